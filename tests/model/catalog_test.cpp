#include <gtest/gtest.h>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

TEST(Catalog, PublishedModelsMatchReference) {
    const auto m = catalog_model("llama-3.1-70b");
    EXPECT_EQ(m.num_layers, 80);
    EXPECT_EQ(m.num_kv_heads, 8);
    EXPECT_EQ(m.kv_elems_per_token_per_layer(), 2 * 8 * 128);
    const auto ds = catalog_model("deepseek-v3");
    EXPECT_TRUE(ds.is_mla());
    EXPECT_EQ(ds.kv_elems_per_token_per_layer(), 512 + 64);
    // DeepSeek-V3 is published as 671B parameters.
    EXPECT_NEAR(ds.total_params() / 1e9, 671.0, 1.0);
    EXPECT_NEAR(catalog_model("llama-3.1-405b").total_params() / 1e9, 405.9, 1.0);
}

TEST(Catalog, UnknownModelListsKnownNames) {
    try {
        catalog_model("llama-9");
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("llama-3.1-70b"), std::string::npos);
    }
}

TEST(HfConfig, LlamaFieldsAndMissingField) {
    const auto m = parse_hf_config(R"({"num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "rope_theta": 500000.0, "torch_dtype": "bfloat16"})",
                                   "config.json");
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_EQ(m.attention, AttentionKind::kGqa);
    EXPECT_EQ(m.kv_dtype, DType::kBf16);
    try {
        parse_hf_config(R"({"hidden_size": 4096})", "config.json");
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("num_hidden_layers"), std::string::npos) << e.what();
    }
}

TEST(ModelSpecJson, RoundTrips) {
    for (const auto& name : catalog_names()) {
        const auto m = catalog_model(name);
        EXPECT_EQ(model_spec_from_json(to_json(m)), m) << name;
    }
}

}  // namespace
}  // namespace kvshard
