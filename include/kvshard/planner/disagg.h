#pragma once
// Disaggregated serving search (docs/cost-model.md, "Disaggregated serving"): N GPUs split into a
// pool of prefill instances and a pool of decode instances, each instance its own layout (dp = 1),
// the KV of each request moved from a prefill instance to a decode instance as kvshard's transfer
// plan (transfer/transfer_plan.h) moves it; aggregated configurations (every replica prefills and
// decodes) ranked in the same list. Objective: output tokens per second per GPU with TTFT and
// TPOT within their service-level objectives.
#include <cstdint>
#include <string>
#include <vector>

#include "kvshard/layout/parallel_config.h"
#include "kvshard/model/model_spec.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/cost_model.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {

struct ServingRequest {
    int gpus = 0;
    int64_t prompt_tokens = 0;  // per request (the mean when prompt_samples are given)
    // Prompt lengths of the requests (e.g. a trace's): prefill time is averaged over them and the
    // prefill queue is M/G/1 with their spread; empty: every prompt has prompt_tokens. The KV
    // transfer and the decode context use prompt_tokens. Each must be in [1, 2^26] and, unless
    // capacity.allow_long_context, below the model's max_model_len (a prompt vLLM accepts).
    std::vector<int64_t> prompt_samples;
    int64_t output_tokens = 256;
    // Share of prompt tokens found in the prefix cache (from a trace replay, sim/): only the rest
    // is prefilled. The KV moved to a decode instance is still the whole prompt's.
    double prefix_hit_rate = 0;
    static constexpr double kMaxSloS = 1e6;  // SLOs are in (0, kMaxSloS] seconds
    double ttft_slo_s = 0;                   // required
    double tpot_slo_s = 0;                   // required
    int64_t max_batch = 256;
    CpScheme cp_scheme = CpScheme::kZigzag;
    // capacity.speculative_tokens > 0 (MTP drafting): both pools speculate, as vLLM's P/D runs
    // (the prefill instance is started with the same --speculative-config: its MTP layers draft
    // at the end of the prefill, vllm-project/vllm PR #55055 "Fix decode instance's multi-layer
    // MTP kv caches during P/D", and the decode instance needs their KV): every instance holds the
    // drafter's weights and its layers' KV, and a request's transfer moves those layers' KV too
    // (they share the KV cache groups of the model's own layers). Layouts at pp 1 only.
    CapacityOptions capacity;
    CostOptions cost;
    WeightDtype weight_dtype = WeightDtype::kModel;
    bool disaggregated = true;  // false: aggregated configurations only
    void validate() const;      // throws Error naming the bad field
};

// One request's KV move from a prefill instance to a decode instance, priced from the transfer plan
// (make_transfer_plan of the two layouts, one message per (source, destination) pair and layer
// group, streamed layer by layer as the prefill writes them).
struct KvTransferCost {
    int64_t bytes = 0;               // TransferPlan::bytes for the whole prompt
    int64_t messages = 0;            // TransferPlan::messages.size() with one layer group
    int64_t layerwise_messages = 0;  // messages when every layer is sent on its own
    int64_t busiest_rank_bytes = 0;  // the most one prefill GPU sends or one decode GPU receives
    bool crosses_nodes = true;       // instances on different nodes: the inter-node link
    double transfer_s = 0;  // busiest GPU: launch + messages * alpha + bytes / link bandwidth
    // What is left after the prefill ends: layers stream while later layers compute, so at best
    // the last layer's share, and at worst everything that did not fit in the prefill time.
    double exposed_s = 0;
};

KvTransferCost price_kv_transfer(const ModelSpec& m, const ParallelConfig& prefill,
                                 const ParallelConfig& decode, const HardwareSpec& hw,
                                 int64_t tokens, double prefill_s, int block_size = 16);

struct ServingEntry {
    bool disaggregated = false;
    // Aggregated: prefill == decode == the configuration (dp = its replicas), instances = dp.
    // Disaggregated: one instance's layout each (dp = 1).
    ParallelConfig prefill, decode;
    int prefill_instances = 0, decode_instances = 0;
    int gpus_used = 0;
    int64_t prefill_tokens = 0;       // tokens one request prefills (prompt minus the prefix hit)
    double prefill_s = 0;             // one request's prefill on an instance
    KvTransferCost transfer;          // disaggregated only
    int64_t decode_batch = 0;         // requests decoding together per decode instance
    double step_s = 0;                // one decode step at decode_batch (no prefill interference)
    double queue_s = 0;               // mean wait for a prefill instance (M/G/1) at the chosen rate
    double ttft_s = 0;                // queue + prefill + exposed transfer
    double tpot_s = 0;                // aggregated: the step stretched by the prefills mixed in
    double requests_per_s = 0;        // all instances
    double tokens_per_s_per_gpu = 0;  // output tokens / s / GPU used
    bool meets_slo = false;
    std::string why_not;       // empty when meets_slo
    std::string name() const;  // "tp8 x2" or "P tp4 x2 + D tp8 x1"
};

// Aggregated configurations (every (dp, pp, cp, tp, ep) for the N GPUs) and, when
// r.disaggregated, every prefill layout x decode layout x instance counts that fit in N GPUs; those
// meeting both SLOs first, by tokens_per_s_per_gpu (descending), then the rest.
std::vector<ServingEntry> plan_serving(const ModelSpec& m, const HardwareSpec& hw,
                                       const ServingRequest& r);

std::string serving_to_json(const ModelSpec& m, const HardwareSpec& hw, const ServingRequest& r,
                            const std::vector<ServingEntry>& entries);

// TPOT against output tokens/s/GPU of the entries meeting the TTFT SLO (log x), with the Pareto
// fronts of aggregated and disaggregated configurations drawn together.
std::string serving_to_svg(const ModelSpec& m, const HardwareSpec& hw, const ServingRequest& r,
                           const std::vector<ServingEntry>& entries);

}  // namespace kvshard
