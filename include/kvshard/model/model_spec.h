#pragma once
// ModelSpec: the shape of a transformer as far as KV, weights and FLOPs are concerned.
// A value: comparable, printable as JSON, loadable from a Hugging Face config.json.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/common/dtype.h"

namespace kvshard {

enum class AttentionKind { kMha, kGqa, kMqa, kMla };
std::string_view attention_kind_name(AttentionKind k);  // "MHA", "GQA", "MQA", "MLA"

// Multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent of kv_lora_rank plus the
// decoupled rope key of qk_rope_head_dim per token and layer, shared by all heads.
struct MlaSpec {
    int kv_lora_rank = 0;
    int qk_rope_head_dim = 0;
    int qk_nope_head_dim = 0;
    int v_head_dim = 0;
    int q_lora_rank = 0;  // 0: queries projected directly from the hidden state
    bool operator==(const MlaSpec&) const = default;
};

struct MoeSpec {
    int num_experts = 0;        // routed experts; 0 means a dense model
    int experts_per_token = 0;  // top-k
    int shared_experts = 0;     // always-on experts (DeepSeek), each of expert_intermediate width
    int expert_intermediate = 0;
    int first_dense_layers = 0;  // layers [0, first_dense_layers) use the dense MLP
    bool enabled() const { return num_experts > 0; }
    bool operator==(const MoeSpec&) const = default;
};

struct ModelSpec {
    std::string name;
    int num_layers = 0;
    int hidden = 0;
    int num_heads = 0;     // query heads
    int num_kv_heads = 0;  // KV heads (MLA: equal to num_heads, but the cache holds one latent)
    int head_dim = 0;
    int intermediate = 0;  // dense MLP width
    int vocab = 0;
    AttentionKind attention = AttentionKind::kGqa;
    MlaSpec mla;
    MoeSpec moe;
    DType kv_dtype = DType::kBf16;
    DType weight_dtype = DType::kBf16;
    double rope_theta = 10000.0;
    double rms_norm_eps = 1e-5;
    bool tie_embeddings = false;

    bool operator==(const ModelSpec&) const = default;

    bool is_mla() const { return attention == AttentionKind::kMla; }
    bool is_moe_layer(int layer) const { return moe.enabled() && layer >= moe.first_dense_layers; }
    int num_moe_layers() const;

    // Elements of KV per token per layer for the whole model (all heads): 2*H_kv*d, or the MLA
    // latent.
    int64_t kv_elems_per_token_per_layer() const;

    // Parameter counts (elements), used for weight memory and FLOPs.
    int64_t attention_params_per_layer() const;
    int64_t dense_mlp_params_per_layer() const;  // 3 * hidden * intermediate (SwiGLU)
    int64_t expert_params() const;         // one routed expert: 3 * hidden * expert_intermediate
    int64_t moe_params_per_layer() const;  // all routed + shared experts + router
    int64_t embedding_params() const;      // vocab * hidden
    int64_t lm_head_params() const;        // 0 when tied
    int64_t total_params() const;
    int64_t active_params_per_token() const;  // what one token multiplies through (top-k experts)

    // Throws kvshard::Error naming the first bad field.
    void validate() const;
};

// JSON (the same field names as `kvshard model --json`).
std::string to_json(const ModelSpec& m);
ModelSpec model_spec_from_json(std::string_view json_text);

}  // namespace kvshard
