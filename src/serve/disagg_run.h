#pragma once
// Internal to src/serve: the pieces of a disaggregated run (kvshard/serve/disagg.h), in the order
// they happen on a rank: plan the requests (disagg_plan.cpp), run the prefill side
// (disagg_prefill.cpp) or the decode side (disagg_decode.cpp), merge every rank's part into the
// report (disagg_report.cpp).
#include <cstdint>
#include <memory>
#include <vector>

#include "kvshard/exec/cp_session.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/serve/disagg.h"
#include "kvshard/transfer/state_pack.h"
#include "kvshard/transfer/transfer_exec.h"
#include "kvshard/transfer/transfer_plan.h"
#include "kvshard/transfer/transfer_schedule.h"
#include "serve/runner.h"

namespace kvshard::serve {

inline constexpr int kTagFirstTokens = 0x7A001;   // prefill last stage -> every decode rank
inline constexpr int kTagDecodeTokens = 0x7A002;  // decode last stage -> earlier decode stages
inline constexpr int kTagScales = 0x7A003;  // fp8: a message's block scales, source -> destination
inline constexpr int kTagState = 0x7A004;   // a state message's payload, source -> destination

// Per request, per CP rank of a side: the request's blocks there.
using CpTables = std::vector<std::vector<std::vector<int32_t>>>;

// What every rank knows of the run before it starts, the same on all of them.
struct DisaggPlan {
    ModelSpec model;  // fp32 KV
    ParallelConfig prefill, decode;
    KvLayout prefill_layout, decode_layout;
    int prefill_ranks = 0, decode_ranks = 0;  // world ranks [0, P) and [P, P + D)
    int requests = 0;
    std::vector<int64_t> prompt_len;
    // Per request: the replica (dp index) of each side that serves it (0 with dp = 1).
    std::vector<int> prefill_replica, decode_replica;
    // The plain executors' blocks: request i's consecutive tables on each side (in its replica's
    // pools), and the pools (every replica's the same size: the largest replica's need).
    std::vector<std::vector<int32_t>> prefill_tables, decode_tables;
    // With the prefix cache: per request, the leading tokens the prefill side shares with an
    // earlier request (not computed), the decode side's (not sent), and the earlier request whose
    // transfer writes the decode side's shared blocks (-1: none); its failure fails this one.
    bool prefix_cache = false;
    std::vector<int64_t> prefill_cached, decode_cached;
    std::vector<int> decode_provider;
    int64_t prefill_blocks = 0, decode_blocks = 0;
    bool cp_prefill = false, cp_decode = false;
    bool share_pools = false;  // prefill pools in shareable memory (direct reads)
    // One per request; with a CP side, filled by share_cp_tables once the sessions hold blocks.
    std::vector<std::shared_ptr<const TransferPlan>> transfers;
    // How each request's plan is carried out: one part per token group (the plan itself for a
    // model of one group, else group_transfer_plan of each), moved by a TransferSender/Receiver
    // pair between the ranks' pools of that group, on request id `request * parts + part`. State
    // groups' messages go as state messages (transfer/state_pack.h) once the prefill is done.
    struct TransferPart {
        int kv_group = 0;
        std::vector<int> layers;  // the group's global layers (layer j of the part's plan)
        std::shared_ptr<const TransferPlan> plan;
        // How its messages travel, for both sides' pools (TransferExecOptions::schedule).
        std::shared_ptr<const TransferSchedule> schedule;
    };
    std::vector<std::vector<TransferPart>> parts;  // [request][part]
    bool has_state = false;                        // the model has state layers

    // Whether request i is served by replica `dp` of a side.
    bool serves(bool prefill_side, int dp, int i) const {
        return (prefill_side ? prefill_replica : decode_replica).at(size_t(i)) == dp;
    }
    // Blocks of each rank's pool on a side (a CP device holds one more).
    int64_t pool_blocks(bool prefill_side) const {
        return prefill_side ? prefill_blocks + (cp_prefill ? 1 : 0)
                            : decode_blocks + (cp_decode ? 1 : 0);
    }
};

// The request id of part p of request i (its transfer's tags).
inline uint64_t part_request_id(const DisaggPlan& plan, int i, int p) {
    return static_cast<uint64_t>(i) * plan.parts.at(size_t(i)).size() + static_cast<uint64_t>(p);
}
// The index of model's pool of KV group kv_group, -1 when the rank holds no layer of it.
int pool_of_group(const RankModel& model, int kv_group);
// A part this rank carries: part `part` of request `request`, with its pool here (`pool`).
struct RankPart {
    int request = 0, part = 0, pool = 0;
};
// The parts this rank (holding `model`, in side replica `replica`) carries, in (request, part)
// order: every part of the replica's requests whose KV group has a pool here.
std::vector<RankPart> rank_parts(const DisaggPlan& plan, bool prefill_side, int replica,
                                 const RankModel& model);
// A request's state on this rank (in state slot `slot`), for pack/unpack_state_message.
StateAccess state_access(RankModel& model, int32_t slot);

// Checks the inputs and plans what can be planned before any rank holds blocks: the plain sides'
// tables, and the transfer plans when neither side runs CP.
DisaggPlan plan_requests(const ModelSpec& m, const ParallelConfig& prefill,
                         const ParallelConfig& decode,
                         const std::vector<std::vector<int32_t>>& prompts, const DisaggOptions& opt,
                         int world_size);
// The transfer plans of every request from both sides' tables.
void make_transfer_plans(DisaggPlan& plan, const DisaggOptions& opt, const CpTables& src,
                         const CpTables& dst);

// One rank's executor on its side: a RankModel (with its communicators) or a CP device + session.
struct SideExecutor {
    RankWiring wiring;
    std::unique_ptr<RankModel> plain;
    std::unique_ptr<CpDevice> cp_device;
    std::unique_ptr<CpSession> cp_session;
    RankCoord coord;
    RankModel& model() { return plain ? *plain : cp_device->model(); }
};
// Builds this rank's executor over `group` (its side's ranks); a CP side reserves (prefill) or
// adopts (decode) every request's blocks.
SideExecutor make_side_executor(const DisaggPlan& plan, const DisaggOptions& opt,
                                const TensorSource& weights,
                                const std::vector<std::vector<int32_t>>& prompts, bool is_prefill,
                                int local_rank, Communicator& group);
// With a CP side: every world rank learns each CP rank's tables and builds the transfer plans.
// Collective over world.
void share_cp_tables(DisaggPlan& plan, const DisaggOptions& opt, SideExecutor& side,
                     Communicator& world);

// What each rank contributes to the report. Times are seconds from the rank's own start (after
// the common barrier). On one host the ranks' starts are put on one clock (steady_clock is
// system-wide there): a rank that is scheduled late after the barrier would otherwise see a
// transfer that began before its start as ending before it.
struct RankTimes {
    double start_abs = 0;         // the rank's start on the steady clock
    uint64_t host = 0;            // hash of the host name
    double prefill_end = -1;      // prefill ranks: forward done
    double last_layer_done = -1;  // prefill ranks: the KV of this rank's last layer written
    double first_send = -1;       // prefill ranks: first message out
    double transfer_done = -1;    // decode ranks: every request's transfer finished
    double decode_seconds = 0;
    int64_t bytes = 0;  // decode ranks: payload bytes received
    int64_t messages = 0;
    int64_t direct_messages = 0;
    int64_t unit_checksum_messages = 0;
};
RankTimes start_times(Clock::time_point t0);

// The prefill side on world rank `me`: the forward step(s), streaming each layer's KV as it is
// written, then the first greedy tokens to every decode rank. Its results: on the last stage's
// rank, each request's prefill logits (has_output false).
void run_prefill_side(const DisaggPlan& plan, const DisaggOptions& opt,
                      const std::vector<std::vector<int32_t>>& prompts, SideExecutor& side,
                      Communicator& world, TransferExecOptions xo, Clock::time_point t0,
                      RankTimes& times, std::vector<RequestResult>& results);
// The decode side: receive every request's KV, agree on which failed, decode the others. Its
// results: every request's error on this rank, and on the rank that brings them, the tokens and
// last logits (has_output).
void run_decode_side(const DisaggPlan& plan, const DisaggOptions& opt, SideExecutor& side,
                     Communicator& world, Communicator& group, const TransferExecOptions& xo,
                     Clock::time_point t0, RankTimes& times, std::vector<RequestResult>& results);

DisaggReport merge_disagg_report(const DisaggPlan& plan, const DisaggOptions& opt,
                                 const std::vector<RankContribution<RankTimes>>& parts);

}  // namespace kvshard::serve
