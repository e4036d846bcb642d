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
// data handles are the only thing set per call (up to kMaxCachedProblems of them). On a CPU without
// bfloat16 instructions oneDNN would emulate them, slower than sgemm: the path is off there (and below
// the avx512 kernel level, so that BOOSTER_CPU_ISA=avx2 tests the other path on any machine).
#include "booster/backends/onednn/onednn.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <unordered_map>
#include <vector>
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

std::atomic<bool>& conv_flag() {
  static std::atomic<bool> on{switched_on_by_env()};
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

using Key = std::array<int64_t, 17>;

// Problems kept per thread and kind (GEMM, convolution). A training loop reuses a few dozen; a loop
// whose shapes keep changing (generation's growing context, batches of varying length) would grow the
// cache without end, so past this many it is emptied and refilled.
constexpr size_t kMaxCachedProblems = 512;

struct Entry {
  bool ok = false;  // false: oneDNN refused this problem; the caller's path computes it
  dnnl::matmul matmul;
  memory src, weights, dst;
};

Entry make_entry(const GemmOperand& a, const GemmOperand& b, int64_t ldc, int64_t c_batch_stride, int64_t batch,
                 int64_t m, int64_t n, int64_t k, double alpha, double beta, bool float32_result) {
  Entry e;
  try {
    const memory::desc src = operand_desc(a, batch, m, k), weights = operand_desc(b, batch, k, n);
    const memory::desc dst({batch, m, n}, float32_result ? memory::data_type::f32 : memory::data_type::bf16,
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
               int64_t batch, int64_t m, int64_t n, int64_t k, double alpha, double beta, bool float32_result) {
  if (!bf16_gemm_enabled() || batch <= 0 || m <= 0 || n <= 0 || k <= 0) return false;
  const Key key = {a.trans, a.ld, a.batch_stride, b.trans, b.ld, b.batch_stride, ldc, c_batch_stride, batch, m, n, k,
                   0, 0, a.stored_rows, b.stored_rows, float32_result};
  Key full = key;
  float fa = float(alpha), fb = float(beta);
  std::memcpy(&full[12], &fa, sizeof fa);
  std::memcpy(&full[13], &fb, sizeof fb);
  thread_local std::map<Key, Entry> cache;
  thread_local dnnl::stream stream(engine());
  auto it = cache.find(full);
  if (it == cache.end()) {
    if (cache.size() >= kMaxCachedProblems) cache.clear();  // shapes that keep changing: start over
    it = cache.emplace(full, make_entry(a, b, ldc, c_batch_stride, batch, m, n, k, alpha, beta, float32_result)).first;
  }
  Entry& e = it->second;
  if (!e.ok) return false;
  e.src.set_data_handle(const_cast<void*>(a.data));
  e.weights.set_data_handle(const_cast<void*>(b.data));
  e.dst.set_data_handle(c);
  e.matmul.execute(stream, {{DNNL_ARG_SRC, e.src}, {DNNL_ARG_WEIGHTS, e.weights}, {DNNL_ARG_DST, e.dst}});
  stream.wait();
  return true;
}

// Note [Convolutions through oneDNN]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// conv2d's forward and both backward products run as oneDNN's direct convolutions
// (convolution_forward / convolution_backward_data / convolution_backward_weights) on the CPU, in
// float32 and, where the bfloat16 GEMMs run through oneDNN, in bfloat16 (float32 accumulation, one
// rounding of each result, as the gather path rounds its GEMM). The gather + GEMM of Note
// [Convolution as gather + GEMM] stays the path for what oneDNN does not take here (float16, float64,
// CUDA tensors, empty batches, the switch off) and is the reference the tests compare with.
// Tensors stay NCHW/OIHW: the primitive is created with format_tag::any (oneDNN picks its blocked
// layouts, nChw16c and friends) and each argument whose chosen layout differs from the tensor's is
// reordered into (or out of) a buffer owned by the cached entry, once per call. Creating primitives
// JITs code, so each (direction, type, shape) gets one entry per thread, holding primitives and
// memory objects; a call sets data handles and executes. Every output element is one sum in the
// same order (input channel blocks, then taps) at every position, which Note [Position-independent
// rounding] in ops/conv.cpp relies on.
// max_pool2d runs through oneDNN's max pooling on the same switch and cache, in NCHW (a pooling
// primitive takes the layout of its source), with a workspace holding each window's argmax from the
// forward for the backward; ops/conv.cpp keeps non-finite inputs on the gather path, whose NaN and
// -inf semantics (torch's) oneDNN's max does not share.
namespace {

enum class ConvKind : int64_t { Forward, BackwardData, BackwardWeights, PoolForward, PoolBackward };

using ConvKey = std::array<int64_t, 19>;

// A primitive argument: the tensor's memory (plain layout, handle set per call) and, when the
// primitive wants another layout, its own buffer and the reorder between the two.
struct ConvArg {
  int arg = 0;
  memory user, prim;
  dnnl::reorder reorder;  // user -> prim for inputs, prim -> user for outputs
  bool reordered = false;
};

struct ConvEntry {
  bool ok = false;
  dnnl::primitive primitive;
  std::vector<ConvArg> inputs, outputs;
  int64_t workspace_bytes = -1;  // max pooling
};

memory::data_type dnnl_type(ConvType t) {
  return t == ConvType::BFloat16 ? memory::data_type::bf16 : memory::data_type::f32;
}

ConvArg make_arg(int arg, const memory::desc& user_desc, const memory::desc& prim_desc, bool input) {
  ConvArg a;
  a.arg = arg;
  a.user = memory(user_desc, engine(), DNNL_MEMORY_NONE);
  if (prim_desc == user_desc) {
    a.prim = a.user;
  } else {
    a.prim = memory(prim_desc, engine());
    a.reorder = input ? dnnl::reorder(a.user, a.prim) : dnnl::reorder(a.prim, a.user);
    a.reordered = true;
  }
  return a;
}

// Max pooling in the tensors' own NCHW layout: a pooling primitive takes no format_tag::any for its
// source, and the images come and go between NCHW ops (batch norm, ReLU) anyway.
ConvEntry make_pool_entry(ConvKind kind, const ConvShape& s, ConvType t) {
  using tag = memory::format_tag;
  ConvEntry e;
  try {
    const memory::data_type dt = dnnl_type(t);
    const memory::desc src({s.n, s.c, s.h, s.w}, dt, tag::nchw), dst({s.n, s.c, s.oh, s.ow}, dt, tag::nchw);
    const memory::dims strides = {s.sh, s.sw}, kernel = {s.kh, s.kw}, pad = {s.ph, s.pw};
    const dnnl::pooling_forward::primitive_desc fwd_pd(
        dnnl::pooling_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_max, src, dst, strides,
                                    kernel, pad, pad),
        engine());
    const memory::desc ws = fwd_pd.workspace_desc();
    e.workspace_bytes = int64_t(ws.get_size());
    if (kind == ConvKind::PoolForward) {
      e.primitive = dnnl::pooling_forward(fwd_pd);
      e.inputs.push_back(make_arg(DNNL_ARG_SRC, src, fwd_pd.src_desc(), true));
      e.outputs.push_back(make_arg(DNNL_ARG_DST, dst, fwd_pd.dst_desc(), false));
      e.outputs.push_back(make_arg(DNNL_ARG_WORKSPACE, ws, ws, false));
    } else {
      const dnnl::pooling_backward::primitive_desc pd(
          dnnl::pooling_backward::desc(dnnl::algorithm::pooling_max, src, dst, strides, kernel, pad, pad), engine(),
          fwd_pd);
      e.primitive = dnnl::pooling_backward(pd);
      e.inputs.push_back(make_arg(DNNL_ARG_DIFF_DST, dst, pd.diff_dst_desc(), true));
      e.inputs.push_back(make_arg(DNNL_ARG_WORKSPACE, ws, ws, true));
      e.outputs.push_back(make_arg(DNNL_ARG_DIFF_SRC, src, pd.diff_src_desc(), false));
    }
    e.ok = true;
  } catch (const dnnl::error&) {
    e.ok = false;
  }
  return e;
}

ConvEntry make_conv_entry(ConvKind kind, const ConvShape& s, ConvType t, bool with_bias) {
  if (kind == ConvKind::PoolForward || kind == ConvKind::PoolBackward) return make_pool_entry(kind, s, t);
  using tag = memory::format_tag;
  ConvEntry e;
  try {
    const memory::data_type dt = dnnl_type(t);
    const bool grouped = s.groups > 1;
    const memory::dims src_dims = {s.n, s.c, s.h, s.w}, dst_dims = {s.n, s.cout, s.oh, s.ow};
    const memory::dims w_dims = grouped ? memory::dims{s.groups, s.cout / s.groups, s.c / s.groups, s.kh, s.kw}
                                        : memory::dims{s.cout, s.c, s.kh, s.kw};
    const memory::desc src_user(src_dims, dt, tag::nchw), dst_user(dst_dims, dt, tag::nchw);
    const memory::desc w_user(w_dims, dt, grouped ? tag::goihw : tag::oihw);
    const memory::desc bias_user = with_bias ? memory::desc({s.cout}, dt, tag::a) : memory::desc();
    const memory::desc src_any(src_dims, dt, tag::any), dst_any(dst_dims, dt, tag::any), w_any(w_dims, dt, tag::any);
    const memory::dims strides = {s.sh, s.sw}, dilates = {s.dh - 1, s.dw - 1}, pad = {s.ph, s.pw};
    const auto algo = dnnl::algorithm::convolution_direct;
    const dnnl::convolution_forward::desc fwd_desc(dnnl::prop_kind::forward_training, algo, src_any, w_any, bias_user,
                                                   dst_any, strides, dilates, pad, pad);
    const dnnl::convolution_forward::primitive_desc fwd_pd(fwd_desc, engine());
    switch (kind) {
      case ConvKind::Forward:
        e.primitive = dnnl::convolution_forward(fwd_pd);
        e.inputs.push_back(make_arg(DNNL_ARG_SRC, src_user, fwd_pd.src_desc(), true));
        e.inputs.push_back(make_arg(DNNL_ARG_WEIGHTS, w_user, fwd_pd.weights_desc(), true));
        if (with_bias) e.inputs.push_back(make_arg(DNNL_ARG_BIAS, bias_user, fwd_pd.bias_desc(), true));
        e.outputs.push_back(make_arg(DNNL_ARG_DST, dst_user, fwd_pd.dst_desc(), false));
        break;
      case ConvKind::BackwardData: {
        const dnnl::convolution_backward_data::primitive_desc pd(
            dnnl::convolution_backward_data::desc(algo, src_any, w_any, dst_any, strides, dilates, pad, pad), engine(),
            fwd_pd);
        e.primitive = dnnl::convolution_backward_data(pd);
        e.inputs.push_back(make_arg(DNNL_ARG_DIFF_DST, dst_user, pd.diff_dst_desc(), true));
        e.inputs.push_back(make_arg(DNNL_ARG_WEIGHTS, w_user, pd.weights_desc(), true));
        e.outputs.push_back(make_arg(DNNL_ARG_DIFF_SRC, src_user, pd.diff_src_desc(), false));
        break;
      }
      case ConvKind::BackwardWeights: {
        const dnnl::convolution_backward_weights::primitive_desc pd(
            dnnl::convolution_backward_weights::desc(algo, src_any, w_any, bias_user, dst_any, strides, dilates, pad,
                                                     pad),
            engine(), fwd_pd);
        e.primitive = dnnl::convolution_backward_weights(pd);
        e.inputs.push_back(make_arg(DNNL_ARG_SRC, src_user, pd.src_desc(), true));
        e.inputs.push_back(make_arg(DNNL_ARG_DIFF_DST, dst_user, pd.diff_dst_desc(), true));
        e.outputs.push_back(make_arg(DNNL_ARG_DIFF_WEIGHTS, w_user, pd.diff_weights_desc(), false));
        if (with_bias) e.outputs.push_back(make_arg(DNNL_ARG_DIFF_BIAS, bias_user, pd.diff_bias_desc(), false));
        break;
      }
    }
    e.ok = true;
  } catch (const dnnl::error&) {
    e.ok = false;
  }
  return e;
}

bool conv_type_enabled(ConvType t) { return t == ConvType::BFloat16 ? conv_bf16_enabled() : conv_enabled(); }

// The cached entry of one problem (per thread), or null when the path is off or oneDNN refuses it.
ConvEntry* conv_entry(ConvKind kind, const ConvShape& s, ConvType t, bool with_bias) {
  if (!conv_type_enabled(t) || s.n <= 0 || s.c <= 0 || s.cout <= 0 || s.oh <= 0 || s.ow <= 0) return nullptr;
  const ConvKey key = {int64_t(kind), int64_t(t), with_bias, s.n, s.c, s.h, s.w, s.cout, s.groups, s.kh,
                       s.kw, s.sh, s.sw, s.ph, s.pw, s.dh, s.dw, s.oh, s.ow};
  thread_local std::map<ConvKey, ConvEntry> cache;
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() >= kMaxCachedProblems) cache.clear();  // Note [bfloat16 GEMMs through oneDNN]
    it = cache.emplace(key, make_conv_entry(kind, s, t, with_bias)).first;
  }
  return it->second.ok ? &it->second : nullptr;
}

// Runs one convolution or pooling product: `in` and `out` are the data pointers of the entry's
// inputs and outputs in the order make_conv_entry lists them.
bool run_conv(ConvKind kind, const ConvShape& s, ConvType t, bool with_bias, std::initializer_list<const void*> in,
              std::initializer_list<void*> out) {
  ConvEntry* entry = conv_entry(kind, s, t, with_bias);
  if (!entry) return false;
  ConvEntry& e = *entry;
  thread_local dnnl::stream stream(engine());
  std::unordered_map<int, memory> args;
  auto ptr = in.begin();
  for (ConvArg& a : e.inputs) {
    a.user.set_data_handle(const_cast<void*>(*ptr++));
    if (a.reordered) a.reorder.execute(stream, a.user, a.prim);
    args.emplace(a.arg, a.prim);
  }
  auto optr = out.begin();
  for (ConvArg& a : e.outputs) {
    a.user.set_data_handle(*optr++);
    args.emplace(a.arg, a.prim);
  }
  e.primitive.execute(stream, args);
  for (ConvArg& a : e.outputs)
    if (a.reordered) a.reorder.execute(stream, a.prim, a.user);
  stream.wait();
  return true;
}

}  // namespace

bool conv_enabled() { return conv_flag().load(std::memory_order_relaxed); }

bool conv_bf16_enabled() { return conv_enabled() && bf16_gemm_enabled(); }

bool set_conv(bool enabled) { return conv_flag().exchange(enabled); }

std::string conv_description() {
  const dnnl_version_t* v = dnnl_version();
  const std::string onednn = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                             std::to_string(v->patch);
  if (!conv_enabled()) return "gather + GEMM: switched off (BOOSTER_ONEDNN=0); " + onednn + " is built in";
  std::string bf16 = "bfloat16 on " + std::string(cpu::bf16_instructions_name());
  if (!cpu::has_bf16_instructions()) bf16 = "bfloat16 as gather + GEMM (no bfloat16 instructions)";
  else if (cpu::isa_level() != cpu::IsaLevel::Avx512) bf16 = "bfloat16 as gather + GEMM (kernel level below avx512)";
  return onednn + " direct convolutions and max pooling, float32 and " + bf16 + " (BOOSTER_ONEDNN=0 turns it off)";
}

bool conv_forward(const ConvShape& s, ConvType t, const void* x, const void* w, const void* bias, void* y) {
  if (bias) return run_conv(ConvKind::Forward, s, t, true, {x, w, bias}, {y});
  return run_conv(ConvKind::Forward, s, t, false, {x, w}, {y});
}

bool conv_backward_data(const ConvShape& s, ConvType t, const void* dy, const void* w, void* dx) {
  return run_conv(ConvKind::BackwardData, s, t, false, {dy, w}, {dx});
}

bool conv_backward_weights(const ConvShape& s, ConvType t, const void* x, const void* dy, void* dw, void* dbias) {
  if (dbias) return run_conv(ConvKind::BackwardWeights, s, t, true, {x, dy}, {dw, dbias});
  return run_conv(ConvKind::BackwardWeights, s, t, false, {x, dy}, {dw});
}

namespace {
bool pool_shape_ok(const ConvShape& s) { return s.cout == s.c && s.groups == 1 && s.dh == 1 && s.dw == 1; }
}  // namespace

int64_t max_pool_workspace_bytes(const ConvShape& s, ConvType t) {
  if (!pool_shape_ok(s)) return -1;
  const ConvEntry* e = conv_entry(ConvKind::PoolForward, s, t, false);
  return e ? e->workspace_bytes : -1;
}

bool max_pool_forward(const ConvShape& s, ConvType t, const void* x, void* y, void* workspace) {
  return pool_shape_ok(s) && run_conv(ConvKind::PoolForward, s, t, false, {x}, {y, workspace});
}

bool max_pool_backward(const ConvShape& s, ConvType t, const void* dy, const void* workspace, void* dx) {
  return pool_shape_ok(s) && run_conv(ConvKind::PoolBackward, s, t, false, {dy, workspace}, {dx});
}

}  // namespace booster::onednn
