// A stop signal that reaches one rank only (a scheduler that signals one process, a kill by pid), under
// `mpirun -np 2`: Note [Stopping on a signal] agrees the request over the group, so every rank stops
// after the same step, the checkpoint of that step is whole (every rank took part in its collective
// save), and a resume from it ends with the bytes of an uninterrupted run.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/data/data.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"
#include "booster/trainer/trainer.h"

using namespace booster;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

distributed::ProcessGroup& world() { return distributed::init_process_group("mpi"); }

// A directory every rank names alike (rank 0 draws the suffix).
fs::path shared_dir(const std::string& tag) {
  Tensor n = full({1}, double(std::random_device{}() % 1000000), DType::Int64);
  world().broadcast(n, 0);
  return fs::temp_directory_path() / ("booster_mpi_signal_" + tag + "_" + std::to_string(n.to_vector<int64_t>()[0]));
}

data::DatasetPtr points(int64_t n = 96) {
  Generator gen(11);
  std::vector<float> x(static_cast<size_t>(n * 6)), y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    y[size_t(i)] = float(i % 3);
    for (int64_t j = 0; j < 6; ++j) x[size_t(i * 6 + j)] = float(gen.normal() + (j == i % 3 ? 2.0 : 0.0));
  }
  return std::make_shared<data::TensorDataset>(from_vector(x, {n, 6}), from_vector(y, {n}).to(DType::Int64));
}

// The MLP, raising SIGTERM in this process during its forward number `signal_at` (0: never): the
// signal then arrives mid-step on this rank only, as a scheduler's kill by pid would.
class SignalAt : public nn::Module {
 public:
  explicit SignalAt(int signal_at) : signal_at_(signal_at) {
    inner_ = register_module("mlp", nn::make_model({{"type", "mlp"}, {"in", 6}, {"hidden", {12}}, {"classes", 3}}, 7));
  }
  Tensor forward(const Tensor& x) override {
    if (++calls_ == signal_at_) std::raise(SIGTERM);
    return (*inner_)(x);
  }
  std::string name() const override { return "SignalAt"; }

 private:
  nn::ModulePtr inner_;
  int signal_at_, calls_ = 0;
};

std::unique_ptr<Booster> ddp_booster(int signal_at = 0) {
  manual_seed(3);
  auto booster = std::make_unique<Booster>(BoosterConfig{.plugin = "ddp"});
  auto model = std::make_shared<SignalAt>(signal_at);
  auto adamw = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", 0.01}});
  auto loader = booster->prepare_dataloader(points(), {.batch_size = 8, .shuffle = true, .seed = 9});
  booster->boost(model, adamw, [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); }, loader);
  return booster;
}

TrainerOptions options(const fs::path& dir) {
  TrainerOptions o;
  o.epochs = 2;  // 6 steps an epoch on each of 2 ranks
  o.checkpoint_every = 100;
  o.keep_last = 0;
  o.checkpoint_dir = dir;
  o.progress = trainer::Progress::Mode::Silent;
  return o;
}

std::vector<double> params(Booster& booster) {
  std::vector<double> out;
  for (const Tensor& p : booster.boosted().model->parameters())
    for (double v : p.tolist()) out.push_back(v);
  return out;
}

}  // namespace

TEST_CASE("a SIGTERM that reaches one rank stops every rank after the same step, saved whole", "[mpi][signal]") {
  REQUIRE(world().size() == 2);
  // Ranks that disagree on the stop would wait in each other's collectives: fail in a minute, not 30.
  distributed::set_default_collective_timeout(std::chrono::seconds(60));
  const fs::path whole_dir = shared_dir("whole"), parts_dir = shared_dir("parts");
  auto whole = ddp_booster();
  Trainer(*whole, options(whole_dir)).fit();

  {
    // Only rank 1 is signalled, during step 4's forward.
    auto first = ddp_booster(world().rank() == 1 ? 4 : 0);
    Trainer trainer(*first, options(parts_dir));
    try {
      trainer.fit();
      FAIL("fit() should have stopped on rank " << world().rank());
    } catch (const InterruptedError& e) {
      CHECK(e.signal() == SIGTERM);
      CHECK_THAT(e.what(), Catch::Contains("after step 4 of 12") && Catch::Contains("step-00000004"));
    }
  }
  world().barrier();
  const auto saved = checkpoint::list_checkpoints(parts_dir);
  REQUIRE(saved.size() == 1);
  CHECK(saved.front().first == 4);

  auto second = ddp_booster();
  TrainerOptions resumed = options(parts_dir);
  resumed.resume = "latest";
  const FitResult result = Trainer(*second, resumed).fit();
  REQUIRE(result.resumed_from.has_value());
  CHECK(result.steps == 12);
  CHECK(params(*second) == params(*whole));
  world().barrier();
  if (world().rank() == 0) {
    fs::remove_all(whole_dir);
    fs::remove_all(parts_dir);
  }
}
