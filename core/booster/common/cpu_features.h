// Which build of the CPU kernels this process runs (Note [CPU kernels per ISA level]).
#pragma once

namespace booster::cpu {

// Note [CPU kernels per ISA level]
// The library is built for any x86-64 CPU: nothing is compiled with -march=native unless the build
// asks for it (BOOSTER_NATIVE=ON). The CPU kernels (core/booster/backends/cpu/*.cpp) are compiled once
// per level below, each copy in its own namespace, and only the copy for the selected level registers
// its kernels when the library loads; the bulk float16/bfloat16 conversions (tensor/half.cpp) pick
// their loop the same way. The selected level is the highest this CPU and OS support, or the one
// named by the environment variable BOOSTER_CPU_ISA (baseline, avx2, avx512) when the CPU supports it.
// Valgrind reports a CPU without AVX-512, so leak checks run the AVX2 kernels.
enum class IsaLevel : int {
  Baseline = 0,  // x86-64 (SSE2)
  Avx2 = 1,      // x86-64-v3: AVX2, FMA, F16C, BMI
  Avx512 = 2,    // x86-64-v4: AVX-512 F, BW, CD, DQ, VL
};

// Whether this CPU computes bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16): where it does
// not, bfloat16 saves memory but not time (its GEMMs widen to float32).
bool has_bf16_instructions();
// "avx512_bf16", "amx_bf16, avx512_bf16", or "none".
const char* bf16_instructions_name();

// The level whose kernels run (fixed at the first call, before any kernel registers).
IsaLevel isa_level();
// Whether this CPU (and its OS) can run code of `level`.
bool isa_supported(IsaLevel level);
const char* isa_name(IsaLevel level);
// "avx512 (of baseline, avx2, avx512)", or "native (-march=native)" for a BOOSTER_NATIVE build.
const char* isa_description();

}  // namespace booster::cpu
