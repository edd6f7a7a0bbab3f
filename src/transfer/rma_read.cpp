#include "kvshard/transfer/rma_read.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <optional>
#include <vector>

#include "kvshard/common/error.h"
#include "kvshard/common/large_alloc.h"
#include "kvshard/common/xxh3.h"
#include "kvshard/transfer/descriptors.h"
#include "kvshard/transfer/transfer_schedule.h"

namespace kvshard {
namespace {

// First head of a rank's pages (MLA: one latent "head", 0).
int first_head(const TransferPlan& plan, const RankKv& rk) {
    return plan.src.layout.model.is_mla() ? 0 : rk.kv_heads.front();
}

void check_destination(const TransferPlan& plan, const TransferMessage& msg, const BlockPool& dst) {
    require(dst.geometry() == rank_page_geometry(plan.dst.layout, msg.dst_rank, plan.dst.block_size,
                                                 plan.dst.order),
            "the destination pool does not have destination rank ", msg.dst_rank,
            "'s page geometry");
    for (const TransferPiece& p : msg.pieces)
        require(p.dst_block >= 0 && p.dst_block < dst.num_blocks(), "block ", p.dst_block,
                " of destination rank ", msg.dst_rank, " is outside its pool of ", dst.num_blocks(),
                " blocks");
}

}  // namespace

RmaPoolWindow::RmaPoolWindow(Communicator& world, BlockPool* pool, int64_t pack_bytes)
    : window_(world.create_window(pool != nullptr ? pool->arena() : std::span<std::byte>())),
      backend_(world.backend()) {
    require(pack_bytes >= 0, "the pack area must be at least 0 bytes, got ", pack_bytes);
    if (pool != nullptr && pack_bytes > 0) {
        pack_mem_ = allocate_large(static_cast<size_t>(pack_bytes));
        pack_area_ = std::span<std::byte>(pack_mem_.get(), static_cast<size_t>(pack_bytes));
    }
    pack_window_ = world.create_window(pack_area_);  // collective, empty where none
}

std::string rma_readable(const TransferPlan& plan, const TransferMessage& msg,
                         int64_t src_num_blocks, int64_t region_bytes) {
    if (message_scales(plan, msg) > 0)
        return "the KV is fp8: its scales are not read through the window";
    const PageGeometry g =
        rank_page_geometry(plan.src.layout, msg.src_rank, plan.src.block_size, plan.src.order);
    if (src_num_blocks < 1 ||
        region_bytes < src_num_blocks * g.page_bytes() * int64_t{g.num_layers} * g.kv_factor)
        return detail::concat("source rank ", msg.src_rank, " exposes ", region_bytes,
                              " bytes, less than the pages of its ", src_num_blocks, " blocks");
    for (const TransferPiece& p : msg.pieces)
        if (p.src_block < 0 || p.src_block >= src_num_blocks)
            return detail::concat("block ", p.src_block, " of source rank ", msg.src_rank,
                                  " is outside its pool of ", src_num_blocks, " blocks");
    return "";
}

namespace {

// Bytes one get reads at most in the chunked read below: small enough that the chunk is still in
// the reader's L2 when its units are hashed, large enough that the per-get cost stays small.
constexpr int64_t kChunkBytes = int64_t{256} << 10;
// Gets of the chunked read in flight at once (a transport that moves them asynchronously, e.g.
// osc pt2pt over TCP, keeps the pipe full; CMA copies inside the get call).
constexpr size_t kChunksInFlight = 16;

struct Unit {
    int64_t dst = 0, bytes = 0;  // offset in the destination pool's arena
    size_t index = 0;            // in unit_checksum's order
};

// Units of msg in an HND destination, in unit_checksum's order.
void destination_units(const TransferPlan& plan, const TransferMessage& msg, const BlockPool& dst,
                       std::vector<Unit>& out) {
    const RankKv& drk = plan.dst.layout.ranks[static_cast<size_t>(msg.dst_rank)];
    const PageGeometry& dg = dst.geometry();
    const int64_t e = dg.elem_size(), vec = plan.vector_bytes();
    const int dh0 = first_head(plan, drk);
    const std::byte* base = dst.arena().data();
    out.clear();
    for (int l = msg.layer_begin; l < msg.layer_end; ++l)
        for (int kv = 0; kv < plan.kv_factor; ++kv)
            for (const TransferPiece& p : msg.pieces) {
                const int64_t page = dst.page(l - drk.layer_begin, kv, p.dst_block) - base;
                for (int h = msg.head_begin; h < msg.head_end; ++h)
                    out.push_back({page + dg.elem_in_page(h - dh0, p.dst_slot, 0) * e,
                                   p.count * vec, out.size()});
            }
}

// Unit checksums, read chunk by chunk: the runs in destination order, cut into chunks of at most
// kChunkBytes, a few gets in flight; each unit (a sub-run of one run: contiguous on both sides)
// is hashed as soon as the chunks under it landed, while they are in cache. Several messages
// (jobs) go through one pipeline, in order: the next one's gets are posted while the previous
// one's land (a transport that moves gets asynchronously, osc pt2pt over TCP, then has no gap
// between messages). out[j]: unit_checksum's value of what landed for job j.
struct UnitJob {
    const TransferMessage* msg = nullptr;
    std::vector<TransferDescriptor> runs;  // source offsets in the window read
};

void read_units_pipelined(Window& window, int src_world, std::span<UnitJob> jobs,
                          const TransferPlan& plan, BlockPool& dst, uint64_t* out) {
    struct JobUnits {
        std::vector<Unit> units;
        std::vector<uint64_t> hashes;
        size_t next = 0;
    };
    std::vector<JobUnits> ju(jobs.size());
    for (size_t j = 0; j < jobs.size(); ++j) {
        destination_units(plan, *jobs[j].msg, dst, ju[j].units);
        std::sort(ju[j].units.begin(), ju[j].units.end(),
                  [](const Unit& a, const Unit& b) { return a.dst < b.dst; });
        ju[j].hashes.assign(ju[j].units.size(), 0);
        std::sort(jobs[j].runs.begin(), jobs[j].runs.end(),
                  [](const TransferDescriptor& a, const TransferDescriptor& b) {
                      return a.dst_offset < b.dst_offset;
                  });
    }
    std::byte* base = dst.arena().data();
    struct Chunk {
        Request req;
        size_t job = 0;
        int64_t dst_end = 0;
        bool last = false;  // of its job
    };
    std::deque<Chunk> in_flight;
    // Waits for the oldest chunk, then hashes every unit of its job that lies below its end
    // (every byte of that job's runs before it has landed; units lie only in runs).
    auto land_one = [&] {
        Chunk c = std::move(in_flight.front());
        in_flight.pop_front();
        c.req.wait();
        JobUnits& u = ju[c.job];
        for (; u.next < u.units.size() && u.units[u.next].dst + u.units[u.next].bytes <= c.dst_end;
             ++u.next) {
            const Unit& x = u.units[u.next];
            u.hashes[x.index] = xxh3_64(base + x.dst, static_cast<size_t>(x.bytes));
        }
        if (c.last) {
            KVSHARD_CHECK(u.next == u.units.size(), "every unit of the message lies in its runs");
            out[c.job] = xxh3_64(u.hashes.data(), u.hashes.size() * sizeof(uint64_t));
        }
    };
    for (size_t j = 0; j < jobs.size(); ++j) {
        const std::vector<TransferDescriptor>& runs = jobs[j].runs;
        for (size_t r = 0; r < runs.size(); ++r) {
            const TransferDescriptor& d = runs[r];
            for (int64_t at = 0; at < d.bytes; at += kChunkBytes) {
                const int64_t n = std::min(kChunkBytes, d.bytes - at);
                if (in_flight.size() >= kChunksInFlight) land_one();
                Chunk c;
                c.req = window.get(
                    std::span<std::byte>(base + d.dst_offset + at, static_cast<size_t>(n)),
                    src_world, d.src_offset + at);
                c.job = j;
                c.dst_end = d.dst_offset + at + n;
                c.last = r + 1 == runs.size() && at + n >= d.bytes;
                in_flight.push_back(std::move(c));
                // A transport that copies inside the get (CMA on one host) has landed it
                // already: hash it now, while it is in cache, not kChunksInFlight chunks later.
                while (!in_flight.empty() && in_flight.front().req.test()) land_one();
            }
        }
        if (runs.empty()) out[j] = xxh3_64(ju[j].hashes.data(), 0);
    }
    while (!in_flight.empty()) land_one();
}

uint64_t read_units_chunked(Window& window, int src_world, std::vector<TransferDescriptor> runs,
                            const TransferPlan& plan, const TransferMessage& msg, BlockPool& dst) {
    UnitJob job{&msg, std::move(runs)};
    uint64_t out = 0;
    read_units_pipelined(window, src_world, std::span<UnitJob>(&job, 1), plan, dst, &out);
    return out;
}

// Staged: where the message's payload in post-receive order (the source's page order) is one run
// of the source pool but many runs pool to pool (a TP reshape: each source head range is a part of
// every destination page), one get per chunk of that run into a staging buffer beats one get per
// descriptor (each get has a fixed cost: 16 KiB gets measured 3x slower than one big one), and
// the destination scatters it (unpack_message, post-receive). Checked while staged: the units lie
// one after the other in unit order (an HND source's post-receive payload), or the stream is the
// post-receive payload itself.
uint64_t read_staged(Window& window, int src_world, int64_t src_offset, const TransferPlan& plan,
                     const TransferMessage& msg, bool units, BlockPool& dst) {
    thread_local LargeBuffer staging;
    thread_local int64_t capacity = 0;
    if (capacity < msg.bytes) {
        staging = allocate_large(static_cast<size_t>(msg.bytes));
        capacity = msg.bytes;
    }
    std::byte* buf = staging.get();
    thread_local std::vector<int64_t> unit_bytes;
    thread_local std::vector<uint64_t> hashes;
    unit_bytes.clear();
    hashes.clear();
    if (units) {
        const int64_t vec = plan.vector_bytes();
        for (int l = msg.layer_begin; l < msg.layer_end; ++l)
            for (int kv = 0; kv < plan.kv_factor; ++kv)
                for (const TransferPiece& p : msg.pieces)
                    for (int h = msg.head_begin; h < msg.head_end; ++h)
                        unit_bytes.push_back(p.count * vec);
    }
    Xxh3Stream stream;
    struct Chunk {
        Request req;
        int64_t end = 0;
    };
    std::deque<Chunk> in_flight;
    size_t next_unit = 0;
    int64_t hashed = 0;  // staging bytes hashed so far
    auto land_one = [&] {
        Chunk c = std::move(in_flight.front());
        in_flight.pop_front();
        c.req.wait();
        if (!units) {
            stream.update(buf + hashed, static_cast<size_t>(c.end - hashed));
            hashed = c.end;
            return;
        }
        for (; next_unit < unit_bytes.size() && hashed + unit_bytes[next_unit] <= c.end;
             ++next_unit) {
            hashes.push_back(xxh3_64(buf + hashed, static_cast<size_t>(unit_bytes[next_unit])));
            hashed += unit_bytes[next_unit];
        }
    };
    for (int64_t at = 0; at < msg.bytes; at += kChunkBytes) {
        const int64_t n = std::min(kChunkBytes, msg.bytes - at);
        if (in_flight.size() >= kChunksInFlight) land_one();
        Chunk c;
        c.req = window.get(std::span<std::byte>(buf + at, static_cast<size_t>(n)), src_world,
                           src_offset + at);
        c.end = at + n;
        in_flight.push_back(std::move(c));
    }
    while (!in_flight.empty()) land_one();
    KVSHARD_CHECK(hashed == msg.bytes, "the staged payload was hashed whole");
    unpack_message(plan, msg, TransferMode::kPostReceive,
                   std::span<const std::byte>(buf, static_cast<size_t>(msg.bytes)), dst);
    return units ? xxh3_64(hashes.data(), hashes.size() * sizeof(uint64_t)) : stream.digest();
}

}  // namespace

uint64_t rma_read_message(Window& window, int src_world, int64_t src_num_blocks,
                          const TransferPlan& plan, int message_index, TransferMode mode,
                          bool units, BlockPool& dst) {
    const TransferMessage& msg = plan.messages.at(static_cast<size_t>(message_index));
    const std::string why = rma_readable(plan, msg, src_num_blocks, window.region_bytes(src_world));
    require(why.empty(), "an RMA read of message ", message_index, ": ", why);
    check_destination(plan, msg, dst);
    const PoolRegion src{
        {rank_page_geometry(plan.src.layout, msg.src_rank, plan.src.block_size, plan.src.order),
         src_num_blocks},
        0};
    const PoolRegion mine{pool_pages(dst), 0};
    std::vector<TransferDescriptor> runs = message_descriptors(plan, message_index, src, mine);
    // Many runs pool to pool but one in the source's order: staged (read_staged). Unit checksums
    // need an HND source (they always come from one); a payload checksum the post-receive order.
    if (runs.size() > 1 &&
        (units ? plan.src.order == PageOrder::kHnd : mode == TransferMode::kPostReceive)) {
        const int64_t off = contiguous_payload_offset(plan, msg, TransferMode::kPostReceive, true,
                                                      src.pages.geometry, src_num_blocks);
        if (off >= 0) return read_staged(window, src_world, off, plan, msg, units, dst);
    }
    // HND destination, unit checksums: chunked, each unit hashed from cache.
    if (units && dst.geometry().order == PageOrder::kHnd)
        return read_units_chunked(window, src_world, std::move(runs), plan, msg, dst);
    // Otherwise every run in one get, then one pass over the landed bytes.
    thread_local std::vector<std::byte*> outs;
    thread_local std::vector<int64_t> offsets, sizes;
    outs.clear();
    offsets.clear();
    sizes.clear();
    std::byte* base = dst.arena().data();
    for (const TransferDescriptor& d : runs) {
        outs.push_back(base + d.dst_offset);
        offsets.push_back(d.src_offset);
        sizes.push_back(d.bytes);
    }
    window.get_many(outs, offsets, sizes, src_world).wait();
    return units ? landed_unit_checksum(plan, msg, dst) : landed_payload_hash(plan, msg, mode, dst);
}

bool rma_pack_helps(const TransferPlan& plan, int message_index, int64_t src_num_blocks,
                    TransferMode mode, const BlockPool& dst) {
    const TransferMessage& msg = plan.messages.at(static_cast<size_t>(message_index));
    const PoolRegion src{
        {rank_page_geometry(plan.src.layout, msg.src_rank, plan.src.block_size, plan.src.order),
         src_num_blocks},
        0};
    const std::vector<TransferDescriptor> runs =
        message_descriptors(plan, message_index, src, PoolRegion{pool_pages(dst), 0});
    if (runs.size() <= 2 || msg.bytes >= static_cast<int64_t>(runs.size()) * kChunkBytes)
        return false;
    const bool staged_order =
        plan.src.order == PageOrder::kHnd || mode == TransferMode::kPostReceive;
    return !(staged_order && contiguous_payload_offset(plan, msg, TransferMode::kPostReceive, true,
                                                       src.pages.geometry, src_num_blocks) >= 0);
}

std::vector<int64_t> rma_pack_offsets(const TransferPlan& plan, int src_rank, int dst_rank,
                                      int64_t pack_bytes) {
    std::vector<int> dsts;
    for (const TransferMessage& m : plan.messages)
        if (m.src_rank == src_rank && std::find(dsts.begin(), dsts.end(), m.dst_rank) == dsts.end())
            dsts.push_back(m.dst_rank);
    const auto at = std::find(dsts.begin(), dsts.end(), dst_rank);
    if (at == dsts.end()) return {};
    const int64_t part = pack_bytes / static_cast<int64_t>(dsts.size()) / 64 * 64;
    const int64_t base = part * (at - dsts.begin());
    std::vector<int64_t> out;
    int64_t p = 0;
    for (const TransferMessage& m : plan.messages) {
        if (m.src_rank != src_rank || m.dst_rank != dst_rank) continue;
        if (m.bytes > part) return {};
        if (p + m.bytes > part) p = 0;
        out.push_back(base + p);
        p += (m.bytes + 63) / 64 * 64;
    }
    return out;
}

uint64_t rma_read_packed(Window& pack_window, int src_world, int64_t offset,
                         const TransferPlan& plan, int message_index, TransferMode mode, bool units,
                         BlockPool& dst) {
    const TransferMessage& msg = plan.messages.at(static_cast<size_t>(message_index));
    check_destination(plan, msg, dst);
    require(message_scales(plan, msg) == 0, "a packed RMA read of message ", message_index,
            ": the KV is fp8");
    require(offset >= 0 && offset + msg.bytes <= pack_window.region_bytes(src_world),
            "a packed RMA read of message ", message_index, " at ", offset, " lies outside the ",
            pack_window.region_bytes(src_world), "-byte pack area of rank ", src_world);
    const int64_t in_pool = contiguous_payload_offset(plan, msg, mode, false, dst);
    if (in_pool >= 0) {  // one run of my pool: straight in
        std::vector<TransferDescriptor> run(1);
        run[0].src_offset = offset;
        run[0].dst_offset = in_pool;
        run[0].bytes = msg.bytes;
        if (units && dst.geometry().order == PageOrder::kHnd)
            return read_units_chunked(pack_window, src_world, std::move(run), plan, msg, dst);
        pack_window
            .get(dst.arena().subspan(static_cast<size_t>(in_pool), static_cast<size_t>(msg.bytes)),
                 src_world, offset)
            .wait();
    } else {  // staged, then unpacked
        thread_local LargeBuffer staging;
        thread_local int64_t capacity = 0;
        if (capacity < msg.bytes) {
            staging = allocate_large(static_cast<size_t>(msg.bytes));
            capacity = msg.bytes;
        }
        const std::span<std::byte> buf(staging.get(), static_cast<size_t>(msg.bytes));
        pack_window.get(buf, src_world, offset).wait();
        unpack_message(plan, msg, mode, buf, dst);
    }
    return units ? landed_unit_checksum(plan, msg, dst) : landed_payload_hash(plan, msg, mode, dst);
}

std::vector<uint64_t> rma_read_messages(RmaPoolWindow& w, int src_world, int64_t src_num_blocks,
                                        const TransferPlan& plan, std::span<const RmaReadJob> jobs,
                                        TransferMode mode, BlockPool& dst) {
    std::vector<uint64_t> out(jobs.size(), 0);
    const bool hnd = dst.geometry().order == PageOrder::kHnd;
    // The runs of a job that goes through the pipeline (unit checksums, straight into an HND
    // pool, not staged), else nullopt.
    auto pipelined = [&](const RmaReadJob& j) -> std::optional<UnitJob> {
        if (!j.units || !hnd) return std::nullopt;
        const TransferMessage& msg = plan.messages.at(static_cast<size_t>(j.message_index));
        check_destination(plan, msg, dst);
        UnitJob u{&msg, {}};
        if (j.pack_offset >= 0) {
            Window& pw = w.pack_window();
            require(message_scales(plan, msg) == 0 &&
                        j.pack_offset + msg.bytes <= pw.region_bytes(src_world),
                    "a packed RMA read of message ", j.message_index, " at ", j.pack_offset,
                    " lies outside the ", pw.region_bytes(src_world), "-byte pack area of rank ",
                    src_world);
            const int64_t in_pool = contiguous_payload_offset(plan, msg, mode, false, dst);
            if (in_pool < 0) return std::nullopt;
            TransferDescriptor d;
            d.src_offset = j.pack_offset;
            d.dst_offset = in_pool;
            d.bytes = msg.bytes;
            u.runs.push_back(d);
            return u;
        }
        const std::string why = rma_readable(plan, msg, src_num_blocks, w.region_bytes(src_world));
        require(why.empty(), "an RMA read of message ", j.message_index, ": ", why);
        const PoolRegion src{
            {rank_page_geometry(plan.src.layout, msg.src_rank, plan.src.block_size, plan.src.order),
             src_num_blocks},
            0};
        u.runs = message_descriptors(plan, j.message_index, src, PoolRegion{pool_pages(dst), 0});
        if (u.runs.size() > 1 && plan.src.order == PageOrder::kHnd &&
            contiguous_payload_offset(plan, msg, TransferMode::kPostReceive, true,
                                      src.pages.geometry, src_num_blocks) >= 0)
            return std::nullopt;  // staged
        return u;
    };
    size_t j = 0;
    while (j < jobs.size()) {
        std::vector<UnitJob> run;
        const bool packed = jobs[j].pack_offset >= 0;
        size_t k = j;
        for (; k < jobs.size() && (jobs[k].pack_offset >= 0) == packed; ++k) {
            std::optional<UnitJob> u = pipelined(jobs[k]);
            if (!u) break;
            run.push_back(std::move(*u));
        }
        if (!run.empty()) {
            read_units_pipelined(packed ? w.pack_window() : w.window(), src_world, run, plan, dst,
                                 out.data() + j);
            j = k;
            continue;
        }
        const RmaReadJob& one = jobs[j];
        out[j] = one.pack_offset >= 0
                     ? rma_read_packed(w.pack_window(), src_world, one.pack_offset, plan,
                                       one.message_index, mode, one.units, dst)
                     : rma_read_message(w.window(), src_world, src_num_blocks, plan,
                                        one.message_index, mode, one.units, dst);
        ++j;
    }
    return out;
}

uint64_t landed_unit_checksum(const TransferPlan& plan, const TransferMessage& msg,
                              const BlockPool& dst) {
    check_destination(plan, msg, dst);
    const RankKv& drk = plan.dst.layout.ranks[static_cast<size_t>(msg.dst_rank)];
    const PageGeometry& dg = dst.geometry();
    const int64_t e = dg.elem_size(), vec = plan.vector_bytes();
    const int dh0 = first_head(plan, drk);
    thread_local std::vector<uint64_t> hashes;
    hashes.clear();
    // Units in unit_checksum's order: layer, K/V, piece, head.
    for (int l = msg.layer_begin; l < msg.layer_end; ++l)
        for (int kv = 0; kv < plan.kv_factor; ++kv)
            for (const TransferPiece& p : msg.pieces) {
                const std::byte* page = dst.page(l - drk.layer_begin, kv, p.dst_block);
                for (int h = msg.head_begin; h < msg.head_end; ++h) {
                    if (dg.order == PageOrder::kHnd) {  // the unit's slots are contiguous
                        hashes.push_back(xxh3_64(page + dg.elem_in_page(h - dh0, p.dst_slot, 0) * e,
                                                 static_cast<size_t>(p.count * vec)));
                    } else {
                        Xxh3Stream s;
                        for (int j = 0; j < p.count; ++j)
                            s.update(page + dg.elem_in_page(h - dh0, p.dst_slot + j, 0) * e,
                                     static_cast<size_t>(vec));
                        hashes.push_back(s.digest());
                    }
                }
            }
    return xxh3_64(hashes.data(), hashes.size() * sizeof(uint64_t));
}

uint64_t landed_payload_hash(const TransferPlan& plan, const TransferMessage& msg,
                             TransferMode mode, const BlockPool& dst) {
    check_destination(plan, msg, dst);
    const RankKv& drk = plan.dst.layout.ranks[static_cast<size_t>(msg.dst_rank)];
    const PageGeometry& dg = dst.geometry();
    const int64_t e = dg.elem_size(), vec = plan.vector_bytes();
    const int dh0 = first_head(plan, drk);
    const bool head_major = wire_order(plan, mode) == PageOrder::kHnd;
    const int heads = msg.head_end - msg.head_begin;
    Xxh3Stream s;
    // The payload's cells in wire order, each read where it landed, runs that continue in the
    // pool hashed as one update.
    const std::byte* run = nullptr;
    int64_t run_len = 0;
    auto cell = [&](const std::byte* at) {
        if (run != nullptr && run + run_len == at) {
            run_len += vec;
            return;
        }
        if (run != nullptr) s.update(run, static_cast<size_t>(run_len));
        run = at;
        run_len = vec;
    };
    for (int l = msg.layer_begin; l < msg.layer_end; ++l)
        for (int kv = 0; kv < plan.kv_factor; ++kv)
            for (const TransferPiece& p : msg.pieces) {
                const std::byte* page = dst.page(l - drk.layer_begin, kv, p.dst_block);
                const int outer = head_major ? heads : p.count;
                const int inner = head_major ? p.count : heads;
                for (int a = 0; a < outer; ++a)
                    for (int b = 0; b < inner; ++b) {
                        const int h = msg.head_begin + (head_major ? a : b);
                        const int j = head_major ? b : a;
                        cell(page + dg.elem_in_page(h - dh0, p.dst_slot + j, 0) * e);
                    }
            }
    if (run != nullptr) s.update(run, static_cast<size_t>(run_len));
    return s.digest();
}

}  // namespace kvshard
