#pragma once
// TransferSchedule: how each message of a TransferPlan travels, decided once from the plan, both
// sides' page descriptions and the options (docs/transfer.md, "Schedule"), so that the sender and
// the receiver carry it out without deciding. A pure function of values, printable and tested by
// tables.
//
// Per message:
//  - path: kDirectRead (direct reads agreed: only a header travels, the destination copies the
//    bytes from the source pool), kZeroCopy (the payload is one run of the source pool and is sent
//    from it), or kBatched (packed into staging, together with the other messages of its batch);
//  - src_offset: kZeroCopy: the payload's byte offset in the source pool;
//  - dst_offset: where the payload is one run of the destination pool, its byte offset there (the
//    receiver receives straight into the pool), else -1 (received into staging, then unpacked);
//  - batch: kBatched: messages of one source rank with the same batch are packed in one pass over
//    the pages: consecutive messages (in the sender's order) of one layer range, at most
//    staging_bytes together (a message larger than that is a batch of its own).
// A sender's messages are in plan order (layer group, then destination); a receiver's in plan
// order per source.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {

// What a schedule needs of one rank's pool: its page geometry and block count (page offsets
// depend on both, block_pool.h).
struct PoolPages {
    PageGeometry geometry;
    int64_t num_blocks = 0;
    bool operator==(const PoolPages&) const = default;
};
PoolPages pool_pages(const BlockPool& pool);
// The pages of every rank of one side of `plan`, each with num_blocks blocks.
std::vector<PoolPages> side_pool_pages(const TransferPlan& plan, bool source_side,
                                       int64_t num_blocks);

struct TransferScheduleOptions {
    TransferMode mode = TransferMode::kAuto;  // resolved with resolve_mode
    bool direct_read = false;                 // every destination reads its sources in place
    int64_t staging_bytes = int64_t{64} << 20;
};

enum class TransferPath { kDirectRead, kZeroCopy, kBatched };
std::string_view transfer_path_name(TransferPath p);  // "direct-read" | "zero-copy" | "batched"

struct ScheduledMessage {
    int message = 0;  // index in plan.messages
    int src_rank = 0, dst_rank = 0;
    int layer_group = 0;
    int64_t bytes = 0;
    TransferPath path = TransferPath::kBatched;
    int64_t src_offset = -1;
    int64_t dst_offset = -1;
    int batch = -1;
    bool operator==(const ScheduledMessage&) const = default;
};

struct TransferSchedule {
    TransferMode mode = TransferMode::kPreSend;  // resolved
    bool direct_read = false;
    int64_t staging_bytes = 0;
    std::vector<ScheduledMessage> messages;  // one per plan message, in plan order
    // Per source rank / destination rank: indices into messages, in the order that rank handles
    // them.
    std::vector<std::vector<int>> sends, receives;
    // The page descriptions it was made for (empty: that side was not given).
    std::vector<PoolPages> src_pools, dst_pools;
};

// src_pools[r] / dst_pools[r]: the pool of source / destination layout rank r (Error when a rank is
// missing or its geometry is not the plan's for that rank). One side may be left empty, or a rank's
// entry have num_blocks 0 (a sender or a receiver that knows only its own pool): the offsets there
// are then -1, and a message with no source pages that is not a direct read is kBatched.
TransferSchedule make_transfer_schedule(const TransferPlan& plan,
                                        std::span<const PoolPages> src_pools,
                                        std::span<const PoolPages> dst_pools,
                                        const TransferScheduleOptions& options);

// One line per message, grouped by source rank: index, destination, layer group, bytes, path,
// offsets, batch.
std::string to_text(const TransferSchedule& schedule);

}  // namespace kvshard
