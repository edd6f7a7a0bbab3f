// ModelSpec::total_params against real checkpoints: the number of elements in every tensor the
// published safetensors hold (matrices, norm weights, biases), read from the checkpoint's
// model.safetensors.index.json ("metadata": {"total_size": bytes}, / 2 for a bf16 checkpoint, / 4
// for an fp32 one: every tensor of these is of the checkpoint's dtype) or from the Hugging Face
// API's safetensors.total. The sources, by file id of the search tool's stored copy, are in
// tests/data/hf_configs/README.md, "Parameter counts". The shapes behind each figure are vLLM's:
// the model file and class are named beside each case.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/model/weights.h"

namespace kvshard {
namespace {

std::string config_path(const std::string& name) {
    return std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/" + name + ".json";
}

struct Checkpoint {
    const char* config;  // tests/data/hf_configs/<config>.json
    int64_t params;      // the checkpoint's element count
    const char* source;  // where params comes from
};

// Each figure fails without the norms: every checkpoint holds two hidden-wide norms per layer (four
// for Gemma 2) and a final one, which total_params did not count before.
const Checkpoint kCheckpoints[] = {
    // vLLM llama.py (LlamaDecoderLayer): q, k, v, o, gate, up, down, input_layernorm,
    // post_attention_layernorm; LlamaModel.norm.
    {"llama-3.1-8b", 8030261248,
     "meta-llama/Llama-3.1-8B index total_size 16060522496 (bf16); HF API 8030261248"},
    {"mistral-7b-v0.1", 7241732096,
     "Mistral-7B(-Instruct-v0.2, the same shapes) index total_size 14483464192 (bf16)"},
    // vLLM mixtral.py: MixtralMoE's gate (hidden -> experts) and experts w1, w2, w3.
    {"mixtral-8x7b-v0.1", 46702792704, "Mixtral-8x7B index total_size 93405585408 (bf16)"},
    {"wizardlm-2-8x22b", 140620634112,
     "WizardLM-2-8x22B (Mixtral-8x22B's shapes) index total_size 281241268224 (bf16)"},
    // vLLM qwen2.py: Qwen2Attention's QKVParallelLinear with bias=True (q, k, v biases).
    {"qwen2.5-7b", 7615616512, "Qwen2.5-7B(-Instruct) index total_size 15231233024 (bf16)"},
    // vLLM qwen3.py: Qwen3Attention's q_norm / k_norm, RMSNorm(head_dim) each.
    {"qwen3-8b", 8190735360, "Qwen/Qwen3-8B index total_size 16381470720 (bf16), 399 tensors"},
    // vLLM qwen3_moe.py: the same attention; Qwen3MoeSparseMoeBlock's gate and 128 experts.
    {"qwen3-30b-a3b", 30532122624, "Qwen3-30B-A3B index total_size 61064245248 (bf16)"},
    // vLLM gemma2.py: Gemma2DecoderLayer's input_layernorm, post_attention_layernorm,
    // pre_feedforward_layernorm and post_feedforward_layernorm; tied embedding.
    {"gemma-2-9b-it", 9241705984, "gemma-2-9b index total_size 18483411968 (bf16), 464 tensors"},
    // vLLM phi3.py (LlamaForCausalLM's layers): fused qkv_proj and gate_up_proj, same counts.
    {"phi-3-mini-4k-instruct", 3821079552,
     "Phi-3-mini-4k-instruct index total_size 7642159104 (bf16), 195 tensors"},
    // vLLM granite.py (GraniteDecoderLayer: Llama's tensors, tied embedding).
    {"granite-3.3-8b-instruct", 8170864640, "granite-3.3-8b-instruct safetensors, 8170864640"},
    // vLLM granitemoe.py: GraniteMoeMoE's router and fused input_linear / output_linear experts.
    {"granite-3.1-1b-a400m-instruct", 1334628352,
     "granite-3.1-1b-a400m-instruct index total_size 5338513408 (fp32: / 4)"},
    // vLLM olmo2.py: Olmo2DecoderLayer's post_attention_layernorm and post_feedforward_layernorm,
    // Olmo2Attention's q_norm RMSNorm(hidden) and k_norm RMSNorm(kv_heads x head_dim).
    {"olmo-2-7b-instruct", 7298617344,
     "allenai/OLMo-2-1124-7B (the same shapes) HF API safetensors.total 7298617344"},
    // SmolLM3 (transformers' SmolLM3DecoderLayer through vLLM's Transformers backend): Llama's.
    {"smollm3-3b", 3075098624,
     "HuggingFaceTB/SmolLM3-3B-Base (the same shapes) HF API safetensors.total 3075098624"},
};

TEST(CheckpointParams, TotalParamsEqualThePublishedCheckpoints) {
    for (const Checkpoint& c : kCheckpoints) {
        SCOPED_TRACE(c.config);
        SCOPED_TRACE(c.source);
        EXPECT_EQ(load_hf_config(config_path(c.config)).total_params(), c.params);
    }
}

TEST(CheckpointParams, CatalogModelsEqualThePublishedCheckpoints) {
    // Llama 3.1 70B and 405B: HF API safetensors.total (tests/data/hf_configs/README.md).
    EXPECT_EQ(catalog_model("llama-3.1-8b").total_params(), 8030261248);
    EXPECT_EQ(catalog_model("llama-3.1-70b").total_params(), 70553706496);
    EXPECT_EQ(catalog_model("llama-3.1-405b").total_params(), 405853388800);
    EXPECT_EQ(catalog_model("mixtral-8x7b").total_params(), 46702792704);
    EXPECT_EQ(catalog_model("mistral-7b-v0.1").total_params(), 7241732096);
}

// Falcon-180B: vLLM's falcon.py under new_decoder_architecture builds ln_attn and ln_mlp, both
// LayerNorms with a bias (num_ln_in_parallel_attn defaults to 2), a fused query_key_value of 232
// query heads and 8 KV heads of 64, no linear biases (bias false), and ln_f with a bias. The
// geometry in Hugging Face's field names from TensorRT-LLM's falcon-180B checkpoint config
// (file id 3247412510: 80 layers, 232 heads, 8 KV heads, hidden 14848, vocab 65024, bias false,
// parallel attention, new decoder architecture, no shared embedding table); the count is the HF
// API's safetensors.total of tiiuae/falcon-180B, 179522565120.
TEST(CheckpointParams, Falcon180BLayerNormsWithBiases) {
    nlohmann::json j = {{"model_type", "falcon"}, {"num_hidden_layers", 80},
                        {"hidden_size", 14848},   {"num_attention_heads", 232},
                        {"num_kv_heads", 8},      {"new_decoder_architecture", true},
                        {"parallel_attn", true},  {"bias", false},
                        {"vocab_size", 65024},    {"tie_word_embeddings", false}};
    const ModelSpec m = parse_hf_config(j.dump(), "falcon-180b.json");
    EXPECT_TRUE(m.norms.norm_bias);
    EXPECT_FALSE(m.norms.parallel);
    EXPECT_EQ(m.norm_params_of_layer(0), 4 * 14848);  // two LayerNorms of weight and bias
    EXPECT_EQ(m.final_norm_params(), 2 * 14848);
    EXPECT_EQ(m.total_params(), 179522565120);
    // One norm before the parallel attention and MLP (Falcon-7B's input_layernorm).
    j["num_ln_in_parallel_attn"] = 1;
    EXPECT_EQ(parse_hf_config(j.dump(), "f.json").norm_params_of_layer(0), 2 * 14848);
    // parallel_attn false: input_layernorm and post_attention_layernorm, whatever the count.
    j["parallel_attn"] = false;
    EXPECT_EQ(parse_hf_config(j.dump(), "f.json").norm_params_of_layer(0), 4 * 14848);
    // config.bias: q/k/v, dense, dense_h_to_4h and dense_4h_to_h biases.
    j["bias"] = true;
    const ModelSpec biased = parse_hf_config(j.dump(), "f.json");
    EXPECT_EQ(biased.total_params() - parse_hf_config(
                                          [&] {
                                              nlohmann::json k = j;
                                              k["bias"] = false;
                                              return k.dump();
                                          }(),
                                          "f.json")
                                          .total_params(),
              80 * ((14848 + 2 * 8 * 64) + 14848 + (4 * 14848 + 14848)));
}

// Each part the counts depend on, by hand, as its vLLM model file builds it.
TEST(CheckpointParams, EachNormAndBiasAsVllmBuildsIt) {
    // Qwen2.5-7B: q, k, v biases of 28 x 128 + 2 x 4 x 128 per layer, none on o_proj.
    const ModelSpec qwen2 = load_hf_config(config_path("qwen2.5-7b"));
    EXPECT_TRUE(qwen2.norms.qkv_bias);
    EXPECT_FALSE(qwen2.norms.o_bias);
    EXPECT_EQ(qwen2.mixer_params_of_layer(0),
              int64_t{2} * 3584 * 3584 + 2 * 3584 * 512 + (3584 + 2 * 512));
    // Qwen3-8B: q_norm and k_norm of head_dim 128 each.
    const ModelSpec qwen3 = load_hf_config(config_path("qwen3-8b"));
    EXPECT_EQ(qwen3.norms.qk, QkNorm::kPerHead);
    EXPECT_EQ(qwen3.mixer_params_of_layer(0), int64_t{2} * 4096 * 4096 + 2 * 4096 * 1024 + 256);
    // OLMo 2: q_norm over all 32 heads, k_norm over all 32 KV heads; post norms only.
    const ModelSpec olmo = load_hf_config(config_path("olmo-2-7b-instruct"));
    EXPECT_EQ(olmo.norms.qk, QkNorm::kAllHeads);
    EXPECT_EQ(olmo.mixer_params_of_layer(0), int64_t{4} * 4096 * 4096 + 2 * 4096);
    EXPECT_EQ(olmo.norm_params_of_layer(0), 2 * 4096);
    // Olmo2Attention builds qkv_proj and o_proj with bias=False whatever attention_bias says.
    nlohmann::json oj;
    std::ifstream(config_path("olmo-2-7b-instruct")) >> oj;
    oj["attention_bias"] = true;
    EXPECT_EQ(parse_hf_config(oj.dump(), "o.json").total_params(), olmo.total_params());
    // Gemma 2: four norms per layer.
    const ModelSpec gemma2 = load_hf_config(config_path("gemma-2-9b-it"));
    EXPECT_EQ(gemma2.norm_params_of_layer(0), 4 * 3584);
    // Gemma 3: four norms and q_norm / k_norm of head_dim 128.
    const ModelSpec gemma3 = load_hf_config(config_path("gemma-3-27b"));
    EXPECT_EQ(gemma3.norm_params_of_layer(0), 4 * 5376);
    EXPECT_EQ(gemma3.norms.qk, QkNorm::kPerHead);
    // Cohere2 (commandr.py's CohereDecoderLayer): one input_layernorm before the parallel
    // attention and MLP.
    const ModelSpec r7b = load_hf_config(config_path("c4ai-command-r7b-12-2024"));
    EXPECT_TRUE(r7b.norms.parallel);
    EXPECT_EQ(r7b.norm_params_of_layer(0), 4096);
    // Falcon-7B (falcon.py): one input_layernorm with a bias per layer, ln_f with a bias.
    const ModelSpec falcon = load_hf_config(config_path("falcon-7b-instruct"));
    EXPECT_EQ(falcon.norm_params_of_layer(0), 2 * 4544);
    EXPECT_EQ(falcon.final_norm_params(), 2 * 4544);
    // DeepSeek-V3 (deepseek_v2.py): MLA's q_a_layernorm and kv_a_layernorm; the gate's
    // e_score_correction_bias under topk_method noaux_tc.
    const ModelSpec ds = load_hf_config(config_path("deepseek-v3"));
    EXPECT_TRUE(ds.norms.router_bias);
    EXPECT_EQ(ds.router_params(), int64_t{7168} * 256 + 256);
    ModelSpec no_rank = ds;
    no_rank.mla.q_lora_rank = 0;  // queries from the hidden state: no q_a_layernorm
    EXPECT_EQ(ds.mixer_params_of_layer(0) - no_rank.mixer_params_of_layer(0),
              int64_t{7168} * 1536 + int64_t{1536} * 128 * 192 + 1536 - int64_t{7168} * 128 * 192);
    // gpt-oss (gpt_oss.py): q, k, v, o biases; the router's bias; each expert's gate_up and down
    // biases.
    const ModelSpec oss = load_hf_config(config_path("gpt-oss-20b"));
    EXPECT_TRUE(oss.norms.qkv_bias && oss.norms.o_bias && oss.norms.router_bias &&
                oss.norms.mlp_bias);
    EXPECT_EQ(oss.routed_expert_params(), int64_t{3} * 2880 * 2880 + 2 * 2880 + 2880);
    // Qwen3-Next (qwen3_next.py's Qwen3NextAttention): q_proj of 2 x 16 heads of 256, the second
    // half the output gate (attn_output_gate, default true), q_norm / k_norm of 256.
    const ModelSpec next = load_hf_config(config_path("qwen3-next-80b-a3b"));
    EXPECT_TRUE(next.norms.attention_output_gate);
    EXPECT_EQ(next.mixer_params_of_layer(3),
              int64_t{3} * 2048 * 16 * 256 + 2 * 2048 * 2 * 256 + 2 * 256);
    nlohmann::json nj;
    std::ifstream(config_path("qwen3-next-80b-a3b")) >> nj;
    nj["attn_output_gate"] = false;
    EXPECT_EQ(next.total_params() - parse_hf_config(nj.dump(), "n.json").total_params(),
              12 * int64_t{2048} * 16 * 256);
    // Mamba-2 mixers (MambaMixer2): the conv1d bias by use_conv_bias / mamba_conv_bias, in_proj
    // and out_proj biases by use_bias / mamba_proj_bias. Bamba-9B's 29 Mamba-2 layers: in_proj
    // of 8192 + 8448 + 128 outputs, out_proj of 4096, conv of 8448 channels.
    nlohmann::json bj;
    std::ifstream(config_path("bamba-9b")) >> bj;
    const int64_t bamba = parse_hf_config(bj.dump(), "b.json").total_params();
    bj["mamba_proj_bias"] = true;
    EXPECT_EQ(parse_hf_config(bj.dump(), "b.json").total_params() - bamba,
              29 * int64_t{8192 + 8448 + 128 + 4096});
    bj["mamba_proj_bias"] = false;
    bj["mamba_conv_bias"] = false;
    EXPECT_EQ(bamba - parse_hf_config(bj.dump(), "b.json").total_params(), 29 * int64_t{8448});
    // Nemotron-H-8B's 24 Mamba-2 layers (128 heads of 64, 8 groups of 128): use_bias.
    nlohmann::json hj;
    std::ifstream(config_path("nemotron-h-8b")) >> hj;
    const int64_t nemo = parse_hf_config(hj.dump(), "h.json").total_params();
    hj["use_bias"] = true;
    EXPECT_EQ(parse_hf_config(hj.dump(), "h.json").total_params() - nemo,
              24 * int64_t{8192 + 10240 + 128 + 4096});
    // Seed-OSS: attention_bias on q, k, v; attention_out_bias false on o.
    const ModelSpec seed = load_hf_config(config_path("seed-oss-36b-instruct"));
    EXPECT_TRUE(seed.norms.qkv_bias);
    EXPECT_FALSE(seed.norms.o_bias);
    // Llama's attention_bias puts biases on q, k, v and o; mlp_bias on gate, up and down.
    nlohmann::json j;
    std::ifstream(config_path("llama-3.1-8b")) >> j;
    const int64_t base = load_hf_config(config_path("llama-3.1-8b")).total_params();
    j["attention_bias"] = true;
    EXPECT_EQ(parse_hf_config(j.dump(), "l.json").total_params() - base,
              32 * int64_t{4096 + 2 * 1024 + 4096});
    j["attention_bias"] = false;
    j["mlp_bias"] = true;
    EXPECT_EQ(parse_hf_config(j.dump(), "l.json").total_params() - base,
              32 * int64_t{2 * 14336 + 4096});
}

// The reference model's safetensors (hf_tensor_list, what kvshard's executors load) hold exactly
// total_params elements: the formulas and the tensors describe one model.
TEST(CheckpointParams, TensorListOfTheReferenceModelsSumsToTotalParams) {
    for (const char* name : {"tiny", "tiny-moe", "tiny-mla", "tiny-hybrid", "small-100m"}) {
        SCOPED_TRACE(name);
        const ModelSpec m = catalog_model(name);
        int64_t elems = 0;
        for (const auto& [tensor, shape] : hf_tensor_list(m)) {
            int64_t n = 1;
            for (int64_t d : shape) n *= d;
            elems += tensor == "lm_head.weight" && m.tie_embeddings ? 0 : n;
        }
        EXPECT_EQ(elems, m.total_params());
    }
}

TEST(CheckpointParams, NormsRoundTripThroughJson) {
    for (const char* file : {"qwen2.5-7b", "olmo-2-7b-instruct", "falcon-7b-instruct",
                             "gpt-oss-20b", "gemma-2-9b-it"}) {
        SCOPED_TRACE(file);
        const ModelSpec m = load_hf_config(config_path(file));
        const ModelSpec back = model_spec_from_json(to_json(m));
        EXPECT_EQ(back.norms, m.norms);
        EXPECT_EQ(back.total_params(), m.total_params());
    }
    // A JSON without "norms" (written before the field) reads as a Llama decoder.
    nlohmann::json j = nlohmann::json::parse(to_json(catalog_model("llama-3.1-8b")));
    j.erase("norms");
    EXPECT_EQ(model_spec_from_json(j.dump()).norms, NormsAndBiases{});
    j["norms"] = {{"qk", "per_token"}};
    EXPECT_THROW(model_spec_from_json(j.dump()), Error);
    j["norms"] = {{"per_part", 3}};
    EXPECT_THROW(model_spec_from_json(j.dump()), Error);
}

nlohmann::json config_json(const std::string& name) {
    std::ifstream in(config_path(name));
    return nlohmann::json::parse(in);
}

// Ling 2.0 (vLLM's bailing_moe.py): BailingAttention's query_layernorm / key_layernorm of head_dim
// under use_qk_norm, BailingMoE's gate expert_bias (one per expert) under
// moe_router_enable_expert_bias, the query_key_value bias under use_qkv_bias. Ling-mini-2.0: 20
// layers of 16 query and 4 KV heads of 128, 19 MoE layers of 256 experts.
TEST(CheckpointParams, LingQkNormsExpertBiasAndQkvBias) {
    nlohmann::json j = config_json("ling-mini-2.0");
    const int64_t published = parse_hf_config(j.dump(), "ling.json").total_params();
    j["use_qk_norm"] = false;
    j["moe_router_enable_expert_bias"] = false;
    const int64_t bare = parse_hf_config(j.dump(), "ling.json").total_params();
    EXPECT_EQ(published - bare, 20 * 2 * 128 + 19 * 256);
    j["use_qkv_bias"] = true;
    EXPECT_EQ(parse_hf_config(j.dump(), "ling.json").total_params() - bare,
              20 * (16 + 2 * 4) * 128);
}

// dots.llm1 (vLLM's dots1.py): Dots1Attention's q_norm / k_norm RMSNorm(head_dim) on every layer,
// Dots1MoE's e_score_correction_bias under topk_method noaux_tc; o_proj without a bias. 62
// layers, head_dim 128, 61 MoE layers of 128 experts.
TEST(CheckpointParams, Dots1QkNormsAndCorrectionBias) {
    nlohmann::json j = config_json("dots.llm1.inst");
    const ModelSpec m = parse_hf_config(j.dump(), "dots1.json");
    EXPECT_EQ(m.norms.qk, QkNorm::kPerHead);
    EXPECT_FALSE(m.norms.o_bias);
    const int64_t published = m.total_params();
    j["topk_method"] = "greedy";
    EXPECT_EQ(published - parse_hf_config(j.dump(), "dots1.json").total_params(), 61 * 128);
}

}  // namespace
}  // namespace kvshard
