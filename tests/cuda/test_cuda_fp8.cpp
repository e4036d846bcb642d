// fp8 on CUDA (Note [Float8 GEMMs on a GPU]): the float8 casts give the CPU's bytes and values for a
// sweep of float32 bit patterns, float8_mm (cuBLASLt on sm_89+) is the float64 product of its operands
// within float32 accumulation, and an fp8 linear on the GPU matches its float64 reference forward and
// backward. Without a GPU every test here is reported as skipped, with the reason (cuda_skip.h).
#include <catch2/catch.hpp>

#include "cuda_skip.h"
#include "float8_reference.h"

#include <cstring>
#include <vector>

#include "booster/autocast/autocast.h"
#include "booster/backends/cuda/cuda.h"
#include "booster/mixed_precision/float8.h"
#include "booster/nn/linear.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"

using namespace booster;

namespace {

const Device kGpu = Device::cuda(0);

// float32 values from a stride through every bit pattern, plus the edges of both formats.
Tensor float32_sweep() {
  std::vector<float> v;
  for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 4093) {
    const uint32_t bits = uint32_t(u);
    float f;
    std::memcpy(&f, &bits, 4);
    v.push_back(f);
  }
  for (float f : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 448.0f, 464.0f, 464.01f, 480.0f, 57344.0f, 61440.0f,
                  61441.0f, 0x1p-9f, 0x1p-10f, 0x1.8p-10f, 0x1p-16f, 0x1p-17f, 0x1.8p-17f})
    v.push_back(f), v.push_back(-f);
  return from_vector(v, {int64_t(v.size())});
}

std::vector<uint8_t> bytes(const Tensor& q) {
  const Tensor cpu = q.to(Device::cpu()).contiguous();
  const uint8_t* p = static_cast<const uint8_t*>(cpu.data_ptr());
  return std::vector<uint8_t>(p, p + cpu.numel());
}

}  // namespace

TEST_CASE("cuda: float8 casts give the CPU's bytes and values", "[cuda][fp8]") {
  if (testing::skip_without_gpu()) return;
  const Tensor x = float32_sweep();
  for (DType src : {DType::Float32, DType::BFloat16, DType::Float16})
    for (DType f8 : {DType::Float8E4M3FN, DType::Float8E5M2})
      for (bool saturate : {false, true})
        for (float scale : {1.0f, 3.0f}) {
          INFO(dtype_name(src) << " -> " << dtype_name(f8) << ", saturate " << saturate << ", scale " << scale);
          const Tensor xs = x.to(src);
          const Tensor cpu = to_float8(xs, f8, scale, saturate), gpu = to_float8(xs.to(kGpu), f8, scale, saturate);
          CHECK(bytes(gpu) == bytes(cpu));
          // Back to float32 (NaNs of either sign compared by bits too).
          const Tensor back_cpu = from_float8(cpu, 0.5f), back_gpu = from_float8(gpu, 0.5f).to(Device::cpu());
          CHECK(std::memcmp(back_cpu.data_ptr(), back_gpu.data_ptr(), back_cpu.nbytes()) == 0);
        }
}

TEST_CASE("cuda: float8_mm is the float64 product of its operands within float32 accumulation", "[cuda][fp8]") {
  if (testing::skip_without_gpu()) return;
  Generator gen(3);
  // Multiples of 16 take cuBLASLt's float8 GEMM on sm_89+; the last shape the dequantized fallback.
  for (const auto& [n, m, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {32, 48, 64}, {16, 16, 16}, {64, 32, 256}, {5, 7, 24}}) {
    INFO("n " << n << ", m " << m << ", k " << k);
    const Tensor a32 = randn({n, k}, &gen) * 4.0, b32 = randn({m, k}, &gen) * 0.02;
    const float sa = 448.0f / float(max(abs(a32)).item()), sb = 448.0f / float(max(abs(b32)).item());
    const float sg = 57344.0f / float(max(abs(b32)).item());
    const Tensor a = to_float8(a32, DType::Float8E4M3FN, sa, true).to(kGpu);
    const Tensor b = to_float8(b32, DType::Float8E4M3FN, sb, true).to(kGpu);
    const Tensor g = to_float8(b32, DType::Float8E5M2, sg, true).to(kGpu);
    const int64_t before = cuda::float8_gemm_count();
    testing::check_float8_mm(a, b, sa, sb, DType::Float32);
    // This build targets sm_90 (CMAKE_CUDA_ARCHITECTURES): sizes that are multiples of 16 must have
    // taken cuBLASLt's float8 kernel, the others the fallback.
    CHECK(cuda::float8_gemm_count() - before == (n % 16 == 0 && m % 16 == 0 && k % 16 == 0 ? 1 : 0));
    testing::check_float8_mm(a, b, sa, sb, DType::BFloat16);
    testing::check_float8_mm(a, g, sa, sg, DType::Float32);  // e4m3 x e5m2, as backward
    testing::check_float8_mm(g.narrow(0, 0, std::min(m, n)).contiguous(), a.narrow(0, 0, std::min(m, n)).contiguous(),
                             sg, sa, DType::Float32);  // e5m2 x e4m3
  }
}

TEST_CASE("cuda: an fp8 linear matches the CPU's forward and backward", "[cuda][fp8]") {
  if (testing::skip_without_gpu()) return;
  // Same layer, input and output gradient on both devices, current scaling: the same scales and
  // float8 operands, so the results differ only in how the sums are accumulated (and, for the
  // bfloat16 output, its rounding). Each side errs from the exact sum by at most (k + 2) u S, where S
  // is the sum of |products| over the k terms (u = 2^-24), so they differ by at most twice that; S is
  // taken from the unquantized operands, 1.25x for float8 rounding (e4m3 at most 2^-4 relative, e5m2
  // 2^-3: 1.0625 x 1.125 < 1.25). The bfloat16 outputs may further differ by one bfloat16 unit (2^-7
  // relative).
  const int64_t rows = 32, in = 64, out = 48;
  Generator gen(5);
  const nn::Linear init(in, out, true, &gen);
  const Tensor x0 = randn({rows, in}, &gen) * 3.0;
  const Tensor g0 = randn({rows, out}, &gen).to(DType::BFloat16);
  mixed_precision::Float8LinearOptions o;
  o.lm_head = true;
  o.scaling.delayed = false;
  auto run = [&](Device device) {
    auto layer = std::make_shared<nn::Linear>(in, out, true);
    layer->load_state_dict(init.state_dict());
    layer->to(device);
    auto linears = std::make_shared<mixed_precision::Float8Linears>(o);
    linears->bind(*layer);
    Tensor x = x0.to(device).detach().requires_grad_();  // a leaf of its own on either device (x0 untouched)
    Tensor y;
    {
      autocast::AutocastGuard guard(true, DType::BFloat16, nullptr, linears);
      y = layer->forward(x);
    }
    y.backward(g0.to(device));
    return std::vector<Tensor>{y.detach().to(DType::Float32).to(Device::cpu()), x.grad().to(Device::cpu()),
                               layer->weight.grad().to(Device::cpu()), layer->bias.grad().to(Device::cpu())};
  };
  const std::vector<Tensor> cpu = run(Device::cpu()), gpu = run(kGpu);
  const Tensor ax = abs(x0).to(DType::Float64), aw = abs(init.weight.detach()).to(DType::Float64),
               ag = abs(g0.to(DType::Float64));
  const std::vector<Tensor> magnitude = {matmul(ax, aw.t()), matmul(ag, aw), matmul(ag.t(), ax), sum(ag, {0})};
  const int64_t inner[] = {in, out, rows, rows};
  const char* names[] = {"output", "input gradient", "weight gradient", "bias gradient"};
  for (size_t i = 0; i < cpu.size(); ++i) {
    INFO(names[i]);
    REQUIRE(gpu[i].shape() == cpu[i].shape());
    const std::vector<double> c = cpu[i].to(DType::Float64).to_vector<double>();
    const std::vector<double> g = gpu[i].to(DType::Float64).to_vector<double>();
    const std::vector<double> s = magnitude[i].contiguous().to_vector<double>();
    int64_t bad = 0;
    for (size_t j = 0; j < c.size(); ++j) {
      // The GEMMs' results are divided by the scales after the sums; S above is in the same units.
      // Plus the GPU's narrower in-chunk accumulation (float8_reference.h), 2^-10 of S.
      double bound = (2.0 * double(inner[i] + 2) * 0x1p-24 + 0x1p-10) * 1.25 * s[j];
      if (i == 0) bound += 0x1p-7 * std::abs(c[j]) + 0x1p-7 * bound;
      if (!(std::abs(g[j] - c[j]) <= bound) && bad++ < 5)
        FAIL_CHECK("[" << j << "]: cuda " << g[j] << ", cpu " << c[j] << " (bound " << bound << ")");
    }
    CHECK(bad == 0);
  }
}
