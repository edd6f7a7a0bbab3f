// Real model shapes: the published config.json of 46 families (tests/data/hf_configs/, sources in
// its README) read into per-layer specs, and their KV figures per rank checked against figures this
// test computes itself from the formulas of docs/model.md and each model's published field values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

std::string config_path(const std::string& name) {
    return std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/" + name + ".json";
}

std::string read_file(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

// One layer as the test knows it from the model card: 'F' full, 'S' sliding, 'C' chunked,
// 'L' latent (MLA), 'G' Gated DeltaNet, 'M' Mamba-2, '1' Mamba-1, 'X' short conv, '-' no KV.
struct L {
    char kind;
    int kv_heads = 0, head_dim = 0, window = 0;
};

// Recurrent state per sequence and layer at tp (heads and groups split, at least one each), bf16:
// conv (k-1) x (heads*head_dim + 2*groups*group_dim), state heads x head_dim x group_dim.
int64_t state_bf16(int heads, int head_dim, int groups, int group_dim, int k, int tp) {
    const int64_t h = std::max(1, heads / tp), g = std::max(1, groups / tp);
    return 2 * ((k - 1) * (h * head_dim + 2 * g * group_dim) + h * head_dim * group_dim);
}

// Qwen3.5: the conv state at bf16, the recurrent state at the config's mamba_ssm_dtype (fp32).
int64_t state_bf16_ssm_fp32(int heads, int head_dim, int groups, int group_dim, int k, int tp) {
    const int64_t h = std::max(1, heads / tp), g = std::max(1, groups / tp);
    return 2 * (k - 1) * (h * head_dim + 2 * g * group_dim) + 4 * h * head_dim * group_dim;
}

// Kimi Linear's KDA layer as vLLM sizes it (MambaStateShapeCalculator.kda_state_shape, dtypes
// from MambaStateDtypeCalculator.kda_state_dtype): conv (k-1) x (heads*dim + 2*heads*dim) / tp at
// the model's bf16, recurrent (heads/tp) x dim x dim always float32.
int64_t kda_state(int heads, int dim, int k, int tp) {
    return int64_t{k - 1} * (3 * heads * dim / tp) * 2 + int64_t{heads / tp} * dim * dim * 4;
}

// A Mamba-1 layer as vLLM sizes it (MambaStateShapeCalculator.mamba1_state_shape, dtypes from
// MambaStateDtypeCalculator.mamba1_state_dtype: the model's bf16 for both): conv (d_conv - 1) x
// (d_inner / tp), SSM (d_inner / tp) x d_state.
int64_t mamba1_state_by_hand(int d_inner, int d_state, int d_conv, int tp) {
    const int64_t c = d_inner / tp;
    return 2 * (int64_t{d_conv - 1} * c + c * d_state);
}

struct Family {
    std::string file;
    std::vector<L> layers;
    std::vector<int> tps;      // valid TP sizes among 1, 2, 4, 8
    int64_t latent_bytes = 0;  // MLA: per token and layer, whole (replicated over tp)
    int64_t indexer_bytes = 0;
    std::function<int64_t(int tp)> state{};  // per state layer and sequence
};

std::vector<L> pattern(int n, const std::function<L(int)>& f) {
    std::vector<L> v;
    for (int i = 0; i < n; ++i) v.push_back(f(i));
    return v;
}

std::vector<Family> families() {
    std::vector<Family> out;
    auto uniform = [](int n, L l) { return pattern(n, [l](int) { return l; }); };
    out.push_back({"llama-3.1-8b", uniform(32, {'F', 8, 128}), {1, 2, 4, 8}});
    out.push_back({"mixtral-8x7b-v0.1", uniform(32, {'F', 8, 128}), {1, 2, 4, 8}});
    out.push_back({"mistral-7b-v0.1", uniform(32, {'S', 8, 128, 4096}), {1, 2, 4, 8}});
    out.push_back({"qwen2.5-7b", uniform(28, {'F', 4, 128}), {1, 2, 4}});
    out.push_back({"qwen3-8b", uniform(36, {'F', 8, 128}), {1, 2, 4, 8}});
    out.push_back({"qwen3-30b-a3b", uniform(48, {'F', 4, 128}), {1, 2, 4, 8}});
    // Qwen3-VL-30B-A3B: Qwen3-30B-A3B's decoder under a vision wrapper's text_config.
    out.push_back({"qwen3-vl-30b-a3b", uniform(48, {'F', 4, 128}), {1, 2, 4, 8}});
    out.push_back({"glm-4-9b-chat", uniform(40, {'F', 2, 128}), {1, 2, 4, 8}});
    // GLM-4.5-Air: 96 query heads of 128 (not hidden / heads = 42.7), 8 KV heads.
    out.push_back({"glm-4.5-air", uniform(46, {'F', 8, 128}), {1, 2, 4, 8}});
    // MiniMax-M2: every layer full attention (attn_type_list all 1), 48 heads of 128, 8 KV heads.
    out.push_back({"minimax-m2", uniform(62, {'F', 8, 128}), {1, 2, 4, 8}});
    out.push_back({"falcon-7b-instruct", uniform(32, {'F', 1, 64}), {1}});  // 71 heads, MQA
    // Llama 4: RoPE layers attend within chunks of 8192, every 4th layer (NoPE) fully.
    out.push_back({"llama-4-scout",
                   pattern(48,
                           [](int i) {
                               return (i + 1) % 4 ? L{'C', 8, 128, 8192} : L{'F', 8, 128};
                           }),
                   {1, 2, 4, 8}});
    out.push_back({"gemma-2-9b-it",
                   pattern(42,
                           [](int i) {
                               return i % 2 == 0 ? L{'S', 8, 256, 4096} : L{'F', 8, 256};
                           }),
                   {1, 2, 4, 8}});
    out.push_back({"gemma-3-27b",
                   pattern(62,
                           [](int i) {
                               return (i + 1) % 6 ? L{'S', 16, 128, 1024} : L{'F', 16, 128};
                           }),
                   {1, 2, 4, 8}});
    out.push_back({"gpt-oss-120b",
                   pattern(36,
                           [](int i) {
                               return i % 2 == 0 ? L{'S', 8, 64, 128} : L{'F', 8, 64};
                           }),
                   {1, 2, 4, 8}});
    out.push_back({"deepseek-v3", uniform(61, {'L'}), {1, 2, 4, 8}, 2 * (512 + 64)});
    // V3.2: plus the indexer's key, 128 fp8 values and one fp32 scale per token and layer.
    out.push_back({"deepseek-v3.2-exp", uniform(61, {'L'}), {1, 2, 4, 8}, 2 * (512 + 64), 128 + 4});
    // Qwen3-Next: 3 Gated DeltaNet layers (16 key heads, 32 value heads, 128 dims, conv 4) per
    // full-attention layer (2 KV heads of 256).
    out.push_back({"qwen3-next-80b-a3b",
                   pattern(48,
                           [](int i) {
                               return (i + 1) % 4 ? L{'G'} : L{'F', 2, 256};
                           }),
                   {1, 2, 4, 8},
                   0,
                   0,
                   [](int tp) { return state_bf16(32, 128, 16, 128, 4, tp); }});
    // Qwen3.5-35B-A3B: Qwen3-Next's pattern under a vision wrapper's text_config; its recurrent
    // state is float32 (mamba_ssm_dtype), as vLLM's Qwen3_5ForConditionalGenerationConfig sizes it.
    out.push_back({"qwen3.5-35b-a3b",
                   pattern(40,
                           [](int i) {
                               return (i + 1) % 4 ? L{'G'} : L{'F', 2, 256};
                           }),
                   {1, 2, 4, 8},
                   0,
                   0,
                   [](int tp) { return state_bf16_ssm_fp32(32, 128, 16, 128, 4, tp); }});
    // Nemotron-H-8B: hybrid_override_pattern, Mamba-2 with 128 heads of 64, 8 groups, state 128.
    const std::string nh = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-";
    out.push_back(
        {"nemotron-h-8b",
         pattern(52,
                 [nh](int i) {
                     return nh[i] == 'M' ? L{'M'} : nh[i] == '*' ? L{'F', 8, 128} : L{'-'};
                 }),
         {1, 2, 4, 8},
         0,
         0,
         // vLLM's NemotronHForCausalLMConfig: the SSM state at float32 unless the config names one.
         [](int tp) { return state_bf16_ssm_fp32(128, 64, 8, 128, 4, tp); }});
    // Granite-4.0-H-Tiny: layer_types of 36 "mamba" and 4 "attention" (layers 5, 15, 25, 35);
    // attention heads of hidden / heads = 1536 / 12 = 128, 4 KV heads (12 query heads: no tp 8);
    // Mamba-2 of 48 heads of 64 (= 2 x 1536), one group, state 128, all at the model's bf16.
    out.push_back({"granite-4.0-h-tiny",
                   pattern(40,
                           [](int i) {
                               return i % 10 == 5 ? L{'F', 4, 128} : L{'M'};
                           }),
                   {1, 2, 4},
                   0,
                   0,
                   [](int tp) { return state_bf16(48, 64, 1, 128, 4, tp); }});
    // Kimi-Linear-48B-A3B: linear_attn_config.full_attn_layers 4, 8, ..., 24, 27 (1-based) are
    // MLA (latent 512 + rope 64), the other 20 KDA of 32 heads of 128, short conv 4.
    out.push_back({"kimi-linear-48b-a3b-instruct",
                   pattern(27, [](int i) { return (i + 1) % 4 == 0 || i == 26 ? L{'L'} : L{'G'}; }),
                   {1, 2, 4, 8},
                   2 * (512 + 64),
                   0,
                   [](int tp) { return kda_state(32, 128, 4, tp); }});
    // LFM2-1.2B: full_attn_idxs 2, 5, 8, 10, 12, 14 are GQA (8 KV heads of 2048 / 32 = 64), the
    // other 10 short conv: vLLM's short_conv_state_shape keeps (conv_L_cache - 1) x conv_dim / tp
    // = 2 x 2048 / tp at bf16.
    out.push_back({"lfm2-1.2b",
                   pattern(16,
                           [](int i) {
                               for (int a : {2, 5, 8, 10, 12, 14})
                                   if (i == a) return L{'F', 8, 64};
                               return L{'X'};
                           }),
                   {1, 2, 4, 8},
                   0,
                   0,
                   [](int tp) { return int64_t{2} * (2048 / tp) * 2; }});
    // Phi-3-mini-4k: Llama's fields, MHA of 32 heads of 3072 / 32 = 96, every layer sliding over
    // 2047 tokens (no layer_types: vLLM's Attention takes the model-level window).
    out.push_back({"phi-3-mini-4k-instruct",
                   pattern(32,
                           [](int) {
                               return L{'S', 32, 96, 2047};
                           }),
                   {1, 2, 4, 8}});
    // Gemma-4-31B: 5 sliding (16 KV heads of 256, window 1024) : 1 full layer, the full ones with
    // global_head_dim 512 and, as attention_k_eq_v, num_global_key_value_heads 4.
    out.push_back({"gemma-4-31b",
                   pattern(60,
                           [](int i) {
                               return (i + 1) % 6 ? L{'S', 16, 256, 1024} : L{'F', 4, 512};
                           }),
                   {1, 2, 4, 8}});
    // Nemotron Super: no-op attention blocks hold no KV; the others 64/8 = 8 KV heads.
    const auto blocks =
        nlohmann::json::parse(read_file(config_path("llama-3.3-nemotron-super-49b")))
            .at("block_configs");
    std::vector<L> super;
    for (const auto& b : blocks)
        super.push_back(b.at("attention").at("no_op").get<bool>() ? L{'-'} : L{'F', 8, 128});
    out.push_back({"llama-3.3-nemotron-super-49b", super, {1, 2, 4, 8}});
    // Olmo 3 7B: layer_types 3 sliding (window 4096) : 1 full, MHA of 32 heads of 4096 / 32.
    out.push_back({"olmo-3-7b",
                   pattern(32,
                           [](int i) {
                               return (i + 1) % 4 ? L{'S', 32, 128, 4096} : L{'F', 32, 128};
                           }),
                   {1, 2, 4, 8}});
    // OLMo 2 7B: every layer full, MHA of 32 heads of 128.
    out.push_back({"olmo-2-7b-instruct", uniform(32, {'F', 32, 128}), {1, 2, 4, 8}});
    // Command R7B: sliding_window_pattern 4 (3 sliding of 4096, then a NoPE full layer), 8 KV
    // heads of 4096 / 32 = 128.
    out.push_back({"c4ai-command-r7b-12-2024",
                   pattern(32,
                           [](int i) {
                               return (i + 1) % 4 ? L{'S', 8, 128, 4096} : L{'F', 8, 128};
                           }),
                   {1, 2, 4, 8}});
    // EXAONE 4.0 32B: layer_types "LLLG" (local 4096, global NoPE), 8 KV heads of head_dim 128.
    out.push_back({"exaone-4.0-32b",
                   pattern(64,
                           [](int i) {
                               return (i + 1) % 4 ? L{'S', 8, 128, 4096} : L{'F', 8, 128};
                           }),
                   {1, 2, 4, 8}});
    // Granite 3.3 8B: Llama's layout, 8 KV heads of 4096 / 32 = 128; multipliers cache nothing.
    out.push_back({"granite-3.3-8b-instruct", uniform(40, {'F', 8, 128}), {1, 2, 4, 8}});
    // Granite 3.1 3B-A800M (MoE): 24 heads of 1536 / 24 = 64, 8 KV heads.
    out.push_back({"granite-3.1-3b-a800m-instruct", uniform(32, {'F', 8, 64}), {1, 2, 4, 8}});
    // SmolLM3-3B: every 4th layer NoPE, which caches the same K and V: 4 KV heads of 128.
    out.push_back({"smollm3-3b", uniform(36, {'F', 4, 128}), {1, 2, 4, 8}});
    // Seed-OSS-36B: 80 query heads and 8 KV heads of head_dim 128 (not 5120 / 80 = 64).
    out.push_back({"seed-oss-36b-instruct", uniform(64, {'F', 8, 128}), {1, 2, 4, 8}});
    // ERNIE-4.5-0.3B: 16 query heads, 2 KV heads of head_dim 128 (not 1024 / 16 = 64).
    out.push_back({"ernie-4.5-0.3b-pt", uniform(18, {'F', 2, 128}), {1, 2, 4, 8}});
    // Hy-MT2-7B (hunyuan_v1_dense): Llama 3.1 8B's attention, 8 KV heads of 128, no CLA.
    out.push_back({"hy-mt2-7b", uniform(32, {'F', 8, 128}), {1, 2, 4, 8}});
    // ERNIE-4.5-21B-A3B: 20 query heads, 4 KV heads of 2560 / 20 = 128 on every layer.
    out.push_back({"ernie-4.5-21b-a3b-pt", uniform(28, {'F', 4, 128}), {1, 2, 4}});
    // Hunyuan-A13B: 32 query heads, 8 KV heads of head_dim 128, no CLA (use_cla false).
    out.push_back({"hunyuan-a13b-instruct", uniform(32, {'F', 8, 128}), {1, 2, 4, 8}});
    // Bamba-9B: attention at attn_layer_indices 9, 18, 27 (8 KV heads of 4096 / 32 = 128), the
    // other 29 Mamba-2 of 128 heads of 64, 1 group, d_state 128, d_conv 4.
    out.push_back({"bamba-9b",
                   pattern(32,
                           [](int i) {
                               return i == 9 || i == 18 || i == 27 ? L{'F', 8, 128} : L{'M'};
                           }),
                   {1, 2, 4, 8},
                   0,
                   0,
                   [](int tp) { return state_bf16(128, 64, 1, 128, 4, tp); }});
    // Falcon-H1-7B: 44 decoder layers of two cache layers each, attention (2 KV heads of
    // head_dim 128) then Mamba-2 (24 heads of 128, 1 group, d_state 256, d_conv 4); tp 8 does
    // not divide the 12 query heads. pp 2 below splits 22 + 22 decoder layers.
    out.push_back({"falcon-h1-7b-instruct",
                   pattern(88,
                           [](int i) {
                               return i % 2 == 0 ? L{'F', 2, 128} : L{'M'};
                           }),
                   {1, 2, 4},
                   0,
                   0,
                   [](int tp) { return state_bf16(24, 128, 1, 256, 4, tp); }});
    // LongCat-Flash-Chat: 28 decoder layers of three cache layers, two MLA attentions (a 512 +
    // 64 latent each, replicated over tp) and the MoE, which caches nothing; 64 heads.
    out.push_back({"longcat-flash-chat",
                   pattern(84, [](int i) { return i % 3 == 2 ? L{'-'} : L{'L'}; }),
                   {1, 2, 4, 8},
                   (512 + 64) * 2});
    // Jamba-v0.1: attention where l % 8 == 4 (8 KV heads of 4096 / 32 = 128), the other 28
    // layers Mamba-1 of d_inner 8192, d_state 16, d_conv 4 (mamba1_state_by_hand).
    out.push_back({"jamba-v0.1",
                   pattern(32,
                           [](int i) {
                               return i % 8 == 4 ? L{'F', 8, 128} : L{'1'};
                           }),
                   {1, 2, 4, 8},
                   0,
                   0,
                   [](int tp) { return mamba1_state_by_hand(8192, 16, 4, tp); }});
    // Ling-mini-2.0 (bailing_moe_v2): 16 query heads, 4 KV heads of head_dim 128 on every layer
    // (vLLM's BailingAttention; tp 8 replicates the KV heads).
    out.push_back({"ling-mini-2.0", uniform(20, {'F', 4, 128}), {1, 2, 4, 8}});
    // Ling-flash-2.0: 32 query heads, 4 KV heads of 128 (its MTP layer is not vLLM's).
    out.push_back({"ling-flash-2.0", uniform(32, {'F', 4, 128}), {1, 2, 4, 8}});
    // dots.llm1: MHA, 32 KV heads of 4096 / 32 = 128 on every layer.
    out.push_back({"dots.llm1.inst", uniform(62, {'F', 32, 128}), {1, 2, 4, 8}});
    // MiMo-7B: Qwen2's decoder, 32 query heads, 8 KV heads of 4096 / 32 = 128.
    out.push_back({"mimo-7b-rl", uniform(36, {'F', 8, 128}), {1, 2, 4, 8}});
    // GLM-4.5V: GLM-4.5-Air's decoder under a vision wrapper's text_config, 8 KV heads of 128.
    out.push_back({"glm-4.5v", uniform(46, {'F', 8, 128}), {1, 2, 4, 8}});
    // Apertus-8B: 32 query heads, 8 KV heads of 4096 / 32 = 128 (no layer_types, no window).
    out.push_back({"apertus-8b-instruct-2509", uniform(32, {'F', 8, 128}), {1, 2, 4, 8}});
    return out;
}

// Bytes per token one TP rank stores for layers [begin, end), bf16.
int64_t expected_bytes_per_token(const Family& f, int tp, int begin, int end) {
    int64_t sum = 0;
    for (int i = begin; i < end; ++i) {
        const L& l = f.layers[i];
        if (l.kind == 'L') sum += f.latent_bytes + f.indexer_bytes;
        if (l.kind == 'F' || l.kind == 'S' || l.kind == 'C')
            sum += 2 * int64_t{std::max(1, l.kv_heads / tp)} * l.head_dim * 2;
    }
    return sum;
}

// Bytes of the whole model (tp 1) for one request of n tokens in blocks of 16.
int64_t expected_request_bytes(const Family& f, int64_t n) {
    const int64_t bs = 16;
    auto blocks_from = [&](int64_t first) { return (n + bs - 1) / bs - first / bs; };
    int64_t sum = 0;
    for (const L& l : f.layers) {
        const int64_t per_token = expected_bytes_per_token(
            Family{f.file, {l}, {}, f.latent_bytes, f.indexer_bytes, nullptr}, 1, 0, 1);
        switch (l.kind) {
            case 'F':
            case 'L':
                sum += blocks_from(0) * bs * per_token;
                break;
            case 'S':
                sum += blocks_from(std::max<int64_t>(0, n - l.window)) * bs * per_token;
                break;
            case 'C':
                sum += blocks_from((n - 1) / l.window * l.window) * bs * per_token;
                break;
            case 'G':
            case 'M':
            case '1':
            case 'X':
                sum += f.state(1);
                break;
            default:
                break;
        }
    }
    return sum;
}

TEST(RealShapes, PublishedFamiliesPerRankAndPerRequest) {
    for (const Family& f : families()) {
        SCOPED_TRACE(f.file);
        const ModelSpec m = load_hf_config(config_path(f.file));
        const int n = static_cast<int>(f.layers.size());
        ASSERT_EQ(m.num_layers, n);
        int state_layers = 0;
        for (const L& l : f.layers)
            state_layers += l.kind == 'G' || l.kind == 'M' || l.kind == '1' || l.kind == 'X';
        for (int tp : {1, 2, 4, 8}) {
            ParallelConfig p;
            p.tp = tp;
            if (std::find(f.tps.begin(), f.tps.end(), tp) == f.tps.end()) {
                EXPECT_THROW(make_layout(m, p), Error) << "tp=" << tp;
                continue;
            }
            const KvLayout lay = make_layout(m, p);
            for (const RankKv& r : lay.ranks) {
                EXPECT_EQ(r.kv_bytes_per_token, expected_bytes_per_token(f, tp, 0, n))
                    << "tp=" << tp;
                EXPECT_EQ(r.state_bytes_per_sequence, state_layers ? state_layers * f.state(tp) : 0)
                    << "tp=" << tp;
            }
        }
        // pp 2: the first stage takes the odd layer.
        ParallelConfig pp2;
        pp2.pp = 2;
        const KvLayout lay = make_layout(m, pp2);
        const int half = (n + 1) / 2;
        EXPECT_EQ(lay.ranks[0].kv_bytes_per_token, expected_bytes_per_token(f, 1, 0, half));
        EXPECT_EQ(lay.ranks[1].kv_bytes_per_token, expected_bytes_per_token(f, 1, half, n));
        // Per request at 1K, 32K and 128K tokens.
        const KvLayout one = make_layout(m, ParallelConfig{});
        for (int64_t len : {1024, 32768, 131072})
            EXPECT_EQ(request_kv_bytes(one, 0, len, 16), expected_request_bytes(f, len))
                << len << " tokens";
    }
}

TEST(RealShapes, WindowsMakeLongRequestsCheaper) {
    // gpt-oss-120b at 128K: the 18 sliding layers keep 128 tokens (8 blocks of 16), the 18 full
    // layers all 131072: 18 * 2048 B/token * (131072 + 128).
    const ModelSpec m = load_hf_config(config_path("gpt-oss-120b"));
    const KvLayout lay = make_layout(m, ParallelConfig{});
    EXPECT_EQ(request_kv_bytes(lay, 0, 131072, 16), int64_t{18} * 2048 * (131072 + 128));
    const KvLayout full = make_layout(with_full_attention(m), ParallelConfig{});
    EXPECT_EQ(request_kv_bytes(full, 0, 131072, 16), int64_t{36} * 2048 * 131072);
    // A sequence shorter than the window keeps every token in both.
    EXPECT_EQ(request_kv_bytes(lay, 0, 100, 16), request_kv_bytes(full, 0, 100, 16));
}

void expect_refused(const std::string& text, const std::string& needle);

// A shared expert is counted as routed experts of its width (MoeSpec), so a width that is not a
// multiple of moe_intermediate_size is refused on the field it came from, in each family's terms.
TEST(RealShapes, SharedExpertWidthsNotInRoutedWidthsAreRefused) {
    nlohmann::json next = nlohmann::json::parse(read_file(config_path("qwen3-next-80b-a3b")));
    next["shared_expert_intermediate_size"] = 700;
    expect_refused(next.dump(),
                   "shared_expert_intermediate_size' (700) is not a multiple of "
                   "moe_intermediate_size (512)");
    nlohmann::json ling = nlohmann::json::parse(read_file(config_path("ling-mini-2.0")));
    ling["moe_shared_expert_intermediate_size"] = 700;
    expect_refused(ling.dump(),
                   "x num_shared_experts (700) is not a multiple of "
                   "moe_intermediate_size (512)");
    nlohmann::json hy = nlohmann::json::parse(read_file(config_path("hunyuan-a13b-instruct")));
    hy["intermediate_size"] = 3000;
    expect_refused(hy.dump(), "x intermediate_size (3000) is not a multiple of");
}

TEST(RealShapes, NonFiniteValuesInUnrelatedFieldsLoad) {
    // Nemotron-H's published config writes time_step_limit as [0.0, Infinity] (Python's json).
    std::string text = read_file(config_path("nemotron-h-8b"));
    text.insert(text.rfind('}'), R"(, "time_step_limit": [0.0, Infinity], "time_step_floor": NaN,
        "initializer_range": -Infinity, "note": "Infinity stays a string")");
    const ModelSpec m = parse_hf_config(text, "nemotron-h/config.json");
    EXPECT_EQ(m.state_bytes_per_sequence(), 24 * state_bf16_ssm_fp32(128, 64, 8, 128, 4, 1));
    // Nemotron-H reads mamba_ssm_cache_dtype from its config (update_mamba_ssm_cache_dtype)...
    std::string half = read_file(config_path("nemotron-h-8b"));
    half.insert(half.rfind('}'), R"(, "mamba_ssm_cache_dtype": "bfloat16")");
    EXPECT_EQ(parse_hf_config(half, "n.json").state_bytes_per_sequence(),
              24 * state_bf16_ssm_fp32(128, 64, 8, 128, 4, 1) -
                  24 * int64_t{128} * 64 * 128 * 2);  // the SSM state at 2 bytes, not 4
    // ... the other families do not (vLLM takes the engine's flag): refused, not applied.
    for (const char* other : {"granite-4.0-h-tiny", "jamba-v0.1", "qwen3-next-80b-a3b"}) {
        std::string t = read_file(config_path(other));
        t.insert(t.rfind('}'), R"(, "mamba_ssm_cache_dtype": "float32")");
        expect_refused(t, "Nemotron-H only");
    }
    // A non-finite value where the KV needs a number is refused by name.
    std::string bad = read_file(config_path("mistral-7b-v0.1"));
    const auto at = bad.find("\"sliding_window\": 4096");
    ASSERT_NE(at, std::string::npos);
    bad.replace(at, 22, "\"sliding_window\": Infinity");
    try {
        parse_hf_config(bad, "mistral/config.json");
        ADD_FAILURE() << "an infinite window was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("sliding_window"), std::string::npos) << e.what();
    }
}

void expect_refused(const std::string& text, const std::string& needle) {
    try {
        parse_hf_config(text, "cfg.json");
        ADD_FAILURE() << "accepted: " << text;
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

TEST(RealShapes, FieldsThatWouldChangeTheKvAreNeverIgnored) {
    const std::string base = R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100)";
    EXPECT_NO_THROW(parse_hf_config(base + "}", "cfg.json"));
    // An attention / cache field the reader does not model: refused, naming field and model type.
    expect_refused(base + R"(, "attention_sink_size": 4})",
                   "'attention_sink_size' of model_type 'llama'");
    expect_refused(base + R"(, "kv_cache_compression": "pyramid"})", "kv_cache_compression");
    expect_refused(base + R"(, "sliding_window_layers": [1]})", "sliding_window_layers");
    // A field another family reads, here ignored: refused.
    expect_refused(base + R"(, "hybrid_override_pattern": "M*"})", "hybrid_override_pattern");
    expect_refused(base + R"(, "attention_chunk_size": 8})", "attention_chunk_size");
    // A window stated but reaching no layer.
    expect_refused(R"({"model_type": "qwen3_next", "num_hidden_layers": 4, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "use_sliding_window": true, "linear_num_value_heads": 2, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_conv_kernel_dim": 4})",
                   "use_sliding_window");
    // An unknown architecture, and an unknown layer type.
    expect_refused(R"({"model_type": "rwkv7", "num_hidden_layers": 2})", "model_type 'rwkv7'");
    expect_refused(base + R"(, "layer_types": ["full_attention", "cross_attention"]})",
                   "cross_attention");
    // A quantized KV cache declared in quantization_config.
    expect_refused(base + R"(, "quantization_config": {"kv_cache_scheme": {"num_bits": 8}}})",
                   "kv_cache_scheme");
    // Unrelated unknown fields are fine.
    EXPECT_NO_THROW(parse_hf_config(base + R"(, "my_tokenizer_note": 3})", "cfg.json"));
    // Nemotron Super blocks with kept sink tokens are not modelled.
    std::string super = read_file(config_path("llama-3.3-nemotron-super-49b"));
    const auto at = super.find("\"num_sink_tokens\": null");
    ASSERT_NE(at, std::string::npos);
    super.replace(at, 23, "\"num_sink_tokens\": 4");
    expect_refused(super, "num_sink_tokens");
}

// Qwen3.5's fields: a recurrent state dtype named by the checkpoint; refused for other families.
TEST(RealShapes, Qwen35ReadsItsSsmDtype) {
    const ModelSpec q = load_hf_config(config_path("qwen3.5-35b-a3b"));
    EXPECT_EQ(q.state.state_dtype, DType::kFp32);
    EXPECT_EQ(q.state.conv_dtype, DType::kBf16);
    EXPECT_EQ(q.kv_bytes_per_token(), 10 * 2 * 2 * 256 * 2);
    // 30 Gated DeltaNet layers: conv 3 x 8192 bf16 + 32 x 128 x 128 fp32 each.
    EXPECT_EQ(q.state_bytes_per_sequence(), 30 * (3 * 8192 * 2 + 32 * 128 * 128 * 4));
    EXPECT_EQ(q.moe.num_experts, 256);
    std::string next = read_file(config_path("qwen3-next-80b-a3b"));
    next.insert(next.find('{') + 1, "\"mamba_ssm_dtype\": \"float32\",");
    expect_refused(next, "mamba_ssm_dtype");
}

// Kimi Linear: KDA layers by linear_attn_config (1-based), MLA elsewhere, the KDA state as vLLM
// sizes it, and the fields vLLM's model asserts or does not read, refused by name.
TEST(RealShapes, KimiLinearAsVllmBuildsIt) {
    const std::string text = read_file(config_path("kimi-linear-48b-a3b-instruct"));
    const ModelSpec m = parse_hf_config(text, "kimi.json");
    EXPECT_EQ(m.layer_mix(), "27 layers: 20 gated_deltanet + 7 mla");
    EXPECT_TRUE(m.is_mla());
    EXPECT_EQ(m.layer(0).kind, LayerKind::kGatedDeltaNet);
    EXPECT_EQ(m.layer(3).kind, LayerKind::kMla);   // layer 4, 1-based
    EXPECT_EQ(m.layer(26).kind, LayerKind::kMla);  // layer 27
    EXPECT_TRUE(m.state.kda);
    EXPECT_EQ(m.state.conv_dtype, DType::kBf16);
    EXPECT_EQ(m.state.state_dtype, DType::kFp32);
    // KV per token: 7 MLA layers x (512 + 64) x 2 bytes, whatever the TP.
    EXPECT_EQ(m.kv_bytes_per_token(), 7 * 1152);
    // State per sequence and KDA layer, by hand from vLLM's shapes at tp 1 / 2 / 4:
    //   tp 1: conv 3 x 12288 x 2 = 73,728 + recurrent 32 x 128 x 128 x 4 = 2,097,152
    //   tp 2: conv 3 x 6144 x 2 = 36,864 + 16 x 128 x 128 x 4 = 1,048,576
    //   tp 4: conv 3 x 3072 x 2 = 18,432 + 8 x 128 x 128 x 4 = 524,288
    EXPECT_EQ(state_bytes(m.state, 1), 73728 + 2097152);
    EXPECT_EQ(state_bytes(m.state, 2), 36864 + 1048576);
    EXPECT_EQ(state_bytes(m.state, 4), 18432 + 524288);
    EXPECT_EQ(m.state_bytes_per_sequence(), 20 * (73728 + 2097152));
    // MoE from layer 1 (first_k_dense_replace), 256 experts of 1024, top 8, one shared expert.
    EXPECT_EQ(m.num_moe_layers(), 26);
    EXPECT_EQ(m.moe.num_experts, 256);
    EXPECT_EQ(m.moe.experts_per_token, 8);
    EXPECT_EQ(m.moe.shared_experts, 1);
    EXPECT_EQ(m.layer(0).intermediate, 9216);
    // Named 48B total, 3B activated. By hand: 26 MoE layers x 256 experts x 3 x 2304 x 1024 =
    // 47.11B, embedding + LM head 2 x 163840 x 2304 = 0.755B, 20 KDA mixers 0.788B, 7 MLA
    // mixers 0.204B, shared experts, routers and the dense layer 0.26B: 49.12B, within 3% of
    // the name (which rounds down).
    EXPECT_NEAR(static_cast<double>(m.total_params()), 48e9, 0.03 * 48e9);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()), 3e9, 0.1 * 3e9);
    // A KDA layer's projections (vLLM's KimiDeltaAttention), not Gated DeltaNet's: q, k, v, o of
    // 2304 x 4096, f_a / g_a 2304 x 128, f_b / g_b 128 x 4096, dt_bias 4096, b_proj 2304 x 32,
    // three convs of 4096 x 4, A_log 32, o_norm 128.
    EXPECT_EQ(m.mixer_params_of_layer(0), int64_t{4} * 2304 * 4096 + 2 * (2304 * 128 + 128 * 4096) +
                                              4096 + 2304 * 32 + 3 * 4096 * 4 + 32 + 128);
    // JSON keeps the KDA mark.
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);

    auto with = [&](const std::string& field) {
        std::string t = text;
        t.insert(t.find('{') + 1, field + ",");
        return t;
    };
    auto replaced = [&](const std::string& from, const std::string& to) {
        std::string t = text;
        const auto at = t.find(from);
        EXPECT_NE(at, std::string::npos) << from;
        if (at != std::string::npos) t.replace(at, from.size(), to);
        return t;
    };
    expect_refused(replaced("\"q_lora_rank\": null", "\"q_lora_rank\": 1536"), "q_lora_rank");
    expect_refused(replaced("\"mla_use_nope\": true", "\"mla_use_nope\": false"), "mla_use_nope");
    expect_refused(replaced("\"num_nextn_predict_layers\": 0", "\"num_nextn_predict_layers\": 1"),
                   "num_nextn_predict_layers");
    expect_refused(with("\"routed_expert_hidden_size\": 3584"), "routed_expert_hidden_size");
    expect_refused(replaced("\"short_conv_kernel_size\": 4",
                            "\"short_conv_kernel_size\": 4, \"use_full_rank_gate\": true"),
                   "use_full_rank_gate");
    // Layer 27 in both lists, or in neither.
    expect_refused(replaced("\"num_heads\": 32", "\"num_heads\": 32, \"kda_layers\": [1]"),
                   "kda_layers");
    expect_refused(replaced("24,\n      27\n", "24\n"), "layer 27 is listed 0 times");
    // MoE on every second layer from layer 1 (moe_layer_freq 2: layers 2, 4, ..., 26).
    const ModelSpec half =
        parse_hf_config(replaced("\"moe_layer_freq\": 1", "\"moe_layer_freq\": 2"), "kimi.json");
    EXPECT_EQ(half.num_moe_layers(), 13);
    EXPECT_FALSE(half.is_moe_layer(1));
    EXPECT_TRUE(half.is_moe_layer(2));
    // Another family's config naming linear_attn_config: refused.
    expect_refused(R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "linear_attn_config": {"kda_layers": [1]}})",
                   "linear_attn_config");
}

// LFM2: short-conv layers and GQA layers by full_attn_idxs (or layer_types), the MLP width vLLM's
// Lfm2MLP derives, and the fields it does not model refused by name.
TEST(RealShapes, Lfm2AsVllmBuildsIt) {
    const std::string text = read_file(config_path("lfm2-1.2b"));
    const ModelSpec m = parse_hf_config(text, "lfm2.json");
    EXPECT_EQ(m.layer_mix(), "16 layers: 10 short_conv + 6 full");
    EXPECT_EQ(m.layer(0).kind, LayerKind::kShortConv);
    EXPECT_EQ(m.layer(2).kind, LayerKind::kFullAttention);
    EXPECT_EQ(m.head_dim, 64);
    // KV per token: 6 layers x K and V x 8 heads x 64 x bf16.
    EXPECT_EQ(m.kv_bytes_per_token(), 6 * 2 * 8 * 64 * 2);
    // Conv state per sequence and layer, by hand from vLLM's short_conv_state_shape:
    // (3 - 1) x 2048 / tp x 2 bytes: 8192 at tp 1, 4096 at tp 2, 2048 at tp 4.
    EXPECT_EQ(state_bytes(m.state, 1), 8192);
    EXPECT_EQ(state_bytes(m.state, 2), 4096);
    EXPECT_EQ(state_bytes(m.state, 4), 2048);
    EXPECT_EQ(m.state_bytes_per_sequence(), 10 * 8192);  // 81,920
    // block_ff_dim 12288, auto-adjusted: int(2 x 12288 / 3) = 8192, x 1.0, a multiple of 256.
    EXPECT_EQ(m.intermediate, 8192);
    EXPECT_TRUE(m.tie_embeddings);  // tie_embedding
    // Published as 1,170,340,608 parameters. By hand: embedding 65536 x 2048 = 134,217,728 (tied),
    // 16 MLPs 3 x 2048 x 8192 = 805,306,368, 6 attention layers 2 x 2048 x 2048 + 2 x 2048 x 512
    // = 62,914,560, 10 short convs (in_proj 3 x 2048^2, out_proj 2048^2, conv 2048 x 3) =
    // 167,833,600: 1,170,272,256 plus 68,352 of norms. Within 0.01%.
    EXPECT_NEAR(static_cast<double>(m.total_params()), 1170340608.0, 1e-4 * 1170340608.0);
    EXPECT_EQ(m.mixer_params_of_layer(0), int64_t{4} * 2048 * 2048 + 2048 * 3);
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);
    ModelSpec spec = m;  // short_conv_state_shape takes no num_spec: no speculative conv rows
    spec.state.spec_conv_rows = 1;
    EXPECT_THROW(spec.validate(), Error);
    // layer_types, the form later LFM2 checkpoints write, reads the same.
    nlohmann::json j = nlohmann::json::parse(text);
    j.erase("full_attn_idxs");
    j["layer_types"] = nlohmann::json::array();
    for (int l = 0; l < 16; ++l)
        j["layer_types"].push_back(m.layer(l).kind == LayerKind::kShortConv ? "conv"
                                                                            : "full_attention");
    EXPECT_EQ(parse_hf_config(j.dump(), "lfm2.json"), m);
    // ... and disagreeing with full_attn_idxs, refused.
    j["full_attn_idxs"] = {2, 5};
    expect_refused(j.dump(), "full_attn_idxs");
    auto replaced = [&](const std::string& from, const std::string& to) {
        std::string t = text;
        const auto at = t.find(from);
        EXPECT_NE(at, std::string::npos) << from;
        if (at != std::string::npos) t.replace(at, from.size(), to);
        return t;
    };
    expect_refused(replaced("\"conv_bias\": false", "\"conv_bias\": true"), "conv_bias");
    expect_refused(replaced("\"conv_dim\": 2048", "\"conv_dim\": 1024"), "conv_dim");
    expect_refused(replaced("\"num_heads\": 32", "\"num_heads\": 16"), "num_heads");
    expect_refused(replaced("\"full_attn_idxs\": [", "\"full_attn_idxs\": [16, "),
                   "full_attn_idxs");
    // LFM2's fields in another family's config: refused.
    expect_refused(R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "conv_L_cache": 3})",
                   "conv_L_cache");
    // tp must divide the conv channels, as vLLM's divide(conv_dim, tp) requires.
    ModelSpec odd = m;
    odd.state.heads = 2046;
    ParallelConfig p4;
    p4.tp = 4;
    EXPECT_THROW(make_layout(odd, p4), Error);
}

// Granite 4.0-H: the MoE with its shared MLP on every layer, the dense variant, the head size
// vLLM uses, "auto" Mamba heads, and the layer list vLLM cannot do without.
TEST(RealShapes, GraniteHybridAsVllmBuildsIt) {
    const std::string tiny = read_file(config_path("granite-4.0-h-tiny"));
    const ModelSpec m = parse_hf_config(tiny, "granite.json");
    EXPECT_EQ(m.moe.num_experts, 64);
    EXPECT_EQ(m.moe.experts_per_token, 6);
    EXPECT_EQ(m.moe.expert_intermediate, 512);
    EXPECT_EQ(m.moe.shared_experts, 2);  // shared_intermediate_size 1024 = 2 experts of 512
    for (int l = 0; l < m.num_layers; ++l) EXPECT_EQ(m.layer(l).mlp, MlpKind::kMoe) << l;
    // 36 Mamba-2 layers: conv 3 x (3072 + 2 x 128) + state 48 x 64 x 128, bf16.
    EXPECT_EQ(m.state_bytes_per_sequence(), 36 * 2 * (3 * 3328 + 48 * 64 * 128));
    auto with = [&](const std::string& from, const std::string& to) {
        std::string t = tiny;
        const auto at = t.find(from);
        EXPECT_NE(at, std::string::npos) << from;
        return at == std::string::npos ? t : t.replace(at, from.size(), to);
    };
    // Granite-4.0-H-1B: no routed experts; the shared MLP (4096) is each layer's dense MLP.
    std::string dense = with("\"num_local_experts\": 64", "\"num_local_experts\": 0");
    dense.replace(dense.find("\"shared_intermediate_size\": 1024"), 32,
                  "\"shared_intermediate_size\": 4096");
    const ModelSpec d = parse_hf_config(dense, "granite-1b.json");
    EXPECT_FALSE(d.moe.enabled());
    EXPECT_EQ(d.layer(0).mlp, MlpKind::kDense);
    EXPECT_EQ(d.layer(0).intermediate, 4096);
    // mamba_d_head "auto" is (mamba_expand x hidden) / mamba_n_heads, as transformers resolves it.
    const ModelSpec a =
        parse_hf_config(with("\"mamba_d_head\": 64", "\"mamba_d_head\": \"auto\""), "a.json");
    EXPECT_EQ(a.state, m.state);
    expect_refused(with("\"mamba_d_head\": 64", "\"mamba_d_head\": 32"), "mamba_d_head");
    // vLLM's attention sizes heads as hidden / heads and ignores head_dim: a disagreeing one is
    // refused, an agreeing one read.
    expect_refused(with("\"hidden_size\": 1536,", "\"hidden_size\": 1536, \"head_dim\": 64,"),
                   "head_dim");
    EXPECT_EQ(
        parse_hf_config(with("\"hidden_size\": 1536,", "\"hidden_size\": 1536, \"head_dim\": 128,"),
                        "h.json")
            .kv_bytes_per_token(),
        m.kv_bytes_per_token());
    // Without layer_types vLLM cannot build the model; a wrong word or length is refused.
    std::string none = tiny;
    const auto lt = none.find("\"layer_types\"");
    none.erase(lt, none.find(']', lt) + 2 - lt);
    expect_refused(none, "layer_types");
    expect_refused(with("\"attention\"", "\"full_attention\""), "layer_types");
    // The Mamba fields are Granite's: in another family they are refused.
    expect_refused(R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "mamba_n_heads": 8})",
                   "mamba_n_heads");
}

// Ministral 3 (and Mistral Small 3.2 on): a mistral3 vision wrapper whose text_config is
// model_type ministral3, Llama's fields; Ministral3Config's defaults were not confirmed, so the
// head counts and head_dim are required.
TEST(RealShapes, Ministral3UnderItsVisionWrapper) {
    const std::string text = R"({"hidden_size": 1024, "num_hidden_layers": 6,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 3072, "vocab_size": 1000, "model_type": "ministral3",
        "sliding_window": null, "rope_parameters": {"rope_type": "yarn", "factor": 16.0,
        "llama_4_scaling_beta": 0.1}})";
    const std::string wrapped = R"({"architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3", "image_token_index": 10, "spatial_merge_size": 2,
        "vision_feature_layer": -1, "torch_dtype": "bfloat16", "vision_config": {"hidden_size": 64},
        "text_config": )" + text +
                                "}";
    const ModelSpec m = parse_hf_config(wrapped, "ministral3.json");
    EXPECT_EQ(m.kv_bytes_per_token(), 6 * 2 * 4 * 128 * 2);
    EXPECT_TRUE(m.uniform());
    std::string no_head_dim = wrapped;
    no_head_dim.erase(no_head_dim.find("\"head_dim\": 128,"), 17);
    expect_refused(no_head_dim, "head_dim");
}

// GLM-5 (glm_moe_dsa): vLLM's GlmMoeDsaForCausalLM is DeepseekV2ForCausalLM, DeepSeek-V3.2's MLA
// with the sparse-attention indexer. Field values of GLM-5 as published (78 layers, hidden 6144, 64
// heads, kv_lora_rank 512, rope 64, indexer 32 heads of 128, top 2048). GLM-5.2's indexer_types
// with "shared" layers (no indexer key of their own) are refused.
TEST(RealShapes, Glm5IsDeepSeekV32Shaped) {
    const std::string glm5 = R"({"architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa", "hidden_size": 6144, "num_hidden_layers": 78,
        "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 154880,
        "intermediate_size": 12288, "moe_intermediate_size": 2048, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128,
        "index_n_heads": 32, "indexer_rope_interleave": true, "num_nextn_predict_layers": 1)";
    const ModelSpec m = parse_hf_config(glm5 + "}", "glm5.json");
    EXPECT_TRUE(m.is_mla());
    EXPECT_EQ(m.indexer.head_dim, 128);
    EXPECT_EQ(m.indexer.heads, 32);
    // Per token and layer: the latent (512 + 64) bf16, and the fp8 indexer key with its fp32 scale.
    const ModelSpec v32 = load_hf_config(config_path("deepseek-v3.2-exp"));
    EXPECT_EQ(m.kv_bytes_per_token() * 61, v32.kv_bytes_per_token() * 78);
    EXPECT_EQ(indexer_bytes_per_token(m), 128 + 4);  // per token and layer
    std::string all_full = ", \"indexer_types\": [";
    for (int l = 0; l < 78; ++l) all_full += l ? ", \"full\"" : "\"full\"";
    EXPECT_EQ(parse_hf_config(glm5 + all_full + "]}", "glm5.json").kv_bytes_per_token(),
              m.kv_bytes_per_token());
    std::string shared = all_full;
    shared.replace(shared.rfind("full"), 4, "shared");
    expect_refused(glm5 + shared + "]}", "indexer_types");
    expect_refused(glm5 + ", \"indexer_types\": [\"full\"]}", "indexer_types");
}

// Gemma 4 as vLLM's Gemma4DecoderLayer builds it and Gemma4TextConfig fills it in.
TEST(RealShapes, Gemma4AsVllmBuildsIt) {
    const std::string base = R"({"model_type": "gemma4_text", "hidden_size": 1024,
        "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4, "num_global_key_value_heads": 2, "vocab_size": 1000,
        "hidden_size_per_layer_input": 0)";
    // No layer_types: 5 sliding : 1 full, the last layer made full; window 512, head_dim 256,
    // global_head_dim 512; without attention_k_eq_v the full layers keep num_key_value_heads.
    const ModelSpec d = parse_hf_config(base + "}", "g4.json");
    for (int l = 0; l < 8; ++l) {
        const bool full = l == 5 || l == 7;
        EXPECT_EQ(d.layer(l).kind, full ? LayerKind::kFullAttention : LayerKind::kSlidingWindow)
            << l;
        EXPECT_EQ(d.layer(l).head_dim, full ? 512 : 256) << l;
        EXPECT_EQ(d.layer(l).num_kv_heads, 4) << l;
        if (!full) {
            EXPECT_EQ(d.layer(l).window, 512) << l;
        }
    }
    EXPECT_TRUE(d.tie_embeddings);
    // attention_k_eq_v: the full layers take num_global_key_value_heads.
    const ModelSpec k = parse_hf_config(base + R"(, "attention_k_eq_v": true})", "g4.json");
    EXPECT_EQ(k.layer(5).num_kv_heads, 2);
    EXPECT_EQ(k.kv_bytes_per_token(), 6 * 2 * 4 * 256 * 2 + 2 * 2 * 2 * 512 * 2);
    // A listed last layer that slides is made full, as transformers does.
    std::string types = R"(, "layer_types": [)";
    for (int l = 0; l < 8; ++l) types += l ? R"(, "sliding_attention")" : R"("sliding_attention")";
    EXPECT_EQ(parse_hf_config(base + types + "]}", "g4.json").layer(7).kind,
              LayerKind::kFullAttention);
    // Gemma-4-26B-A4B: 128 experts of 704 (top 8) beside the dense MLP of 2112 = 3 expert widths.
    const ModelSpec moe = parse_hf_config(base + R"(, "enable_moe_block": true, "num_experts": 128,
        "top_k_experts": 8, "moe_intermediate_size": 704, "intermediate_size": 2112})",
                                          "g4.json");
    EXPECT_EQ(moe.moe.num_experts, 128);
    EXPECT_EQ(moe.moe.shared_experts, 3);
    EXPECT_EQ(moe.layer(0).mlp, MlpKind::kMoe);
    // Not modelled, so refused: per-layer embeddings (also Gemma4TextConfig's default), shared
    // KV layers, all-bidirectional attention.
    std::string ple = base;
    ple.replace(ple.find("\"hidden_size_per_layer_input\": 0"), 32,
                "\"hidden_size_per_layer_input\": 256");
    expect_refused(ple + "}", "hidden_size_per_layer_input");
    std::string no_ple = base;
    no_ple.erase(no_ple.find(",\n        \"hidden_size_per_layer_input\": 0"));
    expect_refused(no_ple + "}", "hidden_size_per_layer_input");
    expect_refused(base + R"(, "num_kv_shared_layers": 4})", "num_kv_shared_layers");
    expect_refused(base + R"(, "use_bidirectional_attention": "all"})",
                   "use_bidirectional_attention");
    EXPECT_NO_THROW(parse_hf_config(base + R"(, "use_bidirectional_attention": "vision"})", "v"));
    // Gemma 4's fields in another family are refused.
    expect_refused(R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "global_head_dim": 128})",
                   "global_head_dim");
}

// MiniMax-01's lightning-attention layers (attn_type_list 0) and a shared expert are refused.
TEST(RealShapes, MiniMaxM2RefusesWhatItDoesNotModel) {
    const std::string m2 = read_file(config_path("minimax-m2"));
    EXPECT_EQ(load_hf_config(config_path("minimax-m2")).kv_bytes_per_token(), 62 * 8 * 128 * 4);
    std::string lightning = m2;
    lightning.replace(lightning.find("[1, "), 4, "[0, ");
    expect_refused(lightning, "attn_type_list");
    std::string shared = m2;
    const auto at = shared.find("\"shared_intermediate_size\": 0");
    ASSERT_NE(at, std::string::npos);
    shared.replace(at, 29, "\"shared_intermediate_size\": 1536");
    expect_refused(shared, "shared_intermediate_size");
}

// SmolLM3: NoPE layers cache what RoPE layers cache; they slide only when the config asks.
TEST(RealShapes, SmolLM3NoPeLayersCacheAlike) {
    const ModelSpec m = load_hf_config(config_path("smollm3-3b"));
    EXPECT_TRUE(m.uniform());
    EXPECT_TRUE(m.tie_embeddings);
    EXPECT_EQ(m.kv_bytes_per_token(), 36 * 2 * 4 * 128 * 2);
    // HuggingFaceTB/SmolLM3-3B: 3.08B parameters (norms not counted here).
    EXPECT_NEAR(static_cast<double>(m.total_params()), 3.08e9, 0.015 * 3.08e9);
    nlohmann::json j = nlohmann::json::parse(read_file(config_path("smollm3-3b")));
    j["use_sliding_window"] = true;
    j["sliding_window"] = 4096;
    const ModelSpec swa = parse_hf_config(j.dump(), "smollm3.json");
    for (int l = 0; l < 36; ++l)
        EXPECT_EQ(swa.layer(l).kind,
                  (l + 1) % 4 == 0 ? LayerKind::kSlidingWindow : LayerKind::kFullAttention)
            << l;
    j["no_rope_layers"] = std::vector<int>(35, 1);
    expect_refused(j.dump(), "no_rope_layers");
}

// Seed-OSS and ERNIE 4.5: head_dim as their config classes and vLLM (seed_oss.py, ernie45.py's
// LlamaForCausalLM) take it; an encoder is refused.
TEST(RealShapes, SeedOssAndErnieReadTheirHeadDim) {
    const ModelSpec m = load_hf_config(config_path("seed-oss-36b-instruct"));
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_EQ(m.kv_bytes_per_token(), 64 * 2 * 8 * 128 * 2);
    // ByteDance-Seed/Seed-OSS-36B: 36.15B parameters (norms not counted here).
    EXPECT_NEAR(static_cast<double>(m.total_params()), 36.15e9, 0.01 * 36.15e9);
    nlohmann::json j = nlohmann::json::parse(read_file(config_path("seed-oss-36b-instruct")));
    j.erase("head_dim");  // SeedOssConfig's default: 128
    EXPECT_EQ(parse_hf_config(j.dump(), "s.json").head_dim, 128);
    j["head_dim"] = nullptr;  // SeedOssConfig: None -> hidden / heads
    EXPECT_EQ(parse_hf_config(j.dump(), "s.json").head_dim, 64);
    j["head_dim"] = 128;
    j["is_causal"] = false;
    expect_refused(j.dump(), "is_causal");
    // ERNIE-4.5-0.3B: 0.36B parameters, tied embeddings (Ernie4_5Config's default as well).
    nlohmann::json e = nlohmann::json::parse(read_file(config_path("ernie-4.5-0.3b-pt")));
    const ModelSpec ernie = parse_hf_config(e.dump(), "e.json");
    EXPECT_TRUE(ernie.tie_embeddings);
    EXPECT_NEAR(static_cast<double>(ernie.total_params()), 0.36e9, 0.015 * 0.36e9);
    e.erase("tie_word_embeddings");
    e["head_dim"] = nullptr;  // Ernie4_5Config: None -> hidden / heads
    const ModelSpec ernie_null = parse_hf_config(e.dump(), "e.json");
    EXPECT_TRUE(ernie_null.tie_embeddings);
    EXPECT_EQ(ernie_null.head_dim, 64);
}

// ERNIE-4.5-21B-A3B as vLLM's ernie45_moe.py builds it (Ernie4_5_MoeDecoderLayer): layer 0 dense
// (moe_layer_start_index 1), layers 1..27 MoE of 64 experts of 1536, top 6, plus a shared MLP of
// 2 x 1536. Published size 21B total, 3B active.
TEST(RealShapes, Ernie45MoeAsVllmBuildsIt) {
    const ModelSpec m = load_hf_config(config_path("ernie-4.5-21b-a3b-pt"));
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_EQ(m.num_kv_heads, 4);
    EXPECT_TRUE(m.tie_embeddings);
    EXPECT_EQ(m.moe.num_experts, 64);
    EXPECT_EQ(m.moe.experts_per_token, 6);
    EXPECT_EQ(m.moe.shared_experts, 2);
    EXPECT_EQ(m.moe.expert_intermediate, 1536);
    EXPECT_FALSE(m.is_moe_layer(0));
    for (int l = 1; l < 28; ++l) EXPECT_TRUE(m.is_moe_layer(l)) << l;
    EXPECT_EQ(m.num_moe_layers(), 27);
    // By hand: attention 2560 x (2 x 2560 + 2 x 4 x 128) per layer; layer 0's dense MLP 3 x 2560
    // x 12288; each MoE layer (64 + 2) experts of 3 x 2560 x 1536 and a 2560 x 64 router; one
    // tied embedding of 103424 x 2560; input_layernorm and post_attention_layernorm per layer and
    // the final norm.
    const int64_t attn = int64_t{2560} * (2 * 2560 + 2 * 4 * 128);
    const int64_t expert = int64_t{3} * 2560 * 1536;
    const int64_t moe_layer = 66 * expert + int64_t{2560} * 64;
    const int64_t embed = int64_t{103424} * 2560;
    const int64_t norms = 28 * 2 * 2560 + 2560;
    const int64_t total = 28 * attn + int64_t{3} * 2560 * 12288 + 27 * moe_layer + embed + norms;
    EXPECT_EQ(m.total_params(), total);
    EXPECT_NEAR(static_cast<double>(total), 21.8e9, 0.01 * 21.8e9);
    // Active: top 6 + 2 shared of 27 layers, the LM head once: about 3B ("A3B").
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()), 3.0e9, 0.2 * 3.0e9);
    // KV per token: 28 layers x 2 x 4 x 128 x bf16.
    EXPECT_EQ(m.kv_bytes_per_token(), int64_t{28} * 2 * 4 * 128 * 2);

    nlohmann::json j = nlohmann::json::parse(read_file(config_path("ernie-4.5-21b-a3b-pt")));
    // moe_layer_interval 2 from start 1 up to end 20: (l + 1) % 2 == 0 and 1 <= l <= 20.
    j["moe_layer_interval"] = 2;
    j["moe_layer_end_index"] = 20;
    const ModelSpec every_other = parse_hf_config(j.dump(), "e.json");
    for (int l = 0; l < 28; ++l)
        EXPECT_EQ(every_other.is_moe_layer(l), (l + 1) % 2 == 0 && l <= 20) << l;
    EXPECT_EQ(every_other.num_moe_layers(), 10);
    j["moe_layer_end_index"] = -1;  // Ernie4_5_MoeConfig: the last layer
    EXPECT_EQ(parse_hf_config(j.dump(), "e.json").num_moe_layers(), 14);
    j["use_moe"] = false;  // vLLM: no layer gets experts
    const ModelSpec dense = parse_hf_config(j.dump(), "e.json");
    EXPECT_FALSE(dense.moe.enabled());
    EXPECT_EQ(dense.num_moe_layers(), 0);
    EXPECT_EQ(dense.mlp_params_of_layer(5), int64_t{3} * 2560 * 12288);
    // MTP (vLLM's ernie_mtp.py): the drafter's block is a LlamaDecoderLayer, a dense MLP.
    j.erase("use_moe");
    j["num_nextn_predict_layers"] = 1;
    const ModelSpec mtp = parse_hf_config(j.dump(), "e.json");
    EXPECT_EQ(mtp.mtp.layers, 1);
    EXPECT_EQ(mtp.mtp.layer.mlp, MlpKind::kDense);
    EXPECT_EQ(mtp.mtp.layer.intermediate, 12288);
    // Absent fields take Ernie4_5_MoeConfig's defaults; a null KV head count stays None there.
    nlohmann::json d = nlohmann::json::parse(read_file(config_path("ernie-4.5-21b-a3b-pt")));
    for (const char* k : {"moe_num_experts", "moe_k", "moe_num_shared_experts",
                          "moe_intermediate_size", "moe_layer_start_index", "moe_layer_interval",
                          "tie_word_embeddings", "intermediate_size"})
        d.erase(k);
    EXPECT_EQ(parse_hf_config(d.dump(), "e.json").total_params(), total);
    d["num_key_value_heads"] = nullptr;
    expect_refused(d.dump(), "num_key_value_heads");
    d["num_key_value_heads"] = 4;
    d["use_moe"] = true;
    d["moe_num_experts"] = 0;
    expect_refused(d.dump(), "moe_num_experts");
}

// Hunyuan-A13B as vLLM's hunyuan_v1.py builds it: HunYuanSparseMoeBlock on every layer, 64
// experts of moe_intermediate_size[l] = 3072, top moe_topk[l] = 8, and (use_mixed_mlp_moe) a
// shared MLP of intermediate_size x num_shared_expert[l] = 3072. Published: 80B total, 13B active.
TEST(RealShapes, HunyuanMoeAsVllmBuildsIt) {
    const ModelSpec m = load_hf_config(config_path("hunyuan-a13b-instruct"));
    EXPECT_EQ(m.moe.num_experts, 64);
    EXPECT_EQ(m.moe.experts_per_token, 8);
    EXPECT_EQ(m.moe.expert_intermediate, 3072);
    EXPECT_EQ(m.moe.shared_experts, 1);
    EXPECT_EQ(m.num_moe_layers(), 32);
    // Attention with query_layernorm / key_layernorm of head_dim (use_qk_norm), two norms per
    // layer and the final one.
    const int64_t attn = int64_t{4096} * (2 * 4096 + 2 * 8 * 128) + 2 * 128;
    const int64_t expert = int64_t{3} * 4096 * 3072;
    const int64_t total =
        32 * (attn + 65 * expert + int64_t{4096} * 64 + 2 * 4096) + int64_t{128167} * 4096 + 4096;
    EXPECT_EQ(m.total_params(), total);
    EXPECT_NEAR(static_cast<double>(total), 80.4e9, 0.01 * 80.4e9);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()), 13e9, 0.05 * 13e9);
    EXPECT_EQ(m.kv_bytes_per_token(), int64_t{32} * 2 * 8 * 128 * 2);

    nlohmann::json j = nlohmann::json::parse(read_file(config_path("hunyuan-a13b-instruct")));
    // The int forms read the same as the per-layer lists.
    j["moe_topk"] = 8;
    j["moe_intermediate_size"] = 3072;
    j["num_shared_expert"] = 1;
    EXPECT_EQ(parse_hf_config(j.dump(), "h.json"), m);
    // moe_intermediate_size null: intermediate_size; num_shared_expert 2: 2 x 3072 wide.
    j["moe_intermediate_size"] = nullptr;
    j["num_shared_expert"] = 2;
    EXPECT_EQ(parse_hf_config(j.dump(), "h.json").moe.shared_experts, 2);
    j["use_mixed_mlp_moe"] = false;  // no shared MLP
    EXPECT_EQ(parse_hf_config(j.dump(), "h.json").moe.shared_experts, 0);
    // Per-layer values kvshard cannot keep apart are refused, not averaged.
    std::vector<int> topk(32, 8);
    topk[5] = 4;
    j["moe_topk"] = topk;
    expect_refused(j.dump(), "moe_topk");
    j["moe_topk"] = std::vector<int>(31, 8);  // shorter than the layers: vLLM asserts
    expect_refused(j.dump(), "moe_topk");
    j["moe_topk"] = 8;
    j.erase("moe_intermediate_size");  // vLLM reads config.moe_intermediate_size
    expect_refused(j.dump(), "moe_intermediate_size");
    j["moe_intermediate_size"] = 3072;
    j["num_experts"] = std::vector<int>(32, 64);  // _is_moe, but the block needs one count
    expect_refused(j.dump(), "num_experts");
    // _is_moe: a list holding a non-integer is dense, and so is num_experts 1.
    j["num_experts"] = nlohmann::json::array({64, "x"});
    EXPECT_FALSE(parse_hf_config(j.dump(), "h.json").moe.enabled());
    j["num_experts"] = 1;
    EXPECT_FALSE(parse_hf_config(j.dump(), "h.json").moe.enabled());
    j["num_experts"] = 64;
    j["use_cla"] = true;  // cla_share_factor 2: odd layers read the even layers' K and V
    expect_refused(j.dump(), "use_cla");
}

// Bamba-9B as vLLM's bamba.py builds it: layers_block_type from attn_layer_indices, BambaMLP of
// intermediate_size on every layer, MambaMixer2 of mamba_expand x hidden in mamba_n_heads heads.
TEST(RealShapes, BambaAsVllmBuildsIt) {
    const ModelSpec m = load_hf_config(config_path("bamba-9b"));
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_FALSE(m.moe.enabled());
    for (int l = 0; l < 32; ++l) EXPECT_EQ(m.layer(l).mlp, MlpKind::kDense) << l;
    // 29 Mamba-2 layers at bf16: conv 3 x (8192 + 2 x 128), SSM 128 x 64 x 128.
    EXPECT_EQ(m.state_bytes_per_sequence(), int64_t{29} * 2 * (3 * 8448 + 128 * 64 * 128));
    EXPECT_EQ(m.kv_bytes_per_token(), int64_t{3} * 2 * 8 * 128 * 2);
    // Published: 9.78B. By hand: attention 4096 x (2 x 4096 + 2 x 1024); Mamba-2 in_proj 4096 x
    // (8192 + 8448 + 128), conv 8448 x (4 + 1), A + D + dt_bias 3 x 128, norm 8192, out_proj
    // 8192 x 4096; MLP 3 x 4096 x 14336 on all 32 layers; untied embedding and LM head;
    // input_layernorm and pre_ff_layernorm per layer, final_layernorm.
    const int64_t attn = int64_t{4096} * (2 * 4096 + 2 * 1024);
    const int64_t mamba =
        int64_t{4096} * (8192 + 8448 + 128) + 8448 * 5 + 3 * 128 + 8192 + int64_t{8192} * 4096;
    const int64_t total = 3 * attn + 29 * mamba + int64_t{32} * 3 * 4096 * 14336 +
                          2 * int64_t{128256} * 4096 + 32 * 2 * 4096 + 4096;
    EXPECT_EQ(m.total_params(), total);
    EXPECT_NEAR(static_cast<double>(total), 9.78e9, 0.01 * 9.78e9);

    nlohmann::json j = nlohmann::json::parse(read_file(config_path("bamba-9b")));
    j["layer_types"] = std::vector<std::string>(32, "attention");  // not read by vLLM
    expect_refused(j.dump(), "attn_layer_indices");
    j.erase("layer_types");
    j["attn_layer_indices"] = {3, 32};
    expect_refused(j.dump(), "attn_layer_indices");
    j.erase("attn_layer_indices");  // BambaConfig: every layer Mamba-2
    EXPECT_EQ(parse_hf_config(j.dump(), "b.json").kv_bytes_per_token(), 0);
    j["attn_layer_indices"] = {9};
    j["head_dim"] = 64;  // vLLM's attention takes hidden / heads = 128
    expect_refused(j.dump(), "head_dim");
    j.erase("head_dim");
    j["mamba_d_head"] = 32;  // x 128 heads must be mamba_expand x hidden
    expect_refused(j.dump(), "mamba_d_head");
}

// Falcon-H1-7B as vLLM's falcon_h1.py builds it: each FalconH1ParallelHybrid decoder layer runs
// FalconH1AttentionDecoderLayer (an Attention with its KV cache) and FalconH1SSMDecoderLayer (a
// MambaMixer2 with its conv + SSM state, registered as model.{44 + i}.mixer) side by side, then
// one FalconH1MLP. kvshard: 88 cache layers, two per decoder layer.
TEST(RealShapes, FalconH1AsVllmBuildsIt) {
    const ModelSpec m = load_hf_config(config_path("falcon-h1-7b-instruct"));
    EXPECT_EQ(m.num_decoder_layers(), 44);
    EXPECT_EQ(m.cache_layers_per_decoder_layer, 2);
    ASSERT_EQ(m.num_layers, 88);
    for (int d = 0; d < 44; ++d) {
        const LayerSpec a = m.layer(2 * d), s = m.layer(2 * d + 1);
        EXPECT_EQ(a.kind, LayerKind::kFullAttention) << d;
        EXPECT_EQ(a.num_kv_heads, 2) << d;
        EXPECT_EQ(a.head_dim, 128) << d;  // config.head_dim, not 3072 / 12 = 256
        EXPECT_EQ(a.mlp, MlpKind::kDense) << d;
        EXPECT_EQ(a.intermediate, 12288) << d;
        EXPECT_EQ(s.kind, LayerKind::kMamba2) << d;
        EXPECT_EQ(s.mlp, MlpKind::kNone) << d;  // the decoder layer's one MLP is counted once
    }
    EXPECT_EQ(m.max_model_len, 262144);
    EXPECT_EQ(m.rope_theta, 1e11);  // as the checkpoint states it
    // KV per token: 44 attention branches x K and V x 2 KV heads x 128 x bf16 = 45056 bytes.
    EXPECT_EQ(m.kv_bytes_per_token(), int64_t{44} * 2 * 2 * 128 * 2);
    // State per sequence: 44 Mamba-2 branches x bf16 x (conv 3 x (3072 + 2 x 1 x 256) + SSM
    // 24 x 128 x 256) = 44 x 1,594,368 bytes (vLLM's mamba2_state_shape at the model dtype).
    EXPECT_EQ(state_bytes(m.state, 1), 2 * (3 * 3584 + 24 * 128 * 256));
    EXPECT_EQ(m.state_bytes_per_sequence(), int64_t{44} * 1594368);
    // Params by hand, per decoder layer: attention 3072 x (2 x 12 x 128 + 2 x 2 x 128); Mamba-2
    // in_proj 3072 x (2 x 3072 + 2 x 256 + 24), conv 3584 x (4 + 1), A + D + dt_bias 3 x 24,
    // gated norm 3072, out_proj 3072 x 3072; MLP 3 x 3072 x 12288. Untied embedding and LM head
    // of 130048. 7.585B, which an mlx 4-bit copy's 4,268,832,515 bytes of weights (4.5 bits a
    // weight with its group-64 bf16 scale and bias) confirms: 7.59e9 x 4.5 / 8 = 4.27e9.
    const int64_t attn = int64_t{3072} * (2 * 12 * 128 + 2 * 2 * 128);
    const int64_t mamba =
        int64_t{3072} * (2 * 3072 + 2 * 256 + 24) + 3584 * 5 + 3 * 24 + 3072 + int64_t{3072} * 3072;
    const int64_t mlp = int64_t{3} * 3072 * 12288;
    // Norms: input_layernorm and pre_ff_layernorm per decoder layer (the Mamba-2 branch shares
    // the first), and the final norm.
    const int64_t norms = 44 * 2 * 3072 + 3072;
    const int64_t total = 44 * (attn + mamba + mlp) + 2 * int64_t{130048} * 3072 + norms;
    EXPECT_EQ(m.total_params(), total);
    EXPECT_NEAR(static_cast<double>(total), 7.59e9, 0.01e9);
    // The JSON round trip keeps the grouping.
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);

    nlohmann::json j = nlohmann::json::parse(read_file(config_path("falcon-h1-7b-instruct")));
    auto refused_with = [&](const char* key, nlohmann::json value, const std::string& needle) {
        nlohmann::json k = j;
        k[key] = std::move(value);
        expect_refused(k.dump(), needle);
    };
    refused_with("hidden_act", "gelu", "silu");
    refused_with("attention_bias", true, "attention_bias");
    refused_with("projectors_bias", true, "projectors_bias");
    refused_with("mamba_proj_bias", true, "mamba_proj_bias");
    refused_with("mamba_conv_bias", false, "mamba_conv_bias");
    refused_with("mamba_use_mlp", false, "mamba_use_mlp");
    refused_with("attn_layer_indices", {0, 1}, "attn_layer_indices");
    refused_with("mamba_d_head", 64, "mamba_d_head");    // 64 x 24 heads is not 3072
    refused_with("mamba_n_heads", 25, "mamba_n_heads");  // does not divide 3072
    // At most 16384 cache layers, two per decoder layer: 8192 decoder layers read, 10000 refused
    // by the count the config states (not the 20000 cache layers it would make).
    refused_with("num_hidden_layers", 10000,
                 "is 10000 decoder layers: model_type 'falcon_h1' makes 2 cache layers of each, "
                 "and kvshard reads at most 16384 cache layers, so at most 8192 decoder layers");
    // rope_theta absent: transformers' FalconH1Config.__init__ (4.x) sets 100000.0, which
    // vLLM's patch_rope_parameters carries into rope_parameters; falcon_h1.py's 1e11 fallback
    // (getattr / set_default_rope_theta) is for a config object without the attribute.
    nlohmann::json no_theta = j;
    no_theta.erase("rope_theta");
    EXPECT_EQ(parse_hf_config(no_theta.dump(), "t.json").rope_theta, 1e5);
    nlohmann::json deepest = j;
    deepest["num_hidden_layers"] = 8192;
    EXPECT_EQ(parse_hf_config(deepest.dump(), "d.json").num_layers, 16384);
    // mamba_d_ssm null: mamba_expand x hidden = 6144 in 24 heads of "auto" 256.
    nlohmann::json wide = j;
    wide["mamba_d_ssm"] = nullptr;
    wide["mamba_d_head"] = "auto";
    EXPECT_EQ(parse_hf_config(wide.dump(), "w.json").state.head_dim, 256);
    // The multipliers scale activations: accepted, nothing changes.
    nlohmann::json mult = j;
    mult["key_multiplier"] = 0.39;
    mult["ssm_multipliers"] = {0.35, 0.25, 0.35, 0.5, 0.35};
    mult["attention_in_multiplier"] = 1.0;
    mult["mamba_norm_before_gate"] = true;
    mult["lm_head_multiplier"] = 0.039;
    mult["embedding_multiplier"] = 5.66;
    mult["mlp_multipliers"] = {0.88, 0.59};
    EXPECT_EQ(parse_hf_config(mult.dump(), "m.json"), parse_hf_config(j.dump(), "m.json"));
    // Another family's config does not take Falcon-H1's fields.
    nlohmann::json llama = nlohmann::json::parse(read_file(config_path("llama-3.1-8b")));
    llama["mamba_d_ssm"] = 1024;
    expect_refused(llama.dump(), "mamba_d_ssm");
}

// LongCat-Flash-Chat as vLLM's longcat_flash.py builds it: each FlashDecoderLayer runs
// self_attn[0] and self_attn[1] (DeepseekV2MLAAttention with prefixes self_attn.0 and .1: two MLA
// caches), mlps[0] and mlps[1] (FlashMLP of ffn_hidden_size) and one LongcatMoe (512 experts of
// expert_ffn_hidden_size, top 12, 256 identity zero experts). kvshard: 84 cache layers, MLA +
// mlps[0], MLA + mlps[1], and the MoE on one that caches nothing.
TEST(RealShapes, LongcatFlashAsVllmBuildsIt) {
    const ModelSpec m = load_hf_config(config_path("longcat-flash-chat"));
    EXPECT_EQ(m.num_decoder_layers(), 28);
    EXPECT_EQ(m.cache_layers_per_decoder_layer, 3);
    ASSERT_EQ(m.num_layers, 84);
    for (int d = 0; d < 28; ++d) {
        for (int i : {0, 1}) {
            EXPECT_EQ(m.layer(3 * d + i).kind, LayerKind::kMla) << d;
            EXPECT_EQ(m.layer(3 * d + i).mlp, MlpKind::kDense) << d;
            EXPECT_EQ(m.layer(3 * d + i).intermediate, 12288) << d;
        }
        EXPECT_EQ(m.layer(3 * d + 2).kind, LayerKind::kNoKv) << d;
        EXPECT_TRUE(m.is_moe_layer(3 * d + 2)) << d;
    }
    EXPECT_EQ(m.moe.num_experts, 512);
    EXPECT_EQ(m.moe.experts_per_token, 12);
    EXPECT_EQ(m.moe.expert_intermediate, 2048);
    EXPECT_EQ(m.moe.shared_experts, 0);
    EXPECT_EQ(m.num_moe_layers(), 28);
    EXPECT_FALSE(m.mtp.enabled());
    EXPECT_EQ(m.max_model_len, 131072);
    // KV per token: 28 decoder layers x 2 MLA latents x (512 + 64) x bf16 = 64,512 bytes.
    EXPECT_EQ(m.kv_bytes_per_token(), int64_t{28} * 2 * (512 + 64) * 2);
    EXPECT_EQ(m.state_bytes_per_sequence(), 0);
    // Params by hand, per decoder layer: two MLA attentions, each q_a 6144 x 1536 + q_b 1536 x
    // 64 x (128 + 64) + kv_a 6144 x (512 + 64) + kv_b 512 x 64 x (128 + 128) + o 64 x 128 x
    // 6144; two FlashMLPs 3 x 6144 x 12288; 512 experts of 3 x 6144 x 2048 and the router's 6144
    // x 512 real-expert columns. Untied embedding and LM head of 131072. Published: 560B total,
    // 18.6B-31.3B active by how many zero experts a token picks; kvshard's active count takes
    // 12 real experts, the top of that range.
    const int64_t mla = int64_t{6144} * 1536 + int64_t{1536} * 64 * 192 + int64_t{6144} * 576 +
                        int64_t{512} * 64 * 256 + int64_t{64} * 128 * 6144;
    const int64_t dense = int64_t{3} * 6144 * 12288;
    const int64_t expert = int64_t{3} * 6144 * 2048;
    const int64_t router = int64_t{6144} * 512;
    const int64_t embed = int64_t{131072} * 6144;
    // Norms: per decoder layer input_layernorm[0..1] and post_attention_layernorm[0..1], each
    // attention's q_a_layernorm (1536) and kv_a_layernorm (512); the final norm.
    const int64_t norms = 28 * (4 * 6144 + 2 * (1536 + 512)) + 6144;
    const int64_t total = 28 * (2 * mla + 2 * dense + 512 * expert + router) + 2 * embed + norms;
    EXPECT_EQ(m.total_params(), total);
    EXPECT_NEAR(static_cast<double>(total), 560e9, 0.005 * 560e9);
    const int64_t active = 28 * (2 * mla + 2 * dense + 12 * expert + router) + embed + norms;
    EXPECT_EQ(m.active_params_per_token(), active);
    EXPECT_NEAR(static_cast<double>(active), 31.3e9, 0.1e9);
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);

    nlohmann::json j = nlohmann::json::parse(read_file(config_path("longcat-flash-chat")));
    auto refused_with = [&](const char* key, nlohmann::json value, const std::string& needle) {
        nlohmann::json k = j;
        k[key] = std::move(value);
        expect_refused(k.dump(), needle);
    };
    refused_with("attention_method", "GQA", "attention_method");
    refused_with("zero_expert_type", "const", "zero_expert_type");
    refused_with("num_hidden_layers", 56, "num_hidden_layers");  // transformers' cache count
    refused_with("hidden_act", "gelu", "silu");
    refused_with("qk_head_dim", 256, "qk_head_dim");
    // vLLM's LongcatMoe takes FlashConfig's moe_topk and moe_intermediate_size, built from the
    // loaded config object (longcat_flash.py, FlashConfig(**hf_config.__dict__)): the
    // checkpoint's remote LongcatFlashConfig (configuration_longcat_flash.py) sets moe_topk
    // (default 12) whatever num_experts_per_tok says and overwrites moe_intermediate_size with
    // expert_ffn_hidden_size (2048); transformers' LongcatFlashConfig aliases
    // num_experts_per_tok to moe_topk and lets a stated moe_intermediate_size through. A value
    // the two classes would hand vLLM differently is refused; an agreeing one is read.
    refused_with("num_experts_per_tok", 8, "field 'num_experts_per_tok' is 8 beside moe_topk 12");
    refused_with("moe_intermediate_size", 1024,
                 "field 'moe_intermediate_size' is 1024 beside expert_ffn_hidden_size 2048");
    refused_with("intermediate_size", 8192,
                 "field 'ffn_hidden_size' is 12288 beside intermediate_size 8192");
    nlohmann::json agreeing = j;
    agreeing["num_experts_per_tok"] = 12;
    agreeing["moe_intermediate_size"] = 2048;
    agreeing["intermediate_size"] = 12288;
    EXPECT_EQ(parse_hf_config(agreeing.dump(), "a.json"), m);
    nlohmann::json defaults = j;  // the classes' defaults: top 12 of 2048, dense 12288
    defaults.erase("moe_topk");
    defaults.erase("expert_ffn_hidden_size");
    defaults.erase("ffn_hidden_size");
    EXPECT_EQ(parse_hf_config(defaults.dump(), "d.json"), m);
    // Three cache layers per decoder layer: at most 16384 / 3 = 5461 decoder layers.
    refused_with("num_layers", 5462, "is 5462 decoder layers");
    refused_with("num_layers", 5462, "at most 5461 decoder layers");
    nlohmann::json deepest = j;
    deepest["num_layers"] = 5461;
    EXPECT_EQ(parse_hf_config(deepest.dump(), "d.json").num_layers, 16383);
    nlohmann::json same = j;
    same["num_hidden_layers"] = 28;        // one count, written twice: accepted
    same["num_nextn_predict_layers"] = 1;  // vLLM skips the MTP weights: not modelled
    same["qk_head_dim"] = 192;             // LongcatFlashConfig's qk_nope + qk_rope
    EXPECT_EQ(parse_hf_config(same.dump(), "l.json").num_decoder_layers(), 28);
    nlohmann::json gqa = j;
    gqa.erase("kv_lora_rank");
    gqa["num_key_value_heads"] = 8;
    expect_refused(gqa.dump(), "MLA");
}

// Jamba-v0.1 as vLLM's jamba.py builds it: JambaConfig.layers_block_type (attention where
// l % 8 == 4), layers_num_experts (16 experts, top 2, on odd layers; JambaMLP elsewhere),
// Mamba-1 mixers of d_inner 2 x 4096. Published: 52B total, 12B active.
TEST(RealShapes, JambaAsVllmBuildsIt) {
    const ModelSpec m = load_hf_config(config_path("jamba-v0.1"));
    int attn = 0, mamba = 0;
    for (int l = 0; l < 32; ++l) {
        const LayerKind k = m.layer(l).kind;
        EXPECT_EQ(k, l % 8 == 4 ? LayerKind::kFullAttention : LayerKind::kMamba1) << l;
        EXPECT_EQ(m.is_moe_layer(l), l % 2 == 1) << l;
        attn += k == LayerKind::kFullAttention;
        mamba += k == LayerKind::kMamba1;
    }
    EXPECT_EQ(attn, 4);
    EXPECT_EQ(mamba, 28);
    // No length field vLLM reads: JambaConfig's default max_position_embeddings.
    EXPECT_EQ(m.max_model_len, 262144);
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_EQ(m.kv_bytes_per_token(), int64_t{4} * 2 * 8 * 128 * 2);
    // State per sequence, tp 1: 28 x bf16 x (3 x 8192 + 8192 x 16) = 8,716,288 bytes; tp 2:
    // half the channels on each rank.
    EXPECT_EQ(m.state_bytes_per_sequence(), int64_t{28} * 2 * (3 * 8192 + 8192 * 16));
    EXPECT_EQ(state_bytes(m.state, 1), 2 * (3 * 8192 + 8192 * 16));
    EXPECT_EQ(state_bytes(m.state, 2), 2 * (3 * 4096 + 4096 * 16));
    EXPECT_EQ(state_bytes(m.state, 2), mamba1_state_by_hand(8192, 16, 4, 2));
    // The layout sizes a rank's state groups with the same bytes.
    for (int tp : {1, 2}) {
        ParallelConfig p;
        p.tp = tp;
        const KvLayout lay = make_layout(m, p);
        int64_t state = 0;
        for (const auto& g : lay.ranks.at(0).groups) state += g.state_bytes_per_sequence;
        EXPECT_EQ(state, 28 * mamba1_state_by_hand(8192, 16, 4, tp)) << tp;
        EXPECT_EQ(lay.ranks.at(0).state_bytes_per_sequence, state) << tp;
    }
    // Parameters by hand. Mamba-1: in_proj 4096 x 2 x 8192, conv 8192 x (4 + 1), x_proj 8192 x
    // (256 + 2 x 16), dt_proj 256 x 8192 + 8192, A 8192 x 16, D 8192, out_proj 8192 x 4096, the
    // dt / B / C RMSNorms of 256, 16, 16.
    const int64_t c = 8192;
    const int64_t mixer =
        4096 * 2 * c + c * 5 + c * (256 + 32) + 256 * c + c + c * 16 + c + c * 4096 + 256 + 32;
    const int64_t attn_p = int64_t{4096} * (2 * 4096 + 2 * 1024);
    const int64_t mlp = int64_t{3} * 4096 * 14336;
    const int64_t moe = 16 * mlp + int64_t{4096} * 16;
    // input_layernorm and pre_ff_layernorm per layer, final_layernorm.
    const int64_t norms = 32 * 2 * 4096 + 4096;
    const int64_t total =
        4 * attn_p + 28 * mixer + 16 * mlp + 16 * moe + 2 * int64_t{65536} * 4096 + norms;
    EXPECT_EQ(m.total_params(), total);
    EXPECT_NEAR(static_cast<double>(total), 51.6e9, 0.01 * 51.6e9);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()), 12e9, 0.05 * 12e9);

    nlohmann::json j = nlohmann::json::parse(read_file(config_path("jamba-v0.1")));
    j["mamba_dt_rank"] = 128;  // not what kvshard counts
    expect_refused(j.dump(), "mamba_dt_rank");
    j["mamba_dt_rank"] = "auto";
    EXPECT_EQ(parse_hf_config(j.dump(), "j.json").total_params(), total);
    // vLLM's MambaMixer takes use_conv_bias=mamba_conv_bias (the conv1d bias counted above) and
    // use_bias=mamba_proj_bias (in_proj / out_proj biases, not counted): JambaConfig's defaults,
    // stated or not, are what the count holds; the other settings are refused, not miscounted.
    j["mamba_conv_bias"] = true;
    j["mamba_proj_bias"] = false;
    EXPECT_EQ(parse_hf_config(j.dump(), "j.json").total_params(), total);
    j["mamba_conv_bias"] = false;
    expect_refused(j.dump(), "'mamba_conv_bias' is false: kvshard counts Jamba's Mamba-1 weights");
    j["mamba_conv_bias"] = true;
    j["mamba_proj_bias"] = true;
    expect_refused(j.dump(), "'mamba_proj_bias' is true: kvshard counts Jamba's Mamba-1 weights");
    j["mamba_proj_bias"] = false;
    j["attn_layer_offset"] = 8;  // JambaConfig: offset below period
    expect_refused(j.dump(), "attn_layer_offset");
    j["attn_layer_offset"] = 4;
    j["num_experts"] = 1;  // layers_num_experts all 1: JambaMLP everywhere
    const ModelSpec dense = parse_hf_config(j.dump(), "j.json");
    EXPECT_FALSE(dense.moe.enabled());
    EXPECT_EQ(dense.num_moe_layers(), 0);
    // tp must divide d_inner (vLLM's divide in mamba1_state_shape).
    j["num_experts"] = 16;
    j["mamba_expand"] = 3;
    j["hidden_size"] = 4096;
    const ModelSpec odd = parse_hf_config(j.dump(), "j.json");
    EXPECT_EQ(odd.state.heads, 12288);
    // A state of 4 channels: tp 8 divides the 32 heads and 8 KV heads (and would replicate 4
    // heads of another kind), but vLLM cannot split 4 channels 8 ways.
    ModelSpec narrow = m;
    narrow.state.heads = 4;
    const auto tps = valid_tp_sizes(narrow);
    EXPECT_NE(std::find(tps.begin(), tps.end(), 4), tps.end());
    EXPECT_EQ(std::find(tps.begin(), tps.end(), 8), tps.end());
    ParallelConfig p8;
    p8.tp = 8;
    try {
        (void)make_layout(narrow, p8);
        ADD_FAILURE() << "tp=8 over 4 Mamba-1 channels was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("does not divide the 4 channels"), std::string::npos)
            << e.what();
    }
    // AI21-Jamba-1.5-Mini, the published config quoted verbatim: the same shapes as the
    // reconstructed v0.1 file (which confirms its values), its length stated as
    // max_position_embeddings.
    const ModelSpec mini = load_hf_config(config_path("jamba-1.5-mini"));
    EXPECT_EQ(mini.total_params(), m.total_params());
    EXPECT_EQ(mini.kv_bytes_per_token(), m.kv_bytes_per_token());
    EXPECT_EQ(mini.state_bytes_per_sequence(), m.state_bytes_per_sequence());
    EXPECT_EQ(mini.max_model_len, 262144);
    EXPECT_EQ(mini.max_model_len_from, "max_position_embeddings 262144");
    for (int l = 0; l < 32; ++l) EXPECT_EQ(mini.layer(l).kind, m.layer(l).kind) << l;
    // No speculative conv rows for Mamba-1 (mamba1_state_shape takes no num_spec).
    ModelSpec spec = m;
    spec.state.spec_conv_rows = 2;
    EXPECT_THROW(spec.validate(), Error);
}

// Hunyuan dense: Llama 3.1 8B's layers under another vocabulary; the experts and the cross-layer
// attention vLLM's hunyuan_v1.py would build are refused, not read as dense layers.
TEST(RealShapes, HunyuanDenseAsVllmBuildsIt) {
    const ModelSpec hy = load_hf_config(config_path("hy-mt2-7b"));
    const ModelSpec llama = load_hf_config(config_path("llama-3.1-8b"));
    EXPECT_EQ(hy.kv_bytes_per_token(), llama.kv_bytes_per_token());
    // The same layers plus HunYuanAttention's query_layernorm / key_layernorm of head_dim 128
    // (use_qk_norm); a tied embedding of 128167 rows instead of Llama's two of 128256.
    EXPECT_EQ(hy.total_params(), llama.total_params() + 32 * 2 * 128 - int64_t{128256} * 4096 * 2 +
                                     int64_t{128167} * 4096);
    nlohmann::json j = nlohmann::json::parse(read_file(config_path("hy-mt2-7b")));
    j["num_experts"] = 1;  // _is_moe: not above 1, the dense MLP
    EXPECT_EQ(parse_hf_config(j.dump(), "h.json").total_params(), hy.total_params());
    j["head_dim"] = nullptr;  // HunYuanAttention: head_dim unset -> attention_head_dim
    j["attention_head_dim"] = 64;
    EXPECT_EQ(parse_hf_config(j.dump(), "h.json").head_dim, 64);
    j["head_dim"] = 128;
    j["num_experts"] = 8;  // experts, but HunYuanDenseV1Config names no moe_topk default
    expect_refused(j.dump(), "moe_topk");
    j["moe_topk"] = 2;
    j["moe_intermediate_size"] = 14336;
    const ModelSpec moe = parse_hf_config(j.dump(), "h.json");
    EXPECT_EQ(moe.moe.num_experts, 8);
    EXPECT_EQ(moe.num_moe_layers(), 32);
    j["num_experts"] = std::vector<int>(32, 2);  // the MoE block needs one count
    expect_refused(j.dump(), "num_experts");
    j["num_experts"] = nlohmann::json::array({2, nullptr});  // _is_moe: not all ints, dense
    EXPECT_EQ(parse_hf_config(j.dump(), "h.json").total_params(), hy.total_params());
    j.erase("num_experts");
    j["use_cla"] = true;  // with cla_share_factor 2: odd layers read the even layers' K and V
    expect_refused(j.dump(), "use_cla");
    j["cla_share_factor"] = 1;  // _get_cla_factor 1: every layer its own attention
    EXPECT_EQ(parse_hf_config(j.dump(), "h.json").kv_bytes_per_token(), hy.kv_bytes_per_token());
}

// Olmo 2 / 3, Command R7B / A (cohere2), EXAONE 4.0 and Granite 3.x: parameter counts against
// the published sizes, the class defaults of absent fields, and what is refused.
TEST(RealShapes, OlmoCohereExaoneGraniteAsVllmBuildsThem) {
    auto near = [](int64_t got, double published, double tolerance) {
        return std::abs(static_cast<double>(got) - published) <= tolerance * published;
    };
    // Published sizes: Olmo-3-1025-7B and OLMo-2-1124-7B "7B" (7.30B with the untied head),
    // c4ai-command-r7b-12-2024 8.03B (tied embeddings), EXAONE-4.0-32B 32.0B, granite-3.3-8b
    // 8,170,864,640 (its safetensors; we count no norms), granite-3.1-3b-a800m 3.3B. Norm
    // weights are not counted: 0.1% for the exact figure, 1.5% for the rounded ones.
    const ModelSpec olmo3 = load_hf_config(config_path("olmo-3-7b"));
    EXPECT_TRUE(near(olmo3.total_params(), 7.30e9, 0.015)) << olmo3.total_params();
    const ModelSpec olmo2 = load_hf_config(config_path("olmo-2-7b-instruct"));
    EXPECT_TRUE(near(olmo2.total_params(), 7.30e9, 0.015)) << olmo2.total_params();
    const ModelSpec r7b = load_hf_config(config_path("c4ai-command-r7b-12-2024"));
    EXPECT_TRUE(r7b.tie_embeddings);
    EXPECT_TRUE(near(r7b.total_params(), 8.03e9, 0.015)) << r7b.total_params();
    const ModelSpec exaone = load_hf_config(config_path("exaone-4.0-32b"));
    EXPECT_TRUE(near(exaone.total_params(), 32.0e9, 0.015)) << exaone.total_params();
    const ModelSpec granite = load_hf_config(config_path("granite-3.3-8b-instruct"));
    EXPECT_TRUE(near(granite.total_params(), 8170864640.0, 0.001)) << granite.total_params();
    const ModelSpec gmoe = load_hf_config(config_path("granite-3.1-3b-a800m-instruct"));
    EXPECT_EQ(gmoe.moe.num_experts, 40);
    EXPECT_EQ(gmoe.moe.experts_per_token, 8);
    EXPECT_EQ(gmoe.moe.expert_intermediate, 512);
    EXPECT_TRUE(near(gmoe.total_params(), 3.3e9, 0.015)) << gmoe.total_params();
    // KV bytes per token per layer kind, bf16: Olmo 3 sliding and full 2 x 32 x 128 x 2.
    EXPECT_EQ(olmo3.kv_bytes_per_token_of_layer(0), 16384);
    EXPECT_EQ(olmo3.layer(0).kind, LayerKind::kSlidingWindow);
    EXPECT_EQ(olmo3.layer(3).kind, LayerKind::kFullAttention);
    EXPECT_EQ(r7b.kv_bytes_per_token(), 32 * 2 * 8 * 128 * 2);
    EXPECT_EQ(exaone.layer(62).window, 4096);
    EXPECT_EQ(exaone.layer(63).kind, LayerKind::kFullAttention);

    auto edited = [](const std::string& file, const std::function<void(nlohmann::json&)>& edit) {
        nlohmann::json j = nlohmann::json::parse(read_file(config_path(file)));
        edit(j);
        return j.dump();
    };
    // Olmo 3 without layer_types and sliding_window: Olmo3Config's 3 : 1 and 4096.
    const ModelSpec olmo3_bare = parse_hf_config(edited("olmo-3-7b",
                                                        [](nlohmann::json& j) {
                                                            j.erase("layer_types");
                                                            j.erase("sliding_window");
                                                        }),
                                                 "olmo3.json");
    EXPECT_EQ(olmo3_bare.layers, olmo3.layers);
    // A sliding_window of null reaches vLLM's Attention as no window: every layer full.
    const ModelSpec olmo3_null = parse_hf_config(
        edited("olmo-3-7b", [](nlohmann::json& j) { j["sliding_window"] = nullptr; }), "o.json");
    EXPECT_EQ(olmo3_null.kv_bytes_per_token(), 32 * 16384);
    EXPECT_TRUE(olmo3_null.uniform());
    // vLLM's Olmo 2 / 3, Cohere 2 and Granite MoE attention use hidden / heads: a head_dim that
    // disagrees is refused, one that agrees is accepted (Command R7B writes 128).
    expect_refused(edited("olmo-3-7b", [](nlohmann::json& j) { j["head_dim"] = 64; }),
                   "hidden_size / num_attention_heads = 128");
    expect_refused(
        edited("granite-3.1-3b-a800m-instruct", [](nlohmann::json& j) { j["head_dim"] = 128; }),
        "head_dim");
    expect_refused(
        edited("c4ai-command-r7b-12-2024", [](nlohmann::json& j) { j["head_dim"] = 256; }),
        "head_dim");
    // Granite (dense) reads head_dim as vLLM's GraniteAttention does.
    const ModelSpec granite_hd = parse_hf_config(
        edited("granite-3.3-8b-instruct", [](nlohmann::json& j) { j["head_dim"] = 64; }), "g.json");
    EXPECT_EQ(granite_hd.kv_bytes_per_token(), 40 * 2 * 8 * 64 * 2);
    // Cohere 2: sliding_window_pattern drives the layers without layer_types; another order of the
    // layers is refused; with layer_types listed they win (vLLM reads them), whatever the pattern.
    const ModelSpec r7b_2 =
        parse_hf_config(edited("c4ai-command-r7b-12-2024",
                               [](nlohmann::json& j) { j["sliding_window_pattern"] = 2; }),
                        "r.json");
    EXPECT_EQ(r7b_2.layer(0).kind, LayerKind::kSlidingWindow);
    EXPECT_EQ(r7b_2.layer(1).kind, LayerKind::kFullAttention);
    EXPECT_EQ(r7b_2.layer(2).kind, LayerKind::kSlidingWindow);
    expect_refused(
        edited("c4ai-command-r7b-12-2024",
               [](nlohmann::json& j) { j["order_of_interleaved_layers"] = "global_attn_first"; }),
        "order_of_interleaved_layers");
    const ModelSpec r7b_listed = parse_hf_config(
        edited("c4ai-command-r7b-12-2024",
               [](nlohmann::json& j) {
                   std::vector<std::string> types;
                   for (int l = 0; l < 32; ++l)
                       types.push_back(l % 2 ? "full_attention" : "sliding_attention");
                   j["layer_types"] = types;  // pattern 2; the file says 4
               }),
        "r.json");
    EXPECT_EQ(r7b_listed.layer(1).kind, LayerKind::kFullAttention);
    EXPECT_EQ(r7b_listed.layer(2).kind, LayerKind::kSlidingWindow);
    // EXAONE 4: a string pattern needs layer_types, which win over it.
    expect_refused(edited("exaone-4.0-32b", [](nlohmann::json& j) { j.erase("layer_types"); }),
                   "give layer_types");
    const ModelSpec exaone_published =
        parse_hf_config(read_file(config_path("exaone-4.0-32b")), "e.json");
    EXPECT_EQ(
        parse_hf_config(edited("exaone-4.0-32b",
                               [](nlohmann::json& j) { j["sliding_window_pattern"] = "LLGG"; }),
                        "e.json"),
        exaone);
    expect_refused(
        edited("exaone-4.0-32b", [](nlohmann::json& j) { j["sliding_window_pattern"] = "LLXG"; }),
        "string of L (local) and G (global)");
    // A null window makes the layer_types' sliding layers full (vLLM's Attention gets no window),
    // whatever pattern is written (Exaone4Config sets it to 0 then); refused without layer_types.
    const ModelSpec exaone_full = parse_hf_config(edited("exaone-4.0-32b",
                                                         [](nlohmann::json& j) {
                                                             j["sliding_window"] = nullptr;
                                                             j["sliding_window_pattern"] = 0;
                                                         }),
                                                  "e.json");
    EXPECT_TRUE(exaone_full.uniform());
    expect_refused(edited("exaone-4.0-32b",
                          [](nlohmann::json& j) {
                              j["sliding_window"] = nullptr;
                              j.erase("layer_types");
                              j["sliding_window_pattern"] = 4;
                          }),
                   "give layer_types");
    EXPECT_TRUE(parse_hf_config(edited("exaone-4.0-32b",
                                       [](nlohmann::json& j) { j["sliding_window"] = nullptr; }),
                                "e.json")
                    .uniform());
    // A pattern of 0 beside layer_types is harmless; without them it derives nothing.
    EXPECT_EQ(parse_hf_config(edited("exaone-4.0-32b",
                                     [](nlohmann::json& j) { j["sliding_window_pattern"] = 0; }),
                              "e.json"),
              exaone_published);
    expect_refused(edited("exaone-4.0-32b",
                          [](nlohmann::json& j) {
                              j.erase("layer_types");
                              j["sliding_window_pattern"] = 0;
                          }),
                   "is 0 and layer_types is missing");
    // An integer pattern alone is Exaone4Config's derivation.
    const ModelSpec exaone_int = parse_hf_config(edited("exaone-4.0-32b",
                                                        [](nlohmann::json& j) {
                                                            j.erase("layer_types");
                                                            j["sliding_window_pattern"] = 4;
                                                        }),
                                                 "e.json");
    EXPECT_EQ(exaone_int.layers, exaone.layers);
    // Fields of other families: refused where they would be ignored.
    expect_refused(
        edited("olmo-2-7b-instruct", [](nlohmann::json& j) { j["sliding_window_pattern"] = 4; }),
        "sliding_window_pattern");
    expect_refused(
        edited("olmo-2-7b-instruct", [](nlohmann::json& j) { j["sliding_window"] = 4096; }),
        "no layer of model_type 'olmo2' slides");
    expect_refused(edited("granite-3.3-8b-instruct",
                          [](nlohmann::json& j) { j["order_of_interleaved_layers"] = "x"; }),
                   "order_of_interleaved_layers");
}

TEST(RealShapes, CatalogEntriesMatchTheirPublishedConfigs) {
    // The catalog's per-layer models are read from trimmed copies of these files: the KV figures
    // must be the same as the whole published file's.
    for (auto [name, file] : {std::pair{"gpt-oss-120b", "gpt-oss-120b"},
                              {"gemma-3-27b", "gemma-3-27b"},
                              {"mistral-7b-v0.1", "mistral-7b-v0.1"},
                              {"qwen3-next-80b-a3b", "qwen3-next-80b-a3b"},
                              {"deepseek-v3.2", "deepseek-v3.2-exp"},
                              {"llama-4-scout", "llama-4-scout"},
                              {"nemotron-h-8b", "nemotron-h-8b"},
                              {"qwen3.5-35b-a3b", "qwen3.5-35b-a3b"},
                              {"glm-4.5-air", "glm-4.5-air"},
                              {"minimax-m2", "minimax-m2"},
                              {"gemma-4-31b", "gemma-4-31b"},
                              {"granite-4.0-h-tiny", "granite-4.0-h-tiny"}}) {
        SCOPED_TRACE(name);
        ModelSpec cat = catalog_model(name);
        ModelSpec pub = load_hf_config(config_path(file));
        EXPECT_EQ(cat.layers, pub.layers);
        EXPECT_EQ(cat.state, pub.state);
        EXPECT_EQ(cat.indexer, pub.indexer);
        EXPECT_EQ(cat.mtp, pub.mtp);
        EXPECT_EQ(cat.kv_bytes_per_token(), pub.kv_bytes_per_token());
        EXPECT_EQ(cat.total_params(), pub.total_params());
    }
}

// Nemotron 3 Super's LatentMoE, as vLLM's NemotronHMoE (models/nemotron_h.py) builds it when
// moe_latent_size is not None: the gate (GateLinear hidden -> n_routed_experts) and the shared
// experts (NemotronHMLP, up + down at hidden, moe_shared_expert_intermediate_size x
// n_shared_experts wide) at hidden_size; the routed experts (FusedMoE, hidden_size =
// moe_latent_size, up + down of moe_intermediate_size) between fc1_latent_proj (hidden -> latent)
// and fc2_latent_proj (latent -> hidden), both ReplicatedLinear. The config file is a labelled
// reconstruction (tests/data/hf_configs/README.md).
TEST(RealShapes, NemotronHLatentMoeAsVllmBuildsIt) {
    const std::string text = read_file(config_path("nemotron-3-super-120b-a12b"));
    const ModelSpec m = parse_hf_config(text, "nemotron-3-super.json");
    int mamba = 0, attention = 0, moe = 0;
    for (int l = 0; l < m.num_layers; ++l) {
        mamba += m.layer(l).kind == LayerKind::kMamba2;
        attention += m.layer(l).kind == LayerKind::kFullAttention;
        moe += m.layer(l).mlp == MlpKind::kMoe;
    }
    EXPECT_EQ(m.num_layers, 88);
    EXPECT_EQ(mamba, 40);
    EXPECT_EQ(attention, 8);
    EXPECT_EQ(moe, 40);
    EXPECT_EQ(m.moe.num_experts, 512);
    EXPECT_EQ(m.moe.experts_per_token, 22);
    EXPECT_EQ(m.moe.latent_size, 1024);
    EXPECT_EQ(m.moe.shared_experts, 2);  // 5376 = 2 x 2688
    // KV is the attention layers' alone: 8 x K and V x 2 KV heads x 128 x bf16.
    EXPECT_EQ(m.kv_bytes_per_token(), 8 * 2 * 2 * 128 * 2);
    // The Mamba-2 state: 128 heads of 64, 8 groups of state 128, conv 4, the SSM state at fp32.
    EXPECT_EQ(m.state_bytes_per_sequence(), 40 * state_bf16_ssm_fp32(128, 64, 8, 128, 4, 1));
    // Parameters by hand. Routed expert: up + down at the latent, 2 x 1024 x 2688; shared
    // expert: 2 x 4096 x 5376; latent projections 2 x 4096 x 1024; router 4096 x 512 and its
    // e_score_correction_bias of 512 (NemotronHMoE).
    const int64_t routed = 2LL * 1024 * 2688, shared = 2LL * 4096 * 5376;
    const int64_t latent = 2LL * 4096 * 1024, router = 4096LL * 512 + 512;
    EXPECT_EQ(m.routed_expert_params(), routed);
    EXPECT_EQ(m.latent_projection_params(), latent);
    EXPECT_EQ(m.moe_params_per_layer(), 512 * routed + shared + latent + router);
    // Mamba-2 (in_proj 4096 x (8192 + 10240 + 128), conv1d 10240 x (4 + 1), A / D / dt_bias,
    // norm 8192, out_proj 8192 x 4096), attention (Q, O 4096 x 4096; K, V 4096 x 256),
    // untied embedding and LM head 131072 x 4096; one norm per layer and norm_f.
    const int64_t norms = 88 * 4096 + 4096;
    const int64_t mamba_p =
        4096LL * (8192 + 10240 + 128) + 10240 * 5 + 3 * 128 + 8192 + 8192LL * 4096;
    const int64_t attention_p = 2LL * 4096 * 4096 + 2LL * 4096 * 256;
    const int64_t vocab = 131072LL * 4096;
    const int64_t total = 40 * mamba_p + 8 * attention_p +
                          40 * (512 * routed + shared + latent + router) + 2 * vocab + norms;
    EXPECT_EQ(m.total_params(), total);  // 120,668,707,840
    const int64_t active = 40 * mamba_p + 8 * attention_p +
                           40 * (22 * routed + shared + latent + router) + vocab + norms;
    EXPECT_EQ(m.active_params_per_token(), active);  // 12,233,366,528
    // Published: 120B total, 12B active ("Nemotron 3 Super 120B-A12B").
    EXPECT_NEAR(static_cast<double>(m.total_params()), 120e9, 0.01 * 120e9);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()), 12e9, 0.03 * 12e9);
    // Routed experts at hidden (no latent) would be four times wider: a 451B model, not 120B.
    nlohmann::json j = nlohmann::json::parse(text);
    j["moe_latent_size"] = nullptr;  // null reads as no latent, as vLLM's `is not None`
    const ModelSpec wide = parse_hf_config(j.dump(), "wide.json");
    EXPECT_EQ(wide.moe.latent_size, 0);
    EXPECT_EQ(wide.moe_params_per_layer(), 512 * 2LL * 4096 * 2688 + shared + router);
    EXPECT_GT(wide.total_params(), 3 * m.total_params());
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);
    // The MTP step ("*E"): an attention layer with KV, then a latent MoE layer of the model's.
    EXPECT_EQ(m.mtp.layers, 1);
    ASSERT_EQ(m.mtp.following.size(), 1u);
    EXPECT_EQ(m.mtp.following[0].mlp, MlpKind::kMoe);
    EXPECT_EQ(m.mtp.layer.kind, LayerKind::kFullAttention);
    // A latent without routed experts, or in another family: refused by name.
    j = nlohmann::json::parse(text);
    j["moe_latent_size"] = 0;
    expect_refused(j.dump(), "moe_latent_size");
    expect_refused(R"({"model_type": "nemotron_h", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 100, "hybrid_override_pattern": "M-",
        "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
        "conv_kernel": 4, "moe_latent_size": 32})",
                   "no routed experts");
    expect_refused(R"({"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_latent_size": 32})",
                   "moe_latent_size");
    ModelSpec bad = m;
    bad.moe.latent_size = -1;
    EXPECT_THROW(bad.validate(), Error);
}

// LFM2-8B-A1B (lfm2_moe), as vLLM's lfm2_moe.py builds it: layer i is Lfm2MoeAttentionDecoderLayer
// where layer_types[i] is "full_attention" (GQA, head_dim hidden / heads, q / k layernorms), else
// Lfm2MoeShortConvDecoderLayer (LFM2's ShortConv); its MLP is Lfm2MoeMlp (w13 + w2 at
// intermediate_size, no auto-adjust) below num_dense_layers, else Lfm2MoeSparseMoeBlock (a gate of
// hidden x num_experts, FusedMoE of num_experts experts of moe_intermediate_size, top
// num_experts_per_tok, no shared experts).
TEST(RealShapes, Lfm2MoeAsVllmBuildsIt) {
    const std::string text = read_file(config_path("lfm2-8b-a1b"));
    const ModelSpec m = parse_hf_config(text, "lfm2-moe.json");
    EXPECT_EQ(m.layer_mix(), "24 layers: 18 short_conv + 6 full");
    for (int l : {2, 6, 10, 14, 18, 21}) EXPECT_EQ(m.layer(l).kind, LayerKind::kFullAttention);
    EXPECT_EQ(m.layer(0).kind, LayerKind::kShortConv);
    EXPECT_EQ(m.head_dim, 64);  // 2048 / 32
    EXPECT_EQ(m.kv_bytes_per_token(), 6 * 2 * 8 * 64 * 2);
    // Conv state: (3 - 1) x 2048 channels x bf16 per short-conv layer.
    EXPECT_EQ(m.state_bytes_per_sequence(), 18 * 2 * 2048 * 2);
    EXPECT_EQ(m.moe.num_experts, 32);
    EXPECT_EQ(m.moe.experts_per_token, 4);
    EXPECT_EQ(m.moe.expert_intermediate, 1792);
    EXPECT_EQ(m.moe.shared_experts, 0);
    EXPECT_EQ(m.moe.first_dense_layers, 2);
    EXPECT_EQ(m.intermediate, 7168);  // intermediate_size as it stands (LFM2 would take 2/3)
    EXPECT_EQ(m.layer(1).mlp, MlpKind::kDense);
    EXPECT_EQ(m.layer(2).mlp, MlpKind::kMoe);
    EXPECT_EQ(m.layer(23).mlp, MlpKind::kMoe);
    EXPECT_TRUE(m.tie_embeddings);  // Lfm2MoeConfig's default
    // Parameters by hand: embedding 65536 x 2048 (tied); 6 attention layers (Q, O 2048^2; K, V
    // 2048 x 512); 18 short convs (in_proj 3 x 2048^2, out_proj 2048^2, conv 2048 x 3); 2 dense
    // MLPs 3 x 2048 x 7168; 22 MoE layers of 32 experts 3 x 2048 x 1792, the gate 2048 x 32 and
    // its e_score_correction_bias of 32 (use_expert_bias); q_layernorm / k_layernorm of 64 on the
    // attention layers; operator_norm and ffn_norm per layer, the final embedding_norm.
    const int64_t h = 2048, vocab = 65536 * h;
    const int64_t attention = 2 * h * h + 2 * h * 512 + 2 * 64, conv = 4 * h * h + 3 * h;
    const int64_t dense = 3 * h * 7168, expert = 3 * h * 1792, router = h * 32 + 32;
    const int64_t norms = 24 * 2 * h + h;
    const int64_t total =
        vocab + 6 * attention + 18 * conv + 2 * dense + 22 * (32 * expert + router) + norms;
    EXPECT_EQ(m.total_params(), total);  // 8,339,930,560
    const int64_t active =
        vocab + 6 * attention + 18 * conv + 2 * dense + 22 * (4 * expert + router) + norms;
    EXPECT_EQ(m.active_params_per_token(), active);  // 1,557,740,992
    // Published: 8.3B total, 1.5B active.
    EXPECT_NEAR(static_cast<double>(m.total_params()), 8.3e9, 0.01 * 8.3e9);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()), 1.5e9, 0.05 * 1.5e9);
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);
    // Lfm2MoeConfig's defaults where the config is silent: 2 dense layers, 32 experts top 4.
    nlohmann::json j = nlohmann::json::parse(text);
    for (const char* k : {"num_dense_layers", "num_experts", "num_experts_per_tok"}) j.erase(k);
    EXPECT_EQ(parse_hf_config(j.dump(), "lfm2-moe.json"), m);
    // num_dense_layers names the dense layers: 4 dense, 20 MoE.
    j = nlohmann::json::parse(text);
    j["num_dense_layers"] = 4;
    const ModelSpec four = parse_hf_config(j.dump(), "lfm2-moe.json");
    EXPECT_EQ(four.layer(3).mlp, MlpKind::kDense);
    EXPECT_EQ(four.num_moe_layers(), 20);
    j["num_dense_layers"] = -1;
    expect_refused(j.dump(), "num_dense_layers");
    // vLLM reads layer_types only: full_attn_idxs alone is refused, as is LFM2's MLP sizing.
    j = nlohmann::json::parse(text);
    j.erase("layer_types");
    j["full_attn_idxs"] = {2, 6, 10, 14, 18, 21};
    expect_refused(j.dump(), "layer_types");
    j = nlohmann::json::parse(text);
    j["block_ff_dim"] = 7168;
    expect_refused(j.dump(), "block_ff_dim");
    // num_dense_layers in another family's config: refused.
    expect_refused(R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "num_dense_layers": 1})",
                   "num_dense_layers");
}

// Ling-mini-2.0 (bailing_moe_v2), as vLLM's bailing_moe.py builds it (BailingMoeV2ForCausalLM):
// every layer BailingAttention (GQA, 4 KV heads of head_dim 128; q / k norms and partial RoPE cache
// nothing more); layer 0 below first_k_dense_replace BailingMLP(intermediate_size), the others
// BailingMoE: a gate of hidden x num_experts, num_experts experts of moe_intermediate_size, top
// num_experts_per_tok, and one shared BailingMLP of num_shared_experts x
// moe_shared_expert_intermediate_size.
TEST(RealShapes, LingMini2AsVllmBuildsIt) {
    const std::string text = read_file(config_path("ling-mini-2.0"));
    const ModelSpec m = parse_hf_config(text, "ling.json");
    EXPECT_EQ(m.layer_mix(), "20 layers: 20 full");
    EXPECT_EQ(m.num_kv_heads, 4);
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_EQ(m.kv_bytes_per_token(), 20 * 2 * 4 * 128 * 2);  // 40,960
    EXPECT_EQ(m.moe.num_experts, 256);
    EXPECT_EQ(m.moe.experts_per_token, 8);
    EXPECT_EQ(m.moe.expert_intermediate, 512);
    EXPECT_EQ(m.moe.shared_experts, 1);
    EXPECT_EQ(m.moe.first_dense_layers, 1);
    EXPECT_EQ(m.intermediate, 5120);
    EXPECT_EQ(m.layer(0).mlp, MlpKind::kDense);
    EXPECT_EQ(m.layer(1).mlp, MlpKind::kMoe);
    EXPECT_EQ(m.num_moe_layers(), 19);
    EXPECT_EQ(m.mlp_projections, 3);  // gate_up_proj and down_proj
    EXPECT_FALSE(m.tie_embeddings);
    EXPECT_EQ(m.max_model_len, 32768);
    EXPECT_FALSE(m.mtp.enabled());
    // Parameters by hand (weights only; norms and the router's expert bias are below the
    // tolerance): embedding and LM head 157184 x 2048; 20 attention layers (Q, O 2048^2; K, V
    // 2048 x 512); one dense MLP 3 x 2048 x 5120; 19 MoE layers of 256 + 1 shared experts
    // 3 x 2048 x 512 and the gate 2048 x 256.
    const double h = 2048, vocab = 157184 * h;
    const double attention = 2 * h * h + 2 * h * 512, dense = 3 * h * 5120, expert = 3 * h * 512;
    const double router = h * 256;
    const double total = 2 * vocab + 20 * attention + dense + 19 * (257 * expert + router);
    EXPECT_NEAR(static_cast<double>(m.total_params()), total, 1e-4 * total);  // 16.26e9
    const double active = vocab + 20 * attention + dense + 19 * (9 * expert + router);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()), active, 1e-4 * active);
    // Published: 16.26B total, 1.43B active of which 789M non-embedding (both embedding tables
    // counted there; kvshard's active count takes the LM head's matmul only).
    EXPECT_NEAR(static_cast<double>(m.total_params()), 16.26e9, 0.005 * 16.26e9);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()) - vocab, 789e6, 0.005 * 789e6);
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);

    const nlohmann::json base = nlohmann::json::parse(text);
    auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
        nlohmann::json j = base;
        edit(j);
        return j.dump();
    };
    // vLLM neither builds nor drafts with Ling 2.0's MTP layers: none is recorded.
    EXPECT_FALSE(parse_hf_config(with([](auto& j) { j["num_nextn_predict_layers"] = 1; }), "l")
                     .mtp.enabled());
    // The shared expert's width: moe_shared_expert_intermediate_size when present, else the
    // routed width; a width that is not a multiple of it, or null, is refused.
    EXPECT_EQ(
        parse_hf_config(with([](auto& j) { j.erase("moe_shared_expert_intermediate_size"); }), "l"),
        m);
    EXPECT_EQ(
        parse_hf_config(with([](auto& j) { j["moe_shared_expert_intermediate_size"] = 1024; }), "l")
            .moe.shared_experts,
        2);
    EXPECT_EQ(
        parse_hf_config(with([](auto& j) { j["num_shared_experts"] = 2; }), "l").moe.shared_experts,
        2);
    EXPECT_EQ(
        parse_hf_config(with([](auto& j) { j["num_shared_experts"] = 0; }), "l").moe.shared_experts,
        0);
    expect_refused(with([](auto& j) { j["moe_shared_expert_intermediate_size"] = 768; }),
                   "moe_shared_expert_intermediate_size");
    expect_refused(with([](auto& j) { j["moe_shared_expert_intermediate_size"] = nullptr; }),
                   "moe_shared_expert_intermediate_size");
    // first_k_dense_replace past the last layer: every layer BailingMLP.
    const ModelSpec all_dense =
        parse_hf_config(with([](auto& j) { j["first_k_dense_replace"] = 20; }), "l");
    EXPECT_FALSE(all_dense.moe.enabled());
    EXPECT_EQ(all_dense.num_moe_layers(), 0);
    EXPECT_EQ(all_dense.kv_bytes_per_token(), m.kv_bytes_per_token());
    // Ling 2.0's remote config class was not read: the fields vLLM takes from it are required.
    for (const char* key : {"first_k_dense_replace", "num_shared_experts", "head_dim",
                            "num_key_value_heads", "num_experts", "moe_intermediate_size"})
        expect_refused(with([&](auto& j) { j.erase(key); }), key);
    // Ling 1.x (bailing_moe): BailingMoeConfig's defaults, first_k_dense_replace and
    // num_shared_experts 0, head_dim hidden / heads (128 here too).
    const ModelSpec v1 = parse_hf_config(with([](auto& j) {
                                             j["model_type"] = "bailing_moe";
                                             j.erase("first_k_dense_replace");
                                             j.erase("num_shared_experts");
                                             j.erase("head_dim");
                                         }),
                                         "l");
    EXPECT_EQ(v1.moe.first_dense_layers, 0);
    EXPECT_EQ(v1.moe.shared_experts, 0);
    EXPECT_EQ(v1.num_moe_layers(), 20);
    EXPECT_EQ(v1.kv_bytes_per_token(), m.kv_bytes_per_token());
    EXPECT_EQ(v1.max_model_len, 32768);
    // Windows: vLLM's BailingAttention has none of its own; a model-level window is off only
    // where the config object holds use_sliding_window false (Ling 1.x's class default).
    expect_refused(with([](auto& j) { j["sliding_window"] = 4096; }), "sliding_window");
    EXPECT_EQ(parse_hf_config(with([](auto& j) {
                                  j["sliding_window"] = 4096;
                                  j["use_sliding_window"] = false;
                              }),
                              "l")
                  .kv_bytes_per_token(),
              m.kv_bytes_per_token());
    EXPECT_EQ(parse_hf_config(with([](auto& j) {
                                  j["model_type"] = "bailing_moe";
                                  j["sliding_window"] = 4096;
                              }),
                              "l")
                  .layer_mix(),
              "20 layers: 20 full");
    expect_refused(with([](auto& j) {
                       j["model_type"] = "bailing_moe";
                       j["sliding_window"] = 4096;
                       j["use_sliding_window"] = true;
                   }),
                   "sliding_window");
    // use_sliding_window true with no sliding_window key: the config class's default window.
    // Ling 1.x's BailingMoeConfig (vLLM transformers_utils/configs/bailing_moe.py) defaults it
    // to 4096, which ModelConfig.get_hf_config_sliding_window hands every layer; Ling 2.0's
    // remote BailingMoeV2Config was not read. Both refused, each naming what it knows.
    expect_refused(with([](auto& j) {
                       j["model_type"] = "bailing_moe";
                       j["use_sliding_window"] = true;
                   }),
                   "BailingMoeConfig (vLLM's transformers_utils/configs/bailing_moe.py) defaults "
                   "it to 4096");
    expect_refused(with([](auto& j) { j["use_sliding_window"] = true; }),
                   "BailingMoeV2Config (the checkpoint's remote code) is unknown");
    // sliding_window null: vLLM slides no layer, and use_sliding_window true says otherwise.
    expect_refused(with([](auto& j) {
                       j["model_type"] = "bailing_moe";
                       j["use_sliding_window"] = true;
                       j["sliding_window"] = nullptr;
                   }),
                   "use_sliding_window' is true, but no layer slides");
    // layer_types is not read by vLLM here: all full accepted, a sliding entry refused.
    EXPECT_EQ(parse_hf_config(with([](auto& j) {
                                  j["layer_types"] = std::vector<std::string>(20, "full_attention");
                              }),
                              "l"),
              m);
    expect_refused(with([](auto& j) {
                       std::vector<std::string> t(20, "full_attention");
                       t[3] = "sliding_attention";
                       j["layer_types"] = t;
                   }),
                   "layer_types");
}

// Ling-flash-2.0: Ling-mini-2.0's architecture at hidden 4096 with one MTP layer in its checkpoint
// (num_nextn_predict_layers 1), which vLLM neither builds nor drafts with (bailing_moe.py builds
// num_hidden_layers layers; SpeculativeConfig.hf_config_override has no bailing_moe mapping).
TEST(RealShapes, LingFlash2CarriesAnMtpLayerVllmDoesNotServe) {
    const ModelSpec m = load_hf_config(config_path("ling-flash-2.0"));
    EXPECT_EQ(m.kv_bytes_per_token(), 32 * 2 * 4 * 128 * 2);  // 65,536
    EXPECT_FALSE(m.mtp.enabled());
    EXPECT_EQ(m.moe.shared_experts, 1);  // moe_shared_expert_intermediate_size 1024
    EXPECT_EQ(m.num_moe_layers(), 31);
    // Parameters by hand: embedding and LM head 157184 x 4096; 32 attention layers (Q, O 4096^2;
    // K, V 4096 x 512); one dense MLP 3 x 4096 x 9216; 31 MoE layers of 256 + 1 experts
    // 3 x 4096 x 1024 and the gate 4096 x 256.
    const double h = 4096, vocab = 157184 * h, attention = 2 * h * h + 2 * h * 512;
    const double dense = 3 * h * 9216, expert = 3 * h * 1024, router = h * 256;
    const double total = 2 * vocab + 32 * attention + dense + 31 * (257 * expert + router);
    EXPECT_NEAR(static_cast<double>(m.total_params()), total, 1e-4 * total);  // 102.9e9
    const double active = vocab + 32 * attention + dense + 31 * (9 * expert + router);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()), active, 1e-4 * active);
    // Published: 103B total, 6.1B active (both embedding tables counted there).
    EXPECT_NEAR(static_cast<double>(m.total_params()), 103e9, 0.005 * 103e9);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()) + vocab, 6.1e9, 0.02 * 6.1e9);
}

// dots.llm1 (dots1), as vLLM's dots1.py builds it: every layer Dots1Attention (32 KV heads of
// head_dim 128, q / k norms); Dots1MoE where n_routed_experts is set, layer >=
// first_k_dense_replace and layer % moe_layer_freq == 0 (128 experts of 1408, top 6, 2 shared of
// 1408, a gate of hidden x 128), else Dots1MLP(intermediate_size).
TEST(RealShapes, Dots1AsVllmBuildsIt) {
    const std::string text = read_file(config_path("dots.llm1.inst"));
    const ModelSpec m = parse_hf_config(text, "dots.json");
    EXPECT_EQ(m.layer_mix(), "62 layers: 62 full");
    EXPECT_EQ(m.attention, AttentionKind::kMha);
    EXPECT_EQ(m.head_dim, 128);  // Dots1Config has no head_dim: hidden / heads
    EXPECT_EQ(m.kv_bytes_per_token(), 62 * 2 * 32 * 128 * 2);  // 1,015,808
    EXPECT_EQ(m.moe.num_experts, 128);
    EXPECT_EQ(m.moe.experts_per_token, 6);
    EXPECT_EQ(m.moe.expert_intermediate, 1408);
    EXPECT_EQ(m.moe.shared_experts, 2);
    EXPECT_EQ(m.moe.first_dense_layers, 1);
    EXPECT_EQ(m.intermediate, 10944);
    EXPECT_EQ(m.num_moe_layers(), 61);
    EXPECT_EQ(m.max_model_len, 32768);
    // Parameters by hand (norms below the tolerance): embedding and LM head 152064 x 4096; 62
    // attention layers 4 x 4096^2; one dense MLP 3 x 4096 x 10944; 61 MoE layers of 128 + 2
    // experts 3 x 4096 x 1408 and the gate 4096 x 128.
    const double h = 4096, vocab = 152064 * h, attention = 4 * h * h;
    const double dense = 3 * h * 10944, expert = 3 * h * 1408, router = h * 128;
    const double total = 2 * vocab + 62 * attention + dense + 61 * (130 * expert + router);
    EXPECT_NEAR(static_cast<double>(m.total_params()), total, 1e-4 * total);
    const double active = vocab + 62 * attention + dense + 61 * (8 * expert + router);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()), active, 1e-4 * active);
    // Published: 142B total, 14B active (both embedding tables counted there; kvshard's active
    // count takes the LM head's matmul only).
    EXPECT_NEAR(static_cast<double>(m.total_params()), 142e9, 0.01 * 142e9);
    EXPECT_NEAR(static_cast<double>(m.active_params_per_token()) + vocab, 14e9, 0.01 * 14e9);
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);

    const nlohmann::json base = nlohmann::json::parse(text);
    auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
        nlohmann::json j = base;
        edit(j);
        return j.dump();
    };
    // moe_layer_freq 2: MoE on the even layers from 2 on (30 of them), Dots1MLP elsewhere.
    const ModelSpec every2 = parse_hf_config(with([](auto& j) { j["moe_layer_freq"] = 2; }), "d");
    EXPECT_EQ(every2.num_moe_layers(), 30);
    EXPECT_EQ(every2.layer(1).mlp, MlpKind::kDense);
    EXPECT_EQ(every2.layer(2).mlp, MlpKind::kMoe);
    EXPECT_EQ(every2.layer(3).mlp, MlpKind::kDense);
    EXPECT_EQ(every2.layer(3).intermediate, 10944);
    EXPECT_EQ(every2.total_params() - m.total_params(),
              every2.mlp_params_of_layer(3) * 31 - m.mlp_params_of_layer(3) * 31);
    // Dots1Config defines no moe_layer_freq, which vLLM reads: required with experts.
    expect_refused(with([](auto& j) { j.erase("moe_layer_freq"); }), "moe_layer_freq");
    // n_routed_experts null: a dense model (Dots1Config's default), every layer Dots1MLP.
    const ModelSpec all_dense =
        parse_hf_config(with([](auto& j) { j["n_routed_experts"] = nullptr; }), "d");
    EXPECT_FALSE(all_dense.moe.enabled());
    EXPECT_EQ(all_dense.kv_bytes_per_token(), m.kv_bytes_per_token());
    const double all_dense_total = 2 * vocab + 62 * (attention + dense);
    EXPECT_NEAR(static_cast<double>(all_dense.total_params()), all_dense_total,
                1e-4 * all_dense_total);
    expect_refused(with([](auto& j) { j.erase("num_experts_per_tok"); }), "num_experts_per_tok");
    // Windows: Dots1Attention has none; Dots1Config's default sliding_window 4096 would reach
    // every layer as vLLM's model-level window unless use_sliding_window is false: refused.
    expect_refused(with([](auto& j) {
                       j.erase("use_sliding_window");
                       j["sliding_window"] = 4096;
                   }),
                   "sliding_window");
    expect_refused(with([](auto& j) {
                       j.erase("sliding_window");
                       j.erase("use_sliding_window");
                   }),
                   "sliding_window");
    EXPECT_EQ(parse_hf_config(with([](auto& j) { j["sliding_window"] = 4096; }), "d"), m);
    EXPECT_EQ(parse_hf_config(with([](auto& j) {
                                  j.erase("use_sliding_window");
                                  j["sliding_window"] = nullptr;
                              }),
                              "d"),
              m);
    // No MTP drafter for dots1 in vLLM: a num_nextn_predict_layers is not recorded.
    EXPECT_FALSE(parse_hf_config(with([](auto& j) { j["num_nextn_predict_layers"] = 1; }), "d")
                     .mtp.enabled());
}

// DeepSeek-V3 with moe_layer_freq above 1, as vLLM's DeepseekV2DecoderLayer builds it
// (deepseek_v2.py: DeepseekV2MoE where n_routed_experts is set, layer_idx >=
// first_k_dense_replace and layer_idx % moe_layer_freq == 0, else DeepseekV2MLP of
// intermediate_size), its MTP layer a DeepseekV2DecoderLayer at index num_hidden_layers + i
// (deepseek_mtp.py). The published V3 writes moe_layer_freq 1.
TEST(RealShapes, DeepSeekReadsMoeLayerFreq) {
    const nlohmann::json base = nlohmann::json::parse(read_file(config_path("deepseek-v3")));
    const ModelSpec v3 = parse_hf_config(base.dump(), "v3.json");
    EXPECT_EQ(v3.num_moe_layers(), 58);  // layers 3..60
    EXPECT_EQ(v3.mtp.layer.mlp, MlpKind::kMoe);
    nlohmann::json j = base;
    j["moe_layer_freq"] = 2;
    const ModelSpec every2 = parse_hf_config(j.dump(), "v3.json");
    // MoE on the even layers from 4 (layer 3 is past first_k_dense_replace 3 but odd): 4, 6,
    // ..., 60 = 29 layers; the other 32 hold the dense MLP of 18432.
    EXPECT_EQ(every2.num_moe_layers(), 29);
    EXPECT_FALSE(every2.is_moe_layer(3));
    EXPECT_TRUE(every2.is_moe_layer(4));
    EXPECT_FALSE(every2.is_moe_layer(59));
    EXPECT_EQ(every2.layer(5).intermediate, 18432);
    EXPECT_EQ(every2.total_params() - v3.total_params(),
              29 * (every2.mlp_params_of_layer(5) - v3.mlp_params_of_layer(5)));
    // The MTP layer sits at index 61, odd: vLLM builds it with the dense MLP.
    EXPECT_EQ(every2.mtp.layer.mlp, MlpKind::kDense);
    EXPECT_EQ(every2.mtp.layer.intermediate, 18432);
    EXPECT_EQ(every2.mtp.layer.kind, LayerKind::kMla);
    // Two MTP layers at 61 and 62 would differ (dense, MoE): one MtpSpec layer cannot hold both.
    j["num_nextn_predict_layers"] = 2;
    expect_refused(j.dump(), "MTP layers 61 and 62 would differ");
    // A frequency no layer index past first_k_dense_replace meets: a dense model.
    j["num_nextn_predict_layers"] = 1;
    j["moe_layer_freq"] = 100;
    const ModelSpec none = parse_hf_config(j.dump(), "v3.json");
    EXPECT_FALSE(none.moe.enabled());
    EXPECT_EQ(none.num_moe_layers(), 0);
    j["moe_layer_freq"] = 0;
    expect_refused(j.dump(), "moe_layer_freq");
}

// Apertus-8B (apertus), as vLLM's apertus.py builds it: LlamaAttention-shaped GQA with q / k
// norms (8 KV heads of hidden / heads = 128: ApertusConfig has no head_dim), the window per layer
// from layer_types when listed, and ApertusMLP: up_proj and down_proj around xIELU, no gate.
TEST(RealShapes, ApertusAsVllmBuildsIt) {
    const std::string text = read_file(config_path("apertus-8b-instruct-2509"));
    const ModelSpec m = parse_hf_config(text, "apertus.json");
    EXPECT_EQ(m.layer_mix(), "32 layers: 32 full");
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_EQ(m.kv_bytes_per_token(), 32 * 2 * 8 * 128 * 2);  // 131,072
    EXPECT_EQ(m.mlp_projections, 2);
    EXPECT_EQ(m.dense_mlp_params_per_layer(), int64_t{2} * 4096 * 21504);
    EXPECT_EQ(m.max_model_len, 65536);  // llama3 rope scaling: the length already counts it
    // Parameters by hand: embedding and LM head 131072 x 4096; 32 layers of attention (Q, O
    // 4096^2; K, V 4096 x 1024) and the two-matrix MLP. Published: 8B (8.05B by these shapes).
    const double h = 4096, vocab = 131072 * h;
    const double total = 2 * vocab + 32 * (2 * h * h + 2 * h * 1024 + 2 * h * 21504);
    EXPECT_NEAR(static_cast<double>(m.total_params()), total, 1e-4 * total);
    EXPECT_NEAR(static_cast<double>(m.total_params()), 8.05e9, 0.005 * 8.05e9);
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);

    nlohmann::json j = nlohmann::json::parse(text);
    // vLLM's ApertusMLP raises on any activation but xIELU.
    j["hidden_act"] = "silu";
    expect_refused(j.dump(), "hidden_act");
    // ApertusConfig's defaults where the config is silent: 32 heads, KV heads = heads, 65536
    // positions (its default llama3 rope scaling does not scale the length).
    j = nlohmann::json::parse(text);
    for (const char* k :
         {"num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rope_scaling"})
        j.erase(k);
    const ModelSpec d = parse_hf_config(j.dump(), "apertus.json");
    EXPECT_EQ(d.num_kv_heads, 32);
    EXPECT_EQ(d.max_model_len, 65536);
    EXPECT_EQ(d.max_model_len_from, "ApertusConfig's default max_position_embeddings 65536");
    // ApertusAttention takes config.sliding_window on the layers layer_types names sliding.
    j = nlohmann::json::parse(text);
    j["sliding_window"] = 4096;
    j["layer_types"] = std::vector<std::string>(32, "full_attention");
    for (int l = 0; l < 32; l += 2) j["layer_types"][l] = "sliding_attention";
    EXPECT_EQ(parse_hf_config(j.dump(), "apertus.json").layer_mix(),
              "32 layers: 16 sliding(4096) + 16 full");
}

// Arcee AFM (arcee): vLLM's arcee.py runs LlamaAttention and ArceeMLP, up_proj and down_proj
// around squared ReLU, no gate. No copy of AFM-4.5B's published config.json was found: this one
// uses ArceeConfig's field names with AFM-4.5B's geometry as its model card describes it (36
// layers, hidden 2560, 20 heads / 4 KV heads of 128, MLP 18432), so the test checks the reading,
// not the published figures.
TEST(RealShapes, ArceeReadsItsUngatedMlp) {
    const std::string afm = R"({"architectures": ["ArceeForCausalLM"], "model_type": "arcee",
        "hidden_act": "relu2", "hidden_size": 2560, "intermediate_size": 18432,
        "num_hidden_layers": 36, "num_attention_heads": 20, "num_key_value_heads": 4,
        "head_dim": 128, "max_position_embeddings": 65536, "vocab_size": 128004,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";
    const ModelSpec m = parse_hf_config(afm, "afm.json");
    EXPECT_EQ(m.mlp_projections, 2);
    EXPECT_EQ(m.kv_bytes_per_token(), 36 * 2 * 4 * 128 * 2);  // 73,728
    const double h = 2560, vocab = 128004 * h;
    const double total = 2 * vocab + 36 * (2 * h * 2560 + 2 * h * 512 + 2 * h * 18432);
    EXPECT_NEAR(static_cast<double>(m.total_params()), total, 1e-4 * total);  // 4.62e9
    // ArceeConfig's defaults: 32 heads, KV heads = heads, head_dim hidden / heads, 4096 positions.
    nlohmann::json j = nlohmann::json::parse(afm);
    for (const char* k :
         {"num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"})
        j.erase(k);
    const ModelSpec d = parse_hf_config(j.dump(), "afm.json");
    EXPECT_EQ(d.num_heads, 32);
    EXPECT_EQ(d.num_kv_heads, 32);
    EXPECT_EQ(d.head_dim, 80);
    EXPECT_EQ(d.max_model_len, 4096);
    // vLLM's ArceeMLP raises on any activation but relu2.
    j = nlohmann::json::parse(afm);
    j["hidden_act"] = "silu";
    expect_refused(j.dump(), "hidden_act");
}

// GLM-4.5V (glm4v_moe): vLLM's glm4_1v.py builds its language model as Glm4MoeForCausalLM from the
// text_config, so it reads as GLM-4.5-Air does (46 layers, 96 query heads, 8 KV heads of 128,
// layer 0 dense, 128 + 1 shared experts of 1408 top 8). Its MTP is not drafted by vLLM.
TEST(RealShapes, Glm45vIsGlm45AirUnderItsVisionWrapper) {
    const std::string text = read_file(config_path("glm-4.5v"));
    const ModelSpec m = parse_hf_config(text, "glm-4.5v.json");
    const ModelSpec air = load_hf_config(config_path("glm-4.5-air"));
    EXPECT_EQ(m.layer_mix(), "46 layers: 46 full");
    EXPECT_EQ(m.kv_bytes_per_token(), 46 * 2 * 8 * 128 * 2);  // 188,416
    EXPECT_EQ(m.kv_bytes_per_token(), air.kv_bytes_per_token());
    EXPECT_EQ(m.moe, air.moe);
    EXPECT_EQ(m.intermediate, 10944);
    EXPECT_EQ(m.total_params(), air.total_params());
    // The dump's weight table counts 107,710,933,120 parameters, of which the vision tower's
    // tensors listed there hold 858,681,856: the language model's 106,852,251,264, norms, q / k /
    // v biases and the routers' correction biases (1,046,144) included, as kvshard counts them.
    EXPECT_EQ(m.total_params(), int64_t{106852251264});
    EXPECT_EQ(m.max_model_len, 65536);
    EXPECT_FALSE(m.mtp.enabled());
    nlohmann::json j = nlohmann::json::parse(text);
    j["text_config"]["num_nextn_predict_layers"] = 1;
    EXPECT_FALSE(parse_hf_config(j.dump(), "glm-4.5v.json").mtp.enabled());
    // Glm4vMoeTextConfig's defaults were not read: the head fields are required.
    j = nlohmann::json::parse(text);
    j["text_config"].erase("head_dim");
    expect_refused(j.dump(), "head_dim");
}

// MiMo-7B (mimo): vLLM's mimo.py runs Qwen2's decoder (MiMoConfig is a Qwen2Config), and
// SpeculativeConfig.hf_config_override turns MiMoForCausalLM into mimo_mtp, whose
// MiMoMultiTokenPredictorLayer is a Qwen2DecoderLayer (full attention, the dense MLP) behind an
// input_proj nn.Linear(2 x hidden, hidden), held whole on every rank, and three RMSNorms.
TEST(RealShapes, MiMoReadsItsMtpLayerAsVllmDraftsWithIt) {
    const std::string text = read_file(config_path("mimo-7b-rl"));
    const ModelSpec m = parse_hf_config(text, "mimo.json");
    EXPECT_EQ(m.layer_mix(), "36 layers: 36 full");
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_EQ(m.kv_bytes_per_token(), 36 * 2 * 8 * 128 * 2);  // 147,456
    EXPECT_EQ(m.max_model_len, 32768);
    ASSERT_TRUE(m.mtp.enabled());
    EXPECT_EQ(m.mtp.layers, 1);
    EXPECT_EQ(m.mtp.layer.kind, LayerKind::kFullAttention);
    EXPECT_EQ(m.mtp.layer.num_kv_heads, 8);
    EXPECT_EQ(m.mtp.layer.head_dim, 128);
    EXPECT_EQ(m.mtp.layer.mlp, MlpKind::kDense);
    EXPECT_EQ(m.mtp.layer.intermediate, 11008);
    EXPECT_FALSE(m.mtp.proj_split_by_tp);
    // Drafting, vLLM's KV cache holds one more such layer.
    EXPECT_EQ(with_mtp_layers(m).kv_bytes_per_token(), 37 * 2 * 8 * 128 * 2);
    // Parameters by hand: embedding and LM head 151680 x 4096; 36 layers of attention (Q, O
    // 4096^2; K, V 4096 x 1024) and the gated MLP 3 x 4096 x 11008 (biases and norms below the
    // tolerance). The MTP layer adds one such layer and its 2 x 4096 x 4096 input_proj.
    const double h = 4096, vocab = 151680 * h, layer = 2 * h * h + 2 * h * 1024 + 3 * h * 11008;
    const double total = 2 * vocab + 36 * layer;
    EXPECT_NEAR(static_cast<double>(m.total_params()), total, 1e-4 * total);  // 7.62e9
    EXPECT_NEAR(static_cast<double>(with_mtp_layers(m).total_params()), total + layer,
                1e-4 * total);
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);
    // Qwen2's window gate: use_sliding_window false leaves every layer full.
    nlohmann::json j = nlohmann::json::parse(text);
    j["sliding_window"] = 32768;
    EXPECT_EQ(parse_hf_config(j.dump(), "mimo.json").layer_mix(), "36 layers: 36 full");
    // MiMoConfig's (Qwen2Config's) defaults: 32 KV heads, 32768 positions.
    j = nlohmann::json::parse(text);
    j.erase("num_key_value_heads");
    j.erase("max_position_embeddings");
    const ModelSpec d = parse_hf_config(j.dump(), "mimo.json");
    EXPECT_EQ(d.num_kv_heads, 32);
    EXPECT_EQ(d.max_model_len_from, "MiMoConfig's default max_position_embeddings 32768");
}

}  // namespace
}  // namespace kvshard
