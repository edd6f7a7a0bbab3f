#include "kvshard/attention/merge.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvshard/common/error.h"

namespace kvshard {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
}

void merge_attention_into(float* acc_out, float* acc_lse, const float* part_out,
                          const float* part_lse, int64_t rows, int dim) {
    for (int64_t r = 0; r < rows; ++r) {
        const float a = acc_lse[r];
        const float b = part_lse[r];
        float* o = acc_out + r * dim;
        const float* p = part_out + r * dim;
        if (b == kNegInf) {
            if (a == kNegInf) std::fill(o, o + dim, 0.0f);
            continue;  // the part carries weight 0
        }
        if (a == kNegInf) {  // the accumulator carries weight 0: take the part as is
            std::copy(p, p + dim, o);
            acc_lse[r] = b;
            continue;
        }
        const float m = std::max(a, b);
        const float wa = std::exp(a - m);
        const float wb = std::exp(b - m);
        const float s = wa + wb;  // in [1, 2]: no overflow, no division by zero
        const float lse = m + std::log(s);
        const float ca = wa / s;
        const float cb = wb / s;
        for (int d = 0; d < dim; ++d) o[d] = ca * o[d] + cb * p[d];
        acc_lse[r] = lse;
    }
}

void merge_attention(std::span<const float* const> outs, std::span<const float* const> lses,
                     int64_t rows, int dim, float* out, float* lse) {
    KVSHARD_CHECK(outs.size() == lses.size(), "one lse array per partial output");
    const size_t n = outs.size();
    std::vector<float> w(n);
    for (int64_t r = 0; r < rows; ++r) {
        float m = kNegInf;
        for (size_t i = 0; i < n; ++i) m = std::max(m, lses[i][r]);
        float* o = out + r * dim;
        std::fill(o, o + dim, 0.0f);
        if (m == kNegInf) {  // no shard sees a key: weight 0 everywhere
            lse[r] = kNegInf;
            continue;
        }
        float s = 0.0f;
        for (size_t i = 0; i < n; ++i) {
            w[i] = std::exp(lses[i][r] - m);  // exp(-inf) = 0; w[i] in [0, 1], the max one is 1
            s += w[i];
        }
        // exp(lse_i - LSE) = w_i / s: dividing by s instead of subtracting the rounded LSE keeps
        // the weights exact to fp32 even when |m| is large (LSE's ulp grows with |m|).
        lse[r] = m + std::log(s);
        const float inv = 1.0f / s;
        for (size_t i = 0; i < n; ++i) {
            if (w[i] == 0.0f) continue;  // never read a weight-0 row (it may be NaN)
            const float wi = w[i] * inv;
            const float* p = outs[i] + r * dim;
            for (int d = 0; d < dim; ++d) o[d] += wi * p[d];
        }
    }
}

void apply_attention_sinks(float* out, float* lse, int64_t rows, int heads, int dim,
                           const float* sinks) {
    for (int64_t r = 0; r < rows; ++r)
        for (int h = 0; h < heads; ++h) {
            float& l = lse[r * heads + h];
            float* o = out + (r * heads + h) * int64_t{dim};
            const float s = sinks[h];
            if (l == kNegInf) {  // no key: the sink takes all the weight, the output is 0
                std::fill(o, o + dim, 0.0f);
                l = s;
                continue;
            }
            const float m = std::max(l, s);
            const float wl = std::exp(l - m), ws = std::exp(s - m);
            const float c = wl / (wl + ws);
            for (int d = 0; d < dim; ++d) o[d] *= c;
            l = m + std::log(wl + ws);
        }
}

}  // namespace kvshard
