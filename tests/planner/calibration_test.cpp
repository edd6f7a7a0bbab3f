// The cost model's default latency terms against published measurements: for each figure, the
// predicted ratio of two configurations' times (never an absolute time) within 10% of the measured
// ratio. The figures are copied here with their sources; BENCHMARKS.md ("Planner") lists them with
// the model's predictions.
#include <gtest/gtest.h>

#include <cstdio>

#include "kvshard/model/catalog.h"
#include "kvshard/planner/cost_model.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {
namespace {

ParallelConfig cfg(int tp, int cp) {
    ParallelConfig p;
    p.tp = tp;
    p.cp = cp;
    return p;
}

// Meta's runs (arXiv:2411.01783, "Context Parallelism for Scalable Million-Token Inference",
// Yang et al., MLSys 2025): Llama 3 405B with row-wise fp8 weights on H100 hosts of 8 GPUs, TP 8
// inside a host, CP across hosts (the kvshard rank order puts TP inside a node and CP across).
CostReport meta_405b(int cp, int64_t prompt, int64_t context, int64_t batch,
                     CpMergePolicy merge = CpMergePolicy::kAuto) {
    const ModelSpec m = catalog_model("llama-3.1-405b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    Workload w;
    w.prompt_tokens = prompt;
    w.context_tokens = context;
    w.batch = batch;
    CostOptions o;
    o.weight_dtype = WeightDtype::kFp8;
    o.cp_decode_merge = merge;
    return estimate_cost(m, cfg(8, cp), hw, w, o);
}

void expect_ratio_within(double predicted, double measured, const char* what) {
    std::printf("%s: measured %.3f, predicted %.3f (predicted / measured %.3f)\n", what, measured,
                predicted, predicted / measured);
    EXPECT_NEAR(predicted / measured, 1.0, 0.10) << what;
}

// arXiv:2411.01783, decode results (the figure as issue 20 quotes it): the time per output token at
// CP=2 x TP=8 (two hosts) is 1.30x that of TP=8 on one host, 128K context, batch 1: CP halves the
// KV each GPU reads but adds a cross-host exchange per layer, and the per-message latency of that
// exchange dominates at one token. The ratio is the issue's; the 128K context and batch 1 are this
// test's reading of Meta's decode setting (at shorter contexts the predicted ratio is higher, the
// KV saving being smaller). Meta's decode is pass-Q: per layer the new token's query goes to the
// other CP ranks and their partial outputs come back, two exchanges per layer; kvshard's all-to-all
// merge makes the same two (all-to-all of partials, all-gather of merged heads), so it is the form
// compared. kvshard's all-gather merge makes one exchange (the hidden state is replicated in the CP
// group, docs/context-parallel.md section 5), and is predicted cheaper, between TP8 and the
// measured figure.
TEST(Calibration, MetaCpDecodeTwoHostsOverOne) {
    const double tp8 = meta_405b(1, 131072, 131072, 1).tpot_s;
    const CostReport cp2 = meta_405b(2, 131072, 131072, 1, CpMergePolicy::kAllToAll);
    expect_ratio_within(cp2.tpot_s / tp8, 1.30,
                        "decode TPOT, CP2xTP8 / TP8, 405B fp8, 128K, batch 1, two exchanges");
    const double one_exchange = meta_405b(2, 131072, 131072, 1, CpMergePolicy::kAllGather).tpot_s;
    EXPECT_GT(one_exchange, tp8);
    EXPECT_LT(one_exchange, cp2.tpot_s);
}

// arXiv:2411.01783, section 1 and abstract: a 128K-token prefill of Llama 3 405B takes about 60 s
// on one H100 host (8 GPUs) and 3.8 s with CP over 16 hosts (128 GPUs): 15.8x on 16x the GPUs.
TEST(Calibration, MetaCpPrefill128kSixteenHostsOverOne) {
    const double one = meta_405b(1, 131072, 131072, 1).ttft_s;
    const double sixteen = meta_405b(16, 131072, 131072, 1).ttft_s;
    expect_ratio_within(one / sixteen, 60.0 / 3.8, "prefill 128K, TP8 / CP16xTP8, 405B fp8");
}

// arXiv:2411.01783, abstract: a 1M-token prefill over 16 hosts (CP16 x TP8) takes 77 s at 93%
// parallelization efficiency, i.e. 0.93 x 16 = 14.9x the time on one host (TP8).
TEST(Calibration, MetaCpPrefill1mParallelEfficiency) {
    const int64_t n = 1 << 20;
    const double one = meta_405b(1, n, n, 1).ttft_s;
    const double sixteen = meta_405b(16, n, n, 1).ttft_s;
    expect_ratio_within(one / sixteen, 0.93 * 16, "prefill 1M, TP8 / CP16xTP8, 405B fp8");
}

}  // namespace
}  // namespace kvshard
