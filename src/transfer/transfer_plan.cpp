#include "kvshard/transfer/transfer_plan.h"

#include <algorithm>
#include <map>
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
    for (const ModelSpec* m : {&a, &b})
        require(m->uniform(), m->name, " has ", m->layer_mix(),
                ": transfer plans move models whose every layer is full attention (or MLA) of one "
                "shape; per-group plans for sliding, chunked, state and no-KV layers are not built "
                "yet");
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
}

void validate_endpoint(const TransferEndpoint& e, const char* side, int64_t num_tokens) {
    const ParallelConfig& p = e.layout.parallel;
    require(e.layout.world_size() == p.world_size() && !e.layout.ranks.empty(), "the ", side,
            " layout is empty: build it with make_layout");
    require(e.dp >= 0 && e.dp < p.dp, "the ", side, " replica dp=", e.dp,
            " does not exist: valid are 0..", p.dp - 1);
    require(e.block_size >= 1, "the ", side, " block size must be at least 1 token, got ",
            e.block_size);
    require(static_cast<int>(e.block_tables.size()) == p.cp, "the ", side,
            " side needs one block table per CP rank (", p.cp, "), got ", e.block_tables.size());
    for (int c = 0; c < p.cp; ++c) {
        const int64_t held = cp_tokens(p, c, num_tokens).total;
        const int64_t need = (held + e.block_size - 1) / e.block_size;
        require(static_cast<int64_t>(e.block_tables[c].size()) >= need, "the ", side,
                " block table of CP rank ", c, " has ", e.block_tables[c].size(),
                " blocks but its ", held, " tokens need ", need, " blocks of ", e.block_size);
        for (int64_t i = 0; i < need; ++i)
            require(e.block_tables[c][i] >= 0, "the ", side, " block table of CP rank ", c,
                    " holds a negative block id ", e.block_tables[c][i]);
    }
}

// Heads per TP rank and how many TP ranks hold each head group.
struct HeadSplit {
    int per_rank = 1;
    int replication = 1;
    int groups = 1;  // distinct head groups
};

HeadSplit head_split(const KvLayout& l) {
    HeadSplit h;
    h.per_rank = l.kv_heads_per_rank();
    h.replication = l.head_replication();
    h.groups = l.parallel.tp / h.replication;
    return h;
}

// What one destination rank needs from one source head group on one (PP stage, CP rank): layers
// [layer_begin, layer_end) x heads [head_begin, head_end) x the tokens of `pieces`. Any copy of
// the group can send it, or several copies a token range each.
struct Demand {
    int dst_rank = 0;
    int layer_begin = 0, layer_end = 0;
    int head_begin = 0, head_end = 0;
    const std::vector<TransferPiece>* pieces = nullptr;
    int64_t tokens = 0;
    // Head vectors per token (over layers and heads): a demand's load is weight() x tokens.
    int64_t weight() const { return int64_t{layer_end - layer_begin} * (head_end - head_begin); }
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
    require(block_size >= 1, "block size must be at least 1 token, got ", block_size);
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
    PageGeometry g;
    g.num_layers = r.num_layers();
    g.kv_factor = m.is_mla() ? 1 : 2;
    g.num_heads = m.is_mla() ? 1 : r.num_kv_heads();
    g.block_size = block_size;
    g.head_dim = m.is_mla() ? latent_dim(m) : m.head_dim;
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

int64_t needed_bytes(const TransferPlan& plan, int dst_rank) {
    const KvLayout& l = plan.dst.layout;
    const RankKv& r = l.ranks[dst_rank];
    if (r.coord.dp != plan.dst.dp) return 0;
    // The rank's tokens at or after the destination's cached prefix.
    int64_t tokens = 0;
    for (const auto& range : cp_tokens(l.parallel, r.coord.cp, plan.num_tokens).ranges)
        tokens +=
            std::max<int64_t>(0, range.end - std::max(range.begin, plan.options.dst_cached_tokens));
    const int heads = l.model.is_mla() ? 1 : r.num_kv_heads();
    return int64_t{r.num_layers()} * plan.kv_factor * heads * tokens * plan.vector_bytes();
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

    const ModelSpec& m = src.layout.model;
    if (m.kv_dtype == DType::kFp8)
        require(src.block_size == dst.block_size && src.layout.parallel.cp == 1 &&
                    dst.layout.parallel.cp == 1,
                "an fp8 transfer keeps each block's codes and per-block scales: both sides need "
                "the same block size and cp=1, got block sizes ",
                src.block_size, " and ", dst.block_size, ", cp=", src.layout.parallel.cp,
                " and cp=", dst.layout.parallel.cp);
    TransferPlan plan;
    plan.src = src;
    plan.dst = dst;
    plan.num_tokens = num_tokens;
    plan.options = options;
    plan.kv_factor = m.is_mla() ? 1 : 2;
    plan.head_dim = m.is_mla() ? latent_dim(m) : m.head_dim;
    plan.elem_size = static_cast<int64_t>(dtype_size(m.kv_dtype));
    const int lpg = options.layers_per_group;
    plan.num_layer_groups = lpg == 0 ? 1 : (m.num_layers + lpg - 1) / lpg;

    const ParallelConfig& ps = src.layout.parallel;
    const ParallelConfig& pd = dst.layout.parallel;
    const HeadSplit hs = head_split(src.layout);

    std::vector<CpTokens> src_tokens, dst_tokens;
    for (int c = 0; c < ps.cp; ++c) src_tokens.push_back(cp_tokens(ps, c, num_tokens));
    for (int c = 0; c < pd.cp; ++c) dst_tokens.push_back(cp_tokens(pd, c, num_tokens));

    // pieces[cs][cd]: the pieces source CP rank cs sends destination CP rank cd, in token order.
    std::vector<std::vector<std::vector<TransferPiece>>> pieces(
        ps.cp, std::vector<std::vector<TransferPiece>>(pd.cp));
    for (int cs = 0; cs < ps.cp; ++cs) {
        const CpTokens& st = src_tokens[cs];
        for (int cd = 0; cd < pd.cp; ++cd) {
            const CpTokens& dt = dst_tokens[cd];
            size_t i = 0, j = 0;
            while (i < st.ranges.size() && j < dt.ranges.size()) {
                const int64_t a =
                    std::max({st.ranges[i].begin, dt.ranges[j].begin, options.dst_cached_tokens});
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
                        pieces[cs][cd].push_back(p);
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
        }
    }

    // Demands: what one destination rank needs of one source head group on one (PP stage, CP
    // rank). The copies of that group (hs.replication TP ranks) share its demands (choose_copies).
    std::map<std::tuple<int, int, int>, std::vector<Demand>> demands;  // (stage, cs, group)
    const std::vector<int> src_split = pp_layer_split(m, ps);
    std::vector<int> src_stage_begin(ps.pp + 1, 0);
    for (int s = 0; s < ps.pp; ++s) src_stage_begin[s + 1] = src_stage_begin[s] + src_split[s];

    for (const RankKv& d : dst.layout.ranks) {
        if (d.coord.dp != dst.dp) continue;
        const int cd = d.coord.cp;
        const int dh0 = m.is_mla() ? 0 : d.kv_heads.front();
        const int dh1 = m.is_mla() ? 1 : d.kv_heads.back() + 1;
        plan.min_bytes += needed_bytes(plan, d.coord.rank);
        for (int stage = 0; stage < ps.pp; ++stage) {
            const int l0 = std::max(d.layer_begin, src_stage_begin[stage]);
            const int l1 = std::min(d.layer_end, src_stage_begin[stage + 1]);
            if (l0 >= l1) continue;
            for (int g = 0; g < hs.groups; ++g) {
                const int h0 = std::max(dh0, g * hs.per_rank);
                const int h1 = std::min(dh1, (g + 1) * hs.per_rank);
                if (h0 >= h1) continue;
                for (int cs = 0; cs < ps.cp; ++cs) {
                    const auto& pcs = pieces[cs][cd];
                    if (pcs.empty()) continue;
                    Demand dm;
                    dm.dst_rank = d.coord.rank;
                    dm.layer_begin = l0;
                    dm.layer_end = l1;
                    dm.head_begin = h0;
                    dm.head_end = h1;
                    dm.pieces = &pcs;
                    for (const auto& p : pcs) dm.tokens += p.count;
                    demands[{stage, cs, g}].push_back(dm);
                }
            }
        }
    }

    std::map<std::tuple<int, int, int>, TransferMessage> by_key;  // (group, src, dst)
    for (const auto& [key, list] : demands) {
        const auto [stage, cs, g] = key;
        const std::vector<CopyShare> shares = choose_copies(list, hs.replication);
        for (const CopyShare& share : shares) {
            const Demand& dm = list[share.demand];
            const int s_rank = rank_of(ps, src.dp, stage, cs, g * hs.replication + share.copy);
            const std::vector<TransferPiece> pcs =
                slice_pieces(*dm.pieces, share.token_begin, share.token_end);
            const int64_t tokens = share.token_end - share.token_begin;
            for (int la = dm.layer_begin; la < dm.layer_end;) {
                const int group = lpg == 0 ? 0 : la / lpg;
                const int lb = lpg == 0 ? dm.layer_end : std::min(dm.layer_end, (group + 1) * lpg);
                TransferMessage msg;
                msg.src_rank = s_rank;
                msg.dst_rank = dm.dst_rank;
                msg.layer_group = group;
                msg.layer_begin = la;
                msg.layer_end = lb;
                msg.head_begin = dm.head_begin;
                msg.head_end = dm.head_end;
                msg.pieces = pcs;
                msg.num_tokens = tokens;
                msg.bytes = int64_t{lb - la} * plan.kv_factor * (dm.head_end - dm.head_begin) *
                            tokens * plan.vector_bytes();
                auto [it, inserted] =
                    by_key.emplace(std::make_tuple(group, s_rank, dm.dst_rank), std::move(msg));
                KVSHARD_CHECK(inserted, "two messages for one (group, source, destination)");
                la = lb;
            }
        }
    }
    for (auto& [key, msg] : by_key) {
        plan.bytes += msg.bytes;
        plan.messages.push_back(std::move(msg));
    }
    return plan;
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
    if (with_messages) {
        nlohmann::json jm = nlohmann::json::array();
        for (const auto& msg : plan.messages) {
            jm.push_back({{"src", msg.src_rank},
                          {"dst", msg.dst_rank},
                          {"layer_group", msg.layer_group},
                          {"layers", {msg.layer_begin, msg.layer_end}},
                          {"heads", {msg.head_begin, msg.head_end}},
                          {"tokens", msg.num_tokens},
                          {"pieces", msg.pieces.size()},
                          {"bytes", msg.bytes}});
        }
        j["message_list"] = jm;
    }
    return j.dump(2);
}

}  // namespace kvshard
