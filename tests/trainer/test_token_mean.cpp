// The loss of a step over masked targets (sft data: ignore_index on prompts and padding) is the mean over
// the non-ignored targets of the whole batch, however it is split into micro-batches (Note [The token
// mean of a global batch] in booster/trainer/trainer.cpp). The model is a table of logits (an Embedding
// whose row for token t is the logits after t), so the reference is closed-form in float64:
//     loss = sum_i (lse(E[x_i]) - E[x_i][y_i]) / N,   dloss/dE[r] = sum_{i: x_i = r} (softmax(E[r]) - e_{y_i}) / N
// over the N targets that are not -100. One SGD step with lr 1 moves E by exactly that gradient. And
// records of prompts of varied lengths, rendered, masked and trained on as booster's sft data, against
// PyTorch's loss with Hugging Face's num_items_in_batch (tests/fixtures/make_sft_fixtures.py).
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/data/data.h"
#include "booster/data/sft.h"
#include "booster/nn/embedding.h"
#include "booster/nn/loss.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"
#include "booster/trainer/trainer.h"
#include "fixture.h"
#include "roundoff.h"
#include "sft_bytes.h"

using namespace booster;
using nlohmann::json;
namespace ro = ::testing::roundoff;

namespace {

constexpr int64_t kVocab = 7, kSamples = 8, kLen = 6;

class TableLM : public nn::Module {
 public:
  explicit TableLM(uint64_t seed, int64_t vocab = kVocab) {
    Generator gen(seed);
    table_ = register_module("table", std::make_shared<nn::Embedding>(vocab, vocab, &gen));
  }
  Tensor forward(const Tensor& x) override { return (*table_)(x); }
  std::string name() const override { return "TableLM"; }

 private:
  std::shared_ptr<nn::Embedding> table_;
};

// Sample i trains on its last k_i targets (1 to kLen: a prompt of varied length), the rest -100.
data::DatasetPtr masked_tokens() {
  const int64_t keep[kSamples] = {1, 6, 2, 5, 3, 1, 4, 6};
  Generator gen(21);
  std::vector<int64_t> x(size_t(kSamples * kLen)), y(size_t(kSamples * kLen));
  for (int64_t s = 0; s < kSamples; ++s)
    for (int64_t t = 0; t < kLen; ++t) {
      x[size_t(s * kLen + t)] = int64_t(gen.uniform() * kVocab) % kVocab;
      y[size_t(s * kLen + t)] = t >= kLen - keep[s] ? int64_t(gen.uniform() * kVocab) % kVocab : -100;
    }
  return std::make_shared<data::TensorDataset>(from_vector(x, {kSamples, kLen}), from_vector(y, {kSamples, kLen}));
}

Tensor lm_loss(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

// The float64 reference of the data's loss and gradient at table E (row-major kVocab x kVocab), and
// per element the sum of its terms' magnitudes (what their roundings scale with).
struct Reference {
  double loss = 0, loss_abs = 0;
  int64_t targets = 0;
  std::vector<double> grad, grad_abs;
};

Reference reference(const std::vector<double>& E, const data::Dataset& data) {
  Reference r;
  r.grad.assign(E.size(), 0.0);
  r.grad_abs.assign(E.size(), 0.0);
  const data::Batch all = data.get_batch({0, 1, 2, 3, 4, 5, 6, 7});
  const std::vector<int64_t> x = all.x.to_vector<int64_t>(), y = all.y.to_vector<int64_t>();
  for (size_t i = 0; i < x.size(); ++i) r.targets += y[i] != -100;
  for (size_t i = 0; i < x.size(); ++i) {
    if (y[i] == -100) continue;
    const double* row = &E[size_t(x[i] * kVocab)];
    double m = row[0];
    for (int64_t c = 1; c < kVocab; ++c) m = std::max(m, row[c]);
    double s = 0;
    for (int64_t c = 0; c < kVocab; ++c) s += std::exp(row[c] - m);
    const double lse = m + std::log(s);
    r.loss += (lse - row[y[i]]) / double(r.targets);
    r.loss_abs += std::abs(lse - row[y[i]]) / double(r.targets);
    for (int64_t c = 0; c < kVocab; ++c) {
      const double g = (std::exp(row[c] - lse) - (c == y[i] ? 1.0 : 0.0)) / double(r.targets);
      r.grad[size_t(x[i] * kVocab + c)] += g;
      r.grad_abs[size_t(x[i] * kVocab + c)] += std::abs(g);
    }
  }
  return r;
}

struct Outcome {
  double loss;
  std::vector<double> table;  // after one SGD step of lr 1
};

// One optimizer step of the 8 samples as `accumulation` micro-batches.
Outcome one_step(int64_t accumulation, bool token_mean, std::vector<double>* table_before = nullptr) {
  Booster booster(BoosterConfig{});
  auto model = std::make_shared<TableLM>(4);
  if (table_before) *table_before = model->state_dict().at("table.weight").to(DType::Float64).to_vector<double>();
  auto sgd = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 1.0}});
  auto loader = booster.prepare_dataloader(masked_tokens(), {.batch_size = kSamples / accumulation});
  booster.boost(model, sgd, lm_loss, loader, nullptr);
  TrainerOptions o;
  o.max_steps = 1;
  o.grad_accumulation = accumulation;
  o.handle_signals = false;
  o.progress = trainer::Progress::Mode::Silent;
  if (token_mean) o.token_mean_ignore_index = -100;
  Trainer trainer(booster, o);
  const FitResult result = trainer.fit();
  return {result.final_loss,
          booster.boosted().model->state_dict().at("table.weight").to(DType::Float64).to_vector<double>()};
}

}  // namespace

TEST_CASE("token mean: masked loss and gradients of 1 and 4 micro-batches equal the float64 sum over count",
          "[trainer][sft]") {
  std::vector<double> before;
  one_step(1, true, &before);
  const Reference ref = reference(before, *masked_tokens());
  REQUIRE(ref.targets == 28);
  for (const int64_t accumulation : {1, 2, 4}) {
    INFO("accumulation " << accumulation);
    const Outcome got = one_step(accumulation, true);
    // Note [Roundoff bounds] in tests/roundoff.h: the float32 chain (the row's log-sum-exp over the
    // vocabulary, the sum over the N targets, the accumulation's sum of micro-batches) plus about ten
    // single roundings (mean to float32, times n R A / N, the Booster's 1/A, the backward of both, the
    // cross-entropy's division by its count, softmax minus one-hot, the SGD update).
    const double eps = ro::gamma(10, ro::kUnit) +
                       ro::reduction_bound({double(kVocab), double(ref.targets), double(accumulation) + 1});
    CHECK(std::abs(got.loss - ref.loss) <= eps * ref.loss_abs);
    for (size_t e = 0; e < before.size(); ++e) {
      const double want = before[e] - ref.grad[e];
      INFO("element " << e << ": " << got.table[e] << " vs " << want);
      CHECK(std::abs(got.table[e] - want) <= ro::kUnit * std::abs(want) + eps * ref.grad_abs[e]);
    }
  }
  // Without it each micro-batch's mean weighs the same: 4 micro-batches of 7, 7, 4 and 10 targets give
  // another loss, far outside the bound (what the option fixes).
  const Outcome mean_of_means = one_step(4, false);
  CHECK(std::abs(mean_of_means.loss - ref.loss) > 1e-3 * ref.loss);
}

TEST_CASE("token mean: evaluation weighs each batch by its counted targets", "[trainer][sft]") {
  TableLM model(4);
  const data::DatasetPtr data = masked_tokens();
  const std::vector<double> table = model.state_dict().at("table.weight").to(DType::Float64).to_vector<double>();
  const Reference ref = reference(table, *data);
  // Batches of 3, 3 and 2 samples hold 9, 9 and 10 targets: weighing them by their 18, 18 and 12
  // positions would not give the mean over the 28 targets.
  const trainer::Evaluation e = trainer::evaluate(model, *data, lm_loss, 3, 1, -100);
  CHECK(e.loss == Approx(ref.loss).epsilon(ro::gamma(10, ro::kUnit) + ro::reduction_bound({double(kVocab), 28.0})));
  CHECK(e.samples == kSamples);
  CHECK(nn::count_targets(data->get_batch({0, 1, 2}).y) == 9);
}

TEST_CASE("token mean: sft records of varied prompts give PyTorch's num_items_in_batch loss and gradient",
          "[trainer][sft]") {
  const json fx = booster::testing::load_fixture_json("sft.json");
  const int64_t T = fx.at("seq_len"), V = fx.at("vocab");
  std::vector<data::Conversation> records;
  for (const json& r : fx.at("records"))
    records.push_back({{"user", r.at("prompt").get<std::string>()}, {"assistant", r.at("response").get<std::string>()}});
  const data::SftTokenizer bytes = ::testing::byte_sft_tokenizer(V);
  const auto sft = std::make_shared<data::SftDataset>(records, data::chat_template_from_json(fx.at("template")), bytes,
                                                      data::SftOptions{.seq_len = T}, "sft.json");
  // The samples are the script's: rendering, cutting and the response mask.
  const Tensor want_x = booster::testing::tensor_from_json(fx.at("x")), want_y = booster::testing::tensor_from_json(fx.at("y"));
  REQUIRE(sft->size() == want_x.size(0));
  std::vector<int64_t> all(size_t(sft->size()));
  for (int64_t i = 0; i < sft->size(); ++i) all[size_t(i)] = i;
  const data::Batch samples = sft->get_batch(all);
  CHECK(samples.x.to_vector<int64_t>() == want_x.to_vector<int64_t>());
  CHECK(samples.y.to_vector<int64_t>() == want_y.to_vector<int64_t>());
  CHECK(sft->response_tokens() == fx.at("num_items").get<int64_t>());

  const std::vector<double> table = fx.at("W").get<std::vector<double>>();
  const int64_t micro = fx.at("micro_batch"), steps = (sft->size() + micro - 1) / micro;
  auto run = [&](int64_t batch, int64_t accumulation, bool token_mean) {
    Booster booster(BoosterConfig{});
    auto model = std::make_shared<TableLM>(1, V);
    {
      autograd::NoGradGuard no_grad;
      model->parameters().front().copy_(from_vector(table, {V, V}));
    }
    auto sgd = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 1.0}});
    booster.boost(model, sgd, lm_loss, booster.prepare_dataloader(sft, {.batch_size = batch}), nullptr);
    TrainerOptions o;
    o.max_steps = 1;
    o.grad_accumulation = accumulation;
    o.handle_signals = false;
    o.progress = trainer::Progress::Mode::Silent;
    if (token_mean) o.token_mean_ignore_index = data::kIgnoreIndex;
    Trainer trainer(booster, o);
    const double loss = trainer.fit().final_loss;
    return std::make_pair(loss, booster.boosted().model->state_dict().at("table.weight").to(DType::Float64).to_vector<double>());
  };
  const double want_loss = fx.at("loss");
  const Tensor grad = booster::testing::tensor_from_json(fx.at("grad"));
  const std::vector<double> g = grad.to_vector<double>();
  const std::vector<int64_t> rows = fx.at("grad_rows").get<std::vector<int64_t>>();
  const double n = double(sft->response_tokens());
  // Per table row, the targets whose input it is: the terms of its gradient, each at most 1 / N.
  std::vector<double> terms(size_t(V), 0.0);
  {
    const std::vector<int64_t> sx = samples.x.to_vector<int64_t>(), sy = samples.y.to_vector<int64_t>();
    for (size_t i = 0; i < sx.size(); ++i)
      if (sy[i] != data::kIgnoreIndex) terms[size_t(sx[i])] += 1.0;
  }
  for (const auto& [batch, accumulation] : std::vector<std::pair<int64_t, int64_t>>{{sft->size(), 1}, {micro, steps}}) {
    INFO(accumulation << " micro-batches");
    const auto [loss, after] = run(batch, accumulation, true);
    // As in the test above: the float32 chain and about ten roundings, relative to the losses (all
    // positive) and, per weight, to the sum of its gradient's terms' sizes.
    const double eps =
        ro::gamma(10, ro::kUnit) + ro::reduction_bound({double(V), n, double(accumulation) + 1});
    CHECK(std::abs(loss - want_loss) <= eps * want_loss);
    for (size_t r = 0; r < rows.size(); ++r)
      for (int64_t c = 0; c < V; ++c) {
        const size_t e = size_t(rows[r] * V + c);
        const double want = double(float(table[e])) - g[r * size_t(V) + size_t(c)];
        CHECK(std::abs(after[e] - want) <= ro::kUnit * std::abs(want) + eps * terms[size_t(rows[r])] / n);
      }
  }
  // The mean of the micro-batches' own means is the other number the script prints.
  const auto [mean_of_means, unused] = run(micro, steps, false);
  CHECK(mean_of_means == Approx(fx.at("mean_of_means").get<double>()).epsilon(1e-5));
  CHECK(std::abs(mean_of_means - want_loss) > 1e-3 * want_loss);
}
