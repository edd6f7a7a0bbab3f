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
    // DP under CP: one CP session serves one replica.
    expect_refused("run --model tiny --cp 2 --dp 2 --gen 2",
                   "the context-parallel executor serves one replica");
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

// The disaggregated run's own flags did nothing (and took any value) without --prefill/--decode.
TEST(Hardening, DisaggFlagsNeedADisaggregatedRun) {
    for (const char* flag :
         {"--staging-mib 5", "--staging-mib 0", "--decode-block-size 8", "--prefill-order nhd",
          "--decode-order nhd", "--transfer-mode pre-send", "--no-stream", "--sender-sleep-us 5",
          "--check-thread-bytes 0", "--direct-read off", "--direct-window 4",
          "--source-checksums off", "--prefill-replicas 2", "--decode-replicas 2",
          "--prefill-route least-tokens"}) {
        const std::string name = std::string(flag).substr(0, std::string(flag).find(' '));
        expect_refused(std::string("run --model tiny --gen 2 ") + flag,
                       name + " applies to a disaggregated run only");
    }
    const auto ok =
        kvshard("run --model tiny --gen 2 --prefill tp=2 --decode tp=1 --staging-mib 5");
    EXPECT_EQ(ok.status, 0) << ok.out;
}

// Under a CP scheme whose ranks do not hold whole hashed blocks the prefix cache cannot hit: asked
// for hits (--shared-prefix) the run is refused; otherwise it runs and says the cache is off.
TEST(Hardening, CpPrefixCacheOffIsReported) {
    expect_refused("run --model tiny --cp 2 --gen 2 --prompts 2 --shared-prefix 16 --prompt-len 32",
                   "--shared-prefix 16 asks for prefix-cache hits, but the prefix cache is off");
    EXPECT_EQ(kvshard("run --model tiny --cp 2 --gen 2 --prompts 2 --shared-prefix 16 "
                      "--prompt-len 32 --no-prefix-cache")
                  .status,
              0);
    const auto off = kvshard("run --model tiny --cp 2 --gen 2 --prompts 2 --prompt-len 32 --json");
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
    const auto text = kvshard("run --model tiny --cp 2 --gen 2 --prompts 2 --prompt-len 32");
    EXPECT_NE(text.out.find("note: the prefix cache is off"), std::string::npos) << text.out;
}

// Several prefill and decode groups: the number of groups given twice and disagreeing, an unknown
// route and a CP side with dp > 1 are refused; a run reports each request's groups in --json.
TEST(Hardening, DisaggReplicaFlags) {
    expect_refused("run --model tiny --prefill dp=2,tp=2 --prefill-replicas 3 --decode tp=1",
                   "--prefill 'dp=2,tp=2' names dp=2 but --prefill-replicas says 3");
    expect_refused("run --model tiny --prefill tp=1 --decode tp=1 --decode-replicas -1",
                   "--decode-replicas must be between 1 and 4096 groups, got -1");
    expect_refused("run --model tiny --prefill dp=2 --decode tp=1 --prefill-route random",
                   "--prefill-route must be round-robin");
    expect_refused("run --model tiny --prefill dp=2,cp=2 --decode tp=1",
                   "a disaggregated side with cp > 1 serves one replica");
    const auto r = kvshard(
        "run --model tiny --prefill tp=2 --prefill-replicas 2 --decode-replicas 2 --decode tp=1 "
        "--prompts 3 --prompt-len 12 --gen 3 --verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("prefill_replica").get<std::vector<int>>(), (std::vector<int>{0, 1, 0}));
    EXPECT_EQ(j.at("decode_replica").get<std::vector<int>>(), (std::vector<int>{0, 1, 0}));
    EXPECT_EQ(j.at("prefill_route").get<std::string>(), "round-robin");
    EXPECT_EQ(j.at("prefill").at("ranks").get<int>(), 4);
}

// --cp-prefill and --cp-decode-merge did nothing (with any valid mode) on a run without a
// context-parallel group.
TEST(Hardening, CpFlagsNeedAContextParallelGroup) {
    expect_refused("run --model tiny --gen 2 --cp-prefill pass-q",
                   "--cp-prefill chooses how a context-parallel group prefills; this run has none");
    expect_refused("run --model tiny --gen 2 --cp-decode-merge all-to-all",
                   "--cp-decode-merge chooses how a context-parallel group merges");
    expect_refused("run --model tiny --gen 2 --prefill tp=1 --decode cp=2 --cp-prefill pass-q",
                   "--cp-prefill chooses");
    expect_refused(
        "run --model tiny --gen 2 --prefill cp=2 --decode tp=1 --cp-decode-merge all-to-all",
        "--cp-decode-merge chooses");
    EXPECT_EQ(kvshard("run --model tiny --gen 2 --cp 2 --cp-prefill pass-q").status, 0);
}

// The memory a run would hold is estimated and refused before anything is allocated: an 8B model's
// fp32 weights, a 2e9-token prompt, 1e8 prompts, a 2^31-1-token block; and the limit's own range.
TEST(Hardening, RunMemoryCheckedBeforeAllocating) {
    expect_refused(
        "run --model llama-3.1-8b --prompts 1 --prompt-len 8 --gen 1 --max-memory-gib 20",
        "weights 29.92 GiB");
    expect_refused("run --model tiny --prompt-len 2000000000 --max-memory-gib 64",
                   "more than --max-memory-gib 64.00");
    expect_refused("run --model tiny --prompts 100000000 --prompt-len 2000000000",
                   "lower --prompts, --prompt-len, --gen or --block-size");
    expect_refused("run --model tiny --block-size 2147483647", "--block-size must be in [1, 2^20]");
    expect_refused("run --model tiny --prefill tp=2 --decode tp=1 --prompt-len 2000000000",
                   "over 3 rank(s)");
    expect_refused("run --model tiny --max-memory-gib nan", "--max-memory-gib must be a finite");
    expect_refused("run --model tiny --max-memory-gib 0", "--max-memory-gib must be a finite");
    // The unsharded --verify run is part of the estimate.
    expect_refused("run --model tiny --tp 2 --verify --max-memory-gib 0.0001",
                   "the unsharded --verify run");
    EXPECT_EQ(kvshard("run --model tiny --gen 2 --max-memory-gib 1").status, 0);
    // The groups of --prefill-replicas / --decode-replicas count: 64 prefill groups of
    // small-100m were estimated as one and ran out of memory (std::bad_alloc at 7 GB).
    expect_refused(
        "run --model tiny --prefill tp=1 --decode tp=1 --prefill-replicas 256 --prompt-len 4 "
        "--gen 1 --max-memory-gib 0.1",
        "over 257 rank(s)");
    expect_refused(
        "run --model tiny --prefill tp=1 --decode tp=1 --decode-replicas 256 --prompt-len 4 "
        "--gen 1 --max-memory-gib 0.1",
        "over 257 rank(s)");
}

}  // namespace
