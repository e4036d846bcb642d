// Pipeline schedules (Note [Pipeline schedules] in booster/nn/pipeline.cpp) checked as lists: every
// micro-batch runs forward then backward exactly once on every stage; running the stages' lists against
// each other (a stage goes on only when the message its next action needs has been sent) finishes for
// every shape, so no stage can wait for ever; 1F1B holds at most P - s micro-batches' activations on
// stage s, GPipe all of them. A one-stage pipeline's micro-batched step gives the whole batch's loss
// and gradients (the stages on several ranks are tests/mpi/test_mpi_pipeline.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "booster/distributed/local_process_group.h"
#include "booster/nn/container.h"
#include "booster/nn/loss.h"
#include "booster/nn/models.h"
#include "booster/nn/pipeline.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"
#include "roundoff.h"

using namespace booster;
using namespace booster::nn::pp;
using Kind = PipelineAction::Kind;

namespace {

struct Simulation {
  bool finished = false;
  std::vector<int> max_in_flight;  // per stage: micro-batches forward but not yet backward
};

// Runs the stages' action lists against each other. F(i) on stage s > 0 needs stage s - 1 to have run
// F(i); B(i) on stage s < P - 1 needs stage s + 1 to have run B(i). Sends never block.
Simulation simulate(Schedule schedule, int stages, int m) {
  std::vector<std::vector<PipelineAction>> lists;
  for (int s = 0; s < stages; ++s) lists.push_back(schedule_actions(schedule, s, stages, m));
  std::vector<size_t> next(size_t(stages), 0);
  const size_t p = static_cast<size_t>(stages), n = static_cast<size_t>(m);
  std::vector<std::vector<bool>> forward_done(p, std::vector<bool>(n)), backward_done(p, std::vector<bool>(n));
  Simulation result;
  result.max_in_flight.assign(size_t(stages), 0);
  std::vector<int> in_flight(size_t(stages), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      if (next[size_t(s)] == lists[size_t(s)].size()) continue;
      const PipelineAction a = lists[size_t(s)][next[size_t(s)]];
      const size_t i = size_t(a.microbatch);
      const bool ready = a.kind == Kind::Forward ? (s == 0 || forward_done[size_t(s - 1)][i])
                                                  : (s == stages - 1 || backward_done[size_t(s + 1)][i]);
      if (!ready) continue;
      if (a.kind == Kind::Forward) {
        forward_done[size_t(s)][i] = true;
        result.max_in_flight[size_t(s)] = std::max(result.max_in_flight[size_t(s)], ++in_flight[size_t(s)]);
      } else {
        REQUIRE(forward_done[size_t(s)][i]);  // a backward only after its forward
        backward_done[size_t(s)][i] = true;
        --in_flight[size_t(s)];
      }
      ++next[size_t(s)];
      progress = true;
    }
  }
  result.finished = true;
  for (int s = 0; s < stages; ++s) result.finished &= next[size_t(s)] == lists[size_t(s)].size();
  return result;
}

}  // namespace

TEST_CASE("pipeline schedules: every micro-batch once each way, no stage waits for ever, 1F1B bounds memory",
          "[pipeline]") {
  for (Schedule schedule : {Schedule::OneFOneB, Schedule::GPipe}) {
    for (int stages = 1; stages <= 6; ++stages) {
      for (int m = 1; m <= 9; ++m) {
        INFO((schedule == Schedule::GPipe ? "gpipe" : "1f1b") << ", " << stages << " stages, " << m << " micro-batches");
        for (int s = 0; s < stages; ++s) {
          const std::vector<PipelineAction> actions = schedule_actions(schedule, s, stages, m);
          REQUIRE(actions.size() == size_t(2 * m));
          for (int i = 0; i < m; ++i) {
            REQUIRE(std::count(actions.begin(), actions.end(), PipelineAction{Kind::Forward, i}) == 1);
            REQUIRE(std::count(actions.begin(), actions.end(), PipelineAction{Kind::Backward, i}) == 1);
          }
        }
        const Simulation sim = simulate(schedule, stages, m);
        REQUIRE(sim.finished);
        for (int s = 0; s < stages; ++s)
          CHECK(sim.max_in_flight[size_t(s)] == (schedule == Schedule::GPipe ? m : std::min(stages - s, m)));
      }
    }
  }
  // Megatron-LM's 1F1B for 4 stages and 8 micro-batches, stage 1: 2 warm-up forwards.
  const std::vector<PipelineAction> stage1 = schedule_actions(Schedule::OneFOneB, 1, 4, 8);
  CHECK(stage1[0] == PipelineAction{Kind::Forward, 0});
  CHECK(stage1[1] == PipelineAction{Kind::Forward, 1});
  CHECK(stage1[2] == PipelineAction{Kind::Forward, 2});
  CHECK(stage1[3] == PipelineAction{Kind::Backward, 0});
  CHECK(stage1.back() == PipelineAction{Kind::Backward, 7});
  CHECK_THROWS_AS(schedule_actions(Schedule::OneFOneB, 4, 4, 8), ValueError);
  CHECK_THROWS_AS(schedule_actions(Schedule::GPipe, 0, 2, 0), ValueError);
  CHECK(parse_schedule("gpipe") == Schedule::GPipe);
  CHECK_THROWS_WITH(parse_schedule("interleaved"), Catch::Contains("\"interleaved\"") && Catch::Contains("1f1b"));
}

// Micro-batches sum the loss and the gradients in another order than the whole batch: the bounds are
// Note [Roundoff bounds]'s (tests/roundoff.h) for this MLP (Linears of 6 and 8 inputs, 3 classes, 12
// rows), per tensor in L2.
TEST_CASE("pipeline: one stage's micro-batched step gives the whole batch's loss and gradients",
          "[pipeline][roundoff]") {
  namespace ro = ::testing::roundoff;
  const double forward = ro::mlp_forward_length({6, 8}, 3, 12);
  const double eps_forward = ro::reduction_bound({forward}), eps_gradient = ro::reduction_bound({2 * forward, 12});
  auto relative_l2 = [](const std::vector<double>& a, const std::vector<double>& b) {
    double diff = 0, scale = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      diff += (a[i] - b[i]) * (a[i] - b[i]);
      scale += b[i] * b[i];
    }
    return std::sqrt(diff / std::max(scale, 1e-300));
  };
  distributed::LocalProcessGroup group;
  auto criterion = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
  Generator gen(5);
  const Tensor x = randn({12, 6}, &gen);
  const Tensor y = from_vector(std::vector<int64_t>{0, 1, 2, 0, 1, 2, 2, 1, 0, 0, 2, 1}, {12});
  auto reference = std::make_shared<nn::MLPClassifier>(6, std::vector<int64_t>{8}, 3, "relu", 3);
  const Tensor whole = criterion((*reference)(x), y);
  whole.backward();
  for (Schedule schedule : {Schedule::OneFOneB, Schedule::GPipe}) {
    auto model = std::make_shared<nn::MLPClassifier>(6, std::vector<int64_t>{8}, 3, "relu", 3);
    PipelineStage stage(model, group, {schedule, 4});
    const double loss = stage.train_step(x, y, criterion);
    CHECK(std::abs(loss - whole.item()) <= eps_forward * std::abs(whole.item()));
    const auto got = model->named_parameters(), want = reference->named_parameters();
    for (size_t k = 0; k < got.size(); ++k) {
      INFO(got[k].first);
      CHECK(relative_l2(got[k].second.grad().tolist(), want[k].second.grad().tolist()) <= eps_gradient);
    }
    // Evaluation, a micro-batch at a time (GEMMs of other sizes: float32 rounding apart).
    const std::vector<double> o = stage.forward(x).tolist(), w = (*model)(x).detach().tolist();
    REQUIRE(o.size() == w.size());
    CHECK(relative_l2(o, w) <= eps_forward);
  }
  PipelineStage uneven(reference, group, {Schedule::OneFOneB, 5});
  CHECK_THROWS_WITH(uneven.train_step(x, y, criterion), Catch::Contains("batch of 12") && Catch::Contains("5"));
}

namespace {

nn::GPTConfig tiny_gpt(int64_t layers) {
  nn::GPTConfig cfg;
  cfg.vocab_size = 32;
  cfg.context = 8;
  cfg.width = 16;
  cfg.layers = layers;
  cfg.heads = 2;
  return cfg;
}

}  // namespace

// Note [Cutting a GPT]: the balanced split against every split there is (an independent search), and
// the stages' parameters against the model's.
TEST_CASE("pipeline: a GPT is cut into stages that together hold it, balanced by parameters", "[pipeline]") {
  for (int64_t layers : {1, 2, 3, 5, 6}) {
    auto gpt = std::make_shared<nn::GPT>(tiny_gpt(layers), 1);
    const int64_t block = (*gpt->blocks)[0]->num_parameters();
    const int64_t first = gpt->wte->num_parameters() + gpt->wpe->num_parameters();
    const int64_t last = gpt->ln_f->num_parameters() + gpt->lm_head->num_parameters();
    for (int stages = 1; stages <= 4; ++stages) {
      INFO(layers << " layers, " << stages << " stages");
      // Every way to give the stages blocks, and the smallest largest stage among them.
      int64_t optimum = std::numeric_limits<int64_t>::max();
      std::vector<int64_t> split(size_t(stages), 0);
      std::function<void(int, int64_t)> each = [&](int s, int64_t left) {
        if (s == stages - 1) {
          split[size_t(s)] = left;
          int64_t worst = 0;
          for (int k = 0; k < stages; ++k)
            worst = std::max(worst, split[size_t(k)] * block + (k == 0 ? first : 0) + (k == stages - 1 ? last : 0));
          optimum = std::min(optimum, worst);
          return;
        }
        for (int64_t n = 0; n <= left; ++n) {
          split[size_t(s)] = n;
          each(s + 1, left - n);
        }
      };
      each(0, layers);
      const std::vector<int64_t> balanced = balance_gpt_layers(*gpt, stages);
      REQUIRE(balanced.size() == size_t(stages));
      int64_t worst = 0, total = 0;
      std::set<std::string> names;
      for (int s = 0; s < stages; ++s) {
        total += balanced[size_t(s)];
        const nn::ModulePtr part = gpt_stage(gpt, s, stages);
        int64_t params = 0;
        for (const auto& [name, p] : part->named_parameters()) {
          CHECK(names.insert(name).second);  // no parameter in two stages
          params += p.numel();
        }
        worst = std::max(worst, params);
      }
      CHECK(total == layers);
      CHECK(worst == optimum);
      // Together the stages hold the model, under its names.
      std::set<std::string> whole;
      for (const auto& [name, p] : gpt->named_parameters()) whole.insert(name);
      CHECK(names == whole);
    }
  }
  auto gpt = std::make_shared<nn::GPT>(tiny_gpt(3), 1);
  CHECK_THROWS_WITH(gpt_stage(gpt, 0, 2, {2, 2}), Catch::Contains("stage_layers [2, 2]") && Catch::Contains("3"));
  CHECK_THROWS_AS(gpt_stage(gpt, 0, 2, {4, -1}), ValueError);
  CHECK_THROWS_AS(gpt_stage(gpt, 0, 3, {1, 2}), ValueError);
  CHECK_THROWS_AS(gpt_stage(gpt, 2, 2), ValueError);
  // The stages run in turn give the model's logits.
  Generator gen(3);
  const Tensor ids = randint(0, 32, {2, 8}, &gen);
  Tensor h = ids;
  for (int s = 0; s < 3; ++s) h = (*gpt_stage(gpt, s, 3, {1, 1, 1}))(h);
  CHECK(h.tolist() == (*gpt)(ids).tolist());
}
