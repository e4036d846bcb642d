// Per-rank memory of ZeRO (the low_level_zero plugin) against an unsharded data-parallel rank, measured
// with the CPU allocator's counters (cpu_bytes_in_use / cpu_peak_bytes: bytes of live storages).
//
//   OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
//     mpirun -np 2 --oversubscribe build/bin/bench_zero_memory [hidden=2048]   (one command line)
//
// The baseline is what a ddp rank holds: the whole float32 model, a gradient for every parameter
// (the optimizer's flat gradient buffer) and AdamW's state for every parameter. For fp16/bf16 the
// ddp baseline is the same (the Booster's fp16 is autocast: float32 weights, gradients and state).
// For each setup, after one warm-up step the program reports the bytes held between steps (through
// the forward pass), split into weights (model + float32 masters), and optimizer state + gradients,
// and the peak during a step. State = what the first step allocated and kept (measured); gradients =
// the rest of what is held beyond the weights. B/param = held bytes (the model state) per parameter.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "booster/booster/booster.h"
#include "booster/plugin/parallel_plugin.h"
#include "booster/distributed/process_group.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/activation.h"
#include "booster/nn/container.h"
#include "booster/nn/linear.h"
#include "booster/ops/ops.h"
#include "booster/plugin/loader.h"
#include "booster/tensor/storage.h"

using namespace booster;
using nlohmann::json;

namespace {

int64_t g_hidden = 2048;
constexpr int64_t kWidth = 512, kBatch = 16;

nn::ModulePtr make_model() {
  Generator gen(7);
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(kWidth, g_hidden, true, &gen));
  m->push_back(std::make_shared<nn::GELU>());
  m->push_back(std::make_shared<nn::Linear>(g_hidden, g_hidden, true, &gen));
  m->push_back(std::make_shared<nn::GELU>());
  m->push_back(std::make_shared<nn::Linear>(g_hidden, kWidth, true, &gen));
  return m;
}

struct Figures {
  std::string setup;
  int64_t weights = 0, state = 0, grads = 0, held = 0, peak = 0;
};

struct Data {
  Tensor x, y;
};

Figures measure(const std::string& setup, const json* zero_options, const Data& data, bool via_booster = false,
                const std::string& plugin_name = "low_level_zero") {
  const size_t base = cpu_bytes_in_use();
  nn::ModulePtr model = make_model();
  const int64_t n = model->num_parameters();
  std::shared_ptr<optim::Optimizer> optimizer =
      optim::make_optimizer({{"type", "adamw"}, {"lr", 1e-4}}, model->parameters());
  std::shared_ptr<mixed_precision::MixedPrecision> precision = mixed_precision::create("fp32");
  std::shared_ptr<ParallelPlugin> plugin;
  int64_t weights = 4 * n;  // the float32 model
  std::unique_ptr<Booster> booster;
  std::shared_ptr<BoostedOptimizer> boosted;
  if (zero_options && via_booster) {
    booster = std::make_unique<Booster>(BoosterConfig{.plugin = plugin_name, .plugin_options = *zero_options});
    Boosted b = booster->boost(model, optimizer);
    model = b.model;
    boosted = b.optimizer;  // keeps the user's optimizer (the source of lr for schedulers) alive
    optimizer = nullptr;
    const int world = booster->process_group().size();
    const int64_t padded = (n + world - 1) / world * world;
    const std::string p = zero_options->value("precision", "fp32");
    if (plugin_name == "low_level_zero") weights = p == "fp32" ? 4 * padded : 2 * padded + 4 * (padded / world);
  } else if (zero_options) {
    auto library = plugin::load(plugin::kParallelKind, "low_level_zero");
    auto* factory = reinterpret_cast<ParallelFactory*>(library->symbol("booster_create_parallel"));
    plugin = plugin::bind(library, std::shared_ptr<ParallelPlugin>(factory(*zero_options)));
    TrainingParts parts{model, optimizer, nullptr, nullptr, nullptr, precision};
    parts = plugin->configure(parts);
    model = parts.model;
    optimizer = parts.optimizer;  // the user's unsharded optimizer (and its buffers) goes away here
    precision = parts.precision;
    const int world = plugin->process_group().size();
    const int64_t padded = (n + world - 1) / world * world;
    const std::string p = zero_options->at("precision");
    weights = p == "fp32" ? 4 * padded : 2 * padded + 4 * (padded / world);  // model + float32 masters
    // Stage 3 keeps only this rank's shard of the model (each module's buffer padded to the world size).
    if (zero_options->value("stage", 1) == 3) weights = (p == "fp32" ? 4 : 6) * (padded / world);
  }
  auto zero_grad_and_backward = [&] {
    if (boosted) {
      boosted->zero_grad();
      booster->backward(mse_loss((*model)(data.x), data.y), *boosted);
    } else {
      optimizer->zero_grad();
      precision->backward(mse_loss((*model)(data.x), data.y), *optimizer);
    }
  };
  auto optimizer_step = [&] {
    if (boosted) boosted->step();
    else precision->step(*optimizer);
  };
  auto step = [&] {
    zero_grad_and_backward();
    optimizer_step();
  };
  // The first step allocates the optimizer state: what it leaves held beyond what was held before it
  // is state (gradient buffers exist from the start, except stage 3's, which live from the backward
  // to the step only).
  const size_t before_first_step = cpu_bytes_in_use();
  step();
  Figures f;
  f.setup = setup;
  f.state = int64_t(cpu_bytes_in_use()) - int64_t(before_first_step);
  step();
  f.held = int64_t(cpu_bytes_in_use()) - int64_t(base);
  reset_cpu_peak_bytes();
  step();
  f.peak = int64_t(cpu_peak_bytes()) - int64_t(base);
  f.weights = weights;
  f.grads = f.held - f.weights - f.state;
  return f;
}

double mib(int64_t b) { return double(b) / (1024.0 * 1024.0); }

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) g_hidden = std::atoll(argv[1]);
  distributed::ProcessGroup& group = distributed::init_process_group("auto");
  Generator gen(1);
  const Data data{randn({kBatch, kWidth}, &gen), randn({kBatch, kWidth}, &gen)};

  std::vector<Figures> rows;
  rows.push_back(measure("unsharded (ddp rank)", nullptr, data));
  const json ddp_options = json::object();
  rows.push_back(measure("ddp plugin (Booster)", &ddp_options, data, true, "ddp"));
  for (const char* precision : {"fp32", "fp16", "bf16"}) {
    const json base = {{"precision", precision}, {"initial_scale", 1024.0}};
    json one = base, after = base, buckets = base;
    one["stage"] = 1;
    after["stage"] = 2;
    after["overlap_communication"] = false;
    buckets["stage"] = 2;
    buckets["reduce_bucket_size_in_m"] = 1;
    rows.push_back(measure(std::string("ZeRO-1 ") + precision, &one, data));
    rows.push_back(measure(std::string("ZeRO-2 ") + precision + " after bwd", &after, data));
    rows.push_back(measure(std::string("ZeRO-2 ") + precision + " 1M buckets", &buckets, data));
    json three = base;
    three["stage"] = 3;
    rows.push_back(measure(std::string("ZeRO-3 ") + precision, &three, data));
  }
  // Through the Booster, which keeps the user's optimizer alive as the source of hyperparameters.
  for (const char* precision : {"fp32", "fp16"}) {
    const json options = {{"stage", 2}, {"precision", precision}, {"initial_scale", 1024.0}, {"reduce_bucket_size_in_m", 1}};
    rows.push_back(measure(std::string("Booster ZeRO-2 ") + precision, &options, data, true));
  }

  if (group.rank() == 0) {
    const Figures& ddp = rows[0];
    const int64_t ddp_opt_grad = ddp.state + ddp.grads;
    std::printf("per-rank memory, %d ranks, %lld parameters (MLP %lld-%lld-%lld-%lld), AdamW\n", group.size(),
                (long long)make_model()->num_parameters(), (long long)kWidth, (long long)g_hidden,
                (long long)g_hidden, (long long)kWidth);
    const double params = double(make_model()->num_parameters());
    std::printf("%-26s %10s %10s %10s %12s %10s %10s %12s %8s\n", "setup", "weights", "opt.state", "grads",
                "state+grads", "held", "peak", "vs ddp s+g", "B/param");
    for (const Figures& f : rows)
      std::printf("%-26s %9.2fM %9.2fM %9.2fM %11.2fM %9.2fM %9.2fM %11.3f %8.2f\n", f.setup.c_str(), mib(f.weights),
                  mib(f.state), mib(f.grads), mib(f.state + f.grads), mib(f.held), mib(f.peak),
                  double(f.state + f.grads) / double(ddp_opt_grad), double(f.held) / params);
    std::printf("(MiB; held = between steps; peak = during a step, activations included; target for ZeRO-2: "
                "state+grads <= 1/%d of ddp's + 5%% = %.3f)\n",
                group.size(), 1.0 / group.size() + 0.05);
  }
  return 0;
}
