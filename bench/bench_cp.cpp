// Context parallelism: (1) per-rank causal attention work, contiguous vs zigzag vs interleave
// (max/mean of per-rank FLOPs from the plan, and of measured per-rank kernel time); (2) the decode
// merge next to the decode attention it merges. Ceiling in the same run: OpenBLAS sgemm FLOP/s
// (what the attention kernel could reach) and memcpy bandwidth (what the merge could reach).
//   build/bench/bench_cp --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kvshard/attention/merge.h"
#include "kvshard/exec/cp_attention.h"
#include "kvshard/exec/cp_plan.h"

namespace kvshard {
namespace {

std::vector<float> random_floats(size_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng);
    return v;
}

ParallelConfig cp_cfg(int cp, CpScheme s) {
    ParallelConfig p;
    p.cp = cp;
    p.cp_scheme = s;
    p.cp_interleave = 16;
    return p;
}

// sgemm FLOP/s on an m x k x n product: the compute ceiling of this machine.
double sgemm_flops_per_s() {
    static double rate = [] {
        const int n = 512;
        auto a = random_floats(n * n, 1), b = random_floats(n * n, 2);
        std::vector<float> c(n * n);
        double best = 0;
        for (int rep = 0; rep < 5; ++rep) {
            const auto t0 = std::chrono::steady_clock::now();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n,
                        b.data(), n, 0.0f, c.data(), n);
            const double s =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            best = std::max(best, 2.0 * n * n * n / s);
        }
        return best;
    }();
    return rate;
}

double memcpy_bytes_per_s() {
    static double rate = [] {
        const size_t n = size_t{64} << 20;
        std::vector<char> a(n, 1), b(n);
        double best = 0;
        for (int rep = 0; rep < 5; ++rep) {
            const auto t0 = std::chrono::steady_clock::now();
            std::memcpy(b.data(), a.data(), n);
            benchmark::DoNotOptimize(b.data());
            const double s =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            best = std::max(best, 2.0 * n / s);  // read + write
        }
        return best;
    }();
    return rate;
}

// Per-rank causal attention of a full prefill of n tokens: plan FLOPs and measured kernel time.
// args: scheme, cp, n
void BM_CpPrefillBalance(benchmark::State& state) {
    const auto scheme = static_cast<CpScheme>(state.range(0));
    const int cp = static_cast<int>(state.range(1));
    const int64_t n = state.range(2);
    const CpAttnShape shape{4, 1, 64, 0.125f};
    const auto map = cp_prompt_map(cp_cfg(cp, scheme), n);
    const auto q = random_floats(n * shape.num_q_heads * shape.head_dim, 3);
    const auto k = random_floats(n * shape.num_kv_heads * shape.head_dim, 4);
    const auto v = random_floats(n * shape.num_kv_heads * shape.head_dim, 5);
    std::vector<int64_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    std::vector<std::vector<int64_t>> qpos(cp);
    std::vector<std::vector<float>> qr(cp);
    const int64_t row = int64_t{shape.num_q_heads} * shape.head_dim;
    for (int c = 0; c < cp; ++c) {
        qpos[c] = map.positions(c);
        for (int64_t p : qpos[c])
            qr[c].insert(qr[c].end(), q.begin() + p * row, q.begin() + (p + 1) * row);
    }
    std::vector<double> secs(cp, 0.0);
    std::vector<float> out(n * row), lse(n * shape.num_q_heads);
    for (auto _ : state) {
        for (int c = 0; c < cp; ++c) {
            const auto t0 = std::chrono::steady_clock::now();
            cp_partial_attention(shape, qr[c].data(), qpos[c], k.data(), v.data(), all, out.data(),
                                 lse.data());
            secs[c] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            benchmark::DoNotOptimize(out.data());
        }
    }
    const auto pairs = cp_causal_pairs(map);
    const double total = std::accumulate(pairs.begin(), pairs.end(), 0.0);
    const double flops_per_pair = 4.0 * shape.num_q_heads * shape.head_dim;
    state.counters["flops_max_over_mean"] =
        *std::max_element(pairs.begin(), pairs.end()) / (total / cp);
    const double tsum = std::accumulate(secs.begin(), secs.end(), 0.0);
    state.counters["time_max_over_mean"] =
        *std::max_element(secs.begin(), secs.end()) / (tsum / cp);
    const double rate = total * flops_per_pair * state.iterations() / tsum;
    state.counters["attn_GFLOPs"] = rate / 1e9;
    state.counters["sgemm_GFLOPs"] = sgemm_flops_per_s() / 1e9;
    state.counters["attn_over_sgemm"] = rate / sgemm_flops_per_s();
    state.SetLabel(std::string(cp_scheme_name(scheme)));
}
BENCHMARK(BM_CpPrefillBalance)
    ->ArgNames({"scheme", "cp", "n"})
    ->ArgsProduct({{int(CpScheme::kContiguous), int(CpScheme::kZigzag), int(CpScheme::kInterleave)},
                   {2, 4, 8},
                   {2048}})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

// Decode of one token over a context of n tokens split over cp ranks: the partial attention of one
// rank (n / cp keys, the critical path), and the merge of the cp partials (every query head).
// args: cp, n
void BM_CpDecodeMerge(benchmark::State& state) {
    const int cp = static_cast<int>(state.range(0));
    const int64_t n = state.range(1);
    const CpAttnShape shape{32, 8, 128, 1.0f / std::sqrt(128.0f)};
    const int64_t shard = n / cp;
    const auto q = random_floats(shape.num_q_heads * shape.head_dim, 6);
    const auto k = random_floats(shard * shape.num_kv_heads * shape.head_dim, 7);
    const auto v = random_floats(shard * shape.num_kv_heads * shape.head_dim, 8);
    std::vector<int64_t> kp(shard);
    std::iota(kp.begin(), kp.end(), 0);
    const std::vector<int64_t> qp = {n};
    const int64_t rows = shape.num_q_heads;
    std::vector<std::vector<float>> po(cp, std::vector<float>(rows * shape.head_dim)),
        pl(cp, std::vector<float>(rows));
    std::vector<float> out(rows * shape.head_dim), lse(rows);
    double attn_s = 0, merge_s = 0;
    for (auto _ : state) {
        auto t0 = std::chrono::steady_clock::now();
        cp_partial_attention(shape, q.data(), qp, k.data(), v.data(), kp, po[0].data(),
                             pl[0].data());
        auto t1 = std::chrono::steady_clock::now();
        for (int c = 1; c < cp; ++c) {  // stand-ins for the other ranks' partials
            po[c] = po[0];
            pl[c] = pl[0];
            for (auto& x : pl[c]) x -= 0.1f * c;
        }
        std::vector<const float*> outs, lses;
        for (int c = 0; c < cp; ++c) {
            outs.push_back(po[c].data());
            lses.push_back(pl[c].data());
        }
        auto t2 = std::chrono::steady_clock::now();
        merge_attention(outs, lses, rows, shape.head_dim, out.data(), lse.data());
        auto t3 = std::chrono::steady_clock::now();
        benchmark::DoNotOptimize(out.data());
        attn_s += std::chrono::duration<double>(t1 - t0).count();
        merge_s += std::chrono::duration<double>(t3 - t2).count();
    }
    const double it = static_cast<double>(state.iterations());
    state.counters["attn_us"] = attn_s / it * 1e6;
    state.counters["merge_us"] = merge_s / it * 1e6;
    state.counters["merge_over_attn"] = merge_s / attn_s;
    // merge ceiling: reading cp partials + writing one at memcpy speed
    const double merge_bytes = (cp + 1.0) * rows * (shape.head_dim + 1) * 4;
    state.counters["merge_GBps"] = merge_bytes / (merge_s / it) / 1e9;
    state.counters["memcpy_GBps"] = memcpy_bytes_per_s() / 1e9;
    const double attn_bytes = 2.0 * shard * shape.num_kv_heads * shape.head_dim * 4;
    state.counters["attn_GBps"] = attn_bytes / (attn_s / it) / 1e9;
}
BENCHMARK(BM_CpDecodeMerge)
    ->ArgNames({"cp", "n"})
    ->ArgsProduct({{2, 4, 8}, {32768}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvshard

BENCHMARK_MAIN();
