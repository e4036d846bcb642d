// Linear: y = x W^T + b over the last dim (torch.nn.Linear).
#pragma once

#include "booster/nn/module.h"
#include "booster/tensor/random.h"

namespace booster::nn {

class Linear : public Module {
 public:
  // PyTorch's default init: kaiming_uniform_(a = sqrt(5)) for the weight, which is
  // U(-1/sqrt(in), 1/sqrt(in)), and the same bound for the bias. Weight first, then bias, from gen
  // (the default generator when null).
  Linear(int64_t in_features, int64_t out_features, bool bias = true, Generator* gen = nullptr);
  // A layer over existing tensors: weight [out, in] and bias [out] (or undefined) become its parameters
  // themselves, not copies. Weight tying: a language model's head over its embedding's table, one
  // tensor listed once by named_parameters() (under its first name) and updated once per step.
  explicit Linear(Tensor weight, Tensor bias = Tensor());

  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "Linear"; }
  std::string extra_repr() const override;

  int64_t in_features, out_features;
  // On a GPU, the output's rows are laid out round_up(out_features, this) apart (see ops' linear).
  int64_t output_row_multiple = 1;
  Tensor weight;  // [out, in]
  Tensor bias;    // [out], undefined without bias
};

}  // namespace booster::nn
