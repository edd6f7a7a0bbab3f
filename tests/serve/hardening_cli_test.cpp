// `kvshard run`, cp-plan and transfer-plan on inputs that used to be accepted and ignored, wrapped
// or crashed: each refused with a message that names the problem, or reported.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "cli_runner.h"

namespace {

kvshard::test::CliResult kvshard(const std::string& args) { return kvshard::test::run_cli(args); }

void expect_refused(const std::string& args, const std::string& needle) {
    const auto r = kvshard(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find("kvshard: error: "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << "\n" << r.out;
}

TEST(Hardening, RefusedInsteadOfIgnoredOrWrapped) {
    // EP under CP: the executor replicated the experts while the table printed them split.
    expect_refused("run --model tiny-moe --cp 2 --ep 2 --gen 2",
                   "expert parallelism under CP is not executed");
    // --seed -1 became 2^64 - 1.
    expect_refused("run --model tiny --seed -1 --gen 2",
                   "--seed must be in [0, 9223372036854775807]");
    // cp-plan planned on an overflowed total; transfer-plan crashed (SIGSEGV).
    expect_refused("cp-plan --model tiny --cp 2 --cached 9223372036854775807",
                   "longer than 2^40 tokens");
    expect_refused("cp-plan --model tiny --cp 2 --cached 9223372036854775000 --new 1000",
                   "longer than 2^40 tokens");
    expect_refused("transfer-plan --model tiny --from tp=1 --to tp=2 --tokens 9223372036854775807",
                   "kvshard plans transfers of [1, 2^26] tokens");
    // rms_norm_eps < 0 gave NaN logits that --verify passed.
    const std::string cfg = testing::TempDir() + "neg_eps_config.json";
    FILE* f = std::fopen(cfg.c_str(), "w");
    std::fputs(R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100, "rms_norm_eps": -1.0})",
               f);
    std::fclose(f);
    expect_refused("run --model " + cfg + " --gen 2 --verify",
                   "rms_norm_eps must be a positive finite number");
}

TEST(Hardening, CpPrefixCacheOffIsReported) {
    const auto off = kvshard(
        "run --model tiny --cp 2 --gen 2 --prompts 2 --shared-prefix 16 --prompt-len 32 --json");
    ASSERT_EQ(off.status, 0) << off.out;
    const auto j = nlohmann::json::parse(off.out);
    EXPECT_FALSE(j.at("prefix_cache").at("on").get<bool>());
    EXPECT_NE(j.at("prefix_cache").at("note").get<std::string>().find("--cp-interleave 16"),
              std::string::npos);
    const auto on = kvshard(
        "run --model tiny --cp 2 --cp-scheme interleave --cp-interleave 16 --gen 2 --prompts 2 "
        "--shared-prefix 16 --prompt-len 32 --json");
    ASSERT_EQ(on.status, 0) << on.out;
    const auto k = nlohmann::json::parse(on.out);
    EXPECT_TRUE(k.at("prefix_cache").at("on").get<bool>());
    EXPECT_EQ(k.at("prefix_cache").at("hit_tokens").get<int64_t>(), 16);
    const auto text =
        kvshard("run --model tiny --cp 2 --gen 2 --prompts 2 --shared-prefix 16 --prompt-len 32");
    EXPECT_NE(text.out.find("note: the prefix cache is off"), std::string::npos) << text.out;
}

}  // namespace
