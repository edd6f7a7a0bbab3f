// The MPI backend of a build without MPI (CMake found no MPI; only this file replaces
// mpi_backend.cpp): asking for it is wrong user input, said as such.
#include <cstdlib>

#include "kvshard/comm/mpi.h"
#include "kvshard/common/error.h"

namespace kvshard {
namespace {

[[noreturn]] void no_mpi() {
    throw Error(
        "this kvshard was built without MPI: use --backend threads (Backend::kThreads), or "
        "install an MPI (e.g. libopenmpi-dev) and rebuild");
}

}  // namespace

void mpi_init(int*, char***) { no_mpi(); }
void mpi_finalize() {}
std::unique_ptr<Communicator> mpi_world() { no_mpi(); }
void mpi_abort(int exit_code) { std::exit(exit_code); }

}  // namespace kvshard
