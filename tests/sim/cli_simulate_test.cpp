// kvshard simulate end to end: JSON fields, errors with exit code 2.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace {

struct Result {
    int code = -1;
    std::string out, err;
};

std::string slurp(const std::string& path) {
    std::ifstream f(path);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
}

Result run_cli(const std::string& args) {
    const std::string base = testing::TempDir() + "kvshard_sim_cli_" +
                             testing::UnitTest::GetInstance()->current_test_info()->name();
    const std::string cmd =
        std::string(KVSHARD_CLI_PATH) + " " + args + " >" + base + ".out 2>" + base + ".err";
    const int status = std::system(cmd.c_str());
    Result r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(base + ".out");
    r.err = slurp(base + ".err");
    return r;
}

const std::string kSample =
    std::string(KVSHARD_TEST_DATA_DIR) + "/mooncake_conversation_head300.jsonl";

TEST(CliSimulate, JsonReportsEveryPolicyAndBothBounds) {
    const Result r =
        run_cli("simulate --trace " + kSample +
                " --replicas 4 --model llama-3.1-70b --hardware h100-sxm --tp 8 --json --svg " +
                testing::TempDir() + "kvshard_sim.svg");
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_NEAR(j["infinite_cache_token_hit_rate"].get<double>(), 345966.0 / 4269971.0, 1e-12);
    EXPECT_GT(j["pooled_lru_token_hit_rate"].get<double>(), 0.0);
    ASSERT_EQ(j["policies"].size(), 5u);
    for (const auto& p : j["policies"]) {
        for (const char* k :
             {"name", "token_hit_rate", "load_max_over_mean", "ttft_p50_s", "ttft_p99_s"})
            EXPECT_TRUE(p.contains(k)) << k;
        EXPECT_GT(p["ttft_p50_s"].get<double>(), 0.0);
        EXPECT_LE(p["ttft_p50_s"].get<double>(), p["ttft_p99_s"].get<double>());
        EXPECT_EQ(p["completed"].get<int64_t>(), 300);
    }
    EXPECT_NE(slurp(testing::TempDir() + "kvshard_sim.svg").find("</svg>"), std::string::npos);
}

// --eagle-block-drop: vLLM engines drafting with EAGLE/MTP recompute the last matched block of
// each prefix hit, so every cache-aware hit rate (and the pooled LRU bound) falls; the infinite
// cache bound is the trace's own and stays.
TEST(CliSimulate, TheEagleBlockDropLowersTheHitRates) {
    const std::string args = "simulate --trace " + kSample +
                             " --replicas 2 --model llama-3.1-70b --hardware h100-sxm --tp 8 "
                             "--policy cache-aware --json";
    const Result plain = run_cli(args);
    const Result eagle = run_cli(args + " --eagle-block-drop");
    ASSERT_EQ(plain.code, 0) << plain.err;
    ASSERT_EQ(eagle.code, 0) << eagle.err;
    const auto p = nlohmann::json::parse(plain.out);
    const auto e = nlohmann::json::parse(eagle.out);
    EXPECT_EQ(p["infinite_cache_token_hit_rate"], e["infinite_cache_token_hit_rate"]);
    EXPECT_LT(e["pooled_lru_token_hit_rate"].get<double>(),
              p["pooled_lru_token_hit_rate"].get<double>());
    EXPECT_LT(e["policies"][0]["token_hit_rate"].get<double>(),
              p["policies"][0]["token_hit_rate"].get<double>());
    EXPECT_GT(e["policies"][0]["token_hit_rate"].get<double>(), 0.0);
    EXPECT_NE(e["setup"].get<std::string>().find("EAGLE block drop"), std::string::npos);
    EXPECT_EQ(p["setup"].get<std::string>().find("EAGLE"), std::string::npos);
}

TEST(CliSimulate, MalformedLineFailsWithItsNumberOrIsSkipped) {
    const std::string bad = testing::TempDir() + "kvshard_bad_trace.jsonl";
    {
        std::ofstream f(bad);
        f << "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1, "
             "2]}\n"
          << "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1]}\n"
          << "{\"timestamp\": 9, \"input_length\": 700, \"output_length\": 3, \"hash_ids\": [1, "
             "3]}\n";
    }
    const std::string common =
        "simulate --trace " + bad + " --replicas 2 --capacity-tokens 65536 --policy kvshard";
    Result r = run_cli(common);
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.err.find("kvshard: error:"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(bad + ":2:"), std::string::npos) << r.err;
    r = run_cli(common + " --on-error skip --json");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_NE(r.err.find(":2: skipped"), std::string::npos) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["requests"].get<int>(), 2);
    EXPECT_EQ(j["skipped_lines"].get<int>(), 1);
}

TEST(CliSimulate, BadFlagsExitWithTwo) {
    EXPECT_EQ(
        run_cli("simulate --trace " + kSample + " --policy random --capacity-tokens 65536").code,
        2);
    EXPECT_EQ(run_cli("simulate --trace /nonexistent.jsonl --capacity-tokens 65536").code, 2);
    EXPECT_EQ(run_cli("simulate --trace " + kSample + " --replicas 0 --capacity-tokens 65536").code,
              2);
    EXPECT_EQ(
        run_cli("simulate --trace " + kSample + " --on-error maybe --capacity-tokens 65536").code,
        2);
    const Result help = run_cli("simulate --help");
    EXPECT_EQ(help.code, 0);
    EXPECT_NE(help.out.find("--policy"), std::string::npos);
}

// --ttl sets the approximate index's TTL; with the exact index it did nothing and took any value
// (nan, -1).
TEST(CliSimulate, TtlNeedsTheApproximateIndex) {
    for (const char* ttl : {"nan", "-1", "60"}) {
        const Result r =
            run_cli("simulate --trace " + kSample + " --capacity-tokens 65536 --ttl " + ttl);
        EXPECT_EQ(r.code, 2) << ttl << "\n" << r.err;
        EXPECT_NE(r.err.find("give --index approximate or drop --ttl"), std::string::npos) << r.err;
        EXPECT_EQ(r.out, "");
    }
    const Result ok = run_cli("simulate --trace " + kSample +
                              " --capacity-tokens 65536 --max-requests 20 --policy round-robin "
                              "--index approximate --ttl 60");
    EXPECT_EQ(ok.code, 0) << ok.err;
}

}  // namespace
