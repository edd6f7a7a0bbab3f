#include "kvshard/router/batch_route.h"

#include "kvshard/cache/block_hash.h"
#include "kvshard/common/error.h"

namespace kvshard {

BatchRoute route_prompts(const std::vector<std::vector<int32_t>>& prompts, int dp, int block_size,
                         RoutingPolicy policy, PolicyParams params) {
    require(block_size >= 1, "routing: block size must be at least 1, got ", block_size);
    params.block_tokens = block_size;
    params.validate();
    Router router(dp, policy, params);  // exact index: fed below with what each replica stores
    std::vector<ReplicaLoad> loads(static_cast<size_t>(dp));
    BatchRoute out;
    out.prompts_per_replica.assign(static_cast<size_t>(dp), 0);
    for (const auto& p : prompts) {
        const std::vector<BlockHash> hashes = hash_token_blocks(p, block_size);
        const RouteDecision d = router.route(
            {.block_hashes = hashes, .num_tokens = static_cast<int64_t>(p.size())}, loads, 0.0);
        router.index().block_stored(d.replica, hashes);
        loads[static_cast<size_t>(d.replica)].queued_prefill_tokens +=
            static_cast<int64_t>(p.size());
        ++out.prompts_per_replica[static_cast<size_t>(d.replica)];
        out.replica_of.push_back(d.replica);
        out.decisions.push_back(d);
    }
    return out;
}

}  // namespace kvshard
