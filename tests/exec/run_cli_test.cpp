// `kvshard run` end to end: JSON fields, verification, per-rank KV bytes, .npy dump, and errors.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include "cli_runner.h"

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

using Result = kvshard::test::CliResult;
using kvshard::test::run_cli;

TEST(RunCli, JsonReportsVerifyAndKvBytesPerRank) {
    const Result r = run_cli(
        "run --model tiny-moe --tp 2 --pp 2 --ep 2 --prompts 3 --prompt-len 20 --shared-prefix 16 "
        "--gen 8 "
        "--block-size 4 --verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_TRUE(j["verify"]["tokens_match"].get<bool>());
    EXPECT_LT(j["verify"]["max_rel_err"].get<double>(), 1e-4);
    ASSERT_EQ(j["ranks"].size(), 4u);
    for (const auto& rk : j["ranks"]) {
        EXPECT_GT(rk["kv_bytes"].get<int64_t>(), 0);
        EXPECT_EQ(rk["kv_bytes"], rk["kv_bytes_predicted"]);
    }
    // Prompts 1 and 2 find the 16 shared tokens (4 full blocks) in the cache.
    EXPECT_EQ(j["prefix_cache"]["hit_tokens"].get<int64_t>(), 32);
    ASSERT_EQ(j["tokens"].size(), 3u);
    EXPECT_EQ(j["tokens"][0].size(), 8u);
}

// Pass-Q under windowed layers at cp = 4 with shards that are not mirror-symmetric (contiguous,
// interleaved): the ring must run the steps that pair each query with the previous shard's keys
// (cp_pass_q_window_ring_steps). Before that fix these runs failed --verify (relative L2 2.5e-2).
TEST(RunCli, PassQUnderWindowsEqualsUnshardedForEveryScheme) {
    // (Chunked layers: CpRing.WindowedPrefillEqualsUnshardedAndReturnsOnlyPartialsThatSeeKeys.)
    for (const char* scheme : {"contiguous", "interleave --cp-interleave 4", "zigzag"}) {
        const std::string args = std::string("run --model tiny-swa") +
                                 " --cp 4 --cp-prefill pass-q --cp-scheme " + scheme +
                                 " --prompt-len 64 --gen 4 --verify --json";
        const Result r = run_cli(args);
        ASSERT_EQ(r.status, 0) << args << "\n" << r.out;
        const auto j = nlohmann::json::parse(r.out);
        EXPECT_TRUE(j["verify"]["tokens_match"].get<bool>()) << args;
        EXPECT_LT(j["verify"]["max_rel_err"].get<double>(), 1e-4) << args;
    }
}

TEST(RunCli, DumpLogitsWritesNpy) {
    const auto path = std::filesystem::temp_directory_path() /
                      ("kvshard_logits_" + std::to_string(getpid()) + ".npy");
    const Result r =
        run_cli("run --model tiny --dp 2 --prompts 2 --prompt-len 5 --gen 3 --dump-logits " +
                path.string());
    ASSERT_EQ(r.status, 0) << r.out;
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_GE(bytes.size(), 10u);
    EXPECT_EQ(bytes.substr(0, 6), "\x93NUMPY");
    const size_t header_len = size_t(uint8_t(bytes[8])) | (size_t(uint8_t(bytes[9])) << 8);
    EXPECT_EQ((10 + header_len) % 64, 0u);
    const std::string header = bytes.substr(10, header_len);
    EXPECT_NE(header.find("'descr': '<f4'"), std::string::npos) << header;
    EXPECT_NE(header.find("'shape': (2, 256)"), std::string::npos) << header;
    EXPECT_EQ(bytes.size(), 10 + header_len + 2 * 256 * 4);
    std::filesystem::remove(path);
}

// `args` exits 2 and its output says `message` (empty: only the exit status is checked).
void expect_refused(const std::string& args, const std::string& message) {
    const Result r = run_cli(args);
    EXPECT_EQ(r.status, 2) << args;
    if (!message.empty()) {
        EXPECT_NE(r.out.find(message), std::string::npos) << r.out;
    }
}

TEST(RunCli, BadInputExitsTwoWithAMessage) {
    expect_refused("run --model tiny --tp 3", "valid tp sizes are 1, 2, 4, 8");
    expect_refused("run --model tiny --ep 2", "kvshard: error:");
    expect_refused("run --model tiny --prompt-ids 1,300", "outside the vocabulary");
    expect_refused("run --model tiny --prompt-len 4 --shared-prefix 5", "");
    // More KV than the machine has memory: refused up front, naming the flags to lower.
    expect_refused("run --model tiny --prompt-len 1 --gen 2147483647",
                   "lower --prompts, --prompt-len, --gen or --block-size");
    const std::string disagg = "run --model tiny --prefill tp=1 --decode tp=1 ";
    expect_refused(disagg + "--staging-mib 9000000000000", "--staging-mib must be between 1 and");
    expect_refused(disagg + "--sender-sleep-us -5",
                   "--sender-sleep-us must be between 0 (spin) and");
    expect_refused(disagg + "--check-thread-bytes -2", "--check-thread-bytes must be -1 (never)");
    expect_refused(disagg + "--direct-read maybe",
                   "--direct-read must be on, rma or off, got 'maybe'");
    expect_refused(disagg + "--direct-window -1", "--direct-window must be between 0 (no bound)");
}

}  // namespace

namespace {

// Replicas without prompts still take part in every step (the EP all-to-alls span the replicas).
TEST(RunCli, ReplicasWithoutPromptsKeepStep) {
    const Result r =
        run_cli("run --model tiny-moe --dp 4 --ep 4 --prompts 2 --gen 6 --verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_TRUE(j["verify"]["tokens_match"].get<bool>());
    int empty = 0;
    for (const auto& rk : j["ranks"]) empty += rk["kv_tokens"].get<int64_t>() == 0;
    EXPECT_EQ(empty, 2);
}

}  // namespace

// --route: the router assigns prompts to DP replicas over its prefix index, so prompts that share
// a prefix meet on one replica and hit its prefix cache; round robin spreads them. Same tokens.
TEST(RunCli, RouteFollowsSharedPrefixesAcrossReplicas) {
    const std::string base =
        "run --model tiny --dp 2 --prompts 4 --prompt-len 40 --shared-prefix 32 --gen 3 --verify "
        "--json --route ";
    const Result rr = run_cli(base + "round-robin");
    const Result kv = run_cli(base + "kvshard");
    ASSERT_EQ(rr.status, 0) << rr.out;
    ASSERT_EQ(kv.status, 0) << kv.out;
    const auto a = nlohmann::json::parse(rr.out), b = nlohmann::json::parse(kv.out);
    EXPECT_TRUE(b["verify"]["tokens_match"].get<bool>());
    EXPECT_EQ(a["tokens"], b["tokens"]);
    const auto hits = [](const nlohmann::json& j) {
        return j["prefix_cache"]["hit_tokens"].get<int64_t>();
    };
    // Round robin: one miss per replica (2 of 4 prompts hit); routed: 3 of 4 hit.
    EXPECT_EQ(hits(a), 2 * 32);
    EXPECT_EQ(hits(b), 3 * 32);
    EXPECT_EQ(b["routing"]["replica_of"].size(), 4u);
    const Result refused = run_cli("run --model tiny --prompts 2 --gen 2 --route kvshard");
    EXPECT_EQ(refused.status, 2);
    EXPECT_NE(refused.out.find("--route kvshard chooses among DP replicas"), std::string::npos)
        << refused.out;
}
