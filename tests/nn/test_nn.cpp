// booster::nn: Module registries and names, checkpoints, modes, dtype conversion, layers, and the GPT
// and MLP models against PyTorch (tests/fixtures/make_nn_module_fixtures.py).
#include <catch2/catch.hpp>

#include <cmath>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/nn/nn.h"
#include "booster/ops/ops.h"
#include "fixture.h"

using namespace booster;
using booster::testing::allclose;
using booster::testing::max_abs_diff;
using booster::testing::tensor_from_json;
using nlohmann::json;

namespace {

const json& fixtures() {
  static const json j = booster::testing::load_fixture_json("nn_modules.json");
  return j;
}

std::vector<std::string> names_of(const std::vector<std::pair<std::string, Tensor>>& named) {
  std::vector<std::string> out;
  for (const auto& [name, t] : named) out.push_back(name);
  return out;
}

// The PyTorch state dict stored in a fixture case ("param:<name>" entries).
nn::StateDict fixture_state_dict(const json& c) {
  nn::StateDict sd;
  for (const auto& [key, value] : c.items())
    if (key.rfind("param:", 0) == 0) sd.emplace(key.substr(6), tensor_from_json(value));
  return sd;
}

std::shared_ptr<nn::GPT> tiny_gpt(uint64_t seed = 0, double dropout = 0.0) {
  return std::make_shared<nn::GPT>(nn::GPTConfig{11, 8, 16, 2, 2, dropout}, seed);
}

std::shared_ptr<nn::MLPClassifier> tiny_mlp(uint64_t seed = 0) {
  return std::make_shared<nn::MLPClassifier>(12, std::vector<int64_t>{10, 8}, 5, "relu", seed);
}

double std_of(const Tensor& t) {
  const auto v = t.tolist();
  double m = 0, s = 0;
  for (double x : v) m += x;
  m /= double(v.size());
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / double(v.size()));
}

// A module with a parameter, a buffer and a child, for registry tests that need no ops.
struct Toy : nn::Module {
  Toy() {
    scale = register_parameter("scale", ones({3}));
    count = register_buffer("count", zeros({}, DType::Int64));
    stat = register_buffer("stat", zeros({3}));
    norm = register_module("norm", std::make_shared<nn::BatchNorm1d>(3));
    proj = register_module("proj", std::make_shared<nn::Linear>(3, 2));
  }
  std::string name() const override { return "Toy"; }
  Tensor scale, count, stat;
  std::shared_ptr<nn::BatchNorm1d> norm;
  std::shared_ptr<nn::Linear> proj;
};

}  // namespace

// ------------------------------------------------------------------------------------------ names

TEST_CASE("MLP parameters have PyTorch's names, order and shapes", "[nn]") {
  const json& c = fixtures().at("mlp");
  auto mlp = tiny_mlp();
  const auto named = mlp->named_parameters();
  REQUIRE(names_of(named) == c.at("names").get<std::vector<std::string>>());
  for (const auto& [name, t] : named) {
    CHECK(t.shape() == c.at("param:" + name).at("shape").get<Shape>());
    CHECK(t.requires_grad());
    CHECK(t.is_leaf());
    CHECK(t.name() == name);  // messages from ops and optimizers name the full path
  }
  REQUIRE(mlp->named_buffers().empty());
  REQUIRE(mlp->num_parameters() == 12 * 10 + 10 + 10 * 8 + 8 + 8 * 5 + 5);
  REQUIRE(mlp->parameters().size() == named.size());
  REQUIRE(mlp->parameters()[0].is_same(named[0].second));
  REQUIRE(mlp->repr() ==
          "MLPClassifier(\n"
          "  (layers): Sequential(\n"
          "    (0): Linear(in_features=12, out_features=10, bias=True)\n"
          "    (1): ReLU()\n"
          "    (2): Linear(in_features=10, out_features=8, bias=True)\n"
          "    (3): ReLU()\n"
          "    (4): Linear(in_features=8, out_features=5, bias=True)\n"
          "  )\n"
          ")");
  REQUIRE(nn::BatchNorm1d(3).repr() == "BatchNorm1d(3, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)");
}

TEST_CASE("GPT parameters have PyTorch's names, order and shapes", "[nn]") {
  const json& c = fixtures().at("gpt");
  auto gpt = tiny_gpt();
  const auto named = gpt->named_parameters();
  REQUIRE(names_of(named) == c.at("names").get<std::vector<std::string>>());
  for (const auto& [name, t] : named) {
    CHECK(t.shape() == c.at("param:" + name).at("shape").get<Shape>());
    CHECK(t.name() == name);
  }
  REQUIRE(names_of(gpt->named_buffers()) == c.at("buffer_names").get<std::vector<std::string>>());
  // The layer members and the registry hold the same tensors.
  REQUIRE(gpt->blocks->named_parameters()[2].second.is_same(
      std::dynamic_pointer_cast<nn::Block>((*gpt->blocks)[0])->attn->c_attn->weight));
  // Non-recursive listing: GPT itself owns no tensors, its children are in registration order.
  REQUIRE(gpt->named_parameters(false).empty());
  std::vector<std::string> children;
  for (const auto& [name, m] : gpt->named_children()) children.push_back(name);
  REQUIRE(children == std::vector<std::string>{"wte", "wpe", "drop", "blocks", "ln_f", "lm_head"});
  REQUIRE(gpt->child("ln_f")->name() == "LayerNorm");
  REQUIRE_THROWS_WITH(gpt->child("h"), Catch::Contains("\"h\"") && Catch::Contains("\"blocks\""));
}

TEST_CASE("buffers and modules are listed with dotted names", "[nn]") {
  Toy toy;
  REQUIRE(names_of(toy.named_parameters()) ==
          std::vector<std::string>{"scale", "norm.weight", "norm.bias", "proj.weight", "proj.bias"});
  REQUIRE(names_of(toy.named_buffers()) == std::vector<std::string>{"count", "stat", "norm.running_mean",
                                                                    "norm.running_var", "norm.num_batches_tracked"});
  REQUIRE(names_of(toy.named_buffers(false)) == std::vector<std::string>{"count", "stat"});
  const auto modules = toy.named_modules();
  REQUIRE(modules.size() == 3);
  REQUIRE(modules[0].first.empty());
  REQUIRE(modules[1].first == "norm");
  std::vector<std::string> visited;
  toy.apply([&](nn::Module& m) { visited.push_back(m.name()); });
  REQUIRE(visited == std::vector<std::string>{"BatchNorm1d", "Linear", "Toy"});  // children first
  for (const auto& [name, t] : toy.named_buffers()) CHECK_FALSE(t.requires_grad());
  const nn::StateDict sd = toy.state_dict();
  REQUIRE(sd.size() == 10);
  REQUIRE(sd.at("norm.num_batches_tracked").dtype() == DType::Int64);
  // state_dict shares storage with the module, like PyTorch's.
  REQUIRE(sd.at("scale").data_ptr() == toy.scale.data_ptr());
  REQUIRE_FALSE(sd.at("scale").requires_grad());
}

// ------------------------------------------------------------------------------------------ init and factory

TEST_CASE("Linear and Embedding use PyTorch's default init", "[nn]") {
  Generator gen(7);
  nn::Linear lin(400, 300, true, &gen);
  const double bound = 1.0 / std::sqrt(400.0);
  for (const Tensor& t : {lin.weight, lin.bias}) {
    const auto v = t.tolist();
    CHECK(*std::max_element(v.begin(), v.end()) <= bound);
    CHECK(*std::min_element(v.begin(), v.end()) >= -bound);
  }
  // U(-b, b) has std b / sqrt(3).
  REQUIRE(std_of(lin.weight) == Approx(bound / std::sqrt(3.0)).epsilon(0.02));
  REQUIRE_FALSE(nn::Linear(4, 3, false).bias.defined());
  REQUIRE(nn::Linear(4, 3, false).named_parameters().size() == 1);

  nn::Embedding emb(300, 200, &gen);
  REQUIRE(std_of(emb.weight) == Approx(1.0).epsilon(0.02));
  REQUIRE_THROWS_AS(nn::Linear(0, 3), ValueError);
}

TEST_CASE("GPT init follows nanoGPT and is deterministic from the seed", "[nn]") {
  auto gpt = std::make_shared<nn::GPT>(nn::GPTConfig{64, 32, 64, 2, 4, 0.0}, 3);
  const auto block = std::dynamic_pointer_cast<nn::Block>((*gpt->blocks)[1]);
  REQUIRE(std_of(gpt->wte->weight) == Approx(0.02).epsilon(0.05));
  REQUIRE(std_of(block->mlp->c_fc->weight) == Approx(0.02).epsilon(0.05));
  // Residual projections are scaled by 1/sqrt(2 layers).
  REQUIRE(std_of(block->mlp->c_proj->weight) == Approx(0.01).epsilon(0.05));
  REQUIRE(std_of(block->attn->c_proj->weight) == Approx(0.01).epsilon(0.05));
  for (double b : block->attn->c_attn->bias.tolist()) REQUIRE(b == 0.0);
  for (double w : gpt->ln_f->weight.tolist()) REQUIRE(w == 1.0);

  auto same = std::make_shared<nn::GPT>(nn::GPTConfig{64, 32, 64, 2, 4, 0.0}, 3);
  auto other = std::make_shared<nn::GPT>(nn::GPTConfig{64, 32, 64, 2, 4, 0.0}, 4);
  const auto a = gpt->parameters(), b = same->parameters(), c = other->parameters();
  for (size_t i = 0; i < a.size(); ++i) REQUIRE(a[i].tolist() == b[i].tolist());
  REQUIRE(a[0].tolist() != c[0].tolist());
}

TEST_CASE("make_model builds the configured model", "[nn]") {
  auto mlp = nn::make_model({{"type", "mlp"}, {"in", 784}, {"hidden", {1024, 1024}}, {"classes", 10}}, 1);
  REQUIRE(mlp->name() == "MLPClassifier");
  REQUIRE(mlp->num_parameters() == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10);

  auto gpt = nn::make_model({{"type", "gpt"}, {"vocab_size", 256}, {"context", 128}, {"width", 256},
                             {"layers", 4}, {"heads", 4}, {"dropout", 0.0}},
                            1);
  REQUIRE(gpt->name() == "GPT");
  const int64_t w = 256, per_block = 2 * 2 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w);
  REQUIRE(gpt->num_parameters() == 256 * w + 128 * w + 4 * per_block + 2 * w + w * 256);

  // Same seed, same weights.
  auto again = nn::make_model({{"type", "mlp"}, {"in", 6}, {"hidden", {5}}, {"classes", 3}, {"activation", "tanh"}}, 9);
  auto twin = nn::make_model({{"type", "mlp"}, {"in", 6}, {"hidden", {5}}, {"classes", 3}, {"activation", "tanh"}}, 9);
  REQUIRE(again->parameters()[0].tolist() == twin->parameters()[0].tolist());
  REQUIRE(std::dynamic_pointer_cast<nn::MLPClassifier>(again)->layers->operator[](1)->name() == "Tanh");
}

TEST_CASE("make_model rejects bad configs naming the key", "[nn]") {
  REQUIRE_THROWS_WITH(nn::make_model({{"type", "resnet"}}, 0),
                      Catch::Contains("\"resnet\"") && Catch::Contains("\"mlp\"") && Catch::Contains("\"gpt\""));
  REQUIRE_THROWS_AS(nn::make_model({{"in", 3}}, 0), ConfigError);
  REQUIRE_THROWS_WITH(nn::make_model({{"type", "mlp"}, {"in", 4}, {"hidden", {3}}, {"classes", 2}, {"hiden", 3}}, 0),
                      Catch::Contains("\"hiden\"") && Catch::Contains("activation"));
  REQUIRE_THROWS_WITH(nn::make_model({{"type", "mlp"}, {"in", 4}, {"hidden", {3}}}, 0), Catch::Contains("\"classes\""));
  REQUIRE_THROWS_WITH(nn::make_model({{"type", "mlp"}, {"in", 4}, {"hidden", {3, -1}}, {"classes", 2}}, 0),
                      Catch::Contains("hidden"));
  REQUIRE_THROWS_WITH(nn::make_model({{"type", "mlp"}, {"in", 4}, {"hidden", {3}}, {"classes", 2}, {"activation", "elu"}}, 0),
                      Catch::Contains("\"elu\"") && Catch::Contains("relu"));
  const json gpt = {{"type", "gpt"}, {"vocab_size", 16}, {"context", 8}, {"width", 12}, {"layers", 1}, {"heads", 5}};
  REQUIRE_THROWS_WITH(nn::make_model(gpt, 0), Catch::Contains("width") && Catch::Contains("heads"));
  json bad_width = gpt;
  bad_width["heads"] = 4;
  bad_width["width"] = "12";
  REQUIRE_THROWS_WITH(nn::make_model(bad_width, 0), Catch::Contains("\"width\""));
  json unknown = gpt;
  unknown["heads"] = 4;
  unknown["n_embd"] = 12;
  REQUIRE_THROWS_AS(nn::make_model(unknown, 0), ConfigError);
  REQUIRE_THROWS_WITH(nn::make_model(unknown, 0), Catch::Contains("\"n_embd\"") && Catch::Contains("vocab_size"));
}

// ------------------------------------------------------------------------------------------ checkpoints

TEST_CASE("load_state_dict names missing, unexpected and mismatched keys", "[nn]") {
  auto mlp = tiny_mlp(1);
  nn::StateDict sd = tiny_mlp(2)->state_dict();
  sd.erase("layers.2.bias");
  sd.emplace("layers.9.weight", zeros({2}));
  sd["layers.4.weight"] = zeros({5, 9});
  const auto before = mlp->parameters()[0].tolist();

  try {
    mlp->load_state_dict(sd);
    FAIL("load_state_dict accepted a mismatched state dict");
  } catch (const CheckpointError& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains("missing keys: \"layers.2.bias\""));
    CHECK_THAT(msg, Catch::Contains("unexpected keys: \"layers.9.weight\""));
    CHECK_THAT(msg, Catch::Contains("layers.4.weight (checkpoint [5, 9], model [5, 8])"));
  }
  // Nothing was copied by the failed load.
  REQUIRE(mlp->parameters()[0].tolist() == before);

  // Non-strict ignores missing and unexpected keys but not a shape mismatch.
  REQUIRE_THROWS_WITH(mlp->load_state_dict(sd, false),
                      Catch::Contains("layers.4.weight") && !Catch::Contains("layers.9.weight") &&
                          !Catch::Contains("layers.2.bias"));
  sd.erase("layers.4.weight");
  mlp->load_state_dict(sd, false);
  REQUIRE(mlp->parameters()[0].tolist() == sd.at("layers.0.weight").tolist());
  REQUIRE(mlp->parameters()[0].tolist() != before);
}

TEST_CASE("load_state_dict copies into the existing tensors converting dtype", "[nn]") {
  Toy toy;
  const Tensor weight_handle = toy.proj->weight;
  nn::StateDict sd;
  for (const auto& [name, t] : toy.state_dict()) sd[name] = t.clone();
  sd["proj.weight"] = from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3});  // float64
  sd["norm.num_batches_tracked"] = scalar_tensor(5, DType::Int64);
  toy.load_state_dict(sd);
  REQUIRE(weight_handle.is_same(toy.proj->weight));
  REQUIRE(toy.proj->weight.dtype() == DType::Float32);
  REQUIRE(toy.proj->weight.tolist() == std::vector<double>{1, 2, 3, 4, 5, 6});
  REQUIRE(toy.proj->weight.requires_grad());
  REQUIRE(toy.norm->num_batches_tracked.item() == 5);
  // Loading a model's own state dict (aliasing its storage) is harmless.
  toy.load_state_dict(toy.state_dict());
  REQUIRE(toy.proj->weight.tolist() == std::vector<double>{1, 2, 3, 4, 5, 6});
}

TEST_CASE("a state dict round trip into a fresh model gives identical outputs", "[nn]") {
  auto src = tiny_gpt(5), dst = tiny_gpt(6);
  const Tensor idx = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 10, 0, 7}, {2, 4});
  src->eval();
  dst->eval();
  REQUIRE(src->forward(idx).tolist() != dst->forward(idx).tolist());
  dst->load_state_dict(src->state_dict());
  REQUIRE(src->forward(idx).tolist() == dst->forward(idx).tolist());

  auto mlp_src = tiny_mlp(5), mlp_dst = tiny_mlp(6);
  const Tensor x = randn({3, 12});
  mlp_dst->load_state_dict(mlp_src->state_dict());
  REQUIRE(mlp_src->forward(x).tolist() == mlp_dst->forward(x).tolist());
}

// ------------------------------------------------------------------------------------------ modes

TEST_CASE("train and eval reach every descendant", "[nn]") {
  auto gpt = tiny_gpt(0, 0.5);
  REQUIRE(gpt->is_training());
  gpt->eval();
  for (const auto& [name, m] : gpt->named_modules()) CHECK_FALSE(m->is_training());
  gpt->train();
  for (const auto& [name, m] : gpt->named_modules()) CHECK(m->is_training());
  gpt->blocks->eval();
  REQUIRE(gpt->is_training());
  REQUIRE_FALSE((*gpt->blocks)[1]->child("mlp")->child("dropout")->is_training());
}

TEST_CASE("Dropout drops in training only, repeatably from its generator", "[nn]") {
  const Tensor x = ones({1000});
  auto drop = std::make_shared<nn::Dropout>(0.25, std::make_shared<Generator>(11));
  drop->eval();
  REQUIRE(drop->forward(x).is_same(x));  // identity, not even a copy
  drop->train();
  const auto y = drop->forward(x).tolist();
  int zeros_seen = 0;
  for (double v : y) {
    if (v == 0.0) ++zeros_seen;
    else REQUIRE(v == Approx(1.0 / 0.75));
  }
  REQUIRE(zeros_seen > 180);
  REQUIRE(zeros_seen < 320);
  auto twin = std::make_shared<nn::Dropout>(0.25, std::make_shared<Generator>(11));
  REQUIRE(twin->forward(x).tolist() == y);
  REQUIRE_THROWS_AS(nn::Dropout(1.5), ValueError);

  // A GPT with dropout is deterministic in eval and random in training.
  auto gpt = tiny_gpt(0, 0.3);
  const Tensor idx = from_vector(std::vector<int64_t>{1, 2, 3, 4}, {1, 4});
  const auto train_a = gpt->forward(idx).tolist(), train_b = gpt->forward(idx).tolist();
  REQUIRE(train_a != train_b);
  gpt->eval();
  auto no_dropout = tiny_gpt(0, 0.0);
  no_dropout->eval();
  REQUIRE(gpt->forward(idx).tolist() == no_dropout->forward(idx).tolist());
}

TEST_CASE("BatchNorm1d matches PyTorch in training and eval", "[nn]") {
  const json& c = fixtures().at("batchnorm");
  nn::BatchNorm1d bn(3);
  {
    NoGradGuard ng;
    bn.weight.copy_(tensor_from_json(c.at("weight")));
    bn.bias.copy_(tensor_from_json(c.at("bias")));
  }
  const Tensor y1 = bn.forward(tensor_from_json(c.at("x1")));
  CHECK(allclose(y1, tensor_from_json(c.at("train_out1")), 1e-5, 1e-6));
  const Tensor y2 = bn.forward(tensor_from_json(c.at("x2")));
  CHECK(allclose(y2, tensor_from_json(c.at("train_out2")), 1e-5, 1e-6));
  CHECK(allclose(bn.running_mean, tensor_from_json(c.at("running_mean")), 1e-5, 1e-6));
  CHECK(allclose(bn.running_var, tensor_from_json(c.at("running_var")), 1e-5, 1e-6));
  REQUIRE(bn.num_batches_tracked.item() == 2);
  bn.eval();
  const Tensor y3 = bn.forward(tensor_from_json(c.at("x3")));
  CHECK(allclose(y3, tensor_from_json(c.at("eval_out")), 1e-5, 1e-6));
  REQUIRE(bn.num_batches_tracked.item() == 2);  // eval does not count batches
  REQUIRE_THROWS_WITH(bn.forward(zeros({2, 4})), Catch::Contains("BatchNorm1d") && Catch::Contains("3 channels"));

  // Without running statistics: no buffers, and batch statistics even in eval.
  nn::BatchNorm1d stateless(3, 1e-5, 0.1, false, false);
  REQUIRE(stateless.state_dict().empty());
  stateless.eval();
  const Tensor y = stateless.forward(tensor_from_json(c.at("x1")));
  for (double m : mean(y, {0}).tolist()) REQUIRE(m == Approx(0.0).margin(1e-5));
}

// ------------------------------------------------------------------------------------------ conversion

TEST_CASE("to(dtype) converts floating tensors in place of the same handles", "[nn]") {
  Toy toy;
  const Tensor held = toy.proj->weight;  // e.g. an optimizer's handle, taken before the conversion
  const auto values = held.tolist();
  toy.proj->weight.set_grad(full({2, 3}, 0.5));
  toy.to(DType::Float16);
  REQUIRE(held.dtype() == DType::Float16);
  REQUIRE(held.is_same(toy.named_parameters()[3].second));
  REQUIRE(held.requires_grad());
  REQUIRE(held.is_leaf());
  REQUIRE(held.grad().dtype() == DType::Float16);
  REQUIRE(held.grad().tolist()[0] == 0.5);
  const auto half_values = held.tolist();
  for (size_t i = 0; i < values.size(); ++i) REQUIRE(half_values[i] == Approx(values[i]).epsilon(1e-3));
  REQUIRE(toy.norm->running_var.dtype() == DType::Float16);
  REQUIRE(toy.stat.dtype() == DType::Float16);
  // Integer buffers keep their dtype.
  REQUIRE(toy.count.dtype() == DType::Int64);
  REQUIRE(toy.norm->num_batches_tracked.dtype() == DType::Int64);
  toy.to(DType::Float32);
  REQUIRE(held.dtype() == DType::Float32);
  REQUIRE_THROWS_AS(toy.to(DType::Int32), DTypeError);
}

TEST_CASE("to(dtype, filter) keeps batch norm in float32 for mixed precision O2", "[nn]") {
  Toy toy;
  toy.to(DType::Float16, [](const nn::Module& m) { return !nn::is_batch_norm(m); });
  REQUIRE(toy.scale.dtype() == DType::Float16);
  REQUIRE(toy.proj->weight.dtype() == DType::Float16);
  REQUIRE(toy.proj->bias.dtype() == DType::Float16);
  REQUIRE(toy.norm->weight.dtype() == DType::Float32);
  REQUIRE(toy.norm->running_mean.dtype() == DType::Float32);
  REQUIRE(toy.norm->running_var.dtype() == DType::Float32);
  for (const auto& [name, t] : toy.state_dict())
    CHECK(t.dtype() == (name.rfind("norm.", 0) == 0 ? (name == "norm.num_batches_tracked" ? DType::Int64 : DType::Float32)
                                                    : name == "count" ? DType::Int64 : DType::Float16));
  // Moving to the device the tensors are on keeps them.
  const void* before = toy.scale.data_ptr();
  toy.to(Device::cpu());
  REQUIRE(toy.scale.data_ptr() == before);
}

TEST_CASE("zero_grad clears or zeroes every gradient", "[nn]") {
  auto mlp = tiny_mlp();
  for (const auto& p : mlp->parameters()) p.set_grad(ones_like(p));
  mlp->zero_grad(false);
  for (const auto& p : mlp->parameters()) {
    REQUIRE(p.grad().defined());
    for (double g : p.grad().tolist()) REQUIRE(g == 0.0);
  }
  mlp->zero_grad();
  for (const auto& p : mlp->parameters()) REQUIRE_FALSE(p.grad().defined());
}

// ------------------------------------------------------------------------------------------ layers and models

TEST_CASE("Sequential chains its modules in order", "[nn]") {
  nn::Sequential seq;
  seq.push_back(std::make_shared<nn::ReLU>()).push_back("squash", std::make_shared<nn::Tanh>());
  REQUIRE(seq.size() == 2);
  REQUIRE(seq.named_children()[1].first == "squash");
  const Tensor x = from_vector(std::vector<float>{-2, -0.5, 0.5, 2}, {4});
  const auto y = seq.forward(x).tolist();
  REQUIRE(y[0] == 0.0);
  REQUIRE(y[1] == 0.0);
  REQUIRE(y[2] == Approx(std::tanh(0.5)));
  REQUIRE(y[3] == Approx(std::tanh(2.0)));
  nn::GELU tanh_gelu("tanh");
  REQUIRE(tanh_gelu.forward(x).tolist() == gelu(x, "tanh").tolist());
  REQUIRE_THROWS_AS(nn::GELU("fast"), ValueError);
}

TEST_CASE("GPT rejects sequences longer than its context, naming both", "[nn]") {
  auto gpt = tiny_gpt();
  REQUIRE_THROWS_AS(gpt->forward(zeros({1, 9}, DType::Int64)), ShapeError);
  REQUIRE_THROWS_WITH(gpt->forward(zeros({1, 9}, DType::Int64)), Catch::Contains("9") && Catch::Contains("8"));
  REQUIRE_THROWS_AS(gpt->forward(zeros({9}, DType::Int64)), ShapeError);
  REQUIRE_THROWS_AS(tiny_mlp()->forward(zeros({2, 11})), ShapeError);
  REQUIRE_THROWS_AS(nn::Linear(4, 2).forward(zeros({3, 5})), ShapeError);
}

namespace {

// Loads a fixture case into `model`, runs forward and cross entropy and backward, and compares the
// logits, the loss and every parameter's gradient with PyTorch's.
void check_against_pytorch(nn::Module& model, const json& c, bool flatten_tokens) {
  model.load_state_dict(fixture_state_dict(c));
  model.eval();
  const Tensor input = tensor_from_json(c.at("input"));
  const Tensor target = tensor_from_json(c.at("target"));
  const Tensor logits = model.forward(input);
  const Tensor expected_logits = tensor_from_json(c.at("logits"));
  INFO("logits max abs diff " << max_abs_diff(logits, expected_logits));
  REQUIRE(allclose(logits, expected_logits, 1e-5, 1e-5));

  const Tensor flat = flatten_tokens ? logits.reshape({-1, logits.size(-1)}) : logits;
  const Tensor loss = cross_entropy(flat, target.reshape({-1}));
  REQUIRE(loss.item() == Approx(tensor_from_json(c.at("loss")).item()).epsilon(1e-5));
  loss.backward();
  for (const auto& [name, p] : model.named_parameters()) {
    const Tensor expected = tensor_from_json(c.at("grad:" + name));
    INFO(name << " grad max abs diff " << max_abs_diff(p.grad(), expected));
    REQUIRE(p.grad().defined());
    CHECK(allclose(p.grad(), expected, 1e-4, 1e-6));
  }
}

}  // namespace

TEST_CASE("GPT forward, loss and gradients match PyTorch", "[nn]") {
  auto gpt = tiny_gpt();
  check_against_pytorch(*gpt, fixtures().at("gpt"), true);
}

TEST_CASE("MLP forward, loss and gradients match PyTorch", "[nn]") {
  auto mlp = tiny_mlp();
  check_against_pytorch(*mlp, fixtures().at("mlp"), false);
}

TEST_CASE("gradients reach every GPT parameter", "[nn]") {
  auto gpt = nn::make_model({{"type", "gpt"}, {"vocab_size", 13}, {"context", 6}, {"width", 8}, {"layers", 2},
                             {"heads", 2}, {"dropout", 0.1}},
                            21);
  Generator gen(3);
  const Tensor idx = randint(0, 13, {3, 6}, &gen), target = randint(0, 13, {3, 6}, &gen);
  const Tensor logits = gpt->forward(idx);
  REQUIRE(logits.shape() == Shape{3, 6, 13});
  cross_entropy(logits.reshape({-1, 13}), target.reshape({-1})).backward();
  for (const auto& [name, p] : gpt->named_parameters()) {
    INFO(name);
    REQUIRE(p.grad().defined());
    REQUIRE(p.grad().shape() == p.shape());
    double norm = 0;
    for (double g : p.grad().tolist()) norm += g * g;
    CHECK(norm > 0.0);
  }
}

// Note [16-bit GPT tolerance]
// The reference is the float32 model holding the 16-bit model's own (rounded) weights, so the only
// difference left is the rounding of activations and gradients to the 16-bit dtype, each within the
// unit roundoff u (2^-11 float16, 2^-8 bfloat16) of the rounded tensor. Forward, the longest path
// rounds K = 27 times: the embedding sum, per block 12 (ln_1, c_attn, scores, softmax, att @ v,
// c_proj, residual, ln_2, c_fc, gelu, mlp c_proj, residual), ln_f and lm_head. Backward adds each op's
// input gradient and the weight gradient along the same path: 2 * 27 more, K = 81 for a gradient.
// Round to nearest even is unbiased and the ops' errors are independent, so they add in quadrature:
// sqrt(K) u, times a conditioning factor of 2 (LayerNorm re-normalizes; the softmax's relative condition
// number is at most its inputs' spread, < 2 at this init). So |logits - ref| <= 2 sqrt(27) u max|ref|
// (10.4 u) and |grad - ref| <= 2 sqrt(81) u max|ref grad| (18 u) per parameter; float16 also flushes
// below its smallest subnormal (2^-24), added as an absolute floor per rounding. Measured: at most
// 1.4 u forward and 6 u backward.
TEST_CASE("a GPT converted to float16 or bfloat16 runs forward and backward within its roundoff of float32",
          "[nn]") {
  const Tensor idx = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2, 3, 4, 5}, {2, 8});
  const Tensor target = from_vector(std::vector<int64_t>{2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2, 3, 4, 5, 6}, {16});
  const double forward_bound = 2 * std::sqrt(27.0), backward_bound = 2 * std::sqrt(81.0);
  for (auto [dt, u] : {std::pair{DType::Float16, 0x1p-11}, std::pair{DType::BFloat16, 0x1p-8}}) {
    INFO(dtype_name(dt));
    const double floor = dt == DType::Float16 ? 0x1p-24 : 0.0;
    auto gpt = tiny_gpt(8), reference = tiny_gpt(8);
    gpt->to(dt);
    reference->to(dt);
    reference->to(DType::Float32);  // the same rounded weights, in float32
    const Tensor logits = gpt->forward(idx), expected = reference->forward(idx);
    REQUIRE(logits.dtype() == dt);
    const double logit_scale = max_abs_diff(expected, zeros_like(expected));
    const double logit_err = max_abs_diff(logits.to(DType::Float32), expected);
    INFO("logits: max error " << logit_err << " of max " << logit_scale);
    CHECK(logit_err <= forward_bound * u * logit_scale + 27 * floor);
    // Round to nearest even is unbiased: the signed error towards zero, summed over the logits, is
    // noise around 0 (measured under 0.1 u of their total magnitude), while rounding that truncates
    // loses between u/2 and u of every value it rounds, the last rounding alone giving -0.5 u or less.
    {
      const auto got_v = logits.to(DType::Float64).tolist(), want_v = expected.to(DType::Float64).tolist();
      double signed_err = 0, magnitude = 0;
      for (size_t i = 0; i < got_v.size(); ++i) {
        signed_err += (got_v[i] - want_v[i]) * (want_v[i] < 0 ? -1.0 : 1.0);
        magnitude += std::abs(want_v[i]);
      }
      INFO("bias " << signed_err / (u * magnitude) << " u");
      CHECK(std::abs(signed_err) <= 0.25 * u * magnitude);
    }
    cross_entropy(logits.reshape({-1, 11}), target).backward();
    cross_entropy(expected.reshape({-1, 11}), target).backward();
    const auto got = gpt->named_parameters(), want = reference->named_parameters();
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(got[i].first);
      REQUIRE(got[i].second.grad().defined());
      REQUIRE(got[i].second.grad().dtype() == dt);
      const Tensor& g = want[i].second.grad();
      const double scale = max_abs_diff(g, zeros_like(g));
      const double err = max_abs_diff(got[i].second.grad().to(DType::Float32), g);
      INFO("gradient: max error " << err << " of max " << scale << " (" << err / (u * scale) << " u)");
      CHECK(scale > 0);
      CHECK(err <= backward_bound * u * scale + 81 * floor);
    }
  }
}

TEST_CASE("a float32 GPT under autocast gives float32 gradients close to float32 training", "[nn]") {
  const Tensor idx = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}, {1, 8});
  const Tensor target = from_vector(std::vector<int64_t>{2, 3, 4, 5, 6, 7, 8, 9}, {8});
  auto reference = tiny_gpt(4), gpt = tiny_gpt(4);
  cross_entropy(reference->forward(idx).reshape({-1, 11}), target).backward();
  {
    autocast::AutocastGuard autocast(true, DType::BFloat16);
    const Tensor logits = gpt->forward(idx);
    REQUIRE(logits.dtype() == DType::BFloat16);  // lm_head is a linear: lowered
    cross_entropy(logits.reshape({-1, 11}), target).backward();
  }
  const auto expected = reference->named_parameters();
  const auto got = gpt->named_parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(got[i].first << " max abs diff " << max_abs_diff(got[i].second.grad(), expected[i].second.grad()));
    REQUIRE(got[i].second.dtype() == DType::Float32);
    REQUIRE(got[i].second.grad().dtype() == DType::Float32);
    // bfloat16 keeps 8 bits: each gradient within a few percent of its largest element.
    const Tensor& want = expected[i].second.grad();
    CHECK(max_abs_diff(got[i].second.grad(), want) <= 0.03 * max_abs_diff(want, zeros_like(want)) + 1e-6);
  }
}

TEST_CASE("loss modules compute torch's losses and convert to a Criterion", "[nn]") {
  Tensor logits = from_vector(std::vector<float>{2.0f, 0.5f, -1.0f, 0.1f, 0.2f, 3.0f}, {2, 3});
  Tensor target = from_vector(std::vector<int64_t>{0, 2}, {2});
  // Reference by hand: mean over rows of logsumexp(row) - row[target].
  auto row_loss = [](double a, double b, double c, double t) {
    return std::log(std::exp(a) + std::exp(b) + std::exp(c)) - t;
  };
  const double expected = 0.5 * (row_loss(2.0, 0.5, -1.0, 2.0) + row_loss(0.1, 0.2, 3.0, 3.0));
  nn::CrossEntropyLoss ce;
  REQUIRE(ce(logits, target).item() == Approx(expected).epsilon(1e-6));
  nn::Criterion crit = std::ref(ce);
  REQUIRE(crit(logits, target).item() == Approx(expected).epsilon(1e-6));
  nn::CrossEntropyLoss summed({.reduction = Reduction::Sum});
  REQUIRE(summed(logits, target).item() == Approx(2 * expected).epsilon(1e-6));
  nn::CrossEntropyLoss ignoring({.ignore_index = 2});
  REQUIRE(ignoring(logits, target).item() == Approx(row_loss(2.0, 0.5, -1.0, 2.0)).epsilon(1e-6));
  REQUIRE_THROWS_AS(nn::CrossEntropyLoss({.label_smoothing = 1.5}), ValueError);

  Tensor a = from_vector(std::vector<float>{1, 2, 3, 4}, {4});
  Tensor b = from_vector(std::vector<float>{1, 0, 3, 1}, {4});
  REQUIRE(nn::MSELoss()(a, b).item() == Approx((0 + 4 + 0 + 9) / 4.0));
  REQUIRE(nn::MSELoss(Reduction::Sum)(a, b).item() == Approx(13.0));
}

// ------------------------------------------------------------------------------------------ errors

// Note [Error context]: an allocation that fails says which op, in which module of which model, for
// which shape and dtype, and what to shrink. The input is an expanded view (no memory behind its 2^40
// rows), so the first real allocation is the output of layers.0's linear: 2^40 x 16 float32 = 64 TiB.
TEST_CASE("out of memory names the op, the shape and dtype, the module and what to shrink", "[nn][errors]") {
  using Catch::Matchers::Contains;
  auto mlp = std::make_shared<nn::MLPClassifier>(8, std::vector<int64_t>{16}, 3, "relu", 0);
  const int64_t rows = int64_t(1) << 40;
  const Tensor x = ones({1, 8}).expand({rows, 8});
  REQUIRE_THROWS_AS((*mlp)(x), OutOfMemoryError);
  REQUIRE_THROWS_AS((*mlp)(x), Error);  // one of the library's typed errors
  CHECK_THROWS_WITH((*mlp)(x), Contains("out of host memory") && Contains("64.0 TiB") &&
                                   Contains("float32 tensor of shape [1099511627776, 16]") &&
                                   Contains("in op 'linear'") &&
                                   Contains("in module 'layers.0' (Linear) of MLPClassifier") &&
                                   Contains("data.batch_size"));
  // The stack unwound: a later failure outside any module names no module.
  CHECK(describe_error_context().empty());
  CHECK_THROWS_WITH(zeros({rows, rows}), Contains("in op 'full'") && !Contains("module") &&
                                             Contains("shape [1099511627776, 1099511627776]"));
  // While a model is built: its parameters do not fit.
  CHECK_THROWS_WITH(nn::make_model({{"type", "linear"}, {"in", int64_t(1) << 22}, {"classes", int64_t(1) << 22}}, 0),
                    Contains("while building model 'linear'") && Contains("shape [4194304, 4194304]") &&
                        Contains("shrink the model"));
}

// Note [Errors name the module] (booster/nn/module.cpp): an error thrown inside a module's forward gets
// the module's path below the model and its class in front, once, keeping its type; the path is built
// only when something throws.
TEST_CASE("an error inside a module's forward names the module's path, once, and keeps its type", "[nn][errors]") {
  using Catch::Matchers::Contains;
  using Catch::Matchers::StartsWith;
  auto mlp = std::make_shared<nn::MLPClassifier>(4, std::vector<int64_t>{8, 8}, 3, "relu", 0);
  // An op's error in a child: the child's path and class, then the op's own words.
  CHECK_THROWS_AS((*mlp)(randn({2, 4}).to(DType::BFloat16)), DTypeError);
  CHECK_THROWS_WITH((*mlp)(randn({2, 4}).to(DType::BFloat16)),
                    StartsWith("layers.0 (Linear): linear: ") && Contains("bfloat16") && Contains("float32"));
  // Deeper: a Sequential inside a Sequential, "1.0 (Linear)"; the layer's own "Linear: " is not repeated.
  auto inner = std::make_shared<nn::Sequential>();
  inner->push_back(std::make_shared<nn::Linear>(8, 5));
  auto outer = std::make_shared<nn::Sequential>();
  outer->push_back(std::make_shared<nn::Linear>(4, 6));
  outer->push_back(inner);
  CHECK_THROWS_AS((*outer)(randn({2, 4})), ShapeError);
  CHECK_THROWS_WITH((*outer)(randn({2, 4})), StartsWith("1.0 (Linear): expected input [..., 8], got shape [2, 6]"));
  // The model's own check, thrown by the outermost module: its class once.
  CHECK_THROWS_WITH((*mlp)(randn({2, 5})), StartsWith("MLPClassifier: expected input") &&
                                               !Contains("MLPClassifier: MLPClassifier"));
  // A module called on its own is the outermost: named by its class.
  nn::Linear lone(3, 2);
  CHECK_THROWS_WITH(lone(randn({2, 4})), StartsWith("Linear: expected input [..., 3]"));
  // Out of memory names the module itself (Note [Error context]); it is not prefixed.
  const Tensor huge = ones({1, 4}).expand({int64_t(1) << 40, 4});
  CHECK_THROWS_WITH((*mlp)(huge), StartsWith("out of host memory"));
}
