#pragma once
// KvGroupManager: one block table per KV group and sequence, for models whose layers keep KV of
// several shapes (kv_groups(model): full attention, sliding window W, chunked local attention C,
// MLA, recurrent-state layers). vLLM's hybrid KV cache manager; docs/cache.md, "KV groups".
//
// Each group has its own pool of block ids, reference counts, prefix index and LRU: block b of
// group g and block b of group h are unrelated. A sequence of L tokens has, per token group, a
// table of ceil(L / block_size) entries, so that token j is in entry j / block_size of every
// group; a windowed group (sliding, chunked) holds only the blocks from
// floor(first_kept_position(kind, W, L') / block_size) on, L' being the length whose window the
// next query needs (below), and writes kNullBlock in the entries it dropped or never took (vLLM's
// null_block): resident blocks = ceil(L / bs) - floor(first_kept / bs), request_kv_bytes'
// count. A state group (GatedDeltaNet, Mamba2) holds one state slot per sequence with L > 0.
//
// Windows and commits. With c tokens committed (their KV written) of L, the next query is at
// position c (c < L) and needs the window first_kept_position(kind, W, c + 1); once c = L it is
// first_kept_position(kind, W, L). So a windowed group keeps blocks from
//   keep_from(c, L) = floor(first_kept_position(kind, W, c < L ? c + 1 : L) / block_size),
// which only grows. Without deferred_commit c = L always; with it, the prefill's earlier windows
// stay resident until commit() (an executor needs them for the prefill's own queries).
//
// Prefix hits. A hit of k blocks (P = k * block_size tokens, computation resumes at P) is served
// by a group when: full / MLA: blocks [0, k) are cached; windowed: blocks [keep_from(P, L), k)
// are cached (only the last window before P); state: only k = 0 (states are not saved at block
// boundaries, so a manager with a state group refuses enable_prefix_cache). The hybrid hit is the
// longest k that every group serves (vLLM's HybridKVCacheCoordinator), found by a fixed point:
// each group in turn lowers k to the longest hit <= k it serves, until no group lowers it.
// Blocks are cached per group by the same chained block hashes (block_hash.h); the events name
// the group (KvEvent::group).
//
// Not thread-safe: one scheduler thread owns a manager.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvshard/cache/block_hash.h"
#include "kvshard/cache/block_manager.h"
#include "kvshard/cache/kv_events.h"
#include "kvshard/cache/paged_kv.h"
#include "kvshard/layout/kv_layout.h"

namespace kvshard {

// A table entry of a block the group does not hold (dropped out of a window, or before the window
// of a prefix hit). Never a valid block id; a kernel that reads only a window never reads it. An
// executor that wants every entry addressable maps it to a page it never writes.
inline constexpr BlockId kNullBlock = -1;

struct KvGroupPoolSpec {
    LayerKind kind = LayerKind::kFullAttention;
    int window = 0;          // sliding window W or chunk C; 0 otherwise
    int64_t num_blocks = 0;  // this group's pool: blocks (token groups) or state slots
    bool operator==(const KvGroupPoolSpec&) const = default;
};

// One spec per group (kv_groups(model) order), each with num_blocks blocks.
std::vector<KvGroupPoolSpec> group_pool_specs(const std::vector<KvGroup>& groups,
                                              int64_t num_blocks);
// Why these groups cannot use a prefix cache; empty when they can.
std::string kv_group_prefix_cache_unsupported(std::span<const KvGroupPoolSpec> groups);

struct KvGroupManagerConfig {
    std::vector<KvGroupPoolSpec> groups;
    int block_size = 16;
    bool enable_prefix_cache = true;
    bool deferred_commit = false;  // as BlockManagerConfig::deferred_commit
};

struct GroupAllocResult {
    int64_t cached_tokens = 0;  // the hybrid hit: leading tokens every group serves (skip them)
    int64_t cached_blocks = 0;  // = cached_tokens / block_size
    std::vector<int64_t> new_blocks;  // per group: fresh blocks taken
};

class KvGroupManager {
  public:
    // Throws Error for no groups, a block size < 1, a group with no blocks, a windowed group with
    // window < 1, a layer kind without KV, or enable_prefix_cache with a state group.
    explicit KvGroupManager(KvGroupManagerConfig config);

    int num_groups() const { return static_cast<int>(config_.groups.size()); }
    int block_size() const { return config_.block_size; }
    const KvGroupPoolSpec& group(int g) const;
    int64_t blocks_for_tokens(int64_t n) const {
        return (n + config_.block_size - 1) / config_.block_size;
    }
    // The first table entry group g keeps with c of L tokens committed (0 for full / MLA / state).
    int64_t keep_from(int g, int64_t committed, int64_t num_tokens) const;

    // ---- prefix lookup (const) ----
    // The hybrid hit of a query of `tokens`, in tokens (a multiple of block_size).
    int64_t lookup(std::span<const int32_t> tokens,
                   std::span<const std::byte> extra_keys = {}) const;
    // The longest hit of at most max_blocks blocks that group g alone serves for a query of
    // num_tokens tokens whose full blocks hash to `hashes`.
    int64_t group_hit_blocks(int g, std::span<const BlockHash> hashes, int64_t num_tokens,
                             int64_t max_blocks) const;
    // The hybrid hit in blocks: the longest k <= max_blocks (-1: any) every group serves.
    int64_t hybrid_hit_blocks(std::span<const BlockHash> hashes, int64_t num_tokens,
                              int64_t max_blocks = -1) const;

    // ---- sequences ----
    // New sequence holding `tokens`: the hybrid hit is shared in every group (its blocks inside
    // each group's window), the rest allocated. max_cached_blocks as BlockManager::allocate.
    // Throws Error when seq exists or a group's pool could never hold it, OutOfBlocksError when
    // some group lacks free + evictable blocks now (nothing changed).
    GroupAllocResult allocate(SeqId seq, std::span<const int32_t> tokens,
                              std::span<const std::byte> extra_keys = {},
                              int64_t max_cached_blocks = -1);
    bool can_allocate(std::span<const int32_t> tokens, std::span<const std::byte> extra_keys = {},
                      int64_t max_cached_blocks = -1) const;
    // Appends tokens; windowed groups drop what fell out of the window (without deferred commit).
    void append(SeqId seq, std::span<const int32_t> tokens);
    bool can_append(SeqId seq, int64_t count) const;
    // As BlockManager::commit; then windowed groups drop the blocks before keep_from.
    // next_query >= 0: the position of the first query of a step that will still read these blocks
    // (an executor that commits a step's tokens as it schedules it, before running it): windowed
    // groups then keep that query's window, keep_from(g, next_query, L), until a later commit.
    void commit(SeqId seq, int64_t num_computed_tokens, int64_t next_query = -1);
    // Releases every group's blocks of the sequence, tail first; hashed blocks stay cached.
    void free(SeqId seq);

    bool contains(SeqId seq) const { return seqs_.find(seq) != seqs_.end(); }
    int64_t num_tokens(SeqId seq) const;
    int64_t num_committed_tokens(SeqId seq) const;
    // Group g's table: token groups ceil(L / bs) entries (kNullBlock where dropped); state
    // groups one slot (none while L = 0).
    std::span<const BlockId> block_table(int g, SeqId seq) const;
    // Entries of group g's table that hold a block (not kNullBlock).
    int64_t resident_blocks(int g, SeqId seq) const;
    // FlashInfer-style description of group g's blocks of these sequences (token groups; the
    // indices keep the kNullBlock entries, so token j stays at entry j / block_size).
    PagedKv paged_kv(int g, std::span<const SeqId> seqs) const;

    // ---- events ----
    // As BlockManager: synchronous, in order, after the operation; every event names its group.
    int subscribe(KvEventCallback callback);
    void unsubscribe(int subscription_id);
    uint64_t next_event_seq() const { return next_event_seq_; }

    // ---- introspection ----
    int64_t num_available_blocks(int g) const;  // free + cached
    int64_t num_used_blocks(int g) const;
    BlockState block_state(int g, BlockId b) const;
    int32_t ref_count(int g, BlockId b) const;
    bool block_computed(int g, BlockId b) const;
    std::optional<BlockHash> registered_hash(int g, BlockId b) const;
    std::vector<BlockId> eviction_order(int g) const;  // least recently used first
    // Throws InternalError naming the first broken invariant (states partition each pool, counts
    // equal table references, windows, index, LRU, computed flags).
    void check_invariants() const;

  private:
    struct Block {
        int32_t ref = 0;
        bool registered = false;
        bool computed = false;
        BlockHash hash;
        BlockId lru_prev = -1, lru_next = -1;
        bool in_lru = false;
    };
    struct Pool {
        KvGroupPoolSpec spec;
        std::vector<Block> blocks;
        std::vector<BlockId> free_list;  // back() is handed out next
        BlockId lru_head = -1, lru_tail = -1;
        int64_t num_free = 0, num_cached = 0, num_used = 0;
        // hash -> its registered copies, oldest first; a lookup takes the front (vLLM's
        // BlockHashToBlockMap.get_one_block), an eviction that one copy.
        std::unordered_map<BlockHash, std::vector<BlockId>, BlockHashHasher> index;
    };
    struct Seq {
        std::vector<std::vector<BlockId>> tables;  // per group
        std::vector<int32_t> tokens;
        std::vector<std::byte> extra_keys;
        std::vector<BlockHash> hashes;  // of every full block
        int64_t committed = 0;
    };

    bool windowed(int g) const;
    bool state_group(int g) const;
    const Seq& seq_or_throw(SeqId seq) const;
    Pool& pool(int g) { return pools_[static_cast<size_t>(g)]; }
    const Pool& pool(int g) const { return pools_[static_cast<size_t>(g)]; }
    const Pool& checked_pool(int g) const { return (group(g), pool(g)); }
    // Fresh blocks group g needs for an allocation that hits hit_blocks and then has `committed`
    // of num_tokens committed: entries [keep_from, total) held, of which [keep_from, hit) shared.
    // Throws Error when the group's pool is too small.
    int64_t fresh_needed(int g, int64_t hit_blocks, int64_t committed, int64_t num_tokens,
                         SeqId seq) const;
    int64_t cached_hits_in(int g, std::span<const BlockHash> hashes, int64_t from,
                           int64_t to) const;
    BlockId take_block(int g);
    void release_block(int g, BlockId b);
    void commit_impl(Seq& s, int64_t n, int64_t next_query = -1);
    // Windowed groups release the entries before keep_from(committed, num_tokens).
    void drop_out_of_window(Seq& s, int64_t committed, int64_t num_tokens);
    void lru_push_back(Pool& p, BlockId b);
    void lru_remove(Pool& p, BlockId b);
    void begin_op();
    void flush_events();
    KvEvent* new_event(KvEventKind kind, int g);
    KvEvent* removed_event(int g);

    KvGroupManagerConfig config_;
    std::vector<Pool> pools_;
    std::unordered_map<SeqId, Seq> seqs_;
    uint64_t next_event_seq_ = 0;
    std::vector<KvEvent> pending_;
    bool publishing_ = false;
    int open_removed_group_ = -1;  // the group of the open BlockRemoved event (-1: none)
    KvEventSubscribers subscribers_;
};

}  // namespace kvshard
