// The hybrid_parallel plugin under `mpirun -np 4` (every TEST_CASE on every rank, in the same order):
// each layout of the four ranks (tp 4, pp 4, tp 2 x pp 2, dp 2 x tp 2, dp 2 x pp 2, dp 4, and dp 4,
// dp 2 x tp 2 and dp 2 x pp 2 with zero_stage 1) trains a GPT and an MLP classifier for 20 steps on the
// same global batches as one process does, through the Booster, and ends within the bounds float32
// roundoff allows (Note [Roundoff bounds] in tests/roundoff.h: tight under SGD, Adam's drift and the
// loss curve under AdamW); the saved model is the single-process file (gathered over tensor ranks and
// stages), the losses agree, and model(x) without gradients gives every rank the whole model's output.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/booster/compat.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/distributed/device_mesh.h"
#include "booster/distributed/nccl_process_group.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/activation.h"
#include "booster/nn/container.h"
#include "booster/nn/linear.h"
#include "booster/nn/loss.h"
#include "booster/nn/tensor_parallel.h"
#include "booster/nn/models.h"
#include "booster/nn/shard_policy.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/deferred.h"
#include "booster/tensor/random.h"
#include "roundoff.h"

using namespace booster;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

distributed::ProcessGroup& world() { return distributed::init_process_group("mpi"); }

// A directory every rank names alike (rank 0 draws the suffix).
fs::path shared_dir(const std::string& tag) {
  Tensor n = full({1}, double(std::random_device{}() % 1000000), DType::Int64);
  world().broadcast(n, 0);
  return fs::temp_directory_path() / ("booster_hybrid_" + tag + "_" + std::to_string(n.to_vector<int64_t>()[0]));
}

struct Case {
  std::string name;
  int tp, pp;
  std::string schedule = "1f1b";
  int zero_stage = 0;
};

const std::vector<Case> kLayouts = {{"tp 4", 4, 1},
                                    {"pp 4", 1, 4},
                                    {"tp 2 x pp 2", 2, 2},
                                    {"dp 2 x tp 2", 2, 1},
                                    {"dp 2 x pp 2 gpipe", 1, 2, "gpipe"},
                                    {"dp 4", 1, 1},
                                    {"dp 4 zero 1", 1, 1, "1f1b", 1},
                                    {"dp 2 x tp 2 zero 1", 2, 1, "1f1b", 1},
                                    {"dp 2 x pp 2 zero 1", 1, 2, "1f1b", 1}};

// ||a - b|| / ||b|| over a tensor (L2).
double relative_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const std::vector<double> x = a.tolist(), y = b.tolist();
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff += (x[i] - y[i]) * (x[i] - y[i]);
    scale += y[i] * y[i];
  }
  return std::sqrt(diff / std::max(scale, 1e-300));
}

using Batch = std::pair<Tensor, Tensor>;

const json kAdamW = {{"type", "adamw"}, {"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.1}};

// Relative bounds for the 16-bit strategies: on each step's loss, on each parameter tensor and on the
// whole model (L2). float32 runs derive theirs from the model's reductions instead.
struct Tolerance {
  double loss, tensor, model;
};
// The reductions of a model's forward (the sum of their lengths along the path to one output) and the
// positions a weight's gradient sums over (Note [Roundoff bounds]).
struct Reductions {
  double forward, positions;
};
using Check = std::variant<Tolerance, Reductions>;
using ModelFactory = std::function<nn::ModulePtr()>;

double l2(const std::vector<double>& v, double p = 2) {
  double s = 0;
  for (double x : v) s += std::pow(std::abs(x), p);
  return std::pow(s, 1 / p);
}

std::vector<double> difference(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// Trains `make()` for the batches in one process (the reference: for fp32 a plain loop with no
// Booster, otherwise a single-process Booster with the same strategy), and through a Booster with
// plugin hybrid_parallel in the layout; compares the losses, the saved model and the inference output.
// For fp32 the bounds follow Note [Roundoff bounds] from the reference's own path: under SGD each
// tensor within sgd_bound of the sum of its step lengths, each loss within the forward's roundoff plus
// |g_t| times the weights' bound; under Adam(W) each element within adam_drift_bound and each loss
// within the forward's roundoff plus |g_t|_1 times that drift (first order in the weights' difference).
// With `accumulation` > 1 each rank runs its rows of a batch as that many micro-batches under
// booster.accumulate() (Note [Gradient accumulation in a loop] in booster/booster/booster.h), the
// optimizer stepping once per batch, against the reference's one step on the whole batch.
void check_layout(const Case& c, const ModelFactory& make, const nn::Criterion& criterion,
                  const std::vector<Batch>& batches, const std::string& precision, const Check& check,
                  double max_norm = 0.0, const json& optimizer = kAdamW, int accumulation = 1) {
  namespace ro = ::testing::roundoff;
  INFO(c.name << " " << precision << (max_norm > 0 ? " clipped" : "")
              << (accumulation > 1 ? " accumulating " + std::to_string(accumulation) : std::string()));
  const json& adamw = optimizer;
  nn::ModulePtr reference = make();
  std::vector<double> ref_losses, ref_norms, grad_l1, grad_l2;
  std::map<std::string, double> path;  // sum over the steps of each tensor's step length
  double model_path = 0;
  std::vector<double> path_before;     // the whole model's path before each step
  if (precision == "fp32") {
    auto ref_opt = optim::make_optimizer(adamw, reference->parameters());
    for (const auto& [x, y] : batches) {
      ref_opt->zero_grad();
      const nn::StateDict before = reference->state_dict();
      std::map<std::string, std::vector<double>> was;
      for (const auto& [name, t] : before) was[name] = t.tolist();
      const Tensor loss = criterion((*reference)(x), y);
      loss.backward();
      std::vector<double> g;
      for (const Tensor& p : reference->parameters())
        if (p.grad().defined())
          for (double v : p.grad().tolist()) g.push_back(v);
      grad_l1.push_back(l2(g, 1));
      grad_l2.push_back(l2(g));
      if (max_norm > 0) {  // torch's clip_grad_norm_, written out: scale by max_norm / (norm + 1e-6) below 1
        double squares = 0;
        for (const Tensor& p : reference->parameters())
          for (double g : p.grad().tolist()) squares += g * g;
        ref_norms.push_back(std::sqrt(squares));
        const double factor = max_norm / (std::sqrt(squares) + 1e-6);
        if (factor < 1) {
          NoGradGuard no_grad;
          for (const Tensor& p : reference->parameters()) p.grad().mul_(factor);
        }
      }
      ref_opt->step();
      ref_losses.push_back(loss.item());
      path_before.push_back(model_path);
      double step_squares = 0;
      for (const auto& [name, t] : reference->state_dict()) {
        const double step = l2(difference(t.tolist(), was[name]));
        path[name] += step;
        step_squares += step * step;
      }
      model_path += std::sqrt(step_squares);
    }
  } else {
    Booster single(BoosterConfig{.mixed_precision = precision});
    Boosted r = single.boost(reference, optim::make_optimizer(adamw, reference->parameters()), criterion);
    for (const auto& [x, y] : batches) {
      r.optimizer->zero_grad();
      ref_losses.push_back(single.execute_pipeline(x, y, *r.model, r.criterion, *r.optimizer));
      r.optimizer->step();
    }
    reference = r.model;
  }

  // The bounds of the float32 comparison.
  const bool derived = std::holds_alternative<Reductions>(check);
  const bool sgd = adamw.at("type") == "sgd";
  double eps_forward = 0, eps_gradient = 0, drift = 0;
  if (derived) {
    REQUIRE(precision == "fp32");
    const Reductions& r = std::get<Reductions>(check);
    // Accumulating adds the mean of the micro-batches' losses (a sum of `accumulation` terms) to the
    // loss, and to each gradient the sum of the micro-batches' gradients and their division by the count
    // (one rounding): reductions of those lengths beside the others.
    const double accumulated = accumulation > 1 ? double(accumulation) + 1 : 0.0;
    eps_forward = ro::reduction_bound({r.forward, accumulated});
    // The gradient: the forward chain, the chain back, the weight's sum over positions, and the
    // gradient norm that clipping divides by (a sum over every parameter).
    eps_gradient =
        ro::reduction_bound({2 * r.forward, r.positions, double(reference->num_parameters()), accumulated});
    if (!sgd) {
      const auto betas = adamw.value("betas", std::vector<double>{0.9, 0.999});
      drift = ro::adam_drift_bound(adamw.at("lr").get<double>(), int(batches.size()), betas[0], betas[1]);
    }
  }
  const double momentum = adamw.value("momentum", 0.0);
  auto loss_bound = [&](size_t s) {
    if (!derived) return std::get<Tolerance>(check).loss * std::abs(ref_losses[s]);
    const double weights = sgd ? ro::sgd_bound(path_before[s], eps_gradient, momentum) * grad_l2[s]
                               : drift * double(s) / double(batches.size()) * grad_l1[s];
    return eps_forward * std::abs(ref_losses[s]) + weights;
  };

  const int n = world().size(), replica = c.tp * c.pp, dp = n / replica, dp_rank = world().rank() / replica;
  const int microbatches = c.pp > 1 ? 2 : 1;
  Booster booster(BoosterConfig{.mixed_precision = precision,
                                .plugin = "hybrid_parallel",
                                .plugin_options = {{"tp_size", c.tp},
                                                   {"pp_size", c.pp},
                                                   {"num_microbatches", microbatches},
                                                   {"schedule", c.schedule},
                                                   {"zero_stage", c.zero_stage}}});
  nn::ModulePtr whole = make();
  auto opt = optim::make_optimizer(adamw, whole->parameters());
  Boosted b = booster.boost(whole, std::move(opt), criterion);
  if (c.zero_stage == 1) {
    // Note [Hybrid ZeRO-1]: this rank steps (and keeps state for) only its share of its part; the
    // shares of the data-parallel group cover the part exactly once.
    int64_t stepped = 0, part = b.model->num_parameters();
    for (const optim::ParamGroup& g : b.optimizer->stepped_optimizer().param_groups())
      for (const Tensor& p : g.params) stepped += p.numel();
    CHECK(stepped < part);
    Tensor total = full({1}, double(stepped), DType::Float64);
    world().all_reduce(total);  // the dp shares of every (tp, pp) part
    Tensor parts = full({1}, double(part) / dp, DType::Float64);
    world().all_reduce(parts);  // every (tp, pp) part once
    CHECK(total.item() == Approx(parts.item()));
  }
  double worst_loss = 0;
  size_t clipped = 0;
  for (size_t s = 0; s < batches.size(); ++s) {
    const auto& [x, y] = batches[s];
    const int64_t rows = x.size(0) / dp, micro_rows = rows / accumulation;
    REQUIRE(micro_rows * accumulation == rows);
    double loss = 0;
    // The README's accumulation loop: every call in the body, the Booster deciding which act.
    for (int k = 0; k < accumulation; ++k) {
      const Booster::Accumulate micro_step = booster.accumulate(accumulation);
      b.optimizer->zero_grad();
      const int64_t first = dp_rank * rows + k * micro_rows;
      loss += booster.execute_pipeline(x.narrow(0, first, micro_rows), y.narrow(0, first, micro_rows), *b.model,
                                       b.criterion, *b.optimizer) /
              accumulation;
      if (max_norm > 0 && micro_step.sync()) {
        const double norm = booster.clip_grad_norm(*b.optimizer, max_norm);
        CHECK(std::abs(norm - ref_norms[s]) <= (eps_gradient + ro::sgd_bound(path_before[s], eps_gradient, momentum) *
                                                                      grad_l2[s] / ref_norms[s]) * ref_norms[s]);
        clipped += ref_norms[s] > max_norm;
      }
      b.optimizer->step();
    }
    CHECK(b.optimizer->steps() == int64_t(s) + 1);
    // Every rank of a replica has its part's loss; the parts' mean is the batch's.
    Tensor mean = full({1}, loss / n, DType::Float64);
    world().all_reduce(mean);
    worst_loss = std::max(worst_loss, std::abs(mean.item() - ref_losses[s]) / std::abs(ref_losses[s]));
    CHECK(std::abs(mean.item() - ref_losses[s]) <= loss_bound(s));
  }

  if (max_norm > 0) CHECK(clipped >= batches.size() / 2);  // most steps clip: the factor is exercised
  // The saved model is one process's file: the same names, shapes and (within the tolerance) values.
  const fs::path dir = shared_dir("model");
  booster.save_model(*b.model, dir);
  if (world().rank() == 0) {
    const checkpoint::TensorMap saved = checkpoint::load_model(dir);
    const nn::StateDict want = reference->state_dict();
    CHECK(saved.size() == want.size());
    double worst = 0, all_diff = 0, all_norm = 0;
    for (const auto& [name, t] : want) {
      INFO(name);
      if (!saved.count(name)) {  // CHECK, not REQUIRE: the other ranks wait at the barrier below
        FAIL_CHECK("the saved model has no " << name);
        continue;
      }
      Tensor got = saved.at(name).to(DType::Float32), ref = t.to(DType::Float32);
      if (derived) {
        const std::vector<double> d = difference(got.tolist(), ref.tolist());
        if (sgd) {
          const double bound = ro::sgd_bound(path[name], eps_gradient, momentum);
          INFO("|difference| " << l2(d) << ", bound " << bound);
          CHECK(l2(d) <= bound);
          all_diff += l2(d) * l2(d);
        } else {
          double largest = 0;
          for (double x : d) largest = std::max(largest, std::abs(x));
          INFO("largest difference " << largest << ", drift bound " << drift);
          CHECK(largest <= drift);
        }
        worst = std::max(worst, l2(d) / std::max(l2(ref.tolist()), 1e-300));
        continue;
      }
      // The key bias's exact gradient is zero (softmax is unchanged when every score of a query moves by
      // the same q . b_k), so what it gets is rounding noise, which Adam's g / sqrt(v) turns into steps
      // of size lr whatever the order of the sums: it is compared on the query and value thirds only.
      if (name.size() > 16 && name.compare(name.size() - 16, 16, "attn.c_attn.bias") == 0) {
        const int64_t w = t.size(0) / 3;
        got = cat({got.narrow(0, 0, w), got.narrow(0, 2 * w, w)}, 0);
        ref = cat({ref.narrow(0, 0, w), ref.narrow(0, 2 * w, w)}, 0);
      }
      const Tolerance& tolerance = std::get<Tolerance>(check);
      const double d = relative_diff(got, ref);
      all_diff += d * d * sum(mul(ref, ref)).item();
      all_norm += sum(mul(ref, ref)).item();
      worst = std::max(worst, d);
      CHECK(d <= tolerance.tensor);
    }
    if (derived && sgd) {
      INFO("whole model |difference| " << std::sqrt(all_diff) << ", bound " << ro::sgd_bound(model_path, eps_gradient, momentum));
      CHECK(std::sqrt(all_diff) <= ro::sgd_bound(model_path, eps_gradient, momentum));
    } else if (!derived) {
      CHECK(std::sqrt(all_diff / all_norm) <= std::get<Tolerance>(check).model);
    }
    WARN(c.name << " " << precision << ": worst parameter difference " << worst << ", worst loss " << worst_loss);
  }
  world().barrier();
  // Inference through the split model (gathered head, the pipeline run without gradients) gives every
  // rank the reference's output.
  // For fp32 the reference is the saved model itself, so only the forward's roundoff separates them.
  {
    autograd::NoGradGuard no_grad;
    const Tensor out = (*b.model)(batches[0].first).to(DType::Float32);
    if (derived) {
      nn::ModulePtr same = make();
      same->load_state_dict(checkpoint::load_model(dir));
      CHECK(relative_diff(out, (*same)(batches[0].first).to(DType::Float32)) <= eps_forward);
    } else {
      const Tensor want = (*reference)(batches[0].first).to(DType::Float32);
      CHECK(relative_diff(out, want) <= 10 * std::get<Tolerance>(check).model);
    }
  }
  world().barrier();
  if (world().rank() == 0) fs::remove_all(dir);
}

std::vector<Batch> gpt_batches(const nn::GPTConfig& cfg, int steps) {
  Generator gen(21);
  std::vector<Batch> out;
  for (int s = 0; s < steps; ++s) {
    const Tensor ids = randint(0, cfg.vocab_size, {8, cfg.context}, &gen);
    out.emplace_back(ids, randint(0, cfg.vocab_size, {8, cfg.context}, &gen));
  }
  return out;
}

nn::GPTConfig small_gpt() {
  nn::GPTConfig cfg;
  cfg.vocab_size = 32;
  cfg.context = 8;
  cfg.width = 16;
  cfg.layers = 4;
  cfg.heads = 4;
  return cfg;
}

// The small GPT's reductions on batches of 8 (Note [Roundoff bounds]).
Reductions gpt_reductions(const nn::GPTConfig& cfg) {
  return {::testing::roundoff::gpt_forward_length(double(cfg.width), double(cfg.layers), double(cfg.heads),
                                                double(cfg.context), double(cfg.vocab_size), 8),
          8.0 * double(cfg.context)};
}

Tensor gpt_loss(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

}  // namespace

TEST_CASE("hybrid: every layout of 4 ranks trains a GPT as one process does", "[mpi][hybrid]") {
  REQUIRE(world().size() == 4);
  const nn::GPTConfig cfg = small_gpt();
  const std::vector<Batch> batches = gpt_batches(cfg, 20);
  for (const Case& c : kLayouts)
    check_layout(c, [&] { return std::make_shared<nn::GPT>(cfg, 5); }, gpt_loss, batches, "fp32", gpt_reductions(cfg));
}

// Note [Clipping split gradients]: the norm returned is the whole model's (within its roundoff bound),
// and clipping by it (0.5: most steps here clip) gives the one-process trajectory under every layout.
// SGD with momentum, whose step is proportional to the gradient, so a wrong factor shows (AdamW's
// m / sqrt(v) would hide most of it).
TEST_CASE("hybrid: gradients clipped by the whole model's norm under every layout", "[mpi][hybrid]") {
  REQUIRE(world().size() == 4);
  const nn::GPTConfig cfg = small_gpt();
  const std::vector<Batch> batches = gpt_batches(cfg, 20);
  for (const Case& c : kLayouts)
    check_layout(c, [&] { return std::make_shared<nn::GPT>(cfg, 5); }, gpt_loss, batches, "fp32", gpt_reductions(cfg),
                 0.5, {{"type", "sgd"}, {"lr", 0.1}, {"momentum", 0.9}});
}

TEST_CASE("hybrid: every layout of 4 ranks trains an MLP classifier as one process does", "[mpi][hybrid]") {
  REQUIRE(world().size() == 4);
  Generator gen(3);
  std::vector<Batch> batches;
  for (int s = 0; s < 20; ++s) {
    const Tensor x = randn({8, 12}, &gen);
    batches.emplace_back(x, randint(0, 8, {8}, &gen));
  }
  auto make = [] { return std::make_shared<nn::MLPClassifier>(12, std::vector<int64_t>{16, 16, 16}, 8, "relu", 4); };
  auto loss = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
  // Linears of 12, 16, 16 and 16 inputs, 8 classes, batches of 8.
  const Reductions reductions{::testing::roundoff::mlp_forward_length({12, 16, 16, 16}, 8, 8), 8};
  for (const Case& c : kLayouts) check_layout(c, make, loss, batches, "fp32", reductions);
}

// Note [Gradient accumulation in a loop] (booster/booster/booster.h): hybrid_parallel cannot skip its
// gradient synchronisation (no_sync), so booster.accumulate() lets each backward add into the local
// gradients, which the plugin averages over the data-parallel group once, before the step. Two
// micro-batches per rank and step under every layout end where one step on each whole batch does.
TEST_CASE("hybrid: accumulate(2) over micro-batches trains every layout as one step per whole batch does",
          "[mpi][hybrid]") {
  REQUIRE(world().size() == 4);
  Generator gen(5);
  std::vector<Batch> batches;
  for (int s = 0; s < 8; ++s) {
    const Tensor x = randn({16, 12}, &gen);
    batches.emplace_back(x, randint(0, 8, {16}, &gen));
  }
  auto make = [] { return std::make_shared<nn::MLPClassifier>(12, std::vector<int64_t>{16, 16, 16}, 8, "relu", 4); };
  auto loss = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
  // Linears of 12, 16, 16 and 16 inputs, 8 classes, batches of 16.
  const Reductions reductions{::testing::roundoff::mlp_forward_length({12, 16, 16, 16}, 8, 16), 16};
  for (const Case& c : kLayouts)
    check_layout(c, make, loss, batches, "fp32", reductions, 0.0, {{"type", "sgd"}, {"lr", 0.1}, {"momentum", 0.9}}, 2);
}

// A gradient that overflows on one pipeline stage only: the found-inf flag is agreed over every rank
// (every stage and tensor rank, not only the data-parallel group), so every rank skips the step, keeps
// its weights and halves its loss scale alike. A stage that stepped alone would leave the model's
// halves from two different steps.
TEST_CASE("hybrid: an inf on one pipeline stage skips the step on every rank", "[mpi][hybrid][amp]") {
  REQUIRE(world().size() == 4);
  const nn::GPTConfig cfg = small_gpt();
  const std::vector<Batch> batches = gpt_batches(cfg, 2);
  Booster booster(BoosterConfig{.mixed_precision = "fp16",
                                .mixed_precision_options = {{"init_scale", 1024.0}},
                                .plugin = "hybrid_parallel",
                                .plugin_options = {{"tp_size", 2}, {"pp_size", 2}, {"num_microbatches", 2}}});
  auto gpt = std::make_shared<nn::GPT>(cfg, 5);
  Boosted b = booster.boost(gpt, optim::make_optimizer(kAdamW, gpt->parameters()), gpt_loss);
  bool last_stage = false;
  for (const auto& [name, p] : b.model->named_parameters()) last_stage = last_stage || name == "lm_head.weight";
  auto all_ranks = [](bool mine) {  // how many ranks say yes
    Tensor n = full({1}, mine ? 1.0 : 0.0, DType::Float64);
    world().all_reduce(n);
    return int(n.item());
  };
  CHECK(all_ranks(last_stage) == 2);  // tp 2 ranks hold the head
  // A normal step first: nothing overflows at this scale, so the skip below is the injected inf's.
  b.optimizer->zero_grad();
  booster.execute_pipeline(batches[0].first, batches[0].second, *b.model, b.criterion, *b.optimizer);
  b.optimizer->step();
  CHECK(all_ranks(b.optimizer->step_was_skipped()) == 0);
  const double scale = booster.precision().loss_scale();

  b.optimizer->zero_grad();
  booster.execute_pipeline(batches[1].first, batches[1].second, *b.model, b.criterion, *b.optimizer);
  if (last_stage) {
    Tensor g = b.model->named_parameters().front().second.grad();
    REQUIRE(g.defined());
    NoGradGuard no_grad;
    g.fill_(std::numeric_limits<double>::infinity());
  }
  std::vector<std::vector<double>> before;
  for (const Tensor& p : b.model->parameters()) before.push_back(p.tolist());
  b.optimizer->step();
  CHECK(all_ranks(b.optimizer->step_was_skipped()) == 4);
  std::vector<std::vector<double>> after;
  for (const Tensor& p : b.model->parameters()) after.push_back(p.tolist());
  CHECK(all_ranks(after == before) == 4);
  CHECK(booster.precision().loss_scale() == scale / 2);
}

TEST_CASE("hybrid: a model without a shard policy is refused by name", "[mpi][hybrid]") {
  struct Custom final : nn::Module {
    Custom() { lin = register_module("lin", std::make_shared<nn::Linear>(4, 4)); }
    Tensor forward(const Tensor& x) override { return (*lin)(x); }
    std::string name() const override { return "MyNet"; }
    std::shared_ptr<nn::Linear> lin;
  };
  Booster booster(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = {{"tp_size", 2}, {"pp_size", 2}}});
  REQUIRE_THROWS_WITH(booster.boost(std::make_shared<Custom>()),
                      Catch::Contains("shard policy for the model 'MyNet'") &&
                          Catch::Contains("register_shard_policy(\"MyNet\""));
}

TEST_CASE("hybrid: sizes that do not fit the world are a ConfigError naming the ones that do", "[mpi][hybrid]") {
  Booster booster(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = {{"tp_size", 3}}});
  REQUIRE_THROWS_AS(booster.boost(std::make_shared<nn::GPT>(small_gpt(), 1)), ConfigError);
}

// The 16-bit strategies under each layout against the same strategy in one process. What differs is
// where sums are split: a row-parallel layer's partial products are rounded to the 16-bit type before
// their all-reduce, micro-batches' gradients are added in another order, each a rounding of unit
// roundoff u (2^-11 for float16, 2^-8 for bfloat16) of the values summed. So
//   * a step's loss, a mean over 64 tokens of values each moved by at most a few u with independent
//     signs, moves by less than u: the bound is u;
//   * a parameter's AdamW step is m / sqrt(v), which a relative change of u in its gradients changes
//     by about 2u of lr; the model's parameters after 20 steps differ by a small multiple of u
//     relative to their size: the bound on the whole model (L2) is 4u;
//   * except elements whose gradient is below the rounding noise itself (a key bias, a weight whose
//     terms cancel): Adam normalizes those to steps of up to lr either way, so single tensors are held
//     only to 128u, which still catches a misplaced shard (an error of order 1).
TEST_CASE("hybrid: 16-bit strategies train under every layout as in one process", "[mpi][hybrid]") {
  REQUIRE(world().size() == 4);
  const nn::GPTConfig cfg = small_gpt();
  const std::vector<Batch> batches = gpt_batches(cfg, 20);
  const std::vector<Case> layouts = {{"tp 4", 4, 1},
                                     {"pp 4", 1, 4},
                                     {"tp 2 x pp 2", 2, 2},
                                     {"dp 2 x tp 2", 2, 1},
                                     {"dp 2 x pp 2 zero 1", 1, 2, "1f1b", 1}};
  const std::map<std::string, double> unit_roundoff = {{"fp16_naive", std::ldexp(1.0, -11)},
                                                       {"fp16", std::ldexp(1.0, -11)},
                                                       {"bf16", std::ldexp(1.0, -8)}};
  for (const auto& [precision, u] : unit_roundoff)
    for (const Case& c : layouts)
      check_layout(c, [&] { return std::make_shared<nn::GPT>(cfg, 5); }, gpt_loss, batches, precision,
                   Tolerance{u, 128 * u, 4 * u});
}

// Every cell of the plugin's column of the compatibility matrix, from the plugin's own declarations:
// the accepted ones train in the tests above; each rejected one names the reason and what to use.
TEST_CASE("hybrid: the compatibility matrix cells of each layout", "[mpi][hybrid][compat]") {
  const std::vector<std::pair<std::string, json>> layouts = {
      {"tp 2", {{"tp_size", 2}}}, {"pp 2", {{"pp_size", 2}}}, {"tp 2 x pp 2", {{"tp_size", 2}, {"pp_size", 2}}}};
  for (const auto& [layout, options] : layouts) {
    INFO(layout);
    const std::shared_ptr<ParallelPlugin> plugin = create_plugin("hybrid_parallel", options);
    const compat::PluginTraits traits = compat::PluginTraits::of(*plugin);
    for (const char* ok : {"fp32", "fp16", "bf16", "fp16_naive"}) {
      INFO(ok);
      CHECK(compat::check(ok, traits, "cpu").compatible);
    }
    for (const char* bad : {"fp16_apex", "fp8"}) {
      INFO(bad);
      const compat::Verdict v = compat::check(bad, traits, "cpu");
      CHECK_FALSE(v.compatible);
      CHECK_THAT(v.instead, Catch::Contains("fp16_naive") || Catch::Contains("bf16"));
      BoosterConfig config{.mixed_precision = bad, .plugin = "hybrid_parallel", .plugin_options = options};
      CHECK_THROWS_AS(Booster(config), IncompatibleError);
    }
    // CUDA models take the device's group (nccl, or staged mpi when ranks share a GPU) where NCCL is built.
    const compat::Verdict cuda = compat::check("fp32", traits, "cuda");
    CHECK(cuda.compatible == distributed::nccl_built());
    if (!cuda.compatible) CHECK_THAT(cuda.message("fp32", "hybrid_parallel", "cuda"), Catch::Contains("cpu"));
  }
  // The ZeRO stages the plugin does not run are refused with the alternative.
  CHECK_THROWS_WITH(create_plugin("hybrid_parallel", {{"pp_size", 2}, {"zero_stage", 2}}),
                    Catch::Contains("use zero_stage 1 with pp_size > 1"));
  CHECK_THROWS_WITH(create_plugin("hybrid_parallel", {{"zero_stage", 2}}), Catch::Contains("use zero_stage 1"));
  CHECK_NOTHROW(create_plugin("hybrid_parallel", {{"tp_size", 2}, {"pp_size", 2}, {"zero_stage", 1}}));
}

namespace {

// A model of a user's own, with no built-in policy: up (6 -> 8), ReLU, down (8 -> 4).
class TwoLayer final : public nn::Module {
 public:
  TwoLayer() {
    Generator gen(9);
    up = register_module("up", std::make_shared<nn::Linear>(6, 8, true, &gen));
    act = register_module("act", std::make_shared<nn::ReLU>());
    down = register_module("down", std::make_shared<nn::Linear>(8, 4, true, &gen));
  }
  Tensor forward(const Tensor& x) override { return (*down)((*act)((*up)(x))); }
  std::string name() const override { return "TwoLayer"; }
  std::shared_ptr<nn::Linear> up, down;
  nn::ModulePtr act;
};

}  // namespace

// A user registers a policy for their model (Megatron's pair: up column-parallel, down row-parallel),
// and the plugin trains it as one process does; before that, the same model is refused by name.
TEST_CASE("hybrid: a model of the user's own trains under its registered shard policy", "[mpi][hybrid]") {
  REQUIRE(world().size() == 4);
  {
    Booster booster(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = {{"tp_size", 2}}});
    REQUIRE_THROWS_WITH(booster.boost(std::make_shared<TwoLayer>()), Catch::Contains("'TwoLayer'"));
  }
  nn::register_shard_policy("TwoLayer", [](const nn::ModulePtr& model, const nn::ShardContext& where) {
    const auto& m = dynamic_cast<const TwoLayer&>(*model);
    BOOSTER_CHECK(where.stages == 1, IncompatibleError, "TwoLayer is not cut into pipeline stages");
    auto part = std::make_shared<nn::Sequential>();
    part->push_back("up", std::make_shared<nn::tp::ColumnParallelLinear>(*m.up, *where.tp));
    part->push_back("act", m.act);
    part->push_back("down", std::make_shared<nn::tp::RowParallelLinear>(*m.down, *where.tp));
    nn::ShardedModel out;
    out.module = part;
    out.shards = {{"up.weight", {0, 1}}, {"up.bias", {0, 1}}, {"down.weight", {1, 1}}};
    return out;
  });
  Generator gen(4);
  std::vector<Batch> batches;
  for (int s = 0; s < 20; ++s) {
    const Tensor x = randn({8, 6}, &gen);
    batches.emplace_back(x, randint(0, 4, {8}, &gen));
  }
  auto loss = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
  for (const Case& c : {Case{"tp 4", 4, 1}, Case{"dp 2 x tp 2", 2, 1}})
    check_layout(c, [] { return std::make_shared<TwoLayer>(); }, loss, batches, "fp32",
                 Reductions{::testing::roundoff::mlp_forward_length({6, 8}, 4, 8), 8});
}

// A layout's optimizer state is its ranks' own parts: another layout of the same world size is refused
// by the plugin's checkpoint IO, naming both layouts; the same layout loads.
TEST_CASE("hybrid: optimizer state saved under one layout is refused under another", "[mpi][hybrid][checkpoint]") {
  REQUIRE(world().size() == 4);
  const fs::path dir = shared_dir("optimizer");
  auto boost = [](Booster& booster) {
    auto gpt = std::make_shared<nn::GPT>(small_gpt(), 5);
    return booster.boost(gpt, optim::make_optimizer(kAdamW, gpt->parameters()), gpt_loss);
  };
  const std::vector<Batch> batches = gpt_batches(small_gpt(), 1);
  {
    Booster booster(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = {{"tp_size", 2}, {"pp_size", 2}}});
    Boosted b = boost(booster);
    b.optimizer->zero_grad();
    booster.execute_pipeline(batches[0].first, batches[0].second, *b.model, b.criterion, *b.optimizer);
    b.optimizer->step();
    booster.save_optimizer(*b.optimizer, dir);
    Booster same(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = {{"tp_size", 2}, {"pp_size", 2}}});
    Boosted again = boost(same);
    CHECK_NOTHROW(same.load_optimizer(*again.optimizer, dir));
  }
  Booster other(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = {{"tp_size", 4}}});
  Boosted b = boost(other);
  CHECK_THROWS_WITH(other.load_optimizer(*b.optimizer, dir),
                    Catch::Contains("was saved with the layout") && Catch::Contains("\"pp_size\":2") &&
                        Catch::Contains("\"tp_size\":4"));
  world().barrier();
  if (world().rank() == 0) fs::remove_all(dir);
}

// Under tensor parallelism the GPT's loss is the vocabulary-parallel cross-entropy; a criterion that is
// something else (here summed instead of averaged) is refused at the first step instead of silently
// replaced.
TEST_CASE("hybrid: a GPT criterion other than plain cross-entropy is refused under tp", "[mpi][hybrid]") {
  REQUIRE(world().size() == 4);
  Booster booster(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = {{"tp_size", 2}}});
  auto gpt = std::make_shared<nn::GPT>(small_gpt(), 5);
  auto summed = [](const Tensor& logits, const Tensor& y) {
    return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}), Reduction::Sum);
  };
  Boosted b = booster.boost(gpt, optim::make_optimizer(kAdamW, gpt->parameters()), summed);
  const std::vector<Batch> batches = gpt_batches(small_gpt(), 1);
  CHECK_THROWS_WITH(booster.execute_pipeline(batches[0].first.narrow(0, 0, 4), batches[0].second.narrow(0, 0, 4),
                                             *b.model, b.criterion, *b.optimizer),
                    Catch::Contains("use plain cross_entropy, or tp_size 1"));
}

namespace {

// TwoLayer with a layer its forward never uses: its parameters get no gradient.
class WithUnused final : public nn::Module {
 public:
  WithUnused() {
    Generator gen(10);
    body = register_module("body", std::make_shared<TwoLayer>());
    spare = register_module("spare", std::make_shared<nn::Linear>(4, 4, true, &gen));
  }
  Tensor forward(const Tensor& x) override { return (*body)(x); }
  std::string name() const override { return "WithUnused"; }
  std::shared_ptr<TwoLayer> body;
  std::shared_ptr<nn::Linear> spare;
};

}  // namespace

// Note [Hybrid ZeRO-1]: a parameter that gets no gradient (frozen, or not used by forward) is not
// stepped by its owner, as at zero_stage 0 and in torch: AdamW's weight decay leaves it where it was.
TEST_CASE("hybrid: zero_stage 1 leaves a parameter without a gradient alone", "[mpi][hybrid]") {
  REQUIRE(world().size() == 4);
  Generator gen(6);
  std::vector<Batch> batches;
  for (int s = 0; s < 10; ++s) {
    const Tensor x = randn({8, 6}, &gen);
    batches.emplace_back(x, randint(0, 4, {8}, &gen));
  }
  auto make = [] {
    auto m = std::make_shared<WithUnused>();
    m->body->up->bias.requires_grad_(false);
    return m;
  };
  auto loss = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
  // SGD with weight decay, so that a stepped parameter without a gradient would move: its path is zero
  // and so is its bound.
  const Reductions reductions{::testing::roundoff::mlp_forward_length({6, 8}, 4, 8), 8};
  const json sgd = {{"type", "sgd"}, {"lr", 0.1}, {"weight_decay", 0.1}};
  check_layout(Case{"dp 4", 1, 1}, make, loss, batches, "fp32", reductions, 0.0, sgd);
  check_layout(Case{"dp 4 zero 1", 1, 1, "1f1b", 1}, make, loss, batches, "fp32", reductions, 0.0, sgd);
  check_layout(Case{"dp 4 zero 1", 1, 1, "1f1b", 1}, make, loss, batches, "fp32", reductions);
}

// A model built under a LazyInitGuard (booster/tensor/deferred.h, as `booster train` builds it) is
// allocated by boost() only where this rank's part needs it: the part's values (made from the recorded
// initializers, bit for bit those of the eagerly built model's part), then the optimizer's flat copy of
// them and the gradients. So the peak over build and boost is at most 3x the part, here well under one
// whole model, where the eager build holds the whole model first.
TEST_CASE("hybrid: a model built deferred allocates only this rank's part", "[mpi][hybrid][deferred]") {
  REQUIRE(world().size() == 4);
  nn::GPTConfig cfg = small_gpt();
  cfg.vocab_size = 256;
  cfg.width = 64;
  cfg.context = 16;
  const json options = {{"tp_size", 2}, {"pp_size", 2}, {"num_microbatches", 2}};
  Booster eager_booster(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = options});
  Booster lazy_booster(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = options});

  reset_cpu_peak_bytes();
  size_t base = cpu_bytes_in_use();
  nn::ModulePtr whole = std::make_shared<nn::GPT>(cfg, 5);
  const int64_t whole_bytes = whole->num_parameters() * 4;
  Boosted eager = eager_booster.boost(whole, optim::make_optimizer(kAdamW, whole->parameters()), gpt_loss);
  const size_t eager_peak = cpu_peak_bytes() - base;

  reset_cpu_peak_bytes();
  base = cpu_bytes_in_use();
  nn::ModulePtr deferred;
  {
    LazyInitGuard lazy;
    deferred = std::make_shared<nn::GPT>(cfg, 5);
  }
  Boosted b = lazy_booster.boost(deferred, optim::make_optimizer(kAdamW, deferred->parameters()), gpt_loss);
  const size_t lazy_peak = cpu_peak_bytes() - base;

  const int64_t part_bytes = b.model->num_parameters() * 4;
  INFO("whole " << whole_bytes << " bytes, part " << part_bytes << ", peak eager " << eager_peak << ", deferred "
                << lazy_peak);
  CHECK(3 * part_bytes < whole_bytes);  // so the bound below tells the two apart
  CHECK(eager_peak >= size_t(whole_bytes));
  CHECK(lazy_peak <= size_t(3 * part_bytes));
  const nn::StateDict want = eager.model->state_dict();
  const nn::StateDict got = b.model->state_dict();
  CHECK(got.size() == want.size());
  for (const auto& [name, t] : got) {
    INFO(name);
    REQUIRE(want.count(name));
    CHECK(sum(ne(t, want.at(name))).item() == 0.0);
  }

  // The policy alone, on a deferred model: it allocates this stage's shards and nothing else (not the
  // other stage's layers, split or whole). Its allocations are the part's parameters that are no longer
  // deferred, plus the float64 staging of one slice at a time (at most twice the largest of them).
  distributed::DeviceMesh mesh(world(), 2, 2);
  nn::ShardContext context;
  context.tp = &mesh.tp_group();
  context.stage = mesh.coord().pp;
  context.stages = 2;
  nn::ModulePtr again;
  {
    LazyInitGuard lazy;
    again = std::make_shared<nn::GPT>(cfg, 5);
  }
  reset_cpu_peak_bytes();
  base = cpu_bytes_in_use();
  const nn::ShardedModel part = nn::find_shard_policy("GPT", "this test")(again, context);
  const size_t policy_peak = cpu_peak_bytes() - base;
  size_t allocated = 0, largest = 0;
  for (const Tensor& p : part.module->parameters())
    if (!is_deferred(p)) allocated += p.nbytes(), largest = std::max(largest, p.nbytes());
  INFO("policy peak " << policy_peak << ", the part's allocated parameters " << allocated);
  CHECK(allocated > 0);
  CHECK(policy_peak <= allocated + 2 * largest);
  CHECK(cpu_bytes_in_use() - base == allocated);
  if (world().rank() == 0)
    WARN("deferred build: whole model " << whole_bytes << " bytes, this rank's part " << part_bytes
                                        << ", peak during build and boost " << lazy_peak << " (eager " << eager_peak
                                        << ")");
}
