#include <gtest/gtest.h>

#include <limits>

#include <map>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "kvshard/cache/block_manager.h"
#include "kvshard/common/error.h"
#include "kvshard/router/kv_index.h"
#include "kvshard/router/policy.h"

namespace kvshard {
namespace {

BlockHash h(uint64_t id) { return BlockHash{id * 0x9E3779B97F4A7C15ull + 1, id}; }

std::vector<BlockHash> chain(std::initializer_list<uint64_t> ids) {
    std::vector<BlockHash> out;
    for (uint64_t id : ids) out.push_back(h(id));
    return out;
}

std::vector<int> overlaps(const KvIndex& idx, const std::vector<BlockHash>& q) {
    std::vector<int> out(static_cast<size_t>(idx.num_replicas()), -1);
    idx.prefix_overlap(q, out);
    return out;
}

// ---------------------------------------------------------------- KvIndex

TEST(KvIndex, ExactEventsGivePrefixOverlaps) {
    KvIndex idx(3);
    idx.block_stored(0, chain({1, 2, 3}));
    idx.block_stored(1, chain({1, 2}));
    idx.block_stored(2, chain({2, 3}));  // no block 1: its chain is useless for this query
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4})), (std::vector<int>{3, 2, 0}));
    EXPECT_EQ(overlaps(idx, chain({9})), (std::vector<int>{0, 0, 0}));
    EXPECT_EQ(overlaps(idx, {}), (std::vector<int>{0, 0, 0}));
    EXPECT_EQ(idx.num_blocks(0), 3);
    // A second block of the same hash (vLLM registers copies): one more block, the same prefix.
    idx.block_stored(0, chain({1}));
    EXPECT_EQ(idx.num_blocks(0), 4);
    idx.block_removed(0, chain({2}));
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3})), (std::vector<int>{1, 2, 0}));
    idx.block_removed(1, chain({7}));  // not held: harmless
    EXPECT_EQ(idx.num_blocks(1), 2);
    idx.all_cleared(1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3})), (std::vector<int>{1, 0, 0}));
    EXPECT_EQ(idx.num_blocks(1), 0);
    EXPECT_TRUE(idx.contains(2, h(3)));
    EXPECT_FALSE(idx.contains(1, h(1)));
}

TEST(KvIndex, RejectsBadReplicaCounts) {
    EXPECT_THROW(KvIndex(0), Error);
    EXPECT_THROW(KvIndex(KvIndex::kMaxReplicas + 1), Error);
    EXPECT_THROW(KvIndex(2, KvIndexMode::kApproximate, 0.0), Error);
    KvIndex all(KvIndex::kMaxReplicas);
    all.block_stored(63, chain({5, 6}));
    EXPECT_EQ(overlaps(all, chain({5, 6}))[63], 2);
    EXPECT_EQ(overlaps(all, chain({5, 6}))[0], 0);
}

TEST(KvIndex, ApproximateModeForgetsAfterTtlUnlessRefreshed) {
    KvIndex idx(2, KvIndexMode::kApproximate, 10.0);
    idx.record_routed(0, chain({1, 2}), 0.0);
    idx.record_routed(1, chain({1}), 5.0);
    EXPECT_EQ(overlaps(idx, chain({1, 2})), (std::vector<int>{2, 1}));
    idx.record_routed(0, chain({1}), 8.0);  // refreshes block 1 on replica 0 until 18
    idx.expire(10.0);                       // block 2 on replica 0 expires (recorded at 0)
    EXPECT_EQ(overlaps(idx, chain({1, 2})), (std::vector<int>{1, 1}));
    idx.expire(15.0);  // replica 1's block 1 (recorded at 5)
    EXPECT_EQ(overlaps(idx, chain({1, 2})), (std::vector<int>{1, 0}));
    idx.expire(18.0);
    EXPECT_EQ(overlaps(idx, chain({1, 2})), (std::vector<int>{0, 0}));
    EXPECT_EQ(idx.num_hashes(), 0);
}

// Randomized: the index against a naive set-per-replica reference.
TEST(KvIndex, MatchesNaiveReferenceUnderRandomEvents) {
    std::mt19937_64 rng(42);
    const int n = 5;
    KvIndex idx(n);
    std::vector<std::multiset<uint64_t>> ref(n);  // copies: a hash stored twice, removed twice
    for (int step = 0; step < 4000; ++step) {
        const int r = static_cast<int>(rng() % n);
        const uint64_t id = rng() % 40;
        switch (rng() % 8) {
            case 0:
            case 1:
            case 2:
            case 3:
                idx.block_stored(r, chain({id}));
                ref[r].insert(id);
                break;
            case 4:
            case 5:
            case 6:
                idx.block_removed(r, chain({id}));
                if (const auto it = ref[r].find(id); it != ref[r].end()) ref[r].erase(it);
                break;
            default:
                if (rng() % 20 == 0) {
                    idx.all_cleared(r);
                    ref[r].clear();
                }
        }
        std::vector<BlockHash> q;
        std::vector<uint64_t> qi;
        for (int k = 0; k < 6; ++k) {
            qi.push_back(rng() % 40);
            q.push_back(h(qi.back()));
        }
        const auto got = overlaps(idx, q);
        for (int i = 0; i < n; ++i) {
            int want = 0;
            while (want < 6 && ref[i].count(qi[static_cast<size_t>(want)])) ++want;
            ASSERT_EQ(got[static_cast<size_t>(i)], want) << "step " << step << " replica " << i;
            ASSERT_EQ(idx.num_blocks(i), static_cast<int64_t>(ref[i].size()));
        }
    }
}

// ---------------------------------------------------------------- policies

struct Case {
    std::vector<BlockHash> blocks;
    std::vector<int> overlap;
    std::vector<ReplicaLoad> loads;
};

RouteDecision decide(RoutingPolicy p, const Case& c, uint64_t rr = 0, PolicyParams params = {}) {
    params.block_tokens = 16;
    return decide_route(p, params, {c.blocks, static_cast<int64_t>(c.blocks.size()) * 16},
                        c.overlap, c.loads, rr);
}

ReplicaLoad load(int64_t queued_tokens, int64_t active_blocks, int64_t capacity = 0) {
    return {queued_tokens, active_blocks, capacity};
}

TEST(Policy, NamesRoundTripAndUnknownIsAnError) {
    for (RoutingPolicy p : all_routing_policies())
        EXPECT_EQ(parse_routing_policy(routing_policy_name(p)), p);
    EXPECT_THROW(parse_routing_policy("random"), Error);
    EXPECT_EQ(all_routing_policies().size(), 5u);
}

TEST(Policy, MismatchedInputsAreErrors) {
    Case c{chain({1}), {0, 0}, {load(0, 0)}};
    EXPECT_THROW(decide(RoutingPolicy::kLeastLoaded, c), Error);
    Case empty{chain({1}), {}, {}};
    EXPECT_THROW(decide(RoutingPolicy::kRoundRobin, empty), Error);
}

TEST(Policy, RoundRobinCycles) {
    Case c{chain({1}), {1, 0, 0}, {load(0, 0), load(0, 0), load(0, 0)}};
    for (uint64_t i = 0; i < 7; ++i) {
        const auto d = decide(RoutingPolicy::kRoundRobin, c, i);
        EXPECT_EQ(d.replica, static_cast<int>(i % 3));
        EXPECT_EQ(d.reason, RouteReason::kRoundRobin);
    }
    EXPECT_EQ(decide(RoutingPolicy::kRoundRobin, c, 0).matched_blocks, 1);
}

TEST(Policy, LeastLoadedCountsQueuedPrefillAndActiveBlocks) {
    // Loads in blocks of 16 tokens: 0 + 10, ceil(33/16)=3 + 5 = 8, 0 + 9.
    Case c{chain({1}), {0, 0, 0}, {load(0, 10), load(33, 5), load(0, 9)}};
    EXPECT_EQ(decide(RoutingPolicy::kLeastLoaded, c).replica, 1);
    // Capacity scaling (mean capacity 200): replica 0 has twice the mean memory, so its 10 blocks
    // count as 5; replica 1's 5 blocks count as 10, replica 2's 9 as 18.
    Case cap{chain({1}), {0, 0, 0}, {load(0, 10, 400), load(0, 5, 100), load(0, 9, 100)}};
    EXPECT_NEAR(effective_load_blocks(cap.loads[0], 16, 200.0), 5.0, 1e-12);
    EXPECT_EQ(decide(RoutingPolicy::kLeastLoaded, cap).replica, 0);
    cap.loads[0].active_blocks = 30;  // 15 > 10
    EXPECT_EQ(decide(RoutingPolicy::kLeastLoaded, cap).replica, 1);
}

TEST(Policy, TiesRotateWithTheCounter) {
    // Idle cluster: least-loaded, cache-aware and cost all tie; the rotation spreads requests.
    Case c{chain({1, 2}), {0, 0, 0, 0}, {load(0, 0), load(0, 0), load(0, 0), load(0, 0)}};
    for (RoutingPolicy p :
         {RoutingPolicy::kLeastLoaded, RoutingPolicy::kCacheAware, RoutingPolicy::kCost})
        for (uint64_t rr = 0; rr < 8; ++rr)
            EXPECT_EQ(decide(p, c, rr).replica, static_cast<int>(rr % 4));
    // A tie among the best matches: equal overlap, lower load wins, then rotation.
    Case t{chain({1, 2}), {2, 2, 0}, {load(0, 3), load(0, 3), load(0, 0)}};
    EXPECT_EQ(decide(RoutingPolicy::kCacheAware, t, 0).replica, 0);
    EXPECT_EQ(decide(RoutingPolicy::kCacheAware, t, 1).replica, 1);
    EXPECT_EQ(decide(RoutingPolicy::kCacheAware, t, 2).replica, 0);  // rotation 2,0,1: 0 first
    t.loads[0].active_blocks = 4;
    EXPECT_EQ(decide(RoutingPolicy::kCacheAware, t, 0).replica, 1);
}

TEST(Policy, CacheAwareFollowsTheBestMatchUntilTheLoadIsImbalanced) {
    PolicyParams p;
    p.balance_abs_threshold = 64;
    p.balance_rel_threshold = 1.5;
    p.cache_threshold = 0.3;
    Case c{chain({1, 2, 3, 4}), {1, 4, 0}, {load(0, 50), load(0, 100), load(0, 40)}};
    // max - min = 60 <= 64: balanced, best match.
    auto d = decide(RoutingPolicy::kCacheAware, c, 0, p);
    EXPECT_EQ(d.replica, 1);
    EXPECT_EQ(d.reason, RouteReason::kBestMatch);
    EXPECT_EQ(d.matched_blocks, 4);
    // The best match overloaded: max - min = 160 > 64 and 200 > 1.5 * 40: least loaded.
    c.loads[1].active_blocks = 200;
    d = decide(RoutingPolicy::kCacheAware, c, 0, p);
    EXPECT_EQ(d.replica, 2);
    EXPECT_EQ(d.reason, RouteReason::kImbalanced);
    // Absolute gap passed but not the relative one (1000 + 1100 vs min 1000): still the best match.
    c.loads = {load(0, 1050), load(0, 1100), load(0, 1000)};
    EXPECT_EQ(decide(RoutingPolicy::kCacheAware, c, 0, p).replica, 1);
    // Relative passed, absolute not (10 vs 4): best match.
    c.loads = {load(0, 5), load(0, 10), load(0, 4)};
    EXPECT_EQ(decide(RoutingPolicy::kCacheAware, c, 0, p).replica, 1);
    // Match ratio 1/4 < 0.3: least loaded (replica 2), even though replica 0 matches one block.
    c.overlap = {1, 1, 0};
    d = decide(RoutingPolicy::kCacheAware, c, 0, p);
    EXPECT_EQ(d.replica, 2);
    EXPECT_EQ(d.reason, RouteReason::kLeastLoaded);
}

TEST(Policy, CostWeighsBlocksToPrefillAgainstActiveBlocks) {
    // 10-block request. cost = w * (queued blocks + 10 - overlap) + active.
    std::vector<BlockHash> ten = chain({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
    Case c{ten, {8, 0, 2}, {load(0, 30), load(0, 22), load(32, 20)}};
    // w = 1: r0 = 2 + 30 = 32; r1 = 10 + 22 = 32; r2 = (2 + 8) + 20 = 30 -> r2.
    auto d = decide(RoutingPolicy::kCost, c);
    EXPECT_EQ(d.replica, 2);
    EXPECT_EQ(d.reason, RouteReason::kLowestCost);
    // w = 2: r0 = 4 + 30 = 34; r1 = 20 + 22 = 42; r2 = 20 + 20 = 40 -> r0.
    PolicyParams p;
    p.overlap_weight = 2.0;
    EXPECT_EQ(decide(RoutingPolicy::kCost, c, 0, p).replica, 0);
    // Tie between r0 and r1 at w = 1 once r2 is heavier: rotation decides.
    c.loads[2].active_blocks = 100;
    EXPECT_EQ(decide(RoutingPolicy::kCost, c, 0).replica, 0);
    EXPECT_EQ(decide(RoutingPolicy::kCost, c, 1).replica, 1);
}

// The first replica in rendezvous order of the request's hash at position `pos`.
int rendezvous_first(const std::vector<BlockHash>& blocks, int n, int pos = 1) {
    const int p = std::min(pos, static_cast<int>(blocks.size()) - 1);
    const BlockHash& b = blocks[static_cast<size_t>(p)];
    const uint64_t key = rendezvous_score(b.lo ^ (b.hi * 0xC2B2AE3D27D4EB4Full), p);
    int best = 0;
    for (int r = 1; r < n; ++r)
        if (rendezvous_score(key, r) > rendezvous_score(key, best)) best = r;
    return best;
}

TEST(Policy, KvshardColdStartIsConsistentPerConversation) {
    const int n = 8;
    Case c{chain({0, 100, 101}), std::vector<int>(n, 0), std::vector<ReplicaLoad>(n)};
    const int first = rendezvous_first(c.blocks, n);
    // Idle cluster, nothing cached: every replica ties; rendezvous order breaks the tie.
    auto d = decide(RoutingPolicy::kKvshard, c);
    EXPECT_EQ(d.replica, first);
    EXPECT_EQ(d.reason, RouteReason::kLeastLoaded);
    // The same conversation's next turn (same first two blocks) picks the same replica, whatever
    // the rotation counter.
    Case next{chain({0, 100, 101, 102, 103}), std::vector<int>(n, 0), std::vector<ReplicaLoad>(n)};
    for (uint64_t rr = 0; rr < 4; ++rr)
        EXPECT_EQ(decide(RoutingPolicy::kKvshard, next, rr).replica, first);
    // Different conversations spread over every replica.
    std::set<int> used;
    for (uint64_t conv = 0; conv < 200; ++conv) {
        Case k{chain({0, 1000 + conv}), std::vector<int>(n, 0), std::vector<ReplicaLoad>(n)};
        used.insert(decide(RoutingPolicy::kKvshard, k).replica);
    }
    EXPECT_EQ(static_cast<int>(used.size()), n);
    // Not idle: a cold request goes to the least loaded replica.
    Case busy{chain({0, 100}), std::vector<int>(n, 0), std::vector<ReplicaLoad>(n, load(0, 10))};
    busy.loads[5].active_blocks = 3;
    EXPECT_EQ(decide(RoutingPolicy::kKvshard, busy).replica, 5);
}

TEST(Policy, KvshardFollowsAConversationButNotASharedSystemPrompt) {
    const int n = 4;
    Case c{chain({0, 7, 8, 9}), {0, 0, 0, 0}, std::vector<ReplicaLoad>(n, load(0, 10))};
    c.loads[2].active_blocks = 5;  // the least loaded
    // Replica 0 holds only the system prompt: one block more than the least loaded, not worth it.
    c.overlap[0] = 1;
    auto d = decide(RoutingPolicy::kKvshard, c);
    EXPECT_EQ(d.replica, 2);
    EXPECT_EQ(d.reason, RouteReason::kLeastLoaded);
    // Replica 0 holds the conversation (3 blocks): follow it.
    c.overlap[0] = 3;
    d = decide(RoutingPolicy::kKvshard, c);
    EXPECT_EQ(d.replica, 0);
    EXPECT_EQ(d.reason, RouteReason::kBestMatch);
    EXPECT_EQ(d.matched_blocks, 3);
    // A tie in overlap: the lower load wins.
    c.overlap[3] = 3;
    c.loads[3].active_blocks = 8;
    EXPECT_EQ(decide(RoutingPolicy::kKvshard, c).replica, 3);
}

TEST(Policy, KvshardSpillsAnOverloadedBestMatch) {
    PolicyParams p;
    p.load_slack = 0.25;
    p.load_headroom_tokens = 16 * 4;  // 4 blocks of 16 tokens
    Case c{chain({0, 7, 8, 9}), {4, 0, 2, 0}, {load(0, 40), load(0, 10), load(0, 12), load(0, 10)}};
    // mean = 72 / 4 = 18, bound = 1.25 * 18 + 4 = 26.5 < 40: replica 0 is out. The longest
    // allowed overlap is replica 2's (2 blocks, a gain of 2 over the least loaded): it spills
    // there.
    auto d = decide(RoutingPolicy::kKvshard, c, 0, p);
    EXPECT_EQ(d.replica, 2);
    EXPECT_EQ(d.reason, RouteReason::kSpill);
    // Without that partial copy: the least loaded of 1 and 3 (a tie: rendezvous order).
    c.overlap[2] = 0;
    d = decide(RoutingPolicy::kKvshard, c, 0, p);
    EXPECT_TRUE(d.replica == 1 || d.replica == 3);
    EXPECT_EQ(d.reason, RouteReason::kSpill);
    EXPECT_EQ(d.replica, decide(RoutingPolicy::kKvshard, c, 1, p).replica);  // not rotation
    // Within the bound (40 <= 1.25 * 18 + 30): the best match keeps it.
    p.load_headroom_tokens = 16 * 30;
    d = decide(RoutingPolicy::kKvshard, c, 0, p);
    EXPECT_EQ(d.replica, 0);
    EXPECT_EQ(d.reason, RouteReason::kBestMatch);
}

TEST(Policy, KvshardPlacesColdRequestsAwayFromQueuedPrefill) {
    // Equal plain load (40 blocks): replica 0 decodes 40 active blocks, replica 1 has 40 blocks of
    // prompt queued. A cold request waits behind the queue on 1, not on 0.
    Case c{chain({0, 5}), {0, 0}, {load(0, 40), load(40 * 16, 0)}};
    PolicyParams p;
    EXPECT_EQ(decide(RoutingPolicy::kKvshard, c, 0, p).replica, 0);
    p.prefill_weight = 1;  // a plain tie: rendezvous order
    EXPECT_EQ(decide(RoutingPolicy::kKvshard, c, 0, p).replica, rendezvous_first(c.blocks, 2));
}

// ---------------------------------------------------------------- Router

TEST(Router, ExactIndexFollowsEventsAndRotates) {
    Router r(3, RoutingPolicy::kCacheAware);
    std::vector<ReplicaLoad> loads(3);
    const auto q = chain({1, 2, 3});
    // Cold: least loaded with rotation 0, 1, 2.
    EXPECT_EQ(r.route({q, 3 * 512}, loads, 0.0).replica, 0);
    EXPECT_EQ(r.route({q, 3 * 512}, loads, 0.0).replica, 1);
    // Replica 2 publishes that it stored the blocks: the next request follows them.
    r.index().block_stored(2, q);
    const auto d = r.route({q, 3 * 512 + 1}, loads, 0.0);
    EXPECT_EQ(d.replica, 2);
    EXPECT_EQ(d.matched_blocks, 3);
    // A prompt of exactly 3 blocks: vLLM recomputes its last token, so the hit is 2 blocks.
    EXPECT_EQ(r.route({q, 3 * 512}, loads, 0.0).matched_blocks, 2);
    EXPECT_THROW(r.route({q, 3 * 512}, std::vector<ReplicaLoad>(2), 0.0), Error);
}

TEST(Router, RefusesMoreHashesThanTheTokenCountHasBlocks) {
    Router r(2, RoutingPolicy::kCacheAware);
    std::vector<ReplicaLoad> loads(2);
    const auto q = chain({1, 2, 3});
    r.index().block_stored(1, q);
    // A trace's hash_ids: one per full block and one for the partial last block (ceil).
    EXPECT_EQ(r.route({q, 2 * 512 + 1}, loads, 0.0).matched_blocks, 2);
    // Fewer hashes than blocks: a prefix of the prompt.
    EXPECT_EQ(r.route({std::span(q).first(2), 3 * 512 + 1}, loads, 0.0).matched_blocks, 2);
    // num_tokens 0 (forgotten) would silently make every hit 0: refused, saying what fits.
    try {
        r.route({q, 0}, loads, 0.0);
        FAIL() << "a token count of 0 with 3 hashes was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("3 block hashes for a prompt of 0 tokens"),
                  std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("at most 0"), std::string::npos) << e.what();
    }
    EXPECT_THROW(r.route({q, 2 * 512}, loads, 0.0), Error);  // 3 hashes, 2 blocks
    EXPECT_THROW(r.route({q, -1}, loads, 0.0), Error);
    EXPECT_EQ(r.route({{}, 0}, loads, 0.0).matched_blocks, 0);  // an empty prompt
    // The largest count: its block count does not overflow (it did as (n + B - 1) / B).
    const int64_t huge = std::numeric_limits<int64_t>::max();
    EXPECT_EQ(r.route({q, huge}, loads, 0.0).matched_blocks, 3);
}

// vLLM caps a prefix-cache hit at num_tokens - 1 tokens (vllm/v1/core/kv_cache_manager.py,
// KVCacheManager.get_computed_blocks: max_cache_hit_length = request.num_tokens - 1; the group's
// find_longest_cache_hit takes max_length // block_size blocks).
TEST(Router, VllmMaxCacheHitBlocks) {
    EXPECT_EQ(vllm_max_cache_hit_blocks(0, 16), 0);
    EXPECT_EQ(vllm_max_cache_hit_blocks(1, 16), 0);
    EXPECT_EQ(vllm_max_cache_hit_blocks(16, 16), 0);
    EXPECT_EQ(vllm_max_cache_hit_blocks(17, 16), 1);
    EXPECT_EQ(vllm_max_cache_hit_blocks(32, 16), 1);
    EXPECT_EQ(vllm_max_cache_hit_blocks(33, 16), 2);
    EXPECT_EQ(vllm_max_cache_hit_blocks(5, 1), 4);
    EXPECT_THROW(vllm_max_cache_hit_blocks(5, 0), Error);
}

// An engine drafting with EAGLE/MTP pops the last block of the capped hit
// (vllm/v1/core/single_type_kv_cache_manager.py, FullAttentionManager.find_longest_cache_hit:
// `if drop_eagle_block and computed_blocks[0]: computed.pop()`, reached when
// SpeculativeConfig.use_eagle(), vllm/config/speculative.py: method eagle, eagle3 or mtp).
TEST(Router, AnEagleEngineDropsTheLastBlockOfTheCappedHit) {
    Router r(2, RoutingPolicy::kCacheAware);
    std::vector<ReplicaLoad> loads(2);
    const auto q = chain({1, 2, 3, 4});
    r.index().block_stored(0, q);
    r.index().block_stored(1, q);
    r.index().set_eagle_block_drop(1, true);
    std::vector<int> out(2);
    r.index().prefix_overlap(q, out);
    EXPECT_EQ(out, (std::vector<int>{4, 3}));
    // 4 full blocks and one token more: the cap is 4; the EAGLE engine takes 3.
    const auto d = r.route({q, 4 * 512 + 1}, loads, 0.0);
    EXPECT_EQ(d.replica, 0);
    EXPECT_EQ(d.matched_blocks, 4);
    // Exactly 4 blocks: the cap is 3 (the last token is recomputed); the EAGLE engine pops one
    // more, 2: not 3 - 1 applied to a shorter cap twice, and not the cap less one only when the
    // cap binds.
    r.index().prefix_overlap(std::span<const BlockHash>(q).first(3), out);
    EXPECT_EQ(out, (std::vector<int>{3, 2}));
    // Held run shorter than the cap: it still loses its last block.
    r.index().block_removed(1, chain({3}));
    r.index().prefix_overlap(q, out);
    EXPECT_EQ(out, (std::vector<int>{4, 1}));
    // Nothing held: 0, never negative.
    r.index().all_cleared(1);
    r.index().prefix_overlap(q, out);
    EXPECT_EQ(out, (std::vector<int>{4, 0}));
}

TEST(Router, SpeculativeMethodsThatDropABlock) {
    for (const char* m : {"eagle", "eagle3", "mtp"}) EXPECT_TRUE(vllm_eagle_block_drop(m)) << m;
    for (const char* m : {"", "none", "ngram", "medusa", "mlp_speculator", "draft_model", "suffix"})
        EXPECT_FALSE(vllm_eagle_block_drop(m)) << m;
    try {
        vllm_eagle_block_drop("EAGLE");
        FAIL() << "no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("'EAGLE'"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("eagle, eagle3 or mtp"), std::string::npos)
            << e.what();
    }
}

// A trace's hash of a trailing partial block never counts: vLLM caches only full blocks.
TEST(Router, APartialLastBlockIsNeverAHit) {
    Router r(2, RoutingPolicy::kCacheAware);
    std::vector<ReplicaLoad> loads(2);
    const auto q = chain({1, 2, 3});
    r.index().block_stored(1, q);
    EXPECT_EQ(r.route({q, 2 * 512 + 100}, loads, 0.0).matched_blocks, 2);
}

TEST(Router, ApproximateIndexRemembersItsOwnDecisions) {
    Router r(4, RoutingPolicy::kCacheAware, {}, KvIndexMode::kApproximate, 30.0);
    std::vector<ReplicaLoad> loads(4);
    const auto q = chain({1, 2, 3});
    const int first = r.route({q, 3 * 512 + 1}, loads, 0.0).replica;
    // Without any event, the next request with the same prefix goes to the same replica.
    for (int k = 1; k <= 3; ++k) {
        const auto d = r.route({q, 3 * 512 + 1}, loads, 10.0 * k);
        EXPECT_EQ(d.replica, first);
        EXPECT_EQ(d.matched_blocks, 3);
    }
    // 30 s after the last use it is forgotten: cold again (least loaded, rotation counter 4 -> 0).
    const auto d = r.route({q, 3 * 512 + 1}, loads, 61.0);
    EXPECT_EQ(d.matched_blocks, 0);
    EXPECT_EQ(d.reason, RouteReason::kLeastLoaded);
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// The exact index fed by a real BlockManager's events holds exactly the manager's registered
// hashes.
TEST(KvIndex, FollowsABlockManagerThroughEvictions) {
    BlockManager m(BlockManagerConfig{6, 4, true});
    KvIndex idx(2);
    m.subscribe([&](const KvEvent& e) { idx.apply(1, e); });
    std::vector<BlockHash> a = chain({1, 2, 3}), b = chain({4, 5, 6, 7});
    m.allocate_with_hashes(0, a, 12);
    EXPECT_EQ(overlaps(idx, a), (std::vector<int>{0, 3}));
    m.free(0);  // cached, still findable
    EXPECT_EQ(overlaps(idx, a), (std::vector<int>{0, 3}));
    m.allocate_with_hashes(1, b, 16);  // 4 blocks: evicts 1 of a's (the tail, 3)
    EXPECT_EQ(overlaps(idx, a), (std::vector<int>{0, 2}));
    EXPECT_EQ(overlaps(idx, b), (std::vector<int>{0, 4}));
    EXPECT_EQ(idx.num_blocks(1), m.metrics().hashed_blocks);
    // A reset refused while sequence 1 runs publishes nothing: the index still equals the cache.
    EXPECT_FALSE(m.clear_cache());
    EXPECT_EQ(overlaps(idx, b), (std::vector<int>{0, 4}));
    EXPECT_EQ(idx.num_blocks(1), m.metrics().hashed_blocks);
    m.free(1);
    ASSERT_TRUE(m.clear_cache());
    EXPECT_EQ(idx.num_blocks(1), 0);
}

// vLLM registers the same content in several blocks (BlockPool.cache_full_blocks never
// de-duplicates) and publishes BlockStored for each and BlockRemoved for each copy it evicts
// (_maybe_evict_cached_block), while get_cached_block still hits through any copy left
// (vllm/v1/core/block_pool.py). The index counts copies: a removal of one leaves the prefix.
TEST(KvIndex, ARemovedCopyLeavesTheHashWhileAnotherCopyHoldsIt) {
    KvIndex idx(2);
    const auto q = chain({1, 2});
    idx.block_stored(1, q);
    idx.block_stored(1, q);  // the same prompt computed by a second sequence
    EXPECT_EQ(idx.num_blocks(1), 4);
    idx.block_removed(1, std::span(q).subspan(1));  // one copy of block 1 evicted
    EXPECT_EQ(overlaps(idx, q), (std::vector<int>{0, 2}));
    EXPECT_EQ(idx.num_blocks(1), 3);
    idx.block_removed(1, std::span(q).subspan(1));  // the last copy
    EXPECT_EQ(overlaps(idx, q), (std::vector<int>{0, 1}));
    idx.block_removed(1, std::span(q).subspan(1));  // nothing left to remove: harmless
    EXPECT_EQ(idx.num_blocks(1), 2);
    // A router forgetting a hash (its memory cap) drops every copy: both of block 0.
    idx.block_forgotten(1, std::span(q).first(1));
    EXPECT_EQ(overlaps(idx, q), (std::vector<int>{0, 0}));
    EXPECT_EQ(idx.num_blocks(1), 0);
    idx.all_cleared(1);
    idx.block_stored(1, q);
    idx.block_removed(1, q);
    EXPECT_EQ(idx.num_blocks(1), 0);  // all_cleared dropped the copies' counts too
    EXPECT_EQ(idx.num_hashes(), 0);
    // Approximate mode: a routed request refreshes its hashes, it does not add copies.
    KvIndex approx(1, KvIndexMode::kApproximate, 10.0);
    approx.record_routed(0, q, 0.0);
    approx.record_routed(0, q, 1.0);
    EXPECT_EQ(approx.num_blocks(0), 2);
    approx.expire(11.5);
    EXPECT_EQ(approx.num_blocks(0), 0);
}

// Two sequences of one replica compute the same prompt at once; the index fed by the manager's
// events keeps the prefix while the manager still serves it from a copy.
TEST(KvIndex, FollowsABlockManagerThroughCopiesOfOneHash) {
    BlockManager m({.num_blocks = 6, .block_size = 4, .deferred_commit = true});
    KvIndex idx(2);
    m.subscribe([&](const KvEvent& e) { idx.apply(1, e); });
    const auto a = chain({1, 2});
    m.allocate_with_hashes(0, a, 8);
    m.allocate_with_hashes(1, a, 8);
    m.commit(0, 8);
    m.commit(1, 8);
    EXPECT_EQ(idx.num_blocks(1), 4);
    m.free(0);
    m.free(1);
    m.allocate_with_hashes(2, chain({7, 8, 9}), 12);  // 2 free blocks + evicts seq 0's block 1
    EXPECT_EQ(m.lookup_hashes(a).blocks.size(), 2u);
    EXPECT_EQ(overlaps(idx, a), (std::vector<int>{0, 2}));
    EXPECT_EQ(idx.num_blocks(1), m.metrics().hashed_blocks);
}

TEST(KvIndex, ALostEventIsAnError) {
    KvIndex idx(2);
    KvEvent e;
    e.kind = KvEventKind::kBlockStored;
    e.block_hashes = chain({1});
    e.seq = 7;
    idx.apply(0, e);  // the first event fixes the start
    e.seq = 8;
    idx.apply(0, e);
    e.seq = 10;  // 9 was lost
    EXPECT_THROW(idx.apply(0, e), Error);
    e.seq = 3;
    idx.apply(1, e);     // replicas count apart
    idx.all_cleared(0);  // resynchronise: the next event starts the feed again
    idx.apply(0, e);
    EXPECT_EQ(idx.num_blocks(0), 1);
}

}  // namespace
}  // namespace kvshard
