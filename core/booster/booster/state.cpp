// Booster::save_state / load_state: the whole state of a boosted training loop in one atomic checkpoint.
//
// Note [Booster state]
// ~~~~~~~~~~~~~~~~~~~~
// A checkpoint is a step directory of a root laid out as Note [Checkpoint directory layout]
// (checkpoint.h) says: `<root>/step-XXXXXXXX/` plus `latest`. Its content is written through the
// Booster's checkpoint IO, so the plugin decides how (a sharded optimizer gathers; rank 0 writes):
//   model/                 Booster::save_model (model.safetensors, or shards + index)
//   optimizer/             Booster::save_optimizer (the optimizer's state and the strategy's: loss
//                          scale, float32 master weights; it names the strategy)
//   scheduler.json         Booster::save_lr_scheduler (when boost() was given a scheduler)
//   extra.safetensors      the registered tensors, as "<name>/<key>" (when any are registered)
//   trainer_state.json     {"format": "booster-state", "version", "step": the boosted optimizer's steps,
//                           "dataloader": its position and epoch (null without one), "rng": {name: state}
//                           ("default", "model.<path>" for the model's generators, registered names),
//                           "mixed_precision", "plugin", "world_size", "settings": Note [Settings a
//                           resume must keep], "state": {name: the registered JSON}, "tensors": [names]}
// Everything goes into `step-N.tmp/` first; rank 0 then fsyncs and renames it to `step-N/` (the commit),
// points `latest` at it and prunes to keep_last, so at every moment `latest` names a whole checkpoint
// (checkpoint::begin_checkpoint / commit_checkpoint). On load, trainer_state.json is read first and a
// checkpoint of another strategy, plugin or world size, or with other settings, is refused before any
// tensor is read. Loading restores every piece, so the loop continues bit for bit as if never stopped.
//
// Note [Settings a resume must keep]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Some settings would make a resumed run silently train another trajectory than the one the checkpoint
// continues: a new seed or batch size changes which samples make up a step, an optimizer or schedule
// option is replaced by the checkpoint's (as torch's load_state_dict does) without a word, a scaler's
// options are not in its saved state. A caller names them with set_resume_settings (the Trainer passes
// config::trajectory_settings); they are saved under "settings" and load_state refuses a resume where
// one differs, naming the dotted key, both values and how to restore the saved one. A key the saved
// settings lack, at any depth, is not compared but reported in LoadedState::unchecked: the checkpoint
// predates it (a later version added an option, resolved with its default now), so adding an option
// never makes old checkpoints unresumable. A key this run lacks is refused: this build does not know the
// option the checkpoint used. The run-length setting (LoadStateOptions::run_length_setting) may shrink:
// a shorter run is an exact prefix of the saved one.
#include <algorithm>
#include <fstream>
#include <set>

#include "booster/booster/booster.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/checksums.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/data/dataloader.h"

namespace booster {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kStateFormat = "booster-state";
// Version 3 added checksums.json (Note [Checkpoint checksums]); version 2 still loads, unverified.
constexpr int kStateFormatVersion = 3;
constexpr int kOldestStateFormatVersion = 2;
constexpr const char* kExtraTensorsFile = "extra.safetensors";

std::string show(const json& value) { return value.is_null() ? "null" : value.dump(); }

std::string step_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

struct SettingDifference {
  std::string where;
  json saved, now;
  bool known_now = true;  // false: this build has no such setting
};

// Where a saved setting and this run's first differ: the dotted path (the "type" of a section first, as
// the other keys follow from it) and both values there (Note [Settings a resume must keep]).
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

json read_state_file(const fs::path& dir, const std::string& context) {
  const fs::path file = dir / checkpoint::kTrainerStateFileName;
  BOOSTER_CHECK(fs::exists(file), CheckpointError, context, ": ", dir.string(), " has no ",
                checkpoint::kTrainerStateFileName, "; it is not a complete checkpoint of Booster::save_state");
  json state;
  try {
    state = json::parse(checkpoint::read_text_file(file));
  } catch (const json::exception& e) {
    BOOSTER_FAIL(CheckpointError, context, ": ", file.string(), " is not valid JSON (", e.what(),
                 "); the checkpoint is truncated or corrupt");
  }
  BOOSTER_CHECK(state.is_object() && state.value("format", "") == kStateFormat, CheckpointError, context, ": ",
                file.string(), " is not a checkpoint of Booster::save_state (no \"format\": \"", kStateFormat,
                "\"); a checkpoint of an earlier version can still give its weights (model.init_from=",
                (dir / "model").string(), ")");
  const json version = state.value("version", json());
  BOOSTER_CHECK(version.is_number_integer() && version.get<int64_t>() >= kOldestStateFormatVersion &&
                    version.get<int64_t>() <= kStateFormatVersion,
                CheckpointError, context, ": ", file.string(), " has format version ", show(version),
                "; this build reads versions ", kOldestStateFormatVersion, " to ", kStateFormatVersion);
  for (const char* key : {"step", "dataloader", "rng", "mixed_precision", "plugin", "world_size", "state"})
    BOOSTER_CHECK(state.contains(key), CheckpointError, context, ": ", file.string(), " lacks \"", key,
                  "\"; the checkpoint is truncated or corrupt");
  BOOSTER_CHECK(state.at("rng").is_object() && state.at("state").is_object() &&
                    state.value("settings", json::object()).is_object(),
                CheckpointError, context, ": ", file.string(), " is malformed (\"rng\", \"state\" and \"settings\" "
                "must be objects); the checkpoint is corrupt");
  return state;
}

// Note [Resuming across layouts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A plugin that leaves checkpoint IO to the Booster and splits no layer (single, ddp) writes what one
// process would: the full model, the full optimizer state, the loader's position in batches. Such a
// checkpoint resumes under any such plugin at any world size, provided the run is the same once
// per-rank settings are made global (LoadStateOptions::portable_settings: `booster train` makes
// data.batch_size the global batch and drops the plugin section). With the same global batch every
// step sees the same samples (the shuffled order is one permutation of the whole data set for every
// world size, Note [Deterministic shuffling]; rank r takes every world-th of it), so a batch position
// means the same samples, and only the order in which gradients are summed changes, which
// LoadedState::layout_change says. trainer_state.json records "single_process_layout"; a checkpoint
// that predates it counts as one when its plugin was single or ddp. A sharded checkpoint
// (low_level_zero) still needs its own plugin and world size.
// Note [Resuming under another precision]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Strategies that keep the model's parameters in float32 without master copies (fp32, fp16 with a
// GradScaler, bf16 autocast, fp8, apex O0/O1) step the same optimizer over the same tensors: their
// checkpoints differ only in the strategy's own state (a loss scale and its counters, fp8's amax
// histories), which does not carry over from one strategy to another. With
// LoadStateOptions::precision_setting a checkpoint of one resumes under another: the model and the
// optimizer load as saved, the strategy keeps its fresh state, and LoadedState::precision_change says
// so. Checked before anything is read: this run's parameters are
// float32 and its strategy holds no master weights (the precision SDK's "master_weights.*" tensors);
// the checkpoint's model and optimizer tensors are float32 (read from the safetensors headers) and its
// strategy saved no master weights. Anything else (fp16_naive's masters, a 16-bit model) is refused,
// naming which.

// The dtypes of a safetensors file's tensors, from its header alone.
std::set<std::string> safetensors_dtypes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  BOOSTER_CHECK(in.good(), CheckpointError, "cannot open ", file.string());
  unsigned char size_bytes[8] = {};
  in.read(reinterpret_cast<char*>(size_bytes), 8);
  uint64_t size = 0;
  for (int i = 7; i >= 0; --i) size = size << 8 | size_bytes[i];
  BOOSTER_CHECK(in.good() && size < (uint64_t(1) << 27), CheckpointError, file.string(), " has no valid safetensors header");
  std::string header(size, '\0');
  in.read(header.data(), std::streamsize(size));
  const json parsed = json::parse(header, nullptr, /*allow_exceptions=*/false);
  BOOSTER_CHECK(in.good() && parsed.is_object(), CheckpointError, file.string(), " has no valid safetensors header");
  std::set<std::string> dtypes;
  for (const auto& [name, entry] : parsed.items())
    if (name != "__metadata__" && entry.is_object()) dtypes.insert(entry.value("dtype", std::string("?")));
  return dtypes;
}

// The files of a saved model: model.safetensors, or the shards its index names.
std::vector<fs::path> model_files(const fs::path& model_dir) {
  if (fs::exists(model_dir / checkpoint::kModelFileName)) return {model_dir / checkpoint::kModelFileName};
  std::vector<fs::path> files;
  const fs::path index = model_dir / checkpoint::kModelIndexFileName;
  if (!fs::exists(index)) return files;
  const json parsed = json::parse(checkpoint::read_text_file(index), nullptr, /*allow_exceptions=*/false);
  std::set<std::string> shards;
  if (parsed.is_object() && parsed.contains("weight_map") && parsed.at("weight_map").is_object())
    for (const auto& [name, shard] : parsed.at("weight_map").items())
      if (shard.is_string()) shards.insert(shard.get<std::string>());
  for (const std::string& shard : shards) files.push_back(model_dir / shard);
  return files;
}

bool single_process_layout(ParallelPlugin& plugin) {
  const ParallelLayout layout = plugin.layout();
  return !plugin.control_checkpoint_io() && layout.tensor <= 1 && layout.pipeline <= 1;
}

}  // namespace

// ------------------------------------------------------------------------------------ registration
void Booster::check_state_name(const std::string& name) const {
  BOOSTER_CHECK(!name.empty() && name.find('/') == std::string::npos, ValueError, "Booster: the state name '", name,
                "' must be non-empty and without '/'");
  BOOSTER_CHECK(!registered_.count(name), ValueError, "Booster: state '", name,
                "' is registered already; give each piece of state its own name");
}

void Booster::register_state(const std::string& name, std::function<json()> save, std::function<void(const json&)> load) {
  check_state_name(name);
  BOOSTER_CHECK(save && load, ValueError, "Booster::register_state('", name, "'): both save and load are required");
  registered_[name] = RegisteredState{std::move(save), std::move(load), nullptr, nullptr};
}

void Booster::register_tensors(const std::string& name, std::function<nn::StateDict()> save,
                               std::function<void(const nn::StateDict&)> load) {
  check_state_name(name);
  BOOSTER_CHECK(save && load, ValueError, "Booster::register_tensors('", name, "'): both save and load are required");
  registered_[name] = RegisteredState{nullptr, nullptr, std::move(save), std::move(load)};
}

void Booster::register_generator(const std::string& name, Generator& generator) {
  BOOSTER_CHECK(!name.empty() && name != "default" && name.rfind("model.", 0) != 0, ValueError,
                "Booster::register_generator: the name '", name,
                "' is taken (\"default\" and \"model.*\" are saved already); choose another");
  registered_generators_[name] = &generator;
}

std::map<std::string, Generator*> Booster::generators() const {
  std::map<std::string, Generator*> out = {{"default", &default_generator()}};
  if (user_model_)
    for (const auto& [name, gen] : user_model_->named_generators()) out["model." + name] = gen;
  for (const auto& [name, gen] : registered_generators_) out[name] = gen;
  return out;
}

int64_t Booster::step() const { return parts_.optimizer ? parts_.optimizer->steps() : 0; }

// ------------------------------------------------------------------------------------------ save
void Booster::lock_state_root(const fs::path& root) {
  if (process_group().rank() != 0) return;
  // One lock per directory however it is spelled ("runs/a", "./runs/a/"): a second flock of the same
  // root from this process would look like another program's.
  fs::path key = fs::absolute(root).lexically_normal();
  if (!key.has_filename()) key = key.parent_path();
  if (!root_locks_.count(key)) root_locks_[key] = std::make_shared<checkpoint::RootLock>(root);
}

fs::path Booster::save_state(const fs::path& root, const SaveStateOptions& options) {
  BOOSTER_CHECK(boosted_, StateError, "Booster::save_state: call boost() first; there is nothing to save yet");
  const int64_t step = options.step.value_or(this->step());
  BOOSTER_CHECK(step >= 0, ValueError, "Booster::save_state: the step is ", step, "; it must be >= 0");
  BOOSTER_CHECK(options.keep_last >= 0, ValueError, "Booster::save_state: keep_last is ", options.keep_last,
                "; 0 keeps every checkpoint, N > 0 the newest N");
  distributed::ProcessGroup& group = process_group();
  const bool writer = group.rank() == 0;
  lock_state_root(root);

  const fs::path tmp_dir = writer ? checkpoint::begin_checkpoint(root, step) : root / (step_dir_name(step) + ".tmp");
  group.barrier();
  if (parts_.model) save_model(*parts_.model, tmp_dir / "model");
  if (parts_.optimizer) save_optimizer(*parts_.optimizer, tmp_dir / "optimizer");
  if (parts_.scheduler) save_lr_scheduler(*parts_.scheduler, tmp_dir / "scheduler.json");
  if (writer) {
    json rng = json::object();
    for (const auto& [name, gen] : generators()) rng[name] = gen->state();
    json extra = json::object();
    std::vector<std::string> tensor_names;
    std::map<std::string, Tensor> tensors;
    for (const auto& [name, reg] : registered_) {
      if (reg.save_json) {
        extra[name] = reg.save_json();
        continue;
      }
      tensor_names.push_back(name);
      for (const auto& [key, t] : reg.save_tensors()) tensors[name + "/" + key] = t;
    }
    if (!tensor_names.empty()) checkpoint::write_safetensors(tmp_dir / kExtraTensorsFile, tensors);
    const json state = {{"format", kStateFormat},
                        {"version", kStateFormatVersion},
                        {"step", step},
                        {"dataloader", parts_.dataloader ? parts_.dataloader->state_dict() : json()},
                        {"rng", rng},
                        {"mixed_precision", precision_->name()},
                        {"plugin", plugin_->name()},
                        {"world_size", group.size()},
                        {"single_process_layout", single_process_layout(*plugin_)},
                        {"settings", resume_settings_},
                        {"state", extra},
                        {"tensors", tensor_names}};
    checkpoint::write_text_file_atomically(tmp_dir / checkpoint::kTrainerStateFileName, state.dump(1) + "\n");
    checkpoint::sync_directory(tmp_dir);
    checkpoint::commit_checkpoint(root, step, options.keep_last);
  }
  group.barrier();
  return root / step_dir_name(step);
}

// ------------------------------------------------------------------------------------------ load
std::optional<fs::path> Booster::find_state(const fs::path& path) {
  // A step named while caught between the renames of a replace is read from its stand-in
  // (checkpoint::resolve_checkpoint knows it).
  const fs::path named = path.lexically_normal().has_filename() ? path.lexically_normal()
                                                                : path.lexically_normal().parent_path();
  if (!fs::exists(path) && !fs::is_directory(named.string() + checkpoint::kReplacedSuffix)) return std::nullopt;
  if (fs::is_directory(path) && !fs::exists(path / checkpoint::kTrainerStateFileName) &&
      checkpoint::holds_no_checkpoint(path))
    return std::nullopt;
  return checkpoint::resolve_checkpoint(path);
}

LoadedState Booster::load_state(const fs::path& path, const LoadStateOptions& options) {
  const std::string& context = options.context;
  BOOSTER_CHECK(boosted_, StateError, context, ": call boost() first, then load the state into what it returned");
  const std::optional<fs::path> found = find_state(path);
  BOOSTER_CHECK(found || fs::exists(path), CheckpointError, context, ": ", path.string(),
                " does not exist; expected a checkpoint directory or a root of them");
  BOOSTER_CHECK(found.has_value(), CheckpointError, context, ": ", path.string(), " holds no committed checkpoint");
  const fs::path dir = *found;
  // Note [Checkpoint checksums]: every file is checked before any is parsed.
  const bool verified = options.verify && checkpoint::verify_checksums(dir) == checkpoint::ChecksumStatus::Verified;
  const json state = read_state_file(dir, context);
  if (options.verify && !verified) {
    BOOSTER_CHECK(state.at("version") != kStateFormatVersion, CheckpointError, context, ": ", dir.string(),
                  " has no ", checkpoint::kChecksumsFileName, " though its format version records one: it was "
                  "removed after the save; pass --no-verify (LoadStateOptions::verify = false) to load it unverified");
    if (process_group().rank() == 0)
      std::fprintf(stderr, "booster: warning: %s predates checksums; its files are not verified\n", dir.c_str());
  }

  auto restore_hint = [&](const std::string& where, const json& saved) {
    return options.restore_hint ? options.restore_hint(where, saved)
                                : "resume with the saved value, or start afresh without loading the state";
  };
  auto refuse_unless_same = [&](const char* what, const json& saved, const json& now, const char* fix) {
    BOOSTER_CHECK(saved == now, CheckpointError, context, ": ", dir.string(), " was saved with ", what, " ",
                  show(saved), " but this run has ", show(now), "; ", fix);
  };
  // Note [Resuming under another precision]: "" when a checkpoint of strategy `saved` can resume under
  // this one, else why not.
  auto float32_without_masters = [&](const fs::path& checkpoint_dir, const std::string& saved) -> std::string {
    auto has_masters = [](const auto& names) {
      return std::any_of(names.begin(), names.end(), [](const std::string& n) { return n.rfind("master_weights", 0) == 0; });
    };
    std::vector<std::string> names_now;
    for (const auto& [name, t] : precision_->state_dict().tensors) names_now.push_back(name);
    if (has_masters(names_now)) return "this run's strategy keeps float32 master weights";
    if (parts_.model)
      for (const auto& [name, p] : parts_.model->named_parameters())
        if (p.dtype() != DType::Float32) return "this run's parameter " + name + " is " + dtype_name(p.dtype());
    const fs::path optimizer_dir = checkpoint_dir / "optimizer";
    std::vector<std::string> names_saved;
    if (fs::exists(optimizer_dir / "precision.safetensors"))
      for (const checkpoint::TensorSpan& span : checkpoint::safetensors_spans(optimizer_dir / "precision.safetensors"))
        names_saved.push_back(span.name);
    if (has_masters(names_saved)) return saved + " saved float32 master weights";
    std::vector<fs::path> files = model_files(checkpoint_dir / "model");
    if (fs::exists(optimizer_dir / "optimizer.safetensors")) files.push_back(optimizer_dir / "optimizer.safetensors");
    for (const fs::path& file : files)
      for (const std::string& dtype : safetensors_dtypes(file))
        if (dtype != "F32" && dtype != "I64") return "its " + file.filename().string() + " holds " + dtype + " tensors";
    return "";
  };
  LoadedState loaded;
  const bool same_precision = state.at("mixed_precision") == json(precision_->name());
  if (!same_precision) {
    const char* fix = "resume with the same strategy, or start afresh";
    if (options.precision_setting.empty() || !state.at("mixed_precision").is_string())
      refuse_unless_same("mixed_precision", state.at("mixed_precision"), json(precision_->name()), fix);
    const std::string saved = state.at("mixed_precision").get<std::string>();
    const std::string why_not = float32_without_masters(dir, saved);
    BOOSTER_CHECK(why_not.empty(), CheckpointError, context, ": ", dir.string(), " was saved with mixed_precision \"",
                  saved, "\" but this run has \"", precision_->name(), "\", and ", why_not,
                  "; resume with the same strategy, or start afresh (model.init_from=", (dir / "model").string(),
                  " keeps the weights)");
    loaded.precision_change = "resumed under " + precision_->name() + " from a checkpoint of " + saved +
                              ": float32 weights and optimizer state carry over; the strategy's own state (loss "
                              "scale, fp8 scaling) starts afresh";
  }
  // Note [Resuming across layouts]
  loaded.dir = dir;
  const int world_now = process_group().size();
  const bool same_layout = state.at("plugin") == json(plugin_->name()) && state.at("world_size") == json(world_now);
  json saved_settings = state.value("settings", json::object());
  json settings_now = resume_settings_;
  if (!same_layout) {
    const bool portable_now = single_process_layout(*plugin_);
    const bool portable_saved = state.contains("single_process_layout")
                                    ? state.at("single_process_layout") == json(true)
                                    : state.at("plugin") == "single" || state.at("plugin") == "ddp";
    const char* fix = portable_now && portable_saved
                          ? "resume with the same plugin and as many processes (booster run -n N), or start afresh"
                          : "resume with the same plugin and as many processes (booster run -n N), or start afresh; "
                            "only single and ddp checkpoints move between plugins and world sizes";
    if (!options.portable_settings || !portable_now || !portable_saved || !state.at("world_size").is_number_integer() ||
        !state.at("plugin").is_string()) {
      refuse_unless_same("plugin", state.at("plugin"), json(plugin_->name()), fix);
      refuse_unless_same("world size", state.at("world_size"), json(world_now), fix);
    }
    const int world_saved = state.at("world_size").get<int>();
    saved_settings = options.portable_settings(saved_settings, world_saved);
    settings_now = options.portable_settings(settings_now, world_now);
    loaded.layout_change = "resumed on " + std::to_string(world_now) + (world_now == 1 ? " process (" : " processes (") +
                           plugin_->name() + ") from a checkpoint of " + std::to_string(world_saved) + " (" +
                           state.at("plugin").get<std::string>() +
                           "): the same samples make each step; gradients are averaged in another order";
  }

  if (!same_precision) {
    saved_settings.erase(options.precision_setting);
    settings_now.erase(options.precision_setting);
  }

  // Note [Settings a resume must keep]
  for (const auto& [key, now] : settings_now.items()) {
    if (!saved_settings.contains(key)) {
      loaded.unchecked.push_back(key);
      continue;
    }
    if (key == options.run_length_setting && saved_settings.at(key).is_number_integer() && now.is_number_integer()) {
      const int64_t saved_steps = saved_settings.at(key).get<int64_t>(), steps_now = now.get<int64_t>();
      if (steps_now <= saved_steps) continue;
      BOOSTER_FAIL(CheckpointError, context, ": ", dir.string(), " was saved with ", key, " ", saved_steps,
                   " but this run has ", steps_now, ", and its lr schedule spans the saved run's steps; a resume "
                   "continues the saved run: ", restore_hint(key, saved_settings.at(key)));
    }
    if (const auto difference = first_difference(key, saved_settings.at(key), now, loaded.unchecked)) {
      const SettingDifference& d = *difference;
      BOOSTER_CHECK(d.known_now, CheckpointError, context, ": ", dir.string(), " was saved with ", d.where, " ",
                    show(d.saved), ", a setting this build does not have; resume with the version that saved it, or "
                    "start afresh (the weights are in ", (dir / "model").string(), ")");
      BOOSTER_FAIL(CheckpointError, context, ": ", dir.string(), " was saved with ", d.where, " ", show(d.saved),
                   " but this run has ", show(d.now), "; a resume continues the saved run: ",
                   restore_hint(d.where, d.saved));
    }
  }
  for (const auto& [name, reg] : registered_) {
    const bool is_tensors = reg.load_tensors != nullptr;
    const json saved_tensors = state.value("tensors", json::array());
    const bool saved = is_tensors ? std::find(saved_tensors.begin(), saved_tensors.end(), json(name)) !=
                                        saved_tensors.end()
                                  : state.at("state").contains(name);
    BOOSTER_CHECK(saved, CheckpointError, context, ": ", dir.string(), " has no registered ",
                  is_tensors ? "tensors" : "state", " '", name,
                  "'; it was saved by a program that did not register it");
  }
  const std::map<std::string, Generator*> gens = generators();
  for (const auto& [name, gen] : gens)
    BOOSTER_CHECK(state.at("rng").contains(name), CheckpointError, context, ": ", dir.string(),
                  " has no state of the random generator '", name, "'; the checkpoint is from another model or program");
  const bool saved_scheduler = fs::exists(dir / "scheduler.json");
  BOOSTER_CHECK(saved_scheduler == bool(parts_.scheduler), CheckpointError, context, ": ", dir.string(),
                saved_scheduler ? " has an lr scheduler state but this run has no scheduler"
                                : " has no lr scheduler state but this run has a scheduler",
                "; resume with the lr scheduler the checkpoint was trained with");
  BOOSTER_CHECK(state.at("dataloader").is_null() || parts_.dataloader, CheckpointError, context, ": ", dir.string(),
                " has a dataloader position but boost() was given no dataloader; pass the same parts as the saved run");

  // Everything checked: restore.
  if (parts_.model) load_model(*parts_.model, dir / "model");
  if (parts_.optimizer) load_optimizer(*parts_.optimizer, dir / "optimizer", same_precision);
  if (parts_.scheduler) load_lr_scheduler(*parts_.scheduler, dir / "scheduler.json");
  if (parts_.dataloader && !state.at("dataloader").is_null()) parts_.dataloader->load_state_dict(state.at("dataloader"));
  try {
    for (const auto& [name, gen] : gens) gen->set_state(state.at("rng").at(name).get<std::vector<uint64_t>>());
    loaded.step = state.at("step").get<int64_t>();
  } catch (const json::exception& e) {
    BOOSTER_FAIL(CheckpointError, context, ": the rng state or step in ", dir.string(), " is malformed (", e.what(), ")");
  }
  std::map<std::string, Tensor> extra_tensors;
  if (fs::exists(dir / kExtraTensorsFile)) extra_tensors = checkpoint::read_safetensors(dir / kExtraTensorsFile).tensors;
  for (const auto& [name, reg] : registered_) {
    if (reg.load_json) {
      reg.load_json(state.at("state").at(name));
      continue;
    }
    nn::StateDict tensors;
    const std::string prefix = name + "/";
    for (const auto& [key, t] : extra_tensors)
      if (key.rfind(prefix, 0) == 0) tensors[key.substr(prefix.size())] = t;
    reg.load_tensors(tensors);
  }
  if (parts_.optimizer) parts_.optimizer->set_steps(loaded.step);
  return loaded;
}

}  // namespace booster
