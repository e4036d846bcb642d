// Neural-network functions and losses: values against PyTorch fixtures (tests/fixtures/nn.json,
// made by make_nn_fixtures.py), gradients against central finite differences in float64, typed
// errors, autocast policies, and dropout's seeded masks.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"
#include "fixture.h"
#include "gradcheck.h"

using namespace booster;
using testing::allclose;
using testing::gradcheck;
using testing::max_abs_diff;
using testing::tensor_from_json;

namespace {

const nlohmann::json& fixtures() {
  static const nlohmann::json j = testing::load_fixture_json("nn.json");
  return j;
}
Tensor fx(const char* c, const char* name) { return tensor_from_json(fixtures().at(c).at(name)); }

Tensor rnd(const Shape& s, uint64_t seed, double scale = 1.0) {
  Generator g(seed);
  return randn(s, &g, DType::Float64) * scale;
}

}  // namespace

// ============================================================================================ softmax

TEST_CASE("softmax and log_softmax match PyTorch over every dim", "[ops][nn_functional]") {
  const Tensor x = fx("softmax_last", "x");
  CHECK(allclose(softmax(x, -1), fx("softmax_last", "softmax"), 1e-12, 1e-14));
  CHECK(allclose(log_softmax(x, 1), fx("softmax_last", "log_softmax"), 1e-12, 1e-14));
  const Tensor y = fx("softmax_middle", "x");
  CHECK(allclose(softmax(y, 0), fx("softmax_middle", "softmax_dim0"), 1e-12, 1e-14));
  CHECK(allclose(softmax(y, 1), fx("softmax_middle", "softmax_dim1"), 1e-12, 1e-14));
  CHECK(allclose(log_softmax(y, -2), fx("softmax_middle", "log_softmax_dim1"), 1e-12, 1e-14));
  // A strided (transposed) input takes the same result as its contiguous copy.
  CHECK(allclose(softmax(y.transpose(0, 2), 2), fx("softmax_middle", "softmax_dim0").transpose(0, 2), 1e-12, 1e-14));
  // float32 and float16 compute in float32 and round once.
  CHECK(allclose(softmax(x.to(DType::Float32), -1), fx("softmax_last", "softmax"), 1e-5, 1e-7));
  const Tensor h = softmax(x.to(DType::Float16), -1);
  REQUIRE(h.dtype() == DType::Float16);
  CHECK(allclose(h, fx("softmax_last", "softmax"), 2e-3, 1e-4));
  // Large logits do not overflow (the max is subtracted).
  const Tensor big = softmax(from_vector(std::vector<float>{1000, 1000}, {2}), 0);
  CHECK(big.tolist() == std::vector<double>{0.5, 0.5});
}

TEST_CASE("float32 softmax keeps float64 accuracy over a wide range, masked entries exactly zero",
          "[ops][nn_functional]") {
  // Rows spanning [-100, 100] with -inf entries (masks): exercises the vectorized exp's range
  // reduction, underflow to 0 and exp(-inf) = 0.
  std::vector<double> v;
  Generator g(30);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 67; ++c) v.push_back(c % 11 == 3 ? -INFINITY : (g.uniform() - 0.5) * (r < 8 ? 200.0 : 6.0));
  // The float64 reference starts from the same float32-rounded inputs, so only the kernel's own
  // error counts: float32's rounding of x - max (relative |x - max| * 6e-8 after exp, so up to 1e-5
  // on the wide rows), and below float32's normal range an absolute one.
  const Tensor x32 = from_vector(v, {16, 67}).to(DType::Float32);
  const Tensor x64 = x32.to(DType::Float64);
  const Tensor ref = softmax(x64, -1), got = softmax(x32, -1);
  CHECK(allclose(got, ref, 1e-5, 1e-37));
  CHECK(allclose(got.slice(0, 8, 16), ref.slice(0, 8, 16), 1e-6, 1e-37));
  const auto gv = got.tolist();
  for (size_t i = 0; i < v.size(); ++i)
    if (std::isinf(v[i])) REQUIRE(gv[i] == 0.0);
  CHECK(allclose(log_softmax(x32, -1), log_softmax(x64, -1), 1e-5, 1e-5));
  // Over dim 0 (the strided lane-block path) too.
  CHECK(allclose(softmax(x32, 0), softmax(x64, 0), 1e-5, 1e-37));
}

TEST_CASE("softmax and log_softmax gradients", "[ops][nn_functional]") {
  const Tensor x = rnd({3, 4, 5}, 1);
  for (int64_t dim : {0, 1, -1}) {
    INFO("dim " << dim);
    CHECK(gradcheck([dim](const std::vector<Tensor>& in) { return softmax(in[0], dim); }, {x}));
    CHECK(gradcheck([dim](const std::vector<Tensor>& in) { return log_softmax(in[0], dim); }, {x}));
  }
}

TEST_CASE("softmax checks and autocast", "[ops][nn_functional]") {
  REQUIRE_THROWS_AS(softmax(zeros({2, 3}), 2), IndexError);
  REQUIRE_THROWS_WITH(softmax(zeros({2}, DType::Int64), 0),
                      Catch::Contains("softmax") && Catch::Contains("int64"));
  // Float32 policy: a float16 input under autocast gives a float32 output.
  const Tensor h = rnd({2, 3}, 2).to(DType::Float16);
  {
    autocast::AutocastGuard guard(true, DType::Float16);
    CHECK(softmax(h, -1).dtype() == DType::Float32);
    CHECK(log_softmax(h, -1).dtype() == DType::Float32);
  }
  CHECK(softmax(h, -1).dtype() == DType::Float16);
}

// ========================================================================================= layer norm

TEST_CASE("layer_norm matches PyTorch with and without affine", "[ops][nn_functional]") {
  const Tensor x = fx("layer_norm", "x");
  CHECK(allclose(layer_norm(x, {4}, fx("layer_norm", "weight"), fx("layer_norm", "bias")),
                 fx("layer_norm", "out_affine"), 1e-10, 1e-12));
  CHECK(allclose(layer_norm(x, {4}), fx("layer_norm", "out_plain"), 1e-10, 1e-12));
  CHECK(allclose(layer_norm(x, {3, 4}, fx("layer_norm", "weight2"), fx("layer_norm", "bias2"), 1e-3),
                 fx("layer_norm", "out_two_dims"), 1e-10, 1e-12));
  // bfloat16 input: statistics in float32, output rounded to bfloat16.
  const Tensor b = layer_norm(x.to(DType::BFloat16), {4});
  REQUIRE(b.dtype() == DType::BFloat16);
  CHECK(allclose(b, fx("layer_norm", "out_plain"), 2e-2, 2e-2));
}

TEST_CASE("layer_norm gradients", "[ops][nn_functional]") {
  const Tensor x = rnd({3, 2, 5}, 3, 2.0), w = rnd({5}, 4), b = rnd({5}, 5);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return layer_norm(in[0], {5}, in[1], in[2]); }, {x, w, b}));
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return layer_norm(in[0], {5}); }, {x}));
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return layer_norm(in[0], {2, 5}, in[1]); },
                     {x, rnd({2, 5}, 6)}));
}

TEST_CASE("layer_norm checks shapes and casts under autocast", "[ops][nn_functional]") {
  REQUIRE_THROWS_WITH(layer_norm(zeros({2, 3}), {4}),
                      Catch::Contains("layer_norm") && Catch::Contains("[4]") && Catch::Contains("[2, 3]"));
  REQUIRE_THROWS_AS(layer_norm(zeros({2, 3}), {3}, zeros({4})), ShapeError);
  autocast::AutocastGuard guard(true, DType::BFloat16);
  CHECK(layer_norm(zeros({2, 3}, DType::BFloat16), {3}).dtype() == DType::Float32);
}

// ========================================================================================= batch norm

TEST_CASE("batch_norm matches PyTorch in training and eval, and updates running stats", "[ops][nn_functional]") {
  for (const char* c : {"batch_norm_2d", "batch_norm_3d"}) {
    INFO(c);
    const Tensor x = fx(c, "x"), w = fx(c, "weight"), b = fx(c, "bias");
    const double momentum = fixtures().at(c).at("momentum").get<double>();
    Tensor rm = fx(c, "running_mean"), rv = fx(c, "running_var");
    CHECK(allclose(batch_norm(x, rm, rv, w, b, true, momentum), fx(c, "out_train"), 1e-10, 1e-12));
    // The running variance takes the unbiased batch variance (a biased one fails this).
    CHECK(allclose(rm, fx(c, "running_mean_after"), 1e-12, 1e-14));
    CHECK(allclose(rv, fx(c, "running_var_after"), 1e-12, 1e-14));
    Tensor rm0 = fx(c, "running_mean"), rv0 = fx(c, "running_var");
    CHECK(allclose(batch_norm(x, rm0, rv0, w, b, false, momentum), fx(c, "out_eval"), 1e-10, 1e-12));
    CHECK(allclose(rm0, fx(c, "running_mean"), 0, 0));  // eval leaves them alone
    // float32 running stats with a float32 input.
    Tensor rm32 = fx(c, "running_mean").to(DType::Float32), rv32 = fx(c, "running_var").to(DType::Float32);
    CHECK(allclose(batch_norm(x.to(DType::Float32), rm32, rv32, w.to(DType::Float32), b.to(DType::Float32), true,
                              momentum),
                   fx(c, "out_train"), 1e-4, 1e-5));
    CHECK(allclose(rv32, fx(c, "running_var_after"), 1e-5, 1e-6));
  }
  // Without running stats, eval mode uses the batch statistics too.
  const Tensor x = fx("batch_norm_2d", "x");
  CHECK(allclose(batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), false),
                 batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true), 0, 0));
}

TEST_CASE("batch_norm statistics stay accurate for data far from zero", "[ops][nn_functional]") {
  // Raw sums of x^2 in float32 would lose the variance of 1000 + N(0, 1) entirely.
  for (const Shape& s : {Shape{512, 4}, Shape{16, 4, 32}}) {
    const Tensor x = rnd(s, 31) + 1000.0;
    Tensor rm64 = zeros({4}, DType::Float64), rv64 = ones({4}, DType::Float64);
    Tensor rm32 = zeros({4}), rv32 = ones({4});
    const Tensor ref = batch_norm(x, rm64, rv64, Tensor(), Tensor(), true);
    const Tensor got = batch_norm(x.to(DType::Float32), rm32, rv32, Tensor(), Tensor(), true);
    CHECK(max_abs_diff(got, ref) < 2e-3);
    CHECK(allclose(rv32, rv64, 1e-3, 1e-4));
    CHECK(allclose(rm32, rm64, 1e-6, 1e-4));
  }
}

TEST_CASE("batch_norm gradients in training and eval", "[ops][nn_functional]") {
  for (const Shape& s : {Shape{5, 3}, Shape{3, 2, 4}}) {
    INFO("shape " << shape_str(s));
    const Tensor x = rnd(s, 7, 1.5), w = rnd({s[1]}, 8), b = rnd({s[1]}, 9);
    Tensor rm = rnd({s[1]}, 10, 0.1), rv = abs(rnd({s[1]}, 11)) + 0.5;
    CHECK(gradcheck(
        [](const std::vector<Tensor>& in) { return batch_norm(in[0], Tensor(), Tensor(), in[1], in[2], true); },
        {x, w, b}));
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return batch_norm(in[0], rm, rv, in[1], in[2], false); },
                       {x, w, b}));
    CHECK(gradcheck([](const std::vector<Tensor>& in) {
      return batch_norm(in[0], Tensor(), Tensor(), Tensor(), Tensor(), true);
    }, {x}));
  }
}

TEST_CASE("batch_norm checks its arguments", "[ops][nn_functional]") {
  REQUIRE_THROWS_WITH(batch_norm(zeros({2, 3, 4, 5}), Tensor(), Tensor(), Tensor(), Tensor(), true),
                      Catch::Contains("batch_norm") && Catch::Contains("[2, 3, 4, 5]"));
  REQUIRE_THROWS_AS(batch_norm(zeros({4, 3}), zeros({2}), ones({2}), Tensor(), Tensor(), true), ShapeError);
  REQUIRE_THROWS_WITH(batch_norm(zeros({1, 3}), Tensor(), Tensor(), Tensor(), Tensor(), true),
                      Catch::Contains("more than 1 value per channel"));
  // One value per channel is fine in eval with running stats.
  CHECK_NOTHROW(batch_norm(zeros({1, 3}), zeros({3}), ones({3}), Tensor(), Tensor(), false));
  // Under autocast batch_norm keeps its input's dtype, as PyTorch's autocast does (Note [Autocast policy]):
  // 16-bit stays 16-bit (float32 statistics inside), float32 stays float32.
  autocast::AutocastGuard guard(true, DType::Float16);
  CHECK(batch_norm(ones({4, 3}, DType::Float16), zeros({3}), ones({3}), Tensor(), Tensor(), true).dtype() ==
        DType::Float16);
  CHECK(batch_norm(ones({4, 3}), zeros({3}), ones({3}), Tensor(), Tensor(), true).dtype() == DType::Float32);
}

// ============================================================================================ dropout

TEST_CASE("dropout masks are seeded, scaled and kept for backward", "[ops][nn_functional]") {
  const Tensor x = ones({64, 50}, DType::Float64);
  Generator g1(42), g2(42), g3(43);
  const auto a = dropout(x, 0.3, true, &g1).tolist();
  const auto b = dropout(x, 0.3, true, &g2).tolist();
  const auto c = dropout(x, 0.3, true, &g3).tolist();
  CHECK(a == b);
  CHECK(a != c);
  // The mask is the generator's uniform floats in row-major order, kept where u >= p: the same on any
  // machine for a given seed.
  Generator ref(42);
  int64_t kept = 0;
  for (double v : a) {
    const bool keep = ref.uniform_float() >= 0.3f;
    REQUIRE(v == (keep ? 1.0 / 0.7 : 0.0));
    kept += keep;
  }
  // About 70% kept, and the mean is preserved in expectation.
  CHECK(double(kept) / double(a.size()) == Approx(0.7).margin(0.03));
  // Backward passes the same mask and scale.
  Generator g4(42);
  Tensor xr = rnd({64, 50}, 12).requires_grad_();
  Tensor y = dropout(xr, 0.3, true, &g4);
  y.backward(ones_like(y));
  CHECK(xr.grad().tolist() == a);
}

TEST_CASE("dropout edge cases", "[ops][nn_functional]") {
  const Tensor x = rnd({3, 4}, 13);
  CHECK(dropout(x, 0.0, true).is_same(x));
  CHECK(dropout(x, 0.7, false).is_same(x));
  CHECK(dropout(x, 1.0, true).tolist() == std::vector<double>(12, 0.0));
  REQUIRE_THROWS_WITH(dropout(x, 1.5, true), Catch::Contains("dropout") && Catch::Contains("1.5"));
  REQUIRE_THROWS_AS(dropout(x, -0.1, true), ValueError);
  // The default generator follows manual_seed.
  manual_seed(5);
  const auto a = dropout(x, 0.5, true).tolist();
  manual_seed(5);
  CHECK(dropout(x, 0.5, true).tolist() == a);
  CHECK(gradcheck([](const std::vector<Tensor>& in) {
    Generator g(9);
    return dropout(in[0], 0.4, true, &g);
  }, {x}));
}

// ========================================================================================== attention

TEST_CASE("scaled_dot_product_attention matches the explicit math", "[ops][nn_functional]") {
  const Tensor q = fx("attention", "q"), k = fx("attention", "k"), v = fx("attention", "v");
  CHECK(allclose(scaled_dot_product_attention(q, k, v), fx("attention", "out"), 1e-10, 1e-12));
  CHECK(allclose(scaled_dot_product_attention(q, k, v, false, 0.3), fx("attention", "out_scaled"), 1e-10, 1e-12));
  const Tensor qc = fx("attention_causal", "q"), kc = fx("attention_causal", "k"), vc = fx("attention_causal", "v");
  CHECK(allclose(scaled_dot_product_attention(qc, kc, vc, true), fx("attention_causal", "out"), 1e-10, 1e-12));
  // float32 through cblas_sgemm; float16 widened to float32 and rounded once.
  CHECK(allclose(scaled_dot_product_attention(q.to(DType::Float32), k.to(DType::Float32), v.to(DType::Float32)),
                 fx("attention", "out"), 1e-4, 1e-5));
  const Tensor h = scaled_dot_product_attention(q.to(DType::Float16), k.to(DType::Float16), v.to(DType::Float16));
  REQUIRE(h.dtype() == DType::Float16);
  CHECK(allclose(h, fx("attention", "out"), 1e-2, 1e-2));
  // Lower policy: float32 inputs under autocast compute and return the autocast dtype.
  autocast::AutocastGuard guard(true, DType::BFloat16);
  CHECK(scaled_dot_product_attention(q.to(DType::Float32), k.to(DType::Float32), v.to(DType::Float32)).dtype() ==
        DType::BFloat16);
}

TEST_CASE("scaled_dot_product_attention gradients, causal and not", "[ops][nn_functional]") {
  const Tensor q = rnd({2, 3, 4}, 14), k = rnd({2, 5, 4}, 15), v = rnd({2, 5, 3}, 16);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return scaled_dot_product_attention(in[0], in[1], in[2]); },
                     {q, k, v}));
  CHECK(gradcheck([](const std::vector<Tensor>& in) {
    return scaled_dot_product_attention(in[0], in[1], in[2], true, 0.7);
  }, {q, k, v}));
  const Tensor q4 = rnd({1, 2, 4, 3}, 17), k4 = rnd({1, 2, 4, 3}, 18), v4 = rnd({1, 2, 4, 2}, 19);
  CHECK(gradcheck([](const std::vector<Tensor>& in) {
    return scaled_dot_product_attention(in[0], in[1], in[2], true);
  }, {q4, k4, v4}));
}

TEST_CASE("scaled_dot_product_attention over many heads equals head by head", "[ops][nn_functional]") {
  // Enough work to split the heads across threads (with BLAS single-threaded meanwhile); each head
  // alone takes the serial path. The two must agree, forward and backward.
  const Tensor q = rnd({4, 3, 40, 16}, 40).to(DType::Float32), k = rnd({4, 3, 48, 16}, 41).to(DType::Float32),
               v = rnd({4, 3, 48, 24}, 42).to(DType::Float32);
  for (bool causal : {false, true}) {
    Tensor qa = q.detach().requires_grad_(), ka = k.detach().requires_grad_(), va = v.detach().requires_grad_();
    Tensor out = scaled_dot_product_attention(qa, ka, va, causal);
    out.backward(ones_like(out));
    for (int64_t b = 0; b < 4; ++b)
      for (int64_t h = 0; h < 3; ++h) {
        Tensor qh = q.select(0, b).select(0, h).contiguous().requires_grad_();
        Tensor kh = k.select(0, b).select(0, h).contiguous().requires_grad_();
        Tensor vh = v.select(0, b).select(0, h).contiguous().requires_grad_();
        Tensor oh = scaled_dot_product_attention(qh, kh, vh, causal);
        oh.backward(ones_like(oh));
        REQUIRE(allclose(out.select(0, b).select(0, h), oh, 1e-5, 1e-6));
        REQUIRE(allclose(qa.grad().select(0, b).select(0, h), qh.grad(), 1e-4, 1e-5));
        REQUIRE(allclose(ka.grad().select(0, b).select(0, h), kh.grad(), 1e-4, 1e-5));
        REQUIRE(allclose(va.grad().select(0, b).select(0, h), vh.grad(), 1e-4, 1e-5));
      }
  }
}

TEST_CASE("scaled_dot_product_attention checks shapes and dtypes", "[ops][nn_functional]") {
  REQUIRE_THROWS_WITH(scaled_dot_product_attention(zeros({2, 3, 4}), zeros({2, 5, 3}), zeros({2, 5, 3})),
                      Catch::Contains("scaled_dot_product_attention") && Catch::Contains("[2, 5, 3]"));
  REQUIRE_THROWS_AS(scaled_dot_product_attention(zeros({2, 3, 4}), zeros({2, 5, 4}), zeros({2, 6, 4})), ShapeError);
  REQUIRE_THROWS_AS(scaled_dot_product_attention(zeros({2, 3, 4}), zeros({3, 5, 4}), zeros({3, 5, 4})), ShapeError);
  REQUIRE_THROWS_AS(scaled_dot_product_attention(zeros({3, 4}), zeros({5, 4}, DType::Float64), zeros({5, 4})),
                    DTypeError);
}

// ============================================================================================= losses

TEST_CASE("reduction_from_string", "[ops][nn_functional]") {
  CHECK(reduction_from_string("none") == Reduction::None);
  CHECK(reduction_from_string("mean") == Reduction::Mean);
  CHECK(reduction_from_string("sum") == Reduction::Sum);
  REQUIRE_THROWS_AS(reduction_from_string("avg"), ValueError);
  REQUIRE_THROWS_WITH(reduction_from_string("avg"), Catch::Contains("avg") && Catch::Contains("'none'") &&
                                                        Catch::Contains("'mean'") && Catch::Contains("'sum'"));
}

TEST_CASE("cross_entropy matches PyTorch with ignore_index and label_smoothing", "[ops][nn_functional]") {
  const Tensor logits = fx("cross_entropy", "logits");
  const Tensor target = fx("cross_entropy", "target").to(DType::Int64);
  for (const char* red : {"none", "mean", "sum"}) {
    INFO(red);
    const Reduction r = reduction_from_string(red);
    CHECK(allclose(cross_entropy(logits, target, r), fx("cross_entropy", red), 1e-12, 1e-13));
    // The smoothed mean divides by the 5 non-ignored targets, not by 6.
    CHECK(allclose(cross_entropy(logits, target, r, -100, 0.1),
                   fx("cross_entropy", (std::string(red) + "_smooth").c_str()), 1e-12, 1e-13));
  }
  const Tensor l3 = fx("cross_entropy_nd", "logits"), t3 = fx("cross_entropy_nd", "target").to(DType::Int64);
  CHECK(allclose(cross_entropy(l3, t3), fx("cross_entropy_nd", "mean"), 1e-12, 1e-13));
  CHECK(allclose(cross_entropy(l3, t3, Reduction::None, -100, 0.2), fx("cross_entropy_nd", "none_smooth"), 1e-12,
                 1e-13));
  // float16 logits: computed in float32.
  CHECK(allclose(cross_entropy(logits.to(DType::Float16), target).to(DType::Float64), fx("cross_entropy", "mean"),
                 2e-3, 1e-3));
  autocast::AutocastGuard guard(true, DType::Float16);
  CHECK(cross_entropy(logits.to(DType::Float16), target).dtype() == DType::Float32);
}

TEST_CASE("cross_entropy gradients for every reduction", "[ops][nn_functional]") {
  const Tensor logits = rnd({5, 4}, 20, 2.0);
  const Tensor target = from_vector(std::vector<int64_t>{1, 3, 2, 3, 0}, {5});
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum})
    for (double smoothing : {0.0, 0.15}) {
      INFO("reduction " << int(r) << " smoothing " << smoothing);
      // ignore_index 3 drops two rows: their gradient must be zero and the mean divides by 3.
      CHECK(gradcheck([&](const std::vector<Tensor>& in) { return cross_entropy(in[0], target, r, 3, smoothing); },
                         {logits}));
    }
  const Tensor l3 = rnd({2, 3, 2, 2}, 21);
  const Tensor t3 = from_vector(std::vector<int64_t>{0, 2, 1, -100, 2, 2, 0, 1}, {2, 2, 2});
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return cross_entropy(in[0], t3, Reduction::Mean, -100, 0.1); },
                     {l3}));
  // An ignored row really gets a zero gradient.
  Tensor x = rnd({2, 3}, 22).requires_grad_();
  cross_entropy(x, from_vector(std::vector<int64_t>{-100, 1}, {2})).backward();
  const auto g = x.grad().tolist();
  CHECK(g[0] == 0.0);
  CHECK(g[1] == 0.0);
  CHECK(g[2] == 0.0);
  CHECK(g[4] < 0.0);
}

TEST_CASE("losses check targets and shapes", "[ops][nn_functional]") {
  const Tensor logits = zeros({2, 3});
  REQUIRE_THROWS_AS(cross_entropy(logits, from_vector(std::vector<int64_t>{0, 3}, {2})), IndexError);
  REQUIRE_THROWS_WITH(cross_entropy(logits, from_vector(std::vector<int64_t>{0, 7}, {2})),
                      Catch::Contains("cross_entropy") && Catch::Contains("target 7") && Catch::Contains("3 classes"));
  REQUIRE_THROWS_WITH(nll_loss(logits, from_vector(std::vector<int64_t>{-2, 0}, {2})),
                      Catch::Contains("nll_loss") && Catch::Contains("target -2"));
  REQUIRE_THROWS_AS(cross_entropy(logits, from_vector(std::vector<int64_t>{0, 1, 2}, {3})), ShapeError);
  REQUIRE_THROWS_AS(cross_entropy(logits, zeros({2})), DTypeError);
  REQUIRE_THROWS_AS(cross_entropy(logits, zeros({2}, DType::Int64), Reduction::Mean, -100, 1.5), ValueError);
  REQUIRE_THROWS_AS(mse_loss(zeros({2, 3}), zeros({4})), ShapeError);
}

TEST_CASE("nll_loss and mse_loss match PyTorch, with gradients", "[ops][nn_functional]") {
  const Tensor lp = fx("nll_loss", "log_probs"), t = fx("nll_loss", "target").to(DType::Int64);
  const Tensor a = fx("mse_loss", "input"), b = fx("mse_loss", "target");
  for (const char* red : {"none", "mean", "sum"}) {
    INFO(red);
    const Reduction r = reduction_from_string(red);
    CHECK(allclose(nll_loss(lp, t, r, 1), fx("nll_loss", red), 1e-12, 1e-13));
    CHECK(allclose(mse_loss(a, b, r), fx("mse_loss", red), 1e-12, 1e-13));
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return nll_loss(in[0], t, r, 1); }, {lp}));
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return mse_loss(in[0], in[1], r); }, {a, b}));
  }
  autocast::AutocastGuard guard(true, DType::Float16);
  CHECK(mse_loss(a.to(DType::Float16), b.to(DType::Float16)).dtype() == DType::Float32);
}

// ====================================================================================== 16-bit paths

namespace {
// Gradients of sum(w * f(x)) for the given inputs, as float64 values.
std::vector<std::vector<double>> grads_of(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                                          std::vector<Tensor> inputs, const Tensor& w) {
  for (auto& x : inputs) x = x.detach().clone().requires_grad_();
  Tensor out = f(inputs);
  out.backward(w.to(out.dtype()));
  std::vector<std::vector<double>> g;
  for (auto& x : inputs) g.push_back(x.grad().tolist());
  return g;
}
}  // namespace

TEST_CASE("float16 and bfloat16 backward kernels compute in float32", "[ops][nn_functional]") {
  using Fn = std::function<Tensor(const std::vector<Tensor>&)>;
  struct Case {
    const char* name;
    Fn f;
    std::vector<Tensor> inputs;
  };
  const std::vector<Case> cases = {
      {"softmax", [](const std::vector<Tensor>& x) { return softmax(x[0], 1); }, {rnd({4, 6, 3}, 50)}},
      {"log_softmax", [](const std::vector<Tensor>& x) { return log_softmax(x[0], -1); }, {rnd({4, 6}, 51)}},
      {"layer_norm", [](const std::vector<Tensor>& x) { return layer_norm(x[0], {6}, x[1], x[2]); },
       {rnd({4, 6}, 52), rnd({6}, 53), rnd({6}, 54)}},
      {"batch_norm", [](const std::vector<Tensor>& x) {
         return batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], true);
       }, {rnd({5, 3, 4}, 55), rnd({3}, 56), rnd({3}, 57)}},
      {"attention", [](const std::vector<Tensor>& x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); },
       {rnd({2, 5, 4}, 58), rnd({2, 5, 4}, 59), rnd({2, 5, 3}, 60)}},
      {"cross_entropy", [](const std::vector<Tensor>& x) {
         return cross_entropy(x[0], from_vector(std::vector<int64_t>{2, 0, -100, 1}, {4}), Reduction::Sum, -100, 0.1);
       }, {rnd({4, 3}, 61)}},
  };
  for (DType dt : {DType::Float16, DType::BFloat16}) {
    const double tol = dt == DType::Float16 ? 1e-2 : 5e-2;
    for (const Case& c : cases) {
      INFO(c.name << " in " << dt);
      // The same (rounded) values in float64 are the reference.
      std::vector<Tensor> low, ref;
      for (const Tensor& x : c.inputs) {
        low.push_back(x.to(dt));
        ref.push_back(x.to(dt).to(DType::Float64));
      }
      const Tensor out_ref = c.f(ref);
      const Tensor w = rnd(out_ref.shape(), 62);
      const auto g_low = grads_of(c.f, low, w.to(dt).to(DType::Float64));
      const auto g_ref = grads_of(c.f, ref, w.to(dt).to(DType::Float64));
      REQUIRE(c.f(low).dtype() == dt);
      for (size_t k = 0; k < g_ref.size(); ++k)
        for (size_t i = 0; i < g_ref[k].size(); ++i)
          REQUIRE(std::abs(g_low[k][i] - g_ref[k][i]) <= tol * (1 + std::abs(g_ref[k][i])));
    }
  }
}

TEST_CASE("cross_entropy takes a single unbatched row", "[ops][nn_functional]") {
  const Tensor logits = fx("cross_entropy", "logits");
  const Tensor target = fx("cross_entropy", "target").to(DType::Int64);
  // Row 3 of the fixture, alone: logits [C], target [].
  const Tensor one = cross_entropy(logits.select(0, 3), target.select(0, 3), Reduction::None);
  REQUIRE(one.dim() == 0);
  CHECK(one.item() == Approx(fx("cross_entropy", "none").tolist()[3]).epsilon(1e-12));
}

// ================================================================== large losses and norms, by hand

// Note [Reductions against a serial loop] (test_ops_math.cpp) for the losses' and layer_norm's
// per-thread partial sums: sizes past the parallel grain and odd, so the threads' shares differ, and
// references that are closed forms or loops written here.
TEST_CASE("large losses and layer_norm parameter gradients sum every thread's partial", "[ops][nn_functional]") {
  const double u32 = 0x1p-24;
  // Cross entropy of all-zero logits is log(C) on every row. Each row's loss rounds once in float32
  // and the rows are summed in double: the mean is within 2 * u32 of log(C), relative.
  const int64_t rows = 30001, classes = 10;
  std::vector<int64_t> labels(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) labels[size_t(i)] = i % classes;
  const Tensor target = from_vector(labels, {rows});
  CHECK(cross_entropy(zeros({rows, classes}), target).item() ==
        Approx(std::log(double(classes))).epsilon(2 * u32));
  CHECK(cross_entropy(zeros({rows, classes}), target, Reduction::Sum).item() ==
        Approx(double(rows) * std::log(double(classes))).epsilon(2 * u32));

  // MSE of differences that are small integers: every square and every partial sum is an exact float32
  // integer (below 2^24), so the sum is exact and the mean one division away (u32).
  const int64_t n = 155617;
  std::vector<float> a(static_cast<size_t>(n)), b(size_t(n), 0.0f);
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) {
    a[size_t(i)] = float((i * 7919) % 13 - 6);
    ss += double(a[size_t(i)]) * a[size_t(i)];
  }
  const Tensor ta = from_vector(a, {n}), tb = from_vector(b, {n});
  CHECK(mse_loss(ta, tb, Reduction::Sum).item() == ss);
  CHECK(mse_loss(ta, tb).item() == Approx(ss / double(n)).epsilon(u32));

  // layer_norm backward sums dweight and dbias over rows in per-thread partials. With every row the
  // same ramp 0..cols-1 and an upstream gradient of ones, dbias = rows (exact in float32) and
  // dweight[i] = rows * xhat[i], xhat computed here in double. xhat rounds once or twice in float32
  // (a few u32) and is added rows times: within (rows + 4) * u32 relative, the worst-case bound.
  const int64_t lrows = 20001, lcols = 37;
  std::vector<float> ramp;
  for (int64_t r = 0; r < lrows; ++r)
    for (int64_t i = 0; i < lcols; ++i) ramp.push_back(float(i));
  const Tensor x = from_vector(ramp, {lrows, lcols});
  Tensor w = ones({lcols}).requires_grad_(), bias = zeros({lcols}).requires_grad_();
  sum(layer_norm(x, {lcols}, w, bias)).backward();
  CHECK(bias.grad().tolist() == std::vector<double>(size_t(lcols), double(lrows)));
  const double mu = double(lcols - 1) / 2;
  double var = 0;
  for (int64_t i = 0; i < lcols; ++i) var += (double(i) - mu) * (double(i) - mu) / double(lcols);
  const auto dw = w.grad().tolist();
  for (int64_t i = 0; i < lcols; ++i) {
    const double xhat = (double(i) - mu) / std::sqrt(var + 1e-5);
    INFO("column " << i);
    CHECK(dw[size_t(i)] == Approx(double(lrows) * xhat).epsilon(double(lrows + 4) * u32));
  }
}

// ============================================================================================ NaN
// Note [NaN propagation] (backends/cpu/elementwise.cpp): every op treats NaN, inf and -0 as PyTorch
// does, forward and backward (tests/fixtures/nonfinite.json, made by make_nonfinite_fixtures.py).
// test_ops_nn runs again under each BOOSTER_CPU_ISA level, so every vectorized copy meets them.

namespace {

const nlohmann::json& nonfinite() {
  static const nlohmann::json j = testing::load_fixture_json("nonfinite.json");
  return j;
}
Tensor nf(const std::string& dtype, const std::string& name) {
  return tensor_from_json(nonfinite().at(dtype).at(name));
}

// Same shape and dtype; NaN exactly where `want` has NaN, the same infinities, the sign of every zero
// when `zero_sign` (forward values: relu(-0) is -0), the rest within atol + rtol |want|.
void check_nonfinite(const Tensor& got, const Tensor& want, double rtol, double atol, bool zero_sign = false) {
  INFO("got  " << got.str() << "\nwant " << want.str());
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.dtype() == want.dtype());
  const auto g = got.tolist(), w = want.tolist();
  for (size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i << ": got " << g[i] << ", want " << w[i]);
    if (std::isnan(w[i]) || std::isnan(g[i])) {
      CHECK(std::isnan(g[i]) == std::isnan(w[i]));
    } else if (std::isinf(w[i])) {
      CHECK(g[i] == w[i]);
    } else {
      CHECK(std::abs(g[i] - w[i]) <= atol + rtol * std::abs(w[i]));
      if (zero_sign && w[i] == 0.0) CHECK(std::signbit(g[i]) == std::signbit(w[i]));
    }
  }
}

struct Tol {
  double rtol, atol;
};
Tol tol_of(const std::string& dtype) { return dtype == "f32" ? Tol{2e-5, 1e-6} : Tol{1e-10, 1e-12}; }

using UnaryFn = std::function<Tensor(const Tensor&)>;
const std::vector<std::pair<std::string, UnaryFn>>& unary_ops() {
  static const std::vector<std::pair<std::string, UnaryFn>> ops = {
      {"relu", [](const Tensor& t) { return relu(t); }},
      {"gelu", [](const Tensor& t) { return gelu(t); }},
      {"gelu_tanh", [](const Tensor& t) { return gelu(t, "tanh"); }},
      {"silu", [](const Tensor& t) { return silu(t); }},
      {"tanh", [](const Tensor& t) { return booster::tanh(t); }},
      {"sigmoid", [](const Tensor& t) { return sigmoid(t); }},
      {"abs", [](const Tensor& t) { return booster::abs(t); }},
      {"clamp", [](const Tensor& t) { return clamp(t, -0.5, 0.5); }},
      {"clamp_min", [](const Tensor& t) { return clamp(t, -0.5, std::nullopt); }},
      {"clamp_max", [](const Tensor& t) { return clamp(t, std::nullopt, 0.5); }},
  };
  return ops;
}

}  // namespace

TEST_CASE("activations keep NaN, inf and -0 as PyTorch, forward and backward", "[ops][nonfinite]") {
  for (const std::string dt : {"f32", "f64"}) {
    const Tensor x = nf(dt, "x"), w = nf(dt, "w");
    const Tol t = tol_of(dt);
    for (const auto& [name, f] : unary_ops()) {
      INFO(dt << " " << name);
      Tensor xi = x.detach().requires_grad_();
      const Tensor y = f(xi);
      sum(mul(y, w)).backward();
      // The sign of a zero output is part of relu's, abs's and clamp's definitions (relu(-0) = -0,
      // abs(-0) = 0); the smooth activations' zeros may carry either sign.
      const bool zero_sign = name == "relu" || name == "abs" || name.rfind("clamp", 0) == 0;
      check_nonfinite(y, nf(dt, name), t.rtol, t.atol, zero_sign);
      check_nonfinite(xi.grad(), nf(dt, name + "_grad"), t.rtol, t.atol);
    }
  }
  // The exact ones in float16 and bfloat16 too (their kernels convert blocks to float32): the float32
  // references, rounded. The block paths need a run of contiguous elements, which these 70 are.
  for (DType d : {DType::Float16, DType::BFloat16}) {
    for (const std::string name : {"relu", "abs", "clamp", "clamp_min", "clamp_max"}) {
      INFO(d << " " << name);
      const UnaryFn& f = std::find_if(unary_ops().begin(), unary_ops().end(), [&](const auto& p) {
                           return p.first == name;
                         })->second;
      Tensor xi = nf("f32", "x").to(d).requires_grad_();
      const Tensor y = f(xi);
      sum(mul(y, nf("f32", "w").to(d))).backward();
      check_nonfinite(y, nf("f32", name).to(d), 0, 0, /*zero_sign=*/true);
      if (name != "abs") check_nonfinite(xi.grad(), nf("f32", name + "_grad").to(d), 0, 0);
    }
  }
}

TEST_CASE("maximum and minimum return NaN and pass the gradient to both sides of a NaN, as PyTorch",
          "[ops][nonfinite]") {
  for (const std::string dt : {"f32", "f64"}) {
    const Tensor a = nf(dt, "a"), b = nf(dt, "b"), w = nf(dt, "w");
    for (const std::string name : {"maximum", "minimum"}) {
      INFO(dt << " " << name);
      Tensor ai = a.detach().requires_grad_(), bi = b.detach().requires_grad_();
      const Tensor y = name == "maximum" ? maximum(ai, bi) : minimum(ai, bi);
      sum(mul(y, w)).backward();
      check_nonfinite(y, nf(dt, name), 0, 0, /*zero_sign=*/false);
      check_nonfinite(ai.grad(), nf(dt, name + "_grad_a"), 1e-15, 0);
      check_nonfinite(bi.grad(), nf(dt, name + "_grad_b"), 1e-15, 0);
    }
  }
  // Broadcast against one NaN: every output is NaN.
  const Tensor all = maximum(nf("f32", "x"), full({}, NAN, DType::Float32));
  for (double v : all.tolist()) CHECK(std::isnan(v));
  for (DType d : {DType::Float16, DType::BFloat16}) {
    INFO(d);
    check_nonfinite(maximum(nf("f32", "a").to(d), nf("f32", "b").to(d)), nf("f32", "maximum").to(d), 0, 0);
    check_nonfinite(minimum(nf("f32", "a").to(d), nf("f32", "b").to(d)), nf("f32", "minimum").to(d), 0, 0);
  }
}

TEST_CASE("max and argmax take NaN as the maximum, as PyTorch, with its gradients", "[ops][nonfinite]") {
  for (const std::string dt : {"f32", "f64"}) {
    INFO(dt);
    const Tensor m = nf(dt, "m"), w = nf(dt, "w");
    for (int64_t dim : {1, 0}) {
      INFO("dim " << dim);
      const std::string key = "max_" + std::to_string(dim);
      Tensor mi = m.detach().requires_grad_();
      const Tensor v = max(mi, dim);
      sum(mul(v, w.slice(0, 0, v.numel()))).backward();
      check_nonfinite(v, nf(dt, key + "_values"), 0, 0);
      CHECK(argmax(m, dim).tolist() == nf(dt, key + "_indices").tolist());
      check_nonfinite(mi.grad(), nf(dt, key + "_grad"), 0, 0);
    }
    CHECK(argmax(m, 1).tolist() == nf(dt, "argmax_1").tolist());
    Tensor mi = m.detach().requires_grad_();
    const Tensor all = max(mi);
    mul(all, 3.0).backward();
    check_nonfinite(all, nf(dt, "max_all"), 0, 0);
    check_nonfinite(mi.grad(), nf(dt, "max_all_grad"), 1e-15, 0);  // shared by the NaNs
  }
  // One long run, each dtype (the threaded full reduction, the 16-lane body, 16-bit blocks): a single
  // NaN anywhere makes the maximum NaN, wherever it sits.
  for (DType d : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16}) {
    for (int64_t at : {int64_t(0), int64_t(15), int64_t(4321), int64_t(4999)}) {
      INFO(d << ", NaN at " << at);
      std::vector<double> v(5000);
      for (size_t i = 0; i < v.size(); ++i) v[i] = double(int64_t(i * 7919 % 1000) - 500);
      v[size_t(at)] = NAN;
      const Tensor t = from_vector(v, {5000}).to(d);
      CHECK(std::isnan(max(t).item()));
      CHECK(std::isnan(max(t, 0).item()));
      CHECK(argmax(t, 0).item() == double(at));
      CHECK(std::isnan(max(t.reshape({50, 100}), 1).tolist()[size_t(at / 100)]));
      CHECK(std::isnan(max(t.reshape({50, 100}), 0).tolist()[size_t(at % 100)]));
    }
  }
}

TEST_CASE("max_pool2d propagates NaN, as PyTorch, with its gradients", "[ops][nonfinite]") {
  for (const std::string dt : {"f32", "f64"}) {
    INFO(dt);
    const Tensor x = nf(dt, "pool_x");
    Tensor xi = x.detach().requires_grad_();
    Tensor y = max_pool2d(xi, {2, 2});
    sum(mul(y, nf(dt, "pool_k2_w"))).backward();
    check_nonfinite(y, nf(dt, "pool_k2"), 0, 0);
    check_nonfinite(xi.grad(), nf(dt, "pool_k2_grad"), 0, 0);
    xi = x.detach().requires_grad_();
    y = max_pool2d(xi, {3, 3}, {2, 2}, {1, 1});
    sum(mul(y, nf(dt, "pool_k3_w"))).backward();
    check_nonfinite(y, nf(dt, "pool_k3"), 0, 0);
    check_nonfinite(xi.grad(), nf(dt, "pool_k3_grad"), tol_of(dt).rtol, tol_of(dt).atol);  // overlapping windows add
  }
  // A window with two NaNs: NaN out, and its gradient goes to one of the NaNs (the first; torch's
  // kernels pick the last: where a finite gradient lands inside a window whose output is NaN).
  Tensor x = from_vector(std::vector<float>{1, NAN, NAN, 2}, {1, 1, 2, 2}).requires_grad_();
  const Tensor y = max_pool2d(x, {2, 2});
  CHECK(std::isnan(y.item()));
  y.backward(full({1, 1, 1, 1}, 5.0));
  CHECK(x.grad().tolist() == std::vector<double>{0, 5, 0, 0});
}

TEST_CASE("softmax, log_softmax and cross_entropy propagate NaN and inf, as PyTorch", "[ops][nonfinite]") {
  for (const std::string dt : {"f32", "f64"}) {
    INFO(dt);
    const Tol t = tol_of(dt);
    const Tensor s = nf(dt, "s"), ws = nf(dt, "ws"), s3 = nf(dt, "s3"), ws3 = nf(dt, "ws3");
    for (const std::string name : {"softmax", "log_softmax"}) {
      INFO(name);
      const bool log = name == "log_softmax";
      Tensor si = s.detach().requires_grad_();
      Tensor y = log ? log_softmax(si, -1) : softmax(si, -1);
      sum(mul(y, ws)).backward();
      check_nonfinite(y, nf(dt, name), t.rtol, t.atol);
      check_nonfinite(si.grad(), nf(dt, name + "_grad"), t.rtol, t.atol);
      si = s3.detach().requires_grad_();  // over dim 1 of [2, 37, 5]: the lane-block loops
      y = log ? log_softmax(si, 1) : softmax(si, 1);
      sum(mul(y, ws3)).backward();
      check_nonfinite(y, nf(dt, name + "_dim1"), t.rtol, t.atol);
      check_nonfinite(si.grad(), nf(dt, name + "_dim1_grad"), t.rtol, t.atol);
    }
    const Tensor target = nf(dt, "ce_target");
    Tensor si = s.detach().requires_grad_();
    Tensor loss = cross_entropy(si, target, Reduction::None);
    sum(mul(loss, nf(dt, "w").slice(0, 0, 5))).backward();
    check_nonfinite(loss, nf(dt, "ce_none"), t.rtol, t.atol);
    check_nonfinite(si.grad(), nf(dt, "ce_none_grad"), t.rtol, t.atol);
    si = s.detach().requires_grad_();
    loss = cross_entropy(si, target);
    mul(loss, 2.0).backward();
    check_nonfinite(loss, nf(dt, "ce_mean"), t.rtol, t.atol);
    check_nonfinite(si.grad(), nf(dt, "ce_mean_grad"), t.rtol, t.atol);
    check_nonfinite(cross_entropy(s.slice(0, 0, 1), target.slice(0, 0, 1)), nf(dt, "ce_finite"), t.rtol, t.atol);
  }
}

// BatchNorm's float32 forward against float64 on the same float32 input, data far from zero (1000 +
// N(0, 1)): y = (x - mean) * rstd * w + b. Its error is the mean's and the variance's sums over the M
// values of a channel (Note [Roundoff bounds] 1: reduction_bound({M}) relative) plus three roundings,
// relative to |y| + 1. Folding it into x * scale + shift (scale = rstd * w) would round x * scale, about
// 1000 here, and lose u * 1000 = 6e-5 of every output, far above that bound.
TEST_CASE("batch_norm's float32 forward keeps float32 accuracy for data far from zero", "[ops][nn_functional]") {
  for (const Shape& s : {Shape{512, 4}, Shape{16, 4, 32}}) {
    const Tensor x = (rnd(s, 31) + 1000.0).to(DType::Float32);
    const int64_t M = s.size() == 2 ? s[0] : s[0] * s[2];
    const Tensor w = (rnd({4}, 32) + 2.0).to(DType::Float32), b = rnd({4}, 33).to(DType::Float32);
    Tensor rm64 = zeros({4}, DType::Float64), rv64 = ones({4}, DType::Float64), rm32 = zeros({4}), rv32 = ones({4});
    const Tensor ref = batch_norm(x.to(DType::Float64), rm64, rv64, w.to(DType::Float64), b.to(DType::Float64), true);
    const Tensor got = batch_norm(x, rm32, rv32, w, b, true);
    const std::vector<double> r = ref.tolist(), g = got.to(DType::Float64).tolist();
    const double u = std::ldexp(1.0, -24);
    // kLambda (6) spreads of u sqrt(M), as tests/roundoff.h's reduction_bound({M}), plus gamma_3.
    const double rel = 6.0 * u * std::sqrt(double(M)) + 3 * u / (1 - 3 * u);
    double worst = 0;
    for (size_t i = 0; i < r.size(); ++i) worst = std::max(worst, std::abs(g[i] - r[i]) / (rel * (std::abs(r[i]) + 3.0)));
    INFO("M " << M << ": worst error " << worst << " of the bound (relative " << rel << ")");
    CHECK(worst <= 1.0);
  }
}

// Batch statistics over M = 102,400 values per channel (both kernel layouts: x [M, C] and [N, C, L]),
// float32 against float64 on the same float32 input and output gradient. The per-channel sums
// accumulate in double (Note [Batch-norm sums in double]), so what is left is a few roundings of each
// result and of the saved float32 mean and rstd: bounds of a small multiple of u that do not grow with
// M. The float32 sums this replaced erred by up to 257 u on y and 259 u on dx here.
TEST_CASE("batch_norm's float32 statistics and gradients stay accurate at 100k values per channel",
          "[ops][nn_functional]") {
  const double u = std::ldexp(1.0, -24);
  for (const Shape& s : {Shape{102400, 3}, Shape{4, 3, 25600}}) {
    INFO("shape " << shape_str(s));
    const int64_t C = 3, L = s.size() == 2 ? 1 : s[2], N = s[0];
    const Tensor x32 = (rnd(s, 41, 1.5) + 0.5).to(DType::Float32), g32 = rnd(s, 42).to(DType::Float32);
    const Tensor w32 = (rnd({C}, 43) + 2.0).to(DType::Float32), b32 = rnd({C}, 44).to(DType::Float32);
    auto run = [&](DType dt) {
      Tensor x = x32.to(dt).requires_grad_(), w = w32.to(dt).requires_grad_(), b = b32.to(dt).requires_grad_();
      Tensor y = batch_norm(x, Tensor(), Tensor(), w, b, true);
      y.backward(g32.to(dt));
      std::vector<std::vector<double>> r;
      for (const Tensor& t : {y, x.grad(), w.grad(), b.grad()}) r.push_back(t.to(DType::Float64).flatten().tolist());
      return r;
    };
    const auto ref = run(DType::Float64), got = run(DType::Float32);
    // Scales the errors are measured against: |y| + 1 per element; max |dx|; sum |g xhat| and sum |g|.
    const std::vector<double> xs = x32.to(DType::Float64).flatten().tolist(), gs = g32.to(DType::Float64).flatten().tolist();
    std::vector<double> mean(C, 0), var(C, 0), sum_gxhat(C, 0), sum_g(C, 0);
    const auto channel = [&](size_t i) { return int64_t(i) / L % C; };
    for (size_t i = 0; i < xs.size(); ++i) mean[size_t(channel(i))] += xs[i] / double(N * L);
    for (size_t i = 0; i < xs.size(); ++i) var[size_t(channel(i))] += std::pow(xs[i] - mean[size_t(channel(i))], 2) / double(N * L);
    for (size_t i = 0; i < xs.size(); ++i) {
      const size_t c = size_t(channel(i));
      sum_gxhat[c] += std::abs(gs[i] * (xs[i] - mean[c]) / std::sqrt(var[c] + 1e-5));
      sum_g[c] += std::abs(gs[i]);
    }
    double err_y = 0, err_dx = 0, err_dw = 0, err_db = 0, max_dx = 0;
    for (double v : ref[1]) max_dx = std::max(max_dx, std::abs(v));
    for (size_t i = 0; i < ref[0].size(); ++i) {
      err_y = std::max(err_y, std::abs(got[0][i] - ref[0][i]) / (std::abs(ref[0][i]) + 1) / u);
      err_dx = std::max(err_dx, std::abs(got[1][i] - ref[1][i]) / max_dx / u);
    }
    for (size_t c = 0; c < size_t(C); ++c) {
      err_dw = std::max(err_dw, std::abs(got[2][c] - ref[2][c]) / sum_gxhat[c] / u);
      err_db = std::max(err_db, std::abs(got[3][c] - ref[3][c]) / sum_g[c] / u);
    }
    INFO("errors in u: y " << err_y << ", dx " << err_dx << ", dweight " << err_dw << ", dbias " << err_db);
    CHECK(err_y <= 8);
    CHECK(err_dx <= 8);
    // dweight and dbias are one rounding of a sum whose size, for random signs, is about sqrt(M) / M of
    // the sum of its terms' sizes: 0.005 u here (the float32 sums: up to 0.8 u).
    CHECK(err_dw <= 0.1);
    CHECK(err_db <= 0.1);
  }
}
