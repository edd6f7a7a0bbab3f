// The prefill side of a disaggregated run: prefill every request, streaming each layer's KV to the
// decode ranks as soon as it is written, then send the first greedy tokens.
#include <algorithm>
#include <thread>

#include "kvshard/common/error.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/source_checksums.h"
#include "serve/disagg_run.h"

namespace kvshard::serve {

void run_prefill_side(const DisaggPlan& plan, const DisaggOptions& opt,
                      const std::vector<std::vector<int32_t>>& prompts, SideExecutor& side,
                      Communicator& world, TransferExecOptions xo, Clock::time_point t0,
                      RankTimes& times, std::vector<RequestResult>& results) {
    const int n = plan.requests, me = world.rank(), vocab = plan.model.vocab;
    RankModel& model = side.model();
    // Seals of this rank's pool, made as each layer's KV is written (below).
    std::shared_ptr<SourceChecksums> sums;
    if ((plan.share_pools || opt.rma_read) && opt.source_checksums &&
        opt.prefill_order == PageOrder::kHnd)
        sums = std::make_shared<SourceChecksums>(model.pool());
    xo.source_checksums = sums;
    std::vector<std::unique_ptr<TransferSender>> senders;
    const double senders_at = seconds_since(t0);
    for (int i = 0; i < n; ++i) {
        TransferExecOptions o = xo;
        o.schedule = plan.schedules[i];
        senders.push_back(std::make_unique<TransferSender>(
            world, plan.transfers[i], static_cast<uint64_t>(i), me, model.pool(), o));
    }
    // Every destination's answer to the hello (direct reads or messages) before the prefill
    // starts: the first layer then leaves as soon as it is done.
    for (;;) {
        bool all = true;
        for (auto& s : senders) {
            s->progress();
            all &= s->connected() || s->done();
        }
        if (all) break;
        std::this_thread::yield();
    }

    // This rank's last layer: when its KV is written, nothing more waits for prefill.
    const int last_layer = plan.prefill_layout.ranks[me].layer_end - 1;
    std::vector<float> logits;
    if (side.cp_session) {
        // One prompt after another (CpSession serves one sequence per prefill call); the logits of
        // its last token come back on every CP rank.
        CpSession& session = *side.cp_session;
        session.set_layer_hook([&](SeqId seq, int layer) {
            if (sums) {  // this CP rank's blocks of the prompt, over the tokens it holds
                const int i = static_cast<int>(seq);
                const int64_t held =
                    cp_token_count(plan.prefill, side.coord.cp, plan.prompt_len[i]);
                sums->seal_sequence(layer, side.cp_device->blocks().block_table(seq), held);
            }
            if (layer == last_layer && static_cast<int>(seq) == n - 1)
                times.last_layer_done = seconds_since(t0);
            senders[static_cast<size_t>(seq)]->layer_ready(layer);
            for (auto& s : senders) s->progress();
        });
        logits.resize(static_cast<size_t>(n) * vocab);
        for (int i = 0; i < n; ++i) {
            const std::vector<float> lg = session.prefill_reserved(static_cast<SeqId>(i));
            KVSHARD_CHECK(static_cast<int64_t>(lg.size()) == vocab, "CP prefill gave ", lg.size(),
                          " logits, expected ", vocab);
            std::copy(lg.begin(), lg.end(), logits.begin() + int64_t{i} * vocab);
        }
        times.prefill_end = seconds_since(t0);
        session.set_layer_hook({});
    } else {
        model.set_attention([&](const AttentionCall& call) {
            default_attention(call);  // writes this layer's KV, then attends
            if (sums)                 // while that KV is still in cache
                for (int i = 0; i < n; ++i)
                    sums->seal_sequence(call.local_layer, plan.prefill_tables[i],
                                        plan.prompt_len[i]);
            if (call.layer == last_layer) times.last_layer_done = seconds_since(t0);
            for (auto& s : senders) {
                s->layer_ready(call.layer);
                s->progress();
            }
        });
        ForwardBatch fb;
        for (int i = 0; i < n; ++i) {
            // Tokens an earlier request's blocks hold are not computed again (same forward: its
            // KV is written layer by layer before this request attends to it).
            const int64_t cached = plan.prefill_cached[i];
            for (int64_t t = cached; t < plan.prompt_len[i]; ++t) {
                fb.token_ids.push_back(prompts[i][t]);
                fb.slots.push_back(t);
            }
            fb.queries.add_sequence(plan.prompt_len[i] - cached, cached);
            fb.kv.add_sequence(plan.prefill_tables[i], plan.prompt_len[i], opt.prefill_block_size);
        }
        logits = model.forward(fb);
        times.prefill_end = seconds_since(t0);
    }
    for (auto& s : senders) s->all_layers_ready();
    // Finish every transfer before anything blocking: the decode ranks need our sends to finish
    // theirs.
    std::vector<TransferSender*> sp;
    for (auto& s : senders) sp.push_back(s.get());
    progress_until_done(sp, {});
    for (auto& s : senders) {
        const TransferResult r = s->finish();
        if (r.first_send_s >= 0) {
            const double at = senders_at + r.first_send_s;  // first_send_s counts from construction
            times.first_send = times.first_send < 0 ? at : std::min(times.first_send, at);
        }
    }
    // fp8: each message's block scales follow its pages (they are final once the prompt is
    // written), in request and message order.
    std::vector<std::vector<float>> scales;
    std::vector<Request> scale_sends;
    for (int i = 0; i < n; ++i)
        for (const TransferMessage& msg : plan.transfers[i]->messages) {
            if (msg.src_rank != me || message_scales(*plan.transfers[i], msg) == 0) continue;
            scales.emplace_back(static_cast<size_t>(message_scales(*plan.transfers[i], msg)));
            pack_scales(*plan.transfers[i], msg, model.pool(), scales.back());
        }
    for (int i = 0, k = 0; i < n; ++i)
        for (const TransferMessage& msg : plan.transfers[i]->messages) {
            if (msg.src_rank != me || message_scales(*plan.transfers[i], msg) == 0) continue;
            scale_sends.push_back(world.isend(std::span<const float>(scales[size_t(k++)]),
                                              plan.prefill_ranks + msg.dst_rank, kTagScales));
        }
    wait_all(scale_sends);
    const int prefill_last = rank_of(plan.prefill, 0, plan.prefill.pp - 1, 0, 0);
    if (me != prefill_last) return;
    std::vector<int32_t> first(static_cast<size_t>(n), 0);
    for (int i = 0; i < n; ++i)
        first[i] = argmax({logits.data() + int64_t{i} * vocab, static_cast<size_t>(vocab)});
    std::vector<Request> reqs;
    for (int d = 0; d < plan.decode_ranks; ++d)
        reqs.push_back(
            world.isend(std::span<const int32_t>(first), plan.prefill_ranks + d, kTagFirstTokens));
    wait_all(reqs);
    for (int i = 0; i < n; ++i) {
        RequestResult r;
        r.id = i;
        r.last_logits.assign(logits.begin() + int64_t{i} * vocab,
                             logits.begin() + int64_t{i + 1} * vocab);
        results.push_back(std::move(r));
    }
}

}  // namespace kvshard::serve
