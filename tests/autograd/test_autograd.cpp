// Autograd engine semantics: accumulation, retain_graph, no-grad, detach, grad-ready hooks, and the
// typed errors a misuse gets. Gradients of individual ops are checked in the op tests.
#include <catch2/catch.hpp>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"

using namespace booster;

namespace {
Tensor leaf(std::vector<float> v, Shape s) { return from_vector(v, s).requires_grad_(); }
}  // namespace

TEST_CASE("gradients accumulate into .grad across backward calls", "[autograd]") {
  Tensor x = leaf({1, 2, 3}, {3});
  sum(mul(x, x)).backward();  // d/dx = 2x
  REQUIRE(x.grad().tolist() == std::vector<double>{2, 4, 6});
  sum(mul(x, 3.0)).backward();  // + 3
  REQUIRE(x.grad().tolist() == std::vector<double>{5, 7, 9});
}

TEST_CASE("a leaf used twice in one graph gets the sum of both paths", "[autograd]") {
  Tensor x = leaf({2}, {1});
  Tensor y = add(mul(x, x), mul(x, 5.0));  // x^2 + 5x -> 2x + 5
  y.backward(ones({1}));
  REQUIRE(x.grad().item() == 9.0);
}

TEST_CASE("backward with an explicit gradient weights the outputs", "[autograd]") {
  Tensor x = leaf({1, 2}, {2});
  Tensor y = mul(x, x);
  y.backward(from_vector(std::vector<float>{10, 100}, {2}));
  REQUIRE(x.grad().tolist() == std::vector<double>{20, 400});
}

TEST_CASE("backward on a non-scalar without a gradient is an AutogradError naming the shape", "[autograd]") {
  Tensor x = leaf({1, 2, 3, 4}, {2, 2});
  Tensor y = mul(x, 2.0);
  REQUIRE_THROWS_AS(y.backward(), AutogradError);
  REQUIRE_THROWS_WITH(y.backward(), Catch::Contains("scalar outputs") && Catch::Contains("[2, 2]"));
  // A gradient of the wrong shape is a ShapeError naming both shapes.
  REQUIRE_THROWS_WITH(y.backward(ones({3})), Catch::Contains("[3]") && Catch::Contains("[2, 2]"));
  // A tensor that never required grad cannot be differentiated.
  REQUIRE_THROWS_AS(sum(ones({2})).backward(), AutogradError);
}

TEST_CASE("retain_graph allows a second backward through the same graph", "[autograd]") {
  Tensor x = leaf({3}, {1});
  Tensor y = sum(exp(x));
  y.backward(Tensor(), /*retain_graph=*/true);
  const double g1 = x.grad().item();
  y.backward();
  REQUIRE(x.grad().item() == Approx(2 * g1));
  REQUIRE_THROWS_WITH(y.backward(), Catch::Contains("retain_graph"));
}

TEST_CASE("NoGradGuard records nothing and restores the mode", "[autograd]") {
  Tensor x = leaf({1, 2}, {2});
  {
    NoGradGuard guard;
    REQUIRE_FALSE(autograd::grad_mode_enabled());
    Tensor y = mul(x, x);
    REQUIRE_FALSE(y.requires_grad());
    REQUIRE(y.grad_fn() == nullptr);
    {
      NoGradGuard nested;
    }
    REQUIRE_FALSE(autograd::grad_mode_enabled());
  }
  REQUIRE(autograd::grad_mode_enabled());
  REQUIRE(mul(x, x).requires_grad());
}

TEST_CASE("detach shares data but cuts the graph", "[autograd]") {
  Tensor x = leaf({1, 2}, {2});
  Tensor y = mul(x, 3.0);
  Tensor d = y.detach();
  REQUIRE_FALSE(d.requires_grad());
  REQUIRE(d.storage() == y.storage());
  // Only the attached path contributes: d(3x * const(3x))/dx = 3 * 3x (not 18x).
  sum(mul(y, d)).backward();
  REQUIRE(x.grad().tolist() == std::vector<double>{9, 18});
}

TEST_CASE("grad-ready hooks fire once per backward, after the leaf's .grad holds the sum", "[autograd]") {
  Tensor w = leaf({1, 2}, {2});
  Tensor b = leaf({0.5f}, {1});
  std::vector<std::string> fired;
  std::vector<double> seen_grad;
  w.set_name("w");
  b.set_name("b");
  w.register_grad_ready_hook([&](Tensor& p) {
    fired.push_back(p.name());
    seen_grad = p.grad().tolist();
  });
  b.register_grad_ready_hook([&](Tensor& p) { fired.push_back(p.name()); });
  // w feeds two ops; its hook must see both contributions: 2w + 1.
  Tensor y = sum(add(add(mul(w, w), w), b));
  y.backward();
  REQUIRE(std::count(fired.begin(), fired.end(), "w") == 1);
  REQUIRE(std::count(fired.begin(), fired.end(), "b") == 1);
  REQUIRE(seen_grad == std::vector<double>{3, 5});
  // Hooks fire again on the next backward, with the accumulated gradient.
  fired.clear();
  sum(mul(w, 1.0)).backward();
  REQUIRE(fired == std::vector<std::string>{"w"});
  REQUIRE(seen_grad == std::vector<double>{4, 6});
  // Only leaves that require grad take hooks.
  REQUIRE_THROWS_AS(mul(w, 2.0).register_grad_ready_hook([](Tensor&) {}), AutogradError);
}

TEST_CASE("in-place writes to a tensor that requires grad are refused under grad mode", "[autograd]") {
  Tensor w = leaf({1, 2}, {2});
  REQUIRE_THROWS_WITH(w.add_(ones({2})), Catch::Contains("add_") && Catch::Contains("NoGradGuard"));
  {
    NoGradGuard guard;
    w.add_(ones({2}));  // the optimizer's way
  }
  REQUIRE(w.tolist() == std::vector<double>{2, 3});
  REQUIRE_THROWS_AS(randint(0, 3, {2}).requires_grad_(), AutogradError);
}
