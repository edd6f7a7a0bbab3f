// Transfer plans between two layouts (prefill -> decode) and their transfer descriptors.
#include <fmt/format.h>

#include <optional>

#include "bindings.h"
#include "kvshard/transfer/descriptors.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard::python {

namespace {

using BlockTables = std::vector<std::vector<int32_t>>;

TransferEndpoint endpoint(const char* side, const KvLayout& layout, int dp, int block_size,
                          const std::string& order, std::optional<BlockTables> tables,
                          int64_t num_tokens) {
    require(block_size >= 1, side, "_block_size must be at least 1 token, got ", block_size);
    require(num_tokens >= 1 && num_tokens <= kMaxTransferTokens, "num_tokens must be in [1, ",
            kMaxTransferTokens, "], got ", num_tokens);
    TransferEndpoint e;
    e.layout = layout;
    e.dp = dp;
    e.block_size = block_size;
    e.order = parse_page_order(order);
    e.block_tables =
        tables ? std::move(*tables) : sequential_block_tables(layout, block_size, num_tokens);
    return e;
}

// The blocks of each pool of one side: what its longest block table needs (as the CLI).
int64_t pool_blocks(const TransferEndpoint& e) {
    int64_t n = 1;
    for (const auto& t : e.block_tables) {
        n = std::max<int64_t>(n, static_cast<int64_t>(t.size()));
        for (int32_t b : t) n = std::max<int64_t>(n, int64_t{b} + 1);
    }
    return n;
}

}  // namespace

void bind_transfer(py::module_& m) {
    // The numpy dtypes of descriptors(), field for field (offsets and padding as in C++).
    PYBIND11_NUMPY_DTYPE(TransferDescriptor, src_rank, dst_rank, layer_group, src_offset,
                         dst_offset, bytes);
    PYBIND11_NUMPY_DTYPE(TransferPiece, token_begin, count, src_block, src_slot, dst_block,
                         dst_slot);
    PYBIND11_NUMPY_DTYPE(DescriptorGroup, src_rank, dst_rank, layer_group, first, count, bytes);

    py::class_<TransferPlan>(m, "TransferPlan",
                             "Which bytes move from which source rank to which destination rank "
                             "when a request's KV goes from one layout to another.")
        .def_readonly("num_tokens", &TransferPlan::num_tokens)
        .def_readonly("bytes", &TransferPlan::bytes, "Sum of the message payloads.")
        .def_readonly("min_bytes", &TransferPlan::min_bytes,
                      "The least any plan must move (each needed byte once).")
        .def_readonly("num_layer_groups", &TransferPlan::num_layer_groups)
        .def_readonly("kv_factor", &TransferPlan::kv_factor)
        .def_readonly("head_dim", &TransferPlan::head_dim)
        .def_readonly("elem_size", &TransferPlan::elem_size)
        .def_property_readonly("num_messages",
                               [](const TransferPlan& p) { return p.messages.size(); })
        .def_property_readonly("src_layout", [](const TransferPlan& p) { return p.src.layout; })
        .def_property_readonly("dst_layout", [](const TransferPlan& p) { return p.dst.layout; })
        .def("executable", &TransferPlan::executable,
             "True when pack/unpack can carry the plan out (one KV group).")
        .def("messages_from", &TransferPlan::messages_from, py::arg("src_rank"))
        .def("messages_to", &TransferPlan::messages_to, py::arg("dst_rank"))
        .def(
            "messages",
            [](const TransferPlan& p) -> py::object {
                return json_loads(to_json(p, true))["message_list"];
            },
            "One dict per message (ranks, layer and head ranges, piece count, bytes), as the "
            "'message_list' of `kvshard transfer-plan --messages --json`.")
        .def(
            "pieces",
            [](const TransferPlan& p, int message) {
                require(message >= 0 && message < static_cast<int>(p.messages.size()), "message ",
                        message, " is outside [0, ", p.messages.size(), ")");
                const auto& v = p.messages[static_cast<size_t>(message)].pieces;
                return py::array_t<TransferPiece>(static_cast<py::ssize_t>(v.size()), v.data());
            },
            py::arg("message"),
            "The token runs of one message: a structured array of token_begin, count, src_block, "
            "src_slot, dst_block, dst_slot.")
        .def(
            "needed_bytes",
            [](const TransferPlan& p, int dst_rank) {
                require(dst_rank >= 0 && dst_rank < p.dst.layout.world_size(), "dst_rank ",
                        dst_rank, " is outside [0, ", p.dst.layout.world_size(), ")");
                return needed_bytes(p, dst_rank);
            },
            py::arg("dst_rank"), "Bytes destination rank dst_rank must receive.")
        .def("tail_bytes", [](const TransferPlan& p) { return tail_bytes(p); })
        .def(
            "mode",
            [](const TransferPlan& p, const std::string& mode) {
                require_executable(p, "a plan of several KV groups has no copy mode");
                return std::string(transfer_mode_name(resolve_mode(p, parse_transfer_mode(mode))));
            },
            py::arg("mode") = "auto", "pre-send or post-receive (auto: fewer memcpy calls).")
        .def(
            "copy_counts",
            [](const TransferPlan& p, const std::string& mode) {
                require_executable(p, "a plan of several KV groups has no copy count");
                const CopyCounts c = count_copies(p, resolve_mode(p, parse_transfer_mode(mode)));
                py::dict d;
                d["pack"] = c.pack;
                d["unpack"] = c.unpack;
                return d;
            },
            py::arg("mode") = "auto", "memcpy calls of packing and unpacking the whole plan.")
        .def(
            "to_json", [](const TransferPlan& p, bool messages) { return to_json(p, messages); },
            py::arg("messages") = false, "The JSON of `kvshard transfer-plan --json [--messages]`.")
        .def(
            "to_dict",
            [](const TransferPlan& p, bool messages) { return json_loads(to_json(p, messages)); },
            py::arg("messages") = false)
        .def("__repr__", [](const TransferPlan& p) {
            return fmt::format("TransferPlan('{}' {} -> {}, tokens={}, messages={}, bytes={})",
                               p.src.layout.model.name, p.src.layout.parallel.to_string(),
                               p.dst.layout.parallel.to_string(), p.num_tokens, p.messages.size(),
                               p.bytes);
        });

    m.def(
        "transfer_plan",
        [](const KvLayout& src, const KvLayout& dst, int64_t num_tokens, int src_block_size,
           int dst_block_size, const std::string& src_order, const std::string& dst_order,
           int src_dp, int dst_dp, std::optional<BlockTables> src_block_tables,
           std::optional<BlockTables> dst_block_tables, int layers_per_message,
           int64_t dst_cached_tokens, bool allow_long_context) {
            // The CLI's --allow-long-context (one model on both sides: make_transfer_plan checks).
            src.model.check_computed_length(num_tokens, allow_long_context, "num_tokens",
                                            kAllowLongContextKwarg);
            py::gil_scoped_release release;
            const TransferEndpoint s = endpoint("src", src, src_dp, src_block_size, src_order,
                                                std::move(src_block_tables), num_tokens);
            const TransferEndpoint d = endpoint("dst", dst, dst_dp, dst_block_size, dst_order,
                                                std::move(dst_block_tables), num_tokens);
            return make_transfer_plan(
                s, d, num_tokens,
                {.layers_per_group = layers_per_message, .dst_cached_tokens = dst_cached_tokens});
        },
        py::arg("src"), py::arg("dst"), py::arg("num_tokens"), py::kw_only(),
        py::arg("src_block_size") = 16, py::arg("dst_block_size") = 16,
        py::arg("src_order") = "hnd", py::arg("dst_order") = "hnd", py::arg("src_dp") = 0,
        py::arg("dst_dp") = 0, py::arg("src_block_tables") = py::none(),
        py::arg("dst_block_tables") = py::none(), py::arg("layers_per_message") = 0,
        py::arg("dst_cached_tokens") = 0, py::arg("allow_long_context") = false,
        "The plan that moves a request of num_tokens tokens from layout `src` (prefill) to `dst` "
        "(decode). Block tables: one int sequence per CP rank of the side's replica, entry j the "
        "block of that rank's j-th block of tokens; None: blocks 0, 1, 2, ... as the CLI. Raises "
        "kvshard.Error when num_tokens exceeds the model's max_model_len, "
        "unless allow_long_context.");

    py::class_<TransferDescriptors>(m, "TransferDescriptors",
                                    "The (src offset, dst offset, bytes) copies that carry a plan "
                                    "out pool to pool, NIXL / Mooncake style.")
        .def_readonly("descriptor_count", &TransferDescriptors::descriptor_count,
                      "Pool-to-pool descriptors: runs contiguous on both sides (all counted).")
        .def_readonly("bytes", &TransferDescriptors::bytes)
        .def_readonly("per_block_descriptor_count",
                      &TransferDescriptors::per_block_descriptor_count)
        .def_readonly("pre_send_count", &TransferDescriptors::pre_send_count)
        .def_readonly("post_receive_count", &TransferDescriptors::post_receive_count)
        .def_readonly("pages_differ", &TransferDescriptors::pages_differ)
        .def_property_readonly("fewer_mode",
                               [](const TransferDescriptors& d) {
                                   return std::string(transfer_mode_name(d.fewer_mode));
                               })
        .def_property_readonly(
            "descriptors",
            [](const TransferDescriptors& d) {
                return py::array_t<TransferDescriptor>(
                    static_cast<py::ssize_t>(d.descriptors.size()), d.descriptors.data());
            },
            "The listed descriptors: a numpy structured array with fields src_rank, dst_rank, "
            "layer_group, src_offset, dst_offset, bytes (byte offsets into the ranks' pools).")
        .def_property_readonly(
            "groups",
            [](const TransferDescriptors& d) {
                return py::array_t<DescriptorGroup>(static_cast<py::ssize_t>(d.groups.size()),
                                                    d.groups.data());
            },
            "Per (src_rank, dst_rank, layer_group): first, count, bytes, as a structured array.")
        .def(
            "to_json", [](const TransferDescriptors& d) { return to_json(d); },
            "The descriptor part of `kvshard transfer-plan --descriptors --json`.")
        .def("to_dict", [](const TransferDescriptors& d) { return json_loads(to_json(d)); })
        .def("__repr__", [](const TransferDescriptors& d) {
            return fmt::format("TransferDescriptors(count={}, listed={}, bytes={})",
                               d.descriptor_count, d.descriptors.size(), d.bytes);
        });

    m.def(
        "transfer_descriptors",
        [](const TransferPlan& plan, int64_t max_listed, std::optional<int64_t> src_pool_blocks,
           std::optional<int64_t> dst_pool_blocks) {
            require(max_listed >= -1, "max_listed must be -1 (all) or at least 0, got ",
                    max_listed);
            py::gil_scoped_release release;
            const int64_t sb = src_pool_blocks.value_or(pool_blocks(plan.src));
            const int64_t db = dst_pool_blocks.value_or(pool_blocks(plan.dst));
            require(sb >= 1 && db >= 1, "pool sizes must be at least 1 block, got ", sb, " and ",
                    db);
            return make_transfer_descriptors(plan, side_pool_regions(plan, true, sb),
                                             side_pool_regions(plan, false, db),
                                             {.max_listed = max_listed});
        },
        py::arg("plan"), py::kw_only(), py::arg("max_listed") = -1,
        py::arg("src_pool_blocks") = py::none(), py::arg("dst_pool_blocks") = py::none(),
        "Descriptors of a plan between pools of src_pool_blocks / dst_pool_blocks blocks at base "
        "0 (None: what the block tables need). max_listed: -1 lists all, else the first ones.");
}

}  // namespace kvshard::python
