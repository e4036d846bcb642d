// The family registry (families.h) and what reads a family's declaration generically: its make_model
// keys, its tensor-parallel split of the parameters.
//
// Note [Model families]
// ~~~~~~~~~~~~~~~~~~~~~
// A decoder family is described once, as data where it can be: make_model's keys (with the schema's
// defaults and bounds and the config.json key and Hugging Face default of each), the Hugging Face
// tensor names (prefix rules, the Conv1D weights stored transposed, the buffers a file carries that are
// not parameters), which Linears of a layer split column- or row-wise under tensor parallelism, and
// the optional parts (a tied head). What cannot be data (building the model, the few config.json checks
// of features a family does not implement, the shard policy's module surgery) are hooks of the same
// declaration. A family registers itself by a static in its own file, so the readers list no family:
// make_model takes its type from the registration (listing_order keeps the built-ins' documented
// order, whatever order the files' statics run in), the Hugging Face reader finds it by config.json's
// model_type or architecture and the writer by the built model, the schema and the memory estimate by
// the config's type, the hybrid plugin its shard policy by the model's name.
#include "booster/nn/families.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "booster/common/error.h"
#include "booster/nn/lora.h"

namespace booster::nn {

namespace detail {
void register_builtin_model(const std::string& name, ModelFactory factory, double order);
}

namespace {

struct FamilyRegistry {
  std::mutex mu;
  std::vector<std::unique_ptr<ModelFamily>> families;  // stable addresses
};

FamilyRegistry& family_registry() {
  static FamilyRegistry* r = new FamilyRegistry();  // never destroyed: registration runs during static init
  return *r;
}

std::string quoted_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "\"" : ", \"") + k + "\"";
  return out;
}

}  // namespace

// ------------------------------------------------------------------------------------------ registry

void register_model_family(ModelFamily family) {
  BOOSTER_CHECK(!family.type.empty() && family.make, ValueError,
                "register_model_family: a family needs a make_model type and a factory");
  FamilyRegistry& r = family_registry();
  const ModelFamily* added = nullptr;
  {
    std::lock_guard lock(r.mu);
    for (const auto& f : r.families)
      BOOSTER_CHECK(f->type != family.type && (family.hf_model_type.empty() || f->hf_model_type != family.hf_model_type),
                    ValueError, "register_model_family: the family \"", family.type, "\" (", family.hf_model_type,
                    ") is registered already");
    r.families.push_back(std::make_unique<ModelFamily>(std::move(family)));
    added = r.families.back().get();
  }
  detail::register_builtin_model(added->type, added->make, added->listing_order);
  if (added->shard_policy) register_shard_policy(added->module_name, added->shard_policy);
}

std::vector<const ModelFamily*> model_families() {
  FamilyRegistry& r = family_registry();
  std::lock_guard lock(r.mu);
  std::vector<const ModelFamily*> out;
  for (const auto& f : r.families) out.push_back(f.get());
  std::stable_sort(out.begin(), out.end(),
                   [](const ModelFamily* a, const ModelFamily* b) { return a->listing_order < b->listing_order; });
  return out;
}

const ModelFamily* find_model_family(const std::string& type) {
  for (const ModelFamily* f : model_families())
    if (f->type == type) return f;
  return nullptr;
}

const ModelFamily* find_hf_family(const std::string& name) {
  for (const ModelFamily* f : model_families())
    if (!name.empty() && (f->hf_model_type == name || f->architecture == name)) return f;
  return nullptr;
}

const ModelFamily* family_of(const Module& model) {
  for (const ModelFamily* f : model_families())
    if (f->owns && f->owns(model)) return f;
  return nullptr;
}

// ------------------------------------------------------------------------------------------ keys

void check_family_keys(const ModelFamily& family, const nlohmann::json& cfg) {
  std::vector<std::string> allowed = {"type"}, required;
  for (const FamilyKey& k : family.keys) {
    allowed.push_back(k.name);
    if (k.required) required.push_back(k.name);
  }
  for (const auto& [key, value] : cfg.items())
    BOOSTER_CHECK(std::find(allowed.begin(), allowed.end(), key) != allowed.end(), ConfigError,
                  "make_model: unknown key \"", key, "\" for model type \"", family.type, "\"; allowed keys are ",
                  quoted_keys(allowed));
  for (const auto& key : required)
    BOOSTER_CHECK(cfg.contains(key), ConfigError, "make_model: missing key \"", key, "\" for model type \"",
                  family.type, "\"; required keys are ", quoted_keys(required));
  for (const FamilyKey& k : family.keys) {
    if (!cfg.contains(k.name)) continue;
    const nlohmann::json& v = cfg.at(k.name);
    switch (k.kind) {
      case FamilyKey::Kind::Integer:
        BOOSTER_CHECK(v.is_number_integer() && double(v.get<int64_t>()) >= k.min, ConfigError, "make_model: \"",
                      k.name, "\" must be a positive integer, got ", v.dump());
        break;
      case FamilyKey::Kind::Number:
        BOOSTER_CHECK(v.is_number() && v.get<double>() >= k.min && v.get<double>() < k.max, ConfigError,
                      "make_model: \"", k.name, "\" must be a number in [", k.min, ", ", k.max, "), got ", v.dump());
        break;
      case FamilyKey::Kind::Boolean:
        BOOSTER_CHECK(v.is_boolean(), ConfigError, "make_model: \"", k.name, "\" must be true or false, got ",
                      v.dump());
        break;
    }
  }
  for (const auto& [a, b] : family.divisible)
    BOOSTER_CHECK(cfg.at(a).get<int64_t>() % cfg.at(b).get<int64_t>() == 0, ConfigError, "make_model: \"", a, "\" ",
                  cfg.at(a).get<int64_t>(), " must be divisible by \"", b, "\" ", cfg.at(b).get<int64_t>());
}

// ------------------------------------------------------------------------------------------ shards

std::map<std::string, ShardSpec> family_shards(const ModelFamily& family, const Module& model, int64_t layers) {
  std::set<std::string> names;
  for (const auto& [name, p] : model.named_parameters()) names.insert(name);
  std::map<std::string, ShardSpec> out;
  out[family.embedding] = {0, 1};
  if (!(family.tied && family.tied(model))) out[family.head] = {0, 1};
  // Adapters on the head (Note [LoRA on the vocabulary-parallel head] in shard_policy.cpp): B by its
  // rows, tied or not.
  const std::string head_b = family.head.substr(0, family.head.rfind('.') + 1) + "lora_B.weight";
  if (names.count(head_b)) out[head_b] = {0, 1};
  for (int64_t i = 0; i < layers; ++i) {
    const std::string p = family.layer_prefix + std::to_string(i) + ".";
    for (const LinearSplit& s : family.layer_splits) {
      const std::string linear = p + s.path;
      out[linear + ".weight"] = {s.dim, s.chunks};
      if (s.dim == 0 && names.count(linear + ".bias")) out[linear + ".bias"] = {0, s.chunks};
      if (names.count(linear + ".lora_A.weight"))
        out[linear + (s.dim == 0 ? ".lora_B.weight" : ".lora_A.weight")] = {s.dim, s.chunks};
    }
  }
  return out;
}

ModulePtr submodule(const ModulePtr& module, const std::string& path) {
  ModulePtr cur = module;
  for (size_t from = 0; cur != nullptr && from <= path.size();) {
    const size_t dot = std::min(path.find('.', from), path.size());
    const std::string part = path.substr(from, dot - from);
    ModulePtr next;
    for (const auto& [name, child] : cur->named_children())
      if (name == part) next = child;
    cur = next;
    from = dot + 1;
  }
  return cur;
}

void split_layer_lora(const ModelFamily& family, const ModulePtr& full, const ModulePtr& split,
                      distributed::ProcessGroup& group) {
  for (const LinearSplit& s : family.layer_splits) {
    const ModulePtr from = submodule(full, s.path), to = submodule(split, s.path);
    BOOSTER_CHECK(from != nullptr && to != nullptr, IncompatibleError, "shard policy '", family.module_name,
                  "': a layer has no ", s.path, " (the family's split table names it)");
    split_lora(*from, *to, s.dim, group, s.chunks);
  }
}

}  // namespace booster::nn
