// The key/value cache of incremental decoding: the keys and values every attention layer computed for
// the positions seen so far, so a decoder run over only the new positions (one token per step during
// generation) attends to the whole prefix without recomputing it. nn::GPT and nn::Llama implement
// CausalLM below; nn::generate (generate.h) drives them.
//
//   nn::KVCache cache = model.make_kv_cache(batch, prompt_len + max_new_tokens);
//   Tensor logits = model.forward_cached(prompt, cache);            // positions 0 .. T-1
//   logits = model.forward_cached(next_token, cache);               // position T, attending to 0 .. T
//
// Note [Key/value cache]
// ~~~~~~~~~~~~~~~~~~~~~~
// A layer's cache is two buffers [B, kv_heads, capacity, head_dim] (Hugging Face's DynamicCache layout),
// allocated on the first append in the new keys' dtype and device, and sized for the whole generation up
// front (KVCache's capacity hint): appending T positions copies T rows into place, nothing more. Appending
// past the capacity grows the buffers geometrically (twice the size), so a caller that gave no good
// hint still pays amortized O(1) copies per position, never a reallocation of the whole cache per token.
// The cached keys are views of the first `length` positions of the buffers.
//
// The new queries are positions start .. start+L-1 of the sequence, the keys positions 0 .. start+L-1.
// Query i may attend key j when j <= start + i: the causal mask aligned to the bottom right, not the top
// left that scaled_dot_product_attention's is_causal means (the two agree only when start == 0).
// cached_attention picks the cheapest exact form: the prefill (start 0) is the ordinary causal
// attention; one new position (a generation step) attends to every cached key with no mask, and its
// grouped query heads are folded into the query length ([B, kv_heads, heads/kv_heads, E] against
// [B, kv_heads, S, E]), so grouped-query attention reads the cache without repeating it per head; any
// other chunk runs the attention op with the mask aligned to the bottom right (AttentionMask's
// query_offset). With a sliding window the keys before the first query's window are not even passed to
// the op (a view, no copy); the cache itself keeps every position. Positions are absolute:
// GPT's position embedding and Llama's rotary angle of a new token are those of position start + i.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "booster/tensor/tensor.h"

namespace booster::nn {

// One attention layer's cached keys and values.
class LayerKVCache {
 public:
  explicit LayerKVCache(int64_t capacity_hint = 0) : capacity_hint_(capacity_hint) {}
  // k, v [B, kv_heads, T, head_dim] of the next T positions, stored at positions length() ..
  // length() + T - 1. Returns the views [B, kv_heads, length() + T, head_dim] of every cached key and
  // value (length() has advanced by T). ShapeError when B, kv_heads, head_dim, dtype or device differ
  // from the first append's.
  std::pair<Tensor, Tensor> append(const Tensor& k, const Tensor& v);
  int64_t length() const { return length_; }
  int64_t capacity() const { return k_.defined() ? k_.size(2) : 0; }
  // Forgets every position (the buffers are kept for the next sequence of the same shape).
  void clear() { length_ = 0; }

 private:
  int64_t capacity_hint_;
  int64_t length_ = 0;
  Tensor k_, v_;  // [B, kv_heads, capacity, head_dim]
};

// Every layer's cache of one model (layer i for the i-th attention layer).
class KVCache {
 public:
  // `layers` attention layers; room for `capacity_hint` positions allocated at the first append.
  KVCache(int64_t layers, int64_t capacity_hint);
  LayerKVCache& layer(int64_t i);
  int64_t num_layers() const { return int64_t(layers_.size()); }
  // Positions cached: where the next forward_cached starts.
  int64_t length() const { return layers_.empty() ? 0 : layers_.front().length(); }
  void clear();

 private:
  std::vector<LayerKVCache> layers_;
};

// Attention of new queries over cached keys (Note [Key/value cache]): q [B, heads, L, E] at positions
// start .. start+L-1; k, v [B, kv_heads, start + L, E], heads a multiple of kv_heads (query head h reads
// key/value head h / (heads / kv_heads)). Query i attends keys j <= start + i, scaled by 1/sqrt(E), and
// with window > 0 only those with start + i - j < window (Mistral's sliding window; a key further back
// is never read). Returns [B, heads, L, E].
Tensor cached_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t start, int64_t window = 0);

// A decoder that can run over new positions with a KVCache: what nn::generate needs of a model.
class CausalLM {
 public:
  virtual ~CausalLM() = default;
  // Token ids int64 [B, T] at positions cache.length() .. cache.length()+T-1 -> logits [B, T, vocab];
  // every layer's keys and values of those positions are appended to `cache`. ShapeError when the
  // positions would pass max_positions(). Equal to the last T positions of forward() over the whole
  // sequence, up to roundoff.
  virtual Tensor forward_cached(const Tensor& idx, KVCache& cache) = 0;
  // An empty cache for this model, with room for `capacity` positions.
  virtual KVCache make_kv_cache(int64_t capacity) const = 0;
  // The longest sequence the model takes (GPT's context, Llama's max_position_embeddings).
  virtual int64_t max_positions() const = 0;
  virtual int64_t vocab_size() const = 0;
  // False for a decoder that cannot keep a cache (a model split into pipeline stages or tensor-parallel
  // parts): nn::generate then runs forward() over the whole sequence at every step, the same tokens at
  // quadratic cost, and never calls forward_cached or make_kv_cache.
  virtual bool has_kv_cache() const { return true; }
};

}  // namespace booster::nn
