#pragma once
// CPU attention over the paged KV of a BlockPool, for causal prefill and decode, with
// an online (numerically stable) softmax and, on request, the log-sum-exp of every query row
// (docs/model.md). The pool may hold fp32, bf16, fp16 or fp8 e4m3 (docs/cache.md, "Element
// types"): attention computes in fp32 over the stored values (converted, fp8 times its scale),
// write_kv converts with store_vector's rounding and scale rule.
//
// Tensors (row-major, contiguous):
//   q, out: [rows][num_q_heads][head_dim]     k, v (write_kv): [rows][num_kv_heads][head_dim]
//   lse:    [rows][num_q_heads], natural log of sum_j exp(scale * q.k_j); -inf for a row that sees
//   no key
// GQA: query head h (local) reads KV head h / (num_q_heads / num_kv_heads) (local), so MHA, GQA and
// MQA are the cases num_q_heads/num_kv_heads = 1, > 1 and = num_q_heads.
#include <cstdint>
#include <span>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/cache/paged_kv.h"

namespace kvshard {

struct AttentionParams {
    int num_q_heads = 1;   // query heads in q and out
    int num_kv_heads = 1;  // KV heads in the pool pages; divides num_q_heads
    int head_dim = 1;      // equal to the pool's head_dim
    float scale = 1.0f;    // usually 1/sqrt(head_dim)
    bool causal = true;    // false: every row sees every KV token of its sequence
    // Local attention (with causal): a row at position p also ignores keys at positions
    //   window > 0, !chunked: <= p - window   (sliding window: itself and window - 1 before)
    //   window > 0,  chunked: <  p - p % window (chunked local: the tokens of its own chunk)
    // so the kernels never touch the blocks before the first visible key (a windowed group's
    // blocks there may be freed: docs/model.md).
    int window = 0;
    bool chunked = false;
};

// The first position a row at `pos` sees under p's window (0 without one).
int64_t first_visible_position(const AttentionParams& p, int64_t pos);

// The query rows of a batch over a PagedKv. Sequence i owns rows [q_indptr[i], q_indptr[i+1]).
// Row t has position q_pos[t]; under `causal` it sees the KV tokens of its sequence whose position
// is
// <= q_pos[t]. KV token (slot) j of a sequence has position j, unless kv_pos is given: then slot j
// of sequence i has position kv_pos[kv_pos_indptr[i] + j], ascending within the sequence (context
// parallelism: a rank holds a subset of the positions).
struct QueryBatch {
    std::vector<int32_t> q_indptr{0};
    std::vector<int64_t> q_pos;
    std::vector<int64_t> kv_pos;         // optional
    std::vector<int64_t> kv_pos_indptr;  // batch + 1 entries when kv_pos is given

    int batch() const { return static_cast<int>(q_indptr.size()) - 1; }
    int64_t rows() const { return q_indptr.back(); }
    // Appends a sequence whose `n` rows have positions first_pos, first_pos + 1, ...
    void add_sequence(int64_t n, int64_t first_pos) {
        for (int64_t t = 0; t < n; ++t) q_pos.push_back(first_pos + t);
        q_indptr.push_back(static_cast<int32_t>(q_pos.size()));
    }
};

// Attention of every query row over its sequence's KV in `layer` of `pool`; `lse` may be null.
void paged_attention(const BlockPool& pool, int layer, const PagedKv& kv, const QueryBatch& qb,
                     const AttentionParams& p, const float* q, float* out, float* lse);

// The same, computed the plain way (one row, one key at a time, two passes). The tests' reference.
void paged_attention_reference(const BlockPool& pool, int layer, const PagedKv& kv,
                               const QueryBatch& qb, const AttentionParams& p, const float* q,
                               float* out, float* lse);

// Writes K and V of row t (of sequence i, rows [indptr[i], indptr[i+1])) to slot slots[t] of
// sequence i in `layer`. The slots' blocks must already be in kv (slot < blocks * block_size).
void write_kv(BlockPool& pool, int layer, const PagedKv& kv, std::span<const int32_t> indptr,
              std::span<const int64_t> slots, const float* k, const float* v);

// Multi-head latent attention in the absorbed form (DeepSeek-V2/V3; docs/model.md): the pool is
// kv_factor 1 with one "head" of latent_dim + rope_dim per token, the row [c | k_pe]. Every query
// head scores q_h . [c | k_pe] and takes the softmax-weighted sum of c (the first latent_dim
// elements of the row) as its output; the caller projects it through each head's W_uv.
//   q: [rows][num_heads][latent_dim + rope_dim]   out: [rows][num_heads][latent_dim]
//   lse: [rows][num_heads] or null. Causal, positions as in paged_attention (kv_pos for CP).
struct MlaParams {
    int num_heads = 1;
    int latent_dim = 1;  // kv_lora_rank
    int rope_dim = 0;    // qk_rope_head_dim
    float scale = 1.0f;  // 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)
};
void mla_attention(const BlockPool& pool, int layer, const PagedKv& kv, const QueryBatch& qb,
                   const MlaParams& p, const float* q, float* out, float* lse);

// Writes row t's latent [c | k_pe] (latent[t][head_dim of the pool]) to slot slots[t] of its
// sequence in `layer` of a kv_factor-1 pool.
void write_latent(BlockPool& pool, int layer, const PagedKv& kv, std::span<const int32_t> indptr,
                  std::span<const int64_t> slots, const float* latent);

}  // namespace kvshard
