// kvshard simulate: replay a request trace over R data-parallel replicas under each routing policy.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>

#include "command.h"
#include "kvshard/common/error.h"
#include "kvshard/planner/hardware.h"
#include "kvshard/sim/planner_service.h"
#include "kvshard/sim/simulator.h"
#include "kvshard/sim/trace_lengths.h"
#include "options.h"

namespace kvshard::cli {
namespace {

struct SimulateFlags {
    std::string trace;
    int replicas = 8;
    std::string policy = "all";
    ModelFlags model{"llama-3.1-70b", ""};
    std::string hardware = "h100-sxm";
    int tp = 8;
    int pp = 1;
    int64_t capacity_tokens = 0;
    std::string on_error = "fail";
    int64_t max_requests = 0;
    std::string index = "exact";
    double ttl_s = SimConfig{}.index_ttl_s;
    int max_batch = 256;
    int64_t max_prefill_tokens = 16384;
    bool eagle_block_drop = false;
    double load_slack = PolicyParams{}.load_slack;
    double load_headroom = PolicyParams{}.load_headroom_tokens;
    double balance_abs = PolicyParams{}.balance_abs_threshold;
    double balance_rel = PolicyParams{}.balance_rel_threshold;
    double cache_threshold = PolicyParams{}.cache_threshold;
    double overlap_weight = PolicyParams{}.overlap_weight;
    double prefill_weight = PolicyParams{}.prefill_weight;
    bool allow_long_context = false;
    bool json = false;
    std::string svg;
};

class ProgressBar {
  public:
    explicit ProgressBar(std::string label) : label_(std::move(label)), on_(isatty(2) != 0) {}
    void operator()(int64_t done, int64_t total) {
        if (!on_ || total <= 0) return;
        const int percent = static_cast<int>(done * 100 / total);
        if (percent == last_percent_ && done != total) return;  // redraw only when it moves
        last_percent_ = percent;
        const int width = 30;
        const int fill = static_cast<int>(done * width / total);
        std::fprintf(stderr, "\r%-13s [%s%s] %3d%% %lld/%lld", label_.c_str(),
                     std::string(fill, '#').c_str(), std::string(width - fill, ' ').c_str(),
                     static_cast<int>(done * 100 / total), static_cast<long long>(done),
                     static_cast<long long>(total));
        if (done == total) std::fprintf(stderr, "\r%*s\r", 80, "");
        std::fflush(stderr);
    }

  private:
    std::string label_;
    bool on_;
    int last_percent_ = -1;
};

void run(const SimulateFlags& f) {
    const Trace trace =
        load_trace(f.trace, parse_trace_error_policy(f.on_error), 512, f.max_requests);
    require(!trace.requests.empty(), "trace '", f.trace, "' holds no valid request");
    for (size_t i = 0; i < trace.skipped.size() && i < 5; ++i)
        std::fprintf(stderr, "kvshard: warning: %s:%lld: skipped malformed line: %s\n",
                     f.trace.c_str(), static_cast<long long>(trace.skipped[i].line),
                     trace.skipped[i].message.c_str());
    if (trace.skipped.size() > 5)
        std::fprintf(stderr, "kvshard: warning: %zu more malformed lines skipped\n",
                     trace.skipped.size() - 5);

    ReplicaSetup setup;
    setup.model = load_model(f.model);
    // A request vLLM refuses is not replayed as if served.
    const int64_t long_requests =
        check_trace_lengths(trace, setup.model, f.allow_long_context, kAllowLongContextFlag);
    setup.hardware = resolve_hardware(f.hardware);
    setup.parallel =
        parse_parallel_config("tp=" + std::to_string(f.tp) + ",pp=" + std::to_string(f.pp));
    require(f.capacity_tokens >= 0,
            "--capacity-tokens must be >= 0 (0 or absent: what the planner computes), got ",
            f.capacity_tokens);
    const int64_t capacity_tokens =
        f.capacity_tokens > 0 ? f.capacity_tokens : replica_kv_tokens(setup);
    require(capacity_tokens >= trace.block_tokens, "each replica holds ", capacity_tokens,
            " KV tokens, less than one ", trace.block_tokens, "-token trace block");
    const PlannerServiceModel service(setup);

    SimConfig cfg;
    cfg.num_replicas = f.replicas;
    cfg.replica_capacity_blocks = capacity_tokens / trace.block_tokens;
    cfg.index_mode = parse_kv_index_mode(f.index);
    cfg.index_ttl_s = f.ttl_s;
    cfg.max_batch = f.max_batch;
    cfg.max_prefill_tokens = f.max_prefill_tokens;
    cfg.eagle_block_drop = f.eagle_block_drop;
    cfg.params.load_slack = f.load_slack;
    cfg.params.load_headroom_tokens = f.load_headroom;
    cfg.params.balance_abs_threshold = f.balance_abs;
    cfg.params.balance_rel_threshold = f.balance_rel;
    cfg.params.cache_threshold = f.cache_threshold;
    cfg.params.overlap_weight = f.overlap_weight;
    cfg.params.prefill_weight = f.prefill_weight;
    cfg.validate();

    std::vector<RoutingPolicy> policies;
    if (f.policy == "all")
        policies = all_routing_policies();
    else
        policies.push_back(parse_routing_policy(f.policy));

    SimReport rep;
    rep.trace = f.trace;
    rep.requests = static_cast<int64_t>(trace.requests.size());
    rep.skipped_lines = static_cast<int64_t>(trace.skipped.size());
    rep.trace_duration_s = trace.duration_s();
    rep.num_replicas = f.replicas;
    rep.block_tokens = trace.block_tokens;
    rep.replica_capacity_blocks = cfg.replica_capacity_blocks;
    rep.setup =
        fmt::format("{}: {} KV tokens{}{}{}", setup.to_string(), capacity_tokens,
                    f.capacity_tokens > 0 ? " (--capacity-tokens)" : " (planner)",
                    f.eagle_block_drop ? ", EAGLE block drop" : "",
                    long_requests > 0 ? fmt::format(", {} requests longer than max_model_len {} "
                                                    "(--allow-long-context)",
                                                    long_requests, setup.model.max_model_len)
                                      : std::string());
    rep.infinite_cache = infinite_cache_hit_rates(trace);
    rep.pooled_lru =
        pooled_lru_hit_rates(trace, cfg.replica_capacity_blocks * f.replicas, cfg.eagle_block_drop);
    for (RoutingPolicy p : policies) {
        cfg.policy = p;
        ProgressBar bar{std::string(routing_policy_name(p))};
        rep.policies.push_back(
            simulate(trace, cfg, service, [&](int64_t d, int64_t t) { bar(d, t); }));
    }
    if (!f.svg.empty()) {
        std::ofstream out(f.svg);
        require(out.good(), "cannot write SVG file '", f.svg, "'");
        out << render_svg(rep);
    }
    if (f.json) {
        print_json(to_json(rep));
        return;
    }
    fmt::print("trace: {}: {} requests over {:.0f} s ({} malformed lines skipped)\n", f.trace,
               rep.requests, rep.trace_duration_s, rep.skipped_lines);
    fmt::print("cluster: {} replicas of {} ({} blocks of {} tokens)\n", rep.num_replicas, rep.setup,
               rep.replica_capacity_blocks, rep.block_tokens);
    fmt::print(
        "bounds: infinite cache {:.1f}% of prompt tokens ({:.1f}% of blocks); "
        "pooled LRU of {} blocks {:.1f}% ({:.1f}%)\n\n",
        rep.infinite_cache.token_hit_rate * 100, rep.infinite_cache.block_hit_rate * 100,
        rep.replica_capacity_blocks * rep.num_replicas, rep.pooled_lru.token_hit_rate * 100,
        rep.pooled_lru.block_hit_rate * 100);
    fmt::print("{:<13} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>10}\n", "policy",
               "tok-hit", "blk-hit", "/pooled", "load max", "TTFT p50", "TTFT p90", "TTFT p99",
               "req/s", "out tok/s");
    for (const auto& p : rep.policies)
        fmt::print(
            "{:<13} {:>7.1f}% {:>7.1f}% {:>9.3f} {:>9.3f} {:>8.3f}s {:>8.3f}s {:>8.3f}s {:>8.2f} "
            "{:>10.0f}\n",
            p.name, p.hits.token_hit_rate * 100, p.hits.block_hit_rate * 100,
            rep.pooled_lru.token_hit_rate > 0
                ? p.hits.token_hit_rate / rep.pooled_lru.token_hit_rate
                : 0.0,
            p.load_max_over_mean, p.ttft_p50_s, p.ttft_p90_s, p.ttft_p99_s, p.requests_per_s,
            p.output_tokens_per_s);
}

void setup(CLI::App& app) {
    auto f = std::make_shared<SimulateFlags>();
    auto* sub = app.add_subcommand("simulate",
                                   "Replay a request trace (Mooncake JSON lines) over "
                                   "data-parallel replicas under each routing "
                                   "policy: prefix-hit rates against the infinite-cache and "
                                   "pooled-LRU bounds, load balance, TTFT");
    sub->add_option("--trace", f->trace,
                    "JSON-lines trace: timestamp (ms), input_length, output_length, hash_ids")
        ->required();
    sub->add_option("--replicas,-r", f->replicas, "data-parallel replicas (1-64)")
        ->capture_default_str();
    sub->add_option("--policy,-p", f->policy,
                    "round-robin|least-loaded|cache-aware|cost|kvshard, or all")
        ->capture_default_str();
    add_model_options(sub, f->model, /*required=*/false);
    sub->add_option("--hardware", f->hardware, "accelerator: a catalog name or a JSON file")
        ->capture_default_str();
    sub->add_option("--tp", f->tp, "tensor parallel size of each replica")->capture_default_str();
    sub->add_option("--pp", f->pp, "pipeline parallel size of each replica")->capture_default_str();
    sub->add_option(
        "--capacity-tokens", f->capacity_tokens,
        "KV tokens per replica (default: what the planner computes for model/hardware/tp)");
    sub->add_option("--on-error", f->on_error, "malformed trace line: fail (stop) or skip (warn)")
        ->capture_default_str();
    sub->add_option("--max-requests", f->max_requests, "replay only the first N requests (0: all)");
    sub->add_option("--index", f->index,
                    "router's view of the caches: exact (KV events) or approximate")
        ->capture_default_str();
    auto* ttl = sub->add_option("--ttl", f->ttl_s,
                                "approximate index: seconds a routed prefix counts as cached")
                    ->capture_default_str();
    sub->add_option("--max-batch", f->max_batch, "running requests per replica")
        ->capture_default_str();
    sub->add_option("--max-prefill-tokens", f->max_prefill_tokens,
                    "prompt tokens prefilled per engine step")
        ->capture_default_str();
    sub->add_flag("--eagle-block-drop", f->eagle_block_drop,
                  "the engines draft with EAGLE, EAGLE3 or MTP: vLLM drops the last matched block "
                  "of each prefix-cache hit (replicas and router); capacity and step times stay "
                  "those of a plain engine");
    sub->add_option("--load-slack", f->load_slack,
                    "kvshard policy: eps in the load bound (1+eps)*mean")
        ->capture_default_str();
    sub->add_option("--load-headroom", f->load_headroom,
                    "kvshard policy: tokens of load added to the bound")
        ->capture_default_str();
    sub->add_option("--balance-abs", f->balance_abs,
                    "cache-aware policy: absolute load gap (blocks) that counts as imbalance")
        ->capture_default_str();
    sub->add_option("--balance-rel", f->balance_rel,
                    "cache-aware policy: max/min load ratio that counts as imbalance")
        ->capture_default_str();
    sub->add_option("--cache-threshold", f->cache_threshold,
                    "cache-aware policy: least match ratio to follow the best match")
        ->capture_default_str();
    sub->add_option("--overlap-weight", f->overlap_weight,
                    "cost policy: weight of the blocks left to prefill against active blocks")
        ->capture_default_str();
    sub->add_option("--prefill-weight", f->prefill_weight,
                    "kvshard policy: weight of a queued prefill block against an active block")
        ->capture_default_str();
    sub->add_flag("--allow-long-context", f->allow_long_context,
                  "replay requests whose prompt + output exceeds the model's max_model_len, as "
                  "engines started with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and a --max-model-len "
                  "that long would serve them (without it such a trace is refused)");
    sub->add_flag("--json", f->json, "print JSON instead of a table");
    sub->add_option("--svg", f->svg,
                    "write a chart (hit rate per policy against the bounds, load balance)");
    sub->callback([f, ttl] {
        // The exact index follows the KV events and has no TTL.
        require(ttl->count() == 0 || f->index != "exact", "--ttl ", f->ttl_s,
                " sets how long the approximate index counts a routed prefix as cached; the "
                "exact index (the default) has no TTL: give --index approximate or drop --ttl");
        run(*f);
    });
}

}  // namespace

KVSHARD_COMMAND("simulate", setup);

}  // namespace kvshard::cli
