// Communicator throughput next to its physical ceiling, measured in the same run.
//
//   ./build/bench_comm [--quick] [--json]
//       threads backend: send/recv (2 ranks) and all_reduce_sum (2 and 4 ranks) vs memcpy of the
//       same bytes in this process.
//   mpirun -np 2 ./build/bench_comm [--quick] [--json]
//       MPI backend: raw MPI_Send/MPI_Recv vs Communicator send/recv of the same bytes, and raw
//       MPI_Allreduce vs the Communicator's deterministic all_reduce_sum, alternating in one run.
//
// Every figure is the best of several repetitions (least disturbed by other load). GB/s = 1e9
// bytes per second of payload. all_reduce GB/s is "algorithm bandwidth": payload bytes per rank
// divided by the time of one all-reduce.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvshard/comm/communicator.h"
#include "kvshard/comm/mpi.h"
#include "kvshard/comm/threads.h"

using namespace kvshard;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
    bool quick = false;
    bool json = false;
};

std::vector<std::size_t> sizes(const Options& o) {
    if (o.quick) return {4 << 10, 1 << 20, 16 << 20};
    return {4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
}

// Enough iterations for ~64 MiB of traffic per repetition, at least 5.
int iterations(std::size_t bytes, const Options& o) {
    const std::size_t budget = o.quick ? (16u << 20) : (64u << 20);
    return static_cast<int>(std::clamp<std::size_t>(budget / bytes, 5, 2000));
}
constexpr int kReps = 5;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

double gbps(std::size_t bytes, int iters, double secs) {
    return static_cast<double>(bytes) * iters / secs / 1e9;
}

std::string human(std::size_t b) {
    if (b >= (1u << 20)) return std::to_string(b >> 20) + " MiB";
    if (b >= (1u << 10)) return std::to_string(b >> 10) + " KiB";
    return std::to_string(b) + " B";
}

struct Timing {
    double op = 1e30;      // best seconds per operation
    double memcpy = 1e30;  // best seconds per memcpy of the same bytes, measured between the reps
};

// One memcpy of `bytes` between two warm buffers, `iters` times; seconds per copy.
double memcpy_seconds(std::vector<std::byte>& a, std::vector<std::byte>& b, int iters) {
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
        std::memcpy(b.data(), a.data(), a.size());
        benchmark::ClobberMemory();
    }
    benchmark::DoNotOptimize(b.data());
    return seconds_since(t0) / iters;
}

// Runs `op` on `world` threads; rank 0 times the memcpy ceiling before each repetition (while the
// other ranks wait), so both figures see the same machine load.
Timing time_threads(int world, std::size_t bytes, int iters,
                    const std::function<void(Communicator&)>& op) {
    Timing t;
    std::vector<std::byte> a(bytes, std::byte{1}), b(bytes, std::byte{2});
    run_threads(world, [&](Communicator& c) {
        for (int rep = 0; rep < kReps; ++rep) {
            if (c.rank() == 0) t.memcpy = std::min(t.memcpy, memcpy_seconds(a, b, iters));
            c.barrier();
            auto t0 = Clock::now();
            for (int i = 0; i < iters; ++i) op(c);
            c.barrier();
            if (c.rank() == 0) t.op = std::min(t.op, seconds_since(t0) / iters);
        }
    });
    return t;
}

// Threads backend: rank 0 streams messages to rank 1 (a rendezvous each: one memcpy per message).
Timing threads_sendrecv(std::size_t bytes, int iters) {
    std::vector<std::vector<std::byte>> bufs(2, std::vector<std::byte>(bytes, std::byte{3}));
    return time_threads(2, bytes, iters, [&](Communicator& c) {
        if (c.rank() == 0)
            c.send(bufs[0], 1, 0);
        else
            c.recv(bufs[1], 0, 0);
    });
}

Timing threads_allreduce(int world, std::size_t bytes, int iters) {
    std::vector<std::vector<float>> bufs(world, std::vector<float>(bytes / sizeof(float), 1.0f));
    return time_threads(world, bytes, iters,
                        [&](Communicator& c) { c.all_reduce_sum(bufs[c.rank()]); });
}

int run_threads_bench(const Options& o) {
    nlohmann::json out = nlohmann::json::array();
    if (!o.json)
        std::printf("%-10s %-22s %10s %10s %8s\n", "bytes", "operation", "GB/s", "memcpy", "ratio");
    for (std::size_t bytes : sizes(o)) {
        const int iters = iterations(bytes, o);
        auto report = [&](const std::string& op, Timing t) {
            const double g = gbps(bytes, 1, t.op), gm = gbps(bytes, 1, t.memcpy);
            if (o.json) {
                out.push_back({{"backend", "threads"},
                               {"op", op},
                               {"bytes", bytes},
                               {"gbps", g},
                               {"memcpy_gbps", gm},
                               {"ratio", g / gm}});
            } else {
                std::printf("%-10s %-22s %10.2f %10.2f %8.2f\n", human(bytes).c_str(), op.c_str(),
                            g, gm, g / gm);
            }
        };
        report("send/recv (2 ranks)", threads_sendrecv(bytes, iters));
        report("all_reduce_sum (2)", threads_allreduce(2, bytes, iters));
        report("all_reduce_sum (4)", threads_allreduce(4, bytes, iters));
    }
    if (o.json) std::printf("%s\n", out.dump(2).c_str());
    return 0;
}

// ---- MPI ----

// Rank 0 streams `iters` messages to rank 1, which acknowledges the last; `raw` picks MPI_Send/
// MPI_Recv on MPI_COMM_WORLD or the Communicator's send/recv. Returns rank 0's seconds per message.
double mpi_stream_seconds(Communicator& c, bool raw, std::vector<std::byte>& buf, int iters) {
    const int me = c.rank();
    const int n = static_cast<int>(buf.size());
    c.barrier();
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
        if (raw) {
            if (me == 0)
                MPI_Send(buf.data(), n, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
            else if (me == 1)
                MPI_Recv(buf.data(), n, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
            if (me == 0)
                c.send(buf, 1, 0);
            else if (me == 1)
                c.recv(buf, 0, 0);
        }
    }
    if (me == 0)
        c.recv(std::span<std::byte>(), 1, 1);
    else if (me == 1)
        c.send(std::span<const std::byte>(), 0, 1);
    return seconds_since(t0) / iters;
}

double mpi_allreduce_seconds(Communicator& c, bool raw, std::vector<float>& v, int iters) {
    c.barrier();
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
        if (raw)
            MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_FLOAT, MPI_SUM,
                          MPI_COMM_WORLD);
        else
            c.all_reduce_sum(v);
    }
    c.barrier();
    return seconds_since(t0) / iters;
}

int run_mpi_bench(const Options& o) {
    auto world = mpi_world();
    Communicator& c = *world;
    const bool root = c.rank() == 0;
    nlohmann::json out = nlohmann::json::array();
    if (root && !o.json)
        std::printf("%d MPI ranks\n%-10s %-16s %12s %12s %8s\n", c.size(), "bytes", "operation",
                    "raw GB/s", "comm GB/s", "ratio");
    for (std::size_t bytes : sizes(o)) {
        const int iters = iterations(bytes, o);
        auto report = [&](const char* op, double raw_t, double comm_t) {
            if (!root) return;
            const double gr = gbps(bytes, 1, raw_t), gc = gbps(bytes, 1, comm_t);
            if (o.json) {
                out.push_back({{"backend", "mpi"},
                               {"ranks", c.size()},
                               {"op", op},
                               {"bytes", bytes},
                               {"raw_gbps", gr},
                               {"comm_gbps", gc},
                               {"ratio", gc / gr}});
            } else {
                std::printf("%-10s %-16s %12.2f %12.2f %8.2f\n", human(bytes).c_str(), op, gr, gc,
                            gc / gr);
            }
        };
        {
            std::vector<std::byte> buf(bytes, std::byte{5});
            double raw = 1e30, comm = 1e30;
            for (int rep = 0; rep < 2 * kReps; ++rep) {  // alternate, so both see the same load
                const bool raw_first = rep % 2 == 0;
                double& first = raw_first ? raw : comm;
                double& second = raw_first ? comm : raw;
                first = std::min(first, mpi_stream_seconds(c, raw_first, buf, iters));
                second = std::min(second, mpi_stream_seconds(c, !raw_first, buf, iters));
            }
            report("send/recv", raw, comm);
        }
        {
            std::vector<float> v(bytes / sizeof(float), 1.0f);
            double raw = 1e30, comm = 1e30;
            for (int rep = 0; rep < 2 * kReps; ++rep) {
                const bool raw_first = rep % 2 == 0;
                double& first = raw_first ? raw : comm;
                double& second = raw_first ? comm : raw;
                first = std::min(first, mpi_allreduce_seconds(c, raw_first, v, iters));
                second = std::min(second, mpi_allreduce_seconds(c, !raw_first, v, iters));
            }
            report("all_reduce_sum", raw, comm);
        }
    }
    if (root && o.json) std::printf("%s\n", out.dump(2).c_str());
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--quick") {
            o.quick = true;
        } else if (a == "--json") {
            o.json = true;
        } else {
            std::fprintf(stderr,
                         "usage: bench_comm [--quick] [--json]\n"
                         "  alone: threads backend vs memcpy; under `mpirun -np 2`: MPI backend vs "
                         "raw MPI\n");
            return a == "--help" || a == "-h" ? 0 : 2;
        }
    }
    if (!under_mpirun() || mpirun_world_size() < 2) return run_threads_bench(o);
    MpiSession mpi(&argc, &argv);
    return run_mpi_bench(o);
}
