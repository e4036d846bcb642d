// Tensor basics: geometry, views, dtype conversion, creation, printing, autograd through views.
#include <catch2/catch.hpp>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"

using namespace booster;

TEST_CASE("views share storage and keep geometry", "[tensor]") {
  Tensor a = arange(0, 24, 1, DType::Float32).reshape({2, 3, 4});
  REQUIRE(a.shape() == Shape{2, 3, 4});
  REQUIRE(a.strides() == Shape{12, 4, 1});
  Tensor t = a.transpose(0, 2);
  REQUIRE(t.shape() == Shape{4, 3, 2});
  REQUIRE_FALSE(t.is_contiguous());
  REQUIRE(t.contiguous().is_contiguous());
  REQUIRE(t.select(0, 1).select(0, 2).select(0, 1).item() == Approx(12 + 8 + 1));
  Tensor s = a.slice(2, 1, 4, 2);  // columns 1 and 3
  REQUIRE(s.shape() == Shape{2, 3, 2});
  REQUIRE(s.contiguous().tolist()[1] == 3.0);
  REQUIRE(a.permute({2, 0, 1}).shape() == Shape{4, 2, 3});
  REQUIRE(a.unsqueeze(1).shape() == Shape{2, 1, 3, 4});
  REQUIRE(a.unsqueeze(-1).shape() == Shape{2, 3, 4, 1});
  REQUIRE(a.unsqueeze(1).squeeze(1).shape() == Shape{2, 3, 4});
  REQUIRE(a.flatten(1).shape() == Shape{2, 12});
  REQUIRE(a.view({-1, 4}).shape() == Shape{6, 4});
  Tensor e = from_vector(std::vector<float>{1, 2, 3}, {3, 1}).expand({3, 4});
  REQUIRE(e.strides() == Shape{1, 0});
  REQUIRE(e.contiguous().tolist() == std::vector<double>{1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3});
  // A transposed tensor cannot be viewed flat; reshape copies.
  REQUIRE_THROWS_AS(t.view({24}), ShapeError);
  REQUIRE(t.reshape({24}).numel() == 24);
}

TEST_CASE("bad dims and shapes throw typed errors naming the op", "[tensor]") {
  Tensor a = zeros({2, 3});
  REQUIRE_THROWS_WITH(a.transpose(0, 2), Catch::Contains("transpose") && Catch::Contains("out of range"));
  REQUIRE_THROWS_AS(a.view({4, 2}), ShapeError);
  REQUIRE_THROWS_AS(a.expand({3, 3}), ShapeError);
  REQUIRE_THROWS_AS(a.narrow(1, 2, 2), IndexError);
  REQUIRE_THROWS_AS(a.item(), ShapeError);
  REQUIRE_THROWS_AS(a.data<double>(), DTypeError);
}

TEST_CASE("dtype conversion rounds and keeps values", "[tensor]") {
  Tensor a = from_vector(std::vector<double>{1.0, 1.0 + 1.0 / 4096, 65504.0, 70000.0, -2.5}, {5});
  Tensor h = a.to(DType::Float16);
  auto v = h.tolist();
  REQUIRE(v[0] == 1.0);
  REQUIRE(v[1] == 1.0);  // tie rounds to even
  REQUIRE(v[2] == 65504.0);
  REQUIRE(std::isinf(v[3]));
  REQUIRE(v[4] == -2.5);
  auto b = a.to(DType::BFloat16).tolist();
  REQUIRE(b[2] == 65536.0);
  REQUIRE(a.to(DType::Int64).tolist()[4] == -2.0);
  REQUIRE(a.to(DType::Bool).tolist() == std::vector<double>{1, 1, 1, 1, 1});
}

TEST_CASE("seeded generators repeat", "[tensor]") {
  Generator g1(42), g2(42);
  Tensor a = randn({100}, &g1), b = randn({100}, &g2);
  REQUIRE(a.tolist() == b.tolist());
  Tensor r = randint(0, 10, {1000}, &g1);
  auto rv = r.tolist();
  REQUIRE(*std::min_element(rv.begin(), rv.end()) == 0);
  REQUIRE(*std::max_element(rv.begin(), rv.end()) == 9);
  Tensor u = rand({10000}, &g1);
  auto uv = u.tolist();
  double m = 0;
  for (double x : uv) m += x;
  REQUIRE(m / 10000 == Approx(0.5).margin(0.02));
}

// The first raw number of `g`'s next draw made to be `out` (xoshiro256**'s output, rotl(s1 * 5, 7) * 9,
// inverted), so that a first uniform of exactly 0, which normal() redraws, comes up on purpose.
static void force_next_output(Generator& g, uint64_t out) {
  auto inverse = [](uint64_t a) {  // of an odd a modulo 2^64, by Newton's iteration
    uint64_t x = a;
    for (int i = 0; i < 6; ++i) x *= 2 - a * x;
    return x;
  };
  const uint64_t r = out * inverse(9);
  std::vector<uint64_t> st = g.state();
  st[2] = ((r >> 7) | (r << 57)) * inverse(5);
  g.set_state(st);
}

TEST_CASE("skipping draws leaves the generator where drawing them would", "[tensor]") {
  for (int64_t n : {0, 1, 2, 3, 4, 5, 7, 64, 1001}) {
    for (bool spare : {false, true}) {
      for (bool zero_first : {false, true}) {
        Generator a(7);
        if (spare) a.normal();
        if (zero_first) force_next_output(a, 5);  // top 53 bits zero: the first uniform is 0.0
        Generator b = a, c = a, d = a;
        for (int64_t i = 0; i < n; ++i) a.normal();
        b.skip_normal(n);
        INFO("n " << n << " spare " << spare << " zero first " << zero_first);
        REQUIRE(a.state() == b.state());
        REQUIRE(a.normal() == b.normal());
        for (int64_t i = 0; i < n; ++i) c.uniform();
        d.skip_uniform(n);
        REQUIRE(c.state() == d.state());
      }
    }
  }
  // The redraw is really taken: the crafted number is the generator's next output.
  Generator g(3);
  force_next_output(g, 5);
  Generator h = g;
  REQUIRE(h.next_u64() == 5);
}

TEST_CASE("autograd through elementwise ops and views", "[tensor][autograd]") {
  Tensor x = from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2}).requires_grad_();
  Tensor y = log(exp(x * x + x.t() * 2.0));  // y = x^2 + 2 x^T
  Tensor g = ones({2, 2});
  y.backward(g);
  // dy/dx summed: 2x + 2 (from the transpose, each element once)
  REQUIRE(x.grad().tolist() == std::vector<double>{4, 6, 8, 10});
  REQUIRE_THROWS_AS(y.backward(g), AutogradError);  // graph freed
  REQUIRE_THROWS_WITH(x.mul_(2.0), Catch::Contains("in-place"));
}

TEST_CASE("printing", "[tensor]") {
  Tensor a = from_vector(std::vector<float>{1.5, -2}, {2});
  REQUIRE(a.str() == "tensor([1.5, -2])");
  REQUIRE(a.to(DType::Float16).str() == "tensor([1.5, -2], dtype=float16)");
}

TEST_CASE("0-d tensors view and reshape to any one-element shape", "[tensor]") {
  Tensor s = full({}, 3.5);
  REQUIRE(s.reshape({1}).shape() == Shape{1});
  REQUIRE(s.view({1, 1}).shape() == Shape{1, 1});
  REQUIRE(s.flatten().shape() == Shape{1});
  REQUIRE(s.view({1, 1}).item() == 3.5);
  REQUIRE_THROWS_AS(s.view({2}), ShapeError);
}

TEST_CASE("a shape with more elements than int64 counts is a ShapeError, not an overflow", "[tensor]") {
  const int64_t big = int64_t(1) << 40;
  CHECK_THROWS_AS(booster::ones({1, 1}).expand({big, big}), booster::ShapeError);
  CHECK_THROWS_WITH(booster::ones({1, 1}).expand({big, big}), Catch::Contains("more elements than a 64-bit"));
  CHECK(booster::ones({1, 1}).expand({big, 4}).numel() == 4 * big);  // large but countable: a view is fine
}
