#include "kvshard/exec/rank_model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "exec/collectives.h"
#include "kvshard/attention/merge.h"
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

// GPT-J style RoPE on `dim` elements at `offset` of each head (stride elements apart): pairs
// (2i, 2i + 1) rotate by position * theta^(-2i/dim). DeepSeek's MLA rope part, as vLLM runs it
// (is_neox_style = False); the cached k_pe keeps this order.
void apply_rope_interleaved(float* x, int64_t n, int heads, int64_t stride, int offset, int dim,
                            const std::vector<float>& cos_t, const std::vector<float>& sin_t) {
    const int half = dim / 2;
    for (int64_t r = 0; r < n; ++r) {
        const float* c = cos_t.data() + r * half;
        const float* s = sin_t.data() + r * half;
        for (int hh = 0; hh < heads; ++hh) {
            float* v = x + (r * heads + hh) * stride + offset;
            for (int i = 0; i < half; ++i) {
                const float a = v[2 * i], b = v[2 * i + 1];
                v[2 * i] = a * c[i] - b * s[i];
                v[2 * i + 1] = b * c[i] + a * s[i];
            }
        }
    }
}

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

// The pool of one KV group's layers on this rank: K/V of the held KV heads, or the MLA latent.
PageGeometry group_geometry(const ModelWeights& w, const KvGroup& g, int layers, int block_size,
                            PageOrder order) {
    PageGeometry geo;
    geo.num_layers = layers;
    geo.block_size = block_size;
    geo.dtype = w.spec.kv_dtype;  // the pool stores this; the model computes in fp32
    geo.order = order;
    if (g.kind == LayerKind::kMla) {
        geo.kv_factor = 1;
        geo.num_heads = 1;
        geo.head_dim = w.spec.mla.kv_lora_rank + w.spec.mla.qk_rope_head_dim;
    } else {
        geo.kv_factor = 2;
        geo.num_heads = w.shard.num_kv_heads();
        geo.head_dim = g.head_dim;
    }
    return geo;
}

void l2_normalize(float* x, int n) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += double(x[i]) * x[i];
    const float inv = float(1.0 / std::sqrt(ss + 1e-6));
    for (int i = 0; i < n; ++i) x[i] *= inv;
}

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

}  // namespace

void set_compute_threads(int n) { openblas_set_num_threads(std::max(1, n)); }

int32_t argmax(std::span<const float> logits) {
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

void default_attention(const AttentionCall& c) {
    const PagedKv& kv = c.kv ? *c.kv : c.batch->kv;
    if (c.mla_latent_dim > 0) {
        write_latent(*c.pool, c.local_layer, kv, c.batch->queries.q_indptr, c.batch->slots, c.k);
        const MlaParams mp{.num_heads = c.params.num_q_heads,
                           .latent_dim = c.mla_latent_dim,
                           .rope_dim = c.params.head_dim - c.mla_latent_dim,
                           .scale = c.params.scale};
        mla_attention(*c.pool, c.local_layer, kv, c.batch->queries, mp, c.q, c.out, nullptr);
        return;
    }
    write_kv(*c.pool, c.local_layer, kv, c.batch->queries.q_indptr, c.batch->slots, c.k, c.v);
    if (!c.sinks) {
        paged_attention(*c.pool, c.local_layer, kv, c.batch->queries, c.params, c.q, c.out,
                        nullptr);
        return;
    }
    std::vector<float> lse(size_t(c.batch->rows() * c.params.num_q_heads));
    paged_attention(*c.pool, c.local_layer, kv, c.batch->queries, c.params, c.q, c.out, lse.data());
    apply_attention_sinks(c.out, lse.data(), c.batch->rows(), c.params.num_q_heads,
                          c.params.head_dim, c.sinks);
}

RankModel::RankModel(ModelWeights weights, int64_t num_blocks, int block_size, RankComms comms,
                     PageOrder order, PoolMemory memory)
    : weights_(std::move(weights)), comms_(comms), attention_(default_attention) {
    build(num_blocks, block_size, order, memory, nullptr);
}

RankModel::RankModel(ModelWeights weights, int block_size,
                     const std::vector<ExternalMemory>& pool_memory, RankComms comms,
                     PageOrder order)
    : weights_(std::move(weights)), comms_(comms), attention_(default_attention) {
    build(0, block_size, order, PoolMemory::kPrivate, &pool_memory);
}

void RankModel::build(int64_t num_blocks, int block_size, PageOrder order, PoolMemory memory,
                      const std::vector<ExternalMemory>* external) {
    const ModelSpec& m = weights_.spec;
    const WeightShard& sh = weights_.shard;
    const int n_local = sh.num_layers();
    layer_pool_.assign(size_t(n_local), -1);
    layer_in_pool_.assign(size_t(n_local), -1);
    layer_state_.assign(size_t(n_local), -1);
    const auto groups = kv_groups(m);
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        const KvGroup& g = groups[gi];
        std::vector<int> here;
        for (int l : g.layers)
            if (l >= sh.layer_begin && l < sh.layer_end) here.push_back(l - sh.layer_begin);
        if (here.empty()) continue;
        if (holds_state(g.kind)) {
            for (int l : here) {
                layer_state_[size_t(l)] = int(states_.size());
                StateLayer st;
                const auto& ss = m.state;
                const int64_t gl = sh.state_group_end(m) - sh.state_group_begin(m);
                const int64_t ch =
                    2 * gl * ss.group_dim + int64_t{sh.num_state_heads()} * ss.head_dim;
                st.conv_elems = (ss.conv_kernel - 1) * ch;
                st.rec_elems = int64_t{sh.num_state_heads()} * ss.group_dim * ss.head_dim;
                states_.push_back(std::move(st));
            }
            continue;
        }
        if (g.kind == LayerKind::kMla || g.kind == LayerKind::kFullAttention ||
            g.kind == LayerKind::kSlidingWindow || g.kind == LayerKind::kChunkedLocal) {
            const int pi = int(pools_.size());
            for (size_t j = 0; j < here.size(); ++j) {
                layer_pool_[size_t(here[j])] = pi;
                layer_in_pool_[size_t(here[j])] = int(j);
            }
            const PageGeometry geo =
                group_geometry(weights_, g, int(here.size()), block_size, order);
            if (external) {
                require(size_t(pi) < external->size(), "this rank holds more pools than the ",
                        external->size(), " memory region(s) given: one per pool (KV group held)");
                const ExternalMemory& mem = (*external)[size_t(pi)];
                require(mem.bytes > 0 && mem.bytes % size_t(geo.block_bytes()) == 0, "pool ", pi,
                        "'s memory holds ", mem.bytes, " bytes, not a whole number of blocks of ",
                        geo.block_bytes(), " bytes (layers ", geo.num_layers, " x kv ",
                        geo.kv_factor, " x heads ", geo.num_heads, " x block_size ", geo.block_size,
                        " x head_dim ", geo.head_dim, " x ", geo.elem_size(), " B)");
                pools_.emplace_back(geo, int64_t(mem.bytes / size_t(geo.block_bytes())), mem);
            } else {
                pools_.emplace_back(geo, num_blocks, memory);
            }
            pool_group_.push_back(int(gi));
        }
    }
    if (external)
        require(external->size() == pools_.size(), external->size(),
                " memory region(s) given but this rank holds ", pools_.size(),
                " pool(s): one per KV group held");
    if (m.is_mla())
        require(m.mla.qk_rope_head_dim % 2 == 0, m.name,
                ": RoPE needs an even qk_rope_head_dim, got ", m.mla.qk_rope_head_dim);
    else
        require(m.head_dim % 2 == 0, m.name, ": RoPE needs an even head_dim, got ", m.head_dim);
}

void RankModel::StateLayer::reserve_slot(int64_t slot) {
    KVSHARD_CHECK(slot >= 0, "state slot ", slot);
    if (int64_t(rec.size()) < (slot + 1) * rec_elems) {
        rec.resize(size_t((slot + 1) * rec_elems), 0.0f);
        conv.resize(size_t((slot + 1) * conv_elems), 0.0f);
    }
}

RankModel::StateLayer& RankModel::state_layer(int layer) {
    const int l = layer - weights_.shard.layer_begin;
    require(l >= 0 && l < int(layer_state_.size()) && layer_state_[size_t(l)] >= 0, "layer ", layer,
            " is not a state layer of this rank (layers [", weights_.shard.layer_begin, ", ",
            weights_.shard.layer_end, "))");
    return states_[size_t(layer_state_[size_t(l)])];
}

std::span<float> RankModel::state_conv(int layer, int32_t slot) {
    StateLayer& st = state_layer(layer);
    st.reserve_slot(slot);
    return {st.conv.data() + slot * st.conv_elems, size_t(st.conv_elems)};
}

std::span<float> RankModel::state_rec(int layer, int32_t slot) {
    StateLayer& st = state_layer(layer);
    st.reserve_slot(slot);
    return {st.rec.data() + slot * st.rec_elems, size_t(st.rec_elems)};
}

int64_t RankModel::state_bytes_per_sequence() const {
    int64_t n = 0;
    for (const auto& st : states_) n += (st.conv_elems + st.rec_elems) * int64_t(sizeof(float));
    return n;
}

void RankModel::rope_tables(const ForwardBatch& b, int dim) {
    const int64_t n = b.rows();
    const int half = dim / 2;
    rope_dim_ = dim;
    rope_cos_.resize(size_t(n * half));
    rope_sin_.resize(size_t(n * half));
    for (int64_t r = 0; r < n; ++r)
        for (int i = 0; i < half; ++i) {
            const double inv_freq = std::pow(weights_.spec.rope_theta, -2.0 * i / dim);
            const double angle = double(b.queries.q_pos[size_t(r)]) * inv_freq;
            rope_cos_[size_t(r * half + i)] = float(std::cos(angle));
            rope_sin_[size_t(r * half + i)] = float(std::sin(angle));
        }
}

void RankModel::tp_all_reduce(std::span<float> data) { coll::all_reduce_sum(comms_.tp, data); }

void RankModel::add_row_parallel(const float* in, int64_t n, int64_t width,
                                 const std::vector<float>& wo, std::vector<float>& x) {
    const int64_t h = weights_.spec.hidden;
    std::vector<float> y(size_t(n * h));
    linear(in, n, width, wo, h, y.data());
    tp_all_reduce(y);
    for (int64_t i = 0; i < n * h; ++i) x[size_t(i)] += y[size_t(i)];
}

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

    // RoPE tables of this step's positions (MLA rotates its qk_rope_head_dim part only).
    rope_tables(b, m.is_mla() ? m.mla.qk_rope_head_dim : m.head_dim);

    std::vector<float> xn(size_t(n * h)), y(size_t(n * h));
    for (int l = 0; l < weights_.shard.num_layers(); ++l) {
        const LayerWeights& w = weights_.layers[size_t(l)];
        switch (w.kind) {
            case LayerKind::kMla:
                mla_block(l, b, x);
                break;
            case LayerKind::kGatedDeltaNet:
                gated_deltanet_block(l, b, x);
                break;
            case LayerKind::kMamba2:
            case LayerKind::kMamba1:
            case LayerKind::kShortConv:
                KVSHARD_CHECK(false, "check_executable refuses ", layer_kind_name(w.kind),
                              " layers");
                break;
            case LayerKind::kNoKv:
                break;
            default:
                attention_block(l, b, x);
        }
        if (w.mlp_norm.empty()) continue;  // a layer without an MLP
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
        v(k.size()), attn(q.size());
    rms_norm(x.data(), n, h, w.attn_norm, m.rms_norm_eps, xn.data());
    linear(xn.data(), n, h, w.wq, nq * d, q.data());
    linear(xn.data(), n, h, w.wk, nkv * d, k.data());
    linear(xn.data(), n, h, w.wv, nkv * d, v.data());
    add_bias(q.data(), n, w.bq);
    add_bias(k.data(), n, w.bk);
    add_bias(v.data(), n, w.bv);
    apply_rope(q.data(), n, nq, int(d), rope_cos_, rope_sin_);
    apply_rope(k.data(), n, nkv, int(d), rope_cos_, rope_sin_);
    const LayerSpec ls = m.layer(weights_.shard.layer_begin + l);
    const int pi = layer_pool_[size_t(l)];
    AttentionCall call;
    call.layer = weights_.shard.layer_begin + l;
    call.local_layer = layer_in_pool_[size_t(l)];
    call.batch = &b;
    call.kv = &b.kv_of_group(pool_group_[size_t(pi)]);
    call.params = {.num_q_heads = nq,
                   .num_kv_heads = nkv,
                   .head_dim = int(d),
                   .scale = 1.0f / std::sqrt(float(d)),
                   .causal = true,
                   .window = ls.kind == LayerKind::kFullAttention ? 0 : ls.window,
                   .chunked = ls.kind == LayerKind::kChunkedLocal};
    call.q = q.data();
    call.k = k.data();
    call.v = v.data();
    call.out = attn.data();
    call.sinks = w.sinks.empty() ? nullptr : w.sinks.data();
    call.pool = &pools_[size_t(pi)];
    attention_(call);  // also with no rows: a replacement may take part in collectives
    add_row_parallel(attn.data(), n, nq * d, w.wo, x);
}

// MLA, absorbed (docs/model.md): with W_kv_b = [W_uk_h; W_uv_h] per head,
//   q_h = [q_nope_h | RoPE(q_pe_h)],  latent_t = [rmsnorm(c_t) | RoPE(k_pe_t)]   (cached)
//   score_ht = (W_uk_h^T q_nope_h) . c_t + RoPE(q_pe_h) . RoPE(k_pe_t), over sqrt(d_nope + d_pe)
//   out_h = W_uv_h sum_t softmax(score)_ht c_t
// which equals the naive form k_nope_ht = W_uk_h c_t, v_ht = W_uv_h c_t exactly in real numbers.
void RankModel::mla_block(int l, const ForwardBatch& b, std::vector<float>& x) {
    const ModelSpec& m = weights_.spec;
    const LayerWeights& w = weights_.layers[size_t(l)];
    const auto& a = m.mla;
    const int64_t n = b.rows(), h = m.hidden;
    const int nq = weights_.shard.num_q_heads();
    const int dn = a.qk_nope_head_dim, dr = a.qk_rope_head_dim, dl = a.kv_lora_rank,
              dv = a.v_head_dim, dqk = dn + dr;
    std::vector<float> xn(size_t(n * h)), q(size_t(n * nq * dqk)), kva(size_t(n * (dl + dr)));
    rms_norm(x.data(), n, h, w.attn_norm, m.rms_norm_eps, xn.data());
    if (a.q_lora_rank > 0) {
        std::vector<float> qa(size_t(n * a.q_lora_rank)), qan(qa.size());
        linear(xn.data(), n, h, w.wq_a, a.q_lora_rank, qa.data());
        rms_norm(qa.data(), n, a.q_lora_rank, w.q_a_norm, m.rms_norm_eps, qan.data());
        linear(qan.data(), n, a.q_lora_rank, w.wq, int64_t{nq} * dqk, q.data());
    } else {
        linear(xn.data(), n, h, w.wq, int64_t{nq} * dqk, q.data());
    }
    linear(xn.data(), n, h, w.wkv_a, dl + dr, kva.data());
    std::vector<float> latent(kva.size());
    for (int64_t r = 0; r < n; ++r) {
        rms_norm(kva.data() + r * (dl + dr), 1, dl, w.kv_a_norm, m.rms_norm_eps,
                 latent.data() + r * (dl + dr));
        std::copy_n(kva.data() + r * (dl + dr) + dl, dr, latent.data() + r * (dl + dr) + dl);
    }
    apply_rope_interleaved(q.data(), n, nq, dqk, dn, dr, rope_cos_, rope_sin_);
    apply_rope_interleaved(latent.data(), n, 1, dl + dr, dl, dr, rope_cos_, rope_sin_);

    // Absorb W_uk into the query: q_lat_h = [W_uk_h^T q_nope_h | q_pe_h].
    const int64_t kvb = dn + dv;
    std::vector<float> qlat(size_t(n * nq * (dl + dr)));
    for (int64_t r = 0; r < n; ++r)
        for (int hh = 0; hh < nq; ++hh) {
            const float* qh = q.data() + (r * nq + hh) * dqk;
            float* o = qlat.data() + (r * nq + hh) * (dl + dr);
            const float* wuk = w.wkv_b.data() + hh * kvb * dl;  // [dn][dl]
            std::fill_n(o, dl, 0.0f);
            for (int i = 0; i < dn; ++i)
                for (int c = 0; c < dl; ++c) o[c] += qh[i] * wuk[int64_t{i} * dl + c];
            std::copy_n(qh + dn, dr, o + dl);
        }
    const int pi = layer_pool_[size_t(l)];
    std::vector<float> olat(size_t(n * nq * dl));
    AttentionCall call;
    call.layer = weights_.shard.layer_begin + l;
    call.local_layer = layer_in_pool_[size_t(l)];
    call.batch = &b;
    call.kv = &b.kv_of_group(pool_group_[size_t(pi)]);
    call.params = {.num_q_heads = nq,
                   .num_kv_heads = 1,
                   .head_dim = dl + dr,
                   .scale = 1.0f / std::sqrt(float(dqk)),
                   .causal = true};
    call.q = qlat.data();
    call.k = latent.data();
    call.out = olat.data();
    call.mla_latent_dim = dl;
    call.pool = &pools_[size_t(pi)];
    attention_(call);
    // Up-project with W_uv: attn_h = W_uv_h olat_h.
    std::vector<float> attn(size_t(n * nq * dv));
    for (int64_t r = 0; r < n; ++r)
        for (int hh = 0; hh < nq; ++hh) {
            const float* ol = olat.data() + (r * nq + hh) * dl;
            const float* wuv = w.wkv_b.data() + (hh * kvb + dn) * dl;  // [dv][dl]
            float* out = attn.data() + (r * nq + hh) * dv;
            for (int i = 0; i < dv; ++i) {
                float acc = 0;
                for (int c = 0; c < dl; ++c) acc += wuv[int64_t{i} * dl + c] * ol[c];
                out[i] = acc;
            }
        }
    add_row_parallel(attn.data(), n, int64_t{nq} * dv, w.wo, x);
}

// Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025), as Qwen3-Next
// runs it: per token, [q | k | v] = SiLU(causal depthwise conv(x W^T)) with the last conv_kernel-1
// inputs kept as conv state; q, k L2-normalised per key head, q scaled by 1/sqrt(k_d);
// beta = sigmoid(x W_b^T), g = -exp(A_log) softplus(x W_a^T + dt_bias); per value head the state
// S [k_d][v_d] updates S := exp(g) S; S += k (beta (v - S^T k))^T, and o = S^T q; then
// o := rmsnorm(o) * norm * SiLU(z) per head and out_proj. Value heads split by TP (a key head is
// shared by the ranks of its value heads); the out_proj is row parallel.
void RankModel::gated_deltanet_block(int l, const ForwardBatch& b, std::vector<float>& x) {
    const ModelSpec& m = weights_.spec;
    const LayerWeights& w = weights_.layers[size_t(l)];
    const WeightShard& sh = weights_.shard;
    const auto& ss = m.state;
    const int64_t h = m.hidden;
    const int kd = ss.group_dim, vd = ss.head_dim, K = ss.conv_kernel;
    const int g0 = sh.state_group_begin(m), gl = sh.state_group_end(m) - g0;
    const int hl = sh.num_state_heads(), r_per_k = ss.heads / ss.groups;
    const int64_t ch = int64_t{2} * gl * kd + int64_t{hl} * vd;
    std::vector<float> xn(size_t(b.rows() * h));
    rms_norm(x.data(), b.rows(), h, w.attn_norm, m.rms_norm_eps, xn.data());
    // The sequences the recurrence runs over: the batch's, or (CP prefill) the whole new rows of
    // each sequence gathered from every CP rank, of which this rank keeps its own.
    std::vector<int32_t> seq_ptr(b.queries.q_indptr.begin(), b.queries.q_indptr.end());
    std::vector<int64_t> seq_first, own;
    for (int i = 0; i < b.batch(); ++i)
        seq_first.push_back(b.queries.q_indptr[i + 1] > b.queries.q_indptr[i]
                                ? b.queries.q_pos[size_t(b.queries.q_indptr[i])]
                                : 0);
    if (state_rows_) {
        StateRows g = state_rows_(xn, h);
        KVSHARD_CHECK(int(g.first_pos.size()) == b.batch() &&
                          int(g.seq_ptr.size()) == b.batch() + 1 &&
                          int64_t{g.seq_ptr.back()} * h == int64_t(g.rows.size()),
                      "gathered state rows describe ", g.first_pos.size(),
                      " sequences for a batch of ", b.batch());
        xn = std::move(g.rows);
        own = std::move(g.own);
        seq_ptr = std::move(g.seq_ptr);
        seq_first = std::move(g.first_pos);
    }
    const int64_t n = int64_t(xn.size()) / h;
    std::vector<float> in(size_t(n * ch)), z(size_t(n * hl * vd)), bb(size_t(n * hl)),
        aa(size_t(n * hl));
    {
        std::vector<float> t(size_t(n * std::max<int64_t>(gl * kd, int64_t{hl} * vd)));
        auto put = [&](const std::vector<float>& wt, int64_t width, int64_t at) {
            linear(xn.data(), n, h, wt, width, t.data());
            for (int64_t r = 0; r < n; ++r)
                std::copy_n(t.data() + r * width, width, in.data() + r * ch + at);
        };
        put(w.lin_q, int64_t{gl} * kd, 0);
        put(w.lin_k, int64_t{gl} * kd, int64_t{gl} * kd);
        put(w.lin_v, int64_t{hl} * vd, int64_t{2} * gl * kd);
    }
    linear(xn.data(), n, h, w.lin_z, int64_t{hl} * vd, z.data());
    linear(xn.data(), n, h, w.lin_b, hl, bb.data());
    linear(xn.data(), n, h, w.lin_a, hl, aa.data());

    StateLayer& st = states_[size_t(layer_state_[size_t(l)])];
    std::vector<float> conv_out(in.size()), o(size_t(n * hl * vd));
    for (int i = 0; i + 1 < int(seq_ptr.size()); ++i) {
        const int32_t r0 = seq_ptr[size_t(i)], r1 = seq_ptr[size_t(i) + 1];
        if (r1 == r0) continue;
        const int64_t slot = b.state_slot(i);
        st.reserve_slot(slot);
        float* cs = st.conv.data() + slot * st.conv_elems;  // [K-1][ch], oldest first
        float* S = st.rec.data() + slot * st.rec_elems;     // [hl][kd][vd]
        if (seq_first[size_t(i)] == 0) {
            std::fill_n(cs, st.conv_elems, 0.0f);
            std::fill_n(S, st.rec_elems, 0.0f);
        }
        // Causal conv over [state | rows], then the state keeps the last K-1 inputs.
        const int64_t rows = r1 - r0;
        std::vector<float> hist(size_t((K - 1 + rows) * ch));
        std::copy_n(cs, st.conv_elems, hist.data());
        std::copy_n(in.data() + int64_t{r0} * ch, rows * ch, hist.data() + (K - 1) * ch);
        for (int64_t t = 0; t < rows; ++t)
            for (int64_t c = 0; c < ch; ++c) {
                float acc = 0;
                for (int j = 0; j < K; ++j)
                    acc += w.conv[size_t(c * K + j)] * hist[size_t((t + j) * ch + c)];
                conv_out[size_t((r0 + t) * ch + c)] = silu(acc);
            }
        std::copy_n(hist.data() + rows * ch, st.conv_elems, cs);
        // The delta rule, token by token.
        std::vector<float> kv_mem(static_cast<size_t>(vd)), delta(static_cast<size_t>(vd));
        for (int32_t t = r0; t < r1; ++t) {
            float* row = conv_out.data() + int64_t{t} * ch;
            for (int kh = 0; kh < gl; ++kh) {
                l2_normalize(row + int64_t{kh} * kd, kd);
                l2_normalize(row + int64_t{gl + kh} * kd, kd);
                for (int e = 0; e < kd; ++e) row[int64_t{kh} * kd + e] /= std::sqrt(float(kd));
            }
            for (int vh = 0; vh < hl; ++vh) {
                const int gvh = sh.state_head_begin + vh;
                const int kh = gvh / r_per_k - g0;
                const float* qv = row + int64_t{kh} * kd;
                const float* kv = row + int64_t{gl + kh} * kd;
                const float* vv = row + int64_t{2} * gl * kd + int64_t{vh} * vd;
                const float beta = 1.0f / (1.0f + std::exp(-bb[size_t(t * hl + vh)]));
                const float g = -std::exp(w.a_log[size_t(vh)]) *
                                softplus(aa[size_t(t * hl + vh)] + w.dt_bias[size_t(vh)]);
                const float decay = std::exp(g);
                float* Sh = S + int64_t{vh} * kd * vd;
                for (int64_t e = 0; e < int64_t{kd} * vd; ++e) Sh[e] *= decay;
                std::fill(kv_mem.begin(), kv_mem.end(), 0.0f);
                for (int e = 0; e < kd; ++e)
                    for (int c = 0; c < vd; ++c)
                        kv_mem[size_t(c)] += kv[e] * Sh[int64_t{e} * vd + c];
                for (int c = 0; c < vd; ++c) delta[size_t(c)] = (vv[c] - kv_mem[size_t(c)]) * beta;
                for (int e = 0; e < kd; ++e)
                    for (int c = 0; c < vd; ++c)
                        Sh[int64_t{e} * vd + c] += kv[e] * delta[size_t(c)];
                float* out = o.data() + (int64_t{t} * hl + vh) * vd;
                for (int c = 0; c < vd; ++c) {
                    float acc = 0;
                    for (int e = 0; e < kd; ++e) acc += qv[e] * Sh[int64_t{e} * vd + c];
                    out[c] = acc;
                }
                // Gated RMSNorm of the head.
                double sq = 0;
                for (int c = 0; c < vd; ++c) sq += double(out[c]) * out[c];
                const float inv = float(1.0 / std::sqrt(sq / vd + m.rms_norm_eps));
                const float* zh = z.data() + (int64_t{t} * hl + vh) * vd;
                for (int c = 0; c < vd; ++c)
                    out[c] = out[c] * inv * w.lin_norm[size_t(c)] * silu(zh[c]);
            }
        }
    }
    if (state_rows_) {  // keep this rank's rows
        std::vector<float> mine(size_t(int64_t(own.size()) * hl * vd));
        for (size_t i = 0; i < own.size(); ++i)
            std::copy_n(o.data() + own[i] * hl * vd, int64_t{hl} * vd,
                        mine.data() + int64_t(i) * hl * vd);
        o = std::move(mine);
    }
    const int64_t n_out = b.rows();
    add_row_parallel(o.data(), n_out, int64_t{hl} * vd, w.wo, x);
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
    if (m.state.heads > 0 && m.state_bytes_per_sequence() > 0) {
        require(m.state.heads % p.tp == 0, m.name, ": tp=", p.tp, " does not divide the ",
                m.state.heads,
                " Gated DeltaNet value heads: the reference model splits them across TP without "
                "replication; choose a tp that divides ",
                m.state.heads);
        const int per = m.state.heads / p.tp;
        s.state_head_begin = r.coord.tp * per;
        s.state_head_end = s.state_head_begin + per;
    }
    return s;
}

}  // namespace kvshard
