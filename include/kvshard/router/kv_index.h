#pragma once
// KvIndex: which replica holds which KV block, as far as a data-parallel router knows.
//
// Block hashes are chained prefix hashes (hash i names the first (i+1)*block_tokens tokens), so a
// flat map hash -> replica bitmask answers "how many leading blocks of this request does replica r
// hold?" with one lookup per block: walk the request's hashes and AND the masks; replica r's
// prefix overlap is the position at which its bit first drops out.
//
// Two modes:
//  - kExact: fed by the KV events of each replica's block store (stored / removed / all cleared);
//    the index equals the union of the replicas' caches at every moment.
//  - kApproximate: for engines that publish no events. The router records its own decisions
//    (route_recorded): a routed request's blocks are assumed cached on that replica for ttl_s
//    seconds after the last time a request routed there used them (SGLang's approximate tree).
// At most kMaxReplicas replicas (one bit each).
//
// KV cache groups (hybrid models: vLLM's group_idx, KvEvent::group): a model whose layers keep
// different KV (full attention, a sliding window, Mamba state) caches each block once per group,
// and each group stores and evicts on its own. The index keeps one map per group. A replica's
// prefix overlap is then the longest k that every group it has published serves, found as a
// fixed point (vLLM's HybridKVCacheCoordinator; KvGroupManager::hybrid_hit_blocks): each group in
// turn lowers k to the longest hit <= k it serves, until none lowers it. A group serves k when
//   full attention (the default rule): blocks [0, k) are held;
//   windowed, w blocks (set_group_window): blocks [max(0, k - w), k) are held (only the window
//     before position k is read; vLLM's sliding window needs ceil((window - 1) / block_size)
//     blocks, Mamba state 1: the block at k - 1).
// k = 0 is always served.
//
// Groups with larger blocks (vLLM's hash_block_size): the hashes a route walks are at the
// router's block size H, vLLM's hash_block_size; a group whose blocks are s times larger
// (set_group_block_scale; vLLM raises the block size of groups with smaller pages) publishes, for
// its block j, the H-granular hash at the end of that block: the request's hash (j + 1) * s - 1
// (vllm/v1/core/kv_cache_utils.py: BlockHashListWithBlockSize). Such a group serves k (in H
// blocks) only when k is a multiple of s and its rule holds on its own blocks [.., k / s), the
// window counted in its blocks; and every hit is a multiple of the least common multiple of the
// scales of the replica's groups (vLLM aligns hits to its scheduler block size, the LCM of the
// groups' block sizes).
// While no replica has more than a full-attention group 0 at scale 1, the walk of group 0 alone
// (with its early exit) answers; otherwise the fixed point answers for every replica.
#include <cstdint>
#include <deque>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvshard/cache/block_hash.h"
#include "kvshard/cache/kv_events.h"
#include "kvshard/router/block_hash_map.h"

namespace kvshard {

enum class KvIndexMode { kExact, kApproximate };

// vllm_max_cache_hit_blocks (the cap of a prefix hit): kvshard/cache/block_hash.h.

// Whether a vLLM engine speculating with `method` (its --speculative-config "method") drops the
// last matched block of each prefix-cache hit: true for eagle, eagle3 and mtp
// (vllm/config/speculative.py, SpeculativeConfig.use_eagle(); KVCacheManager passes it to the
// coordinator as use_eagle), false for "" / none (no speculation), ngram, medusa, mlp_speculator,
// draft_model and suffix. Error naming the accepted methods for any other string.
bool vllm_eagle_block_drop(std::string_view method);

std::string_view kv_index_mode_name(KvIndexMode m);  // "exact" | "approximate"
KvIndexMode parse_kv_index_mode(std::string_view s);

class KvIndex {
  public:
    static constexpr int kMaxReplicas = 64;
    static constexpr int kMaxGroups = 64;

    // Throws Error when num_replicas is outside [1, kMaxReplicas] or ttl_s <= 0 in approximate
    // mode.
    explicit KvIndex(int num_replicas, KvIndexMode mode = KvIndexMode::kExact,
                     double ttl_s = 120.0);

    int num_replicas() const { return num_replicas_; }
    KvIndexMode mode() const { return mode_; }

    // Exact mode: the events of replica `replica`'s block store. Each hash stored is one block: a
    // hash stored k times without a removal between is k blocks of the same content (copies:
    // vLLM's BlockPool registers the same prefix in several blocks and publishes BlockStored for
    // each, BlockRemoved for each copy it evicts; docs/router.md "Copies of one hash"), and the
    // replica holds the hash until it is removed k times, since the engine still hits it through
    // the remaining copies. Removing a hash the replica does not hold is harmless.
    // `group` is the KV cache group, 0 to kMaxGroups - 1 (Error otherwise); a group takes part in
    // the replica's overlap from its first stored block on, until all_cleared.
    void block_stored(int replica, std::span<const BlockHash> hashes, int group = 0);
    void block_removed(int replica, std::span<const BlockHash> hashes, int group = 0);
    // Forgets the hashes, every copy, without an event saying so (a router bounding its memory:
    // VllmEventIngest's cap). Unknown hashes are harmless.
    void block_forgotten(int replica, std::span<const BlockHash> hashes, int group = 0);
    // Every group of the replica (their rules are kept: they describe the model, not the cache).
    void all_cleared(int replica);
    // Group `group` of `replica` serves a prefix k when its last `window_blocks` blocks before k
    // are held (window_blocks >= 0; 0: it never limits the overlap). Error on bad arguments.
    void set_group_window(int replica, int group, int window_blocks);
    // Back to the full-attention rule (the default).
    void set_group_full(int replica, int group);
    // Group `group` of `replica` has blocks of `scale` router blocks (scale >= 1; 1, the default:
    // the router's block size). Kept across all_cleared, like the rules. Error on bad arguments.
    void set_group_block_scale(int replica, int group, int scale);
    int group_block_scale(int replica, int group) const;
    // The replica's engine drafts with EAGLE/MTP (vLLM's SpeculativeConfig.use_eagle(): method
    // eagle, eagle3 or mtp): vLLM drops the last matched block of a prefix-cache hit so that the
    // drafter gets the hidden states of those tokens again (FullAttentionManager /
    // SlidingWindowManager.find_longest_cache_hit in vllm/v1/core/single_type_kv_cache_manager.py,
    // drop_eagle_block; the coordinator in kv_cache_coordinator.py applies it to every KV cache
    // group when none is marked as the draft's). prefix_overlap then gives, for this replica:
    //  - one group of full attention: the held run of the (capped) hashes less one block, never
    //    below 0 (a run of 0 stays 0);
    //  - several groups: a full-attention group serves k when it holds k / s + 1 of its blocks, a
    //    windowed group when its last window + 1 blocks up to and including block k / s are held,
    //    both within the hashes passed (the cap); a group with window 0 (never limits) is
    //    unchanged (vLLM's Mamba finder does not drop); k stays a multiple of the LCM alignment.
    // Kept across all_cleared (it describes the engine, not its cache). Off by default.
    void set_eagle_block_drop(int replica, bool on);
    bool eagle_block_drop(int replica) const;
    // Any of the three, as published by a BlockManager (kvshard/cache/kv_events.h). The first event
    // of a replica fixes where its feed starts; after that an event whose sequence number is not
    // the next one throws Error naming both (a lost or replayed event: that replica's part of the
    // index can no longer be trusted; all_cleared() it and resubscribe).
    void apply(int replica, const KvEvent& event);

    // Approximate mode: `replica` was sent a request with these blocks at time now_s; they count as
    // cached there until now_s + ttl_s (refreshed by each later use).
    void record_routed(int replica, std::span<const BlockHash> hashes, double now_s);
    // Approximate mode: forget entries whose time to live has passed. Called by record_routed;
    // call it before prefix_overlap when time advanced without a routing decision.
    void expire(double now_s);

    // out[r] = number of leading blocks of `hashes` that replica r holds. out.size() ==
    // num_replicas. To get the hit an engine would take, pass only the first
    // vllm_max_cache_hit_blocks(prompt tokens, block size) hashes of the prompt.
    void prefix_overlap(std::span<const BlockHash> hashes, std::span<int> out) const;
    bool contains(int replica, BlockHash h, int group = 0) const;
    // Blocks the index believes replica r holds (copies each), over all its groups / in one group.
    int64_t num_blocks(int replica) const { return counts_[static_cast<size_t>(replica)]; }
    int64_t num_blocks(int replica, int group) const;
    // Distinct (hash, group) pairs held by at least one replica.
    int64_t num_hashes() const;
    // Groups replica r has stored blocks in since its last all_cleared (bit g: group g).
    uint64_t groups(int replica) const { return groups_[static_cast<size_t>(replica)]; }

  private:
    using MaskMap = BlockHashMap<uint64_t>;
    // count_copy: a hash the replica holds already gains a copy (events); else unchanged (the
    // approximate mode's refresh). every_copy: the hash goes (forget, expiry); else one copy.
    void set_bit(int replica, BlockHash h, int group, bool count_copy);
    void clear_bit(int replica, BlockHash h, int group, bool every_copy);
    void check_replica(int replica) const;
    void check_group(int group) const;
    // prefix_overlap when some replica has groups besides a full-attention group 0.
    void hybrid_overlap(std::span<const BlockHash> hashes, std::span<int> out) const;

    struct Expiry {
        double at;
        BlockHash hash;
        int replica;
    };
    int num_replicas_;
    KvIndexMode mode_;
    double ttl_s_;
    std::vector<MaskMap> masks_;   // [group]: hash -> bit r set when replica r holds it
    std::vector<int64_t> counts_;  // blocks per replica, all groups
    std::vector<std::vector<int64_t>> group_counts_;  // [replica][group]
    // [replica][group]: hash -> copies beyond the first, only for hashes the replica holds in
    // several blocks (rare: the bit in masks_ answers lookups; this only counts removals down).
    std::vector<std::vector<std::unordered_map<BlockHash, int64_t, BlockHashHasher>>> copies_;
    std::vector<uint64_t> groups_;  // [replica]: groups with a stored block
    // [replica][group]: -1 full attention, else the window in blocks (set_group_window).
    std::vector<std::vector<int>> window_;
    // [replica][group]: the group's block in router blocks (set_group_block_scale), 1 by default.
    std::vector<std::vector<int>> scale_;
    // Bit r: replica r has a group other than 0, or a windowed or scaled group 0 (prefix_overlap's
    // slow path).
    uint64_t hybrid_ = 0;
    // Bit r: replica r's engine drops the last matched block (set_eagle_block_drop).
    uint64_t eagle_ = 0;
    void update_hybrid(int replica);
    void grow_groups(size_t replica, size_t group);
    std::vector<int64_t> next_seq_;  // next event number per replica; -1 before its first event
    // Approximate mode: latest expiry per (replica, hash) and a FIFO of expiries (non-decreasing
    // because time only moves forward); a popped entry clears its bit only if not refreshed since.
    std::vector<std::unordered_map<BlockHash, double, BlockHashHasher>> expiry_of_;  // [replica]
    std::deque<Expiry> expiries_;
};

}  // namespace kvshard
