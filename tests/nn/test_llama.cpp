// The Llama family (booster/nn/llama.h): logits, loss and gradients of tiny Llamas (grouped- and
// multi-query, tied and untied, two rope_theta values) against a PyTorch implementation of Hugging
// Face's formulas (tests/fixtures/make_llama_fixtures.py), gradients against central finite
// differences in float64, the pieces against their definitions, the config's checks, deferred init,
// activation checkpointing, autocast, and the shard policy's cut and split on one process.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "fixture.h"
#include "gradcheck.h"
#include "llama_fixture.h"

#include "booster/autocast/autocast.h"
#include "booster/distributed/local_process_group.h"
#include "booster/nn/llama.h"
#include "booster/nn/models.h"
#include "booster/nn/shard_policy.h"
#include "booster/nn/tensor_parallel.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"

using namespace booster;
using Catch::Contains;
using json = nlohmann::json;

namespace {

const json& fixtures() {
  static const json j = testing::load_fixture_json("llama.json");
  return j;
}

using testing::llama_config_from;
using testing::set_llama_fixture_weights;

Tensor ids_of(const json& list, const json& batch) {
  return from_vector(list.get<std::vector<int64_t>>(), batch.get<Shape>());
}

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (double v : t.tolist()) m = std::max(m, std::abs(v));
  return m;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

nn::LlamaConfig tiny_config(bool tied, int64_t kv_heads = 1) {
  nn::LlamaConfig c;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = kv_heads;
  c.max_position_embeddings = 16;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 100.0;  // turns fast enough that 5 positions see large angles
  c.tie_word_embeddings = tied;
  return c;
}

// A process group of `size` ranks of which this is `rank`, for building a rank's part of a split model
// on one process: the shard policies slice without communicating. Any collective fails.
// A Llama of 4 query heads over 2 key/value heads, wide enough for tp 2 to split every weight.
nn::LlamaConfig shard_config(int64_t layers) {
  nn::LlamaConfig cfg = tiny_config(false, 2);
  cfg.hidden_size = 32;
  cfg.num_attention_heads = 4;
  cfg.intermediate_size = 48;
  cfg.vocab_size = 64;
  cfg.num_hidden_layers = layers;
  return cfg;
}

class FakeGroup final : public distributed::ProcessGroup {
 public:
  FakeGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "fake"; }
  Device device() const override { return Device::cpu(); }
  void barrier() override { fail(); }
  [[noreturn]] void abort(int, const std::string& why) override { throw std::runtime_error(why); }

 protected:
  distributed::WorkPtr all_reduce_impl(const distributed::BufferSpan&, distributed::ReduceOp, bool) override { fail(); }
  distributed::WorkPtr broadcast_impl(const distributed::BufferSpan&, int, bool) override { fail(); }
  distributed::WorkPtr all_gather_impl(const distributed::BufferSpan&, const distributed::BufferSpan&, bool) override {
    fail();
  }
  distributed::WorkPtr reduce_scatter_impl(const distributed::BufferSpan&, const distributed::BufferSpan&,
                                           distributed::ReduceOp, bool) override {
    fail();
  }

 private:
  [[noreturn]] static void fail() { throw std::runtime_error("FakeGroup: no collectives here"); }
  int rank_, size_;
};

}  // namespace

// Note [Llama fixture tolerance]
// Both sides compute in float32, with the sums in other orders (OpenBLAS against PyTorch's GEMMs, a
// fused attention kernel against matmul + softmax), and the fixture's values are rounded to 9 digits,
// which float32 survives exactly. Two orders of one sum of K terms differ by about sqrt(K) u times the
// sum of the terms' magnitudes (u = 2^-24; K u at worst). A logit goes through 2 L + 1 = 5 such
// reductions in series (each layer's attention and MLP, then lm_head), with RMSNorm bringing the
// activations back to magnitudes of about 1 before each, so the relative errors add: with K = 48 (the
// longest reduction, the MLP's) that is 5 sqrt(48) u = 2.1e-6 of the largest logit. The bound allows 4
// ulps per stage instead of one: 8.3e-6 relative to the largest value. Gradients take the reductions of
// the forward and as many again backward, plus the sums over the B T = 16 rows for a weight: twice the
// stages and sqrt(16) more, 4 x 2 = 8 times the forward's bound, relative to the largest gradient.
// (Measured: 3.6e-7 and 3.9e-7 of the largest logit; gradients 1e-8 to 1.3e-7, 20 to 100 times
// under their bounds.)
TEST_CASE("llama: logits, loss and gradients equal a PyTorch implementation of Hugging Face's formulas",
          "[llama][nn]") {
  const double u = std::ldexp(1.0, -24);
  const double forward_bound = 4.0 * 5.0 * std::sqrt(48.0) * u;
  for (const char* name : {"untied_gqa", "tied_mqa"}) {
    INFO(name);
    const json& f = fixtures().at(name);
    const nn::LlamaConfig cfg = llama_config_from(f.at("config"));
    nn::Llama model(cfg, 0);
    // Hugging Face's names, shapes and state-dict order, exactly (the tied table listed once).
    const auto params = model.named_parameters();
    REQUIRE(params.size() == f.at("params").size());
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(params[i].first == f.at("params")[i][0].get<std::string>());
      CHECK(params[i].second.shape() == f.at("params")[i][1].get<Shape>());
    }
    CHECK(model.state_dict().count("lm_head.weight") == (cfg.tie_word_embeddings ? 0u : 1u));
    set_llama_fixture_weights(model, f.at("params"));

    const Tensor idx = ids_of(f.at("input"), f.at("batch"));
    const Tensor target = ids_of(f.at("target"), f.at("batch"));
    const Tensor logits = model(idx);
    const Tensor want = testing::tensor_from_json(f.at("logits"));
    REQUIRE(logits.shape() == want.shape());
    const double scale = max_abs(want);
    INFO("logits: max difference " << testing::max_abs_diff(logits, want) << ", bound " << forward_bound * scale);
    CHECK(testing::max_abs_diff(logits, want) <= forward_bound * scale);

    const Tensor loss = cross_entropy(logits.reshape({-1, cfg.vocab_size}), target.reshape({-1}));
    const double want_loss = f.at("loss");
    CHECK(std::abs(loss.item() - want_loss) <= forward_bound * std::abs(want_loss));

    loss.backward();
    std::map<std::string, Tensor> by_name;
    for (const auto& [n, t] : model.named_parameters()) by_name[n] = t;
    int checked = 0;
    for (const auto& [key, value] : f.items()) {
      if (key.rfind("grad:", 0) != 0) continue;
      const std::string param = key.substr(5);
      INFO(param);
      REQUIRE(by_name.count(param));
      const Tensor g = by_name.at(param).grad();
      REQUIRE(g.defined());
      const Tensor want_g = testing::tensor_from_json(value);
      const double bound = 8.0 * forward_bound * max_abs(want_g);
      INFO("max difference " << testing::max_abs_diff(g, want_g) << ", bound " << bound);
      CHECK(testing::max_abs_diff(g, want_g) <= bound);
      ++checked;
    }
    CHECK(checked == 5);
  }
}

TEST_CASE("llama: the pieces against their definitions, and silu's gradient", "[llama][ops]") {
  SECTION("silu is x sigmoid(x), in every float dtype, with the right gradient") {
    const Tensor x = from_vector(std::vector<double>{-30.0, -2.5, -1.0, -1e-3, 0.0, 0.5, 3.0, 40.0}, {8});
    const std::vector<double> got = silu(x).tolist();
    const std::vector<double> xs = x.tolist();
    for (size_t i = 0; i < xs.size(); ++i) CHECK(got[i] == Approx(xs[i] / (1.0 + std::exp(-xs[i]))).epsilon(1e-15));
    for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
      const std::vector<double> low = silu(x.to(dt)).tolist();
      const double tol = dt == DType::Float32 ? 1e-6 : dt == DType::BFloat16 ? 1e-2 : 2e-3;
      for (size_t i = 0; i < xs.size(); ++i) CHECK(low[i] == Approx(got[i]).epsilon(tol).margin(1e-6));
    }
    Generator gen(1);
    CHECK(testing::gradcheck([](const std::vector<Tensor>& in) { return silu(in[0]); }, {randn({3, 7}, &gen)}));
  }
  SECTION("RMSNorm: x / sqrt(mean(x^2) + eps) * weight; its input gradient") {
    Generator gen(2);
    nn::RMSNorm norm(6, 1e-5);
    {
      NoGradGuard no_grad;
      norm.weight.copy_(randn({6}, &gen));
    }
    const Tensor x = randn({2, 3, 6}, &gen, DType::Float64);
    norm.to(DType::Float64);
    const std::vector<double> y = norm(x).tolist(), xs = x.tolist(), w = norm.weight.tolist();
    for (int64_t r = 0; r < 6; ++r) {
      double ms = 0.0;
      for (int64_t i = 0; i < 6; ++i) ms += xs[size_t(r * 6 + i)] * xs[size_t(r * 6 + i)] / 6.0;
      for (int64_t i = 0; i < 6; ++i)
        CHECK(y[size_t(r * 6 + i)] == Approx(xs[size_t(r * 6 + i)] / std::sqrt(ms + 1e-5) * w[size_t(i)]).epsilon(1e-13));
    }
    CHECK(testing::gradcheck([&](const std::vector<Tensor>& in) { return norm(in[0]); }, {x}));
    // A 16-bit input is normalized in float32 and comes back in its own dtype (then the weight's).
    norm.to(DType::Float32);
    CHECK(norm(x.to(DType::BFloat16)).dtype() == DType::Float32);
    norm.to(DType::BFloat16);
    CHECK(norm(x.to(DType::BFloat16)).dtype() == DType::BFloat16);
  }
  SECTION("rotary embedding: Hugging Face's rotate_half pairs (i, i + d/2), angle t / theta^(2i/d)") {
    const int64_t d = 8, T = 5, H = 3;
    for (double theta : {10000.0, 500000.0, 10.0}) {
      nn::RotaryEmbedding rope(d, theta);
      Generator gen(3);
      const Tensor x = randn({2, T, H, d}, &gen, DType::Float64);
      const std::vector<double> y = rope.apply(x).tolist(), xs = x.tolist();
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < d / 2; ++i) {
              const double angle = double(t) / std::pow(theta, double(2 * i) / double(d));
              const size_t base = size_t(((b * T + t) * H + h) * d);
              const double x1 = xs[base + size_t(i)], x2 = xs[base + size_t(i + d / 2)];
              // The table is made in float32, as Hugging Face makes it: angles good to a few 1e-7.
              CHECK(y[base + size_t(i)] == Approx(x1 * std::cos(angle) - x2 * std::sin(angle)).margin(2e-6));
              CHECK(y[base + size_t(i + d / 2)] == Approx(x2 * std::cos(angle) + x1 * std::sin(angle)).margin(2e-6));
            }
      CHECK(testing::gradcheck([&](const std::vector<Tensor>& in) { return rope.apply(in[0]); }, {x}));
    }
    // Cached per device and dtype, grown to the longest sequence asked for, and sliced for shorter ones.
    nn::RotaryEmbedding rope(4, 10000.0);
    const auto [c8, s8] = rope.cos_sin(8, Device::cpu(), DType::Float32);
    const auto [c3, s3] = rope.cos_sin(3, Device::cpu(), DType::Float32);
    CHECK(c3.data_ptr() == c8.data_ptr());
    CHECK(c3.tolist() == c8.narrow(0, 0, 3).tolist());
    CHECK(rope.cos_sin(3, Device::cpu(), DType::BFloat16).first.dtype() == DType::BFloat16);
  }
}

// Central differences of L = sum(w * logits), w a fixed random projection (gradcheck.h's), in float64
// for every element of every parameter of a tiny Llama, against backward.
TEST_CASE("llama: gradients of every parameter equal central finite differences in float64", "[llama][nn]") {
  for (bool tied : {false, true}) {
    for (bool checkpointing : {false, true}) {
      INFO((tied ? "tied, " : "untied, ") << (checkpointing ? "activation checkpointing" : "plain"));
      nn::LlamaConfig cfg = tiny_config(tied, tied ? 1 : 2);
      cfg.activation_checkpointing = checkpointing;
      nn::Llama model(cfg, 21);
      model.to(DType::Float64);
      Generator gen(4);
      const Tensor ids = randint(0, cfg.vocab_size, {2, 5}, &gen);
      const Tensor w = randn({2, 5, cfg.vocab_size}, &gen, DType::Float64);
      auto loss_of = [&] { return sum(mul(model(ids), w)); };
      model.zero_grad();
      loss_of().backward();
      const double eps = 1e-6;
      int64_t elements = 0, bad = 0;
      for (const auto& [name, p] : model.named_parameters()) {
        REQUIRE(p.grad().defined());
        const std::vector<double> analytic = p.grad().tolist();
        double* data = p.data<double>();
        for (int64_t i = 0; i < p.numel(); ++i) {
          NoGradGuard no_grad;
          const double orig = data[i];
          data[i] = orig + eps;
          const double plus = loss_of().item();
          data[i] = orig - eps;
          const double minus = loss_of().item();
          data[i] = orig;
          const double numeric = (plus - minus) / (2 * eps);
          if (std::abs(numeric - analytic[size_t(i)]) > 1e-6 + 1e-5 * std::abs(numeric)) {
            if (bad++ < 10)
              UNSCOPED_INFO(name << "[" << i << "]: analytic " << analytic[size_t(i)] << ", numeric " << numeric);
          }
          ++elements;
        }
      }
      CHECK(elements == model.num_parameters());
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("llama: make_model validates the config and names the key", "[llama][models]") {
  const json ok = {{"type", "llama"},         {"vocab_size", 32},         {"hidden_size", 16},
                   {"intermediate_size", 24}, {"num_hidden_layers", 2},    {"num_attention_heads", 4},
                   {"num_key_value_heads", 2}, {"rms_norm_eps", 1e-5},     {"rope_theta", 500000.0},
                   {"tie_word_embeddings", true}, {"max_position_embeddings", 64}};
  const nn::ModulePtr m = nn::make_model(ok, 3);
  const auto* llama = dynamic_cast<const nn::Llama*>(m.get());
  REQUIRE(llama != nullptr);
  CHECK(llama->name() == "Llama");
  CHECK(llama->config.num_key_value_heads == 2);
  CHECK(llama->config.rms_norm_eps == 1e-5);
  CHECK(llama->config.rope_theta == 500000.0);
  CHECK(llama->config.max_position_embeddings == 64);
  CHECK(llama->lm_head->weight.impl() == llama->model->embed_tokens->weight.impl());  // tied: one tensor
  // Defaults: key/value heads = heads (plain multi-head), eps 1e-6, theta 10000, untied.
  json plain = ok;
  for (const char* k : {"num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                        "max_position_embeddings"})
    plain.erase(k);
  const nn::ModulePtr d = nn::make_model(plain, 3);
  const auto& dc = dynamic_cast<const nn::Llama&>(*d).config;
  CHECK(dc.num_key_value_heads == 4);
  CHECK(dc.rms_norm_eps == 1e-6);
  CHECK(dc.rope_theta == 10000.0);
  CHECK_FALSE(dc.tie_word_embeddings);
  CHECK(dc.max_position_embeddings == 2048);
  CHECK(d->state_dict().count("lm_head.weight") == 1);

  auto with = [&](const char* key, json value) {
    json c = ok;
    c[key] = std::move(value);
    return c;
  };
  auto without = [&](const char* key) {
    json c = ok;
    c.erase(key);
    return c;
  };
  CHECK_THROWS_AS(nn::make_model(with("num_layers", 2), 0), ConfigError);
  CHECK_THROWS_WITH(nn::make_model(with("num_layers", 2), 0), Contains("\"num_layers\"") && Contains("\"llama\""));
  CHECK_THROWS_WITH(nn::make_model(without("intermediate_size"), 0),
                    Contains("missing key \"intermediate_size\""));
  CHECK_THROWS_AS(nn::make_model(with("hidden_size", 18), 0), ConfigError);
  CHECK_THROWS_WITH(nn::make_model(with("hidden_size", 18), 0),
                    Contains("\"hidden_size\" 18") && Contains("\"num_attention_heads\" 4"));
  CHECK_THROWS_AS(nn::make_model(with("num_key_value_heads", 3), 0), ConfigError);
  CHECK_THROWS_WITH(nn::make_model(with("num_key_value_heads", 3), 0),
                    Contains("\"num_attention_heads\" 4") && Contains("\"num_key_value_heads\" 3"));
  CHECK_THROWS_WITH(nn::make_model(with("hidden_size", 12), 0), Contains("must be even"));  // head size 3
  CHECK_THROWS_WITH(nn::make_model(with("rope_theta", -1.0), 0), Contains("\"rope_theta\""));
  CHECK_THROWS_WITH(nn::make_model(with("rms_norm_eps", "small"), 0), Contains("\"rms_norm_eps\""));
  CHECK_THROWS_WITH(nn::make_model(with("tie_word_embeddings", 1), 0), Contains("\"tie_word_embeddings\""));
  CHECK_THROWS_WITH(nn::make_model(with("num_attention_heads", 0), 0), Contains("\"num_attention_heads\""));
  // Too long a sequence, named with the limit.
  const Tensor long_ids = zeros({1, 65}, DType::Int64);
  CHECK_THROWS_WITH((*m)(long_ids), Contains("65") && Contains("max_position_embeddings 64"));
}

TEST_CASE("llama: a deferred build equals the eager one, and checkpointing gives the same gradients",
          "[llama][deferred][nn]") {
  for (bool tied : {false, true}) {
    INFO((tied ? "tied" : "untied"));
    nn::LlamaConfig cfg = tiny_config(tied, 1);
    cfg.hidden_size = 32;
    cfg.intermediate_size = 64;
    cfg.num_attention_heads = 4;
    cfg.vocab_size = 96;
    manual_seed(5);
    const auto eager = std::make_shared<nn::Llama>(cfg, 9);
    const std::vector<uint64_t> rng = default_generator().state();
    manual_seed(5);
    const size_t before = cpu_bytes_in_use();
    std::shared_ptr<nn::Llama> lazy;
    {
      LazyInitGuard guard;
      lazy = std::make_shared<nn::Llama>(cfg, 9);
    }
    CHECK(default_generator().state() == rng);
    int64_t bytes = 0;
    for (const Tensor& p : eager->parameters()) bytes += int64_t(p.nbytes());
    CHECK(cpu_bytes_in_use() - before < size_t(bytes) / 50);
    const auto want = eager->state_dict();
    const auto got = lazy->state_dict();
    CHECK(got.size() == want.size());
    for (const auto& [name, t] : got) {
      INFO(name);
      CHECK(is_deferred(t));
      REQUIRE(want.count(name));
      CHECK(same_bits(t, want.at(name)));
    }
    if (tied) CHECK(lazy->lm_head->weight.impl() == lazy->model->embed_tokens->weight.impl());
  }
  // The init: every matrix N(0, 0.02) (Hugging Face's initializer_range), the norms ones.
  {
    nn::LlamaConfig cfg = tiny_config(false, 2);
    cfg.hidden_size = 64;
    cfg.intermediate_size = 128;
    cfg.vocab_size = 256;
    nn::Llama model(cfg, 1);
    for (const auto& [name, p] : model.named_parameters()) {
      INFO(name);
      const std::vector<double> v = p.tolist();
      double m = 0.0, s = 0.0;
      for (double x : v) m += x / double(v.size());
      for (double x : v) s += (x - m) * (x - m) / double(v.size());
      if (name.find("norm") != std::string::npos) {
        CHECK((m == 1.0 && s == 0.0));
      } else {
        CHECK(std::abs(m) < 5 * 0.02 / std::sqrt(double(v.size())));
        CHECK(std::sqrt(s) == Approx(0.02).epsilon(0.1));
      }
    }
    nn::Llama again(cfg, 1), other(cfg, 2);
    CHECK(same_bits(again.model->layers->children()[1]->named_parameters()[0].second,
                    model.model->layers->children()[1]->named_parameters()[0].second));
    CHECK_FALSE(same_bits(other.lm_head->weight, model.lm_head->weight));
  }
  // Activation checkpointing recomputes the same ops: the same loss and gradients, bit for bit.
  for (bool tied : {false, true}) {
    nn::LlamaConfig cfg = tiny_config(tied, 1);
    nn::Llama plain(cfg, 13);
    cfg.activation_checkpointing = true;
    nn::Llama checkpointed(cfg, 13);
    Generator gen(6);
    const Tensor ids = randint(0, cfg.vocab_size, {3, 7}, &gen);
    const Tensor target = randint(0, cfg.vocab_size, {3 * 7}, &gen);
    const Tensor a = cross_entropy(plain(ids).reshape({-1, cfg.vocab_size}), target);
    const Tensor b = cross_entropy(checkpointed(ids).reshape({-1, cfg.vocab_size}), target);
    CHECK(a.item() == b.item());
    a.backward();
    b.backward();
    const auto pa = plain.named_parameters(), pb = checkpointed.named_parameters();
    REQUIRE(pa.size() == pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      INFO(pa[i].first);
      CHECK(same_bits(pa[i].second.grad(), pb[i].second.grad()));
    }
  }
}

TEST_CASE("llama: under bfloat16 autocast the GEMMs run in bfloat16 and the norms in float32", "[llama][amp]") {
  nn::LlamaConfig cfg = tiny_config(false, 1);
  cfg.hidden_size = 32;
  cfg.num_attention_heads = 4;
  nn::Llama model(cfg, 3);
  Generator gen(8);
  const Tensor ids = randint(0, cfg.vocab_size, {2, 6}, &gen);
  const Tensor full = model(ids);
  Tensor low;
  {
    autocast::AutocastGuard guard(true, DType::BFloat16);
    low = model(ids);
    // The residual stream stays float32 (a float32 embedding plus bfloat16 projections promotes), and
    // RMSNorm of it is float32, as under torch.autocast.
    const Tensor h = (*model.model->layers)(model.model->embed_tokens->forward(ids));
    CHECK(h.dtype() == DType::Float32);
    CHECK((*model.model->norm)(h).dtype() == DType::Float32);
  }
  CHECK(low.dtype() == DType::BFloat16);  // lm_head's GEMM
  // bfloat16 keeps 8 bits: a few ulps of 2^-8 through the model, relative to the largest logit.
  CHECK(testing::max_abs_diff(low.to(DType::Float32), full) <= 0.05 * max_abs(full));
  sum(low.to(DType::Float32)).backward();
  for (const auto& [name, p] : model.named_parameters()) {
    INFO(name);
    CHECK(p.grad().defined());
    CHECK(p.grad().dtype() == DType::Float32);
  }
}

TEST_CASE("llama shard policy: stages hold the model under its names, and tp splits heads or says why",
          "[llama][pipeline][tp]") {
  const nn::ShardPolicy policy = nn::find_shard_policy("Llama", "this test");
  const nn::LlamaConfig cfg = shard_config(3);
  auto model = std::make_shared<nn::Llama>(cfg, 4);
  Generator gen(2);
  const Tensor ids = randint(0, cfg.vocab_size, {2, 6}, &gen);
  const Tensor whole = (*model)(ids);

  SECTION("pipeline: the stages together are the model, and run in turn give its logits") {
    std::set<std::string> whole_names;
    std::map<std::string, Tensor> whole_params;
    for (const auto& [name, p] : model->named_parameters()) {
      whole_names.insert(name);
      whole_params[name] = p;
    }
    for (int stages = 1; stages <= 4; ++stages) {
      INFO(stages << " stages");
      std::set<std::string> names;
      Tensor h = ids;
      for (int s = 0; s < stages; ++s) {
        nn::ShardContext c;
        c.stage = s;
        c.stages = stages;
        const nn::ShardedModel part = policy(model, c);
        CHECK(part.shards.empty());
        CHECK_FALSE(part.criterion);
        for (const auto& [name, p] : part.module->named_parameters()) {
          CHECK(names.insert(name).second);               // no parameter on two stages
          CHECK(p.impl() == whole_params.at(name).impl());  // the model's own tensors, not copies
        }
        h = (*part.module)(h);
      }
      CHECK(names == whole_names);
      CHECK(same_bits(h, whole));
    }
    nn::ShardContext c;
    c.stages = 2;
    c.stage_layers = {3, 0};  // every layer on the first stage
    CHECK(policy(model, c).module->named_parameters().size() == 1 + 3 * 9);
    c.stage_layers = {2, 2};
    CHECK_THROWS_WITH(policy(model, c), Contains("stage_layers [2, 2]") && Contains("3"));
    // Tied embeddings need the first and last stage to be one.
    nn::LlamaConfig tied = cfg;
    tied.tie_word_embeddings = true;
    c.stage_layers = {};
    CHECK_THROWS_AS(policy(std::make_shared<nn::Llama>(tied, 4), c), IncompatibleError);
    CHECK_THROWS_WITH(policy(std::make_shared<nn::Llama>(tied, 4), c),
                      Contains("tie_word_embeddings") && Contains("pp_size 1"));
  }
  SECTION("tensor parallel: rank 1 of 2 holds its heads' rows, Megatron's way, named as the model") {
    FakeGroup group(1, 2);
    nn::ShardContext c;
    c.tp = &group;
    const nn::ShardedModel part = policy(model, c);
    std::map<std::string, Tensor> mine, full;
    for (const auto& [name, p] : part.module->named_parameters()) mine[name] = p;
    for (const auto& [name, p] : model->named_parameters()) full[name] = p;
    CHECK(mine.size() == full.size());
    for (const auto& [name, p] : full) {
      INFO(name);
      REQUIRE(mine.count(name));
      const auto spec = part.shards.find(name);
      if (spec == part.shards.end()) {
        CHECK(mine.at(name).impl() == p.impl());  // replicated: the model's own norm weights
        CHECK(name.find("norm") != std::string::npos);
      } else {
        CHECK(same_bits(mine.at(name), p.narrow(spec->second.dim, p.size(spec->second.dim) / 2,
                                                p.size(spec->second.dim) / 2)));
      }
    }
    CHECK(mine.at("model.layers.0.self_attn.q_proj.weight").shape() == Shape{16, 32});  // 2 of 4 heads
    CHECK(mine.at("model.layers.0.self_attn.k_proj.weight").shape() == Shape{8, 32});   // 1 of 2 kv heads
    CHECK(mine.at("model.layers.2.self_attn.o_proj.weight").shape() == Shape{32, 16});
    CHECK(mine.at("model.layers.1.mlp.up_proj.weight").shape() == Shape{24, 32});
    CHECK(mine.at("model.layers.1.mlp.down_proj.weight").shape() == Shape{32, 24});
    CHECK(mine.at("model.embed_tokens.weight").shape() == Shape{32, 32});
    CHECK(mine.at("lm_head.weight").shape() == Shape{32, 32});
    CHECK(part.shards.at("model.layers.2.mlp.down_proj.weight").dim == 1);
    CHECK(part.criterion);

    // Tied: the head is the vocabulary-parallel embedding's own shard.
    nn::LlamaConfig tied = cfg;
    tied.tie_word_embeddings = true;
    const nn::ShardedModel tied_part = policy(std::make_shared<nn::Llama>(tied, 4), c);
    const auto named = tied_part.module->named_parameters();
    CHECK(named.size() == full.size() - 1);
    CHECK(tied_part.shards.count("model.embed_tokens.weight") == 1);
    CHECK(tied_part.shards.count("lm_head.weight") == 0);
  }
  SECTION("tensor parallel sizes that split a key/value head are refused, naming the sizes that work") {
    FakeGroup three(0, 3), four(0, 4);
    nn::ShardContext c;
    c.tp = &four;  // 4 query heads divide, 2 key/value heads do not
    CHECK_THROWS_AS(policy(model, c), IncompatibleError);
    CHECK_THROWS_WITH(policy(model, c), Contains("tensor parallel size 4") && Contains("key/value heads (2)") &&
                                            Contains("whole key/value heads") &&
                                            Contains("tp sizes that work for this model: [1, 2]"));
    c.tp = &three;
    CHECK_THROWS_WITH(policy(model, c), Contains("tensor parallel size 3") && Contains("[1, 2]"));
  }
}

// A rank's part of a deferred Llama (hybrid_parallel builds the whole model under a LazyInitGuard)
// allocates only what it holds: a middle pipeline stage its layer, a tensor-parallel rank its shards and
// the replicated norms, with the eager build's values.
TEST_CASE("llama shard policy: a rank's part of a deferred Llama allocates only that part",
          "[llama][deferred][pipeline][tp]") {
  const nn::ShardPolicy policy = nn::find_shard_policy("Llama", "this test");
  const nn::LlamaConfig cfg = shard_config(4);
  FakeGroup group(1, 2);
  for (bool tp : {false, true}) {
    INFO((tp ? "tensor parallel rank 1 of 2" : "stage 1 of 4"));
    nn::ShardContext c;
    if (tp) {
      c.tp = &group;
    } else {
      c.stage = 1;
      c.stages = 4;
      c.stage_layers = {1, 1, 1, 1};
    }
    const auto eager = std::make_shared<nn::Llama>(cfg, 3);
    const nn::ShardedModel eager_part = policy(eager, c);  // (its shards are copies: made before counting)
    const size_t before = cpu_bytes_in_use();
    std::shared_ptr<nn::Llama> lazy;
    {
      LazyInitGuard guard;
      lazy = std::make_shared<nn::Llama>(cfg, 3);
    }
    const nn::ShardedModel part = policy(lazy, c);
    int64_t part_bytes = 0, whole_bytes = 0;
    for (const Tensor& p : part.module->parameters()) {
      materialize(p);
      part_bytes += int64_t(p.nbytes());
    }
    for (const Tensor& p : eager->parameters()) whole_bytes += int64_t(p.nbytes());
    CHECK(part_bytes < whole_bytes * 3 / 5);
    CHECK(cpu_bytes_in_use() - before == size_t(part_bytes));  // the part, and nothing of the rest
    const auto want = eager_part.module->state_dict();
    for (const auto& [name, t] : part.module->state_dict()) {
      INFO(name);
      REQUIRE(want.count(name));
      CHECK(same_bits(t, want.at(name)));
    }
  }
}

TEST_CASE("llama shard policy: under a ShapesOnlyGuard every part has the eager part's shapes, and nothing is drawn",
          "[llama][deferred][pipeline][tp]") {
  // What `booster check` does to a model it only splits (Note [Checking a model before it trains]): no
  // memory for the whole or the parts, no draws from any generator, the same shapes as the real split.
  const nn::ShardPolicy policy = nn::find_shard_policy("Llama", "this test");
  const nn::LlamaConfig cfg = shard_config(4);
  for (int rank : {0, 1}) {
    for (int stage : {0, 1, 3}) {
      INFO("tp rank " << rank << " of 2, stage " << stage << " of 4");
      FakeGroup group(rank, 2);
      nn::ShardContext c;
      c.tp = &group;
      c.stage = stage;
      c.stages = 4;
      c.stage_layers = {1, 1, 1, 1};
      const nn::ShardedModel eager_part = policy(std::make_shared<nn::Llama>(cfg, 3), c);
      manual_seed(5);
      const std::vector<uint64_t> rng = default_generator().state();
      const size_t before = cpu_bytes_in_use();
      reset_cpu_peak_bytes();
      std::map<std::string, Tensor> shapes;
      {
        LazyInitGuard lazy;
        ShapesOnlyGuard shapes_only;
        shapes = policy(std::make_shared<nn::Llama>(cfg, 3), c).module->state_dict();
      }
      CHECK(cpu_peak_bytes() <= before);
      CHECK(default_generator().state() == rng);
      const auto want = eager_part.module->state_dict();
      REQUIRE(shapes.size() == want.size());
      for (const auto& [name, t] : shapes) {
        INFO(name);
        REQUIRE(want.count(name));
        CHECK(is_deferred(t));
        CHECK(t.shape() == want.at(name).shape());
        CHECK(t.dtype() == want.at(name).dtype());
      }
    }
  }
}
