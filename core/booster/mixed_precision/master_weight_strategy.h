// Forwarding header, kept so code that includes it (the umbrella booster/booster.h among it) still
// compiles: the master-weight step now lives in PrecisionStrategy, and a strategy asks for float32
// master weights with PrecisionRecipe{.model_dtype = ..., .master_weights = true}
// (precision_strategy.h). Include precision_strategy.h instead; this header will go.
#pragma once

#include "booster/mixed_precision/loss_scaler.h"
#include "booster/mixed_precision/master_weight_optimizer.h"
#include "booster/mixed_precision/precision_strategy.h"
