// Moved: the parallel plugin interface is booster/plugin/parallel_plugin.h, with the rest of the
// plugin boundary. This forwarding header keeps code written against the old path compiling (bench/
// still includes it); new code includes the new path.
#pragma once

#include "booster/plugin/parallel_plugin.h"
