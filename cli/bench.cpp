// `booster bench`: the time of one training step (forward, backward, optimizer step, zero_grad) on one
// of the two benchmark workloads, through the Booster as a user's loop would run it.
//
//   booster bench --workload mlp|cnn|gpt [--precision NAME] [--plugin NAME] [--steps N] [--warmup N]
//                 [--hand-written | --compare-hand-written]
//
// Workloads (bench/torch_step.py runs the same ones in PyTorch; bench/run_bench.sh compares):
//   mlp: MLPClassifier 784-1024-1024-10 (ReLU), batch 256, cross-entropy on random data and labels.
//   cnn: CNNClassifier (conv32, conv64 with batch norm, 128 hidden), batch 128 of 1x28x28 random images.
//   gpt: GPT vocab 256, context 128, width 256, 4 layers, 4 heads, batch 8 x 128 random tokens.
// Both train with AdamW (lr 1e-3). Prints one line of JSON: the median wall time of a step, the median
// process CPU time of a step (robust to other jobs on a shared machine; with one thread it is the work
// done), gflops = 6 x parameters x (samples or tokens) per second, and the high-water mark of tensor
// memory over the timed steps (bytes of live CPU storages, from the caching allocator's counter).
//
// Note [Booster overhead]
// The Booster adds a layer of calls around the loop (strategy, plugin, boosted optimizer); it must cost
// nothing measurable. --hand-written times the same step written directly against the strategy (for
// fp32: the plain torch-style loop); --compare-hand-written builds both from the same seed in one
// process and alternates their steps, so drift in the machine's load hits both alike, and reports both
// medians and booster_overhead = boosted / hand-written - 1.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/common/error.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/cnn.h"          // CNNClassifier
#include "booster/nn/models.h"       // MLPClassifier, GPT
#include "booster/ops/ops.h"         // randn, randint, cross_entropy
#include "booster/optim/optimizer.h"  // AdamW
#include "booster/tensor/storage.h"  // cpu_peak_bytes
#include "commands.h"
#include "options.h"

namespace po = boost::program_options;

namespace booster::cli {
namespace {

using Clock = std::chrono::steady_clock;

// One benchmark workload: a freshly initialised model (seed 0) and one fixed batch.
struct Workload {
  std::string name;    // "mlp" or "gpt"
  std::string detail;  // the shape, as bench/torch_step.py names it
  nn::ModulePtr model;
  Tensor x, y;
  nn::Criterion criterion;
  int64_t items = 0;  // samples (MLP) or tokens (GPT) per step
};

Workload make_workload(const std::string& name) {
  Generator gen(0);
  Workload w;
  w.name = name;
  if (name == "mlp") {
    const int64_t batch = 256;
    w.detail = "mlp_784_1024_1024_10_b256";
    w.model = std::make_shared<nn::MLPClassifier>(784, std::vector<int64_t>{1024, 1024}, 10, "relu", 0);
    w.x = randn({batch, 784}, &gen);
    w.y = randint(0, 10, {batch}, &gen);
    w.criterion = [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
    w.items = batch;
    return w;
  }
  if (name == "cnn") {
    const int64_t batch = 128;
    w.detail = "cnn_c32_c64_h128_b128";
    w.model = std::make_shared<nn::CNNClassifier>(nn::CNNConfig{}, 0);
    w.x = randn({batch, 784}, &gen);
    w.y = randint(0, 10, {batch}, &gen);
    w.criterion = [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
    w.items = batch;
    return w;
  }
  BOOSTER_CHECK(name == "gpt", ConfigError, "booster bench: unknown workload '", name, "'; expected mlp, cnn or gpt");
  const int64_t batch = 8;
  nn::GPTConfig config;
  config.vocab_size = 256;
  config.context = 128;
  config.width = 256;
  config.layers = 4;
  config.heads = 4;
  w.detail = "gpt_v256_t128_w256_l4_h4_b8";
  w.model = std::make_shared<nn::GPT>(config, 0);
  w.x = randint(0, config.vocab_size, {batch, config.context}, &gen);
  w.y = randint(0, config.vocab_size, {batch * config.context}, &gen);
  const int64_t vocab = config.vocab_size;
  w.criterion = [vocab](const Tensor& logits, const Tensor& t) { return cross_entropy(logits.reshape({-1, vocab}), t); };
  w.items = batch * config.context;
  return w;
}

std::shared_ptr<optim::Optimizer> make_optimizer(const nn::ModulePtr& model) {
  return std::make_shared<optim::AdamW>(model->parameters(), nlohmann::json{{"lr", 1e-3}});
}

// A training loop ready to step, and what it keeps alive.
struct Loop {
  std::function<void()> step;
  std::shared_ptr<void> keep_alive;
};

// The loop as a user writes it with the Booster (Note [Booster lifecycle] in booster/booster.h).
Loop boosted_loop(Workload& w, const std::string& precision, const std::string& plugin) {
  BoosterConfig config;
  config.mixed_precision = precision;
  config.plugin = plugin;
  auto booster = std::make_shared<Booster>(config);
  auto boosted = std::make_shared<Boosted>(booster->boost(w.model, make_optimizer(w.model), w.criterion));
  Loop loop;
  loop.step = [booster = booster.get(), b = boosted.get(), x = w.x, y = w.y] {
    b->optimizer->zero_grad();
    Tensor loss = b->criterion((*b->model)(x), y);
    booster->backward(loss, *b->optimizer);
    b->optimizer->step();
  };
  loop.keep_alive = std::make_shared<std::pair<std::shared_ptr<Booster>, std::shared_ptr<Boosted>>>(booster, boosted);
  return loop;
}

// The same step written by hand: for fp32 the plain loop, otherwise straight through the strategy.
Loop hand_written_loop(Workload& w, const std::string& precision) {
  std::shared_ptr<optim::Optimizer> optimizer = make_optimizer(w.model);
  Loop loop;
  if (precision == "fp32" || precision == "no") {
    loop.step = [model = w.model, optimizer, criterion = w.criterion, x = w.x, y = w.y] {
      optimizer->zero_grad();
      Tensor loss = criterion((*model)(x), y);
      loss.backward();
      optimizer->step();
    };
    return loop;
  }
  std::shared_ptr<mixed_precision::MixedPrecision> mp = mixed_precision::create(precision);
  mixed_precision::Configured c = mp->configure(w.model, optimizer, w.criterion);
  loop.step = [mp, c, x = w.x, y = w.y] {
    c.optimizer->zero_grad();
    Tensor loss = c.criterion((*c.model)(x), y);
    mp->backward(loss, *c.optimizer);
    mp->step(*c.optimizer);
  };
  return loop;
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Wall and process-CPU seconds of each call of `step`.
struct Timings {
  std::vector<double> wall, cpu;
  void time(const std::function<void()>& step) {
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
    step();
    wall.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    cpu.push_back(process_cpu_seconds() - c0);
  }
};

// Peak resident set size of this process (VmHWM), in bytes; 0 where /proc is not there.
int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

constexpr const char* kHelp =
    "usage: booster bench --workload mlp|cnn|gpt [--precision NAME] [--plugin NAME] [--steps N] [--warmup N]\n"
    "                     [--hand-written | --compare-hand-written]\n"
    "\n"
    "Times training steps (forward, backward, AdamW step, zero_grad) after a warm-up and prints one line\n"
    "of JSON: workload, precision, ms_per_step (median), cpu_ms_per_step (median process CPU time),\n"
    "gflops (6 x parameters x samples or tokens per second), peak_tensor_bytes (high-water mark of live\n"
    "tensor memory over the timed steps) and peak_rss_bytes.\n"
    "  mlp: MLP 784-1024-1024-10, batch 256;  gpt: GPT vocab 256, context 128, width 256, 4 layers,\n"
    "  4 heads, batch 8. Threads: OMP_NUM_THREADS. bench/run_bench.sh compares with PyTorch.\n"
    "\noptions";

}  // namespace

int bench(const std::vector<std::string>& args) {
  po::options_description desc(kHelp);
  std::string workload_name, precision, plugin;
  int steps = 20, warmup = 3;
  desc.add_options()
      ("help,h", "show this help")
      ("workload,w", po::value(&workload_name)->value_name("mlp|cnn|gpt"), "the workload (required)")
      ("precision,p", po::value(&precision)->default_value("fp32")->value_name("NAME"),
       "mixed-precision strategy (booster precisions lists them)")
      ("plugin", po::value(&plugin)->default_value("")->value_name("NAME"),
       "parallel plugin passed to the Booster (default: single process)")
      ("steps", po::value(&steps)->default_value(20)->value_name("N"), "timed steps (the median is reported)")
      ("warmup", po::value(&warmup)->default_value(3)->value_name("N"), "untimed steps first")
      ("hand-written", "time the loop written by hand instead of through the Booster")
      ("compare-hand-written", "time the Booster's loop and the hand-written one alternately in this process "
                               "and report the Booster's overhead (Note [Booster overhead])");
  po::variables_map vm;
  if (!parse_options("bench", desc, args, vm)) return kExitOk;
  BOOSTER_CHECK(vm.count("workload"), ConfigError, "'booster bench' needs --workload mlp|cnn|gpt (see booster bench --help)");
  BOOSTER_CHECK(steps >= 1 && warmup >= 0, ConfigError, "booster bench: --steps must be at least 1 and --warmup at "
                "least 0, got ", steps, " and ", warmup);
  const bool hand_written = vm.count("hand-written") > 0, compare = vm.count("compare-hand-written") > 0;
  BOOSTER_CHECK(!(hand_written && compare), ConfigError,
                "booster bench: --hand-written and --compare-hand-written exclude each other; pick one");
  BOOSTER_CHECK(!(hand_written && !plugin.empty()), ConfigError,
                "booster bench: --hand-written runs without the Booster, so it takes no --plugin");

  Workload w = make_workload(workload_name);
  const int64_t params = w.model->num_parameters();
  Loop loop = hand_written ? hand_written_loop(w, precision) : boosted_loop(w, precision, plugin);
  Loop reference;
  if (compare) {
    Workload w2 = make_workload(workload_name);
    reference = hand_written_loop(w2, precision);
  }

  for (int i = 0; i < warmup; ++i) {
    loop.step();
    if (compare) reference.step();
  }
  reset_cpu_peak_bytes();
  Timings timed, ref;
  for (int i = 0; i < steps; ++i) {
    // Alternate which goes first, so neither always runs right after the other's allocations.
    if (compare && i % 2) ref.time(reference.step);
    timed.time(loop.step);
    if (compare && !(i % 2)) ref.time(reference.step);
  }

  const double seconds = median(timed.wall);
  nlohmann::json line = {{"workload", w.name},
                         {"model", w.detail},
                         {"precision", precision},
                         {"plugin", plugin.empty() ? "single" : plugin},
                         {"loop", hand_written ? "hand_written" : "booster"},
                         {"ms_per_step", seconds * 1e3},
                         {"cpu_ms_per_step", median(timed.cpu) * 1e3},
                         {"min_ms_per_step", *std::min_element(timed.wall.begin(), timed.wall.end()) * 1e3},
                         {"gflops", 6.0 * double(params) * double(w.items) / seconds / 1e9},
                         {"params", params},
                         {"items_per_step", w.items},
                         {"steps", steps},
                         {"threads", std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "default"},
                         {"framework", "booster"}};
  if (compare) {
    const double hand = median(ref.wall);
    line["hand_written_ms_per_step"] = hand * 1e3;
    line["hand_written_cpu_ms_per_step"] = median(ref.cpu) * 1e3;
    line["booster_overhead"] = seconds / hand - 1.0;
    line["booster_cpu_overhead"] = median(timed.cpu) / median(ref.cpu) - 1.0;
  } else {
    // Two models in one process would make these meaningless, so only without --compare-hand-written.
    line["peak_tensor_bytes"] = cpu_peak_bytes();
    line["peak_rss_bytes"] = peak_rss_bytes();
  }
  std::cout << line.dump() << std::endl;
  return kExitOk;
}

}  // namespace booster::cli
