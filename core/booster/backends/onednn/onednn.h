// oneDNN on the CPU: bfloat16 GEMMs on the bfloat16 instructions of the CPU (AVX512-BF16, AMX), which
// OpenBLAS does not reach (Debian's exports no bfloat16 GEMM; the fallback widens to float32 sgemm).
// Used only where it pays: a CPU with those instructions, the avx512 kernel level, and the switch
// BOOSTER_ONEDNN not "0" (Note [bfloat16 GEMMs through oneDNN] in onednn.cpp). Without libdnnl-dev
// at build time, a stub reports the path as unavailable.
#pragma once

#include <cstdint>
#include <string>

#include "booster/kernels/gemm.h"

namespace booster::onednn {

// Whether this build links oneDNN.
bool built();
// Whether bfloat16 GEMMs run through oneDNN now: built, the CPU has bfloat16 instructions, the
// selected kernel level is avx512, BOOSTER_ONEDNN is not "0", and set_bf16_gemm has not turned it off.
bool bf16_gemm_enabled();
// Turns the path on or off for this process (tests and benchmarks compare both); returns the previous
// setting. Turning it on where it cannot run (not built, no bfloat16 instructions) leaves it off.
bool set_bf16_gemm(bool enabled);
// One line for `booster --version`: which path bfloat16 GEMMs take here, and why.
std::string bf16_gemm_description();

// C[i] = alpha op(A[i]) op(B[i]) + beta C[i] for i < batch, bfloat16 operands and result (row-major C,
// unit column stride, ldc and c_batch_stride in elements), float32 accumulation and one rounding of
// each result, as the widening path rounds it. False (and C untouched) when oneDNN takes no such
// problem: the caller computes it the other way.
bool gemm_bf16(const kernels::GemmOperand& a, const kernels::GemmOperand& b, void* c, int64_t ldc,
               int64_t c_batch_stride, int64_t batch, int64_t m, int64_t n, int64_t k, double alpha, double beta);

}  // namespace booster::onednn
