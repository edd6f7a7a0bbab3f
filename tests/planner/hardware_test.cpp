#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "kvshard/common/error.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {
namespace {

TEST(Hardware, CatalogMatchesReference) {
    EXPECT_EQ(hardware_names(), (std::vector<std::string>{"a100-80g", "b200", "h100-sxm", "h200"}));
    const auto h = hardware_by_name("h100-sxm");
    EXPECT_EQ(h.memory_bytes, int64_t{80} << 30);
    EXPECT_DOUBLE_EQ(h.hbm_bw, 3.35e12);
    EXPECT_DOUBLE_EQ(h.flops_bf16, 989e12);
    EXPECT_DOUBLE_EQ(h.flops_fp8, 1979e12);
    EXPECT_DOUBLE_EQ(h.nvlink_bw, 450e9);
    EXPECT_DOUBLE_EQ(h.internode_bw, 50e9);
    EXPECT_DOUBLE_EQ(h.achieved_hbm_bw(), 3.35e12 * 0.8);
    EXPECT_DOUBLE_EQ(h.link_bw(false), 450e9 * 0.8);
    // Calibrated defaults (calibration_test.cpp, BENCHMARKS.md "Planner").
    EXPECT_DOUBLE_EQ(h.hop_latency_s(false), 1e-6);
    EXPECT_DOUBLE_EQ(h.hop_latency_s(true), 30e-6);
    EXPECT_DOUBLE_EQ(h.collective_launch_s, 5e-6);
    EXPECT_DOUBLE_EQ(h.achieved_flops(DType::kFp8), 1979e12 * 0.6);
    // A100 has no fp8: the bf16 rate is used.
    EXPECT_DOUBLE_EQ(hardware_by_name("a100-80g").achieved_flops(DType::kFp8), 312e12 * 0.6);
    EXPECT_EQ(hardware_by_name("h200").memory_bytes, int64_t{141} << 30);
    EXPECT_DOUBLE_EQ(hardware_by_name("b200").nvlink_bw, 900e9);
}

TEST(Hardware, JsonOverridesAndRoundTrips) {
    auto h = parse_hardware_json(R"({"base": "h100-sxm", "hbm_efficiency": 0.7, "memory_gib": 96})",
                                 "x.json");
    EXPECT_DOUBLE_EQ(h.hbm_efficiency, 0.7);
    EXPECT_EQ(h.memory_bytes, int64_t{96} << 30);
    EXPECT_DOUBLE_EQ(h.hbm_bw, 3.35e12);
    const auto full = parse_hardware_json(to_json(hardware_by_name("b200")), "b.json");
    EXPECT_EQ(full, hardware_by_name("b200"));
    EXPECT_EQ(parse_hardware_json(to_json(hardware_by_name("h100-sxm")), "h.json"),
              hardware_by_name("h100-sxm"));
    // The protocol and NVLS terms (docs/cost-model.md, "Protocols inside a node").
    h = parse_hardware_json(R"({"base": "h100-sxm", "nvls_bus_bw_gbps": 0,
        "nvlink_ll_bw_fraction": 1, "nvlink_simple_hop_latency_s": 1e-6, "nvls_latency_s": 2e-5})",
                            "p.json");
    EXPECT_EQ(h.nvls_bus_bw, 0);
    EXPECT_DOUBLE_EQ(h.nvlink_ll_bw_fraction, 1);
    EXPECT_DOUBLE_EQ(h.nvlink_simple_hop_latency_s, 1e-6);
    EXPECT_DOUBLE_EQ(h.nvls_latency_s, 2e-5);
    EXPECT_DOUBLE_EQ(hardware_by_name("h100-sxm").nvls_bus_bw, 480e9);
    h = parse_hardware_json(R"({"name": "mi300x", "memory_gib": 192, "hbm_bw_gbps": 5300,
        "flops_bf16_tflops": 1307, "nvlink_bw_gbps": 448, "internode_bw_gbps": 50})",
                            "m.json");
    EXPECT_EQ(h.name, "mi300x");
    EXPECT_DOUBLE_EQ(h.hbm_bw, 5.3e12);
    EXPECT_DOUBLE_EQ(h.flops_bf16, 1307e12);
}

TEST(Hardware, BadInputsNameTheProblem) {
    auto expect_error = [](const std::string& json, const std::string& needle) {
        try {
            parse_hardware_json(json, "hw.json");
            ADD_FAILURE() << "accepted " << json;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    expect_error("{", "not valid JSON");
    expect_error("[1]", "JSON object");
    expect_error(R"({"memory_gib": 80})", "missing field 'hbm_bw'");
    expect_error(R"({"base": "h100-sxm", "hbm_effciency": 0.7})", "unknown field 'hbm_effciency'");
    expect_error(R"({"base": "h100-sxm", "hbm_efficiency": 1.7})",
                 "hbm_efficiency must be in (0, 1]");
    expect_error(R"({"base": "h100-sxm", "nvlink_bw": "fast"})", "'nvlink_bw' must be a number");
    expect_error(R"({"base": "tpu"})", "unknown hardware 'tpu'");
    // A name that is not a string was ignored (the GPU was called h100-sxm-custom).
    expect_error(R"({"base": "h100-sxm", "name": 5})", "field 'name' must be a string");
    expect_error(R"({"base": "h100-sxm", "gpus_per_node": 0})",
                 "'gpus_per_node' must be an integer in [1, 2^20]");
    // Found by fuzz_hardware_json: a value outside int's range was cast (undefined behaviour).
    expect_error(R"({"base": "h100-sxm", "gpus_per_node": 450000000000.0})",
                 "'gpus_per_node' must be an integer in [1, 2^20], got 4.5e+11");
    expect_error(R"({"base": "h100-sxm", "nvlink_ll_bw_fraction": 0})",
                 "nvlink_ll_bw_fraction must be in (0, 1]");
    expect_error(R"({"base": "h100-sxm", "nvls_bus_bw": -1})", "nvls_bus_bw must be >= 0");
    expect_error(R"({"base": "h100-sxm", "nvls_latency_s": 5})",
                 "nvls_latency_s must be in [0, 1]");
    expect_error(R"({"base": "h100-sxm", "nvlink_simple_hop_latency_s": -1})",
                 "nvlink_simple_hop_latency_s must be in [0, 1]");
    EXPECT_THROW(hardware_by_name("h300"), Error);
    EXPECT_THROW(resolve_hardware("/nonexistent/hw.json"), Error);
}

TEST(Hardware, ResolvesFiles) {
    const std::string path = testing::TempDir() + "kvshard_hw_test.json";
    std::ofstream(path) << R"({"base": "h200", "compute_efficiency": 0.5})";
    const auto h = resolve_hardware(path);
    EXPECT_DOUBLE_EQ(h.compute_efficiency, 0.5);
    EXPECT_EQ(h.memory_bytes, int64_t{141} << 30);
    std::remove(path.c_str());
}

}  // namespace
}  // namespace kvshard
