#include "kvshard/layout/kv_layout.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <numeric>

#include <nlohmann/json.hpp>

#include "kvshard/common/checked.h"
#include "kvshard/common/error.h"

namespace kvshard {
namespace {

std::string join(const std::vector<int>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s;
}

bool has_layer_kind(const ModelSpec& m, LayerKind k) {
    for (int l = 0; l < m.num_layers; ++l)
        if (m.layer(l).kind == k) return true;
    return false;
}

// vLLM's MambaMixer2 (vllm/model_executor/layers/mamba/mamba_mixer2.py) asserts that tp divides
// the SSM heads and the groups, or that there is a single group (which every rank then holds):
// groups are never split unevenly or replicated beyond that one.
bool mamba2_tp_fits(const StateSpec& s, int tp) {
    return s.heads % tp == 0 && (s.groups % tp == 0 || s.groups == 1);
}

}  // namespace

std::vector<KvGroup> kv_groups(const ModelSpec& m) {
    std::vector<KvGroup> groups;
    for (int l = 0; l < m.num_layers; ++l) {
        const LayerSpec s = m.layer(l);
        if (!holds_tokens(s.kind) && !holds_state(s.kind)) continue;
        KvGroup key;
        key.kind = s.kind;
        key.window = s.window;
        key.num_kv_heads = holds_tokens(s.kind) && s.kind != LayerKind::kMla ? s.num_kv_heads : 0;
        key.head_dim = holds_tokens(s.kind) && s.kind != LayerKind::kMla ? s.head_dim : 0;
        key.indexer = s.indexer;
        auto it = std::find_if(groups.begin(), groups.end(), [&](const KvGroup& g) {
            return g.kind == key.kind && g.window == key.window &&
                   g.num_kv_heads == key.num_kv_heads && g.head_dim == key.head_dim &&
                   g.indexer == key.indexer;
        });
        if (it == groups.end()) {
            key.layers = {l};
            groups.push_back(key);
        } else {
            it->layers.push_back(l);
        }
    }
    return groups;
}

namespace {
// The family's vLLM MoE block refuses tp above the routed experts (MoeSpec::tp_at_most_experts),
// and the model builds one: a config whose every layer is dense (Qwen's mlp_only_layers) has none.
bool tp_capped_by_experts(const ModelSpec& m) {
    return m.moe.enabled() && m.moe.tp_at_most_experts && m.num_moe_layers() > 0;
}
}  // namespace

std::vector<int> valid_tp_sizes(const ModelSpec& m) {
    const auto groups = kv_groups(m);
    bool has_state = false;
    for (const auto& g : groups) has_state = has_state || holds_state(g.kind);
    auto fits = [](int n, int t) { return n % t == 0 || t % n == 0; };
    std::vector<int> out;
    for (int t : divisors(m.num_heads)) {
        bool ok = m.is_mla() || fits(m.num_kv_heads, t);
        for (const auto& g : groups)
            if (g.num_kv_heads > 0) ok = ok && fits(g.num_kv_heads, t);
        if (has_state) ok = ok && fits(m.state.heads, t) && fits(m.state.groups, t);
        if (has_layer_kind(m, LayerKind::kMamba2)) ok = ok && mamba2_tp_fits(m.state, t);
        if (has_layer_kind(m, LayerKind::kShortConv) || has_layer_kind(m, LayerKind::kMamba1))
            ok = ok && m.state.heads % t == 0;
        if (tp_capped_by_experts(m)) ok = ok && t <= m.moe.num_experts;
        if (ok) out.push_back(t);
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
    p.validate_sizes();

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

    if (tp_capped_by_experts(m) && p.tp > m.moe.num_experts)
        throw Error(detail::concat(
            "tp=", p.tp, " is greater than the ", m.moe.num_experts, " experts of ", m.name,
            ": vLLM's MoE block of this family raises 'Tensor parallel size is greater than the "
            "number of experts' (Lfm2MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, "
            "Qwen3MoeSparseMoeBlock, Qwen3NextSparseMoeBlock, HunYuanSparseMoeBlock, "
            "Ernie4_5_MoeMoE), with or without expert parallelism: valid tp sizes are ",
            join(valid_tp)));

    for (const KvGroup& g : kv_groups(m)) {
        if (g.kind == LayerKind::kMla || !holds_tokens(g.kind)) continue;
        if (g.num_kv_heads % p.tp != 0 && p.tp % g.num_kv_heads != 0)
            throw Error(
                detail::concat("tp=", p.tp, " and the ", g.num_kv_heads, " KV heads of layer ",
                               g.layers.front(), " (", layer_kind_name(g.kind), ") of ", m.name,
                               " do not divide one another: valid tp sizes are ", join(valid_tp)));
    }
    bool has_state = false;
    for (int l = 0; l < m.num_layers; ++l) has_state = has_state || holds_state(m.layer(l).kind);
    if (has_state) {
        for (auto [n, what] : {std::pair{m.state.heads, "state heads"},
                               std::pair{m.state.groups, "state key heads / groups"}})
            if (n % p.tp != 0 && p.tp % n != 0)
                throw Error(detail::concat("tp=", p.tp, " and the ", n, " ", what, " of ", m.name,
                                           " do not divide one another: valid tp sizes are ",
                                           join(valid_tp)));
    }
    if (has_layer_kind(m, LayerKind::kShortConv) && m.state.heads % p.tp != 0)
        throw Error(detail::concat("tp=", p.tp, " does not divide the ", m.state.heads,
                                   " conv channels of ", m.name,
                                   "'s short-conv layers, which vLLM splits over tp "
                                   "(short_conv_state_shape): valid tp sizes are ",
                                   join(valid_tp)));
    if (has_layer_kind(m, LayerKind::kMamba1) && m.state.heads % p.tp != 0)
        throw Error(detail::concat("tp=", p.tp, " does not divide the ", m.state.heads,
                                   " channels (d_inner) of ", m.name,
                                   "'s Mamba-1 layers, which vLLM splits over tp "
                                   "(mamba1_state_shape): valid tp sizes are ",
                                   join(valid_tp)));
    if (has_layer_kind(m, LayerKind::kMamba2) && !mamba2_tp_fits(m.state, p.tp))
        throw Error(detail::concat(
            "tp=", p.tp, " and the ", m.state.heads, " SSM heads and ", m.state.groups,
            " groups (n_groups) of ", m.name,
            "'s Mamba-2 layers: vLLM splits both over tp, or holds a single group whole on every "
            "rank, so tp must divide the heads and divide the groups unless there is one: valid "
            "tp sizes are ",
            join(valid_tp)));

    // PP splits decoder layers (vLLM's get_pp_indices over num_hidden_layers); a model of several
    // cache layers per decoder layer says which it counts.
    const int decoder_layers = m.num_decoder_layers();
    const std::string layers_word =
        m.cache_layers_per_decoder_layer == 1 ? "layers" : "decoder layers";
    if (p.pp > decoder_layers)
        throw Error(detail::concat("pp=", p.pp, " is larger than the ", decoder_layers, " ",
                                   layers_word, " of ", m.name, ": pp must be at most ",
                                   decoder_layers));
    if (!p.pp_layers.empty()) {
        if (static_cast<int>(p.pp_layers.size()) != p.pp)
            throw Error(detail::concat("pp_layers lists ", p.pp_layers.size(), " stages but pp=",
                                       p.pp, ": give one layer count per stage"));
        for (int n : p.pp_layers)
            require(n >= 1, "pp_layers: every stage needs at least one layer, got ", n);
        const int sum = std::accumulate(p.pp_layers.begin(), p.pp_layers.end(), 0);
        if (sum != decoder_layers)
            throw Error(detail::concat("pp_layers sums to ", sum, " but ", m.name, " has ",
                                       decoder_layers, " ", layers_word,
                                       ": the counts must add up to ", decoder_layers));
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
    // vLLM's get_pp_indices (vllm/distributed/utils.py): the remainder goes one layer each to
    // the stages before the last, from the second-to-last backwards (the last stage holds the
    // final norm and LM head, the first the embedding): 22 layers on 4 stages are 5, 6, 6, 5.
    // It splits num_hidden_layers, the decoder layers (make_layers builds one
    // FalconH1ParallelHybrid or FlashDecoderLayer per index, with all of its attention and Mamba
    // branches).
    const int n = m.num_decoder_layers();
    std::vector<int> split(p.pp, n / p.pp);
    for (int i = 2; i < n % p.pp + 2; ++i) ++split[static_cast<size_t>(p.pp - i)];
    return split;
}

std::vector<int> pp_cache_layer_split(const ModelSpec& m, const ParallelConfig& p) {
    std::vector<int> split = pp_layer_split(m, p);
    for (int& n : split) n *= m.cache_layers_per_decoder_layer;
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
    const auto split = pp_cache_layer_split(m, p);
    std::vector<int> stage_begin(p.pp + 1, 0);
    for (int s = 0; s < p.pp; ++s) stage_begin[s + 1] = stage_begin[s] + split[s];

    const int heads_per_rank = l.kv_heads_per_rank();
    const int replication = l.head_replication();
    const int q_per_rank = m.num_heads / p.tp;
    const int64_t e = static_cast<int64_t>(dtype_size(m.kv_dtype));
    const int experts_per_rank = m.moe.enabled() ? m.moe.num_experts / p.ep : 0;
    const std::vector<KvGroup> groups = kv_groups(m);

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
        for (size_t gi = 0; gi < groups.size(); ++gi) {
            const KvGroup& g = groups[gi];
            RankKvGroup rg;
            rg.group = static_cast<int>(gi);
            rg.kind = g.kind;
            rg.window = g.window;
            for (int layer : g.layers)
                if (layer >= rk.layer_begin && layer < rk.layer_end) rg.layers.push_back(layer);
            if (rg.layers.empty()) continue;
            const int64_t n = static_cast<int64_t>(rg.layers.size());
            const int64_t index_bytes = g.indexer ? indexer_bytes_per_token(m) : 0;
            if (g.kind == LayerKind::kMla) {
                rg.kv_heads = 1;
                rg.bytes_per_token = n * (mla_bytes_per_token(m) + index_bytes);
                // fp8_ds_mla keeps its scales in each token's entry.
                if (m.kv_dtype == DType::kFp8 && !mla_fp8_ds_layout(m))
                    rg.scale_bytes_per_block = n * 4;
            } else if (holds_tokens(g.kind)) {
                rg.kv_heads = std::max(1, g.num_kv_heads / p.tp);
                rg.bytes_per_token = n * (2 * int64_t{rg.kv_heads} * g.head_dim * e + index_bytes);
                if (m.kv_dtype == DType::kFp8)
                    rg.scale_bytes_per_block = n * 2 * int64_t{rg.kv_heads} * 4;
            } else {
                rg.kv_heads = std::max(1, m.state.heads / p.tp);
                rg.state_bytes_per_sequence = n * state_bytes(m.state, p.tp);
            }
            rk.kv_bytes_per_token += rg.bytes_per_token;
            rk.state_bytes_per_sequence += rg.state_bytes_per_sequence;
            rk.groups.push_back(std::move(rg));
        }
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

namespace {
nlohmann::json groups_json(const RankKv& r) {
    nlohmann::json out = nlohmann::json::array();
    for (const RankKvGroup& g : r.groups) {
        nlohmann::json w = g.window > 0 ? nlohmann::json(g.window) : nlohmann::json(nullptr);
        out.push_back({{"group", g.group},
                       {"kind", layer_kind_name(g.kind)},
                       {"layers", g.layers},
                       {"window", w},
                       {"kv_heads", g.kv_heads},
                       {"bytes_per_token", g.bytes_per_token},
                       {"state_bytes_per_sequence", g.state_bytes_per_sequence},
                       {"scale_bytes_per_block", g.scale_bytes_per_block}});
    }
    return out;
}
}  // namespace

int64_t first_kept_position(LayerKind kind, int window, int64_t seq_len) {
    KVSHARD_CHECK(seq_len >= 0, "negative sequence length");
    switch (kind) {
        case LayerKind::kSlidingWindow:
            return std::max<int64_t>(0, seq_len - window);
        case LayerKind::kChunkedLocal:
            return seq_len == 0 ? 0 : (seq_len - 1) / window * window;
        case LayerKind::kFullAttention:
        case LayerKind::kMla:
            return 0;
        case LayerKind::kGatedDeltaNet:
        case LayerKind::kMamba2:
        case LayerKind::kMamba1:
        case LayerKind::kShortConv:
        case LayerKind::kNoKv:
            return seq_len;
    }
    return 0;
}

int64_t cp_tokens_before(const ParallelConfig& p, int cp_rank, int64_t seq_len, int64_t pos) {
    KVSHARD_CHECK(cp_rank >= 0 && cp_rank < p.cp, "cp rank out of range");
    KVSHARD_CHECK(pos >= 0 && pos <= seq_len, "position outside the sequence");
    auto in = [pos](int64_t b, int64_t e) { return std::max<int64_t>(0, std::min(e, pos) - b); };
    switch (p.cp_scheme) {
        case CpScheme::kContiguous:
            return in(part_boundary(seq_len, p.cp, cp_rank),
                      part_boundary(seq_len, p.cp, cp_rank + 1));
        case CpScheme::kZigzag: {
            const int chunks = 2 * p.cp;
            const int second = chunks - 1 - cp_rank;
            return in(part_boundary(seq_len, chunks, cp_rank),
                      part_boundary(seq_len, chunks, cp_rank + 1)) +
                   in(part_boundary(seq_len, chunks, second),
                      part_boundary(seq_len, chunks, second + 1));
        }
        case CpScheme::kInterleave: {
            const int64_t unit = p.cp_interleave;
            const int64_t cycle = unit * p.cp;
            return (pos / cycle) * unit +
                   std::clamp<int64_t>(pos % cycle - cp_rank * unit, 0, unit);
        }
    }
    return 0;
}

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks group g keeps on a rank at CP position cp_rank; peak: the most it can hold up to seq_len.
int64_t group_blocks(const ParallelConfig& p, const RankKvGroup& g, int cp_rank, int64_t seq_len,
                     int block_size, bool peak) {
    const int64_t n = cp_tokens_before(p, cp_rank, seq_len, seq_len);
    const int64_t all = ceil_div(n, block_size);
    if (peak && g.window > 0) return std::min(all, ceil_div(g.window, block_size) + 1);
    const int64_t first = first_kept_position(g.kind, g.window, seq_len);
    const int64_t skipped = cp_tokens_before(p, cp_rank, seq_len, first);
    return all - skipped / block_size;
}

int64_t request_bytes(const KvLayout& l, int rank, int64_t seq_len, int block_size, bool peak) {
    KVSHARD_CHECK(rank >= 0 && rank < l.world_size(), "rank ", rank, " outside the layout");
    require(seq_len >= 0 && seq_len <= kMaxContextTokens,
            "the sequence length must be in [0, 2^40] tokens, got ", seq_len);
    require(block_size >= 1, "block_size must be a positive integer, got ", block_size);
    const RankKv& rk = l.ranks[static_cast<size_t>(rank)];
    int64_t bytes = 0;
    for (const RankKvGroup& g : rk.groups) {
        if (holds_state(g.kind)) {
            bytes += seq_len > 0 ? g.state_bytes_per_sequence : 0;
            continue;
        }
        // Saturating: a search may ask for lengths whose bytes exceed 64 bits (they never fit).
        const int64_t blocks = group_blocks(l.parallel, g, rk.coord.cp, seq_len, block_size, peak);
        bytes = sat_add(bytes, sat_add(sat_mul(sat_mul(blocks, block_size), g.bytes_per_token),
                                       sat_mul(blocks, g.scale_bytes_per_block)));
    }
    return bytes;
}
}  // namespace

int64_t request_kv_bytes(const KvLayout& l, int rank, int64_t seq_len, int block_size) {
    return request_bytes(l, rank, seq_len, block_size, false);
}

int64_t request_kv_bytes_peak(const KvLayout& l, int rank, int64_t seq_len, int block_size) {
    return request_bytes(l, rank, seq_len, block_size, true);
}

namespace {
// Bytes one layer holds for a request of `len` tokens at block size 1 and tp (whole model heads
// split as the layout does).
int64_t layer_request_bytes(const ModelSpec& m, const ParallelConfig& p, int l, int64_t len) {
    const LayerSpec s = m.layer(l);
    if (holds_state(s.kind)) return state_bytes(m.state, p.tp);
    if (!holds_tokens(s.kind)) return 0;
    const int64_t kept = len - first_kept_position(s.kind, s.window, len);
    const int64_t full = m.kv_bytes_per_token_of_layer(l);
    if (s.kind == LayerKind::kMla) return sat_mul(kept, full);
    // The layer's K and V split over tp (replicated below one head per rank), indexer keys whole.
    const int64_t e = static_cast<int64_t>(dtype_size(m.kv_dtype));
    const int64_t kv = 2 * int64_t{s.num_kv_heads} * s.head_dim * e;
    const int64_t per_rank = 2 * int64_t{std::max(1, s.num_kv_heads / p.tp)} * s.head_dim * e;
    return sat_mul(kept, full - kv + per_rank);
}
}  // namespace

std::vector<int64_t> pp_stage_kv_bytes(const ModelSpec& m, const ParallelConfig& p,
                                       int64_t context_tokens) {
    require(context_tokens >= 0 && context_tokens <= kMaxContextTokens,
            "the context must be in [0, 2^40] tokens, got ", context_tokens);
    const auto split = pp_cache_layer_split(m, p);
    std::vector<int64_t> out;
    int layer = 0;
    for (int n : split) {
        int64_t sum = 0;
        for (int i = 0; i < n; ++i, ++layer)
            sum = sat_add(sum, layer_request_bytes(m, p, layer, context_tokens));
        out.push_back(sum);
    }
    return out;
}

std::vector<int> pp_layer_split_kv_balanced(const ModelSpec& m, const ParallelConfig& p,
                                            int64_t context_tokens) {
    ParallelConfig even = p;
    even.pp_layers.clear();
    validate(m, even);
    require(context_tokens >= 1 && context_tokens <= kMaxContextTokens,
            "the context must be in [1, 2^40] tokens, got ", context_tokens);
    // Over decoder layers: a stage holds all cache layers of each of its decoder layers.
    const int L = m.num_decoder_layers(), S = p.pp, k = m.cache_layers_per_decoder_layer;
    std::vector<int64_t> prefix(L + 1, 0);
    for (int d = 0; d < L; ++d) {
        int64_t bytes = 0;
        for (int l = d * k; l < (d + 1) * k; ++l)
            bytes = sat_add(bytes, layer_request_bytes(m, p, l, context_tokens));
        prefix[d + 1] = sat_add(prefix[d], bytes);
    }
    // best[s][i]: the smallest possible maximum over s stages covering layers [0, i); ties are
    // broken towards the even split by comparing the layer-count spread second.
    constexpr int64_t kInf = INT64_MAX;
    std::vector<std::vector<int64_t>> best(S + 1, std::vector<int64_t>(L + 1, kInf));
    std::vector<std::vector<int>> cut(S + 1, std::vector<int>(L + 1, 0));
    best[0][0] = 0;
    const int even_size = L / S;
    for (int s = 1; s <= S; ++s)
        for (int i = s; i <= L - (S - s); ++i)
            for (int j = s - 1; j < i; ++j) {
                if (best[s - 1][j] == kInf) continue;
                const int64_t v = std::max(best[s - 1][j], prefix[i] - prefix[j]);
                const bool better =
                    v < best[s][i] || (v == best[s][i] && std::abs(i - j - even_size) <
                                                              std::abs(i - cut[s][i] - even_size));
                if (better) {
                    best[s][i] = v;
                    cut[s][i] = j;
                }
            }
    std::vector<int> split(S);
    for (int s = S, i = L; s >= 1; --s) {
        split[s - 1] = i - cut[s][i];
        i = cut[s][i];
    }
    return split;
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
                         {"kv_bytes_per_token", r.kv_bytes_per_token},
                         {"state_bytes_per_sequence", r.state_bytes_per_sequence},
                         {"kv_groups", groups_json(r)}});
    }
    nlohmann::json j = {{"model", l.model.name},
                        {"parallel", nlohmann::json::parse(to_json(l.parallel))},
                        {"world_size", l.world_size()},
                        {"kv_heads_per_rank", l.kv_heads_per_rank()},
                        {"head_replication", l.head_replication()},
                        {"layer_mix", l.model.layer_mix()},
                        {"ranks", ranks}};
    return j.dump(2);
}

}  // namespace kvshard
