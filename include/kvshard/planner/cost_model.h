#pragma once
// Communication and time cost model (seed §7): per partitioning, the bytes each GPU moves and the
// time it takes, for a prefill of S tokens and for one decode step, with roofline compute/memory
// time per phase, giving TTFT and TPOT. Every formula and its source: docs/cost-model.md.
#include <cstdint>
#include <string>
#include <string_view>

#include "kvshard/layout/kv_layout.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {

// ---- collectives over a ring of n ranks (bytes = the full buffer each rank holds) ----------
// all-reduce: 2(n-1)/n * bytes / bw + 2(n-1) * hop
double ring_all_reduce_s(double bytes, int n, double bw, double hop_s);
// all-gather / reduce-scatter: (n-1)/n * bytes / bw + (n-1) * hop
double ring_all_gather_s(double bytes, int n, double bw, double hop_s);
// all-to-all: (n-1)/n * bytes / bw + hop (the n-1 pairwise exchanges posted together, as NCCL's
// grouped send/recv and DeepEP do: one message latency, not n-1 in a row; docs/cost-model.md)
double all_to_all_s(double bytes, int n, double bw, double hop_s);
// point-to-point send: bytes / bw + hop
double send_s(double bytes, double bw, double hop_s);

// Does the group of ranks (e.g. rank 0's TP group) span more than one node? Ranks are placed on
// nodes in rank order, gpus_per_node to a node.
enum class GroupKind { kTp, kCp, kPp, kEp, kDp };
bool group_crosses_nodes(const ParallelConfig& p, GroupKind g, int gpus_per_node);

// A group as placed on nodes: n ranks on `nodes` nodes, at most `per_node` of them on one node.
struct GroupSpan {
    int n = 1, nodes = 1, per_node = 1;
    bool crosses_nodes() const { return nodes > 1; }
};
GroupSpan group_span(const ParallelConfig& p, GroupKind g, int gpus_per_node);

// ---- collectives inside one node (docs/cost-model.md, "Protocols inside a node") -------------
// n ranks on one node's NVLink: the faster of the ring under NCCL's low-latency protocols
// (hw.nvlink_hop_latency_s per step, hw.nvlink_ll_bw_fraction of hw.link_bw(false)) and under
// its Simple protocol (hw.nvlink_simple_hop_latency_s per step, the full rate); an all-reduce over
// all of a node's GPUs (n == hw.gpus_per_node) may also take NVLink SHARP where hw.nvls_bus_bw >
// 0: hw.nvls_latency_s + 2(n-1)/n * bytes / hw.nvls_bus_bw. Without collective_launch_s.
double node_all_reduce_s(double bytes, int n, const HardwareSpec& hw);
double node_all_gather_s(double bytes, int n, const HardwareSpec& hw);

// ---- collectives over a group as placed (docs/cost-model.md, "Collectives across nodes") -----
// Inside one node: node_all_reduce_s / node_all_gather_s, and all-to-all at the NVLink rate and
// alpha (hw.link_bw(false), hw.hop_latency_s(false)). Across k nodes with g ranks per node, priced
// the way NCCL runs them:
// - ring: every rank sends 2(n-1)/n * bytes (all-reduce; (n-1)/n all-gather), a share 1/g of it
//   over its own NIC (the g rings' node-to-node edges striped over the node's g NICs) and (g-1)/g
//   over NVLink, the slower of the two paths setting the rate; of the ring's 2(n-1) steps
//   (all-reduce; n-1 all-gather) 2(k-1) (k-1) cross nodes at the inter-node alpha, the others at
//   the NVLink alpha (the step counts of NCCL's tuner, src/graph/tuning.cc);
// - tree (all-reduce only): a chain inside each node (g-1 steps up, g-1 down, NVLink alpha) and a
//   binary tree across nodes (floor(log2 k) steps up and down, inter-node alpha); each rank sends
//   2 * bytes, its node's node-to-node traffic (2 * bytes) striped over the g NICs;
//   an all-reduce takes the faster of ring and tree (NCCL's tuner picks per size);
// - all-to-all: the g-1 messages inside the node and the n-g across posted together (one NVLink
//   and one inter-node latency), the bytes split the same way over NVLink and the NIC (the slower
//   path sets the rate).
// Without collective_launch_s (added per call by the cost model). 0 when n <= 1.
double all_reduce_s(double bytes, const GroupSpan& g, const HardwareSpec& hw);
double all_gather_s(double bytes, const GroupSpan& g, const HardwareSpec& hw);
double all_to_all_s(double bytes, const GroupSpan& g, const HardwareSpec& hw);

// ---- CP pass-KV ring ---------------------------------------------------------------------
// Bytes `rank` sends over the CP ring during one pass-KV prefill of a sequence of `context_tokens`
// tokens (cached + new), summed over the rank's layers. In ring step s = 0..cp-2, CP rank c
// forwards the shard first owned by CP rank (c - s) mod cp, so it sends every shard except the one
// owned by (c + 1) mod cp: per layer, whole-sequence KV minus that shard, at kv_bytes_per_token /
// num_layers bytes per token and layer. Shard sizes are exactly those of cp_token_ranges. 0 when cp
// == 1.
int64_t cp_pass_kv_bytes_sent(const KvLayout& layout, int rank, int64_t context_tokens);

enum class CpPrefillPolicy { kAuto, kPassKv, kPassQ };  // kAuto: the faster of the two
std::string_view cp_prefill_policy_name(CpPrefillPolicy s);
CpPrefillPolicy parse_cp_prefill_policy(std::string_view s);  // auto|pass-kv|pass-q

enum class CpMergePolicy { kAuto, kAllGather, kAllToAll };
std::string_view cp_merge_policy_name(CpMergePolicy s);
CpMergePolicy parse_cp_merge_policy(std::string_view s);  // auto|all-gather|all-to-all

struct CostOptions {
    int activation_bytes = 2;  // bf16 activations (also under fp8 weights)
    // Prefill chunks pipelined through the PP stages; 0: as many as stages (pp). At most
    // kMaxPpPrefillChunks (each chunk is a step of the schedule, costed per stage).
    static constexpr int kMaxPpPrefillChunks = 1024;
    int pp_prefill_chunks = 0;
    CpPrefillPolicy cp_prefill = CpPrefillPolicy::kAuto;
    CpMergePolicy cp_decode_merge = CpMergePolicy::kAuto;
    // Weight storage (capacity.h): bytes read per weight, and fp8 tensor-core rate at <= 8 bits.
    WeightDtype weight_dtype = WeightDtype::kModel;
    void validate() const;
};

// What one phase costs. Seconds add up along one pass through all pipeline stages (for decode:
// one micro-batch's path, which is the step latency); FLOPs and bytes are per GPU, those of the
// busiest stage's GPU over the whole phase (for decode: all micro-batches of the step).
struct PhaseCost {
    double flops = 0;                // per GPU
    double hbm_bytes = 0;            // per GPU: weights and KV read, KV and activations written
    double compute_s = 0;            // flops / achieved FLOP/s, layer by layer
    double memory_s = 0;             // hbm bytes / achieved HBM bandwidth, layer by layer
    double roofline_s = 0;           // sum over layers of max(compute, memory)
    double attention_compute_s = 0;  // the attention (QK, PV) part of compute_s
    double tp_bytes = 0, tp_s = 0;   // all-reduce after attention and after each MLP
    double pp_bytes = 0,
           pp_s = 0;  // activation hand-off: bytes a boundary GPU sends; s on the path
    double cp_bytes = 0, cp_s = 0;  // CP ring (prefill) or partial-output merge (decode); exposed s
    double ep_bytes = 0, ep_s = 0;  // MoE dispatch + combine all-to-all
    double pp_bubble_s = 0;  // pipeline fill/drain (prefill) or idle share (decode) in total_s
    double total_s = 0;      // the phase's latency
    double comm_bytes() const { return tp_bytes + pp_bytes + cp_bytes + ep_bytes; }
};

struct CpPrefillCost {
    double pass_kv_bytes = 0;     // per GPU, all its layers
    double pass_kv_s = 0;         // ring time, all its layers
    bool pass_kv_hidden = false;  // ring time <= attention compute time (overlapped)
    double pass_q_bytes = 0;      // Q ring + all-to-all of partial outputs and LSE
    double pass_q_s = 0;
    CpPrefillPolicy chosen = CpPrefillPolicy::kPassKv;
};

struct CpDecodeCost {
    double all_gather_bytes = 0, all_gather_s = 0;
    double all_to_all_bytes = 0, all_to_all_s = 0;
    CpMergePolicy chosen = CpMergePolicy::kAllGather;
};

struct Workload {
    int64_t prompt_tokens = 0;   // S: tokens prefilled for one request (TTFT)
    int64_t context_tokens = 0;  // tokens in context during decode (cached + generated)
    int64_t batch = 1;           // requests decoding together in one DP replica (TPOT)
    void validate() const;
};

struct CostReport {
    PhaseCost prefill;  // one request of prompt_tokens
    PhaseCost decode;   // one step of `batch` requests at context_tokens
    CpPrefillCost cp_prefill;
    CpDecodeCost cp_decode;
    double ttft_s = 0;
    double tpot_s = 0;
    double decode_tokens_per_s = 0;  // all DP replicas: dp * batch / tpot
    // Share of link time in a decode step that EP's all-to-all leaves for KV transfer (seed §5):
    // 1 - ep_s / tpot_s (1 without EP).
    double ep_link_share_for_kv = 1;
    // PP decode: micro-batches in flight (min(pp, batch)) and whether the slowest stage, running
    // each of them in turn, sets the step rather than one micro-batch's path through the stages.
    int decode_micro_batches = 1;
    bool decode_slowest_stage_bound = false;
};

CostReport estimate_cost(const ModelSpec& m, const ParallelConfig& p, const HardwareSpec& hw,
                         const Workload& w, const CostOptions& options = {});

}  // namespace kvshard
