// Every command that takes a model and a length checks it against the model's max_model_len
// (ModelSpec::check_sequence_length, the check `plan` makes, for a request's length;
// check_computed_length for KV a request has computed): refused with exit 2 and a message
// naming the model, its length, where it came from and --allow-long-context; accepted with that
// flag; unaffected within the length or for a model that states none (the built-in tiny models).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "cli_runner.h"

namespace kvshard {
namespace {

using test::run_cli;

// A llama of 2 small layers whose config.json states max_position_embeddings 64: `run` builds its
// random weights in milliseconds.
std::string tiny_config_with_length() {
    const auto dir =
        std::filesystem::temp_directory_path() /
        ("kvshard_ctxlen_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()));
    std::filesystem::create_directories(dir);
    const auto path = dir / "config.json";
    std::ofstream(path) << R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 64})";
    return path.string();
}

void expect_refused(const test::CliResult& r, const std::string& what, const std::string& model,
                    int64_t max_len) {
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_NE(r.out.find("kvshard: error: " + what), std::string::npos) << r.out;
    EXPECT_NE(
        r.out.find("is longer than model '" + model + "' serves: vLLM derives max_model_len " +
                   std::to_string(max_len) + " from its config (max_position_embeddings " +
                   std::to_string(max_len) + ")"),
        std::string::npos)
        << r.out;
    // The CLI's override, not the Python keyword (these commands are the CLI's).
    EXPECT_NE(r.out.find("or allow long contexts (--allow-long-context) as that variable does"),
              std::string::npos)
        << r.out;
    EXPECT_EQ(r.out.find("allow_long_context=True"), std::string::npos) << r.out;
}

TEST(ContextLengthCli, Layout) {
    expect_refused(run_cli("layout --model llama-3.1-8b --context 131073"),
                   "--context (131073 tokens)", "llama-3.1-8b", 131072);
    const auto at = run_cli("layout --model llama-3.1-8b --context 131072");
    ASSERT_EQ(at.status, 0) << at.out;
    EXPECT_NE(at.out.find("KV@131072"), std::string::npos) << at.out;
    const auto allowed =
        run_cli("layout --model llama-3.1-8b --context 131073 --allow-long-context");
    ASSERT_EQ(allowed.status, 0) << allowed.out;
    EXPECT_NE(allowed.out.find("KV@131073"), std::string::npos) << allowed.out;
    // The default context (32768) is cut to a shorter model's length rather than refused.
    const auto dflt = run_cli("layout --model llama-65b --tp 8");
    ASSERT_EQ(dflt.status, 0) << dflt.out;
    EXPECT_NE(dflt.out.find("KV@2048"), std::string::npos) << dflt.out;
    const auto longer = run_cli("layout --model llama-3.1-8b");
    ASSERT_EQ(longer.status, 0) << longer.out;
    EXPECT_NE(longer.out.find("KV@32768"), std::string::npos) << longer.out;
    EXPECT_EQ(run_cli("layout --model tiny --context 1000000").status, 0);
}

// KV of cached + new tokens (cp-plan) or of a prompt handed to decode (transfer-plan) is at most
// max_model_len - 1 tokens: vLLM refuses a prompt of max_model_len tokens
// (vllm/v1/engine/input_processor.py, InputProcessor._validate_prompt_len) and never computes a
// request's token at position max_model_len - 1 or later (vllm/v1/core/sched/scheduler.py,
// Scheduler.schedule caps num_new_tokens at max_model_len - 1 - num_computed_tokens).
void expect_kv_refused(const test::CliResult& r, const std::string& what, const std::string& model,
                       int64_t max_len) {
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_NE(r.out.find("kvshard: error: " + what), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("is more KV than model '" + model +
                         "' computes for one request: vLLM derives max_model_len " +
                         std::to_string(max_len) + " from its config (max_position_embeddings " +
                         std::to_string(max_len) + ") and computes at most max_model_len - 1 = " +
                         std::to_string(max_len - 1) + " tokens of a request"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("give at most " + std::to_string(max_len - 1) +
                         " tokens, or allow long contexts (--allow-long-context)"),
              std::string::npos)
        << r.out;
    EXPECT_EQ(r.out.find("allow_long_context=True"), std::string::npos) << r.out;
}

TEST(ContextLengthCli, CpPlan) {
    expect_kv_refused(run_cli("cp-plan --model llama-3.1-8b --cp 2 --cached 131000 --new 100"),
                      "--cached 131000 + --new 100 (131100 tokens)", "llama-3.1-8b", 131072);
    // Exactly max_model_len: refused too.
    expect_kv_refused(run_cli("cp-plan --model llama-3.1-8b --cp 2 --cached 130000 --new 1072"),
                      "--cached 130000 + --new 1072 (131072 tokens)", "llama-3.1-8b", 131072);
    const auto within = run_cli("cp-plan --model llama-3.1-8b --cp 2 --cached 130000 --new 1071");
    ASSERT_EQ(within.status, 0) << within.out;
    EXPECT_NE(within.out.find("130000 cached + 1071 new tokens"), std::string::npos) << within.out;
    const auto allowed = run_cli(
        "cp-plan --model llama-3.1-8b --cp 2 --cached 131000 --new 100 --allow-long-context");
    ASSERT_EQ(allowed.status, 0) << allowed.out;
    EXPECT_NE(allowed.out.find("131000 cached + 100 new tokens"), std::string::npos) << allowed.out;
    EXPECT_EQ(run_cli("cp-plan --model tiny --cp 2 --cached 1000000 --new 1000").status, 0);
}

TEST(ContextLengthCli, TransferPlan) {
    expect_kv_refused(run_cli("transfer-plan --model llama-3.1-8b --from tp=2 --to tp=1 --tokens "
                              "131073"),
                      "--tokens (131073 tokens)", "llama-3.1-8b", 131072);
    expect_kv_refused(run_cli("transfer-plan --model llama-3.1-8b --from tp=2 --to tp=1 --tokens "
                              "131072"),
                      "--tokens (131072 tokens)", "llama-3.1-8b", 131072);
    const auto below =
        run_cli("transfer-plan --model llama-3.1-8b --from tp=2 --to tp=1 --tokens 131071");
    ASSERT_EQ(below.status, 0) << below.out;
    EXPECT_NE(below.out.find("llama-3.1-8b: 131071 tokens, dp=1"), std::string::npos) << below.out;
    const auto allowed = run_cli(
        "transfer-plan --model llama-3.1-8b --from tp=2 --to tp=1 --tokens 131073 "
        "--allow-long-context");
    ASSERT_EQ(allowed.status, 0) << allowed.out;
    EXPECT_NE(allowed.out.find("llama-3.1-8b: 131073 tokens, dp=1"), std::string::npos)
        << allowed.out;
    EXPECT_EQ(run_cli("transfer-plan --model tiny --from tp=2 --to tp=1 --tokens 1000000").status,
              0);
}

TEST(ContextLengthCli, RunCountsThePromptAndItsOutput) {
    const std::string model = tiny_config_with_length();
    struct RemoveDir {
        std::filesystem::path dir;
        ~RemoveDir() { std::filesystem::remove_all(dir); }
    } cleanup{std::filesystem::path(model).parent_path()};
    const auto over = run_cli("run --model " + model + " --prompt-len 60 --gen 8");
    EXPECT_EQ(over.status, 2) << over.out;
    EXPECT_NE(over.out.find("a prompt of 60 tokens (--prompt-len) plus --gen 8 (68 tokens) is "
                            "longer than model"),
              std::string::npos)
        << over.out;
    EXPECT_NE(over.out.find("vLLM derives max_model_len 64 from its config "
                            "(max_position_embeddings 64)"),
              std::string::npos)
        << over.out;
    // run has no Python counterpart: the flag only.
    EXPECT_NE(over.out.find("or allow long contexts (--allow-long-context) as"), std::string::npos)
        << over.out;
    EXPECT_EQ(over.out.find("allow_long_context=True"), std::string::npos) << over.out;
    const auto ids = run_cli("run --model " + model + " --prompt-ids 1,2,3 --gen 62");
    EXPECT_EQ(ids.status, 2) << ids.out;
    EXPECT_NE(ids.out.find("a prompt of 3 tokens (--prompt-ids) plus --gen 62 (65 tokens)"),
              std::string::npos)
        << ids.out;
    const auto within = run_cli("run --model " + model + " --prompt-len 56 --gen 8 --verify");
    EXPECT_EQ(within.status, 0) << within.out;
    const auto allowed =
        run_cli("run --model " + model + " --prompt-len 60 --gen 8 --verify --allow-long-context");
    EXPECT_EQ(allowed.status, 0) << allowed.out;
    EXPECT_NE(allowed.out.find("prefill: 60 prompt tokens"), std::string::npos) << allowed.out;
    // A disaggregated run checks the same sequence.
    const auto disagg =
        run_cli("run --model " + model + " --prefill tp=2 --decode tp=1 --prompt-len 60 --gen 8");
    EXPECT_EQ(disagg.status, 2) << disagg.out;
    EXPECT_NE(disagg.out.find("(68 tokens) is longer than model"), std::string::npos) << disagg.out;
    EXPECT_EQ(run_cli("run --model tiny --prompt-len 200 --gen 2").status, 0);
}

}  // namespace
}  // namespace kvshard
