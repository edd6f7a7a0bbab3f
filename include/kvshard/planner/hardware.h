#pragma once
// HardwareSpec: one accelerator and its links, as the capacity and cost models see it.
// Datasheet figures come from ../shared/reference/hardware.md (docs/cost-model.md, "Hardware").
// Achieved rates are the datasheet figure times an efficiency factor; every factor is a named field
// with a documented default, and every field can be overridden from a JSON file.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/common/dtype.h"

namespace kvshard {

struct HardwareSpec {
    std::string name;
    int64_t memory_bytes = 0;  // HBM per GPU (the datasheet's "GB" of HBM are GiB)
    double hbm_bw = 0;         // bytes/s, datasheet
    double flops_bf16 = 0;     // dense FLOP/s (also used for fp16 and fp32 weights)
    double flops_fp8 = 0;      // dense FLOP/s; 0: no fp8 tensor cores (bf16 rate is used)
    int gpus_per_node = 8;     // GPUs joined by NVLink
    double nvlink_bw = 0;      // bytes/s per GPU per direction
    double internode_bw = 0;   // bytes/s per GPU per direction (the GPU's NIC)

    // Efficiency factors (achieved / datasheet) and the latency terms of the collectives.
    double hbm_efficiency = 0.8;        // streaming reads reach ~80% of the HBM datasheet rate
    double compute_efficiency = 0.6;    // achieved share of dense tensor-core FLOP/s in GEMMs
    double nvlink_efficiency = 0.8;     // NCCL bus bandwidth / NVLink datasheet rate
    double internode_efficiency = 0.8;  // NCCL bus bandwidth / NIC line rate
    // Alpha-beta model (docs/cost-model.md, "Collectives"): a collective call costs
    // collective_launch_s + messages * alpha + bytes / bandwidth (a ring all-reduce over n ranks
    // sends 2(n-1) messages per rank, an all-gather or all-to-all n-1, a send 1); inside a node
    // alpha is nvlink_hop_latency_s, and a group spanning nodes is priced as NCCL's ring and tree,
    // only node-to-node steps at internode_hop_latency_s ("Collectives across nodes"). Defaults
    // checked against Meta's CP measurements (arXiv:2411.01783) and nccl-tests runs: BENCHMARKS.md
    // ("Planner"), tests/planner/calibration_test.cpp; ranges from ../shared/reference/hardware.md.
    double nvlink_hop_latency_s = 1e-6;      // alpha per message inside a node (NVLink/NVSwitch)
    double internode_hop_latency_s = 30e-6;  // alpha per node-to-node step (IB, GPUDirect RDMA)
    // Fixed cost of one collective call on the critical path: the kernel launch and the wait for
    // the group's ranks to meet (CUDA-graph launched decode keeps this small).
    double collective_launch_s = 5e-6;
    // NCCL's protocols and NVLink SHARP inside a node (docs/cost-model.md, "Protocols inside a
    // node"): an all-reduce or all-gather over NVLink takes the fastest of
    // - the low-latency protocols (LL/LL128): alpha nvlink_hop_latency_s per step, at a share
    //   nvlink_ll_bw_fraction of the link rate (fitted to a CUDA-graph launched 4 x H100 run,
    //   1 KiB to 4 MiB; NCCL's tuner: LL 1/4, LL128 0.92);
    // - the Simple protocol: nvlink_simple_hop_latency_s per step (NCCL's tuner, hwLat NVLink Ring
    //   Simple), at the full link rate;
    // - for an all-reduce over all of a node's GPUs where nvls_bus_bw > 0, NVLink SHARP (NVLS, the
    //   switch reduces): nvls_latency_s + 2(n-1)/n * bytes / nvls_bus_bw (a bus bandwidth, as
    //   nccl-tests reports it; 0: the switch has none).
    double nvlink_ll_bw_fraction = 0.54;
    double nvlink_simple_hop_latency_s = 3.4e-6;
    double nvls_bus_bw = 0;
    double nvls_latency_s = 50e-6;

    bool operator==(const HardwareSpec&) const = default;

    double achieved_hbm_bw() const { return hbm_bw * hbm_efficiency; }
    // Achieved FLOP/s for GEMMs whose weights have type `weights`.
    double achieved_flops(DType weights) const;
    // Achieved bandwidth and per-hop latency of one link: NVLink, or the GPU's NIC across nodes.
    double link_bw(bool crosses_nodes) const;
    double hop_latency_s(bool crosses_nodes) const;

    // Throws Error naming the first field that is missing, non-positive, or an efficiency outside
    // (0, 1].
    void validate() const;
};

// Built-in catalog: a100-80g, h100-sxm, h200, b200.
std::vector<std::string> hardware_names();
HardwareSpec hardware_by_name(std::string_view name);  // throws Error listing the known names

// JSON with the field names of to_json(). A file may name a catalog entry in "base" and override
// only some fields, e.g. {"base": "h100-sxm", "hbm_efficiency": 0.7}; without "base" every
// datasheet field (memory_bytes or memory_gib, hbm_bw, flops_bf16, nvlink_bw, internode_bw) is
// required. Rates may be given in bytes/s and FLOP/s, or as *_gbps / *_tflops (GB/s = 1e9 B/s,
// TFLOP/s = 1e12).
HardwareSpec parse_hardware_json(std::string_view json_text, const std::string& name_for_errors);
HardwareSpec load_hardware_json(const std::string& path);
// A catalog name, or a path to a JSON file as above.
HardwareSpec resolve_hardware(const std::string& name_or_path);

std::string to_json(const HardwareSpec& h);

}  // namespace kvshard
