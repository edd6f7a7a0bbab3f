#pragma once
// Small fp32 vector primitives for the attention kernels: AVX2+FMA when the CPU has it (chosen once
// at start-up), portable loops otherwise. Internal to src/.
#include <cstdint>

namespace kvshard::vec {

struct Ops {
    float (*dot)(const float* a, const float* b, int n);
    void (*axpy)(float* y, float a, const float* x, int n);  // y += a * x
    void (*scale)(float* y, float a, int n);                 // y *= a
    float (*max)(const float* x, int n);                     // n >= 1
    // x[i] = exp(x[i] - m) for i < n; returns the sum. m must be >= every x[i] and finite.
    float (*exp_sub_sum)(float* x, int n, float m);
    const char* name;
};

const Ops& ops();

}  // namespace kvshard::vec
