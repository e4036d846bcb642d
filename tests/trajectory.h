// A run's trajectory from its checkpoints, for the bounds of tests/roundoff.h: the weights of a step as
// one flat list (every tensor, in name order), the L2 distance of two such lists, and the path length
// sum_t |w_t - w_{t-1}| of a run that saved every step, from the model `booster train` starts from.
#pragma once

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "booster/checkpoint/safetensors.h"
#include "booster/nn/models.h"

namespace testing {

using Weights = std::vector<double>;

// Every tensor of a model file or state dict, in name order (the same order for every file).
template <typename Map>
Weights flat_weights(const Map& tensors) {
  Weights out;
  for (const auto& [name, t] : tensors) {
    const std::vector<double> v = t.tolist();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// The weights a checkpoint step directory holds (its model/ folder).
inline Weights weights_at(const std::filesystem::path& step) {
  return flat_weights(booster::checkpoint::load_model(step / "model"));
}

inline double l2_distance(const Weights& a, const Weights& b) {
  REQUIRE(a.size() == b.size());
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

inline std::filesystem::path step_path(const std::filesystem::path& root, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d", step);
  return root / name;
}

// sum_t |w_t - w_{t-1}| over steps 1..steps of a run that checkpointed every step into `root`, w_0
// being `model` built from `seed` (train.seed, as `booster train` builds it).
inline double checkpoint_path(const std::filesystem::path& root, int steps, const nlohmann::json& model,
                              uint64_t seed) {
  std::map<std::string, booster::Tensor> initial;
  for (const auto& [name, t] : booster::nn::make_model(model, seed)->state_dict()) initial[name] = t;
  Weights before = flat_weights(initial);
  double path = 0.0;
  for (int step = 1; step <= steps; ++step) {
    Weights now = weights_at(step_path(root, step));
    path += l2_distance(now, before);
    before = std::move(now);
  }
  return path;
}

}  // namespace testing
