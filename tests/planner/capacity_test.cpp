// Capacity against hand-computed engine formulas (vLLM determine_num_available_blocks, SGLang
// profile_max_num_token): KV heads per rank = max(1, H_kv / tp); MLA = (kv_lora_rank + rope) per
// layer.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

ParallelConfig cfg(int tp, int pp = 1, int cp = 1, int dp = 1, int ep = 1) {
    ParallelConfig p;
    p.tp = tp;
    p.pp = pp;
    p.cp = cp;
    p.dp = dp;
    p.ep = ep;
    return p;
}

TEST(Capacity, Llama70bTp8OnH100MatchesHandComputedEngineFormula) {
    const auto m = catalog_model("llama-3.1-70b");
    CapacityOptions long_context;  // the memory check's figure, past the model's 131072 tokens
    long_context.allow_long_context = true;
    const auto rep = compute_capacity(m, cfg(8), hardware_by_name("h100-sxm"), long_context);
    // Per rank and layer: Q and O for 64/8 = 8 heads, K and V for 8/8 = 1 head; the MLP split by 8.
    const int64_t attn = 2LL * 8192 * 8 * 128 + 2LL * 8192 * 1 * 128;
    const int64_t mlp = 3LL * 8192 * 28672 / 8;
    const int64_t vocab = (128256 / 8) * 8192LL;  // embedding and LM head (pp = 1: both)
    const int64_t norms = 80LL * 2 * 8192 + 8192;
    const int64_t weights = 2 * (80 * (attn + mlp) + 2 * vocab + norms);
    EXPECT_EQ(rep.weight_bytes_per_gpu, weights);
    EXPECT_EQ(weights, 17640734720LL);
    const int64_t kv_per_token = 80LL * 2 * 1 * 128 * 2;  // layers * (K,V) * heads * d * bf16
    EXPECT_EQ(rep.kv_bytes_per_token, kv_per_token);
    const int64_t budget = static_cast<int64_t>(80 * kGiB * 0.9) - weights - 2 * kGiB;
    const int64_t tokens = budget / kv_per_token / 16 * 16;
    EXPECT_EQ(rep.kv_tokens_per_gpu, tokens);
    EXPECT_EQ(rep.kv_tokens_per_gpu, 1404320);
    EXPECT_EQ(rep.kv_blocks_per_gpu, tokens / 16);
    EXPECT_EQ(rep.max_context, tokens);  // cp = 1: one GPU's KV
    EXPECT_FALSE(rep.context_limited_by_model);
    EXPECT_TRUE(rep.fits);
    // vLLM serves at most max_model_len (131072 for Llama 3.1) however much memory is left.
    const auto capped = compute_capacity(m, cfg(8), hardware_by_name("h100-sxm"));
    EXPECT_EQ(capped.max_context, 131072);
    EXPECT_TRUE(capped.context_limited_by_model);
    EXPECT_FALSE(capped.context_unbounded);
    EXPECT_EQ(capped.kv_tokens_per_gpu, tokens);
    for (const auto& r : rep.ranks) EXPECT_EQ(r.kv_tokens, tokens);
}

TEST(Capacity, TpLargerThanKvHeadsReplicatesHeads) {
    const auto m = catalog_model("llama-3.1-70b");
    const auto hw = hardware_by_name("h100-sxm");
    const auto r16 = compute_capacity(m, cfg(16), hw);
    const auto r8 = compute_capacity(m, cfg(8), hw);
    // max(1, 8/16) = 1 head per rank: KV bytes per token per GPU do not halve past tp = H_kv.
    EXPECT_EQ(r16.kv_bytes_per_token, 80LL * 2 * 1 * 128 * 2);
    EXPECT_EQ(r16.kv_bytes_per_token, r8.kv_bytes_per_token);
    // The replicated K/V projections are counted on every holder.
    const auto w = rank_weight_bytes(make_layout(m, cfg(16)), 0);
    EXPECT_EQ(w.attention, 80LL * 2 * (2LL * 8192 * 4 * 128 + 2LL * 8192 * 1 * 128));
}

TEST(Capacity, MlaLatentIsNotSplitByTp) {
    auto m = catalog_model("deepseek-v3");
    const auto hw = hardware_by_name("b200");
    for (int tp : {1, 8, 16}) {
        const auto rep = compute_capacity(m, cfg(tp), hw);
        EXPECT_EQ(rep.kv_bytes_per_token, 61 * (512 + 64) * 2) << "tp=" << tp;
    }
    m.kv_dtype = DType::kFp8;
    EXPECT_EQ(compute_capacity(m, cfg(8), hw).kv_bytes_per_token, 61 * (512 + 64) * 1);
}

// fp8 KV: vLLM's pages hold 1 byte per element and nothing else (its fp8 cache keeps one k_scale
// and one v_scale per layer outside them), so the planner's blocks are the elements alone;
// kvshard's own pools add an fp32 scale per layer, K/V, block and KV head, which the layout still
// counts.
TEST(Capacity, Fp8BlocksAreVllmPages) {
    auto m = catalog_model("llama-3.1-8b");
    m.kv_dtype = DType::kFp8;
    const auto hw = hardware_by_name("h100-sxm");
    const auto rep = compute_capacity(m, cfg(2), hw);
    const auto& r0 = rep.ranks[0];
    const int64_t per_token = 32LL * 2 * 4 * 128;  // layers * K/V * heads per rank * head_dim
    EXPECT_EQ(r0.kv_bytes_per_token, per_token);
    EXPECT_EQ(rep.engine.block_bytes[0], 16 * per_token);
    EXPECT_EQ(rep.kv_tokens_per_gpu, r0.kv_budget_bytes / (16 * per_token) * 16);
    // kvshard's pool of the same rank: the scales on top of the pages.
    const KvLayout lay = make_layout(m, cfg(2));
    EXPECT_EQ(request_kv_bytes(lay, 0, 16, 16), 16 * per_token + 32LL * 2 * 4 * 4);
}

TEST(Capacity, ExpertsUnderEpAreWholeAndUnderTpAreSplit) {
    const auto m = catalog_model("mixtral-8x7b");
    const int64_t expert = 3LL * 4096 * 14336;
    const int64_t router = 4096LL * 8;
    // TP=4 x DP=2 with EP=8: each of the 8 ranks holds 1 whole expert per layer.
    const auto ep = rank_weight_bytes(make_layout(m, cfg(4, 1, 1, 2, 8)), 5);
    EXPECT_EQ(ep.experts, 32 * (expert + router) * 2);
    // EP=1: all 8 experts, each split over tp=4.
    const auto tp = rank_weight_bytes(make_layout(m, cfg(4)), 0);
    EXPECT_EQ(tp.experts, 32 * (8 * expert / 4 + router) * 2);
    EXPECT_EQ(tp.dense_mlp, 0);
}

TEST(Capacity, EmbeddingOnFirstStageLmHeadOnLast) {
    const auto m = catalog_model("llama-3.1-8b");
    const auto l = make_layout(m, cfg(2, 2));
    const auto first = rank_weight_bytes(l, 0), last = rank_weight_bytes(l, 2);
    EXPECT_EQ(first.embedding, 128256LL / 2 * 4096 * 2);
    EXPECT_EQ(first.lm_head, 0);
    EXPECT_EQ(last.embedding, 0);
    EXPECT_EQ(last.lm_head, 128256LL / 2 * 4096 * 2);
    // Tied embeddings on one stage are held once.
    auto tied = m;
    tied.tie_embeddings = true;
    const auto one = rank_weight_bytes(make_layout(tied, cfg(1)), 0);
    EXPECT_EQ(one.lm_head, 0);
    EXPECT_EQ(one.embedding, 128256LL * 4096 * 2);
    // Whole-model weights over tp=1 equal the parameter count, norms included.
    const auto all = rank_weight_bytes(make_layout(m, cfg(1)), 0);
    EXPECT_EQ(all.total(), m.total_params() * 2);
}

// Norms and biases per rank as vLLM shards them: RMSNorm weights and row-parallel biases whole on
// every rank, the q / k / v biases of QKVParallelLinear split with their heads (KV heads
// replicated where tp exceeds them).
TEST(Capacity, NormsReplicatedColumnParallelBiasesSplit) {
    ModelSpec qwen = catalog_model("qwen2.5-72b");  // q, k, v biases (vLLM qwen2.py)
    ASSERT_TRUE(qwen.norms.qkv_bias);
    const auto whole = rank_weight_bytes(make_layout(qwen, cfg(1)), 0);
    EXPECT_EQ(whole.total(), qwen.total_params() * 2);
    // tp 4: 16 of 64 query heads and 2 of 8 KV heads of 128 per rank.
    const auto tp4 = rank_weight_bytes(make_layout(qwen, cfg(4)), 0);
    EXPECT_EQ(tp4.norms, 2 * (80 * (2 * 8192 + 16 * 128 + 2 * 2 * 128) + 8192));
    // tp 16: 4 query heads, one (replicated) KV head per rank.
    const auto tp16 = rank_weight_bytes(make_layout(qwen, cfg(16)), 0);
    EXPECT_EQ(tp16.norms, 2 * (80 * (2 * 8192 + 4 * 128 + 2 * 1 * 128) + 8192));
    // o_proj's bias (attention_bias in Llama) and down_proj's are added once after the
    // all-reduce: whole on every rank; gate / up biases split with their columns.
    ModelSpec llama = catalog_model("llama-3.1-8b");
    llama.norms.qkv_bias = llama.norms.o_bias = llama.norms.mlp_bias = true;
    EXPECT_EQ(rank_weight_bytes(make_layout(llama, cfg(1)), 0).total(), llama.total_params() * 2);
    const auto b2 = rank_weight_bytes(make_layout(llama, cfg(2)), 0);
    EXPECT_EQ(b2.norms,
              2 * (32 * (2 * 4096 + (16 + 2 * 4) * 128 + 4096 + 2 * 14336 / 2 + 4096) + 4096));
    // Qwen3's q_norm / k_norm of head_dim are replicated.
    ModelSpec qk = catalog_model("qwen3-235b-a22b");
    ASSERT_EQ(qk.norms.qk, QkNorm::kPerHead);
    EXPECT_EQ(rank_weight_bytes(make_layout(qk, cfg(8)), 0).norms,
              2 * (94 * (2 * 4096 + 2 * 128) + 4096));
    // A router's bias is whole on every rank, beside the router.
    ModelSpec ds = catalog_model("deepseek-v3");
    const auto d1 = rank_weight_bytes(make_layout(ds, cfg(1)), 0, 16);
    EXPECT_EQ(d1.total(), ds.total_params() * 2);
}

TEST(Capacity, CpSpreadsOneRequestOverCpGpus) {
    const auto m = catalog_model("llama-3.1-70b");
    const auto hw = hardware_by_name("h100-sxm");
    for (auto scheme : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave}) {
        auto p = cfg(8, 1, 4);
        p.cp_scheme = scheme;
        p.cp_interleave = 16;
        CapacityOptions o;
        o.context_tokens = 1 << 20;
        o.allow_long_context = true;  // past Llama 3.1's 131072, as VLLM_ALLOW_LONG_MAX_MODEL_LEN
        const auto rep = compute_capacity(m, p, hw, o);
        EXPECT_GE(rep.max_context, 4 * rep.kv_tokens_per_gpu - 4 * 16) << cp_scheme_name(scheme);
        EXPECT_LE(rep.max_context, 4 * rep.kv_tokens_per_gpu) << cp_scheme_name(scheme);
        EXPECT_LE(cp_tokens_per_rank(p, rep.max_context), rep.kv_tokens_per_gpu);
        EXPECT_GT(cp_tokens_per_rank(p, rep.max_context + 1), rep.kv_tokens_per_gpu);
        // 2^20 tokens / 4 ranks = 262144 tokens per rank = 16384 blocks per request.
        EXPECT_EQ(rep.requests_per_replica, rep.kv_blocks_per_gpu / 16384);
        EXPECT_EQ(rep.fits, rep.max_context >= (1 << 20));
    }
}

TEST(Capacity, CpTokensPerRankAgreesWithTokenRanges) {
    for (auto scheme : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave})
        for (int cp : {1, 2, 3, 4})
            for (int64_t len : {0, 1, 7, 16, 100, 1001}) {
                ParallelConfig p = cfg(1, 1, cp);
                p.cp_scheme = scheme;
                p.cp_interleave = 3;
                int64_t most = 0;
                for (int r = 0; r < cp; ++r) {
                    int64_t n = 0;
                    for (const auto& tr : cp_token_ranges(p, r, len)) n += tr.size();
                    most = std::max(most, n);
                }
                EXPECT_EQ(cp_tokens_per_rank(p, len), most)
                    << cp_scheme_name(scheme) << " cp=" << cp << " len=" << len;
            }
}

TEST(Capacity, ConcurrencyAndFit) {
    const auto m = catalog_model("llama-3.1-8b");
    CapacityOptions o;
    o.context_tokens = 8192;
    o.allow_long_context = true;  // max_context as memory allows (above the model's 131072)
    const auto rep = compute_capacity(m, cfg(1, 1, 1, 4), hardware_by_name("h100-sxm"), o);
    EXPECT_EQ(rep.requests_per_replica, rep.kv_tokens_per_gpu / 8192);
    EXPECT_EQ(rep.max_concurrency, 4 * rep.requests_per_replica);
    // 405B in bf16 on one 80 GiB GPU does not fit, and says why.
    const auto big =
        compute_capacity(catalog_model("llama-3.1-405b"), cfg(1), hardware_by_name("h100-sxm"));
    EXPECT_FALSE(big.fits);
    EXPECT_EQ(big.kv_tokens_per_gpu, 0);
    EXPECT_NE(big.why_not.find("weights"), std::string::npos) << big.why_not;
    // A context longer than the KV capacity does not fit (past the model's 131072 tokens too).
    o.context_tokens = rep.max_context + 1;
    EXPECT_FALSE(compute_capacity(m, cfg(1), hardware_by_name("h100-sxm"), o).fits);
}

TEST(Capacity, BadOptionsAreErrors) {
    const auto m = catalog_model("tiny");
    const auto hw = hardware_by_name("a100-80g");
    CapacityOptions o;
    o.mem_util = 1.5;
    EXPECT_THROW(compute_capacity(m, cfg(1), hw, o), Error);
    o = {};
    o.block_size = 0;
    EXPECT_THROW(compute_capacity(m, cfg(1), hw, o), Error);
    o = {};
    o.activation_reserve_bytes = -1;
    EXPECT_THROW(compute_capacity(m, cfg(1), hw, o), Error);
    o = {};
    o.context_tokens = -5;
    EXPECT_THROW(compute_capacity(m, cfg(1), hw, o), Error);
}

// Nemotron 3 Super at pp 8 (11 of its 88 layers a stage, its pattern's 8 attention layers on
// stages 0 to 4, stages 5 to 7 only Mamba-2 and MoE): a Mamba-only stage stores no KV per token
// and may hold the fewest blocks (the limiting rank); the report's KV bytes per token is the most
// any GPU stores, as its weights per GPU, not that stage's 0.
TEST(Capacity, KvBytesPerTokenIsTheMostAnyPpStageStores) {
    const ModelSpec m = load_hf_config(std::string(KVSHARD_TEST_DATA_DIR) +
                                       "/hf_configs/nemotron-3-super-120b-a12b.json");
    const auto rep = compute_capacity(m, cfg(1, 8), hardware_by_name("h100-sxm"));
    ASSERT_EQ(rep.ranks.size(), 8u);
    // Stages 1 and 4 hold two attention layers (2 KV heads of 128, K and V, bf16), the others
    // one or none.
    const int64_t two_layers = 2 * 2 * 2 * 128 * 2;
    EXPECT_EQ(rep.ranks[1].kv_bytes_per_token, two_layers);
    EXPECT_EQ(rep.ranks[4].kv_bytes_per_token, two_layers);
    for (int r : {5, 6, 7}) EXPECT_EQ(rep.ranks[r].kv_bytes_per_token, 0) << "stage " << r;
    EXPECT_GE(rep.limiting_rank, 5);  // a Mamba-only stage has the fewest blocks
    EXPECT_EQ(rep.ranks[rep.limiting_rank].kv_bytes_per_token, 0);
    EXPECT_EQ(rep.kv_bytes_per_token, two_layers);
    // The limiting rank's own figures stay its: weights are the most any rank holds.
    int64_t most_weights = 0;
    for (const auto& rc : rep.ranks) most_weights = std::max(most_weights, rc.weights.total());
    EXPECT_EQ(rep.weight_bytes_per_gpu, most_weights);
}

}  // namespace
}  // namespace kvshard
