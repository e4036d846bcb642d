// LoRA adapters on Linear layers (lora.h): two children and a forward hook per adapted layer, so
// every model whose layers are nn::Linear takes them without code of its own.
//
// Note [LoRA as a hook]
// ~~~~~~~~~~~~~~~~~~~~~
// The model's layers call their Linears through typed members ((*q_proj)(h)), so an adapter cannot
// replace the layer in the module tree; it attaches to it instead: lora_A and lora_B become the Linear's
// children (so they are parameters of the model, saved, loaded and handed to the optimizer under PEFT's
// names) and a forward hook adds s B A dropout(x) to the layer's output. The hook runs inside the
// layer's call, so it runs under the strategy's autocast, and a plugin's hooks registered later (ZeRO-3
// gathers lora_A and lora_B as modules of their own) see the adapted output.
#include "booster/nn/lora.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <set>
#include <sstream>

#include "booster/common/error.h"
#include "booster/nn/dropout.h"
#include "booster/nn/linear.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"
#include "booster/tensor/random.h"

namespace booster::nn {

double LoraConfig::scaling() const { return use_rslora ? alpha / std::sqrt(double(r)) : alpha / double(r); }

void LoraConfig::validate() const {
  BOOSTER_CHECK(r >= 1, ValueError, "lora: r is ", r, "; the adapters' rank must be >= 1 (8 and 16 are usual)");
  BOOSTER_CHECK(std::isfinite(alpha) && alpha > 0.0, ValueError, "lora: alpha is ", alpha,
                "; it must be > 0 (often 2 r)");
  BOOSTER_CHECK(dropout >= 0.0 && dropout < 1.0, ValueError, "lora: dropout is ", dropout, "; it must be in [0, 1)");
  BOOSTER_CHECK(!target_modules.empty(), ValueError,
                "lora: target_modules is empty; name the Linear layers to adapt, e.g. [\"q_proj\", \"v_proj\"]");
}

// peft.cpp: checks init_from's settings against `config` and loads its A and B into the adapters.
void load_lora_init_from(Module& model, const LoraConfig& config);

std::vector<std::string> apply_lora(Module& model, const LoraConfig& config) {
  config.validate();
  for (const auto& [name, p] : model.named_parameters())
    BOOSTER_CHECK(name.find(".lora_A.") == std::string::npos, StateError, "lora: the model has adapters already ('",
                  name, "'); apply LoRA once");
  // The Linears, by path, found first: the adapters are Linears too and must not be adapted.
  std::vector<std::pair<std::string, std::shared_ptr<Linear>>> targets;
  std::set<std::string> linear_names;
  const std::set<std::string> wanted(config.target_modules.begin(), config.target_modules.end());
  std::function<void(Module&, const std::string&)> walk = [&](Module& m, const std::string& prefix) {
    for (const auto& [name, child] : m.named_children()) {
      const std::string path = prefix.empty() ? name : prefix + "." + name;
      if (auto linear = std::dynamic_pointer_cast<Linear>(child)) {
        linear_names.insert(name);
        if (wanted.count(name)) targets.emplace_back(path, linear);
      }
      walk(*child, path);
    }
  };
  walk(model, "");
  if (targets.empty()) {
    std::ostringstream names;
    for (const std::string& n : linear_names) names << (names.tellp() > 0 ? ", " : "") << n;
    BOOSTER_FAIL(ConfigError, "lora: no Linear layer of the ", model.name(), " is named in target_modules; its Linear "
                 "layers are named ", linear_names.empty() ? std::string("(none)") : names.str());
  }

  for (Tensor& p : model.parameters()) p.requires_grad_(false);  // only the adapters train
  Generator gen(config.seed);
  auto dropout_gen = std::make_shared<Generator>(config.seed + 1);
  const double s = config.scaling();
  std::vector<std::string> adapted;
  for (auto& [path, linear] : targets) {
    // A: kaiming-uniform (a = sqrt(5)), a Linear's own default; B: zero. Beside the base weight.
    auto A = std::make_shared<Linear>(linear->in_features, config.r, /*bias=*/false, &gen);
    auto B = std::make_shared<Linear>(config.r, linear->out_features, /*bias=*/false, &gen);
    {
      NoGradGuard no_grad;
      B->weight.fill_(0.0);
    }
    if (linear->weight.device() != Device::cpu()) {
      A->to(linear->weight.device());
      B->to(linear->weight.device());
    }
    linear->add_module("lora_A", A);
    linear->add_module("lora_B", B);
    std::shared_ptr<Dropout> drop;
    if (config.dropout > 0.0) {
      drop = std::make_shared<Dropout>(config.dropout, dropout_gen);
      linear->add_module("lora_dropout", drop);
    }
    // Note [LoRA as a hook]
    linear->register_forward_hook([A, B, drop, s](Module&, const Tensor& x, const Tensor& y) {
      const Tensor h = drop ? (*drop)(x) : x;
      return y + (*B)((*A)(h)) * s;
    });
    adapted.push_back(path);
  }
  model.set_tensor_names();
  if (!config.init_from.empty()) load_lora_init_from(model, config);
  return adapted;
}

std::vector<Tensor> trainable_parameters(const Module& model) {
  std::vector<Tensor> out;
  for (const Tensor& p : model.parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

}  // namespace booster::nn
