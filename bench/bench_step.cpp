// bench_step: the time of one float32 training step (forward, backward, AdamW step, zero_grad).
//
//   build/bin/bench_step [--steps N] [--warmup N] [--workload mlp|gpt|all] [--precision P]
//
// Workloads (bench/torch_step.py runs the same ones in PyTorch; bench/run_step_bench.sh compares):
//   mlp: MLPClassifier 784-1024-1024-10 (ReLU), batch 256, cross-entropy on random data and labels.
//   gpt: GPT vocab 256, context 128, width 256, 4 layers, 4 heads, batch 8 of random tokens.
// --precision fp32 (default) times the plain float32 step; fp16, bf16, fp16_naive, ... (any registered
// mixed-precision strategy) time the step through that strategy (configure, scaled backward, step),
// and the workload name gets the suffix "_<precision>".
// Prints one JSON line per workload with the median step time, and gflops = 6 x parameters x
// (samples or tokens) per second, the usual estimate of training FLOPs.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/models.h"    // MLPClassifier, GPT
#include "booster/ops/ops.h"      // randn, randint, cross_entropy
#include "booster/optim/optimizer.h"  // AdamW

using namespace booster;
using Clock = std::chrono::steady_clock;

namespace {

// The thread count as set for OpenMP (and OpenBLAS), or "default".
std::string threads_setting() {
  const char* env = std::getenv("OMP_NUM_THREADS");
  return env && *env ? env : "default";
}

// Median seconds of `steps` calls of `step` after `warmup` untimed ones.
double median_step_seconds(const std::function<void()>& step, int warmup, int steps) {
  for (int i = 0; i < warmup; ++i) step();
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    auto t0 = Clock::now();
    step();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void report(const std::string& workload, double seconds, int64_t params, int64_t items) {
  nlohmann::json line = {{"workload", workload},
                         {"ms_per_step", seconds * 1e3},
                         {"gflops", 6.0 * double(params) * double(items) / seconds / 1e9},
                         {"params", params},
                         {"threads", threads_setting()},
                         {"framework", "booster"}};
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

// Times the step of `model` on (x, y) with AdamW and `criterion`, in float32 or through a strategy.
void bench(const std::string& workload, nn::ModulePtr model, const Tensor& x, const Tensor& y,
           mixed_precision::Criterion criterion, const std::string& precision, int64_t items, int warmup,
           int steps) {
  const int64_t params = model->num_parameters();
  std::shared_ptr<optim::Optimizer> optimizer =
      std::make_shared<optim::AdamW>(model->parameters(), nlohmann::json{{"lr", 1e-3}});
  std::function<void()> step;
  std::string name = workload;
  std::unique_ptr<mixed_precision::MixedPrecision> mp;
  if (precision == "fp32") {
    step = [&] {
      Tensor loss = criterion((*model)(x), y);
      loss.backward();
      optimizer->step();
      optimizer->zero_grad();
    };
  } else {
    mp = mixed_precision::create(precision);
    auto configured = mp->configure(model, optimizer, criterion);
    model = configured.model;
    optimizer = configured.optimizer;
    criterion = configured.criterion;
    name += "_" + precision;
    step = [&] {
      Tensor loss = criterion((*model)(x), y);
      mp->backward(loss, *optimizer);
      mp->step(*optimizer);
      optimizer->zero_grad();
    };
  }
  report(name, median_step_seconds(step, warmup, steps), params, items);
}

void bench_mlp(const std::string& precision, int warmup, int steps) {
  const int64_t batch = 256;
  Generator gen(0);
  auto model = std::make_shared<nn::MLPClassifier>(784, std::vector<int64_t>{1024, 1024}, 10, "relu", 0);
  Tensor x = randn({batch, 784}, &gen);
  Tensor y = randint(0, 10, {batch}, &gen);
  auto criterion = [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
  bench("mlp_784_1024_1024_10_b256", model, x, y, criterion, precision, batch, warmup, steps);
}

void bench_gpt(const std::string& precision, int warmup, int steps) {
  const int64_t batch = 8;
  nn::GPTConfig config;
  config.vocab_size = 256;
  config.context = 128;
  config.width = 256;
  config.layers = 4;
  config.heads = 4;
  Generator gen(0);
  auto model = std::make_shared<nn::GPT>(config, 0);
  Tensor idx = randint(0, config.vocab_size, {batch, config.context}, &gen);
  Tensor target = randint(0, config.vocab_size, {batch * config.context}, &gen);
  const int64_t vocab = config.vocab_size;
  auto criterion = [vocab](const Tensor& logits, const Tensor& t) {
    return cross_entropy(logits.reshape({-1, vocab}), t);
  };
  bench("gpt_v256_t128_w256_l4_h4_b8", model, idx, target, criterion, precision, batch * config.context, warmup,
        steps);
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 20, warmup = 3;
  std::string workload = "all", precision = "fp32";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_step: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--steps") steps = std::max(1, std::atoi(value().c_str()));
    else if (arg == "--warmup") warmup = std::max(0, std::atoi(value().c_str()));
    else if (arg == "--workload") workload = value();
    else if (arg == "--precision") precision = value();
    else {
      std::fprintf(stderr,
                   "usage: bench_step [--steps N] [--warmup N] [--workload mlp|gpt|all]"
                   " [--precision fp32|fp16|bf16|fp16_naive]\n");
      return arg == "--help" || arg == "-h" ? 0 : 2;
    }
  }
  try {
    if (workload == "mlp" || workload == "all") bench_mlp(precision, warmup, steps);
    if (workload == "gpt" || workload == "all") bench_gpt(precision, warmup, steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
