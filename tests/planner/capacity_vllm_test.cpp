// Capacity of hybrid models against vLLM v1's allocator, computed by hand from its source
// (vllm/v1/core/kv_cache_utils.py and vllm/v1/kv_cache_interface.py @001cabc1,
// HybridAttentionMambaModelConfig in vllm/model_executor/models/config.py @1936cf38): H100-80G,
// mem_util 0.9, 2 GiB reserve, block 16, vLLM's available memory = kvshard's KV budget.
#include <gtest/gtest.h>

#include "kvshard/cache/kv_group_manager.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/capacity.h"

namespace kvshard {
namespace {

ParallelConfig tp(int n) {
    ParallelConfig p;
    p.tp = n;
    return p;
}

CapacityReport on_h100(const std::string& model, int tp_size, int64_t context,
                       CapacityOptions o = {}) {
    o.context_tokens = context;
    // max_context as vLLM's memory check gives it, past the model's max_model_len (as with
    // VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); capacity_test.cpp checks the cap.
    o.allow_long_context = true;
    return compute_capacity(catalog_model(model), tp(tp_size), hardware_by_name("h100-sxm"), o);
}

TEST(CapacityVllm, Gemma3PadsItsSixSlidingGroupsToTenLayers) {
    const CapacityReport c = on_h100("gemma-3-27b", 1, 8192);
    // 10 full + 52 sliding(1024) layers: group size 10 (52 >= 1.5 x 10), 1 full + ceil(52/10) = 6
    // sliding groups, 70 slots for 62 layers.
    EXPECT_EQ(c.engine.kind, EngineKvKind::kHybrid);
    EXPECT_EQ(c.engine.group_size, 10);
    EXPECT_EQ(c.engine.groups.size(), 7u);
    EXPECT_EQ(c.engine.padding_slots(), 8);
    const int64_t page = 16 * 2 * 16 * 128 * 2;  // tokens x (K,V) x heads x d x bf16
    EXPECT_EQ(c.engine.page_bytes, page);
    // The budget counts Gemma 3's four norms per layer and its q_norm / k_norm (head_dim 128):
    // 62 x (4 x 5376 + 2 x 128) bf16 weights beside the matrices.
    const int64_t budget = c.ranks[0].kv_budget_bytes;
    EXPECT_EQ(budget, 21143235072);
    EXPECT_EQ(c.kv_blocks_per_gpu, budget / page / 10);  // 16,131
    EXPECT_EQ(c.kv_blocks_per_gpu, 16131);
    EXPECT_EQ(c.kv_tokens_per_gpu, 16131 / 7 * 16);  // vLLM logs 36,864 (was 41,616)
    EXPECT_EQ(c.kv_tokens_per_gpu, 36864);
    // 8192 tokens: the full group 512 blocks, each sliding group ceil(1024/16) + 1 = 65.
    EXPECT_EQ(c.request_blocks, 512 + 6 * 65);
    EXPECT_EQ(c.requests_per_replica, 16131 / 902);  // 17 (was 19)
    EXPECT_EQ(c.requests_per_replica, 17);
    EXPECT_EQ(c.request_kv_bytes, 902 * page * 10);
    // vLLM's startup check: ceil(M/16) + 6 x (ceil((1023 + 8192)/16) + 1) <= 16,131 blocks.
    EXPECT_EQ(c.max_context, (16131 - 6 * (576 + 1)) * 16);
    EXPECT_EQ(c.max_context, 202704);  // was 252,704
    EXPECT_TRUE(c.fits);
}

TEST(CapacityVllm, LongestRequestIsVllmsStartupCheck) {
    CapacityOptions long_context;  // past Gemma 3's 131072, as VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
    long_context.allow_long_context = true;
    const CapacityReport c = on_h100("gemma-3-27b", 1, 230000, long_context);
    EXPECT_GE(c.requests_per_replica, 1);  // one such request's blocks fit ...
    EXPECT_FALSE(c.fits);                  // ... but vLLM refuses max_model_len 230000
    EXPECT_NE(c.why_not.find("max_num_batched_tokens"), std::string::npos) << c.why_not;
    CapacityOptions small;
    small.max_num_batched_tokens = 2048;
    EXPECT_EQ(on_h100("gemma-3-27b", 1, 0, small).max_context, 239568);
}

CapacityReport nemotron_h(DType ssm, int64_t context, CapacityOptions o = {}) {
    // The SSM state's dtype is pinned: vLLM's default for Nemotron-H depends on its version.
    ModelSpec m = catalog_model("nemotron-h-8b");
    m.state.state_dtype = ssm;
    o.context_tokens = context;
    o.allow_long_context = true;  // max_context past the model's 8192, as on_h100
    return compute_capacity(m, tp(1), hardware_by_name("h100-sxm"), o);
}

CapacityOptions prefix_caching_off() {
    CapacityOptions o;
    o.mamba_cache_mode = MambaCacheMode::kNone;
    return o;
}

// With prefix caching off (mamba_cache_mode none: vLLM before PR #50991, or
// --no-enable-prefix-caching), one state block per request and state group.
TEST(CapacityVllm, NemotronHRaisesTheBlockSoAPageHoldsAMambaState) {
    const CapacityReport c = nemotron_h(DType::kBf16, 8192, prefix_caching_off());
    // Mamba-2 state 2,158,592 B (bf16 SSM); one token's attention page 2 x 8 x 128 x 2 = 4096 B:
    // block 16 x ceil(2,158,592 / (16 x 4096)) = 528, page 528 x 4096 = 2,162,688 B.
    EXPECT_EQ(c.state_bytes_per_sequence / 24, 2158592);
    EXPECT_EQ(c.engine.block_size, 528);
    EXPECT_EQ(c.engine.page_bytes, 2162688);
    EXPECT_EQ(c.engine.state_page_padding, 2162688 - 2158592);
    // 4 full + 24 mamba2: group size 4, 1 + 6 groups, no padding.
    EXPECT_EQ(c.engine.groups.size(), 7u);
    EXPECT_EQ(c.engine.group_size, 4);
    EXPECT_EQ(c.kv_blocks_per_gpu, c.ranks[0].kv_budget_bytes / (2162688LL * 4));
    EXPECT_EQ(c.kv_blocks_per_gpu, 6815);
    EXPECT_EQ(c.kv_tokens_per_gpu, 6815 / 7 * 528);  // 513,744, as vLLM logs it
    EXPECT_EQ(c.request_blocks, 16 + 6);             // ceil(8192 / 528) + one per state group
    EXPECT_EQ(c.requests_per_replica, 309);          // was 316
    EXPECT_EQ(c.max_context, (6815 - 6) * 528);
    // fp32 SSM: 4,255,744 B of state, block 16 x ceil(4,255,744 / 65,536) = 1040, page
    // 4,259,840 B, 3460 blocks, ceil(8192 / 1040) + 6 = 14 per request.
    const CapacityReport f = nemotron_h(DType::kFp32, 8192, prefix_caching_off());
    EXPECT_EQ(f.engine.block_size, 1040);
    EXPECT_EQ(f.kv_blocks_per_gpu, 3460);
    EXPECT_EQ(f.kv_tokens_per_gpu, 3460 / 7 * 1040);  // 513,760
    EXPECT_EQ(f.requests_per_replica, 3460 / 14);     // 247
}

TEST(CapacityVllm, NemotronHWithPrefixCachingHoldsTwoStateBlocksPerGroup) {
    // mamba_cache_mode align (vLLM's default for hybrid models since PR #50991): the same block
    // (1040) and blocks per GPU (3460), but a request of 8192 tokens holds ceil(8192 / 1040) + 6 x
    // 2 = 20 blocks at its peak (MambaManager) and vLLM's startup check charges each of the 6 state
    // groups 2 blocks (MambaSpec.max_memory_usage_bytes): max_model_len (3460 - 12) x 1040. It is
    // kvshard's default, as it is vLLM's.
    const CapacityReport a = nemotron_h(DType::kFp32, 8192);
    EXPECT_EQ(a.engine.mamba_cache_mode, MambaCacheMode::kAlign);
    EXPECT_EQ(a.engine.block_size, 1040);
    EXPECT_EQ(a.kv_blocks_per_gpu, 3460);
    EXPECT_EQ(a.request_blocks, 8 + 6 * 2);
    EXPECT_EQ(a.requests_per_replica, 3460 / 20);  // 173 (247 with prefix caching off)
    EXPECT_EQ(a.max_context, (3460 - 12) * 1040);  // 3,585,920 (3,592,160 off)
    EXPECT_EQ(nemotron_h(DType::kFp32, 8192, prefix_caching_off()).max_context, (3460 - 6) * 1040);
}

TEST(CapacityVllm, AGivenBlockSizeIsKeptAndVllmsIsNamed) {
    CapacityOptions o = prefix_caching_off();
    o.raise_block_size = false;
    const CapacityReport kept = nemotron_h(DType::kBf16, 8192, o);
    EXPECT_EQ(kept.engine.kind, EngineKvKind::kSeparate);
    EXPECT_EQ(kept.engine.vllm_block_size, 528);
    EXPECT_NE(kept.engine.note.find("528"), std::string::npos) << kept.engine.note;
    o.block_size = 528;  // vLLM's own: the same figures as when kvshard raises it
    const CapacityReport given = nemotron_h(DType::kBf16, 8192, o);
    EXPECT_EQ(given.engine.kind, EngineKvKind::kHybrid);
    EXPECT_EQ(given.requests_per_replica, 309);
}

TEST(CapacityVllm, Qwen3NextTp4) {
    const CapacityReport c = on_h100("qwen3-next-80b-a3b", 4, 8192, prefix_caching_off());
    // GDN state per rank 3 x (8 x 128 + 2 x 4 x 128) x 2 + 8 x 128 x 128 x 2 = 274,432 B; one
    // token's attention page 2 x max(1, 2/4) x 256 x 2 = 1024 B: block 16 x ceil(274,432 /
    // 16,384) = 272, page 278,528 B; 12 full + 36 GDN: group size 12, 1 + 3 groups.
    EXPECT_EQ(c.engine.block_size, 272);
    EXPECT_EQ(c.engine.page_bytes, 278528);
    EXPECT_EQ(c.engine.groups.size(), 4u);
    // The weights hold the attention layers' output gate (Qwen3NextAttention's q_proj of 2 x
    // 16 heads, docs/model.md "Parameters"): 12 x 2048 x 4 x 256 more per rank than before it was
    // counted, 15 blocks fewer (10,557 -> 10,542).
    EXPECT_EQ(c.kv_blocks_per_gpu, c.ranks[0].kv_budget_bytes / (278528LL * 12));
    EXPECT_EQ(c.kv_blocks_per_gpu, 10542);
    EXPECT_EQ(c.kv_tokens_per_gpu, 10542 / 4 * 272);  // 716,720
    EXPECT_EQ(c.request_blocks, 31 + 3);              // ceil(8192 / 272) + 3
    EXPECT_EQ(c.requests_per_replica, 310);           // was 319
    // Prefix caching on (the default): two state blocks per GDN group, 31 + 3 x 2 per request.
    const CapacityReport a = on_h100("qwen3-next-80b-a3b", 4, 8192);
    EXPECT_EQ(a.kv_blocks_per_gpu, 10542);
    EXPECT_EQ(a.request_blocks, 31 + 3 * 2);
    EXPECT_EQ(a.requests_per_replica, 10542 / 37);  // 284
}

// Kimi-Linear-48B-A3B: 7 MLA layers and 20 KDA layers. On an H100 (SM 9.x) vLLM's first MLA
// backend is FLASH_ATTN_MLA (vllm/platforms/cuda.py, _get_backend_priorities), whose kernel blocks
// are MultipleOf(16) (FlashAttnMLABackend.get_supported_kernel_block_sizes): the alignment is 16,
// as for FlashAttention. The MLA page per token is (512 + 64) x 2 = 1152 B at any TP.
TEST(CapacityVllm, KimiLinearTp4) {
    const ModelSpec m = load_hf_config(std::string(KVSHARD_TEST_DATA_DIR) +
                                       "/hf_configs/kimi-linear-48b-a3b-instruct.json");
    CapacityOptions o = prefix_caching_off();
    o.context_tokens = 8192;
    const CapacityReport c = compute_capacity(m, tp(4), hardware_by_name("h100-sxm"), o);
    // KDA state per rank (kda_state_shape at tp 4): conv 3 x (3 x 4096 / 4) x 2 = 18,432 B +
    // recurrent 8 x 128 x 128 x 4 = 524,288 B = 542,720 B per layer. Block 16 x ceil(542,720 /
    // (16 x 1152)) = 16 x 30 = 480, page 480 x 1152 = 552,960 B, 10,240 B of it padding.
    EXPECT_EQ(c.state_bytes_per_sequence, 20 * 542720);
    EXPECT_EQ(c.engine.kind, EngineKvKind::kHybrid);
    EXPECT_EQ(c.engine.block_size, 480);
    EXPECT_EQ(c.engine.page_bytes, 552960);
    EXPECT_EQ(c.engine.state_page_padding, 552960 - 542720);
    // 7 MLA + 20 KDA: group size 7 (20 >= 1.5 x 7), 1 + ceil(20 / 7) = 4 groups, 28 slots for 27
    // layers.
    EXPECT_EQ(c.engine.group_size, 7);
    EXPECT_EQ(c.engine.groups.size(), 4u);
    EXPECT_EQ(c.engine.padding_slots(), 1);
    const int64_t blocks = c.ranks[0].kv_budget_bytes / (552960LL * 7);
    EXPECT_EQ(c.kv_blocks_per_gpu, blocks);
    EXPECT_EQ(c.kv_tokens_per_gpu, blocks / 4 * 480);
    EXPECT_EQ(c.request_blocks, 18 + 3);  // ceil(8192 / 480) + one per KDA group
    EXPECT_EQ(c.requests_per_replica, blocks / 21);
    // Prefix caching on (vLLM's default, align mode): two state blocks per KDA group.
    CapacityOptions a;
    a.context_tokens = 8192;
    const CapacityReport ca = compute_capacity(m, tp(4), hardware_by_name("h100-sxm"), a);
    EXPECT_EQ(ca.kv_blocks_per_gpu, blocks);
    EXPECT_EQ(ca.request_blocks, 18 + 3 * 2);
    EXPECT_EQ(ca.requests_per_replica, blocks / 24);
}

// LFM2-1.2B on one H100: 6 GQA layers (8 KV heads of 64) and 10 short-conv layers whose conv
// state, 2 x 2048 x 2 = 8192 B, fits a block of 16 tokens' attention page (16 x 2 x 8 x 64 x 2 =
// 32,768 B): vLLM keeps block 16 and pads the state page to 32,768 B.
TEST(CapacityVllm, Lfm2KeepsBlock16AndPadsTheConvState) {
    const ModelSpec m =
        load_hf_config(std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/lfm2-1.2b.json");
    CapacityOptions o = prefix_caching_off();
    o.context_tokens = 8192;
    const CapacityReport c = compute_capacity(m, tp(1), hardware_by_name("h100-sxm"), o);
    EXPECT_EQ(c.state_bytes_per_sequence, 10 * 8192);
    EXPECT_EQ(c.engine.kind, EngineKvKind::kHybrid);
    EXPECT_EQ(c.engine.block_size, 16);
    EXPECT_EQ(c.engine.page_bytes, 32768);
    EXPECT_EQ(c.engine.state_page_padding, 32768 - 8192);
    // 6 attention + 10 short conv: group size 6 (10 >= 1.5 x 6), 1 + ceil(10 / 6) = 3 groups, 18
    // slots for 16 layers.
    EXPECT_EQ(c.engine.group_size, 6);
    EXPECT_EQ(c.engine.groups.size(), 3u);
    EXPECT_EQ(c.engine.padding_slots(), 2);
    const int64_t blocks = c.ranks[0].kv_budget_bytes / (32768LL * 6);
    EXPECT_EQ(c.kv_blocks_per_gpu, blocks);
    EXPECT_EQ(c.kv_tokens_per_gpu, blocks / 3 * 16);
    EXPECT_EQ(c.request_blocks, 512 + 2);  // 8192 / 16 + one per short-conv group
    EXPECT_EQ(c.requests_per_replica, blocks / 514);
    CapacityOptions a;
    a.context_tokens = 8192;
    EXPECT_EQ(compute_capacity(m, tp(1), hardware_by_name("h100-sxm"), a).request_blocks,
              512 + 2 * 2);
}

// Falcon-H1-7B on one H100: 44 decoder layers, each an attention branch (2 KV heads of 128) and a
// Mamba-2 branch side by side. vLLM registers 44 Attention layers and 44 MambaMixer2 layers (named
// model.{44 + i}.mixer, FalconH1ParallelHybrid), so its hybrid allocator sees 44 full-attention
// and 44 Mamba specs. HybridAttentionMambaModelConfig: the Mamba page (mamba2_state_shape at bf16)
// is 2 x (3 x (3072 + 2 x 256) + 24 x 128 x 256) = 1,594,368 B; one token's attention page 2 x 2
// x 128 x 2 = 1024 B; block 16 x cdiv(1,594,368, 16 x 1024) = 16 x 98 = 1568 tokens, page 1568 x
// 1024 = 1,605,632 B, the state padded by 11,264 B. Group size 44 (the kinds have as many layers
// each), one attention group and one Mamba group, no padding slots: a block id takes a page in
// each of 44 tensors.
TEST(CapacityVllm, FalconH1OneAttentionAndOneMambaGroup) {
    const ModelSpec m = load_hf_config(std::string(KVSHARD_TEST_DATA_DIR) +
                                       "/hf_configs/falcon-h1-7b-instruct.json");
    CapacityOptions o = prefix_caching_off();
    o.context_tokens = 8192;
    const CapacityReport c = compute_capacity(m, tp(1), hardware_by_name("h100-sxm"), o);
    EXPECT_EQ(c.state_bytes_per_sequence, 44 * 1594368);
    EXPECT_EQ(c.engine.kind, EngineKvKind::kHybrid);
    EXPECT_EQ(c.engine.block_size, 1568);
    EXPECT_EQ(c.engine.page_bytes, 1605632);
    EXPECT_EQ(c.engine.state_page_padding, 1605632 - 1594368);
    EXPECT_EQ(c.engine.group_size, 44);
    ASSERT_EQ(c.engine.groups.size(), 2u);
    EXPECT_EQ(c.engine.groups[0].kind, LayerKind::kFullAttention);
    EXPECT_EQ(c.engine.groups[1].kind, LayerKind::kMamba2);
    EXPECT_EQ(c.engine.padding_slots(), 0);
    const int64_t blocks = c.ranks[0].kv_budget_bytes / (1605632LL * 44);
    EXPECT_EQ(c.kv_blocks_per_gpu, blocks);
    EXPECT_EQ(c.kv_tokens_per_gpu, blocks / 2 * 1568);
    EXPECT_EQ(c.request_blocks, 6 + 1);  // ceil(8192 / 1568) + the Mamba group's one state
    EXPECT_EQ(c.requests_per_replica, blocks / 7);
    // kvshard's own block tables agree: a KvGroupManager over the model's KV groups at vLLM's
    // block size gives a request of 8192 tokens 6 attention blocks and one Mamba state slot.
    KvGroupManager mgr({group_pool_specs(kv_groups(m), blocks), 1568, false});
    const std::vector<int32_t> prompt(8192, 7);
    mgr.allocate(1, prompt);
    ASSERT_EQ(mgr.num_groups(), 2);
    EXPECT_EQ(mgr.resident_blocks(0, 1), 6);
    EXPECT_EQ(mgr.resident_blocks(1, 1), 1);
    EXPECT_EQ(mgr.resident_blocks(0, 1) + mgr.resident_blocks(1, 1), c.request_blocks);
    CapacityOptions a;
    a.context_tokens = 8192;
    EXPECT_EQ(compute_capacity(m, tp(1), hardware_by_name("h100-sxm"), a).request_blocks, 6 + 2);
    // pp 2: each stage holds 22 whole decoder layers (22 attention + 22 Mamba branches), so its
    // groups have 22 slots: half the bytes per block id.
    ParallelConfig pp2;
    pp2.pp = 2;
    const CapacityReport s = compute_capacity(m, pp2, hardware_by_name("h100-sxm"), o);
    EXPECT_EQ(s.engine.block_size, 1568);
    for (const auto& r : s.ranks)
        EXPECT_EQ(s.engine.block_bytes[static_cast<size_t>(r.rank)], 1605632LL * 22);
    // Weights: the parameters at bf16, two RMSNorms per decoder layer (input_layernorm and
    // pre_ff_layernorm of FalconH1ParallelHybrid, not two per cache layer) and the final norm
    // among them.
    const WeightBytes w = rank_weight_bytes(make_layout(m, tp(1)), 0);
    EXPECT_EQ(w.norms, 2 * (44 * 2 * 3072 + 3072));
    EXPECT_EQ(w.total(), 2 * m.total_params());
}

// LongCat-Flash-Chat: every cache layer that caches is MLA, one uniform group of 56 layers; its
// weights are the parameters plus, per decoder layer, input_layernorm[0..1] and
// post_attention_layernorm[0..1] (4 x hidden) and each attention's q_a and kv_a norms.
TEST(CapacityVllm, LongcatFlashOneMlaGroupAndItsNorms) {
    const ModelSpec m =
        load_hf_config(std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/longcat-flash-chat.json");
    ParallelConfig p;
    p.pp = 2;
    p.tp = 8;
    p.ep = 8;
    CapacityOptions o;
    o.context_tokens = 8192;
    const CapacityReport c = compute_capacity(m, p, hardware_by_name("h200"), o);
    EXPECT_EQ(c.engine.kind, EngineKvKind::kUniform);
    ASSERT_EQ(c.engine.groups.size(), 1u);
    EXPECT_EQ(c.engine.groups[0].layers.size(), 56u);
    // 14 decoder layers a stage, two latents of (512 + 64) x bf16 each, whole on every TP rank.
    EXPECT_EQ(c.engine.block_bytes[0], 16 * 14 * 2 * 576 * 2);
    const WeightBytes w = rank_weight_bytes(make_layout(m, ParallelConfig{}), 0);
    EXPECT_EQ(w.norms, 2 * (28 * (4 * 6144 + 2 * (1536 + 512)) + 6144));
    EXPECT_EQ(w.total(), 2 * m.total_params());
}

TEST(CapacityVllm, UnpaddedHybridsKeepTheirFigures) {
    // gpt-oss-120b: 18 sliding(128) + 18 full, group size 18, no padding. Its weights include
    // the bf16 biases of attention, router and experts (gpt_oss.py), 40 M parameters.
    const CapacityReport g = on_h100("gpt-oss-120b", 1, 8192);
    EXPECT_EQ(g.engine.padding_slots(), 0);
    EXPECT_EQ(g.kv_blocks_per_gpu, 16806);
    EXPECT_EQ(g.kv_tokens_per_gpu, 16806 / 2 * 16);        // 134,448 (135,536 without the biases)
    EXPECT_EQ(g.requests_per_replica, 16806 / (512 + 9));  // 32
    // vLLM's check: ceil(M/16) + ceil((127 + 8192)/16) + 1 <= 16,806.
    EXPECT_EQ(g.max_context, (16806 - 521) * 16);
    // Llama-4-Scout tp4: 36 chunked(8192) + 12 full, group size 12.
    EXPECT_EQ(on_h100("llama-4-scout", 4, 8192).kv_tokens_per_gpu, 432736);
    // Llama-3.1-70B: one group, as before (capacity_test.cpp's 1,404,320 at tp8).
    const CapacityReport l = on_h100("llama-3.1-70b", 8, 8192);
    EXPECT_EQ(l.engine.kind, EngineKvKind::kUniform);
    EXPECT_EQ(l.kv_tokens_per_gpu, 1404320);
    EXPECT_EQ(l.requests_per_replica, 1404320 / 8192);
}

}  // namespace
}  // namespace kvshard
