#include "kvshard/layout/kv_layout.h"

#include <algorithm>
#include <numeric>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

std::string join(const std::vector<int>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s;
}

std::vector<int> divisors(int n) {
    std::vector<int> d;
    for (int i = 1; i <= n; ++i)
        if (n % i == 0) d.push_back(i);
    return d;
}

}  // namespace

std::vector<int> valid_tp_sizes(const ModelSpec& m) {
    std::vector<int> out;
    for (int t : divisors(m.num_heads)) {
        if (m.is_mla() || m.num_kv_heads % t == 0 || t % m.num_kv_heads == 0) out.push_back(t);
    }
    return out;
}

void validate(const ModelSpec& m, const ParallelConfig& p) {
    m.validate();
    auto positive = [](int v, const char* what) {
        require(v >= 1, what, " must be a positive integer, got ", v);
    };
    positive(p.dp, "dp");
    positive(p.pp, "pp");
    positive(p.cp, "cp");
    positive(p.tp, "tp");
    positive(p.ep, "ep");
    positive(p.cp_interleave, "cp_interleave");

    const auto valid_tp = valid_tp_sizes(m);
    if (m.num_heads % p.tp != 0)
        throw Error(detail::concat("tp=", p.tp, " does not divide the ", m.num_heads,
                                   " query heads of ", m.name, ": valid tp sizes are ",
                                   join(valid_tp)));
    if (!m.is_mla() && m.num_kv_heads % p.tp != 0 && p.tp % m.num_kv_heads != 0)
        throw Error(detail::concat("tp=", p.tp, " and the ", m.num_kv_heads, " KV heads of ",
                                   m.name,
                                   " do not divide one another, so heads can be neither split nor "
                                   "replicated evenly: valid tp sizes are ",
                                   join(valid_tp)));

    if (p.pp > m.num_layers)
        throw Error(detail::concat("pp=", p.pp, " is larger than the ", m.num_layers, " layers of ",
                                   m.name, ": pp must be at most ", m.num_layers));
    if (!p.pp_layers.empty()) {
        if (static_cast<int>(p.pp_layers.size()) != p.pp)
            throw Error(detail::concat("pp_layers lists ", p.pp_layers.size(), " stages but pp=",
                                       p.pp, ": give one layer count per stage"));
        for (int n : p.pp_layers)
            require(n >= 1, "pp_layers: every stage needs at least one layer, got ", n);
        const int sum = std::accumulate(p.pp_layers.begin(), p.pp_layers.end(), 0);
        if (sum != m.num_layers)
            throw Error(detail::concat("pp_layers sums to ", sum, " but ", m.name, " has ",
                                       m.num_layers, " layers: the counts must add up to ",
                                       m.num_layers));
    }

    if (p.ep > 1) {
        if (!m.moe.enabled())
            throw Error(
                detail::concat("ep=", p.ep, " on ", m.name,
                               ", a dense model with no experts: use ep=1 (or a MoE model)"));
        if (m.moe.num_experts % p.ep != 0)
            throw Error(detail::concat("ep=", p.ep, " does not divide the ", m.moe.num_experts,
                                       " experts of ", m.name, ": valid ep sizes are divisors of ",
                                       m.moe.num_experts,
                                       " that divide dp*cp*tp=", p.stage_size()));
        if (p.stage_size() % p.ep != 0)
            throw Error(
                detail::concat("ep=", p.ep, " does not divide the dp*cp*tp=", p.stage_size(),
                               " ranks of a pipeline stage: EP spreads experts over those ranks, "
                               "so ep must divide dp*cp*tp"));
    }
}

void validate_world(const ParallelConfig& p, int gpus) {
    require(gpus >= 1, "the GPU count must be a positive integer, got ", gpus);
    if (p.world_size() != gpus)
        throw Error(detail::concat("dp*pp*cp*tp = ", p.dp, "*", p.pp, "*", p.cp, "*", p.tp, " = ",
                                   p.world_size(), " ranks, but ", gpus,
                                   " GPUs were given: the product must equal the GPU count"));
}

std::vector<int> pp_layer_split(const ModelSpec& m, const ParallelConfig& p) {
    validate(m, p);
    if (!p.pp_layers.empty()) return p.pp_layers;
    std::vector<int> split(p.pp, m.num_layers / p.pp);
    for (int s = 0; s < m.num_layers % p.pp; ++s) ++split[s];
    return split;
}

int KvLayout::kv_heads_per_rank() const {
    if (model.is_mla()) return 1;
    return std::max(1, model.num_kv_heads / parallel.tp);
}

int KvLayout::head_replication() const {
    if (model.is_mla()) return parallel.tp;
    return std::max(1, parallel.tp / model.num_kv_heads);
}

KvLayout make_layout(const ModelSpec& m, const ParallelConfig& p) {
    validate(m, p);
    KvLayout l;
    l.model = m;
    l.parallel = p;
    const auto split = pp_layer_split(m, p);
    std::vector<int> stage_begin(p.pp + 1, 0);
    for (int s = 0; s < p.pp; ++s) stage_begin[s + 1] = stage_begin[s] + split[s];

    const int heads_per_rank = l.kv_heads_per_rank();
    const int replication = l.head_replication();
    const int q_per_rank = m.num_heads / p.tp;
    const int64_t e = static_cast<int64_t>(dtype_size(m.kv_dtype));
    const int experts_per_rank = m.moe.enabled() ? m.moe.num_experts / p.ep : 0;

    l.ranks.resize(p.world_size());
    for (int r = 0; r < p.world_size(); ++r) {
        RankKv& rk = l.ranks[r];
        rk.coord = rank_coord(p, r);
        const auto& c = rk.coord;
        if (m.is_mla()) {
            rk.kv_heads = {0};
        } else {
            const int first = (c.tp / replication) * heads_per_rank;
            for (int h = 0; h < heads_per_rank; ++h) rk.kv_heads.push_back(first + h);
        }
        rk.q_head_begin = c.tp * q_per_rank;
        rk.q_head_end = rk.q_head_begin + q_per_rank;
        if (replication > 1) {
            const int group_first_tp = (c.tp / replication) * replication;
            for (int t = group_first_tp; t < group_first_tp + replication; ++t)
                if (t != c.tp) rk.head_replica_ranks.push_back(rank_of(p, c.dp, c.pp, c.cp, t));
        }
        rk.layer_begin = stage_begin[c.pp];
        rk.layer_end = stage_begin[c.pp + 1];
        if (m.moe.enabled()) {
            rk.expert_begin = c.ep * experts_per_rank;
            rk.expert_end = rk.expert_begin + experts_per_rank;
        }
        rk.kv_bytes_per_token = int64_t{rk.num_layers()} * e *
                                (m.is_mla() ? int64_t{m.mla.kv_lora_rank} + m.mla.qk_rope_head_dim
                                            : 2 * int64_t{heads_per_rank} * m.head_dim);
    }
    return l;
}

// ---- CP token ownership ----------------------------------------------------------------------

namespace {
// Boundary b of n equal parts of [0, len): floor(b * len / n).
int64_t part_boundary(int64_t len, int n, int b) { return b * len / n; }
}  // namespace

int cp_owner(const ParallelConfig& p, int64_t seq_len, int64_t pos) {
    KVSHARD_CHECK(pos >= 0 && pos < seq_len, "position ", pos, " outside sequence of ", seq_len);
    const int cp = p.cp;
    switch (p.cp_scheme) {
        case CpScheme::kContiguous: {
            for (int r = 0; r < cp; ++r)
                if (pos < part_boundary(seq_len, cp, r + 1)) return r;
            return cp - 1;
        }
        case CpScheme::kZigzag: {
            const int chunks = 2 * cp;
            int chunk = chunks - 1;
            for (int c = 0; c < chunks; ++c)
                if (pos < part_boundary(seq_len, chunks, c + 1)) {
                    chunk = c;
                    break;
                }
            return chunk < cp ? chunk : chunks - 1 - chunk;
        }
        case CpScheme::kInterleave:
            return static_cast<int>((pos / p.cp_interleave) % cp);
    }
    return 0;
}

std::vector<TokenRange> cp_token_ranges(const ParallelConfig& p, int cp_rank, int64_t seq_len) {
    KVSHARD_CHECK(cp_rank >= 0 && cp_rank < p.cp, "cp rank out of range");
    std::vector<TokenRange> out;
    auto add = [&](int64_t b, int64_t e) {
        if (e <= b) return;
        if (!out.empty() && out.back().end == b)
            out.back().end = e;
        else
            out.push_back({b, e});
    };
    switch (p.cp_scheme) {
        case CpScheme::kContiguous:
            add(part_boundary(seq_len, p.cp, cp_rank), part_boundary(seq_len, p.cp, cp_rank + 1));
            break;
        case CpScheme::kZigzag: {
            const int chunks = 2 * p.cp;
            const int second = chunks - 1 - cp_rank;
            add(part_boundary(seq_len, chunks, cp_rank),
                part_boundary(seq_len, chunks, cp_rank + 1));
            add(part_boundary(seq_len, chunks, second), part_boundary(seq_len, chunks, second + 1));
            break;
        }
        case CpScheme::kInterleave: {
            const int64_t unit = p.cp_interleave;
            for (int64_t b = int64_t{cp_rank} * unit; b < seq_len; b += unit * p.cp)
                add(b, std::min(seq_len, b + unit));
            break;
        }
    }
    return out;
}

std::string cp_token_rule(const ParallelConfig& p, int cp_rank) {
    if (p.cp == 1) return "all tokens";
    switch (p.cp_scheme) {
        case CpScheme::kContiguous:
            return detail::concat("segment ", cp_rank, " of ", p.cp);
        case CpScheme::kZigzag:
            return detail::concat("chunks ", cp_rank, "+", 2 * p.cp - 1 - cp_rank, " of ",
                                  2 * p.cp);
        case CpScheme::kInterleave:
            if (p.cp_interleave == 1) return detail::concat("t%", p.cp, "==", cp_rank);
            return detail::concat("(t/", p.cp_interleave, ")%", p.cp, "==", cp_rank);
    }
    return "?";
}

std::string to_json(const KvLayout& l) {
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& r : l.ranks) {
        ranks.push_back({{"rank", r.coord.rank},
                         {"dp", r.coord.dp},
                         {"pp", r.coord.pp},
                         {"cp", r.coord.cp},
                         {"tp", r.coord.tp},
                         {"ep", r.coord.ep},
                         {"kv_heads", r.kv_heads},
                         {"q_heads", {r.q_head_begin, r.q_head_end}},
                         {"head_replica_ranks", r.head_replica_ranks},
                         {"layers", {r.layer_begin, r.layer_end}},
                         {"experts", {r.expert_begin, r.expert_end}},
                         {"cp_tokens", cp_token_rule(l.parallel, r.coord.cp)},
                         {"kv_bytes_per_token", r.kv_bytes_per_token}});
    }
    nlohmann::json j = {{"model", l.model.name},
                        {"parallel", nlohmann::json::parse(to_json(l.parallel))},
                        {"world_size", l.world_size()},
                        {"kv_heads_per_rank", l.kv_heads_per_rank()},
                        {"head_replication", l.head_replication()},
                        {"ranks", ranks}};
    return j.dump(2);
}

}  // namespace kvshard
