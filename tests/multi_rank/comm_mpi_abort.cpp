// launch(kMpi) when one rank throws: the job must end (MPI_Abort) instead of hanging rank 0 in a
// barrier, and the failing rank must say why. CTest checks the message (PASS_REGULAR_EXPRESSION).
#include <cstdio>

#include "kvshard/comm/launch.h"

int main() {
    kvshard::launch(kvshard::Backend::kMpi, 0, [](kvshard::Communicator& c) {
        if (c.rank() == 1) throw kvshard::Error("deliberate failure on rank 1");
        c.barrier();  // rank 0 waits here for a rank that will never come
    });
    std::printf("not reached: the job should have been aborted\n");
    return 0;
}
