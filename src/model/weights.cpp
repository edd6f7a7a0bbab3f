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
        const int64_t cols = shape.size() == 2 ? shape[1] : 1;
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

// Reads tensors of one layer / the model with the shape checks in one place.
class Reader {
  public:
    explicit Reader(const TensorSource& s) : s_(s) {}
    std::vector<float> full(const std::string& name, std::vector<int64_t> shape) const {
        const int64_t rows = shape[0], cols = shape.size() == 2 ? shape[1] : 1;
        return s_.read(name, shape, 0, rows, 0, cols);
    }
    std::vector<float> rows(const std::string& name, std::vector<int64_t> shape, int64_t b,
                            int64_t e) const {
        const int64_t cols = shape.size() == 2 ? shape[1] : 1;
        return s_.read(name, shape, b, e, 0, cols);
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
    return s;
}

namespace hf_names {
std::string layer_prefix(int layer) { return "model.layers." + std::to_string(layer) + "."; }
std::string expert(int layer, int e, const char* w) {
    return layer_prefix(layer) + "block_sparse_moe.experts." + std::to_string(e) + "." + w +
           ".weight";
}
}  // namespace hf_names

std::vector<std::pair<std::string, std::vector<int64_t>>> hf_tensor_list(const ModelSpec& m) {
    const int64_t h = m.hidden, d = m.head_dim;
    std::vector<std::pair<std::string, std::vector<int64_t>>> out;
    out.push_back({hf_names::kEmbed, {m.vocab, h}});
    for (int l = 0; l < m.num_layers; ++l) {
        const std::string p = hf_names::layer_prefix(l);
        out.push_back({p + "input_layernorm.weight", {h}});
        out.push_back({p + "self_attn.q_proj.weight", {m.num_heads * d, h}});
        out.push_back({p + "self_attn.k_proj.weight", {m.num_kv_heads * d, h}});
        out.push_back({p + "self_attn.v_proj.weight", {m.num_kv_heads * d, h}});
        out.push_back({p + "self_attn.o_proj.weight", {h, m.num_heads * d}});
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

ModelWeights load_weights(const ModelSpec& m, const WeightShard& s, const TensorSource& source) {
    require(!m.is_mla(), m.name, ": the reference model runs MHA/GQA/MQA attention, not MLA");
    require(m.uniform(), m.name, " has ", m.layer_mix(),
            ": the reference model runs models whose every layer is full attention of one shape; "
            "sliding, chunked, state and no-KV layers are not executed yet");
    require(m.moe.shared_experts == 0, m.name,
            ": shared experts are not supported by the reference model (Mixtral-style MoE only)");
    require(0 <= s.layer_begin && s.layer_begin < s.layer_end && s.layer_end <= m.num_layers &&
                0 <= s.q_head_begin && s.q_head_begin < s.q_head_end &&
                s.q_head_end <= m.num_heads && 0 <= s.kv_head_begin &&
                s.kv_head_begin < s.kv_head_end && s.kv_head_end <= m.num_kv_heads &&
                0 <= s.mlp_begin && s.mlp_begin < s.mlp_end && s.mlp_end <= m.intermediate &&
                0 <= s.expert_begin && s.expert_begin <= s.expert_end &&
                s.expert_end <= m.moe.num_experts,
            "weight shard out of range for ", m.name);
    const Reader rd(source);
    const int64_t h = m.hidden, d = m.head_dim;
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
        LayerWeights lw;
        lw.attn_norm = rd.full(p + "input_layernorm.weight", {h});
        const std::vector<int64_t> q_shape{m.num_heads * d, h}, kv_shape{m.num_kv_heads * d, h};
        lw.wq =
            rd.rows(p + "self_attn.q_proj.weight", q_shape, s.q_head_begin * d, s.q_head_end * d);
        lw.wk = rd.rows(p + "self_attn.k_proj.weight", kv_shape, s.kv_head_begin * d,
                        s.kv_head_end * d);
        lw.wv = rd.rows(p + "self_attn.v_proj.weight", kv_shape, s.kv_head_begin * d,
                        s.kv_head_end * d);
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
        } else {
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
        elems += 2 * h;                         // the two norms
        elems += 2 * s.num_q_heads() * d * h;   // wq, wo
        elems += 2 * s.num_kv_heads() * d * h;  // wk, wv
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
