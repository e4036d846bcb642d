// How much of a ddp training step is spent waiting on the gradient all-reduce, with and without
// overlapping it with backward. Run with 2 ranks under mpirun, or under torchrun's variables over the
// tcp group (bench/ddp_comm.sh, BOOSTER_BENCH_GROUP=tcp):
//
//   mpirun -np 2 build/bin/bench_ddp_comm [--steps 30] [--warmup 5] [--batch 128] [--caps 25,1,0.25]
//
// Workload: MLP 784-1024-1024-10 (1.86 M float32 parameters, 7.5 MB of gradients), cross entropy,
// AdamW, fp32, `--batch` samples per rank. Modes:
//   no overlap   backward with gradient sync off (no hooks launch anything), then ONE blocking
//                all-reduce (Avg) of the whole flat gradient, then the optimizer step;
//   overlap cap  the ddp plugin: buckets of `cap` MiB launched from the grad-ready hooks while backward
//                runs, waited before the step; first with progress_thread false (only the hooks poll
//                the buckets in flight), then as users get it by default, with the progress thread
//                (which also polls during the GEMMs).
// Per step we time the whole step (zero_grad, forward, backward, step) and the time blocked on
// communication (no overlap: the all-reduce; overlap: GradientBucketer::wait, which the step calls).
// Printed: medians over steps on rank 0, and the share wait / step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "booster/plugin/parallel_plugin.h"
#include "booster/distributed/bucket.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/plugin/loader.h"
#include "booster/tensor/random.h"

using namespace booster;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

std::shared_ptr<ParallelPlugin> load_ddp(const json& options) {
  std::shared_ptr<plugin::Plugin> library = plugin::load(plugin::kParallelKind, "ddp");
  auto* factory = reinterpret_cast<ParallelFactory*>(library->symbol("booster_create_parallel"));
  return plugin::bind(library, std::shared_ptr<ParallelPlugin>(factory(options)));
}

struct Result {
  std::string mode;
  double step_ms, wait_ms;
  int64_t buckets, launched_in_hooks;
};

// cap_mb <= 0: the no-overlap mode.
Result run(double cap_mb, bool progress_thread, int64_t batch, int steps, int warmup) {
  distributed::ProcessGroup& pg = distributed::default_process_group();
  auto plugin = load_ddp({{"bucket_cap_mb", cap_mb > 0 ? cap_mb : 25.0}, {"progress_thread", progress_thread}});
  nn::ModulePtr model = nn::make_model({{"type", "mlp"}, {"in", 784}, {"hidden", {1024, 1024}}, {"classes", 10}}, 1);
  auto optimizer = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", 1e-3}});
  TrainingParts parts;
  parts.model = model;
  parts.optimizer = optimizer;
  parts.criterion = [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
  parts.precision = mixed_precision::create("fp32");
  parts = plugin->configure(parts);
  const auto* owner = dynamic_cast<const distributed::GradientBucketerOwner*>(parts.precision.get());
  const distributed::GradientBucketer& bucketer = owner->gradient_bucketer();
  const bool overlap = cap_mb > 0;
  if (!overlap) plugin->set_gradient_sync(false);
  const Tensor grads = parts.optimizer->flat_buffers(0)[0]->grad();

  Generator gen(100 + uint64_t(pg.rank()));
  const Tensor x = randn({batch, 784}, &gen);
  const Tensor y = randint(0, 10, {batch}, &gen);
  std::vector<double> step_s, wait_s;
  int64_t launched_in_hooks = 0;
  for (int i = 0; i < warmup + steps; ++i) {
    pg.barrier();  // steps start together: waiting measures communication, not the previous step's skew
    const double waited_before = bucketer.stats().wait_seconds;
    const auto start = Clock::now();
    double comm = 0;
    parts.optimizer->zero_grad();
    Tensor loss = parts.criterion((*parts.model)(x), y);
    parts.precision->backward(loss, *parts.optimizer);
    if (!overlap) {
      const auto comm_start = Clock::now();
      pg.all_reduce(distributed::BufferSpan::of(grads), distributed::ReduceOp::Avg);
      comm = seconds_since(comm_start);
    }
    parts.precision->step(*parts.optimizer);
    const double total = seconds_since(start);
    if (overlap) comm = bucketer.stats().wait_seconds - waited_before;
    if (i >= warmup) {
      step_s.push_back(total);
      wait_s.push_back(comm);
      launched_in_hooks = bucketer.stats().last_launched_in_hooks;
    }
  }
  std::ostringstream mode;
  if (overlap)
    mode << (progress_thread ? "overlap + progress thread" : "overlap, hooks poll") << ", bucket_cap_mb " << cap_mb;
  else
    mode << "no overlap (one all-reduce after backward)";
  return {mode.str(), 1e3 * median(step_s), 1e3 * median(wait_s),
          overlap ? int64_t(bucketer.buckets().size()) : 1, overlap ? launched_in_hooks : 0};
}

// The blocking all-reduce (Avg) of `numel` float32 alone, after a barrier: what the communication
// costs with nothing to overlap it with (the 1.86 M gradients; one element, as a found-inf flag).
double bare_all_reduce_ms(int64_t numel, int steps, int warmup) {
  distributed::ProcessGroup& pg = distributed::default_process_group();
  Tensor buffer = zeros({numel});
  std::vector<double> times;
  for (int i = 0; i < warmup + steps; ++i) {
    pg.barrier();
    const auto start = Clock::now();
    pg.all_reduce(buffer, distributed::ReduceOp::Avg);
    if (i >= warmup) times.push_back(seconds_since(start));
  }
  return 1e3 * median(times);
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 30, warmup = 5;
  int64_t batch = 128;
  std::vector<double> caps = {25, 1, 0.25};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_ddp_comm: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--steps") {
      steps = std::stoi(value());
    } else if (arg == "--warmup") {
      warmup = std::stoi(value());
    } else if (arg == "--batch") {
      batch = std::stoll(value());
    } else if (arg == "--caps") {
      caps.clear();
      std::stringstream list(value());
      for (std::string item; std::getline(list, item, ',');) caps.push_back(std::stod(item));
    } else {
      std::fprintf(stderr, "bench_ddp_comm: unknown argument '%s'; use --steps N --warmup N --batch N --caps a,b\n",
                   arg.c_str());
      return 2;
    }
  }
  distributed::ProcessGroup& pg = distributed::init_process_group("auto");
  const double bare_ms = bare_all_reduce_ms(784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10, steps, warmup);
  const double tiny_ms = bare_all_reduce_ms(1, 10 * steps, warmup);
  std::vector<Result> results;
  results.push_back(run(0, false, batch, steps, warmup));
  for (double cap : caps) results.push_back(run(cap, false, batch, steps, warmup));
  for (double cap : caps) results.push_back(run(cap, true, batch, steps, warmup));
  if (pg.rank() == 0) {
    std::printf("ddp on %d ranks (%s group), MLP 784-1024-1024-10, fp32 AdamW, batch %lld per rank, median of %d "
                "steps\n", pg.size(), pg.backend().c_str(), static_cast<long long>(batch), steps);
    std::printf("the all-reduce alone (7.5 MB float32, blocking, after a barrier): %.2f ms\n", bare_ms);
    std::printf("the all-reduce of one float32 (blocking, after a barrier): %.3f ms\n", tiny_ms);
    std::printf("%-58s %8s %8s %7s %8s %10s\n", "mode", "step ms", "wait ms", "wait %", "buckets", "in hooks");
    for (const Result& r : results)
      std::printf("%-58s %8.2f %8.2f %6.1f%% %8lld %10lld\n", r.mode.c_str(), r.step_ms, r.wait_ms,
                  100.0 * r.wait_ms / r.step_ms, static_cast<long long>(r.buckets),
                  static_cast<long long>(r.launched_in_hooks));
  }
  return 0;
}
