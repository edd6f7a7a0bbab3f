#include "kvshard/layout/parallel_config.h"

#include <charconv>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"

namespace kvshard {

std::string_view cp_scheme_name(CpScheme s) {
    switch (s) {
        case CpScheme::kContiguous:
            return "contiguous";
        case CpScheme::kZigzag:
            return "zigzag";
        case CpScheme::kInterleave:
            return "interleave";
    }
    return "?";
}

CpScheme parse_cp_scheme(std::string_view s) {
    if (s == "contiguous") return CpScheme::kContiguous;
    if (s == "zigzag") return CpScheme::kZigzag;
    if (s == "interleave") return CpScheme::kInterleave;
    throw Error(
        detail::concat("unknown CP scheme '", s, "': expected contiguous, zigzag or interleave"));
}

std::string ParallelConfig::to_string() const {
    std::string s = detail::concat("dp=", dp, " pp=", pp, " cp=", cp, " tp=", tp, " ep=", ep);
    if (cp > 1) {
        s += detail::concat(" cp_scheme=", cp_scheme_name(cp_scheme));
        if (cp_scheme == CpScheme::kInterleave)
            s += detail::concat(" cp_interleave=", cp_interleave);
    }
    if (!pp_layers.empty()) {
        s += " pp_layers=";
        for (size_t i = 0; i < pp_layers.size(); ++i)
            s += (i ? "/" : "") + std::to_string(pp_layers[i]);
    }
    return s;
}

static int parse_int(std::string_view key, std::string_view v) {
    int out = 0;
    auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec != std::errc() || ptr != v.data() + v.size())
        throw Error(detail::concat("parallel config: '", key, "' needs an integer, got '", v, "'"));
    return out;
}

void ParallelConfig::validate_sizes() const {
    int64_t world = 1;
    for (auto [v, name] : {std::pair{dp, "dp"}, std::pair{pp, "pp"}, std::pair{cp, "cp"},
                           std::pair{tp, "tp"}, std::pair{ep, "ep"}}) {
        require(v >= 1 && v <= kMaxWorldSize, name, " must be an integer in [1, ", kMaxWorldSize,
                "], got ", v);
        if (std::string_view(name) != "ep") world *= v;  // each factor <= 2^20: no overflow yet
        require(world <= kMaxWorldSize, "dp*pp*cp*tp = ", dp, "*", pp, "*", cp, "*", tp,
                " exceeds ", kMaxWorldSize, " ranks, the most a layout may have");
    }
    require(cp_interleave >= 1 && cp_interleave <= (1 << 30),
            "cp_interleave must be an integer in [1, 2^30], got ", cp_interleave);
}

std::vector<int> divisors(int n) {
    require(n >= 1, "divisors of a non-positive number (", n, ")");
    std::vector<int> low, high;
    for (int64_t i = 1; i * i <= n; ++i)
        if (n % i == 0) {
            low.push_back(static_cast<int>(i));
            if (i * i != n) high.push_back(static_cast<int>(n / i));
        }
    low.insert(low.end(), high.rbegin(), high.rend());
    return low;
}

ParallelConfig parse_parallel_config(std::string_view text) {
    ParallelConfig p;
    std::vector<std::string_view> seen;  // the keys given so far, aliases as their canonical name
    size_t i = 0;
    while (i < text.size()) {
        while (i < text.size() && (text[i] == ',' || text[i] == ' ')) ++i;
        if (i >= text.size()) break;
        size_t j = i;
        while (j < text.size() && text[j] != ',' && text[j] != ' ') ++j;
        std::string_view item = text.substr(i, j - i);
        i = j;
        auto eq = item.find('=');
        if (eq == std::string_view::npos)
            throw Error(detail::concat("parallel config: '", item,
                                       "' is not key=value (e.g. tp=8,pp=2,cp=4,dp=1,ep=1)"));
        auto key = item.substr(0, eq);
        auto val = item.substr(eq + 1);
        // A key given twice ("tp=2,tp=4", or cp and its alias sp) would silently keep the last.
        std::string_view canonical = key;
        if (key == "sp") canonical = "cp";
        if (key == "cp-scheme") canonical = "cp_scheme";
        if (key == "cp-interleave") canonical = "cp_interleave";
        if (key == "pp-layers") canonical = "pp_layers";
        for (std::string_view s : seen)
            if (s == canonical)
                throw Error(detail::concat("parallel config '", text, "' gives ", canonical,
                                           " twice: give each key once, e.g. tp=8,pp=2"));
        seen.push_back(canonical);
        if (key == "tp")
            p.tp = parse_int(key, val);
        else if (key == "pp")
            p.pp = parse_int(key, val);
        else if (key == "cp" || key == "sp")
            p.cp = parse_int(key, val);
        else if (key == "dp")
            p.dp = parse_int(key, val);
        else if (key == "ep")
            p.ep = parse_int(key, val);
        else if (key == "cp_scheme" || key == "cp-scheme")
            p.cp_scheme = parse_cp_scheme(val);
        else if (key == "cp_interleave" || key == "cp-interleave")
            p.cp_interleave = parse_int(key, val);
        else if (key == "pp_layers" || key == "pp-layers") {
            p.pp_layers.clear();
            size_t a = 0;
            while (a <= val.size()) {
                size_t b = val.find_first_of("/:", a);
                if (b == std::string_view::npos) b = val.size();
                p.pp_layers.push_back(parse_int(key, val.substr(a, b - a)));
                a = b + 1;
            }
        } else {
            throw Error(detail::concat(
                "parallel config: unknown key '", key,
                "': expected tp, pp, cp, dp, ep, cp_scheme, cp_interleave or pp_layers"));
        }
    }
    // '' or ',' read as the default layout: transfer-plan --from '' planned tp=1.
    require(!seen.empty(), "parallel config '", text,
            "' names no key: give key=value pairs, e.g. tp=8,pp=2 (tp=1 for one GPU)");
    return p;
}

std::string to_json(const ParallelConfig& p) {
    nlohmann::json j = {{"dp", p.dp},
                        {"pp", p.pp},
                        {"cp", p.cp},
                        {"tp", p.tp},
                        {"ep", p.ep},
                        {"cp_scheme", cp_scheme_name(p.cp_scheme)},
                        {"cp_interleave", p.cp_interleave},
                        {"pp_layers", p.pp_layers},
                        {"world_size", p.world_size()}};
    return j.dump();
}

RankCoord rank_coord(const ParallelConfig& p, int rank) {
    KVSHARD_CHECK(rank >= 0 && rank < p.world_size(), "rank ", rank, " out of world ",
                  p.world_size());
    RankCoord c;
    c.rank = rank;
    int r = rank;
    c.tp = r % p.tp;
    r /= p.tp;
    c.cp = r % p.cp;
    r /= p.cp;
    c.pp = r % p.pp;
    r /= p.pp;
    c.dp = r;
    const int local = (c.dp * p.cp + c.cp) * p.tp + c.tp;
    c.ep = local % p.ep;
    c.ep_group = local / p.ep;
    return c;
}

int rank_of(const ParallelConfig& p, int dp, int pp, int cp, int tp) {
    KVSHARD_CHECK(dp >= 0 && dp < p.dp && pp >= 0 && pp < p.pp && cp >= 0 && cp < p.cp && tp >= 0 &&
                      tp < p.tp,
                  "coordinate out of range");
    return ((dp * p.pp + pp) * p.cp + cp) * p.tp + tp;
}

}  // namespace kvshard
