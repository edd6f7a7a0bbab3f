// route_prompts: a batch routed in order with each routed prompt's blocks recorded on its replica.
#include <gtest/gtest.h>

#include "kvshard/common/error.h"
#include "kvshard/router/batch_route.h"

namespace kvshard {
namespace {

std::vector<int32_t> prompt(int32_t prefix, int32_t tail, int prefix_len = 32, int len = 40) {
    std::vector<int32_t> p;
    for (int i = 0; i < prefix_len; ++i) p.push_back(prefix * 1000 + i);
    for (int i = prefix_len; i < len; ++i) p.push_back(tail * 1000 + i);
    return p;
}

// Two conversations A, A, B, B: round robin splits each over both replicas (no prefix on the
// replica it lands on); the cache-following policies keep each conversation on one replica (the
// cost policy need not: the queued prefill of the first counts against its replica).
TEST(BatchRoute, FollowsThePrefixWhereRoundRobinSplitsIt) {
    const std::vector<std::vector<int32_t>> prompts = {prompt(1, 1), prompt(1, 2), prompt(2, 3),
                                                       prompt(2, 4)};
    const BatchRoute rr = route_prompts(prompts, 2, 16, RoutingPolicy::kRoundRobin);
    EXPECT_EQ(rr.replica_of, (std::vector<int>{0, 1, 0, 1}));
    for (const auto& d : rr.decisions) EXPECT_EQ(d.matched_blocks, 0);
    for (RoutingPolicy policy : {RoutingPolicy::kKvshard, RoutingPolicy::kCacheAware}) {
        SCOPED_TRACE(std::string(routing_policy_name(policy)));
        const BatchRoute r = route_prompts(prompts, 2, 16, policy);
        EXPECT_EQ(r.replica_of[1], r.replica_of[0]);  // A follows A
        EXPECT_EQ(r.replica_of[3], r.replica_of[2]);  // B follows B
        EXPECT_EQ(r.decisions[1].matched_blocks, 2);  // the 32-token prefix: 2 blocks of 16
        EXPECT_EQ(r.decisions[3].matched_blocks, 2);
        EXPECT_EQ(r.prompts_per_replica[0] + r.prompts_per_replica[1], 4);
    }
}

TEST(BatchRoute, RejectsBadInput) {
    const std::vector<std::vector<int32_t>> prompts = {prompt(1, 1)};
    EXPECT_THROW(route_prompts(prompts, 0, 16, RoutingPolicy::kKvshard), Error);
    EXPECT_THROW(route_prompts(prompts, 2, 0, RoutingPolicy::kKvshard), Error);
}

}  // namespace
}  // namespace kvshard
