// The CUDA runtime layer: checked-call errors, one stream and one cuBLAS handle per device, the
// caching allocator, and the availability queries of cuda.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <map>
#include <mutex>
#include <vector>

#include "booster/backends/cuda/common.cuh"
#include "booster/backends/cuda/device_id.h"
#include "booster/backends/cuda/pinned.h"

namespace booster::cuda {

void throw_cuda_error(const char* call, cudaError_t err, const char* file, int line) {
  throw CudaError(str(call, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") at ", file, ":",
                      line));
}

void throw_cublas_error(const char* call, cublasStatus_t st, const char* file, int line) {
  throw CudaError(str(call, " failed: ", cublasGetStatusName(st), " (", cublasGetStatusString(st), ") at ", file,
                      ":", line));
}

namespace {

constexpr int kMaxDevices = 16;

struct DeviceState {
  std::once_flag once;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  cublasLtHandle_t cublaslt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int sms = 0;
  std::atomic<bool> started{false};  // the stream exists (for synchronize_started)
};

DeviceState* state_storage() {
  static DeviceState* states = new DeviceState[kMaxDevices];  // never destroyed (static destruction order)
  return states;
}

DeviceState& state(int device) {
  DeviceState* states = state_storage();
  BOOSTER_CHECK(device >= 0 && device < std::min(device_count(), kMaxDevices), DeviceError, "cuda:", device,
                " does not exist: ", device_count(), " CUDA device(s) visible");
  DeviceState& s = states[device];
  std::call_once(s.once, [&] {
    // The stream and the cuBLAS handles belong to the device current when they are made. The
    // caller's current device is restored afterwards when the backend already uses it: setting a
    // device initializes its context (CUDA 12+), so an unused device 0 is not touched (Note [CUDA
    // device routing]); launches never rely on the restore, since device_of sets the device.
    int previous = 0;
    BOOSTER_CUDA_CHECK(cudaGetDevice(&previous));
    BOOSTER_CUDA_CHECK(cudaSetDevice(device));
    BOOSTER_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    BOOSTER_CUBLAS_CHECK(cublasCreate(&s.cublas));
    BOOSTER_CUBLAS_CHECK(cublasSetStream(s.cublas, s.stream));
    BOOSTER_CUBLAS_CHECK(cublasLtCreate(&s.cublaslt));
    BOOSTER_CUDA_CHECK(cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, device));
    if (previous != device && previous < kMaxDevices && states[previous].started.load())
      BOOSTER_CUDA_CHECK(cudaSetDevice(previous));
    s.started = true;
  });
  return s;
}

// Whether device's stream exists already (without creating it).
bool state_started(int device) { return state_storage()[device].started.load(); }

std::atomic<bool> g_allow_tf32{false};

}  // namespace

// Note [CUDA device routing]
// A process may drive several GPUs (one per thread, or one after another), and code outside the
// backend (NCCL, a user's own CUDA) may change the current device. So nothing here trusts a cached
// idea of the current device: every kernel family starts with device_of(tensor), which makes the
// tensor's device current (cudaGetDevice is a cheap host-side read; cudaSetDevice runs only on a
// change), then launches on stream(that device), sizes grids by that device's SM count, and
// allocates its temporaries on the tensor's device; no launch asks for another device's state, so
// the launches of a rank whose tensors are on GPU 1 create no context on GPU 0. Creating a device's state
// hands the current device back to the caller where the backend already uses that one. The
// allocator routes copies and memsets by the device that owns the pointer, not the current device.
void set_device(int device) {
  int current = -1;
  BOOSTER_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) BOOSTER_CUDA_CHECK(cudaSetDevice(device));
}

void synchronize_started() {
  for (int d = 0; d < std::min(device_count(), kMaxDevices); ++d)
    if (state_started(d)) BOOSTER_CUDA_CHECK(cudaStreamSynchronize(stream(d)));
}

cudaStream_t stream(int device) { return state(device).stream; }
cublasHandle_t cublas_handle(int device) { return state(device).cublas; }
cublasLtHandle_t cublaslt_handle(int device) { return state(device).cublaslt; }
int sm_count(int device) { return state(device).sms; }

void* cublas_workspace(int device, size_t& bytes) {
  DeviceState& s = state(device);
  if (s.workspace_bytes < bytes) {
    if (s.workspace) BOOSTER_CUDA_CHECK(cudaFreeAsync(s.workspace, s.stream));
    BOOSTER_CUDA_CHECK(cudaMallocAsync(&s.workspace, bytes, s.stream));
    s.workspace_bytes = bytes;
  }
  bytes = s.workspace_bytes;
  return s.workspace;
}

bool is_compiled() { return true; }

int device_count() {
  // Asked once: without a driver cudaGetDeviceCount fails, and that means "no GPU", not an error.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
}

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  if (err != cudaSuccess) return str("no usable CUDA device: cudaGetDeviceCount says ", cudaGetErrorName(err), " (",
                                     cudaGetErrorString(err), ")");
  if (n == 0) return "no CUDA device found";
  return "";
}

std::string device_name(int index) {
  if (index < 0 || index >= device_count()) return "";
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, index) != cudaSuccess) return "";
  return p.name;
}

void* stream_handle(int index) {
  set_device(index);
  return stream(index);
}

void synchronize(int index) {
  if (device_count() == 0) return;
  BOOSTER_CUDA_CHECK(cudaStreamSynchronize(stream(index)));
}

void* host_alloc_pinned(size_t nbytes) {
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, nbytes == 0 ? 1 : nbytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    BOOSTER_FAIL(CudaError, "cannot allocate ", nbytes, " bytes of pinned host memory: cudaHostAlloc says ",
                 cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  }
  return p;
}

void host_free_pinned(void* p) {
  if (p) (void)cudaFreeHost(p);
}

std::string pci_bus_id(int index) {
  if (index < 0 || index >= device_count()) return "";
  char id[64] = {};
  if (cudaDeviceGetPCIBusId(id, int(sizeof id), index) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  return id;
}

namespace {
std::mutex g_profile_mu;
std::map<std::string, std::pair<double, int64_t>> g_profile;  // family -> (seconds, calls)
}  // namespace

bool profiling() {
  static const bool on = [] {
    const char* v = std::getenv("BOOSTER_CUDA_PROFILE");
    return v && *v && std::string(v) != "0";
  }();
  return on;
}

double profile_clock() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void profile_add(const char* family, double seconds) {
  std::lock_guard<std::mutex> lock(g_profile_mu);
  auto& e = g_profile[family];
  e.first += seconds;
  e.second += 1;
}

std::string profile_report() {
  std::lock_guard<std::mutex> lock(g_profile_mu);
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> rows(g_profile.begin(), g_profile.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  std::string out;
  for (const auto& [name, v] : rows) {
    char line[160];
    std::snprintf(line, sizeof line, "%-32s %10.3f ms %8lld calls\n", name.c_str(), v.first * 1e3, (long long)v.second);
    out += line;
  }
  return out;
}

void reset_profile() {
  std::lock_guard<std::mutex> lock(g_profile_mu);
  g_profile.clear();
}

void set_allow_tf32(bool allow) { g_allow_tf32 = allow; }
bool allow_tf32() { return g_allow_tf32.load(); }

// ------------------------------------------------------------------------------ caching allocator
namespace {

std::atomic<size_t> g_in_use{0}, g_peak{0}, g_cached{0};
// Bytes obtained from cudaMalloc and not yet given back (in use + cached), and their peak: updated
// only where cudaMalloc and cudaFree run, never on a cache hit.
std::atomic<size_t> g_reserved{0}, g_peak_reserved{0};

void raise_peak(std::atomic<size_t>& peak, size_t now) {
  size_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

// Note [CUDA caching allocator]
// cudaMalloc and cudaFree synchronize the device and cost tens of microseconds, so no op may call them
// in steady state. Freed blocks go to a free list per (device, rounded size) and are handed out again.
// Every use of memory is queued on the device's one stream (Note [Checked CUDA calls]), so a block
// freed on the host can be reused at once: the next user's work runs after the previous user's in
// stream order. Sizes round up to 512 bytes below 1 MiB and to 2 MiB above, so the shapes of a
// training step map to few buckets and a block of a nearby size serves. When cudaMalloc runs out of
// memory the cache is returned to the driver and the allocation tried once more.
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {}

  void* allocate(size_t nbytes) override {
    const size_t size = round(nbytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        g_cached -= size;
        note_alloc(size);
        return p;
      }
    }
    set_device(device_);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, size);
    if (err != cudaSuccess) {  // most often out of memory: give the cache back and try once more
      (void)cudaGetLastError();
      empty_cache();
      err = cudaMalloc(&p, size);
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      // Out of device memory is an OutOfMemoryError, which Tensor::empty completes with the shape and
      // what was running (Note [Error context]); anything else stays a CudaError.
      if (err == cudaErrorMemoryAllocation)
        BOOSTER_FAIL(OutOfMemoryError, "out of memory on cuda:", device_, " allocating ", size, " bytes (",
                     g_in_use.load(), " bytes in use by tensors, ", free_b, " of ", total_b, " free on the device)");
      BOOSTER_FAIL(CudaError, "cannot allocate ", size, " bytes on cuda:", device_, ": cudaMalloc says ",
                   cudaGetErrorName(err), " (", cudaGetErrorString(err), "); ", g_in_use.load(),
                   " bytes in use by tensors, ", free_b, " of ", total_b, " free on the device");
    }
    raise_peak(g_peak_reserved, g_reserved += size);
    note_alloc(size);
    return p;
  }

  void deallocate(void* p, size_t nbytes) override {
    if (!p) return;
    const size_t size = round(nbytes);
    g_in_use -= size;
    g_cached += size;
    std::lock_guard<std::mutex> lock(mu_);
    free_[size].push_back(p);
  }

  void copy_to_host(void* dst, const void* src, size_t n) override {
    if (n == 0) return;
    set_device(device_);
    BOOSTER_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream(device_)));
    BOOSTER_CUDA_CHECK(cudaStreamSynchronize(stream(device_)));
  }
  void copy_from_host(void* dst, const void* src, size_t n) override {
    if (n == 0) return;
    set_device(device_);
    // Synchronized: the host buffer may be freed as soon as this returns.
    BOOSTER_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream(device_)));
    BOOSTER_CUDA_CHECK(cudaStreamSynchronize(stream(device_)));
  }
  void copy_device(void* dst, const void* src, size_t n) override {
    if (n == 0) return;
    set_device(device_);
    BOOSTER_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream(device_)));
  }
  void memset_zero(void* dst, size_t n) override {
    if (n == 0) return;
    set_device(device_);
    BOOSTER_CUDA_CHECK(cudaMemsetAsync(dst, 0, n, stream(device_)));
  }

  void empty_cache() override {
    set_device(device_);
    BOOSTER_CUDA_CHECK(cudaStreamSynchronize(stream(device_)));
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, blocks] : free_)
      for (void* p : blocks) {
        cudaFree(p);
        g_cached -= size;
        g_reserved -= size;
      }
    free_.clear();
  }

 private:
  static size_t round(size_t n) {
    constexpr size_t kSmall = 512, kLarge = size_t(2) << 20;
    if (n <= (size_t(1) << 20)) return n == 0 ? kSmall : (n + kSmall - 1) / kSmall * kSmall;
    return (n + kLarge - 1) / kLarge * kLarge;
  }
  static void note_alloc(size_t size) { raise_peak(g_peak, g_in_use += size); }

  int device_;
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
};

// One allocator per device; the registry has one slot per device type, so it routes by index.
// An event recorded now on `device`'s stream (leaves `device` current). Destroying it right after
// another stream was made to wait for it is allowed: CUDA frees it once the wait is resolved.
struct StreamEvent {
  explicit StreamEvent(int device) {
    set_device(device);
    BOOSTER_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    BOOSTER_CUDA_CHECK(cudaEventRecord(event, stream(device)));  // (a failure leaks one event)
  }
  ~StreamEvent() { cudaEventDestroy(event); }
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;
  cudaEvent_t event = nullptr;
};

class CudaAllocatorRouter final : public Allocator {
 public:
  CudaAllocator& at() {
    int d = 0;
    BOOSTER_CUDA_CHECK(cudaGetDevice(&d));
    return at(d);
  }
  CudaAllocator& at(int d) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& a = per_device_[d];
    if (!a) a = std::make_unique<CudaAllocator>(d);
    return *a;
  }
  void* allocate_on(int d, size_t n) override {
    BOOSTER_CHECK(d >= 0 && d < device_count(), DeviceError, "cuda:", d, " does not exist: ", device_count(),
                  " CUDA device(s) visible");
    return at(d).allocate(n);
  }
  void deallocate_on(int d, void* p, size_t n) override { at(d).deallocate(p, n); }
  // Without a device index: the current device.
  void* allocate(size_t n) override { return at().allocate(n); }
  void deallocate(void* p, size_t n) override { at(owner(p)).deallocate(p, n); }
  // Copies and memsets run on the stream of the device that owns the memory (Note [CUDA device
  // routing]): the interface passes no device, and the current one may be another GPU's.
  void copy_to_host(void* dst, const void* src, size_t n) override { at(owner(src)).copy_to_host(dst, src, n); }
  void copy_from_host(void* dst, const void* src, size_t n) override { at(owner(dst)).copy_from_host(dst, src, n); }
  void copy_device(void* dst, const void* src, size_t n) override {
    const int d = owner(dst), s = owner(src);
    if (d == s) return at(d).copy_device(dst, src, n);
    if (n == 0) return;
    // Between GPUs: the copy is queued on the destination's stream after the source's pending
    // writes, and the source's stream then waits for the copy, so neither device's later work (a
    // write to the source, or the caching allocator reusing a freed source block) can overtake it.
    const StreamEvent source_ready(s);
    set_device(d);
    BOOSTER_CUDA_CHECK(cudaStreamWaitEvent(stream(d), source_ready.event, 0));
    BOOSTER_CUDA_CHECK(cudaMemcpyPeerAsync(dst, d, src, s, n, stream(d)));
    const StreamEvent copied(d);
    BOOSTER_CUDA_CHECK(cudaStreamWaitEvent(stream(s), copied.event, 0));
  }
  void memset_zero(void* dst, size_t n) override { at(owner(dst)).memset_zero(dst, n); }
  void empty_cache() override {
    for (auto& [d, a] : per_device_) a->empty_cache();
  }

 private:
  // The device whose memory `p` is; the current device when CUDA does not know the pointer.
  static int owner(const void* p) {
    cudaPointerAttributes attr{};
    if (p && cudaPointerGetAttributes(&attr, p) == cudaSuccess && attr.type == cudaMemoryTypeDevice)
      return attr.device;
    (void)cudaGetLastError();
    int d = 0;
    BOOSTER_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }

  std::mutex mu_;
  std::map<int, std::unique_ptr<CudaAllocator>> per_device_;
};

// The allocator is registered only where a GPU is visible, so without one Storage on cuda throws
// DeviceError "no allocator for device cuda:0 ..." (storage.cpp) instead of a CUDA error.
[[maybe_unused]] const bool g_registered = [] {
  if (device_count() > 0) register_allocator(DeviceType::CUDA, new CudaAllocatorRouter());
  return true;
}();

}  // namespace

size_t bytes_in_use() { return g_in_use.load(); }
size_t peak_bytes() { return g_peak.load(); }
void reset_peak_bytes() {
  g_peak = g_in_use.load();
  g_peak_reserved = g_reserved.load();
}
size_t cached_bytes() { return g_cached.load(); }
size_t reserved_bytes() { return g_reserved.load(); }
size_t peak_reserved_bytes() { return g_peak_reserved.load(); }

}  // namespace booster::cuda
