#pragma once
// Arithmetic on sizes computed from user input (flags, config.json, traces): checked_* throws
// kvshard::Error naming what overflowed and the limit; sat_* saturates at INT64_MAX, for searches
// that only compare against a budget. docs/cli-inputs.md lists the ranges the inputs are held to.
#include <cstdint>
#include <limits>
#include <string_view>

#include "kvshard/common/error.h"

namespace kvshard {

inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
    int64_t out = 0;
    if (__builtin_mul_overflow(a, b, &out))
        throw Error(detail::concat(what, " overflows 64 bits (", a, " x ", b,
                                   "): the inputs are too large, the most is ",
                                   std::numeric_limits<int64_t>::max()));
    return out;
}

inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
    int64_t out = 0;
    if (__builtin_add_overflow(a, b, &out))
        throw Error(detail::concat(what, " overflows 64 bits (", a, " + ", b,
                                   "): the inputs are too large, the most is ",
                                   std::numeric_limits<int64_t>::max()));
    return out;
}

// v as an int, or an Error naming `what` and the int range.
inline int checked_narrow(int64_t v, std::string_view what) {
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
        throw Error(detail::concat(what, " is ", v, ", outside the range of a 32-bit integer [",
                                   std::numeric_limits<int>::min(), ", ",
                                   std::numeric_limits<int>::max(), "]"));
    return static_cast<int>(v);
}

inline int64_t sat_mul(int64_t a, int64_t b) {
    int64_t out = 0;
    return __builtin_mul_overflow(a, b, &out) ? std::numeric_limits<int64_t>::max() : out;
}

inline int64_t sat_add(int64_t a, int64_t b) {
    int64_t out = 0;
    return __builtin_add_overflow(a, b, &out) ? std::numeric_limits<int64_t>::max() : out;
}

// A double read from the user as a count or size: finite and in [lo, hi], else an Error naming it.
inline double require_finite_in(double v, double lo, double hi, std::string_view what) {
    if (!(v >= lo && v <= hi))  // also false for NaN
        throw Error(
            detail::concat(what, " must be a finite number in [", lo, ", ", hi, "], got ", v));
    return v;
}

}  // namespace kvshard
