#include "kvshard/serve/disagg.h"

#include "kvshard/common/error.h"
#include "kvshard/transfer/rma_read.h"
#include "serve/disagg_run.h"

namespace kvshard {

const char* prefill_route_name(PrefillRoute r) {
    return r == PrefillRoute::kLeastTokens ? "least-tokens" : "round-robin";
}

PrefillRoute parse_prefill_route(const std::string& s) {
    if (s == "round-robin") return PrefillRoute::kRoundRobin;
    if (s == "least-tokens") return PrefillRoute::kLeastTokens;
    throw Error(detail::concat("prefill route '", s,
                               "': valid are round-robin (request i to replica i % dp) and "
                               "least-tokens (to the replica with the fewest prompt tokens)"));
}

void DisaggOptions::validate() const {
    require(max_new_tokens >= 1, "max_new_tokens must be at least 1, got ", max_new_tokens);
    require(prefill_block_size >= 1 && decode_block_size >= 1,
            "block sizes must be at least 1, got prefill ", prefill_block_size, ", decode ",
            decode_block_size);
    transfer.validate();
    require(!rma_read || transfer.direct_read,
            "RMA reads are direct reads: they need transfer.direct_read (--direct-read rma sets "
            "both)");
    require(!rma_read || prefill_order == decode_order,
            "RMA reads post one MPI_Rget per run contiguous in both pools; between ",
            prefill_order == PageOrder::kHnd ? "HND" : "NHD", " and ",
            decode_order == PageOrder::kHnd ? "HND" : "NHD",
            " pools every run is one head vector: use the same page order on both sides, or "
            "messages (--direct-read off), which reshape on one side");
}

DisaggReport disagg_generate(const ModelSpec& m, const ParallelConfig& prefill,
                             const ParallelConfig& decode, const TensorSource& weights,
                             const std::vector<std::vector<int32_t>>& prompts,
                             const DisaggOptions& opt, Communicator& world) {
    using namespace serve;
    DisaggPlan plan = plan_requests(m, prefill, decode, prompts, opt, world.size());
    const int me = world.rank();
    const bool is_prefill = me < plan.prefill_ranks;
    auto group = world.split(is_prefill ? 0 : 1, me);

    // Executors first (weights are loaded outside the timed part), then a common start.
    SideExecutor side = make_side_executor(plan, opt, weights, prompts, is_prefill,
                                           is_prefill ? me : me - plan.prefill_ranks, *group);
    TransferExecOptions xo = opt.transfer;
    xo.src_world_base = 0;
    xo.dst_world_base = plan.prefill_ranks;
    xo.arena_views = std::make_shared<SharedArenaViews>();  // this rank's, for its requests
    xo.staging_pool = StagingPool::create();                // this rank's, shared by its requests
    // RMA reads: a window over every prefill pool, made collectively here, freed (collectively)
    // when xo goes at the end of the run on every rank.
    if (opt.rma_read)
        xo.rma_window =
            std::make_shared<RmaPoolWindow>(world, is_prefill ? &side.model().pool() : nullptr);
    if (plan.cp_prefill || plan.cp_decode) share_cp_tables(plan, opt, side, world);
    world.barrier();
    const auto t0 = Clock::now();
    RankTimes times = start_times(t0);
    std::vector<RequestResult> results;
    if (is_prefill)
        run_prefill_side(plan, opt, prompts, side, world, xo, t0, times, results);
    else
        run_decode_side(plan, opt, side, world, *group, xo, t0, times, results);
    return merge_disagg_report(plan, opt, gather_contributions(&world, times, results));
}

}  // namespace kvshard
