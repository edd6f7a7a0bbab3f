#pragma once
// Paged decode attention on the device with the per-head log-sum-exp, and the LSE merge of
// partial results (docs/cuda.md, "Decode attention"). The same semantics as the host kernels
// (attention/paged_attention.h, attention/merge.h): one query row per sequence at its last
// position, seeing every KV token of its sequence, GQA (query head h reads KV head
// h / (num_q_heads / num_kv_heads)), natural-log LSE, -inf for a sequence with no token.
//
// Plan, then run (FlashInfer's decode plan): DeviceDecode splits each sequence's tokens into
// chunks of chunk_tokens, one thread block per (chunk, KV head) computes the chunk's partial
// output and LSE for the head's query heads, and a second kernel merges each sequence's chunks.
// bf16 / fp16 pools run on tensor cores with q and the probabilities each split into two halves
// of the pool's type (about 16 bits of mantissa), fp32 pools on CUDA cores; both accumulate in
// fp32 and agree with the host kernel within the tests' 2e-4 (fp16 pools: q * scale * log2(e)
// must stay inside fp16's range, |x| < 65504, as for any fp16 attention kernel).
//
// Tensors in device memory, row-major, fp32:
//   q, out: [batch][num_q_heads][head_dim]   lse: [batch][num_q_heads]
#include <cstdint>
#include <span>
#include <string>

#include "kvshard/cache/paged_kv.h"
#include "kvshard/cuda/device.h"

namespace kvshard::cuda {

struct DecodeParams {
    int num_q_heads = 1;
    int num_kv_heads = 1;  // the pool's heads; divides num_q_heads
    int head_dim = 1;      // the pool's head_dim
    float scale = 1.0f;    // usually 1/sqrt(head_dim)
};

// What the kernels cover: head_dim 64, 128 or 256; HND or NHD pages with K and V (kv_factor 2);
// bf16 or fp16 pools (tensor cores) with 1 to 16 query heads per KV head, fp32 pools (CUDA cores)
// with 1, 2, 4 or 8. "" when `geometry` and `p` are covered, else what is not and what would be.
std::string decode_support_error(const PageGeometry& geometry, const DecodeParams& p);

// "" when kv is a batch the kernels can read from a pool of num_blocks blocks of block_size
// tokens: indptr from 0 to the number of indices, never decreasing; each last_page_len 1 to
// block_size (0 for a sequence without blocks); every block id in [0, num_blocks). Else what is
// wrong, with the sequence or index and the value.
std::string paged_kv_error(const PagedKv& kv, int block_size, int64_t num_blocks);

// One plan serves one run at a time: run() writes the chunks' partial results into the plan's
// own buffers, so two runs of one plan on different streams would overwrite each other's (give
// each concurrent layer or stream its own plan).
class DeviceDecode {
  public:
    // The plan for a batch: its block tables (kv, uploaded once) over pools of `geometry`.
    // chunk_tokens 0 picks one: the multiple of 64 tokens that splits the longest sequence
    // evenly and minimises waves of thread blocks x (tiles per block + a block's fixed cost)
    // (docs/cuda.md). Error when decode_support_error says so, or a block id of kv is outside
    // num_blocks.
    DeviceDecode(const PagedKv& kv, const PageGeometry& geometry, int64_t num_blocks,
                 const DecodeParams& p, int chunk_tokens = 0);
    int chunk_tokens() const { return chunk_tokens_; }
    int64_t work_items() const { return work_items_; }  // (sequence, chunk) pairs
    int batch() const { return batch_; }
    // KV bytes the kernels read (every token of every sequence, K and V of every KV head).
    int64_t kv_bytes() const { return kv_bytes_; }

    // Attention of layer `layer` of `pool` (the geometry and block count of the plan; Error
    // otherwise); q, out, lse device pointers as above. Asynchronous on `stream`.
    void run(const DevicePool& pool, int layer, const float* q, float* out, float* lse,
             void* stream = nullptr);

  private:
    PageGeometry geometry_;
    int64_t num_blocks_ = 0;
    DecodeParams params_;
    int batch_ = 0;
    int chunk_tokens_ = 0;
    int64_t work_items_ = 0;
    int64_t kv_bytes_ = 0;
    DeviceBuffer indptr_, indices_, last_page_len_;  // the PagedKv
    DeviceBuffer work_;                              // per work item: sequence, chunk (int32 x2)
    DeviceBuffer chunk_indptr_;                      // per sequence: its first work item
    DeviceBuffer partial_out_, partial_lse_;         // [work item][num_q_heads][head_dim], [..]
};

// out/lse := the merge of outs.size() partials (device pointers, each [rows][dim] and [rows]):
// m = max lse_i, LSE = m + log sum exp(lse_i - m), O = sum exp(lse_i - LSE) O_i; all -inf gives
// lse -inf and O = 0. Asynchronous on `stream`.
void merge_attention(std::span<const float* const> outs, std::span<const float* const> lses,
                     int64_t rows, int dim, float* out, float* lse, void* stream = nullptr);

}  // namespace kvshard::cuda
