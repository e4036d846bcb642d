// A model's sizes against booster's limits, before the model is built (Note [Sizes before building]).
#include "booster/nn/model_size.h"

#include <cctype>
#include <cstdio>
#include <limits>
#include <optional>

#include "booster/common/error.h"

namespace booster::nn {

using nlohmann::json;

namespace {

constexpr int64_t kSaturated = std::numeric_limits<int64_t>::max();

// A positive integer `v` as a size named `shown`; not present otherwise. A value past INT64_MAX reads as
// INT64_MAX: still past every limit.
SizeField size_of(const json& v, const std::string& shown) {
  SizeField f{shown, 0, false};
  if (v.is_number_unsigned()) f.value = v.get<uint64_t>() > uint64_t(kSaturated) ? kSaturated : int64_t(v.get<uint64_t>());
  else if (v.is_number_integer()) f.value = v.get<int64_t>();
  f.present = f.value > 0;
  return f;
}

SizeField size_field(const json& c, const std::string& key, const std::string& shown, std::optional<int64_t> fallback) {
  const auto it = c.find(key);
  if (it == c.end() || it->is_null()) return fallback ? SizeField{shown, *fallback, true} : SizeField{shown, 0, false};
  return size_of(*it, shown);
}

// A Llama-family decoder's sizes: the keys are the same in a booster config and a config.json; each
// is shown between `open` and `close`.
DecoderSizes llama_sizes(const json& c, const std::string& open, const std::string& close) {
  auto f = [&](const char* key) { return size_field(c, key, open + key + close, std::nullopt); };
  DecoderSizes s;
  s.vocab = f("vocab_size"), s.width = f("hidden_size"), s.layers = f("num_hidden_layers");
  s.heads = f("num_attention_heads"), s.kv_heads = f("num_key_value_heads");
  s.intermediate = f("intermediate_size"), s.positions = f("max_position_embeddings");
  s.tied = c.value("tie_word_embeddings", json(false)) == json(true);
  return s;
}

std::string sci(int64_t n) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2g", double(n));
  return buf;
}

void check_width(const SizeField& f, const std::string& where, const char* what) {
  BOOSTER_CHECK(!f.present || f.value <= kMaxModelWidth, ConfigError, where, f.name, " is ", f.value,
                ", more than booster's limit of ", kMaxModelWidth, " (2^24) for ", what,
                " (no model comes near it: a config gone wrong?); give the model's real size");
}

}  // namespace

int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? kSaturated : out;
}

int64_t saturating_add(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? kSaturated : out;
}

DecoderSizes booster_decoder_sizes(const std::string& type, const json& model) {
  auto f = [&](const char* key, std::optional<int64_t> fallback = std::nullopt) {
    return size_field(model, key, std::string("'model.") + key + "'", fallback);
  };
  DecoderSizes s;
  if (type == "gpt") {
    s.gpt = true;
    s.vocab = f("vocab_size"), s.width = f("width"), s.layers = f("layers"), s.heads = f("heads");
    s.kv_heads = s.heads, s.positions = f("context");
    s.tied = true;
    return s;
  }
  return llama_sizes(model, "'model.", "'");
}

namespace {

bool is_gpt2_config(const json& c) {
  const json type = c.value("model_type", json());
  if (type.is_string()) return type == "gpt2";
  const json arch = c.value("architectures", json());
  return arch.is_array() && !arch.empty() && arch.front() == "GPT2LMHeadModel";
}

}  // namespace

DecoderSizes hf_decoder_sizes(const json& c) {
  auto f = [&](const char* key, std::optional<int64_t> fallback = std::nullopt) {
    return size_field(c, key, std::string("\"") + key + "\"", fallback);
  };
  DecoderSizes s;
  if (is_gpt2_config(c)) {
    // GPT2Config's defaults, as nn::load_pretrained reads them.
    s.gpt = true;
    s.vocab = f("vocab_size", 50257), s.width = f("n_embd", 768), s.layers = f("n_layer", 12);
    s.heads = f("n_head", 12), s.kv_heads = s.heads, s.positions = f("n_positions", 1024);
    s.tied = c.value("tie_word_embeddings", json(true)) != json(false);
    return s;
  }
  return llama_sizes(c, "\"", "\"");
}

int64_t decoder_parameters(const DecoderSizes& s) {
  const int64_t V = s.vocab.present ? s.vocab.value : 1, W = s.width.present ? s.width.value : 1;
  const int64_t L = s.layers.present ? s.layers.value : 1;
  auto mul = [](std::initializer_list<int64_t> xs) {
    int64_t p = 1;
    for (int64_t x : xs) p = saturating_mul(p, x);
    return p;
  };
  int64_t per_layer = 0, total = 0;
  if (s.gpt) {
    // attention (qkv and out, with biases), 4x MLP (with biases), two layer norms; wte, wpe, ln_f.
    per_layer = saturating_add(mul({12, W, W}), mul({13, W}));
    const int64_t P = s.positions.present ? s.positions.value : 1;
    total = saturating_add(mul({V, W}), saturating_add(mul({P, W}), mul({2, W})));
    if (!s.tied) total = saturating_add(total, mul({V, W}));
  } else {
    const int64_t I = s.intermediate.present ? s.intermediate.value : 1;
    // k and v are kv_heads / heads of the width (grouped-query attention); at most the width.
    int64_t kv = W;
    if (s.heads.present && s.kv_heads.present && s.kv_heads.value <= s.heads.value)
      kv = saturating_mul(W / s.heads.value, s.kv_heads.value);
    per_layer = saturating_add(saturating_add(mul({2, W, W}), mul({2, W, kv})), saturating_add(mul({3, W, I}), mul({2, W})));
    total = saturating_add(mul({V, W}), W);
    if (!s.tied) total = saturating_add(total, mul({V, W}));
  }
  return saturating_add(total, saturating_mul(L, per_layer));
}

void check_decoder_sizes(const DecoderSizes& s, const std::string& where) {
  const std::string at = where.empty() ? "" : where + ": ";
  check_width(s.vocab, at, "a vocabulary");
  check_width(s.width, at, "a model's width");
  check_width(s.intermediate, at, "a feed-forward width");
  check_width(s.heads, at, "attention heads");
  check_width(s.kv_heads, at, "key/value heads");
  check_width(s.positions, at, "positions");
  BOOSTER_CHECK(!s.layers.present || s.layers.value <= kMaxModelLayers, ConfigError, at, s.layers.name, " is ",
                s.layers.value, ", more than booster's limit of ", kMaxModelLayers,
                " layers (Note [The depth limit]: no model comes near it; a config gone wrong?); give the model's real "
                "depth");
  const int64_t n = decoder_parameters(s);
  if (n <= kMaxModelParameters) return;
  std::string sizes;
  for (const SizeField* f : {&s.vocab, &s.width, &s.intermediate, &s.layers, &s.positions})
    if (f->present && !(s.gpt && f == &s.intermediate))
      sizes += (sizes.empty() ? "" : ", ") + f->name + " " + std::to_string(f->value);
  BOOSTER_FAIL(ConfigError, at, sizes, " make ", n == kSaturated ? std::string("more than 9.2e18") : "about " + sci(n),
               " parameters, more than booster's limit of 2^40 (", sci(kMaxModelParameters),
               ", 4 TiB of float32 weights); shrink the sizes");
}

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The layer index in a name such as "model.layers.12.mlp.up_proj.weight" or "h.3.attn.c_attn.weight";
// -1 for a name outside the layers. An index of more than 9 digits reads as 10^9 (past any limit).
int64_t layer_index(const std::string& name, bool gpt) {
  const std::string key = gpt ? "h." : "layers.";
  for (size_t at = name.find(key); at != std::string::npos; at = name.find(key, at + 1)) {
    if (at != 0 && name[at - 1] != '.') continue;
    size_t end = at + key.size();
    while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
    const size_t digits = end - (at + key.size());
    if (digits == 0 || end >= name.size() || name[end] != '.') continue;
    return digits > 9 ? int64_t(1'000'000'000) : std::stoll(name.substr(at + key.size(), digits));
  }
  return -1;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

void check_hf_sizes(const json& c, const std::string& where, const std::map<std::string, std::vector<int64_t>>* shapes) {
  if (!c.is_object()) return;  // the reader says what is wrong
  const DecoderSizes s = hf_decoder_sizes(c);
  if (shapes != nullptr && !shapes->empty()) {
    std::vector<std::string> differences;
    // The first tensor whose name ends with `suffix` (a base model's file has no prefix).
    auto find = [&](const std::string& suffix) -> const std::pair<const std::string, std::vector<int64_t>>* {
      for (const auto& kv : *shapes)
        if ((kv.first == suffix || ends_with(kv.first, "." + suffix)) && !kv.second.empty()) return &kv;
      return nullptr;
    };
    auto compare = [&](const SizeField& f, const std::pair<const std::string, std::vector<int64_t>>* t, size_t dim,
                       const char* what) {
      if (f.present && t != nullptr && t->second.size() == 2 && t->second[dim] != f.value)
        differences.push_back(f.name + " is " + std::to_string(f.value) + " but the weights' " + t->first + " " +
                              shape_text(t->second) + " has " + std::to_string(t->second[dim]) + " " + what);
    };
    const auto* embed = find(s.gpt ? "wte.weight" : "embed_tokens.weight");
    compare(s.vocab, embed, 0, "rows (the vocabulary)");
    compare(s.width, embed, 1, "columns (the width)");
    // The sizes that make a build long; the rest (positions, heads) are cheap to build, and the
    // parameter-by-parameter comparison after the build lists their differences in full.
    if (!s.gpt) compare(s.intermediate, find("layers.0.mlp.gate_proj.weight"), 0, "rows (the feed-forward width)");
    int64_t layers = 0;
    std::string deepest;
    for (const auto& [name, shape] : *shapes)
      if (const int64_t i = layer_index(name, s.gpt); i + 1 > layers) layers = i + 1, deepest = name;
    if (s.layers.present && s.layers.value != layers)
      differences.push_back(s.layers.name + " is " + std::to_string(s.layers.value) + " but the weights hold " +
                            std::to_string(layers) + (layers == 1 ? " layer" : " layers") +
                            (deepest.empty() ? std::string() : " (the last: " + deepest + ")"));
    BOOSTER_CHECK(differences.empty(), ConfigError, where, " does not describe the weights beside it: ",
                  [&] {
                    std::string all;
                    for (const std::string& d : differences) all += (all.empty() ? "" : "; ") + d;
                    return all;
                  }(),
                  "; config.json and the weight files must be of one model");
  }
  check_decoder_sizes(s, where);
}

void check_mlp_sizes(const json& model, const std::string& where) {
  const std::string at = where.empty() ? "" : where + ": ";
  std::vector<SizeField> widths = {size_field(model, "in", "'model.in'", std::nullopt)};
  if (const auto it = model.find("hidden"); it != model.end() && it->is_array())
    for (size_t i = 0; i < it->size(); ++i) widths.push_back(size_of((*it)[i], "'model.hidden[" + std::to_string(i) + "]'"));
  widths.push_back(size_field(model, "classes", "'model.classes'", std::nullopt));
  int64_t n = 0;
  for (size_t i = 0; i < widths.size(); ++i) {
    check_width(widths[i], at, "a layer's width");
    if (i + 1 < widths.size() && widths[i].present && widths[i + 1].present)
      n = saturating_add(n, saturating_add(saturating_mul(widths[i].value, widths[i + 1].value), widths[i + 1].value));
  }
  BOOSTER_CHECK(n <= kMaxModelParameters, ConfigError, at, "the widths make about ", sci(n),
                " parameters, more than booster's limit of 2^40 (", sci(kMaxModelParameters),
                ", 4 TiB of float32 weights); shrink them");
}

}  // namespace booster::nn
