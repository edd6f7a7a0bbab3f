#include "kvshard/transfer/descriptors.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

struct Run {
    int64_t src = 0, dst = 0, bytes = 0;
};

// r, checked to be the pool of `rank` of that side.
const PoolRegion& checked_region(const TransferPlan& plan, const PoolRegion& r, bool source_side,
                                 int rank) {
    const char* side = source_side ? "source" : "destination";
    const TransferEndpoint& e = source_side ? plan.src : plan.dst;
    require(r.pages.geometry == rank_page_geometry(e.layout, rank, e.block_size, e.order), "the ",
            side, " pool of rank ", rank,
            " does not have that rank's page geometry: build it with side_pool_regions or "
            "rank_page_geometry");
    require(r.base >= 0, "the ", side, " pool of rank ", rank, " starts at a negative offset ",
            r.base);
    return r;
}

const PoolRegion& region_of(const TransferPlan& plan, std::span<const PoolRegion> regions,
                            bool source_side, int rank) {
    require(rank >= 0 && rank < static_cast<int>(regions.size()), "the ",
            source_side ? "source" : "destination", " pool region of rank ", rank, " is missing (",
            regions.size(), " given): give one per rank of that side's layout");
    return checked_region(plan, regions[static_cast<size_t>(rank)], source_side, rank);
}

// Appends r to runs, merged into the last run where it continues it on both sides.
void push(std::vector<Run>& runs, const Run& r) {
    if (!runs.empty()) {
        Run& last = runs.back();
        if (last.src + last.bytes == r.src && last.dst + last.bytes == r.dst) {
            last.bytes += r.bytes;
            return;
        }
    }
    runs.push_back(r);
}

// The message's bytes as runs that are contiguous on both sides, in walk order (layer, K/V,
// piece, then heads and tokens in the order both pages share, if any), merged as they come.
void message_runs(const TransferPlan& plan, const TransferMessage& msg, const PoolRegion& src,
                  const PoolRegion& dst, std::vector<Run>& runs) {
    const PageGeometry& gs = src.pages.geometry;
    const PageGeometry& gd = dst.pages.geometry;
    const RankKv& rs = plan.src.layout.ranks[msg.src_rank];
    const RankKv& rd = plan.dst.layout.ranks[msg.dst_rank];
    const bool mla = plan.src.layout.model.is_mla();
    const int sh0 = mla ? 0 : rs.kv_heads.front();
    const int dh0 = mla ? 0 : rd.kv_heads.front();
    const int64_t e = gs.elem_size();
    const int64_t vb = int64_t{gs.head_dim} * e;
    const int heads = msg.head_end - msg.head_begin;
    for (const TransferPiece& p : msg.pieces) {
        require(p.src_block < src.pages.num_blocks, "block ", p.src_block, " of source rank ",
                msg.src_rank, " is outside its pool of ", src.pages.num_blocks, " blocks");
        require(p.dst_block < dst.pages.num_blocks, "block ", p.dst_block, " of destination rank ",
                msg.dst_rank, " is outside its pool of ", dst.pages.num_blocks, " blocks");
    }
    for (int l = msg.layer_begin; l < msg.layer_end; ++l) {
        const int ls = l - rs.layer_begin, ld = l - rd.layer_begin;
        for (int kv = 0; kv < plan.kv_factor; ++kv) {
            for (const TransferPiece& p : msg.pieces) {
                const int64_t sp =
                    src.base +
                    ((int64_t{ls} * gs.kv_factor + kv) * src.pages.num_blocks + p.src_block) *
                        gs.page_bytes();
                const int64_t dp =
                    dst.base +
                    ((int64_t{ld} * gd.kv_factor + kv) * dst.pages.num_blocks + p.dst_block) *
                        gd.page_bytes();
                auto so = [&](int h, int j) {
                    return sp + gs.elem_in_page(h - sh0, p.src_slot + j, 0) * e;
                };
                auto dof = [&](int h, int j) {
                    return dp + gd.elem_in_page(h - dh0, p.dst_slot + j, 0) * e;
                };
                if (gs.order == PageOrder::kHnd && gd.order == PageOrder::kHnd) {
                    for (int h = msg.head_begin; h < msg.head_end; ++h)
                        push(runs, {so(h, 0), dof(h, 0), p.count * vb});
                } else if (gs.order == PageOrder::kNhd && gd.order == PageOrder::kNhd) {
                    for (int j = 0; j < p.count; ++j)
                        push(runs, {so(msg.head_begin, j), dof(msg.head_begin, j), heads * vb});
                } else {
                    // Transposed: head vectors, in the source's order.
                    const bool head_major = gs.order == PageOrder::kHnd;
                    const int outer = head_major ? heads : p.count;
                    const int inner = head_major ? p.count : heads;
                    for (int a = 0; a < outer; ++a)
                        for (int b = 0; b < inner; ++b) {
                            const int h = msg.head_begin + (head_major ? a : b);
                            const int j = head_major ? b : a;
                            push(runs, {so(h, j), dof(h, j), vb});
                        }
                }
            }
        }
    }
}

// Runs sorted by `key` merged where they continue on the side(s) checked.
int64_t count_merged(std::vector<Run>& runs, bool by_src, bool both) {
    std::sort(runs.begin(), runs.end(), [by_src](const Run& a, const Run& b) {
        return by_src ? a.src < b.src : a.dst < b.dst;
    });
    int64_t count = 0;
    for (size_t i = 0; i < runs.size(); ++i) {
        const bool continues =
            i > 0 &&
            (by_src ? runs[i - 1].src + runs[i - 1].bytes == runs[i].src
                    : runs[i - 1].dst + runs[i - 1].bytes == runs[i].dst) &&
            (!both || (by_src ? runs[i - 1].dst + runs[i - 1].bytes == runs[i].dst
                              : runs[i - 1].src + runs[i - 1].bytes == runs[i].src));
        if (!continues) ++count;
    }
    return count;
}

// The runs merged on both sides, sorted by source offset (runs is left sorted by source).
std::vector<Run> merge_both(std::vector<Run>& runs) {
    std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.src < b.src; });
    std::vector<Run> out;
    for (const Run& r : runs) push(out, r);
    return out;
}

}  // namespace

std::vector<PoolRegion> side_pool_regions(const TransferPlan& plan, bool source_side,
                                          int64_t num_blocks) {
    std::vector<PoolRegion> out;
    for (const PoolPages& p : side_pool_pages(plan, source_side, num_blocks)) out.push_back({p, 0});
    return out;
}

TransferDescriptors make_transfer_descriptors(const TransferPlan& plan,
                                              std::span<const PoolRegion> src_regions,
                                              std::span<const PoolRegion> dst_regions,
                                              const DescriptorOptions& options) {
    require_executable(
        plan,
        "descriptors cover pools of one page shape (models whose every layer is full "
        "attention or MLA of one shape)");
    TransferDescriptors out;
    out.pages_differ =
        plan.src.order != plan.dst.order || plan.src.block_size != plan.dst.block_size;
    std::vector<Run> runs;
    for (const TransferMessage& msg : plan.messages) {
        const PoolRegion& src = region_of(plan, src_regions, true, msg.src_rank);
        const PoolRegion& dst = region_of(plan, dst_regions, false, msg.dst_rank);
        runs.clear();
        message_runs(plan, msg, src, dst, runs);
        out.per_block_descriptor_count +=
            int64_t{msg.num_layers()} * plan.kv_factor * static_cast<int64_t>(msg.pieces.size());
        const std::vector<Run> merged = merge_both(runs);
        out.post_receive_count += count_merged(runs, true, false);
        out.pre_send_count += count_merged(runs, false, false);
        DescriptorGroup g;
        g.src_rank = msg.src_rank;
        g.dst_rank = msg.dst_rank;
        g.layer_group = msg.layer_group;
        g.first = out.descriptor_count;
        g.count = static_cast<int64_t>(merged.size());
        for (const Run& r : merged) {
            g.bytes += r.bytes;
            if (options.max_listed < 0 ||
                static_cast<int64_t>(out.descriptors.size()) < options.max_listed)
                out.descriptors.push_back(
                    {msg.src_rank, msg.dst_rank, msg.layer_group, r.src, r.dst, r.bytes});
        }
        KVSHARD_CHECK(g.bytes == msg.bytes, "descriptors of a message cover its bytes");
        out.descriptor_count += g.count;
        out.bytes += g.bytes;
        out.groups.push_back(g);
    }
    out.fewer_mode = out.pre_send_count < out.post_receive_count ? TransferMode::kPreSend
                                                                 : TransferMode::kPostReceive;
    return out;
}

std::vector<TransferDescriptor> message_descriptors(const TransferPlan& plan, int message_index,
                                                    const PoolRegion& src_region,
                                                    const PoolRegion& dst_region) {
    require_executable(
        plan,
        "descriptors cover pools of one page shape (models whose every layer is full "
        "attention or MLA of one shape)");
    require(message_index >= 0 && message_index < static_cast<int>(plan.messages.size()),
            "message ", message_index, " is not one of the plan's ", plan.messages.size());
    const TransferMessage& msg = plan.messages[static_cast<size_t>(message_index)];
    const PoolRegion& src = checked_region(plan, src_region, true, msg.src_rank);
    const PoolRegion& dst = checked_region(plan, dst_region, false, msg.dst_rank);
    std::vector<Run> runs;
    message_runs(plan, msg, src, dst, runs);
    std::vector<TransferDescriptor> out;
    for (const Run& r : merge_both(runs))
        out.push_back({msg.src_rank, msg.dst_rank, msg.layer_group, r.src, r.dst, r.bytes});
    return out;
}

std::string to_json(const TransferDescriptors& d) {
    nlohmann::json groups = nlohmann::json::array();
    for (const DescriptorGroup& g : d.groups)
        groups.push_back({{"src", g.src_rank},
                          {"dst", g.dst_rank},
                          {"layer_group", g.layer_group},
                          {"count", g.count},
                          {"bytes", g.bytes}});
    nlohmann::json list = nlohmann::json::array();
    for (const TransferDescriptor& x : d.descriptors)
        list.push_back({{"src", x.src_rank},
                        {"src_offset", x.src_offset},
                        {"dst", x.dst_rank},
                        {"dst_offset", x.dst_offset},
                        {"bytes", x.bytes},
                        {"layer_group", x.layer_group}});
    nlohmann::json j = {{"descriptor_count", d.descriptor_count},
                        {"per_block_descriptor_count", d.per_block_descriptor_count},
                        {"pre_send_count", d.pre_send_count},
                        {"post_receive_count", d.post_receive_count},
                        {"pages_differ", d.pages_differ},
                        {"fewer_mode", transfer_mode_name(d.fewer_mode)},
                        {"bytes", d.bytes},
                        {"groups", groups},
                        {"descriptors_listed", d.descriptors.size()},
                        {"descriptors", list}};
    return j.dump(2);
}

}  // namespace kvshard
