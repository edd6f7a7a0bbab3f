#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/planner.h"

namespace kvshard {
namespace {

TEST(Enumerate, EveryFactorisationThatValidates) {
    // 16 = 2^4 over four factors (dp, pp, cp, tp): C(7,3) = 35, all valid for llama-3.1-8b.
    EXPECT_EQ(enumerate_configs(catalog_model("llama-3.1-8b"), 16, CpScheme::kZigzag).size(), 35u);
    // tp must divide the 64 query heads and meet the 8 KV heads: 6 GPUs allow tp 1 and 2 only.
    for (const auto& p : enumerate_configs(catalog_model("llama-3.1-70b"), 6, CpScheme::kZigzag)) {
        EXPECT_TRUE(p.tp == 1 || p.tp == 2) << p.to_string();
        EXPECT_EQ(p.world_size(), 6);
        EXPECT_EQ(p.ep, 1);
    }
    // MoE: ep over the divisors of 8 experts that divide dp*cp*tp.
    const auto moe = enumerate_configs(catalog_model("mixtral-8x7b"), 8, CpScheme::kZigzag);
    bool saw_tp4_ep8 = false;
    for (const auto& p : moe) {
        EXPECT_EQ(8 % p.ep, 0);
        EXPECT_EQ(p.stage_size() % p.ep, 0) << p.to_string();
        saw_tp4_ep8 = saw_tp4_ep8 || (p.tp == 4 && p.dp == 2 && p.ep == 8);
    }
    EXPECT_TRUE(saw_tp4_ep8);
}

TEST(Plan, MustShow405bOn16H100At128k) {
    const auto m = catalog_model("llama-3.1-405b");
    const auto hw = hardware_by_name("h100-sxm");
    PlanRequest r;
    r.gpus = 16;
    r.context_tokens = 131072;
    const auto entries = plan(m, hw, r);
    ASSERT_EQ(entries.size(), 35u);
    ASSERT_TRUE(entries.front().fits);
    int fitting = 0;
    for (const auto& e : entries) {
        fitting += e.fits;
        if (!e.fits) continue;
        // The engines' formula: floor((mem * 0.9 - weights - reserve) / KV bytes per token) in
        // blocks, KV bytes per token = layers on the GPU * 2 * max(1, 8 / tp) * 128 * 2.
        const auto& c = e.capacity;
        const auto& p = e.parallel;
        const auto split = pp_layer_split(m, p);
        const int64_t layers = split.front();  // the first stage has the most layers
        EXPECT_EQ(c.ranks[0].kv_bytes_per_token, layers * 2 * std::max(1, 8 / p.tp) * 128 * 2);
        for (const auto& rc : c.ranks) {
            const int64_t budget = static_cast<int64_t>((int64_t{80} << 30) * 0.9) -
                                   rc.weights.total() - (int64_t{2} << 30);
            EXPECT_EQ(rc.kv_tokens, budget / rc.kv_bytes_per_token / 16 * 16);
        }
        EXPECT_GE(c.max_context, 131072);
        EXPECT_GT(e.cost.ttft_s, 0);
        EXPECT_GT(e.cost.tpot_s, 0);
    }
    EXPECT_GE(fitting, 1);
    // Best first by throughput among the fitting ones; the non-fitting come last.
    for (size_t i = 1; i < entries.size(); ++i) {
        if (entries[i].fits) {
            EXPECT_GE(entries[i - 1].cost.decode_tokens_per_s, entries[i].cost.decode_tokens_per_s);
            EXPECT_TRUE(entries[i - 1].fits);
        }
    }
}

TEST(Plan, ObjectivesOrderTheirKey) {
    const auto m = catalog_model("llama-3.1-70b");
    const auto hw = hardware_by_name("h200");
    PlanRequest r;
    r.gpus = 8;
    r.context_tokens = 32768;
    for (auto o : {Objective::kTtft, Objective::kTpot}) {
        r.objective = o;
        const auto entries = plan(m, hw, r);
        for (size_t i = 1; i < entries.size() && entries[i].fits; ++i) {
            const auto key = [&](const PlanEntry& e) {
                return o == Objective::kTtft ? e.cost.ttft_s : e.cost.tpot_s;
            };
            EXPECT_LE(key(entries[i - 1]), key(entries[i]));
        }
    }
    // A fixed batch larger than what fits marks the configuration as not fitting.
    r.batch = 1000000;
    for (const auto& e : plan(m, hw, r)) EXPECT_FALSE(e.fits);
}

TEST(Plan, JsonHasTheIssueKeysBestFirst) {
    PlanRequest r;
    r.gpus = 8;
    r.context_tokens = 8192;
    const auto m = catalog_model("mixtral-8x7b");
    const auto hw = hardware_by_name("a100-80g");
    const auto entries = plan(m, hw, r);
    const auto j = nlohmann::json::parse(plan_to_json(m, hw, r, entries));
    ASSERT_EQ(j["configs"].size(), entries.size());
    for (const char* k : {"dp", "pp", "cp", "tp", "ep", "fits", "kv_tokens_per_gpu", "max_context",
                          "ttft_s", "tpot_s"})
        EXPECT_TRUE(j["configs"][0].contains(k)) << k;
    EXPECT_EQ(j["configs"][0]["tp"], entries[0].parallel.tp);
    const std::string svg = plan_to_svg(m, hw, r, entries);
    EXPECT_EQ(svg.rfind("<svg", 0), 0u);
    EXPECT_NE(svg.find("</svg>"), std::string::npos);
    EXPECT_NE(svg.find("mixtral-8x7b"), std::string::npos);
}

TEST(Plan, BadRequestsAreErrors) {
    const auto m = catalog_model("tiny");
    const auto hw = hardware_by_name("h100-sxm");
    PlanRequest r;
    r.gpus = 0;
    r.context_tokens = 10;
    EXPECT_THROW(plan(m, hw, r), Error);
    r.gpus = 2;
    r.context_tokens = 0;
    EXPECT_THROW(plan(m, hw, r), Error);
    r.context_tokens = 10;
    r.batch = -1;
    EXPECT_THROW(plan(m, hw, r), Error);
    EXPECT_THROW(parse_objective("cost"), Error);
}

TEST(Plan, SpeculatingTheSearchTakesPipelineStagesWithTheDrafterOnTheLast) {
    // vLLM runs the MTP drafter on the last PP rank (GPUModelRunner.__init__): the search keeps
    // pp > 1 configurations, and the JSON gives the drafter bytes of the GPU that holds them.
    PlanRequest r;
    r.gpus = 4;
    r.context_tokens = 1024;
    r.capacity.speculative_tokens = 2;
    const auto m = catalog_model("glm-4.5-air");
    const auto hw = hardware_by_name("h100-sxm");
    const auto entries = plan(m, hw, r);
    const auto j = nlohmann::json::parse(plan_to_json(m, hw, r, entries));
    bool pp2 = false;
    for (const auto& c : j["configs"]) {
        if (c["pp"] != 2 || c["tp"] != 2) continue;
        pp2 = true;
        ParallelConfig p;
        p.pp = 2;
        p.tp = 2;
        EXPECT_EQ(c["drafter_weight_bytes_per_gpu"], rank_drafter_weight_bytes(m, p, 3));
        EXPECT_GT(c["drafter_weight_bytes_per_gpu"].get<int64_t>(), 0);
        EXPECT_EQ(rank_drafter_weight_bytes(m, p, 0), 0);
    }
    EXPECT_TRUE(pp2) << "no pp=2 tp=2 configuration among " << j["configs"].size();
}

}  // namespace
}  // namespace kvshard
