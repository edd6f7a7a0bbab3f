#pragma once
// Communicator: the one way ranks talk to each other (docs/comm.md).
//
// Two backends behind this interface, chosen at launch (kvshard/comm/launch.h):
//  - threads (default): ranks are std::threads of one process (run_threads,
//  kvshard/comm/threads.h);
//  - MPI: ranks are processes started by mpirun (kvshard/comm/mpi.h).
// Code written against Communicator runs unchanged on both.
//
// Semantics (the same on both backends):
//  - Ranks are 0..size()-1 of this communicator. Tags are user chosen, 0 <= tag <= kMaxTag.
//  - Point to point: a send matches the first posted receive with the same (source, tag) on the
//    destination, and messages between one pair with one tag arrive in the order they were sent
//    (MPI's non-overtaking rule). A receive must name the exact byte count of the message
//    (recv_any_size() is for messages of unknown size); a mismatch throws Error on the receiver.
//    A blocking send may wait until the receiver has matched it (write code that is safe under
//    MPI's rendezvous protocol: never both peers send-then-recv; use isend/irecv or sendrecv).
//  - Non-blocking isend/irecv return a Request. The buffer must stay alive and untouched until the
//    request completes (wait() or test() returned true). Destroying a pending Request cancels the
//    operation if no peer has matched it yet, else waits for the copy in flight.
//  - Collectives must be called by every rank of the communicator, in the same order.
//  - Reductions are deterministic: element i of the result is
//    ((x_0[i] + x_1[i]) + x_2[i]) + ... + x_{n-1}[i], summed in rank order, on every rank and on
//    both backends, so results are bit-identical across runs and across backends.
//  - Communicators are not thread-safe: one thread uses one Communicator object at a time.
//  - Failure: an operation that cannot complete because the run was aborted (another rank threw,
//    or the threads backend found that every rank is blocked: a deadlock) throws CommAborted; one
//    that waited longer than comm_timeout() ends the run with CommTimeout naming the rank(s) that
//    did not answer.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvshard/common/error.h"

namespace kvshard {

enum class Backend { kThreads, kMpi };
std::string_view backend_name(Backend b);   // "threads" | "mpi"
Backend parse_backend(std::string_view s);  // throws Error unless threads|mpi

// Thrown by communicator operations on a rank whose run was aborted (another rank failed, or a
// deadlock was detected). The message names the cause.
class CommAborted : public Error {
  public:
    explicit CommAborted(const std::string& what) : Error(what) {}
};

// Thrown when a blocking operation waited longer than comm_timeout(): the run is ended on every
// rank, and the message names the rank(s) that did not answer (stopped, dead or far behind).
class CommTimeout : public CommAborted {
  public:
    explicit CommTimeout(const std::string& what) : CommAborted(what) {}
};

// How long any blocking operation (a collective, a blocking send or receive, Request::wait) may
// wait before the run is ended with CommTimeout, in seconds; 0: no limit. Process-wide, read at
// the start of every wait, on both backends (docs/comm.md, "Timeouts"). Default
// kDefaultCommTimeoutS; `kvshard run --comm-timeout-s`.
inline constexpr double kDefaultCommTimeoutS = 300;
void set_comm_timeout(double seconds);  // Error unless finite and in [0, 1e6]
double comm_timeout();

enum class ReduceOp { kSum, kMax, kMin };

namespace detail {
enum class ElemType { kF32, kF64, kI32, kI64 };
template <typename T>
constexpr ElemType elem_type_of() {
    if constexpr (std::is_same_v<T, float>)
        return ElemType::kF32;
    else if constexpr (std::is_same_v<T, double>)
        return ElemType::kF64;
    else if constexpr (std::is_same_v<T, std::int32_t>)
        return ElemType::kI32;
    else
        return ElemType::kI64;
}
template <typename T>
concept Reducible = std::is_same_v<T, float> || std::is_same_v<T, double> ||
    std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t>;

// A contiguous range of trivially copyable elements (std::vector, std::array, std::span, ...).
template <typename R>
concept ByteCopyableRange = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    std::is_trivially_copyable_v<std::ranges::range_value_t<R>>;

template <ByteCopyableRange R>
std::span<const std::byte> const_bytes_of(const R& r) {
    return std::as_bytes(std::span(std::ranges::data(r), std::ranges::size(r)));
}
template <ByteCopyableRange R>
std::span<std::byte> writable_bytes_of(R& r) {
    return std::as_writable_bytes(std::span(std::ranges::data(r), std::ranges::size(r)));
}

// Backend part of a Request.
class RequestImpl {
  public:
    virtual ~RequestImpl() = default;  // cancels if unmatched, else waits for the copy in flight
    virtual bool test() = 0;           // true once complete; throws on failure
    virtual void wait() = 0;           // blocks until complete; throws on failure
};
}  // namespace detail

// Handle of a non-blocking send or receive. Move-only. A default-constructed Request is complete.
class [[nodiscard]] Request {
  public:
    Request() = default;
    explicit Request(std::unique_ptr<detail::RequestImpl> impl) : impl_(std::move(impl)) {}
    Request(Request&&) noexcept = default;
    Request& operator=(Request&&) noexcept = default;
    ~Request() = default;

    void wait();  // blocks until the operation completed; throws Error/CommAborted
    bool test();  // true once complete (then the buffer may be reused)
    bool pending() const { return impl_ != nullptr; }

  private:
    std::unique_ptr<detail::RequestImpl> impl_;
};

// Waits for every request (in order); the first failure is thrown after all were waited for.
void wait_all(std::span<Request> requests);

// A memory window (one-sided reads, MPI RMA): every rank of a communicator exposes one region of
// its memory, and any rank may read bytes of any rank's region without that rank taking part
// (MPI: MPI_Win_create over the regions, a passive-target epoch opened with MPI_Win_lock_all,
// reads posted as MPI_Rget; threads: a memcpy from the peer's region, which lies in this process).
// Made by Communicator::create_window, collectively.
//  - The bytes read are those the region holds when the read happens: the owner must not write
//    the bytes a peer reads until the peer said it is done (the window orders nothing by itself).
//  - Destroy a window on every rank together (MPI_Win_free is collective), after every read of
//    it completed; the regions must outlive it.
//  - Like its communicator, a window is used by one thread at a time (MPI: the thread of
//    mpi_init()).
class Window {
  public:
    Window() = default;
    Window(const Window&) = delete;
    Window& operator=(const Window&) = delete;
    virtual ~Window() = default;

    // Bytes of rank `target`'s region.
    virtual int64_t region_bytes(int target) const = 0;
    // Starts reading out.size() bytes at byte `offset` of rank `target`'s region into `out`; the
    // bytes are in `out` once the request completed (test() true or wait() returned). Error when
    // the range lies outside that region.
    Request get(std::span<std::byte> out, int target, int64_t offset);
    // Several reads from one target as one request: read i puts sizes[i] bytes from
    // offsets[i] at outs[i]. Cheaper than one request per read where there are many.
    Request get_many(std::span<std::byte* const> outs, std::span<const int64_t> offsets,
                     std::span<const int64_t> sizes, int target);

  protected:
    virtual Request do_get_many(std::span<std::byte* const> outs, std::span<const int64_t> offsets,
                                std::span<const int64_t> sizes, int target) = 0;
};

class Communicator {
  public:
    static constexpr int kMaxTag = (1 << 20) - 1;  // user tags are 0..kMaxTag on every backend
    static constexpr int kUndefinedColor = -1;     // split(): this rank joins no sub-group

    Communicator() = default;
    Communicator(const Communicator&) = delete;
    Communicator& operator=(const Communicator&) = delete;
    virtual ~Communicator() = default;

    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual Backend backend() const = 0;
    // Answers the liveness probes of ranks that waited past comm_timeout() (MPI; nothing on
    // threads). Every wait does it; call it also in a long loop that does not communicate (a
    // serving loop of a one-rank group), so that this rank is not taken for a stopped one.
    virtual void keepalive() {}

    // ---- point to point (bytes) ----
    void send(std::span<const std::byte> data, int dest, int tag);
    void recv(std::span<std::byte> data, int source, int tag);
    // Receives a message whose size the receiver does not know in advance.
    std::vector<std::byte> recv_any_size(int source, int tag);
    Request isend(std::span<const std::byte> data, int dest, int tag);
    Request irecv(std::span<std::byte> data, int source, int tag);
    // Sends to `dest` and receives from `source` at the same time (safe for rings and swaps).
    void sendrecv(std::span<const std::byte> send_data, int dest, int send_tag,
                  std::span<std::byte> recv_data, int source, int recv_tag);

    // ---- point to point (typed: any contiguous range of trivially copyable elements) ----
    template <detail::ByteCopyableRange R>
    void send(const R& data, int dest, int tag) {
        send(detail::const_bytes_of(data), dest, tag);
    }
    template <detail::ByteCopyableRange R>
    void recv(R&& data, int source, int tag) {
        recv(detail::writable_bytes_of(data), source, tag);
    }
    template <detail::ByteCopyableRange R>
    Request isend(const R& data, int dest, int tag) {
        return isend(detail::const_bytes_of(data), dest, tag);
    }
    template <detail::ByteCopyableRange R>
    Request irecv(R&& data, int source, int tag) {
        return irecv(detail::writable_bytes_of(data), source, tag);
    }
    template <typename T>
    requires std::is_trivially_copyable_v<T>
    void send_value(const T& v, int dest, int tag) {
        send(std::as_bytes(std::span<const T, 1>(&v, 1)), dest, tag);
    }
    template <typename T>
    requires std::is_trivially_copyable_v<T> T recv_value(int source, int tag) {
        T v{};
        recv(std::as_writable_bytes(std::span<T, 1>(&v, 1)), source, tag);
        return v;
    }

    // ---- collectives ----
    void barrier();
    // Root's bytes are copied into `data` on every rank; all ranks pass the same size.
    void broadcast(std::span<std::byte> data, int root);
    // Equal blocks: recv.size() == size() * send.size(); block r (rank order) comes from rank r.
    void all_gather(std::span<const std::byte> send, std::span<std::byte> recv);
    // Per-rank sizes: recv_counts[r] bytes from rank r, concatenated in rank order into recv
    // (recv.size() == sum of recv_counts; recv_counts[rank()] == send.size()).
    void all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                      std::span<const std::size_t> recv_counts);
    // Variable-size blobs, sizes exchanged for you: result[r] is rank r's `send`.
    std::vector<std::vector<std::byte>> all_gather_blobs(std::span<const std::byte> send);
    // Personalized exchange. `send` is the concatenation, in peer order, of send_counts[p] bytes
    // for peer p; `recv` receives recv_counts[p] bytes from peer p, concatenated in peer order.
    // recv_counts[p] must equal peer p's send_counts[rank()] (all_to_all_counts() computes it).
    // Zero counts are fine.
    void all_to_all_v(std::span<const std::byte> send, std::span<const std::size_t> send_counts,
                      std::span<std::byte> recv, std::span<const std::size_t> recv_counts);
    // What each peer will send me, given what I send each peer: result[p] = peer p's
    // send_counts[rank()].
    std::vector<std::size_t> all_to_all_counts(std::span<const std::size_t> send_counts);

    // In-place reductions; deterministic rank-order arithmetic (see top of file).
    void all_reduce(std::span<float> data, ReduceOp op);
    void all_reduce(std::span<double> data, ReduceOp op);
    void all_reduce(std::span<std::int32_t> data, ReduceOp op);
    void all_reduce(std::span<std::int64_t> data, ReduceOp op);
    void all_reduce_sum(std::span<float> data) { all_reduce(data, ReduceOp::kSum); }
    void all_reduce_sum(std::span<double> data) { all_reduce(data, ReduceOp::kSum); }
    void all_reduce_sum(std::span<std::int32_t> data) { all_reduce(data, ReduceOp::kSum); }
    void all_reduce_sum(std::span<std::int64_t> data) { all_reduce(data, ReduceOp::kSum); }
    template <detail::Reducible T>
    T all_reduce_value(T v, ReduceOp op) {
        all_reduce(std::span<T>(&v, 1), op);
        return v;
    }

    // ---- typed collectives ----
    template <detail::ByteCopyableRange R>
    void broadcast(R&& data, int root) {
        broadcast(detail::writable_bytes_of(data), root);
    }
    template <typename T>
    requires std::is_trivially_copyable_v<T> T broadcast_value(T v, int root) {
        broadcast(std::as_writable_bytes(std::span<T, 1>(&v, 1)), root);
        return v;
    }
    template <detail::ByteCopyableRange S, detail::ByteCopyableRange R>
    void all_gather(const S& send, R&& recv) {
        all_gather(detail::const_bytes_of(send), detail::writable_bytes_of(recv));
    }
    // result[r] = rank r's v.
    template <typename T>
    requires std::is_trivially_copyable_v<T> std::vector<T> all_gather_value(const T& v) {
        std::vector<T> out(static_cast<std::size_t>(size()));
        all_gather(std::as_bytes(std::span<const T, 1>(&v, 1)), detail::writable_bytes_of(out));
        return out;
    }
    // Element counts instead of byte counts; T is the element type of both buffers.
    template <typename T>
    requires std::is_trivially_copyable_v<T>
    void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts,
                      std::span<T> recv, std::span<const std::size_t> recv_counts) {
        std::vector<std::size_t> sb(send_counts.begin(), send_counts.end());
        std::vector<std::size_t> rb(recv_counts.begin(), recv_counts.end());
        for (auto& c : sb) c *= sizeof(T);
        for (auto& c : rb) c *= sizeof(T);
        all_to_all_v(std::as_bytes(send), sb, std::as_writable_bytes(recv), rb);
    }

    // MPI_Comm_split: ranks passing the same color form a new communicator, ordered by (key, old
    // rank). color == kUndefinedColor returns nullptr. Collective over this communicator.
    std::unique_ptr<Communicator> split(int color, int key);

    // ---- one-sided reads ----
    // A window over `region` of this rank (may be empty) and the regions every other rank passes
    // (Window above). Collective over this communicator.
    std::unique_ptr<Window> create_window(std::span<std::byte> region);

  protected:
    virtual void do_send(std::span<const std::byte> data, int dest, int tag) = 0;
    virtual void do_recv(std::span<std::byte> data, int source, int tag) = 0;
    virtual std::vector<std::byte> do_recv_any_size(int source, int tag) = 0;
    virtual Request do_isend(std::span<const std::byte> data, int dest, int tag) = 0;
    virtual Request do_irecv(std::span<std::byte> data, int source, int tag) = 0;
    virtual void do_barrier() = 0;
    virtual void do_broadcast(std::span<std::byte> data, int root) = 0;
    virtual void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv) = 0;
    virtual void do_all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                                 std::span<const std::size_t> recv_counts) = 0;
    virtual void do_all_to_all_v(std::span<const std::byte> send,
                                 std::span<const std::size_t> send_counts,
                                 std::span<std::byte> recv,
                                 std::span<const std::size_t> recv_counts) = 0;
    // Default: reduce-scatter by all_to_all_v (chunk r to rank r), reduce in rank order, then
    // all_gather_v. Backends may override with the same arithmetic order.
    virtual void do_all_reduce(std::span<std::byte> data, detail::ElemType type, ReduceOp op);
    virtual std::unique_ptr<Communicator> do_split(int color, int key) = 0;
    // Default: Error (a backend without one-sided reads).
    virtual std::unique_ptr<Window> do_create_window(std::span<std::byte> region);

  private:
    void check_peer(int peer, const char* what) const;
    void check_tag(int tag, const char* what) const;
};

namespace detail {
// out[i] = op(out[i], in[i]) for `count` elements of `type`; the one reduction kernel of every
// backend, so both backends produce identical bits.
void reduce_into(void* out, const void* in, std::size_t count, ElemType type, ReduceOp op);
std::size_t elem_size(ElemType type);
// The element range [begin, end) of chunk `r` of `count` elements split over `n` ranks.
std::pair<std::size_t, std::size_t> chunk_range(std::size_t count, int n, int r);
}  // namespace detail

}  // namespace kvshard
