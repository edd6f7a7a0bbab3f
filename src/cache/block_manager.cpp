#include "kvshard/cache/block_manager.h"

#include <algorithm>
#include <bit>

#include "cache/block_lru.h"

namespace kvshard {

// ---------------------------------------------------------------- hash index

BlockManager::HashIndex::HashIndex(size_t max_entries) {
    size_t cap = 16;
    while (cap < 2 * max_entries) cap *= 2;
    slots_.resize(cap);
    mask_ = cap - 1;
    shift_ = 64 - std::countr_zero(cap);
}

size_t BlockManager::HashIndex::home(const BlockHash& h) const {
    // Fibonacci hashing of both halves: caller-supplied hashes (trace ids) need not be uniform.
    return static_cast<size_t>(((h.lo ^ (h.hi * 0xC2B2AE3D27D4EB4Full)) * 0x9E3779B97F4A7C15ull) >>
                               shift_);
}

BlockId BlockManager::HashIndex::find(const BlockHash& h) const {
    for (size_t i = home(h);; i = (i + 1) & mask_) {
        const Slot& s = slots_[i];
        if (s.value < 0) return -1;
        if (s.key == h) return s.value;
    }
}

void BlockManager::HashIndex::insert(const BlockHash& h, BlockId b) {
    KVSHARD_CHECK(size_ < slots_.size() / 2, "hash index over its load limit");
    for (size_t i = home(h);; i = (i + 1) & mask_) {
        Slot& s = slots_[i];
        KVSHARD_CHECK(s.value < 0 || s.key != h, "hash inserted twice into the index");
        if (s.value < 0) {
            s.key = h;
            s.value = b;
            ++size_;
            return;
        }
    }
}

void BlockManager::HashIndex::assign(const BlockHash& h, BlockId b) {
    for (size_t i = home(h);; i = (i + 1) & mask_) {
        Slot& s = slots_[i];
        KVSHARD_CHECK(s.value >= 0, "assigning a hash that is not in the index");
        if (s.key == h) {
            s.value = b;
            return;
        }
    }
}

void BlockManager::HashIndex::erase(const BlockHash& h) {
    size_t i = home(h);
    while (true) {
        KVSHARD_CHECK(slots_[i].value >= 0, "erasing a hash that is not in the index");
        if (slots_[i].key == h) break;
        i = (i + 1) & mask_;
    }
    // Backward-shift deletion: move later members of the probe run into the hole when their home
    // position allows it, so that no tombstones are needed.
    size_t hole = i;
    for (size_t j = (hole + 1) & mask_; slots_[j].value >= 0; j = (j + 1) & mask_) {
        const size_t k = home(slots_[j].key);
        // j may fill the hole unless its home lies cyclically in (hole, j].
        const bool home_in_between = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
        if (!home_in_between) {
            slots_[hole] = slots_[j];
            hole = j;
        }
    }
    slots_[hole] = Slot{};
    --size_;
}

void BlockManager::HashIndex::clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    size_ = 0;
}

// ---------------------------------------------------------------- construction

BlockManager::BlockManager(BlockManagerConfig config)
    : config_(config),
      index_(config.enable_prefix_cache && config.num_blocks > 0
                 ? static_cast<size_t>(config.num_blocks)
                 : 0) {
    require(config_.block_size >= 1, "block size must be at least 1 token, got ",
            config_.block_size);
    require(config_.num_blocks >= 1, "a block manager needs at least one block, got ",
            config_.num_blocks);
    require(config_.num_blocks <= INT32_MAX, "at most ", INT32_MAX, " blocks, got ",
            config_.num_blocks);
    blocks_.resize(static_cast<size_t>(config_.num_blocks));
    free_list_.reserve(blocks_.size());
    // Hand out block 0 first.
    for (int64_t b = config_.num_blocks - 1; b >= 0; --b)
        free_list_.push_back(static_cast<BlockId>(b));
    num_free_ = config_.num_blocks;
}

// ---------------------------------------------------------------- lookup

PrefixMatch BlockManager::lookup(std::span<const int32_t> tokens,
                                 std::span<const std::byte> extra_keys) const {
    PrefixMatch m;
    if (!config_.enable_prefix_cache) return m;
    const size_t bs = static_cast<size_t>(config_.block_size);
    // Hash a chunk of blocks at a time on the fast chained path, stop at the first miss: at most
    // one chunk is hashed in vain.
    constexpr size_t kChunkBlocks = 32;
    const size_t full = tokens.size() / bs;
    BlockHash parent = kRootParentHash;
    for (size_t first = 0; first < full; first += kChunkBlocks) {
        const size_t n = std::min(kChunkBlocks, full - first);
        scratch_hashes_.clear();
        hasher_.hash_blocks(parent, tokens.subspan(first * bs, n * bs), config_.block_size,
                            extra_keys, scratch_hashes_);
        for (const BlockHash& h : scratch_hashes_) {
            const BlockId b = index_.find(h);
            if (b < 0) {
                m.num_tokens = static_cast<int64_t>(m.blocks.size()) * config_.block_size;
                return m;
            }
            m.blocks.push_back(b);
        }
        parent = scratch_hashes_.back();
    }
    m.num_tokens = static_cast<int64_t>(m.blocks.size()) * config_.block_size;
    return m;
}

PrefixMatch BlockManager::lookup_hashes(std::span<const BlockHash> block_hashes) const {
    PrefixMatch m;
    if (!config_.enable_prefix_cache) return m;
    for (const BlockHash& h : block_hashes) {
        const BlockId b = index_.find(h);
        if (b < 0) break;
        m.blocks.push_back(b);
    }
    m.num_tokens = static_cast<int64_t>(m.blocks.size()) * config_.block_size;
    return m;
}

void BlockManager::match(std::span<const BlockHash> hashes, int64_t max_hits,
                         std::vector<BlockId>& hits) const {
    hits.clear();
    if (!config_.enable_prefix_cache) return;
    if (max_hits >= 0 && static_cast<size_t>(max_hits) < hashes.size())
        hashes = hashes.first(static_cast<size_t>(max_hits));
    for (const BlockHash& h : hashes) {
        const BlockId b = index_.find(h);
        if (b < 0) break;
        hits.push_back(b);
    }
}

// ---------------------------------------------------------------- allocation

int64_t BlockManager::blocks_needed(int64_t num_tokens, std::span<const BlockId> hits) const {
    const int64_t total = blocks_for_tokens(num_tokens);
    if (total > config_.num_blocks)
        throw Error(detail::concat(
            "a sequence of ", num_tokens, " tokens needs ", total, " blocks of ",
            config_.block_size, " tokens but the whole pool has ", config_.num_blocks,
            " blocks (at most ", config_.num_blocks * config_.block_size, " tokens per sequence)"));
    int64_t need = total - static_cast<int64_t>(hits.size());
    for (const BlockId b : hits) need += blocks_[static_cast<size_t>(b)].ref == 0;
    return need;
}

bool BlockManager::can_allocate(std::span<const int32_t> tokens,
                                std::span<const std::byte> extra_keys,
                                int64_t max_cached_blocks) const {
    scratch_hashes_.clear();
    if (config_.enable_prefix_cache)
        hasher_.hash_blocks(kRootParentHash, tokens, config_.block_size, extra_keys,
                            scratch_hashes_);
    return can_allocate_hashes(scratch_hashes_, static_cast<int64_t>(tokens.size()),
                               max_cached_blocks);
}

bool BlockManager::can_allocate_hashes(std::span<const BlockHash> block_hashes, int64_t num_tokens,
                                       int64_t max_cached_blocks) const {
    if (num_tokens < 0 || blocks_for_tokens(num_tokens) > config_.num_blocks) return false;
    const size_t full = static_cast<size_t>(num_tokens / config_.block_size);
    match(block_hashes.first(std::min(full, block_hashes.size())), max_cached_blocks,
          scratch_hits_);
    return blocks_needed(num_tokens, scratch_hits_) <= num_available_blocks();
}

AllocResult BlockManager::allocate(SeqId seq, std::span<const int32_t> tokens,
                                   std::span<const std::byte> extra_keys,
                                   int64_t max_cached_blocks) {
    scratch_hashes_.clear();
    if (config_.enable_prefix_cache)
        hasher_.hash_blocks(kRootParentHash, tokens, config_.block_size, extra_keys,
                            scratch_hashes_);
    const AllocResult r =
        allocate_impl(seq, scratch_hashes_, static_cast<int64_t>(tokens.size()), max_cached_blocks);
    if (config_.enable_prefix_cache) {
        Seq& s = seqs_.at(seq);
        const size_t full_tokens = scratch_hashes_.size() * static_cast<size_t>(config_.block_size);
        s.tail.assign(tokens.begin() + static_cast<ptrdiff_t>(full_tokens), tokens.end());
        s.extra_keys.assign(extra_keys.begin(), extra_keys.end());
        s.hashable = true;
    }
    return r;
}

AllocResult BlockManager::allocate_with_hashes(SeqId seq, std::span<const BlockHash> block_hashes,
                                               int64_t num_tokens, int64_t max_cached_blocks) {
    require(num_tokens >= 0, "a sequence cannot have ", num_tokens, " tokens");
    const size_t full = static_cast<size_t>(num_tokens / config_.block_size);
    const auto total = static_cast<size_t>(blocks_for_tokens(num_tokens));
    if (block_hashes.size() < full || block_hashes.size() > total)
        throw Error(detail::concat(
            "sequence ", seq, ": ", num_tokens, " tokens in blocks of ", config_.block_size,
            " need ", full, full == total ? "" : " or ", full == total ? "" : std::to_string(total),
            " block hashes (one per full block, optionally one for the partial last block), got ",
            block_hashes.size()));
    return allocate_impl(seq, block_hashes.first(full), num_tokens, max_cached_blocks);
}

AllocResult BlockManager::allocate_impl(SeqId seq, std::span<const BlockHash> hashes,
                                        int64_t num_tokens, int64_t max_cached_blocks) {
    require(!contains(seq), "sequence ", seq,
            " is already allocated; free it first or use a new id");
    require(num_tokens >= 0, "a sequence cannot have ", num_tokens, " tokens");
    match(hashes, max_cached_blocks, scratch_hits_);
    const size_t hits = scratch_hits_.size();
    const int64_t need = blocks_needed(num_tokens, scratch_hits_);
    if (need > num_available_blocks())
        throw OutOfBlocksError(detail::concat(
            "sequence ", seq, " of ", num_tokens, " tokens needs ", need, " more blocks but only ",
            num_available_blocks(), " are free or evictable now; free a sequence first"));

    begin_op();
    Seq s;
    const auto total = static_cast<size_t>(blocks_for_tokens(num_tokens));
    s.blocks.reserve(total);
    for (size_t i = 0; i < hits; ++i) {
        const BlockId b = scratch_hits_[i];
        Block& m = blocks_[static_cast<size_t>(b)];
        if (m.ref == 0) {
            lru_remove(b);
            --num_cached_;
            ++num_used_;
        }
        ++m.ref;
        s.blocks.push_back(b);
    }
    for (size_t i = hits; i < total; ++i) {
        const BlockId b = take_block();
        blocks_[static_cast<size_t>(b)].ref = 1;
        ++num_used_;
        s.blocks.push_back(b);
    }
    s.num_tokens = num_tokens;
    s.hashable = false;
    if (config_.enable_prefix_cache) s.hashes.assign(hashes.begin(), hashes.end());
    // The shared prefix is computed (only registered, hence computed, blocks are found).
    s.committed_tokens = static_cast<int64_t>(hits) * config_.block_size;
    if (!config_.deferred_commit) commit_impl(s, num_tokens);

    if (config_.enable_prefix_cache) {
        ++counters_.queries;
        counters_.query_tokens += num_tokens;
        counters_.hit_tokens += static_cast<int64_t>(hits) * config_.block_size;
    }
    seqs_.emplace(seq, std::move(s));
    flush_events();

    AllocResult r;
    r.cached_blocks = static_cast<int64_t>(hits);
    r.cached_tokens = r.cached_blocks * config_.block_size;
    r.new_blocks = static_cast<int64_t>(total - hits);
    return r;
}

BlockId BlockManager::take_block() {
    if (!free_list_.empty()) {
        const BlockId b = free_list_.back();
        free_list_.pop_back();
        --num_free_;
        blocks_[static_cast<size_t>(b)].computed = false;
        return b;
    }
    KVSHARD_CHECK(lru_head_ >= 0, "take_block called with no free or cached block");
    const BlockId b = lru_head_;
    lru_remove(b);
    --num_cached_;
    if (KvEvent* e = event_for(KvEventKind::kBlockRemoved, false)) {
        e->block_hashes.push_back(blocks_[static_cast<size_t>(b)].hash);
        e->block_ids.push_back(b);
    }
    unregister(b);
    blocks_[static_cast<size_t>(b)].computed = false;
    ++counters_.evictions;
    return b;
}

void BlockManager::release_block(BlockId b) {
    Block& m = blocks_[static_cast<size_t>(b)];
    KVSHARD_CHECK(m.ref > 0, "releasing block ", b, " with reference count ", m.ref);
    if (--m.ref > 0) return;
    --num_used_;
    if (m.registered) {
        lru_push_back(b);
        ++num_cached_;
    } else {
        free_list_.push_back(b);
        ++num_free_;
        m.computed = false;
    }
}

void BlockManager::commit_impl(Seq& s, int64_t n) {
    if (n <= s.committed_tokens) return;
    const auto bs = static_cast<int64_t>(config_.block_size);
    const auto from = static_cast<size_t>(s.committed_tokens / bs);
    const auto to = static_cast<size_t>(n / bs);
    for (size_t i = from; i < to; ++i) blocks_[static_cast<size_t>(s.blocks[i])].computed = true;
    s.committed_tokens = n;
    register_blocks(s, from, to);
}

void BlockManager::commit(SeqId seq, int64_t num_computed_tokens) {
    Seq& s = seq_or_throw(seq);
    require(num_computed_tokens >= 0 && num_computed_tokens <= s.num_tokens, "sequence ", seq,
            " holds ", s.num_tokens,
            " tokens, so its committed KV must cover [0, n) with n in [0, ", s.num_tokens,
            "], got n = ", num_computed_tokens);
    begin_op();
    commit_impl(s, num_computed_tokens);
    flush_events();
}

void BlockManager::register_blocks(Seq& s, size_t from, size_t to) {
    if (!config_.enable_prefix_cache) return;
    KvEvent* group = nullptr;
    bool group_open = false;
    to = std::min(to, s.hashes.size());
    for (size_t i = from; i < to; ++i) {
        // The sequence's previous block is registered: it was a hit or registered before this
        // one, it is used so never evicted, and clear_cache refuses while any block is used.
        KVSHARD_CHECK(i == 0 || blocks_[static_cast<size_t>(s.blocks[i - 1])].registered, "block ",
                      i, " of sequence registered after its unregistered parent");
        // Another block may hold the same hash (the same content computed by another sequence,
        // or past a capped hit): this one is registered beside it, as vLLM's cache_full_blocks
        // does (it never de-duplicates, so that block tables stay append-only).
        const BlockId b = s.blocks[i];
        Block& m = blocks_[static_cast<size_t>(b)];
        KVSHARD_CHECK(!m.registered, "block ", b, " registered twice");
        KVSHARD_CHECK(m.computed, "block ", b, " registered before its KV was committed");
        m.registered = true;
        m.hash = s.hashes[i];
        m.has_parent = i > 0;
        m.parent = i > 0 ? s.hashes[i - 1] : BlockHash{};
        index_link(b);
        ++counters_.stored_blocks;
        if (!group_open) {
            group = event_for(KvEventKind::kBlockStored, true);
            group_open = true;
            if (group && i > 0) group->parent_hash = s.hashes[i - 1];
        }
        if (group) {
            group->block_hashes.push_back(m.hash);
            group->block_ids.push_back(b);
            group->num_tokens += config_.block_size;
        }
    }
}

void BlockManager::index_link(BlockId b) {
    Block& m = blocks_[static_cast<size_t>(b)];
    const BlockId head = index_.find(m.hash);
    if (head < 0) {
        index_.insert(m.hash, b);
        m.dup_prev = m.dup_next = b;
    } else {  // behind the newest copy: the ring runs oldest (the head) to newest
        Block& h = blocks_[static_cast<size_t>(head)];
        const BlockId tail = h.dup_prev;
        blocks_[static_cast<size_t>(tail)].dup_next = b;
        m.dup_prev = tail;
        m.dup_next = head;
        h.dup_prev = b;
    }
    ++num_registered_;
}

void BlockManager::index_unlink(BlockId b) {
    Block& m = blocks_[static_cast<size_t>(b)];
    if (m.dup_next == b) {
        index_.erase(m.hash);
    } else {
        blocks_[static_cast<size_t>(m.dup_prev)].dup_next = m.dup_next;
        blocks_[static_cast<size_t>(m.dup_next)].dup_prev = m.dup_prev;
        // The oldest remaining copy is what a lookup finds next.
        if (index_.find(m.hash) == b) index_.assign(m.hash, m.dup_next);
    }
    m.dup_prev = m.dup_next = -1;
    --num_registered_;
}

void BlockManager::unregister(BlockId b) {
    Block& m = blocks_[static_cast<size_t>(b)];
    index_unlink(b);
    m.registered = false;
    m.has_parent = false;
    m.hash = BlockHash{};
    m.parent = BlockHash{};
}

// ---------------------------------------------------------------- append / free

bool BlockManager::can_append(SeqId seq, int64_t count) const {
    const Seq& s = seq_or_throw(seq);
    if (count < 0) return false;
    const int64_t more =
        blocks_for_tokens(s.num_tokens + count) - static_cast<int64_t>(s.blocks.size());
    return more <= num_available_blocks();
}

void BlockManager::grow(SeqId seq, Seq& s, int64_t count) {
    const int64_t total = blocks_for_tokens(s.num_tokens + count);
    if (total > config_.num_blocks)
        throw Error(detail::concat("appending ", count, " tokens to sequence ", seq, " (",
                                   s.num_tokens, " tokens) needs ", total,
                                   " blocks but the whole pool has ", config_.num_blocks));
    const int64_t more = total - static_cast<int64_t>(s.blocks.size());
    if (more > num_available_blocks())
        throw OutOfBlocksError(detail::concat(
            "appending ", count, " tokens to sequence ", seq, " needs ", more,
            " more blocks but only ", num_available_blocks(), " are free or evictable now"));
    begin_op();
    for (int64_t i = 0; i < more; ++i) {
        const BlockId b = take_block();
        blocks_[static_cast<size_t>(b)].ref = 1;
        ++num_used_;
        s.blocks.push_back(b);
    }
    s.num_tokens += count;
}

void BlockManager::append(SeqId seq, std::span<const int32_t> tokens) {
    Seq& s = seq_or_throw(seq);
    const auto count = static_cast<int64_t>(tokens.size());
    grow(seq, s, count);
    if (s.hashable) {
        const size_t bs = static_cast<size_t>(config_.block_size);
        BlockHash parent = s.hashes.empty() ? kRootParentHash : s.hashes.back();
        size_t pos = 0;
        if (!s.tail.empty()) {
            const size_t take = std::min(bs - s.tail.size(), tokens.size());
            s.tail.insert(s.tail.end(), tokens.begin(),
                          tokens.begin() + static_cast<ptrdiff_t>(take));
            pos = take;
            if (s.tail.size() == bs) {
                parent = hasher_.hash(parent, s.tail, s.extra_keys);
                s.hashes.push_back(parent);
                s.tail.clear();
            }
        }
        if (s.tail.empty()) {
            const auto rest = tokens.subspan(pos);
            const size_t full = rest.size() / bs;
            hasher_.hash_blocks(parent, rest.first(full * bs), config_.block_size, s.extra_keys,
                                s.hashes);
            s.tail.assign(rest.begin() + static_cast<ptrdiff_t>(full * bs), rest.end());
        }
    }
    if (!config_.deferred_commit) commit_impl(s, s.num_tokens);
    flush_events();
}

void BlockManager::append_tokens(SeqId seq, int64_t count) {
    Seq& s = seq_or_throw(seq);
    require(count >= 0, "cannot append ", count, " tokens");
    grow(seq, s, count);
    if (count > 0) {
        s.hashable = false;
        s.tail.clear();
    }
    if (!config_.deferred_commit) commit_impl(s, s.num_tokens);
    flush_events();
}

void BlockManager::free(SeqId seq) {
    const auto it = seqs_.find(seq);
    require(it != seqs_.end(), "sequence ", seq,
            " is not allocated (never allocated, or already freed)");
    const std::vector<BlockId>& blocks = it->second.blocks;
    // Tail first: among blocks released together, the chain's tail is evicted first.
    for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) release_block(*b);
    seqs_.erase(it);
}

bool BlockManager::clear_cache() {
    // vLLM's BlockPool.reset_prefix_cache (vllm/v1/core/block_pool.py) refuses, returning False
    // and publishing nothing, while any block other than its null block is in use.
    if (num_used_ > 0) return false;
    begin_op();
    for (size_t i = 0; i < blocks_.size(); ++i) {
        Block& m = blocks_[i];
        if (!m.registered) continue;
        const auto b = static_cast<BlockId>(i);
        KVSHARD_CHECK(m.ref == 0, "block ", b, " in use while no block is used");
        lru_remove(b);
        --num_cached_;
        free_list_.push_back(b);
        ++num_free_;
        m.computed = false;
        m.registered = m.has_parent = false;
        m.hash = m.parent = BlockHash{};
        m.dup_prev = m.dup_next = -1;
    }
    index_.clear();
    num_registered_ = 0;
    KVSHARD_CHECK(index_.empty(), "prefix index not empty after clearing every block");
    event_for(KvEventKind::kAllCleared, true);
    flush_events();
    return true;
}

// ---------------------------------------------------------------- queries

const BlockManager::Seq& BlockManager::seq_or_throw(SeqId seq) const {
    const auto it = seqs_.find(seq);
    require(it != seqs_.end(), "sequence ", seq,
            " is not allocated (never allocated, or already freed)");
    return it->second;
}

BlockManager::Seq& BlockManager::seq_or_throw(SeqId seq) {
    const auto it = seqs_.find(seq);
    require(it != seqs_.end(), "sequence ", seq,
            " is not allocated (never allocated, or already freed)");
    return it->second;
}

std::span<const BlockId> BlockManager::block_table(SeqId seq) const {
    return seq_or_throw(seq).blocks;
}

int64_t BlockManager::num_tokens(SeqId seq) const { return seq_or_throw(seq).num_tokens; }

int64_t BlockManager::num_committed_tokens(SeqId seq) const {
    return seq_or_throw(seq).committed_tokens;
}

std::span<const BlockHash> BlockManager::block_hashes(SeqId seq) const {
    return seq_or_throw(seq).hashes;
}

PagedKv BlockManager::paged_kv(std::span<const SeqId> seqs) const {
    PagedKv kv;
    for (const SeqId id : seqs) {
        const Seq& s = seq_or_throw(id);
        kv.add_sequence(s.blocks, s.num_tokens, config_.block_size);
    }
    return kv;
}

CacheMetrics BlockManager::metrics() const {
    CacheMetrics m = counters_;
    m.num_blocks = config_.num_blocks;
    m.used_blocks = num_used_;
    m.free_blocks = num_free_;
    m.cached_blocks = num_cached_;
    m.hashed_blocks = num_registered_;
    m.num_sequences = static_cast<int64_t>(seqs_.size());
    return m;
}

BlockState BlockManager::block_state(BlockId b) const {
    require(b >= 0 && b < config_.num_blocks, "block id ", b, " out of range [0, ",
            config_.num_blocks, ")");
    const Block& m = blocks_[static_cast<size_t>(b)];
    if (m.ref > 0) return BlockState::kUsed;
    return m.registered ? BlockState::kCached : BlockState::kFree;
}

int32_t BlockManager::ref_count(BlockId b) const {
    require(b >= 0 && b < config_.num_blocks, "block id ", b, " out of range [0, ",
            config_.num_blocks, ")");
    return blocks_[static_cast<size_t>(b)].ref;
}

bool BlockManager::block_computed(BlockId b) const {
    require(b >= 0 && b < config_.num_blocks, "block id ", b, " out of range [0, ",
            config_.num_blocks, ")");
    return blocks_[static_cast<size_t>(b)].computed;
}

std::optional<BlockHash> BlockManager::registered_hash(BlockId b) const {
    require(b >= 0 && b < config_.num_blocks, "block id ", b, " out of range [0, ",
            config_.num_blocks, ")");
    const Block& m = blocks_[static_cast<size_t>(b)];
    if (!m.registered) return std::nullopt;
    return m.hash;
}

std::vector<BlockHash> BlockManager::registered_hashes() const {
    std::vector<BlockHash> out;
    out.reserve(index_.size());
    for (const Block& m : blocks_)
        if (m.registered) out.push_back(m.hash);
    return out;
}

std::vector<BlockId> BlockManager::eviction_order() const {
    std::vector<BlockId> out;
    for (BlockId b = lru_head_; b >= 0; b = blocks_[static_cast<size_t>(b)].lru_next)
        out.push_back(b);
    return out;
}

// ---------------------------------------------------------------- LRU

void BlockManager::lru_push_back(BlockId b) {
    detail::lru_link_back(blocks_, lru_head_, lru_tail_, b);
}

void BlockManager::lru_remove(BlockId b) { detail::lru_unlink(blocks_, lru_head_, lru_tail_, b); }

// ---------------------------------------------------------------- events

int BlockManager::subscribe(KvEventCallback callback) {
    return subscribers_.add(std::move(callback));
}

void BlockManager::unsubscribe(int subscription_id) { subscribers_.remove(subscription_id); }

void BlockManager::begin_op() {
    publishing_ = !subscribers_.empty();
    open_kind_.reset();
    pending_.clear();
}

KvEvent* BlockManager::event_for(KvEventKind kind, bool force_new) {
    if (!force_new && open_kind_ == kind) return publishing_ ? &pending_.back() : nullptr;
    open_kind_ = kind;
    const uint64_t seq = next_event_seq_++;
    if (!publishing_) return nullptr;
    KvEvent& e = pending_.emplace_back();
    e.kind = kind;
    e.seq = seq;
    e.block_size = config_.block_size;
    return &e;
}

void BlockManager::flush_events() {
    open_kind_.reset();
    subscribers_.deliver(pending_);
}

// ---------------------------------------------------------------- invariants

void BlockManager::check_invariants() const {
    const auto n = static_cast<size_t>(config_.num_blocks);
    KVSHARD_CHECK(blocks_.size() == n, "block metadata size");
    std::vector<int32_t> refs(n, 0);
    for (const auto& [id, s] : seqs_) {
        KVSHARD_CHECK(static_cast<int64_t>(s.blocks.size()) == blocks_for_tokens(s.num_tokens),
                      "sequence ", id, " holds ", s.blocks.size(), " blocks for ", s.num_tokens,
                      " tokens");
        const auto full = static_cast<size_t>(s.num_tokens / config_.block_size);
        KVSHARD_CHECK(s.hashes.size() <= full, "sequence ", id, " has hashes of partial blocks");
        if (s.hashable) {
            KVSHARD_CHECK(
                s.hashes.size() == full &&
                    s.tail.size() == static_cast<size_t>(s.num_tokens % config_.block_size),
                "sequence ", id, " token bookkeeping");
        }
        KVSHARD_CHECK(s.committed_tokens >= 0 && s.committed_tokens <= s.num_tokens, "sequence ",
                      id, " committed ", s.committed_tokens, " of ", s.num_tokens, " tokens");
        KVSHARD_CHECK(config_.deferred_commit || s.committed_tokens == s.num_tokens, "sequence ",
                      id, " has uncommitted tokens without deferred commit");
        const auto committed_full = static_cast<size_t>(s.committed_tokens / config_.block_size);
        for (size_t i = 0; i < s.blocks.size(); ++i) {
            const BlockId b = s.blocks[i];
            KVSHARD_CHECK(b >= 0 && static_cast<size_t>(b) < n, "block id ", b, " out of range");
            ++refs[static_cast<size_t>(b)];
            const Block& m = blocks_[static_cast<size_t>(b)];
            // Only the committed full blocks are computed: a block past them is private to this
            // sequence (shared blocks are registered, hence committed, prefix blocks).
            KVSHARD_CHECK(m.computed == (i < committed_full), "sequence ", id, " block ", i,
                          (m.computed ? " computed" : " not computed"), " with ",
                          s.committed_tokens, " tokens committed");
            if (m.registered) {
                KVSHARD_CHECK(i < s.hashes.size() && s.hashes[i] == m.hash, "sequence ", id,
                              " block ", i, " registered under a hash that is not the sequence's");
            }
        }
        std::vector<BlockId> sorted = s.blocks;
        std::sort(sorted.begin(), sorted.end());
        KVSHARD_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "sequence ",
                      id, " holds a block twice");
    }
    int64_t used = 0, cached = 0, unused = 0, registered = 0;
    size_t heads = 0;
    for (size_t b = 0; b < n; ++b) {
        const Block& m = blocks_[b];
        KVSHARD_CHECK(m.ref == refs[b], "block ", b, " reference count ", m.ref, " but ", refs[b],
                      " sequence references");
        if (m.ref > 0) {
            ++used;
            KVSHARD_CHECK(!m.in_lru, "used block ", b, " in the LRU list");
        } else if (m.registered) {
            ++cached;
            KVSHARD_CHECK(m.in_lru, "cached block ", b, " not in the LRU list");
        } else {
            ++unused;
            KVSHARD_CHECK(!m.in_lru, "free block ", b, " in the LRU list");
        }
        KVSHARD_CHECK(!m.registered || m.computed, "block ", b, " registered but not computed");
        KVSHARD_CHECK(m.ref > 0 || m.registered || !m.computed, "free block ", b,
                      " marked computed");
        if (m.registered) {
            ++registered;
            // Its copies (blocks of the same hash) form a ring through dup_next whose head, the
            // oldest copy, is the one the index names.
            const BlockId head = index_.find(m.hash);
            KVSHARD_CHECK(head >= 0, "block ", b, " registered but its hash is not indexed");
            heads += head == static_cast<BlockId>(b);
            size_t steps = 0;
            bool head_seen = false;
            BlockId c = static_cast<BlockId>(b);
            do {
                const Block& cm = blocks_[static_cast<size_t>(c)];
                KVSHARD_CHECK(cm.registered && cm.hash == m.hash && cm.dup_next >= 0 &&
                                  blocks_[static_cast<size_t>(cm.dup_next)].dup_prev == c,
                              "copy ring of block ", b, " broken at block ", c);
                head_seen = head_seen || c == head;
                c = cm.dup_next;
                KVSHARD_CHECK(++steps <= n, "copy ring of block ", b, " does not close");
            } while (c != static_cast<BlockId>(b));
            KVSHARD_CHECK(head_seen, "block ", b, " is not among the copies the index finds");
        } else {
            KVSHARD_CHECK(m.dup_prev < 0 && m.dup_next < 0, "unregistered block ", b,
                          " linked to copies");
        }
    }
    KVSHARD_CHECK(used == num_used_ && cached == num_cached_ && unused == num_free_,
                  "state counters: used ", num_used_, "/", used, " cached ", num_cached_, "/",
                  cached, " free ", num_free_, "/", unused);
    KVSHARD_CHECK(index_.size() == heads, "index holds ", index_.size(), " hashes but ", heads,
                  " blocks are the copies it names");
    KVSHARD_CHECK(num_registered_ == registered, "registered blocks: counted ", num_registered_,
                  ", found ", registered);
    KVSHARD_CHECK(static_cast<int64_t>(free_list_.size()) == unused, "free list size");
    std::vector<char> seen(n, 0);
    for (const BlockId b : free_list_) {
        KVSHARD_CHECK(b >= 0 && static_cast<size_t>(b) < n && !seen[static_cast<size_t>(b)],
                      "free list entry ", b);
        seen[static_cast<size_t>(b)] = 1;
        KVSHARD_CHECK(block_state(b) == BlockState::kFree, "free list holds non-free block ", b);
    }
    // LRU list: consistent links, exactly the cached blocks; remember positions.
    std::vector<int64_t> pos(n, -1);
    int64_t k = 0;
    BlockId prev = -1;
    for (BlockId b = lru_head_; b >= 0; b = blocks_[static_cast<size_t>(b)].lru_next) {
        KVSHARD_CHECK(k < cached, "LRU list longer than the cached blocks (cycle?)");
        const Block& m = blocks_[static_cast<size_t>(b)];
        KVSHARD_CHECK(m.lru_prev == prev, "LRU back link of block ", b);
        KVSHARD_CHECK(m.ref == 0 && m.registered, "LRU holds non-cached block ", b);
        pos[static_cast<size_t>(b)] = k++;
        prev = b;
    }
    KVSHARD_CHECK(prev == lru_tail_ && k == cached, "LRU list tail / length");
    // Chains: a registered block's parent hash is registered; a cached block is evicted before
    // its parent hash: some copy of it is used, or cached and more recent (a sequence releases
    // its blocks tail first, and a hit takes a parent with every child).
    for (size_t b = 0; b < n; ++b) {
        const Block& m = blocks_[b];
        if (!m.registered || !m.has_parent) continue;
        const BlockId parent = index_.find(m.parent);
        KVSHARD_CHECK(parent >= 0, "block ", b, " is registered but its parent hash is not");
        if (m.ref == 0) {
            bool later = false;
            BlockId p = parent;
            do {
                const Block& pm = blocks_[static_cast<size_t>(p)];
                later = later || pm.ref > 0 || pos[static_cast<size_t>(p)] > pos[b];
                p = pm.dup_next;
            } while (p != parent && !later);
            KVSHARD_CHECK(later, "cached block ", b,
                          " would be evicted after every copy of its parent hash");
        }
    }
    KVSHARD_CHECK(pending_.empty(), "undelivered events outside an operation");
}

}  // namespace kvshard
