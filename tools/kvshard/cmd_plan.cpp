// kvshard plan: rank every (dp, pp, cp, tp, ep) for N GPUs by capacity and estimated TTFT/TPOT.
#include <fmt/format.h>

#include <fstream>
#include <memory>

#include "command.h"
#include "kvshard/common/error.h"
#include "kvshard/planner/disagg.h"
#include "kvshard/planner/planner.h"
#include "kvshard/router/policy.h"
#include "kvshard/sim/planner_service.h"
#include "kvshard/sim/trace.h"
#include "kvshard/sim/trace_lengths.h"
#include "options.h"

namespace kvshard::cli {
namespace {

struct PlanFlags {
    ModelFlags model;
    HardwareFlags hardware;
    int gpus = 0;
    int64_t context = -1;  // -1: not given (then --trace gives it)
    int64_t batch = 0;
    int64_t max_batch = 256;
    std::string objective = "throughput";
    std::string cp_scheme = "zigzag";
    std::string cp_prefill = "auto";
    std::string cp_decode_merge = "auto";
    int pp_chunks = 0;
    int top = 0;
    bool json = false;
    std::string svg;
    std::string explain;  // "tp=8,pp=2": detail one configuration instead of ranking
    std::string weight_dtype = "model";
    bool disagg = false;
    double ttft_slo = 0, tpot_slo = 0;
    int64_t output_tokens = 0;  // 0: 256, or the trace's mean
    std::string trace;
    std::string route = "kvshard";
    std::string speculative_method;  // "mtp"; empty: no speculative decoding
    int speculative_tokens = 0;
    const CLI::Option* speculative_tokens_option = nullptr;
    const CLI::Option* speculative_method_option = nullptr;
};

// --speculative-method / --speculative-tokens: both or neither; the method vLLM's MTP drafter
// runs as ("mtp") and N >= 1.
int speculative_tokens(const PlanFlags& f) {
    const bool tokens_given = f.speculative_tokens_option->count() > 0;
    require(f.speculative_method_option->count() == 0 || !f.speculative_method.empty(),
            "--speculative-method is empty: give mtp (the model's MTP layers draft), or leave the "
            "flag out for no speculative decoding");
    if (f.speculative_method.empty()) {
        require(!tokens_given, "--speculative-tokens ", f.speculative_tokens,
                " needs the drafter: give --speculative-method mtp (the model's MTP layers, the "
                "only method modelled)");
        return 0;
    }
    require(f.speculative_method == "mtp", "unknown --speculative-method '", f.speculative_method,
            "': expected mtp (the model's MTP layers draft, as vLLM's method \"mtp\")");
    require(tokens_given,
            "--speculative-method mtp needs --speculative-tokens N (tokens drafted per step, "
            "N >= 1)");
    require(f.speculative_tokens >= 1 && f.speculative_tokens <= 1024,
            "--speculative-tokens must be an integer in [1, 1024] (tokens drafted per step), got ",
            f.speculative_tokens);
    return f.speculative_tokens;
}

std::string gib(double b) { return fmt::format("{:.1f}", b / (1 << 30)); }

std::string tokens(int64_t t) {
    if (t >= 10'000'000) return fmt::format("{:.1f}M", t / 1e6);
    if (t >= 10'000) return fmt::format("{}k", t / 1000);
    return fmt::format("{}", t);
}

std::string seconds(double s) {
    if (s >= 1) return fmt::format("{:.2f} s", s);
    if (s >= 1e-3) return fmt::format("{:.1f} ms", s * 1e3);
    return fmt::format("{:.0f} us", s * 1e6);
}

std::string mib(double b) {
    if (b == 0) return "0";
    if (b >= (1 << 30)) return fmt::format("{:.1f}G", b / (1 << 30));
    return fmt::format("{:.1f}M", b / (1 << 20));
}

std::string layout_short(const ParallelConfig& p) {
    std::string s;
    for (auto [k, v] : {std::pair{"pp", p.pp}, {"cp", p.cp}, {"tp", p.tp}, {"ep", p.ep}})
        if (v > 1) s += (s.empty() ? "" : ",") + std::string(k) + "=" + std::to_string(v);
    return s.empty() ? "tp=1" : s;
}

std::string secs_bytes(double s, double bytes) {
    return bytes > 0 ? fmt::format("{} ({})", seconds(s), mib(bytes)) : seconds(s);
}

void print_phase(const char* title, const PhaseCost& ph, int pp, const char* pp_note) {
    fmt::print(
        "{}: {}{}\n", title, seconds(ph.total_s),
        pp > 1 ? fmt::format(" (times below: sums over the {} stages; {})", pp, pp_note) : "");
    fmt::print("  roofline {} (compute {}, of it attention {}; memory {})\n",
               seconds(ph.roofline_s), seconds(ph.compute_s), seconds(ph.attention_compute_s),
               seconds(ph.memory_s));
    fmt::print("  exposed communication, bytes one GPU sends: TP {}, PP {}, CP {}, EP {}\n",
               secs_bytes(ph.tp_s, ph.tp_bytes), secs_bytes(ph.pp_s, ph.pp_bytes),
               secs_bytes(ph.cp_s, ph.cp_bytes), secs_bytes(ph.ep_s, ph.ep_bytes));
    if (ph.pp_bubble_s > 0) fmt::print("  pipeline bubble {}\n", seconds(ph.pp_bubble_s));
}

// ", speculating with 1 MTP layer drafting 3 tokens" when speculating, else "".
std::string speculation(const ModelSpec& m, const CapacityOptions& o) {
    if (o.speculative_tokens == 0) return "";
    return fmt::format(", speculating with {} MTP layer{} drafting {} token{}", m.mtp.layers,
                       m.mtp.layers == 1 ? "" : "s", o.speculative_tokens,
                       o.speculative_tokens == 1 ? "" : "s");
}

// Where the capacity figures come from: vLLM's arrangement of the KV cache (engine_kv.h).
std::string engine_kv_summary(const CapacityReport& c, const CapacityOptions& o,
                              const ParallelConfig& p, int64_t context) {
    const EngineKvArrangement& a = c.engine;
    const int64_t budget = c.ranks[c.limiting_rank].kv_budget_bytes;
    const std::string raised =
        a.block_size != o.block_size
            ? fmt::format(" (raised from {} so an attention page holds a state page)", o.block_size)
            : "";
    std::string out;
    if (a.kind == EngineKvKind::kSeparate) {
        out = fmt::format(
            "KV arrangement: not vLLM's ({}): blocks of {} tokens of every token layer, {} B "
            "each, and each state layer's state once per request",
            a.note, a.block_size, a.block_bytes[c.limiting_rank]);
    } else if (a.kind == EngineKvKind::kUniform) {
        out = fmt::format(
            "vLLM's KV arrangement: one group of every layer, blocks of {} tokens{}, {} B each "
            "(every layer's page); {} blocks = floor({} B budget / {} B); KV tokens = blocks x {}",
            a.block_size, raised, a.block_bytes[c.limiting_rank], c.kv_blocks_per_gpu, budget,
            a.block_bytes[c.limiting_rank], a.block_size);
    } else {
        std::string kinds;
        for (size_t i = 0; i < a.groups.size();) {
            size_t j = i;
            while (j < a.groups.size() && a.groups[j].kv_group == a.groups[i].kv_group) ++j;
            const auto& g = a.groups[i];
            kinds +=
                fmt::format("{}{} {}{}", kinds.empty() ? "" : " + ", j - i, layer_kind_name(g.kind),
                            g.window > 0 ? fmt::format("({})", g.window) : std::string());
            i = j;
        }
        const int64_t slots = a.block_bytes[c.limiting_rank] / a.page_bytes;
        out = fmt::format(
            "vLLM's KV arrangement: {} groups ({}) of {} layer slots{}, {} of them padding; blocks "
            "of {} tokens{}, a page of {} B per slot{}; {} blocks = floor({} B budget / ({} B x {} "
            "slots)); KV tokens = {} blocks / {} groups x {}, as vLLM logs it",
            a.groups.size(), kinds, a.group_size,
            // vLLM groups the layers of the whole model and each PP stage holds its share.
            slots != a.group_size ? fmt::format(" model-wide ({} on this GPU's stage)", slots)
                                  : std::string(),
            a.padding_slots(), a.block_size, raised, a.page_bytes,
            a.state_page_padding > 0
                ? fmt::format(" (each state page padded by {} B)", a.state_page_padding)
                : "",
            c.kv_blocks_per_gpu, budget, a.page_bytes, slots, c.kv_blocks_per_gpu, a.groups.size(),
            a.block_size);
    }
    if (a.kind != EngineKvKind::kSeparate && !a.note.empty()) out += "; " + a.note;
    if (a.kind == EngineKvKind::kSeparate) return out;
    bool windowed = false, state = false, sliding = false, chunked = false;
    for (const EngineKvGroup& g : a.groups) {
        windowed = windowed || g.window > 0;
        state = state || holds_state(g.kind);
        sliding = sliding || g.kind == LayerKind::kSlidingWindow;
        chunked = chunked || g.kind == LayerKind::kChunkedLocal;
    }
    // vLLM's MambaManager in align mode keeps a boundary's state block beside the running one,
    // and its startup check charges both.
    const bool align = a.mamba_cache_mode == MambaCacheMode::kAlign;
    const std::string spec =
        a.speculative_blocks > 0 ? fmt::format(" + {} speculative", a.speculative_blocks) : "";
    const std::string state_blocks = (align ? "2 (align: past one block)" : "1") + spec;
    if (context > 0)
        out += fmt::format(
            "\nA request of {} tokens holds at most {} blocks{}, so {} / {} = {} per "
            "replica",
            context, c.request_blocks,
            windowed || state
                ? fmt::format(" ({}{}{})", windowed ? "windowed groups ceil(W/B) + 1" : "",
                              windowed && state ? ", " : "",
                              state ? fmt::format("state groups {}", state_blocks) : "")
                : "",
            c.kv_blocks_per_gpu, c.request_blocks, c.requests_per_replica);
    out += fmt::format(
        "\nLongest request: the largest max_model_len M vLLM's startup check accepts (full layers "
        "ceil(M/B) blocks{}{}{}{})",
        p.cp > 1 ? " of the busiest CP rank's share" : "",
        sliding ? fmt::format(", sliding ceil(min(W - 1 + {}, M)/B) + 1", o.max_num_batched_tokens)
                : "",
        chunked ? fmt::format(", chunked ceil(min(C + {}, M)/B)", o.max_num_batched_tokens) : "",
        state ? (align ? ", state 2 (align)" : ", state 1") + spec : "");
    return out;
}

// --explain: one configuration in detail (per-stage memory, capacity, both phases).
void explain(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& r, const PlanFlags& f) {
    ParallelConfig p = parse_parallel_config(f.explain);
    if (p.cp > 1 && f.explain.find("cp_scheme") == std::string::npos) p.cp_scheme = r.cp_scheme;
    const PlanEntry e = evaluate_config(m, hw, r, p);
    if (f.json) {
        print_json(plan_to_json(m, hw, r, {e}));
        return;
    }
    const auto& c = e.capacity;
    const auto& k = e.cost;
    fmt::print("{}, {} on {} x {}, context {} tokens{}, batch {} per replica\n\n", m.name,
               p.to_string(), r.gpus, hw.name, r.context_tokens, speculation(m, r.capacity),
               e.batch);
    const KvLayout l = make_layout(m, p);
    const int per_decoder = m.cache_layers_per_decoder_layer;
    fmt::print("{:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9}\n", "stage",
               per_decoder == 1 ? "layers" : "dec. lyrs", "attn GiB", "MLP GiB", "expert", "embed",
               "LM head", "norms", "total", "KV B/tok", "KV tok");
    for (int s = 0; s < p.pp; ++s) {
        const auto& rc = c.ranks[rank_of(p, 0, s, 0, 0)];
        const auto& w = rc.weights;
        const auto& rk = l.ranks[rc.rank];
        fmt::print("{:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9}\n", s,
                   fmt::format("[{},{})", rk.layer_begin / per_decoder, rk.layer_end / per_decoder),
                   gib(w.attention), gib(w.dense_mlp), gib(w.experts), gib(w.embedding),
                   gib(w.lm_head), fmt::format("{:.3f}", w.norms / double(1 << 30)), gib(w.total()),
                   rc.kv_bytes_per_token, tokens(rc.kv_tokens));
    }
    // The drafter is on the last stage (all of them at pp 1).
    const int64_t drafter = c.ranks[rank_of(p, 0, p.pp - 1, 0, 0)].weights.drafter;
    if (drafter > 0 && p.pp == 1)
        fmt::print(
            "MTP drafter weights per GPU {} GiB (in total; its {} layer{} as the model's, plus "
            "eh_proj/fc and norms; embedding and LM head shared with the model, as vLLM does)\n",
            gib(drafter), m.mtp.layers, m.mtp.layers == 1 ? "" : "s");
    else if (drafter > 0)
        fmt::print(
            "MTP drafter weights per GPU of stage {} {} GiB (in total; vLLM runs the drafter on "
            "the last stage: its {} layer{} as the model's, eh_proj/fc, norms and its own "
            "embedding, shared with the model's only at pp 1; LM head shared)\n",
            p.pp - 1, gib(drafter), m.mtp.layers, m.mtp.layers == 1 ? "" : "s");
    fmt::print("\n{}\n", engine_kv_summary(c, r.capacity, p, r.context_tokens));
    fmt::print(
        "KV tokens per GPU {} (limiting rank {}), longest request {} tokens{}, {} requests of {} "
        "per replica, {} in all: {}\n\n",
        c.kv_tokens_per_gpu, c.limiting_rank, c.max_context,
        c.context_limited_by_model ? " (the model's max_model_len; memory allows more)" : "",
        c.requests_per_replica, r.context_tokens, c.max_concurrency,
        e.fits ? "fits" : "does not fit: " + c.why_not);
    print_phase(fmt::format("Prefill of {} tokens, TTFT", r.context_tokens).c_str(), k.prefill,
                p.pp, "prefill chunks overlap them");
    if (p.cp > 1)
        fmt::print("  CP: pass-KV {} over the ring ({}), pass-Q {}; chose {}\n",
                   secs_bytes(k.cp_prefill.pass_kv_s, k.cp_prefill.pass_kv_bytes),
                   k.cp_prefill.pass_kv_hidden ? "hidden under attention" : "not hidden",
                   secs_bytes(k.cp_prefill.pass_q_s, k.cp_prefill.pass_q_bytes),
                   cp_prefill_policy_name(k.cp_prefill.chosen));
    print_phase(
        fmt::format("Decode step of {} requests at {} tokens, TPOT", e.batch, r.context_tokens)
            .c_str(),
        k.decode, p.pp,
        k.decode_slowest_stage_bound
            ? fmt::format("{} micro-batches, and the slowest stage, running each in turn, sets "
                          "the step",
                          k.decode_micro_batches)
                  .c_str()
            : "one micro-batch crosses them in turn");
    if (p.cp > 1)
        fmt::print("  CP merge: all-gather {}, all-to-all {}; chose {}\n",
                   secs_bytes(k.cp_decode.all_gather_s, k.cp_decode.all_gather_bytes),
                   secs_bytes(k.cp_decode.all_to_all_s, k.cp_decode.all_to_all_bytes),
                   cp_merge_policy_name(k.cp_decode.chosen));
    if (p.ep > 1)
        fmt::print("  EP leaves {:.0f}% of the link time of a decode step for KV transfer\n",
                   100 * k.ep_link_share_for_kv);
    fmt::print("Decode throughput {:.0f} tokens/s over {} replica(s)\n", k.decode_tokens_per_s,
               p.dp);
}

void run_serving(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& pr,
                 const PlanFlags& f, const TraceWorkload* tw);

void run(const PlanFlags& f) {
    const ModelSpec m = load_model(f.model);
    const HardwareSpec hw = load_hardware(f.hardware);
    require(f.context >= 0 || !f.trace.empty(),
            "--context is required (tokens of a request), unless --trace gives the lengths");
    PlanRequest r;
    r.gpus = f.gpus;
    r.context_tokens = std::max<int64_t>(0, f.context);
    r.weight_dtype = parse_weight_dtype(f.weight_dtype);
    r.batch = f.batch;
    r.max_batch = f.max_batch;
    r.objective = parse_objective(f.objective);
    r.cp_scheme = parse_cp_scheme(f.cp_scheme);
    r.capacity = f.hardware.capacity_options();
    r.capacity.speculative_tokens = speculative_tokens(f);
    r.cost.cp_prefill = parse_cp_prefill_policy(f.cp_prefill);
    r.cost.cp_decode_merge = parse_cp_merge_policy(f.cp_decode_merge);
    r.cost.pp_prefill_chunks = f.pp_chunks;
    require(f.top >= 0, "--top must be >= 0 (0: all), got ", f.top);
    TraceWorkload tw;
    if (!f.trace.empty()) {
        const Trace trace = load_trace(f.trace, TraceErrorPolicy::kFail);
        // Each request is checked, not only the means: vLLM refuses each longer one.
        check_trace_lengths(trace, m, r.capacity.allow_long_context, kAllowLongContextFlag);
        tw = plan_trace_workload(trace, m, hw, r, parse_routing_policy(f.route));
        if (f.context < 0)
            r.context_tokens =
                f.disagg ? tw.mean_input_tokens : tw.mean_input_tokens + tw.mean_output_tokens;
        r.prefix_hit_rate = std::min(tw.token_hit_rate, 0.999);
    }
    if (f.disagg) {
        run_serving(m, hw, r, f, f.trace.empty() ? nullptr : &tw);
        return;
    }
    require(f.ttft_slo == 0 && f.tpot_slo == 0,
            "--ttft-slo and --tpot-slo rank by throughput under SLOs: they need --disagg");
    if (!f.explain.empty()) {
        require(f.svg.empty() && f.top == 0,
                "--explain details one configuration; --svg and --top chart and cut the ranking: "
                "drop --explain, or drop --svg and --top");
        explain(m, hw, r, f);
        return;
    }
    const auto entries = plan(m, hw, r);

    if (!f.svg.empty()) {
        std::ofstream out(f.svg);
        require(static_cast<bool>(out), "cannot write the chart to '", f.svg, "'");
        out << plan_to_svg(m, hw, r, entries);
    }
    if (f.json) {
        if (f.top == 0) {
            print_json(plan_to_json(m, hw, r, entries));
            return;
        }
        // --top N: the best N that fit, as in the table.
        std::vector<PlanEntry> top;
        for (const auto& e : entries)
            if (e.fits && static_cast<int>(top.size()) < f.top) top.push_back(e);
        print_json(plan_to_json(m, hw, r, top));
        return;
    }
    int n_fit = 0;
    for (const auto& e : entries) n_fit += e.fits;
    fmt::print(
        "{} on {} x {} ({} GiB, {} KV, {} weights), context {} tokens{}, objective {}\n", m.name,
        f.gpus, hw.name, gib(static_cast<double>(hw.memory_bytes)), dtype_name(m.kv_dtype),
        r.weight_dtype == WeightDtype::kModel ? weight_storage_name(m)
                                              : std::string(weight_dtype_name(r.weight_dtype)),
        r.context_tokens, speculation(m, r.capacity), objective_name(r.objective));
    if (!f.trace.empty())
        fmt::print(
            "trace {}: {} requests, mean input {} and output {} tokens; replayed over {} "
            "replicas ({}): prefix-hit rate {:.1f}%, so TTFT prefills {} of the {} tokens\n",
            f.trace, tw.requests, tw.mean_input_tokens, tw.mean_output_tokens, tw.replicas,
            tw.policy, 100 * tw.token_hit_rate,
            std::max<int64_t>(1, std::llround(double(r.context_tokens) * (1 - r.prefix_hit_rate))),
            r.context_tokens);
    const EngineKvArrangement* hybrid = nullptr;
    for (const auto& e : entries)
        if (e.capacity.engine.kind == EngineKvKind::kHybrid) hybrid = &e.capacity.engine;
    if (hybrid)
        fmt::print(
            "KV tokens/GPU = floor(floor(({} GiB x {} - weights - {} GiB reserve) / block bytes) "
            "/ {} KV groups) x {}, as vLLM logs it; block bytes: a page per layer slot of its "
            "groups of {}\n",
            gib(static_cast<double>(hw.memory_bytes)), r.capacity.mem_util,
            gib(static_cast<double>(r.capacity.activation_reserve_bytes)), hybrid->groups.size(),
            hybrid->block_size, hybrid->group_size);
    else
        fmt::print(
            "KV tokens/GPU = floor(({} GiB x {} - weights - {} GiB reserve) / KV bytes per "
            "token), in blocks of {}\n",
            gib(static_cast<double>(hw.memory_bytes)), r.capacity.mem_util,
            gib(static_cast<double>(r.capacity.activation_reserve_bytes)), r.capacity.block_size);
    bool per_layer = false;
    for (int l = 0; l < m.num_layers; ++l)
        per_layer = per_layer || (m.layer(l).kind != LayerKind::kFullAttention &&
                                  m.layer(l).kind != LayerKind::kMla);
    const std::string* note = nullptr;  // kSeparate: not vLLM's arrangement, and why
    for (const auto& e : entries)
        if (e.capacity.engine.kind == EngineKvKind::kSeparate) note = &e.capacity.engine.note;
    if (per_layer && note)
        fmt::print(
            "{}: {}: a request of {} tokens holds KV/req per GPU (windowed layers at most "
            "ceil(W/B) + 1 blocks, state layers their state), so requests = floor(KV budget / "
            "KV/req); KV tok counts tokens of a sequence shorter than every window\n",
            m.layer_mix(), *note, f.context);
    else if (per_layer)
        fmt::print(
            "{}: a request of {} tokens holds KV/req per GPU (its blocks: windowed layers at "
            "most ceil(W/B) + 1, state layers one), so requests = blocks / its blocks; max ctx: "
            "vLLM's startup check at max_num_batched_tokens {}\n",
            m.layer_mix(), f.context, r.capacity.max_num_batched_tokens);
    fmt::print("{} of {} configurations fit.{}\n", n_fit, entries.size(),
               f.batch > 0
                   ? fmt::format(" Batch {} per replica.", f.batch)
                   : fmt::format(" Batch per replica: as many as fit, at most {}.", f.max_batch));
    if (r.capacity.speculative_tokens > 0)
        fmt::print(
            "Speculating ({} draft token{}): memory and KV as vLLM allocates them (at pp > 1 the "
            "drafter on the last stage), and TTFT, TPOT and tok/s are the target model's alone "
            "(the drafter's steps and the accepted tokens are not priced).\n",
            r.capacity.speculative_tokens, r.capacity.speculative_tokens == 1 ? "" : "s");
    fmt::print("\n");
    fmt::print(
        "{:>3} {:>3} {:>3} {:>3} {:>3} {:>3}  {:>4} {:>7} {:>8} {:>8} {:>8} {:>8} {:>6} {:>6} "
        "{:>8} {:>8} {:>9} {:>9} {:>9}\n",
        "#", "dp", "pp", "cp", "tp", "ep", "fits", "W GiB", "KV B/tok", "KV/req", "KV tok",
        "max ctx", "conc", "batch", "comm/tok", "comm pf", "TTFT", "TPOT", "tok/s");
    int shown = 0;
    for (size_t i = 0; i < entries.size(); ++i) {
        const auto& e = entries[i];
        if (f.top > 0 && (shown >= f.top || !e.fits)) continue;
        ++shown;
        const auto& p = e.parallel;
        const auto& c = e.capacity;
        const auto& k = e.cost;
        if (!e.fits) {
            fmt::print("{:>3} {:>3} {:>3} {:>3} {:>3} {:>3}  {:>4} {:>7} {:>8}  {}\n", "-", p.dp,
                       p.pp, p.cp, p.tp, p.ep, "no",
                       gib(static_cast<double>(c.weight_bytes_per_gpu)), c.kv_bytes_per_token,
                       c.why_not);
            continue;
        }
        fmt::print(
            "{:>3} {:>3} {:>3} {:>3} {:>3} {:>3}  {:>4} {:>7} {:>8} {:>8} {:>8} {:>8} {:>6} {:>6} "
            "{:>8} {:>8} {:>9} {:>9} {:>9}\n",
            i + 1, p.dp, p.pp, p.cp, p.tp, p.ep, "yes",
            gib(static_cast<double>(c.weight_bytes_per_gpu)), c.kv_bytes_per_token,
            mib(static_cast<double>(c.request_kv_bytes)), tokens(c.kv_tokens_per_gpu),
            c.context_unbounded ? std::string("unbound") : tokens(c.max_context), c.max_concurrency,
            e.batch, mib(k.decode.comm_bytes()), mib(k.prefill.comm_bytes()), seconds(k.ttft_s),
            seconds(k.tpot_s), fmt::format("{:.0f}", k.decode_tokens_per_s));
    }
    if (f.top > 0 && static_cast<int>(entries.size()) > shown)
        fmt::print("... {} more ({} of them do not fit); drop --top to list them all\n",
                   static_cast<int>(entries.size()) - shown,
                   static_cast<int>(entries.size()) - n_fit);
    fmt::print(
        "\nW: weights per GPU. KV B/tok: the most KV bytes per token a GPU stores (a PP stage of "
        "only Mamba layers stores none). KV/req: KV one request of the context holds on the "
        "limiting GPU (the fewest KV blocks). KV tok: KV "
        "tokens per GPU. max ctx: longest single request (spans cp GPUs; at most the model's "
        "max_model_len). conc: requests of "
        "the context that fit at once, all replicas. comm/tok: bytes one GPU sends per decode "
        "step (TP+PP+CP+EP); comm pf: per prefill. tok/s: decode tokens/s, all replicas.\n");
    if (!f.svg.empty()) fmt::print("Chart written to {}\n", f.svg);
}

void explain_serving(const ServingEntry& e, const ServingRequest& sr, int rank) {
    fmt::print("#{} {}: {}\n", rank, e.name(), e.disaggregated ? "disaggregated" : "aggregated");
    fmt::print("  prefill of {} new tokens (of {}) on {}: {}\n", e.prefill_tokens, sr.prompt_tokens,
               e.prefill.to_string(), seconds(e.prefill_s));
    if (e.disaggregated)
        fmt::print(
            "  KV transfer {} -> {}: {} per request in {} messages ({} layer by layer), busiest "
            "GPU {}, over {}: {}, exposed after prefill {}\n",
            layout_short(e.prefill), layout_short(e.decode), mib(double(e.transfer.bytes)),
            e.transfer.messages, e.transfer.layerwise_messages,
            mib(double(e.transfer.busiest_rank_bytes)),
            e.transfer.crosses_nodes ? "the inter-node link" : "NVLink",
            seconds(e.transfer.transfer_s), seconds(e.transfer.exposed_s));
    fmt::print("  TTFT {} = queue {} + prefill {}{}\n", seconds(e.ttft_s), seconds(e.queue_s),
               seconds(e.prefill_s),
               e.disaggregated ? " + exposed transfer " + seconds(e.transfer.exposed_s) : "");
    fmt::print("  decode on {}: batch {} per instance, step {}, TPOT {}{}\n", e.decode.to_string(),
               e.decode_batch, seconds(e.step_s), seconds(e.tpot_s),
               e.disaggregated ? "" : " (stretched by the prefills mixed in)");
    fmt::print("  {:.2f} requests/s over {} + {} instances: {:.0f} output tokens/s per GPU; {}\n",
               e.requests_per_s, e.prefill_instances, e.disaggregated ? e.decode_instances : 0,
               e.tokens_per_s_per_gpu, e.meets_slo ? "meets both SLOs" : "misses: " + e.why_not);
}

void run_serving(const ModelSpec& m, const HardwareSpec& hw, const PlanRequest& pr,
                 const PlanFlags& f, const TraceWorkload* tw) {
    require(
        f.output_tokens >= 0,
        "--output-tokens must be a positive integer (0 or absent: 256, or the trace's mean), got ",
        f.output_tokens);
    ServingRequest sr;
    sr.gpus = pr.gpus;
    sr.prompt_tokens = pr.context_tokens;
    sr.output_tokens = f.output_tokens > 0 ? f.output_tokens : tw ? tw->mean_output_tokens : 256;
    sr.prefix_hit_rate = pr.prefix_hit_rate;
    // The trace's prompt lengths, unless --context fixed one length.
    if (tw && f.context < 0) sr.prompt_samples = tw->input_tokens;
    sr.ttft_slo_s = f.ttft_slo;
    sr.tpot_slo_s = f.tpot_slo;
    sr.max_batch = pr.max_batch;
    sr.cp_scheme = pr.cp_scheme;
    sr.capacity = pr.capacity;
    sr.cost = pr.cost;
    sr.weight_dtype = pr.weight_dtype;
    const auto entries = plan_serving(m, hw, sr);
    int rank = 0;  // --explain's row, 1-based
    if (!f.explain.empty()) {
        rank = 1;
        if (f.explain != "best") {
            size_t used = 0;
            try {
                rank = std::stoi(f.explain, &used);
            } catch (const std::exception&) {
                rank = 0;
            }
            if (used != f.explain.size()) rank = 0;
        }
        require(rank >= 1 && rank <= static_cast<int>(entries.size()),
                "with --disagg, --explain takes a rank of the table (1 to ", entries.size(),
                ") or 'best', got '", f.explain, "'");
    }
    if (!f.svg.empty()) {
        std::ofstream out(f.svg);
        require(static_cast<bool>(out), "cannot write the chart to '", f.svg, "'");
        out << serving_to_svg(m, hw, sr, entries);
    }
    if (f.json) {
        // --explain N: that row alone, as without --disagg; --top N: the best N that meet the
        // SLOs, as the table lists them.
        std::vector<ServingEntry> shown;
        if (rank > 0)
            shown.push_back(entries[rank - 1]);
        else if (f.top > 0)
            for (const auto& e : entries)
                if (e.meets_slo && static_cast<int>(shown.size()) < f.top) shown.push_back(e);
        print_json(serving_to_json(m, hw, sr, rank > 0 || f.top > 0 ? shown : entries));
        return;
    }
    if (rank > 0) {
        explain_serving(entries[rank - 1], sr, rank);
        return;
    }
    int n_ok = 0, n_dis = 0;
    for (const auto& e : entries) {
        n_ok += e.meets_slo;
        n_dis += e.disaggregated;
    }
    fmt::print(
        "{} on {} x {}, prompt {} tokens ({} prefilled after a {:.1f}% prefix hit), output {}, "
        "TTFT SLO {}, TPOT SLO {}{}\n",
        m.name, sr.gpus, hw.name, sr.prompt_tokens, entries.empty() ? 0 : entries[0].prefill_tokens,
        100 * sr.prefix_hit_rate, sr.output_tokens, seconds(sr.ttft_slo_s), seconds(sr.tpot_slo_s),
        speculation(m, sr.capacity));
    fmt::print("{} aggregated and {} disaggregated configurations; {} meet both SLOs.\n\n",
               entries.size() - n_dis, n_dis, n_ok);
    fmt::print("{:>4} {:<36} {:>9} {:>9} {:>9} {:>8} {:>9} {:>6} {:>9} {:>9} {:>8}\n", "#",
               "configuration", "prefill", "KV xfer", "exposed", "queue", "TTFT", "batch", "TPOT",
               "req/s", "tok/s/GPU");
    const int top = f.top > 0 ? f.top : 20;
    int shown = 0;
    for (size_t i = 0; i < entries.size() && shown < top; ++i) {
        const auto& e = entries[i];
        if (!e.meets_slo) continue;
        ++shown;
        fmt::print("{:>4} {:<36} {:>9} {:>9} {:>9} {:>8} {:>9} {:>6} {:>9} {:>9.2f} {:>8.0f}\n",
                   i + 1, e.name(), seconds(e.prefill_s),
                   e.disaggregated ? mib(double(e.transfer.bytes)) : std::string("-"),
                   e.disaggregated ? seconds(e.transfer.exposed_s) : std::string("-"),
                   seconds(e.queue_s), seconds(e.ttft_s), e.decode_batch, seconds(e.tpot_s),
                   e.requests_per_s, e.tokens_per_s_per_gpu);
    }
    int best_agg = -1;
    for (size_t i = 0; i < entries.size(); ++i)
        if (!entries[i].disaggregated && entries[i].meets_slo) {
            best_agg = static_cast<int>(i);
            break;
        }
    if (best_agg >= shown)
        fmt::print("{:>4} {:<36} ... best aggregated: TTFT {}, TPOT {}, {:.0f} tok/s/GPU\n",
                   best_agg + 1, entries[best_agg].name(), seconds(entries[best_agg].ttft_s),
                   seconds(entries[best_agg].tpot_s), entries[best_agg].tokens_per_s_per_gpu);
    if (n_ok > shown) fmt::print("... {} more meet the SLOs (--top N to list)\n", n_ok - shown);
    fmt::print(
        "\nP/D: prefill/decode instances (layout x count). KV xfer: KV bytes per request from "
        "kvshard's transfer plan between the two layouts (kvshard transfer-plan); exposed: what "
        "the layer-wise transfer leaves after the prefill. queue: M/G/1 wait for a prefill "
        "instance at the rate shown. tok/s/GPU: output tokens/s per GPU. --explain N details "
        "row N.\n");
    if (!f.svg.empty()) fmt::print("Chart written to {}\n", f.svg);
}

void setup(CLI::App& app) {
    auto f = std::make_shared<PlanFlags>();
    auto* sub = app.add_subcommand(
        "plan",
        "Rank every (dp, pp, cp, tp, ep) for N GPUs by KV capacity and estimated TTFT/TPOT");
    add_model_options(sub, f->model);
    add_hardware_options(sub, f->hardware);
    sub->add_option("--gpus,-n", f->gpus, "number of GPUs")->required();
    sub->add_option("--context,-c", f->context,
                    "context length in tokens (prompt + generated; with --disagg the prompt); "
                    "optional with --trace (its mean lengths)");
    sub->add_option("--weight-dtype", f->weight_dtype,
                    "weight storage: model (the model's dtype), bf16, fp8 or fp4 (what fits, "
                    "bytes read per step, fp8 tensor cores at 8 bits and below)")
        ->capture_default_str();
    auto* disagg = sub->add_flag(
        "--disagg", f->disagg,
        "also search prefill pools x decode pools (each its own layout and instance "
        "count), ranked with the aggregated configurations by output tokens/s per GPU "
        "under --ttft-slo and --tpot-slo");
    sub->add_option("--ttft-slo", f->ttft_slo, "with --disagg: TTFT objective, seconds");
    sub->add_option("--tpot-slo", f->tpot_slo, "with --disagg: TPOT objective, seconds");
    sub->add_option("--output-tokens", f->output_tokens,
                    "with --disagg: output tokens per request (default 256, or the trace's mean)")
        ->needs(disagg);
    auto* trace = sub->add_option(
        "--trace", f->trace,
        "Mooncake JSONL trace: its mean lengths, and the prefix-hit rate of its replay "
        "(kvshard simulate) over the best configuration's replicas, shorten prefill");
    sub->add_option("--route", f->route,
                    "with --trace: routing policy of the replay (as kvshard simulate --policy)")
        ->capture_default_str()
        ->needs(trace);
    sub->add_option("--batch,-b", f->batch,
                    "requests decoding together per DP replica (default 0: as many as fit, up to "
                    "--max-batch)")
        ->capture_default_str();
    sub->add_option("--max-batch", f->max_batch, "cap on the batch when --batch is 0")
        ->capture_default_str();
    sub->add_option("--objective", f->objective, "ranking: ttft|tpot|throughput")
        ->capture_default_str();
    sub->add_option("--cp-scheme", f->cp_scheme,
                    "token ownership for cp > 1: contiguous|zigzag|interleave")
        ->capture_default_str();
    sub->add_option("--cp-prefill", f->cp_prefill, "CP prefill exchange: auto|pass-kv|pass-q")
        ->capture_default_str();
    sub->add_option("--cp-decode-merge", f->cp_decode_merge,
                    "CP decode merge: auto|all-gather|all-to-all")
        ->capture_default_str();
    sub->add_option("--pp-chunks", f->pp_chunks,
                    "prefill chunks pipelined through PP stages (0: pp)")
        ->capture_default_str();
    sub->add_option(
           "--top", f->top,
           "show only the best N fitting configurations (0: all, with those that do not fit)")
        ->capture_default_str();
    f->speculative_method_option =
        sub->add_option("--speculative-method", f->speculative_method,
                        "speculative decoding: mtp (the model's MTP layers draft, as vLLM's "
                        "--speculative-config method mtp): their KV joins the cache, their weights "
                        "take memory, Mamba/GDN groups hold N more state blocks per request");
    f->speculative_tokens_option = sub->add_option(
        "--speculative-tokens", f->speculative_tokens,
        "with --speculative-method: tokens drafted per step (vLLM num_speculative_tokens)");
    sub->add_flag("--json", f->json, "print JSON instead of a table");
    sub->add_option("--svg", f->svg, "also write a TTFT-vs-TPOT chart to this SVG file");
    sub->add_option(
        "--explain", f->explain,
        "detail one configuration instead of ranking, e.g. \"tp=8,pp=2\" (memory per stage, "
        "capacity, time and bytes per phase)");
    sub->callback([f] { run(*f); });
}

}  // namespace

KVSHARD_COMMAND("plan", setup);

}  // namespace kvshard::cli
