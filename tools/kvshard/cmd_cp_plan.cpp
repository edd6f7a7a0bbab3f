// kvshard cp-plan: the context-parallel plan of one request (docs/context-parallel.md): who stores
// which tokens, the pass-KV / pass-Q bytes of each rank and the automatic choice, the decode merge
// bytes, and (--reuse-from) the blocks moved to reuse a prefix cached under another CP size.
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "command.h"
#include "kvshard/common/checked.h"
#include "kvshard/common/error.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/layout/kv_layout.h"
#include "options.h"

namespace kvshard::cli {
namespace {

struct CpPlanFlags {
    ModelFlags model;
    ParallelFlags parallel;
    int64_t cached = 0;
    int64_t fresh = 1024;
    int block_size = 16;
    int reuse_from = 0;
    bool allow_long_context = false;
    bool json = false;
};

void run(const CpPlanFlags& f) {
    const ModelSpec m = load_model(f.model);
    const ParallelConfig p = to_parallel_config(f.parallel);
    validate(m, p);
    require(f.cached >= 0, "--cached must be >= 0, got ", f.cached);
    require(f.fresh >= 1, "--new must be >= 1 (a prefill computes at least one token), got ",
            f.fresh);
    require(f.block_size >= 1, "--block-size must be >= 1, got ", f.block_size);
    require(f.reuse_from >= 0, "--reuse-from must be a CP size >= 1 (or 0: none), got ",
            f.reuse_from);
    m.check_computed_length(sat_add(f.cached, f.fresh), f.allow_long_context,
                            detail::concat("--cached ", f.cached, " + --new ", f.fresh),
                            kAllowLongContextFlag);
    const std::string doc =
        cp_plan_report_json(m, p, f.cached, f.fresh, f.block_size, f.reuse_from);
    if (f.json) {
        print_json(doc);
        return;
    }
    const nlohmann::json j = nlohmann::json::parse(doc);
    const nlohmann::json& choice = j["choice"];
    const nlohmann::json& ranks = j["ranks"];
    const nlohmann::json& reuse = j["reuse"];
    fmt::print("{}: {}; {} cached + {} new tokens\n", m.name, p.to_string(), f.cached, f.fresh);
    const double frac = choice["new_fraction"].get<double>(),
                 threshold = choice["threshold"].get<double>();
    fmt::print(
        "prefill: {}, the fewer bytes: all ranks move {} B pass-KV, {} B pass-Q\n"
        "Meta's rule: new fraction {:.4f} {} threshold {:.4f}, {} ({} B pass-Q, every partial "
        "returned)\n\n",
        choice["mode"].get<std::string>(), choice["pass_kv_bytes"].get<int64_t>(),
        choice["pass_q_bytes"].get<int64_t>(), frac, frac < threshold ? "<" : ">=", threshold,
        choice["rule_mode"].get<std::string>(), choice["rule_pass_q_bytes"].get<int64_t>());
    fmt::print("{:>5} {:>3} {:>3} {:>10} {:>10} {:>14} {:>14} {:>14} {:>12} {:>12}  {}\n", "rank",
               "cp", "tp", "tokens", "new", "causal_pairs", "pass_kv_B", "pass_q_B", "dec_ag_B",
               "dec_a2a_B", "rule (each segment)");
    for (const auto& r : ranks) {
        fmt::print(
            "{:>5} {:>3} {:>3} {:>10} {:>10} {:>14} {:>14} {:>14} {:>12} {:>12}  {}\n",
            r["rank"].get<int>(), r["cp"].get<int>(), r["tp"].get<int>(),
            r["tokens"].get<int64_t>(), r["new_tokens"].get<int64_t>(),
            r["causal_pairs"].get<int64_t>(), r["pass_kv_bytes"].get<int64_t>(),
            r["pass_q_ring_bytes"].get<int64_t>() + r["pass_q_all_to_all_bytes"].get<int64_t>(),
            r["decode_all_gather_bytes"].get<int64_t>(),
            r["decode_all_to_all_bytes"].get<int64_t>(), cp_token_rule(p, r["cp"].get<int>()));
    }
    if (!reuse.is_null())
        fmt::print("\nreuse of {} cached blocks from cp={}: {} stay, {} move\n",
                   reuse["blocks"].get<int64_t>(), f.reuse_from, reuse["kept"].get<int64_t>(),
                   reuse["moved"].get<int64_t>());
}

void setup(CLI::App& app) {
    auto f = std::make_shared<CpPlanFlags>();
    auto* sub = app.add_subcommand(
        "cp-plan",
        "Show the context-parallel plan of one request: tokens per CP rank, pass-KV vs pass-Q "
        "bytes "
        "and the automatic choice, decode merge bytes, prefix reuse across CP sizes");
    add_model_options(sub, f->model);
    add_parallel_options(sub, f->parallel);
    sub->add_option("--cached", f->cached, "tokens already stored (the cached prefix P)")
        ->capture_default_str();
    sub->add_option("--new", f->fresh, "new tokens to prefill (T)")->capture_default_str();
    auto* reuse_from =
        sub->add_option("--reuse-from", f->reuse_from,
                        "CP size the cached prefix was stored under (block interleave): list the "
                        "blocks moved to this --cp");
    sub->add_option("--block-size", f->block_size, "tokens per KV block (for --reuse-from)")
        ->capture_default_str()
        ->needs(reuse_from);
    sub->add_flag("--allow-long-context", f->allow_long_context,
                  "plan --cached + --new of the model's max_model_len or more, as vLLM computes "
                  "with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and a longer --max-model-len (without it "
                  "at most max_model_len - 1 tokens are taken)");
    sub->add_flag("--json", f->json, "print JSON");
    sub->callback([f] { run(*f); });
}

}  // namespace

KVSHARD_COMMAND("cp-plan", setup);

}  // namespace kvshard::cli
