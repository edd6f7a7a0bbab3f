#include "kvshard/planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include "kvshard/common/error.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/planner/capacity.h"

namespace kvshard {

double ring_all_reduce_s(double bytes, int n, double bw, double hop_s) {
    if (n <= 1) return 0;
    return 2.0 * (n - 1) / n * bytes / bw + 2.0 * (n - 1) * hop_s;
}

double ring_all_gather_s(double bytes, int n, double bw, double hop_s) {
    if (n <= 1) return 0;
    return double(n - 1) / n * bytes / bw + double(n - 1) * hop_s;
}

double all_to_all_s(double bytes, int n, double bw, double hop_s) {
    if (n <= 1) return 0;
    return double(n - 1) / n * bytes / bw + hop_s;
}

double send_s(double bytes, double bw, double hop_s) { return bytes / bw + hop_s; }

GroupSpan group_span(const ParallelConfig& p, GroupKind g, int gpus_per_node) {
    std::vector<int> members;
    switch (g) {
        case GroupKind::kTp:
            for (int t = 0; t < p.tp; ++t) members.push_back(rank_of(p, 0, 0, 0, t));
            break;
        case GroupKind::kCp:
            for (int c = 0; c < p.cp; ++c) members.push_back(rank_of(p, 0, 0, c, 0));
            break;
        case GroupKind::kPp:
            for (int s = 0; s < p.pp; ++s) members.push_back(rank_of(p, 0, s, 0, 0));
            break;
        case GroupKind::kDp:
            for (int d = 0; d < p.dp; ++d) members.push_back(rank_of(p, d, 0, 0, 0));
            break;
        case GroupKind::kEp:
            // EP group 0 of stage 0: stage-local indices [0, ep), local = (dp*cp + cp)*tp + tp.
            for (int local = 0; local < p.ep && local < p.stage_size(); ++local) {
                const int t = local % p.tp;
                const int c = (local / p.tp) % p.cp;
                const int d = local / (p.tp * p.cp);
                members.push_back(rank_of(p, d, 0, c, t));
            }
            break;
    }
    std::map<int, int> per_node;
    for (int r : members) ++per_node[r / gpus_per_node];
    GroupSpan s;
    s.n = static_cast<int>(members.size());
    s.nodes = static_cast<int>(per_node.size());
    s.per_node = 0;
    for (const auto& [node, count] : per_node) s.per_node = std::max(s.per_node, count);
    return s;
}

bool group_crosses_nodes(const ParallelConfig& p, GroupKind g, int gpus_per_node) {
    return group_span(p, g, gpus_per_node).crosses_nodes();
}

namespace {

// floor(log2 k): the depth of a binary tree over k nodes (NCCL's log2i).
int tree_depth(int k) {
    int d = 0;
    while ((2 << d) <= k) ++d;
    return d;
}

// Seconds per byte a rank sends in a ring across nodes: a share 1/g over its NIC, (g-1)/g over
// NVLink, concurrently; the slower path sets the rate.
double ring_s_per_byte(const GroupSpan& s, const HardwareSpec& hw) {
    const double g = s.per_node;
    return std::max(1.0 / (g * hw.link_bw(true)), (g - 1) / (g * hw.link_bw(false)));
}

// Latency of `steps` ring steps of which `inter` cross nodes (NCCL's tuner, src/graph/tuning.cc:
// nInterSteps = 2(nNodes-1) for an all-reduce, nNodes-1 for an all-gather).
double ring_latency_s(int steps, int inter, const HardwareSpec& hw) {
    return inter * hw.hop_latency_s(true) + (steps - inter) * hw.hop_latency_s(false);
}

}  // namespace

double node_all_reduce_s(double bytes, int n, const HardwareSpec& hw) {
    if (n <= 1) return 0;
    const double bw = hw.link_bw(false);
    double t = std::min(
        ring_all_reduce_s(bytes, n, bw * hw.nvlink_ll_bw_fraction, hw.nvlink_hop_latency_s),
        ring_all_reduce_s(bytes, n, bw, hw.nvlink_simple_hop_latency_s));
    if (hw.nvls_bus_bw > 0 && n == hw.gpus_per_node)
        t = std::min(t, hw.nvls_latency_s + 2.0 * (n - 1) / n * bytes / hw.nvls_bus_bw);
    return t;
}

double node_all_gather_s(double bytes, int n, const HardwareSpec& hw) {
    if (n <= 1) return 0;
    const double bw = hw.link_bw(false);
    return std::min(
        ring_all_gather_s(bytes, n, bw * hw.nvlink_ll_bw_fraction, hw.nvlink_hop_latency_s),
        ring_all_gather_s(bytes, n, bw, hw.nvlink_simple_hop_latency_s));
}

double all_reduce_s(double bytes, const GroupSpan& s, const HardwareSpec& hw) {
    if (s.n <= 1) return 0;
    if (!s.crosses_nodes()) return node_all_reduce_s(bytes, s.n, hw);
    const double n = s.n, g = s.per_node;
    const double ring = ring_latency_s(2 * (s.n - 1), 2 * (s.nodes - 1), hw) +
                        2.0 * (n - 1) / n * bytes * ring_s_per_byte(s, hw);
    const double tree_bw =
        std::max(g > 1 ? 1.0 / hw.link_bw(false) : 0.0, 1.0 / (g * hw.link_bw(true)));
    const double tree = 2 * (g - 1) * hw.hop_latency_s(false) +
                        2.0 * tree_depth(s.nodes) * hw.hop_latency_s(true) + 2 * bytes * tree_bw;
    return std::min(ring, tree);
}

double all_gather_s(double bytes, const GroupSpan& s, const HardwareSpec& hw) {
    if (s.n <= 1) return 0;
    if (!s.crosses_nodes()) return node_all_gather_s(bytes, s.n, hw);
    const double n = s.n;
    return ring_latency_s(s.n - 1, s.nodes - 1, hw) + (n - 1) / n * bytes * ring_s_per_byte(s, hw);
}

double all_to_all_s(double bytes, const GroupSpan& s, const HardwareSpec& hw) {
    if (s.n <= 1) return 0;
    if (!s.crosses_nodes())
        return all_to_all_s(bytes, s.n, hw.link_bw(false), hw.hop_latency_s(false));
    const double n = s.n, g = s.per_node;
    return (g > 1 ? hw.hop_latency_s(false) : 0.0) + hw.hop_latency_s(true) +
           bytes * std::max((g - 1) / n / hw.link_bw(false), (n - g) / n / hw.link_bw(true));
}

int64_t cp_pass_kv_bytes_sent(const KvLayout& layout, int rank, int64_t context_tokens) {
    KVSHARD_CHECK(rank >= 0 && rank < layout.world_size(), "rank ", rank, " outside the layout");
    require(context_tokens >= 0, "context_tokens must be >= 0, got ", context_tokens);
    // The executor's count (layout/cp_plan.h) for the prompt's placement.
    return cp_pass_kv_bytes(layout, rank, cp_prompt_map(layout.parallel, context_tokens)).ring;
}

std::string_view cp_prefill_policy_name(CpPrefillPolicy s) {
    switch (s) {
        case CpPrefillPolicy::kAuto:
            return "auto";
        case CpPrefillPolicy::kPassKv:
            return "pass-kv";
        case CpPrefillPolicy::kPassQ:
            return "pass-q";
    }
    return "?";
}

CpPrefillPolicy parse_cp_prefill_policy(std::string_view s) {
    if (s == "auto") return CpPrefillPolicy::kAuto;
    if (s == "pass-kv") return CpPrefillPolicy::kPassKv;
    if (s == "pass-q") return CpPrefillPolicy::kPassQ;
    throw Error(
        detail::concat("unknown CP prefill scheme '", s, "': expected auto, pass-kv or pass-q"));
}

std::string_view cp_merge_policy_name(CpMergePolicy s) {
    switch (s) {
        case CpMergePolicy::kAuto:
            return "auto";
        case CpMergePolicy::kAllGather:
            return "all-gather";
        case CpMergePolicy::kAllToAll:
            return "all-to-all";
    }
    return "?";
}

CpMergePolicy parse_cp_merge_policy(std::string_view s) {
    if (s == "auto") return CpMergePolicy::kAuto;
    if (s == "all-gather") return CpMergePolicy::kAllGather;
    if (s == "all-to-all") return CpMergePolicy::kAllToAll;
    throw Error(detail::concat("unknown CP decode merge '", s,
                               "': expected auto, all-gather or all-to-all"));
}

void CostOptions::validate() const {
    require(activation_bytes >= 1, "activation_bytes must be positive, got ", activation_bytes);
    require(pp_prefill_chunks >= 0 && pp_prefill_chunks <= kMaxPpPrefillChunks,
            "pp_prefill_chunks must be in [0, ", kMaxPpPrefillChunks, "] (0: one per stage), got ",
            pp_prefill_chunks);
}

void Workload::validate() const {
    require(prompt_tokens >= 1, "the prompt must have at least 1 token, got ", prompt_tokens);
    require(context_tokens >= 1, "the decode context must have at least 1 token, got ",
            context_tokens);
    require(batch >= 1, "the batch must be at least 1 request, got ", batch);
}

namespace {

// Time and traffic of one pass through one pipeline stage on its busiest rank.
struct StageCost {
    double flops = 0, hbm_bytes = 0, compute_s = 0, memory_s = 0, roofline_s = 0, attn_s = 0;
    double tp_bytes = 0, tp_s = 0, ep_bytes = 0, ep_s = 0, cp_bytes = 0, cp_s = 0;
    CpPrefillCost cp_prefill;
    CpDecodeCost cp_decode;
    double total() const { return roofline_s + tp_s + ep_s + cp_s; }
};

struct Links {
    double tp_bw, tp_hop, cp_bw, cp_hop, pp_bw, pp_hop, ep_bw, ep_hop;
    double launch;  // per collective call (HardwareSpec::collective_launch_s)
    // The groups as placed on nodes, for the collectives priced hierarchically across nodes.
    GroupSpan tp, cp, ep;
};

class Model {
  public:
    Model(const ModelSpec& m, const ParallelConfig& p, const HardwareSpec& hw, const CostOptions& o)
        : m_(m), p_(p), hw_(hw), o_(o), layout_(make_layout(m, p)) {
        auto link = [&](GroupKind g, double& bw, double& hop) {
            const bool x = group_crosses_nodes(p, g, hw.gpus_per_node);
            bw = hw.link_bw(x);
            hop = hw.hop_latency_s(x);
        };
        link(GroupKind::kTp, l_.tp_bw, l_.tp_hop);
        link(GroupKind::kCp, l_.cp_bw, l_.cp_hop);
        link(GroupKind::kPp, l_.pp_bw, l_.pp_hop);
        link(GroupKind::kEp, l_.ep_bw, l_.ep_hop);
        l_.tp = group_span(p, GroupKind::kTp, hw.gpus_per_node);
        l_.cp = group_span(p, GroupKind::kCp, hw.gpus_per_node);
        l_.ep = group_span(p, GroupKind::kEp, hw.gpus_per_node);
        l_.ep.n = p.ep;
        l_.launch = hw.collective_launch_s;
        // Per-layer bytes per token (and state bytes per sequence) on the TP rank 0 of its stage.
        layer_kv_.assign(m.num_layers, 0.0);
        layer_state_.assign(m.num_layers, 0.0);
        for (int s = 0; s < p.pp; ++s)
            for (const RankKvGroup& g : layout_.ranks[rank_of(p, 0, s, 0, 0)].groups)
                for (int l : g.layers) {
                    const double n = double(g.layers.size());
                    layer_kv_[l] = double(g.bytes_per_token) / n;
                    layer_state_[l] = double(g.state_bytes_per_sequence) / n;
                }
        // Bytes per weight of each part: the override (--weight-dtype), else the checkpoint's
        // storage (quantized parts at their bits, the rest at its dtype).
        const WeightPartBits pb = weight_part_bits(m, weight_bits(m, o.weight_dtype));
        we_attn_ = pb.attention / 8;
        we_mlp_ = pb.dense_mlp / 8;
        we_exp_ = pb.experts / 8;
        flops_ = hw.achieved_flops(pb.fp8_matmuls ? DType::kFp8 : DType::kBf16);
        // Attention's QK^T and PV multiply the queries with the cached K and V: fp8 operands, so
        // the fp8 rate, only when the KV cache is fp8, whatever the weights. A state layer's
        // recurrence runs on bf16 activations and its state.
        attn_flops_ = hw.achieved_flops(m.kv_dtype == DType::kFp8 ? DType::kFp8 : DType::kBf16);
        state_flops_ = hw.achieved_flops(DType::kBf16);
        indexer_flops_ = hw.achieved_flops(m.indexer.dtype);  // DeepGEMM's fp8 MQA logits
        hbm_ = hw.achieved_hbm_bw();
        we_ = pb.base / 8;
    }

    const KvLayout& layout() const { return layout_; }
    const Links& links() const { return l_; }

    // Elements of layer l's attention (or state mixer) projections on one rank, with the
    // indexer's (replicated, as capacity counts them) where the layer has one.
    double attn_elems(int l) const {
        const LayerSpec ls = m_.layer(l);
        const IndexerSpec& ix = m_.indexer;
        const double indexer = has_indexer(l)
                                   ? double(m_.mla.q_lora_rank) * ix.heads * ix.head_dim +
                                         double(m_.hidden) * ix.head_dim + 2.0 * ix.head_dim +
                                         double(m_.hidden) * ix.heads
                                   : 0.0;
        return mixer_elems(ls, l) + indexer;
    }
    double mixer_elems(const LayerSpec& ls, int l) const {
        const double h = m_.hidden, qh = double(m_.num_heads) / p_.tp;
        if (holds_state(ls.kind)) return double(m_.mixer_params_of_layer(l)) / p_.tp;
        if (ls.kind == LayerKind::kNoKv) return 0;
        if (ls.kind == LayerKind::kMla) {
            const MlaSpec& a = m_.mla;
            const double qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
            const double q =
                a.q_lora_rank > 0 ? h * a.q_lora_rank + a.q_lora_rank * qh * qk : h * qh * qk;
            return q + h * (a.kv_lora_rank + a.qk_rope_head_dim) +
                   a.kv_lora_rank * qh * (a.qk_nope_head_dim + a.v_head_dim) +
                   qh * a.v_head_dim * h;
        }
        const double kv_local = std::max(1, ls.num_kv_heads / p_.tp);
        const double q_gate = m_.norms.attention_output_gate ? h * qh * ls.head_dim : 0.0;
        return 2 * h * qh * ls.head_dim + 2 * h * kv_local * ls.head_dim + q_gate;
    }
    // Query-key pairs per query head of causal attention over S tokens in layer l (continuous
    // form, the integral of the keys a query sees, so without the diagonal's S/2 of the exact
    // count cp_prompt_attention_pairs takes): full S^2/2, sliding window W: S*W - W^2/2 once
    // S > W, chunked C: floor(S/C) whole chunks of C^2/2 and the last r = S mod C tokens' r^2/2;
    // 0 for layers without attention.
    double attn_pairs(int l, double S) const {
        const LayerSpec ls = m_.layer(l);
        if (!holds_tokens(ls.kind)) return 0;
        const double W = ls.window;
        if (ls.kind == LayerKind::kSlidingWindow && S > W) return S * W - W * W / 2;
        if (ls.kind == LayerKind::kChunkedLocal && S > W) {
            const double chunks = std::floor(S / W), r = S - chunks * W;
            return chunks * W * W / 2 + r * r / 2;
        }
        return S * S / 2;
    }
    // Keys the last token of a C-token context attends to in layer l.
    double attended(int l, double C) const {
        const LayerSpec ls = m_.layer(l);
        if (!holds_tokens(ls.kind)) return 0;
        const auto len = static_cast<int64_t>(C);
        return double(len - first_kept_position(ls.kind, ls.window, len));
    }
    double qk_dim(int l) const {
        return m_.is_mla() ? m_.mla.qk_nope_head_dim + m_.mla.qk_rope_head_dim
                           : m_.layer(l).head_dim;
    }
    double v_dim(int l) const { return m_.is_mla() ? m_.mla.v_head_dim : m_.layer(l).head_dim; }
    // Multiply-adds per recurrent-state element and token (GDN / Mamba-2 state update and read).
    static constexpr double kStateFlopsPerElem = 4;
    // Elements of a state mixer's out-projection on one rank (GDN: value heads x v_head_dim to
    // hidden; Mamba-2: heads x head_dim to hidden), split by tp like the heads.
    double state_out_elems() const {
        return double(m_.state.heads) * m_.state.head_dim * m_.hidden / p_.tp;
    }
    double state_elems(int l) const {
        return holds_state(m_.layer(l).kind) ? double(std::max(1, m_.state.heads / p_.tp)) *
                                                   m_.state.head_dim * m_.state.group_dim
                                             : 0;
    }
    double q_heads() const { return double(m_.num_heads) / p_.tp; }
    // DeepSeek-V3.2's sparse attention (DSA): the indexer scores every key of the context with its
    // own small heads (fp8 keys, replicated over TP: one key head shared by all) and the layer's
    // attention reads only the top-k keys it picks per query.
    bool has_indexer(int l) const {
        const LayerSpec ls = m_.layer(l);
        return ls.indexer && m_.indexer.enabled() && holds_tokens(ls.kind);
    }
    // Cached indexer bytes per token (the key and its scale), part of layer_kv_.
    double indexer_key_bytes() const {
        return double(m_.indexer.head_dim) * double(dtype_size(m_.indexer.dtype)) +
               m_.indexer.scale_bytes;
    }
    // FLOPs of the indexer's scores of `pairs` (query, key) pairs: every indexer head's dot
    // product over head_dim.
    double indexer_flops(double pairs) const {
        return 2 * pairs * m_.indexer.heads * double(m_.indexer.head_dim);
    }
    // Top-k keys a query attends to in an indexer layer (0: all).
    double sparse_topk(int l) const {
        return has_indexer(l) && m_.indexer.topk > 0 ? double(m_.indexer.topk) : 0.0;
    }
    // Share of the routed experts that at least one of `tokens` tokens picks (uniform top-k
    // routing): 1 - (1 - k/E)^tokens.
    double expert_hit(double tokens) const {
        return 1 - std::pow(1 - double(m_.moe.experts_per_token) / m_.moe.num_experts, tokens);
    }
    // TP all-reduces in layer l: one after each block that ends in a row-parallel projection, the
    // mixer (attention's O, a state mixer's out-projection) and the MLP (its down projection),
    // unless EP's combine replaces the MLP's. A Mamba-2 or attention layer without an MLP, or an
    // MLP-only layer, makes one.
    int tp_all_reduces(int l) const {
        const LayerSpec ls = m_.layer(l);
        const bool mixer = ls.kind != LayerKind::kNoKv;
        const bool mlp = ls.mlp != MlpKind::kNone && !(m_.is_moe_layer(l) && p_.ep > 1);
        return int{mixer} + int{mlp};
    }

    // Ring steps {pass-KV, pass-Q} of layer l's CP prefill of a prompt of S tokens: cp for full
    // attention; for a windowed layer the executor's counts over the prompt's placement
    // (cp_prompt_window_ring_steps), remembered per (kind, window, S).
    std::pair<int, int> ring_steps(int l, double S) const {
        const LayerSpec ls = m_.layer(l);
        const bool windowed = ls.window > 0 && (ls.kind == LayerKind::kSlidingWindow ||
                                                ls.kind == LayerKind::kChunkedLocal);
        if (!windowed) return {p_.cp, p_.cp};
        const bool chunked = ls.kind == LayerKind::kChunkedLocal;
        const auto n = static_cast<int64_t>(S);
        const auto key = std::make_tuple(chunked, ls.window, n);
        auto it = ring_steps_.find(key);
        if (it == ring_steps_.end())
            it = ring_steps_.emplace(key, cp_prompt_window_ring_steps(p_, n, chunked, ls.window))
                     .first;
        return it->second;
    }

    // The busiest CP rank's share of layer l's attention pairs for a prompt of S tokens placed
    // by the configuration's scheme (cp_prompt_attention_pairs): 1 / cp when balanced (zigzag,
    // 2 cp dividing S), about (2 cp - 1) / cp^2 for contiguous shards and full attention; 1
    // without CP. Remembered per (kind, window, S).
    double cp_attention_share(int l, double S) const {
        if (p_.cp == 1) return 1.0;
        const LayerSpec ls = m_.layer(l);
        const bool windowed = ls.window > 0 && (ls.kind == LayerKind::kSlidingWindow ||
                                                ls.kind == LayerKind::kChunkedLocal);
        const bool chunked = windowed && ls.kind == LayerKind::kChunkedLocal;
        return cp_share(chunked, windowed ? ls.window : 0, S);
    }
    // The same for a (chunked or sliding) window, or full attention at window 0.
    double cp_share(bool chunked, int window, double S) const {
        if (p_.cp == 1) return 1.0;
        const int64_t n = std::max<int64_t>(1, std::llround(S));
        const auto key = std::make_tuple(chunked, window, n);
        auto it = attention_share_.find(key);
        if (it == attention_share_.end()) {
            const CpAttentionPairs pairs = cp_prompt_attention_pairs(p_, n, chunked, window);
            const double share = pairs.total > 0 ? pairs.busiest / pairs.total : 1.0 / p_.cp;
            it = attention_share_.emplace(key, share).first;
        }
        return it->second;
    }

    // Prefill of the queries [lo, hi) of a sequence of S tokens (T = (hi - lo) / cp on each CP
    // rank) through stage `s`: a pipeline chunk, or the whole prompt (lo = 0, hi = S). Causal
    // attention pairs them with the keys before them, so later chunks cost more. Under CP a
    // chunk is taken at the whole prompt's busiest share and ring steps, its own tokens' shards
    // passed round the ring.
    StageCost prefill_stage(int s, double S, double lo, double hi) const {
        const RankKv& rk = layout_.ranks[rank_of(p_, 0, s, 0, 0)];
        const double T = (hi - lo) / p_.cp;
        const double h = m_.hidden, a = o_.activation_bytes;
        StageCost c;
        for (int l = rk.layer_begin; l < rk.layer_end; ++l) {
            const double kv_layer = layer_kv_[l];
            // Causal attention over the sequence (or its windows), split over tp (heads) and cp
            // (the busiest CP rank's share of the pairs under the prompt's placement): QK^T and PV
            // are pairs * H * d multiply-adds each. State layers: the recurrence over every token.
            // Sparse attention (an indexer layer): query i attends to min(i + 1, topk) keys, the
            // pairs of a sliding window of topk, and the indexer scores all S^2/2 pairs.
            const double topk = sparse_topk(l);
            auto sparse_pairs = [topk](double n) {
                return n > topk ? n * topk - topk * topk / 2 : n * n / 2;
            };
            const double pairs =
                topk > 0 ? (sparse_pairs(hi) - sparse_pairs(lo)) *
                               cp_share(false, static_cast<int>(topk), S)
                         : (attn_pairs(l, hi) - attn_pairs(l, lo)) * cp_attention_share(l, S);
            const double qk_pv_flops = 2 * pairs * q_heads() * (qk_dim(l) + v_dim(l));
            // A state layer under CP runs as the executor does (docs/context-parallel.md §8): its
            // normed input rows are all-gathered over the CP group, and every rank runs the
            // in-projections and the recurrence over all the chunk's rows from the sequence's
            // state, the out-projection over its own rows only.
            const bool cp_state = p_.cp > 1 && holds_state(m_.layer(l).kind);
            const double state_rows = cp_state ? hi - lo : T;
            const double state_flops = 2 * kStateFlopsPerElem * state_rows * state_elems(l);
            const double ix_flops =
                has_indexer(l) ? indexer_flops((hi * hi - lo * lo) / 2 * cp_share(false, 0, S))
                               : 0.0;
            const double attn_s =
                qk_pv_flops / attn_flops_ + state_flops / state_flops_ + ix_flops / indexer_flops_;
            const bool moe = m_.is_moe_layer(l);
            double elems = attn_elems(l);
            double weight_bytes = elems * we_attn_;
            if (moe) {
                const double pe = m_.routed_expert_params(), ps = m_.expert_params();
                const double lat = m_.latent_projection_params();  // replicated (LatentMoE)
                const double E = m_.moe.num_experts, k = m_.moe.experts_per_token;
                elems += (k * pe + m_.moe.shared_experts * ps) / p_.tp + lat + h * E;
                // Experts read: those hit by the tokens routed through the rank's EP group, as in
                // decode (a short prompt touches few of them). The TP ranks of a CP rank hold the
                // same T tokens; the group's other TP groups (CP ranks, DP replicas) T each.
                const double group_tokens =
                    p_.ep > 1 ? T * std::max(1.0, double(p_.ep) / p_.tp) : T;
                weight_bytes +=
                    (expert_hit(group_tokens) *
                         (p_.ep > 1 ? double(m_.moe.num_experts / p_.ep) * pe : E * pe / p_.tp) +
                     m_.moe.shared_experts * ps / p_.tp + lat) *
                        we_exp_ +
                    h * E * we_;
            } else {
                const double mlp = m_.mlp_params_of_layer(l) / double(p_.tp);
                elems += mlp;
                weight_bytes += mlp * we_mlp_;
            }
            // The other ranks' rows of a CP state layer: read, and projected in.
            const double gathered = state_rows - T;
            const double in_proj = cp_state ? attn_elems(l) - state_out_elems() : 0.0;
            const double bytes =
                weight_bytes + T * kv_layer + 2 * T * h * a + gathered * h * a + layer_state_[l];
            add_roofline(c, 2 * T * elems + 2 * gathered * in_proj,
                         qk_pv_flops + state_flops + ix_flops, attn_s, bytes);
            if (cp_state) {
                const double rows_bytes = (hi - lo) * h * a;  // the gathered buffer
                c.cp_bytes += double(p_.cp - 1) / p_.cp * rows_bytes;
                c.cp_s += all_gather_s(rows_bytes, l_.cp, hw_) + l_.launch;
            }

            const double ar = T * h * a;
            const int n_ar = tp_all_reduces(l);
            if (p_.tp > 1) {
                c.tp_bytes += n_ar * 2.0 * (p_.tp - 1) / p_.tp * ar;
                c.tp_s += n_ar * (all_reduce_s(ar, l_.tp, hw_) + l_.launch);
            }
            if (moe && p_.ep > 1) add_ep(c, T / p_.tp);
            if (p_.cp > 1 && holds_tokens(m_.layer(l).kind)) {
                // The ring steps the executor runs (cp for full attention; a windowed layer's
                // stop once no query's window reaches further, layout/cp_plan.h): per step one
                // shard's transfer against that step's share of the attention compute. Pass-Q
                // returns the partials of the steps it ran.
                const auto [kv_steps, q_steps] = ring_steps(l, S);
                const double kv_step = T * kv_layer;
                const double kv_send = send_s(kv_step, l_.cp_bw, l_.cp_hop) + l_.launch;
                const double kv_exposed =
                    (kv_steps - 1) * std::max(0.0, kv_send - attn_s / kv_steps);
                const double q_step = T * q_heads() * qk_dim(l) * a;
                const double q_send = send_s(q_step, l_.cp_bw, l_.cp_hop) + l_.launch;
                const double part = T * q_heads() * (v_dim(l) + 1) * 4.0;  // fp32 partial O, LSE
                // The all-to-all sends (q_steps - 1) partials: a buffer of cp * part scaled so.
                const double returned = double(q_steps - 1) / (p_.cp - 1);
                const double q_a2a =
                    q_steps > 1 ? all_to_all_s(p_.cp * part * returned, l_.cp, hw_) + l_.launch
                                : 0.0;
                const double q_exposed =
                    (q_steps - 1) * std::max(0.0, q_send - attn_s / q_steps) + q_a2a;
                auto& cpp = c.cp_prefill;
                cpp.pass_kv_bytes += (kv_steps - 1) * kv_step;
                cpp.pass_kv_s += (kv_steps - 1) * kv_send;
                cpp.pass_kv_hidden = kv_send <= attn_s / kv_steps;
                cpp.pass_q_bytes += (q_steps - 1) * (q_step + part);
                cpp.pass_q_s += q_exposed;
                const bool use_q =
                    o_.cp_prefill == CpPrefillPolicy::kPassQ ||
                    (o_.cp_prefill == CpPrefillPolicy::kAuto && q_exposed < kv_exposed);
                cpp.chosen = use_q ? CpPrefillPolicy::kPassQ : CpPrefillPolicy::kPassKv;
                c.cp_bytes += use_q ? (q_steps - 1) * (q_step + part) : (kv_steps - 1) * kv_step;
                c.cp_s += use_q ? q_exposed : kv_exposed;
            }
        }
        // The logits of the prompt's last token (the first output token).
        if (s == p_.pp - 1 && hi >= S) add_lm_head(c, 1);
        return c;
    }

    // One decode step of B requests (one new token each) at context C through stage `s`.
    // Keys the newest token sees in layer l on the busiest CP rank at context C (prompt S): the
    // rank's share for full attention, the placement's count for a windowed layer (whose window
    // may lie on one rank), cp_decode_busiest_keys. Remembered per (kind, window, S, C).
    double decode_keys(int l, double S, double C) const {
        const double all = attended(l, C);
        if (p_.cp == 1 || all <= 0) return all;
        const LayerSpec ls = m_.layer(l);
        const auto len = static_cast<int64_t>(C);
        const int64_t first = first_kept_position(ls.kind, ls.window, len);
        if (first == 0) return all / p_.cp;
        const int64_t prompt = std::clamp<int64_t>(std::llround(S), 0, len);
        const auto key = std::make_tuple(static_cast<int>(ls.kind), ls.window, prompt, len);
        auto it = decode_keys_.find(key);
        if (it == decode_keys_.end())
            it = decode_keys_
                     .emplace(key, double(cp_decode_busiest_keys(p_, prompt, len,
                                                                 kDecodeBlockTokens, first)))
                     .first;
        return it->second;
    }
    // The generated tokens' placement unit outside the interleave scheme: the engines' KV block
    // (capacity's default block of 16 tokens).
    static constexpr int kDecodeBlockTokens = 16;

    StageCost decode_stage(int s, double B, double S, double C) const {
        const RankKv& rk = layout_.ranks[rank_of(p_, 0, s, 0, 0)];
        const double h = m_.hidden, a = o_.activation_bytes;
        StageCost c;
        for (int l = rk.layer_begin; l < rk.layer_end; ++l) {
            const double kv_layer = layer_kv_[l];
            // Attention over the busiest CP rank's share of the keys the new token sees (the
            // window for windowed layers, which may lie on one rank), for its query heads. MLA
            // decodes in the absorbed form: q . latent over kv_lora_rank + rope, then p . latent
            // over kv_lora_rank. State layers read and write their state once per token.
            // Sparse attention (an indexer layer): the indexer scores the rank's Cl keys and reads
            // their indexer keys; attention reads the latents of the top-k picked, taken as spread
            // over the CP ranks like the context.
            const double Cl = decode_keys(l, S, C);
            const double topk = sparse_topk(l), all = attended(l, C);
            const double picked = topk > 0 && all > topk ? Cl * topk / all : Cl;
            const double ix_key = has_indexer(l) ? indexer_key_bytes() : 0.0;
            const double ix_flops = has_indexer(l) ? indexer_flops(B * Cl) : 0.0;
            const double per_key = m_.is_mla() ? 2.0 * m_.mla.kv_lora_rank + m_.mla.qk_rope_head_dim
                                               : qk_dim(l) + v_dim(l);
            const double qk_pv_flops = 2 * B * picked * q_heads() * per_key;
            const double state_flops = 2 * kStateFlopsPerElem * B * state_elems(l);
            const bool moe = m_.is_moe_layer(l);
            double elems = attn_elems(l);
            double weight_bytes = elems * we_attn_;
            if (moe) {
                const double pe = m_.routed_expert_params(), ps = m_.expert_params();
                const double lat = m_.latent_projection_params();  // replicated (LatentMoE)
                const double E = m_.moe.num_experts, k = m_.moe.experts_per_token;
                elems += (k * pe + m_.moe.shared_experts * ps) / p_.tp + lat + h * E;
                // Experts read this step: each is hit by at least one of the group's tokens with
                // probability 1 - (1 - k/E)^tokens (uniform routing).
                const double group_tokens =
                    p_.ep > 1 ? B * std::max(1.0, double(p_.ep) / (p_.cp * p_.tp)) : B;
                const double local =
                    p_.ep > 1 ? double(m_.moe.num_experts / p_.ep) * pe : E * pe / p_.tp;
                weight_bytes +=
                    (expert_hit(group_tokens) * local + m_.moe.shared_experts * ps / p_.tp + lat) *
                        we_exp_ +
                    h * E * we_;
            } else {
                const double mlp = m_.mlp_params_of_layer(l) / double(p_.tp);
                elems += mlp;
                weight_bytes += mlp * we_mlp_;
            }
            const double bytes = weight_bytes + B * picked * (kv_layer - ix_key) + B * Cl * ix_key +
                                 B * kv_layer / p_.cp + 2 * B * layer_state_[l];
            add_roofline(
                c, 2 * B * elems, qk_pv_flops + state_flops + ix_flops,
                qk_pv_flops / attn_flops_ + state_flops / state_flops_ + ix_flops / indexer_flops_,
                bytes);

            const double ar = B * h * a;
            const int n_ar = tp_all_reduces(l);
            if (p_.tp > 1) {
                c.tp_bytes += n_ar * 2.0 * (p_.tp - 1) / p_.tp * ar;
                c.tp_s += n_ar * (all_reduce_s(ar, l_.tp, hw_) + l_.launch);
            }
            if (moe && p_.ep > 1) add_ep(c, B / (p_.tp * p_.cp));
            if (p_.cp > 1 && holds_tokens(m_.layer(l).kind)) {
                // Partial outputs of the rank's query heads and their fp32 LSE.
                const double part = B * q_heads() * (v_dim(l) + 1) * 4.0;  // fp32 partial O, LSE
                const double merged = B * q_heads() * v_dim(l) * a;
                auto& d = c.cp_decode;
                const double ag_s = all_gather_s(p_.cp * part, l_.cp, hw_) + l_.launch;
                const double ag_b = double(p_.cp - 1) * part;
                const double aa_s = all_to_all_s(part, l_.cp, hw_) +
                                    all_gather_s(merged, l_.cp, hw_) + 2 * l_.launch;
                const double aa_b = double(p_.cp - 1) / p_.cp * (part + merged);
                d.all_gather_s += ag_s;
                d.all_gather_bytes += ag_b;
                d.all_to_all_s += aa_s;
                d.all_to_all_bytes += aa_b;
                const bool use_aa = o_.cp_decode_merge == CpMergePolicy::kAllToAll ||
                                    (o_.cp_decode_merge == CpMergePolicy::kAuto && aa_s < ag_s);
                d.chosen = use_aa ? CpMergePolicy::kAllToAll : CpMergePolicy::kAllGather;
                c.cp_bytes += use_aa ? aa_b : ag_b;
                c.cp_s += use_aa ? aa_s : ag_s;
            }
        }
        if (s == p_.pp - 1) add_lm_head(c, B);
        return c;
    }

    double handoff_bytes(double tokens) const { return tokens * m_.hidden * o_.activation_bytes; }

  private:
    // A layer's roofline: `linear_flops` (projections, MLP, experts) at the weights' rate, the
    // attention / state core's `attn_flops` taking `attn_s` (at its operands' rates).
    void add_roofline(StageCost& c, double linear_flops, double attn_flops, double attn_s,
                      double bytes) const {
        const double cs = linear_flops / flops_ + attn_s, ms = bytes / hbm_;
        c.flops += linear_flops + attn_flops;
        c.hbm_bytes += bytes;
        c.compute_s += cs;
        c.memory_s += ms;
        c.roofline_s += std::max(cs, ms);
        c.attn_s += attn_s;
    }
    // The LM head on the last stage: `tokens` rows through its vocab-parallel shard of
    // ceil(V / tp) x h weights (tied or not, it is a matmul), read once.
    void add_lm_head(StageCost& c, double tokens) const {
        const double elems = double((int64_t{m_.vocab} + p_.tp - 1) / p_.tp) * double(m_.hidden);
        add_roofline(c, 2 * tokens * elems, 0, 0, elems * we_);
    }
    // MoE dispatch and combine: each rank sends its `tokens` x top-k hidden vectors and gets them
    // back.
    void add_ep(StageCost& c, double tokens) const {
        const double buf = tokens * m_.moe.experts_per_token * m_.hidden * o_.activation_bytes;
        c.ep_bytes += 2 * double(p_.ep - 1) / p_.ep * buf;
        c.ep_s += 2 * (all_to_all_s(buf, l_.ep, hw_) + l_.launch);
    }

    const ModelSpec& m_;
    const ParallelConfig& p_;
    const HardwareSpec& hw_;
    const CostOptions& o_;
    KvLayout layout_;
    std::vector<double> layer_kv_, layer_state_;  // per layer, on TP rank 0 of its stage
    mutable std::map<std::tuple<bool, int, int64_t>, std::pair<int, int>> ring_steps_;
    mutable std::map<std::tuple<bool, int, int64_t>, double> attention_share_;
    mutable std::map<std::tuple<int, int, int64_t, int64_t>, double> decode_keys_;
    Links l_{};
    double flops_ = 0, attn_flops_ = 0, state_flops_ = 0, indexer_flops_ = 0, hbm_ = 0;
    // Bytes per weight: the unquantized parts (router, embedding, LM head), attention, dense MLP,
    // experts.
    double we_ = 0, we_attn_ = 0, we_mlp_ = 0, we_exp_ = 0;
};

// A stage's work over the prefill chunks: FLOPs, bytes and times add up; the CP ring is hidden when
// it is in every chunk, and takes the last chunk's choice.
void add_chunk(StageCost& whole, const StageCost& c) {
    whole.flops += c.flops;
    whole.hbm_bytes += c.hbm_bytes;
    whole.compute_s += c.compute_s;
    whole.memory_s += c.memory_s;
    whole.roofline_s += c.roofline_s;
    whole.attn_s += c.attn_s;
    whole.tp_bytes += c.tp_bytes;
    whole.tp_s += c.tp_s;
    whole.ep_bytes += c.ep_bytes;
    whole.ep_s += c.ep_s;
    whole.cp_bytes += c.cp_bytes;
    whole.cp_s += c.cp_s;
    CpPrefillCost& w = whole.cp_prefill;
    w.pass_kv_bytes += c.cp_prefill.pass_kv_bytes;
    w.pass_kv_s += c.cp_prefill.pass_kv_s;
    w.pass_kv_hidden = w.pass_kv_hidden && c.cp_prefill.pass_kv_hidden;
    w.pass_q_bytes += c.cp_prefill.pass_q_bytes;
    w.pass_q_s += c.cp_prefill.pass_q_s;
    w.chosen = c.cp_prefill.chosen;
}

// Times add up along the path through the stages; per-GPU quantities (FLOPs, bytes) are those of
// the busiest stage's GPU. `times`: how often the stage runs the computed pass in the phase.
void accumulate(PhaseCost& ph, const StageCost& s, double times) {
    ph.flops = std::max(ph.flops, times * s.flops);
    ph.hbm_bytes = std::max(ph.hbm_bytes, times * s.hbm_bytes);
    ph.tp_bytes = std::max(ph.tp_bytes, times * s.tp_bytes);
    ph.ep_bytes = std::max(ph.ep_bytes, times * s.ep_bytes);
    ph.cp_bytes = std::max(ph.cp_bytes, times * s.cp_bytes);
    ph.compute_s += s.compute_s;
    ph.memory_s += s.memory_s;
    ph.roofline_s += s.roofline_s;
    ph.attention_compute_s += s.attn_s;
    ph.tp_s += s.tp_s;
    ph.ep_s += s.ep_s;
    ph.cp_s += s.cp_s;
}

}  // namespace

CostReport estimate_cost(const ModelSpec& m, const ParallelConfig& p, const HardwareSpec& hw,
                         const Workload& w, const CostOptions& o) {
    w.validate();
    o.validate();
    hw.validate();
    Model model(m, p, hw, o);
    const Links& l = model.links();
    CostReport rep;

    // ---- prefill: one request of S tokens, split into m chunks pipelined through the stages ----
    // Chunk i holds the queries [i S/m, (i+1) S/m): under causal attention it pairs them with
    // (2i + 1) / m^2 of the prompt's pairs, so later chunks take longer. The schedule: a chunk
    // enters stage s when it has left stage s - 1 (and crossed the boundary) and stage s has
    // finished the chunk before it (GPipe's forward, Huang et al. arXiv:1811.06965).
    const double S = static_cast<double>(w.prompt_tokens);
    const int chunks = p.pp == 1 ? 1 : o.pp_prefill_chunks > 0 ? o.pp_prefill_chunks : p.pp;
    const double chunk_tokens = S / p.cp / chunks;
    const double hand_off = send_s(model.handoff_bytes(chunk_tokens), l.pp_bw, l.pp_hop) + l.launch;
    std::vector<double> left(chunks, 0.0);  // when each chunk left the previous stage
    double busiest_stage = 0;
    for (int s = 0; s < p.pp; ++s) {
        StageCost whole;  // the stage's work over all chunks
        whole.cp_prefill.pass_kv_hidden = true;
        double stage_s = 0, free_at = 0;
        for (int i = 0; i < chunks; ++i) {
            const StageCost sc = model.prefill_stage(s, S, S * i / chunks, S * (i + 1) / chunks);
            add_chunk(whole, sc);
            const double start = std::max(left[i] + (s > 0 ? hand_off : 0.0), free_at);
            left[i] = free_at = start + sc.total();
            stage_s += sc.total();
        }
        busiest_stage = std::max(busiest_stage, stage_s);
        accumulate(rep.prefill, whole, 1.0);
        rep.cp_prefill.pass_kv_bytes =
            std::max(rep.cp_prefill.pass_kv_bytes, whole.cp_prefill.pass_kv_bytes);
        rep.cp_prefill.pass_kv_s += whole.cp_prefill.pass_kv_s;
        rep.cp_prefill.pass_q_bytes =
            std::max(rep.cp_prefill.pass_q_bytes, whole.cp_prefill.pass_q_bytes);
        rep.cp_prefill.pass_q_s += whole.cp_prefill.pass_q_s;
        rep.cp_prefill.chosen = whole.cp_prefill.chosen;
        rep.cp_prefill.pass_kv_hidden = whole.cp_prefill.pass_kv_hidden;
    }
    // Each chunk crosses the pp-1 boundaries; the last chunk's hand-offs are on the critical path.
    rep.prefill.pp_bytes = p.pp > 1 ? chunks * model.handoff_bytes(chunk_tokens) : 0;
    rep.prefill.pp_s = (p.pp - 1) * hand_off;
    rep.prefill.total_s = left.back();
    // The busiest stage's idle time on the path (pp-1 of its chunk times with equal ones).
    rep.prefill.pp_bubble_s = rep.prefill.total_s - rep.prefill.pp_s - busiest_stage;

    // ---- decode: B requests split into min(pp, B) micro-batches, each crossing every stage ----
    const double B = static_cast<double>(w.batch);
    const double C = static_cast<double>(w.context_tokens);
    const double micro = std::min<double>(p.pp, B);
    double decode_path = 0, decode_max_stage = 0;
    for (int s = 0; s < p.pp; ++s) {
        const StageCost sc = model.decode_stage(s, B / micro, S, C);
        accumulate(rep.decode, sc, micro);  // per step, every stage runs `micro` micro-batches
        decode_path += sc.total();
        decode_max_stage = std::max(decode_max_stage, sc.total());
        rep.cp_decode.all_gather_bytes =
            std::max(rep.cp_decode.all_gather_bytes, micro * sc.cp_decode.all_gather_bytes);
        rep.cp_decode.all_gather_s += sc.cp_decode.all_gather_s;
        rep.cp_decode.all_to_all_bytes =
            std::max(rep.cp_decode.all_to_all_bytes, micro * sc.cp_decode.all_to_all_bytes);
        rep.cp_decode.all_to_all_s += sc.cp_decode.all_to_all_s;
        rep.cp_decode.chosen = sc.cp_decode.chosen;
    }
    const double mb_handoff = model.handoff_bytes(B / micro);
    rep.decode.pp_bytes = p.pp > 1 ? micro * mb_handoff : 0;
    rep.decode.pp_s = (p.pp - 1) * (send_s(mb_handoff, l.pp_bw, l.pp_hop) + l.launch);
    // A micro-batch's next step starts when it has crossed every stage and when the slowest
    // stage has run the other micro-batches: max(path, micro x slowest stage).
    rep.decode.total_s = std::max(decode_path + rep.decode.pp_s, micro * decode_max_stage);
    rep.decode_micro_batches = static_cast<int>(micro);
    rep.decode_slowest_stage_bound = micro * decode_max_stage > decode_path + rep.decode.pp_s;
    rep.decode.pp_bubble_s = rep.decode.total_s * (p.pp - micro) / p.pp;
    rep.ttft_s = rep.prefill.total_s;
    rep.tpot_s = rep.decode.total_s;
    rep.decode_tokens_per_s = p.dp * B / rep.tpot_s;
    rep.ep_link_share_for_kv = p.ep > 1 ? std::max(0.0, 1 - rep.decode.ep_s / rep.tpot_s) : 1.0;
    return rep;
}

}  // namespace kvshard
