// A model's sizes checked against limits before it is built (Note [Sizes before building]): the
// parameter count of a decoder or an MLP from its config, in arithmetic that cannot overflow.
//
// Note [Sizes before building]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A config's sizes were first checked by building the model: a Hugging Face config.json with
// "vocab_size" 10^12 built (deferred) an embedding whose draws were skipped for minutes,
// "num_hidden_layers" 10^6 grew modules without end, and a booster config with "hidden_size" 2^40 was
// refused only by the allocator ("cannot allocate 4294967296.0 PiB"), a message about memory, not
// about the field. So before anything is built:
//   - every width (vocabulary, hidden, feed-forward, heads, positions, an MLP's layers) is at most
//     kMaxModelWidth = 2^24 (no model comes near: Llama 3's vocabulary is 128,256, its widest layer
//     53,248; the longest context trained, 10M positions, is under it), and the layers at most
//     kMaxModelLayers (the config's depth limit, Note [The depth limit] in config/schema.cpp);
//   - the parameter count, added and multiplied saturating at INT64_MAX so no product wraps, is at
//     most kMaxModelParameters = 2^40 (4 TiB of float32 weights: no host holds it, and no dense model
//     is near it), naming every size that went into it;
//   - a Hugging Face directory's config.json is compared with its weight files' headers in the sizes
//     that make a build long (the embedding's rows and columns, the layers the names count, the
//     feed-forward's rows), and a difference is named with both values and the tensor that says so
//     (nn/hf.cpp); other differences are cheap to build and listed in full after the build.
// Each message names the field, its value and the limit, or what the weights say.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace booster::nn {

inline constexpr int64_t kMaxModelWidth = int64_t(1) << 24;
inline constexpr int64_t kMaxModelLayers = 4096;  // = config::kMaxModelDepth (Note [The depth limit])
inline constexpr int64_t kMaxModelParameters = int64_t(1) << 40;

// One size of a config: its name as the message should show it ('model.hidden_size', "n_embd") and
// its value; `present` false when the config does not give it as a positive integer (the model's own
// reader then says why).
struct SizeField {
  std::string name;
  int64_t value = 0;
  bool present = false;
};

// The sizes of a decoder (GPT-2 or the Llama family). A GPT's feed-forward is 4 x width.
struct DecoderSizes {
  bool gpt = false;
  SizeField vocab, width, layers, heads, kv_heads, intermediate, positions;
  bool tied = false;
};

// The sizes of a booster model config ({"type": "gpt" | "llama" | "mistral" | "qwen2", ...}, its keys
// named 'model.KEY'), or of a Hugging Face config.json (GPT-2's keys and defaults for model_type "gpt2"
// or architectures GPT2LMHeadModel, else the Llama family's), named "KEY".
DecoderSizes booster_decoder_sizes(const std::string& type, const nlohmann::json& model);
DecoderSizes hf_decoder_sizes(const nlohmann::json& config);

// a x b and a + b, saturating at INT64_MAX (for non-negative operands).
int64_t saturating_mul(int64_t a, int64_t b);
int64_t saturating_add(int64_t a, int64_t b);

// The decoder's parameter count (saturating), from its present sizes.
int64_t decoder_parameters(const DecoderSizes& s);

// ConfigError "<where>: <field> is V, more than booster's limit of L for ..." for a width or layer
// count past its limit, or a parameter count past kMaxModelParameters naming the sizes.
void check_decoder_sizes(const DecoderSizes& s, const std::string& where);

// A Hugging Face config.json (`where` names it) against the limits, and, when `shapes` is given, against
// the weight files' headers: every tensor name the files hold (as they name it) -> its shape, plus the
// names an index places in missing shards (with an empty shape). ConfigError naming each difference:
// the key, its value, and the tensor that says otherwise.
void check_hf_sizes(const nlohmann::json& config, const std::string& where,
                    const std::map<std::string, std::vector<int64_t>>* shapes = nullptr);

// The same for a booster config's "mlp" or "linear" model ('model.in', 'model.hidden', 'model.classes').
void check_mlp_sizes(const nlohmann::json& model, const std::string& where);

}  // namespace booster::nn
