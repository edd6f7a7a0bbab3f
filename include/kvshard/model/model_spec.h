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
    // Always-on experts (DeepSeek), each of expert_intermediate width; a shared expert of k times
    // that width (Qwen2-MoE, Nemotron-H) counts as k.
    int shared_experts = 0;
    int expert_intermediate = 0;
    int first_dense_layers = 0;  // layers [0, first_dense_layers) use the dense MLP
    // LatentMoE (Nemotron 3 Super / Ultra): the routed experts run in this width, between two
    // replicated projections hidden -> latent_size and latent_size -> hidden; the router and the
    // shared experts stay at hidden. 0: no latent, the routed experts run at hidden.
    int latent_size = 0;
    // The engine's MoE block refuses tp above num_experts (vLLM's lfm2_moe.py,
    // Lfm2MoeSparseMoeBlock: "Tensor parallel size ... is greater than the number of experts");
    // set by the config reader for such a family, checked by validate(model, parallel).
    bool tp_at_most_experts = false;
    bool enabled() const { return num_experts > 0; }
    bool operator==(const MoeSpec&) const = default;
};

// What one layer keeps per sequence (docs/model.md gives each kind's formula and config fields).
enum class LayerKind {
    kFullAttention,  // K and V of every token
    kSlidingWindow,  // K and V of the last `window` tokens (a query sees itself and window-1
                     // before)
    kChunkedLocal,   // K and V of the tokens of the current chunk of `window` tokens (Llama 4)
    kMla,            // the MLA latent of every token (kv_lora_rank + qk_rope_head_dim)
    kGatedDeltaNet,  // linear attention: a fixed conv + recurrent state per sequence (Qwen3-Next;
                     // Kimi Linear's KDA, StateSpec::kda)
    kMamba2,         // SSM: a fixed conv + SSM state per sequence (Nemotron-H, Granite 4)
    kMamba1,         // SSM (Mamba-1, Jamba): a conv + SSM state per channel, no heads or groups
    kShortConv,      // a gated short convolution: a conv state only per sequence (LFM2)
    kNoKv,           // no KV: an MLP-only layer or a no-op / linear-replaced attention
};
std::string_view layer_kind_name(LayerKind k);  // "full", "sliding", "chunked", "mla", ...
LayerKind parse_layer_kind(std::string_view s);
bool holds_tokens(LayerKind k);  // full, sliding, chunked, mla: KV grows with the sequence
bool holds_state(LayerKind k);   // gated_deltanet, mamba2, mamba1, short_conv: a constant state

// The MLP of one layer.
enum class MlpKind { kDense, kMoe, kNone };

// One layer. Attention kinds carry their own KV heads and head_dim (Nemotron Super varies them per
// layer); state kinds take their shape from ModelSpec::state.
struct LayerSpec {
    LayerKind kind = LayerKind::kFullAttention;
    int num_kv_heads = 0;  // attention kinds except MLA
    int head_dim = 0;      // attention kinds except MLA: per-head dim of K and of V
    int window = 0;        // kSlidingWindow: W; kChunkedLocal: chunk size C; else 0
    // gpt-oss: a learned per-head sink logit joins the softmax. It holds no KV and keeps no token.
    bool learned_sinks = false;
    bool indexer = false;  // DeepSeek-V3.2: this layer also caches ModelSpec::indexer keys
    MlpKind mlp = MlpKind::kDense;
    int intermediate = 0;  // kDense: this layer's MLP width (Nemotron Super varies it)
    bool operator==(const LayerSpec&) const = default;
};

// The recurrent state of linear-attention / SSM layers, one shape per model.
//  Gated DeltaNet: conv state (conv_kernel-1) x (2*k_heads*k_head_dim + v_heads*v_head_dim),
//                  recurrent state v_heads x k_head_dim x v_head_dim.
//  Mamba-2:        conv state (conv_kernel-1) x (heads*head_dim + 2*groups*d_state),
//                  SSM state heads x head_dim x d_state.
//  Short conv:     conv state (conv_kernel-1) x heads, no recurrent state: heads are the conv
//                  channels (LFM2's conv_dim), head_dim 1, groups and group_dim 0; the same
//                  formula then gives vLLM's short_conv_state_shape.
//  Mamba-1:        conv state (conv_kernel-1) x heads, SSM state heads x d_state: heads are the
//                  d_inner channels (mamba_expand x hidden), head_dim 1, groups 0 (no B/C in the
//                  conv), group_dim d_state; the same formula then gives vLLM's
//                  MambaStateShapeCalculator.mamba1_state_shape ((d_conv-1, d_inner/tp) and
//                  (d_inner/tp, d_state)). Groups of 0 add no conv columns at any tp.
// TP splits the heads (and the key heads / groups) as it splits KV heads.
struct StateSpec {
    int heads = 0;        // GDN: value heads; Mamba-2: SSM heads
    int head_dim = 0;     // GDN: v_head_dim; Mamba-2: head_dim
    int groups = 0;       // GDN: key heads; Mamba-2: n_groups (B and C share them); Mamba-1: 0
    int group_dim = 0;    // GDN: k_head_dim; Mamba-2 and Mamba-1: d_state (ssm_state_size)
    int conv_kernel = 0;  // the causal conv's width; the state keeps conv_kernel - 1 columns
    DType conv_dtype = DType::kBf16;
    DType state_dtype = DType::kBf16;  // the recurrent / SSM state (vLLM mamba_ssm_cache_dtype)
    // Kimi Delta Attention (Kimi Linear) in the kGatedDeltaNet layers. Its state is the Gated
    // DeltaNet formula with groups = heads and group_dim = head_dim: vLLM's
    // MambaStateShapeCalculator.kda_state_shape keeps conv (conv_kernel-1) x (num_heads*head_dim
    // + 2*num_heads*head_dim) / tp and recurrent (num_heads/tp) x head_dim x head_dim, the
    // recurrent one always float32 (MambaStateDtypeCalculator.kda_state_dtype). Only its
    // projections differ (mixer_params_of_layer); the reference model does not run it.
    bool kda = false;
    // Conv state rows beyond conv_kernel - 1: an engine's, not the checkpoint's (vLLM's num_spec,
    // the speculative tokens, while drafting with a Gated DeltaNet or Mamba-2 model); 0 otherwise.
    int spec_conv_rows = 0;
    bool operator==(const StateSpec&) const = default;
};

// State bytes per sequence of one state layer on a rank of a TP group of `tp`: heads and groups are
// split by tp, each rank keeping at least one (replicated where tp exceeds them).
int64_t state_bytes(const StateSpec& s, int tp);

// DeepSeek-V3.2's sparse-attention indexer: one key of head_dim per token and layer, shared by
// all heads, stored as `dtype` plus `scale_bytes` of scale per token (vLLM: fp8 + one fp32 scale).
struct IndexerSpec {
    int heads = 0;  // query heads of the indexer (no cache)
    int head_dim = 0;
    int topk = 0;
    DType dtype = DType::kFp8;
    int scale_bytes = 4;
    bool enabled() const { return head_dim > 0; }
    bool operator==(const IndexerSpec&) const = default;
};

// How a quantized checkpoint stores its weights (config.json's quantization_config; docs/model.md,
// "Quantized weights"), per part, in bits per weight with the block scales included: fp8 with one
// fp32 scale per 128 x 128 block is 8 + 32 / 16384 bits, MXFP4 (4-bit e2m1 in blocks of 32 with one
// 8-bit scale) 4 + 8 / 32 = 4.25. A part with 0 bits is stored as weight_dtype, as are the
// embedding, the LM head, the norms and the MoE router, which these methods leave unquantized.
// fp8_compute: the matmuls of the quantized parts run on fp8 tensor cores (weights and activations
// in fp8, as vLLM's fp8 methods run them); otherwise the weights are widened to the activations'
// type (weight-only quantization, e.g. MXFP4 on Hopper).
struct WeightStorage {
    std::string method;         // "" (not quantized), "fp8", "mxfp4", or another method's name
    double attention_bits = 0;  // attention / MLA / indexer / state-mixer projections
    double dense_mlp_bits = 0;  // dense MLPs
    double experts_bits = 0;    // routed and shared experts
    bool fp8_compute = false;
    // False for a method kvshard does not read (awq, gptq, compressed-tensors, ...): its weights
    // are sized only when the caller gives their storage (the planner's --weight-dtype).
    bool sized = true;
    bool quantized() const { return !method.empty(); }
    bool operator==(const WeightStorage&) const = default;
};

// Multi-token-prediction (MTP) layers a checkpoint carries after its decoder layers, which vLLM
// runs as the drafter of speculative decoding (--speculative-config '{"method": "mtp"}'). Each is
// one decoder layer of the model's own kind (vLLM: DeepSeekMultiTokenPredictorLayer.mtp_block, a
// DeepseekV2DecoderLayer with MLA; Glm4MoeMultiTokenPredictorLayer.mtp_block, a GQA
// Glm4MoeDecoderLayer; Qwen3NextMultiTokenPredictor.layers, a Qwen3NextDecoderLayer of
// layer_type "full_attention") plus a projection of [embedding; hidden] (2 x hidden -> hidden:
// eh_proj, a plain nn.Linear held whole on every rank; Qwen3-Next's fc, a ColumnParallelLinear
// split by TP) and three RMSNorms (enorm, hnorm, shared_head.norm; Qwen3-Next pre_fc_norm_hidden,
// pre_fc_norm_embedding, norm). The embedding and LM head are the target's: vLLM's proposer shares
// them (SpecDecodeBaseProposer._maybe_share_embeddings / _maybe_share_lm_head, "Detected MTP
// model").
struct MtpSpec {
    int layers = 0;                 // num_nextn_predict_layers / mtp_num_hidden_layers; 0: none
    LayerSpec layer;                // what each caches (kind, KV heads, indexer) and its MLP
    bool proj_split_by_tp = false;  // Qwen3-Next's fc; false: eh_proj, replicated
    // Decoder layers after `layer` in each MTP step, in order; empty for one layer a step.
    // Nemotron-H builds a step of its mtp_hybrid_override_pattern (vLLM
    // NemotronHMultiTokenPredictor: "*E" is an attention layer, here `layer`, then a MoE layer,
    // here `following`, which caches nothing); the projection and norms come once a step.
    std::vector<LayerSpec> following;
    // Set by the config reader where the checkpoint carries MTP layers that it does not record
    // (layers 0): why, in a clause that completes "its MTP layers are not modelled: ...", e.g.
    // "vLLM builds no drafter for dots1 (...)" or "kvshard does not model LongCat-Flash's drafter
    // (...)". Empty where the config names none. Speculation's refusal states it.
    std::string not_modelled;
    int layers_per_step() const { return 1 + static_cast<int>(following.size()); }
    bool enabled() const { return layers > 0; }
    bool operator==(const MtpSpec&) const = default;
};

// The q_norm / k_norm weights an attention layer holds (RMSNorms of the queries and keys before
// RoPE): none; one of head_dim each, shared by the heads (Qwen3's q_norm / k_norm, Gemma 3,
// Hunyuan, LFM2); or one over all heads, num_heads x head_dim and num_kv_heads x head_dim (OLMo 2,
// MiniMax-M2's per_layer norms).
enum class QkNorm { kNone, kPerHead, kAllHeads };
std::string_view qk_norm_name(QkNorm q);  // "none", "per_head", "all_heads"
QkNorm parse_qk_norm(std::string_view s);

// The checkpoint's norm weights and biases beside its weight matrices, as vLLM loads them
// (docs/model.md, "Parameters"). The defaults are a Llama decoder: one RMSNorm before the mixer,
// one before the MLP, a final norm, no biases.
struct NormsAndBiases {
    // Hidden-wide norms per part of a layer (its mixer, its MLP; a layer without one has none for
    // it): 1 (Llama's input_layernorm and post_attention_layernorm, Nemotron-H's norm per layer,
    // OLMo 2's post norms), 2 (Gemma 2 / 3 and GLM-4: a norm before and after each).
    int per_part = 1;
    // One norm before the mixer and the MLP together, which run in parallel (Falcon-7B's
    // input_layernorm, Cohere's): per_part does not apply.
    bool parallel = false;
    bool norm_bias = false;  // LayerNorms with a bias (Falcon): every hidden-wide norm counts twice
    QkNorm qk = QkNorm::kNone;  // attention layers' q_norm / k_norm
    bool qkv_bias = false;      // q, k and v projections carry a bias (Qwen2, attention_bias)
    bool o_bias = false;        // the output projection carries one (Llama's attention_bias)
    // Every dense MLP and expert projection carries one (mlp_bias; gpt-oss's experts):
    // (mlp_projections - 1) x width + hidden per MLP.
    bool mlp_bias = false;
    // A bias of one per routed expert beside the router (DeepSeek-V3's e_score_correction_bias
    // under noaux_tc, gpt-oss's router bias).
    bool router_bias = false;
    bool shared_expert_gate = false;  // Qwen2-MoE / Qwen3-Next: a hidden -> 1 gate per MoE layer
    // Attention layers' q_proj also yields a sigmoid gate of num_heads x head_dim on the output
    // (Qwen3-Next / Qwen3.5's attn_output_gate): a matrix, not a bias, split by TP like q.
    bool attention_output_gate = false;
    // Mamba-2 mixers (vLLM's MambaMixer2): the conv1d's bias of conv_dim (use_conv_bias /
    // mamba_conv_bias), and in_proj / out_proj biases (use_bias / mamba_proj_bias).
    bool mamba2_conv_bias = true;
    bool mamba2_proj_bias = false;
    bool operator==(const NormsAndBiases&) const = default;
};

// How a caller lets a sequence past max_model_len (ModelSpec::check_sequence_length's message).
inline constexpr std::string_view kAllowLongContextFlag = "--allow-long-context";
inline constexpr std::string_view kAllowLongContextKwarg = "Python allow_long_context=True";
inline constexpr std::string_view kAllowLongContextEither =
    "--allow-long-context; Python allow_long_context=True";

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
    DType weight_dtype = DType::kBf16;  // the checkpoint's torch_dtype (unquantized parts)
    WeightStorage weight_storage;       // the quantized parts, when the checkpoint is quantized
    double rope_theta = 10000.0;
    // The longest sequence (prompt + output) vLLM serves: its max_model_len as derived from
    // config.json by vLLM's _get_and_verify_max_len (docs/model.md, "Context length"); vLLM refuses
    // a longer --max-model-len unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. 0: the model states none
    // (the built-in test models; a config without a length field), and nothing is checked.
    int64_t max_model_len = 0;
    std::string max_model_len_from;  // how it was derived: "max_position_embeddings", ...
    double rms_norm_eps = 1e-5;
    bool tie_embeddings = false;
    // Weight matrices of a dense MLP and of each expert: 3 gated (SwiGLU, GeGLU), 2 plain up/down
    // (Falcon's GELU, Nemotron-H's squared ReLU).
    int mlp_projections = 3;
    NormsAndBiases norms;  // the checkpoint's norm weights and biases (total_params counts them)
    // One entry per layer, or empty: every layer full attention (MLA when attention is kMla) with
    // num_kv_heads x head_dim and the MoE / dense MLP of is_moe_layer.
    std::vector<LayerSpec> layers;
    // How many consecutive entries of `layers` make one decoder layer (the model's
    // num_hidden_layers, what vLLM's get_pp_indices splits over PP stages). 1 for most models;
    // Falcon-H1's FalconH1ParallelHybrid is 2 (an attention branch with the layer's MLP, then a
    // Mamba-2 branch with none), LongCat-Flash's FlashDecoderLayer 3 (two MLA attentions, each
    // with its dense MLP, then the MoE on an entry that caches nothing). num_layers counts the
    // entries ("cache layers"): every KV group, block table and transfer iterates them, and each
    // entry's mixer and MLP params are its own, so a decoder layer's MLP is counted once.
    int cache_layers_per_decoder_layer = 1;
    StateSpec state;      // used by kGatedDeltaNet / kMamba2 / kMamba1 / kShortConv layers
    IndexerSpec indexer;  // used by layers with indexer = true
    MtpSpec mtp;          // the checkpoint's MTP layers (not counted in num_layers)

    bool operator==(const ModelSpec&) const = default;

    // Decoder layers: num_layers / cache_layers_per_decoder_layer. Decoder layer d holds the
    // cache layers [d * k, (d + 1) * k).
    int num_decoder_layers() const { return num_layers / cache_layers_per_decoder_layer; }

    // Layer l as stored or as implied by the uniform fields.
    LayerSpec layer(int l) const;
    // True when every layer is the uniform full-attention (or MLA) layer the executors run.
    bool uniform() const;
    // "36 layers: 18 sliding(128) + 18 full" style summary; with several cache layers per decoder
    // layer "44 decoder layers x 2 cache layers: 44 full + 44 mamba2".
    std::string layer_mix() const;
    // Bytes a token adds to layer l (all heads, K and V, plus indexer keys); 0 for state layers.
    int64_t kv_bytes_per_token_of_layer(int l) const;
    // Bytes of recurrent state per sequence in layer l (all heads); 0 for attention layers.
    int64_t state_bytes_of_layer(int l) const;
    // Sum over layers of kv_bytes_per_token_of_layer: what a token adds while the sequence is
    // shorter than every window.
    int64_t kv_bytes_per_token() const;
    int64_t state_bytes_per_sequence() const;

    bool is_mla() const { return attention == AttentionKind::kMla; }
    bool is_moe_layer(int layer) const;
    int num_moe_layers() const;

    // Elements of KV per token per layer for the whole model (all heads) of the uniform layer:
    // 2*H_kv*d, or the MLA latent.
    int64_t kv_elems_per_token_per_layer() const;

    // Parameter counts (elements), used for weight memory and FLOPs.
    int64_t attention_params_per_layer() const;  // the uniform attention layer
    int64_t mixer_params_of_layer(int l) const;  // attention / linear attention / SSM of layer l
    int64_t mlp_params_of_layer(int l) const;    // dense, MoE or none
    int64_t dense_mlp_params_per_layer() const;  // mlp_projections * hidden * intermediate
    int64_t expert_params() const;  // one expert: mlp_projections * hidden * expert_intermediate
    // One routed expert: as expert_params, at moe.latent_size in place of hidden when it is set.
    int64_t routed_expert_params() const;
    // LatentMoE's two projections (hidden -> latent, latent -> hidden) per MoE layer; 0 without.
    int64_t latent_projection_params() const;
    int64_t moe_params_per_layer() const;  // all routed + shared experts + router
    // The router (hidden -> num_experts) with its bias and a shared-expert gate when the model
    // has them (NormsAndBiases); 0 for a dense model.
    int64_t router_params() const;
    int64_t embedding_params() const;  // vocab * hidden
    int64_t lm_head_params() const;    // 0 when tied
    // The hidden-wide norms of layer l (norms.per_part per part it holds, or one when parallel;
    // twice with norm_bias); its q_norm / k_norm and biases are in mixer_params_of_layer, its MLP
    // biases in mlp_params_of_layer.
    int64_t norm_params_of_layer(int l) const;
    int64_t final_norm_params() const;  // the norm after the last layer
    int64_t total_params() const;
    int64_t active_params_per_token() const;  // what one token multiplies through (top-k experts)

    // Throws kvshard::Error naming the first bad field or range (docs/cli-inputs.md).
    void validate() const;

    // Refuses a sequence of `tokens` longer than max_model_len, as vLLM refuses such a
    // --max-model-len; allow_long: accepted, as with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. `what` names
    // the length in the message ("the context", "prompt + output"); `allow_long_how` the override
    // the caller offers: kAllowLongContextFlag from a CLI command, kAllowLongContextKwarg from a
    // Python function, both (the default) from a library function that either reaches.
    void check_sequence_length(int64_t tokens, bool allow_long, std::string_view what,
                               std::string_view allow_long_how = kAllowLongContextEither) const;
    // Refuses KV of `tokens` computed tokens of one request (a prompt being prefilled, the
    // cached + new tokens of a step, the KV a prefill hands to decode) at or past max_model_len:
    // vLLM computes at most max_model_len - 1 tokens of a request. It refuses a prompt of
    // max_model_len tokens, which leaves no room for an output token
    // (vllm/v1/engine/input_processor.py, InputProcessor._validate_prompt_len), and its scheduler
    // never schedules a token at position max_model_len - 1 or later
    // (vllm/v1/core/sched/scheduler.py, Scheduler.schedule: num_new_tokens is capped at
    // max_model_len - 1 - num_computed_tokens; the request stops at max_model_len tokens,
    // vllm/v1/core/sched/utils.py check_stop, its last sampled token never fed back).
    // allow_long, `what` and `allow_long_how` as check_sequence_length's.
    void check_computed_length(int64_t tokens, bool allow_long, std::string_view what,
                               std::string_view allow_long_how = kAllowLongContextEither) const;

  private:
    void validate_totals() const;
    void validate_decoder_layers() const;

  public:
};

// The same model with every layer full attention (MLA stays MLA): sliding and chunked layers keep
// their heads, state and no-KV layers take the model's KV heads. What a reader that ignores
// per-layer kinds would size; kept for comparisons (`--all-full-attention`).
ModelSpec with_full_attention(const ModelSpec& m);

// The model as vLLM's KV cache sees it when its MTP layers draft: mtp.layers copies of mtp.layer
// appended after the decoder layers (num_layers + mtp.layers, every layer listed), mtp cleared.
// Error when the model has no MTP layers.
ModelSpec with_mtp_layers(const ModelSpec& m);

// Bytes one token's MLA entry (latent and rope key, without indexer keys) takes in one layer:
// (kv_lora_rank + qk_rope_head_dim) x the KV element size, except fp8 on a sparse-MLA model (one
// with an indexer, DeepSeek-V3.2): vLLM's FlashMLA sparse backend stores it as fp8_ds_mla
// (FlashMLASparseBackend.get_kv_cache_shape: 656 bytes for 512 + 64): kv_lora_rank fp8 values,
// one fp32 scale per 128 of them, the rope part in bf16. Its scales are per token: no per-block
// scales (mla_fp8_ds_layout).
int64_t mla_bytes_per_token(const ModelSpec& m);
bool mla_fp8_ds_layout(const ModelSpec& m);
// Bytes one token's indexer key takes in a layer with an indexer (DeepSeek-V3.2): head_dim values
// of indexer.dtype and their scales; 0 for a model without an indexer.
int64_t indexer_bytes_per_token(const ModelSpec& m);
// The vector one token writes into an MLA page of kvshard's pools, in KV elements: the latent and
// rope key, then (a model with an indexer) the indexer key and its scales as raw bytes.
// DeepSeek-V3.2 at bf16: (1152 + 132) / 2 = 642. Throws where the entry is fp8_ds_mla or the
// indexer bytes are not a whole number of KV elements.
int mla_page_dim(const ModelSpec& m);

// JSON (the same field names as `kvshard model --json`).
std::string to_json(const ModelSpec& m);
// How the weights are stored, in a word: the quantization method ("fp8", "mxfp4", ...), else the
// weight dtype ("bf16").
std::string weight_storage_name(const ModelSpec& m);
ModelSpec model_spec_from_json(std::string_view json_text);

}  // namespace kvshard
