// `booster train`: reads the resolved config, builds the parts it names and hands them to the library's
// Trainer (booster/trainer/trainer.h), which runs the loop, logs, evaluates, saves and resumes.
//
// Progress goes to stderr, metrics to <run_dir>/metrics.jsonl; the last line on stdout is the run's
// summary as one JSON object, so scripts can read it with `tail -n 1` (Note [What booster train prints]
// in booster/trainer/progress.h).
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "booster/booster/booster.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/common/error.h"
#include "booster/common/threads.h"
#include "booster/config/config.h"
#include "booster/config/training.h"
#include "booster/data/dataloader.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/lora.h"
#include "booster/nn/models.h"
#include "booster/optim/lr_scheduler.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/deferred.h"
#include "booster/tensor/random.h"
#include "booster/trainer/progress.h"
#include "booster/trainer/trainer.h"
#include "commands.h"

namespace booster::cli {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// How a refused resume restores a saved setting, as a command line would, on `processes` processes.
// data.global_batch_size is no key of the config but data.batch_size x processes (config::
// portable_settings): it is restored by the per-process batch that gives it on these processes, or on
// another number of them.
std::string restore_with_set(const std::string& where, const json& saved, int processes) {
  const std::string afresh =
      ", or start afresh with train.resume null (model.init_from=<checkpoint>/model keeps the weights)";
  if (where == "data.global_batch_size" && saved.is_number_integer()) {
    const int64_t global = saved.get<int64_t>();
    const std::string n = std::to_string(processes) + (processes == 1 ? " process" : " processes");
    const std::string how = global % processes == 0
                                ? "--set data.batch_size=" + std::to_string(global / processes) + " on " + n
                                : "a number of processes N that divides it (booster run -n N) and --set "
                                  "data.batch_size=" + std::to_string(global) + "/N";
    return "resume with data.batch_size x processes = " + std::to_string(global) + ": " + how + afresh;
  }
  const std::string value = where == "train.max_steps" ? saved.dump() + " (or fewer)" : saved.dump();
  return "resume with --set " + where + "=" + value + afresh;
}

// The model of the `model` section, with model.init_from's weights when given. Before boost(): a
// strategy may convert the model, and a plugin broadcasts rank 0's weights. Built deferred
// (booster/tensor/deferred.h): boost() allocates it, only this rank's part under hybrid_parallel.
// Weights from a checkpoint are checked against its checksums first, as a resume checks them, unless
// `verify` is false (--no-verify): Note [Weights from a checkpoint] in booster/checkpoint/checkpoint.cpp.
nn::ModulePtr make_model(json model_config, uint64_t seed, bool verify) {
  const json init_from = model_config.value("init_from", json());
  model_config.erase("init_from");
  nn::ModulePtr model;
  {
    LazyInitGuard lazy;
    model = nn::make_model(model_config, seed);
  }
  if (init_from.is_string()) {
    const fs::path file = init_from.get<std::string>();  // there when the config was resolved
    try {
      model->load_state_dict(
          checkpoint::load_weights(file, {.verify = verify, .warn = trainer::process_rank() == 0}));
    } catch (const Error& e) {
      BOOSTER_FAIL(CheckpointError, "'model.init_from' ", file.string(), ": ", e.what());
    }
  }
  return model;
}

std::optional<fs::path> optional_path(const json& value) {
  if (!value.is_string()) return std::nullopt;
  return fs::path(value.get<std::string>());
}

// Note [Evaluating without training]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `booster eval` is `booster train` with train.max_steps 0 and the weights to evaluate as
// model.init_from (a checkpoint's model/, checked against its checksums) or an hf model section. The run
// is built exactly as train builds it (data split, model, strategy, plugin, boost) and the Trainer
// evaluates it once with the code fit() evaluates with (Trainer::evaluate), so a checkpoint of step N
// gives the numbers train reported at step N. No step is taken and nothing is written: no run
// directory, no metrics, no checkpoint. The evaluation is one line on stderr and the summary, as
// train's, the last line on stdout: test_loss, and test_accuracy for a classifier or val_loss and
// val_ppl for a language model, with the samples, where the weights came from, and the run's
// precision, plugin, device and processes.
template <typename WithRun>
int report_evaluation(Booster& booster, Trainer& trainer, const json& evaluated, bool is_rank0, WithRun with_run) {
  const auto start = std::chrono::steady_clock::now();
  const trainer::Evaluation e = trainer.evaluate();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!is_rank0) return kExitOk;
  json summary = e.to_json();
  summary["samples"] = e.samples;
  summary["seconds"] = seconds;
  summary["steps"] = 0;  // trained here; "step" is the checkpoint's
  summary["mixed_precision"] = trainer::running_precision(booster);
  summary.update(evaluated.is_object() ? evaluated : json{{"weights", "the config's model"}});
  const std::string from = summary.value("checkpoint", summary.value("hf", summary.value("weights", std::string())));
  std::cerr << "booster: eval " << (from.empty() ? std::string() : "of " + from + ": ") << e.describe() << "\n";
  std::cout << with_run(summary).dump() << std::endl;
  BOOSTER_CHECK(std::cout.good(), IOError, "cannot write the evaluation to stdout (", std::strerror(errno), ")");
  return kExitOk;
}

}  // namespace

int run_training(const json& config, BoosterComponents components, const TrainingHooks& hooks) {
  const json& train_cfg = config.at("train");
  const json& data_cfg = config.at("data");
  const uint64_t seed = train_cfg.at("seed").get<uint64_t>();
  manual_seed(seed);
  // train.threads, else OMP_NUM_THREADS, else the cores shared among this machine's processes (Note
  // [Threads per process]); the trainer's start line names the count.
  const json threads = train_cfg.value("threads", json());
  configure_threads(threads.is_number_integer() ? std::optional<int64_t>(threads.get<int64_t>()) : std::nullopt);
  // train.collective_timeout_s was applied when the config was resolved (config::resolve_run).
  // Processes started by torchrun's variables meet (the tcp group, Note [TCP process group]) before
  // anything is written, so a job that cannot meet fails with nothing on disk.
  if (!distributed::launched_by_mpi_launcher() && distributed::job_place_from_launcher().size > 1)
    distributed::default_process_group();

  // The Booster, with the plugin and strategy that resolving the config built and checked.
  Booster booster(std::move(components));

  // Data: this process's share (every rank its own part under data parallelism).
  const config::DataSplits split = config::make_datasets(data_cfg, seed, config::model_vocab_size(config.at("model")));
  data::DataLoaderOptions loader_options;
  loader_options.batch_size = data_cfg.at("batch_size").get<int64_t>();
  loader_options.shuffle = data_cfg.at("shuffle").get<bool>();
  loader_options.drop_last = data_cfg.at("drop_last").get<bool>();
  loader_options.seed = seed;
  std::shared_ptr<data::DataLoader> loader = booster.prepare_dataloader(split.train, loader_options);
  BOOSTER_CHECK(loader->size() > 0, ConfigError, "'data.batch_size' is ", loader_options.batch_size,
                " with drop_last, but the training split has only ", loader->num_samples(), " items for this process");
  const int64_t grad_accumulation = train_cfg.at("grad_accumulation").get<int64_t>();
  BOOSTER_CHECK(loader->size() >= grad_accumulation, ConfigError, "'train.grad_accumulation' is ", grad_accumulation,
                " but an epoch has only ", loader->size(), " batches for this process; lower it or data.batch_size");

  // Note [Evaluating without training]: max_steps 0 (what `booster eval` sets) evaluates the model once.
  const bool evaluate_only = train_cfg.at("max_steps").is_number() && train_cfg.at("max_steps").get<int64_t>() == 0;
  BOOSTER_CHECK(!evaluate_only || !train_cfg.at("resume").is_string(), ConfigError,
                "'train.max_steps' is 0 (evaluate without training) but 'train.resume' is ", train_cfg.at("resume").dump(),
                "; to evaluate a checkpoint use booster eval --checkpoint DIR (or model.init_from=DIR)");
  BOOSTER_CHECK(!evaluate_only || split.test != nullptr, ConfigError,
                "'train.max_steps' is 0 (evaluate without training) but the '", data_cfg.at("type").get<std::string>(),
                "' data has no held-out split to evaluate on; give it one (data.val_path for tokens, "
                "data.test_fraction for text or files, data.num_test_samples for synthetic)");

  TrainerOptions options;
  options.epochs = train_cfg.at("epochs").get<int64_t>();
  if (train_cfg.at("max_steps").is_number() && !evaluate_only)
    options.max_steps = train_cfg.at("max_steps").get<int64_t>();
  options.grad_accumulation = grad_accumulation;
  if (train_cfg.at("max_grad_norm").is_number()) options.max_grad_norm = train_cfg.at("max_grad_norm").get<double>();
  options.log_every = train_cfg.at("log_every").get<int64_t>();
  options.eval_every = train_cfg.at("eval_every").get<int64_t>();
  options.eval_batch_size = data_cfg.at("eval_batch_size").get<int64_t>();
  options.run_dir = optional_path(train_cfg.at("run_dir"));
  options.checkpoint_dir = optional_path(train_cfg.at("checkpoint_dir"));
  options.checkpoint_every = train_cfg.at("checkpoint_every").get<int64_t>();
  options.keep_last = train_cfg.at("keep_last").get<int>();
  options.stop_on_write_error = train_cfg.at("on_write_error") == "stop";
  options.async_checkpoint = train_cfg.at("async_checkpoint").get<bool>();
  options.stop_on_save_error = train_cfg.at("on_save_error") == "stop";
  const json& diagnostics = train_cfg.at("diagnostics");
  options.diagnostics.every = diagnostics.value("every", int64_t(0));
  options.diagnostics.name_nonfinite = diagnostics.value("name_nonfinite", true);
  if (train_cfg.at("resume").is_string()) options.resume = train_cfg.at("resume").get<std::string>();
  options.config = config;
  options.data_description = split.description;
  options.tokens_per_sample = split.tokens_per_sample;
  options.perplexity = split.language_model;
  options.token_mean_ignore_index = split.token_mean_ignore_index;
  const int processes = booster.process_group().size();
  auto restore_hint = [processes](const std::string& where, const json& saved) {
    return restore_with_set(where, saved, processes);
  };
  options.load_options = {.context = "train.resume", .restore_hint = restore_hint,
                          .run_length_setting = "train.max_steps",
                          .verify = train_cfg.at("verify_checkpoints").get<bool>(),
                          .portable_settings = config::portable_settings,
                          .precision_setting = "mixed_precision"};
  options.resume_hint = [](const fs::path& checkpoint) {
    return "resume with --resume " + checkpoint.string() + " (or --resume latest with the same checkpoint directory)";
  };
  const int64_t total_steps = planned_steps(options.epochs, loader->size() / grad_accumulation, options.max_steps);
  options.resume_settings = config::trajectory_settings(config, total_steps);
  if (hooks.adjust) hooks.adjust(options);
  if (evaluate_only) {  // nothing is written: no run directory, no checkpoint
    options.run_dir.reset();
    options.checkpoint_dir.reset();
    options.checkpoint_every = 0;
  }

  // Model, optimizer, loss and schedule, boosted (Note [Booster lifecycle]). The scheduler is built on
  // the user's optimizer, as with torch.
  nn::ModulePtr model = make_model(config.at("model"), seed, train_cfg.at("verify_checkpoints").get<bool>());
  // Note [The lora section] in booster/config/lora_section.cpp: adapters before boost(), and the
  // optimizer over them only.
  const std::optional<nn::LoraConfig> lora = config::lora_config(config);
  if (lora) {
    try {
      booster.enable_lora(model, *lora);
    } catch (const ConfigError& e) {
      if (std::string(e.what()).find("target_modules") == std::string::npos) throw;  // an adapter directory's refusal
      BOOSTER_FAIL(ConfigError, "'lora.target_modules' is ", json(lora->target_modules).dump(), ": ", e.what());
    }
  }
  std::shared_ptr<optim::Optimizer> optimizer =
      optim::make_optimizer(config.at("optimizer"), lora ? nn::trainable_parameters(*model) : model->parameters());
  std::shared_ptr<optim::LRScheduler> scheduler =
      evaluate_only ? nullptr : config::make_lr_scheduler(config.at("lr_scheduler"), *optimizer, total_steps);
  booster.boost(model, optimizer, config::make_criterion(config.at("criterion")), loader, scheduler);

  if (evaluate_only && hooks.evaluated.is_object() && hooks.evaluated.value("lora_adapters", false)) {
    const std::string checkpoint = hooks.evaluated.at("checkpoint").get<std::string>();
    BOOSTER_CHECK(lora.has_value(), ConfigError, "--checkpoint ", checkpoint, " holds LoRA adapters only; evaluate "
                  "it with the config of the run that saved it (its lora section)");
    booster.load_adapters(checkpoint, "booster eval --checkpoint");
  }
  Trainer trainer(booster, std::move(options));
  if (split.test && hooks.evaluate) trainer.set_eval_data(split.test, split.eval_stride);
  if (hooks.before_fit) hooks.before_fit(trainer);
  const bool is_rank0 = booster.process_group().size() > 1 ? booster.process_group().rank() == 0
                                                             : trainer::process_rank() == 0;
  auto with_run = [&](json summary) {
    summary["plugin"] = config.at("plugin").at("name");
    summary["device"] = booster.config().device;
    summary["processes"] = booster.process_group().size();
    return summary;
  };
  if (evaluate_only) return report_evaluation(booster, trainer, hooks.evaluated, is_rank0, with_run);
  FitResult result;
  try {
    result = trainer.fit();
  } catch (const InterruptedError& e) {
    // A run stopped by a signal still ends with its summary, saying so ("interrupted"); main() prints
    // the stop line and exits 128 + the signal.
    if (is_rank0 && !hooks.after_fit && e.summary().is_object()) std::cout << with_run(e.summary()).dump() << std::endl;
    throw;
  }
  if (hooks.after_fit) return hooks.after_fit(booster, trainer, result, is_rank0);

  const json summary = with_run(result.to_json());  // "mixed_precision": the precision that ran
  if (is_rank0) {
    std::cout << summary.dump() << std::endl;
    BOOSTER_CHECK(std::cout.good(), IOError, "cannot write the summary to stdout (", std::strerror(errno),
                  "); the run itself finished", result.last_checkpoint ? " and saved " + result.last_checkpoint->string()
                                                                       : std::string());
  }
  return kExitOk;
}

int train(const json& config, BoosterComponents components) {
  return run_training(config, std::move(components), {});
}

}  // namespace booster::cli
