#include "model/hf_quantization.h"

#include <string_view>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

// Names in modules_to_not_convert / ignored_layers that an fp8 checkpoint may leave unquantized
// without changing what kvshard sizes as quantized: these parts are kept at weight_dtype anyway.
bool left_unquantized_anyway(std::string_view name) {
    for (std::string_view part :
         {"lm_head", "embed", "norm", "router", ".gate", "mlp.gate", "shared_expert_gate"})
        if (name.find(part) != std::string_view::npos &&
            name.find("gate_proj") == std::string_view::npos &&
            name.find("gate_up") == std::string_view::npos)
            return true;
    return false;
}

// compressed-tensors (llm-compressor's checkpoints: RedHatAI's FP8-dynamic, W4A16, NVFP4 ...): one
// config group over every Linear layer. Bits a weight with its scales: fp8 per channel or tensor 8
// (one scale per row or tensor); a group of g weights sharing a 16-bit scale adds 16 / g (an
// asymmetric int group also a 4- or 8-bit zero point, num_bits / g); NVFP4 (4-bit floats, groups of
// 16 with an fp8 scale) 4 + 8 / 16. fp8 matmuls when weights and input activations are both 8-bit
// floats. Anything else (several groups, other targets, ignore lists beyond the LM head, router,
// norms and embedding, or whole attention blocks) is recorded unsized.
WeightStorage compressed_tensors_storage(const nlohmann::json& q) {
    WeightStorage unsized{"compressed-tensors", 0, 0, 0, false, false};
    const auto groups = q.find("config_groups");
    if (groups == q.end() || !groups->is_object() || groups->size() != 1) return unsized;
    const nlohmann::json& g = groups->begin().value();
    if (!g.is_object()) return unsized;
    const auto targets = g.find("targets");
    if (targets == g.end() || *targets != nlohmann::json::array({"Linear"})) return unsized;
    const auto wt = g.find("weights");
    if (wt == g.end() || !wt->is_object()) return unsized;
    auto field = [](const nlohmann::json& o, const char* key) {
        const auto it = o.find(key);
        return it == o.end() ? nlohmann::json() : *it;
    };
    const nlohmann::json nb = field(*wt, "num_bits"), type = field(*wt, "type"),
                         strategy = field(*wt, "strategy"), gs = field(*wt, "group_size"),
                         sym = field(*wt, "symmetric");
    if (!nb.is_number_integer() || !type.is_string() || !strategy.is_string()) return unsized;
    const int64_t bits = nb.get<int64_t>();
    const std::string t = type.get<std::string>(), st = strategy.get<std::string>();
    double stored = 0;
    if (t == "float" && bits == 8 && (st == "channel" || st == "tensor")) {
        stored = 8;
    } else if ((t == "int" && (bits == 4 || bits == 8)) && st == "group" &&
               gs.is_number_integer() && gs.get<int64_t>() >= 1 && gs.get<int64_t>() <= (1 << 20)) {
        const double group = static_cast<double>(gs.get<int64_t>());
        const bool symmetric = sym.is_boolean() ? sym.get<bool>() : true;
        stored = static_cast<double>(bits) + 16.0 / group +
                 (symmetric ? 0.0 : static_cast<double>(bits) / group);
    } else if (t == "int" && (bits == 4 || bits == 8) && st == "channel") {
        stored = static_cast<double>(bits);
    } else if (t == "float" && bits == 4 && st == "tensor_group" && gs == nlohmann::json(16)) {
        stored = 4 + 8.0 / 16;
    } else {
        return unsized;
    }
    bool attention_left = false;
    if (const nlohmann::json ignore = field(q, "ignore"); !ignore.is_null()) {
        if (!ignore.is_array()) return unsized;
        for (const auto& e : ignore) {
            if (!e.is_string()) return unsized;
            const std::string name = e.get<std::string>();
            if (left_unquantized_anyway(name)) continue;
            // Every layer's attention (a regex over all layers), kept at torch_dtype.
            if (name.rfind("re:", 0) == 0 && name.find("self_attn") != std::string::npos &&
                name.find(".*") != std::string::npos) {
                attention_left = true;
                continue;
            }
            return unsized;
        }
    }
    const nlohmann::json act = field(g, "input_activations");
    const bool fp8_compute = stored == 8 && t == "float" && act.is_object() &&
                             field(act, "num_bits") == nlohmann::json(8) &&
                             field(act, "type") == nlohmann::json("float");
    return {"compressed-tensors", attention_left ? 0.0 : stored, stored, stored, fp8_compute, true};
}

}  // namespace

WeightStorage hf_weight_storage(const nlohmann::json& q, const std::string& file) {
    auto refuse = [&](const std::string& why) {
        return Error(detail::concat(file, ": quantization_config", why));
    };
    if (!q.is_object()) throw refuse(" must be an object");
    if (!q.contains("quant_method") || !q.at("quant_method").is_string())
        throw refuse(" has no quant_method string; expected e.g. \"fp8\" or \"mxfp4\"");
    const std::string method = q.at("quant_method").get<std::string>();
    WeightStorage w;
    if (method == "fp8") {
        const std::string fmt =
            q.contains("fmt") && q.at("fmt").is_string() ? q.at("fmt").get<std::string>() : "e4m3";
        if (fmt != "e4m3" && fmt != "e5m2")
            throw refuse(detail::concat(".fmt is '", fmt, "'; expected e4m3 or e5m2"));
        double bits = 8;  // one fp32 scale per tensor: no bits per weight to speak of
        if (q.contains("weight_block_size") && !q.at("weight_block_size").is_null()) {
            const auto& b = q.at("weight_block_size");
            if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() ||
                !b[1].is_number_integer() || b[0].get<int64_t>() < 1 || b[1].get<int64_t>() < 1 ||
                b[0].get<int64_t>() > (1 << 20) || b[1].get<int64_t>() > (1 << 20))
                throw refuse(detail::concat(".weight_block_size is ", b.dump(),
                                            "; expected two positive integers, e.g. [128, 128]"));
            // One fp32 scale (weight_scale_inv) per block.
            bits += 32.0 / (static_cast<double>(b[0].get<int64_t>()) *
                            static_cast<double>(b[1].get<int64_t>()));
        }
        for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
            if (!q.contains(key) || q.at(key).is_null()) continue;
            if (!q.at(key).is_array()) throw refuse(detail::concat(".", key, " must be a list"));
            for (const auto& name : q.at(key)) {
                if (!name.is_string())
                    throw refuse(detail::concat(".", key, " must be a list of module names"));
                if (!left_unquantized_anyway(name.get<std::string>()))
                    throw refuse(detail::concat(
                        ".", key, " leaves '", name.get<std::string>(),
                        "' unquantized; kvshard sizes the attention, MLP and expert weights of "
                        "every layer alike. Give the weights' storage with --weight-dtype instead "
                        "(and remove quantization_config)"));
            }
        }
        w = {"fp8", bits, bits, bits, true};
    } else if (method == "compressed-tensors") {
        w = compressed_tensors_storage(q);
    } else if (method == "mxfp4") {
        // vLLM's Mxfp4Config quantizes the fused MoE layers only (4-bit e2m1 values in blocks of
        // 32 with one e8m0 scale each: 4 + 8 / 32 bits); linear layers stay at torch_dtype, and on
        // GPUs without fp4 matmuls the experts are widened to the activations' type.
        w = {"mxfp4", 0, 0, 4.25, false};
    } else {
        // Sized only with --weight-dtype (capacity.h, weight_bits): the KV figures do not depend
        // on the weights' storage.
        w.method = method;
        w.sized = false;
    }
    return w;
}

}  // namespace kvshard
