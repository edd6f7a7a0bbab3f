#include "serve/runner.h"

#include <algorithm>

#include "kvshard/comm/groups.h"
#include "kvshard/common/error.h"

namespace kvshard::serve {

RankWiring wire_rank(Communicator* group, const ParallelConfig& p, int rank) {
    RankWiring w;
    w.comms.world = group;
    if (!group) return w;
    ParallelGroups g = make_groups(*group, p);
    if (g.tp && g.tp->size() > 1) w.tp = std::move(g.tp);
    if (g.ep && g.ep->size() > 1) w.ep = std::move(g.ep);
    w.comms.tp = w.tp.get();
    w.comms.ep = w.ep.get();
    const RankCoord c = rank_coord(p, rank);
    if (c.pp > 0) w.comms.prev_stage = rank_of(p, c.dp, c.pp - 1, c.cp, c.tp);
    if (c.pp < p.pp - 1) w.comms.next_stage = rank_of(p, c.dp, c.pp + 1, c.cp, c.tp);
    return w;
}

std::vector<int32_t> pass_greedy_tokens(Communicator* group, const ParallelConfig& p,
                                        const RankCoord& c, std::span<const float> logits,
                                        int batch, int vocab, int tag) {
    std::vector<int32_t> toks(static_cast<size_t>(batch), 0);
    if (c.pp == p.pp - 1) {
        for (int i = 0; i < batch; ++i)
            toks[size_t(i)] =
                argmax(logits.subspan(size_t(int64_t{i} * vocab), static_cast<size_t>(vocab)));
        for (int s = 0; s < p.pp - 1; ++s)
            group->send(std::span<const int32_t>(toks), rank_of(p, c.dp, s, c.cp, c.tp), tag);
    } else {
        KVSHARD_CHECK(group != nullptr, "a pipeline stage without a communicator");
        group->recv(std::span<int32_t>(toks), rank_of(p, c.dp, p.pp - 1, c.cp, c.tp), tag);
    }
    return toks;
}

int64_t blocks_for(const std::vector<int64_t>& lengths, int64_t extra, int block_size) {
    int64_t n = 1;
    for (int64_t len : lengths) n += (len + extra + block_size - 1) / block_size;
    return n;
}

std::vector<std::vector<int32_t>> consecutive_tables(const std::vector<int64_t>& lengths,
                                                     int block_size, int64_t& total_blocks) {
    std::vector<std::vector<int32_t>> t;
    int32_t next = 0;
    for (int64_t n : lengths) {
        const int64_t blocks = (n + block_size - 1) / block_size;
        std::vector<int32_t> table;
        for (int64_t b = 0; b < blocks; ++b) table.push_back(next++);
        t.push_back(std::move(table));
    }
    total_blocks = std::max<int64_t>(1, next);
    return t;
}

void put_results(ByteWriter& w, const std::vector<RequestResult>& results) {
    w.put<int64_t>(static_cast<int64_t>(results.size()));
    for (const RequestResult& r : results) {
        w.put<int64_t>(r.id);
        w.put<int32_t>(r.has_output ? 1 : 0);
        w.put_vec(r.tokens);
        w.put_vec(r.last_logits);
        w.put<int32_t>(r.failed ? 1 : 0);
        w.put_str(r.error);
    }
}

std::vector<RequestResult> get_results(ByteReader& rd) {
    std::vector<RequestResult> out(static_cast<size_t>(rd.get<int64_t>()));
    for (RequestResult& r : out) {
        r.id = rd.get<int64_t>();
        r.has_output = rd.get<int32_t>() != 0;
        r.tokens = rd.get_vec<int32_t>();
        r.last_logits = rd.get_vec<float>();
        r.failed = rd.get<int32_t>() != 0;
        r.error = rd.get_str();
    }
    return out;
}

GenerationReport merge_group_report(const std::vector<RankContribution<GroupRow>>& rows,
                                    size_t num_prompts) {
    GenerationReport report;
    report.tokens.resize(num_prompts);
    report.last_logits.resize(num_prompts);
    for (const auto& [row, results] : rows) {
        const RankReport& rr = row.report;
        const RankCoord& rc = rr.coord;
        if (rc.pp == 0 && rc.tp == 0 && rc.cp == 0) {
            report.prefix_hit_tokens += row.replica_hit_tokens;
            report.computed_prompt_tokens += row.replica_computed_tokens;
            report.prompt_tokens += row.replica_prompt_tokens;
        }
        report.prefill_seconds = std::max(report.prefill_seconds, rr.prefill_seconds);
        report.decode_seconds = std::max(report.decode_seconds, rr.decode_seconds);
        for (const RequestResult& r : results) {
            KVSHARD_CHECK(r.has_output && r.id >= 0 && size_t(r.id) < num_prompts,
                          "a result of prompt ", r.id, " of ", num_prompts);
            report.tokens[size_t(r.id)] = r.tokens;
            report.last_logits[size_t(r.id)] = r.last_logits;
        }
        report.ranks.push_back(rr);
    }
    std::sort(report.ranks.begin(), report.ranks.end(),
              [](const auto& a, const auto& b) { return a.rank < b.rank; });
    return report;
}

}  // namespace kvshard::serve
