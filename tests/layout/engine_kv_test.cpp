// vLLM's KV cache arrangement (engine_kv.h) against its grouping rules, by hand.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "kvshard/common/error.h"
#include "kvshard/layout/engine_kv.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

TEST(EngineKv, GroupsTakeEveryNthLayerOfTheirKind) {
    const ModelSpec m = catalog_model("gemma-3-27b");  // full at layers 5, 11, ..., 59
    const EngineKvArrangement a = engine_kv_arrangement(make_layout(m, ParallelConfig{}), 16);
    ASSERT_EQ(a.kind, EngineKvKind::kHybrid);
    std::vector<int> sliding;
    for (int l = 0; l < 62; ++l)
        if ((l + 1) % 6 != 0) sliding.push_back(l);
    // Groups in the order of each kind's first layer: 6 sliding ones, then the full one.
    ASSERT_EQ(a.groups.size(), 7u);
    for (int i = 0; i < 6; ++i) {
        std::vector<int> want;
        for (size_t j = i; j < sliding.size(); j += 6) want.push_back(sliding[j]);
        EXPECT_EQ(a.groups[i].layers, want) << "group " << i;
        EXPECT_EQ(a.groups[i].kind, LayerKind::kSlidingWindow);
    }
    EXPECT_EQ(a.groups[6].layers, (std::vector<int>{5, 11, 17, 23, 29, 35, 41, 47, 53, 59}));
    EXPECT_EQ(a.group_size, 10);
    EXPECT_EQ(a.block_bytes[0], 10 * a.page_bytes);
}

TEST(EngineKv, SmallerGemma3sPadTheSameWay) {
    // Gemma-3-4B (34 layers: 5 full + 29 sliding) and 1B (26: 4 full + 22 sliding) keep the 5:1
    // pattern: group size 5 -> 1 + 6 groups, 35 slots; group size 4 -> 1 + 6 groups, 28 slots.
    for (auto [layers, group_size, padding] : {std::tuple{34, 5, 1}, std::tuple{26, 4, 2}}) {
        ModelSpec m = catalog_model("gemma-3-27b");
        m.layers.resize(layers);
        m.num_layers = layers;
        const EngineKvArrangement a = engine_kv_arrangement(make_layout(m, ParallelConfig{}), 16);
        EXPECT_EQ(a.group_size, group_size) << layers;
        EXPECT_EQ(a.groups.size(), 7u) << layers;
        EXPECT_EQ(a.padding_slots(), padding) << layers;
    }
}

TEST(EngineKv, EachPpStageHoldsAsManySlotsAsItsLargestGroupHasLayersThere) {
    ParallelConfig p;
    p.pp = 2;  // layers [0, 31) and [31, 62): 5 full and 26 sliding each, at most 5 per group
    const EngineKvArrangement a =
        engine_kv_arrangement(make_layout(catalog_model("gemma-3-27b"), p), 16);
    EXPECT_EQ(a.block_bytes[0], 5 * a.page_bytes);
    EXPECT_EQ(a.block_bytes[1], 5 * a.page_bytes);
}

TEST(EngineKv, FewerLayersThanOneAndAHalfTimesTheFewestUseTheMost) {
    // 12 sliding + 13 full (vLLM's own example, gpt-oss-20b + eagle): group size 13, 2 groups.
    ModelSpec m = catalog_model("tiny-swa");
    std::vector<LayerSpec> layers;
    for (int l = 0; l < 25; ++l) {
        LayerSpec s = m.layer(l % m.num_layers);
        s.kind = l < 12 ? LayerKind::kSlidingWindow : LayerKind::kFullAttention;
        s.window = l < 12 ? 8 : 0;
        layers.push_back(s);
    }
    m.num_layers = 25;
    m.layers = layers;
    const EngineKvArrangement a = engine_kv_arrangement(make_layout(m, ParallelConfig{}), 16);
    EXPECT_EQ(a.group_size, 13);
    EXPECT_EQ(a.groups.size(), 2u);
    EXPECT_EQ(a.padding_slots(), 1);
}

TEST(EngineKv, OneKindIsOneGroupOfEveryLayersPage) {
    const KvLayout l = make_layout(catalog_model("llama-3.1-8b"), ParallelConfig{});
    const EngineKvArrangement a = engine_kv_arrangement(l, 16);
    EXPECT_EQ(a.kind, EngineKvKind::kUniform);
    EXPECT_EQ(a.groups.size(), 1u);
    EXPECT_EQ(a.block_bytes[0], 16 * l.ranks[0].kv_bytes_per_token);
}

// vLLM raises the block of an attention + Mamba/GDN model to a multiple of the alignment
// a = max(the backend's smallest kernel block, 16 with FlashAttention / FlashInfer, the block size
// given): a x cdiv(state page, a x one token's attention page) (Platform._align_hybrid_block_size,
// vllm/platforms/interface.py, since vLLM PR #37467). A block size above 16 is the alignment, not
// 16: Qwen3-Next-80B at tp 4 (state 274,432 B per GDN layer, attention 1024 B per token) takes
// 32 x cdiv(274,432, 32,768) = 288 tokens at --block-size 32, not 16 x 17 = 272.
TEST(EngineKv, AGivenBlockSizeAboveSixteenIsTheAlignmentOfTheRaisedBlock) {
    ParallelConfig p;
    p.tp = 4;
    const KvLayout l = make_layout(catalog_model("qwen3-next-80b-a3b"), p);
    EXPECT_EQ(engine_kv_arrangement(l, 16).block_size, 272);  // 16 x cdiv(274,432, 16,384)
    const EngineKvArrangement a32 = engine_kv_arrangement(l, 32);
    EXPECT_EQ(a32.block_size, 288);
    EXPECT_EQ(a32.page_bytes, 288 * 1024);
    EXPECT_EQ(a32.state_page_padding, 288 * 1024 - 274432);
    EXPECT_EQ(engine_kv_arrangement(l, 64).block_size, 320);  // 64 x cdiv(274,432, 65,536)
    const EngineKvArrangement kept = engine_kv_arrangement(l, 32, /*raise_block_size=*/false);
    EXPECT_EQ(kept.kind, EngineKvKind::kSeparate);
    EXPECT_EQ(kept.vllm_block_size, 288);
    EXPECT_NE(kept.note.find("from 32 to 288"), std::string::npos) << kept.note;

    // Nemotron-H-8B at tp 1: state 61,440 B conv (bf16) + 4,194,304 B SSM (fp32) = 4,255,744 B,
    // attention 4096 B per token: 16 -> 1040, 32 -> 32 x 33 = 1056, 64 -> 64 x 17 = 1088.
    const KvLayout n = make_layout(catalog_model("nemotron-h-8b"), ParallelConfig{});
    EXPECT_EQ(engine_kv_arrangement(n, 16).block_size, 1040);
    EXPECT_EQ(engine_kv_arrangement(n, 32).block_size, 1056);
    EXPECT_EQ(engine_kv_arrangement(n, 64).block_size, 1088);
    // A block that already holds a state is kept, and one below 16 aligns to 16.
    EXPECT_EQ(engine_kv_arrangement(n, 2048).block_size, 2048);
    EXPECT_EQ(engine_kv_arrangement(n, 8).block_size, 1040);
}

// vLLM with prefix caching on (mamba_cache_mode "align", `vllm serve`'s default for hybrid models
// since vLLM PR #50991): MambaManager (vllm/v1/core/single_type_kv_cache_manager.py) gives a
// request 1 state block per state group at first, 1 more when it crosses a block and frees the
// older one a step later, so a request past one block holds 2 per group at its peak; the startup
// check charges MambaSpec.max_memory_usage_bytes = page x (2 + speculative blocks) in align mode, x
// (1 + ...) in none. Qwen3-Next-80B at tp 4: block 272, 1 full group and 3 GDN groups.
TEST(EngineKv, AlignModeHoldsTwoStateBlocksPastOneBlock) {
    ParallelConfig p;
    p.tp = 4;
    const KvLayout l = make_layout(catalog_model("qwen3-next-80b-a3b"), p);
    const EngineKvArrangement none = engine_kv_arrangement(l, 16, true, MambaCacheMode::kNone);
    const EngineKvArrangement align = engine_kv_arrangement(l, 16);  // the default
    ASSERT_EQ(align.block_size, 272);  // the block rule is the same in both modes
    ASSERT_EQ(align.groups.size(), 4u);
    EXPECT_EQ(engine_request_blocks(none, p, 8192), 31 + 3);       // ceil(8192 / 272) + 3 x 1
    EXPECT_EQ(engine_request_blocks(align, p, 8192), 31 + 3 * 2);  // + 3 x 2
    EXPECT_EQ(engine_request_blocks(align, p, 272), 1 + 3);        // within one block: 1 each
    EXPECT_EQ(engine_request_blocks(align, p, 273), 2 + 3 * 2);
    EXPECT_EQ(engine_startup_blocks(none, p, 8192, 8192), 31 + 3);
    EXPECT_EQ(engine_startup_blocks(align, p, 8192, 8192), 31 + 3 * 2);
    EXPECT_EQ(engine_startup_blocks(align, p, 100, 8192), 1 + 3 * 2);
    EXPECT_EQ(parse_mamba_cache_mode("align"), MambaCacheMode::kAlign);
    EXPECT_EQ(mamba_cache_mode_name(MambaCacheMode::kNone), "none");
    EXPECT_THROW(parse_mamba_cache_mode("all"), Error);
}

}  // namespace
}  // namespace kvshard
