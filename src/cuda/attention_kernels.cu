// Paged decode attention with LSE, and the LSE merge (docs/cuda.md, "Decode attention").
//
// fp32 pools: CUDA cores. bf16 and fp16 pools take the tensor-core kernel below.
//
// decode_chunk_kernel: one thread block (4 warps) per (work item = a sequence's chunk, KV head).
// The chunk's keys and values stream through shared memory in tiles of TK keys, kStages tiles in
// flight (cp.async, so no register holds a load in flight and the copies of later tiles overlap
// the arithmetic on this one). The G query heads of the KV head are split into head groups of at
// most 4 (GH), each served by the same number of warps; a warp is 32 / KL key groups of KL lanes,
// and a key group takes one key of the tile at a time: each lane VPL 16-byte vectors of it, the
// dot products with the GH query heads reduced over the KL lanes with shuffles, and its own online
// softmax (max, sum, output slice) over the keys it takes (R of each tile). The key groups are
// merged through shared memory into the chunk's partial output and LSE, and combine_chunks_kernel
// merges a sequence's chunks. Scores are kept in log2 units (q is scaled by scale * log2(e) when
// loaded) and the LSE is converted back to natural log at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/kernels.h"

namespace kvshard::cuda::detail {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 4;
// Bytes of keys in a tile (and as many of values): at least this, more where a block's key groups
// need more keys (TK = max(KG, kTileBytes / key bytes)).
constexpr int kTileBytes = 8 << 10;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A 16-byte vector of pool elements (fp32) as floats.
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
constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

// A work item's sequence, its first entry in the block table and its tokens [t0, t1).
struct WorkItem {
    int seq;
    int first_block;
    long long t0, t1;
};
__device__ __forceinline__ WorkItem work_item(const DecodeLaunch& a, long long item) {
    WorkItem w;
    w.seq = a.work[2 * item];
    const int chunk = a.work[2 * item + 1];
    w.first_block = a.indptr[w.seq];
    const int nblk = a.indptr[w.seq + 1] - w.first_block;
    const long long len =
        nblk == 0 ? 0 : static_cast<long long>(nblk - 1) * a.block_size + a.last_page_len[w.seq];
    w.t0 = static_cast<long long>(chunk) * a.chunk_tokens;
    w.t1 = w.t0 + a.chunk_tokens < len ? w.t0 + a.chunk_tokens : len;
    return w;
}

template <int kElem, int D, int G>
struct Shape {
    static constexpr int VE = Vec<kElem>::kN;                    // elements per 16-byte vector
    static constexpr int VPK = D / VE;                           // vectors per key
    static constexpr int GH = cmin(G, 4);                        // query heads per head group
    static constexpr int HG = G / GH;                            // head groups
    static constexpr int WPH = kWarps / HG;                      // warps per head group
    static constexpr int EPL_MAX = cmax(VE, cmin(32, 64 / GH));  // floats a lane keeps per head
    static constexpr int VPL0 = cmax(1, cmin(VPK, EPL_MAX / VE));
    static constexpr int KL = cmin(32, VPK / VPL0);  // lanes per key
    static constexpr int VPL = VPK / KL;             // vectors per lane
    static constexpr int EPL = VPL * VE;             // elements per lane
    static constexpr int GPW = 32 / KL;              // key groups per warp
    static constexpr int KG = WPH * GPW;             // key groups per head group
    static constexpr int TK = cmax(KG, kTileBytes / (D * Vec<kElem>::kBytes));  // keys per tile
    static constexpr int R = TK / KG;                       // keys per key group per tile
    static constexpr int TILE_VECS = TK * VPK;              // 16-byte vectors of a tile's keys
    static constexpr int STAGE_BYTES = 2 * TILE_VECS * 16;  // keys and values
    static constexpr int SCRATCH_BYTES = (2 * KG * G + KG * G * D) * 4;
    static constexpr int SMEM_BYTES = cmax(kStages * STAGE_BYTES, SCRATCH_BYTES);
    static_assert(VPK % KL == 0 && 32 % KL == 0, "lanes per key divide the key and the warp");
    static_assert(TK % KG == 0 && G % GH == 0 && kWarps % HG == 0, "an even split");
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int n = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int kElem, int D, int G>
__global__ void __launch_bounds__(kThreads, 2) decode_chunk_kernel(DecodeLaunch a) {
    using S = Shape<kElem, D, G>;
    using V = Vec<kElem>;
    constexpr int VE = S::VE, VPK = S::VPK, GH = S::GH, KL = S::KL, VPL = S::VPL, EPL = S::EPL,
                  GPW = S::GPW, KG = S::KG, TK = S::TK, R = S::R;
    extern __shared__ uint4 smem[];

    const long long item = blockIdx.x;
    const int kvh = blockIdx.y;
    const WorkItem w = work_item(a, item);
    const int seq = w.seq, first_block = w.first_block;
    const long long t0 = w.t0, t1 = w.t1;
    const int tiles = t1 > t0 ? static_cast<int>((t1 - t0 + TK - 1) / TK) : 0;

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int hg = warp / S::WPH;                     // head group
    const int j = (warp % S::WPH) * GPW + lane / KL;  // key group in the head group
    const int li = lane % KL;                         // lane in the key group

    const unsigned char* pool = a.pool;
    const long long kv_plane = a.num_blocks * a.page_elems;  // elements from a K page to its V page
    const long long layer_base = static_cast<long long>(a.layer) * a.kv_factor * kv_plane;
    const long long head_base = static_cast<long long>(kvh) * a.head_stride;

    // Tile `tile` of the chunk into stage `stage`: keys, then values; keys past t1 zero-filled.
    auto load_tile = [&](int tile, int stage) {
        uint4* sk = smem + static_cast<long long>(stage) * 2 * S::TILE_VECS;
        uint4* sv = sk + S::TILE_VECS;
        const long long k0 = t0 + static_cast<long long>(tile) * TK;
        for (int i = threadIdx.x; i < S::TILE_VECS; i += kThreads) {
            const int key = i / VPK;
            const int vec = i % VPK;
            const long long t = k0 + key;
            const bool valid = t < t1;
            long long el = 0;
            if (valid) {
                const int blk = a.indices[first_block + static_cast<int>(t / a.block_size)];
                const int slot = static_cast<int>(t % a.block_size);
                el = layer_base + static_cast<long long>(blk) * a.page_elems + head_base +
                     static_cast<long long>(slot) * a.token_stride + vec * VE;
            }
            cp_async16(sk + i, pool + el * V::kBytes, valid);
            cp_async16(sv + i, pool + (valid ? el + kv_plane : 0) * V::kBytes, valid);
        }
    };

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < tiles) load_tile(s, s);
        cp_async_commit();
    }

    // q of this head group's query heads, this lane's elements, in log2 units.
    float q[GH][EPL];
    const float qs = a.scale * kLog2e;
#pragma unroll
    for (int g = 0; g < GH; ++g) {
        const float* qrow =
            a.q + (static_cast<long long>(seq) * a.num_q_heads + kvh * G + hg * GH + g) * D;
#pragma unroll
        for (int v = 0; v < VPL; ++v)
#pragma unroll
            for (int e = 0; e < VE; ++e) q[g][v * VE + e] = qrow[(v * KL + li) * VE + e] * qs;
    }
    float m[GH], l[GH], acc[GH][EPL];
#pragma unroll
    for (int g = 0; g < GH; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] = 0.0f;
    }

    for (int tile = 0; tile < tiles; ++tile) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // the tile has landed for every thread; the stage refilled below is free
        if (tile + kStages - 1 < tiles)
            load_tile(tile + kStages - 1, (tile + kStages - 1) % kStages);
        cp_async_commit();

        const uint4* sk = smem + static_cast<long long>(tile % kStages) * 2 * S::TILE_VECS;
        const uint4* sv = sk + S::TILE_VECS;
        const long long k0 = t0 + static_cast<long long>(tile) * TK;
        float s[R][GH];
        bool valid[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int kk = r * KG + j;
            valid[r] = k0 + kk < t1;
#pragma unroll
            for (int g = 0; g < GH; ++g) s[r][g] = 0.0f;
#pragma unroll
            for (int v = 0; v < VPL; ++v) {
                float f[VE];
                V::to_float(sk[kk * VPK + v * KL + li], f);
#pragma unroll
                for (int g = 0; g < GH; ++g)
#pragma unroll
                    for (int e = 0; e < VE; ++e) s[r][g] = fmaf(q[g][v * VE + e], f[e], s[r][g]);
            }
        }
#pragma unroll
        for (int off = KL / 2; off > 0; off >>= 1)
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int g = 0; g < GH; ++g) s[r][g] += __shfl_xor_sync(0xffffffffu, s[r][g], off);
#pragma unroll
        for (int g = 0; g < GH; ++g) {
            float mx = m[g];
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (valid[r]) mx = fmaxf(mx, s[r][g]);
            // mx is finite once any key was seen (scores of finite K and q are finite).
            const float corr = m[g] == -INFINITY ? 0.0f : exp2f(m[g] - mx);
            float sum = l[g] * corr;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                s[r][g] = valid[r] ? exp2f(s[r][g] - mx) : 0.0f;  // now the probability
                sum += s[r][g];
            }
            l[g] = sum;
            m[g] = mx;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] *= corr;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int kk = r * KG + j;
#pragma unroll
            for (int v = 0; v < VPL; ++v) {
                float f[VE];
                V::to_float(sv[kk * VPK + v * KL + li], f);
#pragma unroll
                for (int g = 0; g < GH; ++g)
#pragma unroll
                    for (int e = 0; e < VE; ++e)
                        acc[g][v * VE + e] = fmaf(s[r][g], f[e], acc[g][v * VE + e]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every stage read: the shared memory becomes the merge scratch

    // Merge the key groups of each head: scratch m[KG][G], l[KG][G], acc[KG][G][D].
    float* sm_m = reinterpret_cast<float*>(smem);
    float* sm_l = sm_m + KG * G;
    float* sm_acc = sm_l + KG * G;
#pragma unroll
    for (int g = 0; g < GH; ++g) {
        const int h = hg * GH + g;
        if (li == 0) {
            sm_m[j * G + h] = m[g];
            sm_l[j * G + h] = l[g];
        }
#pragma unroll
        for (int v = 0; v < VPL; ++v)
#pragma unroll
            for (int e = 0; e < VE; ++e)
                sm_acc[(j * G + h) * D + (v * KL + li) * VE + e] = acc[g][v * VE + e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += kThreads) {
        const int h = i / D;
        const int d = i % D;
        float mx = -INFINITY;
        for (int k = 0; k < KG; ++k) mx = fmaxf(mx, sm_m[k * G + h]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY) {
            for (int k = 0; k < KG; ++k) {
                const float mk = sm_m[k * G + h];
                if (mk == -INFINITY) continue;
                const float w = exp2f(mk - mx);
                sum += sm_l[k * G + h] * w;
                o += sm_acc[(k * G + h) * D + d] * w;
            }
        }
        const long long row = item * a.num_q_heads + kvh * G + h;
        a.partial_out[row * D + d] = sum > 0.0f ? o / sum : 0.0f;
        if (d == 0) a.partial_lse[row] = sum > 0.0f ? (mx + log2f(sum)) * kLn2 : -INFINITY;
    }
}

// ---- Tensor cores: bf16 / fp16 pools (mma.sync m16n8k16, fp32 accumulation) ----
//
// decode_mma_kernel: one thread block (4 warps) per (work item, KV head), as above, the tiles of
// 64 keys streamed through shared memory by cp.async (16-byte chunks of each key row swizzled by
// the key's low three bits, so that ldmatrix reads them without bank conflicts). Each warp takes
// 16 keys of a tile: S = Q K^T for the KV head's query heads (the 16 rows of the mma's A; rows
// past G are zero) as two 16 x 8 tiles, an online softmax per row, then O += P V with P taken
// straight from S's accumulator registers (the A fragment of m16n8k16 is two of its C
// fragments). Both products split their fp32 operand into two halves of the pool's type
// (x = hi + lo, hi = round(x), lo = round(x - hi)), so that q and P keep about 16 bits of mantissa:
// two mma per product, and results within the host kernel's fp32 rounding.
// The pool's 16-bit type (kElem 1: bf16, 2: fp16): two values packed in a register, and the mma
// of that type.
template <int kElem>
struct MmaType {
    static_assert(kElem == 1 || kElem == 2, "bf16 or fp16");
    __device__ __forceinline__ static unsigned pack(float lo_col, float hi_col) {
        unsigned u;
        if constexpr (kElem == 1) {
            const __nv_bfloat162 h = __floats2bfloat162_rn(lo_col, hi_col);
            memcpy(&u, &h, 4);
        } else {
            const __half2 h = __floats2half2_rn(lo_col, hi_col);
            memcpy(&u, &h, 4);
        }
        return u;
    }
    __device__ __forceinline__ static float2 unpack(unsigned u) {
        if constexpr (kElem == 1) {
            __nv_bfloat162 h;
            memcpy(&h, &u, 4);
            return __bfloat1622float2(h);
        } else {
            __half2 h;
            memcpy(&h, &u, 4);
            return __half22float2(h);
        }
    }
    // c += a b for one m16n8k16 tile (fp32 accumulators).
    __device__ __forceinline__ static void mma(float* c, const unsigned* a, unsigned b0,
                                               unsigned b1) {
#define KVSHARD_MMA_16816(TYPE)                                                 \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE         \
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n" \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
        if constexpr (kElem == 1)
            KVSHARD_MMA_16816("bf16");
        else
            KVSHARD_MMA_16816("f16");
#undef KVSHARD_MMA_16816
    }
};

// Splits (x, y) into hi and lo halves packed as two-element registers.
template <int kElem>
__device__ __forceinline__ void split_pack(float x, float y, unsigned& hi, unsigned& lo) {
    hi = MmaType<kElem>::pack(x, y);
    const float2 h = MmaType<kElem>::unpack(hi);
    lo = MmaType<kElem>::pack(x - h.x, y - h.y);
}

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* smem_ptr) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem_ptr));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* smem_ptr) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem_ptr));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

template <int D>
struct MmaShape {
    static constexpr int TK = kWarps * 16;  // keys per tile: 16 per warp
    static constexpr int VPK = D / 8;       // 16-byte chunks per key row
    static constexpr int TILE_VECS = TK * VPK;
    static constexpr int STAGES = D <= 128 ? 3 : 2;
    static constexpr int STAGE_BYTES = 2 * TILE_VECS * 16;
    static constexpr int SCRATCH_BYTES = (2 * kWarps * 16 + kWarps * 16 * D) * 4;
    static constexpr int SMEM_BYTES = cmax(STAGES * STAGE_BYTES, SCRATCH_BYTES);
    static constexpr int NT = D / 8;   // 8-wide column tiles of the output
    static constexpr int KS = D / 16;  // 16-deep steps of the score product
    static_assert(VPK >= 8, "the swizzle needs at least 8 chunks per key row");
};

// Index (in 16-byte chunks) of chunk `c` of key row `key` in a tile.
template <int VPK>
__device__ __forceinline__ int swz(int key, int c) {
    return key * VPK + (c ^ (key & 7));
}

template <int kElem, int D>
__global__ void __launch_bounds__(kThreads, 2) decode_mma_kernel(DecodeLaunch a) {
    using S = MmaShape<D>;
    using T = MmaType<kElem>;
    constexpr int TK = S::TK, VPK = S::VPK, NT = S::NT, KS = S::KS, STAGES = S::STAGES;
    extern __shared__ uint4 smem[];

    const long long item = blockIdx.x;
    const int kvh = blockIdx.y;
    const int G = a.num_q_heads / a.num_kv_heads;
    const WorkItem w = work_item(a, item);
    const int seq = w.seq, first_block = w.first_block;
    const long long t0 = w.t0, t1 = w.t1;
    const int tiles = t1 > t0 ? static_cast<int>((t1 - t0 + TK - 1) / TK) : 0;

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int gid = lane >> 2;  // the mma's row group
    const int tig = lane & 3;   // thread in the group

    const unsigned char* pool = a.pool;
    const long long kv_plane = a.num_blocks * a.page_elems;
    const long long layer_base = static_cast<long long>(a.layer) * a.kv_factor * kv_plane;
    const long long head_base = static_cast<long long>(kvh) * a.head_stride;

    // Tile `tile` into stage `stage`. The VPK lanes of a key row are consecutive lanes of one warp
    // (VPK divides 32) and each thread keeps its chunk of the row from tile to tile; of the ITER
    // keys a segment of lanes loads per tile, lane n of the segment looks up key n's page (one
    // block-table read and division per key, not per chunk) and the others take it by shuffle.
    constexpr int KSTEP = kThreads / VPK;  // keys the block loads side by side
    constexpr int ITER = TK / KSTEP;       // keys per thread per tile
    static_assert(32 % VPK == 0 && ITER <= VPK, "a key row within a warp");
    const int vec = threadIdx.x % VPK;
    const int key0 = threadIdx.x / VPK;
    const int seg_base = lane & ~(VPK - 1);
    auto load_tile = [&](int tile, int stage) {
        uint4* sk = smem + static_cast<long long>(stage) * 2 * S::TILE_VECS;
        uint4* sv = sk + S::TILE_VECS;
        const long long k0 = t0 + static_cast<long long>(tile) * TK;
        long long my_el = -1;  // element offset of key key0 + vec * KSTEP's row, -1 past t1
        if (vec < ITER) {
            const long long t = k0 + key0 + vec * KSTEP;
            if (t < t1) {
                const int blk = a.indices[first_block + static_cast<int>(t / a.block_size)];
                const int slot = static_cast<int>(t % a.block_size);
                my_el = layer_base + static_cast<long long>(blk) * a.page_elems + head_base +
                        static_cast<long long>(slot) * a.token_stride;
            }
        }
#pragma unroll
        for (int n = 0; n < ITER; ++n) {
            const long long el = __shfl_sync(0xffffffffu, my_el, seg_base + n);
            const bool valid = el >= 0;
            const long long at_el = valid ? el + vec * 8 : 0;
            const int at = swz<VPK>(key0 + n * KSTEP, vec);
            cp_async16(sk + at, pool + at_el * 2, valid);
            cp_async16(sv + at, pool + (valid ? at_el + kv_plane : 0) * 2, valid);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) load_tile(s, s);
        cp_async_commit();
    }

    // Q as the A operand, hi and lo halves: rows gid and gid + 8 (query heads of this KV head;
    // rows past G are zero), columns ks * 16 + tig * 2 + {0, 1} (+ 8).
    unsigned qhi[KS][4], qlo[KS][4];
    {
        const float qs = a.scale * kLog2e;
        const float* q0 = a.q + (static_cast<long long>(seq) * a.num_q_heads + kvh * G) * D;
        const bool r0 = gid < G, r1 = gid + 8 < G;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const int c = ks * 16 + tig * 2;
            float v[8];
            v[0] = r0 ? q0[gid * D + c] * qs : 0.0f;
            v[1] = r0 ? q0[gid * D + c + 1] * qs : 0.0f;
            v[2] = r1 ? q0[(gid + 8) * D + c] * qs : 0.0f;
            v[3] = r1 ? q0[(gid + 8) * D + c + 1] * qs : 0.0f;
            v[4] = r0 ? q0[gid * D + c + 8] * qs : 0.0f;
            v[5] = r0 ? q0[gid * D + c + 9] * qs : 0.0f;
            v[6] = r1 ? q0[(gid + 8) * D + c + 8] * qs : 0.0f;
            v[7] = r1 ? q0[(gid + 8) * D + c + 9] * qs : 0.0f;
#pragma unroll
            for (int k = 0; k < 4; ++k)
                split_pack<kElem>(v[2 * k], v[2 * k + 1], qhi[ks][k], qlo[ks][k]);
        }
    }
    float o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};  // rows gid, gid + 8
    float l[2] = {0.0f, 0.0f};            // this lane's share of the row sums

    for (int tile = 0; tile < tiles; ++tile) {
        if constexpr (STAGES >= 3)
            cp_async_wait<STAGES - 2>();
        else
            cp_async_wait<0>();
        __syncthreads();
        if (tile + STAGES - 1 < tiles) load_tile(tile + STAGES - 1, (tile + STAGES - 1) % STAGES);
        cp_async_commit();

        const uint4* sk = smem + static_cast<long long>(tile % STAGES) * 2 * S::TILE_VECS;
        const uint4* sv = sk + S::TILE_VECS;
        const int kb = warp * 16;  // this warp's keys in the tile
        const long long k0 = t0 + static_cast<long long>(tile) * TK + kb;
        if (k0 >= t1) continue;  // nothing of this tile for this warp (the barrier above is shared)

        float c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};  // keys kb..+7, kb+8..+15
        {
            const int mi = lane >> 3, row = lane & 7;
            const int key = kb + (mi >> 1) * 8 + row;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                unsigned b[4];
                ldmatrix_x4(b, sk + swz<VPK>(key, ks * 2 + (mi & 1)));
                T::mma(c0, qhi[ks], b[0], b[1]);
                T::mma(c0, qlo[ks], b[0], b[1]);
                T::mma(c1, qhi[ks], b[2], b[3]);
                T::mma(c1, qlo[ks], b[2], b[3]);
            }
        }
        // Keys past the chunk's end: out of the softmax.
        const long long kc = k0 + tig * 2;
        if (kc >= t1) c0[0] = c0[2] = -INFINITY;
        if (kc + 1 >= t1) c0[1] = c0[3] = -INFINITY;
        if (kc + 8 >= t1) c1[0] = c1[2] = -INFINITY;
        if (kc + 9 >= t1) c1[1] = c1[3] = -INFINITY;
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = fmaxf(fmaxf(c0[2 * h], c0[2 * h + 1]), fmaxf(c1[2 * h], c1[2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, m[h]);
            // mx is finite: the warp's first key is before t1, and scores of finite q and K are.
            corr[h] = m[h] == -INFINITY ? 0.0f : exp2f(m[h] - mx);
            m[h] = mx;
            c0[2 * h] = exp2f(c0[2 * h] - mx);
            c0[2 * h + 1] = exp2f(c0[2 * h + 1] - mx);
            c1[2 * h] = exp2f(c1[2 * h] - mx);
            c1[2 * h + 1] = exp2f(c1[2 * h + 1] - mx);
            l[h] = l[h] * corr[h] + c0[2 * h] + c0[2 * h + 1] + c1[2 * h] + c1[2 * h + 1];
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            o[nt][0] *= corr[0];
            o[nt][1] *= corr[0];
            o[nt][2] *= corr[1];
            o[nt][3] *= corr[1];
        }
        // P as the A operand (rows gid / gid + 8, keys tig * 2 + {0, 1} (+ 8)).
        unsigned phi[4], plo[4];
        split_pack<kElem>(c0[0], c0[1], phi[0], plo[0]);
        split_pack<kElem>(c0[2], c0[3], phi[1], plo[1]);
        split_pack<kElem>(c1[0], c1[1], phi[2], plo[2]);
        split_pack<kElem>(c1[2], c1[3], phi[3], plo[3]);
        {
            const int mi = lane >> 3, row = lane & 7;
            const int key = kb + (mi & 1) * 8 + row;
#pragma unroll
            for (int dt = 0; dt < NT / 2; ++dt) {
                unsigned b[4];
                ldmatrix_x4_trans(b, sv + swz<VPK>(key, dt * 2 + (mi >> 1)));
                T::mma(o[2 * dt], phi, b[0], b[1]);
                T::mma(o[2 * dt], plo, b[0], b[1]);
                T::mma(o[2 * dt + 1], phi, b[2], b[3]);
                T::mma(o[2 * dt + 1], plo, b[2], b[3]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Merge the warps: scratch m[warp][16], l[warp][16], o[warp][16][D].
    float* sm_m = reinterpret_cast<float*>(smem);
    float* sm_l = sm_m + kWarps * 16;
    float* sm_o = sm_l + kWarps * 16;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = gid + 8 * h;
        if (tig == 0) {
            sm_m[warp * 16 + row] = m[h];
            sm_l[warp * 16 + row] = sum;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            sm_o[(warp * 16 + row) * D + nt * 8 + tig * 2] = o[nt][2 * h];
            sm_o[(warp * 16 + row) * D + nt * 8 + tig * 2 + 1] = o[nt][2 * h + 1];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += kThreads) {
        const int h = i / D;
        const int d = i % D;
        float mx = -INFINITY;
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w * 16 + h]);
        float sum = 0.0f, acc = 0.0f;
        if (mx != -INFINITY) {
            for (int w = 0; w < kWarps; ++w) {
                const float mw = sm_m[w * 16 + h];
                if (mw == -INFINITY) continue;
                const float wt = exp2f(mw - mx);
                sum += sm_l[w * 16 + h] * wt;
                acc += sm_o[(w * 16 + h) * D + d] * wt;
            }
        }
        const long long row = item * a.num_q_heads + kvh * G + h;
        a.partial_out[row * D + d] = sum > 0.0f ? acc / sum : 0.0f;
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
cudaError_t launch_decode_t(const DecodeLaunch& a, cudaStream_t stream) {
    constexpr int bytes = Shape<kElem, D, G>::SMEM_BYTES;
    // Set at every launch: the attribute belongs to the current device, and it costs little.
    const cudaError_t opt_in = cudaFuncSetAttribute(
        decode_chunk_kernel<kElem, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (opt_in != cudaSuccess) return opt_in;
    const dim3 grid(static_cast<unsigned>(a.work_items), static_cast<unsigned>(a.num_kv_heads));
    decode_chunk_kernel<kElem, D, G><<<grid, kThreads, bytes, stream>>>(a);
    return cudaGetLastError();
}

template <int kElem, int D>
cudaError_t launch_decode_mma(const DecodeLaunch& a, cudaStream_t stream) {
    constexpr int bytes = MmaShape<D>::SMEM_BYTES;
    // Set at every launch: the attribute belongs to the current device, and it costs little.
    const cudaError_t opt_in = cudaFuncSetAttribute(
        decode_mma_kernel<kElem, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (opt_in != cudaSuccess) return opt_in;
    const dim3 grid(static_cast<unsigned>(a.work_items), static_cast<unsigned>(a.num_kv_heads));
    decode_mma_kernel<kElem, D><<<grid, kThreads, bytes, stream>>>(a);
    return cudaGetLastError();
}

using Launcher = cudaError_t (*)(const DecodeLaunch&, cudaStream_t);

// fp32 pools: CUDA cores, 1, 2, 4 or 8 query heads per KV head.
template <int D>
Launcher pick_fp32(int group) {
    switch (group) {
        case 1:
            return launch_decode_t<0, D, 1>;
        case 2:
            return launch_decode_t<0, D, 2>;
        case 4:
            return launch_decode_t<0, D, 4>;
        case 8:
            return launch_decode_t<0, D, 8>;
        default:
            return nullptr;
    }
}

// bf16 / fp16 pools: tensor cores, any group of 1 to 16 query heads per KV head.
template <int kElem>
Launcher pick_mma(int head_dim, int group) {
    if (group < 1 || group > 16) return nullptr;
    switch (head_dim) {
        case 64:
            return launch_decode_mma<kElem, 64>;
        case 128:
            return launch_decode_mma<kElem, 128>;
        case 256:
            return launch_decode_mma<kElem, 256>;
        default:
            return nullptr;
    }
}

Launcher pick(int head_dim, int group, ElemType elem) {
    switch (elem) {
        case ElemType::kFp32:
            switch (head_dim) {
                case 64:
                    return pick_fp32<64>(group);
                case 128:
                    return pick_fp32<128>(group);
                case 256:
                    return pick_fp32<256>(group);
                default:
                    return nullptr;
            }
        case ElemType::kBf16:
            return pick_mma<1>(head_dim, group);
        case ElemType::kFp16:
            return pick_mma<2>(head_dim, group);
    }
    return nullptr;
}

}  // namespace

bool decode_supported(int head_dim, int group, ElemType elem) {
    return pick(head_dim, group, elem) != nullptr;
}

cudaError_t launch_decode(const DecodeLaunch& a, cudaStream_t stream) {
    const Launcher f = pick(a.head_dim, a.num_q_heads / a.num_kv_heads, a.elem);
    const cudaError_t e = f(a, stream);
    if (e != cudaSuccess) return e;
    const dim3 grid(static_cast<unsigned>(a.batch), static_cast<unsigned>(a.num_q_heads));
    combine_chunks_kernel<<<grid, a.head_dim, 0, stream>>>(a);
    return cudaGetLastError();
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
