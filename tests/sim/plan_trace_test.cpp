// plan_trace_workload (sim/planner_service.h): what `kvshard plan --trace` takes from a replay.
#include <gtest/gtest.h>

#include "kvshard/model/catalog.h"
#include "kvshard/sim/planner_service.h"
#include "kvshard/sim/trace.h"

namespace kvshard {
namespace {

TEST(PlanTraceWorkload, LengthsAreTheTracesAndTheHitRateIsTheReplays) {
    const Trace trace =
        load_trace(std::string(KVSHARD_TEST_DATA_DIR) + "/mooncake_conversation_head300.jsonl",
                   TraceErrorPolicy::kFail);
    const ModelSpec m = catalog_model("llama-3.1-8b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    PlanRequest r;
    r.gpus = 8;
    const TraceWorkload kv = plan_trace_workload(trace, m, hw, r, RoutingPolicy::kKvshard);
    ASSERT_EQ(kv.requests, static_cast<int64_t>(trace.requests.size()));
    ASSERT_EQ(kv.input_tokens.size(), trace.requests.size());
    int64_t in = 0;
    for (size_t i = 0; i < trace.requests.size(); ++i) {
        EXPECT_EQ(kv.input_tokens[i], trace.requests[i].input_tokens);
        in += trace.requests[i].input_tokens;
    }
    EXPECT_NEAR(double(kv.mean_input_tokens), double(in) / trace.requests.size(), 0.5);
    EXPECT_GE(kv.replicas, 1);
    EXPECT_GT(kv.token_hit_rate, 0);
    // No replay beats one infinite cache that sees every request.
    EXPECT_LE(kv.token_hit_rate, infinite_cache_hit_rates(trace).token_hit_rate + 1e-12);
    // Spreading requests without looking at prefixes finds no more of them cached.
    const TraceWorkload rr = plan_trace_workload(trace, m, hw, r, RoutingPolicy::kRoundRobin);
    EXPECT_EQ(rr.replicas, kv.replicas);
    if (kv.replicas > 1) {
        EXPECT_LE(rr.token_hit_rate, kv.token_hit_rate);
    }
}

// Speculating with MTP (vLLM's method "mtp" is one of SpeculativeConfig.use_eagle()'s), the
// replayed engines drop the last matched block of every prefix hit, so the hit rate the planner
// uses falls.
TEST(PlanTraceWorkload, MtpEnginesReplayWithTheEagleBlockDrop) {
    const Trace trace =
        load_trace(std::string(KVSHARD_TEST_DATA_DIR) + "/mooncake_conversation_head300.jsonl",
                   TraceErrorPolicy::kFail);
    const ModelSpec m = catalog_model("glm-4.5-air");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    PlanRequest r;
    r.gpus = 8;  // one replica of tp 8: 5.3% of prompt tokens hit, 1.3% with the drop
    const TraceWorkload plain = plan_trace_workload(trace, m, hw, r, RoutingPolicy::kKvshard);
    r.capacity.speculative_tokens = 2;
    const TraceWorkload spec = plan_trace_workload(trace, m, hw, r, RoutingPolicy::kKvshard);
    EXPECT_GT(spec.token_hit_rate, 0);
    EXPECT_LT(spec.token_hit_rate, plain.token_hit_rate);
}

}  // namespace
}  // namespace kvshard
