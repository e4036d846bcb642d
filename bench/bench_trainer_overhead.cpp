// What the Trainer costs over the loop a user writes by hand, on the two benchmark workloads.
//
//   build/bin/bench_trainer_overhead [--workload mlp|gpt] [--precision NAME] [--steps N] [--repeats R]
//                                    [--variants hand,trainer,...]
//
//   build/bin/bench_trainer_overhead --variants trainer_bare,trainer,every:100,every:1 --steps 200
//
// Each repeat builds the same model, optimizer and data (seed 0) for each variant and trains `steps`
// steps with it: "hand", the hand-written loop of README.md (zero_grad, forward, backward, step);
// "trainer", Trainer::fit with its defaults (progress silent, no evaluation, no files); "trainer_bare",
// fit without diagnostics; "every:N", fit with per-module statistics every N steps. The order rotates
// between repeats so drift in the machine's load hits all alike. All read the same batches through a
// boosted DataLoader. Prints one JSON line: the median seconds per step of each variant (`<v>_s`) and
// each one's overhead against the first (`<v>_overhead`; default variants hand,trainer).
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

// "trainer": the defaults (naming a skipped step's first non-finite tensor); "trainer_bare": no
// diagnostics at all; "every:N": per-module statistics every N steps as well.
double with_trainer(Setup& s, const std::string& variant) {
  TrainerOptions o;
  o.progress = trainer::Progress::Mode::Silent;
  o.handle_signals = true;  // as a user gets it
  if (variant == "trainer_bare") o.diagnostics.name_nonfinite = false;
  if (variant.rfind("every:", 0) == 0) o.diagnostics.every = std::atoll(variant.c_str() + 6);
  Trainer trainer(*s.booster, o);
  const auto t0 = Clock::now();
  trainer.fit();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

double run_variant(Setup& s, const std::string& variant) {
  return variant == "hand" ? hand_written(s) : with_trainer(s, variant);
}

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t comma; (comma = list.find(',', start)) != std::string::npos; start = comma + 1)
    out.push_back(list.substr(start, comma - start));
  out.push_back(list.substr(start));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string workload = "mlp", precision = "fp32", variant_list = "hand,trainer";
  int64_t steps = 40, repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--workload") workload = argv[i + 1];
    else if (a == "--precision") precision = argv[i + 1];
    else if (a == "--steps") steps = std::atoll(argv[i + 1]);
    else if (a == "--repeats") repeats = std::atoll(argv[i + 1]);
    else if (a == "--variants") variant_list = argv[i + 1];
    else {
      std::fprintf(stderr, "bench_trainer_overhead: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  const std::vector<std::string> variants = split_commas(variant_list);
  // One warm-up of each (allocator caches, thread pools), then the timed repeats, each in another
  // order (rotated) so drift in the machine's load hits all alike.
  for (const std::string& v : variants) {
    Setup a = make(workload, precision, 4);
    run_variant(a, v);
  }
  std::vector<std::vector<double>> seconds(variants.size());
  for (int64_t r = 0; r < repeats; ++r)
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = (k + size_t(r)) % variants.size();
      Setup a = make(workload, precision, steps);
      seconds[v].push_back(run_variant(a, variants[v]) / double(steps));
    }
  nlohmann::json out = {{"workload", workload}, {"precision", precision}, {"steps", steps}, {"repeats", repeats}};
  const double base = median(seconds[0]);
  for (size_t v = 0; v < variants.size(); ++v) {
    const double m = median(seconds[v]);
    out[variants[v] + "_s"] = m;
    if (v > 0) out[variants[v] + "_overhead"] = m / base - 1.0;
  }
  std::cout << out.dump() << std::endl;
  return 0;
}
