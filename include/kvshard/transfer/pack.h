#pragma once
// Pack and unpack the messages of a TransferPlan between BlockPools (docs/transfer.md).
//
// The wire payload of a message lists, for layer ascending, for kv (K then V; MLA: the latent), for
// each piece in order, the piece's rectangle of heads [head_begin, head_end) x its tokens, each
// cell a head_dim-element vector, in one of two orders:
//  - pre-send: the destination's page order. The sender gathers (reshapes) from its pages; the
//    receiver copies runs that are contiguous in its pages straight in.
//  - post-receive: the source's page order. The sender copies its pages' runs as they are; the
//    receiver scatters them into its own layout.
// Either mode leaves byte-identical destination pools. Consecutive copies that continue in both
// buffers are merged into one memcpy.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/transfer/source_checksums.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {

enum class TransferMode { kPreSend, kPostReceive, kAuto };
std::string_view transfer_mode_name(TransferMode m);  // "pre-send", "post-receive", "auto"
TransferMode parse_transfer_mode(
    std::string_view s);  // pre-send|post-receive|auto; Error otherwise

// The page order of a message's payload under mode (kPreSend or kPostReceive).
PageOrder wire_order(const TransferPlan& plan, TransferMode mode);

// memcpy calls that packing (sender) and unpacking (receiver) the whole plan in `mode` issue.
struct CopyCounts {
    int64_t pack = 0;
    int64_t unpack = 0;
    int64_t total() const { return pack + unpack; }
};
CopyCounts count_copies(const TransferPlan& plan, TransferMode mode);

// kAuto -> the mode whose pack + unpack take fewer memcpy calls (fewer, longer copies run faster);
// on a tie, pre-send. Other modes are returned as they are.
TransferMode resolve_mode(const TransferPlan& plan, TransferMode mode);

// The mode each of plan.groups moves in under `mode`: a token group's is resolve_mode of its own
// plan (the plan itself for a model of one group, else group_transfer_plan), which is what the
// executor and `kvshard run --prefill ... --decode ...` use; a state group's is nullopt (its state
// messages are copied whole, with no page reshape).
std::vector<std::optional<TransferMode>> resolve_group_modes(const TransferPlan& plan,
                                                             TransferMode mode);

// The modes of resolve_group_modes in a line: one name where every token group resolves to the
// same mode ("pre-send"), else each group's ("0 sliding(128): pre-send, 1 full: post-receive");
// "none" for a plan of state groups only.
std::string group_modes_text(const TransferPlan& plan, TransferMode mode);
// The same line for modes already resolved (one per plan.groups entry, as resolve_group_modes).
std::string group_modes_text(const TransferPlan& plan,
                             std::span<const std::optional<TransferMode>> modes);

// Writes message `msg`'s payload (msg.bytes bytes) from the source rank's pool into `out`.
// `pool` must have the source rank's page geometry (rank_page_geometry); Error otherwise, or when a
// block id is outside the pool or `out` has the wrong size. mode must not be kAuto.
void pack_message(const TransferPlan& plan, const TransferMessage& msg, TransferMode mode,
                  const BlockPool& pool, std::span<std::byte> out);

// Copies a payload made by pack_message (same plan, message and mode) into the destination rank's
// pool.
void unpack_message(const TransferPlan& plan, const TransferMessage& msg, TransferMode mode,
                    std::span<const std::byte> in, BlockPool& pool);

// The pool byte offset of msg's payload when, on that side (source_side: the source rank's pool),
// the payload in mode's wire order is one contiguous run of the pool, so that it can be sent from
// or received into the pool itself with no staging copy; -1 otherwise. Same checks as pack_message.
int64_t contiguous_payload_offset(const TransferPlan& plan, const TransferMessage& msg,
                                  TransferMode mode, bool source_side, const BlockPool& pool);
// The same from the pool's page description alone (geometry and block count; no checks of them).
int64_t contiguous_payload_offset(const TransferPlan& plan, const TransferMessage& msg,
                                  TransferMode mode, bool source_side, const PageGeometry& geometry,
                                  int64_t num_blocks);

// A message's copies between one side's pool and its payload, as a list a copy engine can carry
// out without the plan (the CUDA backend's pack/unpack kernels, src/cuda/): the same copies, in
// the same wire order, that pack_message (source_side) or unpack_message (destination side) make,
// merged where they continue in both buffers. Each run is `count` copies of `len` bytes, copy i
// between pool byte pool + i * pool_step and payload byte wire + i * wire_step (a transpose's
// head_dim vectors; count 1 otherwise). The runs cover the payload [0, msg.bytes) once.
// `geometry` and num_blocks describe that side's pool (the rank's geometry; Error otherwise, or
// when a block of msg lies outside it, or mode is kAuto). fp8 scales are not included
// (pack_scales).
struct CopyRun {
    int64_t pool = 0, pool_step = 0;
    int64_t wire = 0, wire_step = 0;
    int64_t len = 0;
    int64_t count = 1;
    int64_t bytes() const { return len * count; }
    bool operator==(const CopyRun&) const = default;
};
std::vector<CopyRun> message_copy_runs(const TransferPlan& plan, const TransferMessage& msg,
                                       TransferMode mode, bool source_side,
                                       const PageGeometry& geometry, int64_t num_blocks);

// Batches: several messages of one source rank (pack) or one destination rank (unpack) that share
// their layer range, in one pass interleaved by (layer, K/V, piece): messages that differ only by
// heads (a TP reshape) then touch each page once, in address order. Same bytes as one call per
// message.
// xxh3: empty, or one entry per message that receives XXH3_64bits(payload) (seed 0) of the payload
// written (pack) or read (unpack), computed while copying, each piece hashed right after it is
// copied (no second pass over the payload). Unpack writes the pool before the caller can compare
// the hash: on a mismatch the message's destination blocks hold the corrupt bytes (they belong to
// that request only, which fails).
void pack_messages(const TransferPlan& plan, std::span<const TransferMessage* const> msgs,
                   TransferMode mode, const BlockPool& pool,
                   std::span<const std::span<std::byte>> outs, std::span<uint64_t> xxh3 = {});
void unpack_messages(const TransferPlan& plan, std::span<const TransferMessage* const> msgs,
                     TransferMode mode, std::span<const std::span<const std::byte>> ins,
                     BlockPool& pool, std::span<uint64_t> xxh3 = {});

// Direct read: the destination copies a message's bytes straight from the source rank's pool,
// mapped into its own process (a shareable pool: common/shared_arena.h), into its pool: one copy,
// no payload in between (transfer_exec.h).
//
// The source pool's arena as the destination sees it.
struct SourceArena {
    const std::byte* data = nullptr;
    int64_t bytes = 0;       // readable bytes from data
    int64_t num_blocks = 0;  // blocks of the source pool (its pages' offsets depend on it)
};

// XXH3_64bits (seed 0) of msg's payload in mode's wire order, read from the source rank's pool:
// the value pack_messages computes, without writing a payload. Same checks as pack_message.
uint64_t hash_payload(const TransferPlan& plan, const TransferMessage& msg, TransferMode mode,
                      const BlockPool& pool);

// Copies msg's bytes from the source arena (source rank msg.src_rank's geometry) into the
// destination pool, each byte once, visiting them in mode's wire order, and returns XXH3_64bits of
// the bytes read: hash_payload's value where the arena holds what the source hashed. The
// destination pool ends up as after pack_message + unpack_message. Error when the arena is too
// small for its geometry and num_blocks, or a block id of msg is outside either pool.
uint64_t copy_direct(const TransferPlan& plan, const TransferMessage& msg, TransferMode mode,
                     const SourceArena& src, BlockPool& dst);

// fp8 KV scales (docs/cache.md, "Element types"). The pages of an fp8 pool move as above, byte for
// byte; each (layer, K/V, piece, head) unit of a message (the order below) also carries its
// source block's fp32 scale of that head, so the destination block holds the source block's codes
// and scale unchanged. An fp8 plan has the same block size on both sides and cp = 1, so every piece
// keeps its slots (make_transfer_plan). message_scales: the count (0 unless the KV is fp8).
int64_t message_scales(const TransferPlan& plan, const TransferMessage& msg);
// The scales of msg from the source rank's pool (its geometry; Error otherwise, as pack_message),
// into `out` (message_scales floats).
void pack_scales(const TransferPlan& plan, const TransferMessage& msg, const BlockPool& pool,
                 std::span<float> out);
// Writes them to the destination rank's pool.
void unpack_scales(const TransferPlan& plan, const TransferMessage& msg, std::span<const float> in,
                   BlockPool& pool);

// Unit checksums (source_checksums.h): a message's units are its (layer, K/V, piece, head) in
// that order (layer ascending, K then V, pieces in order, heads ascending), each the piece's slots
// of that head in its source block.
//
// The unit checksum of msg from the seals of the source pool (sums.pool(), which must have the
// source rank's geometry; Error otherwise): XXH3_64 of the array of its units' checksums, or
// nothing when some piece does not read a whole sealed block (slots [0, sealed tokens)), e.g. a
// block split between destination blocks or CP copies, or not sealed.
std::optional<uint64_t> unit_checksum(const TransferPlan& plan, const TransferMessage& msg,
                                      const SourceChecksums& sums);

// Direct read with unit checksums: copies msg's bytes from the source arena (an HND source; Error
// otherwise, and as copy_direct) into the destination pool, unit by unit, each hashed right after
// it is copied, and returns XXH3_64 of the array of those hashes: unit_checksum's value where the
// arena holds what was sealed. The destination pool ends up as after copy_direct.
uint64_t copy_direct_units(const TransferPlan& plan, const TransferMessage& msg,
                           const SourceArena& src, BlockPool& dst);

}  // namespace kvshard
