// bench_step: the time of one float32 training step (forward, backward, AdamW step, zero_grad).
//
//   build/bin/bench_step [--steps N] [--warmup N] [--workload mlp|gpt|all]
//
// Workloads (bench/torch_step.py runs the same ones in PyTorch; bench/run_step_bench.sh compares):
//   mlp: MLPClassifier 784-1024-1024-10 (ReLU), batch 256, cross-entropy on random data and labels.
//   gpt: GPT vocab 256, context 128, width 256, 4 layers, 4 heads, batch 8 of random tokens.
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

void bench_mlp(int warmup, int steps) {
  const int64_t batch = 256;
  Generator gen(0);
  auto model = std::make_shared<nn::MLPClassifier>(784, std::vector<int64_t>{1024, 1024}, 10, "relu", 0);
  optim::AdamW optimizer(model->parameters(), nlohmann::json{{"lr", 1e-3}});
  Tensor x = randn({batch, 784}, &gen);
  Tensor y = randint(0, 10, {batch}, &gen);
  auto step = [&] {
    Tensor loss = cross_entropy((*model)(x), y);
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
  };
  report("mlp_784_1024_1024_10_b256", median_step_seconds(step, warmup, steps), model->num_parameters(), batch);
}

void bench_gpt(int warmup, int steps) {
  const int64_t batch = 8;
  nn::GPTConfig config;
  config.vocab_size = 256;
  config.context = 128;
  config.width = 256;
  config.layers = 4;
  config.heads = 4;
  Generator gen(0);
  auto model = std::make_shared<nn::GPT>(config, 0);
  optim::AdamW optimizer(model->parameters(), nlohmann::json{{"lr", 1e-3}});
  Tensor idx = randint(0, config.vocab_size, {batch, config.context}, &gen);
  Tensor target = randint(0, config.vocab_size, {batch * config.context}, &gen);
  auto step = [&] {
    Tensor logits = (*model)(idx);
    Tensor loss = cross_entropy(logits.reshape({-1, config.vocab_size}), target);
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
  };
  report("gpt_v256_t128_w256_l4_h4_b8", median_step_seconds(step, warmup, steps), model->num_parameters(),
         batch * config.context);
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 20, warmup = 3;
  std::string workload = "all";
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
    else {
      std::fprintf(stderr, "usage: bench_step [--steps N] [--warmup N] [--workload mlp|gpt|all]\n");
      return arg == "--help" || arg == "-h" ? 0 : 2;
    }
  }
  try {
    if (workload == "mlp" || workload == "all") bench_mlp(warmup, steps);
    if (workload == "gpt" || workload == "all") bench_gpt(warmup, steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
