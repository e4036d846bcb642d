// Qwen2 under tensor parallelism over `mpirun -np 2` (Note [Decoder families] in nn/llama.cpp): its q/k/v
// biases split with their weights' rows and a sliding window on its upper layer. The shard policy's
// split against the whole model in one process (logits, loss, every rank's gradients, the biases' among
// them: its slice of the whole model's), then five SGD steps of a deferred build through the Booster's
// hybrid_parallel plugin with tp 2 against one process, within the roundoff bounds of tests/roundoff.h.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/llama.h"
#include "booster/nn/model_registry.h"
#include "booster/nn/shard_policy.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/deferred.h"
#include "roundoff.h"
#include "trajectory.h"

using namespace booster;
using namespace booster::distributed;
namespace ro = ::testing::roundoff;

namespace {

ProcessGroup& group() { return init_process_group("mpi"); }

// Largest |a - b| / (1 + |b|).
double max_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const std::vector<double> x = a.tolist(), y = b.tolist();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]) / (1 + std::abs(y[i])));
  return m;
}

// The model's reductions (Note [Roundoff bounds]); a bias or a window lengthens none of them.
double forward_bound(double batch, double T) {
  return ro::reduction_bound({ro::llama_forward_length(32, 2, 4, 48, T, 64, batch)});
}
double gradient_bound(double batch, double T) {
  return ro::reduction_bound({2 * ro::llama_forward_length(32, 2, 4, 48, T, 64, batch), batch * T});
}

// Layer 0 attends everything, layer 1 a window of 4 keys (max_window_layers 1).
const nlohmann::json kQwen2 = {{"type", "qwen2"},           {"vocab_size", 64},        {"hidden_size", 32},
                               {"intermediate_size", 48},   {"num_hidden_layers", 2},  {"num_attention_heads", 4},
                               {"num_key_value_heads", 2},  {"max_position_embeddings", 16},
                               {"use_sliding_window", true}, {"sliding_window", 4},    {"max_window_layers", 1}};

std::shared_ptr<nn::Llama> qwen2(uint64_t seed) {
  auto m = std::dynamic_pointer_cast<nn::Llama>(nn::make_model(kQwen2, seed));
  REQUIRE(m != nullptr);
  return m;
}

Tensor loss_of(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

}  // namespace

TEST_CASE("qwen2: tensor parallel over 2 ranks equals the whole model, biases split with their weights",
          "[mpi][tp][families][roundoff]") {
  ProcessGroup& pg = group();
  REQUIRE(pg.size() == 2);
  auto reference = qwen2(7), source = qwen2(7);
  {  // biases start at zero (Hugging Face's init): give them values, the same on both models
    NoGradGuard no_grad;
    for (auto* m : {reference.get(), source.get()}) {
      Generator same(5);
      for (auto [name, p] : m->named_parameters())
        if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) p.copy_(randn(p.shape(), &same) * 0.5);
    }
  }
  nn::ShardContext c;
  c.tp = &pg;
  const nn::ShardedModel part = nn::find_shard_policy("Llama", "this test")(source, c);
  REQUIRE(part.criterion);
  CHECK(part.shards.count("model.layers.1.self_attn.k_proj.bias"));
  const nn::Criterion criterion = part.criterion(loss_of);

  Generator data(3);  // the same batch on both ranks; 9 positions, past the window
  const Tensor ids = randint(0, 64, {2, 9}, &data);
  const Tensor y = randint(0, 64, {2, 9}, &data);
  const Tensor whole = (*reference)(ids);
  const Tensor split = (*part.module)(ids);  // training: this rank's half of the vocabulary
  CHECK(max_diff(split, whole.narrow(2, pg.rank() * 32, 32)) <= forward_bound(2, 9));
  const Tensor want = loss_of(whole, y), got = criterion(split, y);
  CHECK(std::abs(got.item() - want.item()) <= forward_bound(2, 9) * std::abs(want.item()));
  want.backward();
  got.backward();

  std::map<std::string, Tensor> full;
  for (const auto& [name, p] : reference->named_parameters()) full[name] = p;
  const auto mine = part.module->named_parameters();
  CHECK(mine.size() == full.size());
  for (const auto& [name, p] : mine) {
    INFO(name);
    REQUIRE(full.count(name));
    REQUIRE(p.grad().defined());
    Tensor ref = full.at(name).grad();
    const auto spec = part.shards.find(name);
    if (spec != part.shards.end()) {
      const int64_t n = ref.size(spec->second.dim) / 2;
      ref = ref.narrow(spec->second.dim, pg.rank() * n, n);
    }
    CHECK(max_diff(p.grad(), ref) <= gradient_bound(2, 9));
  }
}

TEST_CASE("qwen2: hybrid_parallel tp 2 trains a deferred Qwen2 as one process does", "[mpi][hybrid][families][roundoff]") {
  ProcessGroup& pg = group();
  REQUIRE(pg.size() == 2);
  const nlohmann::json sgd = {{"type", "sgd"}, {"lr", 0.5}};
  Generator data(9);
  std::vector<std::pair<Tensor, Tensor>> batches;
  for (int s = 0; s < 5; ++s) {
    const Tensor x = randint(0, 64, {4, 8}, &data);
    batches.emplace_back(x, randint(0, 64, {4, 8}, &data));
  }
  auto reference = qwen2(11);
  auto ref_opt = optim::make_optimizer(sgd, reference->parameters());
  // Each step's loss within the forward's roundoff plus |g_t| times the weights' SGD bound along the
  // reference's path so far (as tests/mpi/test_mpi_llama.cpp's hybrid case).
  std::vector<double> want, loss_bounds;
  const double eps_gradient = gradient_bound(4, 8);
  double path = 0;
  for (const auto& [x, y] : batches) {
    ref_opt->zero_grad();
    const ::testing::Weights before = ::testing::flat_weights(reference->state_dict());
    const Tensor loss = loss_of((*reference)(x), y);
    loss.backward();
    double g2 = 0;
    for (const Tensor& p : reference->parameters())
      for (double g : p.grad().tolist()) g2 += g * g;
    loss_bounds.push_back(forward_bound(4, 8) * std::abs(loss.item()) + std::sqrt(g2) * ro::sgd_bound(path, eps_gradient));
    ref_opt->step();
    path += ::testing::l2_distance(::testing::flat_weights(reference->state_dict()), before);
    want.push_back(loss.item());
  }
  std::shared_ptr<nn::Llama> lazy;
  {
    LazyInitGuard guard;
    lazy = qwen2(11);
  }
  Booster booster(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = {{"tp_size", 2}, {"pp_size", 1}}});
  Boosted b = booster.boost(lazy, optim::make_optimizer(sgd, lazy->parameters()), loss_of);
  for (size_t s = 0; s < batches.size(); ++s) {
    b.optimizer->zero_grad();
    const double got = booster.execute_pipeline(batches[s].first, batches[s].second, *b.model, b.criterion, *b.optimizer);
    b.optimizer->step();
    INFO("step " << s << ": " << got << " against " << want[s] << ", bound " << loss_bounds[s]);
    CHECK(std::abs(got - want[s]) <= loss_bounds[s]);
  }
}
