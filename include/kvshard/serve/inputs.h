#pragma once
// What a run is given besides its layout: its prompts, where its weights come from, and whether its
// KV fits in this machine's memory.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvshard/layout/parallel_config.h"
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
    std::vector<int32_t> token_ids{};
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

// What a run will hold in memory, estimated before it allocates anything (docs/cli-inputs.md,
// "Memory"): the fp32 weights of every rank this process runs (weight_shard_bytes), their KV pools
// (as many blocks as the runner allocates: blocks_for over each DP replica's prompts plus --gen,
// at the layout's fp32 bytes per token), per-rank forward buffers (the prefill batch's activations
// and logits), the prompts, and with --verify the unsharded reference run, which runs after the
// sharded one (so the peak is the larger of the two, plus the prompts). Sizes in bytes, as doubles:
// an absurd request stays a large number rather than an overflow.
struct RunMemoryEstimate {
    double weights = 0, kv = 0, buffers = 0, prompts = 0;
    double reference = 0;  // the unsharded --verify run: weights + KV + buffers
    int ranks = 0;         // ranks counted in this process
    double sharded() const { return weights + kv + buffers; }
    double peak() const { return (sharded() > reference ? sharded() : reference) + prompts; }
    // "weights 1.20 GiB, KV 3.00 GiB, buffers 12.0 MiB, prompts 4.0 KiB over 2 rank(s)[; the
    // unsharded --verify run 4.10 GiB]"
    std::string breakdown() const;
};

// One group of ranks of a run: a single-group run has one, a disaggregated run two (prefill,
// decode).
struct RunGroup {
    ParallelConfig parallel;
    int block_size = 16;
};

struct RunShape {
    int64_t prompts = 1;
    int64_t prompt_len = 32;
    int64_t gen = 16;
    bool verify = false;
    // Ranks of the job on this host when each process runs one rank (MPI: mpirun's local size);
    // 0: this process runs every rank (threads).
    int local_ranks = 0;
};

// Error when a group's layout does not fit the model (make_layout's message).
RunMemoryEstimate estimate_run_memory(const ModelSpec& m, const std::vector<RunGroup>& groups,
                                      const RunShape& shape);

// This machine's available memory (MemAvailable of /proc/meminfo; the physical memory where that
// cannot be read), in GiB.
double available_memory_gib();

// Error, with the estimate and what to lower, when e.peak() is more than max_gib GiB (`given`:
// the user's --max-memory-gib, else the machine's available memory). `max_gib` must be finite and
// positive.
void check_run_memory(const RunMemoryEstimate& e, double max_gib, bool given = true);

}  // namespace kvshard
