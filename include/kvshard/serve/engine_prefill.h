#pragma once
// A prefill whose KV lands in memory the caller owns (an engine's KV tensors, numpy arrays): the
// reference model (exec/rank_model.h) runs one prompt over every rank of a layout, each rank's
// pools built over the caller's memory (BlockPool's ExternalMemory), the prompt's tokens written to
// the blocks the caller's block table names. What a transfer then reads from those pools is what
// the same prefill on kvshard's own pools would have written, byte for byte (the tests compare
// the two).
#include <cstdint>
#include <span>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/weights.h"

namespace kvshard {

struct EnginePrefillOptions {
    int block_size = 16;
    PageOrder order = PageOrder::kHnd;
};

// Runs the prefill of `tokens` under layout.parallel (dp = 1, cp = 1; tp, pp and ep any) on
// threads, one per rank. memory[r][i]: rank r's pool i (one per KV group the rank holds, in
// kv_groups order, a whole number of blocks of the geometry rank_page_geometry gives, every one of
// them the pool's: the page offsets depend on the block count), holding every block id the table
// names.
// block_table: the sequence's blocks (ceil(len / block_size) distinct ids), the same on every
// rank. Returns the last token's [vocab] logits. Error naming what is wrong before anything runs.
std::vector<float> prefill_into_memory(const KvLayout& layout, const TensorSource& weights,
                                       std::span<const int32_t> tokens,
                                       std::span<const int32_t> block_table,
                                       const std::vector<std::vector<ExternalMemory>>& memory,
                                       const EnginePrefillOptions& opt = {});

// The same prefill on kvshard's own pools (of num_blocks blocks each): returns the logits and, in
// `pools_out[r][i]`, a copy of rank r's pool i after it.
std::vector<float> prefill_into_own_pools(
    const KvLayout& layout, const TensorSource& weights, std::span<const int32_t> tokens,
    std::span<const int32_t> block_table, int64_t num_blocks,
    std::vector<std::vector<std::vector<std::byte>>>& pools_out,
    const EnginePrefillOptions& opt = {});

}  // namespace kvshard
