#include "kvshard/planner/hardware.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

constexpr double kGB = 1e9;  // link and HBM rates: decimal GB/s, as datasheets give them
constexpr double kTflop = 1e12;
constexpr int64_t kGiB = int64_t{1} << 30;

HardwareSpec make(std::string name, int64_t memory_gib, double hbm_tbps, double bf16_tflops,
                  double fp8_tflops, double nvlink_gbps, double internode_gbps) {
    HardwareSpec h;
    h.name = std::move(name);
    h.memory_bytes = memory_gib * kGiB;
    h.hbm_bw = hbm_tbps * 1e12;
    h.flops_bf16 = bf16_tflops * kTflop;
    h.flops_fp8 = fp8_tflops * kTflop;
    h.gpus_per_node = 8;
    h.nvlink_bw = nvlink_gbps * kGB;
    h.internode_bw = internode_gbps * kGB;
    return h;
}

// NVLink SHARP's all-reduce bus bandwidth on a full 8-GPU host: ~480 GB/s on H100 (S. Jeaugey,
// NVIDIA, NVIDIA/nccl-tests issue #212; NVIDIA/nccl issue #1442: "a 30% improvement" over the
// ring's 370). H200 has the same NVSwitch. A100's NVSwitch has no SHARP; for B200 no figure was
// found, so none is priced (docs/cost-model.md, "Protocols inside a node").
HardwareSpec with_nvls(HardwareSpec h, double nvls_bus_gbps) {
    h.nvls_bus_bw = nvls_bus_gbps * kGB;
    return h;
}

// ../shared/reference/hardware.md (datasheets; NVIDIA aiconfigurator system files use the same).
const std::map<std::string, HardwareSpec, std::less<>>& catalog() {
    static const std::map<std::string, HardwareSpec, std::less<>> kCatalog = {
        {"a100-80g", make("a100-80g", 80, 2.039, 312, 0, 300, 25)},
        {"h100-sxm", with_nvls(make("h100-sxm", 80, 3.35, 989, 1979, 450, 50), 480)},
        {"h200", with_nvls(make("h200", 141, 4.8, 989, 1979, 450, 50), 480)},
        {"b200", make("b200", 180, 7.7, 2250, 4500, 900, 100)},
    };
    return kCatalog;
}

std::string known_names() {
    std::string s;
    for (const auto& [n, _] : catalog()) s += (s.empty() ? "" : ", ") + n;
    return s;
}

}  // namespace

double HardwareSpec::achieved_flops(DType weights) const {
    const double peak = (weights == DType::kFp8 && flops_fp8 > 0) ? flops_fp8 : flops_bf16;
    return peak * compute_efficiency;
}

double HardwareSpec::link_bw(bool crosses_nodes) const {
    return crosses_nodes ? internode_bw * internode_efficiency : nvlink_bw * nvlink_efficiency;
}

double HardwareSpec::hop_latency_s(bool crosses_nodes) const {
    return crosses_nodes ? internode_hop_latency_s : nvlink_hop_latency_s;
}

void HardwareSpec::validate() const {
    auto positive = [&](double v, const char* field) {
        require(std::isfinite(v) && v > 0 && v < 1e30, "hardware '", name, "': ", field,
                " must be a positive finite number (below 1e30), got ", v);
    };
    positive(static_cast<double>(memory_bytes), "memory_bytes");
    positive(hbm_bw, "hbm_bw");
    positive(flops_bf16, "flops_bf16");
    require(flops_fp8 >= 0, "hardware '", name, "': flops_fp8 must be >= 0 (0: no fp8), got ",
            flops_fp8);
    positive(gpus_per_node, "gpus_per_node");
    positive(nvlink_bw, "nvlink_bw");
    positive(internode_bw, "internode_bw");
    auto efficiency = [&](double v, const char* field) {
        require(v > 0 && v <= 1, "hardware '", name, "': ", field, " must be in (0, 1], got ", v);
    };
    efficiency(hbm_efficiency, "hbm_efficiency");
    efficiency(compute_efficiency, "compute_efficiency");
    efficiency(nvlink_efficiency, "nvlink_efficiency");
    efficiency(internode_efficiency, "internode_efficiency");
    require(nvlink_hop_latency_s >= 0 && nvlink_hop_latency_s <= 1, "hardware '", name,
            "': nvlink_hop_latency_s must be in [0, 1] s, got ", nvlink_hop_latency_s);
    require(internode_hop_latency_s >= 0 && internode_hop_latency_s <= 1, "hardware '", name,
            "': internode_hop_latency_s must be in [0, 1] s, got ", internode_hop_latency_s);
    require(collective_launch_s >= 0 && collective_launch_s <= 1, "hardware '", name,
            "': collective_launch_s must be in [0, 1] s, got ", collective_launch_s);
    efficiency(nvlink_ll_bw_fraction, "nvlink_ll_bw_fraction");
    require(nvlink_simple_hop_latency_s >= 0 && nvlink_simple_hop_latency_s <= 1, "hardware '",
            name, "': nvlink_simple_hop_latency_s must be in [0, 1] s, got ",
            nvlink_simple_hop_latency_s);
    require(std::isfinite(nvls_bus_bw) && nvls_bus_bw >= 0 && nvls_bus_bw < 1e30, "hardware '",
            name, "': nvls_bus_bw must be >= 0 and finite (0: no NVLink SHARP), got ", nvls_bus_bw);
    require(nvls_latency_s >= 0 && nvls_latency_s <= 1, "hardware '", name,
            "': nvls_latency_s must be in [0, 1] s, got ", nvls_latency_s);
    require(flops_fp8 < 1e30, "hardware '", name, "': flops_fp8 must be finite, got ", flops_fp8);
}

std::vector<std::string> hardware_names() {
    std::vector<std::string> out;
    for (const auto& [n, _] : catalog()) out.push_back(n);
    return out;
}

HardwareSpec hardware_by_name(std::string_view name) {
    auto it = catalog().find(name);
    if (it == catalog().end())
        throw Error(detail::concat("unknown hardware '", name, "': expected one of ", known_names(),
                                   ", or a path to a JSON file (see docs/cost-model.md)"));
    return it->second;
}

HardwareSpec parse_hardware_json(std::string_view json_text, const std::string& file) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(json_text);
    } catch (const nlohmann::json::exception& e) {
        throw Error(detail::concat(file, ": not valid JSON (", e.what(), ")"));
    }
    if (!j.is_object())
        throw Error(detail::concat(file, ": expected a JSON object at the top level"));

    static const char* const kKnown[] = {"base",
                                         "name",
                                         "memory_bytes",
                                         "memory_gib",
                                         "hbm_bw",
                                         "hbm_bw_gbps",
                                         "flops_bf16",
                                         "flops_bf16_tflops",
                                         "flops_fp8",
                                         "flops_fp8_tflops",
                                         "gpus_per_node",
                                         "nvlink_bw",
                                         "nvlink_bw_gbps",
                                         "internode_bw",
                                         "internode_bw_gbps",
                                         "hbm_efficiency",
                                         "compute_efficiency",
                                         "nvlink_efficiency",
                                         "internode_efficiency",
                                         "nvlink_hop_latency_s",
                                         "internode_hop_latency_s",
                                         "collective_launch_s",
                                         "nvlink_ll_bw_fraction",
                                         "nvlink_simple_hop_latency_s",
                                         "nvls_bus_bw",
                                         "nvls_bus_bw_gbps",
                                         "nvls_latency_s"};
    for (const auto& [key, _] : j.items()) {
        bool known = false;
        for (const char* k : kKnown) known = known || key == k;
        if (!known) {
            std::string list;
            for (const char* k : kKnown) list += (list.empty() ? "" : ", ") + std::string(k);
            throw Error(
                detail::concat(file, ": unknown field '", key, "': expected one of ", list));
        }
    }

    const bool has_base = j.contains("base");
    HardwareSpec h;
    if (has_base) {
        if (!j.at("base").is_string())
            throw Error(detail::concat(file, ": field 'base' must be a catalog name (",
                                       known_names(), ")"));
        h = hardware_by_name(j.at("base").get<std::string>());
    }
    auto number = [&](const char* key) -> double {
        const auto& v = j.at(key);
        if (!v.is_number())
            throw Error(
                detail::concat(file, ": field '", key, "' must be a number, got ", v.dump()));
        return v.get<double>();
    };
    // Sets `out` from `key` (scale 1) or `alt_key` (times `alt_scale`); required without a base.
    auto field = [&](double& out, const char* key, const char* alt_key, double alt_scale) {
        if (j.contains(key))
            out = number(key);
        else if (alt_key && j.contains(alt_key))
            out = number(alt_key) * alt_scale;
        else if (!has_base)
            throw Error(detail::concat(file, ": missing field '", key, "'",
                                       alt_key ? detail::concat(" (or '", alt_key, "')") : "",
                                       " (or give \"base\": one of ", known_names(), ")"));
    };
    auto optional = [&](double& out, const char* key) {
        if (j.contains(key)) out = number(key);
    };

    if (j.contains("name") && !j.at("name").is_string())
        throw Error(detail::concat(file, ": field 'name' must be a string (e.g. \"mi300x\"), got ",
                                   j.at("name").dump()));
    h.name = j.contains("name") && j.at("name").is_string() ? j.at("name").get<std::string>()
             : has_base                                     ? h.name + "-custom"
                        : std::filesystem::path(file).stem().string();
    double memory = static_cast<double>(h.memory_bytes);
    field(memory, "memory_bytes", "memory_gib", static_cast<double>(kGiB));
    // 2^50 bytes (1 PiB) per GPU at most: beyond that the value is a typo, and the cast must fit.
    if (!(memory >= 1 && memory <= 0x1p50))
        throw Error(detail::concat(file, ": the GPU memory must be in [1 byte, 1 PiB], got ",
                                   memory, " bytes"));
    h.memory_bytes = static_cast<int64_t>(memory);
    field(h.hbm_bw, "hbm_bw", "hbm_bw_gbps", kGB);
    field(h.flops_bf16, "flops_bf16", "flops_bf16_tflops", kTflop);
    if (j.contains("flops_fp8"))
        h.flops_fp8 = number("flops_fp8");
    else if (j.contains("flops_fp8_tflops"))
        h.flops_fp8 = number("flops_fp8_tflops") * kTflop;
    double gpn = h.gpus_per_node;
    optional(gpn, "gpus_per_node");
    // Checked before the cast: a double outside int's range does not convert (found by fuzzing).
    require(gpn >= 1 && gpn <= (1 << 20) && gpn == std::floor(gpn), file,
            ": field 'gpus_per_node' must be an integer in [1, 2^20], got ", gpn);
    h.gpus_per_node = static_cast<int>(gpn);
    field(h.nvlink_bw, "nvlink_bw", "nvlink_bw_gbps", kGB);
    field(h.internode_bw, "internode_bw", "internode_bw_gbps", kGB);
    optional(h.hbm_efficiency, "hbm_efficiency");
    optional(h.compute_efficiency, "compute_efficiency");
    optional(h.nvlink_efficiency, "nvlink_efficiency");
    optional(h.internode_efficiency, "internode_efficiency");
    optional(h.nvlink_hop_latency_s, "nvlink_hop_latency_s");
    optional(h.internode_hop_latency_s, "internode_hop_latency_s");
    optional(h.collective_launch_s, "collective_launch_s");
    optional(h.nvlink_ll_bw_fraction, "nvlink_ll_bw_fraction");
    optional(h.nvlink_simple_hop_latency_s, "nvlink_simple_hop_latency_s");
    if (j.contains("nvls_bus_bw"))
        h.nvls_bus_bw = number("nvls_bus_bw");
    else if (j.contains("nvls_bus_bw_gbps"))
        h.nvls_bus_bw = number("nvls_bus_bw_gbps") * kGB;
    optional(h.nvls_latency_s, "nvls_latency_s");
    try {
        h.validate();
    } catch (const Error& e) {
        throw Error(detail::concat(file, ": ", e.what()));
    }
    return h;
}

HardwareSpec load_hardware_json(const std::string& path) {
    std::ifstream in(path);
    if (!in)
        throw Error(detail::concat("cannot open hardware file '", path, "': expected one of ",
                                   known_names(), " or a JSON file"));
    std::stringstream ss;
    ss << in.rdbuf();
    return parse_hardware_json(ss.str(), path);
}

HardwareSpec resolve_hardware(const std::string& name_or_path) {
    if (catalog().count(name_or_path)) return hardware_by_name(name_or_path);
    std::error_code ec;
    if (std::filesystem::is_regular_file(name_or_path, ec)) return load_hardware_json(name_or_path);
    return hardware_by_name(name_or_path);  // throws with the list of known names
}

std::string to_json(const HardwareSpec& h) {
    nlohmann::json j = {{"name", h.name},
                        {"memory_bytes", h.memory_bytes},
                        {"hbm_bw", h.hbm_bw},
                        {"flops_bf16", h.flops_bf16},
                        {"flops_fp8", h.flops_fp8},
                        {"gpus_per_node", h.gpus_per_node},
                        {"nvlink_bw", h.nvlink_bw},
                        {"internode_bw", h.internode_bw},
                        {"hbm_efficiency", h.hbm_efficiency},
                        {"compute_efficiency", h.compute_efficiency},
                        {"nvlink_efficiency", h.nvlink_efficiency},
                        {"internode_efficiency", h.internode_efficiency},
                        {"nvlink_hop_latency_s", h.nvlink_hop_latency_s},
                        {"internode_hop_latency_s", h.internode_hop_latency_s},
                        {"collective_launch_s", h.collective_launch_s},
                        {"nvlink_ll_bw_fraction", h.nvlink_ll_bw_fraction},
                        {"nvlink_simple_hop_latency_s", h.nvlink_simple_hop_latency_s},
                        {"nvls_bus_bw", h.nvls_bus_bw},
                        {"nvls_latency_s", h.nvls_latency_s}};
    return j.dump(2);
}

}  // namespace kvshard
