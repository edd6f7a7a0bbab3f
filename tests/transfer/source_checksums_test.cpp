// Source checksums: seals made when the KV is written, unit checksums of messages from them, and
// direct reads checked by them (pack.h: unit_checksum, copy_direct_units).
#include <gtest/gtest.h>

#include <cstring>

#include "kvshard/common/error.h"
#include "kvshard/common/xxh3.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

using testing::llama_mini;

TransferPlan plan_of(const std::string& from, const std::string& to, int64_t tokens,
                     PageOrder order_from = PageOrder::kHnd, int bs_from = 16, int bs_to = 16) {
    const ModelSpec m = llama_mini();
    return make_transfer_plan(testing::make_endpoint(m, from, bs_from, order_from, tokens, 0, 0),
                              testing::make_endpoint(m, to, bs_to, PageOrder::kHnd, tokens, 0, 0),
                              tokens);
}

SourceArena arena_of(const BlockPool& p) {
    return {p.arena().data(), static_cast<int64_t>(p.arena().size()), p.num_blocks()};
}

TEST(SourceChecksums, UnitIsXxh3OfTheHeadsSealedSlots) {
    const auto plan = plan_of("tp=2", "tp=2", 40);
    const auto src = testing::make_source(plan.src, 40);
    const BlockPool& pool = *src.pools[0];
    SourceChecksums sums(pool);
    EXPECT_EQ(sums.sealed_tokens(1, 2), 0);
    sums.seal(1, 2, 8);
    EXPECT_EQ(sums.sealed_tokens(1, 2), 8);
    EXPECT_EQ(sums.sealed_tokens(0, 2), 0);
    const PageGeometry& g = pool.geometry();
    const int64_t vec = int64_t{g.head_dim} * g.elem_size();
    for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < g.num_heads; ++h)
            EXPECT_EQ(sums.unit(1, kv, 2, h),
                      xxh3_64(pool.page(1, kv, 2) + int64_t{h} * g.block_size * vec,
                              static_cast<size_t>(8 * vec)));
    sums.seal_sequence(0, plan.src.block_tables[0], 40);  // 16 + 16 + 8
    EXPECT_EQ(sums.sealed_tokens(0, plan.src.block_tables[0][0]), 16);
    EXPECT_EQ(sums.sealed_tokens(0, plan.src.block_tables[0][2]), 8);
    sums.forget(2);
    EXPECT_EQ(sums.sealed_tokens(1, 2), 0);
}

TEST(SourceChecksums, RejectsBadInput) {
    const auto plan = plan_of("tp=2", "tp=2", 40);
    const auto src = testing::make_source(plan.src, 40);
    SourceChecksums sums(*src.pools[0]);
    EXPECT_THROW(sums.seal(0, 0, 0), Error);
    EXPECT_THROW(sums.seal(0, 0, 17), Error);
    EXPECT_THROW(sums.seal(-1, 0, 4), Error);
    EXPECT_THROW(sums.seal(4, 0, 4), Error);
    EXPECT_THROW(sums.seal(0, static_cast<int32_t>(src.pools[0]->num_blocks()), 4), Error);
    EXPECT_THROW(sums.seal_sequence(0, std::vector<int32_t>{0, 1}, 40), Error);  // needs 3
    const auto nhd = plan_of("tp=2", "tp=2", 40, PageOrder::kNhd);
    const auto nsrc = testing::make_source(nhd.src, 40);
    try {
        SourceChecksums bad(*nsrc.pools[0]);
        FAIL() << "expected an Error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("HND"), std::string::npos) << e.what();
    }
    // copy_direct_units reads units, which an NHD source does not have.
    auto dst = testing::make_destination(nhd.dst);
    const auto& msg = nhd.messages.front();
    EXPECT_THROW(
        copy_direct_units(nhd, msg, arena_of(*nsrc.pools[msg.src_rank]), *dst.pools[msg.dst_rank]),
        Error);
    // unit_checksum of a message from another rank's seals (another geometry).
    const auto tp4 = plan_of("tp=4", "tp=2", 40);
    EXPECT_THROW(unit_checksum(tp4, tp4.messages.front(), sums), Error);
}

// A message has a unit checksum only where each piece reads a whole sealed block.
TEST(SourceChecksums, UnitChecksumNeedsWholeSealedBlocks) {
    const auto plan = plan_of("tp=1", "tp=2", 40);
    const auto src = testing::make_source(plan.src, 40);
    SourceChecksums sums(*src.pools[0]);
    const auto& msg = plan.messages.front();
    EXPECT_FALSE(unit_checksum(plan, msg, sums).has_value());  // nothing sealed
    for (int l = 0; l < 4; ++l) sums.seal_sequence(l, plan.src.block_tables[0], 40);
    EXPECT_TRUE(unit_checksum(plan, msg, sums).has_value());
    sums.seal(3, plan.src.block_tables[0][2], 7);  // the last block sealed short
    EXPECT_FALSE(unit_checksum(plan, msg, sums).has_value());
    sums.seal(3, plan.src.block_tables[0][2], 8);
    EXPECT_TRUE(unit_checksum(plan, msg, sums).has_value());
    sums.forget(plan.src.block_tables[0][1]);
    EXPECT_FALSE(unit_checksum(plan, msg, sums).has_value());
}

// The destination's value equals the source's seals exactly when the bytes read are the bytes
// sealed: a block rewritten after its seal fails the check (the request fails, nothing is silently
// delivered), and the heads of other messages are unaffected.
TEST(SourceChecksums, RewriteAfterSealIsCaught) {
    const auto plan = plan_of("tp=1", "tp=2", 40);
    auto src = testing::make_source(plan.src, 40);
    BlockPool& pool = *src.pools[0];
    SourceChecksums sums(pool);
    for (int l = 0; l < 4; ++l) sums.seal_sequence(l, plan.src.block_tables[0], 40);
    auto dst = testing::make_destination(plan.dst);
    std::vector<uint64_t> want;
    for (const auto& msg : plan.messages) want.push_back(*unit_checksum(plan, msg, sums));
    for (size_t i = 0; i < plan.messages.size(); ++i) {
        const auto& msg = plan.messages[i];
        EXPECT_EQ(copy_direct_units(plan, msg, arena_of(pool), *dst.pools[msg.dst_rank]), want[i]);
    }
    // Head 0 belongs to destination rank 0's message (heads [0, 4)), head 7 to rank 1's.
    const PageGeometry& g = pool.geometry();
    const int64_t vec = int64_t{g.head_dim} * g.elem_size();
    pool.page(2, 1, plan.src.block_tables[0][1])[3 * vec + 5] ^= std::byte{0x40};  // V, head 0
    for (size_t i = 0; i < plan.messages.size(); ++i) {
        const auto& msg = plan.messages[i];
        const uint64_t got = copy_direct_units(plan, msg, arena_of(pool), *dst.pools[msg.dst_rank]);
        if (msg.head_begin == 0)
            EXPECT_NE(got, want[i]);
        else
            EXPECT_EQ(got, want[i]);
    }
    // Resealed, the rewritten bytes are what the checksum says.
    sums.seal(2, plan.src.block_tables[0][1], 16);
    for (size_t i = 0; i < plan.messages.size(); ++i) {
        const auto& msg = plan.messages[i];
        EXPECT_EQ(copy_direct_units(plan, msg, arena_of(pool), *dst.pools[msg.dst_rank]),
                  *unit_checksum(plan, msg, sums));
    }
}

// The unit checksum depends on the order of the units: two units swapped in the source pool (so
// the multiset of unit checksums is the same) still fail the check.
TEST(SourceChecksums, SwappedUnitsAreCaught) {
    const auto plan = plan_of("tp=1", "tp=1", 32);
    auto src = testing::make_source(plan.src, 32);
    BlockPool& pool = *src.pools[0];
    SourceChecksums sums(pool);
    for (int l = 0; l < 4; ++l) sums.seal_sequence(l, plan.src.block_tables[0], 32);
    const auto& msg = plan.messages.front();
    const uint64_t want = *unit_checksum(plan, msg, sums);
    const int64_t unit_bytes = pool.geometry().page_bytes() / pool.geometry().num_heads;
    std::byte* p = pool.page(0, 0, plan.src.block_tables[0][0]);
    std::vector<std::byte> tmp(p, p + unit_bytes);
    std::memcpy(p, p + unit_bytes, static_cast<size_t>(unit_bytes));  // heads 0 and 1
    std::memcpy(p + unit_bytes, tmp.data(), static_cast<size_t>(unit_bytes));
    auto dst = testing::make_destination(plan.dst);
    EXPECT_NE(copy_direct_units(plan, msg, arena_of(pool), *dst.pools[0]), want);
}

}  // namespace
}  // namespace kvshard
