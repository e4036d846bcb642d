// The ddp and low_level_zero plugins on CUDA models (issue 6), through the Booster, at world size 1 (one
// process, one GPU): the plugin takes this process's NCCL group (Note [A group per device]) and must
// train exactly as the single plugin does on the same GPU, because at world size 1 every collective is
// an identity (an average over one rank is the value itself, ncclAvg multiplies by 1/1). What differs
// is the plugin's own machinery on device memory: flat buffers and buckets, NCCL on the compute
// stream, found_inf agreement on a device flag, ZeRO's shards, its unscale and its all-gather. Several
// GPUs need a machine with several GPUs (mpirun -np N on it runs the same code with N ranks).
//
// The first cases need no GPU: the plugins' declared devices, the compatibility matrix built from them,
// and the group a CPU model gets. The GPU cases skip, with the reason, without a GPU.
#include <catch2/catch.hpp>

#include "cuda_skip.h"
#include "roundoff.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "booster/booster/booster.h"
#include "booster/booster/compat.h"
#include "booster/plugin/parallel_plugin.h"
#include "booster/distributed/nccl_process_group.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"

using namespace booster;
using nlohmann::json;

namespace {

using testing::skip_without_gpu;

constexpr int64_t kIn = 32, kClasses = 10, kBatch = 16;
constexpr double kLearningRate = 1e-3;

nn::ModulePtr make_mlp(uint64_t seed) {
  return nn::make_model({{"type", "mlp"}, {"in", kIn}, {"hidden", {64, 64}}, {"classes", kClasses}}, seed);
}

nn::Criterion cross_entropy_loss() {
  return [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
}

std::vector<std::string> expected_devices() {
  return distributed::nccl_built() ? std::vector<std::string>{"cpu", "cuda"} : std::vector<std::string>{"cpu"};
}

// What a run leaves behind: the loss of each step, the final parameters (as float64, flattened), and
// the group the plugin used.
struct Run {
  std::vector<double> losses;
  std::vector<double> initial, params;
  std::string backend;
  Device group_device;
  int skipped = 0;
};

// `steps` steps of AdamW on the MLP on cuda:0 under `config` (its device set to cuda).
Run train_on_gpu(BoosterConfig config, int steps) {
  config.device = "cuda";
  Booster booster(config);
  nn::ModulePtr model = make_mlp(7);
  model->to(Device::cuda());
  auto optimizer = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", kLearningRate}});
  Boosted boosted = booster.boost(model, optimizer, cross_entropy_loss());
  auto flat_params = [&] {
    std::vector<double> out;
    for (const Tensor& p : boosted.model->parameters()) {
      const std::vector<double> v = p.detach().to(DType::Float32).cpu().tolist();
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  };
  Run run;
  run.initial = flat_params();
  for (int s = 0; s < steps; ++s) {
    Generator gen(1000 + uint64_t(s));
    const Tensor x = randn({kBatch, kIn}, &gen).to(Device::cuda());
    const Tensor y = randint(0, kClasses, {kBatch}, &gen).to(Device::cuda());
    boosted.optimizer->zero_grad();
    Tensor loss = boosted.criterion((*boosted.model)(x), y);
    run.losses.push_back(loss.item());
    booster.backward(loss, *boosted.optimizer);
    boosted.optimizer->step();
    run.skipped += boosted.optimizer->step_was_skipped();
  }
  run.params = flat_params();
  run.backend = booster.plugin().process_group().backend();
  run.group_device = booster.plugin().process_group().device();
  return run;
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::abs(x));
  return m;
}

// sqrt(mean((a - b)^2)).
double rms_difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(sum / double(a.size()));
}

// How far `got` ended from `want`, as a fraction of how far `want` trained: a run that drops or
// double-counts gradients, or skips steps, is a large fraction off; rounding is a small one.
double relative_drift(const Run& got, const Run& want) {
  return rms_difference(got.params, want.params) / rms_difference(want.params, want.initial);
}

void print_run(const char* what, const Run& got, const Run& want) {
  std::printf("%-40s max |param - single| = %.3g (max |param| %.3g), rms drift %.3g of the distance trained, "
              "last loss %.6f vs %.6f\n",
              what, max_abs_difference(got.params, want.params), max_abs(want.params), relative_drift(got, want),
              got.losses.back(), want.losses.back());
}

}  // namespace

// ------------------------------------------------------------------------------------ without a GPU

TEST_CASE("cuda plugins: ddp and low_level_zero declare cuda exactly when NCCL is built, and the compatibility "
          "matrix and the Booster follow",
          "[cuda][plugin][compat]") {
  for (const std::string name : {"ddp", "low_level_zero"}) {
    INFO(name);
    std::shared_ptr<ParallelPlugin> plugin = create_plugin(name, json::object());
    CHECK(plugin->supported_devices() == expected_devices());
    const compat::Verdict on_cuda = compat::check("fp32", compat::PluginTraits::of(*plugin), "cuda:0");
    CHECK(on_cuda.compatible == distributed::nccl_built());
    CHECK(compat::check("fp32", compat::PluginTraits::of(*plugin), "cpu").compatible);
    if (distributed::nccl_built()) {
      // The matrix accepts the combination; the Booster then needs the GPU itself.
      if (cuda::is_available()) CHECK_NOTHROW(Booster(BoosterConfig{.plugin = name, .device = "cuda"}));
      else CHECK_THROWS_WITH(Booster(BoosterConfig{.plugin = name, .device = "cuda"}),
                             Catch::Contains("no CUDA GPU was found"));
    } else {
      CHECK_THROWS_AS(Booster(BoosterConfig{.plugin = name, .device = "cuda"}), IncompatibleError);
      CHECK_THAT(on_cuda.reason, Catch::Contains("runs on cpu only"));
    }
  }
}

TEST_CASE("cuda plugins: a CPU model keeps the default group, whatever the build", "[cuda][plugin]") {
  for (const std::string name : {"ddp", "low_level_zero"}) {
    INFO(name);
    Booster booster(BoosterConfig{.plugin = name});
    nn::ModulePtr model = make_mlp(3);
    auto optimizer = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", kLearningRate}});
    booster.boost(model, optimizer, cross_entropy_loss());
    CHECK(&booster.plugin().process_group() == &distributed::default_process_group());
    CHECK(booster.plugin().process_group().device() == Device::cpu());
  }
}

// ------------------------------------------------------------------------------------ on a GPU

TEST_CASE("cuda plugins: a CUDA model in a build without NCCL is a ConfigError naming what is missing",
          "[cuda][plugin]") {
  if (skip_without_gpu()) return;
  if (distributed::nccl_built()) {
    skip_test("this build has NCCL, so there is no missing-NCCL error to see");
    return;
  }
  for (const std::string name : {"ddp", "low_level_zero"}) {
    INFO(name);
    // The config says cpu (so the compatibility check passes) but the model is on the GPU.
    Booster booster(BoosterConfig{.plugin = name});
    nn::ModulePtr model = make_mlp(3);
    model->to(Device::cuda());
    auto optimizer = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", kLearningRate}});
    CHECK_THROWS_AS(booster.boost(model, optimizer, cross_entropy_loss()), ConfigError);
    Booster again(BoosterConfig{.plugin = name});
    CHECK_THROWS_WITH(again.boost(model, optimizer, cross_entropy_loss()),
                      Catch::Contains("cuda:0") && Catch::Contains("nccl") && Catch::Contains("NCCL"));
  }
}

// At world size 1 ddp's average is an identity, so ddp must train as single does, step for step. Bound:
// each weight within Adam's drift over the steps (Note [Roundoff bounds], step 4: a gradient that is
// rounding noise may flip sign and move its weight by 2 lr |m_hat / sqrt(v_hat)| a step), whatever the
// precision. That bound holds whatever the gradients, so it cannot see a parameter whose gradient is
// lost (Adam is blind to a gradient's scale, so a doubled one changes nothing): beside it sits a
// detection threshold, not a roundoff bound: an rms drift under 10% of the distance trained. A lost
// gradient leaves its parameter where it started, so the drift is at least that parameter's share of
// the squared distance trained, under the root: losing any tensor that holds more than 1% of it fails
// the check. No skipped step either.
TEST_CASE("cuda plugins: ddp on one GPU trains like the single plugin on it (fp32, fp16, bf16, fp16_naive)",
          "[cuda][plugin][ddp]") {
  if (skip_without_gpu()) return;
  REQUIRE(distributed::nccl_built());
  constexpr int kSteps = 10;
  for (const std::string precision : {"fp32", "fp16", "bf16", "fp16_naive"}) {
    INFO(precision);
    json options = json::object();
    if (precision == "fp16") options = {{"init_scale", 256.0}};
    if (precision == "fp16_naive") options = {{"initial_scale", 1024.0}};
    const Run single =
        train_on_gpu({.mixed_precision = precision, .mixed_precision_options = options, .plugin = "single"}, kSteps);
    for (const bool find_unused : {false, true}) {
      INFO("find_unused_parameters " << find_unused);
      const Run ddp = train_on_gpu({.mixed_precision = precision,
                                    .mixed_precision_options = options,
                                    .plugin = "ddp",
                                    .plugin_options = {{"bucket_cap_mb", 0.01}, {"find_unused_parameters", find_unused}}},
                                   kSteps);
      print_run(("ddp " + precision + (find_unused ? " find_unused" : "")).c_str(), ddp, single);
      CHECK(ddp.backend == "nccl");
      CHECK(ddp.group_device == Device::cuda(0));
      CHECK(ddp.skipped == single.skipped);
      CHECK(max_abs_difference(ddp.params, single.params) <=
            ::testing::roundoff::adam_drift_bound(kLearningRate, kSteps, 0.9, 0.999));
      if (precision != "fp32") {
        CHECK(ddp.skipped == 0);
        CHECK(relative_drift(ddp, single) <= 0.1);
      }
    }
  }
}

// low_level_zero at world size 1 holds the whole shard, so it must step as the unsharded strategy it
// mirrors: fp32 as single fp32; fp16 as fp16_naive (float32 masters, the same dynamic scaler); bf16 as
// pure bf16 with masters. Bounds: each weight within Adam's drift over the steps, as for ddp above,
// and the same detection threshold on the rms drift (fp32: 1e-4, since there the two runs share every
// rounding but the update kernel's, flat against per tensor: losing a tensor that holds more than
// 1e-8 of the squared path fails it).
TEST_CASE("cuda plugins: low_level_zero stages 1 and 2 on one GPU match the single plugin on it",
          "[cuda][plugin][zero]") {
  if (skip_without_gpu()) return;
  REQUIRE(distributed::nccl_built());
  constexpr int kSteps = 10;
  const std::vector<json> stages = {{{"stage", 1}},
                                    {{"stage", 2}, {"overlap_communication", false}},
                                    {{"stage", 2}, {"reduce_bucket_size_in_m", 5e-3}}};
  for (const std::string precision : {"fp32", "fp16", "bf16"}) {
    BoosterConfig reference_config;
    reference_config.plugin = "single";
    if (precision == "fp16") {
      reference_config.mixed_precision = "fp16_naive";
      reference_config.mixed_precision_options = {{"initial_scale", 1024.0}};
    } else if (precision == "bf16") {
      reference_config.mixed_precision = "bf16";
      reference_config.mixed_precision_options = {{"pure", true}};
    }
    const Run single = train_on_gpu(reference_config, kSteps);
    for (const json& stage : stages) {
      INFO(precision << " " << stage.dump());
      json options = {{"precision", precision}, {"initial_scale", 1024.0}};
      options.update(stage);
      const Run zero = train_on_gpu({.plugin = "low_level_zero", .plugin_options = options}, kSteps);
      print_run(("zero " + precision + " " + stage.dump()).c_str(), zero, single);
      CHECK(zero.backend == "nccl");
      CHECK(zero.group_device == Device::cuda(0));
      CHECK(zero.skipped == 0);
      CHECK(single.skipped == 0);
      CHECK(max_abs_difference(zero.params, single.params) <=
            ::testing::roundoff::adam_drift_bound(kLearningRate, kSteps, 0.9, 0.999));
      CHECK(relative_drift(zero, single) <= (precision == "fp32" ? 1e-4 : 0.1));
    }
  }
}
