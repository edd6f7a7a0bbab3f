// Paged decode attention with LSE, and the LSE merge (docs/cuda.md, "Decode attention").
//
// decode_chunk_kernel: one thread block (4 warps) per (work item = a sequence's chunk, KV head).
// A warp is 32 / KL key groups of KL lanes; a key group reads one key (and its value) per step
// with 16-byte loads, each lane VPL vectors of it (so a warp's loads cover consecutive keys'
// bytes), computes the scores of the head's G query heads (the dot products reduced over the KL
// lanes with shuffles), and keeps its own online softmax (max, sum, output slice) over the keys it
// reads: R keys a step, K and V loads of all R issued before any arithmetic. The key groups of the
// block are merged through shared memory into the chunk's partial output and LSE, and
// combine_chunks_kernel merges a sequence's chunks. Scores are kept in log2 units (q is scaled by
// scale * log2(e) when loaded) and the LSE is converted back to natural log at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/kernels.h"

namespace kvshard::cuda::detail {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A 16-byte vector of pool elements as floats.
template <int kElem>
struct Vec;
template <>
struct Vec<0> {  // fp32
    static constexpr int kN = 4;
    static constexpr int kBytes = 4;
    __device__ __forceinline__ static void to_float(const uint4& v, float* f) {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
};
template <>
struct Vec<1> {  // bf16: the high 16 bits of an fp32
    static constexpr int kN = 8;
    static constexpr int kBytes = 2;
    __device__ __forceinline__ static void to_float(const uint4& v, float* f) {
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};
template <>
struct Vec<2> {  // fp16
    static constexpr int kN = 8;
    static constexpr int kBytes = 2;
    __device__ __forceinline__ static void to_float(const uint4& v, float* f) {
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            __half2 h;
            memcpy(&h, &w[i], 4);
            const float2 x = __half22float2(h);
            f[2 * i] = x.x;
            f[2 * i + 1] = x.y;
        }
    }
};

constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

template <int kElem, int D, int G>
struct Shape {
    static constexpr int VE = Vec<kElem>::kN;  // elements per 16-byte vector
    static constexpr int VPK = D / VE;         // vectors per key
    static constexpr int EPL_MAX =
        cmax(VE, cmin(32, 64 / G));  // output floats a lane may keep per head
    static constexpr int VPL0 = cmax(1, cmin(VPK, EPL_MAX / VE));
    static constexpr int KL = cmin(32, VPK / VPL0);  // lanes per key
    static constexpr int VPL = VPK / KL;             // vectors per lane
    static constexpr int EPL = VPL * VE;             // elements per lane
    static constexpr int GPW = 32 / KL;              // key groups per warp
    static constexpr int R = cmax(1, 4 / VPL);       // keys per group per step
    static constexpr int NG = kWarps * GPW;          // key groups per block
    static constexpr int STEP = NG * R;              // keys per block per step
    static_assert(VPK % KL == 0 && 32 % KL == 0, "lanes per key divide the key and the warp");
};

template <int kElem, int D, int G>
__global__ void __launch_bounds__(kThreads, 2) decode_chunk_kernel(DecodeLaunch a) {
    using S = Shape<kElem, D, G>;
    using V = Vec<kElem>;
    constexpr int VE = S::VE, KL = S::KL, VPL = S::VPL, EPL = S::EPL, GPW = S::GPW, R = S::R;
    __shared__ float sm_m[S::NG][G];
    __shared__ float sm_l[S::NG][G];
    __shared__ float sm_acc[S::NG][G][D];

    const long long item = blockIdx.x;
    const int kvh = blockIdx.y;
    const int seq = a.work[2 * item];
    const int chunk = a.work[2 * item + 1];
    const int first_block = a.indptr[seq];
    const int nblk = a.indptr[seq + 1] - first_block;
    const long long len =
        nblk == 0 ? 0 : static_cast<long long>(nblk - 1) * a.block_size + a.last_page_len[seq];
    const long long t0 = static_cast<long long>(chunk) * a.chunk_tokens;
    const long long t1 = t0 + a.chunk_tokens < len ? t0 + a.chunk_tokens : len;

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int gi = lane / KL;  // key group in the warp
    const int li = lane % KL;  // lane in the key group
    const int group = warp * GPW + gi;

    // q of the G query heads of KV head kvh, this lane's elements, in log2 units.
    float q[G][EPL];
    const float qs = a.scale * kLog2e;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qrow = a.q + (static_cast<long long>(seq) * a.num_q_heads + kvh * G + g) * D;
#pragma unroll
        for (int v = 0; v < VPL; ++v)
#pragma unroll
            for (int e = 0; e < VE; ++e) q[g][v * VE + e] = qrow[(v * KL + li) * VE + e] * qs;
    }
    float m[G], l[G], acc[G][EPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] = 0.0f;
    }

    const unsigned char* pool = a.pool;
    const long long kv_plane = a.num_blocks * a.page_elems;  // elements from a K page to its V page
    const long long layer_base = static_cast<long long>(a.layer) * a.kv_factor * kv_plane;
    const long long head_base = static_cast<long long>(kvh) * a.head_stride;

    for (long long s0 = t0; s0 < t1; s0 += S::STEP) {
        uint4 kr[R][VPL], vr[R][VPL];
        bool valid[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const long long t = s0 + static_cast<long long>(warp) * GPW * R + r * GPW + gi;
            valid[r] = t < t1;
            if (valid[r]) {
                const int blk = a.indices[first_block + static_cast<int>(t / a.block_size)];
                const int slot = static_cast<int>(t % a.block_size);
                const long long koff = layer_base + static_cast<long long>(blk) * a.page_elems +
                                       head_base + static_cast<long long>(slot) * a.token_stride;
#pragma unroll
                for (int v = 0; v < VPL; ++v) {
                    const long long el = koff + (v * KL + li) * VE;
                    kr[r][v] = __ldg(reinterpret_cast<const uint4*>(pool + el * V::kBytes));
                    vr[r][v] =
                        __ldg(reinterpret_cast<const uint4*>(pool + (el + kv_plane) * V::kBytes));
                }
            } else {
#pragma unroll
                for (int v = 0; v < VPL; ++v) {
                    kr[r][v] = make_uint4(0, 0, 0, 0);
                    vr[r][v] = make_uint4(0, 0, 0, 0);
                }
            }
        }
        float s[R][G];
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int g = 0; g < G; ++g) s[r][g] = 0.0f;
#pragma unroll
            for (int v = 0; v < VPL; ++v) {
                float f[VE];
                V::to_float(kr[r][v], f);
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int e = 0; e < VE; ++e) s[r][g] = fmaf(q[g][v * VE + e], f[e], s[r][g]);
            }
        }
#pragma unroll
        for (int off = KL / 2; off > 0; off >>= 1)
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int g = 0; g < G; ++g) s[r][g] += __shfl_xor_sync(0xffffffffu, s[r][g], off);
        float p[R][G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (valid[r]) mx = fmaxf(mx, s[r][g]);
            // mx is finite once any key was seen (scores of finite K and q are finite).
            const float corr = m[g] == -INFINITY ? 0.0f : exp2f(m[g] - mx);
            float sum = l[g] * corr;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                p[r][g] = valid[r] ? exp2f(s[r][g] - mx) : 0.0f;
                sum += p[r][g];
            }
            l[g] = sum;
            m[g] = mx;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] *= corr;
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int v = 0; v < VPL; ++v) {
                float f[VE];
                V::to_float(vr[r][v], f);
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int e = 0; e < VE; ++e)
                        acc[g][v * VE + e] = fmaf(p[r][g], f[e], acc[g][v * VE + e]);
            }
    }

    // Merge the block's key groups.
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (li == 0) {
            sm_m[group][g] = m[g];
            sm_l[group][g] = l[g];
        }
#pragma unroll
        for (int v = 0; v < VPL; ++v)
#pragma unroll
            for (int e = 0; e < VE; ++e)
                sm_acc[group][g][(v * KL + li) * VE + e] = acc[g][v * VE + e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += kThreads) {
        const int g = i / D;
        const int d = i % D;
        float mx = -INFINITY;
        for (int j = 0; j < S::NG; ++j) mx = fmaxf(mx, sm_m[j][g]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY) {
            for (int j = 0; j < S::NG; ++j) {
                if (sm_m[j][g] == -INFINITY) continue;
                const float w = exp2f(sm_m[j][g] - mx);
                sum += sm_l[j][g] * w;
                o += sm_acc[j][g][d] * w;
            }
        }
        const long long row = item * a.num_q_heads + kvh * G + g;
        a.partial_out[row * D + d] = sum > 0.0f ? o / sum : 0.0f;
        if (d == 0) a.partial_lse[row] = sum > 0.0f ? (mx + log2f(sum)) * kLn2 : -INFINITY;
    }
}

// One block per (sequence, query head), one thread per element of head_dim: the LSE merge of the
// sequence's chunks.
__global__ void combine_chunks_kernel(DecodeLaunch a) {
    const int seq = blockIdx.x;
    const int h = blockIdx.y;
    const int d = threadIdx.x;
    const int first = a.chunk_indptr[seq];
    const int last = a.chunk_indptr[seq + 1];
    float mx = -INFINITY;
    for (int c = first; c < last; ++c)
        mx = fmaxf(mx, a.partial_lse[static_cast<long long>(c) * a.num_q_heads + h]);
    float sum = 0.0f, o = 0.0f;
    if (mx != -INFINITY) {
        for (int c = first; c < last; ++c) {
            const long long row = static_cast<long long>(c) * a.num_q_heads + h;
            const float lse = a.partial_lse[row];
            if (lse == -INFINITY) continue;
            const float w = expf(lse - mx);
            sum += w;
            o += w * a.partial_out[row * a.head_dim + d];
        }
    }
    const long long out_row = static_cast<long long>(seq) * a.num_q_heads + h;
    a.out[out_row * a.head_dim + d] = sum > 0.0f ? o / sum : 0.0f;
    if (d == 0) a.lse[out_row] = sum > 0.0f ? mx + logf(sum) : -INFINITY;
}

constexpr int kMaxMerge = 64;
struct MergeArgs {
    const float* outs[kMaxMerge];
    const float* lses[kMaxMerge];
    int n;
    long long rows;
    int dim;
    float* out;
    float* lse;
};

// One thread per (row, element): the row's weights from its partials' LSEs, then its element.
__global__ void merge_kernel(MergeArgs a) {
    const long long total = a.rows * a.dim;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long row = i / a.dim;
        float mx = -INFINITY;
        for (int k = 0; k < a.n; ++k) mx = fmaxf(mx, a.lses[k][row]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY) {
            for (int k = 0; k < a.n; ++k) {
                const float lse = a.lses[k][row];
                if (lse == -INFINITY) continue;  // its out row may hold anything, even NaN
                const float w = expf(lse - mx);
                sum += w;
                o += w * a.outs[k][i];
            }
        }
        a.out[i] = sum > 0.0f ? o / sum : 0.0f;
        if (i % a.dim == 0) a.lse[row] = sum > 0.0f ? mx + logf(sum) : -INFINITY;
    }
}

template <int kElem, int D, int G>
void launch_decode_t(const DecodeLaunch& a, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>(a.work_items), static_cast<unsigned>(a.num_kv_heads));
    decode_chunk_kernel<kElem, D, G><<<grid, kThreads, 0, stream>>>(a);
}

using Launcher = void (*)(const DecodeLaunch&, cudaStream_t);

template <int kElem, int D>
Launcher pick_group(int group) {
    switch (group) {
        case 1:
            return launch_decode_t<kElem, D, 1>;
        case 2:
            return launch_decode_t<kElem, D, 2>;
        case 4:
            return launch_decode_t<kElem, D, 4>;
        case 8:
            return launch_decode_t<kElem, D, 8>;
        default:
            return nullptr;
    }
}

template <int kElem>
Launcher pick_dim(int head_dim, int group) {
    switch (head_dim) {
        case 64:
            return pick_group<kElem, 64>(group);
        case 128:
            return pick_group<kElem, 128>(group);
        case 256:
            return pick_group<kElem, 256>(group);
        default:
            return nullptr;
    }
}

Launcher pick(int head_dim, int group, ElemType elem) {
    switch (elem) {
        case ElemType::kFp32:
            return pick_dim<0>(head_dim, group);
        case ElemType::kBf16:
            return pick_dim<1>(head_dim, group);
        case ElemType::kFp16:
            return pick_dim<2>(head_dim, group);
    }
    return nullptr;
}

}  // namespace

bool decode_supported(int head_dim, int group, ElemType elem) {
    return pick(head_dim, group, elem) != nullptr;
}

void launch_decode(const DecodeLaunch& a, cudaStream_t stream) {
    const Launcher f = pick(a.head_dim, a.num_q_heads / a.num_kv_heads, a.elem);
    f(a, stream);
    const dim3 grid(static_cast<unsigned>(a.batch), static_cast<unsigned>(a.num_q_heads));
    combine_chunks_kernel<<<grid, a.head_dim, 0, stream>>>(a);
}

void launch_merge(const float* const* outs, const float* const* lses, int n, long long rows,
                  int dim, float* out, float* lse, cudaStream_t stream) {
    MergeArgs a{};
    for (int k = 0; k < n; ++k) {
        a.outs[k] = outs[k];
        a.lses[k] = lses[k];
    }
    a.n = n;
    a.rows = rows;
    a.dim = dim;
    a.out = out;
    a.lse = lse;
    const long long total = rows * dim;
    long long blocks = (total + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    if (blocks < 1) blocks = 1;
    merge_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
}

}  // namespace kvshard::cuda::detail
