#include "kvshard/common/shared_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

// The token page: a magic, then the two token words.
constexpr uint64_t kTokenMagic = 0x414E524141564B53ull;  // "SKVAARNA"

std::string errno_text() { return std::strerror(errno); }

}  // namespace

SharedArena::SharedArena(size_t bytes) {
    const size_t usable = (std::max<size_t>(bytes, 1) + kTokenPage - 1) / kTokenPage * kTokenPage;
    mapped_ = kTokenPage + usable;
    const int fd = memfd_create("kvshard-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        throw Error(detail::concat("cannot create shareable memory (memfd_create): ", errno_text(),
                                   "; use private pool memory instead"));
    if (ftruncate(fd, static_cast<off_t>(mapped_)) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        const std::string why = errno_text();
        close(fd);
        throw Error(detail::concat("cannot size shareable memory of ", mapped_, " bytes: ", why));
    }
    void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        const std::string why = errno_text();
        close(fd);
        throw Error(detail::concat("cannot map shareable memory of ", mapped_, " bytes: ", why));
    }
    base_ = static_cast<std::byte*>(p);
    // Advice only (shared memory gets huge pages only where the kernel's shmem_enabled allows).
    (void)madvise(base_, mapped_, MADV_HUGEPAGE);
    std::random_device rd;
    auto word = [&rd] { return (uint64_t{rd()} << 32) ^ rd(); };
    id_.pid = static_cast<int32_t>(getpid());
    id_.fd = fd;
    id_.token[0] = word();
    id_.token[1] = word();
    id_.bytes = usable;
    const uint64_t page[3] = {kTokenMagic, id_.token[0], id_.token[1]};
    std::memcpy(base_, page, sizeof(page));
}

bool SharedArena::supported() {
    static const bool ok = [] {
        try {
            SharedArena probe(1);
            return true;
        } catch (const Error&) {
            return false;
        }
    }();
    return ok;
}

SharedArena::~SharedArena() {
    munmap(base_, mapped_);
    close(id_.fd);
}

std::unique_ptr<SharedArenaView> SharedArenaView::open(const SharedArenaId& id, std::string* why) {
    auto fail = [why](const std::string& text) -> std::unique_ptr<SharedArenaView> {
        if (why != nullptr) *why = text;
        return nullptr;
    };
    if (id.pid <= 0 || id.fd < 0 || id.bytes == 0) return fail("no shareable arena");
    const std::string path = detail::concat("/proc/", id.pid, "/fd/", id.fd);
    // Non-blocking, no controlling terminal: on another host or in another PID namespace the pair
    // may name anything (a FIFO would block an ordinary open); only a regular file is mapped.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return fail(detail::concat("cannot open ", path, ": ", errno_text()));
    const size_t mapped = SharedArena::kTokenPage + id.bytes;
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        static_cast<uint64_t>(st.st_size) != mapped) {
        close(fd);
        return fail(detail::concat(path, " is not an arena of ", id.bytes, " bytes"));
    }
    void* p = mmap(nullptr, mapped, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);  // the mapping keeps the memory
    if (p == MAP_FAILED) return fail(detail::concat("cannot map ", path, ": ", errno_text()));
    uint64_t page[3];
    std::memcpy(page, p, sizeof(page));
    if (page[0] != kTokenMagic || page[1] != id.token[0] || page[2] != id.token[1]) {
        munmap(p, mapped);
        return fail(detail::concat(path, " holds another arena (token mismatch)"));
    }
    return std::unique_ptr<SharedArenaView>(
        new SharedArenaView(id, static_cast<const std::byte*>(p), mapped));
}

SharedArenaView::~SharedArenaView() { munmap(const_cast<std::byte*>(base_), mapped_); }

std::shared_ptr<const SharedArenaView> SharedArenaViews::get(const SharedArenaId& id,
                                                             std::string* why) {
    std::lock_guard lk(mu_);
    for (auto it = views_.begin(); it != views_.end(); ++it)
        if ((*it)->id() == id) {
            views_.splice(views_.begin(), views_, it);
            return views_.front();
        }
    std::shared_ptr<const SharedArenaView> v = SharedArenaView::open(id, why);
    if (!v) return nullptr;
    views_.push_front(v);
    while (views_.size() > capacity_) views_.pop_back();
    return v;
}

}  // namespace kvshard
