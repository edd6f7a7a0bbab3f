// Context parallelism: (1) per-rank causal attention work, contiguous vs zigzag vs interleave
// (max/mean of per-rank FLOPs from the plan, and of measured per-rank kernel time); (2) the decode
// merge next to the decode attention it merges. Ceiling in the same run: OpenBLAS sgemm FLOP/s
// (what the attention kernel could reach) and memcpy bandwidth (what the merge could reach).
// (3) batched CP decode of a model (CpSession, threads backend) next to the same batch on the plain
// executor (one RankModel, no CP) in the same run, with the share of the step spent in the merge.
//   build/bench/bench_cp --benchmark_counters_tabular=true
// Per-rank work is timed in thread CPU time; the threads decode step in wall time (it waits).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <vector>

#include "kvshard/attention/merge.h"
#include "kvshard/comm/threads.h"
#include "kvshard/exec/cp_attention.h"
#include "kvshard/exec/cp_ring.h"
#include "kvshard/exec/cp_session.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

// CPU time of the calling thread: per-rank work measured this way is not inflated by other
// processes sharing the cores (wall time is, on a loaded machine).
double thread_cpu_s() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

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
        openblas_set_num_threads(1);  // one core, like one rank's attention kernel
        const int n = 512;
        auto a = random_floats(n * n, 1), b = random_floats(n * n, 2);
        std::vector<float> c(n * n);
        double best = 0;
        for (int rep = 0; rep < 5; ++rep) {
            const double t0 = thread_cpu_s();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n,
                        b.data(), n, 0.0f, c.data(), n);
            const double s = thread_cpu_s() - t0;
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
            const double t0 = thread_cpu_s();
            std::memcpy(b.data(), a.data(), n);
            benchmark::DoNotOptimize(b.data());
            const double s = thread_cpu_s() - t0;
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
            const double t0 = thread_cpu_s();
            cp_partial_attention(shape, qr[c].data(), qpos[c], k.data(), v.data(), all, out.data(),
                                 lse.data());
            secs[c] += thread_cpu_s() - t0;
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
        const double t0 = thread_cpu_s();
        cp_partial_attention(shape, q.data(), qp, k.data(), v.data(), kp, po[0].data(),
                             pl[0].data());
        const double t1 = thread_cpu_s();
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
        const double t2 = thread_cpu_s();
        merge_attention(outs, lses, rows, shape.head_dim, out.data(), lse.data());
        const double t3 = thread_cpu_s();
        benchmark::DoNotOptimize(out.data());
        attn_s += t1 - t0;
        merge_s += t3 - t2;
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

// Decode of one token over a context of n tokens on cp ranks (threads backend): per rank, the
// partial attention over its n / cp keys, then the exchange + merge (all-gather or Helix
// all-to-all). Ceiling of the exchange: a raw all_gather of the same bytes on the same
// communicator. args: merge (0 all-gather, 1 all-to-all), cp, n
void BM_CpDecodeStepThreads(benchmark::State& state) {
    const auto merge = static_cast<CpDecodeMerge>(state.range(0));
    const int cp = static_cast<int>(state.range(1));
    const int64_t n = state.range(2);
    const CpAttnShape shape{32, 8, 128, 1.0f / std::sqrt(128.0f)};
    const int64_t shard = n / cp;
    const auto q = random_floats(shape.num_q_heads * shape.head_dim, 6);
    const auto k = random_floats(shard * shape.num_kv_heads * shape.head_dim, 7);
    const auto v = random_floats(shard * shape.num_kv_heads * shape.head_dim, 8);
    const int64_t rows = shape.num_q_heads;
    double attn_s = 0, merge_s = 0, raw_s = 0;
    int64_t iters = 0;
    for (auto _ : state) {
        const int reps = 5;
        std::vector<double> a(cp), m(cp), r(cp);
        run_threads(cp, [&](Communicator& w) {
            const int c = w.rank();
            std::vector<int64_t> kp(shard);
            std::iota(kp.begin(), kp.end(), int64_t{c} * shard);
            const std::vector<int64_t> qp = {n};
            std::vector<float> part(rows * shape.head_dim), lse(rows), out(part.size());
            std::vector<float> blob(rows * (shape.head_dim + 1)), all(blob.size() * cp);
            for (int rep = 0; rep < reps; ++rep) {
                w.barrier();
                auto t0 = std::chrono::steady_clock::now();
                cp_partial_attention(shape, q.data(), qp, k.data(), v.data(), kp, part.data(),
                                     lse.data());
                auto t1 = std::chrono::steady_clock::now();
                cp_merge_partials(w, merge, 1, shape.num_q_heads, shape.head_dim, part.data(),
                                  lse.data(), out.data());
                auto t2 = std::chrono::steady_clock::now();
                w.all_gather(blob, all);
                auto t3 = std::chrono::steady_clock::now();
                benchmark::DoNotOptimize(out.data());
                a[c] += std::chrono::duration<double>(t1 - t0).count();
                m[c] += std::chrono::duration<double>(t2 - t1).count();
                r[c] += std::chrono::duration<double>(t3 - t2).count();
            }
        });
        attn_s += *std::max_element(a.begin(), a.end()) / reps;
        merge_s += *std::max_element(m.begin(), m.end()) / reps;
        raw_s += *std::max_element(r.begin(), r.end()) / reps;
        ++iters;
    }
    state.counters["attn_us"] = attn_s / iters * 1e6;
    state.counters["merge_us"] = merge_s / iters * 1e6;
    state.counters["merge_over_attn"] = merge_s / attn_s;
    state.counters["raw_allgather_us"] = raw_s / iters * 1e6;
    state.counters["merge_over_raw"] = merge_s / raw_s;
    state.SetLabel(std::string(cp_decode_merge_name(merge)));
}
BENCHMARK(BM_CpDecodeStepThreads)
    ->ArgNames({"merge", "cp", "n"})
    ->ArgsProduct({{0, 1}, {2, 4}, {8192}})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

// ---- batched decode of a model: CP next to the plain executor ----

// A 4-layer GQA model (hidden 512, 8 query / 4 KV heads of 64, MLP 1024, vocab 1024, fp32): big
// enough that a decode step is the model's work, small enough to hold 32 x 2048 tokens of KV.
const ModelSpec& decode_model() {
    static const ModelSpec m = [] {
        ModelSpec s = catalog_model("small-100m");
        s.name = "bench-cp-4l";
        s.num_layers = 4;
        s.hidden = 512;
        s.num_heads = 8;
        s.num_kv_heads = 4;
        s.head_dim = 64;
        s.intermediate = 1024;
        s.vocab = 1024;
        s.kv_dtype = s.weight_dtype = DType::kFp32;
        s.validate();
        return s;
    }();
    return m;
}

constexpr int kDecodeBlock = 16;
constexpr int kDecodeSteps = 16;  // timed steps, after one warm-up step

// Tokens per second of the plain executor (one RankModel, one thread): `batch` sequences of `ctx`
// tokens each decode one token per step (the same position every step: the KV length stays ctx).
double plain_decode_tokens_per_s(const TensorSource& src, int batch, int64_t ctx) {
    const ModelSpec& m = decode_model();
    const int64_t per_seq = (ctx + 1 + kDecodeBlock - 1) / kDecodeBlock;
    RankModel model(load_weights(m, WeightShard::full(m), src), batch * per_seq, kDecodeBlock);
    ForwardBatch fb;
    for (int s = 0; s < batch; ++s) {
        fb.token_ids.push_back(int32_t(s + 1));
        fb.slots.push_back(ctx);
        fb.queries.add_sequence(1, ctx);
        std::vector<int32_t> blocks(static_cast<size_t>(per_seq));
        std::iota(blocks.begin(), blocks.end(), int32_t(s * per_seq));
        fb.kv.add_sequence(blocks, ctx + 1, kDecodeBlock);
    }
    benchmark::DoNotOptimize(model.forward(fb));  // warm-up
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kDecodeSteps; ++i) benchmark::DoNotOptimize(model.forward(fb));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return double(batch) * kDecodeSteps / s;
}

// Batched decode on a CP group of cp threads (cp ranks, one thread each; merge all-gather or Helix
// all-to-all), `batch` sequences of `ctx` tokens (adopted: KV in place, no prefill computed), and
// the plain executor on the same batch right after; and the same CP steps one sequence per
// forward (the CP group's decode before batching). Wall time of the steps (rank 0; every rank
// waits for the others in each merge, so on a loaded machine the merge time includes waiting for
// the slower rank). args: merge, cp, batch, ctx
void BM_CpBatchDecode(benchmark::State& state) {
    const auto merge = static_cast<CpDecodeMerge>(state.range(0));
    const int cp = static_cast<int>(state.range(1));
    const int batch = static_cast<int>(state.range(2));
    const int64_t ctx = state.range(3);
    set_compute_threads(1);
    const auto src = random_tensor_source(17);
    const ModelSpec& m = decode_model();
    ParallelConfig p;
    p.cp = cp;
    p.cp_scheme = CpScheme::kZigzag;
    double cp_s = 0, merge_s = 0, serial_s = 0;
    for (auto _ : state) {
        run_threads(cp, [&](Communicator& w) {
            CpOptions o;
            o.block_size = kDecodeBlock;
            o.prefix_cache = false;
            o.decode_merge = merge;
            // ctx / cp prompt tokens and up to one block per step of generated ones, per sequence
            o.num_blocks = int64_t{batch} *
                           ((ctx / cp + kDecodeBlock - 1) / kDecodeBlock + 2 * kDecodeSteps + 3);
            CpDevice dev(m, 1, 0, *src, o);
            CpSession s(dev, w, p, o);
            std::vector<SeqId> seqs;
            std::vector<int32_t> feed;
            for (int i = 0; i < batch; ++i) {
                std::vector<int32_t> prompt(static_cast<size_t>(ctx));
                for (int64_t t = 0; t < ctx; ++t) prompt[size_t(t)] = int32_t((i * 31 + t) % 1024);
                s.adopt(i, prompt);
                seqs.push_back(i);
                feed.push_back(int32_t(i + 1));
            }
            s.decode(seqs, feed);  // warm-up
            w.barrier();
            double merged = 0;
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < kDecodeSteps; ++i) {
                benchmark::DoNotOptimize(s.decode(seqs, feed));
                merged += s.last_step().merge_seconds;
            }
            const double secs =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            // The same steps one sequence per forward (how a CP group decoded before batching).
            w.barrier();
            const auto t1 = std::chrono::steady_clock::now();
            for (int i = 0; i < kDecodeSteps; ++i)
                for (int j = 0; j < batch; ++j)
                    benchmark::DoNotOptimize(s.decode(seqs[size_t(j)], feed[size_t(j)]));
            const double serial =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
            if (w.rank() == 0) {
                cp_s = secs;
                merge_s = merged;
                serial_s = serial;
            }
        });
    }
    const double cp_rate = double(batch) * kDecodeSteps / cp_s;
    const double plain_rate = plain_decode_tokens_per_s(*src, batch, ctx);
    state.counters["cp_tok_per_s"] = cp_rate;
    state.counters["plain_tok_per_s"] = plain_rate;
    state.counters["cp_over_plain"] = cp_rate / plain_rate;
    state.counters["cp_one_seq_per_step_tok_per_s"] = double(batch) * kDecodeSteps / serial_s;
    state.counters["merge_share"] = merge_s / cp_s;
    state.counters["merge_ms_per_step"] = merge_s / kDecodeSteps * 1e3;
    state.SetLabel(std::string(cp_decode_merge_name(merge)));
}
BENCHMARK(BM_CpBatchDecode)
    ->ArgNames({"merge", "cp", "batch", "ctx"})
    ->ArgsProduct({{0, 1}, {2}, {1, 8, 32}, {2048}})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

}  // namespace
}  // namespace kvshard

BENCHMARK_MAIN();
