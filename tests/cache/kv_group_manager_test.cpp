// KvGroupManager: one block table per KV group. Windows bounded and equal to request_kv_bytes at
// every length; hybrid prefix hits against a brute-force search; and a model-based randomized test
// against a naive reference (as tests/cache/block_manager_model_test.cpp does for one group).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <unordered_map>

#include "kvshard/cache/kv_group_manager.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/layout/parallel_config.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

bool is_windowed(LayerKind k) {
    return k == LayerKind::kSlidingWindow || k == LayerKind::kChunkedLocal;
}

// The test's own statement of the window rule (docs/cache.md, "KV groups").
int64_t want_keep_from(const KvGroupPoolSpec& g, int bs, int64_t c, int64_t len) {
    if (!is_windowed(g.kind)) return 0;
    return first_kept_position(g.kind, g.window, c < len ? c + 1 : len) / bs;
}

std::vector<int32_t> ramp(int n, int32_t start = 0) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = start + i;
    return t;
}

TEST(KvGroupManager, RefusesBadConfigs) {
    auto msg = [](KvGroupManagerConfig c) {
        try {
            KvGroupManager m(std::move(c));
        } catch (const Error& e) {
            return std::string(e.what());
        }
        return std::string();
    };
    EXPECT_NE(msg({}).find("at least one group"), std::string::npos);
    EXPECT_NE(msg({.groups = {{LayerKind::kSlidingWindow, 0, 8}}}).find("window of at least 1"),
              std::string::npos);
    EXPECT_NE(msg({.groups = {{LayerKind::kFullAttention, 0, 0}}}).find("at least one block"),
              std::string::npos);
    // State groups: prefix reuse refused (no states saved at block boundaries).
    const std::string s =
        msg({.groups = {{LayerKind::kFullAttention, 0, 8}, {LayerKind::kGatedDeltaNet, 0, 4}}});
    EXPECT_NE(s.find("recurrent state"), std::string::npos) << s;
    EXPECT_NE(s.find("enable_prefix_cache = false"), std::string::npos) << s;
    EXPECT_TRUE(msg({.groups = {{LayerKind::kFullAttention, 0, 8}, {LayerKind::kMamba2, 0, 4}},
                     .enable_prefix_cache = false})
                    .empty());
}

// A sequence growing one token at a time far past the window: the windowed groups' resident
// blocks stay at most ceil(W / bs) + 1 and equal ceil(L / bs) - floor(first_kept / bs); the table
// keeps one entry per block of the sequence, kNullBlock before the window.
TEST(KvGroupManager, WindowedGroupsStayBoundedAsTheSequenceGrows) {
    const int bs = 4;
    for (const bool deferred : {false, true}) {
        KvGroupManager m({.groups = {{LayerKind::kFullAttention, 0, 64},
                                     {LayerKind::kSlidingWindow, 10, 5},
                                     {LayerKind::kChunkedLocal, 8, 4}},
                          .block_size = bs,
                          .deferred_commit = deferred});
        m.allocate(1, ramp(3));
        m.commit(1, 3);
        int64_t most_sliding = 0;
        for (int len = 4; len <= 240; ++len) {
            const int32_t tok = len;
            m.append(1, std::span<const int32_t>(&tok, 1));
            m.commit(1, len);
            m.check_invariants();
            const int64_t blocks = (len + bs - 1) / bs;
            EXPECT_EQ(m.resident_blocks(0, 1), blocks);
            for (int g : {1, 2}) {
                const KvGroupPoolSpec& spec = m.group(g);
                const auto t = m.block_table(g, 1);
                ASSERT_EQ(static_cast<int64_t>(t.size()), blocks);
                const int64_t first = first_kept_position(spec.kind, spec.window, len) / bs;
                EXPECT_EQ(m.resident_blocks(g, 1), blocks - first) << "length " << len;
                EXPECT_LE(m.resident_blocks(g, 1), (spec.window + bs - 1) / bs + 1);
                for (int64_t i = 0; i < blocks; ++i)
                    EXPECT_EQ(t[static_cast<size_t>(i)] == kNullBlock, i < first);
                EXPECT_EQ(m.num_used_blocks(g), m.resident_blocks(g, 1));
            }
            most_sliding = std::max(most_sliding, m.resident_blocks(1, 1));
        }
        EXPECT_EQ(most_sliding, 10 / bs + 1 + 1);  // ceil(10 / 4) + 1: the window straddles
        // A pool of 5 sliding blocks served 60 blocks' worth of sequence.
        m.free(1);
        EXPECT_EQ(m.num_used_blocks(1), 0);
        m.check_invariants();
    }
}

// Deferred commit: the prefill keeps every block (its own queries need their windows) until the
// commit; then only the window stays.
TEST(KvGroupManager, DeferredCommitKeepsThePrefillWindowsUntilCommitted) {
    KvGroupManager m(
        {.groups = {{LayerKind::kSlidingWindow, 6, 16}}, .block_size = 2, .deferred_commit = true});
    std::vector<KvEvent> ev;
    m.subscribe([&](const KvEvent& e) { ev.push_back(e); });
    m.allocate(1, ramp(20));
    EXPECT_EQ(m.resident_blocks(0, 1), 10);
    EXPECT_TRUE(ev.empty());
    m.commit(1, 9);  // the next query (position 9) sees 4..9
    EXPECT_EQ(m.resident_blocks(0, 1), 10 - 2);
    m.commit(1, 20);
    EXPECT_EQ(m.resident_blocks(0, 1), 3);  // tokens 14..19
    m.check_invariants();
    // Everything committed was published in group 0, including the blocks now out of the window
    // (cached: another request may still start from them).
    int64_t stored = 0;
    for (const KvEvent& e : ev) {
        EXPECT_EQ(e.kind, KvEventKind::kBlockStored);
        EXPECT_EQ(e.group, 0);
        stored += static_cast<int64_t>(e.block_ids.size());
    }
    EXPECT_EQ(stored, 10);
    EXPECT_EQ(m.num_available_blocks(0), 16 - 3);
}

// Every rank's bytes (per group: resident blocks * block bytes, states) equal request_kv_bytes at
// every length, for each catalog model with more than one KV group.
TEST(KvGroupManager, BytesEqualRequestKvBytesAtEveryLength) {
    const int bs = 4;
    int models = 0;
    for (const std::string& name : catalog_names()) {
        const ModelSpec spec = catalog_model(name);
        if (kv_groups(spec).size() < 2) continue;
        ++models;
        for (const std::string par : {"tp=1", "tp=2,pp=2"}) {
            const ParallelConfig p = parse_parallel_config(par);
            KvLayout layout;
            try {
                layout = make_layout(spec, p);
            } catch (const Error&) {
                continue;  // the model does not split this way
            }
            for (int r = 0; r < layout.world_size(); ++r) {
                SCOPED_TRACE(name + " " + par + " rank " + std::to_string(r));
                const auto& groups = layout.ranks[static_cast<size_t>(r)].groups;
                if (groups.empty()) continue;
                std::vector<KvGroupPoolSpec> specs;
                for (const RankKvGroup& g : groups) specs.push_back({g.kind, g.window, 4096});
                KvGroupManager m(
                    {.groups = specs,
                     .block_size = bs,
                     .enable_prefix_cache = kv_group_prefix_cache_unsupported(specs).empty(),
                     .deferred_commit = true});
                m.allocate(1, ramp(1));
                m.commit(1, 1);
                for (int64_t len = 1; len <= 3000; len += 1 + len / 7) {
                    if (len > m.num_tokens(1)) {
                        m.append(1, ramp(static_cast<int>(len - m.num_tokens(1))));
                        m.commit(1, len);
                    }
                    int64_t bytes = 0;
                    for (size_t g = 0; g < groups.size(); ++g) {
                        const int64_t held = m.resident_blocks(static_cast<int>(g), 1);
                        bytes += holds_state(groups[g].kind)
                                     ? held * groups[g].state_bytes_per_sequence
                                     : held * (bs * groups[g].bytes_per_token +
                                               groups[g].scale_bytes_per_block);
                    }
                    ASSERT_EQ(bytes, request_kv_bytes(layout, r, len, bs)) << "length " << len;
                }
                m.check_invariants();
            }
        }
    }
    EXPECT_GT(models, 0) << "the catalog has no model with several KV groups";
}

TEST(KvGroupManager, HybridHitIsTheLongestPrefixEveryGroupServes) {
    const int bs = 4;
    KvGroupManager m(
        {.groups = {{LayerKind::kFullAttention, 0, 64}, {LayerKind::kSlidingWindow, 8, 64}},
         .block_size = bs});
    const auto a = ramp(40);
    m.allocate(1, a);
    m.free(1);
    // All 10 blocks cached in the full group; the sliding group (committed at once) only ever took
    // blocks 8, 9 (tokens 32..39, the last window), which is all a hit of 10 blocks needs there.
    EXPECT_EQ(m.lookup(a), 40);
    EXPECT_EQ(m.lookup(std::vector<int32_t>(a.begin(), a.begin() + 36)), 0)
        << "a hit of 9 blocks needs the sliding group's blocks 7, 8 and block 7 was never taken";
    KvGroupManager n(
        {.groups = {{LayerKind::kFullAttention, 0, 64}, {LayerKind::kSlidingWindow, 8, 3}},
         .block_size = bs});
    n.allocate(1, a);  // the sliding group only ever holds 3 blocks: the others were never taken
    const auto h = hash_token_blocks(a, bs);
    EXPECT_EQ(n.group_hit_blocks(0, h, 40, -1), 10);
    // Sliding: blocks 8, 9 are cached (held), so a hit of 10 blocks needs [keep_from(40, 40), 10)
    // = [8, 10): served; a hit of 9 needs [keep_from(36), 9) = [7, 9): block 7 was never taken.
    EXPECT_EQ(n.group_hit_blocks(1, h, 40, -1), 10);
    EXPECT_EQ(n.group_hit_blocks(1, h, 41, 9), 0);
    EXPECT_EQ(n.hybrid_hit_blocks(h, 40), 10);
    // A query continuing past the prompt resumes at 40 and needs [keep_from(41), 10) = [8, 10).
    EXPECT_EQ(n.hybrid_hit_blocks(h, 44), 10);
    n.free(1);
    auto b = a;
    b.push_back(7);
    const auto r = n.allocate(2, b);
    EXPECT_EQ(r.cached_tokens, 40);
    const auto t = n.block_table(1, 2);
    ASSERT_EQ(t.size(), 11u);
    EXPECT_EQ(t[7], kNullBlock);
    EXPECT_NE(t[8], kNullBlock);
    n.check_invariants();
}

TEST(KvGroupManager, EventsNameTheGroupAndRoundTripThroughJson) {
    KvGroupManager m(
        {.groups = {{LayerKind::kFullAttention, 0, 8}, {LayerKind::kSlidingWindow, 4, 8}},
         .block_size = 2});
    std::vector<KvEvent> ev;
    m.subscribe([&](const KvEvent& e) { ev.push_back(e); });
    m.allocate(1, ramp(6));
    ASSERT_EQ(ev.size(), 2u);
    EXPECT_EQ(ev[0].group, 0);
    EXPECT_EQ(ev[1].group, 1);
    // The same chained hashes in every group; the sliding group (window 4) holds blocks 1, 2 only.
    ASSERT_EQ(ev[0].block_hashes.size(), 3u);
    EXPECT_EQ(ev[1].block_hashes,
              std::vector<BlockHash>(ev[0].block_hashes.begin() + 1, ev[0].block_hashes.end()));
    EXPECT_EQ(ev[1].parent_hash, ev[0].block_hashes[0]);
    EXPECT_EQ(ev[1].seq, ev[0].seq + 1);
    const std::string line = to_json_line(ev[1]);
    EXPECT_NE(line.find(",\"group\":1}"), std::string::npos) << line;
    EXPECT_EQ(kv_event_from_json(line), ev[1]);
    EXPECT_EQ(to_json_line(ev[0]).find("group"), std::string::npos) << "group 0 lines unchanged";
}

// ---------------------------------------------------------------- model-based randomized test

struct GroupParams {
    uint32_t seed;
    int block_size;
    std::vector<KvGroupPoolSpec> groups;
    bool deferred;
    bool prefix_cache = true;
};

struct RefGroup {
    std::vector<int32_t> ref;
    std::vector<std::optional<BlockHash>> reg;
    std::vector<bool> written;
    std::vector<std::vector<int32_t>> content;
    // hash -> registered copies, oldest first (a lookup finds the front: vLLM's get_one_block).
    std::unordered_map<BlockHash, std::vector<BlockId>, BlockHashHasher> index;
    std::list<BlockId> lru;
    int64_t free_count() const {
        int64_t n = 0;
        for (size_t b = 0; b < ref.size(); ++b) n += ref[b] == 0 && !reg[b];
        return n;
    }
    int64_t available() const { return free_count() + static_cast<int64_t>(lru.size()); }
};

struct RefSeq {
    std::vector<int32_t> tokens;
    std::vector<std::vector<BlockId>> tables;
    int64_t committed = 0;
    int base = 0;
};

class GroupModel {
  public:
    GroupModel(const GroupParams& p, KvGroupManager& m) : p_(p), m_(m), rng_(p.seed) {
        for (const auto& g : p.groups) {
            RefGroup r;
            const auto n = static_cast<size_t>(g.num_blocks);
            r.ref.assign(n, 0);
            r.reg.assign(n, std::nullopt);
            r.written.assign(n, false);
            r.content.assign(n, {});
            groups_.push_back(std::move(r));
        }
        for (auto& b : bases_) {
            b.resize(160);
            for (auto& t : b) t = pick(0, 3);
        }
        m_.subscribe([this](const KvEvent& e) { events_.push_back(e); });
        m_.subscribe([this](const KvEvent& e) { consumer_.apply(e); });
    }

    void step() {
        const int op = pick(0, 99);
        if (op < 30)
            allocate();
        else if (op < 55)
            append();
        else if (op < 70)
            free_one();
        else if (op < 80)
            lookup();
        else if (op < 95)
            commit_one();
        else
            bad_input();
        compare();
    }

    void drain() {
        while (!seqs_.empty()) {
            do_free(seqs_.begin()->first);
            compare();
        }
        for (int g = 0; g < ngroups(); ++g) EXPECT_EQ(m_.num_used_blocks(g), 0);
    }

    int64_t hits = 0, window_hits = 0, evictions = 0, oob = 0, commits = 0;
    int64_t copies_registered = 0;  // blocks registered beside another copy of their hash

  private:
    int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
    int ngroups() const { return static_cast<int>(p_.groups.size()); }
    int64_t blocks_for(int64_t n) const { return (n + p_.block_size - 1) / p_.block_size; }
    bool state(int g) const { return holds_state(p_.groups[static_cast<size_t>(g)].kind); }
    int64_t keep(int g, int64_t c, int64_t len) const {
        return want_keep_from(p_.groups[static_cast<size_t>(g)], p_.block_size, c, len);
    }
    std::vector<int32_t> block_tokens(const std::vector<int32_t>& t, int64_t i) const {
        const auto bs = static_cast<size_t>(p_.block_size);
        return {t.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(i) * bs),
                t.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(i + 1) * bs)};
    }

    // Brute force: the longest k every group serves, by each group's definition.
    bool serves(int g, const std::vector<BlockHash>& h, int64_t len, int64_t k) const {
        if (k == 0) return true;
        if (state(g)) return false;
        const RefGroup& r = groups_[static_cast<size_t>(g)];
        for (int64_t i = keep(g, k * p_.block_size, len); i < k; ++i)
            if (!r.index.count(h[static_cast<size_t>(i)])) return false;
        return true;
    }
    int64_t naive_hit(const std::vector<BlockHash>& h, int64_t len, int64_t cap) const {
        if (!p_.prefix_cache) return 0;
        int64_t k = static_cast<int64_t>(h.size());
        if (cap >= 0) k = std::min(k, cap);
        for (; k > 0; --k) {
            bool all = true;
            for (int g = 0; g < ngroups() && all; ++g) all = serves(g, h, len, k);
            if (all) return k;
        }
        return 0;
    }

    std::vector<KvEvent> take_events() {
        std::vector<KvEvent> e;
        e.swap(events_);
        return e;
    }

    void release(int g, BlockId b) {
        RefGroup& r = groups_[static_cast<size_t>(g)];
        auto& rc = r.ref[static_cast<size_t>(b)];
        ASSERT_GT(rc, 0);
        if (--rc > 0) return;
        if (r.reg[static_cast<size_t>(b)])
            r.lru.push_back(b);
        else
            r.written[static_cast<size_t>(b)] = false;
    }

    // A fresh block the manager took for entry i: unused before; when it was cached, it must be
    // the least recently used (an eviction, expected in removed[g]).
    void take(int g, BlockId b, const std::vector<int32_t>& tokens, int64_t i,
              std::vector<std::vector<BlockId>>& removed) {
        RefGroup& r = groups_[static_cast<size_t>(g)];
        const auto ub = static_cast<size_t>(b);
        ASSERT_EQ(r.ref[ub], 0) << "a fresh block was in use";
        if (r.reg[ub]) {
            ASSERT_EQ(r.free_count(), 0) << "evicted while free blocks remained";
            ASSERT_EQ(r.lru.front(), b) << "eviction is not least-recently-used first";
            r.lru.pop_front();
            auto& copies = r.index.at(*r.reg[ub]);
            copies.erase(std::find(copies.begin(), copies.end(), b));
            if (copies.empty()) r.index.erase(*r.reg[ub]);
            r.reg[ub].reset();
            removed[static_cast<size_t>(g)].push_back(b);
            ++evictions;
        }
        r.ref[ub] = 1;
        r.written[ub] = false;
        r.content[ub] = state(g) || (i + 1) * p_.block_size > static_cast<int64_t>(tokens.size())
                            ? std::vector<int32_t>{}
                            : block_tokens(tokens, i);
    }

    // Tokens [s.committed, n) written: blocks become written and registered, beside any copy of
    // their hash the group holds already (vLLM's cache_full_blocks; expected in stored[g]), then
    // the windows drop what they no longer need.
    void commit_ref(RefSeq& s, int64_t n, std::vector<std::vector<BlockId>>& stored) {
        if (n > s.committed) {
            const auto h = hash_token_blocks(s.tokens, p_.block_size);
            for (int g = 0; g < ngroups(); ++g) {
                if (state(g)) continue;
                RefGroup& r = groups_[static_cast<size_t>(g)];
                for (int64_t i = s.committed / p_.block_size; i < n / p_.block_size; ++i) {
                    const BlockId b = s.tables[static_cast<size_t>(g)][static_cast<size_t>(i)];
                    if (b == kNullBlock) continue;
                    const auto ub = static_cast<size_t>(b);
                    r.written[ub] = true;
                    r.content[ub] = block_tokens(s.tokens, i);
                    if (!p_.prefix_cache) continue;
                    copies_registered += r.index.count(h[static_cast<size_t>(i)]) != 0;
                    r.reg[ub] = h[static_cast<size_t>(i)];
                    r.index[h[static_cast<size_t>(i)]].push_back(b);
                    stored[static_cast<size_t>(g)].push_back(b);
                }
            }
            s.committed = n;
        }
        drop(s);
    }

    void drop(RefSeq& s) {
        const auto len = static_cast<int64_t>(s.tokens.size());
        for (int g = 0; g < ngroups(); ++g) {
            if (state(g)) continue;
            auto& t = s.tables[static_cast<size_t>(g)];
            for (int64_t i = 0;
                 i < std::min<int64_t>(keep(g, s.committed, len), static_cast<int64_t>(t.size()));
                 ++i) {
                if (t[static_cast<size_t>(i)] == kNullBlock) continue;
                release(g, t[static_cast<size_t>(i)]);
                t[static_cast<size_t>(i)] = kNullBlock;
            }
        }
    }

    // The events of one operation, split by group, must be exactly the expected evictions and
    // stores; a stored hash must be the hash of the block's tokens under its parent.
    void check_events(const std::vector<std::vector<BlockId>>& removed,
                      const std::vector<std::vector<BlockId>>& stored) {
        std::vector<std::vector<BlockId>> got_removed(removed.size()), got_stored(stored.size());
        for (const KvEvent& e : take_events()) {
            ASSERT_EQ(e.seq, next_event_++);
            ASSERT_TRUE(e.group >= 0 && e.group < ngroups());
            const auto g = static_cast<size_t>(e.group);
            if (e.kind == KvEventKind::kBlockRemoved) {
                got_removed[g].insert(got_removed[g].end(), e.block_ids.begin(), e.block_ids.end());
                continue;
            }
            ASSERT_EQ(e.kind, KvEventKind::kBlockStored);
            BlockHash parent = e.parent_hash.value_or(kRootParentHash);
            for (size_t j = 0; j < e.block_ids.size(); ++j) {
                const auto b = static_cast<size_t>(e.block_ids[j]);
                ASSERT_TRUE(groups_[g].written[b]) << "BlockStored before the KV was written";
                ASSERT_EQ(hash_block(parent, groups_[g].content[b]), e.block_hashes[j]);
                parent = e.block_hashes[j];
            }
            got_stored[g].insert(got_stored[g].end(), e.block_ids.begin(), e.block_ids.end());
        }
        ASSERT_EQ(got_removed, removed);
        ASSERT_EQ(got_stored, stored);
    }

    std::vector<int32_t> make_prompt(int& base, int max_len) {
        base = pick(0, static_cast<int>(bases_.size()) - 1);
        const int shared = pick(0, max_len);
        std::vector<int32_t> t(bases_[static_cast<size_t>(base)].begin(),
                               bases_[static_cast<size_t>(base)].begin() + shared);
        const int own = pick(0, 2) == 0 ? pick(0, 8) : 0;
        for (int i = 0; i < own; ++i) t.push_back(pick(0, 3));
        return t;
    }

    void allocate() {
        int base = 0;
        const auto tokens = make_prompt(base, pick(0, 7) == 0 ? 120 : 40);
        const auto len = static_cast<int64_t>(tokens.size());
        const auto h = hash_token_blocks(tokens, p_.block_size);
        const int64_t cap = pick(0, 4) == 0 ? pick(0, static_cast<int>(h.size())) : -1;
        const int64_t k = naive_hit(h, len, cap);
        ASSERT_EQ(m_.hybrid_hit_blocks(h, len, cap), k);
        const int64_t c = p_.deferred ? k * p_.block_size : len;
        bool too_large = false, short_now = false;
        for (int g = 0; g < ngroups(); ++g) {
            const RefGroup& r = groups_[static_cast<size_t>(g)];
            const int64_t cap_g = p_.groups[static_cast<size_t>(g)].num_blocks;
            if (state(g)) {
                short_now = short_now || (len > 0 && r.available() < 1);
                continue;
            }
            const int64_t total = blocks_for(len), first = keep(g, c, len);
            if (total - first > cap_g) too_large = true;
            int64_t need = total - std::max(first, k);
            for (int64_t i = first; i < k; ++i)
                need +=
                    r.ref[static_cast<size_t>(r.index.at(h[static_cast<size_t>(i)]).front())] == 0;
            short_now = short_now || need > r.available();
        }
        ASSERT_EQ(m_.can_allocate(tokens, {}, cap), !too_large && !short_now);
        const SeqId id = next_id_++;
        std::optional<GroupAllocResult> result;
        try {
            result = m_.allocate(id, tokens, {}, cap);
            ASSERT_FALSE(too_large || short_now);
            ASSERT_EQ(result->cached_blocks, k);
            ASSERT_EQ(result->cached_tokens, k * p_.block_size);
        } catch (const OutOfBlocksError&) {
            ASSERT_TRUE(short_now && !too_large);
            ++oob;
            ASSERT_TRUE(take_events().empty());
            return;
        } catch (const Error&) {
            ASSERT_TRUE(too_large);
            ASSERT_TRUE(take_events().empty());
            return;
        }
        hits += k;
        const GroupAllocResult res = *result;
        RefSeq s;
        s.tokens = tokens;
        s.base = base;
        s.committed = k * p_.block_size;
        std::vector<std::vector<BlockId>> removed(groups_.size()), stored(groups_.size());
        std::vector<int64_t> fresh(groups_.size(), 0);
        for (int g = 0; g < ngroups(); ++g) {
            const auto t = m_.block_table(g, id);
            s.tables.emplace_back(t.begin(), t.end());
            for (int64_t i = std::max(keep(g, c, len), k); !state(g) && i < blocks_for(len); ++i)
                ++fresh[static_cast<size_t>(g)];
            if (state(g)) fresh[static_cast<size_t>(g)] = len > 0 ? 1 : 0;
            RefGroup& r = groups_[static_cast<size_t>(g)];
            if (state(g)) {
                ASSERT_EQ(static_cast<int64_t>(t.size()), len > 0 ? 1 : 0);
                if (len > 0) take(g, t[0], tokens, 0, removed);
                continue;
            }
            const int64_t total = blocks_for(len), first = keep(g, c, len);
            ASSERT_EQ(static_cast<int64_t>(t.size()), total);
            for (int64_t i = 0; i < total; ++i) {
                const BlockId b = t[static_cast<size_t>(i)];
                if (i < first) {
                    ASSERT_EQ(b, kNullBlock) << "group " << g << " entry " << i;
                } else if (i < k) {
                    // A shared block: the query's tokens, written.
                    ASSERT_EQ(b, r.index.at(h[static_cast<size_t>(i)]).front());
                    ASSERT_TRUE(r.written[static_cast<size_t>(b)]) << "a hit on unwritten KV";
                    ASSERT_EQ(r.content[static_cast<size_t>(b)], block_tokens(tokens, i));
                    if (r.ref[static_cast<size_t>(b)]++ == 0) r.lru.remove(b);
                    if (is_windowed(p_.groups[static_cast<size_t>(g)].kind)) ++window_hits;
                } else {
                    ASSERT_NE(b, kNullBlock);
                    take(g, b, tokens, i, removed);
                }
            }
        }
        if (!p_.deferred) commit_ref(s, len, stored);
        check_events(removed, stored);
        seqs_.emplace(id, std::move(s));
        ASSERT_EQ(res.new_blocks, fresh);
    }

    void append() {
        if (seqs_.empty()) return;
        auto it = seqs_.begin();
        std::advance(it, pick(0, static_cast<int>(seqs_.size()) - 1));
        RefSeq& s = it->second;
        const int n = pick(0, 8) == 0 ? pick(10, 40) : pick(1, 4);
        std::vector<int32_t> add;
        const auto& base = bases_[static_cast<size_t>(s.base)];
        for (int i = 0; i < n; ++i) {
            const size_t pos = s.tokens.size() + add.size();
            add.push_back(pick(0, 1) && pos < base.size() ? base[pos] : pick(0, 3));
        }
        const auto old_len = static_cast<int64_t>(s.tokens.size());
        const int64_t len = old_len + n;
        const int64_t c = p_.deferred ? s.committed : len;
        bool too_large = false, short_now = false;
        for (int g = 0; g < ngroups(); ++g) {
            const RefGroup& r = groups_[static_cast<size_t>(g)];
            const auto& t = s.tables[static_cast<size_t>(g)];
            if (state(g)) {
                short_now = short_now || (t.empty() && r.available() < 1);
                continue;
            }
            const int64_t total = blocks_for(len), first = keep(g, c, len);
            if (total - first > p_.groups[static_cast<size_t>(g)].num_blocks) too_large = true;
            int64_t released = 0;
            for (int64_t i = 0; i < std::min<int64_t>(first, static_cast<int64_t>(t.size())); ++i)
                released += t[static_cast<size_t>(i)] != kNullBlock &&
                            r.ref[static_cast<size_t>(t[static_cast<size_t>(i)])] == 1;
            const int64_t need = total - std::max(first, static_cast<int64_t>(t.size()));
            short_now = short_now || need > r.available() + released;
        }
        ASSERT_EQ(m_.can_append(it->first, n), !too_large && !short_now);
        try {
            m_.append(it->first, add);
            ASSERT_FALSE(too_large || short_now);
        } catch (const OutOfBlocksError&) {
            ASSERT_TRUE(short_now && !too_large);
            ++oob;
            ASSERT_TRUE(take_events().empty());
            return;
        } catch (const Error&) {
            ASSERT_TRUE(too_large);
            ASSERT_TRUE(take_events().empty());
            return;
        }
        s.tokens.insert(s.tokens.end(), add.begin(), add.end());
        // The manager drops the windows first, then takes the new blocks.
        const int64_t committed_before = s.committed;
        if (!p_.deferred) s.committed = len;  // keep() of the drop uses the target
        drop(s);
        s.committed = committed_before;
        std::vector<std::vector<BlockId>> removed(groups_.size()), stored(groups_.size());
        for (int g = 0; g < ngroups(); ++g) {
            const auto t = m_.block_table(g, it->first);
            auto& mine = s.tables[static_cast<size_t>(g)];
            if (state(g)) {
                ASSERT_EQ(t.size(), 1u);
                if (mine.empty()) {
                    take(g, t[0], s.tokens, 0, removed);
                    mine.push_back(t[0]);
                }
                continue;
            }
            ASSERT_EQ(static_cast<int64_t>(t.size()), blocks_for(len));
            ASSERT_TRUE(std::equal(mine.begin(), mine.end(), t.begin()))
                << "group " << g << ": entries before the append changed";
            const int64_t first = keep(g, c, len);
            for (auto i = static_cast<int64_t>(mine.size()); i < blocks_for(len); ++i) {
                const BlockId b = t[static_cast<size_t>(i)];
                if (i < first) {
                    ASSERT_EQ(b, kNullBlock);
                } else {
                    ASSERT_NE(b, kNullBlock);
                    take(g, b, s.tokens, i, removed);
                }
                mine.push_back(b);
            }
        }
        if (!p_.deferred) commit_ref(s, len, stored);
        check_events(removed, stored);
    }

    void commit_one() {
        if (seqs_.empty()) return;
        auto it = seqs_.begin();
        std::advance(it, pick(0, static_cast<int>(seqs_.size()) - 1));
        RefSeq& s = it->second;
        const auto len = static_cast<int>(s.tokens.size());
        const int64_t n = pick(0, 2) == 0 ? len : pick(static_cast<int>(s.committed), len);
        m_.commit(it->first, n);
        ++commits;
        std::vector<std::vector<BlockId>> removed(groups_.size()), stored(groups_.size());
        if (p_.deferred) commit_ref(s, n, stored);
        check_events(removed, stored);
        ASSERT_EQ(m_.num_committed_tokens(it->first), s.committed);
    }

    void do_free(SeqId id) {
        m_.free(id);
        RefSeq& s = seqs_.at(id);
        for (int g = 0; g < ngroups(); ++g) {
            const auto& t = s.tables[static_cast<size_t>(g)];
            for (auto b = t.rbegin(); b != t.rend(); ++b)
                if (*b != kNullBlock) release(g, *b);
        }
        seqs_.erase(id);
        ASSERT_TRUE(take_events().empty()) << "free published events";
    }

    void free_one() {
        if (seqs_.empty()) return;
        auto it = seqs_.begin();
        std::advance(it, pick(0, static_cast<int>(seqs_.size()) - 1));
        do_free(it->first);
    }

    void lookup() {
        int base = 0;
        const auto tokens = make_prompt(base, 60);
        const auto h = hash_token_blocks(tokens, p_.block_size);
        const auto len = static_cast<int64_t>(tokens.size());
        ASSERT_EQ(m_.lookup(tokens), naive_hit(h, len, -1) * p_.block_size);
        // No group's own answer exceeds what it serves; the hybrid hit is served by every group.
        for (int g = 0; g < ngroups(); ++g) {
            const int64_t got = m_.group_hit_blocks(g, h, len, -1);
            ASSERT_TRUE(serves(g, h, len, got));
            if (!p_.prefix_cache) {
                ASSERT_EQ(got, 0);
            }
        }
        ASSERT_TRUE(take_events().empty());
    }

    void bad_input() {
        if (seqs_.empty()) return;
        const auto& [id, s] = *seqs_.begin();
        EXPECT_THROW(m_.commit(id, static_cast<int64_t>(s.tokens.size()) + 1), Error);
        EXPECT_THROW(m_.allocate(id, std::vector<int32_t>{1}), Error);
        EXPECT_THROW(m_.free(next_id_ + 100), Error);
        EXPECT_THROW(m_.block_table(ngroups(), id), Error);
        ASSERT_TRUE(take_events().empty());
    }

    void compare() {
        m_.check_invariants();
        // A consumer of the events holds exactly every group's index.
        size_t registered = 0;
        for (int g = 0; g < ngroups(); ++g)
            for (const auto& [h, copies] : groups_[static_cast<size_t>(g)].index) {
                ASSERT_TRUE(consumer_.contains(h, g)) << "group " << g;
                registered += copies.size();
            }
        ASSERT_EQ(consumer_.size(), registered);
        for (int g = 0; g < ngroups(); ++g) {
            const RefGroup& r = groups_[static_cast<size_t>(g)];
            for (size_t b = 0; b < r.ref.size(); ++b) {
                const auto id = static_cast<BlockId>(b);
                ASSERT_EQ(m_.ref_count(g, id), r.ref[b]) << "group " << g << " block " << b;
                ASSERT_EQ(m_.registered_hash(g, id), r.reg[b]) << "group " << g << " block " << b;
                if (!state(g)) {
                    ASSERT_EQ(m_.block_computed(g, id), r.written[b]);
                }
            }
            ASSERT_EQ(m_.eviction_order(g), std::vector<BlockId>(r.lru.begin(), r.lru.end()));
            ASSERT_EQ(m_.num_available_blocks(g), r.available());
        }
        for (const auto& [id, s] : seqs_) {
            const auto len = static_cast<int64_t>(s.tokens.size());
            ASSERT_EQ(m_.num_tokens(id), len);
            ASSERT_EQ(m_.num_committed_tokens(id), s.committed);
            for (int g = 0; g < ngroups(); ++g) {
                const auto t = m_.block_table(g, id);
                ASSERT_TRUE(std::equal(t.begin(), t.end(), s.tables[static_cast<size_t>(g)].begin(),
                                       s.tables[static_cast<size_t>(g)].end()));
                const int64_t want =
                    state(g) ? (len > 0 ? 1 : 0) : blocks_for(len) - keep(g, s.committed, len);
                ASSERT_EQ(m_.resident_blocks(g, id), want);
            }
        }
    }

    GroupParams p_;
    KvGroupManager& m_;
    std::mt19937 rng_;
    std::array<std::vector<int32_t>, 3> bases_;
    std::vector<RefGroup> groups_;
    std::map<SeqId, RefSeq> seqs_;
    std::vector<KvEvent> events_;
    KvEventIndex consumer_;
    uint64_t next_event_ = 0;
    SeqId next_id_ = 1;
};

class KvGroupManagerModel : public ::testing::TestWithParam<GroupParams> {};

TEST_P(KvGroupManagerModel, RandomOperationsAgreeWithTheReference) {
    const GroupParams& p = GetParam();
    KvGroupManager m({.groups = p.groups,
                      .block_size = p.block_size,
                      .enable_prefix_cache = p.prefix_cache,
                      .deferred_commit = p.deferred});
    GroupModel model(p, m);
    for (int i = 0; i < 4000; ++i) {
        model.step();
        if (::testing::Test::HasFailure()) FAIL() << "at step " << i << " (seed " << p.seed << ")";
    }
    model.drain();
    EXPECT_GT(model.oob, 0);
    if (p.prefix_cache) {  // (without it nothing is cached, so nothing is evicted)
        EXPECT_GT(model.evictions, 0);
        EXPECT_GT(model.hits, 0);
        EXPECT_GT(model.window_hits, 0);
        EXPECT_GT(model.copies_registered, 0);
    }
    std::printf(
        "hit blocks %lld (windowed groups %lld), evictions %lld, out-of-blocks %lld, copies %lld\n",
        static_cast<long long>(model.hits), static_cast<long long>(model.window_hits),
        static_cast<long long>(model.evictions), static_cast<long long>(model.oob),
        static_cast<long long>(model.copies_registered));
}

using K = LayerKind;
INSTANTIATE_TEST_SUITE_P(
    Groups, KvGroupManagerModel,
    ::testing::Values(
        GroupParams{1, 4, {{K::kFullAttention, 0, 40}, {K::kSlidingWindow, 6, 24}}, false},
        GroupParams{2, 4, {{K::kFullAttention, 0, 40}, {K::kSlidingWindow, 6, 24}}, true},
        GroupParams{
            3, 2, {{K::kSlidingWindow, 5, 30}, {K::kChunkedLocal, 8, 30}, {K::kMla, 0, 48}}, false},
        GroupParams{
            4, 2, {{K::kSlidingWindow, 5, 30}, {K::kChunkedLocal, 8, 30}, {K::kMla, 0, 48}}, true},
        GroupParams{5, 4, {{K::kFullAttention, 0, 32}, {K::kSlidingWindow, 13, 32}}, true},
        GroupParams{
            6,
            4,
            {{K::kFullAttention, 0, 40}, {K::kGatedDeltaNet, 0, 6}, {K::kSlidingWindow, 8, 20}},
            true,
            false}),
    [](const auto& info) { return "case" + std::to_string(info.param.seed); });

}  // namespace
}  // namespace kvshard
