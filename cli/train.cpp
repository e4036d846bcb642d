// `booster train`: the training loop driven by a resolved config.
//
// Progress goes to stderr (a bar on a terminal, one line every train.log_every steps otherwise), metrics
// to <run_dir>/metrics.jsonl; the last line on stdout is the run's summary as one JSON object, so scripts
// can read it with `tail -n 1` (Note [What booster train prints] in cli/progress.h).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>

#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/config/training.h"
#include "booster/data/data.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/lr_scheduler.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"
#include "cli/commands.h"
#include "cli/progress.h"

namespace booster::cli {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

template <class... Values>
std::string format_line(const char* format, Values... values) {
  char buf[512];
  std::snprintf(buf, sizeof buf, format, values...);
  return buf;
}

}  // namespace

std::optional<fs::path> make_run_dir(const json& train_cfg) {
  if (!train_cfg.at("run_dir").is_string()) return std::nullopt;
  std::string dir = train_cfg.at("run_dir").get<std::string>();
  const size_t at = dir.find("{time}");
  if (at == std::string::npos) return fs::path(dir);
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &utc);
  dir.replace(at, 6, stamp);
  // Two runs started in the same second get their own directories.
  fs::path candidate = dir;
  for (int n = 2; fs::exists(candidate); ++n) candidate = dir + "-" + std::to_string(n);
  return candidate;
}

int train(const json& config) {
  const json& train_cfg = config.at("train");
  const uint64_t seed = train_cfg.at("seed").get<uint64_t>();
  const int64_t epochs = train_cfg.at("epochs").get<int64_t>();
  const int64_t log_every = train_cfg.at("log_every").get<int64_t>();
  const int64_t eval_every = train_cfg.at("eval_every").get<int64_t>();
  manual_seed(seed);
  Progress progress(Progress::detect());
  const bool is_rank0 = process_rank() == 0;

  // ---- the run directory (Note [The run directory] in config.h): only rank 0 writes files.
  std::optional<fs::path> run_dir = is_rank0 ? make_run_dir(train_cfg) : std::nullopt;
  MetricsLog metrics;
  if (run_dir) {
    std::error_code ec;
    fs::create_directories(*run_dir, ec);
    BOOSTER_CHECK(!ec, ConfigError, "cannot create the run directory '", run_dir->string(), "': ", ec.message(),
                  "; set train.run_dir to a writable directory, or to null for no files");
    std::ofstream(*run_dir / "config.json") << config.dump(2) << "\n";
    metrics.open(*run_dir / kMetricsFileName);
  }

  // ---- data
  const json& data_cfg = config.at("data");
  const config::DataSplits split = config::make_datasets(data_cfg, seed);
  data::DataLoaderOptions loader_options;
  loader_options.batch_size = data_cfg.at("batch_size").get<int64_t>();
  loader_options.shuffle = data_cfg.at("shuffle").get<bool>();
  loader_options.drop_last = data_cfg.at("drop_last").get<bool>();
  loader_options.seed = seed;
  data::DataLoader loader(split.train, loader_options);
  const int64_t eval_batch_size = data_cfg.at("eval_batch_size").get<int64_t>();
  BOOSTER_CHECK(loader.size() > 0, ConfigError, "'data.batch_size' is ", loader_options.batch_size,
                " with drop_last, but the training split has only ", split.train->size(), " items");

  int64_t total_steps = epochs * loader.size();
  if (train_cfg.at("max_steps").is_number()) total_steps = std::min(total_steps, train_cfg.at("max_steps").get<int64_t>());

  // ---- model, optimizer, loss, all three through the precision strategy (Note [The mixed-precision
  // step]): it may convert or wrap each, so only what configure() returns is used from here on, and
  // the scheduler is built on the optimizer it returns (which may hold float32 master weights).
  json mp_options = config.at("mixed_precision");
  const std::string mp_name = mp_options.at("name").get<std::string>();
  mp_options.erase("name");
  std::unique_ptr<mixed_precision::MixedPrecision> precision = mixed_precision::create(mp_name, mp_options);
  const mixed_precision::Configured configured = [&] {
    nn::ModulePtr plain_model = nn::make_model(config.at("model"), seed);
    std::shared_ptr<optim::Optimizer> plain_optimizer =
        optim::make_optimizer(config.at("optimizer"), plain_model->parameters());
    return precision->configure(plain_model, plain_optimizer, config::make_criterion(config.at("criterion")));
  }();
  const nn::ModulePtr& model = configured.model;
  const std::shared_ptr<optim::Optimizer>& optimizer = configured.optimizer;
  const config::Criterion& criterion = configured.criterion;
  std::unique_ptr<optim::LRScheduler> scheduler =
      config::make_lr_scheduler(config.at("lr_scheduler"), *optimizer, total_steps);
  // Strategies that scale the loss start above 1 (dynamic scalers at 2^16); their scale and skipped
  // steps are worth a column in the log and a value in the summary.
  const bool scales_loss = precision->loss_scale() != 1.0;

  progress.print("booster: " + split.description);
  progress.print("booster: model " + model->name() + " with " + human_count(double(model->num_parameters())) +
                 " parameters, optimizer " + optimizer->name() +
                 (scheduler ? ", lr scheduler " + scheduler->name() : std::string()) + ", precision " +
                 precision->name() + ", " + std::to_string(total_steps) + " steps (" + std::to_string(loader.size()) +
                 " per epoch)" + (run_dir ? ", run directory " + run_dir->string() : std::string()));

  // ---- the loop
  const auto run_start = Clock::now();
  json summary = json::object();
  std::optional<config::Evaluation> last_eval;
  auto run_evaluation = [&](int64_t step) {
    if (!split.test) return;
    const auto t0 = Clock::now();
    last_eval = config::evaluate(*model, split, criterion, eval_batch_size);
    progress.print(format_line("eval  step %6lld | test loss %.4f | test accuracy %.2f%% | %lld samples in %.2fs",
                               static_cast<long long>(step), last_eval->loss, 100.0 * last_eval->accuracy,
                               static_cast<long long>(last_eval->samples), seconds_since(t0)));
    metrics.write({{"kind", "eval"},
                   {"step", step},
                   {"test_loss", last_eval->loss},
                   {"test_accuracy", last_eval->accuracy},
                   {"samples", last_eval->samples},
                   {"time", seconds_since(run_start)}});
  };

  model->train();
  int64_t step = 0;
  int64_t skipped_steps = 0;
  double last_loss = 0.0;
  int64_t samples_seen = 0, window_samples = 0;
  double train_seconds = 0.0;  // time in training steps, without evaluation
  auto window_start = Clock::now();
  for (int64_t epoch = 0; epoch < epochs && step < total_steps; ++epoch) {
    loader.set_epoch(epoch);
    for (data::Batch& batch : loader) {
      const auto step_start = Clock::now();
      const double step_lr = optimizer->lr();  // the lr this step uses (the scheduler moves it after)
      Tensor output = (*model)(batch.x);
      Tensor loss = criterion(output, batch.y);
      optimizer->zero_grad();
      precision->backward(loss, *optimizer);
      precision->step(*optimizer);
      // A skipped step (inf/NaN gradients, the scale was lowered) changed no weight, so, as Accelerate
      // does, it does not move the schedule either.
      const bool skipped = precision->step_was_skipped();
      if (skipped) ++skipped_steps;
      else if (scheduler) scheduler->step();
      ++step;
      last_loss = loss.item();
      train_seconds += seconds_since(step_start);
      const int64_t batch_samples = batch.x.size(0);
      samples_seen += batch_samples;
      window_samples += batch_samples;

      // An overflowing 16-bit loss on a skipped step is the scaler's to handle (it throws itself when
      // the scale would fall below its floor).
      BOOSTER_CHECK(skipped || std::isfinite(last_loss), TrainingError, "the loss is ", last_loss, " at step ", step,
                    "; lower optimizer.lr or check the data");
      const bool logged = step % log_every == 0 || step == total_steps;
      StepReport report;
      report.step = step;
      report.total_steps = total_steps;
      report.epoch = epoch + 1;
      report.loss = last_loss;
      report.lr = step_lr;
      if (scales_loss) report.loss_scale = precision->loss_scale();
      report.skipped = skipped_steps;
      report.samples_per_second = double(window_samples) / std::max(seconds_since(window_start), 1e-9);
      report.seconds = seconds_since(run_start);
      report.eta_seconds = train_seconds / double(step) * double(total_steps - step);
      progress.update(report, logged);
      if (logged) {
        metrics.write({{"kind", "train"},
                       {"step", step},
                       {"epoch", report.epoch},
                       {"loss", last_loss},
                       {"lr", step_lr},
                       {"loss_scale", report.loss_scale ? json(*report.loss_scale) : json(nullptr)},
                       {"skipped", skipped_steps},
                       {"samples_per_second", report.samples_per_second},
                       {"time", report.seconds}});
        window_samples = 0;
        window_start = Clock::now();
      }
      if (eval_every > 0 && step % eval_every == 0 && step < total_steps) run_evaluation(step);
      if (step >= total_steps) break;
    }
    // eval_every = 0: evaluate after each epoch (the last one below, once).
    if (eval_every == 0 && step < total_steps) run_evaluation(step);
  }
  run_evaluation(step);
  progress.finish();

  summary["final_loss"] = last_loss;
  summary["steps"] = step;
  summary["mixed_precision"] = precision->name();
  summary["skipped_steps"] = skipped_steps;
  summary["final_loss_scale"] = scales_loss ? json(precision->loss_scale()) : json(nullptr);
  summary["seconds"] = seconds_since(run_start);
  summary["train_seconds"] = train_seconds;
  summary["samples_per_second"] = double(samples_seen) / std::max(train_seconds, 1e-9);
  if (split.tokens_per_sample > 1)
    summary["tokens_per_second"] = double(samples_seen * split.tokens_per_sample) / std::max(train_seconds, 1e-9);
  if (last_eval) {
    summary["test_loss"] = last_eval->loss;
    summary["test_accuracy"] = last_eval->accuracy;
  }
  summary["run_dir"] = run_dir ? json(run_dir->string()) : json(nullptr);
  if (is_rank0) std::cout << summary.dump() << std::endl;
  return kExitOk;
}

}  // namespace booster::cli
