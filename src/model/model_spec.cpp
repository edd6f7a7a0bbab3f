#include "kvshard/model/model_spec.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"

namespace kvshard {

std::string_view attention_kind_name(AttentionKind k) {
    switch (k) {
        case AttentionKind::kMha:
            return "MHA";
        case AttentionKind::kGqa:
            return "GQA";
        case AttentionKind::kMqa:
            return "MQA";
        case AttentionKind::kMla:
            return "MLA";
    }
    return "?";
}

static AttentionKind parse_attention_kind(std::string_view s) {
    if (s == "MHA") return AttentionKind::kMha;
    if (s == "GQA") return AttentionKind::kGqa;
    if (s == "MQA") return AttentionKind::kMqa;
    if (s == "MLA") return AttentionKind::kMla;
    throw Error(detail::concat("unknown attention kind '", s, "': expected MHA, GQA, MQA or MLA"));
}

std::string_view layer_kind_name(LayerKind k) {
    switch (k) {
        case LayerKind::kFullAttention:
            return "full";
        case LayerKind::kSlidingWindow:
            return "sliding";
        case LayerKind::kChunkedLocal:
            return "chunked";
        case LayerKind::kMla:
            return "mla";
        case LayerKind::kGatedDeltaNet:
            return "gated_deltanet";
        case LayerKind::kMamba2:
            return "mamba2";
        case LayerKind::kMamba1:
            return "mamba1";
        case LayerKind::kShortConv:
            return "short_conv";
        case LayerKind::kNoKv:
            return "none";
    }
    return "?";
}

LayerKind parse_layer_kind(std::string_view s) {
    for (LayerKind k :
         {LayerKind::kFullAttention, LayerKind::kSlidingWindow, LayerKind::kChunkedLocal,
          LayerKind::kMla, LayerKind::kGatedDeltaNet, LayerKind::kMamba2, LayerKind::kMamba1,
          LayerKind::kShortConv, LayerKind::kNoKv})
        if (layer_kind_name(k) == s) return k;
    throw Error(detail::concat("unknown layer kind '", s,
                               "': expected full, sliding, chunked, mla, gated_deltanet, mamba2, "
                               "mamba1, short_conv or none"));
}

bool holds_tokens(LayerKind k) {
    return k == LayerKind::kFullAttention || k == LayerKind::kSlidingWindow ||
           k == LayerKind::kChunkedLocal || k == LayerKind::kMla;
}

bool holds_state(LayerKind k) {
    return k == LayerKind::kGatedDeltaNet || k == LayerKind::kMamba2 || k == LayerKind::kMamba1 ||
           k == LayerKind::kShortConv;
}

std::string_view qk_norm_name(QkNorm q) {
    switch (q) {
        case QkNorm::kNone:
            return "none";
        case QkNorm::kPerHead:
            return "per_head";
        case QkNorm::kAllHeads:
            return "all_heads";
    }
    return "?";
}

QkNorm parse_qk_norm(std::string_view s) {
    for (QkNorm q : {QkNorm::kNone, QkNorm::kPerHead, QkNorm::kAllHeads})
        if (s == qk_norm_name(q)) return q;
    throw Error(detail::concat("unknown qk norm '", s, "': expected none, per_head or all_heads"));
}

namespace {
std::string_view mlp_kind_name(MlpKind k) {
    switch (k) {
        case MlpKind::kDense:
            return "dense";
        case MlpKind::kMoe:
            return "moe";
        case MlpKind::kNone:
            return "none";
    }
    return "?";
}
MlpKind parse_mlp_kind(std::string_view s) {
    if (s == "dense") return MlpKind::kDense;
    if (s == "moe") return MlpKind::kMoe;
    if (s == "none") return MlpKind::kNone;
    throw Error(detail::concat("unknown MLP kind '", s, "': expected dense, moe or none"));
}
}  // namespace

LayerSpec ModelSpec::layer(int l) const {
    KVSHARD_CHECK(l >= 0 && l < num_layers, "layer ", l, " outside the ", num_layers, " layers");
    if (!layers.empty()) return layers.at(static_cast<size_t>(l));
    LayerSpec s;
    s.kind = is_mla() ? LayerKind::kMla : LayerKind::kFullAttention;
    s.indexer = is_mla() && indexer.enabled();  // DeepSeek-V3.2: every layer keeps indexer keys
    s.num_kv_heads = is_mla() ? 0 : num_kv_heads;
    s.head_dim = is_mla() ? 0 : head_dim;
    s.mlp = moe.enabled() && l >= moe.first_dense_layers ? MlpKind::kMoe : MlpKind::kDense;
    s.intermediate = s.mlp == MlpKind::kDense ? intermediate : 0;
    return s;
}

bool ModelSpec::uniform() const {
    if (layers.empty()) return true;
    ModelSpec implied = *this;
    implied.layers.clear();
    for (int l = 0; l < num_layers; ++l)
        if (!(layers[static_cast<size_t>(l)] == implied.layer(l))) return false;
    return true;
}

std::string ModelSpec::layer_mix() const {
    // Counts per distinct (kind, window, heads) in order of first appearance.
    struct Entry {
        std::string label;
        int count = 0;
    };
    std::vector<Entry> entries;
    for (int l = 0; l < num_layers; ++l) {
        const LayerSpec s = layer(l);
        std::string label(layer_kind_name(s.kind));
        if (s.window > 0) label += detail::concat("(", s.window, ")");
        if (s.kind != LayerKind::kMla && holds_tokens(s.kind) && s.num_kv_heads != num_kv_heads)
            label += detail::concat("[kv", s.num_kv_heads, "]");
        if (s.indexer) label += "+indexer";
        auto it = std::find_if(entries.begin(), entries.end(),
                               [&](const Entry& e) { return e.label == label; });
        if (it == entries.end())
            entries.push_back({label, 1});
        else
            ++it->count;
    }
    std::string out = cache_layers_per_decoder_layer == 1
                          ? detail::concat(num_layers, " layers: ")
                          : detail::concat(num_decoder_layers(), " decoder layers x ",
                                           cache_layers_per_decoder_layer, " cache layers: ");
    for (size_t i = 0; i < entries.size(); ++i)
        out += detail::concat(i ? " + " : "", entries[i].count, " ", entries[i].label);
    return out;
}

int64_t ModelSpec::kv_bytes_per_token_of_layer(int l) const {
    const LayerSpec s = layer(l);
    const int64_t e = static_cast<int64_t>(dtype_size(kv_dtype));
    int64_t bytes = 0;
    if (s.kind == LayerKind::kMla)
        bytes = mla_bytes_per_token(*this);
    else if (holds_tokens(s.kind))
        bytes = 2 * int64_t{s.num_kv_heads} * s.head_dim * e;
    if (s.indexer) bytes += indexer_bytes_per_token(*this);
    return bytes;
}

int64_t indexer_bytes_per_token(const ModelSpec& m) {
    if (!m.indexer.enabled()) return 0;
    return int64_t{m.indexer.head_dim} * static_cast<int64_t>(dtype_size(m.indexer.dtype)) +
           m.indexer.scale_bytes;
}

int mla_page_dim(const ModelSpec& m) {
    KVSHARD_CHECK(m.is_mla(), m.name, " is not MLA: it has no MLA page vector");
    require(!mla_fp8_ds_layout(m), m.name,
            " is sparse MLA (an indexer) at fp8 KV, which vLLM stores as fp8_ds_mla (656-byte "
            "entries with per-token scales for a 512 + 64 latent); kvshard's fp8 pages hold codes "
            "with per-block scales, so it plans and sizes such caches but does not lay them out "
            "in pools: use bf16 KV for a pool of it, or the plan's sizes only");
    const auto e = static_cast<int64_t>(dtype_size(m.kv_dtype));
    const int64_t index = indexer_bytes_per_token(m);
    require(index % e == 0, m.name, ": its indexer key takes ", index,
            " bytes per token, not a whole number of ", dtype_name(m.kv_dtype),
            " elements, so it cannot follow the latent in one page vector: use a KV dtype of ",
            "1, 2 or 4 bytes that divides it");
    return m.mla.kv_lora_rank + m.mla.qk_rope_head_dim + static_cast<int>(index / e);
}

bool mla_fp8_ds_layout(const ModelSpec& m) {
    return m.is_mla() && m.indexer.enabled() && m.kv_dtype == DType::kFp8;
}

int64_t mla_bytes_per_token(const ModelSpec& m) {
    if (mla_fp8_ds_layout(m))
        return int64_t{m.mla.kv_lora_rank} + 4 * ((int64_t{m.mla.kv_lora_rank} + 127) / 128) +
               2 * int64_t{m.mla.qk_rope_head_dim};
    return (int64_t{m.mla.kv_lora_rank} + m.mla.qk_rope_head_dim) *
           static_cast<int64_t>(dtype_size(m.kv_dtype));
}

int64_t state_bytes(const StateSpec& st, int tp) {
    KVSHARD_CHECK(tp >= 1, "tp must be positive");
    const int64_t heads = std::max(1, st.heads / tp);
    // No groups (short conv, Mamba-1): no B / C columns in the conv state, at any tp.
    const int64_t groups = st.groups > 0 ? std::max(1, st.groups / tp) : 0;
    const int64_t conv_dim = heads * st.head_dim + 2 * groups * st.group_dim;
    const int64_t conv = int64_t{st.conv_kernel - 1 + st.spec_conv_rows} * conv_dim *
                         static_cast<int64_t>(dtype_size(st.conv_dtype));
    const int64_t rec =
        heads * st.head_dim * st.group_dim * static_cast<int64_t>(dtype_size(st.state_dtype));
    return conv + rec;
}

int64_t ModelSpec::state_bytes_of_layer(int l) const {
    return holds_state(layer(l).kind) ? state_bytes(state, 1) : 0;
}

int64_t ModelSpec::kv_bytes_per_token() const {
    int64_t sum = 0;
    for (int l = 0; l < num_layers; ++l) sum += kv_bytes_per_token_of_layer(l);
    return sum;
}

int64_t ModelSpec::state_bytes_per_sequence() const {
    int64_t sum = 0;
    for (int l = 0; l < num_layers; ++l) sum += state_bytes_of_layer(l);
    return sum;
}

bool ModelSpec::is_moe_layer(int l) const {
    if (!layers.empty()) return layers.at(static_cast<size_t>(l)).mlp == MlpKind::kMoe;
    return moe.enabled() && l >= moe.first_dense_layers;
}

int ModelSpec::num_moe_layers() const {
    int n = 0;
    for (int l = 0; l < num_layers; ++l) n += is_moe_layer(l) ? 1 : 0;
    return n;
}

int64_t ModelSpec::kv_elems_per_token_per_layer() const {
    if (is_mla()) return int64_t{mla.kv_lora_rank} + mla.qk_rope_head_dim;
    return 2 * int64_t{num_kv_heads} * head_dim;
}

namespace {

// The q_norm / k_norm weights, q, k, v, o biases and output gate of an attention layer of
// kv_heads x head_dim (NormsAndBiases): q and o span num_heads x head_dim, k and v kv_heads x
// head_dim.
int64_t attention_norm_bias_params(const ModelSpec& m, int64_t kv_heads, int64_t head_dim) {
    const NormsAndBiases& n = m.norms;
    const int64_t q_width = int64_t{m.num_heads} * head_dim, kv_width = kv_heads * head_dim;
    int64_t p = 0;
    if (n.qk == QkNorm::kPerHead) p += 2 * head_dim;
    if (n.qk == QkNorm::kAllHeads) p += q_width + kv_width;
    if (n.qkv_bias) p += q_width + 2 * kv_width;
    if (n.o_bias) p += m.hidden;
    if (n.attention_output_gate) p += int64_t{m.hidden} * q_width;
    return p;
}

// Biases of one MLP of `width` (NormsAndBiases::mlp_bias): gate and up (or up alone) of width,
// down of hidden.
int64_t mlp_bias_params(const ModelSpec& m, int64_t width) {
    return m.norms.mlp_bias ? (m.mlp_projections - 1) * width + m.hidden : 0;
}

}  // namespace

int64_t ModelSpec::attention_params_per_layer() const {
    const int64_t h = hidden;
    if (is_mla()) {
        const int64_t qk_dim = int64_t{mla.qk_nope_head_dim} + mla.qk_rope_head_dim;
        const int64_t q = mla.q_lora_rank > 0
                              ? h * mla.q_lora_rank + int64_t{mla.q_lora_rank} * num_heads * qk_dim
                              : h * num_heads * qk_dim;
        const int64_t kv_a = h * (int64_t{mla.kv_lora_rank} + mla.qk_rope_head_dim);
        const int64_t kv_b = int64_t{mla.kv_lora_rank} * num_heads *
                             (int64_t{mla.qk_nope_head_dim} + mla.v_head_dim);
        const int64_t o = int64_t{num_heads} * mla.v_head_dim * h;
        // q_a_layernorm (with a query latent) and kv_a_layernorm: vLLM's DeepseekV2MLAAttention.
        const int64_t latent_norms = int64_t{mla.q_lora_rank} + mla.kv_lora_rank;
        return q + kv_a + kv_b + o + latent_norms;
    }
    return h * num_heads * head_dim + 2 * h * num_kv_heads * head_dim +
           int64_t{num_heads} * head_dim * h +
           attention_norm_bias_params(*this, num_kv_heads, head_dim);
}

int64_t ModelSpec::mixer_params_of_layer(int l) const {
    const LayerSpec s = layer(l);
    const int64_t h = hidden;
    int64_t p = 0;
    switch (s.kind) {
        case LayerKind::kMla:
            p = attention_params_per_layer();
            break;
        case LayerKind::kFullAttention:
        case LayerKind::kSlidingWindow:
        case LayerKind::kChunkedLocal:
            p = 2 * h * num_heads * s.head_dim + 2 * h * s.num_kv_heads * s.head_dim +
                (s.learned_sinks ? num_heads : 0) +
                attention_norm_bias_params(*this, s.num_kv_heads, s.head_dim);
            break;
        case LayerKind::kGatedDeltaNet: {
            if (state.kda) {
                // vLLM's KimiDeltaAttention (layers/kda.py): q, k, v and o projections of
                // heads x head_dim, the forget gate f_a (hidden -> head_dim) and f_b (head_dim ->
                // heads x head_dim) with dt_bias, beta's b_proj (hidden -> heads), the q/k/v
                // short convs, A_log per head, the output gate g_a / g_b, o_norm (head_dim).
                const int64_t w = int64_t{state.heads} * state.head_dim;
                const int64_t d = state.head_dim;
                p = 4 * h * w + 2 * (h * d + d * w) + w + h * state.heads +
                    3 * w * state.conv_kernel + state.heads + d;
                break;
            }
            // in_proj_qkvz, in_proj_ba, conv1d, A_log + dt_bias, gated norm, out_proj.
            const int64_t k_dim = int64_t{state.groups} * state.group_dim;
            const int64_t v_dim = int64_t{state.heads} * state.head_dim;
            p = h * (2 * k_dim + 2 * v_dim) + h * 2 * state.heads +
                (2 * k_dim + v_dim) * state.conv_kernel + 2 * state.heads + state.head_dim +
                v_dim * h;
            break;
        }
        case LayerKind::kMamba2: {
            // in_proj (z, x, B, C, dt), conv1d (+ bias), A + D + dt_bias, gated norm, out_proj
            // (+ their biases: NormsAndBiases).
            const int64_t inner = int64_t{state.heads} * state.head_dim;
            const int64_t conv_dim = inner + 2 * int64_t{state.groups} * state.group_dim;
            p = h * (inner + conv_dim + state.heads) +
                conv_dim * (state.conv_kernel + (norms.mamba2_conv_bias ? 1 : 0)) +
                3 * state.heads + inner + inner * h +
                (norms.mamba2_proj_bias ? inner + conv_dim + state.heads + h : 0);
            break;
        }
        case LayerKind::kMamba1: {
            // vLLM's MambaMixer (layers/mamba/mamba_mixer.py), as Jamba builds it: in_proj
            // (hidden -> 2 x d_inner: x and the gate), conv1d of conv_kernel taps + bias per
            // channel, x_proj (d_inner -> dt_rank + 2 x d_state), dt_proj (dt_rank -> d_inner,
            // with bias), A (d_inner x d_state), D (d_inner), out_proj (d_inner -> hidden).
            // dt_rank is ceil(hidden / 16) (JambaConfig's "auto"; another is refused on read). The
            // conv bias is mamba_conv_bias true, in_proj / out_proj carry none (mamba_proj_bias
            // false): JambaConfig's defaults, the other settings refused on read. Jamba builds it
            // with use_rms_norm=True (jamba.py's JambaMambaDecoderLayer): dt_layernorm (dt_rank),
            // b_layernorm and c_layernorm (d_state each).
            const int64_t c = state.heads, n = state.group_dim, r = (h + 15) / 16;
            p = 2 * h * c + c * (state.conv_kernel + 1) + c * (r + 2 * n) + r * c + c + c * n + c +
                c * h + r + 2 * n;
            break;
        }
        case LayerKind::kShortConv: {
            // vLLM's ShortConv (layers/mamba/short_conv.py): in_proj (hidden -> 3 x channels: B,
            // C, x), a depthwise conv of conv_kernel taps per channel, out_proj (channels ->
            // hidden); no biases (conv_bias is refused).
            const int64_t c = state.heads;
            p = 3 * h * c + c * state.conv_kernel + c * h;
            break;
        }
        case LayerKind::kNoKv:
            p = 0;
            break;
    }
    if (s.indexer) {
        // wq_b (from the query latent), wk, k_norm, weights_proj.
        p += int64_t{mla.q_lora_rank} * indexer.heads * indexer.head_dim + h * indexer.head_dim +
             2 * int64_t{indexer.head_dim} + h * indexer.heads;
    }
    return p;
}

int64_t ModelSpec::mlp_params_of_layer(int l) const {
    const LayerSpec s = layer(l);
    switch (s.mlp) {
        case MlpKind::kDense:
            return int64_t{mlp_projections} * hidden * s.intermediate +
                   mlp_bias_params(*this, s.intermediate);
        case MlpKind::kMoe:
            return moe_params_per_layer();
        case MlpKind::kNone:
            return 0;
    }
    return 0;
}

int64_t ModelSpec::dense_mlp_params_per_layer() const {
    return int64_t{mlp_projections} * hidden * intermediate;
}

int64_t ModelSpec::expert_params() const {
    return int64_t{mlp_projections} * hidden * moe.expert_intermediate +
           mlp_bias_params(*this, moe.expert_intermediate);
}

int64_t ModelSpec::routed_expert_params() const {
    const int64_t width = moe.latent_size > 0 ? moe.latent_size : hidden;
    const int64_t bias =
        norms.mlp_bias ? (mlp_projections - 1) * int64_t{moe.expert_intermediate} + width : 0;
    return int64_t{mlp_projections} * width * moe.expert_intermediate + bias;
}

int64_t ModelSpec::latent_projection_params() const {
    return 2 * int64_t{hidden} * moe.latent_size;
}

int64_t ModelSpec::moe_params_per_layer() const {
    if (!moe.enabled()) return 0;
    return int64_t{moe.num_experts} * routed_expert_params() +
           int64_t{moe.shared_experts} * expert_params() + router_params() +
           latent_projection_params();
}

int64_t ModelSpec::router_params() const {
    if (!moe.enabled()) return 0;
    return int64_t{hidden} * moe.num_experts + (norms.router_bias ? moe.num_experts : 0) +
           (norms.shared_expert_gate ? hidden : 0);
}

int64_t ModelSpec::embedding_params() const { return int64_t{vocab} * hidden; }

int64_t ModelSpec::lm_head_params() const { return tie_embeddings ? 0 : int64_t{vocab} * hidden; }

int64_t ModelSpec::norm_params_of_layer(int l) const {
    const LayerSpec s = layer(l);
    const int parts = (s.kind != LayerKind::kNoKv ? 1 : 0) + (s.mlp != MlpKind::kNone ? 1 : 0);
    // A decoder layer of several cache layers keeps its norms on the entries holding a mixer and
    // an MLP; the others share them: Falcon-H1's Mamba-2 branch reads the attention branch's
    // input_layernorm (FalconH1ParallelHybrid), LongCat-Flash's MoE the post_attention_layernorm[0]
    // output beside mlps[0] (FlashDecoderLayer).
    if (cache_layers_per_decoder_layer > 1 && parts < 2) return 0;
    const int64_t count = norms.parallel ? (parts > 0 ? 1 : 0) : int64_t{norms.per_part} * parts;
    return count * hidden * (norms.norm_bias ? 2 : 1);
}

int64_t ModelSpec::final_norm_params() const { return int64_t{hidden} * (norms.norm_bias ? 2 : 1); }

int64_t ModelSpec::total_params() const {
    int64_t sum = embedding_params() + lm_head_params() + final_norm_params();
    for (int l = 0; l < num_layers; ++l)
        sum += mixer_params_of_layer(l) + mlp_params_of_layer(l) + norm_params_of_layer(l);
    return sum;
}

int64_t ModelSpec::active_params_per_token() const {
    const int64_t active_moe = int64_t{moe.experts_per_token} * routed_expert_params() +
                               int64_t{moe.shared_experts} * expert_params() + router_params() +
                               latent_projection_params();
    int64_t sum = int64_t{vocab} * hidden + final_norm_params();  // the LM head (tied or not)
    for (int l = 0; l < num_layers; ++l)
        sum += mixer_params_of_layer(l) + norm_params_of_layer(l) +
               (is_moe_layer(l) ? active_moe : mlp_params_of_layer(l));
    return sum;
}

namespace {
// Field ranges (docs/cli-inputs.md): wide enough for any published model, narrow enough that every
// per-layer product fits in 64 bits; totals are checked in validate_totals.
constexpr int kMaxLayers = 1 << 14, kMaxHidden = 1 << 20, kMaxHeads = 1 << 16, kMaxDim = 1 << 16;
constexpr int kMaxVocab = 1 << 28, kMaxWidth = 1 << 24, kMaxExperts = 1 << 16;
}  // namespace

void ModelSpec::validate() const {
    auto positive = [&](int v, const char* field) {
        require(v > 0, "model '", name, "': ", field, " must be a positive integer, got ", v);
    };
    auto at_most = [&](int64_t v, int64_t most, const char* field) {
        require(v <= most, "model '", name, "': ", field, " must be at most ", most, ", got ", v);
    };
    at_most(num_layers, kMaxLayers, "num_layers");
    for (auto [bits, part] : {std::pair{weight_storage.attention_bits, "attention_bits"},
                              std::pair{weight_storage.dense_mlp_bits, "dense_mlp_bits"},
                              std::pair{weight_storage.experts_bits, "experts_bits"}})
        require(bits == 0 || (bits >= 1 && bits <= 32), "model '", name, "': weight_storage.", part,
                " must be 0 (weight_dtype's) or 1 to 32 bits per weight, got ", bits);
    at_most(hidden, kMaxHidden, "hidden");
    at_most(num_heads, kMaxHeads, "num_heads");
    at_most(num_kv_heads, kMaxHeads, "num_kv_heads");
    at_most(head_dim, kMaxDim, "head_dim");
    at_most(intermediate, kMaxWidth, "intermediate");
    at_most(vocab, kMaxVocab, "vocab");
    at_most(moe.num_experts, kMaxExperts, "moe.num_experts");
    at_most(moe.shared_experts, 1 << 10, "moe.shared_experts");
    at_most(moe.expert_intermediate, kMaxWidth, "moe.expert_intermediate");
    at_most(moe.latent_size, kMaxHidden, "moe.latent_size");
    require(norms.per_part >= 0 && norms.per_part <= 2, "model '", name,
            "': norms.per_part must be 0, 1 or 2 (hidden-wide norms per mixer and per MLP), got ",
            norms.per_part);
    for (auto [v, f] :
         {std::pair{mla.kv_lora_rank, "mla.kv_lora_rank"},
          std::pair{mla.qk_rope_head_dim, "mla.qk_rope_head_dim"},
          std::pair{mla.qk_nope_head_dim, "mla.qk_nope_head_dim"},
          std::pair{mla.v_head_dim, "mla.v_head_dim"},
          std::pair{mla.q_lora_rank, "mla.q_lora_rank"}, std::pair{state.heads, "state.heads"},
          std::pair{state.head_dim, "state.head_dim"}, std::pair{state.groups, "state.groups"},
          std::pair{state.group_dim, "state.group_dim"},
          std::pair{state.conv_kernel, "state.conv_kernel"},
          std::pair{indexer.heads, "indexer.heads"},
          std::pair{indexer.head_dim, "indexer.head_dim"},
          std::pair{indexer.scale_bytes, "indexer.scale_bytes"}}) {
        require(v >= 0, "model '", name, "': ", f, " must be >= 0, got ", v);
        at_most(v, kMaxDim, f);
    }
    for (const LayerSpec& s : layers) {
        require(s.num_kv_heads >= 0 && s.head_dim >= 0 && s.intermediate >= 0 && s.window >= 0,
                "model '", name, "': per-layer sizes must be >= 0");
        at_most(s.num_kv_heads, kMaxHeads, "a layer's num_kv_heads");
        at_most(s.head_dim, kMaxDim, "a layer's head_dim");
        at_most(s.intermediate, kMaxWidth, "a layer's intermediate");
    }
    positive(num_layers, "num_layers");
    positive(hidden, "hidden");
    positive(num_heads, "num_heads");
    positive(vocab, "vocab");
    require(mlp_projections == 2 || mlp_projections == 3, "model '", name,
            "': mlp_projections must be 2 (up/down) or 3 (gated), got ", mlp_projections);
    require(std::isfinite(rope_theta) && rope_theta > 0, "model '", name,
            "': rope_theta must be a positive finite number, got ", rope_theta);
    require(std::isfinite(rms_norm_eps) && rms_norm_eps > 0, "model '", name,
            "': rms_norm_eps must be a positive finite number, got ", rms_norm_eps);
    require(max_model_len >= 0 && max_model_len <= (int64_t{1} << 40), "model '", name,
            "': max_model_len must be in [0, 2^40] tokens (0: not stated), got ", max_model_len);
    if (is_mla()) {
        positive(mla.kv_lora_rank, "mla.kv_lora_rank");
        require(mla.qk_rope_head_dim >= 0, "model '", name, "': mla.qk_rope_head_dim must be >= 0");
        positive(mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                 "mla.qk_nope_head_dim + qk_rope_head_dim");
        positive(mla.v_head_dim, "mla.v_head_dim");
    } else {
        positive(num_kv_heads, "num_kv_heads");
        positive(head_dim, "head_dim");
        require(num_heads % num_kv_heads == 0, "model '", name, "': num_heads (", num_heads,
                ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
    }
    if (moe.enabled()) {
        require(moe.experts_per_token >= 1 && moe.experts_per_token <= moe.num_experts, "model '",
                name, "': moe.experts_per_token must be in [1, num_experts=", moe.num_experts,
                "], got ", moe.experts_per_token);
        positive(moe.expert_intermediate, "moe.expert_intermediate");
        require(moe.first_dense_layers >= 0 && moe.first_dense_layers < num_layers, "model '", name,
                "': moe.first_dense_layers must be in [0, num_layers)");
        require(moe.shared_experts >= 0, "model '", name, "': moe.shared_experts must be >= 0");
        require(moe.latent_size >= 0, "model '", name,
                "': moe.latent_size must be >= 0 (0: the routed experts run at hidden), got ",
                moe.latent_size);
    }
    require(cache_layers_per_decoder_layer >= 1 && cache_layers_per_decoder_layer <= 8, "model '",
            name, "': cache_layers_per_decoder_layer must be in [1, 8], got ",
            cache_layers_per_decoder_layer);
    // The MTP layers, checked for uniform and listed models alike.
    require(mtp.layers >= 0 && mtp.layers <= 64, "model '", name,
            "': mtp.layers must be in [0, 64], got ", mtp.layers);
    require(!mtp.enabled() || mtp.not_modelled.empty(), "model '", name,
            "': mtp.not_modelled says why MTP layers are not modelled, so mtp.layers must be 0 "
            "beside it, got ",
            mtp.layers);
    if (mtp.enabled())
        require(mtp.layer.kind == (is_mla() ? LayerKind::kMla : LayerKind::kFullAttention),
                "model '", name, "': an MTP layer must be ",
                is_mla() ? "an MLA" : "a full-attention", " layer like the model's, got ",
                layer_kind_name(mtp.layer.kind));
    for (const LayerSpec& s : mtp.following)
        require(s.kind == LayerKind::kNoKv || s.kind == mtp.layer.kind, "model '", name,
                "': a layer following an MTP step's first must cache nothing or be like it (",
                layer_kind_name(mtp.layer.kind), "), got ", layer_kind_name(s.kind));
    if (layers.empty()) {
        require(cache_layers_per_decoder_layer == 1, "model '", name,
                "': cache_layers_per_decoder_layer is ", cache_layers_per_decoder_layer,
                ", but a model of several cache layers per decoder layer must list its layers");
        if (!moe.enabled() || moe.first_dense_layers > 0) positive(intermediate, "intermediate");
        validate_totals();
        return;
    }
    require(static_cast<int>(layers.size()) == num_layers, "model '", name, "': layers lists ",
            layers.size(), " layers but num_layers is ", num_layers, ": give one per layer");
    validate_decoder_layers();
    bool uses_state = false;
    bool short_conv = false, mamba1 = false, other_state = false;
    for (int l = 0; l < num_layers; ++l) {
        const LayerSpec& s = layers[static_cast<size_t>(l)];
        const std::string where =
            detail::concat("model '", name, "': layer ", l, " (", layer_kind_name(s.kind), ")");
        if (s.kind == LayerKind::kMla) {
            require(is_mla(), where, ": an MLA layer needs attention MLA and the mla fields");
        } else if (holds_tokens(s.kind)) {
            require(s.num_kv_heads > 0 && s.head_dim > 0, where,
                    ": num_kv_heads and head_dim must be positive, got ", s.num_kv_heads, " and ",
                    s.head_dim);
            require(num_heads % s.num_kv_heads == 0, where, ": num_heads (", num_heads,
                    ") must be a multiple of its num_kv_heads (", s.num_kv_heads, ")");
        }
        const bool windowed =
            s.kind == LayerKind::kSlidingWindow || s.kind == LayerKind::kChunkedLocal;
        require(windowed ? s.window > 0 : s.window == 0, where,
                windowed ? ": the window (or chunk) must be a positive token count, got "
                         : ": only sliding and chunked layers have a window, got ",
                s.window);
        require(!s.indexer || indexer.enabled(), where,
                ": the layer caches indexer keys but the model has no indexer head_dim");
        require(s.mlp != MlpKind::kMoe || moe.enabled(), where,
                ": a MoE layer in a model without experts");
        require(s.mlp != MlpKind::kDense || s.intermediate > 0, where,
                ": a dense MLP needs a positive intermediate size, got ", s.intermediate);
        uses_state = uses_state || holds_state(s.kind);
        short_conv = short_conv || s.kind == LayerKind::kShortConv;
        mamba1 = mamba1 || s.kind == LayerKind::kMamba1;
        other_state = other_state || (holds_state(s.kind) && s.kind != LayerKind::kShortConv &&
                                      s.kind != LayerKind::kMamba1);
    }
    require(int{short_conv} + int{mamba1} + int{other_state} <= 1, "model '", name,
            "': short_conv, mamba1 and other state layers cannot share the one StateSpec");
    if (mamba1 || short_conv) {
        // Channels of head_dim 1 with no groups: Mamba-1's d_inner channels with d_state each
        // (group_dim), short conv's conv channels alone (group_dim 0).
        const char* kind = mamba1 ? "mamba1" : "short_conv";
        positive(state.heads, "state.heads");
        if (mamba1) positive(state.group_dim, "state.group_dim");
        require(state.head_dim == 1 && state.groups == 0 && (mamba1 || state.group_dim == 0) &&
                    !state.kda,
                "model '", name, "': a ", kind,
                " state is state.heads channels of head_dim 1 with no groups (groups 0) and ",
                mamba1 ? "group_dim d_state" : "group_dim 0", ", got head_dim ", state.head_dim,
                ", groups ", state.groups, ", group_dim ", state.group_dim);
        require(state.conv_kernel >= 2, "model '", name, "': a ", kind,
                " state keeps conv_kernel - 1 columns: conv_kernel must be at least 2, got ",
                state.conv_kernel);
        // vLLM's mamba1_state_shape and short_conv_state_shape take no num_spec: their conv
        // rows do not grow when speculating.
        require(state.spec_conv_rows == 0, "model '", name, "': a ", kind,
                " state keeps conv_kernel - 1 rows (vLLM adds no speculative rows), so "
                "state.spec_conv_rows must be 0, got ",
                state.spec_conv_rows);
    } else if (uses_state) {
        positive(state.heads, "state.heads");
        positive(state.head_dim, "state.head_dim");
        positive(state.groups, "state.groups");
        positive(state.group_dim, "state.group_dim");
        require(state.spec_conv_rows >= 0 && state.spec_conv_rows <= 1024, "model '", name,
                "': state.spec_conv_rows must be in [0, 1024], got ", state.spec_conv_rows);
        require(state.conv_kernel >= 1, "model '", name,
                "': state.conv_kernel must be a positive integer, got ", state.conv_kernel);
        require(!state.kda || (state.groups == state.heads && state.group_dim == state.head_dim),
                "model '", name,
                "': a KDA state has as many key heads as value heads, of one head_dim (state "
                "groups ",
                state.groups, " x ", state.group_dim, " vs heads ", state.heads, " x ",
                state.head_dim, ")");
    }
    if (indexer.enabled()) {
        positive(indexer.heads, "indexer.heads");
        require(indexer.scale_bytes >= 0, "model '", name, "': indexer.scale_bytes must be >= 0");
    }
    validate_totals();
}

void ModelSpec::validate_decoder_layers() const {
    const int k = cache_layers_per_decoder_layer;  // in [1, 8], checked by validate
    if (k == 1) return;
    require(num_layers % k == 0, "model '", name, "': its ", num_layers,
            " cache layers are not a whole number of decoder layers of ", k,
            ": num_layers must be a multiple of cache_layers_per_decoder_layer");
    // Every decoder layer alike: the entries at one position within a decoder layer share their
    // kind, so a PP stage of n decoder layers holds n of each.
    for (int l = k; l < num_layers; ++l)
        require(layers[static_cast<size_t>(l)] == layers[static_cast<size_t>(l % k)], "model '",
                name, "': cache layer ", l, " (", layer_kind_name(layers[l].kind),
                ") differs from cache layer ", l % k,
                " at the same place of the first decoder layer: every decoder layer of a model "
                "of several cache layers per decoder layer must be alike");
    require(!mtp.enabled(), "model '", name,
            "': MTP layers are not modelled for a model of several cache layers per decoder "
            "layer (mtp.layers must be 0)");
}

void ModelSpec::check_sequence_length(int64_t tokens, bool allow_long, std::string_view what,
                                      std::string_view allow_long_how) const {
    if (max_model_len <= 0 || tokens <= max_model_len || allow_long) return;
    throw Error(detail::concat(
        what, " (", tokens, " tokens) is longer than model '", name, "' serves: vLLM derives ",
        "max_model_len ", max_model_len, " from its config (", max_model_len_from,
        ") and refuses a longer --max-model-len unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (positions ",
        "past it are outside what the model was trained on); give at most ", max_model_len,
        " tokens, or allow long contexts (", allow_long_how, ") as that variable does"));
}

void ModelSpec::check_computed_length(int64_t tokens, bool allow_long, std::string_view what,
                                      std::string_view allow_long_how) const {
    if (max_model_len <= 0 || tokens < max_model_len || allow_long) return;
    throw Error(detail::concat(
        what, " (", tokens, " tokens) is more KV than model '", name,
        "' computes for one request: vLLM derives max_model_len ", max_model_len,
        " from its config (", max_model_len_from,
        ") and computes at most max_model_len - 1 = ", max_model_len - 1,
        " tokens of a request (it refuses a prompt of max_model_len tokens, which leaves no room "
        "for an output token, and never feeds back the last token it samples); give at most ",
        max_model_len - 1, " tokens, or allow long contexts (", allow_long_how,
        ") as VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 with a longer --max-model-len does"));
}

void ModelSpec::validate_totals() const {
    // Each per-layer figure fits in 64 bits under the field ranges; their sums are taken wider.
    __int128 params = embedding_params() + lm_head_params() + final_norm_params(), kv = 0, st = 0;
    for (int l = 0; l < num_layers; ++l) {
        params += mixer_params_of_layer(l) + mlp_params_of_layer(l) + norm_params_of_layer(l);
        kv += kv_bytes_per_token_of_layer(l);
        st += state_bytes_of_layer(l);
    }
    require(params <= (__int128{1} << 55), "model '", name,
            "' has more than 2^55 parameters: its sizes are not those of a model");
    require(kv <= (__int128{1} << 40) && st <= (__int128{1} << 50), "model '", name,
            "': its KV bytes per token (or state per sequence) exceed 2^40 (2^50) bytes: its sizes "
            "are not those of a model");
}

ModelSpec with_full_attention(const ModelSpec& m) {
    require(m.cache_layers_per_decoder_layer == 1, "model '", m.name, "' holds ",
            m.cache_layers_per_decoder_layer,
            " cache layers per decoder layer (several branches side by side): making each of them "
            "full attention is not a model anyone serves, so there is no all-full-attention "
            "comparison for it; compare without --all-full-attention");
    ModelSpec out = m;
    out.name = m.name + " (all full attention)";
    for (LayerSpec& s : out.layers) {
        if (!holds_tokens(s.kind)) {
            s.num_kv_heads = m.is_mla() ? 0 : m.num_kv_heads;
            s.head_dim = m.is_mla() ? 0 : m.head_dim;
        }
        s.kind = m.is_mla() ? LayerKind::kMla : LayerKind::kFullAttention;
        s.window = 0;
    }
    if (out.uniform()) out.layers.clear();
    out.validate();
    return out;
}

ModelSpec with_mtp_layers(const ModelSpec& m) {
    require(m.mtp.enabled(), "model '", m.name,
            "' carries no MTP layers (num_nextn_predict_layers / mtp_num_hidden_layers)");
    ModelSpec out = m;
    out.layers.clear();
    for (int l = 0; l < m.num_layers; ++l) out.layers.push_back(m.layer(l));
    for (int i = 0; i < m.mtp.layers; ++i) {
        out.layers.push_back(m.mtp.layer);
        out.layers.insert(out.layers.end(), m.mtp.following.begin(), m.mtp.following.end());
    }
    out.num_layers = m.num_layers + m.mtp.layers * m.mtp.layers_per_step();
    out.mtp = {};
    out.validate();
    return out;
}

std::string to_json(const ModelSpec& m) {
    nlohmann::json j = {
        {"name", m.name},
        {"num_layers", m.num_layers},
        {"hidden", m.hidden},
        {"num_heads", m.num_heads},
        {"num_kv_heads", m.num_kv_heads},
        {"head_dim", m.head_dim},
        {"intermediate", m.intermediate},
        {"vocab", m.vocab},
        {"attention", attention_kind_name(m.attention)},
        {"mla",
         {{"kv_lora_rank", m.mla.kv_lora_rank},
          {"qk_rope_head_dim", m.mla.qk_rope_head_dim},
          {"qk_nope_head_dim", m.mla.qk_nope_head_dim},
          {"v_head_dim", m.mla.v_head_dim},
          {"q_lora_rank", m.mla.q_lora_rank}}},
        {"moe",
         {{"num_experts", m.moe.num_experts},
          {"experts_per_token", m.moe.experts_per_token},
          {"shared_experts", m.moe.shared_experts},
          {"expert_intermediate", m.moe.expert_intermediate},
          {"first_dense_layers", m.moe.first_dense_layers},
          {"latent_size", m.moe.latent_size},
          {"tp_at_most_experts", m.moe.tp_at_most_experts}}},
        {"kv_dtype", dtype_name(m.kv_dtype)},
        {"weight_dtype", dtype_name(m.weight_dtype)},
        {"weight_storage",
         {{"method", m.weight_storage.method},
          {"attention_bits", m.weight_storage.attention_bits},
          {"dense_mlp_bits", m.weight_storage.dense_mlp_bits},
          {"experts_bits", m.weight_storage.experts_bits},
          {"fp8_compute", m.weight_storage.fp8_compute},
          {"sized", m.weight_storage.sized}}},
        {"rope_theta", m.rope_theta},
        {"max_model_len", m.max_model_len},
        {"max_model_len_from", m.max_model_len_from},
        {"rms_norm_eps", m.rms_norm_eps},
        {"tie_embeddings", m.tie_embeddings},
        {"mlp_projections", m.mlp_projections},
        {"norms",
         {{"per_part", m.norms.per_part},
          {"parallel", m.norms.parallel},
          {"norm_bias", m.norms.norm_bias},
          {"qk", qk_norm_name(m.norms.qk)},
          {"qkv_bias", m.norms.qkv_bias},
          {"o_bias", m.norms.o_bias},
          {"mlp_bias", m.norms.mlp_bias},
          {"router_bias", m.norms.router_bias},
          {"shared_expert_gate", m.norms.shared_expert_gate},
          {"attention_output_gate", m.norms.attention_output_gate},
          {"mamba2_conv_bias", m.norms.mamba2_conv_bias},
          {"mamba2_proj_bias", m.norms.mamba2_proj_bias}}},
        {"total_params", m.total_params()},
        {"kv_bytes_per_token", m.kv_bytes_per_token()},
        {"state_bytes_per_sequence", m.state_bytes_per_sequence()},
        {"layer_mix", m.layer_mix()},
    };
    if (m.cache_layers_per_decoder_layer != 1)
        j["cache_layers_per_decoder_layer"] = m.cache_layers_per_decoder_layer;
    if (!m.layers.empty()) {
        nlohmann::json layers = nlohmann::json::array();
        for (const LayerSpec& s : m.layers)
            layers.push_back({{"kind", layer_kind_name(s.kind)},
                              {"num_kv_heads", s.num_kv_heads},
                              {"head_dim", s.head_dim},
                              {"window", s.window},
                              {"learned_sinks", s.learned_sinks},
                              {"indexer", s.indexer},
                              {"mlp", mlp_kind_name(s.mlp)},
                              {"intermediate", s.intermediate}});
        j["layers"] = layers;
        j["state"] = {{"heads", m.state.heads},
                      {"head_dim", m.state.head_dim},
                      {"groups", m.state.groups},
                      {"group_dim", m.state.group_dim},
                      {"conv_kernel", m.state.conv_kernel},
                      {"conv_dtype", dtype_name(m.state.conv_dtype)},
                      {"state_dtype", dtype_name(m.state.state_dtype)},
                      {"spec_conv_rows", m.state.spec_conv_rows}};
        if (m.state.kda) j["state"]["kda"] = true;
    }
    if (m.mtp.enabled()) {
        auto layer_json = [](const LayerSpec& s) {
            return nlohmann::json{
                {"kind", layer_kind_name(s.kind)}, {"num_kv_heads", s.num_kv_heads},
                {"head_dim", s.head_dim},          {"indexer", s.indexer},
                {"mlp", mlp_kind_name(s.mlp)},     {"intermediate", s.intermediate}};
        };
        j["mtp"] = {{"layers", m.mtp.layers},
                    {"proj_split_by_tp", m.mtp.proj_split_by_tp},
                    {"layer", layer_json(m.mtp.layer)}};
        if (!m.mtp.following.empty()) {
            nlohmann::json following = nlohmann::json::array();
            for (const LayerSpec& s : m.mtp.following) following.push_back(layer_json(s));
            j["mtp"]["following"] = std::move(following);
        }
    } else if (!m.mtp.not_modelled.empty()) {
        j["mtp"] = {{"layers", 0}, {"not_modelled", m.mtp.not_modelled}};
    }
    // A uniform sparse-MLA model (every layer keeps indexer keys) lists no layers.
    if (!m.layers.empty() || m.indexer.enabled())
        j["indexer"] = {{"heads", m.indexer.heads},
                        {"head_dim", m.indexer.head_dim},
                        {"topk", m.indexer.topk},
                        {"dtype", dtype_name(m.indexer.dtype)},
                        {"scale_bytes", m.indexer.scale_bytes}};
    return j.dump(2);
}

std::string weight_storage_name(const ModelSpec& m) {
    return m.weight_storage.quantized() ? m.weight_storage.method
                                        : std::string(dtype_name(m.weight_dtype));
}

ModelSpec model_spec_from_json(std::string_view json_text) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(json_text);
    } catch (const nlohmann::json::exception& e) {
        throw Error(std::string("model JSON does not parse: ") + e.what());
    }
    try {
        ModelSpec m;
        m.name = j.at("name").get<std::string>();
        m.num_layers = j.at("num_layers").get<int>();
        m.hidden = j.at("hidden").get<int>();
        m.num_heads = j.at("num_heads").get<int>();
        m.num_kv_heads = j.at("num_kv_heads").get<int>();
        m.head_dim = j.at("head_dim").get<int>();
        m.intermediate = j.at("intermediate").get<int>();
        m.vocab = j.at("vocab").get<int>();
        m.attention = parse_attention_kind(j.at("attention").get<std::string>());
        const auto& mla = j.at("mla");
        m.mla = {mla.at("kv_lora_rank").get<int>(), mla.at("qk_rope_head_dim").get<int>(),
                 mla.at("qk_nope_head_dim").get<int>(), mla.at("v_head_dim").get<int>(),
                 mla.at("q_lora_rank").get<int>()};
        const auto& moe = j.at("moe");
        m.moe = {moe.at("num_experts").get<int>(),        moe.at("experts_per_token").get<int>(),
                 moe.at("shared_experts").get<int>(),     moe.at("expert_intermediate").get<int>(),
                 moe.at("first_dense_layers").get<int>(), moe.value("latent_size", 0),
                 moe.value("tp_at_most_experts", false)};
        m.kv_dtype = parse_dtype(j.at("kv_dtype").get<std::string>());
        m.weight_dtype = parse_dtype(j.at("weight_dtype").get<std::string>());
        if (j.contains("weight_storage")) {
            const auto& w = j.at("weight_storage");
            m.weight_storage = {
                w.at("method").get<std::string>(),    w.at("attention_bits").get<double>(),
                w.at("dense_mlp_bits").get<double>(), w.at("experts_bits").get<double>(),
                w.at("fp8_compute").get<bool>(),      w.value("sized", true)};
        }
        m.rope_theta = j.at("rope_theta").get<double>();
        m.max_model_len = j.value("max_model_len", int64_t{0});
        m.max_model_len_from = j.value("max_model_len_from", std::string());
        m.rms_norm_eps = j.at("rms_norm_eps").get<double>();
        m.tie_embeddings = j.at("tie_embeddings").get<bool>();
        m.mlp_projections = j.value("mlp_projections", 3);
        m.cache_layers_per_decoder_layer = j.value("cache_layers_per_decoder_layer", 1);
        if (j.contains("norms")) {  // absent: NormsAndBiases' defaults (a Llama decoder)
            const auto& n = j.at("norms");
            const NormsAndBiases d;
            m.norms.per_part = n.value("per_part", d.per_part);
            m.norms.parallel = n.value("parallel", d.parallel);
            m.norms.norm_bias = n.value("norm_bias", d.norm_bias);
            m.norms.qk = parse_qk_norm(n.value("qk", std::string(qk_norm_name(d.qk))));
            m.norms.qkv_bias = n.value("qkv_bias", d.qkv_bias);
            m.norms.o_bias = n.value("o_bias", d.o_bias);
            m.norms.mlp_bias = n.value("mlp_bias", d.mlp_bias);
            m.norms.router_bias = n.value("router_bias", d.router_bias);
            m.norms.shared_expert_gate = n.value("shared_expert_gate", d.shared_expert_gate);
            m.norms.attention_output_gate =
                n.value("attention_output_gate", d.attention_output_gate);
            m.norms.mamba2_conv_bias = n.value("mamba2_conv_bias", d.mamba2_conv_bias);
            m.norms.mamba2_proj_bias = n.value("mamba2_proj_bias", d.mamba2_proj_bias);
        }
        if (j.contains("layers")) {
            for (const auto& l : j.at("layers")) {
                LayerSpec s;
                s.kind = parse_layer_kind(l.at("kind").get<std::string>());
                s.num_kv_heads = l.at("num_kv_heads").get<int>();
                s.head_dim = l.at("head_dim").get<int>();
                s.window = l.at("window").get<int>();
                s.learned_sinks = l.at("learned_sinks").get<bool>();
                s.indexer = l.at("indexer").get<bool>();
                s.mlp = parse_mlp_kind(l.at("mlp").get<std::string>());
                s.intermediate = l.at("intermediate").get<int>();
                m.layers.push_back(s);
            }
            const auto& st = j.at("state");
            m.state = {st.at("heads").get<int>(),
                       st.at("head_dim").get<int>(),
                       st.at("groups").get<int>(),
                       st.at("group_dim").get<int>(),
                       st.at("conv_kernel").get<int>(),
                       parse_dtype(st.at("conv_dtype").get<std::string>()),
                       parse_dtype(st.at("state_dtype").get<std::string>()),
                       st.value("kda", false)};
            m.state.spec_conv_rows = st.value("spec_conv_rows", 0);
        }
        if (j.contains("indexer")) {
            const auto& ix = j.at("indexer");
            m.indexer = {ix.at("heads").get<int>(), ix.at("head_dim").get<int>(),
                         ix.at("topk").get<int>(), parse_dtype(ix.at("dtype").get<std::string>()),
                         ix.at("scale_bytes").get<int>()};
        }
        if (j.contains("mtp")) {
            const auto& t = j.at("mtp");
            auto layer_of = [](const nlohmann::json& l) {
                LayerSpec s;
                s.kind = parse_layer_kind(l.at("kind").get<std::string>());
                s.num_kv_heads = l.at("num_kv_heads").get<int>();
                s.head_dim = l.at("head_dim").get<int>();
                s.indexer = l.at("indexer").get<bool>();
                s.mlp = parse_mlp_kind(l.at("mlp").get<std::string>());
                s.intermediate = l.at("intermediate").get<int>();
                return s;
            };
            m.mtp.layers = t.at("layers").get<int>();
            m.mtp.not_modelled = t.value("not_modelled", "");
            if (m.mtp.layers > 0) {
                m.mtp.proj_split_by_tp = t.at("proj_split_by_tp").get<bool>();
                m.mtp.layer = layer_of(t.at("layer"));
                if (t.contains("following"))
                    for (const auto& l : t.at("following")) m.mtp.following.push_back(layer_of(l));
            }
        }
        m.validate();
        return m;
    } catch (const nlohmann::json::exception& e) {
        throw Error(std::string("model JSON is incomplete or mistyped: ") + e.what());
    }
}

}  // namespace kvshard
