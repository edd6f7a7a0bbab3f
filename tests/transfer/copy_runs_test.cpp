// message_copy_runs: the runs a copy engine (the CUDA backend's kernels) carries out, executed
// here with memcpy, give pack_message's payload and unpack_message's pool, byte for byte, for
// every kind of reshape; and they cover the payload once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

using testing::llama_mini;

struct RunsCase {
    ModelSpec model;
    std::string from, to;
    int bs_from = 16, bs_to = 16;
    PageOrder of = PageOrder::kHnd, ot = PageOrder::kHnd;
    uint64_t shuffle = 0;
};

void apply(std::span<const CopyRun> runs, bool pack, std::byte* pool, std::byte* wire) {
    for (const CopyRun& r : runs)
        for (int64_t i = 0; i < r.count; ++i) {
            std::byte* p = pool + r.pool + i * r.pool_step;
            std::byte* w = wire + r.wire + i * r.wire_step;
            if (pack)
                std::memcpy(w, p, static_cast<size_t>(r.len));
            else
                std::memcpy(p, w, static_cast<size_t>(r.len));
        }
}

class CopyRuns : public ::testing::TestWithParam<RunsCase> {};

TEST_P(CopyRuns, CarriedOutWithMemcpyTheyArePackAndUnpack) {
    const RunsCase& c = GetParam();
    const int64_t tokens = 130;
    const auto se = testing::make_endpoint(c.model, c.from, c.bs_from, c.of, tokens, 0, c.shuffle);
    const auto de = testing::make_endpoint(c.model, c.to, c.bs_to, c.ot, tokens, 0,
                                           c.shuffle ? c.shuffle + 1 : 0);
    const TransferPlan plan = make_transfer_plan(se, de, tokens);
    const testing::Side src = testing::make_source(se, tokens);
    for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive}) {
        testing::Side want = testing::make_destination(de), got = testing::make_destination(de);
        testing::run_plan(plan, mode, src, want);
        for (const TransferMessage& msg : plan.messages) {
            const BlockPool& sp = *src.pools.at(msg.src_rank);
            BlockPool& dp = *got.pools.at(msg.dst_rank);
            const auto pr =
                message_copy_runs(plan, msg, mode, true, sp.geometry(), sp.num_blocks());
            const auto ur =
                message_copy_runs(plan, msg, mode, false, dp.geometry(), dp.num_blocks());
            // Each side's runs cover the payload once.
            for (const auto* runs : {&pr, &ur}) {
                std::vector<uint8_t> covered(static_cast<size_t>(msg.bytes), 0);
                for (const CopyRun& r : *runs)
                    for (int64_t i = 0; i < r.count; ++i)
                        for (int64_t b = 0; b < r.len; ++b)
                            ++covered[static_cast<size_t>(r.wire + i * r.wire_step + b)];
                EXPECT_TRUE(
                    std::all_of(covered.begin(), covered.end(), [](uint8_t n) { return n == 1; }));
            }
            std::vector<std::byte> wire(static_cast<size_t>(msg.bytes)), host(wire.size());
            apply(pr, true, const_cast<std::byte*>(sp.arena().data()), wire.data());
            pack_message(plan, msg, mode, sp, host);
            EXPECT_EQ(std::memcmp(wire.data(), host.data(), wire.size()), 0);
            apply(ur, false, dp.arena().data(), wire.data());
        }
        for (size_t r = 0; r < want.pools.size(); ++r) {
            if (!want.pools[r]) continue;
            EXPECT_EQ(std::memcmp(got.pools[r]->arena().data(), want.pools[r]->arena().data(),
                                  want.pools[r]->arena().size()),
                      0)
                << "rank " << r;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Reshapes, CopyRuns,
    ::testing::Values(
        RunsCase{llama_mini(), "tp=8", "tp=4"},
        RunsCase{llama_mini(), "tp=2", "tp=8", 16, 16, PageOrder::kHnd, PageOrder::kHnd, 9},
        RunsCase{llama_mini(), "tp=2", "tp=2", 16, 64},
        RunsCase{llama_mini(), "tp=2", "tp=4", 16, 16, PageOrder::kHnd, PageOrder::kNhd},
        RunsCase{llama_mini(), "tp=1", "tp=2", 32, 16, PageOrder::kNhd, PageOrder::kHnd},
        RunsCase{llama_mini(), "cp=2", "tp=2"}, RunsCase{llama_mini(4, 2), "tp=4", "tp=2"},
        RunsCase{catalog_model("tiny-mla"), "tp=2", "tp=4", 16, 32}));

TEST(CopyRunsChecks, RefuseAnUnresolvedModeAWrongGeometryAndABlockOutsideThePool) {
    const ModelSpec m = llama_mini();
    const auto se = testing::make_endpoint(m, "tp=2", 16, PageOrder::kHnd, 64);
    const auto de = testing::make_endpoint(m, "tp=1", 16, PageOrder::kHnd, 64);
    const TransferPlan plan = make_transfer_plan(se, de, 64);
    const TransferMessage& msg = plan.messages.front();
    const PageGeometry g = rank_page_geometry(se.layout, msg.src_rank, 16, PageOrder::kHnd);
    EXPECT_THROW(message_copy_runs(plan, msg, TransferMode::kAuto, true, g, 4), Error);
    PageGeometry wrong = g;
    wrong.num_heads += 1;
    EXPECT_THROW(message_copy_runs(plan, msg, TransferMode::kPreSend, true, wrong, 4), Error);
    EXPECT_THROW(message_copy_runs(plan, msg, TransferMode::kPreSend, true, g, 2), Error);
    EXPECT_NO_THROW(message_copy_runs(plan, msg, TransferMode::kPreSend, true, g, 4));
    // A model of several KV groups: each group's plan has its own pools.
    const ModelSpec swa = catalog_model("tiny-swa");
    const TransferPlan hybrid =
        make_transfer_plan(testing::make_endpoint(swa, "tp=2", 16, PageOrder::kHnd, 64),
                           testing::make_endpoint(swa, "tp=1", 16, PageOrder::kHnd, 64), 64);
    ASSERT_FALSE(hybrid.executable());
    try {
        message_copy_runs(hybrid, hybrid.messages.front(), TransferMode::kPreSend, true, g, 4);
        ADD_FAILURE() << "a plan of several KV groups was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("group_transfer_plan"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace kvshard
