// kvshard cp-plan: the context-parallel plan of one request (docs/context-parallel.md): who stores
// which tokens, the pass-KV / pass-Q bytes of each rank and the automatic choice, the decode merge
// bytes, and (--reuse-from) the blocks moved to reuse a prefix cached under another CP size.
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "command.h"
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
    const KvLayout l = make_layout(m, p);
    CpTokenMap map(p.cp);
    map.append(f.cached, p.cp_scheme, p.cp_interleave);
    map.append(f.fresh, p.cp_scheme, p.cp_interleave);
    const CpPrefillChoice choice = choose_cp_prefill(l, f.cached, f.fresh);
    const auto pairs = cp_causal_pairs(map, f.cached);

    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& r : l.ranks) {
        if (r.coord.dp != 0) continue;
        const int c = r.coord.cp;
        const auto kv = cp_pass_kv_bytes(l, r.coord.rank, map);
        const auto q = cp_pass_q_bytes(l, r.coord.rank, map, f.cached);
        ranks.push_back({{"rank", r.coord.rank},
                         {"cp", c},
                         {"tp", r.coord.tp},
                         {"pp", r.coord.pp},
                         {"tokens", map.count(c)},
                         {"new_tokens", map.count(c, f.cached)},
                         {"causal_pairs", pairs[static_cast<size_t>(c)]},
                         {"pass_kv_bytes", kv.total()},
                         {"pass_q_ring_bytes", q.ring},
                         {"pass_q_all_to_all_bytes", q.all_to_all},
                         {"decode_all_gather_bytes",
                          cp_decode_merge_bytes(l, r.coord.rank, CpDecodeMerge::kAllGather)},
                         {"decode_all_to_all_bytes",
                          cp_decode_merge_bytes(l, r.coord.rank, CpDecodeMerge::kAllToAll)}});
    }
    nlohmann::json reuse = nullptr;
    if (f.reuse_from > 0) {
        const auto plan = plan_cp_prefix_reuse(f.reuse_from, p.cp, f.cached / f.block_size);
        reuse = nlohmann::json::parse(to_json(plan));
    }
    if (f.json) {
        nlohmann::json j = {{"model", m.name},
                            {"parallel", nlohmann::json::parse(to_json(p))},
                            {"cached", f.cached},
                            {"new", f.fresh},
                            {"choice",
                             {{"mode", cp_prefill_mode_name(choice.mode)},
                              {"new_fraction", choice.new_fraction},
                              {"threshold", choice.threshold},
                              {"pass_kv_bytes", choice.pass_kv_bytes},
                              {"pass_q_bytes", choice.pass_q_bytes}}},
                            {"ranks", ranks},
                            {"reuse", reuse}};
        print_json(j.dump(2));
        return;
    }
    fmt::print("{}: {}; {} cached + {} new tokens\n", m.name, p.to_string(), f.cached, f.fresh);
    fmt::print(
        "prefill: {} (new fraction {:.4f} {} threshold {:.4f}); all ranks move {} B pass-KV, {} B "
        "pass-Q\n\n",
        cp_prefill_mode_name(choice.mode), choice.new_fraction,
        choice.mode == CpPrefillMode::kPassQ ? "<" : ">=", choice.threshold, choice.pass_kv_bytes,
        choice.pass_q_bytes);
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
    sub->add_option("--block-size", f->block_size, "tokens per KV block (for --reuse-from)")
        ->capture_default_str();
    sub->add_option("--reuse-from", f->reuse_from,
                    "CP size the cached prefix was stored under (block interleave): list the "
                    "blocks moved to this --cp");
    sub->add_flag("--json", f->json, "print JSON");
    sub->callback([f] { run(*f); });
}

}  // namespace

KVSHARD_COMMAND("cp-plan", setup);

}  // namespace kvshard::cli
