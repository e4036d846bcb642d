// The low_level_zero plugin (ZeRO stages 1, 2 and 3) under `mpirun -np 2`. Every TEST_CASE runs on every
// rank in the same order. References are computed locally on each rank by one process that sees the
// whole batch (the data of both ranks) with an unsharded optimizer, or an unsharded master-weight
// strategy for 16-bit training.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/plugin/parallel_plugin.h"
#include "booster/distributed/nccl_process_group.h"
#include "booster/distributed/process_group.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/activation.h"
#include "booster/nn/container.h"
#include "booster/nn/linear.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/lr_scheduler.h"
#include "booster/optim/optimizer.h"
#include "booster/plugin/loader.h"
#include "booster/tensor/storage.h"
#include "roundoff.h"

using namespace booster;
using nlohmann::json;

namespace {

distributed::ProcessGroup& group() { return distributed::init_process_group("mpi"); }

constexpr int64_t kIn = 8, kHidden = 16, kOut = 4;  // 212 parameters: shards cut the weight of layer 2
constexpr int64_t kBatch = 6;                       // per rank

std::shared_ptr<ParallelPlugin> load_zero(const json& options) {
  std::shared_ptr<plugin::Plugin> library = plugin::load(plugin::kParallelKind, "low_level_zero");
  auto* factory = reinterpret_cast<ParallelFactory*>(library->symbol("booster_create_parallel"));
  return plugin::bind(library, std::shared_ptr<ParallelPlugin>(factory(options)));
}

nn::ModulePtr make_model(uint64_t seed) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->push_back(std::make_shared<nn::Linear>(kIn, kHidden, true, &gen));
  model->push_back(std::make_shared<nn::Tanh>());
  model->push_back(std::make_shared<nn::Linear>(kHidden, kOut, true, &gen));
  model->set_tensor_names();
  return model;
}

// The whole batch of step `step` (both ranks' rows), the same on every rank.
struct Batch {
  Tensor x, y;
};
Batch whole_batch(int step, int64_t rows = 2 * kBatch) {
  Generator gen(1000 + uint64_t(step));
  return {randn({rows, kIn}, &gen), randn({rows, kOut}, &gen)};
}
// This rank's rows of it.
Batch my_rows(const Batch& b) {
  const int64_t per_rank = b.x.size(0) / group().size();
  return {b.x.narrow(0, group().rank() * per_rank, per_rank), b.y.narrow(0, group().rank() * per_rank, per_rank)};
}

Tensor loss_of(nn::Module& model, const Batch& b) { return mse_loss(model(b.x), b.y); }

// A model configured by the plugin, with what the loop needs.
struct Zero {
  std::shared_ptr<ParallelPlugin> plugin;
  TrainingParts parts;
  void train_step(const Batch& rows) {
    parts.optimizer->zero_grad();
    parts.precision->backward(loss_of(*parts.model, rows), *parts.optimizer);
    parts.precision->step(*parts.optimizer);
  }
};

Zero make_zero(const json& options, const nn::ModulePtr& model, const json& optimizer) {
  Zero z;
  z.plugin = load_zero(options);
  TrainingParts parts;
  parts.model = model;
  parts.optimizer = optim::make_optimizer(optimizer, model->parameters());
  parts.precision = mixed_precision::create("fp32");
  z.parts = z.plugin->configure(parts);
  return z;
}

std::vector<Tensor> float32_params(const nn::Module& model) {
  std::vector<Tensor> out;
  for (const Tensor& p : model.parameters()) out.push_back(p.detach().to(DType::Float32).clone());
  return out;
}

// max |a - b| over a tensor, relative to max |b|.
double relative_error(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.tolist(), y = b.tolist();
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return diff / scale;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.tolist(), y = b.tolist();
  double diff = 0;
  for (size_t i = 0; i < x.size(); ++i) diff = std::max(diff, std::abs(x[i] - y[i]));
  return diff;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// The float32 value of every parameter, gathered whole for the read under stage 3 (any stage).
std::vector<Tensor> gathered_params(Zero& z) {
  std::vector<Tensor> out;
  z.plugin->with_full_parameters([&] { out = float32_params(*z.parts.model); });
  return out;
}

// Every rank holds the same values (a mismatch shows as a max that differs from the local value).
void require_same_on_every_rank(const nn::Module& model) {
  for (const Tensor& p : model.parameters()) {
    Tensor mine = p.detach().to(DType::Float32).clone();
    Tensor highest = mine.clone();
    group().all_reduce(highest, distributed::ReduceOp::Max);
    REQUIRE(bitwise_equal(mine, highest));
  }
}

// The L2 distance between two lists of tensors.
double l2_distance(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const std::vector<double> x = a[i].tolist(), y = b[i].tolist();
    for (size_t k = 0; k < x.size(); ++k) s += (x[k] - y[k]) * (x[k] - y[k]);
  }
  return std::sqrt(s);
}

// One process, whole batch, plain optimizer: the float32 reference; `path` gets the sum of its step
// lengths (for sgd_bound).
std::vector<Tensor> reference_fp32(const json& optimizer, int steps, double* path = nullptr) {
  nn::ModulePtr model = make_model(7);
  std::unique_ptr<optim::Optimizer> opt = optim::make_optimizer(optimizer, model->parameters());
  std::vector<Tensor> before = float32_params(*model);
  if (path) *path = 0;
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    loss_of(*model, whole_batch(s)).backward();
    opt->step();
    std::vector<Tensor> now = float32_params(*model);
    if (path) *path += l2_distance(now, before);
    before = std::move(now);
  }
  return before;
}

// Note [Roundoff bounds] (tests/roundoff.h) for this model on `rows` rows: the gradient's reductions
// (Linears of 8 and 16 inputs, the mean over rows x 4 outputs, the chain back, the sum over rows), and
// the largest element difference two summation orders may leave after `steps` steps of `optimizer`:
// Adam's drift (any gradients), or SGD's bound along the reference's path (|x|_inf <= |x|_2).
double gradient_bound(int64_t rows = 2 * kBatch) {
  const double forward = kIn + kHidden + double(rows * kOut);
  return ::testing::roundoff::reduction_bound({2 * forward, double(rows)});
}
double weight_bound(const json& optimizer, int steps, double path, const std::vector<double>& lrs = {}) {
  namespace ro = ::testing::roundoff;
  if (optimizer.at("type") == "sgd") return ro::sgd_bound(path, gradient_bound(), optimizer.value("momentum", 0.0));
  const auto betas = optimizer.value("betas", std::vector<double>{0.9, 0.999});
  if (!lrs.empty()) return ro::adam_drift_bound(lrs, betas[0], betas[1]);
  return ro::adam_drift_bound(optimizer.at("lr").get<double>(), steps, betas[0], betas[1]);
}

const json kAdamW = {{"type", "adamw"}, {"lr", 1e-2}};

// The ways to run: stage 1; stage 2 reducing after backward; stage 2 reducing in buckets during
// backward (two buckets here, [0, 144) and [144, 212): the first straddles the shards' boundary).
const std::vector<json> kStages = {{{"stage", 1}},
                                   {{"stage", 2}, {"overlap_communication", false}},
                                   {{"stage", 2}, {"reduce_bucket_size_in_m", 5e-5}}};
// And stage 3, whose parameters are read through the plugin (gathered_params).
const std::vector<json> kAllStages = {{{"stage", 1}},
                                      {{"stage", 2}, {"overlap_communication", false}},
                                      {{"stage", 2}, {"reduce_bucket_size_in_m", 5e-5}},
                                      {{"stage", 3}}};

json with_stage(const json& stage, json options) {
  options.update(stage);
  return options;
}

}  // namespace

TEST_CASE("zero: options are validated and the declarations follow the stage", "[mpi][zero]") {
  REQUIRE_THROWS_WITH(load_zero({{"stages", 2}}), Catch::Contains("unknown option 'stages'"));
  REQUIRE_THROWS_AS(load_zero({{"stage", 4}}), ConfigError);
  REQUIRE_THROWS_AS(load_zero({{"stage", 0}}), ConfigError);
  REQUIRE_THROWS_WITH(load_zero({{"precision", "fp8"}}), Catch::Contains("'precision' = \"fp8\" is not valid"));
  REQUIRE_THROWS_AS(load_zero({{"backoff_factor", 1.5}}), ConfigError);
  REQUIRE_THROWS_AS(load_zero({{"max_norm", -1}}), ConfigError);
  REQUIRE_THROWS_AS(load_zero({{"initial_scale", 4}, {"min_scale", 8}}), ConfigError);
  REQUIRE_THROWS_WITH(load_zero({{"overlap_communication", 1}}), Catch::Contains("must be true or false"));
  REQUIRE_THROWS_AS(load_zero({{"reduce_bucket_size_in_m", 0}}), ConfigError);

  auto one = load_zero(json::object());
  REQUIRE(one->name() == "low_level_zero");
  REQUIRE(one->options().at("stage") == 1);
  REQUIRE(one->options().at("precision") == "fp16");
  REQUIRE(one->options().at("initial_scale") == 4294967296.0);  // ColossalAI's 2**32
  REQUIRE(one->options().at("hysteresis") == 2);
  REQUIRE(one->options().at("max_norm") == 0.0);
  REQUIRE(one->options().at("overlap_communication") == true);
  REQUIRE(one->options().at("reduce_bucket_size_in_m") == 12.0);
  REQUIRE(one->supported_precisions() == std::vector<std::string>{"fp32"});
  REQUIRE(one->supported_devices() ==
          (distributed::nccl_built() ? std::vector<std::string>{"cpu", "cuda"} : std::vector<std::string>{"cpu"}));
  REQUIRE(one->control_precision());
  REQUIRE_FALSE(one->control_device());
  REQUIRE_FALSE(one->control_checkpoint_io());  // its files are a single process's (Note [Resuming across layouts])
  REQUIRE(one->layout().data == group().size());
  REQUIRE(one->support_no_sync());
  REQUIRE_NOTHROW(one->set_gradient_sync(false));

  auto two = load_zero({{"stage", 2}});
  REQUIRE_FALSE(two->support_no_sync());
  REQUIRE_THROWS_WITH(two->set_gradient_sync(false), Catch::Contains("no_sync is not supported with stage 2"));
  REQUIRE_THROWS_AS(two->set_gradient_sync(false), IncompatibleError);
  REQUIRE_NOTHROW(two->set_gradient_sync(true));

  auto three = load_zero({{"stage", 3}});
  REQUIRE_FALSE(three->support_no_sync());
  REQUIRE_THROWS_WITH(three->set_gradient_sync(false), Catch::Contains("no_sync is not supported with stage 3"));
}

TEST_CASE("zero: fp32 stages 1 and 2 on 2 ranks match one process with the whole batch (AdamW, SGD)",
          "[mpi][zero]") {
  for (const json& stage : kStages) {
    for (const json& optimizer : {kAdamW, json{{"type", "sgd"}, {"lr", 0.1}, {"momentum", 0.9}}}) {
      INFO(stage.dump() << ", " << optimizer.dump());
      double path = 0;
      const std::vector<Tensor> expected = reference_fp32(optimizer, 20, &path);
      // Rank 1 starts from other weights: the plugin must broadcast rank 0's.
      Zero z = make_zero(with_stage(stage, {{"precision", "fp32"}}), make_model(group().rank() == 0 ? 7 : 99), optimizer);
      for (int s = 0; s < 20; ++s) z.train_step(my_rows(whole_batch(s)));
      const std::vector<Tensor> got = float32_params(*z.parts.model);
      REQUIRE(got.size() == expected.size());
      // Only the summation order differs (two half-batch gradients averaged vs one whole-batch one).
      for (size_t i = 0; i < got.size(); ++i) REQUIRE(max_abs_diff(got[i], expected[i]) <= weight_bound(optimizer, 20, path));
      require_same_on_every_rank(*z.parts.model);
    }
  }
}

// Tolerance for 16-bit training. The reference is the unsharded master-weight strategy on the whole
// batch (fp16_naive with the same scaler, bf16 pure). The only difference is where the gradient is
// rounded to 16 bits: ZeRO rounds each rank's half-batch gradient (u = 2^-11 for float16, 2^-8 for
// bfloat16), then their average once more, the reference rounds the whole-batch gradient once, so an
// element differs by at most ~3u relative. Adam's step m/(sqrt(v)+eps) is scale-free in the gradient,
// so a relative gradient error of 3u moves each step's update by at most ~2 * 3u * lr; the masters may
// then differ by about steps * 6u * lr after `steps` steps (and the 16-bit weights by one rounding
// more). We require the masters' (read: the model's float32 view of them) max difference below twice
// that, and well below the distance training moved the weights, so the test still fails for a lost
// shard, a missing average or a step taken from stale gradients.
TEST_CASE("zero: fp16 and bf16 at every stage match the unsharded master-weight step within rounding",
          "[mpi][zero]") {
  const int steps = 20;
  const double lr = 1e-2;
  for (const std::string precision : {"fp16", "bf16"}) {
    const double u = precision == "fp16" ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    const double tolerance = 2 * steps * 6 * u * lr;
    for (const json& stage : kAllStages) {
      INFO(precision << " " << stage.dump());
      // Reference.
      nn::ModulePtr ref_model = make_model(7);
      const std::vector<Tensor> initial = float32_params(*ref_model);
      auto strategy = precision == "fp16"
                          ? mixed_precision::create("fp16_naive", {{"initial_scale", 1024.0}})
                          : mixed_precision::create("bf16", {{"pure", true}});
      auto configured = strategy->configure(ref_model, optim::make_optimizer(kAdamW, ref_model->parameters()),
                                            [](const Tensor& o, const Tensor& t) { return mse_loss(o, t); });
      for (int s = 0; s < steps; ++s) {
        configured.optimizer->zero_grad();
        strategy->backward(loss_of(*configured.model, whole_batch(s)), *configured.optimizer);
        strategy->step(*configured.optimizer);
        REQUIRE_FALSE(strategy->step_was_skipped());
      }
      const std::vector<Tensor> expected = float32_params(*ref_model);

      Zero z = make_zero(with_stage(stage, {{"precision", precision}, {"initial_scale", 1024.0}}), make_model(7), kAdamW);
      for (int s = 0; s < steps; ++s) {
        z.train_step(my_rows(whole_batch(s)));
        REQUIRE_FALSE(z.parts.precision->step_was_skipped());
      }
      const std::vector<Tensor> got = gathered_params(z);
      for (size_t i = 0; i < got.size(); ++i) {
        INFO("parameter " << i);
        REQUIRE(z.parts.model->parameters()[i].dtype() == (precision == "fp16" ? DType::Float16 : DType::BFloat16));
        REQUIRE(max_abs_diff(got[i], expected[i]) < tolerance);
        REQUIRE(max_abs_diff(got[i], initial[i]) > 5 * tolerance);  // training moved it further than that
      }
      z.plugin->with_full_parameters([&] { require_same_on_every_rank(*z.parts.model); });
    }
  }
}

TEST_CASE("zero: per-rank optimizer state is half of the unsharded optimizer's (allocator counters)",
          "[mpi][zero]") {
  // What the first step allocates and keeps is the optimizer state (AdamW's exp_avg and exp_avg_sq).
  auto state_bytes_of_first_step = [](const std::function<void()>& backward, const std::function<void()>& step) {
    backward();
    const size_t before = cpu_bytes_in_use();
    step();
    return int64_t(cpu_bytes_in_use()) - int64_t(before);
  };
  nn::ModulePtr full_model = make_model(7);
  auto full = optim::make_optimizer(kAdamW, full_model->parameters());
  const int64_t unsharded = state_bytes_of_first_step([&] { loss_of(*full_model, whole_batch(0)).backward(); },
                                                      [&] { full->step(); });
  // The allocator rounds each block up to 64 bytes; AdamW keeps two float32 buffers.
  constexpr int64_t kRounding = 2 * 64;
  const int64_t exact = 2 * full_model->num_parameters() * 4;
  REQUIRE(unsharded >= exact);  // the baseline holds what it should
  REQUIRE(unsharded < exact + kRounding);

  for (const std::string precision : {"fp32", "fp16"}) {
    int64_t held_by_stage[3] = {0, 0, 0};
    for (int stage : {1, 2}) {
      INFO(precision << " stage " << stage);
      const size_t start = cpu_bytes_in_use();
      Zero z = make_zero({{"stage", stage}, {"precision", precision}, {"initial_scale", 1024.0}}, make_model(7), kAdamW);
      const int64_t sharded = state_bytes_of_first_step(
          [&] { z.parts.precision->backward(loss_of(*z.parts.model, my_rows(whole_batch(0))), *z.parts.optimizer); },
          [&] { z.parts.precision->step(*z.parts.optimizer); });
      REQUIRE_FALSE(z.parts.precision->step_was_skipped());
      // Half, up to the rounding of the two buffers; nothing else is kept by the step.
      REQUIRE(std::abs(sharded * group().size() - unsharded) < group().size() * kRounding);
      REQUIRE(sharded < unsharded * 0.5 + kRounding);
      held_by_stage[stage] = int64_t(cpu_bytes_in_use()) - int64_t(start);
      // Stage 2 gives the full-size gradient buffer back after reducing it: no parameter keeps a grad.
      for (const Tensor& p : z.parts.model->parameters()) REQUIRE(p.grad().defined() == (stage == 1));
    }
    // Between steps stage 1 holds the full working-precision gradient buffer that stage 2 does not.
    const int64_t itemsize = precision == "fp32" ? 4 : 2;
    REQUIRE(held_by_stage[1] - held_by_stage[2] >= make_model(7)->num_parameters() * itemsize);
  }
}

TEST_CASE("zero: an overflow on one rank only makes every rank skip and lowers the scale on both",
          "[mpi][zero]") {
  for (const json& stage : kAllStages) {
    INFO(stage.dump());
    // Rank 1 writes an inf into the last parameter's gradient while backward runs (the hook is
    // registered before the plugin's, so it runs first). That parameter lies in rank 1's shard, so
    // after the reduction only rank 1's shard holds it.
    nn::ModulePtr model = make_model(7);
    bool armed = false;
    model->parameters().back().register_grad_ready_hook([&armed](Tensor& p) {
      if (!armed) return;
      p.grad().reshape({-1}).narrow(0, 0, 1).fill_(std::numeric_limits<double>::infinity());
      armed = false;
    });
    Zero z = make_zero(with_stage(stage, {{"precision", "fp16"}, {"initial_scale", 1024.0}, {"hysteresis", 1}}),
                       model, kAdamW);
    z.train_step(my_rows(whole_batch(0)));
    REQUIRE_FALSE(z.parts.precision->step_was_skipped());
    const std::vector<Tensor> before = gathered_params(z);

    armed = group().rank() == 1;
    z.train_step(my_rows(whole_batch(1)));
    REQUIRE_FALSE(armed);  // the hook fired
    REQUIRE(z.parts.precision->step_was_skipped());
    REQUIRE(z.parts.precision->loss_scale() == 512.0);
    const std::vector<Tensor> after = gathered_params(z);
    for (size_t i = 0; i < after.size(); ++i) REQUIRE(bitwise_equal(after[i], before[i]));

    z.train_step(my_rows(whole_batch(2)));  // clean again
    REQUIRE_FALSE(z.parts.precision->step_was_skipped());
    z.plugin->with_full_parameters([&] { require_same_on_every_rank(*z.parts.model); });
  }
}

// Note [Averages divide first], as in test_mpi_ddp.cpp: the float16 gradient of w on rank r is x_r, whose
// first element 40000 + 8000 r is finite on every rank while the 2-rank sum 88000 overflows float16
// and the mean 44000 does not. Every stage (and stage 2's bucketed path) must step with the mean.
TEST_CASE("zero: a float16 gradient whose 2-rank sum overflows is averaged, and the step is not skipped",
          "[mpi][zero]") {
  constexpr double kLr = 1e-5;
  const std::vector<double> w0{0.5, 0.25, -0.125};
  auto input_of = [](int r) { return std::vector<double>{40000.0 + 8000.0 * (r % 2), 3.0 + r, -1.5 * (r + 1)}; };
  std::vector<double> want = w0;
  for (int r = 0; r < group().size(); ++r)
    for (size_t i = 0; i < want.size(); ++i) want[i] -= kLr * input_of(r)[i] / group().size();
  for (const json& stage : kAllStages) {
    INFO(stage.dump());
    auto model = std::make_shared<nn::Linear>(3, 1, /*bias=*/false);
    {
      NoGradGuard no_grad;
      model->weight.copy_(from_vector(w0, {1, 3}));
    }
    Zero z = make_zero(with_stage(stage, {{"precision", "fp16"}, {"initial_scale", 1.0}}), model,
                       {{"type", "sgd"}, {"lr", kLr}});
    z.parts.optimizer->zero_grad();
    z.parts.precision->backward(sum((*z.parts.model)(from_vector(input_of(group().rank()), {1, 3}))),
                                *z.parts.optimizer);
    z.parts.precision->step(*z.parts.optimizer);
    CHECK_FALSE(z.parts.precision->step_was_skipped());
    CHECK(z.parts.precision->loss_scale() == 1.0);
    std::vector<double> got;
    z.plugin->with_full_parameters([&] { got = z.parts.model->parameters()[0].tolist(); });
    for (size_t i = 0; i < want.size(); ++i) {
      INFO("weight " << i << ": got " << got[i] << ", want " << want[i]);
      CHECK(std::abs(got[i] - want[i]) <= std::ldexp(1.0, -10) * std::abs(w0[i]));  // float16 rounding
    }
    CHECK(std::abs(got[0] - w0[0]) > 0.4);  // it stepped, by the mean
  }
}

TEST_CASE("zero: max_norm clipping across shards equals clipping the whole gradient", "[mpi][zero]") {
  const double max_norm = 0.05, lr = 0.1;
  // Reference: torch.nn.utils.clip_grad_norm_ on the whole-batch float32 gradient, then SGD.
  nn::ModulePtr ref = make_model(7);
  loss_of(*ref, whole_batch(0)).backward();
  double sum_of_squares = 0;
  for (const Tensor& p : ref->parameters())
    for (double g : p.grad().tolist()) sum_of_squares += g * g;
  const double norm = std::sqrt(sum_of_squares);
  const double coef = std::min(1.0, max_norm / (norm + 1e-6));
  REQUIRE(coef < 0.5);  // clipping is active
  std::vector<Tensor> expected;
  for (const Tensor& p : ref->parameters()) expected.push_back(sub(p.detach(), mul(p.grad(), lr * coef)));

  for (const std::string precision : {"fp32", "fp16", "bf16"}) {
    // 16 bits: the forward and backward run on rounded weights and activations, a few roundings of
    // u = 2^-11 (fp16) or 2^-8 (bf16) per element, so the norm may differ by several u; a missing
    // unscale (x1024) or a sum where an average belongs (x2) is far outside. The weights after the
    // step are the float32 result rounded once to 16 bits (within u of the largest weight).
    const double u = precision == "fp16" ? std::ldexp(1.0, -11) : precision == "bf16" ? std::ldexp(1.0, -8) : 0.0;
    // fp32: the norm's roundoff is the gradient's (its reductions) plus its own sum over the 212
    // parameters; the one SGD step lr coef g then moves each weight by that relative error of a step,
    // no more than it relative to the largest weight.
    const double fp32_norm =
        ::testing::roundoff::reduction_bound({2 * (kIn + kHidden + 2.0 * kBatch * kOut), 2.0 * kBatch, 212});
    const double norm_tolerance = precision == "fp32" ? fp32_norm : 8 * u;
    const double weight_tolerance = precision == "fp32" ? 2 * fp32_norm : 2 * u;
    for (const json& stage : kAllStages) {
      for (bool explicit_call : {false, true}) {
        INFO(precision << " " << stage.dump() << (explicit_call ? ", clip_grad_norm called" : ", max_norm option"));
        json options = with_stage(stage, {{"precision", precision}, {"initial_scale", 1024.0}});
        if (!explicit_call) options["max_norm"] = max_norm;
        Zero z = make_zero(options, make_model(7), {{"type", "sgd"}, {"lr", lr}});
        z.parts.optimizer->zero_grad();
        z.parts.precision->backward(loss_of(*z.parts.model, my_rows(whole_batch(0))), *z.parts.optimizer);
        if (explicit_call) {
          const double got_norm = z.parts.precision->clip_grad_norm(*z.parts.optimizer, max_norm);
          REQUIRE(got_norm == Approx(norm).epsilon(norm_tolerance));
        }
        z.parts.precision->step(*z.parts.optimizer);
        REQUIRE_FALSE(z.parts.precision->step_was_skipped());
        REQUIRE(z.parts.precision->last_step_stats().grad_norm == Approx(norm).epsilon(norm_tolerance));
        const std::vector<Tensor> got = gathered_params(z);
        for (size_t i = 0; i < got.size(); ++i) REQUIRE(relative_error(got[i], expected[i]) < weight_tolerance);
      }
    }
  }
}

TEST_CASE("zero: gradient accumulation: stage 1 with no_sync, every stage with synced backwards",
          "[mpi][zero]") {
  // Reference: one step on all four micro-batches (two per rank).
  const Batch big = whole_batch(0, 4 * kBatch);
  nn::ModulePtr ref = make_model(7);
  auto ref_opt = optim::make_optimizer({{"type", "sgd"}, {"lr", 0.1}}, ref->parameters());
  const std::vector<Tensor> initial = float32_params(*ref);
  loss_of(*ref, big).backward();
  ref_opt->step();
  const std::vector<Tensor> expected = float32_params(*ref);
  // One SGD step: the path is the step itself; the gradient sums over 4 B rows (Note [Roundoff bounds]).
  const double bound = ::testing::roundoff::sgd_bound(
      l2_distance(expected, initial),
      ::testing::roundoff::reduction_bound({2 * (kIn + kHidden + 4.0 * kBatch * kOut), 4.0 * kBatch}));

  // Rank r's rows [2rB, 2(r+1)B) in two micro-batches, each loss halved (a mean over 2B rows).
  const int64_t r = group().rank();
  auto micro = [&](int k) {
    return Batch{big.x.narrow(0, (2 * r + k) * kBatch, kBatch), big.y.narrow(0, (2 * r + k) * kBatch, kBatch)};
  };
  for (const json& stage : kAllStages) {
    for (bool no_sync : {false, true}) {
      if (no_sync && stage.at("stage") != 1) continue;  // IncompatibleError (tested above)
      INFO(stage.dump() << (no_sync ? ", no_sync" : ", synced"));
      Zero z = make_zero(with_stage(stage, {{"precision", "fp32"}}), make_model(7), {{"type", "sgd"}, {"lr", 0.1}});
      z.parts.optimizer->zero_grad();
      if (no_sync) z.plugin->set_gradient_sync(false);
      z.parts.precision->backward(mul(loss_of(*z.parts.model, micro(0)), 0.5), *z.parts.optimizer);
      z.plugin->set_gradient_sync(true);
      z.parts.precision->backward(mul(loss_of(*z.parts.model, micro(1)), 0.5), *z.parts.optimizer);
      z.parts.precision->step(*z.parts.optimizer);
      const std::vector<Tensor> got = gathered_params(z);
      for (size_t i = 0; i < got.size(); ++i) REQUIRE(max_abs_diff(got[i], expected[i]) <= bound);
    }
  }
}

TEST_CASE("zero: zero_grad drops the gradients of a backward that no step consumed (stages 1 and 2)",
          "[mpi][zero]") {
  // A backward on a batch, then zero_grad, then the real step: it must equal the real step alone. The
  // reduced shard gradient lives outside the flat buffer the base zero_grad clears, so ZeroOptimizer
  // clears it itself (otherwise stage 2 adds the stale gradient into the next step).
  const Batch stale = whole_batch(5), fresh = whole_batch(6);
  for (const json& stage : kStages) {
    INFO(stage.dump());
    Zero want = make_zero(with_stage(stage, {{"precision", "fp32"}}), make_model(7), {{"type", "sgd"}, {"lr", 0.1}});
    want.train_step(my_rows(fresh));
    Zero got = make_zero(with_stage(stage, {{"precision", "fp32"}}), make_model(7), {{"type", "sgd"}, {"lr", 0.1}});
    got.parts.optimizer->zero_grad();
    got.parts.precision->backward(loss_of(*got.parts.model, my_rows(stale)), *got.parts.optimizer);
    got.train_step(my_rows(fresh));
    const std::vector<Tensor> a = float32_params(*want.parts.model), b = float32_params(*got.parts.model);
    for (size_t i = 0; i < a.size(); ++i) CHECK(bitwise_equal(a[i], b[i]));
  }
}

// Note [ZeRO partitions], "Where the gradients are": the reduced gradient lives in this rank's float32 shard,
// not in the model's .grad(), and step() consumes it, as in ColossalAI's low-level ZeRO.
TEST_CASE("zero: after a synced backward the model's grads are empty, and step() consumes the gradients "
          "(nothing carries over without zero_grad)",
          "[mpi][zero]") {
  const Batch first = whole_batch(7), second = whole_batch(8);
  for (const json& stage : kStages) {
    INFO(stage.dump());
    Zero z = make_zero(with_stage(stage, {{"precision", "fp32"}}), make_model(7), {{"type", "sgd"}, {"lr", 0.1}});
    z.parts.optimizer->zero_grad();
    z.parts.precision->backward(loss_of(*z.parts.model, my_rows(first)), *z.parts.optimizer);
    for (const Tensor& p : z.parts.model->parameters()) {
      if (stage.at("stage") == 2) {
        CHECK_FALSE(p.grad().defined());
      } else {  // a view of the flat buffer, cleared once reduced
        REQUIRE(p.grad().defined());
        for (double g : p.grad().tolist()) CHECK(g == 0.0);
      }
    }
    z.parts.precision->step(*z.parts.optimizer);
    // The second step without zero_grad() equals one after zero_grad(): torch would add the first
    // backward's gradients into it.
    z.parts.precision->backward(loss_of(*z.parts.model, my_rows(second)), *z.parts.optimizer);
    z.parts.precision->step(*z.parts.optimizer);
    Zero want = make_zero(with_stage(stage, {{"precision", "fp32"}}), make_model(7), {{"type", "sgd"}, {"lr", 0.1}});
    want.train_step(my_rows(first));
    want.train_step(my_rows(second));
    const std::vector<Tensor> a = float32_params(*want.parts.model), b = float32_params(*z.parts.model);
    for (size_t i = 0; i < a.size(); ++i) CHECK(bitwise_equal(a[i], b[i]));
  }
}

TEST_CASE("zero: stage 2's grad-ready hooks leave with its optimizer (the model may outlive the plugin)",
          "[mpi][zero]") {
  nn::ModulePtr model = make_model(7);
  const Tensor first = model->parameters().front();
  const size_t before = first.impl()->grad_ready_hooks.size();
  {
    Zero z = make_zero({{"stage", 2}, {"precision", "fp32"}}, model, kAdamW);
    REQUIRE(first.impl()->grad_ready_hooks.size() == before + 1);
    z.train_step(my_rows(whole_batch(0)));
  }
  REQUIRE(first.impl()->grad_ready_hooks.size() == before);
  loss_of(*model, my_rows(whole_batch(1))).backward();  // the plain model still trains
  REQUIRE(first.grad().defined());
}

TEST_CASE("zero: the gathered state_dict round trip continues bit-identically", "[mpi][zero]") {
  for (const json& stage : kStages) {
    INFO(stage.dump());
    const json options = with_stage(stage, {{"precision", "fp16"}, {"initial_scale", 1024.0}, {"growth_interval", 3}});
    Zero a = make_zero(options, make_model(7), kAdamW);
    for (int s = 0; s < 5; ++s) a.train_step(my_rows(whole_batch(s)));
    // Snapshot: gathered optimizer state (collective), model, scaler.
    optim::OptimizerState saved = a.parts.optimizer->state_dict();
    for (auto& [k, t] : saved.tensors) t = t.clone();
    REQUIRE(saved.tensors.count("state.0.exp_avg"));
    REQUIRE(saved.tensors.count("state.3.master_weight"));
    REQUIRE(saved.tensors.at("state.2.exp_avg_sq").shape() == Shape{kOut, kHidden});  // the parameter's shape
    REQUIRE(saved.meta.at("state").at("3").at("step") == 5);
    nn::StateDict weights = a.parts.model->state_dict();
    for (auto& [k, t] : weights) t = t.clone();
    const mixed_precision::MixedPrecisionState scaler = a.parts.precision->state_dict();
    for (int s = 5; s < 10; ++s) a.train_step(my_rows(whole_batch(s)));

    Zero b = make_zero(options, make_model(12345), kAdamW);  // other weights, fresh state
    b.parts.model->load_state_dict(weights);
    b.parts.optimizer->load_state_dict(saved);
    b.parts.precision->load_state_dict(scaler);
    for (int s = 5; s < 10; ++s) b.train_step(my_rows(whole_batch(s)));

    REQUIRE(b.parts.precision->loss_scale() == a.parts.precision->loss_scale());
    const std::vector<Tensor> pa = a.parts.model->parameters(), pb = b.parts.model->parameters();
    for (size_t i = 0; i < pa.size(); ++i) REQUIRE(bitwise_equal(pa[i], pb[i]));
    const optim::OptimizerState sa = a.parts.optimizer->state_dict(), sb = b.parts.optimizer->state_dict();
    REQUIRE(sa.tensors.size() == sb.tensors.size());
    for (const auto& [k, t] : sa.tensors) {
      INFO(k);
      REQUIRE(bitwise_equal(t, sb.tensors.at(k)));
    }
  }
}

TEST_CASE("zero: load_state_dict refuses a state that does not fit, naming what is wrong", "[mpi][zero]") {
  Zero z = make_zero({{"stage", 2}, {"precision", "fp16"}, {"initial_scale", 1024.0}}, make_model(7), kAdamW);
  z.train_step(my_rows(whole_batch(0)));
  const optim::OptimizerState good = z.parts.optimizer->state_dict();

  optim::OptimizerState other_type = good;
  other_type.meta["type"] = "SGD";
  REQUIRE_THROWS_WITH(z.parts.optimizer->load_state_dict(other_type), Catch::Contains("saved by \"SGD\""));
  optim::OptimizerState no_groups = good;
  no_groups.meta["param_groups"].push_back(no_groups.meta["param_groups"][0]);
  REQUIRE_THROWS_AS(z.parts.optimizer->load_state_dict(no_groups), CheckpointError);
  optim::OptimizerState wrong_shape = good;
  wrong_shape.tensors["state.1.exp_avg"] = zeros({3});
  REQUIRE_THROWS_WITH(z.parts.optimizer->load_state_dict(wrong_shape), Catch::Contains("'state.1.exp_avg' has shape"));
  optim::OptimizerState missing = good;
  missing.tensors.erase("state.2.exp_avg_sq");
  REQUIRE_THROWS_WITH(z.parts.optimizer->load_state_dict(missing), Catch::Contains("no 'state.2.exp_avg_sq'"));
  REQUIRE_NOTHROW(z.parts.optimizer->load_state_dict(good));
}

TEST_CASE("zero: an unsharded optimizer's state_dict loads into the shards (portable across world sizes)",
          "[mpi][zero]") {
  // One process trains 5 steps with a plain AdamW, then hands model and optimizer state to ZeRO on 2
  // ranks, which continues; the result must match the one process continuing alone.
  nn::ModulePtr solo = make_model(7);
  auto solo_opt = optim::make_optimizer(kAdamW, solo->parameters());
  auto solo_step = [&](int s) {
    solo_opt->zero_grad();
    loss_of(*solo, whole_batch(s)).backward();
    solo_opt->step();
  };
  for (int s = 0; s < 5; ++s) solo_step(s);
  optim::OptimizerState saved = solo_opt->state_dict();
  for (auto& [k, t] : saved.tensors) t = t.clone();
  nn::StateDict weights = solo->state_dict();
  for (auto& [k, t] : weights) t = t.clone();
  for (int s = 5; s < 10; ++s) solo_step(s);

  Zero z = make_zero({{"stage", 2}, {"precision", "fp32"}}, make_model(99), kAdamW);
  z.parts.model->load_state_dict(weights);
  z.parts.optimizer->load_state_dict(saved);
  for (int s = 5; s < 10; ++s) z.train_step(my_rows(whole_batch(s)));
  const std::vector<Tensor> got = float32_params(*z.parts.model), expected = float32_params(*solo);
  // Steps 6 to 10 of AdamW after the resume: Adam's drift over them (Note [Roundoff bounds]).
  double drift = 0;
  for (int t = 6; t <= 10; ++t) drift += 2 * 1e-2 * ::testing::roundoff::adam_step_ratio(0.9, 0.999, t);
  for (size_t i = 0; i < got.size(); ++i) REQUIRE(max_abs_diff(got[i], expected[i]) <= drift);
}

// ------------------------------------------------------------------------------------ through the Booster

namespace {

nn::Criterion mse() {
  return [](const Tensor& output, const Tensor& target) { return mse_loss(output, target); };
}

// A directory both ranks agree on (rank 0's pid).
std::filesystem::path shared_dir(const std::string& stem) {
  Tensor pid = full({1}, double(getpid()), DType::Int64);
  group().broadcast(pid, 0);
  return std::filesystem::temp_directory_path() / (stem + std::to_string(int64_t(pid.item())));
}

}  // namespace

TEST_CASE("zero: the Booster rejects 16-bit strategies with low_level_zero and names the option to use",
          "[mpi][zero][booster]") {
  REQUIRE_THROWS_AS(Booster(BoosterConfig{.mixed_precision = "fp16", .plugin = "low_level_zero"}), IncompatibleError);
  REQUIRE_THROWS_WITH(Booster(BoosterConfig{.mixed_precision = "fp16_naive", .plugin = "low_level_zero"}),
                      Catch::Contains("low_level_zero manages precision itself"));
  Booster ok(BoosterConfig{.plugin = "low_level_zero", .plugin_options = {{"stage", 2}}});
  REQUIRE(ok.plugin().name() == "low_level_zero");
}

TEST_CASE("zero: through the Booster, a scheduler on the user's optimizer drives the shard optimizer",
          "[mpi][zero][booster]") {
  // Reference: one process, whole batch, AdamW with StepLR halving the lr every 5 steps.
  nn::ModulePtr ref = make_model(7);
  auto ref_opt = optim::make_optimizer(kAdamW, ref->parameters());
  optim::StepLR ref_sched(*ref_opt, 5, 0.5);
  for (int s = 0; s < 20; ++s) {
    ref_opt->zero_grad();
    loss_of(*ref, whole_batch(s)).backward();
    ref_opt->step();
    ref_sched.step();
  }
  for (const json& stage : kStages) {
    INFO(stage.dump());
    Booster booster(BoosterConfig{.plugin = "low_level_zero", .plugin_options = with_stage(stage, {{"precision", "fp32"}})});
    nn::ModulePtr model = make_model(group().rank() == 0 ? 7 : 8);
    std::shared_ptr<optim::Optimizer> opt = optim::make_optimizer(kAdamW, model->parameters());
    auto sched = std::make_shared<optim::StepLR>(*opt, 5, 0.5);
    Boosted b = booster.boost(model, opt, mse(), nullptr, sched);
    for (int s = 0; s < 20; ++s) {
      const Batch rows = my_rows(whole_batch(s));
      b.optimizer->zero_grad();
      booster.backward(b.criterion((*b.model)(rows.x), rows.y), *b.optimizer);
      b.optimizer->step();
      b.scheduler->step();
    }
    REQUIRE(b.optimizer->lr() == Approx(1e-2 / 16));
    REQUIRE(b.optimizer->stepped_optimizer().lr() == Approx(1e-2 / 8));  // the lr of the 20th step
    const std::vector<Tensor> got = float32_params(*b.model), expected = float32_params(*ref);
    std::vector<double> lrs;  // StepLR(5, 0.5) from 1e-2
    for (int s = 0; s < 20; ++s) lrs.push_back(1e-2 * std::pow(0.5, s / 5));
    for (size_t i = 0; i < got.size(); ++i) REQUIRE(max_abs_diff(got[i], expected[i]) <= weight_bound(kAdamW, 20, 0, lrs));
  }
}

// Note [Gradient accumulation in a loop] (booster/booster/booster.h): the README's loop with
// booster.accumulate(3), 3 micro-batches of kBatch rows per rank and step, ends where one process
// stepping once on all of their rows does, at every stage: stage 1 accumulates under no_sync, stages 2
// and 3 (which cannot skip the reduction) add each micro-batch's reduced gradient into the shard.
TEST_CASE("zero: accumulate(3) over micro-batches steps as one process on their whole batch, every stage",
          "[mpi][zero][booster]") {
  constexpr int kAccumulation = 3, kSteps = 4;
  const int64_t whole_rows = group().size() * kAccumulation * kBatch;
  const json sgd = {{"type", "sgd"}, {"lr", 0.1}, {"momentum", 0.9}};
  // Reference: one process, one step per whole batch.
  nn::ModulePtr ref = make_model(7);
  auto ref_opt = optim::make_optimizer(sgd, ref->parameters());
  std::vector<Tensor> before = float32_params(*ref);
  double path = 0;
  for (int s = 0; s < kSteps; ++s) {
    ref_opt->zero_grad();
    loss_of(*ref, whole_batch(s, whole_rows)).backward();
    ref_opt->step();
    std::vector<Tensor> now = float32_params(*ref);
    path += l2_distance(now, before);
    before = std::move(now);
  }
  // Note [Roundoff bounds]: the gradient's reductions over the whole batch, plus the accumulation's sum
  // of 3 micro-batch gradients and its division by 3; the weights within SGD's bound along the path.
  const double eps = ::testing::roundoff::reduction_bound(
      {2 * (kIn + kHidden + double(whole_rows * kOut)), double(whole_rows), kAccumulation + 1.0});
  const double bound = ::testing::roundoff::sgd_bound(path, eps, 0.9);
  for (const json& stage : kAllStages) {
    INFO(stage.dump());
    Booster booster(BoosterConfig{.plugin = "low_level_zero", .plugin_options = with_stage(stage, {{"precision", "fp32"}})});
    nn::ModulePtr model = make_model(group().rank() == 0 ? 7 : 8);
    Boosted b = booster.boost(model, optim::make_optimizer(sgd, model->parameters()), mse());
    for (int s = 0; s < kSteps; ++s) {
      const Batch whole = whole_batch(s, whole_rows);
      for (int k = 0; k < kAccumulation; ++k) {
        // Micro-batch k of rank r: rows (k * ranks + r) * kBatch on; all of them make the whole batch.
        const int64_t first = (k * group().size() + group().rank()) * kBatch;
        auto micro_step = booster.accumulate(kAccumulation);
        b.optimizer->zero_grad();
        booster.backward(b.criterion((*b.model)(whole.x.narrow(0, first, kBatch)), whole.y.narrow(0, first, kBatch)),
                         *b.optimizer);
        b.optimizer->step();
      }
      CHECK(b.optimizer->steps() == s + 1);
    }
    std::vector<Tensor> got;
    booster.plugin().with_full_parameters([&] { got = float32_params(*b.model); });
    CHECK(l2_distance(got, before) <= bound);
  }
}

TEST_CASE("zero: Booster save and load (optimizer gathered into one file by rank 0) continue bit-identically",
          "[mpi][zero][booster][checkpoint]") {
  const std::filesystem::path dir = shared_dir("booster_test_mpi_zero_");
  const json options = {{"stage", 2}, {"precision", "fp16"}, {"initial_scale", 1024.0}, {"growth_interval", 3}};
  auto make = [&](Booster& booster, uint64_t seed) {
    nn::ModulePtr model = make_model(seed);
    std::shared_ptr<optim::Optimizer> opt = optim::make_optimizer(kAdamW, model->parameters());
    return booster.boost(model, opt, mse(), nullptr, std::make_shared<optim::StepLR>(*opt, 3, 0.5));
  };
  auto steps = [&](Booster& booster, Boosted& b, int from, int to) {
    for (int s = from; s < to; ++s) {
      const Batch rows = my_rows(whole_batch(s));
      b.optimizer->zero_grad();
      booster.backward(b.criterion((*b.model)(rows.x), rows.y), *b.optimizer);
      b.optimizer->step();
      b.scheduler->step();
    }
  };
  Booster first(BoosterConfig{.plugin = "low_level_zero", .plugin_options = options});
  Boosted a = make(first, 7);
  steps(first, a, 0, 5);
  first.save_model(*a.model, dir / "model");
  first.save_optimizer(*a.optimizer, dir / "optimizer");
  first.save_lr_scheduler(*a.scheduler, dir / "scheduler.json");
  REQUIRE(std::filesystem::exists(dir / "optimizer" / "optimizer.safetensors"));
  steps(first, a, 5, 10);

  Booster second(BoosterConfig{.plugin = "low_level_zero", .plugin_options = options});
  Boosted b = make(second, 4242);
  second.load_model(*b.model, dir / "model");
  second.load_optimizer(*b.optimizer, dir / "optimizer");
  second.load_lr_scheduler(*b.scheduler, dir / "scheduler.json");
  steps(second, b, 5, 10);
  REQUIRE(second.precision().loss_scale() == first.precision().loss_scale());
  REQUIRE(b.optimizer->lr() == a.optimizer->lr());
  const std::vector<Tensor> pa = a.model->parameters(), pb = b.model->parameters();
  for (size_t i = 0; i < pa.size(); ++i) REQUIRE(bitwise_equal(pa[i], pb[i]));
  group().barrier();
  if (group().rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("zero: through the Booster a rank holds what the plugin alone holds (the user's optimizer gives its "
          "buffers back)",
          "[mpi][zero][booster]") {
  for (const json& stage : kStages) {
    INFO(stage.dump());
    const json options = with_stage(stage, {{"precision", "fp32"}});
    const Batch rows = my_rows(whole_batch(0));
    int64_t direct = 0, boosted = 0;
    {
      const size_t start = cpu_bytes_in_use();
      Zero z = make_zero(options, make_model(7), kAdamW);
      z.train_step(rows);
      direct = int64_t(cpu_bytes_in_use()) - int64_t(start);
    }
    {
      const size_t start = cpu_bytes_in_use();
      Booster booster(BoosterConfig{.plugin = "low_level_zero", .plugin_options = options});
      nn::ModulePtr model = make_model(7);
      std::shared_ptr<optim::Optimizer> opt = optim::make_optimizer(kAdamW, model->parameters());
      Boosted b = booster.boost(model, opt, mse());
      b.optimizer->zero_grad();
      booster.backward(b.criterion((*b.model)(rows.x), rows.y), *b.optimizer);
      b.optimizer->step();
      boosted = int64_t(cpu_bytes_in_use()) - int64_t(start);
      REQUIRE(opt->flat_buffers(0).empty());  // the user's optimizer keeps options only
    }
    REQUIRE(boosted == direct);
  }
}

TEST_CASE("zero: stages 1 and 2 match the ddp plugin (fp32 AdamW; fp16 against ddp with fp16_naive)",
          "[mpi][zero][booster]") {
  // Same data split, same reduction (the Avg of two ranks' gradients in the working dtype rounds
  // once, whichever collective computes it), the same elementwise update on float32 masters: sharding
  // changes which rank computes an element, not how. The trajectories are bit-identical today; the
  // bound leaves room only for a vectorized kernel that rounds a run's tail differently.
  auto train = [](Booster& booster, uint64_t seed) {
    nn::ModulePtr model = make_model(seed);
    std::shared_ptr<optim::Optimizer> opt = optim::make_optimizer(kAdamW, model->parameters());
    Boosted b = booster.boost(model, opt, mse());
    for (int s = 0; s < 20; ++s) {
      const Batch rows = my_rows(whole_batch(s));
      b.optimizer->zero_grad();
      booster.backward(b.criterion((*b.model)(rows.x), rows.y), *b.optimizer);
      b.optimizer->step();
      REQUIRE_FALSE(b.optimizer->step_was_skipped());
    }
    return float32_params(*b.model);
  };
  for (const std::string precision : {"fp32", "fp16"}) {
    Booster ddp(precision == "fp32"
                    ? BoosterConfig{.plugin = "ddp"}
                    : BoosterConfig{.mixed_precision = "fp16_naive",
                                    .mixed_precision_options = {{"initial_scale", 1024.0}},
                                    .plugin = "ddp"});
    const std::vector<Tensor> expected = train(ddp, 7);
    for (const json& stage : kStages) {
      INFO(precision << " " << stage.dump());
      Booster zero(BoosterConfig{.plugin = "low_level_zero",
                                 .plugin_options = with_stage(stage, {{"precision", precision}, {"initial_scale", 1024.0}})});
      const std::vector<Tensor> got = train(zero, group().rank() == 0 ? 7 : 8);
      for (size_t i = 0; i < got.size(); ++i) REQUIRE(relative_error(got[i], expected[i]) < 1e-6);
    }
  }
}

// ------------------------------------------------------------------------------------------- stage 3

TEST_CASE("zero3: fp32 stage 3 on 2 ranks matches one process with the whole batch (AdamW, SGD)", "[mpi][zero]") {
  for (const json& optimizer : {kAdamW, json{{"type", "sgd"}, {"lr", 0.1}, {"momentum", 0.9}}}) {
    INFO(optimizer.dump());
    double path = 0;
    const std::vector<Tensor> expected = reference_fp32(optimizer, 20, &path);
    Zero z = make_zero({{"stage", 3}, {"precision", "fp32"}}, make_model(group().rank() == 0 ? 7 : 99), optimizer);
    // At rest no parameter holds memory: reading one outside a forward is a StateError naming why.
    REQUIRE_THROWS_WITH(z.parts.model->parameters()[0].tolist(), Catch::Contains("ZeRO stage 3"));
    for (int s = 0; s < 20; ++s) z.train_step(my_rows(whole_batch(s)));
    const std::vector<Tensor> got = gathered_params(z);
    REQUIRE(got.size() == expected.size());
    for (size_t i = 0; i < got.size(); ++i) REQUIRE(max_abs_diff(got[i], expected[i]) <= weight_bound(optimizer, 20, path));
    // Gathered once more, both ranks hold the same values.
    z.plugin->with_full_parameters([&] { require_same_on_every_rank(*z.parts.model); });
    // Evaluation gathers each module's parameters for its forward only.
    NoGradGuard no_grad;
    const Batch b = whole_batch(99);
    Tensor out = (*z.parts.model)(b.x);
    REQUIRE(out.shape() == Shape{2 * kBatch, kOut});
  }
}

// Two ranks average two values, which any reduction does in one way (Note [Averages divide first]): so
// stage 3 must give stage 2's parameters bit for bit. Against one process only the summation of the
// batch differs; SGD keeps that at float32 rounding (AdamW divides by the root of tiny second moments of
// rarely seen embedding rows, which magnifies it).
// Tied (GPT-2's lm_head reads the embedding's weight, Note [ZeRO-3: tied parameters]) and untied.
TEST_CASE("zero3: a GPT (embeddings, layer norms, attention) trains as stage 2 and one process do, also "
          "with activation checkpointing and tied embeddings", "[mpi][zero]") {
  nn::GPTConfig cfg;
  cfg.vocab_size = 32;
  cfg.context = 8;
  cfg.width = 16;
  cfg.layers = 2;
  cfg.heads = 2;
  auto batch = [&](int step) {
    Generator gen(500 + uint64_t(step));
    Tensor ids = randint(0, cfg.vocab_size, {4, cfg.context}, &gen);
    Tensor targets = randint(0, cfg.vocab_size, {4, cfg.context}, &gen);
    return std::make_pair(ids, targets);
  };
  auto gpt_loss = [](nn::Module& model, const Tensor& ids, const Tensor& targets) {
    const Tensor logits = model(ids);
    return cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  };
  const json sgd = {{"type", "sgd"}, {"lr", 0.1}, {"momentum", 0.9}};
  auto train_zero = [&](int stage, const json& optimizer) {
    Zero z;
    z.plugin = load_zero({{"stage", stage}, {"precision", "fp32"}});
    TrainingParts parts;
    parts.model = std::make_shared<nn::GPT>(cfg, 3);
    parts.optimizer = optim::make_optimizer(optimizer, parts.model->parameters());
    parts.precision = mixed_precision::create("fp32");
    z.parts = z.plugin->configure(parts);
    for (int s = 0; s < 5; ++s) {
      const auto [ids, targets] = batch(s);
      const int64_t rows = ids.size(0) / group().size();
      z.parts.optimizer->zero_grad();
      z.parts.precision->backward(gpt_loss(*z.parts.model, ids.narrow(0, group().rank() * rows, rows),
                                           targets.narrow(0, group().rank() * rows, rows)),
                                  *z.parts.optimizer);
      z.parts.precision->step(*z.parts.optimizer);
    }
    return gathered_params(z);
  };
  for (const auto& [tied, checkpointing] : {std::pair{false, false}, {false, true}, {true, false}, {true, true}}) {
    INFO("tied " << tied << ", activation checkpointing " << checkpointing);
    cfg.tie_word_embeddings = tied;
    cfg.activation_checkpointing = checkpointing;
    auto reference = std::make_shared<nn::GPT>(cfg, 3);
    auto ref_opt = optim::make_optimizer(sgd, reference->parameters());
    double path = 0;
    std::vector<Tensor> before = float32_params(*reference);
    for (int s = 0; s < 5; ++s) {
      const auto [ids, targets] = batch(s);
      ref_opt->zero_grad();
      gpt_loss(*reference, ids, targets).backward();
      ref_opt->step();
      std::vector<Tensor> now = float32_params(*reference);
      path += l2_distance(now, before);
      before = std::move(now);
    }
    const std::vector<Tensor> want = float32_params(*reference), got = train_zero(3, sgd);
    REQUIRE(got.size() == want.size());
    // Note [Roundoff bounds] for this GPT on 4 sequences of 8, SGD with momentum 0.9 along the path.
    namespace ro = ::testing::roundoff;
    const double bound =
        ro::sgd_bound(path, ro::reduction_bound({2 * ro::gpt_forward_length(16, 2, 2, 8, 32, 4), 4 * 8}), 0.9);
    INFO("path " << path << ", bound " << bound);
    for (size_t i = 0; i < got.size(); ++i) REQUIRE(max_abs_diff(got[i], want[i]) <= bound);
    if (group().size() == 2) {
      const std::vector<Tensor> stage2 = train_zero(2, kAdamW), stage3 = train_zero(3, kAdamW);
      for (size_t i = 0; i < stage3.size(); ++i) REQUIRE(bitwise_equal(stage3[i], stage2[i]));
    }
  }
}

TEST_CASE("zero3: a rank holds about 1/N of the parameters at rest (allocator counters)", "[mpi][zero]") {
  // A model large enough that the parameters dominate what else is allocated.
  auto big = [] {
    Generator gen(5);
    auto model = std::make_shared<nn::Sequential>();
    model->push_back(std::make_shared<nn::Linear>(256, 1024, true, &gen));
    model->push_back(std::make_shared<nn::Tanh>());
    model->push_back(std::make_shared<nn::Linear>(1024, 256, true, &gen));
    model->set_tensor_names();
    return model;
  };
  const int64_t params = 256 * 1024 + 1024 + 1024 * 256 + 256;
  auto resting_bytes = [&](int stage) {
    const size_t before = cpu_bytes_in_use();
    size_t after = 0;
    {
      Zero z = make_zero({{"stage", stage}, {"precision", "fp32"}}, big(), json{{"type", "sgd"}, {"lr", 0.1}});
      Generator gen(9);
      const Batch b{randn({4, 256}, &gen), randn({4, 256}, &gen)};
      z.train_step(b);
      after = cpu_bytes_in_use();
    }
    return double(after - before);
  };
  const double stage2 = resting_bytes(2), stage3 = resting_bytes(3);
  // SGD without momentum keeps no state. Between steps stage 2 holds the whole float32 parameters
  // and its shard's gradient, 4 P + 4 P / N bytes; stage 3 only its shard of the parameters, 4 P / N
  // (its shard's gradient lives from the backward to the step).
  const double n = group().size();
  INFO("stage 2 " << stage2 << " B, stage 3 " << stage3 << " B, " << params << " parameters");
  REQUIRE(std::abs(stage2 - (4.0 * params + 4.0 * params / n)) < 0.05 * 4.0 * params);
  REQUIRE(std::abs(stage3 - 4.0 * params / n) < 0.05 * 4.0 * params / n);
}

namespace {
// Two heads, one used per step (`use_b`, set by the test): on a step where a head is not run its
// parameters get no gradient at all, as a branch or a frozen tower in a real model.
class TwoHeads : public nn::Module {
 public:
  explicit TwoHeads(uint64_t seed) {
    Generator gen(seed);
    trunk_ = register_module("trunk", std::make_shared<nn::Linear>(kIn, kHidden, true, &gen));
    a_ = register_module("a", std::make_shared<nn::Linear>(kHidden, kOut, true, &gen));
    b_ = register_module("b", std::make_shared<nn::Linear>(kHidden, kOut, true, &gen));
    set_tensor_names();
  }
  Tensor forward(const Tensor& x) override {
    const Tensor h = tanh((*trunk_)(x));
    const Tensor out = (use_b ? *b_ : *a_)(h);
    // The other head's exact zero gradient, through autograd (the reference of the Note below).
    return zero_other ? add(out, mul((use_b ? *a_ : *b_)(h), 0.0)) : out;
  }
  std::string name() const override { return "TwoHeads"; }
  bool use_b = false;
  bool zero_other = false;

 private:
  std::shared_ptr<nn::Linear> trunk_, a_, b_;
};
}  // namespace

// Note [ZeRO and parameters without a gradient]: a parameter that gets no gradient on a step (a head
// not run, a frozen branch) is stepped with a zero gradient at every stage, as PyTorch's FSDP and
// DeepSpeed do with their flat buffers (not skipped, as a plain optimizer skips a None grad): SGD's
// momentum carries it on and weight decay shrinks it. Every stage must do exactly that, so the
// reference is one process whose missing gradients are zero-filled; head b runs on steps 2 and 5 only.
// (A stage that skipped them, or stepped them with stale or garbage gradients, is far outside the
// roundoff bound: momentum alone moves them by lr x 0.9 x |buffer| a step.)
TEST_CASE("zero: parameters without a gradient on a step are stepped with zeros, at every stage",
          "[mpi][zero]") {
  const json sgd = {{"type", "sgd"}, {"lr", 0.1}, {"momentum", 0.9}, {"weight_decay", 0.1}};
  constexpr int kSteps = 6;
  auto uses_b = [](int s) { return s == 2 || s == 5; };
  auto reference = std::make_shared<TwoHeads>(7);
  reference->zero_other = true;
  auto opt = optim::make_optimizer(sgd, reference->parameters());
  std::vector<Tensor> before = float32_params(*reference);
  double path = 0;
  for (int s = 0; s < kSteps; ++s) {
    reference->use_b = uses_b(s);
    opt->zero_grad();
    loss_of(*reference, whole_batch(s)).backward();
    opt->step();
    std::vector<Tensor> now = float32_params(*reference);
    path += l2_distance(now, before);
    before = std::move(now);
  }
  const std::vector<Tensor>& want = before;
  const double bound = weight_bound(sgd, kSteps, path);
  for (const json& stage : kAllStages) {
    INFO(stage.dump() << ", path " << path << ", bound " << bound);
    auto model = std::make_shared<TwoHeads>(7);
    Zero z = make_zero(with_stage(stage, {{"precision", "fp32"}}), model, sgd);
    for (int s = 0; s < kSteps; ++s) {
      model->use_b = uses_b(s);
      z.train_step(my_rows(whole_batch(s)));
    }
    const std::vector<Tensor> got = gathered_params(z);
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("parameter " << i);
      CHECK(max_abs_diff(got[i], want[i]) <= bound);
    }
  }
}

// Stage 3 holds whole parameters only for the module running (and the one it prefetches), also in the
// middle of a forward: 16 layers of 1 MiB, sharded over the ranks; the forward's peak above the resting
// shards must stay within three layers plus the activations, where gathering the whole model at once
// would add (1 - 1/N) of 16 MiB.
TEST_CASE("zero3: during a forward a rank holds about one module's whole parameters at a time", "[mpi][zero]") {
  constexpr int kLayers = 16;
  constexpr int64_t kWidth = 512, kRows = 4;
  auto model = std::make_shared<nn::Sequential>();
  Generator gen(5);
  for (int l = 0; l < kLayers; ++l) model->push_back(std::make_shared<nn::Linear>(kWidth, kWidth, true, &gen));
  model->set_tensor_names();
  const double layer_bytes = 4.0 * double(kWidth * kWidth + kWidth);
  Zero z = make_zero({{"stage", 3}, {"precision", "fp32"}}, model, json{{"type", "sgd"}, {"lr", 0.01}});
  const Tensor x = randn({kRows, kWidth}, &gen), y = randn({kRows, kWidth}, &gen);
  z.train_step({x, y});  // a first step allocates what steps keep
  const size_t resting = cpu_bytes_in_use();
  reset_cpu_peak_bytes();
  Tensor out = (*z.parts.model)(x);
  const double peak = double(cpu_peak_bytes()) - double(resting);
  // Activations saved for the backward: each layer's input and output rows, float32.
  const double activations = 2.0 * kLayers * kRows * kWidth * 4.0;
  INFO("forward peak above rest " << peak << " B, layer " << layer_bytes << " B, activations " << activations << " B");
  CHECK(peak <= 3 * layer_bytes + activations);
  CHECK(peak >= layer_bytes);  // the gathered module is counted: the check is not vacuous
  z.parts.optimizer->zero_grad();
  z.parts.precision->backward(mse_loss(out, y), *z.parts.optimizer);
  z.parts.precision->step(*z.parts.optimizer);
}
