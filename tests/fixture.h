// Reads reference fixtures made by PyTorch (tests/fixtures/*.json, written by the scripts beside them).
//
// Format: {"<case>": {"<tensor name>": {"shape": [..], "dtype": "float32", "data": [..flat..]}, ...}, ...}
// A value that is not an object with "shape" (a number, a string, a list) is kept as plain JSON.
#pragma once

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "booster/ops/ops.h"

namespace booster::testing {

inline nlohmann::json load_fixture_json(const std::string& file) {
  const std::string path = std::string(BOOSTER_FIXTURE_DIR) + "/" + file;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("fixture missing: " + path + " (regenerate with the script beside it)");
  return nlohmann::json::parse(in);
}

// A tensor from {"shape": [...], "dtype": "...", "data": [...]}; "inf", "-inf" and "nan" strings allowed.
inline Tensor tensor_from_json(const nlohmann::json& j) {
  Shape shape = j.at("shape").get<Shape>();
  std::vector<double> data;
  for (const auto& v : j.at("data")) {
    if (v.is_string()) {
      const std::string s = v.get<std::string>();
      data.push_back(s == "nan" ? NAN : s == "inf" ? INFINITY : -INFINITY);
    } else {
      data.push_back(v.get<double>());
    }
  }
  const DType dt = dtype_from_string(j.value("dtype", "float64"));
  return from_vector(data, shape, DType::Float64).to(dt);
}

// Max |a - b| / (atol + rtol |b|) style check: every element within atol + rtol * |b|.
inline bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8) {
  if (a.shape() != b.shape()) return false;
  auto va = a.tolist(), vb = b.tolist();
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) && std::isnan(vb[i])) continue;
    if (std::isinf(vb[i]) && va[i] == vb[i]) continue;
    if (!(std::abs(va[i] - vb[i]) <= atol + rtol * std::abs(vb[i]))) return false;
  }
  return true;
}

// The largest absolute difference (for messages).
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  auto va = a.tolist(), vb = b.tolist();
  double m = 0;
  for (size_t i = 0; i < va.size() && i < vb.size(); ++i) m = std::max(m, std::abs(va[i] - vb[i]));
  return m;
}

}  // namespace booster::testing
