// Trains an MLP on Fashion-MNIST by hand, with the library's API and no config file: the same run as
// `booster train --config examples/configs/fashion_mnist_mlp.json`, written out so every step shows.
// The Booster injects the mixed-precision strategy (and would inject a parallel plugin) into an
// ordinary loop, so switching precision is one argument, not new code.
//
//   build/bin/train_fashion_mnist [DATA_DIR] [EPOCHS] [MIXED_PRECISION] [CHECKPOINT_DIR]
//   (defaults: /usr/share/datasets/fashion-mnist, 2 epochs, fp32, no checkpoints; Debian package
//   dataset-fashion-mnist)
//   build/bin/train_fashion_mnist /usr/share/datasets/fashion-mnist 1 bf16
//   build/bin/train_fashion_mnist /usr/share/datasets/fashion-mnist 3 fp16 runs/mnist   // run it again to resume
//
// With a CHECKPOINT_DIR the whole state is saved after every epoch (Booster::save_state: model,
// optimizer and loss scale, schedule, data position, random generators and the best accuracy so far),
// and a run started on a directory that holds a checkpoint continues from it. The Trainer
// (examples/train_with_trainer.cpp) does all of this, and more, in one call.
#include <algorithm>  // std::min: the last test batch
#include <chrono>   // steady_clock: throughput
#include <cstdio>   // printf: progress
#include <cstdlib>  // atoi
#include <string>
#include <vector>   // the test batch indices

#include "booster/autograd/autograd.h"     // NoGradGuard: evaluation records no graph
#include "booster/booster/booster.h"       // Booster, BoosterConfig: precision injected into the loop
#include "booster/data/data.h"             // DataLoader, DataLoaderOptions, Batch
#include "booster/data/fashion_mnist.h"    // load_fashion_mnist: the IDX files as tensors
#include "booster/nn/models.h"             // MLPClassifier: Linear/ReLU stack
#include "booster/ops/ops.h"               // cross_entropy, argmax, eq, sum
#include "booster/optim/lr_scheduler.h"    // CosineAnnealingLR: lr from 1e-3 down to 0 over the run
#include "booster/optim/optimizer.h"       // AdamW

using namespace booster;

int main(int argc, char** argv) {
  const std::string data_dir = argc > 1 ? argv[1] : data::kFashionMnistDir;
  const int epochs = argc > 2 ? std::atoi(argv[2]) : 2;
  const std::string precision = argc > 3 ? argv[3] : "fp32";
  const std::string checkpoint_dir = argc > 4 ? argv[4] : "";
  const int64_t batch_size = 128;
  const uint64_t seed = 0;

  try {
    // ---- data: 60000 training and 10000 test images, 784 pixels each, normalized with the
    // training set's mean and std; labels 0..9.
    auto train_set = data::load_fashion_mnist(data_dir, /*train=*/true, /*normalize=*/true);
    auto test_set = data::load_fashion_mnist(data_dir, /*train=*/false, /*normalize=*/true);
    BoosterConfig booster_config;  // no plugin: one process
    booster_config.mixed_precision = precision;
    Booster booster(booster_config);
    data::DataLoaderOptions loader_options;
    loader_options.batch_size = batch_size;
    loader_options.shuffle = true;  // a new permutation every epoch, from the seed and the epoch
    loader_options.seed = seed;
    auto loader = booster.prepare_dataloader(train_set, loader_options);

    // ---- model and optimizer: 784 -> 1024 -> 1024 -> 10 with ReLU; AdamW with PyTorch's defaults
    // except the learning rate, which follows a cosine from 1e-3 to 0 over the whole run.
    auto mlp = std::make_shared<nn::MLPClassifier>(784, std::vector<int64_t>{1024, 1024}, 10, "relu", seed);
    auto adamw = std::make_shared<optim::AdamW>(mlp->parameters(), nlohmann::json{{"lr", 1e-3}, {"weight_decay", 0.01}});
    auto cosine = std::make_shared<optim::CosineAnnealingLR>(*adamw, /*T_max=*/epochs * loader->size());
    nn::Criterion loss_fn = [](const Tensor& logits, const Tensor& labels) { return cross_entropy(logits, labels); };
    // Only what boost() returns is used from here on: the strategy may cast the model (fp16_naive),
    // wrap its forward in autocast (fp16, bf16) or step float32 master weights.
    auto [model, optimizer, criterion, train_loader, scheduler] = booster.boost(mlp, adamw, loss_fn, loader, cosine);
    // State of our own that a checkpoint should carry, beside everything boost() returned.
    double best_accuracy = 0.0;
    booster.register_state("best_accuracy", [&] { return nlohmann::json(best_accuracy); },
                           [&](const nlohmann::json& saved) { best_accuracy = saved.get<double>(); });
    if (!checkpoint_dir.empty() && Booster::find_state(checkpoint_dir)) {
      const LoadedState resumed = booster.load_state(checkpoint_dir);  // the newest checkpoint there
      std::printf("resumed from %s at step %lld\n", resumed.dir.c_str(), static_cast<long long>(resumed.step));
    }
    std::printf("MLP with %lld parameters, %lld steps per epoch, precision %s\n",
                static_cast<long long>(mlp->num_parameters()), static_cast<long long>(train_loader->size()),
                precision.c_str());

    // ---- training loop
    int64_t step = booster.step();
    auto t0 = std::chrono::steady_clock::now();
    // A resumed run starts at the saved epoch (the loader knows where it was).
    for (int epoch = int(train_loader->epoch()); epoch < epochs; ++epoch) {
      train_loader->set_epoch(epoch);
      model->train();
      for (data::Batch& batch : *train_loader) {
        optimizer->zero_grad();                         // drop last step's gradients
        Tensor logits = (*model)(batch.x);              // forward: [B, 10]
        Tensor loss = criterion(logits, batch.y);       // mean over the batch
        booster.backward(loss, *optimizer);             // fills each parameter's .grad (scaled if the strategy scales)
        optimizer->step();                              // one fused AdamW update, skipped on inf/NaN gradients
        scheduler->step();                              // the next step's lr (not after a skipped step)
        ++step;
        if (step % 100 == 0) {
          double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          std::printf("epoch %d step %5lld | loss %.4f | lr %.2e | %.0f images/s\n", epoch + 1,
                      static_cast<long long>(step), loss.item(), optimizer->lr(), 100.0 * double(batch_size) / seconds);
          t0 = std::chrono::steady_clock::now();
        }
      }

      // ---- evaluation: no graph, eval mode, 1000 test images at a time
      model->eval();
      autograd::NoGradGuard no_grad;
      int64_t correct = 0;
      for (int64_t begin = 0; begin < test_set->size(); begin += 1000) {
        std::vector<int64_t> indices;
        for (int64_t i = begin; i < std::min<int64_t>(begin + 1000, test_set->size()); ++i) indices.push_back(i);
        data::Batch batch = test_set->get_batch(indices);
        Tensor predicted = argmax((*model)(batch.x), /*dim=*/1);
        correct += int64_t(sum(eq(predicted, batch.y).to(DType::Int64)).item());
      }
      const double accuracy = double(correct) / double(test_set->size());
      best_accuracy = std::max(best_accuracy, accuracy);
      std::printf("epoch %d: test accuracy %.2f%% (best %.2f%%)\n", epoch + 1, 100.0 * accuracy, 100.0 * best_accuracy);
      if (!checkpoint_dir.empty())
        std::printf("saved %s\n", booster.save_state(checkpoint_dir, {.keep_last = 2}).c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
