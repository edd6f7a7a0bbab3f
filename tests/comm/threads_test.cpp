// Thread-backend tests of every Communicator operation.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <thread>

#include "comm/conformance.h"
#include "kvshard/comm/communicator.h"
#include "kvshard/comm/groups.h"
#include "kvshard/comm/threads.h"

namespace kvshard {
namespace {

using conformance::reduce_input;

// The backend conformance suite on several world sizes (1 and odd sizes included).
using RankBody = void (*)(Communicator&);
class Conformance : public testing::TestWithParam<std::tuple<const char*, RankBody>> {};

TEST_P(Conformance, OnWorldSizes) {
    for (int n : {1, 2, 3, 4, 6}) {
        SCOPED_TRACE(testing::Message() << "world " << n);
        run_threads(n, std::get<1>(GetParam()));
    }
}

#define KVSHARD_CASE(f) std::make_tuple(#f, &conformance::f)
INSTANTIATE_TEST_SUITE_P(
    Threads, Conformance,
    testing::Values(KVSHARD_CASE(send_recv_all_pairs), KVSHARD_CASE(non_overtaking),
                    KVSHARD_CASE(recv_any_size_and_empty), KVSHARD_CASE(non_blocking_overlap),
                    KVSHARD_CASE(sendrecv_ring), KVSHARD_CASE(size_mismatch_is_an_error),
                    KVSHARD_CASE(broadcast_from_every_root), KVSHARD_CASE(all_gather_equal_blocks),
                    KVSHARD_CASE(all_gather_v_with_zero_sizes),
                    KVSHARD_CASE(all_to_all_v_uneven_and_zero),
                    KVSHARD_CASE(all_reduce_sum_is_rank_order),
                    KVSHARD_CASE(all_reduce_types_and_ops), KVSHARD_CASE(split_groups)),
    [](const auto& info) { return std::string(std::get<0>(info.param)); });
#undef KVSHARD_CASE

TEST(Threads, GroupsMatchLayout) {
    for (int n : {1, 2, 4, 6, 8}) {
        for (const ParallelConfig& p : conformance::layouts_for(n)) {
            SCOPED_TRACE(p.to_string());
            run_threads(n,
                        [&](Communicator& world) { conformance::groups_match_layout(world, p); });
        }
    }
}

TEST(Threads, RankAndSize) {
    for (int n : {1, 2, 5}) {
        std::vector<int> seen(n, -1);
        run_threads(n, [&](Communicator& c) {
            EXPECT_EQ(c.size(), n);
            EXPECT_EQ(c.backend(), Backend::kThreads);
            seen[c.rank()] = c.rank();
        });
        for (int r = 0; r < n; ++r) EXPECT_EQ(seen[r], r);
    }
}

TEST(Threads, InvalidWorldSize) {
    EXPECT_THROW(run_threads(0, [](Communicator&) {}), Error);
}

TEST(Threads, SizeMismatchThrows) {
    EXPECT_THROW(run_threads(2,
                             [](Communicator& c) {
                                 if (c.rank() == 0) {
                                     c.send(std::vector<float>(4), 1, 0);
                                 } else {
                                     std::vector<float> v(3);
                                     c.recv(v, 0, 0);
                                 }
                             }),
                 Error);
}

TEST(Threads, BadArgumentsThrowError) {
    run_threads(2, [](Communicator& c) {
        std::vector<float> v(1);
        EXPECT_THROW(c.send(v, 2, 0), Error);
        EXPECT_THROW(c.send(v, -1, 0), Error);
        EXPECT_THROW(c.recv(v, 0, -1), Error);
        EXPECT_THROW(c.recv(v, 0, Communicator::kMaxTag + 1), Error);
        EXPECT_THROW(c.split(-5, 0), Error);
        std::vector<float> small(1);
        EXPECT_THROW(c.all_gather(v, small), Error);
    });
}

TEST(Threads, DroppedRequestIsCancelled) {
    run_threads(2, [](Communicator& c) {
        if (c.rank() == 1) {
            {
                std::vector<int> buf(1);
                Request dropped = c.irecv(buf, 0, 9);
            }  // unmatched: cancelled, buf may die
            c.barrier();
            EXPECT_EQ(c.recv_value<int>(0, 9), 42);
        } else {
            c.barrier();
            c.send_value(42, 1, 9);
        }
    });
}

TEST(Threads, Barrier) {
    std::atomic<int> arrived{0};
    run_threads(4, [&](Communicator& c) {
        for (int round = 1; round <= 20; ++round) {
            arrived.fetch_add(1);
            c.barrier();
            EXPECT_GE(arrived.load(), round * 4);
            c.barrier();
        }
    });
}

TEST(Threads, AllToAllVMismatchedCountsThrow) {
    EXPECT_THROW(run_threads(2,
                             [](Communicator& c) {
                                 std::vector<std::size_t> sc{1, 1}, rc{1, 2};
                                 std::vector<std::byte> s(2), r(3);
                                 c.all_to_all_v(s, sc, r, rc);
                             }),
                 Error);
}

// Forwards everything to a real communicator but keeps the base class's generic all-reduce (the
// one the MPI backend uses): the thread backend's shared-memory reduction must match it bit for
// bit.
class GenericReduce final : public Communicator {
  public:
    explicit GenericReduce(Communicator& inner) : c_(inner) {}
    int rank() const override { return c_.rank(); }
    int size() const override { return c_.size(); }
    Backend backend() const override { return c_.backend(); }

  protected:
    void do_send(std::span<const std::byte> d, int p, int t) override { c_.send(d, p, t); }
    void do_recv(std::span<std::byte> d, int p, int t) override { c_.recv(d, p, t); }
    std::vector<std::byte> do_recv_any_size(int p, int t) override {
        return c_.recv_any_size(p, t);
    }
    Request do_isend(std::span<const std::byte> d, int p, int t) override {
        return c_.isend(d, p, t);
    }
    Request do_irecv(std::span<std::byte> d, int p, int t) override { return c_.irecv(d, p, t); }
    void do_barrier() override { c_.barrier(); }
    void do_broadcast(std::span<std::byte> d, int root) override { c_.broadcast(d, root); }
    void do_all_gather(std::span<const std::byte> s, std::span<std::byte> r) override {
        c_.all_gather(s, r);
    }
    void do_all_gather_v(std::span<const std::byte> s, std::span<std::byte> r,
                         std::span<const std::size_t> rc) override {
        c_.all_gather_v(s, r, rc);
    }
    void do_all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> sc,
                         std::span<std::byte> r, std::span<const std::size_t> rc) override {
        c_.all_to_all_v(s, sc, r, rc);
    }
    std::unique_ptr<Communicator> do_split(int color, int key) override {
        return c_.split(color, key);
    }

  private:
    Communicator& c_;
};

TEST(Threads, AllReduceSumIsRankOrderAndMatchesGeneric) {
    for (int n : {1, 2, 3, 5}) {
        for (std::size_t count : {0ul, 1ul, 2ul, 7ul, 10000ul, 100003ul}) {
            run_threads(n, [&](Communicator& c) {
                std::vector<float> a(count), b(count);
                for (std::size_t i = 0; i < count; ++i) a[i] = b[i] = reduce_input(c.rank(), i);
                c.all_reduce_sum(a);
                GenericReduce g(c);
                g.all_reduce_sum(b);
                for (std::size_t i = 0; i < count; ++i) {
                    float expect = reduce_input(0, i);
                    for (int r = 1; r < n; ++r) expect = expect + reduce_input(r, i);
                    ASSERT_EQ(std::memcmp(&a[i], &expect, 4), 0) << "n=" << n << " i=" << i;
                    ASSERT_EQ(std::memcmp(&b[i], &expect, 4), 0) << "n=" << n << " i=" << i;
                }
            });
        }
    }
}

TEST(Threads, AllReduceMismatchedLengthsThrow) {
    EXPECT_THROW(run_threads(2,
                             [](Communicator& c) {
                                 std::vector<float> v(10 + c.rank());
                                 c.all_reduce_sum(v);
                             }),
                 Error);
}

TEST(Threads, ExceptionPropagatesAndOthersDoNotHang) {
    // Rank 2 throws while the others block in a recv and in a collective.
    try {
        run_threads(4, [](Communicator& c) {
            if (c.rank() == 2) throw std::runtime_error("boom on rank 2");
            if (c.rank() == 0) {
                std::vector<int> v(1);
                c.recv(v, 2, 0);
            }
            c.barrier();
        });
        FAIL() << "no exception";
    } catch (const CommAborted&) {
        FAIL() << "the first exception must be the original one";
    } catch (const std::runtime_error& e) {
        EXPECT_STREQ(e.what(), "boom on rank 2");
    }
}

TEST(Threads, OtherRanksSeeCommAbortedNamingTheFailedRank) {
    std::vector<std::string> seen(3);
    EXPECT_THROW(run_threads(3,
                             [&](Communicator& c) {
                                 if (c.rank() == 1) throw Error("bad input");
                                 try {
                                     c.barrier();
                                 } catch (const CommAborted& e) {
                                     seen[c.rank()] = e.what();
                                     throw;
                                 }
                             }),
                 Error);
    for (int r : {0, 2}) EXPECT_NE(seen[r].find("rank 1 failed: bad input"), std::string::npos);
}

TEST(Threads, DeadlockIsDetected) {
    // Both ranks receive first: nothing can ever complete.
    try {
        run_threads(2, [](Communicator& c) {
            std::vector<int> v(1);
            c.recv(v, 1 - c.rank(), 0);
        });
        FAIL() << "no exception";
    } catch (const CommAborted& e) {
        EXPECT_NE(std::string(e.what()).find("deadlock"), std::string::npos) << e.what();
    }
    // A rank waits for a rank that already returned.
    EXPECT_THROW(run_threads(3,
                             [](Communicator& c) {
                                 if (c.rank() == 0) c.recv_value<int>(1, 0);
                             }),
                 CommAborted);
    // Blocking sends both ways (unsafe under MPI's rendezvous) are reported, not hung.
    EXPECT_THROW(run_threads(2,
                             [](Communicator& c) {
                                 c.send_value(1, 1 - c.rank(), 0);
                                 c.recv_value<int>(1 - c.rank(), 0);
                             }),
                 CommAborted);
}

// Sets the process-wide communication timeout for one test and restores the default after.
struct ScopedCommTimeout {
    explicit ScopedCommTimeout(double s) { set_comm_timeout(s); }
    ~ScopedCommTimeout() { set_comm_timeout(kDefaultCommTimeoutS); }
};

std::string timeout_message(int world, const std::function<void(Communicator&)>& fn) {
    try {
        run_threads(world, fn);
    } catch (const CommTimeout& e) {
        return e.what();
    } catch (const std::exception& e) {
        return std::string("not a CommTimeout: ") + e.what();
    }
    return "no timeout";
}

// A rank that is late for a collective (it is computing, or stopped) ends the run after the
// timeout on every other rank, with a message that names it; without the timeout it would wait.
TEST(Threads, CollectiveTimeoutNamesTheLateRank) {
    ScopedCommTimeout limit(0.3);
    std::atomic<int> saw_timeout{0};
    const std::string msg = timeout_message(3, [&](Communicator& c) {
        if (c.rank() == 1) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            return;  // never joins the barrier
        }
        try {
            c.barrier();
        } catch (const CommTimeout& e) {
            if (std::string(e.what()).find("rank 1 is not communicating") != std::string::npos)
                ++saw_timeout;
            throw;
        }
    });
    EXPECT_NE(msg.find("timeout: rank "), std::string::npos) << msg;
    EXPECT_NE(msg.find("in barrier"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 1 is not communicating"), std::string::npos) << msg;
    EXPECT_EQ(saw_timeout.load(), 2);  // both waiting ranks, each with the late rank named
}

TEST(Threads, ReceiveTimeoutNamesThePeer) {
    ScopedCommTimeout limit(0.2);
    const std::string msg = timeout_message(2, [](Communicator& c) {
        if (c.rank() == 0) {
            int v = 0;
            c.recv(std::span<int>(&v, 1), 1, 7);
        } else {
            std::this_thread::sleep_for(std::chrono::milliseconds(800));
        }
    });
    EXPECT_NE(msg.find("in recv from rank 1"), std::string::npos) << msg;
}

// A rank that never returns is left behind after the grace period: run_threads still ends, with
// the timeout and the stuck rank in its error.
TEST(Threads, StuckRankIsLeftBehind) {
    ScopedCommTimeout limit(0.2);
    auto release = std::make_shared<std::atomic<bool>>(false);
    const std::string msg = timeout_message(2, [release](Communicator& c) {
        if (c.rank() == 1) {
            while (!release->load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
            return;
        }
        c.barrier();
    });
    release->store(true);
    EXPECT_NE(msg.find("rank(s) 1 did not return and were left behind"), std::string::npos) << msg;
}

// With the timeout off (0), a slow rank is waited for.
TEST(Threads, NoTimeoutWaitsForASlowRank) {
    ScopedCommTimeout limit(0);
    EXPECT_NO_THROW(run_threads(2, [](Communicator& c) {
        if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        c.barrier();
    }));
    EXPECT_THROW(set_comm_timeout(-1), Error);
    EXPECT_THROW(set_comm_timeout(std::nan("")), Error);
}

TEST(Threads, ManyRoundsOfMixedTraffic) {
    run_threads(4, [](Communicator& c) {
        for (int round = 0; round < 200; ++round) {
            const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
            std::vector<int> out{round, c.rank()}, in(2);
            Request r = c.irecv(in, prev, round % 3);
            c.send(out, next, round % 3);
            r.wait();
            ASSERT_EQ(in, (std::vector<int>{round, prev}));
            ASSERT_EQ(c.all_reduce_value(1, ReduceOp::kSum), n);
        }
    });
}

TEST(Groups, WrongWorldSizeOrEpThrows) {
    run_threads(4, [](Communicator& world) {
        EXPECT_THROW(make_groups(world, parse_parallel_config("tp=2")), Error);
        EXPECT_THROW(make_groups(world, parse_parallel_config("tp=4,ep=3")), Error);
    });
}

}  // namespace
}  // namespace kvshard
