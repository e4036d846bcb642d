#include "booster/nn/container.h"

namespace booster::nn {

Sequential::Sequential(std::vector<ModulePtr> modules) {
  for (auto& m : modules) push_back(std::move(m));
}

Sequential& Sequential::push_back(ModulePtr module) { return push_back(std::to_string(modules_.size()), std::move(module)); }

Sequential& Sequential::push_back(const std::string& name, ModulePtr module) {
  register_module(name, module);
  modules_.push_back(std::move(module));
  return *this;
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (const auto& m : modules_) h = (*m)(h);
  return h;
}

}  // namespace booster::nn
