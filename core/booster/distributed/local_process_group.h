// LocalProcessGroup: the world of one process. Every collective is an identity (all_gather and
// reduce_scatter copy `in` to `out`), so single-process training runs the same code path as
// data-parallel training without MPI.
#pragma once

#include "booster/distributed/process_group.h"

namespace booster::distributed {

class LocalProcessGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "local"; }
  Device device() const override { return Device::cpu(); }
  void barrier() override {}
  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) override;
  [[noreturn]] void abort(int exit_code, const std::string& why) override;

 protected:
  WorkPtr all_reduce_impl(const BufferSpan& buf, ReduceOp op, bool async) override;
  WorkPtr broadcast_impl(const BufferSpan& buf, int root, bool async) override;
  WorkPtr all_gather_impl(const BufferSpan& out, const BufferSpan& in, bool async) override;
  WorkPtr reduce_scatter_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op,
                              bool async) override;
};

}  // namespace booster::distributed
