#include "kvshard/common/large_alloc.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>

namespace kvshard {

void LargeFree::operator()(std::byte* p) const noexcept { std::free(p); }

LargeBuffer allocate_large(size_t bytes) {
    const bool huge = bytes >= kHugePageBytes;
    const size_t align = huge ? kHugePageBytes : 4096;
    const size_t size = (std::max<size_t>(bytes, 1) + align - 1) / align * align;
    void* p = std::aligned_alloc(align, size);
    if (p == nullptr) throw std::bad_alloc();
    // Advice only: without transparent huge pages the memory is still good, on 4 KiB pages.
    if (huge) (void)madvise(p, size, MADV_HUGEPAGE);
    return LargeBuffer(static_cast<std::byte*>(p));
}

}  // namespace kvshard
