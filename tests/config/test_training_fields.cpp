// Training-config fields that every other test left at their defaults (tests/README.md, "Config fields
// and the test that varies each"), each varied through config::resolve and make_datasets against its
// closed form: data.normalize "scale" divides the inputs by data.divide_by (4, exact in float32; and the
// default 255 when the key is absent), on the NumPy-written blobs of tests/fixtures/file_data/.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/config/config.h"
#include "booster/config/training.h"
#include "booster/data/dataset.h"

using namespace booster;
using json = nlohmann::json;

namespace {

const std::string kDir = std::string(BOOSTER_FIXTURE_DIR) + "/file_data/";

json blobs_config() {
  return {{"model", {{"type", "mlp"}, {"in", 4}, {"hidden", {8}}, {"classes", 3}}},
          {"optimizer", {{"type", "adam"}, {"lr", 0.01}}},
          {"data", {{"type", "npy"}, {"x", kDir + "blobs_x.npy"}, {"y", kDir + "blobs_y.npy"}}}};
}

// Every input of the training split, in order.
std::vector<double> inputs_of(const json& c) {
  const config::DataSplits s = config::make_datasets(config::resolve(c)["data"], 0);
  std::vector<int64_t> all(static_cast<size_t>(s.train->size()));
  for (size_t i = 0; i < all.size(); ++i) all[i] = int64_t(i);
  return s.train->get_batch(all).x.to(DType::Float64).tolist();
}

}  // namespace

TEST_CASE("training fields: data.normalize scale divides by data.divide_by, 255 when absent", "[config][data][fields]") {
  const std::vector<double> raw = inputs_of(blobs_config());
  REQUIRE(raw.size() == 120 * 4);
  json c = blobs_config();
  c["data"]["normalize"] = "scale";
  c["data"]["divide_by"] = 4.0;
  const std::vector<double> quarter = inputs_of(c);
  REQUIRE(quarter.size() == raw.size());
  size_t off = 0;
  for (size_t i = 0; i < raw.size(); ++i) off += quarter[i] != raw[i] / 4.0;  // a power of two: exact
  CHECK(off == 0);
  c["data"].erase("divide_by");
  const std::vector<double> default_scale = inputs_of(c);
  double worst = 0;  // x * float(1/255) in float32: two roundings
  for (size_t i = 0; i < raw.size(); ++i)
    worst = std::max(worst, std::abs(default_scale[i] - raw[i] / 255.0) / (std::abs(raw[i] / 255.0) + 1e-300));
  CHECK(worst <= 2 * std::ldexp(1.0, -24) * (1 + 1e-9));
}
