// Training the CNN against a float64 PyTorch replica: 20 SGD steps of a small CNNClassifier (conv, batch
// norm, ReLU, max-pool, linear) from PyTorch's initial weights on piecewise-constant images stay as close
// to PyTorch's float64 run as PyTorch's own float32 runs do, on the oneDNN path and on the gather + GEMM
// path (tests/fixtures/make_cnn_train_fixtures.py wrote the reference and the noise).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "fixture.h"

#include "booster/autograd/autograd.h"
#include "booster/backends/onednn/onednn.h"
#include "booster/nn/cnn.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"

using namespace booster;
using json = nlohmann::json;

namespace {

// Restores the convolution path in use when it goes out of scope.
struct ConvPathGuard {
  explicit ConvPathGuard(bool on) : previous(onednn::set_conv(on)) {}
  ~ConvPathGuard() { onednn::set_conv(previous); }
  bool previous;
};

struct Run {
  std::vector<double> losses;
  std::map<std::string, std::vector<double>> weights;
};

// The fixture's model from its initial weights, trained on its batches in float32.
Run train(const json& j) {
  const json& c = j.at("config");
  nn::CNNConfig config;
  config.in_channels = c.at("in_channels");
  config.height = c.at("height");
  config.width = c.at("width");
  config.channels = c.at("channels").get<std::vector<int64_t>>();
  config.hidden = c.at("hidden");
  config.classes = c.at("classes");
  config.batch_norm = true;
  auto model = std::make_shared<nn::CNNClassifier>(config, 0);
  std::map<std::string, Tensor> mine;
  for (const auto& [name, t] : model->named_parameters()) mine[name] = t;
  REQUIRE(mine.size() == j.at("params").size());
  {
    const NoGradGuard no_grad;
    for (const json& p : j.at("params")) {
      const std::string name = p[0];
      INFO(name);
      REQUIRE(mine.count(name));
      const Tensor init = booster::testing::tensor_from_json(j.at("init:" + name));
      REQUIRE(mine.at(name).shape() == init.shape());
      mine.at(name).copy_(init);
    }
  }
  auto optimizer = optim::make_optimizer(j.at("optimizer"), model->parameters());

  const int64_t batch = j.at("batch"), steps = j.at("steps"), h = config.height, w = config.width;
  const std::vector<std::string> images = j.at("images");
  const std::vector<int64_t> labels = j.at("labels");
  REQUIRE(images.size() == size_t(steps * batch));
  Run run;
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<float> pixels;
    for (int64_t i = s * batch; i < (s + 1) * batch; ++i) {
      REQUIRE(images[size_t(i)].size() == size_t(h * w));
      for (char hex : images[size_t(i)])  // a level 0..15, its value (v - 8) / 4
        pixels.push_back(float((std::stoi(std::string(1, hex), nullptr, 16) - 8) / 4.0));
    }
    const Tensor x = from_vector(pixels, {batch, 1, h, w});
    const Tensor y = from_vector(std::vector<int64_t>(labels.begin() + s * batch, labels.begin() + (s + 1) * batch),
                                 {batch});
    optimizer->zero_grad();
    const Tensor loss = cross_entropy((*model)(x), y);
    loss.backward();
    optimizer->step();
    run.losses.push_back(loss.item());
  }
  for (const auto& [name, t] : mine) run.weights[name] = t.tolist();
  return run;
}

}  // namespace

// Note [The CNN's distance from float64]
// The reference is PyTorch float64; the yardstick is how far PyTorch's own float32 runs land from it
// (noise.loss: the largest |loss32 - loss64| over the steps; noise.weights: the L2 distance of the final
// weights; each the largest of three runs whose sums are ordered differently). A float32 run with its
// sums in yet another order is the same random walk of roundoff through the same 20 SGD steps, so it
// lands at about the same distance, give or take the spread between PyTorch's own runs (a factor of 3
// in the weights when the fixture was made); kNoiseFactor = 3 on top of their largest covers that
// spread again. A mistake in any op of the stack (conv, batch norm, ReLU, max-pool, linear, cross-
// entropy, SGD with momentum) that is not a rounding shows far above it, and so does rounding noise
// well beyond float32's: a relative error of up to 5e-6 (about 40 ulps) on each convolution output
// fails it. (A uniform relative bias of a few ulps does not: batch norm divides it out.)
//   What it cannot see is where a max-pool tie goes: tied outputs come from identical patches, so the
// gradient that reaches the weights is the same whichever of the tied positions takes it, and a path that rounds identical patches an ulp apart by position moves the trajectory no
// more than roundoff does (checked: OpenBLAS's Haswell kernels, and every other block of 8 positions
// nudged an ulp up, both stayed under half the noise). Bit-identical outputs at every position are
// checked directly in ops/test_onednn_conv.cpp (Note [Position-independent rounding]).
TEST_CASE("cnn: 20 SGD steps stay within float32 noise of a float64 PyTorch replica, on both conv paths",
          "[cnn][conv][onednn][train][roundoff]") {
  constexpr double kNoiseFactor = 3.0;
  const json j = booster::testing::load_fixture_json("cnn_train.json");
  const double noise_loss = j.at("noise").at("loss"), noise_weights = j.at("noise").at("weights");
  for (bool on : {true, false}) {
    const ConvPathGuard path(on);
    INFO((on ? "oneDNN" : "gather + GEMM") << " path" << (on && !onednn::conv_enabled() ? " (oneDNN absent)" : ""));
    const Run run = train(j);
    REQUIRE(run.losses.size() == j.at("loss").size());
    double loss_distance = 0, sq = 0;
    for (size_t s = 0; s < run.losses.size(); ++s)
      loss_distance = std::max(loss_distance, std::abs(run.losses[s] - j.at("loss")[s].get<double>()));
    for (const json& p : j.at("params")) {
      const std::vector<double>& got = run.weights.at(p[0]);
      const std::vector<double> want = j.at("final:" + p[0].get<std::string>()).at("data").get<std::vector<double>>();
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < got.size(); ++i) sq += (got[i] - want[i]) * (got[i] - want[i]);
    }
    const double weight_distance = std::sqrt(sq);
    INFO("loss: " << loss_distance << " from float64 (PyTorch float32: " << noise_loss << "); weights: "
                  << weight_distance << " (PyTorch float32: " << noise_weights << ")");
    CHECK(loss_distance <= kNoiseFactor * noise_loss);
    CHECK(weight_distance <= kNoiseFactor * noise_weights);
  }
}
