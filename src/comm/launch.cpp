#include "kvshard/comm/launch.h"

#include <chrono>
#include <cstdio>
#include <thread>

#include "kvshard/comm/mpi.h"
#include "kvshard/comm/threads.h"

namespace kvshard {

void launch(Backend backend, int world_size, const std::function<void(Communicator&)>& fn) {
    if (backend == Backend::kThreads) {
        run_threads(world_size, fn);
        return;
    }
    mpi_init();
    auto world = mpi_world();
    require(world_size <= 0 || world_size == world->size(), "the MPI backend with ", world_size,
            " ranks needs `mpirun -np ", world_size, " ...`, but this job has ", world->size(),
            " process", world->size() == 1 ? "" : "es");
    try {
        fn(*world);
    } catch (const std::exception& e) {
        if (world->size() == 1) throw;
        std::fprintf(stderr, "kvshard: rank %d: error: %s\n", world->rank(), e.what());
        std::fflush(stderr);
        // After a timeout every live rank throws within a poll of the others: let them print
        // their view before the abort ends them.
        if (dynamic_cast<const CommTimeout*>(&e))
            std::this_thread::sleep_for(std::chrono::milliseconds(500));
        mpi_abort(2);
    }
}

}  // namespace kvshard
