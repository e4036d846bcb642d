// What the Trainer costs over the loop a user writes by hand, on the two benchmark workloads.
//
//   build/bin/bench_trainer_overhead [--workload mlp|gpt] [--precision NAME] [--steps N] [--repeats R]
//
// Each repeat builds the same model, optimizer and data twice (seed 0) and trains `steps` steps once
// with the hand-written loop of README.md (zero_grad, forward, backward, step) and once with
// Trainer::fit (progress silent, no evaluation, no files), alternating which goes first so drift in the
// machine's load hits both alike. Both read the same batches through a boosted DataLoader. Prints one
// JSON line: the median seconds per step of each and overhead = trainer / hand-written - 1.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/data/data.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/trainer/trainer.h"

using namespace booster;
using Clock = std::chrono::steady_clock;

namespace {

struct Setup {
  std::unique_ptr<Booster> booster;
};

// The `booster bench` workloads: an MLP 784-1024-1024-10 at batch 256, a GPT (256 vocab, 128 context,
// width 256, 4 layers) at batch 8; `steps` batches of random data.
Setup make(const std::string& workload, const std::string& precision, int64_t steps) {
  manual_seed(0);
  Setup s;
  s.booster = std::make_unique<Booster>(BoosterConfig{.mixed_precision = precision});
  Generator gen(0);
  nn::ModulePtr model;
  data::DatasetPtr dataset;
  int64_t batch = 0;
  if (workload == "mlp") {
    batch = 256;
    model = std::make_shared<nn::MLPClassifier>(784, std::vector<int64_t>{1024, 1024}, 10, "relu", 0);
    dataset = std::make_shared<data::TensorDataset>(randn({batch * steps, 784}, &gen), randint(0, 10, {batch * steps}, &gen));
  } else {
    batch = 8;
    model = std::make_shared<nn::GPT>(nn::GPTConfig{256, 128, 256, 4, 4, 0.0}, 0);
    dataset = std::make_shared<data::TensorDataset>(randint(0, 256, {batch * steps, 128}, &gen),
                                                    randint(0, 256, {batch * steps, 128}, &gen));
  }
  auto opt = std::make_shared<optim::AdamW>(model->parameters(), nlohmann::json{{"lr", 1e-3}});
  auto loader = s.booster->prepare_dataloader(dataset, {.batch_size = batch});
  nn::Criterion ce = [](const Tensor& out, const Tensor& y) {
    return out.dim() == 3 ? cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1})) : cross_entropy(out, y);
  };
  s.booster->boost(model, opt, ce, loader, nullptr);
  return s;
}

double hand_written(Setup& s) {
  Booster& booster = *s.booster;
  const Boosted& p = booster.boosted();
  const auto t0 = Clock::now();
  for (data::Batch& batch : *p.dataloader) {
    p.optimizer->zero_grad();
    Tensor loss = p.criterion((*p.model)(batch.x), batch.y);
    booster.backward(loss, *p.optimizer);
    p.optimizer->step();
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double with_trainer(Setup& s) {
  TrainerOptions o;
  o.progress = trainer::Progress::Mode::Silent;
  o.handle_signals = true;  // as a user gets it
  Trainer trainer(*s.booster, o);
  const auto t0 = Clock::now();
  trainer.fit();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  std::string workload = "mlp", precision = "fp32";
  int64_t steps = 40, repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--workload") workload = argv[i + 1];
    else if (a == "--precision") precision = argv[i + 1];
    else if (a == "--steps") steps = std::atoll(argv[i + 1]);
    else if (a == "--repeats") repeats = std::atoll(argv[i + 1]);
    else {
      std::fprintf(stderr, "bench_trainer_overhead: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  // One warm-up of each (allocator caches, thread pools), then the timed repeats.
  {
    Setup a = make(workload, precision, 4), b = make(workload, precision, 4);
    hand_written(a);
    with_trainer(b);
  }
  std::vector<double> hand, trained;
  for (int64_t r = 0; r < repeats; ++r) {
    Setup a = make(workload, precision, steps), b = make(workload, precision, steps);
    if (r % 2 == 0) {
      hand.push_back(hand_written(a) / double(steps));
      trained.push_back(with_trainer(b) / double(steps));
    } else {
      trained.push_back(with_trainer(b) / double(steps));
      hand.push_back(hand_written(a) / double(steps));
    }
  }
  const double h = median(hand), t = median(trained);
  std::cout << nlohmann::json{{"workload", workload}, {"precision", precision},   {"steps", steps},
                              {"repeats", repeats},   {"hand_written_s", h},      {"trainer_s", t},
                              {"overhead", t / h - 1.0}}
                   .dump()
            << std::endl;
  return 0;
}
