// MPI backend (docs/comm.md, "MPI backend"): Communicator over an MPI_Comm.
//
// Point to point maps to MPI_Send/Recv/Isend/Irecv on MPI_BYTE; a message over kMaxChunk bytes is
// sent as consecutive chunks with the same tag (MPI keeps them in order), because MPI counts are
// ints. Collectives map to MPI_Barrier/Bcast/Allgather/Allgatherv/Alltoallv. all_reduce keeps the
// base class's deterministic algorithm (rank-order sums), never MPI_Allreduce, so results are
// bit-identical to the threads backend. Errors are returned (MPI_ERRORS_RETURN) and thrown as
// kvshard::Error.
#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>

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

class MpiRequest final : public detail::RequestImpl {
  public:
    // expected[i]: the byte count chunk i must have (receives); empty for sends.
    MpiRequest(std::vector<MPI_Request> reqs, std::vector<int> expected, int peer, int tag)
        : reqs_(std::move(reqs)), expected_(std::move(expected)), peer_(peer), tag_(tag) {}

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
        const int rc = MPI_Waitall(static_cast<int>(reqs_.size()), reqs_.data(), st.data());
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
};

class MpiCommunicator final : public Communicator {
  public:
    // Takes ownership of `comm` (freed in the destructor).
    explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
        check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "Comm_set_errhandler");
        check_mpi(MPI_Comm_rank(comm_, &rank_), "Comm_rank");
        check_mpi(MPI_Comm_size(comm_, &size_), "Comm_size");
    }
    ~MpiCommunicator() override {
        if (!mpi_is_finalized()) MPI_Comm_free(&comm_);
    }

    int rank() const override { return rank_; }
    int size() const override { return size_; }
    Backend backend() const override { return Backend::kMpi; }

  protected:
    void do_send(std::span<const std::byte> data, int dest, int tag) override {
        for (std::size_t c = 0; c < num_chunks(data.size()); ++c)
            check_mpi(MPI_Send(data.data() + c * kMaxChunk, chunk_len(data.size(), c), MPI_BYTE,
                               dest, tag, comm_),
                      "Send");
    }

    void do_recv(std::span<std::byte> data, int source, int tag) override {
        for (std::size_t c = 0; c < num_chunks(data.size()); ++c) {
            const int want = chunk_len(data.size(), c);
            MPI_Status st;
            const int rc =
                MPI_Recv(data.data() + c * kMaxChunk, want, MPI_BYTE, source, tag, comm_, &st);
            if (rc == MPI_ERR_TRUNCATE)
                throw Error(detail::concat("recv of ", data.size(), " bytes from rank ", source,
                                           " tag ", tag,
                                           " matched a larger message: receive "
                                           "buffers must have the exact message size"));
            check_mpi(rc, "Recv");
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
        check_mpi(MPI_Probe(source, tag, comm_, &st), "Probe");
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
            std::make_unique<MpiRequest>(std::move(reqs), std::vector<int>{}, dest, tag));
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
            std::make_unique<MpiRequest>(std::move(reqs), std::move(expected), source, tag));
    }

    void do_barrier() override { check_mpi(MPI_Barrier(comm_), "Barrier"); }

    void do_broadcast(std::span<std::byte> data, int root) override {
        check_mpi(
            MPI_Bcast(data.data(), to_int_count(data.size(), "broadcast"), MPI_BYTE, root, comm_),
            "Bcast");
    }

    void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv) override {
        to_int_count(recv.size(), "all_gather");
        const int n = to_int_count(send.size(), "all_gather");
        check_mpi(MPI_Allgather(send.data(), n, MPI_BYTE, recv.data(), n, MPI_BYTE, comm_),
                  "Allgather");
    }

    void do_all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                         std::span<const std::size_t> recv_counts) override {
        to_int_count(recv.size(), "all_gather_v");
        std::vector<int> counts(size_), displs(size_);
        int off = 0;
        for (int p = 0; p < size_; ++p) {
            counts[p] = static_cast<int>(recv_counts[p]);
            displs[p] = off;
            off += counts[p];
        }
        check_mpi(MPI_Allgatherv(send.data(), static_cast<int>(send.size()), MPI_BYTE, recv.data(),
                                 counts.data(), displs.data(), MPI_BYTE, comm_),
                  "Allgatherv");
    }

    void do_all_to_all_v(std::span<const std::byte> send, std::span<const std::size_t> send_counts,
                         std::span<std::byte> recv,
                         std::span<const std::size_t> recv_counts) override {
        to_int_count(send.size(), "all_to_all_v");
        to_int_count(recv.size(), "all_to_all_v");
        std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
        int so = 0, ro = 0;
        for (int p = 0; p < size_; ++p) {
            sc[p] = static_cast<int>(send_counts[p]);
            rc[p] = static_cast<int>(recv_counts[p]);
            sd[p] = so;
            rd[p] = ro;
            so += sc[p];
            ro += rc[p];
        }
        const int r = MPI_Alltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, recv.data(),
                                    rc.data(), rd.data(), MPI_BYTE, comm_);
        if (r == MPI_ERR_TRUNCATE)
            throw Error(
                "all_to_all_v: a peer sent more bytes than recv_counts allows (recv_counts[p] "
                "must equal peer p's send_counts[rank()])");
        check_mpi(r, "Alltoallv");
    }

    std::unique_ptr<Communicator> do_split(int color, int key) override {
        MPI_Comm out = MPI_COMM_NULL;
        check_mpi(
            MPI_Comm_split(comm_, color == kUndefinedColor ? MPI_UNDEFINED : color, key, &out),
            "Comm_split");
        if (out == MPI_COMM_NULL) return nullptr;
        return std::make_unique<MpiCommunicator>(out);
    }

  private:
    MPI_Comm comm_;
    int rank_ = 0, size_ = 1;
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
    if (g_we_initialized && mpi_is_initialized() && !mpi_is_finalized()) MPI_Finalize();
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
