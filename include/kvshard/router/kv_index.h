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
#include <cstdint>
#include <deque>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvshard/cache/block_hash.h"
#include "kvshard/cache/kv_events.h"

namespace kvshard {

enum class KvIndexMode { kExact, kApproximate };
std::string_view kv_index_mode_name(KvIndexMode m);  // "exact" | "approximate"
KvIndexMode parse_kv_index_mode(std::string_view s);

class KvIndex {
  public:
    static constexpr int kMaxReplicas = 64;

    // Throws Error when num_replicas is outside [1, kMaxReplicas] or ttl_s <= 0 in approximate
    // mode.
    explicit KvIndex(int num_replicas, KvIndexMode mode = KvIndexMode::kExact,
                     double ttl_s = 120.0);

    int num_replicas() const { return num_replicas_; }
    KvIndexMode mode() const { return mode_; }

    // Exact mode: the events of replica `replica`'s block store. Storing a hash twice or removing
    // a hash the replica does not hold is harmless (idempotent set semantics).
    void block_stored(int replica, std::span<const BlockHash> hashes);
    void block_removed(int replica, std::span<const BlockHash> hashes);
    void all_cleared(int replica);
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
    // num_replicas.
    void prefix_overlap(std::span<const BlockHash> hashes, std::span<int> out) const;
    bool contains(int replica, BlockHash h) const;
    // Blocks the index believes replica r holds.
    int64_t num_blocks(int replica) const { return counts_[static_cast<size_t>(replica)]; }
    // Distinct hashes held by at least one replica.
    int64_t num_hashes() const { return static_cast<int64_t>(masks_.size()); }

  private:
    void set_bit(int replica, BlockHash h);
    void clear_bit(int replica, BlockHash h);
    void check_replica(int replica) const;

    struct Expiry {
        double at;
        BlockHash hash;
        int replica;
    };
    int num_replicas_;
    KvIndexMode mode_;
    double ttl_s_;
    std::unordered_map<BlockHash, uint64_t, BlockHashHasher>
        masks_;                      // hash -> bit r set when replica r holds it
    std::vector<int64_t> counts_;    // blocks per replica
    std::vector<int64_t> next_seq_;  // next event number per replica; -1 before its first event
    // Approximate mode: latest expiry per (replica, hash) and a FIFO of expiries (non-decreasing
    // because time only moves forward); a popped entry clears its bit only if not refreshed since.
    std::vector<std::unordered_map<BlockHash, double, BlockHashHasher>> expiry_of_;  // [replica]
    std::deque<Expiry> expiries_;
};

}  // namespace kvshard
