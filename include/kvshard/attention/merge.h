#pragma once
// Exact merge of partial attention results (GUIDE.md, "The physics"; docs/context-parallel.md §2).
//
// A partial result covers the same query rows over one shard of the keys:
//   out: [rows][dim] fp32, softmax-normalised over that shard's keys only;
//   lse: [rows] fp32, natural-log sum of exp(score) over that shard's keys.
// A shard that has no key visible to a row (an empty shard, or every key masked) has lse = -inf:
// it carries weight 0 and its out row is never read (it may hold garbage, even NaN).
// Merging n partials of one row:
//   m = max_i lse_i;  LSE = m + log sum_i exp(lse_i - m);  O = sum_i exp(lse_i - LSE) * O_i.
// When every lse_i is -inf the merged row is lse = -inf and O = 0, never NaN.
#include <cstdint>
#include <span>

namespace kvshard {

// acc := merge(acc, part), row by row. acc_out/part_out: [rows][dim]; acc_lse/part_lse: [rows].
// An accumulator starts as lse = -inf (its out is then ignored and overwritten).
void merge_attention_into(float* acc_out, float* acc_lse, const float* part_out,
                          const float* part_lse, int64_t rows, int dim);

// out/lse := merge of outs.size() partials (each [rows][dim] and [rows]); out may alias none of
// them.
void merge_attention(std::span<const float* const> outs, std::span<const float* const> lses,
                     int64_t rows, int dim, float* out, float* lse);

// Learned attention sinks (gpt-oss): one logit per query head that joins the softmax denominator
// and adds nothing to the output, i.e. a partial of lse = sink and out = 0. out:
// [rows][heads][dim], lse: [rows][heads] (updated to include the sink), sinks: [heads]. Applied
// once, after every shard of keys is merged.
void apply_attention_sinks(float* out, float* lse, int64_t rows, int heads, int dim,
                           const float* sinks);

}  // namespace kvshard
