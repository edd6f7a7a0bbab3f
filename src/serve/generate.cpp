#include "kvshard/serve/generate.h"

#include <algorithm>
#include <map>

#include "kvshard/cache/kv_group_manager.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "serve/runner.h"

namespace kvshard {
namespace {

constexpr int kTagTokens = 102;  // last pipeline stage -> earlier stages of its replica

// Distinct tokens held in group g's blocks of the given sequences (shared prefix blocks count
// once; entries a window dropped hold none), and the distinct blocks holding them.
std::pair<int64_t, int64_t> distinct_kv_tokens(const KvGroupManager& t, int g,
                                               const std::vector<int64_t>& seqs, int block_size) {
    std::map<int32_t, int64_t> fill;
    for (int64_t s : seqs) {
        const auto table = t.block_table(g, s);
        const int64_t len = t.num_tokens(s);
        for (size_t i = 0; i < table.size(); ++i) {
            if (table[i] == kNullBlock) continue;
            const int64_t f = std::min<int64_t>(block_size, len - int64_t(i) * block_size);
            auto& cur = fill[table[i]];
            cur = std::max(cur, f);
        }
    }
    int64_t n = 0;
    for (const auto& [b, f] : fill) n += f;
    return {n, int64_t(fill.size())};
}

}  // namespace

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

GenerationReport generate(const ModelSpec& spec, const ParallelConfig& p,
                          const TensorSource& weights,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const GenerationOptions& opt, Communicator* world) {
    const ModelSpec& m = spec;  // the pools store m.kv_dtype; the model computes in fp32
    const KvLayout layout = make_layout(m, p);
    if (p.cp > 1) return cp_generate(spec, p, weights, prompts, opt, world);  // serve/cp_generate
    const int world_size = world ? world->size() : 1, rank = world ? world->rank() : 0;
    require(world_size == p.world_size(), "the run has ", world_size, " ranks but ", p.to_string(),
            " needs dp*pp*cp*tp = ", p.world_size());
    check_prompts(prompts, m.vocab, opt.max_new_tokens);
    require(opt.block_size >= 1, "block size must be at least 1, got ", opt.block_size);
    require(opt.arrival_step.empty(),
            "arrival steps (continuous batching) are served under cp > 1 "
            "only; ",
            p.to_string(), " prefills every prompt in its first steps: leave them empty");
    const RankKv& me = layout.ranks[size_t(rank)];
    const RankCoord c = me.coord;
    const serve::RankWiring wiring = serve::wire_rank(world, p, rank);

    // This replica's prompts.
    std::vector<int64_t> mine, lengths;
    require(opt.replica_of.empty() || opt.replica_of.size() == prompts.size(), "replica_of has ",
            opt.replica_of.size(), " entries for ", prompts.size(), " prompts");
    for (int r : opt.replica_of)
        require(r >= 0 && r < p.dp, "replica_of names replica ", r, " of dp=", p.dp);
    for (size_t i = 0; i < prompts.size(); ++i)
        if ((opt.replica_of.empty() ? int(i % size_t(p.dp)) : opt.replica_of[i]) == c.dp) {
            mine.push_back(int64_t(i));
            lengths.push_back(int64_t(prompts[i].size()));
        }
    const int bs = opt.block_size;
    const int64_t num_blocks =
        opt.num_blocks > 0 ? opt.num_blocks : serve::blocks_for(lengths, opt.max_new_tokens, bs);

    RankModel model(load_weights(m, weight_shard(layout, rank), weights), num_blocks, bs,
                    wiring.comms, opt.page_order);
    const std::string no_reuse = model_prefix_cache_unsupported(m);
    const bool prefix_cache = opt.prefix_cache && no_reuse.empty();
    require(opt.prefill_chunk_tokens >= 0, "the prefill chunk must be 0 (a whole prompt per step) ",
            "or a positive number of tokens, got ", opt.prefill_chunk_tokens);
    // One block table per KV group (KvGroupManager): windowed groups free what leaves their
    // window, a prefix hit is the longest every group serves. Deferred commit: a block is findable
    // only once a step that writes its KV is scheduled (docs/cache.md, "Commit"); every rank of
    // the group commits at the same point of the schedule. State groups keep their state in the
    // model's state slots (no prefix reuse: model_prefix_cache_unsupported).
    const std::vector<KvGroup> groups = kv_groups(m);
    std::vector<int> mgr_group(groups.size(), -1);  // model group -> manager group
    std::vector<KvGroup> token_groups;
    for (size_t g = 0; g < groups.size(); ++g)
        if (holds_tokens(groups[g].kind)) {
            mgr_group[g] = int(token_groups.size());
            token_groups.push_back(groups[g]);
        }
    require(!token_groups.empty(), m.name, " has ", m.layer_mix(),
            ": the runner needs at least one attention layer");
    KvGroupManager tables(KvGroupManagerConfig{.groups = group_pool_specs(token_groups, num_blocks),
                                               .block_size = bs,
                                               .enable_prefix_cache = prefix_cache,
                                               .deferred_commit = true});
    // The step's block tables of every group; the entries a window dropped (kNullBlock) name
    // block 0, a page the kernels never read for them (they start at the window).
    auto set_tables = [&](ForwardBatch& fb, const std::vector<int64_t>& ids) {
        auto kv_of = [&](int g) {
            PagedKv kv = tables.paged_kv(g, ids);
            for (auto& b : kv.indices)
                if (b == kNullBlock) b = 0;
            return kv;
        };
        fb.kv = kv_of(0);
        if (token_groups.size() == 1) return;
        fb.group_kv.assign(groups.size(), fb.kv);
        for (size_t g = 0; g < groups.size(); ++g)
            if (mgr_group[g] >= 0) fb.group_kv[g] = kv_of(mgr_group[g]);
    };

    const int batch = int(mine.size());
    std::vector<std::vector<int32_t>> out_tokens(static_cast<size_t>(batch));
    std::vector<float> logits;  // last stage: [batch][vocab], each sequence's latest row
    serve::GroupRow row;
    RankReport& rep = row.report;
    rep.rank = rank;
    rep.coord = c;
    std::vector<int64_t> seqs(static_cast<size_t>(batch));
    for (int i = 0; i < batch; ++i) seqs[size_t(i)] = i;
    // The step's greedy tokens of the sequences whose last row it computed (all when `done` is
    // empty); their logits rows are kept.
    auto next_tokens = [&](const std::vector<float>& lg, const std::vector<char>& done = {}) {
        const auto toks = serve::pass_greedy_tokens(world, p, c, lg, batch, m.vocab, kTagTokens);
        for (int i = 0; i < batch; ++i) {
            if (!done.empty() && !done[size_t(i)]) continue;
            out_tokens[size_t(i)].push_back(toks[size_t(i)]);
            if (!lg.empty())
                std::copy_n(lg.begin() + int64_t{i} * m.vocab, m.vocab,
                            logits.begin() + int64_t{i} * m.vocab);
        }
    };

    // Prefill: every prompt asks the prefix cache first; at least its last token is computed, in
    // steps of at most opt.prefill_chunk_tokens tokens per prompt (0: all in one step). A step's
    // chunk is committed as it is scheduled: the step's forward writes every row's KV of a layer
    // before any row's attention reads it, on every rank, so a later prompt of the same step or
    // any later step may share it; a chunk of a later step stays unfindable until then
    // (docs/cache.md, "Commit").
    {
        const auto t0 = serve::Clock::now();
        std::vector<int64_t> computed(static_cast<size_t>(batch));
        logits.assign(model.last_stage() ? size_t(batch) * size_t(m.vocab) : 0, 0.0f);
        for (bool first = true, more = true; more; first = false) {
            ForwardBatch fb;
            std::vector<char> done(static_cast<size_t>(batch), 0);
            more = false;
            for (int i = 0; i < batch; ++i) {
                const auto& pr = prompts[size_t(mine[size_t(i)])];
                const int64_t len = int64_t(pr.size());
                if (first) {
                    const auto a = tables.allocate(i, pr);
                    const int64_t cached = std::min<int64_t>(a.cached_tokens, len - 1);
                    rep.prefix_hit_tokens += a.cached_tokens;
                    row.replica_prompt_tokens += len;
                    row.replica_computed_tokens += len - cached;
                    computed[size_t(i)] = cached;
                }
                const int64_t from = computed[size_t(i)];
                const int64_t n = opt.prefill_chunk_tokens > 0
                                      ? std::min<int64_t>(len - from, opt.prefill_chunk_tokens)
                                      : len - from;
                for (int64_t t = from; t < from + n; ++t) {
                    fb.token_ids.push_back(pr[size_t(t)]);
                    fb.slots.push_back(t);
                }
                fb.queries.add_sequence(n, from);
                computed[size_t(i)] += n;
                // Windowed groups keep the window of this step's first query until it has run.
                tables.commit(i, computed[size_t(i)], from);
                done[size_t(i)] = n > 0 && computed[size_t(i)] == len;
                more = more || computed[size_t(i)] < len;
            }
            set_tables(fb, seqs);
            const std::vector<float> lg = model.forward(fb);
            next_tokens(lg, done);
        }
        rep.prefill_seconds = serve::seconds_since(t0);
    }
    // Decode: one token per sequence per step.
    {
        const auto t0 = serve::Clock::now();
        for (int step = 1; step < opt.max_new_tokens; ++step) {
            if (world) world->keepalive();  // answers liveness probes (a one-rank replica)
            ForwardBatch fb;
            for (int i = 0; i < batch; ++i) {
                const int32_t tok = out_tokens[size_t(i)].back();
                tables.append(i, std::span<const int32_t>(&tok, 1));
                const int64_t pos = tables.num_tokens(i) - 1;
                fb.token_ids.push_back(tok);
                fb.slots.push_back(pos);
                fb.queries.add_sequence(1, pos);
            }
            set_tables(fb, seqs);
            const std::vector<float> lg = model.forward(fb);
            for (int i = 0; i < batch; ++i) tables.commit(i, tables.num_tokens(i));
            next_tokens(lg);
        }
        rep.decode_seconds = serve::seconds_since(t0);
    }
    // Measured: the pool's bytes of the distinct blocks in use (elements and, fp8, scales).
    // Predicted: the layout's bytes of each request (request_kv_bytes at m.kv_dtype), less one
    // block's (the layout's bytes of one full block) per block the prefix cache shares.
    // Per group: its distinct resident blocks times its pool's block bytes (measured), and the
    // layout's request_kv_bytes of each request less one block (the layout's) per block the
    // prefix cache shares in that group.
    int full_group = 0;  // tokens held: a group that keeps every token, if the model has one
    for (int g = 0; g < int(token_groups.size()); ++g)
        if (token_groups[size_t(g)].kind == LayerKind::kFullAttention ||
            token_groups[size_t(g)].kind == LayerKind::kMla) {
            full_group = g;
            break;
        }
    rep.kv_tokens = distinct_kv_tokens(tables, full_group, seqs, bs).first;
    rep.kv_bytes = batch * model.state_bytes_per_sequence();
    for (int i = 0; i < model.num_pools(); ++i) {
        const int g = mgr_group[size_t(model.pool_group(i))];
        rep.kv_bytes += distinct_kv_tokens(tables, g, seqs, bs).second *
                        model.pool_at(i).geometry().block_bytes();
    }
    for (int64_t s : seqs)
        rep.kv_bytes_predicted += request_kv_bytes(layout, rank, tables.num_tokens(s), bs);
    for (const RankKvGroup& g : me.groups) {
        const int mg = mgr_group[size_t(g.group)];
        if (mg < 0) continue;
        int64_t resident = 0;
        for (int64_t s : seqs) resident += tables.resident_blocks(mg, s);
        const int64_t shared = resident - distinct_kv_tokens(tables, mg, seqs, bs).second;
        rep.kv_bytes_predicted -= shared * (bs * g.bytes_per_token + g.scale_bytes_per_block);
    }
    row.replica_hit_tokens = rep.prefix_hit_tokens;

    // The last stage's first TP rank of each replica brings the results.
    std::vector<serve::RequestResult> results;
    if (c.pp == p.pp - 1 && c.tp == 0 && c.cp == 0)
        for (int i = 0; i < batch; ++i)
            results.push_back(serve::RequestResult::output(
                mine[size_t(i)], out_tokens[size_t(i)],
                std::vector<float>(logits.begin() + int64_t{i} * m.vocab,
                                   logits.begin() + int64_t{i + 1} * m.vocab)));
    GenerationReport out =
        serve::merge_group_report(serve::gather_contributions(world, row, results), prompts.size());
    out.prefix_cache = prefix_cache;
    if (opt.prefix_cache && !no_reuse.empty()) out.prefix_cache_note = no_reuse;
    return out;
}

}  // namespace kvshard
