// Autocast: a thread-local (enabled, dtype) state and a per-op cast policy table, consulted where an
// op is entered, above the kernels.
//
// Note [Autocast policy]
// Each op that autocast knows has a CastPolicy:
//   Lower   - floating inputs are cast to the autocast dtype (matmul, linear, bmm, attention): the
//             GEMM-heavy ops that gain from float16/bfloat16.
//   Float32 - floating inputs are cast up to float32 (softmax, layer_norm, exp/log/pow, sums, losses):
//             the ops whose range or accumulation float16 would ruin. batch_norm is not one (as in
//             PyTorch): it keeps its input's dtype and accumulates in float32.
//   Promote - inputs are cast to the widest floating dtype among them (add, mul, cat, where, ...).
//   None    - untouched.
// The table is data: a mixed-precision strategy may install its own (apex's O1 lists differ from
// torch's). No kernel ever asks which strategy is active.
// Casts of one float32 leaf (a weight) to the autocast dtype are cached for the life of the outermost
// AutocastGuard, so a weight used by several ops in one forward is converted once.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "booster/tensor/tensor.h"

namespace booster::autocast {

enum class CastPolicy : uint8_t { None, Lower, Float32, Promote };

// Ops autocast knows. Keep in sync with op_name().
enum class Op : uint8_t {
  Matmul, Linear, Bmm, Attention, Conv2d,
  Softmax, LogSoftmax, LayerNorm, BatchNorm, Exp, Log, Pow, Sum, Mean, Var,
  CrossEntropy, NllLoss, MseLoss,
  Add, Sub, Mul, Div, Cat, Stack, Where, Maximum, Minimum,
  Count
};
const char* op_name(Op op);

using PolicyTable = std::array<CastPolicy, size_t(Op::Count)>;

// A strategy's own computation of chosen linear layers (fp8 GEMMs), consulted by linear() at entry
// while autocast is on, before the cast policy. It receives the inputs as the caller passed them.
class LinearOverride {
 public:
  virtual ~LinearOverride() = default;
  // The output of linear(x, weight, bias) computed the strategy's way, or an undefined Tensor for the
  // usual path (a layer the strategy did not choose).
  virtual Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) = 0;
};

// PyTorch's lists for CUDA autocast: Lower for GEMMs, Float32 for the numerically sensitive ops,
// Promote for the multi-input elementwise ops.
PolicyTable default_policy_table();

struct State {
  bool enabled = false;
  DType dtype = DType::Float16;
  std::shared_ptr<const PolicyTable> table;  // null: default table
  std::shared_ptr<LinearOverride> linear_override;  // null: none
};

const State& state();
bool is_enabled();
DType autocast_dtype();
// The policy autocast applies to `op` right now (None while disabled), for an op that computes the
// policy's result its own way (a loss reading 16-bit logits as they are, in float32).
CastPolicy current_policy(Op op);

// Enables autocast to `dtype` for this thread until destruction (nests; the outermost one clears the
// cast cache on exit).
class AutocastGuard {
 public:
  explicit AutocastGuard(bool enabled, DType dtype = DType::Float16,
                         std::shared_ptr<const PolicyTable> table = nullptr,
                         std::shared_ptr<LinearOverride> linear_override = nullptr);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  State prev_;
};

// Applies op's policy to its tensor inputs in place (undefined tensors and non-floating ones are left
// alone). Called by ops at entry; a no-op when autocast is off.
void apply(Op op, std::initializer_list<Tensor*> inputs);
void apply(Op op, std::vector<Tensor>& inputs);

// The linear override of the innermost enabled guard, or null.
LinearOverride* linear_override();

// Number of cast-cache hits and entries since the outermost guard opened (tests).
size_t cache_size();

}  // namespace booster::autocast
