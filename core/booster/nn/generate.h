// Sampling text from a decoder: nn::generate runs a CausalLM (nn::GPT, nn::Llama) over a prompt and
// then one new token per step through its key/value cache (kv_cache.h), choosing each token as Hugging
// Face's generate() does (Note [Sampling] in generate.cpp). `booster generate` is this call.
//
//   nn::GenerateResult r = nn::generate(*model, {1, 2, 3}, {.max_new_tokens = 50, .temperature = 0.8,
//                                                             .top_k = 40, .top_p = 0.95, .seed = 7});
//   r.tokens        // the new ids, at most max_new_tokens
//   r.stop_reason   // why it stopped: the count, the model's length limit, or the end-of-sequence id
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "booster/nn/module.h"
#include "booster/tensor/random.h"

namespace booster::nn {

struct GenerateOptions {
  int64_t max_new_tokens = 32;  // >= 0
  // 0: greedy (the highest logit, ties to the lowest id; top_k and top_p then do nothing). Otherwise
  // the logits are divided by it before the filters: < 1 sharpens, > 1 flattens.
  double temperature = 1.0;
  int64_t top_k = 0;   // keep the k highest logits (ties with the k-th kept too); 0: all
  double top_p = 1.0;  // in (0, 1]: keep the smallest most-probable set whose probability reaches it
  uint64_t seed = 0;   // the generator of the draws: one seed, one sequence
  // Stop after this id is generated (it is the last token returned); -1: never.
  int64_t eos_id = -1;
  // More ids that stop it alike (a Hugging Face config's eos_token_id may list several).
  std::vector<int64_t> more_eos_ids;
  // > 0: only ids below it are generated (a tokenizer's vocabulary, when the model's is padded past it).
  int64_t vocab_limit = 0;
  // Hugging Face's repetition_penalty (> 0; 1: off), applied first, before the temperature: the logit
  // of every id already in the sequence (prompt included) is divided by it when positive, multiplied
  // when negative, so a penalty > 1 makes repeats less likely, greedy search included.
  double repetition_penalty = 1.0;
  // Called with the new ids after each one; true stops (StopReason::StopCondition), the last id kept
  // (a stop text: `booster generate --stop`; Hugging Face's StoppingCriteria).
  std::function<bool(const std::vector<int64_t>& generated)> stop;
  // false: every step runs the model over the whole sequence so far (no cache): the test oracle and the
  // benchmark's baseline, the same tokens at quadratic cost.
  bool use_cache = true;
};

enum class StopReason { MaxNewTokens, MaxPositions, EndOfSequence, StopCondition };
std::string to_string(StopReason reason);

struct GenerateResult {
  std::vector<int64_t> tokens;  // the generated ids (the prompt not included)
  StopReason stop_reason = StopReason::MaxNewTokens;
};

// ValueError naming the option for max_new_tokens < 0, a temperature < 0 or not finite, top_k < 0, or
// top_p outside (0, 1].
void validate(const GenerateOptions& options);

// Generates from `model`, which must implement CausalLM (nn::GPT, nn::Llama; IncompatibleError
// otherwise), for one sequence: `prompt` (at least one id, each in [0, vocab)) is run once, then each
// new token costs one position through the cache. The model runs in eval mode without gradients on its
// own device (CPU or CUDA; the logits of the last position come to the CPU for sampling) and is put back
// in its former mode. Stops at max_new_tokens, at eos_id or one of more_eos_ids, or when the sequence fills the model's
// max_positions (StopReason::MaxPositions: the prompt plus the new tokens reached the limit), or when
// `stop` says so. ValueError for bad options or ids, ShapeError for a prompt already as long as the limit,
// TrainingError for logits that hold NaN or inf (a diverged or overflowing model), naming the token.
// `model` may be what boost() returned (Module::causal_lm): every rank of a plugin must call it alike.
GenerateResult generate(Module& model, const std::vector<int64_t>& prompt, const GenerateOptions& options = {});

// The next token from one position's logits under `options` (Note [Sampling]); draws from `gen` unless
// the choice is greedy.
int64_t sample_next_token(const std::vector<float>& logits, const GenerateOptions& options, Generator& gen);

// The ids of the nucleus of `probs` (a distribution over ids): by descending probability (ties: lower
// id first), the shortest prefix whose sum reaches top_p, at least one id. Returned in that order.
std::vector<int64_t> top_p_set(const std::vector<double>& probs, double top_p);

}  // namespace booster::nn
