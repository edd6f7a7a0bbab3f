// Positioned partial attention + the ring schedule + the merge give unsharded causal attention,
// for every scheme, with and without a cached prefix (one process: the ring is walked by hand here;
// cp_ring_test.cpp runs it over a Communicator).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvshard/attention/merge.h"
#include "kvshard/exec/cp_attention.h"
#include "kvshard/layout/cp_plan.h"

namespace kvshard {
namespace {

struct Data {
    CpAttnShape shape;
    int64_t n = 0;
    std::vector<float> q, k, v;  // [n][H][D], every position
    std::vector<int64_t> all_pos;
};

Data make_data(int64_t n, int hq, int hkv, int d, unsigned seed) {
    Data x;
    x.shape = {hq, hkv, d, 1.0f / std::sqrt(float(d))};
    x.n = n;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.5f);
    x.q.resize(n * hq * d);
    x.k.resize(n * hkv * d);
    x.v.resize(n * hkv * d);
    for (auto* t : {&x.q, &x.k, &x.v})
        for (auto& e : *t) e = nd(rng);
    for (int64_t i = 0; i < n; ++i) x.all_pos.push_back(i);
    return x;
}

std::vector<float> gather(const std::vector<float>& t, const std::vector<int64_t>& pos, int row) {
    std::vector<float> out;
    for (int64_t p : pos) out.insert(out.end(), t.begin() + p * row, t.begin() + (p + 1) * row);
    return out;
}

TEST(CpAttention, PositionedKernelSkipsFutureKeysAndEmptyShards) {
    auto x = make_data(6, 2, 1, 4, 1);
    std::vector<int64_t> qp = {0}, kp = {3, 5};
    std::vector<float> out(2 * 4, 9.0f), lse(2, 0.0f);
    cp_partial_attention(x.shape, x.q.data(), qp, x.k.data(), x.v.data(), kp, out.data(),
                         lse.data());
    for (float l : lse) EXPECT_EQ(l, -std::numeric_limits<float>::infinity());
    for (float o : out) EXPECT_EQ(o, 0.0f);
    cp_partial_attention(x.shape, x.q.data(), qp, x.k.data(), x.v.data(), {}, out.data(),
                         lse.data());
    for (float l : lse) EXPECT_EQ(l, -std::numeric_limits<float>::infinity());
}

// Walks the pass-KV ring for every rank and compares with unsharded attention of the new tokens.
void check_ring(int cp, CpScheme scheme, int64_t cached, int64_t fresh, int hq, int hkv) {
    const int d = 8;
    const auto x = make_data(cached + fresh, hq, hkv, d, 11 + cp);
    CpTokenMap map(cp);
    map.append(cached, scheme, 4);
    map.append(fresh, scheme, 4);
    const int qrow = hq * d, kvrow = hkv * d;
    // unsharded
    std::vector<int64_t> new_pos;
    for (int64_t p = cached; p < cached + fresh; ++p) new_pos.push_back(p);
    const auto qn = gather(x.q, new_pos, qrow);
    std::vector<float> want(fresh * qrow), want_lse(fresh * hq);
    cp_partial_attention(x.shape, qn.data(), new_pos, x.k.data(), x.v.data(), x.all_pos,
                         want.data(), want_lse.data());
    for (int c = 0; c < cp; ++c) {
        const auto qp = map.positions(c, cached);
        const auto qc = gather(x.q, qp, qrow);
        std::vector<float> acc(qp.size() * qrow, 0.0f),
            acc_lse(qp.size() * hq, -std::numeric_limits<float>::infinity());
        std::vector<float> part(acc.size()), part_lse(acc_lse.size());
        for (const auto& st : cp_ring_schedule(cp, c)) {
            const auto kp = map.positions(st.holds);
            const auto kc = gather(x.k, kp, kvrow), vc = gather(x.v, kp, kvrow);
            cp_partial_attention(x.shape, qc.data(), qp, kc.data(), vc.data(), kp, part.data(),
                                 part_lse.data());
            merge_attention_into(acc.data(), acc_lse.data(), part.data(), part_lse.data(),
                                 static_cast<int64_t>(qp.size()) * hq, d);
        }
        for (size_t i = 0; i < qp.size(); ++i) {
            const int64_t row = qp[i] - cached;
            for (int e = 0; e < qrow; ++e)
                ASSERT_NEAR(acc[i * qrow + e], want[row * qrow + e],
                            1e-5f * (1 + std::abs(want[row * qrow + e])))
                    << "cp=" << cp << " rank " << c << " pos " << qp[i];
            for (int h = 0; h < hq; ++h)
                ASSERT_NEAR(acc_lse[i * hq + h], want_lse[row * hq + h], 1e-4f);
        }
    }
}

TEST(CpAttention, RingWalkEqualsUnshardedForEverySchemeWithAndWithoutCachedPrefix) {
    for (int cp : {1, 2, 3, 4, 8})
        for (CpScheme s : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave})
            for (int64_t cached : {0, 13}) {
                check_ring(cp, s, cached, 21, 4, 2);
                check_ring(cp, s, cached, 5, 2, 2);  // fewer new tokens than ranks: empty shards
            }
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {
// The vectorised path (ascending keys) and the general one (any order) agree: several query rows
// (prefill tiles), and one row over many keys (decode: 16-key tiles with prefetch ahead), at a
// small head size and at 128 (the unrolled kernel).
TEST(CpAttention, AscendingAndShuffledKeysGiveTheSameResult) {
    struct Case {
        int64_t n;
        int hq, hkv, d;
        std::vector<int64_t> qp;
    };
    for (const Case& c : {Case{150, 4, 2, 16, {3, 70, 149}}, Case{300, 8, 2, 128, {299}},
                          Case{75, 4, 4, 128, {60}}}) {
        auto x = make_data(c.n, c.hq, c.hkv, c.d, 3);
        std::vector<int64_t> kp(static_cast<size_t>(c.n));
        for (int64_t i = 0; i < c.n; ++i) kp[i] = i;
        const int qrow = c.hq * c.d, kvrow = c.hkv * c.d;
        const auto q = gather(x.q, c.qp, qrow);
        const size_t nq = c.qp.size();
        std::vector<float> a(nq * qrow), al(nq * c.hq), b(a.size()), bl(al.size());
        cp_partial_attention(x.shape, q.data(), c.qp, x.k.data(), x.v.data(), kp, a.data(),
                             al.data());
        std::vector<int64_t> perm(kp.rbegin(), kp.rend());  // descending: the general path
        const auto k = gather(x.k, perm, kvrow), v = gather(x.v, perm, kvrow);
        cp_partial_attention(x.shape, q.data(), c.qp, k.data(), v.data(), perm, b.data(),
                             bl.data());
        for (size_t i = 0; i < a.size(); ++i)
            EXPECT_NEAR(a[i], b[i], 1e-5f * (1 + std::abs(b[i]))) << "n=" << c.n << " d=" << c.d;
        for (size_t i = 0; i < al.size(); ++i) EXPECT_NEAR(al[i], bl[i], 1e-4f) << "n=" << c.n;
    }
}
}  // namespace
}  // namespace kvshard
