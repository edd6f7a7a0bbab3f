// fp8 KV through pack/unpack: each destination block holds its source block's e4m3 codes and
// per-head scales unchanged, across TP and PP reshapes and both page orders; an fp8 plan between
// different block sizes or under CP is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "kvshard/common/error.h"
#include "transfer_harness.h"

namespace kvshard {
namespace {

// A value that encodes its coordinates, with a magnitude that varies by token (so blocks rescale).
float value(int layer, int kv, int head, int64_t token, int dim) {
    const float mag = 0.01f + float((token * 7 + head * 3 + layer) % 23);
    return mag * std::sin(float(1 + layer * 131 + kv * 71 + head * 17 + token * 5 + dim));
}

using Case = std::tuple<std::string, std::string, PageOrder>;
class Fp8Transfer : public ::testing::TestWithParam<Case> {};

TEST_P(Fp8Transfer, BlocksArriveWithTheirScales) {
    const auto [from, to, order] = GetParam();
    ModelSpec m = testing::llama_mini(4, 8, 16);
    m.kv_dtype = DType::kFp8;
    const int bs = 8;
    const int64_t tokens = 37;
    const TransferEndpoint src = testing::make_endpoint(m, from, bs, PageOrder::kHnd, tokens, 0, 3);
    const TransferEndpoint dst = testing::make_endpoint(m, to, bs, order, tokens, 0, 5);
    std::vector<std::unique_ptr<BlockPool>> sp, dp;
    for (int r = 0; r < src.layout.world_size(); ++r) {
        sp.push_back(std::make_unique<BlockPool>(rank_page_geometry(src.layout, r, bs, src.order),
                                                 testing::pool_blocks(src)));
        const RankKv& rk = src.layout.ranks[size_t(r)];
        std::vector<float> x(size_t(m.head_dim));
        for (int l = rk.layer_begin; l < rk.layer_end; ++l)
            for (int kv = 0; kv < 2; ++kv)
                for (int64_t t = 0; t < tokens; ++t)
                    for (int h = 0; h < rk.num_kv_heads(); ++h) {
                        for (int i = 0; i < m.head_dim; ++i)
                            x[size_t(i)] = value(l, kv, rk.kv_heads[size_t(h)], t, i);
                        store_vector(*sp.back(), l - rk.layer_begin, kv,
                                     src.block_tables[0][size_t(t / bs)], h, int(t % bs), x.data());
                    }
    }
    for (int r = 0; r < dst.layout.world_size(); ++r)
        dp.push_back(std::make_unique<BlockPool>(rank_page_geometry(dst.layout, r, bs, dst.order),
                                                 testing::pool_blocks(dst)));
    const TransferPlan plan = make_transfer_plan(src, dst, tokens);
    int64_t scales = 0;
    for (const TransferMessage& msg : plan.messages) {
        std::vector<std::byte> buf(size_t(msg.bytes));
        pack_message(plan, msg, TransferMode::kPreSend, *sp[size_t(msg.src_rank)], buf);
        unpack_message(plan, msg, TransferMode::kPreSend, buf, *dp[size_t(msg.dst_rank)]);
        std::vector<float> s(size_t(message_scales(plan, msg)));
        ASSERT_GT(s.size(), 0u);
        pack_scales(plan, msg, *sp[size_t(msg.src_rank)], s);
        unpack_scales(plan, msg, s, *dp[size_t(msg.dst_rank)]);
        scales += int64_t(s.size());
    }
    // Every destination (layer, K/V, head, block) holds the source's scale, and every token the
    // source's dequantized value, exactly.
    auto source_of = [&](int layer, int head) {
        for (int r = 0; r < src.layout.world_size(); ++r) {
            const RankKv& rk = src.layout.ranks[size_t(r)];
            if (layer >= rk.layer_begin && layer < rk.layer_end && head >= rk.kv_heads.front() &&
                head <= rk.kv_heads.back())
                return r;
        }
        return -1;
    };
    int64_t checked = 0;
    std::vector<float> spage, dpage;
    for (int r = 0; r < dst.layout.world_size(); ++r) {
        const RankKv& dk = dst.layout.ranks[size_t(r)];
        const BlockPool& dpool = *dp[size_t(r)];
        dpage.resize(size_t(dpool.geometry().page_elems()));
        for (int l = dk.layer_begin; l < dk.layer_end; ++l)
            for (int kv = 0; kv < 2; ++kv)
                for (int h = 0; h < dk.num_kv_heads(); ++h) {
                    const int gh = dk.kv_heads[size_t(h)];
                    const int s = source_of(l, gh);
                    ASSERT_GE(s, 0);
                    const RankKv& sk = src.layout.ranks[size_t(s)];
                    const BlockPool& spool = *sp[size_t(s)];
                    spage.resize(size_t(spool.geometry().page_elems()));
                    const int sh = gh - sk.kv_heads.front();
                    for (int64_t b = 0; b < (tokens + bs - 1) / bs; ++b) {
                        const int32_t sb = src.block_tables[0][size_t(b)];
                        const int32_t db = dst.block_tables[0][size_t(b)];
                        EXPECT_EQ(dpool.scale(l - dk.layer_begin, kv, db, h),
                                  spool.scale(l - sk.layer_begin, kv, sb, sh));
                        EXPECT_GT(dpool.scale(l - dk.layer_begin, kv, db, h), 0.0f);
                        dequantize_page(spool, l - sk.layer_begin, kv, sb, spage.data());
                        dequantize_page(dpool, l - dk.layer_begin, kv, db, dpage.data());
                        for (int64_t t = b * bs; t < std::min<int64_t>(tokens, (b + 1) * bs); ++t)
                            for (int i = 0; i < m.head_dim; ++i) {
                                const float want = spage[size_t(
                                    spool.geometry().elem_in_page(sh, int(t % bs), i))];
                                ASSERT_EQ(
                                    dpage[size_t(dpool.geometry().elem_in_page(h, int(t % bs), i))],
                                    want)
                                    << "layer " << l << " kv " << kv << " head " << gh << " token "
                                    << t;
                                // and close to the value written (the fp8 rounding)
                                ASSERT_NEAR(want, value(l, kv, gh, t, i),
                                            std::fabs(value(l, kv, gh, t, i)) / 15 + 0.05f);
                                ++checked;
                            }
                    }
                }
    }
    EXPECT_EQ(checked, int64_t{m.num_layers} * 2 * m.num_kv_heads * tokens * m.head_dim *
                           dst.layout.head_replication());
    EXPECT_GT(scales, 0);
}

INSTANTIATE_TEST_SUITE_P(Reshapes, Fp8Transfer,
                         ::testing::Values(Case{"tp=1", "tp=2", PageOrder::kHnd},
                                           Case{"tp=2,pp=2", "tp=4", PageOrder::kNhd},
                                           Case{"tp=8", "pp=2,tp=2", PageOrder::kHnd},
                                           Case{"tp=4", "tp=16", PageOrder::kHnd}));

TEST(Fp8Transfer, OtherBlockSizesAndCpAreRefused) {
    ModelSpec m = testing::llama_mini(4, 8, 16);
    m.kv_dtype = DType::kFp8;
    const auto a = testing::make_endpoint(m, "tp=1", 8, PageOrder::kHnd, 20);
    const auto b = testing::make_endpoint(m, "tp=2", 16, PageOrder::kHnd, 20);
    const auto c = testing::make_endpoint(m, "cp=2", 8, PageOrder::kHnd, 20);
    EXPECT_THROW(make_transfer_plan(a, b, 20), Error);
    EXPECT_THROW(make_transfer_plan(c, a, 20), Error);
    m.kv_dtype = DType::kBf16;  // bf16 moves pages only: other block sizes are fine
    const auto a16 = testing::make_endpoint(m, "tp=1", 8, PageOrder::kHnd, 20);
    const auto b16 = testing::make_endpoint(m, "tp=2", 16, PageOrder::kHnd, 20);
    const TransferPlan p = make_transfer_plan(a16, b16, 20);
    EXPECT_EQ(message_scales(p, p.messages.front()), 0);
    EXPECT_EQ(p.elem_size, 2);
}

// A destination whose cached prefix ends mid-block: the moved tokens' block scale would replace the
// scale its cached tokens of that block were quantized with, so they would decode wrong (1.0 read
// back as 128). Refused, naming the block boundaries that work; a prefix ending on one moves the
// rest and leaves the cached block as it was.
TEST(Fp8Transfer, CachedPrefixEndingMidBlockIsRefused) {
    ModelSpec m = catalog_model("tiny");
    m.kv_dtype = DType::kFp8;
    const int bs = 4;
    const int64_t L = 10;
    const auto src = testing::make_endpoint(m, "tp=1", bs, PageOrder::kHnd, L);
    const auto dst = testing::make_endpoint(m, "tp=1", bs, PageOrder::kHnd, L);
    auto refused = [&](int64_t cached) {
        try {
            make_transfer_plan(src, dst, L, {.dst_cached_tokens = cached});
        } catch (const Error& e) {
            return std::string(e.what());
        }
        return std::string("accepted");
    };
    const std::string mid = refused(2);
    EXPECT_NE(mid.find("cached prefix must end on a block boundary: use 0 or 4 cached tokens"),
              std::string::npos)
        << mid;
    EXPECT_NE(mid.find("(2 tokens, blocks of 4)"), std::string::npos) << mid;
    // 12 is past the 10 tokens: only 8 is offered.
    const std::string late = refused(9);
    EXPECT_NE(late.find("block boundary: use 8 cached tokens"), std::string::npos) << late;
    EXPECT_EQ(late.find("use 8 or"), std::string::npos) << late;

    // On a boundary: the destination's cached block 0 keeps its codes and scale, the rest arrives.
    const int64_t cached = 4;
    const TransferPlan plan = make_transfer_plan(src, dst, L, {.dst_cached_tokens = cached});
    const PageGeometry g = rank_page_geometry(src.layout, 0, bs, PageOrder::kHnd);
    BlockPool sp(g, 3), dp(g, 3);
    // The destination computed its prefix itself: values of magnitude 1; the source's of 100.
    auto val = [&](int64_t t, int x, bool source) {
        return (source ? 100.0f : 1.0f) * (1 + 0.125f * float(x % 4)) * float(1 + t);
    };
    std::vector<float> v(size_t(g.head_dim));
    for (int l = 0; l < g.num_layers; ++l)
        for (int kv = 0; kv < 2; ++kv)
            for (int h = 0; h < g.num_heads; ++h)
                for (int64_t t = 0; t < L; ++t) {
                    for (int x = 0; x < g.head_dim; ++x) v[size_t(x)] = val(t, x, true);
                    store_vector(sp, l, kv, t / bs, h, int(t % bs), v.data());
                    if (t >= cached) continue;
                    for (int x = 0; x < g.head_dim; ++x) v[size_t(x)] = val(t, x, false);
                    store_vector(dp, l, kv, t / bs, h, int(t % bs), v.data());
                }
    std::vector<float> before(size_t(g.page_elems()));
    dequantize_page(dp, 0, 0, 0, before.data());
    for (const TransferMessage& msg : plan.messages) {
        for (const TransferPiece& p : msg.pieces) EXPECT_GE(p.token_begin, cached);
        std::vector<std::byte> buf(size_t(msg.bytes));
        pack_message(plan, msg, TransferMode::kPreSend, sp, buf);
        unpack_message(plan, msg, TransferMode::kPreSend, buf, dp);
        std::vector<float> sc(size_t(message_scales(plan, msg)));
        pack_scales(plan, msg, sp, sc);
        unpack_scales(plan, msg, sc, dp);
    }
    std::vector<float> page(size_t(g.page_elems())), want(size_t(g.page_elems()));
    dequantize_page(dp, 0, 0, 0, page.data());
    EXPECT_EQ(page, before);  // the cached block untouched
    dequantize_page(dp, 0, 0, 1, page.data());
    dequantize_page(sp, 0, 0, 1, want.data());
    EXPECT_EQ(page, want);  // a moved block: the source's codes and scale
}

}  // namespace
}  // namespace kvshard
