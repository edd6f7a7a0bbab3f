// main() for GoogleTest programs run under mpirun (tests/multi_rank/CMakeLists.txt).
// Rank 0 prints the usual report; other ranks print only their failures, prefixed with their rank.
// The exit status is non-zero on every rank when any rank failed a test.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

#include "kvshard/comm/mpi.h"

namespace {

class FailurePrinter : public testing::EmptyTestEventListener {
  public:
    explicit FailurePrinter(int rank) : rank_(rank) {}
    // The test's name is remembered here: OnTestPartResult runs while GoogleTest holds the lock
    // that UnitTest::current_test_info() takes, so asking for it there deadlocks.
    void OnTestStart(const testing::TestInfo& info) override {
        current_ = std::string(info.test_suite_name()) + "." + info.name();
    }
    void OnTestPartResult(const testing::TestPartResult& r) override {
        if (!r.failed()) return;
        std::fprintf(stderr, "[rank %d] FAILED %s at %s:%d\n%s\n", rank_,
                     current_.empty() ? "?" : current_.c_str(), r.file_name() ? r.file_name() : "?",
                     r.line_number(), r.message());
        std::fflush(stderr);
    }

  private:
    int rank_;
    std::string current_;
};

}  // namespace

int main(int argc, char** argv) {
    kvshard::MpiSession mpi(&argc, &argv);
    testing::InitGoogleTest(&argc, argv);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank != 0) {
        auto& listeners = testing::UnitTest::GetInstance()->listeners();
        delete listeners.Release(listeners.default_result_printer());
        listeners.Append(new FailurePrinter(rank));
    }
    int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
    int any_failed = 0;
    MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0 && any_failed && !failed) std::fprintf(stderr, "a test failed on another rank\n");
    return any_failed;
}
