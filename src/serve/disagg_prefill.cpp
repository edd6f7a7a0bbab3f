// The prefill side of a disaggregated run: prefill every request, streaming each layer's KV to the
// decode ranks as soon as it is written, then send the first greedy tokens.
#include <algorithm>
#include <thread>

#include "kvshard/common/error.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/source_checksums.h"
#include "kvshard/transfer/state_pack.h"
#include "serve/disagg_run.h"

namespace kvshard::serve {

void run_prefill_side(const DisaggPlan& plan, const DisaggOptions& opt,
                      const std::vector<std::vector<int32_t>>& prompts, SideExecutor& side,
                      Communicator& world, TransferExecOptions xo, Clock::time_point t0,
                      RankTimes& times, std::vector<RequestResult>& results) {
    const int n = plan.requests, me = world.rank(), vocab = plan.model.vocab;
    RankModel& model = side.model();
    // This rank's replica's requests (all of them with dp = 1).
    const int replica = side.coord.dp;
    auto mine = [&](int i) { return plan.serves(true, replica, i); };
    // Seals of this rank's pool, made as each layer's KV is written (below).
    // (A model of one KV group only: the seals cover the rank's one pool.)
    std::shared_ptr<SourceChecksums> sums;
    if ((plan.share_pools || opt.rma_read) && opt.source_checksums &&
        opt.prefill_order == PageOrder::kHnd && plan.model.uniform())
        sums = std::make_shared<SourceChecksums>(model.pool());
    xo.source_checksums = sums;
    // One sender per part this rank carries (senders[k] moves parts[k]).
    const std::vector<RankPart> parts = rank_parts(plan, true, replica, model);
    std::vector<std::unique_ptr<TransferSender>> senders;
    const double senders_at = seconds_since(t0);
    for (const RankPart& rp : parts) {
        const DisaggPlan::TransferPart& part = plan.parts[rp.request][rp.part];
        TransferExecOptions o = xo;
        o.schedule = part.schedule;
        senders.push_back(std::make_unique<TransferSender>(
            world, part.plan, part_request_id(plan, rp.request, rp.part), me,
            model.pool_at(rp.pool), o));
    }
    // Global layer `layer` written: each sender's part has its layers up to it ready.
    auto layer_done = [&](size_t k, int layer) {
        const int done =
            group_layers_done(plan.parts[parts[k].request][parts[k].part].layers, layer);
        if (done > 0) senders[k]->layer_ready(done - 1);
    };
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
        session.set_layer_hook([&](SeqId seq, int layer, int pool_layer) {
            if (sums) {  // this CP rank's blocks of the prompt, over the tokens it holds
                const int i = static_cast<int>(seq);
                const int64_t held =
                    cp_token_count(plan.prefill, side.coord.cp, plan.prompt_len[i]);
                sums->seal_sequence(pool_layer, side.cp_device->blocks().block_table(seq), held);
            }
            if (layer == last_layer && static_cast<int>(seq) == n - 1)
                times.last_layer_done = seconds_since(t0);
            for (size_t k = 0; k < senders.size(); ++k)
                if (parts[k].request == static_cast<int>(seq)) layer_done(k, layer);
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
                    if (mine(i))
                        sums->seal_sequence(call.local_layer, plan.prefill_tables[i],
                                            plan.prompt_len[i]);
            if (call.layer == last_layer) times.last_layer_done = seconds_since(t0);
            for (size_t k = 0; k < senders.size(); ++k) {
                layer_done(k, call.layer);
                senders[k]->progress();
            }
        });
        // One batch of this replica's requests; logits row k is request batch[k]'s.
        ForwardBatch fb;
        std::vector<int> batch;
        for (int i = 0; i < n; ++i) {
            if (!mine(i)) continue;
            batch.push_back(i);
            // Tokens an earlier request's blocks hold are not computed again (same forward: its
            // KV is written layer by layer before this request attends to it).
            const int64_t cached = plan.prefill_cached[i];
            for (int64_t t = cached; t < plan.prompt_len[i]; ++t) {
                fb.token_ids.push_back(prompts[i][t]);
                fb.slots.push_back(t);
            }
            fb.queries.add_sequence(plan.prompt_len[i] - cached, cached);
            fb.kv.add_sequence(plan.prefill_tables[i], plan.prompt_len[i], opt.prefill_block_size);
            fb.state_slots.push_back(i);  // request i's state (state layers)
        }
        if (!batch.empty()) {
            const std::vector<float> lg = model.forward(fb);
            if (static_cast<int64_t>(lg.size()) == int64_t{vocab} * int64_t(batch.size())) {
                logits.assign(static_cast<size_t>(n) * vocab, 0.0f);
                for (size_t k = 0; k < batch.size(); ++k)
                    std::copy(lg.begin() + static_cast<int64_t>(k) * vocab,
                              lg.begin() + static_cast<int64_t>(k + 1) * vocab,
                              logits.begin() + int64_t{batch[k]} * vocab);
            }
        }
        times.prefill_end = seconds_since(t0);
        // A rank whose last layer holds no KV (state layers, layers without KV) is done here.
        if (times.last_layer_done < 0) times.last_layer_done = times.prefill_end;
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
    // written), in request, part and message order.
    std::vector<std::vector<float>> scales;
    std::vector<Request> scale_sends;
    for (const RankPart& rp : parts) {
        const TransferPlan& tp = *plan.parts[rp.request][rp.part].plan;
        for (const TransferMessage& msg : tp.messages) {
            const int64_t count = message_scales(tp, msg);
            if (msg.src_rank != me || count == 0) continue;
            scales.emplace_back(static_cast<size_t>(count));
            pack_scales(tp, msg, model.pool_at(rp.pool), scales.back());
            scale_sends.push_back(world.isend(std::span<const float>(scales.back()),
                                              plan.prefill_ranks + msg.dst_rank, kTagScales));
        }
    }
    wait_all(scale_sends);
    // State layers: each request's state (final once its prompt has run) as state messages.
    if (plan.has_state) {
        const StateShard shard = rank_state_shard(plan.prefill_layout, me);
        std::vector<std::vector<std::byte>> payloads;
        std::vector<Request> state_sends;
        for (int i = 0; i < n; ++i)
            for (const TransferMessage& msg : plan.transfers[i]->messages) {
                if (msg.src_rank != me || !plan.transfers[i]->groups[msg.kv_group].holds_state())
                    continue;
                payloads.emplace_back(static_cast<size_t>(msg.bytes));
                // (The plain prefill keeps request i in slot i; a CP session chooses.)
                const int32_t slot =
                    side.cp_session ? side.cp_session->held_state_slot(static_cast<SeqId>(i)) : i;
                pack_state_message(*plan.transfers[i], msg, shard, state_access(model, slot),
                                   payloads.back());
                state_sends.push_back(world.isend(std::span<const std::byte>(payloads.back()),
                                                  plan.prefill_ranks + msg.dst_rank, kTagState));
            }
        wait_all(state_sends);
    }
    // Each replica's last stage sends the first tokens of its requests (0 for the others) to
    // every decode rank.
    const int prefill_last = rank_of(plan.prefill, replica, plan.prefill.pp - 1, 0, 0);
    if (me != prefill_last) return;
    std::vector<int32_t> first(static_cast<size_t>(n), 0);
    for (int i = 0; i < n; ++i)
        if (mine(i))
            first[i] = argmax({logits.data() + int64_t{i} * vocab, static_cast<size_t>(vocab)});
    std::vector<Request> reqs;
    for (int d = 0; d < plan.decode_ranks; ++d)
        reqs.push_back(
            world.isend(std::span<const int32_t>(first), plan.prefill_ranks + d, kTagFirstTokens));
    wait_all(reqs);
    for (int i = 0; i < n; ++i) {
        if (!mine(i)) continue;
        RequestResult r;
        r.id = i;
        r.last_logits.assign(logits.begin() + int64_t{i} * vocab,
                             logits.begin() + int64_t{i + 1} * vocab);
        results.push_back(std::move(r));
    }
}

}  // namespace kvshard::serve
