#pragma once
// Flags shared by several subcommands.
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "kvshard/layout/parallel_config.h"
#include "kvshard/model/model_spec.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/hardware.h"

namespace kvshard::cli {

struct ModelFlags {
    std::string model;
    std::string kv_dtype;  // empty: the model's own
    bool all_full_attention = false;
};
// --model NAME|config.json|DIR and --kv-dtype.
void add_model_options(CLI::App* sub, ModelFlags& f, bool required = true);
ModelSpec load_model(const ModelFlags& f);

struct ParallelFlags {
    int tp = 1, pp = 1, cp = 1, dp = 1, ep = 1;
    std::string cp_scheme = "contiguous";
    int cp_interleave = 1;
    std::string pp_layers;  // "10,12,10"
};
// --tp --pp --cp (--sp) --dp --ep --cp-scheme --cp-interleave --pp-layers
void add_parallel_options(CLI::App* sub, ParallelFlags& f);
ParallelConfig to_parallel_config(const ParallelFlags& f);

struct HardwareFlags {
    std::string hardware = "h100-sxm";
    double mem_util = 0.9;
    double activation_reserve_gib = 2.0;
    int block_size = 16;
    const CLI::Option* block_size_option = nullptr;  // given: vLLM's raise is not applied
    int64_t max_num_batched_tokens = 8192;
    std::string mamba_cache_mode = "align";
    bool allow_long_context = false;
    CapacityOptions capacity_options() const;  // validated
};
// --hardware NAME|FILE.json, --mem-util, --activation-reserve-gib, --block-size,
// --max-num-batched-tokens, --mamba-cache-mode, --allow-long-context
void add_hardware_options(CLI::App* sub, HardwareFlags& f);
HardwareSpec load_hardware(const HardwareFlags& f);

// Prints JSON text to stdout followed by a newline.
void print_json(const std::string& json_text);

// Writes a rows x cols float32 matrix as a numpy .npy file (v1.0, little-endian, C order) for
// --dump-logits; Error naming the path when it cannot be written.
void write_npy(const std::string& path, const std::vector<float>& data, int64_t rows, int64_t cols);

}  // namespace kvshard::cli
