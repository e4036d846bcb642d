// The per-rank memory estimate of a training config (Note [Memory estimate] in memory_estimate.h).
#include "booster/config/memory_estimate.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <optional>
#include <sstream>

#include "booster/autograd/autograd.h"
#include "booster/common/error.h"
#include "booster/config/config.h"  // lora_summary
#include "booster/common/json_text.h"
#include "booster/mixed_precision/master_weight_optimizer.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/families.h"
#include "booster/nn/linear.h"
#include "booster/nn/llama.h"
#include "booster/nn/model_registry.h"
#include "booster/tensor/deferred.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"

namespace booster::config {

using nlohmann::json;

int64_t MemoryEstimate::total_bytes() const {
  int64_t total = 0;
  for (const MemoryItem& item : items) total += item.bytes;
  return total;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 5) bytes /= 1024.0, ++u;
  std::ostringstream os;
  os << std::fixed << std::setprecision(u == 0 ? 0 : 1) << bytes << " " << units[u];
  return os.str();
}

HostMemory host_memory() {
  HostMemory m;
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") m.available = kib * 1024;
    if (key == "MemTotal:") m.total = kib * 1024;
  }
  if (const char* fake = std::getenv("BOOSTER_TEST_MEM_AVAILABLE")) m.available = std::atoll(fake);
  return m;
}

namespace {

// What the strategy does to a model, measured on a probe (Note [Memory estimate]).
struct Precision {
  int model_bytes = 4;
  std::string model_dtype = "float32";
  bool master_weights = false;
  int activation_bytes = 4;
};

Precision probe_strategy(const json& section) {
  json options = section;
  const std::string name = options.at("name").get<std::string>();
  options.erase("name");
  std::shared_ptr<mixed_precision::MixedPrecision> strategy(mixed_precision::create(name, options));
  auto model = std::make_shared<nn::Linear>(2, 2);
  std::shared_ptr<optim::Optimizer> sgd = optim::make_optimizer({{"type", "sgd"}, {"lr", 0.1}}, model->parameters());
  mixed_precision::Configured c = strategy->configure(model, sgd, nullptr);
  Precision p;
  const DType dtype = c.model->parameters().at(0).dtype();
  p.model_bytes = int(itemsize(dtype));
  p.model_dtype = dtype_name(dtype);
  p.master_weights = dynamic_cast<mixed_precision::MasterWeightOptimizer*>(c.optimizer.get()) != nullptr;
  // The forward's activations: the probe's output dtype (float16 under autocast or a 16-bit model).
  autograd::NoGradGuard no_grad;
  const Tensor out = (*c.model)(zeros({1, 2}));
  p.activation_bytes = p.model_bytes == 2 || is_low_precision(out.dtype()) ? 2 : 4;
  return p;
}

// Note [Counting a transformer]
// The GPT (nn::GPT: learned positions, LayerNorms and Linears with biases, lm_head without) and the
// Llama (nn::Llama: no biases, RMSNorm weights only, grouped-query attention, SwiGLU), counted from
// their sizes, as the modules make their parameters:
//   gpt    v w (wte) + ctx w (wpe) + L (2 x 2w for two LayerNorms + w 3w + 3w (c_attn) + w w + w (c_proj)
//          + w 4w + 4w (c_fc) + 4w w + w (c_proj)) + 2w (ln_f) + w v (lm_head, unless tied)
//   llama  v h (embed_tokens) + L (h H d (q_proj) + 2 h K d (k_proj, v_proj) + H d h (o_proj) + 3 h I
//          (gate, up, down) + 2h (two RMSNorms)) + h (norm) + h v (lm_head, unless tied), with H query
//          heads, K key/value heads and head size d = h / H
// Activations per token of one micro-batch (elements): the GPT's are Megatron's count (Note [Memory
// estimate]); the Llama's, what its forward keeps for backward, per layer: its input and the normed
// input (2h), q, k, v (h + 2 K d) and q, k after RoPE (h + K d), k and v repeated to every query head
// when K < H (2h), the attention probabilities (H T, the unfused kernel's) and output (h), the
// residual sum and its norm (2h), gate, up, silu(gate) and their product (4 I); plus the embedding's
// output, the final norm's input and output (3h) and the logits with their softmax (2v). With
// activation_checkpointing a layer keeps only its input (h), and one layer's whole set lives again
// while backward recomputes it.
// The sizes come from the family's declaration (nn/families.h: its `sizes`), the counts from its layout:
// "gpt" (GPT-2's blocks) or "llama" (the Llama layers of llama, mistral and qwen2).
struct Transformer : nn::TransformerSizes {

  int64_t parameters() const {
    const int64_t v = vocab, w = width, L = layers;
    const int64_t head = tied ? 0 : w * v;
    if (layout == "gpt") {
      const int64_t per_block = 2 * 2 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w);
      return v * w + positions * w + L * per_block + 2 * w + head;
    }
    const int64_t d = w / heads, q = heads * d, kv = kv_heads * d;
    const int64_t per_layer = w * q + 2 * w * kv + q * w + 3 * w * intermediate + 2 * w + (qkv_bias ? q + 2 * kv : 0);
    return v * w + L * per_layer + w + head;
  }

  double activations_per_token(int64_t T) const {
    const double w = double(width), v = double(vocab), L = double(layers), H = double(heads);
    if (layout == "gpt") return L * (17.0 * w + 2.5 * H * double(T)) + 3.0 * w + 2.0 * v;
    const double kv = double(kv_heads) * (w / H);
    const double per_layer = 2.0 * w + (w + 2.0 * kv) + (w + kv) + (kv_heads < heads ? 2.0 * w : 0.0) +
                             H * double(T) + w + 2.0 * w + 4.0 * double(intermediate);
    const double kept = checkpointing ? L * w + per_layer : L * per_layer;
    return kept + 3.0 * w + 2.0 * v;
  }
};

// The model's sizes, for a gpt, a llama, or an hf directory whose config.json describes one (Hugging
// Face's keys and defaults, as nn::load_pretrained reads them); nullopt for anything else.
std::optional<Transformer> transformer_of(const json& model) {
  const std::string type = model.at("type").get<std::string>();
  std::optional<nn::TransformerSizes> sizes;
  if (const nn::ModelFamily* f = nn::find_model_family(type); f != nullptr && f->sizes) {
    sizes = f->sizes(model, nullptr);
  } else if (type == "hf" && model.value("path", json()).is_string()) {
    // Note [One JSON reader] (json_text.h).
    const json hf = try_read_json_file(model.at("path").get<std::string>() + "/config.json", JsonLimits{});
    if (!hf.is_object()) return std::nullopt;
    const std::string family = hf.value("model_type", json()).is_string() ? hf.at("model_type").get<std::string>() : "";
    const nn::ModelFamily* f = nn::find_hf_family(family);
    if (f == nullptr || f->hf_model_type != family || !f->sizes) return std::nullopt;
    sizes = f->sizes(model, &hf);  // Hugging Face's keys and defaults, as nn::load_pretrained reads them
  }
  if (!sizes) return std::nullopt;
  Transformer t;
  static_cast<nn::TransformerSizes&>(t) = *sizes;
  // Sizes the model would refuse (check_model refuses them first): not counted here.
  if (t.vocab < 1 || t.width < 1 || t.layers < 1 || t.heads < 1 || t.kv_heads < 1 || t.intermediate < 1 ||
      t.positions < 1 || t.width % t.heads != 0)
    return std::nullopt;
  return t;
}

int64_t shard(int64_t n, int world) { return (n + world - 1) / world; }

std::string thousands(int64_t n) {
  std::string s = std::to_string(n);
  for (int i = int(s.size()) - 3; i > 0; i -= 3) s.insert(size_t(i), ",");
  return s;
}

}  // namespace

MemoryEstimate estimate_memory(const json& c, int world_size) {
  BOOSTER_CHECK(world_size >= 1, ValueError, "estimate_memory: world size ", world_size, " must be at least 1");
  MemoryEstimate e;
  e.world_size = world_size;
  const json& model = c.at("model");
  const json& data = c.at("data");
  const std::string type = model.at("type").get<std::string>();
  const int64_t batch = data.at("batch_size").get<int64_t>();

  // ---- parameters and the activation elements of one micro-batch
  int64_t activation_elements = -1;
  std::string activation_detail;
  if (type == "mlp" || type == "linear") {
    std::vector<int64_t> widths = {model.at("in").get<int64_t>()};
    if (type == "mlp")
      for (const json& h : model.at("hidden")) widths.push_back(h.get<int64_t>());
    widths.push_back(model.at("classes").get<int64_t>());
    int64_t per_sample = widths.front() + 2 * widths.back();  // input, logits and their softmax
    for (size_t i = 0; i + 1 < widths.size(); ++i) {
      e.parameters += widths[i] * widths[i + 1] + widths[i + 1];
      if (i + 2 < widths.size()) per_sample += 2 * widths[i + 1];  // a hidden layer before and after its activation
    }
    activation_elements = batch * per_sample;
    activation_detail = type + ", batch " + std::to_string(batch) + " x " + std::to_string(per_sample) + " values";
  } else if (std::optional<Transformer> t = transformer_of(model)) {
    const int64_t T = data.contains("context")   ? data.at("context").get<int64_t>()
                      : data.contains("seq_len") ? data.at("seq_len").get<int64_t>()  // token data
                                                 : t->positions;
    e.parameters = t->parameters();
    activation_elements = int64_t(std::llround(double(batch * T) * t->activations_per_token(T)));
    activation_detail = t->layout + ", batch " + std::to_string(batch) + " x " + std::to_string(T) + " tokens" +
                        (t->checkpointing ? ", layers checkpointed" : "");
    if (type == "hf") e.notes.push_back("model 'hf': the sizes of " + model.at("path").get<std::string>() + "/config.json");
  } else {
    json cfg = model;
    cfg.erase("init_from");
    LazyInitGuard lazy;  // counted, never allocated
    ShapesOnlyGuard shapes;
    e.parameters = nn::make_model(cfg, c.at("train").at("seed").get<uint64_t>())->num_parameters();
    e.notes.push_back("model '" + type + "' was built (deferred) to count its parameters; its activations are not "
                      "estimated");
  }

  // ---- strategy and plugin
  Precision p = probe_strategy(c.at("mixed_precision"));
  const json& plugin = c.at("plugin");
  const std::string plugin_name = plugin.at("name").get<std::string>();
  int zero_stage = 0;
  if (plugin_name == "low_level_zero") {
    zero_stage = plugin.value("stage", 1);
    const std::string precision = plugin.value("precision", std::string("fp16"));
    const bool half = precision == "fp16" || precision == "bf16";
    p.model_bytes = p.activation_bytes = half ? 2 : 4;
    p.model_dtype = precision == "fp16" ? "float16" : precision == "bf16" ? "bfloat16" : "float32";
    p.master_weights = half;
  }
  // hybrid_parallel splits the model over tp_size x pp_size ranks (replicated layer norms and the
  // stages' balance make a rank's part a little larger than the quotient).
  int64_t model_parallel = 1;
  int shard_ways = world_size;  // the ranks ZeRO splits over
  if (plugin_name == "hybrid_parallel") {
    model_parallel = plugin.value("tp_size", int64_t(1)) * plugin.value("pp_size", int64_t(1));
    zero_stage = plugin.value("zero_stage", 0);  // 1: optimizer state (and masters) over the dp group
    shard_ways = std::max(1, int(world_size / std::max<int64_t>(1, model_parallel)));
    e.notes.push_back("hybrid_parallel: parameters, gradients and optimizer state are this rank's 1/" +
                      std::to_string(model_parallel) + " of the model (tp_size x pp_size)" +
                      (zero_stage ? ", the optimizer state split again over the data-parallel ranks (zero_stage 1)"
                                  : "") +
                      " (booster train builds the model deferred, so no rank holds the whole of it; with "
                      "model.init_from the whole float32 model, " +
                      std::to_string(e.parameters * 4) + " bytes, is loaded on every rank first); activations "
                      "are one replica's");
  } else if (plugin_name != "single" && plugin_name != "ddp" && plugin_name != "low_level_zero") {
    e.notes.push_back("plugin '" + plugin_name + "' is assumed to replicate the model, gradients and optimizer on every rank");
  }
  const int world = shard_ways;
  const std::string shard_text = ", sharded 1/" + std::to_string(world);
  // With LoRA the model holds the adapters too, but gradients, masters and optimizer state exist for the
  // adapters only: the frozen base keeps its storage and nothing else (Note [The lora section]).
  int64_t trainable = e.parameters;
  if (std::optional<LoraSummary> lora = lora_summary(c)) {
    e.parameters = lora->total;
    trainable = lora->trainable;
    e.notes.push_back(lora->describe() + ": gradients, master weights and optimizer state for those only");
  }
  const int64_t n = shard(e.parameters, int(model_parallel));
  const int64_t n_trained = shard(trainable, int(model_parallel));

  const int64_t held_params = zero_stage >= 3 ? shard(n, world) : n;
  e.items.push_back({"parameters", thousands(held_params) + " x " + std::to_string(p.model_bytes) + " bytes (" +
                                       p.model_dtype + ")" + (zero_stage >= 3 ? shard_text + " (ZeRO stage 3)" : ""),
                     held_params * p.model_bytes});
  const int64_t grads = zero_stage >= 2 ? shard(n_trained, world) : n_trained;
  e.items.push_back({"gradients", thousands(grads) + " x " + std::to_string(p.model_bytes) + " bytes" +
                                      (zero_stage >= 2 ? shard_text + " (ZeRO stage " + std::to_string(zero_stage) + ")" : ""),
                     grads * p.model_bytes});
  const int64_t sharded = zero_stage >= 1 ? shard(n_trained, world) : n_trained;
  if (p.master_weights)
    e.items.push_back({"master weights", thousands(sharded) + " x 4 bytes (float32)" + (zero_stage ? shard_text : ""),
                       sharded * 4});

  const json& optimizer = c.at("optimizer");
  const std::string opt = optimizer.at("type").get<std::string>();
  int states = 0;
  if (opt == "adam" || opt == "adamw") states = optimizer.value("amsgrad", false) ? 3 : 2;
  else if (opt == "sgd") states = optimizer.value("momentum", 0.0) > 0.0 ? 1 : 0;
  const int state_bytes = p.master_weights ? 4 : p.model_bytes;
  e.items.push_back({"optimizer state", opt + ": " + std::to_string(states) + " x " + thousands(sharded) + " x " +
                                            std::to_string(state_bytes) + " bytes" + (zero_stage ? shard_text : ""),
                     int64_t(states) * sharded * state_bytes});

  if (activation_elements >= 0) {
    e.items.push_back({"activations", activation_detail + ", " + std::to_string(p.activation_bytes) + " bytes each",
                       activation_elements * p.activation_bytes});
  } else {
    e.items.push_back({"activations", "not estimated for model '" + type + "'", 0, false});
  }
  return e;
}

std::string format_memory_estimate(const MemoryEstimate& e) {
  std::ostringstream os;
  os << "memory per rank (world size " << e.world_size << ", " << thousands(e.parameters) << " parameters):\n";
  size_t detail_width = 0;
  for (const MemoryItem& item : e.items) detail_width = std::max(detail_width, item.detail.size());
  for (const MemoryItem& item : e.items) {
    os << "  " << std::left << std::setw(17) << item.what << std::setw(int(detail_width) + 2) << item.detail
       << std::right << std::setw(12) << (item.estimated ? format_bytes(double(item.bytes)) : "?") << "\n";
  }
  os << "  " << std::left << std::setw(17 + int(detail_width) + 2) << "total" << std::right << std::setw(12)
     << format_bytes(double(e.total_bytes())) << "\n";
  for (const std::string& note : e.notes) os << "  note: " << note << "\n";
  return os.str();
}

}  // namespace booster::config
