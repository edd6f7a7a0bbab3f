#pragma once
// Disaggregated prefill/decode of the reference model (docs/transfer.md, "End to end").
//
// One communicator `world` holds both groups: ranks [0, P) are the prefill group (layout `prefill`,
// P = prefill.world_size()), ranks [P, P + D) the decode group (layout `decode`). Every prompt is
// one request. The prefill group runs one batched prefill step; as each layer's attention has
// written its KV, the prefill ranks send that layer of every request to the decode ranks that need
// it (layer-wise streaming, TransferSender), so the transfer overlaps the rest of prefill. The
// first greedy token goes from the prefill group's last stage to the decode group, which decodes
// the other max_new_tokens - 1 tokens. A request whose transfer fails is reported and not decoded;
// the others go on. A side with cp > 1 runs the CP executor (see disagg_generate).
//
// A side with dp > 1 is that many groups (replicas) of its layout, world ranks in the layout's
// rank order. Every rank decides the same assignment: request i's prefill replica by
// DisaggOptions::prefill_route, its decode replica by free KV capacity (each request, in order,
// to the decode replica with the most free blocks, ties to the lowest index; every decode
// replica's pool has the same size, so that is the one with the fewest blocks assigned so far,
// a request counted whole: ceil((prompt + max_new_tokens) / decode_block_size) blocks). Each
// prefill replica prefills its requests in one batch, each decode replica decodes its own, and
// request i's KV moves between the ranks of its two replicas only.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/layout/parallel_config.h"
#include "kvshard/model/model_spec.h"
#include "kvshard/model/weights.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_exec.h"

namespace kvshard {

class Communicator;

// TransferExecOptions' defaults, with the longer timeout a whole run allows (60 s).
inline TransferExecOptions disagg_transfer_defaults() {
    TransferExecOptions o;
    o.timeout_s = 60.0;
    return o;
}

// How the prefill side's replicas (dp > 1) are given the requests.
enum class PrefillRoute {
    kRoundRobin,   // request i to replica i % dp
    kLeastTokens,  // to the replica with the fewest prompt tokens so far (ties: lowest index)
};
// "round-robin", "least-tokens"; parse: Error naming the valid ones.
const char* prefill_route_name(PrefillRoute r);
PrefillRoute parse_prefill_route(const std::string& s);

struct DisaggOptions {
    int max_new_tokens = 16;  // the first comes from prefill, the rest from decode
    int prefill_block_size = 16;
    int decode_block_size = 16;
    PageOrder prefill_order = PageOrder::kHnd;
    PageOrder decode_order = PageOrder::kHnd;
    bool stream_layers = true;  // a message per layer, sent as soon as the layer is done
    // Prefix cache on both plain sides (not with a CP side): a request's leading full blocks that
    // an earlier request of the run already holds are not computed on the prefill side (at least
    // the last prompt token is) and not sent to the decode side, whose blocks for them are shared.
    // With dp > 1 each replica has its own cache: a hit needs the earlier request on the same one.
    bool prefix_cache = true;
    // Direct read from HND prefill pools: each prefill rank seals every layer's KV right after
    // writing it (source_checksums.h), and a message that reads whole sealed blocks is checked by
    // its unit checksum instead of a checksum pass over the source when it is sent.
    bool source_checksums = true;
    // Direct reads through a window over each prefill pool (rma_read.h: MPI RMA, MPI_Rget of the
    // descriptors, then the checksum of what landed) instead of shared memory, so they work
    // across hosts; needs transfer.direct_read and the same page order on both sides.
    bool rma_read = false;
    PrefillRoute prefill_route = PrefillRoute::kRoundRobin;  // a prefill side with dp > 1
    std::optional<CpPrefillMode> cp_prefill_mode;            // a CP prefill side: empty = automatic
    CpDecodeMerge cp_decode_merge = CpDecodeMerge::kAllGather;  // a CP decode side
    // The transfer: mode, staging_bytes, timeout_s, sender_idle_sleep_us, offload_check_bytes,
    // direct_read (the prefill pools are shareable and each decode rank on the same host reads its
    // KV from them in place; false: private pools, messages) and direct_window. The run sets the
    // world bases, the staging pool, the arena views, the seals and each request's schedule
    // itself.
    TransferExecOptions transfer = disagg_transfer_defaults();

    // Error naming the field unless every value is in range.
    void validate() const;
};

struct DisaggReport {
    std::vector<std::vector<int32_t>> tokens;     // per prompt; empty for a failed request
    std::vector<std::vector<float>> last_logits;  // per prompt: [vocab] of the last step
    std::vector<std::string> errors;              // per prompt: empty when its transfer succeeded
    // Per prompt: the prefill and the decode replica (dp index) that served it.
    std::vector<int> prefill_replica, decode_replica;
    int failed_requests = 0;
    // The prefix cache (DisaggOptions::prefix_cache): on or not, and why not (a CP side); prompt
    // tokens, those the prefill computed, and those the decode side already held (not sent).
    bool prefix_cache = false;
    std::string prefix_cache_note;
    int64_t prompt_tokens = 0, prefill_computed_tokens = 0, decode_cached_tokens = 0;
    int64_t transfer_bytes = 0;  // payload bytes received over all requests
    int64_t min_bytes = 0;       // what the decode layout needs for every request
    int64_t messages = 0;
    int64_t direct_messages = 0;  // of those, read by the decode rank straight from a prefill pool
    int64_t unit_checksum_messages = 0;  // of those, checked against the prefill's seals
    std::string mode;            // the first request's resolved transfer mode(s): group_modes_text
    bool streamed = false;       // sent layer by layer (false: after prefill)
    double prefill_seconds = 0;  // from the common start to the end of the slowest prefill rank
    double transfer_start_s = 0, transfer_end_s = 0;  // first message sent, last message landed
    double transfer_seconds = 0;                      // transfer_end_s - transfer_start_s
    // The last prefill layer's KV written (the latest over the prefill ranks), and the part of the
    // transfer window after it: what prefill could not hide. hidden_fraction = 1 - exposed /
    // transfer_seconds (1 when nothing is exposed, 0 when the whole transfer came after).
    double last_layer_s = 0;
    double exposed_seconds = 0;
    double hidden_fraction = 0;
    // Payload bytes that could leave only after their prefill rank's last layer (tail_bytes of
    // each request's plan): the last layer's with streaming, all of them without.
    int64_t tail_bytes = 0;
    double decode_seconds = 0;  // the slowest decode rank's decode loop
};

// Collective over `world` (size prefill.world_size() + decode.world_size()); every rank returns the
// whole report. A side with dp > 1 serves its requests on several replicas (above; not with a
// cp > 1 side, Error). A side with cp > 1 (pp = ep = 1, HND pages) runs the CP executor
// (CpSession), one request after another: a CP prefill side reserves every request's blocks before
// the start (CpSession::reserve) and streams each layer from the session's layer hook; a CP decode
// side takes each request in before the transfer (CpSession::adopt: its blocks for the positions
// its CP scheme gives it) and decodes with merged partial attention. The model computes in fp32;
// both sides' pools store m.kv_dtype (the transfer moves the stored bytes unchanged; fp8: each
// message's block scales follow once the prefill is done, pack_scales). fp8 needs one block size on
// both sides; a KV dtype other than fp32 with a cp > 1 side is refused (Error).
DisaggReport disagg_generate(const ModelSpec& m, const ParallelConfig& prefill,
                             const ParallelConfig& decode, const TensorSource& weights,
                             const std::vector<std::vector<int32_t>>& prompts,
                             const DisaggOptions& options, Communicator& world);

}  // namespace kvshard
