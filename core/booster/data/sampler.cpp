#include "booster/data/sampler.h"

#include <numeric>
#include <utility>

#include "booster/common/error.h"
#include "booster/tensor/random.h"

namespace booster::data {

Sampler::~Sampler() = default;

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t(0));
  Generator gen(seed);
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[size_t(i)], p[size_t(gen.randint(0, i + 1))]);
  return p;
}

SequentialSampler::SequentialSampler(int64_t n) : n_(n) {
  BOOSTER_CHECK(n >= 0, ValueError, "SequentialSampler: n = ", n, " must be >= 0");
}

std::vector<int64_t> SequentialSampler::indices() const {
  std::vector<int64_t> p(static_cast<size_t>(n_));
  std::iota(p.begin(), p.end(), int64_t(0));
  return p;
}

RandomSampler::RandomSampler(int64_t n, uint64_t seed) : n_(n), seed_(seed) {
  BOOSTER_CHECK(n >= 0, ValueError, "RandomSampler: n = ", n, " must be >= 0");
}

std::vector<int64_t> RandomSampler::indices() const {
  return seeded_permutation(n_, seed_ + uint64_t(epoch_));
}

DistributedSampler::DistributedSampler(int64_t n, int64_t num_replicas, int64_t rank, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : n_(n), num_replicas_(num_replicas), rank_(rank), shuffle_(shuffle), seed_(seed), drop_last_(drop_last) {
  BOOSTER_CHECK(n >= 0, ValueError, "DistributedSampler: n = ", n, " must be >= 0");
  BOOSTER_CHECK(num_replicas >= 1, ValueError, "DistributedSampler: num_replicas = ", num_replicas,
                " must be >= 1");
  BOOSTER_CHECK(rank >= 0 && rank < num_replicas, ValueError, "DistributedSampler: rank ", rank,
                " is out of range for num_replicas ", num_replicas, "; expected 0 <= rank < ", num_replicas);
  // torch: with drop_last the tail that does not divide evenly is dropped, else the order is padded.
  num_samples_ = drop_last ? n / num_replicas : (n + num_replicas - 1) / num_replicas;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order;
  if (shuffle_) {
    order = seeded_permutation(n_, seed_ + uint64_t(epoch_));
  } else {
    order.resize(size_t(n_));
    std::iota(order.begin(), order.end(), int64_t(0));
  }
  const int64_t total = total_size();
  std::vector<int64_t> mine;
  mine.reserve(size_t(num_samples_));
  // Position k of the padded order is order[k % n] (torch repeats the order from its start, as many
  // times as needed); truncation is simply never reading past `total`.
  for (int64_t k = rank_; k < total; k += num_replicas_) mine.push_back(order[size_t(k % n_)]);
  return mine;
}

}  // namespace booster::data
