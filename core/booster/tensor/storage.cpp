#include "booster/tensor/storage.h"

#include "booster/common/error.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace booster {

void fill_deferred(Storage& storage, const DeferredInit& init);  // deferred.cpp

namespace {

std::atomic<size_t> g_cpu_in_use{0};
std::atomic<size_t> g_cpu_peak{0};

// Note [CPU caching allocator]
// Training allocates the same shapes every step. Freed blocks are kept in per-size free lists and
// handed out again, so after the first step no op calls malloc. Sizes round up to 64 bytes (the
// alignment AVX-512 loads like). empty_cache() returns everything to the system.
class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kAlign = 64;

  void* allocate(size_t nbytes) override {
    const size_t size = round(nbytes);
    note_alloc(size);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= size;
        return p;
      }
    }
    void* p = std::aligned_alloc(kAlign, size);
    if (!p) {
      empty_cache();
      p = std::aligned_alloc(kAlign, size);
    }
    if (p == nullptr) {
      g_cpu_in_use -= size;  // counted by note_alloc above, never handed out
      // Tensor::empty adds the shape, dtype and what was running (Note [Error context]).
      BOOSTER_FAIL(OutOfMemoryError, "out of host memory allocating ", size, " bytes");
    }
    return p;
  }

  void deallocate(void* p, size_t nbytes) override {
    if (!p) return;
    const size_t size = round(nbytes);
    g_cpu_in_use -= size;
    std::lock_guard<std::mutex> lock(mu_);
    free_[size].push_back(p);
    cached_bytes_ += size;
  }

  void copy_to_host(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void copy_from_host(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void copy_device(void* dst, const void* src, size_t n) override { std::memmove(dst, src, n); }
  void memset_zero(void* dst, size_t n) override { std::memset(dst, 0, n); }

  void empty_cache() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, blocks] : free_)
      for (void* p : blocks) std::free(p);
    free_.clear();
    cached_bytes_ = 0;
  }

 private:
  static size_t round(size_t n) { return n == 0 ? kAlign : (n + kAlign - 1) / kAlign * kAlign; }
  static void note_alloc(size_t size) {
    const size_t now = g_cpu_in_use += size;
    size_t peak = g_cpu_peak.load();
    while (now > peak && !g_cpu_peak.compare_exchange_weak(peak, now)) {
    }
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t cached_bytes_ = 0;
};

Allocator* g_allocators[kNumDeviceTypes] = {};

Allocator* cpu_allocator() {
  // Never destroyed: storages freed during static destruction must still find it.
  static CpuAllocator* a = new CpuAllocator();
  return a;
}

}  // namespace

void register_allocator(DeviceType t, Allocator* a) { g_allocators[int(t)] = a; }
bool has_allocator(DeviceType t) { return t == DeviceType::CPU || g_allocators[int(t)] != nullptr; }

Allocator& allocator_for(Device d) {
  if (d.is_cpu()) return *cpu_allocator();
  Allocator* a = g_allocators[int(d.type)];
  BOOSTER_CHECK(a != nullptr, DeviceError, "no allocator for device ", d,
                ": this build has no CUDA backend or no GPU was found (see `booster --version`)");
  return *a;
}

size_t cpu_bytes_in_use() { return g_cpu_in_use.load(); }
size_t cpu_peak_bytes() { return g_cpu_peak.load(); }
void reset_cpu_peak_bytes() { g_cpu_peak = g_cpu_in_use.load(); }

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  data_ = allocator_for(device).allocate_on(device.index, nbytes);
}

Storage::Storage(size_t nbytes, Device device, Deferred)
    : nbytes_(nbytes), device_(device), released_(true), deferred_(true) {
  (void)allocator_for(device);  // a device without a backend fails now, as an eager allocation would
}

Storage::Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> release)
    : data_(data), nbytes_(nbytes), device_(device), release_(std::move(release)) {}

Storage::~Storage() {
  if (release_) {
    release_(data_);
  } else if (!released_) {
    allocator_for(device_).deallocate_on(device_.index, data_, nbytes_);
  }
}

void Storage::release() {
  BOOSTER_CHECK(!release_, StateError, "Storage::release: this storage wraps memory owned elsewhere; only memory "
                                       "from booster's allocator can be released");
  deferred_ = false;
  init_.reset();
  if (released_) return;
  allocator_for(device_).deallocate_on(device_.index, data_, nbytes_);
  data_ = nullptr;
  released_ = true;
}

void Storage::materialize() {
  if (!released_) return;
  data_ = allocator_for(device_).allocate_on(device_.index, nbytes_);
  released_ = false;
  if (!deferred_) return;
  deferred_ = false;
  if (!init_) return;
  try {
    fill_deferred(*this, *init_);
  } catch (...) {
    // Deferred again with its record, so a later use retries instead of reading garbage.
    allocator_for(device_).deallocate_on(device_.index, data_, nbytes_);
    data_ = nullptr;
    released_ = true;
    deferred_ = true;
    throw;
  }
  init_.reset();
}

void Storage::set_deferred_init(std::shared_ptr<const DeferredInit> init) {
  BOOSTER_CHECK(deferred_, StateError, "Storage::set_deferred_init: the storage is allocated already");
  init_ = std::move(init);
}

void* Storage::on_released() const {
  if (deferred_) {
    const_cast<Storage*>(this)->materialize();  // Note [Deferred storage]: a Storage is never const itself
    return data_;
  }
  BOOSTER_FAIL(StateError, "a tensor's memory is released (", nbytes_, " bytes on ", device_,
               "): it is a parameter that ZeRO stage 3 gathers only while its module runs (Note [Released "
               "storage]); read parameters inside the module's forward, or save the model through the Booster");
}

}  // namespace booster
