// `kvshard run --kv-dtype`: the pools hold the asked dtype. Per-rank KV bytes at one byte per
// element plus the fp8 scales equal the layout's prediction; --verify checks sharded against
// unsharded at that dtype and reports the fp32-KV run's distance beside it; the disaggregated run
// moves bf16 pages (half the fp32 bytes) and fp8 pages with their block scales.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "cli_runner.h"
#include "kvshard/model/catalog.h"

namespace {

using kvshard::test::run_cli;

TEST(KvDtypeCli, Fp8Tp2VerifyJsonShowsOneBytePerElementPlusScales) {
    const auto r = run_cli("run --model tiny --kv-dtype fp8 --tp 2 --verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["kv_dtype"], "fp8");
    const kvshard::ModelSpec m = kvshard::catalog_model("tiny");
    const int64_t bs = 16;  // the default --block-size
    ASSERT_EQ(j["ranks"].size(), 2u);
    for (const auto& rk : j["ranks"]) {
        const int64_t layers = rk["layers"][1].get<int64_t>() - rk["layers"][0].get<int64_t>();
        const auto heads = static_cast<int64_t>(rk["kv_heads"].size());
        const int64_t block = bs * layers * 2 * heads * m.head_dim * 1  // e4m3 elements
                              + layers * 2 * heads * 4;                 // fp32 scales
        const auto bytes = rk["kv_bytes"].get<int64_t>();
        EXPECT_EQ(rk["kv_bytes"], rk["kv_bytes_predicted"]);
        EXPECT_GT(bytes, 0);
        EXPECT_EQ(bytes % block, 0) << bytes << " not whole fp8 blocks of " << block;
        EXPECT_GE(bytes / block, (rk["kv_tokens"].get<int64_t>() + bs - 1) / bs);
    }
    const auto& v = j["verify"];
    EXPECT_EQ(v["kv_dtype"], "fp8");
    EXPECT_EQ(v["ok"], true);
    EXPECT_EQ(v["tokens_match"], true);
    EXPECT_LT(v["max_rel_err"].get<double>(), 1e-4);
    ASSERT_TRUE(v["fp32_reference"].is_object()) << v.dump();
    EXPECT_GT(v["fp32_reference"]["max_rel_err"].get<double>(), 1e-6);

    const auto text = run_cli("run --model tiny --kv-dtype fp8 --tp 2 --verify");
    ASSERT_EQ(text.status, 0) << text.out;
    EXPECT_NE(text.out.find("against the unsharded run with fp8 KV"), std::string::npos)
        << text.out;
    EXPECT_NE(text.out.find("quantization: fp8 KV against the unsharded run with fp32 KV"),
              std::string::npos)
        << text.out;
    EXPECT_EQ(text.out.find("MISMATCH"), std::string::npos) << text.out;
}

TEST(KvDtypeCli, Fp32RunReportsNoQuantization) {
    const auto r = run_cli("run --model tiny --tp 2 --gen 4 --verify --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["kv_dtype"], "fp32");
    EXPECT_TRUE(j["verify"]["fp32_reference"].is_null());
}

TEST(KvDtypeCli, DisaggregatedRunMovesBf16AndRefusesFp8) {
    const std::string args =
        "run --model tiny --prefill tp=1 --decode tp=2 --prompts 2 --prompt-len 20 --gen 4 "
        "--verify --json";
    const auto b = run_cli(args + " --kv-dtype bf16");
    ASSERT_EQ(b.status, 0) << b.out;
    const auto f = run_cli(args + " --kv-dtype fp32");
    ASSERT_EQ(f.status, 0) << f.out;
    const auto jb = nlohmann::json::parse(b.out), jf = nlohmann::json::parse(f.out);
    EXPECT_EQ(jb["kv_dtype"], "bf16");
    EXPECT_EQ(jb["verify"]["ok"], true);
    EXPECT_EQ(jb["verify"]["tokens_match"], true);
    ASSERT_TRUE(jb["verify"]["fp32_reference"].is_object());
    EXPECT_GT(jb["verify"]["fp32_reference"]["max_rel_err"].get<double>(), 1e-7);
    EXPECT_EQ(jb["transfer"]["bytes"], jb["transfer"]["min_bytes"]);
    EXPECT_EQ(2 * jb["transfer"]["bytes"].get<int64_t>(), jf["transfer"]["bytes"].get<int64_t>());
}

// fp8 through the transfer: pages byte for byte plus each block's scales; decode then matches the
// unsharded fp8 run. Different block sizes on the two sides are refused (the scales are per block).
TEST(KvDtypeCli, DisaggregatedRunMovesFp8WithScales) {
    for (const std::string layouts :
         {"--prefill tp=1 --decode tp=2", "--prefill tp=2,pp=2 --decode tp=4",
          "--prefill pp=2 --decode tp=2,pp=2"}) {
        const auto r = run_cli("run --model tiny --kv-dtype fp8 " + layouts +
                               " --prompts 3 --prompt-len 21 --gen 6 --verify --json");
        ASSERT_EQ(r.status, 0) << layouts << "\n" << r.out;
        const auto j = nlohmann::json::parse(r.out);
        EXPECT_EQ(j["kv_dtype"], "fp8");
        EXPECT_EQ(j["verify"]["ok"], true) << layouts;
        EXPECT_EQ(j["verify"]["tokens_match"], true) << layouts;
        EXPECT_LT(j["verify"]["max_rel_err"].get<double>(), 1e-4) << layouts;
        EXPECT_GT(j["verify"]["fp32_reference"]["max_rel_err"].get<double>(), 1e-6) << layouts;
        EXPECT_EQ(j["failed_requests"], 0);
    }
    const auto bad = run_cli(
        "run --model tiny --kv-dtype fp8 --prefill tp=1 --decode tp=2 --decode-block-size 8 "
        "--prompts 1 --gen 2");
    EXPECT_EQ(bad.status, 2) << bad.out;
    EXPECT_NE(bad.out.find("use the same block size on both sides"), std::string::npos) << bad.out;
}

}  // namespace
