// MPI backend (docs/comm.md, "MPI backend"): Communicator over an MPI_Comm.
//
// Point to point maps to MPI_Isend/Irecv on MPI_BYTE; a message over kMaxChunk bytes is
// sent as consecutive chunks with the same tag (MPI keeps them in order), because MPI counts are
// ints. Collectives are point-to-point exchanges between every pair on a duplicate communicator,
// polled under the timeout (below). all_reduce keeps the
// base class's deterministic algorithm (rank-order sums), never MPI_Allreduce, so results are
// bit-identical to the threads backend. Errors are returned (MPI_ERRORS_RETURN) and thrown as
// kvshard::Error.
//
// Timeouts (docs/comm.md, "Timeouts"): every blocking operation is posted non-blocking (MPI_Isend,
// MPI_Irecv) and polled by a Watchdog. One that waits longer than
// comm_timeout() raises an alarm: the rank sends its reason to every other rank on a control
// communicator (a duplicate of the communicator, so it never mixes with user traffic) and collects
// answers for a grace period. A rank that receives an alarm while polling answers it and raises its
// own, so every live rank learns of the fault within one poll. After the grace period every
// alarmed rank throws CommTimeout naming the ranks that did not answer (stopped, dead or not
// communicating); launch() prints it and ends the job.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "kvshard/comm/communicator.h"
#include "kvshard/comm/mpi.h"

namespace kvshard {
namespace {

constexpr std::size_t kMaxChunk = std::size_t{1} << 30;  // bytes per MPI message

bool g_we_initialized = false;

bool mpi_is_initialized() {
    int flag = 0;
    MPI_Initialized(&flag);
    return flag != 0;
}

bool mpi_is_finalized() {
    int flag = 0;
    MPI_Finalized(&flag);
    return flag != 0;
}

std::string mpi_error_string(int code) {
    char buf[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return detail::concat("MPI error ", code);
    return std::string(buf, static_cast<std::size_t>(len));
}

void check_mpi(int rc, const char* what) {
    if (rc != MPI_SUCCESS)
        throw Error(detail::concat("MPI ", what, " failed: ", mpi_error_string(rc)));
}

int to_int_count(std::size_t bytes, const char* what) {
    require(bytes <= static_cast<std::size_t>(INT_MAX), what, ": ", bytes,
            " bytes exceed the MPI backend's limit of ", INT_MAX,
            " bytes per collective buffer; split the operation");
    return static_cast<int>(bytes);
}

// Chunk c of a message of `bytes`: [c*kMaxChunk, min(bytes, (c+1)*kMaxChunk)). An empty message
// is one empty chunk.
std::size_t num_chunks(std::size_t bytes) {
    return bytes == 0 ? 1 : (bytes + kMaxChunk - 1) / kMaxChunk;
}
int chunk_len(std::size_t bytes, std::size_t c) {
    return static_cast<int>(std::min(kMaxChunk, bytes - c * kMaxChunk));
}

using SteadyClock = std::chrono::steady_clock;

double seconds_since(SteadyClock::time_point t) {
    return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

// The liveness protocol of this process (see the top of this file): one control communicator over
// all processes of the job, serviced by every wait of every communicator and by keepalive().
class ControlChannel {
  public:
    ControlChannel() {
        check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &ctl_), "Comm_dup");
        check_mpi(MPI_Comm_set_errhandler(ctl_, MPI_ERRORS_RETURN), "Comm_set_errhandler");
        MPI_Comm_rank(ctl_, &rank_);
        MPI_Comm_size(ctl_, &size_);
        answered_.assign(static_cast<std::size_t>(size_), 0);
    }
    ~ControlChannel() {
        if (mpi_is_finalized()) return;
        for (auto& r : sends_) MPI_Request_free(&r);
        MPI_Comm_free(&ctl_);
    }
    ControlChannel(const ControlChannel&) = delete;
    ControlChannel& operator=(const ControlChannel&) = delete;

    int rank() const { return rank_; }

    // Answers probes, records answers; throws CommTimeout when another rank reported a failure.
    void poll() {
        for (;;) {
            int flag = 0;
            MPI_Status st;
            if (MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, ctl_, &flag, &st) != MPI_SUCCESS || !flag)
                break;
            int n = 0;
            MPI_Get_count(&st, MPI_CHAR, &n);
            std::string text(static_cast<std::size_t>(std::max(n, 0)), '\0');
            MPI_Recv(text.data(), n, MPI_CHAR, st.MPI_SOURCE, st.MPI_TAG, ctl_, MPI_STATUS_IGNORE);
            if (st.MPI_TAG == kProbeTag)
                post(text, st.MPI_SOURCE, kAnswerTag);  // the round number back
            else if (st.MPI_TAG == kAnswerTag && text == std::to_string(round_))
                answered_[static_cast<std::size_t>(st.MPI_SOURCE)] = 1;
            else if (st.MPI_TAG == kFailTag && failure_.empty())
                failure_ = detail::concat("rank ", st.MPI_SOURCE, " reported: ", text);
        }
        if (!failure_.empty()) throw CommTimeout(failure_);
    }

    // A new round: asks every other rank whether it is alive.
    void probe() {
        ++round_;
        answered_.assign(static_cast<std::size_t>(size_), 0);
        answered_[static_cast<std::size_t>(rank_)] = 1;
        for (int p = 0; p < size_; ++p)
            if (p != rank_) post(std::to_string(round_), p, kProbeTag);
    }

    bool all_answered() const {
        return std::all_of(answered_.begin(), answered_.end(), [](char a) { return a != 0; });
    }

    // The ranks of this round that did not answer, as "1, 3".
    std::string silent() const {
        std::string out;
        for (int p = 0; p < size_; ++p)
            if (!answered_[static_cast<std::size_t>(p)])
                out += detail::concat(out.empty() ? "" : ", ", p);
        return out;
    }

    // Tells every other rank, then throws.
    [[noreturn]] void fail(const std::string& why) {
        failure_ = why;
        for (int p = 0; p < size_; ++p)
            if (p != rank_) post(why.substr(0, 2048), p, kFailTag);
        throw CommTimeout(why);
    }

  private:
    static constexpr int kProbeTag = 1, kAnswerTag = 2, kFailTag = 3;

    void post(const std::string& bytes, int dest, int tag) {
        texts_.push_back(bytes);
        MPI_Request r = MPI_REQUEST_NULL;
        if (MPI_Isend(texts_.back().data(), static_cast<int>(texts_.back().size()), MPI_CHAR, dest,
                      tag, ctl_, &r) == MPI_SUCCESS)
            sends_.push_back(r);
        if (sends_.size() > 1024) reap();
    }

    // Frees the control sends that completed, with their buffers.
    void reap() {
        std::vector<MPI_Request> keep;
        std::deque<std::string> keep_texts;
        for (std::size_t k = 0; k < sends_.size(); ++k) {
            int done = 0;
            MPI_Test(&sends_[k], &done, MPI_STATUS_IGNORE);
            if (!done) {
                keep.push_back(sends_[k]);
                keep_texts.push_back(std::move(texts_[k]));
            }
        }
        sends_ = std::move(keep);
        texts_ = std::move(keep_texts);
    }

    MPI_Comm ctl_ = MPI_COMM_NULL;
    int rank_ = 0, size_ = 1;
    long round_ = 0;
    std::vector<char> answered_;
    std::string failure_;
    std::deque<std::string> texts_;  // buffers of sends_, index for index
    std::vector<MPI_Request> sends_;
};

std::shared_ptr<ControlChannel> g_control;  // made by the first mpi_world(), dropped at finalize

// Polls one operation under the timeout and the liveness protocol.
class Watchdog {
  public:
    explicit Watchdog(std::shared_ptr<ControlChannel> ch) : ch_(std::move(ch)) {}

    // Polls until done() (which tests the operation's MPI requests) is true. `what` names the
    // operation for the message (e.g. "all_reduce", "recv from rank 3 tag 7"). After
    // comm_timeout() seconds every rank of the job is probed: when all answer (they are alive,
    // e.g. busy in another group) the wait goes on for another timeout; when some do not within
    // the grace period, the run fails naming them.
    template <typename Done>
    void wait(Done&& done, const std::string& what) {
        const double limit = comm_timeout();
        auto start = SteadyClock::now(), probe_at = start;
        bool probing = false;
        for (long spins = 0;; ++spins) {
            if (done()) return;
            if (spins < 128) continue;
            std::this_thread::yield();
            if (spins % 64 != 0) continue;
            ch_->poll();
            if (limit <= 0) continue;
            if (!probing && seconds_since(start) > limit) {
                ch_->probe();
                probing = true;
                probe_at = SteadyClock::now();
            }
            if (probing) {
                ch_->poll();
                if (ch_->all_answered()) {  // everyone is alive: wait on
                    probing = false;
                    start = SteadyClock::now();
                } else if (seconds_since(probe_at) > grace()) {
                    ch_->fail(detail::concat("timeout: rank ", ch_->rank(), " waited ",
                                             seconds_since(start), " s in ", what,
                                             " (comm timeout ", limit, " s); rank(s) ",
                                             ch_->silent(), " did not answer within ", grace(),
                                             " s (stopped, dead, or busy outside communication)"));
                }
            }
        }
    }

    void keepalive() { ch_->poll(); }

  private:
    static double grace() { return std::clamp(comm_timeout() / 4, 0.2, 30.0); }

    std::shared_ptr<ControlChannel> ch_;
};

class MpiRequest final : public detail::RequestImpl {
  public:
    // expected[i]: the byte count chunk i must have (receives); empty for sends.
    MpiRequest(std::vector<MPI_Request> reqs, std::vector<int> expected, int peer, int tag,
               std::shared_ptr<Watchdog> dog)
        : reqs_(std::move(reqs)),
          expected_(std::move(expected)),
          peer_(peer),
          tag_(tag),
          dog_(std::move(dog)) {}

    ~MpiRequest() override {
        if (mpi_is_finalized()) return;
        // Cancel what is unmatched; what is matched completes.
        for (auto& r : reqs_) {
            if (r == MPI_REQUEST_NULL) continue;
            MPI_Cancel(&r);
            MPI_Wait(&r, MPI_STATUS_IGNORE);
        }
    }

    bool test() override {
        int flag = 0;
        std::vector<MPI_Status> st(reqs_.size());
        check_mpi(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, st.data()),
                  "Testall");
        if (flag) check_counts(st);
        return flag != 0;
    }

    void wait() override {
        std::vector<MPI_Status> st(reqs_.size());
        int rc = MPI_SUCCESS;
        dog_->wait(
            [&] {
                int flag = 0;
                rc = MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, st.data());
                return flag != 0 || rc != MPI_SUCCESS;
            },
            detail::concat(expected_.empty() ? "a send to rank " : "a receive from rank ", peer_,
                           " tag ", tag_));
        if (rc == MPI_ERR_IN_STATUS) {
            for (auto& s : st)
                if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING)
                    throw Error(detail::concat("MPI irecv/isend with rank ", peer_, " tag ", tag_,
                                               " failed: ", mpi_error_string(s.MPI_ERROR)));
        }
        check_mpi(rc, "Waitall");
        check_counts(st);
    }

  private:
    void check_counts(const std::vector<MPI_Status>& st) const {
        for (std::size_t i = 0; i < expected_.size(); ++i) {
            int got = 0;
            MPI_Get_count(&st[i], MPI_BYTE, &got);
            require(got == expected_[i], "irecv from rank ", peer_, " tag ", tag_, ": expected ",
                    expected_[i], " bytes but the message has ", got,
                    ": receive buffers must have the exact message size");
        }
    }

    std::vector<MPI_Request> reqs_;
    std::vector<int> expected_;
    int peer_, tag_;
    std::shared_ptr<Watchdog> dog_;
};

// Reads of a window: one MPI_Rget per chunk of each read; complete (the bytes are in the
// buffers) when every MPI request is. An RMA request cannot be cancelled: destroying a pending one
// waits for it.
class MpiGetRequest final : public detail::RequestImpl {
  public:
    MpiGetRequest(std::vector<MPI_Request> reqs, int target, std::shared_ptr<Watchdog> dog)
        : reqs_(std::move(reqs)), target_(target), dog_(std::move(dog)) {}
    ~MpiGetRequest() override {
        if (mpi_is_finalized()) return;
        MPI_Waitall(static_cast<int>(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE);
    }
    bool test() override {
        int flag = 0;
        check_mpi(
            MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE),
            "Testall (window reads)");
        return flag != 0;
    }
    void wait() override {
        int rc = MPI_SUCCESS;
        dog_->wait(
            [&] {
                int flag = 0;
                rc = MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag,
                                 MPI_STATUSES_IGNORE);
                return flag != 0 || rc != MPI_SUCCESS;
            },
            detail::concat("a window read from rank ", target_));
        check_mpi(rc, "Waitall (window reads)");
    }

  private:
    std::vector<MPI_Request> reqs_;
    int target_;
    std::shared_ptr<Watchdog> dog_;
};

// MPI_Win_create over each rank's region (displacement unit 1: offsets are bytes), with one
// passive-target epoch to every rank for the window's life (MPI_Win_lock_all, shared, no check:
// nobody takes an exclusive lock), so reads need no synchronization call of the target.
class MpiWindow final : public Window {
  public:
    MpiWindow(MPI_Comm comm, std::span<std::byte> region, std::vector<int64_t> sizes,
              std::shared_ptr<Watchdog> dog)
        : sizes_(std::move(sizes)), dog_(std::move(dog)) {
        const int rc =
            MPI_Win_create(region.empty() ? nullptr : region.data(),
                           static_cast<MPI_Aint>(region.size()), 1, MPI_INFO_NULL, comm, &win_);
        // OpenMPI 4.1 with shared memory off (--mca btl self,tcp): osc rdma finds no BTL that
        // can read remote memory and the window fails; osc pt2pt emulates the reads with
        // messages.
        if (rc != MPI_SUCCESS)
            throw Error(detail::concat(
                "MPI Win_create failed: ", mpi_error_string(rc),
                " (no one-sided component works over this transport; with OpenMPI over TCP add "
                "--mca osc pt2pt, or use messages: --direct-read off)"));
        check_mpi(MPI_Win_set_errhandler(win_, MPI_ERRORS_RETURN), "Win_set_errhandler");
        check_mpi(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_), "Win_lock_all");
    }
    ~MpiWindow() override {
        if (mpi_is_finalized()) return;
        MPI_Win_unlock_all(win_);
        MPI_Win_free(&win_);
    }
    int64_t region_bytes(int target) const override {
        require(target >= 0 && target < static_cast<int>(sizes_.size()), "window target ", target,
                " is not a rank of its ", sizes_.size(), "-rank communicator");
        return sizes_[static_cast<std::size_t>(target)];
    }

  protected:
    Request do_get_many(std::span<std::byte* const> outs, std::span<const int64_t> offsets,
                        std::span<const int64_t> sizes, int target) override {
        std::vector<MPI_Request> reqs;
        reqs.reserve(outs.size());
        for (std::size_t i = 0; i < outs.size(); ++i) {
            const auto bytes = static_cast<std::size_t>(sizes[i]);
            if (bytes == 0) continue;
            for (std::size_t c = 0; c < num_chunks(bytes); ++c) {
                MPI_Request r = MPI_REQUEST_NULL;
                const int n = chunk_len(bytes, c);
                const int rc = MPI_Rget(outs[i] + c * kMaxChunk, n, MPI_BYTE, target,
                                        static_cast<MPI_Aint>(offsets[i] + c * kMaxChunk), n,
                                        MPI_BYTE, win_, &r);
                if (rc != MPI_SUCCESS) {
                    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
                    check_mpi(rc, "Rget");
                }
                reqs.push_back(r);
            }
        }
        if (reqs.empty()) return Request();
        return Request(std::make_unique<MpiGetRequest>(std::move(reqs), target, dog_));
    }

  private:
    MPI_Win win_ = MPI_WIN_NULL;
    std::vector<int64_t> sizes_;
    std::shared_ptr<Watchdog> dog_;
};

class MpiCommunicator final : public Communicator {
  public:
    // Takes ownership of `comm` (freed in the destructor).
    explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
        check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "Comm_set_errhandler");
        check_mpi(MPI_Comm_rank(comm_, &rank_), "Comm_rank");
        check_mpi(MPI_Comm_size(comm_, &size_), "Comm_size");
        check_mpi(MPI_Comm_dup(comm_, &coll_), "Comm_dup");
        check_mpi(MPI_Comm_set_errhandler(coll_, MPI_ERRORS_RETURN), "Comm_set_errhandler");
        if (!g_control) g_control = std::make_shared<ControlChannel>();
        dog_ = std::make_shared<Watchdog>(g_control);
    }
    ~MpiCommunicator() override {
        dog_.reset();
        if (!mpi_is_finalized()) {
            MPI_Comm_free(&coll_);
            MPI_Comm_free(&comm_);
        }
    }

    int rank() const override { return rank_; }
    int size() const override { return size_; }
    Backend backend() const override { return Backend::kMpi; }
    void keepalive() override { dog_->keepalive(); }

  protected:
    // Posts with `post(&request)` and waits for it under the watchdog; returns its status.
    template <typename Post>
    MPI_Status wait_one(Post&& post, const char* op, const std::string& detail_text = "") {
        MPI_Request r = MPI_REQUEST_NULL;
        check_mpi(post(&r), op);
        MPI_Status st{};
        int rc = MPI_SUCCESS;
        dog_->wait(
            [&] {
                int flag = 0;
                rc = MPI_Test(&r, &flag, &st);
                return flag != 0 || rc != MPI_SUCCESS;
            },
            detail_text.empty() ? std::string(op) : detail_text);
        if (rc == MPI_ERR_TRUNCATE || st.MPI_ERROR == MPI_ERR_TRUNCATE) {
            st.MPI_ERROR = MPI_ERR_TRUNCATE;
            return st;
        }
        check_mpi(rc, op);
        return st;
    }

    void do_send(std::span<const std::byte> data, int dest, int tag) override {
        for (std::size_t c = 0; c < num_chunks(data.size()); ++c)
            wait_one(
                [&](MPI_Request* r) {
                    return MPI_Isend(data.data() + c * kMaxChunk, chunk_len(data.size(), c),
                                     MPI_BYTE, dest, tag, comm_, r);
                },
                "Isend", detail::concat("send to rank ", dest, " tag ", tag));
    }

    void do_recv(std::span<std::byte> data, int source, int tag) override {
        for (std::size_t c = 0; c < num_chunks(data.size()); ++c) {
            const int want = chunk_len(data.size(), c);
            const MPI_Status st = wait_one(
                [&](MPI_Request* r) {
                    return MPI_Irecv(data.data() + c * kMaxChunk, want, MPI_BYTE, source, tag,
                                     comm_, r);
                },
                "Irecv", detail::concat("recv from rank ", source, " tag ", tag));
            if (st.MPI_ERROR == MPI_ERR_TRUNCATE)
                throw Error(detail::concat("recv of ", data.size(), " bytes from rank ", source,
                                           " tag ", tag,
                                           " matched a larger message: receive "
                                           "buffers must have the exact message size"));
            int got = 0;
            MPI_Get_count(&st, MPI_BYTE, &got);
            require(got == want, "recv of ", data.size(), " bytes from rank ", source, " tag ", tag,
                    " matched a message of ", got,
                    " bytes: receive buffers must have the exact message size (use recv_any_size "
                    "for unknown sizes)");
        }
    }

    std::vector<std::byte> do_recv_any_size(int source, int tag) override {
        MPI_Status st;
        int rc = MPI_SUCCESS;
        dog_->wait(
            [&] {
                int flag = 0;
                rc = MPI_Iprobe(source, tag, comm_, &flag, &st);
                return flag != 0 || rc != MPI_SUCCESS;
            },
            detail::concat("recv_any_size from rank ", source, " tag ", tag));
        check_mpi(rc, "Iprobe");
        int count = 0;
        MPI_Get_count(&st, MPI_BYTE, &count);
        require(static_cast<std::size_t>(count) < kMaxChunk, "recv_any_size from rank ", source,
                " tag ", tag, ": the MPI backend handles unknown-size messages below ", kMaxChunk,
                " bytes");
        std::vector<std::byte> out(static_cast<std::size_t>(count));
        check_mpi(MPI_Recv(out.data(), count, MPI_BYTE, source, tag, comm_, MPI_STATUS_IGNORE),
                  "Recv");
        return out;
    }

    Request do_isend(std::span<const std::byte> data, int dest, int tag) override {
        std::vector<MPI_Request> reqs(num_chunks(data.size()), MPI_REQUEST_NULL);
        for (std::size_t c = 0; c < reqs.size(); ++c)
            check_mpi(MPI_Isend(data.data() + c * kMaxChunk, chunk_len(data.size(), c), MPI_BYTE,
                                dest, tag, comm_, &reqs[c]),
                      "Isend");
        return Request(
            std::make_unique<MpiRequest>(std::move(reqs), std::vector<int>{}, dest, tag, dog_));
    }

    Request do_irecv(std::span<std::byte> data, int source, int tag) override {
        std::vector<MPI_Request> reqs(num_chunks(data.size()), MPI_REQUEST_NULL);
        std::vector<int> expected(reqs.size());
        for (std::size_t c = 0; c < reqs.size(); ++c) {
            expected[c] = chunk_len(data.size(), c);
            check_mpi(MPI_Irecv(data.data() + c * kMaxChunk, expected[c], MPI_BYTE, source, tag,
                                comm_, &reqs[c]),
                      "Irecv");
        }
        return Request(
            std::make_unique<MpiRequest>(std::move(reqs), std::move(expected), source, tag, dog_));
    }

    // Collectives are point-to-point exchanges on coll_ (a duplicate of comm_, so that their
    // messages never match user receives), all posted at once and polled under the watchdog.
    // MPI's own non-blocking collectives (libnbc) were 2.5x slower than the blocking ones for the
    // small all-reduces of a decode step; direct sends between every pair are as fast, and each
    // pair's messages keep MPI's order, so consecutive collectives cannot mix. O(n^2) messages per
    // collective: meant for the tens of ranks kvshard runs, not thousands.
    struct Part {
        int peer;
        std::byte* data;
        std::size_t bytes;
    };
    void exchange(const std::vector<Part>& sends, const std::vector<Part>& recvs,
                  const char* what) {
        std::vector<MPI_Request> reqs(sends.size() + recvs.size(), MPI_REQUEST_NULL);
        for (std::size_t k = 0; k < recvs.size(); ++k)
            check_mpi(MPI_Irecv(recvs[k].data, to_int_count(recvs[k].bytes, what), MPI_BYTE,
                                recvs[k].peer, 0, coll_, &reqs[k]),
                      "Irecv");
        for (std::size_t k = 0; k < sends.size(); ++k)
            check_mpi(MPI_Isend(sends[k].data, to_int_count(sends[k].bytes, what), MPI_BYTE,
                                sends[k].peer, 0, coll_, &reqs[recvs.size() + k]),
                      "Isend");
        std::vector<MPI_Status> st(reqs.size());
        int rc = MPI_SUCCESS;
        dog_->wait(
            [&] {
                int flag = 0;
                rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, st.data());
                return flag != 0 || rc != MPI_SUCCESS;
            },
            what);
        for (std::size_t k = 0; k < recvs.size(); ++k) {
            const bool truncated = rc == MPI_ERR_IN_STATUS && st[k].MPI_ERROR == MPI_ERR_TRUNCATE;
            int got = 0;
            if (!truncated) MPI_Get_count(&st[k], MPI_BYTE, &got);
            require(!truncated && static_cast<std::size_t>(got) == recvs[k].bytes, what, ": rank ",
                    rank_, " expected ", recvs[k].bytes, " bytes from rank ", recvs[k].peer,
                    " but it sent ", truncated ? "more" : std::to_string(got),
                    " (every rank passes matching sizes and counts)");
        }
        check_mpi(rc, what);
    }

    void do_barrier() override {
        std::vector<Part> sends, recvs;
        for (int p = 0; p < size_; ++p)
            if (p != rank_) {
                sends.push_back({p, nullptr, 0});
                recvs.push_back({p, nullptr, 0});
            }
        exchange(sends, recvs, "barrier");
    }

    void do_broadcast(std::span<std::byte> data, int root) override {
        std::vector<Part> sends, recvs;
        if (rank_ == root) {
            for (int p = 0; p < size_; ++p)
                if (p != root) sends.push_back({p, data.data(), data.size()});
        } else {
            recvs.push_back({root, data.data(), data.size()});
        }
        exchange(sends, recvs, "broadcast");
    }

    void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv) override {
        const std::vector<std::size_t> counts(static_cast<std::size_t>(size_), send.size());
        do_all_gather_v(send, recv, counts);
    }

    void do_all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                         std::span<const std::size_t> recv_counts) override {
        std::vector<Part> sends, recvs;
        auto* mine = const_cast<std::byte*>(send.data());  // MPI's send buffers are not const
        std::size_t off = 0;
        for (int p = 0; p < size_; ++p) {
            if (p == rank_) {
                if (!send.empty()) std::memcpy(recv.data() + off, send.data(), send.size());
            } else {
                sends.push_back({p, mine, send.size()});
                recvs.push_back({p, recv.data() + off, recv_counts[p]});
            }
            off += recv_counts[p];
        }
        exchange(sends, recvs, "all_gather_v");
    }

    void do_all_to_all_v(std::span<const std::byte> send, std::span<const std::size_t> send_counts,
                         std::span<std::byte> recv,
                         std::span<const std::size_t> recv_counts) override {
        std::vector<Part> sends, recvs;
        auto* base = const_cast<std::byte*>(send.data());
        std::size_t so = 0, ro = 0;
        for (int p = 0; p < size_; ++p) {
            if (p == rank_) {
                require(send_counts[p] == recv_counts[p], "all_to_all_v: rank ", rank_, " sends ",
                        send_counts[p], " bytes to itself but expects ", recv_counts[p],
                        " (recv_counts[p] must equal peer p's send_counts[rank()])");
                if (send_counts[p]) std::memcpy(recv.data() + ro, send.data() + so, send_counts[p]);
            } else {
                sends.push_back({p, base + so, send_counts[p]});
                recvs.push_back({p, recv.data() + ro, recv_counts[p]});
            }
            so += send_counts[p];
            ro += recv_counts[p];
        }
        exchange(sends, recvs, "all_to_all_v");
    }

    std::unique_ptr<Window> do_create_window(std::span<std::byte> region) override {
        // Under the timeout: MPI_Win_create itself cannot be interrupted.
        std::vector<int64_t> sizes = all_gather_value(static_cast<int64_t>(region.size()));
        return std::make_unique<MpiWindow>(comm_, region, std::move(sizes), dog_);
    }

    std::unique_ptr<Communicator> do_split(int color, int key) override {
        do_barrier();  // under the timeout: MPI_Comm_split itself cannot be interrupted
        MPI_Comm out = MPI_COMM_NULL;
        check_mpi(
            MPI_Comm_split(comm_, color == kUndefinedColor ? MPI_UNDEFINED : color, key, &out),
            "Comm_split");
        if (out == MPI_COMM_NULL) return nullptr;
        return std::make_unique<MpiCommunicator>(out);
    }

  private:
    MPI_Comm comm_;
    MPI_Comm coll_ = MPI_COMM_NULL;  // the collectives' messages
    int rank_ = 0, size_ = 1;
    std::shared_ptr<Watchdog> dog_;
};

}  // namespace

void mpi_init(int* argc, char*** argv) {
    if (mpi_is_initialized()) return;
    require(!mpi_is_finalized(), "MPI was already finalized in this process and cannot restart");
    int provided = 0;
    check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "Init_thread");
    g_we_initialized = true;
    std::atexit([] { mpi_finalize(); });
    // Tags up to kMaxTag must be valid on this MPI.
    void* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    KVSHARD_CHECK(!flag || *static_cast<int*>(ub) >= Communicator::kMaxTag,
                  "MPI_TAG_UB is below Communicator::kMaxTag");
}

void mpi_finalize() {
    if (g_we_initialized && mpi_is_initialized() && !mpi_is_finalized()) {
        g_control.reset();
        MPI_Finalize();
    }
}

std::unique_ptr<Communicator> mpi_world() {
    mpi_init();
    MPI_Comm dup = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "Comm_dup");
    return std::make_unique<MpiCommunicator>(dup);
}

void mpi_abort(int exit_code) {
    if (mpi_is_initialized() && !mpi_is_finalized()) MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::exit(exit_code);
}

}  // namespace kvshard
