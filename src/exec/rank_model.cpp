#include "kvshard/exec/rank_model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "exec/collectives.h"
#include "kvshard/common/error.h"

namespace kvshard {
namespace {

// y[n][out] = x[n][in] W^T, W: [out][in] (nn.Linear).
void linear(const float* x, int64_t n, int64_t in, const std::vector<float>& w, int64_t out,
            float* y) {
    if (n == 0 || out == 0) return;
    KVSHARD_CHECK(int64_t(w.size()) == in * out, "weight of ", w.size(), " elements, expected ", in,
                  "x", out);
    if (n == 1) {  // one row (decode of one sequence): a matrix-vector product streams W once
        cblas_sgemv(CblasRowMajor, CblasNoTrans, int(out), int(in), 1.0f, w.data(), int(in), x, 1,
                    0.0f, y, 1);
        return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(out), int(in), 1.0f, x,
                int(in), w.data(), int(in), 0.0f, y, int(out));
}

void add_bias(float* y, int64_t n, const std::vector<float>& b) {
    if (b.empty()) return;
    const int64_t m = int64_t(b.size());
    for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < m; ++c) y[r * m + c] += b[size_t(c)];
}

void rms_norm(const float* x, int64_t n, int64_t h, const std::vector<float>& w, double eps,
              float* y) {
    for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * h;
        double ss = 0;
        for (int64_t c = 0; c < h; ++c) ss += double(xr[c]) * xr[c];
        const float inv = float(1.0 / std::sqrt(ss / double(h) + eps));
        for (int64_t c = 0; c < h; ++c) y[r * h + c] = xr[c] * inv * w[size_t(c)];
    }
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Rotates pairs (i, i + d/2) of every head (Hugging Face rotate_half convention).
void apply_rope(float* x, int64_t n, int heads, int d, const std::vector<float>& cos_t,
                const std::vector<float>& sin_t) {
    const int half = d / 2;
    for (int64_t r = 0; r < n; ++r) {
        const float* c = cos_t.data() + r * half;
        const float* s = sin_t.data() + r * half;
        for (int hh = 0; hh < heads; ++hh) {
            float* v = x + (r * heads + hh) * d;
            for (int i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}

PageGeometry geometry_for(const ModelWeights& w, int block_size, PageOrder order) {
    PageGeometry g;
    g.num_layers = w.shard.num_layers();
    g.kv_factor = 2;
    g.num_heads = w.shard.num_kv_heads();
    g.block_size = block_size;
    g.head_dim = w.spec.head_dim;
    g.dtype = w.spec.kv_dtype;  // the pool stores this; the model computes in fp32
    g.order = order;
    return g;
}

}  // namespace

void set_compute_threads(int n) { openblas_set_num_threads(std::max(1, n)); }

int32_t argmax(std::span<const float> logits) {
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

void default_attention(const AttentionCall& c) {
    write_kv(*c.pool, c.local_layer, c.batch->kv, c.batch->queries.q_indptr, c.batch->slots, c.k,
             c.v);
    paged_attention(*c.pool, c.local_layer, c.batch->kv, c.batch->queries, c.params, c.q, c.out,
                    nullptr);
}

RankModel::RankModel(ModelWeights weights, int64_t num_blocks, int block_size, RankComms comms,
                     PageOrder order, PoolMemory memory)
    : weights_(std::move(weights)),
      comms_(comms),
      pool_(geometry_for(weights_, block_size, order), num_blocks, memory),
      attention_(default_attention) {
    require(weights_.spec.head_dim % 2 == 0, weights_.spec.name,
            ": RoPE needs an even head_dim, got ", weights_.spec.head_dim);
}

void RankModel::tp_all_reduce(std::span<float> data) { coll::all_reduce_sum(comms_.tp, data); }

std::vector<float> RankModel::forward(const ForwardBatch& b) {
    const ModelSpec& m = weights_.spec;
    const int64_t n = b.rows(), h = m.hidden;
    KVSHARD_CHECK(int64_t(b.token_ids.size()) == n && int64_t(b.slots.size()) == n,
                  "batch rows disagree");
    std::vector<float> x(size_t(n * h));
    if (first_stage()) {
        for (int64_t r = 0; r < n; ++r) {
            const int32_t tok = b.token_ids[size_t(r)];
            require(tok >= 0 && tok < m.vocab, "token id ", tok, " outside the vocabulary [0, ",
                    m.vocab, ")");
            std::copy_n(weights_.embed.data() + int64_t{tok} * h, h, x.data() + r * h);
        }
    } else {
        coll::recv(comms_.world, x, comms_.prev_stage, coll::kTagActivations);
    }

    // RoPE tables of this step's positions.
    const int half = m.head_dim / 2;
    rope_cos_.resize(size_t(n * half));
    rope_sin_.resize(size_t(n * half));
    for (int64_t r = 0; r < n; ++r)
        for (int i = 0; i < half; ++i) {
            const double inv_freq = std::pow(m.rope_theta, -2.0 * i / m.head_dim);
            const double angle = double(b.queries.q_pos[size_t(r)]) * inv_freq;
            rope_cos_[size_t(r * half + i)] = float(std::cos(angle));
            rope_sin_[size_t(r * half + i)] = float(std::sin(angle));
        }

    std::vector<float> xn(size_t(n * h)), y(size_t(n * h));
    for (int l = 0; l < weights_.shard.num_layers(); ++l) {
        const LayerWeights& w = weights_.layers[size_t(l)];
        attention_block(l, b, x);
        rms_norm(x.data(), n, h, w.mlp_norm, m.rms_norm_eps, xn.data());
        if (m.is_moe_layer(weights_.shard.layer_begin + l))
            moe_mlp(w, xn.data(), n, y.data());
        else
            dense_mlp(w, xn.data(), n, y.data());
        for (int64_t i = 0; i < n * h; ++i) x[size_t(i)] += y[size_t(i)];
    }

    if (!last_stage()) {
        coll::send(comms_.world, x, comms_.next_stage, coll::kTagActivations);
        return {};
    }
    const int batch = b.batch();
    std::vector<float> last(size_t(batch) * h, 0.0f), normed(last.size());
    for (int i = 0; i < batch; ++i) {
        const int32_t r1 = b.queries.q_indptr[i + 1];
        if (r1 > b.queries.q_indptr[i])
            std::copy_n(x.data() + int64_t(r1 - 1) * h, h, last.data() + int64_t{i} * h);
    }
    rms_norm(last.data(), batch, h, weights_.final_norm, m.rms_norm_eps, normed.data());
    std::vector<float> logits(size_t(batch) * m.vocab, 0.0f);
    linear(normed.data(), batch, h, weights_.lm_head, m.vocab, logits.data());
    for (int i = 0; i < batch; ++i)
        if (b.queries.q_indptr[i + 1] == b.queries.q_indptr[i])
            std::fill_n(logits.data() + int64_t{i} * m.vocab, m.vocab, 0.0f);
    return logits;
}

void RankModel::attention_block(int l, const ForwardBatch& b, std::vector<float>& x) {
    const ModelSpec& m = weights_.spec;
    const LayerWeights& w = weights_.layers[size_t(l)];
    const int64_t n = b.rows(), h = m.hidden, d = m.head_dim;
    const int nq = weights_.shard.num_q_heads(), nkv = weights_.shard.num_kv_heads();
    std::vector<float> xn(size_t(n * h)), q(size_t(n * nq * d)), k(size_t(n * nkv * d)),
        v(k.size()), attn(q.size()), o(size_t(n * h));
    rms_norm(x.data(), n, h, w.attn_norm, m.rms_norm_eps, xn.data());
    linear(xn.data(), n, h, w.wq, nq * d, q.data());
    linear(xn.data(), n, h, w.wk, nkv * d, k.data());
    linear(xn.data(), n, h, w.wv, nkv * d, v.data());
    add_bias(q.data(), n, w.bq);
    add_bias(k.data(), n, w.bk);
    add_bias(v.data(), n, w.bv);
    apply_rope(q.data(), n, nq, int(d), rope_cos_, rope_sin_);
    apply_rope(k.data(), n, nkv, int(d), rope_cos_, rope_sin_);
    AttentionCall call;
    call.layer = weights_.shard.layer_begin + l;
    call.local_layer = l;
    call.batch = &b;
    call.params = {.num_q_heads = nq,
                   .num_kv_heads = nkv,
                   .head_dim = int(d),
                   .scale = 1.0f / std::sqrt(float(d)),
                   .causal = true};
    call.q = q.data();
    call.k = k.data();
    call.v = v.data();
    call.out = attn.data();
    call.pool = &pool_;
    attention_(call);  // also with no rows: a replacement may take part in collectives
    linear(attn.data(), n, nq * d, w.wo, h, o.data());
    tp_all_reduce(o);
    for (int64_t i = 0; i < n * h; ++i) x[size_t(i)] += o[size_t(i)];
}

void RankModel::dense_mlp(const LayerWeights& w, const float* x, int64_t n, float* y) {
    const int64_t h = weights_.spec.hidden, f = weights_.shard.mlp_width();
    std::vector<float> g(size_t(n * f)), u(g.size());
    linear(x, n, h, w.gate, f, g.data());
    linear(x, n, h, w.up, f, u.data());
    for (size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
    std::fill_n(y, n * h, 0.0f);
    linear(g.data(), n, f, w.down, h, y);
    tp_all_reduce({y, size_t(n * h)});
}

// Mixtral routing: softmax over the router logits, top-k, weights renormalised over the k.
// Each TP rank dispatches the rows r with r % tp == tp_rank (TP ranks hold the same rows), to the
// EP rank that holds the expert; results come back by the reverse all-to-all and the TP all-reduce
// gives every TP rank all rows again.
void RankModel::moe_mlp(const LayerWeights& w, const float* x, int64_t n, float* y) {
    const ModelSpec& m = weights_.spec;
    const int64_t h = m.hidden, ei = m.moe.expert_intermediate;
    const int E = m.moe.num_experts, K = m.moe.experts_per_token;
    const int tp_size = coll::size(comms_.tp), tp_rank = coll::rank(comms_.tp);
    const int ep_size = coll::size(comms_.ep), ep_rank = coll::rank(comms_.ep);
    const int per_rank = E / ep_size;
    KVSHARD_CHECK(
        int(w.experts.size()) == per_rank && weights_.shard.expert_begin == ep_rank * per_rank,
        "expert shard [", weights_.shard.expert_begin, ", ", weights_.shard.expert_end,
        ") does not match ep rank ", ep_rank, " of ", ep_size);

    // Route the rows this rank dispatches.
    std::vector<int64_t> own;
    for (int64_t r = tp_rank; r < n; r += tp_size) own.push_back(r);
    const int64_t n_own = int64_t(own.size());
    std::vector<float> xo(size_t(n_own * h)), logits(size_t(n_own * E));
    for (int64_t i = 0; i < n_own; ++i) std::copy_n(x + own[size_t(i)] * h, h, xo.data() + i * h);
    linear(xo.data(), n_own, h, w.router, E, logits.data());
    std::vector<int32_t> choice(size_t(n_own * K));
    std::vector<float> weight(size_t(n_own * K));
    std::vector<int> idx(static_cast<size_t>(E));
    for (int64_t i = 0; i < n_own; ++i) {
        const float* lg = logits.data() + i * E;
        const float mx = *std::max_element(lg, lg + E);
        std::vector<double> p(static_cast<size_t>(E));
        double sum = 0;
        for (int e = 0; e < E; ++e) sum += p[size_t(e)] = std::exp(double(lg[e] - mx));
        std::iota(idx.begin(), idx.end(), 0);
        std::partial_sort(idx.begin(), idx.begin() + K, idx.end(), [&](int a, int c) {
            return p[size_t(a)] != p[size_t(c)] ? p[size_t(a)] > p[size_t(c)] : a < c;
        });
        double top = 0;
        for (int k = 0; k < K; ++k) top += p[size_t(idx[size_t(k)])] / sum;
        for (int k = 0; k < K; ++k) {
            choice[size_t(i * K + k)] = idx[size_t(k)];
            weight[size_t(i * K + k)] = float(p[size_t(idx[size_t(k)])] / sum / top);
        }
    }

    // Dispatch: entries (row, k) grouped by destination EP rank, in (row, k) order within each.
    std::vector<std::size_t> send_counts(static_cast<size_t>(ep_size), 0);
    for (int32_t e : choice) ++send_counts[size_t(e / per_rank)];
    std::vector<std::size_t> offset(size_t(ep_size) + 1, 0);
    for (int p = 0; p < ep_size; ++p)
        offset[size_t(p) + 1] = offset[size_t(p)] + send_counts[size_t(p)];
    std::vector<int64_t> entry_slot(choice.size());  // send position of entry (i, k)
    {
        std::vector<std::size_t> fill(offset.begin(), offset.end() - 1);
        for (size_t j = 0; j < choice.size(); ++j)
            entry_slot[j] = int64_t(fill[size_t(choice[j] / per_rank)]++);
    }
    std::vector<int32_t> send_ids(choice.size());
    std::vector<float> send_x(choice.size() * size_t(h));
    for (size_t j = 0; j < choice.size(); ++j) {
        send_ids[size_t(entry_slot[j])] = choice[j];
        std::copy_n(xo.data() + int64_t(j / size_t(K)) * h, h, send_x.data() + entry_slot[j] * h);
    }
    std::vector<int32_t> recv_ids;
    std::vector<std::size_t> recv_counts;
    coll::all_to_all(comms_.ep, send_ids, send_counts, recv_ids, recv_counts);
    std::vector<std::size_t> send_elems(send_counts), recv_elems(recv_counts);
    for (auto& c : send_elems) c *= size_t(h);
    for (auto& c : recv_elems) c *= size_t(h);
    std::vector<float> recv_x(recv_ids.size() * size_t(h));
    coll::all_to_all(comms_.ep, send_x, send_elems, recv_x, recv_elems);

    // Run the local experts over what arrived, batched per expert.
    std::vector<float> result(recv_x.size());
    std::vector<float> xe, g, u, ye;
    std::vector<int64_t> rows;
    for (int le = 0; le < per_rank; ++le) {
        const int32_t e = ep_rank * per_rank + le;
        rows.clear();
        for (size_t j = 0; j < recv_ids.size(); ++j)
            if (recv_ids[j] == e) rows.push_back(int64_t(j));
        if (rows.empty()) continue;
        const int64_t mrows = int64_t(rows.size());
        xe.resize(size_t(mrows * h));
        for (int64_t i = 0; i < mrows; ++i)
            std::copy_n(recv_x.data() + rows[size_t(i)] * h, h, xe.data() + i * h);
        g.resize(size_t(mrows * ei));
        u.resize(g.size());
        ye.resize(xe.size());
        const ExpertWeights& ew = w.experts[size_t(le)];
        linear(xe.data(), mrows, h, ew.gate, ei, g.data());
        linear(xe.data(), mrows, h, ew.up, ei, u.data());
        for (size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
        linear(g.data(), mrows, ei, ew.down, h, ye.data());
        for (int64_t i = 0; i < mrows; ++i)
            std::copy_n(ye.data() + i * h, h, result.data() + rows[size_t(i)] * h);
    }

    // Combine: results return in the order they were sent.
    std::vector<float> back(send_x.size());
    coll::all_to_all(comms_.ep, result, recv_elems, back, send_elems);
    std::fill_n(y, n * h, 0.0f);
    for (int64_t i = 0; i < n_own; ++i) {
        float* yr = y + own[size_t(i)] * h;
        for (int k = 0; k < K; ++k) {
            const size_t j = size_t(i * K + k);
            const float wk = weight[j];
            const float* src = back.data() + entry_slot[j] * h;
            for (int64_t c = 0; c < h; ++c) yr[c] += wk * src[c];
        }
    }
    tp_all_reduce({y, size_t(n * h)});
}

WeightShard weight_shard(const KvLayout& layout, int rank) {
    const ModelSpec& m = layout.model;
    const ParallelConfig& p = layout.parallel;
    const RankKv& r = layout.ranks.at(size_t(rank));
    require(m.intermediate % p.tp == 0, m.name, ": the MLP width ", m.intermediate,
            " is not divisible by tp=", p.tp, ": choose a tp that divides ", m.intermediate);
    WeightShard s;
    s.layer_begin = r.layer_begin;
    s.layer_end = r.layer_end;
    s.q_head_begin = r.q_head_begin;
    s.q_head_end = r.q_head_end;
    s.kv_head_begin = r.kv_heads.front();
    s.kv_head_end = r.kv_heads.back() + 1;
    const int w = m.intermediate / p.tp;
    s.mlp_begin = r.coord.tp * w;
    s.mlp_end = s.mlp_begin + w;
    s.expert_begin = r.expert_begin;
    s.expert_end = r.expert_end;
    return s;
}

}  // namespace kvshard
