// "fp8": the chosen Linear layers compute their GEMMs from float8 inputs (HYBRID: e4m3 input and weight
// forward, e5m2 output gradient backward, float32 accumulation, per-tensor current or delayed scaling;
// Note [Float8 scaling] in float8.h); everything else runs under bfloat16 autocast. The parameters stay
// float32 and are the master weights; no loss scaling (the per-tensor scales take its place). The
// scaling state of every fp8 layer is part of the strategy's state, so resume is exact.
#include "booster/mixed_precision/float8.h"
#include "booster/mixed_precision/precision_strategy.h"

namespace booster::mixed_precision {
namespace {

std::vector<std::string> string_list(OptionReader& r, const std::string& key, std::vector<std::string> fallback) {
  const nlohmann::json v = r.raw(key, fallback);
  BOOSTER_CHECK(v.is_array(), ConfigError, "mixed precision 'fp8': option '", key,
                "' must be a list of module paths (glob patterns such as \"blocks.*.mlp.*\"), got ", v.dump());
  std::vector<std::string> out;
  for (const auto& e : v) {
    BOOSTER_CHECK(e.is_string() && !e.get<std::string>().empty(), ConfigError, "mixed precision 'fp8': option '",
                  key, "' must list non-empty strings, got ", e.dump());
    out.push_back(e.get<std::string>());
  }
  return out;
}

class Float8Strategy final : public PrecisionStrategy {
 public:
  Float8Strategy(const OptionReader& reader, nlohmann::json values, PrecisionRecipe recipe,
                 std::shared_ptr<Float8Linears> linears)
      : PrecisionStrategy(reader, std::move(values), std::move(recipe)), linears_(std::move(linears)) {}

  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion) override {
    BOOSTER_CHECK(model != nullptr, ValueError, "fp8: configure needs a model");
    linears_->bind(*model);
    return PrecisionStrategy::configure(std::move(model), std::move(optimizer), std::move(criterion));
  }

  void step(optim::Optimizer& optimizer) override {
    PrecisionStrategy::step(optimizer);
    linears_->end_step(amax_reducer_);  // Note [Agreeing on amax]
  }

  MixedPrecisionState state_dict() const override {
    MixedPrecisionState s = PrecisionStrategy::state_dict();
    s.meta["float8_layers"] = linears_->layer_names();
    for (auto& [k, t] : linears_->state_dict()) s.tensors[k] = t;
    return s;
  }

  void load_state_dict(const MixedPrecisionState& state) override {
    PrecisionStrategy::load_state_dict(state);
    linears_->load_state_dict(state.tensors);
  }

 private:
  std::shared_ptr<Float8Linears> linears_;
};

std::unique_ptr<MixedPrecision> make_fp8(const nlohmann::json& options) {
  OptionReader r("fp8", options);
  Float8LinearOptions o;
  const std::string format = r.choice("format", "hybrid", {"hybrid"});
  const std::string scaling = r.choice("scaling", "delayed", {"delayed", "current"});
  o.scaling.delayed = scaling == "delayed";
  o.scaling.amax_history_len = r.integer("amax_history_len", 1024, 1, 1 << 20);
  o.scaling.amax_compute_algo = r.choice("amax_compute_algo", "max", {"max", "most_recent"});
  o.scaling.margin = int(r.integer("margin", 0, 0, 32));
  o.layers = string_list(r, "layers", {"*"});
  o.exclude = string_list(r, "exclude", {});
  o.min_size = r.integer("min_size", 0, 0, int64_t(1) << 62);
  o.lm_head = r.flag("lm_head", false);
  const nlohmann::json values = {{"format", format},
                                 {"scaling", scaling},
                                 {"amax_history_len", o.scaling.amax_history_len},
                                 {"amax_compute_algo", o.scaling.amax_compute_algo},
                                 {"margin", o.scaling.margin},
                                 {"layers", o.layers},
                                 {"exclude", o.exclude},
                                 {"min_size", o.min_size},
                                 {"lm_head", o.lm_head}};
  auto linears = std::make_shared<Float8Linears>(o);
  PrecisionRecipe recipe;
  recipe.autocast_dtype = DType::BFloat16;
  recipe.linear_override = linears;
  return std::make_unique<Float8Strategy>(r, values, recipe, linears);
}

const Registrar fp8_registrar("fp8", make_fp8);

}  // namespace
}  // namespace booster::mixed_precision
