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
#include <cstdint>
#include <memory>

#include "kvshard/cache/block_pool.h"
#include "kvshard/comm/communicator.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {

// A window over every source pool of the transfers on one world communicator. Made once,
// collectively, by every rank of `world` (the communicator the senders and receivers use), and
// kept across requests: source ranks pass their pool (its arena is exposed), the others null.
// Destroyed on every rank together, after the last transfer that uses it.
class RmaPoolWindow {
  public:
    RmaPoolWindow(Communicator& world, BlockPool* pool);
    Window& window() { return *window_; }
    // Bytes world rank `world_rank` exposed (its pool's arena; 0 where it passed none).
    int64_t region_bytes(int world_rank) const { return window_->region_bytes(world_rank); }
    Backend backend() const { return backend_; }

  private:
    std::unique_ptr<Window> window_;
    Backend backend_;
};

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

// The checksums of msg computed from its bytes where they lie in the destination pool (after any
// transfer of it): landed_unit_checksum equals unit_checksum (source seals) and landed_payload_hash
// equals hash_payload (the source's bytes in mode's wire order) when the bytes arrived intact.
uint64_t landed_unit_checksum(const TransferPlan& plan, const TransferMessage& msg,
                              const BlockPool& dst);
uint64_t landed_payload_hash(const TransferPlan& plan, const TransferMessage& msg,
                             TransferMode mode, const BlockPool& dst);

}  // namespace kvshard
