// Elementwise activations as modules (torch.nn.ReLU, GELU, Tanh), for Sequential and configs.
#pragma once

#include "booster/nn/module.h"

namespace booster::nn {

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "ReLU"; }
};

class GELU : public Module {
 public:
  // "none": the exact erf form; "tanh": the tanh approximation (GPT-2's).
  explicit GELU(std::string approximate = "none");
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "GELU"; }
  std::string extra_repr() const override { return "approximate='" + approximate + "'"; }
  const std::string approximate;
};

class Tanh : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "Tanh"; }
};

// "relu", "gelu", "gelu_tanh", "tanh"; ConfigError naming the choices otherwise.
ModulePtr make_activation(const std::string& kind);

}  // namespace booster::nn
