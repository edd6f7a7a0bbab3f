// KV transfer over the MPI backend: the first P processes are the source (prefill) group, the next
// D the destination (decode) group, as in `mpirun -np P prog : -np D prog`. Layout pairs whose
// P + D equals the job size run; the others skip.
#include <gtest/gtest.h>

#include <map>

#include <memory>
#include <thread>

#include "kvshard/comm/mpi.h"
#include "kvshard/transfer/transfer_exec.h"
#include "transfer/fault_injection.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

Communicator& world() {
    static std::unique_ptr<Communicator> w = mpi_world();
    return *w;
}

struct MpiPair {
    std::string from, to;
    int64_t tokens;
    int bs_from, bs_to;
};

// Elements of destination rank d's pool that differ from what its layout says it holds.
int64_t wrong_elements(const TransferPlan& plan, const testing::Side& dst, int d, int64_t tokens) {
    const auto want = testing::expected_pool(plan.dst, d, tokens, *dst.pools[d]);
    const auto* got = reinterpret_cast<const uint32_t*>(dst.pools[d]->arena().data());
    int64_t wrong = 0;
    for (size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
    return wrong;
}

class TransferMpiTest : public ::testing::TestWithParam<MpiPair> {};

// Runs `requests` transfers of the same plan at once on this rank; returns the results by request.
// Request 0 lands in dst's pool; with `also`, request `also_index` lands in its pool.
std::vector<TransferResult> run_here(const std::shared_ptr<TransferPlan>& plan, testing::Side& src,
                                     testing::Side& dst,
                                     const std::vector<TransferExecOptions>& opts,
                                     testing::Side* also = nullptr, size_t also_index = 0,
                                     const std::map<size_t, testing::TransferFaults>& faults = {}) {
    const int P = plan->src.layout.world_size();
    const int me = world().rank();
    std::vector<TransferResult> out;
    if (me < P) {
        testing::FaultyCommunicator faulty(world());  // spoils the requests of `faults`
        for (const auto& [k, f] : faults) faulty.add(100 + k, f);
        std::vector<std::unique_ptr<TransferSender>> s;
        for (size_t k = 0; k < opts.size(); ++k)
            s.push_back(std::make_unique<TransferSender>(faulty, plan, 100 + k, me, *src.pools[me],
                                                         opts[k]));
        for (int l = 0; l < plan->src.layout.model.num_layers; ++l)
            for (auto& x : s) {
                x->layer_ready(l);
                x->progress();
            }
        for (auto& x : s) out.push_back(x->finish());
    } else {
        // Each request into its own copy of the destination pool.
        std::vector<std::unique_ptr<BlockPool>> pools;
        std::vector<std::unique_ptr<TransferReceiver>> r;
        for (size_t k = 0; k < opts.size(); ++k) {
            const BlockPool& like = *dst.pools[me - P];
            pools.push_back(std::make_unique<BlockPool>(like.geometry(), like.num_blocks()));
            std::copy(like.arena().begin(), like.arena().end(), pools.back()->arena().begin());
            r.push_back(std::make_unique<TransferReceiver>(world(), plan, 100 + k, me - P,
                                                           *pools.back(), opts[k]));
        }
        bool all = false;
        while (!all) {
            all = true;
            for (auto& x : r) all &= x->progress();
            if (!all) std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        for (auto& x : r) out.push_back(x->finish());
        // Request 0 lands in the destination side's own pool for checking.
        std::copy(pools[0]->arena().begin(), pools[0]->arena().end(),
                  dst.pools[me - P]->arena().begin());
        if (also != nullptr)
            std::copy(pools[also_index]->arena().begin(), pools[also_index]->arena().end(),
                      also->pools[me - P]->arena().begin());
    }
    return out;
}

// The pair's plan, HND pages to NHD pages, blocks shuffled by `seed`, a message per layer.
std::shared_ptr<TransferPlan> plan_for(const MpiPair& c, uint64_t seed) {
    const ModelSpec m = testing::llama_mini(5);
    auto src_ep = testing::make_endpoint(m, c.from, c.bs_from, PageOrder::kHnd, c.tokens, 0, seed);
    auto dst_ep = testing::make_endpoint(m, c.to, c.bs_to, PageOrder::kNhd, c.tokens, 0, seed + 1);
    return std::make_shared<TransferPlan>(
        make_transfer_plan(src_ep, dst_ep, c.tokens, {.layers_per_group = 1}));
}

int processes_for(const TransferPlan& plan) {
    return plan.src.layout.world_size() + plan.dst.layout.world_size();
}

TEST_P(TransferMpiTest, StreamedTransferIsExact) {
    const MpiPair& c = GetParam();
    auto plan = plan_for(c, 5);
    const int P = plan->src.layout.world_size();
    if (processes_for(*plan) != world().size())
        GTEST_SKIP() << "needs " << processes_for(*plan) << " processes";
    auto src = testing::make_source(plan->src, c.tokens);
    auto dst = testing::make_destination(plan->dst);
    TransferExecOptions good;
    good.dst_world_base = P;
    good.staging_bytes = 1;          // one message at a time: back-pressure on every send
    TransferExecOptions bad = good;  // another request, corrupted: fails alone
    const auto res =
        run_here(plan, src, dst, {good, bad}, nullptr, 0, {{1, {.corrupt_message = 0}}});
    const int me = world().rank();
    EXPECT_TRUE(res[0].ok()) << res[0].error;
    if (me >= P) {
        const int d = me - P;
        EXPECT_EQ(res[0].bytes, needed_bytes(*plan, d));
        EXPECT_EQ(wrong_elements(*plan, dst, d, c.tokens), 0) << "destination rank " << d;
        if (d == plan->messages[0].dst_rank) {
            EXPECT_EQ(res[1].status, TransferStatus::kChecksumMismatch) << res[1].error;
        }
    } else if (me == plan->messages[0].src_rank) {
        EXPECT_EQ(res[1].status, TransferStatus::kPeerFailed) << res[1].error;
    }
}

// Shareable source pools: each destination process maps its sources' pools and reads every message
// in place (direct read), exactly; a corrupt request fails alone; a request with direct reads off
// moves the same bytes in messages.
TEST_P(TransferMpiTest, DirectReadAcrossProcessesIsExact) {
    const MpiPair& c = GetParam();
    auto plan = plan_for(c, 7);
    const int P = plan->src.layout.world_size();
    if (processes_for(*plan) != world().size())
        GTEST_SKIP() << "needs " << processes_for(*plan) << " processes";
    auto src = testing::make_source(plan->src, c.tokens, PoolMemory::kShareable);
    auto dst = testing::make_destination(plan->dst);
    TransferExecOptions good;
    good.dst_world_base = P;
    good.direct_window = 1;
    good.arena_views = std::make_shared<SharedArenaViews>();
    TransferExecOptions bad = good;  // message 0 corrupted
    TransferExecOptions off = good;
    off.direct_read = false;
    auto dst_off = testing::make_destination(plan->dst);
    const auto res =
        run_here(plan, src, dst, {good, bad, off}, &dst_off, 2, {{1, {.corrupt_message = 0}}});
    const int me = world().rank();
    EXPECT_TRUE(res[0].ok()) << res[0].error;
    EXPECT_TRUE(res[2].ok()) << res[2].error;
    EXPECT_EQ(res[0].direct_messages, res[0].messages);
    EXPECT_GT(res[0].messages, 0);
    EXPECT_EQ(res[2].direct_messages, 0);
    if (me >= P) {
        const int d = me - P;
        EXPECT_EQ(res[0].bytes, needed_bytes(*plan, d));
        EXPECT_EQ(wrong_elements(*plan, dst, d, c.tokens), 0) << "destination rank " << d;
        EXPECT_EQ(wrong_elements(*plan, dst_off, d, c.tokens), 0)
            << "destination rank " << d << ", in messages";
        if (d == plan->messages[0].dst_rank) {
            EXPECT_EQ(res[1].status, TransferStatus::kChecksumMismatch) << res[1].error;
        }
    } else {
        EXPECT_LE(res[0].peak_direct_ahead, 1);  // direct_window 1
        if (me == plan->messages[0].src_rank) {
            EXPECT_EQ(res[1].status, TransferStatus::kPeerFailed) << res[1].error;
        }
    }
}

// Same layout on both sides, blocks in order: every payload goes straight from the source pool to
// the destination pool, and the receivers check them on their worker threads (any size here)
// while senders sleep between polls once all is posted. A corrupt request fails alone.
TEST(TransferMpiZeroCopy, CheckedOnWorkerThread) {
    const ModelSpec m = testing::llama_mini(5);
    auto src_ep = testing::make_endpoint(m, "pp=3", 16, PageOrder::kHnd, 64);
    auto dst_ep = testing::make_endpoint(m, "pp=3", 16, PageOrder::kHnd, 64);
    if (world().size() != 6) GTEST_SKIP() << "needs 6 processes";
    auto plan = std::make_shared<TransferPlan>(
        make_transfer_plan(src_ep, dst_ep, 64, {.layers_per_group = 1}));
    auto src = testing::make_source(plan->src, 64);
    auto dst = testing::make_destination(plan->dst);
    TransferExecOptions good;
    good.dst_world_base = 3;
    good.offload_check_bytes = 0;
    good.sender_idle_sleep_us = 50;
    TransferExecOptions bad = good;  // message 1 corrupted
    const auto res =
        run_here(plan, src, dst, {good, bad}, nullptr, 0, {{1, {.corrupt_message = 1}}});
    const int me = world().rank();
    EXPECT_TRUE(res[0].ok()) << res[0].error;
    EXPECT_EQ(res[0].zero_copy_messages, res[0].messages);
    if (me >= 3) {
        const int d = me - 3;
        EXPECT_EQ(wrong_elements(*plan, dst, d, 64), 0) << "destination rank " << d;
        if (d == plan->messages[1].dst_rank) {
            EXPECT_EQ(res[1].status, TransferStatus::kChecksumMismatch) << res[1].error;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Pairs, TransferMpiTest,
                         ::testing::Values(MpiPair{"tp=2", "tp=1", 70, 16, 64},   // 3 processes
                                           MpiPair{"tp=4", "tp=2", 100, 16, 16},  // 6
                                           MpiPair{"tp=2,pp=2", "tp=1,pp=2", 50, 8, 16},  // 6
                                           MpiPair{"cp=2,tp=2,cp_scheme=zigzag", "tp=2", 64, 16,
                                                   16}),  // 6
                         [](const auto& info) { return "pair" + std::to_string(info.index); });

}  // namespace
}  // namespace kvshard
