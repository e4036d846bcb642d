// The staged group (staged_process_group.h): each CUDA buffer is copied into page-locked host memory,
// the host group runs the collective there, and the result is copied back. Note [Staged collectives].
#include "booster/distributed/staged_process_group.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "booster/backends/cuda/cuda.h"
#include "booster/backends/cuda/pinned.h"
#include "booster/common/error.h"
#include "booster/tensor/storage.h"

namespace booster::distributed {

namespace {

// Page-locked blocks reused by size: pinning is a system call that costs far more than the copy of a
// gradient bucket, and a training step stages the same sizes every time. A request is rounded up
// (round_up) and takes a free block of that size up to twice it. Never freed (CUDA may be torn down
// before static destructors).
class PinnedPool {
 public:
  static PinnedPool& instance() {
    static PinnedPool* pool = new PinnedPool;
    return *pool;
  }

  std::shared_ptr<void> take(size_t nbytes) {
    const size_t want = round_up(nbytes);
    size_t size = 0;
    void* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(want);
      if (it != free_.end() && it->first <= 2 * want) {
        size = it->first;
        block = it->second;
        free_.erase(it);
      }
    }
    if (!block) {
      size = want;
      block = cuda::host_alloc_pinned(size);
    }
    return std::shared_ptr<void>(block, [this, size](void* p) {
      std::lock_guard<std::mutex> lock(mu_);
      free_.emplace(size, p);
    });
  }

 private:
  // 4 KiB pages below 1 MiB, powers of two above: few distinct sizes, at most 2x over.
  static size_t round_up(size_t n) {
    if (n <= (size_t(1) << 20)) return (n + 4095) / 4096 * 4096;
    size_t p = size_t(1) << 20;
    while (p < n) p <<= 1;
    return p;
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;
};

// A device buffer's host copy. The block stays alive while a Work still needs it.
struct Stage {
  std::shared_ptr<void> block;
  BufferSpan host;
};

// Host memory for `device_buf`, filled with its contents when `copy` (the copy waits for the work
// queued on the GPU's stream, so it sees what the kernels before it wrote).
Stage stage(const BufferSpan& device_buf, bool copy) {
  Stage s;
  s.block = PinnedPool::instance().take(device_buf.nbytes());
  s.host = BufferSpan{s.block.get(), device_buf.numel, device_buf.dtype, Device::cpu()};
  if (copy) allocator_for(device_buf.device).copy_to_host(s.host.data, device_buf.data, device_buf.nbytes());
  return s;
}

// Copies the host result back; synchronous, so the buffer holds it for any reader once this returns.
void unstage(const BufferSpan& device_buf, const BufferSpan& host) {
  allocator_for(device_buf.device).copy_from_host(device_buf.data, host.data, device_buf.nbytes());
}

// A CPU tensor over a staged block (point-to-point takes tensors).
Tensor host_tensor(const Stage& s) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(s.host.data, s.host.nbytes(), Device::cpu(), [keep = s.block](void*) {});
  impl->shape = {s.host.numel};
  impl->strides = {1};
  impl->numel = s.host.numel;
  impl->dtype = s.host.dtype;
  return Tensor(std::move(impl));
}

// The host group's Work, then the copies back to the GPU. Dropped without wait(), it still waits and
// copies (a CPU backend's Work waits in its destructor too), so the result always lands. A failure is
// kept and thrown again by every later wait() and is_completed(), as the CPU backends' Works do.
class StagedWork final : public Work {
 public:
  StagedWork(WorkPtr inner, std::function<void()> finish) : inner_(std::move(inner)), finish_(std::move(finish)) {}
  ~StagedWork() override {
    if (done_ || failed_) return;
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "booster: a staged collective dropped without wait() failed: %s\n", e.what());
    }
  }
  void wait() override {
    if (failed_) std::rethrow_exception(failed_);
    if (done_) return;
    try {
      if (inner_) inner_->wait();
      if (finish_) finish_();
    } catch (...) {
      failed_ = std::current_exception();
      throw;
    }
    finish_ = nullptr;
    done_ = true;
  }
  // Once the host collective is done, copies the result back before saying so.
  bool is_completed() override {
    if (failed_) std::rethrow_exception(failed_);
    if (done_) return true;
    if (inner_ && !inner_->is_completed()) return false;
    wait();
    return true;
  }

 private:
  WorkPtr inner_;
  std::function<void()> finish_;
  bool done_ = false;
  std::exception_ptr failed_;
};

WorkPtr finish_work(bool async, WorkPtr inner, std::function<void()> finish) {
  if (!async) {
    if (inner) inner->wait();
    finish();
    return nullptr;
  }
  return std::make_shared<StagedWork>(std::move(inner), std::move(finish));
}

class StagedProcessGroup final : public ProcessGroup {
 public:
  StagedProcessGroup(std::shared_ptr<ProcessGroup> host, Device device) : host_(std::move(host)), device_(device) {
    BOOSTER_CHECK(host_ != nullptr && host_->device().is_cpu(), ValueError,
                  "make_staged_process_group: the host group must be a CPU group");
    BOOSTER_CHECK(device_.is_cuda(), ValueError, "make_staged_process_group: stages CUDA buffers, not ", device_);
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string backend() const override { return host_->backend() + " (staged)"; }
  Device device() const override { return device_; }

  // Waits for this rank's queued GPU work too, as the nccl group's barrier does (it guards file writes).
  void barrier() override {
    cuda::synchronize(device_.index);
    host().barrier();
  }

  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) override {
    std::shared_ptr<ProcessGroup> sub = host_->split(color, key, name);
    return sub ? std::make_shared<StagedProcessGroup>(std::move(sub), device_) : nullptr;
  }

  [[noreturn]] void abort(int exit_code, const std::string& why) override {
    host_->abort(exit_code, why);
    std::abort();  // not reached: the host group ends the job
  }

 protected:
  WorkPtr all_reduce_impl(const BufferSpan& buf, ReduceOp op, bool async) override {
    if (buf.device.is_cpu()) return async ? host().all_reduce_async(buf, op) : (host().all_reduce(buf, op), nullptr);
    if (buf.numel == 0) return completed_work();
    Stage s = stage(buf, true);
    WorkPtr w = async ? host().all_reduce_async(s.host, op) : (host().all_reduce(s.host, op), nullptr);
    return finish_work(async, std::move(w), [buf, s] { unstage(buf, s.host); });
  }

  WorkPtr broadcast_impl(const BufferSpan& buf, int root, bool async) override {
    if (buf.device.is_cpu()) return async ? host().broadcast_async(buf, root) : (host().broadcast(buf, root), nullptr);
    if (buf.numel == 0) return completed_work();
    const bool sender = rank() == root;
    Stage s = stage(buf, sender);
    WorkPtr w = async ? host().broadcast_async(s.host, root) : (host().broadcast(s.host, root), nullptr);
    return finish_work(async, std::move(w), [buf, s, sender] {
      if (!sender) unstage(buf, s.host);
    });
  }

  // The host side always gathers in place: this rank's part is copied into its slice of the host
  // `out`, so `in` may be anywhere (a slice of `out` too).
  WorkPtr all_gather_impl(const BufferSpan& out, const BufferSpan& in, bool async) override {
    if (out.device.is_cpu() && in.device.is_cpu())
      return async ? host().all_gather_async(out, in) : (host().all_gather(out, in), nullptr);
    require_device(out, "all_gather");
    require_device(in, "all_gather");
    if (in.numel == 0) return completed_work();
    Stage s = stage(out, false);
    const BufferSpan mine = s.host.slice(int64_t(rank()) * in.numel, in.numel);
    allocator_for(in.device).copy_to_host(mine.data, in.data, in.nbytes());
    WorkPtr w = async ? host().all_gather_async(s.host, mine) : (host().all_gather(s.host, mine), nullptr);
    return finish_work(async, std::move(w), [out, s] { unstage(out, s.host); });
  }

  // `in`'s host copy is scratch, so the blocking form lets Avg divide before it sums (Note [Averages
  // divide first]); the device `in` is left unchanged either way.
  WorkPtr reduce_scatter_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op, bool async) override {
    if (out.device.is_cpu() && in.device.is_cpu())
      return async ? host().reduce_scatter_async(out, in, op) : (host().reduce_scatter(out, in, op), nullptr);
    require_device(out, "reduce_scatter");
    require_device(in, "reduce_scatter");
    if (out.numel == 0) return completed_work();
    Stage si = stage(in, true), so = stage(out, false);
    WorkPtr w = async ? host().reduce_scatter_async(so.host, si.host, op)
                      : (host().reduce_scatter_consuming(so.host, si.host, op), nullptr);
    return finish_work(async, std::move(w), [out, so, si] { unstage(out, so.host); });
  }

  WorkPtr send_recv_impl(const std::vector<P2PSpan>& ops) override {
    std::vector<P2POp> host_ops;
    std::vector<std::pair<BufferSpan, Stage>> receives;
    std::vector<Stage> sends;
    for (const P2PSpan& op : ops) {
      require_device(op.buf, op.send ? "send" : "recv");
      Stage s = stage(op.buf, op.send);
      host_ops.push_back({op.send ? P2POp::Kind::Send : P2POp::Kind::Recv, host_tensor(s), op.peer, op.tag});
      if (op.send)
        sends.push_back(std::move(s));
      else
        receives.emplace_back(op.buf, std::move(s));
    }
    WorkPtr w = host().batch_send_recv(host_ops);
    return finish_work(true, std::move(w), [receives = std::move(receives), sends = std::move(sends)] {
      for (const auto& [buf, s] : receives) unstage(buf, s.host);
    });
  }

  WorkPtr reduce_scatter_consuming_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op) override {
    return reduce_scatter_impl(out, in, op, false);
  }

 private:
  // The host group (a communicator of this group's own, split from the default one), running with
  // this group's timeout (set_timeout on this group applies to it).
  ProcessGroup& host() {
    host_->set_timeout(timeout());
    return *host_;
  }

  void require_device(const BufferSpan& buf, const char* op) const {
    BOOSTER_CHECK(buf.device == device_ || buf.numel == 0, DeviceError, op, ": a buffer on ", buf.device,
                  ", but this ", backend(), " group works on ", device_, " (and the CPU)");
  }

  std::shared_ptr<ProcessGroup> host_;
  Device device_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_staged_process_group(std::shared_ptr<ProcessGroup> host, Device device) {
  return std::make_shared<StagedProcessGroup>(std::move(host), device);
}

}  // namespace booster::distributed
