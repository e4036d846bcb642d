#include "booster/optim/optimizer.h"

#include <algorithm>
#include <unordered_set>

#include "booster/autograd/autograd.h"
#include "booster/tensor/deferred.h"
#include "booster/tensor/storage.h"

namespace booster::optim {

using nlohmann::json;

namespace {

std::string key_list(const json& defaults) {
  std::string s;
  for (auto it = defaults.begin(); it != defaults.end(); ++it) s += (s.empty() ? "" : ", ") + it.key();
  return s;
}

}  // namespace

bool parse_state_key(const std::string& key, size_t& index, std::string& name) {
  if (key.rfind("state.", 0) != 0) return false;
  const size_t dot = key.find('.', 6);
  if (dot == std::string::npos || dot == 6 || dot + 1 == key.size()) return false;
  const std::string digits = key.substr(6, dot - 6);
  if (digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  index = std::stoul(digits);
  name = key.substr(dot + 1);
  return true;
}

Optimizer::Optimizer(std::string type, json defaults) : type_(std::move(type)), defaults_(std::move(defaults)) {}

json Optimizer::complete_options(const json& options_in) const {
  const json options = options_in.is_null() ? json::object() : options_in;  // `{}` in C++ is null
  BOOSTER_CHECK(options.is_object(), ConfigError, type_, ": options must be a JSON object, got ", options.dump());
  json out = defaults_;
  for (auto it = options.begin(); it != options.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "initial_lr") {  // written by lr schedulers, as in torch
      BOOSTER_CHECK(v.is_number(), ConfigError, type_, ": option 'initial_lr' must be a number, got ", v.dump());
      out[key] = v;
      continue;
    }
    BOOSTER_CHECK(defaults_.contains(key), ConfigError, type_, ": unknown option '", key,
                  "'; valid options are: ", key_list(defaults_));
    const json& d = defaults_.at(key);
    if (d.is_boolean()) {
      BOOSTER_CHECK(v.is_boolean(), ConfigError, type_, ": option '", key, "' must be true or false, got ",
                    v.dump());
    } else if (d.is_array()) {
      const bool ok = v.is_array() && v.size() == d.size() &&
                      std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_number(); });
      BOOSTER_CHECK(ok, ConfigError, type_, ": option '", key, "' must be a list of ", d.size(),
                    " numbers, got ", v.dump());
    } else {
      BOOSTER_CHECK(v.is_number(), ConfigError, type_, ": option '", key, "' must be a number, got ", v.dump());
    }
    out[key] = v;
  }
  for (auto it = out.begin(); it != out.end(); ++it)
    BOOSTER_CHECK(!it.value().is_null(), ConfigError, type_,
                  ": parameter group didn't specify a value of required optimization parameter ", it.key());
  check_options(out);
  return out;
}

void Optimizer::add_param_group(ParamGroup group) {
  BOOSTER_CHECK(!group.params.empty(), ValueError, type_, ": optimizer got an empty parameter list");
  group.options = complete_options(group.options);
  std::unordered_set<const TensorImpl*> seen;
  for (const ParamGroup& g : groups_)
    for (const Tensor& p : g.params) seen.insert(p.impl());
  for (const Tensor& p : group.params) {
    BOOSTER_CHECK(p.defined(), ValueError, type_, ": a parameter is undefined");
    BOOSTER_CHECK(p.is_leaf(), ValueError, type_, ": can't optimize a non-leaf Tensor",
                  p.name().empty() ? "" : " ('" + p.name() + "')");
    BOOSTER_CHECK(seen.insert(p.impl()).second, ValueError, type_,
                  ": some parameters appear more than once or in more than one parameter group",
                  p.name().empty() ? "" : " ('" + p.name() + "')");
  }
  // One flat buffer per dtype, in order of first appearance; global indices follow the group's order.
  std::vector<Segment> segs;
  std::vector<DType> seg_dtype;
  std::vector<std::vector<Tensor>> seg_params;
  std::vector<std::vector<size_t>> seg_index;
  for (size_t i = 0; i < group.params.size(); ++i) {
    const Tensor& p = group.params[i];
    size_t s = size_t(std::find(seg_dtype.begin(), seg_dtype.end(), p.dtype()) - seg_dtype.begin());
    if (s == seg_dtype.size()) {
      seg_dtype.push_back(p.dtype());
      seg_params.emplace_back();
      seg_index.emplace_back();
    }
    seg_params[s].push_back(p);
    seg_index[s].push_back(steps_.size() + i);
  }
  for (size_t s = 0; s < seg_dtype.size(); ++s) {
    Segment seg;
    seg.index = std::move(seg_index[s]);
    const bool deferred = std::any_of(seg_params[s].begin(), seg_params[s].end(), is_deferred);
    if (deferred) {
      // What binding would refuse is refused now, as for parameters bound at once.
      for (const Tensor& p : seg_params[s]) {
        BOOSTER_CHECK(is_floating(p.dtype()), DTypeError, type_, ": parameter '", p.name(), "' has dtype ", p.dtype(),
                      "; only floating parameters can be optimized");
        BOOSTER_CHECK(p.device() == seg_params[s][0].device(), DeviceError, type_, ": parameter '", p.name(),
                      "' is on ", p.device(), " but '", seg_params[s][0].name(), "' is on ",
                      seg_params[s][0].device(), "; put the model on one device");
      }
      seg.unbound = std::move(seg_params[s]);
      has_unbound_ = true;
    } else {
      seg.flat = FlatBuffer(std::move(seg_params[s]));
    }
    segs.push_back(std::move(seg));
  }
  steps_.resize(steps_.size() + group.params.size(), 0);
  groups_.push_back(std::move(group));
  segments_.push_back(std::move(segs));
}

void Optimizer::add_groups(std::vector<ParamGroup> groups) {
  BOOSTER_CHECK(!groups.empty(), ValueError, type_, ": optimizer got an empty parameter list");
  for (ParamGroup& g : groups) add_param_group(std::move(g));
}

// Note [Deferred binding]
// Parameters made under a LazyInitGuard hold no memory yet (booster/tensor/deferred.h); binding them
// into a flat buffer would allocate the whole model (values and gradients) on every rank, the very
// thing deferral avoids when a plugin keeps only a part. So an optimizer over deferred parameters binds
// them on first use instead: a step, zero_grad, flat_buffers(), a state_dict. The optimizer passed to
// Booster::boost() under such a plugin is never used (boost rebuilds it over the part and releases it),
// so its parameters are never bound.
void Optimizer::bind_deferred() const {
  if (!has_unbound_) return;
  // Binding allocates and repoints the parameters, but changes neither values nor options: a const
  // accessor (flat_buffers, state_dict) may do it. Optimizers are never const objects.
  auto* self = const_cast<Optimizer*>(this);
  for (std::vector<Segment>& segs : self->segments_)
    for (Segment& seg : segs)
      if (!seg.unbound.empty()) {
        seg.flat = FlatBuffer(seg.unbound);  // may throw (out of memory): the segment stays unbound
        seg.unbound.clear();
      }
  self->has_unbound_ = false;
}

void Optimizer::zero_grad(bool /*set_to_none*/) {
  bind_deferred();
  for (auto& segs : segments_)
    for (Segment& seg : segs) seg.flat.zero_grad();
}

double Optimizer::lr(size_t group) const {
  BOOSTER_CHECK(group < groups_.size(), IndexError, type_, ": lr(): group ", group, " out of range (",
                groups_.size(), " groups)");
  return groups_[group].options.at("lr").get<double>();
}

void Optimizer::set_lr(double lr) {
  BOOSTER_CHECK(lr >= 0.0, ValueError, "Invalid learning rate: ", lr);
  for (ParamGroup& g : groups_) g.options["lr"] = lr;
}

void Optimizer::release_buffers() {
  for (std::vector<Segment>& segs : segments_) segs.clear();
  has_unbound_ = false;
  std::fill(steps_.begin(), steps_.end(), 0);
}

void Optimizer::rebind() {
  // Unbound (deferred) segments are left alone: they bind on first use, wherever their parameters are then.
  for (std::vector<Segment>& segs : segments_)
    for (Segment& seg : segs) {
      std::vector<Tensor> params = seg.flat.params();
      if (params.empty() || params.front().device() == seg.flat.device()) continue;
      seg.flat = FlatBuffer(std::move(params));
      for (auto& [name, t] : seg.state) t = t.to(seg.flat.device());
    }
}

std::vector<const FlatBuffer*> Optimizer::flat_buffers(size_t group) const {
  bind_deferred();
  std::vector<const FlatBuffer*> out;
  for (const Segment& seg : segments_.at(group)) out.push_back(&seg.flat);
  return out;
}

Tensor& Optimizer::state_buffer(Segment& seg, const std::string& name) {
  bind_deferred();
  auto it = seg.state.find(name);
  if (it != seg.state.end()) return it->second;
  const DType dt = is_low_precision(seg.flat.dtype()) ? DType::Float32 : seg.flat.dtype();
  Tensor t = Tensor::empty({seg.flat.numel()}, dt, seg.flat.device());
  allocator_for(t.device()).memset_zero(t.data_ptr(), t.nbytes());
  return seg.state.emplace(name, std::move(t)).first->second;
}

OptimizerState Optimizer::state_dict() const {
  bind_deferred();
  OptimizerState out;
  out.meta["type"] = type_;
  out.meta["state"] = json::object();
  json groups = json::array();
  for (size_t g = 0; g < groups_.size(); ++g) {
    json o = groups_[g].options;
    json ids = json::array();
    for (const Segment& seg : segments_[g])
      for (size_t gi : seg.index) ids.push_back(gi);
    std::sort(ids.begin(), ids.end());
    o["params"] = ids;
    groups.push_back(o);
    const std::vector<std::string> names = state_names(groups_[g].options);
    for (const Segment& seg : segments_[g]) {
      for (size_t k = 0; k < seg.index.size(); ++k) {
        const size_t gi = seg.index[k];
        if (steps_[gi] == 0) continue;
        out.meta["state"][std::to_string(gi)] = {{"step", steps_[gi]}};
        const Shape& shape = seg.flat.params()[k].shape();
        for (const std::string& name : names) {
          auto it = seg.state.find(name);
          if (it == seg.state.end()) continue;
          out.tensors["state." + std::to_string(gi) + "." + name] =
              make_view(it->second, shape, contiguous_strides(shape), it->second.offset() + seg.flat.offset(k));
        }
      }
    }
  }
  out.meta["param_groups"] = groups;
  return out;
}

void Optimizer::load_state_dict(const OptimizerState& state) {
  bind_deferred();
  const json& meta = state.meta;
  BOOSTER_CHECK(meta.is_object() && meta.contains("param_groups") && meta.at("param_groups").is_array(),
                CheckpointError, type_, ".load_state_dict: the state has no 'param_groups' list");
  if (meta.contains("type"))
    BOOSTER_CHECK(meta.at("type") == type_, CheckpointError, type_, ".load_state_dict: the state was saved by ",
                  meta.at("type").dump(), ", not ", type_);
  const json& saved_groups = meta.at("param_groups");
  BOOSTER_CHECK(saved_groups.size() == groups_.size(), CheckpointError, type_,
                ".load_state_dict: loaded state dict has a different number of parameter groups (",
                saved_groups.size(), " saved, ", groups_.size(), " in this optimizer)");

  // Validate everything first; nothing changes unless the whole state fits.
  std::vector<json> new_options;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const json& sg = saved_groups[g];
    BOOSTER_CHECK(sg.is_object() && sg.contains("params") && sg.at("params").is_array(), CheckpointError, type_,
                  ".load_state_dict: parameter group ", g, " has no 'params' list");
    BOOSTER_CHECK(sg.at("params").size() == groups_[g].params.size(), CheckpointError, type_,
                  ".load_state_dict: parameter group ", g, " has ", sg.at("params").size(),
                  " parameters in the saved state but ", groups_[g].params.size(), " in this optimizer");
    json o = sg;
    o.erase("params");
    try {
      new_options.push_back(complete_options(o));
    } catch (const Error& e) {
      BOOSTER_FAIL(CheckpointError, type_, ".load_state_dict: parameter group ", g, ": ", e.what());
    }
  }
  struct Where {
    size_t group, seg, local;
  };
  std::vector<Where> where(steps_.size());
  for (size_t g = 0; g < segments_.size(); ++g)
    for (size_t s = 0; s < segments_[g].size(); ++s)
      for (size_t k = 0; k < segments_[g][s].index.size(); ++k) where[segments_[g][s].index[k]] = {g, s, k};

  std::vector<int64_t> new_steps(steps_.size(), 0);
  const json empty = json::object();
  const json& saved_state = meta.contains("state") ? meta.at("state") : empty;
  for (auto it = saved_state.begin(); it != saved_state.end(); ++it) {
    size_t gi = 0;
    std::string dummy;
    BOOSTER_CHECK(parse_state_key("state." + it.key() + ".x", gi, dummy) && gi < steps_.size(), CheckpointError,
                  type_, ".load_state_dict: state for parameter '", it.key(), "' but this optimizer has ",
                  steps_.size(), " parameters");
    if (it.value().contains("step")) new_steps[gi] = it.value().at("step").get<int64_t>();
  }
  for (const auto& [key, t] : state.tensors) {
    size_t gi = 0;
    std::string name;
    BOOSTER_CHECK(parse_state_key(key, gi, name), CheckpointError, type_, ".load_state_dict: unexpected key '",
                  key, "' (expected state.<index>.<name>)");
    BOOSTER_CHECK(gi < steps_.size(), CheckpointError, type_, ".load_state_dict: key '", key,
                  "' names parameter ", gi, " but this optimizer has ", steps_.size(), " parameters");
    const Where w = where[gi];
    const std::vector<std::string> names = state_names(new_options[w.group]);
    BOOSTER_CHECK(std::find(names.begin(), names.end(), name) != names.end(), CheckpointError, type_,
                  ".load_state_dict: unexpected state '", key, "' for these options (expected ", names, ")");
    const Tensor& p = segments_[w.group][w.seg].flat.params()[w.local];
    BOOSTER_CHECK(t.shape() == p.shape(), CheckpointError, type_, ".load_state_dict: '", key, "' has shape ",
                  t.shape(), " but parameter ", gi, p.name().empty() ? "" : " ('" + p.name() + "')",
                  " has shape ", p.shape());
    if (new_steps[gi] == 0) new_steps[gi] = 1;  // state without a step count (SGD from elsewhere)
  }
  for (size_t gi = 0; gi < steps_.size(); ++gi) {
    if (new_steps[gi] == 0) continue;
    const Where w = where[gi];
    for (const std::string& name : state_names(new_options[w.group]))
      BOOSTER_CHECK(state.tensors.count("state." + std::to_string(gi) + "." + name), CheckpointError, type_,
                    ".load_state_dict: missing 'state.", gi, ".", name, "' for parameter ", gi, " (which took ",
                    new_steps[gi], " steps)");
  }

  // Apply.
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].options = new_options[g];
    for (Segment& seg : segments_[g])
      for (auto& [name, buf] : seg.state) allocator_for(buf.device()).memset_zero(buf.data_ptr(), buf.nbytes());
  }
  NoGradGuard no_grad;
  for (const auto& [key, t] : state.tensors) {
    size_t gi = 0;
    std::string name;
    parse_state_key(key, gi, name);
    const Where w = where[gi];
    Segment& seg = segments_[w.group][w.seg];
    Tensor& buf = state_buffer(seg, name);
    const Shape& shape = t.shape();
    make_view(buf, shape, contiguous_strides(shape), buf.offset() + seg.flat.offset(w.local)).copy_(t);
  }
  steps_ = new_steps;
}

// ------------------------------------------------------------------------------------------ factory

std::unique_ptr<Optimizer> make_optimizer(const json& cfg, std::vector<Tensor> params) {
  BOOSTER_CHECK(cfg.is_object(), ConfigError, "optimizer: the configuration must be a JSON object, got ",
                cfg.dump());
  BOOSTER_CHECK(cfg.contains("type") && cfg.at("type").is_string(), ConfigError,
                "optimizer: missing \"type\" (one of sgd, adam, adamw) in ", cfg.dump());
  std::string type = cfg.at("type").get<std::string>();
  std::transform(type.begin(), type.end(), type.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  json options = cfg;
  options.erase("type");
  if (type == "sgd") return std::make_unique<SGD>(std::move(params), options);
  if (type == "adam") return std::make_unique<Adam>(std::move(params), options);
  if (type == "adamw") return std::make_unique<AdamW>(std::move(params), options);
  BOOSTER_FAIL(ConfigError, "optimizer: unknown type '", cfg.at("type").get<std::string>(),
               "'; valid types are: sgd, adam, adamw");
}

}  // namespace booster::optim
