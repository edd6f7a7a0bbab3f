#include "kvshard/cuda/copy.h"

#include <algorithm>
#include <limits>

#include "cuda/check.h"
#include "cuda/kernels.h"

namespace kvshard::cuda {
namespace {

static_assert(sizeof(CopyEntry) == sizeof(detail::RawCopyEntry));

// Appends e, split so that no entry copies more than kMaxEntryBytes: a long copy into pieces of
// whole 16-byte units, many short copies into groups of copies.
void push_split(std::vector<CopyEntry>& out, const CopyEntry& e) {
    if (e.len <= 0 || e.count <= 0) return;
    if (e.len * e.count <= kMaxEntryBytes) {
        out.push_back(e);
        return;
    }
    if (e.len > kMaxEntryBytes) {
        for (int64_t i = 0; i < e.count; ++i)
            for (int64_t o = 0; o < e.len; o += kMaxEntryBytes)
                out.push_back({e.src + i * e.src_step + o, 0, e.dst + i * e.dst_step + o, 0,
                               std::min(kMaxEntryBytes, e.len - o), 1});
        return;
    }
    const int64_t per = std::max<int64_t>(1, kMaxEntryBytes / e.len);
    for (int64_t i = 0; i < e.count; i += per)
        out.push_back({e.src + i * e.src_step, e.src_step, e.dst + i * e.dst_step, e.dst_step,
                       e.len, std::min(per, e.count - i)});
}

// pool_is_source: pack (pool -> payload); else unpack (payload -> pool).
std::vector<CopyEntry> run_entries(std::span<const CopyRun> runs, bool pool_is_source) {
    std::vector<CopyEntry> out;
    out.reserve(runs.size());
    for (const CopyRun& r : runs) {
        if (pool_is_source)
            push_split(out, {r.pool, r.pool_step, r.wire, r.wire_step, r.len, r.count});
        else
            push_split(out, {r.wire, r.wire_step, r.pool, r.pool_step, r.len, r.count});
    }
    return out;
}
}  // namespace

std::vector<CopyEntry> pack_entries(std::span<const CopyRun> runs) {
    return run_entries(runs, true);
}

std::vector<CopyEntry> unpack_entries(std::span<const CopyRun> runs) {
    return run_entries(runs, false);
}

std::vector<CopyEntry> direct_entries(std::span<const TransferDescriptor> descriptors) {
    // Descriptors of equal length at constant steps on both sides (a transpose's head_dim
    // vectors: a token's heads, a head's tokens) become one strided entry.
    std::vector<CopyEntry> out;
    CopyEntry cur;
    bool open = false;
    for (const TransferDescriptor& d : descriptors) {
        if (open && d.bytes == cur.len) {
            if (cur.count == 1 && d.src_offset > cur.src && d.dst_offset > cur.dst) {
                cur.src_step = d.src_offset - cur.src;
                cur.dst_step = d.dst_offset - cur.dst;
                cur.count = 2;
                continue;
            }
            if (cur.count > 1 && d.src_offset == cur.src + cur.count * cur.src_step &&
                d.dst_offset == cur.dst + cur.count * cur.dst_step) {
                ++cur.count;
                continue;
            }
        }
        if (open) push_split(out, cur);
        cur = {d.src_offset, 0, d.dst_offset, 0, d.bytes, 1};
        open = true;
    }
    if (open) push_split(out, cur);
    return out;
}

void append_entries(std::vector<CopyEntry>& to, std::span<const CopyEntry> more, int64_t src_base,
                    int64_t dst_base) {
    for (CopyEntry e : more) {
        e.src += src_base;
        e.dst += dst_base;
        to.push_back(e);
    }
}

std::string copy_buffers_error(const CopyExtents& x, const std::byte* src, int64_t src_bytes,
                               const std::byte* dst, int64_t dst_bytes) {
    if (x.src > src_bytes)
        return "the copy program reads " + std::to_string(x.src) +
               " bytes of its source but the source buffer has " + std::to_string(src_bytes) +
               " (a program made for another pool or payload?)";
    if (x.dst > dst_bytes)
        return "the copy program writes " + std::to_string(x.dst) +
               " bytes of its destination but the destination buffer has " +
               std::to_string(dst_bytes) + " (a program made for another pool or payload?)";
    // The kernel reads its source through the read-only cache: the two must not overlap.
    if (src < dst + dst_bytes && dst < src + src_bytes)
        return "a copy program's source and destination overlap (the same pool on both sides?): "
               "they must be separate buffers";
    return "";
}

CopyExtents copy_extents(std::span<const CopyEntry> entries) {
    CopyExtents x;
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    for (size_t i = 0; i < entries.size(); ++i) {
        const CopyEntry& e = entries[i];
        require(e.src >= 0 && e.dst >= 0 && e.len >= 0 && e.count >= 0 && e.src_step >= 0 &&
                    e.dst_step >= 0,
                "copy entry ", i, " has a negative field (src ", e.src, ", src_step ", e.src_step,
                ", dst ", e.dst, ", dst_step ", e.dst_step, ", len ", e.len, ", count ", e.count,
                "): offsets, steps, length and count are >= 0");
        require(e.count == 0 || e.len <= kMaxEntryBytes / e.count, "copy entry ", i, " copies ",
                e.count, " x ", e.len, " bytes: an entry copies at most ", kMaxEntryBytes,
                " (split them with pack_entries / unpack_entries)");
        // The furthest byte of each side must be an int64 (no entry wraps around).
        require(e.count <= 1 || (e.src_step <= (kMax - e.src - e.len) / (e.count - 1) &&
                                 e.dst_step <= (kMax - e.dst - e.len) / (e.count - 1)),
                "copy entry ", i, " reaches past 2^63 bytes");
        x.bytes += e.len * e.count;
        if (e.len > 0 && e.count > 0) {
            x.src = std::max(x.src, e.src + (e.count - 1) * e.src_step + e.len);
            x.dst = std::max(x.dst, e.dst + (e.count - 1) * e.dst_step + e.len);
        }
    }
    return x;
}

DeviceCopyProgram::DeviceCopyProgram(std::span<const CopyEntry> entries)
    : count_(static_cast<int64_t>(entries.size())) {
    const CopyExtents x = copy_extents(entries);  // checks before anything is allocated
    bytes_ = x.bytes;
    src_extent_ = x.src;
    dst_extent_ = x.dst;
    entries_ = DeviceBuffer(static_cast<int64_t>(entries.size_bytes()));
    entries_.upload(std::as_bytes(entries));
}

void DeviceCopyProgram::run(const std::byte* src, std::byte* dst, void* stream) const {
    if (count_ == 0) return;
    detail::launch_copy(reinterpret_cast<const detail::RawCopyEntry*>(entries_.data()), count_,
                        reinterpret_cast<const unsigned char*>(src),
                        reinterpret_cast<unsigned char*>(dst), multiprocessor_count(),
                        detail::stream_of(stream));
    KVSHARD_CUDA_CALL(cudaGetLastError());
}

void DeviceCopyProgram::run_checked(const std::byte* src, int64_t src_bytes, std::byte* dst,
                                    int64_t dst_bytes, void* stream) const {
    const std::string why =
        copy_buffers_error({bytes_, src_extent_, dst_extent_}, src, src_bytes, dst, dst_bytes);
    require(why.empty(), why);
    run(src, dst, stream);
}

void DeviceCopyProgram::run(const DevicePool& src, DeviceBuffer& dst, void* stream) const {
    run_checked(src.data(), src.arena_bytes(), dst.data(), dst.size(), stream);
}

void DeviceCopyProgram::run(const DeviceBuffer& src, DevicePool& dst, void* stream) const {
    run_checked(src.data(), src.size(), dst.data(), dst.arena_bytes(), stream);
}

void DeviceCopyProgram::run(const DevicePool& src, DevicePool& dst, void* stream) const {
    run_checked(src.data(), src.arena_bytes(), dst.data(), dst.arena_bytes(), stream);
}

}  // namespace kvshard::cuda
