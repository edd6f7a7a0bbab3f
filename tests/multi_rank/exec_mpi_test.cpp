// Sharded generation on the MPI backend (ranks are processes) against the unsharded run computed in
// each process: identical greedy tokens for 32 steps, last-step logits within 1e-4 relative L2, KV
// bytes per rank as the layout predicts. Layouts whose world size differs from the job are skipped.
#include <gtest/gtest.h>

#include "kvshard/comm/mpi.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

Communicator& world() {
    static std::unique_ptr<Communicator> w = mpi_world();
    return *w;
}

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
    out[2].insert(out[2].begin(), out[0].begin(), out[0].begin() + 8);  // a prefix-cache hit
    return out;
}

struct Case {
    std::string model, parallel;
};

class ExecMpiTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExecMpiTest, MatchesUnsharded) {
    const ModelSpec m = catalog_model(GetParam().model);
    const ParallelConfig p = parse_parallel_config(GetParam().parallel);
    if (p.world_size() != world().size()) GTEST_SKIP() << "needs " << p.world_size() << " ranks";
    set_compute_threads(1);
    GenerationOptions opt;
    opt.max_new_tokens = 32;
    opt.block_size = 8;
    const auto src = random_tensor_source(5);
    const auto prompts = prompts_for(m);
    const GenerationReport ref = generate(m, ParallelConfig{}, *src, prompts, opt);
    const GenerationReport got = generate(m, p, *src, prompts, opt, &world());
    for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(got.tokens[i], ref.tokens[i]) << "prompt " << i;
        EXPECT_LT(relative_l2(got.last_logits[i], ref.last_logits[i]), 1e-4) << "prompt " << i;
    }
    ASSERT_EQ(int(got.ranks.size()), p.world_size());
    for (const auto& r : got.ranks) {
        EXPECT_GT(r.kv_bytes, 0);
        EXPECT_EQ(r.kv_bytes, r.kv_bytes_predicted) << "rank " << r.rank;
    }
}

INSTANTIATE_TEST_SUITE_P(Grid, ExecMpiTest,
                         ::testing::Values(Case{"tiny", "tp=2"}, Case{"tiny", "pp=2"},
                                           Case{"tiny", "dp=2"}, Case{"tiny-moe", "tp=2,ep=2"},
                                           Case{"tiny", "tp=4"}, Case{"tiny", "tp=2,pp=2"},
                                           Case{"tiny-moe", "dp=2,tp=2,ep=4"},
                                           Case{"tiny-moe", "dp=2,pp=2,ep=2"}),
                         [](const auto& info) {
                             std::string s = info.param.model + "_" + info.param.parallel;
                             for (char& ch : s)
                                 if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                             return s;
                         });

}  // namespace
}  // namespace kvshard
