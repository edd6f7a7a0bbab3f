// Ring prefill (pass-KV, pass-Q) and decode merge (all-gather, Helix all-to-all) over the threads
// Communicator, against unsharded attention; bytes sent against the plan.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <random>
#include <vector>

#include "kvshard/comm/groups.h"
#include "kvshard/comm/threads.h"
#include "kvshard/exec/cp_ring.h"

namespace kvshard {
namespace {

struct Data {
    int hq, hkv, d;
    int64_t n;
    std::vector<float> q, k, v;  // [n][H][D]
};

Data make_data(int64_t n, int hq, int hkv, int d, unsigned seed) {
    Data x{hq, hkv, d, n, {}, {}, {}};
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.5f);
    x.q.resize(n * hq * d);
    x.k.resize(n * hkv * d);
    x.v.resize(n * hkv * d);
    for (auto* t : {&x.q, &x.k, &x.v})
        for (auto& e : *t) e = nd(rng);
    return x;
}

// Rows `pos` of t ([n][H][D]) restricted to heads [h0, h0 + h).
std::vector<float> slice(const std::vector<float>& t, int heads, int d,
                         const std::vector<int64_t>& pos, int h0, int h) {
    std::vector<float> out;
    for (int64_t p : pos)
        out.insert(out.end(), t.begin() + (p * heads + h0) * d,
                   t.begin() + (p * heads + h0 + h) * d);
    return out;
}

std::vector<float> unsharded(const Data& x, const std::vector<int64_t>& qpos,
                             std::vector<float>* lse = nullptr, int window = 0,
                             bool chunked = false) {
    std::vector<int64_t> all(x.n);
    for (int64_t i = 0; i < x.n; ++i) all[i] = i;
    const CpAttnShape s{x.hq, x.hkv, x.d, 1.0f / std::sqrt(float(x.d)), window, chunked};
    const auto q = slice(x.q, x.hq, x.d, qpos, 0, x.hq);
    std::vector<float> out(qpos.size() * x.hq * x.d), l(qpos.size() * x.hq);
    cp_partial_attention(s, q.data(), qpos, x.k.data(), x.v.data(), all, out.data(), l.data());
    if (lse) *lse = l;
    return out;
}

struct Case {
    int cp, tp;
    CpScheme scheme;
    int64_t cached, fresh;
    CpPrefillMode mode;
    int window = 0;  // sliding (or chunked) attention over this many positions; 0: full
    bool chunked = false;
};

// Whether the query at q sees the key at k: causal, and inside the window (computed here from the
// definitions, not with the library's helpers).
bool visible(const Case& c, int64_t q, int64_t k) {
    if (k > q) return false;
    if (c.window <= 0) return true;
    return c.chunked ? k / c.window == q / c.window : q - k < c.window;
}

// Partials a pass-Q prefill did not return (all masked) and its all-to-all bytes, summed over
// the ranks of the runs since the last reset.
int64_t skipped_partials = 0, all_to_all_bytes = 0;

void run_prefill(const Case& c) {
    const int hq = 4, hkv = 2, d = 8;
    const auto x = make_data(c.cached + c.fresh, hq, hkv, d, 5 + c.cp);
    CpTokenMap map(c.cp);
    map.append(c.cached, c.scheme, 4);
    map.append(c.fresh, c.scheme, 4);
    std::vector<int64_t> new_pos;
    for (int64_t p = c.cached; p < map.size(); ++p) new_pos.push_back(p);
    const auto want = unsharded(x, new_pos, nullptr, c.window, c.chunked);
    ParallelConfig pc;
    pc.cp = c.cp;
    pc.tp = c.tp;
    std::mutex mu;
    run_threads(pc.world_size(), [&](Communicator& world) {
        auto g = make_groups(world, pc);
        const int cr = g.coord.cp, tr = g.coord.tp;
        const int lhq = hq / c.tp, lhkv = hkv / c.tp;
        const CpAttnShape s{lhq, lhkv, d, 1.0f / std::sqrt(float(d)), c.window, c.chunked};
        const auto qp = map.positions(cr, c.cached);
        const auto kp = map.positions(cr);
        const auto q = slice(x.q, hq, d, qp, tr * lhq, lhq);
        const auto k = slice(x.k, hkv, d, kp, tr * lhkv, lhkv);
        const auto v = slice(x.v, hkv, d, kp, tr * lhkv, lhkv);
        std::vector<float> out(qp.size() * lhq * d, std::nanf(""));
        CpCommStats st;
        cp_prefill_attention(*g.cp, c.mode, s, map, c.cached, q.data(), k.data(), v.data(),
                             out.data(), &st);
        // bytes: exactly the plan's
        const int next = cp_ring_next(c.cp, cr);
        const int64_t fresh_next = map.count(next, c.cached), fresh_own = map.count(cr, c.cached);
        std::lock_guard lk(mu);
        // The partials returned: those of every other rank whose new queries see one of this
        // rank's keys (a pair with none would carry out 0 and lse -inf).
        int64_t returned = 0;
        for (int r = 0; r < c.cp; ++r) {
            if (r == cr) continue;
            bool sees = false;
            for (int64_t qq : map.positions(r, c.cached))
                for (int64_t kk : kp) sees = sees || visible(c, qq, kk);
            if (sees) returned += map.count(r, c.cached);
        }
        EXPECT_LE(returned, c.fresh - fresh_own);
        if (c.window == 0 && c.mode == CpPrefillMode::kPassKv) {
            EXPECT_EQ(st.ring, c.cp == 1 ? 0 : (map.size() - map.count(next)) * 2 * lhkv * d * 4);
            EXPECT_EQ(st.all_to_all, 0);
        } else if (c.window == 0) {
            EXPECT_EQ(st.ring, c.cp == 1 ? 0 : (c.fresh - fresh_next) * lhq * d * 4);
            EXPECT_EQ(st.all_to_all, returned * lhq * (d + 1) * 4);
        } else if (c.mode == CpPrefillMode::kPassQ) {
            EXPECT_EQ(st.all_to_all, returned * lhq * (d + 1) * 4);
        }
        if (c.mode == CpPrefillMode::kPassQ) {
            skipped_partials += (c.fresh - fresh_own) - returned;
            all_to_all_bytes += st.all_to_all;
        }
        for (size_t i = 0; i < qp.size(); ++i)
            for (int h = 0; h < lhq; ++h)
                for (int e = 0; e < d; ++e) {
                    const float w = want[((qp[i] - c.cached) * hq + tr * lhq + h) * d + e];
                    const float got = out[(i * lhq + h) * d + e];
                    ASSERT_NEAR(got, w, 1e-5f * (1 + std::abs(w)))
                        << "cp=" << c.cp << " tp=" << c.tp << " scheme=" << cp_scheme_name(c.scheme)
                        << " mode=" << cp_prefill_mode_name(c.mode) << " pos " << qp[i];
                }
    });
}

TEST(CpRing, PrefillEqualsUnshardedForEveryCpSchemeModeCachedPrefixAndTp) {
    for (int cp : {1, 2, 3, 4, 8})
        for (int tp : {1, 2})
            for (CpScheme s : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave})
                for (int64_t cached : {0, 11})
                    for (CpPrefillMode m : {CpPrefillMode::kPassKv, CpPrefillMode::kPassQ})
                        run_prefill({cp, tp, s, cached, 19, m});
}

// Windowed layers (sliding and chunked) over every scheme and mode, cached prefix or not: equal
// to unsharded windowed attention. The contiguous scheme shows what pass-Q saves: a rank's queries
// see no keys of the ranks after it (causal), nor under a window those far before, and those
// partials are not returned.
TEST(CpRing, WindowedPrefillEqualsUnshardedAndReturnsOnlyPartialsThatSeeKeys) {
    for (int cp : {2, 3, 4})
        for (CpScheme s : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave})
            for (int64_t cached : {0, 11})
                for (CpPrefillMode m : {CpPrefillMode::kPassKv, CpPrefillMode::kPassQ}) {
                    run_prefill({cp, 1, s, cached, 19, m, 5, false});
                    run_prefill({cp, 1, s, cached, 19, m, 8, true});
                }
    skipped_partials = all_to_all_bytes = 0;
    run_prefill({4, 1, CpScheme::kContiguous, 0, 40, CpPrefillMode::kPassQ});
    // 40 tokens of 10 per rank: rank r's queries see ranks 0..r; the partials of ranks r' < r over
    // rank r's keys (6 pairs of 10 tokens) are not returned.
    EXPECT_EQ(skipped_partials, 6 * 10);
    EXPECT_EQ(all_to_all_bytes, 6 * 10 * 4 * (8 + 1) * 4);  // the 6 pairs that see
    skipped_partials = all_to_all_bytes = 0;
    run_prefill({4, 1, CpScheme::kContiguous, 0, 40, CpPrefillMode::kPassQ, 10, false});
    // A window of 10: rank r's queries see ranks r - 1 and r only (3 pairs returned of 12).
    EXPECT_EQ(skipped_partials, 9 * 10);
    EXPECT_EQ(all_to_all_bytes, 3 * 10 * 4 * (8 + 1) * 4);
}

TEST(CpRing, PrefillWithFewerNewTokensThanRanksLeavesEmptyShards) {
    for (CpPrefillMode m : {CpPrefillMode::kPassKv, CpPrefillMode::kPassQ}) {
        run_prefill({8, 1, CpScheme::kZigzag, 0, 3, m});
        run_prefill({8, 1, CpScheme::kContiguous, 9, 2, m});
    }
}

TEST(CpRing, DecodeMergeEqualsUnshardedBothForms) {
    const int hq = 8, hkv = 2, d = 8;
    for (int cp : {1, 2, 3, 4, 8})
        for (CpDecodeMerge merge : {CpDecodeMerge::kAllGather, CpDecodeMerge::kAllToAll})
            for (int64_t n : {2, 29}) {  // n = 2 < cp: some ranks hold no token (LSE = -inf)
                const auto x = make_data(n, hq, hkv, d, 9);
                CpTokenMap map(cp);
                map.append(n - 1, CpScheme::kZigzag);
                map.append_generated(1, 16);
                const std::vector<int64_t> qpos = {n - 1};
                const auto want = unsharded(x, qpos);
                ParallelConfig pc;
                pc.cp = cp;
                std::mutex mu;
                run_threads(cp, [&](Communicator& world) {
                    const int c = world.rank();
                    const CpAttnShape s{hq, hkv, d, 1.0f / std::sqrt(float(d))};
                    const auto kp = map.positions(c);
                    const auto q = slice(x.q, hq, d, qpos, 0, hq);
                    const auto k = slice(x.k, hkv, d, kp, 0, hkv);
                    const auto v = slice(x.v, hkv, d, kp, 0, hkv);
                    std::vector<float> out(hq * d);
                    CpCommStats st;
                    cp_decode_attention(world, merge, s, q.data(), qpos, k.data(), v.data(), kp,
                                        out.data(), &st);
                    std::lock_guard lk(mu);
                    for (int e = 0; e < hq * d; ++e) {
                        ASSERT_FALSE(std::isnan(out[e]));
                        ASSERT_NEAR(out[e], want[e], 1e-5f * (1 + std::abs(want[e])))
                            << "cp=" << cp << " " << cp_decode_merge_name(merge) << " n=" << n;
                    }
                    // one layer of the plan's bytes (tiny-like: 8 heads, D = 8)
                    if (merge == CpDecodeMerge::kAllGather) {
                        EXPECT_EQ(st.total(), cp == 1 ? 0 : int64_t{cp - 1} * hq * (d + 1) * 4);
                    } else if (cp > 1) {
                        const auto mine = cp_helix_heads(hq, cp, c);
                        EXPECT_EQ(st.total(), (hq - mine.size()) * (d + 1) * 4 +
                                                  (cp - 1) * mine.size() * d * 4);
                    }
                });
            }
}

}  // namespace
}  // namespace kvshard
