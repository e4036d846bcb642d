// A shared library whose static constructor ends the process with exit(0) while it is being loaded
// (Note [A library that exits while loading] in booster/plugin/loader.cpp): booster must not take
// that for a successful run.
#include <cstdio>
#include <cstdlib>

namespace {

struct ExitsOnLoad {
  ExitsOnLoad() {
    std::fputs("exits_on_load: exiting from a static constructor\n", stderr);
    std::exit(0);
  }
};

const ExitsOnLoad exits_on_load;

}  // namespace
