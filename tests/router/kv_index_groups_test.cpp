// KvIndex with KV cache groups (hybrid models): the overlap is the longest prefix every group of
// a replica serves; checked on small cases and against a naive reference under random events.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

#include "kvshard/common/error.h"
#include "kvshard/router/kv_index.h"

namespace kvshard {
namespace {

BlockHash h(uint64_t id) { return BlockHash{id * 0x9E3779B97F4A7C15ull + 1, id}; }

std::vector<BlockHash> chain(std::vector<uint64_t> ids) {
    std::vector<BlockHash> out;
    for (uint64_t id : ids) out.push_back(h(id));
    return out;
}

std::vector<int> overlaps(const KvIndex& idx, const std::vector<BlockHash>& q) {
    std::vector<int> out(static_cast<size_t>(idx.num_replicas()), -1);
    idx.prefix_overlap(q, out);
    return out;
}

TEST(KvIndexGroups, EveryFullAttentionGroupMustHoldThePrefix) {
    KvIndex idx(2);
    idx.block_stored(0, chain({1, 2, 3, 4}), 0);
    idx.block_stored(0, chain({1, 2}), 1);
    idx.block_stored(1, chain({1, 2, 3}), 0);
    idx.block_stored(1, chain({1, 2, 3}), 1);
    // Group 0 alone would say {4, 3}; group 1 of replica 0 holds only 2.
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4})), (std::vector<int>{2, 3}));
    idx.block_removed(1, chain({2}), 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4})), (std::vector<int>{2, 1}));
    EXPECT_EQ(idx.num_blocks(1), 5);
    EXPECT_EQ(idx.num_blocks(1, 1), 2);
    EXPECT_EQ(idx.num_hashes(), 4 + 3);  // (hash, group) pairs: group 0 {1..4}, group 1 {1, 2, 3}
    // A group with every block removed still bounds the overlap: it holds nothing.
    idx.block_removed(0, chain({1, 2}), 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4}))[0], 0);
    EXPECT_THROW(idx.block_stored(0, chain({1}), KvIndex::kMaxGroups), Error);
    EXPECT_THROW(idx.block_stored(0, chain({1}), -1), Error);
}

TEST(KvIndexGroups, AWindowedGroupNeedsOnlyTheBlocksBeforeTheHit) {
    KvIndex idx(1);
    idx.block_stored(0, chain({1, 2, 3, 4, 5, 6}), 0);
    idx.set_group_window(0, 1, 2);
    idx.block_stored(0, chain({3, 4, 6}), 1);  // blocks 1, 2 and 5 left the window and went
    // 6 blocks: the window before 6 is {5, 6}; 5 is gone. Before 4: {3, 4}, held.
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6})), (std::vector<int>{4}));
    idx.block_stored(0, chain({5}), 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6})), (std::vector<int>{6}));
    // The fixed point: group 0 lost block 5, so 4 is the most it serves; the window before 4
    // is held.
    idx.block_removed(0, chain({5}), 0);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6})), (std::vector<int>{4}));
    // A window of 0 blocks never limits the overlap.
    idx.set_group_window(0, 1, 0);
    idx.block_removed(0, chain({3, 4}), 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4})), (std::vector<int>{4}));
    // Back to full attention: group 1 holds {5, 6} only, no prefix.
    idx.set_group_full(0, 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4})), (std::vector<int>{0}));
    EXPECT_THROW(idx.set_group_window(0, 1, -1), Error);
}

// vLLM's hash_block_size: a group whose blocks are s router blocks publishes, for its block j,
// the request's hash (j + 1) * s - 1; it serves k when s divides k, and hits are multiples of the
// LCM of the scales.
TEST(KvIndexGroups, AGroupWithLargerBlocksIsLookedUpAtTheEndsOfItsBlocks) {
    KvIndex idx(1);
    idx.block_stored(0, chain({1, 2, 3, 4, 5, 6, 7}), 0);
    idx.set_group_block_scale(0, 1, 3);
    idx.block_stored(0, chain({3, 6}), 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6, 7})), (std::vector<int>{6}));
    // Group 1 holds the hash at the end of its block 0 only.
    idx.block_removed(0, chain({6}), 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6, 7})), (std::vector<int>{3}));
    // Group 0 at scale 2: hits are multiples of lcm(2, 3) = 6 blocks.
    idx.block_stored(0, chain({6}), 1);
    idx.set_group_block_scale(0, 0, 2);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6, 7})), (std::vector<int>{6}));
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5})), (std::vector<int>{0}));
    // A windowed group of scale 3 and 1 block: only its block before the hit.
    idx.set_group_block_scale(0, 0, 1);
    idx.block_removed(0, chain({3}), 1);
    idx.set_group_window(0, 1, 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6, 7})), (std::vector<int>{6}));
    EXPECT_EQ(idx.group_block_scale(0, 1), 3);
    // The scale describes the model: kept across a clear.
    idx.all_cleared(0);
    EXPECT_EQ(idx.group_block_scale(0, 1), 3);
    EXPECT_EQ(idx.group_block_scale(0, 9), 1);
    EXPECT_THROW(idx.set_group_block_scale(0, 1, 0), Error);
}

// Randomized: the index against a naive reference that tries every k from the longest down and
// checks each group's rule directly. With scales (groups of larger blocks, 1 to 3 router blocks), a
// group serves k when its scale s divides k and its rule holds on its own blocks, block j being the
// query's hash (j + 1) * s - 1; k must be a multiple of the LCM of the scales of the groups that
// take part.
// With eagle, the even replicas drop the EAGLE block (set_eagle_block_drop): a full-attention or
// windowed group serves k when it would serve k + s without the drop, with its window one block
// longer, and that block lies within the query (the cap); a window-0 group is unchanged.
void matches_naive_reference(uint64_t seed, int n, int qlen, int max_window, bool scales,
                             bool eagle = false) {
    std::mt19937_64 rng(seed);
    const int groups = 3, ids = 12;
    KvIndex idx(n);
    for (int r = 0; r < n; ++r) idx.set_eagle_block_drop(r, eagle && r % 2 == 0);
    // A multiset: a hash stored twice is two copies, held until removed twice (vLLM's BlockPool).
    std::vector<std::vector<std::multiset<uint64_t>>> ref(
        n, std::vector<std::multiset<uint64_t>>(groups));
    std::vector<uint64_t> present(n, 0);
    std::vector<std::vector<int>> window(n, std::vector<int>(groups, -1));
    std::vector<std::vector<int>> scale(n, std::vector<int>(groups, 1));
    for (int step = 0; step < 6000; ++step) {
        const int r = static_cast<int>(rng() % n);
        const int g = static_cast<int>(rng() % groups);
        const uint64_t id = rng() % ids;
        const auto op = rng() % 20;
        if (op < 10) {
            idx.block_stored(r, chain({id}), g);
            ref[r][g].insert(id);
            present[r] |= uint64_t{1} << g;
        } else if (op < 16) {
            idx.block_removed(r, chain({id}), g);
            if (const auto it = ref[r][g].find(id); it != ref[r][g].end()) ref[r][g].erase(it);
        } else if (op == 16) {
            const int w = static_cast<int>(rng() % (max_window + 2)) - 1;  // -1: full attention
            if (w < 0) {
                idx.set_group_full(r, g);
            } else {
                idx.set_group_window(r, g, w);
            }
            window[r][g] = w;
        } else if (op < 19) {
            if (!scales) continue;
            const int sc = 1 + static_cast<int>(rng() % 3);
            idx.set_group_block_scale(r, g, sc);
            scale[r][g] = sc;
        } else if (rng() % 8 == 0) {
            idx.all_cleared(r);
            for (auto& st : ref[r]) st.clear();
            present[r] = 0;
        }
        std::vector<uint64_t> qi;
        for (int k = 0; k < qlen; ++k) qi.push_back(rng() % 3 == 0 ? rng() % ids : k);
        const auto got = overlaps(idx, chain(qi));
        for (int i = 0; i < n; ++i) {
            auto takes_part = [&](int gg) { return gg == 0 || (present[i] >> gg & 1); };
            auto serves = [&](int gg, int k) {
                const int sc = scale[i][gg];
                if (k % sc != 0) return false;
                const int e = eagle && i % 2 == 0 && window[i][gg] != 0 ? 1 : 0;
                const int m = k / sc + e;
                if (m * sc > qlen) return false;
                const int w = window[i][gg] < 0 ? -1 : window[i][gg] + e;
                const int from = w < 0 ? 0 : std::max(0, m - w);
                for (int j = from; j < m; ++j)
                    if (!ref[i][gg].count(qi[static_cast<size_t>((j + 1) * sc - 1)])) return false;
                return true;
            };
            int want = qlen;
            for (; want > 0; --want) {
                bool ok = true;
                for (int gg = 0; gg < groups && ok; ++gg)
                    if (takes_part(gg)) ok = serves(gg, want);  // (each scale divides want)
                if (ok) break;
            }
            ASSERT_EQ(got[static_cast<size_t>(i)], want) << "step " << step << " replica " << i;
        }
    }
}

TEST(KvIndexGroups, MatchesNaiveReferenceUnderRandomEvents) {
    matches_naive_reference(7, 4, 8, 3, false);
}

TEST(KvIndexGroups, MatchesNaiveReferenceWithLargerBlockGroups) {
    matches_naive_reference(11, 3, 12, 2, true);
}

TEST(KvIndexGroups, MatchesNaiveReferenceWithTheEagleBlockDrop) {
    matches_naive_reference(13, 4, 8, 3, false, true);
    matches_naive_reference(17, 3, 12, 2, true, true);
}

// vLLM with EAGLE/MTP (vllm/v1/core/single_type_kv_cache_manager.py, find_longest_cache_hit with
// drop_eagle_block): a full-attention group pops its last matched block, then the hit is rounded
// down to the alignment; a sliding-window group needs one more contiguous block and pops it
// (SlidingWindowManager: sliding_window_contiguous_blocks + 1).
TEST(KvIndexGroups, TheEagleDropTakesOneBlockPerGroupThenAligns) {
    KvIndex idx(2);
    for (int r = 0; r < 2; ++r) {
        idx.block_stored(r, chain({1, 2, 3, 4, 5, 6}), 0);
        idx.set_group_window(r, 1, 2);
        idx.block_stored(r, chain({3, 4, 6}), 1);
    }
    idx.set_eagle_block_drop(0, true);
    EXPECT_TRUE(idx.eagle_block_drop(0));
    EXPECT_FALSE(idx.eagle_block_drop(1));
    // Replica 1 (no drop): 4 (the window before 4, {3, 4}, is held; before 6, 5 is missing).
    // Replica 0: the window of 3 blocks up to and including block j must be held: j = 3 needs
    // {2, 3, 4} (2 is gone), j = 2 needs {1, 2, 3}, j = 1 needs {1, 2}, j = 0 needs {1}: none.
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6})), (std::vector<int>{0, 4}));
    idx.block_stored(0, chain({2}), 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6})), (std::vector<int>{3, 4}));
    idx.block_stored(0, chain({5}), 1);
    // Blocks 4, 5, 6 held: j = 5 needs block index 5 (hash 6) plus 3, 4: held, but j + 1 = 6
    // blocks must lie within the 6 hashes given: j = 5 is allowed. Group 0 pops 6 -> 5.
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6})), (std::vector<int>{5, 4}));
    // A cap of 5 hashes: group 0 walks 5 and pops 1: 4. Replica 1 does not hold hash 5 in
    // group 1: 4 as well, by its window.
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5})), (std::vector<int>{4, 4}));
    // Group 0 with blocks of 2 router blocks: hits are multiples of 2; group 0 walks its blocks
    // {1,2} {3,4} {5,6}, pops one: 2 of them = 4 router blocks, aligned.
    idx.set_group_block_scale(0, 0, 2);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5, 6}))[0], 4);
    // 5 hashes: group 0 walks 2 blocks, pops one: 2; the windowed group then needs its blocks
    // 0..2 (a run from the start shorter than its window + 1), and hash 1 is not held: 0.
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5}))[0], 0);
    idx.block_stored(0, chain({1}), 1);
    EXPECT_EQ(overlaps(idx, chain({1, 2, 3, 4, 5}))[0], 2);
    // Kept across a clear (it is the engine's configuration).
    idx.all_cleared(0);
    EXPECT_TRUE(idx.eagle_block_drop(0));
}

}  // namespace
}  // namespace kvshard
