// Forward hooks on modules (Module::register_forward_pre_hook / register_forward_hook, as torch's):
// they fire around each call in registration order, nested modules in forward order; a hook's
// replacement output is what the caller and the autograd graph see; removal works, also from inside a
// hook; an installed ModuleCallObserver (the doctor's tracer) does not bypass them.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "booster/nn/linear.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"

using namespace booster;

TEST_CASE("forward hooks: pre and post hooks fire around each call, nested modules in forward order", "[nn][hooks]") {
  auto model = std::make_shared<nn::MLPClassifier>(4, std::vector<int64_t>{5}, 3, "relu", 1);
  std::vector<std::string> events;
  for (const auto& [name, child] : model->layers->named_children()) {
    child->register_forward_pre_hook([&events, name = name](nn::Module&, const Tensor& in) {
      events.push_back("pre " + name + " " + std::to_string(in.size(1)));
    });
    child->register_forward_hook([&events, name = name](nn::Module& m, const Tensor&, const Tensor& out) {
      events.push_back("post " + name + " " + m.name() + " " + std::to_string(out.size(1)));
      return Tensor();  // keep the output
    });
  }
  Generator gen(2);
  const Tensor x = randn({2, 4}, &gen);
  const std::vector<double> plain = (*model)(x).detach().tolist();
  CHECK(events == std::vector<std::string>{"pre 0 4", "post 0 Linear 5", "pre 1 5", "post 1 ReLU 5", "pre 2 5",
                                           "post 2 Linear 3"});
  // Keeping the output changes nothing.
  events.clear();
  CHECK((*model)(x).detach().tolist() == plain);
  CHECK(events.size() == 6);
}

TEST_CASE("forward hooks: a replaced output is what the caller and backward see, and removal stops a hook", "[nn][hooks]") {
  Generator gen(3);
  auto layer = std::make_shared<nn::Linear>(3, 2, true, &gen);
  const Tensor x = randn({4, 3}, &gen);
  // Reference: d(sum(2 y))/dW = 2 * dy/dW.
  sum(layer->forward(x) * 2.0).backward();
  const std::vector<double> doubled = layer->weight.grad().tolist();
  layer->zero_grad();

  const int64_t twice =
      layer->register_forward_hook([](nn::Module&, const Tensor&, const Tensor& out) { return out * 2.0; });
  int pre_calls = 0;
  const int64_t counting = layer->register_forward_pre_hook([&](nn::Module&, const Tensor&) { ++pre_calls; });
  const Tensor y = (*layer)(x);
  CHECK(y.tolist() == (layer->forward(x) * 2.0).detach().tolist());
  sum(y).backward();
  CHECK(layer->weight.grad().tolist() == doubled);
  CHECK(pre_calls == 1);

  CHECK(layer->remove_forward_hook(twice));
  CHECK_FALSE(layer->remove_forward_hook(twice));
  CHECK((*layer)(x).detach().tolist() == layer->forward(x).detach().tolist());
  CHECK(pre_calls == 2);
  CHECK(layer->remove_forward_hook(counting));
  (*layer)(x);
  CHECK(pre_calls == 2);

  // A hook that removes itself runs this once.
  int once = 0;
  int64_t self = 0;
  self = layer->register_forward_pre_hook([&](nn::Module& m, const Tensor&) {
    ++once;
    m.remove_forward_hook(self);
  });
  (*layer)(x);
  (*layer)(x);
  CHECK(once == 1);
  CHECK_THROWS_AS(layer->register_forward_hook(nullptr), ValueError);
}

namespace {
// Calls forward with a marker around it, as the tracer wraps calls.
struct Marking final : nn::ModuleCallObserver {
  std::vector<std::string>* events;
  Tensor call(nn::Module& module, const Tensor& input) override {
    events->push_back("observer " + module.name());
    return module.forward(input);
  }
};
}  // namespace

TEST_CASE("forward hooks: run around an installed call observer", "[nn][hooks]") {
  Generator gen(4);
  auto layer = std::make_shared<nn::Linear>(3, 2, true, &gen);
  std::vector<std::string> events;
  layer->register_forward_pre_hook([&](nn::Module&, const Tensor&) { events.push_back("pre"); });
  layer->register_forward_hook([&](nn::Module&, const Tensor&, const Tensor&) {
    events.push_back("post");
    return Tensor();
  });
  Marking observer;
  observer.events = &events;
  {
    nn::ModuleCallObserverScope scope(&observer);
    (*layer)(randn({1, 3}, &gen));
  }
  CHECK(events == std::vector<std::string>{"pre", "observer Linear", "post"});
}
