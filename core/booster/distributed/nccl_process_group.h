// NcclProcessGroup: collectives on CUDA tensors through NCCL, behind the ProcessGroup interface.
//
// Note [NCCL process group]
// * Bootstrap: under an MPI launcher rank and size come from MPI_COMM_WORLD (MPI initialized once by
//   booster, ensure_mpi_initialized, so it can serve an mpi group beside this one), rank 0 makes the
//   ncclUniqueId and MPI broadcasts it; otherwise the group is the world of one process. Each rank
//   uses GPU rank % device_count(). Under a launcher without MPI in the build: ConfigError (each rank
//   would silently make a world of its own).
// * Stream order: collectives are queued on the CUDA backend's stream of that GPU, the stream every
//   kernel and copy of the backend uses, so they run after the kernels that produced their buffers (a
//   gradient bucket) and before everything queued later, without any host sync. So the result is in
//   the buffers for every later reader (kernels, and copies to the host, which synchronize) as soon as
//   a collective is queued: blocking forms return without waiting for the GPU, and Work::wait() only
//   orders the backend's stream after the collective (a no-op while everything shares that stream);
//   is_completed() asks the GPU (cudaEventQuery, which any thread may call). Nothing of this group
//   needs polling: NCCL progresses on the GPU by itself. barrier() does block the host until every
//   rank has reached it (it guards file writes).
// * Avg is NCCL's ncclAvg, which multiplies by 1/N before summing (Note [Averages divide first]);
//   float16/bfloat16 reduce in NCCL's own precision (pairwise in float32).
// * A failed NCCL call throws DistributedError naming the call, NCCL's error string and file:line.
#pragma once

#include <memory>

#include "booster/distributed/process_group.h"

namespace booster::distributed {

// True when this build has NCCL (BOOSTER_WITH_NCCL).
bool nccl_built();
// The NCCL group of this process (see the Note). ConfigError without NCCL in the build or without a
// GPU.
std::shared_ptr<ProcessGroup> make_nccl_process_group();

}  // namespace booster::distributed
