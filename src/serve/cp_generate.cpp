// generate()'s path for cp > 1: continuous batching on a CpSession (exec/cp_session.h).
#include <algorithm>

#include "kvshard/comm/threads.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/cp_session.h"
#include "kvshard/serve/generate.h"
#include "serve/runner.h"

namespace kvshard {

std::string model_prefix_cache_unsupported(const ModelSpec& m) {
    if (m.state_bytes_per_sequence() > 0)
        return m.name + " has " + m.layer_mix() +
               ": a state layer keeps one running state per sequence, which is not saved at block "
               "boundaries, so a cached prefix cannot restore it";
    return {};
}

std::string cp_prefix_cache_unsupported(const ParallelConfig& p, int block_size) {
    if (p.cp == 1 || (p.cp_scheme == CpScheme::kInterleave && p.cp_interleave == block_size))
        return "";
    return detail::concat("the prefix cache is off: under cp=", p.cp,
                          " it needs --cp-scheme interleave --cp-interleave ", block_size,
                          " (the block size), so that each rank's blocks are whole hashed blocks "
                          "of the sequence; ",
                          p.to_string(), " splits blocks across ranks");
}

GenerationReport cp_generate(const ModelSpec& m, const ParallelConfig& p,
                             const TensorSource& weights,
                             const std::vector<std::vector<int32_t>>& prompts,
                             const GenerationOptions& opt, Communicator* world) {
    require(opt.block_size >= 1, "block size must be at least 1, got ", opt.block_size);
    check_prompts(prompts, m.vocab, opt.max_new_tokens);
    require(opt.prefill_chunk_tokens == 0,
            "chunked prefill (prefill_chunk_tokens = ", opt.prefill_chunk_tokens,
            ") is not available under cp=", p.cp,
            ": the context-parallel executor prefills each prompt in one step; use 0");
    require(m.kv_dtype == DType::kFp32, "--kv-dtype ", dtype_name(m.kv_dtype), " with cp=", p.cp,
            ": the context-parallel executor (its KV ring and prefix moves) stores fp32 KV only; "
            "use --kv-dtype fp32 under CP, or cp=1 for bf16, fp16 or fp8 pools");
    require(p.ep == 1, "ep=", p.ep, " with cp=", p.cp,
            ": the context-parallel executor replicates the experts on every rank and runs no "
            "all-to-all, so expert parallelism under CP is not executed; use --ep 1 (the planner "
            "still prices EP under CP)");
    require(opt.arrival_step.empty() || opt.arrival_step.size() == prompts.size(),
            "arrival_step has ", opt.arrival_step.size(), " entries for ", prompts.size(),
            " prompts");
    for (int a : opt.arrival_step)
        require(a >= 0, "an arrival step is a decode step index >= 0, got ", a);
    auto body = [&](Communicator& w) {
        require(w.size() == p.world_size(), "the run has ", w.size(), " ranks but ", p.to_string(),
                " needs dp*pp*cp*tp = ", p.world_size());
        CpOptions o;
        o.block_size = opt.block_size;
        // A state layer's running state is not saved at block boundaries: no prefix reuse.
        o.prefix_cache = opt.prefix_cache && model_prefix_cache_unsupported(m).empty();
        o.prefill_mode = opt.cp_prefill_mode;
        o.decode_merge = opt.cp_decode_merge;
        o.num_blocks = opt.num_blocks;
        if (o.num_blocks <= 0) {  // enough for every prompt at once (released ones stay cached)
            std::vector<int64_t> lengths;
            for (const auto& pr : prompts) lengths.push_back(static_cast<int64_t>(pr.size()));
            o.num_blocks = serve::blocks_for(lengths, opt.max_new_tokens, o.block_size);
        }
        const RankCoord c = rank_coord(p, w.rank());
        CpDevice dev(m, p.tp, c.tp, weights, o);
        CpSession s(dev, w, p, o);
        serve::GroupRow row;
        RankReport& rep = row.report;
        rep.rank = w.rank();
        rep.coord = c;
        std::vector<serve::RequestResult> results;
        // Continuous batching: the prompts that have arrived by a step join the running batch in
        // one prefill forward, every running sequence decodes one token per step, and a sequence
        // leaves (released, its hashed blocks stay cached) once it has max_new_tokens tokens.
        const size_t n = prompts.size();
        auto arrival = [&](size_t i) { return opt.arrival_step.empty() ? 0 : opt.arrival_step[i]; };
        std::vector<size_t> order(n);
        for (size_t i = 0; i < n; ++i) order[i] = i;
        std::stable_sort(order.begin(), order.end(),
                         [&](size_t a, size_t b) { return arrival(a) < arrival(b); });
        std::vector<std::vector<int32_t>> toks(n);
        std::vector<std::vector<float>> last(n);
        std::vector<SeqId> running;
        auto take = [&](const std::vector<float>& logits, const std::vector<SeqId>& seqs) {
            for (size_t j = 0; j < seqs.size(); ++j) {
                const auto i = static_cast<size_t>(seqs[j]);
                last[i].assign(logits.begin() + int64_t(j) * m.vocab,
                               logits.begin() + int64_t(j + 1) * m.vocab);
                toks[i].push_back(argmax(last[i]));
            }
        };
        auto leave = [&] {
            std::erase_if(running, [&](SeqId seq) {
                const auto i = static_cast<size_t>(seq);
                if (static_cast<int>(toks[i].size()) < opt.max_new_tokens) return false;
                rep.kv_tokens += s.token_map(seq).count(c.cp);
                // Every CP rank has the logits; the (cp, tp) = 0 rank brings them.
                if (c.cp == 0 && c.tp == 0)
                    results.push_back(serve::RequestResult::output(
                        static_cast<int64_t>(i), std::move(toks[i]), std::move(last[i])));
                s.release(seq);
                return true;
            });
        };
        size_t next = 0;
        for (int step = 0; next < n || !running.empty(); ++step) {
            w.keepalive();  // answers liveness probes
            if (running.empty()) step = std::max(step, arrival(order[next]));
            std::vector<SeqId> joining;
            std::vector<std::vector<int32_t>> joining_tokens;
            for (; next < n && arrival(order[next]) <= step; ++next) {
                joining.push_back(static_cast<SeqId>(order[next]));
                joining_tokens.push_back(prompts[order[next]]);
            }
            if (!joining.empty()) {
                const auto t0 = serve::Clock::now();
                const auto logits = s.prefill(joining, joining_tokens);
                rep.prefill_seconds += serve::seconds_since(t0);
                take(logits, joining);
                for (size_t j = 0; j < joining.size(); ++j) {
                    const CpStepStats& st = s.prefill_stats(joining[j]);
                    const auto len = static_cast<int64_t>(joining_tokens[j].size());
                    row.replica_prompt_tokens += len;
                    row.replica_hit_tokens += st.cached_tokens;
                    row.replica_computed_tokens += len - st.cached_tokens;
                    rep.prefix_hit_tokens += st.local_hit_blocks * o.block_size;
                }
                running.insert(running.end(), joining.begin(), joining.end());
                leave();
            }
            if (running.empty()) continue;
            std::vector<int32_t> feed;
            for (SeqId seq : running) feed.push_back(toks[static_cast<size_t>(seq)].back());
            const auto t0 = serve::Clock::now();
            const auto logits = s.decode(running, feed);
            rep.decode_seconds += serve::seconds_since(t0);
            take(logits, running);
            leave();
        }
        int64_t bytes_per_token = 0;  // every group's pool (the CP session keeps every token)
        for (int i = 0; i < dev.model().num_pools(); ++i)
            bytes_per_token += dev.model().pool_at(i).geometry().bytes_per_token();
        rep.kv_bytes = rep.kv_tokens * bytes_per_token;
        const RankKv& me = s.layout().ranks[static_cast<size_t>(w.rank())];
        rep.kv_bytes_predicted = rep.kv_tokens * me.kv_bytes_per_token;
        // State layers: every CP rank holds each sequence's whole state (docs/context-parallel.md).
        const int64_t n_seq = static_cast<int64_t>(prompts.size());
        rep.kv_bytes += n_seq * dev.model().state_bytes_per_sequence();
        rep.kv_bytes_predicted += n_seq * me.state_bytes_per_sequence;
        GenerationReport out = serve::merge_group_report(
            serve::gather_contributions(&w, row, results), prompts.size());
        const std::string why = cp_prefix_cache_unsupported(p, o.block_size);
        out.prefix_cache = opt.prefix_cache && why.empty();
        if (opt.prefix_cache && !why.empty()) out.prefix_cache_note = why;
        return out;
    };
    if (world) return body(*world);
    require(p.world_size() == 1, "a run without a communicator is one rank, but ", p.to_string(),
            " needs ", p.world_size());
    GenerationReport out;
    run_threads(1, [&](Communicator& w) { out = body(w); });
    return out;
}

}  // namespace kvshard
