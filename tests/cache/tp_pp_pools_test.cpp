// One BlockManager drives the pools of a TP x PP group: tp=2 (different KV heads) x pp=2 (different
// layers), four pools of different contents sharing one block id space. Values encode their own
// coordinates (global layer, K/V, global head, position, dim, token), so a block written by the
// wrong sequence, a shared block with other tokens, or a head or layer on the wrong rank shows.
#include <gtest/gtest.h>

#include <numeric>

#include "kvshard/cache/block_manager.h"
#include "kvshard/cache/block_pool.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

constexpr int kBlockSize = 4;

float kv_value(int layer, int kv, int head, int64_t pos, int dim, int32_t token) {
    // < 2^20 before the fraction, 3 bits of fraction: exact in fp32.
    const int64_t code = ((int64_t{layer} * 2 + kv) * 4 + head) * 8 + dim;
    return static_cast<float>(code * 4096 + pos) + static_cast<float>(token & 7) * 0.125f;
}

struct Group {
    KvLayout layout;
    std::vector<BlockPool> pools;  // one per rank
    BlockManager manager;
};

Group make_group(int64_t budget_bytes) {
    ParallelConfig p;
    p.tp = 2;
    p.pp = 2;
    KvLayout layout = make_layout(catalog_model("tiny"), p);
    std::vector<PageGeometry> geoms;
    for (int r = 0; r < layout.world_size(); ++r)
        geoms.push_back(page_geometry(layout, r, kBlockSize));
    const int64_t blocks = num_blocks_for_budget(geoms, budget_bytes);
    std::vector<BlockPool> pools;
    for (const auto& g : geoms) pools.emplace_back(g, blocks);
    return Group{std::move(layout), std::move(pools), BlockManager({blocks, kBlockSize, true})};
}

// What an executor does after allocate/append: every rank writes its heads and layers of
// positions [from, n) into the blocks of the sequence's block table.
void write_kv(Group& g, SeqId seq, const std::vector<int32_t>& tokens, int64_t from) {
    const auto table = g.manager.block_table(seq);
    for (int r = 0; r < g.layout.world_size(); ++r) {
        const RankKv& rk = g.layout.ranks[static_cast<size_t>(r)];
        BlockPool& pool = g.pools[static_cast<size_t>(r)];
        const PageGeometry& geo = pool.geometry();
        for (int64_t pos = from; pos < static_cast<int64_t>(tokens.size()); ++pos) {
            const BlockId b = table[static_cast<size_t>(pos / kBlockSize)];
            const int slot = static_cast<int>(pos % kBlockSize);
            for (int l = 0; l < geo.num_layers; ++l)
                for (int kv = 0; kv < 2; ++kv) {
                    float* page = pool.page_f32(l, kv, b);
                    for (int h = 0; h < geo.num_heads; ++h)
                        for (int d = 0; d < geo.head_dim; ++d)
                            page[geo.elem_in_page(h, slot, d)] = kv_value(
                                rk.layer_begin + l, kv, rk.kv_heads[static_cast<size_t>(h)], pos, d,
                                tokens[static_cast<size_t>(pos)]);
                }
        }
    }
}

// Every rank holds exactly its own heads and layers of every token of the sequence.
void expect_kv(const Group& g, SeqId seq, const std::vector<int32_t>& tokens) {
    const auto table = g.manager.block_table(seq);
    ASSERT_EQ(g.manager.num_tokens(seq), static_cast<int64_t>(tokens.size()));
    for (int r = 0; r < g.layout.world_size(); ++r) {
        const RankKv& rk = g.layout.ranks[static_cast<size_t>(r)];
        const BlockPool& pool = g.pools[static_cast<size_t>(r)];
        const PageGeometry& geo = pool.geometry();
        for (int64_t pos = 0; pos < static_cast<int64_t>(tokens.size()); ++pos) {
            const BlockId b = table[static_cast<size_t>(pos / kBlockSize)];
            const int slot = static_cast<int>(pos % kBlockSize);
            for (int l = 0; l < geo.num_layers; ++l)
                for (int kv = 0; kv < 2; ++kv)
                    for (int h = 0; h < geo.num_heads; ++h)
                        for (int d = 0; d < geo.head_dim; ++d)
                            ASSERT_EQ(pool.page_f32(l, kv, b)[geo.elem_in_page(h, slot, d)],
                                      kv_value(rk.layer_begin + l, kv,
                                               rk.kv_heads[static_cast<size_t>(h)], pos, d,
                                               tokens[static_cast<size_t>(pos)]))
                                << "rank " << r << " seq " << seq << " pos " << pos << " layer "
                                << l << " head " << h;
        }
    }
}

std::vector<int32_t> iota_tokens(size_t n, int32_t start) {
    std::vector<int32_t> t(n);
    std::iota(t.begin(), t.end(), start);
    return t;
}

TEST(TpPpPools, BytesPerBlockMatchTheLayout) {
    Group g = make_group(16 * 1024);
    ASSERT_EQ(g.pools.size(), 4u);
    for (int r = 0; r < 4; ++r) {
        const RankKv& rk = g.layout.ranks[static_cast<size_t>(r)];
        const PageGeometry& geo = g.pools[static_cast<size_t>(r)].geometry();
        EXPECT_EQ(geo.block_bytes(), rk.kv_bytes_per_token * kBlockSize) << r;
        // tiny: 4 layers, 4 KV heads of 8 fp32 -> 2 layers x K,V x 2 heads x 8 x 4 B per token.
        EXPECT_EQ(rk.kv_bytes_per_token, 2 * 2 * 2 * 8 * 4) << r;
        EXPECT_EQ(geo.num_layers, 2);
        EXPECT_EQ(geo.num_heads, 2);
        EXPECT_EQ(g.pools[static_cast<size_t>(r)].arena_bytes(),
                  g.manager.num_blocks() * rk.kv_bytes_per_token * kBlockSize);
    }
    EXPECT_EQ(g.manager.num_blocks(), 16 * 1024 / (256 * kBlockSize));
    // The four ranks really hold different slices.
    EXPECT_NE(g.layout.ranks[0].kv_heads, g.layout.ranks[1].kv_heads);
    EXPECT_EQ(g.layout.ranks[0].kv_heads, g.layout.ranks[2].kv_heads);
    EXPECT_NE(g.layout.ranks[0].layer_begin, g.layout.ranks[2].layer_begin);
}

TEST(TpPpPools, SameBlockTablesDriveEveryRanksPool) {
    Group g = make_group(12 * 1024);  // 12 blocks of 1 KiB per rank
    ASSERT_EQ(g.manager.num_blocks(), 12);
    const auto a = iota_tokens(10, 100);
    g.manager.allocate(1, a);
    write_kv(g, 1, a, 0);
    auto b = a;
    b.resize(8);  // shares two full blocks with a
    for (int32_t t : {7, 7, 7, 7, 7}) b.push_back(t);
    const auto rb = g.manager.allocate(2, b);
    ASSERT_EQ(rb.cached_tokens, 8);
    write_kv(g, 2, b, rb.cached_tokens);  // only the uncached tokens are computed
    expect_kv(g, 1, a);
    expect_kv(g, 2, b);

    // Free a (its full blocks are still used by b); d comes and goes and leaves two cached
    // blocks; c's prompt then needs an eviction; the shared prefix must survive on every rank.
    g.manager.free(1);
    const auto d = iota_tokens(8, 900);
    g.manager.allocate(4, d);
    write_kv(g, 4, d, 0);
    g.manager.free(4);
    const auto c = iota_tokens(28, 500);
    const auto rc = g.manager.allocate(3, c);
    ASSERT_EQ(rc.cached_tokens, 0);
    write_kv(g, 3, c, 0);
    expect_kv(g, 2, b);
    expect_kv(g, 3, c);

    // Decode: appends on b land in fresh blocks on every rank.
    auto b2 = b;
    for (int32_t t : {1, 2, 3, 4, 5, 6}) b2.push_back(t);
    const int64_t before = g.manager.num_tokens(2);
    g.manager.append(2, std::span(b2).subspan(static_cast<size_t>(before)));
    write_kv(g, 2, b2, before);
    expect_kv(g, 2, b2);
    expect_kv(g, 3, c);
    EXPECT_EQ(g.manager.metrics().evictions, 2);
    EXPECT_EQ(g.manager.metrics().free_blocks + g.manager.metrics().cached_blocks, 0);
    g.manager.check_invariants();
}

TEST(TpPpPools, NhdConversionMovesEveryElement) {
    const Group g = make_group(4096);
    PageGeometry geo = g.pools[1].geometry();
    std::vector<float> hnd(static_cast<size_t>(geo.page_elems())), nhd(hnd.size()),
        back(hnd.size());
    PageGeometry h = geo, n = geo;
    h.order = PageOrder::kHnd;
    n.order = PageOrder::kNhd;
    for (int head = 0; head < geo.num_heads; ++head)
        for (int t = 0; t < geo.block_size; ++t)
            for (int d = 0; d < geo.head_dim; ++d)
                hnd[static_cast<size_t>(h.elem_in_page(head, t, d))] =
                    static_cast<float>((head * 100 + t) * 100 + d);
    convert_page(reinterpret_cast<const std::byte*>(hnd.data()), PageOrder::kHnd,
                 reinterpret_cast<std::byte*>(nhd.data()), PageOrder::kNhd, geo);
    for (int head = 0; head < geo.num_heads; ++head)
        for (int t = 0; t < geo.block_size; ++t)
            for (int d = 0; d < geo.head_dim; ++d)
                ASSERT_EQ(nhd[static_cast<size_t>(n.elem_in_page(head, t, d))],
                          static_cast<float>((head * 100 + t) * 100 + d));
    convert_page(reinterpret_cast<const std::byte*>(nhd.data()), PageOrder::kNhd,
                 reinterpret_cast<std::byte*>(back.data()), PageOrder::kHnd, geo);
    EXPECT_EQ(back, hnd);
}

TEST(TpPpPools, MlaHoldsOneLatentPerRank) {
    ParallelConfig p;
    p.tp = 2;
    const ModelSpec m = catalog_model("tiny-mla");
    const KvLayout layout = make_layout(m, p);
    for (int r = 0; r < layout.world_size(); ++r) {
        const PageGeometry geo = page_geometry(layout, r, 16);
        EXPECT_EQ(geo.kv_factor, 1);
        EXPECT_EQ(geo.num_heads, 1);
        EXPECT_EQ(geo.head_dim, m.mla.kv_lora_rank + m.mla.qk_rope_head_dim);
        EXPECT_EQ(geo.bytes_per_token(), layout.ranks[static_cast<size_t>(r)].kv_bytes_per_token);
    }
}

TEST(TpPpPools, BudgetBelowOneBlockIsAnError) {
    ParallelConfig p;
    p.tp = 2;
    p.pp = 2;
    const KvLayout layout = make_layout(catalog_model("tiny"), p);
    std::vector<PageGeometry> geoms{page_geometry(layout, 0, 16)};
    try {
        num_blocks_for_budget(geoms, 100);
        FAIL() << "no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("give at least 4096 bytes"), std::string::npos)
            << e.what();
    }
    EXPECT_THROW(page_geometry(layout, 4, 16), Error);
    EXPECT_THROW(page_geometry(layout, 0, 0), Error);
    EXPECT_THROW(BlockPool::from_budget(geoms[0], 100), Error);
}

}  // namespace
}  // namespace kvshard
