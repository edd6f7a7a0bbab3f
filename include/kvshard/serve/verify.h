#pragma once
// Checking a run against the unsharded model: the reference is generate() on one rank with every
// prompt token computed (no prefix cache) and a block size other than the run's, so that neither
// the run's paging nor its prefix cache is checked against itself. The reference stores the run's
// KV dtype (sharded equals unsharded at the same dtype); fp8 keeps the run's block size, since its
// scales are per block (docs/cache.md, "Element types"). A run whose KV is not fp32 is also
// compared with the unsharded fp32-KV run: its quantization error, reported, not checked.
#include <cstdint>
#include <string>
#include <vector>

#include "kvshard/model/weights.h"
#include "kvshard/serve/generate.h"

namespace kvshard {

// The bound on the relative L2 distance of the last-step logits that a sharded run must keep.
inline constexpr double kVerifyMaxRelativeL2 = 1e-4;

// The reference's options: max_new_tokens, block size 16 (32 when the run uses 16; fp8 KV: the
// run's), no prefix cache.
GenerationOptions reference_options(int max_new_tokens, int run_block_size,
                                    DType kv_dtype = DType::kFp32);

struct VerifyResult {
    // Over the compared prompts, of the last step's logits; +inf when a distance is not finite.
    double max_rel_err = 0;
    bool tokens_match = true;  // every compared prompt's greedy tokens equal the reference's
    // NaN or infinite logits, in the run and in the reference: any fails the check (a NaN would
    // otherwise vanish from a maximum and two NaN runs compare "identical").
    int64_t non_finite_logits = 0;
    // The KV dtype of the run and the reference.
    DType kv_dtype = DType::kFp32;
    // KV dtype other than fp32: the run against the unsharded run with fp32 KV (the quantization
    // error), over the same prompts; not part of ok().
    bool has_fp32_reference = false;
    double fp32_max_rel_err = 0;
    bool fp32_tokens_match = true;
    bool ok() const {
        return tokens_match && non_finite_logits == 0 && max_rel_err <= kVerifyMaxRelativeL2;
    }
};

// Runs the reference on this thread (one rank) and compares it with a run of max_new_tokens per
// prompt at block size run_block_size: its per-prompt tokens and last-step logits. Prompts with a
// non-empty entry in `skip` (e.g. a failed request's error) are not compared; `skip` may be empty.
VerifyResult verify_against_reference(const ModelSpec& m, const TensorSource& weights,
                                      const std::vector<std::vector<int32_t>>& prompts,
                                      int max_new_tokens, int run_block_size,
                                      const std::vector<std::vector<int32_t>>& tokens,
                                      const std::vector<std::vector<float>>& last_logits,
                                      const std::vector<std::string>& skip = {});

// The relative L2 distance ||a - b|| / ||b|| (0 when both are zero).
double relative_l2(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace kvshard
