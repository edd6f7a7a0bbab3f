#pragma once
// RouteService: the logic of `kvshard router serve` without its sockets (docs/router.md, "The
// service"). It hashes a prompt the way the engines do (their vLLM hash scheme, vllm_hash.h, with
// their PYTHONHASHSEED and block size, and the request's LoRA name and cache salt), asks the index
// (fed by the engines' KV events) for each replica's prefix overlap, decides with a routing
// policy, and keeps per-replica load (blocks of requests routed there and not yet reported
// finished) and counters for /metrics.
// Thread-safe: the HTTP server calls it from several threads.
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvshard/cache/vllm_hash.h"
#include "kvshard/router/kv_index.h"
#include "kvshard/router/policy.h"
#include "kvshard/router/vllm_event_ingest.h"

namespace kvshard {

struct RouteServiceConfig {
    std::vector<std::string> replica_names;  // index order
    RoutingPolicy policy = RoutingPolicy::kKvshard;
    PolicyParams params;  // params.block_tokens is set to block_size
    // vLLM's default --prefix-caching-hash-algo, sha256 (pickle; vllm/config/cache.py).
    VllmHashScheme scheme = VllmHashScheme::kSha256Pickle;
    // The engines' PYTHONHASHSEED; empty: unset, so vLLM's default seed (vllm_engine_hash_seed).
    std::string hash_seed;
    int block_size = 16;
    size_t max_tracked_requests = 1 << 20;  // routed, unfinished requests kept for load
};

// The body of POST /route: {"token_ids": [int, ...], "request_id": "...", "lora_name": "...",
// "cache_salt": "..."}. The LoRA adapter's name and the cache salt are the request's as the engine
// sees them: vLLM mixes them into its block hashes (VllmExtraKeys), so a prompt sent with a salt
// or a LoRA adapter only matches blocks stored under the same ones.
struct RouteRequestBody {
    std::vector<int32_t> token_ids;
    std::string request_id;  // empty when absent
    VllmExtraKeys extra;     // each empty when absent (or null)
};

// Parses a /route body. Error (its message is the 400 reply's) when it is not JSON, not an object,
// has no "token_ids" array of integers, a token id is outside 0..2^31-1, "request_id" is not a
// string, or "lora_name" / "cache_salt" is neither null nor a non-empty string (vLLM's OpenAI
// server refuses an empty cache_salt too); other keys are ignored. The usual shape (those keys,
// plain integers, strings without escapes) is read in one pass; anything else goes through a full
// JSON parser, with the same result.
RouteRequestBody parse_route_request(std::string_view body);

struct RouteOutcome {
    int replica = 0;
    std::string replica_name;
    // Per replica: the prefix hit vLLM would take there, at most (tokens - 1) / block_size
    // blocks (vllm_max_cache_hit_blocks), one block less for an engine that drafts with
    // EAGLE/MTP (KvIndex::set_eagle_block_drop).
    std::vector<int> matched_blocks;
    std::vector<int64_t> load_blocks;  // per replica, after this request
    RouteReason reason = RouteReason::kRoundRobin;
};

class RouteService {
  public:
    // How the service reads the index: runs fn with it held still
    // (VllmEventSubscriber::with_index).
    using IndexAccess =
        std::function<void(const std::function<void(const KvIndex&, const VllmEventIngest*)>&)>;

    // Error on no replica, a block size below 1, or bad policy params.
    RouteService(RouteServiceConfig config, IndexAccess index);

    // Error on a token id outside 0..2^31-1 or an empty prompt. A request id seen before and not
    // finished is routed again and its old load released first. `extra`: the request's LoRA
    // adapter name and cache salt, hashed into its blocks as the engine hashes them.
    RouteOutcome route(const std::string& request_id, std::span<const int64_t> token_ids,
                       const VllmExtraKeys& extra = {});
    RouteOutcome route(const std::string& request_id, std::span<const int32_t> token_ids,
                       const VllmExtraKeys& extra = {});
    // The /route reply of an outcome: {"load": {name: blocks}, "matched_blocks": {name: n},
    // "reason", "replica"} (keys in sorted order, byte for byte what nlohmann::json writes).
    std::string route_reply_json(const RouteOutcome& o) const;
    // Releases the load of a routed request; false when the id is unknown (or already finished).
    bool finished(const std::string& request_id);

    const RouteServiceConfig& config() const { return config_; }
    // The string the engines' NONE_HASH comes from, as the service hashes with it:
    // vllm_engine_hash_seed(scheme, hash_seed), so "vllm-none-hash" when hash_seed is empty.
    const std::string& engine_hash_seed() const { return engine_hash_seed_; }
    int num_replicas() const { return static_cast<int>(config_.replica_names.size()); }
    // JSON: {"replicas": [{"name", "index_blocks", "last_seq", "stale", "load_blocks", ...}]}.
    std::string replicas_json() const;
    // Prometheus text exposition of the counters and the route latency histogram.
    std::string metrics_text() const;
    // Records an HTTP request refused with 400 (for /metrics).
    void count_bad_request();

  private:
    RouteServiceConfig config_;
    IndexAccess index_;
    std::string engine_hash_seed_;
    VllmBlockHash root_;
    // route_reply_json: replica indices in name order and their names as JSON strings.
    std::vector<size_t> names_sorted_;
    std::vector<std::string> names_json_;
    mutable std::mutex mu_;
    uint64_t rr_counter_ = 0;
    std::vector<int64_t> load_;
    std::unordered_map<std::string, std::pair<int, int64_t>> inflight_;  // id -> (replica, blocks)
    int64_t routes_ = 0, hits_ = 0, hit_blocks_ = 0, bad_requests_ = 0, finished_ = 0;
    std::vector<int64_t> routes_to_;
    std::vector<double> latency_bounds_s_;
    std::vector<int64_t> latency_counts_;  // cumulative buckets are formed when printed
    double latency_sum_s_ = 0;
};

}  // namespace kvshard
