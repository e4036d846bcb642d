// Tensor-parallel layers under `mpirun -np 2`: each against its single-process twin built from the same
// generator (outputs, input gradients, and every rank's weight-gradient slice), and the input gradient
// of a column -> GELU -> row block against central finite differences.
#include <catch2/catch.hpp>

#include "gradcheck.h"

#include "booster/distributed/process_group.h"
#include "booster/nn/activation.h"
#include "booster/nn/embedding.h"
#include "booster/nn/linear.h"
#include "booster/nn/tensor_parallel.h"
#include "booster/ops/ops.h"
#include "roundoff.h"

using namespace booster;
using namespace booster::distributed;

namespace {

ProcessGroup& group() { return init_process_group("mpi"); }

// Largest |a - b| / (1 + |b|).
double max_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const std::vector<double> x = a.tolist(), y = b.tolist();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]) / (1 + std::abs(y[i])));
  return m;
}

// Rows (dim 0) or columns (dim 1) of `full` that this rank holds.
Tensor my_slice(const Tensor& full, int64_t dim, const ProcessGroup& pg) {
  const int64_t n = full.size(dim) / pg.size();
  return full.narrow(dim, pg.rank() * n, n);
}

// Two summation orders of a float32 sum of n terms differ by at most 2 gamma_n sum |terms|, gamma_n =
// n u / (1 - n u) (the deterministic bound; Note [Roundoff bounds] in tests/roundoff.h for the rest).
// The longest sum compared here has n = 12 terms (a weight gradient over 3 x 4 rows), each a product
// of a randn value and an input or output gradient, below 5 x 5 (five standard deviations, out of
// reach of these few draws): sum |terms| <= 12 x 25.
constexpr double kTol = 2.0 * 12 * ::testing::roundoff::kUnit / (1 - 12 * ::testing::roundoff::kUnit) * 12 * 25;

}  // namespace

TEST_CASE("column- and row-parallel linears match nn::Linear, forward and backward", "[mpi][tp][roundoff]") {
  ProcessGroup& pg = group();
  REQUIRE(pg.size() == 2);
  Generator data_gen(5);
  const Tensor x0 = randn({3, 4, 8}, &data_gen);  // the same on every rank
  const Tensor g = randn({3, 4, 6}, &data_gen);

  SECTION("column parallel with gather_output") {
    Generator a(11), b(11);
    nn::Linear full(8, 6, true, &a);
    nn::tp::ColumnParallelLinear col(8, 6, pg, true, /*gather_output=*/true, &b);
    CHECK(col.weight.shape() == Shape{3, 8});
    CHECK(max_diff(col.weight, my_slice(full.weight, 0, pg)) == 0.0);  // the same init, sliced
    Tensor x1 = x0.clone().requires_grad_(), x2 = x0.clone().requires_grad_();
    const Tensor y1 = full(x1), y2 = col(x2);
    CHECK(max_diff(y2, y1) < kTol);
    y1.backward(g);
    y2.backward(g);
    CHECK(max_diff(x2.grad(), x1.grad()) < kTol);  // partial dX summed over the group
    CHECK(max_diff(col.weight.grad(), my_slice(full.weight.grad(), 0, pg)) < kTol);
    CHECK(max_diff(col.bias.grad(), my_slice(full.bias.grad(), 0, pg)) < kTol);
  }
  SECTION("row parallel taking the whole input") {
    Generator a(12), b(12);
    nn::Linear full(8, 6, true, &a);
    nn::tp::RowParallelLinear row(8, 6, pg, true, /*input_is_parallel=*/false, &b);
    CHECK(row.weight.shape() == Shape{6, 4});
    Tensor x1 = x0.clone().requires_grad_(), x2 = x0.clone().requires_grad_();
    const Tensor y1 = full(x1), y2 = row(x2);
    CHECK(max_diff(y2, y1) < kTol);
    y1.backward(g);
    y2.backward(g);
    CHECK(max_diff(x2.grad(), x1.grad()) < kTol);  // this rank's slice of dX, all-gathered
    CHECK(max_diff(row.weight.grad(), my_slice(full.weight.grad(), 1, pg)) < kTol);
    CHECK(max_diff(row.bias.grad(), full.bias.grad()) < kTol);  // replicated, so whole
  }
  SECTION("column -> GELU -> row, one all-reduce each way") {
    Generator a(13), b(13);
    nn::Linear fc(8, 16, true, &a), proj(16, 6, true, &a);
    nn::tp::ColumnParallelLinear col(8, 16, pg, true, false, &b);
    nn::tp::RowParallelLinear row(16, 6, pg, true, true, &b);
    Tensor x1 = x0.clone().requires_grad_(), x2 = x0.clone().requires_grad_();
    const Tensor y1 = proj(gelu(fc(x1))), y2 = row(gelu(col(x2)));
    CHECK(max_diff(y2, y1) < kTol);
    y1.backward(g);
    y2.backward(g);
    CHECK(max_diff(x2.grad(), x1.grad()) < kTol);
    CHECK(max_diff(col.weight.grad(), my_slice(fc.weight.grad(), 0, pg)) < kTol);
    CHECK(max_diff(row.weight.grad(), my_slice(proj.weight.grad(), 1, pg)) < kTol);
    CHECK(max_diff(row.bias.grad(), proj.bias.grad()) < kTol);
  }
}

TEST_CASE("a tensor-parallel block's input gradient matches finite differences", "[mpi][tp][roundoff]") {
  ProcessGroup& pg = group();
  Generator gen(21);
  nn::tp::ColumnParallelLinear col(5, 4, pg, true, false, &gen);
  nn::tp::RowParallelLinear row(4, 3, pg, true, true, &gen);
  col.to(DType::Float64);
  row.to(DType::Float64);
  Generator data_gen(22);
  const Tensor x = randn({2, 5}, &data_gen);
  CHECK(booster::testing::gradcheck([&](const std::vector<Tensor>& in) { return row(tanh(col(in[0]))); }, {x}));
  // The communication functions on their own.
  CHECK(booster::testing::gradcheck(
      [&](const std::vector<Tensor>& in) { return nn::tp::gather_last_dim(nn::tp::split_last_dim(in[0], pg) * 3.0, pg); },
      {randn({2, 6}, &data_gen)}));
}

TEST_CASE("tensor-parallel sizes that do not divide are refused naming both", "[mpi][tp][roundoff]") {
  ProcessGroup& pg = group();
  CHECK_THROWS_WITH(nn::tp::ColumnParallelLinear(4, 5, pg), Catch::Contains("out_features 5 does not divide") &&
                                                                Catch::Contains("tensor-parallel size 2"));
  CHECK_THROWS_WITH(nn::tp::RowParallelLinear(3, 4, pg), Catch::Contains("in_features 3 does not divide"));
}

TEST_CASE("vocabulary-parallel embedding and cross-entropy match the whole-vocabulary ones", "[mpi][tp][roundoff]") {
  ProcessGroup& pg = group();
  Generator data_gen(31);
  const int64_t vocab = 10, dim = 3, n = 7;
  std::vector<int64_t> ids{0, 9, 4, 5, 3, 7, 2}, targets{1, 9, 5, 4, -100, 0, 6};
  const Tensor id_t = from_vector(ids, {n}), target_t = from_vector(targets, {n});

  Generator a(41), b(41);
  nn::Embedding full(vocab, dim, &a);
  nn::tp::VocabParallelEmbedding emb(vocab, dim, pg, &b);
  const Tensor e1 = full(id_t), e2 = emb(id_t);
  CHECK(max_diff(e2, e1) == 0.0);  // one rank's row plus zeros
  const Tensor ge = randn({n, dim}, &data_gen);
  e1.backward(ge);
  e2.backward(ge);
  CHECK(max_diff(emb.weight.grad(), my_slice(full.weight.grad(), 0, pg)) == 0.0);  // distinct ids: no sums
  CHECK_THROWS_AS(emb(from_vector(std::vector<int64_t>{10}, {1})), IndexError);

  // Logits with a wide range, so the shared max matters; every rank holds half the vocabulary.
  const Tensor whole = randn({n, vocab}, &data_gen) * 20.0;
  Tensor logits1 = whole.clone().requires_grad_();
  Tensor logits2 = my_slice(whole, 1, pg).clone().requires_grad_();
  const Tensor l1 = cross_entropy(logits1, target_t), l2 = nn::tp::vocab_parallel_cross_entropy(logits2, target_t, pg);
  // The loss sums exponentials over the vocabulary (in two halves) and averages the n rows.
  const double eps = ::testing::roundoff::reduction_bound({double(vocab), double(n)});
  CHECK(std::abs(l2.item() - l1.item()) <= eps * std::abs(l1.item()));
  l1.backward();
  l2.backward();
  CHECK(max_diff(logits2.grad(), my_slice(logits1.grad(), 1, pg)) <= eps / double(n));  // softmax / n: below 1 / n
  // [B, T, V] logits flatten as cross_entropy's [N, C] would.
  const Tensor l3 = nn::tp::vocab_parallel_cross_entropy(my_slice(whole, 1, pg).reshape({1, n, vocab / 2}),
                                                         target_t.reshape({1, n}), pg);
  CHECK(std::abs(l3.item() - l1.item()) <= eps * std::abs(l1.item()));

  // Against central finite differences too: each rank's logits moved one at a time (every rank calls
  // the collective loss each time; only the owner of the logit moves it). The loss is computed in
  // float32, so h = 1e-2 and 2e-3 absolute (the gradients are of order 1/n = 0.14).
  const Tensor base = my_slice(whole, 1, pg).clone();
  const std::vector<double> analytic = logits2.grad().tolist();
  const double h = 1e-2;
  for (int r = 0; r < pg.size(); ++r)
    for (int64_t j = 0; j < base.numel(); ++j) {
      auto loss_at = [&](double delta) {
        std::vector<double> v = base.tolist();
        if (r == pg.rank()) v[size_t(j)] += delta;
        return nn::tp::vocab_parallel_cross_entropy(from_vector(v, base.shape(), DType::Float32), target_t, pg).item();
      };
      const double numeric = (loss_at(h) - loss_at(-h)) / (2 * h);
      if (r == pg.rank()) CHECK(numeric == Approx(analytic[size_t(j)]).margin(2e-3));
    }
}

TEST_CASE("attention split by heads matches the whole CausalSelfAttention", "[mpi][tp][roundoff]") {
  ProcessGroup& pg = group();
  Generator gen(51), data_gen(52);
  nn::CausalSelfAttention full(8, 4, 0.0, &gen);
  nn::tp::ParallelCausalSelfAttention par(full, pg);
  CHECK(par.local_heads == 2);
  Tensor x1 = randn({2, 5, 8}, &data_gen).requires_grad_(), x2 = x1.detach().clone().requires_grad_();
  const Tensor y1 = full(x1), y2 = par(x2);
  CHECK(max_diff(y2, y1) < kTol);
  const Tensor g = randn({2, 5, 8}, &data_gen);
  y1.backward(g);
  y2.backward(g);
  CHECK(max_diff(x2.grad(), x1.grad()) < kTol);
  // c_attn's gradient: this rank's heads' rows of each of q, k and v.
  const Tensor full_grad = full.c_attn->weight.grad();
  std::vector<Tensor> mine;
  for (int64_t part = 0; part < 3; ++part) mine.push_back(full_grad.narrow(0, part * 8 + pg.rank() * 4, 4));
  CHECK(max_diff(par.c_attn->weight.grad(), cat(mine, 0)) < kTol);
  CHECK(max_diff(par.c_proj->weight.grad(), my_slice(full.c_proj->weight.grad(), 1, pg)) < kTol);
  CHECK(max_diff(par.c_proj->bias.grad(), full.c_proj->bias.grad()) < kTol);

  // Built from an existing Linear: the same shard as the generator-built layer.
  Generator a(61), b(61);
  const nn::Linear lin(8, 6, true, &a);
  const nn::tp::ColumnParallelLinear from_layer(lin, pg), from_gen(8, 6, pg, true, false, &b);
  CHECK(max_diff(from_layer.weight, from_gen.weight) == 0.0);
  CHECK(max_diff(from_layer.bias, from_gen.bias) == 0.0);
  CHECK_THROWS_WITH(nn::tp::ParallelCausalSelfAttention(nn::CausalSelfAttention(6, 3), pg),
                    Catch::Contains("3 heads do not divide"));
}
