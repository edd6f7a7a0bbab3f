#pragma once
// BlockManager: which blocks hold which sequence's tokens, and the prefix cache (docs/cache.md).
// Metadata only: ids, hashes, reference counts; no KV bytes and no pointers into pools. One manager
// drives a whole TP x PP group: block id b means the same tokens on every rank of the group, and
// each rank keeps its own heads and layers of those tokens in page b of its own BlockPool.
//
// Every block is in exactly one state:
//   used:   referenced by >= 1 sequence (ref_count > 0); never evicted;
//   cached: ref_count 0, its hash is in the prefix index; evictable (LRU);
//   free:   ref_count 0, no hash.
// Only full blocks are hashed and shared. The prefix index follows vLLM's BlockPool
// (vllm/v1/core/block_pool.py: BlockHashToBlockMap, cache_full_blocks, get_cached_block,
// _maybe_evict_cached_block; docs/cache.md, "Copies of one hash"):
//  - every new full block of a sequence is registered (BlockStored), also when another block
//    already holds the same hash (the same prompt computed by two sequences at once, or blocks
//    past a capped hit): vLLM never de-duplicates, so that block tables stay append-only. Such
//    blocks are copies of one hash; each is registered, cached and evicted on its own;
//  - a lookup of a hash finds its oldest registered copy (vLLM's get_one_block: the first
//    inserted block of the hash's dict that is still there);
//  - evicting a copy publishes BlockRemoved for its hash, even when other copies stay; they stay
//    findable.
// Block i is registered only after the sequence's block i - 1 is (it was a hit or registered
// first, used blocks are never evicted, and clear_cache, like vLLM's reset_prefix_cache, refuses
// while blocks are used). So a registered block's parent hash is always registered:
// lookups never reach a block whose prefix is gone, and eviction (LRU over the cached blocks, a
// sequence's blocks released tail first) always takes a chain's tail before the last copy of its
// head.
//
// A block is *computed* once its KV is written. With deferred_commit (an executor's manager) a
// sequence's blocks are computed only when commit() says so, after the forward step that wrote
// them; before that they are not registered, so no other sequence can hit a block that holds
// nothing yet (docs/cache.md, "Commit"). Without it (a manager with no KV behind it: simulators,
// planners) allocate and append commit at once. A registered block is always computed.
//
// Not thread-safe: one scheduler thread owns a manager.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvshard/cache/block_hash.h"
#include "kvshard/cache/kv_events.h"
#include "kvshard/cache/paged_kv.h"
#include "kvshard/common/error.h"

namespace kvshard {

using BlockId = int32_t;
using SeqId = int64_t;

// Not enough free or evictable blocks right now (the request would fit an idle pool): the caller
// may retry after freeing sequences. Nothing was changed.
class OutOfBlocksError : public Error {
  public:
    using Error::Error;
};

struct BlockManagerConfig {
    int64_t num_blocks = 0;  // blocks of every rank's pool
    int block_size = 16;     // tokens per block
    bool enable_prefix_cache = true;
    // true: full blocks become computed and findable only at commit() (the executor calls it after
    // the step that wrote their KV); false: at allocate / append (no KV behind the manager).
    bool deferred_commit = false;
};

enum class BlockState { kFree, kUsed, kCached };

struct CacheMetrics {
    int64_t num_blocks = 0;
    int64_t used_blocks = 0;    // referenced by a sequence
    int64_t free_blocks = 0;    // unreferenced, no hash
    int64_t cached_blocks = 0;  // unreferenced, hash known: evictable
    int64_t hashed_blocks = 0;  // registered in the prefix index (used or cached), copies each
    int64_t num_sequences = 0;
    int64_t queries = 0;        // allocations that consulted the prefix cache
    int64_t query_tokens = 0;   // prompt tokens of those allocations
    int64_t hit_tokens = 0;     // of which found in the cache
    int64_t evictions = 0;      // cached blocks reclaimed for new data
    int64_t stored_blocks = 0;  // blocks registered in the index so far

    double token_hit_rate() const {
        return query_tokens == 0 ? 0.0 : static_cast<double>(hit_tokens) / query_tokens;
    }
};

struct PrefixMatch {
    std::vector<BlockId> blocks;  // the longest cached prefix of the query, in whole blocks
    int64_t num_tokens = 0;       // blocks.size() * block_size
};

struct AllocResult {
    int64_t cached_tokens = 0;  // leading tokens whose KV is already in shared blocks (skip them)
    int64_t cached_blocks = 0;  // = cached_tokens / block_size
    int64_t new_blocks = 0;     // fresh blocks (not shared): the rest of the sequence
};

class BlockManager {
  public:
    // Throws Error when num_blocks < 1 or block_size < 1.
    explicit BlockManager(BlockManagerConfig config);

    int block_size() const { return config_.block_size; }
    int64_t num_blocks() const { return config_.num_blocks; }
    bool prefix_cache_enabled() const { return config_.enable_prefix_cache; }
    bool deferred_commit() const { return config_.deferred_commit; }
    // Blocks an allocation can take now: free + cached (evictable).
    int64_t num_available_blocks() const { return num_free_ + num_cached_; }
    // Blocks needed to hold num_tokens tokens.
    int64_t blocks_for_tokens(int64_t num_tokens) const {
        return (num_tokens + config_.block_size - 1) / config_.block_size;
    }

    // ---- prefix lookup (const: changes neither state nor metrics) ----
    // Each hash finds its oldest registered copy (see above); the walk stops at the first miss.
    PrefixMatch lookup(std::span<const int32_t> tokens,
                       std::span<const std::byte> extra_keys = {}) const;
    // The same for a query given as chained block hashes (one per full block, head first).
    PrefixMatch lookup_hashes(std::span<const BlockHash> block_hashes) const;

    // ---- sequences ----
    // New sequence `seq` holding `tokens`: shares the longest cached prefix, allocates the rest,
    // registers its new full blocks in the prefix index (with deferred_commit: at commit()). Throws
    // Error when seq exists or the request needs more blocks than the pool has, OutOfBlocksError
    // when they are not available now. max_cached_blocks >= 0 caps the shared prefix (e.g. (len -
    // 1) / block_size, so that the last prompt token is computed and gives logits; or an agreed
    // prefix across ranks); blocks past the cap are allocated fresh even when cached. -1: no cap.
    AllocResult allocate(SeqId seq, std::span<const int32_t> tokens,
                         std::span<const std::byte> extra_keys = {},
                         int64_t max_cached_blocks = -1);
    // The same with the caller's chained block hashes instead of token ids (e.g. a trace's hash
    // ids). block_hashes holds one hash per full block of num_tokens (a hash for a trailing partial
    // block may be included and is ignored). Later appends to this sequence are never hashed.
    AllocResult allocate_with_hashes(SeqId seq, std::span<const BlockHash> block_hashes,
                                     int64_t num_tokens, int64_t max_cached_blocks = -1);
    // The KV of the sequence's tokens [0, num_computed_tokens) is written (on this rank: after the
    // forward step that wrote it returned; see docs/cache.md "Commit" for TP / PP groups): its full
    // blocks become computed and, as the registration rule allows, findable (BlockStored). A count
    // at or below the sequence's committed count changes nothing (KV is never un-written). Throws
    // Error for an unknown sequence or a count outside [0, num_tokens(seq)]. Without
    // deferred_commit every token is committed already and this is a no-op.
    void commit(SeqId seq, int64_t num_computed_tokens);

    // Whether allocate / allocate_with_hashes would succeed now.
    bool can_allocate(std::span<const int32_t> tokens, std::span<const std::byte> extra_keys = {},
                      int64_t max_cached_blocks = -1) const;
    bool can_allocate_hashes(std::span<const BlockHash> block_hashes, int64_t num_tokens,
                             int64_t max_cached_blocks = -1) const;

    // Appends tokens (e.g. decode output) to a sequence; a block that becomes full is hashed and
    // registered (with deferred_commit: at commit()) when the sequence's token ids are all known.
    // Throws Error for an unknown sequence, OutOfBlocksError when a new block is needed and none is
    // available (nothing changed).
    void append(SeqId seq, std::span<const int32_t> tokens);
    // Appends `count` tokens whose ids are not given: their blocks are never hashed or shared.
    void append_tokens(SeqId seq, int64_t count);
    bool can_append(SeqId seq, int64_t count) const;

    // Releases the sequence's blocks (tail first); hashed blocks stay cached and evictable.
    // Throws Error for a sequence that is not allocated (unknown, or already freed).
    void free(SeqId seq);

    bool contains(SeqId seq) const { return seqs_.find(seq) != seqs_.end(); }
    std::span<const BlockId> block_table(SeqId seq) const;
    int64_t num_tokens(SeqId seq) const;
    // Leading tokens of the sequence whose KV is committed (shared prefix hits count as committed).
    int64_t num_committed_tokens(SeqId seq) const;
    // Hashes of the sequence's full blocks, head first, as far as they are known.
    std::span<const BlockHash> block_hashes(SeqId seq) const;
    // FlashInfer-style description of these sequences' blocks (PagedKv).
    PagedKv paged_kv(std::span<const SeqId> seqs) const;

    // Drops every hash from the index, so that cached blocks become free, and publishes
    // AllCleared; returns true. While any block is used it refuses: returns false and changes and
    // publishes nothing (vLLM's BlockPool.reset_prefix_cache, vllm/v1/core/block_pool.py).
    [[nodiscard]] bool clear_cache();

    // ---- events and metrics ----
    // Callbacks run synchronously at the end of the operation that caused the events; they may
    // query the manager but must not modify it. Returns an id for unsubscribe.
    int subscribe(KvEventCallback callback);
    void unsubscribe(int subscription_id);
    uint64_t next_event_seq() const { return next_event_seq_; }
    CacheMetrics metrics() const;

    // ---- introspection (tests, debugging) ----
    BlockState block_state(BlockId b) const;
    int32_t ref_count(BlockId b) const;
    // Whether block b holds a full block of committed KV (always for a cached block, never for a
    // free one).
    bool block_computed(BlockId b) const;
    // The hash under which block b is registered (as a copy or the only block of that hash);
    // nullopt when it is not in the index.
    std::optional<BlockHash> registered_hash(BlockId b) const;
    // Cached blocks, least recently used first (the eviction order).
    std::vector<BlockId> eviction_order() const;
    // The hash of every registered block (used or cached), in block id order; a hash held by
    // several copies appears once per copy: with next_event_seq(), the state a subscriber that
    // joins late starts from (KvEventIndex::sync).
    std::vector<BlockHash> registered_hashes() const;
    // Checks every structural invariant (states partition the pool, reference counts equal the
    // block tables' references, the index, the copy rings and LRU agree, parents of registered
    // blocks are registered); throws InternalError naming the first violation.
    void check_invariants() const;

  private:
    // Open-addressing map hash -> block id (linear probing, backward-shift deletion, load <= 1/2):
    // no allocation per insert, one cache line per probe.
    class HashIndex {
      public:
        explicit HashIndex(size_t max_entries);
        BlockId find(const BlockHash& h) const;      // -1 when absent
        void insert(const BlockHash& h, BlockId b);  // h must be absent
        void assign(const BlockHash& h, BlockId b);  // h must be present
        void erase(const BlockHash& h);              // h must be present
        void clear();
        size_t size() const { return size_; }
        bool empty() const { return size_ == 0; }

      private:
        struct Slot {
            BlockHash key;
            BlockId value = -1;  // -1: empty
        };
        size_t home(const BlockHash& h) const;
        std::vector<Slot> slots_;
        size_t mask_ = 0;
        int shift_ = 0;
        size_t size_ = 0;
    };

    struct Block {
        int32_t ref = 0;
        bool registered = false;
        BlockHash hash;    // valid when registered
        BlockHash parent;  // valid when registered and has_parent
        bool has_parent = false;
        BlockId lru_prev = -1, lru_next = -1;
        bool in_lru = false;
        bool computed = false;  // full and its KV committed; implied by registered
        // Registered blocks of one hash (copies) form a ring, oldest first: the index names the
        // oldest, dup_prev of the oldest is the newest. -1 when not registered.
        BlockId dup_prev = -1, dup_next = -1;
    };
    struct Seq {
        std::vector<BlockId> blocks;
        std::vector<BlockHash> hashes;  // of blocks[0 .. hashes.size()), all full
        int64_t num_tokens = 0;
        bool hashable = true;       // token ids of every block so far are known
        std::vector<int32_t> tail;  // token ids of the partial last block (when hashable)
        std::vector<std::byte> extra_keys;
        int64_t committed_tokens = 0;  // tokens [0, committed_tokens) have their KV written
    };

    const Seq& seq_or_throw(SeqId seq) const;
    Seq& seq_or_throw(SeqId seq);
    // The blocks of the leading hashes registered in the index, at most max_hits (-1: any), into
    // `hits`.
    void match(std::span<const BlockHash> hashes, int64_t max_hits,
               std::vector<BlockId>& hits) const;
    // Blocks an allocation of num_tokens sharing `hits` takes from free + cached; throws Error
    // when the pool is too small for it.
    int64_t blocks_needed(int64_t num_tokens, std::span<const BlockId> hits) const;
    AllocResult allocate_impl(SeqId seq, std::span<const BlockHash> hashes, int64_t num_tokens,
                              int64_t max_cached_blocks);
    BlockId take_block();  // from the free list, else evicts the LRU cached block
    // Appends count tokens' worth of fresh blocks to s (checks pool size and availability first,
    // changing nothing on error), then opens the event batch (begin_op).
    void grow(SeqId seq, Seq& s, int64_t count);
    void release_block(BlockId b);
    // Registers the sequence's full blocks [from, min(to, hashes.size())) where the chain allows.
    void register_blocks(Seq& s, size_t from, size_t to);
    // Marks tokens [committed_tokens, n) committed: their full blocks computed, then registered.
    void commit_impl(Seq& s, int64_t n);
    void unregister(BlockId b);
    // Adds registered block b (hash set) behind the copies of its hash / takes it out of them.
    void index_link(BlockId b);
    void index_unlink(BlockId b);
    void lru_push_back(BlockId b);
    void lru_remove(BlockId b);
    void begin_op();
    void flush_events();
    // The event to add to: the open one of this kind, or a new one (always when force_new). The
    // sequence number advances even when no one listens; then the result is nullptr.
    KvEvent* event_for(KvEventKind kind, bool force_new);

    BlockManagerConfig config_;
    std::vector<Block> blocks_;
    std::vector<BlockId> free_list_;         // back() is handed out next
    BlockId lru_head_ = -1, lru_tail_ = -1;  // head: least recently used
    int64_t num_free_ = 0, num_cached_ = 0, num_used_ = 0;
    HashIndex index_;             // hash -> its oldest registered copy
    int64_t num_registered_ = 0;  // registered blocks, copies included
    std::unordered_map<SeqId, Seq> seqs_;
    mutable BlockHasher hasher_;
    mutable std::vector<BlockHash> scratch_hashes_;
    mutable std::vector<BlockId> scratch_hits_;

    CacheMetrics counters_;  // queries, tokens, evictions, stored
    uint64_t next_event_seq_ = 0;
    std::vector<KvEvent> pending_;          // events of the current operation, delivered at its end
    bool publishing_ = false;               // someone listens during the current operation
    std::optional<KvEventKind> open_kind_;  // kind of the last event of the current operation
    KvEventSubscribers subscribers_;
};

}  // namespace kvshard
