#pragma once
// Direct reads over one-sided communication (docs/transfer.md, "RMA read"): the destination reads
// a message's bytes from the source rank's pool through a Window (comm/communicator.h: MPI RMA,
// MPI_Win_create over the pool and MPI_Rget of each run; threads: memcpy), so a direct read works
// across hosts, not only through shared memory on one host.
//
// The executor (transfer_exec.h) uses it when TransferExecOptions::rma_window is set on both
// sides: the source's hello offers the window instead of a shared arena, the destination accepts,
// and each direct-read header (the message's checksum, unit or payload XXH3) is followed by
// rma_read_message: gets of the message's descriptors (descriptors.h, message_descriptors:
// maximal runs contiguous in both pools) straight into the destination pool, or, where the
// message is many descriptors but one run of the source pool (a TP reshape), gets of that run into
// a staging buffer that is then scattered; completion, then the checksum of the bytes as they
// landed against the header's. fp8 scales are not read this
// way: an fp8 plan is declined (its messages go as two-sided messages).
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/comm/communicator.h"
#include "kvshard/common/large_alloc.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {

// A window over every source pool of the transfers on one world communicator. Made once,
// collectively, by every rank of `world` (the communicator the senders and receivers use), and
// kept across requests: source ranks pass their pool (its arena is exposed), the others null.
// Destroyed on every rank together, after the last transfer that uses it.
//
// A source rank also exposes a pack area of pack_bytes (a second window, made in the same call):
// for a destination whose messages would be many small runs of the source pool (a TP1 -> TP2
// reshape: half of every source page, a 16 KiB run per page), its sender packs each message
// there, in wire order, and the destination reads it in chunk-sized gets (docs/transfer.md, "RMA
// read": packed). 0: none (the destination then reads run by run).
class RmaPoolWindow {
  public:
    static constexpr int64_t kDefaultPackBytes = int64_t{32} << 20;
    RmaPoolWindow(Communicator& world, BlockPool* pool, int64_t pack_bytes = kDefaultPackBytes);
    Window& window() { return *window_; }
    // Bytes world rank `world_rank` exposed (its pool's arena; 0 where it passed none).
    int64_t region_bytes(int world_rank) const { return window_->region_bytes(world_rank); }
    Backend backend() const { return backend_; }
    // The pack areas' window, the bytes of world rank `world_rank`'s, and this rank's own.
    Window& pack_window() { return *pack_window_; }
    int64_t pack_bytes(int world_rank) const { return pack_window_->region_bytes(world_rank); }
    std::span<std::byte> pack_area() { return pack_area_; }
    // One request at a time packs into the area: a sender takes it (false: none, or another
    // request holds it; that request's destinations then read run by run) and gives it back
    // when its destinations are done with it.
    bool acquire_pack_area() { return !pack_area_.empty() && !pack_busy_.exchange(true); }
    void release_pack_area() { pack_busy_.store(false); }

  private:
    std::atomic<bool> pack_busy_{false};
    LargeBuffer pack_mem_;
    std::span<std::byte> pack_area_;
    std::unique_ptr<Window> window_, pack_window_;
    Backend backend_;
};

// Packed reads. Whether a destination asks its source to pack msg: it is more than two runs pool
// to pool, shorter than a chunk get (256 KiB) on average, and not one run of the source pool in
// post-receive order (that is read staged, with no copy on the source).
bool rma_pack_helps(const TransferPlan& plan, int message_index, int64_t src_num_blocks,
                    TransferMode mode, const BlockPool& dst);
// Where each message of the pair (src_rank -> dst_rank), in plan order, lies in the source's
// pack area of pack_bytes: the area is cut into one part per destination rank of src_rank (in
// the plan order of their first message), and each message follows the previous one in its part
// (64-byte aligned), starting the part over where it would not fit. Empty when a message does not
// fit its part. The sender writes message k there once every earlier message over those bytes
// has been credited.
std::vector<int64_t> rma_pack_offsets(const TransferPlan& plan, int src_rank, int dst_rank,
                                      int64_t pack_bytes);
// Reads plan.messages[message_index], packed in wire order (mode) at byte `offset` of the pack
// area of world rank src_world, into dst: straight into the pool where the payload is one run
// there, else staged and unpacked. Returns the checksum of what landed, as rma_read_message.
uint64_t rma_read_packed(Window& pack_window, int src_world, int64_t offset,
                         const TransferPlan& plan, int message_index, TransferMode mode, bool units,
                         BlockPool& dst);

// Whether msg can be read through a window from a source pool of src_num_blocks blocks exposing
// region_bytes: "" when it can, else why not (fp8 scales, a block outside the source pool, a
// region smaller than the pool's pages).
std::string rma_readable(const TransferPlan& plan, const TransferMessage& msg,
                         int64_t src_num_blocks, int64_t region_bytes);

// Reads plan.messages[message_index] from the source pool of world rank src_world (src_num_blocks
// blocks, exposed in `window`) into dst (docs/transfer.md, "RMA read": per descriptor, chunked,
// or staged), waiting for every get. Returns the checksum of what landed: with `units`,
// unit_checksum's value (pack.h); otherwise hash_payload's (XXH3_64 of the payload in mode's wire
// order). Error as rma_readable.
uint64_t rma_read_message(Window& window, int src_world, int64_t src_num_blocks,
                          const TransferPlan& plan, int message_index, TransferMode mode,
                          bool units, BlockPool& dst);

// Several messages of one source, in order, each read as rma_read_message (pack_offset < 0) or
// rma_read_packed (pack_offset: where it lies in the source's pack area) would, checked by unit
// checksums where `units`; consecutive ones that go straight into an HND pool with unit checksums
// share one pipeline of gets (the next message's gets are posted while the previous one's land).
// Returns each message's checksum of what landed.
struct RmaReadJob {
    int message_index = 0;
    bool units = false;
    int64_t pack_offset = -1;
};
std::vector<uint64_t> rma_read_messages(RmaPoolWindow& window, int src_world,
                                        int64_t src_num_blocks, const TransferPlan& plan,
                                        std::span<const RmaReadJob> jobs, TransferMode mode,
                                        BlockPool& dst);

// The checksums of msg computed from its bytes where they lie in the destination pool (after any
// transfer of it): landed_unit_checksum equals unit_checksum (source seals) and landed_payload_hash
// equals hash_payload (the source's bytes in mode's wire order) when the bytes arrived intact.
uint64_t landed_unit_checksum(const TransferPlan& plan, const TransferMessage& msg,
                              const BlockPool& dst);
uint64_t landed_payload_hash(const TransferPlan& plan, const TransferMessage& msg,
                             TransferMode mode, const BlockPool& dst);

}  // namespace kvshard
