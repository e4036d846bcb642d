// DataLoader: batches of a data set in sampler order, assembled ahead by a background thread.
//
//   auto train = load_fashion_mnist(kFashionMnistDir, /*train=*/true);
//   DataLoader loader(train, {.batch_size = 256, .shuffle = true, .seed = 42});
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     loader.set_epoch(epoch);
//     for (auto& [x, y] : loader) { ... }
//   }
//
// Note [DataLoader passes and resuming]
// A pass is one range-for over the loader. begin() draws the epoch's order from the sampler
// (Note [Deterministic shuffling]) and starts a worker thread that assembles the next `prefetch`
// batches into a bounded queue while the consumer trains on the current one. The pass belongs to the
// iterator begin() returns: leaving the loop early (break, an exception) destroys it, which stops and
// joins the worker, so nothing hangs or leaks. An exception thrown while assembling a batch is carried
// over and rethrown by the consumer when it reaches that batch.
// The loader counts the batches it has handed out in the current epoch. state_dict() saves
// {epoch, batches_consumed, seed}; because the order depends only on (seed, epoch), a loader given
// that state by load_state_dict() yields exactly the remaining batches of that epoch on its next pass.
// A pass that runs to the end advances the epoch by one (so looping again reshuffles, as torch's
// RandomSampler does); set_epoch(e) picks an epoch explicitly, as torch's DistributedSampler wants.
// Without a resume pending, every pass starts at the epoch's first batch, as a new torch iterator does.
#pragma once

#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>

#include "booster/data/dataset.h"
#include "booster/data/sampler.h"

namespace booster::data {

struct DataLoaderOptions {
  int64_t batch_size = 1;
  bool shuffle = false;    // a new permutation per epoch (RandomSampler(n, seed)); needs no sampler
  bool drop_last = false;  // drop the last batch when it would be smaller than batch_size
  uint64_t seed = 0;
  // Batches assembled ahead by a worker thread; 0 assembles them in the caller. With a worker, the
  // data set's get_batch runs on that thread, concurrently with the training loop: it must only read.
  int prefetch = 2;
  // Builds a batch from its items (dataset.get(i) for each index, in order), as torch's collate_fn.
  // Empty: the data set's get_batch, which for a TensorDataset gathers the rows in one pass.
  std::function<Batch(std::vector<Batch> items)> collate;
  // Where batches are handed out: x and y are moved there as each batch is taken (the Booster sets its
  // device). Assembling stays on the CPU.
  Device device = Device::cpu();
};

namespace detail {
class BatchSource;
}

class DataLoader {
 public:
  // `sampler` replaces the default order (SequentialSampler, or RandomSampler with shuffle); passing
  // both a sampler and shuffle is a ValueError, as in torch.
  DataLoader(DatasetPtr dataset, DataLoaderOptions options = {}, std::shared_ptr<Sampler> sampler = nullptr);
  ~DataLoader();
  // Iterators point to their loader, so a loader stays where it was made.
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // A single-pass input iterator that owns its pass (Note [DataLoader passes and resuming]).
  // Move-only: copying would duplicate the worker thread's pass.
  class Iterator {
   public:
    using iterator_concept = std::input_iterator_tag;
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using reference = Batch&;
    using pointer = Batch*;

    Iterator();  // the end
    Iterator(Iterator&&) noexcept;
    Iterator& operator=(Iterator&&) noexcept;
    ~Iterator();

    Batch& operator*() const { return current_; }
    Batch* operator->() const { return &current_; }
    Iterator& operator++();
    void operator++(int) { ++*this; }
    bool operator==(const Iterator& other) const { return at_end() == other.at_end(); }
    bool at_end() const { return source_ == nullptr; }

   private:
    friend class DataLoader;
    Iterator(DataLoader* loader, std::unique_ptr<detail::BatchSource> source);
    void advance();

    DataLoader* loader_ = nullptr;
    std::unique_ptr<detail::BatchSource> source_;
    mutable Batch current_;
  };

  Iterator begin();
  Iterator end() { return Iterator(); }

  // Batches per epoch: ceil(samples / batch_size), or floor with drop_last.
  int64_t size() const;
  // Samples per epoch (the sampler's size: a rank's share under a DistributedSampler).
  int64_t num_samples() const { return sampler_->size(); }

  // Selects the epoch of the next pass. Choosing the epoch a resume is pending for keeps the resume.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  // Batches handed out so far in the current epoch.
  int64_t batches_consumed() const { return consumed_; }

  // {"epoch", "batches_consumed", "seed"}.
  nlohmann::json state_dict() const;
  // Makes the next pass yield the remaining batches of the saved epoch. CheckpointError when a key is
  // missing or the position does not fit this loader.
  void load_state_dict(const nlohmann::json& state);

  const DataLoaderOptions& options() const { return options_; }
  // Where the next batches go (DataLoaderOptions::device).
  void set_device(Device device) { options_.device = device; }
  const Dataset& dataset() const { return *dataset_; }
  Sampler& sampler() { return *sampler_; }

 private:
  DatasetPtr dataset_;
  DataLoaderOptions options_;
  std::shared_ptr<Sampler> sampler_;
  bool owns_sampler_ = false;
  int64_t epoch_ = 0;
  int64_t consumed_ = 0;
  bool resume_pending_ = false;
};

}  // namespace booster::data
