// serve/: the library side of `kvshard run` (prompts, weights, the memory check, the check against
// the unsharded model, the options' own validation).
#include <gtest/gtest.h>

#include "kvshard/comm/threads.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/model/catalog.h"
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

TEST(ServeInputs, WeightsAndMemory) {
    const WeightChoice w = choose_weights("tiny", 7);  // no checkpoint directory: random weights
    EXPECT_EQ(w.description, "seed 7");
    ASSERT_NE(w.source, nullptr);
    const ModelSpec m = catalog_model("tiny");
    EXPECT_NO_THROW(check_kv_fits(m, {{1, 2, 3}}, 4));
    try {
        check_kv_fits(m, {{1}}, 2147483647);
        FAIL() << "more KV than any machine's memory";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("lower --gen, --prompt-len or --prompts"),
                  std::string::npos);
    }
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
