// libFuzzer: config.json text -> ModelSpec -> layout, per-request KV and capacity. A kvshard::Error
// is the expected answer to bad input; anything else (a crash, a sanitizer report, another
// exception, an InternalError) is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/hardware.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace kvshard;
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    try {
        const ModelSpec m = parse_hf_config(text, "fuzz/config.json");
        (void)to_json(m);
        (void)m.layer_mix();
        ParallelConfig p;
        const KvLayout l = make_layout(m, p);
        for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{4097}, kMaxContextTokens})
            (void)request_kv_bytes(l, 0, len, 16);
        CapacityOptions o;
        o.context_tokens = 32768;
        (void)compute_capacity(m, p, hardware_by_name("h100-sxm"), o);
        for (int tp : valid_tp_sizes(m)) {
            if (tp > 64) break;
            p.tp = tp;
            (void)make_layout(m, p);
        }
    } catch (const Error&) {
    }
    return 0;
}
