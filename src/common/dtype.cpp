#include "kvshard/common/dtype.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>

#include "kvshard/common/error.h"

namespace kvshard {

std::size_t dtype_size(DType t) {
    switch (t) {
        case DType::kFp32:
            return 4;
        case DType::kBf16:
            return 2;
        case DType::kFp16:
            return 2;
        case DType::kFp8:
            return 1;
    }
    KVSHARD_CHECK(false, "unknown dtype");
    return 0;
}

std::string_view dtype_name(DType t) {
    switch (t) {
        case DType::kFp32:
            return "fp32";
        case DType::kBf16:
            return "bf16";
        case DType::kFp16:
            return "fp16";
        case DType::kFp8:
            return "fp8";
    }
    return "?";
}

DType parse_dtype(std::string_view s) {
    if (s == "fp32" || s == "float32" || s == "float") return DType::kFp32;
    if (s == "bf16" || s == "bfloat16") return DType::kBf16;
    if (s == "fp16" || s == "float16" || s == "half") return DType::kFp16;
    if (s == "fp8" || s == "fp8_e4m3" || s == "fp8_e5m2" || s == "float8_e4m3fn")
        return DType::kFp8;
    throw Error(detail::concat("unknown element type '", s, "': expected fp32, bf16, fp16 or fp8"));
}

}  // namespace kvshard

namespace kvshard {
namespace {

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }
float float_of(uint32_t u) { return std::bit_cast<float>(u); }

// The 256 values of e4m3, built once from the format's definition.
std::array<float, 256> make_fp8_table() {
    std::array<float, 256> t{};
    for (int q = 0; q < 256; ++q) {
        const int e = (q >> 3) & 0xf, m = q & 7;
        float v;
        if (e == 0xf && m == 7)
            v = std::numeric_limits<float>::quiet_NaN();
        else if (e == 0)
            v = std::ldexp(static_cast<float>(m), -9);  // subnormal: m * 2^-9
        else
            v = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
        t[static_cast<size_t>(q)] = (q & 0x80) ? -v : v;
    }
    return t;
}

const std::array<float, 256> kFp8Table = make_fp8_table();

}  // namespace

uint16_t float_to_bf16(float x) {
    const uint32_t u = bits_of(x);
    if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x0040);  // quiet, sign kept
    // Round to nearest even on the 16 bits dropped; a carry into the exponent is the right answer
    // (up to +-inf).
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float bf16_to_float(uint16_t b) { return float_of(uint32_t{b} << 16); }

uint16_t float_to_fp16(float x) {
    const uint32_t u = bits_of(x);
    const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (a < 0x38800000u) {
        // Below fp16's smallest normal 2^-14: a multiple of 2^-24. |x| * 2^24 rounded to nearest
        // even (the default rounding mode) is the subnormal's mantissa; 1024 is the smallest
        // normal, whose bits follow on.
        const float m = std::nearbyint(float_of(a) * 0x1p24f);
        return static_cast<uint16_t>(sign | static_cast<uint16_t>(m));
    }
    // Normal: rebias the exponent (127 -> 15), round the 13 dropped bits to nearest even.
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
}

float fp16_to_float(uint16_t h) {
    const uint32_t sign = uint32_t{h & 0x8000u} << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = static_cast<float>(m) * 0x1p-24f;  // exact
        return sign ? -v : v;
    }
    if (e == 0x1f) return float_of(sign | 0x7f800000u | (m << 13));
    return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

uint8_t float_to_fp8_e4m3(float x) {
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    if (std::isnan(x)) return static_cast<uint8_t>(sign | 0x7f);
    const float a = std::fabs(x);
    if (a >= kFp8E4m3Max) return static_cast<uint8_t>(sign | 0x7e);  // saturate (also inf)
    if (a < 0x1p-6f) {
        // Subnormal range: a multiple of 2^-9 (rounding up to 8 gives the smallest normal, 0x08).
        return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(a * 0x1p9f)));
    }
    int e = 0;
    const float f = std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): unbiased exponent e - 1
    // 3 mantissa bits: (2f - 1) * 8 rounded to nearest even, exact scaling; a carry to 8 moves
    // into the exponent through the addition below.
    const int m = static_cast<int>(std::nearbyint((2.0f * f - 1.0f) * 8.0f));
    const int code = ((e - 1 + 7) << 3) + m;
    // a < 448 keeps code <= 0x7e; the bound states that 0x7f (NaN) is never produced here.
    return static_cast<uint8_t>(sign | std::min(code, 0x7e));
}

float fp8_e4m3_to_float(uint8_t q) { return kFp8Table[q]; }

}  // namespace kvshard
