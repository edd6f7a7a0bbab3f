#pragma once
// The LRU list of free and cached blocks that BlockManager and KvGroupManager keep (one per
// pool): intrusive, doubly linked through the block records' lru_prev / lru_next, in_lru marking
// membership; head = least recently used (evicted first), tail = most recently freed.
#include <cstddef>

#include "kvshard/cache/block_manager.h"
#include "kvshard/common/error.h"

namespace kvshard::detail {

// Appends block b (not in the list) at the tail.
template <typename Blocks>
void lru_link_back(Blocks& blocks, BlockId& head, BlockId& tail, BlockId b) {
    auto& m = blocks[static_cast<size_t>(b)];
    KVSHARD_CHECK(!m.in_lru, "block ", b, " already in the LRU list");
    m.in_lru = true;
    m.lru_prev = tail;
    m.lru_next = -1;
    if (tail >= 0)
        blocks[static_cast<size_t>(tail)].lru_next = b;
    else
        head = b;
    tail = b;
}

// Takes block b (in the list) out of it.
template <typename Blocks>
void lru_unlink(Blocks& blocks, BlockId& head, BlockId& tail, BlockId b) {
    auto& m = blocks[static_cast<size_t>(b)];
    KVSHARD_CHECK(m.in_lru, "block ", b, " not in the LRU list");
    if (m.lru_prev >= 0)
        blocks[static_cast<size_t>(m.lru_prev)].lru_next = m.lru_next;
    else
        head = m.lru_next;
    if (m.lru_next >= 0)
        blocks[static_cast<size_t>(m.lru_next)].lru_prev = m.lru_prev;
    else
        tail = m.lru_prev;
    m.lru_prev = m.lru_next = -1;
    m.in_lru = false;
}

}  // namespace kvshard::detail
