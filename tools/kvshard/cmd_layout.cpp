// kvshard layout: which rank holds which KV heads, layers and tokens.
#include <fmt/format.h>

#include <memory>

#include "command.h"
#include "kvshard/layout/kv_layout.h"
#include "options.h"

namespace kvshard::cli {
namespace {

struct LayoutFlags {
    ModelFlags model;
    ParallelFlags parallel;
    int gpus = 0;
    bool gpus_given = false;
    bool json = false;
};

std::string heads_text(const RankKv& r, const KvLayout& l) {
    if (l.model.is_mla()) return "latent";
    if (r.kv_heads.size() == 1) return fmt::format("{}", r.kv_heads.front());
    return fmt::format("{}-{}", r.kv_heads.front(), r.kv_heads.back());
}

std::string bytes_text(int64_t b) {
    if (b >= (int64_t{1} << 20)) return fmt::format("{:.2f} MiB", b / 1048576.0);
    if (b >= 1024) return fmt::format("{:.1f} KiB", b / 1024.0);
    return fmt::format("{} B", b);
}

void run(const LayoutFlags& f) {
    const ModelSpec m = load_model(f.model);
    const ParallelConfig p = to_parallel_config(f.parallel);
    if (f.gpus_given) validate_world(p, f.gpus);
    const KvLayout l = make_layout(m, p);
    if (f.json) {
        print_json(to_json(l));
        return;
    }
    fmt::print("{}: {} layers, {} query heads, {} KV heads ({}), head_dim {}, KV {}\n", m.name,
               m.num_layers, m.num_heads, m.is_mla() ? 1 : m.num_kv_heads,
               attention_kind_name(m.attention), m.head_dim, dtype_name(m.kv_dtype));
    fmt::print("{}: world size {}; {} KV head(s) per TP rank", p.to_string(), l.world_size(),
               l.kv_heads_per_rank());
    if (l.head_replication() > 1) fmt::print(", each held by {} TP ranks", l.head_replication());
    fmt::print("\n\n");
    fmt::print("{:>5} {:>3} {:>3} {:>3} {:>3} {:>3}  {:<9} {:<9} {:<10} {:<12} {:<24} {:>12}\n",
               "rank", "dp", "pp", "cp", "tp", "ep", "kv_heads", "q_heads", "layers", "experts",
               "cp_tokens", "KV/token");
    for (const auto& r : l.ranks) {
        const std::string experts =
            m.moe.enabled() ? fmt::format("[{},{})", r.expert_begin, r.expert_end) : "-";
        fmt::print("{:>5} {:>3} {:>3} {:>3} {:>3} {:>3}  {:<9} {:<9} {:<10} {:<12} {:<24} {:>12}\n",
                   r.coord.rank, r.coord.dp, r.coord.pp, r.coord.cp, r.coord.tp, r.coord.ep,
                   heads_text(r, l), fmt::format("{}-{}", r.q_head_begin, r.q_head_end - 1),
                   fmt::format("[{},{})", r.layer_begin, r.layer_end), experts,
                   cp_token_rule(p, r.coord.cp), bytes_text(r.kv_bytes_per_token));
    }
}

void setup(CLI::App& app) {
    auto f = std::make_shared<LayoutFlags>();
    auto* sub =
        app.add_subcommand("layout", "Show which rank holds which KV heads, layers and tokens");
    add_model_options(sub, f->model);
    add_parallel_options(sub, f->parallel);
    auto* gpus = sub->add_option("--gpus", f->gpus, "check that dp*pp*cp*tp equals this GPU count");
    sub->add_flag("--json", f->json, "print JSON instead of a table");
    sub->callback([f, gpus] {
        f->gpus_given = gpus->count() > 0;
        run(*f);
    });
}

}  // namespace

KVSHARD_COMMAND("layout", setup);

}  // namespace kvshard::cli
