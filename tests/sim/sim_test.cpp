#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "kvshard/common/error.h"
#include "kvshard/sim/simulator.h"
#include "kvshard/sim/trace.h"

namespace kvshard {
namespace {

std::string line(double ts_ms, int64_t in, int64_t out, const std::vector<uint64_t>& ids) {
    std::string s = "{\"timestamp\": " + std::to_string(ts_ms) +
                    ", \"input_length\": " + std::to_string(in) +
                    ", \"output_length\": " + std::to_string(out) + ", \"hash_ids\": [";
    for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
    return s + "]}\n";
}

Trace parse(const std::string& text, TraceErrorPolicy on_error = TraceErrorPolicy::kFail) {
    std::istringstream in(text);
    return parse_trace(in, "t.jsonl", on_error);
}

// ---------------------------------------------------------------- trace parsing

TEST(Trace, ParsesRequestsAndIgnoresBlankLines) {
    const Trace t = parse(line(0, 1000, 10, {1, 2}) + "\n   \n" + line(1500, 1024, 5, {1, 3}));
    ASSERT_EQ(t.requests.size(), 2u);
    EXPECT_DOUBLE_EQ(t.requests[1].arrival_s, 1.5);
    EXPECT_EQ(t.requests[1].input_tokens, 1024);
    EXPECT_EQ(t.requests[1].output_tokens, 5);
    EXPECT_EQ(t.requests[1].line, 4);
    ASSERT_EQ(t.blocks(t.requests[1]).size(), 2u);
    EXPECT_EQ(t.blocks(t.requests[1])[0], trace_block_hash(1));
    EXPECT_EQ(t.blocks(t.requests[1])[1], trace_block_hash(3));
    EXPECT_NE(trace_block_hash(1), trace_block_hash(3));
    EXPECT_DOUBLE_EQ(t.duration_s(), 1.5);
    EXPECT_TRUE(t.skipped.empty());
}

TEST(Trace, EachKindOfMalformedLineIsReportedWithItsLineNumber) {
    const std::vector<std::pair<std::string, std::string>> bad = {
        {"{\"timestamp\": 0, \"input_length\": 10", "not valid JSON"},
        {"[1, 2]", "not a JSON object"},
        {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}",
         "missing field 'hash_ids'"},
        {"{\"timestamp\": -1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}",
         "'timestamp'"},
        {"{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}",
         "'input_length'"},
        {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1.5, \"hash_ids\": [1]}",
         "'output_length'"},
        {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1000000000000000, "
         "\"hash_ids\": [1]}",
         "'output_length' must be a non-negative integer up to 2^40 tokens"},
        {"{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}",
         "needs ceil(600/512) = 2"},
        {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [\"a\"]}",
         "non-negative integers"},
        {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [-3]}",
         "non-negative integers"},
        // ceil(input / 512) overflowed int64 into a negative block count.
        {"{\"timestamp\": 0, \"input_length\": 9223372036854775807, \"output_length\": 1, "
         "\"hash_ids\": [1]}",
         "'input_length' must be a positive integer up to 2^40 tokens"},
        {"{\"timestamp\": 0, \"input_length\": 18446744073709551615, \"output_length\": 1, "
         "\"hash_ids\": [1]}",
         "'input_length'"},
        {"{\"timestamp\": 1e999, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}",
         ""},
        {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [[1]]}",
         "non-negative integers"},
        {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1.0]}",
         "non-negative integers"},
        {"{\"timestamp\": \"0\", \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}",
         "'timestamp'"},
        {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, "
         "\"hash_ids\": [18446744073709551616]}",
         "non-negative integers"},
        {"null", "not a JSON object"},
    };
    for (const auto& [text, what] : bad) {
        const std::string trace = line(0, 10, 1, {7}) + text + "\n" + line(1, 10, 1, {8});
        try {
            parse(trace);
            ADD_FAILURE() << "accepted: " << text;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("t.jsonl:2:"), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
        const Trace t = parse(trace, TraceErrorPolicy::kSkip);
        ASSERT_EQ(t.requests.size(), 2u) << text;
        EXPECT_EQ(t.requests[1].line, 3);
        ASSERT_EQ(t.skipped.size(), 1u);
        EXPECT_EQ(t.skipped[0].line, 2);
        EXPECT_NE(t.skipped[0].message.find(what), std::string::npos) << t.skipped[0].message;
    }
}

TEST(Trace, TimestampsMustNotGoBack) {
    const std::string text =
        line(2000, 10, 1, {1}) + line(1000, 10, 1, {2}) + line(3000, 10, 1, {3});
    EXPECT_THROW(parse(text), Error);
    const Trace t = parse(text, TraceErrorPolicy::kSkip);
    ASSERT_EQ(t.requests.size(), 2u);
    EXPECT_EQ(t.skipped[0].line, 2);
    EXPECT_NE(t.skipped[0].message.find("earlier"), std::string::npos);
}

TEST(Trace, ErrorPolicyNamesAndMissingFile) {
    EXPECT_EQ(parse_trace_error_policy("skip"), TraceErrorPolicy::kSkip);
    EXPECT_EQ(parse_trace_error_policy("fail"), TraceErrorPolicy::kFail);
    EXPECT_THROW(parse_trace_error_policy("ignore"), Error);
    EXPECT_THROW(load_trace("/nonexistent/trace.jsonl", TraceErrorPolicy::kFail), Error);
    // A directory opened as a stream and failed on its first read ("read error after line 0").
    try {
        load_trace(KVSHARD_TEST_SOURCE_DIR, TraceErrorPolicy::kFail);
        ADD_FAILURE() << "a directory was read as a trace";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("is a directory; expected a JSON-lines file"),
                  std::string::npos)
            << e.what();
    }
}

// ---------------------------------------------------------------- bounds

TEST(Bounds, InfiniteCacheCountsTheLongestSeenPrefix) {
    const Trace t = parse(line(0, 1000, 1, {1, 2}) + line(1, 1300, 1, {1, 2, 3}) +
                          line(2, 1000, 1, {1, 2}) + line(3, 10, 1, {4}));
    const HitRates h = infinite_cache_hit_rates(t);
    // r2 hits blocks 1,2 (1024 tokens); r3 hits both of its blocks (1000 tokens, the last partial).
    EXPECT_EQ(h.hit_blocks, 4);
    EXPECT_EQ(h.total_blocks, 8);
    EXPECT_EQ(h.hit_tokens, 2024);
    EXPECT_EQ(h.total_tokens, 3310);
    EXPECT_DOUBLE_EQ(h.token_hit_rate, 2024.0 / 3310.0);
}

TEST(Bounds, PooledLruEvictsLeastRecentlyUsedTailFirst) {
    // Capacity 3 blocks of 512. r1 fills {1,2,3}; r2 (exactly 3 blocks) hits 2 of them: vLLM
    // recomputes the last prompt token, so its block 3 is computed again into a fresh block (the
    // cached copy of 3 is the one it evicts); r3 ({4,5}) evicts 3 and 2 (a released chain's tail
    // goes first); r4 finds only block 1.
    const Trace t = parse(line(0, 1536, 1, {1, 2, 3}) + line(1, 1536, 1, {1, 2, 3}) +
                          line(2, 1024, 1, {4, 5}) + line(3, 1536, 1, {1, 2, 3}));
    const HitRates h = pooled_lru_hit_rates(t, 3);
    EXPECT_EQ(h.hit_blocks, 3);
    EXPECT_EQ(h.total_blocks, 11);
    EXPECT_EQ(h.hit_tokens, 3 * 512);
    EXPECT_THROW(pooled_lru_hit_rates(t, 0), Error);
    // Large enough: every repeat hits; only full blocks are shared.
    const Trace p = parse(line(0, 1000, 1, {1, 2}) + line(1, 1000, 1, {1, 2}));
    EXPECT_EQ(pooled_lru_hit_rates(p, 100).hit_blocks, 1);
}

TEST(Bounds, Percentile) {
    EXPECT_DOUBLE_EQ(percentile({4, 1, 3, 2}, 50), 2.5);
    EXPECT_DOUBLE_EQ(percentile({4, 1, 3, 2}, 100), 4);
    EXPECT_DOUBLE_EQ(percentile({4, 1, 3, 2}, 0), 1);
    EXPECT_DOUBLE_EQ(percentile({}, 50), 0);
}

// ---------------------------------------------------------------- replay

LinearServiceModel ms_per_token() {
    LinearServiceModel s;
    s.prefill_s_per_token = 1e-3;
    s.decode_fixed_s = 0.01;
    return s;
}

SimConfig one_replica(int64_t blocks = 100) {
    SimConfig c;
    c.num_replicas = 1;
    c.replica_capacity_blocks = blocks;
    c.policy = RoutingPolicy::kRoundRobin;
    return c;
}

TEST(Replay, TtftIsThePrefillOfTheUncachedTokens) {
    // A: 1024 tokens, 3 output tokens: prefill 1.024 s, then 2 decode steps of 10 ms.
    // B at 5 s shares A's two full blocks: prefill 512 tokens, TTFT 0.512 s.
    const Trace t = parse(line(0, 1024, 3, {1, 2}) + line(5000, 1536, 1, {1, 2, 3}));
    const LinearServiceModel svc = ms_per_token();
    const PolicyReport r = simulate(t, one_replica(), svc);
    EXPECT_EQ(r.completed, 2);
    EXPECT_EQ(r.hits.hit_blocks, 2);
    EXPECT_EQ(r.hits.total_blocks, 5);
    EXPECT_EQ(r.hits.hit_tokens, 1024);
    EXPECT_DOUBLE_EQ(r.hits.token_hit_rate, 1024.0 / 2560.0);
    EXPECT_NEAR(r.ttft_p50_s, (1.024 + 0.512) / 2, 1e-9);
    EXPECT_NEAR(r.ttft_p99_s, 1.024 - 0.01 * 0.512, 1e-9);  // interpolated between the two
    EXPECT_NEAR(r.makespan_s, 5.512, 1e-9);
    EXPECT_EQ(r.tokens_per_replica, (std::vector<int64_t>{1024 + 3 + 1536 + 1}));
}

TEST(Replay, AFullyCachedPromptRecomputesItsLastBlock) {
    // A and B: the same 1024-token prompt, 2 full blocks. vLLM caps B's hit at 1023 tokens
    // (vllm/v1/core/kv_cache_manager.py, KVCacheManager.get_computed_blocks: max_cache_hit_length
    // = request.num_tokens - 1), so B hits 1 block and prefills 512 tokens: TTFT 0.512 s, not the
    // 1 ms of a single recomputed token.
    const Trace t = parse(line(0, 1024, 1, {1, 2}) + line(5000, 1024, 1, {1, 2}));
    const LinearServiceModel svc = ms_per_token();
    const PolicyReport r = simulate(t, one_replica(), svc);
    EXPECT_EQ(r.hits.hit_blocks, 1);
    EXPECT_EQ(r.hits.hit_tokens, 512);
    EXPECT_NEAR(r.ttft_p50_s, (1.024 + 0.512) / 2, 1e-9);
    EXPECT_NEAR(r.makespan_s, 5.512, 1e-9);
    EXPECT_EQ(pooled_lru_hit_rates(t, 100).hit_blocks, 1);
    // Room for one request at a time (2 prompt blocks + 1 output block): B still hits block 1,
    // its recomputed last block evicting A's copy of it.
    EXPECT_EQ(simulate(t, one_replica(3), svc).hits.hit_blocks, 1);
}

TEST(Replay, AnEagleEngineRecomputesOneMoreBlock) {
    // A and B: the same prompt of 3 full blocks and one token. Without speculation B hits all 3
    // (cap 1536 / 512 = 3); an engine drafting with EAGLE/MTP pops the last matched block
    // (vllm/v1/core/single_type_kv_cache_manager.py, FullAttentionManager.find_longest_cache_hit:
    // drop_eagle_block), so B hits 2 and prefills 513 tokens.
    const Trace t = parse(line(0, 1537, 1, {1, 2, 3, 4}) + line(5000, 1537, 1, {1, 2, 3, 4}));
    const LinearServiceModel svc = ms_per_token();
    EXPECT_EQ(simulate(t, one_replica(), svc).hits.hit_blocks, 3);
    SimConfig eagle = one_replica();
    eagle.eagle_block_drop = true;
    const PolicyReport r = simulate(t, eagle, svc);
    EXPECT_EQ(r.hits.hit_blocks, 2);
    EXPECT_NEAR(r.makespan_s, 5.513, 1e-9);
    EXPECT_EQ(pooled_lru_hit_rates(t, 100).hit_blocks, 3);
    EXPECT_EQ(pooled_lru_hit_rates(t, 100, true).hit_blocks, 2);
    // Two replicas, cache-aware routing on the exact index: the router sees the same 2 blocks the
    // replica takes (the index knows the replica drops one).
    eagle.num_replicas = 2;
    eagle.policy = RoutingPolicy::kCacheAware;
    EXPECT_EQ(simulate(t, eagle, svc).hits.hit_blocks, 2);
}

TEST(Replay, AfterTheEagleDropThePromptsLaterBlocksAreCachedToo) {
    // B extends A's 3 blocks by 2 (5 full blocks and one token) and hits 2 of them; C repeats B.
    // vLLM caches B's recomputed block 2 under its hash beside A's and chains B's blocks 3 and 4
    // on, so C finds all 5 and pops one: 4. (Had B's recomputed copy stopped the chain, C would
    // find 3 and hit 2.)
    const Trace t = parse(line(0, 1537, 1, {1, 2, 3, 4}) + line(5000, 2561, 1, {1, 2, 3, 5, 6, 7}) +
                          line(10000, 2561, 1, {1, 2, 3, 5, 6, 7}));
    SimConfig eagle = one_replica();
    eagle.eagle_block_drop = true;
    EXPECT_EQ(simulate(t, eagle, ms_per_token()).hits.hit_blocks, 2 + 4);
    EXPECT_EQ(pooled_lru_hit_rates(t, 100, true).hit_blocks, 2 + 4);
    EXPECT_EQ(simulate(t, one_replica(), ms_per_token()).hits.hit_blocks, 3 + 5);
}

TEST(Replay, TheEagleDropsRecomputedBlockTakesAFreshBlockAsInVllm) {
    // A 4-block replica; A holds 3 full blocks and a partial one, then they are cached / free. B
    // repeats A under EAGLE: vLLM hits 2 blocks and computes block 2 again into a fresh block
    // (registered beside A's copy by BlockPool.cache_full_blocks), so B takes 2 fresh blocks: the
    // free one and, by eviction, A's block 2 (released first, LRU). Sharing A's block 2 instead
    // would need no eviction.
    const Trace t = parse(line(0, 1537, 1, {1, 2, 3, 4}) + line(5000, 1537, 1, {1, 2, 3, 4}));
    SimConfig eagle = one_replica(4);
    eagle.eagle_block_drop = true;
    const PolicyReport r = simulate(t, eagle, ms_per_token());
    EXPECT_EQ(r.hits.hit_blocks, 2);
    EXPECT_EQ(r.evicted_blocks, 1);
    EXPECT_EQ(simulate(t, one_replica(4), ms_per_token()).evicted_blocks, 0);
}

TEST(Replay, RequestsQueueBehindAFullPrefillBudget) {
    // Two 1000-token requests at t = 0 with a 1000-token prefill budget per step: the second waits.
    const Trace t = parse(line(0, 1000, 1, {1, 2}) + line(0, 1000, 1, {3, 4}));
    SimConfig c = one_replica();
    c.max_prefill_tokens = 1000;
    const LinearServiceModel svc = ms_per_token();
    const PolicyReport r = simulate(t, c, svc);
    EXPECT_NEAR(r.ttft_p50_s, 1.5, 1e-9);  // TTFTs 1.0 and 2.0
    EXPECT_NEAR(r.makespan_s, 2.0, 1e-9);
    // With room for both they share one step of 2000 tokens.
    c.max_prefill_tokens = 4000;
    EXPECT_NEAR(simulate(t, c, svc).ttft_p50_s, 2.0, 1e-9);
}

TEST(Replay, FiniteCacheEvictsAndOversizedRequestsAreRejected) {
    // 4-block replica: r1 {1,2,3} + 1 output block; r2 {4,5}; r3 {1,2,3} misses (evicted) ...
    const Trace t =
        parse(line(0, 1536, 1, {1, 2, 3}) + line(10000, 1024, 1, {4, 5}) +
              line(20000, 1536, 1, {1, 2, 3}) + line(30000, 4000, 1, {6, 7, 8, 9, 10, 11, 12, 13}));
    const LinearServiceModel svc = ms_per_token();
    const PolicyReport r = simulate(t, one_replica(4), svc);
    EXPECT_EQ(r.rejected, 1);  // 8 blocks > 4
    EXPECT_EQ(r.completed, 3);
    // r2 needs 3 blocks (2 prompt + 1 output): evicts 2 of {3,2,1} (tail first): 3 and 2; block 1
    // survives, so r3 hits one block.
    EXPECT_EQ(r.hits.hit_blocks, 1);
    EXPECT_GT(r.evicted_blocks, 0);
}

TEST(Replay, RoundRobinSpreadsAndCacheAwareFollowsTheConversation) {
    // A conversation of 4 turns, each extending the previous prompt, 10 s apart.
    std::string text;
    std::vector<uint64_t> ids = {0, 1};
    for (int turn = 0; turn < 4; ++turn) {
        text += line(turn * 10000.0, static_cast<int64_t>(ids.size()) * 512, 2, ids);
        ids.push_back(10 + static_cast<uint64_t>(turn));
    }
    const Trace t = parse(text);
    const LinearServiceModel svc = ms_per_token();
    SimConfig c;
    c.num_replicas = 2;
    c.replica_capacity_blocks = 100;
    c.policy = RoutingPolicy::kRoundRobin;
    const PolicyReport rr = simulate(t, c, svc);
    EXPECT_EQ(rr.requests_per_replica, (std::vector<int64_t>{2, 2}));
    for (RoutingPolicy p :
         {RoutingPolicy::kCacheAware, RoutingPolicy::kCost, RoutingPolicy::kKvshard}) {
        for (KvIndexMode m : {KvIndexMode::kExact, KvIndexMode::kApproximate}) {
            c.policy = p;
            c.index_mode = m;
            const PolicyReport r = simulate(t, c, svc);
            // Turns 2..4 hit their whole previous prompt: 2 + 3 + 4 blocks.
            EXPECT_EQ(r.hits.hit_blocks, 9)
                << routing_policy_name(p) << " " << kv_index_mode_name(m);
        }
    }
    EXPECT_LT(rr.hits.hit_blocks, 9);
}

TEST(Replay, ConfigErrors) {
    const Trace t = parse(line(0, 10, 1, {1}));
    const LinearServiceModel svc = ms_per_token();
    SimConfig c = one_replica();
    c.num_replicas = 0;
    EXPECT_THROW(simulate(t, c, svc), Error);
    c = one_replica(0);
    EXPECT_THROW(simulate(t, c, svc), Error);
    c = one_replica();
    c.max_batch = 0;
    EXPECT_THROW(simulate(t, c, svc), Error);
}

// ---------------------------------------------------------------- the Mooncake sample

TEST(Sample, MooncakeHead300) {
    const Trace t =
        load_trace(std::string(KVSHARD_TEST_DATA_DIR) + "/mooncake_conversation_head300.jsonl",
                   TraceErrorPolicy::kFail);
    ASSERT_EQ(t.requests.size(), 300u);
    EXPECT_DOUBLE_EQ(t.duration_s(), 102.0);
    const HitRates inf = infinite_cache_hit_rates(t);  // figures from tests/data/README.md
    EXPECT_EQ(inf.hit_blocks, 676);
    EXPECT_EQ(inf.total_blocks, 8490);
    EXPECT_EQ(inf.hit_tokens, 345966);
    EXPECT_EQ(inf.total_tokens, 4269971);
    // 4 replicas of 2000 blocks: every policy completes everything; the pooled LRU is at most the
    // infinite bound; kvshard beats round-robin (the sample's reuse is mostly within
    // conversations).
    LinearServiceModel svc;
    svc.prefill_s_per_token = 30e-6;
    svc.decode_fixed_s = 0.007;
    SimConfig c;
    c.num_replicas = 4;
    c.replica_capacity_blocks = 2000;
    const HitRates pooled = pooled_lru_hit_rates(t, 8000);
    EXPECT_LE(pooled.hit_tokens, inf.hit_tokens);
    std::vector<PolicyReport> reports;
    for (RoutingPolicy p : all_routing_policies()) {
        c.policy = p;
        reports.push_back(simulate(t, c, svc));
        EXPECT_EQ(reports.back().completed, 300) << reports.back().name;
        EXPECT_LE(reports.back().hits.hit_tokens, inf.hit_tokens);
    }
    EXPECT_GT(reports.back().hits.token_hit_rate, reports.front().hits.token_hit_rate);
    SimReport rep;
    rep.policies = reports;
    rep.infinite_cache = inf;
    rep.pooled_lru = pooled;
    EXPECT_NE(to_json(rep).find("\"pooled_lru_token_hit_rate\""), std::string::npos);
    EXPECT_NE(render_svg(rep).find("</svg>"), std::string::npos);
}

}  // namespace
}  // namespace kvshard
