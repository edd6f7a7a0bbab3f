// kvshard transfer-plan: JSON fields, the seed example, and clear errors.
#include <gtest/gtest.h>

#include "cli_runner.h"

#include <array>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace {

using kvshard::test::CliResult;
using kvshard::test::run_cli;

TEST(TransferPlanCli, JsonSeedExample) {
    const auto r =
        run_cli("transfer-plan --model llama-3.1-70b --from tp=8 --to tp=4 --tokens 1000 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["messages"], 8);
    // 80 layers x K,V x 8 heads x 1000 tokens x 128 x bf16
    EXPECT_EQ(j["min_bytes"].get<int64_t>(), int64_t{80} * 2 * 8 * 1000 * 128 * 2);
    EXPECT_EQ(j["bytes"], j["min_bytes"]);
    ASSERT_EQ(j["pairs"].size(), 8u);
    for (const auto& p : j["pairs"]) {
        EXPECT_EQ(p["dst"].get<int>(), p["src"].get<int>() / 2);
        EXPECT_EQ(p["bytes"].get<int64_t>(), int64_t{80} * 2 * 1000 * 128 * 2);
    }
}

// --schedule prints what the executor carries out: one row per message with its path.
TEST(TransferPlanCli, Schedule) {
    const auto r = run_cli(
        "transfer-plan --model tiny --from tp=1 --to tp=1 --tokens 16 --order-to nhd "
        "--mode post-receive --layers-per-message 1 --schedule");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("schedule: mode post-receive, messages"), std::string::npos) << r.out;
    size_t zero_copy = 0;
    for (size_t at = r.out.find("zero-copy"); at != std::string::npos;
         at = r.out.find("zero-copy", at + 1))
        ++zero_copy;
    EXPECT_GE(zero_copy, 2u) << r.out;  // one per layer of the tiny model
    const auto direct = run_cli(
        "transfer-plan --model tiny --from tp=2 --to tp=1 --tokens 40 --schedule --direct-read");
    ASSERT_EQ(direct.status, 0) << direct.out;
    EXPECT_NE(direct.out.find("direct-read"), std::string::npos) << direct.out;
}

TEST(TransferPlanCli, BlockSizesAndPipeline) {
    const auto r = run_cli(
        "transfer-plan --model llama-3.1-8b --from tp=8 --to tp=4,pp=2 --tokens 300 "
        "--block-size-from 16 "
        "--block-size-to 64 --layers-per-message 1 --json --messages");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["layer_groups"], 32);
    EXPECT_EQ(j["messages"], 32 * 8);  // each layer: 8 source ranks, one destination each
    EXPECT_EQ(j["bytes"], j["min_bytes"]);
    EXPECT_EQ(j["message_list"].size(), 256u);
}

TEST(TransferPlanCli, TableAndErrors) {
    const auto ok = run_cli("transfer-plan --model tiny --from tp=8 --to tp=2 --tokens 10");
    EXPECT_EQ(ok.status, 0) << ok.out;
    EXPECT_NE(ok.out.find("min bytes"), std::string::npos) << ok.out;
    const auto bad_tp = run_cli("transfer-plan --model tiny --from tp=3 --to tp=2 --tokens 10");
    EXPECT_EQ(bad_tp.status, 2);
    EXPECT_NE(bad_tp.out.find("kvshard: error: --from 'tp=3'"), std::string::npos) << bad_tp.out;
    const auto bad_tokens = run_cli("transfer-plan --model tiny --from tp=1 --to tp=2 --tokens 0");
    EXPECT_EQ(bad_tokens.status, 2) << bad_tokens.out;
    const auto bad_order = run_cli("transfer-plan --model tiny --tokens 4 --order-to xyz");
    EXPECT_EQ(bad_order.status, 2) << bad_order.out;
    EXPECT_NE(bad_order.out.find("hnd, nhd"), std::string::npos) << bad_order.out;
    const auto help = run_cli("transfer-plan --help");
    EXPECT_EQ(help.status, 0);
    EXPECT_NE(help.out.find("--block-size-to"), std::string::npos);
}

// Gemma-4-31B: 50 sliding(1024) layers of 16 KV heads x 256 and 10 full layers of 4 KV heads x
// 512, where the model's uniform fields say 16 x 256. transfer-plan prints its per-group table with
// each group's mode (the group plans, with each rank's share of the group's own heads), and the
// bytes are the group's shapes': TP=8 -> TP=2 moves the full layers' 4 heads once, TP=2 -> TP=8
// twice (each head on two destination ranks), and the sliding layers the window's blocks.
TEST(TransferPlanCli, Gemma4GroupsOfTheirOwnHeadShape) {
    const std::string model = std::string("transfer-plan --model ") + KVSHARD_TEST_DATA_DIR
                              "/hf_configs/gemma-4-31b.json";
    const auto text = run_cli(model + " --from tp=8 --to tp=2 -L 5000");
    ASSERT_EQ(text.status, 0) << text.out;
    EXPECT_NE(text.out.find("mode pre-send,"), std::string::npos) << text.out;
    EXPECT_NE(
        text.out.find("sliding(1024)      50        3977         8     806.25 MiB      pre-send"),
        std::string::npos)
        << text.out;
    EXPECT_NE(text.out.find("full      10           0         8     390.62 MiB      pre-send"),
              std::string::npos)
        << text.out;
    // The sliding layers keep blocks of 16 from the one holding 5001 - 1024 = 3977: 1032 tokens.
    const int64_t sliding = int64_t{50} * 2 * 16 * 1032 * 256 * 2;
    const int64_t full = int64_t{10} * 2 * 4 * 5000 * 512 * 2;
    struct Case {
        const char* from;
        const char* to;
        int copies;  // destination ranks holding each full head
    };
    for (const Case& c : {Case{"tp=8", "tp=2", 1}, Case{"tp=2", "tp=8,pp=2", 2}}) {
        SCOPED_TRACE(c.to);
        const int copies = c.copies;
        const auto r = run_cli(model + " --from " + c.from + " --to " + c.to + " -L 5000 --json");
        ASSERT_EQ(r.status, 0) << r.out;
        const auto j = nlohmann::json::parse(r.out);
        ASSERT_EQ(j["kv_groups"].size(), 2u);
        EXPECT_EQ(j["kv_groups"][0]["kind"], "sliding");
        EXPECT_EQ(j["kv_groups"][0]["bytes"].get<int64_t>(), sliding);
        EXPECT_EQ(j["kv_groups"][1]["kind"], "full");
        EXPECT_EQ(j["kv_groups"][1]["bytes"].get<int64_t>(), copies * full);
        EXPECT_EQ(j["bytes"], j["min_bytes"]);
        EXPECT_EQ(j["bytes"].get<int64_t>(), sliding + copies * full);
    }
    // The reference model runs one attention shape: a disaggregated run refuses, naming the layer.
    const auto run = run_cli(std::string("run --model ") + KVSHARD_TEST_DATA_DIR
                             "/hf_configs/gemma-4-31b.json --prefill tp=2 --decode tp=1 "
                             "--prompts 1 --prompt-len 8 --gen 2");
    EXPECT_EQ(run.status, 2) << run.out;
    EXPECT_NE(run.out.find("layer 5 has 4 KV heads of 512 where the model has 16 of 256"),
              std::string::npos)
        << run.out;
}

// Flags of --schedule and --descriptors without them did nothing (and took any value); --json
// dropped the schedule; --staging-mib 0 was refused only after the plan was printed; a layout that
// named tp twice kept the last.
TEST(TransferPlanCli, FlagsAreUsedOrRefusedBeforeAnythingIsPrinted) {
    const std::string base = "transfer-plan --model tiny --from tp=2 --to tp=1 --tokens 64";
    for (const auto& [args, needle] :
         {std::pair{base + " --staging-mib 0", "--staging-mib requires --schedule"},
          {base + " --direct-read", "--direct-read requires --schedule"},
          {base + " --descriptor-limit 5", "--descriptor-limit requires --descriptors"},
          {base + " --schedule --json", "--schedule excludes --json"},
          {base + " --block-size-to 2097152", "block size must be in [1, 2^20] tokens"},
          {"transfer-plan --model tiny --from tp=2,tp=4 --to tp=1 --tokens 64",
           "gives tp twice"}}) {
        const auto r = run_cli(args);
        EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
        EXPECT_NE(r.out.find(needle), std::string::npos) << args << "\n" << r.out;
    }
    // Refused with nothing on stdout.
    const auto staging = kvshard::test::run_command(std::string(KVSHARD_CLI_PATH) + " " + base +
                                                    " --schedule --staging-mib 0 2>/dev/null");
    EXPECT_EQ(staging.status, 2);
    EXPECT_EQ(staging.out, "");
}

// kvshard run with a context-parallel prefill side: ring-attention prefill, each CP rank's KV
// streamed to the decode group layer by layer, tokens identical to the unsharded model.
TEST(DisaggRunCli, CpPrefillVerifies) {
    const auto r = run_cli(
        "run --model tiny --prefill cp=2,tp=2 --decode tp=4 --prompts 2 --prompt-len 20 --gen 4 "
        "--verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["verify"]["tokens_match"], true);
    EXPECT_EQ(j["failed_requests"], 0);
    EXPECT_EQ(j["prefill"]["ranks"], 4);
    EXPECT_EQ(j["transfer"]["streamed"], true);
    EXPECT_EQ(j["transfer"]["bytes"], j["transfer"]["min_bytes"]);
    EXPECT_GT(j["transfer"]["bytes"].get<int64_t>(), 0);

    const auto text = run_cli(
        "run --model tiny --prefill cp=4,cp_scheme=zigzag --decode tp=2,pp=2 --prompts 1 "
        "--prompt-len 19 --gen 3 --verify");
    ASSERT_EQ(text.status, 0) << text.out;
    EXPECT_NE(text.out.find("layer by layer"), std::string::npos) << text.out;
    EXPECT_NE(text.out.find("identical"), std::string::npos) << text.out;
}

// A context-parallel decode side: the KV lands on the CP ranks its scheme names, decode merges the
// ranks' partial attention; a CP decode side with pp > 1 is refused (exit 2, says what would work).
TEST(DisaggRunCli, CpDecodeVerifiesWithPpAndDpIsRefused) {
    const auto r = run_cli(
        "run --model tiny --prefill tp=2 --decode cp=2,tp=2 --prompts 2 --prompt-len 20 --gen 4 "
        "--verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["verify"]["tokens_match"], true);
    EXPECT_EQ(j["failed_requests"], 0);
    EXPECT_EQ(j["decode"]["ranks"], 4);
    EXPECT_EQ(j["transfer"]["streamed"], true);
    EXPECT_EQ(j["transfer"]["bytes"], j["transfer"]["min_bytes"]);

    // A CP decode side with PP: each stage's CP ranks receive their layers.
    const auto pp = run_cli(
        "run --model tiny --prefill tp=2 --decode cp=2,pp=2 --prompts 2 --prompt-len 20 --gen 4 "
        "--verify --json");
    ASSERT_EQ(pp.status, 0) << pp.out;
    const auto jp = nlohmann::json::parse(pp.out);
    EXPECT_EQ(jp["verify"]["tokens_match"], true);
    EXPECT_EQ(jp["decode"]["ranks"], 4);
    EXPECT_EQ(jp["transfer"]["bytes"], jp["transfer"]["min_bytes"]);

    const auto bad =
        run_cli("run --model tiny --prefill tp=2 --decode dp=2,cp=2 --prompts 1 --gen 2");
    EXPECT_EQ(bad.status, 2) << bad.out;
    EXPECT_NE(bad.out.find("kvshard: error: a disaggregated side with cp > 1 serves one replica"),
              std::string::npos)
        << bad.out;
}

// The flags of `kvshard run` that a disaggregated run uses reach it (the CP modes, --dump-logits),
// and the single-group layout flags are refused rather than ignored.
TEST(DisaggRunCli, RunFlagsAreUsedOrRefused) {
    const std::string npy = ::testing::TempDir() + "kvshard_disagg_logits.npy";
    const auto ok = run_cli(
        "run --model tiny --prefill cp=2 --decode cp=2,tp=2 --cp-prefill pass-q --cp-decode-merge "
        "all-to-all --prompts 2 --prompt-len 20 --gen 3 --verify --dump-logits " +
        npy);
    ASSERT_EQ(ok.status, 0) << ok.out;
    std::FILE* f = std::fopen(npy.c_str(), "rb");
    ASSERT_NE(f, nullptr);
    std::array<char, 128> head{};
    const size_t got = std::fread(head.data(), 1, head.size(), f);
    std::fclose(f);
    ASSERT_EQ(got, head.size());
    EXPECT_NE(std::string(head.data(), head.size()).find("'shape': (2, 256)"), std::string::npos);

    const auto bad_merge = run_cli(
        "run --model tiny --prefill tp=1 --decode cp=2 --cp-decode-merge bogus --prompts 1");
    EXPECT_EQ(bad_merge.status, 2) << bad_merge.out;
    EXPECT_NE(bad_merge.out.find("valid merges are all-gather"), std::string::npos)
        << bad_merge.out;
    const auto both = run_cli("run --model tiny --prefill tp=1 --decode tp=1 --tp 2 --prompts 1");
    EXPECT_EQ(both.status, 2) << both.out;
    EXPECT_NE(both.out.find("a disaggregated run takes both layouts from --prefill and --decode"),
              std::string::npos)
        << both.out;
}

// The transfer's polling and checking knobs reach it: in messages, a sleeping sender and checks on
// a worker thread for every payload received straight into the pool still give the unsharded
// tokens.
TEST(DisaggRunCli, SenderSleepAndCheckThread) {
    const auto r = run_cli(
        "run --model tiny --prefill tp=2 --decode tp=2 --direct-read off --sender-sleep-us 50 "
        "--check-thread-bytes 0 --prompts 2 --prompt-len 32 --gen 4 --verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["verify"]["tokens_match"], true);
    EXPECT_EQ(j["failed_requests"], 0);
    EXPECT_EQ(j["transfer"]["bytes"], j["transfer"]["min_bytes"]);
    EXPECT_EQ(j["transfer"]["direct_messages"], 0);
}

// By default every decode rank reads its KV from the prefill pools in place (a window of one
// message here); --direct-read off sends it in messages. Both give the unsharded tokens.
TEST(DisaggRunCli, DirectReadOnAndOff) {
    for (const char* flags : {"--direct-window 1", "--direct-read off"}) {
        const auto r = run_cli(std::string("run --model tiny --prefill tp=4 --decode tp=2,pp=2 ") +
                               flags + " --prompts 2 --prompt-len 24 --gen 4 --verify --json");
        ASSERT_EQ(r.status, 0) << r.out;
        const auto j = nlohmann::json::parse(r.out);
        EXPECT_EQ(j["verify"]["tokens_match"], true) << flags;
        EXPECT_EQ(j["transfer"]["bytes"], j["transfer"]["min_bytes"]) << flags;
        const bool direct = std::string(flags) != "--direct-read off";
        EXPECT_EQ(j["transfer"]["direct_messages"].get<int64_t>(),
                  direct ? j["transfer"]["messages"].get<int64_t>() : 0)
            << flags;
    }
}

// --source-checksums: on (the default), each direct read of whole blocks is checked against the
// prefill's seals; off, against a checksum pass when sent. A value other than on/off exits 2.
TEST(DisaggRunCli, SourceChecksumsOnAndOff) {
    for (const char* value : {"on", "off"}) {
        const auto r = run_cli(std::string("run --model tiny --prefill tp=4 --decode tp=2 ") +
                               "--source-checksums " + value +
                               " --prompts 2 --prompt-len 24 --gen 4 --verify --json");
        ASSERT_EQ(r.status, 0) << r.out;
        const auto j = nlohmann::json::parse(r.out);
        EXPECT_EQ(j["verify"]["tokens_match"], true) << value;
        const int64_t direct = j["transfer"]["direct_messages"].get<int64_t>();
        EXPECT_EQ(direct, j["transfer"]["messages"].get<int64_t>()) << value;
        EXPECT_EQ(j["transfer"]["unit_checksum_messages"].get<int64_t>(),
                  std::string(value) == "on" ? direct : 0)
            << value;
    }
    const auto text = run_cli(
        "run --model tiny --prefill tp=2 --decode tp=1 --prompts 1 --prompt-len 20 --gen 2");
    ASSERT_EQ(text.status, 0) << text.out;
    EXPECT_NE(text.out.find("all read in place (all checked against prefill's seals)"),
              std::string::npos)
        << text.out;
    const auto bad = run_cli("run --model tiny --prefill tp=2 --decode tp=1 --source-checksums 1");
    EXPECT_EQ(bad.status, 2) << bad.out;
    EXPECT_NE(bad.out.find("--source-checksums must be on or off, got '1'"), std::string::npos)
        << bad.out;
}

}  // namespace
