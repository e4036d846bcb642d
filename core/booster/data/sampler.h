// Samplers: the order in which a DataLoader visits a data set, as torch.utils.data samplers.
//
// Note [Deterministic shuffling]
// A shuffled order is a Fisher-Yates permutation drawn from booster::Generator seeded with
// seed + epoch, the rule torch's DistributedSampler uses. The generator and the permutation are ours
// (not the C++ library's distributions), so the same seed and epoch give the same order on every
// machine and compiler, and every rank of a data-parallel job agrees on it without communication.
// The order is a function of (seed, epoch) alone, which is also what makes a DataLoader resumable:
// a checkpoint stores the epoch and the number of batches consumed, not a generator state.
#pragma once

#include <cstdint>
#include <vector>

namespace booster::data {

class Sampler {
 public:
  virtual ~Sampler();
  // The indices of one pass for the current epoch; size() of them.
  virtual std::vector<int64_t> indices() const = 0;
  virtual int64_t size() const = 0;
  // Selects the epoch, and with it the shuffled order (Note [Deterministic shuffling]).
  virtual void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

 protected:
  int64_t epoch_ = 0;
};

// A permutation of 0..n-1 drawn from Generator(seed) (Fisher-Yates).
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed);

// 0, 1, ..., n-1.
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t n);
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return n_; }

 private:
  int64_t n_;
};

// A permutation of 0..n-1 that changes with the epoch: seeded_permutation(n, seed + epoch).
class RandomSampler : public Sampler {
 public:
  explicit RandomSampler(int64_t n, uint64_t seed = 0);
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return n_; }
  uint64_t seed() const { return seed_; }

 private:
  int64_t n_;
  uint64_t seed_;
};

// The share of rank `rank` among `num_replicas` processes, with torch.utils.data.DistributedSampler's
// semantics: the (shuffled or sequential) order is padded by repeating its first indices until it
// divides evenly (every rank gets ceil(n / num_replicas)), or with drop_last truncated to a multiple of
// num_replicas (every rank gets floor(n / num_replicas)); rank r then takes positions r, r + world, ...
// Every rank must be built with the same n, seed and epoch.
class DistributedSampler : public Sampler {
 public:
  DistributedSampler(int64_t n, int64_t num_replicas, int64_t rank, bool shuffle = true, uint64_t seed = 0,
                     bool drop_last = false);
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return num_samples_; }  // per rank
  int64_t total_size() const { return num_samples_ * num_replicas_; }
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }
  bool shuffle() const { return shuffle_; }
  uint64_t seed() const { return seed_; }
  bool drop_last() const { return drop_last_; }

 private:
  int64_t n_, num_replicas_, rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t num_samples_;
};

}  // namespace booster::data
