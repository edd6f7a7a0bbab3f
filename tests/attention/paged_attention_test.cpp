// The fast attention kernels (streaming decode, sgemm prefill) against the plain two-pass
// reference, over paged KV with scattered blocks, GQA groups, both page orders, causal and CP-style
// positions.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>

#include "kvshard/attention/paged_attention.h"

namespace kvshard {
namespace {

struct Case {
    int nq, nkv, d, bs;
    PageOrder order;
    std::vector<int64_t> cached;  // tokens already in the cache per sequence
    std::vector<int64_t> fresh;   // new query rows per sequence
};

// Fills the pool with values and runs both kernels; returns the max abs difference of out and lse.
std::pair<double, double> run_case(const Case& c, bool causal, bool with_kv_pos, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    PageGeometry g{.num_layers = 2,
                   .kv_factor = 2,
                   .num_heads = c.nkv,
                   .block_size = c.bs,
                   .head_dim = c.d,
                   .dtype = DType::kFp32,
                   .order = c.order};
    int64_t blocks_needed = 0;
    for (size_t i = 0; i < c.cached.size(); ++i)
        blocks_needed += (c.cached[i] + c.fresh[i] + c.bs - 1) / c.bs;
    BlockPool pool(g, blocks_needed + 7);
    // Scattered block ids: a shuffled permutation.
    std::vector<int32_t> ids(size_t(pool.num_blocks()));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    PagedKv kv;
    QueryBatch qb;
    size_t next = 0;
    for (size_t i = 0; i < c.cached.size(); ++i) {
        const int64_t len = c.cached[i] + c.fresh[i];
        std::vector<int32_t> blocks;
        for (int64_t b = 0; b < (len + c.bs - 1) / c.bs; ++b) blocks.push_back(ids[next++]);
        kv.add_sequence(blocks, len, c.bs);
        qb.add_sequence(c.fresh[i], c.cached[i]);
        if (with_kv_pos) {
            // slot j holds position 2j (a CP rank holding every other token); queries at
            // 2*(cached+t)+1
            if (qb.kv_pos_indptr.empty()) qb.kv_pos_indptr.push_back(0);
            for (int64_t j = 0; j < len; ++j) qb.kv_pos.push_back(2 * j);
            qb.kv_pos_indptr.push_back(int64_t(qb.kv_pos.size()));
        }
    }
    if (with_kv_pos)
        for (auto& pos : qb.q_pos) pos = 2 * pos + 1;
    for (auto& b : pool.arena()) b = std::byte{0};
    for (int l = 0; l < 2; ++l)
        for (int kvi = 0; kvi < 2; ++kvi)
            for (int64_t b = 0; b < pool.num_blocks(); ++b) {
                float* pg = pool.page_f32(l, kvi, b);
                for (int64_t e = 0; e < g.page_elems(); ++e) pg[e] = u(rng);
            }
    const int64_t rows = qb.rows();
    std::vector<float> q(size_t(rows * c.nq * c.d));
    for (auto& x : q) x = 2.0f * u(rng);
    AttentionParams p{.num_q_heads = c.nq,
                      .num_kv_heads = c.nkv,
                      .head_dim = c.d,
                      .scale = 1.0f / std::sqrt(float(c.d)),
                      .causal = causal};
    std::vector<float> o1(q.size(), 7.f), o2(q.size(), 9.f), l1(size_t(rows * c.nq)), l2(l1.size());
    paged_attention(pool, 1, kv, qb, p, q.data(), o1.data(), l1.data());
    paged_attention_reference(pool, 1, kv, qb, p, q.data(), o2.data(), l2.data());
    double dout = 0, dlse = 0;
    for (size_t i = 0; i < o1.size(); ++i) dout = std::max(dout, double(std::fabs(o1[i] - o2[i])));
    for (size_t i = 0; i < l1.size(); ++i) {
        if (std::isinf(l2[i])) {
            EXPECT_TRUE(std::isinf(l1[i]) && l1[i] < 0)
                << "row " << i << " sees no key: lse must be -inf";
            continue;
        }
        dlse = std::max(dlse, double(std::fabs(l1[i] - l2[i])));
    }
    return {dout, dlse};
}

class PagedAttentionTest : public ::testing::TestWithParam<std::tuple<int, int, PageOrder, bool>> {
};

TEST_P(PagedAttentionTest, MatchesReference) {
    const auto [nq, nkv, order, with_kv_pos] = GetParam();
    const std::vector<Case> cases = {
        // decode: one row per sequence over various cached lengths (streaming path)
        {nq, nkv, 16, 16, order, {0, 1, 15, 16, 17, 100}, {1, 1, 1, 1, 1, 1}},
        // decode at the head sizes with unrolled kernels (64, 128), over many blocks (prefetch)
        {nq, nkv, 64, 16, order, {0, 33, 300}, {1, 1, 1}},
        {nq, nkv, 128, 16, order, {5, 64}, {1, 1}},
        // blocks larger than one kernel step (64 keys), other head sizes
        {nq, nkv, 64, 128, order, {0, 200}, {1, 1}},
        {nq, nkv, 40, 80, order, {3, 150}, {1, 2}},
        {nq, nkv, 24, 256, order, {300}, {1}},
        // prefill from scratch and with a cached prefix (GEMM path), lengths across block and tile
        // edges
        {nq, nkv, 16, 16, order, {0, 120, 7}, {40, 160, 129}},
        // small block size, head_dim not a multiple of 8
        {nq, nkv, 12, 4, order, {5, 0}, {3, 70}},
    };
    uint32_t seed = 1;
    for (const auto& c : cases)
        for (bool causal : {true, false}) {
            const auto [dout, dlse] = run_case(c, causal, with_kv_pos, seed++);
            EXPECT_LT(dout, 2e-5) << "nq=" << nq << " nkv=" << nkv << " d=" << c.d
                                  << " causal=" << causal;
            EXPECT_LT(dlse, 2e-5) << "nq=" << nq << " nkv=" << nkv << " d=" << c.d
                                  << " causal=" << causal;
        }
}

INSTANTIATE_TEST_SUITE_P(Heads, PagedAttentionTest,
                         ::testing::Combine(::testing::Values(4, 8), ::testing::Values(1, 2, 4),
                                            ::testing::Values(PageOrder::kHnd, PageOrder::kNhd),
                                            ::testing::Bool()));

TEST(PagedAttention, RowWithNoVisibleKeyIsZeroWithMinusInfLse) {
    PageGeometry g{.num_layers = 1, .kv_factor = 2, .num_heads = 1, .block_size = 4, .head_dim = 8};
    BlockPool pool(g, 2);
    PagedKv kv;
    kv.add_sequence({1}, 3, 4);
    QueryBatch qb;
    qb.add_sequence(1, 0);
    qb.kv_pos = {5, 6, 7};  // every key is later than the query at position 0
    qb.kv_pos_indptr = {0, 3};
    std::vector<float> q(8, 1.f), out(8, 3.f), lse(1, 0.f);
    AttentionParams p{.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 8, .scale = 1.f};
    paged_attention(pool, 0, kv, qb, p, q.data(), out.data(), lse.data());
    for (float x : out) EXPECT_EQ(x, 0.f);
    EXPECT_TRUE(std::isinf(lse[0]) && lse[0] < 0);
}

TEST(PagedAttention, WriteKvPlacesHeadsInTheirPages) {
    PageGeometry g{.num_layers = 2, .kv_factor = 2, .num_heads = 2, .block_size = 4, .head_dim = 3};
    BlockPool pool(g, 4);
    PagedKv kv;
    kv.add_sequence({3, 1}, 6, 4);
    // token t, head h, dim x -> 100t + 10h + x (K), negated for V
    std::vector<float> k, v;
    std::vector<int64_t> slots;
    for (int t = 0; t < 6; ++t) {
        slots.push_back(t);
        for (int h = 0; h < 2; ++h)
            for (int x = 0; x < 3; ++x) {
                k.push_back(100.f * t + 10.f * h + x);
                v.push_back(-(100.f * t + 10.f * h + x));
            }
    }
    const std::vector<int32_t> indptr{0, 6};
    write_kv(pool, 1, kv, indptr, slots, k.data(), v.data());
    for (int t = 0; t < 6; ++t)
        for (int h = 0; h < 2; ++h)
            for (int x = 0; x < 3; ++x) {
                const int blk = t < 4 ? 3 : 1;
                EXPECT_EQ(pool.page_f32(1, 0, blk)[g.elem_in_page(h, t % 4, x)],
                          100.f * t + 10.f * h + x);
                EXPECT_EQ(pool.page_f32(1, 1, blk)[g.elem_in_page(h, t % 4, x)],
                          -(100.f * t + 10.f * h + x));
                EXPECT_EQ(pool.page_f32(0, 0, blk)[g.elem_in_page(h, t % 4, x)], 0.f)
                    << "layer 0 untouched";
            }
}

}  // namespace
}  // namespace kvshard
