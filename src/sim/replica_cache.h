#pragma once
// One replica's KV cache as the simulator sees it: a BlockManager (the real prefix cache with LRU
// eviction) plus the simulator's admission rule: a request is admitted only when its prompt and its
// whole output fit now, so a running request never needs preemption.
#include <cstdint>
#include <optional>
#include <span>

#include "kvshard/cache/block_manager.h"
#include "kvshard/router/kv_index.h"

namespace kvshard::sim_detail {

class ReplicaCache {
  public:
    // eagle_block_drop: the engine drafts with EAGLE/MTP and drops the last block of each hit
    // (vllm_eagle_block_drop).
    ReplicaCache(int64_t capacity_blocks, int block_tokens, bool eagle_block_drop = false);
    ReplicaCache(ReplicaCache&&) = default;

    // Sequence `seq`: a prompt of prompt_tokens with one hash per full prompt block (full_hashes),
    // then output_tokens more (never shared). Returns the cached prefix in blocks, as vLLM takes it
    // (at most (prompt_tokens - 1) / block_tokens: the last prompt token is always computed; one
    // block fewer than the cached run with eagle_block_drop), or
    // nullopt when the blocks are not available now (nothing changed).
    std::optional<int64_t> admit(int64_t seq, std::span<const BlockHash> full_hashes,
                                 int64_t prompt_tokens, int64_t output_tokens);
    void release(int64_t seq) { manager_.free(seq); }
    // Blocks held by admitted sequences.
    int64_t used_blocks() const { return manager_.metrics().used_blocks; }
    int64_t capacity_blocks() const { return manager_.num_blocks(); }
    int64_t evictions() const { return manager_.metrics().evictions; }
    // Exact routing: forward this cache's KV events to `index` as replica `replica`. The index
    // must outlive this object.
    void publish_to(KvIndex* index, int replica);

  private:
    BlockManager manager_;
    bool eagle_block_drop_;
};

}  // namespace kvshard::sim_detail
