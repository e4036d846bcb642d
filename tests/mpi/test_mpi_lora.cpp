// LoRA (Booster::enable_lora) under `mpirun -np 2`: ddp and low_level_zero stages 1, 2 and 3, each rank
// training on half of the batch, against one process on the whole batch with the same strategy: each
// step's loss and the adapters at the end within the bounds of Note [Roundoff bounds] (tests/roundoff.h;
// float32, and bfloat16's unit where the strategy computes in bfloat16); the frozen base is the same
// bytes at the end on every rank; and the strategy keeps nothing for it: no gradient, no optimizer state
// (ZeRO partitions the adapters only and its gathered state names them alone).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <map>
#include <string>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/llama.h"
#include "booster/nn/lora.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "roundoff.h"
#include "trajectory.h"
#include "llama_fixture.h"

using namespace booster;
using namespace booster::distributed;
using nlohmann::json;

namespace {

ProcessGroup& group() { return init_process_group("mpi"); }
namespace ro = ::testing::roundoff;

const nn::LoraConfig kLora{.r = 4, .alpha = 8, .target_modules = {"q_proj", "v_proj", "down_proj"}};
const json kSgd = {{"type", "sgd"}, {"lr", 0.5}, {"momentum", 0.9}};
constexpr double kMomentum = 0.9;
constexpr int64_t kBatch = 4, kT = 8;  // the whole batch; each rank takes 2 rows

// Note [Roundoff bounds]: the tiny Llama's reductions on the batch, in the unit the strategy computes in.
double forward_bound(double unit) {
  return ro::reduction_bound({ro::llama_forward_length(32, 2, 4, 48, kT, 64, kBatch)}) / ro::kUnit * unit;
}
double gradient_bound(double unit) {
  const double forward = ro::llama_forward_length(32, 2, 4, 48, kT, 64, kBatch);
  return ro::reduction_bound({2 * forward, double(kBatch * kT)}) / ro::kUnit * unit;
}

Tensor loss_of(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

struct Run {
  std::vector<double> losses;                  // each step's loss on the whole batch
  std::vector<double> bounds;                  // the reference's: how far another order may move it
  std::map<std::string, Tensor> adapters;      // float32, at the end
  double path = 0;                             // the reference's: sum over steps of |w_t - w_{t-1}|
};

// How a step sees the batch: whole in one process (the reference, which measures its bounds in `unit`),
// as two halves accumulated in one process (the reference's summation order changed), or this rank's half.
enum class Rows { Whole, Halves, Rank };

// Six SGD steps of the LoRA Llama under `config`.
Run train(const BoosterConfig& config, Rows mode, double unit = ro::kUnit) {
  const bool whole = mode == Rows::Whole;
  ProcessGroup& pg = group();
  Generator data(12);
  Booster booster(config);
  auto model = std::make_shared<nn::Llama>(booster::testing::tiny_llama_config(), 13);
  booster.enable_lora(model, kLora);
  std::map<std::string, Tensor> base_before;
  for (const auto& [n, p] : model->named_parameters())
    if (!p.requires_grad()) base_before[n] = p.detach().clone();
  Boosted b = booster.boost(model, optim::make_optimizer(kSgd, nn::trainable_parameters(*model)), loss_of);
  Run run;
  for (int s = 0; s < 6; ++s) {
    const Tensor x = randint(0, 64, {kBatch, kT}, &data), y = randint(0, 64, {kBatch, kT}, &data);
    const int64_t rows = whole ? kBatch : kBatch / 2, first = mode == Rows::Rank ? rows * pg.rank() : 0;
    const ::testing::Weights before = whole ? ::testing::flat_weights(b.model->state_dict()) : ::testing::Weights();
    if (mode == Rows::Halves) {
      double mean = 0;
      for (int64_t half = 0; half < 2; ++half) {
        auto micro_step = booster.accumulate(2);
        b.optimizer->zero_grad();
        const Tensor loss = b.criterion((*b.model)(x.narrow(0, half * rows, rows)), y.narrow(0, half * rows, rows));
        booster.backward(loss, *b.optimizer);
        b.optimizer->step();
        mean += loss.item() / 2;
      }
      run.losses.push_back(mean);
      continue;
    }
    b.optimizer->zero_grad();
    const Tensor loss = b.criterion((*b.model)(x.narrow(0, first, rows)), y.narrow(0, first, rows));
    booster.backward(loss, *b.optimizer);
    // The frozen base gets no gradient under any plugin or strategy.
    for (const auto& [n, p] : model->named_parameters())
      if (!p.requires_grad()) CHECK_FALSE(p.grad().defined());
    if (whole) {
      double g2 = 0;
      for (const Tensor& p : nn::trainable_parameters(*model))
        for (double g : p.grad().to(DType::Float32).tolist()) g2 += g * g;
      run.bounds.push_back(forward_bound(unit) * std::abs(loss.item()) +
                           std::sqrt(g2) * ro::sgd_bound(run.path, gradient_bound(unit), kMomentum));
    }
    b.optimizer->step();
    if (whole) {
      run.path += ::testing::l2_distance(::testing::flat_weights(b.model->state_dict()), before);
      run.losses.push_back(loss.item());
    } else {
      Tensor mean = full({1}, loss.item() / 2, DType::Float64);  // the ranks' halves: the batch's mean
      pg.all_reduce(mean);
      run.losses.push_back(mean.item());
    }
  }
  // What the strategy holds: state for the adapters only (a sharded optimizer gathers it).
  const optim::OptimizerState state = b.optimizer->stepped_optimizer().state_dict();
  const size_t adapters = nn::trainable_parameters(*model).size();
  for (const auto& [key, t] : state.tensors) {
    size_t i = 0;
    std::string name;
    REQUIRE(optim::parse_state_key(key, i, name));
    CHECK(i < adapters);
  }
  booster.plugin().with_full_parameters([&] {
    for (const auto& [n, p] : model->named_parameters()) {
      if (p.requires_grad()) {
        run.adapters[n] = p.detach().to(DType::Float32).clone();
      } else {
        INFO(n);
        // The base is untouched: under a 16-bit model it is the rounding of what it was given.
        REQUIRE(base_before.count(n));
        CHECK(same_bytes(p.detach(), base_before.at(n).to(p.dtype())));
      }
    }
  });
  return run;
}

double adapter_distance(const Run& got, const Run& want) {
  ::testing::Weights a, b;
  REQUIRE(got.adapters.size() == want.adapters.size());
  for (const auto& [n, t] : want.adapters) {
    REQUIRE(got.adapters.count(n));
    for (double v : t.tolist()) b.push_back(v);
    for (double v : got.adapters.at(n).tolist()) a.push_back(v);
  }
  return ::testing::l2_distance(a, b);
}

// float32: the bounds of Note [Roundoff bounds] along the reference's path.
void check_equal_within_bounds(const Run& got, const Run& want) {
  for (size_t s = 0; s < want.losses.size(); ++s) {
    INFO("step " << s << ": " << got.losses[s] << " against " << want.losses[s] << ", bound " << want.bounds[s]);
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= want.bounds[s]);
  }
  const double distance = adapter_distance(got, want), bound = ro::sgd_bound(want.path, gradient_bound(ro::kUnit), kMomentum);
  INFO("adapters " << distance << " apart, bound " << bound << " (path " << want.path << ")");
  CHECK(distance <= bound);
}

// bfloat16: a sum order changed by float32 roundoff flips bfloat16 roundings downstream, which the
// worst-case bound of step 5 covers only vacuously (its bound exceeds the path). The tight check is the
// one the guide names: against the noise of the same run with only its summation order changed (the
// reference on two accumulated halves, the order a 2-rank sum has), kLambda times it.
void check_within_order_noise(const Run& got, const Run& want, const Run& reordered) {
  for (size_t s = 0; s < want.losses.size(); ++s) {
    const double noise = std::max(std::abs(reordered.losses[s] - want.losses[s]), want.bounds[s] / ro::kUnitBFloat16 * ro::kUnit);
    INFO("step " << s << ": " << got.losses[s] << " against " << want.losses[s] << ", order noise " << noise);
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= ro::kLambda * noise);
  }
  const double noise = adapter_distance(reordered, want), distance = adapter_distance(got, want);
  INFO("adapters " << distance << " apart; the reordered reference " << noise << " apart");
  CHECK(noise > 0);
  CHECK(distance <= ro::kLambda * noise);
}

BoosterConfig zero(int stage, const std::string& precision) {
  return BoosterConfig{.plugin = "low_level_zero", .plugin_options = {{"stage", stage}, {"precision", precision}}};
}

}  // namespace

TEST_CASE("lora: ddp and ZeRO 1, 2, 3 in float32 train the adapters as one process does", "[mpi][lora][roundoff]") {
  REQUIRE(group().size() == 2);
  const Run reference = train(BoosterConfig{}, Rows::Whole);
  for (const auto& [label, config] : std::vector<std::pair<std::string, BoosterConfig>>{
           {"ddp", BoosterConfig{.plugin = "ddp"}}, {"zero 1", zero(1, "fp32")}, {"zero 2", zero(2, "fp32")},
           {"zero 3", zero(3, "fp32")}}) {
    INFO(label);
    check_equal_within_bounds(train(config, Rows::Rank), reference);
  }
}

TEST_CASE("lora: ddp under bf16 autocast and ZeRO 3 in bf16 train as one process in bf16 does",
          "[mpi][lora][roundoff][amp]") {
  REQUIRE(group().size() == 2);
  const BoosterConfig autocast{.mixed_precision = "bf16"};
  check_within_order_noise(train(BoosterConfig{.mixed_precision = "bf16", .plugin = "ddp"}, Rows::Rank),
                           train(autocast, Rows::Whole, ro::kUnitBFloat16), train(autocast, Rows::Halves));
  // ZeRO's bf16 is a bfloat16 model with float32 masters of the adapters: pure bf16 in one process.
  const BoosterConfig pure{.mixed_precision = "bf16", .mixed_precision_options = {{"pure", true}}};
  check_within_order_noise(train(zero(3, "bf16"), Rows::Rank), train(pure, Rows::Whole, ro::kUnitBFloat16),
                           train(pure, Rows::Halves));
}
