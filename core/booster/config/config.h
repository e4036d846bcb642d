// Training configuration: strict, table-driven validation of a JSON config, with defaults.
//
// A config is one JSON object with the sections `model`, `optimizer`, `criterion`, `data`,
// `lr_scheduler` and `train`. Every section's keys, types, ranges and defaults are described once, in
// the schema table in schema.cpp; nothing else in the library re-checks them.
//
// See Note [Config errors]: every mistake is a ConfigError naming the JSON path (`train.epochs`), the
// value that was given and what would be allowed, and an unknown key suggests the nearest valid one.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"  // BoosterConfig, BoosterComponents
#include "booster/common/json_text.h"   // JsonLimits


namespace booster::config {

using json = nlohmann::json;

// The most layers a config's model may have (Note [The depth limit] in schema.cpp).
inline constexpr int64_t kMaxModelDepth = 4096;

// The limits of a config's text (Note [Reading config text] in booster/common/json_text.h): the
// reader's defaults, and an array past its item limit named against the depth limit.
inline JsonLimits config_text_limits() {
  static_assert(kMaxModelDepth == 4096, "the advice below names the depth limit");
  JsonLimits limits;
  limits.items_advice =
      "a config never needs that: data belongs in the files a config names, and a model's layers stop at the depth "
      "limit of 4096";
  return limits;
}

// Note [Config errors]
// ~~~~~~~~~~~~~~~~~~~~
// A config is usually written by hand and fixed from the error message alone, so a message names
//  * the JSON path of the offending key, dotted from the root (`optimizer.betas[1]`),
//  * the value as it was given (JSON-printed, so "1" and 1 look different),
//  * and what would be right: the type, the range, the allowed names, or, for an unknown key, the
//    nearest valid key by edit distance ("did you mean 'epochs'?").
// Defaults are filled by resolve(), so the resolved config (printed by `booster check`) shows every
// value a run will use.

// ------------------------------------------------------------------------------------ the schema
enum class Kind { Bool, Int, Number, String, Object, Array, Any };
const char* kind_name(Kind k);

// One key of a section. A field without a default is required.
struct Field {
  std::string key;
  Kind kind = Kind::Any;
  std::optional<json> default_value;  // nullopt: required
  std::string help;
  // Numbers (Int, Number, and the items of an Array of numbers): inclusive or exclusive bounds.
  std::optional<double> min, max;
  bool min_exclusive = false, max_exclusive = false;
  std::vector<std::string> choices;  // String: the allowed values (empty: any string)
  Kind item_kind = Kind::Any;        // Array: the kind of each item
  std::optional<size_t> length;      // Array: exact length
  // Array: at most this many items, checked before any item (a model's layers: Note [The depth limit]
  // in schema.cpp), and what the limit is, for the message.
  std::optional<size_t> max_length;
  std::string max_length_name;
  bool nullable = false;             // null is accepted (means "not set")
};

// A section is a set of fields, or, when `discriminator` is set (e.g. "type"), one set of fields per
// variant plus the fields every variant shares.
struct Section {
  std::string name;
  std::string help;
  std::vector<Field> common;
  std::string discriminator;                                       // empty: no variants
  std::vector<std::pair<std::string, std::vector<Field>>> variants;  // in the order help lists them
  bool optional = false;  // may be absent from the config (then it is filled with its defaults)
  std::string default_variant;
  // A section whose keys are not known to the table (they belong to a plugin-extensible registry, as
  // mixed_precision's options do) resolves through this instead of `common`/`variants`: it gets the
  // given value (an empty object when absent) and returns the resolved one, throwing ConfigError
  // naming the path as every other check does.
  std::function<json(const json& given)> custom_resolve;
  // Optional, for a section whose variants a registry extends at run time (the model types a program
  // registers or a model library provides): called for a variant that `variants` does not list, with
  // the given keys other than the discriminator and the `common` fields (which the table checks as for
  // any variant). Returns those keys resolved (their owner checks them when it builds the thing), or
  // throws ConfigError naming the JSON path, the value and what is allowed.
  std::function<json(const std::string& variant, const json& rest)> resolve_other_variant;
  // Optional: called with a listed variant's resolved keys (the discriminator among them) after the
  // table has checked them, for a default that follows from another key (a Llama's num_key_value_heads:
  // its query heads) or a key that is left out when not set (a Hugging Face model's dropout).
  std::function<void(const std::string& variant, json& resolved)> finish_variant;
  // Optional: what an optional section that the config leaves out resolves to, instead of its defaults
  // (`lora`: null, no adapters, while "lora": {} is LoRA with every default).
  std::optional<json> when_absent;
};

// The schema of a whole training config, one Section per top-level key.
const std::vector<Section>& training_schema();
// Checks that go across sections of a resolved training config (text data needs a GPT whose context
// covers data.context; the MLP's in/classes match the data; a Llama or Hugging Face model is built and
// split as the run would: check_model). ConfigError naming both paths. (Whether mixed_precision works
// with plugin is checked where they are built: build_booster.)
void check_training_config(const json& resolved);
// Note [Checking a model before it trains] (model_check.cpp): a resolved config's "llama" or "hf" model
// is built deferred (no parameter memory; an hf model reads config.json and its weight files' headers,
// not the weights) through make_model, as `booster train` builds it, so its size errors and missing
// files are make_model's own ConfigError; data.seq_len / data.context must fit its positions; and under
// hybrid_parallel with tp_size or pp_size > 1 the model's shard policy is run for every pipeline stage
// over a stand-in tensor-parallel group of tp_size ranks, so what the policy refuses (key/value heads
// that tp_size splits, tied embeddings across stages, stage_layers that do not add up) is refused with
// the policy's own message, before any process group exists. Other models under such a plugin are
// built deferred to find their policy (refused with the plugin's message when there is none); their
// policies are not run (they are a program's or a library's).
void check_model(const json& resolved);
// Note [Weights of another model] (model_check.cpp): model.init_from's tensors, from the files' headers,
// against the model built deferred; a ConfigError listing the first few that differ and a count of the
// rest. Nothing when init_from is unset or missing (check_training_config names a missing file).
void check_init_from(const json& resolved);
// Note [A trial forward of a library model] (model_check.cpp): for a model from a model library, one
// forward without gradients on two samples of the training split and the criterion on its output, so
// `booster check` reports an input size or class count that does not fit the data with the error the
// first training step would give. Nothing for other models. Called by `booster check`, not by resolve.
// Returns why it did not run ("" when it ran or had nothing to check): a model whose parameters would
// take more than half of the memory available is not built.
std::string trial_forward(const json& resolved);

// ------------------------------------------------------------------------------------ lora
// Note [The lora section] (lora_section.cpp): "lora": {"r", "alpha", "dropout", "target_modules",
// "use_rslora", "init_from", "seed"} puts adapters on the model before boost() (Booster::enable_lora) and trains
// them only; left out or null, the whole model trains.
// The adapters' config of a resolved config (its seed: lora.seed, else train.seed; with init_from, the
// PEFT adapter's settings where the section leaves them out); nullopt when lora is null.
std::optional<nn::LoraConfig> lora_config(const json& resolved);
// What LoRA does to a resolved config's model, counted on the model built deferred with no memory
// (ShapesOnlyGuard): the adapted Linears, trainable and total parameters. ConfigError naming
// lora.target_modules when no Linear of the model matches (with the names its Linears have).
struct LoraSummary {
  std::vector<std::string> adapted;  // module paths
  int64_t trainable = 0, total = 0;
  std::string describe() const;  // "lora: 4 Linears adapted (q_proj, v_proj), 896 trainable of 20,512 parameters (4.37%)"
};
std::optional<LoraSummary> lora_summary(const json& resolved);
// The schema table's `lora` section.
Section lora_section();

// ------------------------------------------------------------------ mixed_precision and plugin
// Note [The mixed_precision section] and Note [The plugin section] in booster_sections.cpp.
inline constexpr const char* kDefaultMixedPrecision = "fp32";  // the default strategy
inline constexpr const char* kDefaultPlugin = "single";         // one process, the built-in plugin

// The one parser of a `mixed_precision` or `plugin` section's shape (`path` is which): a name, or
// {"name": ..., options...}, into (name, options); null or {} gives (default_name, {}). ConfigError
// naming the JSON path for anything else. BoosterConfig::from_json and the schema both use it.
std::pair<std::string, json> parse_named_section(const json& given, const std::string& path,
                                                 const std::string& default_name);
// The section as the schema table resolves it: {"name": ..., options as given}, the name checked
// against the built-in strategies / "single" and the plugins on the search path (or a path to a
// library): ConfigError naming the names, the directories searched and BOOSTER_PLUGIN_PATH. Its options
// are checked where the thing is built (build_booster).
json name_section(const json& given, const std::string& path);
// The Booster's config from a config's mixed_precision and plugin sections ("single" becomes "", the
// built-in plugin).
BoosterConfig booster_config(const json& config);
// The strategy and the plugin of a config's two sections, each built once, checked together
// (BoosterComponents), their options filled in from options(); ConfigError naming the JSON path
// (`mixed_precision.init_scale`) for a bad or unknown option, IncompatibleError for a combination the
// compatibility matrix rejects. Note [Built once] in booster/booster/booster.h.
BoosterComponents build_booster(const json& config);
// {"mixed_precision": {"name", options...}, "plugin": {...}} of built components, for a resolved config.
json resolved_sections(const BoosterComponents& components);

// Note [The run directory]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// `train.run_dir` is where a run leaves its files: metrics.jsonl (Note [What booster train prints] in
// booster/trainer/progress.h), config.json (the resolved config it ran) and, unless `train.checkpoint_dir` says
// otherwise, checkpoints/. "{time}" in it becomes the run's start time (UTC, YYYYmmdd-HHMMSS), so by
// default every run gets a fresh directory under runs/ (taken with a -2, -3, ... suffix when two runs
// start in the same second). null writes no files at all (and then checkpoints need an explicit
// checkpoint_dir). `train.resume: "latest"` looks in the checkpoint directory, so resuming needs one
// that does not change from run to run: an explicit checkpoint_dir or a run_dir without {time}.
inline constexpr const char* kDefaultRunDir = "runs/{time}";

// ------------------------------------------------------------------------------------ operations
// Checks `config` against the schema and returns it with every default filled. Throws ConfigError
// (Note [Config errors]) on the first mistake. The one-argument form uses the training schema, builds
// the strategy and the plugin (build_booster) and runs check_training_config: it is
// resolve_run(config).config.
json resolve(const json& config);
json resolve(const json& config, const std::vector<Section>& schema);

// A resolved training config and the strategy and plugin built while resolving it, to hand to the
// Booster so a run builds each once (Note [Built once]). resolve_run applies train.collective_timeout_s
// (set_default_collective_timeout) before it builds the plugin, which may make the process group.
struct ResolvedRun {
  json config;
  BoosterComponents booster;
};
ResolvedRun resolve_run(const json& config);

// Reads a JSON file; ConfigError naming the file when it is missing or not valid JSON (with the line
// and column of the parse error).
json load_file(const std::string& path);

// Applies one `--set a.b.c=value` override in place. The value is parsed as JSON when it is valid JSON
// (`3`, `1e-3`, `true`, `[0.9, 0.95]`, `"x"`), else taken as a string (`adamw`). Intermediate objects
// are created as needed; indexing into a non-object is a ConfigError naming the path. The result is
// validated by resolve() like any other config.
void apply_override(json& config, const std::string& assignment);

// load_file + apply_override for each `key.path=value` in order + resolve_run: what `booster train`
// runs. load() is load_run().config.
ResolvedRun load_run(const std::string& path, const std::vector<std::string>& overrides = {});
json load(const std::string& path, const std::vector<std::string>& overrides = {});

// Levenshtein distance, and the candidate nearest to `word` (nullopt when none is close enough to be a
// plausible typo).
size_t edit_distance(const std::string& a, const std::string& b);
std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates);

// Reads a JSON value for messages: strings quoted, long values shortened.
std::string show(const json& value);

}  // namespace booster::config
