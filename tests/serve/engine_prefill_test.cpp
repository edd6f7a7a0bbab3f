// A prefill of the reference model whose KV lands in memory the caller owns (engine_prefill.h):
// the caller's pools hold, block for block, what the same prefill writes into kvshard's own pools,
// the bytes it did not write (other blocks, the last block's free slots) are left as they were, and
// a transfer from those pools delivers what a transfer from kvshard's own pools delivers. The
// logits are the unsharded model's.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/engine_prefill.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {
namespace {

struct Aligned {
    explicit Aligned(size_t n) : bytes(n), p(static_cast<std::byte*>(std::aligned_alloc(64, n))) {
        std::memset(p, 0x5a, n);  // the caller's bytes before the prefill
    }
    ~Aligned() { std::free(p); }
    size_t bytes;
    std::byte* p;
};

std::vector<int32_t> prompt(int n, int vocab) {
    std::vector<int32_t> t;
    uint32_t s = 99;
    for (int i = 0; i < n; ++i) {
        s = s * 1664525u + 1013904223u;
        t.push_back(int32_t((s >> 8) % uint32_t(vocab)));
    }
    return t;
}

class EnginePrefill : public ::testing::TestWithParam<const char*> {};

TEST_P(EnginePrefill, CallerMemoryHoldsWhatOwnPoolsHoldAndTransfersTheSame) {
    const ModelSpec m = catalog_model("tiny");
    const KvLayout layout = make_layout(m, parse_parallel_config(GetParam()));
    const int bs = 8;
    const auto tokens = prompt(37, m.vocab);
    const std::vector<int32_t> table{5, 2, 7, 0, 3};  // the engine's blocks, scattered
    const int64_t nblocks = 8;
    const auto weights = random_tensor_source(3);
    const EnginePrefillOptions opt{.block_size = bs};

    std::vector<std::vector<std::vector<std::byte>>> own;
    const auto own_logits =
        prefill_into_own_pools(layout, *weights, tokens, table, nblocks, own, opt);

    std::vector<std::unique_ptr<Aligned>> bufs;
    std::vector<std::vector<ExternalMemory>> mem;
    std::vector<PageGeometry> geo;
    for (int r = 0; r < layout.world_size(); ++r) {
        geo.push_back(rank_page_geometry(layout, r, bs, PageOrder::kHnd));
        bufs.push_back(std::make_unique<Aligned>(size_t(geo.back().block_bytes() * nblocks)));
        mem.push_back({ExternalMemory{bufs.back()->p, bufs.back()->bytes}});
    }
    const auto logits = prefill_into_memory(layout, *weights, tokens, table, mem, opt);

    // The logits: the same as on own pools, and the unsharded model's first greedy token.
    ASSERT_EQ(logits.size(), size_t(m.vocab));
    EXPECT_EQ(logits, own_logits);
    GenerationOptions g;
    g.max_new_tokens = 1;
    g.block_size = bs;
    const GenerationReport ref = generate(m, ParallelConfig{}, *weights, {tokens}, g);
    EXPECT_EQ(argmax(logits), ref.tokens[0][0]);
    EXPECT_LT(relative_l2(logits, ref.last_logits[0]), 1e-4);

    // Block for block: the named blocks equal own pools' bytes; the others keep the caller's.
    for (int r = 0; r < layout.world_size(); ++r) {
        const PageGeometry& gr = geo[size_t(r)];
        ASSERT_EQ(own[size_t(r)].size(), 1u);
        const std::byte* ext = bufs[size_t(r)]->p;
        const std::byte* ref_pool = own[size_t(r)][0].data();
        for (int l = 0; l < gr.num_layers; ++l)
            for (int kv = 0; kv < gr.kv_factor; ++kv)
                for (int64_t b = 0; b < nblocks; ++b) {
                    const int64_t at =
                        ((int64_t{l} * gr.kv_factor + kv) * nblocks + b) * gr.page_bytes();
                    const auto it = std::find(table.begin(), table.end(), b);
                    if (it != table.end()) {
                        // Slots of tokens written; the last block's others keep the caller's.
                        const int64_t first = int64_t(it - table.begin()) * bs;
                        const int64_t valid = std::min<int64_t>(bs, int64_t(tokens.size()) - first);
                        const int64_t row = gr.head_dim * gr.elem_size();
                        for (int h = 0; h < gr.num_heads; ++h)
                            for (int t = 0; t < bs; ++t) {
                                const int64_t e = at + gr.elem_in_page(h, t, 0) * gr.elem_size();
                                if (t < valid) {
                                    EXPECT_EQ(std::memcmp(ext + e, ref_pool + e, size_t(row)), 0)
                                        << "rank " << r << " layer " << l << " kv " << kv
                                        << " block " << b << " head " << h << " slot " << t;
                                } else {
                                    for (int64_t i = 0; i < row; ++i)
                                        ASSERT_EQ(ext[e + i], std::byte{0x5a}) << "slot " << t;
                                }
                            }
                    } else {
                        for (int64_t i = 0; i < gr.page_bytes(); ++i)
                            ASSERT_EQ(ext[at + i], std::byte{0x5a}) << "block " << b;
                    }
                }
    }

    // Transferred to TP=1 (blocks 0..4): the same bytes from the caller's pools as from own pools.
    TransferEndpoint src, dst;
    src.layout = layout;
    dst.layout = make_layout(m, ParallelConfig{});
    src.block_size = dst.block_size = bs;
    src.block_tables = {table};
    dst.block_tables = {{0, 1, 2, 3, 4}};
    const TransferPlan plan = make_transfer_plan(src, dst, int64_t(tokens.size()));
    const PageGeometry gd = rank_page_geometry(dst.layout, 0, bs, PageOrder::kHnd);
    BlockPool from_ext(gd, 5), from_own(gd, 5);
    std::vector<BlockPool> own_pools;
    for (int r = 0; r < layout.world_size(); ++r) {
        own_pools.emplace_back(geo[size_t(r)], nblocks);
        std::memcpy(own_pools.back().arena().data(), own[size_t(r)][0].data(),
                    own[size_t(r)][0].size());
    }
    for (const TransferMessage& msg : plan.messages) {
        std::vector<std::byte> buf(size_t(msg.bytes));
        const BlockPool ext_pool(geo[size_t(msg.src_rank)], nblocks, mem[size_t(msg.src_rank)][0]);
        pack_message(plan, msg, TransferMode::kPreSend, ext_pool, buf);
        unpack_message(plan, msg, TransferMode::kPreSend, buf, from_ext);
        pack_message(plan, msg, TransferMode::kPreSend, own_pools[size_t(msg.src_rank)], buf);
        unpack_message(plan, msg, TransferMode::kPreSend, buf, from_own);
    }
    EXPECT_EQ(
        std::memcmp(from_ext.arena().data(), from_own.arena().data(), from_own.arena().size()), 0);
    // Real values arrived: the K of layer 0 is not all zero.
    bool nonzero = false;
    for (int64_t i = 0; i < gd.page_elems() && !nonzero; ++i)
        nonzero = from_ext.page_f32(0, 0, 0)[i] != 0.0f;
    EXPECT_TRUE(nonzero);
}

INSTANTIATE_TEST_SUITE_P(Layouts, EnginePrefill, ::testing::Values("tp=2", "tp=2,pp=2", "pp=2"),
                         [](const auto& info) {
                             std::string s = info.param;
                             for (char& ch : s)
                                 if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                             return s;
                         });

TEST(EnginePrefill, BadInputIsRefusedWithWhatIsWrong) {
    const ModelSpec m = catalog_model("tiny");
    const KvLayout layout = make_layout(m, parse_parallel_config("tp=2"));
    const auto weights = random_tensor_source(3);
    const auto tokens = prompt(20, m.vocab);
    const PageGeometry g = rank_page_geometry(layout, 0, 8, PageOrder::kHnd);
    Aligned a(size_t(g.block_bytes() * 4) + 64), b(size_t(g.block_bytes() * 4) + 64);
    auto error_of = [&](std::vector<int32_t> table, std::vector<std::vector<ExternalMemory>> mem,
                        const KvLayout& l) {
        try {
            prefill_into_memory(l, *weights, tokens, table, mem, {.block_size = 8});
        } catch (const Error& e) {
            return std::string(e.what());
        }
        return std::string();
    };
    const size_t n = size_t(g.block_bytes() * 4);
    const std::vector<std::vector<ExternalMemory>> ok{{{a.p, n}}, {{b.p, n}}};
    EXPECT_EQ(error_of({0, 1, 2}, ok, layout), "");
    EXPECT_NE(error_of({0, 1}, ok, layout).find("need 3"), std::string::npos);
    EXPECT_NE(error_of({0, 1, 1}, ok, layout).find("appears twice"), std::string::npos);
    EXPECT_NE(error_of({0, 1, 2}, {{{a.p, n}}}, layout).find("memory for 1 rank(s)"),
              std::string::npos);
    EXPECT_NE(error_of({0, 1, 2}, {{{a.p + 8, n}}, {{b.p, n}}}, layout).find("64-byte aligned"),
              std::string::npos);
    EXPECT_NE(error_of({0, 1, 5}, ok, layout).find("outside pool 0's 4 blocks"), std::string::npos);
    EXPECT_NE(error_of({0, 1, 2}, {{{a.p, n - 4}}, {{b.p, n}}}, layout)
                  .find("not a whole number of blocks"),
              std::string::npos);
    EXPECT_NE(error_of({0, 1, 2}, {{}, {{b.p, n}}}, layout).find("one per pool"),
              std::string::npos);
    EXPECT_NE(error_of({0, 1, 2}, ok, make_layout(m, parse_parallel_config("cp=2")))
                  .find("without context parallelism"),
              std::string::npos);
}

TEST(EnginePrefill, OwnPoolsOfAnAbsurdSizeAreRefused) {
    const ModelSpec m = catalog_model("tiny");
    const KvLayout layout = make_layout(m, ParallelConfig{});
    const auto weights = random_tensor_source(3);
    const std::vector<int32_t> tokens{1, 2, 3}, table{0};
    std::vector<std::vector<std::vector<std::byte>>> out;
    for (int64_t blocks : {int64_t{0}, int64_t{-1}, int64_t{1} << 40})
        EXPECT_THROW(prefill_into_own_pools(layout, *weights, tokens, table, blocks, out), Error)
            << blocks;
    EXPECT_THROW(
        prefill_into_own_pools(layout, *weights, tokens, table, 4, out, {.block_size = 1 << 30}),
        Error);
}

}  // namespace
}  // namespace kvshard
