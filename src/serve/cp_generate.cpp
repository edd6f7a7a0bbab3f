// generate()'s path for cp > 1: each prompt in turn on a CpSession (exec/cp_session.h).
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
        for (size_t i = 0; i < prompts.size(); ++i) {
            const auto seq = static_cast<SeqId>(i);
            auto t0 = serve::Clock::now();
            auto logits = s.prefill(seq, prompts[i]);
            rep.prefill_seconds += serve::seconds_since(t0);
            row.replica_prompt_tokens += static_cast<int64_t>(prompts[i].size());
            row.replica_hit_tokens += s.last_step().cached_tokens;
            row.replica_computed_tokens +=
                static_cast<int64_t>(prompts[i].size()) - s.last_step().cached_tokens;
            rep.prefix_hit_tokens += s.last_step().local_hit_blocks * o.block_size;
            std::vector<int32_t> toks = {argmax(logits)};
            t0 = serve::Clock::now();
            for (int step = 1; step < opt.max_new_tokens; ++step) {
                logits = s.decode(seq, toks.back());
                toks.push_back(argmax(logits));
            }
            rep.decode_seconds += serve::seconds_since(t0);
            rep.kv_tokens += s.token_map(seq).count(c.cp);
            // Every CP rank has the logits; the (cp, tp) = 0 rank brings them.
            if (c.cp == 0 && c.tp == 0)
                results.push_back(serve::RequestResult::output(static_cast<int64_t>(i),
                                                               std::move(toks), std::move(logits)));
            s.release(seq);
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
