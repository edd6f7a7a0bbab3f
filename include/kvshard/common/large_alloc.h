#pragma once
// Memory for big, long-lived byte arrays (a rank's KV pool arena, transfer staging buffers).
//
// At least 4 KiB-aligned. From 2 MiB up it is 2 MiB-aligned, its size rounded up to 2 MiB, and
// advised for transparent huge pages (madvise MADV_HUGEPAGE; a no-op where the kernel has them
// off): one TLB entry then maps 2 MiB instead of 4 KiB. Measured on the 2-core VM, MPI's
// single-copy transfer between two such 128 MiB arenas ran 2.5x faster than between 4 KiB pages
// (BENCHMARKS.md "transfer"). The contents are not initialized.
#include <cstddef>
#include <memory>

namespace kvshard {

struct LargeFree {
    void operator()(std::byte* p) const noexcept;
};
using LargeBuffer = std::unique_ptr<std::byte[], LargeFree>;

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Throws std::bad_alloc when the memory is not there.
LargeBuffer allocate_large(size_t bytes);

}  // namespace kvshard
