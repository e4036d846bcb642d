// The precision-plugin SDK: each LossScaler's update rule against sequences written out by hand from
// the documented rules (torch.cuda.amp.GradScaler / _amp_update_scale_; Megatron-LM's and ColossalAI's
// DynamicGradScaler.update), not produced by running the code under test; and PrecisionStrategy's step
// bookkeeping: the found-inf reducer is called exactly once per step, whoever unscales first, and its
// verdict decides the skip.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "booster/mixed_precision/loss_scaler.h"
#include "booster/mixed_precision/precision_strategy.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/data/synthetic.h"

using namespace booster;
using namespace booster::mixed_precision;
using json = nlohmann::json;

// ------------------------------------------------------------------------------------------- scalers

TEST_CASE("ConstantLossScaler: the scale never moves, skipped steps are counted and round-trip", "[amp]") {
  ConstantLossScaler s(1024.0);
  CHECK(s.skips_non_finite());
  for (bool found_inf : {false, true, true, false, true}) {
    s.update(found_inf);
    CHECK(s.scale() == 1024.0);
  }
  CHECK(s.skipped_steps() == 3);
  CHECK(s.state_dict() == json{{"loss_scale", 1024.0}, {"skipped_steps", 3}});
  ConstantLossScaler other(8.0);
  other.load_state_dict(s.state_dict());
  CHECK(other.scale() == 1024.0);
  CHECK(other.skipped_steps() == 3);
  CHECK_THROWS_AS(other.load_state_dict(json::object()), CheckpointError);
  CHECK_FALSE(ConstantLossScaler(128.0, /*skips_non_finite=*/false).skips_non_finite());
}

TEST_CASE("TorchLossScaler: torch's rule (backoff, growth at the interval, finite growth only)", "[amp]") {
  // torch: on inf scale *= backoff_factor and tracker = 0; else tracker += 1 and at growth_interval
  // scale *= growth_factor (kept only if finite) and tracker = 0.
  GradScalerOptions o;
  o.init_scale = 8.0;
  o.growth_interval = 3;
  TorchLossScaler s(o);
  CHECK(s.scale() == 8.0);
  struct Expect {
    bool found_inf;
    double scale;
    int64_t tracker;
  };
  const Expect seq[] = {{false, 8, 1},  {false, 8, 2}, {false, 16, 0}, {true, 8, 0},  {false, 8, 1},
                        {true, 4, 0},   {false, 4, 1}, {false, 4, 2},  {false, 8, 0}, {false, 8, 1},
                        {false, 8, 2},  {false, 16, 0}, {true, 8, 0},  {true, 4, 0},  {true, 2, 0}};
  int step = 0;
  for (const Expect& e : seq) {
    s.update(e.found_inf);
    INFO("step " << step++);
    CHECK(s.scale() == e.scale);
    CHECK(s.growth_tracker() == e.tracker);
  }
  CHECK(s.state_dict() == json{{"scale", 2.0}, {"growth_factor", 2.0}, {"backoff_factor", 0.5},
                               {"growth_interval", 3}, {"_growth_tracker", 0}});

  // The scale is float32, as torch's one-element tensor: 0.1 is float(0.1), and halving it stays float.
  GradScalerOptions tenth;
  tenth.init_scale = 0.1;
  TorchLossScaler t(tenth);
  CHECK(t.scale() == double(0.1f));
  t.update(true);
  CHECK(t.scale() == double(0.1f * 0.5f));

  // Growth that overflows float32 keeps the old scale (torch's isfinite check), and resets the tracker.
  GradScalerOptions big;
  big.init_scale = std::ldexp(1.0, 127);
  big.growth_interval = 1;
  TorchLossScaler b(big);
  b.update(false);
  CHECK(b.scale() == std::ldexp(1.0, 127));
  CHECK(b.growth_tracker() == 0);

  // Factors other than the defaults are the ones used: x3 at each interval, x0.25 on overflow.
  GradScalerOptions odd;
  odd.init_scale = 16.0;
  odd.growth_factor = 3.0;
  odd.backoff_factor = 0.25;
  odd.growth_interval = 2;
  TorchLossScaler f(odd);
  f.update(false);
  f.update(false);
  CHECK(f.scale() == 48.0);
  f.update(true);
  CHECK(f.scale() == 12.0);

  // Defaults are torch's: 2^16, x2, x0.5, 2000.
  TorchLossScaler d;
  CHECK(d.scale() == 65536.0);
  for (int i = 0; i < 1999; ++i) d.update(false);
  CHECK(d.scale() == 65536.0);
  d.update(false);
  CHECK(d.scale() == 131072.0);
}

TEST_CASE("TorchLossScaler: floor, disabled, state round trip", "[amp]") {
  GradScalerOptions o;
  o.init_scale = 4.0;
  TorchLossScaler s(o, /*min_scale=*/2.0);
  s.update(true);  // 4 -> 2: at the floor, allowed
  CHECK(s.scale() == 2.0);
  CHECK_THROWS_AS(s.update(true), TrainingError);  // 2 -> 1: below it

  GradScalerOptions off;
  off.enabled = false;
  TorchLossScaler d(off);
  CHECK(d.scale() == 1.0);
  CHECK_FALSE(d.skips_non_finite());
  d.update(true);
  CHECK(d.scale() == 1.0);
  CHECK(d.state_dict() == json::object());

  TorchLossScaler a(o), b;
  a.update(true);
  a.update(false);
  b.load_state_dict(a.state_dict());
  CHECK(b.scale() == 2.0);
  CHECK(b.growth_tracker() == 1);
  CHECK_THROWS_AS(b.load_state_dict(json{{"scale", 1.0}}), CheckpointError);
}

TEST_CASE("HysteresisLossScaler: Megatron's rule (hysteresis, interval, min and max clamps, floor)", "[amp]") {
  // Megatron: on inf tracker = 0, hysteresis_tracker -= 1, and when it is <= 0
  // scale = max(scale * backoff, min_scale); else tracker += 1 and at growth_interval tracker = 0,
  // hysteresis_tracker = hysteresis, scale = min(scale * growth, max_scale).
  DynamicGradScalerOptions o;
  o.initial_scale = 1024;
  o.min_scale = 256;
  o.max_scale = 2048;
  o.growth_interval = 3;
  o.hysteresis = 2;
  HysteresisLossScaler s(o);
  struct Expect {
    bool found_inf;
    double scale;
    int64_t tracker, hysteresis;
  };
  const Expect seq[] = {
      {true, 1024, 0, 1},   // first overflow: absorbed by hysteresis
      {false, 1024, 1, 1},  // a clean step does not restore it
      {true, 512, 0, 0},    // second overflow: backoff
      {true, 256, 0, -1},   // budget spent: every overflow backs off, down to min_scale
      {false, 256, 1, -1}, {false, 256, 2, -1},
      {false, 512, 0, 2},   // growth restores the budget
      {false, 512, 1, 2},  {false, 512, 2, 2},
      {false, 1024, 0, 2}, {false, 1024, 1, 2}, {false, 1024, 2, 2},
      {false, 2048, 0, 2}, {false, 2048, 1, 2}, {false, 2048, 2, 2},
      {false, 2048, 0, 2},  // clamped at max_scale
  };
  int step = 0;
  for (const Expect& e : seq) {
    s.update(e.found_inf);
    INFO("step " << step++);
    CHECK(s.scale() == e.scale);
    CHECK(s.scaler().growth_tracker() == e.tracker);
    CHECK(s.scaler().hysteresis_tracker() == e.hysteresis);
  }
  CHECK(s.state_dict() == json{{"scale", 2048.0}, {"growth_tracker", 0}, {"hysteresis_tracker", 2}});

  // A backoff landing below min_scale is clamped to it; one due at min_scale throws.
  DynamicGradScalerOptions f;
  f.initial_scale = 384;
  f.min_scale = 256;
  f.hysteresis = 1;
  HysteresisLossScaler floor(f);
  floor.update(true);
  CHECK(floor.scale() == 256);
  CHECK_THROWS_AS(floor.update(true), TrainingError);

  HysteresisLossScaler restored;
  restored.load_state_dict(s.state_dict());
  CHECK(restored.scale() == 2048.0);
  CHECK(restored.scaler().hysteresis_tracker() == 2);
}

// ------------------------------------------------------------------------------------------ strategy

namespace {

// A strategy written against the SDK, as a plugin would: float16 autocast, a static scale; or, with
// masters, a float16 model with float32 master weights.
std::unique_ptr<MixedPrecision> sdk_strategy(bool masters) {
  PrecisionRecipe recipe;
  if (masters) {
    recipe.model_dtype = DType::Float16;
    recipe.master_weights = true;
  } else {
    recipe.autocast_dtype = DType::Float16;
  }
  recipe.scaler = std::make_shared<ConstantLossScaler>(256.0);
  return std::make_unique<PrecisionStrategy>("sdk_test", json::object(), std::move(recipe));
}

std::vector<float> weights(const nn::Module& m) {
  std::vector<float> out;
  for (const Tensor& p : m.parameters())
    for (float v : p.to(DType::Float32).contiguous().to_vector<float>()) out.push_back(v);
  return out;
}

}  // namespace

TEST_CASE("PrecisionStrategy: the found-inf reducer runs exactly once per step and its verdict skips", "[amp]") {
  for (bool masters : {false, true}) {
    for (int extra_calls = 0; extra_calls < 3; ++extra_calls) {
      INFO("masters " << masters << ", unscale/clip calls before step " << extra_calls);
      auto model = std::make_shared<nn::MLPClassifier>(8, std::vector<int64_t>{16}, 3, "relu", 7);
      std::shared_ptr<optim::Optimizer> opt = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}});
      auto mp = sdk_strategy(masters);
      int calls = 0;
      bool force = true;
      // Every local gradient is finite; the "other rank" (the reducer) reports an overflow.
      mp->set_found_inf_reducer([&](bool local) {
        ++calls;
        CHECK_FALSE(local);
        return local || force;
      });
      Configured c = mp->configure(model, opt, [](const Tensor& o, const Tensor& t) { return cross_entropy(o, t); });
      auto data = data::synthetic_classification(32, 8, 3, 4);
      const Tensor x = data->x(), y = data->y();
      auto one_step = [&] {
        c.optimizer->zero_grad();
        mp->backward(c.criterion((*c.model)(x), y), *c.optimizer);
        if (extra_calls >= 1) mp->unscale_gradients(*c.optimizer);
        if (extra_calls >= 2) CHECK(std::isinf(mp->clip_grad_norm(*c.optimizer, 1.0)) == force);  // inf when skipped
        mp->step(*c.optimizer);
      };
      const std::vector<float> before = weights(*model);
      one_step();
      CHECK(calls == 1);
      CHECK(mp->step_was_skipped());
      CHECK(weights(*model) == before);  // untouched
      CHECK(mp->state_dict().meta.at("scaler").at("skipped_steps") == 1);

      force = false;
      one_step();
      CHECK(calls == 2);
      CHECK_FALSE(mp->step_was_skipped());
      CHECK(weights(*model) != before);
      CHECK(mp->last_step_stats().loss_scale == 256.0);
    }
  }
}

TEST_CASE("PrecisionStrategy: a recipe without a scaler never calls the reducer and never skips", "[amp]") {
  for (const json& options : {json{{"pure", false}}, json{{"pure", true}}}) {
    INFO(options.dump());
    auto model = std::make_shared<nn::MLPClassifier>(8, std::vector<int64_t>{16}, 3, "relu", 7);
    std::shared_ptr<optim::Optimizer> opt = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}});
    auto mp = create("bf16", options);
    int calls = 0;
    mp->set_found_inf_reducer([&](bool) { return ++calls, true; });
    Configured c = mp->configure(model, opt, [](const Tensor& o, const Tensor& t) { return cross_entropy(o, t); });
    auto data = data::synthetic_classification(4, 8, 3, 2);
    c.optimizer->zero_grad();
    mp->backward(c.criterion((*c.model)(data->x()), data->y()), *c.optimizer);
    mp->clip_grad_norm(*c.optimizer, 1.0);
    mp->step(*c.optimizer);
    CHECK(calls == 0);
    CHECK_FALSE(mp->step_was_skipped());
  }
}

// ------------------------------------------------------------------------- the README's second recipe

namespace {

// mixed_precision/README.md, "A second recipe": keep the two in step.
std::unique_ptr<MixedPrecision> make_fp16_masters(const nlohmann::json& options) {
  OptionReader reader("fp16_masters", options);
  GradScalerOptions scaler;
  scaler.init_scale = reader.number("init_scale", 65536.0, 0.0, 3.4e38, /*min_exclusive=*/true);
  scaler.growth_interval = reader.integer("growth_interval", 2000, 1, int64_t(1) << 40);

  PrecisionRecipe recipe;
  recipe.model_dtype = DType::Float16;  // the whole model in float16 ...
  recipe.master_weights = true;         // ... stepped through float32 masters
  recipe.scaler = std::make_shared<TorchLossScaler>(scaler);
  return std::make_unique<PrecisionStrategy>(
      reader, nlohmann::json{{"init_scale", scaler.init_scale}, {"growth_interval", scaler.growth_interval}}, recipe);
}

}  // namespace

TEST_CASE("the README's fp16_masters recipe: float16 model, float32 masters, torch's scale", "[amp]") {
  CHECK_THROWS_AS(make_fp16_masters({{"init_scal", 1}}), ConfigError);
  CHECK_THROWS_AS(make_fp16_masters({{"init_scale", 0}}), ConfigError);
  auto mp = make_fp16_masters({{"init_scale", 1024}, {"growth_interval", 2}});
  CHECK(mp->options() == json{{"init_scale", 1024.0}, {"growth_interval", 2}});
  auto model = std::make_shared<nn::MLPClassifier>(8, std::vector<int64_t>{16}, 3, "relu", 7);
  std::shared_ptr<optim::Optimizer> opt = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}});
  Configured c = mp->configure(model, opt, [](const Tensor& o, const Tensor& t) { return cross_entropy(o, t); });
  CHECK(dynamic_cast<MasterWeightOptimizer*>(c.optimizer.get()) != nullptr);
  CHECK(model->parameters().front().dtype() == DType::Float16);
  auto data = data::synthetic_classification(32, 8, 3, 4);
  for (int i = 0; i < 2; ++i) {
    c.optimizer->zero_grad();
    mp->backward(c.criterion((*c.model)(data->x()), data->y()), *c.optimizer);
    mp->step(*c.optimizer);
    CHECK_FALSE(mp->step_was_skipped());
  }
  CHECK(mp->loss_scale() == 2048.0);  // grown after growth_interval = 2 clean steps
  const MixedPrecisionState state = mp->state_dict();
  CHECK(state.meta.at("scaler").at("scale") == 2048.0);
  CHECK(state.tensors.count("master_weights.0.0") == 1);
}
