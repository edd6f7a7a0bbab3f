// BlockManager: allocation, sharing, eviction order, events, metrics, bad input.
#include <gtest/gtest.h>

#include <numeric>
#include <sstream>

#include "kvshard/cache/block_manager.h"

namespace kvshard {
namespace {

std::vector<int32_t> iota_tokens(size_t n, int32_t start = 0) {
    std::vector<int32_t> t(n);
    std::iota(t.begin(), t.end(), start);
    return t;
}

BlockManager make(int64_t blocks, int bs = 4) { return BlockManager({blocks, bs, true}); }

TEST(BlockManager, AllocatesAndFreesWithoutSharing) {
    auto m = make(8);
    const auto r = m.allocate(1, iota_tokens(10));
    EXPECT_EQ(r.cached_tokens, 0);
    EXPECT_EQ(r.new_blocks, 3);
    EXPECT_EQ(m.block_table(1).size(), 3u);
    EXPECT_EQ(m.num_tokens(1), 10);
    EXPECT_EQ(m.block_hashes(1).size(), 2u);  // two full blocks
    auto mt = m.metrics();
    EXPECT_EQ(mt.used_blocks, 3);
    EXPECT_EQ(mt.free_blocks, 5);
    EXPECT_EQ(mt.hashed_blocks, 2);
    m.check_invariants();
    m.free(1);
    mt = m.metrics();
    EXPECT_EQ(mt.used_blocks, 0);
    EXPECT_EQ(mt.cached_blocks, 2);  // full blocks stay cached
    EXPECT_EQ(mt.free_blocks, 6);
    m.check_invariants();
}

// Deferred commit: a prompt's blocks are not findable between its allocation and the commit of
// the step that wrote their KV; BlockStored comes at the commit, for the committed full blocks.
TEST(BlockManager, DeferredCommitHidesBlocksUntilTheirKvIsWritten) {
    BlockManager m({.num_blocks = 16, .block_size = 4, .deferred_commit = true});
    std::vector<KvEvent> events;
    m.subscribe([&](const KvEvent& e) { events.push_back(e); });
    const auto a = iota_tokens(14);  // three full blocks and a partial one
    EXPECT_EQ(m.allocate(1, a).cached_tokens, 0);
    EXPECT_TRUE(events.empty()) << "blocks published before their KV was written";
    EXPECT_EQ(m.num_committed_tokens(1), 0);
    EXPECT_EQ(m.lookup(a).num_tokens, 0);
    // A second request in the window shares nothing: it computes its own copy.
    EXPECT_EQ(m.allocate(2, a).cached_tokens, 0);
    m.check_invariants();

    m.commit(1, 6);  // a first chunk: block 0 full and written, block 1 half
    EXPECT_TRUE(m.block_computed(m.block_table(1)[0]));
    EXPECT_FALSE(m.block_computed(m.block_table(1)[1]));
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].kind, KvEventKind::kBlockStored);
    EXPECT_EQ(events[0].block_ids, std::vector<int32_t>{m.block_table(1)[0]});
    EXPECT_EQ(m.lookup(a).num_tokens, 4);
    EXPECT_EQ(m.allocate(3, a).cached_tokens, 4);
    m.commit(1, 3);  // below what is committed: nothing changes
    EXPECT_EQ(m.num_committed_tokens(1), 6);
    EXPECT_EQ(events.size(), 1u);

    m.commit(1, 14);
    ASSERT_EQ(events.size(), 2u);
    EXPECT_EQ(events[1].block_hashes.size(), 2u);  // blocks 1 and 2; the partial one never
    EXPECT_EQ(events[1].parent_hash, m.block_hashes(1)[0]);
    EXPECT_EQ(m.lookup(a).num_tokens, 12);
    // Sequence 2's own blocks hold the same hashes: registered too, as copies, as vLLM's
    // BlockPool.cache_full_blocks registers every new full block (vllm/v1/core/block_pool.py);
    // lookups keep finding sequence 1's, the first registered.
    m.commit(2, 14);
    ASSERT_EQ(events.size(), 3u);
    EXPECT_EQ(events[2].kind, KvEventKind::kBlockStored);
    EXPECT_EQ(events[2].block_hashes,
              std::vector<BlockHash>(m.block_hashes(2).begin(), m.block_hashes(2).end()));
    EXPECT_EQ(events[2].block_ids,
              std::vector<BlockId>(m.block_table(2).begin(), m.block_table(2).begin() + 3));
    EXPECT_EQ(m.lookup(a).blocks,
              std::vector<BlockId>(m.block_table(1).begin(), m.block_table(1).begin() + 3));
    m.check_invariants();

    // A freed uncommitted block is free (not cached) and forgets that it was ever allocated.
    m.append(3, std::vector<int32_t>{100});
    const BlockId tail = m.block_table(3).back();
    m.free(3);
    EXPECT_EQ(m.block_state(tail), BlockState::kFree);
    EXPECT_FALSE(m.block_computed(tail));
    EXPECT_THROW(m.commit(1, 15), Error);
    EXPECT_THROW(m.commit(3, 0), Error);
    m.check_invariants();

    // Without deferred commit, allocate and append commit at once and commit() is a no-op.
    auto now = make(8);
    now.allocate(1, a);
    EXPECT_EQ(now.num_committed_tokens(1), 14);
    EXPECT_EQ(now.lookup(a).num_tokens, 12);
    now.commit(1, 14);
    now.check_invariants();
}

TEST(BlockManager, SharesOnlyFullBlocksOfACommonPrefix) {
    auto m = make(16);
    auto a = iota_tokens(10);
    m.allocate(1, a);
    auto b = iota_tokens(10);
    b[9] = 999;  // same first two full blocks, different partial block
    const auto r = m.allocate(2, b);
    EXPECT_EQ(r.cached_tokens, 8);
    EXPECT_EQ(r.new_blocks, 1);
    EXPECT_EQ(m.block_table(2)[0], m.block_table(1)[0]);
    EXPECT_EQ(m.block_table(2)[1], m.block_table(1)[1]);
    EXPECT_NE(m.block_table(2)[2], m.block_table(1)[2]);
    EXPECT_EQ(m.ref_count(m.block_table(1)[0]), 2);
    auto c = iota_tokens(10);
    c[5] = -1;  // differs inside block 1
    EXPECT_EQ(m.allocate(3, c).cached_tokens, 4);
    m.check_invariants();
    const auto mt = m.metrics();
    EXPECT_EQ(mt.queries, 3);
    EXPECT_EQ(mt.query_tokens, 30);
    EXPECT_EQ(mt.hit_tokens, 12);
}

TEST(BlockManager, FreedPrefixIsFoundAgain) {
    auto m = make(16);
    const auto t = iota_tokens(17);
    m.allocate(1, t);
    const std::vector<BlockId> first(m.block_table(1).begin(), m.block_table(1).end());
    m.free(1);
    EXPECT_EQ(m.lookup(t).num_tokens, 16);
    const auto r = m.allocate(2, t);
    EXPECT_EQ(r.cached_tokens, 16);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(m.block_table(2)[i], first[i]);
    m.check_invariants();
}

TEST(BlockManager, AppendHashesBlocksAsTheyFill) {
    auto m = make(16);
    m.allocate(1, iota_tokens(3));
    const auto all = iota_tokens(13);
    m.append(1, std::span(all).subspan(3, 2));  // 5 tokens: block 0 full
    m.append(1, std::span(all).subspan(5, 8));  // 13 tokens: 3 full blocks
    EXPECT_EQ(m.num_tokens(1), 13);
    ASSERT_EQ(m.block_hashes(1).size(), 3u);
    EXPECT_EQ(std::vector<BlockHash>(m.block_hashes(1).begin(), m.block_hashes(1).end()),
              hash_token_blocks(all, 4));
    EXPECT_EQ(m.lookup(all).num_tokens, 12);
    m.append_tokens(1, 7);  // ids unknown: not hashed
    EXPECT_EQ(m.num_tokens(1), 20);
    EXPECT_EQ(m.block_hashes(1).size(), 3u);
    m.check_invariants();
}

TEST(BlockManager, EvictsLeastRecentlyUsedTailFirst) {
    auto m = make(6);
    m.allocate(1, iota_tokens(12, 0));    // blocks 0,1,2 (chain a0-a1-a2)
    m.allocate(2, iota_tokens(12, 100));  // blocks 3,4,5
    m.free(1);
    m.free(2);
    // Seq 1 released first (older), each chain tail first.
    const auto order = m.eviction_order();
    ASSERT_EQ(order.size(), 6u);
    EXPECT_EQ(order, (std::vector<BlockId>{2, 1, 0, 5, 4, 3}));
    // A new 2-block sequence evicts seq 1's tail and middle; its head remains findable.
    m.allocate(3, iota_tokens(8, 500));
    EXPECT_EQ(m.lookup(iota_tokens(12, 0)).num_tokens, 4);
    EXPECT_EQ(m.lookup(iota_tokens(12, 100)).num_tokens, 12);
    EXPECT_EQ(m.metrics().evictions, 2);
    m.check_invariants();
}

TEST(BlockManager, UsedBlocksAreNeverEvicted) {
    auto m = make(4);
    m.allocate(1, iota_tokens(12));
    EXPECT_THROW(m.allocate(2, iota_tokens(8, 50)), OutOfBlocksError);
    m.check_invariants();
    EXPECT_EQ(m.metrics().used_blocks, 3);
    EXPECT_TRUE(m.can_allocate(iota_tokens(4, 50)));
    EXPECT_FALSE(m.can_allocate(iota_tokens(8, 50)));
    // Sharing does not need new blocks: the same prompt fits.
    EXPECT_TRUE(m.can_allocate(iota_tokens(12)));
    EXPECT_EQ(m.allocate(3, iota_tokens(12)).new_blocks, 0);
    m.check_invariants();
}

TEST(BlockManager, PrecomputedHashes) {
    auto m = BlockManager({8, 512, true});
    std::vector<BlockHash> h{{1, 0}, {2, 0}, {3, 0}};
    auto r = m.allocate_with_hashes(1, h, 1100);  // 2 full blocks + partial; third hash ignored
    EXPECT_EQ(r.cached_tokens, 0);
    EXPECT_EQ(m.block_table(1).size(), 3u);
    EXPECT_EQ(m.block_hashes(1).size(), 2u);
    r = m.allocate_with_hashes(2, std::span(h).first(2), 1024);
    EXPECT_EQ(r.cached_tokens, 1024);
    EXPECT_EQ(r.new_blocks, 0);
    EXPECT_EQ(m.lookup_hashes(h).num_tokens, 1024);
    m.append_tokens(1, 500);  // decode output: never hashed
    EXPECT_EQ(m.block_hashes(1).size(), 2u);
    EXPECT_THROW(m.allocate_with_hashes(3, std::span(h).first(1), 1100), Error);  // too few
    EXPECT_THROW(m.allocate_with_hashes(3, h, 1024), Error);                      // too many
    m.check_invariants();
}

TEST(BlockManager, EventsDescribeStoredAndRemovedChainsInOrder) {
    auto m = make(4);
    std::vector<KvEvent> got;
    m.subscribe([&](const KvEvent& e) { got.push_back(e); });
    std::ostringstream lines;
    m.subscribe(KvEventJsonWriter(lines, "replica-0"));
    const auto a = iota_tokens(9);
    m.allocate(1, a);  // 2 full blocks stored
    m.free(1);
    m.allocate(2, iota_tokens(12, 100));  // needs 3: 2 free, evicts 1 (a's tail)
    m.free(2);
    ASSERT_TRUE(m.clear_cache());
    ASSERT_EQ(got.size(), 4u);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].seq, i);
    const auto ha = hash_token_blocks(a, 4);
    EXPECT_EQ(got[0].kind, KvEventKind::kBlockStored);
    EXPECT_EQ(got[0].block_hashes, ha);
    EXPECT_FALSE(got[0].parent_hash.has_value());
    EXPECT_EQ(got[0].num_tokens, 8);
    EXPECT_EQ(got[1].kind, KvEventKind::kBlockRemoved);
    EXPECT_EQ(got[1].block_hashes, std::vector<BlockHash>{ha[1]});
    EXPECT_EQ(got[2].kind, KvEventKind::kBlockStored);
    EXPECT_EQ(got[2].block_hashes.size(), 3u);
    EXPECT_EQ(got[3].kind, KvEventKind::kAllCleared);
    // The JSON lines carry the same events.
    std::istringstream in(lines.str());
    std::string line;
    size_t n = 0;
    while (std::getline(in, line)) {
        ASSERT_LT(n, got.size());
        EXPECT_EQ(line.rfind("{\"source\":\"replica-0\",\"seq\":", 0), 0u) << line;
        EXPECT_EQ(kv_event_from_json(line), got[n]) << line;
        ++n;
    }
    EXPECT_EQ(n, got.size());
    EXPECT_EQ(m.metrics().hashed_blocks, 0);
    m.check_invariants();
}

TEST(BlockManager, AppendThenStoredEventChainsFromTheParent) {
    auto m = make(8);
    std::vector<KvEvent> got;
    m.subscribe([&](const KvEvent& e) { got.push_back(e); });
    const auto t = iota_tokens(8);
    m.allocate(1, std::span(t).first(5));
    m.append(1, std::span(t).subspan(5));
    ASSERT_EQ(got.size(), 2u);
    const auto h = hash_token_blocks(t, 4);
    EXPECT_EQ(got[1].block_hashes, std::vector<BlockHash>{h[1]});
    EXPECT_EQ(got[1].parent_hash, h[0]);
}

TEST(BlockManager, MaxCachedBlocksCapsTheSharedPrefix) {
    auto m = make(16);
    const auto t = iota_tokens(12);  // 3 full blocks
    m.allocate(1, t);
    m.free(1);
    // Keep the last token computed: at most (12 - 1) / 4 = 2 blocks shared.
    const auto r = m.allocate(2, t, {}, (12 - 1) / 4);
    EXPECT_EQ(r.cached_blocks, 2);
    EXPECT_EQ(r.new_blocks, 1);
    // Block 2 holds the same tokens as the cached one: registered beside it as a copy, as vLLM's
    // cache_full_blocks registers every new full block (vllm/v1/core/block_pool.py); a lookup still
    // finds the older copy (BlockHashToBlockMap.get_one_block).
    const auto h = hash_token_blocks(t, 4);
    const BlockId copy = m.block_table(2)[2];
    EXPECT_EQ(m.registered_hash(copy), h[2]);
    EXPECT_NE(m.lookup(t).blocks[2], copy);
    EXPECT_EQ(m.metrics().hashed_blocks, 4);
    EXPECT_EQ(m.allocate_with_hashes(3, hash_token_blocks(t, 4), 12, 0).cached_blocks, 0);
    EXPECT_TRUE(m.can_allocate(t, {}, 1));
    m.check_invariants();
}

// Two sequences compute the same prompt at once (neither can hit the other's blocks before they
// are written): vLLM registers both (BlockPool.cache_full_blocks never de-duplicates;
// BlockHashToBlockMap keeps hash -> {block_id: block}), publishes BlockStored for each, and a
// lookup takes the first registered copy still there (get_one_block). Evicting a copy publishes
// BlockRemoved for its hash (_maybe_evict_cached_block) while the other copy keeps the prefix
// findable. vllm/v1/core/block_pool.py.
TEST(BlockManager, TheSamePromptComputedTwiceIsRegisteredTwiceAndEvictedCopyByCopy) {
    BlockManager m({.num_blocks = 6, .block_size = 4, .deferred_commit = true});
    std::vector<KvEvent> got;
    m.subscribe([&](const KvEvent& e) { got.push_back(e); });
    KvEventIndex consumer;
    m.subscribe([&](const KvEvent& e) { consumer.apply(e); });
    const auto t = iota_tokens(8);
    const auto h = hash_token_blocks(t, 4);
    EXPECT_EQ(m.allocate(1, t).cached_blocks, 0);
    EXPECT_EQ(m.allocate(2, t).cached_blocks, 0);  // seq 1's KV is not written yet
    const std::vector<BlockId> a(m.block_table(1).begin(), m.block_table(1).end());
    const std::vector<BlockId> b(m.block_table(2).begin(), m.block_table(2).end());
    m.commit(1, 8);
    m.commit(2, 8);
    ASSERT_EQ(got.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(got[i].kind, KvEventKind::kBlockStored);
        EXPECT_EQ(got[i].block_hashes, h);
        EXPECT_FALSE(got[i].parent_hash.has_value());
    }
    EXPECT_EQ(got[0].block_ids, a);
    EXPECT_EQ(got[1].block_ids, b);
    EXPECT_EQ(m.registered_hash(b[0]), h[0]);
    EXPECT_EQ(m.registered_hash(b[1]), h[1]);
    EXPECT_EQ(m.metrics().hashed_blocks, 4);
    EXPECT_EQ(m.metrics().stored_blocks, 4);
    EXPECT_EQ(m.lookup(t).blocks, a);  // the first registered copies
    EXPECT_EQ(consumer.size(), 4u);
    m.check_invariants();

    // Released: a[1], a[0], b[1], b[0] in LRU order. A new sequence of 3 blocks takes the 2 free
    // ones and evicts a[1]: BlockRemoved for h[1], yet b[1] keeps the prefix whole.
    m.free(1);
    m.free(2);
    got.clear();
    m.allocate(3, iota_tokens(12, 100));
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].kind, KvEventKind::kBlockRemoved);
    EXPECT_EQ(got[0].block_hashes, std::vector<BlockHash>{h[1]});
    EXPECT_EQ(got[0].block_ids, std::vector<BlockId>{a[1]});
    m.commit(3, 12);
    EXPECT_EQ(m.lookup(t).blocks, (std::vector<BlockId>{a[0], b[1]}));
    EXPECT_EQ(consumer.match_length(h), 2u);
    m.check_invariants();

    // The prefix hits through the remaining copies; evicting them all ends it.
    const auto r = m.allocate(4, t);
    EXPECT_EQ(r.cached_blocks, 2);
    EXPECT_EQ(std::vector<BlockId>(m.block_table(4).begin(), m.block_table(4).end()),
              (std::vector<BlockId>{a[0], b[1]}));
    m.free(4);
    m.free(3);
    got.clear();
    m.allocate(5, iota_tokens(24, 200));  // the whole pool: evicts all 6 cached blocks
    ASSERT_GE(got.size(), 1u);
    EXPECT_EQ(got[0].kind, KvEventKind::kBlockRemoved);
    EXPECT_EQ(m.lookup(t).blocks.size(), 0u);
    EXPECT_EQ(consumer.match_length(h), 0u);
    m.check_invariants();
}

TEST(KvEventIndex, FollowsTheFeedAndDetectsGaps) {
    auto m = make(4);
    KvEventIndex idx;
    m.subscribe([&](const KvEvent& e) { idx.apply(e); });
    const auto a = iota_tokens(8);
    m.allocate(1, a);
    const auto ha = hash_token_blocks(a, 4);
    EXPECT_EQ(idx.size(), 2u);
    EXPECT_EQ(idx.match_length(ha), 2u);
    m.free(1);
    m.allocate(2, iota_tokens(12, 50));  // evicts a's tail
    EXPECT_EQ(idx.match_length(ha), 1u);
    EXPECT_EQ(idx.next_seq(), m.next_event_seq());
    // A late joiner starts from a snapshot.
    KvEventIndex late;
    late.sync(m.registered_hashes(), m.next_event_seq());
    m.subscribe([&](const KvEvent& e) { late.apply(e); });
    m.free(2);
    ASSERT_TRUE(m.clear_cache());
    EXPECT_EQ(idx.size(), 0u);
    EXPECT_EQ(late.size(), 0u);
    // Lost and replayed events are refused.
    KvEvent e;
    e.seq = *idx.next_seq() + 1;
    EXPECT_THROW(idx.apply(e), Error);
    e.seq = *idx.next_seq() - 1;
    EXPECT_THROW(idx.apply(e), Error);
    e.seq = *idx.next_seq();
    EXPECT_NO_THROW(idx.apply(e));
}

// vLLM's BlockPool.reset_prefix_cache (vllm/v1/core/block_pool.py) returns False and queues no
// AllBlocksCleared while any block but the null block is in use; it resets only an idle pool.
TEST(BlockManager, ClearCacheRefusesWhileBlocksAreUsed) {
    auto m = make(8);
    std::vector<KvEvent> got;
    m.subscribe([&](const KvEvent& e) { got.push_back(e); });
    const auto a = iota_tokens(9), b = iota_tokens(8, 40);
    const auto ha = hash_token_blocks(a, 4), hb = hash_token_blocks(b, 4);
    m.allocate(1, a);
    m.allocate(2, b);
    m.free(2);  // b's blocks are cached, a's used
    const auto before = m.metrics();
    const uint64_t seq = m.next_event_seq();
    got.clear();
    EXPECT_FALSE(m.clear_cache());
    EXPECT_TRUE(got.empty());
    EXPECT_EQ(m.next_event_seq(), seq);
    const auto after = m.metrics();
    EXPECT_EQ(after.used_blocks, before.used_blocks);
    EXPECT_EQ(after.cached_blocks, before.cached_blocks);
    EXPECT_EQ(after.hashed_blocks, before.hashed_blocks);
    EXPECT_EQ(m.lookup_hashes(ha).num_tokens, 8);  // both prefixes still hit
    EXPECT_EQ(m.lookup_hashes(hb).num_tokens, 8);
    m.check_invariants();
    // A sequence that keeps running extends its chain as before.
    m.append(1, iota_tokens(3, 9));
    EXPECT_EQ(m.lookup_hashes(hash_token_blocks(iota_tokens(12), 4)).num_tokens, 12);
    m.free(1);
    EXPECT_TRUE(m.clear_cache());
    ASSERT_EQ(got.size(), 2u);  // the appended block's BlockStored, then AllCleared
    EXPECT_EQ(got[1].kind, KvEventKind::kAllCleared);
    EXPECT_EQ(m.metrics().free_blocks, 8);
    EXPECT_EQ(m.lookup_hashes(ha).num_tokens, 0);
    m.check_invariants();
}

TEST(BlockManager, BadInputIsAClearErrorAndChangesNothing) {
    EXPECT_THROW(BlockManager({8, 0, true}), Error);
    EXPECT_THROW(BlockManager({0, 16, true}), Error);
    auto m = make(4);
    m.allocate(1, iota_tokens(6));
    const auto before = m.metrics();
    try {
        m.allocate(2, iota_tokens(17));  // 5 blocks > pool of 4
        FAIL() << "no error";
    } catch (const OutOfBlocksError&) {
        FAIL() << "a request larger than the pool is not a transient shortage";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("whole pool has 4 blocks"), std::string::npos)
            << e.what();
    }
    EXPECT_THROW(m.allocate(1, iota_tokens(2)), Error);  // id in use
    EXPECT_THROW(m.free(7), Error);                      // unknown
    EXPECT_THROW(m.append(7, iota_tokens(1)), Error);
    EXPECT_THROW(m.append(1, iota_tokens(20)), Error);  // beyond the pool
    m.free(1);
    EXPECT_THROW(m.free(1), Error);  // double free
    m.check_invariants();
    const auto after = m.metrics();
    EXPECT_EQ(after.queries, before.queries);
    EXPECT_EQ(after.used_blocks, 0);
    EXPECT_EQ(after.cached_blocks + after.free_blocks, 4);
}

TEST(BlockManager, DisabledPrefixCacheNeverShares) {
    BlockManager m({8, 4, false});
    m.allocate(1, iota_tokens(8));
    EXPECT_EQ(m.allocate(2, iota_tokens(8)).cached_tokens, 0);
    m.free(1);
    EXPECT_EQ(m.metrics().cached_blocks, 0);
    EXPECT_EQ(m.lookup(iota_tokens(8)).num_tokens, 0);
    m.check_invariants();
}

TEST(BlockManager, PagedKvDescribesTheBlockTables) {
    auto m = make(8);
    m.allocate(1, iota_tokens(9));
    m.allocate(2, iota_tokens(4, 50));
    const std::vector<SeqId> ids{1, 2};
    const PagedKv kv = m.paged_kv(ids);
    EXPECT_EQ(kv.indptr, (std::vector<int32_t>{0, 3, 4}));
    EXPECT_EQ(kv.last_page_len, (std::vector<int32_t>{1, 4}));
    EXPECT_EQ(kv.seq_len(0, 4), 9);
    EXPECT_EQ(kv.seq_len(1, 4), 4);
}

}  // namespace
}  // namespace kvshard
