// Threads backend (docs/comm.md, "Threads backend").
//
// One World per run_threads call holds the single mutex and condition variable of the run; every
// communicator (the world and each split sub-group) is a Group of world ranks with its own
// mailboxes and collective slots. Point to point is a rendezvous: the second of (send, recv) to
// arrive takes the first out of the destination's mailbox and copies directly from the sender's
// buffer into the receiver's, outside the lock. Collectives publish a descriptor per rank, meet
// at a barrier, read each other's buffers, and meet again before anyone may reuse them.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <list>
#include <mutex>
#include <numeric>
#include <thread>

#include "kvshard/comm/communicator.h"
#include "kvshard/comm/threads.h"

namespace kvshard {
namespace {

struct Group;

// What a blocked rank waits for; `ready` is evaluated under the world mutex.
struct Waiter {
    std::function<bool()> ready;
    const char* op = "";
    const Group* group = nullptr;
    int peer = -1;  // group rank of the peer, -1 for collectives
    int tag = -1;
};

constexpr int kSpinRounds = 64;  // yields before a waiter sleeps on the condition variable

struct World {
    explicit World(int n) : size(n), waiting(n, nullptr), exited(n, 0) {}

    std::mutex mu;
    std::condition_variable cv;
    std::condition_variable exit_cv;  // run_threads waits here: a rank exited or the run aborted
    std::atomic<std::uint64_t> epoch{0};  // bumped by every notify(): lets a waiter spin briefly
    const int size;
    bool aborted = false;
    bool timed_out = false;  // the abort came from a wait longer than comm_timeout()
    std::string abort_reason;
    std::vector<const Waiter*> waiting;  // per world rank; set while blocked
    std::vector<char> exited;            // per world rank; 1 once its function returned or threw

    // Wakes every waiter (spinning or sleeping). Caller holds the lock.
    void notify() {
        epoch.fetch_add(1, std::memory_order_release);
        cv.notify_all();
    }

    void abort_locked(const std::string& reason) {
        if (!aborted) {
            aborted = true;
            abort_reason = reason;
        }
        notify();
        exit_cv.notify_all();
    }

    // True when no running rank can make progress: each one is blocked on a condition that is
    // false. Progress in this backend is only ever made by running (unblocked) ranks.
    bool deadlocked_locked() const {
        bool any_running = false;
        for (int r = 0; r < size; ++r) {
            if (exited[r]) continue;
            any_running = true;
            if (waiting[r] == nullptr || waiting[r]->ready()) return false;
        }
        return any_running;
    }

    std::string describe_deadlock_locked() const;
    std::string describe_timeout_locked(int world_rank, const Waiter& w, double waited) const;

    [[noreturn]] void throw_aborted() const {
        if (timed_out) throw CommTimeout(abort_reason);
        throw CommAborted(abort_reason);
    }

    // Blocks rank `world_rank` until w.ready(); throws CommAborted if the run is (or gets) aborted
    // or if this wait completes a deadlock.
    void wait_until(std::unique_lock<std::mutex>& lk, int world_rank, const Waiter& w) {
        int spins = kSpinRounds;
        const double limit = comm_timeout();
        const auto start = std::chrono::steady_clock::now();
        const auto deadline =
            start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(limit > 0 ? limit : 1e9));
        while (!w.ready()) {
            if (aborted) throw_aborted();
            if (spins > 0) {
                // A partner usually arrives within microseconds: yield a few times before paying
                // for a sleep and a wake-up. Any notify() ends the spin; then re-check under lock.
                const std::uint64_t e = epoch.load(std::memory_order_acquire);
                lk.unlock();
                while (spins > 0 && epoch.load(std::memory_order_acquire) == e) {
                    --spins;
                    std::this_thread::yield();
                }
                lk.lock();
                continue;
            }
            waiting[world_rank] = &w;
            if (deadlocked_locked()) {
                abort_locked(describe_deadlock_locked());
                waiting[world_rank] = nullptr;
                throw CommAborted(abort_reason);
            }
            const bool expired = cv.wait_until(lk, deadline) == std::cv_status::timeout;
            if (expired && !w.ready() && !aborted) {
                const double waited =
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                const std::string why = describe_timeout_locked(world_rank, w, waited);
                waiting[world_rank] = nullptr;
                timed_out = true;
                abort_locked(why);
                throw CommTimeout(why);
            }
            waiting[world_rank] = nullptr;
        }
    }

    // After a rank's function returned: the others may now be waiting for it forever.
    void rank_exited_locked(int world_rank) {
        exited[world_rank] = 1;
        if (!aborted && deadlocked_locked()) abort_locked(describe_deadlock_locked());
        notify();
        exit_cv.notify_all();
    }
};

// One posted send or receive. `source` is the sender's group rank, `dest` the receiver's; the
// op sits in the mailbox of `dest` until matched.
struct Op {
    enum class State { kPosted, kCopying, kDone };
    bool is_send = false;
    int source = 0;
    int dest = 0;
    int tag = 0;
    const std::byte* src = nullptr;              // send: the message
    std::byte* dst = nullptr;                    // recv: the buffer
    std::size_t bytes = 0;                       // send: message size; recv: buffer size
    std::vector<std::byte>* any_size = nullptr;  // recv_any_size: resized to the message
    State state = State::kPosted;
    std::string error;  // set on a failed match (size mismatch) or cancellation
};
using OpPtr = std::shared_ptr<Op>;

struct Mailbox {
    std::list<OpPtr> sends;  // sends to this rank not yet matched, in posting order
    std::list<OpPtr> recvs;  // receives of this rank not yet matched, in posting order
};

struct Group {
    Group(std::shared_ptr<World> w, std::vector<int> m)
        : world(std::move(w)),
          members(std::move(m)),
          boxes(members.size()),
          slots(members.size(), nullptr) {}
    int size() const { return static_cast<int>(members.size()); }

    std::shared_ptr<World> world;
    std::vector<int> members;  // world rank of each group rank
    std::vector<Mailbox> boxes;
    std::vector<const void*> slots;  // collective descriptors, valid between the two barriers
    int arrived = 0;
    std::uint64_t generation = 0;
};

std::string World::describe_deadlock_locked() const {
    std::string s = "deadlock: every running rank is blocked:";
    for (int r = 0; r < size; ++r) {
        s += detail::concat(" rank ", r, ": ");
        if (exited[r]) {
            s += "returned;";
            continue;
        }
        const Waiter* w = waiting[r];
        s += w->op;
        if (w->peer >= 0) {
            const int peer_world = w->group->members[w->peer];
            s += detail::concat(w->op[0] == 's' || w->op[0] == 'i' ? " to" : " from", " rank ",
                                w->peer);
            if (w->group->size() != size) s += detail::concat(" (world rank ", peer_world, ")");
            s += detail::concat(" tag ", w->tag);
        }
        if (w->group->size() != size) s += detail::concat(" in a group of ", w->group->size());
        s += ";";
    }
    s.pop_back();
    return s;
}

std::string World::describe_timeout_locked(int world_rank, const Waiter& w, double waited) const {
    const Group& g = *w.group;
    std::vector<int> late;  // world ranks
    if (w.peer >= 0) {
        late.push_back(g.members[w.peer]);
    } else {  // a collective of g: the members not blocked in a collective of g
        for (int m : g.members) {
            const Waiter* o = waiting[m];
            if (m != world_rank && !(o && o->group == &g && o->peer < 0)) late.push_back(m);
        }
    }
    std::string s =
        detail::concat("timeout: rank ", world_rank, " waited ", waited, " s in ", w.op);
    if (w.peer >= 0) s += detail::concat(w.op[0] == 's' ? " to" : " from", " rank ", late[0]);
    s += detail::concat(" (comm timeout ", comm_timeout(), " s);");
    for (int m : late) {
        s += detail::concat(" rank ", m, " ");
        if (exited[m])
            s += "had returned;";
        else if (waiting[m])
            s += detail::concat("waits in ", waiting[m]->op, ";");
        else
            s += "is not communicating (stopped, stuck or far behind);";
    }
    s.pop_back();
    return s;
}

std::string message_of(const std::exception_ptr& e) {
    try {
        std::rethrow_exception(e);
    } catch (const std::exception& x) {
        return x.what();
    } catch (...) {
        return "unknown exception";
    }
}

// Copies a matched pair; runs outside the lock. Both ops are kCopying, so nobody else touches them.
void copy_matched(Op& send, Op& recv) {
    if (recv.any_size) {
        recv.any_size->resize(send.bytes);
        if (send.bytes) std::memcpy(recv.any_size->data(), send.src, send.bytes);
    } else if (recv.bytes != send.bytes) {
        recv.error = detail::concat("recv of ", recv.bytes, " bytes from rank ", recv.source,
                                    " tag ", recv.tag, " matched a message of ", send.bytes,
                                    " bytes: receive buffers must have the exact message size "
                                    "(use recv_any_size for unknown sizes)");
        // As with MPI, only the receiver sees the error; the send completes.
    } else if (send.bytes) {
        std::memcpy(recv.dst, send.src, send.bytes);
    }
}

class ThreadCommunicator;

class ThreadRequest final : public detail::RequestImpl {
  public:
    ThreadRequest(std::shared_ptr<Group> g, OpPtr op, int world_rank)
        : g_(std::move(g)), op_(std::move(op)), world_rank_(world_rank) {}
    ~ThreadRequest() override;
    bool test() override;
    void wait() override;

  private:
    std::shared_ptr<Group> g_;
    OpPtr op_;
    int world_rank_;
};

// Removes a posted op from its mailbox, or waits for a copy in flight to finish.
void cancel_locked(std::unique_lock<std::mutex>& lk, Group& g, Op& op) {
    if (op.state == Op::State::kPosted) {
        auto& q = op.is_send ? g.boxes[op.dest].sends : g.boxes[op.dest].recvs;
        q.remove_if([&](const OpPtr& p) { return p.get() == &op; });
        op.state = Op::State::kDone;
        op.error = "cancelled";
    } else if (op.state == Op::State::kCopying) {
        g.world->cv.wait(lk, [&] { return op.state == Op::State::kDone; });
    }
}

// Posts an op; if its partner is already there, performs the copy and completes both.
OpPtr post(Group& g, OpPtr op) {
    World& w = *g.world;
    std::unique_lock lk(w.mu);
    if (w.aborted) w.throw_aborted();
    Mailbox& box = g.boxes[op->dest];
    auto& partners = op->is_send ? box.recvs : box.sends;
    auto it = std::find_if(partners.begin(), partners.end(), [&](const OpPtr& p) {
        return p->source == op->source && p->tag == op->tag;
    });
    if (it == partners.end()) {
        (op->is_send ? box.sends : box.recvs).push_back(op);
        return op;
    }
    OpPtr partner = *it;
    partners.erase(it);
    op->state = partner->state = Op::State::kCopying;
    lk.unlock();
    if (op->is_send)
        copy_matched(*op, *partner);
    else
        copy_matched(*partner, *op);
    lk.lock();
    op->state = partner->state = Op::State::kDone;
    w.notify();
    return op;
}

void wait_op(Group& g, Op& op, int world_rank) {
    World& w = *g.world;
    std::unique_lock lk(w.mu);
    Waiter waiter{[&] { return op.state == Op::State::kDone; }, op.is_send ? "send" : "recv", &g,
                  op.is_send ? op.dest : op.source, op.tag};
    try {
        w.wait_until(lk, world_rank, waiter);
    } catch (...) {
        cancel_locked(lk, g, op);
        throw;
    }
    if (!op.error.empty()) throw Error(op.error);
}

ThreadRequest::~ThreadRequest() {
    std::unique_lock lk(g_->world->mu);
    if (op_->state != Op::State::kDone) cancel_locked(lk, *g_, *op_);
}

bool ThreadRequest::test() {
    World& w = *g_->world;
    std::unique_lock lk(w.mu);
    if (op_->state == Op::State::kDone) {
        if (!op_->error.empty()) throw Error(op_->error);
        return true;
    }
    if (w.aborted) {
        cancel_locked(lk, *g_, *op_);
        w.throw_aborted();
    }
    return false;
}

void ThreadRequest::wait() { wait_op(*g_, *op_, world_rank_); }

// A window on threads: every rank's region lies in this process, so a read is a memcpy, done when
// posted (the request is complete).
class ThreadWindow final : public Window {
  public:
    struct Region {
        std::byte* data = nullptr;
        int64_t bytes = 0;
    };
    explicit ThreadWindow(std::vector<Region> regions) : regions_(std::move(regions)) {}
    int64_t region_bytes(int target) const override { return region(target).bytes; }

  protected:
    Request do_get_many(std::span<std::byte* const> outs, std::span<const int64_t> offsets,
                        std::span<const int64_t> sizes, int target) override {
        const Region& r = region(target);
        for (size_t i = 0; i < outs.size(); ++i)
            if (sizes[i] > 0)
                std::memcpy(outs[i], r.data + offsets[i], static_cast<size_t>(sizes[i]));
        return Request();
    }

  private:
    const Region& region(int target) const {
        require(target >= 0 && target < static_cast<int>(regions_.size()), "window target ", target,
                " is not a rank of its ", regions_.size(), "-rank communicator");
        return regions_[static_cast<size_t>(target)];
    }
    std::vector<Region> regions_;
};

class ThreadCommunicator final : public Communicator {
  public:
    ThreadCommunicator(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}

    int rank() const override { return rank_; }
    int size() const override { return g_->size(); }
    Backend backend() const override { return Backend::kThreads; }

  protected:
    void do_send(std::span<const std::byte> data, int dest, int tag) override {
        auto op = post(*g_, make_send(data, dest, tag));
        wait_op(*g_, *op, world_rank());
    }
    void do_recv(std::span<std::byte> data, int source, int tag) override {
        auto op = post(*g_, make_recv(data, source, tag));
        wait_op(*g_, *op, world_rank());
    }
    std::vector<std::byte> do_recv_any_size(int source, int tag) override {
        std::vector<std::byte> out;
        auto op = make_recv({}, source, tag);
        op->any_size = &out;
        op = post(*g_, std::move(op));
        wait_op(*g_, *op, world_rank());
        return out;
    }
    Request do_isend(std::span<const std::byte> data, int dest, int tag) override {
        auto op = post(*g_, make_send(data, dest, tag));
        return Request(std::make_unique<ThreadRequest>(g_, std::move(op), world_rank()));
    }
    Request do_irecv(std::span<std::byte> data, int source, int tag) override {
        auto op = post(*g_, make_recv(data, source, tag));
        return Request(std::make_unique<ThreadRequest>(g_, std::move(op), world_rank()));
    }

    void do_barrier() override {
        std::unique_lock lk(g_->world->mu);
        barrier_locked(lk, "barrier");
    }

    void do_broadcast(std::span<std::byte> data, int root) override {
        exchange("broadcast", data, [&](std::span<const void* const> slots) {
            const auto& src = *static_cast<const std::span<std::byte>*>(slots[root]);
            require(src.size() == data.size(), "broadcast: rank ", rank_, " passed ", data.size(),
                    " bytes but root ", root, " passed ", src.size());
            if (rank_ != root && !data.empty()) std::memcpy(data.data(), src.data(), data.size());
        });
    }

    void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv) override {
        exchange("all_gather", send, [&](std::span<const void* const> slots) {
            for (int p = 0; p < size(); ++p) {
                const auto& src = *static_cast<const std::span<const std::byte>*>(slots[p]);
                require(src.size() == send.size(), "all_gather: rank ", p, " sends ", src.size(),
                        " bytes but rank ", rank_, " sends ", send.size(),
                        " (use all_gather_v for unequal sizes)");
                if (!src.empty())
                    std::memcpy(recv.data() + p * send.size(), src.data(), src.size());
            }
        });
    }

    void do_all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                         std::span<const std::size_t> recv_counts) override {
        exchange("all_gather_v", send, [&](std::span<const void* const> slots) {
            std::size_t off = 0;
            for (int p = 0; p < size(); ++p) {
                const auto& src = *static_cast<const std::span<const std::byte>*>(slots[p]);
                require(src.size() == recv_counts[p], "all_gather_v: rank ", rank_,
                        " expects recv_counts[", p, "] = ", recv_counts[p], " bytes but rank ", p,
                        " sends ", src.size());
                if (!src.empty()) std::memcpy(recv.data() + off, src.data(), src.size());
                off += src.size();
            }
        });
    }

    struct AllToAllDesc {
        const std::byte* send;
        std::vector<std::size_t> offsets;  // offsets[p]..offsets[p+1]: bytes for peer p
    };

    void do_all_to_all_v(std::span<const std::byte> send, std::span<const std::size_t> send_counts,
                         std::span<std::byte> recv,
                         std::span<const std::size_t> recv_counts) override {
        AllToAllDesc mine{send.data(), std::vector<std::size_t>(send_counts.size() + 1, 0)};
        std::partial_sum(send_counts.begin(), send_counts.end(), mine.offsets.begin() + 1);
        exchange("all_to_all_v", mine, [&](std::span<const void* const> slots) {
            std::size_t off = 0;
            for (int p = 0; p < size(); ++p) {
                const auto& d = *static_cast<const AllToAllDesc*>(slots[p]);
                const std::size_t begin = d.offsets[rank_], n = d.offsets[rank_ + 1] - begin;
                require(n == recv_counts[p], "all_to_all_v: rank ", rank_, " expects recv_counts[",
                        p, "] = ", recv_counts[p], " bytes but rank ", p, " sends it ", n);
                if (n) std::memcpy(recv.data() + off, d.send + begin, n);
                off += n;
            }
        });
    }

    // Rank r reduces chunk r of every rank's buffer (in rank order, the same arithmetic as the
    // generic algorithm) and writes the result into chunk r of every rank's buffer. Ranks touch
    // disjoint chunks, so no scratch buffers and a single pass over the data.
    void do_all_reduce(std::span<std::byte> data, detail::ElemType type, ReduceOp op) override {
        const std::size_t esz = detail::elem_size(type);
        const std::size_t count = data.size() / esz;
        if (size() == 1) return;
        exchange("all_reduce", data, [&](std::span<const void* const> slots) {
            std::vector<std::byte*> bufs(size());
            for (int p = 0; p < size(); ++p) {
                const auto& s = *static_cast<const std::span<std::byte>*>(slots[p]);
                require(s.size() == data.size(), "all_reduce: rank ", p, " passed ", s.size() / esz,
                        " elements but rank ", rank_, " passed ", count);
                bufs[p] = s.data();
            }
            auto [begin, end] = detail::chunk_range(count, size(), rank_);
            constexpr std::size_t kTileBytes = 16 * 1024;
            const std::size_t tile = kTileBytes / esz;
            alignas(64) std::byte acc[kTileBytes];
            for (std::size_t i = begin; i < end; i += tile) {
                const std::size_t n = std::min(tile, end - i), nbytes = n * esz, off = i * esz;
                std::memcpy(acc, bufs[0] + off, nbytes);
                for (int p = 1; p < size(); ++p)
                    detail::reduce_into(acc, bufs[p] + off, n, type, op);
                for (int p = 0; p < size(); ++p) std::memcpy(bufs[p] + off, acc, nbytes);
            }
        });
    }

    struct SplitDesc {
        int color;
        int key;
        std::shared_ptr<Group> created;  // set by the leader of each color between barriers
    };

    std::unique_ptr<Window> do_create_window(std::span<std::byte> region) override {
        return std::make_unique<ThreadWindow>(all_gather_value(
            ThreadWindow::Region{region.data(), static_cast<int64_t>(region.size())}));
    }

    std::unique_ptr<Communicator> do_split(int color, int key) override {
        World& w = *g_->world;
        SplitDesc mine{color, key, nullptr};
        std::unique_lock lk(w.mu);
        g_->slots[rank_] = &mine;
        barrier_locked(lk, "split");
        // Members of my color, ordered by (key, old rank); the first one creates the group.
        std::vector<int> members;
        for (int p = 0; p < size(); ++p)
            if (static_cast<const SplitDesc*>(g_->slots[p])->color == color) members.push_back(p);
        std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
            return static_cast<const SplitDesc*>(g_->slots[a])->key <
                   static_cast<const SplitDesc*>(g_->slots[b])->key;
        });
        const bool defined = color != kUndefinedColor;
        if (defined && members.front() == rank_) {
            std::vector<int> world_ranks;
            for (int p : members) world_ranks.push_back(g_->members[p]);
            mine.created = std::make_shared<Group>(g_->world, std::move(world_ranks));
        }
        barrier_locked(lk, "split");
        std::shared_ptr<Group> group;
        if (defined) group = static_cast<const SplitDesc*>(g_->slots[members.front()])->created;
        barrier_locked(lk, "split");
        if (!defined) return nullptr;
        const int new_rank =
            static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
        return std::make_unique<ThreadCommunicator>(std::move(group), new_rank);
    }

  private:
    int world_rank() const { return g_->members[rank_]; }

    OpPtr make_send(std::span<const std::byte> data, int dest, int tag) const {
        auto op = std::make_shared<Op>();
        op->is_send = true;
        op->source = rank_;
        op->dest = dest;
        op->tag = tag;
        op->src = data.data();
        op->bytes = data.size();
        return op;
    }
    OpPtr make_recv(std::span<std::byte> data, int source, int tag) const {
        auto op = std::make_shared<Op>();
        op->source = source;
        op->dest = rank_;
        op->tag = tag;
        op->dst = data.data();
        op->bytes = data.size();
        return op;
    }

    void barrier_locked(std::unique_lock<std::mutex>& lk, const char* what) {
        Group& g = *g_;
        World& w = *g.world;
        if (w.aborted) w.throw_aborted();
        const std::uint64_t gen = g.generation;
        if (++g.arrived == g.size()) {
            g.arrived = 0;
            ++g.generation;
            w.notify();
            return;
        }
        Waiter waiter{[&] { return g.generation != gen; }, what, &g, -1, -1};
        w.wait_until(lk, world_rank(), waiter);
    }

    // Publishes `desc`, meets everyone, runs `work` (which may read every rank's descriptor and the
    // buffers they point to), meets everyone again. A failure in `work` is thrown after the second
    // barrier so that the other ranks are not left waiting.
    template <typename Desc, typename Work>
    void exchange(const char* what, const Desc& desc, Work&& work) {
        World& w = *g_->world;
        {
            std::unique_lock lk(w.mu);
            g_->slots[rank_] = &desc;
            barrier_locked(lk, what);
        }
        std::exception_ptr failure;
        try {
            work(std::span<const void* const>(g_->slots));
        } catch (...) {
            failure = std::current_exception();
        }
        {
            std::unique_lock lk(w.mu);
            barrier_locked(lk, what);
        }
        if (failure) std::rethrow_exception(failure);
    }

    std::shared_ptr<Group> g_;
    int rank_;
};

}  // namespace

void run_threads(int world, const std::function<void(Communicator&)>& fn) {
    require(world >= 1, "run_threads: world size ", world, " is invalid: expected >= 1");
    // What a rank thread touches lives here, co-owned by each thread: a rank that never returns
    // after a timeout is left behind (detached) without pointing into this frame.
    struct RunState {
        std::shared_ptr<World> w;
        std::shared_ptr<Group> root;
        std::function<void(Communicator&)> fn;
        std::exception_ptr first;  // guarded by w->mu
    };
    auto st = std::make_shared<RunState>();
    st->w = std::make_shared<World>(world);
    std::vector<int> all(world);
    std::iota(all.begin(), all.end(), 0);
    st->root = std::make_shared<Group>(st->w, std::move(all));
    st->fn = fn;
    World& w = *st->w;

    auto body = [st](int r) {
        World& w = *st->w;
        try {
            ThreadCommunicator comm(st->root, r);
            st->fn(comm);
            std::unique_lock lk(w.mu);
            w.rank_exited_locked(r);
        } catch (...) {
            auto e = std::current_exception();
            std::unique_lock lk(w.mu);
            if (!st->first) st->first = e;
            w.abort_locked(detail::concat("run aborted: rank ", r, " failed: ", message_of(e)));
            w.rank_exited_locked(r);
        }
    };

    std::vector<std::thread> threads;
    threads.reserve(world);
    try {
        for (int r = 0; r < world; ++r) threads.emplace_back(body, r);
    } catch (...) {
        {
            std::unique_lock lk(w.mu);
            // Ranks that were never started count as exited, so the others cannot wait for them.
            for (int r = static_cast<int>(threads.size()); r < world; ++r) w.exited[r] = 1;
            w.abort_locked(detail::concat("run aborted: could not start thread ", threads.size(),
                                          " of ", world));
        }
        for (auto& t : threads) t.join();
        throw;
    }
    // Every rank returns, or after a timeout the ones that do not (a rank stuck outside any
    // communication) are given the timeout again as grace, then left behind.
    {
        std::unique_lock lk(w.mu);
        auto all_exited = [&] {
            return std::all_of(w.exited.begin(), w.exited.end(), [](char e) { return e != 0; });
        };
        while (!all_exited()) {
            if (w.timed_out) {
                const double grace = std::clamp(comm_timeout(), 0.1, 5.0);
                w.exit_cv.wait_for(lk, std::chrono::duration<double>(grace), all_exited);
                break;
            }
            w.exit_cv.wait(lk);
        }
        if (!all_exited()) {
            std::string stuck;
            for (int r = 0; r < world; ++r)
                if (!w.exited[r]) stuck += detail::concat(stuck.empty() ? "" : ", ", r);
            const std::string why = detail::concat(w.abort_reason, "; rank(s) ", stuck,
                                                   " did not return and were left behind");
            lk.unlock();
            for (int r = 0; r < world; ++r) {
                if (w.exited[r])
                    threads[r].join();
                else
                    threads[r].detach();
            }
            throw CommTimeout(why);
        }
    }
    for (auto& t : threads) t.join();
    if (st->first) std::rethrow_exception(st->first);
}

}  // namespace kvshard
