#include "booster/nn/tensor_parallel.h"

#include "booster/autograd/autograd.h"
#include "booster/nn/linear.h"
#include "booster/ops/ops.h"

namespace booster::nn::tp {

namespace {

Tensor all_reduced(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = x.detach().contiguous().clone();
  group.all_reduce(out);
  return out;
}

Tensor gathered(const Tensor& x, distributed::ProcessGroup& group) {
  const Tensor in = x.detach().contiguous();
  const int n = group.size();
  Tensor all = Tensor::empty({int64_t(n) * in.numel()}, in.dtype(), in.device());
  group.all_gather(all, in);
  std::vector<Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(all.narrow(0, r * in.numel(), in.numel()).reshape(in.shape()));
  return cat(parts, -1);
}

Tensor slice_of(const Tensor& x, distributed::ProcessGroup& group) {
  const int64_t last = x.size(-1), n = group.size();
  BOOSTER_CHECK(last % n == 0, ShapeError, "tensor parallel: the last dim ", last, " of shape ", x.shape(),
                " does not divide by the tensor-parallel size ", n);
  return x.narrow(-1, group.rank() * (last / n), last / n).contiguous();
}

// The rows [rank * rows / n, (rank + 1) * rows / n) of `full` along dim 0 (weights) or dim 1.
Tensor shard(const Tensor& full, int64_t dim, distributed::ProcessGroup& group, const char* layer, const char* what) {
  const int64_t total = full.size(dim), n = group.size();
  BOOSTER_CHECK(total % n == 0, ShapeError, layer, ": ", what, " ", total, " does not divide by the tensor-parallel size ",
                n);
  NoGradGuard no_grad;
  return full.narrow(dim, group.rank() * (total / n), total / n).contiguous().clone();
}

}  // namespace

Tensor copy_to_group(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = x.detach();
  if (autograd::needs_grad({&x}))
    autograd::record(out, "CopyToTensorParallelBackward", {x},
                     [&group](const Tensor& g) { return autograd::grads{all_reduced(g, group)}; });
  return out;
}

Tensor reduce_from_group(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = all_reduced(x, group);
  if (autograd::needs_grad({&x}))
    autograd::record(out, "ReduceFromTensorParallelBackward", {x}, [](const Tensor& g) { return autograd::grads{g}; });
  return out;
}

Tensor gather_last_dim(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = gathered(x, group);
  if (autograd::needs_grad({&x}))
    autograd::record(out, "GatherFromTensorParallelBackward", {x},
                     [&group](const Tensor& g) { return autograd::grads{slice_of(g, group)}; });
  return out;
}

Tensor split_last_dim(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = slice_of(x.detach(), group);
  if (autograd::needs_grad({&x}))
    autograd::record(out, "SplitToTensorParallelBackward", {x},
                     [&group](const Tensor& g) { return autograd::grads{gathered(g, group)}; });
  return out;
}

ColumnParallelLinear::ColumnParallelLinear(int64_t in, int64_t out, distributed::ProcessGroup& group, bool with_bias,
                                           bool gather, Generator* gen)
    : in_features(in), out_features(out), out_per_rank(out / group.size()), gather_output(gather), group_(&group) {
  const Linear full(in, out, with_bias, gen);
  weight = register_parameter("weight", shard(full.weight, 0, group, "ColumnParallelLinear", "out_features"));
  if (with_bias) bias = register_parameter("bias", shard(full.bias, 0, group, "ColumnParallelLinear", "out_features"));
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  BOOSTER_CHECK(x.dim() >= 1 && x.size(-1) == in_features, ShapeError, "ColumnParallelLinear: expected input [..., ",
                in_features, "], got shape ", x.shape());
  const Tensor y = linear(copy_to_group(x, *group_), weight, bias);
  return gather_output ? gather_last_dim(y, *group_) : y;
}

std::string ColumnParallelLinear::extra_repr() const {
  return str("in_features=", in_features, ", out_features=", out_features, " (", out_per_rank, " per rank), bias=",
             bias.defined() ? "True" : "False", ", gather_output=", gather_output ? "True" : "False");
}

RowParallelLinear::RowParallelLinear(int64_t in, int64_t out, distributed::ProcessGroup& group, bool with_bias,
                                     bool parallel_input, Generator* gen)
    : in_features(in), out_features(out), in_per_rank(in / group.size()), input_is_parallel(parallel_input),
      group_(&group) {
  const Linear full(in, out, with_bias, gen);
  weight = register_parameter("weight", shard(full.weight, 1, group, "RowParallelLinear", "in_features"));
  if (with_bias) {
    NoGradGuard no_grad;
    bias = register_parameter("bias", full.bias.clone());
  }
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  const int64_t want = input_is_parallel ? in_per_rank : in_features;
  BOOSTER_CHECK(x.dim() >= 1 && x.size(-1) == want, ShapeError, "RowParallelLinear: expected input [..., ", want,
                input_is_parallel ? "] (this rank's slice of " : "] (of ", in_features, " features), got shape ",
                x.shape());
  const Tensor local = input_is_parallel ? x : split_last_dim(x, *group_);
  const Tensor y = reduce_from_group(linear(local, weight, Tensor()), *group_);
  return bias.defined() ? y + bias : y;
}

std::string RowParallelLinear::extra_repr() const {
  return str("in_features=", in_features, " (", in_per_rank, " per rank), out_features=", out_features,
             ", bias=", bias.defined() ? "True" : "False", ", input_is_parallel=", input_is_parallel ? "True" : "False");
}

}  // namespace booster::nn::tp
