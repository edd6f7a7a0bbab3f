#pragma once
#include <cstddef>
#include <cstdint>
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

// ---- element conversions (docs/cache.md, "Element types") ----
// Written here: Debian ships no C++ library for them (GCC 12 has no std::bfloat16_t, and no
// library has OCP fp8 e4m3 outside the GPU toolkits).
//
// bf16 (1-8-7) and IEEE fp16 (1-5-10): float -> narrow rounds to nearest, ties to even; overflow
// goes to +-inf as IEEE does; a NaN stays a (quiet) NaN with its sign. narrow -> float is exact.
uint16_t float_to_bf16(float x);
float bf16_to_float(uint16_t b);
uint16_t float_to_fp16(float x);
float fp16_to_float(uint16_t h);

// fp8 e4m3 as OCP's E4M3FN (NVIDIA's __nv_fp8_e4m3): 1 sign, 4 exponent (bias 7), 3 mantissa bits,
// no infinities, NaN = S.1111.111 (0x7f, 0xff), largest finite 448 (0x7e), smallest subnormal
// 2^-9. float -> fp8 rounds to nearest, ties to even, and saturates: |x| > 448 (also +-inf)
// gives +-448. NaN gives 0x7f with x's sign.
inline constexpr float kFp8E4m3Max = 448.0f;
uint8_t float_to_fp8_e4m3(float x);
float fp8_e4m3_to_float(uint8_t q);

}  // namespace kvshard
