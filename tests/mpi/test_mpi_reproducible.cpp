// Reproducible training across world sizes (Note [Reproducible training across world sizes] in
// booster/booster/reproducible.h) under `mpirun -np 2` and `-np 4`: a run of Booster::reproducible_step
// on every rank of the job ends on the same bytes (every weight, every optimizer state tensor, every
// step's loss) as the same run on one process that sees the whole global batch. The one-process run is
// made on each rank itself, with the built-in single-process plugin, so the comparison is exact and needs
// no file. Under AdamW the ordinary data-parallel runs differ from the one-process run in their last
// bits (issue 49), so equality here is what the chunk tree buys. Also the refusals, with their messages.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "booster/booster/booster.h"
#include "booster/booster/reproducible.h"
#include "booster/distributed/process_group.h"
#include "booster/mixed_precision/master_weight_optimizer.h"
#include "booster/nn/activation.h"
#include "booster/nn/container.h"
#include "booster/nn/dropout.h"
#include "booster/nn/linear.h"
#include "booster/nn/llama.h"
#include "booster/nn/loss.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/trainer/trainer.h"

using namespace booster;
using nlohmann::json;

namespace {

distributed::ProcessGroup& group() { return distributed::init_process_group("mpi"); }

constexpr int64_t kIn = 8, kHidden = 16, kOut = 4;  // 212 parameters
constexpr int64_t kGlobalRows = 32;                 // rows of a step's global batch
constexpr int64_t kChunks = 8;                      // 1, 2, 4 and 8 processes
constexpr int kSteps = 6;

nn::ModulePtr make_model(double dropout = 0.0) {
  Generator gen(7);
  auto model = std::make_shared<nn::Sequential>();
  model->push_back(std::make_shared<nn::Linear>(kIn, kHidden, true, &gen));
  model->push_back(std::make_shared<nn::Tanh>());
  if (dropout > 0) model->push_back(std::make_shared<nn::Dropout>(dropout));
  model->push_back(std::make_shared<nn::Linear>(kHidden, kOut, true, &gen));
  model->set_tensor_names();
  return model;
}

struct Batch {
  Tensor x, y;
};
// The global batch of step `step`, the same on every rank. Gradients of a near-zero mean are where
// roundoff shows under Adam, so the targets are noise around the model's output.
Batch global_batch(int step) {
  Generator gen(1000 + uint64_t(step));
  return {randn({kGlobalRows, kIn}, &gen), mul(randn({kGlobalRows, kOut}, &gen), 0.1)};
}
// Rank `rank`'s rows of it as a DistributedSampler deals them: rows rank, rank + world, ...
Batch rows_of(const Batch& b, int world, int rank) {
  std::vector<int64_t> picked;
  for (int64_t p = rank; p < b.x.size(0); p += world) picked.push_back(p);
  Tensor index = Tensor::empty({int64_t(picked.size())}, DType::Int64);
  std::memcpy(index.data<int64_t>(), picked.data(), picked.size() * sizeof(int64_t));
  return {index_select(b.x, 0, index), index_select(b.y, 0, index)};
}

Tensor mse(const Tensor& out, const Tensor& target) { return mse_loss(out, target); }

struct Outcome {
  std::vector<Tensor> params;               // as the model holds them (dtype kept)
  std::map<std::string, Tensor> state;      // the optimizer's state tensors
  std::vector<double> losses;               // per step
  std::vector<double> scales;               // the loss scale after each step
  int skipped = 0;                          // steps skipped (inf/NaN gradients)
};

// kSteps reproducible steps of AdamW under `config`; `whole`: this process takes the whole global
// batch (the one-process reference), else its rows of it.
Outcome train(BoosterConfig config, bool whole, int64_t accumulation_rows = 0, int steps = kSteps) {
  config.reproducible = true;
  config.reproducible_chunks = kChunks;
  Booster booster(config);
  nn::ModulePtr net = make_model();
  std::shared_ptr<optim::Optimizer> adamw =
      optim::make_optimizer({{"type", "adamw"}, {"lr", 1e-2}, {"weight_decay", 0.01}}, net->parameters());
  Boosted b = booster.boost(net, adamw, mse);
  Outcome out;
  const int world = whole ? 1 : group().size();
  const int rank = whole ? 0 : group().rank();
  for (int s = 0; s < steps; ++s) {
    const Batch mine = rows_of(global_batch(s), world, rank);
    Tensor x = mine.x, y = mine.y;
    if (accumulation_rows > 0) {
      // The micro-batches of a step, concatenated: what the Trainer passes with grad_accumulation.
      std::vector<Tensor> xs, ys;
      for (int64_t r = 0; r < x.size(0); r += accumulation_rows) {
        xs.push_back(x.narrow(0, r, accumulation_rows));
        ys.push_back(y.narrow(0, r, accumulation_rows));
      }
      x = cat(xs, 0);
      y = cat(ys, 0);
    }
    out.losses.push_back(booster.reproducible_step(x, y, *b.model, b.criterion, *b.optimizer));
    b.optimizer->step();
    out.skipped += b.optimizer->step_was_skipped() ? 1 : 0;
    out.scales.push_back(booster.precision().loss_scale());
  }
  for (const Tensor& p : b.model->parameters()) out.params.push_back(p.detach().clone());
  out.state = b.optimizer->state_dict().tensors;
  // A master-weight strategy keeps its float32 masters beside the optimizer state (ZeRO inside it).
  if (const auto* mw = dynamic_cast<const mixed_precision::MasterWeightOptimizer*>(&b.optimizer->stepped_optimizer())) {
    size_t i = 0;
    for (const optim::ParamGroup& g : mw->inner().param_groups())
      for (const Tensor& master : g.params) out.state["state." + std::to_string(i++) + ".master_weight"] = master.clone();
  }
  return out;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

void require_same_bytes(const Outcome& got, const Outcome& want) {
  REQUIRE(got.params.size() == want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(bitwise_equal(got.params[i], want.params[i]));
  }
  REQUIRE(got.state.size() == want.state.size());
  for (const auto& [name, t] : want.state) {
    INFO("optimizer state " << name);
    REQUIRE(got.state.count(name) == 1);
    REQUIRE(bitwise_equal(got.state.at(name), t));
  }
  REQUIRE(got.skipped == want.skipped);
  REQUIRE(got.scales == want.scales);
  for (size_t s = 0; s < want.losses.size(); ++s) {
    INFO("step " << s + 1);
    REQUIRE(std::memcmp(&got.losses[s], &want.losses[s], sizeof(double)) == 0);
  }
}

BoosterConfig with(const std::string& precision, const std::string& plugin, json plugin_options = json::object()) {
  BoosterConfig c;
  c.mixed_precision = precision;
  c.plugin = plugin;
  c.plugin_options = std::move(plugin_options);
  return c;
}

// ---- the Trainer (what `booster train` runs) on a GPT and a Llama
constexpr int64_t kSequences = 64, kContext = 8, kVocab = 32;
constexpr int64_t kStepRows = 16;  // the global batch: 4 steps an epoch

data::DatasetPtr token_data() {
  Generator gen(31);
  Tensor x = Tensor::empty({kSequences, kContext}, DType::Int64), y = Tensor::empty({kSequences, kContext}, DType::Int64);
  for (int64_t i = 0; i < kSequences * kContext; ++i) {
    x.data<int64_t>()[i] = int64_t(gen.uniform() * double(kVocab)) % kVocab;
    y.data<int64_t>()[i] = int64_t(gen.uniform() * double(kVocab)) % kVocab;
  }
  return std::make_shared<data::TensorDataset>(x, y);
}

Tensor lm_loss(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

nn::ModulePtr language_model(const std::string& family) {
  if (family == "gpt") {
    nn::GPTConfig cfg;
    cfg.vocab_size = kVocab;
    cfg.context = kContext;
    cfg.width = 16;
    cfg.layers = 2;
    cfg.heads = 2;
    return std::make_shared<nn::GPT>(cfg, 5);
  }
  nn::LlamaConfig cfg;
  cfg.vocab_size = kVocab;
  cfg.hidden_size = 16;
  cfg.intermediate_size = 32;
  cfg.num_hidden_layers = 2;
  cfg.num_attention_heads = 4;
  cfg.num_key_value_heads = 2;
  cfg.max_position_embeddings = kContext;
  return std::make_shared<nn::Llama>(cfg, 5);
}

// A Trainer run of two epochs (8 steps) with `accumulation` micro-batches a step; `whole`: one process
// with the whole global batch.
Outcome fit(BoosterConfig config, const std::string& family, int64_t accumulation, bool whole) {
  config.reproducible = true;
  config.reproducible_chunks = kChunks;
  if (whole) config.plugin = "";
  Booster booster(config);
  nn::ModulePtr net = language_model(family);
  std::shared_ptr<optim::Optimizer> adamw =
      optim::make_optimizer({{"type", "adamw"}, {"lr", 3e-2}, {"weight_decay", 0.01}}, net->parameters());
  const int world = whole ? 1 : group().size();
  auto loader = booster.prepare_dataloader(token_data(), {.batch_size = kStepRows / world / accumulation,
                                                          .shuffle = true, .drop_last = true, .seed = 3});
  booster.boost(net, adamw, lm_loss, loader, nullptr);
  TrainerOptions o;
  o.epochs = 2;
  o.grad_accumulation = accumulation;
  o.log_every = 1;
  o.handle_signals = false;
  o.progress = trainer::Progress::Mode::Silent;
  std::vector<double> losses;
  Trainer trainer(booster, o);
  trainer.on_step([&](const trainer::StepReport& r) { losses.push_back(r.loss); });
  const FitResult result = trainer.fit();
  Outcome out;
  for (const auto& [name, t] : booster.boosted().model->state_dict()) out.params.push_back(t.clone());
  out.state = booster.boosted().optimizer->state_dict().tensors;
  out.losses = losses;  // every step's, on rank 0 (on_step hooks run there)
  out.losses.push_back(result.final_loss);
  return out;
}

}  // namespace

TEST_CASE("reproducible Trainer runs of a GPT and a Llama end on the one-process bytes", "[mpi][reproducible]") {
  for (const std::string family : {"gpt", "llama"})
    for (const int64_t accumulation : {1, 2}) {
      INFO(family << ", " << accumulation << " micro-batches a step");
      const Outcome reference = fit(with("fp32", ""), family, accumulation, true);
      require_same_bytes(fit(with("fp32", "ddp"), family, accumulation, false), reference);
      require_same_bytes(
          fit(with("fp32", "low_level_zero", {{"stage", 1}, {"precision", "fp32"}}), family, accumulation, false),
          reference);
    }
  // bf16 on the GPT: a bfloat16 model with float32 masters.
  BoosterConfig pure = with("bf16", "ddp");
  pure.mixed_precision_options = {{"pure", true}};
  require_same_bytes(fit(pure, "gpt", 2, false), fit(pure, "gpt", 2, true));
}

TEST_CASE("reproducible ddp fp32 ends on the one-process bytes", "[mpi][reproducible]") {
  const Outcome reference = train(with("fp32", ""), /*whole=*/true);
  require_same_bytes(train(with("fp32", "ddp"), false), reference);
}

TEST_CASE("reproducible ddp bf16 ends on the one-process bytes", "[mpi][reproducible]") {
  BoosterConfig pure = with("bf16", "");
  pure.mixed_precision_options = {{"pure", true}};
  const Outcome reference = train(pure, true);
  BoosterConfig ddp = with("bf16", "ddp");
  ddp.mixed_precision_options = {{"pure", true}};
  require_same_bytes(train(ddp, false), reference);
  // Autocast bf16 (float32 parameters) too.
  require_same_bytes(train(with("bf16", "ddp"), false), train(with("bf16", ""), true));
}

TEST_CASE("reproducible ddp with the step's micro-batches concatenated", "[mpi][reproducible]") {
  // Two micro-batches per rank and step: the chunks are cut from the concatenated rows.
  const int64_t per_rank = kGlobalRows / group().size();
  require_same_bytes(train(with("fp32", "ddp"), false, per_rank / 2), train(with("fp32", ""), true));
}

TEST_CASE("reproducible ddp fp16 with a dynamic loss scale decides as one process does", "[mpi][reproducible]") {
  // A scale of 2^24 overflows float16 in the first steps (skipped, the scale halves), then grows every
  // 2 good steps: the same decisions, and the same bytes, at every world size.
  BoosterConfig fp16 = with("fp16", "ddp");
  fp16.mixed_precision_options = {{"init_scale", 16777216.0}, {"growth_interval", 2}};
  BoosterConfig single = fp16;
  single.plugin = "";
  const Outcome reference = train(single, true, 0, 16);
  INFO("skipped " << reference.skipped << " of 16 steps");
  REQUIRE(reference.skipped > 0);
  REQUIRE(reference.skipped < 16);
  require_same_bytes(train(fp16, false, 0, 16), reference);
}

TEST_CASE("reproducible zero stage 1 fp32 ends on the one-process bytes", "[mpi][reproducible]") {
  const Outcome reference = train(with("fp32", ""), true);
  require_same_bytes(train(with("fp32", "low_level_zero", {{"stage", 1}, {"precision", "fp32"}}), false), reference);
}

TEST_CASE("reproducible zero stage 1 bf16 ends where ddp does", "[mpi][reproducible]") {
  // ZeRO's bf16 is a bfloat16 model with float32 masters: the pure bf16 recipe on one process.
  BoosterConfig pure = with("bf16", "");
  pure.mixed_precision_options = {{"pure", true}};
  require_same_bytes(train(with("fp32", "low_level_zero", {{"stage", 1}, {"precision", "bf16"}}), false),
                     train(pure, true));
}

TEST_CASE("reproducible refusals name what would work", "[mpi][reproducible]") {
  using Catch::Matchers::Contains;
  BoosterConfig zero2 = with("fp32", "low_level_zero", {{"stage", 2}, {"precision", "fp32"}});
  zero2.reproducible = true;
  REQUIRE_THROWS_WITH(Booster(zero2), Contains("low_level_zero stage 2") && Contains("use stage 1"));
  BoosterConfig zero_fp16 = with("fp32", "low_level_zero", {{"stage", 1}});
  zero_fp16.reproducible = true;
  REQUIRE_THROWS_WITH(Booster(zero_fp16), Contains("precision 'fp16'") && Contains("fp32 or bf16"));
  BoosterConfig naive = with("fp16_naive", "ddp");
  naive.reproducible = true;
  REQUIRE_THROWS_WITH(Booster(naive), Contains("precision 'fp16_naive' is not supported"));

  // Chunks that are no power of two, that do not divide the batch, or that the world size does not divide.
  REQUIRE_THROWS_WITH(reproducible::check_sizes(6, 24, 1, "here"), Contains("power of two") && Contains("1, 2, 4 or 8"));
  REQUIRE_THROWS_WITH(reproducible::check_sizes(16, 24, 1, "here"),
                      Contains("not cut evenly into 16 chunks") && Contains("1, 2, 4 or 8"));
  REQUIRE_THROWS_WITH(reproducible::check_sizes(4, 24, 8, "here"),
                      Contains("8 processes do not divide the 4") && Contains("run on 1, 2 or 4 processes"));
  REQUIRE_THROWS_WITH(reproducible::check_sizes(8, 24, 3, "here"), Contains("run on 1, 2, 4 or 8 processes"));
  REQUIRE_NOTHROW(reproducible::check_sizes(8, 24, 4, "here"));
  REQUIRE(reproducible::default_chunks(24) == 8);
  REQUIRE(reproducible::default_chunks(12) == 4);
  REQUIRE(reproducible::default_chunks(7) == 1);

  // What `booster check` says, and its refusals, on a resolved config.
  json config = {{"train", {{"reproducible", true}, {"reproducible_chunks", nullptr}, {"grad_accumulation", 2},
                            {"max_grad_norm", nullptr}}},
                 {"plugin", {{"name", "ddp"}}},
                 {"mixed_precision", {{"name", "bf16"}}},
                 {"model", {{"type", "gpt"}, {"dropout", 0.0}}},
                 {"data", {{"batch_size", 12}}}};
  REQUIRE_THAT(reproducible::describe_config(config, 1),
               Contains("global batch of 24 rows is cut into 8 chunks of 3 rows") &&
                   Contains("1 (data.batch_size 12), 2 (data.batch_size 6), 4 (data.batch_size 3)"));
  REQUIRE_THROWS_WITH(reproducible::describe_config(config, 3), Contains("run on 1, 2, 4 or 8 processes"));
  config["model"]["dropout"] = 0.1;
  REQUIRE_THROWS_WITH(reproducible::describe_config(config, 1), Contains("model.dropout is 0.1"));
  config["model"]["dropout"] = 0.0;
  config["plugin"] = {{"name", "low_level_zero"}, {"stage", 1}, {"precision", "bf16"}};
  config["train"]["max_grad_norm"] = 1.0;
  REQUIRE_THROWS_WITH(reproducible::describe_config(config, 1), Contains("clipping under low_level_zero"));
  config["train"]["reproducible"] = false;
  REQUIRE_THAT(reproducible::describe_config(config, 1), Contains("not reproducible"));

  // Tensor parallelism, and dropout.
  REQUIRE_THROWS_WITH(reproducible::check_layout("hybrid_parallel", {.data = 1, .tensor = 2}, json::object(), "fp32"),
                      Contains("tp_size 2") && Contains("tp_size 1"));
  BoosterConfig ddp = with("fp32", "ddp");
  ddp.reproducible = true;
  Booster booster(ddp);
  REQUIRE_THROWS_WITH(booster.boost(make_model(0.1)), Contains("dropout '2' has p = 0.1"));

  // A batch the chunks do not divide, at the step.
  BoosterConfig odd = with("fp32", "ddp");
  odd.reproducible = true;
  odd.reproducible_chunks = 8;
  Booster b2(odd);
  nn::ModulePtr net = make_model();
  Boosted parts = b2.boost(net, optim::make_optimizer({{"type", "sgd"}, {"lr", 0.1}}, net->parameters()), mse);
  const Batch rows = rows_of(global_batch(0), 1, 0);
  REQUIRE_THROWS_WITH(b2.reproducible_step(rows.x.narrow(0, 0, 3), rows.y.narrow(0, 0, 3), *parts.model,
                                           parts.criterion, *parts.optimizer),
                      Contains("not cut evenly into 8 chunks"));
}
