#include "kvshard/sim/planner_service.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvshard/common/error.h"

namespace kvshard {

std::string ReplicaSetup::to_string() const {
    return detail::concat(model.name, " on ", hardware.name, ", ", parallel.to_string());
}

int64_t replica_kv_tokens(const ReplicaSetup& s) {
    require(s.parallel.dp == 1,
            "a replica's layout must have dp=1 (replicas are counted apart), got ",
            s.parallel.to_string());
    const CapacityReport c = compute_capacity(s.model, s.parallel, s.hardware, s.capacity);
    require(c.fits && c.kv_tokens_per_gpu > 0, s.to_string(), ": no room for KV: ", c.why_not);
    return c.kv_tokens_per_gpu;
}

PlannerServiceModel::PlannerServiceModel(ReplicaSetup setup, int64_t prefill_quantum,
                                         int64_t context_quantum)
    : setup_(std::move(setup)),
      prefill_quantum_(prefill_quantum),
      context_quantum_(context_quantum) {
    require(prefill_quantum_ >= 1 && context_quantum_ >= 1,
            "service model: quanta must be positive");
    require(setup_.parallel.dp == 1, "a replica's layout must have dp=1, got ",
            setup_.parallel.to_string());
}

double PlannerServiceModel::prefill_s(int64_t new_tokens) const {
    const int64_t n = std::max<int64_t>(1, (new_tokens + prefill_quantum_ - 1) / prefill_quantum_) *
                      prefill_quantum_;
    const auto it = prefill_memo_.find(n);
    if (it != prefill_memo_.end()) return it->second;
    Workload w;
    w.prompt_tokens = n;
    w.context_tokens = n;
    w.batch = 1;
    const double t = estimate_cost(setup_.model, setup_.parallel, setup_.hardware, w, setup_.cost)
                         .prefill.total_s;
    prefill_memo_.emplace(n, t);
    return t;
}

double PlannerServiceModel::decode_step_s(int64_t batch, int64_t context_tokens) const {
    batch = std::max<int64_t>(batch, 1);
    const int64_t per = std::max<int64_t>(1, (context_tokens + batch - 1) / batch);
    const int64_t q = (per + context_quantum_ - 1) / context_quantum_;
    const uint64_t key = (static_cast<uint64_t>(batch) << 32) ^ static_cast<uint64_t>(q);
    const auto it = decode_memo_.find(key);
    if (it != decode_memo_.end()) return it->second;
    Workload w;
    w.prompt_tokens = 1;
    w.context_tokens = q * context_quantum_;
    w.batch = batch;
    const double t = estimate_cost(setup_.model, setup_.parallel, setup_.hardware, w, setup_.cost)
                         .decode.total_s;
    decode_memo_.emplace(key, t);
    return t;
}

TraceWorkload trace_workload(const Trace& trace, const ReplicaSetup& setup, int replicas,
                             RoutingPolicy policy) {
    require(!trace.requests.empty(), "the trace '", trace.source, "' holds no requests");
    require(replicas >= 1, "the replay needs at least one replica, got ", replicas);
    TraceWorkload w;
    w.requests = static_cast<int64_t>(trace.requests.size());
    double in = 0, out = 0;
    std::vector<double> inputs;
    for (const TraceRequest& r : trace.requests) {
        in += static_cast<double>(r.input_tokens);
        out += static_cast<double>(r.output_tokens);
        inputs.push_back(static_cast<double>(r.input_tokens));
        w.input_tokens.push_back(r.input_tokens);
    }
    const double n = static_cast<double>(w.requests);
    w.mean_input_tokens = std::max<int64_t>(1, std::llround(in / n));
    w.mean_output_tokens = std::max<int64_t>(1, std::llround(out / n));
    w.p90_input_tokens = std::llround(percentile(inputs, 90));
    const int64_t capacity_tokens = replica_kv_tokens(setup);
    require(capacity_tokens >= trace.block_tokens, "each replica of ", setup.to_string(), " holds ",
            capacity_tokens, " KV tokens, less than one ", trace.block_tokens,
            "-token trace block");
    const PlannerServiceModel service(setup);
    SimConfig cfg;
    cfg.num_replicas = replicas;
    cfg.replica_capacity_blocks = capacity_tokens / trace.block_tokens;
    cfg.policy = policy;
    // MTP drafting is one of vLLM's use_eagle() methods: its engines drop the last block of each
    // prefix hit (vllm_eagle_block_drop).
    cfg.eagle_block_drop = setup.capacity.speculative_tokens > 0;
    const PolicyReport rep = simulate(trace, cfg, service);
    w.token_hit_rate = rep.hits.token_hit_rate;
    w.policy = rep.name;
    w.replicas = replicas;
    return w;
}

TraceWorkload plan_trace_workload(const Trace& trace, const ModelSpec& m, const HardwareSpec& hw,
                                  PlanRequest r, RoutingPolicy policy) {
    require(!trace.requests.empty(), "the trace '", trace.source, "' holds no requests");
    if (r.context_tokens == 0) {
        double in = 0, out = 0;
        for (const TraceRequest& q : trace.requests) {
            in += static_cast<double>(q.input_tokens);
            out += static_cast<double>(q.output_tokens);
        }
        const double n = static_cast<double>(trace.requests.size());
        r.context_tokens = std::max<int64_t>(1, std::llround(in / n)) +
                           std::max<int64_t>(1, std::llround(out / n));
    }
    const std::vector<PlanEntry> ranked = plan(m, hw, r);
    require(!ranked.empty() && ranked.front().fits, "no configuration of ", r.gpus, " GPUs fits ",
            m.name, " at ", r.context_tokens, " tokens, so the trace '", trace.source,
            "' cannot be replayed");
    ReplicaSetup setup;
    setup.model = m;
    setup.hardware = hw;
    setup.parallel = ranked.front().parallel;
    const int replicas = setup.parallel.dp;
    setup.parallel.dp = 1;
    setup.capacity = r.capacity;
    setup.capacity.weight_dtype = r.weight_dtype;
    setup.cost = r.cost;
    setup.cost.weight_dtype = r.weight_dtype;
    return trace_workload(trace, setup, replicas, policy);
}

}  // namespace kvshard
