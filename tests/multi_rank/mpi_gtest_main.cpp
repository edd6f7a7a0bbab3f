// main() for GoogleTest programs run under mpirun (tests/multi_rank/CMakeLists.txt).
// Rank 0 prints the usual report; other ranks print only their failures, prefixed with their rank.
// The exit status is non-zero on every rank when any rank failed a test.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "kvshard/comm/mpi.h"

namespace {

class FailurePrinter : public testing::EmptyTestEventListener {
  public:
    explicit FailurePrinter(int rank) : rank_(rank) {}
    void OnTestPartResult(const testing::TestPartResult& r) override {
        if (!r.failed()) return;
        const auto* info = testing::UnitTest::GetInstance()->current_test_info();
        std::fprintf(stderr, "[rank %d] FAILED %s.%s at %s:%d\n%s\n", rank_,
                     info ? info->test_suite_name() : "?", info ? info->name() : "?",
                     r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
        std::fflush(stderr);
    }

  private:
    int rank_;
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
