// The seed's examples (kv-under-parallel-partitioning.md §2 and §6).
#include <gtest/gtest.h>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

ParallelConfig tp(int t) {
    ParallelConfig p;
    p.tp = t;
    return p;
}

TEST(LayoutSeed, Tp8WithGqa8GivesOneKvHeadPerGpu) {
    const auto l = make_layout(catalog_model("llama-3.1-70b"), tp(8));
    ASSERT_EQ(l.world_size(), 8);
    for (int r = 0; r < 8; ++r) {
        EXPECT_EQ(l.ranks[r].kv_heads, std::vector<int>{r});
        EXPECT_TRUE(l.ranks[r].head_replica_ranks.empty());
        // 80 layers * 2 (K,V) * 1 head * 128 * 2 bytes
        EXPECT_EQ(l.ranks[r].kv_bytes_per_token, 80 * 2 * 1 * 128 * 2);
    }
}

TEST(LayoutSeed, Tp4WithMha64GivesSixteenKvHeadsPerGpu) {
    const auto l = make_layout(catalog_model("llama-65b"), tp(4));
    for (int r = 0; r < 4; ++r) {
        ASSERT_EQ(l.ranks[r].num_kv_heads(), 16);
        EXPECT_EQ(l.ranks[r].kv_heads.front(), 16 * r);
        EXPECT_EQ(l.ranks[r].kv_heads.back(), 16 * r + 15);
        EXPECT_EQ(l.ranks[r].kv_bytes_per_token, int64_t{80} * 2 * 16 * 128 * 2);
    }
}

TEST(LayoutSeed, Gqa8WithTp16PutsEachHeadOnTwoGpus) {
    const auto l = make_layout(catalog_model("llama-3.1-70b"), tp(16));
    EXPECT_EQ(l.head_replication(), 2);
    for (int r = 0; r < 16; ++r) {
        EXPECT_EQ(l.ranks[r].kv_heads, std::vector<int>{r / 2});
        EXPECT_EQ(l.ranks[r].head_replica_ranks, std::vector<int>{r ^ 1});
    }
}

TEST(LayoutSeed, Tp3AndTp12WithGqa8AreClearErrors) {
    const auto m = catalog_model("llama-3.1-70b");
    for (int t : {3, 12}) {
        try {
            make_layout(m, tp(t));
            FAIL() << "tp=" << t << " should be rejected";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("valid tp sizes are 1, 2, 4, 8, 16, 32, 64"),
                      std::string::npos)
                << e.what();
        }
    }
}

}  // namespace
}  // namespace kvshard
