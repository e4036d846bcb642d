// StagedProcessGroup: collectives and point-to-point on CUDA tensors through a host group (mpi or tcp), each
// buffer copied through page-locked host memory: how ranks that share one GPU communicate, since NCCL
// refuses two ranks on one device (PyTorch's Gloo backend serves CUDA tensors the same way).
// Note [Staged collectives] in this folder's README.md.
#pragma once

#include <memory>

#include "booster/distributed/process_group.h"

namespace booster::distributed {

// A group over the ranks of `host` (a CPU group of its own: the staged group sets its timeout) whose
// buffers live on `device` (a GPU): backend "mpi (staged)", device() `device`. Its subgroups (split)
// are staged alike.
std::shared_ptr<ProcessGroup> make_staged_process_group(std::shared_ptr<ProcessGroup> host, Device device);

}  // namespace booster::distributed
