// Convolution and pooling over NCHW images: conv2d, max_pool2d, avg_pool2d, adaptive_avg_pool2d.
//
// Note [Convolution as gather + GEMM]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every op here is built from ops that already have kernels on every backend and their own backward:
// the image [N, C, H, W] is viewed as [N, C, H*W] with one extra column holding the padding value (0,
// or -inf for max pooling), and index_select gathers, for each of the K = kh*kw kernel taps and L =
// Ho*Wo output positions, the pixel that tap sees (or the padding column) into [N, C, K, L]: im2col
// as one gather. Then
//  * conv2d is one batched GEMM of the weight [G, Cout/G, C/G*K] with the columns [N, G, C/G*K, L];
//  * max_pool2d is max over K (the gradient goes to the first maximum, as torch's; a NaN in a window
//    makes its output NaN and takes the gradient, as torch's, though with several NaNs torch picks the
//    last and this the first);
//  * avg_pool2d is the mean over K, padding included (torch's count_include_pad=True default);
//  * adaptive_avg_pool2d is a GEMM with a fixed [H*W, oh*ow] averaging matrix (windows as torch's:
//    start floor(i*H/oh), end ceil((i+1)*H/oh)).
// So the gradient of the gather is index_add (col2im), autocast treats conv2d as the GEMM it is
// (Op::Conv2d: lower precision, as torch's CUDA autocast lists conv2d), and CUDA runs the same code
// with cuBLAS. The index of a geometry is built once and cached per device. On the CPU, conv2d and
// max_pool2d themselves run through oneDNN where they can (Note [Convolutions through oneDNN] in
// backends/onednn/onednn.cpp): this composition is then the fallback and the tests' reference.
#include <array>
#include <cmath>
#include <functional>
#include <memory>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/backends/onednn/onednn.h"
#include "booster/common/error.h"
#include "booster/kernels/gemm.h"
#include "booster/ops/ops.h"

namespace booster {

namespace {

struct Geometry {
  int64_t h, w, kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t oh() const { return (h + 2 * ph - dh * (kh - 1) - 1) / sh + 1; }
  int64_t ow() const { return (w + 2 * pw - dw * (kw - 1) - 1) / sw + 1; }
  auto key() const { return std::make_tuple(h, w, kh, kw, sh, sw, ph, pw, dh, dw); }
};

// The gather index of Note [Convolution as gather + GEMM]: int64 [K * Ho * Wo] on `device`,
// tap-major; h*w stands for a padded pixel.
Tensor gather_index(const Geometry& g, Device device) {
  static std::mutex mutex;
  static std::map<std::tuple<decltype(g.key()), std::string>, Tensor> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& slot = cache[{g.key(), device.str()}];
  if (slot.defined()) return slot;
  const int64_t oh = g.oh(), ow = g.ow(), positions = oh * ow;
  std::vector<int64_t> index(size_t(g.kh * g.kw * positions), g.h * g.w);
  for (int64_t ki = 0; ki < g.kh; ++ki)
    for (int64_t kj = 0; kj < g.kw; ++kj)
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          const int64_t y = i * g.sh - g.ph + ki * g.dh, x = j * g.sw - g.pw + kj * g.dw;
          const bool inside = y >= 0 && y < g.h && x >= 0 && x < g.w;
          index[size_t((ki * g.kw + kj) * positions + i * ow + j)] = inside ? y * g.w + x : g.h * g.w;
        }
  slot = from_vector(index, {int64_t(index.size())}).to(device);
  return slot;
}

void check_image(const Tensor& x, const char* op) {
  BOOSTER_CHECK(x.dim() == 4, ShapeError, op, ": expected an input of shape [N, C, H, W], got ", x.shape());
  BOOSTER_CHECK(is_floating(x.dtype()), DTypeError, op, ": expected a floating input, got ", x.dtype());
}

void check_pair(const std::array<int64_t, 2>& v, int64_t min, const char* op, const char* what) {
  BOOSTER_CHECK(v[0] >= min && v[1] >= min, ValueError, op, ": ", what, " must be >= ", min, ", got (", v[0], ", ",
                v[1], ")");
}

// [N, C, K, Ho * Wo]: every tap's pixel for every output position (Note [Convolution as gather + GEMM]).
Tensor gather_columns(const Tensor& x, const Geometry& g, double pad_value, const char* op) {
  BOOSTER_CHECK(g.oh() >= 1 && g.ow() >= 1, ShapeError, op, ": the input ", x.shape(), " is smaller than the kernel (",
                g.kh, "x", g.kw, " with dilation (", g.dh, ", ", g.dw, ") and padding (", g.ph, ", ", g.pw,
                ")); the output would be ", g.oh(), "x", g.ow());
  const int64_t n = x.size(0), c = x.size(1);
  Tensor flat = x.reshape({n, c, g.h * g.w});
  Tensor padded = cat({flat, full({n, c, 1}, pad_value, x.dtype(), x.device())}, 2);
  Tensor cols = index_select(padded, 2, gather_index(g, x.device()));
  return cols.reshape({n, c, g.kh * g.kw, g.oh() * g.ow()});
}

// Note [Position-independent rounding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Identical input patches must give identical outputs, bit for bit, at every position: otherwise
// exact ties (a max-pool window over equal activations) break differently from place to place. oneDNN's
// direct convolutions compute every output element in the same order (Note [Convolutions through
// oneDNN]; checked with its avx512, avx2 and sse4.1 kernels). A BLAS GEMM does not: in row-major
// [Cout, K] x [K, L] the L output positions are the BLAS M dimension, which OpenBLAS cuts into tiles of
// its kernel's unroll and its threads' shares, and rows in edge tiles, or (its Haswell and Zen kernels,
// with 1 or 3 threads) the first and last 8 rows of each row block, round an ulp apart from the rest
// (a padding of the positions to whole tiles fixed the first, not the second). So
// on the CPU the gather path's forward GEMM is fixed_order_gemm_kernel (kernels/gemm.h, Note [A GEMM
// that rounds alike everywhere] in backends/cpu/fixed_order_gemm.cpp), which sums every output in one
// order whatever its position, BLAS core or thread count; its backward is matmul's. Elsewhere (CUDA)
// the forward is matmul.

// The gradients of `composed` (a gather-path op) for the inputs flagged in `need`, as its recorded
// backward computes them: where oneDNN refuses a backward product of an op it ran forward, and as the
// backward of the fixed-order GEMM (conv_gemm).
autograd::grads composed_grads(const std::function<Tensor(const std::vector<Tensor>&)>& composed,
                               const std::vector<Tensor>& saved, const Tensor& grad, const std::vector<bool>& need) {
  const bool previous = autograd::grad_mode_enabled();
  autograd::set_grad_mode(true);
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < saved.size(); ++i) {
    inputs.push_back(saved[i].defined() ? saved[i].detach() : Tensor());
    if (need[i]) inputs[i].requires_grad_();
  }
  try {
    autograd::backward(composed(inputs), grad, false);
  } catch (...) {
    autograd::set_grad_mode(previous);
    throw;
  }
  autograd::set_grad_mode(previous);
  autograd::grads out(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    if (need[i]) out[i] = inputs[i].grad();
  return out;
}

// w [G, Cout/G, C/G*K] @ cols [N, G, C/G*K, L] -> [N, G, Cout/G, L], through fixed_order_gemm_kernel
// where the device has it (Note [Position-independent rounding]), with matmul's backward.
Tensor conv_gemm(const Tensor& w, const Tensor& cols) {
  if (!kernels::fixed_order_gemm_kernel.has(cols.device().type)) return matmul(w, cols);
  const int64_t n = cols.size(0), groups = cols.size(1), k = cols.size(2), l = cols.size(3), m = w.size(1);
  const Tensor a = w.contiguous(), b = cols.contiguous();
  Tensor out = Tensor::empty({n, groups, m, l}, b.dtype(), b.device());
  Tensor c = out.reshape({n * groups, m, l});
  kernels::fixed_order_gemm_kernel(b.device())(a, b.reshape({n * groups, k, l}), c);
  const bool need_w = w.requires_grad(), need_cols = cols.requires_grad();
  autograd::record(out, "Conv2dGemmBackward", {w, cols},
                   [a = a.detach(), b = b.detach(), need_w, need_cols](const Tensor& grad) {
                     return composed_grads([](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); },
                                           {a, b}, grad, {need_w, need_cols});
                   });
  return out;
}

// conv2d as gather + GEMM (Note [Convolution as gather + GEMM]), inputs checked.
Tensor conv2d_gather(const Tensor& x, const Tensor& weight, const Tensor& bias, const Geometry& g, int64_t groups) {
  const int64_t n = x.size(0), c = x.size(1), cout = weight.size(0);
  const int64_t k = g.kh * g.kw, per_group = c / groups * k;
  Tensor cols = gather_columns(x, g, 0.0, "conv2d").reshape({n, groups, per_group, g.oh() * g.ow()});
  Tensor out = conv_gemm(weight.reshape({groups, cout / groups, per_group}), cols).reshape({n, cout, g.oh(), g.ow()});
  if (bias.defined()) out = add(out, bias.reshape({1, cout, 1, 1}));
  return out;
}

// The oneDNN element type for x's dtype, or nothing when the oneDNN path does not take this
// convolution (Note [Convolutions through oneDNN]).
std::optional<onednn::ConvType> onednn_conv_type(const Tensor& x, const Tensor& bias, const Geometry& g) {
  if (!x.device().is_cpu() || x.size(0) == 0 || g.oh() < 1 || g.ow() < 1) return std::nullopt;
  if (bias.defined() && (bias.dtype() != x.dtype() || !bias.device().is_cpu())) return std::nullopt;
  if (x.dtype() == DType::Float32 && onednn::conv_enabled()) return onednn::ConvType::Float32;
  if (x.dtype() == DType::BFloat16 && onednn::conv_bf16_enabled()) return onednn::ConvType::BFloat16;
  return std::nullopt;
}

// conv2d through oneDNN, with its own backward (both products through oneDNN). Empty when oneDNN
// refuses the problem, before anything is recorded.
Tensor conv2d_onednn(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in, const Geometry& g,
                     int64_t groups, onednn::ConvType type) {
  const onednn::ConvShape s{x_in.size(0), x_in.size(1), g.h,  g.w,  weight_in.size(0), groups, g.kh,   g.kw,
                            g.sh,         g.sw,         g.ph, g.pw, g.dh,              g.dw,   g.oh(), g.ow()};
  const Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const Tensor bias = bias_in.defined() ? bias_in.contiguous() : Tensor();
  Tensor out = Tensor::empty({s.n, s.cout, s.oh, s.ow}, x.dtype());
  if (!onednn::conv_forward(s, type, x.data_ptr(), weight.data_ptr(), bias.defined() ? bias.data_ptr() : nullptr,
                            out.data_ptr()))
    return Tensor();
  const bool need_x = x_in.requires_grad(), need_w = weight_in.requires_grad(),
             need_b = bias_in.defined() && bias_in.requires_grad();
  autograd::record(
      out, "Conv2dBackward", {x_in, weight_in, bias_in},
      [x = x.detach(), weight = weight.detach(), bias = bias.defined() ? bias.detach() : Tensor(), g, groups, s, type,
       need_x, need_w, need_b](const Tensor& grad_in) {
        const Tensor grad = grad_in.to(x.dtype()).contiguous();
        Tensor dx, dw, db;
        bool ok = true;
        if (need_x) {
          dx = Tensor::empty(x.shape(), x.dtype());
          ok = onednn::conv_backward_data(s, type, grad.data_ptr(), weight.data_ptr(), dx.data_ptr());
        }
        if (ok && (need_w || need_b)) {
          dw = Tensor::empty(weight.shape(), x.dtype());
          if (need_b) db = Tensor::empty({s.cout}, x.dtype());
          ok = onednn::conv_backward_weights(s, type, x.data_ptr(), grad.data_ptr(), dw.data_ptr(),
                                             need_b ? db.data_ptr() : nullptr);
          if (!need_w) dw = Tensor();
        }
        if (!ok)
          return composed_grads(
              [&](const std::vector<Tensor>& in) { return conv2d_gather(in[0], in[1], in[2], g, groups); },
              {x, weight, bias}, grad, {need_x, need_w, need_b});
        return autograd::grads{dx, dw, db};
      });
  return out;
}

// max_pool2d as the max over the gathered windows (Note [Convolution as gather + GEMM]).
Tensor max_pool2d_gather(const Tensor& x, const Geometry& g) {
  Tensor cols = gather_columns(x, g, -std::numeric_limits<double>::infinity(), "max_pool2d");
  return max(cols, 2).reshape({x.size(0), x.size(1), g.oh(), g.ow()});
}

// max_pool2d through oneDNN's max pooling (the first of equal maxima takes the gradient, as the
// gather path's max), or empty when it does not take this problem. Only for finite inputs: oneDNN's
// max skips a NaN that is not first in its window, and starts from the lowest finite value (an
// all--inf window), where the gather path's max (and torch's) returns NaN and -inf.
Tensor max_pool2d_onednn(const Tensor& x_in, const Geometry& g) {
  std::optional<onednn::ConvType> type;
  if (x_in.dtype() == DType::Float32 && onednn::conv_enabled()) type = onednn::ConvType::Float32;
  if (x_in.dtype() == DType::BFloat16 && onednn::conv_bf16_enabled()) type = onednn::ConvType::BFloat16;
  if (!type || !x_in.device().is_cpu() || x_in.size(0) == 0 || g.oh() < 1 || g.ow() < 1 || g.dh != 1 || g.dw != 1)
    return Tensor();
  const int64_t n = x_in.size(0), c = x_in.size(1);
  const onednn::ConvShape s{n, c, g.h, g.w, c, 1, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, 1, 1, g.oh(), g.ow()};
  const int64_t bytes = onednn::max_pool_workspace_bytes(s, *type);
  if (bytes < 0) return Tensor();
  const Tensor x = x_in.contiguous();
  {
    const autograd::NoGradGuard no_grad;  // the check records nothing
    if (!std::isfinite(sum(x).item())) return Tensor();
  }
  auto workspace = std::shared_ptr<char[]>(new char[size_t(std::max<int64_t>(bytes, 1))]);
  Tensor out = Tensor::empty({n, c, g.oh(), g.ow()}, x.dtype());
  if (!onednn::max_pool_forward(s, *type, x.data_ptr(), out.data_ptr(), workspace.get())) return Tensor();
  autograd::record(out, "MaxPool2dBackward", {x_in},
                   [x = x.detach(), g, s, type = *type, workspace](const Tensor& grad_in) {
                     const Tensor grad = grad_in.to(x.dtype()).contiguous();
                     Tensor dx = Tensor::empty(x.shape(), x.dtype());
                     if (onednn::max_pool_backward(s, type, grad.data_ptr(), workspace.get(), dx.data_ptr()))
                       return autograd::grads{dx};
                     return composed_grads([&](const std::vector<Tensor>& in) { return max_pool2d_gather(in[0], g); },
                                           {x}, grad, {true});
                   });
  return out;
}

}  // namespace

Tensor conv2d(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in, std::array<int64_t, 2> stride,
              std::array<int64_t, 2> padding, std::array<int64_t, 2> dilation, int64_t groups) {
  Tensor x = x_in, weight = weight_in, bias = bias_in;
  autocast::apply(autocast::Op::Conv2d, {&x, &weight, &bias});
  check_image(x, "conv2d");
  BOOSTER_CHECK(weight.dim() == 4, ShapeError, "conv2d: weight must be [out_channels, in_channels / groups, kh, kw], got ",
                weight.shape());
  check_pair(stride, 1, "conv2d", "stride");
  check_pair(padding, 0, "conv2d", "padding");
  check_pair(dilation, 1, "conv2d", "dilation");
  const int64_t c = x.size(1), cout = weight.size(0);
  BOOSTER_CHECK(groups >= 1 && c % groups == 0 && cout % groups == 0, ValueError, "conv2d: groups ", groups,
                " must divide in_channels ", c, " and out_channels ", cout);
  BOOSTER_CHECK(weight.size(1) * groups == c, ShapeError, "conv2d: weight ", weight.shape(), " expects ",
                weight.size(1) * groups, " input channels (", weight.size(1), " x groups ", groups, "), got input ",
                x.shape());
  BOOSTER_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == cout), ShapeError, "conv2d: bias must be [",
                cout, "], got ", bias.shape());
  BOOSTER_CHECK(weight.dtype() == x.dtype() && weight.device() == x.device(), DTypeError,
                "conv2d: input (", x.dtype(), ", ", x.device(), ") and weight (", weight.dtype(), ", ", weight.device(),
                ") must have the same dtype and device");
  const Geometry g{x.size(2), x.size(3), weight.size(2), weight.size(3), stride[0], stride[1],
                   padding[0], padding[1], dilation[0], dilation[1]};
  if (const auto type = onednn_conv_type(x, bias, g)) {
    Tensor out = conv2d_onednn(x, weight, bias, g, groups, *type);
    if (out.defined()) return out;
  }
  return conv2d_gather(x, weight, bias, g, groups);
}

Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                  std::array<int64_t, 2> padding, std::array<int64_t, 2> dilation) {
  check_image(x, "max_pool2d");
  if (stride[0] == 0 && stride[1] == 0) stride = kernel;
  check_pair(kernel, 1, "max_pool2d", "kernel_size");
  check_pair(stride, 1, "max_pool2d", "stride");
  check_pair(dilation, 1, "max_pool2d", "dilation");
  BOOSTER_CHECK(padding[0] >= 0 && padding[1] >= 0 && 2 * padding[0] <= kernel[0] && 2 * padding[1] <= kernel[1],
                ValueError, "max_pool2d: padding (", padding[0], ", ", padding[1],
                ") must be at most half the kernel size (", kernel[0], ", ", kernel[1], "), as in torch");
  const Geometry g{x.size(2), x.size(3), kernel[0], kernel[1], stride[0], stride[1],
                   padding[0], padding[1], dilation[0], dilation[1]};
  if (Tensor out = max_pool2d_onednn(x, g); out.defined()) return out;
  return max_pool2d_gather(x, g);
}

Tensor avg_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                  std::array<int64_t, 2> padding) {
  check_image(x, "avg_pool2d");
  if (stride[0] == 0 && stride[1] == 0) stride = kernel;
  check_pair(kernel, 1, "avg_pool2d", "kernel_size");
  check_pair(stride, 1, "avg_pool2d", "stride");
  BOOSTER_CHECK(padding[0] >= 0 && padding[1] >= 0 && 2 * padding[0] <= kernel[0] && 2 * padding[1] <= kernel[1],
                ValueError, "avg_pool2d: padding (", padding[0], ", ", padding[1],
                ") must be at most half the kernel size (", kernel[0], ", ", kernel[1], "), as in torch");
  const Geometry g{x.size(2), x.size(3), kernel[0], kernel[1], stride[0], stride[1], padding[0], padding[1], 1, 1};
  Tensor cols = gather_columns(x, g, 0.0, "avg_pool2d");
  // The sum over the taps, divided by their number (padding counts): in x's dtype, as torch on CUDA.
  return mul(sum(cols, {2}), 1.0 / double(g.kh * g.kw)).to(x.dtype()).reshape({x.size(0), x.size(1), g.oh(), g.ow()});
}

Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> output_size) {
  check_image(x, "adaptive_avg_pool2d");
  check_pair(output_size, 1, "adaptive_avg_pool2d", "output_size");
  const int64_t h = x.size(2), w = x.size(3), oh = output_size[0], ow = output_size[1];
  if (oh == 1 && ow == 1) return mean(x, {2, 3}, /*keepdim=*/true).to(x.dtype());
  // out[.., i*ow + j] = the mean of the window: one GEMM with the averaging matrix [H*W, oh*ow].
  std::vector<double> m(size_t(h * w * oh * ow), 0.0);
  for (int64_t i = 0; i < oh; ++i)
    for (int64_t j = 0; j < ow; ++j) {
      const int64_t y0 = i * h / oh, y1 = ((i + 1) * h + oh - 1) / oh;
      const int64_t x0 = j * w / ow, x1 = ((j + 1) * w + ow - 1) / ow;
      const double inv = 1.0 / double((y1 - y0) * (x1 - x0));
      for (int64_t y = y0; y < y1; ++y)
        for (int64_t xx = x0; xx < x1; ++xx) m[size_t((y * w + xx) * oh * ow + i * ow + j)] = inv;
    }
  Tensor avg = from_vector(m, {h * w, oh * ow}).to(x.device(), x.dtype());
  return matmul(x.reshape({x.size(0), x.size(1), h * w}), avg).to(x.dtype()).reshape({x.size(0), x.size(1), oh, ow});
}

}  // namespace booster
