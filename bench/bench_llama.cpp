// The Llama: training tokens/s on the CPU, or on a GPU with --cuda 1 (bench/torch_llama.py times the
// same model and step in PyTorch; bench/llama_bench.sh runs both and prints the table), and generation
// tokens/s with and without the key/value cache. --bf16 1 trains under the bf16 strategy (autocast).
//
//   build/bin/bench_llama train [--layers 12 --hidden 768 --heads 12 --kv-heads 4 --intermediate 2048
//                               --vocab 32000 --seq 256 --batch 2 --steps 3 --warmup 1 --cuda 0 --bf16 0]
//   build/bin/bench_llama generate [--prompt 16 --new 64 ...sizes]
//
// train: one step = forward, next-token cross-entropy on random tokens, backward, AdamW (lr 1e-4), zero_grad;
// the median wall time of `steps` timed steps after `warmup`. generate: greedy nn::generate of `new`
// tokens after a random prompt of `prompt` tokens, with the cache and without (every step recomputes the
// whole sequence), alternating, `steps` runs each, the median. Prints one JSON line. Threads:
// OMP_NUM_THREADS / OPENBLAS_NUM_THREADS.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/nn/generate.h"
#include "booster/nn/llama.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"

using namespace booster;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || (std::string(argv[1]) != "train" && std::string(argv[1]) != "generate")) {
    std::cerr << "usage: bench_llama train|generate [--layers N --hidden N --heads N --kv-heads N --intermediate N "
                 "--vocab N --seq N --batch N --steps N --warmup N --prompt N --new N]\n";
    return 2;
  }
  const std::string mode = argv[1];
  std::map<std::string, int64_t> a = {{"layers", 12}, {"hidden", 768}, {"heads", 12},  {"kv-heads", 4},
                                      {"intermediate", 2048}, {"vocab", 32000}, {"seq", 256}, {"batch", 2},
                                      {"steps", 3}, {"warmup", 1}, {"prompt", 16}, {"new", 64},
                                      {"cuda", 0},  {"bf16", 0}};
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string key = std::string(argv[i]).substr(2);
    if (!a.count(key)) {
      std::cerr << "bench_llama: unknown option " << argv[i] << "\n";
      return 2;
    }
    a[key] = std::stoll(argv[i + 1]);
  }
  nn::LlamaConfig c;
  c.vocab_size = a["vocab"];
  c.hidden_size = a["hidden"];
  c.intermediate_size = a["intermediate"];
  c.num_hidden_layers = a["layers"];
  c.num_attention_heads = a["heads"];
  c.num_key_value_heads = a["kv-heads"];
  c.max_position_embeddings = std::max<int64_t>(a["seq"] + 1, a["prompt"] + a["new"]);
  auto model = std::make_shared<nn::Llama>(c, 0);
  int64_t params = 0;
  for (const Tensor& p : model->parameters()) params += p.numel();
  nlohmann::json out = {{"model", "llama"}, {"framework", "booster"}, {"params", params}, {"sizes", a}};

  if (mode == "train" && (a["cuda"] || a["bf16"])) {
    // Through a Booster: the model on the device, the strategy's autocast (the time includes loss.item(),
    // which waits for the GPU).
    const int64_t B = a["batch"], T = a["seq"], V = c.vocab_size;
    const Device device = a["cuda"] ? Device::cuda() : Device::cpu();
    Booster booster(BoosterConfig{.mixed_precision = a["bf16"] ? "bf16" : "fp32", .device = device.str()});
    Boosted b = booster.boost(model, std::make_shared<optim::AdamW>(model->parameters(), nlohmann::json{{"lr", 1e-4}}),
                              [](const Tensor& logits, const Tensor& y) {
                                return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
                              });
    Generator gen(1);
    std::vector<double> times;
    double loss_value = 0.0;
    for (int64_t s = 0; s < a["warmup"] + a["steps"]; ++s) {
      const Tensor tokens = randint(0, V, {B, T + 1}, &gen).to(device);
      const Tensor x = tokens.narrow(1, 0, T).contiguous(), y = tokens.narrow(1, 1, T).contiguous();
      const auto t0 = Clock::now();
      b.optimizer->zero_grad();
      Tensor loss = b.criterion((*b.model)(x), y);
      booster.backward(loss, *b.optimizer);
      b.optimizer->step();
      loss_value = loss.item();
      if (s >= a["warmup"]) times.push_back(seconds_since(t0));
    }
    const double ms = 1e3 * median(times);
    out["mode"] = "train";
    out["device"] = device.str();
    out["precision"] = a["bf16"] ? "bf16" : "fp32";
    out["ms_per_step"] = ms;
    out["tokens_per_second"] = double(B * T) / (ms / 1e3);
    out["gflops"] = 6.0 * double(params) * double(B * T) / (ms / 1e3) / 1e9;
    out["loss"] = loss_value;
  } else if (mode == "train") {
    const int64_t B = a["batch"], T = a["seq"], V = c.vocab_size;
    Generator gen(1);
    optim::AdamW opt(model->parameters(), nlohmann::json{{"lr", 1e-4}});
    std::vector<double> times;
    double loss_value = 0.0;
    for (int64_t s = 0; s < a["warmup"] + a["steps"]; ++s) {
      const Tensor tokens = randint(0, V, {B, T + 1}, &gen);
      const Tensor x = tokens.narrow(1, 0, T).contiguous(), y = tokens.narrow(1, 1, T).contiguous();
      const auto t0 = Clock::now();
      opt.zero_grad();
      Tensor loss = cross_entropy((*model)(x).reshape({B * T, V}), y.reshape({B * T}));
      loss.backward();
      opt.step();
      loss_value = loss.item();
      if (s >= a["warmup"]) times.push_back(seconds_since(t0));
    }
    const double ms = 1e3 * median(times);
    out["mode"] = "train";
    out["ms_per_step"] = ms;
    out["tokens_per_second"] = double(B * T) / (ms / 1e3);
    out["gflops"] = 6.0 * double(params) * double(B * T) / (ms / 1e3) / 1e9;
    out["loss"] = loss_value;
  } else {
    Generator gen(2);
    std::vector<int64_t> prompt;
    for (int64_t i = 0; i < a["prompt"]; ++i) prompt.push_back(gen.randint(0, c.vocab_size));
    std::vector<double> cached, plain;
    std::vector<int64_t> first;
    for (int64_t s = 0; s < a["steps"]; ++s) {
      for (bool use_cache : {true, false}) {
        const auto t0 = Clock::now();
        const nn::GenerateResult r = nn::generate(
            *model, prompt, {.max_new_tokens = a["new"], .temperature = 0.0, .use_cache = use_cache});
        (use_cache ? cached : plain).push_back(double(r.tokens.size()) / seconds_since(t0));
        if (first.empty()) first = r.tokens;
        if (r.tokens != first) std::cerr << "bench_llama: the tokens with and without the cache differ\n";
      }
    }
    out["mode"] = "generate";
    out["tokens_per_second_cached"] = median(cached);
    out["tokens_per_second_uncached"] = median(plain);
    out["speedup"] = median(cached) / median(plain);
  }
  std::cout << out.dump() << std::endl;
  return 0;
}
