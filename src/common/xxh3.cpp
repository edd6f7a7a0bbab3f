#include "kvshard/common/xxh3.h"

// The baseline build of XXH3, inline (no call into libxxhash for short updates).
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvshard {
namespace detail {

#if defined(__x86_64__)
namespace xxh3_avx2 {  // xxh3_avx2.cpp
unsigned long long hash(const void* data, size_t len);
void reset(void* state);
void update(void* state, const void* data, size_t len);
unsigned long long digest(const void* state);
}  // namespace xxh3_avx2
#endif

}  // namespace detail

namespace {

static_assert(sizeof(XXH3_state_t) <= 640 && alignof(XXH3_state_t) <= 64,
              "Xxh3Stream::state_ must hold an XXH3_state_t");

namespace base {
#include "xxh3_impl.inc"
}  // namespace base

struct Impl {
    unsigned long long (*hash)(const void*, size_t);
    void (*reset)(void*);
    void (*update)(void*, const void*, size_t);
    unsigned long long (*digest)(const void*);
    bool avx2;
};

const Impl& impl() {
    static const Impl chosen = [] {
#if defined(__x86_64__)
        if (__builtin_cpu_supports("avx2"))
            return Impl{detail::xxh3_avx2::hash, detail::xxh3_avx2::reset,
                        detail::xxh3_avx2::update, detail::xxh3_avx2::digest, true};
#endif
        return Impl{base::hash, base::reset, base::update, base::digest, false};
    }();
    return chosen;
}

}  // namespace

uint64_t xxh3_64(const void* data, size_t len) { return impl().hash(data, len); }

Xxh3Stream::Xxh3Stream() { impl().reset(state_); }

void Xxh3Stream::update(const void* data, size_t len) { impl().update(state_, data, len); }

uint64_t Xxh3Stream::digest() const { return impl().digest(state_); }

namespace detail {
bool xxh3_uses_avx2() { return impl().avx2; }
uint64_t xxh3_64_baseline(const void* data, size_t len) { return base::hash(data, len); }
}  // namespace detail

}  // namespace kvshard
