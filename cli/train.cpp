// `booster train`: the training loop driven by a resolved config.
#include "booster/common/error.h"
#include "cli/commands.h"

namespace booster::cli {

int train(const nlohmann::json& config) {
  BOOSTER_FAIL(NotImplementedError, "booster train: the training loop is not built yet");
}

}  // namespace booster::cli
