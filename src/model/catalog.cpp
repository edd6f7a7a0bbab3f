#include "kvshard/model/catalog.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

ModelSpec dense(std::string name, int layers, int hidden, int heads, int kv_heads, int head_dim,
                int intermediate, int vocab, double rope_theta) {
    ModelSpec m;
    m.name = std::move(name);
    m.num_layers = layers;
    m.hidden = hidden;
    m.num_heads = heads;
    m.num_kv_heads = kv_heads;
    m.head_dim = head_dim;
    m.intermediate = intermediate;
    m.vocab = vocab;
    m.attention = kv_heads == heads ? AttentionKind::kMha
                  : kv_heads == 1   ? AttentionKind::kMqa
                                    : AttentionKind::kGqa;
    m.rope_theta = rope_theta;
    return m;
}

// The length a published config.json states (max_position_embeddings; ModelSpec::max_model_len).
ModelSpec with_max_len(ModelSpec m, int64_t tokens, std::string from = "") {
    m.max_model_len = tokens;
    m.max_model_len_from =
        from.empty() ? detail::concat("max_position_embeddings ", tokens) : std::move(from);
    return m;
}

// A catalog entry read from the KV- and weight-relevant fields of a published config.json
// (tests/data/hf_configs/ holds the whole files and their sources), through the same reader as a
// user's file.
ModelSpec from_config(std::string name, const char* json) {
    ModelSpec m = parse_hf_config(json, "catalog:" + name);
    m.name = std::move(name);
    return m;
}

// Test models with per-layer kinds: fp32 so that sharded and unsharded runs compare tightly.
ModelSpec tiny_swa() {
    // Alternating window-8 (with gpt-oss-style learned sinks) and full layers.
    ModelSpec m = dense("tiny-swa", 4, 64, 8, 4, 8, 128, 256, 10000);
    m.kv_dtype = m.weight_dtype = DType::kFp32;
    const ModelSpec uniform = m;
    for (int l = 0; l < m.num_layers; ++l) {
        LayerSpec s = uniform.layer(l);
        if (l % 2 == 0) {
            s.kind = LayerKind::kSlidingWindow;
            s.window = 8;
        }
        s.learned_sinks = true;
        m.layers.push_back(s);
    }
    return m;
}

ModelSpec tiny_hybrid() {
    // Three Gated DeltaNet layers, then one full-attention layer (Qwen3-Next's 3:1 mix).
    ModelSpec m = dense("tiny-hybrid", 4, 64, 8, 4, 8, 128, 256, 10000);
    m.kv_dtype = m.weight_dtype = DType::kFp32;
    m.state = {.heads = 4,
               .head_dim = 8,
               .groups = 2,
               .group_dim = 8,
               .conv_kernel = 4,
               .conv_dtype = DType::kFp32,
               .state_dtype = DType::kFp32};
    const ModelSpec uniform = m;
    for (int l = 0; l < m.num_layers; ++l) {
        LayerSpec s = uniform.layer(l);
        if ((l + 1) % 4 != 0) s.kind = LayerKind::kGatedDeltaNet;
        m.layers.push_back(s);
    }
    return m;
}

// Published configs (../shared/reference/models.md, from each model's config.json).
const std::map<std::string, std::function<ModelSpec()>, std::less<>>& catalog() {
    static const std::map<std::string, std::function<ModelSpec()>, std::less<>> kCatalog = {
        {"llama-3.1-8b",
         [] {
             return with_max_len(dense("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 500000),
                                 131072);
         }},
        {"llama-3.1-70b",
         [] {
             return with_max_len(
                 dense("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, 500000), 131072);
         }},
        {"llama-3.1-405b",
         [] {
             return with_max_len(
                 dense("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, 500000), 131072);
         }},
        {"llama-65b",
         [] {
             auto m = dense("llama-65b", 80, 8192, 64, 64, 128, 22016, 32000, 10000);
             m.rms_norm_eps = 1e-6;
             m = with_max_len(std::move(m), 2048);
             return m;
         }},
        {"qwen2.5-72b",
         [] {
             auto m = dense("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, 1000000);
             m.norms.qkv_bias = true;  // Qwen2Attention: q, k, v biases (vLLM qwen2.py)
             m.rms_norm_eps = 1e-6;
             m = with_max_len(std::move(m), 32768);
             return m;
         }},
        {"qwen3-235b-a22b",
         [] {
             auto m = dense("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 12288, 151936, 1000000);
             m.norms.qk = QkNorm::kPerHead;  // Qwen3MoeAttention's q_norm / k_norm (head_dim)
             m.moe = {.num_experts = 128,
                      .experts_per_token = 8,
                      .shared_experts = 0,
                      .expert_intermediate = 1536,
                      .first_dense_layers = 0};
             // vLLM's Qwen3MoeSparseMoeBlock (qwen3_moe.py) raises on tp above the experts, as the
             // config reader sets for qwen3_moe.
             m.moe.tp_at_most_experts = true;
             m.rms_norm_eps = 1e-6;
             m = with_max_len(std::move(m), 40960);
             return m;
         }},
        {"mixtral-8x7b",
         [] {
             auto m = dense("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, 1000000);
             m.moe = {.num_experts = 8,
                      .experts_per_token = 2,
                      .shared_experts = 0,
                      .expert_intermediate = 14336,
                      .first_dense_layers = 0};
             m = with_max_len(std::move(m), 32768);
             return m;
         }},
        {"deepseek-v3",
         [] {
             auto m = dense("deepseek-v3", 61, 7168, 128, 128, 192, 18432, 129280, 10000);
             m.attention = AttentionKind::kMla;
             m.mla = {.kv_lora_rank = 512,
                      .qk_rope_head_dim = 64,
                      .qk_nope_head_dim = 128,
                      .v_head_dim = 128,
                      .q_lora_rank = 1536};
             m.moe = {.num_experts = 256,
                      .experts_per_token = 8,
                      .shared_experts = 1,
                      .expert_intermediate = 2048,
                      .first_dense_layers = 3};
             m.rms_norm_eps = 1e-6;
             m.norms.router_bias = true;  // topk_method noaux_tc: e_score_correction_bias
             // The published checkpoint's quantization_config: fp8 e4m3 with one fp32 scale per
             // 128 x 128 block (dynamic fp8 activations).
             const double fp8_block = 8 + 32.0 / (128 * 128);
             m.weight_storage = {"fp8", fp8_block, fp8_block, fp8_block, true};
             m = with_max_len(
                 std::move(m), 163840,
                 "original_max_position_embeddings 4096 x rope_scaling yarn factor 40");
             // num_nextn_predict_layers 1: one MTP layer, an MLA decoder layer with the MoE.
             m.mtp.layers = 1;
             m.mtp.layer = m.layer(m.num_layers - 1);
             return m;
         }},
        // Per-layer models, from their published config.json (tests/data/hf_configs/).
        {"gpt-oss-120b",
         [] {
             return from_config("gpt-oss-120b", R"({"model_type": "gpt_oss",
                 "max_position_embeddings": 131072, "num_hidden_layers": 36, "hidden_size": 2880, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                 "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
                 "vocab_size": 201088, "sliding_window": 128, "rope_theta": 150000,
                 "rms_norm_eps": 1e-05, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "full_attention"], "quantization_config": {"quant_method": "mxfp4",
                 "modules_to_not_convert": ["model.layers.*.self_attn",
                 "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}})");
         }},
        {"gemma-3-27b",
         [] {
             return from_config("gemma-3-27b", R"({"model_type": "gemma3",
                 "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62,
                 "hidden_size": 5376, "num_attention_heads": 32, "num_key_value_heads": 16,
                 "head_dim": 128, "intermediate_size": 21504, "sliding_window": 1024,
                 "query_pre_attn_scalar": 168, "rope_theta": 1000000.0},
                 "torch_dtype": "bfloat16"})");
         }},
        {"mistral-7b-v0.1",
         [] {
             return from_config("mistral-7b-v0.1", R"({"model_type": "mistral",
                 "max_position_embeddings": 32768, "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                 "sliding_window": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-05,
                 "torch_dtype": "bfloat16"})");
         }},
        {"qwen3-next-80b-a3b",
         [] {
             return from_config("qwen3-next-80b-a3b", R"({"model_type": "qwen3_next",
                 "max_position_embeddings": 262144, "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 16,
                 "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120,
                 "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                 "shared_expert_intermediate_size": 512, "full_attention_interval": 4,
                 "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                 "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                 "linear_value_head_dim": 128, "vocab_size": 151936, "rope_theta": 10000000,
                 "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16"})");
         }},
        // Qwen3.5 (and 3.6): Qwen3-Next's layers; the recurrent state at float32
        // (mamba_ssm_dtype, as vLLM sizes it). tests/data/hf_configs/qwen3.5-35b-a3b.json.
        {"qwen3.5-35b-a3b",
         [] {
             return from_config("qwen3.5-35b-a3b", R"({"model_type": "qwen3_5_moe_text",
                 "max_position_embeddings": 262144, "num_hidden_layers": 40, "hidden_size": 2048, "num_attention_heads": 16,
                 "num_key_value_heads": 2, "head_dim": 256, "num_experts": 256,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                 "shared_expert_intermediate_size": 512, "full_attention_interval": 4,
                 "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                 "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                 "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
                 "mtp_num_hidden_layers": 1, "vocab_size": 248320, "rope_theta": 10000000, "rms_norm_eps": 1e-06,
                 "tie_word_embeddings": false})");
         }},
        // GLM-4.5-Air: 96 query heads of 128, 8 KV heads; 128 routed + 1 shared expert.
        {"glm-4.5-air",
         [] {
             return from_config("glm-4.5-air", R"({"model_type": "glm4_moe",
                 "max_position_embeddings": 131072, "num_hidden_layers": 46, "hidden_size": 4096, "num_attention_heads": 96,
                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944,
                 "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
                 "num_nextn_predict_layers": 1, "vocab_size": 151552, "rope_theta": 1000000, "rms_norm_eps": 1e-05,
                 "attention_bias": true, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})");
         }},
        // MiniMax-M2: full attention on all 62 layers, 256 experts of 1536.
        {"minimax-m2",
         [] {
             return from_config("minimax-m2", R"({"model_type": "minimax_m2",
                 "max_position_embeddings": 196608, "num_hidden_layers": 62, "hidden_size": 3072, "num_attention_heads": 48,
                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 1536,
                 "num_local_experts": 256, "num_experts_per_tok": 8, "use_routing_bias": true, "vocab_size": 200064,
                 "rope_theta": 5000000, "rms_norm_eps": 1e-06, "tie_word_embeddings": false,
                 "num_mtp_modules": 3, "use_mtp": true, "torch_dtype": "bfloat16"})");
         }},
        {"deepseek-v3.2",
         [] {
             return from_config("deepseek-v3.2", R"({"model_type": "deepseek_v32",
                 "max_position_embeddings": 163840, "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
                 "num_key_value_heads": 128, "intermediate_size": 18432,
                 "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                 "num_experts_per_tok": 8, "first_k_dense_replace": 3, "topk_method": "noaux_tc",
                 "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                 "v_head_dim": 128, "index_head_dim": 128, "index_n_heads": 64,
                 "index_topk": 2048, "num_nextn_predict_layers": 1, "vocab_size": 129280,
                 "rms_norm_eps": 1e-06,
                 "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme":
                 "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                 "weight_block_size": [128, 128]}})");
         }},
        {"llama-4-scout",
         [] {
             return from_config("llama-4-scout", R"({"model_type": "llama4",
                 "text_config": {"model_type": "llama4_text", "max_position_embeddings": 262144, "num_hidden_layers": 48,
                 "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                 "num_local_experts": 16, "num_experts_per_tok": 1,
                 "interleave_moe_layer_step": 1, "attention_chunk_size": 8192,
                 "no_rope_layer_interval": 4, "vocab_size": 202048, "rope_theta": 500000.0,
                 "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16"},
                 "tie_word_embeddings": false})");
         }},
        {"nemotron-h-8b",
         [] {
             return from_config("nemotron-h-8b", R"({"model_type": "nemotron_h",
                 "max_position_embeddings": 8192, "num_hidden_layers": 52, "hidden_size": 4096, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "attention_head_dim": 128, "intermediate_size": 21504,
                 "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                 "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
                 "ssm_state_size": 128, "conv_kernel": 4, "vocab_size": 131072,
                 "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
                 "torch_dtype": "bfloat16"})");
         }},
        // Gemma-4-31B: 5 sliding layers (16 KV heads of 256, window 1024) to 1 full layer (4 KV
        // heads of 512: attention_k_eq_v); tests/data/hf_configs/gemma-4-31b.json.
        {"gemma-4-31b",
         [] {
             return from_config("gemma-4-31b", R"({"model_type": "gemma4_text",
                 "max_position_embeddings": 262144, "num_hidden_layers": 60, "hidden_size": 5376, "num_attention_heads": 32,
                 "num_key_value_heads": 16, "num_global_key_value_heads": 4,
                 "attention_k_eq_v": true, "head_dim": 256, "global_head_dim": 512,
                 "intermediate_size": 21504, "sliding_window": 1024,
                 "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                 "vocab_size": 262144, "rms_norm_eps": 1e-06, "tie_word_embeddings": true,
                 "torch_dtype": "bfloat16"})");
         }},
        // Granite-4.0-H-Tiny: 36 Mamba-2 and 4 attention layers, MoE of 64 experts plus a shared
        // MLP on every layer; tests/data/hf_configs/granite-4.0-h-tiny.json.
        {"granite-4.0-h-tiny",
         [] {
             std::string types;
             for (int l = 0; l < 40; ++l)
                 types +=
                     detail::concat(l ? ", " : "", l % 10 == 5 ? "\"attention\"" : "\"mamba\"");
             const std::string json = detail::concat(R"({"model_type": "granitemoehybrid",
                 "max_position_embeddings": 131072, "num_hidden_layers": 40, "hidden_size": 1536, "num_attention_heads": 12,
                 "num_key_value_heads": 4, "intermediate_size": 512,
                 "shared_intermediate_size": 1024, "num_local_experts": 64,
                 "num_experts_per_tok": 6, "mamba_n_heads": 48, "mamba_d_head": 64,
                 "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
                 "vocab_size": 100352, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
                 "layer_types": [)",
                                                     types, "]}");
             return from_config("granite-4.0-h-tiny", json.c_str());
         }},
        // Test models: fp32 everywhere so that sharded and unsharded runs compare tightly.
        // tiny: 8 query heads, 4 KV heads, so tp=8 replicates every KV head on 2 ranks.
        {"tiny",
         [] {
             auto m = dense("tiny", 4, 64, 8, 4, 8, 128, 256, 10000);
             m.kv_dtype = m.weight_dtype = DType::kFp32;
             return m;
         }},
        {"tiny-moe",
         [] {
             auto m = dense("tiny-moe", 4, 64, 8, 4, 8, 128, 256, 10000);
             m.moe = {.num_experts = 8,
                      .experts_per_token = 2,
                      .shared_experts = 0,
                      .expert_intermediate = 64,
                      .first_dense_layers = 0};
             m.kv_dtype = m.weight_dtype = DType::kFp32;
             return m;
         }},
        {"tiny-mla",
         [] {
             auto m = dense("tiny-mla", 2, 64, 8, 8, 16, 128, 256, 10000);
             m.attention = AttentionKind::kMla;
             m.mla = {.kv_lora_rank = 32,
                      .qk_rope_head_dim = 8,
                      .qk_nope_head_dim = 8,
                      .v_head_dim = 8,
                      .q_lora_rank = 0};
             m.kv_dtype = m.weight_dtype = DType::kFp32;
             return m;
         }},
        {"tiny-swa", tiny_swa},
        {"tiny-hybrid", tiny_hybrid},
        // ~125M parameters: the benchmark model.
        {"small-100m",
         [] {
             auto m = dense("small-100m", 12, 768, 12, 4, 64, 2048, 32000, 10000);
             m.kv_dtype = m.weight_dtype = DType::kFp32;
             return m;
         }},
    };
    return kCatalog;
}

std::string known_names() {
    std::string s;
    for (const auto& [name, _] : catalog()) s += (s.empty() ? "" : ", ") + name;
    return s;
}

}  // namespace

std::vector<std::string> catalog_names() {
    std::vector<std::string> names;
    for (const auto& [name, _] : catalog()) names.push_back(name);
    return names;
}

bool in_catalog(std::string_view name) { return catalog().find(name) != catalog().end(); }

ModelSpec catalog_model(std::string_view name) {
    auto it = catalog().find(name);
    if (it == catalog().end())
        throw Error(
            detail::concat("unknown model '", name, "': expected one of ", known_names(),
                           ", a path to a Hugging Face config.json, or a directory holding one"));
    ModelSpec m = it->second();
    m.validate();
    return m;
}

namespace {

// model_max_length of the tokenizer_config.json beside a config.json; 0 when there is none or it
// states none (a number is required when the field is there).
double tokenizer_max_length(const std::string& config_path) {
    const auto tok = std::filesystem::path(config_path).parent_path() / "tokenizer_config.json";
    std::error_code ec;
    if (!std::filesystem::is_regular_file(tok, ec)) return 0;
    std::ifstream in(tok);
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
        throw Error(detail::concat(tok.string(), ": not valid JSON (", e.what(), ")"));
    }
    if (!j.is_object() || !j.contains("model_max_length") || j.at("model_max_length").is_null())
        return 0;
    const auto& v = j.at("model_max_length");
    if (!v.is_number() || !(v.get<double>() >= 1))
        throw Error(detail::concat(tok.string(),
                                   ": model_max_length must be a positive number, got ", v.dump()));
    return v.get<double>();
}

}  // namespace

ModelSpec load_hf_config(const std::string& path) {
    std::ifstream in(path);
    if (!in)
        throw Error(
            detail::concat("cannot open '", path, "': expected a Hugging Face config.json"));
    std::stringstream ss;
    ss << in.rdbuf();
    ModelSpec m = parse_hf_config(ss.str(), path, tokenizer_max_length(path));
    if (m.name == "hf-model" || m.name.empty()) {
        auto parent = std::filesystem::path(path).parent_path().filename().string();
        if (!parent.empty()) m.name = parent;
    }
    return m;
}

ModelSpec resolve_model(const std::string& name_or_path) {
    if (in_catalog(name_or_path)) return catalog_model(name_or_path);
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::is_directory(name_or_path, ec)) {
        auto cfg = fs::path(name_or_path) / "config.json";
        if (!fs::exists(cfg, ec))
            throw Error(
                detail::concat("directory '", name_or_path,
                               "' has no config.json: expected a Hugging Face model directory"));
        return load_hf_config(cfg.string());
    }
    if (fs::is_regular_file(name_or_path, ec)) return load_hf_config(name_or_path);
    return catalog_model(name_or_path);  // throws with the list of known names
}

}  // namespace kvshard
