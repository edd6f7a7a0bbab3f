// Pack and unpack throughput of transfer messages next to memcpy of the same bytes, same run.
//
// Each iteration times pack (or unpack) of one message and a plain memcpy of the same number of
// bytes between buffers of the same sizes, alternating, and reports both rates and their ratio
// (ratio = memcpy time / pack time). Times are the thread's CPU time (the build machine is shared).
// Model: llama-3.1-8b shapes (32 layers, 8 KV heads, head_dim 128, bf16), one request.
#include <benchmark/benchmark.h>

#include <time.h>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvshard/common/large_alloc.h"
#include "kvshard/common/xxh3.h"
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
    std::vector<const TransferMessage*> msgs;  // one message, or a batch (all of one rank's)
    std::vector<LargeBuffer> wire_storage;
    std::vector<std::span<std::byte>> wires;  // allocate_large, like the executor's staging
    std::vector<std::span<std::byte>> outs;
    std::vector<std::span<const std::byte>> ins;
    // The memcpy reference: the same kind of memory as the pools and staging buffers (huge pages).
    LargeBuffer copy_src_mem, copy_dst_mem;
    std::span<std::byte> copy_src, copy_dst;
    int64_t bytes = 0;
};

enum class Batch { kNone, kSource, kDestination };

std::unique_ptr<Setup> make_setup(Batch batch, const std::string& from, const std::string& to,
                                  int bs_from, int bs_to, PageOrder of, PageOrder ot,
                                  int64_t tokens, PoolMemory src_memory = PoolMemory::kPrivate) {
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
    const TransferMessage& first = s->plan.messages.front();
    if (batch == Batch::kNone) s->msgs = {&first};
    for (const auto& m : s->plan.messages)
        if ((batch == Batch::kSource && m.src_rank == first.src_rank) ||
            (batch == Batch::kDestination && m.dst_rank == first.dst_rank))
            s->msgs.push_back(&m);
    const TransferMessage* msg = s->msgs.front();
    const int64_t src_blocks = (tokens + bs_from - 1) / bs_from,
                  dst_blocks = (tokens + bs_to - 1) / bs_to;
    s->src_pool = std::make_unique<BlockPool>(
        rank_page_geometry(s->plan.src.layout, msg->src_rank, bs_from, of), src_blocks, src_memory);
    s->dst_pool = std::make_unique<BlockPool>(
        rank_page_geometry(s->plan.dst.layout, msg->dst_rank, bs_to, ot), dst_blocks);
    auto a = s->src_pool->arena();
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::byte>(i * 131 + 7);
    for (const auto* m : s->msgs) {
        const auto n = static_cast<size_t>(m->bytes);
        s->wire_storage.push_back(allocate_large(n));
        s->wires.emplace_back(s->wire_storage.back().get(), n);
        std::fill(s->wires.back().begin(), s->wires.back().end(), std::byte{1});
        s->bytes += m->bytes;
    }
    for (auto& w : s->wires) {
        s->outs.emplace_back(w);
        s->ins.emplace_back(w);
    }
    s->copy_src_mem = allocate_large(static_cast<size_t>(s->bytes));
    s->copy_dst_mem = allocate_large(static_cast<size_t>(s->bytes));
    s->copy_src = {s->copy_src_mem.get(), static_cast<size_t>(s->bytes)};
    s->copy_dst = {s->copy_dst_mem.get(), static_cast<size_t>(s->bytes)};
    std::fill(s->copy_src.begin(), s->copy_src.end(), std::byte{2});
    std::fill(s->copy_dst.begin(), s->copy_dst.end(), std::byte{3});
    return s;
}

void run(benchmark::State& state, bool pack, bool batched, bool hash, TransferMode mode,
         const std::string& from, const std::string& to, int bs_from, int bs_to, PageOrder of,
         PageOrder ot) {
    const int64_t tokens = state.range(0);
    const Batch batch = !batched ? Batch::kNone : pack ? Batch::kSource : Batch::kDestination;
    auto s = make_setup(batch, from, to, bs_from, bs_to, of, ot, tokens);
    if (!pack)  // payloads to unpack (packed from the one source pool: the bytes do not matter)
        for (size_t m = 0; m < s->msgs.size(); ++m)
            std::fill(s->wires[m].begin(), s->wires[m].end(),
                      std::byte{static_cast<unsigned char>(m + 5)});
    double t_op = 0, t_copy = 0, t_two_pass = 0;
    std::vector<uint64_t> sums(hash ? s->msgs.size() : 0);
    uint64_t sink = 0;
    for (auto _ : state) {
        const double t0 = thread_seconds();
        if (pack)
            pack_messages(s->plan, s->msgs, mode, *s->src_pool, s->outs, sums);
        else
            unpack_messages(s->plan, s->msgs, mode, s->ins, *s->dst_pool, sums);
        const double t1 = thread_seconds();
        std::memcpy(s->copy_dst.data(), s->copy_src.data(), s->copy_dst.size());
        benchmark::ClobberMemory();
        const double t2 = thread_seconds();
        if (hash) {  // the unfused way on plain buffers: memcpy, then XXH3 over the copy
            std::memcpy(s->copy_dst.data(), s->copy_src.data(), s->copy_dst.size());
            sink += xxh3_64(s->copy_dst.data(), s->copy_dst.size());
            t_two_pass += thread_seconds() - t2;
        }
        const double op = t1 - t0;
        t_op += op;
        t_copy += t2 - t1;
        state.SetIterationTime(op);
    }
    benchmark::DoNotOptimize(sink);
    if (hash) {
        state.counters["memcpy_xxh3_GBps"] = static_cast<double>(s->bytes) *
                                             static_cast<double>(state.iterations()) / t_two_pass /
                                             1e9;
        state.counters["ratio_vs_memcpy_xxh3"] = t_two_pass / t_op;
    }
    const double bytes = static_cast<double>(s->bytes) * static_cast<double>(state.iterations());
    state.counters["MiB"] = static_cast<double>(s->bytes) / 1048576.0;
    state.counters["messages"] = static_cast<double>(s->msgs.size());
    state.counters["GBps"] = bytes / t_op / 1e9;
    state.counters["memcpy_GBps"] = bytes / t_copy / 1e9;
    state.counters["ratio"] = t_copy / t_op;
    const CopyCounts cc = count_copies(s->plan, mode);
    state.counters["copies_per_msg"] = static_cast<double>(pack ? cc.pack : cc.unpack) /
                                       static_cast<double>(s->plan.messages.size());
}

// Direct read: copy_direct of one message from the source pool into the destination pool with
// the XXH3 of the bytes read, next to memcpy and memcpy + XXH3 of the same bytes. src_memory: the
// source pool private (huge pages) or shareable (as a destination in another process reads it).
// units: copy_direct_units instead (the source's unit checksums, sealed before the loop, are not
// timed: a prefill computes them as it writes the KV; run_seal below times that).
void run_direct(benchmark::State& state, PoolMemory src_memory, bool units, TransferMode mode,
                const std::string& from, const std::string& to, int bs_from, int bs_to,
                PageOrder of, PageOrder ot) {
    auto s = make_setup(Batch::kNone, from, to, bs_from, bs_to, of, ot, state.range(0), src_memory);
    const TransferMessage& msg = *s->msgs.front();
    uint64_t want = 0;
    if (units) {
        SourceChecksums sums(*s->src_pool);
        for (int l = 0; l < s->src_pool->geometry().num_layers; ++l)
            sums.seal_sequence(l, s->plan.src.block_tables[0], state.range(0));
        const auto u = unit_checksum(s->plan, msg, sums);
        if (!u) {
            state.SkipWithError("the message does not read whole sealed blocks");
            return;
        }
        want = *u;
    }
    const auto arena = s->src_pool->arena();
    const SourceArena src{arena.data(), static_cast<int64_t>(arena.size()),
                          s->src_pool->num_blocks()};
    double t_op = 0, t_copy = 0, t_two_pass = 0;
    uint64_t sink = 0;
    for (auto _ : state) {
        const double t0 = thread_seconds();
        if (units) {
            if (copy_direct_units(s->plan, msg, src, *s->dst_pool) != want) {
                state.SkipWithError("unit checksum mismatch");
                return;
            }
        } else {
            sink += copy_direct(s->plan, msg, mode, src, *s->dst_pool);
        }
        const double t1 = thread_seconds();
        std::memcpy(s->copy_dst.data(), s->copy_src.data(), s->copy_dst.size());
        benchmark::ClobberMemory();
        const double t2 = thread_seconds();
        std::memcpy(s->copy_dst.data(), s->copy_src.data(), s->copy_dst.size());
        sink += xxh3_64(s->copy_dst.data(), s->copy_dst.size());
        t_two_pass += thread_seconds() - t2;
        t_op += t1 - t0;
        t_copy += t2 - t1;
        state.SetIterationTime(t1 - t0);
    }
    benchmark::DoNotOptimize(sink);
    const double bytes = static_cast<double>(s->bytes) * static_cast<double>(state.iterations());
    state.counters["MiB"] = static_cast<double>(s->bytes) / 1048576.0;
    state.counters["GBps"] = bytes / t_op / 1e9;
    state.counters["memcpy_GBps"] = bytes / t_copy / 1e9;
    state.counters["memcpy_xxh3_GBps"] = bytes / t_two_pass / 1e9;
    state.counters["ratio"] = t_copy / t_op;
    state.counters["ratio_vs_memcpy_xxh3"] = t_two_pass / t_op;
}

// What sealing costs a prefill (source_checksums.h): each layer's KV of one TP1 rank written into
// the pool (a memcpy of the layer's pages, as the model's KV write) and then sealed, while it is
// still in cache. Reports the write and the seal rates and seal time / write time.
void run_seal(benchmark::State& state) {
    const int64_t tokens = state.range(0);
    auto s =
        make_setup(Batch::kNone, "tp=1", "tp=1", 16, 16, PageOrder::kHnd, PageOrder::kHnd, tokens);
    BlockPool& pool = *s->src_pool;
    SourceChecksums sums(pool);
    const PageGeometry& g = pool.geometry();
    const auto layer_bytes = static_cast<size_t>(g.kv_factor * pool.num_blocks() * g.page_bytes());
    LargeBuffer fresh = allocate_large(layer_bytes);  // the layer's new KV
    std::fill(fresh.get(), fresh.get() + layer_bytes, std::byte{9});
    double t_write = 0, t_seal = 0;
    for (auto _ : state) {
        for (int l = 0; l < g.num_layers; ++l) {
            const double t0 = thread_seconds();
            std::memcpy(pool.page(l, 0, 0), fresh.get(), layer_bytes);
            benchmark::ClobberMemory();
            const double t1 = thread_seconds();
            sums.seal_sequence(l, s->plan.src.block_tables[0], tokens);
            const double t2 = thread_seconds();
            t_write += t1 - t0;
            t_seal += t2 - t1;
        }
        state.SetIterationTime(t_seal);
    }
    const double bytes =
        static_cast<double>(layer_bytes) * g.num_layers * static_cast<double>(state.iterations());
    state.counters["layer_MiB"] = static_cast<double>(layer_bytes) / 1048576.0;
    state.counters["write_GBps"] = bytes / t_write / 1e9;
    state.counters["seal_GBps"] = bytes / t_seal / 1e9;
    state.counters["seal_vs_write"] = t_seal / t_write;
}

constexpr auto kH = PageOrder::kHnd;
constexpr auto kN = PageOrder::kNhd;
constexpr auto kPre = TransferMode::kPreSend;
constexpr auto kPost = TransferMode::kPostReceive;

// hash: the pack/unpack computes each payload's checksum too (the *_xxh3_* rows below).
#define KVSHARD_TRANSFER_CASE(name, pack, batched, hash, mode, from, to, bsf, bst, of, ot) \
    BENCHMARK_CAPTURE(run, name, pack, batched, hash, mode, from, to, bsf, bst, of, ot)    \
        ->Arg(4096)                                                                        \
        ->UseManualTime()                                                                  \
        ->Unit(benchmark::kMillisecond)                                                    \
        ->MinTime(0.5)
#define KVSHARD_TRANSFER_BENCH(name, pack, batched, mode, from, to, bsf, bst, of, ot) \
    KVSHARD_TRANSFER_CASE(name, pack, batched, false, mode, from, to, bsf, bst, of, ot)

// The seed's example: TP=8 -> TP=4, block 16, HND. One message = one head, all layers, all tokens.
KVSHARD_TRANSFER_BENCH(pack_tp8_tp4_presend, true, false, kPre, "tp=8", "tp=4", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_presend, false, false, kPre, "tp=8", "tp=4", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(pack_tp8_tp4_postrecv, true, false, kPost, "tp=8", "tp=4", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_postrecv, false, false, kPost, "tp=8", "tp=4", 16, 16, kH,
                       kH);
// TP=2 -> TP=8: each message is a quarter of the source pages' heads.
KVSHARD_TRANSFER_BENCH(pack_tp2_tp8_presend, true, false, kPre, "tp=2", "tp=8", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp2_tp8_presend, false, false, kPre, "tp=2", "tp=8", 16, 16, kH, kH);
// Block size 16 -> 64.
KVSHARD_TRANSFER_BENCH(pack_tp8_tp4_bs16_64, true, false, kPre, "tp=8", "tp=4", 16, 64, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_bs16_64, false, false, kPre, "tp=8", "tp=4", 16, 64, kH, kH);
// NHD on both sides (token-major pages: a message's head is a 256-byte run per token).
KVSHARD_TRANSFER_BENCH(pack_tp8_tp4_nhd, true, false, kPre, "tp=8", "tp=4", 16, 16, kN, kN);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_nhd, false, false, kPre, "tp=8", "tp=4", 16, 16, kN, kN);
// Batched: all of one rank's messages in one pass (pack: the source's 4 messages of TP=2 -> TP=8;
// unpack: the destination's 2 messages of TP=8 -> TP=4), which touches each page once, in order.
KVSHARD_TRANSFER_BENCH(pack_tp2_tp8_batched, true, true, kPre, "tp=2", "tp=8", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_batched, false, true, kPre, "tp=8", "tp=4", 16, 16, kH, kH);
KVSHARD_TRANSFER_BENCH(unpack_tp8_tp4_nhd_batched, false, true, kPre, "tp=8", "tp=4", 16, 16, kN,
                       kN);
// HND -> NHD transpose (the reshaping side copies head_dim vectors).
KVSHARD_TRANSFER_BENCH(pack_hnd_to_nhd_presend, true, false, kPre, "tp=2", "tp=2", 16, 16, kH, kN);
KVSHARD_TRANSFER_BENCH(unpack_hnd_to_nhd_presend, false, false, kPre, "tp=2", "tp=2", 16, 16, kH,
                       kN);
// The same pair in post-receive mode: the wire follows the source (HND), the unpack transposes.
KVSHARD_TRANSFER_BENCH(pack_hnd_to_nhd_postrecv, true, false, kPost, "tp=2", "tp=2", 16, 16, kH,
                       kN);
KVSHARD_TRANSFER_BENCH(unpack_hnd_to_nhd_postrecv, false, false, kPost, "tp=2", "tp=2", 16, 16, kH,
                       kN);

// Fused checksum: pack (unpack) computing each payload's XXH3_64 while copying, as the executor
// does; next to memcpy alone and to memcpy followed by an XXH3 pass (the unfused way).
#define KVSHARD_TRANSFER_HASH_BENCH(name, pack, batched, mode, from, to, bsf, bst, of, ot) \
    KVSHARD_TRANSFER_CASE(name, pack, batched, true, mode, from, to, bsf, bst, of, ot)
KVSHARD_TRANSFER_HASH_BENCH(pack_xxh3_tp8_tp4_presend, true, false, kPre, "tp=8", "tp=4", 16, 16,
                            kH, kH);
KVSHARD_TRANSFER_HASH_BENCH(unpack_xxh3_tp8_tp4_presend, false, false, kPre, "tp=8", "tp=4", 16, 16,
                            kH, kH);
KVSHARD_TRANSFER_HASH_BENCH(pack_xxh3_tp2_tp8_batched, true, true, kPre, "tp=2", "tp=8", 16, 16, kH,
                            kH);
KVSHARD_TRANSFER_HASH_BENCH(unpack_xxh3_tp8_tp4_nhd, false, false, kPre, "tp=8", "tp=4", 16, 16, kN,
                            kN);

// Direct read (one copy, checksum fused), from a private and from a shareable source pool.
#define KVSHARD_DIRECT_CASE(name, memory, units, mode, from, to, bsf, bst, of, ot)       \
    BENCHMARK_CAPTURE(run_direct, name, memory, units, mode, from, to, bsf, bst, of, ot) \
        ->Arg(4096)                                                                      \
        ->UseManualTime()                                                                \
        ->Unit(benchmark::kMillisecond)                                                  \
        ->MinTime(0.5)
#define KVSHARD_DIRECT_BENCH(name, memory, mode, from, to, bsf, bst, of, ot) \
    KVSHARD_DIRECT_CASE(name, memory, false, mode, from, to, bsf, bst, of, ot)
constexpr auto kPrivate = PoolMemory::kPrivate;
constexpr auto kShared = PoolMemory::kShareable;
KVSHARD_DIRECT_BENCH(direct_tp1_tp1, kPrivate, kPre, "tp=1", "tp=1", 16, 16, kH, kH);
KVSHARD_DIRECT_BENCH(direct_tp1_tp1_shareable, kShared, kPre, "tp=1", "tp=1", 16, 16, kH, kH);
KVSHARD_DIRECT_BENCH(direct_tp8_tp4_shareable, kShared, kPre, "tp=8", "tp=4", 16, 16, kH, kH);
KVSHARD_DIRECT_BENCH(direct_tp2_tp8_shareable, kShared, kPre, "tp=2", "tp=8", 16, 16, kH, kH);
KVSHARD_DIRECT_BENCH(direct_bs16_64_shareable, kShared, kPre, "tp=1", "tp=1", 16, 64, kH, kH);
KVSHARD_DIRECT_BENCH(direct_hnd_to_nhd_shareable, kShared, kPost, "tp=1", "tp=1", 16, 16, kH, kN);
// The same with unit checksums (copy_direct_units; the mode does not matter to it).
KVSHARD_DIRECT_CASE(direct_units_tp1_tp1, kPrivate, true, kPre, "tp=1", "tp=1", 16, 16, kH, kH);
KVSHARD_DIRECT_CASE(direct_units_tp1_tp1_shareable, kShared, true, kPre, "tp=1", "tp=1", 16, 16, kH,
                    kH);
KVSHARD_DIRECT_CASE(direct_units_tp8_tp4_shareable, kShared, true, kPre, "tp=8", "tp=4", 16, 16, kH,
                    kH);
KVSHARD_DIRECT_CASE(direct_units_tp2_tp8_shareable, kShared, true, kPre, "tp=2", "tp=8", 16, 16, kH,
                    kH);
KVSHARD_DIRECT_CASE(direct_units_bs16_64_shareable, kShared, true, kPre, "tp=1", "tp=1", 16, 64, kH,
                    kH);
KVSHARD_DIRECT_CASE(direct_units_hnd_to_nhd_shareable, kShared, true, kPost, "tp=1", "tp=1", 16, 16,
                    kH, kN);
// Sealing a layer as a prefill writes it.
BENCHMARK(run_seal)->Arg(4096)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);

}  // namespace
}  // namespace kvshard

BENCHMARK_MAIN();
