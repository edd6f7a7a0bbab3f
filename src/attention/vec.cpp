#include "attention/vec.h"

#include "kvshard/common/error.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvshard::vec {
namespace {

// ---- portable ----
float dot_generic(const float* a, const float* b, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}
void axpy_generic(float* y, float a, const float* x, int n) {
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
}
void scale_generic(float* y, float a, int n) {
    for (int i = 0; i < n; ++i) y[i] *= a;
}
float max_generic(const float* x, int n) {
    float m = x[0];
    for (int i = 1; i < n; ++i) m = std::max(m, x[i]);
    return m;
}
float exp_sub_sum_generic(float* x, int n, float m) {
    float s = 0;
    for (int i = 0; i < n; ++i) {
        x[i] = std::exp(x[i] - m);
        s += x[i];
    }
    return s;
}

void attend_keys_generic(const float* q, int rows, int64_t q_stride, const float* k, const float* v,
                         int nv, int64_t kv_stride, int d, float scale, float* m, float* l,
                         float* o, Ops::Prefetch /*pf*/) {
    KVSHARD_CHECK(nv >= 1 && nv <= kStepKeys, "attend_keys takes 1 to ", kStepKeys, " keys, got ",
                  nv);
    float s[kStepKeys];
    for (int r = 0; r < rows; ++r) {
        const float* qr = q + r * q_stride;
        for (int j = 0; j < nv; ++j) s[j] = dot_generic(qr, k + j * kv_stride, d) * scale;
        const float mnew = std::max(m[r], max_generic(s, nv));
        float* orow = o + int64_t{r} * d;
        if (mnew != m[r]) {
            const float corr = std::exp(m[r] - mnew);
            l[r] *= corr;
            scale_generic(orow, corr, d);
            m[r] = mnew;
        }
        l[r] += exp_sub_sum_generic(s, nv, mnew);
        for (int j = 0; j < nv; ++j) axpy_generic(orow, s[j], v + j * kv_stride, d);
    }
}

#if defined(__x86_64__)
#define KVSHARD_AVX2 __attribute__((target("avx2,fma")))

KVSHARD_AVX2 inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

KVSHARD_AVX2 float dot_avx2(const float* a, const float* b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

KVSHARD_AVX2 void axpy_avx2(float* y, float a, const float* x, int n) {
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
}

KVSHARD_AVX2 void scale_avx2(float* y, float a, int n) {
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] *= a;
}

KVSHARD_AVX2 float max_avx2(const float* x, int n) {
    int i = 0;
    float m = x[0];
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
        __m128 lo = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
        lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
        m = _mm_cvtss_f32(lo);
    }
    for (; i < n; ++i) m = std::max(m, x[i]);
    return m;
}

// exp(x) for x <= 0 (Cephes polynomial, relative error ~2e-7); arguments below -87 give ~0.
KVSHARD_AVX2 inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    const __m256 xx = _mm256_mul_ps(x, x);
    y = _mm256_fmadd_ps(y, xx, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_cvttps_epi32(fx);
    n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

KVSHARD_AVX2 float exp_sub_sum_avx2(float* x, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        s = _mm256_add_ps(s, e);
    }
    float sum = hsum(s);
    if (i < n) {
        float tail[8];
        const int r = n - i;
        for (int k = 0; k < 8; ++k) tail[k] = k < r ? x[i + k] - m : -100.0f;
        const __m256 e = exp256(_mm256_loadu_ps(tail));
        _mm256_storeu_ps(tail, e);
        for (int k = 0; k < r; ++k) {
            x[i + k] = tail[k];
            sum += tail[k];
        }
    }
    return sum;
}

// Sums of 8 vectors: lane j of the result is the horizontal sum of a[j].
KVSHARD_AVX2 inline __m256 hsum8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Issues a prefetch request list a little at a time: `per_step` lines from each stream per step().
struct Spread {
    const char* a;
    const char* b;
    int left, per_step;
    void step() {
        for (int i = 0; i < per_step && left > 0; ++i, --left, a += 64, b += 64) {
            __builtin_prefetch(a, 0, 2);
            if (b) __builtin_prefetch(b, 0, 2);
        }
    }
};

// o[r] += sum_j p[r][j] v_j for NR rows (p rows kStepKeys apart), 4 vectors of o at a time (d % 32
// == 0), or one at a time otherwise.
template <int NR, int ND>
KVSHARD_AVX2 void accumulate_v(const float* p, const float* v, int nv, int64_t kv_stride, int d_rt,
                               float* o, Spread& pf) {
    const int d = ND > 0 ? 8 * ND : d_rt;
    const int nd = d / 8;
    const int step = nd % 4 == 0 ? 4 : 1;
    for (int x0 = 0; x0 < nd; x0 += step) {
        if (step == 4) {
            __m256 acc[NR][4];
            for (int r = 0; r < NR; ++r)
                for (int t = 0; t < 4; ++t)
                    acc[r][t] = _mm256_loadu_ps(o + int64_t{r} * d + 8 * (x0 + t));
            for (int j = 0; j < nv; ++j) {
                pf.step();
                const float* vj = v + j * kv_stride + 8 * x0;
                __m256 pj[NR];
                for (int r = 0; r < NR; ++r) pj[r] = _mm256_broadcast_ss(p + r * kStepKeys + j);
                for (int t = 0; t < 4; ++t) {
                    const __m256 vt = _mm256_loadu_ps(vj + 8 * t);
                    for (int r = 0; r < NR; ++r) acc[r][t] = _mm256_fmadd_ps(pj[r], vt, acc[r][t]);
                }
            }
            for (int r = 0; r < NR; ++r)
                for (int t = 0; t < 4; ++t)
                    _mm256_storeu_ps(o + int64_t{r} * d + 8 * (x0 + t), acc[r][t]);
        } else {
            __m256 acc[NR];
            for (int r = 0; r < NR; ++r) acc[r] = _mm256_loadu_ps(o + int64_t{r} * d + 8 * x0);
            for (int j = 0; j < nv; ++j) {
                pf.step();
                const __m256 vt = _mm256_loadu_ps(v + j * kv_stride + 8 * x0);
                for (int r = 0; r < NR; ++r)
                    acc[r] =
                        _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * kStepKeys + j), vt, acc[r]);
            }
            for (int r = 0; r < NR; ++r) _mm256_storeu_ps(o + int64_t{r} * d + 8 * x0, acc[r]);
        }
    }
}

constexpr int kMaxRows = 16;

// The AVX2 step for d = 8 * ND (ND > 0: unrolled for that head size; 0: any multiple of 8).
template <int ND>
KVSHARD_AVX2 void attend_keys_avx2_d(const float* q, int rows, int64_t q_stride, const float* k,
                                     const float* v, int nv, int64_t kv_stride, int d_rt,
                                     float scale, float* m, float* l, float* o, Ops::Prefetch pfr) {
    const int d = ND > 0 ? 8 * ND : d_rt;
    // V-loop steps: one per key per 4-vector (or 1-vector) column pass per row group.
    const int passes = (d / 8) % 4 == 0 ? d / 32 : d / 8;
    const int groups = rows / 3 + (rows % 3) / 2 + (rows % 3) % 2;
    const int steps = std::max(1, passes * nv * groups + rows * (nv / 8) * (d / 8));
    Spread pf{static_cast<const char*>(pfr.a), static_cast<const char*>(pfr.b),
              pfr.a ? pfr.lines : 0, (pfr.lines + steps - 1) / steps};
    alignas(32) float s[kMaxRows][kStepKeys];
    const int nd = d / 8;
    const __m256 vscale = _mm256_set1_ps(scale);
    // Scores, 8 keys at a time: 8 independent accumulators, one transpose-sum.
    for (int r = 0; r < rows; ++r) {
        const float* qr = q + r * q_stride;
        int j = 0;
        for (; j + 8 <= nv; j += 8) {
            __m256 acc[8];
            for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
            for (int x = 0; x < nd; ++x) {
                pf.step();
                const __m256 qx = _mm256_loadu_ps(qr + 8 * x);
                for (int t = 0; t < 8; ++t)
                    acc[t] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + (j + t) * kv_stride + 8 * x),
                                             acc[t]);
            }
            _mm256_store_ps(&s[r][j], _mm256_mul_ps(hsum8(acc), vscale));
        }
        for (; j < nv; ++j) s[r][j] = dot_avx2(qr, k + j * kv_stride, d) * scale;
    }
    for (int r = 0; r < rows; ++r) {
        const float mnew = std::max(m[r], max_avx2(s[r], nv));
        if (mnew != m[r]) {
            const float corr = std::exp(m[r] - mnew);
            l[r] *= corr;
            scale_avx2(o + int64_t{r} * d, corr, d);
            m[r] = mnew;
        }
        l[r] += exp_sub_sum_avx2(s[r], nv, mnew);
    }
    // o_r += sum_j p_rj v_j: NR rows x 4 vectors of o in registers, each v load used by every row.
    int r0 = 0;
    {
        for (; r0 + 3 <= rows; r0 += 3)
            accumulate_v<3, ND>(&s[r0][0], v, nv, kv_stride, d, o + int64_t{r0} * d, pf);
        for (; r0 + 2 <= rows; r0 += 2)
            accumulate_v<2, ND>(&s[r0][0], v, nv, kv_stride, d, o + int64_t{r0} * d, pf);
    }
    for (; r0 < rows; ++r0)
        accumulate_v<1, ND>(&s[r0][0], v, nv, kv_stride, d, o + int64_t{r0} * d, pf);
}
KVSHARD_AVX2 void attend_keys_avx2(const float* q, int rows, int64_t q_stride, const float* k,
                                   const float* v, int nv, int64_t kv_stride, int d, float scale,
                                   float* m, float* l, float* o, Ops::Prefetch pf) {
    KVSHARD_CHECK(nv >= 1 && nv <= kStepKeys, "attend_keys takes 1 to ", kStepKeys, " keys, got ",
                  nv);
    if (d % 8 != 0 || rows > kMaxRows)
        attend_keys_generic(q, rows, q_stride, k, v, nv, kv_stride, d, scale, m, l, o, pf);
    else if (d == 64)
        attend_keys_avx2_d<8>(q, rows, q_stride, k, v, nv, kv_stride, d, scale, m, l, o, pf);
    else if (d == 128)
        attend_keys_avx2_d<16>(q, rows, q_stride, k, v, nv, kv_stride, d, scale, m, l, o, pf);
    else
        attend_keys_avx2_d<0>(q, rows, q_stride, k, v, nv, kv_stride, d, scale, m, l, o, pf);
}
#endif

Ops select() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return {dot_avx2,         axpy_avx2,        scale_avx2, max_avx2,
                exp_sub_sum_avx2, attend_keys_avx2, "avx2"};
#endif
    return {dot_generic,         axpy_generic,        scale_generic, max_generic,
            exp_sub_sum_generic, attend_keys_generic, "generic"};
}

}  // namespace

const Ops& ops() {
    static const Ops kOps = select();
    return kOps;
}

}  // namespace kvshard::vec
