// Context-parallel plans: ring schedules, pass-KV / pass-Q choice, decode merges, prefix reuse.
#include <nlohmann/json.hpp>

#include "bindings.h"
#include "kvshard/common/checked.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/layout/kv_layout.h"

namespace kvshard::python {

namespace {

py::dict choice_dict(const CpPrefillChoice& c) {
    py::dict d;
    d["mode"] = std::string(cp_prefill_mode_name(c.mode));
    d["new_fraction"] = c.new_fraction;
    d["threshold"] = c.threshold;
    d["pass_kv_bytes"] = c.pass_kv_bytes;
    d["pass_q_bytes"] = c.pass_q_bytes;
    return d;
}

}  // namespace

void bind_cp(py::module_& m) {
    m.def(
        "cp_plan",
        [](const ModelSpec& model, const ParallelConfig& p, int64_t cached, int64_t fresh,
           int block_size, int reuse_from, bool allow_long_context) {
            // The CLI's --allow-long-context.
            model.check_computed_length(sat_add(cached, fresh), allow_long_context,
                                        detail::concat("cached ", cached, " + new ", fresh),
                                        kAllowLongContextKwarg);
            std::string json;
            {
                py::gil_scoped_release release;
                json = cp_plan_report_json(model, p, cached, fresh, block_size, reuse_from);
            }
            return json_loads(json);
        },
        py::arg("model"), py::arg("parallel"), py::arg("cached"), py::arg("new"), py::kw_only(),
        py::arg("block_size") = 16, py::arg("reuse_from") = 0,
        py::arg("allow_long_context") = false,
        "One request under CP (cached + new tokens): the dict of `kvshard cp-plan --json`. "
        "Raises kvshard.Error when cached + new exceeds the model's max_model_len, unless "
        "allow_long_context.");
    m.def(
        "choose_cp_prefill",
        [](const KvLayout& l, int64_t cached, int64_t fresh) {
            require(cached >= 0 && fresh >= 1, "need cached >= 0 and fresh >= 1, got ", cached,
                    " and ", fresh);
            return choice_dict(choose_cp_prefill(l, cached, fresh));
        },
        py::arg("layout"), py::arg("cached"), py::arg("fresh"),
        "pass-KV or pass-Q for a prefill of `fresh` tokens after `cached` ones, with the bytes.");
    m.def("cp_pass_q_threshold", &cp_pass_q_threshold, py::arg("layout"));
    m.def(
        "cp_ring_schedule",
        [](int cp, int cp_rank) {
            require(cp >= 1 && cp_rank >= 0 && cp_rank < cp, "need 0 <= cp_rank < cp, got cp=", cp,
                    " cp_rank=", cp_rank);
            py::list out;
            for (const auto& s : cp_ring_schedule(cp, cp_rank)) {
                py::dict d;
                d["step"] = s.step;
                d["holds"] = s.holds;
                d["sends"] = s.sends;
                d["receives"] = s.receives;
                out.append(d);
            }
            return out;
        },
        py::arg("cp"), py::arg("cp_rank"), "The KV ring's steps on one CP rank, as dicts.");
    m.def(
        "cp_token_count",
        [](const ParallelConfig& p, int cp_rank, int64_t n) {
            p.validate_sizes();
            require(cp_rank >= 0 && cp_rank < p.cp, "cp_rank must be in [0, ", p.cp, "), got ",
                    cp_rank);
            require(n >= 0, "n must be >= 0, got ", n);
            return cp_token_count(p, cp_rank, n);
        },
        py::arg("parallel"), py::arg("cp_rank"), py::arg("n"),
        "Tokens of an n-token prompt that CP rank cp_rank holds.");
    m.def(
        "cp_helix_heads",
        [](int num_heads, int cp, int cp_rank) {
            require(num_heads >= 1 && cp >= 1 && cp_rank >= 0 && cp_rank < cp,
                    "need num_heads >= 1 and 0 <= cp_rank < cp, got ", num_heads, ", ", cp, ", ",
                    cp_rank);
            const TokenRange r = cp_helix_heads(num_heads, cp, cp_rank);
            return std::pair<int64_t, int64_t>(r.begin, r.end);
        },
        py::arg("num_heads"), py::arg("cp"), py::arg("cp_rank"),
        "(begin, end) of the heads a CP rank merges under the Helix all-to-all.");
    m.def(
        "cp_decode_merge_bytes",
        [](const KvLayout& l, int rank, const std::string& merge) {
            require(rank >= 0 && rank < l.world_size(), "rank ", rank, " is outside [0, ",
                    l.world_size(), ")");
            return cp_decode_merge_bytes(l, rank, parse_cp_decode_merge(merge));
        },
        py::arg("layout"), py::arg("rank"), py::arg("merge") = "all-gather");
    m.def(
        "plan_cp_prefix_reuse",
        [](int src_cp, int dst_cp, int64_t blocks) {
            return json_loads(to_json(plan_cp_prefix_reuse(src_cp, dst_cp, blocks)));
        },
        py::arg("src_cp"), py::arg("dst_cp"), py::arg("blocks"),
        "Which cached prefix blocks move when a request continues under another CP size.");
}

}  // namespace kvshard::python
