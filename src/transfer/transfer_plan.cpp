#include "kvshard/transfer/transfer_plan.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <tuple>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

// The tokens one CP rank holds, with the local index at which each range starts.
struct CpTokens {
    std::vector<TokenRange> ranges;
    std::vector<int64_t> local_begin;
    int64_t total = 0;
};

CpTokens cp_tokens(const ParallelConfig& p, int cp_rank, int64_t num_tokens) {
    CpTokens t;
    t.ranges = cp_token_ranges(p, cp_rank, num_tokens);
    for (const auto& r : t.ranges) {
        t.local_begin.push_back(t.total);
        t.total += r.size();
    }
    return t;
}

int latent_dim(const ModelSpec& m) { return m.mla.kv_lora_rank + m.mla.qk_rope_head_dim; }

void require_same_model(const ModelSpec& a, const ModelSpec& b) {
    auto mismatch = [&](const char* what, auto x, auto y) {
        throw Error(detail::concat("transfer between different models: the source (", a.name,
                                   ") has ", what, " ", x, " but the destination (", b.name,
                                   ") has ", y, "; both sides must hold the same model's KV"));
    };
    if (a.num_layers != b.num_layers) mismatch("layers", a.num_layers, b.num_layers);
    if (a.is_mla() != b.is_mla()) mismatch("MLA", a.is_mla(), b.is_mla());
    if (a.is_mla()) {
        if (latent_dim(a) != latent_dim(b)) mismatch("latent width", latent_dim(a), latent_dim(b));
    } else {
        if (a.num_kv_heads != b.num_kv_heads) mismatch("KV heads", a.num_kv_heads, b.num_kv_heads);
        if (a.head_dim != b.head_dim) mismatch("head_dim", a.head_dim, b.head_dim);
    }
    if (a.kv_dtype != b.kv_dtype)
        mismatch("KV dtype", dtype_name(a.kv_dtype), dtype_name(b.kv_dtype));
    const std::vector<KvGroup> ga = kv_groups(a), gb = kv_groups(b);
    if (ga != gb) mismatch("layers", a.layer_mix(), b.layer_mix());
    bool state = false, indexer = false;
    for (const KvGroup& g : ga) {
        state = state || holds_state(g.kind);
        indexer = indexer || g.indexer;
    }
    if (state && !(a.state == b.state)) mismatch("a state shape", "", "another");
    if (indexer && !(a.indexer == b.indexer)) mismatch("an indexer shape", "", "another");
}

void validate_endpoint(const TransferEndpoint& e, const char* side, int64_t num_tokens) {
    const ParallelConfig& p = e.layout.parallel;
    require(e.layout.world_size() == p.world_size() && !e.layout.ranks.empty(), "the ", side,
            " layout is empty: build it with make_layout");
    require(e.dp >= 0 && e.dp < p.dp, "the ", side, " replica dp=", e.dp,
            " does not exist: valid are 0..", p.dp - 1);
    require(e.block_size >= 1 && e.block_size <= (1 << 20), "the ", side,
            " block size must be in [1, 2^20] tokens, got ", e.block_size);
    require(static_cast<int>(e.block_tables.size()) == p.cp, "the ", side,
            " side needs one block table per CP rank (", p.cp, "), got ", e.block_tables.size());
    for (int c = 0; c < p.cp; ++c) {
        const int64_t held = cp_tokens(p, c, num_tokens).total;
        const int64_t need = (held + e.block_size - 1) / e.block_size;
        require(static_cast<int64_t>(e.block_tables[c].size()) >= need, "the ", side,
                " block table of CP rank ", c, " has ", e.block_tables[c].size(),
                " blocks but its ", held, " tokens need ", need, " blocks of ", e.block_size);
        const std::vector<int32_t>& table = e.block_tables[c];
        for (int64_t i = 0; i < need; ++i)
            require(table[i] >= 0, "the ", side, " block table of CP rank ", c,
                    " holds a negative block id ", table[i]);
        // Distinct ids: two entries with one id would put two token ranges in one block. (An
        // ascending table, the usual one, needs no sorted copy.)
        const auto needed_end = table.begin() + need;
        if (std::adjacent_find(table.begin(), needed_end, std::greater_equal<>()) == needed_end)
            continue;
        std::vector<int32_t> ids(table.begin(), needed_end);
        std::sort(ids.begin(), ids.end());
        const auto dup = std::adjacent_find(ids.begin(), ids.end());
        if (dup != ids.end()) {
            const auto first = std::find(table.begin(), needed_end, *dup);
            const auto second = std::find(first + 1, needed_end, *dup);
            const int64_t i = first - table.begin(), j = second - table.begin();
            throw Error(detail::concat("the ", side, " block table of CP rank ", c, " holds block ",
                                       *dup, " twice, at positions ", i, " and ", j,
                                       " (the rank's tokens ", i * e.block_size, "..",
                                       (i + 1) * e.block_size - 1, " and ", j * e.block_size, "..",
                                       std::min(held, (j + 1) * e.block_size) - 1,
                                       "): both would land in one block; give each of the ", need,
                                       " blocks its tokens need its own id"));
        }
    }
}

// Heads per TP rank and how many TP ranks hold each head group.
struct HeadSplit {
    int per_rank = 1;
    int replication = 1;
    int groups = 1;  // distinct head groups
};

// How tp splits n heads (KV heads of a group, state heads, state key heads): max(1, n / tp) per
// rank, each held by max(1, tp / n) ranks; mla: one latent on every rank. n = 0 (a short-conv
// state has no key heads) is split as one empty head on every rank.
HeadSplit head_split(int n, int tp, bool mla) {
    HeadSplit h;
    h.per_rank = mla ? 1 : std::max(1, n / tp);
    h.replication = mla ? tp : std::max(1, tp / std::max(1, n));
    h.groups = tp / h.replication;
    return h;
}

// Heads [first, first + per_rank) of TP index t under split h.
int first_head(const HeadSplit& h, int t) { return t / h.replication * h.per_rank; }

// The first global position CP rank c (tokens t) still holds of a group whose first kept position
// is `first_kept`: the first position of the block holding c's first kept token. 0 for groups that
// keep every token; num_tokens where c keeps none.
int64_t keep_from(const ParallelConfig& p, int c, const CpTokens& t, int64_t first_kept,
                  int block_size, int64_t num_tokens) {
    if (first_kept == 0) return 0;
    const int64_t before = cp_tokens_before(p, c, num_tokens, first_kept);
    const int64_t k = before / block_size * block_size;  // local index of that block's first slot
    for (size_t i = 0; i < t.ranges.size(); ++i)
        if (k < t.local_begin[i] + t.ranges[i].size())
            return t.ranges[i].begin + (k - t.local_begin[i]);
    return num_tokens;
}

// Tokens that CP ranks with tokens a and b both hold at or after position `from`.
int64_t common_tokens(const CpTokens& a, const CpTokens& b, int64_t from) {
    int64_t n = 0;
    size_t i = 0, j = 0;
    while (i < a.ranges.size() && j < b.ranges.size()) {
        const int64_t lo = std::max({a.ranges[i].begin, b.ranges[j].begin, from});
        const int64_t hi = std::min(a.ranges[i].end, b.ranges[j].end);
        n += std::max<int64_t>(0, hi - lo);
        if (a.ranges[i].end < b.ranges[j].end)
            ++i;
        else
            ++j;
    }
    return n;
}

std::vector<TransferGroup> transfer_groups(const ModelSpec& m, int64_t num_tokens) {
    const auto e = static_cast<int64_t>(dtype_size(m.kv_dtype));
    std::vector<TransferGroup> out;
    for (const KvGroup& k : kv_groups(m)) {
        TransferGroup g;
        g.kind = k.kind;
        g.window = k.window;
        g.layers = k.layers;
        if (k.kind == LayerKind::kMla) {
            g.kv_factor = 1;
            g.num_heads = 1;
            g.vector_bytes = mla_bytes_per_token(m) + (k.indexer ? indexer_bytes_per_token(m) : 0);
        } else if (holds_tokens(k.kind)) {
            require(!k.indexer, "layer ", k.layers.front(), " of ", m.name,
                    " caches indexer keys beside K and V: transfer plans move indexer keys with "
                    "an MLA latent only");
            g.kv_factor = 2;
            g.num_heads = k.num_kv_heads;
            g.vector_bytes = int64_t{k.head_dim} * e;
        } else {
            const StateSpec& st = m.state;
            const auto ce = static_cast<int64_t>(dtype_size(st.conv_dtype));
            const auto se = static_cast<int64_t>(dtype_size(st.state_dtype));
            g.kv_factor = 0;
            g.state_heads = st.heads;
            g.state_keys = st.groups;
            g.state_head_bytes = int64_t{st.conv_kernel - 1} * st.head_dim * ce +
                                 int64_t{st.head_dim} * st.group_dim * se;
            // B/C conv columns exist only where the state has groups: Mamba-2 and GDN/KDA have
            // them; Mamba-1 (vLLM mamba1_state_shape: conv (k-1, d_inner)) and short conv do not.
            g.state_key_bytes =
                st.groups > 0 ? int64_t{st.conv_kernel - 1} * 2 * st.group_dim * ce : 0;
        }
        // The decode side's first query is at position num_tokens: its window, not the last
        // prefill token's (first_kept_position(.., num_tokens), what the prefill side keeps).
        g.first_kept =
            holds_tokens(k.kind) ? first_kept_position(k.kind, k.window, num_tokens + 1) : 0;
        out.push_back(std::move(g));
    }
    return out;
}

// Layers of `layers` (ascending) in [begin, end).
int layers_in(const std::vector<int>& layers, int begin, int end) {
    return static_cast<int>(std::lower_bound(layers.begin(), layers.end(), end) -
                            std::lower_bound(layers.begin(), layers.end(), begin));
}

// What one destination rank needs from one source head group on one (PP stage, CP rank): layers
// [layer_begin, layer_end) x heads [head_begin, head_end) x the tokens of `pieces`. Any copy of
// the group can send it, or several copies a token range each.
struct Demand {
    int dst_rank = 0;
    int layer_begin = 0, layer_end = 0;
    int head_begin = 0, head_end = 0;
    const std::vector<TransferPiece>* pieces = nullptr;  // null for state (tokens = 1)
    int64_t tokens = 0;
    int num_layers = 0;  // the group's layers in [layer_begin, layer_end)
    int64_t unit = 1;    // state: bytes of one head (or key head) of one layer
    // Load per token (head vectors over layers and heads; state: bytes): load = weight x tokens.
    int64_t weight() const { return int64_t{num_layers} * (head_end - head_begin) * unit; }
};

// Copy `copy` of the group sends tokens [token_begin, token_end) (indices into the demand's token
// sequence) of demand `demand`.
struct CopyShare {
    int demand = 0;
    int copy = 0;
    int64_t token_begin = 0, token_end = 0;
};

// Which copies send which demands. Whole demands when that is as good as splitting: each demand
// to the least-loaded copy, larger demands first and ties to the lowest copy, so equal demands go
// round-robin (destination replica j from source copy j mod R: TP=8 -> TP=8 under MLA sends each
// destination its whole range from its own TP index). Split only where that lowers the most any
// one copy sends (a TP shrink, where destinations are fewer than copies): the demands laid end to
// end (in destination rank order) and cut into `copies` equal loads (McNaughton's wrap-around
// rule), at token boundaries, so every demand spans consecutive copies and at most copies - 1
// demands are cut.
std::vector<CopyShare> choose_copies(const std::vector<Demand>& demands, int copies) {
    const int k = static_cast<int>(demands.size());
    std::vector<CopyShare> whole;
    std::vector<int64_t> load(copies, 0);
    std::vector<int> order(k);
    for (int i = 0; i < k; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return demands[a].weight() * demands[a].tokens > demands[b].weight() * demands[b].tokens;
    });
    for (int i : order) {
        const int c = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
        load[c] += demands[i].weight() * demands[i].tokens;
        whole.push_back({i, c, 0, demands[i].tokens});
    }
    const int64_t whole_max = *std::max_element(load.begin(), load.end());
    if (copies == 1) return whole;

    int64_t total = 0;
    for (const Demand& d : demands) total += d.weight() * d.tokens;
    std::vector<CopyShare> split;
    std::fill(load.begin(), load.end(), 0);
    int64_t offset = 0;  // load of the demands before this one
    for (int i = 0; i < k; ++i) {
        const Demand& d = demands[i];
        const int64_t w = d.weight();
        // Token index of demand i at which copy c's share of the total load begins.
        auto cut = [&](int c) {
            const int64_t boundary = total / copies * c + total % copies * c / copies;
            return std::clamp<int64_t>((boundary - offset + w - 1) / w, 0, d.tokens);
        };
        for (int c = 0; c < copies; ++c) {
            const int64_t a = c == 0 ? 0 : cut(c);
            const int64_t b = c == copies - 1 ? d.tokens : cut(c + 1);
            if (a >= b) continue;
            split.push_back({i, c, a, b});
            load[c] += w * (b - a);
        }
        offset += w * d.tokens;
    }
    const int64_t split_max = *std::max_element(load.begin(), load.end());
    return split_max < whole_max ? split : whole;
}

// Tokens [begin, end) of a piece sequence, as pieces (each cut piece keeps its blocks).
std::vector<TransferPiece> slice_pieces(const std::vector<TransferPiece>& pieces, int64_t begin,
                                        int64_t end) {
    std::vector<TransferPiece> out;
    int64_t at = 0;
    for (const TransferPiece& p : pieces) {
        const int64_t a = std::max(begin, at), b = std::min(end, at + p.count);
        if (a < b) {
            TransferPiece q = p;
            const auto skip = static_cast<int32_t>(a - at);
            q.token_begin += skip;
            q.src_slot += skip;
            q.dst_slot += skip;
            q.count = static_cast<int32_t>(b - a);
            out.push_back(q);
        }
        at += p.count;
        if (at >= end) break;
    }
    return out;
}

}  // namespace

std::vector<std::vector<int32_t>> sequential_block_tables(const KvLayout& layout, int block_size,
                                                          int64_t num_tokens) {
    require(block_size >= 1 && block_size <= (1 << 20),
            "block size must be in [1, 2^20] tokens, got ", block_size);
    require(num_tokens >= 0 && num_tokens <= kMaxTransferTokens, "a transfer of ", num_tokens,
            " tokens: kvshard plans transfers of [1, 2^26] tokens");
    std::vector<std::vector<int32_t>> tables(layout.parallel.cp);
    for (int c = 0; c < layout.parallel.cp; ++c) {
        const int64_t held = cp_tokens(layout.parallel, c, num_tokens).total;
        const int64_t blocks = (held + block_size - 1) / block_size;
        for (int64_t b = 0; b < blocks; ++b) tables[c].push_back(static_cast<int32_t>(b));
    }
    return tables;
}

PageGeometry rank_page_geometry(const KvLayout& layout, int rank, int block_size, PageOrder order) {
    KVSHARD_CHECK(rank >= 0 && rank < layout.world_size(), "rank ", rank, " outside the layout");
    const RankKv& r = layout.ranks[rank];
    const ModelSpec& m = layout.model;
    require(m.uniform(), m.name, " has ", m.layer_mix(),
            ": its plan has several KV groups; pack/unpack, schedules and the executor move pools "
            "of one page shape, so carry it out per group: group_transfer_plan(plan, k) for each "
            "token group, state messages (transfer/state_pack.h) for state groups");
    PageGeometry g;
    g.num_layers = r.num_layers();
    g.kv_factor = m.is_mla() ? 1 : 2;
    g.num_heads = m.is_mla() ? 1 : r.num_kv_heads();
    g.block_size = block_size;
    g.head_dim = m.is_mla() ? mla_page_dim(m) : m.head_dim;  // refuses fp8_ds_mla
    g.dtype = m.kv_dtype;
    g.order = order;
    return g;
}

std::vector<int> TransferPlan::messages_from(int src_rank) const {
    std::vector<int> out;
    for (int i = 0; i < static_cast<int>(messages.size()); ++i)
        if (messages[i].src_rank == src_rank) out.push_back(i);
    return out;
}

std::vector<int> TransferPlan::messages_to(int dst_rank) const {
    std::vector<int> out;
    for (int i = 0; i < static_cast<int>(messages.size()); ++i)
        if (messages[i].dst_rank == dst_rank) out.push_back(i);
    return out;
}

int TransferPlan::group_layers(const TransferMessage& msg) const {
    return layers_in(groups.at(msg.kv_group).layers, msg.layer_begin, msg.layer_end);
}

void require_executable(const TransferPlan& plan, std::string_view why) {
    const ModelSpec& m = plan.src.layout.model;
    if (m.uniform() && m.is_mla()) (void)mla_page_dim(m);  // refuses fp8_ds_mla, naming it
    require(plan.executable(), m.name, " has ", m.layer_mix(), ": ", why);
}

bool TransferPlan::executable() const {
    // fp8_ds_mla entries are planned and sized, never packed (rank_page_geometry refuses them).
    return src.layout.model.uniform() && !mla_fp8_ds_layout(src.layout.model);
}

int group_layers_done(const std::vector<int>& layers, int layer) {
    return static_cast<int>(std::upper_bound(layers.begin(), layers.end(), layer) - layers.begin());
}

TransferPlan group_transfer_plan(const TransferPlan& plan, int kv_group) {
    KVSHARD_CHECK(kv_group >= 0 && kv_group < static_cast<int>(plan.groups.size()), "KV group ",
                  kv_group, " outside the plan's ", plan.groups.size());
    const TransferGroup& g = plan.groups[size_t(kv_group)];
    const ModelSpec& m = plan.src.layout.model;
    require(!g.holds_state(), "KV group ", kv_group, " of ", m.name,
            " holds recurrent state: it moves as state messages (pack_state_message), not pages");
    const bool mla = g.kind == LayerKind::kMla;
    // A model of the group's layers alone, every one the group's (full-attention or MLA) shape:
    // the group's KV heads of the group's head size, which may differ from the model's (Gemma 4's
    // full layers: 4 heads of 512 beside sliding layers of 16 heads of 256).
    ModelSpec gm = m;
    gm.name = detail::concat(m.name, " (KV group ", kv_group, ")");
    gm.layers.clear();
    if (mla && !m.layer(g.layers.front()).indexer) gm.indexer = {};  // MLA without indexer keys
    gm.num_layers = static_cast<int>(g.layers.size());
    const auto e = static_cast<int64_t>(dtype_size(m.kv_dtype));
    if (!mla) {
        gm.num_kv_heads = g.num_heads;
        gm.head_dim = static_cast<int>(g.vector_bytes / e);
        gm.attention = AttentionKind::kGqa;
    }
    auto local = [&](int global) {  // group layers before global layer `global`
        return static_cast<int>(std::lower_bound(g.layers.begin(), g.layers.end(), global) -
                                g.layers.begin());
    };
    // Each rank holds its TP share of the group's heads (as the layout's RankKvGroup::kv_heads
    // counts them and vLLM allocates each layer): max(1, H / tp) contiguous heads, each held by
    // max(1, tp / H) ranks, the same rule as the model's heads (make_layout) and the plan's.
    auto side = [&](TransferEndpoint ep) {
        ep.layout.model = gm;
        const ParallelConfig& p = ep.layout.parallel;
        const HeadSplit hs = head_split(g.num_heads, p.tp, mla);
        for (RankKv& r : ep.layout.ranks) {
            r.layer_begin = local(r.layer_begin);
            r.layer_end = local(r.layer_end);
            r.groups.clear();
            if (!mla) {
                const RankCoord& c = r.coord;
                r.kv_heads.clear();
                for (int h = 0; h < hs.per_rank; ++h)
                    r.kv_heads.push_back(first_head(hs, c.tp) + h);
                r.head_replica_ranks.clear();
                const int first_tp = c.tp / hs.replication * hs.replication;
                for (int t = first_tp; t < first_tp + hs.replication; ++t)
                    if (t != c.tp) r.head_replica_ranks.push_back(rank_of(p, c.dp, c.pp, c.cp, t));
            }
            r.kv_bytes_per_token =
                int64_t{r.num_layers()} * g.kv_factor * (mla ? 1 : hs.per_rank) * g.vector_bytes;
            r.state_bytes_per_sequence = 0;
        }
        return ep;
    };
    TransferPlan out;
    out.src = side(plan.src);
    out.dst = side(plan.dst);
    out.num_tokens = plan.num_tokens;
    out.options = plan.options;
    out.num_layer_groups = plan.num_layer_groups;
    TransferGroup og = g;
    for (int& l : og.layers) l = local(l);
    out.groups = {og};
    out.kv_factor = g.kv_factor;
    out.elem_size = e;
    out.head_dim = static_cast<int>(g.vector_bytes / out.elem_size);
    for (const TransferMessage& msg : plan.messages) {
        if (msg.kv_group != kv_group) continue;
        TransferMessage t = msg;
        t.kv_group = 0;
        t.layer_begin = local(msg.layer_begin);
        t.layer_end = local(msg.layer_end);
        out.bytes += t.bytes;
        out.messages.push_back(std::move(t));
    }
    for (int r = 0; r < out.dst.layout.world_size(); ++r) out.min_bytes += needed_bytes(out, r);
    return out;
}

int64_t needed_bytes(const TransferPlan& plan, int dst_rank) {
    const KvLayout& l = plan.dst.layout;
    const RankKv& r = l.ranks[dst_rank];
    if (r.coord.dp != plan.dst.dp) return 0;
    const ParallelConfig& ps = plan.src.layout.parallel;
    const ParallelConfig& pd = l.parallel;
    const int tp = pd.tp;
    const int64_t n = plan.num_tokens;
    const CpTokens dt = cp_tokens(pd, r.coord.cp, n);
    int64_t bytes = 0;
    for (const TransferGroup& g : plan.groups) {
        const int layers = layers_in(g.layers, r.layer_begin, r.layer_end);
        if (layers == 0) continue;
        if (g.holds_state()) {
            bytes += int64_t{layers} *
                     (head_split(g.state_heads, tp, false).per_rank * g.state_head_bytes +
                      head_split(g.state_keys, tp, false).per_rank * g.state_key_bytes);
            continue;
        }
        // The rank's tokens at or after the cached prefix (and, windowed, its kept blocks' first
        // position and the source's).
        int64_t tokens = 0;
        if (g.first_kept == 0) {
            for (const auto& range : dt.ranges)
                tokens += std::max<int64_t>(
                    0, range.end - std::max(range.begin, plan.options.dst_cached_tokens));
        } else {
            const int64_t dst_from =
                keep_from(pd, r.coord.cp, dt, g.first_kept, plan.dst.block_size, n);
            for (int cs = 0; cs < ps.cp; ++cs) {
                const CpTokens st = cp_tokens(ps, cs, n);
                const int64_t src_from =
                    keep_from(ps, cs, st, g.first_kept, plan.src.block_size, n);
                tokens += common_tokens(
                    st, dt, std::max({plan.options.dst_cached_tokens, dst_from, src_from}));
            }
        }
        const int heads = head_split(g.num_heads, tp, g.kind == LayerKind::kMla).per_rank;
        bytes += int64_t{layers} * g.kv_factor * heads * tokens * g.vector_bytes;
    }
    return bytes;
}

int64_t tail_bytes(const TransferPlan& plan) {
    int64_t sum = 0;
    for (const TransferMessage& msg : plan.messages)
        if (msg.layer_end == plan.src.layout.ranks[msg.src_rank].layer_end) sum += msg.bytes;
    return sum;
}

TransferPlan make_transfer_plan(const TransferEndpoint& src, const TransferEndpoint& dst,
                                int64_t num_tokens, const TransferPlanOptions& options) {
    require(num_tokens >= 1 && num_tokens <= kMaxTransferTokens, "a transfer of ", num_tokens,
            " tokens: kvshard plans transfers of [1, 2^26] tokens");
    require(options.layers_per_group >= 0, "layers per group must be 0 (all) or positive, got ",
            options.layers_per_group);
    require(options.dst_cached_tokens >= 0 && options.dst_cached_tokens < num_tokens,
            "the destination's cached prefix must be in [0, ", num_tokens,
            ") tokens (at least the last token moves), got ", options.dst_cached_tokens);
    require_same_model(src.layout.model, dst.layout.model);
    validate_endpoint(src, "source", num_tokens);
    validate_endpoint(dst, "destination", num_tokens);
    // The plan lists a piece per block a message covers (TransferPiece, 32 bytes): bounded before
    // the pieces are made, here for one message and below for all of them.
    const int64_t min_block = std::min(src.block_size, dst.block_size);
    require((num_tokens + min_block - 1) / min_block <= kMaxTransferMessagePieces, "a transfer of ",
            num_tokens, " tokens in blocks of ", min_block, " lists ",
            (num_tokens + min_block - 1) / min_block, " pieces per message, more than the ",
            kMaxTransferMessagePieces, " a plan lists: use blocks of at least ",
            (num_tokens + kMaxTransferMessagePieces - 1) / kMaxTransferMessagePieces,
            " tokens or fewer tokens");

    const ModelSpec& m = src.layout.model;
    if (m.kv_dtype == DType::kFp8)
        require(src.block_size == dst.block_size && src.layout.parallel.cp == 1 &&
                    dst.layout.parallel.cp == 1,
                "an fp8 transfer keeps each block's codes and per-block scales: both sides need "
                "the same block size and cp=1, got block sizes ",
                src.block_size, " and ", dst.block_size, ", cp=", src.layout.parallel.cp,
                " and cp=", dst.layout.parallel.cp);
    if (m.kv_dtype == DType::kFp8 && options.dst_cached_tokens % dst.block_size != 0) {
        // A moved block brings its scale, which would replace the scale the destination's cached
        // tokens of that block were quantized with.
        const int64_t bs = dst.block_size;
        const int64_t below = options.dst_cached_tokens / bs * bs, above = below + bs;
        throw Error(detail::concat(
            "an fp8 transfer with the destination's cached prefix ending mid-block (",
            options.dst_cached_tokens, " tokens, blocks of ", bs,
            "): the moved tokens' block scale would replace the one its cached tokens ", below,
            "..", options.dst_cached_tokens - 1,
            " were quantized with; for fp8 the cached prefix must end on a block boundary: use ",
            below, above < num_tokens ? detail::concat(" or ", above) : std::string(),
            " cached tokens"));
    }
    TransferPlan plan;
    plan.src = src;
    plan.dst = dst;
    plan.num_tokens = num_tokens;
    plan.options = options;
    plan.groups = transfer_groups(m, num_tokens);
    plan.kv_factor = m.is_mla() ? 1 : 2;
    // fp8_ds_mla entries are planned and sized, never packed (rank_page_geometry refuses them).
    plan.head_dim = !m.is_mla()            ? m.head_dim
                    : mla_fp8_ds_layout(m) ? latent_dim(m)
                                           : mla_page_dim(m);
    plan.elem_size = static_cast<int64_t>(dtype_size(m.kv_dtype));
    const int lpg = options.layers_per_group;
    plan.num_layer_groups = lpg == 0 ? 1 : (m.num_layers + lpg - 1) / lpg;

    const ParallelConfig& ps = src.layout.parallel;
    const ParallelConfig& pd = dst.layout.parallel;

    std::vector<CpTokens> src_tokens, dst_tokens;
    for (int c = 0; c < ps.cp; ++c) src_tokens.push_back(cp_tokens(ps, c, num_tokens));
    for (int c = 0; c < pd.cp; ++c) dst_tokens.push_back(cp_tokens(pd, c, num_tokens));

    // The pieces source CP rank cs sends destination CP rank cd, in token order, of the tokens at
    // or after `from`.
    auto make_pieces = [&](int cs, int cd, int64_t from) {
        std::vector<TransferPiece> out;
        const CpTokens& st = src_tokens[cs];
        const CpTokens& dt = dst_tokens[cd];
        size_t i = 0, j = 0;
        while (i < st.ranges.size() && j < dt.ranges.size()) {
            const int64_t a = std::max({st.ranges[i].begin, dt.ranges[j].begin, from});
            const int64_t b = std::min(st.ranges[i].end, dt.ranges[j].end);
            if (a < b) {
                int64_t js = st.local_begin[i] + (a - st.ranges[i].begin);
                int64_t jd = dt.local_begin[j] + (a - dt.ranges[j].begin);
                for (int64_t t = a; t < b;) {
                    const int64_t step = std::min({b - t, src.block_size - js % src.block_size,
                                                   dst.block_size - jd % dst.block_size});
                    TransferPiece p;
                    p.token_begin = t;
                    p.count = static_cast<int32_t>(step);
                    p.src_block = src.block_tables[cs][js / src.block_size];
                    p.src_slot = static_cast<int32_t>(js % src.block_size);
                    p.dst_block = dst.block_tables[cd][jd / dst.block_size];
                    p.dst_slot = static_cast<int32_t>(jd % dst.block_size);
                    out.push_back(p);
                    t += step;
                    js += step;
                    jd += step;
                }
            }
            if (st.ranges[i].end < dt.ranges[j].end)
                ++i;
            else
                ++j;
        }
        return out;
    };

    // pieces[k][cs][cd]: the pieces of token group k (empty for state groups). Groups that keep
    // every token share one set.
    const int ngroups = static_cast<int>(plan.groups.size());
    using PieceGrid = std::vector<std::vector<std::vector<TransferPiece>>>;
    std::vector<std::shared_ptr<const PieceGrid>> pieces(ngroups);
    std::shared_ptr<const PieceGrid> all_tokens;
    for (int k = 0; k < ngroups; ++k) {
        const TransferGroup& g = plan.groups[k];
        if (g.holds_state()) continue;
        if (g.first_kept == 0 && all_tokens) {
            pieces[k] = all_tokens;
            continue;
        }
        auto grid =
            std::make_shared<PieceGrid>(ps.cp, std::vector<std::vector<TransferPiece>>(pd.cp));
        for (int cs = 0; cs < ps.cp; ++cs) {
            const int64_t src_from =
                keep_from(ps, cs, src_tokens[cs], g.first_kept, src.block_size, num_tokens);
            for (int cd = 0; cd < pd.cp; ++cd) {
                const int64_t dst_from =
                    keep_from(pd, cd, dst_tokens[cd], g.first_kept, dst.block_size, num_tokens);
                (*grid)[cs][cd] =
                    make_pieces(cs, cd, std::max({options.dst_cached_tokens, src_from, dst_from}));
            }
        }
        pieces[k] = grid;
        if (g.first_kept == 0) all_tokens = grid;
    }

    // Demands: what one destination rank needs of one source head group on one (PP stage, CP
    // rank), per KV group (state groups: per axis, heads or key heads). The copies of that head
    // group share its demands (choose_copies).
    using DemandKey = std::tuple<int, int, int, int, int>;  // (kv group, axis, stage, cs, group)
    std::map<DemandKey, std::vector<Demand>> demands;
    int64_t listed_pieces = 0;  // of all messages, counted before they are made
    const std::vector<int> src_split = pp_cache_layer_split(m, ps);
    std::vector<int> src_stage_begin(ps.pp + 1, 0);
    for (int s = 0; s < ps.pp; ++s) src_stage_begin[s + 1] = src_stage_begin[s] + src_split[s];

    for (const RankKv& d : dst.layout.ranks) {
        if (d.coord.dp != dst.dp) continue;
        const int cd = d.coord.cp;
        plan.min_bytes += needed_bytes(plan, d.coord.rank);
        for (int stage = 0; stage < ps.pp; ++stage) {
            const int l0 = std::max(d.layer_begin, src_stage_begin[stage]);
            const int l1 = std::min(d.layer_end, src_stage_begin[stage + 1]);
            if (l0 >= l1) continue;
            for (int k = 0; k < ngroups; ++k) {
                const TransferGroup& g = plan.groups[k];
                const int nl = layers_in(g.layers, l0, l1);
                if (nl == 0) continue;
                // Token groups: one axis (KV heads); state groups: heads, then key heads.
                const int axes = g.holds_state() ? 2 : 1;
                for (int axis = 0; axis < axes; ++axis) {
                    const int n = !g.holds_state() ? g.num_heads
                                  : axis == 0      ? g.state_heads
                                                   : g.state_keys;
                    const bool mla = g.kind == LayerKind::kMla;
                    const HeadSplit hs = head_split(n, ps.tp, mla);
                    const HeadSplit hd = head_split(n, pd.tp, mla);
                    const int dh0 = mla ? 0 : first_head(hd, d.coord.tp);
                    const int dh1 = mla ? 1 : dh0 + hd.per_rank;
                    for (int hg = 0; hg < hs.groups; ++hg) {
                        const int h0 = std::max(dh0, hg * hs.per_rank);
                        const int h1 = std::min(dh1, (hg + 1) * hs.per_rank);
                        if (h0 >= h1) continue;
                        Demand dm;
                        dm.dst_rank = d.coord.rank;
                        dm.layer_begin = l0;
                        dm.layer_end = l1;
                        dm.head_begin = h0;
                        dm.head_end = h1;
                        dm.num_layers = nl;
                        if (g.holds_state()) {
                            // Every CP rank of the source holds the sequence's state (as
                            // request_kv_bytes counts it): spread destinations over them.
                            dm.tokens = 1;
                            dm.unit = axis == 0 ? g.state_head_bytes : g.state_key_bytes;
                            if (dm.unit == 0) continue;
                            demands[{k, axis, stage, cd % ps.cp, hg}].push_back(dm);
                            continue;
                        }
                        for (int cs = 0; cs < ps.cp; ++cs) {
                            const auto& pcs = (*pieces[k])[cs][cd];
                            if (pcs.empty()) continue;
                            // Each layer group of [l0, l1) gets a message with these pieces.
                            listed_pieces += static_cast<int64_t>(pcs.size()) *
                                             (lpg == 0 ? 1 : (l1 - 1) / lpg - l0 / lpg + 1);
                            require(listed_pieces <= kMaxTransferPieces, "the transfer plan of ",
                                    num_tokens, " tokens would list more than ", kMaxTransferPieces,
                                    " pieces (a piece per block of each message): use larger "
                                    "blocks, fewer tokens or fewer layer groups "
                                    "(--layers-per-message)");
                            Demand t = dm;
                            t.pieces = &pcs;
                            for (const auto& p : pcs) t.tokens += p.count;
                            demands[{k, axis, stage, cs, hg}].push_back(t);
                        }
                    }
                }
            }
        }
    }

    std::map<std::tuple<int, int, int, int>, TransferMessage>
        by_key;  // (layer group, kv group, src, dst)
    for (const auto& [key, list] : demands) {
        const auto [k, axis, stage, cs, hg] = key;
        const TransferGroup& g = plan.groups[k];
        const int n = !g.holds_state() ? g.num_heads : axis == 0 ? g.state_heads : g.state_keys;
        const HeadSplit hs = head_split(n, ps.tp, g.kind == LayerKind::kMla);
        const std::vector<CopyShare> shares = choose_copies(list, hs.replication);
        for (const CopyShare& share : shares) {
            const Demand& dm = list[share.demand];
            const int s_rank = rank_of(ps, src.dp, stage, cs, hg * hs.replication + share.copy);
            const std::vector<TransferPiece> pcs =
                dm.pieces ? slice_pieces(*dm.pieces, share.token_begin, share.token_end)
                          : std::vector<TransferPiece>{};
            const int64_t tokens = dm.pieces ? share.token_end - share.token_begin : 0;
            // The group's layers of the demand, cut by layer group.
            auto first = std::lower_bound(g.layers.begin(), g.layers.end(), dm.layer_begin);
            auto last = std::lower_bound(g.layers.begin(), g.layers.end(), dm.layer_end);
            for (auto it = first; it != last;) {
                const int group = lpg == 0 ? 0 : *it / lpg;
                auto end = it;
                while (end != last && (lpg == 0 || *end / lpg == group)) ++end;
                const int nl = static_cast<int>(end - it);
                const int heads = dm.head_end - dm.head_begin;
                const int64_t bytes =
                    g.holds_state() ? int64_t{nl} * heads * dm.unit
                                    : int64_t{nl} * g.kv_factor * heads * tokens * g.vector_bytes;
                const auto mkey = std::make_tuple(group, k, s_rank, dm.dst_rank);
                auto found = by_key.find(mkey);
                if (found == by_key.end()) {
                    TransferMessage msg;
                    msg.src_rank = s_rank;
                    msg.dst_rank = dm.dst_rank;
                    msg.layer_group = group;
                    msg.kv_group = k;
                    msg.layer_begin = *it;
                    msg.layer_end = *(end - 1) + 1;
                    msg.pieces = pcs;
                    msg.num_tokens = tokens;
                    found = by_key.emplace(mkey, std::move(msg)).first;
                } else {
                    KVSHARD_CHECK(g.holds_state() && axis == 1,
                                  "two messages for one (group, source, destination)");
                }
                TransferMessage& msg = found->second;
                if (axis == 0) {
                    msg.head_begin = dm.head_begin;
                    msg.head_end = dm.head_end;
                } else {
                    msg.key_begin = dm.head_begin;
                    msg.key_end = dm.head_end;
                }
                msg.bytes += bytes;
                it = end;
            }
        }
    }
    for (auto& [key, msg] : by_key) {
        plan.bytes += msg.bytes;
        plan.messages.push_back(std::move(msg));
    }
    return plan;
}

std::vector<TransferGroupTotals> group_totals(const TransferPlan& plan) {
    std::vector<TransferGroupTotals> out(plan.groups.size());
    for (const TransferMessage& msg : plan.messages) {
        ++out.at(msg.kv_group).messages;
        out[msg.kv_group].bytes += msg.bytes;
    }
    return out;
}

std::string to_json(const TransferPlan& plan, bool with_messages) {
    std::map<std::pair<int, int>, std::pair<int64_t, int>> pairs;
    for (const auto& msg : plan.messages) {
        auto& p = pairs[{msg.src_rank, msg.dst_rank}];
        p.first += msg.bytes;
        p.second += 1;
    }
    nlohmann::json jp = nlohmann::json::array();
    for (const auto& [k, v] : pairs)
        jp.push_back(
            {{"src", k.first}, {"dst", k.second}, {"bytes", v.first}, {"messages", v.second}});
    auto side = [](const TransferEndpoint& e) {
        return nlohmann::json{{"parallel", e.layout.parallel.to_string()},
                              {"dp", e.dp},
                              {"world_size", e.layout.world_size()},
                              {"block_size", e.block_size},
                              {"page_order", e.order == PageOrder::kHnd ? "HND" : "NHD"}};
    };
    nlohmann::json j = {{"model", plan.src.layout.model.name},
                        {"from", side(plan.src)},
                        {"to", side(plan.dst)},
                        {"tokens", plan.num_tokens},
                        {"layer_groups", plan.num_layer_groups},
                        {"messages", plan.messages.size()},
                        {"bytes", plan.bytes},
                        {"min_bytes", plan.min_bytes},
                        {"tail_bytes", tail_bytes(plan)},
                        {"dst_cached_tokens", plan.options.dst_cached_tokens},
                        {"pairs", jp}};
    nlohmann::json jg = nlohmann::json::array();
    const std::vector<TransferGroupTotals> totals = group_totals(plan);
    for (size_t k = 0; k < plan.groups.size(); ++k) {
        const TransferGroup& g = plan.groups[k];
        jg.push_back({{"group", k},
                      {"kind", layer_kind_name(g.kind)},
                      {"window", g.window > 0 ? nlohmann::json(g.window) : nlohmann::json(nullptr)},
                      {"layers", g.layers.size()},
                      {"first_kept",
                       g.holds_state() ? nlohmann::json(nullptr) : nlohmann::json(g.first_kept)},
                      {"messages", totals[k].messages},
                      {"bytes", totals[k].bytes}});
    }
    j["kv_groups"] = jg;
    if (with_messages) {
        nlohmann::json jm = nlohmann::json::array();
        for (const auto& msg : plan.messages) {
            jm.push_back({{"src", msg.src_rank},
                          {"dst", msg.dst_rank},
                          {"layer_group", msg.layer_group},
                          {"kv_group", msg.kv_group},
                          {"layers", {msg.layer_begin, msg.layer_end}},
                          {"heads", {msg.head_begin, msg.head_end}},
                          {"keys", {msg.key_begin, msg.key_end}},
                          {"tokens", msg.num_tokens},
                          {"pieces", msg.pieces.size()},
                          {"bytes", msg.bytes}});
        }
        j["message_list"] = jm;
    }
    return j.dump(2);
}

}  // namespace kvshard
