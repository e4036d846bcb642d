// The tiny Llamas of fixtures/make_llama_fixtures.py, rebuilt in C++: the config from the fixture's
// JSON and the weights by the script's formula (element i of the p-th listed parameter, computed in
// double and rounded once to float, as there). Shared by the model and the generation tests.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "booster/nn/llama.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"

namespace booster::testing {

// A tiny grouped-query Llama (width 32, 4 heads over 2 key/value heads, 2 layers, vocabulary 64, 16
// positions) for the tests that compare layouts or strategies on one model of their own.
inline nn::LlamaConfig tiny_llama_config() {
  nn::LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 16;
  return c;
}

inline nn::LlamaConfig llama_config_from(const nlohmann::json& j) {
  nn::LlamaConfig c;
  c.vocab_size = j.at("vocab_size");
  c.hidden_size = j.at("hidden_size");
  c.intermediate_size = j.at("intermediate_size");
  c.num_hidden_layers = j.at("num_hidden_layers");
  c.num_attention_heads = j.at("num_attention_heads");
  c.num_key_value_heads = j.at("num_key_value_heads");
  c.max_position_embeddings = j.at("max_position_embeddings");
  c.rms_norm_eps = j.at("rms_norm_eps");
  c.rope_theta = j.at("rope_theta");
  c.tie_word_embeddings = j.at("tie_word_embeddings");
  return c;
}

inline void set_llama_fixture_weights(nn::Module& model, const nlohmann::json& params) {
  std::map<std::string, Tensor> mine;
  for (const auto& [name, t] : model.named_parameters()) mine[name] = t;
  NoGradGuard no_grad;
  for (size_t p = 0; p < params.size(); ++p) {
    const std::string name = params[p][0];
    const Shape shape = params[p][1].get<Shape>();
    INFO(name);
    REQUIRE(mine.count(name));
    REQUIRE(mine.at(name).shape() == shape);
    const bool norm = name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0;
    std::vector<float> values(size_t(mine.at(name).numel()));
    for (size_t i = 0; i < values.size(); ++i) {
      const int64_t n = (int64_t(i) * 7919 + int64_t(p) * 104729 + 17) % 2003;
      const double u = double(n) / 2003.0 - 0.5;
      values[i] = float(norm ? 1.0 + u * 0.2 : u * 0.25);
    }
    mine.at(name).copy_(from_vector(values, shape));
  }
}

}  // namespace booster::testing
