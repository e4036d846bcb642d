// `booster train`: the training loop driven by a resolved config.
//
// Progress goes to stderr, one line every train.log_every steps; the last line on stdout is the run's
// summary as one JSON object, so scripts can read it with `tail -n 1`.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>

#include "booster/common/error.h"
#include "booster/config/training.h"
#include "booster/data/data.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/lr_scheduler.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"
#include "cli/commands.h"

namespace booster::cli {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string human_count(int64_t n) {
  char buf[32];
  if (n >= 1000000) std::snprintf(buf, sizeof buf, "%.2fM", double(n) / 1e6);
  else if (n >= 1000) std::snprintf(buf, sizeof buf, "%.1fk", double(n) / 1e3);
  else std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  return buf;
}

}  // namespace

int train(const json& config) {
  const json& train_cfg = config.at("train");
  const uint64_t seed = train_cfg.at("seed").get<uint64_t>();
  const int64_t epochs = train_cfg.at("epochs").get<int64_t>();
  const int64_t log_every = train_cfg.at("log_every").get<int64_t>();
  const int64_t eval_every = train_cfg.at("eval_every").get<int64_t>();
  manual_seed(seed);

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

  std::cerr << "booster: " << split.description << "\n"
            << "booster: model " << model->name() << " with " << human_count(model->num_parameters())
            << " parameters, optimizer " << optimizer->name()
            << (scheduler ? ", lr scheduler " + scheduler->name() : std::string()) << ", precision "
            << precision->name() << ", " << total_steps << " steps ("
            << loader.size() << " per epoch)\n";

  // ---- the loop
  json summary = json::object();
  std::optional<config::Evaluation> last_eval;
  auto run_evaluation = [&](int64_t step) {
    if (!split.test) return;
    const auto t0 = Clock::now();
    last_eval = config::evaluate(*model, split, criterion, eval_batch_size);
    std::fprintf(stderr, "eval  step %6lld | test loss %.4f | test accuracy %.2f%% | %lld samples in %.2fs\n",
                 static_cast<long long>(step), last_eval->loss, 100.0 * last_eval->accuracy,
                 static_cast<long long>(last_eval->samples), seconds_since(t0));
  };

  model->train();
  int64_t step = 0;
  int64_t skipped_steps = 0;
  double last_loss = 0.0;
  int64_t samples_seen = 0, window_samples = 0;
  double train_seconds = 0.0;  // time in training steps, without evaluation
  auto window_start = Clock::now();
  const auto run_start = Clock::now();
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
      if (step % log_every == 0 || step == total_steps) {
        const double window_seconds = seconds_since(window_start);
        char scale_text[64] = "";
        if (scales_loss)
          std::snprintf(scale_text, sizeof scale_text, " | scale %g | skipped %lld", precision->loss_scale(),
                        static_cast<long long>(skipped_steps));
        std::fprintf(stderr, "step %6lld/%lld | epoch %lld | loss %.4f | lr %.3g%s | %.0f samples/s\n",
                     static_cast<long long>(step), static_cast<long long>(total_steps),
                     static_cast<long long>(epoch + 1), last_loss, step_lr, scale_text,
                     double(window_samples) / std::max(window_seconds, 1e-9));
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
  std::cout << summary.dump() << std::endl;
  return kExitOk;
}

}  // namespace booster::cli
