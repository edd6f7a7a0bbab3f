// libFuzzer: a hardware JSON file, then a capacity and cost estimate on it. kvshard::Error is the
// expected answer to bad input; anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/cost_model.h"
#include "kvshard/planner/hardware.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace kvshard;
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    try {
        const HardwareSpec hw = parse_hardware_json(text, "fuzz-hw.json");
        (void)to_json(hw);
        const ModelSpec m = catalog_model("gpt-oss-120b");
        ParallelConfig p;
        p.tp = 8;
        CapacityOptions o;
        o.context_tokens = 131072;
        (void)compute_capacity(m, p, hw, o);
        Workload w;
        w.prompt_tokens = 4096;
        w.context_tokens = 8192;
        w.batch = 8;
        (void)estimate_cost(m, p, hw, w, CostOptions{});
    } catch (const Error&) {
    }
    return 0;
}
