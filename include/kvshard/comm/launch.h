#pragma once
// One entry point for running a rank function under either backend:
//
//   launch(Backend::kThreads, 4, fn);  // 4 threads in this process
//   launch(Backend::kMpi, 4, fn);      // this process is one rank of `mpirun -np 4 prog ...`
//
// The same fn runs in both cases; with MPI each process runs it once, for its own rank.
#include <functional>

#include "kvshard/comm/communicator.h"

namespace kvshard {

// threads: run_threads(world_size, fn) (see threads.h for failure semantics).
// mpi: initializes MPI if needed and calls fn(world) with a communicator over all processes.
//   world_size must equal the number of processes of the mpirun job, or be <= 0 to take it from
//   mpirun; otherwise Error ("needs mpirun -np N"). If fn throws in a job of one process, the
//   exception propagates. In a larger job the other ranks may be blocked in MPI waiting for this
//   one, so the rank prints "kvshard: rank R: error: <what>" to stderr
//   and calls MPI_Abort(2): the whole job exits with a non-zero status.
void launch(Backend backend, int world_size, const std::function<void(Communicator&)>& fn);

}  // namespace kvshard
