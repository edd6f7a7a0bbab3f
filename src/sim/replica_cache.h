#pragma once
// One replica's KV cache as the simulator sees it: admit a request (share its cached prefix, take
// blocks for the rest), release it (its hashed blocks stay cached, LRU), report KV events to the
// router's index.
#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvshard/cache/block_hash.h"
#include "kvshard/router/kv_index.h"

namespace kvshard::sim_detail {

class ReplicaCache {
  public:
    ReplicaCache(int64_t capacity_blocks, int block_tokens);

    // Sequence `seq`: prompt of prompt_tokens with one hash per full prompt block (full_hashes),
    // then output_tokens more (never shared). Returns the cached prefix in blocks, or nullopt when
    // the blocks are not available now (nothing changed).
    std::optional<int64_t> admit(int64_t seq, std::span<const BlockHash> full_hashes,
                                 int64_t prompt_tokens, int64_t output_tokens);
    void release(int64_t seq);
    // Blocks held by admitted sequences.
    int64_t used_blocks() const;
    int64_t capacity_blocks() const { return capacity_; }
    int64_t evictions() const { return evictions_; }
    // Exact routing: forward this cache's KV events to index as replica `replica`.
    void publish_to(KvIndex* index, int replica) {
        index_ = index;
        replica_ = replica;
    }

  private:
    struct Entry {
        int32_t ref = 0;
        std::list<BlockHash>::iterator lru;  // valid when ref == 0
    };
    struct Seq {
        std::vector<BlockHash> hashes;
        int64_t unhashed = 0;
    };
    int64_t capacity_;
    int block_tokens_;
    int64_t used_hashed_ = 0, unhashed_ = 0, evictions_ = 0;
    std::unordered_map<BlockHash, Entry, BlockHashHasher> entries_;
    std::list<BlockHash> lru_;  // front: least recently used
    std::unordered_map<int64_t, Seq> seqs_;
    KvIndex* index_ = nullptr;
    int replica_ = 0;
};

}  // namespace kvshard::sim_detail
