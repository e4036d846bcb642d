// Dropout: zeroes elements with probability p while training (torch.nn.Dropout).
#pragma once

#include <memory>

#include "booster/nn/module.h"
#include "booster/tensor/random.h"

namespace booster::nn {

class Dropout : public Module {
 public:
  // The masks come from `gen`, which several dropouts of one model may share so that a run is
  // repeatable from one seed; the default generator when null.
  explicit Dropout(double p = 0.5, std::shared_ptr<Generator> gen = nullptr);

  // Identity in eval mode or with p == 0; otherwise scales kept elements by 1 / (1 - p).
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "Dropout"; }
  std::vector<std::pair<std::string, Generator*>> own_generators() const override {
    if (gen_) return {{"generator", gen_.get()}};
    return {};
  }
  std::string extra_repr() const override { return str("p=", p); }

  const double p;

 private:
  std::shared_ptr<Generator> gen_;
};

}  // namespace booster::nn
