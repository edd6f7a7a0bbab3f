// The decode side of a disaggregated run: take every request's KV in, agree on which requests
// failed, and decode the others from the prefill's first token.
#include "kvshard/common/error.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/state_pack.h"
#include "serve/disagg_run.h"

namespace kvshard::serve {

void run_decode_side(const DisaggPlan& plan, const DisaggOptions& opt, SideExecutor& side,
                     Communicator& world, Communicator& group, const TransferExecOptions& xo,
                     Clock::time_point t0, RankTimes& times, std::vector<RequestResult>& results) {
    const int n = plan.requests, gen = opt.max_new_tokens, vocab = plan.model.vocab;
    const int d = world.rank() - plan.prefill_ranks;
    RankModel& model = side.model();
    // This rank's replica's requests (all of them with dp = 1).
    const int replica = side.coord.dp;
    auto mine = [&](int i) { return plan.serves(false, replica, i); };
    // One receiver per part this rank carries (receivers[k] moves parts[k]).
    const std::vector<RankPart> parts = rank_parts(plan, false, replica, model);
    std::vector<std::unique_ptr<TransferReceiver>> receivers;
    for (const RankPart& rp : parts) {
        const DisaggPlan::TransferPart& part = plan.parts[rp.request][rp.part];
        TransferExecOptions o = xo;
        o.schedule = part.schedule;
        receivers.push_back(std::make_unique<TransferReceiver>(
            world, part.plan, part_request_id(plan, rp.request, rp.part), d, model.pool_at(rp.pool),
            o));
    }
    std::vector<TransferReceiver*> rp;
    for (auto& r : receivers) rp.push_back(r.get());
    progress_until_done({}, rp);
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::vector<int32_t> failed(static_cast<size_t>(n), 0);
    for (size_t k = 0; k < receivers.size(); ++k) {
        const int i = parts[k].request;
        const TransferResult r = receivers[k]->finish();
        times.bytes += r.bytes;
        times.messages += r.messages;
        times.direct_messages += r.direct_messages;
        times.unit_checksum_messages += r.unit_checksum_messages;
        if (!r.ok() && !failed[i]) {
            failed[i] = 1;
            errors[i] = std::string(transfer_status_name(r.status)) + ": " + r.error;
        }
    }
    receivers.clear();
    // State layers: each request's state from its source ranks (sent after the prefill).
    if (plan.has_state) {
        const StateShard shard = rank_state_shard(plan.decode_layout, d);
        for (int i = 0; i < n; ++i)
            for (const TransferMessage& msg : plan.transfers[i]->messages) {
                if (msg.dst_rank != d || !plan.transfers[i]->groups[msg.kv_group].holds_state())
                    continue;
                std::vector<std::byte> payload(static_cast<size_t>(msg.bytes));
                world.recv(std::span<std::byte>(payload), msg.src_rank, kTagState);
                unpack_state_message(*plan.transfers[i], msg, shard,
                                     state_access(model, int32_t(i)), payload);
                times.bytes += msg.bytes;
                ++times.messages;
            }
    }
    times.transfer_done = seconds_since(t0);
    // One verdict per request for the whole decode side (a replica's ranks flag only its own).
    group.all_reduce(std::span<int32_t>(failed), ReduceOp::kMax);
    // A request whose cached prefix blocks an earlier, failed request was to write fails too.
    for (int i = 0; i < n; ++i) {
        const int from = plan.decode_provider[i];
        if (from >= 0 && failed[from] && !failed[i]) {
            failed[i] = 1;
            errors[i] = detail::concat("its cached prefix was to come with request ", from,
                                       ", whose transfer failed");
        }
    }
    // fp8: the block scales of every message this rank received, from its source rank.
    for (const RankPart& rp : parts) {
        const TransferPlan& tp = *plan.parts[rp.request][rp.part].plan;
        for (const TransferMessage& msg : tp.messages) {
            const int64_t count = message_scales(tp, msg);
            if (msg.dst_rank != d || count == 0) continue;
            std::vector<float> scales(static_cast<size_t>(count));
            world.recv(std::span<float>(scales), msg.src_rank, kTagScales);
            unpack_scales(tp, msg, scales, model.pool_at(rp.pool));
        }
    }

    // The first tokens from every prefill replica's last stage, each for its own requests.
    std::vector<int32_t> first(static_cast<size_t>(n), 0);
    for (int r = 0; r < plan.prefill.dp; ++r) {
        std::vector<int32_t> from(static_cast<size_t>(n), 0);
        world.recv(std::span<int32_t>(from), rank_of(plan.prefill, r, plan.prefill.pp - 1, 0, 0),
                   kTagFirstTokens);
        for (int i = 0; i < n; ++i)
            if (plan.serves(true, r, i)) first[i] = from[i];
    }
    std::vector<std::vector<int32_t>> out(static_cast<size_t>(n));
    std::vector<int> active;
    for (int i = 0; i < n; ++i)
        if (mine(i) && !failed[i]) {
            out[i].push_back(first[i]);
            active.push_back(i);
        }
    const RankCoord c = side.coord;
    const bool last_stage = c.pp == plan.decode.pp - 1;
    std::vector<std::vector<float>> last(static_cast<size_t>(n));  // per request, last step
    const auto td = Clock::now();
    if (side.cp_session) {
        // CpSession decodes one sequence per collective step; every CP rank gets the logits.
        for (int i = 0; i < n; ++i)
            if (failed[i]) side.cp_session->release(static_cast<SeqId>(i));
        for (int step = 1; step < gen; ++step)
            for (int i : active) {
                last[i] = side.cp_session->decode(static_cast<SeqId>(i), out[i].back());
                out[i].push_back(argmax(last[i]));
            }
    } else {
        const int bs = opt.decode_block_size;
        for (int step = 1; step < gen && !active.empty(); ++step) {
            world.keepalive();  // a one-rank decode group communicates with nobody per step
            ForwardBatch fb;
            for (int i : active) {
                const int64_t pos = plan.prompt_len[i] + step - 1;
                fb.token_ids.push_back(out[i].back());
                fb.slots.push_back(pos);
                fb.queries.add_sequence(1, pos);
                const int64_t blocks = (pos + 1 + bs - 1) / bs;
                const auto& table = plan.decode_tables[i];
                fb.kv.add_sequence(std::vector<int32_t>(table.begin(), table.begin() + blocks),
                                   pos + 1, bs);
                fb.state_slots.push_back(i);  // request i's state (state layers)
            }
            const std::vector<float> logits = model.forward(fb);
            const std::vector<int32_t> toks =
                pass_greedy_tokens(&group, plan.decode, c, logits, static_cast<int>(active.size()),
                                   vocab, kTagDecodeTokens);
            for (size_t k = 0; k < active.size(); ++k) {
                out[active[k]].push_back(toks[k]);
                if (last_stage)
                    last[active[k]].assign(logits.begin() + static_cast<int64_t>(k) * vocab,
                                           logits.begin() + static_cast<int64_t>(k + 1) * vocab);
            }
        }
    }
    times.decode_seconds = seconds_since(td);
    const bool brings = last_stage && c.tp == 0 && c.cp == 0;
    for (int i = 0; i < n; ++i) {
        RequestResult r;
        r.id = i;
        r.error = errors[i];
        if (brings && mine(i)) {
            r.has_output = true;
            r.tokens = std::move(out[i]);
            r.failed = failed[i] != 0;
            r.last_logits = std::move(last[i]);  // empty when gen == 1 or the request failed
        }
        results.push_back(std::move(r));
    }
}

}  // namespace kvshard::serve
