// CP over the MPI backend (mpirun -np 2 / 4): ring prefill + merged decode of the tiny model equal
// the unsharded model; ring bytes equal the plan; a prefix cached at cp=np is reused at cp=np/2;
// the CP runner's continuous batching gives the unsharded tokens.
#include <gtest/gtest.h>

#include <random>

#include "kvshard/comm/mpi.h"
#include "kvshard/exec/cp_session.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

Communicator& world() {
    static std::unique_ptr<Communicator> w = mpi_world();
    return *w;
}

std::vector<int32_t> tokens(int n, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> d(0, 255);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = d(rng);
    return t;
}

struct Outcome {
    std::vector<float> prefill_logits, last_logits;
    std::vector<int32_t> tokens;
};

Outcome unsharded(const std::vector<int32_t>& prompt, int steps) {
    GenerationOptions o;
    o.block_size = 4;
    o.prefix_cache = false;
    o.max_new_tokens = 1;
    const auto src = random_tensor_source(99);
    Outcome r;
    r.prefill_logits =
        generate(catalog_model("tiny"), ParallelConfig{}, *src, {prompt}, o).last_logits[0];
    o.max_new_tokens = steps;
    const auto g = generate(catalog_model("tiny"), ParallelConfig{}, *src, {prompt}, o);
    r.tokens = g.tokens[0];
    r.last_logits = g.last_logits[0];
    return r;
}

Outcome serve(CpSession& s, SeqId seq, const std::vector<int32_t>& prompt, int steps) {
    Outcome r;
    auto logits = s.prefill(seq, prompt);
    r.prefill_logits = logits;
    r.tokens.push_back(argmax(logits));
    for (int i = 1; i < steps; ++i) {
        logits = s.decode(seq, r.tokens.back());
        r.tokens.push_back(argmax(logits));
    }
    r.last_logits = logits;
    return r;
}

TEST(CpMpi, EverySchemeAndTpMatchesUnshardedAndSendsThePlannedBytes) {
    const int n = world().size();
    if (n < 2) GTEST_SKIP() << "needs at least 2 ranks";
    const auto prompt = tokens(22, 1);
    const Outcome want = unsharded(prompt, 32);
    const auto src = random_tensor_source(99);
    for (int tp : {1, 2}) {
        if (n % tp != 0 || n / tp < 2) continue;
        for (CpScheme scheme : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave})
            for (CpDecodeMerge merge : {CpDecodeMerge::kAllGather, CpDecodeMerge::kAllToAll}) {
                ParallelConfig p;
                p.cp = n / tp;
                p.tp = tp;
                p.cp_scheme = scheme;
                p.cp_interleave = 4;
                CpOptions o;
                o.block_size = 4;
                o.num_blocks = 64;
                o.decode_merge = merge;
                o.prefill_mode = CpPrefillMode::kPassKv;
                CpDevice dev(catalog_model("tiny"), tp, rank_coord(p, world().rank()).tp, *src, o);
                CpSession s(dev, world(), p, o);
                const Outcome got = serve(s, 0, prompt, 32);
                const std::string what =
                    p.to_string() + " " + std::string(cp_decode_merge_name(merge));
                EXPECT_LT(relative_l2(got.prefill_logits, want.prefill_logits), 1e-4) << what;
                EXPECT_LT(relative_l2(got.last_logits, want.last_logits), 1e-4) << what;
                EXPECT_EQ(got.tokens, want.tokens) << what;
                s.release(0);
            }
    }
}

TEST(CpMpi, RingBytesEqualThePlan) {
    const int n = world().size();
    if (n < 2) GTEST_SKIP() << "needs at least 2 ranks";
    const auto src = random_tensor_source(99);
    ParallelConfig p;
    p.cp = n;
    p.cp_scheme = CpScheme::kZigzag;
    CpOptions o;
    o.block_size = 4;
    o.num_blocks = 64;
    o.prefill_mode = CpPrefillMode::kPassKv;
    CpDevice dev(catalog_model("tiny"), 1, 0, *src, o);
    CpSession s(dev, world(), p, o);
    s.prefill(0, tokens(29, 2));
    EXPECT_EQ(s.last_step().comm.ring,
              cp_pass_kv_bytes(s.layout(), world().rank(), cp_prompt_map(p, 29)).ring);
}

TEST(CpMpi, PrefixCachedAtFullCpIsReusedAtHalfWithoutRecomputation) {
    const int n = world().size();
    if (n < 4) GTEST_SKIP() << "needs 4 ranks";
    const auto src = random_tensor_source(99);
    const auto first = tokens(37, 3);
    std::vector<int32_t> second(first.begin(), first.begin() + 32);
    const auto tail = tokens(6, 4);
    second.insert(second.end(), tail.begin(), tail.end());
    const Outcome want = unsharded(second, 32);
    CpOptions o;
    o.block_size = 4;
    o.num_blocks = 64;
    CpDevice dev(catalog_model("tiny"), 1, 0, *src, o);
    ParallelConfig p;
    p.cp_scheme = CpScheme::kInterleave;
    p.cp_interleave = 4;
    p.cp = n;
    {
        CpSession s(dev, world(), p, o);
        s.prefill(0, first);
        s.release(0);
    }
    p.cp = n / 2;
    CpSession s(dev, world(), p, o);
    if (!s.serving()) {
        s.prefill(1, second);                          // lends its blocks
        EXPECT_EQ(s.last_step().blocks_moved_out, 2);  // rank 2: blocks 2,6 -> 0; rank 3: 3,7 -> 1
        EXPECT_EQ(world().all_reduce_value<int64_t>(0, ReduceOp::kSum), 6);
        return;
    }
    auto logits = s.prefill(1, second);
    EXPECT_EQ(s.last_step().cached_tokens, 32);  // 8 blocks found, half of them moved in
    EXPECT_EQ(world().all_reduce_value<int64_t>(s.last_step().computed_tokens, ReduceOp::kSum), 6);
    std::vector<int32_t> toks = {argmax(logits)};
    EXPECT_LT(relative_l2(logits, want.prefill_logits), 1e-4);
    for (int i = 1; i < 32; ++i) {
        logits = s.decode(1, toks.back());
        toks.push_back(argmax(logits));
    }
    EXPECT_EQ(toks, want.tokens);
    EXPECT_LT(relative_l2(logits, want.last_logits), 1e-4);
}

// The CP runner's continuous batching under MPI: 4 requests of different lengths with shared
// prefixes, two joining mid-decode, every scheme; identical tokens to the unsharded model.
TEST(CpMpi, ContinuousBatchingMatchesUnsharded) {
    const int n = world().size();
    if (n < 2) GTEST_SKIP() << "needs at least 2 ranks";
    const auto src = random_tensor_source(99);
    const ModelSpec m = catalog_model("tiny");
    std::vector<std::vector<int32_t>> prompts = {tokens(21, 5), tokens(9, 6), tokens(14, 7),
                                                 tokens(26, 8)};
    prompts[2].insert(prompts[2].begin(), prompts[0].begin(), prompts[0].begin() + 12);
    prompts[3].insert(prompts[3].begin(), prompts[0].begin(), prompts[0].begin() + 16);
    GenerationOptions o;
    o.block_size = 4;
    o.max_new_tokens = 10;
    GenerationReport want;
    for (const auto& pr : prompts) {  // each prompt alone
        const auto g = generate(m, ParallelConfig{}, *src, {pr}, o);
        want.tokens.push_back(g.tokens[0]);
        want.last_logits.push_back(g.last_logits[0]);
    }
    o.arrival_step = {0, 0, 3, 6};
    for (int tp : {1, 2}) {
        if (n % tp != 0 || n / tp < 2) continue;
        for (CpScheme scheme : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave}) {
            ParallelConfig p;
            p.cp = n / tp;
            p.tp = tp;
            p.cp_scheme = scheme;
            p.cp_interleave = 4;
            const GenerationReport got = generate(m, p, *src, prompts, o, &world());
            for (size_t i = 0; i < prompts.size(); ++i) {
                EXPECT_EQ(got.tokens[i], want.tokens[i]) << p.to_string() << " prompt " << i;
                EXPECT_LT(relative_l2(got.last_logits[i], want.last_logits[i]), 1e-4)
                    << p.to_string() << " prompt " << i;
            }
            if (scheme == CpScheme::kInterleave) {
                EXPECT_EQ(got.prefix_hit_tokens, 12 + 16);
            }
        }
    }
}

}  // namespace
}  // namespace kvshard
