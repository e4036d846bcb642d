// Convolutions through oneDNN (Note [Convolutions through oneDNN] in backends/onednn/onednn.cpp) and
// through the gather + GEMM path (Note [Convolution as gather + GEMM] in ops/conv.cpp): the forward,
// the input gradient, the weight gradient and the bias gradient of conv2d in float32 and bfloat16,
// against the float64 result of the same (rounded) operands, within bounds derived from the unit
// roundoff and the reduction lengths (Note [Roundoff bounds] 5); and Note [Position-independent
// rounding]: identical input patches give identical outputs, bit for bit, at every position, on both
// paths. Where oneDNN cannot run a dtype here, its half says it was skipped.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <dlfcn.h>
#include <limits>
#include <string>
#include <vector>

#include "booster/autograd/autograd.h"
#include "booster/backends/onednn/onednn.h"
#include "booster/common/cpu_features.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"
#include "roundoff.h"
#include "skip.h"

using namespace booster;
using ::testing::roundoff::gamma;
using ::testing::roundoff::kUnit;
using ::testing::roundoff::kUnitBFloat16;

namespace {

// Restores the convolution path in use when it goes out of scope.
struct ConvPathGuard {
  explicit ConvPathGuard(bool on) : previous(onednn::set_conv(on)) {}
  ~ConvPathGuard() { onednn::set_conv(previous); }
  bool previous;
};

struct Case {
  int64_t n, c, h, w, cout, kh, kw, sh, sw, ph, pw, dh, dw, groups;
  bool bias;
};

std::string describe(const Case& c) {
  return str("x [", c.n, ", ", c.c, ", ", c.h, ", ", c.w, "] w [", c.cout, ", ", c.c / c.groups, ", ", c.kh, ", ", c.kw,
             "] stride (", c.sh, ", ", c.sw, ") padding (", c.ph, ", ", c.pw, ") dilation (", c.dh, ", ", c.dw,
             ") groups ", c.groups, c.bias ? " bias" : " no bias");
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {4, 3, 9, 11, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1, true},     // odd sizes, padding
      {2, 16, 14, 14, 24, 3, 3, 1, 1, 1, 1, 1, 1, 1, false},  // no bias
      {3, 5, 10, 8, 7, 3, 2, 2, 2, 0, 1, 1, 1, 1, true},      // stride 2, rectangular kernel
      {2, 8, 12, 13, 16, 5, 5, 2, 1, 2, 2, 1, 1, 1, true},    // 5x5, mixed strides
      {2, 4, 9, 9, 6, 3, 3, 1, 1, 1, 1, 2, 2, 1, true},       // dilation 2
      {2, 8, 7, 7, 12, 3, 3, 1, 1, 1, 1, 1, 1, 4, true},      // groups 4
      {2, 16, 5, 6, 8, 1, 1, 1, 1, 0, 0, 1, 1, 1, true},      // 1x1
      {8, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1, 1, 1, 1, true},    // the CNN's first layer, smaller batch
      {4, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, true},   // the CNN's second layer, smaller batch
  };
  return all;
}

Tensor random(const Shape& shape, DType dtype, uint64_t seed) {
  Generator g(seed);
  return randn(shape, &g).to(dtype);
}

Tensor run_conv(const Case& c, const Tensor& x, const Tensor& w, const Tensor& b) {
  return conv2d(x, w, b, {c.sh, c.sw}, {c.ph, c.pw}, {c.dh, c.dw}, c.groups);
}

// The largest |got - want| / bound over the elements; an element whose bound is 0 must be exact.
double worst_ratio(const Tensor& got, const Tensor& want, const Tensor& bound) {
  const std::vector<double> g = got.to(DType::Float64).tolist(), w = want.tolist(), b = bound.tolist();
  REQUIRE(g.size() == w.size());
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(g[i] - w[i]) / (b[i] + 1e-300));
  return worst;
}

// Runs a case's forward and backward in `dtype` on the path selected now and checks each result
// against float64, in units of its bound (Note [Roundoff bounds] 5): float32 accumulation over the
// reduction (C_in / groups * kh * kw for the forward, C_out / groups * kh * kw for the input gradient,
// N * H_out * W_out for the weight and bias gradients), plus the bias's term, and for bfloat16 the
// rounding of each result (two roundings where the gather path adds the bias to a rounded product,
// kh * kw where its scatter-add sums the taps' bfloat16 column gradients one at a time).
void check_case(const Case& c, DType dtype, uint64_t seed, bool expect_onednn) {
  INFO(describe(c) << " " << dtype << (expect_onednn ? " through oneDNN" : " through gather + GEMM"));
  Tensor x = random({c.n, c.c, c.h, c.w}, dtype, seed),
         w = random({c.cout, c.c / c.groups, c.kh, c.kw}, dtype, seed + 1);
  Tensor b = c.bias ? random({c.cout}, dtype, seed + 2) : Tensor();
  x.requires_grad_();
  w.requires_grad_();
  if (c.bias) b.requires_grad_();
  const Tensor out = run_conv(c, x, w, b);
  REQUIRE(out.dtype() == dtype);
  // Which path ran: the oneDNN op records one node of its own.
  CHECK((out.grad_fn() && out.grad_fn()->name() == "Conv2dBackward") == expect_onednn);
  const Tensor dy = random(out.shape(), dtype, seed + 3);
  autograd::backward(out, dy, false);

  // The float64 result of the same operands, and the magnitudes of its sums: the same products of
  // the absolute values (the gradients of conv2d(|x|, |w|) + |b| seeded with |dy|).
  const auto f64 = [](const Tensor& t) { return t.detach().to(DType::Float64); };
  Tensor x64 = f64(x), w64 = f64(w), b64 = c.bias ? f64(b) : Tensor();
  x64.requires_grad_();
  w64.requires_grad_();
  if (c.bias) b64.requires_grad_();
  const Tensor want = run_conv(c, x64, w64, b64);
  autograd::backward(want, f64(dy), false);
  Tensor ax = abs(f64(x)), aw = abs(f64(w)), ab = c.bias ? abs(f64(b)) : Tensor();
  ax.requires_grad_();
  aw.requires_grad_();
  if (c.bias) ab.requires_grad_();
  const Tensor mag = run_conv(c, ax, aw, ab);
  autograd::backward(mag, abs(f64(dy)), false);

  const bool bf16 = dtype == DType::BFloat16;
  const double u16 = bf16 ? kUnitBFloat16 : 0.0;
  const double k_fwd = double(c.c / c.groups * c.kh * c.kw) + 1, k_dx = double(c.cout / c.groups * c.kh * c.kw),
               k_dw = double(c.n * out.size(2) * out.size(3));
  const double fwd_roundings = (!expect_onednn && c.bias) ? 2 : 1,
               dx_roundings = expect_onednn ? 1 : double(c.kh * c.kw) + 1;
  const auto bound = [&](const Tensor& m, double k, double roundings) {
    return mul(m.detach(), gamma(k + 1, kUnit) + (bf16 ? gamma(roundings, u16) * (1 + gamma(k + 1, kUnit)) : 0.0));
  };
  CHECK(worst_ratio(out, want, bound(mag, k_fwd, fwd_roundings)) <= 1.0);
  CHECK(worst_ratio(x.grad(), x64.grad(), bound(ax.grad(), k_dx, dx_roundings)) <= 1.0);
  CHECK(worst_ratio(w.grad(), w64.grad(), bound(aw.grad(), k_dw, 1)) <= 1.0);
  if (c.bias) CHECK(worst_ratio(b.grad(), b64.grad(), bound(ab.grad(), k_dw, 1)) <= 1.0);
}

// Why the oneDNN half of a test cannot run for `dtype` here, or "" when it can.
std::string onednn_missing(DType dtype) {
  if (!onednn::built()) return "this build has no oneDNN (libdnnl-dev)";
  if (dtype == DType::BFloat16 && !onednn::conv_bf16_enabled())
    return std::string("no bfloat16 convolutions through oneDNN at the selected kernel level (") +
           cpu::bf16_instructions_name() + ", " + cpu::isa_name(cpu::isa_level()) + ")";
  return "";
}

}  // namespace

TEST_CASE("conv2d through oneDNN: forward and gradients within float32 and bfloat16 roundoff of float64",
          "[ops][onednn][conv]") {
  ConvPathGuard on(true);
  uint64_t seed = 100;
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    const std::string missing = onednn_missing(dtype);
    if (!missing.empty()) {
      skip_test(missing);
      continue;
    }
    REQUIRE(onednn::conv_enabled());
    for (const Case& c : cases()) check_case(c, dtype, seed += 10, true);
  }
}

TEST_CASE("conv2d through gather + GEMM: forward and gradients within float32 and bfloat16 roundoff of float64",
          "[ops][onednn][conv]") {
  ConvPathGuard off(false);
  REQUIRE_FALSE(onednn::conv_enabled());
  uint64_t seed = 100;
  for (DType dtype : {DType::Float32, DType::BFloat16})
    for (const Case& c : cases()) check_case(c, dtype, seed += 10, false);
}

TEST_CASE("conv2d: float64 and float16 stay on the gather path with oneDNN on", "[ops][onednn][conv]") {
  ConvPathGuard on(true);
  for (DType dtype : {DType::Float64, DType::Float16}) {
    Tensor x = random({2, 3, 6, 6}, dtype, 1), w = random({4, 3, 3, 3}, dtype, 2);
    x.requires_grad_();
    const Tensor out = conv2d(x, w, Tensor(), {1, 1}, {1, 1}, {1, 1}, 1);
    INFO(dtype);
    REQUIRE(out.grad_fn());
    CHECK(out.grad_fn()->name() != "Conv2dBackward");
  }
}

namespace {

// Whether every listed output position of each (image, channel) plane of `out` holds the same value,
// bit for bit; INFO names the first that does not.
bool same_at(const Tensor& out, const std::vector<std::pair<int64_t, int64_t>>& positions) {
  const Tensor o = out.to(DType::Float64);  // exact for float32 and bfloat16
  const std::vector<double> v = o.tolist();
  const int64_t planes = o.size(0) * o.size(1), oh = o.size(2), ow = o.size(3);
  for (int64_t p = 0; p < planes; ++p) {
    const double first = v[size_t(p * oh * ow + positions[0].first * ow + positions[0].second)];
    for (const auto& [i, j] : positions) {
      const double here = v[size_t(p * oh * ow + i * ow + j)];
      if (std::memcmp(&here, &first, sizeof here) != 0) {
        UNSCOPED_INFO("plane " << p << ": " << here << " at (" << i << ", " << j << ") but " << first << " at ("
                               << positions[0].first << ", " << positions[0].second << "), "
                               << (here - first) / std::abs(first) << " relative");
        return false;
      }
    }
  }
  return true;
}

// Sets the OpenMP thread count (the library's loops and OpenBLAS's) for its scope, where the process
// has OpenMP. OpenBLAS's Haswell and Zen kernels rounded positions apart with 1 and 3 threads, not 2.
struct OmpThreads {
  using Get = int (*)();
  using Set = void (*)(int);
  explicit OmpThreads(int n)
      : get(reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"))),
        set(reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"))),
        previous(get ? get() : 1) {
    if (set) set(n);
  }
  ~OmpThreads() {
    if (set) set(previous);
  }
  Get get;
  Set set;
  int previous;
};

}  // namespace

TEST_CASE("conv2d: identical input patches give identical outputs at every position, on both paths",
          "[ops][onednn][conv][roundoff]") {
  // Note [Position-independent rounding] in ops/conv.cpp. Wide reductions (C_in * 9 = 288) and output
  // widths that are not multiples of a GEMM kernel's tile, so that edge tiles are exercised; 1, 2 and 3
  // threads, which cut the positions differently. CTest runs it again under OpenBLAS's Haswell, Zen
  // and SkylakeX kernels (OPENBLAS_CORETYPE), whose own GEMMs round some positions apart.
  for (int threads : {1, 2, 3}) {
    for (bool on : {true, false})
      for (DType dtype : {DType::Float32, DType::BFloat16}) {
        if (on && !onednn_missing(dtype).empty()) {
          if (threads == 1) skip_test(onednn_missing(dtype));
          continue;
        }
        const OmpThreads omp(threads);
        ConvPathGuard path(on);
        INFO((on ? "oneDNN" : "gather + GEMM") << " " << dtype << ", " << threads << " threads");
        const int64_t n = 2, c = 32, cout = 24;
        const Tensor w = random({cout, c, 3, 3}, dtype, 7), b = random({cout}, dtype, 8);
        {
          // One repeated patch: each (image, channel) of the input constant, so every 3x3 window is the
          // same; no padding, stride 1 and stride 2.
          const Tensor x = random({n, c, 1, 1}, dtype, 9).expand({n, c, 19, 23}).contiguous();
          for (int64_t stride : {1, 2}) {
            const Tensor out = conv2d(x, w, b, {stride, stride}, {0, 0}, {1, 1}, 1);
            std::vector<std::pair<int64_t, int64_t>> all;
            for (int64_t i = 0; i < out.size(2); ++i)
              for (int64_t j = 0; j < out.size(3); ++j) all.push_back({i, j});
            INFO("constant planes, stride " << stride);
            CHECK(same_at(out, all));
          }
        }
        {
          // Random data with one random 3x3 patch (all channels) written at non-overlapping places,
          // first and last rows and columns included; padding 1, so output (r + 1, s + 1) sees the patch
          // written at (r, s).
          const int64_t h = 20, wd = 29;
          std::vector<double> image = random({n, c, h, wd}, DType::Float64, 10).tolist();
          const std::vector<double> patch = random({n, c, 3, 3}, DType::Float64, 11).tolist();
          const std::vector<std::pair<int64_t, int64_t>> at = {{0, 0},  {0, 13}, {0, 26}, {4, 5},  {6, 19},
                                                               {9, 0},  {9, 9},  {11, 26}, {17, 0}, {17, 14}, {17, 26}};
          for (int64_t img = 0; img < n; ++img)
            for (int64_t ch = 0; ch < c; ++ch)
              for (const auto& [r, s] : at)
                for (int64_t a = 0; a < 3; ++a)
                  for (int64_t e = 0; e < 3; ++e)
                    image[size_t(((img * c + ch) * h + r + a) * wd + s + e)] =
                        patch[size_t(((img * c + ch) * 3 + a) * 3 + e)];
          const Tensor x = from_vector(image, {n, c, h, wd}).to(dtype);
          const Tensor out = conv2d(x, w, b, {1, 1}, {1, 1}, {1, 1}, 1);
          std::vector<std::pair<int64_t, int64_t>> centres;
          for (const auto& [r, s] : at) centres.push_back({r + 1, s + 1});
          INFO("repeated patches in random data");
          CHECK(same_at(out, centres));
        }
      }
  }
}

TEST_CASE("max_pool2d through oneDNN equals the gather path bit for bit, ties and gradients included",
          "[ops][onednn][conv]") {
  struct Pool {
    int64_t kh, kw, sh, sw, ph, pw;
  };
  const std::vector<Pool> pools = {{2, 2, 2, 2, 0, 0}, {3, 3, 2, 2, 1, 1}, {3, 3, 1, 1, 1, 1}, {2, 3, 1, 2, 1, 1}};
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    const std::string missing = onednn_missing(dtype);
    if (!missing.empty()) {
      skip_test(missing);
      continue;
    }
    for (const Pool& p : pools) {
      INFO(dtype << " kernel (" << p.kh << ", " << p.kw << ") stride (" << p.sh << ", " << p.sw << ") padding ("
                 << p.ph << ", " << p.pw << ")");
      // Few distinct values, so most windows hold several equal maxima: the gradient must go to the
      // first, in the window's row-major order, on both paths.
      Generator gen(20);
      std::vector<double> values(3 * 5 * 11 * 12);
      for (double& v : values) v = double(int(gen.uniform() * 4)) * 0.5 - 1.0;
      const Tensor x = from_vector(values, {3, 5, 11, 12}).to(dtype);
      const Tensor dy = random({3, 5, (11 + 2 * p.ph - p.kh) / p.sh + 1, (12 + 2 * p.pw - p.kw) / p.sw + 1}, dtype, 21);
      auto run = [&](bool on, const Tensor& input, const Tensor& seed) {
        ConvPathGuard path(on);
        Tensor leaf = input.detach().clone();
        leaf.requires_grad_();
        const Tensor out = max_pool2d(leaf, {p.kh, p.kw}, {p.sh, p.sw}, {p.ph, p.pw}, {1, 1});
        CHECK((out.grad_fn() && out.grad_fn()->name() == "MaxPool2dBackward") == (on && input.dtype() == dtype));
        autograd::backward(out, seed, false);
        return std::vector<Tensor>{out.detach(), leaf.grad()};
      };
      const std::vector<Tensor> on = run(true, x, dy), off = run(false, x, dy);
      // The maxima are exact; so is the gradient where windows do not overlap. Where they do, an
      // input's gradient sums up to (kh / sh) * (kw / sw) windows' in an order of each path's own:
      // within that many roundings (float32's, or bfloat16's where the gather path's scatter-add
      // rounds each sum) of the same sum of |dy|, and exactly zero off the first maxima, which are
      // the float64 gather path's.
      CHECK(on[0].to(DType::Float64).tolist() == off[0].to(DType::Float64).tolist());
      const std::vector<double> a = on[1].to(DType::Float64).tolist(), b = off[1].to(DType::Float64).tolist(),
                                mag = run(false, x.to(DType::Float64), abs(dy.to(DType::Float64)))[1].tolist();
      if (p.kh <= p.sh && p.kw <= p.sw) CHECK(a == b);
      const double windows = double((p.kh + p.sh - 1) / p.sh * ((p.kw + p.sw - 1) / p.sw));
      const double unit = dtype == DType::BFloat16 ? kUnitBFloat16 : kUnit;
      double worst = 0;
      for (size_t i = 0; i < a.size(); ++i)
        worst = std::max(worst, std::abs(a[i] - b[i]) / (2 * gamma(windows, unit) * mag[i] + 1e-300));
      CHECK(worst <= 1.0);
    }
  }
}

TEST_CASE("max_pool2d with oneDNN on: a NaN anywhere in a window and an all -inf window come out as torch's",
          "[ops][onednn][conv]") {
  ConvPathGuard on(true);
  const double inf = std::numeric_limits<double>::infinity();
  // One image, one channel, 2x4, pooled 2x2: the first window holds a NaN after its maximum, the
  // second is all -inf.
  const Tensor x = from_vector(std::vector<double>{1.0, 2.0, -inf, -inf, 3.0, std::nan(""), -inf, -inf}, {1, 1, 2, 4})
                       .to(DType::Float32);
  const std::vector<double> out = max_pool2d(x, {2, 2}, {2, 2}, {0, 0}, {1, 1}).to(DType::Float64).tolist();
  REQUIRE(out.size() == 2);
  CHECK(std::isnan(out[0]));
  CHECK(out[1] == -inf);
}
