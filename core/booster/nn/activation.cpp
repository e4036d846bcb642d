#include "booster/nn/activation.h"

#include "booster/ops/ops.h"

namespace booster::nn {

Tensor ReLU::forward(const Tensor& x) { return relu(x); }

GELU::GELU(std::string approx) : approximate(std::move(approx)) {
  BOOSTER_CHECK(approximate == "none" || approximate == "tanh", ValueError, "GELU: approximate must be \"none\" or "
                "\"tanh\", got \"", approximate, "\"");
}

Tensor GELU::forward(const Tensor& x) { return gelu(x, approximate); }

Tensor Tanh::forward(const Tensor& x) { return tanh(x); }

ModulePtr make_activation(const std::string& kind) {
  if (kind == "relu") return std::make_shared<ReLU>();
  if (kind == "gelu") return std::make_shared<GELU>("none");
  if (kind == "gelu_tanh") return std::make_shared<GELU>("tanh");
  if (kind == "tanh") return std::make_shared<Tanh>();
  BOOSTER_FAIL(ConfigError, "activation: unknown activation \"", kind,
               "\"; expected one of \"relu\", \"gelu\", \"gelu_tanh\", \"tanh\"");
}

}  // namespace booster::nn
