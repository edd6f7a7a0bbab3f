// BlockHashMap against std::unordered_map under random inserts, erases and rewrites, with few
// distinct keys (long probe runs, wrap-around, backward shifts) and with many.
#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

#include "kvshard/router/block_hash_map.h"

namespace kvshard {
namespace {

void check_equal(const BlockHashMap<uint64_t>& m,
                 const std::unordered_map<BlockHash, uint64_t, BlockHashHasher>& ref,
                 uint64_t key_range, int step) {
    ASSERT_EQ(m.size(), ref.size()) << "step " << step;
    for (uint64_t k = 0; k < key_range; ++k) {
        const BlockHash key{k * 7919, k % 3};
        const uint64_t* v = m.find(key);
        const auto it = ref.find(key);
        ASSERT_EQ(v != nullptr, it != ref.end()) << "step " << step << " key " << k;
        if (v) {
            ASSERT_EQ(*v, it->second) << "step " << step << " key " << k;
        }
    }
}

TEST(BlockHashMap, MatchesUnorderedMapUnderRandomOperations) {
    for (uint64_t key_range : {5ull, 40ull, 3000ull}) {
        SCOPED_TRACE("key range " + std::to_string(key_range));
        std::mt19937_64 rng(key_range);
        BlockHashMap<uint64_t> m;
        std::unordered_map<BlockHash, uint64_t, BlockHashHasher> ref;
        for (int step = 0; step < 20000; ++step) {
            const uint64_t k = rng() % key_range;
            const BlockHash key{k * 7919, k % 3};
            const auto op = rng() % 10;
            if (op < 5) {
                const uint64_t v = rng();
                m[key] = v;
                ref[key] = v;
            } else if (op < 9) {
                ASSERT_EQ(m.erase(key), ref.erase(key) == 1) << "step " << step;
            } else if (rng() % 50 == 0) {
                const uint64_t bit = rng() % 2;
                m.rewrite([bit](const BlockHash&, uint64_t& v) {
                    v ^= bit;
                    return v % 4 != 0;
                });
                for (auto it = ref.begin(); it != ref.end();) {
                    it->second ^= bit;
                    it = it->second % 4 != 0 ? std::next(it) : ref.erase(it);
                }
            }
            if (step % 97 == 0 || key_range <= 40) check_equal(m, ref, key_range, step);
        }
        check_equal(m, ref, key_range, -1);
        m.clear();
        EXPECT_TRUE(m.empty());
        EXPECT_EQ(m.find(BlockHash{0, 0}), nullptr);
    }
}

}  // namespace
}  // namespace kvshard
