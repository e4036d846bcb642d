// oneDNN on the CPU: bfloat16 GEMMs on the bfloat16 instructions of the CPU (AVX512-BF16, AMX), which
// OpenBLAS does not reach (Debian's exports no bfloat16 GEMM; the fallback widens to float32 sgemm),
// and direct convolutions in float32 and bfloat16 (Note [Convolutions through oneDNN]). Used only
// where it pays: bfloat16 on a CPU with those instructions at the avx512 kernel level, and the switch
// BOOSTER_ONEDNN not "0" (Note [bfloat16 GEMMs through oneDNN] in onednn.cpp). Without libdnnl-dev
// at build time, a stub reports both paths as unavailable.
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
// each result, as the widening path rounds it; with float32_result, C is float32 and not rounded
// (attention's scores). False (and C untouched) when oneDNN takes no such problem: the caller computes
// it the other way.
bool gemm_bf16(const kernels::GemmOperand& a, const kernels::GemmOperand& b, void* c, int64_t ldc,
               int64_t c_batch_stride, int64_t batch, int64_t m, int64_t n, int64_t k, double alpha, double beta,
               bool float32_result = false);

// Convolutions (Note [Convolutions through oneDNN] in onednn.cpp).
//
// Whether conv2d (and max_pool2d) run through oneDNN now: built, BOOSTER_ONEDNN is not "0" and
// set_conv has not turned it off. float32 runs on any x86-64 CPU; bfloat16 additionally needs what
// the bfloat16 GEMMs need (conv_bf16_enabled).
bool conv_enabled();
bool conv_bf16_enabled();
// Turns the convolution path on or off for this process (tests and benchmarks compare both); returns
// the previous setting. Turning it on where it cannot run (not built) leaves it off.
bool set_conv(bool enabled);
// One line for `booster --version`: which path convolutions take here, and why.
std::string conv_description();

// One 2-D convolution: images [n, c, h, w] and outputs [n, cout, oh, ow] in NCHW, weights
// [cout, c / groups, kh, kw], bias [cout], all contiguous, of one dtype; dilation as torch counts it
// (1: none); oh and ow by torch's formula, padding the same on both sides.
struct ConvShape {
  int64_t n, c, h, w, cout, groups, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow;
};
// Element types the convolution path takes.
enum class ConvType { Float32, BFloat16 };

// y = conv(x, w) + bias (bias may be null). False (y unspecified) when oneDNN takes no such problem
// or the path is off for this type: the caller computes it the other way.
bool conv_forward(const ConvShape& s, ConvType t, const void* x, const void* w, const void* bias, void* y);
// dx = the gradient of the input from dy and w.
bool conv_backward_data(const ConvShape& s, ConvType t, const void* dy, const void* w, void* dx);
// dw (and dbias unless null) = the gradients of the weights and bias from x and dy.
bool conv_backward_weights(const ConvShape& s, ConvType t, const void* x, const void* dy, void* dw, void* dbias);

// Max pooling over the same shapes (cout == c, groups 1, no dilation), on the same switch and types:
// the bytes of the workspace (the index of each window's maximum) that the forward writes and the
// backward reads, or -1 when oneDNN takes no such problem or the path is off for this type.
int64_t max_pool_workspace_bytes(const ConvShape& s, ConvType t);
// y = the maximum of each window (the first of equal maxima), its index into `workspace`.
bool max_pool_forward(const ConvShape& s, ConvType t, const void* x, void* y, void* workspace);
// dx = dy scattered to each window's maximum (from the forward's workspace), zero elsewhere.
bool max_pool_backward(const ConvShape& s, ConvType t, const void* dy, const void* workspace, void* dx);

}  // namespace booster::onednn
