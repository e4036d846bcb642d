// How many threads the CPU kernels use, chosen once at the start of a run (Note [Threads per process]).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace booster {

// Note [Threads per process]
// The CPU kernels (OpenMP, and OpenBLAS's OpenMP build, which follows OpenMP's count) use one thread
// per core by default. The count, first that applies:
//   1. train.threads (a config's, or configure_threads(n) from a user's loop);
//   2. OMP_NUM_THREADS as exported (booster run and torchrun export one per rank when the user did not);
//   3. the usable cores divided among the processes of this machine, as torchrun does, when a launcher
//      says how many there are (LOCAL_WORLD_SIZE: torchrun; OMPI_COMM_WORLD_LOCAL_SIZE: OpenMPI's
//      mpirun; MPI_LOCALNRANKS: MPICH), at least 1;
//   4. the usable cores (the process's CPU affinity, as taskset or a container limits it).
// Each thread of a parallel region must run before the region ends, so a process with more threads
// than the cores free to it waits for descheduled threads at every region: on a machine others keep
// busy, fewer threads (or OMP_WAIT_POLICY=passive) run faster (bench/README.md, "Threads on a busy
// machine"). Small ops stay on one thread whatever the count (Note [The parallel grain]).
struct ThreadChoice {
  int threads = 1;
  std::string source;  // "train.threads", "OMP_NUM_THREADS", "cores / local processes", "cores"
};

// The choice for these inputs (no side effects): `configured` is train.threads (>= 1, or none),
// `getenv` reads the environment, `cores` the usable cores.
ThreadChoice choose_threads(std::optional<int64_t> configured, const std::function<const char*(const char*)>& getenv,
                            int cores);

// The cores this process may run on (its affinity mask; the online CPUs where that is unavailable).
int usable_cores();

// Chooses the count for this process and applies it to OpenMP and OpenBLAS. An OMP_NUM_THREADS the
// runtime already honours is left as it is (also a list such as "4,1" for nested regions).
ThreadChoice configure_threads(std::optional<int64_t> configured = std::nullopt);

// The threads the CPU kernels use now (OpenMP's count for the next parallel region).
int num_threads();

}  // namespace booster
