#pragma once
// BlockHashMap<V>: an open-addressing hash map from BlockHash to a small value, for the router's
// index (kv_index.h) and the event ingest's store order (vllm_event_ingest.h). A std::unordered_map
// allocates one node per key; these maps take millions of inserts and removals a minute from the
// engines' KV events, so the keys and values live in one flat array instead: linear probing at a
// load of at most 0.7, removal by backward shift (no tombstones, probe runs stay short), the
// occupied flag inside the slot (one cache line per probe). A table larger than the caches costs
// a memory access per key: callers with several keys at hand prefetch() them all first, so the
// misses overlap.
// Invalidation: any insert or erase may move entries; pointers from find() are good until then.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvshard/cache/block_hash.h"

namespace kvshard {

template <typename V>
class BlockHashMap {
  public:
    size_t size() const { return size_; }
    // Entries it holds before the next insert grows (and rehashes) the table.
    size_t capacity() const { return slots_.size() * 7 / 10; }
    bool empty() const { return size_ == 0; }

    // Starts loading the slot where `key` would be (no effect on the contents).
    void prefetch(const BlockHash& key) const {
        if (!slots_.empty()) __builtin_prefetch(&slots_[home(key)]);
    }

    // The value of `key`, nullptr when absent.
    V* find(const BlockHash& key) {
        if (size_ == 0) return nullptr;
        for (size_t i = home(key);; i = (i + 1) & mask_) {
            if (!slots_[i].used) return nullptr;
            if (slots_[i].key == key) return &slots_[i].value;
        }
    }
    const V* find(const BlockHash& key) const { return const_cast<BlockHashMap*>(this)->find(key); }

    // The value of `key`, inserted as V{} when absent.
    V& operator[](const BlockHash& key) {
        if ((size_ + 1) * 10 > slots_.size() * 7) grow();
        size_t i = home(key);
        for (; slots_[i].used; i = (i + 1) & mask_)
            if (slots_[i].key == key) return slots_[i].value;
        slots_[i] = Slot{key, V{}, 1};
        ++size_;
        return slots_[i].value;
    }

    // True when `key` was there.
    bool erase(const BlockHash& key) {
        if (size_ == 0) return false;
        size_t i = home(key);
        for (;; i = (i + 1) & mask_) {
            if (!slots_[i].used) return false;
            if (slots_[i].key == key) break;
        }
        // Backward shift: move each later entry of the run into the hole unless its home lies
        // cyclically in (hole, its position], where it must stay.
        size_t hole = i;
        for (size_t j = (i + 1) & mask_; slots_[j].used; j = (j + 1) & mask_) {
            const size_t h = home(slots_[j].key);
            const bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
            if (stays) continue;
            slots_[hole] = slots_[j];
            hole = j;
        }
        slots_[hole].used = 0;
        --size_;
        return true;
    }

    // Calls keep(key, value&) on every entry; drops those for which it returns false.
    template <typename Fn>
    void rewrite(Fn keep) {
        std::vector<Slot> old;
        old.swap(slots_);
        size_ = 0;
        mask_ = 0;
        std::vector<Slot> kept;
        for (auto& s : old)
            if (s.used && keep(s.key, s.value)) kept.push_back(s);
        for (const Slot& s : kept) (*this)[s.key] = s.value;
    }

    void clear() {
        slots_.clear();
        size_ = 0;
        mask_ = 0;
    }

  private:
    struct Slot {
        BlockHash key;
        V value;
        uint8_t used = 0;  // 1: the slot holds an entry
    };

    size_t home(const BlockHash& key) const {
        // Fibonacci hashing of BlockHashHasher's word: its top bits pick the slot.
        const uint64_t x = static_cast<uint64_t>(BlockHashHasher{}(key)) * 0x9E3779B97F4A7C15ull;
        return static_cast<size_t>(x >> shift_) & mask_;
    }

    void grow() {
        const size_t cap = slots_.empty() ? 16 : 2 * slots_.size();
        std::vector<Slot> old(cap);
        old.swap(slots_);
        mask_ = cap - 1;
        shift_ = 64;
        for (size_t c = cap; c > 1; c >>= 1) --shift_;
        size_ = 0;
        for (const auto& s : old)
            if (s.used) (*this)[s.key] = s.value;
    }

    std::vector<Slot> slots_;
    size_t size_ = 0;
    size_t mask_ = 0;  // slots_.size() - 1 (a power of two), 0 when empty
    int shift_ = 64;   // 64 - log2(slots_.size())
};

}  // namespace kvshard
