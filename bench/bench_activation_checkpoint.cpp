// Activation checkpointing on the GPT workload of `booster bench` (vocab 256, context 128, width 256,
// 4 layers, 4 heads, batch 8, AdamW): peak tensor memory of a step and its median time, with and without.
//
//   build/bin/bench_activation_checkpoint [--precision NAME] [--steps N] [--layers L]
//
// Runs alternate between the two so drift in the machine's load hits both. Prints one JSON line.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/storage.h"

using namespace booster;

namespace {

struct Run {
  std::unique_ptr<Booster> booster;
  Boosted parts;
};

Run make(bool checkpointed, const std::string& precision, int64_t layers) {
  nn::GPTConfig c{256, 128, 256, layers, 4, 0.0};
  c.activation_checkpointing = checkpointed;
  auto gpt = std::make_shared<nn::GPT>(c, 0);
  Run r;
  r.booster = std::make_unique<Booster>(BoosterConfig{.mixed_precision = precision});
  auto opt = std::make_shared<optim::AdamW>(gpt->parameters(), nlohmann::json{{"lr", 1e-3}});
  nn::Criterion ce = [](const Tensor& o, const Tensor& t) { return cross_entropy(o.reshape({-1, o.size(-1)}), t.reshape({-1})); };
  r.parts = r.booster->boost(gpt, opt, ce);
  return r;
}

// Seconds and peak bytes of one step.
std::pair<double, size_t> step(Run& r, const Tensor& x, const Tensor& y) {
  reset_cpu_peak_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  r.parts.optimizer->zero_grad();
  Tensor loss = r.parts.criterion((*r.parts.model)(x), y);
  r.booster->backward(loss, *r.parts.optimizer);
  r.parts.optimizer->step();
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), cpu_peak_bytes()};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string precision = "fp32";
  int64_t steps = 10, layers = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--precision") precision = argv[i + 1];
    else if (a == "--steps") steps = std::atoll(argv[i + 1]);
    else if (a == "--layers") layers = std::atoll(argv[i + 1]);
    else {
      std::fprintf(stderr, "bench_activation_checkpoint: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  Generator gen(0);
  const Tensor x = randint(0, 256, {8, 128}, &gen), y = randint(0, 256, {8, 128}, &gen);
  Run plain = make(false, precision, layers), checkpointed = make(true, precision, layers);
  step(plain, x, y);  // warm-up
  step(checkpointed, x, y);
  std::vector<double> t_plain, t_ckpt;
  size_t peak_plain = 0, peak_ckpt = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const auto [a, pa] = step(plain, x, y);
    const auto [b, pb] = step(checkpointed, x, y);
    t_plain.push_back(a);
    t_ckpt.push_back(b);
    peak_plain = std::max(peak_plain, pa);
    peak_ckpt = std::max(peak_ckpt, pb);
  }
  std::cout << nlohmann::json{{"precision", precision},
                              {"layers", layers},
                              {"steps", steps},
                              {"plain_ms", 1e3 * median(t_plain)},
                              {"checkpointed_ms", 1e3 * median(t_ckpt)},
                              {"plain_peak_mib", double(peak_plain) / (1 << 20)},
                              {"checkpointed_peak_mib", double(peak_ckpt) / (1 << 20)}}
                   .dump()
            << std::endl;
}
