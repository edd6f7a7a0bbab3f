#include "kvshard/transfer/transfer_exec.h"

#include <sched.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "kvshard/common/error.h"
#include "kvshard/common/xxh3.h"
#include "kvshard/transfer/rma_read.h"

namespace kvshard {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr int kTagBase = 1 << 19;
constexpr int kTagSlots = 1 << 16;
constexpr int kHeaderKind = kTransferHeaderKind, kPayloadKind = kTransferPayloadKind,
              kAckKind = kTransferAckKind;

uint64_t header_hash(const TransferHeader& h) {
    return xxh3_64(&h, offsetof(TransferHeader, header_xxh3));
}

uint64_t hello_hash(const TransferHello& h) {
    return xxh3_64(&h, offsetof(TransferHello, hello_xxh3));
}

template <typename T>
std::span<const std::byte> bytes_of(const T& v) {
    return std::as_bytes(std::span<const T, 1>(&v, 1));
}
template <typename T>
std::span<std::byte> writable_bytes_of(T& v) {
    return std::as_writable_bytes(std::span<T, 1>(&v, 1));
}

// Between polls: spin while things move, sleep once idle for a while (the cores may be shared).
void idle(double idle_seconds, int sleep_us = 0) {
    if (sleep_us > 0)
        std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    else if (idle_seconds < 0.05)
        std::this_thread::yield();
    else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
}

// How many CPUs this thread may run on (its affinity mask: mpirun binds a rank to one core when
// there are as many ranks as cores). A worker thread only pays where it can run beside us.
int usable_cpus() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
    return CPU_COUNT(&set);
}

// Checks payloads that landed in the pool, on a thread of its own: the receiver's thread goes on
// receiving meanwhile (with a single-copy transport, MPI's copy runs inside its calls), so the
// check overlaps the next payload's copy instead of following it.
class CheckWorker {
  public:
    struct Job {
        std::span<const std::byte> data;
        uint64_t want = 0;
        int message = 0;
        bool ok = false;
    };
    CheckWorker() : thread_([this] { run(); }) {}
    ~CheckWorker() {
        {
            std::lock_guard lk(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }
    CheckWorker(const CheckWorker&) = delete;
    CheckWorker& operator=(const CheckWorker&) = delete;

    void submit(const Job& j) {
        {
            std::lock_guard lk(mu_);
            todo_.push_back(j);
        }
        cv_.notify_all();
    }
    // The finished jobs since the last call.
    std::vector<Job> take_done() {
        std::lock_guard lk(mu_);
        std::vector<Job> out;
        out.swap(done_);
        return out;
    }
    // Submitted and not yet taken.
    int outstanding() {
        std::lock_guard lk(mu_);
        return static_cast<int>(todo_.size() + done_.size()) + (busy_ ? 1 : 0);
    }
    // Blocks until every submitted job is finished (their results stay for take_done).
    void drain() {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [this] { return todo_.empty() && !busy_; });
    }

  private:
    void run() {
        std::unique_lock lk(mu_);
        for (;;) {
            cv_.wait(lk, [this] { return stop_ || !todo_.empty(); });
            if (todo_.empty()) return;  // stopping
            Job j = todo_.front();
            todo_.pop_front();
            busy_ = true;
            lk.unlock();
            j.ok = xxh3_64(j.data.data(), j.data.size()) == j.want;
            lk.lock();
            busy_ = false;
            done_.push_back(j);
            cv_.notify_all();  // a drain() may wait
        }
    }
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Job> todo_;
    std::vector<Job> done_;
    bool busy_ = false;  // a job is being checked
    bool stop_ = false;
    std::thread thread_;
};

}  // namespace

std::shared_ptr<StagingPool> StagingPool::create(int64_t keep_bytes) {
    return std::shared_ptr<StagingPool>(new StagingPool(keep_bytes));
}

StagingPool::Buffer StagingPool::acquire(size_t size) {
    Buffer b;
    b.pool_ = shared_from_this();
    b.size_ = size;
    {
        std::lock_guard lk(mu_);
        auto it = free_.lower_bound(size);
        if (it != free_.end()) {
            b.capacity_ = it->first;
            b.data_ = std::move(it->second);
            kept_ -= static_cast<int64_t>(it->first);
            free_.erase(it);
            return b;
        }
    }
    b.capacity_ = std::max<size_t>(size, 1);
    b.data_ = allocate_large(b.capacity_);  // no zero fill
    return b;
}

void StagingPool::give_back(LargeBuffer data, size_t capacity) {
    std::lock_guard lk(mu_);
    free_.emplace(capacity, std::move(data));
    kept_ += static_cast<int64_t>(capacity);
    while (kept_ > keep_bytes_ && !free_.empty()) {  // drop the smallest first
        kept_ -= static_cast<int64_t>(free_.begin()->first);
        free_.erase(free_.begin());
    }
}

void StagingPool::Buffer::reset() {
    if (data_ && pool_) pool_->give_back(std::move(data_), capacity_);
    data_.reset();
    pool_.reset();
    capacity_ = size_ = 0;
}

StagingPool::Buffer& StagingPool::Buffer::operator=(Buffer&& o) noexcept {
    if (this != &o) {
        reset();
        pool_ = std::move(o.pool_);
        data_ = std::move(o.data_);
        capacity_ = o.capacity_;
        size_ = o.size_;
        o.capacity_ = o.size_ = 0;
    }
    return *this;
}

StagingPool::Buffer::~Buffer() { reset(); }

std::string_view transfer_status_name(TransferStatus s) {
    switch (s) {
        case TransferStatus::kOk:
            return "ok";
        case TransferStatus::kSourceAborted:
            return "source-aborted";
        case TransferStatus::kChecksumMismatch:
            return "checksum-mismatch";
        case TransferStatus::kBadHeader:
            return "bad-header";
        case TransferStatus::kTimeout:
            return "timeout";
        case TransferStatus::kPeerFailed:
            return "peer-failed";
        case TransferStatus::kLocalError:
            return "local-error";
    }
    return "?";
}

void TransferExecOptions::validate() const {
    require(staging_bytes >= 1, "staging_bytes must be at least 1, got ", staging_bytes);
    require(timeout_s > 0, "timeout_s must be positive, got ", timeout_s);
    require(sender_idle_sleep_us >= 0 && sender_idle_sleep_us <= 1000000,
            "sender_idle_sleep_us must be between 0 (spin) and 1000000 (1 s), got ",
            sender_idle_sleep_us);
    require(direct_window >= 0, "direct_window must be at least 0 (0: no bound), got ",
            direct_window);
}

int transfer_tag(uint64_t request_id, int kind) {
    return kTagBase + static_cast<int>(request_id % kTagSlots) * 3 + kind;
}

void seal_header(TransferHeader& h) { h.header_xxh3 = header_hash(h); }

void seal_hello(TransferHello& h) { h.hello_xxh3 = hello_hash(h); }

std::string check_hello(const TransferHello& h, uint64_t request_id, int src_rank, int dst_rank) {
    if (h.magic != TransferHello::kMagic || h.version != TransferHeader::kVersion)
        return detail::concat("not a transfer hello (magic ", h.magic, ", version ", h.version,
                              "; this side speaks version ", TransferHeader::kVersion, ")");
    if (h.hello_xxh3 != hello_hash(h)) return "hello checksum mismatch";
    if (h.request_id != request_id || h.src_rank != static_cast<uint32_t>(src_rank) ||
        h.dst_rank != static_cast<uint32_t>(dst_rank))
        return detail::concat("hello for request ", h.request_id, " (", h.src_rank, "->",
                              h.dst_rank, ") where request ", request_id, " (", src_rank, "->",
                              dst_rank, ") was expected");
    return "";
}

std::string check_header(const TransferHeader& h, const TransferPlan& plan, uint64_t request_id,
                         int message_index) {
    if (h.magic != TransferHeader::kMagic || h.version != TransferHeader::kVersion)
        return detail::concat("not a transfer header (magic ", h.magic, ", version ", h.version,
                              ")");
    if (h.header_xxh3 != header_hash(h)) return "header checksum mismatch";
    const TransferMessage& m = plan.messages.at(message_index);
    if (h.request_id != request_id || h.message_index != static_cast<uint32_t>(message_index) ||
        h.src_rank != static_cast<uint32_t>(m.src_rank) ||
        h.dst_rank != static_cast<uint32_t>(m.dst_rank) ||
        h.layer_group != static_cast<uint32_t>(m.layer_group))
        return detail::concat("header for request ", h.request_id, " message ", h.message_index,
                              " (", h.src_rank, "->", h.dst_rank, ") where request ", request_id,
                              " message ", message_index, " (", m.src_rank, "->", m.dst_rank,
                              ") was expected");
    const uint32_t known =
        TransferHeader::kDirect | TransferHeader::kUnitChecksum | TransferHeader::kPacked;
    if ((h.flags & ~known) != 0 ||
        ((h.flags & (TransferHeader::kUnitChecksum | TransferHeader::kPacked)) != 0 &&
         (h.flags & TransferHeader::kDirect) == 0))
        return detail::concat(
            "header flags ", h.flags, " are not a valid combination (", TransferHeader::kDirect,
            " direct read, ", TransferHeader::kDirect | TransferHeader::kUnitChecksum,
            " direct read with a unit checksum, plus ", TransferHeader::kPacked, " packed, or 0)");
    if (h.status == static_cast<uint32_t>(TransferStatus::kOk) &&
        h.payload_bytes != static_cast<uint64_t>(m.bytes))
        return detail::concat("header announces ", h.payload_bytes,
                              " payload bytes, the plan says ", m.bytes);
    return "";
}

// ---- sender ----------------------------------------------------------------------------------

namespace {

// The schedule a sender (source_side) or receiver of `rank` follows: the caller's, checked against
// this side, or this side's own from its pool.
std::shared_ptr<const TransferSchedule> side_schedule(const TransferPlan& plan,
                                                      const TransferExecOptions& opt,
                                                      TransferMode mode, bool source_side, int rank,
                                                      const BlockPool& pool) {
    const PoolPages mine = pool_pages(pool);
    if (opt.schedule) {
        const TransferSchedule& s = *opt.schedule;
        const auto& pools = source_side ? s.src_pools : s.dst_pools;
        require(s.messages.size() == plan.messages.size() && s.mode == mode && !s.direct_read,
                "TransferExecOptions::schedule is of another plan or mode, or made with direct "
                "reads (make it with direct_read false and the options' mode)");
        require(rank < static_cast<int>(pools.size()) && pools[size_t(rank)] == mine,
                "TransferExecOptions::schedule was made for other pages than the pool of ",
                source_side ? "source" : "destination", " rank ", rank);
        return opt.schedule;
    }
    // This rank's pages only (the others' messages are not this side's business).
    std::vector<PoolPages> pages = side_pool_pages(plan, source_side, 0);
    require(rank >= 0 && rank < static_cast<int>(pages.size()) &&
                pages[size_t(rank)].geometry == mine.geometry,
            "the ", source_side ? "source" : "destination", " pool of rank ", rank,
            " does not have that rank's page geometry");
    pages[size_t(rank)].num_blocks = mine.num_blocks;
    const TransferScheduleOptions so{
        .mode = mode, .direct_read = false, .staging_bytes = opt.staging_bytes};
    return std::make_shared<const TransferSchedule>(
        source_side ? make_transfer_schedule(plan, pages, {}, so)
                    : make_transfer_schedule(plan, {}, pages, so));
}

}  // namespace

struct TransferSender::Impl {
    Communicator& world;
    std::shared_ptr<const TransferPlan> plan;
    uint64_t request_id;
    int src_rank;
    const BlockPool& pool;
    TransferExecOptions opt;
    std::shared_ptr<StagingPool> staging;
    TransferMode mode;
    Clock::time_point t0 = Clock::now();
    Clock::time_point last_progress = t0;

    std::shared_ptr<const TransferSchedule> schedule;
    std::vector<int> mine;  // plan message indices, in the schedule's (plan) order
    size_t next = 0;
    int ready_end = 0;  // layers [0, ready_end) are final
    bool failed_locally = false;
    std::string fail_reason;

    struct InFlight {
        int dst = 0;
        TransferHeader header;
        StagingPool::Buffer payload;
        std::span<const std::byte> direct;  // zero copy: the payload is this run of the pool
        Request header_req, payload_req;
    };
    std::list<InFlight> in_flight;
    int64_t staged = 0;

    // Per distinct destination rank: the hello sent, what it replied, the control message being
    // received (reply, credits, final ack: one at a time, in order), direct-read accounting.
    struct Peer {
        int rank = 0;
        TransferHello hello;
        Request hello_req;
        TransferAck ctl;
        Request ctl_req;
        bool replied = false;  // it said how it takes my messages (or I offered no choice)
        bool direct = false;   // it reads my pool in place
        bool closed = false;   // acked, so it listens no more
        int announced = 0;     // direct: messages announced to it
        int credited = 0;      // direct: messages it has read
        // RMA, packed (it asked for it): my messages to it in order, and where each goes in my
        // pack area (rma_pack_offsets).
        bool packed = false;
        std::vector<int> pair_messages;
        std::vector<int64_t> pack_offsets;
    };
    std::vector<Peer> peers;  // stable: requests point into it
    TransferResult result;
    bool pack_area_held = false;  // opt.rma_window's pack area is this request's (acquire)

    ~Impl() { release_pack_area(); }
    void release_pack_area() {
        if (pack_area_held) opt.rma_window->release_pack_area();
        pack_area_held = false;
    }

    Impl(Communicator& w, std::shared_ptr<const TransferPlan> p, uint64_t rid, int r,
         const BlockPool& pl, TransferExecOptions o)
        : world(w), plan(std::move(p)), request_id(rid), src_rank(r), pool(pl), opt(o) {
        mode = resolve_mode(*plan, opt.mode);
        require(!opt.source_checksums || &opt.source_checksums->pool() == &pool,
                "the source checksums given to the sender of source rank ", src_rank,
                " are of another pool than its own");
        staging = opt.staging_pool ? opt.staging_pool : StagingPool::create();
        schedule = side_schedule(*plan, opt, mode, true, src_rank, pool);
        mine = schedule->sends[static_cast<size_t>(src_rank)];
        std::vector<int> dsts;
        for (int i : mine) {
            const int d = plan->messages[i].dst_rank;
            if (std::find(dsts.begin(), dsts.end(), d) == dsts.end()) dsts.push_back(d);
        }
        peers.resize(dsts.size());
        const SharedArenaId* shared = opt.direct_read ? pool.shared_id() : nullptr;
        for (size_t k = 0; k < dsts.size(); ++k) {
            Peer& q = peers[k];
            q.rank = dsts[k];
            q.hello.request_id = request_id;
            q.hello.src_rank = static_cast<uint32_t>(src_rank);
            q.hello.dst_rank = static_cast<uint32_t>(q.rank);
            if (shared != nullptr) {
                q.hello.flags = TransferHello::kShareable;
                q.hello.pid = shared->pid;
                q.hello.fd = shared->fd;
                q.hello.token[0] = shared->token[0];
                q.hello.token[1] = shared->token[1];
                q.hello.arena_bytes = shared->bytes;
                q.hello.num_blocks = pool.num_blocks();
            }
            if (opt.direct_read && opt.rma_window) {  // readable through the window too
                q.hello.flags |= TransferHello::kRmaWindow;
                q.hello.num_blocks = pool.num_blocks();
                if (k == 0) pack_area_held = opt.rma_window->acquire_pack_area();
                if (pack_area_held) q.hello.flags |= TransferHello::kPackArea;
            }
            // Offering nothing, it needs no answer: messages.
            q.replied =
                (q.hello.flags & (TransferHello::kShareable | TransferHello::kRmaWindow)) == 0;
            seal_hello(q.hello);
            const int dest = opt.dst_world_base + q.rank;
            q.hello_req =
                world.isend(bytes_of(q.hello), dest, transfer_tag(request_id, kHeaderKind));
            q.ctl_req =
                world.irecv(writable_bytes_of(q.ctl), dest, transfer_tag(request_id, kAckKind));
        }
    }

    void set_status(TransferStatus s, const std::string& why) {
        if (result.status == TransferStatus::kOk) {
            result.status = s;
            result.error = why;
        }
    }

    bool aborting() const { return result.status != TransferStatus::kOk; }

    Peer& peer(int dst) {
        return *std::find_if(peers.begin(), peers.end(),
                             [dst](const Peer& q) { return q.rank == dst; });
    }

    void post(InFlight&& f, int dest) {
        in_flight.push_back(std::move(f));
        auto& b = in_flight.back();
        b.header_req = world.isend(std::as_bytes(std::span<const TransferHeader, 1>(&b.header, 1)),
                                   dest, transfer_tag(request_id, kHeaderKind));
        const std::span<const std::byte> data =
            b.direct.empty() ? std::span<const std::byte>(b.payload) : b.direct;
        if (!data.empty())
            b.payload_req = world.isend(data, dest, transfer_tag(request_id, kPayloadKind));
    }

    // The destination asked for packed reads: where each of my messages to it goes.
    void start_packing(Peer& q) {
        q.packed = true;
        q.pack_offsets = rma_pack_offsets(*plan, src_rank, q.rank,
                                          static_cast<int64_t>(opt.rma_window->pack_area().size()));
        for (size_t i = 0; i < plan->messages.size(); ++i)
            if (plan->messages[i].src_rank == src_rank && plan->messages[i].dst_rank == q.rank)
                q.pair_messages.push_back(static_cast<int>(i));
        require(q.pack_offsets.size() == q.pair_messages.size(), "source rank ", src_rank,
                ": destination rank ", q.rank,
                " asked for packed reads, but a message does not fit the pack area");
    }

    // Packed: writes message idx into my pack area once no uncredited message of that
    // destination lies over its bytes; false while one does. xxh3: its payload's XXH3, computed
    // while packing, where asked.
    bool pack_for(Peer& q, int idx, uint64_t* xxh3) {
        const size_t k = static_cast<size_t>(
            std::lower_bound(q.pair_messages.begin(), q.pair_messages.end(), idx) -
            q.pair_messages.begin());
        KVSHARD_CHECK(k < q.pair_messages.size() && q.pair_messages[k] == idx,
                      "a packed message is one of the pair's");
        const TransferMessage& msg = plan->messages[idx];
        const int64_t at = q.pack_offsets[k], end = at + msg.bytes;
        for (size_t j = static_cast<size_t>(q.credited); j < k; ++j) {
            const int64_t b = q.pack_offsets[j];
            if (b < end && at < b + plan->messages[q.pair_messages[j]].bytes) return false;
        }
        const std::span<std::byte> out = opt.rma_window->pack_area().subspan(
            static_cast<size_t>(at), static_cast<size_t>(msg.bytes));
        const TransferMessage* msgs[] = {&msg};
        const std::span<std::byte> outs[] = {out};
        pack_messages(*plan, msgs, mode, pool, outs,
                      xxh3 != nullptr ? std::span<uint64_t>(xxh3, 1) : std::span<uint64_t>());
        return true;
    }

    // Accounts for the message at `next`, sent without a batch (kind: the counter of its kind),
    // and moves on.
    void sent_one(const TransferMessage& msg, int& kind) {
        result.bytes += msg.bytes;
        ++result.messages;
        ++kind;
        if (result.first_send_s < 0) result.first_send_s = seconds_since(t0);
        result.last_send_s = seconds_since(t0);
        ++next;
    }

    bool send_next() {
        if (next >= mine.size()) return false;
        const int idx = mine[next];
        const TransferMessage& msg = plan->messages[idx];
        Peer& to = peer(msg.dst_rank);
        if (to.closed) {  // that destination stopped listening
            ++next;
            return true;
        }
        InFlight f;
        f.dst = msg.dst_rank;
        f.header.mode = mode == TransferMode::kPreSend ? 0 : 1;
        f.header.request_id = request_id;
        f.header.src_rank = static_cast<uint32_t>(msg.src_rank);
        f.header.dst_rank = static_cast<uint32_t>(msg.dst_rank);
        f.header.message_index = static_cast<uint32_t>(idx);
        f.header.layer_group = static_cast<uint32_t>(msg.layer_group);
        const int dest = opt.dst_world_base + msg.dst_rank;
        if (aborting()) {
            f.header.status = static_cast<uint32_t>(TransferStatus::kSourceAborted);
            seal_header(f.header);
            post(std::move(f), dest);
            ++next;
            return true;
        }
        if (msg.layer_end > ready_end) return false;
        if (!to.replied) return false;  // how it takes its messages is not known yet
        if (to.direct) {
            // Only the header travels; the destination reads the bytes from my pool.
            const auto tp = Clock::now();
            std::optional<uint64_t> units;
            if (opt.source_checksums) units = unit_checksum(*plan, msg, *opt.source_checksums);
            // The bound keeps a checksum pass just ahead of the destination's read; a message
            // announced from the seals makes no pass and is not held back (waiting for a credit
            // would only add a round trip per message to the destination's reads).
            if (!units && opt.direct_window > 0 && to.announced - to.credited >= opt.direct_window)
                return false;  // its reads are behind: announce no further ahead
            f.header.payload_bytes = static_cast<uint64_t>(msg.bytes);
            f.header.flags = TransferHeader::kDirect;
            uint64_t packed_xxh3 = 0;
            if (to.packed) {  // into my pack area first (its checksum while packing)
                if (!pack_for(to, idx, units ? nullptr : &packed_xxh3)) {
                    result.pack_seconds += seconds_since(tp);
                    return false;  // its bytes there are still to be read
                }
                f.header.flags |= TransferHeader::kPacked;
                ++result.packed_messages;
            }
            if (units) {  // sealed when written: no pass over the bytes
                f.header.payload_xxh3 = *units;
                f.header.flags |= TransferHeader::kUnitChecksum;
                ++result.unit_checksum_messages;
            } else {
                f.header.payload_xxh3 =
                    to.packed ? packed_xxh3 : hash_payload(*plan, msg, mode, pool);
            }
            seal_header(f.header);
            result.pack_seconds += seconds_since(tp);
            post(std::move(f), dest);
            ++to.announced;
            result.peak_direct_ahead =
                std::max(result.peak_direct_ahead, to.announced - to.credited);
            sent_one(msg, result.direct_messages);
            return true;
        }
        if (!in_flight.empty() && staged + msg.bytes > opt.staging_bytes)
            return false;  // back-pressure
        const ScheduledMessage& planned = schedule->messages[static_cast<size_t>(idx)];
        if (planned.path == TransferPath::kZeroCopy) {
            const int64_t off = planned.src_offset;
            {  // zero copy: send straight from the pool
                // The payload is posted before its header: the checksum pass over the pool then
                // runs while MPI moves the payload (the receiver posts the receive of a zero-copy
                // payload without waiting for its header, and a staged one after it; either way
                // each side's operations stay in message order per tag).
                f.direct = std::span<const std::byte>(pool.arena().data() + off,
                                                      static_cast<size_t>(msg.bytes));
                f.header.payload_bytes = static_cast<uint64_t>(msg.bytes);
                in_flight.push_back(std::move(f));
                InFlight& b = in_flight.back();
                b.payload_req = world.isend(b.direct, dest, transfer_tag(request_id, kPayloadKind));
                const auto tp = Clock::now();
                b.header.payload_xxh3 = xxh3_64(b.direct.data(), b.direct.size());
                seal_header(b.header);
                result.pack_seconds += seconds_since(tp);
                b.header_req =
                    world.isend(std::as_bytes(std::span<const TransferHeader, 1>(&b.header, 1)),
                                dest, transfer_tag(request_id, kHeaderKind));
                sent_one(msg, result.zero_copy_messages);
                return true;
            }
        }
        // Its batch (the schedule's): this and the following messages of the same layers (to other
        // destinations), packed in one pass over the pages; where a destination of the batch reads
        // in place or stopped listening, the batch ends before it.
        size_t end = next + 1;
        while (end < mine.size()) {
            const ScheduledMessage& m2 = schedule->messages[static_cast<size_t>(mine[end])];
            if (planned.batch < 0 || m2.batch != planned.batch) break;
            const Peer& q = peer(m2.dst_rank);
            if (q.closed || !q.replied || q.direct) break;
            ++end;
        }
        int64_t batch_bytes = 0;
        for (size_t k = next; k < end; ++k) batch_bytes += plan->messages[mine[k]].bytes;
        if (!in_flight.empty() && staged + batch_bytes > opt.staging_bytes)
            return false;  // back-pressure: the batch goes whole
        const auto tp = Clock::now();
        std::vector<InFlight> batch;
        std::vector<const TransferMessage*> msgs;
        std::vector<std::span<std::byte>> outs;
        batch.reserve(end - next);
        for (size_t k = next; k < end; ++k) {
            const int i = mine[k];
            const TransferMessage& m = plan->messages[i];
            InFlight b;
            b.dst = m.dst_rank;
            b.header = f.header;
            b.header.dst_rank = static_cast<uint32_t>(m.dst_rank);
            b.header.message_index = static_cast<uint32_t>(i);
            b.header.layer_group = static_cast<uint32_t>(m.layer_group);
            b.header.payload_bytes = static_cast<uint64_t>(m.bytes);
            b.payload = staging->acquire(static_cast<size_t>(m.bytes));
            batch.push_back(std::move(b));
            msgs.push_back(&m);
        }
        for (auto& b : batch) outs.emplace_back(b.payload);
        std::vector<uint64_t> sums(batch.size());
        pack_messages(*plan, msgs, mode, pool, outs, sums);  // checksums computed while packing
        for (size_t k = 0; k < batch.size(); ++k) {
            InFlight& b = batch[k];
            b.header.payload_xxh3 = sums[k];
            seal_header(b.header);
        }
        result.pack_seconds += seconds_since(tp);
        for (auto& b : batch) {
            const int64_t bytes = static_cast<int64_t>(b.payload.size());
            const int to = opt.dst_world_base + b.dst;
            staged += bytes;
            post(std::move(b), to);
            result.bytes += bytes;
            ++result.messages;
        }
        result.peak_staging = std::max(result.peak_staging, staged);
        if (result.first_send_s < 0) result.first_send_s = seconds_since(t0);
        result.last_send_s = seconds_since(t0);
        next = end;
        return true;
    }

    // True when something moved.
    bool step() {
        bool moved = false;
        // Control messages from each destination, in order: the reply to my hello, credits, and
        // the final ack (it listens no more; one that failed fails the request).
        for (Peer& q : peers) {
            while (!q.closed && q.ctl_req.test()) {
                moved = true;
                const TransferAck a = q.ctl;
                if (a.magic != TransferAck::kMagic || a.request_id != request_id) {
                    set_status(TransferStatus::kBadHeader,
                               detail::concat("bad ack from destination rank ", q.rank));
                    q.closed = true;
                    break;
                }
                if (a.kind == TransferAck::kDone) {
                    q.closed = true;
                    if (a.status != static_cast<uint32_t>(TransferStatus::kOk))
                        set_status(
                            TransferStatus::kPeerFailed,
                            detail::concat(
                                "destination rank ", q.rank, " failed the request: ",
                                transfer_status_name(static_cast<TransferStatus>(a.status))));
                    break;
                }
                if (a.kind == TransferAck::kReply) {
                    q.replied = true;
                    q.direct = (a.flags & TransferAck::kDirectRead) != 0 &&
                               (q.hello.flags &
                                (TransferHello::kShareable | TransferHello::kRmaWindow)) != 0;
                    if (q.direct && (a.flags & TransferAck::kPacked) != 0) {
                        if ((q.hello.flags & TransferHello::kPackArea) == 0) {
                            set_status(TransferStatus::kBadHeader,
                                       detail::concat("destination rank ", q.rank,
                                                      " asked for packed reads, not offered"));
                            q.closed = true;
                            break;
                        }
                        start_packing(q);
                    }
                } else if (a.kind == TransferAck::kCredit) {
                    q.credited = std::max(q.credited, static_cast<int>(a.count));
                }
                q.ctl_req = world.irecv(writable_bytes_of(q.ctl), opt.dst_world_base + q.rank,
                                        transfer_tag(request_id, kAckKind));
            }
        }
        // Every destination answered and none packs: the pack area goes back for other requests.
        if (pack_area_held && std::all_of(peers.begin(), peers.end(), [](const Peer& q) {
                return (q.replied || q.closed) && !q.packed;
            }))
            release_pack_area();
        for (auto it = in_flight.begin(); it != in_flight.end();) {
            const bool dropped = peer(it->dst).closed;  // never matched: cancel
            if (!dropped && (!it->header_req.test() ||
                             (it->payload_req.pending() && !it->payload_req.test()))) {
                ++it;
                continue;
            }
            staged -= static_cast<int64_t>(it->payload.size());
            it = in_flight.erase(it);
            moved = true;
        }
        while (send_next()) moved = true;
        return moved;
    }

    bool finished() const {
        return next >= mine.size() && in_flight.empty() &&
               std::all_of(peers.begin(), peers.end(), [](const Peer& q) { return q.closed; });
    }

    void time_out() {
        give_up(TransferStatus::kTimeout,
                detail::concat("source rank ", src_rank, ": no progress for ", opt.timeout_s,
                               " s (", mine.size() - next, " messages unsent, ", in_flight.size(),
                               " in flight)"));
    }

    // Ends the request here: what is in flight or unmatched is cancelled.
    void give_up(TransferStatus status, const std::string& why) {
        set_status(status, why);
        in_flight.clear();
        for (Peer& q : peers) {  // cancel what never matched
            q.hello_req = Request();
            q.ctl_req = Request();
            q.closed = true;
        }
    }
};

TransferSender::TransferSender(Communicator& world, std::shared_ptr<const TransferPlan> plan,
                               uint64_t request_id, int src_rank, const BlockPool& pool,
                               TransferExecOptions options)
    : impl_(std::make_unique<Impl>(world, std::move(plan), request_id, src_rank, pool, options)) {
    KVSHARD_CHECK(src_rank >= 0 && src_rank < impl_->plan->src.layout.world_size(),
                  "source rank out of range");
    const PageGeometry want = rank_page_geometry(
        impl_->plan->src.layout, src_rank, impl_->plan->src.block_size, impl_->plan->src.order);
    require(pool.geometry() == want, "the pool given to the sender of source rank ", src_rank,
            " does not have that rank's page geometry");
    progress();
}

TransferSender::~TransferSender() = default;

void TransferSender::layer_ready(int layer) {
    impl_->ready_end = std::max(impl_->ready_end, layer + 1);
}

void TransferSender::all_layers_ready() {
    impl_->ready_end = impl_->plan->src.layout.model.num_layers;
}

void TransferSender::fail(const std::string& reason) {
    if (impl_->failed_locally) return;
    impl_->failed_locally = true;
    impl_->fail_reason = reason;
    impl_->set_status(TransferStatus::kSourceAborted, reason);
}

bool TransferSender::progress() {
    if (done_) return true;
    Impl& s = *impl_;
    try {
        if (s.step()) s.last_progress = Clock::now();
    } catch (const std::exception& e) {
        // The request fails, not the caller: its other messages go as aborted headers (fail()),
        // and a second failure while doing that gives up at once.
        const std::string why = detail::concat("source rank ", s.src_rank, ": ", e.what());
        if (s.aborting()) {
            s.give_up(TransferStatus::kSourceAborted, why);
            done_ = true;
            s.result.seconds = seconds_since(s.t0);
            return true;
        }
        s.set_status(TransferStatus::kSourceAborted, why);
        s.failed_locally = true;
        s.fail_reason = why;
        s.last_progress = Clock::now();
    }
    // Waiting for prefill, not for a peer: that does not count against the timeout, once the
    // peer has answered (a destination that never answers the hello times the sender out).
    if (s.next < s.mine.size() && !s.aborting()) {
        const TransferMessage& m = s.plan->messages[s.mine[s.next]];
        if (m.layer_end > s.ready_end && s.peer(m.dst_rank).replied) s.last_progress = Clock::now();
    }
    if (s.finished()) {
        done_ = true;
    } else if (seconds_since(s.last_progress) > s.opt.timeout_s) {
        s.time_out();
        done_ = true;
    }
    if (done_) {
        s.result.seconds = seconds_since(s.t0);
        s.release_pack_area();  // its destinations are done with it (or timed out)
    }
    return done_;
}

TransferResult TransferSender::finish() {
    while (!progress()) idle(idle_seconds(), idle_sleep_us());
    return impl_->result;
}

double TransferSender::idle_seconds() const { return seconds_since(impl_->last_progress); }

bool TransferSender::connected() const {
    return std::all_of(impl_->peers.begin(), impl_->peers.end(),
                       [](const Impl::Peer& q) { return q.replied || q.closed; });
}

int TransferSender::idle_sleep_us() const {
    return impl_->next >= impl_->mine.size() ? impl_->opt.sender_idle_sleep_us : 0;
}

// ---- receiver --------------------------------------------------------------------------------

struct TransferReceiver::Impl {
    Communicator& world;
    std::shared_ptr<const TransferPlan> plan;
    uint64_t request_id;
    int dst_rank;
    BlockPool& pool;
    TransferExecOptions opt;
    std::shared_ptr<StagingPool> staging;
    TransferMode mode;
    std::shared_ptr<const TransferSchedule> schedule;
    Clock::time_point t0 = Clock::now();
    Clock::time_point last_progress = t0;

    // Per source: its hello and how its messages come, its messages to me in order, the next one,
    // and the receive in progress.
    struct Source {
        int rank = 0;
        std::vector<int> messages;
        TransferHello hello;
        Request hello_req;
        bool hello_done = false;
        bool reads_in_place = false;        // direct read from its pool
        bool rma = false;                   // ... through opt.rma_window
        std::vector<int64_t> pack_offsets;  // ... packed by it (rma_pack_offsets)
        // RMA: direct-read headers taken but not read yet (read together: rma_read_messages).
        struct Announced {
            int message = 0;
            size_t position = 0;  // in `messages`
            uint64_t want = 0;    // the header's checksum
            bool units = false;
        };
        std::vector<Announced> announced;
        std::shared_ptr<const SharedArenaView> view;  // ... mapped here
        SourceArena arena;
        size_t next = 0;
        TransferHeader header;
        Request header_req;
        bool header_posted = false;
        bool have_header = false;  // header arrived, payload not yet received
        StagingPool::Buffer payload;
        std::span<std::byte> direct;  // zero copy: receiving straight into this run of the pool
        Request payload_req;
        bool payload_posted = false;
    };
    std::vector<Source> sources;
    int64_t staged = 0;
    TransferResult result;
    bool acks_sent = false;
    // Verified payloads waiting for the rest of their layer range's messages, to be unpacked in one
    // pass over the pages (unpack_messages). Key: (layer_begin, layer_end).
    struct Pending {
        std::vector<int> messages;
        std::vector<StagingPool::Buffer> payloads;
        std::vector<uint64_t> sums;  // the headers' payload_xxh3
    };
    std::map<std::pair<int, int>, Pending> pending;
    std::map<std::pair<int, int>, int> expected;  // messages to me per layer range
    // Control messages to the sources (replies, credits, final acks), kept until sent.
    std::list<TransferAck> ctl_out;
    std::list<Request> ctl_reqs;
    std::shared_ptr<SharedArenaViews> views;  // opt.arena_views, or this receiver's own
    std::unique_ptr<CheckWorker> checker;     // started by the first payload it takes
    // A worker thread checks zero-copy payloads only where it can run beside this thread.
    const bool offload_checks = opt.offload_check_bytes >= 0 && usable_cpus() > 1;

    Impl(Communicator& w, std::shared_ptr<const TransferPlan> p, uint64_t rid, int r, BlockPool& pl,
         TransferExecOptions o)
        : world(w), plan(std::move(p)), request_id(rid), dst_rank(r), pool(pl), opt(o) {
        mode = resolve_mode(*plan, opt.mode);
        staging = opt.staging_pool ? opt.staging_pool : StagingPool::create();
        schedule = side_schedule(*plan, opt, mode, false, dst_rank, pool);
        for (int i : schedule->receives[static_cast<size_t>(dst_rank)]) {
            ++expected[{plan->messages[i].layer_begin, plan->messages[i].layer_end}];
            const int s = plan->messages[i].src_rank;
            auto it = std::find_if(sources.begin(), sources.end(),
                                   [s](const Source& x) { return x.rank == s; });
            if (it == sources.end()) {
                sources.emplace_back();
                sources.back().rank = s;
                it = sources.end() - 1;
            }
            it->messages.push_back(i);
        }
        for (Source& src : sources)
            src.hello_req = world.irecv(writable_bytes_of(src.hello), src_world(src),
                                        transfer_tag(request_id, kHeaderKind));
    }

    void set_status(TransferStatus s, const std::string& why) {
        if (result.status == TransferStatus::kOk) {
            result.status = s;
            result.error = why;
        }
    }

    int src_world(const Source& s) const { return opt.src_world_base + s.rank; }

    void send_control(const Source& s, uint16_t kind, uint16_t flags, uint32_t count) {
        forget_sent_controls();
        TransferAck& a = ctl_out.emplace_back();
        a.kind = kind;
        a.flags = flags;
        a.status = static_cast<uint32_t>(result.status);
        a.count = count;
        a.request_id = request_id;
        ctl_reqs.push_back(
            world.isend(bytes_of(a), src_world(s), transfer_tag(request_id, kAckKind)));
    }

    // Drops the control messages that went out; true when none is pending.
    bool forget_sent_controls() {
        auto a = ctl_out.begin();
        for (auto r = ctl_reqs.begin(); r != ctl_reqs.end();) {
            if (r->test()) {
                r = ctl_reqs.erase(r);
                a = ctl_out.erase(a);
            } else {
                ++r;
                ++a;
            }
        }
        return ctl_reqs.empty();
    }

    // Whether this receiver reads the source's pool in place: it offered it, this side allows
    // it, its arena maps here and holds every block the plan names.
    bool accept_direct(Source& s) {
        const TransferHello& h = s.hello;
        if (opt.direct_read && opt.rma_window && (h.flags & TransferHello::kRmaWindow) != 0)
            return s.rma = accept_rma(s);
        if (!opt.direct_read || (h.flags & TransferHello::kShareable) == 0) return false;
        if (!views)
            views = opt.arena_views ? opt.arena_views : std::make_shared<SharedArenaViews>();
        SharedArenaId id;
        id.pid = h.pid;
        id.fd = h.fd;
        id.token[0] = h.token[0];
        id.token[1] = h.token[1];
        id.bytes = h.arena_bytes;
        s.view = views->get(id);
        if (!s.view) return false;  // another host, or no access: messages
        const PageGeometry g =
            rank_page_geometry(plan->src.layout, s.rank, plan->src.block_size, plan->src.order);
        if (h.num_blocks < 1 || static_cast<uint64_t>(h.num_blocks) >
                                    h.arena_bytes / static_cast<uint64_t>(g.block_bytes()))
            return false;
        for (int i : s.messages)
            for (const auto& p : plan->messages[i].pieces)
                if (p.src_block >= h.num_blocks) return false;
        s.arena = {s.view->data(), static_cast<int64_t>(s.view->size()), h.num_blocks};
        return true;
    }

    // RMA read (rma_read.h): every message of this source can be read through the window.
    bool accept_rma(Source& s) {
        const int64_t exposed = opt.rma_window->region_bytes(src_world(s));
        for (int i : s.messages)
            if (!rma_readable(*plan, plan->messages[i], s.hello.num_blocks, exposed).empty())
                return false;
        return true;
    }

    // RMA: whether to ask this source to pack its messages (rma_pack_helps for one of them, and
    // each fits its part of the source's pack area); sets s.pack_offsets.
    bool want_packed(Source& s) {
        const int64_t area = opt.rma_window->pack_bytes(src_world(s));
        if (area <= 0 || (s.hello.flags & TransferHello::kPackArea) == 0) return false;
        bool helps = false;
        for (int i : s.messages)
            if (rma_pack_helps(*plan, i, s.hello.num_blocks, mode, pool)) {
                helps = true;
                break;
            }
        // Credits count messages in order, which both sides must see in plan order.
        if (!helps || !std::is_sorted(s.messages.begin(), s.messages.end())) return false;
        s.pack_offsets = rma_pack_offsets(*plan, s.rank, dst_rank, area);
        if (s.pack_offsets.size() != s.messages.size()) {
            s.pack_offsets.clear();
            return false;
        }
        return true;
    }

    void checksum_failed(int message, int src) {
        set_status(TransferStatus::kChecksumMismatch,
                   detail::concat("destination rank ", dst_rank, ": message ", message,
                                  " from source rank ", src, " failed its checksum"));
    }

    bool step_source(Source& s) {
        const bool moved = take_headers(s);
        if (s.announced.empty()) return moved;
        read_announced(s);
        return true;
    }

    // RMA: reads every announced message of s at once (their gets in one pipeline where they go
    // straight into the pool), checks each, and credits the source once for them all.
    void read_announced(Source& s) {
        const auto tu = Clock::now();
        std::vector<RmaReadJob> jobs;
        for (const auto& a : s.announced)
            jobs.push_back({a.message, a.units,
                            s.pack_offsets.empty() ? int64_t{-1} : s.pack_offsets[a.position]});
        std::vector<uint64_t> got;
        if (result.status == TransferStatus::kOk)
            got = rma_read_messages(*opt.rma_window, src_world(s), s.hello.num_blocks, *plan, jobs,
                                    mode, pool);
        for (size_t k = 0; k < s.announced.size(); ++k) {
            const auto& a = s.announced[k];
            if (result.status != TransferStatus::kOk) break;
            if (got[k] != a.want) {
                checksum_failed(a.message, s.rank);
                break;
            }
            if (a.units) ++result.unit_checksum_messages;
            if (!s.pack_offsets.empty()) ++result.packed_messages;
        }
        result.pack_seconds += seconds_since(tu);
        for (const auto& a : s.announced) landed(a.message, /*direct=*/true);
        send_control(s, TransferAck::kCredit, 0,
                     static_cast<uint32_t>(s.announced.back().position + 1));
        s.announced.clear();
    }

    bool take_headers(Source& s) {
        bool moved = false;
        if (!s.hello_done) {
            if (s.next >= s.messages.size() || !s.hello_req.test()) return false;
            s.hello_done = true;
            moved = true;
            const std::string bad = check_hello(s.hello, request_id, s.rank, dst_rank);
            if (!bad.empty()) {
                set_status(TransferStatus::kBadHeader,
                           detail::concat("destination rank ", dst_rank, " from source rank ",
                                          s.rank, ": ", bad));
                s.next = s.messages.size();  // unknown framing: stop listening to it
                return moved;
            }
            s.reads_in_place = accept_direct(s);
            uint16_t reply = s.reads_in_place ? TransferAck::kDirectRead : 0;
            if (s.reads_in_place && s.rma && want_packed(s)) reply |= TransferAck::kPacked;
            send_control(s, TransferAck::kReply, reply, 0);
        }
        for (;;) {
            if (s.next >= s.messages.size()) return moved;
            if (!s.header_posted) {
                s.header_req =
                    world.irecv(std::as_writable_bytes(std::span<TransferHeader, 1>(&s.header, 1)),
                                src_world(s), transfer_tag(request_id, kHeaderKind));
                s.header_posted = true;
                moved = true;
                // A payload received straight into the pool needs no staging: post its receive
                // now, so that a sender that posts it before the header (zero copy on its side)
                // moves it while checksumming.
                const TransferMessage& msg = plan->messages[s.messages[s.next]];
                const int64_t off =
                    s.reads_in_place
                        ? -1
                        : schedule->messages[static_cast<size_t>(s.messages[s.next])].dst_offset;
                if (off >= 0) {
                    s.direct = std::span<std::byte>(pool.arena().data() + off,
                                                    static_cast<size_t>(msg.bytes));
                    s.payload_req =
                        world.irecv(s.direct, src_world(s), transfer_tag(request_id, kPayloadKind));
                    s.payload_posted = true;
                }
            }
            if (!s.have_header) {
                if (!s.header_req.test()) return moved;
                s.have_header = true;
                moved = true;
                const int idx = s.messages[s.next];
                const std::string bad = check_header(s.header, *plan, request_id, idx);
                if (!bad.empty()) {
                    set_status(TransferStatus::kBadHeader,
                               detail::concat("destination rank ", dst_rank, " from source rank ",
                                              s.rank, ": ", bad));
                    // Unknown framing from here on: stop listening to this source.
                    s.payload_req = Request();  // cancels a payload receive posted ahead
                    s.direct = {};
                    s.payload_posted = false;
                    s.next = s.messages.size();
                    return moved;
                }
                if (s.header.status != static_cast<uint32_t>(TransferStatus::kOk)) {
                    set_status(TransferStatus::kSourceAborted,
                               detail::concat("source rank ", s.rank, " aborted the request"));
                    s.payload_req = Request();  // no payload follows an aborted header
                    s.direct = {};
                    s.payload_posted = false;
                    s.have_header = false;
                    s.header_posted = false;
                    ++s.next;
                    continue;
                }
                const uint16_t want_mode = mode == TransferMode::kPreSend ? 0 : 1;
                if (s.header.mode != want_mode) {
                    set_status(
                        TransferStatus::kBadHeader,
                        detail::concat("destination rank ", dst_rank, " from source rank ", s.rank,
                                       ": the payload is in ",
                                       s.header.mode == 0 ? "pre-send" : "post-receive",
                                       " order, this side resolved ", transfer_mode_name(mode),
                                       " (both sides need the same transfer mode)"));
                    s.payload_req = Request();
                    s.direct = {};
                    s.payload_posted = false;
                    s.next = s.messages.size();
                    return moved;
                }
                const bool direct = (s.header.flags & TransferHeader::kDirect) != 0;
                const bool packed = (s.header.flags & TransferHeader::kPacked) != 0;
                if (direct != s.reads_in_place || packed != !s.pack_offsets.empty()) {
                    set_status(
                        TransferStatus::kBadHeader,
                        detail::concat(
                            "destination rank ", dst_rank, " from source rank ", s.rank, ": a ",
                            direct ? (packed ? "packed direct-read" : "direct-read") : "message",
                            " header where ",
                            s.reads_in_place
                                ? (s.pack_offsets.empty() ? "direct reads" : "packed direct reads")
                                : "messages",
                            " were agreed"));
                    s.payload_req = Request();
                    s.direct = {};
                    s.payload_posted = false;
                    s.next = s.messages.size();
                    return moved;
                }
                if (direct && s.rma) {  // read with the others that are here already
                    s.announced.push_back({idx, s.next, s.header.payload_xxh3,
                                           (s.header.flags & TransferHeader::kUnitChecksum) != 0});
                    s.have_header = false;
                    s.header_posted = false;
                    ++s.next;
                    continue;
                }
                if (direct) {
                    read_in_place(s, idx);
                    s.have_header = false;
                    s.header_posted = false;
                    ++s.next;
                    continue;
                }
            }
            const int idx = s.messages[s.next];
            const TransferMessage& msg = plan->messages[idx];
            if (!s.payload_posted) {  // staged (a zero-copy receive was posted with the header)
                if (staged > 0 && staged + msg.bytes > opt.staging_bytes) flush_pending();
                if (staged > 0 && staged + msg.bytes > opt.staging_bytes)
                    return moved;  // back-pressure
                s.payload = staging->acquire(static_cast<size_t>(msg.bytes));
                staged += msg.bytes;
                result.peak_staging = std::max(result.peak_staging, staged);
                s.payload_req = world.irecv(std::span<std::byte>(s.payload), src_world(s),
                                            transfer_tag(request_id, kPayloadKind));
                s.payload_posted = true;
                moved = true;
            }
            if (!s.payload_req.test()) return moved;
            const auto tu = Clock::now();
            if (!s.direct.empty()) {  // already in place: check it here or on the worker
                if (offload_checks && msg.bytes >= opt.offload_check_bytes) {
                    if (!checker) checker = std::make_unique<CheckWorker>();
                    checker->submit({s.direct, s.header.payload_xxh3, idx, false});
                } else {
                    if (xxh3_64(s.direct.data(), s.direct.size()) != s.header.payload_xxh3)
                        checksum_failed(idx, s.rank);
                    landed(idx);
                }
            } else if (result.status == TransferStatus::kOk) {
                const std::pair<int, int> key{msg.layer_begin, msg.layer_end};
                Pending& pd = pending[key];  // verified while it is unpacked
                pd.messages.push_back(idx);
                pd.payloads.push_back(std::move(s.payload));
                pd.sums.push_back(s.header.payload_xxh3);
                if (static_cast<int>(pd.messages.size()) == expected[key]) unpack_pending(key);
            } else {
                staged -= msg.bytes;  // discarded
            }
            result.pack_seconds += seconds_since(tu);
            s.payload = {};
            s.direct = {};
            s.payload_posted = false;
            s.have_header = false;
            s.header_posted = false;
            ++s.next;
            moved = true;
        }
    }

    // Direct read: copies message idx straight from the source's pool into mine, checking the
    // bytes read against the header's checksum, then credits the source.
    void read_in_place(Source& s, int idx) {
        const TransferMessage& msg = plan->messages[idx];
        const auto tu = Clock::now();
        const bool units = (s.header.flags & TransferHeader::kUnitChecksum) != 0;
        auto read = [&] {
            return units ? copy_direct_units(*plan, msg, s.arena, pool)
                         : copy_direct(*plan, msg, mode, s.arena, pool);
        };
        if (result.status == TransferStatus::kOk && read() != s.header.payload_xxh3)
            checksum_failed(idx, s.rank);
        if (units && result.status == TransferStatus::kOk) ++result.unit_checksum_messages;
        result.pack_seconds += seconds_since(tu);
        landed(idx, /*direct=*/true);
        send_control(s, TransferAck::kCredit, 0, static_cast<uint32_t>(s.next + 1));
    }

    // A message in place in the pool (received straight into it, or read directly) has been
    // checked.
    void landed(int idx, bool direct = false) {
        const TransferMessage& msg = plan->messages[idx];
        const std::pair<int, int> key{msg.layer_begin, msg.layer_end};
        if (result.status == TransferStatus::kOk) {
            result.bytes += msg.bytes;
            ++result.messages;
            ++(direct ? result.direct_messages : result.zero_copy_messages);
        }
        --expected[key];
        auto it = pending.find(key);
        if (it != pending.end() && static_cast<int>(it->second.messages.size()) == expected[key])
            unpack_pending(key);
    }

    // Takes the worker's finished checks; true when there were some.
    bool take_checked() {
        if (!checker) return false;
        const auto done = checker->take_done();
        for (const auto& j : done) {
            if (!j.ok) checksum_failed(j.message, plan->messages[j.message].src_rank);
            landed(j.message);
        }
        return !done.empty();
    }

    void unpack_pending(const std::pair<int, int>& key) {
        auto it = pending.find(key);
        if (it == pending.end()) return;
        Pending& pd = it->second;
        std::vector<const TransferMessage*> msgs;
        std::vector<std::span<const std::byte>> ins;
        for (size_t k = 0; k < pd.messages.size(); ++k) {
            msgs.push_back(&plan->messages[pd.messages[k]]);
            ins.emplace_back(pd.payloads[k]);
        }
        const auto tu = Clock::now();
        if (result.status == TransferStatus::kOk) {
            // The checksums are computed while unpacking (one pass over the payloads). A corrupt
            // payload has then been written into this request's blocks, which it fails (the
            // caller frees them), as with a payload received straight into the pool.
            std::vector<uint64_t> sums(msgs.size());
            unpack_messages(*plan, msgs, mode, ins, pool, sums);
            for (size_t k = 0; k < msgs.size(); ++k)
                if (sums[k] != pd.sums[k]) checksum_failed(pd.messages[k], msgs[k]->src_rank);
        }
        result.pack_seconds += seconds_since(tu);
        for (const auto* m : msgs) {
            staged -= m->bytes;
            if (result.status == TransferStatus::kOk) {
                result.bytes += m->bytes;
                ++result.messages;
            }
        }
        expected[key] -= static_cast<int>(msgs.size());
        pending.erase(it);
    }

    // Unpacks what is waiting now (staging is full and more must come in first).
    void flush_pending() {
        while (!pending.empty()) unpack_pending(pending.begin()->first);
    }

    void send_acks() {
        flush_pending();
        for (const Source& s : sources) send_control(s, TransferAck::kDone, 0, 0);
        acks_sent = true;
    }

    bool step() {
        bool moved = false;
        for (auto& s : sources) moved |= step_source(s);
        moved |= take_checked();
        const bool all_in =
            std::all_of(sources.begin(), sources.end(),
                        [](const Source& s) { return s.next >= s.messages.size(); }) &&
            (!checker || checker->outstanding() == 0);
        if (all_in && !acks_sent) {
            send_acks();
            moved = true;
        }
        return moved;
    }

    bool finished() { return acks_sent && forget_sent_controls(); }

    void time_out() {
        int missing = 0;
        for (const auto& s : sources) missing += static_cast<int>(s.messages.size() - s.next);
        give_up(TransferStatus::kTimeout,
                detail::concat("destination rank ", dst_rank, ": no progress for ", opt.timeout_s,
                               " s, ", missing, " messages missing"));
    }

    // Ends the request here: cancels what never came, checks what landed, and tells the sources.
    void give_up(TransferStatus status, const std::string& why) {
        set_status(status, why);
        for (auto& s : sources) {  // cancel what never came
            s.hello_req = Request();
            s.header_req = Request();
            s.payload_req = Request();
        }
        if (checker) {  // what landed is checked before the caller may free its blocks
            checker->drain();
            take_checked();
        }
        // Tell the sources (a live but slow one stops; a dead one never matches: cancelled below).
        if (!acks_sent) send_acks();
        ctl_reqs.clear();  // cancels what a dead source never matches
        ctl_out.clear();
    }
};

TransferReceiver::TransferReceiver(Communicator& world, std::shared_ptr<const TransferPlan> plan,
                                   uint64_t request_id, int dst_rank, BlockPool& pool,
                                   TransferExecOptions options)
    : impl_(std::make_unique<Impl>(world, std::move(plan), request_id, dst_rank, pool, options)) {
    KVSHARD_CHECK(dst_rank >= 0 && dst_rank < impl_->plan->dst.layout.world_size(),
                  "destination rank out of range");
    const PageGeometry want = rank_page_geometry(
        impl_->plan->dst.layout, dst_rank, impl_->plan->dst.block_size, impl_->plan->dst.order);
    require(pool.geometry() == want, "the pool given to the receiver of destination rank ",
            dst_rank, " does not have that rank's page geometry");
    progress();
}

TransferReceiver::~TransferReceiver() = default;

bool TransferReceiver::progress() {
    if (done_) return true;
    Impl& r = *impl_;
    try {
        if (r.step()) r.last_progress = Clock::now();
    } catch (const std::exception& e) {
        // The request fails, not the caller (a copy that threw, a communicator call that failed).
        try {
            r.give_up(TransferStatus::kLocalError,
                      detail::concat("destination rank ", r.dst_rank, ": ", e.what()));
        } catch (const std::exception&) {  // telling the sources failed too: they time out
        }
        done_ = true;
        r.result.seconds = seconds_since(r.t0);
        return true;
    }
    if (r.finished()) {
        done_ = true;
    } else if (seconds_since(r.last_progress) > r.opt.timeout_s) {
        r.time_out();
        done_ = true;
    }
    if (done_) r.result.seconds = seconds_since(r.t0);
    return done_;
}

TransferResult TransferReceiver::finish() {
    while (!progress()) idle(idle_seconds());
    return impl_->result;
}

double TransferReceiver::idle_seconds() const { return seconds_since(impl_->last_progress); }

void progress_until_done(std::span<TransferSender* const> senders,
                         std::span<TransferReceiver* const> receivers) {
    for (;;) {
        bool all = true;
        double least_idle = 1e9;
        int sleep_us = 1 << 30;  // the least any sender asks for; 0 when a receiver polls too
        for (auto* s : senders) {
            all &= s->progress();
            if (s->done()) continue;
            least_idle = std::min(least_idle, s->idle_seconds());
            sleep_us = std::min(sleep_us, s->idle_sleep_us());
        }
        for (auto* r : receivers) {
            all &= r->progress();
            if (r->done()) continue;
            least_idle = std::min(least_idle, r->idle_seconds());
            sleep_us = 0;
        }
        if (all) return;
        idle(least_idle, sleep_us);
    }
}

}  // namespace kvshard
