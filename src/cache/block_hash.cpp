#include "kvshard/cache/block_hash.h"

// Inline XXH3 so that hashing a fixed-size block compiles to straight-line code (no length
// dispatch, constant-size copies). bench_cache's raw baseline uses the same inline build.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <bit>
#include <cstring>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

// Encoded blocks up to this size are copied into one buffer and hashed with the one-shot XXH3
// (the copy is cheap next to XXH3's setup); larger ones go through XXH3's streaming state, which
// reads the token ids in place and copies only the first and last partial stripes.
constexpr size_t kOneShotLimit = 1024;

void put_u64_le(std::byte* dst, uint64_t v) {
    if constexpr (std::endian::native == std::endian::little) {
        std::memcpy(dst, &v, 8);
    } else {
        for (int i = 0; i < 8; ++i) dst[i] = static_cast<std::byte>(v >> (8 * i));
    }
}

void put_parent(std::byte* dst, const BlockHash& parent) {
    put_u64_le(dst, parent.lo);
    put_u64_le(dst + 8, parent.hi);
}

void put_tokens(std::byte* dst, std::span<const int32_t> tokens) {
    if constexpr (std::endian::native == std::endian::little) {
        std::memcpy(dst, tokens.data(), tokens.size_bytes());
    } else {
        for (size_t i = 0; i < tokens.size(); ++i) {
            const auto v = static_cast<uint32_t>(tokens[i]);
            for (int b = 0; b < 4; ++b) dst[4 * i + b] = static_cast<std::byte>(v >> (8 * b));
        }
    }
}

BlockHash to_block_hash(XXH128_hash_t h) { return BlockHash{h.low64, h.high64}; }

size_t encoded_size(std::span<const int32_t> tokens, std::span<const std::byte> extra) {
    return 16 + tokens.size_bytes() + extra.size();
}

// XXH3-128 of parent (16 bytes) || token bytes (T = tokens_len bytes) for inputs over 240 bytes,
// without copying the tokens. XXH3's long-input loop reads 64-byte stripes at offsets 0, 64, 128...
// plus a last stripe ending at the input's end; only stripe 0 straddles the two pieces, so it is
// built in a 64-byte buffer and every other stripe is read in place from the tokens. This is
// XXH3_hashLong_128b_internal of xxHash 0.8.1 with a two-piece input (same secret, same
// accumulate/scramble/merge steps); tests check it against XXH3_128bits over the concatenation.
#if XXH_VERSION_NUMBER == 801 && defined(XXH_INLINE_ALL)
#define KVSHARD_XXH3_TWO_PIECE 1
constexpr size_t kTwoPieceMin = XXH3_MIDSIZE_MAX + 1;  // 241 bytes: XXH3's long-input path

BlockHash xxh3_128_two_piece(const BlockHash& parent, const std::byte* tokens, size_t tokens_len) {
    const size_t len = 16 + tokens_len;
    alignas(64) std::byte stripe0[XXH_STRIPE_LEN];
    put_parent(stripe0, parent);
    std::memcpy(stripe0 + 16, tokens, XXH_STRIPE_LEN - 16);
    const auto* tok = reinterpret_cast<const xxh_u8*>(tokens);
    auto at = [&](size_t offset) -> const xxh_u8* {
        return offset == 0 ? reinterpret_cast<const xxh_u8*>(stripe0) : tok + offset - 16;
    };
    const xxh_u8* secret = XXH3_kSecret;
    constexpr size_t kSecretSize = sizeof(XXH3_kSecret);
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    constexpr size_t kStripesPerBlock = (kSecretSize - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    constexpr size_t kBlockLen = XXH_STRIPE_LEN * kStripesPerBlock;
    const size_t nb_blocks = (len - 1) / kBlockLen;
    for (size_t n = 0; n < nb_blocks; ++n) {
        for (size_t st = 0; st < kStripesPerBlock; ++st)
            XXH3_accumulate_512(acc, at(n * kBlockLen + st * XXH_STRIPE_LEN),
                                secret + st * XXH_SECRET_CONSUME_RATE);
        XXH3_scrambleAcc(acc, secret + kSecretSize - XXH_STRIPE_LEN);
    }
    const size_t nb_stripes = ((len - 1) - kBlockLen * nb_blocks) / XXH_STRIPE_LEN;
    for (size_t st = 0; st < nb_stripes; ++st)
        XXH3_accumulate_512(acc, at(nb_blocks * kBlockLen + st * XXH_STRIPE_LEN),
                            secret + st * XXH_SECRET_CONSUME_RATE);
    XXH3_accumulate_512(acc, tok + tokens_len - XXH_STRIPE_LEN,
                        secret + kSecretSize - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    BlockHash h;
    h.lo = XXH3_mergeAccs(acc, secret + XXH_SECRET_MERGEACCS_START,
                          static_cast<xxh_u64>(len) * XXH_PRIME64_1);
    h.hi = XXH3_mergeAccs(acc, secret + kSecretSize - sizeof(acc) - XXH_SECRET_MERGEACCS_START,
                          ~(static_cast<xxh_u64>(len) * XXH_PRIME64_2));
    return h;
}
#endif

int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

}  // namespace

std::string BlockHash::hex() const {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string s(32, '0');
    for (int i = 0; i < 16; ++i) {
        s[15 - i] = kDigits[(hi >> (4 * i)) & 0xf];
        s[31 - i] = kDigits[(lo >> (4 * i)) & 0xf];
    }
    return s;
}

BlockHash BlockHash::from_hex(std::string_view text) {
    require(text.size() == 32, "a block hash is 32 hex digits (high 64 bits first), got '", text,
            "' (", text.size(), " characters)");
    BlockHash h;
    for (int i = 0; i < 32; ++i) {
        const int d = hex_digit(text[i]);
        require(d >= 0, "a block hash is 32 hex digits, got '", text, "' (bad character '", text[i],
                "')");
        uint64_t& word = i < 16 ? h.hi : h.lo;
        word = (word << 4) | static_cast<uint64_t>(d);
    }
    return h;
}

std::vector<std::byte> encode_extra_keys(std::string_view cache_salt, std::string_view adapter_id) {
    std::vector<std::byte> out;
    auto put = [&out](uint8_t tag, std::string_view key) {
        if (key.empty()) return;
        require(key.size() <= UINT32_MAX, "an extra key is at most 4 GiB long");
        out.push_back(static_cast<std::byte>(tag));
        const auto n = static_cast<uint32_t>(key.size());
        for (int b = 0; b < 4; ++b) out.push_back(static_cast<std::byte>(n >> (8 * b)));
        for (char c : key) out.push_back(static_cast<std::byte>(c));
    };
    put(1, cache_salt);
    put(2, adapter_id);
    return out;
}

std::vector<std::byte> encode_block(const BlockHash& parent, std::span<const int32_t> tokens,
                                    std::span<const std::byte> extra_keys) {
    std::vector<std::byte> out(encoded_size(tokens, extra_keys));
    put_parent(out.data(), parent);
    put_tokens(out.data() + 16, tokens);
    if (!extra_keys.empty())
        std::memcpy(out.data() + 16 + tokens.size_bytes(), extra_keys.data(), extra_keys.size());
    return out;
}

BlockHash hash_block(const BlockHash& parent, std::span<const int32_t> tokens,
                     std::span<const std::byte> extra_keys) {
    const size_t n = encoded_size(tokens, extra_keys);
#ifdef KVSHARD_XXH3_TWO_PIECE
    if (extra_keys.empty() && n >= kTwoPieceMin && std::endian::native == std::endian::little)
        return xxh3_128_two_piece(parent, reinterpret_cast<const std::byte*>(tokens.data()),
                                  tokens.size_bytes());
#endif
    if (n <= kOneShotLimit) {
        alignas(64) std::byte buf[kOneShotLimit];
        put_parent(buf, parent);
        put_tokens(buf + 16, tokens);
        if (!extra_keys.empty())
            std::memcpy(buf + 16 + tokens.size_bytes(), extra_keys.data(), extra_keys.size());
        return to_block_hash(XXH3_128bits(buf, n));
    }
    BlockHasher h;
    return h.hash(parent, tokens, extra_keys);
}

struct BlockHasher::Stream {
    XXH3_state_t* state = XXH3_createState();
    Stream() { KVSHARD_CHECK(state != nullptr, "XXH3_createState failed"); }
    ~Stream() { XXH3_freeState(state); }
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
};

BlockHasher::BlockHasher() = default;
BlockHasher::~BlockHasher() = default;
BlockHasher::BlockHasher(BlockHasher&&) noexcept = default;
BlockHasher& BlockHasher::operator=(BlockHasher&&) noexcept = default;

BlockHash BlockHasher::hash(const BlockHash& parent, std::span<const int32_t> tokens,
                            std::span<const std::byte> extra_keys) {
    const size_t n = encoded_size(tokens, extra_keys);
#ifdef KVSHARD_XXH3_TWO_PIECE
    if (extra_keys.empty() && n >= kTwoPieceMin && std::endian::native == std::endian::little)
        return xxh3_128_two_piece(parent, reinterpret_cast<const std::byte*>(tokens.data()),
                                  tokens.size_bytes());
#endif
    if (n <= kOneShotLimit || std::endian::native != std::endian::little) {
        if (buf_.size() < n) buf_.resize(n);
        std::byte* b = buf_.data();
        put_parent(b, parent);
        put_tokens(b + 16, tokens);
        if (!extra_keys.empty())
            std::memcpy(b + 16 + tokens.size_bytes(), extra_keys.data(), extra_keys.size());
        return to_block_hash(XXH3_128bits(b, n));
    }
    if (!stream_) stream_ = std::make_unique<Stream>();
    std::byte head[16];
    put_parent(head, parent);
    XXH3_128bits_reset(stream_->state);
    XXH3_128bits_update(stream_->state, head, 16);
    XXH3_128bits_update(stream_->state, tokens.data(), tokens.size_bytes());
    if (!extra_keys.empty())
        XXH3_128bits_update(stream_->state, extra_keys.data(), extra_keys.size());
    return to_block_hash(XXH3_128bits_digest(stream_->state));
}

namespace {

// Chained hashing of n full blocks of kTokens tokens without extra keys (the common case): one
// stack buffer, the parent rewritten in front of each block's ids, all sizes known at compile time.
template <size_t kTokens>
void chain_fixed(BlockHash h, const int32_t* tokens, size_t n, BlockHash* out) {
    constexpr size_t kBytes = 16 + 4 * kTokens;
#ifdef KVSHARD_XXH3_TWO_PIECE
    if constexpr (kBytes >= kTwoPieceMin) {
        for (size_t i = 0; i < n; ++i) {
            h = xxh3_128_two_piece(h, reinterpret_cast<const std::byte*>(tokens + i * kTokens),
                                   4 * kTokens);
            out[i] = h;
        }
        return;
    }
#endif
    alignas(64) std::byte buf[kBytes];
    for (size_t i = 0; i < n; ++i) {
        put_parent(buf, h);
        std::memcpy(buf + 16, tokens + i * kTokens, 4 * kTokens);
        h = to_block_hash(XXH3_128bits(buf, kBytes));
        out[i] = h;
    }
}

}  // namespace

void BlockHasher::hash_blocks(const BlockHash& parent, std::span<const int32_t> tokens,
                              int block_size, std::span<const std::byte> extra_keys,
                              std::vector<BlockHash>& out) {
    require(block_size >= 1, "block size must be at least 1 token, got ", block_size);
    const size_t bs = static_cast<size_t>(block_size);
    const size_t full = tokens.size() / bs;
    if (extra_keys.empty() && std::endian::native == std::endian::little) {
        const size_t old = out.size();
        void (*fixed)(BlockHash, const int32_t*, size_t, BlockHash*) = nullptr;
        switch (block_size) {
            case 16:
                fixed = chain_fixed<16>;
                break;
            case 32:
                fixed = chain_fixed<32>;
                break;
            case 64:
                fixed = chain_fixed<64>;
                break;
            case 128:
                fixed = chain_fixed<128>;
                break;
            case 256:
                fixed = chain_fixed<256>;
                break;
            case 512:
                fixed = chain_fixed<512>;
                break;
            default:
                break;
        }
        if (fixed) {
            out.resize(old + full);
            fixed(parent, tokens.data(), full, out.data() + old);
            return;
        }
    }
    out.reserve(out.size() + full);
    BlockHash h = parent;
    for (size_t i = 0; i < full; ++i) {
        h = hash(h, tokens.subspan(i * bs, bs), extra_keys);
        out.push_back(h);
    }
}

std::vector<BlockHash> BlockHasher::hash_blocks(std::span<const int32_t> tokens, int block_size,
                                                std::span<const std::byte> extra_keys) {
    std::vector<BlockHash> out;
    hash_blocks(kRootParentHash, tokens, block_size, extra_keys, out);
    return out;
}

std::vector<BlockHash> hash_token_blocks(std::span<const int32_t> tokens, int block_size,
                                         std::span<const std::byte> extra_keys) {
    BlockHasher h;
    return h.hash_blocks(tokens, block_size, extra_keys);
}

int64_t vllm_max_cache_hit_blocks(int64_t num_tokens, int64_t block_tokens) {
    require(block_tokens >= 1, "a block holds at least 1 token, got ", block_tokens);
    return num_tokens <= 1 ? 0 : (num_tokens - 1) / block_tokens;
}

}  // namespace kvshard
