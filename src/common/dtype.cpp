#include "kvshard/common/dtype.h"

#include "kvshard/common/error.h"

namespace kvshard {

std::size_t dtype_size(DType t) {
    switch (t) {
        case DType::kFp32:
            return 4;
        case DType::kBf16:
            return 2;
        case DType::kFp16:
            return 2;
        case DType::kFp8:
            return 1;
    }
    KVSHARD_CHECK(false, "unknown dtype");
    return 0;
}

std::string_view dtype_name(DType t) {
    switch (t) {
        case DType::kFp32:
            return "fp32";
        case DType::kBf16:
            return "bf16";
        case DType::kFp16:
            return "fp16";
        case DType::kFp8:
            return "fp8";
    }
    return "?";
}

DType parse_dtype(std::string_view s) {
    if (s == "fp32" || s == "float32" || s == "float") return DType::kFp32;
    if (s == "bf16" || s == "bfloat16") return DType::kBf16;
    if (s == "fp16" || s == "float16" || s == "half") return DType::kFp16;
    if (s == "fp8" || s == "fp8_e4m3" || s == "fp8_e5m2" || s == "float8_e4m3fn")
        return DType::kFp8;
    throw Error(detail::concat("unknown element type '", s, "': expected fp32, bf16, fp16 or fp8"));
}

}  // namespace kvshard
