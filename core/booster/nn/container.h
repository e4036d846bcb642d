// Sequential: children run in order, each one's output the next one's input (torch.nn.Sequential).
#pragma once

#include "booster/nn/module.h"

namespace booster::nn {

class Sequential : public Module {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<ModulePtr> modules);

  // Appends under the next index ("0", "1", ...), as PyTorch names Sequential's children.
  Sequential& push_back(ModulePtr module);
  // Appends under an explicit name.
  Sequential& push_back(const std::string& name, ModulePtr module);

  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "Sequential"; }

  size_t size() const { return modules_.size(); }
  const ModulePtr& operator[](size_t i) const { return modules_.at(i); }
  auto begin() const { return modules_.begin(); }
  auto end() const { return modules_.end(); }

 private:
  std::vector<ModulePtr> modules_;
};

}  // namespace booster::nn
