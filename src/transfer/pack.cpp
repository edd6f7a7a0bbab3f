#include "kvshard/transfer/pack.h"

#include <algorithm>
#include <cstring>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

// Merges copies that continue where the previous one ended in both buffers (offsets in bytes).
// Sink(pool_offset, wire_offset, len) receives each merged copy.
template <typename Sink>
class Coalescer {
  public:
    explicit Coalescer(Sink& sink) : sink_(sink) {}
    void add(int64_t pool_off, int64_t wire_off, int64_t len) {
        if (len_ > 0 && pool_off == pool_ + len_ && wire_off == wire_ + len_) {
            len_ += len;
            return;
        }
        flush();
        pool_ = pool_off;
        wire_ = wire_off;
        len_ = len;
    }
    void flush() {
        if (len_ > 0) sink_(pool_, wire_, len_);
        len_ = 0;
    }

  private:
    Sink& sink_;
    int64_t pool_ = 0, wire_ = 0, len_ = 0;
};

// Wire offsets of a batch carry the message's position in the batch in their top bits, so that
// copies of different messages never merge and a sink can find the message's buffer.
constexpr int kWireShift = 40;
constexpr int64_t kWireMask = (int64_t{1} << kWireShift) - 1;

// Walks the copies between one side's pool and the wire for a batch of messages that share their
// layer range, interleaved by (layer, kv, piece index): messages that differ only by heads (a TP
// reshape) then touch each page once, in address order, instead of once per message.
// Only layers [layer_begin, layer_begin + layer_count) and kvs [0, kv_count) are walked.
template <typename Sink>
void walk_messages(const TransferPlan& plan, std::span<const TransferMessage* const> msgs,
                   bool source_side, PageOrder wire, const PageGeometry& g, int64_t num_blocks,
                   int layer_count, int kv_count, Sink& sink) {
    const TransferEndpoint& side = source_side ? plan.src : plan.dst;
    const int64_t vec = plan.vector_bytes();
    const int64_t page_bytes = g.page_bytes();
    const int bs = g.block_size;
    const int H = g.num_heads;
    const int layer_begin = msgs.front()->layer_begin;
    const RankKv& rk =
        side.layout.ranks[source_side ? msgs.front()->src_rank : msgs.front()->dst_rank];
    std::vector<int64_t> w(msgs.size(), 0);
    std::vector<int> head0(msgs.size());
    size_t max_pieces = 0;
    for (size_t m = 0; m < msgs.size(); ++m) {
        KVSHARD_CHECK(msgs[m]->layer_begin == layer_begin, "a batch shares its layers");
        head0[m] = msgs[m]->head_begin - rk.kv_heads.front();
        max_pieces = std::max(max_pieces, msgs[m]->pieces.size());
    }
    Coalescer<Sink> co(sink);
    for (int l = layer_begin; l < layer_begin + layer_count; ++l) {
        const int local_layer = l - rk.layer_begin;
        for (int kv = 0; kv < kv_count; ++kv) {
            const int64_t page_base = (int64_t{local_layer} * g.kv_factor + kv) * num_blocks;
            for (size_t j = 0; j < max_pieces; ++j) {
                for (size_t m = 0; m < msgs.size(); ++m) {
                    if (j >= msgs[m]->pieces.size()) continue;
                    const TransferPiece& p = msgs[m]->pieces[j];
                    const int nh = msgs[m]->num_heads();
                    const int h0 = head0[m];
                    const int32_t block = source_side ? p.src_block : p.dst_block;
                    const int s0 = source_side ? p.src_slot : p.dst_slot;
                    const int cnt = p.count;
                    const int64_t page = (page_base + block) * page_bytes;
                    const int64_t wb = (static_cast<int64_t>(m) << kWireShift) + w[m];
                    if (g.order == PageOrder::kHnd && wire == PageOrder::kHnd) {
                        for (int hi = 0; hi < nh; ++hi)
                            co.add(page + ((int64_t{h0 + hi} * bs + s0) * vec),
                                   wb + int64_t{hi} * cnt * vec, cnt * vec);
                    } else if (g.order == PageOrder::kNhd && wire == PageOrder::kNhd) {
                        for (int si = 0; si < cnt; ++si)
                            co.add(page + ((int64_t{s0 + si} * H + h0) * vec),
                                   wb + int64_t{si} * nh * vec, nh * vec);
                    } else if (wire == PageOrder::kHnd) {  // NHD pages, HND wire
                        for (int hi = 0; hi < nh; ++hi)
                            for (int si = 0; si < cnt; ++si)
                                co.add(page + ((int64_t{s0 + si} * H + h0 + hi) * vec),
                                       wb + (int64_t{hi} * cnt + si) * vec, vec);
                    } else {  // HND pages, NHD wire
                        for (int si = 0; si < cnt; ++si)
                            for (int hi = 0; hi < nh; ++hi)
                                co.add(page + ((int64_t{h0 + hi} * bs + s0 + si) * vec),
                                       wb + (int64_t{si} * nh + hi) * vec, vec);
                    }
                    w[m] += int64_t{nh} * cnt * vec;
                }
            }
        }
    }
    co.flush();
}

template <typename Sink>
void walk_message(const TransferPlan& plan, const TransferMessage& msg, bool source_side,
                  PageOrder wire, const PageGeometry& g, int64_t num_blocks, int layer_count,
                  int kv_count, Sink& sink) {
    const TransferMessage* one[] = {&msg};
    walk_messages(plan, std::span<const TransferMessage* const>(one), source_side, wire, g,
                  num_blocks, layer_count, kv_count, sink);
}

// memcpy one run behind: before copying run i it prefetches the start of run i + 1 in both buffers,
// so that short strided runs (a head's slots in a page) do not each start cold.
class PrefetchingCopier {
  public:
    void add(std::byte* dst, const std::byte* src, int64_t len) {
        const int64_t ahead = std::min<int64_t>(len, kPrefetchBytes);
        for (int64_t o = 0; o < ahead; o += 64) {
            __builtin_prefetch(src + o, 0);
            __builtin_prefetch(dst + o, 1);
        }
        flush();
        dst_ = dst;
        src_ = src;
        len_ = len;
    }
    void flush() {
        if (len_ > 0) std::memcpy(dst_, src_, static_cast<size_t>(len_));
        len_ = 0;
    }
    ~PrefetchingCopier() { flush(); }

  private:
    static constexpr int64_t kPrefetchBytes = 1024;
    std::byte* dst_ = nullptr;
    const std::byte* src_ = nullptr;
    int64_t len_ = 0;
};

void check_pool(const TransferPlan& plan, const TransferMessage& msg, bool source_side,
                const BlockPool& pool, int64_t payload_bytes) {
    const TransferEndpoint& side = source_side ? plan.src : plan.dst;
    const int rank = source_side ? msg.src_rank : msg.dst_rank;
    const PageGeometry want = rank_page_geometry(side.layout, rank, side.block_size, side.order);
    require(pool.geometry() == want, "the ", source_side ? "source" : "destination",
            " pool of rank ", rank, " does not have that rank's page geometry (", want.num_layers,
            " layers, ", want.num_heads, " heads, block size ", want.block_size, ")");
    require(payload_bytes == msg.bytes, "message ", msg.src_rank, "->", msg.dst_rank, " carries ",
            msg.bytes, " bytes but the buffer has ", payload_bytes);
    for (const auto& p : msg.pieces) {
        const int32_t b = source_side ? p.src_block : p.dst_block;
        require(b < pool.num_blocks(), "block ", b, " of rank ", rank, " is outside its pool of ",
                pool.num_blocks(), " blocks");
    }
}

}  // namespace

std::string_view transfer_mode_name(TransferMode m) {
    switch (m) {
        case TransferMode::kPreSend:
            return "pre-send";
        case TransferMode::kPostReceive:
            return "post-receive";
        case TransferMode::kAuto:
            return "auto";
    }
    return "?";
}

TransferMode parse_transfer_mode(std::string_view s) {
    if (s == "pre-send" || s == "presend") return TransferMode::kPreSend;
    if (s == "post-receive" || s == "postreceive") return TransferMode::kPostReceive;
    if (s == "auto") return TransferMode::kAuto;
    throw Error(
        detail::concat("unknown transfer mode '", s, "': valid are pre-send, post-receive, auto"));
}

PageOrder wire_order(const TransferPlan& plan, TransferMode mode) {
    KVSHARD_CHECK(mode != TransferMode::kAuto, "resolve kAuto before asking for the wire order");
    return mode == TransferMode::kPreSend ? plan.dst.order : plan.src.order;
}

CopyCounts count_copies(const TransferPlan& plan, TransferMode mode) {
    mode = mode == TransferMode::kAuto ? TransferMode::kPreSend : mode;
    const PageOrder wire = wire_order(plan, mode);
    CopyCounts c;
    // One layer and K only, times layers x kv: copies never merge across pages of different layers
    // or K/V in a way that matters for the choice. The pool's block count only shifts offsets.
    for (const auto& msg : plan.messages) {
        int64_t n = 0;
        auto count = [&n](int64_t, int64_t, int64_t) { ++n; };
        const int64_t reps = int64_t{msg.num_layers()} * plan.kv_factor;
        for (bool source : {true, false}) {
            const TransferEndpoint& side = source ? plan.src : plan.dst;
            const PageGeometry g = rank_page_geometry(
                side.layout, source ? msg.src_rank : msg.dst_rank, side.block_size, side.order);
            n = 0;
            walk_message(plan, msg, source, wire, g, int64_t{1} << 20, 1, 1, count);
            (source ? c.pack : c.unpack) += n * reps;
        }
    }
    return c;
}

TransferMode resolve_mode(const TransferPlan& plan, TransferMode mode) {
    if (mode != TransferMode::kAuto) return mode;
    const int64_t pre = count_copies(plan, TransferMode::kPreSend).total();
    const int64_t post = count_copies(plan, TransferMode::kPostReceive).total();
    return post < pre ? TransferMode::kPostReceive : TransferMode::kPreSend;
}

int64_t contiguous_payload_offset(const TransferPlan& plan, const TransferMessage& msg,
                                  TransferMode mode, bool source_side, const BlockPool& pool) {
    require(mode != TransferMode::kAuto, "contiguous_payload_offset needs a resolved mode");
    check_pool(plan, msg, source_side, pool, msg.bytes);
    int64_t runs = 0, pool_off = -1, wire_off = -1, len = 0;
    auto sink = [&](int64_t p, int64_t w, int64_t n) {
        if (++runs == 1) {
            pool_off = p;
            wire_off = w;
            len = n;
        }
    };
    walk_message(plan, msg, source_side, wire_order(plan, mode), pool.geometry(), pool.num_blocks(),
                 msg.num_layers(), plan.kv_factor, sink);
    return runs == 1 && wire_off == 0 && len == msg.bytes ? pool_off : -1;
}

void pack_message(const TransferPlan& plan, const TransferMessage& msg, TransferMode mode,
                  const BlockPool& pool, std::span<std::byte> out) {
    const TransferMessage* one[] = {&msg};
    const std::span<std::byte> outs[] = {out};
    pack_messages(plan, one, mode, pool, outs);
}

void unpack_message(const TransferPlan& plan, const TransferMessage& msg, TransferMode mode,
                    std::span<const std::byte> in, BlockPool& pool) {
    const TransferMessage* one[] = {&msg};
    const std::span<const std::byte> ins[] = {in};
    unpack_messages(plan, one, mode, ins, pool);
}

void pack_messages(const TransferPlan& plan, std::span<const TransferMessage* const> msgs,
                   TransferMode mode, const BlockPool& pool,
                   std::span<const std::span<std::byte>> outs) {
    require(mode != TransferMode::kAuto, "pack_messages needs a resolved mode (call resolve_mode)");
    require(msgs.size() == outs.size() && !msgs.empty(), "pack_messages: one buffer per message");
    for (size_t m = 0; m < msgs.size(); ++m) {
        check_pool(plan, *msgs[m], true, pool, static_cast<int64_t>(outs[m].size()));
        require(msgs[m]->src_rank == msgs[0]->src_rank &&
                    msgs[m]->layer_begin == msgs[0]->layer_begin &&
                    msgs[m]->layer_end == msgs[0]->layer_end,
                "pack_messages: a batch is one source rank's messages of one layer range");
    }
    const std::byte* base = pool.arena().data();
    PrefetchingCopier copier;
    auto copy = [base, outs, &copier](int64_t pool_off, int64_t wire_off, int64_t len) {
        copier.add(
            outs[static_cast<size_t>(wire_off >> kWireShift)].data() + (wire_off & kWireMask),
            base + pool_off, len);
    };
    walk_messages(plan, msgs, true, wire_order(plan, mode), pool.geometry(), pool.num_blocks(),
                  msgs[0]->num_layers(), plan.kv_factor, copy);
    copier.flush();
}

void unpack_messages(const TransferPlan& plan, std::span<const TransferMessage* const> msgs,
                     TransferMode mode, std::span<const std::span<const std::byte>> ins,
                     BlockPool& pool) {
    require(mode != TransferMode::kAuto,
            "unpack_messages needs a resolved mode (call resolve_mode)");
    require(msgs.size() == ins.size() && !msgs.empty(), "unpack_messages: one buffer per message");
    for (size_t m = 0; m < msgs.size(); ++m) {
        check_pool(plan, *msgs[m], false, pool, static_cast<int64_t>(ins[m].size()));
        require(msgs[m]->dst_rank == msgs[0]->dst_rank &&
                    msgs[m]->layer_begin == msgs[0]->layer_begin &&
                    msgs[m]->layer_end == msgs[0]->layer_end,
                "unpack_messages: a batch is one destination rank's messages of one layer range");
    }
    std::byte* base = pool.arena().data();
    PrefetchingCopier copier;
    auto copy = [base, ins, &copier](int64_t pool_off, int64_t wire_off, int64_t len) {
        copier.add(base + pool_off,
                   ins[static_cast<size_t>(wire_off >> kWireShift)].data() + (wire_off & kWireMask),
                   len);
    };
    walk_messages(plan, msgs, false, wire_order(plan, mode), pool.geometry(), pool.num_blocks(),
                  msgs[0]->num_layers(), plan.kv_factor, copy);
    copier.flush();
}

}  // namespace kvshard
