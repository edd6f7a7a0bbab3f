#pragma once
// vLLM's prefix-cache block hashes, byte-exact (docs/router.md, "Block hashes compatible with
// vLLM").
//
// vLLM (vllm/v1/core/kv_cache_utils.py: hash_block_tokens) hashes full block i of a request as
//   hash_fn((parent, tuple(token_ids), extra_keys))
// where parent is block i-1's digest (NONE_HASH for block 0), extra_keys is a tuple of strings or
// None, and hash_fn (vllm/utils/hashing.py; --prefix-caching-hash-algo, default "sha256") is one of
//   sha256:       SHA-256 of pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  -> 32 bytes
//   sha256_cbor:  SHA-256 of cbor2.dumps(obj, canonical=True)                     -> 32 bytes
//   xxhash:       XXH3-128 (canonical, big-endian) of the same pickle             -> 16 bytes
//   xxhash_cbor:  XXH3-128 (canonical, big-endian) of the same CBOR               -> 16 bytes
// NONE_HASH (init_none_hash) is hash_fn(PYTHONHASHSEED), the seed taken as a Python str. The
// 64-bit id that KV events carry (maybe_convert_block_hash) is the digest read as a big-endian
// integer, masked to its low 64 bits: its last 8 bytes, big-endian.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvshard {

// The pickle schemes are vLLM's from the revision where hash_fn returns bytes (BlockHash =
// bytes); before it, sha256 returned an int and pickled an int parent, which is not modelled.
// kSha256Cbor64 is vLLM v0.10's sha256_cbor_64bit (PR #20511): the SHA-256 of the same CBOR read
// as a big-endian int and masked to 64 bits, chained as an int (the parent is a CBOR unsigned
// integer); its digest here is those 8 bytes, big-endian. That revision hashed a LoRA request's
// lora_int_id rather than its name: LoRA requests are refused under it.
enum class VllmHashScheme { kSha256Cbor, kXxhashCbor, kSha256Pickle, kXxhashPickle, kSha256Cbor64 };

// "vllm-sha256-cbor" / "vllm-xxhash-cbor" / "vllm-sha256" / "vllm-xxhash" /
// "vllm-sha256-cbor-64bit" (vLLM's name with "vllm-" before it).
std::string_view vllm_hash_scheme_name(VllmHashScheme s);
// Every scheme, in the order above.
const std::vector<VllmHashScheme>& all_vllm_hash_schemes();
// Inverse of vllm_hash_scheme_name; Error naming the accepted names otherwise.
VllmHashScheme parse_vllm_hash_scheme(std::string_view name);
// Digest length in bytes: 32 (SHA-256), 16 (XXH3-128) or 8 (sha256_cbor_64bit).
size_t vllm_digest_size(VllmHashScheme s);

// A digest as vLLM holds it (Python bytes): 1 to 32 bytes, normally 32 or 16.
class VllmBlockHash {
  public:
    static constexpr size_t kMaxSize = 32;
    VllmBlockHash() = default;
    // Error unless 1 <= bytes.size() <= 32.
    explicit VllmBlockHash(std::span<const uint8_t> bytes);
    // Error unless an even number (2 to 64) of hex digits.
    static VllmBlockHash from_hex(std::string_view text);

    std::span<const uint8_t> bytes() const { return {bytes_.data(), size_}; }
    size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }
    std::string hex() const;  // lowercase, bytes in order (= Python bytes.hex())
    // int.from_bytes(digest, "big") & (2**64 - 1): what vLLM's KV events carry by default.
    uint64_t event_id() const;

    bool operator==(const VllmBlockHash& o) const;

  private:
    std::array<uint8_t, kMaxSize> bytes_{};
    uint8_t size_ = 0;
};

// The per-request extra keys vLLM mixes into a block's hash (generate_block_hash_extra_keys):
// the LoRA adapter's name on every block, then the cache salt on the block that starts at token 0
// only. Multimodal and prompt-embedding keys are not modelled. An empty string means "absent"
// (vLLM tests the salt for truthiness; a LoRA request always has a name).
struct VllmExtraKeys {
    std::string lora_name;
    std::string cache_salt;
};

// NONE_HASH for PYTHONHASHSEED = `python_hash_seed` (the environment string, e.g. "0").
VllmBlockHash vllm_none_hash(VllmHashScheme s, std::string_view python_hash_seed);

// The seed vLLM derives NONE_HASH from when PYTHONHASHSEED is unset and the hash is cryptographic
// (DEFAULT_NONE_HASH_SEED, resolve_none_hash_seed in vllm/v1/core/kv_cache_utils.py): independent
// engines on defaults then agree. Earlier revisions drew random bytes whatever the algorithm.
inline constexpr std::string_view kVllmDefaultNoneHashSeed = "vllm-none-hash";

// The string an engine's NONE_HASH comes from. `python_hash_seed` empty: the engine runs without
// PYTHONHASHSEED, so kVllmDefaultNoneHashSeed for the sha256 schemes, and an Error for the xxhash
// ones (vLLM draws a random seed per process for them: no router can reproduce its hashes).
// Otherwise the seed itself, which must be one Python starts with: "random" or a decimal integer
// in [0, 4294967295] (or kVllmDefaultNoneHashSeed, spelled out); Error naming the rule otherwise.
std::string vllm_engine_hash_seed(VllmHashScheme s, std::string_view python_hash_seed);

// The canonical CBOR bytes of (parent, tuple(tokens), extra_keys): an array of 3 items: a byte
// string, an array of integers, and null (no extra keys) or an array of text strings.
std::vector<uint8_t> vllm_block_cbor(std::span<const uint8_t> parent,
                                     std::span<const int32_t> tokens,
                                     std::span<const std::string> extra_keys = {});

// pickle.dumps((parent, tuple(tokens), extra_keys), protocol=5) as CPython writes it: PROTO 5,
// FRAME, SHORT_BINBYTES, BININT1/BININT2/BININT, TUPLE1-3 or MARK ... TUPLE (EMPTY_TUPLE),
// NONE or a tuple of SHORT_BINUNICODE/BINUNICODE, MEMOIZE after each bytes, str and non-empty
// tuple, STOP. Each extra key is taken as its own Python object (pickle would write BINGET for a
// key that is the very same object as one before it; vLLM's LoRA name and salt come from separate
// request fields).
std::vector<uint8_t> vllm_block_pickle(std::span<const uint8_t> parent,
                                       std::span<const int32_t> tokens,
                                       std::span<const std::string> extra_keys = {});

// What scheme `s` hashes for a block: vllm_block_cbor, vllm_block_pickle, or for
// sha256_cbor_64bit the CBOR with the parent (8 bytes, big-endian) as an unsigned integer.
std::vector<uint8_t> vllm_block_encoding(VllmHashScheme s, std::span<const uint8_t> parent,
                                         std::span<const int32_t> tokens,
                                         std::span<const std::string> extra_keys = {});

// hash_fn((parent, tuple(tokens), extra_keys or None)). An empty parent stands for NONE_HASH in
// vLLM; here the caller passes the root explicitly, so an empty parent is an Error.
VllmBlockHash vllm_hash_block(VllmHashScheme s, const VllmBlockHash& parent,
                              std::span<const int32_t> tokens,
                              std::span<const std::string> extra_keys = {});

// The extra keys of the block starting at token `start_token`: (lora_name?, cache_salt if
// start_token == 0?), empty when neither applies (hashed as None).
std::vector<std::string> vllm_block_extra_keys(const VllmExtraKeys& keys, int64_t start_token);

// Reusable hasher: keeps its CBOR / pickle buffer between blocks. Not thread-safe; one per thread.
class VllmBlockHasher {
  public:
    explicit VllmBlockHasher(VllmHashScheme s) : scheme_(s) {}
    VllmHashScheme scheme() const { return scheme_; }
    VllmBlockHash hash(const VllmBlockHash& parent, std::span<const int32_t> tokens,
                       std::span<const std::string> extra_keys = {});
    // The digests of the tokens.size() / block_size full blocks of `tokens` (a trailing partial
    // block is not hashed), chained from `root` (vllm_none_hash(), or a known parent digest).
    // Error unless block_size >= 1, and on a LoRA name under kSha256Cbor64.
    std::vector<VllmBlockHash> hash_blocks(const VllmBlockHash& root,
                                           std::span<const int32_t> tokens, int block_size,
                                           const VllmExtraKeys& keys = {});

  private:
    VllmHashScheme scheme_;
    std::vector<uint8_t> buf_;
};

}  // namespace kvshard
