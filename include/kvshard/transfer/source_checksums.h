#pragma once
// SourceChecksums: checksums of a source pool's KV computed when the KV is written, so that a
// direct-read transfer needs no checksum pass over the source (docs/transfer.md, "Source
// checksums").
//
// A unit is one (local layer, K/V, block, head) of an HND pool over the block's first `tokens`
// slots: page(layer, kv, block) + head * block_size * head_dim elements, tokens * head_dim
// elements, contiguous bytes. Its checksum is XXH3_64 (seed 0) of those bytes. The writer of the
// KV seals each block of a layer after writing it (the bytes are then still in its cache); the
// table remembers, per (layer, block), how many slots were sealed.
//
// A message whose every piece reads whole sealed blocks (slots [0, sealed tokens)) then has a unit
// checksum (pack.h, unit_checksum): XXH3_64 of the array of its units' checksums in the message's
// unit order. The destination computes the same value from the bytes it reads (copy_direct_units).
// A block rewritten without a new seal makes that value differ: the transfer fails cleanly, it
// does not deliver bytes that no longer match their checksum.
#include <cstdint>
#include <span>
#include <vector>

#include "kvshard/cache/block_pool.h"

namespace kvshard {

class SourceChecksums {
  public:
    // The pool must be HND (a head's slots are then contiguous); Error otherwise. The pool must
    // outlive this object.
    explicit SourceChecksums(const BlockPool& pool);

    // Hashes every unit of `block` at local layer `layer` (both K and V, every head) over its
    // first `tokens` slots (1..block_size), and records that count.
    void seal(int layer, int32_t block, int tokens);
    // seal() for each block of a sequence of num_tokens tokens stored in block_table order (token
    // j in block block_table[j / block_size]).
    void seal_sequence(int layer, std::span<const int32_t> block_table, int64_t num_tokens);
    // Forgets the seals of `block` at every layer (the block is freed or rewritten).
    void forget(int32_t block);

    // Slots sealed for (layer, block); 0 when not sealed.
    int sealed_tokens(int layer, int32_t block) const {
        return tokens_[static_cast<size_t>(int64_t{layer} * num_blocks_ + block)];
    }
    // The checksum of unit (layer, kv, block, head); meaningful when sealed_tokens() > 0.
    uint64_t unit(int layer, int kv, int32_t block, int head) const {
        return units_[static_cast<size_t>(index(layer, kv, block, head))];
    }
    const BlockPool& pool() const { return *pool_; }

  private:
    int64_t index(int layer, int kv, int32_t block, int head) const {
        return ((int64_t{layer} * kv_factor_ + kv) * num_blocks_ + block) * num_heads_ + head;
    }
    const BlockPool* pool_;
    int64_t num_blocks_;
    int kv_factor_, num_heads_, num_layers_;
    std::vector<uint64_t> units_;
    std::vector<int32_t> tokens_;  // per (layer, block)
};

}  // namespace kvshard
