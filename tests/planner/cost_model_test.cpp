// Cost model formulas on small cases (docs/cost-model.md).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kvshard/common/error.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/cost_model.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {
namespace {

ParallelConfig cfg(int tp, int pp = 1, int cp = 1, int dp = 1, int ep = 1) {
    ParallelConfig p;
    p.tp = tp;
    p.pp = pp;
    p.cp = cp;
    p.dp = dp;
    p.ep = ep;
    return p;
}

Workload work(int64_t prompt, int64_t context, int64_t batch) {
    Workload w;
    w.prompt_tokens = prompt;
    w.context_tokens = context;
    w.batch = batch;
    return w;
}

TEST(Collectives, RingFormulas) {
    // all-reduce: 2(n-1)/n * bytes / bw + 2(n-1) * hop
    EXPECT_DOUBLE_EQ(ring_all_reduce_s(8e6, 4, 1e9, 1e-6), 2.0 * 3 / 4 * 8e6 / 1e9 + 6e-6);
    EXPECT_DOUBLE_EQ(ring_all_gather_s(8e6, 4, 1e9, 1e-6), 3.0 / 4 * 8e6 / 1e9 + 3e-6);
    EXPECT_DOUBLE_EQ(all_to_all_s(8e6, 4, 1e9, 1e-6),
                     3.0 / 4 * 8e6 / 1e9 + 1e-6);  // posted together
    EXPECT_DOUBLE_EQ(send_s(1e6, 1e9, 2e-6), 1e-3 + 2e-6);
    EXPECT_EQ(ring_all_reduce_s(8e6, 1, 1e9, 1e-6), 0);
    EXPECT_EQ(ring_all_gather_s(8e6, 1, 1e9, 1e-6), 0);
    EXPECT_EQ(all_to_all_s(8e6, 1, 1e9, 1e-6), 0);
}

TEST(Collectives, GroupsCrossNodesByRankPlacement) {
    EXPECT_FALSE(group_crosses_nodes(cfg(8), GroupKind::kTp, 8));
    EXPECT_TRUE(group_crosses_nodes(cfg(16), GroupKind::kTp, 8));
    EXPECT_TRUE(group_crosses_nodes(cfg(8, 2), GroupKind::kPp, 8));   // ranks 0 and 8
    EXPECT_FALSE(group_crosses_nodes(cfg(4, 2), GroupKind::kPp, 8));  // ranks 0 and 4
    EXPECT_FALSE(group_crosses_nodes(cfg(2, 1, 4), GroupKind::kCp, 8));
    EXPECT_TRUE(group_crosses_nodes(cfg(4, 1, 4), GroupKind::kCp, 8));
    EXPECT_TRUE(group_crosses_nodes(cfg(8, 1, 1, 2), GroupKind::kDp, 8));
    EXPECT_FALSE(group_crosses_nodes(cfg(4, 1, 1, 2, 8), GroupKind::kEp, 8));
    EXPECT_TRUE(group_crosses_nodes(cfg(8, 1, 1, 2, 16), GroupKind::kEp, 8));
}

TEST(Collectives, GroupSpanCountsNodesAndRanksPerNode) {
    auto span = [](const ParallelConfig& p, GroupKind g) {
        const GroupSpan s = group_span(p, g, 8);
        return std::vector<int>{s.n, s.nodes, s.per_node};
    };
    EXPECT_EQ(span(cfg(8), GroupKind::kTp), (std::vector<int>{8, 1, 8}));
    EXPECT_EQ(span(cfg(16), GroupKind::kTp), (std::vector<int>{16, 2, 8}));
    EXPECT_EQ(span(cfg(32), GroupKind::kTp), (std::vector<int>{32, 4, 8}));
    EXPECT_EQ(span(cfg(8, 1, 2), GroupKind::kCp), (std::vector<int>{2, 2, 1}));  // ranks 0 and 8
    EXPECT_EQ(span(cfg(1, 1, 16), GroupKind::kCp), (std::vector<int>{16, 2, 8}));
}

// Across nodes (docs/cost-model.md, "Collectives across nodes"): k nodes, g ranks per node.
TEST(Collectives, HierarchicalAcrossNodes) {
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    const double nv = hw.link_bw(false), nic = hw.link_bw(true);
    const double a = hw.hop_latency_s(false), x = hw.hop_latency_s(true);
    GroupSpan one{8, 1, 8}, two{16, 2, 8}, pair{2, 2, 1}, four{32, 4, 8};
    // Inside a node: node_all_reduce_s / node_all_gather_s ("Protocols inside a node", below);
    // all-to-all at the NVLink rate and alpha.
    EXPECT_DOUBLE_EQ(all_reduce_s(1e6, one, hw), node_all_reduce_s(1e6, 8, hw));
    EXPECT_DOUBLE_EQ(all_gather_s(1e6, one, hw), node_all_gather_s(1e6, 8, hw));
    EXPECT_DOUBLE_EQ(all_to_all_s(1e6, one, hw), all_to_all_s(1e6, 8, nv, a));
    // One rank per node: every step crosses, at the NIC's rate (the flat ring across nodes).
    EXPECT_DOUBLE_EQ(all_reduce_s(1e6, pair, hw), ring_all_reduce_s(1e6, 2, nic, x));
    EXPECT_DOUBLE_EQ(all_gather_s(1e6, pair, hw), ring_all_gather_s(1e6, 2, nic, x));
    EXPECT_DOUBLE_EQ(all_to_all_s(1e6, pair, hw), all_to_all_s(1e6, 2, nic, x));
    // Small: the tree, 2 (g-1) NVLink steps and 2 floor(log2 k) node-to-node steps.
    EXPECT_NEAR(all_reduce_s(8, two, hw), 14 * a + 2 * x, 1e-9);
    EXPECT_NEAR(all_reduce_s(8, four, hw), 14 * a + 4 * x, 1e-9);
    // Large: the ring, 1/8 of each rank's bytes over its NIC (8 x 40 GB/s of bus bandwidth).
    const double big = 8.0 * (1 << 30);
    EXPECT_NEAR(all_reduce_s(big, four, hw),
                2 * 3 * x + 2 * 28 * a + 2.0 * 31 / 32 * big / (8 * nic), 1e-9);
    EXPECT_NEAR(all_gather_s(big, two, hw), x + 14 * a + 15.0 / 16 * big / (8 * nic), 1e-9);
    // All-to-all: 7 messages inside the node and 8 across, posted together (one latency of
    // each); 8/16 of the bytes over the NIC.
    EXPECT_NEAR(all_to_all_s(big, two, hw), a + x + 0.5 * big / nic, 1e-9);
    EXPECT_NEAR(all_to_all_s(8, GroupSpan{256, 32, 8}, hw), a + x + 8 * 248.0 / 256 / nic, 1e-12);
}

// Inside a node (docs/cost-model.md, "Protocols inside a node"): the low-latency protocols below a
// few MiB (the NVLink alpha, a share of the rate), Simple above (its own alpha, the full rate),
// NVLink SHARP for large all-reduces over a whole H100 host; each term is the one that changes
// when it is switched off.
TEST(Collectives, ProtocolsInsideANode) {
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    const double nv = hw.link_bw(false), a = hw.nvlink_hop_latency_s;
    const double ll_bw = nv * hw.nvlink_ll_bw_fraction, sa = hw.nvlink_simple_hop_latency_s;
    // 16 KiB (a decode all-reduce): the low-latency ring.
    EXPECT_DOUBLE_EQ(node_all_reduce_s(16384, 8, hw), ring_all_reduce_s(16384, 8, ll_bw, a));
    EXPECT_DOUBLE_EQ(node_all_gather_s(16384, 4, hw), ring_all_gather_s(16384, 4, ll_bw, a));
    // 64 MiB over 4 of the node's 8 GPUs: the Simple ring (no NVLS on part of a node).
    const double mid = 64.0 * (1 << 20);
    EXPECT_DOUBLE_EQ(node_all_reduce_s(mid, 4, hw), ring_all_reduce_s(mid, 4, nv, sa));
    // 1 GiB over all 8: NVLink SHARP, 480 GB/s of bus bandwidth.
    const double big = 1.0 * (1 << 30);
    EXPECT_DOUBLE_EQ(node_all_reduce_s(big, 8, hw), hw.nvls_latency_s + 1.75 * big / 480e9);
    EXPECT_LT(node_all_reduce_s(big, 8, hw), ring_all_reduce_s(big, 8, nv, sa));
    // Switched off, each changes the price: no SHARP -> the Simple ring; a low-latency protocol at
    // the full rate and Simple's alpha at the NVLink one -> the single alpha-beta ring of before.
    HardwareSpec no_nvls = hw;
    no_nvls.nvls_bus_bw = 0;
    EXPECT_DOUBLE_EQ(node_all_reduce_s(big, 8, no_nvls), ring_all_reduce_s(big, 8, nv, sa));
    HardwareSpec one_protocol = no_nvls;
    one_protocol.nvlink_ll_bw_fraction = 1;
    one_protocol.nvlink_simple_hop_latency_s = a;
    for (double bytes : {16384.0, mid, big})
        EXPECT_DOUBLE_EQ(node_all_reduce_s(bytes, 8, one_protocol),
                         ring_all_reduce_s(bytes, 8, nv, a));
    EXPECT_GT(node_all_reduce_s(1 << 20, 8, hw), node_all_reduce_s(1 << 20, 8, one_protocol));
    // A100's NVSwitch has no SHARP.
    EXPECT_EQ(hardware_by_name("a100-80g").nvls_bus_bw, 0);
    // The planner's prefill of a TP 8 model sees it: 70B at 32K on one H100 host.
    const ModelSpec m = catalog_model("llama-3.1-70b");
    Workload w;
    w.prompt_tokens = w.context_tokens = 32768;
    const double with = estimate_cost(m, cfg(8), hw, w).prefill.tp_s;
    const double without = estimate_cost(m, cfg(8), no_nvls, w).prefill.tp_s;
    EXPECT_LT(with, 0.9 * without);
}

// The ring simulated step by step: in step s, CP rank c forwards the shard first owned by (c - s)
// mod cp.
int64_t simulated_pass_kv(const KvLayout& l, int rank, int64_t len) {
    const auto& p = l.parallel;
    const auto& rk = l.ranks[rank];
    const int64_t per_token_layer = rk.kv_bytes_per_token / rk.num_layers();
    int64_t bytes = 0;
    for (int s = 0; s + 1 < p.cp; ++s) {
        const int owner = ((rk.coord.cp - s) % p.cp + p.cp) % p.cp;
        for (const auto& r : cp_token_ranges(p, owner, len)) bytes += r.size() * per_token_layer;
    }
    return bytes * rk.num_layers();
}

TEST(CpPassKv, BytesSentMatchHandCountAndRingSimulation) {
    const auto m = catalog_model("tiny");  // 4 layers, 4 KV heads of 8, fp32: 256 B per token-layer
    auto p = cfg(1, 1, 4);
    auto l = make_layout(m, p);
    EXPECT_EQ(cp_pass_kv_bytes_sent(l, 0, 100), 4 * 256 * (100 - 25));
    // Zigzag, cp=3, 10 tokens: 6 chunks at 0,1,3,5,6,8,10 -> ranks hold 3, 4, 3 tokens.
    p = cfg(1, 1, 3);
    p.cp_scheme = CpScheme::kZigzag;
    l = make_layout(m, p);
    EXPECT_EQ(cp_pass_kv_bytes_sent(l, 0, 10), 4 * 256 * (10 - 4));
    EXPECT_EQ(cp_pass_kv_bytes_sent(l, 1, 10), 4 * 256 * (10 - 3));
    EXPECT_EQ(cp_pass_kv_bytes_sent(l, 2, 10), 4 * 256 * (10 - 3));
    // Every scheme, tp and pp split, against the simulated ring.
    for (auto scheme : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave})
        for (int cp : {1, 2, 3, 4}) {
            auto q = cfg(2, 2, cp);
            q.cp_scheme = scheme;
            q.cp_interleave = 5;
            const auto lq = make_layout(m, q);
            for (int r = 0; r < lq.world_size(); ++r)
                for (int64_t len : {0, 1, 13, 64, 257})
                    EXPECT_EQ(cp_pass_kv_bytes_sent(lq, r, len), simulated_pass_kv(lq, r, len))
                        << cp_scheme_name(scheme) << " cp=" << cp << " rank=" << r
                        << " len=" << len;
        }
    // cp = 1 sends nothing; MLA passes the latent.
    EXPECT_EQ(cp_pass_kv_bytes_sent(make_layout(m, cfg(4)), 0, 1000), 0);
    const auto mla = make_layout(catalog_model("tiny-mla"), cfg(2, 1, 2));
    EXPECT_EQ(cp_pass_kv_bytes_sent(mla, 0, 8), 2 * (32 + 8) * 4 * 4);
}

TEST(CostModel, DecodeTrafficOnTinyModels) {
    const auto m = catalog_model("tiny");  // hidden 64, 8 query heads of 8
    const auto hw = hardware_by_name("h100-sxm");
    // TP=2: two all-reduces per layer of B*hidden*2 bytes, each sending 2(n-1)/n of it.
    auto r = estimate_cost(m, cfg(2), hw, work(16, 16, 1));
    EXPECT_DOUBLE_EQ(r.decode.tp_bytes, 4 * 2 * (2.0 * 1 / 2) * 64 * 2);
    EXPECT_EQ(r.decode.pp_bytes, 0);
    EXPECT_EQ(r.decode.cp_bytes, 0);
    EXPECT_EQ(r.decode.ep_bytes, 0);
    // PP=2: one hand-off of B*hidden*2 bytes.
    r = estimate_cost(m, cfg(1, 2), hw, work(16, 16, 1));
    EXPECT_DOUBLE_EQ(r.decode.pp_bytes, 64 * 2);
    EXPECT_DOUBLE_EQ(r.decode.tp_bytes, 0);
    // CP=2: all-gather of the fp32 partial O (8 heads x 8 dims) + fp32 LSE per head, each layer.
    r = estimate_cost(m, cfg(1, 1, 2), hw, work(16, 16, 1));
    EXPECT_DOUBLE_EQ(r.cp_decode.all_gather_bytes, 4 * 1 * 8 * (8 + 1) * 4);
    EXPECT_GT(r.cp_decode.all_to_all_bytes, 0);
    // EP=2 over dp=2: dispatch + combine of B x top-2 x hidden x 2 B, half of it leaving the rank.
    r = estimate_cost(catalog_model("tiny-moe"), cfg(1, 1, 1, 2, 2), hw, work(16, 16, 2));
    EXPECT_DOUBLE_EQ(r.decode.ep_bytes, 4 * 2 * 0.5 * (2 * 2 * 64 * 2));
    EXPECT_LT(r.ep_link_share_for_kv, 1.0);
    EXPECT_GT(r.ep_link_share_for_kv, 0.0);
}

// A TP all-reduce follows each row-parallel projection that ends a block: a layer of one mixer and
// one MLP makes two, a layer of a single mixer (Nemotron-H's Mamba-2 and attention layers) or a
// single MLP one. Nemotron-H 8B at tp 8 has 52 such layers, each of one block: 52 all-reduces
// of B x 4096 x 2 bytes, each sending 2 x 7/8 of it (it was priced at 104).
TEST(CostModel, OneTpAllReducePerBlockThatEndsARowParallelProjection) {
    const auto hw = hardware_by_name("h100-sxm");
    const ModelSpec nh = catalog_model("nemotron-h-8b");
    ASSERT_EQ(nh.num_layers, 52);
    ASSERT_EQ(nh.hidden, 4096);
    int blocks = 0;
    for (int l = 0; l < nh.num_layers; ++l) {
        const LayerSpec ls = nh.layer(l);
        blocks += (ls.kind != LayerKind::kNoKv ? 1 : 0) + (ls.mlp != MlpKind::kNone ? 1 : 0);
    }
    EXPECT_EQ(blocks, 52);
    const auto r = estimate_cost(nh, cfg(8), hw, work(8192, 8192, 1));
    EXPECT_DOUBLE_EQ(r.decode.tp_bytes, 52 * 1 * (2.0 * 7 / 8) * 1 * 4096 * 2);
    EXPECT_DOUBLE_EQ(r.prefill.tp_bytes, 52 * 1 * (2.0 * 7 / 8) * 8192 * 4096 * 2);
    // Llama's layers are attention + MLP: two each.
    const ModelSpec llama = catalog_model("llama-3.1-8b");
    const auto rl = estimate_cost(llama, cfg(8), hw, work(8192, 8192, 1));
    EXPECT_DOUBLE_EQ(rl.decode.tp_bytes, 32 * 2 * (2.0 * 7 / 8) * 1 * 4096 * 2);
}

// QK^T and PV multiply queries with the cached K and V: fp8 weights leave them at the bf16 rate
// unless the KV cache is fp8 too. Llama 3.1 70B at tp 8, 128K: 80 layers x S^2/2 pairs x 8 query
// heads x (128 + 128) x 2 FLOPs at the bf16 rate, 4.74 s (it was priced at the fp8 rate, 2.37 s).
TEST(CostModel, AttentionRunsAtTheKvCachesRateNotTheWeights) {
    ModelSpec m = catalog_model("llama-3.1-70b");
    const auto hw = hardware_by_name("h100-sxm");
    const double S = 131072;
    const double hand = 80 * 2 * (S * S / 2) * 8 * (128 + 128);
    CostOptions fp8;
    fp8.weight_dtype = WeightDtype::kFp8;
    const auto bf16_kv = estimate_cost(m, cfg(8), hw, work(131072, 131072, 1), fp8);
    const double bf16_rate = hw.flops_bf16 * hw.compute_efficiency;
    EXPECT_NEAR(bf16_kv.prefill.attention_compute_s / (hand / bf16_rate), 1.0, 1e-12);
    EXPECT_NEAR(bf16_kv.prefill.attention_compute_s, 4.74, 0.01);
    // The same with bf16 weights: the attention time does not change.
    const auto bf16_all = estimate_cost(m, cfg(8), hw, work(131072, 131072, 1));
    EXPECT_DOUBLE_EQ(bf16_all.prefill.attention_compute_s, bf16_kv.prefill.attention_compute_s);
    EXPECT_DOUBLE_EQ(bf16_all.decode.attention_compute_s, bf16_kv.decode.attention_compute_s);
    // An fp8 cache: the fp8 rate.
    m.kv_dtype = DType::kFp8;
    const auto fp8_kv = estimate_cost(m, cfg(8), hw, work(131072, 131072, 1), fp8);
    EXPECT_NEAR(fp8_kv.prefill.attention_compute_s * hw.flops_fp8 * hw.compute_efficiency / hand,
                1.0, 1e-12);
}

// A prefill reads the experts its tokens are routed to, as a decode step does: with T tokens
// each expert is hit with probability 1 - (1 - k/E)^T. gpt-oss-120b (E = 128, k = 4, experts of
// 3 x 2880 x 2880) at tp 2 on H200: 16 tokens hit 40% of the experts, 8 tokens 22%; the bytes
// of the two prefills differ by that share of the 36 layers' experts (MXFP4, split over 2 ranks)
// plus 8 tokens' KV and activations (before: by the KV and activations only, every expert
// read). 16 tokens: prefill memory 30.1 -> 12.2 ms (with the experts in bf16, before the
// checkpoint's MXFP4 storage was read).
TEST(CostModel, PrefillReadsTheExpertsItsTokensHit) {
    const ModelSpec m = catalog_model("gpt-oss-120b");
    const auto hw = hardware_by_name("h200");
    auto bytes = [&](int64_t S) {
        return estimate_cost(m, cfg(2), hw, work(S, S, 1)).prefill.hbm_bytes;
    };
    auto hit = [](double T) { return 1 - std::pow(1 - 4.0 / 128, T); };
    // Bytes per layer per rank: the checkpoint's MXFP4 experts, 4.25 bits a weight, with their
    // gate_up and down biases (3 x 2880, gpt_oss.py), which the cost model reads at the experts'
    // rate (bf16 in the checkpoint: 0.1% of an expert, not worth a rate of their own).
    const double experts = 128.0 * (3 * 2880 * 2880 + 3 * 2880) / 2 * 4.25 / 8;
    const double kv = 2 * 4 * 64 * 2;  // K and V, 4 of 8 heads, bf16
    const double act = 2 * 2880 * 2;   // in and out, bf16
    EXPECT_NEAR(bytes(16) - bytes(8), 36 * ((hit(16) - hit(8)) * experts + 8 * (kv + act)),
                1e-9 * bytes(16));
    // Long prompts hit every expert.
    EXPECT_NEAR(hit(4096), 1.0, 1e-12);
}

// DeepSeek-V3.2's sparse attention (DSA): per query the indexer scores every key (64 heads of
// 128, fp8 keys of 128 B plus a 4 B scale per token, replicated over TP) and MLA attends to the
// 2048 it picks. At tp 8, batch 4: doubling the context from 64K to 128K adds only the indexer's
// keys and scores (the picked latents stay 2048 per query), where dense MLA read and scored
// every latent; below 2048 keys every key is attended. The indexer's projections are weights
// read each step. Prefill: sum over queries of min(i + 1, 2048) pairs for MLA (in bf16, the
// cache's rate), S^2/2 for the indexer at the fp8 rate. 128K, batch 4: TPOT 16.3 -> 7.1 ms.
TEST(CostModel, SparseAttentionReadsTheTopKAndTheIndexerEveryKey) {
    const ModelSpec m = catalog_model("deepseek-v3.2");
    const auto hw = hardware_by_name("h200");
    ASSERT_EQ(m.indexer.heads, 64);
    ASSERT_EQ(m.indexer.head_dim, 128);
    ASSERT_EQ(m.indexer.topk, 2048);
    ASSERT_EQ(m.indexer.dtype, DType::kFp8);
    ASSERT_EQ(m.indexer.scale_bytes, 4);
    for (int l = 0; l < 61; ++l) ASSERT_TRUE(m.layer(l).indexer);
    CostOptions o;
    o.weight_dtype = WeightDtype::kFp8;
    auto run = [&](const ModelSpec& model, int64_t S, int64_t C, int64_t B) {
        return estimate_cost(model, cfg(8), hw, work(S, C, B), o);
    };
    const double ix_key = 128 + 4, latent = (512 + 64) * 2;
    const auto c64k = run(m, 65536, 65536, 4), c128k = run(m, 131072, 131072, 4);
    EXPECT_NEAR(c128k.decode.hbm_bytes - c64k.decode.hbm_bytes, 61 * 4 * 65536 * ix_key, 1.0);
    EXPECT_NEAR(c128k.decode.flops - c64k.decode.flops, 61 * 2.0 * 4 * 65536 * 64 * 128,
                1e-9 * c128k.decode.flops);
    const auto c512 = run(m, 512, 512, 4), c1k = run(m, 1024, 1024, 4);
    EXPECT_NEAR(c1k.decode.hbm_bytes - c512.decode.hbm_bytes, 61 * 4 * 512 * (latent + ix_key),
                1.0);
    // The indexer's weights (fp8): against the same model without it, at one key.
    ModelSpec dense = m;
    dense.layers.clear();
    for (int l = 0; l < m.num_layers; ++l) dense.layers.push_back(m.layer(l));
    for (LayerSpec& ls : dense.layers) ls.indexer = false;
    const double ix_params = 1536.0 * 64 * 128 + 7168.0 * 128 + 2 * 128 + 7168.0 * 64;
    EXPECT_NEAR(run(m, 1, 1, 1).decode.hbm_bytes - run(dense, 1, 1, 1).decode.hbm_bytes,
                61 * (ix_params + 2 * ix_key), 1.0);
    // Prefill attention time.
    const double S = 131072, k = 2048;
    const double hand =
        61 * (2 * (S * k - k * k / 2) * 16 * (192 + 128) / (hw.flops_bf16 * hw.compute_efficiency) +
              2 * (S * S / 2) * 64 * 128 / (hw.flops_fp8 * hw.compute_efficiency));
    EXPECT_NEAR(c128k.prefill.attention_compute_s / hand, 1.0, 1e-12);
    EXPECT_NEAR(c128k.tpot_s, 7.1e-3, 0.1e-3);
}

TEST(CostModel, DecodeIsMemoryBoundAndPrefillComputeBound) {
    const auto m = catalog_model("llama-3.1-70b");
    const auto hw = hardware_by_name("h100-sxm");
    const auto r = estimate_cost(m, cfg(8), hw, work(8192, 8192, 1));
    EXPECT_GT(r.decode.memory_s, r.decode.compute_s);
    EXPECT_GT(r.prefill.compute_s, r.prefill.memory_s);
    // Decode at batch 1 reads each GPU's weights once: 17.6 GB / (3.35 TB/s * 0.8) ~ 6.6 ms + KV.
    EXPECT_GT(r.tpot_s, 17.6e9 / (3.35e12 * 0.8));
    // + 160 all-reduces of 16 KiB, each 14 hops of 3 us: ~6.7 ms.
    EXPECT_LT(r.tpot_s, 17.6e9 / (3.35e12 * 0.8) + 160 * 14 * 3e-6 + 1e-3);
    // Prefill FLOPs ~ 2 * params * S (+ attention): TTFT at least that over 8 GPUs' achieved rate.
    EXPECT_GT(r.ttft_s, 2 * 70.6e9 * 8192 / (8 * 989e12 * 0.6));
    EXPECT_DOUBLE_EQ(r.decode_tokens_per_s, 1 / r.tpot_s);
}

TEST(CostModel, PassKvHidesUnderAttentionAtLongContextOnly) {
    const auto m = catalog_model("llama-3.1-70b");
    const auto hw = hardware_by_name("h100-sxm");
    auto p = cfg(8, 1, 4);
    p.cp_scheme = CpScheme::kZigzag;
    CostOptions o;
    o.cp_prefill = CpPrefillPolicy::kPassKv;
    const auto long_ctx = estimate_cost(m, p, hw, work(131072, 131072, 1), o);
    EXPECT_TRUE(long_ctx.cp_prefill.pass_kv_hidden);
    EXPECT_EQ(long_ctx.prefill.cp_s, 0);
    // Pass-KV bytes per GPU: (cp-1) shards of S/cp tokens at the rank's KV bytes per token.
    EXPECT_DOUBLE_EQ(long_ctx.cp_prefill.pass_kv_bytes, 3.0 * 131072 / 4 * 80 * 2 * 1 * 128 * 2);
    const auto short_ctx = estimate_cost(m, p, hw, work(64, 64, 1), o);
    EXPECT_FALSE(short_ctx.cp_prefill.pass_kv_hidden);
    EXPECT_GT(short_ctx.prefill.cp_s, 0);
}

TEST(CostModel, PipelineBubbleAndChunks) {
    const auto m = catalog_model("llama-3.1-8b");
    const auto hw = hardware_by_name("h100-sxm");
    CostOptions one;
    one.pp_prefill_chunks = 1;
    const auto r1 = estimate_cost(m, cfg(1, 4), hw, work(4096, 4096, 1), one);
    const auto r4 = estimate_cost(m, cfg(1, 4), hw, work(4096, 4096, 1));  // 4 chunks
    EXPECT_LT(r4.ttft_s, r1.ttft_s);
    EXPECT_GT(r1.prefill.pp_bubble_s, r4.prefill.pp_bubble_s);
    // Decode with batch 1 on 4 stages: 3 of 4 stages idle at any time.
    EXPECT_NEAR(r1.decode.pp_bubble_s / r1.tpot_s, 0.75, 1e-12);
}

// The LM head (vocab-parallel, ceil(V / tp) x h on the last stage) is read every step and
// multiplies each decoding token, and the prompt's last token in prefill: halving Llama 3.1 8B's
// vocabulary at tp 8 removes (16032 - 8016) x 4096 bf16 weights from both phases' bytes, and
// 2 x B x (16032 - 8016) x 4096 FLOPs (B = 4 in decode, 1 in prefill). Before, neither phase
// counted it.
TEST(CostModel, TheLmHeadIsReadAndMultipliedOnTheLastStage) {
    const ModelSpec m = catalog_model("llama-3.1-8b");
    ASSERT_EQ(m.vocab, 128256);
    ModelSpec half = m;
    half.vocab = m.vocab / 2;
    const auto hw = hardware_by_name("h100-sxm");
    const double rows = 16032 - 8016;
    for (int pp : {1, 2}) {
        const auto full = estimate_cost(m, cfg(8, pp), hw, work(1024, 1024, 4));
        const auto small = estimate_cost(half, cfg(8, pp), hw, work(1024, 1024, 4));
        // Per step each stage runs min(pp, B) micro-batches of B / min(pp, B) requests, each
        // reading the weights.
        EXPECT_NEAR(full.decode.hbm_bytes - small.decode.hbm_bytes, pp * rows * 4096 * 2, 1.0);
        EXPECT_NEAR(full.prefill.hbm_bytes - small.prefill.hbm_bytes, rows * 4096 * 2, 1.0);
        EXPECT_NEAR(full.decode.flops - small.decode.flops, 2.0 * 4 * rows * 4096, 1.0);
        EXPECT_NEAR(full.prefill.flops - small.prefill.flops, 2.0 * 1 * rows * 4096, 1.0);
    }
}

// PP decode with m = min(pp, B) micro-batches: a micro-batch's next step waits for its path through
// the stages and for the slowest stage to run all m micro-batches. Llama 3.1 8B on pp 2: two
// stages of 16 layers, the last one also running the LM head; batch 2 is 2 micro-batches of the
// same size as batch 1's one, so its step is 2 x the last stage's time: batch 1's path (t0 + t1 +
// send) less the send plus the LM head's time (t1 - t0: 1 GB of bf16 weights at 80% of 3.35
// TB/s). It was priced as the path alone.
TEST(CostModel, PipelineDecodeWaitsForTheSlowestStage) {
    const ModelSpec m = catalog_model("llama-3.1-8b");
    const auto hw = hardware_by_name("h100-sxm");
    const auto b1 = estimate_cost(m, cfg(1, 2), hw, work(1024, 1024, 1));
    const auto b2 = estimate_cost(m, cfg(1, 2), hw, work(1024, 1024, 2));
    const double lm_head_s = 128256.0 * 4096 * 2 / (hw.hbm_bw * hw.hbm_efficiency);
    EXPECT_NEAR(b2.tpot_s, b1.tpot_s - b1.decode.pp_s + lm_head_s, 1e-12);
    EXPECT_GT(b2.tpot_s, b1.tpot_s);
    // The report says which bound set the step (what --explain prints).
    EXPECT_EQ(b1.decode_micro_batches, 1);
    EXPECT_FALSE(b1.decode_slowest_stage_bound);
    EXPECT_EQ(b2.decode_micro_batches, 2);
    EXPECT_TRUE(b2.decode_slowest_stage_bound);
}

// PP prefill in m chunks under causal attention: chunk i pairs its queries with (2i + 1) / m^2 of
// the prompt's pairs. Llama 3.1 8B on pp 2 (16 + 16 layers), 2 chunks of a 128K prompt,
// compute-bound: each stage spends a = its non-attention time / 2 per chunk and b / 4, 3b / 4 of
// its attention b on chunks 0 and 1. Chunk 1 enters stage 1 after it leaves stage 0, so TTFT =
// t(0,0) + t(0,1) + t(1,1) + send = 3a + 1.75b + send (equal chunks gave 3a + 1.5b + send: 8.01
// s against 8.95 s), and stage 1 idles a + 0.75b of it. The vocabulary is cut to 8 so that the
// LM head (on the last chunk of the last stage) does not blur the sums.
TEST(CostModel, PipelinePrefillChunksCostTheirShareOfTheCausalPairs) {
    ModelSpec m = catalog_model("llama-3.1-8b");
    m.vocab = 8;
    const auto hw = hardware_by_name("h100-sxm");
    const auto r = estimate_cost(m, cfg(1, 2), hw, work(131072, 131072, 1));
    ASSERT_GT(r.prefill.compute_s, 100 * r.prefill.memory_s);
    const double b = r.prefill.attention_compute_s / 2;
    const double a = (r.prefill.compute_s - r.prefill.attention_compute_s) / 4;
    EXPECT_NEAR(r.ttft_s / (3 * a + 1.75 * b + r.prefill.pp_s), 1.0, 1e-8);
    EXPECT_NEAR(r.prefill.pp_bubble_s / (a + 0.75 * b), 1.0, 1e-8);
}

TEST(CostModel, BadWorkloadsAreErrors) {
    const auto m = catalog_model("tiny");
    const auto hw = hardware_by_name("h100-sxm");
    EXPECT_THROW(estimate_cost(m, cfg(1), hw, work(0, 16, 1)), Error);
    EXPECT_THROW(estimate_cost(m, cfg(1), hw, work(16, 0, 1)), Error);
    EXPECT_THROW(estimate_cost(m, cfg(1), hw, work(16, 16, 0)), Error);
    EXPECT_THROW(estimate_cost(m, cfg(3), hw, work(16, 16, 1)), Error);
    EXPECT_THROW(parse_cp_prefill_policy("ring"), Error);
    EXPECT_THROW(parse_cp_merge_policy("tree"), Error);
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// The context-parallel executor counts the same bytes from its own token map.
TEST(CpPassKv, AgreesWithTheExecutorsPlan) {
    for (auto scheme : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave})
        for (int cp : {2, 3, 4}) {
            auto p = cfg(2, 1, cp);
            p.cp_scheme = scheme;
            p.cp_interleave = 4;
            const auto l = make_layout(catalog_model("tiny"), p);
            for (int64_t n : {1, 17, 100})
                for (int r = 0; r < l.world_size(); ++r)
                    EXPECT_EQ(cp_pass_kv_bytes_sent(l, r, n),
                              cp_pass_kv_bytes(l, r, cp_prompt_map(p, n)).ring)
                        << cp_scheme_name(scheme) << " cp=" << cp << " n=" << n << " rank=" << r;
        }
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// The planner prices a CP prefill at its busiest rank's share of the attention: contiguous shards
// leave the last rank (2 cp - 1) / cp^2 of a full-attention prompt, zigzag 1 / cp. At 128K on a
// long-context configuration contiguous is predicted slower by the imbalance times the share of
// the prefill that is attention; with one CP rank the scheme changes nothing.
TEST(CostModelCpBalance, ContiguousPrefillIsPricedAtTheBusiestRank) {
    const ModelSpec m = catalog_model("llama-3.1-70b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    Workload w;
    w.prompt_tokens = w.context_tokens = 131072;
    w.batch = 1;
    auto prefill = [&](int cp, CpScheme scheme) {
        ParallelConfig p;
        p.tp = 8;
        p.cp = cp;
        p.cp_scheme = scheme;
        return estimate_cost(m, p, hw, w).ttft_s;
    };
    // (contiguous / zigzag - 1) / (busiest / average - 1) is the share of the prefill that is
    // attention: the same at cp 2 and cp 4 (the MLP and the rest split evenly either way), and
    // for 70B at 128K about half of it (0 if the placement were not priced).
    std::vector<double> share;
    for (int cp : {2, 4}) {
        const double zig = prefill(cp, CpScheme::kZigzag);
        const double con = prefill(cp, CpScheme::kContiguous);
        share.push_back((con / zig - 1) / ((2.0 * cp - 1) / cp - 1));
        EXPECT_GT(share.back(), 0.3) << "cp " << cp;
        EXPECT_LT(share.back(), 0.7) << "cp " << cp;
    }
    EXPECT_NEAR(share[0], share[1], 0.05);
    EXPECT_DOUBLE_EQ(prefill(1, CpScheme::kZigzag), prefill(1, CpScheme::kContiguous));
}

// Decode under CP: a sliding layer's window (gpt-oss: the last 128 positions) lies in the last
// zigzag chunk, on one CP rank, where interleaving by 16 spreads it over both: per layer pair the
// busiest rank reads 65,536 + 128 keys against 65,536 + 64 (the full layer's half of 128K either
// way), and the decode attention time follows exactly.
TEST(CostModelCpBalance, ASlidingWindowAtDecodeIsPricedOnTheRankThatHoldsIt) {
    const ModelSpec m = catalog_model("gpt-oss-120b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    Workload w;
    w.prompt_tokens = w.context_tokens = 131072;
    w.batch = 1;
    auto decode_attention = [&](CpScheme scheme, int unit) {
        ParallelConfig p;
        p.tp = 4;
        p.cp = 2;
        p.cp_scheme = scheme;
        p.cp_interleave = unit;
        return estimate_cost(m, p, hw, w).decode.attention_compute_s;
    };
    const double zig = decode_attention(CpScheme::kZigzag, 1);
    const double inter = decode_attention(CpScheme::kInterleave, 16);
    EXPECT_NEAR(zig / inter, (65536.0 + 128) / (65536.0 + 64), 1e-9);
}

}  // namespace
}  // namespace kvshard
