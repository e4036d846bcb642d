// The CUDA entry points of a build without the CUDA backend: nothing is available, and say why.
#if !defined(BOOSTER_WITH_CUDA)
#include "booster/backends/cuda/cuda.h"
#include "booster/backends/cuda/device_id.h"
#include "booster/backends/cuda/pinned.h"

#include <cstdlib>

namespace booster::cuda {

bool is_compiled() { return false; }
int device_count() { return 0; }
std::string unavailable_reason() { return "this build has no CUDA backend (nvcc was not found at configure time)"; }
std::string device_name(int) { return ""; }
void synchronize(int) {}
void* stream_handle(int) { return nullptr; }
void* host_alloc_pinned(size_t nbytes) { return std::malloc(nbytes == 0 ? 1 : nbytes); }
void host_free_pinned(void* p) { std::free(p); }
std::string pci_bus_id(int) { return ""; }
size_t bytes_in_use() { return 0; }
size_t peak_bytes() { return 0; }
void reset_peak_bytes() {}
size_t cached_bytes() { return 0; }
size_t reserved_bytes() { return 0; }
size_t peak_reserved_bytes() { return 0; }
std::string profile_report() { return ""; }
void reset_profile() {}
void set_allow_tf32(bool) {}
bool allow_tf32() { return false; }
int64_t float8_gemm_count() { return 0; }

}  // namespace booster::cuda
#endif
