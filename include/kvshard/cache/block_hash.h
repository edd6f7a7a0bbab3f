#pragma once
// Prefix-cache block hashes: 128-bit XXH3 chained over full blocks (docs/cache.md, "Block hashes").
//
// The hash of full block i of a sequence is XXH3_128bits (seed 0, default secret) over the bytes
//   parent (16 bytes) || token ids (block_size x int32, little-endian) || extra keys (opaque bytes)
// where parent is the hash of block i-1 (all zero for block 0), written as the 128-bit value in
// little-endian order: low64 as 8 LE bytes, then high64 as 8 LE bytes (Python:
// int.to_bytes(16, "little") of the xxh3_128 intdigest). Extra keys are the same for every block of
// a sequence; encode_extra_keys() gives their canonical form, empty when there is no salt or
// adapter.
#include <compare>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvshard {

struct BlockHash {
    uint64_t lo = 0;  // XXH128_hash_t::low64
    uint64_t hi = 0;  // XXH128_hash_t::high64

    bool is_zero() const { return lo == 0 && hi == 0; }
    auto operator<=>(const BlockHash&) const = default;
    // 32 lowercase hex digits, high64 first: XXH128's canonical form, = Python
    // xxh3_128_hexdigest().
    std::string hex() const;
    // Inverse of hex(); throws Error unless given exactly 32 hex digits.
    static BlockHash from_hex(std::string_view text);
};

// For unordered containers. The hash is already uniform, so its low bits are a fine bucket index.
struct BlockHashHasher {
    size_t operator()(const BlockHash& h) const noexcept {
        return static_cast<size_t>(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull));
    }
};

// The parent of the first block of every sequence.
inline constexpr BlockHash kRootParentHash{};

// Canonical bytes of a sequence's extra keys. Empty when both are empty; otherwise, for each
// non-empty key in this order: a tag byte (1 = cache salt, 2 = adapter id), its byte length as
// uint32 little-endian, then its bytes.
std::vector<std::byte> encode_extra_keys(std::string_view cache_salt, std::string_view adapter_id);

// Hashes one full block (tokens.size() tokens) under `parent`. Allocation-free.
BlockHash hash_block(const BlockHash& parent, std::span<const int32_t> tokens,
                     std::span<const std::byte> extra_keys = {});

// Reusable hasher: keeps a scratch buffer so hashing a chain allocates nothing after warm-up.
// Not thread-safe; one per thread.
class BlockHasher {
  public:
    BlockHasher();
    ~BlockHasher();
    BlockHasher(BlockHasher&&) noexcept;
    BlockHasher& operator=(BlockHasher&&) noexcept;

    BlockHash hash(const BlockHash& parent, std::span<const int32_t> tokens,
                   std::span<const std::byte> extra_keys = {});
    // Appends to `out` the hashes of the tokens.size() / block_size full blocks of `tokens`,
    // chained from `parent`; a trailing partial block is not hashed.
    void hash_blocks(const BlockHash& parent, std::span<const int32_t> tokens, int block_size,
                     std::span<const std::byte> extra_keys, std::vector<BlockHash>& out);
    std::vector<BlockHash> hash_blocks(std::span<const int32_t> tokens, int block_size,
                                       std::span<const std::byte> extra_keys = {});

  private:
    struct Stream;  // XXH3 streaming state for large blocks
    std::vector<std::byte> buf_;
    std::unique_ptr<Stream> stream_;
};

// Convenience: the chained hashes of the full blocks of `tokens`.
std::vector<BlockHash> hash_token_blocks(std::span<const int32_t> tokens, int block_size,
                                         std::span<const std::byte> extra_keys = {});

// The canonical byte encoding of one block (what the hash is computed over), for other
// implementations and for tests.
std::vector<std::byte> encode_block(const BlockHash& parent, std::span<const int32_t> tokens,
                                    std::span<const std::byte> extra_keys = {});

// The most leading blocks of a prompt of num_tokens that vLLM takes from its prefix cache: it caps
// a hit at num_tokens - 1 tokens, so that the last prompt token is computed and gives logits
// (vllm/v1/core/kv_cache_manager.py, KVCacheManager.get_computed_blocks: max_cache_hit_length =
// request.num_tokens - 1; each group's find_longest_cache_hit in single_type_kv_cache_manager.py
// then looks at max_length // block_size blocks). A prompt of exactly k full blocks, all cached,
// hits k - 1 of them and recomputes the last. With groups of s-times-larger blocks the cap in
// their blocks is floor((num_tokens - 1) / (s * block_tokens)), which is this cap divided by s
// (rounded down), so capping the hashes a route walks (in block_tokens blocks) caps every group,
// and KvIndex's LCM alignment then rounds the capped k down as vLLM's alignment_tokens does.
// 0 when num_tokens <= 1. Error when block_tokens < 1.
int64_t vllm_max_cache_hit_blocks(int64_t num_tokens, int64_t block_tokens);

}  // namespace kvshard
