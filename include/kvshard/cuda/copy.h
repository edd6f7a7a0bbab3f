#pragma once
// Device copy programs (docs/cuda.md, "Pack and unpack"): the copies of a transfer plan's
// messages, decided on the host once (transfer/pack.h message_copy_runs, transfer/descriptors.h
// message_descriptors) and carried out on the device in one kernel launch per program, not one per
// block: a TP head regrouping, a block-size change, HND <-> NHD, replicated-head dedup and the MLA
// latent are all runs of such a program. Each warp copies whole entries with 16-byte loads and
// stores (4-byte or single-byte ones where an entry's offsets are not aligned to 16).
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvshard/cuda/device.h"
#include "kvshard/transfer/descriptors.h"
#include "kvshard/transfer/pack.h"

namespace kvshard::cuda {

// One entry: `count` copies of `len` bytes, copy i from src + i * src_step to dst + i * dst_step
// (byte offsets in the program's source and destination buffers).
struct CopyEntry {
    int64_t src = 0, src_step = 0;
    int64_t dst = 0, dst_step = 0;
    int64_t len = 0;
    int64_t count = 1;
    bool operator==(const CopyEntry&) const = default;
};

// Entries longer than this are split, so that one long run (a whole layer of a zero-copy message)
// spreads over the whole GPU.
inline constexpr int64_t kMaxEntryBytes = int64_t{64} << 10;

// The entries of a pack (pool -> payload) or unpack (payload -> pool) from a message's copy runs,
// and of a pool-to-pool direct copy from its descriptors; split at kMaxEntryBytes. Pure.
std::vector<CopyEntry> pack_entries(std::span<const CopyRun> runs);
std::vector<CopyEntry> unpack_entries(std::span<const CopyRun> runs);
std::vector<CopyEntry> direct_entries(std::span<const TransferDescriptor> descriptors);
// Appends `more` with `src_base` / `dst_base` added to their offsets (several messages' payloads
// in one staging buffer, several programs in one launch).
void append_entries(std::vector<CopyEntry>& to, std::span<const CopyEntry> more, int64_t src_base,
                    int64_t dst_base);

// What a list of entries copies: payload bytes, and the furthest byte each side touches (+1).
// Error for an entry with a negative field or over kMaxEntryBytes. Pure.
struct CopyExtents {
    int64_t bytes = 0;
    int64_t src = 0, dst = 0;
    bool operator==(const CopyExtents&) const = default;
};
CopyExtents copy_extents(std::span<const CopyEntry> entries);

// "" when a program of extents x can run from src (src_bytes) to dst (dst_bytes): each buffer
// holds the program's extent on it and the two do not overlap; else what is wrong.
std::string copy_buffers_error(const CopyExtents& x, const std::byte* src, int64_t src_bytes,
                               const std::byte* dst, int64_t dst_bytes);

// A copy program in device memory.
class DeviceCopyProgram {
  public:
    explicit DeviceCopyProgram(std::span<const CopyEntry> entries);
    int64_t entries() const { return count_; }
    int64_t bytes() const { return bytes_; }  // payload bytes the program copies
    // The furthest byte each side touches (+1): the buffers must be at least this large.
    int64_t src_extent() const { return src_extent_; }
    int64_t dst_extent() const { return dst_extent_; }
    // One kernel launch on `stream` (a cudaStream_t; null: the default stream), asynchronous.
    // src / dst: device memory (or memory mapped from another process, ipc.h) of at least
    // src_extent() / dst_extent() bytes, not overlapping.
    void run(const std::byte* src, std::byte* dst, void* stream = nullptr) const;
    // The same with the buffers checked first: Error, before anything is queued, when a side is
    // smaller than the program's extent on it (a program made for another pool or payload) or
    // the two overlap. src_bytes / dst_bytes: the sizes of the device buffers at src / dst.
    void run_checked(const std::byte* src, int64_t src_bytes, std::byte* dst, int64_t dst_bytes,
                     void* stream = nullptr) const;
    void run(const DevicePool& src, DeviceBuffer& dst, void* stream = nullptr) const;  // pack
    void run(const DeviceBuffer& src, DevicePool& dst, void* stream = nullptr) const;  // unpack
    void run(const DevicePool& src, DevicePool& dst, void* stream = nullptr) const;    // direct

  private:
    DeviceBuffer entries_;
    int64_t count_ = 0, bytes_ = 0, src_extent_ = 0, dst_extent_ = 0;
};

}  // namespace kvshard::cuda
