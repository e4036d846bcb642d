// Linked into every tests/mpi program (tests/CMakeLists.txt): the one-minute collective timeout of
// collective_timeout.h, without an include in each file.
#include "collective_timeout.h"
