// `booster train`: the training loop driven by a resolved config.
//
// Progress goes to stderr (a bar on a terminal, one line every train.log_every steps otherwise), metrics
// to <run_dir>/metrics.jsonl; the last line on stdout is the run's summary as one JSON object, so scripts
// can read it with `tail -n 1` (Note [What booster train prints] in cli/progress.h).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "booster/booster/booster.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
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
#include "booster/distributed/process_group.h"
#include "commands.h"
#include "progress.h"

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

// The run directory with {time} filled in (Note [The run directory] in config.h); nullopt for null. Every
// rank gets rank 0's answer, so checkpoints of several processes go to one place.
std::optional<fs::path> make_run_dir(const json& train_cfg, distributed::ProcessGroup& group) {
  if (!train_cfg.at("run_dir").is_string()) return std::nullopt;
  std::string dir = train_cfg.at("run_dir").get<std::string>();
  const size_t at = dir.find("{time}");
  if (at == std::string::npos) return fs::path(dir);
  std::string chosen;
  if (group.rank() == 0) {
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    gmtime_r(&now, &utc);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &utc);
    dir.replace(at, 6, stamp);
    // Two runs started in the same second get their own directories.
    chosen = dir;
    for (int n = 2; fs::exists(chosen); ++n) chosen = dir + "-" + std::to_string(n);
  }
  if (group.size() > 1) {
    // Length, then the bytes, one per int64 (the names are short).
    Tensor length = from_vector(std::vector<float>{float(chosen.size())}, {1}).to(DType::Int64);
    group.broadcast(length, 0);
    const int64_t n = length.to(DType::Int64).contiguous().data<int64_t>()[0];
    std::vector<float> bytes(size_t(n), 0.0f);
    for (size_t i = 0; i < chosen.size(); ++i) bytes[i] = float(static_cast<unsigned char>(chosen[i]));
    Tensor text = from_vector(bytes, {n}).to(DType::Int64);
    group.broadcast(text, 0);
    const int64_t* data = text.contiguous().data<int64_t>();
    chosen.assign(size_t(n), ' ');
    for (int64_t i = 0; i < n; ++i) chosen[size_t(i)] = char(data[i]);
  }
  return fs::path(chosen);
}

namespace {

// ------------------------------------------------------------------------------------------ checkpoints
// Note [Checkpoints of booster train]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint is a directory laid out as Note [Checkpoint directory layout] (checkpoint.h) says for
// the root: `<checkpoint_dir>/step-XXXXXXXX/` plus `latest`. Its content is written through the
// Booster, so the plugin decides how (a sharded optimizer gathers; rank 0 writes):
//   model/                 Booster::save_model (model.safetensors, or shards + index)
//   optimizer/             Booster::save_optimizer (the optimizer's state and the strategy's: loss
//                          scale, float32 master weights; it names the strategy)
//   scheduler.json         Booster::save_lr_scheduler (when there is a scheduler)
//   trainer_state.json     {"format": "booster-train", "version", "step", "skipped_steps", "samples_seen",
//                           "loss": the step's mean loss, "evaluation": the last one (for the summary
//                           of a run resumed at its end), "dataloader": its position, "rng": {"default":
//                           state, "model.dropout": the GPT's dropout generator}, "mixed_precision",
//                           "plugin", "world_size", "model": the model section, "settings": Note
//                           [Settings a resume must keep]}
// A checkpoint of step N is taken after everything step N does (Note [What a step's checkpoint holds]).
// Everything goes into `step-N.tmp/` first; rank 0 then fsyncs and renames it to `step-N/` (the commit,
// Note [Atomic checkpoint writes]; replacing a `step-N/` that exists as Note [Replacing a checkpoint]
// says), points `latest` at it and prunes to keep_last, in that order, so at every moment `latest`
// names a whole checkpoint (checkpoint::begin_checkpoint / commit_checkpoint do it, as for
// checkpoint::save_checkpoint). On resume, trainer_state.json is read first and a checkpoint of another
// strategy, plugin, world size, model or trajectory setting is refused with a message naming both
// sides, before any tensor is read; corrupt or truncated files are CheckpointErrors naming the file.
// Resuming gives the same parameters, bit for bit, and the same metrics records as a run that was
// never interrupted (tests/test_cli_resume.cpp).
constexpr const char* kTrainFormat = "booster-train";
constexpr int kTrainFormatVersion = 1;

// The random generators a run draws from after its start, by name, for the checkpoint: the default one
// and the GPT's dropout generator.
using Generators = std::map<std::string, Generator*>;

Generators run_generators(nn::Module& plain_model) {
  Generators gens = {{"default", &default_generator()}};
  if (auto* gpt = dynamic_cast<nn::GPT*>(&plain_model)) gens["model.dropout"] = &gpt->dropout_generator();
  return gens;
}

struct TrainPosition {
  int64_t step = 0;
  int64_t skipped_steps = 0;
  int64_t samples_seen = 0;
  // For the summary of a run resumed at its end: the last step's mean loss (null when not finite) and
  // the last evaluation ({"step", "test_loss", "test_accuracy", "samples"}, null before the first).
  json loss = nullptr;
  json evaluation = nullptr;
};

// Note [Settings a resume must keep]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Besides the strategy, plugin, world size and model, these settings would silently make a resumed
// run train another trajectory than the one the checkpoint continues, so trainer_state.json records
// them under "settings" and a resume with another value is refused, naming the key, both values and
// the --set that restores the saved one:
//  * which samples make up each step, and in what order: train.seed (the shuffle order comes back from
//    the checkpoint, but the synthetic data set is drawn from the seed), train.grad_accumulation and
//    the data section (batch_size, shuffle, drop_last, the data set's own settings); the saved data
//    position, counted in batches, would also point elsewhere;
//  * the criterion section (another loss, another label smoothing);
//  * the optimizer and lr_scheduler sections: their hyperparameters come back from the checkpoint (as
//    torch's load_state_dict does), so a changed lr, betas or schedule would be ignored without a word;
//  * the mixed_precision and plugin sections, every option resolved: the scaler's options
//    (growth_interval, backoff_factor, hysteresis, min_scale, max_scale, ...) are not in its saved
//    state, which holds only the scale and its trackers; low_level_zero's precision and stage, ddp's
//    find_unused_parameters and broadcast_buffers change the numbers too. Left out, as they change only
//    how fast: ddp's bucket_cap_mb and progress_thread, low_level_zero's overlap_communication and
//    reduce_bucket_size_in_m; and fp16_naive's log_num_zeros_in_grad (a log column). low_level_zero's
//    max_norm is left out as train.max_grad_norm is, of which it is the plugin's counterpart;
//  * train.max_steps, as the run's length in steps, when the schedule's length is the run's (a null
//    T_max or total_steps): the restored schedule keeps the saved length, so a longer run would go past
//    its end (a cosine climbs back up). Only a longer run is refused (naming train.epochs when that is
//    what made it longer): a shorter one is an exact prefix of the saved run.
// Left out because they may legitimately change: max_steps and epochs when the schedule does not
// depend on them (extending a run), max_grad_norm and the evaluation and logging settings (getting
// past a loss spike, watching more closely), data.dir and data.path (the data moved) and
// data.eval_batch_size.
// Checkpoints from before "settings" was recorded lack it, and those of an earlier version lack the
// options added since (at any depth: the config is resolved with every default, so a new optimizer
// option appears in this run's settings and not in the saved ones): they are accepted, with one line
// naming the settings that could not be checked. A setting is never refused for being absent from the
// checkpoint, so adding an option with a default does not make the old checkpoints unresumable.
json trajectory_settings(const json& config, int64_t total_steps) {
  const json& train = config.at("train");
  json data = config.at("data");
  for (const char* may_change : {"dir", "path", "eval_batch_size"}) data.erase(may_change);
  json settings = {{"train.seed", train.at("seed")},
                   {"train.grad_accumulation", train.at("grad_accumulation")},
                   {"data", data},
                   {"criterion", config.at("criterion")},
                   {"optimizer", config.at("optimizer")},
                   {"lr_scheduler", config.at("lr_scheduler")}};
  json mixed_precision = config.at("mixed_precision");
  mixed_precision.erase("log_num_zeros_in_grad");
  settings["mixed_precision"] = mixed_precision;
  json plugin = config.at("plugin");
  const json plugin_name = plugin.value("name", json());
  if (plugin_name == "ddp") {
    for (const char* speed_only : {"bucket_cap_mb", "progress_thread"}) plugin.erase(speed_only);
  } else if (plugin_name == "low_level_zero") {
    for (const char* may_change : {"overlap_communication", "reduce_bucket_size_in_m", "max_norm"})
      plugin.erase(may_change);
  }
  settings["plugin"] = plugin;
  const json& schedule = config.at("lr_scheduler");
  const bool schedule_spans_run = (schedule.contains("T_max") && schedule.at("T_max").is_null()) ||
                                  (schedule.contains("total_steps") && schedule.at("total_steps").is_null());
  if (schedule_spans_run) settings["train.max_steps"] = total_steps;
  return settings;
}

// Where a saved setting and this run's first differ: the dotted path (the "type" of a section first, as
// the other keys follow from it) and both values there. A key the saved settings lack, at any depth, is
// not compared but added to `unchecked`: the checkpoint predates it (a later version added an option,
// resolved with its default now), and its default may well be what the saved run did. A key this run
// lacks is a difference with a null `now` (this build does not know the option the checkpoint used).
struct SettingDifference {
  std::string where;
  json saved, now;
  bool known_now = true;  // false: this build has no such setting
};

std::optional<SettingDifference> first_difference(const std::string& path, const json& saved, const json& now,
                                                  std::vector<std::string>& unchecked) {
  if (saved == now) return std::nullopt;
  if (!saved.is_object() || !now.is_object()) return SettingDifference{path, saved, now};
  std::vector<std::string> keys = {"type"};
  for (const auto& [key, value] : saved.items()) keys.push_back(key);
  for (const auto& [key, value] : now.items()) keys.push_back(key);
  std::optional<SettingDifference> found;
  for (const std::string& key : keys) {
    const std::string where = path + "." + key;
    const bool in_saved = saved.contains(key), in_now = now.contains(key);
    if (!in_saved && !in_now) continue;
    if (!in_saved) {
      if (std::find(unchecked.begin(), unchecked.end(), where) == unchecked.end()) unchecked.push_back(where);
      continue;
    }
    if (found) continue;  // only the unchecked keys are still wanted
    if (!in_now) found = SettingDifference{where, saved.at(key), json(), false};
    else found = first_difference(where, saved.at(key), now.at(key), unchecked);
  }
  return found;
}

std::string step_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

void save_training_checkpoint(Booster& booster, const Boosted& boosted, const Generators& generators,
                              const fs::path& root, const TrainPosition& position, const json& config,
                              int64_t total_steps, int keep_last) {
  distributed::ProcessGroup& group = booster.process_group();
  const bool writer = group.rank() == 0;
  fs::path tmp_dir;
  if (writer) tmp_dir = checkpoint::begin_checkpoint(root, position.step);
  else tmp_dir = root / (step_dir_name(position.step) + ".tmp");
  group.barrier();
  booster.save_model(*boosted.model, tmp_dir / "model");
  booster.save_optimizer(*boosted.optimizer, tmp_dir / "optimizer");
  if (boosted.scheduler) booster.save_lr_scheduler(*boosted.scheduler, tmp_dir / "scheduler.json");
  if (writer) {
    json rng = json::object();
    for (const auto& [name, gen] : generators) rng[name] = gen->state();
    json state = {{"format", kTrainFormat},
                  {"version", kTrainFormatVersion},
                  {"step", position.step},
                  {"skipped_steps", position.skipped_steps},
                  {"samples_seen", position.samples_seen},
                  {"loss", position.loss},
                  {"evaluation", position.evaluation},
                  {"dataloader", boosted.dataloader->state_dict()},
                  {"rng", rng},
                  {"mixed_precision", config.at("mixed_precision").at("name")},
                  {"plugin", config.at("plugin").at("name")},
                  {"world_size", group.size()},
                  {"model", config.at("model")}};
    state["settings"] = trajectory_settings(config, total_steps);
    checkpoint::write_text_file_atomically(tmp_dir / checkpoint::kTrainerStateFileName, state.dump(1) + "\n");
    checkpoint::sync_directory(tmp_dir);
    checkpoint::commit_checkpoint(root, position.step, keep_last);
  }
  group.barrier();
}

struct SavedTraining {
  fs::path dir;
  json state;                           // trainer_state.json
  std::vector<std::string> unchecked;   // settings the checkpoint predates (Note [Settings a resume must keep])
};

// Reads trainer_state.json of the checkpoint at `path` (a step directory or a root) and refuses one
// that this run cannot continue.
SavedTraining read_trainer_state(const fs::path& path, const json& config, int world_size, int64_t total_steps) {
  // A step named while caught between the renames of a replace is read from its stand-in.
  const fs::path named = path.lexically_normal().has_filename() ? path.lexically_normal()
                                                                : path.lexically_normal().parent_path();
  BOOSTER_CHECK(fs::exists(path) || fs::is_directory(named.string() + checkpoint::kReplacedSuffix), CheckpointError,
                "train.resume: ", path.string(),
                " does not exist; expected a checkpoint directory (or \"latest\", or null)");
  const fs::path dir = checkpoint::resolve_checkpoint(path);
  const fs::path file = dir / checkpoint::kTrainerStateFileName;
  BOOSTER_CHECK(fs::exists(file), CheckpointError, "train.resume: ", dir.string(), " has no ",
                checkpoint::kTrainerStateFileName, "; it is not a complete checkpoint of booster train");
  json state;
  try {
    state = json::parse(checkpoint::read_text_file(file));
  } catch (const json::exception& e) {
    BOOSTER_FAIL(CheckpointError, "train.resume: ", file.string(), " is not valid JSON (", e.what(),
                 "); the checkpoint is truncated or corrupt");
  }
  BOOSTER_CHECK(state.is_object() && state.value("format", "") == kTrainFormat, CheckpointError, "train.resume: ",
                file.string(), " is not a checkpoint of booster train (no \"format\": \"", kTrainFormat, "\")");
  BOOSTER_CHECK(state.value("version", 0) == kTrainFormatVersion, CheckpointError, "train.resume: ", file.string(),
                " has format version ", state.value("version", json()).dump(), "; this build reads version ",
                kTrainFormatVersion);
  for (const char* key : {"step", "skipped_steps", "samples_seen", "dataloader", "rng", "mixed_precision", "plugin",
                          "world_size", "model"})
    BOOSTER_CHECK(state.contains(key), CheckpointError, "train.resume: ", file.string(), " lacks \"", key,
                  "\"; the checkpoint is truncated or corrupt");
  auto refuse_unless_same = [&](const char* what, const json& saved, const json& now, const char* fix) {
    BOOSTER_CHECK(saved == now, CheckpointError, "train.resume: ", dir.string(), " was saved with ", what, " ",
                  config::show(saved), " but this run has ", config::show(now), "; ", fix);
  };
  refuse_unless_same("mixed_precision", state.at("mixed_precision"), config.at("mixed_precision").at("name"),
                     "resume with the same strategy, or start afresh with train.resume null");
  refuse_unless_same("plugin", state.at("plugin"), config.at("plugin").at("name"),
                     "resume with the same plugin, or start afresh with train.resume null");
  refuse_unless_same("world size", state.at("world_size"), json(world_size),
                     "resume with as many processes (booster run -n N), or start afresh");
  // init_from only chooses the starting weights, which the checkpoint replaces: it may differ.
  json saved_model = state.at("model"), model_now = config.at("model");
  saved_model.erase("init_from");
  model_now.erase("init_from");
  refuse_unless_same("the model", saved_model, model_now,
                     "use the model section the checkpoint was trained with, or start afresh");
  // Note [Settings a resume must keep]
  const json saved_settings = state.value("settings", json::object());
  BOOSTER_CHECK(saved_settings.is_object(), CheckpointError, "train.resume: ", file.string(),
                " has \"settings\" ", saved_settings.dump(), ", not an object; the checkpoint is corrupt");
  std::vector<std::string> unchecked;
  const json settings_now = trajectory_settings(config, total_steps);
  for (const auto& [key, now] : settings_now.items()) {
    if (!saved_settings.contains(key)) {
      unchecked.push_back(key);
      continue;
    }
    if (key == "train.max_steps" && saved_settings.at(key).is_number_integer() && now.is_number_integer()) {
      // The run's length, recorded when the schedule spans it: a shorter run is an exact prefix of the
      // saved one (the restored schedule keeps the saved length), a longer one would go past its end.
      const int64_t saved_steps = saved_settings.at(key).get<int64_t>(), steps_now = now.get<int64_t>();
      if (steps_now <= saved_steps) continue;
      const json& max_steps = config.at("train").at("max_steps");
      BOOSTER_FAIL(CheckpointError, "train.resume: ", dir.string(), " was saved with ",
                   max_steps.is_number() ? "train.max_steps " + std::to_string(saved_steps) + " but this run has " +
                                               std::to_string(steps_now)
                                         : "a run of " + std::to_string(saved_steps) + " steps but train.epochs " +
                                               config.at("train").at("epochs").dump() + " makes this run " +
                                               std::to_string(steps_now) + " steps",
                   ", and its lr schedule spans the saved run's steps; a resume continues the saved run: resume with "
                   "--set train.max_steps=", saved_steps, " (or fewer), or start afresh with train.resume null "
                   "(model.init_from=", (dir / "model").string(), " keeps the weights)");
    }
    if (const auto difference = first_difference(key, saved_settings.at(key), now, unchecked)) {
      const SettingDifference& d = *difference;
      BOOSTER_CHECK(d.known_now, CheckpointError, "train.resume: ", dir.string(), " was saved with ", d.where, " ",
                    config::show(d.saved), ", a setting this build does not have; resume with the version that saved "
                    "it, or start afresh with train.resume null (model.init_from=", (dir / "model").string(),
                    " keeps the weights)");
      BOOSTER_FAIL(CheckpointError, "train.resume: ", dir.string(), " was saved with ", d.where, " ",
                   config::show(d.saved), " but this run has ", config::show(d.now),
                   "; a resume continues the saved run: resume with --set ", d.where, "=", d.saved.dump(),
                   ", or start afresh with train.resume null (model.init_from=", (dir / "model").string(),
                   " keeps the weights)");
    }
  }
  return {dir, state, unchecked};
}

TrainPosition load_training_checkpoint(Booster& booster, const Boosted& boosted, const Generators& generators,
                                       const fs::path& dir, const json& state) {
  booster.load_model(*boosted.model, dir / "model");
  booster.load_optimizer(*boosted.optimizer, dir / "optimizer");
  const bool saved_scheduler = fs::exists(dir / "scheduler.json");
  BOOSTER_CHECK(saved_scheduler == bool(boosted.scheduler), CheckpointError, "train.resume: ", dir.string(),
                saved_scheduler ? " has an lr scheduler state but this run has no scheduler"
                                : " has no lr scheduler state but this run has a scheduler",
                "; resume with the lr_scheduler section the checkpoint was trained with");
  if (boosted.scheduler) booster.load_lr_scheduler(*boosted.scheduler, dir / "scheduler.json");
  boosted.dataloader->load_state_dict(state.at("dataloader"));
  try {
    for (const auto& [name, gen] : generators) {
      BOOSTER_CHECK(state.at("rng").contains(name), CheckpointError, "train.resume: ", dir.string(),
                    " has no state of the random generator '", name, "'; the checkpoint is from another model");
      gen->set_state(state.at("rng").at(name).get<std::vector<uint64_t>>());
    }
  } catch (const json::exception& e) {
    BOOSTER_FAIL(CheckpointError, "train.resume: the rng state in ", dir.string(), " is malformed (", e.what(), ")");
  }
  TrainPosition position;
  position.step = state.at("step").get<int64_t>();
  position.skipped_steps = state.at("skipped_steps").get<int64_t>();
  position.samples_seen = state.at("samples_seen").get<int64_t>();
  position.loss = state.value("loss", json());
  position.evaluation = state.value("evaluation", json());
  return position;
}

// A resumed run continues its metrics file: the records after the checkpoint's step (written by the
// interrupted run after its last checkpoint) are dropped, so each step appears once (Note [What a
// step's checkpoint holds]), and so is a line that does not parse: the torn last write of a crash.
void truncate_metrics_after(const fs::path& file, int64_t step) {
  if (!fs::exists(file)) return;
  std::ifstream in(file);
  std::string kept, line;
  while (std::getline(in, line)) {
    const json record = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!record.is_object() || record.value("step", int64_t(0)) > step) continue;
    kept += line + "\n";
  }
  in.close();
  checkpoint::write_text_file_atomically(file, kept);
}

}  // namespace

int train(const json& config, BoosterComponents components) {
  const json& train_cfg = config.at("train");
  const uint64_t seed = train_cfg.at("seed").get<uint64_t>();
  const int64_t epochs = train_cfg.at("epochs").get<int64_t>();
  const int64_t log_every = train_cfg.at("log_every").get<int64_t>();
  const int64_t eval_every = train_cfg.at("eval_every").get<int64_t>();
  const int64_t checkpoint_every = train_cfg.at("checkpoint_every").get<int64_t>();
  const int keep_last = train_cfg.at("keep_last").get<int>();
  // 0: no clipping (the schema allows only null or a positive number).
  const double max_grad_norm = train_cfg.at("max_grad_norm").is_number() ? train_cfg.at("max_grad_norm").get<double>() : 0.0;
  // Note [Gradient accumulation]
  // One optimizer step takes grad_accumulation micro-batches: each one's loss is divided by their
  // number, so the accumulated gradient is that of their mean loss, as one batch of all of them would
  // give. Every micro-batch but the last runs its backward inside booster.no_sync() when the plugin
  // supports it, so data-parallel gradients are communicated once per step. Micro-batches left at the
  // end of an epoch that cannot fill a step are not used (as drop_last does for a batch). Steps,
  // schedules, logs and checkpoints count optimizer steps.
  const int64_t grad_accumulation = train_cfg.at("grad_accumulation").get<int64_t>();
  manual_seed(seed);

  // ---- the Booster, with the plugin and strategy that resolving the config built and checked.
  Booster booster(std::move(components));
  const BoosterConfig& booster_config = booster.config();
  distributed::ProcessGroup& group = booster.process_group();
  const bool is_rank0 = group.size() > 1 ? group.rank() == 0 : process_rank() == 0;
  Progress progress(Progress::detect());

  // ---- the run directory (Note [The run directory] in config.h): only rank 0 writes files.
  const std::optional<fs::path> run_dir = make_run_dir(train_cfg, group);
  std::optional<fs::path> checkpoint_root;
  if (train_cfg.at("checkpoint_dir").is_string()) checkpoint_root = fs::path(train_cfg.at("checkpoint_dir").get<std::string>());
  else if (run_dir) checkpoint_root = *run_dir / "checkpoints";
  MetricsLog metrics;

  // ---- data: this process's share (every rank its own part under data parallelism)
  const json& data_cfg = config.at("data");
  const config::DataSplits split = config::make_datasets(data_cfg, seed);
  data::DataLoaderOptions loader_options;
  loader_options.batch_size = data_cfg.at("batch_size").get<int64_t>();
  loader_options.shuffle = data_cfg.at("shuffle").get<bool>();
  loader_options.drop_last = data_cfg.at("drop_last").get<bool>();
  loader_options.seed = seed;
  std::shared_ptr<data::DataLoader> plain_loader = booster.prepare_dataloader(split.train, loader_options);
  const int64_t eval_batch_size = data_cfg.at("eval_batch_size").get<int64_t>();
  BOOSTER_CHECK(plain_loader->size() > 0, ConfigError, "'data.batch_size' is ", loader_options.batch_size,
                " with drop_last, but the training split has only ", plain_loader->num_samples(),
                " items for this process");

  BOOSTER_CHECK(plain_loader->size() >= grad_accumulation, ConfigError, "'train.grad_accumulation' is ",
                grad_accumulation, " but an epoch has only ", plain_loader->size(),
                " batches for this process; lower it or data.batch_size");
  int64_t total_steps = epochs * (plain_loader->size() / grad_accumulation);
  if (train_cfg.at("max_steps").is_number()) total_steps = std::min(total_steps, train_cfg.at("max_steps").get<int64_t>());

  // ---- model, optimizer, loss and schedule, boosted (Note [Booster lifecycle]): only what boost()
  // returns is used from here on. The scheduler is built on the user's optimizer, as with torch.
  json model_config = config.at("model");
  const json init_from = model_config.value("init_from", json());
  model_config.erase("init_from");
  nn::ModulePtr plain_model = nn::make_model(model_config, seed);
  if (init_from.is_string()) {
    // Before boost(): a strategy may convert the model, and a plugin broadcasts rank 0's weights.
    const fs::path file = init_from.get<std::string>();
    BOOSTER_CHECK(fs::exists(file), ConfigError, "'model.init_from' is ", file.string(),
                  ", which does not exist; give a .safetensors file or a checkpoint's model directory");
    try {
      plain_model->load_state_dict(checkpoint::load_model(file));
    } catch (const Error& e) {
      BOOSTER_FAIL(CheckpointError, "'model.init_from' ", file.string(), ": ", e.what());
    }
  }
  const Generators generators = run_generators(*plain_model);
  const Boosted boosted = [&] {
    std::shared_ptr<optim::Optimizer> plain_optimizer =
        optim::make_optimizer(config.at("optimizer"), plain_model->parameters());
    std::shared_ptr<optim::LRScheduler> plain_scheduler =
        config::make_lr_scheduler(config.at("lr_scheduler"), *plain_optimizer, total_steps);
    return booster.boost(plain_model, plain_optimizer, config::make_criterion(config.at("criterion")), plain_loader,
                         plain_scheduler);
  }();
  const nn::ModulePtr& model = boosted.model;
  BoostedOptimizer& optimizer = *boosted.optimizer;
  const nn::Criterion& criterion = boosted.criterion;
  data::DataLoader& loader = *boosted.dataloader;
  BoostedScheduler* scheduler = boosted.scheduler.get();
  mixed_precision::MixedPrecision& precision = booster.precision();
  // Strategies that scale the loss start above 1 (dynamic scalers at 2^16); their scale and skipped
  // steps are worth a column in the log and a value in the summary.
  const bool scales_loss = precision.loss_scale() != 1.0;

  // The process that saves holds the checkpoint directory for the whole run: a second run started on
  // it is refused rather than clearing this one's save in progress as a crash's leftover.
  const bool saves_checkpoints =
      checkpoint_every > 0 && checkpoint_root && (group.size() > 1 ? group.rank() == 0 : is_rank0);
  std::optional<checkpoint::RootLock> checkpoint_root_lock;
  if (saves_checkpoints) checkpoint_root_lock.emplace(*checkpoint_root);

  // ---- resume (Note [Checkpoints of booster train])
  TrainPosition position;
  std::string resumed_from;
  std::string unchecked_settings;  // the checkpoint predates their record
  if (train_cfg.at("resume").is_string()) {
    const std::string resume = train_cfg.at("resume").get<std::string>();
    const bool latest = resume == "latest";
    const fs::path where = latest ? *checkpoint_root : fs::path(resume);
    // "latest" with nothing saved yet starts afresh, so the same command serves the first run and
    // every restart after a crash.
    if (!latest || (fs::is_directory(where) && !checkpoint::list_checkpoints(where).empty())) {
      const SavedTraining saved = read_trainer_state(where, config, group.size(), total_steps);
      const fs::path& dir = saved.dir;
      position = load_training_checkpoint(booster, boosted, generators, dir, saved.state);
      resumed_from = dir.string();
      for (const std::string& key : saved.unchecked) unchecked_settings += (unchecked_settings.empty() ? "" : ", ") + key;
      BOOSTER_CHECK(position.step <= total_steps, CheckpointError, "train.resume: ", dir.string(), " is at step ",
                    position.step, ", past this run's ", total_steps, " steps; raise train.max_steps or train.epochs");
    }
  }
  if (is_rank0 && run_dir) {
    std::error_code ec;
    fs::create_directories(*run_dir, ec);
    BOOSTER_CHECK(!ec, ConfigError, "cannot create the run directory '", run_dir->string(), "': ", ec.message(),
                  "; set train.run_dir to a writable directory, or to null for no files");
    std::ofstream(*run_dir / "config.json") << config.dump(2) << "\n";
    if (position.step > 0) truncate_metrics_after(*run_dir / kMetricsFileName, position.step);
    metrics.open(*run_dir / kMetricsFileName, /*append=*/position.step > 0);
  }

  progress.print("booster: " + split.description);
  progress.print("booster: model " + model->name() + " with " + human_count(double(model->num_parameters())) +
                 " parameters, optimizer " + optimizer.user_optimizer().name() +
                 (scheduler ? ", lr scheduler " + scheduler->scheduler().name() : std::string()) + ", precision " +
                 booster_config.mixed_precision + ", plugin " + config.at("plugin").at("name").get<std::string>() +
                 (group.size() > 1 ? " x " + std::to_string(group.size()) + " processes" : std::string()) + ", " +
                 std::to_string(total_steps) + " steps (" + std::to_string(loader.size()) + " per epoch)" +
                 (run_dir ? ", run directory " + run_dir->string() : std::string()));
  if (!resumed_from.empty())
    progress.print("booster: resumed from " + resumed_from + " at step " + std::to_string(position.step));
  if (!unchecked_settings.empty())
    progress.print("booster: " + resumed_from + " predates the record of " + unchecked_settings +
                   "; they are not checked against this run's");

  // ---- the loop
  const auto run_start = Clock::now();
  auto run_evaluation = [&](int64_t step) {
    if (!split.test) return;
    const auto t0 = Clock::now();
    const config::Evaluation result = config::evaluate(*model, split, criterion, eval_batch_size);
    progress.print(format_line("eval  step %6lld | test loss %.4f | test accuracy %.2f%% | %lld samples in %.2fs",
                               static_cast<long long>(step), result.loss, 100.0 * result.accuracy,
                               static_cast<long long>(result.samples), seconds_since(t0)));
    position.evaluation = {{"step", step},
                           {"test_loss", result.loss},
                           {"test_accuracy", result.accuracy},
                           {"samples", result.samples}};
    metrics.write({{"kind", "eval"},
                   {"step", step},
                   {"test_loss", result.loss},
                   {"test_accuracy", result.accuracy},
                   {"samples", result.samples},
                   {"time", seconds_since(run_start)}});
  };
  auto save_checkpoint_now = [&] {
    // N copies of a one-process run started by mpirun train the same thing: only the launcher's rank 0
    // writes, or they would all commit into one checkpoint directory at once.
    if (group.size() == 1 && !is_rank0) return;
    const auto t0 = Clock::now();
    save_training_checkpoint(booster, boosted, generators, *checkpoint_root, position, config, total_steps,
                             keep_last);
    progress.print(format_line("saved step %6lld | %s in %.2fs", static_cast<long long>(position.step),
                               (*checkpoint_root / step_dir_name(position.step)).c_str(), seconds_since(t0)));
  };

  // Note [What a step's checkpoint holds]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Everything a step does comes before its checkpoint: its log record, the evaluation every
  // eval_every steps, and, at an epoch's last step, the end-of-epoch evaluation (or, at the run's last,
  // the final one). A run resumed from step N thus starts with step N + 1 and repeats or drops no
  // evaluation and no metrics record (truncate_metrics_after drops those after N that the interrupted
  // run wrote). So the batch loop breaks at an epoch's last step, before fetching micro-batches that
  // cannot fill a step (Note [Gradient accumulation]), and its evaluation and checkpoint follow the
  // loop; a run resumed at an epoch's end finds no step left in it and goes on with the next epoch.
  model->train();
  int64_t& step = position.step;
  const int64_t first_step = step;
  double last_loss = position.loss.is_number() ? position.loss.get<double>() : std::nan("");
  int64_t window_samples = 0, samples_this_run = 0;
  double train_seconds = 0.0;  // time in training steps, without evaluation and saving
  auto window_start = Clock::now();
  auto checkpoint_due = [&] { return checkpoint_every > 0 && (step % checkpoint_every == 0 || step == total_steps); };
  auto steps_left_in_epoch = [&] { return (loader.size() - loader.batches_consumed()) / grad_accumulation; };
  for (int64_t epoch = loader.epoch(); epoch < epochs && step < total_steps; ++epoch) {
    loader.set_epoch(epoch);  // keeps a resumed position in this epoch
    if (steps_left_in_epoch() == 0) continue;  // resumed at this epoch's end
    int64_t micro = 0;            // micro-batches accumulated into the current step (Note [Gradient accumulation])
    double accumulated_loss = 0;  // their mean loss
    auto step_start = Clock::now();
    int64_t batch_samples = 0;
    for (data::Batch& batch : loader) {
      if (micro == 0) {
        step_start = Clock::now();
        optimizer.zero_grad();
        accumulated_loss = 0;
        batch_samples = 0;
      }
      const bool last_micro = ++micro == grad_accumulation;
      Tensor loss = criterion((*model)(batch.x), batch.y);
      const Tensor scaled = grad_accumulation > 1 ? mul(loss, 1.0 / double(grad_accumulation)) : loss;
      if (!last_micro && booster.plugin().support_no_sync()) {
        Booster::NoSync no_sync = booster.no_sync();
        booster.backward(scaled, optimizer);
      } else {
        booster.backward(scaled, optimizer);
      }
      accumulated_loss += loss.item() / double(grad_accumulation);
      batch_samples += batch.x.size(0);
      if (!last_micro) continue;
      micro = 0;
      const double step_lr = optimizer.lr();  // the lr this step uses (the scheduler moves it after)
      if (max_grad_norm > 0.0) booster.clip_grad_norm(optimizer, max_grad_norm);
      optimizer.step();
      // A skipped step (inf/NaN gradients, the scale was lowered) changed no weight, so, as Accelerate
      // does, it does not move the schedule either (BoostedScheduler::step knows).
      const bool skipped = optimizer.step_was_skipped();
      if (skipped) ++position.skipped_steps;
      if (scheduler) scheduler->step();
      ++step;
      last_loss = accumulated_loss;
      position.loss = std::isfinite(last_loss) ? json(last_loss) : json(nullptr);
      train_seconds += seconds_since(step_start);
      position.samples_seen += batch_samples;
      samples_this_run += batch_samples;
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
      if (scales_loss) report.loss_scale = precision.loss_scale();
      report.skipped = position.skipped_steps;
      report.samples_per_second = double(window_samples) / std::max(seconds_since(window_start), 1e-9);
      report.seconds = seconds_since(run_start);
      report.eta_seconds = train_seconds / double(step - first_step) * double(total_steps - step);
      progress.update(report, logged);
      if (logged) {
        metrics.write({{"kind", "train"},
                       {"step", step},
                       {"epoch", report.epoch},
                       {"loss", last_loss},
                       {"lr", step_lr},
                       {"loss_scale", report.loss_scale ? json(*report.loss_scale) : json(nullptr)},
                       {"skipped", position.skipped_steps},
                       {"samples_per_second", report.samples_per_second},
                       {"time", report.seconds}});
        window_samples = 0;
        window_start = Clock::now();
      }
      if (eval_every > 0 && step % eval_every == 0 && step < total_steps) run_evaluation(step);
      // The end of the epoch or of the run: evaluation and checkpoint follow the loop.
      if (step >= total_steps || steps_left_in_epoch() == 0) break;
      if (checkpoint_due()) save_checkpoint_now();
    }
    // The epoch's (or the run's) last step (Note [What a step's checkpoint holds]): eval_every = 0
    // evaluates after each epoch, and every run once at its end.
    if (eval_every == 0 || step >= total_steps) run_evaluation(step);
    if (checkpoint_due()) save_checkpoint_now();
  }
  progress.finish();

  json summary = json::object();
  summary["final_loss"] = last_loss;
  summary["steps"] = step;
  summary["mixed_precision"] = booster_config.mixed_precision;
  summary["plugin"] = config.at("plugin").at("name");
  summary["processes"] = group.size();
  summary["skipped_steps"] = position.skipped_steps;
  summary["final_loss_scale"] = scales_loss ? json(precision.loss_scale()) : json(nullptr);
  summary["seconds"] = seconds_since(run_start);
  summary["train_seconds"] = train_seconds;
  summary["samples_per_second"] = double(samples_this_run) / std::max(train_seconds, 1e-9);
  if (split.tokens_per_sample > 1)
    summary["tokens_per_second"] = double(samples_this_run * split.tokens_per_sample) / std::max(train_seconds, 1e-9);
  if (!position.evaluation.is_null()) {
    summary["test_loss"] = position.evaluation.value("test_loss", json());
    summary["test_accuracy"] = position.evaluation.value("test_accuracy", json());
  }
  summary["run_dir"] = run_dir ? json(run_dir->string()) : json(nullptr);
  summary["resumed_from"] = resumed_from.empty() ? json(nullptr) : json(resumed_from);
  if (is_rank0) std::cout << summary.dump() << std::endl;
  return kExitOk;
}

}  // namespace booster::cli
