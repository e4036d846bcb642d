// The hybrid_parallel plugin measured on the character GPT (issue 16's figures, bench/README.md):
//   memory    per-rank parameter + gradient + optimizer bytes of tp 2, pp 2 and zero_stage 1 against a
//             whole replica
//   resident  per-rank tensor memory (peak over build, boost and one step, and held after it) with the
//             model built eagerly and deferred (LazyInitGuard); tp 2 x pp 2 too under -np 4
//   bubble  each pipeline stage's idle fraction (time waiting for messages / step) for M = 1, 4, 8
//           micro-batches against (P - 1) / (M + P - 1)
//   step    step time of tp 2 against ddp on the same ranks, and the tensor-parallel collectives'
//           share of the step (timed inside them); ddp's share from one process at the per-rank batch
//
//   OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
//     mpirun -np 2 --oversubscribe build/bin/bench_hybrid memory|resident|bubble|step   (one command line)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "booster/booster/booster.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/models.h"
#include "booster/nn/pipeline.h"
#include "booster/nn/tensor_parallel.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/deferred.h"
#include "booster/tensor/random.h"

using namespace booster;
using nlohmann::json;

namespace {

distributed::ProcessGroup& world() { return distributed::init_process_group("mpi"); }

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

nn::GPTConfig gpt_config() {
  nn::GPTConfig c;
  c.vocab_size = 256;
  c.context = 64;
  c.width = 256;
  c.layers = 4;
  c.heads = 4;
  return c;
}

const json kAdamW = {{"type", "adamw"}, {"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.1}};

Tensor gpt_loss(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

std::pair<Tensor, Tensor> batch(int64_t rows, uint64_t seed) {
  Generator gen(seed);
  const Tensor x = randint(0, 256, {rows, 64}, &gen);
  return {x, randint(0, 256, {rows, 64}, &gen)};
}

double max_over_ranks(double v) {
  Tensor t = full({1}, v, DType::Float64);
  world().all_reduce(t, distributed::ReduceOp::Max);
  return t.item();
}

// Mean step time (seconds) of `steps` steps after 2 warm-up steps, slowest rank.
template <class Step>
double time_steps(int steps, Step&& step) {
  for (int s = 0; s < 2; ++s) step(s);
  world().barrier();
  const double t0 = now();
  for (int s = 0; s < steps; ++s) step(2 + s);
  world().barrier();
  return max_over_ranks((now() - t0) / steps);
}

void memory() {
  if (world().rank() == 0)
    std::printf("| layout | ranks | parameters MiB | gradients MiB | optimizer MiB | total MiB | vs one replica |\n"
                "|---|---:|---:|---:|---:|---:|---:|\n");
  double whole = 0;
  for (const auto& [name, tp, pp, zero] : std::vector<std::tuple<std::string, int, int, int>>{
           {"replica (dp)", 1, 1, 0}, {"tp 2", 2, 1, 0}, {"pp 2", 1, 2, 0}, {"dp zero_stage 1", 1, 1, 1}}) {
    Booster booster(BoosterConfig{
        .plugin = "hybrid_parallel",
        .plugin_options = {{"tp_size", tp}, {"pp_size", pp}, {"num_microbatches", 2}, {"zero_stage", zero}}});
    auto gpt = std::make_shared<nn::GPT>(gpt_config(), 1);
    Boosted b = booster.boost(gpt, optim::make_optimizer(kAdamW, gpt->parameters()), gpt_loss);
    const auto [x, y] = batch(8, 3);
    b.optimizer->zero_grad();
    booster.execute_pipeline(x, y, *b.model, b.criterion, *b.optimizer);
    b.optimizer->step();
    double params = 0, grads = 0, state = 0;
    for (const Tensor& p : b.model->parameters()) {
      params += double(p.nbytes());
      if (p.grad().defined()) grads += double(p.grad().nbytes());  // in a flat buffer or not
    }
    const optim::Optimizer& opt = b.optimizer->stepped_optimizer();
    for (const auto& [key, t] : opt.state_dict().tensors) state += double(t.nbytes());
    const double mib = 1024.0 * 1024.0;
    params = max_over_ranks(params) / mib;
    grads = max_over_ranks(grads) / mib;
    state = max_over_ranks(state) / mib;
    const double total = params + grads + state;
    if (tp == 1 && pp == 1 && zero == 0) whole = total;
    if (world().rank() == 0)
      std::printf("| %s | %d | %.2f | %.2f | %.2f | %.2f | %.3f |\n", name.c_str(), world().size(), params, grads,
                  state, total, total / whole);
  }
}

// Tensor memory (bytes held by live storages, cpu_bytes_in_use) of a rank: the peak from building the
// model to the end of its first step, and what is held after it (the parts, their gradients and
// optimizer state, plus whatever of the whole model is still alive).
void resident() {
  if (world().rank() == 0)
    std::printf("| layout | ranks | build | whole model MiB | peak MiB | held after step MiB |\n"
                "|---|---:|---|---:|---:|---:|\n");
  std::vector<std::tuple<std::string, int, int>> layouts = {{"replica (dp)", 1, 1}, {"tp 2", 2, 1}, {"pp 2", 1, 2}};
  if (world().size() == 4) layouts = {{"tp 2 x pp 2", 2, 2}};
  const auto [x, y] = batch(8, 3);
  for (const auto& [name, tp, pp] : layouts)
    for (bool deferred : {false, true}) {
      Booster booster(BoosterConfig{.plugin = "hybrid_parallel",
                                    .plugin_options = {{"tp_size", tp}, {"pp_size", pp}, {"num_microbatches", 2}}});
      world().barrier();
      reset_cpu_peak_bytes();
      const double base = double(cpu_bytes_in_use());
      nn::ModulePtr gpt;
      {
        std::optional<LazyInitGuard> lazy;
        if (deferred) lazy.emplace();
        gpt = std::make_shared<nn::GPT>(gpt_config(), 1);
      }
      const double whole = double(gpt->num_parameters()) * 4.0;
      Boosted b = booster.boost(gpt, optim::make_optimizer(kAdamW, gpt->parameters()), gpt_loss);
      b.optimizer->zero_grad();
      booster.execute_pipeline(x, y, *b.model, b.criterion, *b.optimizer);
      b.optimizer->step();
      const double mib = 1024.0 * 1024.0;
      const double peak = max_over_ranks(double(cpu_peak_bytes()) - base) / mib;
      const double held = max_over_ranks(double(cpu_bytes_in_use()) - base) / mib;
      if (world().rank() == 0)
        std::printf("| %s | %d | %s | %.2f | %.2f | %.2f |\n", name.c_str(), world().size(),
                    deferred ? "deferred" : "eager", whole / mib, peak, held);
    }
}

void bubble() {
  const int stages = world().size();
  if (world().rank() == 0)
    std::printf("| M | stage | step ms | idle ms | idle fraction | (P-1)/(M+P-1) |\n|---:|---:|---:|---:|---:|---:|\n");
  for (int m : {1, 4, 8}) {
    auto gpt = std::make_shared<nn::GPT>(gpt_config(), 1);
    nn::pp::PipelineStage stage(nn::pp::gpt_stage(gpt, world().rank(), stages), world(),
                                {nn::pp::Schedule::OneFOneB, m});
    const auto [x, y] = batch(32, 5);
    double idle = 0;
    const int steps = 8;
    const double step = time_steps(steps, [&](int s) {
      stage.module().zero_grad();
      stage.train_step(x, y, gpt_loss);
      if (s >= 2) idle += stage.last_wait_seconds();
    });
    idle /= steps;
    for (int r = 0; r < stages; ++r) {
      Tensor t = full({1}, idle, DType::Float64);
      world().broadcast(t, r);
      if (world().rank() == 0)
        std::printf("| %d | %d | %.1f | %.1f | %.3f | %.3f |\n", m, r, step * 1e3, t.item() * 1e3, t.item() / step,
                    double(stages - 1) / double(m + stages - 1));
    }
  }
}

void step_time() {
  const int64_t global = 16;
  const int steps = 10;
  if (world().rank() == 0) std::printf("| setup | ranks | step ms | communication ms | share |\n|---|---:|---:|---:|---:|\n");
  auto run = [&](const std::string& plugin, json options, int64_t rows, bool print, const char* label) {
    Booster booster(BoosterConfig{.plugin = plugin, .plugin_options = std::move(options)});
    auto gpt = std::make_shared<nn::GPT>(gpt_config(), 1);
    Boosted b = booster.boost(gpt, optim::make_optimizer(kAdamW, gpt->parameters()), gpt_loss);
    const auto [x, y] = batch(rows, 7);
    const double comm0 = nn::tp::communication_seconds();
    double comm_steps = 0;
    const double t = time_steps(steps, [&](int s) {
      const double c0 = nn::tp::communication_seconds();
      b.optimizer->zero_grad();
      booster.backward(b.criterion((*b.model)(x), y), *b.optimizer);
      b.optimizer->step();
      if (s >= 2) comm_steps += nn::tp::communication_seconds() - c0;
    });
    (void)comm0;
    const double comm = max_over_ranks(comm_steps / steps);
    if (print && world().rank() == 0)
      std::printf("| %s | %d | %.1f | %s | %s |\n", label, world().size(), t * 1e3,
                  comm > 0 ? std::to_string(comm * 1e3).substr(0, 6).c_str() : "-",
                  comm > 0 ? std::to_string(comm / t).substr(0, 5).c_str() : "-");
    return t;
  };
  run("hybrid_parallel", {{"tp_size", world().size()}}, global, true, "tp (batch 16 on every rank)");
  const double ddp = run("ddp", json::object(), global / world().size(), true, "ddp (batch 16 / ranks each)");
  // One process's step at ddp's per-rank batch: ddp's step less this is its communication (and waiting).
  if (world().rank() == 0) {
    Booster single(BoosterConfig{});
    auto gpt = std::make_shared<nn::GPT>(gpt_config(), 1);
    Boosted b = single.boost(gpt, optim::make_optimizer(kAdamW, gpt->parameters()), gpt_loss);
    const auto [x, y] = batch(global / world().size(), 7);
    double t0 = 0;
    for (int s = 0; s < 2 + steps; ++s) {
      if (s == 2) t0 = now();
      b.optimizer->zero_grad();
      single.backward(b.criterion((*b.model)(x), y), *b.optimizer);
      b.optimizer->step();
    }
    const double t = (now() - t0) / steps;
    std::printf("| one process, ddp's per-rank batch | 1 | %.1f | %.1f (ddp less this) | %.3f |\n", t * 1e3,
                (ddp - t) * 1e3, (ddp - t) / ddp);
  }
  world().barrier();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "memory";
  if (what == "memory") memory();
  else if (what == "resident") resident();
  else if (what == "bubble") bubble();
  else if (what == "step") step_time();
  else {
    std::fprintf(stderr, "usage: bench_hybrid memory|resident|bubble|step\n");
    return 2;
  }
  return 0;
}
