// A trace's requests against the model's max_model_len (sim/trace_lengths.h): a vLLM server
// refuses prompt + max_tokens > max_model_len (vllm/renderers/params.py,
// TokenizeParams._token_len_check) when it arrives, not at startup, so `simulate` and `plan
// --trace` refuse such a trace unless --allow-long-context, naming how many requests, the first,
// and the cures (filter the trace, or the flag).
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "cli_runner.h"
#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/sim/trace_lengths.h"

namespace kvshard {
namespace {

const std::string kSample =
    std::string(KVSHARD_TEST_DATA_DIR) + "/mooncake_conversation_head300.jsonl";

Trace three_requests() {
    // Lengths 100 + 10, 120 + 9 (line 3: 129 tokens), 130 + 1: blocks of 512 tokens, one each.
    std::istringstream in(
        R"({"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1]})"
        "\n\n"
        R"({"timestamp": 1, "input_length": 120, "output_length": 9, "hash_ids": [2]})"
        "\n"
        R"({"timestamp": 2, "input_length": 130, "output_length": 1, "hash_ids": [3]})"
        "\n");
    return parse_trace(in, "three.jsonl", TraceErrorPolicy::kFail);
}

ModelSpec with_length(int64_t tokens) {
    ModelSpec m = catalog_model("tiny");
    m.max_model_len = tokens;
    m.max_model_len_from = "max_position_embeddings " + std::to_string(tokens);
    return m;
}

TEST(TraceLengths, CountsPromptPlusOutputAndNamesTheFirst) {
    const Trace t = three_requests();
    EXPECT_EQ(check_trace_lengths(t, with_length(131), false, "--flag"), 0);  // 131 fits exactly
    EXPECT_EQ(check_trace_lengths(t, catalog_model("tiny"), false, "--flag"),
              0);  // no length: no check
    try {
        check_trace_lengths(t, with_length(128), false, "--flag");
        FAIL() << "a trace with requests past max_model_len was accepted";
    } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("trace 'three.jsonl': 2 of 3 requests are longer than model 'tiny' "
                            "serves (prompt + max_tokens > max_model_len 128, which vLLM derives "
                            "from its config: max_position_embeddings 128); the first, at line 3, "
                            "is a prompt of 120 tokens plus 9 of output (129 tokens)."),
                  std::string::npos)
            << what;
        // Refused per request at request time, not at startup: the cures are the trace or the
        // override the caller names (here "--flag"), not a server setting.
        EXPECT_NE(what.find("refuses each such request when it arrives"), std::string::npos)
            << what;
        EXPECT_NE(what.find("filter the trace to requests of at most 128 tokens, or replay them "
                            "anyway (--flag)"),
                  std::string::npos)
            << what;
        EXPECT_EQ(what.find("allow_long_context=True"), std::string::npos) << what;
    }
    EXPECT_EQ(check_trace_lengths(t, with_length(128), true, "--flag"), 2);
    EXPECT_EQ(check_trace_lengths(t, with_length(109), true, "--flag"), 3);
}

// A request asking for no output is replayed as one token (the token its prefill samples), so a
// prompt of exactly max_model_len tokens is refused: vLLM's engine refuses a prompt of
// max_model_len tokens, which leaves no room for an output token
// (vllm/v1/engine/input_processor.py, InputProcessor._validate_prompt_len), and max_tokens is at
// least 1.
TEST(TraceLengths, AnEmptyOutputStillNeedsRoomForOneToken) {
    std::istringstream in(
        R"({"timestamp": 0, "input_length": 128, "output_length": 0, "hash_ids": [1]})"
        "\n"
        R"({"timestamp": 1, "input_length": 127, "output_length": 0, "hash_ids": [2]})"
        "\n");
    const Trace t = parse_trace(in, "empty-output.jsonl", TraceErrorPolicy::kFail);
    EXPECT_EQ(check_trace_lengths(t, with_length(129), false, "--flag"), 0);
    EXPECT_EQ(check_trace_lengths(t, with_length(128), true, "--flag"), 1);
    try {
        check_trace_lengths(t, with_length(128), false, "--flag");
        FAIL() << "a prompt of max_model_len tokens was accepted";
    } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("1 of 2 requests are longer than model 'tiny' serves"),
                  std::string::npos)
            << what;
        EXPECT_NE(what.find("the first, at line 1, is a prompt of 128 tokens plus 0 of output "
                            "(replayed as 1, the token its prefill samples: at least 129 tokens)"),
                  std::string::npos)
            << what;
    }
}

TEST(TraceLengthsCli, SimulateRefusesATraceVllmWouldRejectPartOf) {
    const std::string args = "simulate --trace " + kSample +
                             " --replicas 2 --policy round-robin --capacity-tokens 65536";
    // llama-65b serves 2048 tokens; 250 of the sample's 300 requests are longer, the first on
    // line 1.
    const auto over = test::run_cli(args + " --model llama-65b");
    EXPECT_EQ(over.status, 2) << over.out;
    EXPECT_NE(over.out.find("250 of 300 requests are longer than model 'llama-65b' serves "
                            "(prompt + max_tokens > max_model_len 2048"),
              std::string::npos)
        << over.out;
    EXPECT_NE(over.out.find("the first, at line 1, is a prompt of 6758 tokens plus 500 of output "
                            "(7258 tokens)"),
              std::string::npos)
        << over.out;
    // simulate has no Python counterpart: the CLI flag only.
    EXPECT_NE(over.out.find("or replay them anyway (--allow-long-context)"), std::string::npos)
        << over.out;
    EXPECT_EQ(over.out.find("allow_long_context=True"), std::string::npos) << over.out;
    const auto allowed = test::run_cli(args + " --model llama-65b --allow-long-context");
    ASSERT_EQ(allowed.status, 0) << allowed.out;
    EXPECT_NE(
        allowed.out.find("250 requests longer than max_model_len 2048 (--allow-long-context)"),
        std::string::npos)
        << allowed.out;
    // Within the length (llama-3.1-70b: 131072; the longest request is 121213 + its output).
    const auto within = test::run_cli(args + " --model llama-3.1-70b");
    ASSERT_EQ(within.status, 0) << within.out;
    EXPECT_EQ(within.out.find("max_model_len"), std::string::npos) << within.out;
    EXPECT_EQ(test::run_cli(args + " --model tiny").status, 0);
}

TEST(TraceLengthsCli, PlanTraceChecksEveryRequest) {
    const std::string args = "plan --model qwen2.5-72b --gpus 8 --trace " + kSample;
    // qwen2.5-72b serves 32768 tokens: 29 of the sample's requests are longer.
    const auto over = test::run_cli(args);
    EXPECT_EQ(over.status, 2) << over.out;
    EXPECT_NE(over.out.find("29 of 300 requests are longer than model 'qwen2.5-72b' serves"),
              std::string::npos)
        << over.out;
    EXPECT_NE(over.out.find("or replay them anyway (--allow-long-context)"), std::string::npos)
        << over.out;
    EXPECT_EQ(over.out.find("allow_long_context=True"), std::string::npos) << over.out;
    EXPECT_EQ(test::run_cli(args + " --allow-long-context").status, 0);
    EXPECT_EQ(test::run_cli("plan --model llama-3.1-70b --gpus 8 --trace " + kSample).status, 0);
}

}  // namespace
}  // namespace kvshard
