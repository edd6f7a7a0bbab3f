#include "kvshard/common/xxh3.h"

// The baseline build of XXH3, inline (no call into libxxhash for short updates).
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvshard {
namespace detail {

#if defined(__x86_64__)
unsigned long long xxh3_avx2_hash(const void* data, size_t len);
void xxh3_avx2_reset(void* state);
void xxh3_avx2_update(void* state, const void* data, size_t len);
unsigned long long xxh3_avx2_digest(const void* state);
#endif

}  // namespace detail

namespace {

static_assert(sizeof(XXH3_state_t) <= 640 && alignof(XXH3_state_t) <= 64,
              "Xxh3Stream::state_ must hold an XXH3_state_t");

struct Impl {
    unsigned long long (*hash)(const void*, size_t);
    void (*reset)(void*);
    void (*update)(void*, const void*, size_t);
    unsigned long long (*digest)(const void*);
    bool avx2;
};

unsigned long long base_hash(const void* data, size_t len) { return XXH3_64bits(data, len); }
void base_reset(void* s) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(s)); }
void base_update(void* s, const void* data, size_t len) {
    XXH3_64bits_update(static_cast<XXH3_state_t*>(s), data, len);
}
unsigned long long base_digest(const void* s) {
    return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(s));
}

const Impl& impl() {
    static const Impl chosen = [] {
#if defined(__x86_64__)
        if (__builtin_cpu_supports("avx2"))
            return Impl{detail::xxh3_avx2_hash, detail::xxh3_avx2_reset, detail::xxh3_avx2_update,
                        detail::xxh3_avx2_digest, true};
#endif
        return Impl{base_hash, base_reset, base_update, base_digest, false};
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
uint64_t xxh3_64_baseline(const void* data, size_t len) { return base_hash(data, len); }
}  // namespace detail

}  // namespace kvshard
