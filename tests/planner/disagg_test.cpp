// Disaggregated serving search (planner/disagg.h), --weight-dtype and --trace
// (docs/cost-model.md, "Disaggregated serving").
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/disagg.h"
#include "kvshard/planner/planner.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {
namespace {

ParallelConfig cfg(int tp, int pp = 1, int cp = 1) {
    ParallelConfig p;
    p.tp = tp;
    p.pp = pp;
    p.cp = cp;
    p.cp_scheme = CpScheme::kZigzag;
    return p;
}

ServingRequest request(int gpus, int64_t prompt, double ttft, double tpot) {
    ServingRequest r;
    r.gpus = gpus;
    r.prompt_tokens = prompt;
    r.output_tokens = 256;
    r.ttft_slo_s = ttft;
    r.tpot_slo_s = tpot;
    return r;
}

TEST(KvTransfer, BytesAreTheTransferPlansAndEveryTokenMovesOnce) {
    const ModelSpec m = catalog_model("llama-3.1-70b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    for (auto [pf, dc] : {std::pair{cfg(4), cfg(8)}, {cfg(2, 1, 2), cfg(2, 2)}, {cfg(8), cfg(1)}}) {
        const KvTransferCost c = price_kv_transfer(m, pf, dc, hw, 1000, 0.5);
        // 8 KV heads, tp <= 8 on both sides: no replicated head, so the plan moves each token's KV
        // once: 80 layers x 2 x 8 heads x 128 x 2 bytes per token.
        EXPECT_EQ(c.bytes, int64_t{1000} * 80 * 2 * 8 * 128 * 2) << pf.to_string();
        EXPECT_GE(c.layerwise_messages, c.messages);
        EXPECT_GT(c.transfer_s, 0);
        EXPECT_LE(c.exposed_s, c.transfer_s);
        EXPECT_GE(c.exposed_s, c.transfer_s / m.num_layers - 1e-15);
    }
    // The same pair, priced straight from the plan.
    TransferEndpoint src, dst;
    src.layout = make_layout(m, cfg(4));
    dst.layout = make_layout(m, cfg(8));
    src.block_tables = sequential_block_tables(src.layout, 16, 777);
    dst.block_tables = sequential_block_tables(dst.layout, 16, 777);
    const TransferPlan plan = make_transfer_plan(src, dst, 777);
    const KvTransferCost c = price_kv_transfer(m, cfg(4), cfg(8), hw, 777, 0.1);
    EXPECT_EQ(c.bytes, plan.bytes);
    EXPECT_EQ(c.messages, static_cast<int64_t>(plan.messages.size()));
    // A longer prefill hides more of the same transfer; a very short one hides none of it.
    const double t = c.transfer_s;
    EXPECT_NEAR(price_kv_transfer(m, cfg(4), cfg(8), hw, 777, 0).exposed_s, t, 1e-12);
    EXPECT_LT(price_kv_transfer(m, cfg(4), cfg(8), hw, 777, 10 * t).exposed_s, t);
    // Sharing a node: NVLink, faster than the inter-node link.
    const KvTransferCost local = price_kv_transfer(m, cfg(2), cfg(4), hw, 777, 0);
    const KvTransferCost remote = price_kv_transfer(m, cfg(4), cfg(8), hw, 777, 0);
    EXPECT_FALSE(local.crosses_nodes);
    EXPECT_TRUE(remote.crosses_nodes);
}

// A decoder layer of several cache layers is written by the prefill at once: Falcon-H1's 88 cache
// layers are 44 decoder layers, and a long prefill hides all but the last one's share, 1 / 44 of
// the transfer (1 / 88 were each cache layer a step of its own).
TEST(KvTransfer, LayerwiseOverlapIsPerDecoderLayer) {
    const ModelSpec m = load_hf_config(std::string(KVSHARD_TEST_DATA_DIR) +
                                       "/hf_configs/falcon-h1-7b-instruct.json");
    ASSERT_EQ(m.num_layers, 88);
    ASSERT_EQ(m.num_decoder_layers(), 44);
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    const double t = price_kv_transfer(m, cfg(1), cfg(2), hw, 4096, 0).transfer_s;
    ASSERT_GT(t, 0);
    EXPECT_NEAR(price_kv_transfer(m, cfg(1), cfg(2), hw, 4096, 1000 * t).exposed_s, t / 44,
                1e-9 * t);
}

TEST(Serving, EntriesUseTheGpusAndThoseMeetingTheSlosComeFirstBestFirst) {
    const ModelSpec m = catalog_model("llama-3.1-70b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    const ServingRequest r = request(16, 8192, 2.0, 0.05);
    const auto entries = plan_serving(m, hw, r);
    int dis = 0, agg = 0;
    bool seen_miss = false;
    double last = 1e300;
    for (const ServingEntry& e : entries) {
        (e.disaggregated ? dis : agg)++;
        if (e.disaggregated) {
            EXPECT_EQ(e.prefill_instances * e.prefill.world_size() +
                          e.decode_instances * e.decode.world_size(),
                      16)
                << e.name();
            EXPECT_EQ(e.prefill.dp, 1);
            EXPECT_EQ(e.decode.dp, 1);
        } else {
            EXPECT_EQ(e.prefill.world_size(), 16);
            EXPECT_EQ(e.prefill_instances, e.prefill.dp);
        }
        if (!e.meets_slo) {
            seen_miss = true;
            EXPECT_FALSE(e.why_not.empty());
            continue;
        }
        EXPECT_FALSE(seen_miss) << "an entry meeting the SLOs after one missing them";
        EXPECT_LE(e.ttft_s, r.ttft_slo_s * (1 + 1e-9)) << e.name();
        EXPECT_LE(e.tpot_s, r.tpot_slo_s * (1 + 1e-9)) << e.name();
        EXPECT_LE(e.tokens_per_s_per_gpu, last);
        last = e.tokens_per_s_per_gpu;
        EXPECT_GT(e.requests_per_s, 0);
    }
    EXPECT_GT(dis, 0);
    EXPECT_EQ(agg, static_cast<int>(enumerate_configs(m, 16, CpScheme::kZigzag).size()));

    // Aggregated only: the same aggregated entries, no disaggregated ones.
    ServingRequest only = r;
    only.disaggregated = false;
    for (const ServingEntry& e : plan_serving(m, hw, only)) EXPECT_FALSE(e.disaggregated);
}

// MoE: EP may span the DP replicas of an aggregated configuration; every one is costed whole.
TEST(Serving, MoeConfigurationsWithEpAcrossReplicas) {
    const ModelSpec m = catalog_model("mixtral-8x7b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    const auto entries = plan_serving(m, hw, request(8, 4096, 2.0, 0.05));
    bool ep_over_dp = false;
    for (const ServingEntry& e : entries)
        ep_over_dp = ep_over_dp || (!e.disaggregated && e.decode.ep > e.decode.tp * e.decode.cp);
    EXPECT_TRUE(ep_over_dp);
    EXPECT_TRUE(entries.front().meets_slo);
}

// MTP speculation in P/D: vLLM starts the prefill instance with the same --speculative-config (its
// MTP layers draft at the end of the prefill: vllm-project/vllm PR #55055), so both pools hold the
// drafter and its layers' KV, and the transfer moves that KV with the model's (the MTP layer joins
// the model's KV cache groups).
TEST(Serving, SpeculatingBothPoolsHoldTheDrafterAndTheTransferMovesItsKv) {
    const ModelSpec m = catalog_model("glm-4.5-air");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    const ServingRequest plain = request(8, 8192, 2.0, 0.05);
    ServingRequest spec = plain;
    spec.capacity.speculative_tokens = 2;
    const auto a = plan_serving(m, hw, plain);
    const auto b = plan_serving(m, hw, spec);
    int compared = 0;
    for (const ServingEntry& e : b) {
        EXPECT_EQ(e.prefill.pp, 1) << e.name();
        EXPECT_EQ(e.decode.pp, 1) << e.name();
        if (!e.disaggregated) continue;
        // Every pair's transfer is kvshard's plan over the model with its MTP layer: 47 of 46
        // layers' KV (GLM-4.5-Air: 46 layers, one MTP layer, all full attention).
        const KvTransferCost t =
            price_kv_transfer(with_mtp_layers(m), e.prefill, e.decode, hw, 8192, e.prefill_s, 16);
        EXPECT_EQ(e.transfer.bytes, t.bytes) << e.name();
        for (const ServingEntry& p : a) {
            if (!p.disaggregated || p.name() != e.name()) continue;
            EXPECT_EQ(e.transfer.bytes * 46, p.transfer.bytes * 47) << e.name();
            // The drafter's weights and KV leave less room for requests on the decode side.
            EXPECT_LE(e.decode_batch, p.decode_batch) << e.name();
            ++compared;
        }
    }
    EXPECT_GT(compared, 0);
    const auto j = nlohmann::json::parse(serving_to_json(m, hw, spec, b));
    EXPECT_EQ(j["speculative_method"], "mtp");
    EXPECT_EQ(j["speculative_tokens"], 2);
    EXPECT_FALSE(
        nlohmann::json::parse(serving_to_json(m, hw, plain, a)).contains("speculative_tokens"));
    // A model without MTP layers: refused by the capacity's own message.
    ServingRequest tiny = spec;
    tiny.gpus = 2;
    try {
        plan_serving(catalog_model("tiny"), hw, tiny);
        FAIL() << "speculation accepted on a model without MTP layers";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("needs MTP layers"), std::string::npos) << e.what();
    }
}

// A decode instance's step is the cost model's at the request's prompt and mean context: the prompt
// places the context on the CP ranks. Gemma 3 27B's sliding windows (1024 tokens) at the end of a
// 32K zigzag prompt lie on one CP rank, so cp 2 reads the whole window there; priced with a prompt
// of one token (as before), the window was spread round-robin over both ranks: 20.065 ms against
// 20.136 ms.
TEST(Serving, DecodeStepIsPricedAtTheRequestsPrompt) {
    const ModelSpec m = catalog_model("gemma-3-27b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    ServingRequest r = request(4, 32768, 100, 1);
    r.max_batch = 1;
    Workload w;
    w.prompt_tokens = 32768;
    w.context_tokens = 32768 + 128;
    w.batch = 1;
    const double step = estimate_cost(m, cfg(1, 1, 2), hw, w).tpot_s;
    w.prompt_tokens = 1;
    const double one_token_prompt = estimate_cost(m, cfg(1, 1, 2), hw, w).tpot_s;
    ASSERT_GT(step, one_token_prompt * 1.002);
    int seen = 0;
    for (const ServingEntry& e : plan_serving(m, hw, r))
        if (e.disaggregated && e.decode.cp == 2 && e.decode.tp == 1 && e.decode.pp == 1) {
            EXPECT_DOUBLE_EQ(e.step_s, step) << e.name();
            ++seen;
        }
    EXPECT_GT(seen, 0);
}

TEST(Serving, TighterSlosNeverRaiseTheBestThroughput) {
    const ModelSpec m = catalog_model("llama-3.1-8b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    auto best = [&](double ttft, double tpot) {
        const auto e = plan_serving(m, hw, request(8, 4096, ttft, tpot));
        return e.front().meets_slo ? e.front().tokens_per_s_per_gpu : 0.0;
    };
    const double loose = best(2.0, 0.05);
    EXPECT_GT(loose, 0);
    EXPECT_LE(best(2.0, 0.02), loose);
    EXPECT_LE(best(0.5, 0.05), loose);
    EXPECT_LE(best(0.5, 0.02), std::min(best(2.0, 0.02), best(0.5, 0.05)));
}

TEST(Serving, PrefixHitsShortenPrefillAndRaiseThroughput) {
    const ModelSpec m = catalog_model("llama-3.1-8b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    ServingRequest r = request(8, 8192, 1.0, 0.05);
    const auto cold = plan_serving(m, hw, r);
    r.prefix_hit_rate = 0.75;
    const auto warm = plan_serving(m, hw, r);
    EXPECT_EQ(warm.front().prefill_tokens, 2048);
    EXPECT_GE(warm.front().tokens_per_s_per_gpu, cold.front().tokens_per_s_per_gpu);
    // The same configuration prefills faster; its KV transfer is still the whole prompt's.
    for (const ServingEntry& w : warm)
        for (const ServingEntry& c : cold)
            if (w.name() == c.name() && w.disaggregated) {
                EXPECT_LT(w.prefill_s, c.prefill_s);
                EXPECT_EQ(w.transfer.bytes, c.transfer.bytes);
            }
}

// A spread of prompt lengths with the same mean: prefill time is convex in the length (attention is
// quadratic) and the M/G/1 wait grows with the spread, so no configuration does better.
TEST(Serving, ASpreadOfPromptLengthsNeverBeatsTheirMean) {
    const ModelSpec m = catalog_model("llama-3.1-8b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    ServingRequest fixed = request(8, 8192, 1.0, 0.05);
    ServingRequest spread = fixed;
    spread.prompt_samples = {1024, 1024, 1024, 29696};  // mean 8192
    const auto a = plan_serving(m, hw, fixed), b = plan_serving(m, hw, spread);
    int compared = 0;
    for (const ServingEntry& x : a)
        for (const ServingEntry& y : b)
            if (x.name() == y.name() && x.meets_slo && y.meets_slo) {
                EXPECT_GE(y.prefill_s, x.prefill_s) << x.name();
                EXPECT_LE(y.tokens_per_s_per_gpu, x.tokens_per_s_per_gpu * (1 + 1e-9)) << x.name();
                ++compared;
            }
    EXPECT_GT(compared, 0);
    spread.prompt_samples = {0};
    EXPECT_THROW(plan_serving(m, hw, spread), Error);
}

// Every prompt of the distribution is checked, not only their mean: vLLM refuses a prompt of
// max_model_len tokens or more (vllm/v1/engine/input_processor.py,
// InputProcessor._validate_prompt_len), so one such prompt makes the request one vLLM never serves.
TEST(Serving, EveryPromptOfTheDistributionIsWithinTheModelsLength) {
    const ModelSpec m = catalog_model("llama-3.1-8b");  // max_model_len 131072
    ASSERT_EQ(m.max_model_len, 131072);
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    ServingRequest r = request(8, 8192, 10.0, 0.05);
    r.prompt_samples = {1024, 131071, 1024};
    EXPECT_FALSE(plan_serving(m, hw, r).empty());
    r.prompt_samples = {1024, 1024, 131072};  // prompt_tokens (8192) is well within
    try {
        plan_serving(m, hw, r);
        FAIL() << "a prompt of max_model_len tokens was accepted";
    } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("prompt 2 of the distribution (131072 tokens) is more KV than model "
                            "'llama-3.1-8b' computes for one request"),
                  std::string::npos)
            << what;
        EXPECT_NE(what.find("give at most 131071 tokens"), std::string::npos) << what;
    }
    r.capacity.allow_long_context = true;
    EXPECT_FALSE(plan_serving(m, hw, r).empty());
}

TEST(Serving, BadRequestsAreErrors) {
    const ModelSpec m = catalog_model("llama-3.1-8b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    EXPECT_THROW(plan_serving(m, hw, request(8, 4096, 0, 0.05)), Error);
    EXPECT_THROW(plan_serving(m, hw, request(8, 4096, 1, -1)), Error);
    ServingRequest r = request(8, 4096, 1, 0.05);
    r.prefix_hit_rate = 1;
    EXPECT_THROW(plan_serving(m, hw, r), Error);
    // SLOs past 1e6 s made the M/G/1 queue inf and NaN in the table (1e30, 1e308).
    EXPECT_THROW(plan_serving(m, hw, request(8, 4096, 1e30, 0.05)), Error);
    EXPECT_THROW(plan_serving(m, hw, request(8, 4096, 2, 1e308)), Error);
    EXPECT_NO_THROW(plan_serving(m, hw, request(8, 4096, ServingRequest::kMaxSloS, 0.05)));
    // Each prefill chunk is costed per stage: 2^31 - 1 of them ran out of memory.
    ServingRequest chunks = request(8, 4096, 1, 0.05);
    chunks.cost.pp_prefill_chunks = 2147483647;
    EXPECT_THROW(plan_serving(m, hw, chunks), Error);
    chunks.cost.pp_prefill_chunks = CostOptions::kMaxPpPrefillChunks;
    EXPECT_NO_THROW(chunks.validate());
}

TEST(WeightDtype, Fp8HalvesAndFp4QuartersTheWeightsSoMoreKvFits) {
    const ModelSpec m = catalog_model("llama-3.1-70b");
    const HardwareSpec hw = hardware_by_name("h100-sxm");
    CapacityOptions o;
    auto cap = [&](WeightDtype w) {
        o.weight_dtype = w;
        return compute_capacity(m, cfg(1), hw, o);
    };
    const CapacityReport bf16 = cap(WeightDtype::kBf16), fp8 = cap(WeightDtype::kFp8),
                         fp4 = cap(WeightDtype::kFp4);
    EXPECT_EQ(cap(WeightDtype::kModel).weight_bytes_per_gpu, bf16.weight_bytes_per_gpu);
    EXPECT_NEAR(double(fp8.weight_bytes_per_gpu) / bf16.weight_bytes_per_gpu, 0.5, 1e-6);
    EXPECT_NEAR(double(fp4.weight_bytes_per_gpu) / bf16.weight_bytes_per_gpu, 0.25, 1e-6);
    EXPECT_FALSE(bf16.fits);  // 70B in bf16 is 131 GiB on one GPU; in fp8 66 GiB
    EXPECT_TRUE(fp8.fits);
    EXPECT_GT(fp4.kv_tokens_per_gpu, fp8.kv_tokens_per_gpu);
    EXPECT_EQ(parse_weight_dtype("fp4"), WeightDtype::kFp4);
    EXPECT_THROW(parse_weight_dtype("int3"), Error);
    // Decode reads the weights every step: fewer bytes, a shorter step.
    Workload w;
    w.prompt_tokens = 1024;
    w.context_tokens = 1024;
    w.batch = 1;
    CostOptions c8, c16;
    c8.weight_dtype = WeightDtype::kFp8;
    c16.weight_dtype = WeightDtype::kBf16;
    EXPECT_LT(estimate_cost(m, cfg(8), hw, w, c8).tpot_s,
              estimate_cost(m, cfg(8), hw, w, c16).tpot_s);
}

// The must-show command: the transfer bytes of its best disaggregated pair are those of
// `kvshard transfer-plan` between the same two layouts.
TEST(ServingCli, DisaggTransferBytesEqualTransferPlan) {
    const std::string base =
        "plan --disagg --model llama-3.1-70b --hardware h100-sxm --gpus 16 --context 8192 "
        "--ttft-slo 2 --tpot-slo 0.05";
    const auto r = test::run_cli(base + " --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    const nlohmann::json* chosen = nullptr;
    for (const auto& c : j.at("configs"))
        if (c.at("disaggregated").get<bool>() && c.at("meets_slo").get<bool>()) {
            chosen = &c;
            break;
        }
    ASSERT_NE(chosen, nullptr) << "no disaggregated configuration meets the SLOs";
    const std::string from = chosen->at("prefill").at("layout").get<std::string>();
    const std::string to = chosen->at("decode").at("layout").get<std::string>();
    const auto t = test::run_cli("transfer-plan --model llama-3.1-70b --from '" + from +
                                 "' --to '" + to + "' --tokens 8192 --json");
    ASSERT_EQ(t.status, 0) << t.out;
    const auto tj = nlohmann::json::parse(t.out);
    EXPECT_EQ(chosen->at("transfer").at("bytes").get<int64_t>(), tj.at("bytes").get<int64_t>());
    EXPECT_EQ(chosen->at("transfer").at("messages").get<int64_t>(),
              tj.at("messages").get<int64_t>());

    const auto text = test::run_cli(base + " --explain best");
    ASSERT_EQ(text.status, 0) << text.out;
    EXPECT_NE(text.out.find("KV transfer"), std::string::npos) << text.out;
    EXPECT_EQ(test::run_cli(base + " --explain 0").status, 2);
    EXPECT_EQ(test::run_cli(base + " --output-tokens -5").status, 2);
    EXPECT_EQ(test::run_cli(base + " --weight-dtype int3").status, 2);
    EXPECT_EQ(
        test::run_cli("plan --model llama-3.1-70b --gpus 16 --context 8192 --ttft-slo 2").status,
        2);
}

// Flags that used to be accepted and ignored: --explain N with --json (the whole table came out),
// --explain 1abc (read as 1), --json --top N (every configuration came out, with or without
// --disagg), --route without
// --trace, --output-tokens without --disagg, --explain with --top.
TEST(ServingCli, FlagsAreUsedOrRefused) {
    const std::string base = "plan --model tiny --gpus 8 --context 1024";
    const std::string disagg = base + " --disagg --ttft-slo 2 --tpot-slo 0.05";
    const auto one = test::run_cli(disagg + " --json --explain 3");
    ASSERT_EQ(one.status, 0) << one.out;
    const auto all = test::run_cli(disagg + " --json");
    ASSERT_EQ(all.status, 0) << all.out;
    const auto oj = nlohmann::json::parse(one.out), aj = nlohmann::json::parse(all.out);
    ASSERT_EQ(oj.at("configs").size(), 1u);
    ASSERT_GT(aj.at("configs").size(), 3u);
    EXPECT_EQ(oj.at("configs")[0], aj.at("configs")[2]);
    const auto bad = test::run_cli(disagg + " --explain 1abc");
    EXPECT_EQ(bad.status, 2) << bad.out;
    EXPECT_NE(bad.out.find("--explain takes a rank of the table"), std::string::npos) << bad.out;

    const auto dtop = test::run_cli(disagg + " --json --top 2");
    ASSERT_EQ(dtop.status, 0) << dtop.out;
    const auto dj = nlohmann::json::parse(dtop.out);
    ASSERT_EQ(dj.at("configs").size(), 2u);
    for (const auto& c : dj.at("configs")) EXPECT_TRUE(c.at("meets_slo").get<bool>());

    const auto top = test::run_cli(base + " --json --top 2");
    ASSERT_EQ(top.status, 0) << top.out;
    const auto tj = nlohmann::json::parse(top.out);
    ASSERT_EQ(tj.at("configs").size(), 2u);
    for (const auto& c : tj.at("configs")) EXPECT_TRUE(c.at("fits").get<bool>());

    for (const auto& [args, needle] :
         {std::pair{base + " --route cost", "--route requires --trace"},
          {base + " --output-tokens 5", "--output-tokens requires --disagg"},
          {base + " --explain tp=8 --top 3", "drop --explain, or drop --svg and --top"},
          {base + " --disagg --tpot-slo 0.05 --ttft-slo 1e30",
           "the TTFT SLO must be a positive number of seconds up to"},
          {base + " --pp-chunks 2147483647", "pp_prefill_chunks must be in [0, 1024]"}}) {
        const auto r = test::run_cli(args);
        EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
        EXPECT_NE(r.out.find(needle), std::string::npos) << args << "\n" << r.out;
    }
}

// --trace on the repository's Mooncake sample: the replay's prefix-hit rate shortens TTFT by about
// the share it says, and leaves the decode step (TPOT) as it was.
TEST(ServingCli, TraceHitRateShortensPrefill) {
    const std::string trace =
        std::string(KVSHARD_TEST_DATA_DIR) + "/mooncake_conversation_head300.jsonl";
    const std::string base =
        "plan --model llama-3.1-8b --hardware h100-sxm --gpus 8 --context 8192 --json";
    const auto cold = test::run_cli(base);
    const auto warm = test::run_cli(base + " --trace " + trace);
    ASSERT_EQ(cold.status, 0) << cold.out;
    ASSERT_EQ(warm.status, 0) << warm.out;
    const auto cj = nlohmann::json::parse(cold.out), wj = nlohmann::json::parse(warm.out);
    ASSERT_TRUE(wj.contains("prefix_hit_rate"));
    const double hit = wj.at("prefix_hit_rate").get<double>();
    EXPECT_GT(hit, 0.05);  // conversations share their history
    EXPECT_LT(hit, 1.0);
    int compared = 0;
    for (const auto& w : wj.at("configs")) {
        if (!w.at("fits").get<bool>()) continue;
        for (const auto& c : cj.at("configs")) {
            if (c.at("dp") != w.at("dp") || c.at("pp") != w.at("pp") || c.at("cp") != w.at("cp") ||
                c.at("tp") != w.at("tp") || c.at("ep") != w.at("ep"))
                continue;
            const double ratio = w.at("ttft_s").get<double>() / c.at("ttft_s").get<double>();
            EXPECT_LT(ratio, 1.0);
            // Prefill time is close to linear in the new tokens here (8K tokens, attention a
            // minor part), so the ratio is about 1 - hit, never below it by much.
            EXPECT_GT(ratio, (1 - hit) * 0.8);
            EXPECT_DOUBLE_EQ(w.at("tpot_s").get<double>(), c.at("tpot_s").get<double>());
            ++compared;
        }
    }
    EXPECT_GT(compared, 0);
}

}  // namespace
}  // namespace kvshard
