// A test model library (Note [Model libraries] in booster/nn/model_registry.h), built into
// build/test_models/libbooster_model_toy.so, off the search path:
//   toy_mlp   x -> Linear(in, hidden) -> tanh -> Linear(hidden, classes); options checked with OptionReader
//   throws    a factory that throws something that is not a booster error
//   nothing   a factory that returns no model
#include <stdexcept>

#include "booster/config/option_reader.h"
#include "booster/nn/activation.h"
#include "booster/nn/linear.h"
#include "booster/nn/model_registry.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"

namespace {

using namespace booster;

class ToyMLP : public nn::Module {
 public:
  ToyMLP(int64_t in, int64_t hidden, int64_t classes, uint64_t seed) {
    Generator gen(seed);
    fc1_ = register_module("fc1", std::make_shared<nn::Linear>(in, hidden, true, &gen));
    fc2_ = register_module("fc2", std::make_shared<nn::Linear>(hidden, classes, true, &gen));
    set_tensor_names();
  }
  Tensor forward(const Tensor& x) override { return (*fc2_)(tanh((*fc1_)(x.reshape({x.size(0), -1})))); }
  std::string name() const override { return "ToyMLP"; }

 private:
  std::shared_ptr<nn::Linear> fc1_, fc2_;
};

nn::ModulePtr make_toy_mlp(const nlohmann::json& cfg, uint64_t seed) {
  config::OptionReader options("model", "toy_mlp", cfg);
  options.raw("type", "toy_mlp");
  const int64_t in = options.integer("in", 8, 1, 1 << 20);
  const int64_t hidden = options.integer("hidden", 16, 1, 1 << 20);
  const int64_t classes = options.integer("classes", 3, 2, 1 << 20);
  options.finish();
  return std::make_shared<ToyMLP>(in, hidden, classes, seed);
}

void register_models(nn::ModelRegistrar& models) {
  models.add("toy_mlp", make_toy_mlp);
  models.add("throws", [](const nlohmann::json&, uint64_t) -> nn::ModulePtr { throw std::runtime_error("the toy factory always throws"); });
  models.add("nothing", [](const nlohmann::json&, uint64_t) -> nn::ModulePtr { return nullptr; });
}

}  // namespace

BOOSTER_MODEL_LIBRARY("toy", register_models)
