// The paged, batched, KV-cached model against a naive transformer that recomputes everything from
// scratch every step in double precision (no cache, no BLAS, no paging).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

using Vec = std::vector<double>;

Vec matvec(const std::vector<float>& w, const Vec& x, int64_t out) {
    const int64_t in = int64_t(x.size());
    Vec y(size_t(out), 0.0);
    for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i)
            y[size_t(o)] += double(w[size_t(o * in + i)]) * x[size_t(i)];
    return y;
}

Vec rms(const Vec& x, const std::vector<float>& w, double eps) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / double(x.size()) + eps);
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
    return y;
}

void rope(Vec& v, int heads, int d, int64_t pos, double theta) {
    for (int h = 0; h < heads; ++h)
        for (int i = 0; i < d / 2; ++i) {
            const double a = double(pos) * std::pow(theta, -2.0 * i / d);
            const double x = v[size_t(h * d + i)], y = v[size_t(h * d + i + d / 2)];
            v[size_t(h * d + i)] = x * std::cos(a) - y * std::sin(a);
            v[size_t(h * d + i + d / 2)] = y * std::cos(a) + x * std::sin(a);
        }
}

Vec swiglu(const std::vector<float>& g, const std::vector<float>& u, const std::vector<float>& dn,
           const Vec& x, int64_t width) {
    Vec a = matvec(g, x, width), b = matvec(u, x, width);
    for (size_t i = 0; i < a.size(); ++i) a[i] = a[i] / (1 + std::exp(-a[i])) * b[i];
    return matvec(dn, a, int64_t(x.size()));
}

// Logits of the last position of `tokens`.
std::vector<float> naive_logits(const ModelWeights& w, const std::vector<int32_t>& tokens) {
    const ModelSpec& m = w.spec;
    const int64_t n = int64_t(tokens.size()), h = m.hidden, d = m.head_dim;
    const int nq = m.num_heads, nkv = m.num_kv_heads, group = nq / nkv;
    std::vector<Vec> x(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t)
        x[size_t(t)] = Vec(w.embed.begin() + tokens[size_t(t)] * h,
                           w.embed.begin() + (tokens[size_t(t)] + 1) * h);
    for (int l = 0; l < m.num_layers; ++l) {
        const LayerWeights& lw = w.layers[size_t(l)];
        std::vector<Vec> q(static_cast<size_t>(n)), k(static_cast<size_t>(n)),
            v(static_cast<size_t>(n));
        for (int64_t t = 0; t < n; ++t) {
            const Vec xn = rms(x[size_t(t)], lw.attn_norm, m.rms_norm_eps);
            q[size_t(t)] = matvec(lw.wq, xn, nq * d);
            k[size_t(t)] = matvec(lw.wk, xn, nkv * d);
            v[size_t(t)] = matvec(lw.wv, xn, nkv * d);
            rope(q[size_t(t)], nq, int(d), t, m.rope_theta);
            rope(k[size_t(t)], nkv, int(d), t, m.rope_theta);
        }
        for (int64_t t = 0; t < n; ++t) {
            Vec attn(size_t(nq * d), 0.0);
            for (int hh = 0; hh < nq; ++hh) {
                const int kh = hh / group;
                Vec s(size_t(t + 1));
                for (int64_t j = 0; j <= t; ++j) {
                    double acc = 0;
                    for (int64_t e = 0; e < d; ++e)
                        acc += q[size_t(t)][size_t(hh * d + e)] * k[size_t(j)][size_t(kh * d + e)];
                    s[size_t(j)] = acc / std::sqrt(double(d));
                }
                const double mx = *std::max_element(s.begin(), s.end());
                double sum = 0;
                for (auto& e : s) sum += e = std::exp(e - mx);
                for (int64_t j = 0; j <= t; ++j)
                    for (int64_t e = 0; e < d; ++e)
                        attn[size_t(hh * d + e)] +=
                            s[size_t(j)] / sum * v[size_t(j)][size_t(kh * d + e)];
            }
            const Vec o = matvec(lw.wo, attn, h);
            for (int64_t e = 0; e < h; ++e) x[size_t(t)][size_t(e)] += o[size_t(e)];
        }
        for (int64_t t = 0; t < n; ++t) {
            const Vec xn = rms(x[size_t(t)], lw.mlp_norm, m.rms_norm_eps);
            Vec y(size_t(h), 0.0);
            if (m.is_moe_layer(l)) {
                const Vec logits = matvec(lw.router, xn, m.moe.num_experts);
                const double mx = *std::max_element(logits.begin(), logits.end());
                Vec p(logits.size());
                for (size_t e = 0; e < p.size(); ++e) p[e] = std::exp(logits[e] - mx);
                std::vector<int> idx(p.size());
                std::iota(idx.begin(), idx.end(), 0);
                std::stable_sort(idx.begin(), idx.end(),
                                 [&](int a, int b) { return p[size_t(a)] > p[size_t(b)]; });
                double top = 0;
                for (int kk = 0; kk < m.moe.experts_per_token; ++kk)
                    top += p[size_t(idx[size_t(kk)])];
                for (int kk = 0; kk < m.moe.experts_per_token; ++kk) {
                    const auto& ew = lw.experts[size_t(idx[size_t(kk)])];
                    const Vec ye = swiglu(ew.gate, ew.up, ew.down, xn, m.moe.expert_intermediate);
                    for (int64_t e = 0; e < h; ++e)
                        y[size_t(e)] += p[size_t(idx[size_t(kk)])] / top * ye[size_t(e)];
                }
            } else {
                y = swiglu(lw.gate, lw.up, lw.down, xn, m.intermediate);
            }
            for (int64_t e = 0; e < h; ++e) x[size_t(t)][size_t(e)] += y[size_t(e)];
        }
    }
    const Vec xn = rms(x.back(), w.final_norm, m.rms_norm_eps);
    const Vec lg = matvec(w.lm_head, xn, m.vocab);
    return std::vector<float>(lg.begin(), lg.end());
}

std::vector<std::vector<int32_t>> make_prompts(const std::vector<int>& lens, int vocab,
                                               uint32_t seed) {
    std::vector<std::vector<int32_t>> out;
    uint32_t s = seed;
    for (int len : lens) {
        std::vector<int32_t> p;
        for (int i = 0; i < len; ++i) {
            s = s * 1664525u + 1013904223u;
            p.push_back(int32_t((s >> 8) % uint32_t(vocab)));
        }
        out.push_back(p);
    }
    return out;
}

class ReferenceModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceModelTest, MatchesNaiveRecomputation) {
    const ModelSpec m = catalog_model(GetParam());
    const uint64_t seed = 7;
    const auto prompts = make_prompts({13, 20, 1}, m.vocab, 3);
    GenerationOptions opt;
    opt.max_new_tokens = 5;
    opt.block_size = 4;  // many blocks per sequence
    const auto src = random_tensor_source(seed);
    const GenerationReport r = generate(m, ParallelConfig{}, *src, prompts, opt);
    const ModelWeights w = random_weights(m, WeightShard::full(m), seed);
    for (size_t i = 0; i < prompts.size(); ++i) {
        std::vector<int32_t> seq = prompts[i];
        std::vector<float> logits;
        for (int step = 0; step < opt.max_new_tokens; ++step) {
            logits = naive_logits(w, seq);
            const int32_t tok = argmax(logits);
            ASSERT_EQ(r.tokens[i][size_t(step)], tok) << "prompt " << i << " step " << step;
            seq.push_back(tok);
        }
        EXPECT_LT(relative_l2(r.last_logits[i], logits), 1e-5) << "prompt " << i;
    }
    ASSERT_EQ(r.ranks.size(), 1u);
    // prompt + generated - 1 tokens are cached per sequence
    EXPECT_EQ(r.ranks[0].kv_tokens, (13 + 4) + (20 + 4) + (1 + 4));
    // Whole blocks: ceil(17 / 4) + ceil(24 / 4) + ceil(5 / 4) blocks of 4 tokens at fp32.
    EXPECT_EQ(r.ranks[0].kv_bytes,
              (5 + 6 + 2) * 4 * m.num_layers * 2 * m.num_kv_heads * m.head_dim * 4);
    EXPECT_EQ(r.ranks[0].kv_bytes, r.ranks[0].kv_bytes_predicted);
}

INSTANTIATE_TEST_SUITE_P(Models, ReferenceModelTest, ::testing::Values("tiny", "tiny-moe"));

TEST(ReferenceModel, BadTokenAndBadShapesAreErrors) {
    const ModelSpec m = catalog_model("tiny");
    const auto src = random_tensor_source(1);
    GenerationOptions opt;
    EXPECT_THROW(generate(m, ParallelConfig{}, *src, {{1, 2, 999}}, opt), Error);
    EXPECT_THROW(generate(m, ParallelConfig{}, *src, {{}}, opt), Error);
    ParallelConfig p;
    p.tp = 2;
    EXPECT_THROW(generate(m, p, *src, {{1, 2}}, opt), Error) << "2 ranks needed, 1 given";
}

TEST(ReferenceModel, RandomWeightsSliceLikeTheFullTensors) {
    const ModelSpec m = catalog_model("tiny-moe");
    const ModelWeights full = random_weights(m, WeightShard::full(m), 5);
    WeightShard s = WeightShard::full(m);
    s.layer_begin = 1;
    s.layer_end = 3;
    s.q_head_begin = 2;
    s.q_head_end = 4;
    s.kv_head_begin = 1;
    s.kv_head_end = 2;
    s.expert_begin = 4;
    s.expert_end = 6;
    const ModelWeights part = random_weights(m, s, 5);
    const int64_t h = m.hidden, d = m.head_dim;
    for (int l = 1; l < 3; ++l) {
        const auto& f = full.layers[size_t(l)];
        const auto& p = part.layers[size_t(l - 1)];
        for (int64_t r = 0; r < 2 * d; ++r)
            for (int64_t c = 0; c < h; ++c)
                ASSERT_EQ(p.wq[size_t(r * h + c)], f.wq[size_t((2 * d + r) * h + c)]);
        for (int64_t r = 0; r < d; ++r)
            for (int64_t c = 0; c < h; ++c)
                ASSERT_EQ(p.wk[size_t(r * h + c)], f.wk[size_t((d + r) * h + c)]);
        for (int64_t r = 0; r < h; ++r)
            for (int64_t c = 0; c < 2 * d; ++c)
                ASSERT_EQ(p.wo[size_t(r * 2 * d + c)],
                          f.wo[size_t(r * m.num_heads * d + 2 * d + c)]);
        ASSERT_EQ(p.experts.size(), 2u);
        EXPECT_EQ(p.experts[0].down, f.experts[4].down);
        EXPECT_EQ(p.router, f.router);
    }
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// Prompts sharing a 21-token prefix (5 full blocks of 4): later prompts reuse the first one's
// blocks and skip their computation, with the same tokens and logits as a run without the prefix
// cache.
TEST(ReferenceModel, PrefixCacheHitsSkipWorkAndChangeNothing) {
    for (const std::string name : {"tiny", "tiny-moe"}) {
        const ModelSpec m = catalog_model(name);
        auto prompts = make_prompts({21, 7, 3, 0}, m.vocab, 9);
        const auto shared = prompts[0];
        prompts[1].insert(prompts[1].begin(), shared.begin(),
                          shared.end());  // 28 tokens, 20 cached
        prompts[2].insert(prompts[2].begin(), shared.begin(),
                          shared.end());  // 24 tokens, 20 cached
        prompts[3].assign(shared.begin(),
                          shared.begin() + 20);  // 20 tokens all cached: recompute the last
        GenerationOptions opt;
        opt.max_new_tokens = 6;
        opt.block_size = 4;
        const auto src = random_tensor_source(3);
        const GenerationReport with = generate(m, ParallelConfig{}, *src, prompts, opt);
        opt.prefix_cache = false;
        const GenerationReport without = generate(m, ParallelConfig{}, *src, prompts, opt);
        EXPECT_EQ(with.tokens, without.tokens) << name;
        for (size_t i = 0; i < prompts.size(); ++i)
            EXPECT_LT(relative_l2(with.last_logits[i], without.last_logits[i]), 1e-5)
                << name << " prompt " << i;
        EXPECT_EQ(without.prefix_hit_tokens, 0);
        EXPECT_EQ(with.prefix_hit_tokens, 3 * 20) << name;
        EXPECT_EQ(with.computed_prompt_tokens, 21 + 8 + 4 + 1) << name;
        EXPECT_EQ(without.computed_prompt_tokens, 21 + 28 + 24 + 20) << name;
        // Shared blocks are stored once.
        EXPECT_EQ(without.ranks[0].kv_tokens - with.ranks[0].kv_tokens, 3 * 20) << name;
    }
}

}  // namespace
}  // namespace kvshard
