// The exact LSE merge of partial attention (attention/merge.h).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvshard/attention/merge.h"

namespace kvshard {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Softmax attention of one row over scores s and values v[j][dim], with its LSE.
void reference(const std::vector<float>& s, const std::vector<float>& v, int dim,
               std::vector<float>& o, float& lse) {
    double m = -kInf;
    for (float x : s) m = std::max<double>(m, x);
    double sum = 0;
    o.assign(dim, 0.0f);
    std::vector<double> acc(dim, 0.0);
    for (size_t j = 0; j < s.size(); ++j) {
        const double w = std::exp(s[j] - m);
        sum += w;
        for (int d = 0; d < dim; ++d) acc[d] += w * v[j * dim + d];
    }
    for (int d = 0; d < dim; ++d) o[d] = static_cast<float>(acc[d] / sum);
    lse = static_cast<float>(m + std::log(sum));
}

TEST(Merge, ShardedSoftmaxEqualsUnshardedOnRandomData) {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    const int dim = 8, keys = 40;
    for (int trial = 0; trial < 50; ++trial) {
        std::vector<float> s(keys), v(keys * dim);
        for (auto& x : s) x = nd(rng);
        for (auto& x : v) x = nd(rng);
        std::vector<float> want;
        float want_lse;
        reference(s, v, dim, want, want_lse);
        // random cut into up to 6 shards, some of them empty
        std::uniform_int_distribution<int> shard_of(0, 5);
        std::vector<std::vector<float>> ss(6), vs(6);
        for (int j = 0; j < keys; ++j) {
            const int sh = shard_of(rng);
            ss[sh].push_back(s[j]);
            vs[sh].insert(vs[sh].end(), v.begin() + j * dim, v.begin() + (j + 1) * dim);
        }
        std::vector<std::vector<float>> outs(6, std::vector<float>(dim, std::nanf("")));
        std::vector<float> lses(6, -kInf);
        for (int i = 0; i < 6; ++i)
            if (!ss[i].empty()) reference(ss[i], vs[i], dim, outs[i], lses[i]);
        std::vector<const float*> op, lp;
        for (int i = 0; i < 6; ++i) {
            op.push_back(outs[i].data());
            lp.push_back(&lses[i]);
        }
        std::vector<float> got(dim);
        float got_lse;
        merge_attention(op, lp, 1, dim, got.data(), &got_lse);
        EXPECT_NEAR(got_lse, want_lse, 1e-4f * std::abs(want_lse) + 1e-5f);
        for (int d = 0; d < dim; ++d) EXPECT_NEAR(got[d], want[d], 1e-4f * (1 + std::abs(want[d])));
        // the pairwise in-place form gives the same
        std::vector<float> acc(dim, std::nanf(""));
        float acc_lse = -kInf;
        for (int i = 0; i < 6; ++i)
            merge_attention_into(acc.data(), &acc_lse, op[i], lp[i], 1, dim);
        EXPECT_NEAR(acc_lse, want_lse, 1e-4f * std::abs(want_lse) + 1e-5f);
        for (int d = 0; d < dim; ++d) EXPECT_NEAR(acc[d], want[d], 1e-4f * (1 + std::abs(want[d])));
    }
}

TEST(Merge, EmptyShardHasWeightZeroEvenIfItsOutputIsNan) {
    const float nan = std::nanf("");
    std::vector<float> a = {1, 2, 3}, e = {nan, nan, nan};
    float la = 0.5f, le = -kInf;
    const float* outs[] = {e.data(), a.data(), e.data()};
    const float* lses[] = {&le, &la, &le};
    std::vector<float> o(3);
    float l;
    merge_attention(outs, lses, 1, 3, o.data(), &l);
    EXPECT_EQ(o, a);
    EXPECT_EQ(l, la);

    std::vector<float> acc = e;
    float acc_l = -kInf;
    merge_attention_into(acc.data(), &acc_l, a.data(), &la, 1, 3);
    merge_attention_into(acc.data(), &acc_l, e.data(), &le, 1, 3);
    EXPECT_EQ(acc, a);
    EXPECT_EQ(acc_l, la);
}

TEST(Merge, AllEmptyGivesMinusInfinityAndZerosNeverNan) {
    const float nan = std::nanf("");
    std::vector<float> e = {nan, nan};
    float le = -kInf;
    const float* outs[] = {e.data(), e.data()};
    const float* lses[] = {&le, &le};
    std::vector<float> o(2, 7.0f);
    float l = 0;
    merge_attention(outs, lses, 1, 2, o.data(), &l);
    EXPECT_EQ(l, -kInf);
    EXPECT_EQ(o, (std::vector<float>{0, 0}));

    std::vector<float> acc = e;
    float acc_l = -kInf;
    merge_attention_into(acc.data(), &acc_l, e.data(), &le, 1, 2);
    EXPECT_EQ(acc_l, -kInf);
    EXPECT_EQ(acc, (std::vector<float>{0, 0}));
    // zero partials: nothing to merge
    merge_attention({}, {}, 1, 2, o.data(), &l);
    EXPECT_EQ(l, -kInf);
}

TEST(Merge, ExtremeLsesNeitherOverflowNorLosePrecision) {
    // exp(80) overflows fp32 sums if not shifted by the max; 1e4 apart underflows the small one to
    // 0.
    std::vector<float> a = {1, 0}, b = {0, 1};
    for (float big : {80.0f, 1000.0f, 3e4f, -3e4f}) {
        float la = big, lb = big;
        const float* outs[] = {a.data(), b.data()};
        const float* lses[] = {&la, &lb};
        std::vector<float> o(2);
        float l;
        merge_attention(outs, lses, 1, 2, o.data(), &l);
        EXPECT_FLOAT_EQ(o[0], 0.5f);
        EXPECT_FLOAT_EQ(o[1], 0.5f);
        EXPECT_FLOAT_EQ(l, big + std::log(2.0f));
        std::vector<float> acc = a;
        float acc_l = la;
        merge_attention_into(acc.data(), &acc_l, b.data(), &lb, 1, 2);
        EXPECT_FLOAT_EQ(acc[0], 0.5f);
        EXPECT_FLOAT_EQ(acc_l, big + std::log(2.0f));
    }
    float la = 1e4f, lb = -1e4f;
    const float* outs[] = {a.data(), b.data()};
    const float* lses[] = {&la, &lb};
    std::vector<float> o(2);
    float l;
    merge_attention(outs, lses, 1, 2, o.data(), &l);
    EXPECT_EQ(o, a);
    EXPECT_EQ(l, la);
    for (float x : o) EXPECT_FALSE(std::isnan(x));
}

TEST(Merge, ManyRowsAreIndependent) {
    // row r: shard 0 empty for even rows
    const int rows = 4, dim = 2;
    std::vector<float> o0 = {9, 9, 1, 1, 9, 9, 1, 1}, o1 = {2, 2, 2, 2, 2, 2, 2, 2};
    std::vector<float> l0 = {-kInf, 0, -kInf, 0}, l1 = {0, 0, 0, 0};
    const float* outs[] = {o0.data(), o1.data()};
    const float* lses[] = {l0.data(), l1.data()};
    std::vector<float> o(rows * dim);
    std::vector<float> l(rows);
    merge_attention(outs, lses, rows, dim, o.data(), l.data());
    EXPECT_EQ(o, (std::vector<float>{2, 2, 1.5, 1.5, 2, 2, 1.5, 1.5}));
    EXPECT_FLOAT_EQ(l[0], 0.0f);
    EXPECT_FLOAT_EQ(l[1], std::log(2.0f));
}

}  // namespace
}  // namespace kvshard
