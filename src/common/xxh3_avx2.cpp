// XXH3-64 compiled for AVX2: CMakeLists.txt gives this file alone -mavx2, and xxh3.cpp calls it
// only on a CPU with AVX2. Only C headers here: a C++ inline function compiled in this file could
// be the copy the linker keeps for the whole program, AVX2 instructions and all.
#if defined(__x86_64__) && defined(__AVX2__)
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvshard::detail::xxh3_avx2 {
#include "xxh3_impl.inc"
}  // namespace kvshard::detail::xxh3_avx2
#endif
