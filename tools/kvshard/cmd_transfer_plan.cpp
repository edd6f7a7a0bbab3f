// kvshard transfer-plan: which prefill rank sends which KV to which decode rank.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "command.h"
#include "kvshard/common/error.h"
#include "kvshard/transfer/descriptors.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"
#include "kvshard/transfer/transfer_schedule.h"
#include "options.h"

namespace kvshard::cli {
namespace {

struct TransferPlanFlags {
    ModelFlags model;
    std::string from = "tp=1", to = "tp=1";
    int64_t tokens = 0;
    int block_size_from = 16, block_size_to = 16;
    std::string order_from = "hnd", order_to = "hnd";
    int dp_from = 0, dp_to = 0;
    int layers_per_group = 0;
    int64_t dst_cached = 0;
    std::string mode = "auto";
    bool messages = false;
    bool schedule = false;
    bool direct_read = false;
    int64_t staging_mib = 64;
    bool json = false;
    bool descriptors = false;
    int64_t descriptor_limit = 1000;
    bool allow_long_context = false;
};

// The blocks of each pool of one side: what its longest block table needs (sequential tables).
int64_t pool_blocks(const TransferEndpoint& e) {
    int64_t n = 1;
    for (const auto& t : e.block_tables) n = std::max<int64_t>(n, int64_t(t.size()));
    return n;
}

std::string bytes_text(int64_t b) {
    if (b >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / 1073741824.0);
    if (b >= (int64_t{1} << 20)) return fmt::format("{:.2f} MiB", b / 1048576.0);
    if (b >= 1024) return fmt::format("{:.1f} KiB", b / 1024.0);
    return fmt::format("{} B", b);
}

TransferEndpoint endpoint(const char* side, const ModelSpec& m, const std::string& parallel, int dp,
                          int block_size, const std::string& order, int64_t tokens) {
    TransferEndpoint e;
    try {
        e.layout = make_layout(m, parse_parallel_config(parallel));
    } catch (const Error& err) {
        throw Error(fmt::format("{} '{}': {}", side, parallel, err.what()));
    }
    e.dp = dp;
    e.block_size = block_size;
    e.order = parse_page_order(order);
    e.block_tables = sequential_block_tables(e.layout, block_size, tokens);
    return e;
}

void run(const TransferPlanFlags& f) {
    require(f.tokens >= 1, "--tokens must be at least 1, got ", f.tokens);
    // Checked before anything is printed.
    require(f.staging_mib >= 1 && f.staging_mib <= (int64_t{1} << 20),
            "--staging-mib must be between 1 and 1048576 (1 TiB), got ", f.staging_mib);
    const ModelSpec m = load_model(f.model);
    m.check_computed_length(f.tokens, f.allow_long_context, "--tokens", kAllowLongContextFlag);
    const TransferEndpoint src =
        endpoint("--from", m, f.from, f.dp_from, f.block_size_from, f.order_from, f.tokens);
    const TransferEndpoint dst =
        endpoint("--to", m, f.to, f.dp_to, f.block_size_to, f.order_to, f.tokens);
    const TransferPlan plan = make_transfer_plan(
        src, dst, f.tokens,
        {.layers_per_group = f.layers_per_group, .dst_cached_tokens = f.dst_cached});
    // A plan of several KV groups is printed but cannot be packed (transfer_plan.h, executable):
    // there is no copy count to choose a mode by.
    const TransferMode mode = plan.executable() ? resolve_mode(plan, parse_transfer_mode(f.mode))
                                                : parse_transfer_mode(f.mode);
    // The mode each KV group moves in (one entry for a model of one group).
    const auto modes = resolve_group_modes(plan, mode);
    std::optional<TransferDescriptors> desc;
    if (f.descriptors) {
        require(f.descriptor_limit >= -1, "--descriptor-limit must be -1 (all) or at least 0, got ",
                f.descriptor_limit);
        desc = make_transfer_descriptors(plan, side_pool_regions(plan, true, pool_blocks(src)),
                                         side_pool_regions(plan, false, pool_blocks(dst)),
                                         {.max_listed = f.descriptor_limit});
    }
    if (f.json) {
        if (!desc) {
            print_json(to_json(plan, f.messages));
            return;
        }
        auto j = nlohmann::json::parse(to_json(plan, f.messages));
        j.update(nlohmann::json::parse(to_json(*desc)));
        print_json(j.dump(2));
        return;
    }
    fmt::print("{}: {} tokens, {} -> {}\n", m.name, f.tokens, src.layout.parallel.to_string(),
               dst.layout.parallel.to_string());
    fmt::print(
        "block size {} -> {}, pages {} -> {}, mode {}, {} layer group(s)\n", src.block_size,
        dst.block_size, f.order_from, f.order_to,
        plan.executable() ? std::string(transfer_mode_name(mode)) : group_modes_text(plan, modes),
        plan.num_layer_groups);
    fmt::print("messages {}, bytes {} ({}), min bytes {} ({})\n\n", plan.messages.size(),
               plan.bytes, bytes_text(plan.bytes), plan.min_bytes, bytes_text(plan.min_bytes));
    if (!m.uniform()) {
        fmt::print("{:>5} {:>14} {:>7} {:>11} {:>9} {:>14} {:>13}\n", "group", "kind", "layers",
                   "first_kept", "messages", "bytes", "mode");
        const auto totals = group_totals(plan);
        for (size_t k = 0; k < plan.groups.size(); ++k) {
            const TransferGroup& g = plan.groups[k];
            std::string kind(layer_kind_name(g.kind));
            if (g.window > 0) kind += fmt::format("({})", g.window);
            fmt::print(
                "{:>5} {:>14} {:>7} {:>11} {:>9} {:>14} {:>13}\n", k, kind, g.layers.size(),
                g.holds_state() ? std::string("state") : std::to_string(g.first_kept),
                totals[k].messages, bytes_text(totals[k].bytes),
                modes[k] ? std::string(transfer_mode_name(*modes[k])) : std::string("whole state"));
        }
        fmt::print("\n");
    }
    std::map<std::pair<int, int>, std::pair<int64_t, int>> pairs;
    for (const auto& msg : plan.messages) {
        auto& p = pairs[{msg.src_rank, msg.dst_rank}];
        p.first += msg.bytes;
        ++p.second;
    }
    fmt::print("{:>5} {:>5} {:>9} {:>14}\n", "src", "dst", "messages", "bytes");
    for (const auto& [k, v] : pairs)
        fmt::print("{:>5} {:>5} {:>9} {:>14}\n", k.first, k.second, v.second, bytes_text(v.first));
    if (f.messages) {
        fmt::print("\n{:>5} {:>5} {:>6} {:>3} {:>9} {:>9} {:>8} {:>7} {:>12}\n", "src", "dst",
                   "group", "kv", "layers", "heads", "tokens", "pieces", "bytes");
        for (const auto& msg : plan.messages)
            fmt::print("{:>5} {:>5} {:>6} {:>3} {:>9} {:>9} {:>8} {:>7} {:>12}\n", msg.src_rank,
                       msg.dst_rank, msg.layer_group, msg.kv_group,
                       fmt::format("[{},{})", msg.layer_begin, msg.layer_end),
                       fmt::format("[{},{})", msg.head_begin, msg.head_end), msg.num_tokens,
                       msg.pieces.size(), msg.bytes);
    }
    if (desc) {
        fmt::print("\ndescriptors {} (runs contiguous in both pools), per-block scheme {}\n",
                   desc->descriptor_count, desc->per_block_descriptor_count);
        fmt::print("with a reshape: pre-send {}, post-receive {}; fewer: {} ({}){}\n",
                   desc->pre_send_count, desc->post_receive_count,
                   transfer_mode_name(desc->fewer_mode), desc->fewer_count(),
                   desc->pages_differ ? "" : " (same page order and block size on both sides)");
        fmt::print("\n{:>5} {:>5} {:>6} {:>12} {:>14}\n", "src", "dst", "group", "descriptors",
                   "bytes");
        for (const DescriptorGroup& g : desc->groups)
            fmt::print("{:>5} {:>5} {:>6} {:>12} {:>14}\n", g.src_rank, g.dst_rank, g.layer_group,
                       g.count, bytes_text(g.bytes));
        fmt::print("\n{:>5} {:>14} {:>5} {:>14} {:>10} {:>6}\n", "src", "src_offset", "dst",
                   "dst_offset", "bytes", "group");
        for (const TransferDescriptor& x : desc->descriptors)
            fmt::print("{:>5} {:>14} {:>5} {:>14} {:>10} {:>6}\n", x.src_rank, x.src_offset,
                       x.dst_rank, x.dst_offset, x.bytes, x.layer_group);
        if (static_cast<int64_t>(desc->descriptors.size()) < desc->descriptor_count)
            fmt::print("... {} more (--descriptor-limit)\n",
                       desc->descriptor_count - static_cast<int64_t>(desc->descriptors.size()));
    }
    if (f.schedule) {
        const TransferSchedule sched = make_transfer_schedule(
            plan, side_pool_pages(plan, true, pool_blocks(src)),
            side_pool_pages(plan, false, pool_blocks(dst)),
            {.mode = mode, .direct_read = f.direct_read, .staging_bytes = f.staging_mib << 20});
        fmt::print("\n{}", to_text(sched));
    }
}

void setup(CLI::App& app) {
    auto f = std::make_shared<TransferPlanFlags>();
    auto* sub = app.add_subcommand(
        "transfer-plan",
        "Plan moving one request's KV from a prefill layout to a decode layout (docs/transfer.md)");
    add_model_options(sub, f->model);
    sub->add_option("--from", f->from,
                    "prefill layout, e.g. tp=8 or tp=4,pp=2,cp=2,cp_scheme=zigzag")
        ->capture_default_str();
    sub->add_option("--to", f->to, "decode layout, same syntax")->capture_default_str();
    sub->add_option("--tokens,-L", f->tokens, "tokens of the request")->required();
    sub->add_option("--block-size-from", f->block_size_from, "prefill block size (tokens)")
        ->capture_default_str();
    sub->add_option("--block-size-to", f->block_size_to, "decode block size (tokens)")
        ->capture_default_str();
    sub->add_option("--order-from", f->order_from, "prefill page order: hnd|nhd")
        ->capture_default_str();
    sub->add_option("--order-to", f->order_to, "decode page order: hnd|nhd")->capture_default_str();
    sub->add_option("--dp-from", f->dp_from, "prefill replica holding the request")
        ->capture_default_str();
    sub->add_option("--dp-to", f->dp_to, "decode replica receiving the request")
        ->capture_default_str();
    sub->add_option("--dst-cached", f->dst_cached,
                    "leading tokens the decode side already holds (a prefix-cache hit there): "
                    "only the rest moves")
        ->capture_default_str();
    sub->add_option("--layers-per-message", f->layers_per_group,
                    "layers per message (0: all, 1: stream layer by layer)")
        ->capture_default_str();
    sub->add_option("--mode", f->mode, "pre-send|post-receive|auto (where the reshape happens)")
        ->capture_default_str();
    sub->add_flag("--messages", f->messages, "also list every message");
    auto* schedule =
        sub->add_flag("--schedule", f->schedule,
                      "also print the transfer schedule: per source rank, each message's path "
                      "(direct-read, zero-copy, batched), pool offsets and batch (pools holding "
                      "each side's blocks numbered 0, 1, ...)");
    sub->add_flag("--direct-read", f->direct_read,
                  "with --schedule: the destinations read the source pools in place")
        ->needs(schedule);
    sub->add_option("--staging-mib", f->staging_mib,
                    "with --schedule: packed KV in flight per rank (MiB), which bounds a batch")
        ->capture_default_str()
        ->needs(schedule);
    auto* descriptors = sub->add_flag(
        "--descriptors", f->descriptors,
        "also list the transfer descriptors: maximal runs contiguous in both pools "
        "(pools holding each side's blocks numbered 0, 1, ...), the count a per-block "
        "scheme would post, and the counts with a reshape (docs/transfer.md)");
    sub->add_option("--descriptor-limit", f->descriptor_limit,
                    "with --descriptors: descriptors listed (all are counted); -1: all")
        ->capture_default_str()
        ->needs(descriptors);
    sub->add_flag("--allow-long-context", f->allow_long_context,
                  "--tokens of the model's max_model_len or more, as vLLM computes such a prompt "
                  "with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and a longer --max-model-len (without it "
                  "at most max_model_len - 1 tokens are taken)");
    // The schedule is text only (transfer_schedule.h has no JSON form).
    sub->add_flag("--json", f->json, "print JSON instead of a table")->excludes(schedule);
    sub->callback([f] { run(*f); });
}

}  // namespace

KVSHARD_COMMAND("transfer-plan", setup);

}  // namespace kvshard::cli
