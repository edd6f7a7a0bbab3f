// The backend conformance suite (tests/comm/conformance.h) on the MPI backend, under mpirun.
#include <gtest/gtest.h>

#include <cstring>

#include "comm/conformance.h"
#include "kvshard/comm/launch.h"
#include "kvshard/comm/mpi.h"
#include "kvshard/comm/threads.h"

namespace kvshard {
namespace {

Communicator& world() {
    static std::unique_ptr<Communicator> w = mpi_world();
    return *w;
}

TEST(Mpi, WorldMatchesMpirun) {
    EXPECT_EQ(world().backend(), Backend::kMpi);
    EXPECT_EQ(world().size(), mpirun_world_size());
    EXPECT_TRUE(world().size() == 1 || under_mpirun());
}

#define KVSHARD_CONFORMANCE(f) \
    TEST(MpiConformance, f) { conformance::f(world()); }
KVSHARD_CONFORMANCE(send_recv_all_pairs)
KVSHARD_CONFORMANCE(non_overtaking)
KVSHARD_CONFORMANCE(recv_any_size_and_empty)
KVSHARD_CONFORMANCE(non_blocking_overlap)
KVSHARD_CONFORMANCE(sendrecv_ring)
KVSHARD_CONFORMANCE(size_mismatch_is_an_error)
KVSHARD_CONFORMANCE(broadcast_from_every_root)
KVSHARD_CONFORMANCE(all_gather_equal_blocks)
KVSHARD_CONFORMANCE(all_gather_v_with_zero_sizes)
KVSHARD_CONFORMANCE(all_to_all_v_uneven_and_zero)
KVSHARD_CONFORMANCE(all_reduce_sum_is_rank_order)
KVSHARD_CONFORMANCE(all_reduce_types_and_ops)
KVSHARD_CONFORMANCE(split_groups)
#undef KVSHARD_CONFORMANCE

TEST(Mpi, GroupsMatchLayout) {
    for (const ParallelConfig& p : conformance::layouts_for(world().size())) {
        SCOPED_TRACE(p.to_string());
        conformance::groups_match_layout(world(), p);
    }
}

// The same all-reduce on both backends in one process gives the same bits.
TEST(Mpi, AllReduceBitIdenticalToThreadsBackend) {
    const int n = world().size();
    const std::size_t count = 4099;
    auto input = [](int r, std::size_t i) { return conformance::reduce_input(r, i) * 0.37f; };
    std::vector<float> mpi(count);
    for (std::size_t i = 0; i < count; ++i) mpi[i] = input(world().rank(), i);
    world().all_reduce_sum(mpi);
    std::vector<float> threads(count);
    run_threads(n, [&](Communicator& c) {
        std::vector<float> v(count);
        for (std::size_t i = 0; i < count; ++i) v[i] = input(c.rank(), i);
        c.all_reduce_sum(v);
        if (c.rank() == 0) threads = v;
    });
    EXPECT_EQ(std::memcmp(mpi.data(), threads.data(), count * sizeof(float)), 0);
}

TEST(Mpi, LaunchRunsTheRankFunctionOnce) {
    int calls = 0;
    launch(Backend::kMpi, 0, [&](Communicator& c) {
        ++calls;
        EXPECT_EQ(c.size(), world().size());
        EXPECT_EQ(c.rank(), world().rank());
        EXPECT_EQ(c.all_reduce_value(1, ReduceOp::kSum), c.size());
    });
    EXPECT_EQ(calls, 1);
    launch(Backend::kMpi, world().size(), [&](Communicator& c) { ++calls; });
    EXPECT_EQ(calls, 2);
}

TEST(Mpi, LaunchWithTheWrongWorldSizeIsAnError) {
    try {
        launch(Backend::kMpi, world().size() + 1, [](Communicator&) {});
        FAIL() << "no exception";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("mpirun -np"), std::string::npos) << e.what();
    }
}

TEST(Mpi, LargeMessage) {
    if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
    std::vector<std::uint32_t> v(8 << 20);  // 32 MiB
    if (world().rank() == 0) {
        for (std::size_t i = 0; i < v.size(); ++i)
            v[i] = static_cast<std::uint32_t>(i * 2654435761u);
        world().send(v, 1, 1);
    } else if (world().rank() == 1) {
        world().recv(v, 0, 1);
        for (std::size_t i = 0; i < v.size(); i += 4097)
            ASSERT_EQ(v[i], static_cast<std::uint32_t>(i * 2654435761u));
    }
    world().barrier();
}

}  // namespace
}  // namespace kvshard
