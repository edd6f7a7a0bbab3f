#pragma once
// kvshard run --prefill LAYOUT --decode LAYOUT: the disaggregated run (prefill group, KV transfer,
// decode group), called from cmd_run.cpp. The work is kvshard::disagg_generate.
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "kvshard/comm/communicator.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/model/model_spec.h"
#include "kvshard/model/weights.h"
#include "kvshard/serve/disagg.h"

namespace kvshard::cli {

struct DisaggFlags {
    std::string prefill;        // e.g. "tp=8"; empty: not a disaggregated run
    std::string decode;         // e.g. "tp=4,pp=2"
    int decode_block_size = 0;  // 0: --block-size
    std::string prefill_order = "hnd", decode_order = "hnd";
    std::string transfer_mode = "auto";
    bool no_stream = false;
    int64_t staging_mib = 64;
    int sender_sleep_us = DisaggOptions{}.transfer.sender_idle_sleep_us;
    int64_t check_thread_bytes = DisaggOptions{}.transfer.offload_check_bytes;
    std::string direct_read = "on";
    int direct_window = DisaggOptions{}.transfer.direct_window;
    std::string source_checksums = "on";
    int prefill_replicas = 0, decode_replicas = 0;  // 0: the layout's dp (1 unless it names one)
    std::string prefill_route = "round-robin";
    // Every option above but --prefill and --decode: each applies to a disaggregated run only.
    std::vector<const CLI::Option*> side_options;
    bool enabled() const { return !prefill.empty() || !decode.empty(); }
};

// Adds --prefill, --decode, --decode-block-size, --prefill-order, --decode-order, --transfer-mode,
// --no-stream, --staging-mib, --sender-sleep-us, --check-thread-bytes, --direct-read,
// --direct-window, --source-checksums, --prefill-replicas, --decode-replicas, --prefill-route to
// `kvshard run`.
void add_disagg_options(CLI::App* sub, DisaggFlags& f);

// One side's layout: --prefill or --decode (flag) with its text and --prefill-replicas or
// --decode-replicas (0: not given; else the layout's dp), validated for the model; an Error naming
// the flag otherwise, or when the text is missing.
ParallelConfig parse_disagg_side(const char* flag, const std::string& text, int replicas,
                                 const ModelSpec& m);

// Refuses a side option (--staging-mib, --decode-order, ...) given without --prefill/--decode,
// where it would do nothing.
void check_disagg_options_used(const DisaggFlags& f);

struct DisaggRunInput {
    ModelSpec model;
    const TensorSource* weights = nullptr;
    std::string weights_from;
    std::vector<std::vector<int32_t>> prompts;
    int gen = 16;
    int block_size = 16;  // the prefill block size (and the decode one unless --decode-block-size)
    Backend backend = Backend::kThreads;
    bool verify = false;
    bool json = false;
    bool prefix_cache = true;  // --no-prefix-cache turns it off
    std::string dump_logits;   // .npy of the last step's logits; a failed request's row is NaN
    std::optional<CpPrefillMode> cp_prefill_mode;  // a CP prefill side's mode; empty: automatic
    CpDecodeMerge cp_decode_merge = CpDecodeMerge::kAllGather;  // a CP decode side's merge
};

// Runs it and prints the report from world rank 0. Returns the process exit status: 0, or 1 when
// --verify found a difference or a request failed.
int run_disagg(const DisaggFlags& f, const DisaggRunInput& in);

}  // namespace kvshard::cli
