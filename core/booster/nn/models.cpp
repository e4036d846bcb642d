#include "booster/nn/models.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "booster/nn/activation_checkpoint.h"
#include "booster/nn/cnn.h"
#include "booster/nn/hf.h"
#include "booster/nn/init.h"
#include "booster/nn/packing.h"
#include "booster/ops/ops.h"

namespace booster::nn {

// ------------------------------------------------------------------------------------------ GPT

GPT::GPT(const GPTConfig& cfg, uint64_t seed)
    : config(cfg), dropout_gen_(std::make_shared<Generator>(seed ^ 0x9E3779B97F4A7C15ull)) {
  BOOSTER_CHECK(cfg.vocab_size > 0 && cfg.context > 0 && cfg.width > 0 && cfg.layers > 0 && cfg.heads > 0,
                ValueError, "GPT: vocab_size, context, width, layers and heads must be positive, got ", cfg.vocab_size,
                ", ", cfg.context, ", ", cfg.width, ", ", cfg.layers, ", ", cfg.heads);
  BOOSTER_CHECK(cfg.width % cfg.heads == 0, ValueError, "GPT: width ", cfg.width, " is not divisible by heads ",
                cfg.heads);
  Generator gen(seed);
  wte = register_module("wte", std::make_shared<Embedding>(cfg.vocab_size, cfg.width, &gen));
  wpe = register_module("wpe", std::make_shared<Embedding>(cfg.context, cfg.width, &gen));
  drop = register_module("drop", std::make_shared<Dropout>(cfg.dropout, dropout_gen_));
  blocks = register_module("blocks", std::make_shared<Sequential>());
  for (int64_t i = 0; i < cfg.layers; ++i)
    blocks->push_back(std::make_shared<Block>(cfg.width, cfg.heads, cfg.dropout, &gen, dropout_gen_, cfg.layer_norm_eps));
  ln_f = register_module("ln_f", std::make_shared<LayerNorm>(cfg.width, cfg.layer_norm_eps));
  lm_head = register_module("lm_head", cfg.tie_word_embeddings
                                           ? std::make_shared<Linear>(wte->weight)
                                           : std::make_shared<Linear>(cfg.width, cfg.vocab_size, false, &gen));
  // Logits rows 64 apart on a GPU (50257 -> 50304 for GPT-2): aligned rows keep the vocabulary GEMMs on
  // the tensor-core kernels; the padding is never read (the loss takes the row stride).
  lm_head->output_row_multiple = 64;

  // nanoGPT's init, re-drawn over the layers' defaults in parameter order from a fresh generator.
  Generator init_gen(seed + 1);
  const double residual_std = 0.02 / std::sqrt(2.0 * double(cfg.layers));
  for (const auto& [path, m] : named_modules()) {
    if (auto* lin = dynamic_cast<const Linear*>(m)) {
      if (lin->weight.is_same(wte->weight)) continue;  // tied: drawn once, as the embedding
      const bool residual = path.size() >= 7 && path.compare(path.size() - 7, 7, ".c_proj") == 0;
      init::normal_(lin->weight, 0.0, residual ? residual_std : 0.02, init_gen);
      if (lin->bias.defined()) init::zeros_(lin->bias);
    } else if (auto* emb = dynamic_cast<const Embedding*>(m)) {
      init::normal_(emb->weight, 0.0, 0.02, init_gen);
    }
  }
  set_tensor_names();
}

Tensor GPT::forward(const Tensor& idx) { return forward(idx, nullptr); }

Tensor GPT::forward_cached(const Tensor& idx, KVCache& cache) { return forward(idx, &cache); }

Tensor GPT::forward(const Tensor& idx_in, KVCache* cache) {
  // Note [Packed sequences] (packing.h): a packed input's records attend only to themselves (the
  // attention reads the layout this scope holds for the forward, a checkpointed block keeps it for its
  // recompute) and take the position embeddings of their own positions, from 0 at each record.
  Tensor idx = idx_in, packed_positions;
  std::optional<SequenceLayoutScope> scope;
  if (cache == nullptr && is_packed(idx_in)) {
    auto [ids, layout] = unpack_sequences(idx_in);
    idx = ids;
    packed_positions = layout.positions;
    scope.emplace(std::move(layout));
  }
  BOOSTER_CHECK(idx.dim() == 2, ShapeError, "GPT: expected token ids [B, T], got shape ", idx.shape());
  const int64_t T = idx.size(1), start = cache != nullptr ? cache->length() : 0;
  if (cache == nullptr) {
    BOOSTER_CHECK(T <= config.context, ShapeError, "GPT: sequence length ", T, " exceeds the context length ",
                  config.context, "; pass at most ", config.context, " tokens");
  } else {
    BOOSTER_CHECK(cache->num_layers() == config.layers, ValueError, "GPT: a key/value cache of ", cache->num_layers(),
                  " layers for a model of ", config.layers, "; make it with make_kv_cache");
    BOOSTER_CHECK(start + T <= config.context, ShapeError, "GPT: positions ", start, " .. ", start + T - 1,
                  " pass the context length ", config.context, "; generate at most ", config.context, " tokens in all");
  }
  const Tensor positions = packed_positions.defined()
                               ? packed_positions  // [B, T]
                               : arange(double(start), double(start + T), 1.0, DType::Int64).to(idx.device());
  Tensor x = (*drop)((*wte)(idx) + (*wpe)(positions));  // [B, T, C] + [T, C] (packed: [B, T, C])
  if (cache != nullptr) {
    const std::vector<ModulePtr> layers = blocks->children();
    for (size_t i = 0; i < layers.size(); ++i) {
      auto* block = dynamic_cast<Block*>(layers[i].get());
      BOOSTER_CHECK(block != nullptr, IncompatibleError, "GPT: block ", i, " is a ", layers[i]->name(),
                    ", not a Block; a split (tensor- or pipeline-parallel) GPT has no cached forward");
      x = block->forward(x, &cache->layer(int64_t(i)));
    }
  } else if (config.activation_checkpointing) {
    for (const ModulePtr& block : blocks->children()) x = checkpoint(*block, x);
  } else {
    x = (*blocks)(x);
  }
  return (*lm_head)((*ln_f)(x));
}

// ------------------------------------------------------------------------------------------ MLPClassifier

MLPClassifier::MLPClassifier(int64_t in, std::vector<int64_t> hidden, int64_t classes, const std::string& activation,
                             uint64_t seed)
    : in_features(in), num_classes(classes) {
  Generator gen(seed);
  layers = register_module("layers", std::make_shared<Sequential>());
  int64_t width = in;
  for (int64_t h : hidden) {
    layers->push_back(std::make_shared<Linear>(width, h, true, &gen));
    layers->push_back(make_activation(activation));
    width = h;
  }
  layers->push_back(std::make_shared<Linear>(width, classes, true, &gen));
  set_tensor_names();
}

Tensor MLPClassifier::forward(const Tensor& x) {
  BOOSTER_CHECK(x.dim() >= 1 && x.numel() == x.size(0) * in_features, ShapeError,
                "MLPClassifier: expected input [N, ...] with ", in_features, " features per sample, got shape ",
                x.shape());
  return (*layers)(x.reshape({x.size(0), in_features}));
}

// ------------------------------------------------------------------------------------------ factory

namespace {

void check_keys(const nlohmann::json& cfg, const std::string& type, const std::vector<std::string>& allowed,
                const std::vector<std::string>& required) {
  auto list = [](const std::vector<std::string>& keys) { return str(keys); };
  for (const auto& [key, value] : cfg.items())
    BOOSTER_CHECK(std::find(allowed.begin(), allowed.end(), key) != allowed.end(), ConfigError,
                  "make_model: unknown key \"", key, "\" for model type \"", type, "\"; allowed keys are ",
                  list(allowed));
  for (const auto& key : required)
    BOOSTER_CHECK(cfg.contains(key), ConfigError, "make_model: missing key \"", key, "\" for model type \"", type,
                  "\"; required keys are ", list(required));
}

int64_t positive_int(const nlohmann::json& cfg, const std::string& key) {
  const auto& v = cfg.at(key);
  BOOSTER_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, ConfigError, "make_model: \"", key,
                "\" must be a positive integer, got ", v.dump());
  return v.get<int64_t>();
}

ModulePtr make_mlp(const nlohmann::json& cfg, uint64_t seed) {
  const std::string type = "mlp";
  check_keys(cfg, type, {"type", "in", "hidden", "classes", "activation"}, {"in", "hidden", "classes"});
  const auto& hidden_json = cfg["hidden"];
  BOOSTER_CHECK(hidden_json.is_array(), ConfigError, "make_model: \"hidden\" must be a list of positive integers, got ",
                hidden_json.dump());
  std::vector<int64_t> hidden;
  for (const auto& h : hidden_json) {
    BOOSTER_CHECK(h.is_number_integer() && h.get<int64_t>() > 0, ConfigError,
                  "make_model: \"hidden\" must be a list of positive integers, got ", hidden_json.dump());
    hidden.push_back(h.get<int64_t>());
  }
  std::string activation = "relu";
  if (cfg.contains("activation")) {
    BOOSTER_CHECK(cfg["activation"].is_string(), ConfigError, "make_model: \"activation\" must be a string, got ",
                  cfg["activation"].dump());
    activation = cfg["activation"].get<std::string>();
  }
  return std::make_shared<MLPClassifier>(positive_int(cfg, "in"), hidden, positive_int(cfg, "classes"), activation,
                                         seed);
}

// A linear classifier (logistic regression under cross-entropy): an MLPClassifier without hidden
// layers, so its one layer is "layers.0".
ModulePtr make_linear(const nlohmann::json& cfg, uint64_t seed) {
  check_keys(cfg, "linear", {"type", "in", "classes"}, {"in", "classes"});
  return std::make_shared<MLPClassifier>(positive_int(cfg, "in"), std::vector<int64_t>{}, positive_int(cfg, "classes"),
                                         "relu", seed);
}

ModulePtr make_cnn(const nlohmann::json& cfg, uint64_t seed) {
  check_keys(cfg, "cnn", {"type", "in_channels", "height", "width", "channels", "hidden", "classes", "batch_norm", "dropout"},
             {"classes"});
  CNNConfig c;
  if (cfg.contains("in_channels")) c.in_channels = positive_int(cfg, "in_channels");
  if (cfg.contains("height")) c.height = positive_int(cfg, "height");
  if (cfg.contains("width")) c.width = positive_int(cfg, "width");
  if (cfg.contains("hidden")) c.hidden = positive_int(cfg, "hidden");
  c.classes = positive_int(cfg, "classes");
  if (cfg.contains("channels")) {
    const auto& ch = cfg["channels"];
    BOOSTER_CHECK(ch.is_array() && !ch.empty(), ConfigError,
                  "make_model: \"channels\" must be a non-empty list of positive integers, got ", ch.dump());
    c.channels.clear();
    for (const auto& v : ch) {
      BOOSTER_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, ConfigError,
                    "make_model: \"channels\" must be a non-empty list of positive integers, got ", ch.dump());
      c.channels.push_back(v.get<int64_t>());
    }
  }
  if (cfg.contains("batch_norm")) {
    BOOSTER_CHECK(cfg["batch_norm"].is_boolean(), ConfigError, "make_model: \"batch_norm\" must be true or false, got ",
                  cfg["batch_norm"].dump());
    c.batch_norm = cfg["batch_norm"].get<bool>();
  }
  if (cfg.contains("dropout")) {
    const auto& d = cfg["dropout"];
    BOOSTER_CHECK(d.is_number() && d.get<double>() >= 0.0 && d.get<double>() < 1.0, ConfigError,
                  "make_model: \"dropout\" must be a number in [0, 1), got ", d.dump());
    c.dropout = d.get<double>();
  }
  return std::make_shared<CNNClassifier>(c, seed);
}

}  // namespace

// The built-ins register themselves when the library loads (Note [Model libraries] in model_registry.h
// for the other ways in); the decoder families (gpt, llama, mistral, qwen2) by their declarations
// (Note [Model families] in families.cpp), listed between these by their listing_order.
namespace detail {
void register_builtin_model(const std::string& name, ModelFactory factory, double order);
}
[[maybe_unused]] static const bool kBuiltinsRegistered = [] {
  detail::register_builtin_model("mlp", make_mlp, 1);
  detail::register_builtin_model("linear", make_linear, 2);
  detail::register_builtin_model("cnn", make_cnn, 4);
  detail::register_builtin_model("hf", make_hf, 9);  // hf.h: a Hugging Face model directory
  return true;
}();

}  // namespace booster::nn
