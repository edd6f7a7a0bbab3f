#pragma once
// Transfer descriptors: the (source rank, source offset, destination rank, destination offset,
// bytes) runs a one-sided transport (RDMA writes/reads, NIXL's xfer descriptor lists) posts to
// carry out a TransferPlan between two sides' pools, and how many a per-block scheme would post
// (docs/transfer.md, "Descriptors"). A pure function of the plan and both sides' pool pages.
//
// A descriptor is a maximal run: bytes contiguous in the source pool and in the destination pool,
// merged wherever consecutive runs continue on both sides. Offsets are bytes from the region base
// of the rank's pool (PoolRegion::base, 0 by default) plus the BlockPool byte layout
// (block_pool.h): page(l, kv, b) at ((l * kv_factor + kv) * num_blocks + b) * page_bytes, HND or
// NHD inside the page. fp8 scales are not covered (pack_scales moves them).
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"
#include "kvshard/transfer/transfer_schedule.h"

namespace kvshard {

// One rank's pool as the transport sees it: its pages and where the pool's arena starts in the
// rank's registered memory.
struct PoolRegion {
    PoolPages pages;
    int64_t base = 0;
    bool operator==(const PoolRegion&) const = default;
};
// Regions of every rank of one side of `plan`, pools of num_blocks blocks at base 0.
std::vector<PoolRegion> side_pool_regions(const TransferPlan& plan, bool source_side,
                                          int64_t num_blocks);

struct TransferDescriptor {
    int src_rank = 0, dst_rank = 0;
    int layer_group = 0;
    int64_t src_offset = 0, dst_offset = 0;
    int64_t bytes = 0;
    bool operator==(const TransferDescriptor&) const = default;
};

// The descriptors of one (source, destination) pair and layer group: a contiguous slice of
// TransferDescriptors::descriptors.
struct DescriptorGroup {
    int src_rank = 0, dst_rank = 0;
    int layer_group = 0;
    int64_t first = 0;  // index of its first descriptor
    int64_t count = 0;  // its descriptors (all counted, listed or not)
    int64_t bytes = 0;
    bool operator==(const DescriptorGroup&) const = default;
};

struct DescriptorOptions {
    // Descriptors kept in the list (all are counted): -1 all. A 128K-token TP reshape has millions.
    int64_t max_listed = -1;
};

struct TransferDescriptors {
    // Grouped by (layer group, source, destination) in plan order; within a group by source
    // offset. Only the first max_listed are kept.
    std::vector<TransferDescriptor> descriptors;
    std::vector<DescriptorGroup> groups;
    int64_t descriptor_count = 0;  // pool to pool: runs contiguous on both sides
    int64_t bytes = 0;             // = plan.bytes
    // A per-block scheme (vLLM's NixlConnector): one descriptor per (layer, K/V, block) of each
    // peer pair, a block's head range of the peer; where block sizes differ, per piece (a run of
    // tokens in one source and one destination block).
    int64_t per_block_descriptor_count = 0;
    // With a reshape on one side, only that side's pool needs long runs: pre-send packs the source
    // into a staging buffer laid out as the destination's runs (descriptors: runs contiguous in the
    // destination pool); post-receive lands the source's runs in a staging buffer and unpacks
    // (runs contiguous in the source pool).
    int64_t pre_send_count = 0;
    int64_t post_receive_count = 0;
    // Whether the two sides' pages differ in order or block size (the case a reshape is for).
    bool pages_differ = false;
    // The reshape mode with fewer descriptors (ties: post-receive) and its count.
    TransferMode fewer_mode = TransferMode::kPostReceive;
    int64_t fewer_count() const {
        return fewer_mode == TransferMode::kPreSend ? pre_send_count : post_receive_count;
    }
};

// src_regions[r] / dst_regions[r]: source / destination layout rank r (Error when a rank of a
// message is missing, its geometry is not the plan's, or a block lies outside its pool). Plans of
// uniform models only (rank_page_geometry).
TransferDescriptors make_transfer_descriptors(const TransferPlan& plan,
                                              std::span<const PoolRegion> src_regions,
                                              std::span<const PoolRegion> dst_regions,
                                              const DescriptorOptions& options = {});

// The descriptors of one message of the plan (plan.messages[message_index]): its group of
// make_transfer_descriptors, in the same order, with the same checks of the two regions.
std::vector<TransferDescriptor> message_descriptors(const TransferPlan& plan, int message_index,
                                                    const PoolRegion& src_region,
                                                    const PoolRegion& dst_region);

// {"descriptor_count", "per_block_descriptor_count", "pre_send_count", "post_receive_count",
//  "pages_differ", "fewer_mode", "bytes", "groups": [{"src", "dst", "layer_group", "count",
//  "bytes"}], "descriptors": [[src, src_offset, dst, dst_offset, bytes, layer_group], ...],
//  "descriptors_listed"}
std::string to_json(const TransferDescriptors& d);

}  // namespace kvshard
