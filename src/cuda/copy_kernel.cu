// The copy-program kernel (docs/cuda.md, "Pack and unpack"): each warp takes whole entries and
// copies their count x len bytes with 16-byte loads and stores, four in flight per lane; entries
// whose offsets, steps or length are not multiples of 16 take 4-byte or single-byte copies.
#include <cuda_runtime.h>

#include "cuda/kernels.h"

namespace kvshard::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename Word>
__device__ __forceinline__ void copy_entry(const RawCopyEntry& e,
                                           const unsigned char* __restrict__ src,
                                           unsigned char* __restrict__ dst, int lane) {
    const unsigned per_copy = static_cast<unsigned>(e.len / sizeof(Word));  // words per copy
    const unsigned total = per_copy * static_cast<unsigned>(e.count);
    for (unsigned base = lane; base < total; base += 32 * kUnroll) {
        Word w[kUnroll];
        long long to[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const unsigned u = base + 32 * k;
            if (u < total) {
                const unsigned c = u / per_copy;
                const unsigned o = u - c * per_copy;
                const long long from =
                    e.src + c * e.src_step + static_cast<long long>(o) * sizeof(Word);
                to[k] = e.dst + c * e.dst_step + static_cast<long long>(o) * sizeof(Word);
                w[k] = __ldg(reinterpret_cast<const Word*>(src + from));
            }
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
            if (base + 32 * k < total) *reinterpret_cast<Word*>(dst + to[k]) = w[k];
    }
}

__device__ __forceinline__ void copy_entry_bytes(const RawCopyEntry& e,
                                                 const unsigned char* __restrict__ src,
                                                 unsigned char* __restrict__ dst, int lane) {
    for (long long c = 0; c < e.count; ++c)
        for (long long o = lane; o < e.len; o += 32)
            dst[e.dst + c * e.dst_step + o] = src[e.src + c * e.src_step + o];
}

__global__ void __launch_bounds__(kThreads)
    copy_kernel(const RawCopyEntry* __restrict__ entries, long long count,
                const unsigned char* __restrict__ src, unsigned char* __restrict__ dst) {
    const int lane = threadIdx.x & 31;
    const long long base_align = static_cast<long long>(reinterpret_cast<unsigned long long>(src) |
                                                        reinterpret_cast<unsigned long long>(dst));
    const long long warps = static_cast<long long>(gridDim.x) * (kThreads / 32);
    for (long long i = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
         i < count; i += warps) {
        const RawCopyEntry e = entries[i];
        const long long align =
            base_align | e.src | e.dst | e.len | (e.count > 1 ? (e.src_step | e.dst_step) : 0);
        if ((align & 15) == 0)
            copy_entry<uint4>(e, src, dst, lane);
        else if ((align & 3) == 0)
            copy_entry<unsigned>(e, src, dst, lane);
        else
            copy_entry_bytes(e, src, dst, lane);
    }
}

}  // namespace

void launch_copy(const RawCopyEntry* entries, long long count, const unsigned char* src,
                 unsigned char* dst, int sm_count, cudaStream_t stream) {
    const long long warps_needed = count;
    long long blocks = (warps_needed + kThreads / 32 - 1) / (kThreads / 32);
    const long long cap = static_cast<long long>(sm_count) * 8;
    if (blocks > cap) blocks = cap;
    if (blocks < 1) blocks = 1;
    copy_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(entries, count, src, dst);
}

}  // namespace kvshard::cuda::detail
