#pragma once
// What a run is given besides its layout: its prompts, where its weights come from, and whether its
// KV fits in this machine's memory.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvshard/model/model_spec.h"
#include "kvshard/model/weights.h"

namespace kvshard {

// Deterministic prompts: `count` prompts of `length` tokens whose first `shared_prefix` tokens are
// the same in all (prefix-cache hits), drawn from an LCG seeded by `seed`; or, when token_ids is
// non-empty, `count` copies of token_ids.
struct PromptSpec {
    int count = 1;
    int length = 32;
    int shared_prefix = 0;
    uint64_t seed = 1;
    std::vector<int32_t> token_ids;
};
// Error (naming the `kvshard run` flag) when a field is out of range or an id is outside [0,
// vocab).
std::vector<std::vector<int32_t>> make_prompts(const PromptSpec& spec, int vocab);

// The weights of a run: a directory with *.safetensors files is a checkpoint; anything else (a
// catalog name, a config.json) gets random weights from `seed`.
struct WeightChoice {
    std::unique_ptr<TensorSource> source;
    std::string description;  // "safetensors" or "seed N"
};
WeightChoice choose_weights(const std::string& model_arg, uint64_t seed);

// A run keeps every prompt's KV (prompt + generated tokens) in fp32 pools on this machine, at least
// once (the unsharded reference alone). Error, naming the flags to lower, when that is more than
// the machine's physical memory.
void check_kv_fits(const ModelSpec& m, const std::vector<std::vector<int32_t>>& prompts, int gen);

}  // namespace kvshard
