#include "kvshard/model/weights.h"

#include <cmath>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
    return h;
}

bool ends_with(const std::string& s, const char* suffix) {
    const std::string_view suf(suffix);
    return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

class RandomSource final : public TensorSource {
  public:
    explicit RandomSource(uint64_t seed) : seed_(seed) {}
    bool has(const std::string& name) const override { return !ends_with(name, ".bias"); }

    std::vector<float> read(const std::string& name, const std::vector<int64_t>& shape,
                            int64_t row_begin, int64_t row_end, int64_t col_begin,
                            int64_t col_end) const override {
        require(has(name), "tensor '", name, "' is not in the random weights");
        int64_t cols = 1;
        for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
        const bool is_norm = shape.size() == 1 && name.find("norm") != std::string::npos;
        const bool is_embed = name == hf_names::kEmbed;
        const float scale = is_norm ? 0.1f : is_embed ? 1.0f : 1.0f / std::sqrt(float(cols));
        const float offset = is_norm ? 1.0f : 0.0f;
        const uint64_t tensor_seed = splitmix64(seed_ ^ fnv1a(name));
        std::vector<float> out;
        out.reserve(size_t((row_end - row_begin) * (col_end - col_begin)));
        for (int64_t r = row_begin; r < row_end; ++r)
            for (int64_t c = col_begin; c < col_end; ++c) {
                const uint64_t bits = splitmix64(tensor_seed + uint64_t(r * cols + c));
                // 24 random bits -> U[-1, 1)
                const float u = float(int64_t(bits >> 40) - (int64_t{1} << 23)) / float(1 << 23);
                out.push_back(offset + scale * u);
            }
        return out;
    }

  private:
    uint64_t seed_;
};

int64_t row_elems(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
    return n;
}

// Reads tensors of one layer / the model with the shape checks in one place. A tensor of more
// than two dimensions is read as rows of its trailing dimensions (conv1d's [C][1][K]).
class Reader {
  public:
    explicit Reader(const TensorSource& s) : s_(s) {}
    std::vector<float> full(const std::string& name, std::vector<int64_t> shape) const {
        return s_.read(name, shape, 0, shape[0], 0, row_elems(shape));
    }
    std::vector<float> rows(const std::string& name, std::vector<int64_t> shape, int64_t b,
                            int64_t e) const {
        return s_.read(name, shape, b, e, 0, row_elems(shape));
    }
    // Appends rows [b, e) to out.
    void append_rows(std::vector<float>& out, const std::string& name,
                     const std::vector<int64_t>& shape, int64_t b, int64_t e) const {
        const auto r = rows(name, shape, b, e);
        out.insert(out.end(), r.begin(), r.end());
    }
    std::vector<float> cols(const std::string& name, std::vector<int64_t> shape, int64_t b,
                            int64_t e) const {
        return s_.read(name, shape, 0, shape[0], b, e);
    }
    bool has(const std::string& name) const { return s_.has(name); }

  private:
    const TensorSource& s_;
};

}  // namespace

WeightShard WeightShard::full(const ModelSpec& m) {
    WeightShard s;
    s.layer_end = m.num_layers;
    s.q_head_end = m.num_heads;
    s.kv_head_end = m.num_kv_heads;
    s.mlp_end = m.intermediate;
    s.expert_end = m.moe.num_experts;
    s.state_head_end = m.state.heads;
    return s;
}

int WeightShard::state_group_begin(const ModelSpec& m) const {
    if (m.state.groups <= 0 || num_state_heads() <= 0) return 0;
    return state_head_begin / (m.state.heads / m.state.groups);
}
int WeightShard::state_group_end(const ModelSpec& m) const {
    if (m.state.groups <= 0 || num_state_heads() <= 0) return 0;
    return (state_head_end - 1) / (m.state.heads / m.state.groups) + 1;
}

void check_executable(const ModelSpec& m) {
    require(m.cache_layers_per_decoder_layer == 1, m.name, ": its decoder layers hold ",
            m.cache_layers_per_decoder_layer,
            " cache layers each (branches side by side, as Falcon-H1's attention and Mamba-2, or "
            "LongCat-Flash's two attentions around one MoE); the reference model runs one mixer "
            "and one MLP per decoder layer, so it sizes and plans this model but does not run it");
    require(m.moe.shared_experts == 0, m.name,
            ": shared experts are not supported by the reference model (Mixtral-style MoE only)");
    require(m.moe.latent_size == 0, m.name,
            ": a latent MoE (moe.latent_size) is not run by the reference model (Mixtral-style MoE "
            "only)");
    for (int l = 0; l < m.num_layers; ++l) {
        const LayerSpec s = m.layer(l);
        require(s.kind != LayerKind::kMamba2, m.name, ": layer ", l,
                " is a Mamba-2 layer; the reference model runs Gated DeltaNet as its state layer "
                "(Mamba-2 is sized by the layout but not executed)");
        require(s.kind != LayerKind::kMamba1, m.name, ": layer ", l,
                " is a Mamba-1 layer (Jamba); the reference model runs Gated DeltaNet as its "
                "state layer (Mamba-1 is sized by the layout but not executed)");
        require(s.kind != LayerKind::kShortConv, m.name, ": layer ", l,
                " is a short-conv layer (LFM2); the reference model runs Gated DeltaNet as its "
                "state layer (short conv is sized by the layout but not executed)");
        require(!s.indexer, m.name, ": layer ", l,
                " has a sparse-attention indexer, which the reference model does not execute");
        if (s.kind != LayerKind::kMla && holds_tokens(s.kind))
            require(s.num_kv_heads == m.num_kv_heads && s.head_dim == m.head_dim, m.name,
                    ": layer ", l, " has ", s.num_kv_heads, " KV heads of ", s.head_dim,
                    " where the model has ", m.num_kv_heads, " of ", m.head_dim,
                    ": the reference model runs attention layers of the model's one shape");
        if (s.mlp == MlpKind::kDense)
            require(s.intermediate == m.intermediate, m.name, ": layer ", l, " has an MLP of ",
                    s.intermediate, " where the model's is ", m.intermediate,
                    ": the reference model runs one dense MLP width");
        require(s.kind != LayerKind::kGatedDeltaNet || !m.state.kda, m.name, ": layer ", l,
                " is a Kimi Delta Attention (KDA) layer; the reference model runs Gated DeltaNet "
                "only (KDA is sized by the layout but not executed)");
        if (s.kind == LayerKind::kGatedDeltaNet)
            require(m.state.heads > 0 && m.state.groups > 0 &&
                        m.state.heads % m.state.groups == 0 && m.state.conv_kernel >= 1,
                    m.name,
                    ": Gated DeltaNet needs state.heads a multiple of state.groups and a "
                    "conv kernel of at least 1");
    }
    if (m.is_mla())
        require(m.mla.qk_rope_head_dim % 2 == 0, m.name,
                ": RoPE needs an even qk_rope_head_dim, got ", m.mla.qk_rope_head_dim);
}

namespace hf_names {
std::string layer_prefix(int layer) { return "model.layers." + std::to_string(layer) + "."; }
std::string expert(int layer, int e, const char* w) {
    return layer_prefix(layer) + "block_sparse_moe.experts." + std::to_string(e) + "." + w +
           ".weight";
}
}  // namespace hf_names

namespace {

// The mixer tensors of layer l (everything between input_layernorm and post_attention_layernorm).
void mixer_tensors(const ModelSpec& m, int l,
                   std::vector<std::pair<std::string, std::vector<int64_t>>>& out) {
    const LayerSpec ls = m.layer(l);
    const std::string p = hf_names::layer_prefix(l);
    const int64_t h = m.hidden, H = m.num_heads;
    switch (ls.kind) {
        case LayerKind::kNoKv:
            return;
        case LayerKind::kMla: {
            const auto& a = m.mla;
            const int64_t qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
            if (a.q_lora_rank > 0) {
                out.push_back({p + "self_attn.q_a_proj.weight", {a.q_lora_rank, h}});
                out.push_back({p + "self_attn.q_a_layernorm.weight", {a.q_lora_rank}});
                out.push_back({p + "self_attn.q_b_proj.weight", {H * qk, a.q_lora_rank}});
            } else {
                out.push_back({p + "self_attn.q_proj.weight", {H * qk, h}});
            }
            out.push_back({p + "self_attn.kv_a_proj_with_mqa.weight",
                           {a.kv_lora_rank + a.qk_rope_head_dim, h}});
            out.push_back({p + "self_attn.kv_a_layernorm.weight", {a.kv_lora_rank}});
            out.push_back({p + "self_attn.kv_b_proj.weight",
                           {H * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank}});
            out.push_back({p + "self_attn.o_proj.weight", {h, H * a.v_head_dim}});
            return;
        }
        case LayerKind::kShortConv:
            throw Error(detail::concat(m.name,
                                       ": short-conv layers have no tensor list here "
                                       "(not executed)"));
        case LayerKind::kMamba1:
            throw Error(detail::concat(m.name,
                                       ": Mamba-1 layers have no tensor list here "
                                       "(not executed)"));
        case LayerKind::kGatedDeltaNet:
        case LayerKind::kMamba2: {
            require(!m.state.kda, m.name,
                    ": Kimi Delta Attention layers have no tensor list here (not executed)");
            const auto& st = m.state;
            const int64_t kd = st.group_dim, vd = st.head_dim, g = st.groups, hv = st.heads;
            const std::string a = p + "linear_attn.";
            out.push_back({a + "in_proj_qkvz.weight", {2 * g * kd + 2 * hv * vd, h}});
            out.push_back({a + "in_proj_ba.weight", {2 * hv, h}});
            out.push_back({a + "conv1d.weight", {2 * g * kd + hv * vd, 1, st.conv_kernel}});
            out.push_back({a + "dt_bias", {hv}});
            out.push_back({a + "A_log", {hv}});
            out.push_back({a + "norm.weight", {vd}});
            out.push_back({a + "out_proj.weight", {h, hv * vd}});
            return;
        }
        default: {
            const int64_t d = m.head_dim;
            out.push_back({p + "self_attn.q_proj.weight", {H * d, h}});
            out.push_back({p + "self_attn.k_proj.weight", {m.num_kv_heads * d, h}});
            out.push_back({p + "self_attn.v_proj.weight", {m.num_kv_heads * d, h}});
            out.push_back({p + "self_attn.o_proj.weight", {h, H * d}});
            if (ls.learned_sinks) out.push_back({p + "self_attn.sinks", {H}});
            return;
        }
    }
}

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> hf_tensor_list(const ModelSpec& m) {
    const int64_t h = m.hidden;
    std::vector<std::pair<std::string, std::vector<int64_t>>> out;
    out.push_back({hf_names::kEmbed, {m.vocab, h}});
    for (int l = 0; l < m.num_layers; ++l) {
        const std::string p = hf_names::layer_prefix(l);
        const LayerSpec ls = m.layer(l);
        if (ls.kind != LayerKind::kNoKv) out.push_back({p + "input_layernorm.weight", {h}});
        mixer_tensors(m, l, out);
        if (ls.mlp == MlpKind::kNone) continue;
        out.push_back({p + "post_attention_layernorm.weight", {h}});
        if (m.is_moe_layer(l)) {
            const int64_t ei = m.moe.expert_intermediate;
            out.push_back({p + "block_sparse_moe.gate.weight", {m.moe.num_experts, h}});
            for (int e = 0; e < m.moe.num_experts; ++e) {
                out.push_back({hf_names::expert(l, e, "w1"), {ei, h}});
                out.push_back({hf_names::expert(l, e, "w2"), {h, ei}});
                out.push_back({hf_names::expert(l, e, "w3"), {ei, h}});
            }
        } else {
            out.push_back({p + "mlp.gate_proj.weight", {m.intermediate, h}});
            out.push_back({p + "mlp.up_proj.weight", {m.intermediate, h}});
            out.push_back({p + "mlp.down_proj.weight", {h, m.intermediate}});
        }
    }
    out.push_back({hf_names::kFinalNorm, {h}});
    if (!m.tie_embeddings) out.push_back({hf_names::kLmHead, {m.vocab, h}});
    return out;
}

namespace {

void load_attention(const ModelSpec& m, int l, const WeightShard& s, const Reader& rd,
                    LayerWeights& lw) {
    const std::string p = hf_names::layer_prefix(l);
    const int64_t h = m.hidden, d = m.head_dim;
    const std::vector<int64_t> q_shape{m.num_heads * d, h}, kv_shape{m.num_kv_heads * d, h};
    lw.wq = rd.rows(p + "self_attn.q_proj.weight", q_shape, s.q_head_begin * d, s.q_head_end * d);
    lw.wk =
        rd.rows(p + "self_attn.k_proj.weight", kv_shape, s.kv_head_begin * d, s.kv_head_end * d);
    lw.wv =
        rd.rows(p + "self_attn.v_proj.weight", kv_shape, s.kv_head_begin * d, s.kv_head_end * d);
    if (rd.has(p + "self_attn.q_proj.bias")) {
        lw.bq = rd.rows(p + "self_attn.q_proj.bias", {m.num_heads * d}, s.q_head_begin * d,
                        s.q_head_end * d);
        lw.bk = rd.rows(p + "self_attn.k_proj.bias", {m.num_kv_heads * d}, s.kv_head_begin * d,
                        s.kv_head_end * d);
        lw.bv = rd.rows(p + "self_attn.v_proj.bias", {m.num_kv_heads * d}, s.kv_head_begin * d,
                        s.kv_head_end * d);
    }
    lw.wo = rd.cols(p + "self_attn.o_proj.weight", {h, m.num_heads * d}, s.q_head_begin * d,
                    s.q_head_end * d);
    if (m.layer(l).learned_sinks)
        lw.sinks = rd.rows(p + "self_attn.sinks", {m.num_heads}, s.q_head_begin, s.q_head_end);
}

void load_mla(const ModelSpec& m, int l, const WeightShard& s, const Reader& rd, LayerWeights& lw) {
    const std::string p = hf_names::layer_prefix(l) + "self_attn.";
    const auto& a = m.mla;
    const int64_t h = m.hidden, H = m.num_heads, qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
    const int64_t kvb = a.qk_nope_head_dim + a.v_head_dim;
    if (a.q_lora_rank > 0) {
        lw.wq_a = rd.full(p + "q_a_proj.weight", {a.q_lora_rank, h});
        lw.q_a_norm = rd.full(p + "q_a_layernorm.weight", {a.q_lora_rank});
        lw.wq = rd.rows(p + "q_b_proj.weight", {H * qk, a.q_lora_rank}, s.q_head_begin * qk,
                        s.q_head_end * qk);
    } else {
        lw.wq = rd.rows(p + "q_proj.weight", {H * qk, h}, s.q_head_begin * qk, s.q_head_end * qk);
    }
    lw.wkv_a = rd.full(p + "kv_a_proj_with_mqa.weight", {a.kv_lora_rank + a.qk_rope_head_dim, h});
    lw.kv_a_norm = rd.full(p + "kv_a_layernorm.weight", {a.kv_lora_rank});
    lw.wkv_b = rd.rows(p + "kv_b_proj.weight", {H * kvb, a.kv_lora_rank}, s.q_head_begin * kvb,
                       s.q_head_end * kvb);
    lw.wo = rd.cols(p + "o_proj.weight", {h, H * a.v_head_dim}, s.q_head_begin * a.v_head_dim,
                    s.q_head_end * a.v_head_dim);
}

// Qwen3-Next's fused projections are grouped per key head g: in_proj_qkvz rows
// [q_g (k_d) | k_g (k_d) | v_g (r v_d) | z_g (r v_d)], in_proj_ba rows [b_g (r) | a_g (r)], with
// r = value heads per key head; conv1d channels are [q (all) | k (all) | v (all)].
void load_gated_deltanet(const ModelSpec& m, int l, const WeightShard& s, const Reader& rd,
                         LayerWeights& lw) {
    const std::string p = hf_names::layer_prefix(l) + "linear_attn.";
    const auto& st = m.state;
    const int64_t h = m.hidden, kd = st.group_dim, vd = st.head_dim, g = st.groups, hv = st.heads;
    const int64_t r = hv / g, blk = 2 * kd + 2 * r * vd;
    const std::vector<int64_t> qkvz{2 * g * kd + 2 * hv * vd, h}, ba{2 * hv, h};
    const int g0 = s.state_group_begin(m), g1 = s.state_group_end(m);
    for (int64_t k = g0; k < g1; ++k) {
        rd.append_rows(lw.lin_q, p + "in_proj_qkvz.weight", qkvz, k * blk, k * blk + kd);
        rd.append_rows(lw.lin_k, p + "in_proj_qkvz.weight", qkvz, k * blk + kd, k * blk + 2 * kd);
    }
    for (int64_t j = s.state_head_begin; j < s.state_head_end; ++j) {
        const int64_t k = j / r, i = j % r;
        const int64_t v0 = k * blk + 2 * kd + i * vd, z0 = k * blk + 2 * kd + r * vd + i * vd;
        rd.append_rows(lw.lin_v, p + "in_proj_qkvz.weight", qkvz, v0, v0 + vd);
        rd.append_rows(lw.lin_z, p + "in_proj_qkvz.weight", qkvz, z0, z0 + vd);
        rd.append_rows(lw.lin_b, p + "in_proj_ba.weight", ba, k * 2 * r + i, k * 2 * r + i + 1);
        rd.append_rows(lw.lin_a, p + "in_proj_ba.weight", ba, k * 2 * r + r + i,
                       k * 2 * r + r + i + 1);
    }
    const std::vector<int64_t> conv{2 * g * kd + hv * vd, 1, st.conv_kernel};
    rd.append_rows(lw.conv, p + "conv1d.weight", conv, g0 * kd, g1 * kd);
    rd.append_rows(lw.conv, p + "conv1d.weight", conv, g * kd + g0 * kd, g * kd + g1 * kd);
    rd.append_rows(lw.conv, p + "conv1d.weight", conv, 2 * g * kd + s.state_head_begin * vd,
                   2 * g * kd + s.state_head_end * vd);
    lw.dt_bias = rd.rows(p + "dt_bias", {hv}, s.state_head_begin, s.state_head_end);
    lw.a_log = rd.rows(p + "A_log", {hv}, s.state_head_begin, s.state_head_end);
    lw.lin_norm = rd.full(p + "norm.weight", {vd});
    lw.wo = rd.cols(p + "out_proj.weight", {h, hv * vd}, s.state_head_begin * vd,
                    s.state_head_end * vd);
}

}  // namespace

ModelWeights load_weights(const ModelSpec& m, const WeightShard& s, const TensorSource& source) {
    check_executable(m);
    const bool any_state = m.state_bytes_per_sequence() > 0;
    require(0 <= s.layer_begin && s.layer_begin < s.layer_end && s.layer_end <= m.num_layers &&
                0 <= s.q_head_begin && s.q_head_begin < s.q_head_end &&
                s.q_head_end <= m.num_heads && 0 <= s.kv_head_begin &&
                s.kv_head_begin < s.kv_head_end && s.kv_head_end <= std::max(1, m.num_kv_heads) &&
                0 <= s.mlp_begin && s.mlp_begin < s.mlp_end && s.mlp_end <= m.intermediate &&
                0 <= s.expert_begin && s.expert_begin <= s.expert_end &&
                s.expert_end <= m.moe.num_experts &&
                (!any_state || (0 <= s.state_head_begin && s.state_head_begin < s.state_head_end &&
                                s.state_head_end <= m.state.heads)),
            "weight shard out of range for ", m.name);
    const Reader rd(source);
    const int64_t h = m.hidden;
    ModelWeights w;
    w.spec = m;
    w.shard = s;
    w.embed = rd.full(hf_names::kEmbed, {m.vocab, h});
    w.final_norm = rd.full(hf_names::kFinalNorm, {h});
    if (m.tie_embeddings) {
        w.lm_head = w.embed;
    } else {
        w.lm_head = rd.full(hf_names::kLmHead, {m.vocab, h});
    }
    for (int l = s.layer_begin; l < s.layer_end; ++l) {
        const std::string p = hf_names::layer_prefix(l);
        const LayerSpec ls = m.layer(l);
        LayerWeights lw;
        lw.kind = ls.kind;
        if (ls.kind != LayerKind::kNoKv) lw.attn_norm = rd.full(p + "input_layernorm.weight", {h});
        if (ls.kind == LayerKind::kMla)
            load_mla(m, l, s, rd, lw);
        else if (ls.kind == LayerKind::kGatedDeltaNet)
            load_gated_deltanet(m, l, s, rd, lw);
        else if (ls.kind != LayerKind::kNoKv)
            load_attention(m, l, s, rd, lw);
        if (ls.mlp != MlpKind::kNone)
            lw.mlp_norm = rd.full(p + "post_attention_layernorm.weight", {h});
        if (m.is_moe_layer(l)) {
            const int64_t ei = m.moe.expert_intermediate, ne = m.moe.num_experts;
            // Mixtral names, or Qwen-MoE names (mlp.gate / mlp.experts.E.{gate,up,down}_proj).
            const bool mixtral =
                rd.has(p + "block_sparse_moe.gate.weight") || !rd.has(p + "mlp.gate.weight");
            lw.router = rd.full(p + (mixtral ? "block_sparse_moe.gate.weight" : "mlp.gate.weight"),
                                {ne, h});
            for (int e = s.expert_begin; e < s.expert_end; ++e) {
                const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
                ExpertWeights ew;
                ew.gate = rd.full(mixtral ? hf_names::expert(l, e, "w1") : ep + "gate_proj.weight",
                                  {ei, h});
                ew.up = rd.full(mixtral ? hf_names::expert(l, e, "w3") : ep + "up_proj.weight",
                                {ei, h});
                ew.down = rd.full(mixtral ? hf_names::expert(l, e, "w2") : ep + "down_proj.weight",
                                  {h, ei});
                lw.experts.push_back(std::move(ew));
            }
        } else if (ls.mlp == MlpKind::kDense) {
            const std::vector<int64_t> up_shape{m.intermediate, h}, down_shape{h, m.intermediate};
            lw.gate = rd.rows(p + "mlp.gate_proj.weight", up_shape, s.mlp_begin, s.mlp_end);
            lw.up = rd.rows(p + "mlp.up_proj.weight", up_shape, s.mlp_begin, s.mlp_end);
            lw.down = rd.cols(p + "mlp.down_proj.weight", down_shape, s.mlp_begin, s.mlp_end);
        }
        w.layers.push_back(std::move(lw));
    }
    return w;
}

double weight_shard_bytes(const ModelSpec& m, const WeightShard& s) {
    const double h = m.hidden, d = m.head_dim;
    double elems = 2.0 * m.vocab * h + h;  // embed, lm_head (a copy when tied), final norm
    for (int l = s.layer_begin; l < s.layer_end; ++l) {
        const LayerSpec ls = m.layer(l);
        const double nq = s.num_q_heads();
        if (ls.kind != LayerKind::kNoKv) elems += h;  // input norm
        if (ls.kind == LayerKind::kMla) {
            const auto& a = m.mla;
            const double qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
            elems += a.q_lora_rank > 0 ? double(a.q_lora_rank) * (h + 1) + nq * qk * a.q_lora_rank
                                       : nq * qk * h;
            elems += double(a.kv_lora_rank + a.qk_rope_head_dim) * h + a.kv_lora_rank;
            elems += nq * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank;
            elems += nq * a.v_head_dim * h;
        } else if (ls.kind == LayerKind::kGatedDeltaNet) {
            const auto& st = m.state;
            const double gl = s.state_group_end(m) - s.state_group_begin(m);
            const double hl = s.num_state_heads();
            const double ch = 2 * gl * st.group_dim + hl * st.head_dim;
            elems += (2 * gl * st.group_dim + 2 * hl * st.head_dim + 2 * hl) * h;  // projections
            elems += ch * st.conv_kernel + 2 * hl + st.head_dim;  // conv, dt_bias, A_log, norm
            elems += hl * st.head_dim * h;                        // out_proj
        } else if (ls.kind == LayerKind::kShortConv || ls.kind == LayerKind::kMamba1) {
            require(false, m.name, ": layer ", l, " (", layer_kind_name(ls.kind),
                    ") is not executed by the reference model, whose weights this sizes");
        } else if (ls.kind != LayerKind::kNoKv) {
            elems += 2 * nq * d * h;                // wq, wo
            elems += 2 * s.num_kv_heads() * d * h;  // wk, wv
            if (ls.learned_sinks) elems += nq;
        }
        if (ls.mlp == MlpKind::kNone) continue;
        elems += h;  // post-attention norm
        if (m.is_moe_layer(l))
            elems += double(m.moe.num_experts) * h +  // router
                     3.0 * s.num_experts() * m.moe.expert_intermediate * h;
        else
            elems += 3.0 * s.mlp_width() * h;
    }
    return elems * sizeof(float);
}

std::unique_ptr<TensorSource> random_tensor_source(uint64_t seed) {
    return std::make_unique<RandomSource>(seed);
}

ModelWeights random_weights(const ModelSpec& m, const WeightShard& shard, uint64_t seed) {
    return load_weights(m, shard, RandomSource(seed));
}

}  // namespace kvshard
