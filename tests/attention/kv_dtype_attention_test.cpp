// Attention over bf16 / fp16 / fp8 pools: K and V written by write_kv (converted, fp8 scaled per
// block and head), read by both kernels. Against the fp32 pool of the same K and V the output
// stays within the dtype's stated bound (and is not identical: the pool really holds the narrow
// type); against an fp32 pool holding the dequantized values it is the same attention.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>
#include <tuple>

#include "kvshard/attention/paged_attention.h"
#include "kvshard/common/dtype.h"

namespace kvshard {
namespace {

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(b[i]) * b[i];
    }
    return std::sqrt(num / den);
}

// Relative L2 bounds of the attention output against fp32 KV, for K, V ~ U(-1, 1) scaled per token
// by up to 4x: a few times each format's relative rounding step (bf16 2^-8, fp16 2^-11, fp8 e4m3
// 2^-4 at the top of a block's range, coarser below it).
double bound(DType t) {
    switch (t) {
        case DType::kBf16:
            return 1e-2;
        case DType::kFp16:
            return 2e-3;
        case DType::kFp8:
            return 1e-1;
        default:
            return 0;
    }
}

struct Outputs {
    std::vector<float> out, out_dequantized_ref;
};

// nq query heads over nkv KV heads of head_dim d, `cached` tokens then `fresh` query rows per
// sequence.
Outputs run(DType t, PageOrder order, int d, int64_t cached_len, int64_t fresh, uint32_t seed,
            std::vector<float>* fp32_out) {
    const int nq = 4, nkv = 2, bs = 8, nseq = 2;
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    PageGeometry g{.num_layers = 1,
                   .kv_factor = 2,
                   .num_heads = nkv,
                   .block_size = bs,
                   .head_dim = d,
                   .dtype = t,
                   .order = order};
    PageGeometry g32 = g;
    g32.dtype = DType::kFp32;
    const int64_t len = cached_len + fresh;
    const int64_t per_seq = (len + bs - 1) / bs;
    BlockPool pool(g, nseq * per_seq + 3), ref32(g32, nseq * per_seq + 3),
        deq(g32, nseq * per_seq + 3);
    std::vector<int32_t> ids(size_t(pool.num_blocks()));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    PagedKv kv;
    QueryBatch qb;
    for (int i = 0; i < nseq; ++i) {
        std::vector<int32_t> blocks(ids.begin() + i * per_seq, ids.begin() + (i + 1) * per_seq);
        kv.add_sequence(blocks, len, bs);
        qb.add_sequence(fresh, cached_len);
    }
    // Every token of every sequence, written in slot order: the cached ones one call per token
    // (decode-like), the query rows in one call (prefill-like).
    auto values = [&](int64_t rows) {
        std::vector<float> x(size_t(rows * nkv * d));
        for (int64_t r = 0; r < rows; ++r) {
            const float mag = 0.25f + 3.75f * (u(rng) + 1) / 2;
            for (int64_t e = 0; e < nkv * d; ++e) x[size_t(r * nkv * d + e)] = mag * u(rng);
        }
        return x;
    };
    for (int64_t tok = 0; tok < cached_len; ++tok) {
        const auto k = values(nseq), v = values(nseq);
        std::vector<int32_t> indptr = {0};
        std::vector<int64_t> slots;
        for (int i = 0; i < nseq; ++i) {
            slots.push_back(tok);
            indptr.push_back(i + 1);
        }
        write_kv(pool, 0, kv, indptr, slots, k.data(), v.data());
        write_kv(ref32, 0, kv, indptr, slots, k.data(), v.data());
    }
    {
        const auto k = values(nseq * fresh), v = values(nseq * fresh);
        std::vector<int32_t> indptr = {0};
        std::vector<int64_t> slots;
        for (int i = 0; i < nseq; ++i) {
            for (int64_t r = 0; r < fresh; ++r) slots.push_back(cached_len + r);
            indptr.push_back(int32_t(slots.size()));
        }
        write_kv(pool, 0, kv, indptr, slots, k.data(), v.data());
        write_kv(ref32, 0, kv, indptr, slots, k.data(), v.data());
    }
    for (int which = 0; which < 2; ++which)
        for (int64_t b = 0; b < pool.num_blocks(); ++b)
            dequantize_page(pool, 0, which, b, deq.page_f32(0, which, b));
    std::vector<float> q(size_t(qb.rows() * nq * d));
    for (auto& x : q) x = 2.0f * u(rng);
    const AttentionParams p{.num_q_heads = nq,
                            .num_kv_heads = nkv,
                            .head_dim = d,
                            .scale = 1.0f / std::sqrt(float(d)),
                            .causal = true};
    Outputs r;
    r.out.assign(q.size(), 0.f);
    r.out_dequantized_ref.assign(q.size(), 0.f);
    fp32_out->assign(q.size(), 0.f);
    paged_attention(pool, 0, kv, qb, p, q.data(), r.out.data(), nullptr);
    paged_attention_reference(deq, 0, kv, qb, p, q.data(), r.out_dequantized_ref.data(), nullptr);
    paged_attention(ref32, 0, kv, qb, p, q.data(), fp32_out->data(), nullptr);
    // The plain reference kernel reads the narrow pool the same way.
    std::vector<float> plain(q.size(), 0.f);
    paged_attention_reference(pool, 0, kv, qb, p, q.data(), plain.data(), nullptr);
    EXPECT_LT(rel_l2(plain, r.out_dequantized_ref), 1e-6);
    return r;
}

class KvDtypeAttention : public ::testing::TestWithParam<std::tuple<DType, PageOrder>> {};

TEST_P(KvDtypeAttention, WithinTheDtypesBoundOfFp32) {
    const auto [t, order] = GetParam();
    // (cached, fresh): decode rows (streaming kernel) and prefill rows (GEMM kernel).
    // (cached, fresh): decode rows (streaming kernel) and prefill rows (GEMM kernel), at head sizes
    // with and without the unrolled kernels.
    for (const int d : {32, 64, 128})
        for (const auto& [cached, fresh] :
             {std::pair<int64_t, int64_t>{37, 1}, {0, 45}, {13, 20}}) {
            std::vector<float> fp32;
            const Outputs r =
                run(t, order, d, cached, fresh, uint32_t(d + cached * 100 + fresh), &fp32);
            const double err = rel_l2(r.out, fp32);
            EXPECT_LT(err, bound(t))
                << dtype_name(t) << " d " << d << " cached " << cached << " fresh " << fresh;
            EXPECT_GT(err, 1e-7) << dtype_name(t)
                                 << ": the output equals fp32 KV's, so the pool "
                                    "did not store the narrow type";
            EXPECT_LT(rel_l2(r.out, r.out_dequantized_ref), 2e-5)
                << dtype_name(t) << " d " << d << ": attention over the stored values";
        }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvDtypeAttention,
                         ::testing::Combine(::testing::Values(DType::kBf16, DType::kFp16,
                                                              DType::kFp8),
                                            ::testing::Values(PageOrder::kHnd, PageOrder::kNhd)),
                         [](const auto& info) {
                             return std::string(dtype_name(std::get<0>(info.param))) +
                                    (std::get<1>(info.param) == PageOrder::kHnd ? "_hnd" : "_nhd");
                         });

}  // namespace
}  // namespace kvshard
