// A test model library (Note [Model libraries] in booster/nn/model_registry.h), built into
// build/test_models/libbooster_model_toy.so, off the search path:
//   toy_mlp   x -> Linear(in, hidden) -> tanh -> Linear(hidden, classes); options checked with OptionReader
//   throws    a factory that throws something that is not a booster error
//   nothing   a factory that returns no model
//   toy_nested  the MLP as blocks of a module class of the library's own, below the top level (objects
//             whose code is the library's, held by the model's children)
#include <stdexcept>
#include <vector>

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

// Linear -> tanh, a class of this library's own used as a child.
class Block : public nn::Module {
 public:
  Block(int64_t in, int64_t out, Generator* gen) { fc_ = register_module("fc", std::make_shared<nn::Linear>(in, out, true, gen)); }
  Tensor forward(const Tensor& x) override { return tanh((*fc_)(x)); }
  std::string name() const override { return "ToyBlock"; }

 private:
  std::shared_ptr<nn::Linear> fc_;
};

class ToyNested : public nn::Module {
 public:
  ToyNested(int64_t in, int64_t hidden, int64_t classes, uint64_t seed) {
    Generator gen(seed);
    blocks_.push_back(register_module("block0", std::make_shared<Block>(in, hidden, &gen)));
    blocks_.push_back(register_module("block1", std::make_shared<Block>(hidden, hidden, &gen)));
    head_ = register_module("head", std::make_shared<nn::Linear>(hidden, classes, true, &gen));
    set_tensor_names();
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x.reshape({x.size(0), -1});
    for (const auto& b : blocks_) h = (*b)(h);
    return (*head_)(h);
  }
  std::string name() const override { return "ToyNested"; }

 private:
  std::vector<std::shared_ptr<Block>> blocks_;
  std::shared_ptr<nn::Linear> head_;
};

nn::ModulePtr make_toy_nested(const nlohmann::json& cfg, uint64_t seed) {
  config::OptionReader options("model", "toy_nested", cfg);
  options.raw("type", "toy_nested");
  const int64_t in = options.integer("in", 8, 1, 1 << 20);
  const int64_t hidden = options.integer("hidden", 16, 1, 1 << 20);
  const int64_t classes = options.integer("classes", 3, 2, 1 << 20);
  options.finish();
  return std::make_shared<ToyNested>(in, hidden, classes, seed);
}

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
  models.add("toy_nested", make_toy_nested);
}

}  // namespace

BOOSTER_MODEL_LIBRARY("toy", register_models)
