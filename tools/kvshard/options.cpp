#include "options.h"

#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <fstream>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"

namespace kvshard::cli {

void add_model_options(CLI::App* sub, ModelFlags& f, bool required) {
    std::string names;
    for (const auto& n : catalog_names()) names += (names.empty() ? "" : ", ") + n;
    auto* opt = sub->add_option("--model,-m", f.model,
                                "model: a catalog name (" + names +
                                    "), a Hugging Face config.json, or a directory holding one");
    if (required) opt->required();
    sub->add_option("--kv-dtype", f.kv_dtype,
                    "KV element type: fp32|bf16|fp16|fp8 (default: the model's)");
    sub->add_flag("--all-full-attention", f.all_full_attention,
                  "size every layer as full attention (windows, chunks and states ignored), "
                  "to compare with the model as it is");
}

ModelSpec load_model(const ModelFlags& f) {
    ModelSpec m = resolve_model(f.model);
    if (!f.kv_dtype.empty()) m.kv_dtype = parse_dtype(f.kv_dtype);
    if (f.all_full_attention) m = with_full_attention(m);
    return m;
}

void add_parallel_options(CLI::App* sub, ParallelFlags& f) {
    const CLI::Range size(1, ParallelConfig::kMaxWorldSize);
    sub->add_option("--tp", f.tp, "tensor parallel size (splits KV heads)")
        ->capture_default_str()
        ->check(size);
    sub->add_option("--pp", f.pp, "pipeline parallel size (splits layers)")
        ->capture_default_str()
        ->check(size);
    sub->add_option("--cp,--sp", f.cp, "context parallel size (splits tokens)")
        ->capture_default_str()
        ->check(size);
    sub->add_option("--dp", f.dp, "data parallel replicas")->capture_default_str()->check(size);
    sub->add_option("--ep", f.ep, "expert parallel size (MoE experts over dp*cp*tp ranks)")
        ->capture_default_str()
        ->check(size);
    sub->add_option("--cp-scheme", f.cp_scheme,
                    "token ownership under CP: contiguous|zigzag|interleave")
        ->capture_default_str();
    sub->add_option("--cp-interleave", f.cp_interleave,
                    "tokens per round-robin unit for interleave")
        ->capture_default_str();
    sub->add_option("--pp-layers", f.pp_layers,
                    "explicit (decoder) layers per stage, e.g. 10,12,10");
}

ParallelConfig to_parallel_config(const ParallelFlags& f) {
    // Set field by field (not through a "key=value" string, which a value with a comma could
    // extend); validate() checks the sizes.
    ParallelConfig p;
    p.tp = f.tp;
    p.pp = f.pp;
    p.cp = f.cp;
    p.dp = f.dp;
    p.ep = f.ep;
    p.cp_scheme = parse_cp_scheme(f.cp_scheme);
    p.cp_interleave = f.cp_interleave;
    // Either one did nothing where it does not apply.
    require(p.cp > 1 || p.cp_scheme == CpScheme::kContiguous, "--cp-scheme ", f.cp_scheme,
            " places tokens over the CP ranks; with --cp 1 there is one: give --cp 2 or more, or "
            "drop --cp-scheme");
    require(p.cp_interleave == 1 || p.cp_scheme == CpScheme::kInterleave, "--cp-interleave ",
            p.cp_interleave, " is the unit of --cp-scheme interleave; with --cp-scheme ",
            f.cp_scheme, " it does nothing: give --cp-scheme interleave, or drop --cp-interleave");
    if (!f.pp_layers.empty()) {
        std::string layers = f.pp_layers;
        for (char& c : layers)
            if (c == ',') c = '/';
        require(layers.find_first_of("= ") == std::string::npos,
                "--pp-layers takes layer counts per stage, e.g. 10,12,10; got '", f.pp_layers, "'");
        p.pp_layers = parse_parallel_config("pp_layers=" + layers).pp_layers;
    }
    return p;
}

void add_hardware_options(CLI::App* sub, HardwareFlags& f) {
    std::string names;
    for (const auto& n : hardware_names()) names += (names.empty() ? "" : ", ") + n;
    sub->add_option("--hardware,--hw", f.hardware,
                    "GPU: a catalog name (" + names + ") or a JSON file (docs/cost-model.md)")
        ->capture_default_str();
    sub->add_option("--mem-util", f.mem_util,
                    "share of GPU memory for weights + KV (vLLM gpu_memory_utilization)")
        ->capture_default_str();
    sub->add_option("--activation-reserve-gib", f.activation_reserve_gib,
                    "GiB per GPU kept for activations, CUDA graphs and buffers")
        ->capture_default_str();
    f.block_size_option =
        sub->add_option("--block-size", f.block_size,
                        "tokens per KV block (not given: 16, raised for attention + Mamba/GDN "
                        "models as vLLM does so an attention page holds a state)")
            ->capture_default_str();
    sub->add_option("--max-num-batched-tokens", f.max_num_batched_tokens,
                    "tokens one step may prefill (vLLM max_num_batched_tokens; `vllm serve` "
                    "default on GPUs of 70 GiB or more): vLLM's startup check charges each "
                    "sliding layer W - 1 + this many")
        ->capture_default_str();
    sub->add_option("--mamba-cache-mode", f.mamba_cache_mode,
                    "state blocks of Mamba/GDN layers: none (vLLM with prefix caching off: one "
                    "per request and state group) or align (prefix caching on, vLLM's default "
                    "for hybrid models since PR #50991: two at the startup check and while a "
                    "request crosses a block)")
        ->capture_default_str();
    sub->add_flag("--allow-long-context", f.allow_long_context,
                  "plan a context longer than the model's max_model_len (derived from its "
                  "config.json as vLLM does), as vLLM serves it with "
                  "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1");
}

CapacityOptions HardwareFlags::capacity_options() const {
    require(activation_reserve_gib >= 0 && activation_reserve_gib <= 1 << 20,
            "--activation-reserve-gib must be a number in [0, 1048576] GiB, got ",
            activation_reserve_gib);
    CapacityOptions o;
    o.mem_util = mem_util;
    o.activation_reserve_bytes = static_cast<int64_t>(activation_reserve_gib * (1 << 30));
    o.block_size = block_size;
    o.raise_block_size = block_size_option == nullptr || block_size_option->count() == 0;
    o.max_num_batched_tokens = max_num_batched_tokens;
    o.allow_long_context = allow_long_context;
    try {
        o.mamba_cache_mode = parse_mamba_cache_mode(mamba_cache_mode);
    } catch (const Error& e) {
        throw Error(detail::concat("--mamba-cache-mode: ", e.what()));
    }
    o.validate();
    return o;
}

HardwareSpec load_hardware(const HardwareFlags& f) { return resolve_hardware(f.hardware); }

void print_json(const std::string& json_text) { std::printf("%s\n", json_text.c_str()); }

// numpy .npy v1.0, little-endian float32, C order.
void write_npy(const std::string& path, const std::vector<float>& data, int64_t rows,
               int64_t cols) {
    std::string header =
        fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}", rows, cols);
    while ((10 + header.size() + 1) % 64 != 0) header += ' ';
    header += '\n';
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    require(bool(out), "--dump-logits: cannot write '", path, "'");
    out.write("\x93NUMPY\x01\x00", 8);
    const uint16_t len = uint16_t(header.size());
    const char len_bytes[2] = {char(len & 0xff), char(len >> 8)};
    out.write(len_bytes, 2);
    out.write(header.data(), std::streamsize(header.size()));
    out.write(reinterpret_cast<const char*>(data.data()),
              std::streamsize(data.size() * sizeof(float)));
    require(bool(out), "--dump-logits: write to '", path, "' failed");
}

}  // namespace kvshard::cli
