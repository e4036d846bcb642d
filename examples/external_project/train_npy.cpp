// A user's own program: a module of its own, trained on the user's .npy files by the library's Trainer.
// Progress, metrics.jsonl, checkpoints, exact resume and a clean stop on Ctrl-C or SIGTERM come from the
// library; nothing here is specific to them beyond the options.
//
//   train_npy X.npy Y.npy RUN_DIR [--epochs N] [--precision NAME] [--resume latest]
//   train_npy features.npy labels.npy runs/gated --epochs 20
//   train_npy features.npy labels.npy runs/gated --epochs 20 --resume latest   // after a stop: goes on
//
// X holds one sample per row (float32/float64/uint8), Y one class index per row. A fifth of the rows is
// held out for evaluation. Exits 0 at the end, 128 + the signal when stopped by one, 1 on an error.
#include <booster/booster.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

using namespace booster;

// A gated classifier: h = tanh(W1 x) * sigmoid(W2 x), then LayerNorm and a linear head.
class GatedClassifier : public nn::Module {
 public:
  GatedClassifier(int64_t features, int64_t width, int64_t classes) {
    value_ = register_module("value", std::make_shared<nn::Linear>(features, width));
    gate_ = register_module("gate", std::make_shared<nn::Linear>(features, width));
    norm_ = register_module("norm", std::make_shared<nn::LayerNorm>(Shape{width}));
    head_ = register_module("head", std::make_shared<nn::Linear>(width, classes));
  }
  Tensor forward(const Tensor& x) override {
    const Tensor h = mul(tanh((*value_)(x)), sigmoid((*gate_)(x)));
    return (*head_)((*norm_)(h));
  }
  std::string name() const override { return "GatedClassifier"; }

 private:
  std::shared_ptr<nn::Linear> value_, gate_, head_;
  std::shared_ptr<nn::LayerNorm> norm_;
};

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: train_npy X.npy Y.npy RUN_DIR [--epochs N] [--precision NAME] [--resume latest]\n");
    return 2;
  }
  const std::string x_path = argv[1], y_path = argv[2], run_dir = argv[3];
  std::string precision = "fp32", resume;
  int64_t epochs = 10;
  for (int i = 4; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--epochs") epochs = std::atoll(argv[i + 1]);
    else if (a == "--precision") precision = argv[i + 1];
    else if (a == "--resume") resume = argv[i + 1];
    else {
      std::fprintf(stderr, "train_npy: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  try {
    manual_seed(0);
    data::FileDataOptions files;
    files.train.x_path = x_path;
    files.train.y_path = y_path;
    files.test_fraction = 0.2;
    files.normalize = data::Normalize::Standardize;
    const data::FileData data = data::load_file_data(files);
    const int64_t features = data.train->x().size(1);
    const int64_t classes = int64_t(max(data.train->y()).item()) + 1;

    Booster booster(BoosterConfig{.mixed_precision = precision});
    auto loader = booster.prepare_dataloader(data.train, {.batch_size = 16, .shuffle = true, .seed = 0});
    auto model = std::make_shared<GatedClassifier>(features, 32, classes);
    auto adamw = std::make_shared<optim::AdamW>(model->parameters(), nlohmann::json{{"lr", 3e-3}});
    nn::Criterion loss = [](const Tensor& logits, const Tensor& labels) { return cross_entropy(logits, labels); };
    booster.boost(model, adamw, loss, loader);

    TrainerOptions options;
    options.epochs = epochs;
    options.log_every = 10;
    options.run_dir = run_dir;
    options.checkpoint_every = 1000;
    options.keep_last = 2;
    options.resume = resume;
    options.data_description = data.description;
    options.resume_hint = [&](const std::filesystem::path&) {
      return "resume with: train_npy " + x_path + " " + y_path + " " + run_dir + " --resume latest";
    };
    Trainer trainer(booster, options);
    trainer.set_eval_data(data.test);
    std::cout << trainer.fit().to_json().dump() << std::endl;
  } catch (const InterruptedError& e) {
    std::fprintf(stderr, "train_npy: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_npy: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
