#pragma once
// XXH3-64 (seed 0), the checksum of every transfer payload and header: libxxhash's XXH3_64bits,
// compiled from its header twice, for AVX2 and for the baseline x86-64 (SSE2), the variant picked
// once at run time from the CPU's flags. Both give the same values as XXH3_64bits. The AVX2 build
// hashes data in cache 2.4x faster on the 2-core VM (2.9 vs 6.9 ms per 128 MiB; data from memory
// is bound by the memory either way). Debian's libxxhash also exports dispatching functions, but
// they take AVX-512 paths after which this machine's SSE code measured 3x slower.
#include <cstddef>
#include <cstdint>

namespace kvshard {

uint64_t xxh3_64(const void* data, size_t len);

// Streaming: the XXH3-64 of the concatenation of what update() was given.
class Xxh3Stream {
  public:
    Xxh3Stream();
    void update(const void* data, size_t len);
    uint64_t digest() const;

  private:
    alignas(64) unsigned char state_[640];  // an XXH3_state_t
};

namespace detail {
bool xxh3_uses_avx2();
// The baseline build, whatever the CPU (for tests that compare the two).
uint64_t xxh3_64_baseline(const void* data, size_t len);
}  // namespace detail

}  // namespace kvshard
