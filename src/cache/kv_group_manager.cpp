#include "kvshard/cache/kv_group_manager.h"

#include <algorithm>

#include "cache/block_lru.h"
#include "kvshard/common/error.h"

namespace kvshard {

std::vector<KvGroupPoolSpec> group_pool_specs(const std::vector<KvGroup>& groups,
                                              int64_t num_blocks) {
    std::vector<KvGroupPoolSpec> out;
    out.reserve(groups.size());
    for (const KvGroup& g : groups) out.push_back({g.kind, g.window, num_blocks});
    return out;
}

std::string kv_group_prefix_cache_unsupported(std::span<const KvGroupPoolSpec> groups) {
    for (size_t g = 0; g < groups.size(); ++g)
        if (holds_state(groups[g].kind))
            return detail::concat(
                "group ", g, " (", layer_kind_name(groups[g].kind),
                ") keeps a recurrent state per sequence, and kvshard does not save states at "
                "block boundaries, so no prefix of it can be reused: turn the prefix cache off "
                "(enable_prefix_cache = false) for this model");
    return {};
}

// ---------------------------------------------------------------- construction

KvGroupManager::KvGroupManager(KvGroupManagerConfig config) : config_(std::move(config)) {
    require(!config_.groups.empty(), "a KV group manager needs at least one group, got none");
    require(config_.block_size >= 1, "block size must be at least 1, got ", config_.block_size);
    for (size_t g = 0; g < config_.groups.size(); ++g) {
        const KvGroupPoolSpec& s = config_.groups[g];
        require(holds_tokens(s.kind) || holds_state(s.kind), "group ", g, " is of kind ",
                layer_kind_name(s.kind),
                ", which keeps no KV: leave it out (kv_groups() forms no group of it)");
        require(s.num_blocks >= 1, "group ", g, " needs at least one block, got ", s.num_blocks);
        const bool w = s.kind == LayerKind::kSlidingWindow || s.kind == LayerKind::kChunkedLocal;
        require(!w || s.window >= 1, "group ", g, " (", layer_kind_name(s.kind),
                ") needs a window of at least 1 token, got ", s.window);
    }
    if (config_.enable_prefix_cache) {
        const std::string why = kv_group_prefix_cache_unsupported(config_.groups);
        require(why.empty(), why);
    }
    pools_.resize(config_.groups.size());
    for (size_t g = 0; g < pools_.size(); ++g) {
        Pool& p = pools_[g];
        p.spec = config_.groups[g];
        p.blocks.resize(static_cast<size_t>(p.spec.num_blocks));
        p.free_list.reserve(p.blocks.size());
        for (int64_t b = p.spec.num_blocks - 1; b >= 0; --b)
            p.free_list.push_back(static_cast<BlockId>(b));
        p.num_free = p.spec.num_blocks;
    }
}

const KvGroupPoolSpec& KvGroupManager::group(int g) const {
    require(g >= 0 && g < num_groups(), "group ", g, " out of range [0, ", num_groups(), ")");
    return config_.groups[static_cast<size_t>(g)];
}

bool KvGroupManager::windowed(int g) const {
    const LayerKind k = config_.groups[static_cast<size_t>(g)].kind;
    return k == LayerKind::kSlidingWindow || k == LayerKind::kChunkedLocal;
}

bool KvGroupManager::state_group(int g) const {
    return holds_state(config_.groups[static_cast<size_t>(g)].kind);
}

int64_t KvGroupManager::keep_from(int g, int64_t committed, int64_t num_tokens) const {
    const KvGroupPoolSpec& s = group(g);
    if (!windowed(g)) return 0;
    const int64_t len = committed < num_tokens ? committed + 1 : num_tokens;
    return first_kept_position(s.kind, s.window, len) / config_.block_size;
}

// ---------------------------------------------------------------- lookup

int64_t KvGroupManager::group_hit_blocks(int g, std::span<const BlockHash> hashes,
                                         int64_t num_tokens, int64_t max_blocks) const {
    group(g);
    if (!config_.enable_prefix_cache || state_group(g)) return 0;
    const auto full = static_cast<int64_t>(hashes.size());
    int64_t k = max_blocks < 0 ? full : std::min(max_blocks, full);
    const Pool& p = pool(g);
    auto cached = [&](int64_t i) {
        return p.index.find(hashes[static_cast<size_t>(i)]) != p.index.end();
    };
    if (!windowed(g)) {
        int64_t n = 0;
        while (n < k && cached(n)) ++n;
        return n;
    }
    // Longest k whose last window, blocks [keep_from(P, L), k), is cached. run[i]: cached blocks
    // in a row ending at block i, so k is served when k - keep_from <= run[k - 1]. O(k) lookups.
    std::vector<int64_t> run(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i)
        run[static_cast<size_t>(i)] =
            cached(i) ? (i > 0 ? run[static_cast<size_t>(i - 1)] : 0) + 1 : 0;
    for (; k > 0; --k) {
        const int64_t from = keep_from(g, k * config_.block_size, num_tokens);
        if (k - from <= run[static_cast<size_t>(k - 1)]) return k;
    }
    return 0;
}

int64_t KvGroupManager::hybrid_hit_blocks(std::span<const BlockHash> hashes, int64_t num_tokens,
                                          int64_t max_blocks) const {
    if (!config_.enable_prefix_cache) return 0;
    int64_t k = max_blocks < 0 ? static_cast<int64_t>(hashes.size())
                               : std::min<int64_t>(max_blocks, static_cast<int64_t>(hashes.size()));
    // Each group lowers k to the longest hit <= k it serves; every group then serves k, and no
    // longer common hit was skipped (a group's answer is the largest it serves below its input).
    for (bool lowered = true; lowered && k > 0;) {
        lowered = false;
        for (int g = 0; g < num_groups(); ++g) {
            const int64_t h = group_hit_blocks(g, hashes, num_tokens, k);
            if (h < k) {
                k = h;
                lowered = true;
            }
        }
    }
    return k;
}

int64_t KvGroupManager::lookup(std::span<const int32_t> tokens,
                               std::span<const std::byte> extra_keys) const {
    if (!config_.enable_prefix_cache) return 0;
    const auto hashes = hash_token_blocks(tokens, config_.block_size, extra_keys);
    return hybrid_hit_blocks(hashes, static_cast<int64_t>(tokens.size())) * config_.block_size;
}

// ---------------------------------------------------------------- allocation

int64_t KvGroupManager::cached_hits_in(int g, std::span<const BlockHash> hashes, int64_t from,
                                       int64_t to) const {
    const Pool& p = pool(g);
    int64_t n = 0;
    for (int64_t i = from; i < to; ++i) {
        const BlockId b = p.index.at(hashes[static_cast<size_t>(i)]).front();
        n += p.blocks[static_cast<size_t>(b)].ref == 0;
    }
    return n;
}

int64_t KvGroupManager::fresh_needed(int g, int64_t hit_blocks, int64_t committed,
                                     int64_t num_tokens, SeqId seq) const {
    const Pool& p = pool(g);
    if (state_group(g)) return num_tokens > 0 ? 1 : 0;
    const int64_t total = blocks_for_tokens(num_tokens);
    const int64_t first = keep_from(g, committed, num_tokens);
    const int64_t resident = total - first;
    if (resident > p.spec.num_blocks)
        throw Error(detail::concat("sequence ", seq, " of ", num_tokens, " tokens needs ", resident,
                                   " resident blocks of ", config_.block_size, " tokens in group ",
                                   g, " (", layer_kind_name(p.spec.kind),
                                   ") but that group's whole pool has ", p.spec.num_blocks,
                                   " blocks"));
    return total - std::max(first, hit_blocks);
}

bool KvGroupManager::can_allocate(std::span<const int32_t> tokens,
                                  std::span<const std::byte> extra_keys,
                                  int64_t max_cached_blocks) const {
    const auto len = static_cast<int64_t>(tokens.size());
    const auto hashes = config_.enable_prefix_cache
                            ? hash_token_blocks(tokens, config_.block_size, extra_keys)
                            : std::vector<BlockHash>{};
    const int64_t k = hybrid_hit_blocks(hashes, len, max_cached_blocks);
    const int64_t committed = config_.deferred_commit ? k * config_.block_size : len;
    for (int g = 0; g < num_groups(); ++g) {
        int64_t need = 0;
        try {
            need = fresh_needed(g, k, committed, len, 0);
        } catch (const Error&) {
            return false;
        }
        if (!state_group(g)) {
            const int64_t first = keep_from(g, committed, len);
            need += cached_hits_in(g, hashes, std::min(first, k), k);
        }
        if (need > num_available_blocks(g)) return false;
    }
    return true;
}

GroupAllocResult KvGroupManager::allocate(SeqId seq, std::span<const int32_t> tokens,
                                          std::span<const std::byte> extra_keys,
                                          int64_t max_cached_blocks) {
    require(!contains(seq), "sequence ", seq,
            " is already allocated; free it first or use a new id");
    const auto len = static_cast<int64_t>(tokens.size());
    Seq s;
    s.tokens.assign(tokens.begin(), tokens.end());
    s.extra_keys.assign(extra_keys.begin(), extra_keys.end());
    s.hashes = hash_token_blocks(tokens, config_.block_size, extra_keys);
    const int64_t k = hybrid_hit_blocks(s.hashes, len, max_cached_blocks);
    const int64_t committed = config_.deferred_commit ? k * config_.block_size : len;
    // Check every group before changing any: too large for a pool (Error) first, then short now.
    std::vector<int64_t> fresh(pools_.size());
    for (int g = 0; g < num_groups(); ++g)
        fresh[static_cast<size_t>(g)] = fresh_needed(g, k, committed, len, seq);
    for (int g = 0; g < num_groups(); ++g) {
        int64_t need = fresh[static_cast<size_t>(g)];
        if (!state_group(g)) {
            const int64_t first = keep_from(g, committed, len);
            need += cached_hits_in(g, s.hashes, std::min(first, k), k);
        }
        if (need > num_available_blocks(g))
            throw OutOfBlocksError(detail::concat(
                "sequence ", seq, " of ", len, " tokens needs ", need, " more blocks in group ", g,
                " (", layer_kind_name(group(g).kind), ") but only ", num_available_blocks(g),
                " are free or evictable now; free a sequence first"));
    }

    begin_op();
    s.tables.resize(pools_.size());
    for (int g = 0; g < num_groups(); ++g) {
        Pool& p = pool(g);
        std::vector<BlockId>& t = s.tables[static_cast<size_t>(g)];
        if (state_group(g)) {
            if (len > 0) {
                const BlockId b = take_block(g);
                p.blocks[static_cast<size_t>(b)].ref = 1;
                ++p.num_used;
                t.push_back(b);
            }
            continue;
        }
        const int64_t total = blocks_for_tokens(len);
        const int64_t first = keep_from(g, committed, len);
        t.assign(static_cast<size_t>(total), kNullBlock);
        for (int64_t i = first; i < std::max(first, k); ++i) {
            const BlockId b = p.index.at(s.hashes[static_cast<size_t>(i)]).front();
            Block& m = p.blocks[static_cast<size_t>(b)];
            if (m.ref == 0) {
                lru_remove(p, b);
                --p.num_cached;
                ++p.num_used;
            }
            ++m.ref;
            t[static_cast<size_t>(i)] = b;
        }
        for (int64_t i = std::max(first, k); i < total; ++i) {
            const BlockId b = take_block(g);
            p.blocks[static_cast<size_t>(b)].ref = 1;
            ++p.num_used;
            t[static_cast<size_t>(i)] = b;
        }
    }
    s.committed = k * config_.block_size;
    auto [it, inserted] = seqs_.emplace(seq, std::move(s));
    KVSHARD_CHECK(inserted, "sequence ", seq, " inserted twice");
    if (!config_.deferred_commit) commit_impl(it->second, len);
    flush_events();

    GroupAllocResult r;
    r.cached_blocks = k;
    r.cached_tokens = k * config_.block_size;
    r.new_blocks = std::move(fresh);
    return r;
}

bool KvGroupManager::can_append(SeqId seq, int64_t count) const {
    const Seq& s = seq_or_throw(seq);
    if (count < 0) return false;
    const auto len = static_cast<int64_t>(s.tokens.size());
    const int64_t new_len = len + count;
    const int64_t committed = config_.deferred_commit ? s.committed : new_len;
    for (int g = 0; g < num_groups(); ++g) {
        const Pool& p = pool(g);
        const auto& t = s.tables[static_cast<size_t>(g)];
        if (state_group(g)) {
            if (t.empty() && new_len > 0 && num_available_blocks(g) < 1) return false;
            continue;
        }
        const int64_t first = keep_from(g, committed, new_len);
        const int64_t total = blocks_for_tokens(new_len);
        if (total - first > p.spec.num_blocks) return false;
        // Blocks dropped first (their last reference) become available to the new ones.
        int64_t released = 0;
        for (int64_t i = 0; i < std::min<int64_t>(first, static_cast<int64_t>(t.size())); ++i) {
            const BlockId b = t[static_cast<size_t>(i)];
            released += b != kNullBlock && p.blocks[static_cast<size_t>(b)].ref == 1;
        }
        const int64_t need = total - std::max(first, static_cast<int64_t>(t.size()));
        if (need > num_available_blocks(g) + released) return false;
    }
    return true;
}

void KvGroupManager::append(SeqId seq, std::span<const int32_t> tokens) {
    const auto count = static_cast<int64_t>(tokens.size());
    seq_or_throw(seq);
    Seq& s = seqs_.at(seq);
    if (!can_append(seq, count)) {
        const int64_t new_len = static_cast<int64_t>(s.tokens.size()) + count;
        for (int g = 0; g < num_groups(); ++g) {
            if (state_group(g)) continue;
            const int64_t first =
                keep_from(g, config_.deferred_commit ? s.committed : new_len, new_len);
            const int64_t resident = blocks_for_tokens(new_len) - first;
            require(resident <= group(g).num_blocks, "appending ", count, " tokens to sequence ",
                    seq, " needs ", resident, " resident blocks in group ", g, " (",
                    layer_kind_name(group(g).kind), ") but its whole pool has ",
                    group(g).num_blocks);
        }
        throw OutOfBlocksError(detail::concat("appending ", count, " tokens to sequence ", seq,
                                              " needs more blocks than are free or evictable "
                                              "now in some group; free a sequence first"));
    }
    begin_op();
    const size_t bs = static_cast<size_t>(config_.block_size);
    s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
    const auto len = static_cast<int64_t>(s.tokens.size());
    for (size_t i = s.hashes.size(); (i + 1) * bs <= s.tokens.size(); ++i) {
        const BlockHash parent = i == 0 ? kRootParentHash : s.hashes[i - 1];
        s.hashes.push_back(hash_block(
            parent, std::span<const int32_t>(s.tokens).subspan(i * bs, bs), s.extra_keys));
    }
    const int64_t committed = config_.deferred_commit ? s.committed : len;
    // Drop what fell out of the windows first, so that those blocks can be reused.
    drop_out_of_window(s, committed, len);
    for (int g = 0; g < num_groups(); ++g) {
        Pool& p = pool(g);
        auto& t = s.tables[static_cast<size_t>(g)];
        if (state_group(g)) {
            if (t.empty() && len > 0) {
                const BlockId b = take_block(g);
                p.blocks[static_cast<size_t>(b)].ref = 1;
                ++p.num_used;
                t.push_back(b);
            }
            continue;
        }
        const int64_t first = keep_from(g, committed, len);
        const auto total = static_cast<size_t>(blocks_for_tokens(len));
        while (t.size() < total) {
            if (static_cast<int64_t>(t.size()) < first) {
                t.push_back(kNullBlock);  // already out of the window: never taken
                continue;
            }
            const BlockId b = take_block(g);
            p.blocks[static_cast<size_t>(b)].ref = 1;
            ++p.num_used;
            t.push_back(b);
        }
    }
    if (!config_.deferred_commit) commit_impl(s, len);
    flush_events();
}

void KvGroupManager::commit(SeqId seq, int64_t num_computed_tokens, int64_t next_query) {
    const Seq& cs = seq_or_throw(seq);
    const auto len = static_cast<int64_t>(cs.tokens.size());
    require(num_computed_tokens >= 0 && num_computed_tokens <= len, "sequence ", seq, " holds ",
            len, " tokens, so its committed KV must cover [0, n) with n in [0, ", len,
            "], got n = ", num_computed_tokens);
    require(next_query <= num_computed_tokens, "the next query at ", next_query, " lies after the ",
            num_computed_tokens, " committed tokens");
    begin_op();
    commit_impl(seqs_.at(seq), num_computed_tokens, next_query);
    flush_events();
}

void KvGroupManager::commit_impl(Seq& s, int64_t n, int64_t next_query) {
    if (n <= s.committed) return;
    const auto bs = static_cast<int64_t>(config_.block_size);
    const int64_t from = s.committed / bs, to = n / bs;
    for (int g = 0; g < num_groups(); ++g) {
        if (state_group(g)) continue;
        Pool& p = pool(g);
        const auto& t = s.tables[static_cast<size_t>(g)];
        KvEvent* run = nullptr;  // the open BlockStored event (null while not publishing)
        bool run_open = false;
        for (int64_t i = from; i < to; ++i) {
            const BlockId b = t[static_cast<size_t>(i)];
            const BlockHash& h = s.hashes[static_cast<size_t>(i)];
            // A null entry was out of the window before it was ever taken (no commit deferred).
            // A hash indexed already (the same content in another block) is registered again, as
            // a copy: vLLM's BlockPool.cache_full_blocks never de-duplicates (docs/cache.md).
            if (b == kNullBlock || !config_.enable_prefix_cache) {
                if (b != kNullBlock) p.blocks[static_cast<size_t>(b)].computed = true;
                run_open = false;
                continue;
            }
            Block& m = p.blocks[static_cast<size_t>(b)];
            m.computed = true;
            m.registered = true;
            m.hash = h;
            p.index[h].push_back(b);
            if (!run_open) {
                run = new_event(KvEventKind::kBlockStored, g);
                run_open = true;
                if (run && i > 0) run->parent_hash = s.hashes[static_cast<size_t>(i - 1)];
            }
            if (run) {
                run->block_hashes.push_back(h);
                run->block_ids.push_back(b);
                run->num_tokens += bs;
            }
        }
    }
    s.committed = n;
    drop_out_of_window(s, next_query >= 0 ? next_query : n, static_cast<int64_t>(s.tokens.size()));
}

void KvGroupManager::drop_out_of_window(Seq& s, int64_t committed, int64_t num_tokens) {
    for (int g = 0; g < num_groups(); ++g) {
        if (!windowed(g)) continue;
        auto& t = s.tables[static_cast<size_t>(g)];
        const int64_t first =
            std::min<int64_t>(keep_from(g, committed, num_tokens), static_cast<int64_t>(t.size()));
        for (int64_t i = 0; i < first; ++i) {
            BlockId& b = t[static_cast<size_t>(i)];
            if (b == kNullBlock) continue;
            release_block(g, b);
            b = kNullBlock;
        }
    }
}

void KvGroupManager::free(SeqId seq) {
    const auto it = seqs_.find(seq);
    require(it != seqs_.end(), "sequence ", seq,
            " is not allocated (never allocated, or already freed)");
    for (int g = 0; g < num_groups(); ++g) {
        const auto& t = it->second.tables[static_cast<size_t>(g)];
        // Tail first: among blocks released together, the tail is evicted first.
        for (auto b = t.rbegin(); b != t.rend(); ++b)
            if (*b != kNullBlock) release_block(g, *b);
    }
    seqs_.erase(it);
}

BlockId KvGroupManager::take_block(int g) {
    Pool& p = pool(g);
    if (!p.free_list.empty()) {
        const BlockId b = p.free_list.back();
        p.free_list.pop_back();
        --p.num_free;
        p.blocks[static_cast<size_t>(b)].computed = false;
        return b;
    }
    KVSHARD_CHECK(p.lru_head >= 0, "group ", g, ": take_block with no free or cached block");
    const BlockId b = p.lru_head;
    lru_remove(p, b);
    --p.num_cached;
    Block& m = p.blocks[static_cast<size_t>(b)];
    if (KvEvent* e = removed_event(g)) {
        e->block_hashes.push_back(m.hash);
        e->block_ids.push_back(b);
    }
    // That copy only; the others of its hash stay findable (vLLM's _maybe_evict_cached_block).
    auto& copies = p.index.at(m.hash);
    copies.erase(std::find(copies.begin(), copies.end(), b));
    if (copies.empty()) p.index.erase(m.hash);
    m.registered = false;
    m.computed = false;
    m.hash = BlockHash{};
    return b;
}

void KvGroupManager::release_block(int g, BlockId b) {
    Pool& p = pool(g);
    Block& m = p.blocks[static_cast<size_t>(b)];
    KVSHARD_CHECK(m.ref > 0, "group ", g, ": releasing block ", b, " with reference count ", m.ref);
    if (--m.ref > 0) return;
    --p.num_used;
    if (m.registered) {
        lru_push_back(p, b);
        ++p.num_cached;
    } else {
        m.computed = false;
        p.free_list.push_back(b);
        ++p.num_free;
    }
}

// ---------------------------------------------------------------- queries

const KvGroupManager::Seq& KvGroupManager::seq_or_throw(SeqId seq) const {
    const auto it = seqs_.find(seq);
    require(it != seqs_.end(), "sequence ", seq,
            " is not allocated (never allocated, or already freed)");
    return it->second;
}

int64_t KvGroupManager::num_tokens(SeqId seq) const {
    return static_cast<int64_t>(seq_or_throw(seq).tokens.size());
}

int64_t KvGroupManager::num_committed_tokens(SeqId seq) const {
    return seq_or_throw(seq).committed;
}

std::span<const BlockId> KvGroupManager::block_table(int g, SeqId seq) const {
    group(g);
    return seq_or_throw(seq).tables[static_cast<size_t>(g)];
}

int64_t KvGroupManager::resident_blocks(int g, SeqId seq) const {
    const auto t = block_table(g, seq);
    return static_cast<int64_t>(
        std::count_if(t.begin(), t.end(), [](BlockId b) { return b != kNullBlock; }));
}

PagedKv KvGroupManager::paged_kv(int g, std::span<const SeqId> seqs) const {
    require(!holds_state(group(g).kind), "group ", g, " (", layer_kind_name(group(g).kind),
            ") keeps one recurrent state per sequence, not pages of tokens: read its state "
            "slot, block_table(g, seq)[0]");
    PagedKv kv;
    for (const SeqId id : seqs) {
        const Seq& s = seq_or_throw(id);
        kv.add_sequence(s.tables[static_cast<size_t>(g)], static_cast<int64_t>(s.tokens.size()),
                        config_.block_size);
    }
    return kv;
}

int64_t KvGroupManager::num_available_blocks(int g) const {
    const Pool& p = checked_pool(g);
    return p.num_free + p.num_cached;
}

int64_t KvGroupManager::num_used_blocks(int g) const { return checked_pool(g).num_used; }

BlockState KvGroupManager::block_state(int g, BlockId b) const {
    const Pool& p = checked_pool(g);
    require(b >= 0 && b < p.spec.num_blocks, "block id ", b, " out of range [0, ",
            p.spec.num_blocks, ") of group ", g);
    const Block& m = p.blocks[static_cast<size_t>(b)];
    if (m.ref > 0) return BlockState::kUsed;
    return m.registered ? BlockState::kCached : BlockState::kFree;
}

int32_t KvGroupManager::ref_count(int g, BlockId b) const {
    block_state(g, b);
    return pool(g).blocks[static_cast<size_t>(b)].ref;
}

bool KvGroupManager::block_computed(int g, BlockId b) const {
    block_state(g, b);
    return pool(g).blocks[static_cast<size_t>(b)].computed;
}

std::optional<BlockHash> KvGroupManager::registered_hash(int g, BlockId b) const {
    block_state(g, b);
    const Block& m = pool(g).blocks[static_cast<size_t>(b)];
    if (!m.registered) return std::nullopt;
    return m.hash;
}

std::vector<BlockId> KvGroupManager::eviction_order(int g) const {
    const Pool& p = checked_pool(g);
    std::vector<BlockId> out;
    for (BlockId b = p.lru_head; b >= 0; b = p.blocks[static_cast<size_t>(b)].lru_next)
        out.push_back(b);
    return out;
}

// ---------------------------------------------------------------- LRU

void KvGroupManager::lru_push_back(Pool& p, BlockId b) {
    detail::lru_link_back(p.blocks, p.lru_head, p.lru_tail, b);
}

void KvGroupManager::lru_remove(Pool& p, BlockId b) {
    detail::lru_unlink(p.blocks, p.lru_head, p.lru_tail, b);
}

// ---------------------------------------------------------------- events

int KvGroupManager::subscribe(KvEventCallback callback) {
    return subscribers_.add(std::move(callback));
}

void KvGroupManager::unsubscribe(int subscription_id) { subscribers_.remove(subscription_id); }

void KvGroupManager::begin_op() {
    publishing_ = !subscribers_.empty();
    open_removed_group_ = -1;
    pending_.clear();
}

KvEvent* KvGroupManager::new_event(KvEventKind kind, int g) {
    open_removed_group_ = kind == KvEventKind::kBlockRemoved ? g : -1;
    const uint64_t seq = next_event_seq_++;
    if (!publishing_) return nullptr;
    KvEvent& e = pending_.emplace_back();
    e.kind = kind;
    e.seq = seq;
    e.block_size = config_.block_size;
    e.group = g;
    return &e;
}

KvEvent* KvGroupManager::removed_event(int g) {
    if (open_removed_group_ == g) return publishing_ ? &pending_.back() : nullptr;
    return new_event(KvEventKind::kBlockRemoved, g);
}

void KvGroupManager::flush_events() {
    open_removed_group_ = -1;
    subscribers_.deliver(pending_);
}

// ---------------------------------------------------------------- invariants

void KvGroupManager::check_invariants() const {
    const auto bs = static_cast<int64_t>(config_.block_size);
    for (int g = 0; g < num_groups(); ++g) {
        const Pool& p = pool(g);
        const auto n = static_cast<size_t>(p.spec.num_blocks);
        std::vector<int32_t> refs(n, 0);
        for (const auto& [id, s] : seqs_) {
            const auto& t = s.tables[static_cast<size_t>(g)];
            const auto len = static_cast<int64_t>(s.tokens.size());
            if (state_group(g)) {
                KVSHARD_CHECK(static_cast<int64_t>(t.size()) == (len > 0 ? 1 : 0), "sequence ", id,
                              " holds ", t.size(), " state slots in group ", g);
            } else {
                KVSHARD_CHECK(static_cast<int64_t>(t.size()) == blocks_for_tokens(len), "sequence ",
                              id, " group ", g, " table of ", t.size(), " entries for ", len,
                              " tokens");
                const int64_t first = keep_from(g, s.committed, len);
                for (int64_t i = 0; i < static_cast<int64_t>(t.size()); ++i) {
                    const BlockId b = t[static_cast<size_t>(i)];
                    KVSHARD_CHECK((b == kNullBlock) == (i < first), "sequence ", id, " group ", g,
                                  " entry ", i, (b == kNullBlock ? " dropped" : " held"),
                                  " but the window keeps entries from ", first);
                    if (b == kNullBlock) continue;
                    const Block& m = p.blocks[static_cast<size_t>(b)];
                    KVSHARD_CHECK(m.computed == (i < s.committed / bs), "sequence ", id, " group ",
                                  g, " entry ", i, " computed flag with ", s.committed,
                                  " tokens committed");
                    KVSHARD_CHECK(!m.registered || m.hash == s.hashes[static_cast<size_t>(i)],
                                  "sequence ", id, " group ", g, " entry ", i,
                                  " registered under another hash");
                }
            }
            std::vector<BlockId> sorted;
            for (const BlockId b : t) {
                if (b == kNullBlock) continue;
                KVSHARD_CHECK(b >= 0 && static_cast<size_t>(b) < n, "block id ", b,
                              " out of range in group ", g);
                ++refs[static_cast<size_t>(b)];
                sorted.push_back(b);
            }
            std::sort(sorted.begin(), sorted.end());
            KVSHARD_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                          "sequence ", id, " holds a block twice in group ", g);
        }
        int64_t used = 0, cached = 0, unused = 0, registered = 0;
        for (size_t b = 0; b < n; ++b) {
            const Block& m = p.blocks[b];
            KVSHARD_CHECK(m.ref == refs[b], "group ", g, " block ", b, " reference count ", m.ref,
                          " but ", refs[b], " table references");
            KVSHARD_CHECK(!m.registered || m.computed, "group ", g, " block ", b,
                          " registered but not computed");
            if (m.ref > 0) {
                ++used;
                KVSHARD_CHECK(!m.in_lru, "used block ", b, " in the LRU list");
            } else if (m.registered) {
                ++cached;
                KVSHARD_CHECK(m.in_lru, "cached block ", b, " not in the LRU list");
            } else {
                ++unused;
                KVSHARD_CHECK(!m.in_lru && !m.computed, "free block ", b, " of group ", g,
                              " in the LRU list or marked computed");
            }
            if (m.registered) {
                ++registered;
                const auto it = p.index.find(m.hash);
                KVSHARD_CHECK(
                    it != p.index.end() && std::count(it->second.begin(), it->second.end(), b) == 1,
                    "group ", g, " block ", b, " registered but not indexed once");
            }
        }
        KVSHARD_CHECK(used == p.num_used && cached == p.num_cached && unused == p.num_free,
                      "group ", g, " state counters");
        int64_t indexed = 0;
        for (const auto& [h, copies] : p.index) indexed += static_cast<int64_t>(copies.size());
        KVSHARD_CHECK(indexed == registered, "group ", g, " index holds ", indexed, " blocks for ",
                      registered, " registered blocks");
        KVSHARD_CHECK(static_cast<int64_t>(p.free_list.size()) == unused, "group ", g,
                      " free list size");
        int64_t k = 0;
        BlockId prev = -1;
        for (BlockId b = p.lru_head; b >= 0; b = p.blocks[static_cast<size_t>(b)].lru_next) {
            KVSHARD_CHECK(k < cached, "group ", g, " LRU list longer than the cached blocks");
            const Block& m = p.blocks[static_cast<size_t>(b)];
            KVSHARD_CHECK(m.lru_prev == prev, "group ", g, " LRU back link of block ", b);
            KVSHARD_CHECK(m.ref == 0 && m.registered, "group ", g, " LRU holds block ", b);
            ++k;
            prev = b;
        }
        KVSHARD_CHECK(prev == p.lru_tail && k == cached, "group ", g, " LRU tail / length");
    }
    KVSHARD_CHECK(pending_.empty(), "undelivered events outside an operation");
}

}  // namespace kvshard
