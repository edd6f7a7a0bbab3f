#include "kvshard/layout/cp_plan.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>

#include "kvshard/common/error.h"

namespace kvshard {

namespace {

int mod(int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

ParallelConfig cp_only(int cp, CpScheme scheme, int unit) {
    ParallelConfig p;
    p.cp = cp;
    p.cp_scheme = scheme;
    p.cp_interleave = unit;
    return p;
}

int segment_owner(const CpSegment& s, int cp, int64_t pos) {
    if (s.scheme == CpScheme::kInterleave) return mod(pos / s.unit, cp);
    return cp_owner(cp_only(cp, s.scheme, 1), s.end - s.begin, pos - s.begin);
}

// Tokens of KV dtype per query/output element etc. live on the rank; these are per-token-per-layer.
int64_t elem_size(const KvLayout& l) { return static_cast<int64_t>(dtype_size(l.model.kv_dtype)); }

// Query heads and layers of the ranks with cp index 0 (one CP slice of dp group 0).
template <typename F>
void for_each_cp0_rank(const KvLayout& l, F&& f) {
    for (const auto& r : l.ranks)
        if (r.coord.cp == 0 && r.coord.dp == 0) f(r);
}

// Elements per query head and token of one layer of a token-holding group, as the session moves
// them (docs/context-parallel.md §8): an attention layer's query row and partial output are its own
// head_dim (Gemma 4's full layers 512, its sliding ones 256); MLA runs absorbed, a latent query of
// kv_lora_rank + qk_rope_head_dim whose prefill partials travel whole (the owner drops the rope
// part) and whose decode partials are kv_lora_rank.
struct HeadDims {
    int64_t q = 0, prefill_out = 0, decode_out = 0;
};
HeadDims head_dims(const ModelSpec& m, const RankKvGroup& g) {
    if (g.kind == LayerKind::kMla) {
        const int64_t latent = m.mla.kv_lora_rank, q = latent + m.mla.qk_rope_head_dim;
        return {q, q, latent};
    }
    const int64_t d = m.layer(g.layers.front()).head_dim;
    return {d, d, d};
}

// Calls f(group, layers, dims) for each of the rank's groups that attend over the sequence's
// tokens (full, sliding, chunked, MLA). The CP ring and the decode merge run only in those; a
// state layer (Mamba, Gated DeltaNet, short conv) or a layer without KV (LongCat-Flash's MoE
// entry) has no queries to pass and no partials to merge: Falcon-H1's 88 cache layers count 44.
template <typename F>
void for_each_attention_group(const KvLayout& l, const RankKv& r, F&& f) {
    for (const RankKvGroup& g : r.groups)
        if (holds_tokens(g.kind) && !g.layers.empty())
            f(g, static_cast<int64_t>(g.layers.size()), head_dims(l.model, g));
}

// Bytes per new token and query head a rank's layers move in pass-Q (Meta's count: the query in
// the KV dtype, the fp32 partial and LSE), summed over its attention layers.
int64_t pass_q_bytes_per_token_head(const KvLayout& l, const RankKv& r) {
    int64_t n = 0;
    for_each_attention_group(l, r, [&](const RankKvGroup&, int64_t layers, const HeadDims& d) {
        n += layers * (d.q * elem_size(l) + 4 * d.prefill_out + 4);
    });
    return n;
}

}  // namespace

CpTokenMap::CpTokenMap(int cp) : cp_(cp) { require(cp >= 1, "cp must be >= 1, got ", cp); }

void CpTokenMap::append(int64_t n, CpScheme scheme, int unit) {
    require(n >= 0, "cannot append ", n, " tokens");
    require(unit >= 1, "interleave unit must be >= 1, got ", unit);
    require(n <= kMaxContextTokens - size(), "a sequence of ", size(), " + ", n,
            " tokens is longer than 2^40 tokens, the longest kvshard plans for");
    if (n == 0) return;
    const int64_t b = size();
    if (cp_ == 1) scheme = CpScheme::kContiguous;  // one rank: every rule is the same
    if (scheme != CpScheme::kInterleave) unit = 1;
    // Interleave runs of the same unit compose into one (the rule is global).
    if (scheme == CpScheme::kInterleave && !segments_.empty() &&
        segments_.back().scheme == CpScheme::kInterleave && segments_.back().unit == unit) {
        segments_.back().end += n;
        return;
    }
    if (cp_ == 1 && !segments_.empty()) {
        segments_.back().end += n;
        return;
    }
    segments_.push_back({b, b + n, scheme, unit});
}

void CpTokenMap::append_generated(int64_t n, int unit) { append(n, CpScheme::kInterleave, unit); }

int CpTokenMap::owner(int64_t pos) const {
    KVSHARD_CHECK(pos >= 0 && pos < size(), "position ", pos, " outside a sequence of ", size());
    auto it = std::upper_bound(segments_.begin(), segments_.end(), pos,
                               [](int64_t p, const CpSegment& s) { return p < s.end; });
    return segment_owner(*it, cp_, pos);
}

std::vector<TokenRange> CpTokenMap::ranges(int cp_rank, int64_t begin, int64_t end) const {
    KVSHARD_CHECK(cp_rank >= 0 && cp_rank < cp_, "cp rank ", cp_rank, " out of range");
    if (end < 0) end = size();
    std::vector<TokenRange> out;
    auto add = [&](int64_t b, int64_t e) {
        if (b >= e) return;
        if (!out.empty() && out.back().end == b)
            out.back().end = e;
        else
            out.push_back({b, e});
    };
    for (const auto& s : segments_) {
        const int64_t b = std::max(begin, s.begin), e = std::min(end, s.end);
        if (b >= e) continue;
        if (s.scheme == CpScheme::kInterleave) {
            // first unit start u*unit with u % cp == cp_rank at or before b
            int64_t u = b / s.unit;
            u -= mod(u - cp_rank, cp_);
            for (int64_t t = u * s.unit; t < e; t += int64_t{s.unit} * cp_)
                add(std::max(t, b), std::min(e, t + s.unit));
        } else {
            for (const auto& r :
                 cp_token_ranges(cp_only(cp_, s.scheme, 1), cp_rank, s.end - s.begin))
                add(std::max(b, s.begin + r.begin), std::min(e, s.begin + r.end));
        }
    }
    return out;
}

std::vector<int64_t> CpTokenMap::positions(int cp_rank, int64_t begin, int64_t end) const {
    std::vector<int64_t> out;
    for (const TokenRange& r : ranges(cp_rank, begin, end))
        for (int64_t x = r.begin; x < r.end; ++x) out.push_back(x);
    return out;
}

int64_t CpTokenMap::count(int cp_rank, int64_t begin, int64_t end) const {
    int64_t n = 0;
    for (const TokenRange& r : ranges(cp_rank, begin, end)) n += r.size();
    return n;
}

int64_t cp_token_count(const ParallelConfig& p, int cp_rank, int64_t n) {
    return cp_tokens_before(p, cp_rank, n, n);
}

CpTokenMap cp_prompt_map(const ParallelConfig& p, int64_t n) {
    CpTokenMap m(p.cp);
    m.append(n, p.cp_scheme, p.cp_interleave);
    return m;
}

int cp_ring_next(int cp, int cp_rank) { return (cp_rank + 1) % cp; }
int cp_ring_prev(int cp, int cp_rank) { return (cp_rank + cp - 1) % cp; }

std::vector<CpRingStep> cp_ring_schedule(int cp, int cp_rank) {
    KVSHARD_CHECK(cp >= 1 && cp_rank >= 0 && cp_rank < cp, "bad cp rank ", cp_rank, " of ", cp);
    std::vector<CpRingStep> steps;
    for (int s = 0; s < cp; ++s) {
        CpRingStep st;
        st.step = s;
        st.holds = mod(cp_rank - s, cp);
        if (s + 1 < cp) {
            st.sends = st.holds;
            st.receives = mod(cp_rank - s - 1, cp);
        }
        steps.push_back(st);
    }
    return steps;
}

namespace {

// 1 + the last step s at which some rank's new queries see the keys of the rank s behind it
// (keys_behind) or s ahead of it.
int window_ring_steps(const CpTokenMap& map, int64_t new_begin, bool chunked, int window,
                      bool keys_behind) {
    const int cp = map.cp();
    if (window <= 0) return cp;
    std::vector<std::vector<TokenRange>> q(static_cast<size_t>(cp)), k(static_cast<size_t>(cp));
    for (int c = 0; c < cp; ++c) {
        q[size_t(c)] = map.ranges(c, new_begin);
        k[size_t(c)] = map.ranges(c);
    }
    // The last step any rank needs, searched from the end (the first hit is the answer); step 0,
    // each rank's own keys, always runs.
    for (int s = cp - 1; s >= 1; --s)
        for (int c = 0; c < cp; ++c)
            if (cp_shard_sees(q[size_t(c)], k[size_t(mod(keys_behind ? c - s : c + s, cp))],
                              chunked, window))
                return s + 1;
    return 1;
}

}  // namespace

int cp_window_ring_steps(const CpTokenMap& map, int64_t new_begin, bool chunked, int window) {
    return window_ring_steps(map, new_begin, chunked, window, true);
}

int cp_pass_q_window_ring_steps(const CpTokenMap& map, int64_t new_begin, bool chunked,
                                int window) {
    return window_ring_steps(map, new_begin, chunked, window, false);
}

std::pair<int, int> cp_prompt_window_ring_steps(const ParallelConfig& p, int64_t n, bool chunked,
                                                int window) {
    int64_t len = n;
    if (p.cp_scheme == CpScheme::kInterleave && window > 0) {
        int64_t period = int64_t{p.cp_interleave} * p.cp;
        if (chunked) {
            // lcm(period, window) in 128 bits: a longer period than the prompt counts it whole.
            const __int128 l = __int128{period / std::gcd(period, int64_t{window})} * window;
            period = l > n ? n + 1 : static_cast<int64_t>(l);
        }
        // Positions from window - 1 on have whole windows; ownership and (chunked) chunk starts
        // repeat every period, so one period of them after the first window shows every case.
        if (period <= n) len = std::min(n, period + window);
    }
    const CpTokenMap map = cp_prompt_map(p, len);
    return {cp_window_ring_steps(map, 0, chunked, window),
            cp_pass_q_window_ring_steps(map, 0, chunked, window)};
}

namespace {

// Pairs of the queries at positions [0, x): each query q sees q + 1 keys (full), min(q + 1, W)
// (sliding window W) or q % W + 1 (chunks of W). In 128 bits: a planner context may be 2^40
// tokens, whose pairs are about 2^79.
using WidePairs = __int128;
WidePairs pairs_before(int64_t x, bool chunked, int window) {
    const WidePairs X = x;
    if (window <= 0) return X * (X + 1) / 2;
    const WidePairs w = window;
    if (chunked) return (X / w) * (w * (w + 1) / 2) + (X % w) * (X % w + 1) / 2;
    return X <= w ? X * (X + 1) / 2 : w * (w + 1) / 2 + (X - w) * w;
}

// Pairs of each CP rank's queries among the first len positions of a prompt placed by p.
std::vector<WidePairs> rank_pairs(const ParallelConfig& p, int64_t len, bool chunked, int window) {
    std::vector<WidePairs> out(static_cast<size_t>(p.cp), 0);
    if (len <= 0) return out;
    const CpTokenMap map = cp_prompt_map(p, len);
    for (int c = 0; c < p.cp; ++c)
        for (const TokenRange& r : map.ranges(c))
            out[static_cast<size_t>(c)] +=
                pairs_before(r.end, chunked, window) - pairs_before(r.begin, chunked, window);
    return out;
}

CpAttentionPairs balanced_pairs(const ParallelConfig& p, int64_t n, bool chunked, int window) {
    const double total = static_cast<double>(pairs_before(n, chunked, window));
    return {total, total / p.cp};
}

}  // namespace

CpAttentionPairs cp_prompt_attention_pairs(const ParallelConfig& p, int64_t n, bool chunked,
                                           int window) {
    const int64_t period = int64_t{p.cp_interleave} * p.cp;
    // An interleaved prompt of many periods: listing its runs would take n / unit entries.
    if (p.cp_scheme == CpScheme::kInterleave && n / period > 65536) {
        // Full or sliding attention: each rank's queries differ in number by under a unit per
        // period and (past the first window) see equally many keys, so the split is even to
        // about 1 / periods: taken as balanced.
        if (!chunked || window <= 0) return balanced_pairs(p, n, chunked, window);
        // Chunked: a query's keys depend on its place in its chunk, and the owners and chunk
        // starts repeat every lcm(period, window) positions, so each rank's pairs are k times
        // those of one such span plus those of the first n mod span positions.
        const WidePairs wide_span =
            WidePairs{period / std::gcd(period, int64_t{window})} * window;  // lcm, unwrapped
        if (wide_span > n / 2 || wide_span > (int64_t{1} << 24))
            return balanced_pairs(p, n, chunked, window);  // no short period: taken as balanced
        const auto span = static_cast<int64_t>(wide_span);
        const auto whole = rank_pairs(p, span, chunked, window);
        const auto rest = rank_pairs(p, n % span, chunked, window);
        WidePairs total = 0, busiest = 0;
        for (size_t c = 0; c < whole.size(); ++c) {
            const WidePairs pairs = WidePairs{n / span} * whole[c] + rest[c];
            total += pairs;
            busiest = std::max(busiest, pairs);
        }
        return {static_cast<double>(total), static_cast<double>(busiest)};
    }
    WidePairs total = 0, busiest = 0;
    for (const WidePairs pairs : rank_pairs(p, n, chunked, window)) {
        total += pairs;
        busiest = std::max(busiest, pairs);
    }
    return {static_cast<double>(total), static_cast<double>(busiest)};
}

int64_t cp_decode_busiest_keys(const ParallelConfig& p, int64_t prompt, int64_t context,
                               int block_size, int64_t first_visible) {
    require(prompt >= 0 && context >= prompt && first_visible >= 0 && first_visible <= context,
            "cp_decode_busiest_keys: need 0 <= prompt <= context and first_visible in [0, "
            "context], got prompt ",
            prompt, ", context ", context, ", first_visible ", first_visible);
    require(block_size >= 1, "block_size must be >= 1, got ", block_size);
    CpTokenMap map = cp_prompt_map(p, prompt);
    map.append_generated(context - prompt,
                         p.cp_scheme == CpScheme::kInterleave ? p.cp_interleave : block_size);
    int64_t busiest = 0;
    for (int c = 0; c < p.cp; ++c)
        busiest = std::max(busiest, map.count(c, first_visible, context));
    return busiest;
}

namespace {

// Ascending positions as maximal runs.
std::vector<TokenRange> runs_of(std::span<const int64_t> pos) {
    std::vector<TokenRange> out;
    for (int64_t p : pos) {
        if (!out.empty() && out.back().end == p)
            ++out.back().end;
        else
            out.push_back({p, p + 1});
    }
    return out;
}

}  // namespace

bool cp_shard_sees(std::span<const int64_t> q_pos, std::span<const int64_t> kv_pos, bool chunked,
                   int window) {
    return cp_shard_sees(runs_of(q_pos), runs_of(kv_pos), chunked, window);
}

bool cp_shard_sees(std::span<const TokenRange> q, std::span<const TokenRange> kv, bool chunked,
                   int window) {
    // For queries [a, b] the best keys are in the last run that starts at or before b: every
    // earlier run ends before that one begins. Some key k <= b of it is seen iff its largest such
    // key, min(end - 1, b), is at or after the first key a's window keeps.
    for (const TokenRange& r : q) {
        if (r.size() <= 0) continue;
        const int64_t a = r.begin, b = r.end - 1;
        auto it = std::upper_bound(kv.begin(), kv.end(), b,
                                   [](int64_t x, const TokenRange& k) { return x < k.begin; });
        if (it == kv.begin()) continue;
        --it;
        const int64_t last =
            std::min(it->end - 1, b);  // >= it->begin: the run starts at or before b
        const int64_t first = window <= 0 ? 0
                              : chunked   ? a - a % window
                                          : std::max<int64_t>(0, a - window + 1);
        if (last >= first) return true;
    }
    return false;
}

CpPrefillBytes cp_pass_kv_bytes(const KvLayout& layout, int rank, const CpTokenMap& map) {
    const RankKv& r = layout.ranks.at(rank);
    const int cp = layout.parallel.cp;
    KVSHARD_CHECK(map.cp() == cp, "token map for cp=", map.cp(), " used with cp=", cp);
    CpPrefillBytes b;
    if (cp == 1) return b;
    const int64_t tokens = map.size() - map.count(cp_ring_next(cp, r.coord.cp));
    b.ring = tokens * r.kv_bytes_per_token;
    // A windowed group's ring stops after the steps its window needs (cp_window_ring_steps): it
    // sends the shards of steps [0, steps - 1) only.
    for (const RankKvGroup& g : r.groups) {
        if (g.window <= 0 || g.bytes_per_token == 0) continue;
        const int steps =
            cp_window_ring_steps(map, 0, g.kind == LayerKind::kChunkedLocal, g.window);
        int64_t sent = 0;
        for (int s = 0; s + 1 < steps; ++s) sent += map.count(mod(r.coord.cp - s, cp));
        b.ring -= (tokens - sent) * g.bytes_per_token;
    }
    return b;
}

CpPrefillBytes cp_pass_q_bytes(const KvLayout& layout, int rank, const CpTokenMap& map,
                               int64_t new_begin) {
    const RankKv& r = layout.ranks.at(rank);
    const int cp = layout.parallel.cp;
    KVSHARD_CHECK(map.cp() == cp, "token map for cp=", map.cp(), " used with cp=", cp);
    CpPrefillBytes b;
    if (cp == 1) return b;
    const int64_t hq = r.q_head_end - r.q_head_begin;
    const int64_t fresh = map.size() - new_begin;
    // The all-to-all returns owner o's partials (fp32 output and LSE per query head and token)
    // only where some new query of o's sees a key of this rank's: causally, and for a windowed
    // group inside its window (cp_shard_sees); a partial without one would be empty. A windowed
    // group's ring stops after the steps its window needs.
    const std::vector<TokenRange> keys = map.ranges(r.coord.cp);
    auto returned_tokens = [&](bool chunked, int window) {
        int64_t t = 0;
        for (int o = 0; o < cp; ++o)
            if (o != r.coord.cp && cp_shard_sees(map.ranges(o, new_begin), keys, chunked, window))
                t += map.count(o, new_begin);
        return t;
    };
    const int64_t q_tokens = fresh - map.count(cp_ring_next(cp, r.coord.cp), new_begin);
    const int64_t returned = returned_tokens(false, 0);
    for_each_attention_group(
        layout, r, [&](const RankKvGroup& g, int64_t layers, const HeadDims& d) {
            int64_t sent = q_tokens, back = returned;
            if (g.window > 0) {
                const bool chunked = g.kind == LayerKind::kChunkedLocal;
                const int steps = cp_pass_q_window_ring_steps(map, new_begin, chunked, g.window);
                sent = 0;
                for (int s = 0; s + 1 < steps; ++s)
                    sent += map.count(mod(r.coord.cp - s, cp), new_begin);
                back = returned_tokens(chunked, g.window);
            }
            b.ring += sent * layers * hq * d.q * elem_size(layout);
            b.all_to_all += back * layers * hq * (d.prefill_out + 1) * 4;
        });
    return b;
}

std::string_view cp_prefill_mode_name(CpPrefillMode m) {
    return m == CpPrefillMode::kPassKv ? "pass-kv" : "pass-q";
}

CpPrefillMode parse_cp_prefill_mode(std::string_view s) {
    if (s == "pass-kv" || s == "kv") return CpPrefillMode::kPassKv;
    if (s == "pass-q" || s == "q") return CpPrefillMode::kPassQ;
    throw Error(
        detail::concat("unknown CP prefill mode '", s, "': valid modes are pass-kv, pass-q"));
}

double cp_pass_q_threshold(const KvLayout& layout) {
    // Per token, over one CP slice: pass-KV moves kv_bytes_per_token (2 * L * Hkv_r * D * e);
    // pass-Q moves L * Hq_r * (D * e + 4 * D + 4). Both are multiplied by (cp - 1) over the ring.
    double kv = 0, q = 0;
    for_each_cp0_rank(layout, [&](const RankKv& r) {
        kv += static_cast<double>(r.kv_bytes_per_token);
        q += static_cast<double>(pass_q_bytes_per_token_head(layout, r)) *
             static_cast<double>(r.q_head_end - r.q_head_begin);
    });
    return q > 0 ? kv / q : 0.0;
}

CpPrefillChoice choose_cp_prefill(const KvLayout& layout, int64_t cached, int64_t fresh) {
    require(cached >= 0 && fresh >= 1, "a prefill needs at least one new token (cached=", cached,
            ", new=", fresh, ")");
    CpPrefillChoice c;
    c.new_fraction = static_cast<double>(fresh) / static_cast<double>(cached + fresh);
    c.threshold = cp_pass_q_threshold(layout);
    const int64_t cp1 = layout.parallel.cp - 1;
    int64_t kv_per_token = 0, q_per_token = 0;
    for_each_cp0_rank(layout, [&](const RankKv& r) {
        kv_per_token += r.kv_bytes_per_token;
        q_per_token += pass_q_bytes_per_token_head(layout, r) * (r.q_head_end - r.q_head_begin);
    });
    // Exact totals: summing N - n_{c+1} over the CP ranks gives (cp - 1) N.
    const int64_t dp = layout.parallel.dp;
    c.pass_kv_bytes = dp * cp1 * (cached + fresh) * kv_per_token;
    c.pass_q_bytes = dp * cp1 * fresh * q_per_token;
    c.mode = (cp1 > 0 && c.pass_q_bytes < c.pass_kv_bytes) ? CpPrefillMode::kPassQ
                                                           : CpPrefillMode::kPassKv;
    return c;
}

CpPrefillChoice choose_cp_prefill(const KvLayout& layout, const CpTokenMap& map, int64_t cached) {
    require(cached >= 0 && cached < map.size(),
            "a prefill needs at least one new token (cached=", cached, " of ", map.size(),
            " placed)");
    CpPrefillChoice c;
    c.new_fraction = static_cast<double>(map.size() - cached) / static_cast<double>(map.size());
    c.threshold = cp_pass_q_threshold(layout);
    for (int r = 0; r < layout.world_size(); ++r) {
        c.pass_kv_bytes += cp_pass_kv_bytes(layout, r, map).total();
        c.pass_q_bytes += cp_pass_q_bytes(layout, r, map, cached).total();
    }
    c.mode = (layout.parallel.cp > 1 && c.pass_q_bytes < c.pass_kv_bytes) ? CpPrefillMode::kPassQ
                                                                          : CpPrefillMode::kPassKv;
    return c;
}

std::string_view cp_decode_merge_name(CpDecodeMerge m) {
    return m == CpDecodeMerge::kAllGather ? "all-gather" : "all-to-all";
}

CpDecodeMerge parse_cp_decode_merge(std::string_view s) {
    if (s == "all-gather" || s == "allgather") return CpDecodeMerge::kAllGather;
    if (s == "all-to-all" || s == "alltoall" || s == "helix") return CpDecodeMerge::kAllToAll;
    throw Error(detail::concat("unknown CP decode merge '", s,
                               "': valid merges are all-gather, all-to-all (helix)"));
}

TokenRange cp_helix_heads(int num_heads, int cp, int cp_rank) {
    return {int64_t{cp_rank} * num_heads / cp, int64_t{cp_rank + 1} * num_heads / cp};
}

int64_t cp_decode_merge_bytes(const KvLayout& layout, int rank, CpDecodeMerge merge) {
    const RankKv& r = layout.ranks.at(rank);
    const int cp = layout.parallel.cp;
    if (cp == 1) return 0;
    const int64_t hq = r.q_head_end - r.q_head_begin;
    // all-to-all: to every other rank, the partial rows of that rank's heads; then all-gather
    // of the merged O of this rank's heads (no LSE needed any more).
    const TokenRange mine = cp_helix_heads(static_cast<int>(hq), cp, r.coord.cp);
    int64_t bytes = 0;
    for_each_attention_group(layout, r, [&](const RankKvGroup&, int64_t layers, const HeadDims& d) {
        const int64_t row = (d.decode_out + 1) * 4;  // fp32 O and LSE per head
        bytes +=
            merge == CpDecodeMerge::kAllGather
                ? layers * (cp - 1) * hq * row
                : layers * ((hq - mine.size()) * row + (cp - 1) * mine.size() * d.decode_out * 4);
    });
    return bytes;
}

std::vector<int64_t> cp_causal_pairs(const CpTokenMap& map, int64_t q_begin) {
    // Over runs, not positions (a map may hold 2^40 tokens): the queries [b, e) see
    // sum (p + 1) = (b + 1 + e) (e - b) / 2 keys, summed in 128 bits.
    std::vector<int64_t> pairs(map.cp(), 0);
    for (int c = 0; c < map.cp(); ++c) {
        __int128 sum = 0;
        for (const TokenRange& r : map.ranges(c, q_begin))
            sum += (static_cast<__int128>(r.begin) + 1 + r.end) * r.size() / 2;
        require(sum <= std::numeric_limits<int64_t>::max(),
                "the causal (query, key) pairs of CP rank ", c, " over a sequence of ", map.size(),
                " tokens exceed 2^63 - 1, the most kvshard counts: give at most about 2^32 tokens");
        pairs[static_cast<size_t>(c)] = static_cast<int64_t>(sum);
    }
    return pairs;
}

int64_t cp_local_blocks(int64_t global_blocks, int cp, int cp_rank) {
    if (global_blocks <= cp_rank) return 0;
    return (global_blocks - cp_rank + cp - 1) / cp;
}

CpPrefixReusePlan plan_cp_prefix_reuse(int src_cp, int dst_cp, int64_t blocks) {
    require(src_cp >= 1 && dst_cp >= 1, "cp sizes must be >= 1 (got ", src_cp, " and ", dst_cp,
            ")");
    require(blocks >= 0, "block count must be >= 0, got ", blocks);
    std::vector<std::vector<int>> holders;
    for (int64_t b = 0; b < blocks; ++b) holders.push_back({static_cast<int>(b % src_cp)});
    std::vector<int> dst_device;
    for (int c = 0; c < dst_cp; ++c) dst_device.push_back(c);
    CpPrefixReusePlan plan = plan_cp_prefix_moves(holders, dst_device);
    plan.src_cp = src_cp;
    return plan;
}

CpPrefixReusePlan plan_cp_prefix_moves(const std::vector<std::vector<int>>& holders,
                                       const std::vector<int>& dst_device) {
    KVSHARD_CHECK(!dst_device.empty(), "a prefix served by no CP rank");
    CpPrefixReusePlan plan;
    plan.src_cp = 0;  // not one CP size: wherever the blocks are
    plan.dst_cp = static_cast<int>(dst_device.size());
    plan.blocks = static_cast<int64_t>(holders.size());
    for (int64_t b = 0; b < plan.blocks; ++b) {
        const std::vector<int>& h = holders[static_cast<size_t>(b)];
        KVSHARD_CHECK(!h.empty(), "block ", b, " of the prefix has no holder");
        const int dst = dst_device[static_cast<size_t>(b % plan.dst_cp)];
        if (std::find(h.begin(), h.end(), dst) != h.end())
            ++plan.kept;
        else
            plan.moves.push_back({b, h.front(), dst});
    }
    return plan;
}

std::string to_json(const CpPrefixReusePlan& plan) {
    nlohmann::json moves = nlohmann::json::array();
    for (const auto& m : plan.moves)
        moves.push_back({{"block", m.block}, {"src", m.src}, {"dst", m.dst}});
    nlohmann::json j = {{"src_cp", plan.src_cp},      {"dst_cp", plan.dst_cp},
                        {"blocks", plan.blocks},      {"kept", plan.kept},
                        {"moved", plan.moves.size()}, {"moves", moves}};
    return j.dump(2);
}

std::string cp_plan_report_json(const ModelSpec& m, const ParallelConfig& p, int64_t cached,
                                int64_t fresh, int block_size, int reuse_from) {
    validate(m, p);
    require(cached >= 0, "the cached prefix must be >= 0 tokens, got ", cached);
    require(fresh >= 1, "the new tokens must be >= 1 (a prefill computes at least one token), got ",
            fresh);
    require(block_size >= 1, "the block size must be >= 1, got ", block_size);
    require(block_size <= (1 << 20), "the block size must be at most 2^20 tokens, got ",
            block_size);
    require(reuse_from >= 0 && reuse_from <= ParallelConfig::kMaxWorldSize,
            "the CP size to reuse from must be in [1, ", ParallelConfig::kMaxWorldSize,
            "] (or 0: none), got ", reuse_from);
    // The reuse plan lists every cached block's move.
    require(reuse_from == 0 || cached / block_size <= kMaxCpReuseBlocks, "reusing ", cached,
            " cached tokens in blocks of ", block_size, " lists ", cached / block_size,
            " block moves, more than the ", kMaxCpReuseBlocks,
            " kvshard lists: use larger blocks or a shorter cached prefix");
    const KvLayout l = make_layout(m, p);
    CpTokenMap map(p.cp);
    map.append(cached, p.cp_scheme, p.cp_interleave);
    map.append(fresh, p.cp_scheme, p.cp_interleave);
    const CpPrefillChoice choice = choose_cp_prefill(l, map, cached);
    const CpPrefillChoice rule = choose_cp_prefill(l, cached, fresh);
    const auto pairs = cp_causal_pairs(map, cached);
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& r : l.ranks) {
        if (r.coord.dp != 0) continue;
        const int c = r.coord.cp;
        const auto kv = cp_pass_kv_bytes(l, r.coord.rank, map);
        const auto q = cp_pass_q_bytes(l, r.coord.rank, map, cached);
        ranks.push_back({{"rank", r.coord.rank},
                         {"cp", c},
                         {"tp", r.coord.tp},
                         {"pp", r.coord.pp},
                         {"tokens", map.count(c)},
                         {"new_tokens", map.count(c, cached)},
                         {"causal_pairs", pairs[static_cast<size_t>(c)]},
                         {"pass_kv_bytes", kv.total()},
                         {"pass_q_ring_bytes", q.ring},
                         {"pass_q_all_to_all_bytes", q.all_to_all},
                         {"decode_all_gather_bytes",
                          cp_decode_merge_bytes(l, r.coord.rank, CpDecodeMerge::kAllGather)},
                         {"decode_all_to_all_bytes",
                          cp_decode_merge_bytes(l, r.coord.rank, CpDecodeMerge::kAllToAll)}});
    }
    nlohmann::json reuse = nullptr;
    if (reuse_from > 0)
        reuse = nlohmann::json::parse(
            to_json(plan_cp_prefix_reuse(reuse_from, p.cp, cached / block_size)));
    nlohmann::json j = {{"model", m.name},
                        {"parallel", nlohmann::json::parse(to_json(p))},
                        {"cached", cached},
                        {"new", fresh},
                        {"choice",
                         {{"mode", cp_prefill_mode_name(choice.mode)},
                          {"new_fraction", choice.new_fraction},
                          {"threshold", choice.threshold},
                          {"pass_kv_bytes", choice.pass_kv_bytes},
                          {"pass_q_bytes", choice.pass_q_bytes},
                          {"rule_mode", cp_prefill_mode_name(rule.mode)},
                          {"rule_pass_q_bytes", rule.pass_q_bytes}}},
                        {"ranks", ranks},
                        {"reuse", reuse}};
    return j.dump(2);
}

}  // namespace kvshard
