// kvshard::xxh3_64 and Xxh3Stream give libxxhash's XXH3_64bits values, on whichever build the CPU
// picked (AVX2 or baseline) and on the baseline build.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <random>
#include <vector>

#include "kvshard/common/xxh3.h"

namespace kvshard {
namespace {

std::vector<unsigned char> random_bytes(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<unsigned char> v(n);
    for (auto& b : v) b = static_cast<unsigned char>(rng());
    return v;
}

TEST(Xxh3, EqualsLibxxhashAtEveryLengthClass) {
    // XXH3 has separate code for 0, 1-3, 4-8, 9-16, 17-128, 129-240 and longer inputs, and its
    // vector loop works on 1 KiB stripes: lengths across all of them, and an odd offset.
    std::vector<size_t> lengths;
    for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
    for (size_t n : {1023u, 1024u, 1025u, 4096u, 65537u, 1u << 20}) lengths.push_back(n);
    const auto buf = random_bytes((1u << 20) + 8, 7);
    for (size_t n : lengths) {
        const unsigned char* p = buf.data() + 3;
        const uint64_t want = XXH3_64bits(p, n);
        EXPECT_EQ(xxh3_64(p, n), want) << n << " bytes (avx2: " << detail::xxh3_uses_avx2() << ")";
        EXPECT_EQ(detail::xxh3_64_baseline(p, n), want) << n << " bytes";
    }
}

TEST(Xxh3, StreamOverRandomPiecesEqualsOneShot) {
    const auto buf = random_bytes(300000, 11);
    std::mt19937_64 rng(5);
    for (int trial = 0; trial < 20; ++trial) {
        Xxh3Stream s;
        size_t off = 0;
        while (off < buf.size()) {
            const size_t piece = std::min<size_t>(buf.size() - off, rng() % 9000);
            s.update(buf.data() + off, piece);
            off += piece;
        }
        EXPECT_EQ(s.digest(), XXH3_64bits(buf.data(), buf.size())) << "trial " << trial;
    }
    EXPECT_EQ(Xxh3Stream().digest(), XXH3_64bits(nullptr, 0));
}

}  // namespace
}  // namespace kvshard
