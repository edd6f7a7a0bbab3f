// Models (catalog, config.json), parallel configurations and KV layouts.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bindings.h"
#include "kvshard/common/dtype.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/layout/parallel_config.h"
#include "kvshard/model/catalog.h"
#include "kvshard/model/model_spec.h"

namespace kvshard::python {

namespace {

py::dict coord_dict(const RankCoord& c) {
    py::dict d;
    d["rank"] = c.rank;
    d["dp"] = c.dp;
    d["pp"] = c.pp;
    d["cp"] = c.cp;
    d["tp"] = c.tp;
    d["ep"] = c.ep;
    d["ep_group"] = c.ep_group;
    return d;
}

std::string parallel_repr(const ParallelConfig& p) {
    std::string s = fmt::format("ParallelConfig(dp={}, pp={}, cp={}, tp={}, ep={}", p.dp, p.pp,
                                p.cp, p.tp, p.ep);
    if (p.cp > 1) s += fmt::format(", cp_scheme='{}'", cp_scheme_name(p.cp_scheme));
    if (p.cp_scheme == CpScheme::kInterleave)
        s += fmt::format(", cp_interleave={}", p.cp_interleave);
    if (!p.pp_layers.empty()) s += fmt::format(", pp_layers={}", fmt::join(p.pp_layers, ", "));
    return s + ")";
}

}  // namespace

void bind_model_layout(py::module_& m) {
    py::class_<ModelSpec>(m, "ModelSpec",
                          "A model's shape as far as KV, weights and FLOPs go (a value: ==, "
                          "to_dict). Build one with catalog_model, load_hf_config or "
                          "resolve_model; a str converts through resolve_model.")
        .def(py::init(&resolve_model), py::arg("name_or_path"),
             "A catalog name, a config.json path, or a directory holding one.")
        .def_readonly("name", &ModelSpec::name)
        .def_readonly("num_layers", &ModelSpec::num_layers,
                      "Cache layers (entries of the per-layer list): num_decoder_layers x "
                      "cache_layers_per_decoder_layer.")
        .def_readonly("cache_layers_per_decoder_layer", &ModelSpec::cache_layers_per_decoder_layer,
                      "1 for most models; 2 for Falcon-H1 (attention and Mamba-2 side by side), 3 "
                      "for LongCat-Flash (two MLA attentions and the MoE).")
        .def_property_readonly("num_decoder_layers", &ModelSpec::num_decoder_layers,
                               "The decoder layers (num_hidden_layers), what PP splits.")
        .def_readonly("hidden", &ModelSpec::hidden)
        .def_readonly("num_heads", &ModelSpec::num_heads)
        .def_readonly("num_kv_heads", &ModelSpec::num_kv_heads)
        .def_readonly("head_dim", &ModelSpec::head_dim)
        .def_readonly("intermediate", &ModelSpec::intermediate)
        .def_readonly("vocab", &ModelSpec::vocab)
        .def_readonly("max_model_len", &ModelSpec::max_model_len,
                      "The longest sequence vLLM serves, derived from config.json as vLLM does "
                      "(0: the model states none).")
        .def_property_readonly(
            "attention",
            [](const ModelSpec& s) { return std::string(attention_kind_name(s.attention)); })
        .def_property_readonly(
            "kv_dtype", [](const ModelSpec& s) { return std::string(dtype_name(s.kv_dtype)); })
        .def_property_readonly(
            "weight_dtype",
            [](const ModelSpec& s) { return std::string(dtype_name(s.weight_dtype)); })
        .def_property_readonly("weight_storage", &weight_storage_name,
                               "How the weights are stored: the quantization method of a quantized "
                               "checkpoint ('fp8', 'mxfp4', ...), else weight_dtype. to_dict()['"
                               "weight_storage'] has the bits of each part.")
        .def("is_mla", &ModelSpec::is_mla)
        .def("uniform", &ModelSpec::uniform,
             "True when every layer is the model's uniform full-attention (or MLA) layer.")
        .def("layer_mix", &ModelSpec::layer_mix, "e.g. '36 layers: 18 sliding(128) + 18 full'.")
        .def("kv_bytes_per_token", &ModelSpec::kv_bytes_per_token,
             "KV bytes a token adds over all layers and heads (while shorter than every window).")
        .def("state_bytes_per_sequence", &ModelSpec::state_bytes_per_sequence)
        .def("total_params", &ModelSpec::total_params)
        .def("active_params_per_token", &ModelSpec::active_params_per_token)
        .def(
            "with_kv_dtype",
            [](const ModelSpec& s, const std::string& dtype) {
                ModelSpec out = s;
                out.kv_dtype = parse_dtype(dtype);
                return out;
            },
            py::arg("dtype"), "The same model with a KV cache of fp32, bf16, fp16 or fp8.")
        .def(
            "with_full_attention", [](const ModelSpec& s) { return with_full_attention(s); },
            "The same model with every layer full attention (--all-full-attention).")
        .def("validate", &ModelSpec::validate, "Raises kvshard.Error naming the first bad field.")
        .def(
            "to_json", [](const ModelSpec& s) { return to_json(s); },
            "The JSON of `kvshard model --json`.")
        .def(
            "to_dict", [](const ModelSpec& s) { return json_loads(to_json(s)); },
            "json.loads(to_json()).")
        .def_static(
            "from_json", [](const std::string& text) { return model_spec_from_json(text); },
            py::arg("text"))
        .def(py::self == py::self)
        .def("__repr__", [](const ModelSpec& s) {
            // Several cache layers per decoder layer (Falcon-H1: 44 x 2): the decoder layers and
            // how many cache layers each holds, as `kvshard layout` and `kvshard models` say.
            const std::string layers =
                s.cache_layers_per_decoder_layer == 1
                    ? fmt::format("layers={}", s.num_layers)
                    : fmt::format("decoder_layers={} x {}", s.num_decoder_layers(),
                                  s.cache_layers_per_decoder_layer);
            return fmt::format(
                "ModelSpec(name='{}', {}, heads={}, kv_heads={}, head_dim={}, "
                "attention='{}', kv_dtype='{}')",
                s.name, layers, s.num_heads, s.num_kv_heads, s.head_dim,
                attention_kind_name(s.attention), dtype_name(s.kv_dtype));
        });
    py::implicitly_convertible<py::str, ModelSpec>();

    m.def("catalog_names", &catalog_names, "Names of the built-in models.");
    m.def(
        "in_catalog", [](const std::string& name) { return in_catalog(name); }, py::arg("name"));
    m.def(
        "catalog_model", [](const std::string& name) { return catalog_model(name); },
        py::arg("name"), "A built-in model; kvshard.Error lists the known names.");
    m.def("load_hf_config", &load_hf_config, py::arg("path"),
          "A model from a Hugging Face config.json (Llama, Qwen2/3, Mixtral, DeepSeek-V3 ...).");
    m.def(
        "parse_hf_config",
        [](const std::string& text, const std::string& name) {
            return parse_hf_config(text, name);
        },
        py::arg("json_text"), py::arg("name") = "config.json",
        "A model from the text of a config.json; `name` appears in error messages.");
    m.def("resolve_model", &resolve_model, py::arg("name_or_path"),
          "A catalog name, a config.json path, or a directory holding one.");

    py::class_<ParallelConfig>(m, "ParallelConfig",
                               "How a deployment is cut (dp, pp, cp, tp, ep). A value with == and "
                               "to_dict; a str such as 'tp=4,pp=2' converts through parse.")
        .def(py::init([](int tp, int pp, int cp, int dp, int ep, const std::string& cp_scheme,
                         int cp_interleave, std::vector<int> pp_layers) {
                 ParallelConfig p;
                 p.tp = tp;
                 p.pp = pp;
                 p.cp = cp;
                 p.dp = dp;
                 p.ep = ep;
                 p.cp_scheme = parse_cp_scheme(cp_scheme);
                 p.cp_interleave = cp_interleave;
                 p.pp_layers = std::move(pp_layers);
                 p.validate_sizes();
                 return p;
             }),
             py::kw_only(), py::arg("tp") = 1, py::arg("pp") = 1, py::arg("cp") = 1,
             py::arg("dp") = 1, py::arg("ep") = 1, py::arg("cp_scheme") = "contiguous",
             py::arg("cp_interleave") = 1, py::arg("pp_layers") = std::vector<int>{})
        .def(py::init([](const std::string& text) { return parse_parallel_config(text); }),
             py::arg("text"), "Parses 'tp=8,pp=2,cp=4,cp_scheme=zigzag,pp_layers=10/12/10'.")
        .def_static(
            "parse", [](const std::string& text) { return parse_parallel_config(text); },
            py::arg("text"), "Parses the CLI's layout string, e.g. 'tp=4,pp=2'.")
        .def_readonly("dp", &ParallelConfig::dp)
        .def_readonly("pp", &ParallelConfig::pp)
        .def_readonly("cp", &ParallelConfig::cp)
        .def_readonly("tp", &ParallelConfig::tp)
        .def_readonly("ep", &ParallelConfig::ep)
        .def_property_readonly(
            "cp_scheme",
            [](const ParallelConfig& p) { return std::string(cp_scheme_name(p.cp_scheme)); })
        .def_readonly("cp_interleave", &ParallelConfig::cp_interleave)
        .def_readonly("pp_layers", &ParallelConfig::pp_layers)
        .def_property_readonly("world_size", &ParallelConfig::world_size)
        .def_property_readonly("stage_size", &ParallelConfig::stage_size)
        .def(
            "rank_coord",
            [](const ParallelConfig& p, int rank) {
                require(rank >= 0 && rank < p.world_size(), "rank ", rank, " is outside [0, ",
                        p.world_size(), ")");
                return coord_dict(rank_coord(p, rank));
            },
            py::arg("rank"), "{'rank', 'dp', 'pp', 'cp', 'tp', 'ep', 'ep_group'} of a rank.")
        .def(
            "rank_of",
            [](const ParallelConfig& p, int dp, int pp, int cp, int tp) {
                require(dp >= 0 && dp < p.dp && pp >= 0 && pp < p.pp && cp >= 0 && cp < p.cp &&
                            tp >= 0 && tp < p.tp,
                        "coordinates (dp=", dp, ", pp=", pp, ", cp=", cp, ", tp=", tp,
                        ") are outside ", p.to_string());
                return rank_of(p, dp, pp, cp, tp);
            },
            py::kw_only(), py::arg("dp") = 0, py::arg("pp") = 0, py::arg("cp") = 0,
            py::arg("tp") = 0)
        .def("to_json", [](const ParallelConfig& p) { return to_json(p); })
        .def("to_dict", [](const ParallelConfig& p) { return json_loads(to_json(p)); })
        .def(py::self == py::self)
        .def("__str__", &ParallelConfig::to_string)
        .def("__repr__", &parallel_repr);
    py::implicitly_convertible<py::str, ParallelConfig>();
    m.def(
        "parse_parallel_config",
        [](const std::string& text) { return parse_parallel_config(text); }, py::arg("text"),
        "Parses the CLI's layout string, e.g. 'tp=4,pp=2'.");

    py::class_<KvLayout>(m, "KvLayout",
                         "Which KV every rank holds: a pure function of (model, parallel).")
        .def_readonly("model", &KvLayout::model)
        .def_readonly("parallel", &KvLayout::parallel)
        .def_property_readonly("world_size", &KvLayout::world_size)
        .def_property_readonly("kv_heads_per_rank", &KvLayout::kv_heads_per_rank)
        .def_property_readonly("head_replication", &KvLayout::head_replication)
        .def_property_readonly(
            "ranks",
            [](const KvLayout& l) -> py::object { return json_loads(to_json(l))["ranks"]; },
            "One dict per rank, as in `kvshard layout --json`.")
        .def(
            "request_kv_bytes",
            [](const KvLayout& l, int rank, int64_t seq_len, int block_size) {
                require(rank >= 0 && rank < l.world_size(), "rank ", rank, " is outside [0, ",
                        l.world_size(), ")");
                require(seq_len >= 0 && seq_len <= kMaxContextTokens, "seq_len must be in [0, ",
                        kMaxContextTokens, "], got ", seq_len);
                require(block_size >= 1, "block_size must be >= 1, got ", block_size);
                return request_kv_bytes(l, rank, seq_len, block_size);
            },
            py::arg("rank"), py::arg("seq_len"), py::arg("block_size") = 16,
            "Bytes `rank` holds for one request of seq_len tokens, in whole blocks.")
        .def(
            "request_kv_bytes_peak",
            [](const KvLayout& l, int rank, int64_t seq_len, int block_size) {
                require(rank >= 0 && rank < l.world_size(), "rank ", rank, " is outside [0, ",
                        l.world_size(), ")");
                require(seq_len >= 0 && seq_len <= kMaxContextTokens, "seq_len must be in [0, ",
                        kMaxContextTokens, "], got ", seq_len);
                require(block_size >= 1, "block_size must be >= 1, got ", block_size);
                return request_kv_bytes_peak(l, rank, seq_len, block_size);
            },
            py::arg("rank"), py::arg("seq_len"), py::arg("block_size") = 16)
        .def(
            "to_json", [](const KvLayout& l) { return to_json(l); },
            "The JSON of `kvshard layout --json`.")
        .def("to_dict", [](const KvLayout& l) { return json_loads(to_json(l)); })
        .def(py::self == py::self)
        .def("__repr__", [](const KvLayout& l) {
            return fmt::format("KvLayout(model='{}', parallel='{}', world_size={})", l.model.name,
                               l.parallel.to_string(), l.world_size());
        });

    m.def(
        "make_layout",
        [](const ModelSpec& model, const ParallelConfig& parallel) {
            py::gil_scoped_release release;
            return make_layout(model, parallel);
        },
        py::arg("model"), py::arg("parallel"),
        "The KV layout of a model under a parallel configuration; kvshard.Error when it is "
        "impossible (the message says what would be valid).");
    m.def(
        "validate", [](const ModelSpec& model, const ParallelConfig& p) { validate(model, p); },
        py::arg("model"), py::arg("parallel"), "Raises kvshard.Error unless the layout is valid.");
    m.def("valid_tp_sizes", &valid_tp_sizes, py::arg("model"));
    m.def("pp_layer_split", &pp_layer_split, py::arg("model"), py::arg("parallel"),
          "Decoder layers held by each PP stage.");
    m.def("pp_cache_layer_split", &pp_cache_layer_split, py::arg("model"), py::arg("parallel"),
          "Cache layers held by each PP stage (decoder layers x cache_layers_per_decoder_layer).");
    m.def(
        "pp_stage_kv_bytes",
        [](const ModelSpec& model, const ParallelConfig& p, int64_t context_tokens,
           bool allow_long_context) {
            validate(model, p);
            require(context_tokens >= 0 && context_tokens <= kMaxContextTokens,
                    "context_tokens must be in [0, ", kMaxContextTokens, "], got ", context_tokens);
            model.check_sequence_length(context_tokens, allow_long_context, "context_tokens",
                                        kAllowLongContextKwarg);
            return pp_stage_kv_bytes(model, p, context_tokens);
        },
        py::arg("model"), py::arg("parallel"), py::arg("context_tokens"), py::kw_only(),
        py::arg("allow_long_context") = false);
    m.def(
        "pp_layer_split_kv_balanced",
        [](const ModelSpec& model, const ParallelConfig& p, int64_t context_tokens,
           bool allow_long_context) {
            validate(model, p);
            require(context_tokens >= 0 && context_tokens <= kMaxContextTokens,
                    "context_tokens must be in [0, ", kMaxContextTokens, "], got ", context_tokens);
            model.check_sequence_length(context_tokens, allow_long_context, "context_tokens",
                                        kAllowLongContextKwarg);
            return pp_layer_split_kv_balanced(model, p, context_tokens);
        },
        py::arg("model"), py::arg("parallel"), py::arg("context_tokens"), py::kw_only(),
        py::arg("allow_long_context") = false);
    m.def(
        "kv_groups",
        [](const ModelSpec& model) {
            py::list out;
            for (const KvGroup& g : kv_groups(model)) {
                py::dict d;
                d["kind"] = std::string(layer_kind_name(g.kind));
                d["window"] = g.window;
                d["num_kv_heads"] = g.num_kv_heads;
                d["head_dim"] = g.head_dim;
                d["indexer"] = g.indexer;
                d["layers"] = g.layers;
                out.append(d);
            }
            return out;
        },
        py::arg("model"), "The model's KV cache groups (vLLM's KV cache groups), as dicts.");
    m.def(
        "cp_owner",
        [](const ParallelConfig& p, int64_t seq_len, int64_t pos) {
            p.validate_sizes();
            require(pos >= 0 && pos < seq_len, "pos must be in [0, seq_len=", seq_len, "), got ",
                    pos);
            return cp_owner(p, seq_len, pos);
        },
        py::arg("parallel"), py::arg("seq_len"), py::arg("pos"),
        "The CP rank that stores token `pos` of a sequence of seq_len tokens.");
    m.def(
        "cp_token_ranges",
        [](const ParallelConfig& p, int cp_rank, int64_t seq_len) {
            p.validate_sizes();
            require(cp_rank >= 0 && cp_rank < p.cp, "cp_rank must be in [0, ", p.cp, "), got ",
                    cp_rank);
            require(seq_len >= 0, "seq_len must be >= 0, got ", seq_len);
            std::vector<std::pair<int64_t, int64_t>> out;
            for (const auto& r : cp_token_ranges(p, cp_rank, seq_len))
                out.emplace_back(r.begin, r.end);
            return out;
        },
        py::arg("parallel"), py::arg("cp_rank"), py::arg("seq_len"),
        "[(begin, end), ...] of the positions a CP rank holds, ascending.");
    m.def(
        "cp_token_rule",
        [](const ParallelConfig& p, int cp_rank) {
            p.validate_sizes();
            require(cp_rank >= 0 && cp_rank < p.cp, "cp_rank must be in [0, ", p.cp, "), got ",
                    cp_rank);
            return cp_token_rule(p, cp_rank);
        },
        py::arg("parallel"), py::arg("cp_rank"));
}

}  // namespace kvshard::python
