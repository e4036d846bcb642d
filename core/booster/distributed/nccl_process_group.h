// NcclProcessGroup: collectives on CUDA tensors through NCCL, behind the ProcessGroup interface.
//
// Note [NCCL process group]
// * Bootstrap: under an MPI launcher rank and size come from MPI_COMM_WORLD (MPI initialized once by
//   booster, ensure_mpi_initialized, so it can serve an mpi group beside this one), rank 0 makes the
//   ncclUniqueId and MPI broadcasts it; otherwise the group is the world of one process. Each rank
//   uses GPU rank % device_count(). Under a launcher without MPI in the build: ConfigError (each rank
//   would silently make a world of its own). Without an MPI launcher, a world size over 1 in the
//   environment (torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or BOOSTER_RANK/BOOSTER_WORLD_SIZE) makes the
//   group from those, with the id handed out through BOOSTER_NCCL_ID_FILE or MASTER_ADDR/MASTER_PORT
//   (rendezvous.h, Note [Rendezvous without MPI]), and GPU LOCAL_RANK % device_count(); when such a job
//   has its tcp CPU group (the default group "auto" makes there), rank 0's id travels through it instead.
// * Stream order: collectives are queued on the CUDA backend's stream of that GPU, the stream every
//   kernel and copy of the backend uses, so they run after the kernels that produced their buffers (a
//   gradient bucket) and before everything queued later, without any host sync. Blocking forms
//   return once queued, Work::wait() orders the backend's stream after the collective (a no-op while
//   everything shares that stream) and checks NCCL's asynchronous error, is_completed() asks the GPU
//   (cudaEventQuery, which any thread may call). What that lets a caller read, and when other CUDA
//   code must synchronize first: Note [When a collective's result is there] in process_group.h.
//   Nothing of this group needs polling: NCCL progresses on the GPU by itself. barrier() does block
//   the host until every rank has reached it (it guards file writes), polling the stream with back-off.
// * Timeouts: a watchdog thread ends the job when a collective has not finished on the GPU within the
//   group's timeout (Note [Collective timeouts], "nccl", in distributed/README.md).
// * Avg is NCCL's ncclAvg, which multiplies by 1/N before summing (Note [Averages divide first]);
//   float16/bfloat16 reduce in NCCL's own precision (pairwise in float32).
// * A failed NCCL call throws DistributedError naming the call, NCCL's error string and file:line.
#pragma once

#include <memory>

#include "booster/distributed/process_group.h"

namespace booster::distributed {

// True when this build has NCCL (BOOSTER_WITH_NCCL).
bool nccl_built();
// A new NCCL group (see the Note): a communicator over every rank, so every rank must call it. Library
// code takes the process's one NCCL group from process_group_for(cuda) or init_process_group("nccl")
// instead (Note [A group per device]). ConfigError without NCCL in the build, without a GPU, or under
// an MPI launcher without MPI in the build; each message says what is missing. `bootstrap`, when not
// null, is a CPU group over the same ranks (tcp) that hands rank 0's unique id to the others.
std::shared_ptr<ProcessGroup> make_nccl_process_group(ProcessGroup* bootstrap = nullptr);

}  // namespace booster::distributed
