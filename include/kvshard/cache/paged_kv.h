#pragma once
// PagedKv: the one description of a batch of sequences' KV in a BlockPool (FlashInfer's
// paged_kv_t), shared by attention, pack/unpack and transfer.
//   Sequence i uses blocks indices[indptr[i] .. indptr[i+1]) in order; its last block holds
//   last_page_len[i] tokens (1..block_size), every other block is full.
//   Token j of sequence i lives in block indices[indptr[i] + j / block_size] at slot j %
//   block_size.
#include <cstdint>
#include <vector>

#include "kvshard/cache/block_pool.h"

namespace kvshard {

struct PagedKv {
    std::vector<int32_t> indptr{0};      // batch + 1 entries
    std::vector<int32_t> indices;        // block ids
    std::vector<int32_t> last_page_len;  // batch entries

    int batch() const { return static_cast<int>(last_page_len.size()); }
    // Tokens of sequence i.
    int64_t seq_len(int i, int block_size) const {
        const int32_t n = indptr[i + 1] - indptr[i];
        return n == 0 ? 0 : int64_t{n - 1} * block_size + last_page_len[i];
    }
    // Appends a sequence given its block table and token count.
    void add_sequence(const std::vector<int32_t>& blocks, int64_t num_tokens, int block_size) {
        indices.insert(indices.end(), blocks.begin(), blocks.end());
        indptr.push_back(static_cast<int32_t>(indices.size()));
        const int64_t rem = num_tokens % block_size;
        last_page_len.push_back(
            num_tokens == 0 ? 0 : static_cast<int32_t>(rem == 0 ? block_size : rem));
    }
};

}  // namespace kvshard
