// The MPI backend of ProcessGroup (CPU tensors). This header does not include <mpi.h>: code that only
// uses ProcessGroup builds the same with and without MPI.
//
// Note [Failing ranks], Note [Collective timeouts] and Note [MPI progress], the design of how this
// backend brings a job down instead of hanging and how its collectives progress, are in this
// folder's README.md.
#pragma once

#include <memory>
#include <string>

#include "booster/distributed/process_group.h"

namespace booster::distributed {

// True when booster was built with MPI (BOOSTER_WITH_MPI).
bool mpi_built();
// Initializes MPI (once per process) and returns a group over MPI_COMM_WORLD. ConfigError when the
// build has no MPI; DistributedError when MPI cannot start or was already finalized.
std::shared_ptr<ProcessGroup> make_mpi_process_group();
// Initializes MPI once per process with what Note [Failing ranks] (README.md) installs (error handler, terminate
// handler, finalize or abort at exit). If the application initialized MPI itself, booster leaves its
// finalization to it. ConfigError without MPI in the build; DistributedError when MPI cannot start.
void ensure_mpi_initialized();
// Finalizes MPI now, for a process whose ranks all agreed to stop (an interrupted run that saved, Note
// [Stopping on a signal]): its non-zero exit status then reaches the launcher instead of aborting the job
// (Note [Failing ranks]). Collective. No-op when booster did not initialize MPI or it is finalized.
void finalize_mpi_for_agreed_exit();
// This rank among the ranks on its node (those that share memory with it) and how many there are.
// Initializes MPI; ConfigError without MPI in the build.
struct NodeRanks {
  int rank = 0, size = 1;
};
NodeRanks mpi_node_ranks();
// The thread support MPI provided: "single", "funneled", "serialized", "multiple"; "none" before MPI
// is initialized by booster.
std::string mpi_thread_support();

}  // namespace booster::distributed
