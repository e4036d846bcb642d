#include "booster/distributed/process_group.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <vector>

#include "booster/distributed/local_process_group.h"
#include "booster/distributed/nccl_process_group.h"
#include "booster/distributed/mpi_process_group.h"
#include "booster/distributed/rendezvous.h"
#include "booster/distributed/staged_process_group.h"
#include "booster/distributed/tcp_process_group.h"
#include "booster/backends/cuda/cuda.h"
#include "booster/backends/cuda/device_id.h"
#include "booster/ops/ops.h"

namespace booster::distributed {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

BufferSpan BufferSpan::of(const Tensor& t, const char* op) {
  BOOSTER_CHECK(t.defined(), ValueError, op, ": expected a defined tensor");
  BOOSTER_CHECK(t.is_contiguous(), ShapeError, op, ": expected a contiguous tensor, got shape ",
                t.shape(), " with strides ", t.strides(), "; call .contiguous() first");
  return BufferSpan{t.data_ptr(), t.numel(), t.dtype(), t.device()};
}

BufferSpan BufferSpan::slice(int64_t start, int64_t length) const {
  BOOSTER_CHECK(start >= 0 && length >= 0 && start + length <= numel, IndexError,
                "BufferSpan::slice: elements [", start, ", ", start + length,
                ") are out of a span of ", numel, " elements");
  return BufferSpan{static_cast<char*>(data) + size_t(start) * itemsize(dtype), length, dtype, device};
}

void wait_all(const std::vector<WorkPtr>& works) {
  for (const WorkPtr& w : works)
    if (w) w->wait();
}

namespace {

class CompletedWork final : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

bool overlaps(const BufferSpan& a, const BufferSpan& b) {
  auto* a0 = static_cast<const char*>(a.data);
  auto* b0 = static_cast<const char*>(b.data);
  return a.nbytes() != 0 && b.nbytes() != 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void check_reducible(DType dtype, ReduceOp op, const char* name) {
  BOOSTER_CHECK(dtype != DType::Bool, DTypeError, name,
                ": cannot reduce bool buffers; use an integer or floating dtype");
  BOOSTER_CHECK(!is_float8(dtype), DTypeError, name, ": cannot reduce ", dtype,
                " buffers (float8 holds data only); reduce in bfloat16 or float32 and convert after");
  BOOSTER_CHECK(op != ReduceOp::Avg || is_floating(dtype), DTypeError, name,
                ": ReduceOp avg needs a floating dtype (an integer average would truncate), got ",
                dtype, "; use sum and divide");
}

void check_same_kind(const BufferSpan& out, const BufferSpan& in, const char* name) {
  BOOSTER_CHECK(out.dtype == in.dtype, DTypeError, name, ": output dtype ", out.dtype,
                " differs from input dtype ", in.dtype);
  BOOSTER_CHECK(out.device == in.device, DeviceError, name, ": output on ", out.device,
                " but input on ", in.device);
}

// Keeps the tensors alive for an async collective's lifetime.
WorkPtr keeping(WorkPtr w, std::initializer_list<Tensor> tensors) {
  if (!w) w = completed_work();
  for (const Tensor& t : tensors) w->keep_alive(t);
  return w;
}

}  // namespace

WorkPtr completed_work() { return std::make_shared<CompletedWork>(); }

// ---------------------------------------------------------------------------------------- checks

void ProcessGroup::check_all_reduce(const BufferSpan& buf, ReduceOp op, const char* name) const {
  BOOSTER_CHECK(buf.data != nullptr || buf.numel == 0, ValueError, name, ": null buffer of ",
                buf.numel, " elements");
  BOOSTER_CHECK(buf.numel >= 0, ValueError, name, ": negative element count ", buf.numel);
  check_reducible(buf.dtype, op, name);
}

void ProcessGroup::check_broadcast(int root, const char* name) const {
  BOOSTER_CHECK(root >= 0 && root < size(), ValueError, name, ": root ", root,
                " is not a rank of a group of size ", size(), "; expected 0..", size() - 1);
}

void ProcessGroup::check_all_gather(const BufferSpan& out, const BufferSpan& in,
                                    const char* name) const {
  check_same_kind(out, in, name);
  BOOSTER_CHECK(out.numel == in.numel * size(), ShapeError, name, ": output has ", out.numel,
                " elements but ", size(), " ranks x ", in.numel, " input elements need ",
                in.numel * size());
  // The one overlap allowed: `in` is exactly this rank's slice of `out` (gather in place).
  const bool in_place = static_cast<const char*>(in.data) ==
                        static_cast<const char*>(out.data) + size_t(rank()) * in.nbytes();
  BOOSTER_CHECK(in_place || !overlaps(out, in), ValueError, name,
                ": input overlaps the output other than as this rank's slice (rank ", rank(),
                ", elements [", rank() * in.numel, ", ", (rank() + 1) * in.numel, "))");
}

void ProcessGroup::check_reduce_scatter(const BufferSpan& out, const BufferSpan& in, ReduceOp op,
                                        const char* name) const {
  check_same_kind(out, in, name);
  check_reducible(in.dtype, op, name);
  BOOSTER_CHECK(in.numel == out.numel * size(), ShapeError, name, ": input has ", in.numel,
                " elements but ", size(), " ranks x ", out.numel, " output elements need ",
                out.numel * size());
  BOOSTER_CHECK(!overlaps(out, in), ValueError, name,
                ": output overlaps the input; reduce_scatter needs separate buffers");
}

// ---------------------------------------------------------------------------------------- tensors

void ProcessGroup::all_reduce(Tensor& t, ReduceOp op) {
  all_reduce(BufferSpan::of(t, "all_reduce"), op);
  t.bump_version();
}

WorkPtr ProcessGroup::all_reduce_async(Tensor& t, ReduceOp op) {
  WorkPtr w = all_reduce_async(BufferSpan::of(t, "all_reduce_async"), op);
  t.bump_version();
  return keeping(std::move(w), {t});
}

void ProcessGroup::broadcast(Tensor& t, int root) {
  broadcast(BufferSpan::of(t, "broadcast"), root);
  t.bump_version();
}

WorkPtr ProcessGroup::broadcast_async(Tensor& t, int root) {
  WorkPtr w = broadcast_async(BufferSpan::of(t, "broadcast_async"), root);
  t.bump_version();
  return keeping(std::move(w), {t});
}

void ProcessGroup::all_gather(Tensor& out, const Tensor& in) {
  all_gather(BufferSpan::of(out, "all_gather"), BufferSpan::of(in, "all_gather"));
  out.bump_version();
}

WorkPtr ProcessGroup::all_gather_async(Tensor& out, const Tensor& in) {
  WorkPtr w = all_gather_async(BufferSpan::of(out, "all_gather_async"),
                               BufferSpan::of(in, "all_gather_async"));
  out.bump_version();
  return keeping(std::move(w), {out, in});
}

void ProcessGroup::reduce_scatter(Tensor& out, const Tensor& in, ReduceOp op) {
  reduce_scatter(BufferSpan::of(out, "reduce_scatter"), BufferSpan::of(in, "reduce_scatter"), op);
  out.bump_version();
}

void ProcessGroup::reduce_scatter_consuming(Tensor& out, Tensor& in, ReduceOp op) {
  reduce_scatter_consuming(BufferSpan::of(out, "reduce_scatter_consuming"),
                           BufferSpan::of(in, "reduce_scatter_consuming"), op);
  out.bump_version();
  in.bump_version();
}

WorkPtr ProcessGroup::reduce_scatter_async(Tensor& out, const Tensor& in, ReduceOp op) {
  WorkPtr w = reduce_scatter_async(BufferSpan::of(out, "reduce_scatter_async"),
                                   BufferSpan::of(in, "reduce_scatter_async"), op);
  out.bump_version();
  return keeping(std::move(w), {out, in});
}

// ---------------------------------------------------------------------------------------- spans

void ProcessGroup::all_reduce(const BufferSpan& buf, ReduceOp op) {
  check_all_reduce(buf, op, "all_reduce");
  if (WorkPtr w = all_reduce_impl(buf, op, false)) w->wait();
}

WorkPtr ProcessGroup::all_reduce_async(const BufferSpan& buf, ReduceOp op) {
  check_all_reduce(buf, op, "all_reduce_async");
  return keeping(all_reduce_impl(buf, op, true), {});
}

void ProcessGroup::broadcast(const BufferSpan& buf, int root) {
  check_broadcast(root, "broadcast");
  if (WorkPtr w = broadcast_impl(buf, root, false)) w->wait();
}

WorkPtr ProcessGroup::broadcast_async(const BufferSpan& buf, int root) {
  check_broadcast(root, "broadcast_async");
  return keeping(broadcast_impl(buf, root, true), {});
}

void ProcessGroup::all_gather(const BufferSpan& out, const BufferSpan& in) {
  check_all_gather(out, in, "all_gather");
  if (WorkPtr w = all_gather_impl(out, in, false)) w->wait();
}

WorkPtr ProcessGroup::all_gather_async(const BufferSpan& out, const BufferSpan& in) {
  check_all_gather(out, in, "all_gather_async");
  return keeping(all_gather_impl(out, in, true), {});
}

void ProcessGroup::reduce_scatter(const BufferSpan& out, const BufferSpan& in, ReduceOp op) {
  check_reduce_scatter(out, in, op, "reduce_scatter");
  if (WorkPtr w = reduce_scatter_impl(out, in, op, false)) w->wait();
}

WorkPtr ProcessGroup::reduce_scatter_async(const BufferSpan& out, const BufferSpan& in,
                                           ReduceOp op) {
  check_reduce_scatter(out, in, op, "reduce_scatter_async");
  return keeping(reduce_scatter_impl(out, in, op, true), {});
}

void ProcessGroup::reduce_scatter_consuming(const BufferSpan& out, const BufferSpan& in, ReduceOp op) {
  check_reduce_scatter(out, in, op, "reduce_scatter_consuming");
  if (WorkPtr w = reduce_scatter_consuming_impl(out, in, op)) w->wait();
}

// ---------------------------------------------------------------------------------------- point to point

WorkPtr ProcessGroup::batch_send_recv(const std::vector<P2POp>& ops) {
  const char* name = "batch_send_recv";
  std::vector<P2PSpan> spans;
  spans.reserve(ops.size());
  for (const P2POp& op : ops) {
    const bool send = op.kind == P2POp::Kind::Send;
    const char* what = send ? "send" : "recv";
    BOOSTER_CHECK(op.tensor.defined(), ValueError, name, ": a ", what, " has no tensor");
    BOOSTER_CHECK(op.peer >= 0 && op.peer < size() && op.peer != rank(), ValueError, name, ": a ", what,
                  " names peer ", op.peer, ", but the peer must be another rank of this group of ", size(),
                  " (this one is ", rank(), ")");
    BOOSTER_CHECK(op.tag >= 0 && op.tag <= 32767, ValueError, name, ": a ", what, " has tag ", op.tag,
                  "; tags are 0 to 32767 (what MPI guarantees)");
    BOOSTER_CHECK(op.tensor.device() == device(), DeviceError, name, ": a ", what, " tensor is on ",
                  op.tensor.device(), " but this ", backend(), " group works on ", device());
    spans.push_back({send, BufferSpan::of(op.tensor, name), op.peer, op.tag});
  }
  if (spans.empty()) return completed_work();
  WorkPtr w = send_recv_impl(spans);
  for (const P2POp& op : ops) {
    w->keep_alive(op.tensor);
    if (op.kind == P2POp::Kind::Recv) Tensor(op.tensor).bump_version();
  }
  return w;
}

WorkPtr ProcessGroup::send(const Tensor& t, int dst, int tag) {
  return batch_send_recv({P2POp{P2POp::Kind::Send, t, dst, tag}});
}

WorkPtr ProcessGroup::recv(Tensor& t, int src, int tag) {
  return batch_send_recv({P2POp{P2POp::Kind::Recv, t, src, tag}});
}

WorkPtr ProcessGroup::send_recv_impl(const std::vector<P2PSpan>&) {
  BOOSTER_FAIL(IncompatibleError, "batch_send_recv: the ", backend(),
               " backend has no point-to-point operations; use the mpi (CPU) or nccl (CUDA) backend");
}

// ---------------------------------------------------------------------------------------- default group

namespace {

std::mutex g_default_mutex;
std::shared_ptr<ProcessGroup> g_default_group;
// Note [A group per device]: this process's one NCCL group, whether init_process_group("nccl") or
// process_group_for(cuda) made it first. Held by a pointer that is never deleted, so it lives until
// the process ends (CUDA and NCCL may be torn down before static destructors run); a default group
// made with "nccl" is a second owner of it, so it is not destroyed with g_default_group either.
std::mutex g_nccl_mutex;
std::shared_ptr<ProcessGroup>* g_nccl_group = nullptr;

bool mpi_launched() { return launched_by_mpi_launcher() && mpi_built(); }

// "auto": mpi under an MPI launcher; tcp when the environment names a world of several processes
// without one (torchrun's variables, Note [Rendezvous without MPI]); else local.
std::string resolve_backend(const std::string& backend) {
  if (backend != "auto") return backend;
  if (mpi_launched()) return "mpi";
  if (const std::optional<EnvRanks> env = ranks_from_environment(); env && env->world_size > 1) return "tcp";
  return "local";
}

// The tcp group of the ranks the environment names, meeting through MASTER_ADDR/MASTER_PORT or a file.
std::shared_ptr<ProcessGroup> make_environment_tcp_group() {
  const std::optional<EnvRanks> env = ranks_from_environment();
  BOOSTER_CHECK(env.has_value(), ConfigError, "init_process_group: backend \"tcp\" takes its rank and world size "
                "from the environment: set RANK and WORLD_SIZE (as torchrun does), or BOOSTER_RANK and "
                "BOOSTER_WORLD_SIZE");
  std::optional<RendezvousSpec> spec = rendezvous_from_environment();
  BOOSTER_CHECK(spec.has_value() || env->world_size == 1, ConfigError, "init_process_group: backend \"tcp\" with ",
                env->world_size, " processes needs a place for them to meet: set MASTER_ADDR and MASTER_PORT to "
                "rank 0's host and a free port there, or BOOSTER_NCCL_ID_FILE to a path every rank shares");
  if (!spec) spec = RendezvousSpec{};  // a world of one meets nobody
  return make_tcp_process_group(env->rank, env->world_size, *spec, default_collective_timeout());
}

// The process's NCCL group, made on first use (ConfigError from make_nccl_process_group when it
// cannot be; a later call tries again). `bootstrap`: the CPU group that hands NCCL's id to every rank
// when MPI does not (a tcp default group), else null.
std::shared_ptr<ProcessGroup> shared_nccl_group(ProcessGroup* bootstrap) {
  std::lock_guard<std::mutex> lock(g_nccl_mutex);
  if (!g_nccl_group) g_nccl_group = new std::shared_ptr<ProcessGroup>(make_nccl_process_group(bootstrap));
  return *g_nccl_group;
}

// The default group when it is the CPU group of a job without MPI (so NCCL bootstraps through it).
ProcessGroup* tcp_default_group() {
  ProcessGroup& world = default_process_group();
  return world.backend() == "tcp" ? &world : nullptr;
}

// Note [Staged collectives]: under an MPI launcher, ranks that share a GPU (two ranks of one node on the
// same PCI device, whatever CUDA_VISIBLE_DEVICES renumbered) would be refused by NCCL; they stage
// through the mpi group instead. Every rank decides from the same all-gathered (host, GPU) list, so the
// choice is the job's, not the rank's. BOOSTER_CUDA_COLLECTIVES=staged or =nccl overrides it. Collective
// on first use, as the NCCL group's creation is.
bool ranks_share_gpus() {
  static const bool share = [] {
    const char* forced = std::getenv("BOOSTER_CUDA_COLLECTIVES");
    const std::string choice = forced ? forced : "";
    BOOSTER_CHECK(choice.empty() || choice == "staged" || choice == "nccl", ConfigError,
                  "BOOSTER_CUDA_COLLECTIVES is \"", choice, "\"; expected \"staged\" (through the mpi group and "
                  "host memory) or \"nccl\", or leave it unset to choose by the ranks per GPU");
    if (choice == "nccl") return false;
    // A host group to stage through: mpi under an MPI launcher, tcp under torchrun's variables.
    const bool host_group = mpi_launched() || resolve_backend("auto") == "tcp";
    BOOSTER_CHECK(host_group || choice != "staged", ConfigError, "BOOSTER_CUDA_COLLECTIVES=staged needs a job "
                  "of several processes: started by an MPI launcher (mpirun or booster run -n N) in a build with "
                  "MPI, or by torchrun-style variables (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT)");
    if (!host_group) return false;
    // A default group made with init_process_group("nccl") is NCCL already: the job chose it.
    if (!default_process_group().device().is_cpu()) return false;
    if (choice == "staged") return true;
    // This rank's host and GPU, as 128 bytes, gathered from every rank.
    constexpr size_t kBytes = 128;
    char host[64] = {};
    ::gethostname(host, sizeof host - 1);
    const int gpus = cuda::device_count();
    const std::string me = std::string(host) + "|" + (gpus > 0 ? cuda::pci_bus_id(node_rank() % gpus) : "");
    std::vector<int64_t> packed(kBytes / 8, 0);
    std::memcpy(packed.data(), me.data(), std::min(me.size(), kBytes - 1));
    ProcessGroup& world = default_process_group();
    Tensor mine = from_vector(packed, {int64_t(packed.size())});
    Tensor all = Tensor::empty({int64_t(packed.size()) * world.size()}, DType::Int64, Device::cpu());
    world.all_gather(all, mine);
    const std::vector<int64_t> every = all.to_vector<int64_t>();
    std::set<std::vector<int64_t>> seen;
    for (int r = 0; r < world.size(); ++r)
      if (!seen.insert(std::vector<int64_t>(every.begin() + r * packed.size(), every.begin() + (r + 1) * packed.size()))
               .second)
        return true;
    return false;
  }();
  return share;
}

// This process's staged group for CUDA tensors: the default (mpi) group's ranks, on GPU node rank %
// number of GPUs. Never deleted, as the NCCL group.
std::shared_ptr<ProcessGroup> shared_staged_group() {
  static std::shared_ptr<ProcessGroup>* group = [] {
    const ProcessGroup& world = default_process_group();
    BOOSTER_CHECK(world.device().is_cpu(), ConfigError, "collectives on CUDA tensors of ranks that share a GPU "
                  "stage through the CPU group (mpi or tcp), but the default group is \"", world.backend(), "\"");
    // A communicator of its own, whose timeout the staged group may set without touching the default's.
    std::shared_ptr<ProcessGroup> host = default_process_group().split(0, world.rank(), "staged");
    const int gpus = std::max(1, cuda::device_count());
    return new std::shared_ptr<ProcessGroup>(
        make_staged_process_group(host, Device::cuda(node_rank() % gpus)));
  }();
  return *group;
}

}  // namespace

bool launched_by_mpi_launcher() {
  // OpenMPI's mpirun, PMIx launchers, MPICH's hydra and Slurm's srun (with an MPI plugin).
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"})
    if (std::getenv(var) != nullptr) return true;
  return false;
}

int node_rank() {
  if (mpi_launched()) return mpi_node_ranks().rank;
  const std::optional<EnvRanks> env = ranks_from_environment();
  return env ? env->local_rank : 0;
}

JobPlace job_place_from_launcher() {
  const auto variable = [](std::initializer_list<const char*> names) -> const char* {
    for (const char* name : names)
      if (const char* v = std::getenv(name); v && *v) return v;
    return nullptr;
  };
  if (const char* size = variable({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})) {
    const char* rank = variable({"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"});
    return {rank ? std::max(0, std::atoi(rank)) : 0, std::max(1, std::atoi(size))};
  }
  try {
    if (const std::optional<EnvRanks> env = ranks_from_environment()) return {env->rank, env->world_size};
  } catch (const ConfigError&) {
  }
  return {};
}

ProcessGroup& init_process_group(const std::string& backend) {
  std::lock_guard<std::mutex> lock(g_default_mutex);  // lock order: g_default_mutex, then g_nccl_mutex
  const std::string chosen = resolve_backend(backend);
  if (g_default_group) {
    BOOSTER_CHECK(backend == "auto" || g_default_group->backend() == chosen, StateError,
                  "init_process_group: the default group already uses backend \"",
                  g_default_group->backend(), "\"; cannot switch to \"", chosen, "\"");
    return *g_default_group;
  }
  if (chosen == "local") {
    g_default_group = std::make_shared<LocalProcessGroup>();
  } else if (chosen == "mpi") {
    BOOSTER_CHECK(mpi_built(), ConfigError,
                  "init_process_group: backend \"mpi\" needs a build with MPI (OpenMPI was not "
                  "found when booster was configured); use \"local\" for one process");
    g_default_group = make_mpi_process_group();
  } else if (chosen == "tcp") {
    g_default_group = make_environment_tcp_group();
  } else if (chosen == "nccl") {
    try {
      g_default_group = shared_nccl_group(nullptr);  // the group process_group_for(cuda) gives too
    } catch (const ConfigError& e) {
      BOOSTER_FAIL(ConfigError, "init_process_group: ", e.what());
    }
  } else {
    BOOSTER_FAIL(ConfigError, "init_process_group: unknown backend \"", backend,
                 "\"; expected \"auto\", \"mpi\", \"tcp\", \"nccl\" or \"local\"");
  }
  return *g_default_group;
}

ProcessGroup& default_process_group() { return init_process_group("auto"); }

void check_group_serves(const ProcessGroup& group, Device device) {
  if (group.device() == device) return;
  BOOSTER_CHECK(!device.is_cpu(), DeviceError, "process_group_for(cpu): the default group is \"", group.backend(),
                "\" (made by init_process_group(\"", group.backend(), "\")), whose collectives take buffers on ",
                group.device(), " only, so a model on the CPU has no group; move the model to ", group.device(),
                ", or make the default group with init_process_group(\"auto\") (mpi under mpirun, else local) "
                "and let process_group_for(cuda) make the NCCL group a CUDA model needs");
  BOOSTER_CHECK(group.device().is_cuda(), DeviceError, "process_group_for(", device, "): the \"", group.backend(),
                "\" group takes buffers on ", group.device(), " only");
  BOOSTER_FAIL(DeviceError, "process_group_for(", device, "): rank ", group.rank(), " runs ", group.backend(), " on ",
               group.device(), " (rank % number of GPUs); put the model on ", group.device(),
               ", or start one rank per GPU");
}

ProcessGroup& process_group_for(Device device) {
  if (device.is_cpu()) {
    ProcessGroup& group = default_process_group();
    check_group_serves(group, device);
    return group;
  }
  BOOSTER_CHECK(device.is_cuda(), DeviceError, "process_group_for: no process group backend for ", device);
  std::shared_ptr<ProcessGroup> group;
  if (ranks_share_gpus()) {
    group = shared_staged_group();
    check_group_serves(*group, device);
    return *group;
  }
  try {
    group = shared_nccl_group(tcp_default_group());  // the default group too when that is "nccl"
  } catch (const ConfigError& e) {
    // The inner message says what is missing and how to get it.
    BOOSTER_FAIL(ConfigError, "collectives on ", device, " need an NCCL group, which cannot be made: ", e.what());
  }
  check_group_serves(*group, device);
  return *group;
}

ProcessGroup& process_group_for(const std::vector<Tensor>& tensors, const std::string& who) {
  const Tensor* first = nullptr;
  for (const Tensor& t : tensors) {
    if (!t.defined()) continue;
    if (!first) first = &t;
    BOOSTER_CHECK(t.device() == first->device(), DeviceError, who, ": '", first->name(), "' is on ", first->device(),
                  " but '", t.name(), "' on ", t.device(), "; move the whole model to one device first");
  }
  const Device device = first ? first->device() : Device::cpu();
  try {
    return process_group_for(device);
  } catch (const ConfigError& e) {
    BOOSTER_FAIL(ConfigError, who, ": the model is on ", device, ", and ", e.what());
  }
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  return g_default_group != nullptr;
}

// ---------------------------------------------------------------------------------------- timeouts

namespace {

std::atomic<double> g_default_timeout_s{0.0};  // 0: not set by set_default_collective_timeout

double checked_timeout(std::chrono::duration<double> timeout, const char* who) {
  const double s = timeout.count();
  BOOSTER_CHECK(std::isfinite(s) && s > 0, ValueError, who, ": the timeout is ", s,
                " s; expected a positive number of seconds");
  return s;
}

// BOOSTER_COLLECTIVE_TIMEOUT_S, or kDefaultCollectiveTimeout when it is not set.
double timeout_from_environment() {
  const char* text = std::getenv("BOOSTER_COLLECTIVE_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return kDefaultCollectiveTimeout.count();
  char* end = nullptr;
  const double s = std::strtod(text, &end);
  BOOSTER_CHECK(end != text && *end == '\0' && std::isfinite(s) && s > 0, ConfigError,
                "BOOSTER_COLLECTIVE_TIMEOUT_S is \"", text,
                "\"; expected the collective timeout as a positive number of seconds (e.g. 1800)");
  return s;
}

}  // namespace

std::chrono::duration<double> default_collective_timeout() {
  if (const double s = g_default_timeout_s.load(); s > 0) return std::chrono::duration<double>(s);
  static const double from_environment = timeout_from_environment();  // a ConfigError retries next call
  return std::chrono::duration<double>(from_environment);
}

void set_default_collective_timeout(std::chrono::duration<double> timeout) {
  g_default_timeout_s.store(checked_timeout(timeout, "set_default_collective_timeout"));
}

std::chrono::duration<double> ProcessGroup::timeout() const {
  if (const double s = timeout_s_.load(); s > 0) return std::chrono::duration<double>(s);
  return default_collective_timeout();
}

void ProcessGroup::set_timeout(std::chrono::duration<double> timeout) {
  timeout_s_.store(checked_timeout(timeout, "ProcessGroup::set_timeout"));
}

std::shared_ptr<ProcessGroup> ProcessGroup::split(int color, int key, const std::string& name) {
  BOOSTER_FAIL(NotImplementedError, "split: the \"", backend(), "\" backend cannot make subgroups yet (group \"",
               name, "\"); use the mpi backend (CPU tensors)");
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks, const std::string& name) {
  int position = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    BOOSTER_CHECK(ranks[i] >= 0 && ranks[i] < size(), ValueError, "new_group \"", name, "\": rank ", ranks[i],
                  " is not in this group of ", size());
    for (size_t j = 0; j < i; ++j)
      BOOSTER_CHECK(ranks[j] != ranks[i], ValueError, "new_group \"", name, "\": rank ", ranks[i], " is listed twice");
    if (ranks[i] == rank()) position = int(i);
  }
  return split(position < 0 ? -1 : 0, position, name);
}

std::vector<int> split_world_ranks(const std::vector<std::array<int, 3>>& parent, int color) {
  if (color < 0) return {};
  std::vector<std::array<int, 3>> members;  // {key, parent rank, world rank}
  for (size_t r = 0; r < parent.size(); ++r)
    if (parent[r][0] == color) members.push_back({parent[r][1], int(r), parent[r][2]});
  std::sort(members.begin(), members.end());
  std::vector<int> world;
  for (const auto& m : members) world.push_back(m[2]);
  return world;
}

}  // namespace booster::distributed
