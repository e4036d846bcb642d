#include "booster/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace booster::optim {

using nlohmann::json;

// ------------------------------------------------------------------------------------------ base

LRScheduler::LRScheduler(Optimizer& optimizer, int64_t last_epoch) : optimizer_(optimizer), last_epoch_(last_epoch) {
  BOOSTER_CHECK(last_epoch >= -1, ValueError, "lr scheduler: last_epoch must be -1 (start) or a step count, got ",
                last_epoch);
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    json& o = groups[g].options;
    if (last_epoch == -1) {
      if (!o.contains("initial_lr")) o["initial_lr"] = o.at("lr");
    } else {
      BOOSTER_CHECK(o.contains("initial_lr"), ConfigError, "lr scheduler: param 'initial_lr' is not specified in "
                    "param_groups[", g, "] when resuming an optimizer");
    }
    base_lrs_.push_back(o.at("initial_lr").get<double>());
  }
}

std::vector<double> LRScheduler::group_lrs() const {
  std::vector<double> out;
  for (const ParamGroup& g : optimizer_.param_groups()) out.push_back(g.options.at("lr").get<double>());
  return out;
}

void LRScheduler::step() {
  ++step_count_;
  ++last_epoch_;
  const std::vector<double> lrs = get_lr();
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size() && g < lrs.size(); ++g) groups[g].options["lr"] = lrs[g];
  last_lr_ = group_lrs();
}

json LRScheduler::state_dict() const {
  json j = hyperparams();
  j["type"] = name();
  j["base_lrs"] = base_lrs_;
  j["last_epoch"] = last_epoch_;
  j["step_count"] = step_count_;
  j["last_lr"] = last_lr_;
  return j;
}

void LRScheduler::load_state_dict(const json& j) {
  BOOSTER_CHECK(j.is_object() && j.contains("type") && j.contains("base_lrs") && j.contains("last_epoch"),
                CheckpointError, name(), ".load_state_dict: expected an object with type, base_lrs and last_epoch, got ",
                j.dump());
  BOOSTER_CHECK(j.at("type") == name(), CheckpointError, name(), ".load_state_dict: the state was saved by ",
                j.at("type").dump());
  const auto base = j.at("base_lrs").get<std::vector<double>>();
  BOOSTER_CHECK(base.size() == base_lrs_.size(), CheckpointError, name(), ".load_state_dict: the state has ",
                base.size(), " base lrs but the optimizer has ", base_lrs_.size(), " param groups");
  try {
    load_hyperparams(j);
  } catch (const Error& e) {
    BOOSTER_FAIL(CheckpointError, name(), ".load_state_dict: ", e.what());
  } catch (const json::exception& e) {
    BOOSTER_FAIL(CheckpointError, name(), ".load_state_dict: ", e.what());
  }
  base_lrs_ = base;
  last_epoch_ = j.at("last_epoch").get<int64_t>();
  step_count_ = j.value("step_count", int64_t(0));
  last_lr_ = j.value("last_lr", std::vector<double>{});
}

// ------------------------------------------------------------------------------------------ StepLR

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma, int64_t last_epoch)
    : LRScheduler(optimizer, last_epoch), step_size_(step_size), gamma_(gamma) {
  BOOSTER_CHECK(step_size >= 1, ValueError, "StepLR: step_size must be at least 1, got ", step_size);
  BOOSTER_CHECK(gamma >= 0.0, ValueError, "StepLR: gamma must be non-negative, got ", gamma);
  initial_step();
}

std::vector<double> StepLR::get_lr() const {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ == 0 || last_epoch_ % step_size_ != 0) return lrs;
  for (double& lr : lrs) lr *= gamma_;
  return lrs;
}

json StepLR::hyperparams() const { return {{"step_size", step_size_}, {"gamma", gamma_}}; }

void StepLR::load_hyperparams(const json& j) {
  step_size_ = j.at("step_size").get<int64_t>();
  gamma_ = j.at("gamma").get<double>();
}

// ------------------------------------------------------------------------------------------ CosineAnnealingLR

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min, int64_t last_epoch)
    : LRScheduler(optimizer, last_epoch), T_max_(T_max), eta_min_(eta_min) {
  BOOSTER_CHECK(T_max >= 1, ValueError, "CosineAnnealingLR: T_max must be at least 1, got ", T_max);
  BOOSTER_CHECK(eta_min >= 0.0, ValueError, "CosineAnnealingLR: eta_min must be non-negative, got ", eta_min);
  initial_step();
}

std::vector<double> CosineAnnealingLR::get_lr() const {
  constexpr double pi = std::numbers::pi;
  const double T = double(T_max_), t = double(last_epoch_);
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ == 0) return lrs;
  for (size_t g = 0; g < lrs.size() && g < base_lrs_.size(); ++g) {
    const double base = base_lrs_[g];
    if (step_count_ == 1 && last_epoch_ > 0) {  // resumed: the closed form
      lrs[g] = eta_min_ + (base - eta_min_) * (1 + std::cos(t * pi / T)) / 2;
    } else if ((last_epoch_ - 1 - T_max_) % (2 * T_max_) == 0) {  // the bottom of a period: restart upward
      lrs[g] = lrs[g] + (base - eta_min_) * (1 - std::cos(pi / T)) / 2;
    } else {
      lrs[g] = (1 + std::cos(pi * t / T)) / (1 + std::cos(pi * (t - 1) / T)) * (lrs[g] - eta_min_) + eta_min_;
    }
  }
  return lrs;
}

json CosineAnnealingLR::hyperparams() const { return {{"T_max", T_max_}, {"eta_min", eta_min_}}; }

void CosineAnnealingLR::load_hyperparams(const json& j) {
  T_max_ = j.at("T_max").get<int64_t>();
  eta_min_ = j.at("eta_min").get<double>();
}

// ------------------------------------------------------------------------------------------ LinearWarmup

void LinearWarmup::check(const LinearWarmupOptions& o) {
  BOOSTER_CHECK(o.warmup_steps >= 0, ValueError, "LinearWarmup: warmup_steps must be non-negative, got ",
                o.warmup_steps);
  BOOSTER_CHECK(o.total_steps >= o.warmup_steps && o.total_steps >= 1, ValueError,
                "LinearWarmup: total_steps must be at least 1 and at least warmup_steps (", o.warmup_steps, "), got ",
                o.total_steps);
  BOOSTER_CHECK(o.decay == "cosine" || o.decay == "linear" || o.decay == "constant", ConfigError,
                "LinearWarmup: unknown decay '", o.decay, "'; valid decays are: cosine, linear, constant");
  BOOSTER_CHECK(o.min_lr_ratio >= 0.0 && o.min_lr_ratio <= 1.0, ValueError,
                "LinearWarmup: min_lr_ratio must be in [0, 1], got ", o.min_lr_ratio);
  BOOSTER_CHECK(o.min_lr < 0.0 || o.min_lr_ratio == 0.0, ConfigError,
                "LinearWarmup: give min_lr (", o.min_lr, ") or min_lr_ratio (", o.min_lr_ratio, "), not both");
  BOOSTER_CHECK(o.start_factor >= 0.0 && o.start_factor <= 1.0, ValueError,
                "LinearWarmup: start_factor must be in [0, 1], got ", o.start_factor);
}

LinearWarmup::LinearWarmup(Optimizer& optimizer, const LinearWarmupOptions& options, int64_t last_epoch)
    : LRScheduler(optimizer, last_epoch), o_(options) {
  check(o_);
  initial_step();
}

double LinearWarmup::factor(int64_t s, double min_ratio) const {
  if (s < o_.warmup_steps)
    return o_.start_factor + (1.0 - o_.start_factor) * double(s) / double(o_.warmup_steps);
  if (o_.decay == "constant") return 1.0;
  const double p = std::min(1.0, double(s - o_.warmup_steps) / double(std::max<int64_t>(1, o_.total_steps - o_.warmup_steps)));
  if (o_.decay == "linear") return min_ratio + (1.0 - min_ratio) * (1.0 - p);
  return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
}

std::vector<double> LinearWarmup::get_lr() const {
  std::vector<double> lrs;
  for (double base : base_lrs_) {
    const double m = o_.min_lr >= 0.0 ? (base > 0.0 ? std::min(1.0, o_.min_lr / base) : 0.0) : o_.min_lr_ratio;
    lrs.push_back(base * factor(last_epoch_, m));
  }
  return lrs;
}

json LinearWarmup::hyperparams() const {
  return {{"warmup_steps", o_.warmup_steps}, {"total_steps", o_.total_steps}, {"decay", o_.decay},
          {"min_lr_ratio", o_.min_lr_ratio}, {"min_lr", o_.min_lr},           {"start_factor", o_.start_factor}};
}

void LinearWarmup::load_hyperparams(const json& j) {
  LinearWarmupOptions o;
  o.warmup_steps = j.at("warmup_steps").get<int64_t>();
  o.total_steps = j.at("total_steps").get<int64_t>();
  o.decay = j.at("decay").get<std::string>();
  o.min_lr_ratio = j.at("min_lr_ratio").get<double>();
  o.min_lr = j.at("min_lr").get<double>();
  o.start_factor = j.at("start_factor").get<double>();
  check(o);
  o_ = o;
}

// ------------------------------------------------------------------------------------------ factory

namespace {

enum class Kind { Int, Number, String };

struct Key {
  const char* name;
  Kind kind;
  bool required;
};

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

// Checks cfg's keys against `keys` (besides "type"): unknown, missing and mistyped keys are ConfigErrors.
void check_keys(const json& cfg, const std::string& type, const std::vector<Key>& keys) {
  std::string valid;
  for (const Key& k : keys) valid += (valid.empty() ? "" : ", ") + std::string(k.name);
  for (auto it = cfg.begin(); it != cfg.end(); ++it) {
    if (it.key() == "type") continue;
    auto k = std::find_if(keys.begin(), keys.end(), [&](const Key& k) { return it.key() == k.name; });
    BOOSTER_CHECK(k != keys.end(), ConfigError, "lr scheduler '", type, "': unknown key '", it.key(),
                  "'; valid keys are: ", valid);
    const json& v = it.value();
    const bool ok = k->kind == Kind::Int ? v.is_number_integer() : k->kind == Kind::Number ? v.is_number() : v.is_string();
    BOOSTER_CHECK(ok, ConfigError, "lr scheduler '", type, "': key '", it.key(), "' must be ",
                  k->kind == Kind::Int ? "an integer" : k->kind == Kind::Number ? "a number" : "a string", ", got ",
                  v.dump());
  }
  for (const Key& k : keys)
    BOOSTER_CHECK(!k.required || cfg.contains(k.name), ConfigError, "lr scheduler '", type, "': missing required key '",
                  k.name, "'");
}

}  // namespace

std::unique_ptr<LRScheduler> make_scheduler(const json& cfg, Optimizer& optimizer) {
  BOOSTER_CHECK(cfg.is_object() && cfg.contains("type") && cfg.at("type").is_string(), ConfigError,
                "lr scheduler: expected an object with a \"type\" (one of step, cosine, linear_warmup), got ",
                cfg.dump());
  const std::string type = cfg.at("type").get<std::string>();
  const std::string t = lower(type);
  if (t == "step" || t == "steplr" || t == "step_lr") {
    check_keys(cfg, type, {{"step_size", Kind::Int, true}, {"gamma", Kind::Number, false}});
    return std::make_unique<StepLR>(optimizer, cfg.at("step_size").get<int64_t>(), cfg.value("gamma", 0.1));
  }
  if (t == "cosine" || t == "cosineannealinglr" || t == "cosine_annealing") {
    check_keys(cfg, type, {{"T_max", Kind::Int, true}, {"eta_min", Kind::Number, false}});
    return std::make_unique<CosineAnnealingLR>(optimizer, cfg.at("T_max").get<int64_t>(), cfg.value("eta_min", 0.0));
  }
  if (t == "linear_warmup" || t == "linearwarmup" || t == "warmup") {
    check_keys(cfg, type,
               {{"warmup_steps", Kind::Int, true},
                {"total_steps", Kind::Int, true},
                {"decay", Kind::String, false},
                {"min_lr_ratio", Kind::Number, false},
                {"min_lr", Kind::Number, false},
                {"start_factor", Kind::Number, false}});
    BOOSTER_CHECK(!(cfg.contains("min_lr") && cfg.contains("min_lr_ratio")), ConfigError, "lr scheduler '", type,
                  "': give min_lr or min_lr_ratio, not both");
    LinearWarmupOptions o;
    o.warmup_steps = cfg.at("warmup_steps").get<int64_t>();
    o.total_steps = cfg.at("total_steps").get<int64_t>();
    o.decay = cfg.value("decay", o.decay);
    o.min_lr_ratio = cfg.value("min_lr_ratio", o.min_lr_ratio);
    o.min_lr = cfg.value("min_lr", o.min_lr);
    o.start_factor = cfg.value("start_factor", o.start_factor);
    if (cfg.contains("min_lr"))
      BOOSTER_CHECK(o.min_lr >= 0.0, ValueError, "LinearWarmup: min_lr must be non-negative, got ", o.min_lr);
    return std::make_unique<LinearWarmup>(optimizer, o);
  }
  BOOSTER_FAIL(ConfigError, "lr scheduler: unknown type '", type, "'; valid types are: step, cosine, linear_warmup");
}

}  // namespace booster::optim
