#pragma once
// Backend conformance checks: each function is a rank body that any Communicator must pass, for
// any size() >= 1. tests/comm runs them on the threads backend (several world sizes) and
// tests/multi_rank runs them under mpirun on the MPI backend: same checks, same expected bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kvshard/comm/communicator.h"
#include "kvshard/comm/groups.h"

namespace kvshard::conformance {

// A value that names where it came from: a wrong copy cannot look right.
inline float code(int src, int dst, int i) {
    return static_cast<float>(src * 1000000 + dst * 10000 + i);
}

// Every rank sends a vector of 100+d floats to every other rank d; receives in reverse rank order,
// so that sends wait in the mailbox before their receives are posted.
inline void send_recv_all_pairs(Communicator& c) {
    const int n = c.size(), me = c.rank();
    std::vector<std::vector<float>> out(n);
    std::vector<Request> reqs;
    for (int d = 0; d < n; ++d) {
        if (d == me) continue;
        out[d].resize(100 + d);
        for (int i = 0; i < static_cast<int>(out[d].size()); ++i) out[d][i] = code(me, d, i);
        reqs.push_back(c.isend(out[d], d, 7));
    }
    for (int s = n - 1; s >= 0; --s) {
        if (s == me) continue;
        std::vector<float> in(100 + me);
        c.recv(in, s, 7);
        for (int i = 0; i < static_cast<int>(in.size()); ++i) ASSERT_EQ(in[i], code(s, me, i));
    }
    wait_all(reqs);
}

// Matching is by (source, tag), in sending order within one tag.
inline void non_overtaking(Communicator& c) {
    if (c.size() < 2) return;
    if (c.rank() == 0) {
        std::vector<int> vals(10);
        std::iota(vals.begin(), vals.end(), 0);
        std::vector<Request> reqs;
        for (int i = 0; i < 10; ++i)
            reqs.push_back(c.isend(std::span<const int>(&vals[i], 1), 1, i % 2));
        wait_all(reqs);
    } else if (c.rank() == 1) {
        for (int i = 1; i < 10; i += 2) EXPECT_EQ(c.recv_value<int>(0, 1), i);
        for (int i = 0; i < 10; i += 2) EXPECT_EQ(c.recv_value<int>(0, 0), i);
    }
    c.barrier();
}

inline void recv_any_size_and_empty(Communicator& c) {
    if (c.size() < 2) return;
    if (c.rank() == 0) {
        std::vector<std::byte> msg(12345, std::byte{0x5a});
        c.send(msg, 1, 3);
        c.send(std::span<const std::byte>(), 1, 4);
        c.send(std::span<const std::byte>(), 1, 5);
    } else if (c.rank() == 1) {
        auto got = c.recv_any_size(0, 3);
        ASSERT_EQ(got.size(), 12345u);
        EXPECT_EQ(got[12344], std::byte{0x5a});
        EXPECT_TRUE(c.recv_any_size(0, 4).empty());
        c.recv(std::span<std::byte>(), 0, 5);
    }
    c.barrier();
}

// Both sides post receive and send first, do other work, then poll with test() and wait().
inline void non_blocking_overlap(Communicator& c) {
    const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    std::vector<double> out(1 << 16), in(1 << 16);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = c.rank() * 1e6 + static_cast<double>(i);
    Request r = c.irecv(in, prev, 1);
    Request s = c.isend(out, next, 1);
    double busy = 0;
    for (int i = 0; i < 1000; ++i) busy += std::sqrt(static_cast<double>(i));
    EXPECT_GT(busy, 0);
    while (!r.test()) {
    }
    EXPECT_FALSE(r.pending());
    s.wait();
    for (std::size_t i = 0; i < in.size(); ++i)
        ASSERT_EQ(in[i], prev * 1e6 + static_cast<double>(i));
    EXPECT_TRUE(r.test());  // a completed request stays complete
}

inline void sendrecv_ring(Communicator& c) {
    const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    for (int round = 0; round < 50; ++round) {
        std::vector<float> out(1000, static_cast<float>(c.rank() + round)), in(1000);
        c.sendrecv(std::as_bytes(std::span(out)), next, round % 4,
                   std::as_writable_bytes(std::span(in)), prev, round % 4);
        ASSERT_EQ(in[999], static_cast<float>(prev + round));
    }
}

inline void size_mismatch_is_an_error(Communicator& c) {
    if (c.size() < 2) return;
    if (c.rank() == 0) {
        std::vector<float> v(4, 1.0f);
        c.send(v, 1, 11);
    } else if (c.rank() == 1) {
        std::vector<float> v(8);
        EXPECT_THROW(c.recv(v, 0, 11), Error);
    }
    c.barrier();
}

inline void broadcast_from_every_root(Communicator& c) {
    for (int root = 0; root < c.size(); ++root) {
        std::vector<int> v(257, c.rank() == root ? root + 100 : -1);
        c.broadcast(v, root);
        for (int x : v) ASSERT_EQ(x, root + 100);
        EXPECT_EQ(c.broadcast_value(c.rank() * 3, root), root * 3);
    }
}

inline void all_gather_equal_blocks(Communicator& c) {
    const int n = c.size();
    std::vector<float> mine(5), all(5 * n);
    for (int i = 0; i < 5; ++i) mine[i] = code(c.rank(), 0, i);
    c.all_gather(mine, all);
    for (int r = 0; r < n; ++r)
        for (int i = 0; i < 5; ++i) ASSERT_EQ(all[r * 5 + i], code(r, 0, i));
    auto ranks = c.all_gather_value(c.rank() * 7);
    for (int r = 0; r < n; ++r) EXPECT_EQ(ranks[r], 7 * r);
}

// Rank r contributes 3*r bytes (rank 0 nothing).
inline void all_gather_v_with_zero_sizes(Communicator& c) {
    const int n = c.size();
    std::vector<std::size_t> counts(n);
    for (int r = 0; r < n; ++r) counts[r] = 3 * static_cast<std::size_t>(r);
    std::vector<std::byte> mine(counts[c.rank()], static_cast<std::byte>(c.rank() + 1));
    std::vector<std::byte> all(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
    c.all_gather_v(mine, all, counts);
    std::size_t off = 0;
    for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < counts[r]; ++i)
            ASSERT_EQ(all[off++], static_cast<std::byte>(r + 1));
    auto blobs = c.all_gather_blobs(mine);
    ASSERT_EQ(blobs.size(), static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
        ASSERT_EQ(blobs[r].size(), counts[r]);
        for (auto b : blobs[r]) ASSERT_EQ(b, static_cast<std::byte>(r + 1));
    }
}

// Rank s sends (s + 2*d) % 4 elements to rank d: uneven, with zeros, including to itself.
inline std::size_t a2a_count(int s, int d) { return static_cast<std::size_t>((s + 2 * d) % 4); }

inline void all_to_all_v_uneven_and_zero(Communicator& c) {
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
    c.all_to_all_v(std::span<const float>(send), send_counts, std::span<float>(recv), recv_counts);
    std::size_t off = 0;
    for (int s = 0; s < n; ++s)
        for (std::size_t i = 0; i < recv_counts[s]; ++i)
            ASSERT_EQ(recv[off++], code(s, me, static_cast<int>(i)));
}

// Values with wildly different magnitudes, so that any other summation order changes the bits.
inline float reduce_input(int rank, std::size_t i) {
    const float mag[] = {1e8f, 1.0f, -1e8f, 3e-3f, 7.5f};
    return mag[(rank + i) % 5] * (1.0f + static_cast<float>(i % 7) * 0.1f);
}

// all_reduce_sum equals the serial rank-order sum bit for bit, for sizes below, at and above
// the number of ranks.
inline void all_reduce_sum_is_rank_order(Communicator& c) {
    const int n = c.size();
    for (std::size_t count : {0ul, 1ul, 2ul, 7ul, 10000ul, 100003ul}) {
        std::vector<float> a(count);
        for (std::size_t i = 0; i < count; ++i) a[i] = reduce_input(c.rank(), i);
        c.all_reduce_sum(a);
        for (std::size_t i = 0; i < count; ++i) {
            float expect = reduce_input(0, i);
            for (int r = 1; r < n; ++r) expect = expect + reduce_input(r, i);
            ASSERT_EQ(std::memcmp(&a[i], &expect, 4), 0)
                << "n=" << n << " count=" << count << " i=" << i;
        }
    }
}

inline void all_reduce_types_and_ops(Communicator& c) {
    const int r = c.rank(), n = c.size();
    std::vector<std::int32_t> i32{r, -r, 10 * r};
    c.all_reduce(i32, ReduceOp::kMax);
    EXPECT_EQ(i32, (std::vector<std::int32_t>{n - 1, 0, 10 * (n - 1)}));
    std::vector<std::int64_t> i64{std::int64_t{1} << 40, r};
    c.all_reduce_sum(i64);
    EXPECT_EQ(i64, (std::vector<std::int64_t>{std::int64_t{n} << 40, n * (n - 1) / 2}));
    std::vector<double> d{1.5 * r, -1.0 * r};
    c.all_reduce(d, ReduceOp::kMin);
    EXPECT_EQ(d, (std::vector<double>{0.0, -1.0 * (n - 1)}));
    EXPECT_EQ(c.all_reduce_value(r + 1, ReduceOp::kSum), n * (n + 1) / 2);
    EXPECT_FLOAT_EQ(c.all_reduce_value(static_cast<float>(r), ReduceOp::kMax),
                    static_cast<float>(n - 1));
}

// Even/odd ranks, keys reversed (highest rank first); traffic with equal tags in the parent and the
// sub-group does not mix; nested splits; an undefined color gets nullptr.
inline void split_groups(Communicator& c) {
    const int n = c.size(), me = c.rank();
    auto sub = c.split(me % 2, -me);
    ASSERT_NE(sub, nullptr);
    std::vector<int> expect_members;
    for (int r = n - 1; r >= 0; --r)
        if (r % 2 == me % 2) expect_members.push_back(r);
    EXPECT_EQ(sub->size(), static_cast<int>(expect_members.size()));
    auto members = sub->all_gather_value(me);
    EXPECT_EQ(members, expect_members);
    EXPECT_EQ(members[sub->rank()], me);
    if (sub->size() >= 2) {
        // Sub-group rank 0 and 1 (world ranks members[0], members[1]) talk on tag 0 in both.
        const int a = members[0], b = members[1];
        if (me == a) {
            const int x = 100 + me, y = -me;
            Request r1 = sub->isend(std::span<const int>(&x, 1), 1, 0);
            Request r2 = c.isend(std::span<const int>(&y, 1), b, 0);
            r1.wait();
            r2.wait();
        }
        if (me == b) {
            EXPECT_EQ(c.recv_value<int>(a, 0), -a);
            EXPECT_EQ(sub->recv_value<int>(0, 0), 100 + a);
        }
    }
    EXPECT_EQ(sub->all_reduce_value(me, ReduceOp::kSum),
              std::accumulate(expect_members.begin(), expect_members.end(), 0));
    auto single = sub->split(sub->rank(), 0);
    ASSERT_NE(single, nullptr);
    EXPECT_EQ(single->size(), 1);
    EXPECT_EQ(single->all_reduce_value(5, ReduceOp::kSum), 5);
    auto partial = c.split(me < n - 1 || n == 1 ? 0 : Communicator::kUndefinedColor, 0);
    if (me == n - 1 && n > 1) {
        EXPECT_EQ(partial, nullptr);
    } else {
        ASSERT_NE(partial, nullptr);
        EXPECT_EQ(partial->rank(), me);  // equal keys: parent order
        partial->barrier();
    }
}

// make_groups: every group has the members the layout's rank order predicts.
inline void groups_match_layout(Communicator& world, const ParallelConfig& p) {
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
    auto replica = g.replica->all_gather_value(world.rank());
    for (int w : replica) EXPECT_EQ(rank_coord(p, w).dp, c.dp);
    EXPECT_EQ(g.tp->all_reduce_value(world.rank(), ReduceOp::kSum),
              std::accumulate(tp.begin(), tp.end(), 0));
}

// Every layout of `world_size` ranks worth checking.
inline std::vector<ParallelConfig> layouts_for(int world_size) {
    std::vector<ParallelConfig> out;
    for (const char* s : {"tp=1", "tp=2", "tp=4", "tp=8", "tp=2,pp=2", "tp=2,cp=2,pp=2",
                          "dp=2,tp=2,ep=4", "dp=2,pp=2,tp=2,ep=2", "pp=3,tp=2", "dp=3,cp=2", "pp=2",
                          "dp=2,ep=2", "cp=2,tp=2", "dp=2,tp=2", "pp=4", "cp=4"}) {
        ParallelConfig p = parse_parallel_config(s);
        if (p.world_size() == world_size) out.push_back(p);
    }
    return out;
}

}  // namespace kvshard::conformance
