// Deferred initialization (booster/tensor/deferred.h): a model built under a LazyInitGuard holds no
// memory, and what it gives when allocated, whole or a slice at a time, is bit for bit what the same
// code gives eagerly, with the generators left in the same state. The references are the eager
// tensors read element by element here, not the library's slicing.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <vector>

#include "booster/nn/cnn.h"
#include "booster/nn/models.h"
#include "booster/nn/nn.h"
#include "booster/nn/shard_policy.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/deferred.h"
#include "booster/tensor/random.h"

using namespace booster;

namespace {

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

int64_t parameter_bytes(const nn::Module& m) {
  int64_t n = 0;
  for (const Tensor& p : m.parameters()) n += int64_t(p.nbytes());
  for (const Tensor& b : m.buffers()) n += int64_t(b.nbytes());
  return n;
}

nn::GPTConfig gpt_config() {
  nn::GPTConfig cfg;
  cfg.vocab_size = 96;
  cfg.context = 16;
  cfg.width = 32;
  cfg.layers = 4;
  cfg.heads = 4;
  return cfg;
}

// Builds with `make` eagerly and under a guard, from the same default generator state, and checks
// that the deferred one held no memory, then matches the eager one bit for bit, generators included.
template <class Make>
void check_model(Make&& make) {
  manual_seed(11);
  const nn::ModulePtr eager = make();
  const std::vector<uint64_t> eager_rng = default_generator().state();

  manual_seed(11);
  const size_t before = cpu_bytes_in_use();
  nn::ModulePtr lazy;
  {
    LazyInitGuard guard;
    lazy = make();
  }
  CHECK(default_generator().state() == eager_rng);
  const int64_t bytes = parameter_bytes(*eager);
  INFO(lazy->name() << ": " << bytes << " bytes of parameters and buffers");
  CHECK(cpu_bytes_in_use() - before < size_t(bytes) / 100);
  const auto eager_state = eager->state_dict();
  for (const auto& [name, t] : lazy->state_dict()) {
    INFO(name);
    CHECK(is_deferred(t));
    REQUIRE(eager_state.count(name));
    CHECK(same_bits(t, eager_state.at(name)));  // the read allocates and fills it
    CHECK_FALSE(is_deferred(t));
  }
  CHECK(cpu_bytes_in_use() - before >= size_t(bytes));
}

}  // namespace

TEST_CASE("deferred: models built under a LazyInitGuard hold no memory and equal the eager ones",
          "[deferred][nn]") {
  SECTION("GPT") {
    check_model([] { return std::make_shared<nn::GPT>(gpt_config(), 3); });
  }
  SECTION("MLP classifier") {
    check_model([] { return std::make_shared<nn::MLPClassifier>(20, std::vector<int64_t>{32, 24}, 10, "gelu", 4); });
  }
  SECTION("CNN with batch norm (buffers too)") {
    nn::CNNConfig cfg;
    cfg.height = cfg.width = 8;
    cfg.channels = {4, 8};
    cfg.hidden = 16;
    check_model([&] { return std::make_shared<nn::CNNClassifier>(cfg, 5); });
  }
  SECTION("layers drawing from the default generator") {
    // Linear's default init draws from the default generator: the deferred draws must advance it alike.
    check_model([] {
      auto seq = std::make_shared<nn::Sequential>();
      seq->push_back(std::make_shared<nn::Linear>(7, 5));
      seq->push_back(std::make_shared<nn::Linear>(5, 3, false));
      return seq;
    });
  }
}

TEST_CASE("deferred: a slice is made from the recorded values without allocating the whole", "[deferred]") {
  const Shape shape = {6, 4, 10};
  for (DType dtype : {DType::Float32, DType::BFloat16, DType::Float16}) {
    for (int kind = 0; kind < 3; ++kind) {
      INFO("dtype " << dtype << ", kind " << kind);
      auto init = [&](const Tensor& t, Generator& g) {
        if (kind == 0) nn::init::uniform_(t, -0.7, 1.3, g);
        if (kind == 1) nn::init::normal_(t, 0.25, 2.0, g);
        if (kind == 2) Tensor(t).fill_(-3.5);
      };
      Generator g1(99), g2(99);
      const Tensor eager = Tensor::empty(shape, dtype);
      init(eager, g1);
      Tensor lazy;
      {
        LazyInitGuard guard;
        lazy = Tensor::empty(shape, dtype);
      }
      init(lazy, g2);
      CHECK(g1.state() == g2.state());
      for (int64_t dim = 0; dim < 3; ++dim) {
        // Two ranges along `dim`, as a shard of chunks 2 takes them.
        const int64_t n = shape[size_t(dim)], length = n / 2 - 1;
        const std::vector<int64_t> starts = {1, n / 2};
        const Tensor got = select_ranges(lazy, dim, starts, length);
        CHECK(is_deferred(lazy));
        const Tensor want_eager = select_ranges(eager, dim, starts, length);
        // The reference: the eager tensor's elements picked by index.
        const Tensor e = eager.to(DType::Float64).contiguous();
        const double* src = e.data<double>();
        const std::vector<double> values = got.to(DType::Float64).tolist();
        size_t at = 0;
        bool all = true;
        for (int64_t i = 0; i < (dim == 0 ? 2 * length : shape[0]); ++i)
          for (int64_t j = 0; j < (dim == 1 ? 2 * length : shape[1]); ++j)
            for (int64_t k = 0; k < (dim == 2 ? 2 * length : shape[2]); ++k) {
              int64_t idx[3] = {i, j, k};
              const int64_t r = idx[dim];
              idx[dim] = starts[size_t(r / length)] + r % length;
              all = all && values[at++] == src[(idx[0] * shape[1] + idx[1]) * shape[2] + idx[2]];
            }
        CHECK(all);
        CHECK(same_bits(got, want_eager));
      }
      CHECK(same_bits(lazy, eager));  // and whole, once read
    }
  }
}

TEST_CASE("init: a tensor of many chunks draws as a view filled whole, and as a deferred one", "[deferred][init]") {
  // fill_from fills a contiguous tensor a chunk (2^20 elements) at a time and any other tensor through
  // one float64 buffer of its size: the same draws in the same order, rounded once each, so the bits
  // agree; and a deferred tensor materializes them too.
  const Shape shape = {1100, 1000};  // 1.1e6 elements: a chunk and a part
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    for (int kind = 0; kind < 2; ++kind) {
      INFO("dtype " << dtype << ", kind " << kind);
      auto init = [&](const Tensor& t, Generator& g) {
        if (kind == 0) nn::init::uniform_(t, -0.7, 1.3, g);
        else nn::init::normal_(t, 0.25, 2.0, g);
      };
      Generator g1(7), g2(7), g3(7);
      const Tensor chunked = Tensor::empty(shape, dtype);
      init(chunked, g1);
      const Tensor transposed = Tensor::empty({shape[1], shape[0]}, dtype).transpose(0, 1);
      REQUIRE_FALSE(transposed.is_contiguous());
      init(transposed, g2);
      Tensor lazy;
      {
        LazyInitGuard guard;
        lazy = Tensor::empty(shape, dtype);
      }
      init(lazy, g3);
      materialize(lazy);
      CHECK(g1.state() == g2.state());
      CHECK(g1.state() == g3.state());
      CHECK(same_bits(chunked, transposed.contiguous()));
      CHECK(same_bits(chunked, lazy));
    }
  }
}

TEST_CASE("deferred: writes and partial inits run eagerly on the recorded values", "[deferred]") {
  Generator g1(5), g2(5);
  Tensor eager = Tensor::empty({4, 6}), lazy;
  {
    LazyInitGuard guard;
    lazy = Tensor::empty({4, 6});
  }
  nn::init::normal_(eager, 0.0, 1.0, g1);
  nn::init::normal_(lazy, 0.0, 1.0, g2);
  // An init of a view cannot be recorded: the whole is allocated with its values first.
  nn::init::uniform_(eager.narrow(0, 1, 2), 0.0, 1.0, g1);
  nn::init::uniform_(lazy.narrow(0, 1, 2), 0.0, 1.0, g2);
  CHECK_FALSE(is_deferred(lazy));
  CHECK(same_bits(lazy, eager));

  // A copy over the whole replaces the values; one from itself keeps them.
  Tensor a, b;
  {
    LazyInitGuard guard;
    a = zeros({3, 3});
    b = ones({3, 3});
  }
  Tensor src = arange(9, DType::Float32).reshape({3, 3});
  a.copy_(src);
  CHECK(same_bits(a, src));
  b.copy_(b.t());
  CHECK(same_bits(b, ones({3, 3})));
  // Re-initializing replaces the record: the last init wins, as eagerly.
  Generator g3(8), g4(8);
  Tensor c = Tensor::empty({5}), d;
  {
    LazyInitGuard guard;
    d = Tensor::empty({5});
  }
  Tensor(c).fill_(2.0);
  nn::init::uniform_(c, -1.0, 1.0, g3);
  Tensor(d).fill_(2.0);
  nn::init::uniform_(d, -1.0, 1.0, g4);
  CHECK(is_deferred(d));
  CHECK(same_bits(d, c));
}

TEST_CASE("deferred: an optimizer over deferred parameters binds them on first use", "[deferred][optim]") {
  auto make = [] { return std::make_shared<nn::MLPClassifier>(12, std::vector<int64_t>{16}, 4, "relu", 2); };
  const nn::ModulePtr eager = make();
  nn::ModulePtr lazy;
  {
    LazyInitGuard guard;
    lazy = make();
  }
  const nlohmann::json adamw = {{"type", "AdamW"}, {"lr", 0.01}};
  auto eager_opt = optim::make_optimizer(adamw, eager->parameters());
  const size_t before = cpu_bytes_in_use();
  auto lazy_opt = optim::make_optimizer(adamw, lazy->parameters());
  CHECK(cpu_bytes_in_use() == before);  // nothing bound, nothing allocated
  for (const Tensor& p : lazy->parameters()) CHECK(is_deferred(p));

  Generator data(1);
  for (int step = 0; step < 3; ++step) {
    const Tensor x = randn({8, 12}, &data);
    const Tensor y = randint(0, 4, {8}, &data);
    for (auto [model, opt] : {std::pair{eager, eager_opt.get()}, std::pair{lazy, lazy_opt.get()}}) {
      opt->zero_grad();
      cross_entropy((*model)(x), y).backward();
      opt->step();
    }
  }
  const auto want = eager->state_dict();
  for (const auto& [name, t] : lazy->state_dict()) {
    INFO(name);
    CHECK(same_bits(t, want.at(name)));
  }
  // The values live in the optimizer's flat buffer, as eagerly bound parameters do.
  CHECK(lazy_opt->flat_buffers(0).size() == 1);
  CHECK(lazy_opt->flat_buffers(0)[0]->numel() == lazy->num_parameters());
}

TEST_CASE("deferred: a pipeline stage of a deferred GPT allocates only its part", "[deferred][nn]") {
  const nn::GPTConfig cfg = gpt_config();
  const nn::ModulePtr eager = std::make_shared<nn::GPT>(cfg, 7);
  const size_t before = cpu_bytes_in_use();
  nn::ModulePtr lazy;
  {
    LazyInitGuard guard;
    lazy = std::make_shared<nn::GPT>(cfg, 7);
  }
  nn::ShardContext context;
  context.stage = 1;
  context.stages = 4;
  const nn::ShardPolicy policy = nn::find_shard_policy("GPT", "this test");
  const nn::ShardedModel part = policy(lazy, context);
  const nn::ShardedModel eager_part = policy(eager, context);
  for (const Tensor& p : part.module->parameters()) materialize(p);
  const int64_t part_bytes = parameter_bytes(*part.module), whole_bytes = parameter_bytes(*eager);
  CHECK(part_bytes < whole_bytes / 3);
  CHECK(cpu_bytes_in_use() - before == size_t(part_bytes));  // the part, and nothing of the rest
  const auto want = eager_part.module->state_dict();
  for (const auto& [name, t] : part.module->state_dict()) {
    INFO(name);
    CHECK(same_bits(t, want.at(name)));
  }
  // The layers of other stages were never allocated.
  for (const auto& [name, t] : lazy->state_dict())
    if (!want.count(name)) CHECK(is_deferred(t));
}

TEST_CASE("deferred: refusals keep the recorded values, and overlapping ranges are refused", "[deferred]") {
  Generator g1(4), g2(4);
  const Tensor eager = Tensor::empty({4, 6});
  nn::init::normal_(eager, 0.0, 1.0, g1);
  Tensor lazy;
  {
    LazyInitGuard guard;
    lazy = Tensor::empty({4, 6});
  }
  nn::init::normal_(lazy, 0.0, 1.0, g2);
  // A copy that fails (the shapes do not broadcast) leaves the tensor as it was.
  CHECK_THROWS_AS(lazy.copy_(zeros({5, 6})), ShapeError);
  CHECK(is_deferred(lazy));
  CHECK_THROWS_AS(select_ranges(lazy, 1, {0, 2}, 3), ValueError);  // [0, 3) and [2, 5) overlap
  CHECK(same_bits(select_ranges(lazy, 1, {3, 0}, 3), select_ranges(eager, 1, {3, 0}, 3)));
  CHECK(same_bits(lazy, eager));

  // An optimizer refuses a deferred parameter it could not bind when it is made, as an eager one.
  Tensor ints;
  {
    LazyInitGuard guard;
    ints = zeros({3}, DType::Int64);
  }
  const nlohmann::json sgd = {{"type", "SGD"}, {"lr", 0.1}};
  CHECK_THROWS_AS(optim::make_optimizer(sgd, {zeros({3}, DType::Int64)}), DTypeError);
  CHECK_THROWS_AS(optim::make_optimizer(sgd, {ints}), DTypeError);
}
