// torch.optim.Adam and AdamW (1.13) as one fused kernel per run of parameters (kernels/fused.h).
#include <cmath>

#include "booster/autograd/autograd.h"
#include "booster/kernels/fused.h"
#include "booster/optim/optimizer.h"

namespace booster::optim {

using nlohmann::json;

json AdamOptions::to_json() const {
  json o = {{"lr", lr}, {"betas", {betas[0], betas[1]}}, {"eps", eps}, {"amsgrad", amsgrad}};
  if (!std::isnan(weight_decay)) o["weight_decay"] = weight_decay;
  return o;
}

namespace {
json adam_defaults(double weight_decay) {
  return {{"lr", 1e-3}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", weight_decay}, {"amsgrad", false}};
}

std::vector<ParamGroup> one_group(std::vector<Tensor> params) {
  std::vector<ParamGroup> groups;
  groups.push_back(ParamGroup{std::move(params), json::object()});
  return groups;
}
}  // namespace

Adam::Adam(std::string type, bool decoupled, double default_weight_decay)
    : Optimizer(std::move(type), adam_defaults(default_weight_decay)), decoupled_(decoupled) {}

Adam::Adam(std::vector<Tensor> params, const AdamOptions& options) : Adam(std::move(params), options.to_json()) {}

Adam::Adam(std::vector<Tensor> params, const json& options) : Adam("Adam", false, 0.0) {
  defaults_ = complete_options(options);
  add_groups(one_group(std::move(params)));
}

Adam::Adam(std::vector<ParamGroup> groups, const json& defaults) : Adam("Adam", false, 0.0) {
  defaults_ = complete_options(defaults);
  add_groups(std::move(groups));
}

AdamW::AdamW(std::vector<Tensor> params, const AdamOptions& options) : AdamW(std::move(params), options.to_json()) {}

AdamW::AdamW(std::vector<Tensor> params, const json& options) : Adam("AdamW", true, 1e-2) {
  defaults_ = complete_options(options);
  add_groups(one_group(std::move(params)));
}

AdamW::AdamW(std::vector<ParamGroup> groups, const json& defaults) : Adam("AdamW", true, 1e-2) {
  defaults_ = complete_options(defaults);
  add_groups(std::move(groups));
}

void Adam::check_options(const json& o) const {
  const double lr = num(o, "lr"), eps = num(o, "eps"), wd = num(o, "weight_decay");
  const double b0 = o.at("betas")[0].get<double>(), b1 = o.at("betas")[1].get<double>();
  BOOSTER_CHECK(lr >= 0.0, ValueError, "Invalid learning rate: ", lr);
  BOOSTER_CHECK(eps >= 0.0, ValueError, "Invalid epsilon value: ", eps);
  BOOSTER_CHECK(b0 >= 0.0 && b0 < 1.0, ValueError, "Invalid beta parameter at index 0: ", b0);
  BOOSTER_CHECK(b1 >= 0.0 && b1 < 1.0, ValueError, "Invalid beta parameter at index 1: ", b1);
  BOOSTER_CHECK(wd >= 0.0, ValueError, "Invalid weight_decay value: ", wd);
}

std::vector<std::string> Adam::state_names(const json& o) const {
  if (flag(o, "amsgrad")) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

void Adam::step() {
  NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const json& o = groups_[g].options;
    const double lr = num(o, "lr"), eps = num(o, "eps"), wd = num(o, "weight_decay");
    const double beta1 = o.at("betas")[0].get<double>(), beta2 = o.at("betas")[1].get<double>();
    const bool amsgrad = flag(o, "amsgrad");
    for_each_run(g, [&](Segment& seg, const Run& run) {
      Tensor& m = state_buffer(seg, "exp_avg");
      Tensor& v = state_buffer(seg, "exp_avg_sq");
      Tensor* vmax = amsgrad ? &state_buffer(seg, "max_exp_avg_sq") : nullptr;
      // Scalars in double, as torch computes them in Python, then rounded to the state's precision.
      const double step = double(run.step);
      const double bias_correction1 = 1.0 - std::pow(beta1, step);
      const double bias_correction2 = 1.0 - std::pow(beta2, step);
      const kernels::AdamStep s{beta1, beta2, 1.0 - beta1, 1.0 - beta2, wd, 1.0 - lr * wd, -(lr / bias_correction1),
                                std::sqrt(bias_correction2), eps, decoupled_, amsgrad};
      const int64_t len = run.end - run.begin;
      Tensor p = seg.flat.data().narrow(0, run.begin, len), m_run = m.narrow(0, run.begin, len);
      Tensor v_run = v.narrow(0, run.begin, len);
      Tensor vmax_run = vmax ? vmax->narrow(0, run.begin, len) : Tensor();
      kernels::adam_kernel(seg.flat.device())(s, p, seg.flat.grad().narrow(0, run.begin, len), m_run, v_run, vmax_run);
    });
  }
}

}  // namespace booster::optim
