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
// What we cannot tell from a failure: a rank that returns 0 from main while the others still expect a
// collective from it (a program whose ranks disagree on the collectives); they wait until the
// collective's timeout (Note [Collective timeouts]). A rank that is alive but stalled is not seen by
// mpirun either: the timeout is what ends that job. ProcessGroup::abort(code, why) is the explicit way
// out for code that wants to stop the job.
//
// Note [Collective timeouts]
// A rank stopped (SIGSTOP, a debugger), deadlocked or looping forever leaves the others inside their
// next collective; MPI would let them wait for ever. So every collective of the mpi backend, blocking
// forms included, is started non-blocking (MPI_Iallreduce, MPI_Ibcast, MPI_Iallgather,
// MPI_Ireduce_scatter_block, MPI_Ibarrier) and waited for by one loop with a deadline: the start of the
// collective plus the group's timeout() (default 1800 s as torch's; ProcessGroup::set_timeout,
// set_default_collective_timeout, which `booster train` calls with train.collective_timeout_s, or
// BOOSTER_COLLECTIVE_TIMEOUT_S). A Work started earlier counts from its start, as torch's does.
// * Waiting does not hold a core for long: OpenMPI moves data only inside MPI calls (Note [MPI
//   progress]), so the loop polls MPI_Testall back to back while the data could still be moving (100 us
//   plus 1 ns per byte, i.e. 1 GB/s), then sleeps between polls, each sleep twice the last, from 10 us
//   up to 250 us. A rank waiting for a late one thus uses a few percent of a core instead of all of it
//   (MPI_Waitall spins inside OpenMPI; on a machine with fewer cores than ranks that spinning also slows
//   the ranks doing the work). Sleeping from the start would not do: each protocol step of a
//   collective then waits for the next poll, and a 1 MB all-reduce took 5 times as long. Once the loop
//   sleeps, a late rank's arrival is noticed within 250 us, and each later step as well.
// * At the deadline, MPI cannot say who is missing, so the ranks take a census. Each group keeps a
//   sequence number: its collectives are numbered 1, 2, ... in the order this rank started them, the
//   same on every rank (they must start the same collectives in the same order). The rank that timed
//   out sends a query, {collectives it started, the one it waits for}, to every other rank on a
//   communicator of the census's own (so it never matches a collective), and listens for a grace
//   period of min(2 s, the timeout), or until every rank answered. A rank inside the wait loop of this
//   group answers a query with its own record between two sleeps; a rank that timed out too has sent
//   its query to everyone, which counts as its answer. A rank that started the collective (its count
//   reaches the sequence number) arrived; one that answered with a lower count is waiting in an earlier
//   collective (the ranks disagree on the collectives: the message names what it waits for); one that
//   did not answer is stopped, hung, or busy outside collectives. If every rank arrived, the collective
//   itself is stuck (a rank stopped making progress inside it, or the network failed), and the message
//   says so.
// * Then the rank throws DistributedError: "all_reduce on group "world" (2 ranks) timed out after
//   3.0 s on rank 0: rank 1 did not arrive (no answer ...); rank 0 waited; ...", with the sequence
//   number and how to raise the timeout. Uncaught, it ends the job through Note [Failing ranks]
//   (mpirun kills the stalled rank too, stopped or not). The group is unusable afterwards: its
//   collectives throw at once, and a process that had a timeout aborts the job at exit even with status
//   0, since MPI_Finalize would wait for the missing rank.
// * Every rank still waiting times out by itself at its own deadline; it does not wait for the one that
//   reported first. Ranks that are not in a collective learn of it when mpirun ends the job.
// * "nccl" (nccl_process_group.cpp): a collective is queued on the GPU and the host rarely waits for it
//   in the group (Note [When a collective's result is there]); it blocks later, in whatever CUDA call
//   synchronizes, which cannot time out. So, as torch's NCCL watchdog, a thread of the group records an
//   event after each collective and looks every 100 ms at the oldest unfinished one: past its deadline,
//   it takes the census (on MPI_COMM_WORLD's ranks, when an MPI launcher started the job and MPI gives
//   MPI_THREAD_MULTIPLE; else the message says the missing ranks are unknown), prints the same message,
//   calls ncclCommAbort and ends the job (MPI_Abort, or exit 1 without MPI): a thread blocked in a
//   synchronization cannot be handed an exception. The watchdog also answers other ranks' census
//   queries, with the number of collectives this rank queued. barrier(), which blocks the host, polls
//   the stream with the back-off above and throws the DistributedError itself at its deadline. This
//   path is compiled in CI but has not run on GPUs yet.
//
// Note [MPI progress]
// Collectives are MPI_Iallreduce / MPI_Ibcast / MPI_Iallgather / MPI_Ireduce_scatter_block / MPI_Ibarrier,
// blocking forms included, which wait at once (Note [Collective timeouts]).
// OpenMPI (shared memory and TCP) has no progress thread: a started collective advances only while
// this rank is inside an MPI call. Code that overlaps compute with a collective should call
// Work::is_completed() now and then (it is a cheap MPI_Testall), or the collective does most of its
// work in wait(). OpenMPI's non-blocking all-reduce (libnbc) picks a binomial reduce + broadcast for
// in-place buffers, which measured twice slower than MPI_Allreduce on 25 MiB (2 ranks); unless the
// user set it, we ask for Rabenseifner's reduce-scatter + all-gather instead
// (OMPI_MCA_coll_libnbc_iallreduce_algorithm=3, set before MPI_Init), which matches MPI_Allreduce.
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
