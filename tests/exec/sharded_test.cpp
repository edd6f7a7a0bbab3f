// Sharded runs on the threads backend against the unsharded run of the same weights: last-step
// logits within 1e-4 relative L2, identical greedy tokens for 32 steps, every rank's KV bytes as
// the layout predicts. Grid: TP (incl. replicated KV heads), PP (uneven), EP over TP and DP ranks,
// CP with TP, PP and EP, and mixes.
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "kvshard/comm/threads.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

constexpr uint64_t kSeed = 11;
constexpr int kSteps = 32;

std::vector<std::vector<int32_t>> prompts_for(const ModelSpec& m) {
    std::vector<std::vector<int32_t>> out;
    uint32_t s = 12345;
    for (int len : {9, 17, 24, 5}) {
        std::vector<int32_t> p;
        for (int i = 0; i < len; ++i) {
            s = s * 1664525u + 1013904223u;
            p.push_back(int32_t((s >> 8) % uint32_t(m.vocab)));
        }
        out.push_back(p);
    }
    // Shared prefixes (prompt 2 starts like prompt 0, prompt 3 like prompt 1: the same DP replica
    // when dp <= 2), so that the prefix cache serves whole blocks in sharded runs too.
    out[2].insert(out[2].begin(), out[0].begin(), out[0].begin() + 8);
    out[3].insert(out[3].begin(), out[1].begin(), out[1].begin() + 16);
    return out;
}

GenerationOptions options() {
    GenerationOptions o;
    o.max_new_tokens = kSteps;
    o.block_size = 8;
    return o;
}

const GenerationReport& unsharded(const std::string& model) {
    static std::map<std::string, GenerationReport> cache;
    auto it = cache.find(model);
    if (it == cache.end()) {
        const ModelSpec m = catalog_model(model);
        const auto src = random_tensor_source(kSeed);
        it = cache.emplace(model, generate(m, ParallelConfig{}, *src, prompts_for(m), options()))
                 .first;
    }
    return it->second;
}

GenerationReport run_sharded(const ModelSpec& m, const ParallelConfig& p) {
    const auto src = random_tensor_source(kSeed);
    const auto prompts = prompts_for(m);
    std::vector<GenerationReport> reports(size_t(p.world_size()));
    run_threads(p.world_size(), [&](Communicator& world) {
        reports[size_t(world.rank())] = generate(m, p, *src, prompts, options(), &world);
    });
    for (int r = 1; r < p.world_size(); ++r) {
        EXPECT_EQ(reports[size_t(r)].tokens, reports[0].tokens)
            << "rank " << r << " disagrees on the tokens";
    }
    return reports[0];
}

struct GridCase {
    std::string model;
    std::string parallel;
};

class ShardedTest : public ::testing::TestWithParam<GridCase> {};

TEST_P(ShardedTest, MatchesUnsharded) {
    const auto& gc = GetParam();
    const ModelSpec m = catalog_model(gc.model);
    const ParallelConfig p = parse_parallel_config(gc.parallel);
    const GenerationReport& ref = unsharded(gc.model);
    const GenerationReport got = run_sharded(m, p);
    ASSERT_EQ(got.tokens.size(), ref.tokens.size());
    for (size_t i = 0; i < ref.tokens.size(); ++i) {
        ASSERT_EQ(got.tokens[i].size(), size_t(kSteps));
        EXPECT_EQ(got.tokens[i], ref.tokens[i]) << "prompt " << i;
        EXPECT_LT(relative_l2(got.last_logits[i], ref.last_logits[i]), 1e-4) << "prompt " << i;
    }
    ASSERT_EQ(int(got.ranks.size()), p.world_size());
    const KvLayout layout = make_layout(m, p);
    for (const auto& r : got.ranks) {
        EXPECT_GT(r.kv_tokens, 0) << "rank " << r.rank;
        EXPECT_EQ(r.kv_bytes, r.kv_bytes_predicted) << "rank " << r.rank;
        if (p.cp > 1) continue;  // the CP session reports the bytes of the tokens it holds
        // fp32: whole blocks of the rank's bytes per token (no scales)
        const int64_t block =
            int64_t{options().block_size} * layout.ranks[size_t(r.rank)].kv_bytes_per_token;
        EXPECT_EQ(r.kv_bytes % block, 0) << "rank " << r.rank;
        EXPECT_GE(r.kv_bytes / block,
                  (r.kv_tokens + options().block_size - 1) / options().block_size);
    }
    // Each replica holds its own prompts' tokens: the KV tokens of a DP replica's ranks agree, and
    // over the replicas they add up to the unsharded run's.
    int64_t total = 0;
    for (const auto& r : got.ranks)
        if (r.coord.pp == 0 && r.coord.tp == 0) total += r.kv_tokens;
    if (p.dp <= 2) {
        // The CP session counts every sequence's tokens (over the CP ranks of a stage), a shared
        // prefix once per sequence; the unsharded run counts a cached prefix once.
        EXPECT_EQ(total, ref.ranks[0].kv_tokens + (p.cp > 1 ? ref.prefix_hit_tokens : 0));
        // Under a CP scheme that splits blocks across ranks the cache is off (and says so).
        EXPECT_EQ(got.prefix_hit_tokens, got.prefix_cache ? ref.prefix_hit_tokens : 0);
        EXPECT_EQ(got.prefix_cache, p.cp == 1 || p.cp_scheme == CpScheme::kInterleave);
    }
    EXPECT_EQ(ref.prefix_hit_tokens, 8 + 16);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, ShardedTest,
    ::testing::Values(
        GridCase{"tiny", "tp=1"}, GridCase{"tiny", "tp=2"}, GridCase{"tiny", "tp=4"},
        GridCase{"tiny", "tp=8"},  // 8 > 4 KV heads: each KV head on 2 ranks
        GridCase{"tiny", "pp=2"}, GridCase{"tiny", "pp=3"},  // 2+1+1 layers
        GridCase{"tiny", "pp=2,pp_layers=3/1"}, GridCase{"tiny", "dp=2"},
        GridCase{"tiny", "tp=2,pp=2"}, GridCase{"tiny", "tp=8,pp=2"},
        GridCase{"tiny", "dp=2,tp=2,pp=2"}, GridCase{"tiny-moe", "tp=1"},
        GridCase{"tiny-moe", "tp=2,ep=2"}, GridCase{"tiny-moe", "dp=2,ep=2"},
        GridCase{"tiny-moe", "tp=4,ep=4"}, GridCase{"tiny-moe", "dp=2,tp=2,ep=4"},
        GridCase{"tiny-moe", "tp=4,ep=2"}, GridCase{"tiny-moe", "dp=4,ep=4"},
        GridCase{"tiny-moe", "tp=2,pp=3,ep=2"}, GridCase{"tiny-moe", "dp=2,tp=2,pp=2,ep=4"},
        // Context parallelism with PP (each stage a cp x tp grid) and with EP
        // (the experts spread over CP ranks); interleave at the block size keeps
        // the prefix cache on.
        GridCase{"tiny", "cp=2,tp=2,pp=2"},
        GridCase{"tiny", "cp=2,pp=2,cp_scheme=interleave,cp_interleave=8"},
        GridCase{"tiny", "cp=2,tp=2,pp=3,cp_scheme=zigzag"}, GridCase{"tiny-moe", "cp=2,ep=2"},
        GridCase{"tiny-moe", "cp=2,ep=2,cp_scheme=interleave,cp_interleave=8"},
        GridCase{"tiny-moe", "cp=2,tp=2,ep=4"}, GridCase{"tiny-moe", "cp=2,tp=2,pp=2,ep=2"}),
    [](const auto& info) {
        std::string s = info.param.model + "_" + info.param.parallel;
        for (char& ch : s)
            if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
        return s;
    });

}  // namespace
}  // namespace kvshard
