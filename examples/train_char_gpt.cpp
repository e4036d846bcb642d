// Trains a small character-level GPT on a text file with the Booster, then writes a sample: the
// language-model counterpart of train_fashion_mnist.cpp, written with the library's API and no config.
//
//   build/bin/train_char_gpt [TEXT_FILE] [STEPS] [MIXED_PRECISION]
//   (defaults: /usr/share/common-licenses/GPL-3, which every Debian system has; 300 steps; fp32)
//   build/bin/train_char_gpt /usr/share/common-licenses/GPL-3 300 bf16
//
// Every byte is a token (vocabulary 256); the model sees 64 bytes and learns to predict each next one.
// The mixed-precision strategy is one argument: the loop below is the same for every strategy, which
// is the Booster's point.
#include <algorithm>  // std::max: the sampling's numerical guard
#include <chrono>     // steady_clock: throughput
#include <cmath>      // std::exp: softmax of the last logits
#include <cstdio>     // printf: progress and the sample
#include <cstdlib>    // atoi
#include <fstream>    // the text file
#include <sstream>    // ... read whole
#include <string>
#include <vector>

#include "booster/autograd/autograd.h"    // NoGradGuard: sampling records no graph
#include "booster/booster/booster.h"      // Booster, BoosterConfig: precision injected into the loop
#include "booster/data/data.h"            // DataLoader options
#include "booster/data/synthetic.h"       // CharDataset: every window of `context` bytes and the next ones
#include "booster/nn/models.h"            // GPT, GPTConfig
#include "booster/ops/ops.h"              // cross_entropy, from_vector
#include "booster/optim/lr_scheduler.h"   // CosineAnnealingLR
#include "booster/optim/optimizer.h"      // AdamW
#include "booster/tensor/random.h"        // Generator: the sampling's draws

using namespace booster;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot open '" + path + "'; pass a readable text file as the first argument");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Continues `prompt` by `length` bytes, drawing each from the model's distribution at temperature 0.8.
std::string sample(nn::Module& model, const std::string& prompt, int64_t context, int length, uint64_t seed) {
  autograd::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  Generator gen(seed);
  std::string text = prompt;
  for (int i = 0; i < length; ++i) {
    // The last `context` bytes as token ids [1, T].
    const std::string window = text.substr(text.size() > size_t(context) ? text.size() - size_t(context) : 0);
    std::vector<int64_t> ids(window.begin(), window.end());
    for (int64_t& id : ids) id = int64_t(static_cast<unsigned char>(id));
    Tensor logits = model(from_vector(ids, {1, int64_t(ids.size())}));  // [1, T, 256]
    Tensor last = logits.select(1, int64_t(ids.size()) - 1).reshape({-1}).to(DType::Float32).contiguous();
    const float* z = last.data<float>();
    // softmax(z / 0.8), then one draw.
    float top = z[0];
    for (int v = 1; v < 256; ++v) top = std::max(top, z[v]);
    std::vector<double> p(256);
    double total = 0.0;
    for (int v = 0; v < 256; ++v) total += p[size_t(v)] = std::exp((z[v] - top) / 0.8);
    double u = gen.uniform() * total;
    int next = 255;
    for (int v = 0; v < 256; ++v) {
      if ((u -= p[size_t(v)]) <= 0.0) {
        next = v;
        break;
      }
    }
    text.push_back(char(next));
  }
  model.train(was_training);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "/usr/share/common-licenses/GPL-3";
  const int64_t steps = argc > 2 ? std::atoi(argv[2]) : 300;
  const std::string precision = argc > 3 ? argv[3] : "fp32";
  const int64_t context = 64, batch_size = 16;
  const uint64_t seed = 0;

  try {
    // ---- data: the first 90% of the file to train on, byte windows of `context` + 1.
    const std::string text = read_file(path);
    const size_t train_bytes = text.size() * 9 / 10;
    auto train_set = std::make_shared<data::CharDataset>(text.substr(0, train_bytes), context);

    // ---- the Booster: the strategy comes from the command line; no plugin is one process.
    BoosterConfig booster_config;  // no plugin: one process
    booster_config.mixed_precision = precision;
    Booster booster(booster_config);
    data::DataLoaderOptions loader_options;
    loader_options.batch_size = batch_size;
    loader_options.shuffle = true;
    loader_options.seed = seed;
    auto loader = booster.prepare_dataloader(train_set, loader_options);

    // ---- model, optimizer, schedule: 2 layers of width 128, AdamW as nanoGPT, cosine to 0.
    nn::GPTConfig config;
    config.context = context;
    config.width = 128;
    config.layers = 2;
    config.heads = 4;
    auto gpt = std::make_shared<nn::GPT>(config, seed);
    auto adamw = std::make_shared<optim::AdamW>(gpt->parameters(), nlohmann::json{{"lr", 3e-3}, {"betas", {0.9, 0.95}},
                                                                                 {"weight_decay", 0.1}});
    auto cosine = std::make_shared<optim::CosineAnnealingLR>(*adamw, /*T_max=*/steps);
    nn::Criterion next_byte_loss = [](const Tensor& logits, const Tensor& targets) {  // [B, T, 256] vs [B, T]
      return cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
    };
    // Only what boost() returns is used from here on: the strategy may cast or wrap each part.
    auto [model, optimizer, criterion, boosted_loader, scheduler] =
        booster.boost(gpt, adamw, next_byte_loss, loader, cosine);
    std::printf("GPT with %lld parameters on %s (%zu training bytes), precision %s, %lld steps\n",
                static_cast<long long>(gpt->num_parameters()), path.c_str(), train_bytes, precision.c_str(),
                static_cast<long long>(steps));

    // ---- training loop: the same for every strategy.
    int64_t step = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t epoch = 0; step < steps; ++epoch) {
      boosted_loader->set_epoch(epoch);
      for (data::Batch& batch : *boosted_loader) {
        optimizer->zero_grad();
        Tensor loss = criterion((*model)(batch.x), batch.y);  // forward under the strategy's autocast
        booster.backward(loss, *optimizer);                   // scaled backward where the strategy scales
        booster.clip_grad_norm(*optimizer, 1.0);              // unscales first
        optimizer->step();                                    // skipped on inf/NaN gradients
        scheduler->step();                                    // not after a skipped step
        if (++step % 25 == 0) {
          const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          std::printf("step %4lld | loss %.4f | lr %.2e | %.0f tokens/s\n", static_cast<long long>(step), loss.item(),
                      optimizer->lr(), 25.0 * double(batch_size * context) / seconds);
          t0 = std::chrono::steady_clock::now();
        }
        if (step >= steps) break;
      }
    }

    // ---- a sample, continuing the first line of the held-out tail.
    const std::string tail = text.substr(train_bytes);
    const std::string prompt = tail.substr(0, std::min<size_t>(tail.find('\n') == std::string::npos ? 32 : tail.find('\n') + 1, 64));
    std::printf("\nsample:\n%s\n", sample(*model, prompt, context, 200, seed).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_char_gpt: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
