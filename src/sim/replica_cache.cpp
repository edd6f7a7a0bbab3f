#include "sim/replica_cache.h"

namespace kvshard::sim_detail {

ReplicaCache::ReplicaCache(int64_t capacity_blocks, int block_tokens, bool eagle_block_drop)
    : manager_(BlockManagerConfig{capacity_blocks, block_tokens, /*enable_prefix_cache=*/true}),
      eagle_block_drop_(eagle_block_drop) {}

std::optional<int64_t> ReplicaCache::admit(int64_t seq, std::span<const BlockHash> full_hashes,
                                           int64_t prompt_tokens, int64_t output_tokens) {
    // can_allocate_hashes counts the blocks of prompt + output, less the cached prefix that is
    // already in use, against the free + evictable blocks.
    // vLLM recomputes the last prompt token (KVCacheManager.get_computed_blocks caps a hit at
    // num_tokens - 1): a fully cached prompt of k blocks shares k - 1 and computes the last one
    // into a fresh block.
    const int64_t max_hit = vllm_max_cache_hit_blocks(prompt_tokens, manager_.block_size());
    if (!manager_.can_allocate_hashes(full_hashes, prompt_tokens + output_tokens, max_hit))
        return std::nullopt;
    const AllocResult r = manager_.allocate_with_hashes(seq, full_hashes, prompt_tokens, max_hit);
    manager_.append_tokens(seq, output_tokens);
    // EAGLE/MTP: vLLM walks the cached run up to the cap, then pops its last block
    // (FullAttentionManager.find_longest_cache_hit, drop_eagle_block) and computes it again. vLLM
    // caches the recomputed block beside the first under the same hash, and the prompt's later
    // blocks chain on; here the request shares the cached block instead (the BlockManager
    // registers no second copy and would stop the chain there), so the same hashes stay findable
    // and the request holds one block less than in vLLM. The hit, the tokens prefilled, is the
    // popped run.
    if (eagle_block_drop_ && r.cached_blocks > 0) return r.cached_blocks - 1;
    return r.cached_blocks;
}

void ReplicaCache::publish_to(KvIndex* index, int replica) {
    manager_.subscribe([index, replica](const KvEvent& e) { index->apply(replica, e); });
}

}  // namespace kvshard::sim_detail
