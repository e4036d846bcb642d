// The pieces of a GPT-2 style decoder (nanoGPT's names, so checkpoints map one to one):
// CausalSelfAttention, the feed-forward MLP, and the pre-norm Block.
#pragma once

#include <memory>

#include "booster/nn/activation.h"
#include "booster/nn/dropout.h"
#include "booster/nn/kv_cache.h"
#include "booster/nn/linear.h"
#include "booster/nn/normalization.h"
#include "booster/tensor/random.h"

namespace booster::nn {

// Multi-head causal self-attention over x [B, T, width].
class CausalSelfAttention : public Module {
 public:
  // Weights drawn from init_gen (default generator when null); dropout masks from dropout_gen.
  CausalSelfAttention(int64_t width, int64_t heads, double dropout = 0.0, Generator* init_gen = nullptr,
                      std::shared_ptr<Generator> dropout_gen = nullptr);

  // q, k, v = split(c_attn(x)) each viewed [B, H, T, width/H]; causal scaled dot-product attention;
  // heads merged back to [B, T, width]; c_proj; residual dropout. (Dropout on the attention weights
  // themselves is not applied: the fused attention op takes no dropout probability.)
  Tensor forward(const Tensor& x) override;  // forward(x, nullptr)
  // With a cache: forward over new positions x [B, T, width] with the earlier ones' keys and values in
  // `cache`, to which this call's are appended (Note [Key/value cache] in kv_cache.h).
  Tensor forward(const Tensor& x, LayerKVCache* cache);
  std::string name() const override { return "CausalSelfAttention"; }

  const int64_t width, heads;
  std::shared_ptr<Linear> c_attn;  // width -> 3 width (q, k, v)
  std::shared_ptr<Linear> c_proj;  // width -> width
  std::shared_ptr<Dropout> resid_dropout;
};

// Feed-forward: c_fc (width -> 4 width), GELU (tanh), c_proj (4 width -> width), dropout.
class MLP : public Module {
 public:
  MLP(int64_t width, double dropout = 0.0, Generator* init_gen = nullptr,
      std::shared_ptr<Generator> dropout_gen = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "MLP"; }

  std::shared_ptr<Linear> c_fc;
  std::shared_ptr<GELU> gelu;
  std::shared_ptr<Linear> c_proj;
  std::shared_ptr<Dropout> dropout;
};

// Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
class Block : public Module {
 public:
  Block(int64_t width, int64_t heads, double dropout = 0.0, Generator* init_gen = nullptr,
        std::shared_ptr<Generator> dropout_gen = nullptr, double layer_norm_eps = 1e-5);
  Tensor forward(const Tensor& x) override;               // forward(x, nullptr)
  Tensor forward(const Tensor& x, LayerKVCache* cache);  // attention through the cache when not null
  std::string name() const override { return "Block"; }

  std::shared_ptr<LayerNorm> ln_1;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<LayerNorm> ln_2;
  std::shared_ptr<MLP> mlp;
};

}  // namespace booster::nn
