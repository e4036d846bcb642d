// torch.optim.SGD (1.13) as one fused kernel per run of parameters (kernels/fused.h).
#include "booster/autograd/autograd.h"
#include "booster/kernels/fused.h"
#include "booster/optim/optimizer.h"

namespace booster::optim {

using nlohmann::json;

json SGDOptions::to_json() const {
  json o = {{"momentum", momentum}, {"dampening", dampening}, {"weight_decay", weight_decay}, {"nesterov", nesterov}};
  if (!std::isnan(lr)) o["lr"] = lr;
  return o;
}

namespace {
json sgd_defaults() {
  return {{"lr", nullptr}, {"momentum", 0.0}, {"dampening", 0.0}, {"weight_decay", 0.0}, {"nesterov", false}};
}
}  // namespace

SGD::SGD(std::vector<Tensor> params, const SGDOptions& options) : SGD(std::move(params), options.to_json()) {}

SGD::SGD(std::vector<Tensor> params, const json& options) : Optimizer("SGD", sgd_defaults()) {
  std::vector<ParamGroup> groups;
  groups.push_back(ParamGroup{std::move(params), json::object()});
  defaults_ = complete_options(options);
  add_groups(std::move(groups));
}

SGD::SGD(std::vector<ParamGroup> groups, const json& defaults) : Optimizer("SGD", sgd_defaults()) {
  // Group options win over `defaults`, which may leave lr out when every group sets it; what it
  // does set is checked (keys, types, ranges) as a complete option set would be.
  json probe = defaults.is_null() ? json::object() : defaults;
  if (probe.is_object() && !probe.contains("lr")) probe["lr"] = 0.0;
  complete_options(probe);
  for (auto it = defaults.begin(); it != defaults.end(); ++it) defaults_[it.key()] = it.value();
  add_groups(std::move(groups));
}

void SGD::check_options(const json& o) const {
  const double lr = num(o, "lr"), momentum = num(o, "momentum"), dampening = num(o, "dampening"),
               wd = num(o, "weight_decay");
  BOOSTER_CHECK(lr >= 0.0, ValueError, "Invalid learning rate: ", lr);
  BOOSTER_CHECK(momentum >= 0.0, ValueError, "Invalid momentum value: ", momentum);
  BOOSTER_CHECK(wd >= 0.0, ValueError, "Invalid weight_decay value: ", wd);
  BOOSTER_CHECK(!flag(o, "nesterov") || (momentum > 0.0 && dampening == 0.0), ValueError,
                "Nesterov momentum requires a momentum and zero dampening (got momentum ", momentum,
                ", dampening ", dampening, ")");
}

std::vector<std::string> SGD::state_names(const json& o) const {
  if (num(o, "momentum") != 0.0) return {"momentum_buffer"};
  return {};
}

void SGD::load_state_dict(const OptimizerState& state) {
  Optimizer::load_state_dict(state);
  has_buffer_.assign(num_params(), 0);
  for (size_t gi = 0; gi < num_params(); ++gi)
    has_buffer_[gi] = state.tensors.count("state." + std::to_string(gi) + ".momentum_buffer") > 0;
}

void SGD::step() {
  NoGradGuard no_grad;
  has_buffer_.resize(num_params(), 0);
  for (size_t g = 0; g < groups_.size(); ++g) {
    const json& o = groups_[g].options;
    const double lr = num(o, "lr"), momentum = num(o, "momentum"), dampening = num(o, "dampening"),
                 wd = num(o, "weight_decay");
    const bool nesterov = flag(o, "nesterov");
    for_each_run(g, [&](Segment& seg, const Run& run) {
      Tensor* buf = momentum != 0.0 ? &state_buffer(seg, "momentum_buffer") : nullptr;
      // Runs break where has_buffer_ changes (run_key), so the run's first parameter speaks for all.
      const bool first = !has_buffer_[seg.index[run.first_param]];
      const kernels::SGDStep s{-lr, wd, momentum, 1.0 - dampening, nesterov, first};
      const int64_t len = run.end - run.begin;
      Tensor p = seg.flat.data().narrow(0, run.begin, len);
      Tensor b_run = buf ? buf->narrow(0, run.begin, len) : Tensor();
      kernels::sgd_kernel(seg.flat.device())(s, p, seg.flat.grad().narrow(0, run.begin, len), b_run);
      if (buf)
        for (size_t k = run.first_param; k < run.end_param; ++k) has_buffer_[seg.index[k]] = 1;
    });
  }
}

}  // namespace booster::optim
