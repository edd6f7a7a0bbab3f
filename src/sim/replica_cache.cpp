#include "sim/replica_cache.h"

#include <algorithm>

namespace kvshard::sim_detail {

ReplicaCache::ReplicaCache(int64_t capacity_blocks, int block_tokens, bool eagle_block_drop)
    : manager_(BlockManagerConfig{capacity_blocks, block_tokens, /*enable_prefix_cache=*/true}),
      eagle_block_drop_(eagle_block_drop) {}

std::optional<int64_t> ReplicaCache::admit(int64_t seq, std::span<const BlockHash> full_hashes,
                                           int64_t prompt_tokens, int64_t output_tokens) {
    // vLLM recomputes the last prompt token (KVCacheManager.get_computed_blocks caps a hit at
    // num_tokens - 1): a fully cached prompt of k blocks shares k - 1 and computes the last one
    // into a fresh block.
    int64_t max_hit = vllm_max_cache_hit_blocks(prompt_tokens, manager_.block_size());
    // EAGLE/MTP: vLLM walks the cached run up to that cap, then pops its last block
    // (FullAttentionManager.find_longest_cache_hit, drop_eagle_block) and computes it again into a
    // fresh block, which cache_full_blocks registers beside the cached one as a copy of its hash
    // (vllm/v1/core/block_pool.py); the prompt's later blocks chain on. The BlockManager does the
    // same when the hit is capped one block short of the run.
    if (eagle_block_drop_) {
        const size_t walk = std::min(full_hashes.size(), static_cast<size_t>(max_hit));
        const auto run =
            static_cast<int64_t>(manager_.lookup_hashes(full_hashes.first(walk)).blocks.size());
        max_hit = std::max<int64_t>(0, run - 1);
    }
    // can_allocate_hashes counts the blocks of prompt + output, less the cached prefix that is
    // already in use, against the free + evictable blocks.
    if (!manager_.can_allocate_hashes(full_hashes, prompt_tokens + output_tokens, max_hit))
        return std::nullopt;
    const AllocResult r = manager_.allocate_with_hashes(seq, full_hashes, prompt_tokens, max_hit);
    manager_.append_tokens(seq, output_tokens);
    return r.cached_blocks;
}

void ReplicaCache::publish_to(KvIndex* index, int replica) {
    manager_.subscribe([index, replica](const KvEvent& e) { index->apply(replica, e); });
}

}  // namespace kvshard::sim_detail
