// Runs whose pools hold bf16 or fp8: sharded (TP 2, PP 2) equals unsharded at the same KV dtype
// (last-step logits within 1e-4 relative L2, identical greedy tokens), each rank's KV bytes are
// the layout's prediction at that dtype (fp8: one byte per element plus one fp32 scale per block,
// layer, K/V and head), and the run differs from the fp32-KV run (the quantization is real), which
// verify reports beside the check.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "kvshard/comm/threads.h"
#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

constexpr uint64_t kSeed = 5;

std::vector<std::vector<int32_t>> prompts_for(const ModelSpec& m) {
    std::vector<std::vector<int32_t>> out;
    uint32_t s = 777;
    for (int len : {11, 19, 6}) {
        std::vector<int32_t> p;
        for (int i = 0; i < len; ++i) {
            s = s * 1664525u + 1013904223u;
            p.push_back(int32_t((s >> 8) % uint32_t(m.vocab)));
        }
        out.push_back(p);
    }
    out[2].insert(out[2].begin(), out[1].begin(), out[1].begin() + 16);  // 2 shared blocks
    return out;
}

GenerationOptions options() {
    GenerationOptions o;
    o.max_new_tokens = 12;
    o.block_size = 8;
    return o;
}

ModelSpec model_at(DType t) {
    ModelSpec m = catalog_model("tiny");
    m.kv_dtype = t;
    return m;
}

GenerationReport run(const ModelSpec& m, const ParallelConfig& p) {
    const auto src = random_tensor_source(kSeed);
    std::vector<GenerationReport> reports(size_t(p.world_size()));
    run_threads(p.world_size(), [&](Communicator& world) {
        reports[size_t(world.rank())] = generate(m, p, *src, prompts_for(m), options(), &world);
    });
    return reports[0];
}

class KvDtypeSharded : public ::testing::TestWithParam<std::tuple<DType, std::string>> {};

TEST_P(KvDtypeSharded, EqualsUnshardedAtTheSameDtype) {
    const auto [t, parallel] = GetParam();
    const ModelSpec m = model_at(t);
    const ParallelConfig p = parse_parallel_config(parallel);
    const GenerationReport one = run(m, ParallelConfig{});
    const GenerationReport got = run(m, p);
    const GenerationReport fp32 = run(model_at(DType::kFp32), ParallelConfig{});
    ASSERT_EQ(got.tokens.size(), one.tokens.size());
    double quant_err = 0;
    for (size_t i = 0; i < one.tokens.size(); ++i) {
        EXPECT_EQ(got.tokens[i], one.tokens[i]) << "prompt " << i;
        EXPECT_LT(relative_l2(got.last_logits[i], one.last_logits[i]), 1e-4) << "prompt " << i;
        quant_err = std::max(quant_err, relative_l2(one.last_logits[i], fp32.last_logits[i]));
    }
    EXPECT_GT(quant_err, 1e-6) << dtype_name(t) << " KV gives the fp32 run's logits";
    // Every rank: the pool's bytes are the layout's prediction, in whole blocks of
    // (elements at the dtype's size + fp8 scales).
    const KvLayout layout = make_layout(m, p);
    const int bs = options().block_size;
    for (const auto& r : got.ranks) {
        const RankKv& rk = layout.ranks[size_t(r.rank)];
        const int64_t elems = int64_t{bs} * rk.num_layers() * 2 * rk.num_kv_heads() * m.head_dim;
        const int64_t block =
            elems * int64_t(dtype_size(t)) +
            (t == DType::kFp8 ? int64_t{rk.num_layers()} * 2 * rk.num_kv_heads() * 4 : 0);
        EXPECT_EQ(r.kv_bytes, r.kv_bytes_predicted) << "rank " << r.rank;
        EXPECT_GT(r.kv_bytes, 0);
        EXPECT_EQ(r.kv_bytes % block, 0) << "rank " << r.rank;
        EXPECT_GE(r.kv_bytes / block, (r.kv_tokens + bs - 1) / bs) << "rank " << r.rank;
    }
    // verify: passes at the run's dtype and reports the fp32 run's distance beside it.
    const auto src = random_tensor_source(kSeed);
    const VerifyResult v = verify_against_reference(
        m, *src, prompts_for(m), options().max_new_tokens, bs, got.tokens, got.last_logits);
    EXPECT_TRUE(v.ok()) << v.max_rel_err;
    EXPECT_EQ(v.kv_dtype, t);
    EXPECT_TRUE(v.has_fp32_reference);
    EXPECT_GT(v.fp32_max_rel_err, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Grid, KvDtypeSharded,
                         ::testing::Combine(::testing::Values(DType::kFp8, DType::kBf16),
                                            ::testing::Values("tp=2", "pp=2", "tp=2,pp=2")),
                         [](const auto& info) {
                             std::string s = std::string(dtype_name(std::get<0>(info.param))) +
                                             "_" + std::get<1>(info.param);
                             for (char& ch : s)
                                 if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                             return s;
                         });

TEST(KvDtypeSharded, CpRefusesNarrowKv) {
    const ModelSpec m = model_at(DType::kBf16);
    const ParallelConfig p = parse_parallel_config("cp=2");
    const auto src = random_tensor_source(kSeed);
    try {
        run_threads(2, [&](Communicator& world) {
            (void)generate(m, p, *src, prompts_for(m), options(), &world);
        });
        ADD_FAILURE() << "cp=2 with bf16 KV ran";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("--kv-dtype fp32"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace kvshard
