// Hardware, capacity, the cost model and the planner's search.
#include <fmt/format.h>

#include <optional>

#include "bindings.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/cost_model.h"
#include "kvshard/planner/disagg.h"
#include "kvshard/planner/hardware.h"
#include "kvshard/planner/planner.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard::python {

namespace {

// speculative_method / speculative_tokens as the CLI's --speculative-method /
// --speculative-tokens (tools/kvshard/cmd_plan.cpp): both or neither, method "mtp" only.
int speculative_tokens_of(const std::string& method, int tokens) {
    if (method.empty()) {
        require(tokens == 0, "speculative_tokens=", tokens,
                " needs the drafter: give speculative_method=\"mtp\" (the model's MTP layers, the "
                "only method modelled)");
        return 0;
    }
    require(method == "mtp", "unknown speculative_method '", method,
            "': expected \"mtp\" (the model's MTP layers draft, as vLLM's method \"mtp\")");
    require(tokens >= 1 && tokens <= 1024,
            "speculative_method=\"mtp\" needs speculative_tokens "
            "in [1, 1024] (tokens drafted per step), got ",
            tokens);
    return tokens;
}

CapacityOptions capacity_options(double mem_util, double activation_reserve_gib,
                                 std::optional<int> block_size, int64_t context_tokens,
                                 bool allow_long_context, int64_t max_num_batched_tokens,
                                 const std::string& mamba_cache_mode, int speculative_tokens = 0) {
    // As the CLI's --mem-util / --activation-reserve-gib / --block-size
    // (tools/kvshard/options.cpp).
    require(activation_reserve_gib >= 0 && activation_reserve_gib <= 1 << 20,
            "activation_reserve_gib must be a number in [0, 1048576] GiB, got ",
            activation_reserve_gib);
    CapacityOptions o;
    o.mem_util = mem_util;
    o.activation_reserve_bytes = static_cast<int64_t>(activation_reserve_gib * (1 << 30));
    // As the CLI's --block-size: given, it is kept; left out (None), 16 is raised as vLLM raises
    // it for attention + Mamba/GDN models (CapacityOptions::raise_block_size).
    o.block_size = block_size.value_or(16);
    o.raise_block_size = !block_size.has_value();
    o.context_tokens = context_tokens;
    o.allow_long_context = allow_long_context;  // the CLI's --allow-long-context
    // The CLI's --max-num-batched-tokens and --mamba-cache-mode (tools/kvshard/options.cpp).
    o.max_num_batched_tokens = max_num_batched_tokens;
    try {
        o.mamba_cache_mode = parse_mamba_cache_mode(mamba_cache_mode);
    } catch (const Error& e) {
        throw Error(detail::concat("mamba_cache_mode: ", e.what()));
    }
    o.speculative_tokens = speculative_tokens;
    o.validate();
    return o;
}

py::dict weights_dict(const WeightBytes& w) {
    py::dict d;
    d["attention"] = w.attention;
    d["dense_mlp"] = w.dense_mlp;
    d["experts"] = w.experts;
    d["embedding"] = w.embedding;
    d["lm_head"] = w.lm_head;
    d["norms"] = w.norms;
    d["total"] = w.total();
    return d;
}

py::dict capacity_dict(const CapacityReport& c) {
    py::dict d;
    d["limiting_rank"] = c.limiting_rank;
    d["weight_bytes_per_gpu"] = c.weight_bytes_per_gpu;
    d["kv_bytes_per_token"] = c.kv_bytes_per_token;
    d["state_bytes_per_sequence"] = c.state_bytes_per_sequence;
    d["kv_tokens_per_gpu"] = c.kv_tokens_per_gpu;
    d["kv_blocks_per_gpu"] = c.kv_blocks_per_gpu;
    d["max_context"] = c.max_context;
    d["context_unbounded"] = c.context_unbounded;
    d["context_limited_by_model"] = c.context_limited_by_model;
    d["request_kv_bytes"] = c.request_kv_bytes;
    d["request_blocks"] = c.request_blocks;
    d["block_size"] = c.engine.block_size;
    d["kv_cache_groups"] = c.engine.groups.size();
    d["requests_per_replica"] = c.requests_per_replica;
    d["max_concurrency"] = c.max_concurrency;
    d["fits"] = c.fits;
    d["why_not"] = c.why_not;
    py::list ranks;
    for (const auto& r : c.ranks) {
        py::dict rd;
        rd["rank"] = r.rank;
        rd["weights"] = weights_dict(r.weights);
        rd["kv_bytes_per_token"] = r.kv_bytes_per_token;
        rd["state_bytes_per_sequence"] = r.state_bytes_per_sequence;
        rd["kv_budget_bytes"] = r.kv_budget_bytes;
        rd["kv_tokens"] = r.kv_tokens;
        ranks.append(rd);
    }
    d["ranks"] = ranks;
    return d;
}

py::dict phase_dict(const PhaseCost& p) {
    py::dict d;
    d["flops"] = p.flops;
    d["hbm_bytes"] = p.hbm_bytes;
    d["compute_s"] = p.compute_s;
    d["memory_s"] = p.memory_s;
    d["roofline_s"] = p.roofline_s;
    d["attention_compute_s"] = p.attention_compute_s;
    d["tp_bytes"] = p.tp_bytes;
    d["tp_s"] = p.tp_s;
    d["pp_bytes"] = p.pp_bytes;
    d["pp_s"] = p.pp_s;
    d["cp_bytes"] = p.cp_bytes;
    d["cp_s"] = p.cp_s;
    d["ep_bytes"] = p.ep_bytes;
    d["ep_s"] = p.ep_s;
    d["pp_bubble_s"] = p.pp_bubble_s;
    d["total_s"] = p.total_s;
    d["comm_bytes"] = p.comm_bytes();
    return d;
}

py::dict cost_dict(const CostReport& c) {
    py::dict d;
    d["prefill"] = phase_dict(c.prefill);
    d["decode"] = phase_dict(c.decode);
    py::dict cp_prefill;
    cp_prefill["pass_kv_bytes"] = c.cp_prefill.pass_kv_bytes;
    cp_prefill["pass_kv_s"] = c.cp_prefill.pass_kv_s;
    cp_prefill["pass_kv_hidden"] = c.cp_prefill.pass_kv_hidden;
    cp_prefill["pass_q_bytes"] = c.cp_prefill.pass_q_bytes;
    cp_prefill["pass_q_s"] = c.cp_prefill.pass_q_s;
    cp_prefill["chosen"] = std::string(cp_prefill_policy_name(c.cp_prefill.chosen));
    d["cp_prefill"] = cp_prefill;
    py::dict cp_decode;
    cp_decode["all_gather_bytes"] = c.cp_decode.all_gather_bytes;
    cp_decode["all_gather_s"] = c.cp_decode.all_gather_s;
    cp_decode["all_to_all_bytes"] = c.cp_decode.all_to_all_bytes;
    cp_decode["all_to_all_s"] = c.cp_decode.all_to_all_s;
    cp_decode["chosen"] = std::string(cp_merge_policy_name(c.cp_decode.chosen));
    d["cp_decode"] = cp_decode;
    d["ttft_s"] = c.ttft_s;
    d["tpot_s"] = c.tpot_s;
    d["decode_tokens_per_s"] = c.decode_tokens_per_s;
    d["ep_link_share_for_kv"] = c.ep_link_share_for_kv;
    return d;
}

// The request of `kvshard plan` with the CLI's defaults (tools/kvshard/cmd_plan.cpp).
PlanRequest plan_request(int gpus, int64_t context_tokens, int64_t batch, int64_t max_batch,
                         const std::string& objective, const std::string& cp_scheme,
                         const std::string& cp_prefill, const std::string& cp_decode_merge,
                         int pp_chunks, double mem_util, double activation_reserve_gib,
                         std::optional<int> block_size, bool allow_long_context,
                         int64_t max_num_batched_tokens, const std::string& mamba_cache_mode,
                         const std::string& speculative_method, int speculative_tokens) {
    PlanRequest r;
    r.gpus = gpus;
    r.context_tokens = context_tokens;
    r.batch = batch;
    r.max_batch = max_batch;
    r.objective = parse_objective(objective);
    r.cp_scheme = parse_cp_scheme(cp_scheme);
    r.capacity = capacity_options(mem_util, activation_reserve_gib, block_size, 0,
                                  allow_long_context, max_num_batched_tokens, mamba_cache_mode,
                                  speculative_tokens_of(speculative_method, speculative_tokens));
    r.cost.cp_prefill = parse_cp_prefill_policy(cp_prefill);
    r.cost.cp_decode_merge = parse_cp_merge_policy(cp_decode_merge);
    r.cost.pp_prefill_chunks = pp_chunks;
    return r;
}

// The keywords every plan and serving binding ends with (the CLI's engine and memory flags).
#define KVSHARD_ENGINE_ARGS                                                                   \
    py::arg("cp_decode_merge") = "auto", py::arg("pp_chunks") = 0, py::arg("mem_util") = 0.9, \
    py::arg("activation_reserve_gib") = 2.0, py::arg("block_size") = py::none(),              \
    py::arg("allow_long_context") = false, py::arg("max_num_batched_tokens") = 8192,          \
    py::arg("mamba_cache_mode") = "align", py::arg("speculative_method") = "",                \
    py::arg("speculative_tokens") = 0

#define KVSHARD_PLAN_ARGS                                                                    \
    py::arg("model"), py::arg("hardware"), py::arg("gpus"), py::arg("context_tokens"),       \
        py::kw_only(), py::arg("batch") = 0, py::arg("max_batch") = 256,                     \
                       py::arg("objective") = "throughput", py::arg("cp_scheme") = "zigzag", \
                       py::arg("cp_prefill") = "auto", KVSHARD_ENGINE_ARGS

// The request of `kvshard plan --disagg` with the CLI's defaults (tools/kvshard/cmd_plan.cpp,
// run_serving).
ServingRequest serving_request(int gpus, int64_t prompt_tokens, double ttft_slo, double tpot_slo,
                               int64_t output_tokens, std::vector<int64_t> prompt_samples,
                               double prefix_hit_rate, const std::string& weight_dtype,
                               bool disaggregated, int64_t max_batch, const std::string& cp_scheme,
                               const std::string& cp_prefill, const std::string& cp_decode_merge,
                               int pp_chunks, double mem_util, double activation_reserve_gib,
                               std::optional<int> block_size, bool allow_long_context,
                               int64_t max_num_batched_tokens, const std::string& mamba_cache_mode,
                               const std::string& speculative_method, int speculative_tokens) {
    ServingRequest r;
    r.gpus = gpus;
    r.prompt_tokens = prompt_tokens;
    r.prompt_samples = std::move(prompt_samples);
    r.output_tokens = output_tokens;
    r.prefix_hit_rate = prefix_hit_rate;
    r.ttft_slo_s = ttft_slo;
    r.tpot_slo_s = tpot_slo;
    r.max_batch = max_batch;
    r.cp_scheme = parse_cp_scheme(cp_scheme);
    r.capacity = capacity_options(mem_util, activation_reserve_gib, block_size, 0,
                                  allow_long_context, max_num_batched_tokens, mamba_cache_mode,
                                  speculative_tokens_of(speculative_method, speculative_tokens));
    r.cost.cp_prefill = parse_cp_prefill_policy(cp_prefill);
    r.cost.cp_decode_merge = parse_cp_merge_policy(cp_decode_merge);
    r.cost.pp_prefill_chunks = pp_chunks;
    r.weight_dtype = parse_weight_dtype(weight_dtype);
    r.disaggregated = disaggregated;
    r.validate();
    return r;
}

#define KVSHARD_SERVING_ARGS                                                                \
    py::arg("model"), py::arg("hardware"), py::arg("gpus"), py::arg("prompt_tokens"),       \
        py::kw_only(), py::arg("ttft_slo"), py::arg("tpot_slo"),                            \
        py::arg("output_tokens") = 256, py::arg("prompt_samples") = std::vector<int64_t>{}, \
        py::arg("prefix_hit_rate") = 0.0, py::arg("weight_dtype") = "model",                \
        py::arg("disaggregated") = true, py::arg("max_batch") = 256,                        \
        py::arg("cp_scheme") = "zigzag", py::arg("cp_prefill") = "auto", KVSHARD_ENGINE_ARGS

// A binding of (model, hardware, gpus, context_tokens, KVSHARD_PLAN_ARGS' keywords) that builds
// the PlanRequest and returns fn(model, hardware, request).
template <typename F>
auto with_plan_request(F fn) {
    return [fn](const ModelSpec& model, const HardwareSpec& hw, int gpus, int64_t context_tokens,
                int64_t batch, int64_t max_batch, const std::string& objective,
                const std::string& cp_scheme, const std::string& cp_prefill,
                const std::string& cp_decode_merge, int pp_chunks, double mem_util,
                double activation_reserve_gib, std::optional<int> block_size,
                bool allow_long_context, int64_t max_num_batched_tokens,
                const std::string& mamba_cache_mode, const std::string& speculative_method,
                int speculative_tokens) {
        return fn(
            model, hw,
            plan_request(gpus, context_tokens, batch, max_batch, objective, cp_scheme, cp_prefill,
                         cp_decode_merge, pp_chunks, mem_util, activation_reserve_gib, block_size,
                         allow_long_context, max_num_batched_tokens, mamba_cache_mode,
                         speculative_method, speculative_tokens));
    };
}

// The same for KVSHARD_SERVING_ARGS and the ServingRequest.
template <typename F>
auto with_serving_request(F fn) {
    return
        [fn](const ModelSpec& model, const HardwareSpec& hw, int gpus, int64_t prompt_tokens,
             double ttft_slo, double tpot_slo, int64_t output_tokens,
             std::vector<int64_t> prompt_samples, double prefix_hit_rate,
             const std::string& weight_dtype, bool disaggregated, int64_t max_batch,
             const std::string& cp_scheme, const std::string& cp_prefill,
             const std::string& cp_decode_merge, int pp_chunks, double mem_util,
             double activation_reserve_gib, std::optional<int> block_size, bool allow_long_context,
             int64_t max_num_batched_tokens, const std::string& mamba_cache_mode,
             const std::string& speculative_method, int speculative_tokens) {
            return fn(model, hw,
                      serving_request(gpus, prompt_tokens, ttft_slo, tpot_slo, output_tokens,
                                      std::move(prompt_samples), prefix_hit_rate, weight_dtype,
                                      disaggregated, max_batch, cp_scheme, cp_prefill,
                                      cp_decode_merge, pp_chunks, mem_util, activation_reserve_gib,
                                      block_size, allow_long_context, max_num_batched_tokens,
                                      mamba_cache_mode, speculative_method, speculative_tokens));
        };
}

py::dict transfer_cost_dict(const KvTransferCost& t) {
    py::dict d;
    d["bytes"] = t.bytes;
    d["messages"] = t.messages;
    d["layerwise_messages"] = t.layerwise_messages;
    d["busiest_rank_bytes"] = t.busiest_rank_bytes;
    d["crosses_nodes"] = t.crosses_nodes;
    d["transfer_s"] = t.transfer_s;
    d["exposed_s"] = t.exposed_s;
    return d;
}

}  // namespace

void bind_planner(py::module_& m) {
    py::class_<HardwareSpec>(m, "HardwareSpec",
                             "A GPU and its links (a value: ==, to_dict). A str converts through "
                             "resolve_hardware (catalog name or JSON file).")
        .def(py::init(&resolve_hardware), py::arg("name_or_path"))
        .def_readonly("name", &HardwareSpec::name)
        .def_readonly("memory_bytes", &HardwareSpec::memory_bytes)
        .def_readonly("hbm_bw", &HardwareSpec::hbm_bw)
        .def_readonly("flops_bf16", &HardwareSpec::flops_bf16)
        .def_readonly("flops_fp8", &HardwareSpec::flops_fp8)
        .def_readonly("gpus_per_node", &HardwareSpec::gpus_per_node)
        .def_readonly("nvlink_bw", &HardwareSpec::nvlink_bw)
        .def_readonly("internode_bw", &HardwareSpec::internode_bw)
        .def("to_json", [](const HardwareSpec& h) { return to_json(h); })
        .def("to_dict", [](const HardwareSpec& h) { return json_loads(to_json(h)); })
        .def_static(
            "from_json",
            [](const std::string& text) { return parse_hardware_json(text, "<json>"); },
            py::arg("text"))
        .def(py::self == py::self)
        .def("__repr__", [](const HardwareSpec& h) {
            return fmt::format("HardwareSpec(name='{}', memory_gib={:.0f}, gpus_per_node={})",
                               h.name, h.memory_bytes / double(1 << 30), h.gpus_per_node);
        });
    py::implicitly_convertible<py::str, HardwareSpec>();
    m.def("hardware_names", &hardware_names, "Names of the built-in GPUs.");
    m.def("resolve_hardware", &resolve_hardware, py::arg("name_or_path"),
          "A built-in GPU by name, or a hardware JSON file (docs/cost-model.md).");

    m.def(
        "compute_capacity",
        [](const ModelSpec& model, const ParallelConfig& p, const HardwareSpec& hw, double mem_util,
           double activation_reserve_gib, std::optional<int> block_size, int64_t context_tokens,
           bool allow_long_context, int64_t max_num_batched_tokens,
           const std::string& mamba_cache_mode, const std::string& speculative_method,
           int speculative_tokens) {
            const CapacityOptions o =
                capacity_options(mem_util, activation_reserve_gib, block_size, context_tokens,
                                 allow_long_context, max_num_batched_tokens, mamba_cache_mode,
                                 speculative_tokens_of(speculative_method, speculative_tokens));
            CapacityReport c;
            {
                py::gil_scoped_release release;
                c = compute_capacity(model, p, hw, o);
            }
            return capacity_dict(c);
        },
        py::arg("model"), py::arg("parallel"), py::arg("hardware"), py::kw_only(),
        py::arg("mem_util") = 0.9, py::arg("activation_reserve_gib") = 2.0,
        py::arg("block_size") = py::none(), py::arg("context_tokens") = 0,
        py::arg("allow_long_context") = false, py::arg("max_num_batched_tokens") = 8192,
        py::arg("mamba_cache_mode") = "align", py::arg("speculative_method") = "",
        py::arg("speculative_tokens") = 0,
        "Weights, KV budget and KV tokens per GPU, as a dict (per-rank figures under 'ranks'). "
        "speculative_method=\"mtp\" with speculative_tokens=N: the model's MTP layers draft N "
        "tokens per step (`kvshard plan --speculative-method mtp --speculative-tokens N`).");
    m.def(
        "estimate_cost",
        [](const ModelSpec& model, const ParallelConfig& p, const HardwareSpec& hw,
           int64_t prompt_tokens, int64_t context_tokens, int64_t batch,
           const std::string& cp_prefill, const std::string& cp_decode_merge, int pp_chunks) {
            Workload w{
                .prompt_tokens = prompt_tokens, .context_tokens = context_tokens, .batch = batch};
            CostOptions o;
            o.cp_prefill = parse_cp_prefill_policy(cp_prefill);
            o.cp_decode_merge = parse_cp_merge_policy(cp_decode_merge);
            o.pp_prefill_chunks = pp_chunks;
            CostReport c;
            {
                py::gil_scoped_release release;
                c = estimate_cost(model, p, hw, w, o);
            }
            return cost_dict(c);
        },
        py::arg("model"), py::arg("parallel"), py::arg("hardware"), py::kw_only(),
        py::arg("prompt_tokens"), py::arg("context_tokens"), py::arg("batch") = 1,
        py::arg("cp_prefill") = "auto", py::arg("cp_decode_merge") = "auto",
        py::arg("pp_chunks") = 0,
        "TTFT of one prompt and TPOT of a decode batch from the roofline cost model, as a dict.");
    m.def(
        "enumerate_configs",
        [](const ModelSpec& model, int gpus, const std::string& cp_scheme) {
            require(gpus >= 1, "gpus must be >= 1, got ", gpus);
            return enumerate_configs(model, gpus, parse_cp_scheme(cp_scheme));
        },
        py::arg("model"), py::arg("gpus"), py::arg("cp_scheme") = "zigzag",
        "Every valid ParallelConfig of the model on `gpus` GPUs.");
    m.def(
        "plan",
        with_plan_request([](const ModelSpec& model, const HardwareSpec& hw, const PlanRequest& r) {
            std::string json;
            {
                py::gil_scoped_release release;
                json = plan_to_json(model, hw, r, plan(model, hw, r));
            }
            return json_loads(json);
        }),
        KVSHARD_PLAN_ARGS,
        "Every configuration ranked by the objective: the dict of `kvshard plan --json`.");
    m.def(
        "plan_svg",
        with_plan_request([](const ModelSpec& model, const HardwareSpec& hw, const PlanRequest& r) {
            py::gil_scoped_release release;
            return plan_to_svg(model, hw, r, plan(model, hw, r));
        }),
        KVSHARD_PLAN_ARGS, "The chart of `kvshard plan --svg`, as SVG text.");
    m.def(
        "explain_plan",
        [](const ModelSpec& model, const HardwareSpec& hw, int gpus, int64_t context_tokens,
           const ParallelConfig& p, int64_t batch, int64_t max_batch, const std::string& objective,
           const std::string& cp_scheme, const std::string& cp_prefill,
           const std::string& cp_decode_merge, int pp_chunks, double mem_util,
           double activation_reserve_gib, std::optional<int> block_size, bool allow_long_context,
           int64_t max_num_batched_tokens, const std::string& mamba_cache_mode,
           const std::string& speculative_method, int speculative_tokens) {
            const PlanRequest r = plan_request(
                gpus, context_tokens, batch, max_batch, objective, cp_scheme, cp_prefill,
                cp_decode_merge, pp_chunks, mem_util, activation_reserve_gib, block_size,
                allow_long_context, max_num_batched_tokens, mamba_cache_mode, speculative_method,
                speculative_tokens);
            std::string json;
            {
                py::gil_scoped_release release;
                json = plan_to_json(model, hw, r, {evaluate_config(model, hw, r, p)});
            }
            return json_loads(json);
        },
        py::arg("model"), py::arg("hardware"), py::arg("gpus"), py::arg("context_tokens"),
        py::arg("parallel"), py::kw_only(), py::arg("batch") = 0, py::arg("max_batch") = 256,
        py::arg("objective") = "throughput", py::arg("cp_scheme") = "zigzag",
        py::arg("cp_prefill") = "auto", py::arg("cp_decode_merge") = "auto",
        py::arg("pp_chunks") = 0, py::arg("mem_util") = 0.9,
        py::arg("activation_reserve_gib") = 2.0, py::arg("block_size") = py::none(),
        py::arg("allow_long_context") = false, py::arg("max_num_batched_tokens") = 8192,
        py::arg("mamba_cache_mode") = "align", py::arg("speculative_method") = "",
        py::arg("speculative_tokens") = 0,
        "One configuration evaluated as `kvshard plan --explain ... --json` does (the parallel "
        "config is used as given: spell cp_scheme in it when cp > 1).");

    m.def("plan_disagg",
          with_serving_request(
              [](const ModelSpec& model, const HardwareSpec& hw, const ServingRequest& r) {
                  std::string json;
                  {
                      py::gil_scoped_release release;
                      json = serving_to_json(model, hw, r, plan_serving(model, hw, r));
                  }
                  return json_loads(json);
              }),
          KVSHARD_SERVING_ARGS,
          "Prefill pools x decode pools (each its own layout and instance count) ranked with the "
          "aggregated configurations by output tokens/s per GPU under the TTFT and TPOT SLOs "
          "(seconds): the dict of `kvshard plan --disagg --json`. prefix_hit_rate and "
          "prompt_samples stand for what --trace measures.");
    m.def("plan_disagg_svg",
          with_serving_request(
              [](const ModelSpec& model, const HardwareSpec& hw, const ServingRequest& r) {
                  py::gil_scoped_release release;
                  return serving_to_svg(model, hw, r, plan_serving(model, hw, r));
              }),
          KVSHARD_SERVING_ARGS, "The chart of `kvshard plan --disagg --svg`, as SVG text.");
    m.def(
        "price_kv_transfer",
        [](const ModelSpec& model, const ParallelConfig& prefill, const ParallelConfig& decode,
           const HardwareSpec& hw, int64_t tokens, double prefill_s, int block_size) {
            require(tokens >= 1 && tokens <= kMaxTransferTokens, "tokens must be in [1, ",
                    kMaxTransferTokens, "], got ", tokens);
            require(prefill_s >= 0, "prefill_s must be >= 0 seconds, got ", prefill_s);
            require(block_size >= 1, "block_size must be >= 1, got ", block_size);
            KvTransferCost t;
            {
                py::gil_scoped_release release;
                t = price_kv_transfer(model, prefill, decode, hw, tokens, prefill_s, block_size);
            }
            return transfer_cost_dict(t);
        },
        py::arg("model"), py::arg("prefill"), py::arg("decode"), py::arg("hardware"),
        py::arg("tokens"), py::kw_only(), py::arg("prefill_s") = 0.0, py::arg("block_size") = 16,
        "One request's KV move from a prefill instance to a decode instance as plan_disagg "
        "prices it (bytes and messages of kvshard's transfer plan, the busiest GPU's time, what "
        "stays exposed after a prefill of prefill_s seconds), as a dict.");
}

}  // namespace kvshard::python
