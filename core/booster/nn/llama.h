// The Llama model family (Meta's Llama 1-3 architecture as Hugging Face's transformers implements it):
// a pre-norm decoder with RMSNorm, rotary position embedding, grouped-query attention and a SwiGLU
// feed-forward, no biases anywhere. Modules and parameters carry Hugging Face's names, so a
// checkpoint's tensors map one to one ("model.layers.3.self_attn.q_proj.weight"):
//
//   model.embed_tokens.weight                        [vocab, hidden]
//   model.layers.N.input_layernorm.weight            [hidden]
//   model.layers.N.self_attn.q_proj.weight           [heads * head_dim, hidden]
//   model.layers.N.self_attn.k_proj.weight           [kv_heads * head_dim, hidden]   (v_proj alike)
//   model.layers.N.self_attn.o_proj.weight           [hidden, heads * head_dim]
//   model.layers.N.post_attention_layernorm.weight   [hidden]
//   model.layers.N.mlp.gate_proj.weight              [intermediate, hidden]          (up_proj alike)
//   model.layers.N.mlp.down_proj.weight              [hidden, intermediate]
//   model.norm.weight                                [hidden]
//   lm_head.weight                                   [vocab, hidden]  (absent when tied: the embedding's)
//
// make_model builds it from {"type": "llama", ...} (make_llama below); its shard policy for the
// hybrid_parallel plugin is registered under "Llama" (Note [Llama shard policy] in llama.cpp).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "booster/distributed/process_group.h"
#include "booster/nn/container.h"
#include "booster/nn/embedding.h"
#include "booster/nn/kv_cache.h"
#include "booster/nn/linear.h"
#include "booster/nn/shard_policy.h"

namespace booster::nn {

// Hugging Face's rope_scaling (Note [RoPE scaling] in llama.cpp): none, "linear" (every inverse
// frequency divided by factor) or "llama3" (long wavelengths divided by factor, short ones kept, a
// smooth blend between low_freq_factor and high_freq_factor of original_max_position_embeddings).
struct RopeScaling {
  std::string type;  // "" (none), "linear" or "llama3"
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  bool operator==(const RopeScaling&) const = default;
};

// Hugging Face's LlamaConfig keys, with its defaults where it has one that matters here.
struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 256;
  int64_t intermediate_size = 688;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 4;       // < heads: grouped-query attention; 1: multi-query
  int64_t max_position_embeddings = 2048;  // longest sequence accepted (RoPE has no table to outgrow)
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;      // lm_head reads the embedding table (one tensor)
  // Recompute each decoder layer's activations in backward instead of keeping them (nn::checkpoint).
  bool activation_checkpointing = false;
  // The family's optional parts (DecoderFamily below): which model_type this is, q/k/v biases (Qwen2),
  // a sliding window of `sliding_window` keys (0: none) on the layers from max_window_layers on
  // (Mistral: all of them, 0; Qwen2: Note [Qwen2's window layers] in llama.cpp), RoPE scaling.
  std::string model_type = "llama";
  bool attention_bias = false;
  int64_t sliding_window = 0;
  int64_t max_window_layers = 0;
  RopeScaling rope_scaling;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // The sliding window of decoder layer i (0: it attends every earlier key).
  int64_t window_of(int64_t layer) const { return layer >= max_window_layers ? sliding_window : 0; }
  // ValueError naming the first size that is not positive or does not divide as the model needs.
  void validate() const;
};

// One decoder family of the Llama architecture, declared once (Note [Decoder families] in llama.cpp):
// its model_type (make_model's "type" and config.json's "model_type"), Hugging Face's class, the
// config.json keys it takes beyond Llama's with their defaults, and its optional parts. make_llama
// (validation), the Hugging Face reader and writer (hf.cpp), the config schema, the memory estimate and
// the shard policy read this table; a new family of this shape is one entry (decoder_families()).
struct DecoderFamily {
  std::string model_type, architecture;
  // config.json keys beyond Llama's common ones, with Hugging Face's default (null: none).
  // Each is one of "sliding_window", "use_sliding_window", "max_window_layers" (read by the one
  // parser, parse_decoder_config).
  std::vector<std::pair<std::string, nlohmann::json>> extra_keys;
  bool qkv_bias = false;              // q/k/v projections always carry biases (Qwen2)
  int64_t default_max_positions = 2048;
  double default_rope_theta = 10000.0;
};
// The families: llama, mistral, qwen2.
const std::vector<DecoderFamily>& decoder_families();
// The family of a model_type, or nullptr.
const DecoderFamily* find_decoder_family(const std::string& model_type);
// ConfigError naming the known architectures booster does not have (gemma, phi, mixtral, ...) and
// those it has, for a model_type or architecture outside the table.
[[noreturn]] void refuse_family(const std::string& where, const std::string& model_type);
// A LlamaConfig from make_model's keys (the family's keys, as make_llama documents them): ConfigError
// naming the key for an unknown key, a missing or ill-typed value or sizes that do not divide.
LlamaConfig parse_decoder_config(const nlohmann::json& config);

// y = x * rsqrt(mean(x^2 over the last dim) + eps) * weight (Hugging Face's LlamaRMSNorm): normalized in
// float32 whatever x's dtype, rounded back to x's dtype, then scaled by the weight (ones initially).
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t hidden_size, double eps = 1e-6);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "LlamaRMSNorm"; }
  std::string extra_repr() const override;

  const int64_t hidden_size;
  const double eps;
  Tensor weight;  // [hidden_size]
};

// The rotary embedding's cos and sin tables (Hugging Face's rotate_half layout), made once per device
// and dtype and shared by every layer of a model: inv_freq_i = 1 / theta^(2i / head_dim), the angle of
// position t is t * inv_freq, concatenated with itself to head_dim (Note [Rotary embedding] in
// llama.cpp). Not a module: it has no parameters and nothing to save.
class RotaryEmbedding {
 public:
  RotaryEmbedding(int64_t head_dim, double theta, RopeScaling scaling = {});
  // x [B, T, H, head_dim] rotated by positions start .. start+T-1: x * cos + rotate_half(x) * sin, where
  // rotate_half(x) = cat(-x2, x1) of x's halves. Differentiable in x; the tables are constants.
  Tensor apply(const Tensor& x, int64_t start = 0);
  // cos and sin [T, head_dim] for positions 0 .. T-1 on `device` as `dtype` (views of the cached table).
  std::pair<Tensor, Tensor> cos_sin(int64_t T, Device device, DType dtype);

  const int64_t head_dim;
  const double theta;
  const RopeScaling scaling;

 private:
  struct Table {
    Tensor cos, sin;  // [length, head_dim]; sin's first half negated: rotate_half's sign lives here
  };
  void scale_inv_freq(std::vector<float>& inv_freq) const;  // Note [RoPE scaling]
  std::mutex mutex_;
  std::map<std::tuple<int, int, int>, Table> tables_;  // (device type, device index, dtype)
};

// Causal self-attention with grouped-query heads: q_proj gives `heads` query heads, k_proj and v_proj
// `kv_heads` key/value heads (each shared by heads / kv_heads query heads), RoPE on q and k,
// softmax(q k^T / sqrt(head_dim)) v through the fused attention op, o_proj. Under tensor parallelism
// (tp_group set) the projections are this rank's heads and o_proj is row-parallel: the input enters the
// group once for q, k and v together (one all-reduce of its gradient, not three).
class LlamaAttention : public Module {
 public:
  // window: this layer's sliding window (0: none), config.window_of(layer).
  LlamaAttention(const LlamaConfig& config, std::shared_ptr<RotaryEmbedding> rotary, Generator* init_gen = nullptr,
                 int64_t window = 0);
  // This rank's heads of `full` (q/k/v rows of its heads copied, o_proj's columns: row-parallel). kv_heads
  // and heads must divide by the group size.
  LlamaAttention(const LlamaAttention& full, distributed::ProcessGroup& group);
  Tensor forward(const Tensor& x) override;  // forward(x, nullptr)
  // x [B, T, hidden]. Without a cache: positions 0 .. T-1 (or a packed layout's, Note [Packed sequences]).
  // With one: new positions x rotated by their absolute positions, attending to the keys and values in
  // `cache`, to which theirs are appended (Note [Key/value cache] in kv_cache.h).
  Tensor forward(const Tensor& x, LayerKVCache* cache);
  std::string name() const override { return "LlamaAttention"; }

  const int64_t hidden_size, heads, kv_heads, head_dim;  // heads, kv_heads: this rank's
  const int64_t window;              // sliding window (0: none)
  ModulePtr q_proj, k_proj, v_proj;  // nn::Linear, with biases in Qwen2 (this rank's rows under tp)
  ModulePtr o_proj;                  // nn::Linear, or tp::RowParallelLinear
  std::shared_ptr<RotaryEmbedding> rotary;

 private:
  distributed::ProcessGroup* tp_group_ = nullptr;
};

// SwiGLU feed-forward: down_proj(silu(gate_proj(x)) * up_proj(x)). Under tensor parallelism gate and
// up are column-parallel (this rank's intermediate features) and down row-parallel.
class LlamaMLP : public Module {
 public:
  LlamaMLP(const LlamaConfig& config, Generator* init_gen = nullptr);
  LlamaMLP(const LlamaMLP& full, distributed::ProcessGroup& group);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "LlamaMLP"; }

  ModulePtr gate_proj, up_proj, down_proj;

 private:
  distributed::ProcessGroup* tp_group_ = nullptr;
};

// h = x + self_attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h)).
class LlamaDecoderLayer : public Module {
 public:
  LlamaDecoderLayer(const LlamaConfig& config, std::shared_ptr<RotaryEmbedding> rotary, Generator* init_gen = nullptr,
                    int64_t window = 0);
  // The tensor-parallel twin of `full`: attention and MLP split, the norms `full`'s own (shared).
  LlamaDecoderLayer(const LlamaDecoderLayer& full, distributed::ProcessGroup& group);
  Tensor forward(const Tensor& x) override;               // forward(x, nullptr)
  Tensor forward(const Tensor& x, LayerKVCache* cache);  // attention through the cache when not null
  std::string name() const override { return "LlamaDecoderLayer"; }

  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMLP> mlp;
  ModulePtr input_layernorm;  // RMSNorm
  ModulePtr post_attention_layernorm;
};

// Hugging Face's LlamaModel: embed_tokens, layers.0 .. layers.{L-1}, norm. Token ids [B, T] ->
// normalized hidden states [B, T, hidden].
class LlamaModel : public Module {
 public:
  LlamaModel(const LlamaConfig& config, Generator* init_gen);
  Tensor forward(const Tensor& idx) override;  // forward(idx, nullptr)
  // With a cache: Llama::forward_cached's hidden states (token ids only, no packed input).
  Tensor forward(const Tensor& idx, KVCache* cache);
  std::string name() const override { return "LlamaModel"; }

  const LlamaConfig config;
  std::shared_ptr<RotaryEmbedding> rotary;
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<Sequential> layers;
  std::shared_ptr<RMSNorm> norm;
};

// Hugging Face's LlamaForCausalLM: token ids int64 [B, T] (T <= max_position_embeddings) -> logits
// [B, T, vocab]. Init as Hugging Face's: every Linear and the embedding N(0, 0.02) (initializer_range),
// norms ones; drawn in parameter order from Generator(seed), so deterministic from the seed (and the
// same under a LazyInitGuard). With tie_word_embeddings, lm_head is a Linear over the embedding's own
// tensor, listed once, as "model.embed_tokens.weight".
class Llama : public Module, public CausalLM {
 public:
  explicit Llama(const LlamaConfig& config, uint64_t seed = 0);
  Tensor forward(const Tensor& idx) override;
  // CausalLM (kv_cache.h): the new positions' logits, rotated by their absolute positions.
  Tensor forward_cached(const Tensor& idx, KVCache& cache) override;
  KVCache make_kv_cache(int64_t capacity) const override { return KVCache(config.num_hidden_layers, capacity); }
  int64_t max_positions() const override { return config.max_position_embeddings; }
  int64_t vocab_size() const override { return config.vocab_size; }
  std::string name() const override { return "Llama"; }

  const LlamaConfig config;
  std::shared_ptr<LlamaModel> model;
  std::shared_ptr<Linear> lm_head;
};

// {"type": "llama" | "mistral" | "qwen2", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
// "num_attention_heads" (required), "num_key_value_heads" (default: the heads), "max_position_embeddings"
// (2048), "rms_norm_eps" (1e-6), "rope_theta" (10000), "tie_word_embeddings" (false),
// "activation_checkpointing" (false), "rope_scaling" (null, or {"rope_type": "linear" | "llama3", ...} as
// Hugging Face writes it), and the family's own: mistral "sliding_window" (4096, null: none); qwen2
// "use_sliding_window" (false), "sliding_window" (4096), "max_window_layers" (28)}. ConfigError naming the key for an unknown key, a missing or
// ill-typed value, or sizes that do not divide (hidden by heads, heads by kv heads).
ModulePtr make_llama(const nlohmann::json& config, uint64_t seed);

// The shard policy registered under "Llama" (Note [Llama shard policy] in llama.cpp).
ShardedModel llama_shard_policy(const ModulePtr& model, const ShardContext& context);

}  // namespace booster::nn
