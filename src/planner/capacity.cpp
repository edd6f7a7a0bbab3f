#include "kvshard/planner/capacity.h"

#include <algorithm>
#include <cstdio>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Tokens CP rank r stores of a sequence of `len` tokens; matches cp_token_ranges (tested) without
// building the range list, which under interleave has len / cp_interleave entries.
int64_t cp_tokens_of_rank(const ParallelConfig& p, int r, int64_t len) {
    auto boundary = [len](int n, int b) { return b * len / n; };
    switch (p.cp_scheme) {
        case CpScheme::kContiguous:
            return boundary(p.cp, r + 1) - boundary(p.cp, r);
        case CpScheme::kZigzag: {
            const int chunks = 2 * p.cp;
            const int second = chunks - 1 - r;
            return boundary(chunks, r + 1) - boundary(chunks, r) + boundary(chunks, second + 1) -
                   boundary(chunks, second);
        }
        case CpScheme::kInterleave: {
            const int64_t unit = p.cp_interleave;
            const int64_t cycle = unit * p.cp;
            const int64_t rem = len % cycle;
            return (len / cycle) * unit + std::clamp<int64_t>(rem - r * unit, 0, unit);
        }
    }
    return 0;
}

}  // namespace

void CapacityOptions::validate() const {
    require(mem_util > 0 && mem_util <= 1, "mem_util must be in (0, 1], got ", mem_util);
    require(activation_reserve_bytes >= 0, "the activation reserve must be >= 0 bytes, got ",
            activation_reserve_bytes);
    require(block_size >= 1, "block_size must be a positive integer, got ", block_size);
    require(context_tokens >= 0, "the context length must be >= 0 tokens, got ", context_tokens);
}

int64_t cp_tokens_per_rank(const ParallelConfig& p, int64_t context_tokens) {
    int64_t most = 0;
    for (int r = 0; r < p.cp; ++r) most = std::max(most, cp_tokens_of_rank(p, r, context_tokens));
    return most;
}

WeightBytes rank_weight_bytes(const KvLayout& layout, int rank) {
    const ModelSpec& m = layout.model;
    const ParallelConfig& p = layout.parallel;
    const RankKv& rk = layout.ranks.at(rank);
    const int64_t h = m.hidden;
    const int64_t tp = p.tp;
    const int64_t q_heads = m.num_heads / p.tp;

    // Elements per layer of attention on this rank.
    int64_t attn = 0;
    int64_t norms_per_layer = 2 * h;  // input and post-attention RMSNorm
    if (m.is_mla()) {
        const MlaSpec& a = m.mla;
        const int64_t qk_dim = int64_t{a.qk_nope_head_dim} + a.qk_rope_head_dim;
        // q_a and kv_a (down-projections) are replicated; q_b, kv_b, o are split by head.
        const int64_t q = a.q_lora_rank > 0
                              ? h * a.q_lora_rank + int64_t{a.q_lora_rank} * q_heads * qk_dim
                              : h * q_heads * qk_dim;
        const int64_t kv_a = h * (int64_t{a.kv_lora_rank} + a.qk_rope_head_dim);
        const int64_t kv_b =
            int64_t{a.kv_lora_rank} * q_heads * (int64_t{a.qk_nope_head_dim} + a.v_head_dim);
        const int64_t o = q_heads * a.v_head_dim * h;
        attn = q + kv_a + kv_b + o;
        norms_per_layer += a.kv_lora_rank + a.q_lora_rank;
    } else {
        const int64_t d = m.head_dim;
        attn = 2 * h * q_heads * d + 2 * h * rk.num_kv_heads() * d;  // Q and O, then K and V
    }

    int dense_layers = 0, moe_layers = 0;
    for (int l = rk.layer_begin; l < rk.layer_end; ++l)
        (m.is_moe_layer(l) ? moe_layers : dense_layers)++;

    WeightBytes w;
    const int64_t e = static_cast<int64_t>(dtype_size(m.weight_dtype));
    w.attention = rk.num_layers() * attn * e;
    w.dense_mlp = dense_layers * (m.dense_mlp_params_per_layer() / tp) * e;
    if (m.moe.enabled()) {
        const int64_t routed = p.ep > 1 ? int64_t{m.moe.num_experts / p.ep} * m.expert_params()
                                        : int64_t{m.moe.num_experts} * m.expert_params() / tp;
        const int64_t shared = int64_t{m.moe.shared_experts} * m.expert_params() / tp;
        const int64_t router = h * m.moe.num_experts;
        w.experts = moe_layers * (routed + shared + router) * e;
    }
    const int64_t vocab_shard = ceil_div(m.vocab, tp) * h;
    const bool first = rk.coord.pp == 0;
    const bool last = rk.coord.pp == p.pp - 1;
    if (first) w.embedding = vocab_shard * e;
    // A tied LM head reuses the embedding only when both live on the same stage.
    if (last && (!m.tie_embeddings || p.pp > 1)) w.lm_head = vocab_shard * e;
    w.norms = (rk.num_layers() * norms_per_layer + (last ? h : 0)) * e;
    return w;
}

CapacityReport compute_capacity(const ModelSpec& m, const ParallelConfig& p, const HardwareSpec& hw,
                                const CapacityOptions& options) {
    options.validate();
    hw.validate();
    const KvLayout layout = make_layout(m, p);
    const int64_t bs = options.block_size;
    const int64_t usable =
        static_cast<int64_t>(static_cast<double>(hw.memory_bytes) * options.mem_util);

    CapacityReport rep;
    rep.ranks.resize(layout.world_size());
    for (int r = 0; r < layout.world_size(); ++r) {
        RankCapacity& rc = rep.ranks[r];
        rc.rank = r;
        rc.weights = rank_weight_bytes(layout, r);
        rc.kv_bytes_per_token = layout.ranks[r].kv_bytes_per_token;
        rc.kv_budget_bytes = usable - rc.weights.total() - options.activation_reserve_bytes;
        rc.kv_tokens = rc.kv_budget_bytes > 0 && rc.kv_bytes_per_token > 0
                           ? rc.kv_budget_bytes / rc.kv_bytes_per_token / bs * bs
                           : 0;
    }
    int lim = 0;
    for (int r = 0; r < layout.world_size(); ++r) {
        if (rep.ranks[r].kv_tokens < rep.ranks[lim].kv_tokens) lim = r;
        rep.weight_bytes_per_gpu = std::max(rep.weight_bytes_per_gpu, rep.ranks[r].weights.total());
    }
    rep.limiting_rank = lim;
    rep.kv_bytes_per_token = rep.ranks[lim].kv_bytes_per_token;
    rep.kv_tokens_per_gpu = rep.ranks[lim].kv_tokens;
    rep.kv_blocks_per_gpu = rep.kv_tokens_per_gpu / bs;

    // Longest L whose busiest CP rank holds at most kv_tokens_per_gpu tokens (the token count on
    // a rank is non-decreasing in L for every scheme). kv_tokens is whole blocks, so a rank holding
    // n <= kv_tokens tokens also has the ceil(n / block_size) blocks it needs.
    const int64_t cap = rep.kv_tokens_per_gpu;
    int64_t lo = 0;
    int64_t hi = (cap + 1) * p.cp * (p.cp_scheme == CpScheme::kInterleave ? p.cp_interleave : 1);
    while (lo < hi) {  // invariant: tokens(lo) <= cap, tokens(hi) > cap or hi untested
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (cp_tokens_per_rank(p, mid) <= cap)
            lo = mid;
        else
            hi = mid - 1;
    }
    rep.max_context = lo;

    if (options.context_tokens > 0) {
        const int64_t blocks_per_request =
            ceil_div(cp_tokens_per_rank(p, options.context_tokens), bs);
        rep.requests_per_replica = rep.kv_blocks_per_gpu / blocks_per_request;
        rep.max_concurrency = rep.requests_per_replica * p.dp;
    }

    const RankCapacity& worst = rep.ranks[lim];
    if (worst.kv_budget_bytes <= 0) {
        char buf[160];
        std::snprintf(buf, sizeof buf,
                      "weights %.1f GiB + reserve %.1f GiB exceed %.1f GiB (%.2f x %.1f GiB)",
                      rep.weight_bytes_per_gpu / kGiB, options.activation_reserve_bytes / kGiB,
                      usable / kGiB, options.mem_util, hw.memory_bytes / kGiB);
        rep.why_not = buf;
    } else if (rep.kv_tokens_per_gpu < bs) {
        rep.why_not =
            detail::concat("less than one KV block of ", bs, " tokens fits on rank ", lim);
    } else if (options.context_tokens > rep.max_context) {
        rep.why_not = detail::concat("a ", options.context_tokens,
                                     "-token context needs more KV than fits (max ",
                                     rep.max_context, " tokens)");
    }
    rep.fits = rep.why_not.empty();
    return rep;
}

}  // namespace kvshard
