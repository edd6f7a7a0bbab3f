#pragma once
// Small fp32 vector primitives for the attention kernels: AVX2+FMA when the CPU has it (chosen once
// at start-up), portable loops otherwise. Internal to src/.
#include <cstdint>

namespace kvshard::vec {

constexpr int kStepKeys = 64;  // the most keys one attend_keys step takes

struct Ops {
    float (*dot)(const float* a, const float* b, int n);
    void (*axpy)(float* y, float a, const float* x, int n);  // y += a * x
    void (*scale)(float* y, float a, int n);                 // y *= a
    float (*max)(const float* x, int n);                     // n >= 1
    // x[i] = exp(x[i] - m) for i < n; returns the sum. m must be >= every x[i] and finite.
    float (*exp_sub_sum)(float* x, int n, float m);
    // Online-softmax step of `rows` query rows over nv keys: s_j = scale * q_r . k_j, then
    //   m_r' = max(m_r, max_j s_j), l_r = l_r e^(m_r - m_r') + sum_j e^(s_j - m_r'),
    //   o_r = o_r e^(m_r - m_r') + sum_j e^(s_j - m_r') v_j.
    // q: rows x d (stride q_stride); k, v: nv keys of d (stride kv_stride); o: rows x d;
    // 1 <= nv <= kStepKeys.
    // pf: optional prefetch of the next data, spread over the work: pf.lines cache lines from
    // each of pf.a and pf.b (null: none).
    struct Prefetch {
        const void* a = nullptr;
        const void* b = nullptr;
        int lines = 0;
    };
    void (*attend_keys)(const float* q, int rows, int64_t q_stride, const float* k, const float* v,
                        int nv, int64_t kv_stride, int d, float scale, float* m, float* l, float* o,
                        Prefetch pf);
    const char* name;
};

const Ops& ops();

}  // namespace kvshard::vec
