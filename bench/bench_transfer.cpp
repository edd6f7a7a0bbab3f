// Pack and unpack throughput of transfer messages next to memcpy of the same bytes, same run.
//
// Each iteration times pack (or unpack) of one message and a plain memcpy of the same number of
// bytes between buffers of the same sizes, alternating, and reports both rates and their ratio
// (ratio = memcpy time / pack time). Times are the thread's CPU time (the build machine is shared).
// Model: llama-3.1-8b shapes (32 layers, 8 KV heads, head_dim 128, bf16), one request.
#include <benchmark/benchmark.h>

#include <time.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvshard/model/catalog.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {
namespace {

// CPU time of this thread: the machine is shared, so wall time would count other processes' turns.
double thread_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Setup {
    TransferPlan plan;
    std::unique_ptr<BlockPool> src_pool, dst_pool;
    const TransferMessage* msg = nullptr;
    std::vector<std::byte> wire, copy_src, copy_dst;
};

std::unique_ptr<Setup> make_setup(const std::string& from, const std::string& to, int bs_from,
                                  int bs_to, PageOrder of, PageOrder ot, int64_t tokens) {
    const ModelSpec m = catalog_model("llama-3.1-8b");
    auto endpoint = [&](const std::string& par, int bs, PageOrder o) {
        TransferEndpoint e;
        e.layout = make_layout(m, parse_parallel_config(par));
        e.block_size = bs;
        e.order = o;
        e.block_tables = sequential_block_tables(e.layout, bs, tokens);
        return e;
    };
    auto s = std::make_unique<Setup>();
    s->plan = make_transfer_plan(endpoint(from, bs_from, of), endpoint(to, bs_to, ot), tokens);
    s->msg = &s->plan.messages.front();
    const int64_t src_blocks = (tokens + bs_from - 1) / bs_from,
                  dst_blocks = (tokens + bs_to - 1) / bs_to;
    s->src_pool = std::make_unique<BlockPool>(
        rank_page_geometry(s->plan.src.layout, s->msg->src_rank, bs_from, of), src_blocks);
    s->dst_pool = std::make_unique<BlockPool>(
        rank_page_geometry(s->plan.dst.layout, s->msg->dst_rank, bs_to, ot), dst_blocks);
    auto a = s->src_pool->arena();
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::byte>(i * 131 + 7);
    s->wire.assign(static_cast<size_t>(s->msg->bytes), std::byte{1});
    s->copy_src.assign(s->wire.size(), std::byte{2});
    s->copy_dst.assign(s->wire.size(), std::byte{3});
    return s;
}

void run(benchmark::State& state, bool pack, TransferMode mode, const std::string& from,
         const std::string& to, int bs_from, int bs_to, PageOrder of, PageOrder ot) {
    const int64_t tokens = state.range(0);
    auto s = make_setup(from, to, bs_from, bs_to, of, ot, tokens);
    if (!pack) pack_message(s->plan, *s->msg, mode, *s->src_pool, s->wire);
    double t_op = 0, t_copy = 0;
    for (auto _ : state) {
        const double t0 = thread_seconds();
        if (pack)
            pack_message(s->plan, *s->msg, mode, *s->src_pool, s->wire);
        else
            unpack_message(s->plan, *s->msg, mode, s->wire, *s->dst_pool);
        const double t1 = thread_seconds();
        std::memcpy(s->copy_dst.data(), s->copy_src.data(), s->copy_dst.size());
        benchmark::ClobberMemory();
        const double t2 = thread_seconds();
        const double op = t1 - t0;
        t_op += op;
        t_copy += t2 - t1;
        state.SetIterationTime(op);
    }
    const double bytes =
        static_cast<double>(s->msg->bytes) * static_cast<double>(state.iterations());
    state.counters["MiB"] = static_cast<double>(s->msg->bytes) / 1048576.0;
    state.counters["GBps"] = bytes / t_op / 1e9;
    state.counters["memcpy_GBps"] = bytes / t_copy / 1e9;
    state.counters["ratio"] = t_copy / t_op;
    const CopyCounts cc = count_copies(s->plan, mode);
    state.counters["copies_per_msg"] = static_cast<double>(pack ? cc.pack : cc.unpack) /
                                       static_cast<double>(s->plan.messages.size());
}

constexpr auto kH = PageOrder::kHnd;
constexpr auto kN = PageOrder::kNhd;
constexpr auto kPre = TransferMode::kPreSend;
constexpr auto kPost = TransferMode::kPostReceive;

#define KVSHARD_TRANSFER_BENCH(name, pack, mode, from, to, bsf, bst, of, ot) \
    BENCHMARK_CAPTURE(run, name, pack, mode, from, to, bsf, bst, of, ot)     \
        ->Arg(4096)                                                          \
        ->UseManualTime()                                                    \
        ->Unit(benchmark::kMillisecond)                                      \
        ->MinTime(0.5)

// The seed's example: TP=8 -> TP=4, block 16, HND. One message = one head, all layers, all tokens.
KVSHARD_TRANSFER_BENCH(pack_tp8_tp4_presend, true, kPre, "tp=8", "tp=4", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_presend, false, kPre, "tp=8", "tp=4", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(pack_tp8_tp4_postrecv, true, kPost, "tp=8", "tp=4", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_postrecv, false, kPost, "tp=8", "tp=4", 16, 16, kH, kH);
// TP=2 -> TP=8: each message is a quarter of the source pages' heads.
KVSHARD_TRANSFER_BENCH(pack_tp2_tp8_presend, true, kPre, "tp=2", "tp=8", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp2_tp8_presend, false, kPre, "tp=2", "tp=8", 16, 16, kH, kH);
// Block size 16 -> 64.
KVSHARD_TRANSFER_BENCH(pack_tp8_tp4_bs16_64, true, kPre, "tp=8", "tp=4", 16, 64, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_bs16_64, false, kPre, "tp=8", "tp=4", 16, 64, kH, kH);
// NHD on both sides (token-major pages: a message's head is a 256-byte run per token).
KVSHARD_TRANSFER_BENCH(pack_tp8_tp4_nhd, true, kPre, "tp=8", "tp=4", 16, 16, kN, kN);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_nhd, false, kPre, "tp=8", "tp=4", 16, 16, kN, kN);
// HND -> NHD transpose (the reshaping side copies head_dim vectors).
KVSHARD_TRANSFER_BENCH(pack_hnd_to_nhd_presend, true, kPre, "tp=2", "tp=2", 16, 16, kH, kN);
KVSHARD_TRANSFER_BENCH(unpack_hnd_to_nhd_presend, false, kPre, "tp=2", "tp=2", 16, 16, kH, kN);

}  // namespace
}  // namespace kvshard

BENCHMARK_MAIN();
