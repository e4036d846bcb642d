// Note [Passive waiting by default]
// OpenMP's threads spin at a region's end before they sleep (libgomp: up to 300,000 iterations). On a
// machine whose cores other processes keep busy, the spinning thread takes the core from the thread it
// waits for: bench/README.md ("Threads on a busy machine") measured a tiny Llama at 7 samples/s with
// two `yes` processes on 2 cores against 760 with OMP_WAIT_POLICY=passive, and passive was no slower
// on the shared machine when nothing else ran. So the booster command waits passively unless the
// user chose otherwise (OMP_WAIT_POLICY, or GOMP_SPINCOUNT, set). libgomp reads its environment once,
// in its constructor, before main and before any constructor of this program: the variable is set
// from the executable's .preinit_array, which the dynamic loader runs before the libraries'
// constructors. A user's own program exports OMP_WAIT_POLICY=passive itself (README.md, "Threads").
#include <cstdlib>

namespace {

void default_to_passive_waiting(int, char**, char**) {
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr)
    setenv("OMP_WAIT_POLICY", "passive", 0);
}

[[gnu::section(".preinit_array"), gnu::used]] void (*const preinit_wait_policy)(int, char**, char**) =
    &default_to_passive_waiting;

}  // namespace
