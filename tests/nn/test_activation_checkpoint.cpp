// Activation checkpointing (Note [Recomputing in backward]): gradients equal to the plain run's bit for
// bit, with dropout and under autocast, the random streams left as a plain run leaves them, and less
// memory held between forward and backward.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/nn/nn.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/storage.h"

using namespace booster;

namespace {

// Every parameter's gradient as bytes.
std::string grad_bytes(const nn::Module& m) {
  std::string out;
  for (const auto& [name, p] : m.named_parameters()) {
    REQUIRE(p.grad().defined());
    const Tensor g = p.grad().contiguous();
    out += name;
    out.append(static_cast<const char*>(g.data_ptr()), g.nbytes());
  }
  return out;
}

std::shared_ptr<nn::Sequential> block(uint64_t seed) {
  Generator init(seed);
  auto seq = std::make_shared<nn::Sequential>();
  seq->push_back(std::make_shared<nn::Linear>(16, 32, true, &init));
  seq->push_back(std::make_shared<nn::GELU>());
  seq->push_back(std::make_shared<nn::Dropout>(0.3));  // draws from the default generator
  seq->push_back(std::make_shared<nn::Linear>(32, 16, true, &init));
  return seq;
}

}  // namespace

TEST_CASE("checkpoint: an MLP block with dropout gets the plain run's gradients, also under autocast",
          "[checkpoint_activations]") {
  for (bool autocast_on : {false, true}) {
    INFO("autocast bf16 " << autocast_on);
    auto run = [&](bool checkpointed, std::vector<uint64_t>& rng_after) {
      auto a = block(1), b = block(2);
      manual_seed(42);
      Generator g(3);
      Tensor x = randn({8, 16}, &g).requires_grad_();
      Tensor loss;
      {
        autocast::AutocastGuard ac(autocast_on, DType::BFloat16);
        Tensor h = checkpointed ? nn::checkpoint(*a, x) : (*a)(x);
        h = checkpointed ? nn::checkpoint(*b, relu(h)) : (*b)(relu(h));
        loss = sum(mul(h.to(DType::Float32), h.to(DType::Float32)));
      }
      loss.backward();
      rng_after = default_generator().state();
      std::string bytes = grad_bytes(*a) + grad_bytes(*b);
      const Tensor gx = x.grad().contiguous();
      bytes.append(static_cast<const char*>(gx.data_ptr()), gx.nbytes());
      return bytes;
    };
    std::vector<uint64_t> rng_plain, rng_checkpointed;
    const std::string plain = run(false, rng_plain);
    const std::string checkpointed = run(true, rng_checkpointed);
    CHECK(plain == checkpointed);
    CHECK(rng_plain == rng_checkpointed);
  }
}

TEST_CASE("checkpoint: outside grad mode it is a plain forward, and the wrapper keeps parameters under module.",
          "[checkpoint_activations]") {
  auto a = block(1);
  Generator g(3);
  const Tensor x = randn({4, 16}, &g);
  a->eval();
  autograd::NoGradGuard ng;
  const Tensor plain = (*a)(x);
  nn::Checkpoint wrapped(a);
  CHECK(wrapped(x).tolist() == plain.tolist());
  CHECK(wrapped.named_parameters().front().first == "module.0.weight");
}

TEST_CASE("checkpoint: the GPT with dropout trains a step under bf16 with the plain run's gradients and less memory",
          "[checkpoint_activations][gpt]") {
  for (const std::string precision : {"fp32", "bf16"}) {
    INFO(precision);
    auto run = [&](bool checkpointed, size_t& peak) {
      nn::GPTConfig c{256, 64, 64, 4, 4, 0.1};
      c.activation_checkpointing = checkpointed;
      auto gpt = std::make_shared<nn::GPT>(c, 7);
      Booster booster(BoosterConfig{.mixed_precision = precision});
      auto opt = std::make_shared<optim::AdamW>(gpt->parameters(), nlohmann::json{{"lr", 1e-3}});
      nn::Criterion ce = [](const Tensor& o, const Tensor& t) {
        return cross_entropy(o.reshape({-1, o.size(-1)}), t.reshape({-1}));
      };
      auto [model, optimizer, criterion, loader, scheduler] = booster.boost(gpt, opt, ce);
      Generator g(5);
      const Tensor idx = randint(0, 256, {4, 64}, &g), target = randint(0, 256, {4, 64}, &g);
      reset_cpu_peak_bytes();
      Tensor loss = criterion((*model)(idx), target);
      booster.backward(loss, *optimizer);
      peak = cpu_peak_bytes();
      return grad_bytes(*gpt);
    };
    size_t plain_peak = 0, checkpointed_peak = 0;
    const std::string plain = run(false, plain_peak);
    const std::string checkpointed = run(true, checkpointed_peak);
    CHECK(plain == checkpointed);
    INFO("peak bytes: plain " << plain_peak << ", checkpointed " << checkpointed_peak);
    CHECK(checkpointed_peak < plain_peak);
  }
}
