// Capacity of models with windowed layers: requests of a context counted by what each group keeps.
#include <gtest/gtest.h>

#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {
namespace {

TEST(CapacityWindows, CapacityCountsRequestsByTheirWindows) {
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    CapacityOptions o;
    o.context_tokens = 131072;
    ParallelConfig p;
    p.tp = 8;
    const ModelSpec m = catalog_model("gpt-oss-120b");
    const CapacityReport rep = compute_capacity(m, p, hw, o);
    const CapacityReport full = compute_capacity(with_full_attention(m), p, hw, o);
    const KvLayout l = make_layout(m, p);
    // vLLM's arrangement: the sliding group's blocks at their most, ceil(128/16) + 1, and a block
    // a page in each of 18 layer slots (= request_kv_bytes_peak, no padding here).
    EXPECT_EQ(rep.request_blocks, 131072 / 16 + 9);
    EXPECT_EQ(rep.request_kv_bytes, request_kv_bytes_peak(l, 0, 131072, 16));
    EXPECT_EQ(rep.requests_per_replica, rep.kv_blocks_per_gpu / rep.request_blocks);
    // Half the layers keep 128 tokens instead of 131072: about twice the requests.
    EXPECT_GE(rep.requests_per_replica, 2 * full.requests_per_replica - 1);
    EXPECT_EQ(full.requests_per_replica,
              full.ranks[0].kv_budget_bytes / 16 / full.kv_bytes_per_token / (131072 / 16));
    // Every layer windowed: no context runs out (past the config's 32768 tokens, as vLLM with
    // VLLM_ALLOW_LONG_MAX_MODEL_LEN=1).
    o.allow_long_context = true;
    const CapacityReport mistral =
        compute_capacity(catalog_model("mistral-7b-v0.1"), ParallelConfig{}, hw, o);
    EXPECT_TRUE(mistral.context_unbounded);
    EXPECT_TRUE(mistral.fits);
}

}  // namespace
}  // namespace kvshard
