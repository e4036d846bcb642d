// The token mean of a global batch (Note [The token mean of a global batch] in booster/trainer/trainer.cpp)
// under `mpirun -np 2`: a GPT trained one Trainer step on 8 sequences whose targets are masked as sft
// data's (a prompt of varied length, -100), split over 2 ranks and 1, 2 or 4 micro-batches, under ddp,
// low_level_zero stages 1 to 3 and hybrid_parallel (dp 2, tp 2, pp 2), ends where one process's plain
// step on all 8 does: loss = sum of the N counted targets' losses / N (in float64 from the per-target
// losses), gradient that of the summed cross-entropy over N, within float32 roundoff bounds. And packed
// sft samples (Note [Packing SFT records]) train a Llama under ddp, ZeRO-2 and tp 2 as one process
// trains it on the records one by one, and under pp (1F1B, GPipe, with activation checkpointing; on 4
// ranks tp 2 x pp 2 and dp 2 x pp 2) give the logits and step of one process on the same packed batch,
// as they do a GPT under pp 2, tp 2 and tp 2 x pp 2.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/data/data.h"
#include "booster/data/sft.h"
#include "booster/nn/model_registry.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/loss.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"
#include "booster/trainer/trainer.h"
#include "roundoff.h"
#include "sft_bytes.h"

using namespace booster;
using nlohmann::json;
namespace fs = std::filesystem;
namespace ro = ::testing::roundoff;

namespace {

distributed::ProcessGroup& world() { return distributed::init_process_group("mpi"); }

fs::path shared_dir(const std::string& tag) {
  Tensor n = full({1}, double(std::random_device{}() % 1000000), DType::Int64);
  world().broadcast(n, 0);
  return fs::temp_directory_path() / ("booster_token_mean_" + tag + "_" + std::to_string(n.to_vector<int64_t>()[0]));
}

constexpr int64_t kSamples = 8;
constexpr double kLr = 0.5;

nn::GPTConfig small_gpt() {
  nn::GPTConfig cfg;
  cfg.vocab_size = 32;
  cfg.context = 8;
  cfg.width = 16;
  cfg.layers = 2;
  cfg.heads = 2;
  return cfg;
}

// Sample i trains on its last k_i targets (1 to 8), the rest -100: 36 targets in all.
data::DatasetPtr masked_tokens(const nn::GPTConfig& cfg) {
  const int64_t keep[kSamples] = {1, 8, 2, 7, 3, 1, 6, 8};
  const int64_t T = cfg.context;
  Generator gen(31);
  std::vector<int64_t> x(size_t(kSamples * T)), y(size_t(kSamples * T));
  for (int64_t s = 0; s < kSamples; ++s)
    for (int64_t t = 0; t < T; ++t) {
      x[size_t(s * T + t)] = int64_t(gen.uniform() * double(cfg.vocab_size)) % cfg.vocab_size;
      y[size_t(s * T + t)] = t >= T - keep[s] ? int64_t(gen.uniform() * double(cfg.vocab_size)) % cfg.vocab_size : -100;
    }
  return std::make_shared<data::TensorDataset>(from_vector(x, {kSamples, T}), from_vector(y, {kSamples, T}));
}

Tensor lm_loss(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

double l2(const std::vector<double>& v) {
  double s = 0;
  for (double e : v) s += e * e;
  return std::sqrt(s);
}

struct Reference {
  double loss = 0, loss_abs = 0;
  std::map<std::string, std::vector<double>> before, grad;
};

// One process, the whole batch at once, no Trainer: the per-target losses summed in float64 over N,
// and the gradient of cross_entropy(Sum) / N.
Reference reference(const nn::GPTConfig& cfg) {
  Reference r;
  nn::GPT model(cfg, 5);
  for (const auto& [name, t] : model.state_dict()) r.before[name] = t.to(DType::Float64).to_vector<double>();
  const data::Batch all = masked_tokens(cfg)->get_batch({0, 1, 2, 3, 4, 5, 6, 7});
  const Tensor logits = model(all.x).reshape({-1, cfg.vocab_size});
  const Tensor target = all.y.reshape({-1});
  const int64_t n = nn::count_targets(target);
  REQUIRE(n == 36);
  {
    autograd::NoGradGuard no_grad;
    const std::vector<double> each = cross_entropy(logits, target, Reduction::None).to(DType::Float64).to_vector<double>();
    for (double l : each) r.loss += l / double(n), r.loss_abs += std::abs(l) / double(n);
  }
  (cross_entropy(logits, target, Reduction::Sum) * (1.0 / double(n))).backward();
  for (const auto& [name, p] : model.named_parameters()) r.grad[name] = p.grad().to(DType::Float64).to_vector<double>();
  return r;
}

struct Layout {
  std::string name, plugin;
  json options;
  int64_t accumulation;
};

}  // namespace

TEST_CASE("token mean: every plugin and accumulation on 2 ranks gives the float64 sum over count",
          "[mpi][trainer][sft]") {
  REQUIRE(world().size() == 2);
  const nn::GPTConfig cfg = small_gpt();
  const Reference ref = reference(cfg);
  const std::vector<Layout> layouts = {
      {"ddp, 1 micro-batch", "ddp", json::object(), 1},
      {"ddp, 2 micro-batches", "ddp", json::object(), 2},
      {"ddp, 4 micro-batches", "ddp", json::object(), 4},
      {"zero 1", "low_level_zero", {{"stage", 1}, {"precision", "fp32"}}, 2},
      {"zero 2", "low_level_zero", {{"stage", 2}, {"precision", "fp32"}}, 2},
      {"zero 3", "low_level_zero", {{"stage", 3}, {"precision", "fp32"}}, 2},
      {"hybrid dp 2", "hybrid_parallel", json::object(), 2},
      {"hybrid tp 2", "hybrid_parallel", {{"tp_size", 2}}, 2},
      {"hybrid pp 2", "hybrid_parallel", {{"pp_size", 2}, {"num_microbatches", 2}}, 2},
  };
  for (const Layout& l : layouts) {
    INFO(l.name);
    Booster booster(BoosterConfig{.plugin = l.plugin, .plugin_options = l.options});
    auto model = std::make_shared<nn::GPT>(cfg, 5);
    auto sgd = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", kLr}});
    const int64_t replicas = l.options.value("tp_size", 1) * l.options.value("pp_size", 1) > 1 ? 1 : 2;
    auto loader = booster.prepare_dataloader(masked_tokens(cfg), {.batch_size = kSamples / replicas / l.accumulation});
    booster.boost(model, sgd, lm_loss, loader, nullptr);
    TrainerOptions o;
    o.max_steps = 1;
    o.grad_accumulation = l.accumulation;
    o.handle_signals = false;
    o.progress = trainer::Progress::Mode::Silent;
    o.token_mean_ignore_index = -100;
    Trainer trainer(booster, o);
    const FitResult result = trainer.fit();
    // Note [Roundoff bounds] in tests/roundoff.h: the GPT's forward chain on the batch, the same back,
    // the weight's sum over the 64 positions, the sums over micro-batches and ranks, and about ten single
    // roundings of the scaling (Note [The token mean of a global batch]).
    const double forward = ro::gpt_forward_length(double(cfg.width), double(cfg.layers), double(cfg.heads),
                                                  double(cfg.context), double(cfg.vocab_size), double(kSamples));
    const double eps_forward = ro::gamma(10, ro::kUnit) + ro::reduction_bound({forward, double(l.accumulation) + 2});
    const double eps_gradient = ro::gamma(10, ro::kUnit) +
                                ro::reduction_bound({2 * forward, double(kSamples * cfg.context), double(l.accumulation) + 2});
    CHECK(std::abs(result.final_loss - ref.loss) <= eps_forward * ref.loss_abs);
    const fs::path dir = shared_dir("model");
    booster.save_model(*booster.boosted().model, dir);
    if (world().rank() == 0) {
      const checkpoint::TensorMap saved = checkpoint::load_model(dir);
      for (const auto& [name, before] : ref.before) {
        INFO(name);
        if (!ref.grad.count(name)) continue;  // not a parameter
        if (!saved.count(name)) {
          FAIL_CHECK("the saved model has no " << name);
          continue;
        }
        const std::vector<double> got = saved.at(name).to(DType::Float64).to_vector<double>();
        const std::vector<double>& g = ref.grad.at(name);
        std::vector<double> want(before.size()), d(before.size());
        for (size_t e = 0; e < before.size(); ++e) want[e] = before[e] - kLr * g[e], d[e] = got[e] - want[e];
        // The update's own rounding (one unit of each weight) and the gradient's (sgd_bound of the
        // step's length).
        const double bound = ro::kUnit * l2(want) + ro::sgd_bound(kLr * l2(g), eps_gradient);
        INFO("|difference| " << l2(d) << ", bound " << bound << ", step " << kLr * l2(g));
        CHECK(l2(d) <= bound);
      }
    }
    world().barrier();
    if (world().rank() == 0) fs::remove_all(dir);
  }
}

namespace {

// Short records of varied lengths, byte-tokenized (bos 1, eos 2), packed into sequences of 32.
std::shared_ptr<data::SftDataset> byte_records(bool packing) {
  const data::SftTokenizer bytes = ::testing::byte_sft_tokenizer();
  std::vector<data::Conversation> records;
  for (const auto& [p, r] : std::vector<std::pair<std::string, std::string>>{
           {"a", "one"}, {"what is two", "2"}, {"say hello", "hello"}, {"q", "r"}, {"hi", "yo"},
           {"x", "abc"}, {"name it", "a name"}, {"b", "c"}, {"up or down", "up"}, {"why", "because"}})
    records.push_back({{"user", p}, {"assistant", r}});
  const data::ChatTemplate tmpl =
      data::chat_template_from_json({{"user", "U:{content}|"}, {"assistant", "A:{content}!"}});
  return std::make_shared<data::SftDataset>(records, tmpl, bytes, data::SftOptions{.seq_len = 32, .packing = packing},
                                            "records");
}

const json kLlama = {{"type", "llama"},          {"vocab_size", 256},      {"hidden_size", 16},
                     {"intermediate_size", 24},  {"num_hidden_layers", 2}, {"num_attention_heads", 2},
                     {"num_key_value_heads", 2}, {"max_position_embeddings", 64}};

// One Trainer step of SGD lr kLr on all of `data` in one batch per replica, of the Llama `config`; its
// loss. With `logits`, first the boosted model's output on `eval_x` without gradients.
double llama_step(Booster& booster, const data::DatasetPtr& data, int64_t batch, const json& config = kLlama,
                  const Tensor& eval_x = Tensor(), Tensor* logits = nullptr) {
  const nn::ModulePtr model = nn::make_model(config, 5);
  auto sgd = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", kLr}});
  booster.boost(model, sgd, lm_loss, booster.prepare_dataloader(data, {.batch_size = batch}), nullptr);
  if (logits != nullptr) {
    autograd::NoGradGuard no_grad;
    *logits = (*booster.boosted().model)(eval_x);
  }
  TrainerOptions o;
  o.max_steps = 1;
  o.handle_signals = false;
  o.progress = trainer::Progress::Mode::Silent;
  o.token_mean_ignore_index = data::kIgnoreIndex;
  Trainer trainer(booster, o);
  return trainer.fit().final_loss;
}

// Rank 0 reads the model `booster` saves and checks it is one process's step `want` from `start`, within
// a unit of each weight (the update's rounding, twice) and the gradient's sgd_bound of the step.
void check_saved_step(Booster& booster, const nn::StateDict& want, const nn::StateDict& start, double eps_gradient) {
  const fs::path dir = shared_dir("packed");
  booster.save_model(*booster.boosted().model, dir);
  if (world().rank() == 0) {
    const checkpoint::TensorMap saved = checkpoint::load_model(dir);
    for (const auto& [key, w] : want) {
      INFO(key);
      if (!saved.count(key)) {
        FAIL_CHECK("the saved model has no " << key);
        continue;
      }
      const std::vector<double> a = saved.at(key).to(DType::Float64).to_vector<double>();
      const std::vector<double> b = w.to(DType::Float64).to_vector<double>();
      const std::vector<double> s0 = start.at(key).to(DType::Float64).to_vector<double>();
      std::vector<double> d(a.size()), moved(a.size());
      for (size_t e = 0; e < a.size(); ++e) d[e] = a[e] - b[e], moved[e] = b[e] - s0[e];
      const double bound = 2 * ro::kUnit * l2(b) + ro::sgd_bound(l2(moved), eps_gradient);
      INFO("difference " << l2(d) << ", step " << l2(moved) << ", bound " << bound);
      CHECK(l2(d) <= bound);
    }
  }
  world().barrier();
  if (world().rank() == 0) fs::remove_all(dir);
}

}  // namespace

TEST_CASE("token mean: packed sft samples on 2 ranks train a Llama as the records one by one in one process",
          "[mpi][trainer][sft]") {
  const auto alone = byte_records(false), packed = byte_records(true);
  REQUIRE(alone->size() == 10);
  REQUIRE(packed->size() == 6);  // next fit in 32 positions: [11 19] [21 9] [11 11] [20 9] [19] [17]
  Booster single(BoosterConfig{});
  const double want_loss = llama_step(single, alone, alone->size());
  const nn::StateDict want = single.boosted().model->state_dict();
  const nn::StateDict start = nn::make_model(kLlama, 5)->state_dict();
  const double forward = ro::llama_forward_length(16, 2, 2, 24, 32, 256, 10 * 32);
  const double eps_gradient = ro::reduction_bound({2 * forward, 10 * 32, 4});
  for (const auto& [name, plugin, options, replicas] : std::vector<std::tuple<std::string, std::string, json, int64_t>>{
           {"ddp", "ddp", json::object(), 2},
           {"zero 2", "low_level_zero", {{"stage", 2}, {"precision", "fp32"}}, 2},
           {"hybrid tp 2", "hybrid_parallel", {{"tp_size", 2}}, 1}}) {
    INFO(name);
    Booster booster(BoosterConfig{.plugin = plugin, .plugin_options = options});
    const double loss = llama_step(booster, packed, packed->size() / replicas);
    CHECK(std::abs(loss - want_loss) <= ro::reduction_bound({forward, 4}) * want_loss);
    check_saved_step(booster, want, start, eps_gradient);
  }
}

TEST_CASE("token mean: packed sft samples under hybrid pp and tp give a Llama and a GPT the logits and step of one process",
          "[mpi][trainer][sft][packed_pp]") {
  // Note [Packed micro-batches] in booster/nn/pipeline.cpp: a stage after the first runs each
  // micro-batch under the layout of the packed input it is handed too, so the split Llama's logits
  // (evaluation through forward_to_all) and one Trainer step (execute_pipeline) equal the packed batch's
  // on one process, where the records stay apart. On 2 ranks pp 2 under 1F1B, GPipe and with activation
  // checkpointing; on 4 (CTest's test_mpi_token_mean_4_ranks) tp 2 x pp 2 and dp 2 x pp 2.
  const int n = world().size();
  REQUIRE((n == 2 || n == 4));
  distributed::set_default_collective_timeout(std::chrono::seconds(60));  // a stage left waiting fails
  const auto packed = byte_records(true);
  const data::Batch all = packed->get_batch({0, 1, 2, 3, 4, 5});
  // A GPT of the same size keeps the records apart by the same segments, its learned positions per record.
  const json kGPT = {{"type", "gpt"}, {"vocab_size", 256}, {"context", 64}, {"width", 16}, {"layers", 2}, {"heads", 2}};
  // One process, per model: the logits of the packed batch, then one step on it.
  struct Reference {
    Tensor logits;
    double loss;
    nn::StateDict want, start;
  };
  std::map<std::string, Reference> references;
  auto reference_of = [&](const json& config) -> const Reference& {
    const std::string type = config.at("type");
    if (!references.count(type)) {
      Booster single(BoosterConfig{});
      Reference r;
      r.loss = llama_step(single, packed, packed->size(), config, all.x, &r.logits);
      r.want = single.boosted().model->state_dict();
      r.start = nn::make_model(config, 5)->state_dict();
      references[type] = r;
    }
    return references.at(type);
  };
  // Note [Roundoff bounds]: the layouts differ in the GEMMs' row counts (micro-batches), the sums of
  // the weight gradients over micro-batches and ranks, and tp's split sums over the width.
  auto forward_length = [](const json& config, double batch) {
    return config.at("type") == "gpt" ? ro::gpt_forward_length(16, 2, 2, 32, 256, batch)
                                      : ro::llama_forward_length(16, 2, 2, 24, 32, 256, batch);
  };
  json recomputing = kLlama;
  recomputing["activation_checkpointing"] = true;
  using Layout = std::tuple<std::string, json, json>;
  const std::vector<Layout> layouts =
      n == 2 ? std::vector<Layout>{
                   {"pp 2, 1f1b, 2 micro-batches", {{"pp_size", 2}, {"num_microbatches", 2}}, kLlama},
                   {"pp 2, gpipe, 3 micro-batches", {{"pp_size", 2}, {"num_microbatches", 3}, {"schedule", "gpipe"}},
                    kLlama},
                   {"pp 2, 1f1b, 3 micro-batches, activation checkpointing",
                    {{"pp_size", 2}, {"num_microbatches", 3}}, recomputing},
                   {"GPT, pp 2, 1f1b, 2 micro-batches", {{"pp_size", 2}, {"num_microbatches", 2}}, kGPT},
                   {"GPT, tp 2", {{"tp_size", 2}}, kGPT}}
             : std::vector<Layout>{
                   {"tp 2 x pp 2, 2 micro-batches", {{"tp_size", 2}, {"pp_size", 2}, {"num_microbatches", 2}}, kLlama},
                   {"dp 2 x pp 2, 3 micro-batches, activation checkpointing",
                    {{"pp_size", 2}, {"num_microbatches", 3}}, recomputing},
                   {"GPT, tp 2 x pp 2, 2 micro-batches", {{"tp_size", 2}, {"pp_size", 2}, {"num_microbatches", 2}},
                    kGPT}};
  for (const auto& [name, options, model_config] : layouts) {
    INFO(name);
    const Reference& ref = reference_of(model_config);
    const Tensor& want_logits = ref.logits;
    const double want_loss = ref.loss;
    const double eps_logits = ro::reduction_bound({forward_length(model_config, 1)});
    const double forward = forward_length(model_config, 6 * 32);
    const double eps_gradient = ro::reduction_bound({2 * forward, 6 * 32, 4});
    Booster booster(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = options});
    const int64_t replicas = n / (options.value("tp_size", 1) * options.value("pp_size", 1));
    Tensor logits;
    const double loss = llama_step(booster, packed, packed->size() / replicas, model_config, all.x, &logits);
    REQUIRE(logits.shape() == want_logits.shape());
    const double scale = max(abs(want_logits)).item<double>();
    const double d_logits = max(abs(logits - want_logits)).item<double>();
    INFO("logits differ by " << d_logits << ", bound " << eps_logits * scale);
    CHECK(d_logits <= eps_logits * scale);
    INFO("loss " << loss << ", one process " << want_loss);
    CHECK(std::abs(loss - want_loss) <= ro::reduction_bound({forward, 4}) * want_loss);
    check_saved_step(booster, ref.want, ref.start, eps_gradient);
  }
}
