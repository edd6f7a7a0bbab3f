// Capacity with speculative decoding by the model's MTP layers, against vLLM v1, each expected
// figure derived here from vLLM's source (vllm-project/vllm):
//  - the drafter's attention layers join the KV cache spec (GPUModelRunner.get_kv_cache_spec
//    walks every AttentionLayerBase of the forward context, the drafter's included) and are
//    grouped with the model's own layers of their kind (kv_cache_utils.get_kv_cache_groups);
//  - the drafter is one decoder layer per MTP layer (DeepSeekMultiTokenPredictorLayer.mtp_block,
//    Glm4MoeMultiTokenPredictorLayer.mtp_block, Qwen3NextMultiTokenPredictor.layers) with eh_proj
//    (nn.Linear(2h, h), whole on every rank) or fc (ColumnParallelLinear(2h, h), split by TP) and
//    three RMSNorms; embedding and LM head shared with the target
//    (SpecDecodeBaseProposer._maybe_share_embeddings / _maybe_share_lm_head);
//  - Mamba/GDN groups: MambaSpec.num_speculative_blocks = num_speculative_tokens
//    (MambaBase.get_kv_cache_spec); a request holds 1 + N state blocks (mode none) or 2 + N (align,
//    MambaManager.allocate_new_blocks), and the startup check charges the same
//    (MambaSpec.max_memory_usage_bytes);
//  - the scheduler's lookahead (Scheduler.num_lookahead_tokens = N for method mtp) is capped at
//    max_model_len by KVCacheManager.allocate_slots, so a request of max_model_len tokens holds no
//    more attention blocks.
// H100-80G (DeepSeek-V3: H200), mem_util 0.9, 2 GiB reserve, block 16 (raised for Qwen3-Next),
// context 8192.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {
namespace {

const std::string kData = KVSHARD_TEST_DATA_DIR;

ParallelConfig tp(int n) {
    ParallelConfig p;
    p.tp = n;
    return p;
}

CapacityReport on_gpu(const std::string& gpu, const ModelSpec& m, int tp_size,
                      int speculative_tokens, CapacityOptions o = {}) {
    o.context_tokens = 8192;
    o.speculative_tokens = speculative_tokens;
    // max_context as vLLM's memory check gives it, past the model's max_model_len (as with
    // VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); capacity_test.cpp checks the cap.
    o.allow_long_context = true;
    return compute_capacity(m, tp(tp_size), hardware_by_name(gpu), o);
}

CapacityReport on_h100(const ModelSpec& m, int tp_size, int speculative_tokens,
                       CapacityOptions o = {}) {
    return on_gpu("h100-sxm", m, tp_size, speculative_tokens, o);
}

// DeepSeek-V3's 671B fp8 weights do not fit 8 x H100 (80 GiB); 8 x H200 (141 GiB).
CapacityReport on_h200(const ModelSpec& m, int tp_size, int speculative_tokens) {
    return on_gpu("h200", m, tp_size, speculative_tokens);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

TEST(CapacityMtp, ConfigsRecordTheirMtpLayers) {
    const ModelSpec ds = load_hf_config(kData + "/hf_configs/deepseek-v3.json");
    EXPECT_EQ(ds.mtp.layers, 1);  // num_nextn_predict_layers
    EXPECT_EQ(ds.mtp.layer.kind, LayerKind::kMla);
    EXPECT_EQ(ds.mtp.layer.mlp, MlpKind::kMoe);
    EXPECT_FALSE(ds.mtp.proj_split_by_tp);
    EXPECT_EQ(ds.num_layers, 61);  // not counted among the decoder layers
    EXPECT_EQ(catalog_model("deepseek-v3").mtp, ds.mtp);

    const ModelSpec glm = load_hf_config(kData + "/hf_configs/glm-4.5-air.json");
    EXPECT_EQ(glm.mtp.layers, 1);
    EXPECT_EQ(glm.mtp.layer.kind, LayerKind::kFullAttention);
    EXPECT_EQ(glm.mtp.layer.num_kv_heads, 8);
    EXPECT_EQ(glm.mtp.layer.head_dim, 128);
    EXPECT_EQ(glm.mtp.layer.mlp, MlpKind::kMoe);

    // Qwen3-Next's config names no count: vLLM builds one (num_nextn_predict_layers default 1).
    const ModelSpec qn = load_hf_config(kData + "/hf_configs/qwen3-next-80b-a3b.json");
    EXPECT_EQ(qn.mtp.layers, 1);
    EXPECT_EQ(qn.mtp.layer.kind, LayerKind::kFullAttention);
    EXPECT_EQ(qn.mtp.layer.num_kv_heads, 2);
    EXPECT_EQ(qn.mtp.layer.head_dim, 256);
    EXPECT_TRUE(qn.mtp.proj_split_by_tp);
    const ModelSpec q35 = load_hf_config(kData + "/hf_configs/qwen3.5-35b-a3b.json");
    EXPECT_EQ(q35.mtp.layers, 1);  // mtp_num_hidden_layers

    EXPECT_FALSE(load_hf_config(kData + "/hf_configs/qwen3-8b.json").mtp.enabled());

    // The MTP layers survive the model's JSON.
    EXPECT_EQ(model_spec_from_json(to_json(qn)), qn);
    EXPECT_EQ(model_spec_from_json(to_json(ds)), ds);
}

TEST(CapacityMtp, DeepSeekV3Tp8AddsAnMlaLayerToItsOneGroup) {
    const ModelSpec m = catalog_model("deepseek-v3");
    const CapacityReport off = on_h200(m, 8, 0);
    const CapacityReport on = on_h200(m, 8, 3);
    ASSERT_TRUE(on.fits) << on.why_not;

    // The drafter on each of 8 ranks. Attention (MLA, DeepseekV2MLAAttention): q_a_proj and
    // kv_a_proj_with_mqa whole, q_b_proj / kv_b_proj / o_proj split over the 128 heads (16 here),
    // fp8 with one fp32 scale per 128 x 128 block (8 + 32/16384 bits).
    const int64_t h = 7168, heads = 16;
    const int64_t mla = h * 1536 + 1536 * heads * 192 + h * (512 + 64) + 512 * heads * (128 + 128) +
                        heads * 128 * h;
    EXPECT_EQ(mla, 36634624);
    const int64_t mla_bytes = mla + mla / 4096;  // x (1 + 1/4096): the block scales
    // MoE (FusedMoE split by tp at ep 1): 256 routed + 1 shared expert of 3 x 7168 x 2048, fp8;
    // the gate (7168 x 256) and its e_score_correction_bias (256, noaux_tc) in bf16.
    const int64_t expert = 3 * h * 2048;
    const int64_t experts = (256 * expert + expert) / 8;
    const int64_t moe_bytes = experts + experts / 4096 + 2 * (h * 256 + 256);
    // Norms in bf16: the layer's two, q_a_layernorm (1536), kv_a_layernorm (512); then eh_proj
    // (2h x h, unquantized nn.Linear, whole) with enorm, hnorm and shared_head.norm.
    const int64_t norm_bytes = 2 * (2 * h + 1536 + 512);
    const int64_t eh_bytes = 2 * (2 * h * h + 3 * h);
    const int64_t drafter = mla_bytes + moe_bytes + norm_bytes + eh_bytes;
    EXPECT_EQ(drafter, 1661047344);  // 1.55 GiB per GPU
    EXPECT_EQ(on.ranks[0].weights.drafter, drafter);
    EXPECT_EQ(off.ranks[0].weights.drafter, 0);
    EXPECT_EQ(on.ranks[0].kv_budget_bytes, off.ranks[0].kv_budget_bytes - drafter);

    // One uniform MLA group: a block is 16 tokens x 576 bf16 in each of 61 (62) layers.
    EXPECT_EQ(on.engine.kind, EngineKvKind::kUniform);
    EXPECT_EQ(off.engine.block_bytes[0], 16 * 1152 * 61);
    EXPECT_EQ(on.engine.block_bytes[0], 16 * 1152 * 62);
    EXPECT_EQ(on.kv_bytes_per_token, 1152 * 62);
    const int64_t blocks = on.ranks[0].kv_budget_bytes / (16 * 1152 * 62);
    EXPECT_EQ(on.kv_blocks_per_gpu, blocks);
    EXPECT_EQ(on.kv_tokens_per_gpu, blocks * 16);
    EXPECT_EQ(on.max_context, blocks * 16);  // the startup check: ceil(M / 16) <= blocks
    // A request of max_model_len = 8192 tokens: its lookahead slots are capped at max_model_len.
    EXPECT_EQ(on.request_blocks, 8192 / 16);
    EXPECT_EQ(on.requests_per_replica, blocks / 512);
    // Switched off, the figures are the model's own: more blocks, more tokens and requests.
    EXPECT_EQ(off.kv_blocks_per_gpu, off.ranks[0].kv_budget_bytes / (16 * 1152 * 61));
    EXPECT_GT(off.kv_tokens_per_gpu, on.kv_tokens_per_gpu);
    EXPECT_GT(off.requests_per_replica, on.requests_per_replica);
    // The count of draft tokens moves nothing for a model without state layers.
    EXPECT_EQ(on_h200(m, 8, 1).kv_blocks_per_gpu, blocks);
    EXPECT_EQ(on_h200(m, 8, 1).requests_per_replica, on.requests_per_replica);
}

TEST(CapacityMtp, GlmAirTp4AddsAGqaLayer) {
    const ModelSpec m = load_hf_config(kData + "/hf_configs/glm-4.5-air.json");
    const CapacityReport off = on_h100(m, 4, 0);
    const CapacityReport on = on_h100(m, 4, 1);
    // Glm4MoeDecoderLayer at tp 4: 24 of 96 query heads, 2 of 8 KV heads of 128 (Q, K, V, O);
    // q, k, v biases of the held heads (attention_bias); 128 routed + 1 shared expert of 3 x
    // 4096 x 1408 split by tp, the gate and its e_score_correction_bias whole; two norms; eh_proj
    // 2h x h whole and three norms. All bf16.
    const int64_t h = 4096;
    const int64_t attn = 2 * h * 24 * 128 + 2 * h * 2 * 128 + (24 + 2 * 2) * 128;
    const int64_t expert = 3 * h * 1408;
    const int64_t moe = (128 * expert + expert) / 4 + h * 128 + 128;
    const int64_t drafter = 2 * (attn + moe + 2 * h + 2 * h * h + 3 * h);
    EXPECT_EQ(drafter, 1238678784);
    EXPECT_EQ(on.ranks[0].weights.drafter, drafter);
    EXPECT_EQ(on.ranks[0].kv_budget_bytes, off.ranks[0].kv_budget_bytes - drafter);
    // One full-attention group of 46 (47) layers; a page is 16 tokens x 2 x 2 heads x 128 x bf16.
    const int64_t page = 16 * 2 * 2 * 128 * 2;
    EXPECT_EQ(off.engine.block_bytes[0], page * 46);
    EXPECT_EQ(on.engine.block_bytes[0], page * 47);
    const int64_t blocks = on.ranks[0].kv_budget_bytes / (page * 47);
    EXPECT_EQ(on.kv_blocks_per_gpu, blocks);
    EXPECT_EQ(on.kv_tokens_per_gpu, blocks * 16);
    EXPECT_EQ(on.requests_per_replica, blocks / 512);
    EXPECT_EQ(off.requests_per_replica, off.ranks[0].kv_budget_bytes / (page * 46) / 512);
    EXPECT_GT(off.requests_per_replica, on.requests_per_replica);
}

TEST(CapacityMtp, QwenNextTp4RegroupsAndHoldsSpeculativeStates) {
    const ModelSpec m = catalog_model("qwen3-next-80b-a3b");
    const CapacityReport off = on_h100(m, 4, 0);
    const CapacityReport on = on_h100(m, 4, 2);
    // Pages at tp 4: one token of a full layer 2 x 1 KV head (2 replicated over 4) x 256 x 2 =
    // 1024 B; a GDN state (3 x (2 x 4 x 128 + 8 x 128) conv + 8 x 128 x 128 recurrent) x 2 B =
    // 274,432 B. vLLM's block: 16 x cdiv(274432, 16 x 1024) = 272 tokens, a page of 278,528 B.
    // Speculating N = 2, the conv state keeps 3 + 2 rows (gated_delta_net_state_shape's num_spec):
    // (5 x 2048 + 8 x 128 x 128) x 2 = 282,624 B, block 16 x cdiv(282624, 16384) = 288 tokens.
    const int64_t page_off = 272 * 1024;
    const int64_t page = 288 * 1024;
    EXPECT_EQ(off.engine.block_size, 272);
    EXPECT_EQ(off.engine.page_bytes, page_off);
    EXPECT_EQ(on.engine.block_size, 288);
    EXPECT_EQ(on.engine.page_bytes, page);
    // Off: 12 full + 36 GDN layers, groups of 12 (36 >= 1.5 x 12): 1 + 3 groups, no padding.
    EXPECT_EQ(off.engine.group_size, 12);
    EXPECT_EQ(off.engine.padding_slots(), 0);
    EXPECT_EQ(off.engine.block_bytes[0], page_off * 12);
    // On: 13 full (the MTP layer) + 36 GDN: groups of 13 (36 >= 1.5 x 13), the GDN layers in
    // cdiv(36, 13) = 3 groups of 12, 3 padding slots; a block id takes 13 pages.
    EXPECT_EQ(on.engine.group_size, 13);
    EXPECT_EQ(on.engine.groups.size(), 4u);
    EXPECT_EQ(on.engine.padding_slots(), 3);
    EXPECT_EQ(on.engine.block_bytes[0], page * 13);
    EXPECT_EQ(on.engine.speculative_blocks, 2);

    // Drafter at tp 4: Q/K/V/O of 4 query heads and 1 KV head of 256 (as kvshard sizes the
    // model's own full layers), the output gate of the 4 heads, q_norm / k_norm of 256, 512 routed
    // + 1 shared expert of 3 x 2048 x 512 split by tp, the gate and the shared_expert_gate (h)
    // whole, two norms; fc (2h x h) split by tp and three norms. bf16.
    const int64_t h = 2048;
    const int64_t attn = 3 * h * 4 * 256 + 2 * h * 1 * 256 + 2 * 256;
    const int64_t expert = 3 * h * 512;
    const int64_t moe = (512 * expert + expert) / 4 + h * 512 + h;
    const int64_t drafter = 2 * (attn + moe + 2 * h + 2 * h * h / 4 + 3 * h);
    EXPECT_EQ(drafter, 827876352);
    EXPECT_EQ(on.ranks[0].weights.drafter, drafter);
    EXPECT_EQ(on.ranks[0].kv_budget_bytes, off.ranks[0].kv_budget_bytes - drafter);

    const int64_t blocks = on.ranks[0].kv_budget_bytes / (page * 13);
    EXPECT_EQ(on.kv_blocks_per_gpu, blocks);
    EXPECT_EQ(on.kv_tokens_per_gpu, blocks / 4 * 288);  // vLLM logs blocks / groups x block
    // A request of 8192 tokens (align mode, past one block): the full group cdiv(8192, 288) = 29
    // blocks, each GDN group 2 + 2 speculative state blocks.
    EXPECT_EQ(on.request_blocks, ceil_div(8192, 288) + 3 * (2 + 2));
    EXPECT_EQ(on.request_blocks, 41);
    EXPECT_EQ(off.request_blocks, 31 + 3 * 2);
    EXPECT_EQ(on.requests_per_replica, blocks / 41);
    // vLLM's startup check: cdiv(M, 288) + 3 x (2 + 2) <= blocks.
    EXPECT_EQ(on.max_context, (blocks - 12) * 288);
    EXPECT_GT(off.requests_per_replica, on.requests_per_replica);

    // Prefix caching off (mamba_cache_mode none): 1 + 2 state blocks per GDN group.
    CapacityOptions none;
    none.mamba_cache_mode = MambaCacheMode::kNone;
    const CapacityReport on_none = on_h100(m, 4, 2, none);
    EXPECT_EQ(on_none.request_blocks, 29 + 3 * (1 + 2));
    EXPECT_EQ(on_none.max_context, (on_none.kv_blocks_per_gpu - 9) * 288);
    // More draft tokens, more state blocks per request: fewer requests, same pool (3 + 4 conv
    // rows: (7 x 2048 + 131072) x 2 = 290,816 B, still a block of 288).
    const CapacityReport on4 = on_h100(m, 4, 4);
    EXPECT_EQ(on4.engine.block_size, 288);
    EXPECT_EQ(on4.kv_blocks_per_gpu, blocks);
    EXPECT_EQ(on4.request_blocks, 29 + 3 * (2 + 4));
    EXPECT_EQ(on4.requests_per_replica, blocks / 47);
}

TEST(CapacityMtp, SeparateArrangementCountsAStatePerDraftToken) {
    // A given --block-size below vLLM's (272) keeps kvshard's separate sizing: each state layer's
    // state once per request, plus one per draft token (num_speculative_blocks).
    CapacityOptions o;
    o.block_size = 16;
    o.raise_block_size = false;
    const ModelSpec m = catalog_model("qwen3-next-80b-a3b");
    const CapacityReport off = on_h100(m, 4, 0, o);
    const CapacityReport on = on_h100(m, 4, 2, o);
    ASSERT_EQ(on.engine.kind, EngineKvKind::kSeparate);
    const int64_t states = 36 * int64_t{274432};  // 36 GDN layers' state at tp 4
    EXPECT_EQ(off.request_kv_bytes, 8192 * 12 * 1024 + states);
    // Speculating, each state's conv keeps 2 more rows of 2048 bf16 channels.
    const int64_t spec_states = 36 * (int64_t{274432} + 2 * 2048 * 2);
    EXPECT_EQ(on.request_kv_bytes, 8192 * 13 * 1024 + (1 + 2) * spec_states);
    EXPECT_EQ(on.requests_per_replica, on.ranks[0].kv_budget_bytes / on.request_kv_bytes);
}

TEST(CapacityMtp, RefusesAModelWithoutMtpLayers) {
    const ModelSpec plain = load_hf_config(kData + "/hf_configs/qwen3-8b.json");
    try {
        on_h100(plain, 1, 2);
        FAIL() << "speculation accepted on a model without MTP layers";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("carries none"), std::string::npos) << e.what();
    }
    // Checkpoints whose MTP layers the reader drops on purpose: the refusal says why, per model
    // (MtpSpec::not_modelled), never that the config names none. From vLLM's
    // SpeculativeConfig.hf_config_override (vllm/config/speculative.py), which picks the
    // drafter: it maps longcat_flash to longcat_flash_mtp (vLLM drafts; kvshard does not model
    // it), and nothing for MiniMax-M2 (minimax_m3 only), Ling 2.0 (bailing_hybrid only), dots1,
    // or GLM-4.5V (architectures[0] Glm4MoeForCausalLM only).
    auto refusal = [](const ModelSpec& m) {
        EXPECT_FALSE(m.mtp.enabled());
        try {
            on_h100(m, 8, 2);
        } catch (const Error& e) {
            const std::string what = e.what();
            EXPECT_EQ(what.find("carries none"), std::string::npos) << what;
            return what;
        }
        ADD_FAILURE() << "speculation accepted on " << m.name;
        return std::string();
    };
    auto json_of = [](const std::string& name) {
        std::ifstream in(kData + "/hf_configs/" + name + ".json");
        return nlohmann::json::parse(in);
    };
    EXPECT_NE(refusal(load_hf_config(kData + "/hf_configs/minimax-m2.json"))
                  .find("carries MTP layers that are not modelled: vLLM builds no drafter for "
                        "MiniMax-M2 (minimax_m2): vllm/config/speculative.py's "
                        "SpeculativeConfig.hf_config_override maps minimax_m3 to MiniMaxM3MTP and "
                        "nothing for minimax_m2; its num_mtp_modules are not read"),
              std::string::npos);
    EXPECT_NE(refusal(load_hf_config(kData + "/hf_configs/longcat-flash-chat.json"))
                  .find("carries MTP layers that are not modelled: kvshard does not model "
                        "LongCat-Flash's drafter (vLLM drafts with longcat_flash_mtp.py"),
              std::string::npos);
    EXPECT_NE(refusal(load_hf_config(kData + "/hf_configs/ling-flash-2.0.json"))
                  .find("vLLM builds no drafter for Ling 2.0 (bailing_moe_v2): "),
              std::string::npos);
    nlohmann::json dots = json_of("dots.llm1.inst");
    dots["num_nextn_predict_layers"] = 1;
    EXPECT_NE(refusal(parse_hf_config(dots.dump(), "dots.json"))
                  .find("vLLM builds no drafter for dots.llm1 (dots1): "),
              std::string::npos);
    nlohmann::json glm = json_of("glm-4.5v");
    glm["text_config"]["num_nextn_predict_layers"] = 1;
    EXPECT_NE(refusal(parse_hf_config(glm.dump(), "glm.json"))
                  .find("vLLM builds no drafter for GLM-4.5V / 4.6V (glm4v_moe): "),
              std::string::npos);
    // The reason travels with the spec's JSON.
    const ModelSpec longcat = load_hf_config(kData + "/hf_configs/longcat-flash-chat.json");
    EXPECT_EQ(model_spec_from_json(to_json(longcat)).mtp.not_modelled, longcat.mtp.not_modelled);
    // A reason beside modelled MTP layers contradicts itself.
    ModelSpec both = catalog_model("deepseek-v3");
    ASSERT_TRUE(both.mtp.enabled());
    both.mtp.not_modelled = "x";
    EXPECT_THROW(both.validate(), Error);
    // A LongCat config stating num_nextn_predict_layers 0 carries none.
    nlohmann::json no_mtp = json_of("longcat-flash-chat");
    no_mtp["num_nextn_predict_layers"] = 0;
    EXPECT_TRUE(parse_hf_config(no_mtp.dump(), "l.json").mtp.not_modelled.empty());
    CapacityOptions o;
    o.speculative_tokens = -1;
    EXPECT_THROW(o.validate(), Error);
}

// NVIDIA-Nemotron-3-Nano-30B-A3B's geometry (as tests/model/hf_config_audit_test.cpp quotes it)
// with the MTP fields Nemotron 3 Super carries (num_nextn_predict_layers 1,
// mtp_hybrid_override_pattern "*E"). No published Nemotron-H checkpoint with MTP layers has a
// plain MoE: Super and Ultra carry LatentMoE (moe_latent_size), which is refused, not sized.
std::string nemotron_mtp_config(const std::string& mtp_fields) {
    return R"({"model_type": "nemotron_h", "head_dim": 128, "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "intermediate_size": 1856, "mamba_head_dim": 64, "mamba_num_heads": 64, "n_groups": 8,
        "ssm_state_size": 128, "conv_kernel": 4, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "n_routed_experts": 128,
        "n_shared_experts": 1, "num_attention_heads": 32, "num_experts_per_tok": 6,
        "num_hidden_layers": 52, "num_key_value_heads": 2, "torch_dtype": "bfloat16",
        "vocab_size": 131072)" +
           mtp_fields + "}";
}

std::string nemotron_mtp_error(const std::string& mtp_fields) {
    try {
        parse_hf_config(nemotron_mtp_config(mtp_fields), "nemotron-mtp/config.json");
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

TEST(CapacityMtp, NemotronHReadsItsMtpStepAsVllmBuildsIt) {
    // vLLM's NemotronHMultiTokenPredictor (models/nemotron_h_mtp.py): one step of the layers of
    // mtp_hybrid_override_pattern, '*' a NemotronHAttentionDecoderLayer, 'E' a
    // NemotronHMoEDecoderLayer; eh_proj a ColumnParallelLinear, split by TP.
    const ModelSpec m = parse_hf_config(nemotron_mtp_config(R"(, "num_nextn_predict_layers": 1,
            "mtp_hybrid_override_pattern": "*E")"),
                                        "nemotron-mtp/config.json");
    EXPECT_EQ(m.num_layers, 52);
    EXPECT_EQ(m.mtp.layers, 1);
    EXPECT_EQ(m.mtp.layer.kind, LayerKind::kFullAttention);
    EXPECT_EQ(m.mtp.layer.num_kv_heads, 2);
    EXPECT_EQ(m.mtp.layer.head_dim, 128);
    EXPECT_EQ(m.mtp.layer.mlp, MlpKind::kNone);  // the attention layer has no MLP
    ASSERT_EQ(m.mtp.following.size(), 1u);
    EXPECT_EQ(m.mtp.following[0].kind, LayerKind::kNoKv);
    EXPECT_EQ(m.mtp.following[0].mlp, MlpKind::kMoe);
    EXPECT_TRUE(m.mtp.proj_split_by_tp);
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);
    // The draft layers follow the model's: 52 + 2, the attention one caching, the MoE one not.
    const ModelSpec d = with_mtp_layers(m);
    EXPECT_EQ(d.num_layers, 54);
    EXPECT_EQ(d.layer(52).kind, LayerKind::kFullAttention);
    EXPECT_EQ(d.layer(53).kind, LayerKind::kNoKv);
    EXPECT_EQ(d.layer(53).mlp, MlpKind::kMoe);

    // mtp_layers_block_type, from which some NemotronH config classes derive the pattern.
    EXPECT_EQ(parse_hf_config(nemotron_mtp_config(R"(, "num_nextn_predict_layers": 1,
                  "mtp_layers_block_type": ["attention", "moe"])"),
                              "nemotron-mtp/config.json")
                  .mtp,
              m.mtp);
    // Without num_nextn_predict_layers (or 0) the pattern names no drafter.
    EXPECT_FALSE(parse_hf_config(nemotron_mtp_config(R"(, "mtp_hybrid_override_pattern": "*E")"),
                                 "nemotron-mtp/config.json")
                     .mtp.enabled());

    // What vLLM refuses, or kvshard does not size, is refused.
    EXPECT_NE(nemotron_mtp_error(R"(, "num_nextn_predict_layers": 2,
                  "mtp_hybrid_override_pattern": "*E")")
                  .find("asserts num_nextn_predict_layers == 1"),
              std::string::npos);
    EXPECT_NE(nemotron_mtp_error(R"(, "num_nextn_predict_layers": 1,
                  "mtp_hybrid_override_pattern": "*M")")
                  .find("has 'M' at 1"),
              std::string::npos);
    EXPECT_NE(nemotron_mtp_error(R"(, "num_nextn_predict_layers": 1,
                  "mtp_hybrid_override_pattern": "E*")")
                  .find("starts with its attention layer"),
              std::string::npos);
    EXPECT_NE(nemotron_mtp_error(R"(, "num_nextn_predict_layers": 1)")
                  .find("names no mtp_hybrid_override_pattern"),
              std::string::npos);
    EXPECT_NE(nemotron_mtp_error(R"(, "num_nextn_predict_layers": 1,
                  "mtp_layers_block_type": ["attention", "mamba"])")
                  .find("names 'mamba'"),
              std::string::npos);
}

TEST(CapacityMtp, NemotronSuperLatentMoeOnEightH100s) {
    // Nemotron 3 Super (a labelled reconstruction of its config, tests/data/hf_configs) at tp 8,
    // bf16, MTP with 2 draft tokens: kvshard plan --model <it> --hardware h100-sxm --gpus 8
    // --context 8192 --speculative-method mtp --speculative-tokens 2.
    const ModelSpec m = load_hf_config(kData + "/hf_configs/nemotron-3-super-120b-a12b.json");
    const CapacityReport off = on_h100(m, 8, 0);
    const CapacityReport on = on_h100(m, 8, 2);
    ASSERT_TRUE(on.fits) << on.why_not;
    // vLLM's NemotronHMoE (models/nemotron_h.py): the routed experts (FusedMoE of hidden_size
    // moe_latent_size = 1024, up and down of 2688) split over tp at ep 1, as kvshard splits
    // experts; the shared expert (NemotronHMLP at hidden, 5376 wide) split by tp;
    // fc1_latent_proj / fc2_latent_proj (ReplicatedLinear, 4096 x 1024 each) and the router
    // (4096 x 512, with its e_score_correction_bias of 512) whole on every rank.
    const int64_t h = 4096;
    const int64_t routed = 2 * 1024 * 2688, shared = 2 * h * 5376, latent = 2 * h * 1024;
    const int64_t router = h * 512 + 512;
    const int64_t moe = 512 * routed / 8 + shared / 8 + latent + router;
    EXPECT_EQ(off.ranks[0].weights.experts, 40 * moe * 2);  // 40 MoE layers, bf16
    // Under ep 8 each rank holds 64 whole routed experts; the rest as at ep 1.
    ParallelConfig ep;
    ep.tp = 8;
    ep.ep = 8;
    EXPECT_EQ(rank_weight_bytes(make_layout(m, ep), 3).experts,
              40 * 2 * (64 * routed + shared / 8 + latent + router));
    // The drafter ("*E"): the attention layer (Q and O of 4 of 32 heads, K and V of 1 of 2 KV
    // heads replicated, head_dim 128), the latent MoE layer, one norm a layer (NemotronH's
    // decoder layers hold one mixer each), eh_proj (2h x h split by tp), enorm, hnorm and
    // final_layernorm.
    const int64_t attention = 2 * h * 4 * 128 + 2 * h * 1 * 128;
    const int64_t drafter = 2 * (attention + moe + 2 * h + 2 * h * h / 8 + 3 * h);
    EXPECT_EQ(on.ranks[0].weights.drafter, drafter);
    EXPECT_EQ(on.ranks[0].kv_budget_bytes, off.ranks[0].kv_budget_bytes - drafter);
    // KV: 8 attention layers of 1 KV head of 128 per rank, bf16; 9 with the drafter's.
    EXPECT_EQ(off.kv_bytes_per_token, 8 * 2 * 1 * 128 * 2);
    EXPECT_EQ(on.kv_bytes_per_token, 9 * 2 * 1 * 128 * 2);
    // Weights per GPU: about 241 GB / 8 of the model's bf16 parameters.
    EXPECT_NEAR(static_cast<double>(off.ranks[0].weights.total()),
                2.0 * static_cast<double>(m.total_params()) / 8, 0.05 * 2 * 120.7e9 / 8);
}

TEST(CapacityMtp, NemotronHTp2GrowsItsMamba2ConvStatesAndAddsAnAttentionLayer) {
    const ModelSpec m = parse_hf_config(nemotron_mtp_config(R"(, "num_nextn_predict_layers": 1,
            "mtp_hybrid_override_pattern": "*E")"),
                                        "nemotron-mtp/config.json");
    ASSERT_EQ(m.state.conv_dtype, DType::kBf16);
    const CapacityReport off = on_h100(m, 2, 0);
    const CapacityReport on = on_h100(m, 2, 2);
    ASSERT_TRUE(on.fits) << on.why_not;

    // KV: 6 attention layers of 2 KV heads of 128 (1 per rank at tp 2) in bf16, 7 with the
    // drafter's; its MoE layer caches nothing.
    EXPECT_EQ(off.kv_bytes_per_token, 6 * 2 * 1 * 128 * 2);
    EXPECT_EQ(on.kv_bytes_per_token, 7 * 2 * 1 * 128 * 2);

    // Mamba-2 conv state: vLLM's Mamba2Base.get_state_shape (MambaMixer2 hands it
    // vllm_config.num_speculative_tokens) passes num_spec to
    // MambaStateShapeCalculator.mamba2_state_shape, whose conv state keeps conv_kernel - 1 +
    // num_spec rows of (intermediate + 2 * n_groups * d_state) / tp channels: at tp 2,
    // 64 * 64 / 2 + 2 * 8 * 128 / 2 = 3072 channels, 3 rows off, 3 + 2 speculating. The SSM state
    // is unchanged. 23 Mamba-2 layers.
    const int64_t conv_channels = 64 * 64 / 2 + 2 * 8 * 128 / 2;
    EXPECT_EQ(conv_channels, 3072);
    EXPECT_EQ(on.state_bytes_per_sequence - off.state_bytes_per_sequence,
              23 * int64_t{2} * conv_channels * 2);

    // The drafter per rank, bf16: the attention layer (Q and O of 16 of 32 heads, K and V of 1 of
    // 2 KV heads, head_dim 128), the MoE layer (128 routed and a shared expert of twice 1856,
    // squared-ReLU: up and down, split by tp; the router and its e_score_correction_bias whole),
    // one norm a layer, eh_proj (2h x h split by tp) and enorm, hnorm, final_layernorm.
    const int64_t h = 2688;
    const int64_t attention = 2 * h * 16 * 128 + 2 * h * 1 * 128;
    const int64_t expert = 2 * h * 1856;
    const int64_t moe = 128 * expert / 2 + 2 * expert / 2 + h * 128 + 128;
    const int64_t drafter = 2 * (attention + moe + 2 * h + 2 * h * h / 2 + 3 * h);
    EXPECT_EQ(on.ranks[0].weights.drafter, drafter);
    EXPECT_EQ(on.ranks[0].kv_budget_bytes, off.ranks[0].kv_budget_bytes - drafter);
}

TEST(CapacityMtp, OnlyGdnAndMamba2ConvStatesGrowWhileDrafting) {
    // Kimi Linear's KDA: KimiGatedDeltaNetAttention.get_state_shape calls kda_state_shape without
    // num_spec (gdn/kimi_gdn_linear_attn.py), so its conv keeps conv_kernel - 1 rows. Given MTP
    // layers by hand (its config's are refused: vLLM skips them), its states stay as they are.
    ModelSpec kimi = load_hf_config(kData + "/hf_configs/kimi-linear-48b-a3b-instruct.json");
    ASSERT_TRUE(kimi.state.kda);
    kimi.mtp.layers = 1;
    kimi.mtp.layer = kimi.layer(kimi.num_layers - 1);
    const CapacityReport off = on_gpu("h200", kimi, 2, 0);
    const CapacityReport on = on_gpu("h200", kimi, 2, 2);
    EXPECT_EQ(on.state_bytes_per_sequence, off.state_bytes_per_sequence);
}

TEST(CapacityMtp, GlmAirPp2PutsTheDrafterOnTheLastStageWithItsOwnEmbedding) {
    // vLLM at pp > 1: GPUModelRunner.__init__ builds the drafter only on the last PP rank
    // ("currently we put the entire draft model on the last PP rank"), and
    // LLMBaseProposer._maybe_share_embeddings shares the target's embedding only when the PP
    // group has one rank, so there the drafter loads its own (a VocabParallelEmbedding, split by
    // tp); the LM head, on the last stage, is still shared.
    const ModelSpec m = load_hf_config(kData + "/hf_configs/glm-4.5-air.json");
    ParallelConfig p;
    p.pp = 2;
    p.tp = 2;
    CapacityOptions o;
    o.context_tokens = 8192;
    const CapacityReport off = compute_capacity(m, p, hardware_by_name("h100-sxm"), o);
    o.speculative_tokens = 2;
    const CapacityReport on = compute_capacity(m, p, hardware_by_name("h100-sxm"), o);
    ASSERT_EQ(on.ranks.size(), 4u);

    // KV: 46 layers split 23 + 23, the MTP layer on stage 1 (ranks 2, 3); a GQA layer of 2 x 4 of
    // 8 KV heads x 128 in bf16 per token at tp 2.
    const int64_t layer_kv = 2 * 4 * 128 * 2;
    for (int r : {0, 1}) {
        EXPECT_EQ(off.ranks[r].kv_bytes_per_token, 23 * layer_kv);
        EXPECT_EQ(on.ranks[r].kv_bytes_per_token, 23 * layer_kv);
        EXPECT_EQ(on.ranks[r].weights.drafter, 0);  // no drafter off the last stage
        EXPECT_EQ(on.ranks[r].weights.total(), off.ranks[r].weights.total());
    }
    // Weights on stage 1: the drafter of a pp 1 layout of the same tp (its decoder layer split by
    // tp 2, eh_proj whole, three norms) plus its own embedding of ceil(151552 / 2) x 4096 bf16.
    ParallelConfig tp2;
    tp2.tp = 2;
    const int64_t embedding = (151552 + 1) / 2 * int64_t{4096} * 2;
    for (int r : {2, 3}) {
        EXPECT_EQ(on.ranks[r].kv_bytes_per_token, 24 * layer_kv);
        EXPECT_EQ(on.ranks[r].weights.drafter,
                  rank_drafter_weight_bytes(m, tp2, r - 2) + embedding);
        EXPECT_EQ(rank_drafter_weight_bytes(m, p, r), on.ranks[r].weights.drafter);
        EXPECT_EQ(on.ranks[r].weights.total() - on.ranks[r].weights.drafter,
                  off.ranks[r].weights.total());
    }
    EXPECT_EQ(rank_drafter_weight_bytes(m, p, 0), 0);
    // The last stage, with more weights and more KV per token, holds fewer tokens.
    EXPECT_EQ(on.limiting_rank, 2);
    EXPECT_LT(on.kv_tokens_per_gpu, off.kv_tokens_per_gpu);
}

}  // namespace
}  // namespace kvshard
