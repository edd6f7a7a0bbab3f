// kvshard layout: which rank holds which KV heads, layers and tokens.
#include <fmt/format.h>

#include <algorithm>
#include <memory>

#include "kvshard/common/error.h"

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
    int64_t context = 32768;
    bool context_given = false;
    bool allow_long_context = false;
    int block_size = 16;
    bool kv_balanced = false;
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

std::string group_text(const RankKvGroup& g) {
    std::string kind(layer_kind_name(g.kind));
    if (g.window > 0) kind += fmt::format("({})", g.window);
    const std::string size = holds_state(g.kind)
                                 ? fmt::format("{}/seq", bytes_text(g.state_bytes_per_sequence))
                                 : fmt::format("{}/token", bytes_text(g.bytes_per_token));
    return fmt::format("{} x{} {}h {}", kind, g.layers.size(), g.kv_heads, size);
}

void run(LayoutFlags f) {
    const ModelSpec m = load_model(f.model);
    // The default is a request the model serves: 32768 tokens, or its whole length when shorter.
    if (!f.context_given && m.max_model_len > 0) f.context = std::min(f.context, m.max_model_len);
    require(f.context >= 1 && f.context <= kMaxContextTokens,
            "--context must be in [1, 2^40] tokens, got ", f.context);
    m.check_sequence_length(f.context, f.allow_long_context, "--context", kAllowLongContextFlag);
    require(f.block_size >= 1 && f.block_size <= (1 << 20),
            "--block-size must be in [1, 2^20] tokens, got ", f.block_size);
    ParallelConfig p = to_parallel_config(f.parallel);
    if (f.kv_balanced) {
        require(p.pp_layers.empty(),
                "--pp-split kv and --pp-layers both choose the PP split: give one");
        p.pp_layers = pp_layer_split_kv_balanced(m, p, f.context);
    }
    if (f.gpus_given) validate_world(p, f.gpus);
    const KvLayout l = make_layout(m, p);
    if (f.json) {
        print_json(to_json(l));
        return;
    }
    const int per_decoder = m.cache_layers_per_decoder_layer;
    const std::string layers_text =
        per_decoder == 1 ? fmt::format("{} layers", m.num_layers)
                         : fmt::format("{} decoder layers of {} cache layers ({} in all)",
                                       m.num_decoder_layers(), per_decoder, m.num_layers);
    fmt::print("{}: {}, {} query heads, {} KV heads ({}), head_dim {}, KV {}\n", m.name,
               layers_text, m.num_heads, m.is_mla() ? 1 : m.num_kv_heads,
               attention_kind_name(m.attention), m.head_dim, dtype_name(m.kv_dtype));
    fmt::print("{}: world size {}; {} KV head(s) per TP rank", p.to_string(), l.world_size(),
               l.kv_heads_per_rank());
    if (l.head_replication() > 1) fmt::print(", each held by {} TP ranks", l.head_replication());
    fmt::print("\n\n");
    fmt::print("{}\n", m.layer_mix());
    fmt::print(
        "{:>5} {:>3} {:>3} {:>3} {:>3} {:>3}  {:<9} {:<9} {:<10} {:<12} {:<24} {:>12} {:>12}\n",
        "rank", "dp", "pp", "cp", "tp", "ep", "kv_heads", "q_heads",
        per_decoder == 1 ? "layers" : "cache lyr", "experts", "cp_tokens", "KV/token",
        fmt::format("KV@{}", f.context));
    for (const auto& r : l.ranks) {
        const std::string experts =
            m.moe.enabled() ? fmt::format("[{},{})", r.expert_begin, r.expert_end) : "-";
        fmt::print(
            "{:>5} {:>3} {:>3} {:>3} {:>3} {:>3}  {:<9} {:<9} {:<10} {:<12} {:<24} {:>12} {:>12}\n",
            r.coord.rank, r.coord.dp, r.coord.pp, r.coord.cp, r.coord.tp, r.coord.ep,
            heads_text(r, l), fmt::format("{}-{}", r.q_head_begin, r.q_head_end - 1),
            fmt::format("[{},{})", r.layer_begin, r.layer_end), experts,
            cp_token_rule(p, r.coord.cp), bytes_text(r.kv_bytes_per_token),
            bytes_text(request_kv_bytes(l, r.coord.rank, f.context, f.block_size)));
    }
    if (!m.uniform()) {
        // Per KV group on each distinct rank shape (the first rank of each PP stage and TP rank 0).
        fmt::print("\nKV groups (one block table each), per rank of each PP stage:\n");
        for (int s = 0; s < p.pp; ++s) {
            const RankKv& r = l.ranks[static_cast<size_t>(rank_of(p, 0, s, 0, 0))];
            std::string groups;
            for (const auto& g : r.groups) groups += (groups.empty() ? "" : "; ") + group_text(g);
            fmt::print("  stage {}: {}\n", s, groups.empty() ? "no KV" : groups);
        }
    }
    fmt::print(
        "\nKV@{}: bytes one rank holds for a request of {} tokens, in whole blocks of {} per "
        "group (windowed groups keep their window, state groups their state).\n",
        f.context, f.context, f.block_size);
    if (per_decoder > 1)
        fmt::print(
            "cache lyr: the rank's cache layers [begin,end), {} per decoder layer; PP splits "
            "decoder layers (--pp-layers counts them), each stage holding all cache layers of "
            "its decoder layers.\n",
            per_decoder);
    if (p.pp > 1) {
        const auto stage = pp_stage_kv_bytes(m, p, f.context);
        const int64_t most = *std::max_element(stage.begin(), stage.end());
        const int64_t least = *std::min_element(stage.begin(), stage.end());
        std::string list;
        for (int64_t b : stage) list += (list.empty() ? "" : ", ") + bytes_text(b);
        fmt::print("PP stages hold {} of KV per request of {} tokens (most/least {:.2f})", list,
                   f.context, least > 0 ? double(most) / double(least) : 0.0);
        const auto balanced = pp_layer_split_kv_balanced(m, p, f.context);
        ParallelConfig b = p;
        b.pp_layers = balanced;
        const auto bs = pp_stage_kv_bytes(m, b, f.context);
        if (!f.kv_balanced && *std::max_element(bs.begin(), bs.end()) < most) {
            std::string split;
            for (int n : balanced) split += (split.empty() ? "" : ",") + std::to_string(n);
            fmt::print("; a KV-balanced split --pp-layers {} (or --pp-split kv) holds at most {}",
                       split, bytes_text(*std::max_element(bs.begin(), bs.end())));
        }
        fmt::print("\n");
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
    auto* context = sub->add_option("--context", f->context,
                                    "tokens of one request for the per-request KV column and the "
                                    "PP balance (default: 32768, or the model's max_model_len "
                                    "when shorter)");
    sub->add_flag("--allow-long-context", f->allow_long_context,
                  "a --context longer than the model's max_model_len, as vLLM serves one with "
                  "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (without it such a --context is refused)");
    sub->add_option("--block-size", f->block_size, "tokens per KV block")->capture_default_str();
    auto* split = sub->add_option_function<std::string>(
        "--pp-split",
        [f](const std::string& v) {
            if (v == "kv")
                f->kv_balanced = true;
            else if (v != "even")
                throw Error(detail::concat("--pp-split must be even or kv, got '", v, "'"));
        },
        "how to split layers over PP stages: even (layer counts) or kv (balance KV bytes at "
        "--context)");
    (void)split;
    sub->callback([f, gpus, context] {
        f->gpus_given = gpus->count() > 0;
        f->context_given = context->count() > 0;
        run(*f);
    });
}

}  // namespace

KVSHARD_COMMAND("layout", setup);

}  // namespace kvshard::cli
