#include "kvshard/transfer/transfer_schedule.h"

#include <fmt/format.h>

#include <utility>

#include "kvshard/common/error.h"

namespace kvshard {

PoolPages pool_pages(const BlockPool& pool) { return {pool.geometry(), pool.num_blocks()}; }

std::vector<PoolPages> side_pool_pages(const TransferPlan& plan, bool source_side,
                                       int64_t num_blocks) {
    const TransferEndpoint& e = source_side ? plan.src : plan.dst;
    std::vector<PoolPages> out;
    for (int r = 0; r < static_cast<int>(e.layout.ranks.size()); ++r)
        out.push_back({rank_page_geometry(e.layout, r, e.block_size, e.order), num_blocks});
    return out;
}

std::string_view transfer_path_name(TransferPath p) {
    switch (p) {
        case TransferPath::kDirectRead:
            return "direct-read";
        case TransferPath::kZeroCopy:
            return "zero-copy";
        case TransferPath::kBatched:
            return "batched";
    }
    return "?";
}

namespace {

const PoolPages& rank_pages(const TransferPlan& plan, std::span<const PoolPages> pools,
                            bool source_side, int rank) {
    const char* side = source_side ? "source" : "destination";
    require(rank >= 0 && rank < static_cast<int>(pools.size()), "the ", side,
            " pool pages of rank ", rank, " are missing (", pools.size(), " given)");
    const TransferEndpoint& e = source_side ? plan.src : plan.dst;
    const PoolPages& p = pools[size_t(rank)];
    require(p.geometry == rank_page_geometry(e.layout, rank, e.block_size, e.order), "the ", side,
            " pool of rank ", rank, " does not have that rank's page geometry");
    return p;
}

void check_blocks(const TransferMessage& msg, bool source_side, const PoolPages& p) {
    const int rank = source_side ? msg.src_rank : msg.dst_rank;
    for (const TransferPiece& piece : msg.pieces) {
        const int32_t b = source_side ? piece.src_block : piece.dst_block;
        require(b < p.num_blocks, "block ", b, " of rank ", rank, " is outside its pool of ",
                p.num_blocks, " blocks");
    }
}

// A side's pages of `rank` are given unless the side is empty or they have no blocks.
bool given(std::span<const PoolPages> pools, int rank) {
    return !pools.empty() &&
           (rank >= static_cast<int>(pools.size()) || pools[size_t(rank)].num_blocks > 0);
}

}  // namespace

TransferSchedule make_transfer_schedule(const TransferPlan& plan,
                                        std::span<const PoolPages> src_pools,
                                        std::span<const PoolPages> dst_pools,
                                        const TransferScheduleOptions& options) {
    TransferSchedule s;
    s.mode = resolve_mode(plan, options.mode);
    s.direct_read = options.direct_read;
    s.staging_bytes = options.staging_bytes;
    s.src_pools.assign(src_pools.begin(), src_pools.end());
    s.dst_pools.assign(dst_pools.begin(), dst_pools.end());
    s.sends.resize(plan.src.layout.ranks.size());
    s.receives.resize(plan.dst.layout.ranks.size());
    for (int i = 0; i < static_cast<int>(plan.messages.size()); ++i) {
        const TransferMessage& msg = plan.messages[size_t(i)];
        ScheduledMessage m;
        m.message = i;
        m.src_rank = msg.src_rank;
        m.dst_rank = msg.dst_rank;
        m.layer_group = msg.layer_group;
        m.bytes = msg.bytes;
        if (options.direct_read) {
            m.path = TransferPath::kDirectRead;
        } else {
            if (given(src_pools, msg.src_rank)) {
                const PoolPages& src = rank_pages(plan, src_pools, true, msg.src_rank);
                check_blocks(msg, true, src);
                m.src_offset = contiguous_payload_offset(plan, msg, s.mode, true, src.geometry,
                                                         src.num_blocks);
            }
            m.path = m.src_offset >= 0 ? TransferPath::kZeroCopy : TransferPath::kBatched;
        }
        if (given(dst_pools, msg.dst_rank)) {
            const PoolPages& dst = rank_pages(plan, dst_pools, false, msg.dst_rank);
            check_blocks(msg, false, dst);
            m.dst_offset =
                contiguous_payload_offset(plan, msg, s.mode, false, dst.geometry, dst.num_blocks);
        }
        s.messages.push_back(m);
    }
    for (int r = 0; r < static_cast<int>(s.sends.size()); ++r)
        s.sends[size_t(r)] = plan.messages_from(r);
    for (int r = 0; r < static_cast<int>(s.receives.size()); ++r)
        s.receives[size_t(r)] = plan.messages_to(r);
    // Batches: per sender, consecutive batched messages of one layer range within staging_bytes.
    int next_batch = 0;
    for (const auto& sends : s.sends) {
        int open = -1;  // the batch being filled, and its bytes and layer range
        int64_t open_bytes = 0;
        std::pair<int, int> open_layers{-1, -1};
        for (int k : sends) {
            ScheduledMessage& m = s.messages[size_t(k)];
            if (m.path != TransferPath::kBatched) {
                open = -1;
                continue;
            }
            const TransferMessage& msg = plan.messages[size_t(k)];
            const std::pair<int, int> layers{msg.layer_begin, msg.layer_end};
            if (open >= 0 && layers == open_layers && open_bytes + m.bytes <= s.staging_bytes) {
                m.batch = open;
                open_bytes += m.bytes;
                continue;
            }
            open = m.batch = next_batch++;
            open_bytes = m.bytes;
            open_layers = layers;
        }
    }
    return s;
}

std::string to_text(const TransferSchedule& s) {
    std::string out =
        fmt::format("schedule: mode {}, {}, staging {} bytes\n", transfer_mode_name(s.mode),
                    s.direct_read ? "direct reads" : "messages", s.staging_bytes);
    out += fmt::format("{:>4} {:>4} {:>7} {:>5} {:>12}  {:<11} {:>12} {:>12} {:>5}\n", "src", "dst",
                       "message", "group", "bytes", "path", "src_offset", "dst_offset", "batch");
    auto off = [](int64_t o) { return o < 0 ? std::string("-") : fmt::format("{}", o); };
    for (const auto& sends : s.sends)
        for (int k : sends) {
            const ScheduledMessage& m = s.messages[size_t(k)];
            out += fmt::format("{:>4} {:>4} {:>7} {:>5} {:>12}  {:<11} {:>12} {:>12} {:>5}\n",
                               m.src_rank, m.dst_rank, m.message, m.layer_group, m.bytes,
                               transfer_path_name(m.path), off(m.src_offset), off(m.dst_offset),
                               m.batch < 0 ? std::string("-") : fmt::format("{}", m.batch));
        }
    return out;
}

}  // namespace kvshard
