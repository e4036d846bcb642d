// Plugins on CUDA tensors with several ranks on one GPU, under `mpirun -np 2` (and `-np 4` for the
// hybrid case): ranks that share a GPU get the staged group (Note [Staged collectives] in
// core/booster/distributed/README.md), so ddp, ZeRO-1/2/3 and hybrid_parallel run their real
// collectives on device buffers. Each is compared with one process on the same GPU that sees the whole
// batch, within the bounds of the dtype (Note [Roundoff bounds] in tests/roundoff.h for float32 under
// SGD; Adam's drift bound for bfloat16). Every case skips, with the reason, without a GPU.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "booster/backends/cuda/cuda.h"
#include "booster/booster/booster.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/distributed/mpi_process_group.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"
#include "cuda_skip.h"
#include "roundoff.h"
#include "trajectory.h"

using namespace booster;
using nlohmann::json;
namespace fs = std::filesystem;
namespace ro = ::testing::roundoff;

namespace {

// mpi under mpirun; tcp when bench/gpu_round.sh starts the ranks with torchrun's variables.
distributed::ProcessGroup& world() { return distributed::init_process_group("auto"); }

// This rank's GPU and its group. The staged group is asked for explicitly, so a machine with a GPU per
// rank tests it too (there the automatic choice would be NCCL).
Device my_gpu() { return Device::cuda(distributed::node_rank() % cuda::device_count()); }
distributed::ProcessGroup& gpu_group() {
  world();
  setenv("BOOSTER_CUDA_COLLECTIVES", "staged", 0);
  return distributed::process_group_for(my_gpu());
}

// A directory every rank names alike (rank 0 draws the suffix).
fs::path shared_dir(const std::string& tag) {
  Tensor n = full({1}, double(std::random_device{}() % 1000000), DType::Int64);
  world().broadcast(n, 0);
  return fs::temp_directory_path() / ("booster_mpi_cuda_" + tag + "_" + std::to_string(n.to_vector<int64_t>()[0]));
}

std::vector<double> host(const Tensor& t) { return t.to(DType::Float64).tolist(); }

Tensor on_gpu(std::vector<double> v, DType dtype = DType::Float32) {
  const int64_t n = int64_t(v.size());
  return from_vector(v, {n}).to(dtype).to(my_gpu());
}

// A state dict or model file on the host (both are maps by name).
std::map<std::string, Tensor> sorted(const std::map<std::string, Tensor>& d) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : d) out[name] = t.to(Device::cpu());
  return out;
}

}  // namespace

// The choice between NCCL and the staged group is the job's: every rank decides from the same gathered
// (host, GPU) list. Ranks of one node with one GPU or none share it, so they stage; no GPU is needed
// for the choice, nor for CPU buffers, which the staged group passes to its mpi communicator.
TEST_CASE("staged group: ranks of one node that share a GPU agree on it, and CPU buffers pass through",
          "[mpi][cuda]") {
  if (cuda::device_count() > 1) {
    skip_test("this node has several GPUs: the ranks may each have their own (NCCL)");
    return;
  }
  world();
  distributed::ProcessGroup& g = distributed::process_group_for(Device::cuda(0));
  CHECK(g.backend() == world().backend() + " (staged)");
  CHECK(g.device() == Device::cuda(0));
  CHECK(g.size() == world().size());
  CHECK(g.rank() == world().rank());
  Tensor t = full({2}, double(g.rank() + 1));
  g.all_reduce(t);
  const double sum = g.size() * (g.size() + 1) / 2.0;
  CHECK(t.tolist() == std::vector<double>{sum, sum});
  // Its timeout is its own: setting it leaves the default group's alone.
  const auto before = world().timeout();
  g.set_timeout(std::chrono::seconds(42));
  Tensor u = full({1}, 1.0);
  g.all_reduce(u);
  CHECK(world().timeout() == before);
  g.barrier();
}

TEST_CASE("staged group: collectives and sends on CUDA tensors of ranks that share a GPU", "[mpi][cuda]") {
  if (::testing::skip_without_gpu()) return;
  distributed::ProcessGroup& g = gpu_group();
  const int r = g.rank(), n = g.size();
  REQUIRE(n == world().size());
  CHECK(g.backend() == world().backend() + " (staged)");
  CHECK(g.device() == my_gpu());
  // Exact in every dtype: small integers.
  for (const DType dtype : {DType::Float32, DType::BFloat16, DType::Int64}) {
    INFO(dtype_name(dtype));
    Tensor t = on_gpu({double(r + 1), double(2 * r), 5.0}, dtype);
    g.all_reduce(t);
    const double sum_r = n * (n + 1) / 2.0;
    CHECK(host(t) == std::vector<double>{sum_r, double(n * (n - 1)), 5.0 * n});
    Tensor m = on_gpu({double(r), -double(r)}, dtype);
    g.all_reduce(m, distributed::ReduceOp::Max);
    CHECK(host(m) == std::vector<double>{double(n - 1), 0.0});
  }
  Tensor avg = on_gpu({double(2 * r), 4.0});
  g.all_reduce(avg, distributed::ReduceOp::Avg);
  CHECK(host(avg) == std::vector<double>{double(n - 1), 4.0});

  Tensor b = on_gpu({double(r), double(r)});
  g.broadcast(b, n - 1);
  CHECK(host(b) == std::vector<double>{double(n - 1), double(n - 1)});

  // All-gather, out of place and in place (this rank's slice of `out`).
  Tensor out = Tensor::empty({2 * n}, DType::Float32, my_gpu());
  g.all_gather(out, on_gpu({double(r), double(10 * r)}));
  std::vector<double> want;
  for (int k = 0; k < n; ++k) want.insert(want.end(), {double(k), double(10 * k)});
  CHECK(host(out) == want);
  Tensor in_place = zeros({2 * n}, DType::Float32, my_gpu());
  Tensor mine = in_place.narrow(0, 2 * r, 2);
  mine.copy_(on_gpu({double(r), double(10 * r)}));
  g.all_gather(in_place, mine);
  CHECK(host(in_place) == want);

  // Reduce-scatter leaves `in` as it was; Avg divides the sums.
  std::vector<double> rows(size_t(2 * n));
  for (int k = 0; k < 2 * n; ++k) rows[size_t(k)] = double(k + r);
  const Tensor in = on_gpu(rows);
  Tensor part = Tensor::empty({2}, DType::Float32, my_gpu());
  g.reduce_scatter(part, in, distributed::ReduceOp::Sum);
  const double ranks = n * (n - 1) / 2.0;
  CHECK(host(part) == std::vector<double>{double(n * 2 * r) + ranks, double(n * (2 * r + 1)) + ranks});
  CHECK(host(in) == rows);
  g.reduce_scatter(part, in, distributed::ReduceOp::Avg);
  CHECK(host(part) == std::vector<double>{2.0 * r + ranks / n, 2.0 * r + 1 + ranks / n});

  // Non-blocking: the result is there after wait(), and also when the Work is dropped unwaited.
  Tensor a = on_gpu({1.0, double(r)});
  distributed::WorkPtr w = g.all_reduce_async(a);
  w->wait();
  CHECK(host(a) == std::vector<double>{double(n), ranks});
  Tensor dropped = on_gpu({1.0});
  g.all_reduce_async(dropped);
  CHECK(host(dropped) == std::vector<double>{double(n)});

  // A ring: each rank sends to the next and receives from the previous, both posted at once.
  Tensor got = zeros({3}, DType::Float32, my_gpu());
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  g.batch_send_recv({{distributed::ProcessGroup::P2POp::Kind::Send, on_gpu({double(r), 7.0, -1.0}), next, 3},
                     {distributed::ProcessGroup::P2POp::Kind::Recv, got, prev, 3}})
      ->wait();
  CHECK(host(got) == std::vector<double>{double(prev), 7.0, -1.0});

  // Subgroups are staged too: each rank alone.
  std::shared_ptr<distributed::ProcessGroup> alone = g.split(r, 0, "alone");
  REQUIRE(alone != nullptr);
  CHECK(alone->size() == 1);
  CHECK(alone->device() == my_gpu());
  Tensor one = on_gpu({double(r)});
  alone->all_reduce(one);
  CHECK(host(one) == std::vector<double>{double(r)});
  g.barrier();
}

namespace {

constexpr int64_t kIn = 32, kClasses = 10, kBatch = 16;  // the global batch; each rank takes its rows
constexpr int kSteps = 10;
const json kMlp = {{"type", "mlp"}, {"in", kIn}, {"hidden", {64, 64}}, {"classes", kClasses}};

struct Batch {
  Tensor x, y;
};
Batch global_batch(int step) {
  Generator gen(500 + uint64_t(step));
  return {randn({kBatch, kIn}, &gen).to(my_gpu()), randint(0, kClasses, {kBatch}, &gen).to(my_gpu())};
}
Batch rows_of(const Batch& b, int rank, int ranks) {
  const int64_t rows = b.x.size(0) / ranks;
  return {b.x.narrow(0, rank * rows, rows), b.y.narrow(0, rank * rows, rows)};
}

Tensor ce(const Tensor& out, const Tensor& y) { return cross_entropy(out, y); }

// The reference: one process on this rank's GPU, the whole batch, no Booster. Gives the final weights
// and the path sum_t |w_t - w_{t-1}| of the whole model (Note [Roundoff bounds], step 3).
struct Reference {
  std::map<std::string, Tensor> weights;
  std::vector<double> losses, grad_l2;  // each step's loss and |gradient|_2
  double path = 0;
};

// |gradient|_2 over the parameters.
double grad_norm(const nn::Module& model) {
  double s = 0;
  for (const Tensor& p : model.parameters())
    if (p.grad().defined())
      for (double g : p.grad().tolist()) s += g * g;
  return std::sqrt(s);
}
Reference train_reference(const json& optimizer) {
  nn::ModulePtr model = nn::make_model(kMlp, 7);
  model->to(my_gpu());
  auto opt = optim::make_optimizer(optimizer, model->parameters());
  Reference ref;
  ::testing::Weights before = ::testing::flat_weights(sorted(model->state_dict()));
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = global_batch(s);
    opt->zero_grad();
    Tensor loss = ce((*model)(b.x), b.y);
    loss.backward();
    ref.grad_l2.push_back(grad_norm(*model));
    opt->step();
    ref.losses.push_back(loss.item());
    ::testing::Weights after = ::testing::flat_weights(sorted(model->state_dict()));
    ref.path += ::testing::l2_distance(after, before);
    before = std::move(after);
  }
  ref.weights = sorted(model->state_dict());
  return ref;
}

// The same steps through a Booster with `config` on the GPU, each rank on its rows; the whole model as
// the plugin saves it (gathered from the shards for ZeRO-3).
struct Run {
  std::map<std::string, Tensor> weights;
  std::vector<double> losses;  // the mean over the ranks
  std::string backend;
};
Run train_boosted(BoosterConfig config, const json& optimizer) {
  config.device = "cuda:" + std::to_string(my_gpu().index);
  Booster booster(config);
  nn::ModulePtr model = nn::make_model(kMlp, 7);
  model->to(my_gpu());
  auto b = booster.boost(model, optim::make_optimizer(optimizer, model->parameters()), ce);
  Run out;
  for (int s = 0; s < kSteps; ++s) {
    const Batch rows = rows_of(global_batch(s), world().rank(), world().size());
    b.optimizer->zero_grad();
    Tensor loss = b.criterion((*b.model)(rows.x), rows.y);
    booster.backward(loss, *b.optimizer);
    b.optimizer->step();
    Tensor mean = full({1}, loss.item() / world().size(), DType::Float64);
    world().all_reduce(mean);
    out.losses.push_back(mean.item());
  }
  out.backend = booster.plugin().process_group().backend();
  const fs::path dir = shared_dir("model");
  booster.save_model(*b.model, dir);
  world().barrier();
  out.weights = sorted(checkpoint::load_model(dir));
  world().barrier();
  if (world().rank() == 0) fs::remove_all(dir);
  return out;
}

}  // namespace

// float32 under SGD with momentum: the whole model within sgd_bound of the reference's path, each loss
// within the forward's roundoff plus the weights' share.
TEST_CASE("ddp and ZeRO 1, 2, 3 on CUDA tensors train as one process on the GPU", "[mpi][cuda]") {
  if (::testing::skip_without_gpu()) return;
  gpu_group();
  const json sgd = {{"type", "sgd"}, {"lr", 0.05}, {"momentum", 0.9}};
  const Reference ref = train_reference(sgd);
  const double forward = ro::mlp_forward_length({double(kIn), 64, 64}, double(kClasses), double(kBatch));
  const double params = double(nn::make_model(kMlp, 7)->num_parameters());
  const double eps_gradient = ro::reduction_bound({2 * forward, double(kBatch), params});
  const double bound = ro::sgd_bound(ref.path, eps_gradient, 0.9);
  const std::vector<std::pair<std::string, BoosterConfig>> configs = {
      {"ddp", {.plugin = "ddp", .plugin_options = {{"bucket_cap_mb", 0.01}}}},
      {"zero 1", {.plugin = "low_level_zero", .plugin_options = {{"stage", 1}, {"precision", "fp32"}}}},
      {"zero 2", {.plugin = "low_level_zero", .plugin_options = {{"stage", 2}, {"precision", "fp32"}}}},
      {"zero 3", {.plugin = "low_level_zero", .plugin_options = {{"stage", 3}, {"precision", "fp32"}}}}};
  for (const auto& [name, config] : configs) {
    INFO(name);
    const Run run = train_boosted(config, sgd);
    CHECK(run.backend == world().backend() + " (staged)");
    REQUIRE(run.weights.size() == ref.weights.size());
    const double diff = ::testing::l2_distance(::testing::flat_weights(run.weights), ::testing::flat_weights(ref.weights));
    INFO("|difference| " << diff << ", bound " << bound << ", path " << ref.path);
    if (world().rank() == 0)
      std::printf("%-7s fp32 SGD: |w - w_single| = %.3g, bound %.3g (path %.3g)\n", name.c_str(), diff, bound, ref.path);
    CHECK(diff <= bound);
    CHECK(ref.path > 0.1);  // it trained: the bound is not vacuous
    // Each loss: the forward's roundoff plus, to first order, |g|_2 times the weights' bound.
    for (int s = 0; s < kSteps; ++s) {
      INFO("step " << s);
      CHECK(std::abs(run.losses[size_t(s)] - ref.losses[size_t(s)]) <=
            ro::reduction_bound({forward}) * std::abs(ref.losses[size_t(s)]) + ref.grad_l2[size_t(s)] * bound);
    }
  }
}

// bfloat16 autocast under AdamW: each weight within Adam's drift bound of one process's bf16 run, which
// holds whatever the rounding (Note [Roundoff bounds], step 4), and well inside it on the whole.
TEST_CASE("ddp under bf16 on CUDA tensors stays within Adam's drift of one process on the GPU", "[mpi][cuda]") {
  if (::testing::skip_without_gpu()) return;
  gpu_group();
  const double lr = 1e-3;
  const json adamw = {{"type", "adamw"}, {"lr", lr}};
  // One process, the whole batch, the same strategy.
  Booster single(BoosterConfig{.mixed_precision = "bf16", .device = "cuda:" + std::to_string(my_gpu().index)});
  nn::ModulePtr model = nn::make_model(kMlp, 7);
  model->to(my_gpu());
  const std::map<std::string, Tensor> initial = sorted(model->state_dict());
  auto r = single.boost(model, optim::make_optimizer(adamw, model->parameters()), ce);
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = global_batch(s);
    r.optimizer->zero_grad();
    single.backward(r.criterion((*r.model)(b.x), b.y), *r.optimizer);
    r.optimizer->step();
  }
  const std::map<std::string, Tensor> want = sorted(r.model->state_dict());
  const Run run = train_boosted({.mixed_precision = "bf16", .plugin = "ddp"}, adamw);
  CHECK(run.backend == world().backend() + " (staged)");
  const double drift = ro::adam_drift_bound(lr, kSteps, 0.9, 0.999);
  const ::testing::Weights got = ::testing::flat_weights(run.weights), ref = ::testing::flat_weights(want),
                           start = ::testing::flat_weights(initial);
  double largest = 0;
  for (size_t i = 0; i < got.size(); ++i) largest = std::max(largest, std::abs(got[i] - ref[i]));
  // A sanity check only: Adam's drift bound holds whatever the gradients (Note [Roundoff bounds], step
  // 4). What can fail is the L2 check below it.
  INFO("largest difference " << largest << ", drift bound " << drift);
  if (world().rank() == 0)
    std::printf("ddp bf16 AdamW: max |w - w_single| = %.3g, drift bound %.3g; L2 %.3g of %.3g trained\n", largest,
                drift, ::testing::l2_distance(got, ref), ::testing::l2_distance(ref, start));
  CHECK(largest <= drift);
  // A detection threshold, not a roundoff bound (the drift bound above is that): a gradient lost in the
  // staged all-reduce leaves its parameter where it started, so the L2 difference is at least that
  // parameter's share of the distance trained, above 10% for any tensor holding 1% of its square.
  CHECK(::testing::l2_distance(got, ref) <= 0.1 * ::testing::l2_distance(ref, start));
}

// tp 2 x pp 2 on four ranks of one GPU against one process on it: a GPT under SGD with momentum, the
// saved (gathered) model within sgd_bound, every step's loss within its bound.
TEST_CASE("hybrid tp 2 x pp 2 on CUDA tensors trains a GPT as one process on the GPU", "[mpi][cuda][hybrid]") {
  if (::testing::skip_without_gpu()) return;
  if (world().size() != 4) {
    skip_test("hybrid tp 2 x pp 2 needs 4 ranks (mpirun -np 4 test_mpi_cuda \"[hybrid]\")");
    return;
  }
  gpu_group();
  nn::GPTConfig cfg;
  cfg.vocab_size = 32;
  cfg.context = 8;
  cfg.width = 16;
  cfg.layers = 4;
  cfg.heads = 4;
  auto gpt_loss = [](const Tensor& logits, const Tensor& y) {
    return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
  };
  std::vector<std::pair<Tensor, Tensor>> batches;
  Generator gen(21);
  for (int s = 0; s < kSteps; ++s) {
    const Tensor ids = randint(0, cfg.vocab_size, {8, cfg.context}, &gen);
    batches.emplace_back(ids.to(my_gpu()), randint(0, cfg.vocab_size, {8, cfg.context}, &gen).to(my_gpu()));
  }
  const json sgd = {{"type", "sgd"}, {"lr", 0.1}, {"momentum", 0.9}};
  // The reference.
  auto reference = std::make_shared<nn::GPT>(cfg, 5);
  reference->to(my_gpu());
  auto ref_opt = optim::make_optimizer(sgd, reference->parameters());
  std::vector<double> ref_losses, ref_grad_l2;
  double path = 0;
  ::testing::Weights before = ::testing::flat_weights(sorted(reference->state_dict()));
  for (const auto& [x, y] : batches) {
    ref_opt->zero_grad();
    Tensor loss = gpt_loss((*reference)(x), y);
    loss.backward();
    ref_grad_l2.push_back(grad_norm(*reference));
    ref_opt->step();
    ref_losses.push_back(loss.item());
    ::testing::Weights after = ::testing::flat_weights(sorted(reference->state_dict()));
    path += ::testing::l2_distance(after, before);
    before = std::move(after);
  }
  // The hybrid run.
  Booster booster(BoosterConfig{.plugin = "hybrid_parallel",
                                .plugin_options = {{"tp_size", 2}, {"pp_size", 2}, {"num_microbatches", 2}},
                                .device = "cuda:" + std::to_string(my_gpu().index)});
  auto whole = std::make_shared<nn::GPT>(cfg, 5);
  whole->to(my_gpu());
  auto b = booster.boost(whole, optim::make_optimizer(sgd, whole->parameters()), gpt_loss);
  CHECK(booster.plugin().process_group().backend() == world().backend() + " (staged)");
  const double forward = ro::gpt_forward_length(double(cfg.width), double(cfg.layers), double(cfg.heads),
                                                double(cfg.context), double(cfg.vocab_size), 8);
  const double eps_gradient =
      ro::reduction_bound({2 * forward, 8.0 * double(cfg.context), double(reference->num_parameters())});
  const double bound = ro::sgd_bound(path, eps_gradient, 0.9);
  for (size_t s = 0; s < batches.size(); ++s) {
    b.optimizer->zero_grad();
    const double loss =
        booster.execute_pipeline(batches[s].first, batches[s].second, *b.model, b.criterion, *b.optimizer);
    b.optimizer->step();
    Tensor mean = full({1}, loss / world().size(), DType::Float64);
    world().all_reduce(mean);  // every rank of the replica holds its part's loss; their mean is the batch's
    INFO("step " << s);
    CHECK(std::abs(mean.item() - ref_losses[s]) <=
          ro::reduction_bound({forward}) * std::abs(ref_losses[s]) + ref_grad_l2[s] * bound);
  }
  const fs::path dir = shared_dir("hybrid");
  booster.save_model(*b.model, dir);
  world().barrier();
  const ::testing::Weights got = ::testing::flat_weights(sorted(checkpoint::load_model(dir)));
  const ::testing::Weights want = ::testing::flat_weights(sorted(reference->state_dict()));
  REQUIRE(got.size() == want.size());
  INFO("|difference| " << ::testing::l2_distance(got, want) << ", bound " << bound << ", path " << path);
  if (world().rank() == 0)
    std::printf("hybrid tp 2 x pp 2 fp32 SGD: |w - w_single| = %.3g, bound %.3g (path %.3g)\n",
                ::testing::l2_distance(got, want), bound, path);
  CHECK(::testing::l2_distance(got, want) <= bound);
  CHECK(path > 0.1);
  world().barrier();
  if (world().rank() == 0) fs::remove_all(dir);
}
