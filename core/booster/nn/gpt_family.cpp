// The GPT (nn::GPT, models.h) as a model family (Note [Model families] in families.cpp): make_model's
// keys and config.json's (GPT2Config's names and defaults), GPT-2's tensor names with its transposed
// Conv1D weights, the tensor-parallel split of a block, and the hooks that build the model.
#include <cmath>

#include "booster/common/error.h"
#include "booster/nn/families.h"
#include "booster/nn/models.h"

namespace booster::nn {

namespace {

using json = nlohmann::json;
using Kind = FamilyKey::Kind;

int64_t integer(const json& cfg, const char* key) { return cfg.at(key).get<int64_t>(); }

// make_model's {"type": "gpt", ...}; ConfigError naming the key (check_family_keys) or the sizes.
ModulePtr make_gpt(const json& cfg, uint64_t seed) {
  check_family_keys(*find_model_family("gpt"), cfg);
  GPTConfig g;
  g.vocab_size = integer(cfg, "vocab_size");
  g.context = integer(cfg, "context");
  g.width = integer(cfg, "width");
  g.layers = integer(cfg, "layers");
  g.heads = integer(cfg, "heads");
  g.dropout = cfg.value("dropout", g.dropout);
  g.activation_checkpointing = cfg.value("activation_checkpointing", g.activation_checkpointing);
  return std::make_shared<GPT>(g, seed);
}

// GPT2LMHeadModel's config.json (GPT2Config's defaults); what nn::GPT does not compute (another
// activation, n_inner other than 4 n_embd, scaled attention variants) is refused by key.
ModulePtr gpt2_from_hf(const HfConfigReader& r, const json& overrides, uint64_t seed) {
  if (overrides.contains("dropout")) {
    const json& d = overrides.at("dropout");
    BOOSTER_CHECK(d.is_number() && d.get<double>() >= 0.0 && d.get<double>() < 1.0, ConfigError,
                  "'model.dropout' must be a number in [0, 1), got ", d.dump());
  }
  GPTConfig g;
  g.vocab_size = r.positive("vocab_size", 50257);
  g.context = r.positive("n_positions", 1024);
  g.width = r.positive("n_embd", 768);
  g.layers = r.positive("n_layer", 12);
  g.heads = r.positive("n_head", 12);
  g.layer_norm_eps = r.number("layer_norm_epsilon", 1e-5);
  g.tie_word_embeddings = r.boolean("tie_word_embeddings", true);
  const std::string act = r.text("activation_function", "gelu_new");
  if (r.find("activation_function"))
    r.refuse_unless(act == "gelu_new" || act == "gelu_pytorch_tanh", "activation_function",
                    "\"gelu_new\", GELU's tanh approximation");
  if (const json* n_inner = r.find("n_inner"))
    r.refuse_unless(*n_inner == 4 * g.width, "n_inner", "null, i.e. 4 n_embd");
  if (r.find("scale_attn_by_inverse_layer_idx"))
    r.refuse_unless(!r.boolean("scale_attn_by_inverse_layer_idx", false), "scale_attn_by_inverse_layer_idx", "false");
  if (r.find("scale_attn_weights")) r.refuse_unless(r.boolean("scale_attn_weights", true), "scale_attn_weights", "true");
  BOOSTER_CHECK(g.width % g.heads == 0, ConfigError, r.where, ": n_embd ", g.width, " is not divisible by n_head ", g.heads);
  g.dropout = overrides.value("dropout", 0.0);
  g.activation_checkpointing = overrides.value("activation_checkpointing", false);
  return std::make_shared<GPT>(g, seed);
}

json gpt2_to_hf(const Module& model) {
  const GPTConfig& g = dynamic_cast<const GPT&>(model).config;
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", g.vocab_size},
          {"n_positions", g.context},
          {"n_embd", g.width},
          {"n_layer", g.layers},
          {"n_head", g.heads},
          {"n_inner", nullptr},
          {"layer_norm_epsilon", g.layer_norm_eps},
          {"activation_function", "gelu_new"},
          {"tie_word_embeddings", g.tie_word_embeddings},
          {"resid_pdrop", g.dropout},
          {"embd_pdrop", g.dropout},
          {"attn_pdrop", 0.0}};  // nn::GPT applies no dropout to the attention weights
}

// The memory estimate's sizes: a make_model config's keys, or config.json's with GPT2Config's defaults.
// (Megatron's count has no checkpointed variant here: the GPT's activations are counted whole.)
std::optional<TransformerSizes> gpt_sizes(const json& model, bool hf) {
  const ModelFamily& f = *find_model_family("gpt");
  auto size = [&](const char* key) -> int64_t {
    for (const FamilyKey& k : f.keys)
      if (k.name == key) {
        const json v = model.value(hf ? k.hf_key : k.name, json());
        return v.is_number_integer() ? v.get<int64_t>() : hf ? k.hf_default.get<int64_t>() : 0;
      }
    return 0;
  };
  const json tie = model.value("tie_word_embeddings", json());
  const int64_t w = size("width");
  return TransformerSizes{"gpt", size("vocab_size"), w, size("layers"), size("heads"), size("heads"), 4 * w,
                          size("context"), hf && (tie.is_boolean() ? tie.get<bool>() : true), false};
}

[[maybe_unused]] const bool kRegistered = [] {
  ModelFamily f;
  f.type = "gpt";
  f.module_name = "GPT";
  f.hf_model_type = "gpt2";
  f.architecture = "GPT2LMHeadModel";
  f.listing_order = 3;  // after mlp and linear, before cnn
  // make_model's keys; config.json's GPT2Config names and defaults.
  f.keys = {
      {"vocab_size", Kind::Integer, 256, true, 1, INFINITY, false, "", "vocab_size", 50257},
      {"context", Kind::Integer, 128, true, 1, INFINITY, false, "longest sequence", "n_positions", 1024},
      {"width", Kind::Integer, 256, true, 1, INFINITY, false, "", "n_embd", 768},
      {"layers", Kind::Integer, 4, true, 1, INFINITY, true, "transformer blocks (Note [The depth limit])", "n_layer", 12},
      {"heads", Kind::Integer, 4, true, 1, INFINITY, false, "must divide width", "n_head", 12},
      {"dropout", Kind::Number, 0.0, false, 0.0, 1.0, false, "", "", nullptr},
      {"activation_checkpointing", Kind::Boolean, false, false, 0, INFINITY, false,
       "recompute each block's activations in backward: less memory, one more forward", "", nullptr},
  };
  f.divisible = {{"width", "heads"}};
  f.context_key = "context";
  f.make = make_gpt;
  f.from_hf = gpt2_from_hf;
  f.to_hf = gpt2_to_hf;
  f.hf_overrides = {"dropout"};
  f.sizes = [](const json& m, const json* hf) { return hf ? gpt_sizes(*hf, true) : gpt_sizes(m, false); };
  f.owns = [](const Module& m) { return dynamic_cast<const GPT*>(&m) != nullptr; };
  f.tied = [](const Module& m) { return dynamic_cast<const GPT&>(m).config.tie_word_embeddings; };
  // Note [Hugging Face names] in hf.cpp: nanoGPT's names under transformer., Conv1D weights [in, out].
  f.base_prefix = "transformer.";
  f.names = {{"wte.", "transformer.wte."},
             {"wpe.", "transformer.wpe."},
             {"blocks.", "transformer.h."},
             {"ln_f.", "transformer.ln_f."},
             {"lm_head.", "lm_head."}};
  f.conv1d = {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"};
  f.buffers = R"(transformer\.h\.\d+\.attn\.(masked_)?bias)";
  // Megatron's split of a block (Note [Shard policies] in shard_policy.cpp): c_attn's q, k and v rows
  // each by heads, c_proj row-parallel, c_fc column- and mlp.c_proj row-parallel.
  f.layer_prefix = "blocks.";
  f.layer_splits = {{"attn.c_attn", 0, 3}, {"attn.c_proj", 1, 1}, {"mlp.c_fc", 0, 1}, {"mlp.c_proj", 1, 1}};
  f.embedding = "wte.weight";
  f.head = "lm_head.weight";
  f.shard_policy = gpt_shard_policy;  // shard_policy.cpp: the block surgery; its shards read the table above
  register_model_family(std::move(f));
  return true;
}();

}  // namespace

}  // namespace booster::nn
