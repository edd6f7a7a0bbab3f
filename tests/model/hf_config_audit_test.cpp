// config.json readings an audit found silently wrong, each checked against the figure the
// architecture's own config class (transformers) and vLLM give. The configs are written inline,
// trimmed to the fields that matter; each names the published config it mirrors.
#include <gtest/gtest.h>

#include <string>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

std::string error_of(const std::string& json) {
    try {
        parse_hf_config(json, "cfg.json");
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

TEST(HfConfigAudit, Glm4ReadsKvHeadsLikeLlama) {
    // THUDM/GLM-4-9B-0414 config.json (model_type glm4, Glm4ForCausalLM); its values are also
    // transformers' Glm4Config defaults. vLLM's glm4.py: num_key_value_heads x head_dim per layer.
    const std::string glm4_9b = R"({"architectures": ["Glm4ForCausalLM"], "attention_bias": true,
        "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 13696, "max_position_embeddings": 32768, "model_type": "glm4",
        "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
        "vocab_size": 151552})";
    const ModelSpec m = parse_hf_config(glm4_9b, "glm-4-9b-0414/config.json");
    EXPECT_EQ(m.num_kv_heads, 2);
    EXPECT_EQ(m.head_dim, 128);
    EXPECT_EQ(m.attention, AttentionKind::kGqa);
    EXPECT_EQ(m.kv_bytes_per_token(), 40 * 2 * 2 * 128 * 2);  // 40,960 (read as MHA: 655,360)
    EXPECT_EQ(m.intermediate, 13696);
    EXPECT_EQ(m.mlp_projections, 3);  // gate_up_proj (fused gate and up) and down_proj
    // The ChatGLM field names are not Glm4Config's: refused, not ignored.
    std::string chatglm_style = glm4_9b;
    chatglm_style.insert(chatglm_style.rfind('}'), R"(, "multi_query_group_num": 2)");
    EXPECT_NE(error_of(chatglm_style).find("multi_query_group_num"), std::string::npos);
}

}  // namespace
}  // namespace kvshard
