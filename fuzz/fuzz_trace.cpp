// libFuzzer: Mooncake JSON-lines trace text, read with both error policies. kvshard::Error is the
// expected answer to bad input (with "fail"); anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "kvshard/common/error.h"
#include "kvshard/sim/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace kvshard;
    const std::string text(reinterpret_cast<const char*>(data), size);
    for (TraceErrorPolicy policy : {TraceErrorPolicy::kFail, TraceErrorPolicy::kSkip}) {
        try {
            std::istringstream in(text);
            (void)parse_trace(in, "fuzz.jsonl", policy, 512, 0);
        } catch (const Error&) {
        }
    }
    return 0;
}
