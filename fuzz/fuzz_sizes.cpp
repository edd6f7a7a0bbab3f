// libFuzzer: the numbers a user gives the CLI's layout, capacity and planning flags (--tp, --pp,
// --cp, --dp, --ep, --cp-interleave, --context, --block-size, --gpus, --mem-util), as raw 64-bit
// values, through the library calls those flags reach. kvshard::Error is the expected answer to
// an out-of-range value; anything else (overflow reported by UBSan, a crash, an InternalError) is
// a finding. Layouts are built only for worlds of at most 4096 ranks, to keep each input fast.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/hardware.h"
#include "kvshard/planner/planner.h"

namespace {
int64_t next(const uint8_t*& data, size_t& size) {
    int64_t v = 0;
    const size_t n = size < 8 ? size : 8;
    std::memcpy(&v, data, n);
    data += n;
    size -= n;
    return v;
}
int as_int(int64_t v) { return static_cast<int>(static_cast<int32_t>(v)); }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace kvshard;
    static const char* kModels[] = {
        "tiny",     "tiny-swa",     "tiny-hybrid",        "tiny-mla",
        "tiny-moe", "gpt-oss-120b", "qwen3-next-80b-a3b", "llama-3.1-8b"};
    const ModelSpec m = catalog_model(kModels[static_cast<size_t>(next(data, size)) % 8]);
    ParallelConfig p;
    p.tp = as_int(next(data, size));
    p.pp = as_int(next(data, size));
    p.cp = as_int(next(data, size));
    p.dp = as_int(next(data, size));
    p.ep = as_int(next(data, size));
    p.cp_interleave = as_int(next(data, size));
    p.cp_scheme = static_cast<CpScheme>(static_cast<uint64_t>(next(data, size)) % 3);
    const int64_t context = next(data, size);
    const int block = as_int(next(data, size));
    const int gpus = as_int(next(data, size));
    double mem_util = 0;
    const int64_t bits = next(data, size);
    std::memcpy(&mem_util, &bits, sizeof mem_util);
    try {
        p.validate_sizes();
        if (int64_t{p.world_size()} <= 4096) {
            const KvLayout l = make_layout(m, p);
            (void)request_kv_bytes(l, 0, context, block);
            (void)request_kv_bytes_peak(l, l.world_size() - 1, context, block);
            CapacityOptions o;
            o.context_tokens = context;
            o.block_size = block;
            o.mem_util = mem_util;
            (void)compute_capacity(m, p, hardware_by_name("h100-sxm"), o);
            if (p.pp > 1) (void)pp_layer_split_kv_balanced(m, p, context);
        }
    } catch (const Error&) {
    }
    try {
        PlanRequest r;
        r.gpus = gpus;
        r.context_tokens = context;
        r.capacity.block_size = block;
        r.capacity.mem_util = mem_util;
        r.validate();
        if (gpus <= 64) (void)plan(m, hardware_by_name("h100-sxm"), r);
    } catch (const Error&) {
    }
    return 0;
}
