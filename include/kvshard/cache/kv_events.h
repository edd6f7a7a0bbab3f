#pragma once
// KV events: what a block manager publishes about its prefix cache (docs/cache.md, "KV events").
// A cache-aware router rebuilds each replica's set of cached block hashes from this feed.
//
// Every event carries a sequence number, 0, 1, 2, ... per manager with no gaps, in the order the
// changes happened. Subscribers receive events synchronously, in that order, after the operation
// that caused them has completed (so the manager is consistent when a callback runs).
//   BlockStored:  blocks that became findable by lookup. block_hashes is one chain, head first;
//                 parent_hash is the hash the first of them chains from (none for a sequence's
//                 first block); num_tokens = block_hashes.size() * block_size.
//   BlockRemoved: hashes that are no longer findable (evicted).
//   AllCleared:   every hash was dropped (clear_cache()).
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>  // unordered_multiset
#include <utility>
#include <vector>

#include "kvshard/cache/block_hash.h"

namespace kvshard {

enum class KvEventKind { kBlockStored, kBlockRemoved, kAllCleared };
std::string_view kv_event_kind_name(KvEventKind k);  // "BlockStored", "BlockRemoved", "AllCleared"

struct KvEvent {
    KvEventKind kind = KvEventKind::kBlockStored;
    uint64_t seq = 0;                      // event sequence number
    std::vector<BlockHash> block_hashes;   // Stored: chain order; Removed: eviction order
    std::optional<BlockHash> parent_hash;  // Stored only; nullopt when the chain starts at the root
    int64_t num_tokens = 0;                // Stored only
    int block_size = 0;                    // tokens per block of the manager
    std::vector<int32_t> block_ids;        // the manager's block ids, same order as block_hashes
    // The KV group of the blocks (KvGroupManager; vLLM's group_idx); 0 for a BlockManager.
    int group = 0;

    bool operator==(const KvEvent&) const = default;
};

using KvEventCallback = std::function<void(const KvEvent&)>;

// The subscriptions of one event source (BlockManager, KvGroupManager): callbacks by id, each
// event delivered to every one in subscription order.
class KvEventSubscribers {
  public:
    // Throws Error on an empty callback. Returns the id for remove().
    int add(KvEventCallback callback);
    // Throws Error when no subscription has that id.
    void remove(int subscription_id);
    bool empty() const { return subs_.empty(); }
    // Delivers `pending` (and clears it) from a local copy, so a callback may query the source
    // or cause new events to be collected for a later delivery.
    void deliver(std::vector<KvEvent>& pending) const;

  private:
    std::vector<std::pair<int, KvEventCallback>> subs_;
    int next_id_ = 0;
};

// One JSON object, no newline:
//   {"seq":3,"type":"BlockStored","block_hashes":["<32 hex>",...],"parent_hash":"<32 hex>"|null,
//    "num_tokens":32,"block_size":16,"block_ids":[4,5]}
// "source" is added first when non-empty (e.g. a replica name); "group":g last when g != 0 (so a
// one-group manager's lines are unchanged).
std::string to_json_line(const KvEvent& e, std::string_view source = {});
// Parses what to_json_line writes (the "source" field is ignored); throws Error on a malformed
// line.
KvEvent kv_event_from_json(std::string_view line);

// A consumer's copy of one manager's registered block hashes, kept exact by applying the
// manager's events in order (what a cache-aware router keeps per replica). A multiset: several
// blocks may hold one hash (copies, as in vLLM's BlockPool; docs/cache.md "Copies of one hash"),
// each stored and removed by its own event, so BlockStored adds one copy per hash listed,
// BlockRemoved takes one away, and a hash is findable while a copy is left; AllCleared empties it.
// One multiset per KV group (KvEvent::group): the same hash may be cached in one group and evicted
// from another (KvGroupManager).
class KvEventIndex {
  public:
    // Applies one event. The first event applied (or sync()) fixes where the feed starts; after
    // that, an event whose sequence number is not the next one throws Error naming both (a lost
    // or replayed event: the copy can no longer be trusted; sync() again).
    void apply(const KvEvent& e);
    // Starts from a snapshot of group 0 (every other group empty): BlockManager's
    // registered_hashes() and next_event_seq().
    void sync(std::span<const BlockHash> hashes, uint64_t next_seq);
    bool contains(const BlockHash& h, int group = 0) const;
    // How many leading hashes of a request are present in the group: the blocks it would hit.
    size_t match_length(std::span<const BlockHash> request, int group = 0) const;
    size_t size() const;  // registered blocks (copies each) over all groups
    // Sequence number the next event must carry; nullopt before the first event or sync.
    std::optional<uint64_t> next_seq() const { return next_seq_; }

  private:
    using HashSet = std::unordered_multiset<BlockHash, BlockHashHasher>;
    HashSet& set_of(int group) { return group == 0 ? hashes_ : other_groups_[group]; }
    const HashSet* find_set(int group) const;
    HashSet hashes_;                       // group 0
    std::map<int, HashSet> other_groups_;  // groups != 0
    std::optional<uint64_t> next_seq_;
};

// Subscriber that writes one JSON line per event to a stream (flushes after each line).
class KvEventJsonWriter {
  public:
    explicit KvEventJsonWriter(std::ostream& out, std::string source = {})
        : out_(&out), source_(std::move(source)) {}
    void operator()(const KvEvent& e) const;

  private:
    std::ostream* out_;
    std::string source_;
};

}  // namespace kvshard
