// TransferSchedule: the path, offsets and batch of every message, by table, for named layout
// pairs: the seed's TP=8 -> TP=4, a direct read, a post-receive with a transpose, CP -> non-CP.
#include <gtest/gtest.h>

#include "kvshard/common/error.h"
#include "kvshard/transfer/transfer_schedule.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

using testing::llama_mini;

struct Row {
    int src, dst, message, group;
    int64_t bytes;
    TransferPath path;
    int64_t src_offset, dst_offset;
    int batch;
};

constexpr auto kBatched = TransferPath::kBatched;
constexpr auto kZeroCopy = TransferPath::kZeroCopy;
constexpr auto kDirect = TransferPath::kDirectRead;

struct Pair {
    std::string from, to;
    int64_t tokens;
    PageOrder order_from = PageOrder::kHnd, order_to = PageOrder::kHnd;
    int layers_per_group = 0;
};

TransferPlan plan_of(const Pair& p) {
    const ModelSpec m = llama_mini();
    return make_transfer_plan(testing::make_endpoint(m, p.from, 16, p.order_from, p.tokens),
                              testing::make_endpoint(m, p.to, 16, p.order_to, p.tokens), p.tokens,
                              {.layers_per_group = p.layers_per_group});
}

// Each side's pools hold exactly the blocks of its longest table.
TransferSchedule schedule_of(const TransferPlan& plan, const TransferScheduleOptions& o) {
    auto blocks = [](const TransferEndpoint& e) {
        int64_t n = 1;
        for (const auto& t : e.block_tables) n = std::max<int64_t>(n, int64_t(t.size()));
        return n;
    };
    return make_transfer_schedule(plan, side_pool_pages(plan, true, blocks(plan.src)),
                                  side_pool_pages(plan, false, blocks(plan.dst)), o);
}

// The schedule's rows in each sender's order, source rank ascending.
void expect_rows(const TransferSchedule& s, const std::vector<Row>& want) {
    std::vector<Row> got;
    for (const auto& sends : s.sends)
        for (int k : sends) {
            const ScheduledMessage& m = s.messages[size_t(k)];
            got.push_back({m.src_rank, m.dst_rank, m.message, m.layer_group, m.bytes, m.path,
                           m.src_offset, m.dst_offset, m.batch});
        }
    ASSERT_EQ(got.size(), want.size()) << to_text(s);
    for (size_t i = 0; i < want.size(); ++i) {
        const Row &g = got[i], &w = want[i];
        EXPECT_TRUE(g.src == w.src && g.dst == w.dst && g.message == w.message &&
                    g.group == w.group && g.bytes == w.bytes && g.path == w.path &&
                    g.src_offset == w.src_offset && g.dst_offset == w.dst_offset &&
                    g.batch == w.batch)
            << "row " << i << " differs:\n"
            << to_text(s);
    }
}

// The seed's example, streamed two layers per message: [H0]..[H7] -> [H0H1]..[H6H7]. A source
// rank's message holds one head of a block's 16 slots, so it is no run of either pool: every
// message is packed, alone in its batch (each source rank sends one destination per layer range).
TEST(TransferSchedule, SeedTp8ToTp4) {
    const TransferPlan plan = plan_of({"tp=8", "tp=4", 100, PageOrder::kHnd, PageOrder::kHnd, 2});
    const TransferSchedule s = schedule_of(plan, {});
    EXPECT_EQ(s.mode, TransferMode::kPreSend);
    // 1 head x 100 tokens x 16 dims x 4 B x (K, V) x 2 layers = 25600 B.
    std::vector<Row> want;
    for (int r = 0; r < 8; ++r)
        for (int g = 0; g < 2; ++g)
            want.push_back({r, r / 2, g * 8 + r, g, 25600, kBatched, -1, -1, r * 2 + g});
    expect_rows(s, want);
    EXPECT_EQ(s.receives[0], (std::vector<int>{0, 1, 8, 9}));
}

// Direct reads agreed: only headers travel, no offsets, no batches.
TEST(TransferSchedule, DirectRead) {
    const TransferPlan plan = plan_of({"tp=2", "tp=1", 40});
    const TransferSchedule s = schedule_of(plan, {.direct_read = true});
    // 4 heads x 40 tokens x 16 x 4 B x 2 x 4 layers = 81920 B.
    expect_rows(
        s, {{0, 0, 0, 0, 81920, kDirect, -1, -1, -1}, {1, 0, 1, 0, 81920, kDirect, -1, -1, -1}});
}

// Post-receive with a transpose (HND -> NHD): the payload is in the source's order, and a layer of
// one full block is one run of the source pool (its K page, then its V page): sent from the pool at
// layer * 2 pages (a page: 8 heads x 16 slots x 16 x 4 B = 8192 B); the receiver scatters it.
TEST(TransferSchedule, PostReceiveWithTranspose) {
    const TransferPlan plan = plan_of({"tp=1", "tp=1", 16, PageOrder::kHnd, PageOrder::kNhd, 1});
    const TransferSchedule s = schedule_of(plan, {.mode = TransferMode::kPostReceive});
    EXPECT_EQ(s.mode, TransferMode::kPostReceive);
    expect_rows(s, {{0, 0, 0, 0, 16384, kZeroCopy, 0, -1, -1},
                    {0, 0, 1, 1, 16384, kZeroCopy, 16384, -1, -1},
                    {0, 0, 2, 2, 16384, kZeroCopy, 32768, -1, -1},
                    {0, 0, 3, 3, 16384, kZeroCopy, 49152, -1, -1}});
    // Pre-send over the same pair gathers on the sender instead: packed, one layer per batch.
    const TransferSchedule pre = schedule_of(plan, {.mode = TransferMode::kPreSend});
    for (const auto& m : pre.messages) EXPECT_EQ(m.path, kBatched);
}

// CP -> non-CP: each CP rank's 16 tokens are one block of its pool, so each of its layers leaves
// from the pool; on the destination they land in blocks 0 and 1, K and V apart: staged.
TEST(TransferSchedule, CpToNonCp) {
    const TransferPlan plan = plan_of({"cp=2", "tp=1", 32, PageOrder::kHnd, PageOrder::kHnd, 1});
    const TransferSchedule s = schedule_of(plan, {});
    std::vector<Row> want;
    for (int c = 0; c < 2; ++c)
        for (int l = 0; l < 4; ++l)
            want.push_back({c, 0, l * 2 + c, l, 16384, kZeroCopy, int64_t{l} * 16384, -1, -1});
    expect_rows(s, want);
    EXPECT_EQ(s.receives[0], (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
}

// A TP reshape to more ranks: one source rank's messages of a layer range go to four destinations
// and are packed together, as many as staging holds (here two).
TEST(TransferSchedule, BatchesBoundedByStaging) {
    const TransferPlan plan = plan_of({"tp=2", "tp=8", 40});
    const TransferSchedule s = schedule_of(plan, {.staging_bytes = 2 * 20480});
    std::vector<Row> want;
    for (int r = 0; r < 2; ++r)
        for (int d = 0; d < 4; ++d)
            want.push_back({r, r * 4 + d, r * 4 + d, 0, 20480, kBatched, -1, -1, r * 2 + d / 2});
    expect_rows(s, want);
    const TransferSchedule one = schedule_of(plan, {.staging_bytes = 1});  // each its own batch
    for (const auto& m : one.messages) EXPECT_EQ(m.batch, m.message);
}

TEST(TransferSchedule, RejectsPagesThatDoNotFit) {
    const TransferPlan plan = plan_of({"tp=8", "tp=4", 100});
    auto src = side_pool_pages(plan, true, 7);
    auto dst = side_pool_pages(plan, false, 7);
    EXPECT_NO_THROW(make_transfer_schedule(plan, src, dst, {}));
    EXPECT_THROW(make_transfer_schedule(plan, side_pool_pages(plan, true, 6), dst, {}), Error)
        << "block 6 of the source is outside a pool of 6 blocks";
    src[3].geometry.num_heads = 2;
    EXPECT_THROW(make_transfer_schedule(plan, src, dst, {}), Error) << "rank 3's geometry";
    EXPECT_THROW(make_transfer_schedule(plan, std::span(src).first(2), dst, {}), Error)
        << "missing ranks";
}

}  // namespace
}  // namespace kvshard
