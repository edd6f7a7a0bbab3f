#pragma once
// The weight storage of a quantized Hugging Face checkpoint, from its config.json's
// quantization_config (hf_config.cpp's reader; docs/model.md, "Quantized weights").
#include <nlohmann/json.hpp>
#include <string>

#include "kvshard/model/model_spec.h"

namespace kvshard {

// quantization_config `q` of config file `file` as vLLM loads it. Reads quant_method "fp8"
// (e4m3 weights and activations; block scales from weight_block_size, else one per tensor),
// "mxfp4" (the routed experts in MXFP4; vLLM leaves every linear layer unquantized under it) and
// "compressed-tensors" with one config group over every Linear layer (fp8 per channel or tensor,
// int4/int8 per group or channel, NVFP4).
// Any other method is recorded with sized = false (its weights are then sized only with an explicit
// --weight-dtype). Error for an fp8 format or block size it cannot size, and an fp8 checkpoint
// whose modules_to_not_convert / ignored_layers name a part beyond the embedding, LM head, norms
// and router (kvshard sizes whole parts, not single layers).
WeightStorage hf_weight_storage(const nlohmann::json& q, const std::string& file);

}  // namespace kvshard
