// The `lora` section of a training config: its table, the nn::LoraConfig it gives, and what `booster
// check` says about it (the trainable parameters).
//
// Note [The lora section]
// ~~~~~~~~~~~~~~~~~~~~~~~
//   "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
//            "use_rslora": false, "init_from": null, "seed": null}
// is PEFT's LoraConfig (r, lora_alpha, lora_dropout, target_modules, use_rslora) as Booster::enable_lora
// takes it: `booster train` applies it to the model before boost() and builds the optimizer over the
// adapters only (nn::trainable_parameters), so under every strategy and plugin the frozen base has no
// gradient, master weight or optimizer state, and checkpoints hold the adapters (Note [Adapter-only
// checkpoints] in booster/booster/state.cpp). The section is top-level, beside model and optimizer,
// because it changes both: what the model computes and what the optimizer holds. Left out or null, the
// whole model trains; {} is LoRA with every default. A's initial draws come from lora.seed, else
// train.seed. With init_from (a PEFT adapter directory) the adapters start from its A and B, and r,
// alpha, target_modules and use_rslora left out are the adapter's (nn::LoraConfig::from_json, which
// refuses a given one that differs). The keys a resume must keep are the checkpoint's own (state.cpp
// compares them), not train's settings.
#include <iomanip>
#include <set>
#include <sstream>

#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/nn/lora.h"
#include "booster/nn/models.h"
#include "booster/tensor/deferred.h"

namespace booster::config {

namespace {

Field lora_field(std::string key, Kind kind, json def, std::string help) {
  Field f;
  f.key = std::move(key);
  f.kind = kind;
  f.default_value = std::move(def);
  f.help = std::move(help);
  return f;
}

Section lora_table() {
  Section s;
  s.name = "lora";
  s.help = "LoRA adapters: {\"r\", \"alpha\", \"dropout\", \"target_modules\", \"use_rslora\", \"init_from\"}";
  Field r = lora_field("r", Kind::Int, 8, "the adapters' rank");
  r.min = 1;
  Field alpha = lora_field("alpha", Kind::Number, 16.0, "lora_alpha: the adapter's output is scaled by alpha / r");
  alpha.min = 0.0;
  alpha.min_exclusive = true;
  Field dropout = lora_field("dropout", Kind::Number, 0.0, "lora_dropout on the adapter's input");
  dropout.min = 0.0;
  dropout.max = 1.0;
  dropout.max_exclusive = true;
  Field targets = lora_field("target_modules", Kind::Array, json::array({"q_proj", "v_proj"}),
                             "the Linear layers to adapt, by name (the last part of their module path)");
  targets.item_kind = Kind::String;
  Field rslora = lora_field("use_rslora", Kind::Bool, false, "scale by alpha / sqrt(r) (rsLoRA) instead of alpha / r");
  Field init_from = lora_field("init_from", Kind::String, nullptr, "a PEFT adapter directory to start from; null: A "
                                                                   "kaiming-uniform, B zero");
  init_from.nullable = true;
  Field seed = lora_field("seed", Kind::Int, nullptr, "the draws of A's start and of the dropout; null: train.seed");
  seed.min = 0;
  seed.nullable = true;
  s.common = {r, alpha, dropout, targets, rslora, init_from, seed};
  return s;
}

std::string thousands(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

// Used by the schema table (schema.cpp).
Section lora_section() {
  Section s;
  s.name = "lora";
  s.help = lora_table().help;
  s.optional = true;
  s.when_absent = json(nullptr);
  s.custom_resolve = [](const json& given) -> json {
    if (given.is_null()) return nullptr;
    json out = resolve(json{{"lora", given}}, {lora_table()}).at("lora");
    // From a PEFT adapter, what the config leaves out is the adapter's (nn::LoraConfig::from_json).
    if (out.at("init_from").is_string())
      for (const char* adapter_key : {"r", "alpha", "target_modules", "use_rslora"})
        if (!given.contains(adapter_key)) out[adapter_key] = nullptr;
    const json& targets = out.at("target_modules");
    if (targets.is_null()) return out;
    if (targets.empty())
      throw ConfigError("'lora.target_modules' is []; name the Linear layers to adapt, e.g. [\"q_proj\", \"v_proj\"]");
    std::set<std::string> seen;
    for (size_t i = 0; i < targets.size(); ++i) {
      const std::string name = targets[i].get<std::string>();
      if (name.empty() || name.find('.') != std::string::npos)
        throw ConfigError("'lora.target_modules[" + std::to_string(i) + "]' is " + show(targets[i]) +
                          "; expected a Linear's name, the last part of its module path (\"q_proj\", not "
                          "\"self_attn.q_proj\")");
      if (!seen.insert(name).second)
        throw ConfigError("'lora.target_modules[" + std::to_string(i) + "]' is " + show(targets[i]) +
                          ", named twice; name each Linear once");
    }
    return out;
  };
  return s;
}

std::optional<nn::LoraConfig> lora_config(const json& resolved) {
  const json& lora = resolved.value("lora", json());
  if (lora.is_null()) return std::nullopt;
  json section = lora;
  if (section.value("seed", json()).is_null()) section["seed"] = resolved.at("train").at("seed");
  return nn::LoraConfig::from_json(section);  // reads lora.init_from's adapter_config.json
}

std::optional<LoraSummary> lora_summary(const json& resolved) {
  std::optional<nn::LoraConfig> lora = lora_config(resolved);
  if (!lora) return std::nullopt;
  lora->init_from.clear();  // the shapes are the config's; the adapter's values are not read here
  json section = resolved.at("model");
  section.erase("init_from");  // the weights do not change the shapes
  LazyInitGuard lazy;
  ShapesOnlyGuard shapes;
  const nn::ModulePtr model = nn::make_model(section, resolved.at("train").at("seed").get<uint64_t>());
  LoraSummary s;
  try {
    s.adapted = nn::apply_lora(*model, *lora);
  } catch (const ConfigError& e) {
    throw ConfigError("'lora.target_modules' is " + json(lora->target_modules).dump() + ": " + e.what());
  }
  for (const Tensor& p : model->parameters()) {
    s.total += p.numel();
    if (p.requires_grad()) s.trainable += p.numel();
  }
  return s;
}

std::string LoraSummary::describe() const {
  std::set<std::string> names;
  for (const std::string& path : adapted) names.insert(path.substr(path.rfind('.') + 1));
  std::string list;
  for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
  std::ostringstream out;
  out << "lora: " << adapted.size() << " Linear" << (adapted.size() == 1 ? "" : "s") << " adapted (" << list << "), "
      << thousands(trainable) << " trainable of " << thousands(total) << " parameters (" << std::fixed
      << std::setprecision(2) << (total > 0 ? 100.0 * double(trainable) / double(total) : 0.0) << "%)";
  return out.str();
}

}  // namespace booster::config
