// Element conversions (common/dtype.h), exhaustively: every bf16 / fp16 pattern and every fp8 e4m3
// code, and float inputs between neighbouring codes against a brute-force nearest-value search.
#include "kvshard/common/dtype.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace kvshard {
namespace {

// The fp8 code of x's sign nearest to x among the finite `values` (ties: the one with the even
// code), the definition of round-to-nearest-even written out.
uint8_t nearest(const std::vector<std::pair<double, uint8_t>>& values, double x) {
    uint8_t best = 0;
    double bd = std::numeric_limits<double>::infinity();
    for (const auto& [v, c] : values) {
        if (((c & 0x80) != 0) != std::signbit(x)) continue;
        const double d = std::fabs(v - x);
        if (d < bd || (d == bd && (c & 1) == 0 && (best & 1) == 1)) {
            bd = d;
            best = c;
        }
    }
    return best;
}

TEST(Dtype, Bf16EveryPatternRoundTripsThroughFloat) {
    for (uint32_t b = 0; b < 65536; ++b) {
        const float f = bf16_to_float(static_cast<uint16_t>(b));
        EXPECT_EQ(std::bit_cast<uint32_t>(f), b << 16) << b;
        if (std::isnan(f)) {
            EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f)))) << b;
            EXPECT_EQ(float_to_bf16(f) & 0x8000, b & 0x8000) << "NaN keeps its sign " << b;
        } else {
            EXPECT_EQ(float_to_bf16(f), b) << b;
        }
    }
}

TEST(Dtype, Fp16EveryPatternRoundTripsThroughFloat) {
    int nans = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
        const float f = fp16_to_float(static_cast<uint16_t>(h));
        const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
        if (e == 0x1f && m != 0) {
            ++nans;
            EXPECT_TRUE(std::isnan(f)) << h;
            EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(f)))) << h;
            EXPECT_EQ(float_to_fp16(f) & 0x8000, h & 0x8000) << h;
            continue;
        }
        // The value from the format's definition.
        const double expect =
            (h & 0x8000 ? -1.0 : 1.0) * (e == 0      ? std::ldexp(double(m), -24)
                                         : e == 0x1f ? std::numeric_limits<double>::infinity()
                                                     : std::ldexp(1.0 + m / 1024.0, int(e) - 15));
        EXPECT_EQ(double(f), expect) << h;
        EXPECT_EQ(float_to_fp16(f), h) << h;
    }
    EXPECT_EQ(nans, 2 * 1023);
}

// Midpoints between neighbouring finite values round to the even code, and points just beside a
// midpoint to the nearer value: over every pair of neighbours (bf16, fp16).
template <typename ToNarrow, typename ToFloat>
void check_midpoints(ToNarrow to_narrow, ToFloat to_float, uint16_t max_finite) {
    for (uint32_t c = 0; c < max_finite; ++c) {
        for (const uint32_t sign : {0u, 0x8000u}) {
            const auto lo = static_cast<uint16_t>(sign | c),
                       hi = static_cast<uint16_t>(sign | (c + 1));
            const double a = to_float(lo), b = to_float(hi);
            const double mid = (a + b) / 2;  // exact in double
            const auto mid_f = static_cast<float>(mid);
            if (double(mid_f) != mid)
                continue;  // not a float (fp32 holds every bf16/fp16 midpoint)
            EXPECT_EQ(to_narrow(mid_f), (c & 1) == 0 ? lo : hi) << c;
            EXPECT_EQ(to_narrow(std::nextafter(mid_f, float(a))), lo) << c;
            EXPECT_EQ(to_narrow(std::nextafter(mid_f, float(b))), hi) << c;
        }
    }
}

TEST(Dtype, Bf16RoundsToNearestEven) {
    check_midpoints(float_to_bf16, bf16_to_float, 0x7f7f);
    // Beyond the largest finite bf16, half way to the next binade and up: +-inf.
    EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
    EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
}

TEST(Dtype, Fp16RoundsToNearestEvenAndOverflowsToInf) {
    check_midpoints(float_to_fp16, fp16_to_float, 0x7bff);
    EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);
    EXPECT_EQ(float_to_fp16(65519.996f), 0x7bff);
    EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);  // the tie goes to even: inf
    EXPECT_EQ(float_to_fp16(-1e30f), 0xfc00);
    EXPECT_EQ(float_to_fp16(0x1p-25f), 0x0000);  // half the smallest subnormal: even (0)
    EXPECT_EQ(float_to_fp16(std::nextafter(0x1p-25f, 1.f)), 0x0001);
    EXPECT_EQ(float_to_fp16(-0.0f), 0x8000);
}

TEST(Dtype, Fp8E4m3EveryCode) {
    std::vector<std::pair<double, uint8_t>> finite;
    int nans = 0;
    for (int q = 0; q < 256; ++q) {
        const auto c = static_cast<uint8_t>(q);
        const float f = fp8_e4m3_to_float(c);
        const int e = (q >> 3) & 0xf, m = q & 7;
        if (e == 0xf && m == 7) {
            ++nans;
            EXPECT_TRUE(std::isnan(f)) << q;
            EXPECT_EQ(float_to_fp8_e4m3(f), (q & 0x80) | 0x7f) << q;
            continue;
        }
        const double expect = (q & 0x80 ? -1.0 : 1.0) *
                              (e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1 + m / 8.0, e - 7));
        EXPECT_EQ(double(f), expect) << q;
        EXPECT_EQ(float_to_fp8_e4m3(f), c) << q;
        finite.emplace_back(expect, c);
    }
    EXPECT_EQ(nans, 2);
    EXPECT_EQ(fp8_e4m3_to_float(0x7e), kFp8E4m3Max);
    EXPECT_EQ(fp8_e4m3_to_float(0x01), 0x1p-9f);
    // Saturation: beyond 448 (and inf) gives +-448, never NaN.
    EXPECT_EQ(float_to_fp8_e4m3(449.0f), 0x7e);
    EXPECT_EQ(float_to_fp8_e4m3(1e9f), 0x7e);
    EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
    EXPECT_EQ(float_to_fp8_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
    EXPECT_EQ(float_to_fp8_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0xff);
    // Every midpoint between neighbouring codes, and the floats just beside it, against the
    // brute-force nearest-even search.
    for (const auto& [v, c] : finite) {
        for (const auto& [w, d] : finite) {
            if (d != c + 1 || (c & 0x80) != (d & 0x80)) continue;
            const auto mid = static_cast<float>((v + w) / 2);
            for (const float x : {mid, std::nextafter(mid, -1e9f), std::nextafter(mid, 1e9f)})
                EXPECT_EQ(float_to_fp8_e4m3(x), nearest(finite, x)) << x;
        }
    }
    // Random floats over the whole range (and below it) against the same search.
    std::mt19937 rng(7);
    std::uniform_real_distribution<double> log2mag(-14, 9);
    for (int i = 0; i < 20000; ++i) {
        const float x = float((i & 1 ? -1 : 1) * std::exp2(log2mag(rng)));
        const uint8_t want =
            std::fabs(x) > kFp8E4m3Max ? (x < 0 ? 0xfe : 0x7e) : nearest(finite, x);
        ASSERT_EQ(float_to_fp8_e4m3(x), want) << x;
    }
}

}  // namespace
}  // namespace kvshard
