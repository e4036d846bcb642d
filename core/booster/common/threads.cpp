// Note [Threads per process] in threads.h.
#include "booster/common/threads.h"

#include <cblas.h>
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "booster/common/error.h"

namespace booster {
namespace {

// A positive integer, or nothing for unset, empty or anything else (OpenMP ignores such values too).
std::optional<int64_t> positive(const char* v) {
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (end == v || n < 1) return std::nullopt;
  return int64_t(n);
}

}  // namespace

ThreadChoice choose_threads(std::optional<int64_t> configured, const std::function<const char*(const char*)>& getenv,
                            int cores) {
  cores = std::max(cores, 1);
  if (configured) {
    BOOSTER_CHECK(*configured >= 1, ConfigError, "train.threads must be >= 1 (or null: choose), got ", *configured);
    return {int(std::min<int64_t>(*configured, 1 << 16)), "train.threads"};
  }
  // OpenMP reads the first entry of a list ("4,1"): the outermost level's count.
  if (const auto n = positive(getenv("OMP_NUM_THREADS"))) return {int(std::min<int64_t>(*n, 1 << 16)), "OMP_NUM_THREADS"};
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const auto local = positive(getenv(name)); local && *local > 1)
      return {int(std::max<int64_t>(1, cores / *local)), "cores / local processes"};
  return {cores, "cores"};
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return int(std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)));
}

ThreadChoice configure_threads(std::optional<int64_t> configured) {
  const ThreadChoice choice = choose_threads(configured, [](const char* name) { return std::getenv(name); },
                                             usable_cores());
  // OpenMP already runs with an exported OMP_NUM_THREADS; setting it again would flatten a nested list.
  // OpenBLAS's OpenMP build follows OpenMP's count at every call; its pthread build is told.
  if (choice.source != "OMP_NUM_THREADS") {
    omp_set_num_threads(choice.threads);
    openblas_set_num_threads(choice.threads);
  }
  return choice;
}

int num_threads() { return omp_get_max_threads(); }

}  // namespace booster
