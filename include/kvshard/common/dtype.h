#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace kvshard {

// Element types for KV and weights. Sizes are what engines allocate per element.
enum class DType { kFp32, kBf16, kFp16, kFp8 };

std::size_t dtype_size(DType t);
std::string_view dtype_name(DType t);  // "fp32", "bf16", "fp16", "fp8"
// Accepts fp32|float32, bf16|bfloat16, fp16|float16|half, fp8|fp8_e4m3|fp8_e5m2; throws Error
// otherwise.
DType parse_dtype(std::string_view s);

}  // namespace kvshard
