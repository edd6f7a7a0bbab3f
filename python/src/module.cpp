// kvshard._kvshard: the module's entry point and the error translation.
#include "bindings.h"
#include "kvshard/cache/block_manager.h"
#include "kvshard/common/error.h"

namespace kvshard::python {

py::object json_loads(const std::string& text) {
    return py::module_::import("json").attr("loads")(text);
}

std::string json_dumps(const py::handle& value) {
    return py::module_::import("json").attr("dumps")(value).cast<std::string>();
}

std::vector<BlockHash> hashes_from(const py::object& hex) {
    // Read in place from the str objects (no std::string per hash): converting a list of 64
    // hashes through std::vector<std::string> took ~6 us, 20x the routing decision itself
    // (BENCHMARKS.md, "python").
    if (PyUnicode_Check(hex.ptr()))
        throw py::type_error("block hashes: a sequence of 32-digit hex strings, not one string");
    const auto fast = py::reinterpret_steal<py::object>(
        PySequence_Fast(hex.ptr(), "block hashes: a sequence of 32-digit hex strings"));
    if (!fast) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
    std::vector<BlockHash> out;
    out.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (!PyUnicode_Check(items[i]))
            throw py::type_error("block hashes: a sequence of 32-digit hex strings, item " +
                                 std::to_string(i) + " is not a str");
        Py_ssize_t len = 0;
        const char* text = PyUnicode_AsUTF8AndSize(items[i], &len);
        if (!text) throw py::error_already_set();
        out.push_back(BlockHash::from_hex({text, static_cast<size_t>(len)}));
    }
    return out;
}

std::vector<std::string> hashes_to(std::span<const BlockHash> hashes) {
    std::vector<std::string> out;
    out.reserve(hashes.size());
    for (const auto& h : hashes) out.push_back(h.hex());
    return out;
}

}  // namespace kvshard::python

namespace py = pybind11;

PYBIND11_MODULE(_kvshard, m) {
    namespace kp = kvshard::python;
    m.doc() = "kvshard: KV caches under distributed LLM inference parallelism (C++ core).";
    // kvshard::Error is wrong user input: a ValueError carrying the library's message. Registered
    // before its subclass so that the subclass's translator is tried first.
    // Translators are tried newest first, so the subclass is registered after its base.
    auto error = py::register_exception<kvshard::Error>(m, "Error", PyExc_ValueError);
    error.attr("__doc__") =
        "Wrong input to kvshard (the C++ kvshard::Error): the message says what is wrong and "
        "what would be right.";
    auto out_of_blocks =
        py::register_exception<kvshard::OutOfBlocksError>(m, "OutOfBlocksError", error.ptr());
    out_of_blocks.attr("__doc__") = "The block manager has too few free or evictable blocks.";
    // Raised and caught as kvshard.Error (the package re-exports them).
    error.attr("__module__") = "kvshard";
    out_of_blocks.attr("__module__") = "kvshard";
    kp::bind_model_layout(m);
    kp::bind_planner(m);
    kp::bind_cp(m);
    kp::bind_transfer(m);
    kp::bind_cache(m);
    kp::bind_router(m);
    kp::bind_pack(m);
    kp::bind_bench(m);
}
