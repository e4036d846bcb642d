// The host-side arithmetic of the CPU process groups (mpi's float16/bfloat16 reductions and Avg's
// division, the tcp group's every reduction): one definition, so both backends round alike. Internal:
// not installed (an -impl header).
#pragma once

#include <cstdint>

#include "booster/distributed/process_group.h"

namespace booster::distributed::detail {

// dst[i] = dst[i] (op) src[i] for n elements of `dtype` (float32/64, int32/64, float16, bfloat16; 16-bit
// floats widened to float32 and rounded back, one rounding per element). Avg combines as Sum: the
// values were divided first (Note [Averages divide first]). DTypeError for another dtype, naming `who`.
void reduce_into(void* dst, const void* src, int64_t n, DType dtype, ReduceOp op, const char* who);

// data[i] /= divisor in `dtype` (one rounding per element; 16-bit floats through float32): Avg's
// division. DTypeError for a dtype that has no average.
void divide_by(void* data, int64_t n, DType dtype, int divisor);

}  // namespace booster::distributed::detail
