// nn::generate (generate.h): the prompt through the model once, then one cached position per new token.
//
// Note [Sampling]
// ~~~~~~~~~~~~~~~
// Hugging Face's generate() with do_sample, in its order of logits processors, computed in float64 on
// the CPU from the float32 logits of the last position:
//   1. temperature 0 is greedy search: the id of the highest logit, the lowest id among equals (torch's
//      argmax), with no draw from the generator;
//   2. otherwise logits / temperature;
//   3. top_k > 0: every logit below the k-th highest is removed (-inf), so ties with the k-th stay, as
//      TopKLogitsWarper keeps them;
//   4. top_p < 1: softmax of what is left, ids by descending probability (lower id first among equals),
//      and the shortest prefix whose probability sums to at least top_p is kept, never fewer than one id
//      (TopPLogitsWarper, which removes from the other end what sums to at most 1 - top_p: the same set);
//   5. softmax over the kept ids and one draw: u uniform in [0, 1) from the seeded generator, the first id
//      (ascending) whose cumulative probability exceeds u. One draw per token, so a seed fixes the sequence.
// The draws are our generator's (xoshiro256**), not torch's, so a sampled sequence matches Hugging Face's
// in distribution, not token for token; greedy search matches exactly.
#include "booster/nn/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>

#include "booster/common/error.h"
#include "booster/nn/kv_cache.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"

namespace booster::nn {

std::string to_string(StopReason reason) {
  switch (reason) {
    case StopReason::MaxNewTokens: return "max_new_tokens";
    case StopReason::MaxPositions: return "max_positions";
    case StopReason::EndOfSequence: return "eos";
    case StopReason::StopCondition: return "stop";
  }
  return "?";
}

void validate(const GenerateOptions& o) {
  BOOSTER_CHECK(o.max_new_tokens >= 0, ValueError, "generate: max_new_tokens is ", o.max_new_tokens,
                "; it must be >= 0");
  BOOSTER_CHECK(std::isfinite(o.temperature) && o.temperature >= 0.0, ValueError, "generate: temperature is ",
                o.temperature, "; it must be >= 0 (0 is greedy)");
  BOOSTER_CHECK(o.top_k >= 0, ValueError, "generate: top_k is ", o.top_k, "; it must be >= 0 (0 keeps every id)");
  BOOSTER_CHECK(o.top_p > 0.0 && o.top_p <= 1.0, ValueError, "generate: top_p is ", o.top_p,
                "; it must be in (0, 1] (1 keeps every id)");
  BOOSTER_CHECK(o.vocab_limit >= 0, ValueError, "generate: vocab_limit is ", o.vocab_limit,
                "; it must be >= 0 (0: the model's vocabulary)");
  BOOSTER_CHECK(std::isfinite(o.repetition_penalty) && o.repetition_penalty > 0.0, ValueError,
                "generate: repetition_penalty is ", o.repetition_penalty, "; it must be > 0 (1 is off)");
}

std::vector<int64_t> top_p_set(const std::vector<double>& probs, double top_p) {
  std::vector<int64_t> order(probs.size());
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return probs[size_t(a)] > probs[size_t(b)]; });
  double sum = 0.0;
  size_t keep = 0;
  while (keep < order.size()) {
    sum += probs[size_t(order[keep])];
    ++keep;
    if (sum >= top_p) break;
  }
  order.resize(std::max<size_t>(keep, 1));
  return order;
}

int64_t sample_next_token(const std::vector<float>& logits, const GenerateOptions& o, Generator& gen) {
  BOOSTER_CHECK(!logits.empty(), ValueError, "generate: no logits to sample from");
  const size_t V = logits.size();
  if (o.temperature == 0.0) {  // 1. greedy: max_element keeps the first (lowest) id among equals
    return int64_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::vector<double> z(V);
  for (size_t i = 0; i < V; ++i) z[i] = double(logits[i]) / o.temperature;  // 2.
  if (o.top_k > 0 && size_t(o.top_k) < V) {  // 3.
    std::vector<double> sorted = z;
    std::nth_element(sorted.begin(), sorted.begin() + (o.top_k - 1), sorted.end(), std::greater<double>());
    const double kth = sorted[size_t(o.top_k - 1)];
    for (double& v : z)
      if (v < kth) v = neg_inf;
  }
  auto softmax_of = [&](const std::vector<double>& x) {
    const double m = *std::max_element(x.begin(), x.end());
    std::vector<double> p(V);
    double s = 0.0;
    for (size_t i = 0; i < V; ++i) s += (p[i] = x[i] == neg_inf ? 0.0 : std::exp(x[i] - m));
    for (double& v : p) v /= s;
    return p;
  };
  std::vector<double> p = softmax_of(z);
  if (o.top_p < 1.0) {  // 4.
    std::vector<double> kept(V, neg_inf);
    for (int64_t id : top_p_set(p, o.top_p)) kept[size_t(id)] = z[size_t(id)];
    p = softmax_of(kept);
  }
  const double u = gen.uniform();  // 5.
  double cumulative = 0.0;
  int64_t last_kept = 0;
  for (size_t i = 0; i < V; ++i) {
    if (p[i] == 0.0) continue;
    last_kept = int64_t(i);
    cumulative += p[i];
    if (u < cumulative) return int64_t(i);
  }
  return last_kept;  // u beyond a cumulative sum that rounded below 1
}

GenerateResult generate(Module& model, const std::vector<int64_t>& prompt, const GenerateOptions& o) {
  validate(o);
  CausalLM* lm = model.causal_lm();
  BOOSTER_CHECK(lm != nullptr, IncompatibleError, "generate: the model (", model.name(),
                ") has no key/value-cache forward; nn::generate takes a decoder that implements nn::CausalLM "
                "(nn::GPT, nn::Llama, or what boost() returned for one)");
  const int64_t vocab = lm->vocab_size(), limit = lm->max_positions(), P = int64_t(prompt.size());
  BOOSTER_CHECK(P > 0, ValueError, "generate: the prompt is empty; give at least one token id");
  for (size_t i = 0; i < prompt.size(); ++i)
    BOOSTER_CHECK(prompt[i] >= 0 && prompt[i] < vocab, ValueError, "generate: prompt token ", i, " is id ", prompt[i],
                  ", outside the model's vocabulary [0, ", vocab, ")");
  BOOSTER_CHECK(P < limit || o.max_new_tokens == 0, ShapeError, "generate: the prompt has ", P,
                " tokens, the model takes at most ", limit, " positions in all; shorten the prompt to leave room");

  // Device and mode: the model's own device; eval (no dropout) for the call, then back.
  Device device = Device::cpu();
  for (const Tensor& p : model.parameters()) {
    device = p.device();
    break;
  }
  const bool was_training = model.is_training();
  model.eval();
  struct RestoreMode {
    Module& m;
    bool training;
    ~RestoreMode() { m.train(training); }
  } restore{model, was_training};
  NoGradGuard no_grad;

  GenerateResult result;
  Generator gen(o.seed);
  std::vector<int64_t> sequence = prompt;
  // Not P + max_new_tokens first: near 2^63 it wraps negative.
  const int64_t total = o.max_new_tokens >= limit - P ? limit : P + o.max_new_tokens;
  const bool use_cache = o.use_cache && lm->has_kv_cache();
  std::optional<KVCache> cache;
  if (use_cache) cache = lm->make_kv_cache(total);
  const int64_t allowed = o.vocab_limit > 0 ? std::min(o.vocab_limit, vocab) : vocab;
  // [1, T, V] -> the last position's allowed ids, float32 on the CPU, checked and penalized.
  auto last_logits = [&](const Tensor& logits) {
    std::vector<float> z = logits.select(1, logits.size(1) - 1).reshape({vocab}).narrow(0, 0, allowed)
                               .to(Device::cpu()).to(DType::Float32).to_vector<float>();
    const int64_t bad = std::count_if(z.begin(), z.end(), [](float v) { return !std::isfinite(v); });
    BOOSTER_CHECK(bad == 0, TrainingError, "generate: the logits of new token ", result.tokens.size() + 1,
                  " (position ", sequence.size(), ") hold NaN or inf in ", bad, " of ", allowed,
                  " ids; the model's weights or its computation overflowed: check the checkpoint (booster doctor "
                  "names the first non-finite tensor), or generate from float32 weights");
    if (o.repetition_penalty != 1.0) {
      std::vector<bool> seen(size_t(allowed), false);
      for (int64_t id : sequence)
        if (id < allowed && !seen[size_t(id)]) {
          seen[size_t(id)] = true;
          float& v = z[size_t(id)];
          v = v > 0.0f ? float(double(v) / o.repetition_penalty) : float(double(v) * o.repetition_penalty);
        }
    }
    return z;
  };
  auto ids_tensor = [&](const int64_t* ids, int64_t n) {
    return from_vector(std::vector<int64_t>(ids, ids + n), {1, n}).to(device);
  };

  Tensor logits;
  if (o.max_new_tokens > 0) logits = use_cache ? lm->forward_cached(ids_tensor(prompt.data(), P), *cache)
                                                  : model(ids_tensor(prompt.data(), P));
  while (int64_t(result.tokens.size()) < o.max_new_tokens) {
    const int64_t next = sample_next_token(last_logits(logits), o, gen);
    result.tokens.push_back(next);
    sequence.push_back(next);
    if (next == o.eos_id || std::find(o.more_eos_ids.begin(), o.more_eos_ids.end(), next) != o.more_eos_ids.end()) {
      result.stop_reason = StopReason::EndOfSequence;
      return result;
    }
    if (o.stop && o.stop(result.tokens)) {
      result.stop_reason = StopReason::StopCondition;
      return result;
    }
    if (int64_t(result.tokens.size()) == o.max_new_tokens) break;
    if (int64_t(sequence.size()) >= limit) {
      result.stop_reason = StopReason::MaxPositions;
      return result;
    }
    logits = use_cache ? lm->forward_cached(ids_tensor(&next, 1), *cache)
                         : model(ids_tensor(sequence.data(), int64_t(sequence.size())));
  }
  result.stop_reason = StopReason::MaxNewTokens;
  return result;
}

}  // namespace booster::nn
