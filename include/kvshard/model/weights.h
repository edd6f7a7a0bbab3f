#pragma once
// Weights of a Llama-family decoder (dense or Mixtral-style MoE), fp32, for the whole model or for
// the slice one rank holds under TP / PP / EP (docs/model.md).
//
// Shapes follow Hugging Face nn.Linear: a weight is [out_features][in_features], row-major, and a
// projection computes y = x W^T. Slicing is Megatron-style:
//   q_proj / k_proj / v_proj: rows of the held heads (column parallel),
//   o_proj: columns of the held query heads (row parallel),
//   gate_proj / up_proj: rows [mlp_begin, mlp_end), down_proj: the same columns,
//   experts: whole experts [expert_begin, expert_end), layers: [layer_begin, layer_end).
// Embedding, final norm, LM head and router are replicated on every rank that holds them.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvshard/model/model_spec.h"

namespace kvshard {

// The part of the model one rank holds. A value; `full(m)` is the unsharded model.
struct WeightShard {
    int layer_begin = 0, layer_end = 0;
    int q_head_begin = 0, q_head_end = 0;
    int kv_head_begin = 0, kv_head_end = 0;  // may be shared with other ranks (tp > H_kv)
    int mlp_begin = 0, mlp_end = 0;          // dense MLP intermediate columns
    int expert_begin = 0, expert_end = 0;    // routed experts of every MoE layer
    // Gated DeltaNet layers: value heads [state_head_begin, state_head_end) of
    // ModelSpec::state.heads; their key heads are v / (heads / groups), a contiguous range (one key
    // head shared by several ranks where tp exceeds the key heads).
    int state_head_begin = 0, state_head_end = 0;

    int num_layers() const { return layer_end - layer_begin; }
    int num_q_heads() const { return q_head_end - q_head_begin; }
    int num_kv_heads() const { return kv_head_end - kv_head_begin; }
    int mlp_width() const { return mlp_end - mlp_begin; }
    int num_experts() const { return expert_end - expert_begin; }
    int num_state_heads() const { return state_head_end - state_head_begin; }
    // Key heads (GDN groups) of the held value heads: [begin, end) of ModelSpec::state.groups.
    int state_group_begin(const ModelSpec& m) const;
    int state_group_end(const ModelSpec& m) const;
    bool operator==(const WeightShard&) const = default;

    static WeightShard full(const ModelSpec& m);
};

struct ExpertWeights {
    std::vector<float> gate;  // w1 [expert_intermediate][hidden]
    std::vector<float> up;    // w3 [expert_intermediate][hidden]
    std::vector<float> down;  // w2 [hidden][expert_intermediate]
};

// One layer. Which members are filled depends on the layer's kind (docs/model.md, "The
// reference model's layers"):
//   full / sliding / chunked: attn_norm, wq, wk, wv, (biases), wo, and sinks when learned_sinks
//   mla (DeepSeek-V3 names):  attn_norm, wq (q_b_proj, or q_proj when q_lora_rank is 0: rows of the
//                             held heads x (qk_nope + qk_rope)), wq_a + q_a_norm (q_lora_rank > 0),
//                             wkv_a (kv_a_proj_with_mqa, whole: the latent every rank caches),
//                             kv_a_norm, wkv_b (kv_b_proj rows of the held heads x (qk_nope + v)),
//                             wo (columns of the held heads x v_head_dim)
//   gated_deltanet (Qwen3-Next linear_attn names): attn_norm, lin_q / lin_k (held key heads x k_d),
//                             lin_v / lin_z (held value heads x v_d), lin_b / lin_a (held value
//                             heads), conv ([q | k | v channels held][conv_kernel]), dt_bias,
//                             a_log, lin_norm ([v_d]), wo (out_proj columns of the held heads)
//   none: no mixer weights.
// Then mlp_norm and the dense or MoE MLP (none for an MLP-less layer).
struct LayerWeights {
    LayerKind kind = LayerKind::kFullAttention;
    std::vector<float> attn_norm;       // [hidden]
    std::vector<float> wq;              // [n_q * head_dim][hidden]
    std::vector<float> wk, wv;          // [n_kv * head_dim][hidden]
    std::vector<float> bq, bk, bv;      // q/k/v biases (Qwen2), empty when the model has none
    std::vector<float> wo;              // [hidden][n_q * head_dim]
    std::vector<float> sinks;           // learned sinks of the held query heads [n_q]
    std::vector<float> wq_a, q_a_norm;  // MLA with q_lora_rank > 0
    std::vector<float> wkv_a, kv_a_norm, wkv_b;                   // MLA
    std::vector<float> lin_q, lin_k, lin_v, lin_z, lin_b, lin_a;  // Gated DeltaNet projections
    std::vector<float> conv, dt_bias, a_log, lin_norm;            // Gated DeltaNet
    std::vector<float> mlp_norm;                                  // [hidden]
    std::vector<float> gate, up;                                  // dense MLP: [mlp_width][hidden]
    std::vector<float> down;                                      // dense MLP: [hidden][mlp_width]
    std::vector<float> router;           // MoE: [num_experts][hidden], all experts
    std::vector<ExpertWeights> experts;  // MoE: experts [expert_begin, expert_end)
};

struct ModelWeights {
    ModelSpec spec;
    WeightShard shard;
    std::vector<float> embed;          // [vocab][hidden]
    std::vector<float> final_norm;     // [hidden]
    std::vector<float> lm_head;        // [vocab][hidden] (a copy of embed when tied)
    std::vector<LayerWeights> layers;  // layers [shard.layer_begin, shard.layer_end)

    const LayerWeights& layer(int global_layer) const {
        return layers[global_layer - shard.layer_begin];
    }
};

// A place tensors come from, by Hugging Face name. 1-D tensors have shape {n}; they are read as n
// rows of one column.
class TensorSource {
  public:
    virtual ~TensorSource() = default;
    virtual bool has(const std::string& name) const = 0;
    // Rows [row_begin, row_end) x columns [col_begin, col_end) of `name` as fp32, row-major. Throws
    // Error naming the tensor when it is missing or its shape is not `shape`.
    virtual std::vector<float> read(const std::string& name, const std::vector<int64_t>& shape,
                                    int64_t row_begin, int64_t row_end, int64_t col_begin,
                                    int64_t col_end) const = 0;
};

// Deterministic random tensors: element i of tensor `name` is a pure function of (seed, name, i),
// so every rank generates exactly its slice of the same full tensors. Norm weights are 1 + U(-0.1,
// 0.1), projections U(-1, 1)/sqrt(in_features), the embedding U(-1, 1). It has every tensor except
// biases.
std::unique_ptr<TensorSource> random_tensor_source(uint64_t seed);

// Builds the weights of `shard` from a source, checking every shape. Throws Error naming the
// tensor.
ModelWeights load_weights(const ModelSpec& m, const WeightShard& shard, const TensorSource& source);
ModelWeights random_weights(const ModelSpec& m, const WeightShard& shard, uint64_t seed);

// The fp32 bytes load_weights(m, shard, ...) holds, computed without loading (biases, which only
// some checkpoints have, not counted): what a run checks against its memory limit before it loads
// anything. Counted in double, so that no shard of a model the spec accepts can overflow it.
double weight_shard_bytes(const ModelSpec& m, const WeightShard& shard);

// Refuses (Error naming the layer and what would run) a model the reference model cannot execute:
// Mamba-2 layers, attention layers whose KV heads or head_dim differ from the model's, per-layer
// MLP widths, shared experts.
void check_executable(const ModelSpec& m);

// Hugging Face tensor names (Llama / Qwen2 / Mixtral; gpt-oss sinks; DeepSeek-V3 MLA; Qwen3-Next
// Gated DeltaNet).
namespace hf_names {
std::string layer_prefix(int layer);                  // "model.layers.N."
std::string expert(int layer, int e, const char* w);  // w: "w1" | "w2" | "w3" (Mixtral)
inline constexpr const char* kEmbed = "model.embed_tokens.weight";
inline constexpr const char* kFinalNorm = "model.norm.weight";
inline constexpr const char* kLmHead = "lm_head.weight";
}  // namespace hf_names

// Every (name, shape) of the full model as a Hugging Face checkpoint stores it (Mixtral names for
// MoE).
std::vector<std::pair<std::string, std::vector<int64_t>>> hf_tensor_list(const ModelSpec& m);

}  // namespace kvshard
