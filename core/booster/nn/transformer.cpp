#include "booster/nn/transformer.h"

#include "booster/nn/packing.h"
#include "booster/ops/ops.h"

namespace booster::nn {

namespace {

// Note [Packed sequences] (packing.h): inside a packed forward a query attends only to keys of its own
// record; outside one, nothing more than the causal mask.
AttentionMask packed_mask() {
  AttentionMask mask;
  if (const SequenceLayout* packed = current_sequence_layout()) mask.segments = packed->segments;
  return mask;
}

}  // namespace

CausalSelfAttention::CausalSelfAttention(int64_t width_, int64_t heads_, double p, Generator* init_gen,
                                         std::shared_ptr<Generator> dropout_gen)
    : width(width_), heads(heads_) {
  BOOSTER_CHECK(heads > 0 && width > 0 && width % heads == 0, ValueError, "CausalSelfAttention: width ", width,
                " must be a positive multiple of heads ", heads);
  c_attn = register_module("c_attn", std::make_shared<Linear>(width, 3 * width, true, init_gen));
  c_proj = register_module("c_proj", std::make_shared<Linear>(width, width, true, init_gen));
  resid_dropout = register_module("resid_dropout", std::make_shared<Dropout>(p, std::move(dropout_gen)));
}

Tensor CausalSelfAttention::forward(const Tensor& x) { return forward(x, nullptr); }

// One path for both (Note [One attention path] in llama.cpp): only the attention itself differs, the
// fused causal op over this call's keys without a cache, cached_attention over all cached keys with one.
Tensor CausalSelfAttention::forward(const Tensor& x, LayerKVCache* cache) {
  BOOSTER_CHECK(x.dim() == 3 && x.size(2) == width, ShapeError, "CausalSelfAttention: expected input [B, T, ",
                width, "], got shape ", x.shape());
  const int64_t B = x.size(0), T = x.size(1), head_dim = width / heads;
  const std::vector<Tensor> qkv = split((*c_attn)(x), width, 2);
  // [B, T, width] -> [B, H, T, head_dim]: a view (the split pieces are runs of the last dim).
  auto to_heads = [&](const Tensor& t) { return t.view({B, T, heads, head_dim}).transpose(1, 2); };
  Tensor y;
  if (cache != nullptr) {
    const int64_t start = cache->length();
    auto [k, v] = cache->append(to_heads(qkv[1]), to_heads(qkv[2]));
    y = cached_attention(to_heads(qkv[0]), k, v, start);
  } else {
    y = scaled_dot_product_attention(to_heads(qkv[0]), to_heads(qkv[1]), to_heads(qkv[2]), true, std::nullopt,
                                     packed_mask());
  }
  y = y.transpose(1, 2).reshape({B, T, width});
  return (*resid_dropout)((*c_proj)(y));
}

MLP::MLP(int64_t width, double p, Generator* init_gen, std::shared_ptr<Generator> dropout_gen) {
  c_fc = register_module("c_fc", std::make_shared<Linear>(width, 4 * width, true, init_gen));
  gelu = register_module("gelu", std::make_shared<GELU>("tanh"));
  c_proj = register_module("c_proj", std::make_shared<Linear>(4 * width, width, true, init_gen));
  dropout = register_module("dropout", std::make_shared<Dropout>(p, std::move(dropout_gen)));
}

Tensor MLP::forward(const Tensor& x) { return (*dropout)((*c_proj)((*gelu)((*c_fc)(x)))); }

Block::Block(int64_t width, int64_t heads, double p, Generator* init_gen, std::shared_ptr<Generator> dropout_gen,
             double layer_norm_eps) {
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(width, layer_norm_eps));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(width, heads, p, init_gen, dropout_gen));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(width, layer_norm_eps));
  mlp = register_module("mlp", std::make_shared<MLP>(width, p, init_gen, dropout_gen));
}

Tensor Block::forward(const Tensor& x) { return forward(x, nullptr); }

Tensor Block::forward(const Tensor& x, LayerKVCache* cache) {
  const Tensor normed = (*ln_1)(x);
  // Without a cache through operator(), so hooks and error paths see the attention module as before.
  Tensor h = x + (cache != nullptr ? attn->forward(normed, cache) : (*attn)(normed));
  return h + (*mlp)((*ln_2)(h));
}

}  // namespace booster::nn
