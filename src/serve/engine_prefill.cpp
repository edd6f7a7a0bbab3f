#include "kvshard/serve/engine_prefill.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>

#include "kvshard/comm/threads.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "serve/runner.h"

namespace kvshard {

namespace {

void check_inputs(const KvLayout& layout, std::span<const int32_t> tokens,
                  std::span<const int32_t> block_table, const EnginePrefillOptions& opt) {
    const ParallelConfig& p = layout.parallel;
    require(p.dp == 1 && p.cp == 1,
            "a prefill into the caller's memory runs one replica without "
            "context parallelism (dp=1, cp=1; tp, pp and ep any), got ",
            p.to_string());
    require(opt.block_size >= 1 && opt.block_size <= (1 << 20),
            "block size must be in [1, 2^20] tokens, got ", opt.block_size);
    require(!tokens.empty(), "a prefill needs at least one token");
    for (int32_t t : tokens)
        require(t >= 0 && t < layout.model.vocab, "token id ", t, " is outside the vocabulary [0, ",
                layout.model.vocab, ")");
    const int64_t need =
        (static_cast<int64_t>(tokens.size()) + opt.block_size - 1) / opt.block_size;
    require(static_cast<int64_t>(block_table.size()) == need, "the block table names ",
            block_table.size(), " block(s) but ", tokens.size(), " tokens in blocks of ",
            opt.block_size, " need ", need);
    std::set<int32_t> seen;
    for (int32_t b : block_table) {
        require(b >= 0, "block id ", b, " in the block table is negative");
        require(seen.insert(b).second, "block ", b, " appears twice in the block table");
    }
}

// Runs the prefill on every rank; make_model(rank, weights) builds the rank's model; after the
// forward, done(rank, model) sees it. Returns the last stage's logits.
std::vector<float> run_prefill(
    const KvLayout& layout, const TensorSource& weights, std::span<const int32_t> tokens,
    std::span<const int32_t> block_table, const EnginePrefillOptions& opt,
    const std::function<RankModel(int, ModelWeights, RankComms)>& make_model,
    const std::function<void(int, RankModel&)>& done) {
    const ParallelConfig& p = layout.parallel;
    const ModelSpec& m = layout.model;
    std::vector<float> logits;
    std::mutex mu;
    run_threads(p.world_size(), [&](Communicator& w) {
        const int rank = w.rank();
        serve::RankWiring wiring = serve::wire_rank(&w, p, rank);
        RankModel model =
            make_model(rank, load_weights(m, weight_shard(layout, rank), weights), wiring.comms);
        ForwardBatch fb;
        const std::vector<int32_t> table(block_table.begin(), block_table.end());
        const auto n = static_cast<int64_t>(tokens.size());
        fb.token_ids.assign(tokens.begin(), tokens.end());
        for (int64_t t = 0; t < n; ++t) fb.slots.push_back(t);
        fb.queries.add_sequence(n, 0);
        fb.kv.add_sequence(table, n, opt.block_size);
        std::vector<float> lg = model.forward(fb);
        if (!lg.empty() && rank_coord(p, rank).tp == 0) {
            std::lock_guard lock(mu);
            logits = std::move(lg);
        }
        done(rank, model);
    });
    return logits;
}

}  // namespace

std::vector<float> prefill_into_memory(const KvLayout& layout, const TensorSource& weights,
                                       std::span<const int32_t> tokens,
                                       std::span<const int32_t> block_table,
                                       const std::vector<std::vector<ExternalMemory>>& memory,
                                       const EnginePrefillOptions& opt) {
    check_inputs(layout, tokens, block_table, opt);
    require(static_cast<int>(memory.size()) == layout.world_size(), "memory for ", memory.size(),
            " rank(s) given but ", layout.parallel.to_string(), " has ", layout.world_size());
    const int32_t last = *std::max_element(block_table.begin(), block_table.end());
    return run_prefill(
        layout, weights, tokens, block_table, opt,
        [&](int rank, ModelWeights w, RankComms comms) {
            try {
                RankModel model(std::move(w), opt.block_size, memory[size_t(rank)], comms,
                                opt.order);
                for (int i = 0; i < model.num_pools(); ++i)
                    require(last < model.pool_at(i).num_blocks(), "block ", last,
                            " of the block table is outside pool ", i, "'s ",
                            model.pool_at(i).num_blocks(), " blocks");
                return model;
            } catch (const Error& e) {
                throw Error(detail::concat("rank ", rank, "'s memory: ", e.what()));
            }
        },
        [](int, RankModel&) {});
}

std::vector<float> prefill_into_own_pools(
    const KvLayout& layout, const TensorSource& weights, std::span<const int32_t> tokens,
    std::span<const int32_t> block_table, int64_t num_blocks,
    std::vector<std::vector<std::vector<std::byte>>>& pools_out, const EnginePrefillOptions& opt) {
    check_inputs(layout, tokens, block_table, opt);
    require(num_blocks >= 1 && num_blocks <= (int64_t{1} << 26),
            "the pools' block count must be in [1, 2^26], got ", num_blocks);
    for (int32_t b : block_table)
        require(b < num_blocks, "block ", b, " is outside the pools' ", num_blocks, " blocks");
    pools_out.assign(size_t(layout.world_size()), {});
    return run_prefill(
        layout, weights, tokens, block_table, opt,
        [&](int, ModelWeights w, RankComms comms) {
            return RankModel(std::move(w), num_blocks, opt.block_size, comms, opt.order);
        },
        [&](int rank, RankModel& model) {
            auto& out = pools_out[size_t(rank)];
            for (int i = 0; i < model.num_pools(); ++i) {
                const auto arena = model.pool_at(i).arena();
                out.emplace_back(arena.begin(), arena.end());
            }
        });
}

}  // namespace kvshard
