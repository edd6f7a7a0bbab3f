#pragma once
// The MPI backend (OpenMPI): ranks are processes started by mpirun (or one process without it).
// No MPI header here: the implementation keeps MPI_Comm behind the Communicator interface.
//
// Threading: MPI is initialized with MPI_THREAD_FUNNELED; only the thread that called mpi_init()
// may use MPI communicators (threads-backend worlds inside an MPI process are fine: they never
// call MPI).
#include <memory>

#include "kvshard/comm/communicator.h"

namespace kvshard {

// Initializes MPI unless it already is (idempotent) and arranges mpi_finalize() at exit.
void mpi_init(int* argc = nullptr, char*** argv = nullptr);
// Finalizes MPI if this library initialized it and it is not finalized yet (idempotent). No MPI
// communicator may be used afterwards.
void mpi_finalize();
// True when this process was started by mpirun/mpiexec (from the launcher's environment, without
// initializing MPI).
bool under_mpirun();
// The job size mpirun announced in the environment; 1 when not under mpirun.
int mpirun_world_size();
// The processes of the job on this host (OMPI_COMM_WORLD_LOCAL_SIZE or MPI_LOCALNRANKS); 1 when
// not under mpirun or not announced.
int mpirun_local_size();

// A communicator over all processes (a duplicate of MPI_COMM_WORLD, so its traffic never mixes
// with other users of MPI_COMM_WORLD). Calls mpi_init() if needed. Collective over all processes.
std::unique_ptr<Communicator> mpi_world();

// Ends every process of the job with `exit_code` (MPI_Abort on MPI_COMM_WORLD); without MPI
// initialized, std::exit(exit_code).
[[noreturn]] void mpi_abort(int exit_code);

// RAII for a main(): initializes MPI in the constructor, finalizes in the destructor.
class MpiSession {
  public:
    MpiSession(int* argc, char*** argv) { mpi_init(argc, argv); }
    ~MpiSession() { mpi_finalize(); }
    MpiSession(const MpiSession&) = delete;
    MpiSession& operator=(const MpiSession&) = delete;
};

}  // namespace kvshard
