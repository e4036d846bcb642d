// Kernel registration per device, in the spirit of PyTorch's DispatchStub: a kernel family is
// declared once in a header, defined once, and each backend registers its implementation.
//
//   // kernels/elementwise.h
//   BOOSTER_DECLARE_KERNEL(binary_kernel, void(BinaryOp, const Tensor&, const Tensor&, Tensor&, double));
//   // kernels/kernels.cpp
//   BOOSTER_DEFINE_KERNEL(binary_kernel);
//   // backends/cpu/elementwise.cpp
//   BOOSTER_REGISTER_KERNEL(binary_kernel, CPU, &cpu_binary);
//
// The core is a shared library, so every backend's registration runs when it loads.
#pragma once

#include "booster/common/error.h"
#include "booster/tensor/dtype.h"

namespace booster::kernels {

template <class Fn>
class DispatchStub {
 public:
  // constexpr so the stub is constant-initialized before any registration runs.
  constexpr explicit DispatchStub(const char* name) : name_(name) {}
  // The kernel for `device`; throws DeviceError when that backend did not register one.
  Fn* operator()(Device device) const {
    Fn* fn = fns_[int(device.type)];
    BOOSTER_CHECK(fn != nullptr, DeviceError, name_, ": no kernel registered for device ", device,
                  device.is_cuda() ? " (was the library built with CUDA, and is a GPU present?)" : "");
    return fn;
  }
  bool has(DeviceType t) const { return fns_[int(t)] != nullptr; }
  bool set(DeviceType t, Fn* fn) {
    fns_[int(t)] = fn;
    return true;
  }

 private:
  const char* name_;
  Fn* fns_[kNumDeviceTypes] = {};
};

}  // namespace booster::kernels

#define BOOSTER_DECLARE_KERNEL(name, ...)     \
  using name##_fn = __VA_ARGS__;              \
  extern ::booster::kernels::DispatchStub<name##_fn> name

#define BOOSTER_DEFINE_KERNEL(name) constinit ::booster::kernels::DispatchStub<name##_fn> name(#name)

#define BOOSTER_REGISTER_KERNEL(name, device, fn) \
  [[maybe_unused]] static const bool booster_registered_##name##_##device =  \
      ::booster::kernels::name.set(::booster::DeviceType::device, fn)
