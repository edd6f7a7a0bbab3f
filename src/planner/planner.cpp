#include "kvshard/planner/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

std::string short_name(const ParallelConfig& p) {
    std::string s;
    auto add = [&](const char* k, int v) {
        if (v > 1) s += (s.empty() ? "" : " ") + std::string(k) + std::to_string(v);
    };
    add("dp", p.dp);
    add("pp", p.pp);
    add("cp", p.cp);
    add("tp", p.tp);
    add("ep", p.ep);
    return s.empty() ? "1 GPU" : s;
}

std::string xml_escape(const std::string& s) {
    std::string out;
    for (char c : s) {
        if (c == '<')
            out += "&lt;";
        else if (c == '>')
            out += "&gt;";
        else if (c == '&')
            out += "&amp;";
        else if (c == '"')
            out += "&quot;";
        else
            out += c;
    }
    return out;
}

std::string fmt_time(double s) {
    char buf[32];
    if (s >= 1)
        std::snprintf(buf, sizeof buf, "%.3g s", s);
    else if (s >= 1e-3)
        std::snprintf(buf, sizeof buf, "%.3g ms", s * 1e3);
    else
        std::snprintf(buf, sizeof buf, "%.3g us", s * 1e6);
    return buf;
}

// A few words for the chart: what ran out.
std::string short_reason(const PlanEntry& e) {
    const auto& c = e.capacity;
    const auto& worst = c.ranks.at(c.limiting_rank);
    char buf[96];
    if (worst.kv_budget_bytes <= 0)
        std::snprintf(buf, sizeof buf, "weights %.0f GiB per GPU",
                      c.weight_bytes_per_gpu / 1073741824.0);
    else if (c.kv_tokens_per_gpu == 0 || c.max_context == 0)
        std::snprintf(buf, sizeof buf, "no room for one KV block");
    else if (c.fits)
        std::snprintf(buf, sizeof buf, "batch needs more KV than fits");
    else
        std::snprintf(buf, sizeof buf, "KV holds %lld tokens per request at most",
                      static_cast<long long>(c.max_context));
    return buf;
}

}  // namespace

std::string_view objective_name(Objective o) {
    switch (o) {
        case Objective::kTtft:
            return "ttft";
        case Objective::kTpot:
            return "tpot";
        case Objective::kThroughput:
            return "throughput";
    }
    return "?";
}

Objective parse_objective(std::string_view s) {
    if (s == "ttft") return Objective::kTtft;
    if (s == "tpot") return Objective::kTpot;
    if (s == "throughput") return Objective::kThroughput;
    throw Error(detail::concat("unknown objective '", s, "': expected ttft, tpot or throughput"));
}

void PlanRequest::validate() const {
    require(gpus >= 1 && gpus <= ParallelConfig::kMaxWorldSize,
            "the GPU count must be an integer in [1, ", ParallelConfig::kMaxWorldSize, "], got ",
            gpus);
    require(context_tokens >= 1 && context_tokens <= kMaxContextTokens,
            "the context must be in [1, 2^40] tokens, got ", context_tokens);
    require(batch >= 0, "the batch must be >= 0 (0: as many as fit), got ", batch);
    require(max_batch >= 1, "max_batch must be a positive integer, got ", max_batch);
    require(prefix_hit_rate >= 0 && prefix_hit_rate < 1,
            "the prefix hit rate must be in [0, 1), got ", prefix_hit_rate);
    capacity.validate();
    cost.validate();
}

std::vector<ParallelConfig> enumerate_configs(const ModelSpec& m, int gpus, CpScheme cp_scheme) {
    require(gpus >= 1 && gpus <= ParallelConfig::kMaxWorldSize,
            "the GPU count must be an integer in [1, ", ParallelConfig::kMaxWorldSize, "], got ",
            gpus);
    m.validate();
    std::vector<ParallelConfig> out;
    for (int tp : divisors(gpus))
        for (int pp : divisors(gpus / tp))
            for (int cp : divisors(gpus / tp / pp)) {
                ParallelConfig p;
                p.tp = tp;
                p.pp = pp;
                p.cp = cp;
                p.dp = gpus / tp / pp / cp;
                p.cp_scheme = cp_scheme;
                const std::vector<int> eps =
                    m.moe.enabled() ? divisors(m.moe.num_experts) : std::vector<int>{1};
                for (int ep : eps) {
                    if (p.stage_size() % ep != 0) continue;
                    p.ep = ep;
                    try {
                        validate(m, p);
                    } catch (const Error&) {
                        continue;
                    }
                    out.push_back(p);
                }
            }
    return out;
}

PlanEntry evaluate_config(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& r,
                          const ParallelConfig& p) {
    r.validate();
    validate(m, p);
    validate_world(p, r.gpus);
    CapacityOptions cap_opt = r.capacity;
    cap_opt.context_tokens = r.context_tokens;
    cap_opt.weight_dtype = r.weight_dtype;
    CostOptions cost_opt = r.cost;
    cost_opt.weight_dtype = r.weight_dtype;
    PlanEntry e;
    e.parallel = p;
    e.capacity = compute_capacity(m, p, hw, cap_opt);
    e.fits = e.capacity.fits;
    if (e.fits && r.batch > e.capacity.requests_per_replica) {
        e.fits = false;
        e.capacity.why_not = detail::concat("a batch of ", r.batch, " requests of ",
                                            r.context_tokens, " tokens needs more KV than fits (",
                                            e.capacity.requests_per_replica, " per replica)");
    }
    e.batch = r.batch > 0 ? r.batch
                          : std::clamp<int64_t>(e.capacity.requests_per_replica, 1, r.max_batch);
    Workload w;
    w.prompt_tokens =
        std::max<int64_t>(1, std::llround(double(r.context_tokens) * (1.0 - r.prefix_hit_rate)));
    w.context_tokens = r.context_tokens;
    w.batch = e.batch;
    e.cost = estimate_cost(m, p, hw, w, cost_opt);
    return e;
}

std::vector<PlanEntry> plan(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& r) {
    r.validate();
    hw.validate();
    std::vector<PlanEntry> entries;
    for (const ParallelConfig& p : enumerate_configs(m, r.gpus, r.cp_scheme))
        entries.push_back(evaluate_config(m, hw, r, p));
    auto key = [&](const PlanEntry& e) {
        switch (r.objective) {
            case Objective::kTtft:
                return e.cost.ttft_s;
            case Objective::kTpot:
                return e.cost.tpot_s;
            case Objective::kThroughput:
                return -e.cost.decode_tokens_per_s;
        }
        return 0.0;
    };
    std::stable_sort(entries.begin(), entries.end(), [&](const PlanEntry& a, const PlanEntry& b) {
        if (a.fits != b.fits) return a.fits;
        if (!a.fits) return false;
        const double ka = key(a), kb = key(b);
        if (ka != kb) return ka < kb;
        const int ia = a.parallel.world_size() / a.parallel.dp,
                  ib = b.parallel.world_size() / b.parallel.dp;
        if (ia != ib) return ia < ib;
        return a.capacity.kv_tokens_per_gpu > b.capacity.kv_tokens_per_gpu;
    });
    return entries;
}

std::string plan_to_json(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& r,
                         const std::vector<PlanEntry>& entries) {
    nlohmann::ordered_json configs = nlohmann::ordered_json::array();
    for (const auto& e : entries) {
        const auto& p = e.parallel;
        const auto& c = e.capacity;
        const auto& k = e.cost;
        nlohmann::ordered_json j = {
            {"dp", p.dp},
            {"pp", p.pp},
            {"cp", p.cp},
            {"tp", p.tp},
            {"ep", p.ep},
            {"fits", e.fits},
            {"kv_tokens_per_gpu", c.kv_tokens_per_gpu},
            {"max_context", c.max_context},
            {"ttft_s", k.ttft_s},
            {"tpot_s", k.tpot_s},
            {"weight_bytes_per_gpu", c.weight_bytes_per_gpu},
            {"kv_bytes_per_token", c.kv_bytes_per_token},
            {"state_bytes_per_sequence", c.state_bytes_per_sequence},
            {"request_kv_bytes", c.request_kv_bytes},
            {"context_unbounded", c.context_unbounded},
            {"context_limited_by_model", c.context_limited_by_model},
            {"kv_blocks_per_gpu", c.kv_blocks_per_gpu},
            {"block_size", c.engine.block_size},
            {"kv_cache_groups", c.engine.groups.size()},
            {"request_blocks", c.request_blocks},
            {"requests_per_replica", c.requests_per_replica},
            {"max_concurrency", c.max_concurrency},
            {"batch", e.batch},
            {"decode_tokens_per_s", k.decode_tokens_per_s},
            {"prefill_comm_bytes",
             {{"tp", k.prefill.tp_bytes},
              {"pp", k.prefill.pp_bytes},
              {"cp", k.prefill.cp_bytes},
              {"ep", k.prefill.ep_bytes}}},
            {"decode_comm_bytes",
             {{"tp", k.decode.tp_bytes},
              {"pp", k.decode.pp_bytes},
              {"cp", k.decode.cp_bytes},
              {"ep", k.decode.ep_bytes}}},
            {"pp_bubble_s", {{"prefill", k.prefill.pp_bubble_s}, {"decode", k.decode.pp_bubble_s}}},
            {"ep_link_share_for_kv", k.ep_link_share_for_kv},
        };
        if (p.cp > 1) {
            j["cp_prefill"] = cp_prefill_policy_name(k.cp_prefill.chosen);
            j["cp_pass_kv_hidden"] = k.cp_prefill.pass_kv_hidden;
            j["cp_decode_merge"] = cp_merge_policy_name(k.cp_decode.chosen);
        }
        if (r.capacity.speculative_tokens > 0) {
            // The most one GPU holds: at pp > 1 only the last stage holds the drafter.
            int64_t drafter = 0;
            for (const RankCapacity& rc : c.ranks) drafter = std::max(drafter, rc.weights.drafter);
            j["drafter_weight_bytes_per_gpu"] = drafter;
        }
        if (!e.fits) j["why_not"] = c.why_not;
        configs.push_back(std::move(j));
    }
    nlohmann::ordered_json out = {{"model", m.name},
                                  {"hardware", hw.name},
                                  {"gpus", r.gpus},
                                  {"context", r.context_tokens},
                                  {"batch", r.batch},
                                  {"objective", objective_name(r.objective)},
                                  {"mem_util", r.capacity.mem_util},
                                  {"activation_reserve_bytes", r.capacity.activation_reserve_bytes},
                                  {"block_size", r.capacity.block_size},
                                  {"weight_dtype", weight_dtype_name(r.weight_dtype)},
                                  {"prefix_hit_rate", r.prefix_hit_rate},
                                  {"configs", configs}};
    if (r.capacity.speculative_tokens > 0) {
        // Placed before "configs" so the request's fields stay together.
        out.erase("configs");
        out["speculative_method"] = "mtp";
        out["speculative_tokens"] = r.capacity.speculative_tokens;
        out["configs"] = configs;
    }
    return out.dump(2);
}

std::string plan_to_svg(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& r,
                        const std::vector<PlanEntry>& entries) {
    std::vector<const PlanEntry*> fit, misfit;
    for (const auto& e : entries) (e.fits ? fit : misfit).push_back(&e);

    const double W = 1010, H = 600, L = 80, R = 660, T = 70, B = 520;  // plot box [L,R] x [T,B]
    std::ostringstream s;
    s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
      << "\" viewBox=\"0 0 " << W << " " << H
      << "\" font-family=\"Helvetica, Arial, sans-serif\">\n";
    s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s on %d x %s, context %lld tokens", m.name.c_str(), r.gpus,
                  hw.name.c_str(), static_cast<long long>(r.context_tokens));
    s << "<text x=\"" << L << "\" y=\"30\" font-size=\"18\" font-weight=\"bold\">"
      << xml_escape(buf) << "</text>\n";
    std::snprintf(
        buf, sizeof buf,
        "%zu of %zu configurations fit. Lower-left is better. Ranked by %s; the best is red.",
        fit.size(), entries.size(), std::string(objective_name(r.objective)).c_str());
    s << "<text x=\"" << L << "\" y=\"52\" font-size=\"13\" fill=\"#444\">" << xml_escape(buf)
      << "</text>\n";

    if (fit.empty()) {
        s << "<text x=\"" << L << "\" y=\"" << (T + B) / 2
          << "\" font-size=\"16\" fill=\"#a00\">No configuration fits in memory.</text>\n";
    } else {
        double x0 = 1e300, x1 = 0, y0 = 1e300, y1 = 0;
        for (auto* e : fit) {
            x0 = std::min(x0, e->cost.ttft_s);
            x1 = std::max(x1, e->cost.ttft_s);
            y0 = std::min(y0, e->cost.tpot_s);
            y1 = std::max(y1, e->cost.tpot_s);
        }
        // Log axes padded by a quarter decade around the data, ticks at 1, 2, 5 x 10^k.
        const double lx0 = std::log10(x0) - 0.25, lx1 = std::log10(x1) + 0.25;
        const double ly0 = std::log10(y0) - 0.25, ly1 = std::log10(y1) + 0.25;
        auto px = [&](double v) { return L + (std::log10(v) - lx0) / (lx1 - lx0) * (R - L); };
        auto py = [&](double v) { return B - (std::log10(v) - ly0) / (ly1 - ly0) * (B - T); };
        s << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << R - L << "\" height=\""
          << B - T << "\" fill=\"#fafafa\" stroke=\"#888\"/>\n";
        auto ticks = [](double l0, double l1) {
            std::vector<double> out;
            for (double d = std::floor(l0); d <= std::ceil(l1); ++d)
                for (int k : {1, 2, 5}) {
                    const double v = std::pow(10, d) * k;
                    if (std::log10(v) >= l0 && std::log10(v) <= l1) out.push_back(v);
                }
            return out;
        };
        for (double v : ticks(lx0, lx1)) {
            s << "<line x1=\"" << px(v) << "\" y1=\"" << T << "\" x2=\"" << px(v) << "\" y2=\"" << B
              << "\" stroke=\"#ddd\"/>\n";
            s << "<text x=\"" << px(v) << "\" y=\"" << B + 18
              << "\" font-size=\"12\" text-anchor=\"middle\">" << fmt_time(v) << "</text>\n";
        }
        for (double v : ticks(ly0, ly1)) {
            s << "<line x1=\"" << L << "\" y1=\"" << py(v) << "\" x2=\"" << R << "\" y2=\"" << py(v)
              << "\" stroke=\"#ddd\"/>\n";
            s << "<text x=\"" << L - 6 << "\" y=\"" << py(v) + 4
              << "\" font-size=\"12\" text-anchor=\"end\">" << fmt_time(v) << "</text>\n";
        }
        s << "<text x=\"" << (L + R) / 2 << "\" y=\"" << B + 42
          << "\" font-size=\"14\" text-anchor=\"middle\">time to first token (prefill of the whole "
             "context)</text>\n";
        s << "<text x=\"20\" y=\"" << (T + B) / 2 << "\" font-size=\"14\" text-anchor=\"middle\" "
          << "transform=\"rotate(-90 20 " << (T + B) / 2 << ")\">time per output token</text>\n";

        // Pareto front (no other fitting config is better on both axes), as a step line.
        std::vector<const PlanEntry*> front;
        for (auto* e : fit) {
            bool dominated = false;
            for (auto* o : fit)
                dominated = dominated ||
                            (o->cost.ttft_s <= e->cost.ttft_s && o->cost.tpot_s <= e->cost.tpot_s &&
                             (o->cost.ttft_s < e->cost.ttft_s || o->cost.tpot_s < e->cost.tpot_s));
            if (!dominated) front.push_back(e);
        }
        std::sort(front.begin(), front.end(),
                  [](auto* a, auto* b) { return a->cost.ttft_s < b->cost.ttft_s; });
        if (front.size() > 1) {
            s << "<polyline fill=\"none\" stroke=\"#2a7\" stroke-width=\"1.5\" "
                 "stroke-dasharray=\"5 3\" points=\"";
            for (size_t i = 0; i < front.size(); ++i) {
                if (i)
                    s << px(front[i]->cost.ttft_s) << "," << py(front[i - 1]->cost.tpot_s) << " ";
                s << px(front[i]->cost.ttft_s) << "," << py(front[i]->cost.tpot_s) << " ";
            }
            s << "\"/>\n";
        }
        // Points: the best last so it is drawn on top. The best few get their rank as a label,
        // placed at the first of four spots around the point that overlaps no label placed before.
        struct Box {
            double x0, y0, x1, y1;
        };
        std::vector<Box> placed;
        std::ostringstream labels;
        const size_t labeled = std::min<size_t>(fit.size(), 8);
        for (size_t i = 0; i < labeled; ++i) {
            const double x = px(fit[i]->cost.ttft_s), y = py(fit[i]->cost.tpot_s);
            const std::string text = "#" + std::to_string(i + 1);
            const double w = 8.0 * text.size(), h = 12;
            const double spots[4][2] = {
                {x + 8, y - 6}, {x + 8, y + 14}, {x - 8 - w, y - 6}, {x - 8 - w, y + 14}};
            for (const auto& sp : spots) {
                const Box b{sp[0], sp[1] - h, sp[0] + w, sp[1]};
                bool clash = false;
                for (const auto& o : placed)
                    clash = clash || !(b.x1 < o.x0 || o.x1 < b.x0 || b.y1 < o.y0 || o.y1 < b.y0);
                if (clash) continue;
                placed.push_back(b);
                labels << "<text x=\"" << sp[0] << "\" y=\"" << sp[1]
                       << "\" font-size=\"12\" font-weight=\"bold\" fill=\""
                       << (i == 0 ? "#b11" : "#124") << "\">" << text << "</text>\n";
                break;
            }
        }
        for (size_t i = fit.size(); i-- > 0;) {
            const PlanEntry& e = *fit[i];
            const double x = px(e.cost.ttft_s), y = py(e.cost.tpot_s);
            const bool on_front =
                front.size() > 1 && std::find(front.begin(), front.end(), &e) != front.end();
            s << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"" << (i == 0 ? 7 : 5)
              << "\" fill=\""
              << (i == 0     ? "#d22"
                  : on_front ? "#2a7"
                             : "#48c")
              << "\" fill-opacity=\"0.85\""
              << " stroke=\"#222\" stroke-width=\"0.6\"><title>#" << i + 1 << " "
              << xml_escape(short_name(e.parallel)) << ": TTFT " << fmt_time(e.cost.ttft_s)
              << ", TPOT " << fmt_time(e.cost.tpot_s) << "</title></circle>\n";
        }
        s << labels.str();
        if (front.size() > 1)
            s << "<text x=\"" << L << "\" y=\"" << H - 14 << "\" font-size=\"11\" fill=\"#2a7\">"
              << "Green, dashed: the Pareto front (no other configuration is faster on both "
                 "axes).</text>\n";
    }

    // Side panel: the ranking and what did not fit.
    double y = T + 4;
    const double sx = R + 24;
    s << "<text x=\"" << sx << "\" y=\"" << y << "\" font-size=\"14\" font-weight=\"bold\">Best by "
      << objective_name(r.objective) << " (TTFT, TPOT, decode)</text>\n";
    y += 20;
    for (size_t i = 0; i < fit.size() && i < 8; ++i) {
        const PlanEntry& e = *fit[i];
        std::snprintf(buf, sizeof buf, "#%zu %s: %s, %s, %.0f tok/s", i + 1,
                      short_name(e.parallel).c_str(), fmt_time(e.cost.ttft_s).c_str(),
                      fmt_time(e.cost.tpot_s).c_str(), e.cost.decode_tokens_per_s);
        s << "<text x=\"" << sx << "\" y=\"" << y << "\" font-size=\"11\">" << xml_escape(buf)
          << "</text>\n";
        y += 16;
    }
    y += 14;
    s << "<text x=\"" << sx << "\" y=\"" << y
      << "\" font-size=\"14\" font-weight=\"bold\" fill=\"#a00\">" << misfit.size()
      << " do not fit</text>\n";
    y += 20;
    for (size_t i = 0; i < misfit.size() && y < H - 20; ++i) {
        const bool last_line = y + 16 >= H - 20 && i + 1 < misfit.size();
        std::string line = last_line
                               ? detail::concat("... and ", misfit.size() - i, " more")
                               : short_name(misfit[i]->parallel) + ": " + short_reason(*misfit[i]);
        s << "<text x=\"" << sx << "\" y=\"" << y << "\" font-size=\"10\" fill=\"#733\">"
          << xml_escape(line) << "</text>\n";
        y += 14;
        if (last_line) break;
    }
    s << "</svg>\n";
    return s.str();
}

}  // namespace kvshard
