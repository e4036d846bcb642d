// The Llama decoder families (llama, mistral, qwen2: llama.h's decoder_families(), Note [Decoder
// families] in llama.cpp) as model families (Note [Model families] in families.cpp): their config.json
// in both directions, Hugging Face's names (nn::Llama's own), the tensor-parallel split of a layer.
#include "booster/common/error.h"
#include "booster/nn/families.h"
#include "booster/nn/llama.h"

namespace booster::nn {

namespace {

using json = nlohmann::json;

ModulePtr llama_from_hf(const DecoderFamily& family, const HfConfigReader& r, const json& overrides, uint64_t seed) {
  json cfg = {{"type", family.model_type}};
  cfg["vocab_size"] = r.positive("vocab_size");
  cfg["hidden_size"] = r.positive("hidden_size");
  cfg["intermediate_size"] = r.positive("intermediate_size");
  cfg["num_hidden_layers"] = r.positive("num_hidden_layers");
  cfg["num_attention_heads"] = r.positive("num_attention_heads");
  cfg["num_key_value_heads"] = r.positive("num_key_value_heads", cfg["num_attention_heads"].get<int64_t>());
  cfg["max_position_embeddings"] = r.positive("max_position_embeddings", family.default_max_positions);
  cfg["rms_norm_eps"] = r.number("rms_norm_eps", 1e-6);
  cfg["rope_theta"] = r.number("rope_theta", family.default_rope_theta);
  cfg["tie_word_embeddings"] = r.boolean("tie_word_embeddings", false);
  // rope_scaling and the family's own keys as config.json writes them (null kept: "no window");
  // make_llama checks them (an unsupported rope_type is refused there, naming what is supported).
  if (const json* scaling = r.find("rope_scaling")) cfg["rope_scaling"] = *scaling;
  for (const auto& [key, fallback] : family.extra_keys)
    if (r.c.contains(key)) cfg[key] = r.c.at(key);
  if (r.find("hidden_act")) r.refuse_unless(r.text("hidden_act", "silu") == "silu", "hidden_act", "\"silu\"");
  if (r.find("attention_bias")) r.refuse_unless(!r.boolean("attention_bias", false), "attention_bias", "false");
  if (r.find("mlp_bias")) r.refuse_unless(!r.boolean("mlp_bias", false), "mlp_bias", "false");
  if (r.find("head_dim"))
    r.refuse_unless(cfg["num_attention_heads"].get<int64_t>() * r.positive("head_dim") == cfg["hidden_size"].get<int64_t>(),
                    "head_dim", "hidden_size / num_attention_heads");
  if (overrides.contains("activation_checkpointing")) cfg["activation_checkpointing"] = overrides.at("activation_checkpointing");
  try {
    return make_llama(cfg, seed);
  } catch (const ConfigError& e) {
    BOOSTER_FAIL(ConfigError, r.where, ": ", e.what());
  }
}

json llama_to_hf(const DecoderFamily& family, const Module& model) {
  const LlamaConfig& c = dynamic_cast<const Llama&>(model).config;
  json rope_scaling = nullptr;
  if (c.rope_scaling.type == "linear") rope_scaling = {{"rope_type", "linear"}, {"factor", c.rope_scaling.factor}};
  if (c.rope_scaling.type == "llama3")
    rope_scaling = {{"rope_type", "llama3"},
                    {"factor", c.rope_scaling.factor},
                    {"low_freq_factor", c.rope_scaling.low_freq_factor},
                    {"high_freq_factor", c.rope_scaling.high_freq_factor},
                    {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  json out = {{"architectures", {family.architecture}},
              {"model_type", c.model_type},
              {"vocab_size", c.vocab_size},
              {"hidden_size", c.hidden_size},
              {"intermediate_size", c.intermediate_size},
              {"num_hidden_layers", c.num_hidden_layers},
              {"num_attention_heads", c.num_attention_heads},
              {"num_key_value_heads", c.num_key_value_heads},
              {"max_position_embeddings", c.max_position_embeddings},
              {"rms_norm_eps", c.rms_norm_eps},
              {"rope_theta", c.rope_theta},
              {"rope_scaling", rope_scaling},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", c.tie_word_embeddings}};
  if (c.model_type == "llama") out["attention_bias"] = false, out["mlp_bias"] = false;
  // The family's own keys (Note [Qwen2's window layers]): the window as config.json writes it.
  for (const auto& [key, fallback] : family.extra_keys) {
    if (key == "sliding_window") out[key] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
    if (key == "use_sliding_window") out[key] = c.sliding_window > 0;
    if (key == "max_window_layers") out[key] = c.max_window_layers;
  }
  return out;
}

// The memory estimate's sizes from make_model's keys or config.json's (the same names here).
std::optional<TransformerSizes> llama_sizes(const DecoderFamily& f, const json& m, bool checkpointing) {
  auto i = [](const json& j, const char* key, int64_t fallback) {
    const json v = j.value(key, json());
    return v.is_number_integer() ? v.get<int64_t>() : fallback;
  };
  auto b = [](const json& j, const char* key, bool fallback) {
    const json v = j.value(key, json());
    return v.is_boolean() ? v.get<bool>() : fallback;
  };
  const int64_t heads = i(m, "num_attention_heads", 0);
  return TransformerSizes{"llama", i(m, "vocab_size", 0), i(m, "hidden_size", 0), i(m, "num_hidden_layers", 0), heads,
                          i(m, "num_key_value_heads", heads), i(m, "intermediate_size", 0),
                          i(m, "max_position_embeddings", f.default_max_positions), b(m, "tie_word_embeddings", false),
                          checkpointing, f.qkv_bias};
}

[[maybe_unused]] const bool kRegistered = [] {
  double order = 5;  // after cnn, before hf
  for (const DecoderFamily& d : decoder_families()) {
    ModelFamily f;
    f.type = d.model_type;
    f.module_name = "Llama";
    f.hf_model_type = d.model_type;
    f.architecture = d.architecture;
    f.listing_order = order, order += 0.1;
    f.make = make_llama;
    f.from_hf = [&d](const HfConfigReader& r, const json& o, uint64_t seed) { return llama_from_hf(d, r, o, seed); };
    f.to_hf = [&d](const Module& m) { return llama_to_hf(d, m); };
    f.sizes = [&d](const json& m, const json* hf) {
      return llama_sizes(d, hf ? *hf : m, m.value("activation_checkpointing", json()) == json(true));
    };
    f.owns = [type = d.model_type](const Module& m) {
      const auto* llama = dynamic_cast<const Llama*>(&m);
      return llama != nullptr && llama->config.model_type == type;
    };
    f.tied = [](const Module& m) { return dynamic_cast<const Llama&>(m).config.tie_word_embeddings; };
    // nn::Llama's names are Hugging Face's; older files carry the rotary table.
    f.base_prefix = "model.";
    f.names = {{"", ""}};
    f.buffers = R"(model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq)";
    // Note [Llama shard policy] in llama.cpp.
    f.layer_prefix = "model.layers.";
    f.layer_splits = {{"self_attn.q_proj", 0}, {"self_attn.k_proj", 0}, {"self_attn.v_proj", 0},
                      {"self_attn.o_proj", 1}, {"mlp.gate_proj", 0},    {"mlp.up_proj", 0},
                      {"mlp.down_proj", 1}};
    f.embedding = "model.embed_tokens.weight";
    f.head = "lm_head.weight";
    f.shard_policy = llama_shard_policy;  // llama.cpp: one policy, under "Llama", for all three
    register_model_family(std::move(f));
  }
  return true;
}();

}  // namespace

}  // namespace booster::nn
