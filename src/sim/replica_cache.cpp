#include "sim/replica_cache.h"

#include "kvshard/common/error.h"

namespace kvshard::sim_detail {

ReplicaCache::ReplicaCache(int64_t capacity_blocks, int block_tokens)
    : capacity_(capacity_blocks), block_tokens_(block_tokens) {}

int64_t ReplicaCache::used_blocks() const { return used_hashed_ + unhashed_; }

std::optional<int64_t> ReplicaCache::admit(int64_t seq, std::span<const BlockHash> full_hashes,
                                           int64_t prompt_tokens, int64_t output_tokens) {
    const int64_t total = (prompt_tokens + output_tokens + block_tokens_ - 1) / block_tokens_;
    size_t hit = 0;
    while (hit < full_hashes.size() && entries_.count(full_hashes[hit])) ++hit;
    int64_t reclaimed = 0;  // cached blocks the hit takes off the LRU
    for (size_t i = 0; i < hit; ++i)
        if (entries_[full_hashes[i]].ref == 0) ++reclaimed;
    const int64_t need = total - static_cast<int64_t>(hit);
    const int64_t cached = static_cast<int64_t>(lru_.size()) - reclaimed;
    if (need > capacity_ - used_blocks() - reclaimed) return std::nullopt;
    Seq s;
    for (size_t i = 0; i < hit; ++i) {
        Entry& e = entries_[full_hashes[i]];
        if (e.ref++ == 0) {
            lru_.erase(e.lru);
            ++used_hashed_;
        }
        s.hashes.push_back(full_hashes[i]);
    }
    // Free blocks now: capacity - used - cached; evict LRU heads until `need` fit.
    int64_t free_now = capacity_ - used_blocks() - static_cast<int64_t>(lru_.size());
    std::vector<BlockHash> removed;
    while (free_now < need) {
        KVSHARD_CHECK(!lru_.empty(), "admission checked the space");
        removed.push_back(lru_.front());
        entries_.erase(lru_.front());
        lru_.pop_front();
        ++evictions_;
        ++free_now;
    }
    (void)cached;
    if (index_ && !removed.empty()) index_->block_removed(replica_, removed);
    std::vector<BlockHash> stored;
    for (size_t i = hit; i < full_hashes.size(); ++i) {
        entries_[full_hashes[i]].ref = 1;
        ++used_hashed_;
        s.hashes.push_back(full_hashes[i]);
        stored.push_back(full_hashes[i]);
    }
    s.unhashed = total - static_cast<int64_t>(full_hashes.size());
    unhashed_ += s.unhashed;
    if (index_ && !stored.empty()) index_->block_stored(replica_, stored);
    KVSHARD_CHECK(seqs_.emplace(seq, std::move(s)).second, "sequence ", seq, " admitted twice");
    return static_cast<int64_t>(hit);
}

void ReplicaCache::release(int64_t seq) {
    auto it = seqs_.find(seq);
    KVSHARD_CHECK(it != seqs_.end(), "release of unknown sequence ", seq);
    // Tail first: a chain's tail becomes least recently used before its head.
    for (auto h = it->second.hashes.rbegin(); h != it->second.hashes.rend(); ++h) {
        Entry& e = entries_[*h];
        if (--e.ref == 0) {
            e.lru = lru_.insert(lru_.end(), *h);
            --used_hashed_;
        }
    }
    unhashed_ -= it->second.unhashed;
    seqs_.erase(it);
}

}  // namespace kvshard::sim_detail
