// Training on CUDA follows training on the CPU: the MLP and the GPT take a few AdamW steps under every
// mixed-precision strategy (fp32, fp16 + GradScaler, bf16, fp16_naive) on both devices from the same
// initial weights and batches, and the loss trajectories agree within the strategy's precision. The
// CPU rounds float16/bfloat16 exactly as the GPU does (Note [Low-precision storage on the CPU]), so the
// differences left are summation order and fused-kernel rounding. Skipped, with the reason, without a GPU.
#include <catch2/catch.hpp>

#include "cuda_skip.h"
#include "roundoff.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <filesystem>
#include <optional>

#include "booster/backends/cuda/cuda.h"
#include "booster/booster/booster.h"
#include "booster/data/data.h"
#include "booster/trainer/trainer.h"
#include "booster/booster/build_info.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/nn.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/grad_mode.h"

using namespace booster;

namespace {

using testing::skip_without_gpu;
namespace ro = ::testing::roundoff;

using ModelFactory = std::function<nn::ModulePtr()>;
using OptimizerFactory = std::function<std::shared_ptr<optim::Optimizer>(std::vector<Tensor>)>;

std::shared_ptr<optim::Optimizer> adamw(std::vector<Tensor> params) {
  return std::make_shared<optim::AdamW>(std::move(params), nlohmann::json{{"lr", 1e-3}});
}

// What a run leaves behind, per step: the loss, the largest logit, and (fp32 runs only, whose
// gradients are not scaled) the gradient's spread sum_p sqrt(n_p) |g_p|_2 and L2 norm and the path
// sum |w_t - w_{t-1}| walked before the step (Note [Roundoff bounds], steps 3 and 6).
struct Trajectory {
  std::vector<double> losses, logit_scale, spread, grad_l2, path;
};

std::vector<double> flat_params(const nn::Module& model) {
  std::vector<double> out;
  for (const Tensor& p : model.parameters()) {
    const std::vector<double> v = p.detach().cpu().to(DType::Float64).tolist();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// `steps` steps training a fresh model on `device` with strategy `precision`.
Trajectory train(const ModelFactory& make, const Tensor& x, const Tensor& y, mixed_precision::Criterion crit,
                 const std::string& precision, Device device, int steps, const OptimizerFactory& make_optimizer = adamw) {
  nn::ModulePtr model = make();
  model->to(device);
  std::shared_ptr<optim::Optimizer> opt = make_optimizer(model->parameters());
  std::unique_ptr<mixed_precision::MixedPrecision> mp;
  if (precision != "fp32") {
    mp = mixed_precision::create(precision);
    auto configured = mp->configure(model, opt, crit);
    model = configured.model;
    opt = configured.optimizer;
    crit = configured.criterion;
  }
  const Tensor xd = x.to(device), yd = y.to(device);
  Trajectory run;
  double path = 0;
  for (int s = 0; s < steps; ++s) {
    const Tensor out = (*model)(xd);
    Tensor loss = crit(out, yd);
    run.losses.push_back(loss.item());
    run.logit_scale.push_back(max(abs(out.detach().to(DType::Float32))).item());
    if (mp) {
      mp->backward(loss, *opt);
      mp->step(*opt);
    } else {
      loss.backward();
      std::vector<std::vector<double>> grads;
      double g2 = 0;
      for (const Tensor& p : model->parameters()) {
        grads.push_back(p.grad().cpu().to(DType::Float64).tolist());
        for (double g : grads.back()) g2 += g * g;
      }
      run.spread.push_back(ro::gradient_spread(grads));
      run.grad_l2.push_back(std::sqrt(g2));
      run.path.push_back(path);
      const std::vector<double> before = flat_params(*model);
      opt->step();
      const std::vector<double> after = flat_params(*model);
      double d2 = 0;
      for (size_t i = 0; i < after.size(); ++i) d2 += (after[i] - before[i]) * (after[i] - before[i]);
      path += std::sqrt(d2);
    }
    opt->zero_grad();
  }
  return run;
}

// Unit roundoff of the strategy's compute dtype: 2^-11 float16, 2^-8 bfloat16, 2^-24 float32.
double unit_roundoff(const std::string& precision) {
  if (precision == "fp32") return 0x1p-24;
  if (precision == "bf16") return 0x1p-8;
  return 0x1p-11;
}

// The relative difference of the two devices' gradients, K roundings on the longest path (Note [CPU
// and CUDA gradients agree within roundoff]): 2 sqrt(K) 2u, in float32 2 sqrt(K) sqrt(1024) u.
double gradient_error(const std::string& precision, double roundings) {
  const double u = precision == "fp32" ? std::sqrt(1024.0) * unit_roundoff("fp32") : 2 * unit_roundoff(precision);
  return 2 * std::sqrt(roundings) * u;
}

// The gradients of the first backward (before any step: both devices hold the same weights), as
// float64, one vector per parameter. Under a loss-scaling strategy they are scaled by the same initial
// scale on both devices, which the relative comparison below does not see.
std::vector<std::vector<double>> first_gradients(const ModelFactory& make, const Tensor& x, const Tensor& y,
                                                 mixed_precision::Criterion crit, const std::string& precision,
                                                 Device device) {
  nn::ModulePtr model = make();
  model->to(device);
  std::shared_ptr<optim::Optimizer> opt = adamw(model->parameters());
  std::unique_ptr<mixed_precision::MixedPrecision> mp;
  if (precision != "fp32") {
    mp = mixed_precision::create(precision);
    auto configured = mp->configure(model, opt, crit);
    model = configured.model;
    opt = configured.optimizer;
    crit = configured.criterion;
  }
  Tensor loss = crit((*model)(x.to(device)), y.to(device));
  if (mp) mp->backward(loss, *opt);
  else loss.backward();
  std::vector<std::vector<double>> grads;
  for (const Tensor& p : model->parameters()) grads.push_back(p.grad().cpu().to(DType::Float64).tolist());
  return grads;
}

// Note [CPU and CUDA gradients agree within roundoff]
// Both devices round to the same 16-bit values (Note [Low-precision storage on the CPU]); what differs
// is the float32 summation order inside each op, which moves a result by a few float32 roundoffs and
// so, where it sits near a 16-bit rounding boundary, rounds it to the neighbouring value: one rounding
// of at most 2u per op. The longest path rounds K times (`roundings`: forward ops plus each op's input
// and weight gradient); independent unbiased roundings add in quadrature, and with a conditioning
// factor of 2 a gradient is within 2 sqrt(K) 2u of the other device's, relative to its largest element.
// In float32 the order alone matters: sums of n terms differ by about sqrt(n) u, n <= 1024 here.
// The models are smooth (GELU, not ReLU): with ReLU, a pre-activation that rounds to the other side of
// zero on one device switches a unit off and moves its whole row of weight gradients (seen on an H100:
// 5% to 30% of the largest element under fp16 and bf16), which no roundoff bound covers.
void compare_first_gradients(const std::string& what, const ModelFactory& make, const Tensor& x, const Tensor& y,
                             mixed_precision::Criterion crit, double roundings, const std::string& precision) {
  const auto cpu = first_gradients(make, x, y, crit, precision, Device::cpu());
  const auto gpu = first_gradients(make, x, y, crit, precision, Device::cuda());
  REQUIRE(cpu.size() == gpu.size());
  const double bound = gradient_error(precision, roundings);
  for (size_t i = 0; i < cpu.size(); ++i) {
    double scale = 0, err = 0;
    for (size_t j = 0; j < cpu[i].size(); ++j) {
      scale = std::max(scale, std::abs(cpu[i][j]));
      err = std::max(err, std::abs(gpu[i][j] - cpu[i][j]));
    }
    INFO(what << " under " << precision << ", parameter " << i << ": max difference " << err << " of max "
              << scale << ", bound " << bound * scale);
    CHECK(scale > 0);
    CHECK(err <= bound * scale);
  }
}

const char* const kPrecisions[] = {"fp32", "fp16", "bf16", "fp16_naive"};

// The loss trajectories, step by step (Note [Roundoff bounds]): the forward's roundoff, then the
// weights' difference. Forward: the logits within eps (the gradient's bound, whose K counts the
// forward's roundings too) of their scale, and the loss, 1-Lipschitz in each logit of a row, within
// 2 eps of it; plus the loss's own float32 sums (its classes and rows) and roundings, relative to it.
// Weights: under AdamW the loss-curve bound of step 6 (near-zero gradients may flip sign and move
// their weights by 2 lr a step, but change the loss only by their own small gradient); under SGD the
// path bound of step 3 times |g|_2. The gradients' spread, norm and path are the fp32 CPU run's.
void compare(const std::string& what, const ModelFactory& make, const Tensor& x, const Tensor& y,
             mixed_precision::Criterion crit, int steps, double roundings, double classes, double rows,
             const OptimizerFactory& make_optimizer = adamw, double sgd_momentum = -1) {
  const Trajectory reference = train(make, x, y, crit, "fp32", Device::cpu(), steps, make_optimizer);
  for (const std::string precision : kPrecisions) {
    INFO(what << " under " << precision);
    compare_first_gradients(what, make, x, y, crit, roundings, precision);
    const Trajectory cpu = train(make, x, y, crit, precision, Device::cpu(), steps, make_optimizer);
    const Trajectory gpu = train(make, x, y, crit, precision, Device::cuda(), steps, make_optimizer);
    REQUIRE(gpu.losses.size() == cpu.losses.size());
    const double eps = gradient_error(precision, roundings);
    std::printf("%-4s %-10s", what.c_str(), precision.c_str());
    std::vector<double> lrs;
    for (size_t i = 0; i < cpu.losses.size(); ++i) {
      const double l = cpu.losses[i], g = gpu.losses[i];
      const double forward = 2 * eps * cpu.logit_scale[i] +
                             (ro::reduction_bound({classes, rows}) + ro::gamma(4, ro::kUnit)) * std::abs(l);
      const double weights = sgd_momentum >= 0
                                 ? reference.grad_l2[i] * ro::sgd_bound(reference.path[i], eps, sgd_momentum)
                                 : ro::adam_loss_bound(eps, reference.spread[i], lrs, 0.9, 0.999);
      std::printf("  %.5f/%.5f", l, g);
      INFO("step " << i << ": cpu " << l << ", cuda " << g << ", bound " << forward + weights << " (forward "
                   << forward << ")");
      CHECK(std::isfinite(g));
      CHECK(std::abs(g - l) <= forward + weights);
      lrs.push_back(1e-3);  // adamw()'s
    }
    std::printf("\n");
    CHECK(gpu.losses.back() < gpu.losses.front());  // it trains
  }
}

}  // namespace

TEST_CASE("the MLP trains on CUDA as on the CPU under every mixed-precision strategy", "[cuda]") {
  if (skip_without_gpu()) return;
  Generator g(0);
  const Tensor x = randn({64, 784}, &g);
  const Tensor y = randint(0, 10, {64}, &g);
  // GELU, not ReLU: Note [CPU and CUDA gradients agree within roundoff].
  auto make = [] { return nn::ModulePtr(std::make_shared<nn::MLPClassifier>(784, std::vector<int64_t>{256, 256}, 10, "gelu_tanh", 0)); };
  auto crit = [](const Tensor& out, const Tensor& t) { return cross_entropy(out, t); };
  // Three linears and two GELUs round in forward (5); backward, each linear's input and weight gradient
  // and each GELU's (8): K = 13.
  compare("mlp", make, x, y, crit, 6, 13, 10, 64);
}

TEST_CASE("the GPT trains on CUDA as on the CPU under every mixed-precision strategy", "[cuda]") {
  if (skip_without_gpu()) return;
  nn::GPTConfig config;
  config.vocab_size = 64;
  config.context = 32;
  config.width = 64;
  config.layers = 2;
  config.heads = 4;
  Generator g(1);
  const Tensor idx = randint(0, config.vocab_size, {4, config.context}, &g);
  const Tensor target = randint(0, config.vocab_size, {4 * config.context}, &g);
  auto make = [config] { return nn::ModulePtr(std::make_shared<nn::GPT>(config, 0)); };
  const int64_t vocab = config.vocab_size;
  auto crit = [vocab](const Tensor& logits, const Tensor& t) { return cross_entropy(logits.reshape({-1, vocab}), t); };
  // 27 forward roundings and twice as many backward (Note [16-bit GPT tolerance] in tests/nn/test_nn.cpp).
  compare("gpt", make, idx, target, crit, 6, 81, 64, 4 * 32);
}

TEST_CASE("an MLP with BatchNorm1d trains with SGD on CUDA as on the CPU under every mixed-precision strategy",
          "[cuda]") {
  Generator g(2);
  const Tensor x = randn({64, 32}, &g);
  const Tensor y = randint(0, 10, {64}, &g);
  auto make = [] {
    Generator init(3);
    auto seq = std::make_shared<nn::Sequential>();
    // No bias before the batch norm: its gradient is exactly zero (the normalization removes it), so
    // the two devices' values are rounding noise with no scale to compare against.
    seq->push_back(std::make_shared<nn::Linear>(32, 64, false, &init));
    seq->push_back(std::make_shared<nn::BatchNorm1d>(64));
    seq->push_back(std::make_shared<nn::GELU>("tanh"));
    seq->push_back(std::make_shared<nn::Linear>(64, 10, true, &init));
    return nn::ModulePtr(seq);
  };
  auto crit = [](const Tensor& out, const Tensor& t) { return cross_entropy(out, t); };
  auto sgd = [](std::vector<Tensor> params) -> std::shared_ptr<optim::Optimizer> {
    return std::make_shared<optim::SGD>(
        std::move(params), nlohmann::json{{"lr", 0.05}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 1e-4}});
  };
  // The CPU half runs on any machine: every strategy trains this model with SGD on the CPU.
  for (const std::string precision : kPrecisions) {
    INFO("CPU under " << precision);
    const std::vector<double> cpu = train(make, x, y, crit, precision, Device::cpu(), 6, sgd).losses;
    for (double l : cpu) CHECK(std::isfinite(l));
    CHECK(cpu.back() < cpu.front());
  }
  if (skip_without_gpu()) return;
  // linear, batch norm, GELU, linear forward (4); backward, the linears' and batch norm's input and
  // weight gradients and GELU's (7): K = 11.
  compare("bn", make, x, y, crit, 6, 11, 10, 64, sgd, 0.9);
}

// The Trainer's plumbing on the GPU. How a GPU run's trajectory follows the CPU's is the business of the
// tests above, whose bounds need smooth models and per-step gradients; here the checks need no trajectory
// bound. The run trains (its last loss below its first), resumes exactly, and its evaluation equals the
// CPU's evaluation of the same trained weights up to the forward's roundoff: each logit within eps of the
// row's largest |logit| (Note [CPU and CUDA gradients agree within roundoff], with K = 3 forward
// roundings: two linears and a ReLU, which is continuous, so the forward bound holds for it), hence the
// mean loss within 2 eps of the logit scale plus its own sums' order term, and a prediction may differ
// only where the top two logits are within 2 eps of the scale on one device, so within 4 eps on the
// CPU's full-batch logits.
TEST_CASE("device \"cuda\" in the BoosterConfig: boost() moves the model, batches arrive there, the Trainer "
          "trains and resumes", "[cuda][trainer]") {
  if (!cuda::is_available()) {
    // Without a GPU the same config is refused before any work, in one line that says why.
    CHECK_THROWS_AS(Booster(BoosterConfig{.device = "cuda"}), DeviceError);
    CHECK_THROWS_WITH(Booster(BoosterConfig{.device = "cuda"}), Catch::Contains("no CUDA GPU was found"));
  }
  if (skip_without_gpu()) return;
  CHECK_THROWS_WITH(Booster(BoosterConfig{.device = "cuda:" + std::to_string(cuda::device_count())}),
                    Catch::Contains("choose one of them"));
  Generator g(5);
  const Tensor features = randn({256, 16}, &g), labels = randint(0, 4, {256}, &g);
  auto data = std::make_shared<data::TensorDataset>(features, labels);
  nn::Criterion ce = [](const Tensor& o, const Tensor& t) { return cross_entropy(o, t); };
  struct Outcome {
    FitResult fit;
    nn::ModulePtr model;
    std::vector<double> losses;
  };
  auto run = [&](const std::string& device, const std::filesystem::path& dir, const std::string& resume,
                 std::optional<int64_t> max_steps) {
    manual_seed(0);
    Booster booster(BoosterConfig{.mixed_precision = "fp16", .device = device});
    Generator init(1);
    nn::ModulePtr model = std::make_shared<nn::MLPClassifier>(16, std::vector<int64_t>{32}, 4, "relu", 1);
    auto opt = std::make_shared<optim::AdamW>(model->parameters(), nlohmann::json{{"lr", 1e-2}});
    auto loader = booster.prepare_dataloader(data, {.batch_size = 32, .shuffle = true, .seed = 2});
    const Boosted boosted = booster.boost(model, opt, ce, loader, nullptr);
    CHECK(model->parameters().front().device() == device_from_string(device));
    for (data::Batch& b : *loader) {
      CHECK(b.x.device() == device_from_string(device));
      CHECK(b.y.device() == device_from_string(device));
      break;
    }
    loader->set_epoch(0);
    TrainerOptions o;
    o.epochs = 2;
    o.max_steps = max_steps;
    o.checkpoint_dir = dir;
    o.checkpoint_every = 5;
    o.resume = resume;
    o.progress = trainer::Progress::Mode::Silent;
    Trainer trainer(booster, o);
    trainer.set_eval_data(data);
    Outcome out{FitResult{}, boosted.model, {}};
    trainer.on_step([&out](const trainer::StepReport& r) { out.losses.push_back(r.loss); });
    out.fit = trainer.fit();
    return out;
  };
  const auto root = std::filesystem::temp_directory_path() / "booster_cuda_trainer";
  std::filesystem::remove_all(root);
  Outcome gpu = run("cuda", root / "gpu", "", std::nullopt);
  const FitResult& fit = gpu.fit;
  CHECK(fit.steps == 16);
  REQUIRE(gpu.losses.size() == 16);
  CHECK(gpu.losses.back() < gpu.losses.front());  // it trains
  REQUIRE(fit.evaluation.has_value());
  CHECK(fit.evaluation->samples == 256);

  // The same weights evaluated on the CPU, batched as the Trainer batches, and the CPU's full-batch
  // logits for the bound.
  gpu.model->to(Device::cpu());
  const trainer::Evaluation on_cpu = trainer::evaluate(*gpu.model, *data, ce, TrainerOptions{}.eval_batch_size);
  gpu.model->eval();
  Tensor logits;
  {
    NoGradGuard no_grad;
    logits = (*gpu.model)(features).to(DType::Float64);
  }
  const std::vector<double> z = logits.tolist();
  const double eps = gradient_error("fp16", 3);
  double scale = 0;
  int64_t near_ties = 0;
  for (int64_t i = 0; i < 256; ++i) {
    std::vector<double> row(z.begin() + i * 4, z.begin() + i * 4 + 4);
    double row_scale = 0;
    for (double v : row) row_scale = std::max(row_scale, std::abs(v));
    scale = std::max(scale, row_scale);
    std::sort(row.begin(), row.end());
    if (row[3] - row[2] <= 4 * eps * row_scale) ++near_ties;
  }
  const double loss_bound = 2 * eps * scale + (ro::reduction_bound({4, 256}) + ro::gamma(4, ro::kUnit)) * on_cpu.loss;
  INFO("GPU evaluation: loss " << fit.evaluation->loss << ", accuracy " << fit.evaluation->accuracy
                               << "; CPU: loss " << on_cpu.loss << ", accuracy " << on_cpu.accuracy << "; loss bound "
                               << loss_bound << ", near ties " << near_ties);
  CHECK(std::abs(fit.evaluation->loss - on_cpu.loss) <= loss_bound);
  CHECK(std::abs(fit.evaluation->accuracy - on_cpu.accuracy) <= double(near_ties) / 256.0);
  // A run of 7 steps (saved at 5 and 7) resumed to the end: the same loss as the uninterrupted GPU run.
  run("cuda", root / "parts", "", 7);
  const Outcome resumed = run("cuda", root / "parts", "latest", std::nullopt);
  CHECK(resumed.fit.resumed_from.has_value());
  CHECK(resumed.fit.final_loss == fit.final_loss);
}
