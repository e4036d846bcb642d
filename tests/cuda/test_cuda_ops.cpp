// The cross-backend runner (in the spirit of ggml's test-backend-ops): every op that the CUDA backend
// implements runs on the GPU in float32, float16 and bfloat16, and its value and its input gradients
// are compared with the same op on the CPU in float64, fed the same (rounded) inputs. The error is
// ||cuda - ref|| / ||ref||, held to a bound derived from the dtype's unit roundoff and the case's
// reductions (Note [CUDA runner bounds]); NaN never passes. Without a GPU every test here is reported
// as skipped, with the reason (cuda_skip.h).
#include <catch2/catch.hpp>

#include "cuda_skip.h"
#include "roundoff.h"

#include <cmath>
#include <cstdio>
#include <algorithm>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "booster/autograd/autograd.h"
#include "booster/backends/cuda/cuda.h"
#include "booster/booster/build_info.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"

using namespace booster;

namespace {

using testing::skip_without_gpu;
namespace ro = ::testing::roundoff;

struct OpCase {
  std::string name;
  std::vector<Shape> shapes;  // floating inputs, drawn N(0, 1) (or |N| + 0.5 when positive)
  std::function<Tensor(const std::vector<Tensor>&)> fn;
  bool grad = true;      // also compare the gradients of every input
  bool positive = false;
  double kappa = 1;      // the conditioning of ops whose result cancels (Note [CUDA runner bounds])
  double length = 1;     // the longest chain of sums, forward or backward, in terms (ditto)
};

// Relative L2 error; infinity when either side has a NaN where the other has not.
double rel_error(const Tensor& got, const Tensor& ref) {
  const std::vector<double> g = got.tolist(), r = ref.tolist();
  if (g.size() != r.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) != std::isnan(r[i])) return INFINITY;
    if (std::isnan(r[i]) || (std::isinf(r[i]) && g[i] == r[i])) continue;
    num += (g[i] - r[i]) * (g[i] - r[i]);
    den += r[i] * r[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// The unit roundoff of a dtype, and of the type its kernels compute and accumulate in (float32 for the
// 16-bit dtypes, Note [Roundoff bounds] step 5).
double unit(DType d) {
  switch (d) {
    case DType::Float32: return ro::kUnit;
    case DType::Float16: return ro::kUnitFloat16;
    case DType::Float64: return ro::kUnitFloat64;
    default: return ro::kUnitBFloat16;
  }
}
double compute_unit(DType d) { return d == DType::Float64 ? ro::kUnitFloat64 : ro::kUnit; }

// Note [CUDA runner bounds]
// A case's result against float64 on the same rounded inputs (Note [Roundoff bounds], step 5):
// - each op rounds its result once to the dtype (u) after evaluating it in the compute type (unit u_c)
//   within 4 ulp = 8 u_c (CUDA's powf; expf, erff, tanhf are 2 ulp; no fast-math flags), and a case
//   chains at most kChain = 4 ops (scalar_ops; unfused attention's scores, scale, softmax and product):
//   gamma(kChain, u + 8 u_c) in the worst case;
// - its sums, forward and backward, accumulate in the compute type in the kernel's order: the
//   order term reduction_bound({length}, u_c) of their chained lengths (OpCase::length);
// - kappa 2 where the result cancels (variance, layer and batch norm, attention, pow's log y, and
//   sqrt_rsqrt's gradient 1 / (2 sqrt x) - 1 / (2 x^1.5) near x = 1);
// - a gradient passes the chain twice (each op's backward multiplies its derivative, evaluated from the
//   rounded saved values, by the rounded incoming gradient): gamma(2 kChain, ...).
// float32 GEMMs run without TF32 (checked before the cases run). Float16 and bfloat16 come to
// 4 u and 8 u (value and gradient); float32 and float64 to their reductions' order term.
constexpr double kChain = 4;

double value_bound(const OpCase& c, DType dt) {
  const double per_op = unit(dt) + 8 * compute_unit(dt);
  return c.kappa * (ro::gamma(kChain, per_op) + ro::reduction_bound({c.length}, compute_unit(dt)));
}
double gradient_bound(const OpCase& c, DType dt) {
  const double per_op = unit(dt) + 8 * compute_unit(dt);
  return c.kappa * (ro::gamma(2 * kChain, per_op) + ro::reduction_bound({c.length}, compute_unit(dt)));
}

// Integer tensors a case needs (targets, indices), made on the CPU and moved where the inputs are.
Tensor on(const Tensor& t, const Tensor& like) { return t.to(like.device()); }

std::vector<OpCase> cases() {
  Generator g(7);
  const Tensor targets = randint(0, 11, {6}, &g);
  Tensor targets_ignore = targets.clone();
  targets_ignore.narrow(0, 2, 1).fill_(-100);
  const Tensor tokens = randint(0, 13, {3, 5}, &g);
  const Tensor gather_idx = randint(0, 5, {4, 3}, &g);
  const Tensor select_idx = from_vector(std::vector<int64_t>{4, 0, 2, 2}, {4});
  const Tensor mask = gt(rand({4, 5}, &g, DType::Float64), scalar_tensor(0.5, DType::Float64));
  using V = std::vector<Tensor>;
  std::vector<OpCase> c = {
      {"add_broadcast", {{3, 1, 5}, {4, 5}}, [](const V& x) { return add(x[0], x[1], 0.5); }},
      {"sub", {{4, 5}, {4, 5}}, [](const V& x) { return sub(x[0], x[1]); }},
      {"mul_broadcast", {{4, 5}, {5}}, [](const V& x) { return mul(x[0], x[1]); }},
      {"div", {{4, 5}, {4, 5}}, [](const V& x) { return div(x[0], x[1]); }, true, true},
      {"pow_tensor", {{4, 5}, {4, 5}}, [](const V& x) { return pow(x[0], x[1]); }, true, true, 2},
      {"maximum", {{4, 5}, {4, 5}}, [](const V& x) { return maximum(x[0], x[1]); }},
      {"minimum", {{4, 5}, {1, 5}}, [](const V& x) { return minimum(x[0], x[1]); }},
      {"scalar_ops", {{4, 5}}, [](const V& x) { return rdiv(rsub(mul(add(x[0], 3.0), 0.5), 4.0), 2.0); }},
      {"neg_abs", {{4, 5}}, [](const V& x) { return abs(neg(x[0])); }},
      {"exp", {{4, 5}}, [](const V& x) { return exp(x[0]); }},
      {"log", {{4, 5}}, [](const V& x) { return log(x[0]); }, true, true},
      {"sqrt_rsqrt", {{4, 5}}, [](const V& x) { return add(sqrt(x[0]), rsqrt(x[0])); }, true, true, 2},
      {"pow_scalar", {{4, 5}}, [](const V& x) { return add(pow(x[0], 2.0), pow(x[0], 3.0)); }, true, true},
      {"clamp", {{4, 5}}, [](const V& x) { return clamp(x[0], -0.5, 0.7); }},
      {"relu", {{4, 5}}, [](const V& x) { return relu(x[0]); }},
      {"gelu_erf", {{4, 5}}, [](const V& x) { return gelu(x[0]); }},
      {"gelu_tanh", {{64, 33}}, [](const V& x) { return gelu(x[0], "tanh"); }},
      {"tanh", {{4, 5}}, [](const V& x) { return tanh(x[0]); }},
      {"sigmoid", {{4, 5}}, [](const V& x) { return sigmoid(x[0]); }},
      {"silu", {{4, 5}}, [](const V& x) { return silu(x[0]); }},
      {"compare",
       {{4, 5}, {4, 5}},
       [](const V& x) {
         return add(add(eq(x[0], x[0]).to(x[0].dtype()), lt(x[0], x[1]).to(x[0].dtype())),
                    add(ge(x[0], x[1]).to(x[0].dtype()), isfinite(x[0]).to(x[0].dtype())));
       },
       false},
      {"where_masked_fill",
       {{4, 5}, {4, 5}},
       [mask](const V& x) { return masked_fill(where(on(mask, x[0]), x[0], x[1]), on(mask, x[0]), 2.5); }},
      {"copy_transpose", {{6, 7}}, [](const V& x) { return mul(x[0].t().contiguous(), 2.0); }},
      {"cat_stack", {{2, 3}, {4, 3}}, [](const V& x) { return stack({cat({x[0], x[1]}, 0), cat({x[1], x[0]}, 0)}, 1); }},
      {"sum_dims", {{5, 6, 7}}, [](const V& x) { return sum(x[0], {0, 2}); }},
      {"sum_rows_columns", {{300, 40}}, [](const V& x) { return add(sum(x[0], {0}), sum(x[0].narrow(1, 0, 1))); }},
      {"mean_all", {{17, 19}}, [](const V& x) { return mean(x[0]); }},
      {"max_dim", {{6, 9}}, [](const V& x) { return max(x[0], 1); }},
      {"argmax", {{6, 9}}, [](const V& x) { return argmax(x[0], 0).to(x[0].dtype()); }, false},
      {"var", {{6, 9}}, [](const V& x) { return var(x[0], {1}); }, true, false, 2},
      {"matmul", {{16, 24}, {24, 8}}, [](const V& x) { return matmul(x[0], x[1]); }},
      {"matmul_transposed", {{24, 16}, {8, 24}}, [](const V& x) { return matmul(x[0].t(), x[1].t()); }},
      {"matmul_batched_broadcast", {{3, 5, 16}, {16, 7}}, [](const V& x) { return matmul(x[0], x[1]); }},
      {"bmm", {{3, 5, 16}, {3, 16, 4}}, [](const V& x) { return bmm(x[0], x[1]); }},
      {"linear", {{2, 5, 16}, {8, 16}, {8}}, [](const V& x) { return linear(x[0], x[1], x[2]); }},
      {"softmax_last", {{7, 33}}, [](const V& x) { return softmax(x[0], -1); }},
      {"softmax_inner", {{5, 6, 4}}, [](const V& x) { return softmax(x[0], 1); }},
      {"log_softmax", {{7, 1000}}, [](const V& x) { return log_softmax(x[0], -1); }},
      {"layer_norm", {{6, 48}, {48}, {48}}, [](const V& x) { return layer_norm(x[0], {48}, x[1], x[2]); },
       true, false, 2},
      {"layer_norm_many_rows", {{700, 40}, {40}, {40}}, [](const V& x) { return layer_norm(x[0], {40}, x[1], x[2]); },
       true, false, 2},
      {"attention", {{4, 9, 8}, {4, 9, 8}, {4, 9, 8}},
       [](const V& x) { return scaled_dot_product_attention(x[0], x[1], x[2], false); }, true, false, 2},
      {"attention_causal", {{4, 9, 8}, {4, 9, 8}, {4, 9, 8}},
       [](const V& x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); }, true, false, 2},
      {"cross_entropy", {{6, 11}}, [targets](const V& x) { return cross_entropy(x[0], on(targets, x[0])); }},
      {"cross_entropy_smooth_ignore", {{6, 11}},
       [targets_ignore](const V& x) {
         return cross_entropy(x[0], on(targets_ignore, x[0]), Reduction::Mean, -100, 0.1);
       }},
      {"cross_entropy_none", {{6, 11}},
       [targets](const V& x) { return cross_entropy(x[0], on(targets, x[0]), Reduction::None); }},
      {"nll_loss", {{6, 11}}, [targets](const V& x) { return nll_loss(log_softmax(x[0], 1), on(targets, x[0])); }},
      {"mse_loss", {{4, 5}, {4, 5}}, [](const V& x) { return mse_loss(x[0], x[1]); }},
      {"embedding", {{13, 6}}, [tokens](const V& x) { return embedding(x[0], on(tokens, x[0])); }},
      {"index_select", {{5, 3}}, [select_idx](const V& x) { return index_select(x[0], 0, on(select_idx, x[0])); }},
      {"gather", {{4, 5}}, [gather_idx](const V& x) { return gather(x[0], 1, on(gather_idx, x[0])); }},
      // batch_norm: [N, C] and [N, C, L] in training (batch statistics; the short-row and long-row
      // reductions of Note [CUDA batch norm], the latter with the rows cut in two) and in eval.
      {"batch_norm_train_2d", {{32, 6}, {6}, {6}},
       [](const V& x) { return batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], true); }, true, false, 2},
      {"batch_norm_train_2d_many_rows", {{700, 40}, {40}, {40}},
       [](const V& x) { return batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], true); }, true, false, 2},
      {"batch_norm_train_short_rows", {{9, 5, 7}, {5}, {5}},
       [](const V& x) { return batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], true); }, true, false, 2},
      {"batch_norm_train_long_rows", {{3, 4, 80}, {4}, {4}},
       [](const V& x) { return batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], true); }, true, false, 2},
      {"batch_norm_train_split_rows", {{2, 2, 2100}, {2}, {2}},
       [](const V& x) { return batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], true); }, true, false, 2},
      {"batch_norm_train_2d_many_partials", {{4096, 3}, {3}, {3}},
       [](const V& x) { return batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], true); }, true, false, 2},
      {"batch_norm_train_no_affine", {{16, 3, 33}},
       [](const V& x) { return batch_norm(x[0], Tensor(), Tensor(), Tensor(), Tensor(), true); }, true, false, 2},
      {"batch_norm_eval", {{8, 4, 40}, {4}, {4}},
       [](const V& x) {
         const Tensor rm = from_vector(std::vector<double>{0.1, -0.2, 0.3, 0.0}, {4}, DType::Float32);
         const Tensor rv = from_vector(std::vector<double>{0.5, 1.5, 2.0, 0.8}, {4}, DType::Float32);
         return batch_norm(x[0], on(rm, x[0]), on(rv, x[0]), x[1], x[2], false);
       }},
      {"batch_norm_eval_2d", {{8, 4}, {4}, {4}},
       [](const V& x) {
         const Tensor rm = from_vector(std::vector<double>{0.1, -0.2, 0.3, 0.0}, {4}, DType::Float32);
         const Tensor rv = from_vector(std::vector<double>{0.5, 1.5, 2.0, 0.8}, {4}, DType::Float32);
         return batch_norm(x[0], on(rm, x[0]), on(rv, x[0]), x[1], x[2], false);
       }},
      {"dropout_seeded",
       {{8, 9}},
       [](const V& x) {
         Generator dg(3);
         return dropout(x[0], 0.3, true, &dg);
       }},
  };
  // Each case's chained sums in terms, forward and backward (Note [CUDA runner bounds]): a broadcast
  // input's gradient sums over the rows it was broadcast to; a GEMM sums over its inner dimension (its
  // transposed products' over the others, which are shorter here), plus a bias's term; softmax over its
  // row forward and again backward; a norm over its row (or a channel's N L values) twice forward and
  // twice backward, then its weight gradient over the rows; attention over E for the scores, S for the
  // softmax and the product, and each of them again backward; a loss over its classes, then the batch;
  // a gradient scattered to repeated indices over the repeats.
  const std::map<std::string, double> lengths = {
      {"add_broadcast", 4}, {"mul_broadcast", 4}, {"minimum", 4}, {"sum_dims", 5 * 7}, {"sum_rows_columns", 300},
      {"mean_all", 17 * 19}, {"var", 2 * 9}, {"matmul", 24}, {"matmul_transposed", 24},
      {"matmul_batched_broadcast", 16}, {"bmm", 16}, {"linear", 16 + 1}, {"softmax_last", 2 * 33},
      {"softmax_inner", 2 * 6}, {"log_softmax", 2 * 1000}, {"layer_norm", 4 * 48 + 6},
      {"layer_norm_many_rows", 4 * 40 + 700}, {"attention", 2 * (8 + 9 + 9)}, {"attention_causal", 2 * (8 + 9 + 9)},
      {"cross_entropy", 11 + 6}, {"cross_entropy_smooth_ignore", 2 * 11 + 6}, {"cross_entropy_none", 11},
      {"nll_loss", 2 * 11 + 6}, {"mse_loss", 20}, {"embedding", 15}, {"index_select", 4}, {"gather", 3},
      {"batch_norm_train_2d", 5 * 32}, {"batch_norm_train_2d_many_rows", 5 * 700},
      {"batch_norm_train_short_rows", 5 * 9 * 7}, {"batch_norm_train_long_rows", 5 * 3 * 80},
      {"batch_norm_train_split_rows", 5 * 2 * 2100}, {"batch_norm_train_2d_many_partials", 5 * 4096},
      {"batch_norm_train_no_affine", 5 * 16 * 33}, {"batch_norm_eval", 8 * 40}, {"batch_norm_eval_2d", 8}};
  for (const auto& [name, length] : lengths) {
    auto it = std::find_if(c.begin(), c.end(), [&](const OpCase& k) { return k.name == name; });
    if (it == c.end()) throw std::logic_error("no runner case named " + name);
    it->length = length;
  }
  return c;
}

}  // namespace

// The half of the runner that needs no GPU: every case's float64 CPU reference runs, is finite, and
// gives every input a gradient (a malformed case fails here, on any machine).
TEST_CASE("every case of the CUDA cross-backend runner has a finite float64 CPU reference", "[cuda]") {
  int checked = 0;
  for (const OpCase& c : cases()) {
    INFO("op " << c.name);
    Generator g(1);
    std::vector<Tensor> in;
    for (const Shape& s : c.shapes) {
      Tensor base = randn(s, &g, DType::Float64);
      if (c.positive) base = add(abs(base), 0.5);
      in.push_back(base.detach().requires_grad_(c.grad));
    }
    const Tensor ref = c.fn(in);
    for (double v : ref.tolist()) REQUIRE(std::isfinite(v));
    if (c.grad) {
      sum(mul(ref, randn(ref.shape(), &g, DType::Float64))).backward();
      for (const Tensor& t : in) {
        REQUIRE(t.grad().defined());
        for (double v : t.grad().tolist()) REQUIRE(std::isfinite(v));
      }
    }
    ++checked;
  }
  CHECK(checked == int(cases().size()));
}

namespace {

// Runs case c in dtype dt on `device` and on the CPU in float64 from the same rounded inputs, and
// checks the value and every input gradient against their bounds (Note [CUDA runner bounds]).
void check_case(const OpCase& c, DType dt, Device device, uint64_t seed) {
  Generator g(seed);
  std::vector<Tensor> ref_in, dev_in;
  for (const Shape& s : c.shapes) {
    Tensor base = randn(s, &g, DType::Float64);
    if (c.positive) base = add(abs(base), 0.5);
    const Tensor rounded = base.to(dt);  // both sides see the same representable inputs
    ref_in.push_back(rounded.to(DType::Float64).detach().requires_grad_(c.grad));
    dev_in.push_back(rounded.to(device).detach().requires_grad_(c.grad));
  }
  const Tensor ref = c.fn(ref_in);
  const Tensor got = c.fn(dev_in);
  INFO("op " << c.name << " in " << dt << " on " << device);
  REQUIRE(got.device() == device);
  REQUIRE(got.shape() == ref.shape());
  const double tol = value_bound(c, dt), grad_tol = gradient_bound(c, dt);
  const double err = rel_error(got.to(Device::cpu()).to(DType::Float64), ref);
  std::printf("%-30s %-9s %-7s value err %.2e (bound %.1e)", c.name.c_str(), dtype_name(dt), device.str().c_str(), err,
              tol);
  CHECK(err <= tol);
  if (c.grad) {
    const Tensor w = randn(ref.shape(), &g, DType::Float64).to(dt);
    sum(mul(ref, w.to(DType::Float64))).backward();
    sum(mul(got, w.to(device))).backward();
    double worst = 0;
    for (size_t i = 0; i < ref_in.size(); ++i) {
      REQUIRE(dev_in[i].grad().defined());
      const double ge = rel_error(dev_in[i].grad().to(Device::cpu()).to(DType::Float64), ref_in[i].grad());
      INFO("gradient of input " << i);
      CHECK(ge <= grad_tol);
      worst = std::max(worst, ge);
    }
    std::printf("  grad err %.2e (bound %.1e)", worst, grad_tol);
  }
  std::printf("\n");
}

}  // namespace

// The same bounds hold for the CPU's own float32, float16 and bfloat16 kernels, which follow the
// contract the derivation assumes (evaluate in float32, round once to the dtype; sums in float32): a
// bound that misses a term fails here, on any machine, before a GPU sees it.
TEST_CASE("the CUDA runner's derived bounds hold for the CPU kernels in float32, float16 and bfloat16", "[cuda]") {
  uint64_t seed = 100;
  for (const OpCase& c : cases())
    for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) check_case(c, dt, Device::cpu(), ++seed);
}

TEST_CASE("every op on CUDA matches the CPU float64 result in float32, float16 and bfloat16", "[cuda]") {
  if (skip_without_gpu()) return;
  // Note [CUDA runner bounds] counts float32 GEMMs in float32's unit: TF32 (u = 2^-11) must be off.
  REQUIRE_FALSE(cuda::allow_tf32());
  int checked = 0;
  uint64_t seed = 100;
  int float64_cases = 0;
  for (const OpCase& c : cases()) {
    for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) {
      check_case(c, dt, Device::cuda(), ++seed);
      ++checked;
    }
    // batch_norm's float64 path has kernels of its own (double shuffles and Welford states).
    if (c.name.rfind("batch_norm", 0) == 0) {
      check_case(c, DType::Float64, Device::cuda(), ++seed);
      ++float64_cases;
    }
  }
  cuda::synchronize();
  CHECK(checked == int(cases().size()) * 3);
  CHECK(float64_cases >= 8);
}

TEST_CASE("batch_norm backward with empty rows gives zero weight and bias gradients on the CPU and CUDA", "[cuda]") {
  // The CPU half states the expected result on any machine; the CUDA half skips without a GPU.
  for (const bool on_gpu : {false, true}) {
    if (on_gpu && skip_without_gpu()) return;
    const Device dev = on_gpu ? Device::cuda() : Device::cpu();
    const Tensor x = zeros({2, 3, 0}, DType::Float32, dev).requires_grad_(true);
    const Tensor w = ones({3}, DType::Float32, dev).requires_grad_(true);
    const Tensor b = zeros({3}, DType::Float32, dev).requires_grad_(true);
    const Tensor rm = zeros({3}, DType::Float32, dev), rv = ones({3}, DType::Float32, dev);
    sum(batch_norm(x, rm, rv, w, b, false)).backward();
    INFO("on " << dev);
    REQUIRE(w.grad().defined());
    CHECK(w.grad().cpu().tolist() == std::vector<double>{0, 0, 0});
    CHECK(b.grad().cpu().tolist() == std::vector<double>{0, 0, 0});
  }
}

// 102,400 values per channel in float32, both first-launch layouts ([M, C]: short runs; [N, C, L]: long
// runs), against float64 on the CPU fed the same float32 input and output gradient. A thread sums at most
// kPerThread values in float32 and everything after is double (Note [CUDA batch-norm sums in double]),
// so the bounds are the CPU test's (tests/ops/test_ops_nn.cpp): a few roundings, not growing with M.
TEST_CASE("batch_norm on CUDA keeps float32 accuracy at 100k values per channel", "[cuda]") {
  if (skip_without_gpu()) return;
  const double u = std::ldexp(1.0, -24);
  for (const Shape& s : {Shape{102400, 3}, Shape{4, 3, 25600}}) {
    INFO("shape " << str(s));
    const int64_t C = 3;
    Generator gen(41);
    const Tensor x32 = add(mul(randn(s, &gen, DType::Float64), 1.5), 0.5).to(DType::Float32);
    const Tensor g32 = randn(s, &gen, DType::Float32);
    const Tensor w32 = add(randn({C}, &gen, DType::Float64), 2.0).to(DType::Float32);
    const Tensor b32 = randn({C}, &gen, DType::Float32);
    auto run = [&](DType dt, Device dev) {
      Tensor x = x32.to(dt).to(dev).requires_grad_(), w = w32.to(dt).to(dev).requires_grad_(),
             b = b32.to(dt).to(dev).requires_grad_();
      Tensor y = batch_norm(x, Tensor(), Tensor(), w, b, true);
      y.backward(g32.to(dt).to(dev));
      std::vector<std::vector<double>> r;
      for (const Tensor& t : {y, x.grad(), w.grad(), b.grad()}) r.push_back(t.cpu().to(DType::Float64).flatten().tolist());
      return r;
    };
    const auto ref = run(DType::Float64, Device::cpu()), got = run(DType::Float32, Device::cuda());
    double err_y = 0, err_dx = 0, max_dx = 0;
    for (double v : ref[1]) max_dx = std::max(max_dx, std::abs(v));
    for (size_t i = 0; i < ref[0].size(); ++i) {
      err_y = std::max(err_y, std::abs(got[0][i] - ref[0][i]) / (std::abs(ref[0][i]) + 1) / u);
      err_dx = std::max(err_dx, std::abs(got[1][i] - ref[1][i]) / max_dx / u);
    }
    // dweight and dbias relative to the sums of their terms' sizes, sum |g xhat| and sum |g|.
    const int64_t L = s.size() == 2 ? 1 : s[2], M = s[0] * L;
    const std::vector<double> xs = x32.to(DType::Float64).flatten().tolist(), gs = g32.to(DType::Float64).flatten().tolist();
    std::vector<double> mu(C, 0), var(C, 0), sum_gxhat(C, 0), sum_g(C, 0);
    const auto channel = [&](size_t i) { return size_t(int64_t(i) / L % C); };
    for (size_t i = 0; i < xs.size(); ++i) mu[channel(i)] += xs[i] / double(M);
    for (size_t i = 0; i < xs.size(); ++i) var[channel(i)] += (xs[i] - mu[channel(i)]) * (xs[i] - mu[channel(i)]) / double(M);
    for (size_t i = 0; i < xs.size(); ++i) {
      sum_gxhat[channel(i)] += std::abs(gs[i] * (xs[i] - mu[channel(i)]) / std::sqrt(var[channel(i)] + 1e-5));
      sum_g[channel(i)] += std::abs(gs[i]);
    }
    double err_dw = 0, err_db = 0;
    for (size_t c = 0; c < size_t(C); ++c) {
      err_dw = std::max(err_dw, std::abs(got[2][c] - ref[2][c]) / sum_gxhat[c] / u);
      err_db = std::max(err_db, std::abs(got[3][c] - ref[3][c]) / sum_g[c] / u);
    }
    std::printf("batch_norm 100k per channel %-14s errors in u: y %.2f dx %.2f dweight %.2f dbias %.2f\n",
                str(s).c_str(), err_y, err_dx, err_dw, err_db);
    INFO("errors in u: y " << err_y << ", dx " << err_dx << ", dweight " << err_dw << ", dbias " << err_db);
    CHECK(err_y <= 8);
    CHECK(err_dx <= 8);
    // Float32 sums of at most kPerThread (64) terms, then double: well below u of the terms' sizes.
    CHECK(err_dw <= 1);
    CHECK(err_db <= 1);
  }
}

TEST_CASE("tensors move between host and device bit for bit, and the allocator reuses blocks", "[cuda]") {
  if (skip_without_gpu()) return;
  Generator g(1);
  for (DType dt : {DType::Float64, DType::Float32, DType::Float16, DType::BFloat16, DType::Int64, DType::Int32,
                   DType::Bool}) {
    const Tensor h = mul(randn({37, 3}, &g, DType::Float64), 10.0).to(dt);
    const Tensor d = h.to(Device::cuda());
    CHECK(d.device() == Device::cuda());
    CHECK(d.dtype() == dt);
    CHECK(d.to(Device::cpu()).tolist() == h.tolist());
    // A strided view copied across devices keeps its logical order.
    CHECK(h.t().to(Device::cuda()).contiguous().to(Device::cpu()).tolist() == h.t().contiguous().tolist());
  }
  // Conversion on the device rounds as the host does (round to nearest even).
  const Tensor x = randn({1000}, &g, DType::Float32);
  CHECK(x.to(Device::cuda()).to(DType::BFloat16).cpu().tolist() == x.to(DType::BFloat16).tolist());
  CHECK(x.to(Device::cuda()).to(DType::Float16).cpu().tolist() == x.to(DType::Float16).tolist());

  // Freed blocks come back: the same shapes allocated again do not grow the device footprint.
  cuda::synchronize();
  { Tensor warm = Tensor::empty({1 << 20}, DType::Float32, Device::cuda()); }
  const size_t cached_before = cuda::cached_bytes();
  const size_t in_use_before = cuda::bytes_in_use();
  for (int i = 0; i < 10; ++i) {
    Tensor t = Tensor::empty({1 << 20}, DType::Float32, Device::cuda());
    CHECK(cuda::bytes_in_use() > in_use_before);
  }
  CHECK(cuda::bytes_in_use() == in_use_before);
  CHECK(cuda::cached_bytes() == cached_before);
}

TEST_CASE("CUDA misuse throws typed errors that say what was wrong", "[cuda]") {
  if (skip_without_gpu()) return;
  CHECK_THROWS_AS(Tensor::empty({4}, DType::Float32, Device::cuda(cuda::device_count() + 3)), DeviceError);
  const Tensor a = randn({3, 4}).to(Device::cuda());
  const Tensor b = randn({4, 3});
  CHECK_THROWS_AS(matmul(a, b), DeviceError);
  // Asking for more memory than the device has names the allocation, CUDA's error and the free memory.
  try {
    Tensor::empty({int64_t(1) << 44}, DType::Float32, Device::cuda());
    FAIL("a 64 TiB allocation succeeded");
  } catch (const OutOfMemoryError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("cannot allocate 64.0 TiB for a float32 tensor of shape [17592186044416]") !=
          std::string::npos);
    CHECK(std::string(e.what()).find("out of memory on cuda:0 allocating 70368744177664 bytes") != std::string::npos);
    CHECK(std::string(e.what()).find("free on the device") != std::string::npos);
  }
  // The backend still works after the failed allocation.
  CHECK(sum(ones({10}, DType::Float32, Device::cuda())).item() == 10.0);
}

TEST_CASE("build info reports the CUDA backend and the device", "[cuda]") {
  const nlohmann::json info = build_info();
  CHECK(info["cuda"]["compiled"].get<bool>() == cuda::is_compiled());
  CHECK(info["cuda"]["device_count"].get<int>() == cuda::device_count());
  CHECK(build_info_line().rfind("CUDA: ", 0) == 0);
  if (skip_without_gpu()) return;
  CHECK(!info["cuda"]["devices"][0].get<std::string>().empty());
  CHECK(info["cuda"]["reason"].get<std::string>().empty());
}

// ------------------------------------------------------------------------- batch norm running stats
namespace {

// Two training steps of batch_norm from running stats (0, 1), momentum 0.1: the running statistics
// (mean, unbiased variance) after them. x0, x1 already on `running`'s device and in their dtype.
std::pair<Tensor, Tensor> running_stats_after(const Tensor& x0, const Tensor& x1, DType stats_dtype, Device device) {
  const int64_t C = x0.size(1);
  Tensor rm = zeros({C}, stats_dtype, device), rv = ones({C}, stats_dtype, device);
  for (const Tensor& x : {x0, x1}) batch_norm(x, rm, rv, Tensor(), Tensor(), true, 0.1);
  return {rm.to(Device::cpu()).to(DType::Float64), rv.to(Device::cpu()).to(DType::Float64)};
}

struct RunningStatsCase {
  Shape shape;
  double offset;  // data far from zero: the variance must not cancel
};

}  // namespace

TEST_CASE("batch_norm's running statistics on CUDA follow the CPU after training steps", "[cuda]") {
  const std::vector<RunningStatsCase> shapes = {{{32, 6}, 0}, {{9, 5, 7}, 0}, {{4, 3, 300}, 0}, {{64, 4}, 100},
                                                {{4, 3, 300}, 100}};
  // The float64 CPU reference against the closed form from other kernels (mean and var reductions):
  // runs on any machine, so a wrong reference cannot hide behind the skip below.
  for (const RunningStatsCase& c : shapes) {
    Generator g(5);
    const Tensor x0 = add(randn(c.shape, &g, DType::Float64), c.offset);
    const Tensor x1 = add(randn(c.shape, &g, DType::Float64), c.offset);
    const auto [rm, rv] = running_stats_after(x0, x1, DType::Float64, Device::cpu());
    const std::vector<int64_t> dims = x0.dim() == 3 ? std::vector<int64_t>{0, 2} : std::vector<int64_t>{0};
    const Tensor rm_want = add(mul(mean(x0, dims), 0.9 * 0.1), mul(mean(x1, dims), 0.1));
    const Tensor rv_want = add(add(mul(var(x0, dims), 0.9 * 0.1), mul(var(x1, dims), 0.1)), 0.9 * 0.9);
    INFO("shape " << str(c.shape));
    CHECK(rel_error(rm, rm_want) <= 1e-12);
    CHECK(rel_error(rv, rv_want) <= 1e-12);
  }
  if (skip_without_gpu()) return;
  for (const RunningStatsCase& c : shapes) {
    for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) {
      Generator g(6);
      // Both sides see the same representable inputs; the statistics are float32 on the device (as
      // BatchNorm1d keeps them), accumulated in double (Note [CUDA batch-norm sums in double]).
      const Tensor x0 = add(randn(c.shape, &g, DType::Float64), c.offset).to(dt);
      const Tensor x1 = add(randn(c.shape, &g, DType::Float64), c.offset).to(dt);
      const auto [rm_ref, rv_ref] =
          running_stats_after(x0.to(DType::Float64), x1.to(DType::Float64), DType::Float64, Device::cpu());
      const auto [rm, rv] = running_stats_after(x0.to(Device::cuda()), x1.to(Device::cuda()), DType::Float32,
                                                Device::cuda());
      const double err_mean = rel_error(rm, rm_ref), err_var = rel_error(rv, rv_ref);
      std::printf("batch_norm running stats %-12s %-9s mean err %.2e var err %.2e\n", str(c.shape).c_str(),
                  dtype_name(dt), err_mean, err_var);
      INFO("shape " << str(c.shape) << " in " << dt);
      // The inputs are exact in float32 and the statistics are float32: the mean, then the variance
      // about it, sum n = N L terms each (order term of 2 n); two momentum updates of three roundings
      // each and the unbiased factor n / (n - 1) (7 roundings, gamma_8 with the mean's division).
      const double n = double(x0.numel() / x0.size(1));
      const double bound = ro::gamma(8, ro::kUnit) + ro::reduction_bound({2 * n});
      CHECK(err_mean <= bound);
      CHECK(err_var <= bound);
    }
  }
}

// ------------------------------------------------------------------------------- SGD trajectories
namespace {

struct SGDCase {
  double momentum, dampening, weight_decay;
  bool nesterov;
};

// Every combination torch accepts (nesterov needs momentum and no dampening).
std::vector<SGDCase> sgd_cases() {
  std::vector<SGDCase> out;
  for (double momentum : {0.0, 0.9})
    for (double dampening : {0.0, 0.3})
      for (double weight_decay : {0.0, 0.05})
        for (bool nesterov : {false, true})
          if (!nesterov || (momentum != 0.0 && dampening == 0.0))
            out.push_back({momentum, dampening, weight_decay, nesterov});
  return out;
}

constexpr double kSGDLr = 0.1;
constexpr int kSGDSteps = 6;

// CPU and CUDA run the same SGD operations in the same order on the same dtype; only the compilers'
// contraction of a multiply-add into an FMA may differ, moving a result by one rounding. Each step
// rounds at most 4 results per element (weight decay's d, the buffer, nesterov's d, the parameter),
// and a rounding that went the other way stays in the parameter (and, shrunk by the momentum, in the
// buffer): over the steps a chain of 6 x 4 roundings of the dtype, gamma_24.
double sgd_trajectory_bound(DType dt) { return ro::gamma(4 * kSGDSteps, unit(dt)); }

// Parameters made from `init` on `device` take one SGD step per entry of `grads`; parameter 1 gets no
// gradient on step 0, so its momentum buffer starts a step later than the others' (a run of its own,
// with the first-step copy). Returns the final parameters and momentum buffers, in float64.
struct SGDResult {
  std::vector<Tensor> params, buffers;
};
SGDResult run_sgd(const SGDCase& c, const std::vector<Tensor>& init, const std::vector<std::vector<Tensor>>& grads,
                  Device device) {
  std::vector<Tensor> params;
  for (const Tensor& t : init) params.push_back(t.to(device).detach().requires_grad_());
  optim::SGD opt(params, nlohmann::json{{"lr", kSGDLr},
                                        {"momentum", c.momentum},
                                        {"dampening", c.dampening},
                                        {"weight_decay", c.weight_decay},
                                        {"nesterov", c.nesterov}});
  for (size_t s = 0; s < grads.size(); ++s) {
    opt.zero_grad();
    for (size_t i = 0; i < params.size(); ++i)
      if (!(s == 0 && i == 1)) params[i].grad().copy_(grads[s][i]);
    opt.step();
  }
  SGDResult r;
  for (const Tensor& p : params) r.params.push_back(p.detach().to(Device::cpu()).to(DType::Float64));
  const optim::OptimizerState state = opt.state_dict();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state.tensors.find("state." + std::to_string(i) + ".momentum_buffer");
    if (it != state.tensors.end()) r.buffers.push_back(it->second.to(Device::cpu()).to(DType::Float64));
  }
  return r;
}

struct SGDProblem {
  std::vector<Tensor> init;
  std::vector<std::vector<Tensor>> grads;  // [step][param]
};
SGDProblem sgd_problem(DType dt, uint64_t seed) {
  Generator g(seed);
  const std::vector<Shape> shapes = {{5, 7}, {13}, {3, 4}};
  SGDProblem pr;
  for (const Shape& s : shapes) pr.init.push_back(randn(s, &g, DType::Float64).to(dt));
  for (int step = 0; step < kSGDSteps; ++step) {
    pr.grads.emplace_back();
    for (const Shape& s : shapes) pr.grads.back().push_back(randn(s, &g, DType::Float64).to(dt));
  }
  return pr;
}

}  // namespace

TEST_CASE("SGD on CUDA follows CPU SGD over several steps for every option combination", "[cuda]") {
  // The CPU side against torch's update rule written out in float64 (test_optim checks it against
  // PyTorch itself): runs on any machine, so the reference and the skipped-gradient schedule are
  // checked even where the device half is skipped.
  for (const SGDCase& c : sgd_cases()) {
    const SGDProblem pr = sgd_problem(DType::Float32, 11);
    const SGDResult got = run_sgd(c, pr.init, pr.grads, Device::cpu());
    INFO("momentum " << c.momentum << " dampening " << c.dampening << " weight_decay " << c.weight_decay
                     << " nesterov " << c.nesterov);
    REQUIRE(got.buffers.size() == (c.momentum != 0.0 ? pr.init.size() : 0));
    for (size_t i = 0; i < pr.init.size(); ++i) {
      std::vector<double> p = pr.init[i].to(DType::Float64).tolist(), buf;
      for (size_t s = 0; s < pr.grads.size(); ++s) {
        if (s == 0 && i == 1) continue;
        const std::vector<double> g = pr.grads[s][i].to(DType::Float64).tolist();
        const bool first = buf.empty();
        if (c.momentum != 0.0 && first) buf.resize(p.size());
        for (size_t k = 0; k < p.size(); ++k) {
          double d = g[k] + c.weight_decay * p[k];
          if (c.momentum != 0.0) {
            buf[k] = first ? d : c.momentum * buf[k] + (1 - c.dampening) * d;
            d = c.nesterov ? d + c.momentum * buf[k] : buf[k];
          }
          p[k] -= kSGDLr * d;
        }
      }
      // float32 against float64: every one of the 6 x 4 roundings counts, gamma_24 in float32.
      const Shape shape = pr.init[i].shape();
      CHECK(rel_error(got.params[i], from_vector(p, shape)) <= sgd_trajectory_bound(DType::Float32));
      if (c.momentum != 0.0)
        CHECK(rel_error(got.buffers[i], from_vector(buf, shape)) <= sgd_trajectory_bound(DType::Float32));
    }
  }
  if (skip_without_gpu()) return;
  int checked = 0;
  for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) {
    const SGDProblem pr = sgd_problem(dt, 12);
    for (const SGDCase& c : sgd_cases()) {
      const SGDResult ref = run_sgd(c, pr.init, pr.grads, Device::cpu());
      const SGDResult got = run_sgd(c, pr.init, pr.grads, Device::cuda());
      INFO(dt << ": momentum " << c.momentum << " dampening " << c.dampening << " weight_decay " << c.weight_decay
              << " nesterov " << c.nesterov);
      REQUIRE(got.buffers.size() == ref.buffers.size());
      double worst = 0;
      for (size_t i = 0; i < ref.params.size(); ++i) worst = std::max(worst, rel_error(got.params[i], ref.params[i]));
      for (size_t i = 0; i < ref.buffers.size(); ++i)
        worst = std::max(worst, rel_error(got.buffers[i], ref.buffers[i]));
      std::printf("SGD m=%.1f d=%.1f wd=%.2f nesterov=%d %-9s worst err %.2e\n", c.momentum, c.dampening,
                  c.weight_decay, int(c.nesterov), dtype_name(dt), worst);
      CHECK(worst <= sgd_trajectory_bound(dt));
      ++checked;
    }
  }
  CHECK(checked == 3 * int(sgd_cases().size()));
}

// ------------------------------------------------------------------------------------ a second GPU
// Note [CUDA device routing]: work on cuda:1 runs on cuda:1's stream, with its allocator and SM
// count, whichever device is current when it starts. Needs two GPUs; says why it is skipped otherwise.
TEST_CASE("ops, copies and SGD on a second CUDA device follow the CPU while the first is current", "[cuda]") {
  if (skip_without_gpu()) return;
  if (cuda::device_count() < 2) {
    skip_test("needs 2 CUDA devices, " + std::to_string(cuda::device_count()) + " visible");
    return;
  }
  const Device first = Device::cuda(0), second = Device::cuda(1);
  const Tensor on_first = ones({8}, DType::Float32, first);
  const auto make_first_current = [&] { CHECK(sum(on_first).item() == 8.0); };
  uint64_t seed = 500;
  for (const OpCase& c : cases()) {
    make_first_current();
    check_case(c, DType::Float32, second, ++seed);
  }
  // Between the GPUs and back, bit for bit.
  Generator g(9);
  const Tensor h = randn({257, 3}, &g, DType::Float32);
  make_first_current();
  const Tensor d1 = h.to(first).to(second);
  CHECK(d1.device() == second);
  CHECK(d1.to(Device::cpu()).tolist() == h.tolist());
  CHECK(d1.to(first).to(Device::cpu()).tolist() == h.tolist());
  // SGD with momentum on cuda:1 (flat buffers and state allocated and zeroed there).
  const SGDProblem pr = sgd_problem(DType::Float32, 13);
  const SGDCase c{0.9, 0.0, 0.05, true};
  make_first_current();
  const SGDResult ref = run_sgd(c, pr.init, pr.grads, Device::cpu());
  const SGDResult got = run_sgd(c, pr.init, pr.grads, second);
  REQUIRE(got.buffers.size() == ref.buffers.size());
  for (size_t i = 0; i < ref.params.size(); ++i)
    CHECK(rel_error(got.params[i], ref.params[i]) <= sgd_trajectory_bound(DType::Float32));
  for (size_t i = 0; i < ref.buffers.size(); ++i)
    CHECK(rel_error(got.buffers[i], ref.buffers[i]) <= sgd_trajectory_bound(DType::Float32));
  cuda::synchronize(1);
}
