// The MPI backend of ProcessGroup (CPU tensors). This header does not include <mpi.h>: code that only
// uses ProcessGroup builds the same with and without MPI.
//
// Note [Failing ranks]
// A rank that stops while the others sit in a collective must bring the job down, not leave it hanging.
// Once booster has initialized MPI (for the mpi backend, or for the NCCL group's bootstrap):
//  * every MPI call returns its error (MPI_ERRORS_RETURN) and we throw DistributedError naming the
//    collective, the MPI call and MPI's error string;
//  * std::terminate (an uncaught exception, in main or in any thread; a throwing destructor or noexcept
//    function) prints the exception on stderr with the rank and calls MPI_Abort: mpirun then kills every
//    rank and exits non-zero;
//  * exit() or a return from main with a non-zero status prints the status with the rank and calls
//    MPI_Abort with that status instead of MPI_Finalize (MPI_Finalize would wait for ranks that may be
//    blocked in a collective this rank will never join). Status 0 finalizes normally;
//  * a rank killed by a signal is seen by mpirun itself, which kills the others.
// What we cannot detect: a rank that returns 0 from main while the others still expect a collective
// from it (a program whose ranks disagree on the collectives); they wait, as with torch.distributed.
// ProcessGroup::abort(code, why) is the explicit way out for code that wants to stop the job.
//
// Note [MPI progress]
// Non-blocking forms are MPI_Iallreduce / MPI_Ibcast / MPI_Iallgather / MPI_Ireduce_scatter_block.
// OpenMPI (shared memory and TCP) has no progress thread: a started collective advances only while
// this rank is inside an MPI call. Code that overlaps compute with a collective should call
// Work::is_completed() now and then (it is a cheap MPI_Testall), or the collective does most of its
// work in wait(). OpenMPI's non-blocking all-reduce (libnbc) picks a binomial reduce + broadcast for
// in-place buffers, which measured twice slower than the blocking call on 25 MiB (2 ranks); unless the
// user set it, we ask for Rabenseifner's reduce-scatter + all-gather instead
// (OMPI_MCA_coll_libnbc_iallreduce_algorithm=3, set before MPI_Init), which matches the blocking call.
// If the data-parallel plugin needs more overlap than polling gives, the alternative is the one
// torch.distributed's MPI backend takes: one worker thread per group running the blocking calls in
// issue order.
//
// MPI is initialized once per process (ensure_mpi_initialized, also called by the NCCL group's
// bootstrap, Note [A group per device]) with MPI_Init_thread asking for MPI_THREAD_MULTIPLE; when the
// library provides less, every MPI call of this backend is serialized by one mutex (collectives may
// then still be started from any thread, one at a time). MPI is finalized at exit when we initialized
// it. Outside mpirun, "mpi" still works as a singleton (size 1) through OpenMPI's singleton init, but
// "auto" picks "local" there so single-process runs never touch MPI.
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
// Initializes MPI once per process with what Note [Failing ranks] installs (error handler, terminate
// handler, finalize or abort at exit). If the application initialized MPI itself, booster leaves its
// finalization to it. ConfigError without MPI in the build; DistributedError when MPI cannot start.
void ensure_mpi_initialized();
// Finalizes MPI now, for a process whose ranks all agreed to stop (an interrupted run that saved, Note
// [Stopping on a signal]): its non-zero exit status then reaches the launcher instead of aborting the job
// (Note [Failing ranks]). Collective. No-op when booster did not initialize MPI or it is finalized.
void finalize_mpi_for_agreed_exit();
// The thread support MPI provided: "single", "funneled", "serialized", "multiple"; "none" before MPI
// is initialized by booster.
std::string mpi_thread_support();

}  // namespace booster::distributed
