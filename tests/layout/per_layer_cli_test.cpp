// The CLI on models with per-layer kinds: layout's KV groups and per-request column, models' layer
// mix, plan with and without --all-full-attention, and the refusals.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "cli_runner.h"

namespace {

kvshard::test::CliResult kvshard(const std::string& args) { return kvshard::test::run_cli(args); }

std::string config(const std::string& name) {
    return std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/" + name + ".json";
}

TEST(PerLayerCli, LayoutJsonHasKvGroupsAndState) {
    const auto r = kvshard("layout --model " + config("qwen3-next-80b-a3b") + " --tp 4 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("layer_mix"), "48 layers: 36 gated_deltanet + 12 full");
    const auto& rank = j.at("ranks").at(0);
    const auto& groups = rank.at("kv_groups");
    ASSERT_EQ(groups.size(), 2u);
    EXPECT_EQ(groups[0].at("kind"), "gated_deltanet");
    EXPECT_EQ(groups[0].at("layers").size(), 36u);
    EXPECT_TRUE(groups[1].at("window").is_null());
    // Full layers: 12 x 2 x max(1, 2/4) x 256 x 2 bytes; state: 36 layers of conv 3 x (2 x 4 x 128
    // + 8 x 128) and recurrent 8 x 128 x 128, bf16.
    EXPECT_EQ(rank.at("kv_bytes_per_token"), 12 * 2 * 1 * 256 * 2);
    EXPECT_EQ(rank.at("state_bytes_per_sequence"),
              36 * 2 * (3 * (2 * 4 * 128 + 8 * 128) + 8 * 128 * 128));
}

TEST(PerLayerCli, LayoutTextShowsGroupsAndPpBalance) {
    const auto r = kvshard("layout --model gemma-3-27b --pp 4 --context 131072");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("62 layers: 52 sliding(1024) + 10 full"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("KV groups (one block table each)"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("PP stages hold"), std::string::npos) << r.out;
    const auto bad = kvshard("layout --model gemma-3-27b --pp 4 --pp-split weights");
    EXPECT_EQ(bad.status, 2) << bad.out;
    EXPECT_NE(bad.out.find("--pp-split must be even or kv"), std::string::npos) << bad.out;
    const auto both = kvshard("layout --model gemma-3-27b --pp 2 --pp-split kv --pp-layers 31,31");
    EXPECT_EQ(both.status, 2) << both.out;
    const auto ctx = kvshard("layout --model gemma-3-27b --context 0");
    EXPECT_EQ(ctx.status, 2) << ctx.out;
}

TEST(PerLayerCli, PlanCountsWindowedRequests) {
    auto conc = [](const std::string& extra) {
        const auto r = kvshard(
            "plan --model gpt-oss-120b --hardware h100-sxm --gpus 8 --context 131072 --json" +
            extra);
        EXPECT_EQ(r.status, 0) << r.out;
        const auto j = nlohmann::json::parse(r.out);
        for (const auto& c : j.at("configs"))
            if (c.at("dp") == 1 && c.at("pp") == 1 && c.at("cp") == 1 && c.at("tp") == 8 &&
                c.at("ep") == 1)
                return c.at("max_concurrency").get<int64_t>();
        ADD_FAILURE() << "no tp=8 row";
        return int64_t{0};
    };
    const int64_t windowed = conc(""), full = conc(" --all-full-attention");
    EXPECT_GT(full, 0);
    // Half the layers keep 128 tokens: about twice the 128K requests.
    EXPECT_GE(windowed, 2 * full - 1);
    EXPECT_LE(windowed, 2 * full + 1);
}

TEST(PerLayerCli, UnmodelledFieldsAndRunsOfPerLayerModelsAreRefused) {
    const std::string path = testing::TempDir() + "sinky_config.json";
    {
        FILE* f = std::fopen(path.c_str(), "w");
        std::fputs(R"({"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
            "attention_sink_tokens": 4})",
                   f);
        std::fclose(f);
    }
    const auto r = kvshard("layout --model " + path);
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_NE(r.out.find("'attention_sink_tokens' of model_type 'mistral'"), std::string::npos)
        << r.out;
    // The reference model runs every layer kind but Mamba-2, which is refused by name.
    const auto swa = kvshard("run --model tiny-swa --tp 2 --prompts 1 --prompt-len 16 --gen 2");
    EXPECT_EQ(swa.status, 0) << swa.out;
    const auto run = kvshard("run --model nemotron-h-8b --prompts 1 --prompt-len 16 --gen 2");
    EXPECT_EQ(run.status, 2) << run.out;
    EXPECT_NE(run.out.find("Mamba-2"), std::string::npos) << run.out;
    const auto models = kvshard("models --model " + config("nemotron-h-8b"));
    ASSERT_EQ(models.status, 0) << models.out;
    EXPECT_NE(models.out.find("\"layer_mix\": \"52 layers: 24 mamba2 + 24 none + 4 full\""),
              std::string::npos)
        << models.out;
}

// Decoder layers of several cache layers through the CLI: layout says which layers it counts, plan
// --explain prints decoder-layer ranges per stage, models the parameter count to set beside the
// published size (Falcon-H1-7B: 7.59B; LongCat-Flash-Chat: 560B, 18.6B-31.3B active), and
// --pp-layers counts decoder layers.
TEST(PerLayerCli, DecoderLayersOfSeveralCacheLayers) {
    const auto lay = kvshard("layout --model " + config("falcon-h1-7b-instruct") + " --pp 2");
    ASSERT_EQ(lay.status, 0) << lay.out;
    EXPECT_NE(lay.out.find("44 decoder layers of 2 cache layers (88 in all)"), std::string::npos)
        << lay.out;
    EXPECT_NE(lay.out.find("44 decoder layers x 2 cache layers: 44 full + 44 mamba2"),
              std::string::npos)
        << lay.out;
    EXPECT_NE(lay.out.find("cache lyr"), std::string::npos) << lay.out;
    EXPECT_NE(lay.out.find("[44,88)"), std::string::npos) << lay.out;
    const auto split =
        kvshard("layout --model " + config("falcon-h1-7b-instruct") + " --pp 2 --pp-layers 20,24");
    ASSERT_EQ(split.status, 0) << split.out;
    EXPECT_NE(split.out.find("[40,88)"), std::string::npos) << split.out;
    const auto bad =
        kvshard("layout --model " + config("falcon-h1-7b-instruct") + " --pp 2 --pp-layers 40,48");
    EXPECT_EQ(bad.status, 2) << bad.out;
    EXPECT_NE(bad.out.find("pp_layers sums to 88 but falcon_h1 has 44 decoder layers"),
              std::string::npos)
        << bad.out;

    const auto plan = kvshard("plan --model " + config("falcon-h1-7b-instruct") +
                              " --hardware h100-sxm -n 2 -c 8192 --explain pp=2");
    ASSERT_EQ(plan.status, 0) << plan.out;
    EXPECT_NE(plan.out.find("dec. lyrs"), std::string::npos) << plan.out;
    EXPECT_NE(plan.out.find("[22,44)"), std::string::npos) << plan.out;
    EXPECT_NE(plan.out.find("2 groups (1 full + 1 mamba2) of 44 layer slots model-wide (22 on this "
                            "GPU's stage), 0 of them padding; blocks of 1568 tokens"),
              std::string::npos)
        << plan.out;

    const auto falcon = kvshard("models --model " + config("falcon-h1-7b-instruct"));
    ASSERT_EQ(falcon.status, 0) << falcon.out;
    const auto f = nlohmann::json::parse(falcon.out);
    EXPECT_EQ(f.at("cache_layers_per_decoder_layer"), 2);
    EXPECT_NEAR(f.at("total_params").get<double>(), 7.59e9, 0.01e9);
    const auto longcat = kvshard("models --model " + config("longcat-flash-chat"));
    ASSERT_EQ(longcat.status, 0) << longcat.out;
    const auto l = nlohmann::json::parse(longcat.out);
    EXPECT_EQ(l.at("cache_layers_per_decoder_layer"), 3);
    EXPECT_EQ(l.at("kv_bytes_per_token"), 28 * 2 * (512 + 64) * 2);
    EXPECT_NEAR(l.at("total_params").get<double>(), 560e9, 0.005 * 560e9);
    // The reference model does not run them: refused with the reason.
    const auto run = kvshard("run --model " + config("falcon-h1-7b-instruct") + " --tp 1");
    EXPECT_EQ(run.status, 2) << run.out;
    EXPECT_NE(run.out.find("does not run it"), std::string::npos) << run.out;
}

}  // namespace
