// Picks the CPU kernel level once per process (Note [CPU kernels per ISA level]).
#include "booster/common/cpu_features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <string>

namespace booster::cpu {

namespace {

IsaLevel best_supported() {
  if (isa_supported(IsaLevel::Avx512)) return IsaLevel::Avx512;
  if (isa_supported(IsaLevel::Avx2)) return IsaLevel::Avx2;
  return IsaLevel::Baseline;
}

IsaLevel select() {
  const IsaLevel best = best_supported();
  const char* env = std::getenv("BOOSTER_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  const std::string want = env;
  for (IsaLevel level : {IsaLevel::Baseline, IsaLevel::Avx2, IsaLevel::Avx512}) {
    if (want != isa_name(level)) continue;
    if (isa_supported(level)) return level;
    std::fprintf(stderr, "booster: BOOSTER_CPU_ISA=%s is not supported by this CPU; using %s\n", env,
                 isa_name(best));
    return best;
  }
  std::fprintf(stderr, "booster: BOOSTER_CPU_ISA=%s is not one of baseline, avx2, avx512; using %s\n", env,
               isa_name(best));
  return best;
}

}  // namespace

bool isa_supported(IsaLevel level) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // may run before libgcc's own constructor (static initializers of the core)
  switch (level) {
    case IsaLevel::Baseline:
      return true;
    case IsaLevel::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi2");
    case IsaLevel::Avx512:
      return isa_supported(IsaLevel::Avx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }
  return false;
#else
  return level == IsaLevel::Baseline;
#endif
}

namespace {

struct Bf16Features {
  bool avx512_bf16 = false, amx_bf16 = false;
};

Bf16Features bf16_features() {
  Bf16Features f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!isa_supported(IsaLevel::Avx512)) return f;  // both need the AVX-512 (or AMX) state the OS enables
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) f.amx_bf16 = (edx >> 22) & 1;
  if (eax >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) f.avx512_bf16 = (eax >> 5) & 1;
#endif
  return f;
}

}  // namespace

bool has_bf16_instructions() {
  static const Bf16Features f = bf16_features();
  return f.avx512_bf16 || f.amx_bf16;
}

const char* bf16_instructions_name() {
  static const Bf16Features f = bf16_features();
  if (f.amx_bf16 && f.avx512_bf16) return "amx_bf16, avx512_bf16";
  if (f.amx_bf16) return "amx_bf16";
  return f.avx512_bf16 ? "avx512_bf16" : "none";
}

IsaLevel isa_level() {
  static const IsaLevel level = select();
  return level;
}

const char* isa_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::Baseline: return "baseline";
    case IsaLevel::Avx2: return "avx2";
    case IsaLevel::Avx512: return "avx512";
  }
  return "unknown";
}

const char* isa_description() {
#if defined(BOOSTER_CPU_NATIVE)
  return "native (-march=native)";
#else
  static const std::string text = std::string(isa_name(isa_level())) + " (built: baseline, avx2, avx512)";
  return text.c_str();
#endif
}

}  // namespace booster::cpu
