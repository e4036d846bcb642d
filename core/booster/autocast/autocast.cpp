#include "booster/autocast/autocast.h"

#include <unordered_map>

#include "booster/tensor/grad_mode.h"

namespace booster::autocast {

namespace {

struct ThreadState {
  State state;
  int depth = 0;  // open guards that enabled autocast
  // Note [Autocast cast cache]: leaf float32 tensor -> its cast, valid while the leaf's version holds.
  struct Entry {
    std::weak_ptr<TensorImpl> source;
    uint64_t version;
    DType dtype;
    Tensor cast;
  };
  std::unordered_map<TensorImpl*, Entry> cache;
};

thread_local ThreadState t_state;

const std::shared_ptr<const PolicyTable>& default_table() {
  static const auto table = std::make_shared<const PolicyTable>(default_policy_table());
  return table;
}

Tensor cast_to(const Tensor& t, DType dtype) {
  // Cache casts of leaves that require grad (the weights): the same weight feeds several ops.
  const bool cacheable = t.is_leaf() && t.requires_grad() && autograd::grad_mode_enabled();
  if (!cacheable) return t.to(dtype);
  auto& cache = t_state.cache;
  auto it = cache.find(t.impl());
  if (it != cache.end() && !it->second.source.expired() && it->second.version == t.version() &&
      it->second.dtype == dtype)
    return it->second.cast;
  Tensor c = t.to(dtype);
  cache[t.impl()] = {t.impl_ptr(), t.version(), dtype, c};
  return c;
}

}  // namespace

const char* op_name(Op op) {
  static const char* names[] = {"matmul", "linear", "bmm", "attention", "conv2d", "softmax", "log_softmax",
                                "layer_norm", "batch_norm", "exp", "log", "pow", "sum", "mean", "var",
                                "cross_entropy", "nll_loss", "mse_loss", "add", "sub", "mul", "div", "cat",
                                "stack", "where", "maximum", "minimum"};
  static_assert(sizeof(names) / sizeof(names[0]) == size_t(Op::Count));
  return names[size_t(op)];
}

PolicyTable default_policy_table() {
  PolicyTable t{};
  t.fill(CastPolicy::None);
  for (Op op : {Op::Matmul, Op::Linear, Op::Bmm, Op::Attention, Op::Conv2d}) t[size_t(op)] = CastPolicy::Lower;
  // batch_norm is not among them, as in PyTorch's CPU and CUDA autocast: it runs in its input's dtype,
  // with float32 statistics and accumulation (the kernels' acc_t), so a 16-bit convolution's output
  // stays 16-bit through batch norm, ReLU and pooling to the next convolution.
  for (Op op : {Op::Softmax, Op::LogSoftmax, Op::LayerNorm, Op::Exp, Op::Log, Op::Pow, Op::Sum, Op::Mean, Op::Var,
                Op::CrossEntropy, Op::NllLoss, Op::MseLoss})
    t[size_t(op)] = CastPolicy::Float32;
  for (Op op : {Op::Add, Op::Sub, Op::Mul, Op::Div, Op::Cat, Op::Stack, Op::Where, Op::Maximum, Op::Minimum})
    t[size_t(op)] = CastPolicy::Promote;
  return t;
}

const State& state() { return t_state.state; }
LinearOverride* linear_override() { return t_state.state.enabled ? t_state.state.linear_override.get() : nullptr; }
bool is_enabled() { return t_state.state.enabled; }
DType autocast_dtype() { return t_state.state.dtype; }

CastPolicy current_policy(Op op) {
  const State& st = t_state.state;
  if (!st.enabled) return CastPolicy::None;
  return (st.table ? *st.table : *default_table())[size_t(op)];
}

AutocastGuard::AutocastGuard(bool enabled, DType dtype, std::shared_ptr<const PolicyTable> table,
                             std::shared_ptr<LinearOverride> linear_override)
    : prev_(t_state.state) {
  BOOSTER_CHECK(!enabled || is_low_precision(dtype), DTypeError,
                "autocast: dtype must be float16 or bfloat16, got ", dtype);
  t_state.state = State{enabled, dtype, table ? std::move(table) : default_table(),
                        enabled ? std::move(linear_override) : nullptr};
  if (enabled) ++t_state.depth;
}

AutocastGuard::~AutocastGuard() {
  if (t_state.state.enabled && --t_state.depth == 0) t_state.cache.clear();
  t_state.state = prev_;
}

size_t cache_size() { return t_state.cache.size(); }

namespace {

template <class Range>
void apply_range(Op op, Range&& inputs) {
  const State& st = t_state.state;
  if (!st.enabled) return;
  const PolicyTable& table = st.table ? *st.table : *default_table();
  const CastPolicy policy = table[size_t(op)];
  switch (policy) {
    case CastPolicy::None: return;
    case CastPolicy::Lower:
      for (Tensor* t : inputs)
        if (t->defined() && t->dtype() == DType::Float32) *t = cast_to(*t, st.dtype);
      return;
    case CastPolicy::Float32:
      for (Tensor* t : inputs)
        if (t->defined() && is_low_precision(t->dtype())) *t = t->to(DType::Float32);
      return;
    case CastPolicy::Promote: {
      DType widest = DType::Bool;
      bool any_float = false;
      for (Tensor* t : inputs)
        if (t->defined() && is_floating(t->dtype())) {
          widest = any_float ? promote_types(widest, t->dtype()) : t->dtype();
          any_float = true;
        }
      if (!any_float) return;
      for (Tensor* t : inputs)
        if (t->defined() && is_floating(t->dtype()) && t->dtype() != widest) *t = t->to(widest);
      return;
    }
  }
}

}  // namespace

void apply(Op op, std::initializer_list<Tensor*> inputs) { apply_range(op, inputs); }

void apply(Op op, std::vector<Tensor>& inputs) {
  if (!t_state.state.enabled) return;
  std::vector<Tensor*> ptrs;
  ptrs.reserve(inputs.size());
  for (Tensor& t : inputs) ptrs.push_back(&t);
  apply_range(op, ptrs);
}

}  // namespace booster::autocast
