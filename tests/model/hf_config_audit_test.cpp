// config.json readings an audit found silently wrong, each checked against the figure the
// architecture's own config class (transformers) and vLLM give. The configs are written inline,
// trimmed to the fields that matter; each names the published config it mirrors.
#include <gtest/gtest.h>

#include <string>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
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

TEST(HfConfigAudit, MissingHeadDimAndKvHeadsTakeTheConfigClassDefaults) {
    // google/gemma-3-12b-it: its text_config names no head_dim; Gemma3TextConfig's default is 256
    // (hidden / heads would be 240). 48 layers of 8 KV heads x 256, bf16.
    const ModelSpec g12 = parse_hf_config(R"({"architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3", "text_config": {"hidden_size": 3840, "intermediate_size": 15360,
        "model_type": "gemma3_text", "num_attention_heads": 16, "num_hidden_layers": 48,
        "num_key_value_heads": 8, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024}, "torch_dtype": "bfloat16"})",
                                          "gemma-3-12b-it/config.json");
    EXPECT_EQ(g12.head_dim, 256);
    EXPECT_EQ(g12.kv_bytes_per_token(), 48 * 2 * 8 * 256 * 2);  // 393,216 (at 240: 368,640)
    // google/gemma-3-4b-it's text_config names no heads at all: 8 heads, 4 KV heads of 256.
    const ModelSpec g4 = parse_hf_config(R"({"model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "sliding_window": 1024}, "torch_dtype": "bfloat16"})",
                                         "gemma-3-4b-it/config.json");
    EXPECT_EQ(g4.num_heads, 8);
    EXPECT_EQ(g4.num_kv_heads, 4);
    EXPECT_EQ(g4.kv_bytes_per_token(), 34 * 2 * 4 * 256 * 2);
    // Gemma 2: head_dim 256, KV heads 4 when absent.
    const ModelSpec g2 = parse_hf_config(R"({"model_type": "gemma2", "num_hidden_layers": 2,
        "hidden_size": 2304, "num_attention_heads": 8, "intermediate_size": 9216,
        "vocab_size": 256000, "sliding_window": 4096})",
                                         "gemma2/config.json");
    EXPECT_EQ(g2.head_dim, 256);
    EXPECT_EQ(g2.num_kv_heads, 4);

    // Qwen3Config: head_dim 128 (Qwen3-32B: hidden 5120 / 64 heads would be 80), KV heads 32.
    const std::string qwen3 = R"({"model_type": "qwen3", "num_hidden_layers": 64,
        "hidden_size": 5120, "num_attention_heads": 64, "intermediate_size": 25600,
        "vocab_size": 151936)";
    const ModelSpec q3 = parse_hf_config(qwen3 + R"(, "num_key_value_heads": 8})", "q3.json");
    EXPECT_EQ(q3.head_dim, 128);
    EXPECT_EQ(parse_hf_config(qwen3 + "}", "q3.json").num_kv_heads, 32);
    // ... and a null num_key_value_heads is the query heads there (Qwen3Config maps None so).
    EXPECT_EQ(parse_hf_config(qwen3 + R"(, "num_key_value_heads": null})", "q3.json").num_kv_heads,
              64);
    // MistralConfig / MixtralConfig: 8 KV heads when absent, not MHA.
    for (const char* type : {"mistral", "mixtral"}) {
        std::string cfg = std::string(R"({"model_type": ")") + type +
                          R"(", "num_hidden_layers": 2, "hidden_size": 4096,
            "num_attention_heads": 32, "intermediate_size": 14336, "vocab_size": 32000)";
        if (std::string(type) == "mixtral")
            cfg += R"(, "num_local_experts": 8, "num_experts_per_tok": 2)";
        const ModelSpec m = parse_hf_config(cfg + "}", "cfg.json");
        EXPECT_EQ(m.num_kv_heads, 8) << type;
        EXPECT_EQ(m.head_dim, 128) << type;
    }
    // Qwen2Config: 32 KV heads; Qwen2MoeConfig 16; head_dim hidden / heads for both.
    EXPECT_EQ(
        parse_hf_config(R"({"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 4096,
        "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 151936})",
                        "cfg.json")
            .num_kv_heads,
        32);
    // Llama (and no model_type): absent KV heads are the query heads, head_dim hidden / heads.
    const ModelSpec llama = parse_hf_config(R"({"model_type": "llama", "num_hidden_layers": 2,
        "hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 11008,
        "vocab_size": 32000})",
                                            "cfg.json");
    EXPECT_EQ(llama.num_kv_heads, 32);
    EXPECT_EQ(llama.head_dim, 128);

    // No confirmed default: refused, naming the field and the config class.
    const std::string qwen3_moe = R"({"model_type": "qwen3_moe", "num_hidden_layers": 2,
        "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 151936})";
    const std::string e = error_of(qwen3_moe);
    EXPECT_NE(e.find("missing field 'head_dim'"), std::string::npos) << e;
    EXPECT_NE(e.find("Qwen3MoeConfig"), std::string::npos) << e;
    EXPECT_NE(error_of(R"({"model_type": "qwen2_moe", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": null, "intermediate_size": 128,
        "vocab_size": 100})")
                  .find("'num_key_value_heads' is null"),
              std::string::npos);
}

TEST(HfConfigAudit, Float32CheckpointsAreSizedAtVllmsBf16) {
    // google/gemma-2-27b (base) publishes torch_dtype float32; vLLM's --dtype auto downcasts it to
    // bf16 (_resolve_auto_dtype, "Downcast for float32 models"), and its KV cache follows.
    // 46 layers, 16 KV heads x 128, alternating sliding (4096) and full.
    const std::string gemma2_27b = R"({"architectures": ["Gemma2ForCausalLM"],
        "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid", "head_dim": 128,
        "hidden_size": 4608, "intermediate_size": 36864, "model_type": "gemma2",
        "num_attention_heads": 32, "num_hidden_layers": 46, "num_key_value_heads": 16,
        "query_pre_attn_scalar": 144, "sliding_window": 4096, "torch_dtype": "float32",
        "vocab_size": 256000})";
    const ModelSpec m = parse_hf_config(gemma2_27b, "gemma-2-27b/config.json");
    EXPECT_EQ(m.kv_dtype, DType::kBf16);
    EXPECT_EQ(m.weight_dtype, DType::kBf16);
    EXPECT_EQ(m.kv_bytes_per_token(), 46 * 2 * 16 * 128 * 2);  // 376,832 (at fp32: 753,664)
    // A config naming no dtype is read the same way (vLLM takes it as float32, then downcasts).
    std::string unnamed = gemma2_27b;
    unnamed.replace(unnamed.find(R"("torch_dtype": "float32",)"), 25, "");
    EXPECT_EQ(parse_hf_config(unnamed, "cfg.json").kv_dtype, DType::kBf16);
    // 16-bit checkpoints keep their dtype.
    std::string fp16 = gemma2_27b;
    fp16.replace(fp16.find("float32"), 7, "float16");
    EXPECT_EQ(parse_hf_config(fp16, "cfg.json").kv_dtype, DType::kFp16);
}

TEST(HfConfigAudit, DeepSeekV32Fp8KvIsFlashMlasFp8DsMla) {
    // vLLM stores DeepSeek-V3.2's fp8 cache as fp8_ds_mla (FlashMLASparseBackend
    // .get_kv_cache_shape: 656 bytes a token and layer): 512 fp8 latent values, 4 fp32 scales
    // (16 bytes), 64 bf16 rope values (128 bytes). Plus the indexer key (128 fp8 + 4) per layer.
    ModelSpec v32 = catalog_model("deepseek-v3.2");
    v32.kv_dtype = DType::kFp8;
    EXPECT_TRUE(mla_fp8_ds_layout(v32));
    EXPECT_EQ(mla_bytes_per_token(v32), 512 + 16 + 128);
    EXPECT_EQ(v32.kv_bytes_per_token(), 61 * (656 + 132));  // 48,068 (was 61 x (576 + 132))
    const KvLayout lay = make_layout(v32, ParallelConfig{});
    ASSERT_EQ(lay.ranks[0].groups.size(), 1u);
    EXPECT_EQ(lay.ranks[0].kv_bytes_per_token, 48068);
    EXPECT_EQ(lay.ranks[0].groups[0].scale_bytes_per_block, 0);  // scales live in each entry
    EXPECT_EQ(request_kv_bytes(lay, 0, 1000, 64), int64_t{16} * 64 * 48068);
    // bf16 V3.2 and plain DeepSeek-V3 at fp8 keep the plain latent (576 elements), the latter
    // with kvshard's per-block fp8 scales.
    v32.kv_dtype = DType::kBf16;
    EXPECT_EQ(v32.kv_bytes_per_token(), 61 * (2 * 576 + 132));
    ModelSpec v3 = catalog_model("deepseek-v3");
    v3.kv_dtype = DType::kFp8;
    EXPECT_FALSE(mla_fp8_ds_layout(v3));
    EXPECT_EQ(v3.kv_bytes_per_token(), 61 * 576);
    EXPECT_EQ(make_layout(v3, ParallelConfig{}).ranks[0].groups[0].scale_bytes_per_block, 61 * 4);
}

TEST(HfConfigAudit, HarmlessFieldsAreAccepted) {
    // meta-llama/Llama-4-Maverick-17B-128E-Instruct's text_config carries transformers' runtime
    // hint _attn_implementation_autoset (4.48-4.50); the KV is the same without it.
    const std::string text = R"("attention_chunk_size": 8192, "head_dim": 128,
        "hidden_size": 5120, "interleave_moe_layer_step": 2, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "model_type": "llama4_text", "num_attention_heads": 40,
        "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8,
        "num_local_experts": 128, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "use_qk_norm": false, "vocab_size": 202048)";
    const auto maverick = [&](const std::string& extra) {
        return parse_hf_config(R"({"model_type": "llama4", "text_config": {)" + extra + text + "}}",
                               "maverick/config.json");
    };
    const ModelSpec plain = maverick("");
    EXPECT_EQ(maverick(R"("_attn_implementation_autoset": true, )"), plain);
    EXPECT_EQ(maverick(R"("_attn_implementation": "sdpa", )"), plain);

    // google/gemma-3-270m: "_sliding_window_pattern": 6 (Gemma3TextConfig's stored name) and
    // "use_bidirectional_attention": false beside layer_types (5 sliding, 1 full, x3).
    std::string types;
    for (int l = 0; l < 18; ++l)
        types += std::string(l ? ", " : "") +
                 ((l + 1) % 6 ? "\"sliding_attention\"" : "\"full_attention\"");
    const auto gemma = [&](const std::string& extra) {
        return R"({"model_type": "gemma3_text", "head_dim": 256, "hidden_size": 640,
            "intermediate_size": 2048, "num_attention_heads": 4, "num_hidden_layers": 18,
            "num_key_value_heads": 1, "sliding_window": 512, "vocab_size": 262144,
            "torch_dtype": "bfloat16", "layer_types": [)" +
               types + "]" + extra + "}";
    };
    const ModelSpec g = parse_hf_config(gemma(""), "gemma-3-270m/config.json");
    EXPECT_EQ(g.layer_mix(), "18 layers: 15 sliding(512) + 3 full");
    EXPECT_EQ(g.layer(5).kind, LayerKind::kFullAttention);
    EXPECT_EQ(parse_hf_config(gemma(R"(, "_sliding_window_pattern": 6,
        "use_bidirectional_attention": false)"),
                              "gemma-3-270m/config.json"),
              g);
    // Refused where it would matter: a pattern that disagrees with the layers, a bidirectional
    // (encoder) model.
    EXPECT_NE(error_of(gemma(R"(, "_sliding_window_pattern": 4)")).find("_sliding_window_pattern"),
              std::string::npos);
    EXPECT_NE(error_of(gemma(R"(, "use_bidirectional_attention": true)"))
                  .find("use_bidirectional_attention"),
              std::string::npos);
}

TEST(HfConfigAudit, SharedExpertsOfTheirOwnWidthAreCounted) {
    // Qwen/Qwen2-57B-A14B-Instruct: a shared expert of 20480 beside 64 routed experts of 2560
    // (was refused). Its parameters are those of 8 routed-width experts.
    const ModelSpec q = parse_hf_config(R"({"model_type": "qwen2_moe", "hidden_size": 3584,
        "intermediate_size": 18944, "moe_intermediate_size": 2560, "num_attention_heads": 28,
        "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "shared_expert_intermediate_size": 20480,
        "sliding_window": 65536, "use_sliding_window": false, "max_window_layers": 28,
        "decoder_sparse_step": 1, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "vocab_size": 151936})",
                                        "qwen2-57b/config.json");
    EXPECT_EQ(q.moe.shared_experts, 8);
    const int64_t h = 3584;
    // Qwen2MoeSparseMoeBlock's shared_expert_gate (hidden -> 1) beside the shared expert.
    EXPECT_EQ(q.moe_params_per_layer(), (64 * 3 * h * 2560) + 3 * h * 20480 + h * 64 + h);
    // nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: moe_shared_expert_intermediate_size 3712, twice the
    // routed 1856 (it was read as one expert of 1856). Squared-ReLU MLPs: 2 projections.
    std::string nano = R"({"model_type": "nemotron_h", "head_dim": 128, "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "intermediate_size": 1856, "mamba_head_dim": 64, "mamba_num_heads": 64, "n_groups": 8,
        "ssm_state_size": 128, "conv_kernel": 4, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "n_routed_experts": 128,
        "n_shared_experts": 1, "num_attention_heads": 32, "num_experts_per_tok": 6,
        "num_hidden_layers": 52, "num_key_value_heads": 2, "torch_dtype": "bfloat16",
        "vocab_size": 131072})";
    const ModelSpec n = parse_hf_config(nano, "nemotron-3-nano/config.json");
    EXPECT_EQ(n.moe.shared_experts, 2);
    const int64_t d = 2688;
    // NemotronHMoE's gate with its e_score_correction_bias (128).
    EXPECT_EQ(n.moe_params_per_layer(), 128 * 2 * d * 1856 + 2 * d * 3712 + d * 128 + 128);
    // A width that is not a multiple of the routed one is refused, not rounded.
    nano.replace(nano.find("3712"), 4, "3000");
    EXPECT_NE(error_of(nano).find("moe_shared_expert_intermediate_size"), std::string::npos);
}

TEST(HfConfigAudit, LayerTypesKeepTheirFullLayersUnderAModelWindow) {
    // A Llama-field config naming each layer (vLLM's LlamaAttention, and Apertus', take the
    // window per layer from layer_types): the full layers stay full. kvshard had also applied the
    // model-level window to every layer, sizing the full layers as sliding.
    const std::string cfg = R"({"model_type": "mistral", "num_hidden_layers": 4,
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 512, "vocab_size": 1000, "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                        "full_attention"]})";
    const ModelSpec m = parse_hf_config(cfg, "cfg.json");
    EXPECT_EQ(m.layer_mix(), "4 layers: 2 sliding(64) + 2 full");
    EXPECT_EQ(m.layer(1).kind, LayerKind::kFullAttention);
    // Without layer_types the window is the model's, on every layer (Mistral-7B-v0.1).
    const std::string no_types =
        cfg.substr(0, cfg.find(R"("layer_types")")) + R"("tie_word_embeddings": false})";
    EXPECT_EQ(parse_hf_config(no_types, "cfg.json").layer_mix(), "4 layers: 4 sliding(64)");
}

TEST(HfConfigAudit, KimiK25WrapperReadsItsDeepSeekTextConfig) {
    // moonshotai/Kimi-K2.5: a kimi_k25 wrapper whose text_config (model_type kimi_k2) is Kimi K2's
    // DeepSeek-V3 decoder (geometry as a loader's test copies the K2.5 text_config, file id
    // 61290795863). Its use_unified_vision_chunk groups images and video as one prompt modality
    // (vLLM chat_utils.py); it was refused as a field that might change the KV cache.
    const std::string k25 = R"({"architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25", "media_placeholder_token_id": 163605,
        "use_unified_vision_chunk": true, "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "tie_word_embeddings": false, "text_config": {"model_type": "kimi_k2",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 163840, "max_position_embeddings": 262144, "torch_dtype": "bfloat16"},
        "vision_config": {"hidden_size": 1152}})";
    const ModelSpec m = parse_hf_config(k25, "kimi-k2.5/config.json");
    EXPECT_TRUE(m.is_mla());
    EXPECT_EQ(m.kv_bytes_per_token(), 61 * (512 + 64) * 2);  // 70,272
    EXPECT_EQ(m.moe.num_experts, 384);
    EXPECT_EQ(m.max_model_len, 262144);
}

TEST(HfConfigAudit, UseSlidingWindowFalseSwitchesAModelWindowOff) {
    // vLLM's ModelConfig.get_hf_config_sliding_window returns None where the config object has
    // use_sliding_window false, whatever the model type (not only Qwen's): a Mistral-field config
    // stating it false attends fully on every layer. kvshard had slid every layer.
    const std::string base = R"({"model_type": "mistral", "num_hidden_layers": 4,
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 512, "vocab_size": 1000, "sliding_window": 64)";
    EXPECT_EQ(parse_hf_config(base + R"(, "use_sliding_window": false})", "cfg.json").layer_mix(),
              "4 layers: 4 full");
    EXPECT_EQ(parse_hf_config(base + R"(, "use_sliding_window": true})", "cfg.json").layer_mix(),
              "4 layers: 4 sliding(64)");
    EXPECT_EQ(parse_hf_config(base + "}", "cfg.json").layer_mix(), "4 layers: 4 sliding(64)");
}

}  // namespace
}  // namespace kvshard
