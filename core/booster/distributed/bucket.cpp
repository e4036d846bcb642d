#include "booster/distributed/bucket.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "booster/autograd/autograd.h"
#include "booster/common/error.h"
#include "booster/ops/ops.h"

namespace booster::distributed {

namespace {
// torch's _DEFAULT_FIRST_BUCKET_BYTES: a small first bucket gets communication going early.
constexpr int64_t kFirstBucketBytes = int64_t(1) << 20;
}  // namespace

// Note [Progress thread]
// With options.progress_thread, a thread polls the oldest bucket in flight (Work::is_completed, one
// MPI_Testall) every kPollInterval while backward computes, so a collective advances during the
// GEMMs instead of only when a hook runs. Works are handed over under a mutex; the thread touches
// only the works it was given, and wait() first stops it (waiting until it is out of MPI) and then
// waits for every work itself, so no Work is ever used by two threads at once.
namespace {
constexpr auto kPollInterval = std::chrono::microseconds(50);
}  // namespace

struct ProgressThread {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<WorkPtr> queue;  // handed over, in launch order
  size_t completed = 0;        // queue[0, completed) are known complete
  bool paused = false;         // wait() is running: hands off
  bool busy = false;           // inside is_completed()
  bool stop = false;
  std::thread thread;

  ProgressThread() : thread([this] { run(); }) {}
  ~ProgressThread() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    thread.join();
  }

  void hand_over(WorkPtr work) {
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(work));
    }
    cv.notify_all();
  }

  // Stops polling; returns once the thread is out of is_completed(). resume() clears the queue.
  void pause() {
    std::unique_lock<std::mutex> lock(mu);
    paused = true;
    cv.wait(lock, [&] { return !busy; });
  }
  void resume() {
    std::lock_guard<std::mutex> lock(mu);
    queue.clear();
    completed = 0;
    paused = false;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || (!paused && completed < queue.size()); });
      if (stop) return;
      WorkPtr work = queue[completed];
      busy = true;
      lock.unlock();
      bool done = false;
      try {
        done = work->is_completed();
      } catch (...) {
        done = true;  // wait() will see the failure and report it
      }
      lock.lock();
      busy = false;
      cv.notify_all();
      if (done) {
        ++completed;
      } else {
        lock.unlock();
        std::this_thread::sleep_for(kPollInterval);
        lock.lock();
      }
    }
  }
};

// One parameter that requires grad: where its gradient lives and which bucket holds it.
struct ParamSlot {
  size_t buffer, index, bucket;
  bool ready = false;  // its grad-ready hook ran in the current backward
  // It got a gradient in a backward under no_sync since the last synced one: the accumulated sum holds
  // it, so with find_unused_parameters it counts as used (torch keeps its local_used_map likewise).
  bool used_unsynced = false;
};

struct GradientBucketer::State {
  ProcessGroup* group;
  std::vector<const optim::FlatBuffer*> buffers;
  GradientBucketerOptions options;
  std::vector<Bucket> buckets;
  std::vector<ParamSlot> slots;
  std::vector<int64_t> slots_per_bucket;  // parameters that must report ready per bucket
  std::vector<int64_t> pending;           // ... still missing in the current backward
  size_t next_to_launch = 0;              // buckets [0, next_to_launch) are launched
  std::deque<WorkPtr> works;              // launched, not yet waited for (in launch order)
  size_t polled = 0;                      // works[0, polled) are known complete
  Tensor used_flags;                      // find_unused_parameters: int32 per slot, Max-reduced, on
  Tensor used_flags_host;                 // ... the group's device; the host's copy (the same tensor on a CPU group)
  WorkPtr used_flags_work;
  bool sync = true;
  bool in_flight = false;  // something launched since the last wait()
  int64_t launched_in_hooks = 0, launched_at_finish = 0;  // in the current backward
  std::unique_ptr<ProgressThread> progress;                 // with options.progress_thread
  GradientBucketStats stats;

  // The flat gradient slot of a parameter, as a tensor of the parameter's shape.
  Tensor grad_slot(const ParamSlot& s) const {
    const optim::FlatBuffer& fb = *buffers[s.buffer];
    const Tensor& p = fb.params()[s.index];
    return make_view(fb.grad(), p.shape(), contiguous_strides(p.shape()), fb.grad().offset() + fb.offset(s.index));
  }

  bool is_slot(const Tensor& g, const ParamSlot& s) const {
    const optim::FlatBuffer& fb = *buffers[s.buffer];
    return g.defined() && g.storage() == fb.grad().storage() &&
           g.offset() == fb.grad().offset() + fb.offset(s.index) && g.dtype() == fb.dtype() &&
           g.shape() == fb.params()[s.index].shape() && g.is_contiguous();
  }

  // A gradient that backward created outside the flat buffer (after a zero_grad that set it to None)
  // is copied into its slot before the bucket is reduced, else the reduction would miss it.
  void adopt_gradient(const ParamSlot& s, Tensor& param) {
    const Tensor g = param.grad();
    if (!g.defined() || is_slot(g, s)) return;
    NoGradGuard no_grad;
    Tensor slot = grad_slot(s);
    slot.copy_(g);  // bumps the slot's version: the gradient arrived
    param.set_grad(slot);
  }

  void on_grad_ready(size_t slot_index, Tensor& param) {
    ParamSlot& s = slots[slot_index];
    if (!sync) {
      s.used_unsynced = true;
      return;
    }
    BOOSTER_CHECK(!s.ready, StateError, "data parallel: the gradient of '", param.name(),
                  "' became ready twice before its bucket was synchronised (two backwards without "
                  "finish_backward() between them); call backward through the booster (booster.backward), "
                  "or use no_sync() for gradient accumulation");
    adopt_gradient(s, param);
    s.ready = true;
    if (--pending[s.bucket] == 0) launch_ready_buckets();
    poll();
  }

  void launch(size_t b, bool from_hook) {
    const Bucket& bucket = buckets[b];
    const BufferSpan span = BufferSpan::of(buffers[bucket.buffer]->grad(), "GradientBucketer")
                                .slice(bucket.begin, bucket.end - bucket.begin);
    works.push_back(group->all_reduce_async(span, options.op));
    if (progress) progress->hand_over(works.back());
    in_flight = true;
    ++(from_hook ? launched_in_hooks : launched_at_finish);
  }

  void launch_ready_buckets() {
    while (next_to_launch < buckets.size() && pending[next_to_launch] == 0) launch(next_to_launch++, true);
  }

  // Moves outstanding collectives along (Note [Gradient buckets], "Progress").
  void poll() {
    if (progress || !group->device().is_cpu()) return;  // the thread polls; NCCL needs no polling
    while (polled < works.size() && works[polled]->is_completed()) ++polled;
  }

  void finish_backward() {
    if (!sync) return;
    while (next_to_launch < buckets.size()) launch(next_to_launch++, false);
    if (options.find_unused_parameters) {
      int32_t* flags = used_flags_host.data<int32_t>();
      std::fill(flags, flags + used_flags_host.numel(), 0);
      for (size_t i = 0; i < slots.size(); ++i) flags[i] = slots[i].ready || slots[i].used_unsynced ? 1 : 0;
      // On a GPU group the flags travel to the device and back (Note [Gradient buckets], "Arrival").
      if (used_flags.data_ptr() != used_flags_host.data_ptr()) used_flags.copy_(used_flags_host);
      used_flags_work = group->all_reduce_async(used_flags, ReduceOp::Max);
      in_flight = true;
    }
    // Ready for the next backward.
    for (ParamSlot& s : slots) s.ready = s.used_unsynced = false;
    pending = slots_per_bucket;
    next_to_launch = 0;
    ++stats.synced_backwards;
    stats.launched_in_hooks += launched_in_hooks;
    stats.launched_at_finish += launched_at_finish;
    stats.last_launched_in_hooks = launched_in_hooks;
    stats.last_launched_at_finish = launched_at_finish;
    launched_in_hooks = launched_at_finish = 0;
  }

  void wait() {
    if (!in_flight) return;
    const auto start = std::chrono::steady_clock::now();
    if (progress) progress->pause();
    try {
      for (WorkPtr& w : works) w->wait();
    } catch (...) {
      if (progress) progress->resume();
      throw;
    }
    if (progress) progress->resume();
    works.clear();
    polled = 0;
    if (used_flags_work) {
      used_flags_work->wait();
      // A copy to the host synchronizes the stream the all-reduce is on (Note [When a collective's
      // result is there]); reading the device buffer any other way could see stale flags.
      if (used_flags.data_ptr() != used_flags_host.data_ptr()) used_flags_host.copy_(used_flags);
    }
    used_flags_work.reset();
    stats.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    in_flight = false;
    mark_arrived();
  }

  // Note [Gradient buckets], "Arrival": every rank now holds the same gradients and must agree on
  // which of them arrived.
  void mark_arrived() {
    const int32_t* used = options.find_unused_parameters ? used_flags_host.data<int32_t>() : nullptr;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (used && used[i] == 0) continue;
      const ParamSlot& s = slots[i];
      const Tensor& p = buffers[s.buffer]->params()[s.index];
      const Tensor g = p.grad();
      if (is_slot(g, s)) {
        if (g.version() == 0) g.bump_version();
      } else {
        // No gradient on this rank (or one outside the buffer that never reached a hook): the slot
        // holds the reduced value.
        Tensor slot = grad_slot(s);
        slot.bump_version();
        p.set_grad(slot);
      }
    }
  }
};

GradientBucketer::GradientBucketer(ProcessGroup& group, std::vector<const optim::FlatBuffer*> buffers,
                                   GradientBucketerOptions options)
    : state_(std::make_shared<State>()) {
  BOOSTER_CHECK(std::isfinite(options.bucket_cap_mb) && options.bucket_cap_mb > 0, ValueError,
                "GradientBucketer: bucket_cap_mb = ", options.bucket_cap_mb, " must be a positive number");
  State& st = *state_;
  st.group = &group;
  st.buffers = std::move(buffers);
  st.options = options;
  const int64_t cap_bytes = std::max<int64_t>(1, int64_t(options.bucket_cap_mb * double(int64_t(1) << 20)));

  // Cut buckets walking the parameters backwards (Note [Gradient buckets]). Within one buffer, a run
  // of consecutive parameters taken backwards is still one contiguous span.
  for (size_t bi = st.buffers.size(); bi-- > 0;) {
    const optim::FlatBuffer& fb = *st.buffers[bi];
    BOOSTER_CHECK(fb.grad().defined(), StateError, "GradientBucketer: flat buffer ", bi, " has no gradient buffer");
    const int64_t item = int64_t(itemsize(fb.dtype()));
    Bucket current;
    int64_t current_bytes = 0;
    auto close = [&] {
      if (current.params.empty()) return;
      st.buckets.push_back(std::move(current));
      current = Bucket{};
      current_bytes = 0;
    };
    for (size_t i = fb.size(); i-- > 0;) {
      const int64_t bytes = fb.params()[i].numel() * item;
      const int64_t limit = st.buckets.empty() ? std::min(cap_bytes, kFirstBucketBytes) : cap_bytes;
      if (!current.params.empty() && current_bytes + bytes > limit) close();
      if (current.params.empty()) {
        current.buffer = bi;
        current.end = fb.offset(i + 1);
      }
      current.begin = fb.offset(i);
      current.params.push_back(i);
      current_bytes += bytes;
    }
    close();
  }

  // Slots and hooks for the parameters that take part in backward.
  st.slots_per_bucket.assign(st.buckets.size(), 0);
  for (size_t b = 0; b < st.buckets.size(); ++b) {
    const Bucket& bucket = st.buckets[b];
    for (size_t i : bucket.params) {
      const Tensor& p = st.buffers[bucket.buffer]->params()[i];
      if (!p.requires_grad()) continue;
      const size_t slot = st.slots.size();
      st.slots.push_back(ParamSlot{bucket.buffer, i, b});
      ++st.slots_per_bucket[b];
      std::weak_ptr<State> weak = state_;
      p.register_grad_ready_hook([weak, slot](Tensor& param) {
        if (auto alive = weak.lock()) alive->on_grad_ready(slot, param);
      });
    }
  }
  st.pending = st.slots_per_bucket;
  // Only host-driven collectives (MPI) need a thread to advance them; NCCL runs on the GPU.
  if (options.progress_thread && group.size() > 1 && group.device().is_cpu())
    st.progress = std::make_unique<ProgressThread>();
  if (options.find_unused_parameters) {
    const int64_t n = std::max<int64_t>(1, int64_t(st.slots.size()));
    st.used_flags_host = Tensor::empty({n}, DType::Int32);
    st.used_flags = group.device().is_cpu() ? st.used_flags_host : Tensor::empty({n}, DType::Int32, group.device());
  }
}

GradientBucketer::~GradientBucketer() {
  // Outstanding collectives write into the gradient buffers: finish them before anyone frees those.
  try {
    state_->wait();
  } catch (...) {
  }
}

const std::vector<GradientBucketer::Bucket>& GradientBucketer::buckets() const { return state_->buckets; }
const GradientBucketerOptions& GradientBucketer::options() const { return state_->options; }
void GradientBucketer::set_sync(bool enabled) { state_->sync = enabled; }
bool GradientBucketer::sync() const { return state_->sync; }
void GradientBucketer::finish_backward() { state_->finish_backward(); }
void GradientBucketer::wait() { state_->wait(); }
bool GradientBucketer::in_flight() const { return state_->in_flight; }
const GradientBucketStats& GradientBucketer::stats() const { return state_->stats; }
void GradientBucketer::reset_stats() { state_->stats = GradientBucketStats{}; }

GradientBucketerOwner::~GradientBucketerOwner() = default;

std::function<bool(bool)> found_inf_on_any_rank(ProcessGroup& group) {
  return [&group](bool local_found_inf) {
    if (group.size() == 1) return local_found_inf;
    // On the group's device: a fill kernel writes the flag (no copy in), and reading the result is the
    // one copy out, which waits only for this all-reduce (the strategy's own read of found_inf has
    // drained the stream already).
    Tensor flag = full({1}, local_found_inf ? 1.0 : 0.0, DType::Int32, group.device());
    group.all_reduce(flag, ReduceOp::Max);
    return flag.item() != 0.0;
  };
}

std::function<void(std::vector<float>&)> max_on_all_ranks(ProcessGroup& group) {
  return [&group](std::vector<float>& values) {
    if (group.size() == 1 || values.empty()) return;
    // MPI's and NCCL's Max may drop NaN; an amax that was NaN on any rank must stay NaN (it keeps the
    // scale), so NaN travels as +inf, which from_amax treats the same way.
    for (float& v : values)
      if (std::isnan(v)) v = INFINITY;
    Tensor t = from_vector(values, {int64_t(values.size())}).to(group.device());
    group.all_reduce(t, ReduceOp::Max);
    values = t.to_vector<float>();
  };
}

}  // namespace booster::distributed
