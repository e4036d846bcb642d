// Ready-made models. make_model() (model_registry.h, included here) builds them, and any registered
// or library model, from a JSON config:
//
//   auto model = nn::make_model({{"type", "mlp"}, {"in", 784}, {"hidden", {1024, 1024}}, {"classes", 10}}, seed);
//   auto gpt = nn::make_model({{"type", "gpt"}, {"vocab_size", 256}, {"context", 128}, {"width", 256},
//                              {"layers", 4}, {"heads", 4}, {"dropout", 0.0}}, seed);
#pragma once

#include <memory>
#include <nlohmann/json.hpp>

#include "booster/nn/container.h"
#include "booster/nn/embedding.h"
#include "booster/nn/model_registry.h"  // make_model, register_model
#include "booster/nn/transformer.h"

namespace booster::nn {

struct GPTConfig {
  int64_t vocab_size = 256;
  int64_t context = 128;  // longest sequence (rows of wpe)
  int64_t width = 256;
  int64_t layers = 4;
  int64_t heads = 4;
  double dropout = 0.0;
  // Recompute each block's activations in backward instead of keeping them (nn::checkpoint).
  bool activation_checkpointing = false;
  // GPT-2's: lm_head reads wte's table (one tensor, listed once as "wte.weight"), and the layer norms'
  // epsilon (Hugging Face's tie_word_embeddings and layer_norm_epsilon).
  bool tie_word_embeddings = false;
  double layer_norm_eps = 1e-5;
};

// A GPT-2 style decoder (nanoGPT; its weight tying is tie_word_embeddings, off by default):
//   wte, wpe -> drop -> blocks.0 .. blocks.{layers-1} -> ln_f -> lm_head (no bias).
// Init as nanoGPT: Linear and Embedding weights N(0, 0.02), biases zero, LayerNorm (1, 0), and every
// residual projection (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 layers)). Deterministic from seed.
class GPT : public Module, public CausalLM {
 public:
  explicit GPT(const GPTConfig& config, uint64_t seed = 0);

  // idx int64 [B, T] with T <= context -> logits [B, T, vocab_size].
  Tensor forward(const Tensor& idx) override;
  // CausalLM (kv_cache.h): the new positions' logits, their position embeddings those of their absolute
  // positions, attention through the cache.
  Tensor forward_cached(const Tensor& idx, KVCache& cache) override;  // forward(idx, &cache)
  // The one path of both: no cache (nullptr) is forward(idx), positions 0 .. T-1.
  Tensor forward(const Tensor& idx, KVCache* cache);
  KVCache make_kv_cache(int64_t capacity) const override { return KVCache(config.layers, capacity); }
  int64_t max_positions() const override { return config.context; }
  int64_t vocab_size() const override { return config.vocab_size; }
  std::string name() const override { return "GPT"; }
  std::vector<std::pair<std::string, Generator*>> own_generators() const override {
    return {{"dropout", dropout_gen_.get()}};
  }

  const GPTConfig config;
  std::shared_ptr<Embedding> wte, wpe;
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<Sequential> blocks;
  std::shared_ptr<LayerNorm> ln_f;
  std::shared_ptr<Linear> lm_head;

  // The generator every dropout of the model draws its masks from (a checkpoint saves its state so a
  // resumed run draws the same masks).
  Generator& dropout_generator() const { return *dropout_gen_; }

 private:
  std::shared_ptr<Generator> dropout_gen_;
};

// A multilayer perceptron classifier: flattens x [N, ...] to [N, in], then
// layers = Linear(in, h0), act, Linear(h0, h1), act, ..., Linear(h_last, classes).
// Parameters are "layers.0.weight", "layers.0.bias", "layers.2.weight", ... (activations take the odd
// indices, as in a PyTorch nn.Sequential). PyTorch's default Linear init, deterministic from seed.
class MLPClassifier : public Module {
 public:
  MLPClassifier(int64_t in, std::vector<int64_t> hidden, int64_t classes, const std::string& activation = "relu",
                uint64_t seed = 0);

  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "MLPClassifier"; }

  const int64_t in_features, num_classes;
  std::shared_ptr<Sequential> layers;
};

}  // namespace booster::nn
