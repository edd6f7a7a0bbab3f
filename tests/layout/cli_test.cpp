// The CLI on bad input: "kvshard: error: ..." on stderr and exit status 2, never a crash.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include "cli_runner.h"

#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace {

using Result = kvshard::test::CliResult;
Result kvshard(const std::string& args) { return kvshard::test::run_cli(args); }

std::string temp_file(const std::string& name, const std::string& text) {
    const std::string path = testing::TempDir() + name;
    std::ofstream(path) << text;
    return path;
}

void expect_usage_error(const std::string& args, const std::string& needle) {
    const Result r = kvshard(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find("kvshard: error: "), std::string::npos) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << "\n" << r.out;
}

TEST(CliErrors, LayoutValidationPaths) {
    expect_usage_error("layout --model llama-3.1-70b --tp 3",
                       "tp=3 does not divide the 64 query heads");
    expect_usage_error("layout --model llama-3.1-70b --tp 12",
                       "valid tp sizes are 1, 2, 4, 8, 16, 32, 64");
    expect_usage_error("layout --model llama-3.1-8b --pp 40", "pp=40 is larger than the 32 layers");
    expect_usage_error("layout --model llama-3.1-8b --pp 2 --pp-layers 10,10",
                       "pp_layers sums to 20");
    expect_usage_error("layout --model llama-3.1-8b --pp 2 --pp-layers 32",
                       "pp_layers lists 1 stages");
    expect_usage_error("layout --model llama-3.1-8b --tp 4 --dp 2 --ep 8", "dense model");
    expect_usage_error("layout --model mixtral-8x7b --dp 3 --ep 3",
                       "ep=3 does not divide the 8 experts");
    expect_usage_error("layout --model mixtral-8x7b --tp 4 --ep 8", "ep must divide dp*cp*tp");
    expect_usage_error("layout --model llama-3.1-70b --tp 8 --pp 2 --gpus 8",
                       "but 8 GPUs were given");
    expect_usage_error("layout --model llama-3.1-70b --tp 0",
                       "--tp must be in [1, 1048576], got 0");
    expect_usage_error("layout --model llama-3.1-70b --dp -2",
                       "--dp must be in [1, 1048576], got -2");
    expect_usage_error("layout --model llama-3.1-70b --cp 2 --cp-scheme spiral",
                       "unknown CP scheme 'spiral'");
    expect_usage_error(
        "layout --model llama-3.1-70b --cp 2 --cp-scheme interleave --cp-interleave 0",
        "cp_interleave must be a positive integer");
    expect_usage_error("layout --model llama-3.1-70b --kv-dtype fp7", "fp7");
    expect_usage_error("layout --model no-such-model", "unknown model 'no-such-model'");
    expect_usage_error("layout --model llama-3.1-70b --tp eight", "eight");
    expect_usage_error("layout --tp 8", "--model");
    expect_usage_error("layout --model llama-3.1-70b --gpus 0",
                       "GPU count must be a positive integer");
}

TEST(CliErrors, ModelFiles) {
    const auto missing = temp_file("kvshard_cli_missing.json", R"({"hidden_size": 4096})");
    expect_usage_error("models --model " + missing, "missing field 'num_hidden_layers'");
    const auto broken = temp_file("kvshard_cli_broken.json", "{not json");
    expect_usage_error("layout --model " + broken, "not valid JSON");
    const auto mistyped =
        temp_file("kvshard_cli_mistyped.json",
                  R"({"num_hidden_layers": "32", "hidden_size": 4096, "num_attention_heads": 32,
                                       "intermediate_size": 11008, "vocab_size": 32000})");
    expect_usage_error("layout --model " + mistyped,
                       "'num_hidden_layers' must be a positive integer");
}

TEST(CliErrors, PlanPaths) {
    const std::string base = "plan --model llama-3.1-8b --hardware h100-sxm ";
    expect_usage_error(base + "--gpus 0 --context 1024",
                       "GPU count must be an integer in [1, 1048576]");
    expect_usage_error(base + "--gpus 8 --context 0", "context must be in [1, 2^40] tokens");
    expect_usage_error(base + "--gpus 8 --context 1024 --batch -3", "batch must be >= 0");
    expect_usage_error(base + "--gpus 8 --context 1024 --objective cost",
                       "unknown objective 'cost'");
    expect_usage_error(base + "--gpus 8 --context 1024 --mem-util 1.5",
                       "mem_util must be in (0, 1]");
    expect_usage_error(base + "--gpus 8 --context 1024 --block-size 0",
                       "block_size must be an integer in [1, 2^20] tokens");
    expect_usage_error(base + "--gpus 8 --context 1024 --cp-prefill ring",
                       "unknown CP prefill scheme 'ring'");
    expect_usage_error(base + "--context 1024", "--gpus");
    expect_usage_error("plan --model llama-3.1-8b --hardware tpu-v9 --gpus 8 --context 1024",
                       "unknown hardware 'tpu-v9'");
    const auto hw =
        temp_file("kvshard_cli_hw.json", R"({"base": "h100-sxm", "hbm_eficiency": 0.7})");
    expect_usage_error("plan --model llama-3.1-8b --hardware " + hw + " --gpus 8 --context 1024",
                       "unknown field 'hbm_eficiency'");
}

TEST(Cli, HelpOnEveryCommand) {
    for (const char* cmd : {"layout", "plan", "models"}) {
        const Result r = kvshard(std::string(cmd) + " --help");
        EXPECT_EQ(r.status, 0) << cmd;
        EXPECT_NE(r.out.find("--json"), std::string::npos) << cmd << "\n" << r.out;
    }
}

TEST(Cli, LayoutJson) {
    const Result r = kvshard("layout --model llama-3.1-70b --tp 8 --pp 2 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["world_size"], 16);
    ASSERT_EQ(j["ranks"].size(), 16u);
    EXPECT_EQ(j["ranks"][9]["kv_heads"], nlohmann::json::array({1}));
    EXPECT_EQ(j["ranks"][9]["layers"], nlohmann::json::array({40, 80}));
    EXPECT_EQ(j["ranks"][9]["kv_bytes_per_token"], 40 * 2 * 128 * 2);
    for (const char* k : {"rank", "dp", "pp", "cp", "tp"})
        EXPECT_TRUE(j["ranks"][0].contains(k)) << k;
}

TEST(Cli, PlanMustShowJsonAndSvg) {
    const std::string svg = testing::TempDir() + "kvshard_cli_plan.svg";
    const Result r = kvshard(
        "plan --model llama-3.1-405b --hardware h100-sxm --gpus 16 --context 131072 --json --svg " +
        svg);
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    ASSERT_FALSE(j["configs"].empty());
    EXPECT_TRUE(j["configs"][0]["fits"].get<bool>());
    EXPECT_GE(j["configs"][0]["max_context"].get<int64_t>(), 131072);
    std::ifstream in(svg);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text.rfind("<svg", 0), 0u);
    std::remove(svg.c_str());
    // The table form prints a ranked table.
    const Result t =
        kvshard("plan --model llama-3.1-405b --hardware h100-sxm --gpus 16 --context 131072");
    ASSERT_EQ(t.status, 0) << t.out;
    EXPECT_NE(t.out.find("configurations fit"), std::string::npos);
}

}  // namespace

namespace {

TEST(Cli, PlanHardwareFromJsonFile) {
    // 40 GiB A100s: llama-3.1-70b no longer fits on 2 GPUs.
    const auto hw = temp_file("kvshard_cli_a100_40g.json",
                              R"({"base": "a100-80g", "name": "a100-40g", "memory_gib": 40})");
    const Result small =
        kvshard("plan --model llama-3.1-70b --gpus 2 --context 4096 --json --hardware " + hw);
    ASSERT_EQ(small.status, 0) << small.out;
    const auto j = nlohmann::json::parse(small.out);
    EXPECT_EQ(j["hardware"], "a100-40g");
    for (const auto& c : j["configs"]) EXPECT_FALSE(c["fits"].get<bool>());
    const Result big =
        kvshard("plan --model llama-3.1-70b --gpus 2 --context 4096 --json --hardware a100-80g");
    ASSERT_EQ(big.status, 0) << big.out;
    EXPECT_TRUE(nlohmann::json::parse(big.out)["configs"][0]["fits"].get<bool>());
}

}  // namespace

namespace {

TEST(Cli, PlanExplainOneConfiguration) {
    const std::string base =
        "plan --model llama-3.1-405b --hardware h100-sxm --gpus 16 --context 131072 ";
    const Result t = kvshard(base + "--explain tp=8,pp=2");
    ASSERT_EQ(t.status, 0) << t.out;
    EXPECT_NE(t.out.find("[63,126)"), std::string::npos) << t.out;
    EXPECT_NE(t.out.find("TTFT"), std::string::npos);
    const Result j = kvshard(base + "--explain tp=8,pp=2 --json");
    ASSERT_EQ(j.status, 0) << j.out;
    const auto c = nlohmann::json::parse(j.out)["configs"];
    ASSERT_EQ(c.size(), 1u);
    EXPECT_EQ(c[0]["kv_tokens_per_gpu"], 757264);
    expect_usage_error(base + "--explain tp=8,pp=4", "but 16 GPUs were given");
    expect_usage_error(base + "--explain tp=3,pp=2", "tp=3 does not divide");
    expect_usage_error(base + "--explain tq=8", "unknown key 'tq'");
}

}  // namespace

namespace {

// CLI11's own parse errors come out in kvshard's words: the flag, what it takes, which --help.
TEST(CliErrors, ParseErrorsNameTheFlagAndWhatItTakes) {
    expect_usage_error(
        "layout --model tiny --tp abc",
        "--tp expects an integer in [1, 1048576], got 'abc' (see 'kvshard layout --help')");
    expect_usage_error("plan --model tiny --gpus abc --context 10",
                       "--gpus expects an integer, got 'abc'");
    expect_usage_error("layout --model tiny --tp 99999999999", "--tp must be in [1, 1048576]");
    expect_usage_error("frobnicate",
                       "unknown command 'frobnicate': expected one of cp-plan, hash, layout");
    expect_usage_error("", "no command given: expected one of");
    expect_usage_error("layout --model tiny --bogus 3",
                       "unknown option '--bogus' for kvshard layout");
    expect_usage_error("layout --model tiny extra",
                       "unexpected argument 'extra' for kvshard layout");
    expect_usage_error("layout --model tiny --tp", "--tp needs a value (INT");
    expect_usage_error("plan --model tiny", "--gpus is required (see 'kvshard plan --help')");
    expect_usage_error("plan --model tiny --gpus 8 --context 1024 --mem-util abc",
                       "--mem-util expects a number, got 'abc'");
}

// CLI11 alone clamped an integer past 64 bits to 2^63 - 1 (--batch 18446744073709551616 ran with
// 9223372036854775807), read 0x10 as 16 and a leading 0 as octal (--context 010 was 8), and
// took '' as 0.
TEST(CliErrors, IntegersAreDecimalAndFitIn64Bits) {
    const std::string plan = "plan --model tiny --gpus 8 --context 1024 ";
    expect_usage_error(plan + "--batch 18446744073709551616",
                       "--batch: '18446744073709551616' does not fit in a 64-bit integer");
    expect_usage_error(plan + "--max-batch -9223372036854775809", "does not fit in a 64-bit");
    expect_usage_error("layout --model tiny --tp 0x2",
                       "--tp: expects a decimal integer (digits, e.g. 16), got '0x2'");
    expect_usage_error(plan + "--batch ''", "--batch: expects an integer, got ''");
    expect_usage_error("run --model tiny --seed 18446744073709551616",
                       "--seed must be in [0, 9223372036854775807]");
    const Result octal = kvshard("plan --model tiny --gpus 8 --context 010 --top 1");
    EXPECT_EQ(octal.status, 0) << octal.out;
    EXPECT_NE(octal.out.find("context 10 tokens"), std::string::npos) << octal.out;
}

// --cp-scheme with cp = 1 and --cp-interleave without the interleave scheme did nothing.
TEST(CliErrors, CpSchemeFlagsNeedWhatTheyApplyTo) {
    expect_usage_error("layout --model tiny --cp-scheme zigzag",
                       "--cp-scheme zigzag places tokens over the CP ranks; with --cp 1 there is "
                       "one");
    expect_usage_error("cp-plan --model tiny --cp 2 --cp-interleave 4",
                       "--cp-interleave 4 is the unit of --cp-scheme interleave; with --cp-scheme "
                       "contiguous it does nothing");
    expect_usage_error("run --model tiny --cp 2 --cp-scheme zigzag --cp-interleave 0",
                       "--cp-interleave 0 is the unit of --cp-scheme interleave");
    EXPECT_EQ(kvshard("layout --model tiny --cp 2 --cp-scheme interleave --cp-interleave 4").status,
              0);
}

// models without --model lists the catalog: --kv-dtype and --all-full-attention were accepted and
// ignored there, a bad --kv-dtype included.
TEST(CliErrors, ModelsCatalogHonoursItsFlags) {
    expect_usage_error("models --kv-dtype bogus", "unknown element type 'bogus'");
    const Result bf16 = kvshard("models --json");
    const Result fp8 = kvshard("models --json --kv-dtype fp8");
    const Result full = kvshard("models --json --all-full-attention");
    ASSERT_EQ(bf16.status, 0) << bf16.out;
    ASSERT_EQ(fp8.status, 0) << fp8.out;
    ASSERT_EQ(full.status, 0) << full.out;
    const auto a = nlohmann::json::parse(bf16.out), b = nlohmann::json::parse(fp8.out),
               c = nlohmann::json::parse(full.out);
    ASSERT_EQ(a.size(), b.size());
    for (const auto& m : b) EXPECT_EQ(m.at("kv_dtype"), "fp8") << m.at("name");
    EXPECT_NE(a, c);
}

// Sizes that used to crash or loop: refused with the range in the message.
TEST(CliErrors, HugeSizesAreRefusedNotCrashed) {
    expect_usage_error("plan --model tiny --gpus 2147483647 --context 10",
                       "the GPU count must be an integer in [1, 1048576], got 2147483647");
    expect_usage_error("plan --model llama-3.1-8b --gpus 8 --context 4611686018427387904",
                       "the context must be in [1, 2^40] tokens");
    expect_usage_error("layout --model tiny --dp 65536 --cp 32768 --tp 2",
                       "exceeds 1048576 ranks, the most a layout may have");
    const std::string heads =
        temp_file("heads.json",
                  R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2147483647,
        "head_dim": 8, "intermediate_size": 128, "vocab_size": 100})");
    expect_usage_error("layout --model " + heads, "num_heads must be at most 65536");
    const std::string layers =
        temp_file("layers.json",
                  R"({"num_hidden_layers": 2000000000, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100})");
    expect_usage_error("layout --model " + layers, "at most 16384 layers");
    const std::string huge = temp_file(
        "huge.json",
        R"({"num_hidden_layers": 200, "hidden_size": 1000000, "num_attention_heads": 65536,
        "num_key_value_heads": 65536, "head_dim": 65536, "intermediate_size": 128,
        "vocab_size": 100})");
    expect_usage_error("layout --model " + huge, "more than 2^55 parameters");
    const std::string moe =
        temp_file("moe.json",
                  R"({"model_type": "deepseek_v3", "num_hidden_layers": 4, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "first_k_dense_replace": 4294967297})");
    expect_usage_error("layout --model " + moe, "first_k_dense_replace");
    const std::string trace =
        std::string(KVSHARD_TEST_DATA_DIR) + "/mooncake_conversation_head300.jsonl";
    expect_usage_error("simulate --trace " + trace + " --load-slack nan --policy kvshard",
                       "load slack must be a finite number");
    expect_usage_error("simulate --trace " + trace + " --prefill-weight nan --policy kvshard",
                       "prefill weight must be a finite number");
    expect_usage_error("simulate --trace " + trace + " --capacity-tokens -5",
                       "--capacity-tokens must be >= 0");
    expect_usage_error("simulate --trace " + trace + " --max-requests -1",
                       "request limit must be >= 0");
    expect_usage_error("simulate --trace " + trace + " --capacity-tokens 1000000000000",
                       "exceed the 2^26 blocks the simulator holds");
    // 1e30 GiB used to wrap to a negative byte count.
    expect_usage_error("plan --model tiny --gpus 1 --context 10 --activation-reserve-gib 1e30",
                       "--activation-reserve-gib must be a number in [0, 1048576] GiB");
    const std::string hw = temp_file("hw_huge.json", R"({"base": "h100-sxm", "memory_gib": 1e30})");
    expect_usage_error("plan --model tiny --gpus 1 --context 10 --hardware " + hw,
                       "GPU memory must be in [1 byte, 1 PiB]");
}

}  // namespace
