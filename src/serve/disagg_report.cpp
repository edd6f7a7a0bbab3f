// A disaggregated run's report from every rank's part: one clock for the times, the transfer
// totals, and each request's tokens, logits and error.
#include <algorithm>
#include <functional>
#include <string>

#include <unistd.h>

#include "serve/disagg_run.h"

namespace kvshard::serve {
namespace {

uint64_t host_hash() {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    return std::hash<std::string>{}(name);
}

}  // namespace

RankTimes start_times(Clock::time_point t0) {
    RankTimes t;
    t.start_abs = std::chrono::duration<double>(t0.time_since_epoch()).count();
    t.host = host_hash();
    return t;
}

DisaggReport merge_disagg_report(const DisaggPlan& plan, const DisaggOptions& opt,
                                 const std::vector<RankContribution<RankTimes>>& parts) {
    const int n = plan.requests, P = plan.prefill_ranks;
    DisaggReport rep;
    rep.tokens.resize(n);
    rep.last_logits.resize(n);
    rep.errors.resize(n);
    rep.prefill_replica = plan.prefill_replica;
    rep.decode_replica = plan.decode_replica;
    std::vector<std::vector<float>> prefill_logits(static_cast<size_t>(n));
    std::vector<int32_t> failed_flags(static_cast<size_t>(n), 0);
    rep.transfer_start_s = -1;
    // One host: shift every rank's times onto the earliest start.
    double first_start = 0;
    bool one_host = true;
    for (size_t r = 0; r < parts.size(); ++r) {
        const RankTimes& t = parts[r].row;
        first_start = r == 0 ? t.start_abs : std::min(first_start, t.start_abs);
        one_host = one_host && t.host == parts[0].row.host;
    }
    for (int r = 0; r < static_cast<int>(parts.size()); ++r) {
        RankTimes t = parts[r].row;
        if (one_host) {
            const double shift = t.start_abs - first_start;
            for (double* x : {&t.prefill_end, &t.last_layer_done, &t.first_send, &t.transfer_done})
                if (*x >= 0) *x += shift;
        }
        for (const RequestResult& res : parts[r].results) {
            const auto i = static_cast<size_t>(res.id);
            if (r < P) {  // the prefill's last stage: the logits of the prefill step
                prefill_logits[i] = res.last_logits;
                continue;
            }
            if (!res.error.empty() && rep.errors[i].empty())
                rep.errors[i] = "decode rank " + std::to_string(r - P) + ": " + res.error;
            if (res.has_output) {
                rep.tokens[i] = res.tokens;
                failed_flags[i] = res.failed ? 1 : 0;
                rep.last_logits[i] = res.last_logits;
            }
        }
        rep.prefill_seconds = std::max(rep.prefill_seconds, t.prefill_end);
        rep.last_layer_s = std::max(rep.last_layer_s, t.last_layer_done);
        if (t.first_send >= 0)
            rep.transfer_start_s = rep.transfer_start_s < 0
                                       ? t.first_send
                                       : std::min(rep.transfer_start_s, t.first_send);
        rep.transfer_end_s = std::max(rep.transfer_end_s, t.transfer_done);
        rep.decode_seconds = std::max(rep.decode_seconds, t.decode_seconds);
        rep.transfer_bytes += t.bytes;
        rep.messages += t.messages;
        rep.direct_messages += t.direct_messages;
        rep.unit_checksum_messages += t.unit_checksum_messages;
    }
    if (rep.transfer_start_s < 0) rep.transfer_start_s = rep.transfer_end_s;
    rep.transfer_seconds = std::max(0.0, rep.transfer_end_s - rep.transfer_start_s);
    rep.exposed_seconds =
        std::clamp(rep.transfer_end_s - std::max(rep.last_layer_s, rep.transfer_start_s), 0.0,
                   rep.transfer_seconds);
    rep.hidden_fraction =
        rep.transfer_seconds > 0 ? 1.0 - rep.exposed_seconds / rep.transfer_seconds : 1.0;
    for (int i = 0; i < n; ++i) {
        if (failed_flags[i] && rep.errors[i].empty()) rep.errors[i] = "failed";
        rep.min_bytes += plan.transfers[i]->min_bytes;
        rep.tail_bytes += tail_bytes(*plan.transfers[i]);
        if (!rep.errors[i].empty()) ++rep.failed_requests;
        if (opt.max_new_tokens == 1 && rep.errors[i].empty() && !prefill_logits[i].empty())
            rep.last_logits[i] = prefill_logits[i];
    }
    rep.mode = group_modes_text(*plan.transfers[0], opt.transfer.mode);
    rep.streamed = opt.stream_layers;
    rep.prefix_cache = plan.prefix_cache;
    if (opt.prefix_cache && !plan.prefix_cache)
        rep.prefix_cache_note =
            plan.model.uniform()
                ? "the prefix cache is off: a side with cp > 1 serves each request whole "
                  "(CpSession runs without prefix reuse here)"
                : "the prefix cache is off: this model's windowed or state layers keep less than "
                  "the whole prefix, and a disaggregated run reuses prefixes only where every "
                  "layer keeps it";
    for (int i = 0; i < n; ++i) {
        rep.prompt_tokens += plan.prompt_len[i];
        rep.prefill_computed_tokens += plan.prompt_len[i] - plan.prefill_cached[i];
        rep.decode_cached_tokens += plan.decode_cached[i];
    }
    return rep;
}

}  // namespace kvshard::serve
