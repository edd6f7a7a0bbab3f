// The cost model per layer: windowed layers read only their window in decode and pair each query
// with at most W keys in prefill; state layers read and write their state.
#include <gtest/gtest.h>

#include "kvshard/layout/cp_plan.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/cost_model.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {
namespace {

CostReport cost(const ModelSpec& m, int64_t prompt, int64_t context) {
    ParallelConfig p;
    p.tp = 8;
    Workload w;
    w.prompt_tokens = prompt;
    w.context_tokens = context;
    w.batch = 1;
    return estimate_cost(m, p, hardware_by_name("h100-sxm"), w, CostOptions{});
}

TEST(CostWindows, WindowedLayersReadTheirWindowOnly) {
    const ModelSpec m = catalog_model("gpt-oss-120b");  // 18 sliding(128) + 18 full layers
    const CostReport win = cost(m, 32768, 131072);
    const CostReport full = cost(with_full_attention(m), 32768, 131072);
    // Decode: each of the 18 sliding layers reads 128 keys instead of 131072, at 2 (K, V) x 1 head
    // x 64 x 2 bytes per key on a tp=8 rank; the weights are the same.
    const double kv_key = 2 * 1 * 64 * 2;
    EXPECT_NEAR(full.decode.hbm_bytes - win.decode.hbm_bytes, 18 * (131072.0 - 128) * kv_key, 1e3);
    // Prefill: S^2/2 against S*W - W^2/2 query-key pairs per query head, 2 multiply-adds each of
    // QK and PV over 8 query heads of 64 dims per rank.
    const double S = 32768, W = 128;
    const double pairs = S * S / 2 - (S * W - W * W / 2);
    EXPECT_NEAR(full.prefill.flops - win.prefill.flops, 18 * 2 * pairs * 8 * (64 + 64),
                1e-9 * full.prefill.flops);
    EXPECT_LT(win.ttft_s, full.ttft_s);
    EXPECT_LT(win.tpot_s, full.tpot_s);
}

// Chunked attention pairs each query with the keys of its own chunk: over S = 12288 tokens and
// chunks of C = 8192, one whole chunk of C^2/2 pairs and a last one of 4096^2/2 (continuous form:
// the exact count of cp_prompt_attention_pairs less the diagonal's S/2), 41.9M pairs per query
// head where S*C/2 (as priced before) is 50.3M. Llama 4 Scout: 36 chunked layers, every 4th
// layer full; 40 / 8 = 5 query heads of 128 on a tp 8 rank.
TEST(CostWindows, ChunkedPairsAreCountedChunkByChunk) {
    const ModelSpec m = catalog_model("llama-4-scout");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    const double S = 12288, C = 8192;
    int chunked = 0, full = 0;
    for (int l = 0; l < m.num_layers; ++l) {
        const LayerSpec ls = m.layer(l);
        ASSERT_EQ(ls.head_dim, 128);
        if (ls.kind == LayerKind::kChunkedLocal) {
            ASSERT_EQ(ls.window, 8192);
            ++chunked;
        } else if (ls.kind == LayerKind::kFullAttention) {
            ++full;
        }
    }
    ASSERT_EQ(chunked, 36);
    ASSERT_EQ(full, 12);
    const double chunk_pairs = C * C / 2 + (S - C) * (S - C) / 2;
    ParallelConfig one;
    EXPECT_DOUBLE_EQ(cp_prompt_attention_pairs(one, int64_t(S), true, int(C)).total - S / 2,
                     chunk_pairs);
    const double per_pair = 2 * 5 * (128 + 128);  // QK^T and PV over 5 heads, 2 FLOPs each
    const double hand = (chunked * chunk_pairs + full * S * S / 2) * per_pair /
                        (hw.flops_bf16 * hw.compute_efficiency);
    EXPECT_NEAR(cost(m, int64_t(S), int64_t(S)).prefill.attention_compute_s / hand, 1.0, 1e-12);
}

// CP prefill under windows: the planner counts the ring steps the executor runs. gpt-oss-120b at
// cp=4, 32K tokens: over contiguous shards a sliding layer's ring stops after one transfer (its
// queries reach back into the previous rank's shard only), so the pass-KV bytes are the
// executor's count, below those of the same model with every layer full; over zigzag shards the
// mirrored chunk needs the next rank's keys, the last step, and nothing is saved.
TEST(CostWindows, CpPrefillRingStopsWhereTheExecutorsDoes) {
    const ModelSpec m = catalog_model("gpt-oss-120b");
    const int64_t S = 32768;
    Workload w;
    w.prompt_tokens = w.context_tokens = S;
    for (CpScheme scheme : {CpScheme::kContiguous, CpScheme::kZigzag}) {
        ParallelConfig p;
        p.cp = 4;
        p.cp_scheme = scheme;
        const HardwareSpec hw = hardware_by_name("h100-sxm");
        const CostReport win = estimate_cost(m, p, hw, w);
        const CostReport full = estimate_cost(with_full_attention(m), p, hw, w);
        const int64_t exact = cp_pass_kv_bytes(make_layout(m, p), 0, cp_prompt_map(p, S)).total();
        EXPECT_DOUBLE_EQ(win.cp_prefill.pass_kv_bytes, double(exact)) << cp_scheme_name(scheme);
        if (scheme == CpScheme::kContiguous) {
            // 18 full layers send 3 shards, 18 sliding layers 1.
            EXPECT_NEAR(win.cp_prefill.pass_kv_bytes / full.cp_prefill.pass_kv_bytes,
                        (18.0 * 3 + 18.0 * 1) / (36.0 * 3), 1e-12);
            EXPECT_LT(win.cp_prefill.pass_kv_s, full.cp_prefill.pass_kv_s);
        } else {
            EXPECT_DOUBLE_EQ(win.cp_prefill.pass_kv_bytes, full.cp_prefill.pass_kv_bytes);
        }
    }
}

TEST(CostWindows, StateLayersReadAndWriteTheirState) {
    const ModelSpec m = catalog_model("qwen3-next-80b-a3b");  // 36 GDN + 12 full layers
    const CostReport a = cost(m, 1024, 4096);
    const CostReport b = cost(m, 1024, 8192);
    // Doubling the context adds only the 12 full layers' KV reads: 4096 keys x 2 x
    // max(1, 2/8) head x 256 x 2 bytes each.
    EXPECT_NEAR(b.decode.hbm_bytes - a.decode.hbm_bytes, 12 * 4096.0 * 2 * 1 * 256 * 2, 1e3);
    // The state traffic per decode step: read and write each GDN layer's state on a tp=8 rank
    // (4 value heads, 2 key heads of 128: conv 3 x (2*2*128 + 4*128), state 4 x 128 x 128, bf16).
    const double state = 2.0 * (3 * (2 * 2 * 128 + 4 * 128) + 4 * 128 * 128);
    const CostReport all_full = cost(with_full_attention(m), 1024, 4096);
    EXPECT_GT(a.decode.hbm_bytes, 36 * 2 * state);
    EXPECT_LT(a.decode.hbm_bytes, all_full.decode.hbm_bytes + 36 * 2 * state);
}

// A state layer under CP is priced as the CP executor runs it (docs/context-parallel.md §8): the
// normed input rows all-gathered over the CP group, the in-projections and the recurrence over all
// S rows on every rank, the out-projection over the rank's S / cp rows. Nemotron-H 8B's shapes
// with every layer Mamba-2 and no MLP, tp 1, S = 8192: from cp 1 to cp 2 a rank saves only half
// the out-projection, 52 x S/2 x 2 x (128 x 64 x 4096) FLOPs, and sends 52 x 1/2 x S x 4096 x 2
// bytes (before, cp 2 halved everything and sent nothing).
TEST(CostWindows, CpPrefillOfStateLayersRunsTheRecurrenceOverAllRows) {
    ModelSpec m = catalog_model("nemotron-h-8b");
    ASSERT_EQ(m.state.heads, 128);
    ASSERT_EQ(m.state.head_dim, 64);
    for (LayerSpec& ls : m.layers) {
        ls.kind = LayerKind::kMamba2;
        ls.num_kv_heads = ls.head_dim = 0;
        ls.mlp = MlpKind::kNone;
        ls.intermediate = 0;
    }
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    auto prefill = [&](int cp) {
        ParallelConfig p;
        p.cp = cp;
        Workload w;
        w.prompt_tokens = w.context_tokens = 8192;
        return estimate_cost(m, p, hw, w).prefill;
    };
    const PhaseCost one = prefill(1), two = prefill(2);
    const double S = 8192, out = 128.0 * 64 * 4096;
    EXPECT_NEAR(one.flops - two.flops, 52 * (S / 2) * 2 * out, 1e-9 * one.flops);
    EXPECT_DOUBLE_EQ(two.cp_bytes, 52 * 0.5 * S * 4096 * 2);
    EXPECT_GT(two.cp_s, 0);
    EXPECT_DOUBLE_EQ(one.cp_bytes, 0);
}

}  // namespace
}  // namespace kvshard
