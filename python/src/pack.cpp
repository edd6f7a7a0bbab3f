// Packing a transfer plan's messages from and into KV pools held in numpy arrays.
//
// A rank's pool is the BlockPool arena: pages in (layer, kv, block) order, each page
// [heads, block_size, head_dim] (HND) or [block_size, heads, head_dim] (NHD). So a C-contiguous
// array of shape [num_layers, kv_factor, num_blocks, heads, block_size, head_dim] (HND) of the KV
// dtype is a pool; any C-contiguous array of the same bytes works. A 64-byte aligned array is the
// pool itself (a BlockPool over ExternalMemory: zero copy, written in place); any other is copied
// into a BlockPool and back. pool_array makes such an aligned array (numpy's own large arrays
// start 16 bytes past a page boundary, so they would take the copy), and pack_message(out=...)
// packs into the caller's payload buffer: a fresh 64 MiB array per call costs its page faults,
// about as much as the pack itself (BENCHMARKS.md, "python").
#include <cstdint>
#include <cstring>
#include <vector>

#include "bindings.h"
#include "kvshard/common/dtype.h"
#include "kvshard/serve/engine_prefill.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard::python {

namespace {

const TransferMessage& message_of(const TransferPlan& plan, int message) {
    require(message >= 0 && message < static_cast<int>(plan.messages.size()), "message ", message,
            " is outside [0, ", plan.messages.size(), ")");
    return plan.messages[static_cast<size_t>(message)];
}

TransferMode mode_of(const TransferPlan& plan, const std::string& mode) {
    require_executable(plan,
                       "a plan of several KV groups cannot be packed; pack each group's plan "
                       "(group_transfer_plan)");
    return resolve_mode(plan, parse_transfer_mode(mode));
}

PageGeometry side_geometry(const TransferPlan& plan, bool source, int rank) {
    const TransferEndpoint& e = source ? plan.src : plan.dst;
    const PageGeometry g = rank_page_geometry(e.layout, rank, e.block_size, e.order);
    require(g.dtype != DType::kFp8,
            "fp8 pools carry per-block scales that pack_message does not move; pack bf16, fp16 "
            "or fp32 KV");
    return g;
}

// A BlockPool over `array` (64-byte aligned) or holding a copy of it; its bytes must be whole
// blocks of geometry g.
BlockPool pool_of(const PageGeometry& g, const py::array& array, const char* what) {
    require(array.flags() & py::array::c_style, what, " must be C-contiguous");
    const auto bytes = static_cast<int64_t>(array.nbytes());
    require(bytes > 0 && bytes % g.block_bytes() == 0, what, " holds ", bytes,
            " bytes; a pool of this rank is a whole number of blocks of ", g.block_bytes(),
            " bytes (num_layers ", g.num_layers, " x kv ", g.kv_factor, " x heads ", g.num_heads,
            " x block_size ", g.block_size, " x head_dim ", g.head_dim, " x ", g.elem_size(),
            " B)");
    auto* base = static_cast<std::byte*>(const_cast<void*>(array.data()));
    if (reinterpret_cast<uintptr_t>(base) % 64 == 0)
        return BlockPool(g, bytes / g.block_bytes(),
                         ExternalMemory{base, static_cast<size_t>(bytes)});
    BlockPool pool(g, bytes / g.block_bytes());
    std::memcpy(pool.arena().data(), array.data(), static_cast<size_t>(bytes));
    return pool;
}

// numpy's type for the KV elements of g (numpy has no bfloat16: bf16 pools hold uint16 bit
// patterns; fp8 pools uint8 codes).
py::dtype numpy_dtype(const PageGeometry& g) {
    switch (g.dtype) {
        case DType::kFp32:
            return py::dtype::of<float>();
        case DType::kFp16:
            return py::dtype("float16");
        case DType::kBf16:
            return py::dtype::of<uint16_t>();
        case DType::kFp8:
            return py::dtype::of<uint8_t>();
    }
    return py::dtype::of<uint8_t>();
}

// The shape of a pool array of num_blocks blocks of g (HND or NHD pages).
std::vector<py::ssize_t> pool_shape(const PageGeometry& g, int64_t num_blocks) {
    const bool hnd = g.order == PageOrder::kHnd;
    return {g.num_layers,
            g.kv_factor,
            static_cast<py::ssize_t>(num_blocks),
            hnd ? g.num_heads : g.block_size,
            hnd ? g.block_size : g.num_heads,
            g.head_dim};
}

// The payload buffer of msg: `out` when given (written in place), else a new uint8 array.
py::array payload_of(const TransferMessage& msg, const py::object& out) {
    if (out.is_none()) return py::array_t<uint8_t>(static_cast<py::ssize_t>(msg.bytes));
    require(py::isinstance<py::array>(out), "out must be a numpy array (or None)");
    auto a = py::reinterpret_borrow<py::array>(out);
    require(a.flags() & py::array::c_style, "out must be C-contiguous");
    require(a.writeable(), "out must be writeable");
    require(static_cast<int64_t>(a.nbytes()) == msg.bytes, "out holds ", a.nbytes(),
            " bytes; the message carries ", msg.bytes);
    return a;
}

py::dict geometry_dict(const PageGeometry& g) {
    py::dict d;
    d["num_layers"] = g.num_layers;
    d["kv_factor"] = g.kv_factor;
    d["num_heads"] = g.num_heads;
    d["block_size"] = g.block_size;
    d["head_dim"] = g.head_dim;
    d["dtype"] = std::string(dtype_name(g.dtype));
    d["order"] = g.order == PageOrder::kHnd ? "hnd" : "nhd";
    d["page_bytes"] = g.page_bytes();
    d["block_bytes"] = g.block_bytes();
    return d;
}

// The caller's memory of one pool: a C-contiguous, writeable, 64-byte aligned array (written in
// place: a copy would leave the caller's array unwritten, so any other is refused).
ExternalMemory memory_of(const py::handle& h, int rank) {
    require(py::isinstance<py::array>(h), "pools[", rank,
            "] must be a numpy array (or a list of them, one per KV group the rank holds)");
    auto a = py::reinterpret_borrow<py::array>(h);
    require(a.flags() & py::array::c_style, "pools[", rank, "] must be C-contiguous");
    require(a.writeable(), "pools[", rank, "] must be writeable");
    auto* base = static_cast<std::byte*>(a.mutable_data());
    require(reinterpret_cast<uintptr_t>(base) % 64 == 0, "pools[", rank,
            "] must start on a 64-byte boundary (the prefill writes it in place): make it with "
            "kvshard.pool_array");
    return ExternalMemory{base, static_cast<size_t>(a.nbytes())};
}

py::array_t<float> logits_array(const std::vector<float>& v) {
    py::array_t<float> out(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

}  // namespace

void bind_pack(py::module_& m) {
    m.def(
        "prefill_into",
        [](const KvLayout& layout, const TokenArray& tokens, const TokenArray& block_table,
           const py::list& pools, int block_size, const std::string& order, uint64_t seed) {
            std::vector<std::vector<ExternalMemory>> mem;
            std::vector<py::object> keep;  // the arrays stay alive (and unchanged) meanwhile
            for (size_t r = 0; r < pools.size(); ++r) {
                const py::handle h = pools[r];
                std::vector<ExternalMemory> rank;
                if (py::isinstance<py::list>(h) || py::isinstance<py::tuple>(h)) {
                    for (const py::handle x : h) rank.push_back(memory_of(x, int(r)));
                } else {
                    rank.push_back(memory_of(h, int(r)));
                }
                keep.push_back(py::reinterpret_borrow<py::object>(h));
                mem.push_back(std::move(rank));
            }
            const EnginePrefillOptions opt{.block_size = block_size,
                                           .order = parse_page_order(order)};
            const auto weights = random_tensor_source(seed);
            std::vector<float> logits;
            {
                py::gil_scoped_release release;
                logits = prefill_into_memory(layout, *weights, token_span(tokens),
                                             token_span(block_table), mem, opt);
            }
            return logits_array(logits);
        },
        py::arg("layout"), py::arg("tokens"), py::arg("block_table"), py::arg("pools"),
        py::kw_only(), py::arg("block_size") = 16, py::arg("order") = "hnd", py::arg("seed") = 1,
        "The reference model's prefill of `tokens` under `layout` (dp=1, cp=1; random weights of "
        "`seed`, as `kvshard run --seed`), each rank's KV written in place into the caller's pool "
        "arrays: pools[r] is rank r's pool (a 64-byte aligned C-contiguous array of whole blocks, "
        "e.g. kvshard.pool_array of a transfer plan whose source is this layout; a list of them "
        "for a rank holding several KV groups), block_table the sequence's blocks (the same on "
        "every rank). Only the named blocks' written slots change. Returns the last token's "
        "[vocab] logits.");
    m.def(
        "prefill_own_pools",
        [](const KvLayout& layout, const TokenArray& tokens, const TokenArray& block_table,
           int64_t num_blocks, int block_size, const std::string& order, uint64_t seed) {
            const EnginePrefillOptions opt{.block_size = block_size,
                                           .order = parse_page_order(order)};
            const auto weights = random_tensor_source(seed);
            std::vector<std::vector<std::vector<std::byte>>> pools;
            std::vector<float> logits;
            {
                py::gil_scoped_release release;
                logits = prefill_into_own_pools(layout, *weights, token_span(tokens),
                                                token_span(block_table), num_blocks, pools, opt);
            }
            py::list out;
            for (const auto& rank : pools) {
                py::list rl;
                for (const auto& bytes : rank) {
                    py::array_t<uint8_t> a(static_cast<py::ssize_t>(bytes.size()));
                    std::memcpy(a.mutable_data(), bytes.data(), bytes.size());
                    rl.append(a);
                }
                out.append(rl);
            }
            return py::make_tuple(logits_array(logits), out);
        },
        py::arg("layout"), py::arg("tokens"), py::arg("block_table"), py::arg("num_blocks"),
        py::kw_only(), py::arg("block_size") = 16, py::arg("order") = "hnd", py::arg("seed") = 1,
        "The same prefill as prefill_into on kvshard's own pools of num_blocks blocks: returns "
        "(logits, pools), pools[r][i] the bytes (uint8) of rank r's pool i after it.");
    m.def(
        "pool_geometry",
        [](const TransferPlan& plan, bool source, int rank) {
            const KvLayout& l = source ? plan.src.layout : plan.dst.layout;
            require(rank >= 0 && rank < l.world_size(), "rank ", rank, " is outside [0, ",
                    l.world_size(), ")");
            const TransferEndpoint& e = source ? plan.src : plan.dst;
            return geometry_dict(rank_page_geometry(e.layout, rank, e.block_size, e.order));
        },
        py::arg("plan"), py::arg("source"), py::arg("rank"),
        "The page geometry of a rank's pool on one side of a plan: a pool array has shape "
        "[num_layers, kv_factor, num_blocks, num_heads, block_size, head_dim] (hnd) or "
        "[..., block_size, num_heads, head_dim] (nhd).");
    m.def(
        "pack_message",
        [](const TransferPlan& plan, int message, const py::array& src_pool,
           const std::string& mode, const py::object& out) {
            const TransferMessage& msg = message_of(plan, message);
            const TransferMode mo = mode_of(plan, mode);
            const BlockPool pool =
                pool_of(side_geometry(plan, true, msg.src_rank), src_pool, "src_pool");
            py::array payload = payload_of(msg, out);
            {
                py::gil_scoped_release release;
                pack_message(plan, msg, mo, pool,
                             {static_cast<std::byte*>(payload.mutable_data()),
                              static_cast<size_t>(msg.bytes)});
            }
            return payload;
        },
        py::arg("plan"), py::arg("message"), py::arg("src_pool"), py::arg("mode") = "auto",
        py::kw_only(), py::arg("out") = py::none(),
        "Message `message`'s payload packed from the source rank's pool array (read in place "
        "when the array is 64-byte aligned): into `out` (any C-contiguous writeable array of "
        "exactly the message's bytes, returned) or, without it, a new uint8 array.");
    PYBIND11_NUMPY_DTYPE(CopyRun, pool, pool_step, wire, wire_step, len, count);
    m.def(
        "message_copy_runs",
        [](const TransferPlan& plan, int message, const std::string& mode, bool source,
           int64_t num_blocks) {
            const TransferMessage& msg = message_of(plan, message);
            const TransferMode mo = mode_of(plan, mode);
            const TransferEndpoint& e = source ? plan.src : plan.dst;
            const int rank = source ? msg.src_rank : msg.dst_rank;
            std::vector<CopyRun> runs;
            {
                py::gil_scoped_release release;
                runs = message_copy_runs(plan, msg, mo, source,
                                         rank_page_geometry(e.layout, rank, e.block_size, e.order),
                                         num_blocks);
            }
            return py::array_t<CopyRun>(static_cast<py::ssize_t>(runs.size()), runs.data());
        },
        py::arg("plan"), py::arg("message"), py::arg("mode") = "auto", py::kw_only(),
        py::arg("source"), py::arg("num_blocks"),
        "The copies between one side's pool (of num_blocks blocks) and message `message`'s "
        "payload, as a copy engine (a GPU kernel, the CUDA backend's copy programs) carries them "
        "out: a numpy structured array with fields pool, pool_step, wire, wire_step, len, count; "
        "run i copies `count` blocks of `len` bytes, copy k between pool byte pool + k * "
        "pool_step and payload byte wire + k * wire_step. source=True: the source rank's pool "
        "(pack); False: the destination rank's (unpack).");
    m.def(
        "pool_array",
        [](const TransferPlan& plan, bool source, int rank, int64_t num_blocks) {
            const KvLayout& l = source ? plan.src.layout : plan.dst.layout;
            require(rank >= 0 && rank < l.world_size(), "rank ", rank, " is outside [0, ",
                    l.world_size(), ")");
            require(num_blocks >= 1, "num_blocks must be >= 1, got ", num_blocks);
            const TransferEndpoint& e = source ? plan.src : plan.dst;
            const PageGeometry g = rank_page_geometry(e.layout, rank, e.block_size, e.order);
            const auto bytes = static_cast<size_t>(num_blocks * g.block_bytes());
            // Over-allocated by 63 bytes and viewed from the first 64-byte boundary; the view
            // keeps the raw array alive (its base).
            py::array_t<uint8_t> raw(static_cast<py::ssize_t>(bytes + 63));
            auto* p = raw.mutable_data();
            const size_t skip = (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
            std::memset(p + skip, 0, bytes);
            const py::dtype dt = numpy_dtype(g);
            const auto shape = pool_shape(g, num_blocks);
            std::vector<py::ssize_t> strides(shape.size());
            py::ssize_t stride = dt.itemsize();
            for (size_t i = shape.size(); i-- > 0;) {
                strides[i] = stride;
                stride *= shape[i];
            }
            return py::array(dt, shape, strides, p + skip, raw);
        },
        py::arg("plan"), py::arg("source"), py::arg("rank"), py::arg("num_blocks"),
        "A zeroed, 64-byte aligned pool array of `num_blocks` blocks for a rank of one side of "
        "the plan (the shape of pool_geometry; dtype float32, float16, or uint16 holding bf16 "
        "bits): pack_message and unpack_message read and write it in place.");
    m.def(
        "unpack_message",
        [](const TransferPlan& plan, int message, const py::array& payload, py::array dst_pool,
           const std::string& mode) {
            const TransferMessage& msg = message_of(plan, message);
            const TransferMode mo = mode_of(plan, mode);
            require(payload.flags() & py::array::c_style, "payload must be C-contiguous");
            require(static_cast<int64_t>(payload.nbytes()) == msg.bytes, "payload holds ",
                    payload.nbytes(), " bytes; message ", message, " carries ", msg.bytes);
            require(dst_pool.writeable(), "dst_pool must be writeable");
            BlockPool pool =
                pool_of(side_geometry(plan, false, msg.dst_rank), dst_pool, "dst_pool");
            {
                py::gil_scoped_release release;
                unpack_message(plan, msg, mo,
                               {reinterpret_cast<const std::byte*>(payload.data()),
                                static_cast<size_t>(msg.bytes)},
                               pool);
            }
            if (!pool.external())  // a copy: write it back
                std::memcpy(dst_pool.mutable_data(), pool.arena().data(), pool.arena().size());
        },
        py::arg("plan"), py::arg("message"), py::arg("payload"), py::arg("dst_pool"),
        py::arg("mode") = "auto",
        "Writes a payload made by pack_message (same plan, message, mode) into the destination "
        "rank's pool array, in place.");
}

}  // namespace kvshard::python
