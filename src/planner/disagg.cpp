#include "kvshard/planner/disagg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/planner/planner.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {
namespace {

std::string layout_name(const ParallelConfig& p) {
    std::string s;
    auto add = [&](const char* k, int v) {
        if (v > 1) s += (s.empty() ? "" : " ") + std::string(k) + std::to_string(v);
    };
    add("pp", p.pp);
    add("cp", p.cp);
    add("tp", p.tp);
    add("ep", p.ep);
    return s.empty() ? "1 GPU" : s;
}

ParallelConfig one_instance(ParallelConfig p) {
    p.dp = 1;
    return p;
}

// Mean wait in an M/G/1 queue (Poisson arrivals) at utilization rho < 1, Pollaczek-Khinchine:
// W = rho * c / (2 (1 - rho)) with c = E[S^2] / E[S] (c = t for a fixed service time t: M/D/1).
double mg1_wait_s(double rho, double c) { return rho <= 0 ? 0.0 : rho * c / (2 * (1 - rho)); }

// The highest utilization whose M/G/1 wait is at most `slack` seconds.
double mg1_max_rho(double slack, double c) {
    if (slack <= 0) return 0;
    const double k = slack / c;
    return 2 * k / (1 + 2 * k);
}

struct PrefillSide {
    bool fits = false;
    std::string why_not;
    double prefill_s = 0;   // mean over the prompt lengths
    double residual_s = 0;  // E[t^2] / E[t]: the queue's c (= prefill_s for one length)
};

struct DecodeSide {
    bool fits = false;
    std::string why_not;
    int64_t batch = 0;  // the largest batch whose step meets the TPOT SLO (aggregated: fits)
    int64_t batch_fit = 0;
    double step_s = 0;
};

class Evaluator {
  public:
    Evaluator(const ModelSpec& m, const HardwareSpec& hw, const ServingRequest& r)
        : m_(m),
          hw_(hw),
          r_(r),
          // Speculating, the MTP layers' KV is in the same KV cache groups as the model's own
          // layers (gpu_model_runner.get_kv_cache_spec), so the connector moves it with them.
          moved_(r.capacity.speculative_tokens > 0 && m.mtp.enabled() ? with_mtp_layers(m) : m) {
        cost_ = r.cost;
        cost_.weight_dtype = r.weight_dtype;
        new_tokens_ =
            std::max<int64_t>(1, static_cast<int64_t>(std::llround(double(r.prompt_tokens) *
                                                                   (1.0 - r.prefix_hit_rate))));
    }
    int64_t new_tokens() const { return new_tokens_; }

    const PrefillSide& prefill(const ParallelConfig& p) {
        const std::string key = p.to_string();
        auto it = prefill_.find(key);
        if (it != prefill_.end()) return it->second;
        PrefillSide s;
        CapacityOptions c = r_.capacity;
        c.context_tokens = r_.prompt_tokens;
        c.weight_dtype = r_.weight_dtype;
        const CapacityReport cap = compute_capacity(m_, p, hw_, c);
        s.fits = cap.fits;
        s.why_not = cap.why_not;
        if (r_.prompt_samples.empty()) {
            s.prefill_s = prefill_time(p, r_.prompt_tokens);
            s.residual_s = s.prefill_s;
        } else {
            // The trace's lengths, rounded up to 256 tokens so that few distinct ones are costed.
            std::map<int64_t, double> memo;
            double sum = 0, sum2 = 0;
            for (int64_t len : r_.prompt_samples) {
                const int64_t q = (len + 255) / 256 * 256;
                auto it = memo.find(q);
                if (it == memo.end()) it = memo.emplace(q, prefill_time(p, q)).first;
                sum += it->second;
                sum2 += it->second * it->second;
            }
            const double n = static_cast<double>(r_.prompt_samples.size());
            s.prefill_s = sum / n;
            s.residual_s = sum2 / sum;
        }
        return prefill_.emplace(key, s).first->second;
    }

    // One prompt of `len` tokens, of which the prefix-hit share is cached.
    double prefill_time(const ParallelConfig& p, int64_t len) const {
        const int64_t fresh = std::max<int64_t>(
            1, static_cast<int64_t>(std::llround(double(len) * (1.0 - r_.prefix_hit_rate))));
        return estimate_cost(m_, p, hw_, work(fresh, len, 1), cost_).ttft_s;
    }

    // Decode steps at the mean context of a request's decode (prompt + half its output). The
    // prompt is the whole request's: it places the context on the CP ranks (a windowed layer's
    // window at the end of a zigzag prompt lies on one rank, cost_model.h).
    double step_s(const ParallelConfig& p, int64_t batch) const {
        const int64_t ctx = r_.prompt_tokens + std::max<int64_t>(1, r_.output_tokens / 2);
        return estimate_cost(m_, p, hw_, work(r_.prompt_tokens, ctx, batch), cost_).tpot_s;
    }

    // The largest batch that fits in KV (capped at max_batch) and, when `slo_bound`, whose step
    // meets the TPOT SLO (the step grows with the batch: bisection).
    const DecodeSide& decode(const ParallelConfig& p, bool slo_bound) {
        const std::string key = p.to_string() + (slo_bound ? "/slo" : "");
        auto it = decode_.find(key);
        if (it != decode_.end()) return it->second;
        DecodeSide s;
        CapacityOptions c = r_.capacity;
        c.context_tokens = r_.prompt_tokens + r_.output_tokens;
        c.weight_dtype = r_.weight_dtype;
        const CapacityReport cap = compute_capacity(m_, p, hw_, c);
        s.fits = cap.fits;
        s.why_not = cap.why_not;
        s.batch_fit = std::min<int64_t>(cap.requests_per_replica, r_.max_batch);
        if (s.fits && s.batch_fit >= 1) {
            int64_t lo = 1, hi = s.batch_fit;
            if (slo_bound && step_s(p, 1) > r_.tpot_slo_s) {
                s.fits = false;
                char buf[128];
                std::snprintf(buf, sizeof buf, "one request's decode step %.1f ms exceeds TPOT SLO",
                              step_s(p, 1) * 1e3);
                s.why_not = buf;
            } else if (slo_bound) {
                while (lo < hi) {  // invariant: step(lo) <= slo
                    const int64_t mid = lo + (hi - lo + 1) / 2;
                    if (step_s(p, mid) <= r_.tpot_slo_s)
                        lo = mid;
                    else
                        hi = mid - 1;
                }
            } else {
                lo = hi;
            }
            s.batch = lo;
            s.step_s = step_s(p, lo);
        }
        return decode_.emplace(key, s).first->second;
    }

    const KvTransferCost& transfer(const ParallelConfig& pf, const ParallelConfig& dc,
                                   double prefill_s) {
        const std::string key = pf.to_string() + "->" + dc.to_string();
        auto it = transfer_.find(key);
        if (it != transfer_.end()) return it->second;
        return transfer_
            .emplace(key, price_kv_transfer(moved_, pf, dc, hw_, r_.prompt_tokens, prefill_s,
                                            r_.capacity.block_size))
            .first->second;
    }

  private:
    static Workload work(int64_t prompt, int64_t ctx, int64_t batch) {
        Workload w;
        w.prompt_tokens = prompt;
        w.context_tokens = ctx;
        w.batch = batch;
        return w;
    }
    const ModelSpec& m_;
    const HardwareSpec& hw_;
    const ServingRequest& r_;
    ModelSpec moved_;  // the layers whose KV a prefill instance sends
    CostOptions cost_;
    int64_t new_tokens_ = 1;
    std::map<std::string, PrefillSide> prefill_;
    std::map<std::string, DecodeSide> decode_;
    std::map<std::string, KvTransferCost> transfer_;
};

ServingEntry aggregated(Evaluator& ev, const ServingRequest& r, const ParallelConfig& p) {
    ServingEntry e;
    e.disaggregated = false;
    // The whole configuration is costed (its replicas are identical, and EP may span them).
    e.prefill = e.decode = p;
    e.prefill_instances = e.decode_instances = p.dp;
    e.gpus_used = p.world_size();
    e.prefill_tokens = ev.new_tokens();
    const PrefillSide& pf = ev.prefill(e.prefill);
    const DecodeSide& dc = ev.decode(e.decode, false);
    e.prefill_s = pf.prefill_s;
    if (!pf.fits || !dc.fits || dc.batch_fit < 1) {
        e.why_not = !pf.fits ? pf.why_not : dc.why_not;
        if (e.why_not.empty()) e.why_not = "no decode batch fits";
        return e;
    }
    // Each replica interleaves prefills with decode steps: at request rate lambda it spends
    // rho = lambda * t_p of its time prefilling, so a step takes t_d / (1 - rho) for the requests
    // decoding; Little's law with B slots: lambda * out * t_d / (1 - rho) <= B. The TPOT SLO caps
    // rho at 1 - t_d / slo and the TTFT SLO (M/G/1 wait for the prefill) at mg1_max_rho.
    const double tp = pf.prefill_s, out = static_cast<double>(r.output_tokens);
    const double rho_ttft = mg1_max_rho(r.ttft_slo_s - tp, pf.residual_s);
    double best = 0;
    int64_t best_b = 0;
    double best_td = 0;
    std::vector<int64_t> batches;
    for (int64_t b = 1; b < dc.batch_fit; b *= 2) batches.push_back(b);
    batches.push_back(dc.batch_fit);
    for (int64_t b : batches) {
        const double td = ev.step_s(e.decode, b);
        const double rho_tpot = 1 - td / r.tpot_slo_s;
        if (rho_tpot <= 0) continue;
        const double lambda =
            std::min({double(b) / (out * td + double(b) * tp), rho_tpot / tp, rho_ttft / tp});
        if (lambda > best) {
            best = lambda;
            best_b = b;
            best_td = td;
        }
    }
    e.decode_batch = best_b > 0 ? best_b : 1;
    e.step_s = best_b > 0 ? best_td : ev.step_s(e.decode, 1);
    const double rho = best * tp;
    e.queue_s = mg1_wait_s(rho, pf.residual_s);
    e.ttft_s = e.queue_s + tp;
    e.tpot_s = e.step_s / (1 - rho);
    e.requests_per_s = best * p.dp;
    e.tokens_per_s_per_gpu = e.requests_per_s * out / e.gpus_used;
    if (tp >= r.ttft_slo_s) {
        e.ttft_s = tp;
        e.why_not = detail::concat("prefill alone exceeds the TTFT SLO");
    } else if (best <= 0) {
        e.tpot_s = e.step_s;
        e.why_not = "one request's decode step exceeds the TPOT SLO";
    }
    e.meets_slo = e.why_not.empty();
    return e;
}

}  // namespace

void ServingRequest::validate() const {
    require(gpus >= 1 && gpus <= ParallelConfig::kMaxWorldSize,
            "the GPU count must be an integer in [1, ", ParallelConfig::kMaxWorldSize, "], got ",
            gpus);
    require(prompt_tokens >= 1 && prompt_tokens <= kMaxTransferTokens,
            "the prompt must be in [1, 2^26] tokens, got ", prompt_tokens);
    require(output_tokens >= 1, "the output must be at least 1 token, got ", output_tokens);
    for (int64_t len : prompt_samples)
        require(len >= 1 && len <= kMaxTransferTokens,
                "every prompt length of the distribution must be in [1, 2^26] tokens, got ", len);
    require(prefix_hit_rate >= 0 && prefix_hit_rate < 1,
            "the prefix hit rate must be in [0, 1), got ", prefix_hit_rate);
    // At most kMaxSloS: beyond it the M/G/1 queue figures overflow to inf and NaN.
    require(ttft_slo_s > 0 && ttft_slo_s <= kMaxSloS,
            "the TTFT SLO must be a positive number of seconds up to ", kMaxSloS,
            " (e.g. --ttft-slo 2), got ", ttft_slo_s);
    require(tpot_slo_s > 0 && tpot_slo_s <= kMaxSloS,
            "the TPOT SLO must be a positive number of seconds up to ", kMaxSloS,
            " (e.g. --tpot-slo 0.05), got ", tpot_slo_s);
    require(max_batch >= 1, "max_batch must be a positive integer, got ", max_batch);
    capacity.validate();
    cost.validate();
}

KvTransferCost price_kv_transfer(const ModelSpec& m, const ParallelConfig& prefill,
                                 const ParallelConfig& decode, const HardwareSpec& hw,
                                 int64_t tokens, double prefill_s, int block_size) {
    TransferEndpoint src, dst;
    src.layout = make_layout(m, one_instance(prefill));
    dst.layout = make_layout(m, one_instance(decode));
    src.block_size = dst.block_size = block_size;
    src.block_tables = sequential_block_tables(src.layout, block_size, tokens);
    dst.block_tables = sequential_block_tables(dst.layout, block_size, tokens);
    const TransferPlan plan = make_transfer_plan(src, dst, tokens);

    KvTransferCost c;
    c.bytes = plan.bytes;
    c.messages = static_cast<int64_t>(plan.messages.size());
    c.crosses_nodes =
        prefill.world_size() / prefill.dp + decode.world_size() / decode.dp > hw.gpus_per_node;
    const double bw = hw.link_bw(c.crosses_nodes), alpha = hw.hop_latency_s(c.crosses_nodes);
    std::vector<int64_t> sent(src.layout.world_size()), recv(dst.layout.world_size());
    std::vector<int64_t> sent_msgs(sent.size()), recv_msgs(recv.size());
    for (const TransferMessage& msg : plan.messages) {
        sent[msg.src_rank] += msg.bytes;
        recv[msg.dst_rank] += msg.bytes;
        // Streamed layer by layer, the message is one per layer it covers.
        sent_msgs[msg.src_rank] += msg.num_layers();
        recv_msgs[msg.dst_rank] += msg.num_layers();
        c.layerwise_messages += msg.num_layers();
    }
    auto rank_s = [&](int64_t bytes, int64_t msgs) {
        return bytes == 0 ? 0.0
                          : hw.collective_launch_s + double(msgs) * alpha + double(bytes) / bw;
    };
    for (size_t r = 0; r < sent.size(); ++r) {
        c.busiest_rank_bytes = std::max(c.busiest_rank_bytes, sent[r]);
        c.transfer_s = std::max(c.transfer_s, rank_s(sent[r], sent_msgs[r]));
    }
    for (size_t r = 0; r < recv.size(); ++r) {
        c.busiest_rank_bytes = std::max(c.busiest_rank_bytes, recv[r]);
        c.transfer_s = std::max(c.transfer_s, rank_s(recv[r], recv_msgs[r]));
    }
    // Layer l leaves when the prefill has written it: all but the last layer's share can hide
    // behind the prefill of the layers after it. The prefill writes a decoder layer's caches
    // together (Falcon-H1's attention and Mamba-2 branches), so the shares are per decoder layer.
    const double layers = std::max(1, m.num_decoder_layers());
    c.exposed_s = std::max(c.transfer_s / layers, c.transfer_s - prefill_s * (layers - 1) / layers);
    return c;
}

std::string ServingEntry::name() const {
    if (!disaggregated)
        return layout_name(decode) +
               (decode_instances > 1 ? " x" + std::to_string(decode_instances) : std::string());
    return "P " + layout_name(prefill) + " x" + std::to_string(prefill_instances) + " + D " +
           layout_name(decode) + " x" + std::to_string(decode_instances);
}

std::vector<ServingEntry> plan_serving(const ModelSpec& m, const HardwareSpec& hw,
                                       const ServingRequest& r) {
    r.validate();
    hw.validate();
    m.validate();
    // A request holds its prompt and its output: vLLM's max_model_len bounds both together.
    m.check_sequence_length(r.prompt_tokens + r.output_tokens, r.capacity.allow_long_context,
                            detail::concat("a prompt of ", r.prompt_tokens, " tokens plus ",
                                           r.output_tokens, " of output"));
    // Each prompt of the distribution is one request's: vLLM refuses a prompt of max_model_len
    // tokens or more (vllm/v1/engine/input_processor.py, InputProcessor._validate_prompt_len).
    // Not prompt + output_tokens: that is a mean, and a trace's requests are checked each with its
    // own output before they get here (check_trace_lengths).
    for (size_t i = 0; i < r.prompt_samples.size(); ++i)
        m.check_computed_length(r.prompt_samples[i], r.capacity.allow_long_context,
                                detail::concat("prompt ", i, " of the distribution"));
    Evaluator ev(m, hw, r);
    std::vector<ServingEntry> out;
    // Speculating, the transfer of the MTP layers' KV (moved_) is modelled at pp 1 only: at
    // pp > 1 vLLM puts them on the last stage, which price_kv_transfer's layouts do not follow.
    const bool pp1_only = r.capacity.speculative_tokens > 0;
    for (const ParallelConfig& p : enumerate_configs(m, r.gpus, r.cp_scheme))
        if (!pp1_only || p.pp == 1) out.push_back(aggregated(ev, r, p));

    if (r.disaggregated) {
        // Instance layouts (dp = 1) of every size below N that some split of N can use.
        std::vector<ParallelConfig> layouts;
        for (int g = 1; g < r.gpus; ++g)
            for (const ParallelConfig& p : enumerate_configs(m, g, r.cp_scheme))
                if (p.dp == 1 && (!pp1_only || p.pp == 1)) layouts.push_back(p);
        const double out_tokens = static_cast<double>(r.output_tokens);
        for (const ParallelConfig& pf : layouts) {
            const PrefillSide& ps = ev.prefill(pf);
            if (!ps.fits || ps.prefill_s >= r.ttft_slo_s) continue;
            for (const ParallelConfig& dc : layouts) {
                const int gp = pf.world_size(), gd = dc.world_size();
                const DecodeSide& ds = ev.decode(dc, true);
                if (!ds.fits) continue;
                bool priced = false;
                KvTransferCost tc;
                for (int np = 1; np * gp < r.gpus; ++np) {
                    if ((r.gpus - np * gp) % gd != 0) continue;
                    const int nd = (r.gpus - np * gp) / gd;
                    if (!priced) {
                        tc = ev.transfer(pf, dc, ps.prefill_s);
                        priced = true;
                    }
                    ServingEntry e;
                    e.disaggregated = true;
                    e.prefill = pf;
                    e.decode = dc;
                    e.prefill_instances = np;
                    e.decode_instances = nd;
                    e.gpus_used = r.gpus;
                    e.prefill_tokens = ev.new_tokens();
                    e.prefill_s = ps.prefill_s;
                    e.transfer = tc;
                    e.decode_batch = ds.batch;
                    e.step_s = e.tpot_s = ds.step_s;
                    const double rho_max =
                        mg1_max_rho(r.ttft_slo_s - ps.prefill_s - tc.exposed_s, ps.residual_s);
                    const double lambda_p = np * rho_max / ps.prefill_s;
                    const double lambda_d = nd * double(ds.batch) / (out_tokens * ds.step_s);
                    const double lambda = std::min(lambda_p, lambda_d);
                    const double rho = lambda * ps.prefill_s / np;
                    e.queue_s = mg1_wait_s(rho, ps.residual_s);
                    e.ttft_s = e.queue_s + ps.prefill_s + tc.exposed_s;
                    e.requests_per_s = lambda;
                    e.tokens_per_s_per_gpu = lambda * out_tokens / r.gpus;
                    if (rho_max <= 0) e.why_not = "prefill + exposed KV transfer exceed TTFT SLO";
                    e.meets_slo = e.why_not.empty();
                    out.push_back(e);
                }
            }
        }
    }
    std::stable_sort(out.begin(), out.end(), [](const ServingEntry& a, const ServingEntry& b) {
        if (a.meets_slo != b.meets_slo) return a.meets_slo;
        if (!a.meets_slo) return false;
        if (a.tokens_per_s_per_gpu != b.tokens_per_s_per_gpu)
            return a.tokens_per_s_per_gpu > b.tokens_per_s_per_gpu;
        // Equal throughput (e.g. both prefill-bound): the faster decode, then the earlier token.
        if (a.tpot_s != b.tpot_s) return a.tpot_s < b.tpot_s;
        return a.ttft_s < b.ttft_s;
    });
    return out;
}

std::string serving_to_json(const ModelSpec& m, const HardwareSpec& hw, const ServingRequest& r,
                            const std::vector<ServingEntry>& entries) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    auto layout = [](const ParallelConfig& p) {
        return nlohmann::ordered_json{
            {"layout", p.to_string()}, {"pp", p.pp}, {"cp", p.cp}, {"tp", p.tp}, {"ep", p.ep}};
    };
    for (const ServingEntry& e : entries) {
        nlohmann::ordered_json j = {{"name", e.name()},
                                    {"disaggregated", e.disaggregated},
                                    {"prefill", layout(e.prefill)},
                                    {"decode", layout(e.decode)},
                                    {"prefill_instances", e.prefill_instances},
                                    {"decode_instances", e.decode_instances},
                                    {"meets_slo", e.meets_slo},
                                    {"prefill_tokens", e.prefill_tokens},
                                    {"prefill_s", e.prefill_s},
                                    {"queue_s", e.queue_s},
                                    {"ttft_s", e.ttft_s},
                                    {"tpot_s", e.tpot_s},
                                    {"decode_batch", e.decode_batch},
                                    {"requests_per_s", e.requests_per_s},
                                    {"tokens_per_s_per_gpu", e.tokens_per_s_per_gpu}};
        if (e.disaggregated)
            j["transfer"] = {{"bytes", e.transfer.bytes},
                             {"messages", e.transfer.messages},
                             {"layerwise_messages", e.transfer.layerwise_messages},
                             {"busiest_rank_bytes", e.transfer.busiest_rank_bytes},
                             {"crosses_nodes", e.transfer.crosses_nodes},
                             {"transfer_s", e.transfer.transfer_s},
                             {"exposed_s", e.transfer.exposed_s}};
        if (!e.meets_slo) j["why_not"] = e.why_not;
        list.push_back(std::move(j));
    }
    nlohmann::ordered_json o = {{"model", m.name},
                                {"hardware", hw.name},
                                {"gpus", r.gpus},
                                {"prompt_tokens", r.prompt_tokens},
                                {"output_tokens", r.output_tokens},
                                {"prefix_hit_rate", r.prefix_hit_rate},
                                {"ttft_slo_s", r.ttft_slo_s},
                                {"tpot_slo_s", r.tpot_slo_s},
                                {"weight_dtype", weight_dtype_name(r.weight_dtype)}};
    if (r.capacity.speculative_tokens > 0) {
        o["speculative_method"] = "mtp";
        o["speculative_tokens"] = r.capacity.speculative_tokens;
    }
    o["configs"] = list;
    return o.dump(2);
}

std::string serving_to_svg(const ModelSpec& m, const HardwareSpec& hw, const ServingRequest& r,
                           const std::vector<ServingEntry>& entries) {
    const double W = 900, H = 560, L = 80, R = 860, T = 70, B = 490;
    std::vector<const ServingEntry*> pts;
    for (const auto& e : entries)
        if (e.tokens_per_s_per_gpu > 0 && e.ttft_s <= r.ttft_slo_s) pts.push_back(&e);
    std::ostringstream s;
    s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
      << "\" viewBox=\"0 0 " << W << " " << H
      << "\" font-family=\"Helvetica, Arial, sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
    char buf[256];
    std::snprintf(
        buf, sizeof buf,
        "%s on %d x %s, prompt %lld, output %lld tokens, TTFT SLO %.3g s, TPOT SLO %.3g s",
        m.name.c_str(), r.gpus, hw.name.c_str(), static_cast<long long>(r.prompt_tokens),
        static_cast<long long>(r.output_tokens), r.ttft_slo_s, r.tpot_slo_s);
    s << "<text x=\"" << L << "\" y=\"30\" font-size=\"15\" font-weight=\"bold\">" << buf
      << "</text>\n<text x=\"" << L
      << "\" y=\"52\" font-size=\"12\" fill=\"#444\">Configurations within the TTFT SLO. Up-left "
         "is better. Lines: Pareto fronts (blue aggregated, orange disaggregated); dashed: the "
         "TPOT SLO.</text>\n";
    if (pts.empty()) {
        s << "<text x=\"" << L << "\" y=\"" << (T + B) / 2
          << "\" font-size=\"16\" fill=\"#a00\">No configuration meets the TTFT "
             "SLO.</text>\n</svg>\n";
        return s.str();
    }
    double x0 = r.tpot_slo_s, x1 = r.tpot_slo_s, y1 = 0;
    for (auto* e : pts) {
        x0 = std::min(x0, e->tpot_s);
        x1 = std::max(x1, e->tpot_s);
        y1 = std::max(y1, e->tokens_per_s_per_gpu);
    }
    const double lx0 = std::log10(x0) - 0.1, lx1 = std::log10(x1) + 0.1;
    y1 *= 1.1;
    auto px = [&](double v) { return L + (std::log10(v) - lx0) / (lx1 - lx0) * (R - L); };
    auto py = [&](double v) { return B - v / y1 * (B - T); };
    s << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << R - L << "\" height=\"" << B - T
      << "\" fill=\"#fafafa\" stroke=\"#888\"/>\n";
    for (double d = std::floor(lx0); d <= std::ceil(lx1); ++d)
        for (int k : {1, 2, 3, 5, 7}) {
            const double v = std::pow(10, d) * k;
            if (std::log10(v) < lx0 || std::log10(v) > lx1) continue;
            s << "<line x1=\"" << px(v) << "\" y1=\"" << T << "\" x2=\"" << px(v) << "\" y2=\"" << B
              << "\" stroke=\"#ddd\"/><text x=\"" << px(v) << "\" y=\"" << B + 18
              << "\" font-size=\"12\" text-anchor=\"middle\">" << v * 1e3 << " ms</text>\n";
        }
    for (int i = 0; i <= 5; ++i) {
        const double v = y1 * i / 5;
        s << "<text x=\"" << L - 6 << "\" y=\"" << py(v) + 4
          << "\" font-size=\"12\" text-anchor=\"end\">" << std::lround(v) << "</text>\n";
    }
    s << "<line x1=\"" << px(r.tpot_slo_s) << "\" y1=\"" << T << "\" x2=\"" << px(r.tpot_slo_s)
      << "\" y2=\"" << B << "\" stroke=\"#a00\" stroke-dasharray=\"5 3\"/>\n";
    s << "<text x=\"" << (L + R) / 2 << "\" y=\"" << B + 42
      << "\" font-size=\"14\" text-anchor=\"middle\">time per output token</text>\n"
      << "<text x=\"20\" y=\"" << (T + B) / 2
      << "\" font-size=\"14\" text-anchor=\"middle\" transform=\"rotate(-90 20 " << (T + B) / 2
      << ")\">output tokens/s per GPU</text>\n";
    for (bool dis : {false, true}) {
        std::vector<const ServingEntry*> kind;
        for (auto* e : pts)
            if (e->disaggregated == dis) kind.push_back(e);
        std::sort(kind.begin(), kind.end(), [](auto* a, auto* b) { return a->tpot_s < b->tpot_s; });
        const char* color = dis ? "#e80" : "#27c";
        // Front: the best throughput at or below each TPOT.
        std::vector<const ServingEntry*> front;
        for (auto* e : kind)
            if (front.empty() || e->tokens_per_s_per_gpu > front.back()->tokens_per_s_per_gpu)
                front.push_back(e);
        if (front.size() > 1) {
            s << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\" points=\"";
            for (size_t i = 0; i < front.size(); ++i) {
                if (i)
                    s << px(front[i]->tpot_s) << "," << py(front[i - 1]->tokens_per_s_per_gpu)
                      << " ";
                s << px(front[i]->tpot_s) << "," << py(front[i]->tokens_per_s_per_gpu) << " ";
            }
            s << "\"/>\n";
        }
        for (auto* e : kind)
            s << "<circle cx=\"" << px(e->tpot_s) << "\" cy=\"" << py(e->tokens_per_s_per_gpu)
              << "\" r=\"3.5\" fill=\"" << color << "\" fill-opacity=\"0.6\"><title>" << e->name()
              << "</title></circle>\n";
    }
    s << "</svg>\n";
    return s.str();
}

}  // namespace kvshard
