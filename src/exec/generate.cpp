#include "kvshard/exec/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>

#include "common/byte_buffer.h"
#include "exec/collectives.h"
#include "kvshard/cache/block_manager.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/cp_session.h"
#include "kvshard/exec/rank_model.h"

namespace kvshard {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Distinct tokens held in the blocks of the given sequences (shared prefix blocks count once).
template <typename Tables>
int64_t distinct_kv_tokens(const Tables& t, const std::vector<int64_t>& seqs, int block_size) {
    std::map<int32_t, int64_t> fill;
    for (int64_t s : seqs) {
        const auto table = t.block_table(s);
        const int64_t len = t.num_tokens(s);
        for (size_t i = 0; i < table.size(); ++i) {
            const int64_t f = std::min<int64_t>(block_size, len - int64_t(i) * block_size);
            auto& cur = fill[table[i]];
            cur = std::max(cur, f);
        }
    }
    int64_t n = 0;
    for (const auto& [b, f] : fill) n += f;
    return n;
}

}  // namespace

WeightShard weight_shard(const KvLayout& layout, int rank) {
    const ModelSpec& m = layout.model;
    const ParallelConfig& p = layout.parallel;
    const RankKv& r = layout.ranks.at(size_t(rank));
    require(m.intermediate % p.tp == 0, m.name, ": the MLP width ", m.intermediate,
            " is not divisible by tp=", p.tp, ": choose a tp that divides ", m.intermediate);
    WeightShard s;
    s.layer_begin = r.layer_begin;
    s.layer_end = r.layer_end;
    s.q_head_begin = r.q_head_begin;
    s.q_head_end = r.q_head_end;
    s.kv_head_begin = r.kv_heads.front();
    s.kv_head_end = r.kv_heads.back() + 1;
    const int w = m.intermediate / p.tp;
    s.mlp_begin = r.coord.tp * w;
    s.mlp_end = s.mlp_begin + w;
    s.expert_begin = r.expert_begin;
    s.expert_end = r.expert_end;
    return s;
}

void check_prompts(const std::vector<std::vector<int32_t>>& prompts, int vocab,
                   int max_new_tokens) {
    require(max_new_tokens >= 1, "the number of tokens to generate must be at least 1, got ",
            max_new_tokens);
    for (size_t i = 0; i < prompts.size(); ++i) {
        require(!prompts[i].empty(), "prompt ", i,
                " is empty: every prompt needs at least one token");
        for (int32_t t : prompts[i])
            require(t >= 0 && t < vocab, "prompt ", i, " holds token id ", t,
                    " outside the vocabulary [0, ", vocab, ")");
    }
}

double relative_l2(const std::vector<float>& a, const std::vector<float>& b) {
    KVSHARD_CHECK(a.size() == b.size(), "relative_l2 of vectors of ", a.size(), " and ", b.size(),
                  " elements");
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(b[i]) * b[i];
    }
    if (den == 0) return num == 0 ? 0.0 : std::sqrt(num);
    return std::sqrt(num / den);
}

GenerationReport generate(const ModelSpec& spec, const ParallelConfig& p,
                          const TensorSource& weights,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const GenerationOptions& opt, Communicator* world) {
    ModelSpec m = spec;
    m.kv_dtype = DType::kFp32;  // the reference computes and caches in fp32
    const KvLayout layout = make_layout(m, p);
    if (p.cp > 1) return cp_generate(spec, p, weights, prompts, opt, world);  // exec/cp_session.cpp
    const int world_size = coll::size(world), rank = coll::rank(world);
    require(world_size == p.world_size(), "the run has ", world_size, " ranks but ", p.to_string(),
            " needs dp*pp*cp*tp = ", p.world_size());
    check_prompts(prompts, m.vocab, opt.max_new_tokens);
    require(opt.block_size >= 1, "block size must be at least 1, got ", opt.block_size);
    const RankKv& me = layout.ranks[size_t(rank)];
    const RankCoord c = me.coord;

    // Whom this rank talks to.
    coll::Groups groups = coll::make_groups(world, p);
    RankComms comms;
    comms.world = world;
    comms.tp = groups.tp.get();
    comms.ep = groups.ep.get();
    if (c.pp > 0) comms.prev_stage = rank_of(p, c.dp, c.pp - 1, c.cp, c.tp);
    if (c.pp < p.pp - 1) comms.next_stage = rank_of(p, c.dp, c.pp + 1, c.cp, c.tp);
    const bool last_stage = c.pp == p.pp - 1;

    // This replica's prompts.
    std::vector<int64_t> mine;
    for (size_t i = 0; i < prompts.size(); ++i)
        if (int(i % size_t(p.dp)) == c.dp) mine.push_back(int64_t(i));
    const int bs = opt.block_size;
    int64_t num_blocks = opt.num_blocks;
    if (num_blocks <= 0) {
        num_blocks = 1;
        for (int64_t i : mine)
            num_blocks += (int64_t(prompts[size_t(i)].size()) + opt.max_new_tokens + bs - 1) / bs;
    }

    RankModel model(load_weights(m, weight_shard(layout, rank), weights), num_blocks, bs, comms,
                    opt.page_order);
    BlockManager tables(BlockManagerConfig{
        .num_blocks = num_blocks, .block_size = bs, .enable_prefix_cache = opt.prefix_cache});

    const int batch = int(mine.size());
    std::vector<std::vector<int32_t>> out_tokens(static_cast<size_t>(batch));
    std::vector<float> logits;
    RankReport rep;
    rep.rank = rank;
    rep.coord = c;
    int64_t computed = 0, prompt_tokens = 0;

    // Passes the greedy tokens of a step from the last stage to the earlier ones.
    auto next_tokens = [&](const std::vector<float>& lg) {
        std::vector<int32_t> toks(size_t(batch), 0);
        if (last_stage) {
            for (int i = 0; i < batch; ++i)
                toks[size_t(i)] = argmax({lg.data() + int64_t{i} * m.vocab, size_t(m.vocab)});
            for (int s = 0; s < p.pp - 1; ++s)
                coll::send(world, std::span<const int32_t>(toks), rank_of(p, c.dp, s, c.cp, c.tp),
                           coll::kTagTokens);
        } else {
            coll::recv(world, std::span<int32_t>(toks), rank_of(p, c.dp, p.pp - 1, c.cp, c.tp),
                       coll::kTagTokens);
        }
        for (int i = 0; i < batch; ++i) out_tokens[size_t(i)].push_back(toks[size_t(i)]);
    };

    // Prefill: every prompt asks the prefix cache first; at least its last token is computed.
    {
        const auto t0 = Clock::now();
        ForwardBatch fb;
        for (int i = 0; i < batch; ++i) {
            const auto& pr = prompts[size_t(mine[size_t(i)])];
            const int64_t len = int64_t(pr.size());
            const auto a = tables.allocate(i, pr);
            const int64_t cached = std::min<int64_t>(a.cached_tokens, len - 1);
            rep.prefix_hit_tokens += a.cached_tokens;
            prompt_tokens += len;
            computed += len - cached;
            for (int64_t t = cached; t < len; ++t) {
                fb.token_ids.push_back(pr[size_t(t)]);
                fb.slots.push_back(t);
            }
            fb.queries.add_sequence(len - cached, cached);
        }
        std::vector<int64_t> seqs(static_cast<size_t>(batch));
        for (int i = 0; i < batch; ++i) seqs[size_t(i)] = i;
        fb.kv = tables.paged_kv(seqs);
        logits = model.forward(fb);
        next_tokens(logits);
        rep.prefill_seconds = seconds_since(t0);
    }
    // Decode: one token per sequence per step.
    {
        const auto t0 = Clock::now();
        for (int step = 1; step < opt.max_new_tokens; ++step) {
            ForwardBatch fb;
            std::vector<int64_t> seqs(static_cast<size_t>(batch));
            for (int i = 0; i < batch; ++i) {
                const int32_t tok = out_tokens[size_t(i)].back();
                tables.append(i, std::span<const int32_t>(&tok, 1));
                const int64_t pos = tables.num_tokens(i) - 1;
                fb.token_ids.push_back(tok);
                fb.slots.push_back(pos);
                fb.queries.add_sequence(1, pos);
                seqs[size_t(i)] = i;
            }
            fb.kv = tables.paged_kv(seqs);
            logits = model.forward(fb);
            next_tokens(logits);
        }
        rep.decode_seconds = seconds_since(t0);
    }
    {
        std::vector<int64_t> seqs(static_cast<size_t>(batch));
        for (int i = 0; i < batch; ++i) seqs[size_t(i)] = i;
        rep.kv_tokens = distinct_kv_tokens(tables, seqs, bs);
    }
    rep.kv_bytes = rep.kv_tokens * model.pool().geometry().bytes_per_token();
    rep.kv_bytes_predicted = rep.kv_tokens * me.kv_bytes_per_token;

    // Gather every rank's report; the last stage's first TP rank of each replica brings the
    // results.
    ByteWriter w;
    w.put(rep);
    const bool brings_results = last_stage && c.tp == 0 && c.cp == 0;
    w.put<int64_t>(brings_results ? batch : 0);
    w.put<int64_t>(computed);
    w.put<int64_t>(prompt_tokens);
    if (brings_results)
        for (int i = 0; i < batch; ++i) {
            w.put<int64_t>(mine[size_t(i)]);
            w.put_vec(out_tokens[size_t(i)]);
            w.put_vec(std::vector<float>(logits.begin() + int64_t{i} * m.vocab,
                                         logits.begin() + int64_t{i + 1} * m.vocab));
        }
    const auto blobs = coll::all_gather_blobs(world, w.bytes());

    GenerationReport report;
    report.tokens.resize(prompts.size());
    report.last_logits.resize(prompts.size());
    for (const auto& blob : blobs) {
        ByteReader rd(blob);
        const auto rr = rd.get<RankReport>();
        const auto n = rd.get<int64_t>();
        const auto comp = rd.get<int64_t>();
        const auto ptoks = rd.get<int64_t>();
        const RankCoord rc = rr.coord;
        // Count each replica once: its (pp=0, tp=0) rank.
        if (rc.pp == 0 && rc.tp == 0 && rc.cp == 0) {
            report.prefix_hit_tokens += rr.prefix_hit_tokens;
            report.computed_prompt_tokens += comp;
            report.prompt_tokens += ptoks;
        }
        report.prefill_seconds = std::max(report.prefill_seconds, rr.prefill_seconds);
        report.decode_seconds = std::max(report.decode_seconds, rr.decode_seconds);
        for (int64_t k = 0; k < n; ++k) {
            const auto id = size_t(rd.get<int64_t>());
            report.tokens[id] = rd.get_vec<int32_t>();
            report.last_logits[id] = rd.get_vec<float>();
        }
        report.ranks.push_back(rr);
    }
    std::sort(report.ranks.begin(), report.ranks.end(),
              [](const auto& a, const auto& b) { return a.rank < b.rank; });
    return report;
}

}  // namespace kvshard
