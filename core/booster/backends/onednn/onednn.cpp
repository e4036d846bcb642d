// bfloat16 GEMMs through oneDNN's matmul primitive (onednn.h).
//
// Note [bfloat16 GEMMs through oneDNN]
// A bfloat16 GEMM on the OpenBLAS path widens both operands to float32 scratch, runs sgemm and rounds
// C: three passes over memory and float32 arithmetic. oneDNN's matmul runs on the CPU's bfloat16 dot
// products (vdpbf16ps, AMX tiles), accumulating in float32 and rounding each result once to bfloat16
// (round to nearest even), which is what the widening path computes up to the order of the float32
// sums. Operands are described as they lie (Note [GEMM operand layouts]: a transposed operand is a
// stride, a broadcast one a batch of 1), alpha is an output scale and beta a sum post-op, so nothing
// is copied. Creating a primitive JITs code (tens of microseconds to milliseconds), so each problem
// (sizes, strides, alpha, beta) gets one primitive, kept per thread with its memory objects, whose
// data handles are the only thing set per call. On a CPU without bfloat16 instructions oneDNN would
// emulate them, slower than sgemm: the path is off there (and below the avx512 kernel level, so that
// BOOSTER_CPU_ISA=avx2 tests the other path on any machine).
#include "booster/backends/onednn/onednn.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>

#include "booster/common/cpu_features.h"

namespace booster::onednn {
namespace {

using dnnl::memory;
using kernels::GemmOperand;

bool switched_on_by_env() {
  const char* env = std::getenv("BOOSTER_ONEDNN");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

bool can_run() { return cpu::has_bf16_instructions() && cpu::isa_level() == cpu::IsaLevel::Avx512; }

std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{can_run() && switched_on_by_env()};
  return on;
}

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

// Logical [rows, cols] of a stored operand (Note [GEMM operand layouts]), over `batch` matrices or one
// broadcast matrix.
memory::desc operand_desc(const GemmOperand& op, int64_t batch, int64_t rows, int64_t cols) {
  const bool broadcast = op.batch_stride == 0;
  const memory::dim bs = broadcast ? std::max<int64_t>(op.stored_rows * op.ld, 1) : op.batch_stride;
  const memory::dims strides = op.trans ? memory::dims{bs, 1, op.ld} : memory::dims{bs, op.ld, 1};
  return memory::desc({broadcast ? 1 : batch, rows, cols}, memory::data_type::bf16, strides);
}

using Key = std::array<int64_t, 16>;

struct Entry {
  bool ok = false;  // false: oneDNN refused this problem; the caller's path computes it
  dnnl::matmul matmul;
  memory src, weights, dst;
};

Entry make_entry(const GemmOperand& a, const GemmOperand& b, int64_t ldc, int64_t c_batch_stride, int64_t batch,
                 int64_t m, int64_t n, int64_t k, double alpha, double beta) {
  Entry e;
  try {
    const memory::desc src = operand_desc(a, batch, m, k), weights = operand_desc(b, batch, k, n);
    const memory::desc dst({batch, m, n}, memory::data_type::bf16,
                           {std::max<int64_t>(c_batch_stride, m * ldc), ldc, 1});
    dnnl::primitive_attr attr;
    if (alpha != 1.0) attr.set_output_scales(0, {float(alpha)});
    if (beta != 0.0) {
      dnnl::post_ops ops;
      ops.append_sum(float(beta));
      attr.set_post_ops(ops);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, weights, dst), attr, engine());
    e.matmul = dnnl::matmul(pd);
    e.src = memory(src, engine(), DNNL_MEMORY_NONE);
    e.weights = memory(weights, engine(), DNNL_MEMORY_NONE);
    e.dst = memory(dst, engine(), DNNL_MEMORY_NONE);
    e.ok = true;
  } catch (const dnnl::error&) {
    e.ok = false;
  }
  return e;
}

}  // namespace

bool built() { return true; }

bool bf16_gemm_enabled() { return enabled_flag().load(std::memory_order_relaxed); }

bool set_bf16_gemm(bool enabled) { return enabled_flag().exchange(enabled && can_run()); }

std::string bf16_gemm_description() {
  const dnnl_version_t* v = dnnl_version();
  const std::string onednn = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                             std::to_string(v->patch);
  if (bf16_gemm_enabled()) return onednn + " on " + cpu::bf16_instructions_name() + " (BOOSTER_ONEDNN=0 turns it off)";
  std::string why;
  if (!cpu::has_bf16_instructions()) why = "this CPU has no bfloat16 instructions";
  else if (cpu::isa_level() != cpu::IsaLevel::Avx512) why = "the kernel level is below avx512 (BOOSTER_CPU_ISA)";
  else why = "switched off (BOOSTER_ONEDNN=0)";
  return "widened to float32 (OpenBLAS sgemm): " + why + "; " + onednn + " is built in";
}

bool gemm_bf16(const GemmOperand& a, const GemmOperand& b, void* c, int64_t ldc, int64_t c_batch_stride,
               int64_t batch, int64_t m, int64_t n, int64_t k, double alpha, double beta) {
  if (!bf16_gemm_enabled() || batch <= 0 || m <= 0 || n <= 0 || k <= 0) return false;
  const Key key = {a.trans, a.ld, a.batch_stride, b.trans, b.ld, b.batch_stride, ldc, c_batch_stride, batch, m, n, k,
                   0, 0, a.stored_rows, b.stored_rows};
  Key full = key;
  float fa = float(alpha), fb = float(beta);
  std::memcpy(&full[12], &fa, sizeof fa);
  std::memcpy(&full[13], &fb, sizeof fb);
  thread_local std::map<Key, Entry> cache;
  thread_local dnnl::stream stream(engine());
  auto it = cache.find(full);
  if (it == cache.end())
    it = cache.emplace(full, make_entry(a, b, ldc, c_batch_stride, batch, m, n, k, alpha, beta)).first;
  Entry& e = it->second;
  if (!e.ok) return false;
  e.src.set_data_handle(const_cast<void*>(a.data));
  e.weights.set_data_handle(const_cast<void*>(b.data));
  e.dst.set_data_handle(c);
  e.matmul.execute(stream, {{DNNL_ARG_SRC, e.src}, {DNNL_ARG_WEIGHTS, e.weights}, {DNNL_ARG_DST, e.dst}});
  stream.wait();
  return true;
}

}  // namespace booster::onednn
