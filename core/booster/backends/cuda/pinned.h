// Page-locked host memory (cudaHostAlloc), which copies to and from a GPU at full speed: the staging
// buffers of collectives that run on the host (Note [Staged collectives] in distributed/README.md).
#pragma once

#include <cstddef>

namespace booster::cuda {

// CudaError when it cannot be had; without CUDA compiled in, plain host memory.
void* host_alloc_pinned(size_t nbytes);
// host_free_pinned(nullptr) does nothing.
void host_free_pinned(void* p);

}  // namespace booster::cuda
