// The seed's examples (kv-under-parallel-partitioning.md §2 and §6).
#include <gtest/gtest.h>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

ParallelConfig tp(int t) {
    ParallelConfig p;
    p.tp = t;
    return p;
}

TEST(LayoutSeed, Tp8WithGqa8GivesOneKvHeadPerGpu) {
    const auto l = make_layout(catalog_model("llama-3.1-70b"), tp(8));
    ASSERT_EQ(l.world_size(), 8);
    for (int r = 0; r < 8; ++r) {
        EXPECT_EQ(l.ranks[r].kv_heads, std::vector<int>{r});
        EXPECT_TRUE(l.ranks[r].head_replica_ranks.empty());
        // 80 layers * 2 (K,V) * 1 head * 128 * 2 bytes
        EXPECT_EQ(l.ranks[r].kv_bytes_per_token, 80 * 2 * 1 * 128 * 2);
    }
}

TEST(LayoutSeed, Tp4WithMha64GivesSixteenKvHeadsPerGpu) {
    const auto l = make_layout(catalog_model("llama-65b"), tp(4));
    for (int r = 0; r < 4; ++r) {
        ASSERT_EQ(l.ranks[r].num_kv_heads(), 16);
        EXPECT_EQ(l.ranks[r].kv_heads.front(), 16 * r);
        EXPECT_EQ(l.ranks[r].kv_heads.back(), 16 * r + 15);
        EXPECT_EQ(l.ranks[r].kv_bytes_per_token, int64_t{80} * 2 * 16 * 128 * 2);
    }
}

TEST(LayoutSeed, Gqa8WithTp16PutsEachHeadOnTwoGpus) {
    const auto l = make_layout(catalog_model("llama-3.1-70b"), tp(16));
    EXPECT_EQ(l.head_replication(), 2);
    for (int r = 0; r < 16; ++r) {
        EXPECT_EQ(l.ranks[r].kv_heads, std::vector<int>{r / 2});
        EXPECT_EQ(l.ranks[r].head_replica_ranks, std::vector<int>{r ^ 1});
    }
}

TEST(LayoutSeed, Tp3AndTp12WithGqa8AreClearErrors) {
    const auto m = catalog_model("llama-3.1-70b");
    for (int t : {3, 12}) {
        try {
            make_layout(m, tp(t));
            FAIL() << "tp=" << t << " should be rejected";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("valid tp sizes are 1, 2, 4, 8, 16, 32, 64"),
                      std::string::npos)
                << e.what();
        }
    }
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

ParallelConfig cfg(int tp, int pp, int cp, int dp, int ep = 1) {
    ParallelConfig p;
    p.tp = tp;
    p.pp = pp;
    p.cp = cp;
    p.dp = dp;
    p.ep = ep;
    return p;
}

// §6: TP=8 x DP=4 — four replicas, each one full copy of the KV of its requests.
TEST(LayoutSeed, Tp8Dp4ReplicatesTheTp8Layout) {
    const auto l = make_layout(catalog_model("llama-3.1-70b"), cfg(8, 1, 1, 4));
    ASSERT_EQ(l.world_size(), 32);
    for (int r = 0; r < 32; ++r) {
        const auto& rk = l.ranks[r];
        EXPECT_EQ(rk.coord.dp, r / 8);
        EXPECT_EQ(rk.coord.tp, r % 8);
        EXPECT_EQ(rk.kv_heads, std::vector<int>{r % 8});
        EXPECT_TRUE(rk.head_replica_ranks.empty());  // DP copies hold other requests, not replicas
        EXPECT_EQ(rk.layer_begin, 0);
        EXPECT_EQ(rk.layer_end, 80);
        EXPECT_EQ(rk.kv_bytes_per_token, 80 * 2 * 1 * 128 * 2);
    }
}

// §6: TP=8 x PP=2 — each stage holds half the layers, so half the KV bytes per token.
TEST(LayoutSeed, Tp8Pp2SplitsLayers) {
    const auto l = make_layout(catalog_model("llama-3.1-405b"), cfg(8, 2, 1, 1));
    ASSERT_EQ(l.world_size(), 16);
    for (int r = 0; r < 16; ++r) {
        const auto& rk = l.ranks[r];
        EXPECT_EQ(rk.coord.pp, r / 8);
        EXPECT_EQ(rk.kv_heads, std::vector<int>{r % 8});
        EXPECT_EQ(rk.layer_begin, r < 8 ? 0 : 63);
        EXPECT_EQ(rk.layer_end, r < 8 ? 63 : 126);
        EXPECT_EQ(rk.kv_bytes_per_token, 63 * 2 * 1 * 128 * 2);
    }
    // Uneven layer counts as vLLM's get_pp_indices splits them: the (L mod pp) stages before the
    // last take one more each, from the second-to-last backwards (vllm/distributed/utils.py; its
    // docs' example: 61 layers on 4 stages are 15, 15, 16, 15). An explicit split is kept.
    auto p = cfg(1, 3, 1, 1);
    EXPECT_EQ(pp_layer_split(catalog_model("llama-3.1-8b"), p), (std::vector<int>{11, 11, 10}));
    p = cfg(1, 4, 1, 1);
    EXPECT_EQ(pp_layer_split(catalog_model("deepseek-v3"), p), (std::vector<int>{15, 15, 16, 15}));
    EXPECT_EQ(pp_layer_split(catalog_model("llama-3.1-405b"), p),
              (std::vector<int>{31, 32, 32, 31}));
    p = cfg(1, 2, 1, 1);
    EXPECT_EQ(pp_layer_split(catalog_model("deepseek-v3"), p), (std::vector<int>{31, 30}));
    p = cfg(1, 3, 1, 1);
    p.pp_layers = {8, 12, 12};
    const auto u = make_layout(catalog_model("llama-3.1-8b"), p);
    EXPECT_EQ(u.ranks[1].layer_begin, 8);
    EXPECT_EQ(u.ranks[1].layer_end, 20);
    EXPECT_EQ(u.ranks[1].kv_bytes_per_token, 12 * 2 * 8 * 128 * 2);
}

// §6: TP=8 x SP=4 — the tokens of one sequence are spread over 4 CP ranks.
TEST(LayoutSeed, Tp8Sp4SplitsTokens) {
    auto p = cfg(8, 1, 4, 1);
    p.cp_scheme = CpScheme::kZigzag;
    const auto l = make_layout(catalog_model("llama-3.1-70b"), p);
    ASSERT_EQ(l.world_size(), 32);
    const int64_t seq = 131072;
    int64_t total_tokens = 0;
    for (int r = 0; r < 32; ++r) {
        const auto& rk = l.ranks[r];
        EXPECT_EQ(rk.coord.cp, r / 8);
        EXPECT_EQ(rk.kv_heads, std::vector<int>{r % 8});
        EXPECT_EQ(rk.kv_bytes_per_token, 80 * 2 * 1 * 128 * 2);
        const auto ranges = cp_token_ranges(p, rk.coord.cp, seq);
        // Zigzag: chunks c and 7-c of 8, 16384 tokens each (CP rank 3's chunks 3 and 4 touch).
        const int c = rk.coord.cp;
        if (c < 3) {
            ASSERT_EQ(ranges.size(), 2u);
            EXPECT_EQ(ranges[0], (TokenRange{16384 * c, 16384 * (c + 1)}));
            EXPECT_EQ(ranges[1], (TokenRange{16384 * (7 - c), 16384 * (8 - c)}));
        } else {
            EXPECT_EQ(ranges, (std::vector<TokenRange>{{16384 * 3, 16384 * 5}}));
        }
        int64_t held = 0;
        for (const auto& tr : ranges) held += tr.size();
        EXPECT_EQ(held, seq / 4);
        // Per-rank KV of the 128K sequence: a quarter of the tokens at one head's bytes.
        EXPECT_EQ(held * rk.kv_bytes_per_token, int64_t{32768} * 40960);
        if (rk.coord.tp == 0) total_tokens += held;
    }
    EXPECT_EQ(total_tokens, seq);
    for (int64_t t = 0; t < seq; t += 997) {
        const int owner = cp_owner(p, seq, t);
        bool found = false;
        for (const auto& tr : cp_token_ranges(p, owner, seq))
            found = found || (t >= tr.begin && t < tr.end);
        EXPECT_TRUE(found) << t;
    }
}

// §6: TP=4 x EP=8 on a MoE model — EP spreads the 8 experts over the dp*cp*tp = 8 ranks of the
// stage; KV still follows TP (2 of Mixtral's 8 KV heads per rank) and DP.
TEST(LayoutSeed, Tp4Ep8OnMixtral) {
    const auto l = make_layout(catalog_model("mixtral-8x7b"), cfg(4, 1, 1, 2, 8));
    ASSERT_EQ(l.world_size(), 8);
    for (int r = 0; r < 8; ++r) {
        const auto& rk = l.ranks[r];
        EXPECT_EQ(rk.coord.tp, r % 4);
        EXPECT_EQ(rk.coord.dp, r / 4);
        EXPECT_EQ(rk.coord.ep, r);
        EXPECT_EQ(rk.expert_begin, r);
        EXPECT_EQ(rk.expert_end, r + 1);
        EXPECT_EQ(rk.kv_heads, (std::vector<int>{2 * (r % 4), 2 * (r % 4) + 1}));
        EXPECT_EQ(rk.kv_bytes_per_token, 32 * 2 * 2 * 128 * 2);
    }
    // EP=1: every rank holds all experts (TP-split).
    const auto tp_only = make_layout(catalog_model("mixtral-8x7b"), cfg(4, 1, 1, 2, 1));
    EXPECT_EQ(tp_only.ranks[5].expert_begin, 0);
    EXPECT_EQ(tp_only.ranks[5].expert_end, 8);
}

// MLA: every TP rank holds the whole latent; the replicas are all other TP ranks.
TEST(LayoutSeed, MlaLatentOnEveryTpRank) {
    const auto l = make_layout(catalog_model("deepseek-v3"), cfg(8, 1, 1, 1));
    EXPECT_EQ(l.head_replication(), 8);
    for (int r = 0; r < 8; ++r) {
        EXPECT_EQ(l.ranks[r].kv_heads, std::vector<int>{0});
        EXPECT_EQ(l.ranks[r].head_replica_ranks.size(), 7u);
        EXPECT_EQ(l.ranks[r].kv_bytes_per_token, 61 * (512 + 64) * 2);
    }
}

TEST(LayoutSeed, JsonHasTheIssueKeys) {
    const auto l = make_layout(catalog_model("llama-3.1-70b"), cfg(8, 2, 1, 1));
    const std::string j = to_json(l);
    for (const char* k : {"\"world_size\": 16", "\"ranks\"", "\"kv_heads\"", "\"layers\"",
                          "\"kv_bytes_per_token\""})
        EXPECT_NE(j.find(k), std::string::npos) << k;
}

}  // namespace
}  // namespace kvshard
