#pragma once
// TEMPORARY subset of the cache branch's block_hash.h (replaced by it at merge).
#include <compare>
#include <cstddef>
#include <cstdint>

namespace kvshard {

struct BlockHash {
    uint64_t lo = 0;
    uint64_t hi = 0;
    bool is_zero() const { return lo == 0 && hi == 0; }
    auto operator<=>(const BlockHash&) const = default;
};

struct BlockHashHasher {
    size_t operator()(const BlockHash& h) const noexcept {
        return static_cast<size_t>(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull));
    }
};

}  // namespace kvshard
