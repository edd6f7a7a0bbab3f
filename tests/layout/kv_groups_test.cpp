// KV groups per rank, per-request KV bytes in whole blocks per group (with CP), and the
// KV-balanced PP split.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

TEST(KvGroups, OneGroupPerLayerShape) {
    const ModelSpec m = catalog_model("gpt-oss-120b");
    const auto groups = kv_groups(m);
    ASSERT_EQ(groups.size(), 2u);
    EXPECT_EQ(groups[0].kind, LayerKind::kSlidingWindow);
    EXPECT_EQ(groups[0].window, 128);
    EXPECT_EQ(groups[0].layers.size(), 18u);
    EXPECT_EQ(groups[0].layers.front(), 0);
    EXPECT_EQ(groups[1].kind, LayerKind::kFullAttention);
    EXPECT_EQ(groups[1].layers.front(), 1);
    // Nemotron-H: the MLP-only layers form no group.
    const auto nh = kv_groups(catalog_model("nemotron-h-8b"));
    ASSERT_EQ(nh.size(), 2u);
    EXPECT_EQ(nh[0].kind, LayerKind::kMamba2);
    EXPECT_EQ(nh[0].layers.size(), 24u);
    EXPECT_EQ(nh[1].layers, (std::vector<int>{7, 18, 29, 40}));
}

TEST(KvGroups, RanksHoldTheirStagesShareOfEachGroup) {
    ParallelConfig p;
    p.pp = 2;
    p.tp = 2;
    const KvLayout l = make_layout(catalog_model("tiny-hybrid"), p);
    for (const RankKv& r : l.ranks) {
        int64_t bytes = 0, state = 0;
        for (const auto& g : r.groups) {
            for (int layer : g.layers) {
                EXPECT_GE(layer, r.layer_begin);
                EXPECT_LT(layer, r.layer_end);
            }
            bytes += g.bytes_per_token;
            state += g.state_bytes_per_sequence;
        }
        EXPECT_EQ(bytes, r.kv_bytes_per_token);
        EXPECT_EQ(state, r.state_bytes_per_sequence);
    }
    // Stage 0 holds GDN layers 0 and 1: fp32, 2 of 4 value heads and 1 of 2 key heads per rank:
    // conv 3 x (2*8 + 2*1*8), state 2 x 8 x 8.
    EXPECT_EQ(l.ranks[0].state_bytes_per_sequence, 2 * 4 * (3 * (2 * 8 + 2 * 8) + 2 * 8 * 8));
    EXPECT_EQ(l.ranks[0].kv_bytes_per_token, 0);
}

TEST(KvGroups, FirstKeptPosition) {
    EXPECT_EQ(first_kept_position(LayerKind::kFullAttention, 0, 100), 0);
    EXPECT_EQ(first_kept_position(LayerKind::kSlidingWindow, 8, 5), 0);
    EXPECT_EQ(first_kept_position(LayerKind::kSlidingWindow, 8, 100), 92);
    EXPECT_EQ(first_kept_position(LayerKind::kChunkedLocal, 8, 16), 8);  // last token 15: chunk 1
    EXPECT_EQ(first_kept_position(LayerKind::kChunkedLocal, 8, 17), 16);
    EXPECT_EQ(first_kept_position(LayerKind::kMamba2, 0, 17), 17);
}

TEST(KvGroups, WindowedBlocksStayBoundedAsTheSequenceGrows) {
    const KvLayout l = make_layout(catalog_model("mistral-7b-v0.1"), ParallelConfig{});
    const int64_t per_block = 16 * l.ranks[0].kv_bytes_per_token;
    int64_t most = 0;
    for (int64_t len = 1; len <= 20000; len += 7) {
        const int64_t b = request_kv_bytes(l, 0, len, 16);
        EXPECT_EQ(b % per_block, 0);
        most = std::max(most, b);
        EXPECT_LE(b, request_kv_bytes_peak(l, 0, len, 16));
    }
    // 4096-token window in 16-token blocks: 256 blocks, 257 when the window starts mid-block.
    EXPECT_EQ(most, 257 * per_block);
    EXPECT_EQ(request_kv_bytes_peak(l, 0, 1 << 20, 16), 257 * per_block);
}

TEST(KvGroups, CpRanksSplitEachGroupsTokens) {
    const ModelSpec m = catalog_model("tiny-swa");  // window 8 on even layers
    for (CpScheme scheme : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave}) {
        ParallelConfig p;
        p.cp = 3;
        p.cp_scheme = scheme;
        p.cp_interleave = 2;
        const KvLayout l = make_layout(m, p);
        for (int64_t len : {1, 7, 8, 9, 50, 301}) {
            // At block size 1 the CP ranks hold exactly the tokens the whole sequence keeps.
            int64_t sum = 0;
            for (const RankKv& r : l.ranks) sum += request_kv_bytes(l, r.coord.rank, len, 1);
            const KvLayout one = make_layout(m, ParallelConfig{});
            EXPECT_EQ(sum, request_kv_bytes(one, 0, len, 1)) << len;
            int64_t tokens = 0;
            for (int c = 0; c < p.cp; ++c) tokens += cp_tokens_before(p, c, len, len);
            EXPECT_EQ(tokens, len);
        }
    }
}

TEST(KvGroups, KvBalancedPipelineSplit) {
    // tiny-hybrid: layers 0-2 hold a constant state, layer 3 all tokens. At a long context the
    // even split 2,2 puts all the token KV on stage 1; the balanced split gives stage 1 only
    // layer 3.
    const ModelSpec m = catalog_model("tiny-hybrid");
    ParallelConfig p;
    p.pp = 2;
    const auto even = pp_stage_kv_bytes(m, p, 100000);
    const auto split = pp_layer_split_kv_balanced(m, p, 100000);
    EXPECT_EQ(split, (std::vector<int>{3, 1}));
    ParallelConfig b = p;
    b.pp_layers = split;
    const auto bal = pp_stage_kv_bytes(m, b, 100000);
    EXPECT_LT(*std::max_element(bal.begin(), bal.end()),
              *std::max_element(even.begin(), even.end()));
    EXPECT_EQ(std::accumulate(bal.begin(), bal.end(), int64_t{0}),
              std::accumulate(even.begin(), even.end(), int64_t{0}));
    // A uniform model keeps its even split.
    ParallelConfig q;
    q.pp = 4;
    EXPECT_EQ(pp_layer_split_kv_balanced(catalog_model("llama-3.1-8b"), q, 4096),
              (std::vector<int>{8, 8, 8, 8}));
}

}  // namespace
}  // namespace kvshard
