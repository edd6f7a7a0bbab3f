// Transfer plan + pack/unpack: named layout pairs and a property test over random pairs.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "kvshard/common/error.h"
#include "kvshard/common/xxh3.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

using testing::element_code;
using testing::llama_mini;

struct Case {
    ModelSpec model;
    std::string from, to;
    int64_t tokens = 100;
    int bs_from = 16, bs_to = 16;
    PageOrder order_from = PageOrder::kHnd, order_to = PageOrder::kHnd;
    int dp_from = 0, dp_to = 0;
    int layers_per_group = 0;
    uint64_t shuffle = 0;
    int64_t dst_cached = 0;
};

TransferPlan plan_of(const Case& c) {
    auto src = testing::make_endpoint(c.model, c.from, c.bs_from, c.order_from, c.tokens, c.dp_from,
                                      c.shuffle);
    auto dst = testing::make_endpoint(c.model, c.to, c.bs_to, c.order_to, c.tokens, c.dp_to,
                                      c.shuffle ? c.shuffle + 1 : 0);
    return make_transfer_plan(
        src, dst, c.tokens,
        {.layers_per_group = c.layers_per_group, .dst_cached_tokens = c.dst_cached});
}

// Copies every message straight from its source pool (direct read) in `mode`; checks that the hash
// of the bytes read equals hash_payload on the source and XXH3 of the packed payload. With `sums`
// (the source's seals), each message that has a unit checksum is also read by copy_direct_units
// into `units` (counted in *unit_messages), whose value must equal it; the others are read there
// by copy_direct too.
testing::Side run_direct(const TransferPlan& plan, TransferMode mode, const testing::Side& src,
                         const std::vector<std::unique_ptr<SourceChecksums>>* sums = nullptr,
                         testing::Side* units = nullptr, int* unit_messages = nullptr) {
    auto dst = testing::make_destination(plan.dst);
    if (units != nullptr) *units = testing::make_destination(plan.dst);
    for (const auto& msg : plan.messages) {
        const BlockPool& from = *src.pools.at(msg.src_rank);
        const SourceArena arena{from.arena().data(), static_cast<int64_t>(from.arena().size()),
                                from.num_blocks()};
        const uint64_t read = copy_direct(plan, msg, mode, arena, *dst.pools.at(msg.dst_rank));
        std::vector<std::byte> payload(static_cast<size_t>(msg.bytes));
        pack_message(plan, msg, mode, from, payload);
        EXPECT_EQ(read, xxh3_64(payload.data(), payload.size()));
        EXPECT_EQ(read, hash_payload(plan, msg, mode, from));
        if (units == nullptr) continue;
        BlockPool& to = *units->pools.at(msg.dst_rank);
        const SourceChecksums* s = sums->at(msg.src_rank).get();
        const auto want = s != nullptr ? unit_checksum(plan, msg, *s) : std::nullopt;
        if (want) {
            EXPECT_EQ(copy_direct_units(plan, msg, arena, to), *want)
                << "message " << msg.src_rank << "->" << msg.dst_rank;
            ++*unit_messages;
        } else {
            copy_direct(plan, msg, mode, arena, to);
        }
    }
    return dst;
}

// Runs the plan in both modes and checks every destination pool element by element, that no byte is
// written twice, that total bytes equal the minimum, and that both modes, and direct reads in
// both wire orders, give identical pools.
// unit_messages_seen: messages that had a unit checksum (HND sources).
void check_exact(const Case& c, const TransferPlan& plan, int* unit_messages_seen = nullptr) {
    SCOPED_TRACE(c.model.name + " " + c.from + " -> " + c.to +
                 " tokens=" + std::to_string(c.tokens) + " bs " + std::to_string(c.bs_from) + "->" +
                 std::to_string(c.bs_to));
    EXPECT_EQ(plan.bytes, plan.min_bytes);
    const auto src = testing::make_source(plan.src, c.tokens);
    const auto sums = testing::seal_source(src, c.tokens);
    std::vector<std::vector<std::byte>> first_mode_pools;
    for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive}) {
        SCOPED_TRACE(std::string(transfer_mode_name(mode)));
        auto dst = testing::make_destination(plan.dst);
        const auto res = testing::run_plan(plan, mode, src, dst);
        EXPECT_EQ(res.bytes, plan.min_bytes);
        for (int r = 0; r < plan.dst.layout.world_size(); ++r) {
            if (!dst.pools[r]) continue;
            EXPECT_EQ(res.bytes_to[r], needed_bytes(plan, r)) << "dst rank " << r;
            const auto want = testing::expected_pool(plan.dst, r, c.tokens, *dst.pools[r],
                                                     plan.options.dst_cached_tokens);
            const auto* got = reinterpret_cast<const uint32_t*>(dst.pools[r]->arena().data());
            int64_t wrong = 0, first = -1;
            for (size_t i = 0; i < want.size(); ++i)
                if (got[i] != want[i]) {
                    if (first < 0) first = static_cast<int64_t>(i);
                    ++wrong;
                }
            EXPECT_EQ(wrong, 0) << "dst rank " << r << ": first wrong element " << first
                                << " holds " << (first >= 0 ? got[first] : 0) << " want "
                                << (first >= 0 ? want[first] : 0);
        }
        const auto counts = testing::write_counts(plan, mode, dst);
        for (int r = 0; r < plan.dst.layout.world_size(); ++r) {
            if (!dst.pools[r]) continue;
            const auto want = testing::expected_pool(plan.dst, r, c.tokens, *dst.pools[r],
                                                     plan.options.dst_cached_tokens);
            int64_t bad = 0;
            for (size_t i = 0; i < counts[r].size(); ++i) {
                const uint8_t expect = want[i / 4] == testing::kSentinel ? 0 : 1;
                bad += counts[r][i] != expect;
            }
            EXPECT_EQ(bad, 0) << "dst rank " << r << ": bytes written other than once where needed";
        }
        if (first_mode_pools.empty()) {
            for (auto& p : dst.pools)
                first_mode_pools.emplace_back(
                    p ? std::vector<std::byte>(p->arena().begin(), p->arena().end())
                      : std::vector<std::byte>{});
        } else {
            for (size_t r = 0; r < dst.pools.size(); ++r) {
                if (!dst.pools[r]) continue;
                EXPECT_TRUE(std::equal(first_mode_pools[r].begin(), first_mode_pools[r].end(),
                                       dst.pools[r]->arena().begin()))
                    << "pre-send and post-receive differ on dst rank " << r;
            }
        }
        testing::Side units;
        int unit_messages = 0;
        const auto direct = run_direct(plan, mode, src, &sums, &units, &unit_messages);
        for (size_t r = 0; r < direct.pools.size(); ++r) {
            if (!direct.pools[r]) continue;
            EXPECT_TRUE(std::equal(first_mode_pools[r].begin(), first_mode_pools[r].end(),
                                   direct.pools[r]->arena().begin()))
                << "a direct read differs from pack + unpack on dst rank " << r;
            EXPECT_TRUE(std::equal(first_mode_pools[r].begin(), first_mode_pools[r].end(),
                                   units.pools[r]->arena().begin()))
                << "a direct read with unit checksums differs from pack + unpack on dst rank " << r;
        }
        if (unit_messages_seen != nullptr) *unit_messages_seen = unit_messages;
    }
}

// Messages sent per (src, dst) pair, and source ranks seen.
std::map<std::pair<int, int>, int> pair_counts(const TransferPlan& plan) {
    std::map<std::pair<int, int>, int> m;
    for (const auto& msg : plan.messages) ++m[{msg.src_rank, msg.dst_rank}];
    return m;
}

// Plans of the longest transfers are bounded before their pieces are made: 2^26 tokens in blocks
// of 1 (67M pieces a message) and a 126-layer model streamed a message per layer took minutes and
// ran out of memory; blocks past 2^20 tokens are refused like the CLI's.
TEST(TransferPlan, HugePlansAndBlocksAreRefusedBeforeTheyAreMade) {
    const ModelSpec m = catalog_model("tiny");
    auto error_of = [&](const std::string& from, const std::string& to, int64_t tokens, int bs,
                        int layers_per_group) -> std::string {
        try {
            auto src = testing::make_endpoint(m, from, bs, PageOrder::kHnd, tokens);
            auto dst = testing::make_endpoint(m, to, bs, PageOrder::kHnd, tokens);
            make_transfer_plan(src, dst, tokens, {.layers_per_group = layers_per_group});
        } catch (const Error& e) {
            return e.what();
        }
        return "";
    };
    EXPECT_NE(error_of("tp=1", "tp=1", kMaxTransferTokens, 1, 0).find("use blocks of at least 4"),
              std::string::npos);
    // A message per layer: 4 sources x 4 layers = 16 messages of 2^23 pieces, 2^27 in all.
    EXPECT_NE(error_of("tp=4", "tp=1", kMaxTransferTokens, 8, 1).find("would list more than"),
              std::string::npos);
    EXPECT_NE(error_of("tp=1", "tp=1", 64, (1 << 20) + 1, 0).find("in [1, 2^20] tokens"),
              std::string::npos);
    EXPECT_EQ(error_of("tp=2", "tp=1", 100000, 4, 1), "");
}

TEST(TransferPlan, SeedExampleTp8ToTp4) {
    // [H0][H1]...[H7] -> [H0H1][H2H3][H4H5][H6H7]
    Case c{.model = llama_mini(), .from = "tp=8", .to = "tp=4", .tokens = 100};
    const auto plan = plan_of(c);
    ASSERT_EQ(plan.messages.size(), 8u);
    for (const auto& msg : plan.messages) {
        EXPECT_EQ(msg.dst_rank, msg.src_rank / 2);
        EXPECT_EQ(msg.head_begin, msg.src_rank);
        EXPECT_EQ(msg.head_end, msg.src_rank + 1);
        EXPECT_EQ(msg.num_tokens, 100);
        EXPECT_EQ(msg.layer_begin, 0);
        EXPECT_EQ(msg.layer_end, 4);
    }
    int units = 0;
    check_exact(c, plan, &units);
    EXPECT_EQ(units, 8);  // every piece a whole sealed block: unit checksums throughout
}

TEST(TransferPlan, Tp2ToTp8) {
    Case c{.model = llama_mini(), .from = "tp=2", .to = "tp=8", .tokens = 77};
    const auto plan = plan_of(c);
    ASSERT_EQ(plan.messages.size(), 8u);
    for (const auto& msg : plan.messages) {
        EXPECT_EQ(msg.src_rank, msg.dst_rank / 4);
        EXPECT_EQ(msg.head_begin, msg.dst_rank);
    }
    int units = 0;
    check_exact(c, plan, &units);
    EXPECT_EQ(units, 8);
}

TEST(TransferPlan, Tp16ReplicatedHeadsToTp2) {
    // 8 KV heads on 16 ranks: each head held twice. Each copy sends half the tokens; no head twice.
    Case c{.model = llama_mini(), .from = "tp=16", .to = "tp=2", .tokens = 90};
    const auto plan = plan_of(c);
    ASSERT_EQ(plan.messages.size(), 16u);
    std::map<int, int64_t> sent;
    for (const auto& msg : plan.messages) {
        sent[msg.src_rank] += msg.bytes;
        EXPECT_EQ(msg.num_tokens, 45);
        EXPECT_EQ(msg.dst_rank, msg.src_rank / 8);
    }
    EXPECT_EQ(sent.size(), 16u);  // every copy sends
    for (const auto& [r, b] : sent) EXPECT_EQ(b, sent.begin()->second);
    int units = -1;
    check_exact(c, plan, &units);
    EXPECT_EQ(units, 0);  // the two copies split block 2 between them: XXH3 of the bytes instead
}

TEST(TransferPlan, Tp2ToTp16ReplicatedDestination) {
    // Every destination copy of a head receives it; each from the one source rank that holds it.
    Case c{.model = llama_mini(), .from = "tp=2", .to = "tp=16", .tokens = 40};
    const auto plan = plan_of(c);
    ASSERT_EQ(plan.messages.size(), 16u);
    for (const auto& msg : plan.messages) EXPECT_EQ(msg.head_begin, msg.dst_rank / 2);
    EXPECT_EQ(plan.min_bytes, 2 * 4 * 2 * 8 * 40 * 16 * 4);  // each head held twice
    check_exact(c, plan);
}

TEST(TransferPlan, Pp2ToPp3UnevenSplits) {
    // 7 layers, split as vLLM's get_pp_indices: source stages [0,4) [4,7); destination [0,2)
    // [2,5) [5,7) (the extra layer on the stage before the last).
    Case c{.model = llama_mini(7), .from = "pp=2,tp=2", .to = "pp=3,tp=2", .tokens = 50};
    const auto plan = plan_of(c);
    std::set<std::tuple<int, int, int, int>> got;  // src stage, dst stage, layer range
    for (const auto& msg : plan.messages)
        got.insert({plan.src.layout.ranks[msg.src_rank].coord.pp,
                    plan.dst.layout.ranks[msg.dst_rank].coord.pp, msg.layer_begin, msg.layer_end});
    const std::set<std::tuple<int, int, int, int>> want = {
        {0, 0, 0, 2}, {0, 1, 2, 4}, {1, 1, 4, 5}, {1, 2, 5, 7}};
    EXPECT_EQ(got, want);
    EXPECT_EQ(plan.messages.size(), 8u);  // 4 stage pairs x 2 TP ranks
    check_exact(c, plan);
    Case explicit_split = c;
    explicit_split.from = "pp=2,pp_layers=2/5";
    explicit_split.to = "pp=3,pp_layers=1/5/1";
    check_exact(explicit_split, plan_of(explicit_split));
}

TEST(TransferPlan, Cp4ToCp1) {
    for (const char* scheme : {"contiguous", "zigzag", "interleave,cp_interleave=3"}) {
        Case c{.model = llama_mini(),
               .from = std::string("cp=4,tp=2,cp_scheme=") + scheme,
               .to = "tp=2",
               .tokens = 101};
        const auto plan = plan_of(c);
        EXPECT_EQ(plan.messages.size(), 8u)
            << scheme;  // 4 CP ranks x 2 TP ranks, each to its TP peer
        for (const auto& msg : plan.messages)
            EXPECT_EQ(plan.src.layout.ranks[msg.src_rank].coord.tp,
                      plan.dst.layout.ranks[msg.dst_rank].coord.tp);
        check_exact(c, plan);
    }
}

TEST(TransferPlan, Cp1ToCp4AndBetweenSchemes) {
    check_exact(Case{.model = llama_mini(),
                     .from = "tp=4",
                     .to = "cp=4,tp=1,cp_scheme=zigzag",
                     .tokens = 64},
                plan_of(Case{.model = llama_mini(),
                             .from = "tp=4",
                             .to = "cp=4,tp=1,cp_scheme=zigzag",
                             .tokens = 64}));
    Case c{.model = llama_mini(),
           .from = "cp=2,cp_scheme=zigzag",
           .to = "cp=3,cp_scheme=interleave,cp_interleave=16",
           .tokens = 133,
           .bs_from = 8,
           .bs_to = 16};
    check_exact(c, plan_of(c));
}

TEST(TransferPlan, BlockSize16To64) {
    Case c{.model = llama_mini(),
           .from = "tp=4",
           .to = "tp=4",
           .tokens = 200,
           .bs_from = 16,
           .bs_to = 64};
    const auto plan = plan_of(c);
    ASSERT_EQ(plan.messages.size(), 4u);
    for (const auto& msg : plan.messages) {
        EXPECT_EQ(msg.src_rank, msg.dst_rank);
        EXPECT_EQ(msg.pieces.size(),
                  13u);  // ceil(200 / 16) source blocks, each inside one 64-block
    }
    int units = 0;
    check_exact(c, plan, &units);
    EXPECT_EQ(units, 4);  // the last block holds 8 tokens, sealed as 8
    Case back = c;
    std::swap(back.bs_from, back.bs_to);
    back.shuffle = 7;
    units = -1;
    check_exact(back, plan_of(back), &units);
    EXPECT_EQ(units, 0);  // each 64-token source block is split between 16-token blocks
}

TEST(TransferPlan, HndToNhdAndBack) {
    Case c{.model = llama_mini(),
           .from = "tp=8",
           .to = "tp=2",
           .tokens = 70,
           .order_from = PageOrder::kHnd,
           .order_to = PageOrder::kNhd,
           .shuffle = 3};
    check_exact(c, plan_of(c));
    std::swap(c.order_from, c.order_to);
    check_exact(c, plan_of(c));
    c.order_from = c.order_to = PageOrder::kNhd;
    check_exact(c, plan_of(c));
    // Several heads on both sides, so the rectangles are really transposed.
    for (auto [from, to] : {std::pair{PageOrder::kHnd, PageOrder::kNhd},
                            std::pair{PageOrder::kNhd, PageOrder::kHnd}}) {
        Case m{.model = llama_mini(),
               .from = "tp=2",
               .to = "tp=4",
               .tokens = 45,
               .bs_from = 4,
               .bs_to = 16,
               .order_from = from,
               .order_to = to};
        check_exact(m, plan_of(m));
    }
}

TEST(TransferPlan, MlaTp8ToTp2) {
    // The latent is on every TP rank and the destinations are fewer than the copies: each
    // destination's tokens are split over 4 of the 8 copies (a quarter each), so every copy sends
    // a quarter of the tokens, as few as any split allows, in 8 messages. (The earlier rule, every
    // copy an eighth of the tokens to each destination, sent the same bytes per copy in 16.)
    Case c{.model = catalog_model("tiny-mla"), .from = "tp=8", .to = "tp=2", .tokens = 96};
    const auto plan = plan_of(c);
    ASSERT_EQ(plan.messages.size(), 8u);
    std::map<int, std::set<int>> sources_of;
    for (const auto& msg : plan.messages) {
        EXPECT_EQ(msg.num_tokens, 24);
        EXPECT_EQ(msg.dst_rank, msg.src_rank / 4);
        sources_of[msg.dst_rank].insert(msg.src_rank);
    }
    EXPECT_EQ(sources_of[0].size(), 4u);
    EXPECT_EQ(sources_of[1].size(), 4u);
    EXPECT_EQ(plan.min_bytes, 2 * (2 * 40 * 96 * 4));  // 2 destinations x 2 layers x latent 40 fp32
    check_exact(c, plan);
}

// Bytes each source rank sends.
std::map<int, int64_t> bytes_by_source(const TransferPlan& plan) {
    std::map<int, int64_t> out;
    for (const auto& msg : plan.messages) out[msg.src_rank] += msg.bytes;
    return out;
}

int64_t max_source_bytes(const TransferPlan& plan) {
    int64_t most = 0;
    for (const auto& [r, b] : bytes_by_source(plan)) most = std::max(most, b);
    return most;
}

// Both sides replicate the latent on every TP rank (MLA under tp=8): each destination gets its
// whole range from the source rank with its own TP index, in whole blocks; one message per
// destination and layer group.
TEST(TransferPlan, ReplicatedOnBothSidesSendsWholeRangesFromTheSameReplica) {
    const ModelSpec ds = catalog_model("deepseek-v3");
    for (int lpg : {0, 1}) {
        SCOPED_TRACE("layers per group " + std::to_string(lpg));
        const auto src = testing::make_endpoint(ds, "tp=8", 16, PageOrder::kHnd, 100);
        const auto dst = testing::make_endpoint(ds, "tp=8", 16, PageOrder::kHnd, 100);
        const auto plan = make_transfer_plan(src, dst, 100, {.layers_per_group = lpg});
        std::map<int, int> per_group;
        for (const auto& msg : plan.messages) {
            ++per_group[msg.layer_group];
            EXPECT_EQ(msg.src_rank, msg.dst_rank);
            EXPECT_EQ(msg.num_tokens, 100);
            // ceil(100 / 16) whole blocks, the last one partly filled.
            ASSERT_EQ(msg.pieces.size(), 7u);
            for (size_t i = 0; i < msg.pieces.size(); ++i) {
                EXPECT_EQ(msg.pieces[i].src_slot, 0);
                EXPECT_EQ(msg.pieces[i].count, i + 1 < msg.pieces.size() ? 16 : 4);
            }
        }
        EXPECT_EQ(static_cast<int>(per_group.size()), plan.num_layer_groups);
        EXPECT_EQ(plan.num_layer_groups, lpg == 0 ? 1 : ds.num_layers);
        for (const auto& [g, n] : per_group) EXPECT_EQ(n, 8) << "layer group " << g;
        EXPECT_EQ(plan.bytes, plan.min_bytes);
        // Every source sends exactly what one destination needs: no source does more.
        for (const auto& [r, b] : bytes_by_source(plan)) EXPECT_EQ(b, needed_bytes(plan, r));
    }
    // The same, checked element by element on a small MLA model.
    Case c{.model = catalog_model("tiny-mla"), .from = "tp=8", .to = "tp=8", .tokens = 100};
    const auto plan = plan_of(c);
    ASSERT_EQ(plan.messages.size(), 8u);
    for (const auto& msg : plan.messages) EXPECT_EQ(msg.src_rank, msg.dst_rank);
    int units = 0;
    check_exact(c, plan, &units);
    EXPECT_EQ(units, 8);  // whole sealed blocks: each message has a unit checksum
}

// MLA TP=4 -> TP=2: 4 copies, 2 destinations. Whole ranges would leave two copies idle and the
// others sending a destination's all; split, each destination is served by two copies and no
// source sends more than half of what a destination needs.
TEST(TransferPlan, TpShrinkStillSpreadsOverTheCopies) {
    Case c{.model = catalog_model("tiny-mla"), .from = "tp=4", .to = "tp=2", .tokens = 100};
    const auto plan = plan_of(c);
    std::map<int, std::set<int>> sources_of;
    for (const auto& msg : plan.messages) sources_of[msg.dst_rank].insert(msg.src_rank);
    ASSERT_EQ(sources_of.size(), 2u);
    for (const auto& [d, s] : sources_of) EXPECT_GT(s.size(), 1u) << "destination " << d;
    EXPECT_EQ(bytes_by_source(plan).size(), 4u);  // every copy sends
    const int64_t one_destination = needed_bytes(plan, 0);
    EXPECT_LT(max_source_bytes(plan), one_destination);
    EXPECT_EQ(max_source_bytes(plan), one_destination / 2);  // 100 tokens: 50 each
    check_exact(c, plan);
    // deepseek-v3 the same way.
    const ModelSpec ds = catalog_model("deepseek-v3");
    const auto src = testing::make_endpoint(ds, "tp=4", 16, PageOrder::kHnd, 1000);
    const auto dst = testing::make_endpoint(ds, "tp=2", 16, PageOrder::kHnd, 1000);
    const auto big = make_transfer_plan(src, dst, 1000);
    EXPECT_EQ(big.messages.size(), 4u);
    EXPECT_EQ(max_source_bytes(big), needed_bytes(big, 0) / 2);
}

// GQA(8) with replicated heads on both sides: TP=16 (each head on 2 ranks) -> TP=32 (each head on
// 4). Each destination gets its head whole from one of the head's two source copies, the
// destinations of a head alternating between them: every source sends two destinations' worth.
TEST(TransferPlan, GqaTp16ToTp32WholeRangesRoundRobin) {
    Case c{.model = llama_mini(), .from = "tp=16", .to = "tp=32", .tokens = 70};
    const auto plan = plan_of(c);
    ASSERT_EQ(plan.messages.size(), 32u);
    std::map<int, int> sources_per_destination;
    for (const auto& msg : plan.messages) {
        ++sources_per_destination[msg.dst_rank];
        EXPECT_EQ(msg.num_tokens, 70);
        EXPECT_EQ(msg.head_begin, msg.dst_rank / 4);
        // Destination replica j (of 4) of head h from source copy j mod 2.
        EXPECT_EQ(msg.src_rank, 2 * (msg.dst_rank / 4) + (msg.dst_rank % 4) % 2);
    }
    EXPECT_EQ(sources_per_destination.size(), 32u);
    for (const auto& [d, n] : sources_per_destination) EXPECT_EQ(n, 1);
    const auto by_source = bytes_by_source(plan);
    EXPECT_EQ(by_source.size(), 16u);
    for (const auto& [r, b] : by_source) EXPECT_EQ(b, 2 * needed_bytes(plan, 0));
    int units = 0;
    check_exact(c, plan, &units);
    EXPECT_EQ(units, 32);
}

TEST(TransferPlan, LayerGroupsOneMessagePerLayer) {
    Case c{.model = llama_mini(6),
           .from = "tp=4,pp=2",
           .to = "tp=2",
           .tokens = 33,
           .layers_per_group = 1};
    const auto plan = plan_of(c);
    EXPECT_EQ(plan.num_layer_groups, 6);
    EXPECT_EQ(plan.messages.size(), 6u * 4u);  // per layer: 4 source TP ranks -> their dst
    for (size_t i = 1; i < plan.messages.size(); ++i)
        EXPECT_LE(plan.messages[i - 1].layer_group, plan.messages[i].layer_group);
    for (const auto& msg : plan.messages) EXPECT_EQ(msg.num_layers(), 1);
    check_exact(c, plan);
}

TEST(TransferPlan, DataParallelReplicas) {
    Case c{.model = llama_mini(),
           .from = "dp=2,tp=2",
           .to = "dp=3,tp=4",
           .tokens = 21,
           .dp_from = 1,
           .dp_to = 2};
    const auto plan = plan_of(c);
    for (const auto& msg : plan.messages) {
        EXPECT_EQ(plan.src.layout.ranks[msg.src_rank].coord.dp, 1);
        EXPECT_EQ(plan.dst.layout.ranks[msg.dst_rank].coord.dp, 2);
    }
    check_exact(c, plan);
}

TEST(TransferPlan, OneMessagePerPairAndGroup) {
    Case c{.model = llama_mini(5),
           .from = "tp=4,pp=2,cp=2",
           .to = "tp=8,pp=3,cp=3,cp_scheme=zigzag",
           .tokens = 150,
           .bs_from = 16,
           .bs_to = 32};
    const auto plan = plan_of(c);
    for (const auto& [pair, n] : pair_counts(plan)) EXPECT_EQ(n, 1);
    check_exact(c, plan);
}

// A prefix the destination already holds: exactly the tokens after it arrive, once, on every
// destination rank (CP schemes, replicated heads, block-size and page-order changes), and min_bytes
// counts only them.
TEST(TransferPlan, DestinationCachedPrefixIsNotSent) {
    const ModelSpec tiny = catalog_model("tiny");
    for (Case c : {Case{tiny, "tp=8", "tp=4"}, Case{tiny, "tp=2,pp=2", "pp=3,tp=2"},
                   Case{tiny, "cp=2,cp_scheme=zigzag", "cp=3,cp_scheme=interleave,cp_interleave=4"},
                   Case{tiny, "tp=1", "tp=2", 100, 16, 4, PageOrder::kNhd, PageOrder::kHnd}}) {
        const TransferPlan full = plan_of(c);
        for (int64_t k : {int64_t{0}, int64_t{16}, int64_t{37}, int64_t{99}}) {
            c.dst_cached = k;
            const TransferPlan plan = plan_of(c);
            check_exact(c, plan);
            EXPECT_EQ(plan.min_bytes * c.tokens, full.min_bytes * (c.tokens - k))
                << c.from << " -> " << c.to << " cached " << k;
        }
    }
    Case bad{tiny, "tp=1", "tp=1"};
    bad.dst_cached = bad.tokens;
    EXPECT_THROW(plan_of(bad), Error);
    bad.dst_cached = -1;
    EXPECT_THROW(plan_of(bad), Error);
}

TEST(TransferPlan, RejectsBadInput) {
    auto src = testing::make_endpoint(llama_mini(), "tp=8", 16, PageOrder::kHnd, 10);
    auto dst = testing::make_endpoint(llama_mini(5), "tp=4", 16, PageOrder::kHnd, 10);
    EXPECT_THROW(make_transfer_plan(src, dst, 10), Error);  // different layer counts
    dst = testing::make_endpoint(llama_mini(), "tp=4", 16, PageOrder::kHnd, 10);
    EXPECT_THROW(make_transfer_plan(src, dst, 0), Error);
    EXPECT_THROW(make_transfer_plan(src, dst, 100), Error);  // tables sized for 10 tokens
    dst.dp = 1;
    EXPECT_THROW(make_transfer_plan(src, dst, 10), Error);
    dst.dp = 0;
    dst.block_tables.clear();
    EXPECT_THROW(make_transfer_plan(src, dst, 10), Error);
    try {
        make_transfer_plan(
            src, testing::make_endpoint(catalog_model("tiny-mla"), "tp=2", 16, PageOrder::kHnd, 10),
            10);
        FAIL() << "expected an Error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("same model"), std::string::npos) << e.what();
    }
}

// A block table that names one block twice within the blocks its tokens need would put two token
// ranges in one block, the later overwriting the earlier: refused on either side, naming the id
// and both positions. Past the needed blocks (room the tokens do not use) anything goes.
TEST(TransferPlan, RejectsDuplicateBlockIds) {
    const ModelSpec tiny = catalog_model("tiny");
    // 32 tokens, tp=1 -> `to`, blocks of bs on both sides, with these tables.
    auto outcome = [&](const std::vector<std::vector<int32_t>>& src_tables,
                       const std::vector<std::vector<int32_t>>& dst_tables, int bs = 16,
                       const std::string& to = "tp=1") {
        auto src = testing::make_endpoint(tiny, "tp=1", bs, PageOrder::kHnd, 32);
        auto dst = testing::make_endpoint(tiny, to, bs, PageOrder::kHnd, 32);
        src.block_tables = src_tables;
        dst.block_tables = dst_tables;
        try {
            make_transfer_plan(src, dst, 32);
        } catch (const Error& e) {
            return std::string(e.what());
        }
        return std::string("accepted");
    };
    const std::string dst = outcome({{0, 1}}, {{5, 5}});
    EXPECT_NE(dst.find("the destination block table of CP rank 0 holds block 5 twice, at "
                       "positions 0 and 1 (the rank's tokens 0..15 and 16..31)"),
              std::string::npos)
        << dst;
    const std::string src = outcome({{9, 9}}, {{0, 1}});
    EXPECT_NE(src.find("the source block table of CP rank 0 holds block 9 twice"),
              std::string::npos)
        << src;
    // Not in order, blocks of 4 (8 needed): block 3 at positions 1 and 6.
    const std::string shuffled = outcome({{0, 1, 2, 3, 4, 5, 6, 7}}, {{8, 3, 0, 5, 7, 2, 3, 1}}, 4);
    EXPECT_NE(shuffled.find("holds block 3 twice, at positions 1 and 6 (the rank's tokens 4..7 "
                            "and 24..27)"),
              std::string::npos)
        << shuffled;
    EXPECT_EQ(outcome({{0, 1, 2, 3, 4, 5, 6, 7}}, {{8, 3, 0, 5, 7, 2, 6, 1}}, 4), "accepted");
    // Block 3 again at position 2, past the 2 blocks needed.
    EXPECT_EQ(outcome({{3, 7, 3}}, {{0, 1}}), "accepted");
    // cp=2 destination (16 tokens a rank, one block each): each rank's pool is its own, so the
    // same id on both ranks is fine.
    EXPECT_EQ(outcome({{0, 1}}, {{4}, {4}}, 16, "cp=2"), "accepted");
    const std::string cp = outcome({{0, 1, 2, 3}}, {{4, 5}, {2, 2, 2}}, 8, "cp=2");
    EXPECT_NE(cp.find("CP rank 1 holds block 2 twice, at positions 0 and 1"), std::string::npos)
        << cp;
}

TEST(TransferPlan, PackRejectsWrongPool) {
    Case c{.model = llama_mini(), .from = "tp=8", .to = "tp=4", .tokens = 16};
    const auto plan = plan_of(c);
    const auto& msg = plan.messages.front();
    BlockPool wrong(rank_page_geometry(plan.dst.layout, 0, 16, PageOrder::kHnd),
                    4);  // dst geometry
    std::vector<std::byte> buf(static_cast<size_t>(msg.bytes));
    EXPECT_THROW(pack_message(plan, msg, TransferMode::kPreSend, wrong, buf), Error);
    BlockPool right(rank_page_geometry(plan.src.layout, msg.src_rank, 16, PageOrder::kHnd), 4);
    std::vector<std::byte> short_buf(static_cast<size_t>(msg.bytes - 1));
    EXPECT_THROW(pack_message(plan, msg, TransferMode::kPreSend, right, short_buf), Error);
    EXPECT_NO_THROW(pack_message(plan, msg, TransferMode::kPreSend, right, buf));
    EXPECT_THROW(parse_transfer_mode("sideways"), Error);
}

// A direct read checks the source arena it is given against the source rank's geometry and the
// message's blocks before reading anything.
TEST(TransferPlan, CopyDirectRejectsWrongArena) {
    Case c{.model = llama_mini(), .from = "tp=8", .to = "tp=4", .tokens = 40};
    const auto plan = plan_of(c);
    const auto& msg = plan.messages.front();  // blocks 0..2 of its source
    const auto src = testing::make_source(plan.src, c.tokens);
    auto dst = testing::make_destination(plan.dst);
    const BlockPool& from = *src.pools[msg.src_rank];
    BlockPool& to = *dst.pools[msg.dst_rank];
    const auto bytes = static_cast<int64_t>(from.arena().size());
    const TransferMode mode = TransferMode::kPreSend;
    EXPECT_NO_THROW(
        copy_direct(plan, msg, mode, {from.arena().data(), bytes, from.num_blocks()}, to));
    try {
        copy_direct(plan, msg, mode, {from.arena().data(), bytes - 1, from.num_blocks()}, to);
        FAIL() << "expected an Error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("does not hold"), std::string::npos) << e.what();
    }
    try {
        copy_direct(plan, msg, mode, {from.arena().data(), bytes, 2}, to);
        FAIL() << "expected an Error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("outside its pool of 2 blocks"), std::string::npos)
            << e.what();
    }
    EXPECT_THROW(copy_direct(plan, msg, TransferMode::kAuto,
                             {from.arena().data(), bytes, from.num_blocks()}, to),
                 Error);
    BlockPool wrong_dst(from.geometry(), to.num_blocks());  // a source rank's geometry
    EXPECT_THROW(
        copy_direct(plan, msg, mode, {from.arena().data(), bytes, from.num_blocks()}, wrong_dst),
        Error);
}

TEST(TransferPlan, AutoModePicksFewerCopies) {
    // HND source, NHD destination, block 16 -> 64: the mode whose wire follows the side with more
    // scattered runs costs more; auto must pick the cheaper one and both must be valid.
    Case c{.model = llama_mini(),
           .from = "tp=8",
           .to = "tp=2",
           .tokens = 128,
           .order_from = PageOrder::kHnd,
           .order_to = PageOrder::kNhd};
    const auto plan = plan_of(c);
    const auto pre = count_copies(plan, TransferMode::kPreSend).total();
    const auto post = count_copies(plan, TransferMode::kPostReceive).total();
    const auto chosen = resolve_mode(plan, TransferMode::kAuto);
    // (A tie between different page orders goes to post-receive: the transpose in the unpack.)
    EXPECT_EQ(chosen, post <= pre ? TransferMode::kPostReceive : TransferMode::kPreSend);
    // Same page order on both sides with full blocks: every message is one run per (layer, kv,
    // piece).
    Case same{.model = llama_mini(), .from = "tp=4", .to = "tp=4", .tokens = 64};
    const auto p2 = plan_of(same);
    EXPECT_EQ(count_copies(p2, TransferMode::kPreSend).pack, 4 * 4 * 2 * 1);  // pages 0..3 adjacent
}

// ---- property test over random layout pairs --------------------------------------------------

std::string random_parallel(std::mt19937_64& rng, const ModelSpec& m, int max_world) {
    auto pick = [&](const std::vector<int>& v) { return v[rng() % v.size()]; };
    for (;;) {
        const auto tps = valid_tp_sizes(m);
        const int tp = pick(tps);
        const int pp = 1 + static_cast<int>(rng() % std::min(3, m.num_layers));
        const int cp = pick({1, 1, 2, 3, 4});
        const int dp = pick({1, 1, 2});
        if (tp * pp * cp * dp > max_world) continue;
        std::string s = "tp=" + std::to_string(tp) + ",pp=" + std::to_string(pp) +
                        ",cp=" + std::to_string(cp) + ",dp=" + std::to_string(dp);
        if (cp > 1) {
            const int scheme = static_cast<int>(rng() % 3);
            s += scheme == 0   ? ",cp_scheme=contiguous"
                 : scheme == 1 ? ",cp_scheme=zigzag"
                               : ",cp_scheme=interleave";
            if (scheme == 2) s += ",cp_interleave=" + std::to_string(pick({1, 4, 16}));
        }
        if (pp > 1 && rng() % 2 == 0) {
            // A random uneven split.
            std::vector<int> split(pp, 1);
            for (int l = pp; l < m.num_layers; ++l) ++split[rng() % pp];
            s += ",pp_layers=";
            for (int i = 0; i < pp; ++i) s += (i ? "/" : "") + std::to_string(split[i]);
        }
        return s;
    }
}

TEST(TransferPlan, PropertyRandomLayoutPairs) {
    std::mt19937_64 rng(20261130);
    const std::vector<ModelSpec> models = {catalog_model("tiny"), catalog_model("tiny-mla"),
                                           llama_mini(5), llama_mini(3, 1, 8) /* MQA */,
                                           llama_mini(3, 32, 4) /* MHA */};
    const int kCases = 40;
    int unit_messages = 0;  // over all cases
    for (int i = 0; i < kCases; ++i) {
        const ModelSpec& m = models[rng() % models.size()];
        Case c;
        c.model = m;
        c.from = random_parallel(rng, m, 32);
        c.to = random_parallel(rng, m, 32);
        c.tokens = 1 + static_cast<int64_t>(rng() % 300);
        const std::vector<int> sizes = {1, 4, 5, 16, 64};
        c.bs_from = sizes[rng() % sizes.size()];
        c.bs_to = sizes[rng() % sizes.size()];
        c.order_from = rng() % 2 ? PageOrder::kHnd : PageOrder::kNhd;
        c.order_to = rng() % 2 ? PageOrder::kHnd : PageOrder::kNhd;
        c.dp_from = static_cast<int>(rng() % parse_parallel_config(c.from).dp);
        c.dp_to = static_cast<int>(rng() % parse_parallel_config(c.to).dp);
        c.layers_per_group = static_cast<int>(rng() % 3);
        c.shuffle = rng() % 2 ? rng() | 1 : 0;
        SCOPED_TRACE("case " + std::to_string(i));
        const auto plan = plan_of(c);
        // Coalesced: one message per (src, dst, layer group).
        std::set<std::tuple<int, int, int>> keys;
        for (const auto& msg : plan.messages)
            EXPECT_TRUE(keys.insert({msg.layer_group, msg.src_rank, msg.dst_rank}).second);
        // The copies of a source head group share its load: none sends more than an even share
        // plus one token of its group's largest (source, destination) pair, the most rounding a
        // split to whole tokens can add.
        const KvLayout& sl = plan.src.layout;
        const int copies = sl.head_replication();
        std::map<std::pair<int, int>, std::pair<int64_t, int64_t>> pair_load;  // bytes, tokens
        for (const auto& msg : plan.messages) {
            auto& p = pair_load[{msg.src_rank, msg.dst_rank}];
            p.first += msg.bytes;
            p.second = msg.num_tokens;  // the same in every layer group of a pair
        }
        std::map<std::tuple<int, int, int>, std::map<int, int64_t>> copy_groups;
        std::map<std::tuple<int, int, int>, int64_t> token_bytes;
        for (const auto& [pair, load] : pair_load) {
            const RankCoord& rc = sl.ranks[pair.first].coord;
            const std::tuple<int, int, int> key{rc.pp, rc.cp, rc.tp / copies};
            copy_groups[key][pair.first] += load.first;
            token_bytes[key] = std::max(token_bytes[key], load.first / load.second);
        }
        for (const auto& [key, loads] : copy_groups) {
            int64_t total = 0;
            for (const auto& [r, b] : loads) total += b;
            for (const auto& [r, b] : loads)
                EXPECT_LE(b, (total + copies - 1) / copies + token_bytes[key]) << "source " << r;
        }
        int units = 0;
        check_exact(c, plan, &units);
        unit_messages += units;
        if (::testing::Test::HasFailure()) break;
    }
    EXPECT_GT(unit_messages, 0);  // some pairs read whole sealed blocks
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// Batched pack/unpack (one pass over a rank's pages for all its messages of a layer range) gives
// the same payloads and the same destination pools as one call per message.
TEST(TransferPlan, BatchedPackUnpackMatchesPerMessage) {
    const std::vector<Case> cases = {
        {.model = llama_mini(), .from = "tp=8", .to = "tp=4", .tokens = 77},
        {.model = llama_mini(),
         .from = "tp=2",
         .to = "tp=8",
         .tokens = 50,
         .bs_from = 4,
         .bs_to = 16},
        {.model = llama_mini(5),
         .from = "tp=4,pp=2",
         .to = "tp=2,pp=3,cp=2,cp_scheme=zigzag",
         .tokens = 90,
         .order_from = PageOrder::kNhd,
         .layers_per_group = 1,
         .shuffle = 9},
        {.model = llama_mini(),
         .from = "tp=16",
         .to = "tp=2",
         .tokens = 33,
         .order_to = PageOrder::kNhd},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.from + " -> " + c.to);
        const auto plan = plan_of(c);
        const auto src = testing::make_source(plan.src, c.tokens);
        for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive}) {
            auto one = testing::make_destination(plan.dst);
            auto batched = testing::make_destination(plan.dst);
            testing::run_plan(plan, mode, src, one);
            // Batches: (source rank, layer range) for pack; (destination rank, layer range) for
            // unpack.
            std::map<std::tuple<int, int, int>, std::vector<const TransferMessage*>> by_src;
            for (const auto& m : plan.messages)
                by_src[{m.src_rank, m.layer_begin, m.layer_end}].push_back(&m);
            std::map<const TransferMessage*, std::vector<std::byte>> payload;
            for (auto& [key, msgs] : by_src) {
                std::vector<std::span<std::byte>> outs;
                for (const auto* m : msgs) {
                    payload[m].assign(static_cast<size_t>(m->bytes), std::byte{0});
                    outs.push_back(payload[m]);
                }
                pack_messages(plan, msgs, mode, *src.pools[std::get<0>(key)], outs);
                for (const auto* m : msgs) {
                    std::vector<std::byte> single(static_cast<size_t>(m->bytes));
                    pack_message(plan, *m, mode, *src.pools[m->src_rank], single);
                    EXPECT_TRUE(single == payload[m])
                        << "message " << m->src_rank << "->" << m->dst_rank;
                }
            }
            std::map<std::tuple<int, int, int>, std::vector<const TransferMessage*>> by_dst;
            for (const auto& m : plan.messages)
                by_dst[{m.dst_rank, m.layer_begin, m.layer_end}].push_back(&m);
            for (auto& [key, msgs] : by_dst) {
                std::vector<std::span<const std::byte>> ins;
                for (const auto* m : msgs) ins.push_back(payload[m]);
                unpack_messages(plan, msgs, mode, ins, *batched.pools[std::get<0>(key)]);
            }
            for (size_t r = 0; r < one.pools.size(); ++r) {
                if (!one.pools[r]) continue;
                EXPECT_TRUE(std::equal(one.pools[r]->arena().begin(), one.pools[r]->arena().end(),
                                       batched.pools[r]->arena().begin()))
                    << "dst rank " << r;
            }
        }
    }
}

}  // namespace
}  // namespace kvshard
