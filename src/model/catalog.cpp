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
