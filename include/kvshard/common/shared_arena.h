#pragma once
// Memory that other processes on the same host can map read-only: a source rank's KV pool, so
// that the destination of a transfer reads it in place with one copy (transfer/transfer_exec.h,
// "direct read"), the way an RDMA READ or a single-copy shared-memory transport would.
//
// The owner creates a memfd, seals it against shrinking and growing (a reader's mapping can then
// never fault past the end), maps it read-write, and writes a random 128-bit token into its first
// page; the usable bytes start at the second page (4 KiB-aligned). A reader on the same host opens
// /proc/<pid>/fd/<fd> of the owner, maps it read-only and checks the token. A reader on another
// host, in another PID namespace, without permission, or facing a reused PID finds no such file
// or another token, and gets nothing (the caller then moves the bytes in messages). The bytes stay
// readable for as long as the reader's mapping lives, even after the owner freed its arena or died.
//
// Linux only (memfd_create, /proc). Pages: the kernel's shared-memory pages (4 KiB unless
// /sys/kernel/mm/transparent_hugepage/shmem_enabled allows huge pages; the arena is advised for
// them).
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace kvshard {

// What a reader needs to find and check an arena. Plain data: it travels in messages.
struct SharedArenaId {
    int32_t pid = 0;             // the owner process
    int32_t fd = -1;             // the memfd's descriptor in the owner
    uint64_t token[2] = {0, 0};  // random; also in the arena's first page
    uint64_t bytes = 0;          // usable bytes
    bool operator==(const SharedArenaId&) const = default;
};

// The owner's side: `bytes` usable bytes, zero-filled (untouched pages cost nothing until used).
class SharedArena {
  public:
    // Throws Error when the kernel refuses the memfd or its size (the message says which).
    explicit SharedArena(size_t bytes);
    ~SharedArena();
    SharedArena(const SharedArena&) = delete;
    SharedArena& operator=(const SharedArena&) = delete;

    std::byte* data() const { return base_ + kTokenPage; }
    size_t size() const { return id_.bytes; }
    const SharedArenaId& id() const { return id_; }

    static constexpr size_t kTokenPage = 4096;

    // Whether this process can create one (memfd with seals; checked once). Where it cannot, a
    // caller keeps its pools private and moves bytes in messages.
    static bool supported();

  private:
    SharedArenaId id_;
    std::byte* base_ = nullptr;  // the mapping: token page, then the usable bytes
    size_t mapped_ = 0;
};

// A reader's read-only mapping of another arena (possibly of this very process).
class SharedArenaView {
  public:
    // Null, with the reason in *why (if given), where this process cannot map the arena `id`
    // names: not on this host, gone, no permission, or another arena behind that descriptor.
    static std::unique_ptr<SharedArenaView> open(const SharedArenaId& id,
                                                 std::string* why = nullptr);
    ~SharedArenaView();
    SharedArenaView(const SharedArenaView&) = delete;
    SharedArenaView& operator=(const SharedArenaView&) = delete;

    const std::byte* data() const { return base_ + SharedArena::kTokenPage; }
    size_t size() const { return id_.bytes; }
    const SharedArenaId& id() const { return id_; }

  private:
    SharedArenaView(SharedArenaId id, const std::byte* base, size_t mapped)
        : id_(id), base_(base), mapped_(mapped) {}
    SharedArenaId id_;
    const std::byte* base_;
    size_t mapped_;
};

// Views kept open across requests (a first read of each page of a fresh mapping faults; a kept
// view has its page tables warm), the most recently used `capacity` of them. Thread-safe.
class SharedArenaViews {
  public:
    explicit SharedArenaViews(size_t capacity = 64) : capacity_(capacity) {}
    // The view of `id`, opened on first use; null (reason in *why) where it cannot be mapped.
    std::shared_ptr<const SharedArenaView> get(const SharedArenaId& id, std::string* why = nullptr);

  private:
    std::mutex mu_;
    size_t capacity_;
    std::list<std::shared_ptr<const SharedArenaView>> views_;  // most recently used first
};

}  // namespace kvshard
