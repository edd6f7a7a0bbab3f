// Thread-backend tests of every Communicator operation.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "kvshard/comm/communicator.h"
#include "kvshard/comm/groups.h"
#include "kvshard/comm/threads.h"

namespace kvshard {
namespace {

// A value that names where it came from: a wrong copy cannot look right.
float code(int src, int dst, int i) { return static_cast<float>(src * 1000000 + dst * 10000 + i); }

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

TEST(Threads, SendRecvTyped) {
    run_threads(3, [](Communicator& c) {
        // Every rank sends a vector to every other rank; receive in reverse order to exercise the
        // mailbox (sends arrive before their receives are posted).
        std::vector<std::vector<float>> out(3);
        std::vector<Request> reqs;
        for (int d = 0; d < 3; ++d) {
            if (d == c.rank()) continue;
            out[d].resize(100 + d);
            for (int i = 0; i < static_cast<int>(out[d].size()); ++i)
                out[d][i] = code(c.rank(), d, i);
            reqs.push_back(c.isend(out[d], d, 7));
        }
        for (int s = 2; s >= 0; --s) {
            if (s == c.rank()) continue;
            std::vector<float> in(100 + c.rank());
            c.recv(in, s, 7);
            for (int i = 0; i < static_cast<int>(in.size()); ++i)
                ASSERT_EQ(in[i], code(s, c.rank(), i));
        }
        wait_all(reqs);
    });
}

TEST(Threads, NonOvertakingAndTagMatching) {
    // Non-blocking sends queue up in the mailbox before any receive is posted.
    run_threads(2, [](Communicator& c) {
        if (c.rank() == 0) {
            std::vector<int> vals(10);
            std::iota(vals.begin(), vals.end(), 0);
            std::vector<Request> reqs;
            for (int i = 0; i < 10; ++i)
                reqs.push_back(c.isend(std::span<const int>(&vals[i], 1), 1, i % 2));
            wait_all(reqs);
        } else {
            // Tag 1 first: matching is by (source, tag), in order within a tag.
            for (int i = 1; i < 10; i += 2) EXPECT_EQ(c.recv_value<int>(0, 1), i);
            for (int i = 0; i < 10; i += 2) EXPECT_EQ(c.recv_value<int>(0, 0), i);
        }
    });
}

TEST(Threads, RecvAnySizeAndEmptyMessages) {
    run_threads(2, [](Communicator& c) {
        if (c.rank() == 0) {
            std::vector<std::byte> msg(12345, std::byte{0x5a});
            c.send(msg, 1, 3);
            c.send(std::span<const std::byte>(), 1, 4);
            c.send(std::span<const std::byte>(), 1, 5);
        } else {
            auto got = c.recv_any_size(0, 3);
            ASSERT_EQ(got.size(), 12345u);
            EXPECT_EQ(got[12344], std::byte{0x5a});
            EXPECT_TRUE(c.recv_any_size(0, 4).empty());
            c.recv(std::span<std::byte>(), 0, 5);
        }
    });
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

TEST(Threads, NonBlockingOverlapAndTest) {
    run_threads(2, [](Communicator& c) {
        const int peer = 1 - c.rank();
        std::vector<double> out(1 << 16), in(1 << 16);
        for (std::size_t i = 0; i < out.size(); ++i)
            out[i] = c.rank() * 1e6 + static_cast<double>(i);
        // Both ranks post the receive and the send first, then compute, then complete.
        Request r = c.irecv(in, peer, 1);
        Request s = c.isend(out, peer, 1);
        double busy = 0;
        for (int i = 0; i < 1000; ++i) busy += std::sqrt(static_cast<double>(i));
        EXPECT_GT(busy, 0);
        while (!r.test()) {
        }
        EXPECT_FALSE(r.pending());
        s.wait();
        for (std::size_t i = 0; i < in.size(); ++i)
            ASSERT_EQ(in[i], peer * 1e6 + static_cast<double>(i));
        EXPECT_TRUE(r.test());  // a completed request stays complete
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

TEST(Threads, SendRecvRing) {
    run_threads(5, [](Communicator& c) {
        const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
        std::vector<float> out(1000, static_cast<float>(c.rank())), in(1000);
        c.sendrecv(std::as_bytes(std::span(out)), next, 2, std::as_writable_bytes(std::span(in)),
                   prev, 2);
        EXPECT_EQ(in[999], static_cast<float>(prev));
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

TEST(Threads, Broadcast) {
    run_threads(4, [](Communicator& c) {
        for (int root = 0; root < c.size(); ++root) {
            std::vector<int> v(257, c.rank() == root ? root + 100 : -1);
            c.broadcast(v, root);
            for (int x : v) ASSERT_EQ(x, root + 100);
            EXPECT_EQ(c.broadcast_value(c.rank() * 3, root), root * 3);
        }
    });
}

TEST(Threads, AllGather) {
    run_threads(3, [](Communicator& c) {
        std::vector<float> mine(5), all(15);
        for (int i = 0; i < 5; ++i) mine[i] = code(c.rank(), 0, i);
        c.all_gather(mine, all);
        for (int r = 0; r < 3; ++r)
            for (int i = 0; i < 5; ++i) ASSERT_EQ(all[r * 5 + i], code(r, 0, i));
        auto ranks = c.all_gather_value(c.rank() * 7);
        EXPECT_EQ(ranks, (std::vector<int>{0, 7, 14}));
    });
}

TEST(Threads, AllGatherVWithZeroSizes) {
    run_threads(4, [](Communicator& c) {
        // Rank r contributes r*3 bytes (rank 0 nothing).
        std::vector<std::size_t> counts{0, 3, 6, 9};
        std::vector<std::byte> mine(counts[c.rank()], static_cast<std::byte>(c.rank() + 1));
        std::vector<std::byte> all(18);
        c.all_gather_v(mine, all, counts);
        std::size_t off = 0;
        for (int r = 0; r < 4; ++r)
            for (std::size_t i = 0; i < counts[r]; ++i)
                ASSERT_EQ(all[off++], static_cast<std::byte>(r + 1));
        auto blobs = c.all_gather_blobs(mine);
        ASSERT_EQ(blobs.size(), 4u);
        for (int r = 0; r < 4; ++r) {
            ASSERT_EQ(blobs[r].size(), counts[r]);
            for (auto b : blobs[r]) ASSERT_EQ(b, static_cast<std::byte>(r + 1));
        }
    });
}

// Rank s sends (s + 2*d) % 4 elements to rank d: uneven, with zeros, including to itself.
std::size_t a2a_count(int s, int d) { return static_cast<std::size_t>((s + 2 * d) % 4); }

TEST(Threads, AllToAllVUnevenAndZeroCounts) {
    run_threads(4, [](Communicator& c) {
        const int n = c.size(), me = c.rank();
        std::vector<std::size_t> send_counts(n);
        std::vector<float> send;
        for (int d = 0; d < n; ++d) {
            send_counts[d] = a2a_count(me, d);
            for (std::size_t i = 0; i < send_counts[d]; ++i)
                send.push_back(code(me, d, static_cast<int>(i)));
        }
        auto recv_counts = c.all_to_all_counts(send_counts);
        for (int s = 0; s < n; ++s) ASSERT_EQ(recv_counts[s], a2a_count(s, me));
        std::vector<float> recv(
            std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0}));
        c.all_to_all_v(std::span<const float>(send), send_counts, std::span<float>(recv),
                       recv_counts);
        std::size_t off = 0;
        for (int s = 0; s < n; ++s)
            for (std::size_t i = 0; i < recv_counts[s]; ++i)
                ASSERT_EQ(recv[off++], code(s, me, static_cast<int>(i)));
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

// Values with wildly different magnitudes, so that any other summation order changes the bits.
float reduce_input(int rank, std::size_t i) {
    const float mag[] = {1e8f, 1.0f, -1e8f, 3e-3f, 7.5f};
    return mag[(rank + i) % 5] * (1.0f + static_cast<float>(i % 7) * 0.1f);
}

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

TEST(Threads, AllReduceOtherTypesAndOps) {
    run_threads(4, [](Communicator& c) {
        const int r = c.rank();
        std::vector<std::int32_t> i32{r, -r, 10 * r};
        c.all_reduce(i32, ReduceOp::kMax);
        EXPECT_EQ(i32, (std::vector<std::int32_t>{3, 0, 30}));
        std::vector<std::int64_t> i64{std::int64_t{1} << 40, r};
        c.all_reduce_sum(i64);
        EXPECT_EQ(i64, (std::vector<std::int64_t>{std::int64_t{4} << 40, 6}));
        std::vector<double> d{1.5 * r, -1.0 * r};
        c.all_reduce(d, ReduceOp::kMin);
        EXPECT_EQ(d, (std::vector<double>{0.0, -3.0}));
        EXPECT_EQ(c.all_reduce_value(r + 1, ReduceOp::kSum), 10);
        EXPECT_FLOAT_EQ(c.all_reduce_value(static_cast<float>(r), ReduceOp::kMax), 3.0f);
    });
}

TEST(Threads, AllReduceMismatchedLengthsThrow) {
    EXPECT_THROW(run_threads(2,
                             [](Communicator& c) {
                                 std::vector<float> v(10 + c.rank());
                                 c.all_reduce_sum(v);
                             }),
                 Error);
}

TEST(Threads, SplitEvenOddReversedKeys) {
    run_threads(6, [](Communicator& c) {
        auto sub = c.split(c.rank() % 2, -c.rank());
        ASSERT_NE(sub, nullptr);
        EXPECT_EQ(sub->size(), 3);
        // Keys are -rank: highest world rank first.
        const int expect_rank = (c.rank() % 2 == 0) ? (4 - c.rank()) / 2 : (5 - c.rank()) / 2;
        EXPECT_EQ(sub->rank(), expect_rank);
        auto members = sub->all_gather_value(c.rank());
        if (c.rank() % 2 == 0)
            EXPECT_EQ(members, (std::vector<int>{4, 2, 0}));
        else
            EXPECT_EQ(members, (std::vector<int>{5, 3, 1}));
        // Traffic in the sub-group with the same tags as in the parent does not mix.
        // World rank 4 is rank 0 of its sub-group and world rank 2 is rank 1 of it.
        if (c.rank() == 4) {
            const int a = 104, b = -4;
            Request r1 = sub->isend(std::span<const int>(&a, 1), 1, 0);
            Request r2 = c.isend(std::span<const int>(&b, 1), 2, 0);
            r1.wait();
            r2.wait();
        }
        if (c.rank() == 2) {
            EXPECT_EQ(c.recv_value<int>(4, 0), -4);
            EXPECT_EQ(sub->recv_value<int>(0, 0), 104);
        }
        EXPECT_EQ(sub->all_reduce_value(c.rank(), ReduceOp::kSum), c.rank() % 2 ? 9 : 6);
        // Nested split.
        auto single = sub->split(sub->rank(), 0);
        EXPECT_EQ(single->size(), 1);
        EXPECT_EQ(single->all_reduce_value(5, ReduceOp::kSum), 5);
    });
}

TEST(Threads, SplitUndefinedColor) {
    run_threads(4, [](Communicator& c) {
        auto sub = c.split(c.rank() < 3 ? 0 : Communicator::kUndefinedColor, 0);
        if (c.rank() == 3) {
            EXPECT_EQ(sub, nullptr);
        } else {
            ASSERT_NE(sub, nullptr);
            EXPECT_EQ(sub->size(), 3);
            EXPECT_EQ(sub->rank(), c.rank());  // equal keys: old rank order
            sub->barrier();
        }
    });
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

// ---- groups from the layout ----

class MakeGroups : public testing::TestWithParam<const char*> {};

TEST_P(MakeGroups, EveryGroupMatchesTheRankOrder) {
    const ParallelConfig p = parse_parallel_config(GetParam());
    run_threads(p.world_size(), [&](Communicator& world) {
        ParallelGroups g = make_groups(world, p);
        const RankCoord c = rank_coord(p, world.rank());
        EXPECT_EQ(g.coord, c);
        ASSERT_EQ(g.tp->size(), p.tp);
        ASSERT_EQ(g.cp->size(), p.cp);
        ASSERT_EQ(g.pp->size(), p.pp);
        ASSERT_EQ(g.dp->size(), p.dp);
        ASSERT_EQ(g.ep->size(), p.ep);
        ASSERT_EQ(g.stage->size(), p.stage_size());
        ASSERT_EQ(g.replica->size(), p.pp * p.cp * p.tp);
        EXPECT_EQ(g.tp->rank(), c.tp);
        EXPECT_EQ(g.cp->rank(), c.cp);
        EXPECT_EQ(g.pp->rank(), c.pp);
        EXPECT_EQ(g.dp->rank(), c.dp);
        EXPECT_EQ(g.ep->rank(), c.ep);
        // Members, by world rank, as the layout predicts.
        auto tp = g.tp->all_gather_value(world.rank());
        for (int i = 0; i < p.tp; ++i) EXPECT_EQ(tp[i], rank_of(p, c.dp, c.pp, c.cp, i));
        auto cp = g.cp->all_gather_value(world.rank());
        for (int i = 0; i < p.cp; ++i) EXPECT_EQ(cp[i], rank_of(p, c.dp, c.pp, i, c.tp));
        auto pp = g.pp->all_gather_value(world.rank());
        for (int i = 0; i < p.pp; ++i) EXPECT_EQ(pp[i], rank_of(p, c.dp, i, c.cp, c.tp));
        auto dp = g.dp->all_gather_value(world.rank());
        for (int i = 0; i < p.dp; ++i) EXPECT_EQ(dp[i], rank_of(p, i, c.pp, c.cp, c.tp));
        auto ep = g.ep->all_gather_value(world.rank());
        for (int i = 0; i < p.ep; ++i) {
            const RankCoord m = rank_coord(p, ep[i]);
            EXPECT_EQ(m.pp, c.pp);
            EXPECT_EQ(m.ep_group, c.ep_group);
            EXPECT_EQ(m.ep, i);
        }
        auto stage = g.stage->all_gather_value(world.rank());
        for (int w : stage) EXPECT_EQ(rank_coord(p, w).pp, c.pp);
        // A TP all-reduce sums exactly the TP peers.
        EXPECT_EQ(g.tp->all_reduce_value(world.rank(), ReduceOp::kSum),
                  std::accumulate(tp.begin(), tp.end(), 0));
    });
}

INSTANTIATE_TEST_SUITE_P(Layouts, MakeGroups,
                         testing::Values("tp=1", "tp=4", "tp=2,pp=2", "tp=2,cp=2,pp=2",
                                         "dp=2,tp=2,ep=4", "dp=2,pp=2,tp=2,ep=2", "pp=3,tp=2",
                                         "dp=3,cp=2", "tp=8"));

TEST(Groups, WrongWorldSizeOrEpThrows) {
    run_threads(4, [](Communicator& world) {
        EXPECT_THROW(make_groups(world, parse_parallel_config("tp=2")), Error);
        EXPECT_THROW(make_groups(world, parse_parallel_config("tp=4,ep=3")), Error);
    });
}

}  // namespace
}  // namespace kvshard
