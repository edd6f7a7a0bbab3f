#pragma once
// Partial causal attention over a shard of positioned keys: the unit of work of ring attention
// and of CP decode. Queries and keys carry their GLOBAL positions; a query at position p sees the
// keys at positions <= p. The result is a partial (O, LSE) to be merged with attention/merge.h.
#include <cstdint>
#include <span>

namespace kvshard {

struct CpAttnShape {
    int num_q_heads = 1;  // query heads computed here
    int num_kv_heads =
        1;  // KV heads held here; query head h reads KV head h / (num_q_heads / num_kv_heads)
    int head_dim = 1;
    float scale = 1.0f;  // usually 1 / sqrt(head_dim)
    // Local attention, as AttentionParams::window / chunked: a query at p also ignores keys
    // before first_visible_position (sliding: p - window + 1; chunked: p - p % window).
    int window = 0;
    bool chunked = false;
    bool operator==(const CpAttnShape&) const = default;
};

// q: [nq][num_q_heads][head_dim], q_pos: [nq]; k, v: [nk][num_kv_heads][head_dim], kv_pos: [nk]
// (any order). out: [nq][num_q_heads][head_dim]; lse: [nq][num_q_heads], natural log; a row with no
// visible key gets lse = -inf and out = 0.
// The first position a query at `pos` sees under the shape's window (0 without one).
int64_t cp_first_visible(const CpAttnShape& shape, int64_t pos);
void cp_partial_attention(const CpAttnShape& shape, const float* q, std::span<const int64_t> q_pos,
                          const float* k, const float* v, std::span<const int64_t> kv_pos,
                          float* out, float* lse);

}  // namespace kvshard
