// Direct reads through a window (rma_read.h) over the threads Communicator: every destination
// pool byte-identical to the message path's, checksums computed from the landed bytes equal to the
// source's, and corrupt or unreadable sources fail or fall back cleanly.
#include <gtest/gtest.h>

#include <mutex>

#include "kvshard/comm/threads.h"
#include "kvshard/transfer/rma_read.h"
#include "kvshard/transfer/transfer_exec.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

using testing::llama_mini;

struct Case {
    ModelSpec model;
    std::string from, to;
    int64_t tokens = 64;
    int bs_from = 16, bs_to = 16;
    PageOrder order_from = PageOrder::kHnd, order_to = PageOrder::kHnd;
};

std::shared_ptr<TransferPlan> plan_of(const Case& c, uint64_t shuffle) {
    auto src =
        testing::make_endpoint(c.model, c.from, c.bs_from, c.order_from, c.tokens, 0, shuffle);
    auto dst = testing::make_endpoint(c.model, c.to, c.bs_to, c.order_to, c.tokens, 0,
                                      shuffle ? shuffle + 1 : 0);
    return std::make_shared<TransferPlan>(make_transfer_plan(src, dst, c.tokens));
}

struct Outcome {
    std::vector<TransferResult> src, dst;
};

// One request over P + D threads. rma: a window over the source pools on both sides (else
// messages); seal: the senders announce unit checksums from seals.
Outcome run_transfer(const std::shared_ptr<TransferPlan>& plan, testing::Side& src,
                     testing::Side& dst, TransferMode mode, bool rma, bool seal,
                     bool receivers_rma = true,
                     int64_t pack_bytes = RmaPoolWindow::kDefaultPackBytes) {
    const int P = plan->src.layout.world_size(), D = plan->dst.layout.world_size();
    std::vector<std::unique_ptr<SourceChecksums>> sums;
    if (seal) sums = testing::seal_source(src, plan->num_tokens);
    Outcome out;
    out.src.resize(static_cast<size_t>(P));
    out.dst.resize(static_cast<size_t>(D));
    std::mutex mu;
    run_threads(P + D, [&](Communicator& world) {
        const int me = world.rank();
        const bool source = me < P;
        const int local = source ? me : me - P;
        TransferExecOptions o;
        o.mode = mode;
        o.dst_world_base = P;
        o.direct_read = rma;
        std::shared_ptr<RmaPoolWindow> window;
        if (rma) {
            window = std::make_shared<RmaPoolWindow>(
                world, source ? src.pools[local].get() : nullptr, pack_bytes);
            if (source || receivers_rma) o.rma_window = window;
        }
        TransferResult r;
        if (source) {
            if (seal && sums[static_cast<size_t>(local)])
                o.source_checksums = std::shared_ptr<const SourceChecksums>(
                    sums[static_cast<size_t>(local)].get(), [](const SourceChecksums*) {});
            TransferSender s(world, plan, 7, local, *src.pools[local], o);
            s.all_layers_ready();
            r = s.finish();
        } else {
            TransferReceiver t(world, plan, 7, local, *dst.pools[local], o);
            r = t.finish();
        }
        world.barrier();  // no window is freed while a peer may still read it
        std::lock_guard lk(mu);
        (source ? out.src : out.dst)[static_cast<size_t>(local)] = r;
    });
    return out;
}

int direct_read(const Outcome& r) {
    int n = 0;
    for (const auto& d : r.dst) n += d.direct_messages;
    return n;
}
int packed_read(const Outcome& r) {
    int n = 0;
    for (const auto& d : r.dst) n += d.packed_messages;
    return n;
}
int packed_sent(const Outcome& r) {
    int n = 0;
    for (const auto& s : r.src) n += s.packed_messages;
    return n;
}
int unit_read(const Outcome& r) {
    int n = 0;
    for (const auto& d : r.dst) n += d.unit_checksum_messages;
    return n;
}

void expect_ok(const Outcome& r) {
    for (const auto& s : r.src) EXPECT_TRUE(s.ok()) << s.error;
    for (const auto& d : r.dst) EXPECT_TRUE(d.ok()) << d.error;
}

bool same_pools(const testing::Side& a, const testing::Side& b) {
    for (size_t i = 0; i < a.pools.size(); ++i) {
        if (!a.pools[i]) continue;
        const auto x = a.pools[i]->arena(), y = b.pools[i]->arena();
        if (x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size()) != 0) return false;
    }
    return true;
}

class RmaRead : public ::testing::TestWithParam<std::tuple<int, TransferMode, bool>> {};

const std::vector<Case>& cases() {
    static const std::vector<Case> c = {
        {llama_mini(), "tp=2", "tp=1", 64},
        {llama_mini(), "tp=1", "tp=1", 64, 16, 64},  // different block sizes
        {llama_mini(), "tp=2", "tp=4", 77, 16, 8},
        {llama_mini(5), "tp=2,pp=2", "tp=4,pp=3", 70, 16, 64},
        {llama_mini(), "tp=2", "tp=1", 50, 16, 16, PageOrder::kHnd, PageOrder::kNhd},
        {llama_mini(), "tp=4", "tp=2", 50, 8, 16, PageOrder::kNhd, PageOrder::kHnd},
        {catalog_model("tiny-mla"), "tp=2", "tp=1", 40},
        {llama_mini(), "cp=2,tp=2,cp_scheme=zigzag", "tp=1", 90},
    };
    return c;
}

// Byte-identical to the message path (destination pools compared whole, sentinels included), and
// exact against what the layouts say.
TEST_P(RmaRead, ByteIdenticalToMessages) {
    const auto [index, mode, seal] = GetParam();
    const Case& c = cases()[static_cast<size_t>(index)];
    SCOPED_TRACE(c.model.name + " " + c.from + " -> " + c.to);
    auto plan = plan_of(c, 31);
    testing::Side src = testing::make_source(plan->src, c.tokens);
    testing::Side via_rma = testing::make_destination(plan->dst);
    testing::Side via_messages = testing::make_destination(plan->dst);
    const Outcome r = run_transfer(plan, src, via_rma, mode, true, seal);
    expect_ok(r);
    const Outcome m = run_transfer(plan, src, via_messages, mode, false, false);
    expect_ok(m);
    const int n = static_cast<int>(plan->messages.size());
    EXPECT_EQ(direct_read(r), n);  // every message read through the window
    EXPECT_EQ(direct_read(m), 0);
    EXPECT_TRUE(same_pools(via_rma, via_messages));
    for (int d = 0; d < plan->dst.layout.world_size(); ++d) {
        const auto want = testing::expected_pool(plan->dst, d, c.tokens, *via_rma.pools[d]);
        const auto* got = reinterpret_cast<const uint32_t*>(via_rma.pools[d]->arena().data());
        EXPECT_TRUE(std::equal(want.begin(), want.end(), got)) << "destination rank " << d;
    }
    if (!seal) {
        EXPECT_EQ(unit_read(r), 0);
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, RmaRead,
                         ::testing::Combine(::testing::Range(0, 8),
                                            ::testing::Values(TransferMode::kPreSend,
                                                              TransferMode::kPostReceive),
                                            ::testing::Bool()));

// Sequential block tables: a TP reshape's message is one run of the source pool in post-receive
// order, read staged (one get per chunk of it, then scattered); sealed, every read is checked by
// unit checksums, unsealed in post-receive mode by the payload's checksum. Byte-identical either
// way.
TEST(RmaReadChecks, StagedReadsOfOneSourceRun) {
    for (const Case& c :
         {Case{llama_mini(), "tp=2", "tp=1", 64}, Case{llama_mini(), "tp=4", "tp=2", 48},
          Case{llama_mini(), "tp=2", "tp=1", 64, 16, 64}})
        for (bool seal : {true, false}) {
            SCOPED_TRACE(c.from + " -> " + c.to + (seal ? " sealed" : ""));
            auto plan = plan_of(c, 0);
            for (const TransferMessage& msg : plan->messages)
                EXPECT_GE(
                    contiguous_payload_offset(
                        *plan, msg, TransferMode::kPostReceive, true,
                        rank_page_geometry(plan->src.layout, msg.src_rank, c.bs_from, c.order_from),
                        testing::pool_blocks(plan->src)),
                    0);
            testing::Side src = testing::make_source(plan->src, c.tokens);
            testing::Side a = testing::make_destination(plan->dst);
            testing::Side b = testing::make_destination(plan->dst);
            const Outcome r = run_transfer(plan, src, a, TransferMode::kPostReceive, true, seal);
            expect_ok(r);
            EXPECT_EQ(direct_read(r), static_cast<int>(plan->messages.size()));
            EXPECT_EQ(unit_read(r), seal ? static_cast<int>(plan->messages.size()) : 0);
            expect_ok(run_transfer(plan, src, b, TransferMode::kPostReceive, false, false));
            EXPECT_TRUE(same_pools(a, b));
        }
}

// Where each destination reads a part of every source page (TP1 -> TP2: many small runs, none
// of them one run of the source pool), the source packs each message into its pack area and the
// destination reads it there: byte-identical to messages, sealed or not, in both modes; with a
// pack area that holds only a few messages the source waits for credits before it reuses it;
// with none, or one too small for a message, the runs are read one by one.
TEST(RmaReadChecks, PackedReadsOfManySmallRuns) {
    for (const Case& c :
         {Case{llama_mini(), "tp=1", "tp=2", 64}, Case{llama_mini(), "tp=2", "tp=4", 80}})
        for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive})
            for (bool seal : {true, false}) {
                auto plan = plan_of(c, 0);
                const int n = static_cast<int>(plan->messages.size());
                int64_t largest = 0;
                for (const TransferMessage& m : plan->messages)
                    largest = std::max(largest, m.bytes);
                testing::Side src = testing::make_source(plan->src, c.tokens);
                testing::Side b = testing::make_destination(plan->dst);
                expect_ok(run_transfer(plan, src, b, mode, false, false));
                // Every message of a pair in its part, a part holding three messages (reused),
                // none, one smaller than a message.
                const int dsts_per_src =
                    plan->dst.layout.world_size() /
                    std::min(plan->dst.layout.world_size(), plan->src.layout.world_size());
                for (int64_t pack : {RmaPoolWindow::kDefaultPackBytes,
                                     dsts_per_src * (3 * largest + 192), int64_t{0}, largest / 2}) {
                    SCOPED_TRACE(c.from + " -> " + c.to + " " +
                                 std::string(transfer_mode_name(mode)) + (seal ? " sealed" : "") +
                                 " pack area " + std::to_string(pack));
                    const bool fits = pack >= dsts_per_src * largest;
                    testing::Side a = testing::make_destination(plan->dst);
                    const Outcome r = run_transfer(plan, src, a, mode, true, seal, true, pack);
                    expect_ok(r);
                    EXPECT_EQ(direct_read(r), n);
                    EXPECT_EQ(packed_read(r), fits ? n : 0);
                    EXPECT_EQ(packed_sent(r), fits ? n : 0);
                    EXPECT_EQ(unit_read(r), seal ? n : 0);
                    EXPECT_TRUE(same_pools(a, b));
                }
            }
}

// Two requests at once from the same sources (as a server runs them): the pack area is one
// request's at a time, so the first packs and the second, offered none, reads run by run; both
// byte-identical to messages.
TEST(RmaReadChecks, ConcurrentRequestsShareThePackAreaOneAtATime) {
    const Case c{llama_mini(), "tp=1", "tp=2", 64};
    auto plan = plan_of(c, 0);
    const int n = static_cast<int>(plan->messages.size());
    testing::Side src = testing::make_source(plan->src, c.tokens);
    auto sums = testing::seal_source(src, plan->num_tokens);
    testing::Side want = testing::make_destination(plan->dst);
    expect_ok(run_transfer(plan, src, want, TransferMode::kPreSend, false, false));
    testing::Side a = testing::make_destination(plan->dst);
    testing::Side b = testing::make_destination(plan->dst);
    const int P = plan->src.layout.world_size(), D = plan->dst.layout.world_size();
    std::vector<TransferResult> first(static_cast<size_t>(P + D)), second(first.size());
    std::mutex mu;
    run_threads(P + D, [&](Communicator& world) {
        const int me = world.rank();
        const bool source = me < P;
        const int local = source ? me : me - P;
        TransferExecOptions o;
        o.mode = TransferMode::kPreSend;
        o.dst_world_base = P;
        o.rma_window =
            std::make_shared<RmaPoolWindow>(world, source ? src.pools[local].get() : nullptr);
        TransferResult r1, r2;
        if (source) {
            o.source_checksums = std::shared_ptr<const SourceChecksums>(
                sums[static_cast<size_t>(local)].get(), [](const SourceChecksums*) {});
            TransferSender s1(world, plan, 7, local, *src.pools[local], o);
            TransferSender s2(world, plan, 8, local, *src.pools[local], o);
            s1.all_layers_ready();
            s2.all_layers_ready();
            TransferSender* both[] = {&s1, &s2};
            progress_until_done(both, {});
            r1 = s1.finish();
            r2 = s2.finish();
        } else {
            TransferReceiver t1(world, plan, 7, local, *a.pools[local], o);
            TransferReceiver t2(world, plan, 8, local, *b.pools[local], o);
            TransferReceiver* both[] = {&t1, &t2};
            progress_until_done({}, both);
            r1 = t1.finish();
            r2 = t2.finish();
        }
        world.barrier();
        std::lock_guard lk(mu);
        first[static_cast<size_t>(me)] = r1;
        second[static_cast<size_t>(me)] = r2;
    });
    int packed1 = 0, packed2 = 0;
    for (int me = P; me < P + D; ++me) {
        EXPECT_TRUE(first[static_cast<size_t>(me)].ok()) << first[static_cast<size_t>(me)].error;
        EXPECT_TRUE(second[static_cast<size_t>(me)].ok()) << second[static_cast<size_t>(me)].error;
        packed1 += first[static_cast<size_t>(me)].packed_messages;
        packed2 += second[static_cast<size_t>(me)].packed_messages;
    }
    EXPECT_EQ(packed1, n);
    EXPECT_EQ(packed2, 0);
    EXPECT_TRUE(same_pools(a, want));
    EXPECT_TRUE(same_pools(b, want));
}

// A corrupted pack area fails the request by its checksum (sealed: the bytes landed are checked
// against the seals, not against what was packed).
TEST(RmaReadChecks, PackedReadOfChangedBytesFailsItsChecksum) {
    const Case c{llama_mini(), "tp=1", "tp=2", 64};
    auto plan = plan_of(c, 0);
    testing::Side src = testing::make_source(plan->src, c.tokens);
    auto sums = testing::seal_source(src, plan->num_tokens);
    // Change a source byte after sealing: the packed copy carries it, the seals do not.
    src.pools[0]->arena()[0] ^= std::byte{1};
    testing::Side a = testing::make_destination(plan->dst);
    const int P = plan->src.layout.world_size(), D = plan->dst.layout.world_size();
    std::vector<TransferResult> dst(static_cast<size_t>(D));
    std::mutex mu;
    run_threads(P + D, [&](Communicator& world) {
        const int me = world.rank();
        const bool source = me < P;
        const int local = source ? me : me - P;
        TransferExecOptions o;
        o.mode = TransferMode::kPreSend;
        o.dst_world_base = P;
        auto window =
            std::make_shared<RmaPoolWindow>(world, source ? src.pools[local].get() : nullptr);
        o.rma_window = window;
        if (source) {
            o.source_checksums = std::shared_ptr<const SourceChecksums>(
                sums[static_cast<size_t>(local)].get(), [](const SourceChecksums*) {});
            TransferSender s(world, plan, 7, local, *src.pools[local], o);
            s.all_layers_ready();
            s.finish();
        } else {
            TransferReceiver t(world, plan, 7, local, *a.pools[local], o);
            const TransferResult r = t.finish();
            std::lock_guard lk(mu);
            dst[static_cast<size_t>(local)] = r;
        }
        world.barrier();
    });
    int mismatches = 0;
    for (const auto& r : dst) mismatches += r.status == TransferStatus::kChecksumMismatch;
    EXPECT_EQ(mismatches, 1);  // the destination that reads byte 0 of the source pool
}

// The checksums from the landed bytes equal the source's, for both modes and page orders.
TEST(RmaReadChecks, LandedChecksumsEqualTheSources) {
    for (const Case& c : cases()) {
        SCOPED_TRACE(c.from + " -> " + c.to);
        auto plan = plan_of(c, 5);
        testing::Side src = testing::make_source(plan->src, c.tokens);
        testing::Side dst = testing::make_destination(plan->dst);
        const Outcome r = run_transfer(plan, src, dst, TransferMode::kPreSend, false, false);
        expect_ok(r);
        const auto sums = testing::seal_source(src, c.tokens);
        for (const TransferMessage& msg : plan->messages) {
            const BlockPool& sp = *src.pools[msg.src_rank];
            const BlockPool& dp = *dst.pools[msg.dst_rank];
            for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive})
                EXPECT_EQ(landed_payload_hash(*plan, msg, mode, dp),
                          hash_payload(*plan, msg, mode, sp));
            if (sums[msg.src_rank]) {
                const auto units = unit_checksum(*plan, msg, *sums[msg.src_rank]);
                if (units) {
                    EXPECT_EQ(landed_unit_checksum(*plan, msg, dp), *units);
                }
            }
        }
    }
}

// A source byte changed after the source computed its checksum: the read lands the new byte and
// its checksum differs from the announced one (the executor then fails the request).
TEST(RmaReadChecks, ChangedSourceByteChangesTheChecksum) {
    const Case c{llama_mini(), "tp=2", "tp=1", 64};
    auto plan = plan_of(c, 0);
    testing::Side src = testing::make_source(plan->src, c.tokens);
    testing::Side dst = testing::make_destination(plan->dst);
    const int idx = static_cast<int>(plan->messages.size()) - 1;
    const TransferMessage& msg = plan->messages[static_cast<size_t>(idx)];
    BlockPool& sp = *src.pools[msg.src_rank];
    const uint64_t before = hash_payload(*plan, msg, TransferMode::kPreSend, sp);
    sp.page(0, 1, msg.pieces.front().src_block)[0] ^= std::byte{1};
    run_threads(3, [&](Communicator& world) {
        RmaPoolWindow w(world, world.rank() < 2 ? src.pools[world.rank()].get() : nullptr);
        if (world.rank() == 2) {
            const uint64_t got =
                rma_read_message(w.window(), msg.src_rank, sp.num_blocks(), *plan, idx,
                                 TransferMode::kPreSend, false, *dst.pools[0]);
            EXPECT_NE(got, before);
            EXPECT_EQ(got, hash_payload(*plan, msg, TransferMode::kPreSend, sp));
        }
        world.barrier();
    });
}

// Where a window cannot serve a message, the destination declines and the messages go as
// two-sided messages (byte-identical), and rma_readable says why.
TEST(RmaReadChecks, DeclinedWindowFallsBackToMessages) {
    const Case c{llama_mini(), "tp=2", "tp=1", 64};
    auto plan = plan_of(c, 0);
    testing::Side src = testing::make_source(plan->src, c.tokens);
    testing::Side a = testing::make_destination(plan->dst);
    testing::Side b = testing::make_destination(plan->dst);
    // The destination has no window: the sources' offer goes unanswered by a window, messages.
    const Outcome r = run_transfer(plan, src, a, TransferMode::kPreSend, true, false, false);
    expect_ok(r);
    EXPECT_EQ(direct_read(r), 0);
    expect_ok(run_transfer(plan, src, b, TransferMode::kPreSend, false, false));
    EXPECT_TRUE(same_pools(a, b));

    const TransferMessage& msg = plan->messages.front();
    EXPECT_EQ(rma_readable(*plan, msg, src.pools[0]->num_blocks(),
                           static_cast<int64_t>(src.pools[0]->arena().size())),
              "");
    EXPECT_NE(rma_readable(*plan, msg, src.pools[0]->num_blocks(), 100).find("exposes 100 bytes"),
              std::string::npos);
    ModelSpec fp8 = llama_mini();
    fp8.kv_dtype = DType::kFp8;
    auto fp8_plan = plan_of({fp8, "tp=2", "tp=1", 64}, 0);
    EXPECT_NE(rma_readable(*fp8_plan, fp8_plan->messages.front(), 8, int64_t{1} << 30).find("fp8"),
              std::string::npos);
}

// Windows on threads: reads of any range of a peer's region, refused outside it.
TEST(RmaReadChecks, ThreadWindowReadsPeerRegions) {
    run_threads(3, [&](Communicator& world) {
        std::vector<std::byte> mine(static_cast<size_t>(100 + world.rank()));
        for (size_t i = 0; i < mine.size(); ++i)
            mine[i] = static_cast<std::byte>(i * 7 + static_cast<size_t>(world.rank()));
        auto w = world.create_window(mine);
        for (int p = 0; p < world.size(); ++p) {
            EXPECT_EQ(w->region_bytes(p), 100 + p);
            std::vector<std::byte> got(10);
            w->get(got, p, 90).wait();
            for (size_t i = 0; i < got.size(); ++i)
                EXPECT_EQ(got[i], static_cast<std::byte>((90 + i) * 7 + static_cast<size_t>(p)));
            EXPECT_THROW(w->get(got, p, 95 + p), Error);
        }
        world.barrier();
    });
}

}  // namespace
}  // namespace kvshard
