// The Booster on one process: the boosted loop against the same loop written by hand, optional
// arguments, skipped steps and the scheduler, no_sync, checkpoint IO, plugin loading and the
// compatibility matrix.
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "skip.h"
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <tuple>

#include "booster/booster/booster.h"
#include "booster/booster/compat.h"
#include "booster/booster/single_process.h"
#include "booster/data/synthetic.h"
#include "booster/distributed/local_process_group.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/lr_scheduler.h"
#include "booster/optim/optimizer.h"
#include "booster/plugin/loader.h"
#include "booster/tensor/random.h"
#include "roundoff.h"
#include "trajectory.h"

using namespace booster;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int64_t kIn = 12, kClasses = 3, kBatch = 16;

nn::ModulePtr make_mlp(uint64_t seed = 7) {
  return std::make_shared<nn::MLPClassifier>(kIn, std::vector<int64_t>{24}, kClasses, "relu", seed);
}
std::shared_ptr<optim::Optimizer> make_adamw(const nn::ModulePtr& model, double lr = 1e-2) {
  return std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", lr}});
}
nn::Criterion cross_entropy() {
  return [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
}
std::shared_ptr<data::TensorDataset> dataset() { return data::synthetic_classification(4 * kBatch, kIn, kClasses, 3); }

// Every parameter value, in order, as float64 (for exact and approximate comparisons).
std::vector<double> values(const nn::Module& model) {
  std::vector<double> out;
  for (const Tensor& p : model.parameters()) {
    Tensor f = p.to(DType::Float64).contiguous();
    out.insert(out.end(), f.data<double>(), f.data<double>() + f.numel());
  }
  return out;
}

// The loop of the README, boosted, for `steps` batches (cycling through the loader).
void boosted_steps(Booster& booster, Boosted& b, int steps) {
  int done = 0;
  while (done < steps) {
    for (data::Batch& batch : *b.dataloader) {
      b.optimizer->zero_grad();
      Tensor loss = b.criterion((*b.model)(batch.x), batch.y);
      booster.backward(loss, *b.optimizer);
      b.optimizer->step();
      if (b.scheduler) b.scheduler->step();
      if (++done == steps) return;
    }
  }
}

data::DataLoaderOptions loader_options() {
  data::DataLoaderOptions o;
  o.batch_size = kBatch;
  o.prefetch = 0;
  return o;
}

}  // namespace

TEST_CASE("booster: with no plugin, the boosted fp32 loop equals the hand-written loop bit for bit", "[booster]") {
  auto data = dataset();
  // By hand.
  nn::ModulePtr ref = make_mlp();
  auto ref_opt = make_adamw(ref);
  optim::StepLR ref_sched(*ref_opt, 2, 0.5);
  data::DataLoader ref_loader(data, loader_options());
  for (int epoch = 0; epoch < 2; ++epoch)
    for (data::Batch& batch : ref_loader) {
      ref_opt->zero_grad();
      Tensor loss = cross_entropy((*ref)(batch.x), batch.y);
      loss.backward();
      ref_opt->step();
      ref_sched.step();
    }
  // Boosted.
  Booster booster;
  nn::ModulePtr model = make_mlp();
  auto opt = make_adamw(model);
  auto sched = std::make_shared<optim::StepLR>(*opt, 2, 0.5);
  Boosted b = booster.boost(model, opt, cross_entropy(), std::make_shared<data::DataLoader>(data, loader_options()), sched);
  boosted_steps(booster, b, 8);
  CHECK(values(*b.model) == values(*ref));
  CHECK(b.scheduler->get_last_lr() == ref_sched.get_last_lr());
  CHECK(b.optimizer->lr() == ref_opt->lr());
  CHECK(booster.plugin().name() == "single");
  CHECK(booster.process_group().size() == 1);
}

TEST_CASE("booster: the single plugin loaded from its library trains exactly as no plugin", "[booster][plugin]") {
  auto data = dataset();
  std::vector<double> results[2];
  for (int with_library = 0; with_library < 2; ++with_library) {
    Booster booster(BoosterConfig{.mixed_precision = "fp16", .plugin = with_library ? "single" : ""});
    nn::ModulePtr model = make_mlp();
    Boosted b = booster.boost(model, make_adamw(model), cross_entropy(),
                              booster.prepare_dataloader(data, loader_options()));
    boosted_steps(booster, b, 6);
    results[with_library] = values(*b.model);
  }
  CHECK(results[0] == results[1]);
}

TEST_CASE("booster: every boost() argument but the model is optional, for every strategy", "[booster]") {
  for (const char* precision : {"fp32", "fp16", "bf16", "fp16_naive", "fp16_apex", "no"}) {
    INFO(precision);
    {
      Booster booster(BoosterConfig{.mixed_precision = precision});
      Boosted b = booster.boost(make_mlp());
      REQUIRE(b.model);
      CHECK_FALSE(b.optimizer);
      CHECK_FALSE(b.criterion);
      CHECK_FALSE(b.dataloader);
      CHECK_FALSE(b.scheduler);
      Tensor x = randn({4, kIn});
      Tensor out = (*b.model)(x);  // the (possibly converted) model still runs
      CHECK(out.size(1) == kClasses);
    }
    {
      Booster booster(BoosterConfig{.mixed_precision = precision});
      nn::ModulePtr model = make_mlp();
      Boosted b = booster.boost(model, make_adamw(model));
      REQUIRE(b.optimizer);
      b.optimizer->zero_grad();
      // Without a criterion given to boost() the loss runs outside autocast: compute it in float32, as
      // torch's autocast would (a float16 loss would get a float16 gradient of 65536: inf).
      Tensor logits = (*b.model)(randn({4, kIn})).to(DType::Float32);
      Tensor loss = cross_entropy(logits, from_vector(std::vector<int64_t>{0, 1, 2, 0}, {4}));
      booster.backward(loss, *b.optimizer);
      b.optimizer->step();
      CHECK_FALSE(b.optimizer->step_was_skipped());
    }
  }
  Booster booster;
  CHECK_THROWS_AS(booster.boost(nullptr), ValueError);
}

TEST_CASE("booster: boost() twice on one Booster is refused", "[booster]") {
  Booster booster;
  booster.boost(make_mlp());
  CHECK_THROWS_WITH(booster.boost(make_mlp()), Catch::Contains("one Booster per model"));
}

TEST_CASE("booster: an overflowing step is skipped and the scheduler does not advance", "[booster][amp]") {
  for (const char* precision : {"fp16", "fp16_naive", "fp16_apex"}) {
    INFO(precision);
    Booster booster(BoosterConfig{.mixed_precision = precision});
    nn::ModulePtr model = make_mlp();
    auto opt = make_adamw(model);
    auto sched = std::make_shared<optim::StepLR>(*opt, 1, 0.5);
    Boosted b = booster.boost(model, opt, cross_entropy(), nullptr, sched);
    const std::vector<double> before = values(*b.model);
    const double scale_before = booster.precision().loss_scale();
    b.optimizer->zero_grad();
    Tensor x = randn({4, kIn});
    Tensor y = from_vector(std::vector<int64_t>{0, 1, 2, 0}, {4});
    // A loss times float32's largest value overflows once scaled: every gradient is inf or NaN.
    Tensor loss = mul(b.criterion((*b.model)(x), y), double(std::numeric_limits<float>::max()));
    booster.backward(loss, *b.optimizer);
    b.optimizer->step();
    b.scheduler->step();
    CHECK(b.optimizer->step_was_skipped());
    CHECK(values(*b.model) == before);
    // fp16_naive's DynamicGradScaler backs off only after `hysteresis` (2) overflows.
    if (std::string(precision) == "fp16_naive") CHECK(booster.precision().loss_scale() == scale_before);
    else CHECK(booster.precision().loss_scale() < scale_before);
    CHECK(b.scheduler->get_last_lr().at(0) == Approx(1e-2));  // StepLR(1, 0.5) would have halved it
    // A clean step then steps both.
    b.optimizer->zero_grad();
    booster.backward(b.criterion((*b.model)(x), y), *b.optimizer);
    b.optimizer->step();
    b.scheduler->step();
    CHECK_FALSE(b.optimizer->step_was_skipped());
    CHECK(values(*b.model) != before);
    CHECK(b.scheduler->get_last_lr().at(0) == Approx(5e-3));
  }
}

TEST_CASE("booster: a scheduler on the user's optimizer drives the optimizer that steps (fp16_naive masters)",
          "[booster][amp]") {
  Booster booster(BoosterConfig{.mixed_precision = "fp16_naive"});
  nn::ModulePtr model = make_mlp();
  auto opt = make_adamw(model, 1e-2);
  auto sched = std::make_shared<optim::StepLR>(*opt, 1, 0.1);
  Boosted b = booster.boost(model, opt, cross_entropy(), nullptr, sched);
  REQUIRE(&b.optimizer->stepped_optimizer() != opt.get());  // fp16_naive steps float32 masters
  Tensor x = randn({4, kIn});
  Tensor y = from_vector(std::vector<int64_t>{0, 1, 2, 0}, {4});
  for (int i = 0; i < 3; ++i) {
    b.optimizer->zero_grad();
    booster.backward(b.criterion((*b.model)(x), y), *b.optimizer);
    b.optimizer->step();
    b.scheduler->step();
  }
  CHECK(b.optimizer->lr() == Approx(1e-5));
  b.optimizer->zero_grad();
  booster.backward(b.criterion((*b.model)(x), y), *b.optimizer);
  b.optimizer->step();
  CHECK(b.optimizer->stepped_optimizer().lr() == Approx(1e-5));
}

TEST_CASE("booster: no_sync accumulates gradients, and gradient accumulation equals one large batch", "[booster][roundoff]") {
  auto data = dataset();
  // Reference: one step on 2 * kBatch samples with mean loss.
  nn::ModulePtr ref = make_mlp();
  const std::vector<double> initial = values(*ref);
  auto ref_opt = std::make_shared<optim::SGD>(ref->parameters(), json{{"lr", 0.1}});
  Tensor x = data->x().slice(0, 0, 2 * kBatch), y = data->y().slice(0, 0, 2 * kBatch);
  ref_opt->zero_grad();
  cross_entropy((*ref)(x), y).backward();
  ref_opt->step();

  Booster booster;
  nn::ModulePtr model = make_mlp();
  Boosted b = booster.boost(model, std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}}), cross_entropy());
  b.optimizer->zero_grad();
  {
    auto guard = booster.no_sync();
    Tensor l = mul(b.criterion((*b.model)(x.slice(0, 0, kBatch)), y.slice(0, 0, kBatch)), 0.5);
    booster.backward(l, *b.optimizer);
  }
  Tensor l = mul(b.criterion((*b.model)(x.slice(0, kBatch, 2 * kBatch)), y.slice(0, kBatch, 2 * kBatch)),
                      0.5);
  booster.backward(l, *b.optimizer);
  b.optimizer->step();
  const std::vector<double> got = values(*b.model), want = values(*ref);
  REQUIRE(got.size() == want.size());
  // Two half-batch gradients summed against one whole-batch gradient: one SGD step apart by at most
  // sgd_bound of the step's length (Note [Roundoff bounds], tests/roundoff.h; the MLP's reductions).
  namespace ro = ::testing::roundoff;
  const double bound = ro::sgd_bound(::testing::l2_distance(want, initial),
                                     ro::reduction_bound({2 * ro::mlp_forward_length({kIn, 24}, kClasses, 2 * kBatch),
                                                          2 * kBatch}));
  CHECK(::testing::l2_distance(got, want) <= bound);
}

TEST_CASE("booster: save and load of model, optimizer and scheduler continue the same trajectory", "[booster][checkpoint]") {
  const fs::path dir = fs::temp_directory_path() / ("booster_test_ckpt_" + std::to_string(getpid()));
  fs::remove_all(dir);
  auto data = dataset();
  auto make = [&](Booster& booster) {
    nn::ModulePtr model = make_mlp();
    auto opt = make_adamw(model);
    auto sched = std::make_shared<optim::StepLR>(*opt, 3, 0.5);
    return booster.boost(model, opt, cross_entropy(), std::make_shared<data::DataLoader>(data, loader_options()), sched);
  };
  for (const char* precision : {"fp32", "fp16_naive"}) {
    INFO(precision);
    Booster full_booster(BoosterConfig{.mixed_precision = precision});
    Boosted full = make(full_booster);
    boosted_steps(full_booster, full, 8);

    Booster first(BoosterConfig{.mixed_precision = precision});
    Boosted a = make(first);
    boosted_steps(first, a, 4);
    first.save_model(*a.model, dir / "model");
    first.save_optimizer(*a.optimizer, dir / "optimizer");
    first.save_lr_scheduler(*a.scheduler, dir / "scheduler.json");

    Booster second(BoosterConfig{.mixed_precision = precision});
    Boosted r = make(second);
    second.load_model(*r.model, dir / "model");
    second.load_optimizer(*r.optimizer, dir / "optimizer");
    second.load_lr_scheduler(*r.scheduler, dir / "scheduler.json");
    // The loader has 4 batches per epoch and does not shuffle: `full` saw batches 0-3 twice, so 4 steps
    // from the start of a fresh loader are exactly its second half.
    boosted_steps(second, r, 4);
    CHECK(values(*r.model) == values(*full.model));
    CHECK(r.scheduler->get_last_lr() == full.scheduler->get_last_lr());
    fs::remove_all(dir);
  }
}

TEST_CASE("booster: a checkpoint of another model shape is refused with the key and shapes", "[booster][checkpoint]") {
  const fs::path dir = fs::temp_directory_path() / ("booster_test_shape_" + std::to_string(getpid()));
  Booster booster;
  Boosted a = booster.boost(make_mlp());
  booster.save_model(*a.model, dir);
  Booster other;
  Boosted b = other.boost(std::make_shared<nn::MLPClassifier>(kIn, std::vector<int64_t>{25}, kClasses, "relu", 1));
  CHECK_THROWS_AS(other.load_model(*b.model, dir), Error);
  CHECK_THROWS_WITH(other.load_model(*b.model, dir / "nothing-here"), Catch::Contains("nothing-here"));
  fs::remove_all(dir);
}

// ------------------------------------------------------------------------------------------ config
TEST_CASE("booster: BoosterConfig from JSON takes names or objects and rejects unknown keys", "[booster][config]") {
  BoosterConfig c = BoosterConfig::from_json(json::parse(
      R"({"mixed_precision": {"name": "fp16", "init_scale": 1024}, "plugin": "single", "device": "cpu"})"));
  CHECK(c.mixed_precision == "fp16");
  CHECK(c.mixed_precision_options == json{{"init_scale", 1024}});
  CHECK(c.plugin == "single");
  CHECK(c.plugin_options == json::object());
  CHECK_THROWS_WITH(BoosterConfig::from_json(json{{"mixed_precison", "fp16"}}), Catch::Contains("unknown key 'mixed_precison'"));
  CHECK_THROWS_AS(BoosterConfig::from_json(json{{"plugin", 3}}), ConfigError);
  CHECK_THROWS_AS(Booster(BoosterConfig{.mixed_precision = "fp16", .mixed_precision_options = {{"init_scal", 2}}}),
                  ConfigError);
  CHECK_THROWS_WITH(Booster(BoosterConfig{.plugin = "single", .plugin_options = {{"x", 1}}}),
                    Catch::Contains("takes no options"));
}

// ------------------------------------------------------------------------------------------ plugins
// Note [Optional slots] in booster/plugin/parallel_plugin.h: a plugin that defines only the required
// slots (name, configure, process_group) gets documented defaults, and a Booster runs it.
namespace {
class MinimalPlugin final : public ParallelPlugin {
 public:
  std::string name() const override { return "minimal"; }
  TrainingParts configure(TrainingParts parts) override {
    ++configured;
    return parts;
  }
  distributed::ProcessGroup& process_group() override { return group_; }
  int configured = 0;

 private:
  distributed::LocalProcessGroup group_;
};
}  // namespace

TEST_CASE("booster: a plugin with only the required slots gets the documented defaults", "[booster][plugin]") {
  auto plugin = std::make_shared<MinimalPlugin>();
  CHECK(plugin->version() == "0");
  CHECK(plugin->options() == json::object());
  CHECK(plugin->supported_devices() == std::vector<std::string>{"cpu"});
  CHECK(plugin->supported_precisions() == std::vector<std::string>{"*"});
  CHECK_FALSE(plugin->control_precision());
  CHECK_FALSE(plugin->control_device());
  CHECK_FALSE(plugin->control_checkpoint_io());
  CHECK_FALSE(plugin->support_no_sync());
  CHECK(plugin->layout().data == 1);
  CHECK_NOTHROW(plugin->set_gradient_sync(true));
  CHECK_THROWS_AS(plugin->set_gradient_sync(false), IncompatibleError);
  CHECK(plugin->checkpoint_io() != nullptr);
  CHECK(plugin->prepare_dataloader(dataset(), {.batch_size = kBatch})->num_samples() == 4 * kBatch);
  // Only cpu by default: the one place the combination is checked refuses cuda.
  CHECK_THROWS_AS(BoosterComponents(BoosterConfig{.device = "cuda"}, plugin, mixed_precision::create("fp32")),
                  IncompatibleError);

  Booster booster(BoosterComponents(BoosterConfig{.mixed_precision = "fp16"}, plugin, mixed_precision::create("fp16")));
  nn::ModulePtr model = make_mlp();
  Boosted b = booster.boost(model, make_adamw(model), cross_entropy());
  CHECK(plugin->configured == 1);
  b.optimizer->zero_grad();
  booster.backward(b.criterion((*b.model)(randn({4, kIn})), from_vector(std::vector<int64_t>{0, 1, 2, 0}, {4})),
                   *b.optimizer);
  b.optimizer->step();
  CHECK_FALSE(b.optimizer->step_was_skipped());
  CHECK_THROWS_AS(booster.no_sync(), IncompatibleError);
}

// Note [Gradient accumulation in a loop] (booster.h): the README's loop with booster.accumulate(4) over
// micro-batches of kBatch takes the step one batch of 4 kBatch takes, whether zero_grad() opens the
// body or follows step(); the optimizer and scheduler step once per cycle.
namespace {
// `cycles` optimizer steps of SGD (momentum 0.9) over micro-batches of kBatch, 4 per step, through
// `booster` (fp32, its plugin) and the README's accumulation loop. Returns the final weights.
std::vector<double> accumulated_run(Booster& booster, int cycles, bool zero_grad_first) {
  nn::ModulePtr model = make_mlp();
  auto opt = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}, {"momentum", 0.9}});
  auto sched = std::make_shared<optim::StepLR>(*opt, 1, 0.5);
  Boosted b = booster.boost(model, opt, cross_entropy(), std::make_shared<data::DataLoader>(dataset(), loader_options()),
                            sched);
  int micro = 0;
  while (micro < 4 * cycles)
    for (data::Batch& batch : *b.dataloader) {
      auto micro_step = booster.accumulate(4);
      CHECK(micro_step.micro_step() == micro % 4);
      CHECK(micro_step.sync() == (micro % 4 == 3));
      if (zero_grad_first) b.optimizer->zero_grad();
      booster.backward(b.criterion((*b.model)(batch.x), batch.y), *b.optimizer);
      const double norm = booster.clip_grad_norm(*b.optimizer, 1e9);
      CHECK(std::isnan(norm) == !micro_step.sync());
      b.optimizer->step();
      b.scheduler->step();
      if (!zero_grad_first) b.optimizer->zero_grad();
      CHECK(b.optimizer->steps() == (micro + 1) / 4);
      if (++micro == 4 * cycles) break;
    }
  CHECK(b.scheduler->get_last_lr()[0] == Approx(0.1 * std::pow(0.5, cycles)));
  return values(*b.model);
}
}  // namespace

TEST_CASE("booster: accumulate(n) over n micro-batches steps as one batch of all of them", "[booster][roundoff]") {
  constexpr int kCycles = 2;
  auto data = dataset();  // 4 kBatch samples: one loader epoch is one cycle
  // Reference: kCycles SGD steps on the whole 4 kBatch batch (its mean loss), the lr halved each step.
  nn::ModulePtr ref = make_mlp();
  auto ref_opt = std::make_shared<optim::SGD>(ref->parameters(), json{{"lr", 0.1}, {"momentum", 0.9}});
  optim::StepLR ref_sched(*ref_opt, 1, 0.5);
  std::vector<double> before = values(*ref);
  double path = 0.0;  // sum_t |w_t - w_{t-1}| of the reference (tests/roundoff.h step 3)
  for (int t = 0; t < kCycles; ++t) {
    ref_opt->zero_grad();
    cross_entropy((*ref)(data->x()), data->y()).backward();
    ref_opt->step();
    ref_sched.step();
    const std::vector<double> now = values(*ref);
    path += ::testing::l2_distance(now, before);
    before = now;
  }
  const std::vector<double> want = values(*ref);
  // Note [Roundoff bounds] (tests/roundoff.h): both runs compute a step's gradient through the MLP's
  // forward and backward reductions (twice mlp_forward_length over the 4 kBatch samples); they differ in
  // how the batch sum of the weight gradients is ordered (four partial sums of kBatch, each divided by
  // 4, against one of 4 kBatch: a reduction of 4 kBatch terms either way) and in the division, one
  // rounding. So a gradient differs by reduction_bound of those lengths, and the SGD runs by sgd_bound
  // of the reference's path with momentum 0.9.
  namespace ro = ::testing::roundoff;
  const double bound =
      ro::sgd_bound(path, ro::reduction_bound({2 * ro::mlp_forward_length({kIn, 24}, kClasses, 4 * kBatch), 4 * kBatch, 1}),
                    0.9);
  for (bool zero_grad_first : {true, false}) {
    INFO((zero_grad_first ? "zero_grad() at the top of the body" : "zero_grad() after step()"));
    Booster booster;
    const std::vector<double> got = accumulated_run(booster, kCycles, zero_grad_first);
    CHECK(::testing::l2_distance(got, want) <= bound);
    CHECK(booster.step() == kCycles);
  }
  // A plugin that cannot skip gradient synchronisation accumulates without no_sync, to the same weights.
  {
    auto plugin = std::make_shared<MinimalPlugin>();
    Booster booster(BoosterComponents(BoosterConfig{}, plugin, mixed_precision::create("fp32")));
    CHECK(::testing::l2_distance(accumulated_run(booster, kCycles, true), want) <= bound);
  }
}

TEST_CASE("booster: accumulate() refuses a bad count, nested guards and a count changed mid-cycle", "[booster]") {
  Booster booster;
  nn::ModulePtr model = make_mlp();
  Boosted b = booster.boost(model, make_adamw(model), cross_entropy());
  CHECK_THROWS_AS(booster.accumulate(0), ValueError);
  {
    auto first = booster.accumulate(3);
    CHECK_THROWS_WITH(booster.accumulate(3), Catch::Contains("open already"));
  }
  CHECK_THROWS_WITH(booster.accumulate(2), Catch::Contains("middle of a cycle of 3"));
  { auto second = booster.accumulate(3); }
  { auto third = booster.accumulate(3); CHECK(third.sync()); }
  CHECK_NOTHROW(booster.accumulate(2));  // a new cycle may take another count
  // Outside a guard nothing is gated.
  b.optimizer->zero_grad();
  booster.backward(b.criterion((*b.model)(randn({4, kIn})), from_vector(std::vector<int64_t>{0, 1, 2, 0}, {4})),
                   *b.optimizer);
  b.optimizer->step();
  CHECK(b.optimizer->steps() == 1);
}

TEST_CASE("booster: a missing plugin lists the directories searched, a non-plugin file says so", "[booster][plugin]") {
  try {
    Booster b(BoosterConfig{.plugin = "no_such_plugin"});
    FAIL("no error");
  } catch (const PluginError& e) {
    CHECK_THAT(e.what(), Catch::Contains("libbooster_plugin_no_such_plugin.so"));
    CHECK_THAT(e.what(), Catch::Contains(BOOSTER_LIB_DIR));
  }
  // The core library is a shared library but no plugin.
  CHECK_THROWS_WITH(Booster(BoosterConfig{.plugin = std::string(BOOSTER_LIB_DIR) + "/libbooster_core.so"}),
                    Catch::Contains("not a booster plugin"));
  // A precision plugin is not a parallel plugin.
  CHECK_THROWS_AS(Booster(BoosterConfig{.plugin = std::string(BOOSTER_LIB_DIR) + "/libbooster_precision_static_fp16.so"}),
                  PluginError);
}

TEST_CASE("booster: the single plugin's library unloads when its last object is gone", "[booster][plugin]") {
  const std::string file = plugin::find(plugin::kParallelKind, "single").string();
  auto mapped = [&] {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line))
      if (line.find(file) != std::string::npos) return true;
    return false;
  };
  REQUIRE_FALSE(mapped());
  nn::ModulePtr model;
  {
    Booster booster(BoosterConfig{.plugin = "single"});
    CHECK(mapped());
    model = booster.boost(make_mlp()).model;
  }
  model.reset();
  CHECK_FALSE(mapped());
}

TEST_CASE("booster: plugin load/boost/destroy cycle (run under valgrind by the [valgrind] test)", "[.booster_cycle]") {
  for (int round = 0; round < 2; ++round) {
    Booster booster(BoosterConfig{.mixed_precision = "fp16", .plugin = "single"});
    nn::ModulePtr model = make_mlp();
    Boosted b = booster.boost(model, make_adamw(model), cross_entropy());
    b.optimizer->zero_grad();
    booster.backward(b.criterion((*b.model)(randn({4, kIn})), from_vector(std::vector<int64_t>{0, 1, 2, 0}, {4})), *b.optimizer);
    b.optimizer->step();
    CHECK_THROWS_AS(Booster(BoosterConfig{.plugin = "no_such_plugin"}), PluginError);
  }
}

TEST_CASE("booster: loading and unloading a parallel plugin leaks nothing (valgrind)", "[booster][valgrind]") {
  if (std::system("valgrind --version >/dev/null 2>&1") != 0) {
    skip_test("valgrind is not installed (apt-get install valgrind)");
    return;
  }
  const fs::path self = fs::read_symlink("/proc/self/exe");
  const fs::path log = fs::temp_directory_path() / ("booster_valgrind_" + std::to_string(getpid()) + ".log");
  // Only definite leaks and memory errors count (thread pools keep memory reachable at exit by design).
  const std::string command = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 valgrind --leak-check=full --suppressions=" BOOSTER_SOURCE_DIR "/tests/valgrind.supp "
                              "--errors-for-leak-kinds=definite --error-exitcode=3 --log-file=" +
                              log.string() + " " + self.string() + " '[.booster_cycle]' >" + log.string() +
                              ".out 2>&1";
  const int status = std::system(command.c_str());
  auto slurp = [](const fs::path& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    fs::remove(p);
    return s.str();
  };
  const std::string text = slurp(log), out = slurp(log.string() + ".out");
  INFO(out << text);
  CHECK(out.find("All tests passed") != std::string::npos);  // the hidden cycle really ran
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(text.find("ERROR SUMMARY: 0 errors") != std::string::npos);
}

// ------------------------------------------------------------------------------------ compatibility
namespace {
compat::PluginTraits zero_like() { return {"low_level_zero", {"cpu"}, {"fp32"}, true, {2, 1, 1}}; }
compat::PluginTraits any_plugin(ParallelLayout layout = {}) { return {"hybrid", {"cpu", "cuda"}, {"*"}, false, layout}; }
}  // namespace

TEST_CASE("compat: 16-bit strategies passed to a plugin that controls precision are rejected", "[booster][compat]") {
  for (const char* p : {"fp16", "fp16_apex", "fp16_naive", "bf16"}) {
    INFO(p);
    const compat::Verdict v = compat::check(p, zero_like(), "cpu");
    CHECK_FALSE(v.compatible);
    CHECK_THAT(v.message(p, "low_level_zero", "cpu"),
               Catch::Contains(std::string(p) + " is not compatible with low_level_zero") &&
                   Catch::Contains("manages precision itself") && Catch::Contains("set its precision option"));
    CHECK_THROWS_AS(compat::require_compatible(p, zero_like(), "cpu"), IncompatibleError);
  }
  CHECK(compat::check("fp32", zero_like(), "cpu").compatible);
  CHECK(compat::check("no", zero_like(), "cpu").compatible);
  // A precision plugin is a mixed-precision strategy too.
  CHECK_FALSE(compat::check("static_fp16", zero_like(), "cpu").compatible);
}

TEST_CASE("compat: devices and precisions a plugin does not list", "[booster][compat]") {
  compat::Verdict v = compat::check("fp32", zero_like(), "cuda:0");
  CHECK_FALSE(v.compatible);
  CHECK_THAT(v.message("fp32", "low_level_zero", "cuda:0"), Catch::Contains("runs on cpu only"));
  compat::PluginTraits only_bf16{"p", {"cpu"}, {"fp32", "bf16"}, false, {}};
  CHECK(compat::check("bf16", only_bf16, "cpu").compatible);
  CHECK_THAT(compat::check("fp16", only_bf16, "cpu").reason, Catch::Contains("supports fp32, bf16"));
  // Through the Booster: single takes every device it lists and rejects others before any work.
  CHECK_THROWS_WITH(Booster(BoosterConfig{.device = "tpu"}), Catch::Contains("runs on cpu, cuda only"));
}

TEST_CASE("compat: apex-style with tensor parallel, and whole-model state with pipeline parallel", "[booster][compat]") {
  const compat::PluginTraits tp = any_plugin({1, 2, 1}), pp = any_plugin({1, 1, 2});
  CHECK_FALSE(compat::check("fp16_apex", tp, "cpu").compatible);
  CHECK_THAT(compat::check("fp16_apex", tp, "cpu").reason, Catch::Contains("tensor parallelism") && Catch::Contains("apex"));
  // A precision plugin's reason is its own: it declares no tensor-parallel support.
  const compat::Verdict plugin_tp = compat::check("static_fp16", tp, "cpu");
  CHECK_FALSE(plugin_tp.compatible);
  CHECK_THAT(plugin_tp.reason, Catch::Contains("precision plugin declares no support"));
  CHECK_THAT(plugin_tp.reason, !Catch::Contains("apex"));
  for (const char* ok : {"fp32", "fp16", "bf16", "fp16_naive"}) {
    INFO(ok);
    CHECK(compat::check(ok, tp, "cpu").compatible);
    CHECK(compat::check(ok, pp, "cpu").compatible);
  }
  for (const char* bad : {"fp16_apex", "some_precision_plugin"}) {
    INFO(bad);
    CHECK_FALSE(compat::check(bad, pp, "cpu").compatible);
    CHECK_THAT(compat::check(bad, pp, "cpu").reason, Catch::Contains("pipeline parallelism"));
    CHECK_THAT(compat::check(bad, pp, "cpu").instead, Catch::Contains("fp16_naive"));
  }
}

TEST_CASE("compat: fp8 runs single and data parallel, and with ZeRO, tp or pp it says what to use", "[booster][compat]") {
  CHECK(compat::check("fp8", compat::PluginTraits::of(SingleProcessPlugin()), "cpu").compatible);
  CHECK(compat::check("fp8", {"ddp", {"cpu", "cuda"}, {"*"}, false, {2, 1, 1}}, "cpu").compatible);
  const compat::Verdict zero = compat::check("fp8", zero_like(), "cpu");
  CHECK_FALSE(zero.compatible);
  CHECK_THAT(zero.message("fp8", "low_level_zero", "cpu"),
             Catch::Contains("manages precision itself") && Catch::Contains("\"precision\": \"bf16\""));
  const compat::Verdict tp = compat::check("fp8", any_plugin({1, 2, 1}), "cpu");
  CHECK_FALSE(tp.compatible);
  CHECK_THAT(tp.reason, Catch::Contains("amax of every shard"));
  CHECK(tp.instead == "use bf16");
  const compat::Verdict pp = compat::check("fp8", any_plugin({1, 1, 2}), "cpu");
  CHECK_FALSE(pp.compatible);
  CHECK_THAT(pp.instead, Catch::Contains("fp16_naive"));
}

TEST_CASE("compat: the matrix table has a row per strategy, a column per plugin plus tp and pp", "[booster][compat]") {
  const compat::Matrix m = compat::build_matrix({"fp32", "fp16", "fp16_apex"}, {compat::PluginTraits::of(SingleProcessPlugin()), zero_like()});
  REQUIRE(m.columns == std::vector<std::string>{"single", "low_level_zero", "tensor parallel", "pipeline parallel"});
  CHECK(m.cells[0][1].compatible);         // fp32 x zero
  CHECK_FALSE(m.cells[1][1].compatible);   // fp16 x zero
  CHECK_FALSE(m.cells[2][2].compatible);   // apex x tp
  CHECK(m.cells[1][2].compatible);         // fp16 x tp
  const std::string table = compat::format_matrix(m);
  CHECK_THAT(table, Catch::Contains("fp16_apex") && Catch::Contains("no (") && Catch::Contains("(1) "));
}

// ---------------------------------------------------------------------------------------- the CLI
namespace {
// Runs the booster program; returns (exit code, stdout + stderr).
std::pair<int, std::string> run_booster(const std::string& args) {
  const fs::path out = fs::temp_directory_path() / ("booster_cli_" + std::to_string(getpid()) + ".txt");
  const int status = std::system((std::string(BOOSTER_BIN_DIR) + "/booster " + args + " >" + out.string() + " 2>&1").c_str());
  std::ifstream in(out);
  std::stringstream s;
  s << in.rdbuf();
  fs::remove(out);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, s.str()};
}
}  // namespace

TEST_CASE("booster plugins and booster compat print the plugins and the matrix", "[booster][cli]") {
  auto [code, text] = run_booster("plugins");
  CHECK(code == 0);
  CHECK_THAT(text, Catch::Contains("single 1.0") && Catch::Contains("libbooster_plugin_single.so") &&
                       Catch::Contains("devices: cpu, cuda"));
  std::tie(code, text) = run_booster("compat");
  CHECK(code == 0);
  CHECK_THAT(text, Catch::Contains("precision") && Catch::Contains("single") && Catch::Contains("tensor parallel") &&
                       Catch::Contains("fp16_apex") && Catch::Contains("not usable with tensor parallelism"));
  std::tie(code, text) = run_booster("compat --device");
  CHECK(code == 2);
}
