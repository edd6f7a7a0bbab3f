// serve/: the library side of `kvshard run` (prompts, weights, the memory check, the check against
// the unsharded model, the options' own validation).
#include <gtest/gtest.h>

#include <cmath>

#include "kvshard/comm/threads.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"
#include "kvshard/model/weights.h"
#include "kvshard/serve/disagg.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/inputs.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

TEST(ServeInputs, PromptsAreDeterministicWithASharedPrefix) {
    const PromptSpec spec{.count = 3, .length = 20, .shared_prefix = 8, .seed = 5};
    const auto a = make_prompts(spec, 256);
    EXPECT_EQ(a, make_prompts(spec, 256));
    ASSERT_EQ(a.size(), 3u);
    for (const auto& p : a) {
        ASSERT_EQ(p.size(), 20u);
        EXPECT_TRUE(std::equal(p.begin(), p.begin() + 8, a[0].begin()));
        for (int32_t t : p) EXPECT_TRUE(t >= 0 && t < 256);
    }
    EXPECT_NE(a[0], a[1]);  // their own tokens differ
    EXPECT_NE(make_prompts({.count = 3, .length = 20, .shared_prefix = 8, .seed = 6}, 256), a);
    const auto ids = make_prompts({.count = 2, .token_ids = {1, 2, 3}}, 256);
    EXPECT_EQ(ids, (std::vector<std::vector<int32_t>>{{1, 2, 3}, {1, 2, 3}}));
}

TEST(ServeInputs, BadPromptSpecsNameTheFlag) {
    auto message = [](const PromptSpec& s) {
        try {
            make_prompts(s, 100);
        } catch (const Error& e) {
            return std::string(e.what());
        }
        return std::string();
    };
    EXPECT_NE(message({.count = 0}).find("--prompts must be at least 1"), std::string::npos);
    EXPECT_NE(message({.length = 0}).find("--prompt-len must be at least 1"), std::string::npos);
    EXPECT_NE(message({.length = 4, .shared_prefix = 5}).find("--shared-prefix must be in [0, 4]"),
              std::string::npos);
    EXPECT_NE(message({.token_ids = {1, 100}}).find("outside the vocabulary [0, 100)"),
              std::string::npos);
}

TEST(ServeInputs, Weights) {
    const WeightChoice w = choose_weights("tiny", 7);  // no checkpoint directory: random weights
    EXPECT_EQ(w.description, "seed 7");
    ASSERT_NE(w.source, nullptr);
}

// weight_shard_bytes is what load_weights holds, for every rank's shard of a few layouts.
TEST(ServeMemory, WeightShardBytesEqualLoadedWeights) {
    const auto src = random_tensor_source(3);
    for (const std::string name : {"tiny", "tiny-moe"})
        for (const std::string par : {"tp=1", "tp=2,pp=2", "tp=8", "tp=2,ep=2"}) {
            const ModelSpec m = catalog_model(name);
            const ParallelConfig p = parse_parallel_config(par);
            if (p.ep > 1 && !m.moe.enabled()) continue;
            const KvLayout layout = make_layout(m, p);
            for (int r = 0; r < layout.world_size(); ++r) {
                SCOPED_TRACE(name + " " + par + " rank " + std::to_string(r));
                const WeightShard s = weight_shard(layout, r);
                const ModelWeights w = load_weights(m, s, *src);
                double floats = double(w.embed.size() + w.final_norm.size() + w.lm_head.size());
                for (const LayerWeights& l : w.layers) {
                    for (const auto* v : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.mlp_norm,
                                          &l.gate, &l.up, &l.down, &l.router})
                        floats += double(v->size());
                    for (const ExpertWeights& e : l.experts)
                        floats += double(e.gate.size() + e.up.size() + e.down.size());
                }
                EXPECT_EQ(weight_shard_bytes(m, s), floats * sizeof(float));
            }
        }
}

// The estimate grows with what the run holds, counts the unsharded --verify run, and the check
// refuses above the limit with the estimate in the message, before anything is allocated.
TEST(ServeMemory, EstimateAndCheck) {
    const ModelSpec m = catalog_model("tiny");
    const std::vector<RunGroup> tp2{{parse_parallel_config("tp=2"), 16}};
    const RunShape base{.prompts = 4, .prompt_len = 64, .gen = 8};
    const RunMemoryEstimate e = estimate_run_memory(m, tp2, base);
    EXPECT_EQ(e.ranks, 2);
    // Both ranks hold the embedding and LM head; the KV of 4 x 72 tokens + a spare block per rank.
    const KvLayout l = make_layout(m, parse_parallel_config("tp=2"));
    EXPECT_GT(e.weights, 2.0 * 2 * m.vocab * m.hidden * 4);
    EXPECT_EQ(e.kv, 2.0 * (16 + 4 * 80) * l.ranks[0].kv_bytes_per_token);
    EXPECT_EQ(e.reference, 0);
    RunShape longer = base;
    longer.prompt_len = 640;
    EXPECT_GT(estimate_run_memory(m, tp2, longer).kv, e.kv * 5);
    RunShape verify = base;
    verify.verify = true;
    const RunMemoryEstimate v = estimate_run_memory(m, tp2, verify);
    EXPECT_GT(v.reference, 0);
    EXPECT_GE(v.peak(), e.peak());
    // MPI, one rank per process on this host: only the local ranks count.
    RunShape mpi = base;
    mpi.local_ranks = 1;
    EXPECT_EQ(estimate_run_memory(m, tp2, mpi).ranks, 1);
    // DP splits the prompts: each replica's pool holds its own.
    const RunMemoryEstimate dp2 =
        estimate_run_memory(m, {{parse_parallel_config("dp=2,tp=2"), 16}}, base);
    EXPECT_EQ(dp2.kv, 4.0 * (16 + 2 * 80) * l.ranks[0].kv_bytes_per_token);

    EXPECT_NO_THROW(check_run_memory(e, 1.0));
    auto message = [&](const RunMemoryEstimate& x, double gib, bool given = true) {
        try {
            check_run_memory(x, gib, given);
        } catch (const Error& err) {
            return std::string(err.what());
        }
        return std::string();
    };
    const std::string low = message(e, 1e-6);
    EXPECT_NE(low.find("more than --max-memory-gib 0.00"), std::string::npos) << low;
    EXPECT_NE(message(e, 1e-6, false).find("available memory"), std::string::npos);
    EXPECT_NE(low.find("weights "), std::string::npos) << low;
    EXPECT_NE(message(e, std::nan("")).find("finite number of GiB above 0"), std::string::npos);
    EXPECT_NE(message(e, 0).find("finite number of GiB above 0"), std::string::npos);
    // A prompt of 2e9 tokens or a block of 2^31 - 1 tokens: refused by the estimate, no overflow.
    RunShape huge = base;
    huge.prompt_len = 2000000000;
    EXPECT_NE(message(estimate_run_memory(m, tp2, huge), 1024).find("GiB"), std::string::npos);
    EXPECT_NE(
        message(estimate_run_memory(m, {{ParallelConfig{}, 2147483647}}, base), 1024).find("KV"),
        std::string::npos);
    EXPECT_GT(available_memory_gib(), 0);
}

// A sharded run checked against the reference passes; a changed token or logit does not; a skipped
// (failed) prompt is not compared.
TEST(ServeVerify, AgainstTheUnshardedModel) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    const auto weights = random_tensor_source(3);
    const auto prompts = make_prompts({.count = 2, .length = 12, .seed = 2}, m.vocab);
    const ParallelConfig p = parse_parallel_config("tp=2,pp=2");
    GenerationOptions opt;
    opt.max_new_tokens = 4;
    GenerationReport r;
    run_threads(p.world_size(), [&](Communicator& world) {
        GenerationReport got = generate(m, p, *weights, prompts, opt, &world);
        if (world.rank() == 0) r = std::move(got);
    });
    const VerifyResult ok = verify_against_reference(m, *weights, prompts, opt.max_new_tokens,
                                                     opt.block_size, r.tokens, r.last_logits);
    EXPECT_TRUE(ok.ok());
    EXPECT_TRUE(ok.tokens_match);
    EXPECT_LE(ok.max_rel_err, kVerifyMaxRelativeL2);

    auto tokens = r.tokens;
    tokens[1][2] = (tokens[1][2] + 1) % m.vocab;
    EXPECT_FALSE(verify_against_reference(m, *weights, prompts, opt.max_new_tokens, opt.block_size,
                                          tokens, r.last_logits)
                     .tokens_match);
    auto logits = r.last_logits;
    for (float& x : logits[0]) x *= 1.01f;
    const VerifyResult off = verify_against_reference(m, *weights, prompts, opt.max_new_tokens,
                                                      opt.block_size, r.tokens, logits);
    EXPECT_FALSE(off.ok());
    EXPECT_GT(off.max_rel_err, kVerifyMaxRelativeL2);
    EXPECT_FALSE(verify_against_reference(m, *weights, prompts, opt.max_new_tokens, opt.block_size,
                                          tokens, logits, {"failed", ""})
                     .tokens_match)
        << "prompt 0 skipped, prompt 1's changed token still counts";
    EXPECT_TRUE(verify_against_reference(m, *weights, prompts, opt.max_new_tokens, opt.block_size,
                                         r.tokens, logits, {"failed", ""})
                    .ok());
    EXPECT_EQ(reference_options(4, 16).block_size, 32);
    EXPECT_EQ(reference_options(4, 32).block_size, 16);
    EXPECT_FALSE(reference_options(4, 16).prefix_cache);
}

// Issue 22: with chunked prefill a prompt's later blocks are written in later steps. Prompts that
// share its prefix, arriving together, must hit only the blocks whose KV a step already wrote or
// writes before their own reads (deferred commit), never a block still waiting for its chunk:
// then every output equals the unsharded run's without a prefix cache. (Before the commit rule the
// second prompt hit all five of the first prompt's blocks at allocation and read four of them
// unwritten in the first step: its tokens and logits differed.)
TEST(ServePrefixCache, ChunkedPrefillNeverSharesBlocksBeforeTheirKvIsWritten) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    const auto weights = random_tensor_source(11);
    const auto base = make_prompts({.count = 2, .length = 40, .seed = 4}, m.vocab);
    std::vector<std::vector<int32_t>> prompts{base[0], base[0], base[0]};
    prompts[1].insert(prompts[1].end(), base[1].begin(), base[1].begin() + 9);  // A + 9 own
    prompts[2].resize(20);                                                      // A's first 20
    prompts[2].insert(prompts[2].end(), base[1].begin(), base[1].begin() + 5);  // + 5 own
    for (const std::string par : {"tp=1", "tp=2", "pp=2", "tp=2,pp=2"})
        for (const int64_t chunk : {int64_t{0}, int64_t{8}, int64_t{12}}) {
            SCOPED_TRACE(par + " chunk " + std::to_string(chunk));
            const ParallelConfig p = parse_parallel_config(par);
            GenerationOptions opt;
            opt.max_new_tokens = 3;
            opt.block_size = 8;
            opt.prefill_chunk_tokens = chunk;
            GenerationReport r;
            run_threads(p.world_size(), [&](Communicator& world) {
                GenerationReport got = generate(m, p, *weights, prompts, opt, &world);
                if (world.rank() == 0) r = std::move(got);
            });
            const VerifyResult v = verify_against_reference(
                m, *weights, prompts, opt.max_new_tokens, opt.block_size, r.tokens, r.last_logits);
            EXPECT_TRUE(v.tokens_match);
            EXPECT_LE(v.max_rel_err, kVerifyMaxRelativeL2);
            // Prompts 1 and 2 still share what was written (or scheduled in the same step) first.
            EXPECT_GT(r.prefix_hit_tokens, 0);
            if (chunk == 0) {
                // One step: every full block of the shared prefix is shared (40 and 16 tokens).
                EXPECT_EQ(r.prefix_hit_tokens, 40 + 16);
            } else {
                // Only the first chunk's blocks were findable when prompts 1, 2 were allocated.
                EXPECT_LT(r.prefix_hit_tokens, 40 + 16);
            }
        }
    // A windowed model (no prefix reuse there): chunked prefill keeps each chunk's windows until
    // the chunk's queries ran, so the output still equals the unsharded run's.
    const ModelSpec swa = catalog_model("tiny-swa");
    for (const std::string par : {"tp=1", "tp=2,pp=2"})
        for (const int64_t chunk : {int64_t{5}, int64_t{16}}) {
            SCOPED_TRACE("tiny-swa " + par + " chunk " + std::to_string(chunk));
            const ParallelConfig p = parse_parallel_config(par);
            GenerationOptions opt;
            opt.max_new_tokens = 3;
            opt.block_size = 4;
            opt.prefill_chunk_tokens = chunk;
            GenerationReport r;
            run_threads(p.world_size(), [&](Communicator& world) {
                GenerationReport got = generate(swa, p, *weights, prompts, opt, &world);
                if (world.rank() == 0) r = std::move(got);
            });
            const VerifyResult v =
                verify_against_reference(swa, *weights, prompts, opt.max_new_tokens, opt.block_size,
                                         r.tokens, r.last_logits);
            EXPECT_TRUE(v.tokens_match);
            EXPECT_LE(v.max_rel_err, kVerifyMaxRelativeL2);
            for (const RankReport& rr : r.ranks) EXPECT_EQ(rr.kv_bytes, rr.kv_bytes_predicted);
        }
    GenerationOptions bad;
    bad.prefill_chunk_tokens = -1;
    EXPECT_THROW(generate(m, ParallelConfig{}, *weights, prompts, bad), Error);
    // The CP executor prefills each prompt in one step: a chunk is refused, naming the option.
    GenerationOptions cp;
    cp.prefill_chunk_tokens = 8;
    try {
        run_threads(2, [&](Communicator& world) {
            generate(m, parse_parallel_config("cp=2"), *weights, prompts, cp, &world);
        });
        ADD_FAILURE() << "chunked prefill under cp=2 was accepted";
    } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find("prefill_chunk_tokens"), std::string::npos)
            << e.what();
    }
}

TEST(ServeOptions, DisaggOptionsValidateThemselves) {
    DisaggOptions o;
    EXPECT_NO_THROW(o.validate());
    EXPECT_EQ(o.transfer.timeout_s, 60.0);
    o.decode_block_size = 0;
    EXPECT_THROW(o.validate(), Error);
    o = DisaggOptions{};
    o.transfer.staging_bytes = 0;
    EXPECT_THROW(o.validate(), Error);
    o = DisaggOptions{};
    o.transfer.sender_idle_sleep_us = -1;
    EXPECT_THROW(o.validate(), Error);
    o = DisaggOptions{};
    o.max_new_tokens = 0;
    EXPECT_THROW(o.validate(), Error);
}

}  // namespace
}  // namespace kvshard
