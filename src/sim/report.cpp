// JSON and SVG renderings of a SimReport.
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "kvshard/sim/simulator.h"

namespace kvshard {

namespace {

nlohmann::json hits_json(const HitRates& h) {
    return {{"token_hit_rate", h.token_hit_rate}, {"block_hit_rate", h.block_hit_rate},
            {"hit_tokens", h.hit_tokens},         {"total_tokens", h.total_tokens},
            {"hit_blocks", h.hit_blocks},         {"total_blocks", h.total_blocks}};
}

std::string xml_escape(const std::string& s) {
    std::string out;
    for (char c : s) {
        switch (c) {
            case '<':
                out += "&lt;";
                break;
            case '>':
                out += "&gt;";
                break;
            case '&':
                out += "&amp;";
                break;
            case '"':
                out += "&quot;";
                break;
            default:
                out += c;
        }
    }
    return out;
}

}  // namespace

std::string to_json(const SimReport& r) {
    nlohmann::json j;
    j["trace"] = r.trace;
    j["requests"] = r.requests;
    j["skipped_lines"] = r.skipped_lines;
    j["trace_duration_s"] = r.trace_duration_s;
    j["replicas"] = r.num_replicas;
    j["block_tokens"] = r.block_tokens;
    j["replica_capacity_blocks"] = r.replica_capacity_blocks;
    j["replica_capacity_tokens"] = r.replica_capacity_blocks * r.block_tokens;
    j["setup"] = r.setup;
    j["infinite_cache_token_hit_rate"] = r.infinite_cache.token_hit_rate;
    j["infinite_cache_block_hit_rate"] = r.infinite_cache.block_hit_rate;
    j["pooled_lru_token_hit_rate"] = r.pooled_lru.token_hit_rate;
    j["pooled_lru_block_hit_rate"] = r.pooled_lru.block_hit_rate;
    j["infinite_cache"] = hits_json(r.infinite_cache);
    j["pooled_lru"] = hits_json(r.pooled_lru);
    auto& ps = j["policies"] = nlohmann::json::array();
    for (const auto& p : r.policies) {
        nlohmann::json reasons = nlohmann::json::object();
        for (size_t k = 0; k < p.reasons.size(); ++k)
            if (p.reasons[k] > 0)
                reasons[std::string(route_reason_name(static_cast<RouteReason>(k)))] = p.reasons[k];
        ps.push_back({
            {"name", p.name},
            {"token_hit_rate", p.hits.token_hit_rate},
            {"block_hit_rate", p.hits.block_hit_rate},
            {"fraction_of_pooled_lru", r.pooled_lru.token_hit_rate > 0
                                           ? p.hits.token_hit_rate / r.pooled_lru.token_hit_rate
                                           : 0.0},
            {"load_max_over_mean", p.load_max_over_mean},
            {"tokens_per_replica", p.tokens_per_replica},
            {"requests_per_replica", p.requests_per_replica},
            {"ttft_mean_s", p.ttft_mean_s},
            {"ttft_p50_s", p.ttft_p50_s},
            {"ttft_p90_s", p.ttft_p90_s},
            {"ttft_p99_s", p.ttft_p99_s},
            {"makespan_s", p.makespan_s},
            {"requests_per_s", p.requests_per_s},
            {"output_tokens_per_s", p.output_tokens_per_s},
            {"completed", p.completed},
            {"rejected", p.rejected},
            {"evicted_blocks", p.evicted_blocks},
            {"decisions", reasons},
        });
    }
    return j.dump(2);
}

std::string render_svg(const SimReport& r) {
    // Two panels side by side: token hit rate per policy (with the two bounds as lines), and
    // max/mean load per policy (with 1.0 and 1.2 marked).
    const int n = static_cast<int>(r.policies.size());
    const int bar_w = 56, gap = 18, left = 60, top = 70, h = 260;
    const int panel_w = std::max(1, n) * (bar_w + gap) + gap;
    const int width = left + panel_w + 90 + left + panel_w + 40;
    const int height = top + h + 90;
    std::string s = fmt::format(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
        "font-family=\"sans-serif\" "
        "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
        width, height);
    s += fmt::format("<text x=\"{}\" y=\"22\" font-size=\"15\">{}</text>\n", left,
                     xml_escape(fmt::format("{} replicas, {} requests ({})", r.num_replicas,
                                            r.requests, r.setup)));
    // Panel 1: hit rate, 0..max(bound)*1.15.
    const double top_rate =
        std::max({r.infinite_cache.token_hit_rate, r.pooled_lru.token_hit_rate, 0.01}) * 1.15;
    auto y_rate = [&](double v) { return top + h - v / top_rate * h; };
    s += fmt::format("<text x=\"{}\" y=\"{}\">prompt-token hit rate</text>\n", left, top - 12);
    s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n", left,
                     top + h, left + panel_w, top + h);
    for (int k = 0; k <= 4; ++k) {
        const double v = top_rate * k / 4;
        s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.0f}%</text>\n",
                         left - 6, y_rate(v) + 4, v * 100);
    }
    for (int i = 0; i < n; ++i) {
        const auto& p = r.policies[static_cast<size_t>(i)];
        const double x = left + gap + i * (bar_w + gap);
        const double y = y_rate(p.hits.token_hit_rate);
        s += fmt::format(
            "<rect x=\"{}\" y=\"{:.1f}\" width=\"{}\" height=\"{:.1f}\" fill=\"#4878a8\"/>\n", x, y,
            bar_w, top + h - y);
        s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"middle\">{:.1f}%</text>\n",
                         x + bar_w / 2.0, y - 4, p.hits.token_hit_rate * 100);
        s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                         x + bar_w / 2.0, top + h + 16, xml_escape(p.name));
    }
    auto bound = [&](double v, const char* color, const std::string& label) {
        s += fmt::format(
            "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"{}\" "
            "stroke-dasharray=\"6,3\"/>\n"
            "<text x=\"{}\" y=\"{:.1f}\" fill=\"{}\">{}</text>\n",
            left, y_rate(v), left + panel_w, y_rate(v), color, left + panel_w + 4, y_rate(v) + 4,
            color, xml_escape(label));
    };
    bound(r.infinite_cache.token_hit_rate, "#b03030",
          fmt::format("infinite {:.1f}%", r.infinite_cache.token_hit_rate * 100));
    bound(r.pooled_lru.token_hit_rate, "#308030",
          fmt::format("pooled LRU {:.1f}%", r.pooled_lru.token_hit_rate * 100));
    // Panel 2: load max/mean, 1.0 .. max.
    const int left2 = left + panel_w + 90 + left;
    double top_load = 1.3;
    for (const auto& p : r.policies) top_load = std::max(top_load, p.load_max_over_mean * 1.1);
    auto y_load = [&](double v) { return top + h - (v - 1.0) / (top_load - 1.0) * h; };
    s += fmt::format(
        "<text x=\"{}\" y=\"{}\">load balance: max / mean tokens served per replica</text>\n",
        left2, top - 12);
    s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n", left2,
                     top + h, left2 + panel_w, top + h);
    for (int k = 0; k <= 4; ++k) {
        const double v = 1.0 + (top_load - 1.0) * k / 4;
        s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.2f}</text>\n",
                         left2 - 6, y_load(v) + 4, v);
    }
    for (int i = 0; i < n; ++i) {
        const auto& p = r.policies[static_cast<size_t>(i)];
        const double x = left2 + gap + i * (bar_w + gap);
        const double y = y_load(p.load_max_over_mean);
        s += fmt::format(
            "<rect x=\"{}\" y=\"{:.1f}\" width=\"{}\" height=\"{:.1f}\" fill=\"#c08040\"/>\n", x, y,
            bar_w, top + h - y);
        s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"middle\">{:.3f}</text>\n",
                         x + bar_w / 2.0, y - 4, p.load_max_over_mean);
        s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                         x + bar_w / 2.0, top + h + 16, xml_escape(p.name));
    }
    s += fmt::format(
        "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#b03030\" "
        "stroke-dasharray=\"6,3\"/>\n"
        "<text x=\"{}\" y=\"{:.1f}\" fill=\"#b03030\">1.2</text>\n",
        left2, y_load(1.2), left2 + panel_w, y_load(1.2), left2 + panel_w + 4, y_load(1.2) + 4);
    // TTFT line under the bars.
    for (int i = 0; i < n; ++i) {
        const auto& p = r.policies[static_cast<size_t>(i)];
        s += fmt::format(
            "<text x=\"{}\" y=\"{}\" font-size=\"10\">{}: TTFT p50 {:.2f} s, p99 {:.2f} s</text>\n",
            left + (i % 3) * 260, top + h + 40 + (i / 3) * 14, xml_escape(p.name), p.ttft_p50_s,
            p.ttft_p99_s);
    }
    s += "</svg>\n";
    return s;
}

}  // namespace kvshard
