// Executing transfer plans over the threads Communicator: layer-wise streaming, back-pressure,
// checksums and failures that stay within their request.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <optional>

#include "kvshard/comm/threads.h"
#include "kvshard/transfer/transfer_exec.h"
#include "transfer/fault_injection.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

using testing::llama_mini;

struct Pair {
    ModelSpec model;
    std::string from, to;
    int64_t tokens = 64;
    int bs_from = 16, bs_to = 16;
    PageOrder order_from = PageOrder::kHnd, order_to = PageOrder::kHnd;
};

std::shared_ptr<TransferPlan> make_plan(const Pair& p, int layers_per_group, uint64_t shuffle = 0) {
    auto src =
        testing::make_endpoint(p.model, p.from, p.bs_from, p.order_from, p.tokens, 0, shuffle);
    auto dst = testing::make_endpoint(p.model, p.to, p.bs_to, p.order_to, p.tokens, 0,
                                      shuffle ? shuffle + 1 : 0);
    return std::make_shared<TransferPlan>(
        make_transfer_plan(src, dst, p.tokens, {.layers_per_group = layers_per_group}));
}

int64_t wrong_elements(const TransferPlan& plan, const testing::Side& dst, int64_t tokens) {
    int64_t wrong = 0;
    for (int r = 0; r < plan.dst.layout.world_size(); ++r) {
        if (!dst.pools[r]) continue;
        const auto want = testing::expected_pool(plan.dst, r, tokens, *dst.pools[r]);
        const auto* got = reinterpret_cast<const uint32_t*>(dst.pools[r]->arena().data());
        for (size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
    }
    return wrong;
}

// One request: P source threads and D destination threads in one world. Sources mark layers ready
// one by one (as prefill would) and progress between layers.
struct Outcome {
    std::vector<TransferResult> src, dst;
};

struct XferRequest {
    std::shared_ptr<TransferPlan> plan;
    uint64_t id = 1;
    TransferExecOptions opt;
    testing::Side src, dst;
    testing::TransferFaults faults;             // made by the senders' communicator
    int fail_source = -1;                       // this source calls fail() after its first layer
    bool receivers_refuse_direct = false;       // the destinations run with direct_read = false
    std::vector<int> refusing_destinations;     // ... or only these destination ranks
    std::optional<TransferMode> receiver_mode;  // the destinations' mode, if not opt.mode
    bool seal = false;  // the sources' pools are sealed (source_checksums.h) before the run
    // Per source rank, the seals its sender uses (filled by run_requests when `seal` and empty).
    std::vector<std::shared_ptr<const SourceChecksums>> sums;
    Outcome out;
};

void run_requests(std::vector<XferRequest*> reqs) {
    const int P = reqs[0]->plan->src.layout.world_size();
    const int D = reqs[0]->plan->dst.layout.world_size();
    for (auto* r : reqs) {
        r->opt.src_world_base = 0;
        r->opt.dst_world_base = P;
        r->out.src.assign(P, {});
        r->out.dst.assign(D, {});
    }
    for (auto* r : reqs)
        if (r->seal && r->sums.empty())
            for (auto& u : testing::seal_source(r->src, r->plan->num_tokens))
                r->sums.push_back(std::move(u));
    std::mutex mu;
    run_threads(P + D, [&](Communicator& world) {
        const int me = world.rank();
        if (me < P) {
            testing::FaultyCommunicator faulty(world);
            for (auto* r : reqs)
                if (r->faults.any()) faulty.add(r->id, r->faults);
            std::vector<std::unique_ptr<TransferSender>> senders;
            for (auto* r : reqs) {
                TransferExecOptions o = r->opt;
                if (!r->sums.empty()) o.source_checksums = r->sums[me];
                senders.push_back(std::make_unique<TransferSender>(faulty, r->plan, r->id, me,
                                                                   *r->src.pools[me], o));
            }
            const RankKv& rk = reqs[0]->plan->src.layout.ranks[me];
            for (int l = rk.layer_begin; l < rk.layer_end; ++l) {
                for (size_t k = 0; k < reqs.size(); ++k) {
                    if (reqs[k]->fail_source == me && l == rk.layer_begin + 1)
                        senders[k]->fail("prefill failed");
                    senders[k]->layer_ready(l);
                    senders[k]->progress();
                }
            }
            for (auto& s : senders) s->all_layers_ready();
            bool all = false;
            while (!all) {
                all = true;
                for (auto& s : senders) all &= s->progress();
                if (!all) std::this_thread::yield();
            }
            std::lock_guard lk(mu);
            for (size_t k = 0; k < reqs.size(); ++k) reqs[k]->out.src[me] = senders[k]->finish();
        } else {
            const int d = me - P;
            testing::FaultyCommunicator faulty(world);
            for (auto* r : reqs)
                if (r->faults.any()) faulty.add(r->id, r->faults);
            std::vector<std::unique_ptr<TransferReceiver>> receivers;
            for (auto* r : reqs) {
                TransferExecOptions o = r->opt;
                if (r->receivers_refuse_direct || std::count(r->refusing_destinations.begin(),
                                                             r->refusing_destinations.end(), d) > 0)
                    o.direct_read = false;
                if (r->receiver_mode) o.mode = *r->receiver_mode;
                receivers.push_back(std::make_unique<TransferReceiver>(faulty, r->plan, r->id, d,
                                                                       *r->dst.pools[d], o));
            }
            bool all = false;
            while (!all) {
                all = true;
                for (auto& r : receivers) all &= r->progress();
                if (!all) std::this_thread::yield();
            }
            std::lock_guard lk(mu);
            for (size_t k = 0; k < reqs.size(); ++k) reqs[k]->out.dst[d] = receivers[k]->finish();
        }
    });
}

// memory: kShareable sources let the destinations read their pools in place (direct read).
XferRequest make_request(const Pair& p, int layers_per_group, uint64_t id,
                         TransferMode mode = TransferMode::kAuto,
                         PoolMemory memory = PoolMemory::kPrivate) {
    XferRequest r;
    r.plan = make_plan(p, layers_per_group, id * 11);
    r.id = id;
    r.opt.mode = mode;
    r.src = testing::make_source(r.plan->src, p.tokens, memory);
    r.dst = testing::make_destination(r.plan->dst);
    return r;
}

void expect_all_ok(const XferRequest& r, int64_t tokens) {
    int64_t sent = 0, received = 0;
    for (const auto& s : r.out.src) {
        EXPECT_TRUE(s.ok()) << s.error;
        sent += s.bytes;
    }
    for (const auto& d : r.out.dst) {
        EXPECT_TRUE(d.ok()) << d.error;
        received += d.bytes;
    }
    EXPECT_EQ(sent, r.plan->min_bytes);
    EXPECT_EQ(received, r.plan->min_bytes);
    EXPECT_EQ(wrong_elements(*r.plan, r.dst, tokens), 0);
}

TEST(TransferExec, StreamsLayerByLayerOverThreads) {
    const std::vector<Pair> pairs = {
        {llama_mini(), "tp=8", "tp=4", 100},
        {llama_mini(5), "tp=2,pp=2", "tp=4,pp=3", 70, 16, 64},
        {llama_mini(), "tp=16", "tp=2", 50, 8, 16, PageOrder::kNhd, PageOrder::kHnd},
        {catalog_model("tiny-mla"), "tp=8", "tp=2", 40},
        {testing::sparse_mla_mini(), "tp=4,cp=2", "tp=2", 45},  // latent + indexer keys
        {llama_mini(), "cp=4,tp=2,cp_scheme=zigzag", "tp=2", 90},
        {catalog_model("tiny"), "tp=4,cp=2,cp_scheme=interleave,cp_interleave=16", "tp=2,pp=2", 61,
         16, 32},
    };
    for (const auto& p : pairs) {
        for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive}) {
            SCOPED_TRACE(p.model.name + " " + p.from + " -> " + p.to + " " +
                         std::string(transfer_mode_name(mode)));
            XferRequest r = make_request(p, 1, 7, mode);
            run_requests({&r});
            expect_all_ok(r, p.tokens);
        }
    }
}

TEST(TransferExec, BoundedStagingWithBackPressure) {
    Pair p{llama_mini(), "tp=2", "tp=4", 200};
    XferRequest r = make_request(p, 1, 3);
    int64_t largest = 0;
    for (const auto& m : r.plan->messages) largest = std::max(largest, m.bytes);
    r.opt.staging_bytes = largest;  // one message in flight per sender and per receiver
    run_requests({&r});
    expect_all_ok(r, p.tokens);
    for (const auto& s : r.out.src) EXPECT_LE(s.peak_staging, largest);
    for (const auto& d : r.out.dst) EXPECT_LE(d.peak_staging, largest);
}

// Runs `bad` (its message `corrupt` corrupted after checksumming) beside `good`: the corrupt
// message's destination fails the request with a checksum mismatch, its source learns it from the
// ack, and `good` lands intact.
void expect_only_corrupt_request_fails(XferRequest& bad, XferRequest& good, int corrupt,
                                       int64_t tokens) {
    bad.faults.corrupt_message = corrupt;
    const TransferMessage& m = bad.plan->messages[corrupt];
    run_requests({&bad, &good});
    EXPECT_EQ(bad.out.dst[m.dst_rank].status, TransferStatus::kChecksumMismatch)
        << bad.out.dst[m.dst_rank].error;
    EXPECT_EQ(bad.out.src[m.src_rank].status, TransferStatus::kPeerFailed)
        << bad.out.src[m.src_rank].error;
    expect_all_ok(good, tokens);
}

TEST(TransferExec, ChecksumMismatchFailsOnlyThatRequest) {
    Pair p{llama_mini(), "tp=8", "tp=4", 48};
    XferRequest bad = make_request(p, 1, 21);
    XferRequest good = make_request(p, 1, 22);
    expect_only_corrupt_request_fails(bad, good, 5, p.tokens);
}

// In messages (private pools) and in direct reads (shareable ones).
TEST(TransferExec, SourceFailureAbortsThatRequest) {
    for (PoolMemory memory : {PoolMemory::kPrivate, PoolMemory::kShareable}) {
        Pair p{llama_mini(), "tp=4,pp=2", "tp=2", 32};
        XferRequest bad = make_request(p, 1, 31, TransferMode::kAuto, memory);
        XferRequest good = make_request(p, 0, 32, TransferMode::kAuto, memory);
        bad.fail_source = 1;
        run_requests({&bad, &good});
        EXPECT_EQ(bad.out.src[1].status, TransferStatus::kSourceAborted);
        int aborted = 0;
        for (int d : {0, 1}) aborted += bad.out.dst[d].status == TransferStatus::kSourceAborted;
        EXPECT_GE(aborted, 1);
        // Every destination that got messages from rank 1 failed the request.
        for (const auto& msg : bad.plan->messages)
            if (msg.src_rank == 1) {
                EXPECT_FALSE(bad.out.dst[msg.dst_rank].ok());
            }
        expect_all_ok(good, p.tokens);
    }
}

// A communicator call that throws inside progress() fails that request, on either side, and no
// other: the sender's remaining messages go as aborted headers, the receiver acks its failure.
TEST(TransferExec, FailedSendOrReceiveFailsOnlyThatRequest) {
    Pair p{llama_mini(), "tp=4", "tp=2", 48};
    {
        XferRequest bad = make_request(p, 1, 81);
        XferRequest good = make_request(p, 1, 82);
        bad.opt.timeout_s = 0.5;
        bad.faults.payload_send_throws = true;
        run_requests({&bad, &good});
        for (const auto& s : bad.out.src) {
            EXPECT_EQ(s.status, TransferStatus::kSourceAborted) << s.error;
            EXPECT_NE(s.error.find("the payload send failed"), std::string::npos) << s.error;
        }
        for (const auto& d : bad.out.dst) EXPECT_FALSE(d.ok());
        expect_all_ok(good, p.tokens);
    }
    {
        XferRequest bad = make_request(p, 1, 83);
        XferRequest good = make_request(p, 1, 84);
        bad.opt.timeout_s = 0.5;
        bad.faults.payload_recv_throws = true;
        run_requests({&bad, &good});
        for (const auto& d : bad.out.dst) {
            EXPECT_EQ(d.status, TransferStatus::kLocalError) << d.error;
            EXPECT_NE(d.error.find("the payload receive failed"), std::string::npos) << d.error;
        }
        for (const auto& s : bad.out.src) EXPECT_FALSE(s.ok());
        expect_all_ok(good, p.tokens);
    }
}

TEST(TransferExec, HungSourceTimesOut) {
    Pair p{llama_mini(), "tp=4", "tp=2", 32};
    XferRequest bad = make_request(p, 1, 41);
    XferRequest good = make_request(p, 1, 42);
    bad.opt.timeout_s = 0.3;
    bad.faults.stall_after = 0;  // every source sends nothing
    run_requests({&bad, &good});
    for (const auto& d : bad.out.dst) EXPECT_EQ(d.status, TransferStatus::kTimeout) << d.error;
    for (const auto& s : bad.out.src) EXPECT_FALSE(s.ok());
    expect_all_ok(good, p.tokens);
}

// Payloads received straight into the pool are checked on the receiver's worker thread (every
// size here), and senders sleep between polls once everything is posted.
XferRequest zero_copy_request(const Pair& p, uint64_t id, TransferMode mode = TransferMode::kAuto) {
    XferRequest r;
    r.plan = make_plan(p, 1);  // blocks in order: each layer's run of a rank is contiguous
    r.id = id;
    r.opt.mode = mode;
    r.opt.offload_check_bytes = 0;
    r.opt.sender_idle_sleep_us = 50;
    r.src = testing::make_source(r.plan->src, p.tokens);
    r.dst = testing::make_destination(r.plan->dst);
    return r;
}

int zero_copy_received(const XferRequest& r) {
    int n = 0;
    for (const auto& d : r.out.dst) n += d.zero_copy_messages;
    return n;
}

TEST(TransferExec, ZeroCopyPayloadsCheckedOnWorkerThread) {
    const std::vector<Pair> pairs = {
        {llama_mini(), "tp=2", "tp=2", 96},
        {llama_mini(6), "tp=2,pp=2", "tp=2,pp=2", 64},
        {llama_mini(), "tp=1", "tp=1", 64, 16, 16, PageOrder::kNhd, PageOrder::kNhd},
    };
    for (const auto& p : pairs)
        for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive}) {
            SCOPED_TRACE(p.from + " -> " + p.to + " " + std::string(transfer_mode_name(mode)));
            XferRequest r = zero_copy_request(p, 61, mode);
            run_requests({&r});
            expect_all_ok(r, p.tokens);
            EXPECT_EQ(zero_copy_received(r), static_cast<int>(r.plan->messages.size()));
        }
}

TEST(TransferExec, WorkerThreadCheckFailsOnlyThatRequest) {
    Pair p{llama_mini(), "tp=2", "tp=2", 64};
    XferRequest bad = zero_copy_request(p, 62);
    XferRequest good = zero_copy_request(p, 63);
    expect_only_corrupt_request_fails(bad, good, 3, p.tokens);
    EXPECT_GT(zero_copy_received(good), 0);
}

TEST(TransferExec, TimeoutWaitsForWorkerChecks) {
    Pair p{llama_mini(), "tp=2", "tp=2", 64};
    XferRequest bad = zero_copy_request(p, 64);
    bad.opt.timeout_s = 0.3;
    bad.faults.stall_after = 2;  // each source sends two messages, then hangs
    run_requests({&bad});
    for (const auto& d : bad.out.dst) {
        EXPECT_EQ(d.status, TransferStatus::kTimeout) << d.error;
        EXPECT_EQ(d.zero_copy_messages, 2);  // landed and checked before the timeout
    }
    for (const auto& s : bad.out.src) EXPECT_FALSE(s.ok());
}

TEST(TransferExec, HeaderRoundTrip) {
    Pair p{llama_mini(), "tp=8", "tp=4", 16};
    auto plan = make_plan(p, 0);
    TransferHeader h;
    h.request_id = 9;
    h.src_rank = plan->messages[2].src_rank;
    h.dst_rank = plan->messages[2].dst_rank;
    h.message_index = 2;
    h.payload_bytes = plan->messages[2].bytes;
    seal_header(h);
    EXPECT_EQ(check_header(h, *plan, 9, 2), "");
    EXPECT_NE(check_header(h, *plan, 10, 2), "");
    EXPECT_NE(check_header(h, *plan, 9, 3), "");
    h.payload_bytes += 1;
    EXPECT_EQ(check_header(h, *plan, 9, 2), "header checksum mismatch");
    seal_header(h);
    EXPECT_NE(check_header(h, *plan, 9, 2).find("payload bytes"), std::string::npos);
    h.payload_bytes -= 1;
    for (uint32_t flags :
         {TransferHeader::kDirect, TransferHeader::kDirect | TransferHeader::kUnitChecksum}) {
        h.flags = flags;
        seal_header(h);
        EXPECT_EQ(check_header(h, *plan, 9, 2), "") << flags;
    }
    for (uint32_t flags : {TransferHeader::kUnitChecksum, 4u, TransferHeader::kDirect | 8u}) {
        h.flags = flags;
        seal_header(h);
        EXPECT_NE(check_header(h, *plan, 9, 2).find("not a valid combination"), std::string::npos)
            << flags;
    }
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// The executor (batched pack, pending batched unpack, small staging) on random layout pairs.
TEST(TransferExec, RandomPairsOverThreads) {
    std::mt19937_64 rng(777);
    const std::vector<ModelSpec> models = {catalog_model("tiny"), catalog_model("tiny-mla"),
                                           testing::llama_mini(5)};
    const std::vector<std::string> layouts = {"tp=1",
                                              "tp=2",
                                              "tp=4",
                                              "tp=8",
                                              "pp=2,tp=2",
                                              "pp=3",
                                              "cp=2,tp=2",
                                              "cp=3,cp_scheme=zigzag",
                                              "cp=2,pp=2,cp_scheme=interleave,cp_interleave=4"};
    int ran = 0;
    for (int i = 0; i < 12; ++i) {
        const ModelSpec& m = models[rng() % models.size()];
        Pair p{m, layouts[rng() % layouts.size()], layouts[rng() % layouts.size()],
               1 + static_cast<int64_t>(rng() % 120)};
        const std::vector<int> sizes = {1, 4, 16};
        p.bs_from = sizes[rng() % sizes.size()];
        p.bs_to = sizes[rng() % sizes.size()];
        p.order_from = rng() % 2 ? PageOrder::kHnd : PageOrder::kNhd;
        p.order_to = rng() % 2 ? PageOrder::kHnd : PageOrder::kNhd;
        if (parse_parallel_config(p.from).pp > m.num_layers ||
            parse_parallel_config(p.to).pp > m.num_layers)
            continue;
        SCOPED_TRACE(m.name + " " + p.from + " -> " + p.to + " tokens " + std::to_string(p.tokens));
        XferRequest r =
            make_request(p, static_cast<int>(rng() % 3), 50 + i,
                         rng() % 2 ? TransferMode::kPreSend : TransferMode::kPostReceive);
        int64_t largest = 0;
        for (const auto& msg : r.plan->messages) largest = std::max(largest, msg.bytes);
        r.opt.staging_bytes = rng() % 2 ? largest : (int64_t{1} << 30);
        run_requests({&r});
        expect_all_ok(r, p.tokens);
        ++ran;
        if (::testing::Test::HasFailure()) break;
    }
    EXPECT_GE(ran, 8);
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// Same layout on both sides, blocks in order, pools exactly as large as the request: every
// per-layer message is one run of both pools, so it goes without any staging copy, and still lands
// exactly.
TEST(TransferExec, ZeroCopyWhenPayloadIsOneRun) {
    Pair p{testing::llama_mini(), "tp=2,pp=2", "tp=2,pp=2", 64};
    XferRequest r;
    r.plan = make_plan(p, 1, /*shuffle=*/0);
    r.id = 90;
    r.opt.mode = TransferMode::kPostReceive;
    r.src = testing::make_source(r.plan->src, p.tokens);
    r.dst = testing::make_destination(r.plan->dst);
    for (const auto& m : r.plan->messages) {
        EXPECT_GE(contiguous_payload_offset(*r.plan, m, TransferMode::kPostReceive, true,
                                            *r.src.pools[m.src_rank]),
                  0);
        EXPECT_GE(contiguous_payload_offset(*r.plan, m, TransferMode::kPostReceive, false,
                                            *r.dst.pools[m.dst_rank]),
                  0);
    }
    run_requests({&r});
    expect_all_ok(r, p.tokens);
    for (const auto& s : r.out.src) {
        EXPECT_EQ(s.zero_copy_messages, s.messages);
        EXPECT_EQ(s.peak_staging, 0);
    }
    for (const auto& d : r.out.dst) EXPECT_EQ(d.zero_copy_messages, d.messages);
    // A reshape (TP 2 -> 4) is not one run on the source: it is packed.
    Pair q{testing::llama_mini(), "tp=2", "tp=4", 64};
    XferRequest t;
    t.plan = make_plan(q, 1, 0);
    t.id = 91;
    t.opt.mode = TransferMode::kPostReceive;
    t.src = testing::make_source(t.plan->src, q.tokens);
    t.dst = testing::make_destination(t.plan->dst);
    run_requests({&t});
    expect_all_ok(t, q.tokens);
    for (const auto& s : t.out.src) EXPECT_EQ(s.zero_copy_messages, 0);
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// ---- direct read: the destination copies straight from the source pool ----------------------

int direct_sent(const XferRequest& r) {
    int n = 0;
    for (const auto& s : r.out.src) n += s.direct_messages;
    return n;
}
int direct_read(const XferRequest& r) {
    int n = 0;
    for (const auto& d : r.out.dst) n += d.direct_messages;
    return n;
}

XferRequest direct_request(const Pair& p, int layers_per_group, uint64_t id,
                           TransferMode mode = TransferMode::kAuto) {
    return make_request(p, layers_per_group, id, mode, PoolMemory::kShareable);
}

TEST(TransferExecDirect, EveryMessageReadInPlaceAndExact) {
    const std::vector<Pair> pairs = {
        {llama_mini(), "tp=8", "tp=4", 100},
        {llama_mini(), "tp=2", "tp=8", 77},
        {llama_mini(5), "tp=2,pp=2", "tp=4,pp=3", 70, 16, 64},
        {llama_mini(), "tp=16", "tp=2", 50, 8, 16, PageOrder::kNhd, PageOrder::kHnd},
        {catalog_model("tiny-mla"), "tp=8", "tp=2", 40},
        {llama_mini(), "cp=4,tp=2,cp_scheme=zigzag", "tp=2", 90},
        {llama_mini(), "tp=1", "tp=1", 64},
    };
    for (const auto& p : pairs)
        for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive}) {
            SCOPED_TRACE(p.model.name + " " + p.from + " -> " + p.to + " " +
                         std::string(transfer_mode_name(mode)));
            XferRequest r = direct_request(p, 1, 100, mode);
            run_requests({&r});
            expect_all_ok(r, p.tokens);
            const int n = static_cast<int>(r.plan->messages.size());
            EXPECT_EQ(direct_sent(r), n);
            EXPECT_EQ(direct_read(r), n);
            for (const auto& s : r.out.src) {
                EXPECT_EQ(s.peak_staging, 0);                         // no payloads
                EXPECT_LE(s.peak_direct_ahead, r.opt.direct_window);  // credits bound it
                EXPECT_GE(s.peak_direct_ahead, 1);
            }
            for (const auto& d : r.out.dst) EXPECT_EQ(d.peak_staging, 0);
        }
}

// Random layout pairs, block tables shuffled over the pools, any window of credits.
TEST(TransferExecDirect, RandomPairsAndWindows) {
    std::mt19937_64 rng(4242);
    const std::vector<ModelSpec> models = {catalog_model("tiny"), catalog_model("tiny-mla"),
                                           testing::llama_mini(5)};
    const std::vector<std::string> layouts = {
        "tp=1", "tp=2", "tp=4", "pp=2,tp=2", "pp=3", "cp=2,tp=2", "cp=3,cp_scheme=zigzag"};
    int ran = 0;
    for (int i = 0; i < 10; ++i) {
        const ModelSpec& m = models[rng() % models.size()];
        Pair p{m, layouts[rng() % layouts.size()], layouts[rng() % layouts.size()],
               1 + static_cast<int64_t>(rng() % 120)};
        p.bs_from = std::vector<int>{1, 4, 16}[rng() % 3];
        p.bs_to = std::vector<int>{1, 4, 16}[rng() % 3];
        p.order_from = rng() % 2 ? PageOrder::kHnd : PageOrder::kNhd;
        p.order_to = rng() % 2 ? PageOrder::kHnd : PageOrder::kNhd;
        if (parse_parallel_config(p.from).pp > m.num_layers ||
            parse_parallel_config(p.to).pp > m.num_layers)
            continue;
        XferRequest r =
            direct_request(p, static_cast<int>(rng() % 3), 120 + i,
                           rng() % 2 ? TransferMode::kPreSend : TransferMode::kPostReceive);
        r.opt.direct_window = static_cast<int>(rng() % 4);  // 0: unbounded
        SCOPED_TRACE(m.name + " " + p.from + " -> " + p.to + " tokens " + std::to_string(p.tokens) +
                     " window " + std::to_string(r.opt.direct_window));
        run_requests({&r});
        expect_all_ok(r, p.tokens);
        EXPECT_EQ(direct_read(r), static_cast<int>(r.plan->messages.size()));
        if (r.opt.direct_window > 0) {
            for (const auto& s : r.out.src) EXPECT_LE(s.peak_direct_ahead, r.opt.direct_window);
        }
        ++ran;
        if (::testing::Test::HasFailure()) break;
    }
    EXPECT_GE(ran, 7);
}

// Either side may say no: then the bytes travel in messages, as with a private pool.
TEST(TransferExecDirect, EitherSideCanDeclineIt) {
    Pair p{llama_mini(), "tp=4", "tp=2", 64};
    XferRequest off = direct_request(p, 1, 130);
    off.opt.direct_read = false;
    XferRequest refused = direct_request(p, 1, 131);
    refused.receivers_refuse_direct = true;
    XferRequest on = direct_request(p, 1, 132);
    run_requests({&off, &refused, &on});
    for (XferRequest* r : {&off, &refused, &on}) expect_all_ok(*r, p.tokens);
    EXPECT_EQ(direct_sent(off), 0);
    EXPECT_EQ(direct_sent(refused), 0);
    EXPECT_EQ(direct_read(refused), 0);
    EXPECT_EQ(direct_read(on), static_cast<int>(on.plan->messages.size()));
}

// One source, two destinations, one of which declines: the source is read in place by
// one and sends messages (packed) to the other, in the same request.
TEST(TransferExecDirect, MixedDestinationsOfOneSource) {
    Pair p{llama_mini(), "tp=1", "tp=2", 64};
    XferRequest r = direct_request(p, 1, 133);
    r.refusing_destinations = {0};
    run_requests({&r});
    expect_all_ok(r, p.tokens);
    EXPECT_EQ(r.out.dst[0].direct_messages, 0);
    EXPECT_EQ(r.out.dst[1].direct_messages, r.out.dst[1].messages);
    EXPECT_GT(r.out.dst[1].messages, 0);
    EXPECT_EQ(r.out.src[0].direct_messages, r.out.dst[1].messages);
}

// A destination that cannot map the source's pool (here: a wrong token in the hello) declines,
// and the bytes travel in messages.
TEST(TransferExecDirect, UnmappableSourceFallsBackToMessages) {
    Pair p{llama_mini(), "tp=2", "tp=2", 64};
    XferRequest r = direct_request(p, 1, 134);
    r.faults.wrong_arena_token = true;
    run_requests({&r});
    expect_all_ok(r, p.tokens);
    EXPECT_EQ(direct_read(r), 0);
    EXPECT_EQ(direct_sent(r), 0);
}

// Both sides must resolve the same transfer mode: a payload in the other order is a bad header,
// never a silent mis-unpack.
TEST(TransferExec, ModeMismatchIsABadHeader) {
    for (PoolMemory memory : {PoolMemory::kPrivate, PoolMemory::kShareable}) {
        Pair p{llama_mini(), "tp=2", "tp=4", 32};
        XferRequest r = make_request(p, 1, 135, TransferMode::kPreSend, memory);
        r.receiver_mode = TransferMode::kPostReceive;
        r.opt.timeout_s = 5;
        run_requests({&r});
        // Each destination fails; one told of it first may abort the rest of its source's
        // messages, so another destination may see those instead.
        int bad = 0;
        for (const auto& d : r.out.dst) {
            EXPECT_FALSE(d.ok());
            if (d.status == TransferStatus::kBadHeader) {
                ++bad;
                EXPECT_NE(d.error.find("same transfer mode"), std::string::npos) << d.error;
            }
        }
        EXPECT_GE(bad, 1);
        for (const auto& s : r.out.src) EXPECT_FALSE(s.ok());
    }
}

int unit_sent(const XferRequest& r) {
    int n = 0;
    for (const auto& s : r.out.src) n += s.unit_checksum_messages;
    return n;
}
int unit_read(const XferRequest& r) {
    int n = 0;
    for (const auto& d : r.out.dst) n += d.unit_checksum_messages;
    return n;
}

// Sealed sources: messages whose pieces read whole sealed blocks go with unit checksums (no pass
// over the source), the others with the XXH3 of their bytes; the KV lands exactly either way.
TEST(TransferExecDirect, UnitChecksumsFromSealedSources) {
    struct Want {
        Pair p;
        bool all_units;  // every message (else none)
    };
    const std::vector<Want> cases = {
        {{llama_mini(), "tp=8", "tp=4", 100}, true},
        {{llama_mini(), "tp=2", "tp=8", 77}, true},
        {{llama_mini(5), "tp=2,pp=2", "tp=4,pp=3", 70, 16, 64}, true},
        {{llama_mini(), "tp=1", "tp=2", 64, 16, 16, PageOrder::kHnd, PageOrder::kNhd}, true},
        {{llama_mini(), "tp=16", "tp=2", 50}, false},  // the two copies of a head split a block
        {{llama_mini(), "tp=2", "tp=2", 40, 16, 16, PageOrder::kNhd, PageOrder::kHnd}, false},
    };
    for (const auto& c : cases)
        for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive}) {
            SCOPED_TRACE(c.p.from + " -> " + c.p.to + " " + std::string(transfer_mode_name(mode)));
            XferRequest r = direct_request(c.p, 1, 170, mode);
            r.seal = true;
            run_requests({&r});
            expect_all_ok(r, c.p.tokens);
            const int n = static_cast<int>(r.plan->messages.size());
            EXPECT_EQ(direct_read(r), n);
            EXPECT_EQ(unit_sent(r), c.all_units ? n : 0);
            EXPECT_EQ(unit_read(r), unit_sent(r));
        }
}

// A source block rewritten after its seal: the destination's value differs from the seal, and
// that request fails cleanly while another one, sealed after the same write, goes on.
TEST(TransferExecDirect, RewriteAfterSealFailsOnlyThatRequest) {
    Pair p{llama_mini(), "tp=4", "tp=2", 48};
    XferRequest bad = direct_request(p, 1, 181);
    XferRequest good = direct_request(p, 1, 182);
    bad.seal = good.seal = true;
    for (auto& u : testing::seal_source(bad.src, p.tokens)) bad.sums.push_back(std::move(u));
    BlockPool& pool = *bad.src.pools[1];  // sealed, then rewritten
    pool.page(2, 0, bad.plan->src.block_tables[0][1])[40] ^= std::byte{1};
    run_requests({&bad, &good});
    // Rank 1 sends to destination 0 (heads 2, 3 of [0, 4)).
    EXPECT_EQ(bad.out.dst[0].status, TransferStatus::kChecksumMismatch) << bad.out.dst[0].error;
    EXPECT_EQ(bad.out.src[1].status, TransferStatus::kPeerFailed) << bad.out.src[1].error;
    expect_all_ok(good, p.tokens);
    EXPECT_EQ(unit_sent(good), static_cast<int>(good.plan->messages.size()));
}

TEST(TransferExecDirect, ChecksumMismatchFailsOnlyThatRequest) {
    for (bool sealed : {false, true}) {  // the XXH3 of the bytes, or the unit checksum
        SCOPED_TRACE(sealed ? "sealed" : "not sealed");
        Pair p{llama_mini(), "tp=8", "tp=4", 48};
        XferRequest bad = direct_request(p, 1, 141);
        XferRequest good = direct_request(p, 1, 142);
        bad.seal = good.seal = sealed;
        expect_only_corrupt_request_fails(bad, good, 5, p.tokens);
        EXPECT_EQ(direct_read(good), static_cast<int>(good.plan->messages.size()));
        EXPECT_EQ(unit_read(good), sealed ? direct_read(good) : 0);
    }
}

// Seals of another pool than the sender's own are refused.
TEST(TransferExecDirect, SealsOfAnotherPoolAreRefused) {
    Pair p{llama_mini(), "tp=2", "tp=2", 32};
    XferRequest r = direct_request(p, 1, 191);
    auto sums = testing::seal_source(r.src, p.tokens);
    TransferExecOptions o;
    o.source_checksums = std::move(sums[1]);
    run_threads(1, [&](Communicator& world) {
        try {
            TransferSender s(world, r.plan, 1, 0, *r.src.pools[0], o);
            ADD_FAILURE() << "expected an Error";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("another pool"), std::string::npos) << e.what();
        }
    });
}

TEST(TransferExecDirect, HungSourceTimesOut) {
    Pair p{llama_mini(), "tp=4", "tp=2", 32};
    XferRequest bad = direct_request(p, 1, 161);
    XferRequest good = direct_request(p, 1, 162);
    bad.opt.timeout_s = 0.3;
    bad.faults.stall_after = 1;  // every source announces one message, then hangs
    run_requests({&bad, &good});
    for (const auto& d : bad.out.dst) {
        EXPECT_EQ(d.status, TransferStatus::kTimeout) << d.error;
        EXPECT_LE(d.direct_messages, 2);  // at most one from each of its two sources
    }
    for (const auto& s : bad.out.src) EXPECT_FALSE(s.ok());
    expect_all_ok(good, p.tokens);
}

// Requests that share one cache of mapped source pools (as a server's ranks do) land exactly.
TEST(TransferExecDirect, SharedViewCacheAcrossRequests) {
    Pair p{llama_mini(), "tp=2", "tp=1", 64};
    auto views = std::make_shared<SharedArenaViews>();
    std::vector<XferRequest> reqs;
    for (uint64_t id = 170; id < 174; ++id) {
        reqs.push_back(direct_request(p, 1, id));
        reqs.back().opt.arena_views = views;
    }
    std::vector<XferRequest*> ptrs;
    for (auto& r : reqs) ptrs.push_back(&r);
    run_requests(ptrs);
    for (auto& r : reqs) {
        expect_all_ok(r, p.tokens);
        EXPECT_EQ(direct_read(r), static_cast<int>(r.plan->messages.size()));
    }
}

TEST(TransferExecDirect, HelloRoundTrip) {
    TransferHello h;
    h.request_id = 5;
    h.src_rank = 1;
    h.dst_rank = 3;
    seal_hello(h);
    EXPECT_EQ(check_hello(h, 5, 1, 3), "");
    EXPECT_NE(check_hello(h, 6, 1, 3).find("was expected"), std::string::npos);
    EXPECT_NE(check_hello(h, 5, 2, 3).find("was expected"), std::string::npos);
    h.num_blocks = 7;
    EXPECT_EQ(check_hello(h, 5, 1, 3), "hello checksum mismatch");
    h.version = 1;
    seal_hello(h);
    EXPECT_NE(check_hello(h, 5, 1, 3).find("version 1"), std::string::npos);
}

}  // namespace
}  // namespace kvshard
