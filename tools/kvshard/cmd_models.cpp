// kvshard models: the built-in catalog, or one model's spec (from the catalog or a config.json).
#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "command.h"
#include "kvshard/model/catalog.h"
#include "options.h"

namespace kvshard::cli {
namespace {

struct ModelsFlags {
    ModelFlags model;
    bool json = false;
};

void run(const ModelsFlags& f) {
    if (!f.model.model.empty()) {
        const ModelSpec m = load_model(f.model);
        print_json(to_json(m));
        return;
    }
    // The catalog, each entry as --kv-dtype and --all-full-attention change it (all made before
    // printing, so a bad --kv-dtype prints nothing but the error).
    std::vector<ModelSpec> catalog;
    for (const auto& n : catalog_names()) {
        ModelFlags one = f.model;
        one.model = n;
        catalog.push_back(load_model(one));
    }
    if (f.json) {
        std::string out = "[";
        bool first = true;
        for (const ModelSpec& m : catalog) {
            out += (first ? "" : ",") + to_json(m);
            first = false;
        }
        print_json(out + "]");
        return;
    }
    fmt::print(
        "{:<19} {:>6} {:>6} {:>4} {:>5} {:>5} {:>4} {:>8} {:>9} {:>7} {:>10} {:>10} {:>8}  {}\n",
        "name", "layers", "hidden", "H", "H_kv", "d", "attn", "experts", "params", "weights",
        "KV/token", "state/seq", "max len", "layer mix");
    const std::vector<std::string> names = catalog_names();
    for (size_t i = 0; i < catalog.size(); ++i) {
        const ModelSpec& m = catalog[i];
        const int64_t kv = m.kv_bytes_per_token();
        const int64_t state = m.state_bytes_per_sequence();
        const std::string mix = m.layer_mix();
        const double params = static_cast<double>(m.total_params());
        const std::string params_text = params >= 1e9 ? fmt::format("{:.2f}B", params / 1e9)
                                                      : fmt::format("{:.2f}M", params / 1e6);
        fmt::print(
            "{:<19} {:>6} {:>6} {:>4} {:>5} {:>5} {:>4} {:>8} {:>9} {:>7} {:>7.1f}KiB {:>10} {:>8} "
            " "
            "{}\n",
            names[i], m.num_decoder_layers(), m.hidden, m.num_heads,
            m.is_mla() ? 1 : m.num_kv_heads, m.head_dim, attention_kind_name(m.attention),
            m.moe.enabled() ? fmt::format("{}/{}", m.moe.experts_per_token, m.moe.num_experts)
                            : "-",
            params_text, weight_storage_name(m), kv / 1024.0,
            state > 0 ? fmt::format("{:.1f}MiB", state / 1048576.0) : "-",
            m.max_model_len > 0 ? std::to_string(m.max_model_len) : "-",
            mix.substr(mix.find(": ") + 2));
    }
}

void setup(CLI::App& app) {
    auto f = std::make_shared<ModelsFlags>();
    auto* sub =
        app.add_subcommand("models", "List the model catalog, or print one model's spec as JSON");
    add_model_options(sub, f->model, /*required=*/false);
    sub->add_flag("--json", f->json, "print the whole catalog as JSON");
    sub->callback([f] { run(*f); });
}

}  // namespace

KVSHARD_COMMAND("models", setup);

}  // namespace kvshard::cli
