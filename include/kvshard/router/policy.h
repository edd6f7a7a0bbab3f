#pragma once
// Data-parallel routing: which replica serves a request. docs/router.md has the formulas.
//
// Every policy sees the same inputs: the request's block hashes (chained prefix hashes, one per
// block_tokens tokens), each replica's prefix overlap with the request (from KvIndex), and each
// replica's load (prompt tokens queued for prefill, KV blocks held by running requests) and
// capacity. decide_route is a pure function of those values; Router adds the state a deployment
// keeps (the index and a round-robin counter).
//
// Load is measured in blocks: load_r = active_blocks_r + ceil(queued_prefill_tokens_r /
// block_tokens), scaled by mean_capacity / capacity_r when capacities are given (so a replica with
// twice the memory counts as half as loaded). Ties between equally good replicas go to the first
// one in rotation order starting at rr_counter % R, so an idle cluster is not piled onto replica 0
// (kvshard breaks ties by rendezvous hashing instead, see PolicyParams).
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvshard/router/kv_index.h"

namespace kvshard {

enum class RoutingPolicy {
    kRoundRobin,   // request i -> replica i % R
    kLeastLoaded,  // lowest load
    kCacheAware,   // SGLang: best prefix match unless the load is imbalanced or the match is poor
    kCost,         // Dynamo: lowest overlap_weight * blocks to prefill + active blocks
    kKvshard,      // follow the data within a load bound, else least loaded
};
std::string_view routing_policy_name(
    RoutingPolicy p);  // round-robin|least-loaded|cache-aware|cost|kvshard
RoutingPolicy parse_routing_policy(std::string_view s);
std::vector<RoutingPolicy> all_routing_policies();

struct ReplicaLoad {
    int64_t queued_prefill_tokens = 0;  // prompt tokens routed here and not yet prefilled
    int64_t active_blocks = 0;          // KV blocks held by running (admitted) requests
    int64_t capacity_blocks = 0;        // KV capacity in blocks; 0 on every replica: all equal
    bool operator==(const ReplicaLoad&) const = default;
};

struct PolicyParams {
    int block_tokens = 512;  // tokens per block (the unit of block_hashes)
    // cache-aware (SGLang router defaults, with load counted in blocks instead of requests):
    // imbalanced when max_load - min_load > balance_abs_threshold AND
    // max_load > balance_rel_threshold * min_load; then least loaded. Otherwise the best match,
    // unless its overlap / request blocks < cache_threshold; then least loaded.
    double cache_threshold = 0.3;
    double balance_abs_threshold = 64;
    double balance_rel_threshold = 1.5;
    // cost (Dynamo KV router): cost_r = overlap_weight * (queued prefill blocks_r + request blocks
    // - overlap_r) + active_blocks_r; the lowest cost wins.
    double overlap_weight = 1.0;
    // kvshard: a request follows its data when that is worth it and the load allows, and goes to
    // the least loaded replica otherwise (docs/router.md):
    //   bound   = (1 + load_slack) * mean_load + load_headroom_tokens / block_tokens;
    //   allowed = replicas with load <= bound (the least loaded always is);
    //   least   = the allowed replica with the lowest placement load, active_blocks +
    //             prefill_weight * queued prefill blocks (a queued prompt holds up everything
    //             behind it, an active block barely slows a decode step);
    //   best    = the allowed replica with the longest overlap;
    //   choose best if overlap(best) > overlap(least) + min_gain_blocks, else least.
    // Ties go by rendezvous order of the request's hash at position affinity_blocks (a chained
    // hash: system prompt + first turn), the same for every turn of one conversation.
    double load_slack = 0.25;
    double load_headroom_tokens = 131072;
    double prefill_weight = 16;
    int affinity_blocks = 1;
    int min_gain_blocks = 1;
    // Throws Error naming the parameter unless every weight and threshold is finite and in its
    // range (docs/cli-inputs.md).
    void validate() const;
};

struct RouteRequest {
    std::span<const BlockHash> block_hashes;  // in order; block i covers tokens [i*bt, (i+1)*bt)
    int64_t num_tokens = 0;                   // prompt tokens (the last block may be partial)
};

enum class RouteReason {
    kRoundRobin,
    kLeastLoaded,  // least-loaded policy; cache-aware with a poor match; kvshard with no gain
    kImbalanced,   // cache-aware: thresholds passed, least loaded
    kBestMatch,    // the longest prefix overlap
    kLowestCost,   // cost policy
    kSpill,        // kvshard: the longest overlap was on a replica over the load bound
};
std::string_view route_reason_name(RouteReason r);

struct RouteDecision {
    int replica = 0;
    int matched_blocks = 0;  // the chosen replica's prefix overlap
    RouteReason reason = RouteReason::kRoundRobin;
    bool operator==(const RouteDecision&) const = default;
};

// The decision. overlap[r]: leading blocks of the request replica r holds
// (KvIndex::prefix_overlap); loads[r]: replica r's load; rr_counter: round-robin position (also the
// start of tie rotation). Throws Error when overlap and loads differ in size or are empty.
RouteDecision decide_route(RoutingPolicy policy, const PolicyParams& params,
                           const RouteRequest& req, std::span<const int> overlap,
                           std::span<const ReplicaLoad> loads, uint64_t rr_counter);

// Load in blocks, scaled by capacity as described above (mean_capacity_blocks <= 0: unscaled).
double effective_load_blocks(const ReplicaLoad& l, int block_tokens, double mean_capacity_blocks);

// Rendezvous (highest random weight) score of replica r for an affinity key.
uint64_t rendezvous_score(uint64_t key, int replica);

// A router of one DP group: its KV index, its policy and its round-robin counter.
class Router {
  public:
    Router(int num_replicas, RoutingPolicy policy, PolicyParams params = {},
           KvIndexMode mode = KvIndexMode::kExact, double ttl_s = 120.0);

    int num_replicas() const { return index_.num_replicas(); }
    RoutingPolicy policy() const { return policy_; }
    const PolicyParams& params() const { return params_; }
    KvIndex& index() { return index_; }
    const KvIndex& index() const { return index_; }

    // Decides, and in approximate mode records the request's blocks on the chosen replica.
    // loads.size() must equal num_replicas(). req.block_hashes holds at most one hash per block of
    // req.num_tokens, ceil(num_tokens / block_tokens) (a partial last block's hash allowed, as a
    // trace's hash_ids carry it; fewer: a prefix); Error otherwise, and for num_tokens < 0, since
    // the token count caps the hit (vllm_max_cache_hit_blocks) and a wrong one silently zeroes
    // it.
    RouteDecision route(const RouteRequest& req, std::span<const ReplicaLoad> loads, double now_s);

  private:
    RoutingPolicy policy_;
    PolicyParams params_;
    KvIndex index_;
    uint64_t rr_counter_ = 0;
    std::vector<int> overlap_;  // scratch, one per replica
};

}  // namespace kvshard
