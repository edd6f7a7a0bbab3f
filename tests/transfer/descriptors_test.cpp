// Transfer descriptors against a naive reference: every element's source and destination byte
// offset from the pool byte layout written out here, merged into runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "cli_runner.h"
#include "kvshard/common/error.h"
#include "kvshard/transfer/descriptors.h"
#include "transfer/transfer_harness.h"

#include <nlohmann/json.hpp>

namespace kvshard {
namespace {

using testing::llama_mini;

struct Case {
    ModelSpec model;
    std::string from, to;
    int64_t tokens = 100;
    int bs_from = 16, bs_to = 16;
    PageOrder order_from = PageOrder::kHnd, order_to = PageOrder::kHnd;
    uint64_t shuffle = 0;
    int layers_per_group = 0;
};

TransferPlan plan_of(const Case& c) {
    const auto src =
        testing::make_endpoint(c.model, c.from, c.bs_from, c.order_from, c.tokens, 0, c.shuffle);
    const auto dst = testing::make_endpoint(c.model, c.to, c.bs_to, c.order_to, c.tokens, 0,
                                            c.shuffle ? c.shuffle + 1 : 0);
    return make_transfer_plan(src, dst, c.tokens, {.layers_per_group = c.layers_per_group});
}

// Elements of one head vector: MLA's latent and rope key, then any indexer key (fp8 values and
// their scale bytes) in the same vector, as KV elements.
int64_t vector_elems(const ModelSpec& m) {
    if (!m.is_mla()) return m.head_dim;
    const int64_t el = static_cast<int64_t>(dtype_size(m.kv_dtype));
    const int64_t index = m.indexer.enabled() ? m.indexer.head_dim + m.indexer.scale_bytes : 0;
    return m.mla.kv_lora_rank + m.mla.qk_rope_head_dim + index / el;
}

// Byte offset of element (layer, kv, head, slot, dim) of `rank`'s pool: the layout of
// block_pool.h, spelled out: pages [layer][kv][block], HND [head][slot][dim], NHD
// [slot][head][dim].
int64_t element_offset(const TransferEndpoint& e, int rank, int64_t num_blocks, int64_t base,
                       int layer, int kv, int block, int head, int slot, int dim) {
    const RankKv& r = e.layout.ranks[rank];
    const ModelSpec& m = e.layout.model;
    const int64_t heads = m.is_mla() ? 1 : r.num_kv_heads();
    const int64_t el = static_cast<int64_t>(dtype_size(m.kv_dtype));
    const int64_t hd = vector_elems(m);
    const int64_t kvf = m.is_mla() ? 1 : 2;
    const int64_t h = head - (m.is_mla() ? 0 : r.kv_heads.front());
    const int64_t page = heads * e.block_size * hd * el;
    const int64_t in_page = e.order == PageOrder::kHnd ? (h * e.block_size + slot) * hd + dim
                                                       : (int64_t{slot} * heads + h) * hd + dim;
    return base + ((int64_t{layer - r.layer_begin} * kvf + kv) * num_blocks + block) * page +
           in_page * el;
}

struct Expected {
    std::vector<TransferDescriptor> descriptors;
    int64_t pre_send = 0, post_receive = 0;
};

// Walks every element of every message, then merges its (source, destination) byte pairs into
// runs: on both sides (sorted by source), on the destination only (pre-send: the source reshapes
// into staging), on the source only (post-receive).
Expected naive(const TransferPlan& plan, int64_t src_blocks, int64_t dst_blocks, int64_t src_base,
               int64_t dst_base) {
    const ModelSpec& m = plan.src.layout.model;
    const int64_t el = static_cast<int64_t>(dtype_size(m.kv_dtype));
    const int64_t hd = vector_elems(m);
    Expected out;
    for (const TransferMessage& msg : plan.messages) {
        std::vector<std::pair<int64_t, int64_t>> elems;  // (src, dst) byte offsets
        for (int l = msg.layer_begin; l < msg.layer_end; ++l)
            for (int kv = 0; kv < plan.kv_factor; ++kv)
                for (const TransferPiece& p : msg.pieces)
                    for (int h = msg.head_begin; h < msg.head_end; ++h)
                        for (int j = 0; j < p.count; ++j)
                            for (int x = 0; x < hd; ++x)
                                elems.emplace_back(
                                    element_offset(plan.src, msg.src_rank, src_blocks, src_base, l,
                                                   kv, p.src_block, h, p.src_slot + j, x),
                                    element_offset(plan.dst, msg.dst_rank, dst_blocks, dst_base, l,
                                                   kv, p.dst_block, h, p.dst_slot + j, x));
        std::sort(elems.begin(), elems.end());
        for (size_t i = 0; i < elems.size(); ++i) {
            const bool both = i > 0 && elems[i].first == elems[i - 1].first + el &&
                              elems[i].second == elems[i - 1].second + el;
            if (both)
                out.descriptors.back().bytes += el;
            else
                out.descriptors.push_back({msg.src_rank, msg.dst_rank, msg.layer_group,
                                           elems[i].first, elems[i].second, el});
            out.post_receive += !(i > 0 && elems[i].first == elems[i - 1].first + el);
        }
        std::vector<int64_t> dsts;
        for (const auto& [s, d] : elems) dsts.push_back(d);
        std::sort(dsts.begin(), dsts.end());
        for (size_t i = 0; i < dsts.size(); ++i)
            out.pre_send += !(i > 0 && dsts[i] == dsts[i - 1] + el);
    }
    return out;
}

void check(const Case& c, int64_t src_base = 0, int64_t dst_base = 0) {
    SCOPED_TRACE(c.from + " -> " + c.to + " bs " + std::to_string(c.bs_from) + "->" +
                 std::to_string(c.bs_to));
    const TransferPlan plan = plan_of(c);
    const int64_t sb = testing::pool_blocks(plan.src), db = testing::pool_blocks(plan.dst);
    auto sr = side_pool_regions(plan, true, sb);
    auto dr = side_pool_regions(plan, false, db);
    for (auto& r : sr) r.base = src_base;
    for (auto& r : dr) r.base = dst_base;
    const TransferDescriptors d = make_transfer_descriptors(plan, sr, dr);
    const Expected want = naive(plan, sb, db, src_base, dst_base);
    EXPECT_EQ(d.descriptor_count, static_cast<int64_t>(want.descriptors.size()));
    EXPECT_TRUE(d.descriptors == want.descriptors);
    EXPECT_EQ(d.pre_send_count, want.pre_send);
    EXPECT_EQ(d.post_receive_count, want.post_receive);
    EXPECT_EQ(d.bytes, plan.bytes);
    EXPECT_EQ(d.fewer_mode, d.pre_send_count < d.post_receive_count ? TransferMode::kPreSend
                                                                    : TransferMode::kPostReceive);
    // Groups: one per message, in plan order, covering the list.
    ASSERT_EQ(d.groups.size(), plan.messages.size());
    int64_t at = 0, per_block = 0;
    for (size_t i = 0; i < d.groups.size(); ++i) {
        const auto& g = d.groups[i];
        const auto& msg = plan.messages[i];
        EXPECT_EQ(g.src_rank, msg.src_rank);
        EXPECT_EQ(g.dst_rank, msg.dst_rank);
        EXPECT_EQ(g.first, at);
        EXPECT_EQ(g.bytes, msg.bytes);
        at += g.count;
        per_block +=
            int64_t{msg.num_layers()} * plan.kv_factor * static_cast<int64_t>(msg.pieces.size());
    }
    EXPECT_EQ(d.per_block_descriptor_count, per_block);
    // Listing fewer keeps the counts.
    const TransferDescriptors few = make_transfer_descriptors(plan, sr, dr, {.max_listed = 3});
    EXPECT_EQ(few.descriptor_count, d.descriptor_count);
    ASSERT_EQ(few.descriptors.size(), std::min<size_t>(3, d.descriptors.size()));
    EXPECT_TRUE(std::equal(few.descriptors.begin(), few.descriptors.end(), d.descriptors.begin()));
}

TEST(TransferDescriptors, Tp8ToTp4) {
    check({.model = llama_mini(), .from = "tp=8", .to = "tp=4"});
    check({.model = llama_mini(), .from = "tp=8", .to = "tp=4", .shuffle = 5}, 4096, 1 << 20);
    check({.model = llama_mini(), .from = "tp=8", .to = "tp=4", .layers_per_group = 1});
}

TEST(TransferDescriptors, Tp2ToTp8) {
    check({.model = llama_mini(), .from = "tp=2", .to = "tp=8", .tokens = 77});
}

TEST(TransferDescriptors, BlockSize16To64) {
    check({.model = llama_mini(), .from = "tp=4", .to = "tp=4", .tokens = 200, .bs_to = 64});
    check({.model = llama_mini(), .from = "tp=4", .to = "tp=4", .tokens = 200, .bs_from = 64});
}

TEST(TransferDescriptors, HndToNhd) {
    for (auto [from, to] :
         {std::pair{PageOrder::kHnd, PageOrder::kNhd}, std::pair{PageOrder::kNhd, PageOrder::kHnd},
          std::pair{PageOrder::kNhd, PageOrder::kNhd}})
        check({.model = llama_mini(),
               .from = "tp=8",
               .to = "tp=2",
               .tokens = 70,
               .order_from = from,
               .order_to = to});
    // A transpose with several heads on both sides leaves only head vectors pool to pool; one
    // reshape side keeps runs long.
    const TransferPlan plan = plan_of({.model = llama_mini(),
                                       .from = "tp=2",
                                       .to = "tp=2",
                                       .tokens = 64,
                                       .order_to = PageOrder::kNhd});
    const auto d = make_transfer_descriptors(plan, side_pool_regions(plan, true, 4),
                                             side_pool_regions(plan, false, 4));
    EXPECT_TRUE(d.pages_differ);
    // 4 layers x K,V x 4 heads x 64 tokens of head vectors per pair, 2 pairs; only the last
    // vector of each page (head 3, slot 15 in HND; slot 15, head 3 in NHD) continues into the next
    // page's first on both sides: 32 pages per pair, 31 joins.
    EXPECT_EQ(d.descriptor_count, 2 * (4 * 2 * 4 * 64 - 31));
    EXPECT_LT(d.fewer_count(), d.descriptor_count / 16);
}

TEST(TransferDescriptors, CpToNonCp) {
    check({.model = llama_mini(), .from = "cp=2,tp=2", .to = "tp=2", .tokens = 90});
    check({.model = llama_mini(),
           .from = "cp=3,tp=2,cp_scheme=zigzag",
           .to = "tp=4",
           .tokens = 101,
           .bs_from = 8});
    check({.model = catalog_model("tiny-mla"), .from = "cp=2,tp=2", .to = "tp=2", .tokens = 50});
}

// DeepSeek-V3.2's shape: the indexer key rides in each token's MLA vector, so its bytes are in
// the runs (40 + 5 fp32 elements per token here).
TEST(TransferDescriptors, SparseMlaCarriesIndexerKeys) {
    const ModelSpec m = testing::sparse_mla_mini();
    ASSERT_EQ(vector_elems(m), 45);
    check({.model = m, .from = "tp=8", .to = "tp=4", .tokens = 70});
    check({.model = m, .from = "cp=2,tp=2", .to = "tp=2", .tokens = 50, .bs_to = 32});
    const TransferPlan plan = plan_of({.model = m, .from = "tp=2", .to = "tp=1", .tokens = 64});
    EXPECT_EQ(plan.bytes, int64_t{2} * 64 * 45 * 4);  // one destination, 2 layers, 64 tokens
}

// Same layout on both sides, blocks in order: a rank's whole pool range is one run where the
// request fills its blocks.
TEST(TransferDescriptors, SameLayoutIsOneRunPerRank) {
    const TransferPlan plan =
        plan_of({.model = llama_mini(), .from = "tp=8", .to = "tp=8", .tokens = 128});
    const auto d = make_transfer_descriptors(plan, side_pool_regions(plan, true, 8),
                                             side_pool_regions(plan, false, 8));
    EXPECT_EQ(d.descriptor_count, 8);
    EXPECT_EQ(d.per_block_descriptor_count, 8 * 4 * 2 * 8);
    check({.model = llama_mini(), .from = "tp=8", .to = "tp=8", .tokens = 128});
}

TEST(TransferDescriptors, RejectsWrongRegions) {
    const TransferPlan plan = plan_of({.model = llama_mini(), .from = "tp=8", .to = "tp=4"});
    auto sr = side_pool_regions(plan, true, 7);
    auto dr = side_pool_regions(plan, false, 7);
    EXPECT_NO_THROW(make_transfer_descriptors(plan, sr, dr));
    EXPECT_THROW(make_transfer_descriptors(plan, sr, std::span(dr).first(2)), Error);
    EXPECT_THROW(make_transfer_descriptors(plan, side_pool_regions(plan, true, 3), dr), Error);
    std::swap(sr, dr);
    EXPECT_THROW(make_transfer_descriptors(plan, sr, dr), Error);  // geometries of the other side
}

TEST(TransferDescriptors, Cli) {
    using kvshard::test::run_cli;
    const auto r = run_cli(
        "transfer-plan --model llama-3.1-8b --from tp=8 --to tp=4 --tokens 1000 --descriptors "
        "--json --descriptor-limit 5");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["descriptors"].size(), 5u);
    // 8 pairs x 32 layers x K,V x 63 blocks.
    EXPECT_EQ(j["per_block_descriptor_count"].get<int64_t>(), int64_t{8} * 32 * 2 * 63);
    EXPECT_GT(j["descriptor_count"].get<int64_t>(), 0);
    EXPECT_EQ(j["bytes"], j["min_bytes"]);
    // TP=8 -> TP=4 in HND, whole blocks: each source head is half of every destination page, so
    // pool to pool nothing merges (one run per layer, K/V and block, as per block), while the
    // source's pages are one run per pair (post-receive).
    const auto full = run_cli(
        "transfer-plan --model llama-3.1-8b --from tp=8 --to tp=4 --tokens 1024 --descriptors "
        "--json --descriptor-limit 0");
    ASSERT_EQ(full.status, 0) << full.out;
    const auto jf = nlohmann::json::parse(full.out);
    EXPECT_EQ(jf["descriptors"].size(), 0u);
    EXPECT_EQ(jf["per_block_descriptor_count"].get<int64_t>(), int64_t{8} * 32 * 2 * 64);
    EXPECT_EQ(jf["descriptor_count"], jf["per_block_descriptor_count"]);
    EXPECT_EQ(jf["post_receive_count"], 8);
    EXPECT_EQ(jf["fewer_mode"], "post-receive");
    const auto text =
        run_cli("transfer-plan --model tiny --from tp=1 --to tp=1 --tokens 16 --descriptors");
    ASSERT_EQ(text.status, 0) << text.out;
    EXPECT_NE(text.out.find("descriptors 1 (runs contiguous in both pools)"), std::string::npos)
        << text.out;
    const auto bad =
        run_cli("transfer-plan --model tiny-swa --from tp=1 --to tp=1 --tokens 16 --descriptors");
    EXPECT_EQ(bad.status, 2) << bad.out;
}

}  // namespace
}  // namespace kvshard
