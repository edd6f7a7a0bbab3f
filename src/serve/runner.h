#pragma once
// Internal to src/serve: what every driver (one group, CP, prefill group -> decode group) does the
// same way on a rank: its communicators, the greedy tokens of a pipeline step, its blocks, and the
// gathering of every rank's report row and request results.
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "common/byte_buffer.h"
#include "kvshard/comm/communicator.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/layout/parallel_config.h"
#include "kvshard/serve/generate.h"

namespace kvshard::serve {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The communicators of one rank of layout p inside `group` (group ranks in p's rank order; null:
// a group of one). TP and EP groups of one rank stay null (RankModel then skips their collectives).
struct RankWiring {
    std::unique_ptr<Communicator> tp, ep;
    RankComms comms;
};
RankWiring wire_rank(Communicator* group, const ParallelConfig& p, int rank);

// The greedy tokens of one pipeline step of `batch` sequences: the last stage takes the argmax of
// each sequence's [vocab] row of `logits` and sends them to the earlier stages of its (dp, cp, tp)
// column, which receive them. Group ranks are in p's rank order.
std::vector<int32_t> pass_greedy_tokens(Communicator* group, const ParallelConfig& p,
                                        const RankCoord& c, std::span<const float> logits,
                                        int batch, int vocab, int tag);

// Blocks for sequences of prompt length + extra tokens each: sum of ceil((len + extra) / bs), + 1.
int64_t blocks_for(const std::vector<int64_t>& lengths, int64_t extra, int block_size);
// Consecutive block tables: request i uses the next ceil(lengths[i] / bs) block ids. total_blocks:
// how many that is (at least 1).
std::vector<std::vector<int32_t>> consecutive_tables(const std::vector<int64_t>& lengths,
                                                     int block_size, int64_t& total_blocks);

// What a rank says about one request.
struct RequestResult {
    // A request's output (has_output) or a prefill rank's logits of it.
    static RequestResult output(int64_t id, std::vector<int32_t> tokens,
                                std::vector<float> last_logits) {
        RequestResult r;
        r.id = id;
        r.has_output = true;
        r.tokens = std::move(tokens);
        r.last_logits = std::move(last_logits);
        return r;
    }
    int64_t id = 0;
    bool has_output = false;  // tokens, failed and last_logits are meaningful
    std::vector<int32_t> tokens;
    std::vector<float> last_logits;
    bool failed = false;
    std::string error;
};
template <typename Row>
struct RankContribution {
    Row row;
    std::vector<RequestResult> results;
};
void put_results(ByteWriter& w, const std::vector<RequestResult>& results);
std::vector<RequestResult> get_results(ByteReader& rd);

// All-gathers every rank's row (trivially copyable) and request results over `world` (null: one
// rank). Every rank gets all of them, by rank.
template <typename Row>
std::vector<RankContribution<Row>> gather_contributions(Communicator* world, const Row& row,
                                                        const std::vector<RequestResult>& results) {
    static_assert(std::is_trivially_copyable_v<Row>);
    ByteWriter w;
    w.put(row);
    put_results(w, results);
    std::vector<std::vector<std::byte>> blobs;
    if (world)
        blobs = world->all_gather_blobs(w.bytes());
    else
        blobs.push_back(w.bytes());
    std::vector<RankContribution<Row>> out;
    for (const auto& blob : blobs) {
        ByteReader rd(blob);
        RankContribution<Row> c;
        c.row = rd.get<Row>();
        c.results = get_results(rd);
        out.push_back(std::move(c));
    }
    return out;
}

// One group's report: every rank's row, the replica totals counted once per replica (from its
// (pp, cp, tp) = 0 rank), the slowest rank's times, and each prompt's results.
struct GroupRow {
    RankReport report;
    int64_t replica_prompt_tokens = 0;
    int64_t replica_computed_tokens = 0;
    int64_t replica_hit_tokens = 0;
};
GenerationReport merge_group_report(const std::vector<RankContribution<GroupRow>>& rows,
                                    size_t num_prompts);

}  // namespace kvshard::serve
