// The cross-backend runner (in the spirit of ggml's test-backend-ops): every op that the CUDA backend
// implements runs on the GPU in float32, float16 and bfloat16, and its value and its input gradients
// are compared with the same op on the CPU in float64, fed the same (rounded) inputs. The error is
// ||cuda - ref|| / ||ref||, held to a per-dtype bound; NaN never passes. Without a GPU every test here
// prints why it was skipped and passes.
#include <catch2/catch.hpp>

#include "cuda_skip.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "booster/autograd/autograd.h"
#include "booster/backends/cuda/cuda.h"
#include "booster/common/build_info.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"

using namespace booster;

namespace {

using testing::skip_without_gpu;

struct OpCase {
  std::string name;
  std::vector<Shape> shapes;  // floating inputs, drawn N(0, 1) (or |N| + 0.5 when positive)
  std::function<Tensor(const std::vector<Tensor>&)> fn;
  bool grad = true;      // also compare the gradients of every input
  bool positive = false;
  double tol_scale = 1;  // multiplies the dtype's bound (ops that amplify rounding)
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

double bound(DType d) {
  switch (d) {
    case DType::Float32: return 2e-5;
    case DType::Float16: return 4e-3;
    default: return 3e-2;  // bfloat16: 8 significant bits
  }
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
      {"sqrt_rsqrt", {{4, 5}}, [](const V& x) { return add(sqrt(x[0]), rsqrt(x[0])); }, true, true},
      {"pow_scalar", {{4, 5}}, [](const V& x) { return add(pow(x[0], 2.0), pow(x[0], 3.0)); }, true, true},
      {"clamp", {{4, 5}}, [](const V& x) { return clamp(x[0], -0.5, 0.7); }},
      {"relu", {{4, 5}}, [](const V& x) { return relu(x[0]); }},
      {"gelu_erf", {{4, 5}}, [](const V& x) { return gelu(x[0]); }},
      {"gelu_tanh", {{64, 33}}, [](const V& x) { return gelu(x[0], "tanh"); }},
      {"tanh", {{4, 5}}, [](const V& x) { return tanh(x[0]); }},
      {"sigmoid", {{4, 5}}, [](const V& x) { return sigmoid(x[0]); }},
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
      {"dropout_seeded",
       {{8, 9}},
       [](const V& x) {
         Generator dg(3);
         return dropout(x[0], 0.3, true, &dg);
       }},
  };
  return c;
}

}  // namespace

TEST_CASE("every op on CUDA matches the CPU float64 result in float32, float16 and bfloat16", "[cuda]") {
  if (skip_without_gpu()) return;
  int checked = 0;
  uint64_t seed = 100;
  for (const OpCase& c : cases()) {
    for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) {
      ++seed;
      Generator g(seed);
      std::vector<Tensor> ref_in, dev_in;
      for (const Shape& s : c.shapes) {
        Tensor base = randn(s, &g, DType::Float64);
        if (c.positive) base = add(abs(base), 0.5);
        const Tensor rounded = base.to(dt);  // both sides see the same representable inputs
        ref_in.push_back(rounded.to(DType::Float64).detach().requires_grad_(c.grad));
        dev_in.push_back(rounded.to(Device::cuda()).detach().requires_grad_(c.grad));
      }
      const Tensor ref = c.fn(ref_in);
      const Tensor got = c.fn(dev_in);
      INFO("op " << c.name << " in " << dt);
      REQUIRE(got.device() == Device::cuda());
      REQUIRE(got.shape() == ref.shape());
      const double tol = bound(dt) * c.tol_scale;
      const double err = rel_error(got.to(Device::cpu()).to(DType::Float64), ref);
      std::printf("%-30s %-9s value err %.2e (bound %.1e)", c.name.c_str(), dtype_name(dt), err, tol);
      CHECK(err <= tol);
      if (c.grad) {
        const Tensor w = randn(ref.shape(), &g, DType::Float64).to(dt);
        sum(mul(ref, w.to(DType::Float64))).backward();
        sum(mul(got, w.to(Device::cuda()))).backward();
        double worst = 0;
        for (size_t i = 0; i < ref_in.size(); ++i) {
          REQUIRE(dev_in[i].grad().defined());
          const double ge = rel_error(dev_in[i].grad().to(Device::cpu()).to(DType::Float64), ref_in[i].grad());
          INFO("gradient of input " << i);
          CHECK(ge <= tol * 2);
          worst = std::max(worst, ge);
        }
        std::printf("  grad err %.2e", worst);
      }
      std::printf("\n");
      ++checked;
    }
  }
  cuda::synchronize();
  CHECK(checked == int(cases().size()) * 3);
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
  } catch (const CudaError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("cannot allocate 70368744177664 bytes on cuda:0") != std::string::npos);
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
