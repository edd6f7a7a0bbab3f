// The CUDA backend's kernels next to the device's own ceilings, same run (a GPU machine only).
//
//   bench_cuda [--reps 10] [--quick] [--sweep]
//
// Prints one JSON line per figure: the kernel's time and rate next to cudaMemcpy device-to-device
// of the same bytes (median over --reps, CUDA events), and their ratio (memcpy time / kernel
// time):
//  - pack / unpack / direct: the seed's TP=8 -> TP=4 case (llama-3.1-70b, bf16, HND, block 16: one
//    source rank's message, 1 GiB) and HND -> NHD (llama-3.1-70b TP=1 -> TP=1, 1 GiB), one kernel
//    launch per message;
//  - decode: paged decode attention with LSE at batch 64 x 32K tokens (llama-3.1-8b's 32 query /
//    8 KV heads, and one llama-3.1-70b TP=8 rank's 8 query / 1 KV head; bf16, block 16, shuffled
//    block tables), its KV bytes read per second next to the copy's DRAM traffic (bytes read +
//    written per second of the same cudaMemcpy).
// --quick: 1/8 of the sizes (a smoke run). --sweep: the decode figures also at fixed chunk sizes
// (the plan's choice is chunk_tokens 0).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvshard/cuda/attention.h"
#include "kvshard/cuda/copy.h"
#include "kvshard/cuda/device.h"
#include "kvshard/model/catalog.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {
namespace {

void ck(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "bench_cuda: %s: %s\n", what, cudaGetErrorString(e));
        std::exit(1);
    }
}

// Median milliseconds of `reps` runs of f (after one warm-up), timed with CUDA events.
template <typename F>
double median_ms(int reps, F&& f) {
    cudaEvent_t a, b;
    ck(cudaEventCreate(&a), "event");
    ck(cudaEventCreate(&b), "event");
    f();
    ck(cudaDeviceSynchronize(), "warm-up");
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
        ck(cudaEventRecord(a), "record");
        f();
        ck(cudaEventRecord(b), "record");
        ck(cudaEventSynchronize(b), "sync");
        float ms = 0;
        ck(cudaEventElapsedTime(&ms, a, b), "elapsed");
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return t[t.size() / 2];
}

double memcpy_ms(int64_t bytes, int reps) {
    cuda::DeviceBuffer x(bytes), y(bytes);
    x.fill(1);
    return median_ms(reps, [&] {
        ck(cudaMemcpyAsync(y.data(), x.data(), static_cast<size_t>(bytes),
                           cudaMemcpyDeviceToDevice),
           "memcpy");
    });
}

void print_copy(const char* name, const char* kind, const cuda::DeviceCopyProgram& prog, double ms,
                double ref_ms) {
    const double gbps = static_cast<double>(prog.bytes()) / (ms * 1e-3) / 1e9;
    const double ref = static_cast<double>(prog.bytes()) / (ref_ms * 1e-3) / 1e9;
    std::printf(
        "{\"bench\": \"%s\", \"kernel\": \"%s\", \"bytes\": %lld, \"entries\": %lld, \"ms\": "
        "%.3f, \"GBps\": %.1f, \"memcpy_ms\": %.3f, \"memcpy_GBps\": %.1f, \"ratio\": %.3f}\n",
        name, kind, static_cast<long long>(prog.bytes()), static_cast<long long>(prog.entries()),
        ms, gbps, ref_ms, ref, ref_ms / ms);
    std::fflush(stdout);
}

TransferEndpoint endpoint(const ModelSpec& m, const std::string& par, PageOrder o, int64_t tokens) {
    TransferEndpoint e;
    e.layout = make_layout(m, parse_parallel_config(par));
    e.block_size = 16;
    e.order = o;
    e.block_tables = sequential_block_tables(e.layout, 16, tokens);
    return e;
}

// Pack, unpack and (for one page order) the direct pool-to-pool read of the first message of
// source rank 0, each one launch, next to cudaMemcpy of its bytes.
void bench_transfer(const char* name, const std::string& from, const std::string& to, PageOrder of,
                    PageOrder ot, int64_t tokens, int reps) {
    const ModelSpec m = catalog_model("llama-3.1-70b");
    const auto se = endpoint(m, from, of, tokens), de = endpoint(m, to, ot, tokens);
    const TransferPlan plan = make_transfer_plan(se, de, tokens);
    const TransferMessage& msg = plan.messages[static_cast<size_t>(plan.messages_from(0).front())];
    const int64_t sblocks = static_cast<int64_t>(se.block_tables[0].size());
    const int64_t dblocks = static_cast<int64_t>(de.block_tables[0].size());
    const PageGeometry sg = rank_page_geometry(se.layout, msg.src_rank, 16, of);
    const PageGeometry dg = rank_page_geometry(de.layout, msg.dst_rank, 16, ot);
    cuda::DevicePool sp(sg, sblocks), dp(dg, dblocks);
    cuda::DeviceBuffer staging(msg.bytes);
    ck(cudaMemset(sp.data(), 0x3c, static_cast<size_t>(sp.arena_bytes())), "memset");
    const double ref = memcpy_ms(msg.bytes, reps);
    for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive}) {
        const std::string label = std::string(name) + " " + std::string(transfer_mode_name(mode));
        const cuda::DeviceCopyProgram pack(
            cuda::pack_entries(message_copy_runs(plan, msg, mode, true, sg, sblocks)));
        const cuda::DeviceCopyProgram unpack(
            cuda::unpack_entries(message_copy_runs(plan, msg, mode, false, dg, dblocks)));
        print_copy(label.c_str(), "pack", pack,
                   median_ms(reps, [&] { pack.run(sp.data(), staging.data()); }), ref);
        print_copy(label.c_str(), "unpack", unpack,
                   median_ms(reps, [&] { unpack.run(staging.data(), dp.data()); }), ref);
    }
    const PoolRegion sr{{sg, sblocks}, 0}, dr{{dg, dblocks}, 0};
    const int index = plan.messages_from(0).front();
    const cuda::DeviceCopyProgram direct(
        cuda::direct_entries(message_descriptors(plan, index, sr, dr)));
    print_copy(name, "direct", direct, median_ms(reps, [&] { direct.run(sp.data(), dp.data()); }),
               ref);
}

void bench_decode(const char* name, int hq, int hkv, int batch, int64_t len, PageOrder order,
                  int reps, double copy_traffic_gbps, int chunk_tokens = 0) {
    PageGeometry g;
    g.num_layers = 1;
    g.kv_factor = 2;
    g.num_heads = hkv;
    g.block_size = 16;
    g.head_dim = 128;
    g.dtype = DType::kBf16;
    g.order = order;
    const int64_t per_seq = (len + 15) / 16;
    const int64_t blocks = per_seq * batch;
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937_64 rng(1);
    std::shuffle(ids.begin(), ids.end(), rng);
    PagedKv kv;
    for (int b = 0; b < batch; ++b)
        kv.add_sequence(
            std::vector<int32_t>(ids.begin() + b * per_seq, ids.begin() + (b + 1) * per_seq), len,
            16);
    cuda::DevicePool pool(g, blocks);
    ck(cudaMemset(pool.data(), 0x3c, static_cast<size_t>(pool.arena_bytes())), "memset");
    cuda::DeviceDecode plan(kv, g, blocks, {hq, hkv, 128, 1.0f / std::sqrt(128.0f)}, chunk_tokens);
    std::vector<float> q(static_cast<size_t>(batch) * hq * 128);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : q) v = nd(rng);
    cuda::DeviceBuffer dq(static_cast<int64_t>(q.size() * 4)), dout(dq.size()),
        dlse(int64_t{batch} * hq * 4);
    dq.upload(std::as_bytes(std::span<const float>(q)));
    const double ms = median_ms(reps, [&] {
        plan.run(pool, 0, reinterpret_cast<const float*>(dq.data()),
                 reinterpret_cast<float*>(dout.data()), reinterpret_cast<float*>(dlse.data()));
    });
    const double gbps = static_cast<double>(plan.kv_bytes()) / (ms * 1e-3) / 1e9;
    std::printf(
        "{\"bench\": \"%s\", \"kernel\": \"decode\", \"batch\": %d, \"tokens\": %lld, \"q_heads\": "
        "%d, \"kv_heads\": %d, \"order\": \"%s\", \"kv_bytes\": %lld, \"chunk_tokens\": %d, "
        "\"work_items\": %lld, \"ms\": %.3f, \"GBps\": %.1f, \"copy_traffic_GBps\": %.1f, "
        "\"ratio\": %.3f}\n",
        name, batch, static_cast<long long>(len), hq, hkv, order == PageOrder::kHnd ? "hnd" : "nhd",
        static_cast<long long>(plan.kv_bytes()), plan.chunk_tokens(),
        static_cast<long long>(plan.work_items()), ms, gbps, copy_traffic_gbps,
        gbps / copy_traffic_gbps);
    std::fflush(stdout);
}

}  // namespace
}  // namespace kvshard

int main(int argc, char** argv) {
    using namespace kvshard;
    int reps = 10;
    bool quick = false, sweep = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--reps" && i + 1 < argc) {
            reps = std::max(1, std::atoi(argv[++i]));
        } else if (a == "--quick") {
            quick = true;
        } else if (a == "--sweep") {
            sweep = true;
        } else {
            std::fprintf(stderr, "usage: bench_cuda [--reps N] [--quick] [--sweep]\n");
            return 2;
        }
    }
    if (!cuda::device_available()) {
        std::printf("{\"skipped\": \"no CUDA device present\"}\n");
        return 0;
    }
    std::printf("{\"device\": \"%s\", \"reps\": %d}\n", cuda::device_description().c_str(), reps);
    const int64_t gib = int64_t{1} << 30;
    const int64_t div = quick ? 8 : 1;
    // The copy ceiling of the decode figures: DRAM traffic (read + write) of a 1 GiB copy.
    const double copy_ms = memcpy_ms(gib / div, reps);
    const double traffic = 2.0 * static_cast<double>(gib / div) / (copy_ms * 1e-3) / 1e9;
    std::printf(
        "{\"bench\": \"memcpy\", \"bytes\": %lld, \"ms\": %.3f, \"GBps\": %.1f, "
        "\"traffic_GBps\": %.1f}\n",
        static_cast<long long>(gib / div), copy_ms, traffic / 2, traffic);
    // One TP=8 source rank of llama-3.1-70b holds 40,960 B per token (80 layers, K and V, one
    // head of 128 bf16): 26,214 tokens are 1 GiB. TP=1 holds 327,680 B: 3,276 tokens.
    bench_transfer("tp8->tp4 hnd", "tp=8", "tp=4", PageOrder::kHnd, PageOrder::kHnd, 26214 / div,
                   reps);
    bench_transfer("tp1 hnd->nhd", "tp=1", "tp=1", PageOrder::kHnd, PageOrder::kNhd, 3276 / div,
                   reps);
    bench_decode("llama-3.1-8b", 32, 8, 64, 32768 / div, PageOrder::kHnd, reps, traffic);
    bench_decode("llama-3.1-8b", 32, 8, 64, 32768 / div, PageOrder::kNhd, reps, traffic);
    bench_decode("llama-3.1-70b tp8 rank", 8, 1, 64, 32768 / div, PageOrder::kHnd, reps, traffic);
    if (sweep) {
        for (int c : {1024, 2048, 4096, 8192, 16384})
            bench_decode("llama-3.1-8b", 32, 8, 64, 32768 / div, PageOrder::kHnd, reps, traffic, c);
        for (int c : {256, 1024, 2048, 4096, 8192})
            bench_decode("llama-3.1-70b tp8 rank", 8, 1, 64, 32768 / div, PageOrder::kHnd, reps,
                         traffic, c);
    }
    return 0;
}
