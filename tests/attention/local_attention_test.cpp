// Sliding-window and chunked attention, learned sinks and MLA's absorbed form against plain
// computations written here from the definitions (docs/model.md), not from the kernels' helpers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "kvshard/attention/merge.h"
#include "kvshard/attention/paged_attention.h"

namespace kvshard {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

std::vector<float> randoms(size_t n, uint32_t seed) {
    std::mt19937 g(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (auto& x : v) x = u(g);
    return v;
}

struct Case {
    int window;
    bool chunked;
    int rows;  // query rows at the end of the sequence (1: decode, many: prefill)
};

class LocalAttention : public ::testing::TestWithParam<std::tuple<Case, PageOrder>> {};

// One sequence of 70 tokens in blocks of 8; the blocks wholly before every row's window are the
// null block 0, filled with NaN: a kernel that touched them would return NaN.
TEST_P(LocalAttention, MatchesMaskedSoftmaxAndNeverReadsBlocksBeforeTheWindow) {
    const auto [c, order] = GetParam();
    const int bs = 8, nkv = 2, nq = 4, d = 16, len = 70;
    PageGeometry g{.num_layers = 1,
                   .kv_factor = 2,
                   .num_heads = nkv,
                   .block_size = bs,
                   .head_dim = d,
                   .dtype = DType::kFp32,
                   .order = order};
    const int nblocks = (len + bs - 1) / bs;
    BlockPool pool(g, nblocks + 1);
    const auto keys = randoms(size_t(len * nkv * d), 1), vals = randoms(keys.size(), 2);
    const int64_t first_row_pos = len - c.rows;
    AttentionParams p{.num_q_heads = nq,
                      .num_kv_heads = nkv,
                      .head_dim = d,
                      .scale = 1.0f / std::sqrt(float(d)),
                      .causal = true,
                      .window = c.window,
                      .chunked = c.chunked};
    const int64_t first_visible = first_visible_position(p, first_row_pos);
    std::vector<int32_t> table;
    for (int b = 0; b < nblocks; ++b) table.push_back((b + 1) * bs <= first_visible ? 0 : b + 1);
    for (int kv = 0; kv < 2; ++kv) {
        float* z = pool.page_f32(0, kv, 0);
        std::fill(z, z + g.page_elems(), kNan);
    }
    for (int t = 0; t < len; ++t) {
        if (table[size_t(t / bs)] == 0) continue;
        for (int h = 0; h < nkv; ++h)
            for (int x = 0; x < d; ++x) {
                const int64_t e = g.elem_in_page(h, t % bs, x);
                pool.page_f32(0, 0, table[size_t(t / bs)])[e] = keys[size_t((t * nkv + h) * d + x)];
                pool.page_f32(0, 1, table[size_t(t / bs)])[e] = vals[size_t((t * nkv + h) * d + x)];
            }
    }
    PagedKv kv;
    kv.add_sequence(table, len, bs);
    QueryBatch qb;
    qb.add_sequence(c.rows, first_row_pos);
    const auto q = randoms(size_t(c.rows * nq * d), 3);
    std::vector<float> out(q.size()), lse(size_t(c.rows * nq));
    paged_attention(pool, 0, kv, qb, p, q.data(), out.data(), lse.data());

    for (int r = 0; r < c.rows; ++r) {
        const int64_t pos = first_row_pos + r;
        // The definition: sliding sees (pos - W, pos], chunked sees [pos - pos % C, pos].
        const int64_t lo =
            c.chunked ? pos - pos % c.window : std::max<int64_t>(0, pos - c.window + 1);
        for (int h = 0; h < nq; ++h) {
            const int kh = h / (nq / nkv);
            std::vector<double> s;
            double mx = -1e300;
            for (int64_t j = lo; j <= pos; ++j) {
                double a = 0;
                for (int x = 0; x < d; ++x)
                    a += double(q[size_t((r * nq + h) * d + x)]) *
                         keys[size_t((j * nkv + kh) * d + x)];
                s.push_back(a * p.scale);
                mx = std::max(mx, s.back());
            }
            double sum = 0;
            std::vector<double> o(size_t(d), 0.0);
            for (int64_t j = lo; j <= pos; ++j) {
                const double e = std::exp(s[size_t(j - lo)] - mx);
                sum += e;
                for (int x = 0; x < d; ++x)
                    o[size_t(x)] += e * vals[size_t((j * nkv + kh) * d + x)];
            }
            for (int x = 0; x < d; ++x)
                ASSERT_NEAR(out[size_t((r * nq + h) * d + x)], o[size_t(x)] / sum, 2e-5)
                    << "row " << r << " head " << h;
            EXPECT_NEAR(lse[size_t(r * nq + h)], mx + std::log(sum), 2e-4);
        }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, LocalAttention,
    ::testing::Combine(::testing::Values(Case{8, false, 1}, Case{8, false, 30}, Case{20, false, 1},
                                         Case{20, false, 40}, Case{16, true, 1}, Case{16, true, 33},
                                         Case{5, true, 12}),
                       ::testing::Values(PageOrder::kHnd, PageOrder::kNhd)));

TEST(AttentionSinks, EqualASoftmaxWithOneMoreLogitThatAddsNothing) {
    const int rows = 3, heads = 2, dim = 4, keys = 5;
    const auto s = randoms(size_t(rows * heads * keys), 7), v = randoms(size_t(keys * dim), 8);
    const std::vector<float> sinks{0.7f, -2.0f};
    std::vector<float> out(size_t(rows * heads * dim)), lse(size_t(rows * heads)), want(out.size()),
        want_lse(lse.size());
    for (int r = 0; r < rows; ++r)
        for (int h = 0; h < heads; ++h) {
            const float* sr = s.data() + (r * heads + h) * keys;
            double z = 0, zs = std::exp(double(sinks[size_t(h)]));
            for (int j = 0; j < keys; ++j) z += std::exp(double(sr[j]));
            lse[size_t(r * heads + h)] = float(std::log(z));
            want_lse[size_t(r * heads + h)] = float(std::log(z + zs));
            for (int x = 0; x < dim; ++x) {
                double a = 0;
                for (int j = 0; j < keys; ++j)
                    a += std::exp(double(sr[j])) * v[size_t(j * dim + x)];
                out[size_t((r * heads + h) * dim + x)] = float(a / z);
                want[size_t((r * heads + h) * dim + x)] = float(a / (z + zs));
            }
        }
    apply_attention_sinks(out.data(), lse.data(), rows, heads, dim, sinks.data());
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], want[i], 1e-6);
    for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], want_lse[i], 1e-5);
    // A row that saw no key: the sink takes all the weight.
    float o[2] = {kNan, kNan}, l = -std::numeric_limits<float>::infinity();
    const float sink = 1.5f;
    apply_attention_sinks(o, &l, 1, 1, 2, &sink);
    EXPECT_EQ(o[0], 0.0f);
    EXPECT_EQ(l, sink);
}

// The absorbed form (scores against the latent, W_uk folded into the query, W_uv after the sum)
// against the naive form that materializes every head's K = [W_uk c | k_pe] and V = W_uv c.
TEST(MlaAttention, AbsorbedFormEqualsNaiveForm) {
    const int H = 3, dn = 4, dr = 4, dl = 12, dv = 5, len = 21, bs = 4;
    PageGeometry g{.num_layers = 1,
                   .kv_factor = 1,
                   .num_heads = 1,
                   .block_size = bs,
                   .head_dim = dl + dr,
                   .dtype = DType::kFp32};
    const int nblocks = (len + bs - 1) / bs;
    BlockPool pool(g, nblocks);
    const auto latent = randoms(size_t(len * (dl + dr)), 11);
    std::vector<int32_t> table;
    for (int b = nblocks - 1; b >= 0; --b) table.push_back(b);  // scattered blocks
    PagedKv kv;
    kv.add_sequence(table, len, bs);
    std::vector<int64_t> slots;
    for (int t = 0; t < len; ++t) slots.push_back(t);
    const std::vector<int32_t> indptr{0, len};
    write_latent(pool, 0, kv, indptr, slots, latent.data());

    const auto wuk = randoms(size_t(H * dn * dl), 12), wuv = randoms(size_t(H * dv * dl), 13);
    const int rows = 6;
    const auto qn = randoms(size_t(rows * H * dn), 14), qp = randoms(size_t(rows * H * dr), 15);
    const float scale = 1.0f / std::sqrt(float(dn + dr));
    // Absorbed: q_lat = [W_uk^T q_nope | q_pe].
    std::vector<float> qlat(size_t(rows * H * (dl + dr)), 0.0f), olat(size_t(rows * H * dl));
    for (int r = 0; r < rows; ++r)
        for (int h = 0; h < H; ++h) {
            float* o = qlat.data() + (r * H + h) * (dl + dr);
            for (int i = 0; i < dn; ++i)
                for (int c = 0; c < dl; ++c)
                    o[c] += qn[size_t((r * H + h) * dn + i)] * wuk[size_t((h * dn + i) * dl + c)];
            for (int i = 0; i < dr; ++i) o[dl + i] = qp[size_t((r * H + h) * dr + i)];
        }
    QueryBatch qb;
    qb.add_sequence(rows, len - rows);
    mla_attention(pool, 0, kv, qb, MlaParams{H, dl, dr, scale}, qlat.data(), olat.data(), nullptr);

    for (int r = 0; r < rows; ++r) {
        const int pos = len - rows + r;
        for (int h = 0; h < H; ++h) {
            std::vector<double> s, vsum(size_t(dv), 0.0);
            double mx = -1e300, z = 0;
            for (int j = 0; j <= pos; ++j) {
                const float* c = latent.data() + j * (dl + dr);
                double a = 0;
                for (int i = 0; i < dn; ++i) {
                    double k = 0;
                    for (int x = 0; x < dl; ++x) k += wuk[size_t((h * dn + i) * dl + x)] * c[x];
                    a += qn[size_t((r * H + h) * dn + i)] * k;
                }
                for (int i = 0; i < dr; ++i) a += qp[size_t((r * H + h) * dr + i)] * c[dl + i];
                s.push_back(a * scale);
                mx = std::max(mx, s.back());
            }
            for (int j = 0; j <= pos; ++j) {
                const double e = std::exp(s[size_t(j)] - mx);
                z += e;
                const float* c = latent.data() + j * (dl + dr);
                for (int i = 0; i < dv; ++i) {
                    double v = 0;
                    for (int x = 0; x < dl; ++x) v += wuv[size_t((h * dv + i) * dl + x)] * c[x];
                    vsum[size_t(i)] += e * v;
                }
            }
            for (int i = 0; i < dv; ++i) {
                double got = 0;
                for (int x = 0; x < dl; ++x)
                    got += wuv[size_t((h * dv + i) * dl + x)] * olat[size_t((r * H + h) * dl + x)];
                EXPECT_NEAR(got, vsum[size_t(i)] / z, 1e-5) << "row " << r << " head " << h;
            }
        }
    }
}

}  // namespace
}  // namespace kvshard
