// Pipeline parallelism over MPI (`mpirun -np 2`: every TEST_CASE runs on every rank, in the same order):
// an MLP cut into one stage per rank, trained one step under 1F1B and GPipe with 4 micro-batches, gives
// each rank's parameters the gradients a single process computes for the whole model and batch
// (float32 sums in another order: within Note [Roundoff bounds] of tests/roundoff.h), the whole batch's
// loss on every rank, and the whole model's output on the last stage; a GPT cut into stages likewise.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "booster/distributed/process_group.h"
#include "booster/nn/container.h"
#include "booster/nn/loss.h"
#include "booster/nn/models.h"
#include "booster/nn/pipeline.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"
#include "roundoff.h"

using namespace booster;
using namespace booster::nn::pp;
namespace ro = ::testing::roundoff;

namespace {
// |a - b| / |b| over a tensor (L2): per tensor, so a near-zero element is not held to its own size.
double relative_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    scale += b[i] * b[i];
  }
  return std::sqrt(diff / std::max(scale, 1e-300));
}
}  // namespace

TEST_CASE("mpi pipeline: stages on the ranks give one process's loss, gradients and output", "[mpi][pipeline][roundoff]") {
  distributed::ProcessGroup& group = distributed::init_process_group("mpi");
  const int stages = group.size(), rank = group.rank();
  auto criterion = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
  Generator gen(11);
  const Tensor x = randn({16, 6}, &gen);
  std::vector<int64_t> labels;
  for (int i = 0; i < 16; ++i) labels.push_back((i * 7) % 3);
  const Tensor y = from_vector(labels, {16});
  // Every rank builds the same model from the same seed: layers 0..6 (Linear, ReLU, ..., Linear).
  auto make = [] { return std::make_shared<nn::MLPClassifier>(6, std::vector<int64_t>{16, 16, 16}, 3, "relu", 4); };
  auto reference = make();
  const Tensor whole_loss = criterion((*reference)(x), y);
  whole_loss.backward();
  const Tensor whole_out = (*reference)(x).detach();

  // The MLP's reductions (Linears of 6, 16, 16 and 16 inputs, 3 classes, 16 rows).
  const double forward = ro::mlp_forward_length({6, 16, 16, 16}, 3, 16);
  const double eps_forward = ro::reduction_bound({forward}), eps_gradient = ro::reduction_bound({2 * forward, 16});
  for (Schedule schedule : {Schedule::OneFOneB, Schedule::GPipe}) {
    INFO((schedule == Schedule::GPipe ? "gpipe" : "1f1b"));
    auto model = make();
    // Stage r takes an equal share of the 7 layers, cut before a Linear (the last stage the rest):
    // up to 4 stages each hold parameters.
    const size_t n = model->layers->size(), per = 2 * std::max<size_t>(1, (n + 1) / 2 / size_t(stages));
    const size_t begin = size_t(rank) * per, end = rank + 1 == stages ? n : begin + per;
    auto part = std::make_shared<nn::Sequential>();
    for (size_t i = begin; i < end; ++i) part->push_back(std::to_string(i), (*model->layers)[i]);
    PipelineStage stage(part, group, {schedule, 4});
    const double loss = stage.train_step(x, y, criterion);
    CHECK(std::abs(loss - whole_loss.item()) <= eps_forward * std::abs(whole_loss.item()));
    // This stage's parameters have the whole model's gradients.
    const auto mine = part->named_parameters();
    REQUIRE_FALSE(mine.empty());
    for (const auto& [name, p] : mine) {
      const std::string full_name = "layers." + name;
      INFO(full_name);
      Tensor want;
      for (const auto& [n2, q] : reference->named_parameters())
        if (n2 == full_name) want = q.grad();
      REQUIRE(want.defined());
      REQUIRE(p.grad().defined());
      CHECK(relative_l2(p.grad().tolist(), want.tolist()) <= eps_gradient);
    }
    const Tensor out = stage.forward(x);
    if (stage.is_last()) {
      const std::vector<double> o = out.tolist(), w = whole_out.tolist();
      REQUIRE(o.size() == w.size());
      CHECK(relative_l2(o, w) <= eps_forward);
    } else {
      CHECK_FALSE(out.defined());
    }
  }
}

// Note [Cutting a GPT]: the GPT cut into one balanced stage per rank (embeddings first, head last),
// trained one step under both schedules, gives every rank's parameters one process's gradients for the
// whole model and batch, and every rank the whole batch's loss.
TEST_CASE("mpi pipeline: a GPT cut into stages trains as one process does", "[mpi][pipeline][roundoff]") {
  distributed::ProcessGroup& group = distributed::init_process_group("mpi");
  nn::GPTConfig cfg;
  cfg.vocab_size = 32;
  cfg.context = 8;
  cfg.width = 16;
  cfg.layers = 4;
  cfg.heads = 2;
  Generator gen(21);
  const Tensor ids = randint(0, cfg.vocab_size, {8, cfg.context}, &gen);
  const Tensor targets = randint(0, cfg.vocab_size, {8, cfg.context}, &gen);
  auto criterion = [](const Tensor& logits, const Tensor& y) {
    return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
  };
  auto reference = std::make_shared<nn::GPT>(cfg, 5);
  const Tensor whole = criterion((*reference)(ids), targets);
  whole.backward();
  std::map<std::string, Tensor> want;
  for (const auto& [name, p] : reference->named_parameters()) want[name] = p.grad();

  // The GPT's reductions on 8 sequences of 8 (Note [Roundoff bounds]).
  const double forward = ro::gpt_forward_length(16, 4, 2, 8, 32, 8);
  const double eps_forward = ro::reduction_bound({forward}), eps_gradient = ro::reduction_bound({2 * forward, 64});
  for (Schedule schedule : {Schedule::OneFOneB, Schedule::GPipe}) {
    INFO((schedule == Schedule::GPipe ? "gpipe" : "1f1b"));
    auto gpt = std::make_shared<nn::GPT>(cfg, 5);
    PipelineStage stage(gpt_stage(gpt, group.rank(), group.size()), group, {schedule, 4});
    const double loss = stage.train_step(ids, targets, criterion);
    CHECK(std::abs(loss - whole.item()) <= eps_forward * std::abs(whole.item()));
    const auto mine = stage.module().named_parameters();
    REQUIRE_FALSE(mine.empty());
    for (const auto& [name, p] : mine) {
      INFO(name);
      REQUIRE(want.count(name));
      REQUIRE(p.grad().defined());
      CHECK(relative_l2(p.grad().tolist(), want.at(name).tolist()) <= eps_gradient);
    }
  }
}
