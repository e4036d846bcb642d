// A user's own model trained by the library's Trainer: progress bar or log lines, metrics.jsonl,
// checkpoints, exact resume and a clean stop on Ctrl-C or SIGTERM, with no loop written by hand
// (examples/train_fashion_mnist.cpp writes the loop out instead).
//
//   build/bin/train_with_trainer [--precision NAME] [--epochs N] [--max-steps N] [--run-dir DIR]
//                                [--resume latest|DIR] [--data DIR]
//   build/bin/train_with_trainer --precision bf16 --run-dir runs/residual --epochs 3
//   build/bin/train_with_trainer --run-dir runs/residual --resume latest     // after Ctrl-C: goes on
//
// Exits 0 at the end, 128 + the signal when stopped by one (after saving), 1 on an error.
#include <booster/booster.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

using namespace booster;

// A residual MLP block no built-in model has, written as a PyTorch user writes an nn.Module.
class ResidualClassifier : public nn::Module {
 public:
  ResidualClassifier(int64_t features, int64_t width, int64_t classes) {
    in_ = register_module("in", std::make_shared<nn::Linear>(features, width));
    up_ = register_module("up", std::make_shared<nn::Linear>(width, 2 * width));
    down_ = register_module("down", std::make_shared<nn::Linear>(2 * width, width));
    head_ = register_module("head", std::make_shared<nn::Linear>(width, classes));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = relu((*in_)(x.reshape({x.size(0), -1})));
    h = h + (*down_)(relu((*up_)(h)));
    return (*head_)(h);
  }
  std::string name() const override { return "ResidualClassifier"; }

 private:
  std::shared_ptr<nn::Linear> in_, up_, down_, head_;
};

int main(int argc, char** argv) {
  std::string precision = "fp32", run_dir, resume, data_dir = data::kFashionMnistDir;
  int64_t epochs = 2, max_steps = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    if (!value) {
      std::fprintf(stderr, "train_with_trainer: %s needs a value\n", a.c_str());
      return 2;
    }
    if (a == "--precision") precision = value;
    else if (a == "--epochs") epochs = std::atoll(value);
    else if (a == "--max-steps") max_steps = std::atoll(value);
    else if (a == "--run-dir") run_dir = value;
    else if (a == "--resume") resume = value;
    else if (a == "--data") data_dir = value;
    else {
      std::fprintf(stderr, "train_with_trainer: unknown option %s\n", a.c_str());
      return 2;
    }
    ++i;
  }

  try {
    manual_seed(0);
    Booster booster(BoosterConfig{.mixed_precision = precision});
    auto train_set = data::load_fashion_mnist(data_dir, /*train=*/true);
    auto test_set = data::load_fashion_mnist(data_dir, /*train=*/false);
    auto loader = booster.prepare_dataloader(train_set, {.batch_size = 128, .shuffle = true, .seed = 0});

    auto model = std::make_shared<ResidualClassifier>(784, 256, 10);
    auto adamw = std::make_shared<optim::AdamW>(model->parameters(), nlohmann::json{{"lr", 1e-3}});
    const int64_t steps = max_steps > 0 ? std::min(max_steps, epochs * loader->size()) : epochs * loader->size();
    auto cosine = std::make_shared<optim::CosineAnnealingLR>(*adamw, steps);
    nn::Criterion loss = [](const Tensor& logits, const Tensor& labels) { return cross_entropy(logits, labels); };
    booster.boost(model, adamw, loss, loader, cosine);

    TrainerOptions options;
    options.epochs = epochs;
    if (max_steps > 0) options.max_steps = max_steps;
    options.log_every = 50;
    if (!run_dir.empty()) {
      options.run_dir = run_dir;       // metrics.jsonl and checkpoints/ go here
      options.checkpoint_every = 200;  // and a save on Ctrl-C / SIGTERM
      options.keep_last = 2;
    }
    options.resume = resume;
    options.resume_hint = [&](const std::filesystem::path&) {
      return "resume with: train_with_trainer --run-dir " + run_dir + " --resume latest";
    };
    Trainer trainer(booster, options);
    trainer.set_eval_data(test_set);
    const FitResult result = trainer.fit();
    std::cout << result.to_json().dump() << std::endl;
  } catch (const InterruptedError& e) {
    std::fprintf(stderr, "train_with_trainer: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_with_trainer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
