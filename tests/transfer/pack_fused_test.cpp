// Pack and unpack with the copy kernel at real vector sizes (256-byte head_dim vectors: 4 KiB runs
// per head and page, non-temporal stores, prefetch ahead), and with the checksum computed while
// copying: the fused XXH3_64 equals XXH3_64bits of the payload, a corrupted payload is detected,
// and a destination's batch unpacked in any message order gives the same pool and the same
// checksums.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <map>
#include <random>
#include <tuple>

#include "transfer_harness.h"

namespace kvshard {
namespace {

struct Case {
    std::string from, to;
    int bs_from = 16, bs_to = 16;
    PageOrder order_from = PageOrder::kHnd, order_to = PageOrder::kHnd;
    int64_t tokens = 200;
};

// fp32 head_dim 64: 256-byte vectors, as bf16 head_dim 128 (llama-3.1-8b).
const ModelSpec kModel = testing::llama_mini(2, 8, 64);

TransferPlan plan_of(const Case& c) {
    return make_transfer_plan(
        testing::make_endpoint(kModel, c.from, c.bs_from, c.order_from, c.tokens),
        testing::make_endpoint(kModel, c.to, c.bs_to, c.order_to, c.tokens), c.tokens);
}

const std::vector<Case> kCases = {
    {.from = "tp=8", .to = "tp=4"},
    {.from = "tp=2", .to = "tp=8"},
    {.from = "tp=8", .to = "tp=4", .bs_from = 16, .bs_to = 64},
    {.from = "tp=8",
     .to = "tp=4",
     .order_from = PageOrder::kNhd,
     .order_to = PageOrder::kNhd,
     .tokens = 190},
    {.from = "tp=2", .to = "tp=2", .order_to = PageOrder::kNhd},
    {.from = "tp=4,pp=2", .to = "tp=1", .bs_from = 32, .bs_to = 16, .tokens = 77},
};

using Payloads = std::map<const TransferMessage*, std::vector<std::byte>>;
using Batches = std::map<std::tuple<int, int, int>, std::vector<const TransferMessage*>>;

// Packs all messages, batched per (source rank, layer range), with fused checksums.
Payloads pack_all(const TransferPlan& plan, TransferMode mode, const testing::Side& src,
                  std::map<const TransferMessage*, uint64_t>& sums) {
    Batches by_src;
    for (const auto& m : plan.messages)
        by_src[{m.src_rank, m.layer_begin, m.layer_end}].push_back(&m);
    Payloads payload;
    for (auto& [key, msgs] : by_src) {
        std::vector<std::span<std::byte>> outs;
        for (const auto* m : msgs) {
            payload[m].assign(static_cast<size_t>(m->bytes), std::byte{0});
            outs.push_back(payload[m]);
        }
        std::vector<uint64_t> s(msgs.size());
        pack_messages(plan, msgs, mode, *src.pools[std::get<0>(key)], outs, s);
        for (size_t k = 0; k < msgs.size(); ++k) sums[msgs[k]] = s[k];
    }
    return payload;
}

Batches by_destination(const TransferPlan& plan) {
    Batches by_dst;
    for (const auto& m : plan.messages)
        by_dst[{m.dst_rank, m.layer_begin, m.layer_end}].push_back(&m);
    return by_dst;
}

TEST(PackFused, ChecksumIsXxh3OfPayloadAndPoolsExact) {
    for (const Case& c : kCases) {
        SCOPED_TRACE(c.from + " -> " + c.to);
        const TransferPlan plan = plan_of(c);
        const auto src = testing::make_source(plan.src, c.tokens);
        for (TransferMode mode : {TransferMode::kPreSend, TransferMode::kPostReceive}) {
            SCOPED_TRACE(std::string(transfer_mode_name(mode)));
            std::map<const TransferMessage*, uint64_t> packed;
            Payloads payload = pack_all(plan, mode, src, packed);
            for (const auto& [m, bytes] : payload) {
                EXPECT_EQ(packed[m], XXH3_64bits(bytes.data(), bytes.size()));
                std::vector<std::byte> single(bytes.size());
                pack_message(plan, *m, mode, *src.pools[m->src_rank], single);
                EXPECT_TRUE(single == bytes);
            }
            auto dst = testing::make_destination(plan.dst);
            for (auto& [key, msgs] : by_destination(plan)) {
                std::vector<std::span<const std::byte>> ins;
                for (const auto* m : msgs) ins.push_back(payload[m]);
                std::vector<uint64_t> got(msgs.size());
                unpack_messages(plan, msgs, mode, ins, *dst.pools[std::get<0>(key)], got);
                for (size_t k = 0; k < msgs.size(); ++k) EXPECT_EQ(got[k], packed[msgs[k]]);
            }
            for (size_t r = 0; r < dst.pools.size(); ++r) {
                const auto want =
                    testing::expected_pool(plan.dst, static_cast<int>(r), c.tokens, *dst.pools[r]);
                const auto a = dst.pools[r]->arena();
                EXPECT_EQ(std::memcmp(a.data(), want.data(), a.size()), 0) << "dst rank " << r;
            }
        }
    }
}

TEST(PackFused, CorruptedPayloadIsDetectedOnlyInItsMessage) {
    const TransferPlan plan = plan_of(kCases[0]);  // tp=8 -> tp=4: 2 messages per destination
    const auto src = testing::make_source(plan.src, kCases[0].tokens);
    const TransferMode mode = TransferMode::kPreSend;
    std::map<const TransferMessage*, uint64_t> packed;
    Payloads payload = pack_all(plan, mode, src, packed);
    std::mt19937 rng(5);
    for (auto& [key, msgs] : by_destination(plan)) {
        ASSERT_GE(msgs.size(), 2u);
        const size_t bad = rng() % msgs.size();
        auto& p = payload[msgs[bad]];
        p[rng() % p.size()] ^= std::byte{0x01};  // one bit anywhere
        auto dst = testing::make_destination(plan.dst);
        std::vector<std::span<const std::byte>> ins;
        for (const auto* m : msgs) ins.push_back(payload[m]);
        std::vector<uint64_t> got(msgs.size());
        unpack_messages(plan, msgs, mode, ins, *dst.pools[std::get<0>(key)], got);
        for (size_t k = 0; k < msgs.size(); ++k) {
            if (k == bad)
                EXPECT_NE(got[k], packed[msgs[k]]);
            else
                EXPECT_EQ(got[k], packed[msgs[k]]);
        }
    }
}

TEST(PackFused, UnpackOrderDoesNotMatter) {
    for (const Case& c : {kCases[0], kCases[3]}) {
        SCOPED_TRACE(c.from + " -> " + c.to);
        const TransferPlan plan = plan_of(c);
        const auto src = testing::make_source(plan.src, c.tokens);
        const TransferMode mode = TransferMode::kPreSend;
        std::map<const TransferMessage*, uint64_t> packed;
        Payloads payload = pack_all(plan, mode, src, packed);
        auto in_order = testing::make_destination(plan.dst);
        auto reversed = testing::make_destination(plan.dst);
        auto batches = by_destination(plan);
        // Forward: one batch per destination; reversed: the batches in reverse order and each
        // batch's messages reversed, as a receiver may see them arrive.
        for (auto& [key, msgs] : batches) {
            std::vector<std::span<const std::byte>> ins;
            for (const auto* m : msgs) ins.push_back(payload[m]);
            unpack_messages(plan, msgs, mode, ins, *in_order.pools[std::get<0>(key)]);
        }
        for (auto it = batches.rbegin(); it != batches.rend(); ++it) {
            std::vector<const TransferMessage*> msgs(it->second.rbegin(), it->second.rend());
            std::vector<std::span<const std::byte>> ins;
            for (const auto* m : msgs) ins.push_back(payload[m]);
            std::vector<uint64_t> got(msgs.size());
            unpack_messages(plan, msgs, mode, ins, *reversed.pools[std::get<0>(it->first)], got);
            for (size_t k = 0; k < msgs.size(); ++k) EXPECT_EQ(got[k], packed[msgs[k]]);
        }
        for (size_t r = 0; r < in_order.pools.size(); ++r) {
            const auto a = in_order.pools[r]->arena(), b = reversed.pools[r]->arena();
            EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin())) << "dst rank " << r;
        }
    }
}

}  // namespace
}  // namespace kvshard
