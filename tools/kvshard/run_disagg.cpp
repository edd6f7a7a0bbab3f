#include "run_disagg.h"

#include <fmt/format.h>

#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

#include "kvshard/comm/launch.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/serve/disagg.h"
#include "kvshard/serve/verify.h"
#include "options.h"
#include "verify_output.h"

namespace kvshard::cli {
namespace {

PageOrder parse_order(const std::string& flag, const std::string& s) {
    try {
        return parse_page_order(s);
    } catch (const Error& e) {
        throw Error(flag + ": " + e.what());
    }
}

std::string bytes_text(int64_t b) {
    if (b >= (int64_t{1} << 20)) return fmt::format("{:.2f} MiB", b / 1048576.0);
    if (b >= 1024) return fmt::format("{:.1f} KiB", b / 1024.0);
    return fmt::format("{} B", b);
}

}  // namespace

ParallelConfig parse_disagg_side(const char* flag, const std::string& text, int replicas,
                                 const ModelSpec& m) {
    require(!text.empty(), flag,
            " is missing: a disaggregated run needs both --prefill and --decode, e.g. "
            "--prefill tp=8 --decode tp=4");
    require(replicas >= 0 && replicas <= 4096, flag,
            "-replicas must be between 1 and 4096 groups, got ", replicas);
    ParallelConfig p;
    try {
        p = parse_parallel_config(text);
    } catch (const Error& e) {
        throw Error(fmt::format("{} '{}': {}", flag, text, e.what()));
    }
    if (replicas > 0) {
        require(p.dp == 1 || p.dp == replicas, flag, " '", text, "' names dp=", p.dp, " but ", flag,
                "-replicas says ", replicas,
                ": give the number of groups once (dp in the layout or the flag), or the same in "
                "both");
        p.dp = replicas;
    }
    try {
        validate(m, p);
        return p;
    } catch (const Error& e) {
        throw Error(fmt::format("{} '{}': {}", flag, text, e.what()));
    }
}

void add_disagg_options(CLI::App* sub, DisaggFlags& f) {
    sub->add_option(
        "--prefill", f.prefill,
        "disaggregated run: the prefill group's layout, e.g. tp=8, tp=4,pp=2 or cp=2,tp=2,pp=2 "
        "(cp > 1: context-parallel prefill, dp=1) (with --decode)");
    sub->add_option(
        "--decode", f.decode,
        "disaggregated run: the decode group's layout, e.g. tp=4, tp=2,pp=2 or cp=2,tp=2 "
        "(cp > 1: context-parallel decode, dp=1)");
    f.side_options.push_back(
        sub->add_option("--decode-block-size", f.decode_block_size,
                        "disaggregated run: decode block size (default: --block-size)"));
    f.side_options.push_back(sub->add_option("--prefill-order", f.prefill_order,
                                             "disaggregated run: prefill page order hnd|nhd")
                                 ->capture_default_str());
    f.side_options.push_back(sub->add_option("--decode-order", f.decode_order,
                                             "disaggregated run: decode page order hnd|nhd")
                                 ->capture_default_str());
    f.side_options.push_back(
        sub->add_option("--transfer-mode", f.transfer_mode,
                        "disaggregated run: where the KV is reshaped: pre-send|post-receive|auto")
            ->capture_default_str());
    f.side_options.push_back(
        sub->add_flag("--no-stream", f.no_stream,
                      "disaggregated run: send the KV after prefill instead of layer by layer"));
    f.side_options.push_back(
        sub->add_option(
               "--staging-mib", f.staging_mib,
               "disaggregated run: packed KV in flight per rank (MiB; back-pressure beyond)")
            ->capture_default_str());
    f.side_options.push_back(
        sub->add_option("--sender-sleep-us", f.sender_sleep_us,
                        "disaggregated run: a prefill rank with all its KV posted sleeps this long "
                        "between polls (0: spins; > 0 frees its core where the transport moves the "
                        "bytes without it, e.g. MPI on one host with CMA)")
            ->capture_default_str());
    f.side_options.push_back(
        sub->add_option(
               "--check-thread-bytes", f.check_thread_bytes,
               "disaggregated run: a payload received straight into the pool of at least this "
               "many bytes is checksummed on a worker thread beside the receive (where the "
               "rank may use more than one CPU; -1: never)")
            ->capture_default_str());
    f.side_options.push_back(
        sub->add_option(
               "--direct-read", f.direct_read,
               "disaggregated run: on: the prefill pools are shareable and each decode rank "
               "on the same host reads its KV from them in place (one copy, only headers "
               "travel); rma: each decode rank reads its KV from the prefill pools through an "
               "MPI RMA window (MPI_Rget of each contiguous run, then a checksum check), "
               "which works across hosts; off: the KV travels in messages")
            ->capture_default_str());
    f.side_options.push_back(
        sub->add_option("--direct-window", f.direct_window,
                        "disaggregated run, direct read: messages a prefill rank announces to one "
                        "decode rank ahead of what it has read (0: no bound)")
            ->capture_default_str());
    f.side_options.push_back(
        sub->add_option(
               "--source-checksums", f.source_checksums,
               "disaggregated run, direct read: on: each prefill rank seals every layer's KV "
               "as it writes it (one XXH3 per block and head), and a message that reads whole "
               "sealed blocks is checked against those seals, with no checksum pass over the "
               "prefill pool when it is sent; off: every message is checksummed when sent")
            ->capture_default_str());
    f.side_options.push_back(
        sub->add_option("--prefill-replicas", f.prefill_replicas,
                        "disaggregated run: prefill groups of the --prefill layout (its dp; the "
                        "requests go to them by --prefill-route)"));
    f.side_options.push_back(sub->add_option(
        "--decode-replicas", f.decode_replicas,
        "disaggregated run: decode groups of the --decode layout (its dp; each request "
        "goes to the one with the most free KV blocks)"));
    f.side_options.push_back(
        sub->add_option(
               "--prefill-route", f.prefill_route,
               "disaggregated run, several prefill groups: round-robin (request i to group i "
               "% dp) or least-tokens (to the group with the fewest prompt tokens so far)")
            ->capture_default_str());
}

void check_disagg_options_used(const DisaggFlags& f) {
    if (f.enabled()) return;
    for (const CLI::Option* o : f.side_options)
        require(o->count() == 0, o->get_name(),
                " applies to a disaggregated run only: give --prefill LAYOUT and --decode LAYOUT "
                "(e.g. --prefill tp=2 --decode tp=1), or drop ",
                o->get_name());
}

int run_disagg(const DisaggFlags& f, const DisaggRunInput& in) {
    const ModelSpec& m = in.model;
    const ParallelConfig pp = parse_disagg_side("--prefill", f.prefill, f.prefill_replicas, m);
    const ParallelConfig pd = parse_disagg_side("--decode", f.decode, f.decode_replicas, m);
    require(f.staging_mib >= 1 && f.staging_mib <= (int64_t{1} << 20),
            "--staging-mib must be between 1 and 1048576 (1 TiB), got ", f.staging_mib);
    require(f.sender_sleep_us >= 0 && f.sender_sleep_us <= 1000000,
            "--sender-sleep-us must be between 0 (spin) and 1000000 (1 s), got ",
            f.sender_sleep_us);
    require(f.check_thread_bytes >= -1,
            "--check-thread-bytes must be -1 (never) or a byte count >= 0, got ",
            f.check_thread_bytes);
    require(f.direct_read == "on" || f.direct_read == "off" || f.direct_read == "rma",
            "--direct-read must be on, rma or off, got '", f.direct_read, "'");
    require(f.source_checksums == "on" || f.source_checksums == "off",
            "--source-checksums must be on or off, got '", f.source_checksums, "'");
    require(f.direct_window >= 0 && f.direct_window <= 1000000,
            "--direct-window must be between 0 (no bound) and 1000000 messages, got ",
            f.direct_window);
    require(f.decode_block_size >= 0 && f.decode_block_size <= 1 << 20,
            "--decode-block-size must be in [1, 2^20] tokens (or 0: the same as --block-size), "
            "got ",
            f.decode_block_size);
    DisaggOptions opt;
    opt.max_new_tokens = in.gen;
    opt.prefill_block_size = in.block_size;
    opt.decode_block_size = f.decode_block_size > 0 ? f.decode_block_size : in.block_size;
    opt.prefill_order = parse_order("--prefill-order", f.prefill_order);
    opt.decode_order = parse_order("--decode-order", f.decode_order);
    opt.transfer.mode = parse_transfer_mode(f.transfer_mode);
    require(f.prefill_route == "round-robin" || f.prefill_route == "least-tokens",
            "--prefill-route must be round-robin (request i to group i % dp) or least-tokens (to "
            "the group with the fewest prompt tokens so far), got '",
            f.prefill_route, "'");
    opt.prefill_route = parse_prefill_route(f.prefill_route);
    opt.cp_prefill_mode = in.cp_prefill_mode;
    opt.cp_decode_merge = in.cp_decode_merge;
    opt.stream_layers = !f.no_stream;
    opt.prefix_cache = in.prefix_cache;
    opt.transfer.staging_bytes = f.staging_mib << 20;
    opt.transfer.sender_idle_sleep_us = f.sender_sleep_us;
    opt.transfer.offload_check_bytes = f.check_thread_bytes;
    opt.transfer.direct_read = f.direct_read != "off";
    opt.rma_read = f.direct_read == "rma";
    opt.transfer.direct_window = f.direct_window;
    opt.source_checksums = f.source_checksums == "on";
    set_compute_threads(1);

    int status = 0;
    launch(in.backend, pp.world_size() + pd.world_size(), [&](Communicator& world) {
        const DisaggReport r = disagg_generate(m, pp, pd, *in.weights, in.prompts, opt, world);
        if (world.rank() != 0) return;
        VerifyResult v;
        if (in.verify) {
            v = verify_against_reference(m, *in.weights, in.prompts, in.gen, in.block_size,
                                         r.tokens, r.last_logits, r.errors);
            if (!v.ok()) status = 1;
        }
        if (r.failed_requests > 0) status = 1;
        if (!in.dump_logits.empty()) {
            std::vector<float> all;
            for (const auto& l : r.last_logits) {
                if (l.empty())  // a failed request
                    all.insert(all.end(), static_cast<size_t>(m.vocab),
                               std::numeric_limits<float>::quiet_NaN());
                else
                    all.insert(all.end(), l.begin(), l.end());
            }
            write_npy(in.dump_logits, all, static_cast<int64_t>(in.prompts.size()), m.vocab);
        }
        if (in.json) {
            nlohmann::json j = {{"model", m.name},
                                {"weights", in.weights_from},
                                {"backend", std::string(backend_name(in.backend))},
                                {"prefill",
                                 {{"parallel", pp.to_string()},
                                  {"ranks", pp.world_size()},
                                  {"block_size", opt.prefill_block_size},
                                  {"seconds", r.prefill_seconds}}},
                                {"decode",
                                 {{"parallel", pd.to_string()},
                                  {"ranks", pd.world_size()},
                                  {"block_size", opt.decode_block_size},
                                  {"seconds", r.decode_seconds}}},
                                {"transfer",
                                 {{"bytes", r.transfer_bytes},
                                  {"min_bytes", r.min_bytes},
                                  {"messages", r.messages},
                                  {"direct_messages", r.direct_messages},
                                  {"unit_checksum_messages", r.unit_checksum_messages},
                                  {"mode", r.mode},
                                  {"streamed", r.streamed},
                                  {"seconds", r.transfer_seconds},
                                  {"tail_bytes", r.tail_bytes},
                                  {"last_layer_s", r.last_layer_s},
                                  {"end_s", r.transfer_end_s},
                                  {"exposed_seconds", r.exposed_seconds},
                                  {"hidden_fraction", r.hidden_fraction}}},
                                {"prefix_cache",
                                 {{"on", r.prefix_cache},
                                  {"note", r.prefix_cache_note},
                                  {"prompt_tokens", r.prompt_tokens},
                                  {"prefill_computed_tokens", r.prefill_computed_tokens},
                                  {"decode_cached_tokens", r.decode_cached_tokens}}},
                                {"prompts", in.prompts.size()},
                                {"gen", in.gen},
                                {"tokens", r.tokens},
                                {"prefill_replica", r.prefill_replica},
                                {"decode_replica", r.decode_replica},
                                {"prefill_route", prefill_route_name(opt.prefill_route)},
                                {"failed_requests", r.failed_requests},
                                {"errors", r.errors},
                                {"kv_dtype", dtype_name(m.kv_dtype)},
                                {"verify", in.verify ? verify_json(v) : nlohmann::json(nullptr)}};
            print_json(j.dump(2));
        } else {
            fmt::print(
                "{} ({} weights, {} KV), backend {}: prefill {} ({} ranks) -> decode {} ({} "
                "ranks), {} prompt(s), generate {} token(s) each\n",
                m.name, in.weights_from, dtype_name(m.kv_dtype), backend_name(in.backend),
                pp.to_string(), pp.world_size(), pd.to_string(), pd.world_size(), in.prompts.size(),
                in.gen);
            fmt::print("prefill: {:.2f} ms, {} of {} prompt tokens computed{}\n",
                       r.prefill_seconds * 1e3, r.prefill_computed_tokens, r.prompt_tokens,
                       r.prefix_cache ? fmt::format(" (prefix cache: the decode side held {} "
                                                    "tokens already, not sent)",
                                                    r.decode_cached_tokens)
                                      : "");
            if (!r.prefix_cache_note.empty()) fmt::print("note: {}\n", r.prefix_cache_note);
            const std::string in_place = r.direct_messages == 0 ? "none"
                                         : r.direct_messages == r.messages
                                             ? "all"
                                             : fmt::format("{} of them", r.direct_messages);
            const std::string sealed = r.unit_checksum_messages == 0 ? ""
                                       : r.unit_checksum_messages == r.direct_messages
                                           ? " (all checked against prefill's seals)"
                                           : fmt::format(" ({} checked against prefill's seals)",
                                                         r.unit_checksum_messages);
            fmt::print(
                "transfer: {} in {} messages (minimum {}), {} read in place{}, mode {}, {} ({} "
                "waited for the last layer); {:.2f} ms, {:.2f} ms of it exposed after the last "
                "prefill layer ({:.0f}% hidden)\n",
                bytes_text(r.transfer_bytes), r.messages, bytes_text(r.min_bytes), in_place, sealed,
                r.mode, r.streamed ? "layer by layer" : "after prefill", bytes_text(r.tail_bytes),
                r.transfer_seconds * 1e3, r.exposed_seconds * 1e3, r.hidden_fraction * 100);
            fmt::print("decode: {:.2f} ms\n", r.decode_seconds * 1e3);
            if (pp.dp > 1 || pd.dp > 1) {
                std::string served;
                for (size_t i = 0; i < in.prompts.size(); ++i)
                    served += fmt::format("{}{}->{}", i ? ", " : "", r.prefill_replica[i],
                                          r.decode_replica[i]);
                fmt::print("replicas (prefill -> decode) per request ({} prefill route): {}\n",
                           prefill_route_name(opt.prefill_route), served);
            }
            for (size_t i = 0; i < in.prompts.size(); ++i)
                if (!r.errors[i].empty()) fmt::print("request {} failed: {}\n", i, r.errors[i]);
            if (!r.tokens.empty() && !r.tokens[0].empty()) {
                std::string toks;
                for (size_t i = 0; i < r.tokens[0].size() && i < 16; ++i)
                    toks += fmt::format("{} ", r.tokens[0][i]);
                fmt::print("prompt 0 -> {}{}\n", toks, r.tokens[0].size() > 16 ? "..." : "");
            }
            if (in.verify) print_verify(v);
        }
        std::fflush(stdout);
    });
    return status;
}

}  // namespace kvshard::cli
