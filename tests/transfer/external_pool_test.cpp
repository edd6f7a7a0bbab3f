// Pools over memory the caller owns (an engine's KV tensor): written through write_kv as a
// prefill writes them and transferred TP=2 -> TP=1, the destination's bytes are identical to the
// same transfer between kvshard's own pools; the caller's bytes around and before are left alone.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "kvshard/attention/paged_attention.h"
#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {
namespace {

struct Aligned {
    explicit Aligned(size_t n) : bytes(n), p(static_cast<std::byte*>(std::aligned_alloc(64, n))) {}
    ~Aligned() { std::free(p); }
    size_t bytes;
    std::byte* p;
};

// K/V of token t, head h (global), element x: a value that encodes its coordinates.
float coord_value(int layer, int kv, int64_t t, int h, int x) {
    return float(layer * 100000 + kv * 50000 + t * 100 + h * 10 + x) * 1e-3f;
}

void prefill_write(BlockPool& pool, const RankKv& r, const std::vector<int32_t>& table,
                   int64_t tokens, int bs, int head_dim) {
    PagedKv kv;
    kv.add_sequence(table, tokens, bs);
    const std::vector<int32_t> indptr{0, int32_t(tokens)};
    std::vector<int64_t> slots;
    for (int64_t t = 0; t < tokens; ++t) slots.push_back(t);
    const int nh = r.num_kv_heads();
    for (int l = 0; l < r.num_layers(); ++l) {
        std::vector<float> k(size_t(tokens * nh * head_dim)), v(k.size());
        for (int64_t t = 0; t < tokens; ++t)
            for (int h = 0; h < nh; ++h)
                for (int x = 0; x < head_dim; ++x) {
                    const size_t at = size_t((t * nh + h) * head_dim + x);
                    k[at] = coord_value(r.layer_begin + l, 0, t, r.kv_heads[size_t(h)], x);
                    v[at] = coord_value(r.layer_begin + l, 1, t, r.kv_heads[size_t(h)], x);
                }
        write_kv(pool, l, kv, indptr, slots, k.data(), v.data());
    }
}

// Runs the plan between the given pools: every message packed from its source, unpacked into its
// destination.
void carry_out(const TransferPlan& plan, std::vector<BlockPool*> src, BlockPool& dst) {
    for (const TransferMessage& msg : plan.messages) {
        std::vector<std::byte> buf(size_t(msg.bytes));
        pack_message(plan, msg, TransferMode::kPreSend, *src[size_t(msg.src_rank)], buf);
        unpack_message(plan, msg, TransferMode::kPreSend, buf, dst);
    }
}

TEST(ExternalPool, TransferOverCallerMemoryIsByteIdenticalToOwnPools) {
    const ModelSpec m = catalog_model("tiny");
    const int bs = 8;
    const int64_t tokens = 37;
    TransferEndpoint src, dst;
    src.layout = make_layout(m, parse_parallel_config("tp=2"));
    dst.layout = make_layout(m, parse_parallel_config("tp=1"));
    src.block_size = dst.block_size = bs;
    src.block_tables = {{4, 1, 3, 0, 2}};  // scattered blocks
    dst.block_tables = {{2, 0, 4, 1, 3}};
    const TransferPlan plan = make_transfer_plan(src, dst, tokens);
    const int64_t nblocks = 6;

    // kvshard's own pools.
    std::vector<BlockPool> own_src;
    for (int r = 0; r < 2; ++r)
        own_src.emplace_back(rank_page_geometry(src.layout, r, bs, PageOrder::kHnd), nblocks);
    BlockPool own_dst(rank_page_geometry(dst.layout, 0, bs, PageOrder::kHnd), nblocks);
    for (int r = 0; r < 2; ++r)
        prefill_write(own_src[size_t(r)], src.layout.ranks[size_t(r)], src.block_tables[0], tokens,
                      bs, m.head_dim);
    carry_out(plan, {&own_src[0], &own_src[1]}, own_dst);

    // The same over caller buffers, each with 4 KiB of sentinel bytes after the arena.
    constexpr size_t kTail = 4096;
    std::vector<std::unique_ptr<Aligned>> bufs;
    std::vector<BlockPool> ext_src;
    for (int r = 0; r < 2; ++r) {
        const PageGeometry g = rank_page_geometry(src.layout, r, bs, PageOrder::kHnd);
        const size_t n = size_t(g.block_bytes() * nblocks);
        bufs.push_back(std::make_unique<Aligned>(n + kTail));
        std::memset(bufs.back()->p, 0x5a, n + kTail);
        ext_src.emplace_back(g, nblocks, ExternalMemory{bufs.back()->p, n});
        EXPECT_TRUE(ext_src.back().external());
        // Not cleared: the caller's bytes are as they were until written.
        EXPECT_EQ(ext_src.back().arena()[0], std::byte{0x5a});
    }
    const PageGeometry gd = rank_page_geometry(dst.layout, 0, bs, PageOrder::kHnd);
    const size_t nd = size_t(gd.block_bytes() * nblocks);
    Aligned dbuf(nd + kTail);
    std::memset(dbuf.p, 0, nd);
    std::memset(dbuf.p + nd, 0x5a, kTail);
    BlockPool ext_dst(gd, nblocks, ExternalMemory{dbuf.p, nd});
    for (int r = 0; r < 2; ++r) {
        std::memset(bufs[size_t(r)]->p, 0, bufs[size_t(r)]->bytes - kTail);
        prefill_write(ext_src[size_t(r)], src.layout.ranks[size_t(r)], src.block_tables[0], tokens,
                      bs, m.head_dim);
    }
    carry_out(plan, {&ext_src[0], &ext_src[1]}, ext_dst);

    ASSERT_EQ(ext_dst.arena_bytes(), own_dst.arena_bytes());
    EXPECT_EQ(std::memcmp(dbuf.p, own_dst.arena().data(), nd), 0)
        << "the destination over caller memory differs from kvshard's own pool";
    EXPECT_EQ(ext_dst.arena().data(), dbuf.p);  // the caller's bytes, not a copy
    for (size_t i = 0; i < kTail; ++i) ASSERT_EQ(dbuf.p[nd + i], std::byte{0x5a}) << i;
    for (int r = 0; r < 2; ++r)
        for (size_t i = 0; i < kTail; ++i)
            ASSERT_EQ(bufs[size_t(r)]->p[bufs[size_t(r)]->bytes - kTail + i], std::byte{0x5a});
    // And the transfer moved real values: token 36, head 3, element 5 of layer 2's V.
    const float* page = ext_dst.page_f32(2, 1, dst.block_tables[0][36 / bs]);
    EXPECT_EQ(page[gd.elem_in_page(3, 36 % bs, 5)], coord_value(2, 1, 36, 3, 5));
}

TEST(ExternalPool, BadMemoryIsRefusedWithWhatIsWrong) {
    const PageGeometry g{.num_layers = 2,
                         .kv_factor = 2,
                         .num_heads = 2,
                         .block_size = 4,
                         .head_dim = 8,
                         .dtype = DType::kFp32};
    Aligned buf(size_t(g.block_bytes() * 4) + 64);
    auto error_of = [&](ExternalMemory mem) {
        try {
            BlockPool p(g, 4, mem);
        } catch (const Error& e) {
            return std::string(e.what());
        }
        return std::string();
    };
    EXPECT_NE(error_of({nullptr, 1 << 20}).find("is null"), std::string::npos);
    EXPECT_NE(error_of({buf.p, size_t(g.block_bytes() * 4) - 1}).find("too small"),
              std::string::npos);
    EXPECT_NE(error_of({buf.p + 8, size_t(g.block_bytes() * 4)}).find("64-byte aligned"),
              std::string::npos);
    EXPECT_EQ(error_of({buf.p, size_t(g.block_bytes() * 4)}), "");
}

}  // namespace
}  // namespace kvshard
