// The Llama family (llama.h): its layers, the model, its config factory and its shard policy.
//
// Note [Rotary embedding]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Hugging Face's layout ("rotate_half"), not Meta's interleaved pairs: a head's vector x is two halves
// x1 = x[:d/2], x2 = x[d/2:], and feature i of x1 is rotated with feature i of x2 by the angle
// t * inv_freq_i of its position t, inv_freq_i = 1 / theta^(2i / d):
//   rope(x) = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x2, x1),
// where cos and sin are [T, d] with the d/2 angles written twice. The table is made as Hugging Face
// makes it, in float32 (the exponent 2i/d, theta^that, its reciprocal, the product with t, each
// rounded to float32; cos and sin of that float32 angle), then cast to the activations' dtype, as
// Hugging Face casts it, so a float16 model rotates in float16. Since sin's two halves are equal,
// rotate_half(x) * sin = cat(x2, x1) * cat(-s, s): the table keeps its first half negated and the
// forward is one concatenation, two products and a sum, with no negation pass. Tables are cached per
// device and dtype, grown to the longest sequence seen, and shared by all layers (one per model).
//
// Note [Llama shard policy]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// As the GPT's (Note [Shard policies] in shard_policy.cpp), Megatron's split with Hugging Face's names:
// embed_tokens vocabulary-parallel; per layer, q_proj, k_proj, v_proj (by heads: a rank holds
// heads/tp query heads and kv_heads/tp key/value heads, which are exactly the ones its query heads
// read, since the query heads of one group are adjacent) and gate_proj, up_proj column-parallel,
// o_proj and down_proj row-parallel; the norms replicated; lm_head column-parallel over the
// vocabulary with the vocabulary-parallel cross-entropy in training. With tied embeddings lm_head is
// the vocabulary-parallel embedding's own shard (the two split the same rows alike). tp must divide
// the heads, the key/value heads, the intermediate size and the vocabulary; otherwise the policy
// refuses, naming the sizes that would work (replicating key/value heads, as Megatron does when
// tp > kv_heads, is not done). The pipeline cuts between decoder layers, balanced by parameters (the
// embedding counted on the first stage, norm and lm_head on the last), as the GPT's; tied embeddings
// need the first and the last stage to be one, so they are refused with pp > 1.
//
// Note [Decoder families]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Mistral and Qwen2 are Llama with optional parts: Mistral a sliding window on every layer, Qwen2 q/k/v
// biases and a window on its upper layers; Llama 3 adds RoPE scaling. One table (decoder_families())
// declares each family: its model_type and Hugging Face class, the config.json keys it adds with their
// defaults, and whether its q/k/v carry biases. One parser (parse_decoder_config) reads any family's
// keys into a LlamaConfig, so make_model, the Hugging Face reader (hf.cpp: config.json's keys are the
// same), the schema and the memory estimate take a new family from its entry; the writer writes the
// entry's keys back. Tensor names are Hugging Face's in all three (biases as "...q_proj.bias"); under
// tensor parallelism a bias is split as its weight (column-parallel q/k/v: the rank's rows of both).
// Other architectures of this lineage that differ in more than these parts (gemma's scaled embedding
// and GeGLU, phi's partial rotary and dense MLP, mixtral's and qwen2_moe's experts) are refused by name.
//
// Note [Qwen2's window layers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Qwen2's config.json writes use_sliding_window, sliding_window and max_window_layers; transformers'
// Qwen2Config makes sliding_window None unless use_sliding_window, and layer i a "sliding_attention"
// layer when sliding_window is set and i >= max_window_layers (layer_types), the rest full attention.
// So the lower max_window_layers layers attend everything and the ones above use the window; Mistral
// is the case max_window_layers = 0. LlamaConfig keeps sliding_window (0: none) and max_window_layers.
//
// Note [RoPE scaling]
// ~~~~~~~~~~~~~~~~~~~
// transformers' rope_init_functions, on the default inverse frequencies, in float32 as there:
//   linear: inv_freq / factor.
//   llama3: wavelen = 2 pi / inv_freq; low = original / low_freq_factor, high = original /
//     high_freq_factor (wavelengths); wavelen > low: inv_freq / factor; wavelen < high: inv_freq;
//     between: (1 - s) inv_freq / factor + s inv_freq with s = (original / wavelen - low_freq_factor) /
//     (high_freq_factor - low_freq_factor).
// Both leave the attention scaling at 1 (no mscale), so only the table changes.
#include "booster/nn/llama.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <set>

#include "booster/autograd/autograd.h"
#include "booster/common/error.h"
#include "booster/nn/activation_checkpoint.h"
#include "booster/nn/packing.h"
#include "booster/nn/families.h"
#include "booster/nn/init.h"
#include "booster/nn/lora.h"
#include "booster/nn/pipeline.h"
#include "booster/nn/tensor_parallel.h"
#include "booster/ops/ops.h"

namespace booster::nn {

void LlamaConfig::validate() const {
  BOOSTER_CHECK(vocab_size > 0 && hidden_size > 0 && intermediate_size > 0 && num_hidden_layers > 0 &&
                    num_attention_heads > 0 && num_key_value_heads > 0 && max_position_embeddings > 0,
                ValueError, "Llama: vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
                "num_attention_heads, num_key_value_heads and max_position_embeddings must be positive, got ",
                vocab_size, ", ", hidden_size, ", ", intermediate_size, ", ", num_hidden_layers, ", ",
                num_attention_heads, ", ", num_key_value_heads, ", ", max_position_embeddings);
  BOOSTER_CHECK(hidden_size % num_attention_heads == 0, ValueError, "Llama: hidden_size ", hidden_size,
                " is not divisible by num_attention_heads ", num_attention_heads);
  BOOSTER_CHECK(head_dim() % 2 == 0, ValueError, "Llama: the head size hidden_size / num_attention_heads = ",
                head_dim(), " must be even (the rotary embedding turns pairs of features)");
  BOOSTER_CHECK(num_attention_heads % num_key_value_heads == 0, ValueError, "Llama: num_attention_heads ",
                num_attention_heads, " is not divisible by num_key_value_heads ", num_key_value_heads);
  BOOSTER_CHECK(rms_norm_eps > 0.0 && rope_theta > 0.0, ValueError,
                "Llama: rms_norm_eps and rope_theta must be positive, got ", rms_norm_eps, " and ", rope_theta);
  BOOSTER_CHECK(sliding_window >= 0 && max_window_layers >= 0, ValueError, "Llama: sliding_window and ",
                "max_window_layers must be >= 0 (0: no window, all layers windowed), got ", sliding_window, " and ",
                max_window_layers);
  BOOSTER_CHECK(rope_scaling.type.empty() || rope_scaling.type == "linear" || rope_scaling.type == "llama3", ValueError,
                "Llama: rope_scaling type \"", rope_scaling.type, "\" is not one of \"\" (none), \"linear\", \"llama3\"");
}

namespace {

constexpr double kInitStd = 0.02;  // Hugging Face's initializer_range

// A bias-free Linear(in -> out) drawn N(0, 0.02) from gen, one draw per element.
std::shared_ptr<Linear> normal_linear(int64_t in, int64_t out, Generator& gen) {
  auto l = std::make_shared<Linear>(Tensor::empty({out, in}));
  init::normal_(l->weight, 0.0, kInitStd, gen);
  return l;
}

Generator& gen_or_default(Generator* g) { return g != nullptr ? *g : default_generator(); }

const Linear& as_linear(const ModulePtr& m, const char* what) {
  const auto* l = dynamic_cast<const Linear*>(m.get());
  BOOSTER_CHECK(l != nullptr, IncompatibleError, "Llama tensor parallelism: ", what, " is a ", m->name(),
                ", expected an unsplit nn::Linear (is the model split already?)");
  return *l;
}

// This rank's rows (output features) of `full`, as a plain Linear over a copy; a bias follows its rows.
std::shared_ptr<Linear> row_shard(const ModulePtr& full, distributed::ProcessGroup& group, const char* what) {
  const Linear& l = as_linear(full, what);
  return std::make_shared<Linear>(shard_of(l.weight, {0, 1}, group.rank(), group.size()),
                                  l.bias.defined() ? shard_of(l.bias, {0, 1}, group.rank(), group.size()) : Tensor());
}

}  // namespace

// ------------------------------------------------------------------------------------------ families

const std::vector<DecoderFamily>& decoder_families() {
  static const std::vector<DecoderFamily> families = {
      {"llama", "LlamaForCausalLM", {}, false, 2048, 10000.0},
      {"mistral", "MistralForCausalLM", {{"sliding_window", 4096}}, false, 131072, 10000.0},
      {"qwen2", "Qwen2ForCausalLM",
       {{"use_sliding_window", false}, {"sliding_window", 4096}, {"max_window_layers", 28}}, true, 32768, 10000.0},
  };
  return families;
}

const DecoderFamily* find_decoder_family(const std::string& model_type) {
  for (const DecoderFamily& f : decoder_families())
    if (f.model_type == model_type) return &f;
  return nullptr;
}

void refuse_family(const std::string& where, const std::string& model_type) {
  static const std::vector<std::string> known_other = {
      "gemma", "gemma2", "gemma3", "phi", "phi3", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "falcon",
      "gpt_neox", "mpt", "deepseek_v2", "deepseek_v3", "olmo", "starcoder2", "cohere", "stablelm"};
  std::string have;
  for (const DecoderFamily& f : decoder_families()) have += (have.empty() ? "\"" : ", \"") + f.model_type + "\"";
  const bool known = std::find(known_other.begin(), known_other.end(), model_type) != known_other.end();
  BOOSTER_FAIL(ConfigError, where, ": model_type \"", model_type, "\" ",
               known ? "is an architecture booster does not implement" : "is not a family booster has",
               "; it reads ", have, " and \"gpt2\"");
}

namespace {

std::string quoted_list(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "\"" : ", \"") + k + "\"";
  return out;
}

int64_t positive_int(const nlohmann::json& cfg, const std::string& key) {
  const auto& v = cfg.at(key);
  BOOSTER_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, ConfigError, "make_model: \"", key,
                "\" must be a positive integer, got ", v.dump());
  return v.get<int64_t>();
}

double positive_number(const nlohmann::json& cfg, const std::string& key) {
  const auto& v = cfg.at(key);
  BOOSTER_CHECK(v.is_number() && v.get<double>() > 0.0 && std::isfinite(v.get<double>()), ConfigError,
                "make_model: \"", key, "\" must be a positive number, got ", v.dump());
  return v.get<double>();
}

bool boolean(const nlohmann::json& cfg, const std::string& key) {
  const auto& v = cfg.at(key);
  BOOSTER_CHECK(v.is_boolean(), ConfigError, "make_model: \"", key, "\" must be true or false, got ", v.dump());
  return v.get<bool>();
}

// Hugging Face's rope_scaling object (Note [RoPE scaling]); null and {"rope_type": "default"} are none.
RopeScaling parse_rope_scaling(const nlohmann::json& j) {
  RopeScaling r;
  if (j.is_null()) return r;
  BOOSTER_CHECK(j.is_object(), ConfigError, "make_model: \"rope_scaling\" must be null or an object, got ", j.dump());
  const nlohmann::json type = j.contains("rope_type") ? j.at("rope_type") : j.value("type", nlohmann::json());
  BOOSTER_CHECK(type.is_string(), ConfigError, "make_model: \"rope_scaling\" needs a \"rope_type\" (or \"type\"), got ",
                j.dump());
  const std::string t = type.get<std::string>();
  if (t == "default") return r;
  BOOSTER_CHECK(t == "linear" || t == "llama3", ConfigError, "make_model: rope_scaling's rope_type \"", t,
                "\" is not implemented; booster supports \"default\", \"linear\" (factor) and \"llama3\" (factor, ",
                "low_freq_factor, high_freq_factor, original_max_position_embeddings)");
  r.type = t;
  for (const auto& [key, v] : j.items()) {
    const bool known = key == "rope_type" || key == "type" || key == "factor" ||
                       (t == "llama3" && (key == "low_freq_factor" || key == "high_freq_factor" ||
                                          key == "original_max_position_embeddings"));
    BOOSTER_CHECK(known, ConfigError, "make_model: rope_scaling key \"", key, "\" is not one rope_type \"", t,
                  "\" takes (", t == "linear" ? "factor" : "factor, low_freq_factor, high_freq_factor, "
                  "original_max_position_embeddings", ")");
  }
  BOOSTER_CHECK(j.contains("factor"), ConfigError, "make_model: rope_scaling of rope_type \"", t, "\" needs \"factor\"");
  r.factor = positive_number(j, "factor");
  if (t == "llama3") {
    for (const char* key : {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      BOOSTER_CHECK(j.contains(key), ConfigError, "make_model: rope_scaling of rope_type \"llama3\" needs \"", key, "\"");
    r.low_freq_factor = positive_number(j, "low_freq_factor");
    r.high_freq_factor = positive_number(j, "high_freq_factor");
    r.original_max_position_embeddings = positive_int(j, "original_max_position_embeddings");
    BOOSTER_CHECK(r.high_freq_factor > r.low_freq_factor, ConfigError, "make_model: rope_scaling's high_freq_factor ",
                  r.high_freq_factor, " must exceed low_freq_factor ", r.low_freq_factor);
  }
  return r;
}

}  // namespace

LlamaConfig parse_decoder_config(const nlohmann::json& cfg) {
  BOOSTER_CHECK(cfg.is_object(), ConfigError, "make_model: a model config must be an object, got ", cfg.dump());
  const std::string type = cfg.value("type", std::string("llama"));
  const DecoderFamily* family = find_decoder_family(type);
  if (family == nullptr) refuse_family("make_model", type);
  const std::vector<std::string> required = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads"};
  std::vector<std::string> allowed = {"type", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                                      "rope_theta", "tie_word_embeddings", "activation_checkpointing", "rope_scaling"};
  allowed.insert(allowed.end(), required.begin(), required.end());
  for (const auto& [key, fallback] : family->extra_keys) allowed.push_back(key);
  for (const auto& [key, value] : cfg.items())
    BOOSTER_CHECK(std::find(allowed.begin(), allowed.end(), key) != allowed.end(), ConfigError,
                  "make_model: unknown key \"", key, "\" for model type \"", type, "\"; allowed keys are ",
                  quoted_list(allowed));
  for (const auto& key : required)
    BOOSTER_CHECK(cfg.contains(key), ConfigError, "make_model: missing key \"", key, "\" for model type \"", type,
                  "\"; required keys are ", quoted_list(required));
  LlamaConfig c;
  c.model_type = type;
  c.attention_bias = family->qkv_bias;
  c.max_position_embeddings = family->default_max_positions;
  c.rope_theta = family->default_rope_theta;
  c.vocab_size = positive_int(cfg, "vocab_size");
  c.hidden_size = positive_int(cfg, "hidden_size");
  c.intermediate_size = positive_int(cfg, "intermediate_size");
  c.num_hidden_layers = positive_int(cfg, "num_hidden_layers");
  c.num_attention_heads = positive_int(cfg, "num_attention_heads");
  c.num_key_value_heads =
      cfg.contains("num_key_value_heads") ? positive_int(cfg, "num_key_value_heads") : c.num_attention_heads;
  if (cfg.contains("max_position_embeddings")) c.max_position_embeddings = positive_int(cfg, "max_position_embeddings");
  if (cfg.contains("rms_norm_eps")) c.rms_norm_eps = positive_number(cfg, "rms_norm_eps");
  if (cfg.contains("rope_theta")) c.rope_theta = positive_number(cfg, "rope_theta");
  if (cfg.contains("tie_word_embeddings")) c.tie_word_embeddings = boolean(cfg, "tie_word_embeddings");
  if (cfg.contains("activation_checkpointing")) c.activation_checkpointing = boolean(cfg, "activation_checkpointing");
  if (cfg.contains("rope_scaling")) c.rope_scaling = parse_rope_scaling(cfg.at("rope_scaling"));
  // The family's own keys (Note [Qwen2's window layers]): a window of sliding_window keys, null for none.
  auto value = [&](const std::string& key) {
    for (const auto& [k, fallback] : family->extra_keys)
      if (k == key) return cfg.contains(key) ? cfg.at(key) : fallback;
    return nlohmann::json();
  };
  const nlohmann::json window = value("sliding_window");
  if (!window.is_null()) {
    BOOSTER_CHECK(window.is_number_integer() && window.get<int64_t>() > 0, ConfigError, "make_model: \"sliding_window\" ",
                  "must be a positive integer or null (no window), got ", window.dump());
    c.sliding_window = window.get<int64_t>();
  }
  const nlohmann::json use = value("use_sliding_window");
  if (!use.is_null()) {
    BOOSTER_CHECK(use.is_boolean(), ConfigError, "make_model: \"use_sliding_window\" must be true or false, got ", use.dump());
    if (!use.get<bool>()) c.sliding_window = 0;
  }
  const nlohmann::json layers = value("max_window_layers");
  if (!layers.is_null()) {
    BOOSTER_CHECK(layers.is_number_integer() && layers.get<int64_t>() >= 0, ConfigError,
                  "make_model: \"max_window_layers\" must be an integer >= 0, got ", layers.dump());
    c.max_window_layers = layers.get<int64_t>();
  }
  BOOSTER_CHECK(c.hidden_size % c.num_attention_heads == 0, ConfigError, "make_model: \"hidden_size\" ",
                c.hidden_size, " must be divisible by \"num_attention_heads\" ", c.num_attention_heads);
  BOOSTER_CHECK(c.head_dim() % 2 == 0, ConfigError, "make_model: \"hidden_size\" / \"num_attention_heads\" = ",
                c.head_dim(), " must be even (the rotary embedding turns pairs of features)");
  BOOSTER_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, ConfigError,
                "make_model: \"num_attention_heads\" ", c.num_attention_heads,
                " must be divisible by \"num_key_value_heads\" ", c.num_key_value_heads,
                " (each key/value head serves a whole group of query heads)");
  return c;
}

// ------------------------------------------------------------------------------------------ RMSNorm

RMSNorm::RMSNorm(int64_t hidden, double eps_) : hidden_size(hidden), eps(eps_) {
  BOOSTER_CHECK(hidden > 0 && eps > 0.0, ValueError, "RMSNorm: hidden_size and eps must be positive, got ", hidden,
                " and ", eps);
  weight = register_parameter("weight", ones({hidden}));
}

Tensor RMSNorm::forward(const Tensor& x) {
  BOOSTER_CHECK(x.dim() >= 1 && x.size(-1) == hidden_size, ShapeError, "RMSNorm: expected input [..., ",
                hidden_size, "], got shape ", x.shape());
  // Hugging Face normalizes in float32 and rounds back before the weight; float64 stays float64.
  const DType compute = x.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  const Tensor xf = x.to(compute);
  const Tensor ms = mean(xf * xf, {-1}, /*keepdim=*/true);
  return weight * (xf * rsqrt(ms + eps)).to(x.dtype());
}

std::string RMSNorm::extra_repr() const { return str("(", hidden_size, ",), eps=", eps); }

// ------------------------------------------------------------------------------------------ rotary

RotaryEmbedding::RotaryEmbedding(int64_t d, double th, RopeScaling sc) : head_dim(d), theta(th), scaling(std::move(sc)) {
  BOOSTER_CHECK(d > 0 && d % 2 == 0 && th > 0.0, ValueError, "RotaryEmbedding: head_dim must be positive and even ",
                "and theta positive, got ", d, " and ", th);
}

std::pair<Tensor, Tensor> RotaryEmbedding::cos_sin(int64_t T, Device device, DType dtype) {
  std::lock_guard lock(mutex_);
  Table& table = tables_[{int(device.type), int(device.index), int(dtype)}];
  const int64_t have = table.cos.defined() ? table.cos.size(0) : 0;
  if (have < T) {
    // Grown geometrically, so a run whose lengths creep up rebuilds it a logarithmic number of times.
    const int64_t length = std::max(T, 2 * have);
    const int64_t half = head_dim / 2;
    NoGradGuard no_grad;
    Tensor c = Tensor::empty({length, head_dim}), s = Tensor::empty({length, head_dim});  // float32, CPU
    float* pc = c.data<float>();
    float* ps = s.data<float>();
    std::vector<float> inv_freq(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {  // Note [Rotary embedding]: float32 steps, as Hugging Face
      const float exponent = float(2 * i) / float(head_dim);
      inv_freq[size_t(i)] = 1.0f / std::pow(float(theta), exponent);
    }
    scale_inv_freq(inv_freq);
    for (int64_t t = 0; t < length; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const float angle = float(t) * inv_freq[size_t(i)];
        const float cv = float(std::cos(double(angle))), sv = float(std::sin(double(angle)));
        pc[t * head_dim + i] = pc[t * head_dim + half + i] = cv;
        ps[t * head_dim + i] = -sv;  // rotate_half's sign (Note [Rotary embedding])
        ps[t * head_dim + half + i] = sv;
      }
    table.cos = c.to(dtype).to(device);
    table.sin = s.to(dtype).to(device);
  }
  return {table.cos.narrow(0, 0, T), table.sin.narrow(0, 0, T)};
}

void RotaryEmbedding::scale_inv_freq(std::vector<float>& inv_freq) const {
  // Note [RoPE scaling]: float32 steps in transformers' order.
  const float factor = float(scaling.factor);
  if (scaling.type == "linear") {
    for (float& f : inv_freq) f = f / factor;
  } else if (scaling.type == "llama3") {
    const float original = float(scaling.original_max_position_embeddings);
    const float low = float(scaling.low_freq_factor), high = float(scaling.high_freq_factor);
    const float low_wavelen = float(double(scaling.original_max_position_embeddings) / scaling.low_freq_factor);
    const float high_wavelen = float(double(scaling.original_max_position_embeddings) / scaling.high_freq_factor);
    const float two_pi = float(2.0 * 3.14159265358979323846);
    for (float& f : inv_freq) {
      const float wavelen = two_pi / f;
      const float scaled = wavelen > low_wavelen ? f / factor : f;
      if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
        const float smooth = (original / wavelen - low) / (high - low);
        f = (1.0f - smooth) * scaled / factor + smooth * scaled;
      } else {
        f = scaled;
      }
    }
  }
}

Tensor RotaryEmbedding::apply(const Tensor& x, int64_t start) {
  BOOSTER_CHECK(x.dim() == 4 && x.size(3) == head_dim, ShapeError, "RotaryEmbedding: expected [B, T, heads, ",
                head_dim, "], got shape ", x.shape());
  BOOSTER_CHECK(start >= 0, ValueError, "RotaryEmbedding: the first position must be >= 0, got ", start);
  const int64_t T = x.size(1), half = head_dim / 2;
  auto [cos, sin] = cos_sin(start + T, x.device(), x.dtype());
  cos = cos.narrow(0, start, T).view({T, 1, head_dim});  // the angles of the absolute positions
  sin = sin.narrow(0, start, T).view({T, 1, head_dim});
  const Tensor swapped = cat({x.narrow(3, half, half), x.narrow(3, 0, half)}, 3);  // cat(x2, x1)
  return x * cos + swapped * sin;
}

// ------------------------------------------------------------------------------------------ attention

LlamaAttention::LlamaAttention(const LlamaConfig& c, std::shared_ptr<RotaryEmbedding> rope, Generator* init_gen,
                               int64_t window_)
    : hidden_size(c.hidden_size),
      heads(c.num_attention_heads),
      kv_heads(c.num_key_value_heads),
      head_dim(c.head_dim()),
      window(window_),
      rotary(std::move(rope)) {
  c.validate();
  BOOSTER_CHECK(rotary != nullptr && rotary->head_dim == head_dim, ValueError,
                "LlamaAttention: needs a rotary embedding of head size ", head_dim);
  Generator& g = gen_or_default(init_gen);
  // Qwen2's q/k/v biases start at zero, as Hugging Face's _init_weights sets them (no draws).
  auto projection = [&](int64_t out) {
    auto l = normal_linear(hidden_size, out, g);
    return c.attention_bias ? std::make_shared<Linear>(l->weight, zeros({out})) : l;
  };
  q_proj = register_module("q_proj", projection(heads * head_dim));
  k_proj = register_module("k_proj", projection(kv_heads * head_dim));
  v_proj = register_module("v_proj", projection(kv_heads * head_dim));
  o_proj = register_module("o_proj", normal_linear(heads * head_dim, hidden_size, g));
}

LlamaAttention::LlamaAttention(const LlamaAttention& full, distributed::ProcessGroup& group)
    : hidden_size(full.hidden_size),
      heads(full.heads / group.size()),
      kv_heads(full.kv_heads / group.size()),
      head_dim(full.head_dim),
      window(full.window),
      rotary(full.rotary),
      tp_group_(&group) {
  BOOSTER_CHECK(full.tp_group_ == nullptr, IncompatibleError, "LlamaAttention: already split");
  BOOSTER_CHECK(full.heads % group.size() == 0 && full.kv_heads % group.size() == 0, IncompatibleError,
                "LlamaAttention: ", full.heads, " query heads and ", full.kv_heads,
                " key/value heads must both divide by the tensor-parallel size ", group.size());
  q_proj = register_module("q_proj", row_shard(full.q_proj, group, "q_proj"));
  k_proj = register_module("k_proj", row_shard(full.k_proj, group, "k_proj"));
  v_proj = register_module("v_proj", row_shard(full.v_proj, group, "v_proj"));
  o_proj = register_module("o_proj", std::make_shared<tp::RowParallelLinear>(as_linear(full.o_proj, "o_proj"), group,
                                                                             /*input_is_parallel=*/true));
}

Tensor LlamaAttention::forward(const Tensor& x) { return forward(x, nullptr); }

// Note [One attention path]: the uncached and the cached forward share the projections, the rotary
// turn (by absolute positions: 0 .. T-1 without a cache, cache->length() onwards with one) and o_proj.
// They differ only in the attention itself: without a cache, the fused op over this call's keys (grouped
// heads repeated, the sliding window and packed documents as an AttentionMask); with one, the keys are
// appended to the cache and cached_attention reads them all (grouped heads and window handled there).
// A cached forward reads no packed layout: generation runs one document per row.
Tensor LlamaAttention::forward(const Tensor& x, LayerKVCache* cache) {
  BOOSTER_CHECK(x.dim() == 3 && x.size(2) == hidden_size, ShapeError, "LlamaAttention: expected input [B, T, ",
                hidden_size, "], got shape ", x.shape());
  const int64_t B = x.size(0), T = x.size(1), start = cache != nullptr ? cache->length() : 0;
  // Under tensor parallelism x enters the group once for all three projections (Megatron's f).
  const Tensor h = tp_group_ != nullptr ? tp::copy_to_group(x, *tp_group_) : x;
  // Note [Packed sequences]: each document turns by its own positions and attends only to itself.
  const SequenceLayout* packed = cache == nullptr ? current_sequence_layout() : nullptr;
  auto rotate = [&](const Tensor& t) {
    return packed ? rotate_at_positions(*rotary, t, packed->positions) : rotary->apply(t, start);
  };
  Tensor q = rotate((*q_proj)(h).view({B, T, heads, head_dim}));
  Tensor k = rotate((*k_proj)(h).view({B, T, kv_heads, head_dim}));
  Tensor v = (*v_proj)(h).view({B, T, kv_heads, head_dim});
  Tensor y;
  if (cache != nullptr) {
    auto [keys, values] = cache->append(k.transpose(1, 2), v.transpose(1, 2));  // [B, kv_heads, start + T, d]
    y = cached_attention(q.transpose(1, 2), keys, values, start, window);       // grouped heads read their kv head
  } else {
    if (kv_heads != heads) {
      // Grouped-query attention: query head j reads key/value head j / (heads / kv_heads).
      const int64_t rep = heads / kv_heads;
      auto repeat = [&](const Tensor& t) {
        return t.unsqueeze(3).expand({B, T, kv_heads, rep, head_dim}).reshape({B, T, heads, head_dim});
      };
      k = repeat(k);
      v = repeat(v);
    }
    AttentionMask mask;
    mask.window = window < T ? window : 0;  // a window as long as the sequence masks nothing more
    if (packed) mask.segments = packed->segments;
    y = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), true, std::nullopt,
                                     mask);
  }
  y = y.transpose(1, 2).reshape({B, T, heads * head_dim});
  return (*o_proj)(y);
}

// ------------------------------------------------------------------------------------------ MLP

LlamaMLP::LlamaMLP(const LlamaConfig& c, Generator* init_gen) {
  Generator& g = gen_or_default(init_gen);
  gate_proj = register_module("gate_proj", normal_linear(c.hidden_size, c.intermediate_size, g));
  up_proj = register_module("up_proj", normal_linear(c.hidden_size, c.intermediate_size, g));
  down_proj = register_module("down_proj", normal_linear(c.intermediate_size, c.hidden_size, g));
}

LlamaMLP::LlamaMLP(const LlamaMLP& full, distributed::ProcessGroup& group) : tp_group_(&group) {
  BOOSTER_CHECK(full.tp_group_ == nullptr, IncompatibleError, "LlamaMLP: already split");
  gate_proj = register_module("gate_proj", row_shard(full.gate_proj, group, "gate_proj"));
  up_proj = register_module("up_proj", row_shard(full.up_proj, group, "up_proj"));
  down_proj = register_module("down_proj", std::make_shared<tp::RowParallelLinear>(
                                               as_linear(full.down_proj, "down_proj"), group, true));
}

Tensor LlamaMLP::forward(const Tensor& x) {
  const Tensor h = tp_group_ != nullptr ? tp::copy_to_group(x, *tp_group_) : x;
  return (*down_proj)(silu((*gate_proj)(h)) * (*up_proj)(h));
}

// ------------------------------------------------------------------------------------------ layer

// Registered in Hugging Face's order (attention, MLP, then the norms), so parameters list, and draw
// their init, in its state-dict order.
LlamaDecoderLayer::LlamaDecoderLayer(const LlamaConfig& c, std::shared_ptr<RotaryEmbedding> rope, Generator* gen,
                                     int64_t window) {
  self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(c, std::move(rope), gen, window));
  mlp = register_module("mlp", std::make_shared<LlamaMLP>(c, gen));
  input_layernorm = register_module("input_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps));
}

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaDecoderLayer& full, distributed::ProcessGroup& group) {
  self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(*full.self_attn, group));
  mlp = register_module("mlp", std::make_shared<LlamaMLP>(*full.mlp, group));
  input_layernorm = register_module("input_layernorm", full.input_layernorm);
  post_attention_layernorm = register_module("post_attention_layernorm", full.post_attention_layernorm);
}

Tensor LlamaDecoderLayer::forward(const Tensor& x) { return forward(x, nullptr); }

Tensor LlamaDecoderLayer::forward(const Tensor& x, LayerKVCache* cache) {
  const Tensor normed = (*input_layernorm)(x);
  // Without a cache through operator(), so hooks and error paths see the attention module as before.
  const Tensor h = x + (cache != nullptr ? self_attn->forward(normed, cache) : (*self_attn)(normed));
  return h + (*mlp)((*post_attention_layernorm)(h));
}

// ------------------------------------------------------------------------------------------ model

namespace {

void check_ids(const Tensor& idx, int64_t max_positions) {
  BOOSTER_CHECK(idx.dim() == 2, ShapeError, "Llama: expected token ids [B, T], got shape ", idx.shape());
  BOOSTER_CHECK(idx.size(1) <= max_positions, ShapeError, "Llama: sequence length ", idx.size(1),
                " exceeds max_position_embeddings ", max_positions, "; pass at most ", max_positions,
                " tokens or raise max_position_embeddings");
}

Tensor run_layers(const std::vector<ModulePtr>& layers, Tensor h, bool activation_checkpointing) {
  for (const ModulePtr& layer : layers) h = activation_checkpointing ? checkpoint(*layer, h) : (*layer)(h);
  return h;
}

}  // namespace

LlamaModel::LlamaModel(const LlamaConfig& c, Generator* init_gen)
    : config(c), rotary(std::make_shared<RotaryEmbedding>(c.head_dim(), c.rope_theta, c.rope_scaling)) {
  c.validate();
  Generator& g = gen_or_default(init_gen);
  {
    // Embedding's own N(0, 1) draws go to a scratch generator; the table is drawn N(0, 0.02) from g.
    Generator scratch(0);
    embed_tokens = register_module("embed_tokens", std::make_shared<Embedding>(c.vocab_size, c.hidden_size, &scratch));
  }
  init::normal_(embed_tokens->weight, 0.0, kInitStd, g);
  layers = register_module("layers", std::make_shared<Sequential>());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    layers->push_back(std::make_shared<LlamaDecoderLayer>(c, rotary, &g, c.window_of(i)));
  norm = register_module("norm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps));
}

Tensor LlamaModel::forward(const Tensor& idx) { return forward(idx, nullptr); }

Tensor LlamaModel::forward(const Tensor& idx, KVCache* cache) {
  Tensor ids = idx;
  std::optional<SequenceLayoutScope> scope;
  if (cache == nullptr && is_packed(idx)) {
    // Note [Packed sequences]: the layout holds for this forward (a checkpointed layer keeps it for its
    // recompute, Note [Recomputing in backward]).
    auto [unpacked, layout] = unpack_sequences(idx);
    ids = unpacked;
    scope.emplace(std::move(layout));
  }
  if (cache == nullptr) {
    check_ids(ids, config.max_position_embeddings);
  } else {
    BOOSTER_CHECK(idx.dim() == 2, ShapeError, "Llama: expected token ids [B, T], got shape ", idx.shape());
    const int64_t start = cache->length(), T = idx.size(1);
    BOOSTER_CHECK(cache->num_layers() == config.num_hidden_layers, ValueError, "Llama: a key/value cache of ",
                  cache->num_layers(), " layers for a model of ", config.num_hidden_layers,
                  "; make it with make_kv_cache");
    BOOSTER_CHECK(start + T <= config.max_position_embeddings, ShapeError, "Llama: positions ", start, " .. ",
                  start + T - 1, " pass max_position_embeddings ", config.max_position_embeddings,
                  "; generate at most that many tokens in all or raise max_position_embeddings");
  }
  Tensor h = (*embed_tokens)(ids);
  const std::vector<ModulePtr> children = layers->children();
  if (cache == nullptr) return (*norm)(run_layers(children, h, config.activation_checkpointing));
  for (size_t i = 0; i < children.size(); ++i) {
    auto* layer = dynamic_cast<LlamaDecoderLayer*>(children[i].get());
    BOOSTER_CHECK(layer != nullptr, IncompatibleError, "Llama: layer ", i, " is a ", children[i]->name(),
                  ", not a LlamaDecoderLayer; a pipeline stage has no cached forward");
    h = layer->forward(h, &cache->layer(int64_t(i)));
  }
  return (*norm)(h);
}

Llama::Llama(const LlamaConfig& c, uint64_t seed) : config(c) {
  c.validate();
  Generator gen(seed);
  model = register_module("model", std::make_shared<LlamaModel>(c, &gen));
  lm_head = register_module("lm_head", c.tie_word_embeddings
                                           ? std::make_shared<Linear>(model->embed_tokens->weight)
                                           : normal_linear(c.hidden_size, c.vocab_size, gen));
  set_tensor_names();
}

Tensor Llama::forward(const Tensor& idx) { return (*lm_head)((*model)(idx)); }

Tensor Llama::forward_cached(const Tensor& idx, KVCache& cache) { return (*lm_head)(model->forward(idx, &cache)); }

// ------------------------------------------------------------------------------------------ factory

ModulePtr make_llama(const nlohmann::json& cfg, uint64_t seed) { return std::make_shared<Llama>(parse_decoder_config(cfg), seed); }

// ------------------------------------------------------------------------------------------ shard policy

namespace {

// Layers [begin, end) of a Llama, with the embedding on the first stage and norm + lm_head on the
// last, named as in the whole model ("model.layers.5.mlp.up_proj.weight").
class LlamaStage final : public Module {
 public:
  LlamaStage(const LlamaConfig& config, ModulePtr embed, std::vector<std::pair<int64_t, ModulePtr>> layers,
             ModulePtr norm, ModulePtr head)
      : config_(config), embed_(std::move(embed)), norm_(std::move(norm)), head_(std::move(head)) {
    auto body = register_module("model", std::make_shared<Sequential>());
    if (embed_) body->push_back("embed_tokens", embed_);
    auto stack = std::make_shared<Sequential>();
    for (auto& [i, layer] : layers) {
      stack->push_back(std::to_string(i), layer);
      layers_.push_back(layer);
    }
    body->push_back("layers", stack);
    if (norm_) body->push_back("norm", norm_);
    if (head_) register_module("lm_head", head_);
  }
  std::string name() const override { return "LlamaStage"; }

  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    // Note [Packed sequences]: the first stage unpacks a packed input and holds its layout for its own
    // layers; a later stage runs under the layout its PipelineStage installs from the same micro-batch
    // (Note [Packed micro-batches] in pipeline.cpp).
    std::optional<SequenceLayoutScope> scope;
    if (embed_) {
      Tensor ids = x;
      if (is_packed(x)) {
        auto [unpacked, layout] = unpack_sequences(x);
        ids = unpacked;
        scope.emplace(std::move(layout));
      }
      check_ids(ids, config_.max_position_embeddings);
      h = (*embed_)(ids);
    }
    h = run_layers(layers_, h, config_.activation_checkpointing);
    if (norm_) h = (*norm_)(h);
    if (head_) h = (*head_)(h);
    return h;
  }

 private:
  LlamaConfig config_;
  ModulePtr embed_, norm_, head_;
  std::vector<ModulePtr> layers_;
};

std::vector<int64_t> divisors_of(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

}  // namespace

ShardedModel llama_shard_policy(const ModulePtr& whole, const ShardContext& c) {
  const auto llama = std::dynamic_pointer_cast<Llama>(whole);
  BOOSTER_CHECK(llama != nullptr, IncompatibleError, "shard policy 'Llama': the model is a ", whole->name(),
                ", not a booster::nn::Llama");
  const LlamaConfig& cfg = llama->config;
  BOOSTER_CHECK(c.stages >= 1 && c.stage >= 0 && c.stage < c.stages, ValueError, "pipeline: stage ", c.stage,
                " does not exist in a pipeline of ", c.stages, " stages");
  BOOSTER_CHECK(!cfg.tie_word_embeddings || c.stages == 1, IncompatibleError,
                "shard policy 'Llama': tie_word_embeddings shares one tensor between the embedding (first "
                "pipeline stage) and lm_head (last stage), which a pipeline of ", c.stages,
                " stages puts on different ranks; use pp_size 1, or untie the embeddings");
  const std::vector<ModulePtr> layers = llama->model->layers->children();
  std::vector<int64_t> per_stage = c.stage_layers;
  if (per_stage.empty()) {
    std::vector<int64_t> sizes;
    for (const ModulePtr& l : layers) sizes.push_back(l->num_parameters());
    const int64_t head = cfg.tie_word_embeddings ? 0 : llama->lm_head->num_parameters();
    per_stage = pp::balance_units(sizes, llama->model->embed_tokens->num_parameters(),
                                  llama->model->norm->num_parameters() + head, c.stages);
  }
  int64_t total = 0;
  bool negative = false;
  for (int64_t n : per_stage) total += n, negative = negative || n < 0;
  BOOSTER_CHECK(int(per_stage.size()) == c.stages && total == int64_t(layers.size()) && !negative, ValueError,
                "pipeline: stage_layers ", per_stage, " must give each of the ", c.stages,
                " stages a number of decoder layers >= 0, together the model's ", layers.size());
  int64_t begin = 0;
  for (int s = 0; s < c.stage; ++s) begin += per_stage[size_t(s)];
  const int64_t end = begin + per_stage[size_t(c.stage)];
  const bool first = c.stage == 0, last = c.stage == c.stages - 1;

  ShardedModel out;
  ModulePtr embed = first ? ModulePtr(llama->model->embed_tokens) : nullptr;
  ModulePtr head = last ? ModulePtr(llama->lm_head) : nullptr;
  std::vector<std::pair<int64_t, ModulePtr>> mine;
  for (int64_t i = begin; i < end; ++i) mine.emplace_back(i, layers[size_t(i)]);
  distributed::ProcessGroup* group = c.tp;
  if (group != nullptr && group->size() > 1) {
    const int64_t tp = group->size();
    const bool fits = cfg.num_attention_heads % tp == 0 && cfg.num_key_value_heads % tp == 0 &&
                      cfg.intermediate_size % tp == 0 && cfg.vocab_size % tp == 0;
    if (!fits) {
      const int64_t g = std::gcd(std::gcd(cfg.num_attention_heads, cfg.num_key_value_heads),
                                 std::gcd(cfg.intermediate_size, cfg.vocab_size));
      BOOSTER_FAIL(IncompatibleError, "shard policy 'Llama': tensor parallel size ", tp,
                   " must divide the query heads (", cfg.num_attention_heads, "), the key/value heads (",
                   cfg.num_key_value_heads, "), the intermediate size (", cfg.intermediate_size,
                   ") and the vocabulary (", cfg.vocab_size, ")",
                   cfg.num_key_value_heads % tp != 0 ? ": each rank must hold whole key/value heads" : "",
                   "; tp sizes that work for this model: ", divisors_of(g));
    }
    // Only this stage's layers are split (Note [Shard policies]).
    std::shared_ptr<tp::VocabParallelEmbedding> vocab_embed;
    if (first) embed = vocab_embed = std::make_shared<tp::VocabParallelEmbedding>(*llama->model->embed_tokens, *group);
    // How each Linear of a layer splits: the family's declaration (llama_family.cpp).
    const ModelFamily& family = *family_of(*llama);
    for (auto& [i, layer] : mine) {
      auto split = std::make_shared<LlamaDecoderLayer>(dynamic_cast<const LlamaDecoderLayer&>(*layer), *group);
      // LoRA adapters follow their Linear's split (Note [LoRA under tensor parallelism] in lora.cpp).
      split_layer_lora(family, layer, split, *group);
      layer = split;
    }
    if (last) {
      // Tied: one stage (checked above), the head is the embedding's shard. Adapters on it follow the
      // rows (Note [LoRA on the vocabulary-parallel head] in shard_policy.cpp).
      head = vocab_parallel_head(*llama->lm_head, cfg.tie_word_embeddings ? vocab_embed->weight : Tensor(), *group);
    }
    // Each Linear of a layer by its split; a bias the model has follows a column split's rows and stays
    // whole under a row split (added once after the all-reduce); LoRA's B follows a column split's rows,
    // A a row split's columns, the other replicated.
    out.shards = family_shards(family, *llama, cfg.num_hidden_layers);
    out.criterion = vocab_parallel_criterion(*group, cfg.vocab_size, "Llama");
  }
  auto stage = std::make_shared<LlamaStage>(cfg, embed, std::move(mine), last ? ModulePtr(llama->model->norm) : nullptr,
                                            head);
  stage->train(llama->is_training());
  out.module = stage;
  return out;
}

}  // namespace booster::nn
