#include "kvshard/common/error.h"

namespace kvshard::detail {

void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
    std::string what = concat("internal invariant violated: ", cond, " (", file, ":", line, ")");
    if (!msg.empty()) what += ": " + msg;
    throw InternalError(what);
}

}  // namespace kvshard::detail
