#pragma once
// Trace replay over R data-parallel replicas: routing, finite LRU prefix caches, queueing, TTFT.
// docs/router.md describes the model; in short:
//  - every request is routed on arrival (Router, with the replicas' loads at that moment);
//  - each replica runs an iteration-level scheduler: a step admits waiting requests in FIFO order
//    (while blocks are available, up to max_batch running and max_prefill_tokens prompt tokens per
//    step, at least one), prefills their uncached tokens and runs one decode token for every
//    running request; step time = prefill_s(new tokens) + decode_step_s(batch, context);
//  - admission allocates the request's prompt + output blocks in the replica's BlockManager with
//  the
//    trace's block hashes (full prompt blocks are shared, the last partial block and the output are
//    not): the cached prefix is the hit, the rest is computed; blocks are freed when the request
//    ends and stay cached until LRU evicts them;
//  - exact routing indexes follow the BlockManagers' KV events.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvshard/router/policy.h"
#include "kvshard/sim/trace.h"

namespace kvshard {

// Times of one replica's engine steps. Implementations: LinearServiceModel (tests) and the
// planner's roofline cost model (planner_service_model, sim/planner_service.h).
class ServiceModel {
  public:
    virtual ~ServiceModel() = default;
    // Prefill of new_tokens prompt tokens (all requests admitted in one step together).
    virtual double prefill_s(int64_t new_tokens) const = 0;
    // One decode step of `batch` requests holding context_tokens tokens of KV in total.
    virtual double decode_step_s(int64_t batch, int64_t context_tokens) const = 0;
};

// prefill_s = prefill_fixed_s + new_tokens * prefill_s_per_token;
// decode_step_s = decode_fixed_s + batch * decode_s_per_request + context *
// decode_s_per_context_token.
struct LinearServiceModel final : ServiceModel {
    double prefill_fixed_s = 0;
    double prefill_s_per_token = 0;
    double decode_fixed_s = 0;
    double decode_s_per_request = 0;
    double decode_s_per_context_token = 0;
    double prefill_s(int64_t new_tokens) const override {
        return prefill_fixed_s + static_cast<double>(new_tokens) * prefill_s_per_token;
    }
    double decode_step_s(int64_t batch, int64_t context_tokens) const override {
        return decode_fixed_s + static_cast<double>(batch) * decode_s_per_request +
               static_cast<double>(context_tokens) * decode_s_per_context_token;
    }
};

struct SimConfig {
    int num_replicas = 8;
    int64_t replica_capacity_blocks = 0;  // KV blocks of trace.block_tokens tokens per replica
    RoutingPolicy policy = RoutingPolicy::kKvshard;
    PolicyParams params;  // params.block_tokens is set to the trace's
    KvIndexMode index_mode = KvIndexMode::kExact;
    double index_ttl_s = 300.0;          // approximate mode: ~ how long a block survives in LRU
    int max_batch = 256;                 // running requests per replica
    int64_t max_prefill_tokens = 16384;  // prompt tokens per step (a longer prompt runs alone)
    // The engines draft with EAGLE/MTP (vllm_eagle_block_drop): each replica's cache drops the last
    // matched block of a prefix hit, and the router's index knows it (set_eagle_block_drop).
    bool eagle_block_drop = false;
    void validate() const;  // throws Error on a bad value
};

struct PolicyReport {
    std::string name;
    HitRates hits;  // prompt tokens and blocks found in the chosen replica's cache at admission
    std::vector<int64_t> tokens_per_replica;  // prompt + output tokens of the requests served
    std::vector<int64_t> requests_per_replica;
    double load_max_over_mean = 0;  // of tokens_per_replica
    double ttft_mean_s = 0, ttft_p50_s = 0, ttft_p90_s = 0, ttft_p99_s = 0;
    double makespan_s = 0;  // first arrival to last completion
    double requests_per_s = 0;
    double output_tokens_per_s = 0;
    int64_t completed = 0;
    int64_t rejected = 0;  // prompt + output larger than a replica's whole cache
    int64_t evicted_blocks = 0;
    std::vector<int64_t> reasons;  // decisions per RouteReason (indexed by its value)
};

// Progress: (requests routed so far, total).
using SimProgress = std::function<void(int64_t done, int64_t total)>;

PolicyReport simulate(const Trace& trace, const SimConfig& config, const ServiceModel& service,
                      const SimProgress& progress = {});

// One LRU cache of capacity_blocks (a BlockManager) that sees every request in arrival order: what
// perfect routing without duplicated blocks reaches under LRU. Counts full prompt blocks only, as
// the replicas do; eagle_block_drop as SimConfig's.
HitRates pooled_lru_hit_rates(const Trace& trace, int64_t capacity_blocks,
                              bool eagle_block_drop = false);

// Percentile (0..100) of unsorted values, by linear interpolation between order statistics.
double percentile(std::vector<double> values, double p);

struct SimReport {
    std::string trace;
    int64_t requests = 0;
    int64_t skipped_lines = 0;
    double trace_duration_s = 0;
    int num_replicas = 0;
    int block_tokens = 0;
    int64_t replica_capacity_blocks = 0;
    std::string setup;  // model, hardware, layout, in words
    HitRates infinite_cache;
    HitRates pooled_lru;
    std::vector<PolicyReport> policies;
};

std::string to_json(const SimReport& r);
// A self-contained SVG: token hit rate per policy against the two bounds, and max/mean load.
std::string render_svg(const SimReport& r);

}  // namespace kvshard
