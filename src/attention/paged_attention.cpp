#include "kvshard/attention/paged_attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention/vec.h"
#include "kvshard/common/error.h"

namespace kvshard {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query rows (sequence rows x heads of one GQA group) at or above which the GEMM path is used.
constexpr int64_t kGemmMinRows = 16;
constexpr int kTileRows = 128;    // query rows per GEMM tile
constexpr int kTileKeys = 256;    // keys per GEMM chunk
constexpr int kPrefetchRuns = 4;  // decode: (block, KV head) steps to prefetch ahead

void check_args(const BlockPool& pool, int layer, const PagedKv& kv, const QueryBatch& qb,
                const AttentionParams& p) {
    const auto& g = pool.geometry();
    KVSHARD_CHECK(g.kv_factor == 2, "attention needs a K/V pool (kv_factor 2)");
    KVSHARD_CHECK(layer >= 0 && layer < g.num_layers, "layer ", layer, " not in the pool");
    KVSHARD_CHECK(g.head_dim == p.head_dim && g.num_heads == p.num_kv_heads,
                  "pool geometry (heads ", g.num_heads, ", head_dim ", g.head_dim,
                  ") differs from the attention params");
    KVSHARD_CHECK(p.num_kv_heads >= 1 && p.num_q_heads % p.num_kv_heads == 0, "q heads ",
                  p.num_q_heads, " not a multiple of kv heads ", p.num_kv_heads);
    KVSHARD_CHECK(qb.batch() == kv.batch(), "query batch of ", qb.batch(),
                  " sequences over a KV batch of ", kv.batch());
    KVSHARD_CHECK(int64_t(qb.q_pos.size()) == qb.rows(), "q_pos size");
    KVSHARD_CHECK(qb.kv_pos.empty() || int(qb.kv_pos_indptr.size()) == qb.batch() + 1,
                  "kv_pos_indptr size");
}

// Where token j of sequence i lives for KV head h: pointer to its head_dim floats. An fp32 pool is
// read in place; a bf16 / fp16 / fp8 pool's pages of the batch (this layer, K and V) are first
// converted to fp32 into `staged`, [kv][position in kv.indices][page_elems], in page order, so
// that the kernels below run unchanged on the stored values (docs/cache.md, "Element types").
struct PageView {
    const BlockPool* pool;
    const PagedKv* kv;
    int layer, block_size, head_dim;
    int64_t head_stride_elems, token_stride;  // within a page
    const float* staged = nullptr;            // null for an fp32 pool
    int64_t page_elems = 0, staged_pages = 0;

    PageView(const BlockPool& p, const PagedKv& k, int l, std::vector<float>* stage = nullptr)
        : pool(&p),
          kv(&k),
          layer(l),
          block_size(p.geometry().block_size),
          head_dim(p.geometry().head_dim) {
        const auto& g = p.geometry();
        head_stride_elems = g.elem_in_page(1, 0, 0) - g.elem_in_page(0, 0, 0);
        token_stride = g.elem_in_page(0, 1, 0) - g.elem_in_page(0, 0, 0);
        page_elems = g.page_elems();
        if (g.dtype != DType::kFp32) {
            KVSHARD_CHECK(stage != nullptr, "a non-fp32 pool is read through a staging buffer");
            staged_pages = int64_t(k.indices.size());
            stage->resize(size_t(2 * staged_pages * page_elems));
            for (int which = 0; which < 2; ++which)
                for (int64_t i = 0; i < staged_pages; ++i)
                    dequantize_page(p, l, which, k.indices[size_t(i)],
                                    stage->data() + (which * staged_pages + i) * page_elems);
            staged = stage->data();
        }
    }
    const float* block_ptr(int which, int seq, int64_t b, int head) const {
        const int64_t at = kv->indptr[seq] + b;
        if (staged)
            return staged + (which * staged_pages + at) * page_elems + head * head_stride_elems;
        return pool->page_f32(layer, which, kv->indices[size_t(at)]) + head * head_stride_elems;
    }
    const float* token(int which, int seq, int64_t j, int head) const {
        return block_ptr(which, seq, j / block_size, head) + (j % block_size) * token_stride;
    }
};

// Keys visible to every row of sequence i: slots [lo, vis) (causal: a prefix; a window raises lo).
void visible_ranges(const QueryBatch& qb, const PagedKv& kv, int i, int block_size,
                    const AttentionParams& p, std::vector<int64_t>& lo, std::vector<int64_t>& vis) {
    const int64_t len = kv.seq_len(i, block_size);
    const int32_t r0 = qb.q_indptr[i], r1 = qb.q_indptr[i + 1];
    vis.resize(size_t(r1 - r0));
    lo.assign(size_t(r1 - r0), 0);
    const bool local = p.causal && p.window > 0;
    for (int32_t t = r0; t < r1; ++t) {
        int64_t n = len, first = 0;
        if (p.causal) {
            const int64_t pos = qb.q_pos[t];
            const int64_t from = local ? first_visible_position(p, pos) : 0;
            if (qb.kv_pos.empty()) {
                n = std::clamp<int64_t>(pos + 1, 0, len);
                first = std::clamp<int64_t>(from, 0, n);
            } else {
                const auto* b = qb.kv_pos.data() + qb.kv_pos_indptr[i];
                const int64_t cnt =
                    std::min<int64_t>(len, qb.kv_pos_indptr[i + 1] - qb.kv_pos_indptr[i]);
                n = std::upper_bound(b, b + cnt, pos) - b;
                first = local ? std::lower_bound(b, b + n, from) - b : 0;
            }
        }
        vis[size_t(t - r0)] = n;
        lo[size_t(t - r0)] = first;
    }
}

struct Workspace {
    std::vector<float> k, v, q, s, o, m, l, staged;
    std::vector<int64_t> vis, lo;
};

void finish_row(const float* o, float m, float l, int d, float* out, float* lse) {
    if (l > 0) {
        const float inv = 1.0f / l;
        for (int x = 0; x < d; ++x) out[x] = o[x] * inv;
        if (lse) *lse = m + std::log(l);
    } else {
        std::fill(out, out + d, 0.0f);
        if (lse) *lse = kNegInf;
    }
}

// Few query rows per KV head (decode): stream each block's pages once, every KV head of the block
// in turn, no copies. Each (block, KV head) step also prefetches, into L2 and spread over its work,
// the K and V bytes of the step kPrefetchRuns ahead (1/num_kv_heads of a page: the head's run in
// HND). The hardware prefetchers stop at every 4 KiB page and pages of a sequence are scattered
// over the pool; measured on a Zen 4 core: 0.54 -> 0.6-0.7 of a streaming read (BENCHMARKS.md
// "model").
void attend_streaming(const PageView& pv, const AttentionParams& p, int seq, int32_t r0, int32_t r1,
                      const std::vector<int64_t>& lo, const std::vector<int64_t>& vis,
                      const float* q, float* out, float* lse, Workspace& ws) {
    const auto& V = vec::ops();
    const int d = p.head_dim, nq = p.num_q_heads, nkv = p.num_kv_heads, group = nq / nkv;
    const int bs = pv.block_size;
    const int64_t nrows = r1 - r0;
    ws.o.assign(size_t(nrows * nq * d), 0.0f);
    ws.m.assign(size_t(nrows * nq), kNegInf);
    ws.l.assign(size_t(nrows * nq), 0.0f);
    const int64_t maxvis = *std::max_element(vis.begin(), vis.end());
    const int64_t nblocks = (maxvis + bs - 1) / bs;
    const int64_t first_block = *std::min_element(lo.begin(), lo.end()) / bs;
    const int64_t nsteps = nblocks * nkv;
    const int64_t slice_bytes = pv.pool->geometry().page_bytes() / nkv;
    const int slice_lines = int(slice_bytes / 64);
    // HND: a head's step reads only its own slice. NHD: every step reads the whole page, so the
    // prefetch runs a whole block further ahead.
    const int64_t distance =
        kPrefetchRuns + (pv.pool->geometry().order == PageOrder::kHnd ? 0 : nkv);
    for (int64_t b = first_block; b < nblocks; ++b) {
        const int64_t j0 = b * bs;
        for (int kh = 0; kh < nkv; ++kh) {
            const float* kb = pv.block_ptr(0, seq, b, kh);
            const float* vb = pv.block_ptr(1, seq, b, kh);
            vec::Ops::Prefetch pf;
            if (const int64_t ahead = b * nkv + kh + distance; ahead < nsteps) {
                const int64_t off = (ahead % nkv) * slice_bytes;
                pf = {
                    reinterpret_cast<const std::byte*>(pv.block_ptr(0, seq, ahead / nkv, 0)) + off,
                    reinterpret_cast<const std::byte*>(pv.block_ptr(1, seq, ahead / nkv, 0)) + off,
                    slice_lines};
            }
            for (int64_t t = 0; t < nrows; ++t) {
                const int nv = int(std::clamp<int64_t>(vis[size_t(t)] - j0, 0, bs));
                const int c_lo = int(std::clamp<int64_t>(lo[size_t(t)] - j0, 0, bs));
                const int64_t row = t * nq + kh * group;
                // At most kStepKeys keys per step (blocks may be larger); the first step of the
                // block's work carries the prefetch.
                for (int c0 = c_lo; c0 < nv; c0 += vec::kStepKeys) {
                    const int64_t off = int64_t{c0} * pv.token_stride;
                    V.attend_keys(q + ((r0 + t) * int64_t{nq} + kh * group) * d, group, d, kb + off,
                                  vb + off, std::min(vec::kStepKeys, nv - c0), pv.token_stride, d,
                                  p.scale, ws.m.data() + row, ws.l.data() + row,
                                  ws.o.data() + row * d, pf);
                    pf = {};
                }
            }
        }
    }
    for (int64_t t = 0; t < nrows; ++t)
        for (int h = 0; h < nq; ++h) {
            const int64_t r = t * nq + h, row = (r0 + t) * int64_t{nq} + h;
            finish_row(ws.o.data() + r * d, ws.m[size_t(r)], ws.l[size_t(r)], d, out + row * d,
                       lse ? lse + row : nullptr);
        }
}

// Many query rows per KV head (prefill): gather the head's keys and values once, then tiles of
// S = Q K^T and O += P V through sgemm with an online softmax between them.
void attend_gemm(const PageView& pv, const AttentionParams& p, int seq, int kh, int32_t r0,
                 int32_t r1, const std::vector<int64_t>& lo, const std::vector<int64_t>& vis,
                 const float* q, float* out, float* lse, Workspace& ws) {
    const auto& V = vec::ops();
    const int d = p.head_dim, group = p.num_q_heads / p.num_kv_heads, bs = pv.block_size;
    const int64_t maxvis = *std::max_element(vis.begin(), vis.end());
    // Keys are gathered from the first visible block on: ws.k row j holds slot base + j.
    const int64_t base =
        std::min<int64_t>(*std::min_element(lo.begin(), lo.end()) / bs * bs, maxvis / bs * bs);
    ws.k.resize(size_t(std::max<int64_t>(maxvis - base, 1) * d));
    ws.v.resize(ws.k.size());
    for (int64_t j0 = base; j0 < maxvis; j0 += bs) {
        const int64_t n = std::min<int64_t>(bs, maxvis - j0);
        const float* kb = pv.block_ptr(0, seq, j0 / bs, kh);
        const float* vb = pv.block_ptr(1, seq, j0 / bs, kh);
        float* kd = ws.k.data() + (j0 - base) * d;
        float* vd = ws.v.data() + (j0 - base) * d;
        if (pv.token_stride == d) {
            std::memcpy(kd, kb, size_t(n * d) * sizeof(float));
            std::memcpy(vd, vb, size_t(n * d) * sizeof(float));
        } else {
            for (int64_t j = 0; j < n; ++j) {
                std::memcpy(kd + j * d, kb + j * pv.token_stride, size_t(d) * sizeof(float));
                std::memcpy(vd + j * d, vb + j * pv.token_stride, size_t(d) * sizeof(float));
            }
        }
    }
    const int64_t nrows = r1 - r0;
    const int64_t tile_t = std::max<int64_t>(1, kTileRows / group);  // sequence rows per tile
    ws.q.resize(size_t(tile_t * group * d));
    ws.o.resize(ws.q.size());
    ws.s.resize(size_t(tile_t * group * kTileKeys));
    ws.m.resize(size_t(tile_t * group));
    ws.l.resize(ws.m.size());
    for (int64_t t0 = 0; t0 < nrows; t0 += tile_t) {
        const int64_t tn = std::min(tile_t, nrows - t0);
        const int64_t m = tn * group;
        int64_t tile_vis = 0, tile_lo = maxvis;
        for (int64_t t = 0; t < tn; ++t) {
            tile_vis = std::max(tile_vis, vis[size_t(t0 + t)]);
            tile_lo = std::min(tile_lo, lo[size_t(t0 + t)]);
        }
        for (int64_t t = 0; t < tn; ++t)
            for (int gi = 0; gi < group; ++gi) {
                const float* src =
                    q + ((r0 + t0 + t) * int64_t{p.num_q_heads} + kh * group + gi) * d;
                float* dst = ws.q.data() + (t * group + gi) * d;
                for (int x = 0; x < d; ++x) dst[x] = src[x] * p.scale;
            }
        std::fill(ws.o.begin(), ws.o.begin() + m * d, 0.0f);
        std::fill(ws.m.begin(), ws.m.begin() + m, kNegInf);
        std::fill(ws.l.begin(), ws.l.begin() + m, 0.0f);
        for (int64_t j0 = std::max(base, tile_lo); j0 < tile_vis; j0 += kTileKeys) {
            const int n = int(std::min<int64_t>(kTileKeys, tile_vis - j0));
            float* S = ws.s.data();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), n, d, 1.0f, ws.q.data(), d,
                        ws.k.data() + (j0 - base) * d, d, 0.0f, S, n);
            for (int64_t r = 0; r < m; ++r) {
                float* srow = S + r * n;
                const int64_t t = t0 + r / group;
                const int nv = int(std::clamp<int64_t>(vis[size_t(t)] - j0, 0, n));
                const int a = int(std::clamp<int64_t>(lo[size_t(t)] - j0, 0, nv));
                if (nv > a) {
                    const float mnew = std::max(ws.m[size_t(r)], V.max(srow + a, nv - a));
                    if (ws.m[size_t(r)] != mnew) {
                        const float corr = std::exp(ws.m[size_t(r)] - mnew);
                        ws.l[size_t(r)] *= corr;
                        V.scale(ws.o.data() + r * d, corr, d);
                        ws.m[size_t(r)] = mnew;
                    }
                    ws.l[size_t(r)] += V.exp_sub_sum(srow + a, nv - a, mnew);
                }
                std::fill(srow, srow + a, 0.0f);
                std::fill(srow + std::max(nv, a), srow + n, 0.0f);
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(m), d, n, 1.0f, S, n,
                        ws.v.data() + (j0 - base) * d, d, 1.0f, ws.o.data(), d);
        }
        for (int64_t r = 0; r < m; ++r) {
            const int64_t row =
                (r0 + t0 + r / group) * int64_t{p.num_q_heads} + kh * group + r % group;
            finish_row(ws.o.data() + r * d, ws.m[size_t(r)], ws.l[size_t(r)], d, out + row * d,
                       lse ? lse + row : nullptr);
        }
    }
}

}  // namespace

int64_t first_visible_position(const AttentionParams& p, int64_t pos) {
    if (p.window <= 0) return 0;
    return p.chunked ? pos - pos % p.window : std::max<int64_t>(0, pos - p.window + 1);
}

void paged_attention(const BlockPool& pool, int layer, const PagedKv& kv, const QueryBatch& qb,
                     const AttentionParams& p, const float* q, float* out, float* lse) {
    check_args(pool, layer, kv, qb, p);
    thread_local Workspace ws;
    const PageView pv(pool, kv, layer, &ws.staged);
    const int group = p.num_q_heads / p.num_kv_heads;
    for (int i = 0; i < qb.batch(); ++i) {
        const int32_t r0 = qb.q_indptr[i], r1 = qb.q_indptr[i + 1];
        if (r1 == r0) continue;
        visible_ranges(qb, kv, i, pv.block_size, p, ws.lo, ws.vis);
        const std::vector<int64_t>&vis = ws.vis, &lo = ws.lo;  // the kernels do not touch them
        if (int64_t(r1 - r0) * group >= kGemmMinRows) {
            for (int kh = 0; kh < p.num_kv_heads; ++kh)
                attend_gemm(pv, p, i, kh, r0, r1, lo, vis, q, out, lse, ws);
        } else {
            attend_streaming(pv, p, i, r0, r1, lo, vis, q, out, lse, ws);
        }
    }
}

void paged_attention_reference(const BlockPool& pool, int layer, const PagedKv& kv,
                               const QueryBatch& qb, const AttentionParams& p, const float* q,
                               float* out, float* lse) {
    check_args(pool, layer, kv, qb, p);
    std::vector<float> staged;
    const PageView pv(pool, kv, layer, &staged);
    const int d = p.head_dim, group = p.num_q_heads / p.num_kv_heads;
    std::vector<int64_t> vis, lo;
    std::vector<double> s;
    for (int i = 0; i < qb.batch(); ++i) {
        visible_ranges(qb, kv, i, pv.block_size, p, lo, vis);
        for (int32_t t = qb.q_indptr[i]; t < qb.q_indptr[i + 1]; ++t) {
            const int64_t n = vis[size_t(t - qb.q_indptr[i])];
            const int64_t j_lo = lo[size_t(t - qb.q_indptr[i])];
            for (int h = 0; h < p.num_q_heads; ++h) {
                const float* qr = q + (int64_t{t} * p.num_q_heads + h) * d;
                float* o = out + (int64_t{t} * p.num_q_heads + h) * d;
                const int kh = h / group;
                s.assign(size_t(n), 0.0);
                double mx = -std::numeric_limits<double>::infinity();
                for (int64_t j = j_lo; j < n; ++j) {
                    const float* kj = pv.token(0, i, j, kh);
                    double acc = 0;
                    for (int x = 0; x < d; ++x) acc += double(qr[x]) * kj[x];
                    s[size_t(j)] = acc * p.scale;
                    mx = std::max(mx, s[size_t(j)]);
                }
                double sum = 0;
                std::vector<double> acc(size_t(d), 0.0);
                for (int64_t j = j_lo; j < n; ++j) {
                    const double e = std::exp(s[size_t(j)] - mx);
                    sum += e;
                    const float* vj = pv.token(1, i, j, kh);
                    for (int x = 0; x < d; ++x) acc[size_t(x)] += e * vj[x];
                }
                const bool any = n > j_lo;
                for (int x = 0; x < d; ++x) o[x] = any ? float(acc[size_t(x)] / sum) : 0.0f;
                if (lse)
                    lse[int64_t{t} * p.num_q_heads + h] = any ? float(mx + std::log(sum)) : kNegInf;
            }
        }
    }
}

void write_kv(BlockPool& pool, int layer, const PagedKv& kv, std::span<const int32_t> indptr,
              std::span<const int64_t> slots, const float* k, const float* v) {
    const auto& g = pool.geometry();
    KVSHARD_CHECK(g.kv_factor == 2, "write_kv needs a K/V pool (kv_factor 2)");
    KVSHARD_CHECK(int(indptr.size()) == kv.batch() + 1, "indptr has ", indptr.size(),
                  " entries for a batch of ", kv.batch());
    const int d = g.head_dim, bs = g.block_size, nh = g.num_heads;
    for (int i = 0; i < kv.batch(); ++i) {
        const int64_t nblocks = kv.indptr[i + 1] - kv.indptr[i];
        for (int32_t t = indptr[i]; t < indptr[i + 1]; ++t) {
            const int64_t slot = slots[size_t(t)];
            KVSHARD_CHECK(slot >= 0 && slot < nblocks * bs, "slot ", slot, " outside the ", nblocks,
                          " blocks of sequence ", i);
            const int32_t blk = kv.indices[kv.indptr[i] + slot / bs];
            const int off = int(slot % bs);
            for (int h = 0; h < nh; ++h) {
                store_vector(pool, layer, 0, blk, h, off, k + (int64_t{t} * nh + h) * d);
                store_vector(pool, layer, 1, blk, h, off, v + (int64_t{t} * nh + h) * d);
            }
        }
    }
}

void mla_attention(const BlockPool& pool, int layer, const PagedKv& kv, const QueryBatch& qb,
                   const MlaParams& p, const float* q, float* out, float* lse) {
    const auto& g = pool.geometry();
    const int dl = p.latent_dim, dq = p.latent_dim + p.rope_dim;
    KVSHARD_CHECK(g.kv_factor == 1 && g.num_heads == 1 && g.head_dim == dq,
                  "MLA attention needs a latent pool of one head of ", dq, " elements");
    KVSHARD_CHECK(layer >= 0 && layer < g.num_layers, "layer ", layer, " not in the pool");
    KVSHARD_CHECK(qb.batch() == kv.batch(), "query batch of ", qb.batch(),
                  " sequences over a KV batch of ", kv.batch());
    AttentionParams ap;
    ap.causal = true;
    std::vector<int64_t> vis, lo;
    std::vector<float> page(size_t(g.page_elems()));
    std::vector<float> keys;  // the visible rows of one sequence, [j][dq]
    std::vector<double> s, acc;
    for (int i = 0; i < qb.batch(); ++i) {
        const int32_t r0 = qb.q_indptr[i], r1 = qb.q_indptr[i + 1];
        if (r1 == r0) continue;
        visible_ranges(qb, kv, i, g.block_size, ap, lo, vis);
        const int64_t n = *std::max_element(vis.begin(), vis.end());
        keys.resize(size_t(n * dq));
        for (int64_t b = 0; b * g.block_size < n; ++b) {
            const int32_t blk = kv.indices[size_t(kv.indptr[i] + b)];
            const float* src;
            if (g.dtype == DType::kFp32) {
                src = pool.page_f32(layer, 0, blk);
            } else {
                dequantize_page(pool, layer, 0, blk, page.data());
                src = page.data();
            }
            const int64_t cnt = std::min<int64_t>(g.block_size, n - b * g.block_size);
            for (int64_t t = 0; t < cnt; ++t)
                std::memcpy(keys.data() + (b * g.block_size + t) * dq,
                            src + g.elem_in_page(0, int(t), 0), size_t(dq) * sizeof(float));
        }
        for (int32_t t = r0; t < r1; ++t) {
            const int64_t nv = vis[size_t(t - r0)];
            for (int h = 0; h < p.num_heads; ++h) {
                const float* qr = q + (int64_t{t} * p.num_heads + h) * dq;
                float* o = out + (int64_t{t} * p.num_heads + h) * dl;
                s.assign(size_t(nv), 0.0);
                double mx = -std::numeric_limits<double>::infinity();
                for (int64_t j = 0; j < nv; ++j) {
                    const float* kj = keys.data() + j * dq;
                    double a = 0;
                    for (int x = 0; x < dq; ++x) a += double(qr[x]) * kj[x];
                    s[size_t(j)] = a * p.scale;
                    mx = std::max(mx, s[size_t(j)]);
                }
                double sum = 0;
                acc.assign(size_t(dl), 0.0);
                for (int64_t j = 0; j < nv; ++j) {
                    const double e = std::exp(s[size_t(j)] - mx);
                    sum += e;
                    const float* cj = keys.data() + j * dq;
                    for (int x = 0; x < dl; ++x) acc[size_t(x)] += e * cj[x];
                }
                for (int x = 0; x < dl; ++x) o[x] = nv > 0 ? float(acc[size_t(x)] / sum) : 0.0f;
                if (lse)
                    lse[int64_t{t} * p.num_heads + h] =
                        nv > 0 ? float(mx + std::log(sum)) : kNegInf;
            }
        }
    }
}

void write_latent(BlockPool& pool, int layer, const PagedKv& kv, std::span<const int32_t> indptr,
                  std::span<const int64_t> slots, const float* latent) {
    const auto& g = pool.geometry();
    KVSHARD_CHECK(g.kv_factor == 1 && g.num_heads == 1, "write_latent needs a latent pool");
    KVSHARD_CHECK(int(indptr.size()) == kv.batch() + 1, "indptr has ", indptr.size(),
                  " entries for a batch of ", kv.batch());
    const int bs = g.block_size;
    for (int i = 0; i < kv.batch(); ++i) {
        const int64_t nblocks = kv.indptr[i + 1] - kv.indptr[i];
        for (int32_t t = indptr[i]; t < indptr[i + 1]; ++t) {
            const int64_t slot = slots[size_t(t)];
            KVSHARD_CHECK(slot >= 0 && slot < nblocks * bs, "slot ", slot, " outside the ", nblocks,
                          " blocks of sequence ", i);
            store_vector(pool, layer, 0, kv.indices[size_t(kv.indptr[i] + slot / bs)], 0,
                         int(slot % bs), latent + int64_t{t} * g.head_dim);
        }
    }
}

}  // namespace kvshard
