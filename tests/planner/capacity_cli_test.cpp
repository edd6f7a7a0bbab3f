// kvshard plan prints vLLM's arrangement and where each capacity figure comes from.
#include <gtest/gtest.h>

#include "cli_runner.h"

namespace kvshard {
namespace {

using test::run_cli;

// At pp > 1 vLLM groups the whole model's layers and each stage holds its share of every group:
// Falcon-H1-7B's 44-slot groups are 22 slots on each of two stages.
TEST(CapacityCli, ExplainSaysAGroupsSlotsAreModelWideAndWhatAStageHolds) {
    const std::string model =
        std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/falcon-h1-7b-instruct.json";
    const auto pp = run_cli("plan -m " + model + " -n 2 -c 8192 --explain pp=2");
    ASSERT_EQ(pp.status, 0) << pp.out;
    EXPECT_NE(pp.out.find("2 groups (1 full + 1 mamba2) of 44 layer slots model-wide (22 on this "
                          "GPU's stage), 0 of them padding"),
              std::string::npos)
        << pp.out;
    EXPECT_NE(pp.out.find("(1605632 B x 22 slots)"), std::string::npos) << pp.out;
    const auto tp = run_cli("plan -m " + model + " -n 2 -c 8192 --explain tp=2");
    ASSERT_EQ(tp.status, 0) << tp.out;
    EXPECT_NE(tp.out.find("of 44 layer slots, 0 of them padding"), std::string::npos) << tp.out;
}

TEST(CapacityCli, ExplainShowsTheGroupsPaddingAndEachFiguresArithmetic) {
    const auto r = run_cli("plan -m gemma-3-27b -n 1 -c 8192 --explain tp=1");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("7 groups (6 sliding(1024) + 1 full) of 10 layer slots, 8 of them "
                         "padding"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("16131 blocks = floor(21143235072 B budget / (131072 B x 10 slots))"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("holds at most 902 blocks"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("KV tokens per GPU 36864 (limiting rank 0), longest request 131072 "
                         "tokens (the model's max_model_len; memory allows more), 17 requests of "
                         "8192"),
              std::string::npos)
        << r.out;
    const auto allowed =
        run_cli("plan -m gemma-3-27b -n 1 -c 8192 --explain tp=1 --allow-long-context");
    EXPECT_NE(allowed.out.find("longest request 202704 tokens, 17 requests of 8192"),
              std::string::npos)
        << allowed.out;
}

TEST(CapacityCli, AGivenBlockSizeBelowVllmsIsKeptAndVllmsIsNamed) {
    const auto raised = run_cli("plan -m qwen3-next-80b-a3b -n 4 -c 8192 --explain tp=4");
    ASSERT_EQ(raised.status, 0) << raised.out;
    EXPECT_NE(raised.out.find("blocks of 272 tokens (raised from 16"), std::string::npos)
        << raised.out;
    const auto kept =
        run_cli("plan -m qwen3-next-80b-a3b -n 4 -c 8192 --explain tp=4 --block-size 16");
    ASSERT_EQ(kept.status, 0) << kept.out;
    EXPECT_NE(kept.out.find("vLLM would raise the block size from 16 to 272"), std::string::npos)
        << kept.out;
}

// vLLM refuses --max-model-len above what the config derives (max_position_embeddings, scaled by
// RoPE factors) unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; plan refuses such a context likewise.
TEST(CapacityCli, ContextBeyondTheModelsLengthIsRefused) {
    const auto over = run_cli("plan -m llama-3.1-8b -n 1 -c 131073");
    EXPECT_EQ(over.status, 2) << over.out;
    EXPECT_NE(over.out.find("the context (131073 tokens) is longer than model 'llama-3.1-8b' "
                            "serves: vLLM derives max_model_len 131072"),
              std::string::npos)
        << over.out;
    EXPECT_EQ(run_cli("plan -m llama-3.1-8b -n 1 -c 131072").status, 0);
    EXPECT_EQ(run_cli("plan -m llama-3.1-8b -n 1 -c 131073 --allow-long-context").status, 0);
    // With --disagg the decode pool holds prompt + output tokens.
    const auto dis = run_cli(
        "plan -m llama-3.1-8b -n 2 -c 131000 --disagg --output-tokens 256 --ttft-slo 100 "
        "--tpot-slo 1");
    EXPECT_EQ(dis.status, 2) << dis.out;
    EXPECT_NE(
        dis.out.find("a prompt of 131000 tokens plus 256 of output (131256 tokens) is longer"),
        std::string::npos)
        << dis.out;
    // The built-in test models state no length: nothing is checked.
    EXPECT_EQ(run_cli("plan -m tiny -n 1 -c 1000000").status, 0);
}

TEST(CapacityCli, MaxNumBatchedTokensMovesTheLongestRequest) {
    const auto r = run_cli(
        "plan -m gemma-3-27b -n 1 -c 230000 --explain tp=1 --max-num-batched-tokens 2048 "
        "--allow-long-context");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("longest request 239568 tokens"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(": fits"), std::string::npos) << r.out;
    const auto bad = run_cli("plan -m tiny -n 1 -c 64 --max-num-batched-tokens 0");
    EXPECT_EQ(bad.status, 2);
    EXPECT_NE(bad.out.find("max_num_batched_tokens must be in [1, 2^40]"), std::string::npos)
        << bad.out;
}

TEST(CapacityCli, SpeculativeMtpIsExplainedAndRefusedWhereItCannotApply) {
    const std::string qn = "plan -m qwen3-next-80b-a3b -n 4 -c 8192 --explain tp=4";
    const auto on = run_cli(qn + " --speculative-method mtp --speculative-tokens 2");
    ASSERT_EQ(on.status, 0) << on.out;
    EXPECT_NE(on.out.find("speculating with 1 MTP layer drafting 2 tokens"), std::string::npos)
        << on.out;
    EXPECT_NE(on.out.find("4 groups (3 gated_deltanet + 1 full) of 13 layer slots, 3 of them "
                          "padding"),
              std::string::npos)
        << on.out;
    // cdiv(8192, 288) + 3 x (2 + 2): the conv rows for 2 draft tokens raise the block 272 -> 288.
    EXPECT_NE(on.out.find("blocks of 288 tokens"), std::string::npos) << on.out;
    EXPECT_NE(on.out.find("holds at most 41 blocks"), std::string::npos) << on.out;
    EXPECT_NE(on.out.find("state groups 2 (align: past one block) + 2 speculative"),
              std::string::npos)
        << on.out;
    EXPECT_NE(on.out.find("MTP drafter weights per GPU 0.8 GiB"), std::string::npos) << on.out;
    const auto off = run_cli(qn);
    ASSERT_EQ(off.status, 0) << off.out;
    EXPECT_EQ(off.out.find("speculat"), std::string::npos) << off.out;
    EXPECT_NE(off.out.find("holds at most 37 blocks"), std::string::npos) << off.out;

    // --disagg: both pools speculate (disagg_test.cpp); the header says so.
    const auto pd = run_cli(
        "plan -n 8 -c 8192 -m glm-4.5-air --disagg --ttft-slo 2 --tpot-slo 0.05 "
        "--speculative-method mtp --speculative-tokens 2 --top 3");
    ASSERT_EQ(pd.status, 0) << pd.out;
    EXPECT_NE(pd.out.find("TPOT SLO 50.0 ms, speculating with 1 MTP layer drafting 2 tokens\n"),
              std::string::npos)
        << pd.out;

    // pp 2: the drafter is on the last stage, with its own embedding.
    const auto pp2 = run_cli(
        "plan -n 4 -c 1024 -m glm-4.5-air --speculative-method mtp --speculative-tokens 2 "
        "--explain pp=2,tp=2");
    ASSERT_EQ(pp2.status, 0) << pp2.out;
    EXPECT_NE(pp2.out.find("MTP drafter weights per GPU of stage 1 2.8 GiB (in total; vLLM runs "
                           "the drafter on the last stage"),
              std::string::npos)
        << pp2.out;

    for (auto [flags, says] : {
             std::pair{"-m tiny --speculative-method mtp --speculative-tokens 2",
                       "speculative decoding with MTP needs MTP layers, and model 'tiny' carries "
                       "none"},
             {"-m glm-4.5-air --speculative-method mtp --speculative-tokens 0",
              "--speculative-tokens must be an integer in [1, 1024]"},
             {"-m glm-4.5-air --speculative-tokens 2",
              "needs the drafter: give "
              "--speculative-method mtp"},
             {"-m glm-4.5-air --speculative-method mtp", "needs --speculative-tokens N"},
             {"-m glm-4.5-air --speculative-method eagle --speculative-tokens 2",
              "unknown --speculative-method 'eagle'"},
         }) {
        const auto r = run_cli(std::string("plan -n 4 -c 1024 ") + flags);
        EXPECT_EQ(r.status, 2) << flags << "\n" << r.out;
        EXPECT_NE(r.out.find(says), std::string::npos) << flags << "\n" << r.out;
    }
}

}  // namespace
}  // namespace kvshard
