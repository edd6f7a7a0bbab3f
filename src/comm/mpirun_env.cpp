// What mpirun says in the environment: needs no MPI library, so a threads-only build has it too.
#include <cstdlib>

#include "kvshard/comm/mpi.h"

namespace kvshard {

bool under_mpirun() {
    for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
        if (std::getenv(v)) return true;
    return false;
}

int mpirun_world_size() {
    for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
        if (const char* s = std::getenv(v)) return std::atoi(s);
    return 1;
}

int mpirun_local_size() {
    for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
        if (const char* s = std::getenv(v)) {
            const int n = std::atoi(s);
            if (n >= 1) return n;
        }
    return 1;
}

}  // namespace kvshard
