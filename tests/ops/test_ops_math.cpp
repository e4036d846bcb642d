// Reductions, linear algebra, joining and indexing: values against PyTorch (tests/fixtures/math.json,
// made by make_math_fixtures.py), gradients against finite differences, typed errors.
#include <catch2/catch.hpp>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/kernels/gemm.h"
#include "booster/ops/ops.h"
#include "fixture.h"
#include "gradcheck.h"

using namespace booster;
using testing::allclose;
using testing::gradcheck;
using testing::tensor_from_json;

namespace {

const nlohmann::json& fixtures() {
  static const nlohmann::json j = testing::load_fixture_json("math.json");
  return j;
}

Tensor fx(const std::string& c, const std::string& name) { return tensor_from_json(fixtures().at(c).at(name)); }

// Values and shape match the fixture (float32: relative 1e-5; float64: 1e-12).
void check_close(const Tensor& got, const Tensor& want, double rtol, double atol) {
  INFO("got " << got.str() << "\nwant " << want.str());
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.dtype() == want.dtype());
  REQUIRE(allclose(got, want, rtol, atol));
}

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

Tensor rn(const Shape& s, uint64_t seed) {
  Generator g(seed);
  return randn(s, &g, DType::Float64);
}

}  // namespace

// ------------------------------------------------------------------------------------------ reductions

TEST_CASE("reductions match PyTorch in float64 and float32", "[ops]") {
  for (const char* c : {"reduce_f64", "reduce_f32"}) {
    const bool f32 = std::string(c) == "reduce_f32";
    const double rtol = f32 ? 1e-5 : 1e-12, atol = f32 ? 1e-6 : 1e-12;
    INFO(c);
    Tensor x = fx(c, "x");
    check_close(sum(x), fx(c, "sum_all"), rtol, atol);
    check_close(sum(x, {0, 2}), fx(c, "sum_0_2"), rtol, atol);
    check_close(sum(x, {-1}, true), fx(c, "sum_m1_keep"), rtol, atol);
    check_close(sum(x, {0}), fx(c, "sum_0"), rtol, atol);
    check_close(mean(x, {1}), fx(c, "mean_1"), rtol, atol);
    check_close(mean(x), fx(c, "mean_all"), rtol, atol);
    check_close(var(x, {1}), fx(c, "var_1"), rtol, atol);
    check_close(var(x, {0, 2}, false, true), fx(c, "var_0_2_biased_keep"), rtol, atol);
    check_close(max(x, 1), fx(c, "max_1_values"), 0, 0);
    check_close(argmax(x, 1), fx(c, "max_1_indices"), 0, 0);
    check_close(max(x), fx(c, "max_all"), 0, 0);
    check_close(argmax(x, -1), fx(c, "argmax_m1"), 0, 0);
    Tensor xt = x.transpose(0, 2);
    check_close(sum(xt, {1}), fx(c, "xt_sum_1"), rtol, atol);
    check_close(sum(xt, {2}), fx(c, "xt_sum_2"), rtol, atol);
  }
}

TEST_CASE("bfloat16 sums and means accumulate in float32 and round once as PyTorch", "[ops]") {
  Tensor x = fx("reduce_bf16", "x");
  REQUIRE(x.dtype() == DType::BFloat16);
  // Exact equality: one rounding of a float32 sum agrees with PyTorch bit for bit on these sizes.
  check_close(sum(x, {0}), fx("reduce_bf16", "sum_0"), 0, 0);
  check_close(sum(x, {1}), fx("reduce_bf16", "sum_1"), 0, 0);
  check_close(mean(x, {1}), fx("reduce_bf16", "mean_1"), 0, 0);
}

TEST_CASE("float16 sums of many values accumulate in float32", "[ops]") {
  // Naive float16 accumulation sticks at 2048 (2048 + 1 rounds back to 2048).
  Tensor h = ones({4096}, DType::Float16);
  Tensor s = sum(h);
  REQUIRE(s.dtype() == DType::Float16);
  REQUIRE(s.item() == 4096.0);
  Tensor rows = ones({3, 4096}, DType::Float16);
  REQUIRE(sum(rows, {1}).tolist() == std::vector<double>{4096, 4096, 4096});
  Tensor cols = ones({4096, 3}, DType::Float16);
  REQUIRE(sum(cols, {0}).tolist() == std::vector<double>{4096, 4096, 4096});
  REQUIRE(mean(h).item() == 1.0);
}

TEST_CASE("sums of integers and bools are int64", "[ops]") {
  Tensor b = from_vector(std::vector<int64_t>{1, 0, 1, 1}, {2, 2}).to(DType::Bool);
  Tensor s = sum(b);
  REQUIRE(s.dtype() == DType::Int64);
  REQUIRE(s.item() == 3);
  Tensor i = from_vector(std::vector<int64_t>{2000000000, 2000000000}, {2}).to(DType::Int32);
  REQUIRE(sum(i).dtype() == DType::Int64);
  REQUIRE(sum(i).item<int64_t>() == 4000000000LL);  // would overflow int32
  REQUIRE(sum(b, {0}).tolist() == std::vector<double>{2, 1});
}

namespace {

// Note [Reductions against a serial loop]
// The parallel reductions are checked against plain loops written here and closed forms, never against
// the library's own kernels (which would hide a bug shared by both). The data are integers in
// [-7, -1] and [1, 7] from a hash of the index: every partial sum of fewer than 2^21 of them is an
// integer of magnitude below 2^24, so float32 adds them exactly in any order, the serial loop in double
// is the exact answer, and, with no zeros, dropping any element or any thread's partial changes it.
std::vector<double> hashed_integers(int64_t n, uint32_t salt) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint32_t h = uint32_t(i) * 2654435761u ^ salt;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    v[size_t(i)] = double(int(h % 7) + 1) * ((h >> 8) & 1 ? 1.0 : -1.0);
  }
  return v;
}

// 301 x 517 = 155617 elements: past cpu::kParallelGrain (32768) on every path, and odd, so two
// threads' chunks (77809 + 77808) differ and neither is a multiple of the 16 accumulator lanes.
constexpr int64_t kRows = 301, kCols = 517, kN = kRows * kCols;

}  // namespace

TEST_CASE("large sums, means and maxima over threads agree with a serial loop and closed forms", "[ops]") {
  // Closed forms: float32 holds every count here exactly.
  CHECK(sum(ones({kRows, kCols})).item() == double(kN));
  CHECK(sum(ones({kRows, kCols}), {1}).tolist() == std::vector<double>(size_t(kRows), double(kCols)));
  CHECK(sum(ones({kRows, kCols}), {0}).tolist() == std::vector<double>(size_t(kCols), double(kRows)));
  CHECK(sum(ones({kRows, kCols}).t(), {1}).tolist() == std::vector<double>(size_t(kCols), double(kRows)));
  // The arithmetic series 0 + 1 + ... + (n-1) = n(n-1)/2 in float64 (exact below 2^53), its mean
  // (n-1)/2 (an exact quotient), its maximum n-1 at the last element and its variance n(n+1)/12.
  const Tensor ramp = arange(0.0, double(kN), 1.0, DType::Float64);
  CHECK(sum(ramp).item() == double(kN) * double(kN - 1) / 2);
  CHECK(mean(ramp).item() == double(kN - 1) / 2);
  CHECK(max(ramp).item() == double(kN - 1));
  CHECK(argmax(ramp, 0).item() == double(kN - 1));
  // float64 two-pass variance: each of the n squared deviations and their running sum carries at most
  // n * u64 (u64 = 2^-53) relative error, about 2e-11 here.
  CHECK(var(ramp, {0}).item() == Approx(double(kN) * double(kN + 1) / 12).epsilon(double(kN) * 0x1p-53));

  const std::vector<double> v = hashed_integers(kN, 17);
  const Tensor x = from_vector(v, {kRows, kCols}, DType::Float32);
  double total = 0;
  std::vector<double> rows(size_t(kRows), 0.0), cols(size_t(kCols), 0.0);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kCols; ++c) {
      const double e = v[size_t(r * kCols + c)];
      total += e;
      rows[size_t(r)] += e;
      cols[size_t(c)] += e;
    }
  // Exact, whatever the order (Note [Reductions against a serial loop]): full, row, column, strided.
  CHECK(sum(x).item() == total);
  CHECK(sum(x, {1}).tolist() == rows);
  CHECK(sum(x, {0}).tolist() == cols);
  CHECK(sum(x.t(), {0}).tolist() == rows);
  CHECK(sum(x.t(), {1}).tolist() == cols);
  CHECK(sum(x, {0, 1}, true).reshape({1}).tolist() == std::vector<double>{total});
  // float16/bfloat16 inputs (the integers are exact there) accumulate in float32 and round once: the
  // result is within u = 2^-11 (float16) or 2^-8 (bfloat16) of the exact sum, relative.
  for (auto [dt, u] : {std::pair{DType::Float16, 0x1p-11}, std::pair{DType::BFloat16, 0x1p-8}}) {
    INFO(dtype_name(dt));
    const Tensor h = x.to(dt);
    CHECK(std::abs(sum(h).item() - total) <= u * std::abs(total));
    const auto got_rows = sum(h, {1}).tolist(), got_cols = sum(h, {0}).tolist();
    for (int64_t r = 0; r < kRows; ++r) CHECK(std::abs(got_rows[size_t(r)] - rows[size_t(r)]) <= u * std::abs(rows[size_t(r)]));
    for (int64_t c = 0; c < kCols; ++c) CHECK(std::abs(got_cols[size_t(c)] - cols[size_t(c)]) <= u * std::abs(cols[size_t(c)]));
  }
  // Means: the exact sum divided once in float32, so within u32 = 2^-24 of the exact quotient.
  const double u32 = 0x1p-24;
  CHECK(std::abs(mean(x).item() - total / double(kN)) <= u32 * std::abs(total / double(kN)));
  const auto mean_rows = mean(x, {1}).tolist(), mean_cols = mean(x, {0}).tolist();
  for (int64_t r = 0; r < kRows; ++r) {
    const double want = rows[size_t(r)] / double(kCols);
    CHECK(std::abs(mean_rows[size_t(r)] - want) <= u32 * std::abs(want));
  }
  for (int64_t c = 0; c < kCols; ++c) {
    const double want = cols[size_t(c)] / double(kRows);
    CHECK(std::abs(mean_cols[size_t(c)] - want) <= u32 * std::abs(want));
  }

  // Maxima and first argmax by a serial scan, with the overall maximum placed in the last thread's
  // tail (the last element) and, in a second tensor, at the very first element.
  for (int64_t at : {kN - 1, int64_t(0)}) {
    INFO("maximum at " << at);
    std::vector<double> w = v;
    w[size_t(at)] = 100;
    const Tensor y = from_vector(w, {kRows, kCols}, DType::Float32);
    CHECK(max(y).item() == 100);
    CHECK(max(y.reshape({kN})).item() == 100);
    CHECK(argmax(y.reshape({kN}), 0).item() == double(at));
    std::vector<double> row_max(size_t(kRows), -1e300), col_max(size_t(kCols), -1e300);
    std::vector<double> row_arg(size_t(kRows), 0), col_arg(size_t(kCols), 0);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < kCols; ++c) {
        const double e = w[size_t(r * kCols + c)];
        if (e > row_max[size_t(r)]) row_max[size_t(r)] = e, row_arg[size_t(r)] = double(c);
        if (e > col_max[size_t(c)]) col_max[size_t(c)] = e, col_arg[size_t(c)] = double(r);
      }
    CHECK(max(y, 1).tolist() == row_max);
    CHECK(max(y, 0).tolist() == col_max);
    CHECK(max(y.t(), 1).tolist() == col_max);
    CHECK(argmax(y, 1).tolist() == row_arg);
    CHECK(argmax(y, 0).tolist() == col_arg);
  }
  // A NaN anywhere, here in the last thread's tail, is the maximum.
  std::vector<double> w = v;
  w.back() = NAN;
  CHECK(std::isnan(max(from_vector(w, {kN}, DType::Float32)).item()));
}

TEST_CASE("large variances over threads agree with a two-pass serial loop", "[ops]") {
  const std::vector<double> v = hashed_integers(kN, 29);
  const Tensor x = from_vector(v, {kRows, kCols}, DType::Float32);
  // Reference: the two-pass formula in double over the same values.
  auto two_pass = [&](int64_t count, auto&& at) {
    double m = 0;
    for (int64_t i = 0; i < count; ++i) m += at(i);
    m /= double(count);
    double ss = 0;
    for (int64_t i = 0; i < count; ++i) ss += (at(i) - m) * (at(i) - m);
    return ss / double(count - 1);
  };
  // float32 two-pass over m elements: the mean (exact sum, one division), each deviation and its
  // square round once (3 u32), and a running sum of m non-negative terms adds at most m * u32
  // (the worst-case bound, whatever order the kernel adds in): (m + 3) * u32 relative.
  const double u32 = 0x1p-24;
  auto tol = [&](int64_t m) { return double(m + 3) * u32; };
  const double all = two_pass(kN, [&](int64_t i) { return v[size_t(i)]; });
  CHECK(var(x, {0, 1}).item() == Approx(all).epsilon(tol(kN)));
  const auto got_rows = var(x, {1}).tolist();
  for (int64_t r = 0; r < kRows; ++r)
    CHECK(got_rows[size_t(r)] ==
          Approx(two_pass(kCols, [&](int64_t i) { return v[size_t(r * kCols + i)]; })).epsilon(tol(kCols)));
  const auto got_cols = var(x, {0}).tolist();
  for (int64_t c = 0; c < kCols; ++c)
    CHECK(got_cols[size_t(c)] ==
          Approx(two_pass(kRows, [&](int64_t i) { return v[size_t(i * kCols + c)]; })).epsilon(tol(kRows)));
  // Over a 3-d tensor's first and last dims (a strided reduction), against the same loop.
  const Tensor x3 = x.reshape({7, 43, kCols});
  const auto got_mid = var(x3, {0, 2}).tolist();
  for (int64_t j = 0; j < 43; ++j)
    CHECK(got_mid[size_t(j)] == Approx(two_pass(7 * kCols, [&](int64_t i) {
                                   return v[size_t((i / kCols) * 43 * kCols + j * kCols + i % kCols)];
                                 })).epsilon(tol(7 * kCols)));
}

TEST_CASE("max and argmax pick the first maximum, NaN wins", "[ops]") {
  Tensor x = from_vector(std::vector<double>{1, 3, 3, 2, 5, 5}, {2, 3});
  REQUIRE(argmax(x, 1).tolist() == std::vector<double>{1, 1});
  REQUIRE(max(x, 1, true).shape() == Shape{2, 1});
  Tensor n = from_vector(std::vector<double>{1, NAN, 3}, {3});
  REQUIRE(std::isnan(max(n).item()));
  REQUIRE(std::isnan(max(n, 0).item()));
  REQUIRE(argmax(n, 0).item() == 1);
  // The first NaN is the argmax (torch.argmax); a later NaN does not move it.
  Tensor two_nans = from_vector(std::vector<double>{1, NAN, 3, NAN, 2}, {5});
  REQUIRE(argmax(two_nans, 0).item() == 1);
  REQUIRE(argmax(two_nans.to(DType::Float32), 0).item() == 1);
}

TEST_CASE("reduction gradients match finite differences", "[ops][autograd]") {
  Tensor x = rn({3, 4, 5}, 11);
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return sum(v[0]); }, {x}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return sum(v[0], {0, 2}); }, {x}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return sum(v[0], {-1}, true); }, {x}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return mean(v[0], {1}); }, {x}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return mean(v[0], {-2, 0}, true); }, {x}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return var(v[0], {1}); }, {x}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return var(v[0], {0, -1}, false, true); }, {x}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return max(v[0], 1); }, {x}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return max(v[0], -1, true); }, {x}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return max(v[0]); }, {x}));
  // Broadcasting backward (autograd::sum_to) runs through sum.
  Tensor b = rn({4, 1}, 12);
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return mul(v[0], v[1]); }, {x, b}));
}

TEST_CASE("max gradients go to the first maximum (dim) or split among ties (all)", "[ops][autograd]") {
  Tensor x = from_vector(std::vector<double>{2, 2, 1, 0, 3, 3}, {2, 3}).requires_grad_();
  max(x, 1).backward(ones({2}, DType::Float64));
  REQUIRE(x.grad().tolist() == std::vector<double>{1, 0, 0, 0, 1, 0});
  Tensor y = from_vector(std::vector<double>{3, 1, 3, 3}, {4}).requires_grad_();
  max(y).backward();
  auto g = y.grad().tolist();
  REQUIRE(g[0] == Approx(1.0 / 3));
  REQUIRE(g[1] == 0);
  REQUIRE(g[3] == Approx(1.0 / 3));
}

TEST_CASE("sum and mean under autocast run in float32", "[ops][amp]") {
  Tensor h = ones({8}, DType::Float16);
  autocast::AutocastGuard ac(true, DType::Float16);
  REQUIRE(sum(h).dtype() == DType::Float32);
  REQUIRE(mean(h).dtype() == DType::Float32);
}

TEST_CASE("reductions reject bad dims with typed errors naming the op", "[ops]") {
  Tensor x = zeros({2, 3});
  REQUIRE_THROWS_AS(sum(x, {2}), IndexError);
  REQUIRE_THROWS_WITH(sum(x, {-3}), Catch::Contains("sum") && Catch::Contains("-3"));
  REQUIRE_THROWS_WITH(sum(x, {1, -1}), Catch::Contains("sum") && Catch::Contains("more than once"));
  REQUIRE_THROWS_WITH(mean(x, {5}), Catch::Contains("mean"));
  REQUIRE_THROWS_WITH(max(x, 2), Catch::Contains("max"));
  REQUIRE_THROWS_WITH(argmax(x, -3), Catch::Contains("argmax"));
  REQUIRE_THROWS_WITH(var(x, {3}), Catch::Contains("var"));
  REQUIRE_THROWS_AS(max(zeros({0})), IndexError);
  REQUIRE_THROWS_AS(mean(zeros({2}, DType::Int64)), DTypeError);
}

// ------------------------------------------------------------------------------------------ linear algebra

TEST_CASE("matmul, linear and bmm match PyTorch in float64 and float32", "[ops]") {
  for (const char* c : {"linalg_f64", "linalg_f32"}) {
    const bool f32 = std::string(c) == "linalg_f32";
    const double rtol = f32 ? 1e-5 : 1e-12, atol = f32 ? 1e-5 : 1e-12;
    INFO(c);
    check_close(matmul(fx(c, "a3"), fx(c, "b2")), fx(c, "a3_b2"), rtol, atol);
    check_close(matmul(fx(c, "a4"), fx(c, "b3")), fx(c, "a4_b3"), rtol, atol);
    check_close(matmul(fx(c, "v4"), fx(c, "m45")), fx(c, "v4_m45"), rtol, atol);
    check_close(matmul(fx(c, "v4"), fx(c, "v4")), fx(c, "v4_v4"), rtol, atol);
    check_close(matmul(fx(c, "m45").t(), fx(c, "v4")), fx(c, "m45t_v4"), rtol, atol);
    check_close(linear(fx(c, "x"), fx(c, "w"), fx(c, "bias")), fx(c, "linear"), rtol, atol);
    check_close(linear(fx(c, "x"), fx(c, "w")), fx(c, "linear_nobias"), rtol, atol);
    check_close(bmm(fx(c, "ba"), fx(c, "bb")), fx(c, "bmm"), rtol, atol);
  }
}

TEST_CASE("bfloat16 matmul and linear round like PyTorch (within one bf16 ulp)", "[ops]") {
  const char* c = "linalg_bf16";
  auto within_one_ulp = [](const Tensor& got, const Tensor& want) {
    REQUIRE(got.dtype() == DType::BFloat16);
    REQUIRE(got.shape() == want.shape());
    auto g = got.tolist(), w = want.tolist();
    int exact = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      // One bf16 ulp at |w|: 2^(exponent - 7).
      const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::abs(w[i]), 1e-30)) - 7);
      INFO("element " << i << ": " << g[i] << " vs " << w[i]);
      REQUIRE(std::abs(g[i] - w[i]) <= ulp);
      exact += g[i] == w[i];
    }
    REQUIRE(exact >= int(g.size() * 9 / 10));  // rounding once from float32: nearly all bit-equal
  };
  within_one_ulp(matmul(fx(c, "a"), fx(c, "b")), fx(c, "ab"));
  within_one_ulp(linear(fx(c, "x"), fx(c, "w"), fx(c, "bias")), fx(c, "linear"));
  // Transposed operands take the BLAS transpose flags and give the same values.
  Tensor bt = fx(c, "b").t().contiguous().t();
  within_one_ulp(matmul(fx(c, "a"), bt), fx(c, "ab"));
}

TEST_CASE("float16 matmul accumulates in float32 and rounds once", "[ops]") {
  // 4096 products of 1 * 1: a float16 accumulator would stop at 2048.
  Tensor a = ones({2, 4096}, DType::Float16), b = ones({4096, 3}, DType::Float16);
  REQUIRE(matmul(a, b).tolist() == std::vector<double>(6, 4096.0));
}

TEST_CASE("matmul handles transposed, sliced and broadcast operands", "[ops]") {
  Tensor a = rn({3, 5, 4}, 21), b = rn({4, 6}, 22);
  Tensor ref = matmul(a.contiguous(), b.contiguous());
  // Transposed storage for both (BLAS flags), and a strided slice (copied).
  Tensor at = a.transpose(1, 2).contiguous().transpose(1, 2);
  Tensor bt = b.t().contiguous().t();
  REQUIRE(allclose(matmul(at, bt), ref, 1e-12, 1e-12));
  Tensor wide = rn({4, 12}, 23);
  Tensor sliced = wide.slice(1, 0, 12, 2);
  REQUIRE(allclose(matmul(a, sliced), matmul(a, sliced.contiguous()), 1e-12, 1e-12));
  // Broadcast batch dims: [2, 1, 5, 4] @ [3, 4, 6] -> [2, 3, 5, 6].
  Tensor a4 = rn({2, 1, 5, 4}, 24), b3 = rn({3, 4, 6}, 25);
  Tensor o = matmul(a4, b3);
  REQUIRE(o.shape() == Shape{2, 3, 5, 6});
  REQUIRE(allclose(o.select(0, 1).select(0, 2), matmul(a4.select(0, 1).select(0, 0), b3.select(0, 2)), 1e-12, 1e-12));
  // 2-D @ batched.
  Tensor m = rn({5, 4}, 26);
  REQUIRE(allclose(matmul(m, b3).select(0, 1), matmul(m, b3.select(0, 1)), 1e-12, 1e-12));
}

TEST_CASE("gemm kernel honours trans flags, alpha, beta and broadcast batches", "[ops]") {
  // C = alpha op(A) op(B) + beta C, checked against matmul of explicitly transposed copies.
  for (DType dt : {DType::Float64, DType::Float32, DType::BFloat16}) {
    INFO(dt);
    Tensor a = rn({2, 4, 3}, 81).to(dt), b = rn({1, 5, 4}, 82).to(dt), c0 = rn({2, 3, 5}, 83).to(dt);
    Tensor b_bcast = b.expand({2, 5, 4});  // batch stride 0
    Tensor c = c0.clone();
    kernels::GemmArgs args;
    args.trans_a = true;
    args.trans_b = true;
    args.alpha = 0.5;
    args.beta = 2.0;
    kernels::gemm_kernel(Device::cpu())(args, a, b_bcast, c);
    Tensor ref = add(mul(matmul(a.to(DType::Float64).transpose(1, 2), b_bcast.to(DType::Float64).transpose(1, 2)), 0.5),
                     mul(c0.to(DType::Float64), 2.0));
    const double tol = dt == DType::BFloat16 ? 2e-2 : 1e-5;
    REQUIRE(allclose(c.to(DType::Float64), ref, tol, tol));
  }
}

TEST_CASE("linear and matmul accept non-contiguous inputs", "[ops]") {
  Tensor x = rn({4, 3, 5}, 91).transpose(0, 1);  // [3, 4, 5], not viewable as [12, 5]
  Tensor w = rn({6, 5}, 92), b = rn({6}, 93);
  REQUIRE(allclose(linear(x, w, b), linear(x.contiguous(), w, b), 1e-12, 1e-12));
  REQUIRE(allclose(linear(x, w.t().contiguous().t(), b), linear(x.contiguous(), w, b), 1e-12, 1e-12));
  REQUIRE(allclose(matmul(x, w.t()), matmul(x.contiguous(), w.t().contiguous()), 1e-12, 1e-12));
}

TEST_CASE("matmul of attention-style permuted batch dims matches the contiguous result", "[ops]") {
  // [B, T, H, D] viewed as [B, H, T, D]: the batch dims have no single stride.
  Tensor x = rn({2, 5, 3, 4}, 95), y = rn({2, 5, 3, 4}, 96);
  Tensor q = x.transpose(1, 2), k = y.transpose(1, 2);
  Tensor scores = matmul(q, k.transpose(-1, -2));
  REQUIRE(scores.shape() == Shape{2, 3, 5, 5});
  REQUIRE(allclose(scores, matmul(q.contiguous(), k.contiguous().transpose(-1, -2).contiguous()), 1e-12, 1e-12));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return matmul(v[0].transpose(1, 2), v[1].permute({0, 2, 3, 1})); },
                    {x, y}));
}

TEST_CASE("linear algebra gradients match finite differences", "[ops][autograd]") {
  Tensor a3 = rn({2, 3, 4}, 31), b2 = rn({4, 5}, 32), b3 = rn({2, 4, 5}, 33);
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); }, {a3, b2}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); }, {a3, b3}));
  // Broadcasting batch dims: gradients are summed over the broadcast dims.
  Tensor a4 = rn({2, 1, 3, 4}, 34), b31 = rn({3, 4, 2}, 35);
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); }, {a4, b31}));
  Tensor m = rn({3, 4}, 36);
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); }, {m, b3}));
  // 1-D operands.
  Tensor v4 = rn({4}, 37);
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); }, {v4, b2}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); }, {a3, v4}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); }, {v4, v4}));
  // Transposed operands through the BLAS flags.
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return matmul(v[0].t(), v[1].t()); }, {rn({4, 3}, 38), rn({5, 4}, 39)}));
  Tensor x = rn({2, 3, 4}, 40), w = rn({5, 4}, 41), bias = rn({5}, 42);
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return linear(v[0], v[1], v[2]); }, {x, w, bias}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return linear(v[0], v[1]); }, {rn({4}, 43), w}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return bmm(v[0], v[1]); }, {rn({3, 2, 4}, 44), rn({3, 4, 5}, 45)}));
}

TEST_CASE("linear under autocast runs in the autocast dtype", "[ops][amp]") {
  Tensor x = rn({4, 8}, 50).to(DType::Float32), w = rn({3, 8}, 51).to(DType::Float32).requires_grad_();
  Tensor b = zeros({3}).requires_grad_();
  Tensor y;
  {
    autocast::AutocastGuard ac(true, DType::BFloat16);
    y = linear(x, w, b);
  }
  REQUIRE(y.dtype() == DType::BFloat16);
  sum(y.to(DType::Float32)).backward();
  REQUIRE(w.grad().dtype() == DType::Float32);
  REQUIRE(b.grad().tolist() == std::vector<double>{4, 4, 4});
}

TEST_CASE("linear algebra shape errors name the op and both shapes", "[ops]") {
  REQUIRE_THROWS_WITH(matmul(zeros({2, 3}), zeros({4, 5})),
                      "matmul: shapes [2, 3] and [4, 5] cannot be multiplied (3 != 4)");
  REQUIRE_THROWS_AS(matmul(zeros({2, 2, 3}), zeros({3, 3, 2})), ShapeError);  // batch 2 vs 3
  REQUIRE_THROWS_AS(matmul(zeros({}), zeros({3})), ShapeError);
  REQUIRE_THROWS_AS(matmul(zeros({2, 3}), zeros({3, 2}, DType::Float64)), DTypeError);
  REQUIRE_THROWS_WITH(linear(zeros({2, 3}), zeros({4, 5})),
                      Catch::Contains("linear") && Catch::Contains("[2, 3]") && Catch::Contains("[4, 5]"));
  REQUIRE_THROWS_WITH(linear(zeros({2, 5}), zeros({4, 5}), zeros({3})), Catch::Contains("linear: bias"));
  REQUIRE_THROWS_WITH(bmm(zeros({2, 2, 3}), zeros({3, 3, 2})), Catch::Contains("bmm"));
  REQUIRE_THROWS_WITH(bmm(zeros({2, 3}), zeros({3, 2})), Catch::Contains("bmm: expected 3-D"));
}

// ------------------------------------------------------------------------------------------ joining and indexing

TEST_CASE("joining and indexing match PyTorch", "[ops]") {
  const char* c = "indexing";
  Tensor p = fx(c, "p"), q = fx(c, "q");
  check_close(cat({p, q}, 1), fx(c, "cat_1"), 0, 0);
  check_close(stack({p, mul(p, 2.0)}, -1), fx(c, "stack_m1"), 0, 0);
  check_close(embedding(fx(c, "weight"), fx(c, "ids")), fx(c, "embedding"), 0, 0);
  check_close(gather(fx(c, "g_src"), 1, fx(c, "g_idx")), fx(c, "gather_1"), 0, 0);
  check_close(index_select(fx(c, "g_src"), 1, fx(c, "sel_idx")), fx(c, "index_select_1"), 0, 0);
  // int32 indices select the same rows.
  check_close(embedding(fx(c, "weight"), fx(c, "ids").to(DType::Int32)), fx(c, "embedding"), 0, 0);
}

TEST_CASE("cat promotes dtypes, skips empty 1-D tensors, and works on non-contiguous inputs", "[ops]") {
  Tensor a = from_vector(std::vector<float>{1, 2}, {1, 2});
  Tensor b = from_vector(std::vector<double>{3, 4}, {1, 2});
  Tensor c = cat({a, b});
  REQUIRE(c.dtype() == DType::Float64);
  REQUIRE(c.tolist() == std::vector<double>{1, 2, 3, 4});
  REQUIRE(cat({zeros({0}), a}, 0).tolist() == std::vector<double>{1, 2});
  Tensor t = arange(0, 6, 1, DType::Float32).reshape({2, 3}).t();  // [3, 2], non-contiguous
  REQUIRE(cat({t, t}, 1).tolist() == std::vector<double>{0, 3, 0, 3, 1, 4, 1, 4, 2, 5, 2, 5});
  Tensor h = ones({2}, DType::Float16), f = ones({2}, DType::BFloat16);
  REQUIRE(cat({h, f}).dtype() == DType::Float32);
}

TEST_CASE("split and chunk are views with torch's piece sizes", "[ops]") {
  Tensor a = arange(0, 10, 1, DType::Float32).reshape({5, 2});
  auto s = split(a, 2);
  REQUIRE(s.size() == 3);
  REQUIRE(s[2].shape() == Shape{1, 2});
  REQUIRE(s[1].tolist() == std::vector<double>{4, 5, 6, 7});
  REQUIRE(s[1].storage() == a.storage());
  auto c = chunk(a, 3, 0);  // ceil(5 / 3) = 2 -> sizes 2, 2, 1
  REQUIRE(c.size() == 3);
  REQUIRE(c[2].shape() == Shape{1, 2});
  auto c4 = chunk(arange(0, 6, 1, DType::Float32), 4);  // ceil(6 / 4) = 2 -> only 3 pieces, as torch
  REQUIRE(c4.size() == 3);
  auto cols = chunk(a, 2, -1);
  REQUIRE(cols[1].tolist() == std::vector<double>{1, 3, 5, 7, 9});
}

TEST_CASE("joining and indexing gradients match finite differences", "[ops][autograd]") {
  Tensor a = rn({2, 3}, 61), b = rn({2, 1}, 62), c = rn({2, 3}, 63);
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return cat({v[0], v[1]}, -1); }, {a, b}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return cat({v[0], v[1]}, 0); }, {a, c}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return stack({v[0], v[1]}, 1); }, {a, c}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) { return mul(split(v[0], 2, 1)[1], 3.0); }, {a}));
  REQUIRE(gradcheck([](const std::vector<Tensor>& v) {
    auto p = chunk(v[0], 3, -1);
    return add(mul(p[0], p[2]), p[1]);
  }, {a}));
  Tensor ids = from_vector(std::vector<int64_t>{1, 4, 1, 0, 4, 4}, {2, 3});  // repeats must accumulate
  REQUIRE(gradcheck([ids](const std::vector<Tensor>& v) { return embedding(v[0], ids); }, {rn({5, 3}, 64)}));
  Tensor gi = from_vector(std::vector<int64_t>{0, 2, 2, 1, 1, 0}, {2, 3});
  REQUIRE(gradcheck([gi](const std::vector<Tensor>& v) { return gather(v[0], 1, gi); }, {rn({2, 4}, 65)}));
  Tensor gi0 = from_vector(std::vector<int64_t>{2, 0, 2}, {1, 3});
  REQUIRE(gradcheck([gi0](const std::vector<Tensor>& v) { return gather(v[0], -2, gi0); }, {rn({3, 3}, 66)}));
  Tensor si = from_vector(std::vector<int64_t>{2, 0, 2}, {3});
  REQUIRE(gradcheck([si](const std::vector<Tensor>& v) { return index_select(v[0], -1, si); }, {rn({2, 3, 4}, 67)}));
  REQUIRE(gradcheck([si](const std::vector<Tensor>& v) { return index_select(v[0], 0, si); }, {rn({4, 2}, 68)}));
}

TEST_CASE("embedding gradients of repeated rows accumulate in the weight's dtype", "[ops][autograd]") {
  Tensor w = zeros({3, 2}, DType::BFloat16).requires_grad_();
  Tensor ids = from_vector(std::vector<int64_t>(300, 1), {300});
  sum(embedding(w, ids)).backward();
  REQUIRE(w.grad().dtype() == DType::BFloat16);
  // 300 ones accumulated in float32 then rounded (bf16 accumulation would stop at 256).
  REQUIRE(w.grad().tolist() == std::vector<double>{0, 0, 300, 300, 0, 0});
}

TEST_CASE("joining and indexing reject bad shapes and indices with typed errors", "[ops]") {
  Tensor w = zeros({7, 3});
  REQUIRE_THROWS_AS(embedding(w, from_vector(std::vector<int64_t>{0, 7}, {2})), IndexError);
  REQUIRE_THROWS_WITH(embedding(w, from_vector(std::vector<int64_t>{0, 7}, {2})),
                      Catch::Contains("embedding") && Catch::Contains("index 7") && Catch::Contains("size 7"));
  REQUIRE_THROWS_WITH(embedding(w, from_vector(std::vector<int64_t>{-1}, {1})), Catch::Contains("index -1"));
  REQUIRE_THROWS_AS(embedding(w, zeros({2})), DTypeError);
  REQUIRE_THROWS_AS(embedding(zeros({7}), from_vector(std::vector<int64_t>{0}, {1})), ShapeError);
  REQUIRE_THROWS_WITH(cat({zeros({2, 3}), zeros({3, 3})}, 1), Catch::Contains("cat") && Catch::Contains("[3, 3]"));
  REQUIRE_THROWS_AS(cat({}, 0), ValueError);
  REQUIRE_THROWS_AS(cat({zeros({2})}, 1), IndexError);
  REQUIRE_THROWS_WITH(stack({zeros({2}), zeros({3})}), Catch::Contains("stack"));
  REQUIRE_THROWS_WITH(gather(zeros({2, 3}), 1, from_vector(std::vector<int64_t>{3}, {1, 1})),
                      Catch::Contains("gather") && Catch::Contains("index 3"));
  REQUIRE_THROWS_AS(gather(zeros({2, 3}), 1, from_vector(std::vector<int64_t>{0}, {1})), ShapeError);
  REQUIRE_THROWS_AS(gather(zeros({2, 3}), 2, from_vector(std::vector<int64_t>{0}, {1, 1})), IndexError);
  REQUIRE_THROWS_WITH(index_select(zeros({2, 3}), 0, from_vector(std::vector<int64_t>{2}, {1})),
                      Catch::Contains("index_select") && Catch::Contains("index 2"));
  REQUIRE_THROWS_AS(split(zeros({4}), 0), ValueError);
  REQUIRE_THROWS_AS(chunk(zeros({4}), 0), ValueError);
}

TEST_CASE("empty operands give empty or zero results", "[ops]") {
  REQUIRE(matmul(zeros({2, 3, 0}), zeros({0, 4})).tolist() == std::vector<double>(24, 0.0));
  REQUIRE(linear(zeros({0, 5}), zeros({3, 5}), zeros({3})).shape() == Shape{0, 3});
  REQUIRE(sum(zeros({0, 3}), {0}).tolist() == std::vector<double>{0, 0, 0});
  REQUIRE(sum(zeros({3, 0}), {1}).tolist() == std::vector<double>{0, 0, 0});
  REQUIRE(cat({zeros({0, 2}), ones({1, 2})}).tolist() == std::vector<double>{1, 1});
}

TEST_CASE("matmul of strided vectors (rows and columns of a matrix)", "[ops]") {
  Tensor m = rn({4, 5}, 97), w = rn({4, 3}, 98);
  Tensor col = m.select(1, 2);  // stride 5
  REQUIRE(allclose(matmul(col, w), matmul(col.contiguous(), w), 1e-12, 1e-12));
  Tensor w2 = rn({3, 4}, 99);
  REQUIRE(allclose(matmul(w2, col), matmul(w2, col.contiguous()), 1e-12, 1e-12));
  REQUIRE(matmul(col, col).item() == Approx(matmul(col.contiguous(), col.contiguous()).item()));
}
