// Booster::save_state / load_state: the whole state of a boosted training loop in one atomic checkpoint.
//
// Note [Booster state]
// ~~~~~~~~~~~~~~~~~~~~
// A checkpoint is a step directory of a root laid out as Note [Checkpoint directory layout]
// (checkpoint.h) says: `<root>/step-XXXXXXXX/` plus `latest`. Its content is written through the
// Booster's checkpoint IO, so the plugin decides how (a sharded optimizer gathers; rank 0 writes):
//   model/                 Booster::save_model (model.safetensors, or shards + index)
//   optimizer/             Booster::save_optimizer (the optimizer's state and the strategy's: loss
//                          scale, float32 master weights; it names the strategy). optimizer.json holds
//                          torch's meta plus "param_names", the parameter of each index
//                          "state.<i>", as one process holds it (a sharded optimizer gathers)
//   scheduler.json         Booster::save_lr_scheduler (when boost() was given a scheduler)
//   extra.safetensors      the registered tensors, as "<name>/<key>" (when any are registered)
//   trainer_state.json     {"format": "booster-state", "version", "step": the boosted optimizer's steps,
//                           "dataloader": its position and epoch (null without one), "rng": {name: state}
//                           ("default", "model.<path>" for the model's generators, registered names),
//                           "mixed_precision", "precision" (its label, Note [Resuming under another
//                           precision]), "plugin", "plugin_options", "world_size", "portable_layout",
//                           "settings": Note [Settings a resume must keep], "state": {name: the
//                           registered JSON}, "tensors": [names]}
// Everything goes into `step-N.tmp/` first; rank 0 then fsyncs and renames it to `step-N/` (the commit),
// points `latest` at it and prunes to keep_last, so at every moment `latest` names a whole checkpoint
// (checkpoint::begin_checkpoint / commit_checkpoint). On load, trainer_state.json is read first and a
// checkpoint with other settings is refused before any tensor is read, as is one of another plugin,
// world size or strategy unless the caller allows the move (Note [Resuming across layouts], Note
// [Resuming under another precision]). Loading restores every piece, so the loop continues bit for bit
// as if never stopped.
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
#include <cstdio>
#include <fstream>
#include <functional>
#include <regex>
#include <set>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/checksums.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/common/json_text.h"
#include "booster/data/dataloader.h"
#include "booster/distributed/process_group.h"
#include "booster/ops/ops.h"

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

// The LoRA settings a checkpoint records (Note [Adapter-only checkpoints]); the seed only made A's start.
json lora_json(const nn::LoraConfig& c) {
  return {{"r", c.r}, {"alpha", c.alpha}, {"dropout", c.dropout}, {"target_modules", c.target_modules},
          {"use_rslora", c.use_rslora}};
}

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
    // Note [One JSON reader] (booster/common/json_text.h).
    state = parse_json_text(checkpoint::read_text_file(file), "checkpoint file " + file.string(),
                            checkpoint_limits());
  } catch (const JsonSyntaxError& e) {
    BOOSTER_FAIL(CheckpointError, context, ": ", file.string(), " is not valid JSON (", e.detail(),
                 "); the checkpoint is truncated or corrupt");
  } catch (const ConfigError& e) {
    BOOSTER_FAIL(CheckpointError, context, ": ", e.what());
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
// A plugin that splits no layer (single, ddp, low_level_zero) writes what one process would: the full
// model, the optimizer state per parameter in the unsharded optimizer's layout ("state.<i>.<name>" in
// the parameter's shape; ZeRO gathers its shards, Note [ZeRO partitions]), the loader's position in
// batches. Such a checkpoint resumes under any such plugin at any world size (a ZeRO optimizer takes
// its shard of the full state), provided the run is the same once per-rank settings are made global
// (LoadStateOptions::portable_settings: `booster train` makes data.batch_size the global batch and
// keeps of the plugin section only what changes the numbers). With the same global batch every step
// sees the same samples (the shuffled order is one permutation of the whole data set for every world
// size, Note [Deterministic shuffling]; rank r takes every world-th of it), so a batch position means
// the same samples, and only the order in which gradients are summed changes, which
// LoadedState::layout_change says. trainer_state.json records "portable_layout" (written as
// "single_process_layout" before low_level_zero joined); a checkpoint that records neither counts as
// one when its plugin was single, ddp or low_level_zero, whose files have always had this layout.
// Note [Resuming under another precision]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A strategy is named with the precision a plugin controls ("low_level_zero (bf16)"); when the names
// differ, the checkpoint is read whole and handed over by optimizer parameter index (the index
// torch's optimizer state uses; the same model and optimizer give the same order, and the saved
// "param_names" are checked against this run's):
//   * the float32 weights: the saved float32 masters where the strategy kept them (ZeRO's
//     "state.<i>.master_weight", the precision SDK's "master_weights.<g>.<j>"), else the model's own
//     parameters, which must then be float32 (a 16-bit model without masters has lost them: refused);
//   * this run takes them as its masters if it keeps any (in its optimizer's state or its strategy's)
//     and as its parameters, rounded to their dtype; a 16-bit model stepped without masters (apex O3)
//     is refused, it could not continue the float32 weights;
//   * the optimizer's moments and step counts load as saved;
//   * the strategy's own state (a loss scale and its counters, fp8's amax histories) starts afresh,
//     and LoadedState::precision_change says so.
// Everything is read and checked before anything is loaded.

bool portable_layout(ParallelPlugin& plugin) {
  const ParallelLayout layout = plugin.layout();
  return !plugin.control_checkpoint_io() && layout.tensor <= 1 && layout.pipeline <= 1;
}

// The strategy's name with the options that choose its dtypes: "low_level_zero (bf16)" (a plugin's
// precision), "fp16_apex O2", "bf16 pure".
std::string precision_label(const std::string& name, const json& options) {
  std::string label = name;
  if (!options.is_object()) return label;
  if (options.contains("precision") && options.at("precision").is_string())
    label += " (" + options.at("precision").get<std::string>() + ")";
  if (options.contains("opt_level") && options.at("opt_level").is_string())
    label += " " + options.at("opt_level").get<std::string>();
  if (options.value("pure", json(false)) == json(true)) label += " pure";
  return label;
}

// "low_level_zero stage 2" for a plugin whose options name a stage, else the plugin's name.
std::string plugin_label(const std::string& name, const json& options) {
  if (options.is_object() && options.contains("stage") && options.at("stage").is_number_integer())
    return name + " stage " + std::to_string(options.at("stage").get<int>());
  return name;
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

// Note [Adapter-only checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With LoRA (enable_lora) the base is frozen: it is the same at every step, so a checkpoint's model/
// holds only the modules with a parameter that trains (lora_A and lora_B of each adapted Linear, plus
// any module a program unfroze itself), under the whole model's names, and optimizer/ the state of the
// adapters, which are all the optimizer holds (boost() refuses an optimizer with a frozen parameter).
// The base it was trained on is named by a digest of its frozen parameters (Booster::base_digest: their
// names, dtypes, shapes and bytes as boost() was given them, before a strategy converts them, so the
// digest does not depend on the precision or the plugin), saved in trainer_state.json as
// "lora": {"config": {...}, "base_digest": "..."}. load_state refuses a checkpoint whose digest differs
// from this run's base (another model.init_from, seed or family), naming both digests, one of another
// LoRA config naming the key, and a full checkpoint into a LoRA run or the other way round; then it loads
// the adapters into the same module tree, so a resume continues bit for bit as a full one does. The
// model's buffers are the base's and are not saved (a model whose buffers train, batch norm's running
// statistics, is no LoRA target). The tree shares the model's modules, so under ZeRO-3 the checkpoint
// IO gathers the adapters' shards into it as it gathers a whole model's.
nn::ModulePtr Booster::adapter_view() const {
  auto root = std::make_shared<nn::Module>();
  std::map<std::string, nn::ModulePtr> nodes = {{"", root}};
  // The node of `path` in the view, made with its ancestors on first use.
  std::function<nn::ModulePtr(const std::string&)> node = [&](const std::string& path) -> nn::ModulePtr {
    if (auto it = nodes.find(path); it != nodes.end()) return it->second;
    const size_t dot = path.rfind('.');
    nn::ModulePtr parent = node(dot == std::string::npos ? "" : path.substr(0, dot));
    auto made = std::make_shared<nn::Module>();
    parent->add_module(dot == std::string::npos ? path : path.substr(dot + 1), made);
    return nodes[path] = made;
  };
  std::function<void(const nn::ModulePtr&, const std::string&)> walk = [&](const nn::ModulePtr& m,
                                                                          const std::string& path) {
    for (const auto& [name, child] : m->named_children()) {
      const std::string child_path = path.empty() ? name : path + "." + name;
      bool trains = false;
      for (const auto& [pname, p] : child->named_parameters(/*recurse=*/false)) trains |= p.requires_grad();
      if (trains) {
        node(path)->add_module(name, child);  // the module whole, with its children
        continue;
      }
      walk(child, child_path);
    }
  };
  // Under a plugin that splits layers the adapters that train are the split model's (this rank's pieces
  // and stage, named as the whole model's; its checkpoint IO gathers them): Note [LoRA under tensor
  // parallelism] in nn/lora.cpp.
  const ParallelLayout layout = plugin_->layout();
  walk(layout.tensor > 1 || layout.pipeline > 1 ? parts_.model : user_model_, "");
  return root;
}

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
  if (parts_.model) save_model(lora_ ? *adapter_view() : *parts_.model, tmp_dir / "model");  // Note [Adapter-only checkpoints]
  if (parts_.optimizer) save_optimizer(*parts_.optimizer, tmp_dir / "optimizer");
  if (parts_.scheduler) save_lr_scheduler(*parts_.scheduler, tmp_dir / "scheduler.json");
  json rng = json::object();
  for (const auto& [name, gen] : generators()) rng[name] = gen->state();
  if (splits_model()) {  // Note [Per-rank state of a split model]: each rank's generators, before the commit
    checkpoint::write_text_file_atomically(tmp_dir / rank_file("rng", ".json"), rng.dump() + "\n");
    group.barrier();
  }
  if (writer) {
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
    json state = {{"format", kStateFormat},
                        {"version", kStateFormatVersion},
                        {"step", step},
                        {"dataloader", parts_.dataloader ? parts_.dataloader->state_dict() : json()},
                        {"rng", rng},
                        {"mixed_precision", precision_->name()},
                        {"precision", precision_label(precision_->name(), precision_->options())},
                        {"plugin", plugin_->name()},
                        {"plugin_options", plugin_->options()},
                        {"world_size", group.size()},
                        {"portable_layout", portable_layout(*plugin_)},
                        {"settings", resume_settings_},
                        {"state", extra},
                        {"tensors", tensor_names}};
    if (lora_) state["lora"] = {{"config", lora_json(*lora_)}, {"base_digest", lora_base_digest_}};
    checkpoint::write_text_file_atomically(tmp_dir / checkpoint::kTrainerStateFileName, state.dump(1) + "\n");
    if (options.commit) {
      checkpoint::sync_directory(tmp_dir);
      checkpoint::commit_checkpoint(root, step, options.keep_last);
    }
  }
  // commit = false: the caller commits once every rank's files are written (Note [Asynchronous
  // checkpoints] in trainer/async_save.h).
  if (!options.commit) return root / step_dir_name(step);
  group.barrier();
  return root / step_dir_name(step);
}

// ------------------------------------------------------------------------------------------ load
// Note [Adapter-only checkpoints]: a checkpoint's "lora" against this run's, before anything loads.
void Booster::check_lora_state(const json& state, const fs::path& dir, const std::string& context) const {
  const json saved_lora = state.value("lora", json());
  BOOSTER_CHECK(saved_lora.is_object() == lora_.has_value(), CheckpointError, context, ": ", dir.string(),
                saved_lora.is_object()
                    ? " holds LoRA adapters only, but this run trains the whole model; resume with the lora settings "
                      "it was saved with (" + saved_lora.value("config", json()).dump() + ")"
                    : " is a checkpoint of the whole model, but this run trains LoRA adapters; resume without lora, "
                      "or start the adapters afresh on its weights (model.init_from=" + (dir / "model").string() + ")");
  if (lora_) {
    const json config_now = lora_json(*lora_), config_saved = saved_lora.value("config", json::object());
    std::vector<std::string> ignored;
    if (const auto d = first_difference("lora", config_saved, config_now, ignored))
      BOOSTER_FAIL(CheckpointError, context, ": ", dir.string(), " was saved with ", d->where, " ", show(d->saved),
                   " but this run has ", show(d->now), "; a resume continues the saved adapters: resume with --set ",
                   d->where, "=", show(d->saved));
    const json digest = saved_lora.value("base_digest", json());
    BOOSTER_CHECK(digest == json(lora_base_digest_), CheckpointError, context, ": ", dir.string(),
                  " holds adapters trained on a base whose digest is ", show(digest), " but this run's base has ",
                  show(json(lora_base_digest_)), "; resume on the base it was trained on (the same model section, "
                  "model.init_from and train.seed)");
  }

}

void Booster::load_adapters(const fs::path& step_dir, const std::string& context) {
  BOOSTER_CHECK(boosted_ && lora_, StateError, context, ": load_adapters needs a LoRA model (enable_lora) boosted first");
  checkpoint::verify_checksums(step_dir);  // Note [Checkpoint checksums]: a damaged file names itself
  const json state = read_state_file(step_dir, context);
  check_lora_state(state, step_dir, context);
  load_model(*adapter_view(), step_dir / "model");
}

// Note [Falling back from a damaged checkpoint]
// A root resumes from its newest step that passes its checksums: the one `latest` names, else each
// committed step from the newest down (checkpoint::checkpoint_candidates). A step that fails them (a
// flipped byte, a truncated or missing file) is passed over with one warning naming the file and
// tensor, and left as it is on disk: a later save of the same step keeps it beside as step-N.damaged
// instead of replacing it (commit_checkpoint). With no step passing, the error names the newest one's
// damage. A `latest` naming a step that is gone stays the error it was (it lists the steps there), and
// a step directory named explicitly is loaded or refused as it is: no fallback.
//
// Note [Ranks resume from one step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With several processes each rank looks in its own view of the root: per-host copies of it, or a
// file damaged only in one host's copy or cache, can make ranks find different newest steps, and
// ranks that load different steps train on from different states without a word. So load_state
// exchanges every rank's newest step that passes its checksums (one all-reduce of one int64 per rank)
// and every rank resumes from the oldest of them: a rank whose own is newer looks again at or below
// it (verifying the older steps it had not reached), and the exchange repeats until the ranks agree,
// which in the usual case (one shared root) is the first time. Rank 0 names the steps passed over and
// the rank that made them so; a rank's damage that rank 0 did not see is named by that rank. A rank
// that finds nothing it can load (no step passes, or a `latest` naming a step that is gone) fails
// every rank, each naming that rank, rather than leaving the others waiting in the next collective.
namespace {

// The step of a step directory (step-XXXXXXXX, or its .replaced stand-in); -1 for any other name.
int64_t step_of_dir(const fs::path& dir) {
  static const std::regex name(R"(step-(\d{8})(\.replaced)?)");
  std::smatch m;
  const std::string base = dir.filename().string();
  return std::regex_match(base, m, name) ? std::stoll(m[1].str()) : -1;
}

// The first of `candidates` (best first) at or below step `at_most` (-1: any) that passes its
// checksums (a step that lost its checksums.json does not: checkpoint::verify_step); the failures
// before it go to `damaged`.
std::optional<fs::path> first_passing(const std::vector<fs::path>& candidates, int64_t at_most,
                                      std::vector<std::string>& damaged) {
  for (const fs::path& dir : candidates) {
    if (at_most >= 0 && step_of_dir(dir) > at_most) continue;
    try {
      checkpoint::verify_step(dir);
    } catch (const CheckpointError& e) {
      damaged.push_back(e.what());
      continue;
    }
    return dir;
  }
  return std::nullopt;
}

}  // namespace

namespace {

// find_state, with the damage of the steps passed over (file and tensor) in `damaged`.
std::optional<fs::path> find_newest(const fs::path& path, bool verify, std::vector<std::string>& damaged) {
  // A step named while caught between the renames of a replace is read from its stand-in
  // (checkpoint::resolve_checkpoint knows it).
  const fs::path named = path.lexically_normal().has_filename() ? path.lexically_normal()
                                                                : path.lexically_normal().parent_path();
  if (!fs::exists(path) && !fs::is_directory(named.string() + checkpoint::kReplacedSuffix)) return std::nullopt;
  if (!fs::is_directory(path) || fs::exists(path / checkpoint::kTrainerStateFileName))
    return checkpoint::resolve_checkpoint(path);
  if (checkpoint::holds_no_checkpoint(path)) return std::nullopt;
  const std::vector<fs::path> candidates = checkpoint::checkpoint_candidates(path);
  if (!verify || candidates.empty()) return checkpoint::resolve_checkpoint(path);  // or its error
  checkpoint::resolve_checkpoint(path);  // a `latest` naming a step that is gone stays an error
  if (std::optional<fs::path> dir = first_passing(candidates, -1, damaged)) return dir;
  BOOSTER_FAIL(CheckpointError, "no checkpoint in ", path.string(), " passes its checksums: ", damaged.front(),
               damaged.size() > 1 ? str(" (and ", damaged.size() - 1, " more)") : std::string());
}

std::string passed_over_line(const std::string& damage, const fs::path& dir) {
  return str(damage, "; resuming from ", dir.string(), " instead, the damaged step left as it is");
}

}  // namespace

std::optional<fs::path> Booster::find_state(const fs::path& path, std::vector<std::string>* passed_over, bool verify) {
  std::vector<std::string> damaged;
  std::optional<fs::path> dir = find_newest(path, verify, damaged);
  if (passed_over && dir)
    for (const std::string& d : damaged) passed_over->push_back(passed_over_line(d, *dir));
  return dir;
}

// Note [Ranks resume from one step]: find_state on every rank, and the step they all load.
std::optional<fs::path> Booster::agree_on_state(const fs::path& path, const LoadStateOptions& options) {
  distributed::ProcessGroup& group = process_group();
  const int world = group.size(), me = group.rank();
  constexpr int64_t kNothing = -2;  // find_state found nothing there (the caller's errors follow)
  constexpr int64_t kFailed = -3;   // no step this rank can load: `failure` says why
  constexpr int64_t kUnnumbered = -1;  // a directory named explicitly, not step-XXXXXXXX: loaded as named
  const bool fallback =
      options.verify && fs::is_directory(path) && !fs::exists(path / checkpoint::kTrainerStateFileName);
  std::vector<std::string> damaged;
  std::optional<fs::path> found;
  std::string failure;
  try {
    found = find_newest(path, options.verify, damaged);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // A rank that cannot fall back (a step named, --no-verify) takes no part in choosing a step: it
  // contributes no step number, so every rank loads what it found.
  auto code = [&] {
    return !failure.empty() ? kFailed : !found ? kNothing : fallback ? step_of_dir(*found) : kUnnumbered;
  };
  // Every rank's code, in rank order: one all-reduce (a sum of one slot each).
  auto exchange = [&](int64_t mine) {
    std::vector<int64_t> slots(size_t(world), 0);
    slots[size_t(me)] = mine;
    Tensor t = from_vector(slots, {int64_t(world)}).to(group.device());
    group.all_reduce(t);
    const Tensor host = t.cpu().contiguous();
    return std::vector<int64_t>(host.data<int64_t>(), host.data<int64_t>() + world);
  };
  std::vector<int64_t> first;  // what each rank found on its own
  std::vector<std::string> agreed;  // this rank's lines about steps passed over for another rank
  for (;;) {
    const std::vector<int64_t> all = exchange(code());
    if (first.empty()) first = all;
    for (int r = 0; r < world; ++r) {
      if (all[size_t(r)] != kFailed) continue;
      BOOSTER_CHECK(r != me, CheckpointError, options.context, ": rank ", r, " of ", world, ": ", failure,
                    "; every rank must resume from the same step, so none does");
      BOOSTER_FAIL(CheckpointError, options.context, ": rank ", r, " of ", world, " finds no checkpoint it can load in "
                   "its checkpoint directory (its own message says why); every rank must resume from the same step, "
                   "so none does: give every rank a root holding a step that passes its checksums");
    }
    const bool none = std::find(all.begin(), all.end(), kNothing) != all.end();
    if (none) {
      const bool every = std::count(all.begin(), all.end(), kNothing) == world;
      if (every) break;  // nothing saved anywhere: the caller's own error or fresh start
      const int r = int(std::find(all.begin(), all.end(), kNothing) - all.begin());
      BOOSTER_FAIL(CheckpointError, options.context, ": rank ", r, " of ", world, " finds no checkpoint in ",
                   r == me ? path.string() : std::string("its checkpoint directory"), " while other ranks do; every "
                   "rank must resume from the same step, so none does: give every rank the same checkpoints");
    }
    if (std::find(all.begin(), all.end(), kUnnumbered) != all.end()) break;
    const int64_t oldest = *std::min_element(all.begin(), all.end());
    if (std::count(all.begin(), all.end(), oldest) == world) break;
    const int lowest = int(std::find(all.begin(), all.end(), oldest) - all.begin());
    const int64_t mine = code();
    if (mine <= oldest) continue;
    // Rank `lowest` can load nothing newer: look again at or below its step.
    agreed.push_back(str(me == 0 ? "" : str("rank ", me, ": "), found->string(), " passes its checksums, but rank ",
                         lowest, " of ", world, " has no step newer than ", oldest, " that does (its own warning "
                         "says why); every rank resumes from the same step, so this one is passed over"));
    std::vector<std::string> older_damage;
    try {
      found = first_passing(checkpoint::checkpoint_candidates(path), oldest, older_damage);
      if (!found)
        failure = str("no checkpoint in ", path.string(), " at or below step ", oldest, " (rank ", lowest,
                      "'s newest) passes its checksums", older_damage.empty() ? "" : ": " + older_damage.front());
    } catch (const std::exception& e) {
      failure = e.what();
    }
    for (std::string& d : older_damage) damaged.push_back(std::move(d));
  }
  // Rank 0 names the damage it passed over; another rank names damage only it saw (its newest step
  // differed from rank 0's). Each rank names a good step it passed over for another rank.
  const bool own_view = me == 0 || first[size_t(me)] != first[0];
  if (own_view && found)
    for (const std::string& d : damaged)
      std::fprintf(stderr, "booster: warning: %s%s\n", me == 0 ? "" : str("rank ", me, ": ").c_str(),
                   passed_over_line(d, *found).c_str());
  for (const std::string& line : agreed) std::fprintf(stderr, "booster: warning: %s\n", line.c_str());
  return found;
}

LoadedState Booster::load_state(const fs::path& path, const LoadStateOptions& options) {
  const std::string& context = options.context;
  BOOSTER_CHECK(boosted_, StateError, context, ": call boost() first, then load the state into what it returned");
  std::vector<std::string> passed_over;
  const std::optional<fs::path> found =
      process_group().size() > 1 ? agree_on_state(path, options) : find_state(path, &passed_over, options.verify);
  if (process_group().rank() == 0)
    for (const std::string& line : passed_over) std::fprintf(stderr, "booster: warning: %s\n", line.c_str());
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
  LoadedState loaded;
  // Note [Resuming under another precision]. A checkpoint that predates the labels names its strategy
  // only, and is compared by name.
  BOOSTER_CHECK(state.at("mixed_precision").is_string() && state.at("plugin").is_string(), CheckpointError, context,
                ": ", dir.string(), " names its strategy or plugin malformed; the checkpoint is corrupt");
  const bool labelled = state.contains("precision") && state.at("precision").is_string();
  const std::string saved_precision = labelled ? state.at("precision").get<std::string>()
                                               : state.at("mixed_precision").get<std::string>();
  const std::string precision_now =
      labelled ? precision_label(precision_->name(), precision_->options()) : precision_->name();
  const bool same_precision = saved_precision == precision_now;
  if (!same_precision) {
    if (options.precision_setting.empty())
      refuse_unless_same("mixed_precision", json(saved_precision), json(precision_now),
                         "resume with the same strategy, or start afresh");
    loaded.precision_change = "resumed under " + precision_now + " from a checkpoint of " + saved_precision +
                              ": float32 weights and optimizer state carry over; the strategy's own state (loss "
                              "scale, fp8 scaling) starts afresh";
  }
  // Note [Resuming across layouts]
  loaded.dir = dir;
  const int world_now = process_group().size();
  const json plugin_settings_saved = state.value("settings", json::object()).value("plugin", json());
  const json plugin_settings_now = resume_settings_.is_object() ? resume_settings_.value("plugin", json()) : json();
  // A plugin's "stage" (ZeRO's) says where state lives: another stage is another layout. The plugin's
  // other settings are compared as settings, below.
  auto stage_of = [](const json& plugin_settings) {
    return plugin_settings.is_object() ? plugin_settings.value("stage", json()) : json();
  };
  const bool same_layout = state.at("plugin") == json(plugin_->name()) && state.at("world_size") == json(world_now) &&
                           (!plugin_settings_saved.is_object() || stage_of(plugin_settings_saved) == stage_of(plugin_settings_now));
  json saved_settings = state.value("settings", json::object());
  json settings_now = resume_settings_;
  if (!same_layout) {
    const std::string plugin_saved = state.at("plugin").get<std::string>();
    const bool portable_now = portable_layout(*plugin_);
    // Before "portable_layout": "single_process_layout" (true for single and ddp; low_level_zero, then
    // false, always wrote the same files), else the plugin's name.
    const bool portable_saved =
        state.contains("portable_layout") ? state.at("portable_layout") == json(true)
        : plugin_saved == "single" || plugin_saved == "ddp" || plugin_saved == "low_level_zero"
            ? true
            : state.value("single_process_layout", json(false)) == json(true);
    const char* fix = portable_now && portable_saved
                          ? "resume with the same plugin and as many processes (booster run -n N), or start afresh"
                          : "resume with the same plugin and as many processes (booster run -n N), or start afresh; "
                            "only checkpoints of plugins that split no layer (single, ddp, low_level_zero) move "
                            "between plugins and world sizes";
    if (!options.portable_settings || !portable_now || !portable_saved || !state.at("world_size").is_number_integer()) {
      refuse_unless_same("plugin", state.at("plugin"), json(plugin_->name()), fix);
      refuse_unless_same("world size", state.at("world_size"), json(world_now), fix);
      refuse_unless_same("plugin stage", stage_of(plugin_settings_saved), stage_of(plugin_settings_now), fix);
    }
    const int world_saved = state.at("world_size").get<int>();
    saved_settings = options.portable_settings(saved_settings, world_saved);
    settings_now = options.portable_settings(settings_now, world_now);
    // Across plugins their sections hold different options; what they share that changes the numbers
    // (the precision) is compared as the strategy.
    if (plugin_saved != plugin_->name()) {
      saved_settings.erase("plugin");
      settings_now.erase("plugin");
    }
    const json plugin_options_saved = state.value("plugin_options", plugin_settings_saved);
    loaded.layout_change = "resumed on " + std::to_string(world_now) + (world_now == 1 ? " process (" : " processes (") +
                           plugin_label(plugin_->name(), plugin_->options()) + ") from a checkpoint of " +
                           std::to_string(world_saved) + " (" + plugin_label(plugin_saved, plugin_options_saved) +
                           "): the same samples make each step; gradients are averaged in another order";
  }

  if (!same_precision) {
    for (json* settings : {&saved_settings, &settings_now}) {
      settings->erase(options.precision_setting);
      if (settings->contains("plugin") && settings->at("plugin").is_object()) (*settings)["plugin"].erase("precision");
    }
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

  check_lora_state(state, dir, context);  // Note [Adapter-only checkpoints]

  // Everything checked: restore.
  if (same_precision) {
    if (parts_.model) load_model(lora_ ? *adapter_view() : *parts_.model, dir / "model");
    if (parts_.optimizer) load_optimizer(*parts_.optimizer, dir / "optimizer");
  } else {
    const std::string refusal = str(context, ": ", dir.string(), " was saved with mixed_precision \"", saved_precision,
                                    "\" but this run has \"", precision_now, "\", and ");
    HandOver handover = read_hand_over(dir, refusal);
    apply_hand_over(handover);
  }
  if (parts_.scheduler) load_lr_scheduler(*parts_.scheduler, dir / "scheduler.json");
  if (parts_.dataloader && !state.at("dataloader").is_null()) parts_.dataloader->load_state_dict(state.at("dataloader"));
  try {
    json rng = state.at("rng");
    if (splits_model()) {  // Note [Per-rank state of a split model]
      const fs::path mine = dir / rank_file("rng", ".json");
      BOOSTER_CHECK(fs::exists(mine), CheckpointError, context, ": ", mine.string(), " does not exist; a checkpoint of ",
                    "a split model resumes with the same layout");
      rng = parse_json_as<CheckpointError>(checkpoint::read_text_file(mine), "checkpoint file " + mine.string(),
                                           str(context, ": ", mine.string(), " is not valid JSON: "),
                                           checkpoint_limits());
    }
    for (const auto& [name, gen] : gens) gen->set_state(rng.at(name).get<std::vector<uint64_t>>());
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

// ----------------------------------------------------------------- Note [Resuming under another precision]
namespace {
// "master_weights.<g>.<j>" (the precision SDK's masters) -> g and j.
bool split_master_key(const std::string& key, size_t& group, size_t& index) {
  const std::string prefix = "master_weights.";
  if (key.rfind(prefix, 0) != 0) return false;
  const size_t dot = key.find('.', prefix.size());
  if (dot == std::string::npos) return false;
  const std::string g = key.substr(prefix.size(), dot - prefix.size()), j = key.substr(dot + 1);
  for (const std::string& digits : {g, j})
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return false;
  group = std::stoul(g);
  index = std::stoul(j);
  return true;
}

std::vector<Tensor> flat_params(const optim::Optimizer& optimizer, std::vector<size_t>* group_sizes = nullptr) {
  std::vector<Tensor> params;
  for (const optim::ParamGroup& g : optimizer.param_groups()) {
    if (group_sizes) group_sizes->push_back(g.params.size());
    params.insert(params.end(), g.params.begin(), g.params.end());
  }
  return params;
}

std::string show_sizes(const std::vector<size_t>& sizes) {
  json out = json::array();
  for (size_t size : sizes) out.push_back(size);
  return out.dump();
}
}  // namespace

nn::StateDict Booster::read_master_weights(const fs::path& step_dir) {
  const fs::path dir = step_dir / "optimizer";
  const fs::path meta_file = dir / "optimizer.json", tensor_file = dir / "optimizer.safetensors";
  nn::StateDict out;
  if (!fs::exists(meta_file)) return out;
  const json meta = parse_json_as<CheckpointError>(
      checkpoint::read_text_file(meta_file), "checkpoint file " + meta_file.string(),
      meta_file.string() + " is not valid JSON; the checkpoint is corrupt: ", checkpoint_limits());
  BOOSTER_CHECK(meta.is_object() && meta.contains("param_groups") && meta.at("param_groups").is_array(),
                CheckpointError, meta_file.string(), " is not an optimizer state; the checkpoint is corrupt");
  const json names = meta.value("param_names", json());
  if (!names.is_array()) return out;  // a checkpoint too old to name its parameters: no masters are used
  std::vector<size_t> first(1, 0);
  for (const json& g : meta.at("param_groups"))
    first.push_back(first.back() + (g.is_object() && g.contains("params") && g.at("params").is_array() ? g.at("params").size() : 0));
  auto name_of = [&](size_t i) -> std::string {
    BOOSTER_CHECK(i < names.size() && names[i].is_string(), CheckpointError, meta_file.string(),
                  " names no parameter ", i, " but the checkpoint holds its master weight; the checkpoint is corrupt");
    return names[i].get<std::string>();
  };
  auto take = [&](size_t i, const Tensor& t, const fs::path& file) {
    BOOSTER_CHECK(t.dtype() == DType::Float32, CheckpointError, "the master weight of '", name_of(i), "' in ",
                  file.string(), " is ", dtype_name(t.dtype()), ", not float32; the checkpoint is corrupt");
    out.emplace(name_of(i), t);
  };
  if (fs::exists(tensor_file))
    for (const auto& [key, t] : checkpoint::read_safetensors(tensor_file).tensors) {
      size_t i = 0;
      std::string name;
      if (optim::parse_state_key(key, i, name) && name == optim::kMasterWeight) take(i, t, tensor_file);
    }
  const fs::path precision_file = dir / "precision.safetensors";
  if (fs::exists(precision_file))
    for (const auto& [key, t] : checkpoint::read_safetensors(precision_file).tensors) {
      size_t g = 0, j = 0;
      if (split_master_key(key, g, j) && g + 1 < first.size() && first[g] + j < first[g + 1] &&
          !out.count(name_of(first[g] + j)))
        take(first[g] + j, t, precision_file);
    }
  return out;
}

nn::StateDict Booster::read_trained_weights(const fs::path& step_dir, bool* used_masters) {
  nn::StateDict weights = checkpoint::load_model(step_dir / "model");
  const nn::StateDict masters = read_master_weights(step_dir);
  if (used_masters) *used_masters = !masters.empty();
  for (const auto& [name, master] : masters) {
    auto it = weights.find(name);
    BOOSTER_CHECK(it != weights.end() && it->second.shape() == master.shape(), CheckpointError, "the checkpoint ",
                  step_dir.string(), " holds a master weight for '", name, "' that its model ",
                  it == weights.end() ? std::string("does not have") : "has in another shape",
                  "; the checkpoint is corrupt");
    it->second = master;
  }
  return weights;
}

Booster::HandOver Booster::read_hand_over(const fs::path& dir, const std::string& refusal) const {
  auto refuse = [&](const std::string& why) {
    BOOSTER_FAIL(CheckpointError, refusal, why, "; resume with the same strategy, or start afresh (model.init_from=",
                 (dir / "model").string(), " keeps the weights)");
  };
  HandOver h;
  if (parts_.model) h.model = checkpoint::load_model(dir / "model");
  if (!parts_.optimizer) return h;
  const optim::Optimizer& stepped = parts_.optimizer->stepped_optimizer();
  std::vector<size_t> sizes_now;
  const std::vector<Tensor> params = flat_params(stepped, &sizes_now);
  const size_t n = params.size();

  const fs::path optimizer_dir = dir / "optimizer";
  const fs::path meta_file = optimizer_dir / "optimizer.json", tensor_file = optimizer_dir / "optimizer.safetensors";
  BOOSTER_CHECK(fs::exists(meta_file) && fs::exists(tensor_file), CheckpointError, refusal, "its optimizer state (",
                meta_file.string(), ", ", tensor_file.string(), ") is missing; the checkpoint is incomplete");
  h.optimizer.meta = parse_json_as<CheckpointError>(
      checkpoint::read_text_file(meta_file), "checkpoint file " + meta_file.string(),
      refusal + meta_file.string() + " is not valid JSON; the checkpoint is corrupt: ", checkpoint_limits());
  BOOSTER_CHECK(h.optimizer.meta.is_object() && h.optimizer.meta.contains("param_groups") &&
                    h.optimizer.meta.at("param_groups").is_array(),
                CheckpointError, refusal, meta_file.string(), " is not an optimizer state; the checkpoint is corrupt");
  h.optimizer.tensors = checkpoint::read_safetensors(tensor_file).tensors;

  // The same parameters in the same order.
  std::vector<size_t> sizes_saved;
  for (const json& g : h.optimizer.meta.at("param_groups"))
    sizes_saved.push_back(g.is_object() && g.contains("params") && g.at("params").is_array() ? g.at("params").size() : 0);
  if (sizes_saved != sizes_now)
    refuse(str("its optimizer has parameter groups of ", show_sizes(sizes_saved), " parameters but this run's has ",
               show_sizes(sizes_now), " (another model or optimizer)"));
  const json names = h.optimizer.meta.value("param_names", json());
  // Checkpoints written before parameters were named by their whole path hold the last part only
  // ("weight" for "features.0.weight"): a name that is the end of this run's path matches it.
  auto same_parameter = [](const std::string& saved, const std::string& now) {
    return saved == now || (saved.find('.') == std::string::npos && now.size() > saved.size() &&
                            now.compare(now.size() - saved.size(), saved.size(), saved) == 0 &&
                            now[now.size() - saved.size() - 1] == '.');
  };
  if (names.is_array() && names.size() == n)
    for (size_t i = 0; i < n; ++i)
      if (names[i].is_string() && !params[i].name().empty() && !same_parameter(names[i], params[i].name()))
        refuse(str("its optimizer's parameter ", i, " is '", names[i].get<std::string>(), "' but this run's is '",
                   params[i].name(), "' (another model)"));

  // The float32 weights: saved masters first, then the model's parameters.
  h.weights.resize(n);
  for (auto it = h.optimizer.tensors.begin(); it != h.optimizer.tensors.end();) {
    size_t i = 0;
    std::string name;
    if (optim::parse_state_key(it->first, i, name) && name == optim::kMasterWeight && i < n) {
      h.weights[i] = it->second;
      it = h.optimizer.tensors.erase(it);
    } else {
      ++it;
    }
  }
  const fs::path precision_file = optimizer_dir / "precision.safetensors";
  if (fs::exists(precision_file)) {
    std::vector<size_t> first(sizes_now.size() + 1, 0);
    for (size_t g = 0; g < sizes_now.size(); ++g) first[g + 1] = first[g] + sizes_now[g];
    for (auto& [key, t] : checkpoint::read_safetensors(precision_file).tensors) {
      size_t g = 0, j = 0;
      if (split_master_key(key, g, j) && g < sizes_now.size() && j < sizes_now[g] && !h.weights[first[g] + j].defined())
        h.weights[first[g] + j] = t;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const std::string& name = params[i].name();
    if (!h.weights[i].defined()) {
      auto it = h.model.find(name);
      if (it == h.model.end()) refuse(str("its model has no parameter '", name, "'"));
      if (it->second.dtype() != DType::Float32)
        refuse(str("its model holds '", name, "' as ", dtype_name(it->second.dtype()),
                   " and it saved no float32 master weights to continue from"));
      h.weights[i] = it->second;
    }
    if (h.weights[i].dtype() != DType::Float32)
      refuse(str("its master weight of '", name, "' is ", dtype_name(h.weights[i].dtype()), ", not float32"));
    if (h.weights[i].shape() != params[i].shape())
      refuse(str("its weight of '", name, "' has shape ", h.weights[i].shape(), " but this run's has ", params[i].shape()));
  }

  // This run must be able to hold them.
  bool masters_in_strategy = false;
  for (const auto& [key, t] : precision_->state_dict().tensors) masters_in_strategy |= key.rfind("master_weights.", 0) == 0;
  if (!masters_in_strategy && !stepped.state_holds_master_weights())
    for (const Tensor& p : params)
      if (p.dtype() != DType::Float32)
        refuse(str("this run's parameter '", p.name(), "' is ", dtype_name(p.dtype()),
                   " and its strategy keeps no float32 master weights, so it cannot continue float32 weights"));
  return h;
}

void Booster::apply_hand_over(HandOver& h) {
  optim::Optimizer* stepped_ptr = parts_.optimizer ? &parts_.optimizer->stepped_optimizer() : nullptr;
  const std::vector<Tensor> params = stepped_ptr ? flat_params(*stepped_ptr) : std::vector<Tensor>();
  // Parameters a plugin shards (ZeRO-3) are written whole, then sharded again.
  plugin_->with_full_parameters([&] {
    if (parts_.model) parts_.model->load_state_dict(h.model, /*strict=*/!lora_);  // adapters only: Note [Adapter-only checkpoints]
    NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor p = params[i];
      p.copy_(h.weights[i]);  // rounded where the parameter is 16-bit
      p.bump_version();
    }
  });
  if (!stepped_ptr) return;
  optim::Optimizer& stepped = *stepped_ptr;
  if (stepped.state_holds_master_weights())
    for (size_t i = 0; i < params.size(); ++i)
      h.optimizer.tensors["state." + std::to_string(i) + "." + optim::kMasterWeight] = h.weights[i];
  stepped.load_state_dict(h.optimizer);
  // The strategy keeps its fresh state (a new loss scale), with the masters replaced.
  mixed_precision::MixedPrecisionState fresh = precision_->state_dict();
  bool masters = false;
  std::vector<size_t> first(1, 0);
  for (const optim::ParamGroup& g : stepped.param_groups()) first.push_back(first.back() + g.params.size());
  for (auto& [key, t] : fresh.tensors) {
    size_t g = 0, j = 0;
    if (!split_master_key(key, g, j) || g + 1 >= first.size() || first[g] + j >= first[g + 1]) continue;
    t = h.weights[first[g] + j];
    masters = true;
  }
  if (masters) precision_->load_state_dict(fresh);
  parts_.optimizer->copy_options_from_stepped();
}

}  // namespace booster
