// Direct reads over MPI RMA (rma_read.h): the first P processes are the source group, the next D
// the destination group. Each destination reads its KV from the source pools through a window
// (MPI_Win_create, MPI_Rget of each descriptor), checks it, and ends up byte-identical to the
// message path. Pairs whose P + D is not the job size skip.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "kvshard/comm/mpi.h"
#include "kvshard/transfer/rma_read.h"
#include "kvshard/transfer/transfer_exec.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

Communicator& world() {
    static std::unique_ptr<Communicator> w = mpi_world();
    return *w;
}

struct RmaPair {
    std::string from, to;
    int64_t tokens;
    int bs_from, bs_to;
    PageOrder order_to = PageOrder::kHnd;
};

class TransferRmaMpiTest : public ::testing::TestWithParam<std::tuple<RmaPair, bool>> {};

// One request on this rank; returns its result. rma: through `window`; else messages.
TransferResult run_one(const std::shared_ptr<TransferPlan>& plan, testing::Side& src,
                       BlockPool& dst_pool, uint64_t id, std::shared_ptr<RmaPoolWindow> window,
                       const SourceChecksums* seals) {
    const int P = plan->src.layout.world_size();
    const int me = world().rank();
    TransferExecOptions o;
    o.dst_world_base = P;
    o.direct_read = window != nullptr;
    o.rma_window = std::move(window);
    if (me < P) {
        if (seals != nullptr)
            o.source_checksums =
                std::shared_ptr<const SourceChecksums>(seals, [](const SourceChecksums*) {});
        TransferSender s(world(), plan, id, me, *src.pools[me], o);
        s.all_layers_ready();
        return s.finish();
    }
    TransferReceiver r(world(), plan, id, me - P, dst_pool, o);
    return r.finish();
}

TEST_P(TransferRmaMpiTest, ByteIdenticalToMessages) {
    const auto [p, seal] = GetParam();
    const ModelSpec m = testing::llama_mini();
    const TransferEndpoint se =
        testing::make_endpoint(m, p.from, p.bs_from, PageOrder::kHnd, p.tokens, 0, 7);
    const TransferEndpoint de =
        testing::make_endpoint(m, p.to, p.bs_to, p.order_to, p.tokens, 0, 9);
    const int P = se.layout.world_size(), D = de.layout.world_size();
    if (world().size() != P + D) GTEST_SKIP() << p.from << " -> " << p.to << " needs " << P + D;
    auto plan = std::make_shared<TransferPlan>(make_transfer_plan(se, de, p.tokens));
    testing::Side src = testing::make_source(se, p.tokens);
    testing::Side dst = testing::make_destination(de);
    const auto sums = seal ? testing::seal_source(src, p.tokens)
                           : std::vector<std::unique_ptr<SourceChecksums>>(src.pools.size());
    const int me = world().rank();
    const bool source = me < P;
    auto window = std::make_shared<RmaPoolWindow>(world(), source ? src.pools[me].get() : nullptr);
    BlockPool* via_rma = source ? nullptr : dst.pools[me - P].get();
    std::unique_ptr<BlockPool> via_messages;
    if (!source) {
        via_messages = std::make_unique<BlockPool>(via_rma->geometry(), via_rma->num_blocks());
        std::memcpy(via_messages->arena().data(), via_rma->arena().data(), via_rma->arena().size());
    }
    const SourceChecksums* seals = source ? sums[me].get() : nullptr;
    const TransferResult r =
        run_one(plan, src, source ? *src.pools[me] : *via_rma, 1, window, seals);
    EXPECT_TRUE(r.ok()) << r.error;
    const TransferResult mr =
        run_one(plan, src, source ? *src.pools[me] : *via_messages, 2, nullptr, nullptr);
    EXPECT_TRUE(mr.ok()) << mr.error;
    if (!source) {
        int mine = 0;
        for (const auto& msg : plan->messages) mine += msg.dst_rank == me - P;
        EXPECT_EQ(r.direct_messages, mine);  // every one read through the window
        EXPECT_EQ(mr.direct_messages, 0);
        // TP1 -> TP2: half of every source page, many small runs: packed by the source.
        if (p.from == "tp=1" && p.to == "tp=2") {
            EXPECT_EQ(r.packed_messages, mine);
        }
        if (seal && p.bs_to >= p.bs_from) {  // else a source block splits: no unit checksum
            EXPECT_EQ(r.unit_checksum_messages, mine);
        }
        EXPECT_EQ(std::memcmp(via_rma->arena().data(), via_messages->arena().data(),
                              via_rma->arena().size()),
                  0);
        const auto want = testing::expected_pool(de, me - P, p.tokens, *via_rma);
        const auto* got = reinterpret_cast<const uint32_t*>(via_rma->arena().data());
        EXPECT_TRUE(std::equal(want.begin(), want.end(), got));
    }
    world().barrier();  // nobody frees the window while a peer reads
}

INSTANTIATE_TEST_SUITE_P(Pairs, TransferRmaMpiTest,
                         ::testing::Combine(::testing::Values(RmaPair{"tp=1", "tp=1", 70, 16, 64},
                                                              RmaPair{"tp=2", "tp=1", 64, 16, 16},
                                                              RmaPair{"tp=1", "tp=2", 50, 16, 16,
                                                                      PageOrder::kNhd},
                                                              RmaPair{"tp=1", "tp=2", 64, 16, 16},
                                                              RmaPair{"tp=2", "tp=1", 45, 16, 8}),
                                            ::testing::Bool()));

}  // namespace
}  // namespace kvshard
