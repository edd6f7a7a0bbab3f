#pragma once
// The threads backend: ranks are std::threads of this process (the default backend).
#include <functional>

#include "kvshard/comm/communicator.h"

namespace kvshard {

// Runs fn(comm) on `world` ranks, one std::thread each, and returns when every rank returned.
// comm.rank() is 0..world-1, comm.size() == world, comm.backend() == Backend::kThreads.
//
// Failure: the first exception thrown out of fn by any rank (first in time) is rethrown here, as
// is, after all threads have stopped. As soon as one rank throws, the run is aborted: every
// communicator operation that is blocked or started afterwards on the other ranks throws
// CommAborted ("... rank R failed: <what>"), so no rank is left waiting. A deadlock (every rank
// still running is blocked on an operation that no running rank can complete, e.g. a recv from a
// rank that already returned) also aborts the run with a CommAborted that names what each rank
// waits for.
//
// Messages are handed over without an intermediate buffer: a send completes when the receiver's
// buffer has been filled (one memcpy per message, done by whichever side arrives second).
void run_threads(int world, const std::function<void(Communicator&)>& fn);

}  // namespace kvshard
