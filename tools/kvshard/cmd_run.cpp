// kvshard run: batched prefill + greedy decode of the reference model, sharded over TP/PP/EP/DP
// ranks (threads or MPI), with per-rank KV bytes against the layout and, with --verify, the
// unsharded run.
#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>

#include "command.h"
#include "kvshard/comm/communicator.h"
#include "kvshard/comm/launch.h"
#include "kvshard/comm/mpi.h"
#include "kvshard/common/checked.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"
#include "kvshard/router/batch_route.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/inputs.h"
#include "kvshard/serve/verify.h"
#include "options.h"
#include "run_disagg.h"
#include "verify_output.h"

namespace kvshard::cli {
namespace {

struct RunFlags {
    ModelFlags model;
    ParallelFlags parallel;
    std::string backend = "threads";
    int prompt_len = 32;
    int gen = 16;
    int prompts = 1;
    int shared_prefix = 0;
    std::string prompt_ids;
    uint64_t seed = 1;
    int block_size = 16;
    bool no_prefix_cache = false;
    int64_t prefill_chunk = 0;
    int arrive_every = 0;
    double max_memory_gib = 0;  // --max-memory-gib; else: the machine's available memory
    bool max_memory_given = false;
    double comm_timeout_s = kDefaultCommTimeoutS;
    std::string route = "round-robin";  // --route: how prompts go to DP replicas
    bool allow_long_context = false;
    bool verify = false;
    bool json = false;
    std::string dump_logits;
    std::string cp_prefill = "auto";                 // --cp-prefill auto|pass-kv|pass-q
    std::string cp_decode_merge = "all-gather";      // --cp-decode-merge all-gather|all-to-all
    const CLI::Option* cp_prefill_option = nullptr;  // given: a CP group must use it
    const CLI::Option* cp_decode_merge_option = nullptr;
    DisaggFlags disagg;  // --prefill/--decode: the disaggregated run (run_disagg.cpp)
};

std::vector<int32_t> parse_ids(const std::string& text, int vocab) {
    std::vector<int32_t> ids;
    size_t pos = 0;
    while (pos <= text.size()) {
        const size_t comma = text.find(',', pos);
        const std::string item =
            text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        size_t used = 0;
        long long v = -1;
        try {
            v = std::stoll(item, &used);
        } catch (...) {
            used = 0;
        }
        require(used == item.size() && !item.empty(), "--prompt-ids: '", item,
                "' is not a token id: give comma-separated integers, e.g. 1,2,3");
        require(v >= 0 && v < vocab, "--prompt-ids: token id ", v,
                " is outside the vocabulary [0, ", vocab, ")");
        ids.push_back(int32_t(v));
        if (comma == std::string::npos) break;
        pos = comma + 1;
    }
    return ids;
}

std::string bytes_text(int64_t b) {
    if (b >= (int64_t{1} << 20)) return fmt::format("{:.2f} MiB", b / 1048576.0);
    if (b >= 1024) return fmt::format("{:.1f} KiB", b / 1024.0);
    return fmt::format("{} B", b);
}

void print_result(const RunFlags& f, const ModelSpec& m, const ParallelConfig& p,
                  const std::string& weights_from, const GenerationReport& r,
                  const std::optional<VerifyResult>& v, int64_t prompt_count,
                  const std::optional<BatchRoute>& routed) {
    const int64_t decode_tokens = prompt_count * (f.gen - 1);
    const double prefill_tps =
        r.prefill_seconds > 0 ? r.computed_prompt_tokens / r.prefill_seconds : 0;
    const double decode_tps = r.decode_seconds > 0 ? decode_tokens / r.decode_seconds : 0;
    const KvLayout layout = make_layout(m, p);
    if (f.json) {
        nlohmann::json ranks = nlohmann::json::array();
        for (const auto& rr : r.ranks) {
            const RankKv& rk = layout.ranks[size_t(rr.rank)];
            ranks.push_back({{"rank", rr.rank},
                             {"dp", rr.coord.dp},
                             {"pp", rr.coord.pp},
                             {"cp", rr.coord.cp},
                             {"tp", rr.coord.tp},
                             {"ep", rr.coord.ep},
                             {"layers", {rk.layer_begin, rk.layer_end}},
                             {"kv_heads", rk.kv_heads},
                             {"experts", {rk.expert_begin, rk.expert_end}},
                             {"kv_tokens", rr.kv_tokens},
                             {"kv_bytes", rr.kv_bytes},
                             {"kv_bytes_predicted", rr.kv_bytes_predicted},
                             {"prefix_hit_tokens", rr.prefix_hit_tokens}});
        }
        nlohmann::json j = {
            {"model", m.name},
            {"weights", weights_from},
            {"parallel", nlohmann::json::parse(to_json(p))},
            {"backend", f.backend},
            {"prompts", prompt_count},
            {"gen", f.gen},
            {"prefill",
             {{"prompt_tokens", r.prompt_tokens},
              {"computed_tokens", r.computed_prompt_tokens},
              {"seconds", r.prefill_seconds},
              {"tokens_per_s", prefill_tps}}},
            {"decode",
             {{"tokens", decode_tokens},
              {"seconds", r.decode_seconds},
              {"tokens_per_s", decode_tps}}},
            {"prefix_cache",
             {{"on", r.prefix_cache},
              {"note", r.prefix_cache_note},
              {"hit_tokens", r.prefix_hit_tokens},
              {"prompt_tokens", r.prompt_tokens}}},
            {"routing",
             {{"policy", f.route},
              {"replica_of", routed ? nlohmann::json(routed->replica_of) : nlohmann::json(nullptr)},
              {"prompts_per_replica",
               routed ? nlohmann::json(routed->prompts_per_replica) : nlohmann::json(nullptr)}}},
            {"tokens", r.tokens},
            {"ranks", ranks},
            {"kv_dtype", dtype_name(m.kv_dtype)},
            {"verify", v ? verify_json(*v) : nlohmann::json(nullptr)}};
        print_json(j.dump(2));
        return;
    }
    fmt::print("{} ({} weights, {} KV), {}, backend {}: {} prompt(s), generate {} token(s) each\n",
               m.name, weights_from, dtype_name(m.kv_dtype), p.to_string(), f.backend, prompt_count,
               f.gen);
    fmt::print(
        "prefill: {} prompt tokens, {} computed, {} prefix-cache hits, {:.2f} ms, {:.0f} "
        "tokens/s\n",
        r.prompt_tokens, r.computed_prompt_tokens, r.prefix_hit_tokens, r.prefill_seconds * 1e3,
        prefill_tps);
    fmt::print("decode:  {} tokens in {:.2f} ms, {:.0f} tokens/s\n", decode_tokens,
               r.decode_seconds * 1e3, decode_tps);
    if (!r.prefix_cache_note.empty()) fmt::print("note: {}\n", r.prefix_cache_note);
    if (routed) {
        std::string per;
        for (int n : routed->prompts_per_replica)
            per += fmt::format("{}{}", per.empty() ? "" : ", ", n);
        fmt::print("routing: {} policy, prompts per replica [{}]\n", f.route, per);
    }
    fmt::print(
        "\n{:>5} {:>3} {:>3} {:>3} {:>3} {:>3}  {:<8} {:<9} {:<8} {:>10} {:>12} {:>12}  {}\n",
        "rank", "dp", "pp", "cp", "tp", "ep", "layers", "kv_heads", "experts", "kv_tokens",
        "kv_bytes", "predicted", "");
    for (const auto& rr : r.ranks) {
        const RankKv& rk = layout.ranks[size_t(rr.rank)];
        const std::string heads =
            rk.kv_heads.size() == 1 ? fmt::format("{}", rk.kv_heads.front())
                                    : fmt::format("{}-{}", rk.kv_heads.front(), rk.kv_heads.back());
        fmt::print(
            "{:>5} {:>3} {:>3} {:>3} {:>3} {:>3}  {:<8} {:<9} {:<8} {:>10} {:>12} {:>12}  {}\n",
            rr.rank, rr.coord.dp, rr.coord.pp, rr.coord.cp, rr.coord.tp, rr.coord.ep,
            fmt::format("[{},{})", rk.layer_begin, rk.layer_end), heads,
            m.moe.enabled() ? fmt::format("[{},{})", rk.expert_begin, rk.expert_end) : "-",
            rr.kv_tokens, bytes_text(rr.kv_bytes), bytes_text(rr.kv_bytes_predicted),
            rr.kv_bytes == rr.kv_bytes_predicted ? "ok" : "MISMATCH");
    }
    if (!r.tokens.empty()) {
        std::string toks;
        for (size_t i = 0; i < r.tokens[0].size() && i < 16; ++i)
            toks += fmt::format("{} ", r.tokens[0][i]);
        fmt::print("\nprompt 0 -> {}{}\n", toks, r.tokens[0].size() > 16 ? "..." : "");
    }
    if (v) print_verify(*v);
}

void run(const RunFlags& f) {
    check_disagg_options_used(f.disagg);
    ModelSpec m = load_model(f.model);
    const ParallelConfig p = to_parallel_config(f.parallel);
    validate(m, p);
    require(f.gen >= 1, "--gen must be at least 1, got ", f.gen);
    require(f.block_size >= 1 && f.block_size <= 1 << 20,
            "--block-size must be in [1, 2^20] tokens, got ", f.block_size);
    const Backend backend = parse_backend(f.backend);
    require_finite_in(f.comm_timeout_s, 0, 1e6, "--comm-timeout-s");
    set_comm_timeout(f.comm_timeout_s);
    require(f.prompts >= 1, "--prompts must be at least 1, got ", f.prompts);
    require(f.prompt_len >= 1, "--prompt-len must be at least 1, got ", f.prompt_len);
    // Prompts that share a prefix ask for prefix hits: refused where CP cannot give them.
    if (f.shared_prefix > 0 && !f.no_prefix_cache && !f.disagg.enabled()) {
        const std::string model_why = model_prefix_cache_unsupported(m);
        require(model_why.empty(), "--shared-prefix ", f.shared_prefix,
                " asks for prefix-cache hits, but ", model_why,
                ": use --no-prefix-cache to run without reuse");
        const std::string why = cp_prefix_cache_unsupported(p, f.block_size);
        require(why.empty(), "--shared-prefix ", f.shared_prefix,
                " asks for prefix-cache hits, but ", why,
                ": use that scheme, or --no-prefix-cache to run without reuse");
    }
    PromptSpec ps{.count = f.prompts,
                  .length = f.prompt_len,
                  .shared_prefix = f.shared_prefix,
                  .seed = f.seed,
                  .token_ids = f.prompt_ids.empty() ? std::vector<int32_t>{}
                                                    : parse_ids(f.prompt_ids, m.vocab)};
    // What the run will hold, checked before the prompts, weights or pools are made.
    std::vector<RunGroup> groups;
    if (f.disagg.enabled()) {
        // With their replicas (--prefill-replicas was left out: 64 groups were sized as one).
        groups.push_back(
            {parse_disagg_side("--prefill", f.disagg.prefill, f.disagg.prefill_replicas, m),
             f.block_size});
        groups.push_back(
            {parse_disagg_side("--decode", f.disagg.decode, f.disagg.decode_replicas, m),
             f.disagg.decode_block_size > 0 ? f.disagg.decode_block_size : f.block_size});
    } else {
        groups.push_back({p, f.block_size});
    }
    // Both choose what a context-parallel group does: with cp = 1 they did nothing.
    const bool cp_prefills = groups.front().parallel.cp > 1;
    const bool cp_decodes = groups.back().parallel.cp > 1;
    require(f.cp_prefill_option->count() == 0 || cp_prefills,
            "--cp-prefill chooses how a context-parallel group prefills; this run has none: give "
            "--cp 2 or more (or a --prefill side with cp > 1), or drop --cp-prefill");
    require(f.cp_decode_merge_option->count() == 0 || cp_decodes,
            "--cp-decode-merge chooses how a context-parallel group merges its decode partials; "
            "this run has none: give --cp 2 or more (or a --decode side with cp > 1), or drop "
            "--cp-decode-merge");
    // Each prompt and its output are one sequence: a vLLM server refuses prompt + max_tokens >
    // max_model_len (vllm/renderers/params.py, TokenizeParams._token_len_check).
    const int64_t prompt_tokens =
        ps.token_ids.empty() ? int64_t{f.prompt_len} : static_cast<int64_t>(ps.token_ids.size());
    m.check_sequence_length(
        prompt_tokens + f.gen, f.allow_long_context,
        detail::concat("a prompt of ", prompt_tokens,
                       ps.token_ids.empty() ? " tokens (--prompt-len)" : " tokens (--prompt-ids)",
                       " plus --gen ", f.gen),
        kAllowLongContextFlag);
    const RunShape shape{.prompts = f.prompts,
                         .prompt_len = prompt_tokens,
                         .gen = f.gen,
                         .verify = f.verify,
                         .local_ranks = backend == Backend::kMpi ? mpirun_local_size() : 0};
    check_run_memory(estimate_run_memory(m, groups, shape),
                     f.max_memory_given
                         ? require_finite_in(f.max_memory_gib, 1e-6, 1 << 20, "--max-memory-gib")
                         : available_memory_gib(),
                     f.max_memory_given);
    const auto prompts = make_prompts(ps, m.vocab);
    const WeightChoice weights = choose_weights(f.model.model, f.seed);
    std::optional<CpPrefillMode> cp_prefill_mode;
    if (f.cp_prefill != "auto") cp_prefill_mode = parse_cp_prefill_mode(f.cp_prefill);
    const CpDecodeMerge cp_decode_merge = parse_cp_decode_merge(f.cp_decode_merge);
    if (f.disagg.enabled()) {
        require(f.prefill_chunk == 0,
                "--prefill-chunk applies to a single-group run; a disaggregated run prefills each "
                "prompt in one step on its prefill group: drop --prefill-chunk");
        require(f.arrive_every == 0,
                "--arrive-every applies to a single-group run under --cp; a disaggregated run "
                "serves its prompts together: drop --arrive-every");
        require(p == ParallelConfig{},
                "--tp/--pp/--cp/--dp/--ep/--cp-scheme describe a single-group run (got ",
                p.to_string(),
                "); a disaggregated run takes both layouts from --prefill and --decode, e.g. "
                "--prefill tp=8 --decode cp=2,tp=2,cp_scheme=zigzag");
        const int status =
            run_disagg(f.disagg, {m, weights.source.get(), weights.description, prompts, f.gen,
                                  f.block_size, backend, f.verify, f.json, !f.no_prefix_cache,
                                  f.dump_logits, cp_prefill_mode, cp_decode_merge});
        if (status != 0) {
            std::fprintf(stderr, "kvshard: run: verification failed or a request failed\n");
            std::fflush(stderr);
            std::exit(status);
        }
        return;
    }
    const RoutingPolicy route = parse_routing_policy(f.route);
    GenerationOptions opt;
    std::optional<BatchRoute> routed;
    if (route != RoutingPolicy::kRoundRobin) {
        require(p.dp > 1, "--route ", f.route, " chooses among DP replicas: give --dp 2 or more");
        routed = route_prompts(prompts, p.dp, f.block_size, route);
        opt.replica_of = routed->replica_of;
    }
    opt.max_new_tokens = f.gen;
    opt.block_size = f.block_size;
    opt.prefix_cache = !f.no_prefix_cache;
    opt.prefill_chunk_tokens = f.prefill_chunk;
    if (f.arrive_every > 0) {
        require(p.cp > 1,
                "--arrive-every staggers arrivals into the CP runner's continuous "
                "batching: give --cp 2 or more (the plain runner prefills every prompt at once)");
        for (size_t i = 0; i < prompts.size(); ++i)
            opt.arrival_step.push_back(static_cast<int>(i) * f.arrive_every);
    }
    opt.cp_prefill_mode = cp_prefill_mode;
    opt.cp_decode_merge = cp_decode_merge;
    set_compute_threads(1);

    bool failed = false;
    launch(backend, p.world_size(), [&](Communicator& world) {
        const GenerationReport r = generate(m, p, *weights.source, prompts, opt, &world);
        if (world.rank() != 0) return;
        std::optional<VerifyResult> v;
        if (f.verify) {
            v = verify_against_reference(m, *weights.source, prompts, opt.max_new_tokens,
                                         opt.block_size, r.tokens, r.last_logits);
            failed = !v->ok();
        }
        for (const auto& rr : r.ranks) failed = failed || rr.kv_bytes != rr.kv_bytes_predicted;
        if (!f.dump_logits.empty()) {
            std::vector<float> all;
            for (const auto& l : r.last_logits) all.insert(all.end(), l.begin(), l.end());
            write_npy(f.dump_logits, all, int64_t(prompts.size()), m.vocab);
        }
        print_result(f, m, p, weights.description, r, v, int64_t(prompts.size()), routed);
        std::fflush(stdout);
    });
    if (failed) {
        std::fprintf(stderr, "kvshard: run: verification failed\n");
        std::fflush(stderr);
        std::exit(1);
    }
}

void setup(CLI::App& app) {
    auto f = std::make_shared<RunFlags>();
    auto* sub = app.add_subcommand(
        "run",
        "Run batched prefill and greedy decode of the reference model, sharded over TP/PP/EP/DP "
        "ranks; print "
        "per-rank KV bytes against the layout, tokens per second and prefix-cache hits");
    add_model_options(sub, f->model);
    add_parallel_options(sub, f->parallel);
    sub->add_option("--backend", f->backend,
                    "threads (ranks as threads of this process) | mpi (this process is one rank of "
                    "`mpirun -np N kvshard run --backend mpi ...`)")
        ->capture_default_str();
    sub->add_option("--prompt-len", f->prompt_len,
                    "tokens per prompt (including the shared prefix)")
        ->capture_default_str();
    sub->add_option("--gen", f->gen, "greedy tokens to generate per prompt")->capture_default_str();
    sub->add_option("--prompts", f->prompts,
                    "number of prompts (DP replicas as --route assigns them)")
        ->capture_default_str();
    sub->add_option("--shared-prefix", f->shared_prefix,
                    "leading tokens all prompts share (prefix-cache hits)")
        ->capture_default_str();
    sub->add_option("--prompt-ids", f->prompt_ids,
                    "the prompt as comma-separated token ids (every prompt)");
    sub->add_option("--seed", f->seed, "seed of the random weights and prompts")
        ->check(CLI::Range(uint64_t{0}, uint64_t{INT64_MAX}))
        ->capture_default_str();
    sub->add_option("--block-size", f->block_size, "tokens per KV block")->capture_default_str();
    sub->add_flag("--no-prefix-cache", f->no_prefix_cache, "recompute every prompt token");
    sub->add_option("--prefill-chunk", f->prefill_chunk,
                    "chunked prefill: at most this many tokens of each prompt per forward step "
                    "(0: a whole prompt in one step; single-group runs with cp=1)")
        ->check(CLI::Range(0, 1 << 20))
        ->capture_default_str();
    sub->add_option("--arrive-every", f->arrive_every,
                    "continuous batching under --cp: prompt i joins the running batch at decode "
                    "step i * N (0: every prompt at once)")
        ->check(CLI::Range(0, 1 << 20))
        ->capture_default_str();
    sub->add_option(
           "--max-memory-gib", f->max_memory_gib,
           "refuse the run when its estimated memory (weights, KV pools, buffers, prompts, "
           "the --verify reference) is above this many GiB; default: this machine's "
           "available memory")
        ->each([f](const std::string&) { f->max_memory_given = true; });
    sub->add_option("--route", f->route,
                    "how prompts go to DP replicas: round-robin (prompt i on replica i % dp) | "
                    "least-loaded | cache-aware | cost | kvshard (the router's policies over its "
                    "prefix index, docs/router.md)")
        ->capture_default_str();
    sub->add_option("--comm-timeout-s", f->comm_timeout_s,
                    "end the run when a rank waits longer than this in any collective, blocking "
                    "send/receive or request (a stopped, dead or stuck rank), naming the rank(s) "
                    "that did not answer; 0: no limit")
        ->capture_default_str();
    f->cp_prefill_option =
        sub->add_option(
               "--cp-prefill", f->cp_prefill,
               "CP prefill: auto (the mode that moves fewer bytes, docs/context-parallel.md "
               "section 4) | pass-kv (KV shards travel the ring) | pass-q (queries travel, "
               "partial outputs come back by all-to-all)")
            ->capture_default_str();
    f->cp_decode_merge_option =
        sub->add_option(
               "--cp-decode-merge", f->cp_decode_merge,
               "CP decode: all-gather (every rank merges every partial) | all-to-all (Helix: "
               "each rank merges a share of the heads)")
            ->capture_default_str();
    sub->add_flag(
        "--verify", f->verify,
        "also run the model unsharded (one rank, another block size, no prefix cache) and compare: "
        "last-step logits within 1e-4 relative L2 and identical tokens (exit 1 otherwise)");
    sub->add_flag("--allow-long-context", f->allow_long_context,
                  "run prompts whose prompt + --gen exceeds the model's max_model_len, as vLLM "
                  "serves them with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (without it they are refused)");
    sub->add_flag("--json", f->json, "print JSON");
    sub->add_option("--dump-logits", f->dump_logits,
                    "write the last step's logits [prompts][vocab] to FILE.npy");
    add_disagg_options(sub, f->disagg);
    sub->callback([f] { run(*f); });
}

}  // namespace

KVSHARD_COMMAND("run", setup);

}  // namespace kvshard::cli
