#pragma once
// Routing a batch of prompts over DP replicas, in order, with a router that sees each routed
// prompt's blocks stored on its replica: what `kvshard run --dp N --route POLICY` assigns. The
// reference run prefills each replica's prompts together, so a later prompt finds an earlier one's
// full blocks in its replica's prefix cache, and the router knows it.
#include <cstdint>
#include <vector>

#include "kvshard/router/policy.h"

namespace kvshard {

struct BatchRoute {
    std::vector<int> replica_of;           // per prompt
    std::vector<RouteDecision> decisions;  // per prompt: replica, matched blocks, reason
    std::vector<int> prompts_per_replica;
};

// Prompt i's block hashes are kvshard's chained hashes of its full blocks of block_size tokens
// (the BlockManager's); load is the prompt tokens routed to each replica so far (queued prefill).
// Error when dp is outside [1, 64] (the router's replicas), block_size < 1, or the parameters are
// out of range.
BatchRoute route_prompts(const std::vector<std::vector<int32_t>>& prompts, int dp, int block_size,
                         RoutingPolicy policy, PolicyParams params = {});

}  // namespace kvshard
