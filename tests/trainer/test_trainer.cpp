// The training loop as a library: Booster::save_state/load_state in a hand-written loop, and the
// Trainer, over a user's own nn::Module and data set. The reference for "resumes exactly" is the same
// program run without interruption: every parameter, optimizer state and registered value must be equal
// bit for bit.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/data/data.h"
#include "booster/nn/nn.h"
#include "booster/ops/ops.h"
#include "booster/optim/lr_scheduler.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"
#include "booster/trainer/signals.h"
#include "booster/trainer/trainer.h"

using namespace booster;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("booster_test_trainer_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A user's model: no built-in has it. A residual block with its own dropout generator, so a resume must
// restore that generator too (Module::own_generators).
class NoisyResidual : public nn::Module {
 public:
  explicit NoisyResidual(uint64_t seed) : gen_(std::make_shared<Generator>(seed + 1)) {
    Generator init(seed);
    up_ = register_module("up", std::make_shared<nn::Linear>(6, 12));
    down_ = register_module("down", std::make_shared<nn::Linear>(12, 6));
    head_ = register_module("head", std::make_shared<nn::Linear>(6, 3));
    drop_ = register_module("drop", std::make_shared<nn::Dropout>(0.2, gen_));
  }
  Tensor forward(const Tensor& x) override { return (*head_)(x + (*drop_)((*down_)(relu((*up_)(x))))); }
  std::string name() const override { return "NoisyResidual"; }

 private:
  std::shared_ptr<Generator> gen_;
  std::shared_ptr<nn::Linear> up_, down_, head_;
  std::shared_ptr<nn::Dropout> drop_;
};

// 96 points of 6 features in 3 classes, the same for every call.
data::DatasetPtr points(int64_t n = 96) {
  Generator gen(11);
  std::vector<float> x(static_cast<size_t>(n * 6)), y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    y[size_t(i)] = float(i % 3);
    for (int64_t j = 0; j < 6; ++j) x[size_t(i * 6 + j)] = float(gen.normal() + (j == i % 3 ? 2.0 : 0.0));
  }
  return std::make_shared<data::TensorDataset>(from_vector(x, {n, 6}), from_vector(y, {n}).to(DType::Int64));
}

// Everything a run ends with, as bytes: parameters, the stepped optimizer's state, the scheduler.
std::string end_state(Booster& booster) {
  std::string out;
  for (const auto& [name, t] : booster.boosted().model->state_dict()) {
    const Tensor c = t.cpu().contiguous();
    out += name;
    out.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }
  const optim::OptimizerState state = booster.boosted().optimizer->state_dict();
  for (const auto& [name, t] : state.tensors) {
    const Tensor c = t.cpu().contiguous();
    out += name;
    out.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }
  if (booster.boosted().scheduler) out += booster.boosted().scheduler->state_dict().dump();
  return out;
}

struct Run {
  std::unique_ptr<Booster> booster;
  double ema = 0.0;                 // registered JSON state
  nn::StateDict running;            // registered tensors
  Generator augment{5};             // a registered generator the loop draws from
};

// A Booster over a fresh NoisyResidual, AdamW, a cosine schedule and a shuffled loader.
void setup(Run& run, const std::string& precision) {
  manual_seed(3);
  run.booster = std::make_unique<Booster>(BoosterConfig{.mixed_precision = precision});
  auto model = std::make_shared<NoisyResidual>(7);
  auto adamw = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", 0.01}});
  auto cosine = std::make_shared<optim::CosineAnnealingLR>(*adamw, 20);
  auto loader = run.booster->prepare_dataloader(points(), {.batch_size = 16, .shuffle = true, .seed = 9});
  nn::Criterion ce = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
  run.booster->boost(model, adamw, ce, loader, cosine);
  run.ema = 0.0;
  run.running = {{"sum", zeros({3})}};
  run.booster->register_state("ema", [&run] { return json(run.ema); }, [&run](const json& j) { run.ema = j.get<double>(); });
  run.booster->register_tensors(
      "running", [&run] { return run.running; }, [&run](const nn::StateDict& t) { run.running = t; });
  run.booster->register_generator("augment", run.augment);
}

// The hand-written loop: `steps` optimizer steps from wherever the loader and the booster are.
void train_steps(Run& run, int64_t steps) {
  Booster& booster = *run.booster;
  const Boosted& p = booster.boosted();
  while (steps > 0) {
    for (data::Batch& batch : *p.dataloader) {
      p.optimizer->zero_grad();
      const Tensor x = add(batch.x, mul(randn(batch.x.shape(), &run.augment), 0.01));
      Tensor loss = p.criterion((*p.model)(x), batch.y);
      booster.backward(loss, *p.optimizer);
      p.optimizer->step();
      p.scheduler->step();
      run.ema = 0.9 * run.ema + 0.1 * loss.item();
      run.running["sum"] = add(run.running["sum"], full({3}, loss.item()));
      if (--steps == 0) break;
    }
  }
}

}  // namespace

TEST_CASE("save_state/load_state in a hand-written loop resume bit for bit", "[trainer][checkpoint]") {
  for (const std::string precision : {"fp32", "fp16", "bf16", "fp16_naive"}) {
    INFO(precision);
    const fs::path root = scratch("loop_" + precision);
    Run whole;
    setup(whole, precision);
    train_steps(whole, 20);

    Run first;
    setup(first, precision);
    train_steps(first, 9);  // inside the second epoch (6 batches each)
    const fs::path saved = first.booster->save_state(root, {.keep_last = 2});
    CHECK(saved == root / "step-00000009");
    CHECK(checkpoint::read_text_file(root / "latest") == "step-00000009\n");
    // The process goes away; a fresh one resumes from the root's latest.
    first.booster.reset();

    Run second;
    setup(second, precision);
    const LoadedState loaded = second.booster->load_state(root);
    CHECK(loaded.step == 9);
    CHECK(second.booster->step() == 9);
    CHECK(second.ema == first.ema);
    train_steps(second, 11);
    CHECK(second.booster->step() == 20);
    CHECK(end_state(*second.booster) == end_state(*whole.booster));
    CHECK(second.ema == whole.ema);
    CHECK(second.running.at("sum").tolist() == whole.running.at("sum").tolist());
    CHECK(second.augment.state() == whole.augment.state());
  }
}

TEST_CASE("load_state refuses another strategy, changed settings and missing registered state", "[trainer][checkpoint]") {
  const fs::path root = scratch("refuse");
  Run a;
  setup(a, "fp16");
  a.booster->set_resume_settings({{"batch_size", 16}, {"optimizer", {{"lr", 0.01}, {"betas", {0.9, 0.999}}}}});
  train_steps(a, 3);
  a.booster->save_state(root);
  a.booster.reset();

  Run other_strategy;
  setup(other_strategy, "bf16");
  CHECK_THROWS_WITH(other_strategy.booster->load_state(root),
                    Catch::Contains("was saved with mixed_precision \"fp16\" but this run has \"bf16\""));

  Run changed;
  setup(changed, "fp16");
  changed.booster->set_resume_settings({{"batch_size", 16}, {"optimizer", {{"lr", 0.02}, {"betas", {0.9, 0.999}}}}});
  CHECK_THROWS_AS(changed.booster->load_state(root), CheckpointError);
  CHECK_THROWS_WITH(changed.booster->load_state(root),
                    Catch::Contains("was saved with optimizer.lr 0.01 but this run has 0.02; a resume continues the "
                                    "saved run"));
  // Nothing was restored by the refused loads.
  CHECK(changed.booster->step() == 0);

  // A setting the checkpoint predates is reported, not refused.
  Run newer;
  setup(newer, "fp16");
  newer.booster->set_resume_settings(
      {{"batch_size", 16}, {"optimizer", {{"lr", 0.01}, {"betas", {0.9, 0.999}}, {"amsgrad", false}}}, {"seed", 1}});
  const LoadedState loaded = newer.booster->load_state(root);
  CHECK(loaded.unchecked == std::vector<std::string>{"optimizer.amsgrad", "seed"});

  Run missing;
  setup(missing, "fp16");
  missing.booster->register_state("teacher", [] { return json(1); }, [](const json&) {});
  CHECK_THROWS_WITH(missing.booster->load_state(root), Catch::Contains("has no registered state 'teacher'"));

  CHECK_THROWS_WITH(missing.booster->load_state(root / "step-00000042"), Catch::Contains("does not exist"));
  CHECK_THROWS_WITH(missing.booster->register_state("ema", [] { return json(); }, [](const json&) {}),
                    Catch::Contains("registered already"));
}

TEST_CASE("save_state commits atomically, keeps keep_last and holds the root's lock", "[trainer][checkpoint]") {
  const fs::path root = scratch("keep");
  Run a;
  setup(a, "fp32");
  for (int i = 0; i < 4; ++i) {
    train_steps(a, 2);
    a.booster->save_state(root, {.keep_last = 2});
  }
  // The same root spelled another way is the same lock, not a second program.
  CHECK_NOTHROW(a.booster->save_state(root.string() + "/", {.keep_last = 2, .step = 8}));
  const auto kept = checkpoint::list_checkpoints(root);
  REQUIRE(kept.size() == 2);
  CHECK(kept[0].first == 6);
  CHECK(kept[1].first == 8);
  // A second program saving into the same root is refused while this one holds it.
  CHECK_THROWS_WITH(checkpoint::RootLock(root), Catch::Contains("in use by another process"));
  a.booster.reset();
  CHECK_NOTHROW(checkpoint::RootLock(root));
}

namespace {

TrainerOptions trainer_options(const fs::path& dir) {
  TrainerOptions o;
  o.epochs = 4;  // 6 steps per epoch
  o.log_every = 2;
  o.eval_every = 5;
  o.checkpoint_every = 7;
  o.keep_last = 0;
  o.run_dir = dir / "run";
  o.checkpoint_dir = dir / "checkpoints";
  o.progress = trainer::Progress::Mode::Silent;
  o.max_grad_norm = 1.0;
  return o;
}

std::vector<json> metrics(const fs::path& run_dir) {
  std::vector<json> out;
  std::ifstream in(run_dir / trainer::kMetricsFileName);
  for (std::string line; std::getline(in, line);) {
    json r = json::parse(line);
    r.erase("time");
    r.erase("samples_per_second");
    // Peak memory counts from each process's fit(): a resumed one starts from what loading left live.
    for (const char* key : {"peak_tensor_bytes", "peak_reserved_bytes"}) r.erase(key);
    out.push_back(r);
  }
  return out;
}

}  // namespace

TEST_CASE("Trainer: a user's model trains with metrics, checkpoints and hooks", "[trainer]") {
  const fs::path dir = scratch("fit");
  Run run;
  setup(run, "bf16");
  Trainer trainer(*run.booster, trainer_options(dir));
  trainer.set_eval_data(points(30));
  std::vector<int64_t> steps_seen;
  int evaluations = 0;
  trainer.on_step([&](const trainer::StepReport& r) { steps_seen.push_back(r.step); });
  trainer.on_evaluation([&](int64_t, const trainer::Evaluation& e) {
    ++evaluations;
    CHECK(e.samples == 30);
  });
  const FitResult result = trainer.fit();
  CHECK(result.steps == 24);
  CHECK(trainer.total_steps() == 24);
  CHECK(steps_seen.size() == 24);
  CHECK(steps_seen.back() == 24);
  // every 5 steps (5, 10, 15, 20) and at the end
  CHECK(evaluations == 5);
  REQUIRE(result.evaluation.has_value());
  CHECK(result.evaluation->accuracy > 0.6);
  const std::vector<json> records = metrics(dir / "run");
  CHECK(std::count_if(records.begin(), records.end(), [](const json& r) { return r["kind"] == "train"; }) == 12);
  std::vector<int64_t> saved;
  for (const auto& [step, path] : checkpoint::list_checkpoints(dir / "checkpoints")) saved.push_back(step);
  CHECK(saved == std::vector<int64_t>{7, 14, 21, 24});
  CHECK(fs::exists(dir / "run" / "metrics.jsonl"));
}

TEST_CASE("Trainer: a fit() that failed between micro-batches leaves the next fit() a fresh cycle", "[trainer]") {
  // grad_accumulation 2: the third criterion call is the first micro-batch of step 2. It throws once;
  // the Booster is then in mid cycle, which the next fit() abandons instead of refusing.
  manual_seed(3);
  Booster booster(BoosterConfig{});
  auto model = std::make_shared<NoisyResidual>(7);
  auto adamw = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", 0.01}});
  auto loader = booster.prepare_dataloader(points(), {.batch_size = 16, .shuffle = true, .seed = 9});
  int calls = 0;
  nn::Criterion ce = [&calls](const Tensor& out, const Tensor& y) {
    if (++calls == 3) throw DataError("a bad micro-batch");
    return cross_entropy(out, y);
  };
  booster.boost(model, adamw, ce, loader, nullptr);
  TrainerOptions o;
  o.epochs = 1;
  o.grad_accumulation = 2;
  o.progress = trainer::Progress::Mode::Silent;
  Trainer trainer(booster, o);
  // A cycle that a loop outside fit() left open is refused, naming that loop.
  {
    const Booster::Accumulate outside = booster.accumulate(2);
  }
  CHECK_THROWS_WITH(trainer.fit(), Catch::Contains("a loop outside fit()"));
  CHECK_THROWS_AS(
      [&] {
        const Booster::Accumulate open = booster.accumulate(2);
        booster.abandon_accumulation();
      }(),
      StateError);
  booster.abandon_accumulation();
  CHECK(calls == 0);
  CHECK_THROWS_WITH(trainer.fit(), Catch::Contains("a bad micro-batch"));
  CHECK(booster.accumulation().micro == 1);
  CHECK(booster.step() == 1);
  const FitResult again = trainer.fit();
  CHECK(again.steps == 3);  // 6 micro-batches an epoch: 3 steps
  CHECK(booster.accumulation().micro == 0);
}

TEST_CASE("Trainer: stopped by SIGTERM mid-run, resumed from latest, ends with the same bytes", "[trainer][signal]") {
  const fs::path whole_dir = scratch("whole"), parts_dir = scratch("parts");
  struct sigaction before {};
  sigaction(SIGTERM, nullptr, &before);
  Run whole;
  setup(whole, "fp16");
  Trainer whole_trainer(*whole.booster, trainer_options(whole_dir));
  whole_trainer.set_eval_data(points(30));
  const FitResult whole_result = whole_trainer.fit();

  {
    Run first;
    setup(first, "fp16");
    Trainer trainer(*first.booster, trainer_options(parts_dir));
    trainer.set_eval_data(points(30));
    // The preemption arrives during step 10, as a cluster's SIGTERM would.
    trainer.on_step([](const trainer::StepReport& r) {
      if (r.step == 10) std::raise(SIGTERM);
    });
    try {
      trainer.fit();
      FAIL("fit() should have stopped");
    } catch (const InterruptedError& e) {
      CHECK(e.signal() == SIGTERM);
      CHECK(e.exit_code() == 143);
      CHECK_THAT(e.what(), Catch::Contains("stopped by SIGTERM after step 10 of 24; saved " +
                                           (parts_dir / "checkpoints" / "step-00000010").string()));
    }
  }
  // The handlers are put back once fit() is over.
  struct sigaction now {};
  sigaction(SIGTERM, nullptr, &now);
  CHECK(now.sa_handler == before.sa_handler);

  Run second;
  setup(second, "fp16");
  TrainerOptions options = trainer_options(parts_dir);
  options.resume = "latest";
  Trainer trainer(*second.booster, options);
  trainer.set_eval_data(points(30));
  const FitResult result = trainer.fit();
  REQUIRE(result.resumed_from.has_value());
  CHECK(*result.resumed_from == parts_dir / "checkpoints" / "step-00000010");
  CHECK(result.steps == 24);
  CHECK(end_state(*second.booster) == end_state(*whole.booster));
  CHECK(result.final_loss == whole_result.final_loss);
  CHECK(result.evaluation->loss == whole_result.evaluation->loss);
  // The metrics file reads as if the run had never stopped.
  CHECK(metrics(parts_dir / "run") == metrics(whole_dir / "run"));
}

TEST_CASE("Trainer: a signal during the last step says the run is complete, not how to resume it", "[trainer][signal]") {
  const fs::path dir = scratch("last_step_signal");
  Run run;
  setup(run, "fp32");
  Trainer trainer(*run.booster, trainer_options(dir));
  trainer.on_step([](const trainer::StepReport& r) {
    if (r.step == 24) std::raise(SIGTERM);  // the run's last step (4 epochs of 6)
  });
  try {
    trainer.fit();
    FAIL("fit() should have reported the signal");
  } catch (const InterruptedError& e) {
    CHECK(e.signal() == SIGTERM);
    CHECK_THAT(e.what(), Catch::Contains("stopped by SIGTERM after the last step, 24 of 24, as the run ended; it is "
                                         "complete; saved " + (dir / "checkpoints" / "step-00000024").string()));
    CHECK_THAT(e.what(), !Catch::Contains("resume"));
  }
}

TEST_CASE("Trainer: options out of range and missing parts are named", "[trainer]") {
  Run run;
  setup(run, "fp32");
  TrainerOptions o;
  o.grad_accumulation = 0;
  CHECK_THROWS_WITH(Trainer(*run.booster, o), Catch::Contains("grad_accumulation is 0"));
  o = {};
  o.checkpoint_every = 5;
  CHECK_THROWS_WITH(Trainer(*run.booster, o), Catch::Contains("no run_dir or checkpoint_dir"));
  o = {};
  o.grad_accumulation = 100;
  CHECK_THROWS_WITH(Trainer(*run.booster, o), Catch::Contains("an epoch has only 6 batches"));
  Booster bare;
  CHECK_THROWS_AS(Trainer(bare, {}), StateError);
  // A Trainer's state leaves the Booster with it: a later save does not reach a Trainer that is gone,
  // and a second Trainer may follow the first.
  { Trainer first(*run.booster, {}); }
  CHECK_NOTHROW(run.booster->save_state(scratch("after_trainer")));
  CHECK_NOTHROW(Trainer(*run.booster, {}));
}

TEST_CASE("find_state: afresh only for a root holding nothing, and a dangling latest is an error", "[trainer][checkpoint]") {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("booster_test_find_state_" + std::to_string(::getpid()));
  fs::remove_all(root);
  CHECK_FALSE(Booster::find_state(root).has_value());  // no directory
  fs::create_directories(root / "step-00000003.tmp");  // a first save that never committed
  std::ofstream(root / "lock") << "host:1\n";
  CHECK_FALSE(Booster::find_state(root).has_value());
  std::ofstream(root / "latest") << "step-00000003\n";  // names a step that is not there
  CHECK_THROWS_WITH(Booster::find_state(root), Catch::Contains("names step-00000003, which does not exist"));
  fs::remove_all(root);
}

TEST_CASE("Trainer: diagnostics every N steps reach on_diagnostics with that step's statistics", "[trainer][diagnostics]") {
  Run run;
  setup(run, "bf16");
  TrainerOptions o;
  o.max_steps = 6;
  o.handle_signals = false;
  o.progress = trainer::Progress::Mode::Silent;
  o.diagnostics.every = 3;
  Trainer trainer(*run.booster, o);
  std::vector<int64_t> seen;
  trainer.on_diagnostics([&](int64_t step, const diagnostics::Tracer& tracer) {
    seen.push_back(step);
    CHECK(tracer.statistics_steps() == 1);
    for (const diagnostics::ModuleStats& m : tracer.modules()) {
      // One batch of 16: "up" is Linear(6, 12), "head" Linear(6, 3) with 6 x 3 + 3 parameters.
      if (m.path == "up") CHECK(m[diagnostics::Role::Output].count == 16 * 12);
      if (m.path == "head") CHECK(m[diagnostics::Role::ParameterGradient].count == 6 * 3 + 3);
      // The user's model's own forward: the residual input x reaches "head" through an add, the
      // dropout's output gradient is that of "down"'s output.
      if (m.path == "drop") CHECK(m[diagnostics::Role::OutputGradient].count == 16 * 6);
    }
  });
  trainer.fit();
  CHECK(seen == std::vector<int64_t>{3, 6});
  CHECK(trainer.skipped_steps().empty());
}

namespace {
// Finite in, NaN out: sqrt of values far below zero.
class SqrtBelowZero : public nn::Module {
 public:
  Tensor forward(const Tensor& x) override { return sqrt(add(x, -1000.0)); }
  std::string name() const override { return "SqrtBelowZero"; }
};
}  // namespace

TEST_CASE("Trainer: a non-finite loss names the first non-finite tensor", "[trainer][diagnostics]") {
  // fp32 skips no step, so the run stops with a TrainingError; it names the module whose output first
  // held a NaN.
  manual_seed(3);
  Booster booster(BoosterConfig{.mixed_precision = "fp32"});
  auto model = std::make_shared<nn::Sequential>();
  model->push_back(std::make_shared<nn::Linear>(6, 3));
  model->push_back(std::make_shared<SqrtBelowZero>());
  auto sgd = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}});
  auto loader = booster.prepare_dataloader(points(), {.batch_size = 16});
  nn::Criterion ce = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
  booster.boost(model, sgd, ce, loader);
  TrainerOptions o;
  o.max_steps = 2;
  o.handle_signals = false;
  o.progress = trainer::Progress::Mode::Silent;
  Trainer trainer(booster, o);
  std::string message;
  try {
    trainer.fit();
  } catch (const TrainingError& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("nan at step 1 (the first non-finite tensor: the output of 1 (SqrtBelowZero) in forward)") !=
        std::string::npos);
}
