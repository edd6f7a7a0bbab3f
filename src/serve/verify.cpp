#include "kvshard/serve/verify.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvshard/common/error.h"

namespace kvshard {

GenerationOptions reference_options(int max_new_tokens, int run_block_size, DType kv_dtype) {
    GenerationOptions o;
    o.max_new_tokens = max_new_tokens;
    // fp8's scales group a block's tokens: another block size would quantize other values.
    o.block_size = kv_dtype == DType::kFp8 ? run_block_size : run_block_size == 16 ? 32 : 16;
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
    const GenerationReport ref =
        generate(m, ParallelConfig{}, weights, prompts,
                 reference_options(max_new_tokens, run_block_size, m.kv_dtype));
    VerifyResult v;
    v.kv_dtype = m.kv_dtype;
    auto max_err = [](double acc, double err) {
        return std::isfinite(err) ? std::max(acc, err) : std::numeric_limits<double>::infinity();
    };
    for (size_t i = 0; i < prompts.size(); ++i) {
        if (!skip.empty() && !skip[i].empty()) continue;
        v.max_rel_err = max_err(v.max_rel_err, relative_l2(last_logits[i], ref.last_logits[i]));
        for (const auto* logits : {&last_logits[i], &ref.last_logits[i]})
            v.non_finite_logits += std::count_if(logits->begin(), logits->end(),
                                                 [](float x) { return !std::isfinite(x); });
        v.tokens_match = v.tokens_match && tokens[i] == ref.tokens[i];
    }
    if (m.kv_dtype != DType::kFp32) {
        ModelSpec m32 = m;
        m32.kv_dtype = DType::kFp32;
        const GenerationReport ref32 = generate(m32, ParallelConfig{}, weights, prompts,
                                                reference_options(max_new_tokens, run_block_size));
        v.has_fp32_reference = true;
        for (size_t i = 0; i < prompts.size(); ++i) {
            if (!skip.empty() && !skip[i].empty()) continue;
            v.fp32_max_rel_err =
                max_err(v.fp32_max_rel_err, relative_l2(last_logits[i], ref32.last_logits[i]));
            v.fp32_tokens_match = v.fp32_tokens_match && tokens[i] == ref32.tokens[i];
        }
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
