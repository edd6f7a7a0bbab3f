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

std::vector<BatchStep> continuous_batch_schedule(const std::vector<int>& arrival_step,
                                                 size_t num_prompts, int max_new_tokens) {
    require(arrival_step.empty() || arrival_step.size() == num_prompts, "arrival_step has ",
            arrival_step.size(), " entries for ", num_prompts, " prompts");
    for (int a : arrival_step)
        require(a >= 0, "an arrival step is a decode step index >= 0, got ", a);
    require(max_new_tokens >= 1, "max_new_tokens must be at least 1, got ", max_new_tokens);
    auto arrival = [&](size_t i) { return arrival_step.empty() ? 0 : arrival_step[i]; };
    std::vector<size_t> order(num_prompts);
    for (size_t i = 0; i < num_prompts; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return arrival(a) < arrival(b); });
    std::vector<BatchStep> out;
    std::vector<int64_t> running;
    std::vector<int> have(num_prompts, 0);  // tokens each prompt has
    size_t next = 0;
    for (int step = 0; next < num_prompts || !running.empty(); ++step) {
        if (running.empty()) step = std::max(step, arrival(order[next]));
        BatchStep bs;
        bs.step = step;
        for (; next < num_prompts && arrival(order[next]) <= step; ++next) {
            bs.join.push_back(static_cast<int64_t>(order[next]));
            have[order[next]] = 1;  // the prefill's token
            running.push_back(static_cast<int64_t>(order[next]));
        }
        for (int64_t i : running)
            if (have[size_t(i)] < max_new_tokens) {
                bs.decode.push_back(i);
                ++have[size_t(i)];
            }
        std::erase_if(running, [&](int64_t i) {
            if (have[size_t(i)] < max_new_tokens) return false;
            bs.leave.push_back(i);
            return true;
        });
        out.push_back(std::move(bs));
    }
    return out;
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
    require(p.dp == 1, "dp=", p.dp, " with cp=", p.cp,
            ": the context-parallel executor serves one replica; use dp=1 with cp > 1");
    const std::vector<BatchStep> schedule =
        continuous_batch_schedule(opt.arrival_step, prompts.size(), opt.max_new_tokens);
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
        CpDevice dev(m, p, w.rank(), weights, o);  // its stage, TP slice and experts
        CpSession s(dev, w, p, o);
        serve::GroupRow row;
        RankReport& rep = row.report;
        rep.rank = w.rank();
        rep.coord = c;
        std::vector<serve::RequestResult> results;
        // Continuous batching (continuous_batch_schedule): at each step the prompts that have
        // arrived join in one prefill forward, the running ones decode one token each in one
        // forward, and a finished one leaves (released; its hashed blocks stay cached).
        const size_t n = prompts.size();
        std::vector<std::vector<int32_t>> toks(n);
        std::vector<std::vector<float>> last(n);
        auto take = [&](const std::vector<float>& logits, const std::vector<int64_t>& ids) {
            for (size_t j = 0; j < ids.size(); ++j) {
                const auto i = static_cast<size_t>(ids[j]);
                last[i].assign(logits.begin() + int64_t(j) * m.vocab,
                               logits.begin() + int64_t(j + 1) * m.vocab);
                toks[i].push_back(argmax(last[i]));
            }
        };
        for (const BatchStep& bs : schedule) {
            w.keepalive();  // answers liveness probes
            if (!bs.join.empty()) {
                const std::vector<SeqId> seqs(bs.join.begin(), bs.join.end());
                std::vector<std::vector<int32_t>> feed;
                for (int64_t i : bs.join) feed.push_back(prompts[size_t(i)]);
                const auto t0 = serve::Clock::now();
                const auto logits = s.prefill(seqs, feed);
                rep.prefill_seconds += serve::seconds_since(t0);
                take(logits, bs.join);
                for (size_t j = 0; j < seqs.size(); ++j) {
                    const CpStepStats& st = s.prefill_stats(seqs[j]);
                    const auto len = static_cast<int64_t>(feed[j].size());
                    row.replica_prompt_tokens += len;
                    row.replica_hit_tokens += st.cached_tokens;
                    row.replica_computed_tokens += len - st.cached_tokens;
                    rep.prefix_hit_tokens += st.local_hit_blocks * o.block_size;
                }
            }
            if (!bs.decode.empty()) {
                const std::vector<SeqId> seqs(bs.decode.begin(), bs.decode.end());
                std::vector<int32_t> feed;
                for (int64_t i : bs.decode) feed.push_back(toks[size_t(i)].back());
                const auto t0 = serve::Clock::now();
                const auto logits = s.decode(seqs, feed);
                rep.decode_seconds += serve::seconds_since(t0);
                take(logits, bs.decode);
            }
            for (int64_t i : bs.leave) {
                rep.kv_tokens += s.token_map(i).count(c.cp);
                // Every rank has the logits (the last stage's, broadcast); the first stage's
                // (cp, tp) = 0 rank brings them.
                if (c.pp == 0 && c.cp == 0 && c.tp == 0)
                    results.push_back(serve::RequestResult::output(i, std::move(toks[size_t(i)]),
                                                                   std::move(last[size_t(i)])));
                s.release(i);
            }
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
