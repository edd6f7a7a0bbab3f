#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/model/model_spec.h"

namespace kvshard {

// Built-in models: the published configs of ../shared/reference/models.md plus small test models
// ("tiny", "tiny-moe", "tiny-mla", "small-100m").
std::vector<std::string> catalog_names();
bool in_catalog(std::string_view name);
ModelSpec catalog_model(std::string_view name);  // throws Error listing the known names

// Loads a model from a Hugging Face config.json (the architectures of docs/model.md section 0).
// Throws Error naming the file and the missing or bad field. KV and weight dtype are torch_dtype's
// as vLLM's --dtype auto serves it: a float32 (or unnamed) checkpoint is read as bf16.
// A tokenizer_config.json beside the config.json bounds max_model_len by its model_max_length, as
// vLLM's _get_and_verify_max_len takes it into account.
ModelSpec load_hf_config(const std::string& path);
// tokenizer_max_length: a tokenizer_config.json's model_max_length (0: none).
ModelSpec parse_hf_config(std::string_view json_text, const std::string& name_for_errors,
                          double tokenizer_max_length = 0);

// NAME from the catalog, a path to a config.json, or a directory that holds one.
ModelSpec resolve_model(const std::string& name_or_path);

}  // namespace kvshard
