// Model-based randomized test (GUIDE.md convention 8, RocksDB's db_map_fuzzer style): thousands of
// random operations run on the BlockManager and on a naive reference model side by side. The model
// keeps block contents, reference counts, the prefix index (rebuilt only from the KV events) and
// the LRU list as plain containers; after every step the two must agree and every invariant hold.
// With deferred commit the model also keeps which blocks hold written KV (set at commit, cleared
// when a block is reused): a prefix hit or a BlockStored event on a block not written yet fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <deque>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <unordered_map>

#include "kvshard/cache/block_manager.h"

namespace kvshard {
namespace {

struct RefSeq {
    std::vector<int32_t> tokens;  // unknown ids are stored as unique negative sentinels
    std::vector<std::byte> extra;
    std::vector<BlockId> table;
    bool hashable = true;          // ids all known and allocated from tokens
    int base = -1;                 // prompt family, for appends that continue it
    std::vector<BlockHash> chain;  // the full blocks' hashes the manager knows
    int64_t committed = 0;         // tokens whose KV is written
};

struct Params {
    uint32_t seed;
    int block_size;
    int64_t num_blocks;
    bool deferred = false;  // BlockManagerConfig::deferred_commit
};

class Model {
  public:
    Model(Params p, BlockManager& m)
        : p_(p),
          m_(m),
          rng_(p.seed),
          ref_(static_cast<size_t>(p.num_blocks), 0),
          reg_(static_cast<size_t>(p.num_blocks)),
          written_(static_cast<size_t>(p.num_blocks), false),
          content_(static_cast<size_t>(p.num_blocks)),
          content_extra_(static_cast<size_t>(p.num_blocks)) {
        std::uniform_int_distribution<int32_t> tok(0, 6);  // tiny vocabulary: many equal blocks
        for (auto& b : bases_) {
            b.resize(200);
            for (auto& t : b) t = tok(rng_);
        }
        m_.subscribe([this](const KvEvent& e) { events_.push_back(e); });
        m_.subscribe([this](const KvEvent& e) { consumer_.apply(e); });
    }

    void step() {
        const int op = pick(0, 99);
        if (op < 28)
            allocate();
        else if (op < 48)
            append();
        else if (op < 68)
            free_one();
        else if (op < 78)
            lookup();
        else if (op < 79)
            clear();
        else if (op < 93)
            commit();
        else
            bad_input();
        compare();
    }

    void drain() {
        while (!seqs_.empty()) {
            const SeqId id = seqs_.begin()->first;
            do_free(id);
            compare();
        }
        const auto mt = m_.metrics();
        EXPECT_EQ(mt.used_blocks, 0);
        EXPECT_EQ(mt.free_blocks + mt.cached_blocks, p_.num_blocks);
    }

    int64_t hits_seen() const { return hits_seen_; }
    int64_t evictions_seen() const { return evictions_seen_; }
    int64_t out_of_blocks_seen() const { return oob_seen_; }
    int64_t duplicates_seen() const { return duplicates_seen_; }
    int64_t uncommitted_skips() const { return uncommitted_skips_; }
    int64_t clears_done() const { return clears_done_; }
    int64_t clears_refused() const { return clears_refused_; }

  private:
    int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

    std::vector<int32_t> make_prompt(int& base, int max_len) {
        base = pick(0, static_cast<int>(bases_.size()) - 1);
        const int shared = pick(0, max_len);
        std::vector<int32_t> t(bases_[static_cast<size_t>(base)].begin(),
                               bases_[static_cast<size_t>(base)].begin() + shared);
        const int own = pick(0, 3) == 0 ? pick(0, 12) : 0;
        for (int i = 0; i < own; ++i) t.push_back(pick(0, 6));
        return t;
    }

    std::vector<std::byte> make_extra() {
        if (pick(0, 6) != 0) return {};
        return encode_extra_keys(pick(0, 1) ? "tenant-a" : "tenant-b", "");
    }

    const std::vector<BlockHash> hashes_of(const std::vector<int32_t>& t,
                                           const std::vector<std::byte>& extra) const {
        return hash_token_blocks(t, p_.block_size, extra);
    }

    size_t ref_match(const std::vector<BlockHash>& h) const {
        size_t n = 0;
        while (n < h.size() && index_.count(h[n])) ++n;
        return n;
    }

    int64_t ref_free() const {
        int64_t n = 0;
        for (size_t b = 0; b < ref_.size(); ++b) n += ref_[b] == 0 && !reg_[b];
        return n;
    }

    std::vector<int32_t> block_tokens(const std::vector<int32_t>& t, size_t i) const {
        const size_t bs = static_cast<size_t>(p_.block_size);
        const size_t end = std::min(t.size(), (i + 1) * bs);
        return {t.begin() + static_cast<ptrdiff_t>(i * bs),
                t.begin() + static_cast<ptrdiff_t>(end)};
    }

    // Checks that a block the manager shares holds exactly the query's tokens.
    void expect_content(BlockId b, const std::vector<int32_t>& t, size_t i,
                        const std::vector<std::byte>& extra) {
        ASSERT_TRUE(written_[static_cast<size_t>(b)])
            << "a shared block's KV is not written yet (hit inside the allocate-commit window)";
        ASSERT_EQ(content_[static_cast<size_t>(b)], block_tokens(t, i))
            << "a shared block holds other tokens than the query";
        ASSERT_EQ(content_extra_[static_cast<size_t>(b)], extra);
    }

    std::vector<KvEvent> take_events() {
        std::vector<KvEvent> ev;
        ev.swap(events_);
        return ev;
    }

    // The eviction part of an operation's events (at most one BlockRemoved, first): exactly the
    // `expect` least recently used cached blocks, none of them in use.
    void check_removed(const std::vector<KvEvent>& ev, size_t& k, int64_t expect) {
        if (expect == 0) return;
        ASSERT_LT(k, ev.size());
        ASSERT_EQ(ev[k].kind, KvEventKind::kBlockRemoved);
        check_seq(ev[k]);
        ASSERT_EQ(static_cast<int64_t>(ev[k].block_ids.size()), expect);
        ASSERT_EQ(ev[k].block_hashes.size(), ev[k].block_ids.size());
        for (size_t j = 0; j < ev[k].block_ids.size(); ++j) {
            const BlockId b = ev[k].block_ids[j];
            ASSERT_FALSE(lru_.empty());
            ASSERT_EQ(b, lru_.front()) << "eviction is not least-recently-used first";
            ASSERT_EQ(ref_[static_cast<size_t>(b)], 0) << "a used block was evicted";
            ASSERT_EQ(reg_[static_cast<size_t>(b)], ev[k].block_hashes[j]);
            lru_.pop_front();
            // That copy goes; other copies of the hash stay findable.
            auto& copies = index_.at(ev[k].block_hashes[j]);
            const auto at = std::find(copies.begin(), copies.end(), b);
            ASSERT_NE(at, copies.end()) << "evicted block " << b << " was not a registered copy";
            copies.erase(at);
            if (copies.empty()) index_.erase(ev[k].block_hashes[j]);
            reg_[static_cast<size_t>(b)].reset();
            written_[static_cast<size_t>(b)] = false;
        }
        evictions_seen_ += expect;
        ++k;
    }

    // The store part: the blocks [from, min(to, chain.size())) of a sequence that the
    // registration rule admits (the sequence's previous block registered; a hash already indexed
    // in another block is registered again, as a copy: vLLM's cache_full_blocks), in BlockStored
    // events whose hashes match the model's block contents.
    void check_stored(const std::vector<KvEvent>& ev, size_t& k,
                      const std::vector<BlockHash>& chain, const std::vector<BlockId>& table,
                      size_t from, size_t to) {
        std::vector<BlockHash> want_h;
        std::vector<BlockId> want_b;
        for (size_t i = from; i < std::min(to, chain.size()); ++i) {
            if (i > 0) {
                const auto& pr = reg_[static_cast<size_t>(table[i - 1])];
                if (!pr || *pr != chain[i - 1]) break;
            }
            if (index_.count(chain[i])) ++duplicates_seen_;  // same content in another block
            want_h.push_back(chain[i]);
            want_b.push_back(table[i]);
            reg_[static_cast<size_t>(table[i])] = chain[i];
            index_[chain[i]].push_back(table[i]);
        }
        std::vector<BlockHash> got_h;
        std::vector<BlockId> got_b;
        for (; k < ev.size(); ++k) {
            ASSERT_EQ(ev[k].kind, KvEventKind::kBlockStored);
            check_seq(ev[k]);
            ASSERT_EQ(ev[k].block_size, p_.block_size);
            ASSERT_EQ(ev[k].num_tokens,
                      static_cast<int64_t>(ev[k].block_hashes.size()) * p_.block_size);
            std::optional<BlockHash> parent = ev[k].parent_hash;
            for (size_t j = 0; j < ev[k].block_hashes.size(); ++j) {
                const auto b = static_cast<size_t>(ev[k].block_ids[j]);
                ASSERT_TRUE(written_[b]) << "BlockStored for a block whose KV is not written";
                ASSERT_EQ(static_cast<int>(content_[b].size()), p_.block_size);
                ASSERT_EQ(
                    hash_block(parent.value_or(kRootParentHash), content_[b], content_extra_[b]),
                    ev[k].block_hashes[j])
                    << "a stored hash does not match the block's tokens";
                parent = ev[k].block_hashes[j];
            }
            got_h.insert(got_h.end(), ev[k].block_hashes.begin(), ev[k].block_hashes.end());
            got_b.insert(got_b.end(), ev[k].block_ids.begin(), ev[k].block_ids.end());
        }
        ASSERT_EQ(got_h, want_h);
        ASSERT_EQ(got_b, want_b);
    }

    void check_seq(const KvEvent& e) {
        ASSERT_EQ(e.seq, next_event_) << "event sequence numbers must be consecutive";
        ++next_event_;
    }

    // Expected outcome of needing `more` new blocks with `hit_cached` hits taken from the cache.
    enum class Outcome { kOk, kTooLarge, kOutOfBlocks };

    void allocate() {
        int base = 0;
        auto tokens = make_prompt(base, pick(0, 9) == 0 ? 199 : 48);
        const auto extra = make_extra();
        const bool hash_mode = pick(0, 4) == 0;
        const SeqId id = next_id_++;
        const auto chain = hashes_of(tokens, extra);
        // Sometimes cap the shared prefix (keep the last token computed, an agreed prefix...).
        const int64_t cap = pick(0, 4) == 0 ? pick(0, static_cast<int>(ref_match(chain))) : -1;
        const size_t hits =
            cap >= 0 ? std::min(ref_match(chain), static_cast<size_t>(cap)) : ref_match(chain);
        const int64_t total = m_.blocks_for_tokens(static_cast<int64_t>(tokens.size()));
        int64_t hit_cached = 0;
        for (size_t i = 0; i < hits; ++i)
            hit_cached += ref_[static_cast<size_t>(index_.at(chain[i]).front())] == 0;
        const int64_t need = total - static_cast<int64_t>(hits) + hit_cached;
        const int64_t available = ref_free() + static_cast<int64_t>(lru_.size());
        const Outcome want = total > p_.num_blocks ? Outcome::kTooLarge
                             : need > available    ? Outcome::kOutOfBlocks
                                                   : Outcome::kOk;
        ASSERT_EQ(hash_mode
                      ? m_.can_allocate_hashes(chain, static_cast<int64_t>(tokens.size()), cap)
                      : m_.can_allocate(tokens, extra, cap),
                  want == Outcome::kOk);
        const auto before = m_.metrics();
        AllocResult r;
        try {
            if (hash_mode) {
                auto h = chain;
                if (tokens.size() % static_cast<size_t>(p_.block_size) != 0 && pick(0, 1))
                    h.push_back(BlockHash{12345, 678});  // a partial block's hash id is ignored
                r = m_.allocate_with_hashes(id, h, static_cast<int64_t>(tokens.size()), cap);
            } else {
                r = m_.allocate(id, tokens, extra, cap);
            }
        } catch (const OutOfBlocksError&) {
            ASSERT_EQ(want, Outcome::kOutOfBlocks);
            ++oob_seen_;
            expect_unchanged(before);
            return;
        } catch (const Error&) {
            ASSERT_EQ(want, Outcome::kTooLarge);
            expect_unchanged(before);
            return;
        }
        ASSERT_EQ(want, Outcome::kOk);
        ASSERT_EQ(r.cached_tokens, static_cast<int64_t>(hits) * p_.block_size);
        if (p_.deferred && hits < chain.size() && uncommitted_holder(chain[hits]))
            ++uncommitted_skips_;  // the next block is allocated elsewhere but not written yet
        ASSERT_EQ(r.new_blocks, total - static_cast<int64_t>(hits));
        hits_seen_ += static_cast<int64_t>(hits);
        const std::vector<BlockId> table(m_.block_table(id).begin(), m_.block_table(id).end());
        ASSERT_EQ(static_cast<int64_t>(table.size()), total);
        for (size_t i = 0; i < hits; ++i) {
            ASSERT_EQ(table[i], index_.at(chain[i]).front());
            expect_content(table[i], tokens, i, extra);
            auto& rc = ref_[static_cast<size_t>(table[i])];
            if (rc == 0) lru_.remove(table[i]);
            ++rc;
        }
        const int64_t evict =
            std::max<int64_t>(0, (total - static_cast<int64_t>(hits)) - ref_free());
        for (size_t i = hits; i < table.size(); ++i)
            ASSERT_EQ(ref_[static_cast<size_t>(table[i])], 0) << "a new block was in use";
        const auto ev = take_events();
        size_t k = 0;
        check_removed(ev, k, evict);
        for (size_t i = hits; i < table.size(); ++i) {
            const auto b = static_cast<size_t>(table[i]);
            ASSERT_FALSE(reg_[b]) << "a new block still carries a hash";
            ASSERT_FALSE(written_[b]) << "a new block is marked written";
            ref_[b] = 1;
            content_[b] = block_tokens(tokens, i);
            content_extra_[b] = extra;
        }
        RefSeq s;
        s.tokens = tokens;
        s.extra = extra;
        s.table = table;
        s.hashable = !hash_mode;
        s.base = base;
        s.chain = chain;
        s.committed = static_cast<int64_t>(hits) * p_.block_size;
        if (!p_.deferred) mark_committed(ev, k, s, static_cast<int64_t>(tokens.size()));
        ASSERT_EQ(k, ev.size());
        ASSERT_EQ(m_.num_committed_tokens(id), s.committed);
        seqs_.emplace(id, std::move(s));
    }

    void append() {
        if (seqs_.empty()) return;
        auto it = seqs_.begin();
        std::advance(it, pick(0, static_cast<int>(seqs_.size()) - 1));
        const SeqId id = it->first;
        RefSeq& s = it->second;
        const bool unknown = pick(0, 5) == 0;
        const int n = pick(0, 9) == 0 ? pick(20, 160) : pick(1, 9);
        std::vector<int32_t> add;
        for (int i = 0; i < n; ++i) {
            const size_t pos = s.tokens.size() + add.size();
            const auto& base = bases_[static_cast<size_t>(s.base)];
            if (unknown)
                add.push_back(next_unknown_--);
            else if (pick(0, 1) && pos < base.size())
                add.push_back(base[pos]);  // continue the family: later prompts can share it
            else
                add.push_back(pick(0, 6));
        }
        const size_t bs = static_cast<size_t>(p_.block_size);
        const int64_t total =
            m_.blocks_for_tokens(static_cast<int64_t>(s.tokens.size() + add.size()));
        const int64_t more = total - static_cast<int64_t>(s.table.size());
        const int64_t available = ref_free() + static_cast<int64_t>(lru_.size());
        const Outcome want = total > p_.num_blocks ? Outcome::kTooLarge
                             : more > available    ? Outcome::kOutOfBlocks
                                                   : Outcome::kOk;
        ASSERT_EQ(m_.can_append(id, n), want == Outcome::kOk);
        const auto before = m_.metrics();
        try {
            if (unknown)
                m_.append_tokens(id, n);
            else
                m_.append(id, add);
        } catch (const OutOfBlocksError&) {
            ASSERT_EQ(want, Outcome::kOutOfBlocks);
            ++oob_seen_;
            expect_unchanged(before);
            return;
        } catch (const Error&) {
            ASSERT_EQ(want, Outcome::kTooLarge);
            expect_unchanged(before);
            return;
        }
        ASSERT_EQ(want, Outcome::kOk);
        const std::vector<BlockId> table(m_.block_table(id).begin(), m_.block_table(id).end());
        ASSERT_EQ(static_cast<int64_t>(table.size()), total);
        ASSERT_TRUE(std::equal(s.table.begin(), s.table.end(), table.begin()));
        for (size_t i = s.table.size(); i < table.size(); ++i)
            ASSERT_EQ(ref_[static_cast<size_t>(table[i])], 0);
        const size_t old_full = s.tokens.size() / bs;
        const int64_t evict = std::max<int64_t>(0, more - ref_free());
        const auto ev = take_events();
        size_t k = 0;
        check_removed(ev, k, evict);
        s.tokens.insert(s.tokens.end(), add.begin(), add.end());
        s.table = table;
        for (size_t i = old_full; i < table.size(); ++i) {  // the partial block and the new ones
            const auto b = static_cast<size_t>(table[i]);
            if (ref_[b] == 0) ref_[b] = 1;
            content_[b] = block_tokens(s.tokens, i);
            content_extra_[b] = s.extra;
        }
        if (unknown) s.hashable = false;
        if (s.hashable) s.chain = hashes_of(s.tokens, s.extra);
        if (!p_.deferred) mark_committed(ev, k, s, static_cast<int64_t>(s.tokens.size()));
        ASSERT_EQ(k, ev.size()) << "unexpected events";
    }

    // Whether some sequence holds the block of hash h in its table, not committed yet.
    bool uncommitted_holder(const BlockHash& h) const {
        for (const auto& [id, s] : seqs_) {
            const size_t full = static_cast<size_t>(s.committed / p_.block_size);
            for (size_t i = full; i < s.chain.size(); ++i)
                if (s.chain[i] == h) return true;
        }
        return false;
    }

    // Tokens [s.committed, n) of s are written: their full blocks become written and, where the
    // registration rule admits them, stored (checked against the events from k on).
    void mark_committed(const std::vector<KvEvent>& ev, size_t& k, RefSeq& s, int64_t n) {
        if (n <= s.committed) return;
        const auto bs = static_cast<size_t>(p_.block_size);
        const size_t from = static_cast<size_t>(s.committed) / bs;
        const size_t to = static_cast<size_t>(n) / bs;
        for (size_t i = from; i < to; ++i) {
            const auto b = static_cast<size_t>(s.table[i]);
            ASSERT_FALSE(written_[b]) << "a block past the committed prefix was already written";
            written_[b] = true;
        }
        s.committed = n;
        check_stored(ev, k, s.chain, s.table, from, to);
    }

    // The executor's commit after a forward step: a random sequence's KV is written up to a
    // random point at or past what it had (sometimes below it: a no-op).
    void commit() {
        if (seqs_.empty()) return;
        auto it = seqs_.begin();
        std::advance(it, pick(0, static_cast<int>(seqs_.size()) - 1));
        RefSeq& s = it->second;
        const auto len = static_cast<int64_t>(s.tokens.size());
        const int64_t n = pick(0, 2) == 0 ? len
                          : pick(0, 5) == 0
                              ? pick(0, static_cast<int>(s.committed))
                              : pick(static_cast<int>(s.committed), static_cast<int>(len));
        m_.commit(it->first, n);
        const auto ev = take_events();
        size_t k = 0;
        mark_committed(ev, k, s, n);
        ASSERT_EQ(k, ev.size()) << "commit published unexpected events";
        ASSERT_EQ(m_.num_committed_tokens(it->first), s.committed);
    }

    void do_free(SeqId id) {
        m_.free(id);
        RefSeq& s = seqs_.at(id);
        for (auto b = s.table.rbegin(); b != s.table.rend(); ++b) {
            auto& rc = ref_[static_cast<size_t>(*b)];
            ASSERT_GT(rc, 0);
            if (--rc == 0 && reg_[static_cast<size_t>(*b)]) lru_.push_back(*b);
            if (rc == 0 && !reg_[static_cast<size_t>(*b)])
                written_[static_cast<size_t>(*b)] = false;
        }
        seqs_.erase(id);
        ASSERT_TRUE(events_.empty()) << "free published events";
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
        const auto extra = make_extra();
        const auto chain = hashes_of(tokens, extra);
        const size_t hits = ref_match(chain);
        const auto before = m_.metrics();
        const PrefixMatch got = pick(0, 1) ? m_.lookup(tokens, extra) : m_.lookup_hashes(chain);
        ASSERT_EQ(got.blocks.size(), hits);
        ASSERT_EQ(got.num_tokens, static_cast<int64_t>(hits) * p_.block_size);
        for (size_t i = 0; i < hits; ++i) {
            ASSERT_EQ(got.blocks[i], index_.at(chain[i]).front());
            expect_content(got.blocks[i], tokens, i, extra);
        }
        expect_unchanged(before);
    }

    void clear() {
        // Half the time every sequence finishes first: vLLM's reset_prefix_cache
        // (vllm/v1/core/block_pool.py) resets only a pool with no block in use, and otherwise
        // returns False and changes and publishes nothing.
        if (pick(0, 1) == 0) {
            while (!seqs_.empty()) do_free(seqs_.begin()->first);
        }
        if (!seqs_.empty()) {
            const auto before = m_.metrics();
            ASSERT_FALSE(m_.clear_cache());
            ++clears_refused_;
            expect_unchanged(before);
            return;
        }
        ASSERT_TRUE(m_.clear_cache());
        ++clears_done_;
        ASSERT_EQ(events_.size(), 1u);
        ASSERT_EQ(events_[0].kind, KvEventKind::kAllCleared);
        check_seq(events_[0]);
        events_.clear();
        for (size_t b = 0; b < reg_.size(); ++b) {
            ASSERT_EQ(ref_[b], 0);
            written_[b] = false;
            reg_[b].reset();
        }
        index_.clear();
        lru_.clear();
    }

    void bad_input() {
        const auto before = m_.metrics();
        switch (pick(0, 4)) {
            case 0:
                EXPECT_THROW(m_.free(next_id_ + 1000), Error);
                break;
            case 1: {
                if (seqs_.empty()) return;
                // A double free: free then free again.
                const SeqId id = seqs_.begin()->first;
                do_free(id);
                compare();
                const auto mid = m_.metrics();
                EXPECT_THROW(m_.free(id), Error);
                expect_unchanged(mid);
                return;
            }
            case 2: {
                std::vector<int32_t> huge(static_cast<size_t>(p_.num_blocks * p_.block_size + 1),
                                          1);
                try {
                    m_.allocate(next_id_++, huge);
                    FAIL() << "a request larger than the pool was accepted";
                } catch (const OutOfBlocksError&) {
                    FAIL() << "larger than the pool is not a transient shortage";
                } catch (const Error&) {
                }
                break;
            }
            case 3:
                if (seqs_.empty()) return;
                EXPECT_THROW(m_.allocate(seqs_.begin()->first, std::vector<int32_t>{1, 2}), Error);
                break;
            case 4: {
                if (seqs_.empty()) return;
                const auto& [id, s] = *seqs_.begin();
                EXPECT_THROW(m_.commit(id, static_cast<int64_t>(s.tokens.size()) + 1), Error);
                EXPECT_THROW(m_.commit(id, -1), Error);
                EXPECT_THROW(m_.commit(next_id_ + 1000, 0), Error);
                EXPECT_EQ(m_.num_committed_tokens(id), s.committed);
                break;
            }
        }
        expect_unchanged(before);
    }

    void expect_unchanged(const CacheMetrics& before) {
        const auto now = m_.metrics();
        ASSERT_EQ(now.used_blocks, before.used_blocks);
        ASSERT_EQ(now.cached_blocks, before.cached_blocks);
        ASSERT_EQ(now.free_blocks, before.free_blocks);
        ASSERT_EQ(now.hashed_blocks, before.hashed_blocks);
        ASSERT_EQ(now.queries, before.queries);
        ASSERT_EQ(now.evictions, before.evictions);
        ASSERT_TRUE(events_.empty());
    }

    void compare() {
        m_.check_invariants();
        // Consumers of the event feed (one from the start, one that joined late from a snapshot)
        // hold exactly the manager's index.
        if (!late_ && pick(0, 199) == 0) {
            late_.emplace();
            late_->sync(m_.registered_hashes(), m_.next_event_seq());
            m_.subscribe([this](const KvEvent& e) { late_->apply(e); });
        }
        const auto registered = m_.registered_hashes();
        ASSERT_EQ(consumer_.size(), registered.size());
        for (const BlockHash& h : registered) ASSERT_TRUE(consumer_.contains(h));
        if (late_) {
            ASSERT_EQ(late_->size(), registered.size());
            for (const BlockHash& h : registered) ASSERT_TRUE(late_->contains(h));
        }
        int64_t used = 0, cached = 0, free = 0;
        for (size_t b = 0; b < ref_.size(); ++b) {
            const auto id = static_cast<BlockId>(b);
            ASSERT_EQ(m_.ref_count(id), ref_[b]) << "block " << b;
            ASSERT_EQ(m_.block_computed(id), written_[b]) << "block " << b;
            ASSERT_EQ(m_.registered_hash(id), reg_[b]) << "block " << b;
            const BlockState st = m_.block_state(id);
            if (ref_[b] > 0) {
                ++used;
                ASSERT_EQ(st, BlockState::kUsed);
            } else if (reg_[b]) {
                ++cached;
                ASSERT_EQ(st, BlockState::kCached);
            } else {
                ++free;
                ASSERT_EQ(st, BlockState::kFree);
            }
        }
        ASSERT_EQ(m_.eviction_order(), std::vector<BlockId>(lru_.begin(), lru_.end()));
        const auto mt = m_.metrics();
        ASSERT_EQ(mt.used_blocks, used);
        ASSERT_EQ(mt.cached_blocks, cached);
        ASSERT_EQ(mt.free_blocks, free);
        ASSERT_EQ(mt.num_sequences, static_cast<int64_t>(seqs_.size()));
        ASSERT_EQ(m_.next_event_seq(), next_event_);
        for (const auto& [id, s] : seqs_) {
            ASSERT_EQ(m_.num_tokens(id), static_cast<int64_t>(s.tokens.size()));
            ASSERT_TRUE(std::equal(s.table.begin(), s.table.end(), m_.block_table(id).begin(),
                                   m_.block_table(id).end()));
        }
    }

  private:
    Params p_;
    BlockManager& m_;
    std::mt19937 rng_;
    std::array<std::vector<int32_t>, 4> bases_;
    std::map<SeqId, RefSeq> seqs_;
    std::vector<int32_t> ref_;
    std::vector<std::optional<BlockHash>> reg_;
    // hash -> its registered copies, oldest first: a lookup finds the front (vLLM's
    // BlockHashToBlockMap.get_one_block, the first inserted block still there).
    std::unordered_map<BlockHash, std::deque<BlockId>, BlockHashHasher> index_;
    std::list<BlockId> lru_;
    std::vector<bool> written_;  // the block is full and its KV committed
    std::vector<std::vector<int32_t>> content_;
    std::vector<std::vector<std::byte>> content_extra_;
    std::vector<KvEvent> events_;
    KvEventIndex consumer_;
    std::optional<KvEventIndex> late_;
    uint64_t next_event_ = 0;
    SeqId next_id_ = 1;
    int32_t next_unknown_ = -1000000;
    int64_t hits_seen_ = 0, evictions_seen_ = 0, oob_seen_ = 0, duplicates_seen_ = 0;
    int64_t clears_done_ = 0, clears_refused_ = 0;
    int64_t uncommitted_skips_ = 0;
};

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

class BlockManagerModel : public ::testing::TestWithParam<Params> {};

TEST_P(BlockManagerModel, RandomOperationsAgreeWithTheReference) {
    const Params p = GetParam();
    BlockManager m(
        {.num_blocks = p.num_blocks, .block_size = p.block_size, .deferred_commit = p.deferred});
    Model model(p, m);
    constexpr int kSteps = 5000;
    for (int i = 0; i < kSteps; ++i) {
        model.step();
        if (::testing::Test::HasFatalFailure() || ::testing::Test::HasFailure())
            FAIL() << "at step " << i << " (seed " << p.seed << ")";
    }
    model.drain();
    // The run exercised what it is meant to exercise.
    EXPECT_GT(model.hits_seen(), 0);
    EXPECT_GT(model.evictions_seen(), 0);
    EXPECT_GT(model.out_of_blocks_seen(), 0);
    // Blocks of a hash another block held were registered as copies (vLLM's rule).
    EXPECT_GT(model.duplicates_seen(), 0);
    // Resets of an idle pool went through; resets while sequences ran were refused.
    EXPECT_GT(model.clears_done(), 0);
    EXPECT_GT(model.clears_refused(), 0);
    // Deferred: allocations met blocks inside their allocate-commit window (and did not hit them).
    if (p.deferred) {
        EXPECT_GT(model.uncommitted_skips(), 0);
    }
    std::printf(
        "hit blocks %lld, evictions %lld, out-of-blocks %lld, duplicate blocks %lld, "
        "uncommitted blocks not hit %lld\n",
        static_cast<long long>(model.hits_seen()), static_cast<long long>(model.evictions_seen()),
        static_cast<long long>(model.out_of_blocks_seen()),
        static_cast<long long>(model.duplicates_seen()),
        static_cast<long long>(model.uncommitted_skips()));
}

INSTANTIATE_TEST_SUITE_P(Seeds, BlockManagerModel,
                         ::testing::Values(Params{1, 4, 24}, Params{2, 4, 24}, Params{3, 1, 40},
                                           Params{4, 2, 32}, Params{5, 16, 12}, Params{6, 4, 64},
                                           Params{7, 4, 24, true}, Params{8, 4, 24, true},
                                           Params{9, 1, 40, true}, Params{10, 2, 32, true},
                                           Params{11, 16, 12, true}, Params{12, 4, 64, true}),
                         [](const auto& info) {
                             return "seed" + std::to_string(info.param.seed) + "_bs" +
                                    std::to_string(info.param.block_size) + "_blocks" +
                                    std::to_string(info.param.num_blocks) +
                                    (info.param.deferred ? "_deferred" : "");
                         });

}  // namespace
}  // namespace kvshard
