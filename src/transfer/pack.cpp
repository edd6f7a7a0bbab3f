#include "kvshard/transfer/pack.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kvshard/common/error.h"
#include "kvshard/common/xxh3.h"

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
    // `count` copies of len bytes, the i-th at pool_off + i * pool_step and wire_off + i *
    // wire_step (a transpose's head_dim vectors): in one call where the sink takes strided copies
    // (the copy kernel then loops without a call per vector), else one add() each.
    void add_strided(int64_t pool_off, int64_t pool_step, int64_t wire_off, int64_t wire_step,
                     int64_t len, int64_t count) {
        if (pool_step == len && wire_step == len) {
            add(pool_off, wire_off, len * count);
        } else if (count == 1) {
            add(pool_off, wire_off, len);  // may continue the previous copy
        } else if constexpr (requires { sink_.strided(0, 0, 0, 0, 0, 0); }) {
            flush();
            sink_.strided(pool_off, pool_step, wire_off, wire_step, len, count);
        } else {
            for (int64_t i = 0; i < count; ++i)
                add(pool_off + i * pool_step, wire_off + i * wire_step, len);
        }
    }

    // A hint: the walk reads pool bytes [pool_off, pool_off + len) next (after the copies given so
    // far), for a sink that prefetches them.
    void read_ahead(int64_t pool_off, int64_t len) {
        if constexpr (requires { sink_.read_ahead(0, 0); }) sink_.read_ahead(pool_off, len);
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
                            co.add_strided(page + ((int64_t{s0} * H + h0 + hi) * vec), H * vec,
                                           wb + int64_t{hi} * cnt * vec, vec, vec, cnt);
                    } else {  // HND pages, NHD wire
                        // A transpose reads nh strided streams that all end with the page: the
                        // next piece's heads are read ahead while this one is copied.
                        if (j + 1 < msgs[m]->pieces.size()) {
                            const TransferPiece& q = msgs[m]->pieces[j + 1];
                            co.read_ahead((page_base + (source_side ? q.src_block : q.dst_block)) *
                                                  page_bytes +
                                              int64_t{h0} * bs * vec,
                                          int64_t{nh} * bs * vec);
                        }
                        for (int si = 0; si < cnt; ++si)
                            co.add_strided(page + ((int64_t{h0} * bs + s0 + si) * vec), bs * vec,
                                           wb + int64_t{si} * nh * vec, vec, vec, nh);
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

// memcpy through a call: with a length GCC can bound (a step of a run) it would otherwise inline
// the copy as `rep movsq`, which starts slowly for the few hundred bytes of one step.
[[gnu::noinline]] void plain_copy(std::byte* dst, const std::byte* src, int64_t len) {
    std::memcpy(dst, src, static_cast<size_t>(len));
}

#if defined(__SSE2__)
// Copies `bytes` (a multiple of 64) to a 64-byte-aligned dst with non-temporal stores.
[[gnu::always_inline]] inline void stream_lines(std::byte* dst, const std::byte* src,
                                                int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) {
        const auto* s = reinterpret_cast<const __m128i*>(src + o);
        auto* d = reinterpret_cast<__m128i*>(dst + o);
        const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1),
                      c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
        _mm_stream_si128(d, a);
        _mm_stream_si128(d + 1, b);
        _mm_stream_si128(d + 2, c);
        _mm_stream_si128(d + 3, e);
    }
}
#endif

// Copies len bytes with non-temporal stores for the destination's whole 64-byte lines (ordinary
// stores for the partial lines at its ends, and for copies under 128 bytes).
[[gnu::always_inline]] inline void stream_copy(std::byte* dst, const std::byte* src, int64_t len) {
#if defined(__SSE2__)
    if (len >= 128) {
        const int64_t head =
            std::min<int64_t>(len, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
        if (head > 0) plain_copy(dst, src, head);
        dst += head;
        src += head;
        len -= head;
        const int64_t body = len & ~int64_t{63};
        stream_lines(dst, src, body);
        if (len > body) plain_copy(dst + body, src + body, len - body);
        return;
    }
#endif
    plain_copy(dst, src, len);
}

// Copies the runs of a walk, kAhead runs behind the walk, so that while run i is copied the source
// lines of run i + kAhead are prefetched into L2 (prefetcht1), a few lines per step of the copy:
// the hardware prefetchers do not cross 4 KiB pages, so a run would otherwise start cold, also
// one that continues the previous run in the source (a TP slice of a page: 4 KiB runs, each in
// its own 4 KiB page; prefetching those too moved the batched TP2 -> TP8 pack from 0.88 to
// 0.92-0.97 of memcpy). Runs under kPrefetchMinRun bytes are left to the hardware prefetchers; at
// most kPrefetchBytes of one run are prefetched. A transpose's strided copies prefetch what the
// walk says it reads next (read_ahead).
//
// stream_stores: the destination is written with non-temporal stores (whole 64-byte lines; partial
// lines at a run's ends with ordinary stores), which skip reading each destination line before it
// is written: the copy then reads only its source. Pack writes a staging buffer that MPI or the
// receiver reads next, unpack the pool that decode reads later; neither is re-read by this core.
//
// With hashing on, each message's payload is hashed (XXH3_64, seed 0) while it is copied: after a
// run (a long one: each kHashChunk piece of it) is copied its source bytes (the message's wire
// bytes: pack and a direct read take them from the source pool), still in L1, are fed to that
// message's streaming state; runs of one message that continue each other in the source are fed as
// one piece of up to kHashChunk bytes. Walks visit each message's wire bytes
// in increasing order, so this is XXH3_64bits of the payload.
class RunCopier {
  public:
    RunCopier(bool stream_stores, size_t hashed_messages)
        : stream_(stream_stores), hashes_(hashed_messages) {}

    // msg: the run's message in the batch (for its hash).
    [[gnu::always_inline]] void add(std::byte* dst, const std::byte* src, int64_t len, size_t msg) {
        const Run r{dst, src, len, msg};
        if (count_ == 0 && len < kPrefetchMinRun) {  // short runs: nothing to prefetch, copy now
            copy_run(r, nullptr);
            return;
        }
        ring_[(head_ + count_) % kRing] = r;
        ++count_;
        if (count_ > kAhead) {
            const Run front = ring_[head_];
            head_ = (head_ + 1) % kRing;
            --count_;
            copy_run(front, &ring_[(head_ + count_ - 1) % kRing]);
        }
    }

    // Source bytes that strided copies read next: add_strided prefetches them (into L2) as it
    // goes, as many lines per vector copied as the vector has, until the next call.
    void read_ahead(const std::byte* p, int64_t len) {
        ra_ = p;
        ra_lines_ = (len + 63) / 64;
    }

    // count runs of len bytes, the i-th from src + i * src_step to dst + i * dst_step, in that
    // order (a transpose's head_dim vectors: len is short, and each is copied at once, as add()
    // copies a short run, without a call per vector).
    void add_strided(std::byte* dst, int64_t dst_step, const std::byte* src, int64_t src_step,
                     int64_t len, int64_t count, size_t msg) {
        while (count_ > 0) {  // what is queued goes first
            const Run front = ring_[head_];
            head_ = (head_ + 1) % kRing;
            --count_;
            copy_run(front, nullptr);
        }
        const bool hashing = !hashes_.empty();
#if defined(__SSE2__)
        // Whole lines at line-aligned destinations (head_dim vectors of 64-byte multiples, as
        // in every real model): non-temporal stores straight from a tight loop.
        if (stream_ && len % 64 == 0 && dst_step % 64 == 0 &&
            reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
            for (int64_t i = 0; i < count; ++i) {
                stream_lines(dst + i * dst_step, src + i * src_step, len);
                if (hashing) feed(hashes_[msg], src + i * src_step, len);
                for (int64_t k = 0; k < len / 64 && ra_lines_ > 0; ++k, --ra_lines_, ra_ += 64)
                    __builtin_prefetch(ra_, 0, 2);
            }
            return;
        }
#endif
        for (int64_t i = 0; i < count; ++i) {
            copy(dst + i * dst_step, src + i * src_step, len);
            if (hashing) feed(hashes_[msg], src + i * src_step, len);
        }
    }

    // Copies what is still queued and finishes the hashes (and orders the non-temporal stores
    // before whatever the caller does next, e.g. handing the buffer to another thread).
    void finish(std::span<uint64_t> hashes) {
        while (count_ > 0) {
            const Run front = ring_[head_];
            head_ = (head_ + 1) % kRing;
            --count_;
            copy_run(front, nullptr);
        }
        for (size_t m = 0; m < hashes_.size(); ++m) {
            flush_hash(hashes_[m]);
            if (m < hashes.size()) hashes[m] = hashes_[m].state.digest();
        }
#if defined(__SSE2__)
        if (stream_) _mm_sfence();
#endif
    }

  private:
    struct Run {
        std::byte* dst = nullptr;
        const std::byte* src = nullptr;
        int64_t len = 0;
        size_t msg = 0;
    };
    struct Hash {
        Xxh3Stream state;
        const std::byte* pending = nullptr;  // wire bytes copied but not hashed yet
        int64_t pending_len = 0;
    };
    static constexpr int kAhead = 2, kRing = 4;       // kRing > kAhead, a power of 2
    static constexpr int64_t kStep = 512;             // bytes copied between prefetch batches
    static constexpr int64_t kPrefetchBytes = 16384;  // at most this much of one run
    static constexpr int64_t kPrefetchMinRun = 1024;  // shorter runs: left to the hardware
    static constexpr int64_t kHashChunk = 8192;

    // Copies r; prefetches ahead's source lines, spread over the copy. With hashing, the run is
    // copied and hashed piece by piece (at most kHashChunk bytes between a byte's copy and its
    // hash), so a long run's bytes are hashed from L1, not re-read from memory.
    [[gnu::always_inline]] void copy_run(const Run& r, const Run* ahead) {
        const bool prefetch = ahead != nullptr && ahead->len >= kPrefetchMinRun;
        const bool hashing = !hashes_.empty();
        if (!prefetch && (!hashing || r.len <= kHashChunk)) {
            copy(r.dst, r.src, r.len);
            if (hashing) feed(hashes_[r.msg], r.src, r.len);
            return;
        }
        const std::byte* pf = prefetch ? ahead->src : nullptr;
        const int64_t pf_lines = prefetch ? (std::min(ahead->len, kPrefetchBytes) + 63) / 64 : 0;
        const int64_t step = prefetch ? kStep : kHashChunk;
        const int64_t steps = std::max<int64_t>(1, (r.len + step - 1) / step);
        const int64_t per_step = (pf_lines + steps - 1) / steps;
        int64_t line = 0;
        for (int64_t off = 0; off < r.len; off += step) {
            for (int64_t j = 0; j < per_step && line < pf_lines; ++j, ++line)
                __builtin_prefetch(pf + line * 64, 0, 2);
            const int64_t n = std::min(step, r.len - off);
            copy(r.dst + off, r.src + off, n);
            if (hashing) feed(hashes_[r.msg], r.src + off, n);
        }
        for (; line < pf_lines; ++line) __builtin_prefetch(pf + line * 64, 0, 2);
    }

    // Queues n wire bytes at p (just copied, in L1) for the message's hash: pieces that continue
    // each other are hashed together, up to kHashChunk bytes.
    [[gnu::always_inline]] static void feed(Hash& h, const std::byte* p, int64_t n) {
        if (h.pending_len > 0 && h.pending + h.pending_len == p &&
            h.pending_len + n <= kHashChunk) {
            h.pending_len += n;
            return;
        }
        flush_hash(h);
        h.pending = p;
        h.pending_len = n;
    }

    static void flush_hash(Hash& h) {
        if (h.pending_len > 0) h.state.update(h.pending, static_cast<size_t>(h.pending_len));
        h.pending_len = 0;
    }

    [[gnu::always_inline]] void copy(std::byte* dst, const std::byte* src, int64_t len) const {
        if (stream_)
            stream_copy(dst, src, len);
        else
            plain_copy(dst, src, len);
    }

    bool stream_;
    const std::byte* ra_ = nullptr;  // read_ahead: the next line to prefetch, and how many are left
    int64_t ra_lines_ = 0;
    std::vector<Hash> hashes_;
    Run ring_[kRing];
    int head_ = 0, count_ = 0;
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

// The arguments of pack_messages / unpack_messages (fn): a resolved mode, one buffer (of the
// message's size) and at most one hash per message, all of one rank (source side: the source rank)
// and one layer range.
template <typename Buffers>
void check_batch(const char* fn, const TransferPlan& plan,
                 std::span<const TransferMessage* const> msgs, bool source_side, TransferMode mode,
                 const BlockPool& pool, const Buffers& buffers, std::span<uint64_t> xxh3) {
    require(mode != TransferMode::kAuto, fn, " needs a resolved mode (call resolve_mode)");
    require(msgs.size() == buffers.size() && !msgs.empty(), fn, ": one buffer per message");
    require(xxh3.empty() || xxh3.size() == msgs.size(), fn, ": one hash per message");
    for (size_t m = 0; m < msgs.size(); ++m) {
        check_pool(plan, *msgs[m], source_side, pool, static_cast<int64_t>(buffers[m].size()));
        const int rank = source_side ? msgs[m]->src_rank : msgs[m]->dst_rank;
        const int rank0 = source_side ? msgs[0]->src_rank : msgs[0]->dst_rank;
        require(rank == rank0 && msgs[m]->layer_begin == msgs[0]->layer_begin &&
                    msgs[m]->layer_end == msgs[0]->layer_end,
                fn, ": a batch is one ", source_side ? "source" : "destination",
                " rank's messages of one layer range");
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
    if (post != pre) return post < pre ? TransferMode::kPostReceive : TransferMode::kPreSend;
    // A tie between different page orders: transpose in the receiver's unpack (a scatter of
    // head_dim vectors), which measured faster than the same transpose in the sender's pack (a
    // gather): BENCHMARKS.md "transfer", HND -> NHD, 1.53 vs 0.99 of memcpy.
    return plan.src.order != plan.dst.order ? TransferMode::kPostReceive : TransferMode::kPreSend;
}

std::vector<std::optional<TransferMode>> resolve_group_modes(const TransferPlan& plan,
                                                             TransferMode mode) {
    if (plan.executable()) return {resolve_mode(plan, mode)};
    std::vector<std::optional<TransferMode>> modes;
    for (size_t k = 0; k < plan.groups.size(); ++k) {
        if (plan.groups[k].holds_state() || mla_fp8_ds_layout(plan.src.layout.model))
            modes.emplace_back(std::nullopt);  // moved whole, or sized only (fp8_ds_mla)
        else
            modes.emplace_back(resolve_mode(group_transfer_plan(plan, static_cast<int>(k)), mode));
    }
    return modes;
}

std::string group_modes_text(const TransferPlan& plan, TransferMode mode) {
    return group_modes_text(plan, resolve_group_modes(plan, mode));
}

std::string group_modes_text(const TransferPlan& plan,
                             std::span<const std::optional<TransferMode>> modes) {
    require(modes.size() == plan.groups.size() || (plan.executable() && modes.size() == 1),
            "group_modes_text: ", modes.size(), " modes for ", plan.groups.size(), " KV groups");
    std::optional<TransferMode> common;
    bool same = true;
    for (const auto& m : modes) {
        if (!m) continue;
        if (common && *common != *m) same = false;
        common = m;
    }
    if (!common) return "none";
    if (same) return std::string(transfer_mode_name(*common));
    std::string text;
    for (size_t k = 0; k < modes.size(); ++k) {
        if (!modes[k]) continue;
        const TransferGroup& g = plan.groups[k];
        if (!text.empty()) text += ", ";
        text += std::to_string(k);
        text += ' ';
        text += layer_kind_name(g.kind);
        if (g.window > 0) {
            text += '(';
            text += std::to_string(g.window);
            text += ')';
        }
        text += ": ";
        text += transfer_mode_name(*modes[k]);
    }
    return text;
}

int64_t contiguous_payload_offset(const TransferPlan& plan, const TransferMessage& msg,
                                  TransferMode mode, bool source_side, const BlockPool& pool) {
    check_pool(plan, msg, source_side, pool, msg.bytes);
    return contiguous_payload_offset(plan, msg, mode, source_side, pool.geometry(),
                                     pool.num_blocks());
}

int64_t contiguous_payload_offset(const TransferPlan& plan, const TransferMessage& msg,
                                  TransferMode mode, bool source_side, const PageGeometry& geometry,
                                  int64_t num_blocks) {
    require(mode != TransferMode::kAuto, "contiguous_payload_offset needs a resolved mode");
    int64_t runs = 0, pool_off = -1, wire_off = -1, len = 0;
    auto sink = [&](int64_t p, int64_t w, int64_t n) {
        if (++runs == 1) {
            pool_off = p;
            wire_off = w;
            len = n;
        }
    };
    walk_message(plan, msg, source_side, wire_order(plan, mode), geometry, num_blocks,
                 msg.num_layers(), plan.kv_factor, sink);
    return runs == 1 && wire_off == 0 && len == msg.bytes ? pool_off : -1;
}

std::vector<CopyRun> message_copy_runs(const TransferPlan& plan, const TransferMessage& msg,
                                       TransferMode mode, bool source_side,
                                       const PageGeometry& geometry, int64_t num_blocks) {
    require(mode != TransferMode::kAuto,
            "message_copy_runs needs a resolved mode (call resolve_mode)");
    require_executable(plan,
                       "copy runs describe pools of one page shape; take each token group's plan "
                       "(group_transfer_plan) and its pools");
    const TransferEndpoint& side = source_side ? plan.src : plan.dst;
    const int rank = source_side ? msg.src_rank : msg.dst_rank;
    const PageGeometry want = rank_page_geometry(side.layout, rank, side.block_size, side.order);
    require(geometry == want, "message_copy_runs: the ", source_side ? "source" : "destination",
            " geometry of rank ", rank, " is not that rank's (", want.num_layers, " layers, ",
            want.num_heads, " heads, block size ", want.block_size, ")");
    for (const auto& p : msg.pieces) {
        const int32_t b = source_side ? p.src_block : p.dst_block;
        require(b >= 0 && b < num_blocks, "block ", b, " of rank ", rank,
                " is outside its pool of ", num_blocks, " blocks");
    }
    struct Collect {
        std::vector<CopyRun> runs;
        void operator()(int64_t pool_off, int64_t wire_off, int64_t len) {
            runs.push_back({pool_off, len, wire_off, len, len, 1});
        }
        void strided(int64_t pool_off, int64_t pool_step, int64_t wire_off, int64_t wire_step,
                     int64_t len, int64_t count) {
            runs.push_back({pool_off, pool_step, wire_off, wire_step, len, count});
        }
    } collect;
    walk_message(plan, msg, source_side, wire_order(plan, mode), geometry, num_blocks,
                 msg.num_layers(), plan.kv_factor, collect);
    return std::move(collect.runs);
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
                   std::span<const std::span<std::byte>> outs, std::span<uint64_t> xxh3) {
    check_batch("pack_messages", plan, msgs, true, mode, pool, outs, xxh3);
    const std::byte* base = pool.arena().data();
    // Non-temporal stores into the staging buffers too: reading the source (a slice of each page)
    // is then the only read stream. The hash reads the source pieces (the same bytes, in L1).
    RunCopier copier(true, xxh3.size());
    struct PackSink {
        const std::byte* base;
        std::span<const std::span<std::byte>> outs;
        RunCopier& copier;
        void operator()(int64_t pool_off, int64_t wire_off, int64_t len) {
            const auto m = static_cast<size_t>(wire_off >> kWireShift);
            copier.add(outs[m].data() + (wire_off & kWireMask), base + pool_off, len, m);
        }
        void strided(int64_t pool_off, int64_t pool_step, int64_t wire_off, int64_t wire_step,
                     int64_t len, int64_t count) {
            const auto m = static_cast<size_t>(wire_off >> kWireShift);
            copier.add_strided(outs[m].data() + (wire_off & kWireMask), wire_step, base + pool_off,
                               pool_step, len, count, m);
        }
        void read_ahead(int64_t pool_off, int64_t len) { copier.read_ahead(base + pool_off, len); }
    } copy{base, outs, copier};
    walk_messages(plan, msgs, true, wire_order(plan, mode), pool.geometry(), pool.num_blocks(),
                  msgs[0]->num_layers(), plan.kv_factor, copy);
    copier.finish(xxh3);
}

void unpack_messages(const TransferPlan& plan, std::span<const TransferMessage* const> msgs,
                     TransferMode mode, std::span<const std::span<const std::byte>> ins,
                     BlockPool& pool, std::span<uint64_t> xxh3) {
    check_batch("unpack_messages", plan, msgs, false, mode, pool, ins, xxh3);
    std::byte* base = pool.arena().data();
    RunCopier copier(true, xxh3.size());
    struct UnpackSink {
        std::byte* base;
        std::span<const std::span<const std::byte>> ins;
        RunCopier& copier;
        void operator()(int64_t pool_off, int64_t wire_off, int64_t len) {
            const auto m = static_cast<size_t>(wire_off >> kWireShift);
            copier.add(base + pool_off, ins[m].data() + (wire_off & kWireMask), len, m);
        }
        void strided(int64_t pool_off, int64_t pool_step, int64_t wire_off, int64_t wire_step,
                     int64_t len, int64_t count) {
            const auto m = static_cast<size_t>(wire_off >> kWireShift);
            copier.add_strided(base + pool_off, pool_step, ins[m].data() + (wire_off & kWireMask),
                               wire_step, len, count, m);
        }
    } copy{base, ins, copier};
    walk_messages(plan, msgs, false, wire_order(plan, mode), pool.geometry(), pool.num_blocks(),
                  msgs[0]->num_layers(), plan.kv_factor, copy);
    copier.finish(xxh3);
}

uint64_t hash_payload(const TransferPlan& plan, const TransferMessage& msg, TransferMode mode,
                      const BlockPool& pool) {
    require(mode != TransferMode::kAuto, "hash_payload needs a resolved mode (call resolve_mode)");
    check_pool(plan, msg, true, pool, msg.bytes);
    const std::byte* base = pool.arena().data();
    std::vector<std::pair<int64_t, int64_t>> runs;  // (pool offset, length), in wire order
    auto collect = [&runs](int64_t pool_off, int64_t, int64_t len) {
        runs.emplace_back(pool_off, len);
    };
    walk_message(plan, msg, true, wire_order(plan, mode), pool.geometry(), pool.num_blocks(),
                 msg.num_layers(), plan.kv_factor, collect);
    // One run (the common zero-copy case): the one-shot function, the same value.
    if (runs.size() == 1) return xxh3_64(base + runs[0].first, static_cast<size_t>(msg.bytes));
    Xxh3Stream state;
    for (const auto& [off, len] : runs) state.update(base + off, static_cast<size_t>(len));
    return state.digest();
}

namespace {

// A direct read's checks, before anything is read: the source arena holds its pool of sg's
// geometry, msg's blocks lie inside both pools, and the destination pool is msg's.
void check_direct(const TransferPlan& plan, const TransferMessage& msg, const PageGeometry& sg,
                  const SourceArena& src, const BlockPool& dst) {
    require(src.data != nullptr && src.num_blocks >= 1 &&
                src.num_blocks <= src.bytes / sg.block_bytes(),
            "the source arena of rank ", msg.src_rank, " (", src.bytes, " bytes) does not hold ",
            src.num_blocks, " blocks of ", sg.block_bytes(), " bytes");
    for (const auto& p : msg.pieces)
        require(p.src_block < src.num_blocks, "block ", p.src_block, " of source rank ",
                msg.src_rank, " is outside its pool of ", src.num_blocks, " blocks");
    check_pool(plan, msg, false, dst, msg.bytes);
}

}  // namespace

uint64_t copy_direct(const TransferPlan& plan, const TransferMessage& msg, TransferMode mode,
                     const SourceArena& src, BlockPool& dst) {
    require(mode != TransferMode::kAuto, "copy_direct needs a resolved mode (call resolve_mode)");
    const PageGeometry sg =
        rank_page_geometry(plan.src.layout, msg.src_rank, plan.src.block_size, plan.src.order);
    check_direct(plan, msg, sg, src, dst);
    // Each side's runs partition the wire bytes [0, msg.bytes) in increasing order; their
    // intersections are the pool-to-pool copies, visited in wire order. The side whose page order
    // the wire follows has the longer runs: those are listed (in this thread's list, reused from
    // call to call: a transpose or a TP slice has tens of thousands of runs per message), and the
    // other side's walk consumes them as it goes.
    struct WireRun {
        int64_t pool, wire, len;
    };
    thread_local std::vector<WireRun> listed;
    listed.clear();
    const PageOrder wire = wire_order(plan, mode);
    const bool list_source = wire == plan.src.order;
    auto list = [](int64_t p, int64_t w, int64_t n) { listed.push_back({p, w, n}); };
    if (list_source)
        walk_message(plan, msg, true, wire, sg, src.num_blocks, msg.num_layers(), plan.kv_factor,
                     list);
    else
        walk_message(plan, msg, false, wire, dst.geometry(), dst.num_blocks(), msg.num_layers(),
                     plan.kv_factor, list);
    std::byte* base = dst.arena().data();
    RunCopier copier(true, 1);
    // The walked side's copies, cut against the listed runs.
    struct DirectSink {
        const std::vector<WireRun>& listed;
        bool list_source;
        std::byte* base;
        const std::byte* from;
        RunCopier& copier;
        size_t i = 0;
        int64_t covered = 0;
        // The listed run holding wire byte `wire_off`.
        const WireRun& at(int64_t wire_off) {
            while (listed[i].wire + listed[i].len <= wire_off) {
                ++i;
                KVSHARD_CHECK(i < listed.size(), "both sides' runs cover the message's wire bytes");
            }
            return listed[i];
        }
        void operator()(int64_t pool_off, int64_t wire_off, int64_t len) {
            covered += len;
            while (len > 0) {
                const WireRun& a = at(wire_off);
                const int64_t n = std::min(len, a.wire + a.len - wire_off);
                const int64_t a_off = a.pool + (wire_off - a.wire);
                if (list_source)
                    copier.add(base + pool_off, from + a_off, n, 0);
                else
                    copier.add(base + a_off, from + pool_off, n, 0);
                pool_off += n;
                wire_off += n;
                len -= n;
            }
        }
        // A transpose's vectors: in one strided copy where their wire bytes lie in one listed run
        // (the listed side then holds them at the wire's spacing), else one by one.
        void strided(int64_t pool_off, int64_t pool_step, int64_t wire_off, int64_t wire_step,
                     int64_t len, int64_t count) {
            const WireRun& a = at(wire_off);
            const int64_t end = wire_off + (count - 1) * wire_step + len;
            if (end > a.wire + a.len) {
                for (int64_t k = 0; k < count; ++k)
                    (*this)(pool_off + k * pool_step, wire_off + k * wire_step, len);
                return;
            }
            covered += len * count;
            const int64_t a_off = a.pool + (wire_off - a.wire);
            if (list_source)
                copier.add_strided(base + pool_off, pool_step, from + a_off, wire_step, len, count,
                                   0);
            else
                copier.add_strided(base + a_off, wire_step, from + pool_off, pool_step, len, count,
                                   0);
        }
    } copy{listed, list_source, base, src.data, copier};
    if (list_source)
        walk_message(plan, msg, false, wire, dst.geometry(), dst.num_blocks(), msg.num_layers(),
                     plan.kv_factor, copy);
    else
        walk_message(plan, msg, true, wire, sg, src.num_blocks, msg.num_layers(), plan.kv_factor,
                     copy);
    const int64_t covered = copy.covered;
    KVSHARD_CHECK(covered == msg.bytes, "the direct copies of a message cover its ", msg.bytes,
                  " bytes, not ", covered);
    uint64_t h = 0;
    copier.finish(std::span<uint64_t>(&h, 1));
    return h;
}

namespace {

// Calls f(layer, kv, piece, head) for msg's units in their order (pack.h).
template <typename F>
void for_each_unit(const TransferMessage& msg, int kv_factor, F&& f) {
    for (int l = msg.layer_begin; l < msg.layer_end; ++l)
        for (int kv = 0; kv < kv_factor; ++kv)
            for (const TransferPiece& p : msg.pieces)
                for (int h = msg.head_begin; h < msg.head_end; ++h) f(l, kv, p, h);
}

}  // namespace

int64_t message_scales(const TransferPlan& plan, const TransferMessage& msg) {
    if (plan.src.layout.model.kv_dtype != DType::kFp8) return 0;
    return int64_t{msg.num_layers()} * plan.kv_factor * static_cast<int64_t>(msg.pieces.size()) *
           msg.num_heads();
}

void pack_scales(const TransferPlan& plan, const TransferMessage& msg, const BlockPool& pool,
                 std::span<float> out) {
    check_pool(plan, msg, true, pool, msg.bytes);
    require(static_cast<int64_t>(out.size()) == message_scales(plan, msg),
            "pack_scales: ", out.size(), " floats for the ", message_scales(plan, msg),
            " scales of the message");
    const RankKv& rk = plan.src.layout.ranks[static_cast<size_t>(msg.src_rank)];
    const int h0 = rk.kv_heads.front();
    size_t i = 0;
    for_each_unit(msg, plan.kv_factor, [&](int l, int kv, const TransferPiece& p, int h) {
        out[i++] = pool.scale(l - rk.layer_begin, kv, p.src_block, h - h0);
    });
}

void unpack_scales(const TransferPlan& plan, const TransferMessage& msg, std::span<const float> in,
                   BlockPool& pool) {
    check_pool(plan, msg, false, pool, msg.bytes);
    require(static_cast<int64_t>(in.size()) == message_scales(plan, msg),
            "unpack_scales: ", in.size(), " floats for the ", message_scales(plan, msg),
            " scales of the message");
    const RankKv& rk = plan.dst.layout.ranks[static_cast<size_t>(msg.dst_rank)];
    const int h0 = rk.kv_heads.front();
    size_t i = 0;
    for_each_unit(msg, plan.kv_factor, [&](int l, int kv, const TransferPiece& p, int h) {
        KVSHARD_CHECK(p.src_slot == p.dst_slot, "an fp8 piece keeps its slots");
        pool.set_scale(l - rk.layer_begin, kv, p.dst_block, h - h0, in[i++]);
    });
}

std::optional<uint64_t> unit_checksum(const TransferPlan& plan, const TransferMessage& msg,
                                      const SourceChecksums& sums) {
    check_pool(plan, msg, true, sums.pool(), msg.bytes);
    const RankKv& rk = plan.src.layout.ranks[static_cast<size_t>(msg.src_rank)];
    for (int l = msg.layer_begin; l < msg.layer_end; ++l)
        for (const TransferPiece& p : msg.pieces)
            if (p.src_slot != 0 || sums.sealed_tokens(l - rk.layer_begin, p.src_block) != p.count)
                return std::nullopt;
    thread_local std::vector<uint64_t> units;
    units.clear();
    const int h0 = rk.kv_heads.front();
    for_each_unit(msg, plan.kv_factor, [&](int l, int kv, const TransferPiece& p, int h) {
        units.push_back(sums.unit(l - rk.layer_begin, kv, p.src_block, h - h0));
    });
    return xxh3_64(units.data(), units.size() * sizeof(uint64_t));
}

uint64_t copy_direct_units(const TransferPlan& plan, const TransferMessage& msg,
                           const SourceArena& src, BlockPool& dst) {
    const PageGeometry sg =
        rank_page_geometry(plan.src.layout, msg.src_rank, plan.src.block_size, plan.src.order);
    require(sg.order == PageOrder::kHnd,
            "a direct read with unit checksums needs an HND source; source rank ", msg.src_rank,
            " is NHD");
    check_direct(plan, msg, sg, src, dst);
    const RankKv& srk = plan.src.layout.ranks[static_cast<size_t>(msg.src_rank)];
    const RankKv& drk = plan.dst.layout.ranks[static_cast<size_t>(msg.dst_rank)];
    const PageGeometry& dg = dst.geometry();
    const int64_t vec = plan.vector_bytes();
    const int sh0 = srk.kv_heads.front(), dh0 = drk.kv_heads.front();
    const bool dst_hnd = dg.order == PageOrder::kHnd;
    // The units' copies, listed first so that each copy can prefetch the source of the unit after
    // next.
    struct Unit {
        const std::byte* src;
        std::byte* dst;
        int64_t len;
    };
    thread_local std::vector<Unit> list;
    list.clear();
    for_each_unit(msg, plan.kv_factor, [&](int l, int kv, const TransferPiece& p, int h) {
        const int64_t spage =
            ((int64_t{l - srk.layer_begin} * sg.kv_factor + kv) * src.num_blocks + p.src_block) *
            sg.page_bytes();
        std::byte* dpage = dst.page(l - drk.layer_begin, kv, p.dst_block);
        list.push_back({src.data + spage + (int64_t{h - sh0} * sg.block_size + p.src_slot) * vec,
                        dst_hnd ? dpage + (int64_t{h - dh0} * dg.block_size + p.dst_slot) * vec
                                : dpage + (int64_t{p.dst_slot} * dg.num_heads + (h - dh0)) * vec,
                        int64_t{p.count} * vec});
    });
    thread_local std::vector<uint64_t> units;
    units.resize(list.size());
    const int64_t dst_step = dst_hnd ? vec : int64_t{dg.num_heads} * vec;  // per vector
    int64_t covered = 0;
    for (size_t i = 0; i < list.size(); ++i) {
        const Unit& u = list[i];
        // The unit after next: its lines are in flight while this one is copied and hashed (the
        // hardware prefetchers stop at each 4 KiB page and, with no misses while a unit is hashed,
        // would not be ahead even where the units continue each other).
        constexpr size_t kAhead = 2;
        const Unit* next = i + kAhead < list.size() ? &list[i + kAhead] : nullptr;
        const int64_t pf_lines = next ? (std::min<int64_t>(next->len, 16384) + 63) / 64 : 0;
        // In 512-byte steps (NHD destination: vector by vector, each to its token), each step
        // prefetching its share of that unit's lines.
        const int64_t step = dst_hnd ? 512 : vec;
        const int64_t steps = (u.len + step - 1) / step;
        const int64_t per_step = (pf_lines + steps - 1) / steps;
        int64_t line = 0;
        for (int64_t off = 0; off < u.len; off += step) {
            for (int64_t j = 0; j < per_step && line < pf_lines; ++j, ++line)
                __builtin_prefetch(next->src + line * 64, 0, 2);
            stream_copy(dst_hnd ? u.dst + off : u.dst + off / vec * dst_step, u.src + off,
                        std::min(step, u.len - off));
        }
        units[i] = xxh3_64(u.src, static_cast<size_t>(u.len));  // from L1: just copied
        covered += u.len;
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
    KVSHARD_CHECK(covered == msg.bytes, "the units of a message cover its ", msg.bytes,
                  " bytes, not ", covered);
    return xxh3_64(units.data(), units.size() * sizeof(uint64_t));
}

}  // namespace kvshard
