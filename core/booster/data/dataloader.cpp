#include "booster/data/dataloader.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "booster/common/error.h"

namespace booster::data {

namespace detail {

// The batches [first, end) of one pass over `order`, made in the caller's thread (prefetch 0) or by a
// worker thread that keeps up to `prefetch` finished batches in a queue.
class BatchSource {
 public:
  BatchSource(DatasetPtr dataset, std::vector<int64_t> order, int64_t batch_size, int64_t first, int64_t end,
              int prefetch, std::function<Batch(std::vector<Batch>)> collate)
      : dataset_(std::move(dataset)),
        collate_(std::move(collate)),
        order_(std::move(order)),
        batch_size_(batch_size),
        next_(first),
        end_(end),
        capacity_(size_t(prefetch)) {
    if (prefetch == 0) return;
    if (first < end)
      worker_ = std::thread([this] { run_worker(); });
    else
      worker_done_ = true;  // an empty pass needs no worker
  }

  ~BatchSource() {
    if (worker_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
      }
      can_put_.notify_all();
      worker_.join();
    }
  }

  BatchSource(const BatchSource&) = delete;
  BatchSource& operator=(const BatchSource&) = delete;

  // The next batch into `out`; false when the pass is over. Rethrows what the worker threw.
  bool next(Batch& out) {
    if (capacity_ == 0) {
      if (next_ >= end_) return false;
      out = make(next_++);
      return true;
    }
    std::unique_lock<std::mutex> lock(mu_);
    can_take_.wait(lock, [&] { return !queue_.empty() || worker_done_; });
    if (!queue_.empty()) {
      out = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      can_put_.notify_one();
      return true;
    }
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    return false;
  }

 private:
  Batch make(int64_t b) const {
    const auto from = order_.begin() + b * batch_size_;
    const auto to = order_.begin() + std::min<int64_t>((b + 1) * batch_size_, int64_t(order_.size()));
    if (!collate_) return dataset_->get_batch(std::vector<int64_t>(from, to));
    std::vector<Batch> items;
    items.reserve(size_t(to - from));
    for (auto it = from; it != to; ++it) items.push_back(dataset_->get(*it));
    return collate_(std::move(items));
  }

  void run_worker() {
    for (int64_t b = next_; b < end_; ++b) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        can_put_.wait(lock, [&] { return stop_ || queue_.size() < capacity_; });
        if (stop_) return;
      }
      Batch batch;
      try {
        batch = make(b);
      } catch (...) {
        finish(std::current_exception());
        return;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        queue_.push_back(std::move(batch));
      }
      can_take_.notify_one();
    }
    finish(nullptr);
  }

  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::move(error);
      worker_done_ = true;
    }
    can_take_.notify_one();
  }

  const DatasetPtr dataset_;
  const std::function<Batch(std::vector<Batch>)> collate_;
  const std::vector<int64_t> order_;
  const int64_t batch_size_;
  int64_t next_;  // the next batch to make (the worker's start when there is one)
  const int64_t end_;
  const size_t capacity_;

  std::mutex mu_;
  std::condition_variable can_put_;   // the queue has room, or stop_
  std::condition_variable can_take_;  // the queue has a batch, or worker_done_
  std::deque<Batch> queue_;
  bool stop_ = false;
  bool worker_done_ = false;
  std::exception_ptr error_;
  std::thread worker_;  // last: starts after every other member exists
};

}  // namespace detail

// ------------------------------------------------------------------------------------------ Iterator

DataLoader::Iterator::Iterator() = default;
DataLoader::Iterator::Iterator(Iterator&&) noexcept = default;
DataLoader::Iterator& DataLoader::Iterator::operator=(Iterator&&) noexcept = default;
DataLoader::Iterator::~Iterator() = default;

DataLoader::Iterator::Iterator(DataLoader* loader, std::unique_ptr<detail::BatchSource> source)
    : loader_(loader), source_(std::move(source)) {
  advance();
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  advance();
  return *this;
}

void DataLoader::Iterator::advance() {
  if (!source_) return;
  bool got = false;
  try {
    got = source_->next(current_);
  } catch (...) {
    source_.reset();
    current_ = {};
    throw;
  }
  if (got) {
    ++loader_->consumed_;
    if (!loader_->options_.device.is_cpu()) {
      current_.x = current_.x.to(loader_->options_.device);
      current_.y = current_.y.to(loader_->options_.device);
    }
    return;
  }
  // The pass ran to its end: the next one belongs to the next epoch.
  source_.reset();
  current_ = {};
  ++loader_->epoch_;
  loader_->consumed_ = 0;
}

// ---------------------------------------------------------------------------------------- DataLoader

DataLoader::DataLoader(DatasetPtr dataset, DataLoaderOptions options, std::shared_ptr<Sampler> sampler)
    : dataset_(std::move(dataset)), options_(options), sampler_(std::move(sampler)) {
  BOOSTER_CHECK(dataset_ != nullptr, ValueError, "DataLoader: the data set is null");
  BOOSTER_CHECK(options_.batch_size > 0, ValueError, "DataLoader: batch_size = ", options_.batch_size,
                " must be a positive integer");
  BOOSTER_CHECK(options_.prefetch >= 0, ValueError, "DataLoader: prefetch = ", options_.prefetch,
                " must be >= 0 (0 assembles batches in the calling thread)");
  BOOSTER_CHECK(!(sampler_ && options_.shuffle), ValueError,
                "DataLoader: a sampler option is mutually exclusive with shuffle; shuffle inside the sampler "
                "(e.g. DistributedSampler(..., shuffle=true)) and leave shuffle false");
  if (!sampler_) {
    owns_sampler_ = true;
    if (options_.shuffle)
      sampler_ = std::make_shared<RandomSampler>(dataset_->size(), options_.seed);
    else
      sampler_ = std::make_shared<SequentialSampler>(dataset_->size());
  }
}

DataLoader::~DataLoader() = default;

int64_t DataLoader::size() const {
  const int64_t n = sampler_->size(), b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

DataLoader::Iterator DataLoader::begin() {
  if (!resume_pending_) consumed_ = 0;
  resume_pending_ = false;
  sampler_->set_epoch(epoch_);
  std::vector<int64_t> order = sampler_->indices();
  auto source = std::make_unique<detail::BatchSource>(dataset_, std::move(order), options_.batch_size, consumed_,
                                                      size(), options_.prefetch, options_.collate);
  return Iterator(this, std::move(source));
}

void DataLoader::set_epoch(int64_t epoch) {
  if (epoch == epoch_) return;  // keeps a resume pending for this epoch
  epoch_ = epoch;
  consumed_ = 0;
  resume_pending_ = false;
}

nlohmann::json DataLoader::state_dict() const {
  return {{"epoch", epoch_}, {"batches_consumed", consumed_}, {"seed", options_.seed}};
}

void DataLoader::load_state_dict(const nlohmann::json& state) {
  for (const char* key : {"epoch", "batches_consumed", "seed"})
    BOOSTER_CHECK(state.contains(key) && state.at(key).is_number_integer(), CheckpointError,
                  "DataLoader.load_state_dict: the state lacks the integer key \"", key, "\" (got ", state.dump(),
                  "); expected {\"epoch\", \"batches_consumed\", \"seed\"} as saved by state_dict()");
  const auto epoch = state.at("epoch").get<int64_t>();
  const auto consumed = state.at("batches_consumed").get<int64_t>();
  const auto seed = state.at("seed").get<uint64_t>();
  BOOSTER_CHECK(epoch >= 0, CheckpointError, "DataLoader.load_state_dict: epoch ", epoch, " must be >= 0");
  BOOSTER_CHECK(consumed >= 0 && consumed <= size(), CheckpointError, "DataLoader.load_state_dict: ",
                consumed, " batches consumed does not fit an epoch of ", size(),
                " batches; the state comes from a loader with another data set, batch size or sampler");
  if (seed != options_.seed) {
    // The order is a function of the seed: take the saved one so the remaining batches are the same.
    options_.seed = seed;
    if (owns_sampler_ && options_.shuffle) sampler_ = std::make_shared<RandomSampler>(dataset_->size(), seed);
  }
  epoch_ = epoch;
  consumed_ = consumed;
  resume_pending_ = true;
}

}  // namespace booster::data
