// `kvshard run --cp ...` end to end on the threads backend (the MPI one: tests/multi_rank).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include "cli_runner.h"

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

namespace {

using Result = kvshard::test::CliResult;
using kvshard::test::run_cli;

TEST(CpCli, RunCp4ZigzagVerifies) {
    const Result r = run_cli(
        "run --model tiny --cp 4 --cp-scheme zigzag --prompt-len 40 --gen 32 --verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_TRUE(j["verify"]["tokens_match"].get<bool>());
    EXPECT_LT(j["verify"]["max_rel_err"].get<double>(), 1e-4);
    ASSERT_EQ(j["ranks"].size(), 4u);
    int64_t tokens = 0;
    for (const auto& rk : j["ranks"]) {
        EXPECT_EQ(rk["kv_bytes"], rk["kv_bytes_predicted"]);
        tokens += rk["kv_tokens"].get<int64_t>();
    }
    EXPECT_EQ(tokens, 40 + 31);  // every token stored once, on one CP rank
}

TEST(CpCli, RunCp2Tp2InterleaveWithPrefixCacheAndHelixMergeVerifies) {
    const Result r = run_cli(
        "run --model tiny --cp 2 --tp 2 --cp-scheme interleave --cp-interleave 4 --block-size 4 "
        "--prompts 3 --shared-prefix 16 --prompt-len 30 --gen 8 --cp-decode-merge all-to-all "
        "--cp-prefill pass-q --verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_TRUE(j["verify"]["tokens_match"].get<bool>());
    EXPECT_EQ(j["prefix_cache"]["hit_tokens"].get<int64_t>(), 32);  // prompts 1, 2: 4 blocks each
}

TEST(CpCli, BadCpFlagsExitTwo) {
    for (const char* args :
         {"run --model tiny --cp 2 --cp-prefill ring",
          "run --model tiny --cp 2 --cp-decode-merge tree", "run --model tiny --cp 2 --dp 2"}) {
        const Result r = run_cli(args);
        EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
        EXPECT_NE(r.out.find("kvshard: error:"), std::string::npos) << r.out;
    }
}

}  // namespace

namespace {
TEST(CpPlanCli, JsonChoiceBytesAndReuse) {
    const Result r = run_cli(
        "cp-plan --model llama-3.1-70b --tp 8 --cp 4 --cp-scheme interleave --cp-interleave 16 "
        "--cached 128000 --new 1000 --reuse-from 8 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["choice"]["mode"], "pass-q");
    EXPECT_LT(j["choice"]["pass_q_bytes"].get<int64_t>(),
              j["choice"]["pass_kv_bytes"].get<int64_t>());
    ASSERT_EQ(j["ranks"].size(), 32u);
    int64_t kv = 0, q = 0, tokens = 0;
    for (const auto& rk : j["ranks"]) {
        kv += rk["pass_kv_bytes"].get<int64_t>();
        q += rk["pass_q_ring_bytes"].get<int64_t>() + rk["pass_q_all_to_all_bytes"].get<int64_t>();
        if (rk["tp"] == 0) tokens += rk["tokens"].get<int64_t>();
    }
    EXPECT_EQ(kv, j["choice"]["pass_kv_bytes"].get<int64_t>());
    EXPECT_EQ(q, j["choice"]["pass_q_bytes"].get<int64_t>());
    EXPECT_EQ(j["choice"]["rule_mode"], "pass-q");
    EXPECT_GE(j["choice"]["rule_pass_q_bytes"].get<int64_t>(), q);
    EXPECT_EQ(tokens, 129000);
    EXPECT_EQ(j["reuse"]["blocks"], 8000);
    EXPECT_EQ(j["reuse"]["kept"], 4000);  // blocks b with b % 8 == b % 4
}

// Where the windows make Meta's rule and the exact bytes disagree, the plan takes the fewer bytes
// and prints both (docs/context-parallel.md section 4).
TEST(CpPlanCli, ChoiceFollowsTheExactBytesUnderWindows) {
    const Result r =
        run_cli("cp-plan --model tiny-swa --cp 4 --cp-scheme contiguous --cached 64 --new 40");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("prefill: pass-kv, the fewer bytes: all ranks move 212992 B pass-KV, "
                         "215040 B pass-Q"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("Meta's rule: new fraction 0.3846 < threshold 0.4706, pass-q"),
              std::string::npos)
        << r.out;
}

TEST(CpPlanCli, FullPrefillPassesKvAndBadInputExitsTwo) {
    const Result r = run_cli("cp-plan --model tiny --cp 2 --new 64");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("prefill: pass-kv"), std::string::npos) << r.out;
    for (const char* args :
         {"cp-plan --model tiny --cp 2 --new 0", "cp-plan --model tiny --cp 2 --cached -1",
          "cp-plan --model tiny --cp 2 --reuse-from -2"}) {
        const Result e = run_cli(args);
        EXPECT_EQ(e.status, 2) << args << "\n" << e.out;
        EXPECT_NE(e.out.find("kvshard: error:"), std::string::npos) << e.out;
    }
}

// Long requests: 2^31 new tokens counted the causal pairs token by token (minutes, then
// std::bad_alloc); 2^40 overflowed them; a reuse plan of 2^36 blocks listed each block's move.
// --block-size without --reuse-from did nothing.
TEST(CpPlanCli, LongRequestsArePlannedOrRefusedWithTheirLimit) {
    const Result r = run_cli("cp-plan --model tiny --cp 2 --new 2147483648 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    int64_t pairs = 0;
    for (const auto& rank : j.at("ranks")) pairs += rank.at("causal_pairs").get<int64_t>();
    const int64_t n = int64_t{1} << 31;
    EXPECT_EQ(pairs, n / 2 * (n + 1));  // n(n+1)/2
    for (const auto& [args, needle] :
         {std::pair{"cp-plan --model tiny --cp 2 --new 1099511627776", "exceed 2^63 - 1"},
          {"cp-plan --model tiny --cp 2 --cached 1099511627775 --new 1 --reuse-from 1",
           "more than the 1048576 kvshard lists"},
          {"cp-plan --model tiny --cp 2 --cached 64 --reuse-from 2147483647",
           "must be in [1, 1048576]"},
          {"cp-plan --model tiny --cp 2 --block-size 8", "--block-size requires --reuse-from"}}) {
        const Result e = run_cli(args);
        EXPECT_EQ(e.status, 2) << args << "\n" << e.out;
        EXPECT_NE(e.out.find(needle), std::string::npos) << args << "\n" << e.out;
    }
}
}  // namespace
