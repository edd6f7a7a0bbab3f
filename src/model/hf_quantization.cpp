#include "model/hf_quantization.h"

#include <string_view>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

// Names in modules_to_not_convert / ignored_layers that an fp8 checkpoint may leave unquantized
// without changing what kvshard sizes as quantized: these parts are kept at weight_dtype anyway.
bool left_unquantized_anyway(std::string_view name) {
    for (std::string_view part : {"lm_head", "embed", "norm", "router", ".gate", "mlp.gate"})
        if (name.find(part) != std::string_view::npos &&
            name.find("gate_proj") == std::string_view::npos &&
            name.find("gate_up") == std::string_view::npos)
            return true;
    return false;
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
