// The data layer: samplers against torch's DistributedSampler, the DataLoader's order, prefetching,
// early exit and resuming, Fashion-MNIST reading and its errors, the synthetic and character data sets.
#include <catch2/catch.hpp>

#include "skip.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include "booster/data/data.h"
#include "booster/ops/ops.h"
#include "fixture.h"

using namespace booster;
using namespace booster::data;
namespace fs = std::filesystem;

namespace {

// A data set whose x row i is [i, 10 i] (float32) and y is i (int64): every batch names its indices.
std::shared_ptr<TensorDataset> indexed_dataset(int64_t n) {
  std::vector<float> x;
  std::vector<int64_t> y;
  for (int64_t i = 0; i < n; ++i) {
    x.push_back(float(i));
    x.push_back(float(10 * i));
    y.push_back(i);
  }
  return std::make_shared<TensorDataset>(from_vector(x, {n, 2}), from_vector(y, {n}));
}

// The y values of every batch of one pass.
std::vector<std::vector<int64_t>> pass_labels(DataLoader& loader) {
  std::vector<std::vector<int64_t>> out;
  for (auto& [x, y] : loader) out.push_back(y.to_vector<int64_t>());
  return out;
}

std::vector<int64_t> flat(const std::vector<std::vector<int64_t>>& v) {
  std::vector<int64_t> f;
  for (const auto& b : v) f.insert(f.end(), b.begin(), b.end());
  return f;
}

std::vector<int64_t> iota_vec(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), int64_t(0));
  return v;
}

// A temporary folder removed at the end of the test.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("booster_test_data_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

bool fashion_mnist_present() {
  if (fs::exists(fs::path(kFashionMnistDir) / "train-images-idx3-ubyte.gz")) return true;
  skip_test(std::string(kFashionMnistDir) + " is absent (apt-get install dataset-fashion-mnist)");
  return false;
}

}  // namespace

// ------------------------------------------------------------------------------------------ samplers

TEST_CASE("DistributedSampler without shuffle matches torch's partitions, padding and truncation", "[data]") {
  const auto fixture = testing::load_fixture_json("data.json").at("distributed_sampler");
  REQUIRE(fixture.size() >= 50);
  for (const auto& [name, c] : fixture.items()) {
    const int64_t n = c.at("n"), world = c.at("world");
    const bool drop_last = c.at("drop_last");
    for (int64_t rank = 0; rank < world; ++rank) {
      DistributedSampler s(n, world, rank, /*shuffle=*/false, /*seed=*/0, drop_last);
      const auto expected = c.at("ranks").at(size_t(rank)).get<std::vector<int64_t>>();
      INFO(name << " rank " << rank);
      REQUIRE(s.size() == int64_t(expected.size()));
      REQUIRE(s.indices() == expected);
    }
  }
}

TEST_CASE("DistributedSampler with shuffle partitions each epoch's permutation across ranks", "[data]") {
  struct Case {
    int64_t n, world;
    bool drop_last;
  };
  for (const Case c : {Case{12, 3, false}, Case{12, 4, true}, Case{10, 3, false}, Case{10, 3, true},
                       Case{7, 4, false}, Case{5, 1, false}, Case{2, 3, false}}) {
    INFO("n " << c.n << " world " << c.world << " drop_last " << c.drop_last);
    const int64_t per_rank = c.drop_last ? c.n / c.world : (c.n + c.world - 1) / c.world;
    std::vector<std::vector<int64_t>> epoch_orders;
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      std::map<int64_t, int> seen;
      std::vector<int64_t> all;
      for (int64_t rank = 0; rank < c.world; ++rank) {
        DistributedSampler s(c.n, c.world, rank, /*shuffle=*/true, /*seed=*/7, c.drop_last);
        s.set_epoch(epoch);
        const auto mine = s.indices();
        REQUIRE(int64_t(mine.size()) == per_rank);
        REQUIRE(s.size() == per_rank);
        for (int64_t i : mine) {
          REQUIRE((i >= 0 && i < c.n));
          ++seen[i];
          all.push_back(i);
        }
        // Rebuilding the sampler (another process) gives the same share.
        DistributedSampler again(c.n, c.world, rank, true, 7, c.drop_last);
        again.set_epoch(epoch);
        REQUIRE(again.indices() == mine);
      }
      const int64_t total = per_rank * c.world;
      if (c.n % c.world == 0) {
        REQUIRE(int64_t(seen.size()) == c.n);  // every index exactly once
        for (auto& [i, k] : seen) REQUIRE(k == 1);
      } else if (c.drop_last) {
        REQUIRE(int64_t(seen.size()) == total);  // n - total dropped, none repeated
        for (auto& [i, k] : seen) REQUIRE(k == 1);
      } else {
        REQUIRE(int64_t(seen.size()) == c.n);  // every index, total - n of them twice (or more when n < world)
        int64_t repeats = 0;
        for (auto& [i, k] : seen) repeats += k - 1;
        REQUIRE(repeats == total - c.n);
      }
      epoch_orders.push_back(all);
    }
    if (c.n >= 5) {
      REQUIRE(epoch_orders[0] != epoch_orders[1]);  // set_epoch reshuffles
      REQUIRE(epoch_orders[1] != epoch_orders[2]);
    }
  }
}

TEST_CASE("DistributedSampler shuffled padding repeats the start of the permutation, as torch does", "[data]") {
  // n = 10, world = 4: total 12, the permutation's first two entries pad the end.
  const auto perm = seeded_permutation(10, /*seed=*/3 + /*epoch=*/2);
  std::vector<int64_t> padded = perm;
  padded.push_back(perm[0]);
  padded.push_back(perm[1]);
  for (int64_t rank = 0; rank < 4; ++rank) {
    DistributedSampler s(10, 4, rank, true, 3, false);
    s.set_epoch(2);
    std::vector<int64_t> expected;
    for (size_t k = size_t(rank); k < padded.size(); k += 4) expected.push_back(padded[k]);
    REQUIRE(s.indices() == expected);
  }
}

TEST_CASE("DistributedSampler validates its arguments", "[data]") {
  REQUIRE_THROWS_AS(DistributedSampler(10, 2, 2), ValueError);
  REQUIRE_THROWS_WITH(DistributedSampler(10, 2, 5), Catch::Contains("rank 5") && Catch::Contains("num_replicas 2"));
  REQUIRE_THROWS_AS(DistributedSampler(10, 2, -1), ValueError);
  REQUIRE_THROWS_AS(DistributedSampler(10, 0, 0), ValueError);
  REQUIRE_THROWS_AS(DistributedSampler(-1, 2, 0), ValueError);
  REQUIRE_NOTHROW(DistributedSampler(10, 2, 1));
}

TEST_CASE("RandomSampler is a seeded permutation that changes with the epoch", "[data]") {
  RandomSampler a(100, 42), b(100, 42), other_seed(100, 43);
  const auto p0 = a.indices();
  std::vector<int64_t> sorted = p0;
  std::sort(sorted.begin(), sorted.end());
  REQUIRE(sorted == iota_vec(100));
  REQUIRE(p0 != iota_vec(100));
  REQUIRE(b.indices() == p0);                // same seed, same epoch
  REQUIRE(a.indices() == p0);                // asking twice does not advance anything
  REQUIRE(other_seed.indices() != p0);
  a.set_epoch(1);
  const auto p1 = a.indices();
  REQUIRE(p1 != p0);
  b.set_epoch(1);
  REQUIRE(b.indices() == p1);
  // seed + epoch, as torch's DistributedSampler: (42, epoch 1) is (43, epoch 0).
  REQUIRE(p1 == other_seed.indices());
  // The generator and the shuffle are ours, so the order is pinned on every machine; a change here
  // silently breaks resuming runs from old checkpoints.
  REQUIRE(RandomSampler(10, 0).indices() == seeded_permutation(10, 0));
  REQUIRE(SequentialSampler(4).indices() == std::vector<int64_t>{0, 1, 2, 3});
  REQUIRE(RandomSampler(0, 1).indices().empty());
}

TEST_CASE("seeded_permutation output is pinned", "[data]") {
  // Written by this implementation (xoshiro256** + Fisher-Yates); see the note in the test above.
  const auto p = seeded_permutation(8, 1234);
  std::vector<int64_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  REQUIRE(sorted == iota_vec(8));
  REQUIRE(p == seeded_permutation(8, 1234));
  REQUIRE(p == std::vector<int64_t>{7, 1, 4, 0, 2, 6, 5, 3});
}

// ------------------------------------------------------------------------------------------ datasets

namespace {
// A Dataset that only implements get(), to exercise the default get_batch.
class SquaresDataset : public Dataset {
 public:
  int64_t size() const override { return 6; }
  Batch get(int64_t i) const override {
    return {from_vector(std::vector<float>{float(i), float(i * i), -1.f}, {3}), from_vector(std::vector<int64_t>{i}, {})};
  }
};
// Item i has i + 1 features: items of different shapes cannot be stacked.
class RaggedDataset : public Dataset {
 public:
  int64_t size() const override { return 3; }
  Batch get(int64_t i) const override { return {zeros({i + 1}), zeros({}, DType::Int64)}; }
};
}  // namespace

TEST_CASE("Dataset::get_batch stacks items, TensorDataset gathers rows", "[data]") {
  RaggedDataset ragged;
  REQUIRE(ragged.get_batch({1, 1}).x.shape() == Shape{2, 2});
  REQUIRE_THROWS_AS(ragged.get_batch({0, 2}), ShapeError);
  REQUIRE_THROWS_WITH(ragged.get_batch({0, 2}), Catch::Contains("item 1") && Catch::Contains("[3]"));

  SquaresDataset sq;
  Batch b = sq.get_batch({4, 1, 4});
  REQUIRE(b.x.shape() == Shape{3, 3});
  REQUIRE(b.y.shape() == Shape{3});
  REQUIRE(b.x.tolist() == std::vector<double>{4, 16, -1, 1, 1, -1, 4, 16, -1});
  REQUIRE(b.y.to_vector<int64_t>() == std::vector<int64_t>{4, 1, 4});
  REQUIRE_THROWS_AS(sq.get_batch({6}), IndexError);

  auto ds = indexed_dataset(5);
  REQUIRE(ds->size() == 5);
  Batch g = ds->get_batch({3, 0, 3, 4});
  REQUIRE(g.x.shape() == Shape{4, 2});
  REQUIRE(g.x.tolist() == std::vector<double>{3, 30, 0, 0, 3, 30, 4, 40});
  REQUIRE(g.y.to_vector<int64_t>() == std::vector<int64_t>{3, 0, 3, 4});
  // A batch is a copy: writing to it leaves the data set alone.
  g.x.fill_(-7);
  REQUIRE(ds->get(3).x.tolist() == std::vector<double>{3, 30});
  REQUIRE_THROWS_WITH(ds->get_batch({0, 5}), Catch::Contains("index 5") && Catch::Contains("out of range"));
  REQUIRE_THROWS_AS(ds->get_batch({-1}), IndexError);
  REQUIRE_THROWS_AS(ds->get(5), IndexError);

  // Non-contiguous inputs are stored contiguously; the first dimensions must agree.
  Tensor xt = from_vector(std::vector<float>{0, 1, 2, 3, 4, 5}, {2, 3}).t();  // [3, 2], column-major view
  TensorDataset tds(xt, from_vector(std::vector<int64_t>{7, 8, 9}, {3}));
  REQUIRE(tds.get_batch({2}).x.tolist() == std::vector<double>{2, 5});
  REQUIRE_THROWS_AS(TensorDataset(zeros({3, 2}), zeros({4})), ShapeError);
}

TEST_CASE("synthetic_classification is seeded, balanced and learnable", "[data]") {
  const int64_t n = 600, features = 8, classes = 3;
  auto ds = synthetic_classification(n, features, classes, 5);
  REQUIRE(ds->x().shape() == Shape{n, features});
  REQUIRE(ds->y().dtype() == DType::Int64);
  REQUIRE(synthetic_classification(n, features, classes, 5)->x().tolist() == ds->x().tolist());
  REQUIRE(synthetic_classification(n, features, classes, 6)->x().tolist() != ds->x().tolist());
  const auto x = ds->x().to_vector<double>();
  const auto y = ds->y().to_vector<int64_t>();
  std::vector<int64_t> count(classes, 0);
  for (int64_t label : y) ++count[size_t(label)];
  REQUIRE(count == std::vector<int64_t>(classes, n / classes));
  // Nearest class mean classifies almost every point: the classes are separable.
  std::vector<double> mean(size_t(classes * features), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t f = 0; f < features; ++f) mean[size_t(y[size_t(i)] * features + f)] += x[size_t(i * features + f)];
  for (double& m : mean) m /= double(n / classes);
  int64_t correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t best = -1;
    double best_d = 1e300;
    for (int64_t c = 0; c < classes; ++c) {
      double d = 0;
      for (int64_t f = 0; f < features; ++f) {
        const double diff = x[size_t(i * features + f)] - mean[size_t(c * features + f)];
        d += diff * diff;
      }
      if (d < best_d) best_d = d, best = c;
    }
    correct += best == y[size_t(i)];
  }
  REQUIRE(double(correct) / double(n) > 0.95);
  REQUIRE_THROWS_AS(synthetic_classification(0, 2, 2), ValueError);
}

TEST_CASE("CharDataset windows a text with the target shifted by one", "[data]") {
  CharDataset ds("hello world", 4);
  REQUIRE(ds.size() == 7);
  REQUIRE(ds.vocab_size() == 256);
  Batch b = ds.get(1);
  REQUIRE(b.x.to_vector<int64_t>() == std::vector<int64_t>{'e', 'l', 'l', 'o'});
  REQUIRE(b.y.to_vector<int64_t>() == std::vector<int64_t>{'l', 'l', 'o', ' '});
  Batch last = ds.get(6);
  REQUIRE(last.y.to_vector<int64_t>() == std::vector<int64_t>{'o', 'r', 'l', 'd'});
  Batch g = ds.get_batch({6, 1});
  REQUIRE(g.x.shape() == Shape{2, 4});
  REQUIRE(g.y.to_vector<int64_t>() == std::vector<int64_t>{'o', 'r', 'l', 'd', 'l', 'l', 'o', ' '});
  REQUIRE_THROWS_AS(ds.get(7), IndexError);
  // Bytes above 127 are values 128..255, not negative chars.
  REQUIRE(CharDataset(std::string("\xff\x80\x01"), 1).get(0).x.to_vector<int64_t>() == std::vector<int64_t>{255});

  TempDir dir("char");
  const fs::path file = dir.path / "text.txt";
  std::ofstream(file) << "abcdefgh";
  auto from_file = char_dataset(file.string(), 3);
  REQUIRE(from_file->size() == 5);
  REQUIRE(from_file->get(4).y.to_vector<int64_t>() == std::vector<int64_t>{'f', 'g', 'h'});
  REQUIRE_THROWS_WITH(char_dataset((dir.path / "absent.txt").string(), 3), Catch::Contains("absent.txt"));
  REQUIRE_THROWS_AS(char_dataset(file.string(), 8), DataError);
}

// ------------------------------------------------------------------------------------------ DataLoader

TEST_CASE("DataLoader batches cover the data set in order, with the last batch partial or dropped", "[data]") {
  auto ds = indexed_dataset(10);
  for (int prefetch : {0, 2}) {
    INFO("prefetch " << prefetch);
    DataLoader loader(ds, {.batch_size = 4, .prefetch = prefetch});
    REQUIRE(loader.size() == 3);
    int batches = 0;
    for (auto& [x, y] : loader) {
      const int64_t expected_rows = batches < 2 ? 4 : 2;
      REQUIRE(x.shape() == Shape{expected_rows, 2});
      REQUIRE(y.shape() == Shape{expected_rows});
      // x's rows are the ones y names.
      const auto xs = x.tolist();
      const auto ys = y.to_vector<int64_t>();
      for (int64_t r = 0; r < expected_rows; ++r) {
        REQUIRE(ys[size_t(r)] == batches * 4 + r);
        REQUIRE(xs[size_t(2 * r + 1)] == 10.0 * double(ys[size_t(r)]));
      }
      ++batches;
    }
    REQUIRE(batches == 3);

    DataLoader dropping(ds, {.batch_size = 4, .drop_last = true, .prefetch = prefetch});
    REQUIRE(dropping.size() == 2);
    REQUIRE(flat(pass_labels(dropping)) == iota_vec(8));

    DataLoader exact(ds, {.batch_size = 5, .drop_last = true, .prefetch = prefetch});
    REQUIRE(pass_labels(exact).size() == 2);
    DataLoader one_batch(ds, {.batch_size = 64, .prefetch = prefetch});
    REQUIRE(pass_labels(one_batch) == std::vector<std::vector<int64_t>>{iota_vec(10)});
    DataLoader none(ds, {.batch_size = 64, .drop_last = true, .prefetch = prefetch});
    REQUIRE(none.size() == 0);
    REQUIRE(pass_labels(none).empty());
  }
}

TEST_CASE("DataLoader shuffles deterministically per seed and epoch", "[data]") {
  auto ds = indexed_dataset(50);
  DataLoader a(ds, {.batch_size = 8, .shuffle = true, .seed = 3});
  DataLoader b(ds, {.batch_size = 8, .shuffle = true, .seed = 3, .prefetch = 0});
  DataLoader c(ds, {.batch_size = 8, .shuffle = true, .seed = 4});
  const auto a0 = pass_labels(a);
  std::vector<int64_t> all = flat(a0);
  REQUIRE(all != iota_vec(50));
  std::sort(all.begin(), all.end());
  REQUIRE(all == iota_vec(50));  // every sample once
  REQUIRE(pass_labels(b) == a0);  // same seed, prefetching or not
  REQUIRE(pass_labels(c) != a0);
  // A finished pass advances the epoch, and with it the order.
  REQUIRE(a.epoch() == 1);
  const auto a1 = pass_labels(a);
  REQUIRE(a1 != a0);
  // set_epoch goes back to an epoch's order.
  a.set_epoch(0);
  REQUIRE(pass_labels(a) == a0);
  a.set_epoch(1);
  REQUIRE(pass_labels(a) == a1);
}

TEST_CASE("DataLoader with a DistributedSampler yields the rank's share", "[data]") {
  auto ds = indexed_dataset(10);
  std::multiset<int64_t> seen;
  for (int64_t rank = 0; rank < 3; ++rank) {
    auto sampler = std::make_shared<DistributedSampler>(10, 3, rank, true, 11);
    DataLoader loader(ds, {.batch_size = 2}, sampler);
    REQUIRE(loader.num_samples() == 4);
    REQUIRE(loader.size() == 2);
    loader.set_epoch(5);
    sampler->set_epoch(5);
    const auto mine = flat(pass_labels(loader));
    REQUIRE(mine == sampler->indices());
    seen.insert(mine.begin(), mine.end());
  }
  REQUIRE(seen.size() == 12);
  for (int64_t i = 0; i < 10; ++i) REQUIRE(seen.count(i) >= 1);
  REQUIRE_THROWS_AS(DataLoader(ds, {.batch_size = 2, .shuffle = true}, std::make_shared<SequentialSampler>(10)),
                    ValueError);
}

TEST_CASE("DataLoader rejects bad options", "[data]") {
  auto ds = indexed_dataset(4);
  REQUIRE_THROWS_AS(DataLoader(ds, {.batch_size = 0}), ValueError);
  REQUIRE_THROWS_WITH(DataLoader(ds, {.batch_size = -3}), Catch::Contains("batch_size = -3"));
  REQUIRE_THROWS_AS(DataLoader(ds, {.batch_size = 1, .prefetch = -1}), ValueError);
  REQUIRE_THROWS_AS(DataLoader(nullptr, {}), ValueError);
}

TEST_CASE("DataLoader: leaving a pass early stops the worker, the next pass starts over", "[data]") {
  // Large batches so the worker is busy (or blocked on a full queue) when the consumer leaves.
  auto ds = std::make_shared<TensorDataset>(zeros({20000, 256}), zeros({20000}, DType::Int64));
  for (int round = 0; round < 20; ++round) {
    DataLoader loader(ds, {.batch_size = 500, .shuffle = true, .prefetch = 4});
    int seen = 0;
    for (auto& batch : loader) {
      REQUIRE(batch.x.shape() == Shape{500, 256});
      if (++seen == 2) break;
    }
    REQUIRE(loader.batches_consumed() == 2);
    if (round % 2 == 0) {
      // Without a resume pending, a new pass starts at the first batch of the same epoch.
      int64_t count = 0;
      for (auto& batch : loader) count += batch.x.size(0) == 500;
      REQUIRE(count == 40);
    }
    // Destroying the loader (and, in odd rounds, an abandoned pass) must not hang: a hang is caught
    // by CTest's timeout, not by a clock in the test.
  }
  // An iterator abandoned outside a loop is stopped when destroyed too.
  {
    DataLoader loader(ds, {.batch_size = 100, .prefetch = 2});
    auto it = loader.begin();
    REQUIRE(it != loader.end());
  }
}

namespace {
// Counts the batches asked of it and records, as each is asked for, how far the worker is ahead of the
// consumer: `released` is the batch the consumer is about to move to (set before it advances).
class CountingDataset : public Dataset {
 public:
  int64_t size() const override { return 100; }
  Batch get(int64_t i) const override { return {full({1}, double(i)), full({}, double(i), DType::Int64)}; }
  Batch get_batch(const std::vector<int64_t>& indices) const override {
    const int lead = ++batches_made - released.load();
    for (int seen = max_lead.load(); lead > seen && !max_lead.compare_exchange_weak(seen, lead);) {
    }
    return Dataset::get_batch(indices);
  }
  mutable std::atomic<int> batches_made{0}, max_lead{0};
  std::atomic<int> released{0};
};
}  // namespace

TEST_CASE("DataLoader's worker runs at most `prefetch` batches ahead of the consumer", "[data]") {
  // No clock: the dataset records the worker's lead each time it makes a batch. Holding batch k, the
  // consumer waits until the worker has made every batch it may (k + 1 + prefetch; an unbounded wait,
  // CTest's timeout catches a hang), so at every batch a worker that overruns its queue gets the chance
  // to, and the lead it reached must be exactly 1 + prefetch: the held batch plus a full queue.
  for (int prefetch : {1, 3}) {
    INFO("prefetch " << prefetch);
    auto ds = std::make_shared<CountingDataset>();
    DataLoader loader(ds, {.batch_size = 2, .prefetch = prefetch});
    const int batches = 50;
    int k = 0;
    for (auto it = loader.begin(); it != loader.end(); ++k) {
      REQUIRE(it->y.to_vector<int64_t>() == std::vector<int64_t>{2 * k, 2 * k + 1});
      while (ds->batches_made.load() < std::min(batches, k + 1 + prefetch)) std::this_thread::yield();
      ds->released.store(k + 1);
      ++it;
    }
    CHECK(k == batches);
    CHECK(ds->batches_made.load() == batches);
    CHECK(ds->max_lead.load() == 1 + prefetch);
  }
}

namespace {
// Throws on item `bad` (through the default get_batch), to test that the worker's errors arrive.
class FaultyDataset : public Dataset {
 public:
  explicit FaultyDataset(int64_t bad) : bad_(bad) {}
  int64_t size() const override { return 20; }
  Batch get(int64_t i) const override {
    if (i == bad_) throw DataError("FaultyDataset: item " + std::to_string(i) + " is unreadable");
    return {full({2}, double(i)), full({}, double(i), DType::Int64)};
  }

 private:
  int64_t bad_;
};
}  // namespace

TEST_CASE("DataLoader rethrows a worker's exception when the consumer reaches that batch", "[data]") {
  for (int prefetch : {0, 1, 3}) {
    INFO("prefetch " << prefetch);
    DataLoader loader(std::make_shared<FaultyDataset>(13), {.batch_size = 4, .prefetch = prefetch});
    std::vector<int64_t> got;
    auto consume = [&] {
      for (auto& [x, y] : loader) {
        auto v = y.to_vector<int64_t>();
        got.insert(got.end(), v.begin(), v.end());
      }
    };
    REQUIRE_THROWS_WITH(consume(), Catch::Contains("item 13 is unreadable"));
    REQUIRE(got == iota_vec(12));  // the three batches before the bad one arrived
    REQUIRE(loader.epoch() == 0);  // a failed pass does not finish the epoch
  }
}

TEST_CASE("DataLoader resumes from state_dict with exactly the remaining batches", "[data]") {
  auto ds = indexed_dataset(37);
  const DataLoaderOptions options{.batch_size = 5, .shuffle = true, .seed = 9};
  DataLoader reference(ds, options);
  reference.set_epoch(2);
  const auto full_epoch = pass_labels(reference);
  REQUIRE(full_epoch.size() == 8);

  for (int64_t stop_after : {0, 1, 3, 7, 8}) {
    INFO("stop after " << stop_after);
    DataLoader first(ds, options);
    first.set_epoch(2);
    nlohmann::json state = first.state_dict();
    int64_t k = 0;
    if (stop_after > 0) {
      for (auto& batch : first) {
        (void)batch;
        if (++k == stop_after) {
          state = first.state_dict();  // saved inside the loop, after training on batch k
          break;
        }
      }
    }
    REQUIRE(state.at("epoch") == 2);
    REQUIRE(state.at("batches_consumed") == stop_after);
    REQUIRE(state.at("seed") == 9);

    // A fresh loader (another process), even one made with another seed, takes the state.
    DataLoader resumed(ds, {.batch_size = 5, .shuffle = true, .seed = 1234});
    resumed.load_state_dict(nlohmann::json::parse(state.dump()));
    resumed.set_epoch(2);  // the usual loop header; it keeps the pending resume
    const auto rest = pass_labels(resumed);
    REQUIRE(rest == std::vector<std::vector<int64_t>>(full_epoch.begin() + stop_after, full_epoch.end()));
    // Then the next epoch, complete.
    REQUIRE(resumed.epoch() == 3);
    REQUIRE(pass_labels(resumed).size() == 8);
  }

  DataLoader loader(ds, options);
  REQUIRE_THROWS_AS(loader.load_state_dict({{"epoch", 0}, {"seed", 9}}), CheckpointError);
  REQUIRE_THROWS_WITH(loader.load_state_dict({{"epoch", 0}, {"batches_consumed", 9}, {"seed", 9}}),
                      Catch::Contains("9 batches consumed") && Catch::Contains("8 batches"));
  // Choosing another epoch drops a pending resume.
  loader.load_state_dict({{"epoch", 2}, {"batches_consumed", 6}, {"seed", 9}});
  loader.set_epoch(2);
  REQUIRE(pass_labels(loader).size() == 2);
  loader.load_state_dict({{"epoch", 2}, {"batches_consumed", 6}, {"seed", 9}});
  loader.set_epoch(0);
  REQUIRE(pass_labels(loader).size() == 8);
}

// ------------------------------------------------------------------------------------------ Fashion-MNIST

TEST_CASE("Fashion-MNIST loads both splits with labels 0..9 and pixels in [0, 1]", "[data]") {
  if (!fashion_mnist_present()) return;
  for (bool train : {true, false}) {
    auto ds = load_fashion_mnist(kFashionMnistDir, train);
    const int64_t n = train ? 60000 : 10000;
    REQUIRE(ds->size() == n);
    REQUIRE(ds->x().shape() == Shape{n, 784});
    REQUIRE(ds->x().dtype() == DType::Float32);
    REQUIRE(ds->y().shape() == Shape{n});
    REQUIRE(ds->y().dtype() == DType::Int64);
    // Fashion-MNIST is balanced: n / 10 of each class.
    std::vector<int64_t> count(10, 0);
    for (int64_t label : ds->y().to_vector<int64_t>()) {
      REQUIRE((label >= 0 && label <= 9));
      ++count[size_t(label)];
    }
    REQUIRE(count == std::vector<int64_t>(10, n / 10));
    const float* px = ds->x().data<float>();
    double lo = 1e9, hi = -1e9, sum = 0;
    for (int64_t i = 0; i < n * 784; ++i) {
      lo = std::min<double>(lo, px[i]);
      hi = std::max<double>(hi, px[i]);
      sum += px[i];
    }
    REQUIRE(lo == 0.0);
    REQUIRE(hi == 1.0);
    if (train) REQUIRE(sum / double(n * 784) == Approx(kFashionMnistMean).margin(5e-4));
  }
  // Normalized: the training pixels have mean 0 and std 1 (to the precision of the constants).
  auto norm = load_fashion_mnist(kFashionMnistDir, true, /*normalize=*/true);
  const float* px = norm->x().data<float>();
  const int64_t total = norm->x().numel();
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < total; ++i) sum += px[i], sq += double(px[i]) * px[i];
  const double mean = sum / double(total);
  REQUIRE(mean == Approx(0.0).margin(2e-3));
  REQUIRE(std::sqrt(sq / double(total) - mean * mean) == Approx(1.0).margin(3e-3));
}

TEST_CASE("Fashion-MNIST: missing, truncated and malformed files give DataError naming the file", "[data]") {
  TempDir dir("fmnist");
  // Missing: the message names the path and the package that provides it.
  REQUIRE_THROWS_AS(load_fashion_mnist(dir.path.string(), false), DataError);
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path.string(), false),
                      Catch::Contains((dir.path / "t10k-images-idx3-ubyte.gz").string()) &&
                          Catch::Contains("apt-get install dataset-fashion-mnist"));
  if (!fashion_mnist_present()) return;

  const fs::path src(kFashionMnistDir);
  const fs::path images = dir.path / "t10k-images-idx3-ubyte.gz", labels = dir.path / "t10k-labels-idx1-ubyte.gz";
  fs::copy_file(src / "t10k-images-idx3-ubyte.gz", images);
  fs::copy_file(src / "t10k-labels-idx1-ubyte.gz", labels);
  REQUIRE(load_fashion_mnist(dir.path.string(), false)->size() == 10000);  // the copies are fine

  // Truncated images: the gzip stream ends early.
  fs::resize_file(images, fs::file_size(images) / 2);
  REQUIRE_THROWS_AS(load_fashion_mnist(dir.path.string(), false), DataError);
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path.string(), false),
                      Catch::Contains(images.string()) && Catch::Contains("truncated"));

  // Corrupt labels (compressed bytes overwritten): zlib's checks fail.
  fs::copy_file(src / "t10k-images-idx3-ubyte.gz", images, fs::copy_options::overwrite_existing);
  {
    std::fstream f(labels, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2000);
    const std::string junk(200, '\x5a');
    f.write(junk.data(), std::streamsize(junk.size()));
  }
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path.string(), false), Catch::Contains(labels.string()));

  // An uncompressed file with the wrong magic number (the images file where the labels should be).
  fs::remove(labels);
  const fs::path raw_labels = dir.path / "t10k-labels-idx1-ubyte";
  {
    std::ofstream f(raw_labels, std::ios::binary);
    const unsigned char header[] = {0, 0, 8, 3, 0, 0, 0, 1};
    f.write(reinterpret_cast<const char*>(header), sizeof header);
  }
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path.string(), false),
                      Catch::Contains(raw_labels.string()) && Catch::Contains("magic number 0x803"));
  // Right magic, too few labels for its header.
  {
    std::ofstream f(raw_labels, std::ios::binary);
    const unsigned char header[] = {0, 0, 8, 1, 0, 0, 0x27, 0x10, 1, 2, 3};
    f.write(reinterpret_cast<const char*>(header), sizeof header);
  }
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path.string(), false),
                      Catch::Contains(raw_labels.string()) && Catch::Contains("truncated"));
  // A label file of another split: the counts disagree.
  {
    std::ofstream f(raw_labels, std::ios::binary);
    const unsigned char header[] = {0, 0, 8, 1, 0, 0, 0, 5, 1, 2, 3, 4, 5};
    f.write(reinterpret_cast<const char*>(header), sizeof header);
  }
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path.string(), false),
                      Catch::Contains("10000 images") && Catch::Contains("5 labels"));
  // Right sizes but a label out of 0..9.
  {
    std::ofstream f(raw_labels, std::ios::binary);
    const unsigned char header[] = {0, 0, 8, 1, 0, 0, 0x27, 0x10};
    f.write(reinterpret_cast<const char*>(header), sizeof header);
    std::string body(10000, '\x03');
    body[77] = 12;
    f.write(body.data(), std::streamsize(body.size()));
  }
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path.string(), false),
                      Catch::Contains("label 12 at index 77"));
}

TEST_CASE("DataLoader's collate builds each batch from its items, in sampler order", "[data]") {
  auto ds = indexed_dataset(10);
  for (int prefetch : {0, 2}) {
    DataLoaderOptions opt;
    opt.batch_size = 4;
    opt.prefetch = prefetch;
    std::vector<std::vector<int64_t>> seen;
    // A collate that keeps only the labels, as a sum, and records the items it was given.
    opt.collate = [&seen](std::vector<Batch> items) {
      std::vector<int64_t> labels;
      for (const Batch& b : items) labels.push_back(int64_t(b.y.item()));
      seen.push_back(labels);
      int64_t total = 0;
      for (int64_t l : labels) total += l;
      return Batch{from_vector(std::vector<int64_t>{total}, {1}), from_vector(std::vector<int64_t>{int64_t(labels.size())}, {1})};
    };
    DataLoader loader(ds, opt);
    std::vector<double> sums, counts;
    for (auto& [x, y] : loader) {
      sums.push_back(x.item());
      counts.push_back(y.item());
    }
    REQUIRE(sums == std::vector<double>{0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9});
    REQUIRE(counts == std::vector<double>{4, 4, 2});
    REQUIRE(seen == std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}});
  }
}
