// End to end on the threads backend: prefill on one layout, transfer, decode on another; tokens and
// logits equal to the unsharded model's.
#include <gtest/gtest.h>

#include <algorithm>

#include "kvshard/comm/threads.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/disagg.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/inputs.h"
#include "kvshard/serve/verify.h"
#include "transfer/fault_injection.h"

namespace kvshard {
namespace {

std::vector<std::vector<int32_t>> prompts_for(const ModelSpec& m, int count, int len) {
    std::vector<std::vector<int32_t>> out;
    uint64_t s = 12345;
    for (int p = 0; p < count; ++p) {
        std::vector<int32_t> pr;
        for (int i = 0; i < len + 3 * p; ++i) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            pr.push_back(static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(m.vocab)));
        }
        out.push_back(pr);
    }
    return out;
}

struct DisaggCase {
    std::string model, prefill, decode;
    int bs_prefill = 16, bs_decode = 16;
    PageOrder order_prefill = PageOrder::kHnd, order_decode = PageOrder::kHnd;
    TransferMode mode = TransferMode::kAuto;
    bool stream = true;
    bool direct = true;  // decode ranks read the prefill pools in place (false: messages)
    bool seal = true;    // the prefill ranks seal their KV as they write it
    bool prefix_cache = true;
    PrefillRoute route = PrefillRoute::kRoundRobin;
};

void PrintTo(const DisaggCase& c, std::ostream* os) {
    *os << c.model << " " << c.prefill << " -> " << c.decode << (c.direct ? "" : " (messages)");
}

DisaggReport run_case(const DisaggCase& c, const std::vector<std::vector<int32_t>>& prompts,
                      const TensorSource& src, int gen, int corrupt = -1) {
    const ModelSpec m = catalog_model(c.model);
    const ParallelConfig pp = parse_parallel_config(c.prefill),
                         pd = parse_parallel_config(c.decode);
    DisaggOptions opt;
    opt.max_new_tokens = gen;
    opt.prefill_block_size = c.bs_prefill;
    opt.decode_block_size = c.bs_decode;
    opt.prefill_order = c.order_prefill;
    opt.decode_order = c.order_decode;
    opt.transfer.mode = c.mode;
    opt.stream_layers = c.stream;
    opt.transfer.direct_read = c.direct;
    opt.source_checksums = c.seal;
    opt.prefix_cache = c.prefix_cache;
    opt.prefill_route = c.route;
    DisaggReport out;
    run_threads(pp.world_size() + pd.world_size(), [&](Communicator& world) {
        // corrupt >= 0: the prefill ranks' link spoils one payload of that request
        testing::FaultyCommunicator faulty(world);
        if (corrupt >= 0 && world.rank() < pp.world_size())
            faulty.add(static_cast<uint64_t>(corrupt), {.corrupt_message = 0});
        DisaggReport r = disagg_generate(m, pp, pd, src, prompts, opt, faulty);
        if (world.rank() == 0) out = std::move(r);
    });
    return out;
}

class DisaggEndToEnd : public ::testing::TestWithParam<DisaggCase> {};

TEST_P(DisaggEndToEnd, TokensMatchUnshardedModel) {
    const DisaggCase& c = GetParam();
    set_compute_threads(1);
    const ModelSpec m = catalog_model(c.model);
    const auto prompts = prompts_for(m, 3, 11);
    const auto src = random_tensor_source(7);
    const int gen = 6;
    const DisaggReport r = run_case(c, prompts, *src, gen);
    GenerationOptions go;
    go.max_new_tokens = gen;
    const GenerationReport ref = generate(m, ParallelConfig{}, *src, prompts, go);
    EXPECT_EQ(r.failed_requests, 0);
    for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(r.errors[i], "");
        EXPECT_EQ(r.tokens[i], ref.tokens[i]) << "prompt " << i;
        EXPECT_LT(relative_l2(r.last_logits[i], ref.last_logits[i]), 1e-4) << "prompt " << i;
    }
    EXPECT_EQ(r.transfer_bytes, r.min_bytes);
    EXPECT_GT(r.messages, 0);
    EXPECT_EQ(r.direct_messages, c.direct ? r.messages : 0);
    EXPECT_LE(r.unit_checksum_messages, r.direct_messages);
    EXPECT_EQ(r.streamed, c.stream);
    // On one clock the last request lands after the first message leaves (the ranks' starts after
    // the barrier differ when a thread is scheduled late).
    EXPECT_GT(r.transfer_end_s, r.transfer_start_s);
    // Streamed: the first message leaves before the prefill ends (every layer but the last is
    // sent while later layers compute), CP prefill sides included.
    if (c.stream) {
        EXPECT_LT(r.transfer_start_s, r.prefill_seconds);
    }
}

INSTANTIATE_TEST_SUITE_P(
    LayoutPairs, DisaggEndToEnd,
    ::testing::Values(
        DisaggCase{"tiny", "tp=8", "tp=4"},  // the seed's example (tp=8 replicates heads)
        DisaggCase{"tiny", "tp=8", "tp=4", 16, 16, PageOrder::kHnd, PageOrder::kHnd,
                   TransferMode::kAuto, true, false},  // ... in messages
        DisaggCase{"tiny", "tp=2", "tp=8"}, DisaggCase{"tiny", "tp=4,pp=2", "tp=2", 4, 16},
        DisaggCase{"tiny", "pp=2", "pp=3,tp=2", 16, 4, PageOrder::kHnd, PageOrder::kNhd},
        DisaggCase{"tiny", "tp=1", "tp=2,pp=2", 8, 8, PageOrder::kNhd, PageOrder::kHnd,
                   TransferMode::kPostReceive},
        DisaggCase{"tiny-moe", "tp=2,ep=2", "tp=4", 16, 16, PageOrder::kHnd, PageOrder::kHnd,
                   TransferMode::kPreSend, false},
        // Context-parallel prefill (ring attention), each CP rank's KV streamed to the decode
        // group layer by layer.
        DisaggCase{"tiny", "cp=2,tp=2", "tp=4"},
        DisaggCase{"tiny", "cp=4,cp_scheme=zigzag", "tp=2,pp=2", 16, 4, PageOrder::kHnd,
                   PageOrder::kNhd},
        DisaggCase{"tiny", "cp=2,cp_scheme=interleave,cp_interleave=4", "pp=2", 4, 16,
                   PageOrder::kHnd, PageOrder::kHnd, TransferMode::kPostReceive},
        // Context-parallel decode (merged partial attention): the KV lands on the CP ranks that
        // the decode side's scheme gives each token, streamed layer by layer from a plain prefill.
        DisaggCase{"tiny", "tp=4", "cp=2,tp=2"},
        DisaggCase{"tiny", "tp=2,pp=2", "cp=4,cp_scheme=zigzag", 8, 16, PageOrder::kNhd,
                   PageOrder::kHnd, TransferMode::kPostReceive},
        // CP on both sides, different sizes, schemes and block sizes.
        DisaggCase{"tiny", "cp=2,cp_scheme=zigzag", "cp=3,cp_scheme=interleave,cp_interleave=4", 16,
                   4},
        DisaggCase{"tiny", "cp=2,tp=2", "tp=2,pp=2", 16, 16, PageOrder::kHnd, PageOrder::kNhd,
                   TransferMode::kPostReceive, true, false},
        // CP with PP (each stage's layers sent by that stage's CP ranks) and with EP.
        DisaggCase{"tiny", "cp=2,pp=2", "tp=2"}, DisaggCase{"tiny", "cp=2,tp=2,pp=2", "tp=4,pp=2"},
        DisaggCase{"tiny", "tp=2", "cp=2,pp=2", 16, 8},
        DisaggCase{"tiny", "cp=2,pp=2,cp_scheme=zigzag", "cp=2,tp=2,pp=2"},
        DisaggCase{"tiny-moe", "cp=2,ep=2", "cp=2,ep=2"},
        DisaggCase{"tiny-moe", "cp=2,tp=2,ep=4", "tp=2,ep=2"}),
    [](const auto& info) { return "pair" + std::to_string(info.index); });

// Seals made as prefill writes each layer: where the messages read whole blocks (same block size,
// no replicated heads split between copies), every one is checked against them; off, none is;
// the tokens are the unsharded model's either way.
TEST(DisaggSourceChecksums, OnAndOff) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    const auto prompts = prompts_for(m, 3, 13);
    const auto src = random_tensor_source(11);
    GenerationOptions go;
    go.max_new_tokens = 4;
    const GenerationReport ref = generate(m, ParallelConfig{}, *src, prompts, go);
    for (const std::string prefill : {"tp=2", "tp=2,pp=2", "cp=2,tp=2"})
        for (bool seal : {true, false}) {
            SCOPED_TRACE(prefill + (seal ? " sealed" : " not sealed"));
            DisaggCase c{"tiny", prefill, "tp=4"};
            c.seal = seal;
            const DisaggReport r = run_case(c, prompts, *src, 4);
            EXPECT_EQ(r.failed_requests, 0);
            for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(r.tokens[i], ref.tokens[i]);
            EXPECT_EQ(r.direct_messages, r.messages);
            if (!seal)
                EXPECT_EQ(r.unit_checksum_messages, 0);
            else if (prefill.starts_with("cp"))  // a CP rank's share may end inside a block
                EXPECT_GT(r.unit_checksum_messages, 0);
            else
                EXPECT_EQ(r.unit_checksum_messages, r.messages);
        }
}

// What the run reports as exposed: the bytes that wait for their prefill rank's last layer
// (streamed: that layer's; not streamed: all of them), and the part of the transfer window after
// the last prefill layer's KV was written, on one clock. Switching streaming off moves every byte
// behind the last layer, so the benefit the report claims disappears with it.
TEST(DisaggExposure, StreamingLeavesOnlyTheLastLayerExposed) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    const auto prompts = prompts_for(m, 2, 21);
    const auto src = random_tensor_source(5);
    for (const std::string prefill : {"tp=2", "tp=2,pp=2", "cp=2,tp=2"})
        for (bool stream : {true, false}) {
            SCOPED_TRACE(prefill + (stream ? " streamed" : " after prefill"));
            DisaggCase c{"tiny", prefill, "tp=4"};
            c.stream = stream;
            const DisaggReport r = run_case(c, prompts, *src, 2);
            ASSERT_EQ(r.failed_requests, 0);
            const int pp = parse_parallel_config(prefill).pp;
            if (stream)  // each stage's last layer, of layers that all hold the same bytes
                EXPECT_EQ(r.tail_bytes * m.num_layers, r.transfer_bytes * pp);
            else
                EXPECT_EQ(r.tail_bytes, r.transfer_bytes);
            EXPECT_GT(r.last_layer_s, 0);
            EXPECT_LE(r.last_layer_s, r.prefill_seconds);
            EXPECT_GE(r.exposed_seconds, 0);
            EXPECT_LE(r.exposed_seconds, r.transfer_seconds);
            EXPECT_NEAR(r.hidden_fraction, 1 - r.exposed_seconds / r.transfer_seconds, 1e-12);
            // Every message of the slowest rank leaves after its last layer, and lands after it.
            if (!stream) {
                EXPECT_GT(r.exposed_seconds, 0);
            }
        }
}

// Prompts that share a prefix: the prefill side computes the shared blocks once and the decode
// side receives them once (its later requests share those blocks); tokens and logits stay the
// unsharded model's. Off, every token is computed and sent.
TEST(DisaggPrefixCache, SharedPrefixComputedAndSentOnce) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    const auto prompts =
        make_prompts({.count = 3, .length = 40, .shared_prefix = 33, .seed = 4}, m.vocab);
    const auto src = random_tensor_source(9);
    GenerationOptions go;
    go.max_new_tokens = 4;
    const GenerationReport ref = generate(m, ParallelConfig{}, *src, prompts, go);
    for (DisaggCase c :
         {DisaggCase{"tiny", "tp=2", "tp=1"}, DisaggCase{"tiny", "tp=2,pp=2", "tp=4", 8, 4},
          DisaggCase{"tiny", "pp=2", "tp=2,pp=2", 4, 16, PageOrder::kNhd}}) {
        SCOPED_TRACE(c.prefill + " -> " + c.decode);
        DisaggReport on, off;
        for (bool cache : {true, false}) {
            c.prefix_cache = cache;
            DisaggReport r = run_case(c, prompts, *src, 4);
            ASSERT_EQ(r.failed_requests, 0);
            for (size_t i = 0; i < prompts.size(); ++i) {
                EXPECT_EQ(r.tokens[i], ref.tokens[i]) << "prompt " << i;
                EXPECT_LT(relative_l2(r.last_logits[i], ref.last_logits[i]), 1e-4);
            }
            EXPECT_EQ(r.transfer_bytes, r.min_bytes);
            EXPECT_EQ(r.prompt_tokens, 120);
            (cache ? on : off) = std::move(r);
        }
        EXPECT_TRUE(on.prefix_cache);
        EXPECT_FALSE(off.prefix_cache);
        // Requests 1 and 2 share the full blocks of the 33-token prefix on each side.
        const int64_t pbs = c.bs_prefill, dbs = c.bs_decode;
        EXPECT_EQ(on.prefill_computed_tokens, 120 - 2 * (33 / pbs) * pbs);
        EXPECT_EQ(on.decode_cached_tokens, 2 * std::min<int64_t>(33 / dbs, 39 / dbs) * dbs);
        EXPECT_EQ(off.prefill_computed_tokens, 120);
        EXPECT_EQ(off.decode_cached_tokens, 0);
        EXPECT_EQ(on.transfer_bytes * 120, off.transfer_bytes * (120 - on.decode_cached_tokens));
    }
}

// A request whose cached prefix on the decode side was to be written by an earlier request's
// transfer fails with it, instead of decoding from blocks that hold nothing.
TEST(DisaggPrefixCache, ProviderFailureFailsTheSharers) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    auto prompts =
        make_prompts({.count = 2, .length = 40, .shared_prefix = 33, .seed = 4}, m.vocab);
    prompts.push_back(prompts_for(m, 1, 40)[0]);  // a third prompt that shares nothing
    const auto src = random_tensor_source(9);
    const DisaggReport r = run_case(DisaggCase{"tiny", "tp=2", "tp=1"}, prompts, *src, 3,
                                    /*corrupt=*/0);
    EXPECT_EQ(r.failed_requests, 2);
    EXPECT_NE(r.errors[0].find("checksum"), std::string::npos) << r.errors[0];
    EXPECT_NE(r.errors[1].find("its cached prefix was to come with request 0"), std::string::npos)
        << r.errors[1];
    EXPECT_EQ(r.errors[2], "");
    EXPECT_EQ(r.tokens[2].size(), 3u);
}

TEST(DisaggFailure, CorruptRequestFailsAloneOthersDecode) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    const auto prompts = prompts_for(m, 3, 9);
    const auto src = random_tensor_source(3);
    GenerationOptions go;
    go.max_new_tokens = 5;
    const GenerationReport ref = generate(m, ParallelConfig{}, *src, prompts, go);
    for (bool direct : {true, false}) {
        DisaggCase c{"tiny", "tp=4", "tp=2"};
        c.direct = direct;
        const DisaggReport r = run_case(c, prompts, *src, 5, /*corrupt=*/1);
        EXPECT_EQ(r.failed_requests, 1) << (direct ? "direct read" : "messages");
        EXPECT_NE(r.errors[1].find("checksum"), std::string::npos) << r.errors[1];
        EXPECT_TRUE(r.tokens[1].empty());
        for (int i : {0, 2}) {
            EXPECT_EQ(r.errors[i], "");
            EXPECT_EQ(r.tokens[i], ref.tokens[i]) << "prompt " << i;
        }
    }
}

// The same with a context-parallel side: the CP executor releases the failed request's blocks and
// decodes the others (every CP rank agrees on which), and nothing hangs.
TEST(DisaggFailure, CorruptRequestFailsAloneWithCpSides) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    const auto prompts = prompts_for(m, 3, 21);
    const auto src = random_tensor_source(5);
    GenerationOptions go;
    go.max_new_tokens = 4;
    const GenerationReport ref = generate(m, ParallelConfig{}, *src, prompts, go);
    for (const DisaggCase& c :
         {DisaggCase{"tiny", "tp=2", "cp=2,tp=2"}, DisaggCase{"tiny", "cp=2", "tp=1"},
          DisaggCase{"tiny", "cp=2,cp_scheme=zigzag", "cp=3", 16, 4}}) {
        const DisaggReport r = run_case(c, prompts, *src, 4, /*corrupt=*/2);
        EXPECT_EQ(r.failed_requests, 1) << c.prefill << " -> " << c.decode;
        EXPECT_NE(r.errors[2].find("checksum"), std::string::npos) << r.errors[2];
        EXPECT_TRUE(r.tokens[2].empty());
        for (int i : {0, 1}) {
            EXPECT_EQ(r.errors[i], "");
            EXPECT_EQ(r.tokens[i], ref.tokens[i])
                << c.prefill << " -> " << c.decode << " prompt " << i;
        }
    }
}

// Several prefill and several decode groups (dp > 1 on both sides): each request is prefilled by
// its prefill replica, moved to its decode replica and decoded there; every request's tokens are
// the unsharded model's, every replica serves some request, and each request's KV moves once.
TEST(DisaggReplicas, TwoPrefillTwoDecodeGroupsMatchUnshardedModel) {
    set_compute_threads(1);
    for (DisaggCase c : {
             DisaggCase{"tiny", "dp=2,tp=2", "dp=2,tp=1"},
             DisaggCase{"tiny", "dp=2,pp=2", "dp=2,tp=2", 8, 4, PageOrder::kHnd, PageOrder::kNhd},
             DisaggCase{"tiny", "dp=2,tp=2", "dp=2,pp=2", 16, 16, PageOrder::kHnd, PageOrder::kHnd,
                        TransferMode::kAuto, true, false},  // messages
             DisaggCase{"tiny", "dp=3", "dp=2,tp=2", 4, 16, PageOrder::kHnd, PageOrder::kHnd,
                        TransferMode::kPostReceive, true, true, true, true,
                        PrefillRoute::kLeastTokens},
             DisaggCase{"tiny-swa", "dp=2,tp=2", "dp=2,tp=1", 4, 4},
             DisaggCase{"tiny-swa", "dp=2,pp=2", "dp=2,tp=2", 4, 8},
         }) {
        SCOPED_TRACE(c.model + " " + c.prefill + " -> " + c.decode);
        const ModelSpec m = catalog_model(c.model);
        // Six prompts of different lengths; prompt 4 starts with prompt 0 (a prefix hit where
        // both land on the same replica of a side).
        auto prompts = prompts_for(m, 6, 9);
        prompts[4].insert(prompts[4].begin(), prompts[0].begin(), prompts[0].end());
        const auto src = random_tensor_source(11);
        const int gen = 5;
        const DisaggReport r = run_case(c, prompts, *src, gen);
        GenerationOptions go;
        go.max_new_tokens = gen;
        const GenerationReport ref = generate(m, ParallelConfig{}, *src, prompts, go);
        ASSERT_EQ(r.failed_requests, 0);
        ASSERT_EQ(r.prefill_replica.size(), prompts.size());
        ASSERT_EQ(r.decode_replica.size(), prompts.size());
        for (size_t i = 0; i < prompts.size(); ++i) {
            EXPECT_EQ(r.errors[i], "");
            EXPECT_EQ(r.tokens[i], ref.tokens[i]) << "prompt " << i;
            EXPECT_LT(relative_l2(r.last_logits[i], ref.last_logits[i]), 1e-4) << "prompt " << i;
        }
        const ParallelConfig pp = parse_parallel_config(c.prefill),
                             pd = parse_parallel_config(c.decode);
        for (int k = 0; k < pp.dp; ++k)
            EXPECT_NE(std::count(r.prefill_replica.begin(), r.prefill_replica.end(), k), 0)
                << "prefill replica " << k << " served nothing";
        for (int k = 0; k < pd.dp; ++k)
            EXPECT_NE(std::count(r.decode_replica.begin(), r.decode_replica.end(), k), 0)
                << "decode replica " << k << " served nothing";
        if (c.route == PrefillRoute::kRoundRobin) {
            for (size_t i = 0; i < prompts.size(); ++i)
                EXPECT_EQ(r.prefill_replica[i], int(i) % pp.dp);
        }
        EXPECT_EQ(r.transfer_bytes, r.min_bytes);
        EXPECT_GT(r.messages, 0);
    }
}

// The decode replica of each request is the one with the most free KV blocks (the fewest
// assigned), ties to the lowest; least-tokens sends each prompt to the prefill replica with the
// fewest prompt tokens so far.
TEST(DisaggReplicas, AssignmentFollowsFreeBlocksAndRoute) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    const auto src = random_tensor_source(3);
    // Lengths 30, 2, 2, 2 with block size 4 and 2 new tokens: 8, 1, 1, 1 blocks.
    std::vector<std::vector<int32_t>> prompts;
    for (int len : {30, 2, 2, 2}) prompts.emplace_back(static_cast<size_t>(len), 5);
    DisaggCase c{"tiny", "dp=2", "dp=2", 4, 4};
    c.prefix_cache = false;
    c.route = PrefillRoute::kLeastTokens;
    const DisaggReport r = run_case(c, prompts, *src, 2);
    ASSERT_EQ(r.failed_requests, 0);
    EXPECT_EQ(r.decode_replica, (std::vector<int>{0, 1, 1, 1}));
    EXPECT_EQ(r.prefill_replica, (std::vector<int>{0, 1, 1, 1}));
    c.route = PrefillRoute::kRoundRobin;
    const DisaggReport rr = run_case(c, prompts, *src, 2);
    EXPECT_EQ(rr.prefill_replica, (std::vector<int>{0, 1, 0, 1}));
    EXPECT_EQ(rr.tokens, r.tokens);
}

TEST(DisaggFailure, RejectsUnsupportedLayouts) {
    const ModelSpec m = catalog_model("tiny");
    const auto src = random_tensor_source(1);
    const auto prompts = prompts_for(m, 1, 4);
    run_threads(3, [&](Communicator& world) {
        EXPECT_THROW(disagg_generate(m, parse_parallel_config("tp=2"),
                                     parse_parallel_config("tp=2"), *src, prompts, {}, world),
                     Error);  // 2 + 2 ranks needed, 3 given
    });
    run_threads(3, [&](Communicator& world) {
        DisaggOptions o;
        o.decode_order = PageOrder::kNhd;
        EXPECT_THROW(disagg_generate(m, parse_parallel_config("tp=1"),
                                     parse_parallel_config("cp=2"), *src, prompts, o, world),
                     Error);
    });
    run_threads(5, [&](Communicator& world) {  // a CP side serves one replica
        try {
            disagg_generate(m, parse_parallel_config("dp=2,cp=2"), parse_parallel_config("tp=1"),
                            *src, prompts, {}, world);
            ADD_FAILURE() << "prefill dp=2,cp=2 accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("a disaggregated side with cp > 1 serves one "
                                                 "replica: use dp=1 with cp > 1"),
                      std::string::npos)
                << e.what();
        }
    });
    EXPECT_THROW(parse_prefill_route("random"), Error);
}

}  // namespace
}  // namespace kvshard
