#include "kvshard/model/model_spec.h"

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

int ModelSpec::num_moe_layers() const {
    return moe.enabled() ? num_layers - moe.first_dense_layers : 0;
}

int64_t ModelSpec::kv_elems_per_token_per_layer() const {
    if (is_mla()) return int64_t{mla.kv_lora_rank} + mla.qk_rope_head_dim;
    return 2 * int64_t{num_kv_heads} * head_dim;
}

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
        return q + kv_a + kv_b + o;
    }
    return h * num_heads * head_dim + 2 * h * num_kv_heads * head_dim +
           int64_t{num_heads} * head_dim * h;
}

int64_t ModelSpec::dense_mlp_params_per_layer() const { return 3 * int64_t{hidden} * intermediate; }

int64_t ModelSpec::expert_params() const { return 3 * int64_t{hidden} * moe.expert_intermediate; }

int64_t ModelSpec::moe_params_per_layer() const {
    if (!moe.enabled()) return 0;
    return (int64_t{moe.num_experts} + moe.shared_experts) * expert_params() +
           int64_t{hidden} * moe.num_experts;
}

int64_t ModelSpec::embedding_params() const { return int64_t{vocab} * hidden; }

int64_t ModelSpec::lm_head_params() const { return tie_embeddings ? 0 : int64_t{vocab} * hidden; }

int64_t ModelSpec::total_params() const {
    const int moe_layers = num_moe_layers();
    return num_layers * attention_params_per_layer() +
           (num_layers - moe_layers) * dense_mlp_params_per_layer() +
           moe_layers * moe_params_per_layer() + embedding_params() + lm_head_params();
}

int64_t ModelSpec::active_params_per_token() const {
    const int moe_layers = num_moe_layers();
    const int64_t active_moe =
        (int64_t{moe.experts_per_token} + moe.shared_experts) * expert_params() +
        int64_t{hidden} * moe.num_experts;
    return num_layers * attention_params_per_layer() +
           (num_layers - moe_layers) * dense_mlp_params_per_layer() + moe_layers * active_moe +
           int64_t{vocab} * hidden;  // LM head (tied or not, it is a matmul)
}

void ModelSpec::validate() const {
    auto positive = [&](int v, const char* field) {
        require(v > 0, "model '", name, "': ", field, " must be a positive integer, got ", v);
    };
    positive(num_layers, "num_layers");
    positive(hidden, "hidden");
    positive(num_heads, "num_heads");
    positive(vocab, "vocab");
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
    }
    if (!moe.enabled() || moe.first_dense_layers > 0) positive(intermediate, "intermediate");
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
          {"first_dense_layers", m.moe.first_dense_layers}}},
        {"kv_dtype", dtype_name(m.kv_dtype)},
        {"weight_dtype", dtype_name(m.weight_dtype)},
        {"rope_theta", m.rope_theta},
        {"rms_norm_eps", m.rms_norm_eps},
        {"tie_embeddings", m.tie_embeddings},
        {"total_params", m.total_params()},
        {"kv_bytes_per_token", m.kv_elems_per_token_per_layer() * m.num_layers *
                                   static_cast<int64_t>(dtype_size(m.kv_dtype))},
    };
    return j.dump(2);
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
        m.moe = {moe.at("num_experts").get<int>(), moe.at("experts_per_token").get<int>(),
                 moe.at("shared_experts").get<int>(), moe.at("expert_intermediate").get<int>(),
                 moe.at("first_dense_layers").get<int>()};
        m.kv_dtype = parse_dtype(j.at("kv_dtype").get<std::string>());
        m.weight_dtype = parse_dtype(j.at("weight_dtype").get<std::string>());
        m.rope_theta = j.at("rope_theta").get<double>();
        m.rms_norm_eps = j.at("rms_norm_eps").get<double>();
        m.tie_embeddings = j.at("tie_embeddings").get<bool>();
        m.validate();
        return m;
    } catch (const nlohmann::json::exception& e) {
        throw Error(std::string("model JSON is incomplete or mistyped: ") + e.what());
    }
}

}  // namespace kvshard
