// The tracer on CUDA tensors: its finiteness checks set flags on the device and are read once after
// the step, so the names must be those the CPU gives for the same model (a forward overflow, a
// backward one, a parameter gradient), and per-module statistics must match the CPU's counts.
#include <catch2/catch.hpp>

#include "cuda_skip.h"

#include <cmath>
#include <vector>

#include "booster/diagnostics/tensor_stats.h"
#include "booster/diagnostics/tracer.h"
#include "booster/nn/nn.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"
#include "booster/tensor/random.h"

using namespace booster;
using namespace booster::diagnostics;
using testing::skip_without_gpu;

namespace {

class Sqrt : public nn::Module {
 public:
  Tensor forward(const Tensor& x) override { return sqrt(x); }
  std::string name() const override { return "Sqrt"; }
};

std::shared_ptr<nn::Linear> linear(int64_t in, int64_t out, double weight, double bias) {
  auto l = std::make_shared<nn::Linear>(in, out);
  NoGradGuard no_grad;
  l->weight.fill_(weight);
  l->bias.fill_(bias);
  return l;
}

// The first non-finite tensor of one traced step of sum(model(x)) * factor on `device`.
std::optional<NonFinite> first_on(nn::Module& model, const Tensor& x, double factor, Device device, bool statistics) {
  model.to(device);
  model.zero_grad();
  Tracer tracer(model);
  tracer.begin_step(statistics);
  {
    const auto observing = tracer.observe();
    mul(sum(model(x.to(device))), factor).backward();
  }
  tracer.end_step();
  return tracer.first_nonfinite();
}

}  // namespace

TEST_CASE("cuda tracer: the first non-finite tensor is named as on the CPU", "[cuda][diagnostics]") {
  if (skip_without_gpu()) return;
  const Device gpu = Device::cuda(0);
  struct Case {
    const char* what;
    std::function<std::shared_ptr<nn::Sequential>()> make;
    Tensor x;
    double factor;
  };
  const std::vector<Case> cases = {
      {"forward overflow",
       [] {
         auto m = std::make_shared<nn::Sequential>();
         m->push_back(linear(4, 8, 0.5, 0.0));
         m->push_back(std::make_shared<nn::ReLU>());
         m->push_back(linear(8, 8, 3e38, 0.0));
         return m;
       },
       full({3, 4}, 10.0), 1.0},
      {"backward overflow",
       [] {
         auto m = std::make_shared<nn::Sequential>();
         m->push_back(linear(4, 8, 0.5, -100.0));
         m->push_back(std::make_shared<nn::ReLU>());
         m->push_back(std::make_shared<Sqrt>());
         m->push_back(linear(8, 2, 1.0, 0.0));
         return m;
       },
       ones({3, 4}), 1.0},
      {"parameter gradient",
       [] {
         auto m = std::make_shared<nn::Sequential>();
         m->push_back(linear(4, 8, 2.5e8, 0.0));
         m->push_back(linear(8, 2, 1e9, 0.0));
         return m;
       },
       ones({3, 4}), 1e30},
  };
  for (const Case& c : cases)
    for (const bool statistics : {false, true}) {
      INFO(c.what << ", statistics " << statistics);
      auto cpu_model = c.make(), gpu_model = c.make();
      const std::optional<NonFinite> cpu = first_on(*cpu_model, c.x, c.factor, Device::cpu(), statistics);
      const std::optional<NonFinite> cuda = first_on(*gpu_model, c.x, c.factor, gpu, statistics);
      REQUIRE(cpu);
      REQUIRE(cuda);
      CHECK(cuda->to_json() == cpu->to_json());
    }
}

TEST_CASE("cuda tracer: past 1024 traced tensors the flag buffer grows and keeps its flags", "[cuda][diagnostics]") {
  if (skip_without_gpu()) return;
  // Sqrt's input gradient is among the last of about 1200 checked tensors (600 layers' outputs, then
  // their gradients).
  auto make = [](double bias) {
    auto m = std::make_shared<nn::Sequential>();
    m->push_back(linear(4, 8, 0.5, bias));
    m->push_back(std::make_shared<nn::ReLU>());
    m->push_back(std::make_shared<Sqrt>());
    for (int i = 0; i < 600; ++i) m->push_back(linear(8, 8, 0.125, 0.0));
    return m;
  };
  auto clean = make(1.0);
  CHECK_FALSE(first_on(*clean, ones({2, 4}), 1.0, Device::cuda(0), false));
  auto bad = make(-100.0);
  const std::optional<NonFinite> first = first_on(*bad, ones({2, 4}), 1.0, Device::cuda(0), false);
  REQUIRE(first);
  CHECK(first->module == "2");
  CHECK(first->tensor == Role::InputGradient);
}

// The statistics kernel against the CPU's loop, on values at every boundary the statistics count: each
// format's overflow, underflow and subnormal thresholds (and the float32 patterns either side), float32
// subnormals, zeros of both signs, inf and NaN, and a million random values over many exponents.
TEST_CASE("cuda tracer: tensor statistics on the GPU equal the CPU's, boundaries included", "[cuda][diagnostics]") {
  if (skip_without_gpu()) return;
  std::vector<float> v = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-45f, -1e-40f, 3.4e38f, 1.0f, -2.5f};
  for (Format f : kFormats) {
    const FormatRange& r = format_range(f);
    for (float edge : {r.overflow_from, r.underflow_upto, r.normal_from})
      for (float x : {edge, std::nextafter(edge, 0.0f), std::nextafter(edge, INFINITY)}) v.push_back(x), v.push_back(-x);
  }
  Generator gen(11);
  const std::vector<double> wide = (randn({1 << 20}, &gen) * 8.0).tolist();
  for (double x : wide) v.push_back(float(std::ldexp(1.0, int(x)) * (x - std::floor(x) + 0.5)));
  const Tensor host = from_vector(v, {int64_t(v.size())});
  for (DType dtype : {DType::Float32, DType::BFloat16, DType::Float16}) {
    INFO(dtype_name(dtype));
    const Tensor t = host.to(dtype);
    const TensorStats cpu = tensor_stats(t), gpu = tensor_stats(t.to(Device::cuda()));
    CHECK(gpu.to_json() == cpu.to_json());
    CHECK(gpu.count == cpu.count);
    CHECK(gpu.exponents == cpu.exponents);
    CHECK(max_abs(t.to(Device::cuda())) == max_abs(t));
    // A strided view is read as its values.
    const Tensor strided = t.to(Device::cuda()).reshape({-1, 2}).t();
    CHECK(tensor_stats(strided).to_json() == cpu.to_json());
  }
}
