// NcclProcessGroup: collectives on CUDA tensors through NCCL, behind the ProcessGroup interface.
//
// Note [NCCL process group]
// * Bootstrap: under an MPI launcher (and with MPI in the build) rank and size come from
//   MPI_COMM_WORLD, rank 0 makes the ncclUniqueId and MPI broadcasts it; otherwise the group is the
//   world of one process. Each rank uses GPU rank % device_count().
// * Collectives are queued on the CUDA backend's stream of that GPU, so they are ordered after the
//   kernels that produced the buffers (a gradient bucket) without any host sync. Blocking forms then
//   wait for the stream; async forms record an event that Work::wait() waits for.
// * Avg is NCCL's ncclAvg; float16/bfloat16 reduce in NCCL's own precision (pairwise in float32).
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
