#include "kvshard/comm/communicator.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <numeric>

namespace kvshard {

std::string_view backend_name(Backend b) {
    switch (b) {
        case Backend::kThreads:
            return "threads";
        case Backend::kMpi:
            return "mpi";
    }
    return "?";
}

Backend parse_backend(std::string_view s) {
    if (s == "threads") return Backend::kThreads;
    if (s == "mpi") return Backend::kMpi;
    throw Error(detail::concat("unknown backend '", s, "': expected threads or mpi"));
}

// ---- timeouts ----

namespace {
std::atomic<double> g_comm_timeout{kDefaultCommTimeoutS};
}

void set_comm_timeout(double seconds) {
    require(seconds >= 0 && seconds <= 1e6,
            "the communication timeout must be a finite number of seconds in [0, 1e6] (0: no "
            "limit), got ",
            seconds);
    g_comm_timeout.store(seconds);
}

double comm_timeout() { return g_comm_timeout.load(); }

// ---- Request ----

void Request::wait() {
    if (!impl_) return;
    // Reset even when wait() throws: a failed request is finished.
    auto impl = std::move(impl_);
    impl->wait();
}

bool Request::test() {
    if (!impl_) return true;
    if (!impl_->test()) return false;
    impl_.reset();
    return true;
}

void wait_all(std::span<Request> requests) {
    std::exception_ptr first;
    for (auto& r : requests) {
        try {
            r.wait();
        } catch (...) {
            if (!first) first = std::current_exception();
        }
    }
    if (first) std::rethrow_exception(first);
}

// ---- argument checks (user errors: Error) ----

void Communicator::check_peer(int peer, const char* what) const {
    require(peer >= 0 && peer < size(), what, ": rank ", peer,
            " is out of range: this communicator has ", size(), " ranks (0..", size() - 1, ")");
}

void Communicator::check_tag(int tag, const char* what) const {
    require(tag >= 0 && tag <= kMaxTag, what, ": tag ", tag, " is out of range 0..", kMaxTag);
}

void Communicator::send(std::span<const std::byte> data, int dest, int tag) {
    check_peer(dest, "send");
    check_tag(tag, "send");
    do_send(data, dest, tag);
}

void Communicator::recv(std::span<std::byte> data, int source, int tag) {
    check_peer(source, "recv");
    check_tag(tag, "recv");
    do_recv(data, source, tag);
}

std::vector<std::byte> Communicator::recv_any_size(int source, int tag) {
    check_peer(source, "recv_any_size");
    check_tag(tag, "recv_any_size");
    return do_recv_any_size(source, tag);
}

Request Communicator::isend(std::span<const std::byte> data, int dest, int tag) {
    check_peer(dest, "isend");
    check_tag(tag, "isend");
    return do_isend(data, dest, tag);
}

Request Communicator::irecv(std::span<std::byte> data, int source, int tag) {
    check_peer(source, "irecv");
    check_tag(tag, "irecv");
    return do_irecv(data, source, tag);
}

void Communicator::sendrecv(std::span<const std::byte> send_data, int dest, int send_tag,
                            std::span<std::byte> recv_data, int source, int recv_tag) {
    Request reqs[2] = {irecv(recv_data, source, recv_tag), isend(send_data, dest, send_tag)};
    wait_all(reqs);
}

void Communicator::barrier() { do_barrier(); }

void Communicator::broadcast(std::span<std::byte> data, int root) {
    check_peer(root, "broadcast");
    do_broadcast(data, root);
}

void Communicator::all_gather(std::span<const std::byte> send, std::span<std::byte> recv) {
    require(recv.size() == send.size() * static_cast<std::size_t>(size()),
            "all_gather: recv holds ", recv.size(),
            " bytes, expected size() * send.size() = ", size(), " * ", send.size());
    do_all_gather(send, recv);
}

void Communicator::all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                                std::span<const std::size_t> recv_counts) {
    require(recv_counts.size() == static_cast<std::size_t>(size()),
            "all_gather_v: ", recv_counts.size(), " recv counts given, expected one per rank (",
            size(), ")");
    require(recv_counts[rank()] == send.size(), "all_gather_v: recv_counts[", rank(),
            "] = ", recv_counts[rank()], " but this rank sends ", send.size(), " bytes");
    const std::size_t total =
        std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0});
    require(recv.size() == total, "all_gather_v: recv holds ", recv.size(),
            " bytes, expected the sum of recv_counts = ", total);
    do_all_gather_v(send, recv, recv_counts);
}

std::vector<std::vector<std::byte>> Communicator::all_gather_blobs(
    std::span<const std::byte> send) {
    const auto sizes = all_gather_value<std::uint64_t>(send.size());
    std::vector<std::size_t> counts(sizes.begin(), sizes.end());
    std::vector<std::byte> flat(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
    do_all_gather_v(send, flat, counts);
    std::vector<std::vector<std::byte>> out(counts.size());
    std::size_t off = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) {
        out[r].assign(flat.begin() + static_cast<std::ptrdiff_t>(off),
                      flat.begin() + static_cast<std::ptrdiff_t>(off + counts[r]));
        off += counts[r];
    }
    return out;
}

void Communicator::all_to_all_v(std::span<const std::byte> send,
                                std::span<const std::size_t> send_counts, std::span<std::byte> recv,
                                std::span<const std::size_t> recv_counts) {
    const auto n = static_cast<std::size_t>(size());
    require(send_counts.size() == n && recv_counts.size() == n,
            "all_to_all_v: ", send_counts.size(), " send counts and ", recv_counts.size(),
            " recv counts given, expected one per rank (", n, ")");
    const std::size_t st = std::accumulate(send_counts.begin(), send_counts.end(), std::size_t{0});
    const std::size_t rt = std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0});
    require(send.size() == st, "all_to_all_v: send holds ", send.size(),
            " bytes, expected the sum of send_counts = ", st);
    require(recv.size() == rt, "all_to_all_v: recv holds ", recv.size(),
            " bytes, expected the sum of recv_counts = ", rt);
    do_all_to_all_v(send, send_counts, recv, recv_counts);
}

std::vector<std::size_t> Communicator::all_to_all_counts(std::span<const std::size_t> send_counts) {
    const auto n = static_cast<std::size_t>(size());
    require(send_counts.size() == n, "all_to_all_counts: ", send_counts.size(),
            " counts given, expected one per rank (", n, ")");
    std::vector<std::uint64_t> out64(n);
    std::vector<std::uint64_t> in64(send_counts.begin(), send_counts.end());
    std::vector<std::size_t> bytes(n, sizeof(std::uint64_t));
    do_all_to_all_v(std::as_bytes(std::span(in64)), bytes, std::as_writable_bytes(std::span(out64)),
                    bytes);
    return {out64.begin(), out64.end()};
}

void Communicator::all_reduce(std::span<float> data, ReduceOp op) {
    do_all_reduce(std::as_writable_bytes(data), detail::ElemType::kF32, op);
}
void Communicator::all_reduce(std::span<double> data, ReduceOp op) {
    do_all_reduce(std::as_writable_bytes(data), detail::ElemType::kF64, op);
}
void Communicator::all_reduce(std::span<std::int32_t> data, ReduceOp op) {
    do_all_reduce(std::as_writable_bytes(data), detail::ElemType::kI32, op);
}
void Communicator::all_reduce(std::span<std::int64_t> data, ReduceOp op) {
    do_all_reduce(std::as_writable_bytes(data), detail::ElemType::kI64, op);
}

void Communicator::do_all_reduce(std::span<std::byte> data, detail::ElemType type, ReduceOp op) {
    const int n = size();
    const std::size_t esz = detail::elem_size(type);
    const std::size_t count = data.size() / esz;
    if (n == 1 || count == 0) return;
    // Reduce-scatter: chunk p of my data goes to rank p; I receive my chunk from everyone.
    std::vector<std::size_t> send_counts(n), recv_counts(n), chunk_bytes(n);
    for (int p = 0; p < n; ++p) {
        auto [b, e] = detail::chunk_range(count, n, p);
        chunk_bytes[p] = (e - b) * esz;
    }
    const std::size_t mine = chunk_bytes[rank()];
    std::fill(recv_counts.begin(), recv_counts.end(), mine);
    std::vector<std::byte> gathered(mine * static_cast<std::size_t>(n));
    do_all_to_all_v(data, chunk_bytes, gathered, recv_counts);
    // Reduce in rank order: acc = x_0, then acc = acc op x_p for p = 1..n-1.
    std::vector<std::byte> acc(gathered.begin(),
                               gathered.begin() + static_cast<std::ptrdiff_t>(mine));
    for (int p = 1; p < n; ++p)
        detail::reduce_into(acc.data(), gathered.data() + mine * static_cast<std::size_t>(p),
                            mine / esz, type, op);
    do_all_gather_v(acc, data, chunk_bytes);
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
    require(color >= 0 || color == kUndefinedColor, "split: color ", color,
            " is invalid: expected >= 0 or kUndefinedColor (-1)");
    return do_split(color, key);
}

// ---- windows ----

std::unique_ptr<Window> Communicator::create_window(std::span<std::byte> region) {
    return do_create_window(region);
}

std::unique_ptr<Window> Communicator::do_create_window(std::span<std::byte>) {
    throw Error(detail::concat("the ", backend_name(backend()),
                               " communicator has no one-sided reads (windows)"));
}

Request Window::get(std::span<std::byte> out, int target, int64_t offset) {
    std::byte* const outs[] = {out.data()};
    const int64_t offsets[] = {offset};
    const int64_t sizes[] = {static_cast<int64_t>(out.size())};
    return get_many(outs, offsets, sizes, target);
}

Request Window::get_many(std::span<std::byte* const> outs, std::span<const int64_t> offsets,
                         std::span<const int64_t> sizes, int target) {
    require(outs.size() == offsets.size() && outs.size() == sizes.size(),
            "window get_many: ", outs.size(), " buffers, ", offsets.size(), " offsets and ",
            sizes.size(), " sizes: give one of each per read");
    const int64_t have = region_bytes(target);
    for (size_t i = 0; i < sizes.size(); ++i)
        require(offsets[i] >= 0 && sizes[i] >= 0 && offsets[i] <= have - sizes[i], "window get of ",
                sizes[i], " bytes at offset ", offsets[i], " of rank ", target,
                " lies outside its region of ", have, " bytes");
    return do_get_many(outs, offsets, sizes, target);
}

// ---- helpers shared by the backends ----

namespace detail {

std::size_t elem_size(ElemType type) {
    switch (type) {
        case ElemType::kF32:
            return 4;
        case ElemType::kF64:
            return 8;
        case ElemType::kI32:
            return 4;
        case ElemType::kI64:
            return 8;
    }
    return 1;
}

namespace {
template <typename T>
void reduce_typed(T* __restrict out, const T* __restrict in, std::size_t count, ReduceOp op) {
    switch (op) {
        case ReduceOp::kSum:
            for (std::size_t i = 0; i < count; ++i) out[i] = out[i] + in[i];
            break;
        case ReduceOp::kMax:
            for (std::size_t i = 0; i < count; ++i) out[i] = in[i] > out[i] ? in[i] : out[i];
            break;
        case ReduceOp::kMin:
            for (std::size_t i = 0; i < count; ++i) out[i] = in[i] < out[i] ? in[i] : out[i];
            break;
    }
}
}  // namespace

void reduce_into(void* out, const void* in, std::size_t count, ElemType type, ReduceOp op) {
    switch (type) {
        case ElemType::kF32:
            reduce_typed(static_cast<float*>(out), static_cast<const float*>(in), count, op);
            break;
        case ElemType::kF64:
            reduce_typed(static_cast<double*>(out), static_cast<const double*>(in), count, op);
            break;
        case ElemType::kI32:
            reduce_typed(static_cast<std::int32_t*>(out), static_cast<const std::int32_t*>(in),
                         count, op);
            break;
        case ElemType::kI64:
            reduce_typed(static_cast<std::int64_t*>(out), static_cast<const std::int64_t*>(in),
                         count, op);
            break;
    }
}

std::pair<std::size_t, std::size_t> chunk_range(std::size_t count, int n, int r) {
    const auto nn = static_cast<std::size_t>(n);
    const auto rr = static_cast<std::size_t>(r);
    const std::size_t base = count / nn, extra = count % nn;
    const std::size_t begin = rr * base + std::min(rr, extra);
    return {begin, begin + base + (rr < extra ? 1 : 0)};
}

}  // namespace detail
}  // namespace kvshard
