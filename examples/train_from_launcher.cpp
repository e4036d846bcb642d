// A training loop whose precision and parallelism the launcher picks, as `accelerate launch
// --mixed_precision bf16` picks them for an Accelerator(): the program names neither.
//
//   build/bin/booster run -n 2 --mixed-precision bf16 --plugin ddp -- build/bin/train_from_launcher
//   build/bin/train_from_launcher                  # one process, fp32: the defaults
//   build/bin/train_from_launcher --steps 50
//
// BoosterConfig::from_env() reads what `booster run` exported (BOOSTER_MIXED_PRECISION, BOOSTER_PLUGIN;
// Note [Switching by launcher]); booster::print_main prints from rank 0 only, so each line appears once
// however many processes run. The last line is JSON: {"mixed_precision", "plugin", "processes",
// "steps", "final_loss"}. Exits 0, 1 on an error, 2 on a bad option or name.
#include <booster/booster.h>

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace booster;

int main(int argc, char** argv) {
  int64_t steps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) {
      steps = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr, "train_from_launcher: unknown option %s (usage: train_from_launcher [--steps N])\n", a.c_str());
      return 2;
    }
  }
  try {
    manual_seed(0);
    Booster booster(BoosterConfig::from_env());
    // 8 features, 3 classes; a data-parallel plugin gives each rank its share of every batch.
    auto loader = booster.prepare_dataloader(data::synthetic_classification(512, 8, 3, /*seed=*/1),
                                             {.batch_size = 32, .shuffle = true, .seed = 0});
    auto mlp = std::make_shared<nn::MLPClassifier>(8, std::vector<int64_t>{32}, 3, "relu", /*seed=*/0);
    auto adamw = std::make_shared<optim::AdamW>(mlp->parameters(), nlohmann::json{{"lr", 1e-2}});
    nn::Criterion loss_fn = [](const Tensor& logits, const Tensor& labels) { return cross_entropy(logits, labels); };
    auto [model, optimizer, criterion, train_loader, scheduler] = booster.boost(mlp, adamw, loss_fn, loader);

    const BoosterConfig& config = booster.config();
    const std::string plugin = config.plugin.empty() ? "single" : config.plugin;
    const int processes = booster.process_group().size();
    print_main("mixed precision ", config.mixed_precision, ", plugin ", plugin, ", ", processes,
               processes == 1 ? " process" : " processes");
    int64_t step = 0;
    double last_loss = 0.0;
    for (int epoch = 0; step < steps; ++epoch) {
      train_loader->set_epoch(epoch);
      for (data::Batch& batch : *train_loader) {
        optimizer->zero_grad();
        Tensor loss = criterion((*model)(batch.x), batch.y);
        booster.backward(loss, *optimizer);
        optimizer->step();
        last_loss = loss.item();
        if (++step % 10 == 0) print_main("step ", step, " | loss ", last_loss);
        if (step == steps) break;
      }
    }
    print_main(nlohmann::json{{"mixed_precision", config.mixed_precision}, {"plugin", plugin},
                              {"processes", processes}, {"steps", step}, {"final_loss", last_loss}}
                   .dump());
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "train_from_launcher: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_from_launcher: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
