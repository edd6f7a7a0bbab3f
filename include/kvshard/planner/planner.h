#pragma once
// Planner: enumerate every valid (dp, pp, cp, tp, ep) for N GPUs, size each with the capacity
// model, time it with the cost model, mark those that do not fit and rank the rest.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/planner/capacity.h"
#include "kvshard/planner/cost_model.h"

namespace kvshard {

enum class Objective { kTtft, kTpot, kThroughput };
std::string_view objective_name(Objective o);
Objective parse_objective(std::string_view s);  // ttft|tpot|throughput

struct PlanRequest {
    int gpus = 0;
    int64_t context_tokens = 0;  // prompt = context for TTFT; decode at this context for TPOT
    // Requests decoding together per DP replica; 0: as many as fit, capped at max_batch.
    int64_t batch = 0;
    int64_t max_batch = 256;
    Objective objective = Objective::kThroughput;
    CpScheme cp_scheme = CpScheme::kZigzag;  // token ownership used for cp > 1
    CapacityOptions capacity;
    CostOptions cost;
    // Weight storage (capacity.h); evaluate_config passes it to both capacity and cost.
    WeightDtype weight_dtype = WeightDtype::kModel;
    // Share of the prompt found in the prefix cache (e.g. a trace replay's, sim/): TTFT prefills
    // only the rest (attention over the cached prefix not counted, as sim's PlannerServiceModel).
    double prefix_hit_rate = 0;
    void validate() const;
};

struct PlanEntry {
    ParallelConfig parallel;
    CapacityReport capacity;
    CostReport cost;
    int64_t batch = 0;  // the batch per replica the cost was evaluated at
    bool fits = false;
};

// All (dp, pp, cp, tp, ep) with dp*pp*cp*tp = gpus that pass validate(); ep ranges over the
// divisors of the expert count that divide dp*cp*tp (1 only for dense models). In a fixed order.
std::vector<ParallelConfig> enumerate_configs(const ModelSpec& m, int gpus, CpScheme cp_scheme);

// Sizes and costs one configuration for the request (its world size must equal r.gpus): what plan()
// does for each enumerated configuration.
PlanEntry evaluate_config(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& r,
                          const ParallelConfig& p);

// Fitting entries first, best first by the objective (ties: fewer GPUs per model instance first,
// then larger KV capacity); then the rest in enumeration order.
std::vector<PlanEntry> plan(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& r);

// {"model","hardware","gpus","context","objective","configs":[{"dp","pp","cp","tp","ep","fits",
//  "kv_tokens_per_gpu","max_context","ttft_s","tpot_s",...}]}
std::string plan_to_json(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& r,
                         const std::vector<PlanEntry>& entries);

// A hand-written SVG chart: TTFT against TPOT of the fitting configurations (log scales) with the
// objective's best marked, and the non-fitting ones listed.
std::string plan_to_svg(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& r,
                        const std::vector<PlanEntry>& entries);

}  // namespace kvshard
