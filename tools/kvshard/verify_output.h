#pragma once
// How `kvshard run` prints a VerifyResult (single group and disaggregated runs alike).
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>

#include "kvshard/common/dtype.h"
#include "kvshard/serve/verify.h"

namespace kvshard::cli {

// {"kv_dtype", "max_rel_err", "tokens_match", "non_finite_logits", "ok", "fp32_reference":
// null | {"max_rel_err", "tokens_match"}}: the check at the run's KV dtype, and beside it the
// quantization error against the unsharded run with fp32 KV.
inline nlohmann::json verify_json(const VerifyResult& v) {
    return {{"kv_dtype", std::string(dtype_name(v.kv_dtype))},
            {"max_rel_err", v.max_rel_err},
            {"tokens_match", v.tokens_match && v.non_finite_logits == 0},
            {"non_finite_logits", v.non_finite_logits},
            {"ok", v.ok()},
            {"fp32_reference", v.has_fp32_reference
                                   ? nlohmann::json{{"max_rel_err", v.fp32_max_rel_err},
                                                    {"tokens_match", v.fp32_tokens_match}}
                                   : nlohmann::json(nullptr)}};
}

inline void print_verify(const VerifyResult& v) {
    fmt::print(
        "verify: max relative L2 error of the last-step logits {:.3g} (limit 1e-4) against the "
        "unsharded run with {} KV, greedy tokens {}{}\n",
        v.max_rel_err, dtype_name(v.kv_dtype), v.tokens_match ? "identical" : "DIFFER",
        v.non_finite_logits > 0
            ? fmt::format(", {} NaN or infinite logits: FAILED", v.non_finite_logits)
            : "");
    if (v.has_fp32_reference)
        fmt::print(
            "quantization: {} KV against the unsharded run with fp32 KV: max relative L2 error "
            "{:.3g}, greedy tokens {} (reported, not checked)\n",
            dtype_name(v.kv_dtype), v.fp32_max_rel_err,
            v.fp32_tokens_match ? "identical" : "differ");
}

}  // namespace kvshard::cli
