#include "attention/vec.h"

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
#endif

Ops select() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return {dot_avx2, axpy_avx2, scale_avx2, max_avx2, exp_sub_sum_avx2, "avx2"};
#endif
    return {dot_generic, axpy_generic, scale_generic, max_generic, exp_sub_sum_generic, "generic"};
}

}  // namespace

const Ops& ops() {
    static const Ops kOps = select();
    return kOps;
}

}  // namespace kvshard::vec
