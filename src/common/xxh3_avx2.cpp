// XXH3-64 compiled for AVX2: CMakeLists.txt gives this file alone -mavx2, and xxh3.cpp calls it
// only on a CPU with AVX2. Only C headers here: a C++ inline function compiled in this file could
// be the copy the linker keeps for the whole program, AVX2 instructions and all.
#if defined(__x86_64__) && defined(__AVX2__)
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvshard::detail {

unsigned long long xxh3_avx2_hash(const void* data, size_t len) { return XXH3_64bits(data, len); }
void xxh3_avx2_reset(void* state) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state)); }
void xxh3_avx2_update(void* state, const void* data, size_t len) {
    XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, len);
}
unsigned long long xxh3_avx2_digest(const void* state) {
    return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}

}  // namespace kvshard::detail
#endif
