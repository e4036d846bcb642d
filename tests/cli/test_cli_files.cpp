// `booster train` on what a user brings: a model from a model library of their own
// (tests/models/toy, built into build/test_models/) and data from .npy, .npz, CSV files
// (tests/fixtures/file_data/, written by NumPy), run as a user would run the command.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using json = nlohmann::json;
using testing::RunResult;

namespace {

const std::string kData = std::string(BOOSTER_FIXTURE_DIR) + "/file_data/";
const std::string kToy = std::string(BOOSTER_TEST_MODEL_DIR) + "/libbooster_model_toy.so";

fs::path scratch_dir() { return testing::scratch_dir("test_cli_files"); }

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, env);
}

fs::path write_config(const std::string& name, const json& config) {
  fs::path p = scratch_dir() / name;
  std::ofstream(p) << config.dump(2);
  return p;
}

json summary_line(const std::string& out) {
  std::istringstream in(out);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return json::parse(last);
}

// The 3-class blobs of the fixtures (120 train, 30 test rows of 4 features) as .npy files.
json npy_config() {
  return {{"model", {{"type", "mlp"}, {"in", 4}, {"hidden", {16}}, {"classes", 3}}},
          {"optimizer", {{"type", "adam"}, {"lr", 0.02}}},
          {"data",
           {{"type", "npy"},
            {"x", kData + "blobs_x.npy"},
            {"y", kData + "blobs_y.npy"},
            {"test_x", kData + "blobs_test_x.npy"},
            {"test_y", kData + "blobs_test_y.npy"},
            {"normalize", "standardize"},
            {"batch_size", 16}}},
          {"train", {{"epochs", 15}, {"log_every", 10}, {"seed", 2}, {"run_dir", nullptr}}}};
}

}  // namespace

TEST_CASE("booster train: an MLP on .npy files learns the blobs", "[cli][files]") {
  const fs::path cfg = write_config("npy.json", npy_config());
  const RunResult r = run_booster("train --config " + cfg.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json summary = summary_line(r.out);
  CHECK(summary["steps"] == 15 * (120 / 16 + 1));
  CHECK(summary["test_accuracy"].get<double>() > 0.9);
  CHECK_THAT(r.err, Contains("blobs_x.npy"));  // the data's description in the log

  // The same rows from a compressed .npz and from CSV, with a test_fraction split.
  json npz = npy_config();
  npz["data"] = {{"type", "npy"}, {"path", kData + "blobs_compressed.npz"}, {"x_key", "inputs"}, {"y_key", "labels"},
                 {"test_fraction", 0.25}, {"normalize", "standardize"}, {"batch_size", 16}};
  const RunResult z = run_booster("train --config " + write_config("npz.json", npz).string());
  INFO(z.err);
  REQUIRE(z.exit_code == 0);
  CHECK(summary_line(z.out)["test_accuracy"].get<double>() > 0.85);
  json csv = npz;
  csv["data"] = {{"type", "csv"}, {"path", kData + "blobs.csv"}, {"label_column", "label"}, {"test_fraction", 0.25},
                 {"batch_size", 16}};
  const RunResult c = run_booster("train --config " + write_config("csv.json", csv).string());
  INFO(c.err);
  REQUIRE(c.exit_code == 0);
  CHECK(summary_line(c.out)["test_accuracy"].get<double>() > 0.85);
}

TEST_CASE("booster train and check: file data errors name the file and the key", "[cli][files]") {
  json bad = npy_config();
  bad["data"]["y"] = kData + "labels_i4.npy";
  RunResult r = run_booster("check --config " + write_config("rows.json", bad).string());
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("blobs_x.npy has 120 rows") && Contains("labels_i4.npy has 6"));
  r = run_booster("train --config " + write_config("in.json", npy_config()).string() + " --set model.in=5");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("'model.in' is 5") && Contains("set 'model.in' to 4"));
  r = run_booster("check --config " + write_config("classes.json", npy_config()).string() + " --set model.classes=2");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("label 2") && Contains("blobs_y.npy"));
  r = run_booster("check --config " + write_config("missing.json", npy_config()).string() +
                  " --set data.x=" + kData + "nothing_here.npy");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("nothing_here.npy does not exist"));
  // One line each.
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
}

TEST_CASE("booster train: a model from the user's model library, by path and by name", "[cli][models]") {
  json c = {{"model", {{"type", "toy_mlp"}, {"library", kToy}, {"in", 8}, {"hidden", 16}, {"classes", 3}}},
            {"optimizer", {{"type", "adam"}, {"lr", 0.02}}},
            {"data", {{"type", "synthetic"}, {"num_samples", 256}, {"num_test_samples", 64}, {"num_features", 8},
                      {"num_classes", 3}, {"batch_size", 32}}},
            {"train", {{"epochs", 3}, {"seed", 1}, {"run_dir", nullptr}}}};
  RunResult r = run_booster("train --config " + write_config("toy.json", c).string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(summary_line(r.out)["test_accuracy"].get<double>() > 0.6);

  // By name, found through BOOSTER_PLUGIN_PATH; `check` prints the library's keys as given.
  c["model"]["library"] = "toy";
  const fs::path by_name = write_config("toy_by_name.json", c);
  r = run_booster("check --config " + by_name.string(), "BOOSTER_PLUGIN_PATH=" BOOSTER_TEST_MODEL_DIR);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("\"library\": \"toy\"") && Contains("\"hidden\": 16"));
  r = run_booster("train --config " + by_name.string() + " --set train.max_steps=3",
                  "BOOSTER_PLUGIN_PATH=" BOOSTER_TEST_MODEL_DIR);
  INFO(r.err);
  CHECK(r.exit_code == 0);
  // Not on the search path: a config error naming the key and where it looked.
  r = run_booster("check --config " + by_name.string(), "BOOSTER_PLUGIN_PATH=/nowhere");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("'model.library'") && Contains("libbooster_model_toy.so") && Contains("/nowhere"));
  // The factory's own option check, as one line.
  r = run_booster("train --config " + write_config("toy_bad.json", c).string() + " --set model.hiden=3",
                  "BOOSTER_PLUGIN_PATH=" BOOSTER_TEST_MODEL_DIR);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("hiden"));
}

// A library model whose children are objects of the library's own classes: the library must stay loaded
// until the last of them is destroyed. PrecisionModule adopts the model's children, so every strategy
// (and the plugins that wrap the model) used to destroy a child after the library was closed: exit
// 139 after the summary.
TEST_CASE("booster train: a library model with children of its own classes exits cleanly under every strategy",
          "[cli][models][plugin]") {
  const json c = {{"model", {{"type", "toy_nested"}, {"library", kToy}, {"in", 8}, {"hidden", 16}, {"classes", 3}}},
                  {"optimizer", {{"type", "adam"}, {"lr", 0.02}}},
                  {"data", {{"type", "synthetic"}, {"num_samples", 64}, {"num_test_samples", 32}, {"num_features", 8},
                            {"num_classes", 3}, {"batch_size", 16}}},
                  {"train", {{"epochs", 1}, {"seed", 1}, {"run_dir", nullptr}}}};
  const std::string config = write_config("toy_nested.json", c).string();
  for (const std::string plugin : {"single", "ddp"})
    for (const std::string precision : {"fp32", "fp16", "bf16", "fp16_naive", "fp16_apex", "fp8"}) {
      INFO(plugin << " " << precision);
      const RunResult r = run_booster("train --config " + config + " --plugin " + plugin + " --mixed-precision " + precision);
      INFO(r.err);
      CHECK(r.exit_code == 0);
      CHECK(summary_line(r.out)["mixed_precision"] == precision);
    }
  // ZeRO with its own bfloat16, and the doctor, which builds and drops the model several times.
  RunResult r = run_booster("train --config " + config + " --plugin low_level_zero --set plugin.precision=bf16");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  r = run_booster("doctor --config " + config + " --mixed-precision fp16");
  INFO(r.err);
  CHECK(r.exit_code == 0);
}
