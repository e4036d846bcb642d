// LoRA under the hybrid_parallel plugin (Note [LoRA under tensor parallelism] in nn/lora.cpp), over
// `mpirun -np 2`, for both shard policies that split adapters: a Llama with adapters on all seven of a
// layer's Linears, and a GPT with adapters on all four of a block's (c_attn, whose B splits in its
// q | k | v row blocks, the two c_proj and c_fc), B nonzero (PEFT starts it at zero, where a wrong split
// of B or of A's gradient would not show), against the same model in one process. The shard policy
// with tp 2: this rank's logits, the loss and every adapter's gradient (its slice of the whole model's
// where the adapter is split, the whole gradient where it is replicated); then three AdamW steps
// through the Booster with tp 2 and with pp 2: each step's loss, the first step's adapter gradients,
// the adapters at the end in the gathered checkpoint, and the frozen base saved unchanged. Both also
// with an adapter on the vocabulary-parallel lm_head (tied to the embedding or not). On 4 ranks
// (`mpirun -np 4 ... "[hybrid_4_ranks]"`, CTest's test_mpi_lora_hybrid_4_ranks) the same training,
// lm_head adapted, under tp 2 x pp 2 and dp 2 x tp 2. Bounds from Note [Roundoff bounds]
// (tests/roundoff.h), float32.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <functional>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <tuple>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/llama.h"
#include "booster/nn/lora.h"
#include "booster/nn/models.h"
#include "booster/nn/shard_policy.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "roundoff.h"
#include "llama_fixture.h"

using namespace booster;
using namespace booster::distributed;
using nlohmann::json;
namespace fs = std::filesystem;
namespace ro = ::testing::roundoff;

namespace {

// A bug that leaves a rank waiting fails the test within a minute, naming the collective.
ProcessGroup& group() {
  set_default_collective_timeout(std::chrono::seconds(60));
  return init_process_group("mpi");
}

constexpr int64_t kRank = 4;
const json kAdamW = {{"type", "adamw"}, {"lr", 1e-2}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.1}};

// One model under test: how to build it whole, its adapters, and how each adapter splits at tp 2.
struct Family {
  std::string policy;  // the model's name(): its shard policy
  nn::LoraConfig lora;
  std::function<nn::ModulePtr()> build;
  int64_t vocab;
  int64_t adapters;  // adapter tensors (A and B) of the whole model
  int64_t adapted_outputs = 2 * 4;  // adapted Linears on the forward's path (Note [Roundoff bounds] below)
  // Note [Roundoff bounds]: the model's forward reductions (roundoff.h), on `batch` sequences of T.
  std::function<double(double batch, double T)> model_length;
  // Note [LoRA under tensor parallelism]: B along out under a column-parallel base (in its blocks for
  // a fused one), A along in under a row-parallel one; nothing for the others.
  std::function<std::optional<nn::ShardSpec>(const std::string& name)> split;
};

Family llama() {
  return {.policy = "Llama",
          .lora = {.r = kRank,
                   .alpha = 8,
                   .target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}},
          .build = [] { return std::make_shared<nn::Llama>(booster::testing::tiny_llama_config(), 13); },
          .vocab = 64,
          .adapters = 2 * 7 * 2,
          .model_length = [](double batch, double T) { return ro::llama_forward_length(32, 2, 4, 48, T, 64, batch); },
          .split = [](const std::string& name) -> std::optional<nn::ShardSpec> {
            const bool row = name.find("o_proj.") != std::string::npos || name.find("down_proj.") != std::string::npos;
            if (row && name.find(".lora_A.") != std::string::npos) return nn::ShardSpec{1, 1};
            if (!row && name.find(".lora_B.") != std::string::npos) return nn::ShardSpec{0, 1};
            return std::nullopt;
          }};
}

// `f` with adapters on lm_head too, the model from `build` (Note [LoRA on the vocabulary-parallel
// head] in shard_policy.cpp): its B splits by the head's vocabulary rows, tied to the embedding or not.
Family with_head(Family f, std::function<nn::ModulePtr()> build) {
  f.lora.target_modules.push_back("lm_head");
  f.build = std::move(build);
  f.adapters += 2;
  f.adapted_outputs += 1;
  f.split = [split = f.split](const std::string& name) -> std::optional<nn::ShardSpec> {
    if (name == "lm_head.lora_B.weight") return nn::ShardSpec{0, 1};
    return split(name);
  };
  return f;
}

Family llama_with_head(bool tied) {
  return with_head(llama(), [tied] {
    nn::LlamaConfig c = booster::testing::tiny_llama_config();
    c.tie_word_embeddings = tied;
    return std::make_shared<nn::Llama>(c, 13);
  });
}

// A tiny GPT: width 32, 4 heads, 2 blocks, vocabulary 64, 16 positions.
Family gpt() {
  return {.policy = "GPT",
          .lora = {.r = kRank, .alpha = 8, .target_modules = {"c_attn", "c_proj", "c_fc"}},
          .build =
              [] {
                nn::GPTConfig c;
                c.vocab_size = 64, c.context = 16, c.width = 32, c.layers = 2, c.heads = 4;
                return std::make_shared<nn::GPT>(c, 13);
              },
          .vocab = 64,
          .adapters = 2 * 4 * 2,
          .model_length = [](double batch, double T) { return ro::gpt_forward_length(32, 2, 4, T, 64, batch); },
          .split = [](const std::string& name) -> std::optional<nn::ShardSpec> {
            const bool row = name.find("c_proj.") != std::string::npos;
            if (row && name.find(".lora_A.") != std::string::npos) return nn::ShardSpec{1, 1};
            if (row || name.find(".lora_B.") == std::string::npos) return std::nullopt;
            return nn::ShardSpec{0, name.find("c_attn.") != std::string::npos ? 3 : 1};  // q | k | v
          }};
}

Family gpt_with_head(bool tied) {
  return with_head(gpt(), [tied] {
    nn::GPTConfig c;
    c.vocab_size = 64, c.context = 16, c.width = 32, c.layers = 2, c.heads = 4, c.tie_word_embeddings = tied;
    return std::make_shared<nn::GPT>(c, 13);
  });
}

// The whole model, adapted, its B drawn N(0, 0.1^2) (the same on every rank and in every call).
nn::ModulePtr adapted(const Family& f, Booster* booster = nullptr) {
  nn::ModulePtr m = f.build();
  if (booster) {
    booster->enable_lora(m, f.lora);
  } else {
    nn::apply_lora(*m, f.lora);
  }
  NoGradGuard no_grad;
  Generator gen(5);
  for (auto [name, p] : m->named_parameters())
    if (name.find(".lora_B.") != std::string::npos) p.copy_(randn(p.shape(), &gen) * 0.1);
  return m;
}

// Note [Roundoff bounds]: the model's reductions, and per layer four adapted outputs on the path
// (Llama: q/k/v, o, gate/up, down; GPT: c_attn, c_proj, c_fc, c_proj; lm_head one more where adapted)
// each adding B's sum over r and the addition to the base's output.
double forward_length(const Family& f, double batch, double T) {
  return f.model_length(batch, T) + double(f.adapted_outputs) * (kRank + 1);
}
double forward_bound(const Family& f, double batch, double T) {
  return ro::reduction_bound({forward_length(f, batch, T)});
}
double gradient_bound(const Family& f, double batch, double T, double parameters = 0) {
  return ro::reduction_bound({2 * forward_length(f, batch, T), batch * T, parameters});
}

// Largest |a - b| / (1 + |b|).
double max_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const std::vector<double> x = a.tolist(), y = b.tolist();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]) / (1 + std::abs(y[i])));
  return m;
}

Tensor loss_of(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

// A directory every rank names alike (rank 0 draws the suffix).
fs::path shared_dir(const std::string& tag) {
  Tensor n = full({1}, double(std::random_device{}() % 1000000), DType::Int64);
  group().broadcast(n, 0);
  return fs::temp_directory_path() / ("booster_lora_hybrid_" + tag + "_" + std::to_string(n.to_vector<int64_t>()[0]));
}

// The policy with tp 2 alone: this rank's logits, the loss and every adapter's gradient.
void check_tp_split(const Family& f) {
  ProcessGroup& pg = group();
  REQUIRE(pg.size() == 2);
  auto reference = adapted(f), source = adapted(f);
  nn::ShardContext c;
  c.tp = &pg;
  const nn::ShardedModel part = nn::find_shard_policy(f.policy, "this test")(source, c);
  const nn::Criterion criterion = part.criterion(loss_of);
  const int64_t half = f.vocab / 2;

  Generator data(3);  // the same batch on both ranks
  const Tensor ids = randint(0, f.vocab, {2, 9}, &data), y = randint(0, f.vocab, {2, 9}, &data);
  const Tensor whole = (*reference)(ids);
  const Tensor split = (*part.module)(ids);  // training: this rank's half of the vocabulary
  CHECK(max_diff(split, whole.narrow(2, pg.rank() * half, half)) <= forward_bound(f, 2, 9));
  const Tensor want = loss_of(whole, y), got = criterion(split, y);
  CHECK(std::abs(got.item() - want.item()) <= forward_bound(f, 2, 9) * std::abs(want.item()));
  want.backward();
  got.backward();

  std::map<std::string, Tensor> full_params;
  for (const auto& [name, p] : reference->named_parameters()) full_params[name] = p;
  int adapters = 0;
  for (const auto& [name, p] : part.module->named_parameters()) {
    INFO(name);
    REQUIRE(full_params.count(name));
    if (!full_params.at(name).requires_grad()) continue;  // the frozen base (the plugin freezes its pieces)
    ++adapters;
    REQUIRE(p.grad().defined());
    Tensor ref = full_params.at(name).grad();
    // The policy lays the piece out as the test expects (the checkpoint gathers it so).
    const auto spec = f.split(name);
    const auto policy_spec = part.shards.find(name);
    REQUIRE(spec.has_value() == (policy_spec != part.shards.end()));
    if (spec) {
      CHECK((policy_spec->second.dim == spec->dim && policy_spec->second.chunks == spec->chunks));
      ref = nn::shard_of(ref, *spec, pg.rank(), 2);
    }
    CHECK(max_diff(p.grad(), ref) <= gradient_bound(f, 2, 9));
  }
  CHECK(adapters == f.adapters);
}

struct Layout {
  std::string label;
  int tp, pp;  // dp: the world's size over tp x pp
};

// Three AdamW steps through the Booster under each layout (on 2 ranks tp 2 and pp 2; on 4, tp 2 x pp 2
// and dp 2 x tp 2), against a plain loop in one process.
void check_training(const Family& f, const std::vector<Layout>& layouts) {
  ProcessGroup& pg = group();
  const int world_size = pg.size();
  const int steps = 3;
  Generator data(9);
  std::vector<std::pair<Tensor, Tensor>> batches;
  for (int s = 0; s < steps; ++s) {
    const Tensor x = randint(0, f.vocab, {4, 8}, &data);
    batches.emplace_back(x, randint(0, f.vocab, {4, 8}, &data));
  }
  // The reference: a plain loop in one process.
  auto reference = adapted(f);
  std::map<std::string, Tensor> base;  // the frozen base as it started
  for (const auto& [n, p] : reference->named_parameters())
    if (!p.requires_grad()) base[n] = p.detach().clone();
  auto ref_opt = optim::make_optimizer(kAdamW, nn::trainable_parameters(*reference));
  std::vector<double> want, grad_l1;
  std::map<std::string, Tensor> first_grads;
  for (const auto& [x, y] : batches) {
    ref_opt->zero_grad();
    const Tensor loss = loss_of((*reference)(x), y);
    loss.backward();
    double l1 = 0;
    for (const auto& [n, p] : reference->named_parameters()) {
      if (!p.requires_grad()) continue;
      for (double g : p.grad().tolist()) l1 += std::abs(g);
      if (want.empty()) first_grads[n] = p.grad().clone();
    }
    grad_l1.push_back(l1);
    ref_opt->step();
    want.push_back(loss.item());
  }
  const int64_t trained = int64_t(nn::trainable_parameters(*reference).size());
  int64_t trained_numel = 0;
  for (const Tensor& p : nn::trainable_parameters(*reference)) trained_numel += p.numel();
  // Under AdamW each element within adam_drift_bound, each loss within the forward's roundoff plus
  // |g_t|_1 times that drift (first order in the weights' difference), as tests/mpi/test_mpi_hybrid.cpp.
  const double eps_forward = forward_bound(f, 4, 8), eps_gradient = gradient_bound(f, 4, 8, double(trained_numel));
  const double drift = ro::adam_drift_bound(kAdamW.at("lr").get<double>(), steps, 0.9, 0.95);

  for (const auto& [label, tp, pp] : layouts) {
    INFO(label);
    REQUIRE(world_size % (tp * pp) == 0);
    const int replica = tp * pp, dp_rank = pg.rank() / replica, tp_rank = pg.rank() % tp;  // Megatron's order
    const int64_t rows = batches[0].first.size(0) / (world_size / replica);
    // The first step's gradients before step(): with dp > 1 the replica's own rows' (the plugin averages
    // them over the replicas in step()), from one process on those rows.
    std::map<std::string, Tensor> want_grads = first_grads;
    if (world_size > replica) {
      auto own = adapted(f);
      const auto& [x, y] = batches[0];
      loss_of((*own)(x.narrow(0, dp_rank * rows, rows)), y.narrow(0, dp_rank * rows, rows)).backward();
      for (const auto& [n, p] : own->named_parameters())
        if (p.requires_grad()) want_grads[n] = p.grad();
    }
    Booster booster(BoosterConfig{.plugin = "hybrid_parallel",
                                  .plugin_options = {{"tp_size", tp}, {"pp_size", pp}, {"num_microbatches", 2}}});
    auto whole = adapted(f, &booster);
    Boosted b = booster.boost(whole, optim::make_optimizer(kAdamW, nn::trainable_parameters(*whole)), loss_of);
    for (int s = 0; s < steps; ++s) {
      b.optimizer->zero_grad();
      const auto& [x, y] = batches[size_t(s)];
      const double got = booster.execute_pipeline(x.narrow(0, dp_rank * rows, rows), y.narrow(0, dp_rank * rows, rows),
                                                  *b.model, b.criterion, *b.optimizer);
      if (s == 0) {
        // The first step's gradients: this rank's adapters (its slice where split), the base none.
        int64_t seen = 0;
        for (const auto& [n, p] : b.model->named_parameters()) {
          INFO(n);
          if (!p.requires_grad()) {
            CHECK_FALSE(p.grad().defined());
            continue;
          }
          ++seen;
          REQUIRE(want_grads.count(n));
          REQUIRE(p.grad().defined());
          Tensor ref = want_grads.at(n);
          if (tp > 1)
            if (const auto spec = f.split(n)) ref = nn::shard_of(ref, *spec, tp_rank, tp);
          CHECK(max_diff(p.grad(), ref) <= eps_gradient);
        }
        Tensor total = full({1}, double(seen), DType::Float64);
        pg.all_reduce(total);  // pp: the stages' adapters together; tp and dp: each rank all of them
        CHECK(total.item() == double(world_size / pp * trained));
      }
      b.optimizer->step();
      // Every rank has its replica's loss (of its rows); the ranks' mean is the batch's.
      Tensor mean = full({1}, got / world_size, DType::Float64);
      pg.all_reduce(mean);
      const double bound = eps_forward * std::abs(want[size_t(s)]) + drift * double(s) / steps * grad_l1[size_t(s)];
      INFO("step " << s << ": " << mean.item() << " against " << want[size_t(s)] << ", bound " << bound);
      CHECK(std::abs(mean.item() - want[size_t(s)]) <= bound);
    }
    // The saved model is one process's file: adapters within the drift, the base unchanged.
    const fs::path dir = shared_dir("model");
    booster.save_model(*b.model, dir);
    if (pg.rank() == 0) {
      const checkpoint::TensorMap saved = checkpoint::load_model(dir);
      const nn::StateDict ref = reference->state_dict();
      CHECK(saved.size() == ref.size());
      for (const auto& [n, t] : ref) {
        INFO(n);
        if (!saved.count(n)) {
          FAIL_CHECK("the saved model has no " << n);
          continue;
        }
        const Tensor got = saved.at(n);
        REQUIRE(got.shape() == t.shape());
        if (base.count(n)) {
          CHECK(max_diff(got, base.at(n)) == 0.0);
          continue;
        }
        double largest = 0;
        const std::vector<double> a = got.tolist(), w = t.tolist();
        for (size_t i = 0; i < a.size(); ++i) largest = std::max(largest, std::abs(a[i] - w[i]));
        CHECK(largest <= drift);
      }
    }
    pg.barrier();
    if (pg.rank() == 0) fs::remove_all(dir);
  }
}

const std::vector<Layout> kTwoRanks = {{"tp 2", 2, 1}, {"pp 2", 1, 2}};
const std::vector<Layout> kFourRanks = {{"tp 2 x pp 2", 2, 2}, {"dp 2 x tp 2", 2, 1}};

}  // namespace

TEST_CASE("lora: the Llama policy with tp 2 splits the adapters, logits and gradients as one process",
          "[mpi][lora][tp][roundoff]") {
  check_tp_split(llama());
}

TEST_CASE("lora: the GPT policy with tp 2 splits the adapters, c_attn's B by q, k and v, as one process",
          "[mpi][lora][tp][gpt][roundoff]") {
  check_tp_split(gpt());
}

TEST_CASE("lora: the Llama policy with tp 2 splits lm_head's adapters by the vocabulary as one process",
          "[mpi][lora][tp][roundoff]") {
  SECTION("untied") { check_tp_split(llama_with_head(false)); }
  SECTION("tied to the embedding") { check_tp_split(llama_with_head(true)); }
}

TEST_CASE("lora: hybrid_parallel tp 2 and pp 2 train a Llama's lm_head adapters as one process does",
          "[mpi][lora][hybrid][roundoff]") {
  check_training(llama_with_head(false), kTwoRanks);
  // Tied to the embedding: tp only (a pipeline puts the embedding and the head on different ranks).
  check_training(llama_with_head(true), {{"tp 2, tied", 2, 1}});
}

TEST_CASE("lora: the GPT policy with tp 2 splits lm_head's adapters by the vocabulary as one process",
          "[mpi][lora][tp][gpt][roundoff]") {
  SECTION("untied") { check_tp_split(gpt_with_head(false)); }
  SECTION("tied to the embedding") { check_tp_split(gpt_with_head(true)); }
}

TEST_CASE("lora: hybrid_parallel tp 2 and pp 2 train the adapters as one process does",
          "[mpi][lora][hybrid][roundoff]") {
  check_training(llama(), kTwoRanks);
}

TEST_CASE("lora: hybrid_parallel tp 2 and pp 2 train a GPT's adapters as one process does",
          "[mpi][lora][hybrid][gpt][roundoff]") {
  check_training(gpt(), kTwoRanks);
}

// On 4 ranks only (CTest's test_mpi_lora_hybrid_4_ranks: hidden from the 2-rank run, picked by its tag).
TEST_CASE("lora: hybrid_parallel tp 2 x pp 2 and dp 2 x tp 2 train a Llama's adapters as one process does",
          "[.][mpi][lora][hybrid_4_ranks][roundoff]") {
  REQUIRE(group().size() == 4);
  check_training(llama_with_head(false), kFourRanks);
}

TEST_CASE("lora: hybrid_parallel tp 2 x pp 2 and dp 2 x tp 2 train a GPT's adapters as one process does",
          "[.][mpi][lora][hybrid_4_ranks][gpt][roundoff]") {
  REQUIRE(group().size() == 4);
  check_training(gpt_with_head(false), kFourRanks);
}
