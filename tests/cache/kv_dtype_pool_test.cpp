// Pools of each KV dtype: their bytes (elements at the dtype's size, fp8 scales per block and head)
// against the layout's prediction, the stored codes against the converters, and fp8's scale rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/common/dtype.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

PageGeometry geometry(DType t, int heads = 2, PageOrder order = PageOrder::kHnd) {
    PageGeometry g;
    g.num_layers = 3;
    g.num_heads = heads;
    g.block_size = 4;
    g.head_dim = 8;
    g.dtype = t;
    g.order = order;
    return g;
}

TEST(KvDtypePool, BytesPerDtype) {
    for (const DType t : {DType::kFp32, DType::kBf16, DType::kFp16, DType::kFp8}) {
        const PageGeometry g = geometry(t);
        const BlockPool pool(g, 5);
        const int64_t elems = int64_t{3} * 2 * 2 * 4 * 8;  // layers * K/V * heads * slots * dim
        const int64_t scales = t == DType::kFp8 ? int64_t{3} * 2 * 2 : 0;
        EXPECT_EQ(g.block_bytes(), elems * int64_t(dtype_size(t)) + scales * 4) << dtype_name(t);
        EXPECT_EQ(pool.arena_bytes(), 5 * g.block_bytes()) << dtype_name(t);
        EXPECT_EQ(pool.pages_bytes(), 5 * elems * int64_t(dtype_size(t))) << dtype_name(t);
    }
    EXPECT_EQ(geometry(DType::kFp8).block_bytes(), 3 * 2 * 2 * 4 * 8 + 3 * 2 * 2 * 4);
}

// The pool of each rank of a TP x PP layout at each dtype holds, per block, what the layout
// predicts for one block of a request (request_kv_bytes of block_size tokens).
TEST(KvDtypePool, BlockBytesEqualTheLayoutsPrediction) {
    for (const DType t : {DType::kFp32, DType::kBf16, DType::kFp16, DType::kFp8}) {
        ModelSpec m = catalog_model("tiny");
        m.kv_dtype = t;
        ParallelConfig p;
        p.tp = 2;
        p.pp = 2;
        const KvLayout l = make_layout(m, p);
        for (int r = 0; r < l.world_size(); ++r) {
            const PageGeometry g = page_geometry(l, r, 8);
            EXPECT_EQ(g.block_bytes(), request_kv_bytes(l, r, 8, 8)) << dtype_name(t);
            // 3 blocks for 17 tokens.
            EXPECT_EQ(3 * g.block_bytes(), request_kv_bytes(l, r, 17, 8)) << dtype_name(t);
            const RankKv& rk = l.ranks[size_t(r)];
            const int64_t elems = int64_t{rk.num_layers()} * 2 * rk.num_kv_heads() * m.head_dim;
            EXPECT_EQ(rk.kv_bytes_per_token, elems * int64_t(dtype_size(t)));
            const int64_t scales =
                t == DType::kFp8 ? int64_t{rk.num_layers()} * 2 * rk.num_kv_heads() * 4 : 0;
            EXPECT_EQ(g.block_bytes(), 8 * rk.kv_bytes_per_token + scales) << dtype_name(t);
        }
    }
}

std::vector<float> ramp(int d, float base) {
    std::vector<float> x(static_cast<size_t>(d));
    for (int i = 0; i < d; ++i) x[size_t(i)] = base * (float(i) - 3.3f) / 7.0f;
    return x;
}

TEST(KvDtypePool, Bf16AndFp16StoreTheRoundedCodes) {
    for (const DType t : {DType::kBf16, DType::kFp16}) {
        for (const PageOrder order : {PageOrder::kHnd, PageOrder::kNhd}) {
            const PageGeometry g = geometry(t, 2, order);
            BlockPool pool(g, 2);
            const std::vector<float> x = ramp(8, 1.37f);
            store_vector(pool, 2, 1, 1, 1, 3, x.data());
            const auto* codes = reinterpret_cast<const uint16_t*>(pool.page(2, 1, 1));
            std::vector<float> back(size_t(g.page_elems()));
            dequantize_page(pool, 2, 1, 1, back.data());
            for (int i = 0; i < 8; ++i) {
                const uint16_t want =
                    t == DType::kBf16 ? float_to_bf16(x[size_t(i)]) : float_to_fp16(x[size_t(i)]);
                EXPECT_EQ(codes[g.elem_in_page(1, 3, i)], want);
                EXPECT_EQ(back[size_t(g.elem_in_page(1, 3, i))],
                          t == DType::kBf16 ? bf16_to_float(want) : fp16_to_float(want));
                EXPECT_NE(back[size_t(g.elem_in_page(1, 3, i))], x[size_t(i)] + 1.0f);
            }
            // Nothing else of the pool was written.
            int64_t nonzero = 0;
            for (const std::byte b : pool.arena()) nonzero += b != std::byte{0};
            EXPECT_LE(nonzero, 16);
            EXPECT_GT(nonzero, 0);
        }
    }
}

bool is_power_of_two(float s) {
    int e = 0;
    return std::frexp(s, &e) == 0.5f;
}

TEST(KvDtypePool, Fp8ScaleRule) {
    const PageGeometry g = geometry(DType::kFp8);
    BlockPool pool(g, 2);
    // Slot 0: the scale is the smallest power of two that fits the vector's largest magnitude.
    const std::vector<float> a = ramp(8, 3.0f);  // |a| <= 3 * 4.3 / 7
    store_vector(pool, 0, 0, 1, 0, 0, a.data());
    const float s0 = pool.scale(0, 0, 1, 0);
    float amax = 0;
    for (float v : a) amax = std::max(amax, std::fabs(v));
    EXPECT_TRUE(is_power_of_two(s0)) << s0;
    EXPECT_LE(amax, kFp8E4m3Max * s0);
    EXPECT_GT(amax, kFp8E4m3Max * s0 / 2);
    std::vector<float> page(size_t(g.page_elems()));
    dequantize_page(pool, 0, 0, 1, page.data());
    for (int i = 0; i < 8; ++i) {
        const float got = page[size_t(g.elem_in_page(0, 0, i))];
        EXPECT_EQ(got, fp8_e4m3_to_float(float_to_fp8_e4m3(a[size_t(i)] / s0)) * s0);
        EXPECT_LE(std::fabs(got - a[size_t(i)]), std::fabs(a[size_t(i)]) / 16 + 0x1p-9f * s0);
    }
    // A smaller vector in slot 1 keeps the scale and slot 0's codes.
    std::vector<uint8_t> before(reinterpret_cast<const uint8_t*>(pool.page(0, 0, 1)),
                                reinterpret_cast<const uint8_t*>(pool.page(0, 0, 1)) + 32);
    const std::vector<float> b = ramp(8, 1.0f);
    store_vector(pool, 0, 0, 1, 0, 1, b.data());
    EXPECT_EQ(pool.scale(0, 0, 1, 0), s0);
    EXPECT_EQ(0, std::memcmp(before.data(), pool.page(0, 0, 1), 8));
    // A larger one in slot 2 raises the scale and re-encodes slots 0 and 1 at it.
    const std::vector<float> c = ramp(8, 40.0f);
    store_vector(pool, 0, 0, 1, 0, 2, c.data());
    const float s2 = pool.scale(0, 0, 1, 0);
    EXPECT_TRUE(is_power_of_two(s2));
    EXPECT_GT(s2, s0);
    dequantize_page(pool, 0, 0, 1, page.data());
    for (int i = 0; i < 8; ++i) {
        const float c_dq = fp8_e4m3_to_float(float_to_fp8_e4m3(c[size_t(i)] / s2)) * s2;
        EXPECT_EQ(page[size_t(g.elem_in_page(0, 2, i))], c_dq);
        // slot 0 re-encoded: its old value at the new scale
        const float a_old = fp8_e4m3_to_float(float_to_fp8_e4m3(a[size_t(i)] / s0)) * s0;
        EXPECT_EQ(page[size_t(g.elem_in_page(0, 0, i))],
                  fp8_e4m3_to_float(float_to_fp8_e4m3(a_old / s2)) * s2);
    }
    // Other heads, K/V, layers and blocks keep scale 0 (nothing stored).
    EXPECT_EQ(pool.scale(0, 0, 1, 1), 0.0f);
    EXPECT_EQ(pool.scale(0, 1, 1, 0), 0.0f);
    EXPECT_EQ(pool.scale(0, 0, 0, 0), 0.0f);
    // Slot 0 written again (a block reused) starts over: the scale of the new vector alone.
    store_vector(pool, 0, 0, 1, 0, 0, b.data());
    float bmax = 0;
    for (float v : b) bmax = std::max(bmax, std::fabs(v));
    EXPECT_LE(bmax, kFp8E4m3Max * pool.scale(0, 0, 1, 0));
    EXPECT_GT(bmax, kFp8E4m3Max * pool.scale(0, 0, 1, 0) / 2);
    // Saturation and NaN inside a vector: the finite maximum sets the scale.
    std::vector<float> d = ramp(8, 1.0f);
    d[2] = std::numeric_limits<float>::infinity();
    d[3] = std::numeric_limits<float>::quiet_NaN();
    store_vector(pool, 1, 1, 0, 1, 0, d.data());
    dequantize_page(pool, 1, 1, 0, page.data());
    const float sd = pool.scale(1, 1, 0, 1);
    EXPECT_EQ(page[size_t(g.elem_in_page(1, 0, 2))], kFp8E4m3Max * sd);
    EXPECT_TRUE(std::isnan(page[size_t(g.elem_in_page(1, 0, 3))]));
}

// What a head stores depends on that head's values alone: a rank holding heads {0, 1} and a rank
// holding head 1 alone (TP) store the same codes and scale for head 1, whatever the other head
// holds and however the writes are split.
TEST(KvDtypePool, Fp8HeadBytesDoNotDependOnTheRank) {
    BlockPool both(geometry(DType::kFp8, 2), 1), one(geometry(DType::kFp8, 1), 1);
    for (int t = 0; t < 4; ++t) {
        const std::vector<float> h1 = ramp(8, float(1 + 5 * t)), h0 = ramp(8, float(100 - t));
        store_vector(both, 1, 0, 0, 0, t, h0.data());
        store_vector(both, 1, 0, 0, 1, t, h1.data());
        store_vector(one, 1, 0, 0, 0, t, h1.data());
    }
    const PageGeometry g2 = both.geometry(), g1 = one.geometry();
    EXPECT_EQ(both.scale(1, 0, 0, 1), one.scale(1, 0, 0, 0));
    for (int t = 0; t < 4; ++t)
        EXPECT_EQ(0, std::memcmp(both.page(1, 0, 0) + g2.elem_in_page(1, t, 0),
                                 one.page(1, 0, 0) + g1.elem_in_page(0, t, 0), 8))
            << "slot " << t;
}

}  // namespace
}  // namespace kvshard
