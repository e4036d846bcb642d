// LR schedulers: StepLR and CosineAnnealingLR against PyTorch 1.13 sequences, LinearWarmup against its
// documented formula, state_dict round trips and configuration errors.
#include <catch2/catch.hpp>

#include <cmath>
#include <numbers>

#include "booster/ops/ops.h"
#include "booster/optim/lr_scheduler.h"
#include "fixture.h"

using namespace booster;
using namespace booster::optim;
using nlohmann::json;

namespace {

// Two groups with lr 0.1 and 0.05, as in the fixture script.
struct TwoGroups {
  Tensor a = zeros({2}).requires_grad_(), b = zeros({3}).requires_grad_();
  SGD opt{{ParamGroup{{a}, {{"lr", 0.1}}}, ParamGroup{{b}, {{"lr", 0.05}}}}, json{{"lr", 0.1}}};
};

json scheduler_cfg(const json& c) {
  json cfg = c.at("options");
  cfg["type"] = c.at("type");
  return cfg;
}

}  // namespace

TEST_CASE("StepLR and CosineAnnealingLR reproduce torch's lr sequences", "[optim]") {
  const json fx = testing::load_fixture_json("optim.json");
  for (const char* name : {"scheduler.step_lr", "scheduler.cosine", "scheduler.cosine_no_min"}) {
    const json& c = fx.at(name);
    TwoGroups tg;
    auto sched = make_scheduler(scheduler_cfg(c), tg.opt);
    const json& lrs = c.at("lrs");
    for (size_t k = 0; k < lrs.size(); ++k) {
      if (k > 0) sched->step();
      const auto want = lrs[k].get<std::vector<double>>();
      INFO(name << " after " << k << " steps");
      REQUIRE(sched->last_epoch() == int64_t(k));
      for (size_t g = 0; g < 2; ++g) {
        REQUIRE(sched->get_last_lr()[g] == Approx(want[g]).epsilon(1e-13).margin(1e-16));
        REQUIRE(tg.opt.lr(g) == sched->get_last_lr()[g]);
      }
    }
    REQUIRE(sched->base_lrs() == std::vector<double>{0.1, 0.05});
    REQUIRE(tg.opt.param_groups()[1].options.at("initial_lr") == 0.05);
  }
}

TEST_CASE("LinearWarmup follows its documented formula", "[optim]") {
  const double pi = std::numbers::pi;
  SECTION("cosine decay to a ratio") {
    TwoGroups tg;
    LinearWarmup s(tg.opt, {.warmup_steps = 4, .total_steps = 12, .decay = "cosine", .min_lr_ratio = 0.1});
    for (int64_t step = 0; step <= 15; ++step) {
      if (step > 0) s.step();
      double f;
      if (step < 4) f = double(step) / 4;
      else f = 0.1 + 0.9 * 0.5 * (1 + std::cos(pi * std::min(1.0, double(step - 4) / 8)));
      INFO("step " << step);
      REQUIRE(s.get_last_lr()[0] == Approx(0.1 * f).margin(1e-15));
      REQUIRE(s.get_last_lr()[1] == Approx(0.05 * f).margin(1e-15));
    }
    REQUIRE(s.get_last_lr()[0] == Approx(0.01));  // floor after total_steps
  }
  SECTION("linear decay to an absolute minimum, with a start factor") {
    TwoGroups tg;
    auto s = make_scheduler(json{{"type", "linear_warmup"}, {"warmup_steps", 2}, {"total_steps", 6},
                                 {"decay", "linear"}, {"min_lr", 0.01}, {"start_factor", 0.5}},
                            tg.opt);
    const std::vector<double> want0{0.05, 0.075, 0.1, 0.1 - 0.09 / 4, 0.1 - 0.09 / 2, 0.1 - 0.09 * 3 / 4, 0.01, 0.01};
    const std::vector<double> want1{0.025, 0.0375, 0.05, 0.05 - 0.04 / 4, 0.05 - 0.04 / 2, 0.05 - 0.04 * 3 / 4, 0.01};
    for (size_t k = 0; k < want0.size(); ++k) {
      if (k > 0) s->step();
      INFO("step " << k);
      REQUIRE(s->get_last_lr()[0] == Approx(want0[k]).margin(1e-15));
      if (k < want1.size()) REQUIRE(s->get_last_lr()[1] == Approx(want1[k]).margin(1e-15));
    }
  }
  SECTION("no warmup starts at the base lr") {
    TwoGroups tg;
    LinearWarmup s(tg.opt, {.warmup_steps = 0, .total_steps = 10, .decay = "linear"});
    REQUIRE(s.get_last_lr()[0] == 0.1);
    s.step();
    REQUIRE(s.get_last_lr()[0] == Approx(0.09));
  }
}

TEST_CASE("scheduler state_dict round trip continues the sequence", "[optim]") {
  for (const json& cfg : {json{{"type", "step"}, {"step_size", 2}, {"gamma", 0.5}},
                          json{{"type", "cosine"}, {"T_max", 4}, {"eta_min", 0.001}},
                          json{{"type", "linear_warmup"}, {"warmup_steps", 3}, {"total_steps", 9}}}) {
    INFO(cfg.dump());
    TwoGroups straight;
    auto s1 = make_scheduler(cfg, straight.opt);
    for (int k = 0; k < 10; ++k) s1->step();

    TwoGroups first;
    auto s2 = make_scheduler(cfg, first.opt);
    for (int k = 0; k < 5; ++k) s2->step();
    const json saved = s2->state_dict();
    const OptimizerState opt_saved = first.opt.state_dict();

    TwoGroups second;
    second.opt.load_state_dict(opt_saved);  // lr and initial_lr of the groups come back here
    auto s3 = make_scheduler(cfg, second.opt);
    s3->load_state_dict(saved);
    second.opt.load_state_dict(opt_saved);  // undo the new scheduler's initial step
    REQUIRE(s3->last_epoch() == 5);
    for (int k = 0; k < 5; ++k) s3->step();
    REQUIRE(s3->get_last_lr() == s1->get_last_lr());
    REQUIRE(second.opt.lr(1) == straight.opt.lr(1));
  }
  TwoGroups tg;
  StepLR step(tg.opt, 3);
  REQUIRE_THROWS_WITH(step.load_state_dict(json{{"type", "CosineAnnealingLR"}, {"base_lrs", {0.1, 0.05}},
                                                {"last_epoch", 2}}),
                      Catch::Contains("saved by \"CosineAnnealingLR\""));
  REQUIRE_THROWS_WITH(step.load_state_dict(json{{"type", "StepLR"}, {"base_lrs", {0.1}}, {"last_epoch", 2},
                                                {"step_size", 3}, {"gamma", 0.1}}),
                      Catch::Contains("1 base lrs") && Catch::Contains("2 param groups"));
}

TEST_CASE("bad scheduler configurations throw naming the key", "[optim]") {
  TwoGroups tg;
  REQUIRE_THROWS_WITH(make_scheduler(json{{"type", "exponential"}}, tg.opt),
                      Catch::Contains("'exponential'") && Catch::Contains("step, cosine, linear_warmup"));
  REQUIRE_THROWS_WITH(make_scheduler(json{{"type", "step"}, {"step_size", 2}, {"gama", 0.5}}, tg.opt),
                      Catch::Contains("unknown key 'gama'") && Catch::Contains("step_size, gamma"));
  REQUIRE_THROWS_WITH(make_scheduler(json{{"type", "cosine"}}, tg.opt), Catch::Contains("missing required key 'T_max'"));
  REQUIRE_THROWS_WITH(make_scheduler(json{{"type", "step"}, {"step_size", 2.5}}, tg.opt),
                      Catch::Contains("'step_size' must be an integer"));
  REQUIRE_THROWS_AS(make_scheduler(json{{"type", "step"}, {"step_size", 0}}, tg.opt), ValueError);
  REQUIRE_THROWS_AS(make_scheduler(json{{"type", "cosine"}, {"T_max", 0}}, tg.opt), ValueError);
  REQUIRE_THROWS_WITH(make_scheduler(json{{"type", "linear_warmup"}, {"warmup_steps", 5}, {"total_steps", 10},
                                          {"decay", "exp"}},
                                     tg.opt),
                      Catch::Contains("unknown decay 'exp'"));
  REQUIRE_THROWS_AS(make_scheduler(json{{"type", "linear_warmup"}, {"warmup_steps", 5}, {"total_steps", 3}}, tg.opt),
                    ValueError);
  REQUIRE_THROWS_WITH(make_scheduler(json{{"type", "linear_warmup"}, {"warmup_steps", 1}, {"total_steps", 3},
                                          {"min_lr", 0.0}, {"min_lr_ratio", 0.1}},
                                     tg.opt),
                      Catch::Contains("not both"));
  // Resuming (last_epoch != -1) needs initial_lr in every group.
  Tensor p = zeros({1}).requires_grad_();
  SGD fresh({p}, SGDOptions{.lr = 0.1});
  REQUIRE_THROWS_WITH(StepLR(fresh, 2, 0.1, 4), Catch::Contains("initial_lr"));
}
