// libFuzzer: the first bytes of a safetensors file (8-byte length + JSON header), taken as the
// whole file. kvshard::Error is the expected answer to bad input; anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvshard/common/error.h"
#include "kvshard/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view bytes(reinterpret_cast<const char*>(data), size);
    try {
        (void)kvshard::parse_safetensors_header(bytes, static_cast<int64_t>(size), "fuzz.st");
        // The same header in front of a file a little longer than the fuzz input.
        (void)kvshard::parse_safetensors_header(bytes, static_cast<int64_t>(size) + 4096,
                                                "fuzz.st");
    } catch (const kvshard::Error&) {
    }
    return 0;
}
