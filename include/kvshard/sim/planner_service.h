#pragma once
// The simulator's replicas as the planner sees them: KV capacity from compute_capacity and engine
// step times from the roofline cost model (estimate_cost). docs/router.md, "Service times".
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvshard/layout/parallel_config.h"
#include "kvshard/model/model_spec.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/cost_model.h"
#include "kvshard/planner/hardware.h"
#include "kvshard/planner/planner.h"
#include "kvshard/sim/simulator.h"

namespace kvshard {

// One DP replica: a model on `parallel.tp * parallel.pp * parallel.cp` GPUs (parallel.dp must be
// 1).
struct ReplicaSetup {
    ModelSpec model;
    HardwareSpec hardware;
    ParallelConfig parallel;
    CapacityOptions capacity;
    CostOptions cost;
    std::string to_string() const;  // "llama-3.1-70b on h100-sxm, dp=1 pp=1 cp=1 tp=8 ep=1"
};

// KV tokens one replica holds (the planner's kv_tokens_per_gpu: every GPU of the replica holds
// its share of the same tokens). Throws Error when the model does not fit.
int64_t replica_kv_tokens(const ReplicaSetup& setup);

// Step times from estimate_cost, memoized (the simulator asks millions of times):
//  prefill_s(n)          = estimate_cost(prompt_tokens = n').prefill.total_s, n' = n rounded up to
//                          a multiple of prefill_quantum tokens;
//  decode_step_s(B, ctx) = estimate_cost(batch = B, context_tokens = ceil(ctx / B) rounded up to a
//                          multiple of context_quantum).decode.total_s.
// The prefill of the uncached part of a prompt is costed as a fresh prompt of that many tokens
// (attention over the cached prefix is not added).
class PlannerServiceModel final : public ServiceModel {
  public:
    explicit PlannerServiceModel(ReplicaSetup setup, int64_t prefill_quantum = 32,
                                 int64_t context_quantum = 128);
    double prefill_s(int64_t new_tokens) const override;
    double decode_step_s(int64_t batch, int64_t context_tokens) const override;
    const ReplicaSetup& setup() const { return setup_; }

  private:
    ReplicaSetup setup_;
    int64_t prefill_quantum_, context_quantum_;
    mutable std::unordered_map<int64_t, double> prefill_memo_;
    mutable std::unordered_map<uint64_t, double> decode_memo_;
};

// What a trace says about the planner's workload: its mean prompt and output lengths, and the
// prefix-hit rate its replay reaches over `replicas` replicas of `setup` under `policy` (each
// replica's cache as large as its KV capacity, replica_kv_tokens), so the planner prefills only
// the uncached share of a prompt. With setup.capacity.speculative_tokens > 0 (MTP drafting) the
// replicas drop the last block of each prefix hit, as vLLM's engines do
// (SimConfig::eagle_block_drop).
struct TraceWorkload {
    int64_t requests = 0;
    int64_t mean_input_tokens = 0;   // rounded
    int64_t mean_output_tokens = 0;  // rounded, at least 1
    int64_t p90_input_tokens = 0;
    std::vector<int64_t> input_tokens;  // every request's, in trace order (the distribution)
    double token_hit_rate = 0;          // hit prompt tokens / prompt tokens, from simulate()
    std::string policy;
    int replicas = 0;
};
TraceWorkload trace_workload(const Trace& trace, const ReplicaSetup& setup, int replicas,
                             RoutingPolicy policy);

// What `kvshard plan --trace` replays: the trace over the replicas of the best configuration
// plan(m, hw, r) ranks for it (r.context_tokens = the trace's mean input + output when 0; r's
// capacity, cost and weight options), under `policy`. Throws Error when nothing fits.
TraceWorkload plan_trace_workload(const Trace& trace, const ModelSpec& m, const HardwareSpec& hw,
                                  PlanRequest r, RoutingPolicy policy);

}  // namespace kvshard
