// kvshard._kvshard._bench: the C++ side of bench/bench_python.py, so that a Python call and the
// same C++ call are timed in the same process, on the same values and the same memory. Each
// function runs its call `iterations` times in a C++ loop and returns the seconds of this thread's
// CPU time (CLOCK_THREAD_CPUTIME_ID: the machine is shared, descheduled time does not count) per
// call. Not part of the public API (a private submodule, left out of the stubs).
#include <time.h>

#include <cstring>

#include "bindings.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/router/policy.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard::python {

namespace {

double thread_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Keeps a result alive so the loop is not optimized away.
template <class T>
void keep(T const& value) {
    asm volatile("" : : "r"(&value) : "memory");
}

template <class F>
double per_call(int64_t iterations, F&& f) {
    require(iterations >= 1, "iterations must be >= 1, got ", iterations);
    py::gil_scoped_release release;
    const double t0 = thread_seconds();
    for (int64_t i = 0; i < iterations; ++i) f();
    return (thread_seconds() - t0) / static_cast<double>(iterations);
}

std::span<std::byte> bytes_of(py::array& a, const char* what) {
    require(a.flags() & py::array::c_style, what, " must be C-contiguous");
    require(a.writeable(), what, " must be writeable");
    return {static_cast<std::byte*>(a.mutable_data()), static_cast<size_t>(a.nbytes())};
}

}  // namespace

void bind_bench(py::module_& m) {
    auto b = m.def_submodule(
        "_bench",
        "C++ timing loops for bench/bench_python.py (seconds of thread CPU time per call).");
    b.def("thread_seconds", &thread_seconds, "CLOCK_THREAD_CPUTIME_ID of the calling thread.");
    b.def(
        "noop", [] {}, "Does nothing: the floor of a call from Python into the module.");
    b.def(
        "make_layout",
        [](const ModelSpec& model, const ParallelConfig& parallel, int64_t iterations) {
            return per_call(iterations, [&] { keep(make_layout(model, parallel)); });
        },
        py::arg("model"), py::arg("parallel"), py::arg("iterations"));
    b.def(
        "transfer_plan",
        [](const KvLayout& src, const KvLayout& dst, int64_t num_tokens, int64_t iterations) {
            // As kvshard.transfer_plan with its defaults: sequential block tables of 16 tokens,
            // HND pages, built on every call.
            return per_call(iterations, [&] {
                TransferEndpoint s, d;
                s.layout = src;
                s.block_tables = sequential_block_tables(src, 16, num_tokens);
                d.layout = dst;
                d.block_tables = sequential_block_tables(dst, 16, num_tokens);
                keep(make_transfer_plan(s, d, num_tokens));
            });
        },
        py::arg("src"), py::arg("dst"), py::arg("num_tokens"), py::arg("iterations"));
    b.def(
        "route",
        [](Router& router, const py::object& block_hashes, int64_t num_tokens,
           const std::vector<ReplicaLoad>& loads, int64_t iterations) {
            require(static_cast<int>(loads.size()) == router.num_replicas(),
                    "one load per replica is needed");
            const auto hashes = hashes_from(block_hashes);
            return per_call(iterations, [&] {
                keep(router.route({.block_hashes = hashes, .num_tokens = num_tokens}, loads, 0.0));
            });
        },
        py::arg("router"), py::arg("block_hashes"), py::arg("num_tokens"), py::arg("loads"),
        py::arg("iterations"), "Router.route in a C++ loop (hashes parsed once, before the loop).");
    b.def(
        "pack_message",
        [](const TransferPlan& plan, int message, py::array src_pool, py::array out,
           const std::string& mode, int64_t iterations) {
            require(message >= 0 && message < static_cast<int>(plan.messages.size()),
                    "message outside the plan");
            const TransferMessage& msg = plan.messages[static_cast<size_t>(message)];
            const TransferMode mo = resolve_mode(plan, parse_transfer_mode(mode));
            const PageGeometry g = rank_page_geometry(plan.src.layout, msg.src_rank,
                                                      plan.src.block_size, plan.src.order);
            const auto src = bytes_of(src_pool, "src_pool");
            const auto dst = bytes_of(out, "out");
            require(static_cast<int64_t>(dst.size()) == msg.bytes, "out must hold ", msg.bytes,
                    " bytes");
            const BlockPool pool(g, static_cast<int64_t>(src.size()) / g.block_bytes(),
                                 ExternalMemory{src.data(), src.size()});
            return per_call(iterations, [&] { pack_message(plan, msg, mo, pool, dst); });
        },
        py::arg("plan"), py::arg("message"), py::arg("src_pool"), py::arg("out"), py::arg("mode"),
        py::arg("iterations"),
        "pack_message from a 64-byte aligned pool array into `out`, in a C++ loop.");
    b.def(
        "memcpy",
        [](py::array dst, py::array src, int64_t iterations) {
            const auto d = bytes_of(dst, "dst");
            require(src.flags() & py::array::c_style, "src must be C-contiguous");
            require(src.nbytes() == dst.nbytes(), "src and dst must have the same size");
            const void* s = src.data();
            return per_call(iterations, [&] {
                std::memcpy(d.data(), s, d.size());
                keep(d);
            });
        },
        py::arg("dst"), py::arg("src"), py::arg("iterations"),
        "memcpy of src into dst (the physical ceiling of a pack of the same bytes).");
}

}  // namespace kvshard::python
