// fp8 scaling and the fp8 linear layers (float8.h). On the CPU the GEMMs run over the dequantized
// float8 values in float32 (exact products of float8 values, float32 accumulation), and the output is
// multiplied by the inverse scales afterwards, as a float8 GEMM with scale factors computes it.
//
// Note [Float8 GEMMs on a GPU]
// On CUDA tensors the GEMMs are float8_mm: cuBLASLt's float8 GEMM with the scales as its scale factors
// (sm_89+, sizes multiples of 16; elsewhere the same dequantized float32 GEMM). It takes both operands
// contiguous along the inner dimension, so forward quantizes x and the weight a second time transposed
// for the backward GEMMs (dX = dY W takes W^T [in, out], dW = dY^T X takes X^T [in, rows], and dY^T is
// quantized in backward); quantizing elementwise, the transposed copies hold the same float8 values.
#include "booster/mixed_precision/float8.h"

#include <cmath>

#include "booster/autograd/autograd.h"
#include "booster/nn/linear.h"
#include "booster/ops/ops.h"

namespace booster::mixed_precision {

// ------------------------------------------------------------------------------------ Float8Scale

Float8Scale::Float8Scale(float fp8_max, const Float8ScalingOptions& options) : fp8_max_(fp8_max), options_(options) {
  if (options_.delayed) ring_.assign(size_t(options_.amax_history_len), 0.0f);
}

float Float8Scale::from_amax(float amax) const {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return scale_;
  return (fp8_max_ / amax) / std::ldexp(1.0f, options_.margin);
}

float Float8Scale::scale_for(float amax, bool record) {
  if (!record) return options_.delayed ? scale_ : from_amax(amax);  // Note [Forwards that do not train]
  if (!std::isnan(step_amax_) && (std::isnan(amax) || amax > step_amax_)) step_amax_ = amax;
  if (options_.delayed) return scale_;
  scale_ = from_amax(amax);
  return scale_;
}

void Float8Scale::update() {
  if (options_.delayed) {
    ring_[size_t(next_)] = step_amax_;
    const float recent = step_amax_;
    next_ = (next_ + 1) % int64_t(ring_.size());
    float amax = recent;
    if (options_.amax_compute_algo == "max") {
      for (float a : ring_) {
        if (std::isnan(a)) {
          amax = a;
          break;
        }
        amax = std::max(amax, a);
      }
    }
    scale_ = from_amax(amax);
  }
  step_amax_ = 0.0f;
}

std::vector<float> Float8Scale::history() const {
  std::vector<float> h;
  const int64_t n = int64_t(ring_.size());
  for (int64_t i = 1; i <= n; ++i) h.push_back(ring_[size_t((next_ - i + n) % n)]);
  return h;
}

std::vector<float> Float8Scale::state() const {
  std::vector<float> s{scale_, step_amax_, float(next_)};
  s.insert(s.end(), ring_.begin(), ring_.end());
  return s;
}

void Float8Scale::load_state(const std::vector<float>& s) {
  BOOSTER_CHECK(s.size() == 3 + ring_.size(), StateError, "fp8 scaling state has ", s.size(), " values, expected ",
                3 + ring_.size(), " (amax_history_len ", ring_.size(),
                "): was the checkpoint saved with another amax_history_len or scaling?");
  scale_ = s[0];
  step_amax_ = s[1];
  next_ = int64_t(s[2]);
  BOOSTER_CHECK(next_ >= 0 && (ring_.empty() ? next_ == 0 : next_ < int64_t(ring_.size())), StateError,
                "fp8 scaling state: history position ", s[2], " is out of range");
  std::copy(s.begin() + 3, s.end(), ring_.begin());
}

// ---------------------------------------------------------------------------------- Float8Linears

namespace {

// '*' matches any run of characters (dots included); everything else matches itself.
bool glob_match(const std::string& pattern, const std::string& text) {
  size_t p = 0, t = 0, star = std::string::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

bool matches_any(const std::vector<std::string>& patterns, const std::string& name) {
  for (const std::string& p : patterns)
    if (glob_match(p, name)) return true;
  return false;
}

float amax_of(const Tensor& t) { return float(max(abs(t)).item()); }

// The float32 product of two float8 operands (dequantized with scale 1: exact; transposed as float32
// views, which the GEMM takes as flags), times 1 / (scale_a * scale_b).
Tensor scaled_mm(const Tensor& a, const Tensor& b, float scale_a, float scale_b) {
  return matmul(a, b) * (1.0 / (double(scale_a) * double(scale_b)));
}

}  // namespace

Float8Linears::Float8Linears(Float8LinearOptions options) : options_(std::move(options)) {}

void Float8Linears::bind(const nn::Module& model) {
  layers_.clear();
  by_weight_.clear();
  std::vector<std::pair<std::string, const nn::Linear*>> linears;
  for (const auto& [name, m] : model.named_modules())
    if (const auto* l = dynamic_cast<const nn::Linear*>(m)) linears.emplace_back(name, l);
  for (size_t i = 0; i < linears.size(); ++i) {
    const auto& [name, l] = linears[i];
    const bool head = i + 1 == linears.size() || name == "lm_head" || name.ends_with(".lm_head");
    if (head && !options_.lm_head) continue;
    if (!matches_any(options_.layers, name) || matches_any(options_.exclude, name)) continue;
    if (l->weight.numel() < options_.min_size) continue;
    const float e4m3 = Float8E4M3FN::kMax, e5m2 = Float8E5M2::kMax;
    auto layer = std::make_shared<Layer>(Layer{name, Float8Scale(e4m3, options_.scaling),
                                               Float8Scale(e4m3, options_.scaling),
                                               Float8Scale(e5m2, options_.scaling)});
    layers_.push_back(layer);
    by_weight_[l->weight.impl()] = layer;
  }
}

Tensor Float8Linears::linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  auto it = by_weight_.find(weight.impl());
  if (it == by_weight_.end()) return {};
  const std::shared_ptr<Layer> layer = it->second;
  BOOSTER_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.shape().back() == weight.shape()[1], ShapeError,
                "linear: input shape ", x.shape(), " and weight shape ", weight.shape(), " cannot be multiplied");
  const int64_t in = weight.shape()[1], out_features = weight.shape()[0];
  const DType x_dtype = x.dtype(), w_dtype = weight.dtype();
  // Note [Float8 GEMMs on a GPU]: float8_mm (cuBLASLt) takes both operands contiguous along k, so the
  // backward GEMMs get x and the weight quantized transposed (the same bytes as x8 and w8, transposed).
  const bool gpu = !x.device().is_cpu();
  const bool backward = autograd::needs_grad({&x, &weight, &bias});
  // A forward under grad mode trains (a frozen layer's too); one without (evaluation) leaves the
  // scaling state as it found it (Note [Forwards that do not train] in float8.h).
  const bool training = autograd::grad_mode_enabled();
  Tensor x8, w8, x_for_dw, w_for_dx, y;
  float sx, sw;
  {
    NoGradGuard no_grad;
    const autocast::AutocastGuard no_autocast(false);  // the GEMM below is float32 over float8 values
    const Tensor x2 = x.detach().reshape({-1, in});
    sx = layer->input.scale_for(amax_of(x2), training);
    sw = layer->weight.scale_for(amax_of(weight.detach()), training);
    x8 = to_float8(x2, DType::Float8E4M3FN, sx, /*saturate=*/true);
    w8 = to_float8(weight.detach(), DType::Float8E4M3FN, sw, /*saturate=*/true);
    if (gpu) {
      y = float8_mm(x8, w8, sx, sw);  // [rows, out] float32
      if (backward) {
        x_for_dw = to_float8(x2.t().contiguous(), DType::Float8E4M3FN, sx, /*saturate=*/true);  // [in, rows]
        w_for_dx = to_float8(weight.detach().t().contiguous(), DType::Float8E4M3FN, sw, /*saturate=*/true);
      }
    } else {
      y = scaled_mm(from_float8(x8), from_float8(w8).t(), sx, sw);  // [rows, out] float32
      x_for_dw = x8;
      w_for_dx = w8;
    }
    if (bias.defined()) y = y + bias.detach().to(DType::Float32);
    Shape s(x.shape().begin(), x.shape().end() - 1);
    s.push_back(out_features);
    y = y.reshape(s).to(options_.output_dtype);
  }
  if (backward) {
    const bool gx = x.requires_grad(), gw = weight.requires_grad(), gb = bias.defined() && bias.requires_grad();
    std::vector<Tensor> inputs{x, weight};
    if (bias.defined()) inputs.push_back(bias);
    const DType b_dtype = bias.defined() ? bias.dtype() : DType::Float32;
    autograd::record(y, "Float8LinearBackward", inputs,
                     [layer, x_for_dw, w_for_dx, sx, sw, x_shape = x.shape(), x_dtype, w_dtype, b_dtype, gx, gw, gb,
                      out_features, gpu, has_bias = bias.defined()](const Tensor& g) {
                       const autocast::AutocastGuard no_autocast(false);  // float32 GEMMs, as forward
                       const Tensor g2 = g.reshape({-1, out_features});
                       const Tensor g_in = g2.dtype() == DType::Float64 ? g2.to(DType::Float32) : g2;
                       const float sg = layer->grad_output.scale_for(amax_of(g2));
                       const Tensor g8 = to_float8(g_in, DType::Float8E5M2, sg, /*saturate=*/true);
                       autograd::grads r(has_bias ? 3 : 2);
                       if (gpu) {  // Note [Float8 GEMMs on a GPU]
                         if (gx) r[0] = float8_mm(g8, w_for_dx, sg, sw).reshape(x_shape).to(x_dtype);  // dY W
                         if (gw) {
                           const Tensor gt8 = to_float8(g_in.t().contiguous(), DType::Float8E5M2, sg, /*saturate=*/true);
                           r[1] = float8_mm(gt8, x_for_dw, sg, sx).to(w_dtype);  // dW = dY^T X
                         }
                       } else {
                         const Tensor g32 = from_float8(g8);
                         if (gx) r[0] = scaled_mm(g32, from_float8(w_for_dx), sg, sw).reshape(x_shape).to(x_dtype);
                         if (gw) r[1] = scaled_mm(g32.t(), from_float8(x_for_dw), sg, sx).to(w_dtype);
                       }
                       if (gb) r[2] = sum(g2.to(DType::Float32), {0}).to(b_dtype);  // db = sum dY
                       return r;
                     });
  }
  return y;
}

void Float8Linears::end_step(const MixedPrecision::AmaxReducer& agree) {
  if (agree && !layers_.empty()) {
    std::vector<float> amaxes;
    for (const auto& l : layers_)
      for (const Float8Scale* s : {&l->input, &l->weight, &l->grad_output}) amaxes.push_back(s->step_amax());
    agree(amaxes);
    size_t i = 0;
    for (const auto& l : layers_)
      for (Float8Scale* s : {&l->input, &l->weight, &l->grad_output}) s->set_step_amax(amaxes[i++]);
  }
  for (const auto& l : layers_) {
    l->input.update();
    l->weight.update();
    l->grad_output.update();
  }
}

std::vector<std::string> Float8Linears::layer_names() const {
  std::vector<std::string> names;
  for (const auto& l : layers_) names.push_back(l->name);
  return names;
}

const Float8Linears::Layer& Float8Linears::layer(const std::string& name) const {
  for (const auto& l : layers_)
    if (l->name == name) return *l;
  BOOSTER_FAIL(ValueError, "fp8: no fp8 layer named '", name, "'");
}

std::map<std::string, Tensor> Float8Linears::state_dict() const {
  std::map<std::string, Tensor> out;
  for (const auto& l : layers_) {
    for (const auto& [role, scale] : {std::pair<const char*, const Float8Scale*>{"input", &l->input},
                                      {"weight", &l->weight}, {"grad_output", &l->grad_output}}) {
      const std::vector<float> s = scale->state();
      out["float8." + l->name + "." + role] = from_vector(s, {int64_t(s.size())});
    }
  }
  return out;
}

void Float8Linears::load_state_dict(const std::map<std::string, Tensor>& tensors) {
  size_t used = 0;
  for (const auto& l : layers_) {
    for (const auto& [role, scale] : {std::pair<const char*, Float8Scale*>{"input", &l->input},
                                      {"weight", &l->weight}, {"grad_output", &l->grad_output}}) {
      const std::string key = "float8." + l->name + "." + role;
      auto it = tensors.find(key);
      BOOSTER_CHECK(it != tensors.end(), StateError, "fp8: the checkpoint has no scaling state '", key,
                    "': was it saved with other fp8 layers (layers, exclude, min_size, lm_head)?");
      scale->load_state(it->second.to(DType::Float32).to_vector<float>());
      ++used;
    }
  }
  size_t present = 0;
  for (const auto& [k, t] : tensors) present += k.rfind("float8.", 0) == 0;
  BOOSTER_CHECK(present == used, StateError, "fp8: the checkpoint has scaling state for ", present / 3,
                " layers, this run chose ", layers_.size(), " (", layers_.size() ? layers_.front()->name : "none",
                " ...): were other fp8 layers chosen when it was saved?");
}

}  // namespace booster::mixed_precision
