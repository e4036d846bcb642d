// What differs between the per-ISA builds of the CPU kernels (Note [CPU kernels per ISA level] in
// booster/common/cpu_features.h): the namespace their inline helpers live in, and whether a copy
// registers its kernels.
#pragma once

#include "booster/common/cpu_features.h"
#include "booster/kernels/dispatch.h"

// Note [One namespace per ISA build]
// The helpers in these headers are inline functions and templates, emitted by every file that uses
// them. Compiled once per ISA level, copies with one name would be merged by the linker, and a CPU
// without AVX-512 could end up running the AVX-512 copy. Each build therefore puts them in an inline
// namespace of its own (set by CMake: isa_baseline, isa_avx2, isa_avx512; isa_default elsewhere).
#if !defined(BOOSTER_CPU_ISA_NS)
#define BOOSTER_CPU_ISA_NS isa_default
#endif

// Registers a CPU kernel: in a per-ISA build only the copy for cpu::isa_level() does.
#if defined(BOOSTER_CPU_ISA_LEVEL)
#define BOOSTER_REGISTER_CPU_KERNEL(name, fn)                                                          \
  [[maybe_unused]] static const bool booster_registered_##name##_CPU =                                \
      ::booster::cpu::isa_level() == ::booster::cpu::IsaLevel(BOOSTER_CPU_ISA_LEVEL) &&                \
      ::booster::kernels::name.set(::booster::DeviceType::CPU, fn)
#else
#define BOOSTER_REGISTER_CPU_KERNEL(name, fn) BOOSTER_REGISTER_KERNEL(name, CPU, fn)
#endif
