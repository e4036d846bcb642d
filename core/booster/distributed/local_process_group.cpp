#include "booster/distributed/local_process_group.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace booster::distributed {

namespace {

// With one rank, sum/avg/max/min of one value is that value, so all_reduce and broadcast leave the
// buffer as it is; all_gather and reduce_scatter move `in` into `out` (nothing when already there).
WorkPtr copy_span(const BufferSpan& out, const BufferSpan& in) {
  if (out.data != in.data && in.nbytes() != 0) std::memmove(out.data, in.data, in.nbytes());
  return completed_work();
}

}  // namespace

void LocalProcessGroup::abort(int exit_code, const std::string& why) {
  std::fprintf(stderr, "booster: rank 0 of 1 aborts: %s\n", why.c_str());
  std::fflush(stderr);
  std::_Exit(exit_code == 0 ? 1 : exit_code);
}

WorkPtr LocalProcessGroup::all_reduce_impl(const BufferSpan&, ReduceOp, bool) {
  return completed_work();
}

WorkPtr LocalProcessGroup::broadcast_impl(const BufferSpan&, int, bool) { return completed_work(); }

WorkPtr LocalProcessGroup::all_gather_impl(const BufferSpan& out, const BufferSpan& in, bool) {
  return copy_span(out, in);
}

WorkPtr LocalProcessGroup::reduce_scatter_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp,
                                               bool) {
  return copy_span(out, in);
}

std::shared_ptr<ProcessGroup> LocalProcessGroup::split(int color, int key, const std::string& name) {
  if (color < 0) return nullptr;
  return std::make_shared<LocalProcessGroup>();
}

}  // namespace booster::distributed
