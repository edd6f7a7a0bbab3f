#include "kvshard/serve/verify.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvshard/common/error.h"

namespace kvshard {

GenerationOptions reference_options(int max_new_tokens, int run_block_size) {
    GenerationOptions o;
    o.max_new_tokens = max_new_tokens;
    o.block_size = run_block_size == 16 ? 32 : 16;
    o.prefix_cache = false;
    return o;
}

VerifyResult verify_against_reference(const ModelSpec& m, const TensorSource& weights,
                                      const std::vector<std::vector<int32_t>>& prompts,
                                      int max_new_tokens, int run_block_size,
                                      const std::vector<std::vector<int32_t>>& tokens,
                                      const std::vector<std::vector<float>>& last_logits,
                                      const std::vector<std::string>& skip) {
    KVSHARD_CHECK(tokens.size() == prompts.size() && last_logits.size() == prompts.size(),
                  "a run of ", prompts.size(), " prompts reports ", tokens.size(), " and ",
                  last_logits.size(), " results");
    KVSHARD_CHECK(skip.empty() || skip.size() == prompts.size(), "skip holds ", skip.size(),
                  " entries for ", prompts.size(), " prompts");
    const GenerationReport ref = generate(m, ParallelConfig{}, weights, prompts,
                                          reference_options(max_new_tokens, run_block_size));
    VerifyResult v;
    for (size_t i = 0; i < prompts.size(); ++i) {
        if (!skip.empty() && !skip[i].empty()) continue;
        const double err = relative_l2(last_logits[i], ref.last_logits[i]);
        v.max_rel_err = std::isfinite(err) ? std::max(v.max_rel_err, err)
                                           : std::numeric_limits<double>::infinity();
        for (const auto* logits : {&last_logits[i], &ref.last_logits[i]})
            v.non_finite_logits += std::count_if(logits->begin(), logits->end(),
                                                 [](float x) { return !std::isfinite(x); });
        v.tokens_match = v.tokens_match && tokens[i] == ref.tokens[i];
    }
    return v;
}

double relative_l2(const std::vector<float>& a, const std::vector<float>& b) {
    KVSHARD_CHECK(a.size() == b.size(), "relative_l2 of vectors of ", a.size(), " and ", b.size(),
                  " elements");
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(b[i]) * b[i];
    }
    if (den == 0) return num == 0 ? 0.0 : std::sqrt(num);
    return std::sqrt(num / den);
}

}  // namespace kvshard
