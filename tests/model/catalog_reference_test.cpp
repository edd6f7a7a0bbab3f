// The catalog against ../shared/reference/models.md, and the Hugging Face field names of each
// family.
#include <gtest/gtest.h>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

struct Row {
    const char* name;
    int layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
    AttentionKind attention;
    int experts, per_token;
};

// name | layers | hidden | H | H_kv | d | intermediate (dense, or MoE expert width) | vocab
const Row kReference[] = {
    {"llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, AttentionKind::kGqa, 0, 0},
    {"llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, AttentionKind::kGqa, 0, 0},
    {"llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, AttentionKind::kGqa, 0, 0},
    {"llama-65b", 80, 8192, 64, 64, 128, 22016, 32000, AttentionKind::kMha, 0, 0},
    {"qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, AttentionKind::kGqa, 0, 0},
    {"qwen3-235b-a22b", 94, 4096, 64, 4, 128, 1536, 151936, AttentionKind::kGqa, 128, 8},
    {"mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, AttentionKind::kGqa, 8, 2},
};

TEST(CatalogReference, PublishedConfigs) {
    for (const Row& r : kReference) {
        SCOPED_TRACE(r.name);
        const ModelSpec m = catalog_model(r.name);
        EXPECT_EQ(m.num_layers, r.layers);
        EXPECT_EQ(m.hidden, r.hidden);
        EXPECT_EQ(m.num_heads, r.heads);
        EXPECT_EQ(m.num_kv_heads, r.kv_heads);
        EXPECT_EQ(m.head_dim, r.head_dim);
        EXPECT_EQ(m.vocab, r.vocab);
        EXPECT_EQ(m.attention, r.attention);
        EXPECT_EQ(m.moe.num_experts, r.experts);
        EXPECT_EQ(m.moe.experts_per_token, r.per_token);
        EXPECT_EQ(r.experts ? m.moe.expert_intermediate : m.intermediate, r.intermediate);
        EXPECT_FALSE(m.tie_embeddings);
        EXPECT_EQ(m.kv_dtype, DType::kBf16);
        // Engine KV bytes per token (models.md): 2 * H_kv * d * e per layer.
        EXPECT_EQ(m.kv_elems_per_token_per_layer(), 2 * r.kv_heads * r.head_dim);
    }
    const ModelSpec ds = catalog_model("deepseek-v3");
    EXPECT_EQ(ds.num_layers, 61);
    EXPECT_EQ(ds.hidden, 7168);
    EXPECT_EQ(ds.num_heads, 128);
    EXPECT_EQ(ds.intermediate, 18432);
    EXPECT_EQ(ds.vocab, 129280);
    EXPECT_EQ(ds.mla, (MlaSpec{512, 64, 128, 128, 1536}));
    EXPECT_EQ(ds.moe, (MoeSpec{256, 8, 1, 2048, 3}));
    EXPECT_FALSE(ds.is_moe_layer(2));
    EXPECT_TRUE(ds.is_moe_layer(3));
    EXPECT_EQ(ds.num_moe_layers(), 58);
    // Published totals: Mixtral 46.7B, Qwen3-235B-A22B 235B total / 22B active, Llama 3.1
    // 70B 70.6B.
    EXPECT_NEAR(catalog_model("mixtral-8x7b").total_params() / 1e9, 46.7, 0.1);
    EXPECT_NEAR(catalog_model("qwen3-235b-a22b").total_params() / 1e9, 235.1, 0.5);
    // Published "22B activated" also counts the input embedding (0.62B), which is a lookup here.
    EXPECT_NEAR(catalog_model("qwen3-235b-a22b").active_params_per_token() / 1e9, 22.2 - 0.62, 0.3);
    EXPECT_NEAR(catalog_model("llama-3.1-70b").total_params() / 1e9, 70.6, 0.1);
    EXPECT_NEAR(ds.active_params_per_token() / 1e9, 37.5, 1.5);  // "37B activated"
}

TEST(CatalogReference, EveryCatalogModelValidates) {
    for (const auto& n : catalog_names()) {
        EXPECT_TRUE(in_catalog(n));
        EXPECT_NO_THROW(catalog_model(n).validate()) << n;
        EXPECT_EQ(catalog_model(n).name, n);
    }
    EXPECT_FALSE(in_catalog("llama-4"));
}

TEST(HfFamilies, Mixtral) {
    const auto m =
        parse_hf_config(R"({"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "torch_dtype": "bfloat16"})",
                        "mixtral/config.json");
    const auto ref = catalog_model("mixtral-8x7b");
    EXPECT_EQ(m.moe, ref.moe);
    EXPECT_EQ(m.total_params(), ref.total_params());
}

TEST(HfFamilies, Qwen3MoeWithExplicitHeadDim) {
    // Qwen3 sets head_dim = 128 although hidden / heads = 64.
    const auto m =
        parse_hf_config(R"({"model_type": "qwen3_moe", "num_hidden_layers": 94, "hidden_size": 4096,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"})",
                        "qwen3/config.json");
    const auto ref = catalog_model("qwen3-235b-a22b");
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_EQ(m.moe, ref.moe);
    EXPECT_EQ(m.kv_elems_per_token_per_layer(), ref.kv_elems_per_token_per_layer());
    EXPECT_EQ(m.total_params(), ref.total_params());
    // Qwen3 dense models write "num_experts": 0 or omit it: dense.
    const auto dense =
        parse_hf_config(R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100, "num_experts": 0})",
                        "qwen3-dense/config.json");
    EXPECT_FALSE(dense.moe.enabled());
    EXPECT_EQ(dense.attention, AttentionKind::kMha);  // no num_key_value_heads: MHA
}

TEST(HfFamilies, DeepSeekV3) {
    const auto m = parse_hf_config(
        R"({"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
        "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "topk_method": "noaux_tc", "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280, "torch_dtype": "bfloat16"})",
        "deepseek/config.json");
    const auto ref = catalog_model("deepseek-v3");
    EXPECT_TRUE(m.is_mla());
    EXPECT_EQ(m.mla, ref.mla);
    EXPECT_EQ(m.moe, ref.moe);
    EXPECT_EQ(m.kv_elems_per_token_per_layer(), 512 + 64);
    EXPECT_EQ(m.total_params(), ref.total_params());
    // DeepSeek-V2-Lite style: q_lora_rank null means queries come straight from the hidden state.
    const auto lite =
        parse_hf_config(R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100, "kv_lora_rank": 16, "q_lora_rank": null,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8})",
                        "lite/config.json");
    EXPECT_EQ(lite.mla.q_lora_rank, 0);
}

TEST(HfFamilies, BadFieldsAreNamed) {
    auto expect = [](const char* json, const char* needle) {
        try {
            parse_hf_config(json, "cfg.json");
            ADD_FAILURE() << "accepted " << json;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("cfg.json"), std::string::npos) << e.what();
        }
    };
    const char* base_ok = R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100})";
    EXPECT_NO_THROW(parse_hf_config(base_ok, "cfg.json"));
    expect(
        R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100})",
        "missing field 'intermediate_size'");
    expect(
        R"({"num_hidden_layers": -2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8,
        "vocab_size": 100})",
        "'num_hidden_layers' must be a positive integer");
    expect(
        R"({"num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6, "intermediate_size": 8,
        "vocab_size": 100, "num_key_value_heads": 4})",
        "must be a multiple of num_key_value_heads");
    expect(
        R"({"num_hidden_layers": 2, "hidden_size": 65, "num_attention_heads": 4, "intermediate_size": 8,
        "vocab_size": 100})",
        "'head_dim' is missing");
    expect(
        R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8,
        "vocab_size": 100, "torch_dtype": "int3"})",
        "int3");
    expect(
        R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8,
        "vocab_size": 100, "num_local_experts": 8})",
        "missing field 'num_experts_per_tok'");
    expect(
        R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8,
        "vocab_size": 100, "kv_lora_rank": 16})",
        "missing field 'qk_rope_head_dim'");
    expect(
        R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8,
        "vocab_size": 100, "rope_theta": "big"})",
        "'rope_theta' must be a number");
    expect("[]", "JSON object");
    expect("{", "not valid JSON");
    EXPECT_THROW(load_hf_config("/nonexistent/config.json"), Error);
    EXPECT_THROW(resolve_model("/tmp"), Error);  // a directory without config.json
}

}  // namespace
}  // namespace kvshard
