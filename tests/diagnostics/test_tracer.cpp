// The tracer (diagnostics/tracer.h) and the doctor's verdict (diagnostics/doctor.h): which tensor of a
// step is named as the first non-finite one, in models built so that exactly one module's forward
// output, input gradient or parameter gradient overflows; the per-module statistics against
// tensor_stats of the same tensors computed outside the tracer and closed forms (a sum's gradient is
// all ones); the findings and recommendation on tensors whose classes are known by construction.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "booster/diagnostics/doctor.h"
#include "booster/diagnostics/tracer.h"
#include "booster/nn/nn.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"

using namespace booster;
using namespace booster::diagnostics;

namespace {

// sqrt: finite at 0, its gradient is not.
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

const ModuleStats& stats_of(const Tracer& tracer, const std::string& path) {
  for (const ModuleStats& m : tracer.modules())
    if (m.path == path) return m;
  FAIL("no module " << path);
  static const ModuleStats none;
  return none;
}

void check_same(const TensorStats& got, const TensorStats& want) {
  CHECK(got.count == want.count);
  CHECK(got.nonfinite == want.nonfinite);
  CHECK(got.zeros == want.zeros);
  CHECK(got.max_abs == want.max_abs);
  CHECK(got.exponents == want.exponents);
  for (Format f : kFormats) {
    CHECK(got.in(f).overflow == want.in(f).overflow);
    CHECK(got.in(f).underflow == want.in(f).underflow);
    CHECK(got.in(f).subnormal == want.in(f).subnormal);
  }
}

// One traced forward and backward of sum(model(x)) * loss_factor.
void traced_step(Tracer& tracer, nn::Module& model, const Tensor& x, bool statistics, double loss_factor = 1.0) {
  tracer.begin_step(statistics);
  {
    const auto observing = tracer.observe();
    Tensor loss = mul(sum(model(x)), loss_factor);
    loss.backward();
  }
  tracer.end_step();
}

}  // namespace

TEST_CASE("tracer: a forward overflow is named at the first module whose output is not finite", "[diagnostics]") {
  for (const bool statistics : {false, true}) {
    INFO("statistics " << statistics);
    // Every ReLU output is 4 x 10 x 0.5 = 20; layer 2 sums 8 of them times 3e38: inf. Layer 3 and the
    // Sequential return non-finite outputs too, later.
    nn::Sequential model;
    model.push_back(linear(4, 8, 0.5, 0.0));
    model.push_back(std::make_shared<nn::ReLU>());
    model.push_back(linear(8, 8, 3e38, 0.0));
    model.push_back(linear(8, 2, 1.0, 0.0));
    Tracer tracer(model);
    traced_step(tracer, model, full({3, 4}, 10.0), statistics);
    const std::optional<NonFinite> first = tracer.first_nonfinite();
    REQUIRE(first);
    CHECK(first->module == "2");
    CHECK(first->type == "Linear");
    CHECK_FALSE(first->backward);
    CHECK(first->tensor == Role::Output);
    CHECK(first->describe() == "the output of 2 (Linear) in forward");
    CHECK(first->to_json() == nlohmann::json{{"module", "2"}, {"type", "Linear"}, {"pass", "forward"}, {"tensor", "output"}});

    // The next step is clean again once the weights are.
    {
      NoGradGuard no_grad;
      model[2]->parameters()[0].fill_(0.01);
    }
    model.zero_grad();
    traced_step(tracer, model, full({3, 4}, 10.0), statistics);
    CHECK_FALSE(tracer.first_nonfinite());
  }
}

namespace {
// Scales its input in place and returns it: the same storage as the previous module's output, changed.
class ScaleInPlace : public nn::Module {
 public:
  explicit ScaleInPlace(double factor) : factor_(factor) {}
  Tensor forward(const Tensor& x) override {
    Tensor y = x;
    return y.mul_(factor_);
  }
  std::string name() const override { return "ScaleInPlace"; }

 private:
  double factor_;
};
}  // namespace

// The tracer checks each tensor once per step, but a tensor changed in place since its check is a new
// value: the in-place module that made it inf is the one named, not the next module.
TEST_CASE("tracer: a tensor changed in place is checked again and its module named", "[diagnostics]") {
  for (const bool statistics : {false, true}) {
    INFO("statistics " << statistics);
    nn::Sequential model;
    model.push_back(linear(4, 8, 0.5, 0.0));            // 20 everywhere
    model.push_back(std::make_shared<ScaleInPlace>(3e38));  // inf, in the same storage
    model.push_back(linear(8, 2, 1.0, 0.0));
    Tracer tracer(model);
    tracer.begin_step(statistics);
    {
      const auto observing = tracer.observe();
      NoGradGuard no_grad;
      model(full({3, 4}, 10.0));
    }
    tracer.end_step();
    const std::optional<NonFinite> first = tracer.first_nonfinite();
    REQUIRE(first);
    CHECK(first->module == "1");
    CHECK(first->type == "ScaleInPlace");
    CHECK(first->tensor == Role::Output);
  }
}

TEST_CASE("tracer: a backward overflow is named at the first gradient that is not finite", "[diagnostics]") {
  for (const bool statistics : {false, true}) {
    INFO("statistics " << statistics);
    // The bias -100 zeroes every ReLU output; sqrt(0) = 0 is finite, its gradient g / (2 sqrt(0)) is
    // not. The gradients reach 3 and its input (finite), then the Sqrt's input gradient: the first bad
    // one; what follows it is not named.
    nn::Sequential model;
    model.push_back(linear(4, 8, 0.5, -100.0));
    model.push_back(std::make_shared<nn::ReLU>());
    model.push_back(std::make_shared<Sqrt>());
    model.push_back(linear(8, 2, 1.0, 0.0));
    Tracer tracer(model);
    traced_step(tracer, model, full({3, 4}, 1.0), statistics);
    const std::optional<NonFinite> first = tracer.first_nonfinite();
    REQUIRE(first);
    CHECK(first->module == "2");
    CHECK(first->type == "Sqrt");
    CHECK(first->backward);
    CHECK(first->tensor == Role::InputGradient);
    CHECK(first->describe() == "the input gradient of 2 (Sqrt) in backward");
    if (statistics) {
      CHECK(stats_of(tracer, "3")[Role::InputGradient].nonfinite == 0);
      CHECK(stats_of(tracer, "2")[Role::OutputGradient].nonfinite == 0);
      CHECK(stats_of(tracer, "2")[Role::InputGradient].nonfinite == 24);
    }
  }
}

TEST_CASE("tracer: a parameter gradient that overflows alone is named with the parameter", "[diagnostics]") {
  // Inputs of 1e38 times weights of 1e-37 give outputs of 40 (finite), and layer 1's input gradient is
  // 100 x 1 = 100 per row; layer 0's weight gradient sums three rows of 100 x 1e38: inf. Its bias
  // gradient (300) and layer 1's gradients stay finite, and layer 0's input needs no gradient.
  nn::Sequential model;
  model.push_back(linear(4, 8, 1e-37, 0.0));
  model.push_back(linear(8, 2, 1.0, 0.0));
  Tracer tracer(model);
  traced_step(tracer, model, full({3, 4}, 1e38), /*statistics=*/false, /*loss_factor=*/50.0);
  const std::optional<NonFinite> first = tracer.first_nonfinite();
  REQUIRE(first);
  CHECK(first->module == "0");
  CHECK(first->backward);
  CHECK(first->tensor == Role::ParameterGradient);
  CHECK(first->parameter == "0.weight");
  CHECK(first->describe() == "the parameter gradient 0.weight of 0 (Linear) in backward");
  CHECK(first->to_json().at("parameter") == "0.weight");
}

TEST_CASE("tracer: a module's parameter gradient comes before its input gradient", "[diagnostics]") {
  // Layer 1 sees inputs of 4 x 2.5e8 = 1e9 through weights of 1e9 (outputs 8e18, finite); the loss
  // gradient of 1e30 makes both its weight gradient (1e30 x 1e9 x 3 rows) and its input gradient
  // (2 x 1e30 x 1e9) overflow in the same backward. Its output gradient (1e30) is finite.
  nn::Sequential model;
  model.push_back(linear(4, 8, 2.5e8, 0.0));
  model.push_back(linear(8, 2, 1e9, 0.0));
  Tracer tracer(model);
  traced_step(tracer, model, ones({3, 4}), /*statistics=*/false, /*loss_factor=*/1e30);
  const std::optional<NonFinite> first = tracer.first_nonfinite();
  REQUIRE(first);
  CHECK(first->module == "1");
  CHECK(first->tensor == Role::ParameterGradient);
  CHECK(first->parameter == "1.weight");
}

TEST_CASE("tracer: per-module statistics are those of the module's tensors", "[diagnostics]") {
  Generator gen(3);
  auto lin = std::make_shared<nn::Linear>(3, 5, true, &gen);
  nn::Sequential model;
  model.push_back(lin);
  model.push_back(std::make_shared<nn::ReLU>());
  const Tensor x = randn({4, 3}, &gen);
  Tracer tracer(model);
  traced_step(tracer, model, x, /*statistics=*/true);
  CHECK(tracer.statistics_steps() == 1);

  // Computed again outside the tracer.
  Tensor out0, out1;
  {
    NoGradGuard no_grad;
    out0 = (*lin)(x);
    out1 = relu(out0);
  }
  check_same(stats_of(tracer, "0")[Role::Output], tensor_stats(out0));
  check_same(stats_of(tracer, "1")[Role::Output], tensor_stats(out1));
  check_same(stats_of(tracer, "")[Role::Output], tensor_stats(out1));
  CHECK(stats_of(tracer, "0").input_max_abs == diagnostics::max_abs(x));
  // The gradient of a sum is all ones: 20 values in the binade of 2^0.
  const TensorStats& ones_grad = stats_of(tracer, "")[Role::OutputGradient];
  CHECK(ones_grad.count == 20);
  CHECK(ones_grad.max_abs == 1.0f);
  CHECK(ones_grad.exponents[127] == 20);
  check_same(stats_of(tracer, "1")[Role::OutputGradient], ones_grad);
  // The ReLU's input gradient is layer 0's output gradient: ones where out0 > 0.
  const TensorStats& relu_input_grad = stats_of(tracer, "1")[Role::InputGradient];
  int64_t positive = 0;
  for (double v : out0.tolist()) positive += v > 0;
  CHECK(relu_input_grad.count == 20);
  CHECK(relu_input_grad.exponents[127] == positive);
  CHECK(relu_input_grad.zeros == 20 - positive);
  check_same(stats_of(tracer, "0")[Role::OutputGradient], relu_input_grad);
  // Layer 0's input needs no gradient; its parameters' gradients are the weight's and the bias's.
  CHECK(stats_of(tracer, "0")[Role::InputGradient].empty());
  TensorStats params = tensor_stats(lin->weight.grad());
  params.merge(tensor_stats(lin->bias.grad()));
  check_same(stats_of(tracer, "0")[Role::ParameterGradient], params);
  CHECK(stats_of(tracer, "0").parameter_max_abs == std::max(diagnostics::max_abs(lin->weight), diagnostics::max_abs(lin->bias)));

  // A step without statistics adds nothing; a second statistics step adds its counts.
  model.zero_grad();
  traced_step(tracer, model, x, /*statistics=*/false);
  CHECK(stats_of(tracer, "0")[Role::Output].count == 20);
  model.zero_grad();
  traced_step(tracer, model, x, /*statistics=*/true);
  CHECK(stats_of(tracer, "0")[Role::Output].count == 40);
  CHECK(tracer.statistics_steps() == 2);
  tracer.reset_statistics();
  CHECK(tracer.statistics_steps() == 0);
  CHECK(stats_of(tracer, "0").empty());
  CHECK(tracer.statistics_json().at("modules").empty());
}

TEST_CASE("tracer: past 1024 traced tensors the flag buffer grows and keeps its flags", "[diagnostics]") {
  // Sqrt's input gradient is among the last of about 1200 checked tensors (600 layers' outputs, then
  // their gradients); a clean model names nothing.
  for (const double bias : {1.0, -100.0}) {
    nn::Sequential model;
    model.push_back(linear(4, 8, 0.5, bias));
    model.push_back(std::make_shared<nn::ReLU>());
    model.push_back(std::make_shared<Sqrt>());
    for (int i = 0; i < 600; ++i) model.push_back(linear(8, 8, 0.125, 0.0));
    Tracer tracer(model);
    traced_step(tracer, model, ones({2, 4}), /*statistics=*/false);
    const std::optional<NonFinite> first = tracer.first_nonfinite();
    if (bias > 0) {
      CHECK_FALSE(first);
      continue;
    }
    REQUIRE(first);
    CHECK(first->module == "2");
    CHECK(first->tensor == Role::InputGradient);
  }
}

TEST_CASE("tracer: a module recomputed under activation checkpointing is counted once", "[diagnostics]") {
  // The checkpointed block runs twice (forward, and again inside backward); its forward statistics
  // are one forward's, and the gradients of the recomputed graph are traced.
  auto block = std::make_shared<nn::Sequential>();
  block->push_back(linear(3, 5, 0.25, 0.0));
  block->push_back(std::make_shared<nn::ReLU>());
  nn::Sequential model;
  model.push_back(std::make_shared<nn::Checkpoint>(block));
  model.push_back(linear(5, 2, 1.0, 0.0));
  Tracer tracer(model);
  traced_step(tracer, model, ones({4, 3}), /*statistics=*/true);
  const ModuleStats& inner = stats_of(tracer, "0.module.0");
  CHECK(inner[Role::Output].count == 4 * 5);
  CHECK(inner[Role::OutputGradient].count == 4 * 5);
  CHECK(inner[Role::ParameterGradient].count == 3 * 5 + 5);
  CHECK(stats_of(tracer, "0")[Role::Output].count == 4 * 5);
  CHECK_FALSE(tracer.first_nonfinite());
}

TEST_CASE("tracer: nothing is traced outside observe() or after the tracer is gone", "[diagnostics]") {
  nn::Sequential model;
  model.push_back(linear(2, 2, 1.0, 0.0));
  Tensor loss;
  {
    Tracer tracer(model);
    tracer.begin_step(true);
    {
      const auto observing = tracer.observe();
      loss = sum(model(ones({1, 2})));
    }
    // Forward outside the scope: not seen.
    const Tensor unseen = sum(model(ones({1, 2})));
    CHECK(stats_of(tracer, "0")[Role::Output].count == 2);
  }
  // The graph outlives the tracer; its backward still runs and changes nothing.
  loss.backward();
  CHECK(model[0]->parameters()[0].grad().defined());
  CHECK(nn::module_call_observer() == nullptr);
}

namespace {

ModuleStats module_with(const std::string& path, const std::string& type, Role role, const Tensor& values) {
  ModuleStats m;
  m.path = path;
  m.type = type;
  m.roles[size_t(role)] = tensor_stats(values);
  return m;
}

// n values of `small` and the rest 1.0.
Tensor mixed(int64_t total, int64_t n, float small) {
  std::vector<float> v(size_t(total), 1.0f);
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = small;
  return from_vector(v, {total});
}

}  // namespace

TEST_CASE("doctor: lost float16 gradients recommend bf16 and name the module", "[diagnostics]") {
  // 1e-9 is below float16's 2^-25 (it becomes zero) and a normal bfloat16 number.
  DoctorInput in;
  in.format = "float16";
  in.precision = "fp16";
  in.loss_scale = 1.0;
  in.steps = 3;
  in.modules = {module_with("blocks.2.mlp.c_fc", "Linear", Role::ParameterGradient, mixed(100, 4, 1e-9f)),
                module_with("head", "Linear", Role::InputGradient, mixed(1000, 1, 1e-9f))};
  Diagnosis d = diagnose(in);
  CHECK(d.recommendation ==
        "use bf16: float16: 4.00% of the parameter gradients of blocks.2.mlp.c_fc (Linear) underflow to zero at "
        "scale 1; bfloat16 keeps them");

  // Between 0.1% and 1%: raise the scale first.
  in.modules = {module_with("head", "Linear", Role::InputGradient, mixed(1000, 5, 1e-9f))};
  d = diagnose(in);
  CHECK(d.recommendation.rfind("raise the initial loss scale or use bf16: float16: 0.50% of the input gradients of head", 0) == 0);

  // Under bf16 the same tensors are fine.
  in.format = "bfloat16";
  in.precision = "bf16";
  d = diagnose(in);
  CHECK(d.recommendation.rfind("bf16 is fine here", 0) == 0);
  CHECK(d.findings.empty());
  // Even values bf16 loses (below its 2^-133) never make it recommend bf16: it states the fraction.
  DoctorInput tiny = in;
  tiny.modules = {module_with("head", "Linear", Role::InputGradient, mixed(100, 5, 1e-41f))};
  d = diagnose(tiny);
  CHECK(d.recommendation == "bf16 is fine here: no forward overflow, and at most 5.00% of any module's gradients underflow");
  REQUIRE(d.findings.size() == 1);
  CHECK(d.findings[0].rfind("bfloat16: 5.00% of the input gradients of head (Linear) underflow to zero", 0) == 0);

  // Under fp32, whether bf16 would hold them.
  in.format = "float32";
  in.precision = "fp32";
  d = diagnose(in);
  CHECK(d.recommendation.rfind("bf16 would hold every value", 0) == 0);
  REQUIRE(d.findings.size() == 1);  // float16 would lose 0.5% of head's input gradients
  CHECK(d.findings[0].rfind("float16: 0.50% of the input gradients of head (Linear)", 0) == 0);
}

TEST_CASE("doctor: a float16 forward overflow comes first", "[diagnostics]") {
  DoctorInput in;
  in.format = "float16";
  in.precision = "fp16_naive";
  in.steps = 1;
  in.modules = {module_with("layers.0", "Linear", Role::Output, mixed(10, 1, 1e5f)),
                module_with("layers.2", "Linear", Role::ParameterGradient, mixed(10, 5, 1e-9f))};
  const Diagnosis d = diagnose(in);
  CHECK(d.recommendation ==
        "use bf16: float16: 10.00% of the outputs of layers.0 (Linear) exceed 65504 (max |x| 100000); bfloat16 "
        "keeps them");
  REQUIRE(d.findings.size() == 2);
}

TEST_CASE("doctor: skipped steps are reported with their first non-finite tensor", "[diagnostics]") {
  DoctorInput in;
  in.format = "float16";
  in.precision = "fp16";
  in.steps = 4;
  in.loss_scale = 16384;
  in.modules = {module_with("fc", "Linear", Role::Output, mixed(10, 0, 0.0f))};
  in.skipped = {{1, 32768, NonFinite{"fc", "Linear", true, Role::InputGradient, {}}}, {2, 16384, std::nullopt}};
  const Diagnosis d = diagnose(in);
  REQUIRE(d.findings.size() == 1);
  CHECK(d.findings[0] == "2 of 4 steps were skipped; the first non-finite tensor of step 1 was the input gradient of "
                         "fc (Linear) in backward");
  CHECK(d.recommendation == "use bf16, which needs no loss scale: " + d.findings[0]);
  const nlohmann::json report = doctor_report(in, d);
  CHECK(report.at("skipped_steps").size() == 2);
  CHECK(report.at("skipped_steps")[0].at("first_nonfinite").at("tensor") == "input_grad");
  CHECK(report.at("skipped_steps")[1].at("first_nonfinite").is_null());
  CHECK(report.at("modules").size() == 1);
}

TEST_CASE("doctor: fp8 scales map each Linear's amax to the format's largest value", "[diagnostics]") {
  // Output gradients: 10 values of 2^10, 60 of 1 and 30 of 2^-30. Scaled so 2^10 becomes 57344 (x 56),
  // 2^-30 x 56 is far below e5m2's half smallest subnormal 2^-17: 30% lost; 1.0 x 56 is kept.
  std::vector<float> g(100, 1.0f);
  for (int i = 0; i < 10; ++i) g[size_t(i)] = 1024.0f;
  for (int i = 10; i < 40; ++i) g[size_t(i)] = std::ldexp(1.0f, -30);
  ModuleStats m = module_with("fc1", "Linear", Role::OutputGradient, from_vector(g, {100}));
  m.roles[size_t(Role::Output)] = tensor_stats(ones({4}));
  m.input_max_abs = 2.0f;
  m.parameter_max_abs = 0.5f;
  ModuleStats relu = module_with("act", "ReLU", Role::Output, ones({4}));
  DoctorInput in;
  in.format = "fp8";
  in.precision = "fp8";
  in.steps = 1;
  in.modules = {m, relu};
  const Diagnosis d = diagnose(in);
  REQUIRE(d.fp8_scales.size() == 1);
  const nlohmann::json& s = d.fp8_scales.at("fc1");
  CHECK(s.at("input").get<double>() == 224.0);
  CHECK(s.at("weight").get<double>() == 896.0);
  CHECK(s.at("grad_output").get<double>() == 56.0);
  CHECK(s.at("grad_output_below_e5m2").get<double>() == Approx(0.3));
  REQUIRE(d.findings.size() == 1);
  CHECK(d.findings[0] == "fp8: scaled to e5m2's 57344, at least 30.00% of the output gradients of fc1 (Linear) still "
                         "underflow; keep it in bf16 (mixed_precision.exclude)");
}

TEST_CASE("doctor: the compute format of a config", "[diagnostics]") {
  using nlohmann::json;
  const json single = {{"name", "single"}};
  CHECK(compute_format({{"name", "fp16"}}, single) == "float16");
  CHECK(compute_format({{"name", "fp16_naive"}}, single) == "float16");
  CHECK(compute_format({{"name", "fp16_apex"}, {"opt_level", "O2"}}, single) == "float16");
  CHECK(compute_format({{"name", "fp16_apex"}, {"opt_level", "O0"}}, single) == "float32");
  CHECK(compute_format({{"name", "bf16"}}, single) == "bfloat16");
  CHECK(compute_format({{"name", "fp8"}}, single) == "fp8");
  CHECK(compute_format({{"name", "fp32"}}, single) == "float32");
  CHECK(compute_format({{"name", "fp32"}}, {{"name", "low_level_zero"}, {"precision", "bf16"}}) == "bfloat16");
}
