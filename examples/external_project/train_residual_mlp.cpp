// A user's own model trained through the Booster, built against an installed booster
// (find_package(booster), one include). The strategy and plugin come from the command line or a JSON
// config, so switching precision is no code change:
//
//   train_residual_mlp [MIXED_PRECISION | --config FILE.json] [STEPS]
//   train_residual_mlp bf16 200
//   train_residual_mlp --config run.json     // {"mixed_precision": {"name": "fp16", "init_scale": 1024}}
//
// Prints the loss of the first and last steps and the accuracy; exits 1 unless the loss fell.
#include <booster/booster.h>

#include <cstdio>
#include <fstream>
#include <string>

using namespace booster;

// x + W2 relu(W1 x), then a classifier: a block no built-in model has, written the way a PyTorch user
// writes an nn.Module (parameters live in registered child modules).
class ResidualMLP : public nn::Module {
 public:
  ResidualMLP(int64_t features, int64_t hidden, int64_t classes) {
    up_ = register_module("up", std::make_shared<nn::Linear>(features, hidden));
    down_ = register_module("down", std::make_shared<nn::Linear>(hidden, features));
    head_ = register_module("head", std::make_shared<nn::Linear>(features, classes));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x + (*down_)(relu((*up_)(x)));
    return (*head_)(h);
  }
  std::string name() const override { return "ResidualMLP"; }

 private:
  std::shared_ptr<nn::Linear> up_, down_, head_;
};

int main(int argc, char** argv) {
  try {
    BoosterConfig config;
    int arg = 1;
    if (argc > 2 && std::string(argv[1]) == "--config") {
      std::ifstream file(argv[2]);
      if (!file) throw ConfigError(std::string("cannot read ") + argv[2]);
      config = BoosterConfig::from_json(nlohmann::json::parse(file));
      arg = 3;
    } else if (argc > 1) {
      config.mixed_precision = argv[arg++];
    }
    const int steps = argc > arg ? std::stoi(argv[arg]) : 150;

    manual_seed(0);
    auto dataset = data::synthetic_classification(/*n=*/2048, /*features=*/32, /*classes=*/4, /*seed=*/1);
    auto net = std::make_shared<ResidualMLP>(32, 64, 4);
    auto adamw = std::make_shared<optim::AdamW>(net->parameters(), nlohmann::json{{"lr", 3e-3}});
    nn::Criterion loss_fn = [](const Tensor& logits, const Tensor& y) { return cross_entropy(logits, y); };

    Booster booster(config);
    data::DataLoaderOptions options;
    options.batch_size = 64;
    options.shuffle = true;
    auto loader = booster.prepare_dataloader(dataset, options);
    auto [model, optimizer, criterion, train_loader, scheduler] = booster.boost(net, adamw, loss_fn, loader);

    double first = 0, last = 0;
    int step = 0;
    for (int epoch = 0; step < steps; ++epoch) {
      train_loader->set_epoch(epoch);
      for (data::Batch& batch : *train_loader) {
        if (step == steps) break;
        optimizer->zero_grad();
        Tensor loss = criterion((*model)(batch.x), batch.y);
        booster.backward(loss, *optimizer);
        optimizer->step();
        (step == 0 ? first : last) = loss.item();
        ++step;
      }
    }
    model->eval();
    autograd::NoGradGuard no_grad;
    data::Batch all = dataset->get_batch([&] {
      std::vector<int64_t> i(size_t(dataset->size()));
      for (size_t k = 0; k < i.size(); ++k) i[k] = int64_t(k);
      return i;
    }());
    const double accuracy = sum(eq(argmax((*model)(all.x), 1), all.y).to(DType::Int64)).item() / double(dataset->size());
    std::printf("%s: %d steps, loss %.4f -> %.4f, accuracy %.1f%%\n", booster.precision().name().c_str(), steps,
                first, last, 100.0 * accuracy);
    return last < first ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_residual_mlp: error: %s\n", e.what());
    return 2;
  }
}
