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

// Published configs (../shared/reference/models.md, from each model's config.json).
const std::map<std::string, std::function<ModelSpec()>, std::less<>>& catalog() {
    static const std::map<std::string, std::function<ModelSpec()>, std::less<>> kCatalog = {
        {"llama-3.1-8b",
         [] { return dense("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 500000); }},
        {"llama-3.1-70b",
         [] { return dense("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, 500000); }},
        {"llama-3.1-405b",
         [] { return dense("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, 500000); }},
        {"llama-65b",
         [] {
             auto m = dense("llama-65b", 80, 8192, 64, 64, 128, 22016, 32000, 10000);
             m.rms_norm_eps = 1e-6;
             return m;
         }},
        {"qwen2.5-72b",
         [] {
             auto m = dense("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, 1000000);
             m.rms_norm_eps = 1e-6;
             return m;
         }},
        {"qwen3-235b-a22b",
         [] {
             auto m = dense("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 12288, 151936, 1000000);
             m.moe = {.num_experts = 128,
                      .experts_per_token = 8,
                      .shared_experts = 0,
                      .expert_intermediate = 1536,
                      .first_dense_layers = 0};
             m.rms_norm_eps = 1e-6;
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
             return m;
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

// ---- Hugging Face config.json --------------------------------------------------------------

class HfFields {
  public:
    HfFields(const nlohmann::json& j, std::string file) : j_(j), file_(std::move(file)) {}

    bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

    int positive_int(const char* key) const {
        if (!has(key)) throw Error(detail::concat(file_, ": missing field '", key, "'"));
        return positive_int_value(key);
    }
    int positive_int_or(const char* key, int fallback) const {
        return has(key) ? positive_int_value(key) : fallback;
    }
    int int_or(const char* key, int fallback) const {
        if (!has(key)) return fallback;
        const auto& v = j_.at(key);
        if (!v.is_number_integer() || v.get<int64_t>() < 0)
            throw Error(detail::concat(file_, ": field '", key,
                                       "' must be a non-negative integer, got ", v.dump()));
        return v.get<int>();
    }
    double number_or(const char* key, double fallback) const {
        if (!has(key)) return fallback;
        const auto& v = j_.at(key);
        if (!v.is_number())
            throw Error(
                detail::concat(file_, ": field '", key, "' must be a number, got ", v.dump()));
        return v.get<double>();
    }
    bool bool_or(const char* key, bool fallback) const {
        if (!has(key)) return fallback;
        const auto& v = j_.at(key);
        if (!v.is_boolean())
            throw Error(
                detail::concat(file_, ": field '", key, "' must be true or false, got ", v.dump()));
        return v.get<bool>();
    }
    std::string string_or(const char* key, std::string fallback) const {
        if (!has(key)) return fallback;
        const auto& v = j_.at(key);
        if (!v.is_string())
            throw Error(
                detail::concat(file_, ": field '", key, "' must be a string, got ", v.dump()));
        return v.get<std::string>();
    }

  private:
    int positive_int_value(const char* key) const {
        const auto& v = j_.at(key);
        if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > (1LL << 31) - 1)
            throw Error(detail::concat(file_, ": field '", key,
                                       "' must be a positive integer, got ", v.dump()));
        return v.get<int>();
    }
    const nlohmann::json& j_;
    std::string file_;
};

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

ModelSpec parse_hf_config(std::string_view json_text, const std::string& file) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(json_text);
    } catch (const nlohmann::json::exception& e) {
        throw Error(detail::concat(file, ": not valid JSON (", e.what(), ")"));
    }
    if (!j.is_object())
        throw Error(detail::concat(file, ": expected a JSON object at the top level"));
    HfFields f(j, file);

    ModelSpec m;
    m.name = f.string_or("_name_or_path", f.string_or("model_type", "hf-model"));
    m.num_layers = f.positive_int("num_hidden_layers");
    m.hidden = f.positive_int("hidden_size");
    m.num_heads = f.positive_int("num_attention_heads");
    m.num_kv_heads = f.positive_int_or("num_key_value_heads", m.num_heads);  // absent: MHA
    m.vocab = f.positive_int("vocab_size");
    m.rope_theta = f.number_or("rope_theta", 10000.0);
    m.rms_norm_eps = f.number_or("rms_norm_eps", 1e-6);
    m.tie_embeddings = f.bool_or("tie_word_embeddings", false);
    const std::string torch_dtype = f.string_or("torch_dtype", "bfloat16");
    try {
        m.weight_dtype = parse_dtype(torch_dtype);
    } catch (const Error& e) {
        throw Error(detail::concat(file, ": field 'torch_dtype': ", e.what()));
    }
    m.kv_dtype = m.weight_dtype;

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
        if (m.hidden % m.num_heads != 0 && !f.has("head_dim"))
            throw Error(detail::concat(file, ": field 'head_dim' is missing and hidden_size (",
                                       m.hidden, ") is not divisible by num_attention_heads (",
                                       m.num_heads, ")"));
        m.head_dim = f.positive_int_or("head_dim", m.hidden / m.num_heads);
        if (m.num_heads % m.num_kv_heads != 0)
            throw Error(detail::concat(file, ": num_attention_heads (", m.num_heads,
                                       ") must be a multiple of num_key_value_heads (",
                                       m.num_kv_heads, ")"));
        m.attention = m.num_kv_heads == m.num_heads ? AttentionKind::kMha
                      : m.num_kv_heads == 1         ? AttentionKind::kMqa
                                                    : AttentionKind::kGqa;
    }

    if (f.has("num_local_experts")) {  // Mixtral
        m.moe.num_experts = f.positive_int("num_local_experts");
        m.moe.experts_per_token = f.positive_int("num_experts_per_tok");
        m.moe.expert_intermediate = f.positive_int("intermediate_size");
    } else if (f.has("n_routed_experts")) {  // DeepSeek-V3
        m.moe.num_experts = f.positive_int("n_routed_experts");
        m.moe.shared_experts = f.int_or("n_shared_experts", 0);
        m.moe.experts_per_token = f.positive_int("num_experts_per_tok");
        m.moe.expert_intermediate = f.positive_int("moe_intermediate_size");
        m.moe.first_dense_layers = f.int_or("first_k_dense_replace", 0);
    } else if (f.has("num_experts") && f.int_or("num_experts", 0) > 0) {  // Qwen3-MoE
        m.moe.num_experts = f.positive_int("num_experts");
        m.moe.experts_per_token = f.positive_int("num_experts_per_tok");
        m.moe.expert_intermediate = f.positive_int("moe_intermediate_size");
    }
    const bool needs_dense = !m.moe.enabled() || m.moe.first_dense_layers > 0;
    m.intermediate = needs_dense
                         ? f.positive_int("intermediate_size")
                         : f.positive_int_or("intermediate_size", m.moe.expert_intermediate);
    try {
        m.validate();
    } catch (const Error& e) {
        throw Error(detail::concat(file, ": ", e.what()));
    }
    return m;
}

ModelSpec load_hf_config(const std::string& path) {
    std::ifstream in(path);
    if (!in)
        throw Error(
            detail::concat("cannot open '", path, "': expected a Hugging Face config.json"));
    std::stringstream ss;
    ss << in.rdbuf();
    ModelSpec m = parse_hf_config(ss.str(), path);
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
