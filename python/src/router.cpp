// The router: its prefix index over replicas and the routing policies.
#include <fmt/format.h>

#include "bindings.h"
#include "kvshard/router/kv_index.h"
#include "kvshard/router/policy.h"

namespace kvshard::python {

namespace {

py::dict decision_dict(const RouteDecision& d) {
    py::dict out;
    out["replica"] = d.replica;
    out["matched_blocks"] = d.matched_blocks;
    out["reason"] = std::string(route_reason_name(d.reason));
    return out;
}

std::vector<ReplicaLoad> loads_of(const std::optional<std::vector<ReplicaLoad>>& loads, int n) {
    if (!loads) return std::vector<ReplicaLoad>(static_cast<size_t>(n));
    require(static_cast<int>(loads->size()) == n, "loads has ", loads->size(),
            " entries; one per replica (", n, ") is needed");
    return *loads;
}

}  // namespace

void bind_router(py::module_& m) {
    m.def("routing_policy_names", [] {
        std::vector<std::string> out;
        for (RoutingPolicy p : all_routing_policies()) out.emplace_back(routing_policy_name(p));
        return out;
    });
    m.def("vllm_max_cache_hit_blocks", &vllm_max_cache_hit_blocks, py::arg("num_tokens"),
          py::arg("block_tokens"),
          "The most leading blocks of a prompt vLLM takes from its prefix cache: (num_tokens - 1) "
          "// block_tokens (it recomputes the last token).");
    m.def("vllm_eagle_block_drop", &vllm_eagle_block_drop, py::arg("method"),
          "Whether a vLLM engine speculating with this --speculative-config method drops the last "
          "matched block of each prefix-cache hit (eagle, eagle3, mtp); ValueError for a method "
          "vLLM does not have.");

    py::class_<ReplicaLoad>(m, "ReplicaLoad", "What a replica is busy with, as the router sees it.")
        .def(py::init(
                 [](int64_t queued_prefill_tokens, int64_t active_blocks, int64_t capacity_blocks) {
                     return ReplicaLoad{queued_prefill_tokens, active_blocks, capacity_blocks};
                 }),
             py::kw_only(), py::arg("queued_prefill_tokens") = 0, py::arg("active_blocks") = 0,
             py::arg("capacity_blocks") = 0)
        .def_readwrite("queued_prefill_tokens", &ReplicaLoad::queued_prefill_tokens)
        .def_readwrite("active_blocks", &ReplicaLoad::active_blocks)
        .def_readwrite("capacity_blocks", &ReplicaLoad::capacity_blocks)
        .def(py::self == py::self)
        .def("__repr__", [](const ReplicaLoad& l) {
            return fmt::format(
                "ReplicaLoad(queued_prefill_tokens={}, active_blocks={}, capacity_blocks={})",
                l.queued_prefill_tokens, l.active_blocks, l.capacity_blocks);
        });

    py::class_<PolicyParams>(m, "PolicyParams", "Knobs of the routing policies (policy.h).")
        .def(py::init([](py::kwargs kw) {
            PolicyParams p;
            py::object o = py::cast(&p, py::return_value_policy::reference);
            for (auto item : kw) {
                const auto key = item.first.cast<std::string>();
                require(py::hasattr(o, key.c_str()), "PolicyParams has no field '", key, "'");
                o.attr(key.c_str()) = item.second;
            }
            p.validate();
            return p;
        }))
        .def_readwrite("block_tokens", &PolicyParams::block_tokens)
        .def_readwrite("cache_threshold", &PolicyParams::cache_threshold)
        .def_readwrite("balance_abs_threshold", &PolicyParams::balance_abs_threshold)
        .def_readwrite("balance_rel_threshold", &PolicyParams::balance_rel_threshold)
        .def_readwrite("overlap_weight", &PolicyParams::overlap_weight)
        .def_readwrite("load_slack", &PolicyParams::load_slack)
        .def_readwrite("load_headroom_tokens", &PolicyParams::load_headroom_tokens)
        .def_readwrite("prefill_weight", &PolicyParams::prefill_weight)
        .def_readwrite("affinity_blocks", &PolicyParams::affinity_blocks)
        .def_readwrite("min_gain_blocks", &PolicyParams::min_gain_blocks)
        .def("validate", &PolicyParams::validate);

    py::class_<KvIndex>(m, "KvIndex",
                        "Which replica holds which block hash (exact from KV events, or "
                        "approximate from routing decisions with a TTL).")
        .def(py::init([](int num_replicas, const std::string& mode, double ttl_s) {
                 require(num_replicas >= 1 && num_replicas <= KvIndex::kMaxReplicas,
                         "num_replicas must be in [1, ", KvIndex::kMaxReplicas, "], got ",
                         num_replicas);
                 return KvIndex(num_replicas, parse_kv_index_mode(mode), ttl_s);
             }),
             py::arg("num_replicas"), py::arg("mode") = "exact", py::arg("ttl_s") = 120.0)
        .def_property_readonly("num_replicas", &KvIndex::num_replicas)
        .def_property_readonly(
            "mode", [](const KvIndex& i) { return std::string(kv_index_mode_name(i.mode())); })
        .def(
            "block_stored",
            [](KvIndex& i, int replica, const py::object& hashes, int group) {
                i.block_stored(replica, hashes_from(hashes), group);
            },
            py::arg("replica"), py::arg("hashes"), py::arg("group") = 0,
            "group: the KV cache group (hybrid models; vLLM's group_idx).")
        .def(
            "block_removed",
            [](KvIndex& i, int replica, const py::object& hashes, int group) {
                i.block_removed(replica, hashes_from(hashes), group);
            },
            py::arg("replica"), py::arg("hashes"), py::arg("group") = 0)
        .def("set_group_window", &KvIndex::set_group_window, py::arg("replica"), py::arg("group"),
             py::arg("window_blocks"),
             "The group serves a prefix when its last window_blocks blocks before it are held.")
        .def("set_group_full", &KvIndex::set_group_full, py::arg("replica"), py::arg("group"))
        .def("set_group_block_scale", &KvIndex::set_group_block_scale, py::arg("replica"),
             py::arg("group"), py::arg("scale"),
             "The group's blocks are `scale` router blocks (vLLM's hash_block_size): its block j "
             "is the request's hash (j + 1) * scale - 1.")
        .def("group_block_scale", &KvIndex::group_block_scale, py::arg("replica"), py::arg("group"))
        .def("set_eagle_block_drop", &KvIndex::set_eagle_block_drop, py::arg("replica"),
             py::arg("on"),
             "The replica's engine drafts with EAGLE/MTP: its overlaps lose the last matched block "
             "(per group, as vLLM's find_longest_cache_hit with drop_eagle_block).")
        .def("eagle_block_drop", &KvIndex::eagle_block_drop, py::arg("replica"))
        .def("all_cleared", &KvIndex::all_cleared, py::arg("replica"))
        .def(
            "apply",
            [](KvIndex& i, int replica, const py::object& event) {
                const std::string line =
                    py::isinstance<py::str>(event) ? event.cast<std::string>() : json_dumps(event);
                i.apply(replica, kv_event_from_json(line));
            },
            py::arg("replica"), py::arg("event"), "A KV event (dict or JSON line) of a replica.")
        .def(
            "record_routed",
            [](KvIndex& i, int replica, const py::object& hashes, double now_s) {
                i.record_routed(replica, hashes_from(hashes), now_s);
            },
            py::arg("replica"), py::arg("hashes"), py::arg("now_s"))
        .def("expire", &KvIndex::expire, py::arg("now_s"))
        .def(
            "prefix_overlap",
            [](const KvIndex& i, const py::object& hashes) {
                std::vector<int> out(static_cast<size_t>(i.num_replicas()));
                i.prefix_overlap(hashes_from(hashes), out);
                return out;
            },
            py::arg("hashes"), "Leading blocks of the request each replica holds.")
        .def(
            "contains",
            [](const KvIndex& i, int replica, const std::string& h, int group) {
                return i.contains(replica, BlockHash::from_hex(h), group);
            },
            py::arg("replica"), py::arg("hash"), py::arg("group") = 0)
        .def(
            "num_blocks",
            [](const KvIndex& i, int replica) {
                require(replica >= 0 && replica < i.num_replicas(), "replica ", replica,
                        " is outside [0, ", i.num_replicas(), ")");
                return i.num_blocks(replica);
            },
            py::arg("replica"))
        .def_property_readonly("num_hashes", &KvIndex::num_hashes);

    py::class_<Router>(m, "Router", "A routing policy over a KvIndex of num_replicas replicas.")
        .def(
            py::init([](int num_replicas, const std::string& policy,
                        std::optional<PolicyParams> params, const std::string& mode, double ttl_s) {
                require(num_replicas >= 1 && num_replicas <= KvIndex::kMaxReplicas,
                        "num_replicas must be in [1, ", KvIndex::kMaxReplicas, "], got ",
                        num_replicas);
                const PolicyParams p = params.value_or(PolicyParams{});
                p.validate();
                return std::make_unique<Router>(num_replicas, parse_routing_policy(policy), p,
                                                parse_kv_index_mode(mode), ttl_s);
            }),
            py::arg("num_replicas"), py::arg("policy") = "kvshard", py::arg("params") = py::none(),
            py::arg("mode") = "exact", py::arg("ttl_s") = 120.0)
        .def_property_readonly("num_replicas", &Router::num_replicas)
        .def_property_readonly(
            "policy", [](const Router& r) { return std::string(routing_policy_name(r.policy())); })
        .def_property_readonly(
            "index", [](Router& r) -> KvIndex& { return r.index(); },
            py::return_value_policy::reference_internal)
        .def(
            "route",
            [](Router& r, const py::object& block_hashes, int64_t num_tokens,
               std::optional<std::vector<ReplicaLoad>> loads, double now_s) {
                const auto hashes = hashes_from(block_hashes);
                const auto l = loads_of(loads, r.num_replicas());
                return decision_dict(
                    r.route({.block_hashes = hashes, .num_tokens = num_tokens}, l, now_s));
            },
            py::arg("block_hashes"), py::arg("num_tokens"), py::arg("loads") = py::none(),
            py::arg("now_s") = 0.0,
            "{'replica', 'matched_blocks', 'reason'} for a request; loads: one ReplicaLoad per "
            "replica (None: all idle).");

    m.def(
        "decide_route",
        [](const std::string& policy, const py::object& block_hashes, int64_t num_tokens,
           const std::vector<int>& overlap, std::optional<std::vector<ReplicaLoad>> loads,
           std::optional<PolicyParams> params, uint64_t rr_counter) {
            const auto hashes = hashes_from(block_hashes);
            require(!overlap.empty(), "overlap needs one entry per replica");
            const auto l = loads_of(loads, static_cast<int>(overlap.size()));
            const PolicyParams p = params.value_or(PolicyParams{});
            p.validate();
            return decision_dict(decide_route(parse_routing_policy(policy), p,
                                              {.block_hashes = hashes, .num_tokens = num_tokens},
                                              overlap, l, rr_counter));
        },
        py::arg("policy"), py::arg("block_hashes"), py::arg("num_tokens"), py::arg("overlap"),
        py::arg("loads") = py::none(), py::arg("params") = py::none(), py::arg("rr_counter") = 0,
        "A policy's pure decision given each replica's prefix overlap and load.");
}

}  // namespace kvshard::python
