#pragma once
// Checking a run against the unsharded model: the reference is generate() on one rank with every
// prompt token computed (no prefix cache) and a block size other than the run's, so that neither
// the run's paging nor its prefix cache is checked against itself.
#include <cstdint>
#include <string>
#include <vector>

#include "kvshard/model/weights.h"
#include "kvshard/serve/generate.h"

namespace kvshard {

// The bound on the relative L2 distance of the last-step logits that a sharded run must keep.
inline constexpr double kVerifyMaxRelativeL2 = 1e-4;

// The reference's options: max_new_tokens, block size 16 (32 when the run uses 16), no prefix
// cache.
GenerationOptions reference_options(int max_new_tokens, int run_block_size);

struct VerifyResult {
    // Over the compared prompts, of the last step's logits; +inf when a distance is not finite.
    double max_rel_err = 0;
    bool tokens_match = true;  // every compared prompt's greedy tokens equal the reference's
    // NaN or infinite logits, in the run and in the reference: any fails the check (a NaN would
    // otherwise vanish from a maximum and two NaN runs compare "identical").
    int64_t non_finite_logits = 0;
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
