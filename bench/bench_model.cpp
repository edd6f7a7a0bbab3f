// bench_model: the reference model and its attention kernels next to their ceilings, one thread.
//   Sgemm             OpenBLAS sgemm 1024^3: the compute ceiling (GFLOP/s)
//   PrefillAttention  causal prefill over paged KV (small-100m heads): GFLOP/s, ratio to Sgemm
//   StreamRead        a plain read pass over a buffer as large as the decode KV: the bandwidth
//                     ceiling
//   DecodeAttention   one decode step over that KV: GB/s of K and V read, ratio to StreamRead
//   WindowedDecodeAttention  a sliding-window decode step reading the same bytes (the last 4096 of
//                     16384 tokens per sequence): GB/s of the window's K and V, ratio to StreamRead
//                     (blocks in order or scattered over the pool; HND or NHD pages)
//   ModelPrefill / ModelDecode  small-100m unsharded: tokens per second
// Ratios are computed against the ceilings measured earlier in the same run (benchmarks run in
// registration order). Run: build/bench/bench_model [--benchmark_filter=...]
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "kvshard/attention/paged_attention.h"
#include "kvshard/common/large_alloc.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

double g_sgemm_gflops = 0;
double g_stream_gbps = 0;

// small-100m attention geometry
constexpr int kQHeads = 12, kKvHeads = 4, kHeadDim = 64, kBlock = 16;

void fill_random(std::span<float> v, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (auto& x : v) x = u(rng);
}

void BM_Sgemm(benchmark::State& state) {
    set_compute_threads(1);
    const int n = int(state.range(0));
    std::vector<float> a(size_t(n) * n), b(a.size()), c(a.size());
    fill_random(a, 1);
    fill_random(b, 2);
    for (auto _ : state) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.f, a.data(), n, b.data(), n,
                    0.f, c.data(), n);
        benchmark::DoNotOptimize(c.data());
    }
    const double flops = 2.0 * n * n * double(n) * double(state.iterations());
    state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsRate);
}

struct Paged {
    std::unique_ptr<BlockPool> pool;
    PagedKv kv;
};

// batch sequences of len tokens each in one layer; blocks in order, or (scattered) a random
// permutation of the pool's blocks, as a long-running pool hands them out.
Paged make_paged(int batch, int64_t len, bool scattered = false, bool nhd = false) {
    PageGeometry g{.num_layers = 1,
                   .kv_factor = 2,
                   .num_heads = kKvHeads,
                   .block_size = kBlock,
                   .head_dim = kHeadDim,
                   .dtype = DType::kFp32,
                   .order = nhd ? PageOrder::kNhd : PageOrder::kHnd};
    const int64_t per_seq = (len + kBlock - 1) / kBlock;
    std::vector<int32_t> ids(static_cast<size_t>(per_seq * batch));
    std::iota(ids.begin(), ids.end(), 0);
    if (scattered) std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
    Paged p;
    p.pool = std::make_unique<BlockPool>(g, per_seq * batch);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    float* base = reinterpret_cast<float*>(p.pool->arena().data());
    for (size_t i = 0; i < p.pool->arena().size() / 4; ++i) base[i] = u(rng);
    for (int s = 0; s < batch; ++s) {
        const auto first = ids.begin() + s * per_seq;
        p.kv.add_sequence(std::vector<int32_t>(first, first + per_seq), len, kBlock);
    }
    return p;
}

void BM_PrefillAttention(benchmark::State& state) {
    const int64_t len = state.range(0);
    Paged p = make_paged(1, len);
    QueryBatch qb;
    qb.add_sequence(len, 0);
    std::vector<float> q(size_t(len * kQHeads * kHeadDim)), out(q.size());
    fill_random(q, 4);
    const AttentionParams ap{.num_q_heads = kQHeads,
                             .num_kv_heads = kKvHeads,
                             .head_dim = kHeadDim,
                             .scale = 1.f / 8.f,
                             .causal = true};
    for (auto _ : state) {
        paged_attention(*p.pool, 0, p.kv, qb, ap, q.data(), out.data(), nullptr);
        benchmark::DoNotOptimize(out.data());
    }
    // QK^T and PV over the visible keys: 4 * d flops per (query head, visible key).
    const double flops =
        4.0 * kHeadDim * kQHeads * (double(len) * (len + 1) / 2) * double(state.iterations());
    state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsRate);
}

// Eight independent sums kept in registers (the accumulators' address never escapes: with
// DoNotOptimize on the array itself, GCC kept them in memory and the loop ran at half the speed).
float stream_sum(const float* __restrict p, size_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t i = 0; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; ++k) acc[k] += p[i + size_t(k)];
    float s = 0;
    for (float a : acc) s += a;
    return s;
}

void BM_StreamRead(benchmark::State& state) {
    const int64_t bytes = state.range(0);
    // The same kind of memory as the KV pool the decode kernel reads (allocate_large: huge pages).
    const LargeBuffer mem = allocate_large(size_t(bytes));
    const std::span<float> buf(reinterpret_cast<float*>(mem.get()), size_t(bytes / 4));
    fill_random(buf, 5);
    for (auto _ : state) benchmark::DoNotOptimize(stream_sum(buf.data(), buf.size()));
    state.counters["GB/s"] = benchmark::Counter(double(bytes) * double(state.iterations()) * 1e-9,
                                                benchmark::Counter::kIsRate);
}

// One decode step over `batch` sequences of `len` tokens each, the query seeing the last
// `window` of them (0: all); GB/s counts the K and V of the keys it sees.
void decode_step(benchmark::State& state, int batch, int64_t len, int64_t window, bool scattered,
                 bool nhd) {
    Paged p = make_paged(batch, len, scattered, nhd);
    QueryBatch qb;
    for (int s = 0; s < batch; ++s) qb.add_sequence(1, len - 1);
    std::vector<float> q(size_t(batch * kQHeads * kHeadDim)), out(q.size());
    fill_random(q, 6);
    const AttentionParams ap{.num_q_heads = kQHeads,
                             .num_kv_heads = kKvHeads,
                             .head_dim = kHeadDim,
                             .scale = 1.f / 8.f,
                             .causal = true,
                             .window = int(window)};
    for (auto _ : state) {
        paged_attention(*p.pool, 0, p.kv, qb, ap, q.data(), out.data(), nullptr);
        benchmark::DoNotOptimize(out.data());
    }
    const double seen = double(window > 0 ? std::min(window, len) : len);
    const double bytes = double(batch) * seen * 2 * kKvHeads * kHeadDim * 4;
    state.counters["KV_MiB"] = bytes / 1048576.0;
    state.counters["GB/s"] =
        benchmark::Counter(bytes * double(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

void BM_DecodeAttention(benchmark::State& state) {
    decode_step(state, int(state.range(0)), state.range(1), 0, state.range(2) != 0,
                state.range(3) != 0);
}

// One decode step of a sliding-window layer: each sequence holds `len` tokens, the query sees the
// last `window`; only those keys' K and V count as bytes read (the kernel starts at the window's
// first block and never touches the blocks before it).
void BM_WindowedDecodeAttention(benchmark::State& state) {
    decode_step(state, int(state.range(0)), state.range(1), state.range(2), state.range(3) != 0,
                false);
}

// ---- the whole model ----

const ModelWeights& small_weights() {
    static const ModelWeights w = [] {
        const ModelSpec m = catalog_model("small-100m");
        return random_weights(m, WeightShard::full(m), 1);
    }();
    return w;
}

ForwardBatch prefill_batch(int batch, int64_t len, int vocab) {
    ForwardBatch fb;
    const int64_t per_seq = (len + 64 + kBlock - 1) / kBlock;
    for (int s = 0; s < batch; ++s) {
        for (int64_t t = 0; t < len; ++t) {
            fb.token_ids.push_back(int32_t((s * 7919 + t * 31) % vocab));
            fb.slots.push_back(t);
        }
        fb.queries.add_sequence(len, 0);
        std::vector<int32_t> blocks(static_cast<size_t>(per_seq));
        std::iota(blocks.begin(), blocks.end(), int32_t(s * per_seq));
        fb.kv.add_sequence(blocks, len, kBlock);
    }
    return fb;
}

void BM_ModelPrefill(benchmark::State& state) {
    set_compute_threads(1);
    const int batch = int(state.range(0));
    const int64_t len = state.range(1);
    const ModelWeights& w = small_weights();
    RankModel model(w, batch * ((len + 64 + kBlock - 1) / kBlock), kBlock);
    const ForwardBatch fb = prefill_batch(batch, len, w.spec.vocab);
    for (auto _ : state) benchmark::DoNotOptimize(model.forward(fb));
    state.counters["tokens/s"] = benchmark::Counter(
        double(batch * len) * double(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_ModelDecode(benchmark::State& state) {
    set_compute_threads(1);
    const int batch = int(state.range(0));
    const int64_t ctx = state.range(1);
    const ModelWeights& w = small_weights();
    const int64_t per_seq = (ctx + 64 + kBlock - 1) / kBlock;
    RankModel model(w, batch * per_seq, kBlock);
    model.forward(prefill_batch(batch, ctx, w.spec.vocab));
    // Every iteration decodes position ctx again (same KV length each time).
    ForwardBatch fb;
    for (int s = 0; s < batch; ++s) {
        fb.token_ids.push_back(int32_t(s + 1));
        fb.slots.push_back(ctx);
        fb.queries.add_sequence(1, ctx);
        std::vector<int32_t> blocks(static_cast<size_t>(per_seq));
        std::iota(blocks.begin(), blocks.end(), int32_t(s * per_seq));
        fb.kv.add_sequence(blocks, ctx + 1, kBlock);
    }
    for (auto _ : state) benchmark::DoNotOptimize(model.forward(fb));
    state.counters["tokens/s"] =
        benchmark::Counter(double(batch) * double(state.iterations()), benchmark::Counter::kIsRate);
}

// Ceilings first; ratios are printed by the reporter below.
BENCHMARK(BM_Sgemm)->Arg(1024)->Unit(benchmark::kMillisecond)->MinTime(0.5);
BENCHMARK(BM_PrefillAttention)->Arg(512)->Arg(2048)->Unit(benchmark::kMillisecond)->MinTime(0.5);
// KV of the decode case: 8 sequences x 4096 tokens x 4 heads x 64 x K,V x 4 B = 64 MiB
BENCHMARK(BM_StreamRead)->Arg(int64_t{64} << 20)->Unit(benchmark::kMillisecond)->MinTime(0.5);
// Args: batch, tokens per sequence, scattered blocks (0/1), NHD pages (0/1).
BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"batch", "len", "scattered", "nhd"})
    ->Args({8, 4096, 0, 0})
    ->Args({8, 4096, 1, 0})
    ->Args({8, 4096, 1, 1})
    ->Args({1, 256, 0, 0})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);
// Args: batch, tokens per sequence, window, scattered blocks: 64 MiB of windowed K+V read per step
// (the streaming read's size) out of 256 MiB held.
BENCHMARK(BM_WindowedDecodeAttention)
    ->ArgNames({"batch", "len", "window", "scattered"})
    ->Args({8, 16384, 4096, 0})
    ->Args({8, 16384, 4096, 1})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);
BENCHMARK(BM_ModelPrefill)
    ->Args({1, 512})
    ->Args({4, 128})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
BENCHMARK(BM_ModelDecode)
    ->Args({1, 512})
    ->Args({8, 512})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);

// Prints each figure's ratio to its ceiling after the run.
class RatioReporter : public benchmark::ConsoleReporter {
  public:
    void ReportRuns(const std::vector<Run>& runs) override {
        ConsoleReporter::ReportRuns(runs);
        for (const auto& r : runs) {
            const std::string name = r.benchmark_name();
            auto counter = [&](const char* k) {
                auto it = r.counters.find(k);
                return it == r.counters.end() ? 0.0 : double(it->second);
            };
            if (name.rfind("BM_Sgemm", 0) == 0) g_sgemm_gflops = counter("GFLOP/s");
            if (name.rfind("BM_StreamRead", 0) == 0) g_stream_gbps = counter("GB/s");
            if (name.rfind("BM_PrefillAttention", 0) == 0 && g_sgemm_gflops > 0)
                ratios_.push_back(name + ": " + std::to_string(counter("GFLOP/s")) + " GFLOP/s = " +
                                  std::to_string(counter("GFLOP/s") / g_sgemm_gflops) +
                                  " of sgemm (goal >= 0.5)");
            if ((name.rfind("BM_DecodeAttention", 0) == 0 ||
                 name.rfind("BM_WindowedDecodeAttention", 0) == 0) &&
                g_stream_gbps > 0)
                ratios_.push_back(name + ": " + std::to_string(counter("GB/s")) +
                                  " GB/s = " + std::to_string(counter("GB/s") / g_stream_gbps) +
                                  " of the streaming read (goal >= 0.6)");
        }
    }
    void Finalize() override {
        ConsoleReporter::Finalize();
        std::printf("\nsgemm %.2f GFLOP/s, streaming read %.2f GB/s (one thread)\n", g_sgemm_gflops,
                    g_stream_gbps);
        for (const auto& s : ratios_) std::printf("%s\n", s.c_str());
    }

  private:
    std::vector<std::string> ratios_;
};

}  // namespace
}  // namespace kvshard

int main(int argc, char** argv) {
    benchmark::Initialize(&argc, argv);
    kvshard::RatioReporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    benchmark::Shutdown();
    return 0;
}
