// Shared helpers of the pybind11 module kvshard._kvshard (python/src/*.cpp). The module is thin,
// like the CLI: it converts arguments, calls the library and turns results into Python values
// (dicts through the library's own to_json where one exists, numpy arrays for long tables).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvshard/cache/block_hash.h"
#include "kvshard/common/error.h"

namespace kvshard::python {

namespace py = pybind11;

// json.loads of a JSON text written by the library.
py::object json_loads(const std::string& text);
// json.dumps of a Python value (dicts handed to the library's JSON readers).
std::string json_dumps(const py::handle& value);

// Token ids from any int sequence or numpy array, as int32 (copied once, C order).
using TokenArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
inline std::span<const int32_t> token_span(const TokenArray& a) {
    return {a.data(), static_cast<size_t>(a.size())};
}

// kvshard's block hashes travel as 32-digit hex strings (BlockHash::hex, the KV event wire form).
// Any sequence of such strings (a list, a tuple, a numpy array of str); TypeError otherwise.
std::vector<BlockHash> hashes_from(const py::object& hex);
std::vector<std::string> hashes_to(std::span<const BlockHash> hashes);

void bind_model_layout(py::module_& m);
void bind_planner(py::module_& m);
void bind_cp(py::module_& m);
void bind_transfer(py::module_& m);
void bind_cache(py::module_& m);
void bind_router(py::module_& m);
void bind_pack(py::module_& m);
// The private submodule _bench: C++ timing loops for bench/bench_python.py.
void bind_bench(py::module_& m);

}  // namespace kvshard::python
