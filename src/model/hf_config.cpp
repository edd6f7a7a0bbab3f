// Hugging Face config.json -> ModelSpec, per layer. Each family's fields and the rule that turns
// them into layer kinds are listed in docs/model.md; a field that may change the KV cache and that
// this reader does not model is refused by name, never ignored.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <regex>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "kvshard/common/checked.h"
#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "model/hf_quantization.h"

namespace kvshard {
namespace {

// Python's json writes NaN, Infinity and -Infinity, which are not JSON. Outside strings they are
// replaced by the string "<non-finite X>": a field the KV does not depend on is then ignored as
// before, and one that sizes the KV is refused by name, since it is present but not a number.
std::string replace_non_finite(std::string_view text) {
    std::string out;
    out.reserve(text.size());
    bool in_string = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            out += c;
            if (c == '\\' && i + 1 < text.size()) {
                out += text[++i];
            } else if (c == '"') {
                in_string = false;
            }
            continue;
        }
        if (c == '"') {
            in_string = true;
            out += c;
            continue;
        }
        bool replaced = false;
        for (std::string_view word : {"-Infinity", "Infinity", "NaN"}) {
            if (text.substr(i, word.size()) == word) {
                out += detail::concat("\"<non-finite ", word, ">\"");
                i += word.size() - 1;
                replaced = true;
                break;
            }
        }
        if (!replaced) out += c;
    }
    return out;
}

class HfFields {
  public:
    HfFields(const nlohmann::json& j, std::string file) : j_(j), file_(std::move(file)) {}

    const std::string& file() const { return file_; }
    const nlohmann::json& json() const { return j_; }
    bool has(const std::string& key) const { return j_.contains(key) && !j_.at(key).is_null(); }

    // The first of `keys` present, or "" when none is.
    std::string first_of(std::initializer_list<const char*> keys) const {
        for (const char* k : keys)
            if (has(k)) return k;
        return "";
    }
    int positive_int(const std::string& key) const {
        if (!has(key)) throw Error(detail::concat(file_, ": missing field '", key, "'"));
        return positive_int_value(key);
    }
    int positive_int_or(const std::string& key, int fallback) const {
        return has(key) ? positive_int_value(key) : fallback;
    }
    int int_or(const std::string& key, int fallback) const {
        if (!has(key)) return fallback;
        const auto& v = j_.at(key);
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kIntMax)
            throw Error(detail::concat(file_, ": field '", key,
                                       "' must be a non-negative integer below 2^31, got ",
                                       v.dump()));
        return v.get<int>();
    }
    double number_or(const std::string& key, double fallback) const {
        if (!has(key)) return fallback;
        const auto& v = j_.at(key);
        if (!v.is_number())
            throw Error(
                detail::concat(file_, ": field '", key, "' must be a number, got ", v.dump()));
        return v.get<double>();
    }
    bool bool_or(const std::string& key, bool fallback) const {
        if (!has(key)) return fallback;
        const auto& v = j_.at(key);
        if (!v.is_boolean())
            throw Error(
                detail::concat(file_, ": field '", key, "' must be true or false, got ", v.dump()));
        return v.get<bool>();
    }
    std::string string_or(const std::string& key, std::string fallback) const {
        if (!has(key)) return fallback;
        const auto& v = j_.at(key);
        if (!v.is_string())
            throw Error(
                detail::concat(file_, ": field '", key, "' must be a string, got ", v.dump()));
        return v.get<std::string>();
    }
    const nlohmann::json& array(const std::string& key) const {
        if (!has(key) || !j_.at(key).is_array())
            throw Error(detail::concat(file_, ": field '", key, "' must be a list"));
        return j_.at(key);
    }
    Error bad(const std::string& key, const std::string& what) const {
        return Error(detail::concat(file_, ": field '", key, "' ", what));
    }

  private:
    static constexpr int64_t kIntMax = (int64_t{1} << 31) - 1;
    int positive_int_value(const std::string& key) const {
        const auto& v = j_.at(key);
        if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > kIntMax)
            throw Error(detail::concat(file_, ": field '", key,
                                       "' must be a positive integer below 2^31, got ", v.dump()));
        return v.get<int>();
    }
    const nlohmann::json& j_;
    std::string file_;
};

// The architectures this reader knows (model_type). A config without model_type is read as a
// Llama-style decoder.
enum class Family {
    // llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, glm4 (GLM-4-0414: Llama field
    // names; its extra post-attention / post-MLP norms hold no KV), and no model_type
    kLlama,
    kQwen3Next,
    kGemma2,
    kGemma3,
    kGptOss,
    kLlama4,
    kDeepSeek,  // deepseek_v2, deepseek_v3, deepseek_v32, kimi_k2
    kChatGlm,   // chatglm (GLM-4-9B-chat, ChatGLM3: the ChatGLM field names)
    kFalcon,
    kNemotronH,
    kNemotronNas,    // Nemotron Super / Ultra (block_configs)
    kGemma4,         // gemma4(_text): per-layer head sizes, K = V weights on full layers
    kGraniteHybrid,  // granitemoehybrid (Granite 4.0-H: Mamba-2 + attention, MoE on every layer)
    kBamba,          // bamba (Bamba-9B: Mamba-2 + attention by attn_layer_indices, dense MLPs)
    kJamba,          // jamba (AI21 Jamba: Mamba-1 + attention by period / offset, MoE likewise)
    kOlmo,        // olmo2, olmo3 (Olmo 3: sliding layers by layer_types, else 3 sliding : 1 full)
    kCohere2,     // cohere2 (Command R7B / A: 3 sliding : 1 full, NoPE full layers)
    kExaone4,     // exaone4 (EXAONE 4.0: layer_types, else sliding_window_pattern)
    kSmolLM3,     // smollm3 (SmolLM3: NoPE layers by no_rope_layers; KV alike on every layer)
    kKimiLinear,  // kimi_linear (Kimi Linear: KDA layers by linear_attn_config, the others MLA)
    kLfm2,        // lfm2, lfm2_moe (LiquidAI LFM2: short-conv layers and GQA layers by
                  // layer_types; LFM2-MoE with experts after num_dense_layers)
    kFalconH1,    // falcon_h1 (Falcon-H1: attention and Mamba-2 side by side in every layer)
    kLongcat,     // longcat_flash (LongCat-Flash: two MLA attentions, two MLPs, one MoE a layer)
    kBailing,     // bailing_moe, bailing_moe_v2 (inclusionAI Ling / Ring: GQA on every layer, dense
                  // MLPs below first_k_dense_replace, then MoE with shared experts)
    kDots1,       // dots1 (rednote-hilab dots.llm1: GQA, DeepSeek's MoE field names)
};

Family family_of(const std::string& model_type, const std::string& file) {
    static const std::map<std::string, Family, std::less<>> kFamilies = {
        {"", Family::kLlama},
        {"llama", Family::kLlama},
        {"mistral", Family::kLlama},
        {"ministral3", Family::kLlama},  // Ministral 3 / Mistral Small 3.2+: mistral3's text_config
        {"phi3", Family::kLlama},        // Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini: Llama's fields
        {"mixtral", Family::kLlama},
        {"qwen2", Family::kLlama},
        {"qwen2_moe", Family::kLlama},
        // MiMo-7B (MiMoConfig, the checkpoint's configuration_mimo.py: a Qwen2Config plus
        // num_nextn_predict_layers): vLLM's mimo.py runs Qwen2's decoder and its MTP layers as
        // mimo_mtp.py's drafter (read below).
        {"mimo", Family::kLlama},
        {"qwen3", Family::kLlama},
        {"qwen3_moe", Family::kLlama},
        // Qwen3-VL: a vision wrapper around a Qwen3 (qwen3_vl_text) or Qwen3-MoE
        // (qwen3_vl_moe_text) decoder; its text_config is read as those are.
        {"qwen3_vl", Family::kLlama},
        {"qwen3_vl_text", Family::kLlama},
        {"qwen3_vl_moe", Family::kLlama},
        {"qwen3_vl_moe_text", Family::kLlama},
        {"qwen3_next", Family::kQwen3Next},
        // Qwen3.5 (a vision wrapper around a text_config): Qwen3-Next's hybrid of Gated DeltaNet
        // and gated full attention (vLLM's qwen3_5.py builds on qwen3_next.py).
        {"qwen3_5", Family::kQwen3Next},
        {"qwen3_5_text", Family::kQwen3Next},
        {"qwen3_5_moe", Family::kQwen3Next},
        {"qwen3_5_moe_text", Family::kQwen3Next},
        {"gemma2", Family::kGemma2},
        {"gemma3", Family::kGemma3},
        {"gemma3_text", Family::kGemma3},
        {"gemma4", Family::kGemma4},
        {"gemma4_text", Family::kGemma4},
        {"gpt_oss", Family::kGptOss},
        {"llama4", Family::kLlama4},
        {"llama4_text", Family::kLlama4},
        {"deepseek_v2", Family::kDeepSeek},
        {"deepseek_v3", Family::kDeepSeek},
        {"deepseek_v32", Family::kDeepSeek},
        {"kimi_k2", Family::kDeepSeek},
        {"glm_moe_dsa",
         Family::kDeepSeek},  // GLM-5: vLLM's GlmMoeDsaForCausalLM is DeepSeek-V3.2's
        {"chatglm", Family::kChatGlm},
        // Not ChatGLM: Glm4Config (transformers models/glm4) and vLLM's glm4.py read
        // num_key_value_heads and head_dim; multi_query_group_num does not exist there.
        {"glm4", Family::kLlama},
        // GLM-4.5 / 4.6 / 4.7 (Glm4MoeConfig): GQA attention with an explicit head_dim and
        // DeepSeek's MoE field names (n_routed_experts, n_shared_experts, first_k_dense_replace).
        {"glm4_moe", Family::kLlama},
        // GLM-4.5V / GLM-4.6V (Glm4vMoeConfig): vLLM's glm4_1v.py builds the language model of a
        // glm4v_moe wrapper as Glm4MoeForCausalLM from its text_config (glm4v_moe_text), read as
        // glm4_moe is; its MTP layers are not (below).
        {"glm4v_moe", Family::kLlama},
        {"glm4v_moe_text", Family::kLlama},
        // MiniMax-M2 / M2.1 / M2.5 (MiniMaxM2Config): GQA on every layer (attn_type_list all 1;
        // MiniMax-01's lightning-attention layers, 0, are refused), Mixtral's MoE field names.
        {"minimax_m2", Family::kLlama},
        {"falcon", Family::kFalcon},
        {"RefinedWeb", Family::kFalcon},
        {"RefinedWebModel", Family::kFalcon},
        {"nemotron_h", Family::kNemotronH},
        {"nemotron-nas", Family::kNemotronNas},
        {"granitemoehybrid", Family::kGraniteHybrid},
        {"bamba", Family::kBamba},
        {"jamba", Family::kJamba},
        {"olmo2", Family::kOlmo},
        {"olmo3", Family::kOlmo},
        {"cohere2", Family::kCohere2},
        {"exaone4", Family::kExaone4},
        {"smollm3", Family::kSmolLM3},
        {"kimi_linear", Family::kKimiLinear},
        {"lfm2", Family::kLfm2},
        // LFM2-MoE (LFM2-8B-A1B; vLLM's lfm2_moe.py): LFM2's layers, the MLP of the first
        // num_dense_layers dense, the others MoE (read below).
        {"lfm2_moe", Family::kLfm2},
        // Seed-OSS (SeedOssConfig): Llama's fields with a head_dim of its own; vLLM's seed_oss.py
        // builds every layer full attention of num_key_value_heads x config.head_dim.
        {"seed_oss", Family::kLlama},
        // ERNIE 4.5 dense (Ernie4_5Config): Llama's fields; vLLM's ernie45.py is LlamaForCausalLM.
        {"ernie4_5", Family::kLlama},
        // ERNIE 4.5 MoE (Ernie4_5_MoeConfig, vLLM's ernie45_moe.py): Llama's attention, experts on
        // the layers its moe_* fields name (read below).
        {"ernie4_5_moe", Family::kLlama},
        // Hunyuan (HunYuanDenseV1Config, HunYuanMoEV1Config): Llama's fields; vLLM's hunyuan_v1.py
        // builds both, with experts where num_experts is above 1 and cross-layer attention
        // (use_cla) checked below.
        {"hunyuan_v1_dense", Family::kLlama},
        {"hunyuan_v1_moe", Family::kLlama},
        // Granite 3.x (GraniteConfig, GraniteMoeConfig): Llama's fields plus embedding, residual,
        // attention and logit multipliers, which scale activations and cache nothing.
        {"granite", Family::kLlama},
        {"granitemoe", Family::kLlama},
        // Falcon-H1 (vLLM's falcon_h1.py): each FalconH1ParallelHybrid decoder layer runs an
        // attention branch and a Mamba-2 branch side by side, then one MLP: two cache layers per
        // decoder layer (read_falcon_h1).
        {"falcon_h1", Family::kFalconH1},
        // LongCat-Flash (vLLM's longcat_flash.py): each FlashDecoderLayer holds two MLA attentions
        // (self_attn.0 and .1, a KV cache each), two dense MLPs and one MoE: three cache layers
        // per decoder layer (read_longcat_flash).
        {"longcat_flash", Family::kLongcat},
        // Ling / Ring (inclusionAI): vLLM's bailing_moe.py builds BailingMoeForCausalLM (Ling 1.x,
        // model_type bailing_moe) and BailingMoeV2ForCausalLM (Ling 2.0: Ling-mini / flash / 1T,
        // Ring-*; the checkpoints' BailingMoeV2Config names bailing_moe_v2) with one decoder
        // layer; read below. Ling 2.5's hybrid (bailing_hybrid, BailingMoeV2_5ForCausalLM:
        // linear attention beside MLA) is another model file and is not read.
        {"bailing_moe", Family::kBailing},
        {"bailing_moe_v2", Family::kBailing},
        // dots.llm1 (Dots1Config, vLLM's dots1.py): GQA with q / k norms on every layer, experts
        // by DeepSeek's field names (read below).
        {"dots1", Family::kDots1},
        // Apertus (ApertusConfig, vLLM's apertus.py) and Arcee AFM (ArceeConfig, vLLM's arcee.py):
        // Llama's attention and fields; their MLPs are not gated (up and down only, xIELU and
        // squared ReLU), so mlp_projections is 2 (read below).
        {"apertus", Family::kLlama},
        {"arcee", Family::kLlama},
    };
    auto it = kFamilies.find(model_type);
    if (it != kFamilies.end()) return it->second;
    // Architectures whose cache kvshard's layer kinds cannot express: refused with the reason.
    static const std::map<std::string, const char*, std::less<>> kNotExpressible = {};
    if (auto why = kNotExpressible.find(model_type); why != kNotExpressible.end())
        throw Error(detail::concat(file, ": model_type '", model_type,
                                   "' is not supported: ", why->second));
    std::string known;
    for (const auto& [name, _] : kFamilies)
        if (!name.empty()) known += (known.empty() ? "" : ", ") + name;
    throw Error(detail::concat(file, ": unsupported architecture (model_type '", model_type,
                               "'): kvshard reads ", known,
                               "; an unknown architecture's KV cache cannot be sized safely"));
}

// What a config class makes of an absent num_attention_heads, num_key_value_heads or head_dim.
// vLLM sizes the KV from the transformers config object, so an absent field is the class's
// default, not one rule for every family. Defaults from transformers' configuration_<type>.py
// (main, commit 008e5743): LlamaConfig (kv None -> heads, head_dim None -> hidden / heads),
// MistralConfig and MixtralConfig (kv 8), Qwen2Config (kv 32), Qwen2MoeConfig (kv 16),
// Qwen3Config (kv 32, head_dim 128), Qwen3MoeConfig (kv 4; no head_dim default of its own),
// Glm4Config (kv 2, head_dim 128), Gemma2Config and Gemma3TextConfig (heads 8, kv 4, head_dim
// 256), GptOssConfig (kv 8, head_dim 64), Llama4TextConfig (kv 8, head_dim 128),
// Qwen3NextConfig (kv 2, head_dim 256). Where no default was confirmed the field is required.
struct ClassDefaults {
    static constexpr int kRequired = 0;
    static constexpr int kFromHeads = -1;  // kv: num_attention_heads; head_dim: hidden / heads
    const char* config_class = "";
    int num_heads = kRequired;
    int num_kv_heads = kFromHeads;
    int head_dim = kFromHeads;
    bool null_kv_is_heads = true;  // the class maps num_key_value_heads = None to the heads
};

ClassDefaults class_defaults(const std::string& model_type) {
    constexpr int R = ClassDefaults::kRequired, H = ClassDefaults::kFromHeads;
    static const std::map<std::string, ClassDefaults, std::less<>> kDefaults = {
        {"", {"LlamaConfig", R, H, H, true}},
        {"llama", {"LlamaConfig", R, H, H, true}},
        {"mistral", {"MistralConfig", R, 8, H, true}},
        {"ministral3", {"Ministral3Config", R, R, R, false}},  // defaults not confirmed: required
        {"phi3", {"Phi3Config", 32, H, H, true}},  // heads 32, KV None -> heads, hidden / heads
        {"mixtral", {"MixtralConfig", R, 8, H, true}},
        {"qwen2", {"Qwen2Config", R, 32, H, true}},
        {"qwen2_moe", {"Qwen2MoeConfig", R, 16, H, false}},
        {"mimo", {"MiMoConfig", R, 32, H, true}},  // Qwen2Config's
        {"qwen3", {"Qwen3Config", R, 32, 128, true}},
        {"qwen3_moe", {"Qwen3MoeConfig", R, 4, R, false}},
        {"glm4", {"Glm4Config", R, 2, 128, false}},
        {"glm4_moe", {"Glm4MoeConfig", R, R, R, false}},        // defaults not confirmed: required
        {"glm4v_moe", {"Glm4vMoeTextConfig", R, R, R, false}},  // not confirmed either
        {"glm4v_moe_text", {"Glm4vMoeTextConfig", R, R, R, false}},
        {"qwen3_vl", {"Qwen3VLTextConfig", R, R, R, false}},
        {"qwen3_vl_text", {"Qwen3VLTextConfig", R, R, R, false}},
        {"qwen3_vl_moe", {"Qwen3VLMoeTextConfig", R, R, R, false}},
        {"qwen3_vl_moe_text", {"Qwen3VLMoeTextConfig", R, R, R, false}},
        {"minimax_m2", {"MiniMaxM2Config", R, R, R, false}},
        {"gemma2", {"Gemma2Config", 8, 4, 256, false}},
        {"gemma3", {"Gemma3TextConfig", 8, 4, 256, false}},
        {"gemma3_text", {"Gemma3TextConfig", 8, 4, 256, false}},
        // Gemma4TextConfig: 8 heads, 4 KV heads (an int, not None-able), head_dim 256; the full
        // layers' global_head_dim (512) and num_global_key_value_heads are read below.
        {"gemma4", {"Gemma4TextConfig", 8, 4, 256, false}},
        {"gemma4_text", {"Gemma4TextConfig", 8, 4, 256, false}},
        {"gpt_oss", {"GptOssConfig", R, 8, 64, true}},
        {"llama4", {"Llama4TextConfig", R, 8, 128, true}},
        {"llama4_text", {"Llama4TextConfig", R, 8, 128, true}},
        {"qwen3_next", {"Qwen3NextConfig", R, 2, 256, false}},
        // Qwen3_5TextConfig (vLLM transformers_utils/configs/qwen3_5.py, commit c04143bb): heads
        // 16, kv 4, head_dim 256. Qwen3_5MoeTextConfig's defaults are not confirmed: required.
        {"qwen3_5", {"Qwen3_5TextConfig", 16, 4, 256, false}},
        {"qwen3_5_text", {"Qwen3_5TextConfig", 16, 4, 256, false}},
        {"qwen3_5_moe", {"Qwen3_5MoeTextConfig", R, R, R, false}},
        {"qwen3_5_moe_text", {"Qwen3_5MoeTextConfig", R, R, R, false}},
        {"nemotron_h", {"NemotronHConfig", R, R, R, false}},
        // GraniteMoeHybridConfig: 32 heads, KV None -> heads; vLLM's attention takes head_dim =
        // hidden / heads whatever the config says (granitemoehybrid.py), checked below.
        {"granitemoehybrid", {"GraniteMoeHybridConfig", 32, H, H, true}},
        // KimiLinearConfig (vLLM transformers_utils/configs/kimi_linear.py): 32 heads, KV None ->
        // heads; its attention layers are MLA, sized from kv_lora_rank and qk_rope_head_dim.
        {"kimi_linear", {"KimiLinearConfig", 32, H, H, true}},
        // Lfm2Config (transformers configuration_lfm2.py): 32 heads, 8 KV heads (an int); vLLM's
        // Lfm2Attention takes head_dim = hidden / heads, checked below.
        {"lfm2", {"Lfm2Config", 32, 8, H, false}},
        // Lfm2MoeConfig (vLLM transformers_utils/configs/lfm2_moe.py, transformers'
        // configuration_lfm2_moe.py): 32 heads, 8 KV heads; Lfm2MoeAttention takes hidden / heads.
        {"lfm2_moe", {"Lfm2MoeConfig", 32, 8, H, false}},
        {"chatglm", {"ChatGLMConfig", R, H, R, false}},  // KV heads from multi_query_group_num
        // Olmo2Config (transformers) and Olmo3Config (vLLM transformers_utils/configs/olmo3.py):
        // 32 heads, KV None -> heads; vLLM's Olmo2Attention (olmo2.py, which also runs Olmo 3)
        // takes head_dim = hidden / heads whatever the config says, checked below.
        {"olmo2", {"Olmo2Config", 32, H, H, true}},
        {"olmo3", {"Olmo3Config", 32, H, H, true}},
        // Cohere2Config: 64 heads, KV None -> heads, head_dim set to hidden / heads in
        // __post_init__ (vLLM's CohereAttention, commandr.py, computes the same).
        {"cohere2", {"Cohere2Config", 64, H, H, true}},
        // Exaone4Config: 32 heads, 32 KV heads (an int), no head_dim default; vLLM's
        // Exaone4Attention (exaone4.py) takes config.head_dim, else hidden / heads.
        {"exaone4", {"Exaone4Config", 32, 32, H, false}},
        // GraniteConfig / GraniteMoeConfig: 32 heads, KV None -> heads. vLLM's GraniteAttention
        // (granite.py) reads head_dim, else hidden / heads; GraniteMoeAttention (granitemoe.py)
        // is built from hidden_size and the head counts only: hidden / heads, checked below.
        {"granite", {"GraniteConfig", 32, H, H, true}},
        {"granitemoe", {"GraniteMoeConfig", 32, H, H, true}},
        // SmolLM3Config: 16 heads, 4 KV heads (None -> heads). vLLM runs SmolLM3 through its
        // Transformers backend (registry.py, _TRANSFORMERS_SUPPORTED_MODELS), i.e. transformers'
        // SmolLM3Attention: head_dim from the config, else hidden / heads.
        {"smollm3", {"SmolLM3Config", 16, 4, H, true}},
        // SeedOssConfig: 80 heads, 8 KV heads (None -> heads), head_dim 128 (None -> hidden /
        // heads, read below).
        {"seed_oss", {"SeedOssConfig", 80, 8, 128, true}},
        // Ernie4_5Config: 16 heads, 2 KV heads (None -> heads), head_dim 128 (None -> hidden /
        // heads); vLLM's LlamaAttention reads config.head_dim.
        {"ernie4_5", {"Ernie4_5Config", 16, 2, 128, true}},
        // Ernie4_5_MoeConfig: 20 heads, 4 KV heads (None stays None), no head_dim of its own:
        // vLLM's Ernie4_5_MoeAttention takes head_dim or hidden / heads.
        {"ernie4_5_moe", {"Ernie4_5_MoeConfig", 20, 4, H, false}},
        // HunYuanDenseV1Config: 32 heads, KV None -> heads, head_dim None; vLLM's HunYuanAttention
        // (hunyuan_v1.py) takes head_dim when set, else attention_head_dim, else hidden / heads.
        {"hunyuan_v1_dense", {"HunYuanDenseV1Config", 32, H, H, true}},
        // HunYuanMoEV1Config: 32 heads, KV None -> heads, head_dim None (the same attention).
        {"hunyuan_v1_moe", {"HunYuanMoEV1Config", 32, H, H, true}},
        // BambaConfig: 32 heads, 8 KV heads (None -> heads); vLLM's BambaAttentionDecoderLayer
        // takes head_dim = hidden / heads whatever the config says, checked below.
        {"bamba", {"BambaConfig", 32, 8, H, true}},
        // JambaConfig: 32 heads, 8 KV heads (None -> heads); vLLM's JambaAttentionDecoderLayer
        // takes head_dim = hidden / heads, checked below.
        {"jamba", {"JambaConfig", 32, 8, H, true}},
        // FalconH1Config (transformers configuration_falcon_h1.py): 32 heads, 8 KV heads (None ->
        // heads), no head_dim of its own; vLLM's FalconH1AttentionDecoderLayer takes
        // config.head_dim when set, else hidden / heads.
        {"falcon_h1", {"FalconH1Config", 32, 8, H, true}},
        // Ling 1.x's BailingMoeConfig (vLLM transformers_utils/configs/bailing_moe.py, adapted
        // from inclusionAI/Ling's configuration_bailing_moe.py, commit 42f5f31a): 16 heads, 0 KV
        // heads (no usable default: required), head_dim None -> hidden / heads, which vLLM's
        // BailingAttention also takes (config.head_dim or hidden // heads). The heads are
        // required too: which class a Ling 1.x checkpoint loads (vLLM's or its remote code) is
        // not confirmed. Ling 2.0's BailingMoeV2Config is the checkpoint's remote code, whose
        // defaults were not read: all three required.
        {"bailing_moe", {"BailingMoeConfig", R, R, H, false}},
        {"bailing_moe_v2", {"BailingMoeV2Config", R, R, R, false}},
        // Dots1Config (transformers configuration_dots1.py, commit 16a1bdc1): 32 heads, 32 KV
        // heads (None -> heads), no head_dim attribute: vLLM's Dots1Attention takes
        // getattr(config, "head_dim", hidden // heads).
        {"dots1", {"Dots1Config", 32, 32, H, true}},
        // ApertusConfig (configuration_apertus.py, commit ecbf7a09): 32 heads, KV None -> heads, no
        // head_dim attribute (vLLM's ApertusAttention: getattr(config, "head_dim", None), else
        // hidden // heads). ArceeConfig (configuration_arcee.py, commit e1b55167): 32 heads, KV
        // None -> heads, head_dim None -> hidden // heads (vLLM's arcee.py runs LlamaAttention).
        {"apertus", {"ApertusConfig", 32, H, H, true}},
        {"arcee", {"ArceeConfig", 32, H, H, true}},
    };
    auto it = kDefaults.find(model_type);
    // The rest: Falcon (head_dim is hidden / heads by definition, KV heads from its own fields),
    // DeepSeek / Kimi (MLA), Nemotron Super (a LlamaConfig, KV heads per block).
    return it != kDefaults.end() ? it->second : ClassDefaults{"LlamaConfig", R, H, H, true};
}

// Fields this reader turns into the ModelSpec, or knows do not change what the KV cache holds
// (they shape the attention math, the router, positions or training only). Any other field whose
// name speaks of attention, caches, windows, heads or recurrent state is refused.
const std::set<std::string, std::less<>>& understood_fields() {
    static const std::set<std::string, std::less<>> kFields = {
        // read into the spec
        "num_hidden_layers",
        "n_layer",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "n_head",
        "num_key_value_heads",
        "num_kv_heads",
        "n_head_kv",
        "head_dim",
        "attention_head_dim",
        "kv_channels",
        "multi_query",
        "multi_query_attention",
        "multi_query_group_num",
        "new_decoder_architecture",
        "sliding_window",
        "sliding_window_size",
        "sliding_window_pattern",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "attention_chunk_size",
        "no_rope_layers",
        "no_rope_layer_interval",
        "full_attention_interval",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_value_head_dim",
        "hybrid_override_pattern",
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "conv_kernel",
        "n_groups",
        "mamba_ssm_cache_dtype",
        "mamba_ssm_dtype",
        "mamba_n_heads",  // Granite 4.0-H's Mamba-2 fields
        "mamba_d_head",
        "mamba_d_state",
        "mamba_n_groups",
        "mamba_d_conv",
        "mamba_expand",
        "mamba_d_ssm",  // Falcon-H1: the Mamba-2 width, read below
        // Falcon-H1: checked below; they scale activations, or (rms_norm, norm_before_gate) pick
        // the gated norm's form, and cache nothing
        "mamba_rms_norm",
        "mamba_norm_before_gate",
        "mamba_use_mlp",
        "key_multiplier",
        "attention_in_multiplier",
        "attention_out_multiplier",
        "ssm_multipliers",
        "ssm_in_multiplier",
        "ssm_out_multiplier",
        "lm_head_multiplier",  // Falcon-H1: scales the logits
        // LongCat-Flash: scale the MLA norms' weights at load; checked below (must be MLA)
        "mla_scale_q_lora",
        "mla_scale_kv_lora",
        "attention_method",
        "qk_head_dim",  // LongcatFlashConfig: qk_nope_head_dim + qk_rope_head_dim, checked below
        "layers_block_type",   // GraniteMoeHybridConfig's alias of layer_types
        "attn_layer_indices",  // Bamba: its attention layers, read below
        "attn_rotary_emb",     // Bamba: the rotary dim (positions only)
        "attn_layer_period",   // Jamba: its attention layers, read below
        "attn_layer_offset",
        "mamba_dt_rank",           // Jamba: checked below
        "mamba_inner_layernorms",  // Jamba: dt / B / C norms (vLLM builds them always: counted)
        "linear_attn_config",      // Kimi Linear: its KDA layers and their shape, read below
        "conv_L_cache",            // LFM2's short conv: its width, and which layers are attention
        "conv_dim",
        "full_attn_idxs",
        "num_heads",  // LFM2's original key beside num_attention_heads, checked equal below
        "conv_bias",  // LFM2: checked below (biases are not counted)
        "conv_dim_out",
        "conv_use_xavier_init",  // initialization only
        "block_configs",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "index_head_dim",
        "index_n_heads",
        "index_topk",
        "global_head_dim",             // Gemma 4's full-attention layers, read below
        "num_global_key_value_heads",  // (with attention_k_eq_v)
        "attention_k_eq_v",
        "num_kv_shared_layers",  // Gemma 4 / 3n: refused when > 0
        "indexer_types",  // GLM-5.x: checked below (only "full", an indexer key on every layer)
        // do not change what is cached
        "attention_dropout",
        "attention_bias",
        "attention_out_bias",  // Seed-OSS: a bias on the output projection, after the cache
        "attn_output_gate",    // Qwen3.5: a sigmoid gate on the attention output
        "attn_type_list",      // MiniMax-M2: checked below (every layer full attention)
        "attn_logit_softcapping",
        "query_pre_attn_scalar",
        "use_qk_norm",
        "qk_layernorm",
        // Kimi K2.5 / GLM-5V wrappers: image and video items grouped as one "vision_chunk"
        // modality of the prompt (vLLM's chat_utils.py, use_unified_vision_chunk_modality); the
        // text_config's decoder caches as it does without it
        "use_unified_vision_chunk",
        "use_qkv_bias",  // Ling: a bias on the QKV projection, before the cache
        "norm_head",     // Ling 1.x: the LM head's rows normalized at load
        "attn_scale",
        "attn_temperature_tuning",
        "attention_softmax_in_fp32",
        "apply_query_key_layer_scaling",
        "add_qkv_bias",
        "use_cache",
        "cache_implementation",
        "head_dim_original",
        "mamba_hidden_act",
        "mamba_proj_bias",
        "mamba_chunk_size",
        "chunk_size",
        "use_conv_bias",
        "use_mamba_kernels",
        "mamba_conv_bias",
        "position_embedding_type",  // Granite 4.0-H: "nope" or "rope", positions only
        "residual_in_fp32",
        "rescale_prenorm_residual",
        "n_group",
        "topk_group",
        "num_expert_group",  // Kimi Linear's grouped top-k routing: which experts, not the KV
        "use_grouped_topk",
        "attention_multiplier",
        "partial_rotary_factor",
        "rotary_dim",
        "rope_scaling",
        "rope_theta",
        "rope_ratio",
        "original_rope",
        "num_nextn_predict_layers",
        "pretraining_tp",
        "decoder_sparse_step",
        "mlp_only_layers",
        "moe_layers",
        "interleave_moe_layer_step",
        "layer_norm_epsilon",
        "layernorm_epsilon",
        "time_step_limit",
        "time_step_min",
        "time_step_max",
        "time_step_floor",
        "expand",
        "alibi",
        "parallel_attn",
        "num_ln_in_parallel_attn",  // Falcon: its norms (ModelSpec::norms), read below
        "qkv_bias",                 // Qwen3-Next: q, k, v biases (ModelSpec::norms), read below
        "multi_query_group_num_original",
        // transformers 4.48-4.50 write these runtime hints into saved configs (Llama-4's
        // text_config): the attention kernel to use, not what it caches
        "_attn_implementation",
        "_attn_implementation_autoset",
        // Gemma 3: checked against the layers below; refused when true
        "_sliding_window_pattern",
        "use_bidirectional_attention",
    };
    return kFields;
}

bool speaks_of_kv(const std::string& key) {
    static const std::regex kKvWords(
        "attn|attention|kv|cache|window|head|sliding|chunk|sink|ssm|mamba|linear_|state|conv|"
        "layer_types|index_|lora|rope_layers|query|key|value|group",
        std::regex::icase);
    return std::regex_search(key, kKvWords);
}

void refuse_unknown_kv_fields(const HfFields& f, const std::string& model_type) {
    for (const auto& [key, value] : f.json().items()) {
        if (understood_fields().count(key) || !speaks_of_kv(key)) continue;
        throw Error(detail::concat(
            f.file(), ": field '", key, "' of model_type '",
            model_type.empty() ? "(none)" : model_type,
            "' may change what the KV cache holds, and kvshard does not model it: its KV figures "
            "would be wrong (remove the field if it does not apply, or report the architecture)"));
    }
}

// Nemotron Super / Ultra: a DeciLM block's FFN width from its ffn_mult (transformers'
// _ffn_mult_to_intermediate_size: 2/3 of ffn_mult * hidden, rounded up to a multiple of 256).
int ffn_mult_to_intermediate(double ffn_mult, int hidden) {
    const auto raw =
        static_cast<int64_t>(2.0 * ffn_mult * hidden / 3.0);  // < 2^46: ffn_mult <= 1e4
    return checked_narrow((raw + 255) / 256 * 256, "the FFN width from ffn_mult");
}

LayerKind layer_type_kind(const std::string& t, const std::string& file, int layer) {
    if (t == "full_attention") return LayerKind::kFullAttention;
    if (t == "sliding_attention") return LayerKind::kSlidingWindow;
    if (t == "chunked_attention") return LayerKind::kChunkedLocal;
    if (t == "linear_attention") return LayerKind::kGatedDeltaNet;
    throw Error(detail::concat(file, ": layer_types[", layer, "] is '", t,
                               "': expected full_attention, sliding_attention, chunked_attention "
                               "or linear_attention"));
}

// Which layers apply RoPE (1) and which are NoPE (0): no_rope_layers as listed (Llama 4 and
// SmolLM3 name it so, 1 meaning RoPE), else every no_rope_layer_interval-th layer (default 4) NoPE.
// empty_is_absent: an empty list is computed as if absent (Llama4TextConfig fills it in).
std::vector<int> rope_layer_list(const HfFields& f, int L, bool empty_is_absent) {
    std::vector<int> rope(L, 1);
    if (f.has("no_rope_layers") && !(empty_is_absent && f.array("no_rope_layers").empty())) {
        const auto& nr = f.array("no_rope_layers");
        if (static_cast<int>(nr.size()) != L)
            throw f.bad("no_rope_layers",
                        detail::concat("lists ", nr.size(), " layers but there are ", L));
        for (int l = 0; l < L; ++l) {
            if (!nr[l].is_number_integer() || (nr[l] != 0 && nr[l] != 1))
                throw f.bad("no_rope_layers", "must be a list of 0 and 1");
            rope[l] = nr[l].get<int>();
        }
    } else {
        const int interval = f.positive_int_or("no_rope_layer_interval", 4);
        for (int l = 0; l < L; ++l) rope[l] = (l + 1) % interval != 0 ? 1 : 0;
    }
    return rope;
}

// A per-layer list of layer type names (layer_types and its aliases): num_hidden_layers strings,
// each one of `allowed` when that is not empty.
std::vector<std::string> layer_type_list(const HfFields& f, const std::string& key, int layers,
                                         std::initializer_list<std::string_view> allowed = {}) {
    const auto& types = f.array(key);
    if (static_cast<int>(types.size()) != layers)
        throw f.bad(key, detail::concat("lists ", types.size(), " layers but num_hidden_layers is ",
                                        layers));
    std::vector<std::string> out;
    for (size_t l = 0; l < types.size(); ++l) {
        const std::string t = types[l].is_string() ? types[l].get<std::string>() : "";
        if (allowed.size() == 0 && !types[l].is_string())
            throw f.bad(key, "must be a list of strings");
        if (allowed.size() > 0 && std::find(allowed.begin(), allowed.end(), t) == allowed.end()) {
            std::string names;
            for (std::string_view a : allowed)
                names += detail::concat(names.empty() ? "" : " or ", "\"", a, "\"");
            throw f.bad(key, detail::concat("has ", types[l].dump(), " at layer ", l, ": expected ",
                                            names));
        }
        out.push_back(t);
    }
    return out;
}

// Fields only some families read: present in another family's config they would be ignored, so
// they are refused there.
void refuse_foreign_fields(const HfFields& f, Family fam, const std::string& model_type) {
    struct Owned {
        const char* key;
        std::vector<Family> readers;
    };
    static const std::vector<Owned> kOwned = {
        {"hybrid_override_pattern", {Family::kNemotronH}},
        {"mamba_num_heads", {Family::kNemotronH}},
        {"ssm_state_size", {Family::kNemotronH}},
        {"moe_latent_size", {Family::kNemotronH}},
        {"global_head_dim", {Family::kGemma4}},
        {"num_global_key_value_heads", {Family::kGemma4}},
        {"attention_k_eq_v", {Family::kGemma4}},
        {"num_kv_shared_layers", {Family::kGemma4}},
        {"hidden_size_per_layer_input", {Family::kGemma4}},
        {"enable_moe_block", {Family::kGemma4}},
        {"mamba_n_heads", {Family::kGraniteHybrid, Family::kBamba, Family::kFalconH1}},
        {"mamba_d_head", {Family::kGraniteHybrid, Family::kBamba, Family::kFalconH1}},
        {"mamba_d_state",
         {Family::kGraniteHybrid, Family::kBamba, Family::kJamba, Family::kFalconH1}},
        {"mamba_n_groups", {Family::kGraniteHybrid, Family::kBamba, Family::kFalconH1}},
        {"mamba_d_conv",
         {Family::kGraniteHybrid, Family::kBamba, Family::kJamba, Family::kFalconH1}},
        {"mamba_expand",
         {Family::kGraniteHybrid, Family::kBamba, Family::kJamba, Family::kFalconH1}},
        {"layers_block_type", {Family::kGraniteHybrid}},
        {"qk_head_dim", {Family::kLongcat}},
        {"mamba_d_ssm", {Family::kFalconH1}},
        {"mamba_rms_norm", {Family::kFalconH1}},
        {"mamba_norm_before_gate", {Family::kFalconH1}},
        {"mamba_use_mlp", {Family::kFalconH1}},
        {"attn_layer_indices", {Family::kBamba, Family::kFalconH1}},  // Falcon-H1: null only
        {"attn_layer_period", {Family::kJamba}},
        {"attn_layer_offset", {Family::kJamba}},
        {"expert_layer_period", {Family::kJamba}},
        {"expert_layer_offset", {Family::kJamba}},
        {"mamba_dt_rank", {Family::kJamba}},
        {"block_configs", {Family::kNemotronNas}},
        {"linear_attn_config", {Family::kKimiLinear}},
        {"conv_L_cache", {Family::kLfm2}},
        {"conv_dim", {Family::kLfm2}},
        {"full_attn_idxs", {Family::kLfm2}},
        {"num_dense_layers", {Family::kLfm2}},
        {"num_heads", {Family::kLfm2}},
        {"linear_num_value_heads", {Family::kQwen3Next}},
        {"linear_num_key_heads", {Family::kQwen3Next}},
        {"full_attention_interval", {Family::kQwen3Next}},
        {"attention_chunk_size", {Family::kLlama4}},
        {"no_rope_layers", {Family::kLlama4, Family::kSmolLM3}},
        {"sliding_window_pattern", {Family::kGemma3, Family::kCohere2, Family::kExaone4}},
        {"order_of_interleaved_layers", {Family::kCohere2}},
        {"_sliding_window_pattern", {Family::kGemma3}},
        {"multi_query_group_num", {Family::kChatGlm}},
        {"new_decoder_architecture", {Family::kFalcon}},
        {"multi_query", {Family::kFalcon}},
    };
    for (const Owned& o : kOwned) {
        if (!f.has(o.key)) continue;
        if (std::find(o.readers.begin(), o.readers.end(), fam) != o.readers.end()) continue;
        throw f.bad(o.key, detail::concat("is set, but kvshard does not read it for model_type '",
                                          model_type.empty() ? "(none)" : model_type,
                                          "': its KV figures would ignore it"));
    }
    if (f.has("quantization_config") && f.json().at("quantization_config").is_object()) {
        const auto& q = f.json().at("quantization_config");
        for (const char* k : {"kv_cache_scheme", "kv_cache_quant_algo"})
            if (q.contains(k) && !q.at(k).is_null())
                throw Error(detail::concat(
                    f.file(), ": quantization_config.", k,
                    " quantizes the KV cache, which kvshard does not read from config.json: remove "
                    "it and give the KV element type with --kv-dtype"));
    }
}

// Nemotron-H's MTP step, as vLLM builds it (models/nemotron_h_mtp.py,
// NemotronHMultiTokenPredictor): one step only (it asserts num_nextn_predict_layers == 1), of the
// layers mtp_hybrid_override_pattern names: '*' a NemotronHAttentionDecoderLayer (KV like the
// model's attention layers), 'E' a NemotronHMoEDecoderLayer (no KV); any other character raises
// NotImplementedError. Some NemotronH config classes derive the pattern from
// mtp_layers_block_type ("attention" -> '*', "moe" -> 'E'). The step's first layer holds enorm,
// hnorm and eh_proj, a ColumnParallelLinear(2h, h) split by TP; its last final_layernorm.
// m.mtp.layer is already the model's last attention layer.
void read_nemotron_h_mtp(const HfFields& f, int steps, ModelSpec& m) {
    if (steps != 1)
        throw f.bad("num_nextn_predict_layers",
                    detail::concat("is ", steps,
                                   ", but vLLM's Nemotron-H drafter builds one MTP step "
                                   "(NemotronHMultiTokenPredictor asserts "
                                   "num_nextn_predict_layers == 1): set it to 1, or 0 for none"));
    std::string pattern;
    const char* key = "mtp_hybrid_override_pattern";
    if (f.has(key)) {
        pattern = f.string_or(key, "");
    } else if (f.has("mtp_layers_block_type")) {
        key = "mtp_layers_block_type";
        for (const auto& t : f.array(key)) {
            const std::string type = t.is_string() ? t.get<std::string>() : t.dump();
            if (type == "attention")
                pattern += '*';
            else if (type == "moe")
                pattern += 'E';
            else
                throw f.bad(key, detail::concat("names '", type,
                                                "': vLLM's Nemotron-H MTP step builds attention "
                                                "and moe layers only"));
        }
    } else {
        throw f.bad("num_nextn_predict_layers",
                    "is set, but the config names no mtp_hybrid_override_pattern (or "
                    "mtp_layers_block_type), the layers of vLLM's Nemotron-H MTP step");
    }
    if (pattern.empty() || pattern[0] != '*')
        throw f.bad(key, detail::concat("is '", pattern,
                                        "': kvshard models a Nemotron-H MTP step that starts "
                                        "with its attention layer (as \"*E\")"));
    LayerSpec moe;
    moe.kind = LayerKind::kNoKv;
    moe.mlp = MlpKind::kMoe;
    const LayerSpec attention = m.mtp.layer;
    m.mtp.following.clear();
    for (size_t i = 1; i < pattern.size(); ++i) {
        if (pattern[i] == '*') {
            m.mtp.following.push_back(attention);
        } else if (pattern[i] == 'E') {
            if (!m.moe.enabled())
                throw f.bad(key, "has an E (MoE) layer but the config names no experts");
            m.mtp.following.push_back(moe);
        } else {
            throw f.bad(key, detail::concat("has '", pattern[i], "' at ", i,
                                            ": vLLM's Nemotron-H MTP step builds * (attention) "
                                            "and E (MoE) layers only (NotImplementedError)"));
        }
    }
    m.mtp.proj_split_by_tp = true;  // eh_proj: ColumnParallelLinear
}

// moe_layer_freq as vLLM's DeepseekV2DecoderLayer reads it (deepseek_v2.py: MoE where
// n_routed_experts is set, layer_idx >= first_k_dense_replace and layer_idx % moe_layer_freq == 0,
// moe_layer_freq = getattr(config, "moe_layer_freq", 1)), as do Dots1DecoderLayer (dots1.py) and
// Kimi Linear's decoder layer: from m.moe.first_dense_layers on, the layers whose index is a
// multiple of `freq` hold the MoE, the others the dense MLP of m.intermediate. Afterwards
// first_dense_layers is the first MoE layer (a contiguous tail then reads as uniform); where no
// layer qualifies the model is dense, as vLLM builds it.
void apply_moe_layer_freq(int freq, ModelSpec& m, std::vector<LayerSpec>& layers) {
    int first_moe = -1;
    for (int l = 0; l < static_cast<int>(layers.size()); ++l) {
        const bool moe = l >= m.moe.first_dense_layers && l % freq == 0;
        layers[l].mlp = moe ? MlpKind::kMoe : MlpKind::kDense;
        layers[l].intermediate = moe ? 0 : m.intermediate;
        if (moe && first_moe < 0) first_moe = l;
    }
    if (first_moe < 0)
        m.moe = MoeSpec{};
    else
        m.moe.first_dense_layers = first_moe;
}

// Kimi Linear (vLLM's kimi_linear.py, KimiLinearConfig in transformers_utils/configs): layer l is
// Kimi Delta Attention when l + 1 is in linear_attn_config.kda_layers (1-based,
// KimiLinearConfig.is_kda_layer), else MLA (KimiMLAAttention, which asserts q_lora_rank None and
// mla_use_nope). MoE on layers from first_k_dense_replace that are multiples of moe_layer_freq.
// The KDA state is sized by the Gated DeltaNet formula (StateSpec::kda says why).
void read_kimi_linear(const HfFields& f, ModelSpec& m, std::vector<LayerSpec>& layers) {
    const int L = m.num_layers;
    if (f.has("q_lora_rank"))
        throw f.bad("q_lora_rank",
                    "is set, but vLLM's Kimi Linear MLA projects queries directly (it asserts "
                    "q_lora_rank is null)");
    if (m.is_mla() && !f.bool_or("mla_use_nope", false))
        throw f.bad("mla_use_nope",
                    "is not true, which vLLM's Kimi Linear MLA asserts (its MLA layers use no "
                    "RoPE): set it to true");
    if (f.int_or("num_nextn_predict_layers", 0) > 0)
        throw f.bad("num_nextn_predict_layers",
                    "is above 0, but vLLM's Kimi Linear skips MTP layers (no drafter is modelled "
                    "for it): set it to 0");
    // Kimi K3's fields (a latent MoE, gated MLA output, block residuals): not Kimi Linear's.
    for (const char* k3 : {"mla_use_output_gate", "routed_expert_hidden_size",
                           "latent_moe_use_norm", "attn_res_block_size"})
        if (f.has(k3) && !(f.json().at(k3).is_boolean() && !f.json().at(k3).get<bool>()))
            throw f.bad(k3,
                        "is set: kvshard reads Kimi Linear (KimiLinearForCausalLM), whose vLLM "
                        "model has no such part; it would be sized wrong");
    if (m.moe.enabled()) apply_moe_layer_freq(f.positive_int_or("moe_layer_freq", 1), m, layers);
    if (!f.has("linear_attn_config")) return;  // is_kda_layer false everywhere: all MLA
    const auto& lac = f.json().at("linear_attn_config");
    if (!lac.is_object()) throw f.bad("linear_attn_config", "must be an object");
    const HfFields c(lac, detail::concat(f.file(), ": linear_attn_config"));
    for (const auto& [key, value] : lac.items()) {
        static const std::set<std::string, std::less<>> kRead = {
            "kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"};
        if (!kRead.count(key) && !value.is_null())
            throw c.bad(key,
                        "is not read by vLLM's Kimi Linear KDA (kda_layers, full_attn_layers, "
                        "num_heads, head_dim, short_conv_kernel_size): kvshard would size a KDA "
                        "layer it does not model");
    }
    auto layer_list = [&](const char* key) {
        std::vector<int> out;
        for (const auto& v : c.array(key)) {
            if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > L)
                throw c.bad(key, detail::concat("has ", v.dump(),
                                                ": expected 1-based layer "
                                                "numbers in [1, ",
                                                L, "] (num_hidden_layers)"));
            out.push_back(v.get<int>());
        }
        return out;
    };
    const std::vector<int> kda = layer_list("kda_layers");
    const std::vector<int> full = layer_list("full_attn_layers");
    std::vector<int> listed(L + 1, 0);
    for (int n : kda) ++listed[n];
    for (int n : full) ++listed[n];
    for (int n = 1; n <= L; ++n)
        if (listed[n] != 1)
            throw c.bad("kda_layers",
                        detail::concat("and full_attn_layers must list each layer 1..", L,
                                       " exactly once between them; layer ", n, " is listed ",
                                       listed[n], " times"));
    if (!kda.empty() && !m.is_mla())
        throw f.bad("kv_lora_rank", "is missing: Kimi Linear's full-attention layers are MLA");
    for (int n : kda) layers[n - 1].kind = LayerKind::kGatedDeltaNet;
    if (kda.empty()) return;
    m.state.heads = m.state.groups = c.positive_int("num_heads");
    m.state.head_dim = m.state.group_dim = c.positive_int("head_dim");
    m.state.conv_kernel = c.positive_int("short_conv_kernel_size");
    m.state.kda = true;
    m.state.conv_dtype = m.kv_dtype;     // kda_state_dtype: mamba_cache_dtype (auto: model's)
    m.state.state_dtype = DType::kFp32;  // and the recurrent state always float32
}

// MoeSpec counts shared experts in routed experts' widths: a shared MLP of `width` is width /
// moe_intermediate_size of them (the same parameters and FLOPs, kept whole on every EP rank). A
// width that is not a multiple is refused on `key`; `how` says how the width came from it.
int shared_experts_in_routed_widths(const HfFields& f, const ModelSpec& m, int64_t width,
                                    const char* key, std::string_view how) {
    if (width % m.moe.expert_intermediate != 0)
        throw f.bad(
            key, detail::concat(how, "(", width, ") is not a multiple of moe_intermediate_size (",
                                m.moe.expert_intermediate,
                                "): kvshard counts shared experts in routed widths"));
    return checked_narrow(width / m.moe.expert_intermediate, "the shared experts");
}

// LFM2's dense MLP width as vLLM's Lfm2MLP takes it: block_ff_dim (transformers' Lfm2Config maps
// it to intermediate_size, default 12288); with block_auto_adjust_ff_dim (default true) 2/3 of
// it, times block_ffn_dim_multiplier when set, rounded up to block_multiple_of (256).
int lfm2_ff_width(const HfFields& f) {
    const std::string key = f.has("block_ff_dim") ? "block_ff_dim" : "intermediate_size";
    int64_t ff = f.positive_int_or(key, 12288);
    if (f.bool_or("block_auto_adjust_ff_dim", true)) {
        ff = 2 * ff / 3;
        if (f.has("block_ffn_dim_multiplier")) {
            const double mult = f.number_or("block_ffn_dim_multiplier", 1.0);
            if (!(mult > 0 && mult <= 1e4))
                throw f.bad("block_ffn_dim_multiplier",
                            detail::concat("must be a positive number up to 1e4, got ", mult));
            ff = static_cast<int64_t>(mult * static_cast<double>(ff));
        }
        const int64_t multiple = f.positive_int_or("block_multiple_of", 256);
        ff = (ff + multiple - 1) / multiple * multiple;
    }
    return checked_narrow(ff, "LFM2's MLP width");
}

// LFM2 (vLLM's lfm2.py): layer i is attention when config.layer_types[i] is "full_attention",
// else a ShortConv layer ("conv"). Lfm2Config fills layer_types from full_attn_idxs (0-based)
// when absent, and makes every layer attention when both are absent. A ShortConv keeps one conv
// state of (conv_L_cache - 1) x conv_dim / tp (MambaStateShapeCalculator.short_conv_state_shape)
// at the model dtype (short_conv_state_dtype): a kShortConv layer, StateSpec heads = conv_dim
// channels of head_dim 1, no groups.
void read_lfm2(const HfFields& f, ModelSpec& m, std::vector<LayerSpec>& layers) {
    const int L = m.num_layers;
    std::vector<bool> attention(L, true);
    if (f.has("layer_types")) {
        const auto types = layer_type_list(f, "layer_types", L, {"conv", "full_attention"});
        for (int l = 0; l < L; ++l) attention[l] = types[l] == "full_attention";
        if (f.has("full_attn_idxs")) {
            std::vector<bool> listed(L, false);
            for (const auto& v : f.array("full_attn_idxs"))
                if (v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < L)
                    listed[v.get<int>()] = true;
            if (listed != attention)
                throw f.bad("full_attn_idxs",
                            "disagrees with layer_types, which vLLM reads (Lfm2Config keeps "
                            "layer_types when both are set): remove one");
        }
    } else if (f.has("full_attn_idxs")) {
        attention.assign(L, false);
        for (const auto& v : f.array("full_attn_idxs")) {
            if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= L)
                throw f.bad(
                    "full_attn_idxs",
                    detail::concat("has ", v.dump(), ": expected layer indices in [0, ", L, ")"));
            attention[v.get<int>()] = true;
        }
    }
    if (f.has("num_heads") && f.positive_int("num_heads") != m.num_heads)
        throw f.bad("num_heads", detail::concat("is ", f.positive_int("num_heads"),
                                                " but num_attention_heads is ", m.num_heads,
                                                ": vLLM reads num_attention_heads"));
    if (f.bool_or("conv_bias", false))
        throw f.bad("conv_bias", "is true: kvshard counts LFM2's short conv without biases");
    for (const char* key : {"block_dim", "conv_dim", "conv_dim_out"})
        if (f.has(key) && f.positive_int(key) != m.hidden)
            throw f.bad(key, detail::concat("is ", f.positive_int(key), ", not hidden_size (",
                                            m.hidden, "): vLLM's LFM2 layers take hidden_size"));
    bool any_conv = false;
    for (int l = 0; l < L; ++l)
        if (!attention[l]) {
            layers[l].kind = LayerKind::kShortConv;
            any_conv = true;
        }
    if (!any_conv) return;
    m.state.heads = f.positive_int_or("conv_dim", m.hidden);
    m.state.head_dim = 1;
    m.state.groups = 0;
    m.state.group_dim = 0;
    m.state.conv_kernel = f.positive_int_or("conv_L_cache", 3);
    m.state.conv_dtype = m.state.state_dtype = m.kv_dtype;
}

// Falcon-H1, as vLLM's falcon_h1.py builds it: every FalconH1ParallelHybrid decoder layer runs a
// FalconH1AttentionDecoderLayer (qkv_proj and o_proj without biases, num_key_value_heads x
// head_dim, head_dim from the config else hidden / heads) and a FalconH1SSMDecoderLayer (a
// MambaMixer2 of d_ssm = mamba_d_ssm, else mamba_expand x hidden, in mamba_n_heads heads of
// mamba_d_head, mamba_n_groups groups of mamba_d_state, conv of mamba_d_conv) side by side, then
// one FalconH1MLP (gate_up and down of intermediate_size, silu). The decoder layer becomes two
// cache layers: the attention branch with the MLP, the Mamba-2 branch with none (vLLM's
// FalconH1ParallelHybrid gives that branch the prefix prefix.split(".")[0] + f".{num_hidden_layers
// + layer_idx}", i.e. model.{num_hidden_layers + i} beside the attention's model.layers.{i}: its
// mixer model.{num_hidden_layers + i}.mixer, a KV cache spec of its own). The multipliers
// (attention_in, key, ssm_in / ssm_out, mlp, lm_head, embedding) scale activations and cache
// nothing; the gated norm's weight (d_ssm) is counted even where mamba_rms_norm is false and vLLM's
// Mixer2RMSNormGated registers none (d_ssm per layer, well below 0.01% of the parameters).
void read_falcon_h1(const HfFields& f, ModelSpec& m, std::vector<LayerSpec>& layers) {
    const int L = m.num_layers;
    const std::string act = f.string_or("hidden_act", "silu");
    if (act != "silu")
        throw f.bad("hidden_act", detail::concat("is '", act,
                                                 "', but vLLM's FalconH1MLP runs silu only "
                                                 "(it raises on any other activation)"));
    // Biases vLLM's falcon_h1.py never builds: its loader would drop them ("Skip loading extra
    // bias"), so the checkpoint would not run as trained.
    for (const char* key : {"attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias"})
        if (f.bool_or(key, false))
            throw f.bad(key,
                        "is true, but vLLM's Falcon-H1 layers carry no such bias (its "
                        "loader skips the weights): kvshard sizes what vLLM builds, which "
                        "would not be this checkpoint");
    if (!f.bool_or("mamba_conv_bias", true))
        throw f.bad("mamba_conv_bias",
                    "is false: kvshard counts the Mamba-2 conv with its bias "
                    "(FalconH1Config's default)");
    if (!f.bool_or("mamba_use_mlp", true))
        throw f.bad("mamba_use_mlp",
                    "is false, but vLLM's FalconH1ParallelHybrid builds the MLP "
                    "on every layer whatever it says: the checkpoint would not "
                    "load as kvshard sizes it");
    if (f.json().contains("attn_layer_indices") && !f.json().at("attn_layer_indices").is_null())
        throw f.bad("attn_layer_indices",
                    "is set, but every Falcon-H1 layer runs attention and Mamba-2 side by side "
                    "(FalconH1Config.layers_block_type is all \"hybrid\"): it must be null");

    // MambaMixer2 of d_ssm (FalconH1Config: mamba_d_ssm 1024, else mamba_expand x hidden; heads
    // 128, mamba_d_head "auto" = d_ssm / heads, 1 group, d_state 256, d_conv 4).
    int64_t d_ssm = int64_t{f.positive_int_or("mamba_expand", 2)} * m.hidden;
    const char* d_ssm_key = "mamba_expand";
    if (f.json().contains("mamba_d_ssm") && !f.json().at("mamba_d_ssm").is_null()) {
        d_ssm = f.positive_int("mamba_d_ssm");
        d_ssm_key = "mamba_d_ssm";
    } else if (!f.json().contains("mamba_d_ssm")) {
        d_ssm = 1024;  // FalconH1Config's default; null means mamba_expand x hidden
        d_ssm_key = "mamba_d_ssm";
    }
    const int heads = f.positive_int_or("mamba_n_heads", 128);
    if (d_ssm % heads != 0)
        throw f.bad("mamba_n_heads", detail::concat("(", heads, ") must divide the Mamba-2 width (",
                                                    d_ssm, ", from ", d_ssm_key, ")"));
    int head = static_cast<int>(d_ssm / heads);
    if (f.has("mamba_d_head") &&
        !(f.json().at("mamba_d_head").is_string() && f.string_or("mamba_d_head", "") == "auto")) {
        head = f.positive_int("mamba_d_head");
        if (int64_t{head} * heads != d_ssm)
            throw f.bad("mamba_d_head",
                        detail::concat("x mamba_n_heads (", int64_t{head} * heads,
                                       ") must equal the Mamba-2 width (", d_ssm, ", from ",
                                       d_ssm_key, "), as FalconH1Config requires"));
    }
    m.state.heads = heads;
    m.state.head_dim = head;
    m.state.groups = f.positive_int_or("mamba_n_groups", 1);
    m.state.group_dim = f.positive_int_or("mamba_d_state", 256);
    m.state.conv_kernel = f.positive_int_or("mamba_d_conv", 4);
    if (m.state.heads % m.state.groups != 0)
        throw f.bad("mamba_n_groups",
                    detail::concat("(", m.state.groups, ") must divide mamba_n_heads (", heads,
                                   "): MambaMixer2 gives each group whole heads"));

    std::vector<LayerSpec> out;
    out.reserve(2 * static_cast<size_t>(L));
    for (int l = 0; l < L; ++l) {
        LayerSpec attention = layers[static_cast<size_t>(l)];  // full attention, dense MLP
        attention.kind = LayerKind::kFullAttention;
        LayerSpec mamba;
        mamba.kind = LayerKind::kMamba2;
        mamba.mlp = MlpKind::kNone;
        out.push_back(attention);
        out.push_back(mamba);
    }
    layers = std::move(out);
    m.num_layers = 2 * L;
    m.cache_layers_per_decoder_layer = 2;
}

// LongCat-Flash, as vLLM's longcat_flash.py builds it: every FlashDecoderLayer runs self_attn[0]
// (a DeepseekV2MLAAttention, prefix self_attn.0: an MLA cache of its own), the MoE (LongcatMoe,
// fed from the same point) beside mlps[0] (a FlashMLP of ffn_hidden_size), then self_attn[1]
// (self_attn.1, a second MLA cache) and mlps[1]. The decoder layer becomes three cache layers: MLA
// with mlps[0], MLA with mlps[1], and one that caches nothing with the MoE. Both attentions are MLA
// of the config's fields (attention_method "MLA"); the router, its correction bias and the norms
// are not counted (as for every family).
void read_longcat_flash(const HfFields& f, ModelSpec& m, std::vector<LayerSpec>& layers) {
    if (!m.is_mla())
        throw Error(detail::concat(f.file(),
                                   ": LongCat-Flash's attentions are MLA (DeepseekV2MLAAttention), "
                                   "but the config has no kv_lora_rank"));
    if (f.has("attention_method")) {
        std::string method = f.string_or("attention_method", "");
        std::transform(method.begin(), method.end(), method.begin(),
                       [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
        if (method != "MLA")
            throw f.bad("attention_method",
                        detail::concat("is '", f.string_or("attention_method", ""),
                                       "', but vLLM's FlashDecoderLayer builds MLA attention "
                                       "only"));
    }
    const std::string act = f.string_or("hidden_act", "silu");
    if (act != "silu")
        throw f.bad("hidden_act", detail::concat("is '", act,
                                                 "', but vLLM's FlashMLP runs silu only (it "
                                                 "raises on any other activation)"));
    if (f.has("qk_head_dim") &&
        f.positive_int("qk_head_dim") != m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim)
        throw f.bad(
            "qk_head_dim",
            detail::concat("is ", f.positive_int("qk_head_dim"),
                           ", but the attention's query/key heads are qk_nope_head_dim + "
                           "qk_rope_head_dim = ",
                           m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim,
                           " (what vLLM's DeepseekV2MLAAttention builds): fix or remove it"));
    const int L = m.num_layers;
    LayerSpec attention;
    attention.kind = LayerKind::kMla;
    attention.mlp = MlpKind::kDense;
    attention.intermediate = m.intermediate;
    LayerSpec moe;
    moe.kind = LayerKind::kNoKv;
    moe.mlp = MlpKind::kMoe;
    std::vector<LayerSpec> out;
    out.reserve(3 * static_cast<size_t>(L));
    for (int l = 0; l < L; ++l) {
        out.push_back(attention);
        out.push_back(attention);
        out.push_back(moe);
    }
    layers = std::move(out);
    m.num_layers = 3 * L;
    m.cache_layers_per_decoder_layer = 3;
}

// Ling (bailing_moe, bailing_moe_v2) and dots.llm1 (dots1) build every layer full attention:
// BailingAttention and Dots1Attention give vLLM's Attention no per-layer window, so a window could
// only come from the model level, cache_config.sliding_window =
// ModelConfig.get_hf_config_sliding_window() (vllm/config/model.py): config.sliding_window, or
// None where the config object has use_sliding_window false. The published configs switch it off;
// a window that would reach every layer is refused rather than sized, as is a layer_types naming a
// sliding layer (neither model file reads layer_types). dots.llm1's MoE layers follow
// moe_layer_freq here (MoeSpec holds the rest).
// use_sliding_window as the config object of Ling / dots.llm1 holds it: stated, else
// BailingMoeConfig's False (Ling 1.x, vLLM transformers_utils/configs/bailing_moe.py); Dots1Config
// defines no such attribute, and Ling 2.0's remote BailingMoeV2Config was not read (its published
// configs state neither key). True: vLLM's get_hf_config_sliding_window returns no window.
bool full_attention_only_window_off(const HfFields& f, const std::string& model_type) {
    return f.has("use_sliding_window") ? !f.bool_or("use_sliding_window", false)
                                       : model_type == "bailing_moe";
}

void read_full_attention_only(const HfFields& f, Family fam, const std::string& model_type,
                              ModelSpec& m, std::vector<LayerSpec>& layers) {
    const int L = m.num_layers;
    const bool window_off = full_attention_only_window_off(f, model_type);
    if (!window_off && f.has("sliding_window"))
        throw f.bad("sliding_window",
                    detail::concat("is ", f.json().at("sliding_window").dump(),
                                   " and use_sliding_window is not false: vLLM would apply it to "
                                   "every layer of model_type '",
                                   model_type,
                                   "' as the model-level window, which kvshard does not read for "
                                   "this model (the published configs set use_sliding_window "
                                   "false or sliding_window null)"));
    // An absent sliding_window is the config class's default, which vLLM would apply to every
    // layer (getattr(hf_text_config, "sliding_window", None)): Dots1Config's and Ling 1.x's
    // BailingMoeConfig's is 4096; Ling 2.0's class was not read, so there a stated
    // use_sliding_window true leaves the window unknown.
    if (!window_off && !f.json().contains("sliding_window")) {
        if (fam == Family::kDots1)
            throw Error(detail::concat(
                f.file(),
                ": missing field 'sliding_window': Dots1Config defaults it to 4096, which vLLM "
                "would apply to every layer as the model-level window; give it (null for none) "
                "or set use_sliding_window false"));
        if (model_type == "bailing_moe")
            throw Error(detail::concat(
                f.file(),
                ": missing field 'sliding_window' while use_sliding_window is true: "
                "BailingMoeConfig (vLLM's transformers_utils/configs/bailing_moe.py) defaults it "
                "to 4096, which vLLM would apply to every layer as the model-level window; give "
                "it (null for none) or set use_sliding_window false"));
        if (f.has("use_sliding_window"))
            throw Error(detail::concat(
                f.file(),
                ": missing field 'sliding_window' while use_sliding_window is true: the default "
                "of Ling 2.0's BailingMoeV2Config (the checkpoint's remote code) is unknown to "
                "kvshard, and vLLM would apply it to every layer as the model-level window; give "
                "it (null for none) or set use_sliding_window false"));
    }
    if (f.has("layer_types")) {
        const std::vector<std::string> types =
            layer_type_list(f, "layer_types", L, {"full_attention", "sliding_attention"});
        for (int l = 0; l < L; ++l)
            if (types[l] != "full_attention")
                throw f.bad(
                    "layer_types",
                    detail::concat("names ", types[l], " at layer ", l, ", but vLLM's ",
                                   fam == Family::kDots1 ? "Dots1Attention" : "BailingAttention",
                                   " builds every layer full attention (it does not read "
                                   "layer_types): remove the list or make it all "
                                   "\"full_attention\""));
    }
    if (fam == Family::kDots1 && m.moe.enabled())
        apply_moe_layer_freq(f.positive_int("moe_layer_freq"), m, layers);
}

// The length a config class gives where config.json states none. vLLM's _get_and_verify_max_len
// (vllm/config/model.py) reads each length key with getattr(hf_config, key, None), so a key the
// file leaves out is the class's default; only a class with no such attribute leaves vLLM at its
// fallback (2048, or an unchecked --max-model-len), which kvshard reports as no length (0).
// Each default read from the class's source: transformers src/transformers/models/<type>/
// configuration_<type>.py (main, commit 008e5743 unless named), vLLM's own classes in
// vllm/transformers_utils/configs/<file>.py (the model_type -> class mapping is vLLM's
// _CONFIG_REGISTRY, vllm/transformers_utils/config.py).
// Not confirmed, so left unknown: kimi_k2 (remote code), bailing_moe and bailing_moe_v2 (vLLM's
// BailingMoeConfig or the checkpoint's remote code, not settled), glm_moe_dsa (vLLM maps it to
// DeepseekV3Config in some versions and to transformers' GlmMoeDsaConfig in others), nemotron-nas
// (DeciLMConfig, remote code), a config without model_type. Known to have none:
// KimiLinearConfig (vLLM configs/kimi_linear.py) and RWConfig (RefinedWeb / RefinedWebModel, vLLM
// configs/falcon.py) define no length attribute.
struct ClassLength {
    const char* config_class;
    const char* key;  // the possible_keys entry the class defaults
    int64_t tokens;
};

const ClassLength* class_length(const std::string& model_type) {
    static const std::map<std::string, ClassLength, std::less<>> kLengths = {
        {"llama", {"LlamaConfig", "max_position_embeddings", 2048}},
        {"mistral", {"MistralConfig", "max_position_embeddings", 4096 * 32}},  // commit 001f85b3
        // Ministral3Config: 262144; without rope parameters its default yarn (16 x 16384,
        // class_rope below) gives the length.
        {"ministral3", {"Ministral3Config", "max_position_embeddings", 262144}},
        {"phi3", {"Phi3Config", "max_position_embeddings", 4096}},
        {"mixtral", {"MixtralConfig", "max_position_embeddings", 4096 * 32}},
        {"qwen2", {"Qwen2Config", "max_position_embeddings", 32768}},
        {"qwen2_moe", {"Qwen2MoeConfig", "max_position_embeddings", 32768}},
        {"mimo", {"MiMoConfig", "max_position_embeddings", 32768}},  // Qwen2Config's
        {"qwen3", {"Qwen3Config", "max_position_embeddings", 32768}},
        {"qwen3_moe", {"Qwen3MoeConfig", "max_position_embeddings", 32768}},
        {"qwen3_vl", {"Qwen3VLTextConfig", "max_position_embeddings", 128000}},  // 000c33fd
        {"qwen3_vl_text", {"Qwen3VLTextConfig", "max_position_embeddings", 128000}},
        {"qwen3_vl_moe", {"Qwen3VLMoeTextConfig", "max_position_embeddings", 128000}},
        {"qwen3_vl_moe_text", {"Qwen3VLMoeTextConfig", "max_position_embeddings", 128000}},
        {"qwen3_next", {"Qwen3NextConfig", "max_position_embeddings", 32768}},
        // vLLM configs/qwen3_5.py (commit c04143bb).
        {"qwen3_5", {"Qwen3_5TextConfig", "max_position_embeddings", 32768}},
        {"qwen3_5_text", {"Qwen3_5TextConfig", "max_position_embeddings", 32768}},
        // vLLM configs/qwen3_5_moe.py (commit 7f30d67b).
        {"qwen3_5_moe", {"Qwen3_5MoeTextConfig", "max_position_embeddings", 32768}},
        {"qwen3_5_moe_text", {"Qwen3_5MoeTextConfig", "max_position_embeddings", 32768}},
        {"gemma2", {"Gemma2Config", "max_position_embeddings", 8192}},
        {"gemma3", {"Gemma3TextConfig", "max_position_embeddings", 131072}},
        {"gemma3_text", {"Gemma3TextConfig", "max_position_embeddings", 131072}},
        {"gemma4", {"Gemma4TextConfig", "max_position_embeddings", 131072}},
        {"gemma4_text", {"Gemma4TextConfig", "max_position_embeddings", 131072}},
        // GptOssConfig (commit 02b8f42b): 131072; its default rope_parameters (yarn 32 x 4096) give
        // the same.
        {"gpt_oss", {"GptOssConfig", "max_position_embeddings", 131072}},
        {"llama4", {"Llama4TextConfig", "max_position_embeddings", 4096 * 32}},
        {"llama4_text", {"Llama4TextConfig", "max_position_embeddings", 4096 * 32}},
        {"deepseek_v2", {"DeepseekV2Config", "max_position_embeddings", 2048}},
        // transformers' DeepseekV3Config (commit 001f85b3) and vLLM's (configs/deepseek_v3.py,
        // which _CONFIG_REGISTRY gives deepseek_v32): 4096 both.
        {"deepseek_v3", {"DeepseekV3Config", "max_position_embeddings", 4096}},
        {"deepseek_v32", {"DeepseekV3Config", "max_position_embeddings", 4096}},
        // vLLM configs/chatglm.py: seq_length 2048, and max_position_embeddings = seq_length.
        {"chatglm", {"ChatGLMConfig", "seq_length", 2048}},
        {"glm4", {"Glm4Config", "max_position_embeddings", 131072}},
        {"glm4_moe", {"Glm4MoeConfig", "max_position_embeddings", 131072}},  // commit 008c726d
        {"minimax_m2", {"MiniMaxM2Config", "max_position_embeddings", 196608}},
        {"falcon", {"FalconConfig", "max_position_embeddings", 2048}},
        {"nemotron_h", {"NemotronHConfig", "max_position_embeddings", 4096}},  // commit 13923c63
        {"granitemoehybrid", {"GraniteMoeHybridConfig", "max_position_embeddings", 2048}},
        {"bamba", {"BambaConfig", "max_position_embeddings", 262144}},  // commit 001f85b3
        // Jamba-v0.1 writes its length as n_ctx, which vLLM does not read: the class's counts.
        {"jamba", {"JambaConfig", "max_position_embeddings", 262144}},
        {"olmo2", {"Olmo2Config", "max_position_embeddings", 2048}},
        {"olmo3", {"Olmo3Config", "max_position_embeddings", 2048}},  // vLLM configs/olmo3.py
        {"cohere2", {"Cohere2Config", "max_position_embeddings", 8192}},
        {"exaone4", {"Exaone4Config", "max_position_embeddings", 2048}},
        {"smollm3", {"SmolLM3Config", "max_position_embeddings", 32768}},
        {"lfm2", {"Lfm2Config", "max_position_embeddings", 128000}},         // commit 05cd1ec1
        {"lfm2_moe", {"Lfm2MoeConfig", "max_position_embeddings", 128000}},  // commit 2ab31a81
        {"seed_oss", {"SeedOssConfig", "max_position_embeddings", 524288}},
        {"ernie4_5", {"Ernie4_5Config", "max_position_embeddings", 131072}},
        {"ernie4_5_moe", {"Ernie4_5_MoeConfig", "max_position_embeddings", 131072}},  // 001f85b3
        {"hunyuan_v1_dense", {"HunYuanDenseV1Config", "max_position_embeddings", 2048}},
        {"hunyuan_v1_moe", {"HunYuanMoEV1Config", "max_position_embeddings", 2048}},  // 008cd60e
        {"granite", {"GraniteConfig", "max_position_embeddings", 2048}},
        {"granitemoe", {"GraniteMoeConfig", "max_position_embeddings", 2048}},  // 040e1a7e
        {"falcon_h1", {"FalconH1Config", "max_position_embeddings", 8192}},
        {"longcat_flash", {"LongcatFlashConfig", "max_position_embeddings", 131072}},
        {"dots1", {"Dots1Config", "max_position_embeddings", 2048}},       // commit 16a1bdc1
        {"apertus", {"ApertusConfig", "max_position_embeddings", 65536}},  // commit ecbf7a09
        {"arcee", {"ArceeConfig", "max_position_embeddings", 4096}},       // commit e1b55167
    };
    auto it = kLengths.find(model_type);
    return it != kLengths.end() ? &it->second : nullptr;
}

// Config classes that fill in a yarn RoPE scaling when config.json states none (neither
// rope_scaling nor rope_parameters). vLLM's _get_and_verify_max_len reads the class's
// hf_config.rope_parameters, so such a config serves original_max_position_embeddings x factor,
// whatever its max_position_embeddings says.
struct ClassRope {
    const char* config_class;
    int64_t original;  // original_max_position_embeddings
    double factor;
};

const ClassRope* class_rope(const std::string& model_type) {
    static const std::map<std::string, ClassRope, std::less<>> kRopes = {
        // transformers' configuration_gpt_oss.py, GptOssConfig.__post_init__.
        {"gpt_oss", {"GptOssConfig", 4096, 32.0}},
        // transformers' configuration_ministral3.py, Ministral3Config.__post_init__.
        {"ministral3", {"Ministral3Config", 16384, 16.0}},
    };
    auto it = kRopes.find(model_type);
    return it != kRopes.end() ? &it->second : nullptr;
}

}  // namespace

// The longest sequence vLLM serves, as vllm/config/model.py's _get_and_verify_max_len derives it
// from the (text) config: the smallest of its length fields (a field the file leaves out is the
// config class's default, class_length above), model_max_length winning when set, then scaled by
// the RoPE scaling factor except for the su, longrope and llama3 types (whose
// max_position_embeddings already counts it) and Gemma 3 (the same); yarn scales
// original_max_position_embeddings. A config with none of the fields and a class with none
// states no length (0).
void read_max_model_len(const HfFields& f, const std::string& model_type,
                        double tokenizer_max_length, ModelSpec& m) {
    // A length above 2^40 (transformers' "no limit" int(1e30)) bounds nothing kvshard checks.
    constexpr double kLongest = double(int64_t{1} << 40);
    auto length = [&](const std::string& key) {
        const auto& v = f.json().at(key);
        if (!v.is_number() || std::isnan(v.get<double>()) || v.get<double>() < 1)
            throw f.bad(key, detail::concat("must be a positive number of tokens, got ", v.dump()));
        return std::min(v.get<double>(), kLongest);
    };
    const ClassLength* class_default = class_length(model_type);
    double derived = 0;
    std::string from;
    for (const char* key :
         {"max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
          "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len"}) {
        double v = 0;
        std::string what;
        if (f.has(key)) {
            v = length(key);
            what = detail::concat(key, " ", static_cast<int64_t>(v));
        } else if (class_default && std::string_view(class_default->key) == key) {
            v = static_cast<double>(class_default->tokens);
            what = detail::concat(class_default->config_class, "'s default ", key, " ",
                                  class_default->tokens);
        } else {
            continue;
        }
        if (from.empty() || v < derived) {
            derived = v;
            from = what;
        }
    }
    if (f.has("model_max_length")) {  // Command-R / Cohere: it wins over the others
        derived = length("model_max_length");
        from = detail::concat("model_max_length ", static_cast<int64_t>(derived));
    }
    // Before the RoPE factor, as vLLM takes it; also where the config states no length.
    if (tokenizer_max_length > 0 && (from.empty() || tokenizer_max_length < derived)) {
        derived = std::min(tokenizer_max_length, kLongest);
        from = detail::concat("tokenizer_config.json's model_max_length ",
                              static_cast<int64_t>(derived));
    }
    const std::string rope_key = f.has("rope_parameters") ? "rope_parameters"
                                 : f.has("rope_scaling")  ? "rope_scaling"
                                                          : "";
    if (!rope_key.empty() && model_type.find("gemma3") == std::string::npos) {
        const auto& rope = f.json().at(rope_key);
        if (!rope.is_object()) throw f.bad(rope_key, "must be an object");
        // Transformers 5 may key the parameters by layer type.
        static const std::set<std::string, std::less<>> kLayerTypes = {"full_attention",
                                                                       "sliding_attention",
                                                                       "chunked_attention",
                                                                       "linear_attention",
                                                                       "mamba",
                                                                       "conv"};
        bool per_layer_type = !rope.empty();
        for (const auto& [key, _] : rope.items()) per_layer_type &= kLayerTypes.count(key) > 0;
        std::vector<const nlohmann::json*> params;
        if (per_layer_type)
            for (const auto& [_, v] : rope.items()) params.push_back(&v);
        else
            params.push_back(&rope);
        double factor = 1.0;
        std::string scaled;
        for (const nlohmann::json* rp : params) {
            if (!rp->is_object()) throw f.bad(rope_key, "must hold objects per layer type");
            std::string type = "default";
            for (const char* k : {"rope_type", "type"})
                if (rp->contains(k) && rp->at(k).is_string()) {
                    type = rp->at(k).get<std::string>();
                    break;
                }
            if (type == "su" || type == "longrope" || type == "llama3") continue;
            if (rp->contains("factor")) {
                const auto& v = rp->at("factor");
                if (!v.is_number() || !(v.get<double>() > 0) || v.get<double>() > 1e6)
                    throw f.bad(rope_key, detail::concat("has factor ", v.dump(),
                                                         ": expected a positive number"));
                factor = v.get<double>();
            }
            scaled = type;
            if (type == "yarn") {
                const nlohmann::json* orig = rp->contains("original_max_position_embeddings")
                                                 ? &rp->at("original_max_position_embeddings")
                                             : f.has("original_max_position_embeddings")
                                                 ? &f.json().at("original_max_position_embeddings")
                                                 : nullptr;
                if (orig) {
                    if (!orig->is_number() || !(orig->get<double>() >= 1))
                        throw f.bad(rope_key,
                                    detail::concat("has original_max_position_embeddings ",
                                                   orig->dump(), ": expected a positive number"));
                    derived = orig->get<double>();
                    from = detail::concat("original_max_position_embeddings ",
                                          static_cast<int64_t>(derived));
                }
            }
        }
        if (factor != 1.0 && !from.empty()) {
            derived *= factor;
            from = detail::concat(from, " x ", rope_key, " ", scaled, " factor ", factor);
        }
    }
    if (const ClassRope* cr = rope_key.empty() ? class_rope(model_type) : nullptr) {
        derived = static_cast<double>(cr->original) * cr->factor;
        from = detail::concat(cr->config_class,
                              "'s default rope_parameters: original_max_position_embeddings ",
                              cr->original, " x yarn factor ", cr->factor);
    }
    if (from.empty()) return;  // none stated, none defaulted (vLLM: 2048 or --max-model-len)
    m.max_model_len = static_cast<int64_t>(std::min(derived, kLongest));
    m.max_model_len_from = from;
}

// The norm weights and biases the checkpoint holds beside its matrices (ModelSpec::norms), as
// vLLM's model files build each family's layers; NormsAndBiases' defaults are Llama's
// (vLLM llama.py: LlamaDecoderLayer's input_layernorm and post_attention_layernorm, LlamaModel's
// norm; LlamaAttention's qkv_proj and o_proj bias = attention_bias, LlamaMLP's bias = mlp_bias).
void read_norms_and_biases(const HfFields& f, Family fam, const std::string& model_type,
                           ModelSpec& m) {
    NormsAndBiases& n = m.norms;
    const bool attention_bias = f.bool_or("attention_bias", false);
    const bool qwen3 = model_type.rfind("qwen3", 0) == 0;  // qwen3, qwen3_moe, qwen3_vl*, next, 3.5
    n.qkv_bias = attention_bias;
    n.o_bias = attention_bias;
    n.mlp_bias = f.bool_or("mlp_bias", false);
    // GLM-4.5V's language model is vLLM's Glm4MoeForCausalLM (glm4_1v.py), as GLM-4.5's.
    const bool glm4_moe = model_type == "glm4_moe" || model_type.rfind("glm4v_moe", 0) == 0;
    if (model_type == "qwen2" || model_type == "qwen2_moe" || model_type == "mimo") {
        // Qwen2Attention / Qwen2MoeAttention: QKVParallelLinear(bias=True), o_proj without
        // (MiMo: vLLM's MiMoModel is Qwen2Model's decoder).
        n.qkv_bias = true;
        n.o_bias = false;
    } else if (qwen3) {
        // Qwen3Attention: qkv_proj bias = attention_bias, o_proj none; q_norm / k_norm =
        // RMSNorm(head_dim) (qwen3.py, qwen3_moe.py, qwen3_next.py's Qwen3NextAttention).
        n.o_bias = false;
        n.qk = QkNorm::kPerHead;
    } else if (model_type == "seed_oss") {
        n.o_bias = f.bool_or("attention_out_bias", false);  // SeedOssAttention's o_proj
    } else if (glm4_moe || model_type == "glm4") {
        // Glm4MoeAttention / Glm4Attention: qkv_proj bias = attention_bias, o_proj none;
        // Glm4MoeAttention's q_norm / k_norm RMSNorm(head_dim) when use_qk_norm.
        n.o_bias = false;
        if (f.bool_or("use_qk_norm", false)) n.qk = QkNorm::kPerHead;
    } else if (model_type == "hunyuan_v1_dense" || model_type == "hunyuan_v1_moe") {
        // HunYuanAttention: query_layernorm / key_layernorm RMSNorm(head_dim) when use_qk_norm.
        if (f.bool_or("use_qk_norm", false)) n.qk = QkNorm::kPerHead;
    } else if (model_type == "minimax_m2") {
        // MiniMaxM2Attention: q_norm RMSNorm(heads x head_dim), k_norm RMSNorm(kv_heads x
        // head_dim) (qk_norm_type "per_layer"); MiniMaxM2MoE's e_score_correction_bias when
        // use_routing_bias.
        n.qk = QkNorm::kAllHeads;
        n.router_bias = f.bool_or("use_routing_bias", false);
    } else if (model_type == "chatglm") {
        // GLMAttention: query_key_value bias = add_bias_linear or add_qkv_bias, dense (o) bias =
        // add_bias_linear.
        const bool linear = f.bool_or("add_bias_linear", false);
        n.qkv_bias = linear || f.bool_or("add_qkv_bias", false);
        n.o_bias = linear;
    }
    switch (fam) {
        case Family::kGemma2:
        case Family::kGemma3:
        case Family::kGemma4:
            // Gemma2DecoderLayer / Gemma3DecoderLayer: input_layernorm, post_attention_layernorm,
            // pre_feedforward_layernorm, post_feedforward_layernorm; Gemma 3's q_norm / k_norm
            // RMSNorm(head_dim).
            n.per_part = 2;
            if (fam != Family::kGemma2) n.qk = QkNorm::kPerHead;
            break;
        case Family::kOlmo:
            // Olmo2DecoderLayer: post_attention_layernorm and post_feedforward_layernorm only;
            // Olmo2Attention's q_norm RMSNorm(hidden), k_norm RMSNorm(kv_heads x head_dim), its
            // qkv_proj and o_proj without biases whatever attention_bias says.
            n.qk = QkNorm::kAllHeads;
            n.qkv_bias = n.o_bias = false;
            break;
        case Family::kCohere2:
            // CohereDecoderLayer (commandr.py): one input_layernorm before the attention and the
            // MLP, which run in parallel; q_norm / k_norm LayerNorm((heads, head_dim)) when
            // use_qk_norm.
            n.parallel = true;
            if (f.bool_or("use_qk_norm", false)) n.qk = QkNorm::kAllHeads;
            break;
        case Family::kExaone4:
            // Exaone4DecoderLayer: post_attention_layernorm and post_feedforward_layernorm;
            // Exaone4Attention's q_norm / k_norm RMSNorm(head_dim).
            n.qk = QkNorm::kPerHead;
            break;
        case Family::kLfm2:
            // Lfm2Attention: q_layernorm / k_layernorm RMSNorm(head_dim).
            n.qk = QkNorm::kPerHead;
            break;
        case Family::kGptOss:
            // OAIAttention: qkv and o_proj with biases; MLPBlock: router nn.Linear with a bias,
            // experts with gate_up and down biases (gpt_oss.py).
            n.qkv_bias = n.o_bias = true;
            n.router_bias = true;
            n.mlp_bias = true;
            break;
        case Family::kFalcon: {
            // FalconDecoderLayer (falcon.py): LayerNorms with a bias; input_layernorm and
            // post_attention_layernorm when parallel_attn is false, else ln_attn and ln_mlp when
            // num_ln_in_parallel_attn is 2 (its default under new_decoder_architecture), else
            // input_layernorm alone (Falcon-7B); every Linear's bias = config.bias.
            n.norm_bias = true;
            const int parallel_norms = f.int_or(
                "num_ln_in_parallel_attn", f.bool_or("new_decoder_architecture", false) ? 2 : 1);
            n.parallel = f.bool_or("parallel_attn", true) && parallel_norms != 2;
            const bool bias = f.bool_or("bias", false);
            n.qkv_bias = n.o_bias = n.mlp_bias = bias;
            break;
        }
        case Family::kDeepSeek:
            // DeepseekV2MoE: the gate's e_score_correction_bias when topk_method is noaux_tc.
            n.router_bias = f.string_or("topk_method", "") == "noaux_tc";
            break;
        case Family::kDots1:
            // Dots1Attention (dots1.py): qkv_proj bias = attention_bias, o_proj none, q_norm /
            // k_norm RMSNorm(head_dim) always; Dots1MoE's gate e_score_correction_bias when
            // topk_method is noaux_tc.
            n.o_bias = false;
            n.qk = QkNorm::kPerHead;
            n.router_bias = f.string_or("topk_method", "") == "noaux_tc";
            break;
        case Family::kBailing:
            // BailingAttention (bailing_moe.py): query_key_value bias = use_bias or use_qkv_bias,
            // dense (o) bias = use_bias; query_layernorm / key_layernorm of head_dim when
            // use_qk_norm (RMSNorm under use_rmsnorm, else a LayerNorm whose bias of head_dim is
            // not counted); BailingMoE's gate expert_bias when moe_router_enable_expert_bias.
            // BailingMLP's biases under use_bias (dense and shared experts, not the routed ones)
            // are not counted: the published Ling configs set use_bias false.
            n.qkv_bias = f.bool_or("use_bias", false) || f.bool_or("use_qkv_bias", false);
            n.o_bias = f.bool_or("use_bias", false);
            if (f.bool_or("use_qk_norm", false)) n.qk = QkNorm::kPerHead;
            n.router_bias = f.bool_or("moe_router_enable_expert_bias", false);
            break;
        case Family::kJamba:
            // JambaAttentionDecoderLayer: qkv_proj and o_proj with bias=False whatever
            // attention_bias says.
            n.qkv_bias = n.o_bias = false;
            break;
        case Family::kKimiLinear:
            // KimiMoE: the gate's e_score_correction_bias.
            n.router_bias = true;
            break;
        case Family::kNemotronH:
            // NemotronHMoE: the gate's e_score_correction_bias; NemotronHAttention's projections
            // bias = attention_bias, NemotronHMLP's = mlp_bias; NemotronHMambaDecoderLayer's
            // MambaMixer2(use_conv_bias=config.use_conv_bias, use_bias=config.use_bias).
            n.router_bias = true;
            n.mamba2_conv_bias = f.bool_or("use_conv_bias", true);
            n.mamba2_proj_bias = f.bool_or("use_bias", false);
            break;
        case Family::kBamba:
        case Family::kGraniteHybrid:
            // BambaMixerDecoderLayer / GraniteMoeHybridMambaDecoderLayer: MambaMixer2(
            // use_conv_bias=config.mamba_conv_bias, use_bias=config.mamba_proj_bias).
            n.mamba2_conv_bias = f.bool_or("mamba_conv_bias", true);
            n.mamba2_proj_bias = f.bool_or("mamba_proj_bias", false);
            break;
        default:
            break;
    }
    if (model_type == "glm4") n.per_part = 2;  // Glm4DecoderLayer: post_self_attn / post_mlp norms
    if (glm4_moe) n.router_bias = true;        // Glm4MoE: e_score_correction_bias
    // Lfm2MoeSparseMoeBlock (lfm2_moe.py): the gate's e_score_correction_bias when
    // use_expert_bias (Lfm2MoeConfig's default true).
    if (model_type == "lfm2_moe") n.router_bias = f.bool_or("use_expert_bias", true);
    // Qwen2MoeSparseMoeBlock / Qwen3NextSparseMoeBlock: shared_expert_gate (hidden -> 1) beside a
    // shared expert.
    if ((model_type == "qwen2_moe" || fam == Family::kQwen3Next) && m.moe.shared_experts > 0)
        n.shared_expert_gate = true;
    if (fam == Family::kQwen3Next) {
        // Qwen3NextAttention: qkv_proj of num_heads x (1 + attn_output_gate) query heads
        // (getattr(config, "attn_output_gate", True)), its bias = qkv_bias (not attention_bias).
        n.attention_output_gate = f.bool_or("attn_output_gate", true);
        n.qkv_bias = f.bool_or("qkv_bias", false);
    }
}

ModelSpec parse_hf_config(std::string_view json_text, const std::string& file,
                          double tokenizer_max_length) {
    nlohmann::json top;
    try {
        top = nlohmann::json::parse(replace_non_finite(json_text));
    } catch (const nlohmann::json::exception& e) {
        throw Error(detail::concat(file, ": not valid JSON (", e.what(), ")"));
    }
    if (!top.is_object())
        throw Error(detail::concat(file, ": expected a JSON object at the top level"));
    // Multimodal wrappers (Llama 4, Gemma 3, ...) nest the language model under text_config; its
    // fields win, the wrapper's fill in what it lacks (torch_dtype, tie_word_embeddings).
    nlohmann::json j = top;
    if (top.contains("text_config") && top.at("text_config").is_object()) {
        j = top.at("text_config");
        for (const auto& [key, value] : top.items())
            if (key != "text_config" && key != "vision_config" && key != "audio_config" &&
                !j.contains(key))
                j[key] = value;
        if (top.contains("model_type") && top.at("text_config").contains("model_type"))
            j["model_type"] = top.at("text_config").at("model_type");
    }
    j.erase("vision_config");
    j.erase("audio_config");
    HfFields f(j, file);
    const std::string model_type = f.string_or("model_type", "");
    const Family fam = family_of(model_type, file);
    refuse_unknown_kv_fields(f, model_type);
    refuse_foreign_fields(f, fam, model_type);

    ModelSpec m;
    m.name = f.string_or("_name_or_path", model_type.empty() ? "hf-model" : model_type);
    auto pick = [&](std::initializer_list<const char*> keys, const char* canonical) {
        const std::string k = f.first_of(keys);
        return k.empty() ? std::string(canonical) : k;
    };
    m.num_layers =
        f.positive_int(pick({"num_hidden_layers", "n_layer", "num_layers"}, "num_hidden_layers"));
    if (fam == Family::kLongcat && f.has("num_layers") && f.has("num_hidden_layers") &&
        f.positive_int("num_hidden_layers") != f.positive_int("num_layers"))
        // transformers' LongcatFlashConfig counts two per decoder layer there (its cache layers).
        throw f.bad("num_hidden_layers",
                    detail::concat("is ", f.positive_int("num_hidden_layers"),
                                   " beside num_layers ", f.positive_int("num_layers"),
                                   ": vLLM's FlashConfig builds num_hidden_layers decoder layers "
                                   "when set, while the checkpoint has num_layers of them; give "
                                   "one count (num_layers, the decoder layers)"));
    // ModelSpec holds at most 16384 cache layers; Falcon-H1 makes two of each decoder layer and
    // LongCat-Flash three (read_falcon_h1, read_longcat_flash), so their decoder layers are
    // checked here against 16384 / k, by the count the config states.
    const int cache_layers_per_decoder_layer = fam == Family::kFalconH1  ? 2
                                               : fam == Family::kLongcat ? 3
                                                                         : 1;
    if (m.num_layers > (1 << 14) / cache_layers_per_decoder_layer) {
        if (cache_layers_per_decoder_layer == 1)
            throw Error(detail::concat(file, ": ", m.num_layers,
                                       " layers: kvshard reads models of at most 16384 layers"));
        throw f.bad(pick({"num_hidden_layers", "n_layer", "num_layers"}, "num_hidden_layers"),
                    detail::concat("is ", m.num_layers, " decoder layers: model_type '", model_type,
                                   "' makes ", cache_layers_per_decoder_layer,
                                   " cache layers of each, and kvshard reads at most 16384 cache "
                                   "layers, so at most ",
                                   (1 << 14) / cache_layers_per_decoder_layer, " decoder layers"));
    }
    m.hidden = f.positive_int("hidden_size");
    const ClassDefaults defaults = class_defaults(model_type);
    auto missing = [&](const char* key) {
        return Error(
            detail::concat(file, ": missing field '", key, "': transformers' ",
                           defaults.config_class, " (model_type '", model_type,
                           "') has no default for it that kvshard could confirm, "
                           "and the KV size depends on it; add the model's value to the config"));
    };
    const std::string heads_key = pick({"num_attention_heads", "n_head"}, "num_attention_heads");
    if (!f.has(heads_key) && defaults.num_heads == ClassDefaults::kRequired)
        throw Error(detail::concat(file, ": missing field '", heads_key, "'"));
    m.num_heads = f.positive_int_or(heads_key, defaults.num_heads);
    m.vocab = f.has("vocab_size") || (fam != Family::kGemma3 && fam != Family::kGemma4)
                  ? f.positive_int(pick({"vocab_size", "padded_vocab_size"}, "vocab_size"))
              : fam == Family::kGemma4
                  ? 262144   // Gemma4TextConfig's default
                  : 262208;  // Gemma3TextConfig's default; the published text_config omits it
    // Falcon-H1 without rope_theta: vLLM's FalconH1AttentionDecoderLayer falls back to 1e11
    // (getattr(config, "rope_theta", 1e11); later set_default_rope_theta(config, 1e11)) only where
    // the config object has none, and it always has one: transformers' FalconH1Config.__init__
    // (4.x, which vLLM's requirements/common.txt pins: transformers < 5) sets rope_theta =
    // 100000.0, which patch_rope_parameters (vllm/transformers_utils/config.py) moves into
    // rope_parameters before the model reads it. (transformers 5's FalconH1Config defines no
    // rope_theta; RotaryEmbeddingConfigMixin.default_theta, 10000, would apply there.) The
    // published checkpoints state it (1e11).
    m.rope_theta = f.number_or("rope_theta", fam == Family::kFalconH1 ? 1e5 : 10000.0);
    m.rms_norm_eps = f.number_or(
        pick({"rms_norm_eps", "layer_norm_epsilon", "layernorm_epsilon"}, "rms_norm_eps"), 1e-6);
    const bool gemma = fam == Family::kGemma2 || fam == Family::kGemma3 || fam == Family::kGemma4;
    // Gemma, Cohere2Config, SmolLM3Config, Ernie4_5Config and Ernie4_5_MoeConfig tie the
    // embeddings by default
    m.tie_embeddings =
        f.bool_or("tie_word_embeddings", gemma || fam == Family::kCohere2 ||
                                             fam == Family::kSmolLM3 || model_type == "ernie4_5" ||
                                             model_type == "ernie4_5_moe" || fam == Family::kLfm2);
    // Lfm2Config: its original key tie_embedding wins over tie_word_embeddings.
    if (fam == Family::kLfm2) m.tie_embeddings = f.bool_or("tie_embedding", m.tie_embeddings);
    const std::string torch_dtype =
        f.string_or(f.has("torch_dtype") ? "torch_dtype" : "dtype", "bfloat16");
    try {
        m.weight_dtype = parse_dtype(torch_dtype);
    } catch (const Error& e) {
        throw Error(detail::concat(file, ": field 'torch_dtype': ", e.what()));
    }
    // vLLM's default --dtype auto serves a float32 checkpoint in 16 bits (vllm/config/model.py,
    // _resolve_auto_dtype: "Downcast for float32 models", to the platform's first dtype, bf16 on
    // GPUs of compute capability 8.0 and up), and its KV cache (--kv-cache-dtype auto) follows.
    // Sized at fp32 the KV and the weights would be twice what vLLM holds; --kv-dtype and
    // --weight-dtype still choose fp32 explicitly.
    if (m.weight_dtype == DType::kFp32) m.weight_dtype = DType::kBf16;
    m.kv_dtype = m.weight_dtype;
    if (f.has("quantization_config"))
        m.weight_storage = hf_weight_storage(f.json().at("quantization_config"), file);

    // ---- KV heads and head_dim of the model's attention layers ----
    if (fam == Family::kFalcon) {
        if (f.bool_or("new_decoder_architecture", false))
            m.num_kv_heads = f.positive_int(pick({"num_kv_heads", "n_head_kv"}, "num_kv_heads"));
        else if (f.bool_or("multi_query", true))
            m.num_kv_heads = 1;  // Falcon-7B: num_kv_heads is written but unused (MQA)
        else
            m.num_kv_heads = m.num_heads;
    } else if (fam == Family::kChatGlm) {
        m.num_kv_heads = f.bool_or("multi_query_attention", false)
                             ? f.positive_int("multi_query_group_num")
                             : m.num_heads;
    } else if (f.has("num_key_value_heads")) {
        m.num_kv_heads = f.positive_int("num_key_value_heads");
    } else if (f.json().contains("num_key_value_heads")) {  // null
        if (!defaults.null_kv_is_heads)
            throw f.bad("num_key_value_heads",
                        detail::concat("is null, which ", defaults.config_class,
                                       " does not turn into a KV head count: give the number"));
        m.num_kv_heads = m.num_heads;
    } else if (defaults.num_kv_heads == ClassDefaults::kFromHeads) {
        m.num_kv_heads = m.num_heads;
    } else if (defaults.num_kv_heads == ClassDefaults::kRequired && !f.has("kv_lora_rank")) {
        throw missing("num_key_value_heads");
    } else {
        m.num_kv_heads = defaults.num_kv_heads;
    }
    const std::string head_dim_key =
        pick({"head_dim", "attention_head_dim", "kv_channels"}, "head_dim");

    if (f.has("kv_lora_rank")) {  // DeepSeek-V2/V3 multi-head latent attention
        m.attention = AttentionKind::kMla;
        m.mla.kv_lora_rank = f.positive_int("kv_lora_rank");
        m.mla.qk_rope_head_dim = f.positive_int("qk_rope_head_dim");
        m.mla.qk_nope_head_dim = f.positive_int("qk_nope_head_dim");
        m.mla.v_head_dim = f.positive_int("v_head_dim");
        m.mla.q_lora_rank = f.int_or("q_lora_rank", 0);
        m.num_kv_heads = m.num_heads;
        m.head_dim = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim;
    } else {
        // Families whose vLLM attention takes hidden / heads as the head size and never reads
        // head_dim (Granite 4.0-H's own check is below).
        const bool head_dim_from_hidden = fam == Family::kOlmo || fam == Family::kCohere2 ||
                                          model_type == "granitemoe" || fam == Family::kLfm2 ||
                                          fam == Family::kBamba || fam == Family::kJamba;
        if (f.has(head_dim_key) && fam != Family::kGraniteHybrid && !head_dim_from_hidden) {
            m.head_dim = f.positive_int(head_dim_key);
        } else if (defaults.head_dim == ClassDefaults::kRequired) {
            throw missing(head_dim_key.c_str());
        } else if (defaults.head_dim != ClassDefaults::kFromHeads &&
                   !((model_type == "seed_oss" || model_type == "ernie4_5") &&
                     f.json().contains(head_dim_key))) {
            // (SeedOssConfig and Ernie4_5Config map an explicit null to hidden / heads.)
            m.head_dim = defaults.head_dim;  // e.g. Gemma 3's 256 where hidden / heads is 240
        } else {
            if (m.hidden % m.num_heads != 0)
                throw Error(detail::concat(file, ": field 'head_dim' is missing and hidden_size (",
                                           m.hidden, ") is not divisible by num_attention_heads (",
                                           m.num_heads, ")"));
            m.head_dim = m.hidden / m.num_heads;
        }
        if (head_dim_from_hidden && f.has(head_dim_key) &&
            f.positive_int(head_dim_key) != m.head_dim)
            throw f.bad(
                head_dim_key,
                detail::concat("is ", f.positive_int(head_dim_key), ", but vLLM's ", model_type,
                               " attention uses hidden_size / num_attention_heads = ", m.head_dim,
                               ": remove the field or fix it"));
        if (m.num_heads % m.num_kv_heads != 0)
            throw Error(detail::concat(file, ": num_attention_heads (", m.num_heads,
                                       ") must be a multiple of num_key_value_heads (",
                                       m.num_kv_heads, ")"));
        m.attention = m.num_kv_heads == m.num_heads ? AttentionKind::kMha
                      : m.num_kv_heads == 1         ? AttentionKind::kMqa
                                                    : AttentionKind::kGqa;
    }

    if (model_type == "minimax_m2") {
        if (f.has("attn_type_list")) {
            const auto& types = f.array("attn_type_list");
            if (static_cast<int>(types.size()) != m.num_layers)
                throw f.bad("attn_type_list",
                            detail::concat("lists ", types.size(),
                                           " layers but num_hidden_layers is ", m.num_layers));
            for (size_t l = 0; l < types.size(); ++l)
                if (!types[l].is_number_integer() || types[l].get<int64_t>() != 1)
                    throw f.bad("attn_type_list",
                                detail::concat("has ", types[l].dump(), " at layer ", l,
                                               ": kvshard reads MiniMax-M2's full-attention "
                                               "layers (1); lightning attention (0, MiniMax-01) "
                                               "keeps a state it does not model"));
        }
        if (f.int_or("shared_intermediate_size", 0) != 0)
            throw f.bad("shared_intermediate_size",
                        "is not 0: kvshard reads MiniMax-M2's MoE without a shared expert");
    }

    // ---- MoE ----
    // A shared expert of the width `key` states, in routed widths
    // (shared_experts_in_routed_widths).
    auto shared_width_in_experts = [&](const char* key) {
        return f.has(key) ? shared_experts_in_routed_widths(f, m, f.positive_int(key), key, "") : 1;
    };
    if (fam == Family::kGemma4) {
        // enable_moe_block: num_experts experts of moe_intermediate_size (top_k_experts) beside
        // the layer's dense MLP of intermediate_size, which counts as that many expert widths
        // (Gemma-4-26B-A4B: 2112 = 3 x 704), as vLLM's Gemma4DecoderLayer runs both.
        if (f.bool_or("enable_moe_block", false)) {
            m.moe.num_experts = f.positive_int("num_experts");
            m.moe.experts_per_token = f.positive_int("top_k_experts");
            m.moe.expert_intermediate = f.positive_int("moe_intermediate_size");
            m.moe.shared_experts = shared_width_in_experts("intermediate_size");
        }
    } else if (fam == Family::kGraniteHybrid) {
        // GraniteMoeHybridConfig: num_local_experts 8, num_experts_per_tok 2, intermediate_size
        // 11008 (each expert's width), shared_intermediate_size 1024 (a shared MLP on every
        // layer, 0 for none) when absent. num_local_experts 0 (Granite-4.0-H-1B) is dense: the
        // shared MLP is the layer's MLP (vLLM's GraniteMoeHybrid*DecoderLayer).
        const int experts = f.int_or("num_local_experts", 8);
        if (experts < 0) throw f.bad("num_local_experts", "must not be negative");
        const int shared = f.int_or("shared_intermediate_size", 1024);
        if (shared < 0) throw f.bad("shared_intermediate_size", "must not be negative");
        if (experts > 0) {
            m.moe.num_experts = experts;
            m.moe.experts_per_token = f.positive_int_or("num_experts_per_tok", 2);
            m.moe.expert_intermediate = f.positive_int_or("intermediate_size", 11008);
            m.moe.shared_experts =
                shared == 0 ? 0 : shared_width_in_experts("shared_intermediate_size");
        }
    } else if (fam == Family::kKimiLinear) {
        // KimiLinearConfig: num_experts None is a dense model. vLLM's KimiMoE: num_experts of
        // moe_intermediate_size, top num_experts_per_token, a shared KimiMLP of
        // moe_intermediate_size x num_shared_experts; layers below first_k_dense_replace (and
        // those not a multiple of moe_layer_freq, set per layer below) keep the dense MLP.
        if (f.has("num_experts")) {
            m.moe.num_experts = f.positive_int("num_experts");
            m.moe.experts_per_token = f.positive_int("num_experts_per_token");
            m.moe.expert_intermediate = f.positive_int("moe_intermediate_size");
            m.moe.shared_experts = f.int_or("num_shared_experts", 0);
            m.moe.first_dense_layers = f.int_or("first_k_dense_replace", 0);
            if (m.moe.first_dense_layers >= m.num_layers)
                throw f.bad("first_k_dense_replace",
                            detail::concat("must be below num_hidden_layers (", m.num_layers,
                                           "), got ", m.moe.first_dense_layers));
        }
    } else if (fam == Family::kJamba) {
        // JambaConfig.layers_num_experts: num_experts (default 16) on layers l with
        // l % expert_layer_period == expert_layer_offset, else 1; vLLM's jamba.py builds JambaMoE
        // (experts of intermediate_size, top num_experts_per_tok, default 2) where that is above
        // 1, else JambaMLP of intermediate_size. Which layers is set per layer below.
        const int experts = f.int_or("num_experts", 16);
        if (experts > 1) {
            m.moe.num_experts = experts;
            m.moe.experts_per_token = f.positive_int_or("num_experts_per_tok", 2);
            m.moe.expert_intermediate = f.positive_int_or("intermediate_size", 14336);
        }
    } else if (fam == Family::kBailing) {
        // vLLM's bailing_moe.py (BailingMoeBlock, commit 3a04cf8f): layer l below
        // config.first_k_dense_replace holds BailingMLP(intermediate_size), gate + up + down; the
        // others BailingMoE: a bias-free gate of hidden x num_experts
        // (moe_router_enable_expert_bias adds a bias of num_experts, not counted, as no family's
        // router bias is), SharedFusedMoE of num_experts experts of moe_intermediate_size, top
        // num_experts_per_tok (n_group / topk_group group the choice, not the experts), and with
        // num_shared_experts > 0 one shared BailingMLP of num_shared_experts x
        // moe_shared_expert_intermediate_size (where the config has that attribute, else
        // moe_intermediate_size). vLLM reads first_k_dense_replace and num_shared_experts from the
        // config object: Ling 1.x's BailingMoeConfig defaults both to 0; Ling 2.0's remote
        // BailingMoeV2Config was not read, so there they are required.
        const bool v2 = model_type == "bailing_moe_v2";
        auto int_v1_default = [&](const char* key, int v1_default) {
            if (v2 && !f.has(key)) throw missing(key);
            return f.int_or(key, v1_default);
        };
        m.moe.num_experts = f.positive_int("num_experts");
        m.moe.experts_per_token = f.positive_int("num_experts_per_tok");
        m.moe.expert_intermediate = f.positive_int("moe_intermediate_size");
        const char* shared_key = "moe_shared_expert_intermediate_size";
        if (f.json().contains(shared_key) && !f.has(shared_key))
            throw f.bad(shared_key,
                        "is null: vLLM's BailingMoE takes it whenever the config has the attribute "
                        "and fails on None; give the shared expert's width or remove the field");
        const int shared = int_v1_default("num_shared_experts", 0);
        if (shared > 0) {
            const int64_t width = int64_t{shared} * (f.has(shared_key) ? f.positive_int(shared_key)
                                                                       : m.moe.expert_intermediate);
            m.moe.shared_experts =
                shared_experts_in_routed_widths(f, m, width, shared_key, "x num_shared_experts ");
        }
        m.moe.first_dense_layers = int_v1_default("first_k_dense_replace", 0);
        if (m.moe.first_dense_layers >= m.num_layers) m.moe = {};  // every layer BailingMLP
    } else if (fam == Family::kDots1) {
        // vLLM's dots1.py (Dots1DecoderLayer, commit 3a04cf8f): Dots1MoE where
        // config.n_routed_experts is not None and layer_idx >= first_k_dense_replace and
        // layer_idx % moe_layer_freq == 0 (set per layer below), else Dots1MLP(intermediate_size).
        // Dots1MoE: a bias-free gate of hidden x n_routed_experts (topk_method noaux_tc adds an
        // e_score_correction_bias, not counted), SharedFusedMoE of n_routed_experts experts of
        // moe_intermediate_size, top num_experts_per_tok, and n_shared_experts (None: none)
        // shared experts as one Dots1MLP of moe_intermediate_size x n_shared_experts.
        // Dots1Config's defaults: n_routed_experts None (dense), num_experts_per_tok None,
        // first_k_dense_replace 0, moe_intermediate_size 1408; it defines no moe_layer_freq,
        // which vLLM reads from the config object.
        if (f.has("n_routed_experts")) {
            m.moe.num_experts = f.positive_int("n_routed_experts");
            if (!f.has("num_experts_per_tok"))
                throw f.bad("num_experts_per_tok",
                            "is missing while n_routed_experts is set: vLLM's Dots1MoE takes its "
                            "top-k from it (Dots1Config's default is None); give the number");
            m.moe.experts_per_token = f.positive_int("num_experts_per_tok");
            m.moe.expert_intermediate = f.positive_int_or("moe_intermediate_size", 1408);
            m.moe.shared_experts = f.int_or("n_shared_experts", 0);
            m.moe.first_dense_layers = f.int_or("first_k_dense_replace", 0);
            if (!f.has("moe_layer_freq"))
                throw Error(detail::concat(
                    file,
                    ": missing field 'moe_layer_freq': vLLM's Dots1DecoderLayer reads "
                    "config.moe_layer_freq, which Dots1Config does not define (1: every layer "
                    "from first_k_dense_replace on is MoE)"));
        }
    } else if (model_type == "ernie4_5_moe") {
        // vLLM's ernie45_moe.py (Ernie4_5_MoeDecoderLayer): layer l holds Ernie4_5_MoeMoE when
        // use_moe (default: moe_num_experts > 0) and (l + 1) % moe_layer_interval == 0 and
        // moe_layer_start_index <= l <= moe_layer_end_index, else the dense MLP of
        // intermediate_size. The MoE: moe_num_experts of moe_intermediate_size, top moe_k, and
        // a shared MLP of moe_intermediate_size x moe_num_shared_experts. Ernie4_5_MoeConfig's
        // defaults: 64 experts, moe_k 6, 1536 wide, 2 shared, start 1, end -1 (the last layer),
        // interval 1. Which layers are MoE is set per layer below.
        const int experts = f.int_or("moe_num_experts", 64);
        if (f.bool_or("use_moe", experts > 0)) {
            if (experts == 0)
                throw f.bad("moe_num_experts",
                            "is 0 while use_moe is true: vLLM's Ernie4_5_MoeMoE needs experts");
            m.moe.num_experts = experts;
            m.moe.experts_per_token = f.positive_int_or("moe_k", 6);
            m.moe.expert_intermediate = f.positive_int_or("moe_intermediate_size", 1536);
            m.moe.shared_experts = f.int_or("moe_num_shared_experts", 2);
        }
    } else if (model_type == "hunyuan_v1_dense" || model_type == "hunyuan_v1_moe") {
        // vLLM's hunyuan_v1.py, for both: _is_moe (num_experts an int above 1, or a list of
        // ints one of which is above 1; a list holding anything else is dense) builds
        // HunYuanSparseMoeBlock on every layer: num_experts experts (one count: its router
        // has config.num_experts outputs, so a list fails there), top moe_topk (an int, or a
        // per-layer list indexed by layer), each moe_intermediate_size wide (int or per-layer
        // list; None: intermediate_size), and with use_mixed_mlp_moe a shared HunYuanMLP of
        // intermediate_size x num_shared_expert (int or per-layer list). MoeSpec keeps one
        // top-k and one width per model: per-layer lists must agree over the layers.
        bool moe = false;
        if (f.has("num_experts")) {
            const auto& e = f.json().at("num_experts");
            if (e.is_number_integer()) {
                moe = e.get<int64_t>() > 1;
            } else if (e.is_array()) {
                const bool all_ints = std::all_of(e.begin(), e.end(), [](const nlohmann::json& v) {
                    return v.is_number_integer();
                });
                for (const auto& v : e) moe = moe || (all_ints && v.get<int64_t>() > 1);
            } else {
                throw f.bad("num_experts", "must be an integer or a list of integers");
            }
            if (moe && !e.is_number_integer())
                throw f.bad("num_experts",
                            detail::concat("is ", e.dump(),
                                           ": a list with an entry above 1 makes vLLM's "
                                           "hunyuan_v1.py build HunYuanSparseMoeBlock, which "
                                           "takes num_experts as one count and fails on a "
                                           "list; give one integer"));
        }
        const int L = m.num_layers;
        // An int, or a list of ints with at least L entries that agree over the first L.
        auto per_layer = [&](const char* key) {
            const auto& v = f.json().at(key);
            if (v.is_number_integer()) return f.int_or(key, 0);
            if (!v.is_array() || static_cast<int>(v.size()) < L)
                throw f.bad(key, detail::concat("must be an integer or a list of at least ", L,
                                                " integers (one per layer), got ", v.dump()));
            for (int l = 0; l < L; ++l)
                if (!v[l].is_number_integer() || v[l].get<int64_t>() < 0 ||
                    v[l].get<int64_t>() > (int64_t{1} << 30))
                    throw f.bad(key, detail::concat("has ", v[l].dump(), " at layer ", l,
                                                    ": expected a non-negative integer"));
            for (int l = 1; l < L; ++l)
                if (v[l] != v[0])
                    throw f.bad(key, detail::concat("varies over the layers (", v[0].dump(),
                                                    " at layer 0, ", v[l].dump(), " at layer ", l,
                                                    "): kvshard keeps one value per model"));
            return v[0].get<int>();
        };
        if (moe) {
            m.moe.num_experts = f.positive_int("num_experts");
            // HunYuanMoEV1Config: moe_topk 1; HunYuanDenseV1Config names no default.
            if (!f.has("moe_topk") && model_type != "hunyuan_v1_moe") throw missing("moe_topk");
            m.moe.experts_per_token = f.has("moe_topk") ? per_layer("moe_topk") : 1;
            // vLLM reads config.moe_intermediate_size, which neither config class defaults.
            if (!f.json().contains("moe_intermediate_size")) throw missing("moe_intermediate_size");
            const int dense_width = f.positive_int("intermediate_size");
            m.moe.expert_intermediate =
                f.has("moe_intermediate_size") ? per_layer("moe_intermediate_size") : dense_width;
            if (m.moe.experts_per_token <= 0 || m.moe.expert_intermediate <= 0)
                throw f.bad(m.moe.experts_per_token <= 0 ? "moe_topk" : "moe_intermediate_size",
                            "must be positive");
            const auto& mixed = f.json().value("use_mixed_mlp_moe", nlohmann::json(false));
            const bool shared = mixed.is_boolean()  ? mixed.get<bool>()
                                : mixed.is_number() ? mixed.get<double>() > 0
                                                    : false;
            if (shared) {
                if (!f.has("num_shared_expert"))
                    throw f.bad("num_shared_expert",
                                "is missing while use_mixed_mlp_moe is set: vLLM's "
                                "HunYuanSparseMoeBlock reads it for the shared MLP's width");
                const int64_t width = int64_t{dense_width} * per_layer("num_shared_expert");
                m.moe.shared_experts = shared_experts_in_routed_widths(
                    f, m, width, "num_shared_expert", "x intermediate_size ");
            }
        }
        if (f.bool_or("use_cla", false) && f.int_or("cla_share_factor", 1) > 1)
            throw f.bad(
                "use_cla",
                detail::concat("is true with cla_share_factor ", f.int_or("cla_share_factor", 1),
                               ": cross-layer attention (layers reading an earlier "
                               "layer's K and V) is not modelled"));
    } else if (fam == Family::kLongcat) {
        // vLLM's LongcatMoe: n_routed_experts (FlashConfig falls back to num_experts[layer]) of
        // config.moe_intermediate_size, top config.moe_topk (else num_experts_per_tok); no shared
        // expert. vLLM builds FlashConfig(**hf_config.__dict__) (longcat_flash.py) from the config
        // object transformers loaded, which decides what those attributes hold:
        //  - the checkpoint's remote LongcatFlashConfig (configuration_longcat_flash.py) sets
        //    moe_topk (default 12) whatever num_experts_per_tok says, and overwrites
        //    moe_intermediate_size with expert_ffn_hidden_size (default 2048);
        //  - transformers' LongcatFlashConfig aliases num_experts_per_tok to moe_topk (default 12)
        //    and keeps expert_ffn_hidden_size (2048), so a moe_intermediate_size in config.json
        //    reaches FlashConfig as an extra attribute and wins there.
        // kvshard reads moe_topk and expert_ffn_hidden_size (with their defaults), on which both
        // agree, and refuses a num_experts_per_tok or moe_intermediate_size that differs from
        // them: which value vLLM takes would depend on the class that loaded the config.
        // Its zero_expert_num zero-computation experts are identities: no weights, only router
        // columns (hidden x zero_expert_num, not counted, as no family's router bias is), and a
        // token routed to them skips an expert, so the active parameters count top-k real
        // experts: the most a token can activate.
        m.moe.num_experts = f.positive_int_or("n_routed_experts", 512);
        m.moe.experts_per_token = f.positive_int_or("moe_topk", 12);
        m.moe.expert_intermediate = f.positive_int_or("expert_ffn_hidden_size", 2048);
        auto refuse_other = [&](const char* key, const char* read, int value) {
            if (f.has(key) && f.positive_int(key) != value)
                throw f.bad(key, detail::concat(
                                     "is ", f.positive_int(key), " beside ", read, " ", value,
                                     " (stated or the class default): vLLM's FlashConfig takes "
                                     "the second where the checkpoint's remote LongcatFlashConfig "
                                     "loads the config, and may take the first where "
                                     "transformers' LongcatFlashConfig does; state one value, or "
                                     "make them equal"));
        };
        refuse_other("num_experts_per_tok", "moe_topk", m.moe.experts_per_token);
        refuse_other("moe_intermediate_size", "expert_ffn_hidden_size", m.moe.expert_intermediate);
        if (f.int_or("zero_expert_num", 0) < 0)
            throw f.bad("zero_expert_num", "must not be negative");
        if (f.int_or("zero_expert_num", 0) > 0 &&
            f.string_or("zero_expert_type", "identity") != "identity")
            throw f.bad("zero_expert_type",
                        detail::concat("is '", f.string_or("zero_expert_type", ""),
                                       "': kvshard reads LongCat-Flash's identity zero experts "
                                       "(no weights) only"));
    } else if (f.has("num_local_experts")) {  // Mixtral, gpt-oss, Llama 4
        m.moe.num_experts = f.positive_int("num_local_experts");
        m.moe.experts_per_token = f.positive_int(
            pick({"num_experts_per_tok", "experts_per_token"}, "num_experts_per_tok"));
        m.moe.expert_intermediate = f.positive_int("intermediate_size");
        if (fam == Family::kLlama4) m.moe.shared_experts = 1;
    } else if (f.has("n_routed_experts")) {  // DeepSeek-V3
        m.moe.num_experts = f.positive_int("n_routed_experts");
        m.moe.shared_experts = f.int_or("n_shared_experts", 0);
        m.moe.experts_per_token = f.positive_int("num_experts_per_tok");
        m.moe.expert_intermediate = f.positive_int("moe_intermediate_size");
        // Nemotron-H MoE (Nemotron-3-Nano): shared experts of their own width.
        m.moe.shared_experts *= shared_width_in_experts("moe_shared_expert_intermediate_size");
        m.moe.first_dense_layers = f.int_or("first_k_dense_replace", 0);
        if (m.moe.first_dense_layers >= m.num_layers)
            throw f.bad("first_k_dense_replace",
                        detail::concat("must be below num_hidden_layers (", m.num_layers, "), got ",
                                       m.moe.first_dense_layers));
    } else if (f.has("num_experts") && f.int_or("num_experts", 0) > 0) {  // Qwen3-MoE, Qwen3-Next
        m.moe.num_experts = f.positive_int("num_experts");
        m.moe.experts_per_token = f.positive_int("num_experts_per_tok");
        m.moe.expert_intermediate = f.positive_int("moe_intermediate_size");
        // Qwen2-MoE, Qwen3-Next: one shared expert of its own width (Qwen2-57B-A14B: 20480, 8
        // routed widths of 2560).
        if (f.has("shared_expert_intermediate_size"))
            m.moe.shared_experts = shared_width_in_experts("shared_expert_intermediate_size");
    }
    if (model_type == "lfm2_moe") {
        // vLLM's lfm2_moe.py: layer i < num_dense_layers (Lfm2MoeConfig default 2) has the dense
        // Lfm2MoeMlp, the others Lfm2MoeSparseMoeBlock: a bias-free gate (hidden x num_experts,
        // ReplicatedLinear), FusedMoE of num_experts (32) experts of moe_intermediate_size (1792)
        // with gate, up and down, top num_experts_per_tok (4), no shared experts.
        // use_expert_bias adds a num_experts bias to the routing scores (not counted, as no
        // family's router bias is).
        m.moe = {};
        m.moe.num_experts = f.positive_int_or("num_experts", 32);
        m.moe.experts_per_token = f.positive_int_or("num_experts_per_tok", 4);
        m.moe.expert_intermediate = f.positive_int_or("moe_intermediate_size", 1792);
        const int dense = f.int_or("num_dense_layers", 2);
        if (dense < 0) throw f.bad("num_dense_layers", detail::concat("must be >= 0, got ", dense));
        m.moe.first_dense_layers = dense;
        if (dense >= m.num_layers) m.moe = {};  // every layer dense, as vLLM builds it
        // Lfm2MoeSparseMoeBlock raises when tp_size > num_experts.
        m.moe.tp_at_most_experts = m.moe.enabled();
        for (const char* key : {"block_ff_dim", "block_auto_adjust_ff_dim", "block_multiple_of",
                                "block_ffn_dim_multiplier"})
            if (f.has(key))
                throw f.bad(key,
                            "is set, but vLLM's LFM2-MoE dense MLP (Lfm2MoeMlp) takes "
                            "intermediate_size as it stands: remove it");
    }

    if (fam == Family::kFalcon || fam == Family::kNemotronH) m.mlp_projections = 2;
    // vLLM's MoE block of these families raises "Tensor parallel size N is greater than the
    // number of experts E" when the TP group is larger than the routed experts, whatever
    // expert parallelism does (the check reads get_tensor_model_parallel_world_size(), which
    // enable_expert_parallel leaves as it is): qwen2_moe.py Qwen2MoeSparseMoeBlock, qwen3_moe.py
    // Qwen3MoeSparseMoeBlock (qwen3_vl_moe.py's Qwen3MoeLLMModel builds Qwen3MoeModel),
    // qwen3_next.py Qwen3NextSparseMoeBlock (qwen3_5.py builds it for qwen3_5_moe_text),
    // hunyuan_v1.py HunYuanSparseMoeBlock, ernie45_moe.py Ernie4_5_MoeMoE. deepseek_v2.py
    // (DeepseekV2MoE), glm4_moe.py (Glm4MoE), mixtral.py, granitemoe.py, bailing_moe.py and
    // dots1.py check nothing of the kind.
    for (const char* t :
         {"qwen2_moe", "qwen3_moe", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_next",
          "qwen3_5_moe", "qwen3_5_moe_text", "hunyuan_v1_moe", "hunyuan_v1_dense", "ernie4_5_moe"})
        if (model_type == t) m.moe.tp_at_most_experts = m.moe.enabled();
    if (model_type == "apertus" || model_type == "arcee") {
        // vLLM's ApertusMLP and ArceeMLP: up_proj and down_proj, no gate, and they raise on any
        // activation but their own (ApertusMLP: "Only xIELU is supported"; ArceeMLP: "Only
        // 'relu2' is supported for AFM"). ApertusConfig's and ArceeConfig's defaults are those.
        m.mlp_projections = 2;
        const std::string act = model_type == "apertus" ? "xielu" : "relu2";
        if (f.string_or("hidden_act", act) != act)
            throw f.bad("hidden_act",
                        detail::concat("is ", f.json().at("hidden_act").dump(), ": vLLM's ",
                                       model_type == "apertus" ? "ApertusMLP" : "ArceeMLP",
                                       " supports only \"", act, "\" (an up / down MLP)"));
    }
    const std::string inter_key = pick(
        {"intermediate_size_mlp", "ffn_hidden_size", "intermediate_size"}, "intermediate_size");
    const bool needs_dense = !m.moe.enabled() || m.moe.first_dense_layers > 0 ||
                             ((fam == Family::kKimiLinear || fam == Family::kDeepSeek) &&
                              f.int_or("moe_layer_freq", 1) > 1);
    if (fam == Family::kFalcon)
        m.intermediate = f.positive_int_or("ffn_hidden_size", 4 * m.hidden);
    else if (fam == Family::kLongcat) {
        // FlashMLP of config.intermediate_size: the remote LongcatFlashConfig takes
        // intermediate_size, else ffn_hidden_size (default 12288); transformers' class aliases
        // intermediate_size to ffn_hidden_size, which FlashConfig prefers. Two different values
        // leave the width to the loading class: refused.
        m.intermediate = f.positive_int_or(
            f.has("intermediate_size") ? "intermediate_size" : "ffn_hidden_size", 12288);
        if (f.has("ffn_hidden_size") && f.positive_int("ffn_hidden_size") != m.intermediate)
            throw f.bad("ffn_hidden_size",
                        detail::concat("is ", f.positive_int("ffn_hidden_size"),
                                       " beside intermediate_size ", m.intermediate,
                                       ": vLLM's FlashMLP takes the second where the checkpoint's "
                                       "remote LongcatFlashConfig loads the config, the first "
                                       "where transformers' LongcatFlashConfig does; state one "
                                       "value, or make them equal"));
    } else if (fam == Family::kNemotronNas)
        m.intermediate = 0;  // per block, from ffn_mult
    else if (fam == Family::kLlama4)
        m.intermediate = f.positive_int_or("intermediate_size_mlp", m.moe.expert_intermediate);
    else if (fam == Family::kGraniteHybrid)
        m.intermediate = m.moe.enabled() ? m.moe.expert_intermediate
                                         : f.int_or("shared_intermediate_size", 1024);
    else if (model_type == "lfm2_moe")  // Lfm2MoeMlp: intermediate_size as it stands
        m.intermediate = f.positive_int_or("intermediate_size", 7168);
    else if (fam == Family::kLfm2)
        m.intermediate = lfm2_ff_width(f);
    else if (fam == Family::kBamba || fam == Family::kJamba ||
             fam == Family::kFalconH1)  // their dense MLP (FalconH1Config's default too)
        m.intermediate = f.positive_int_or("intermediate_size", 14336);
    else if (fam == Family::kDots1)  // Dots1Config's default
        m.intermediate = f.positive_int_or("intermediate_size", 10944);
    else if (model_type == "ernie4_5_moe")  // its dense layers (layer 0 by default)
        m.intermediate = f.positive_int_or("intermediate_size", 12288);
    else
        m.intermediate = needs_dense ? f.positive_int(inter_key)
                                     : f.positive_int_or(inter_key, m.moe.expert_intermediate);

    // ---- per layer ----
    const int L = m.num_layers;
    std::vector<LayerSpec> layers(L);
    for (int l = 0; l < L; ++l) {
        LayerSpec& s = layers[l];
        s.kind = m.is_mla() ? LayerKind::kMla : LayerKind::kFullAttention;
        s.num_kv_heads = m.is_mla() ? 0 : m.num_kv_heads;
        s.head_dim = m.is_mla() ? 0 : m.head_dim;
        s.mlp = m.moe.enabled() && l >= m.moe.first_dense_layers ? MlpKind::kMoe : MlpKind::kDense;
        s.intermediate = s.mlp == MlpKind::kDense ? m.intermediate : 0;
    }
    auto window_field = [&](const char* key) {
        if (!f.has(key)) throw Error(detail::concat(file, ": missing field '", key, "'"));
        return f.positive_int(key);
    };
    auto set_window = [&](LayerSpec& s, LayerKind kind, int w) {
        s.kind = kind;
        s.window = w;
    };

    const bool per_layer_family = fam == Family::kOlmo || fam == Family::kCohere2 ||
                                  fam == Family::kExaone4 || fam == Family::kSmolLM3;
    if (f.has("layer_types") && fam != Family::kGraniteHybrid && fam != Family::kBamba &&
        fam != Family::kGemma4 && fam != Family::kLfm2 && fam != Family::kBailing &&
        fam != Family::kDots1 && !per_layer_family) {
        const std::vector<std::string> types = layer_type_list(f, "layer_types", L);
        for (int l = 0; l < L; ++l) {
            const LayerKind k = layer_type_kind(types[l], file, l);
            if (k == LayerKind::kSlidingWindow)
                set_window(layers[l], k, window_field("sliding_window"));
            else if (k == LayerKind::kChunkedLocal)
                set_window(layers[l], k, window_field("attention_chunk_size"));
            else
                layers[l].kind = k;
            if (k == LayerKind::kGatedDeltaNet && fam != Family::kQwen3Next)
                throw f.bad("layer_types", detail::concat("names linear_attention, which kvshard "
                                                          "reads only for qwen3_next, not '",
                                                          model_type, "'"));
        }
    } else if (fam == Family::kGemma2) {
        // Even layers slide, odd layers attend fully (transformers' Gemma2 default).
        for (int l = 0; l < L; l += 2)
            set_window(layers[l], LayerKind::kSlidingWindow, window_field("sliding_window"));
    } else if (fam == Family::kGemma3) {
        const int pattern = f.positive_int_or("sliding_window_pattern", 6);
        for (int l = 0; l < L; ++l)
            if ((l + 1) % pattern != 0)
                set_window(layers[l], LayerKind::kSlidingWindow, window_field("sliding_window"));
    }
    if (per_layer_family) {
        // Olmo 3, Cohere 2 and EXAONE 4 name each layer in layer_types ("sliding_attention" or
        // "full_attention"); their config classes fill it when absent: Olmo3Config 3 sliding :
        // 1 full, Cohere2Config and Exaone4Config from sliding_window_pattern (default 4), Olmo 2
        // none sliding. vLLM builds each layer from config.layer_types (olmo2.py's
        // Olmo2Attention, commandr.py's CohereAttention, exaone4.py's Exaone4Attention) with
        // config.sliding_window as its window. Cohere 2's and EXAONE 4's full layers skip RoPE
        // (NoPE): positions change what is computed, not what is cached.
        std::vector<bool> sliding(L, false);
        const bool listed = f.has("layer_types");
        const bool null_window =
            f.json().contains("sliding_window") && f.json().at("sliding_window").is_null();
        if (listed) {
            const std::vector<std::string> types =
                layer_type_list(f, "layer_types", L, {"sliding_attention", "full_attention"});
            for (int l = 0; l < L; ++l) sliding[l] = types[l] == "sliding_attention";
        }
        // With layer_types listed the pattern only filled them when absent (Cohere2Config,
        // Exaone4Config; Exaone4Config even sets it to 0 when sliding_window is null): vLLM reads
        // layer_types, so the pattern is checked for its form only.
        if (f.has("sliding_window_pattern")) {
            const auto& p = f.json().at("sliding_window_pattern");
            std::vector<bool> from_pattern(L);
            if (p.is_string() && fam == Family::kExaone4) {
                // EXAONE 4's published configs write the pattern as a string, "LLLG": L local
                // (sliding), G global, repeated over the layers, beside layer_types.
                const std::string s = p.get<std::string>();
                if (s.empty() || s.find_first_not_of("LG") != std::string::npos)
                    throw f.bad("sliding_window_pattern",
                                detail::concat("is \"", s,
                                               "\": expected an integer or a string of L (local) "
                                               "and G (global), e.g. \"LLLG\""));
                for (int l = 0; l < L; ++l) from_pattern[l] = s[l % s.size()] == 'L';
                // Exaone4Config derives layer_types from an integer pattern only: vLLM cannot
                // build the layers from a string alone.
                if (!listed)
                    throw f.bad("sliding_window_pattern",
                                detail::concat("is \"", s,
                                               "\" and layer_types is missing: Exaone4Config "
                                               "derives the layers from an integer pattern only; "
                                               "give layer_types"));
            } else {
                const int n = f.int_or("sliding_window_pattern", 0);
                if (n == 0 && !listed)
                    throw f.bad("sliding_window_pattern",
                                "is 0 and layer_types is missing: the config class derives no "
                                "layers from it; give layer_types or a positive pattern");
                for (int l = 0; l < L && n > 0; ++l) from_pattern[l] = (l + 1) % n != 0;
            }
            if (!listed) sliding = from_pattern;
        } else if (fam == Family::kSmolLM3) {
            // SmolLM3Config: no_rope_layers (1 RoPE, 0 NoPE), else every
            // no_rope_layer_interval-th layer (default 4) NoPE; without layer_types the NoPE
            // layers slide when use_sliding_window and sliding_window are set. RoPE or not, every
            // layer caches K and V of num_key_value_heads x head_dim.
            const std::vector<int> rope = rope_layer_list(f, L, /*empty_is_absent=*/false);
            if (!listed && f.bool_or("use_sliding_window", false) && f.has("sliding_window"))
                for (int l = 0; l < L; ++l) sliding[l] = rope[l] == 0;
        } else if (!listed && model_type != "olmo2") {
            for (int l = 0; l < L; ++l) sliding[l] = (l + 1) % 4 != 0;
        }
        if (fam == Family::kCohere2 && f.has("order_of_interleaved_layers") &&
            f.string_or("order_of_interleaved_layers", "") != "local_attn_first")
            throw f.bad("order_of_interleaved_layers",
                        detail::concat("is ", f.json().at("order_of_interleaved_layers").dump(),
                                       ": Cohere2Config and vLLM put the sliding layers first in "
                                       "each group (\"local_attn_first\"), the only order read"));
        // The class default window is 4096 (Olmo3Config, Cohere2Config, Exaone4Config; None in
        // SmolLM3Config); an explicit null reaches vLLM's Attention as no window: those layers
        // attend fully. Exaone4Config without layer_types then divides by a pattern of 0.
        if (null_window && fam == Family::kExaone4 && !listed)
            throw f.bad("sliding_window",
                        "is null and layer_types is missing: Exaone4Config then derives no "
                        "layers (its pattern becomes 0); give layer_types");
        const int window =
            null_window ? 0
                        : f.positive_int_or("sliding_window", fam == Family::kSmolLM3 ? 0 : 4096);
        for (int l = 0; l < L; ++l)
            if (sliding[l] && window > 0) set_window(layers[l], LayerKind::kSlidingWindow, window);
    }
    if (fam == Family::kGemma3) {
        // Gemma3TextConfig stores sliding_window_pattern as _sliding_window_pattern and writes it
        // back under that name; on load it derives the layers from layer_types, else from
        // sliding_window_pattern (default 6), never from _sliding_window_pattern. Accepted where
        // it agrees with the layers read; a disagreement leaves the layout in doubt.
        if (f.has("_sliding_window_pattern")) {
            const int p = f.positive_int("_sliding_window_pattern");
            for (int l = 0; l < L; ++l)
                if ((layers[l].kind == LayerKind::kSlidingWindow) != ((l + 1) % p != 0))
                    throw f.bad("_sliding_window_pattern",
                                detail::concat("(", p, ") disagrees with layer ", l,
                                               " as layer_types / sliding_window_pattern give it: "
                                               "remove one of them"));
        }
        // EmbeddingGemma: bidirectional, and transformers halves the window; not a decoder's KV.
        if (f.bool_or("use_bidirectional_attention", false))
            throw f.bad("use_bidirectional_attention",
                        "is true (an encoder, its sliding window halved by transformers): kvshard "
                        "sizes causal decoders' KV caches");
    } else if (fam == Family::kGemma4) {
        // "vision": image tokens attend both ways, text stays causal; "all" is an encoder (and
        // Gemma4TextConfig halves its window).
        const auto& j = f.json();
        if (j.contains("use_bidirectional_attention") &&
            !j.at("use_bidirectional_attention").is_null() &&
            j.at("use_bidirectional_attention") != "vision")
            throw f.bad("use_bidirectional_attention",
                        detail::concat("is ", j.at("use_bidirectional_attention").dump(),
                                       ": kvshard sizes causal decoders' KV caches (null or "
                                       "\"vision\" are read)"));
    } else if (!f.bool_or("is_causal", true)) {
        // vLLM's seed_oss.py (and the Qwen-derived models) build an encoder on is_causal false.
        throw f.bad("is_causal", "is false: kvshard sizes causal decoders' KV caches");
    } else if (f.bool_or("use_bidirectional_attention", false)) {
        throw f.bad("use_bidirectional_attention",
                    "is true: kvshard sizes causal decoders' KV caches");
    } else if (fam == Family::kGptOss) {
        for (int l = 0; l < L; l += 2)
            set_window(layers[l], LayerKind::kSlidingWindow, window_field("sliding_window"));
    } else if (fam == Family::kQwen3Next) {
        const int interval = f.positive_int_or("full_attention_interval", 4);
        for (int l = 0; l < L; ++l)
            if ((l + 1) % interval != 0) layers[l].kind = LayerKind::kGatedDeltaNet;
    } else if (fam == Family::kLlama) {
        // Mistral writes sliding_window alone; Qwen2/3 gate it with use_sliding_window and keep
        // the first max_window_layers layers full. With layer_types listed (read above) the
        // window reaches the layers it names sliding only (docs/model.md).
        // vLLM's ModelConfig.get_hf_config_sliding_window gives no window where the config
        // object has use_sliding_window false: Qwen2Config / Qwen3Config (MiMoConfig) default it
        // to False, the other classes here define no such attribute unless config.json names it.
        const bool qwen = model_type.rfind("qwen", 0) == 0 || model_type == "mimo";
        if (f.has("sliding_window") && !f.has("layer_types") &&
            f.bool_or("use_sliding_window", !qwen)) {
            const int first = qwen ? f.int_or("max_window_layers", 0) : 0;
            for (int l = first; l < L; ++l)
                set_window(layers[l], LayerKind::kSlidingWindow, window_field("sliding_window"));
        }
    }
    if (fam == Family::kLlama4 && f.has("attention_chunk_size") && !f.has("layer_types")) {
        // Layers with RoPE attend within their chunk; the NoPE layers (no_rope_layers[i] == 0)
        // attend fully. Absent: every no_rope_layer_interval-th layer is NoPE.
        const int chunk = f.positive_int("attention_chunk_size");
        const std::vector<int> rope = rope_layer_list(f, L, /*empty_is_absent=*/true);
        for (int l = 0; l < L; ++l)
            if (rope[l]) set_window(layers[l], LayerKind::kChunkedLocal, chunk);
    }
    if (fam == Family::kLlama4 && m.moe.enabled()) {
        std::vector<bool> moe(L, false);
        if (f.has("moe_layers")) {
            for (const auto& v : f.array("moe_layers")) {
                if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= L)
                    throw f.bad("moe_layers", detail::concat("must list layers in [0, ", L, ")"));
                moe[v.get<int>()] = true;
            }
        } else {
            const int step = f.positive_int_or("interleave_moe_layer_step", 1);
            for (int l = step - 1; l < L; l += step) moe[l] = true;
        }
        for (int l = 0; l < L; ++l) {
            layers[l].mlp = moe[l] ? MlpKind::kMoe : MlpKind::kDense;
            layers[l].intermediate = moe[l] ? 0 : m.intermediate;
        }
    }
    if (model_type == "ernie4_5_moe" && m.moe.enabled()) {
        // Ernie4_5_MoeConfig turns moe_layer_end_index -1 into the last layer.
        const int start = f.int_or("moe_layer_start_index", 1);
        int end = L - 1;
        if (f.has("moe_layer_end_index")) {
            const auto& v = f.json().at("moe_layer_end_index");
            if (!(v.is_number_integer() && v.get<int64_t>() == -1))
                end = f.int_or("moe_layer_end_index", L - 1);
        }
        const int interval = f.positive_int_or("moe_layer_interval", 1);
        bool any = false;
        for (int l = 0; l < L; ++l) {
            const bool moe = (l + 1) % interval == 0 && l >= start && l <= end;
            layers[l].mlp = moe ? MlpKind::kMoe : MlpKind::kDense;
            layers[l].intermediate = moe ? 0 : m.intermediate;
            any = any || moe;
        }
        if (!any) {  // no layer in range: vLLM builds only dense MLPs
            m.moe = MoeSpec{};
        } else {
            int first = 0;
            while (layers[first].mlp != MlpKind::kMoe) ++first;
            m.moe.first_dense_layers = first;  // lets a contiguous tail read as uniform
        }
    }
    if (fam == Family::kJamba) {
        // JambaConfig.layers_block_type: attention where l % attn_layer_period ==
        // attn_layer_offset (defaults 8 and 4), else Mamba-1 (vLLM's JambaMambaDecoderLayer:
        // MambaMixer of d_inner = mamba_expand x hidden, d_state mamba_d_state, d_conv
        // mamba_d_conv; JambaConfig's defaults 2, 16, 4). An offset not below its period is
        // refused, as JambaConfig refuses it.
        auto period_offset = [&](const char* period_key, const char* offset_key, int period,
                                 int offset) {
            const int p = f.positive_int_or(period_key, period);
            const int o = f.int_or(offset_key, offset);
            if (o >= p)
                throw f.bad(offset_key, detail::concat("(", o, ") must be below ", period_key, " (",
                                                       p, "), as JambaConfig requires"));
            return std::pair{p, o};
        };
        const auto [attn_p, attn_o] = period_offset("attn_layer_period", "attn_layer_offset", 8, 4);
        const auto [exp_p, exp_o] =
            period_offset("expert_layer_period", "expert_layer_offset", 2, 1);
        for (int l = 0; l < L; ++l) {
            if (l % attn_p != attn_o) layers[l].kind = LayerKind::kMamba1;
            const bool moe = m.moe.enabled() && l % exp_p == exp_o;
            layers[l].mlp = moe ? MlpKind::kMoe : MlpKind::kDense;
            layers[l].intermediate = moe ? 0 : m.intermediate;
        }
        if (m.moe.enabled()) {
            bool any = false;
            for (const auto& s : layers) any = any || s.mlp == MlpKind::kMoe;
            if (!any) m.moe = MoeSpec{};  // the offset names no layer: all dense
        }
        const int64_t inner = int64_t{f.positive_int_or("mamba_expand", 2)} * m.hidden;
        m.state.heads = checked_narrow(inner, "Jamba's d_inner (mamba_expand x hidden_size)");
        m.state.head_dim = 1;
        m.state.groups = 0;
        m.state.group_dim = f.positive_int_or("mamba_d_state", 16);
        m.state.conv_kernel = f.positive_int_or("mamba_d_conv", 4);
        // "auto" is ceil(hidden / 16) (JambaConfig), the rank mixer_params_of_layer counts.
        const int auto_rank = (m.hidden + 15) / 16;
        if (f.has("mamba_dt_rank") &&
            !(f.json().at("mamba_dt_rank").is_string() &&
              f.string_or("mamba_dt_rank", "") == "auto") &&
            f.positive_int("mamba_dt_rank") != auto_rank)
            throw f.bad("mamba_dt_rank",
                        detail::concat("is ", f.json().at("mamba_dt_rank").dump(),
                                       ": kvshard counts Jamba's Mamba-1 weights with dt_rank "
                                       "ceil(hidden_size / 16) = ",
                                       auto_rank, " (\"auto\")"));
        // vLLM's JambaMambaDecoderLayer (jamba.py) builds MambaMixer(use_conv_bias=
        // mamba_conv_bias, use_bias=mamba_proj_bias): a conv1d bias of d_inner when the first is
        // true, in_proj (2 x d_inner) and out_proj (hidden) biases when the second is
        // (layers/mamba/mamba_mixer.py). mixer_params_of_layer counts JambaConfig's defaults, conv
        // bias on and projection biases off, as every published Jamba sets them; another setting
        // is refused rather than miscounted.
        if (!f.bool_or("mamba_conv_bias", true))
            throw f.bad("mamba_conv_bias",
                        "is false: kvshard counts Jamba's Mamba-1 weights with the conv1d bias "
                        "(JambaConfig's default, true); a Jamba without it is not supported");
        if (f.bool_or("mamba_proj_bias", false))
            throw f.bad("mamba_proj_bias",
                        "is true: kvshard counts Jamba's Mamba-1 weights without in_proj / "
                        "out_proj biases (JambaConfig's default, false); a Jamba with them is not "
                        "supported");
    }
    if (fam == Family::kGptOss)
        for (auto& s : layers) s.learned_sinks = true;
    if (fam == Family::kQwen3Next && f.has("mlp_only_layers"))
        for (const auto& v : f.array("mlp_only_layers")) {
            if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= L)
                throw f.bad("mlp_only_layers", detail::concat("must list layers in [0, ", L, ")"));
            layers[v.get<int>()].mlp = MlpKind::kDense;
            layers[v.get<int>()].intermediate = f.positive_int("intermediate_size");
        }
    if (fam == Family::kQwen3Next) {
        m.state.heads = f.positive_int("linear_num_value_heads");
        m.state.head_dim = f.positive_int("linear_value_head_dim");
        m.state.groups = f.positive_int("linear_num_key_heads");
        m.state.group_dim = f.positive_int("linear_key_head_dim");
        m.state.conv_kernel = f.positive_int("linear_conv_kernel_dim");
    }

    if (fam == Family::kKimiLinear) read_kimi_linear(f, m, layers);
    if (fam == Family::kDeepSeek && m.moe.enabled())
        apply_moe_layer_freq(f.positive_int_or("moe_layer_freq", 1), m, layers);
    if (fam == Family::kBailing || fam == Family::kDots1)
        read_full_attention_only(f, fam, model_type, m, layers);
    if (model_type == "lfm2_moe" && !f.has("layer_types"))
        throw Error(detail::concat(
            file,
            ": missing field 'layer_types': vLLM's Lfm2MoeModel builds layer i from "
            "config.layer_types[i] (\"conv\" or \"full_attention\"), which Lfm2MoeConfig "
            "does not derive from full_attn_idxs"));
    if (fam == Family::kLfm2) read_lfm2(f, m, layers);

    if (fam == Family::kNemotronH) {
        const std::string pattern = f.string_or("hybrid_override_pattern", "");
        if (static_cast<int>(pattern.size()) != L)
            throw f.bad("hybrid_override_pattern",
                        detail::concat("has ", pattern.size(),
                                       " characters but num_hidden_layers "
                                       "is ",
                                       L, ": expected one of M, *, -, E per layer"));
        for (int l = 0; l < L; ++l) {
            LayerSpec& s = layers[l];
            s.intermediate = 0;
            switch (pattern[l]) {
                case 'M':
                    s.kind = LayerKind::kMamba2;
                    s.mlp = MlpKind::kNone;
                    break;
                case '*':
                    s.mlp = MlpKind::kNone;
                    break;
                case '-':
                    s.kind = LayerKind::kNoKv;
                    s.mlp = MlpKind::kDense;
                    s.intermediate = m.intermediate;
                    break;
                case 'E':
                    s.kind = LayerKind::kNoKv;
                    s.mlp = MlpKind::kMoe;
                    if (!m.moe.enabled())
                        throw f.bad("hybrid_override_pattern",
                                    "has an E (MoE) layer but the config names no experts");
                    break;
                default:
                    throw f.bad("hybrid_override_pattern",
                                detail::concat("has '", pattern[l], "' at layer ", l,
                                               ": expected M (Mamba-2), * (attention), - (MLP) "
                                               "or E (MoE)"));
            }
        }
        // Nemotron 3 Super / Ultra's LatentMoE, as vLLM's NemotronHMoE (models/nemotron_h.py)
        // builds it when config.moe_latent_size is not None: the gate reads hidden_size; the
        // routed experts (FusedMoE) take hidden_size = moe_latent_size, between fc1_latent_proj
        // (hidden -> latent) and fc2_latent_proj (latent -> hidden), two ReplicatedLinear
        // layers; the shared experts (NemotronHMLP) stay at hidden_size.
        if (f.has("moe_latent_size")) {
            if (!m.moe.enabled())
                throw f.bad("moe_latent_size",
                            "is set, but the config names no routed experts (n_routed_experts) "
                            "to run in it: remove it or set it to null");
            m.moe.latent_size = f.positive_int("moe_latent_size");
        }
        m.state.heads = f.positive_int("mamba_num_heads");
        m.state.head_dim = f.positive_int("mamba_head_dim");
        m.state.groups = f.positive_int("n_groups");
        m.state.group_dim = f.positive_int("ssm_state_size");
        m.state.conv_kernel = f.positive_int("conv_kernel");
    }
    if (fam == Family::kGemma4) {
        // Per-layer embeddings (Gemma 4 E2B / E4B) add a table of vocab_size_per_layer_input x
        // layers x hidden_size_per_layer_input that kvshard does not size; KV-shared layers
        // (num_kv_shared_layers) read an earlier layer's cache. Both are refused, not ignored.
        if (f.int_or("hidden_size_per_layer_input", 256) != 0)
            throw f.bad("hidden_size_per_layer_input",
                        "is not 0 (Gemma4TextConfig's default is 256): per-layer embeddings are "
                        "not modelled, so the weights would be undersized");
        if (f.int_or("num_kv_shared_layers", 0) != 0)
            throw f.bad("num_kv_shared_layers",
                        "is not 0: layers reading another layer's KV cache are not modelled");
        // Gemma4TextConfig: layer_types, else 5 sliding : 1 full, and the last layer is made
        // full whatever the list says. vLLM's Gemma4DecoderLayer: full layers have
        // global_head_dim (default 512) and, with attention_k_eq_v (K's weights reused as V; both
        // are still cached), num_global_key_value_heads KV heads.
        const int window = f.positive_int_or("sliding_window", 512);
        std::vector<bool> sliding(L);
        if (f.has("layer_types")) {
            const std::vector<std::string> types =
                layer_type_list(f, "layer_types", L, {"sliding_attention", "full_attention"});
            for (int l = 0; l < L; ++l) sliding[l] = types[l] == "sliding_attention";
        } else {
            for (int l = 0; l < L; ++l) sliding[l] = (l + 1) % 6 != 0;
        }
        sliding[L - 1] = false;
        const int global_head_dim = f.positive_int_or("global_head_dim", 512);
        const bool k_eq_v = f.bool_or("attention_k_eq_v", false);
        const int global_kv = k_eq_v && f.has("num_global_key_value_heads")
                                  ? f.positive_int("num_global_key_value_heads")
                                  : m.num_kv_heads;
        if (m.num_heads % global_kv != 0)
            throw f.bad("num_global_key_value_heads",
                        detail::concat("(", global_kv, ") must divide num_attention_heads (",
                                       m.num_heads, ")"));
        for (int l = 0; l < L; ++l) {
            if (sliding[l]) {
                set_window(layers[l], LayerKind::kSlidingWindow, window);
            } else {
                layers[l].kind = LayerKind::kFullAttention;
                layers[l].head_dim = global_head_dim;
                layers[l].num_kv_heads = global_kv;
            }
        }
    }
    if (fam == Family::kGraniteHybrid || fam == Family::kBamba) {
        std::vector<std::string> types;
        if (fam == Family::kBamba) {
            // vLLM's bamba.py builds layer i from config.layers_block_type[i], a BambaConfig
            // property: "attention" where i is in attn_layer_indices, else "mamba" (every layer
            // Mamba-2 when the list is absent or empty). A saved layer_types is not read there.
            if (f.has("layer_types"))
                throw f.bad("layer_types",
                            "is set, but BambaConfig derives the layers from attn_layer_indices "
                            "only (vLLM would not read it): remove it");
            types.assign(L, "mamba");
            if (f.has("attn_layer_indices"))
                for (const auto& v : f.array("attn_layer_indices")) {
                    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= L)
                        throw f.bad("attn_layer_indices",
                                    detail::concat("has ", v.dump(),
                                                   ": expected layer indices in [0, ", L, ")"));
                    types[v.get<int>()] = "attention";
                }
        } else {
            // vLLM builds each layer from config.layer_types[i] ("mamba" or "attention") and
            // fails without the list; transformers reads layers_block_type as its alias.
            const char* key = f.has("layer_types") ? "layer_types" : "layers_block_type";
            if (!f.has(key))
                throw Error(detail::concat(file,
                                           ": missing field 'layer_types': Granite 4.0-H names "
                                           "each layer \"mamba\" or \"attention\""));
            types = layer_type_list(f, key, L, {"mamba", "attention"});
        }
        for (int l = 0; l < L; ++l) {
            if (types[l] == "mamba") layers[l].kind = LayerKind::kMamba2;
            if (!m.moe.enabled() && m.intermediate == 0) layers[l].mlp = MlpKind::kNone;
        }
        // vLLM's attention uses hidden / heads as the head size and ignores a head_dim field.
        if (f.has(head_dim_key) && f.positive_int(head_dim_key) != m.head_dim)
            throw f.bad(head_dim_key, detail::concat("is ", f.positive_int(head_dim_key),
                                                     ", but vLLM's ", model_type,
                                                     " attention uses hidden_size / "
                                                     "num_attention_heads = ",
                                                     m.head_dim, ": remove the field or fix it"));
        // MambaMixer2 of intermediate mamba_expand * hidden_size in heads of mamba_d_head
        // ("auto": intermediate / heads); GraniteMoeHybridConfig's defaults where absent, which
        // BambaConfig shares (128 heads, 1 group, d_state 256, d_conv 4, expand 2).
        const int expand = f.positive_int_or("mamba_expand", 2);
        const int64_t inner = int64_t{expand} * m.hidden;
        const int heads = f.positive_int_or("mamba_n_heads", 128);
        if (inner % heads != 0)
            throw f.bad("mamba_n_heads",
                        detail::concat("(", heads, ") must divide mamba_expand x hidden_size (",
                                       inner, ")"));
        int head = static_cast<int>(inner / heads);
        if (f.has("mamba_d_head") && !(f.json().at("mamba_d_head").is_string() &&
                                       f.string_or("mamba_d_head", "") == "auto")) {
            head = f.positive_int("mamba_d_head");
            if (int64_t{head} * heads != inner)
                throw f.bad(
                    "mamba_d_head",
                    detail::concat("x mamba_n_heads (", int64_t{head} * heads,
                                   ") must equal mamba_expand x hidden_size (", inner, ")"));
        }
        m.state.heads = heads;
        m.state.head_dim = head;
        m.state.groups = f.positive_int_or("mamba_n_groups", 1);
        m.state.group_dim = f.positive_int_or("mamba_d_state", 256);
        m.state.conv_kernel = f.positive_int_or("mamba_d_conv", 4);
    }
    const bool qwen3_5 = model_type.rfind("qwen3_5", 0) == 0;
    if (f.has("mamba_ssm_dtype") && !qwen3_5)
        throw f.bad("mamba_ssm_dtype", detail::concat("is set, but kvshard reads it for Qwen3.5 "
                                                      "only, not model_type '",
                                                      model_type, "'"));
    if (fam == Family::kFalconH1) read_falcon_h1(f, m, layers);
    if (fam == Family::kLongcat) read_longcat_flash(f, m, layers);
    if (fam == Family::kNemotronH || fam == Family::kQwen3Next || fam == Family::kGraniteHybrid ||
        fam == Family::kBamba || fam == Family::kJamba || fam == Family::kFalconH1) {
        // Granite 4.0-H, Bamba, Qwen3-Next, Falcon-H1 (FalconH1ForCausalLM.
        // get_mamba_state_dtype_from_config): vLLM's mamba2_state_dtype of the model dtype under
        // the engine's default 'auto' (no config override); Jamba: mamba1_state_dtype, the same
        // rule (_mamba_state_dtype).
        m.state.conv_dtype = m.state.state_dtype = m.kv_dtype;
        // Nemotron-H: vLLM's NemotronHForCausalLMConfig sets mamba_ssm_cache_dtype, while it is
        // 'auto', to the config's mamba_ssm_cache_dtype, else DEFAULT_MAMBA_SSM_CACHE_DTYPE =
        // "float32" ("only float32 is known to have no accuracy issues"; model_executor/models/
        // config.py, vLLM main since late 2025; v0.11 defaulted to float16, 2 bytes as bf16).
        if (fam == Family::kNemotronH) m.state.state_dtype = DType::kFp32;
        // Qwen3.5 names the recurrent state's dtype (float32 in the published checkpoints);
        // vLLM's Qwen3_5ForConditionalGenerationConfig makes it mamba_ssm_cache_dtype while that
        // is 'auto' (model_executor/models/config.py), the conv state staying at the model's.
        if (qwen3_5 && f.has("mamba_ssm_dtype")) {
            try {
                m.state.state_dtype = parse_dtype(f.string_or("mamba_ssm_dtype", ""));
            } catch (const Error& e) {
                throw f.bad("mamba_ssm_dtype", e.what());
            }
        }
        // Only Nemotron-H's config class reads the field (update_mamba_ssm_cache_dtype); for
        // the other families vLLM takes the engine's --mamba-ssm-cache-dtype, 'auto' by default,
        // whatever config.json says. A config naming it there is refused, as mamba_ssm_dtype
        // outside Qwen3.5: the reader does not guess which of the two the user means.
        if (fam != Family::kNemotronH && f.has("mamba_ssm_cache_dtype"))
            throw f.bad("mamba_ssm_cache_dtype",
                        detail::concat("is set, but vLLM reads it from config.json for Nemotron-H "
                                       "only; model_type '",
                                       model_type,
                                       "' keeps its SSM state in the engine's "
                                       "--mamba-ssm-cache-dtype (auto: the model dtype, as "
                                       "kvshard sizes it): remove the field"));
        if (f.has("mamba_ssm_cache_dtype")) {
            try {
                m.state.state_dtype = parse_dtype(f.string_or("mamba_ssm_cache_dtype", ""));
            } catch (const Error& e) {
                throw f.bad("mamba_ssm_cache_dtype", e.what());
            }
        }
    }

    if (fam == Family::kNemotronNas) {
        const auto& blocks = f.array("block_configs");
        if (static_cast<int>(blocks.size()) != L)
            throw f.bad("block_configs",
                        detail::concat("lists ", blocks.size(), " blocks but there are ", L));
        for (int l = 0; l < L; ++l) {
            const std::string where = detail::concat("block_configs[", l, "]");
            const auto& b = blocks[l];
            if (!b.is_object() || !b.contains("attention") || !b.contains("ffn"))
                throw f.bad(where, "must hold an attention and an ffn object");
            HfFields attn(b.at("attention"), detail::concat(file, ": ", where, ".attention"));
            HfFields ffn(b.at("ffn"), detail::concat(file, ": ", where, ".ffn"));
            for (const char* unmodelled : {"num_sink_tokens", "sparsify"})
                if (attn.has(unmodelled))
                    throw Error(detail::concat(file, ": ", where, ".attention: field '", unmodelled,
                                               "' is set, and kvshard does not model it"));
            LayerSpec& s = layers[l];
            if (attn.bool_or("no_op", false) || attn.bool_or("replace_with_linear", false)) {
                s.kind = LayerKind::kNoKv;
                s.num_kv_heads = s.head_dim = 0;
            } else {
                const int group = attn.positive_int("n_heads_in_group");
                if (m.num_heads % group != 0)
                    throw attn.bad("n_heads_in_group",
                                   detail::concat("(", group, ") must divide num_attention_heads (",
                                                  m.num_heads, ")"));
                s.num_kv_heads = m.num_heads / group;
                if (attn.has("window_length"))
                    set_window(s, LayerKind::kSlidingWindow, attn.positive_int("window_length"));
            }
            if (ffn.bool_or("no_op", false) || ffn.bool_or("replace_with_linear", false)) {
                s.mlp = MlpKind::kNone;
                s.intermediate = 0;
            } else {
                const double mult = ffn.number_or("ffn_mult", 0);
                if (!(mult > 0) || !std::isfinite(mult) || mult > 1e4)
                    throw ffn.bad("ffn_mult", "must be a positive number");
                s.mlp = MlpKind::kDense;
                s.intermediate = ffn_mult_to_intermediate(mult, m.hidden);
            }
        }
        // The uniform fields describe the first attention layer.
        for (const auto& s : layers)
            if (holds_tokens(s.kind)) {
                m.num_kv_heads = s.num_kv_heads;
                m.attention = m.num_kv_heads == m.num_heads ? AttentionKind::kMha
                              : m.num_kv_heads == 1         ? AttentionKind::kMqa
                                                            : AttentionKind::kGqa;
                break;
            }
    }

    if (f.has("indexer_types")) {
        // GLM-5.x names per layer whether it keeps its own indexer ("full") or reuses an earlier
        // layer's top-k ("shared", which would cache no indexer key): kvshard models the former.
        const auto& types = f.array("indexer_types");
        if (static_cast<int>(types.size()) != m.num_layers)
            throw f.bad("indexer_types",
                        detail::concat("lists ", types.size(), " layers but num_hidden_layers is ",
                                       m.num_layers));
        for (size_t l = 0; l < types.size(); ++l)
            if (!types[l].is_string() || types[l].get<std::string>() != "full")
                throw f.bad("indexer_types",
                            detail::concat("has ", types[l].dump(), " at layer ", l,
                                           ": kvshard models an indexer key on every layer "
                                           "(\"full\"); layers sharing another's indexer are "
                                           "not modelled"));
    }
    if (f.has("index_head_dim")) {  // DeepSeek-V3.2's sparse-attention indexer, on every layer
        if (!m.is_mla())
            throw f.bad("index_head_dim", "is set but the model has no MLA (kv_lora_rank)");
        m.indexer.head_dim = f.positive_int("index_head_dim");
        m.indexer.heads = f.positive_int("index_n_heads");
        m.indexer.topk = f.int_or("index_topk", 0);
        m.indexer.dtype = DType::kFp8;
        m.indexer.scale_bytes = 4 * ((m.indexer.head_dim + 127) / 128);  // one fp32 per 128
        for (auto& s : layers) s.indexer = true;
    }

    // A window the config states must reach some layer, unless the family switches it off
    // (Qwen2/3's use_sliding_window false).
    const bool qwen_gate = model_type.rfind("qwen", 0) == 0 || model_type == "mimo";
    // Ling and dots.llm1: read_full_attention_only refused any window that would reach a layer;
    // their window is off as it reads it, so a use_sliding_window true with sliding_window null
    // is refused here as for the other families. A Llama-field config's use_sliding_window false
    // switches it off as well (above).
    const bool window_off = (qwen_gate && (!f.bool_or("use_sliding_window", false) ||
                                           f.int_or("max_window_layers", 0) >= L)) ||
                            (fam == Family::kLlama && !f.bool_or("use_sliding_window", true)) ||
                            ((fam == Family::kBailing || fam == Family::kDots1) &&
                             full_attention_only_window_off(f, model_type));
    const bool any_sliding = std::any_of(layers.begin(), layers.end(), [](const LayerSpec& s) {
        return s.kind == LayerKind::kSlidingWindow;
    });
    if (f.has("sliding_window") && !window_off && !any_sliding)
        throw f.bad("sliding_window",
                    detail::concat("is set, but no layer of model_type '", model_type,
                                   "' slides under kvshard's reading of this config (set "
                                   "layer_types, or report the architecture)"));
    if (f.bool_or("use_sliding_window", false) && !any_sliding && !window_off)
        throw f.bad("use_sliding_window", "is true, but no layer slides (is sliding_window set?)");

    read_max_model_len(f, model_type, tokenizer_max_length, m);
    // MTP layers (ModelSpec::mtp), as vLLM builds its drafter: num_nextn_predict_layers of them
    // (DeepSeekMultiTokenPredictor, Glm4MoeMultiTokenPredictor), Qwen3.5's mtp_num_hidden_layers,
    // and one for Qwen3-Next, whose config names none (Qwen3NextMultiTokenPredictor:
    // getattr(config, "num_nextn_predict_layers", 1)). Each caches what the model's last attention
    // layer caches and has its MLP (MoE past first_k_dense_replace; Qwen3-Next's sparse step 1).
    int mtp_layers = f.int_or("num_nextn_predict_layers", 0);
    const char* mtp_key = "num_nextn_predict_layers";
    if (f.has("mtp_num_hidden_layers")) {
        mtp_layers = f.int_or("mtp_num_hidden_layers", 0);
        mtp_key = "mtp_num_hidden_layers";
    } else if (model_type == "qwen3_next" && !f.has("num_nextn_predict_layers")) {
        mtp_layers = 1;
    }
    if (mtp_layers < 0 || mtp_layers > 64)
        throw f.bad(mtp_key, detail::concat("must be in [0, 64], got ", mtp_layers));
    // MTP layers a checkpoint carries and this reader drops on purpose: mtp.not_modelled says
    // why, and speculation's refusal (compute_capacity) states it. The reasons, from vLLM's
    // SpeculativeConfig.hf_config_override (vllm/config/speculative.py), which picks the MTP
    // drafter by model_type / architectures[0]:
    //  - LongCat-Flash: it maps longcat_flash to longcat_flash_mtp, drafting with
    //    num_nextn_predict_layers (getattr default 1, the remote LongcatFlashConfig's default
    //    too); LongcatFlashForCausalLM itself skips the .mtp. weights. vLLM drafts; kvshard does
    //    not model MTP for a model of several cache layers per decoder layer.
    //  - Ling 1.x / 2.0 (bailing_moe, bailing_moe_v2): only the hybrid Ling 2.5 / 3
    //    (bailing_hybrid, BailingMoeV2_5ForCausalLM, BailingMoeV3ForCausalLM) map to a drafter;
    //    BailingMoeModel builds num_hidden_layers layers and skips the rest.
    //  - dots.llm1 (dots1): no mapping (dots3_note is another model).
    //  - GLM-4.5V / 4.6V (glm4v_moe): architectures[0] "Glm4MoeForCausalLM" maps to
    //    glm4_moe_mtp, and a glm4v_moe checkpoint's is Glm4vMoeForConditionalGeneration.
    //  - MiniMax-M2 (num_mtp_modules, use_mtp): minimax_m3 maps to MiniMaxM3MTP, minimax_m2 to
    //    nothing (MTPModelTypes lists no minimax_m2_mtp).
    auto no_drafter = [&](const std::string& model, const std::string& why) {
        return detail::concat("vLLM builds no drafter for ", model, ": ", why);
    };
    const char* kOverride = "vllm/config/speculative.py's SpeculativeConfig.hf_config_override";
    std::string not_modelled;
    if (fam == Family::kLongcat && (!f.json().contains("num_nextn_predict_layers") ||
                                    f.int_or("num_nextn_predict_layers", 0) > 0))
        not_modelled = detail::concat(
            "kvshard does not model LongCat-Flash's drafter (vLLM drafts with "
            "longcat_flash_mtp.py, to which ",
            kOverride,
            " maps longcat_flash), as it models no MTP layers for a model of several cache "
            "layers per decoder layer");
    else if (fam == Family::kBailing && mtp_layers > 0)
        not_modelled = no_drafter(
            detail::concat(model_type == "bailing_moe" ? "Ling 1.x" : "Ling 2.0", " (", model_type,
                           ")"),
            detail::concat(kOverride,
                           " maps only the hybrid Ling 2.5 / 3, bailing_hybrid, to an MTP "
                           "drafter; bailing_moe.py builds num_hidden_layers layers and skips the "
                           "rest"));
    else if (fam == Family::kDots1 && mtp_layers > 0)
        not_modelled = no_drafter("dots.llm1 (dots1)",
                                  detail::concat(kOverride, " maps no dots1 model to one"));
    else if (model_type.rfind("glm4v_moe", 0) == 0 && mtp_layers > 0)
        not_modelled = no_drafter(
            "GLM-4.5V / 4.6V (glm4v_moe)",
            detail::concat(kOverride,
                           " maps architectures[0] Glm4MoeForCausalLM to glm4_moe_mtp, and this "
                           "checkpoint's is Glm4vMoeForConditionalGeneration"));
    else if (model_type == "minimax_m2" &&
             (f.int_or("num_mtp_modules", 0) > 0 || f.bool_or("use_mtp", false)))
        not_modelled = no_drafter(
            "MiniMax-M2 (minimax_m2)",
            detail::concat(kOverride,
                           " maps minimax_m3 to MiniMaxM3MTP and nothing for minimax_m2; its "
                           "num_mtp_modules are not read"));
    if (fam == Family::kLongcat || fam == Family::kBailing || fam == Family::kDots1 ||
        model_type.rfind("glm4v_moe", 0) == 0)
        mtp_layers = 0;
    m.mtp.not_modelled = not_modelled;
    if (mtp_layers > 0) {
        const auto last = std::find_if(layers.rbegin(), layers.rend(), [](const LayerSpec& s) {
            return s.kind == LayerKind::kFullAttention || s.kind == LayerKind::kMla;
        });
        if (last == layers.rend())
            throw f.bad(mtp_key,
                        "is set, but no layer is full attention or MLA for kvshard to "
                        "model the MTP layers on");
        m.mtp.layers = mtp_layers;
        m.mtp.layer = *last;
        if (fam == Family::kDeepSeek) {
            // DeepSeekMultiTokenPredictorLayer.mtp_block is a DeepseekV2DecoderLayer of prefix
            // model.layers.{num_hidden_layers + i} (deepseek_mtp.py), so its MLP follows
            // moe_layer_freq at that index (first_k_dense_replace is below num_hidden_layers).
            const int freq = f.positive_int_or("moe_layer_freq", 1);
            auto moe_at = [&](int i) { return m.moe.enabled() && (L + i) % freq == 0; };
            for (int i = 1; i < mtp_layers; ++i)
                if (moe_at(i) != moe_at(0))
                    throw f.bad(
                        "moe_layer_freq",
                        detail::concat("is ", freq, ": vLLM's MTP layers ", L, " and ", L + i,
                                       " would differ in their MLP (MoE or dense), and "
                                       "kvshard models one kind of MTP layer"));
            m.mtp.layer.mlp = moe_at(0) ? MlpKind::kMoe : MlpKind::kDense;
            m.mtp.layer.intermediate = moe_at(0) ? 0 : m.intermediate;
        }
        if (model_type == "ernie4_5_moe") {
            // vLLM's ernie_mtp.py: ErnieMultiTokenPredictorLayer.mtp_block is a
            // LlamaDecoderLayer, whose MLP is the dense one of intermediate_size.
            m.mtp.layer.mlp = MlpKind::kDense;
            m.mtp.layer.intermediate = m.intermediate;
        }
        m.mtp.proj_split_by_tp = fam == Family::kQwen3Next;  // fc: ColumnParallelLinear
        if (fam == Family::kNemotronH) read_nemotron_h_mtp(f, mtp_layers, m);
    }

    read_norms_and_biases(f, fam, model_type, m);
    m.layers = std::move(layers);
    if (m.uniform()) m.layers.clear();
    try {
        m.validate();
    } catch (const Error& e) {
        throw Error(detail::concat(file, ": ", e.what()));
    }
    return m;
}

}  // namespace kvshard
