#pragma once
// Launchers of the kernels (*.cu), called by the host code of the backend. Plain types only, so
// that nvcc compiles the kernels without the library's C++20 headers.
#include <cuda_runtime.h>

#include <cstdint>

namespace kvshard::cuda::detail {

// Mirrors CopyEntry (copy.h): six int64 fields.
struct RawCopyEntry {
    long long src, src_step, dst, dst_step, len, count;
};

void launch_copy(const RawCopyEntry* entries, long long count, const unsigned char* src,
                 unsigned char* dst, int sm_count, cudaStream_t stream);

enum class ElemType { kFp32 = 0, kBf16 = 1, kFp16 = 2 };

struct DecodeLaunch {
    const unsigned char* pool;  // the arena
    long long num_blocks;
    long long page_elems;  // elements per page
    int layer;
    int kv_factor;
    int block_size;
    int num_kv_heads;  // of the pool
    int num_q_heads;
    int head_dim;
    int head_stride;   // elements between heads of one token (HND: bs*D; NHD: D)
    int token_stride;  // elements between tokens of one head (HND: D; NHD: H*D)
    ElemType elem;
    float scale;
    const int* indptr;
    const int* indices;
    const int* last_page_len;
    const int* work;  // [work item][2]: sequence, chunk
    long long work_items;
    const int* chunk_indptr;  // [batch + 1]: work items of each sequence
    int batch;
    int chunk_tokens;
    const float* q;
    float* partial_out;  // [work item][num_q_heads][head_dim]
    float* partial_lse;  // [work item][num_q_heads]
    float* out;
    float* lse;
};

// False when (head_dim, group size, elem) has no kernel.
bool decode_supported(int head_dim, int group, ElemType elem);
// The decode kernel and the merge of each sequence's chunks; the first launch error.
cudaError_t launch_decode(const DecodeLaunch& a, cudaStream_t stream);

void launch_merge(const float* const* outs, const float* const* lses, int n, long long rows,
                  int dim, float* out, float* lse, cudaStream_t stream);

}  // namespace kvshard::cuda::detail
