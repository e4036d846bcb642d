// The `booster` program and the config validation behind it.
//
// The program is run as a user would run it (std::system, stdout and stderr captured to files), so
// these tests check exit codes and the one-line messages, not internals.
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"
#include "booster/config/config.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path scratch_dir() {
  fs::path dir = fs::temp_directory_path() / ("booster_test_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

// Runs `build/bin/booster <args>` through the shell; args are passed as written.
RunResult run_booster(const std::string& args) {
  fs::path dir = scratch_dir();
  fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  std::string cmd = std::string(BOOSTER_BIN_DIR) + "/booster " + args + " >" + out.string() + " 2>" + err.string();
  int status = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

fs::path write_config(const std::string& name, const json& config) {
  fs::path p = scratch_dir() / name;
  std::ofstream(p) << config.dump(2);
  return p;
}

// A small synthetic classification run that trains in a second.
json synthetic_config() {
  return json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "criterion": {"type": "cross_entropy"},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "train": {"epochs": 2, "log_every": 4, "seed": 1}
  })");
}

// The last non-empty line of the program's stdout, parsed as JSON.
json summary_line(const std::string& out) {
  std::istringstream in(out);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return json::parse(last);
}

std::string source_path(const std::string& rel) { return std::string(BOOSTER_SOURCE_DIR) + "/" + rel; }

}  // namespace

// ------------------------------------------------------------------------------------------ config
TEST_CASE("edit distance and nearest key", "[cli][config]") {
  using booster::config::edit_distance;
  using booster::config::nearest;
  CHECK(edit_distance("", "") == 0);
  CHECK(edit_distance("epoch", "epochs") == 1);
  CHECK(edit_distance("kitten", "sitting") == 3);
  CHECK(edit_distance("tpye", "type") == 2);
  CHECK(nearest("epoch", {"max_steps", "epochs", "seed"}) == std::optional<std::string>("epochs"));
  CHECK(nearest("lr_schedular", {"model", "lr_scheduler", "train"}) == std::optional<std::string>("lr_scheduler"));
  // Nothing close: no suggestion rather than a misleading one.
  CHECK_FALSE(nearest("zzzzzzzz", {"epochs", "seed"}).has_value());
}

TEST_CASE("resolve fills defaults and keeps given values", "[cli][config]") {
  json c = booster::config::resolve(synthetic_config());
  CHECK(c["optimizer"]["weight_decay"] == 0.01);  // AdamW's PyTorch default
  CHECK(c["optimizer"]["betas"] == json::array({0.9, 0.999}));
  CHECK(c["optimizer"]["lr"] == 0.01);
  CHECK(c["lr_scheduler"]["type"] == "none");     // optional section
  CHECK(c["criterion"]["label_smoothing"] == 0.0);
  CHECK(c["train"]["max_steps"].is_null());
  CHECK(c["train"]["epochs"] == 2);
  CHECK(c["data"]["shuffle"] == true);
  // An integral float is accepted for an integer and stored as one.
  json d = synthetic_config();
  d["train"]["epochs"] = 3.0;
  CHECK(booster::config::resolve(d)["train"]["epochs"].is_number_integer());
  // What `booster check` prints is itself a valid config that resolves to the same thing.
  CHECK(booster::config::resolve(c) == c);
}

TEST_CASE("config errors name the path, the value and what is allowed", "[cli][config]") {
  using Catch::Matchers::Contains;
  using booster::ConfigError;
  json c = synthetic_config();

  c["train"]["epoch"] = 3;
  REQUIRE_THROWS_WITH(booster::config::resolve(c), Contains("train.epoch") && Contains("did you mean 'epochs'?"));
  c = synthetic_config();
  c["optimizer"]["lr"] = "fast";
  REQUIRE_THROWS_WITH(booster::config::resolve(c), Contains("optimizer.lr") && Contains("\"fast\"") &&
                                                       Contains("a number"));
  c = synthetic_config();
  c["optimizer"]["betas"] = json::array({0.9, 1.0});
  REQUIRE_THROWS_WITH(booster::config::resolve(c), Contains("optimizer.betas[1]") && Contains("[0, 1)"));
  c = synthetic_config();
  c["optimizer"]["betas"] = json::array({0.9});
  REQUIRE_THROWS_AS(booster::config::resolve(c), ConfigError);
  c = synthetic_config();
  c["model"]["type"] = "mpl";
  REQUIRE_THROWS_WITH(booster::config::resolve(c), Contains("model.type") && Contains("did you mean 'mlp'?"));
  c = synthetic_config();
  c["train"]["epochs"] = 2.5;
  REQUIRE_THROWS_WITH(booster::config::resolve(c), Contains("train.epochs") && Contains("2.5") &&
                                                       Contains("an integer"));
  c = synthetic_config();
  c["data"]["type"] = "text";  // text needs a path
  REQUIRE_THROWS_WITH(booster::config::resolve(c), Contains("data"));
  c = synthetic_config();
  c.erase("model");
  REQUIRE_THROWS_WITH(booster::config::resolve(c), Contains("'model' is missing"));
  c = synthetic_config();
  c["modle"] = json::object();
  REQUIRE_THROWS_WITH(booster::config::resolve(c), Contains("did you mean 'model'?"));
}

TEST_CASE("set overrides parse JSON values and fall back to strings", "[cli][config]") {
  json c = synthetic_config();
  booster::config::apply_override(c, "optimizer.lr=3e-4");
  CHECK(c["optimizer"]["lr"] == 3e-4);
  booster::config::apply_override(c, "optimizer.type=sgd");  // not JSON: a string
  CHECK(c["optimizer"]["type"] == "sgd");
  booster::config::apply_override(c, "model.hidden=[4, 5]");
  CHECK(c["model"]["hidden"] == json::array({4, 5}));
  booster::config::apply_override(c, "lr_scheduler.type=cosine");  // creates the section
  CHECK(c["lr_scheduler"]["type"] == "cosine");
  booster::config::apply_override(c, "data.shuffle=false");
  CHECK(c["data"]["shuffle"] == false);
  REQUIRE_THROWS_AS(booster::config::apply_override(c, "optimizer.lr"), booster::ConfigError);
  REQUIRE_THROWS_WITH(booster::config::apply_override(c, "train.epochs.x=1"),
                      Catch::Matchers::Contains("train.epochs"));
}

// ------------------------------------------------------------------------------------------ program
TEST_CASE("booster --help and --version exit 0", "[cli]") {
  RunResult help = run_booster("--help");
  CHECK(help.exit_code == 0);
  CHECK(help.out.find("train") != std::string::npos);
  RunResult train_help = run_booster("train --help");
  CHECK(train_help.exit_code == 0);
  CHECK(train_help.out.find("--set") != std::string::npos);
  RunResult version = run_booster("--version");
  CHECK(version.exit_code == 0);
  CHECK(version.out.find("CUDA:") != std::string::npos);
  CHECK(version.out.find("MPI:") != std::string::npos);
}

TEST_CASE("usage mistakes exit 2 with one line on stderr", "[cli]") {
  RunResult r = run_booster("trian");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("did you mean 'train'?") != std::string::npos);
  r = run_booster("train");  // no --config
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--config") != std::string::npos);
  r = run_booster("train --config x.json --frobnicate");
  CHECK(r.exit_code == 2);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
}

TEST_CASE("an unknown config key exits 2 naming the path and the nearest key", "[cli]") {
  json c = synthetic_config();
  c["train"]["epoch"] = 1;
  RunResult r = run_booster("train --config " + write_config("unknown_key.json", c).string());
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("train.epoch") != std::string::npos);
  CHECK(r.err.find("did you mean 'epochs'?") != std::string::npos);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);  // one line, no trace
  CHECK(r.out.empty());
}

TEST_CASE("a wrong type exits 2 naming the path and the value", "[cli]") {
  json c = synthetic_config();
  c["data"]["batch_size"] = "big";
  RunResult r = run_booster("train --config " + write_config("wrong_type.json", c).string());
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("data.batch_size") != std::string::npos);
  CHECK(r.err.find("\"big\"") != std::string::npos);
}

TEST_CASE("a missing or broken config file exits 2 naming it", "[cli]") {
  RunResult r = run_booster("train --config /nonexistent/booster_config.json");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("/nonexistent/booster_config.json") != std::string::npos);
  fs::path broken = scratch_dir() / "broken.json";
  std::ofstream(broken) << "{\"model\": {";
  r = run_booster("check --config " + broken.string());
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("broken.json") != std::string::npos);
  CHECK(r.err.find("line") != std::string::npos);
}

TEST_CASE("set overrides are applied and validated", "[cli]") {
  fs::path cfg = write_config("set.json", synthetic_config());
  RunResult r = run_booster("check --config " + cfg.string() +
                            " --set optimizer.lr=0.5 --set train.max_steps=3 --set optimizer.type=sgd");
  REQUIRE(r.exit_code == 0);
  json resolved = json::parse(r.out);
  CHECK(resolved["optimizer"]["lr"] == 0.5);
  CHECK(resolved["optimizer"]["type"] == "sgd");
  CHECK(resolved["optimizer"]["momentum"] == 0.0);  // SGD's defaults, not AdamW's
  CHECK(resolved["train"]["max_steps"] == 3);

  r = run_booster("train --config " + cfg.string() + " --set optimizer.lr=-1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("optimizer.lr") != std::string::npos);
  CHECK(r.err.find("-1") != std::string::npos);
  r = run_booster("train --config " + cfg.string() + " --set train.epoch=1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("did you mean 'epochs'?") != std::string::npos);
  r = run_booster("train --config " + cfg.string() + " --set noequals");
  CHECK(r.exit_code == 2);
}

TEST_CASE("settings that contradict each other across sections exit 2 naming both", "[cli]") {
  fs::path cfg = write_config("cross.json", synthetic_config());
  RunResult r = run_booster("check --config " + cfg.string() + " --set model.in=9");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("model.in") != std::string::npos);
  CHECK(r.err.find("8 features") != std::string::npos);
  r = run_booster("check --config " + cfg.string() + " --set data.type=text --set data.path=/x --set data.num_samples=1");
  CHECK(r.exit_code == 2);  // num_samples is not a key of text data
  CHECK(r.err.find("unknown key 'data.num_") != std::string::npos);
}

TEST_CASE("a runtime failure exits 1 with one line naming the cause", "[cli]") {
  json c = json::parse(R"({
    "model": {"type": "gpt", "vocab_size": 256, "context": 8, "width": 8, "layers": 1, "heads": 2},
    "optimizer": {"type": "adamw"},
    "data": {"type": "text", "path": "/nonexistent/corpus.txt", "context": 8}
  })");
  RunResult r = run_booster("train --config " + write_config("runtime.json", c).string());
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("/nonexistent/corpus.txt") != std::string::npos);
  CHECK(r.err.find("booster: error: ") != std::string::npos);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
}

TEST_CASE("the shipped example configs are valid", "[cli]") {
  for (const char* name : {"examples/configs/fashion_mnist_mlp.json", "examples/configs/gpt_char.json"}) {
    INFO(name);
    RunResult r = run_booster(std::string("check --config ") + source_path(name));
    CHECK(r.exit_code == 0);
    CHECK_NOTHROW(json::parse(r.out));
  }
}

TEST_CASE("a short synthetic training run prints a JSON summary", "[cli]") {
  fs::path cfg = write_config("synthetic.json", synthetic_config());
  RunResult r = run_booster("train --config " + cfg.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  json summary = summary_line(r.out);
  for (const char* key : {"final_loss", "steps", "seconds", "test_accuracy", "samples_per_second"}) {
    INFO(key);
    CHECK(summary.contains(key));
  }
  CHECK(summary["steps"] == 16);  // 256 samples / 32 per batch * 2 epochs
  CHECK(summary["final_loss"].get<double>() < 1.0986);  // below chance for 3 classes: it learned
  CHECK(summary["test_accuracy"].get<double>() > 0.5);
  CHECK(r.err.find("step") != std::string::npos);  // progress went to stderr

  // max_steps stops early, and the same seed gives the same loss.
  RunResult a = run_booster("train --config " + cfg.string() + " --set train.max_steps=5");
  RunResult b = run_booster("train --config " + cfg.string() + " --set train.max_steps=5");
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  CHECK(summary_line(a.out)["steps"] == 5);
  CHECK(summary_line(a.out)["final_loss"] == summary_line(b.out)["final_loss"]);
}

TEST_CASE("a tiny character GPT trains on a text file", "[cli]") {
  fs::path text = scratch_dir() / "corpus.txt";
  {
    std::ofstream out(text);
    for (int i = 0; i < 200; ++i) out << "the quick brown fox jumps over the lazy dog. ";
  }
  json c = json::parse(R"({
    "model": {"type": "gpt", "vocab_size": 256, "context": 16, "width": 16, "layers": 1, "heads": 2},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "text", "context": 16, "batch_size": 8},
    "lr_scheduler": {"type": "linear_warmup", "warmup_steps": 2},
    "train": {"max_steps": 6, "log_every": 3}
  })");
  c["data"]["path"] = text.string();
  RunResult r = run_booster("train --config " + write_config("gpt.json", c).string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  json summary = summary_line(r.out);
  CHECK(summary["steps"] == 6);
  CHECK(summary.contains("tokens_per_second"));
  CHECK(summary.contains("test_accuracy"));  // next-character accuracy on the file's last 10%
  CHECK(summary["final_loss"].get<double>() < std::log(256.0));  // better than uniform over bytes
}

TEST_CASE("the default Fashion-MNIST config reaches 85% test accuracy", "[cli][e2e]") {
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    WARN("skipped: /usr/share/datasets/fashion-mnist is absent");
    return;
  }
  RunResult r = run_booster("train --config " + source_path("examples/configs/fashion_mnist_mlp.json"));
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  json summary = summary_line(r.out);
  REQUIRE(summary.contains("test_accuracy"));
  CHECK(summary["test_accuracy"].get<double>() >= 0.85);
  WARN("Fashion-MNIST: test accuracy " << summary["test_accuracy"] << " in " << summary["seconds"] << " s");
}
