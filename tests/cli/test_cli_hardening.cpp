// Faults an operator meets, through the real `booster` binary: damaged checkpoints, a `latest` that
// names nothing, hostile configs, a full disk, a FIFO where a plugin should be. Each must end in one
// clear line and a non-zero exit, never a crash, a hang or a silently wrong run.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/data/fashion_mnist.h"
#include "booster/data/npy.h"
#include "booster/ops/ops.h"
#include "run_booster.h"
#include "skip.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::read_text;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_hardening"); }

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, env);
}

fs::path write_text(const std::string& name, const std::string& text) {
  const fs::path p = scratch_dir() / name;
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
  return p;
}

json small_config() {
  return json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "train": {"epochs": 2, "max_steps": 12, "log_every": 4, "seed": 3, "run_dir": null, "keep_last": 0}
  })");
}

fs::path step_dir(const fs::path& root, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d", step);
  return root / name;
}

// Trains the small config into a fresh checkpoint root, saving at steps 4, 8 and 12.
fs::path train_with_checkpoints(const std::string& name) {
  const fs::path root = scratch_dir() / name;
  fs::remove_all(root);
  const fs::path cfg = write_text(name + ".json", small_config().dump());
  const RunResult r = run_booster("train --config " + cfg.string() + " --set train.checkpoint_every=4 " +
                                  "--set train.checkpoint_dir=" + root.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return root;
}

std::string resume_args(const fs::path& root, const std::string& resume = "latest") {
  const fs::path cfg = scratch_dir() / "resume.json";
  std::ofstream(cfg, std::ios::trunc) << small_config().dump();
  return "train --config " + cfg.string() + " --set train.checkpoint_every=4 --set train.checkpoint_dir=" +
         root.string() + " --resume " + resume;
}

// Flips one bit of the byte at `offset` of `file`.
void flip_bit(const fs::path& file, uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(offset));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x10);
  f.seekp(std::streamoff(offset));
  f.write(&c, 1);
}

// The first line of a message, and that there is only one.
std::string one_line(const std::string& err) {
  const std::string line = err.substr(0, err.find('\n'));
  return line;
}

}  // namespace

TEST_CASE("a flipped bit in a checkpoint's tensor data is refused, naming the file and the tensor", "[cli][hardening]") {
  const fs::path root = train_with_checkpoints("flip");
  for (const char* file : {"model/model.safetensors", "optimizer/optimizer.safetensors"}) {
    INFO(file);
    // A damaged copy of step 12 in a root of its own, so each file is tried alone.
    const fs::path damaged = scratch_dir() / "flip_damaged";
    fs::remove_all(damaged);
    fs::create_directories(damaged);
    fs::copy(step_dir(root, 12), step_dir(damaged, 12), fs::copy_options::recursive);
    std::ofstream(damaged / "latest") << "step-00000012\n";
    const fs::path target = step_dir(damaged, 12) / file;
    const auto spans = booster::checkpoint::safetensors_spans(target);
    REQUIRE(!spans.empty());
    const auto& victim = spans[spans.size() / 2];  // a tensor in the middle of the data: its middle byte
    flip_bit(target, (victim.begin + victim.end) / 2);

    const RunResult refused = run_booster(resume_args(damaged));
    INFO(refused.err);
    CHECK(refused.exit_code == 1);
    CHECK_THAT(refused.err, Catch::Contains(target.string()) && Catch::Contains("'" + victim.name + "'") &&
                                Catch::Contains("checksum") && Catch::Contains("--no-verify"));
    CHECK(refused.out.empty());  // no summary: nothing was trained

    // The escape hatch loads it as it is (a run that is already at its last step trains no more).
    const RunResult forced = run_booster(resume_args(damaged) + " --no-verify");
    INFO(forced.err);
    CHECK(forced.exit_code == 0);
  }
}

// Named by its path, a damaged step is refused (a root's `latest` falls back to an older step instead:
// "resume from latest falls back past a damaged newest step and keeps it").
TEST_CASE("damage to a checkpoint's other files is refused too", "[cli][hardening]") {
  const fs::path root = train_with_checkpoints("damage");
  const fs::path dir = step_dir(root, 12);
  SECTION("a digit of trainer_state.json") {
    std::string text = read_text(dir / "trainer_state.json");
    const size_t at = text.find("\"step\": 12");
    REQUIRE(at != std::string::npos);
    text[at + 9] = '3';  // a still valid JSON that claims step 13
    std::ofstream(dir / "trainer_state.json", std::ios::trunc | std::ios::binary) << text;
    const RunResult r = run_booster(resume_args(root, dir.string()));
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("trainer_state.json") && Catch::Contains("checksum"));
  }
  SECTION("a safetensors header") {
    flip_bit(dir / "model" / "model.safetensors", 20);
    const RunResult r = run_booster(resume_args(root, dir.string()));
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("model.safetensors") && Catch::Contains("header"));
  }
  SECTION("a file cut short") {
    fs::resize_file(dir / "optimizer" / "optimizer.safetensors", fs::file_size(dir / "optimizer" / "optimizer.safetensors") - 4);
    const RunResult r = run_booster(resume_args(root, dir.string()));
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("optimizer.safetensors") && Catch::Contains("bytes"));
  }
  SECTION("the checksums removed") {
    fs::remove(dir / "checksums.json");
    const RunResult r = run_booster(resume_args(root, dir.string()));
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("checksums.json") && Catch::Contains("--no-verify"));
  }
  SECTION("an undamaged checkpoint resumes") {
    const RunResult r = run_booster(resume_args(root, dir.string()));
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK(json::parse(r.out)["resumed_from"] == dir.string());
  }
}

TEST_CASE("resume latest: a latest that names a missing step is an error listing the steps there", "[cli][hardening]") {
  const fs::path root = train_with_checkpoints("dangling");
  SECTION("the step directory is gone") {
    fs::remove_all(step_dir(root, 12));
    const RunResult r = run_booster(resume_args(root));
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(one_line(r.err), Catch::Contains("step-00000012") && Catch::Contains("does not exist") &&
                                    Catch::Contains("step-00000004, step-00000008"));
    CHECK(r.out.empty());
  }
  SECTION("latest is a dangling symlink") {
    fs::remove(root / "latest");
    fs::create_directory_symlink(step_dir(root, 16), root / "latest");
    const RunResult r = run_booster(resume_args(root));
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(one_line(r.err), Catch::Contains("step-00000016") && Catch::Contains("does not exist"));
  }
  SECTION("latest is a symlink to a step") {
    fs::remove(root / "latest");
    fs::create_directory_symlink(step_dir(root, 8), root / "latest");
    const RunResult r = run_booster(resume_args(root));
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK(json::parse(r.out)["resumed_from"] == step_dir(root, 8).string());
  }
  SECTION("only leftovers that are not checkpoints") {
    fs::remove_all(root);
    fs::create_directories(root / "step-00000004.tmp");  // a first save killed before its commit
    const RunResult r = run_booster(resume_args(root));
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.err, Catch::Contains("no checkpoint in " + root.string() + " yet; starting from step 0"));
    CHECK(json::parse(r.out)["resumed_from"].is_null());
  }
  SECTION("a directory holding something else") {
    fs::remove_all(root);
    fs::create_directories(root);
    std::ofstream(root / "notes.txt") << "not a checkpoint";
    const RunResult r = run_booster(resume_args(root));
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("no checkpoint in " + root.string()));
  }
}

TEST_CASE("deeply nested JSON is a config error with its path, not a crash", "[cli][hardening][config]") {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  json config = small_config();
  SECTION("at the top of the file") {
    const fs::path cfg = write_text("deep_top.json", deep);
    const RunResult r = run_booster("check --config " + cfg.string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("nested more than 64 deep"));
  }
  SECTION("inside model.hidden") {
    std::string text = config.dump();
    const std::string hidden = "\"hidden\":[16]";
    REQUIRE(text.find(hidden) != std::string::npos);
    text.replace(text.find(hidden), hidden.size(), "\"hidden\":" + deep);
    const fs::path cfg = write_text("deep_hidden.json", text);
    const RunResult r = run_booster("check --config " + cfg.string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(one_line(r.err), Catch::Contains("'model.hidden[0][0]") && Catch::Contains("nested more than 64"));
    CHECK(r.err.size() < 1000);
  }
  SECTION("in a --set value") {
    const fs::path cfg = write_text("deep_set.json", config.dump());
    const RunResult r = run_booster("check --config " + cfg.string() + " --set 'model.hidden=" + std::string(5000, '[') + "'");
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("--set") && Catch::Contains("nested more than 64"));
  }
}

TEST_CASE("a key given twice is refused with both positions", "[cli][hardening][config]") {
  const fs::path cfg = write_text("duplicate.json", "{\n  \"model\": {\"type\": \"mlp\"},\n  \"data\": {},\n  \"model\": {}\n}\n");
  const RunResult r = run_booster("check --config " + cfg.string());
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("\"model\" is given twice") && Catch::Contains("line 4") &&
                        Catch::Contains("first at line 2, column 3"));
  // Inside a section too.
  const fs::path inner = write_text("duplicate_inner.json", R"({"optimizer": {"lr": 0.1, "type": "sgd", "lr": 0.2}})");
  const RunResult r2 = run_booster("check --config " + inner.string());
  CHECK(r2.exit_code == 2);
  CHECK_THAT(r2.err, Catch::Contains("'optimizer.lr'") && Catch::Contains("given twice"));
}

TEST_CASE("values a config cannot hold are one short line naming the key, exit 2", "[cli][hardening][config]") {
  json config = small_config();
  SECTION("a batch size past what an int64 holds") {
    std::string text = config.dump();
    text.replace(text.find("\"batch_size\":32"), 15, "\"batch_size\":9223372036854775808");
    const RunResult r = run_booster("check --config " + write_text("big_batch.json", text).string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("data.batch_size"));
  }
  SECTION("a number out of the range of a double") {
    std::string text = config.dump();
    text.replace(text.find("\"lr\":0.01"), 9, "\"lr\":1e400");
    const fs::path cfg = write_text("overflow.json", text);
    const RunResult r = run_booster("check --config " + cfg.string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains(cfg.string()) && Catch::Contains("'optimizer.lr'") && Catch::Contains("1e400"));
  }
  SECTION("a 10 MB value is not echoed back") {
    config["data"]["type"] = std::string(10'000'000, 'x');
    const RunResult r = run_booster("check --config " + write_text("long_value.json", config.dump()).string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("data.type"));
    CHECK(r.err.size() < 2000);
  }
  SECTION("a NUL inside a key") {
    const fs::path cfg = write_text("nul_key.json", R"({"mo\u0000del": {}})");
    const RunResult r = run_booster("check --config " + cfg.string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("mo\\u0000del") && Catch::Contains("control character"));
  }
  SECTION("a config file larger than any config") {
    config["padding"] = std::string(75'000'000, ' ');
    const RunResult r = run_booster("check --config " + write_text("huge.json", config.dump()).string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("75.0 MB") && Catch::Contains("limited to"));
  }
  fs::remove(scratch_dir() / "long_value.json");
  fs::remove(scratch_dir() / "huge.json");
}

TEST_CASE("a plugin or config path that is a FIFO is refused, not opened", "[cli][hardening]") {
  const fs::path fifo = scratch_dir() / "plugin_fifo.so";
  fs::remove(fifo);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const fs::path cfg = write_text("fifo.json", small_config().dump());
  // `timeout` turns a hang into exit 124.
  RunResult r = run_booster("check --config " + cfg.string() + " --plugin " + fifo.string(), "timeout 60");
  CHECK(r.exit_code == 1);  // as for a plugin path that does not exist
  CHECK_THAT(r.err, Catch::Contains(fifo.string()) && Catch::Contains("not a regular file"));
  r = run_booster("check --config " + fifo.string(), "timeout 60");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("not a regular file"));
  fs::remove(fifo);
}

TEST_CASE("a metrics record that cannot be written stops the run, and a resume rewrites it", "[cli][hardening]") {
  // /dev/full fails every write with ENOSPC, as a full disk does.
  if (!fs::exists("/dev/full")) {
    skip_test("this system has no /dev/full to stand for a full disk");
    return;
  }
  const fs::path run_dir = scratch_dir() / "full_run", root = scratch_dir() / "full_ckpt";
  fs::remove_all(run_dir);
  fs::remove_all(root);
  fs::create_directories(run_dir);
  fs::create_symlink("/dev/full", run_dir / "metrics.jsonl");
  json config = small_config();
  config["train"]["log_every"] = 6;
  const fs::path cfg = write_text("full.json", config.dump());
  const std::string args = "train --config " + cfg.string() + " --set train.checkpoint_every=4 --set train.run_dir=" +
                           run_dir.string() + " --set train.checkpoint_dir=" + root.string();
  const RunResult stopped = run_booster(args);
  INFO(stopped.err);
  CHECK(stopped.exit_code == 1);
  CHECK_THAT(stopped.err, Catch::Contains("metrics.jsonl") && Catch::Contains("No space left on device") &&
                              Catch::Contains("at step 6") && Catch::Contains(step_dir(root, 4).string()));
  // It stopped without saving past the lost record.
  CHECK(fs::exists(step_dir(root, 4)));
  CHECK_FALSE(fs::exists(step_dir(root, 8)));

  // With space again, the resume writes the records of steps 6 and 12.
  fs::remove(run_dir / "metrics.jsonl");
  const RunResult resumed = run_booster(args + " --resume latest");
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  std::vector<int64_t> steps;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const json record = json::parse(line);
    if (record["kind"] == "train") steps.push_back(record["step"].get<int64_t>());
  }
  CHECK(steps == std::vector<int64_t>{6, 12});

  // Chosen: going on without the records.
  fs::remove_all(run_dir);
  fs::remove_all(root);
  fs::create_directories(run_dir);
  fs::create_symlink("/dev/full", run_dir / "metrics.jsonl");
  const RunResult warned = run_booster(args + " --set train.on_write_error=warn");
  INFO(warned.err);
  CHECK(warned.exit_code == 0);
  CHECK_THAT(warned.err, Catch::Contains("warning: cannot write") && Catch::Contains("going on"));
}

TEST_CASE("the summary line that cannot be written is an error", "[cli][hardening]") {
  if (!fs::exists("/dev/full")) {
    skip_test("this system has no /dev/full to stand for a full disk");
    return;
  }
  const fs::path cfg = write_text("summary.json", small_config().dump());
  const std::string cmd = std::string(BOOSTER_BIN_DIR) + "/booster train --config " + cfg.string() +
                          " > /dev/full 2> " + (scratch_dir() / "summary_err.txt").string();
  const int status = std::system(cmd.c_str());
  CHECK(WEXITSTATUS(status) == 1);
  CHECK_THAT(read_text(scratch_dir() / "summary_err.txt"), Catch::Contains("cannot write the summary"));
}

TEST_CASE("unreadable lines in metrics.jsonl at resume are kept aside with a warning", "[cli][hardening]") {
  const fs::path run_dir = scratch_dir() / "garbage_run", root = scratch_dir() / "garbage_ckpt";
  fs::remove_all(run_dir);
  fs::remove_all(root);
  const fs::path cfg = write_text("garbage.json", small_config().dump());
  const std::string args = "train --config " + cfg.string() + " --set train.checkpoint_every=4 --set train.run_dir=" +
                           run_dir.string() + " --set train.checkpoint_dir=" + root.string();
  REQUIRE(run_booster(args).exit_code == 0);
  std::ofstream(run_dir / "metrics.jsonl", std::ios::app) << "this is not JSON\n{\"kind\": \"train\", \"step\": 3}\n";
  const RunResult r = run_booster(args + " --resume latest");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("warning: 1 line(s)") && Catch::Contains("metrics.jsonl.unreadable"));
  CHECK_THAT(read_text(run_dir / "metrics.jsonl.unreadable"), Catch::Contains("this is not JSON"));
}

TEST_CASE("a gzip file whose end is cut is refused, whatever the cut", "[hardening][data]") {
  const fs::path source = fs::path(booster::data::kFashionMnistDir);
  if (!fs::exists(source / "t10k-labels-idx1-ubyte.gz")) {
    skip_test("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
    return;
  }
  const fs::path dir = scratch_dir() / "cut_gzip";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(source / "t10k-images-idx3-ubyte.gz", dir / "t10k-images-idx3-ubyte.gz");
  const std::string whole = read_text(source / "t10k-labels-idx1-ubyte.gz");
  // 1-8 bytes cut the CRC/length trailer only (the data is whole), more cut the deflate stream too.
  for (size_t cut = 1; cut <= 12; ++cut) {
    INFO("cut " << cut << " bytes");
    std::ofstream(dir / "t10k-labels-idx1-ubyte.gz", std::ios::binary | std::ios::trunc)
        << whole.substr(0, whole.size() - cut);
    CHECK_THROWS_AS(booster::data::load_fashion_mnist(dir.string(), /*train=*/false), booster::DataError);
    CHECK_THROWS_WITH(booster::data::load_fashion_mnist(dir.string(), /*train=*/false),
                      Catch::Contains("t10k-labels-idx1-ubyte.gz") &&
                          (Catch::Contains("truncated") || Catch::Contains("corrupt")));
  }
  std::ofstream(dir / "t10k-labels-idx1-ubyte.gz", std::ios::binary | std::ios::trunc) << whole;
  CHECK(booster::data::load_fashion_mnist(dir.string(), /*train=*/false)->size() == 10000);
}

TEST_CASE("a large gzip file cut inside its trailer stops the command", "[hardening][data]") {
  // The images are read in reads larger than zlib's gz buffer, the path on which gzread took a stream
  // cut inside its CRC/length trailer for a whole one (Note [Whole gzip streams]).
  const fs::path source = fs::path(booster::data::kFashionMnistDir);
  if (!fs::exists(source / "train-images-idx3-ubyte.gz")) {
    skip_test("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
    return;
  }
  const fs::path dir = scratch_dir() / "cut_gzip_train";
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* name : {"train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"})
    fs::create_symlink(source / name, dir / name);
  const std::string whole = read_text(source / "train-images-idx3-ubyte.gz");
  for (size_t cut : {size_t(1), size_t(4), size_t(8)}) {
    INFO("cut " << cut << " bytes");
    std::ofstream(dir / "train-images-idx3-ubyte.gz", std::ios::binary | std::ios::trunc)
        << whole.substr(0, whole.size() - cut);
    const RunResult r = run_booster("train --config " + std::string(BOOSTER_SOURCE_DIR) +
                                    "/examples/configs/fashion_mnist_mlp.json --set data.dir=" + dir.string() +
                                    " --set train.max_steps=1 --set train.run_dir=null");
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.err, Catch::Contains("train-images-idx3-ubyte.gz") && Catch::Contains("truncated"));
  }
  fs::remove_all(dir);
}

TEST_CASE("an all-NaN .npy data set is refused naming the file and the index, and when allowed stops at the first step",
          "[cli][hardening][data]") {
  // issue 38: this trained to loss 1.07 and exit 0 (the CPU ReLU turned NaN into 0).
  const fs::path x = scratch_dir() / "all_nan_x.npy", y = scratch_dir() / "all_nan_y.npy";
  std::vector<int64_t> labels(64);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = int64_t(i % 3);
  booster::data::write_npy(x, booster::full({64, 8}, NAN, booster::DType::Float32));
  booster::data::write_npy(y, booster::from_vector(labels, {64}));
  json cfg = small_config();
  cfg["data"] = {{"type", "npy"}, {"x", x.string()}, {"y", y.string()}, {"batch_size", 16}};
  const fs::path path = write_text("all_nan.json", cfg.dump());
  for (const std::string command : {"train", "check"}) {
    INFO(command);
    const RunResult r = run_booster(command + " --config " + path.string());
    INFO(r.err);
    CHECK(r.exit_code == 1);  // a DataError, as every other data file a run cannot use
    CHECK_THAT(one_line(r.err), Catch::Contains("all_nan_x.npy: sample 0, element 0 (index [0, 0]) is nan") &&
                                    Catch::Contains("data.allow_nonfinite"));
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
  // Allowed, the NaN reaches the loss (relu keeps it, as torch's) and the run stops there.
  const RunResult r = run_booster("train --config " + path.string() + " --set data.allow_nonfinite=true");
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("the loss is nan at step 1"));
  CHECK(r.out.find("final_loss") == std::string::npos);
}

// ---------------------------------------------------------------------------------------------------
// issue 38, item 4: no file of a checkpoint is read unverified (Note [Checkpoint checksums]).

namespace {

// `dir`/checksums.json without the entry of `file` (relative to the step).
void drop_checksum_entry(const fs::path& dir, const std::string& file) {
  json manifest = json::parse(read_text(dir / "checksums.json"));
  REQUIRE(manifest["files"].erase(file) == 1);
  std::ofstream(dir / "checksums.json", std::ios::trunc | std::ios::binary) << manifest.dump(1) << "\n";
}

// A copy of step 12 of `root` in a root of its own, named by `latest`; returns the step directory.
fs::path copy_step(const fs::path& root, const std::string& name) {
  const fs::path copy = scratch_dir() / name;
  fs::remove_all(copy);
  fs::create_directories(copy);
  fs::copy(step_dir(root, 12), step_dir(copy, 12), fs::copy_options::recursive);
  std::ofstream(copy / "latest") << "step-00000012\n";
  return step_dir(copy, 12);
}

// The tensor in the middle of a safetensors file, after one bit of its middle byte is flipped.
std::string flip_middle_tensor(const fs::path& file) {
  const auto spans = booster::checkpoint::safetensors_spans(file);
  REQUIRE(!spans.empty());
  const auto& victim = spans[spans.size() / 2];
  flip_bit(file, (victim.begin + victim.end) / 2);
  return victim.name;
}

std::string init_from_args(const fs::path& from) {
  const fs::path cfg = write_text("init_from.json", small_config().dump());
  return "train --config " + cfg.string() + " --set train.max_steps=1 --set model.init_from=" + from.string();
}

}  // namespace

TEST_CASE("a checkpoint file that checksums.json does not list is refused, naming it", "[cli][hardening]") {
  const fs::path root = train_with_checkpoints("uncovered");
  SECTION("a file's entry removed, then the file damaged") {
    // Read unverified, the damage would be trained on.
    for (const std::string file : {"model/model.safetensors", "optimizer/optimizer.safetensors", "trainer_state.json"}) {
      INFO(file);
      const fs::path dir = copy_step(root, "uncovered_entry");
      drop_checksum_entry(dir, file);
      if (file.ends_with(".safetensors")) flip_middle_tensor(dir / file);
      const RunResult r = run_booster(resume_args(dir.parent_path()));
      INFO(r.err);
      CHECK(r.exit_code == 1);
      CHECK_THAT(one_line(r.err), Catch::Contains((dir / file).string()) && Catch::Contains("not covered by") &&
                                      Catch::Contains("checksums.json") && Catch::Contains("another checkpoint"));
      CHECK(r.out.empty());
    }
  }
  SECTION("a file added to the step after the save") {
    const fs::path dir = copy_step(root, "uncovered_added");
    std::ofstream(dir / "model" / "extra.safetensors") << "added later";
    const RunResult r = run_booster(resume_args(dir.parent_path()));
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(one_line(r.err), Catch::Contains((dir / "model" / "extra.safetensors").string()) &&
                                    Catch::Contains("not covered by"));
  }
  SECTION("--no-verify still loads it as it is") {
    const fs::path dir = copy_step(root, "uncovered_forced");
    drop_checksum_entry(dir, "model/model.safetensors");
    const RunResult r = run_booster(resume_args(dir.parent_path()) + " --no-verify");
    INFO(r.err);
    CHECK(r.exit_code == 0);
  }
}

TEST_CASE("model.init_from a checkpoint verifies its model files as a resume does", "[cli][hardening]") {
  const fs::path root = train_with_checkpoints("init_verify");
  SECTION("a flipped bit in a tensor, from the step or from its model folder") {
    const fs::path dir = copy_step(root, "init_flip");
    const fs::path file = dir / "model" / "model.safetensors";
    const std::string tensor = flip_middle_tensor(file);
    for (const fs::path& from : {dir / "model", dir, file}) {
      INFO(from);
      const RunResult r = run_booster(init_from_args(from));
      INFO(r.err);
      CHECK(r.exit_code == 1);
      CHECK_THAT(one_line(r.err), Catch::Contains("model.init_from") && Catch::Contains(file.string()) &&
                                      Catch::Contains("'" + tensor + "'") && Catch::Contains("checksum") &&
                                      Catch::Contains("--no-verify"));
      CHECK(r.out.empty());
    }
    // --no-verify takes the weights as they are.
    const RunResult forced = run_booster(init_from_args(dir / "model") + " --no-verify");
    INFO(forced.err);
    CHECK(forced.exit_code == 0);
  }
  SECTION("the model's entry removed from checksums.json") {
    const fs::path dir = copy_step(root, "init_uncovered");
    drop_checksum_entry(dir, "model/model.safetensors");
    const RunResult r = run_booster(init_from_args(dir / "model"));
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(one_line(r.err), Catch::Contains((dir / "model" / "model.safetensors").string()) &&
                                    Catch::Contains("not covered by"));
  }
  SECTION("checksums.json removed from a step whose format records one") {
    const fs::path dir = copy_step(root, "init_no_checksums");
    fs::remove(dir / "checksums.json");
    const RunResult r = run_booster(init_from_args(dir / "model"));
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(one_line(r.err), Catch::Contains(dir.string()) && Catch::Contains("has no checksums.json"));
  }
  SECTION("an undamaged step and its model folder load, and a damaged optimizer does not matter") {
    const fs::path dir = copy_step(root, "init_whole");
    flip_middle_tensor(dir / "optimizer" / "optimizer.safetensors");  // init_from reads only the model
    for (const fs::path& from : {dir / "model", dir, dir / "model" / "model.safetensors"}) {
      INFO(from);
      const RunResult r = run_booster(init_from_args(from));
      INFO(r.err);
      CHECK(r.exit_code == 0);
      CHECK(r.err.find("warning") == std::string::npos);
    }
  }
  SECTION("weights outside a checkpoint carry no checksums and load without a word") {
    // A Hugging Face style folder (the model's files alone) and a plain .safetensors file.
    const fs::path folder = scratch_dir() / "init_plain_folder";
    fs::remove_all(folder);
    fs::copy(step_dir(root, 12) / "model", folder, fs::copy_options::recursive);
    const fs::path file = scratch_dir() / "init_plain.safetensors";
    fs::copy_file(folder / "model.safetensors", file, fs::copy_options::overwrite_existing);
    for (const fs::path& from : {folder, file}) {
      INFO(from);
      const RunResult r = run_booster(init_from_args(from));
      INFO(r.err);
      CHECK(r.exit_code == 0);
      CHECK(r.err.find("warning") == std::string::npos);
      CHECK(r.err.find("checksum") == std::string::npos);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// issue 38, item 5: a damaged library file is refused before dlopen (Note [Checking a library before
// dlopen] in booster/plugin/loader.cpp), not met as SIGBUS inside it.

TEST_CASE("a truncated plugin library is refused naming the file, not a crash", "[cli][hardening][plugin]") {
  struct Case {
    std::string library, option;
  };
  const fs::path cfg = write_text("truncated_plugin.json", small_config().dump());
  for (const Case& c : {Case{"libbooster_plugin_ddp.so", "--plugin"},
                        Case{"libbooster_precision_static_fp16.so", "--mixed-precision"}}) {
    const fs::path whole = fs::path(BOOSTER_LIB_DIR) / c.library;
    if (!fs::exists(whole)) {
      skip_test(whole.string() + " is not built");
      return;
    }
    const std::string bytes = read_text(whole);
    for (const size_t size : {bytes.size() / 2, size_t(100)}) {
      INFO(c.option << " " << c.library << " cut to " << size << " bytes");
      const fs::path cut = scratch_dir() / ("cut_" + std::to_string(size) + "_" + c.library);
      std::ofstream(cut, std::ios::binary | std::ios::trunc) << bytes.substr(0, size);
      const RunResult r = run_booster("train --config " + cfg.string() + " " + c.option + " " + cut.string());
      INFO(r.err);
      CHECK(r.exit_code == 1);  // a PluginError, as for a plugin path that does not exist (not 128 + SIGBUS)
      CHECK_THAT(one_line(r.err), Catch::Contains(cut.string()) &&
                                      Catch::Contains("truncated: " + std::to_string(size) + " bytes, its headers reach ") &&
                                      Catch::Contains("rebuild or reinstall it"));
      CHECK(r.out.empty());
      fs::remove(cut);
    }
  }
}

namespace {

// Starts `booster <args>` in the background, waits until its stderr holds `marker` (a line start; ""
// waits `delay` seconds instead), sends SIGINT, and returns what it printed and its status.
RunResult interrupt_when(const std::string& args, const std::string& marker, double delay = 0.0) {
  const std::string wait =
      marker.empty() ? "sleep " + std::to_string(delay) + "; " : testing::wait_for_line(marker, 2400, 0.01);
  return testing::run_booster_interrupted(scratch_dir() / "interrupt", args, wait, "kill -INT $pid");
}

}  // namespace

// Note [Stopping on a signal]: a run is stopped cleanly wherever the signal finds it.
TEST_CASE("Ctrl-C while the run starts stops it before the first step, exit 130, with a summary", "[cli][hardening][signal]") {
  // Millions of synthetic points take seconds to make, before any step: the signal comes meanwhile.
  json config = small_config();
  config["data"]["num_samples"] = 8000000;
  const fs::path cfg = write_text("signal_start.json", config.dump());
  const RunResult r = interrupt_when("train --config " + cfg.string(), "", 1.0);
  INFO(r.err);
  CHECK(r.exit_code == 130);
  CHECK_THAT(r.err, Catch::Contains("stopped by SIGINT before step 1 of 12"));
  CHECK_THAT(r.err, !Catch::Contains("step      1/"));
  const json summary = json::parse(testing::last_line(r.out));
  CHECK(summary["interrupted"] == "SIGINT");
  CHECK(summary["steps"] == 0);
}

TEST_CASE("Ctrl-C during the final evaluation or save ends the run with exit 130 and a summary saying so",
          "[cli][hardening][signal]") {
  json config = small_config();
  SECTION("during the final evaluation") {
    // A test split large enough that its evaluation takes a while after the last step's line.
    config["model"]["hidden"] = {512, 512};
    config["data"]["num_test_samples"] = 400000;
    config["train"]["log_every"] = 1;
    const fs::path cfg = write_text("signal_eval.json", config.dump());
    const RunResult r = interrupt_when("train --config " + cfg.string(), "step     12/12");
    INFO(r.err);
    CHECK(r.exit_code == 130);
    // Nothing is left to train, so the line says the run is complete rather than how to resume it.
    CHECK_THAT(r.err,
               Catch::Contains("stopped by SIGINT after the last step, 12 of 12, as the run ended; it is complete"));
    CHECK_THAT(r.err, !Catch::Contains("resume"));
    const json summary = json::parse(testing::last_line(r.out));
    CHECK(summary["interrupted"] == "SIGINT");
    CHECK(summary["steps"] == 12);
    CHECK(summary["test_accuracy"].is_number());  // the evaluation finished first
  }
  SECTION("during the final checkpoint's save") {
    // A model large enough that saving it takes a while after the evaluation's line.
    config["model"]["hidden"] = {2500, 2500, 2500};
    config["train"]["max_steps"] = 2;
    const fs::path root = scratch_dir() / "signal_save";
    fs::remove_all(root);
    const fs::path cfg = write_text("signal_save.json", config.dump());
    const RunResult r = interrupt_when("train --config " + cfg.string() + " --set train.checkpoint_every=2 " +
                                           "--set train.checkpoint_dir=" + root.string(),
                                       "eval ");
    INFO(r.err);
    CHECK(r.exit_code == 130);
    CHECK_THAT(r.err, Catch::Contains("stopped by SIGINT"));
    const json summary = json::parse(testing::last_line(r.out));
    CHECK(summary["interrupted"] == "SIGINT");
    CHECK(summary["steps"] == 2);
    CHECK(fs::exists(step_dir(root, 2)));
  }
}

// Note [The depth limit] in booster/config/schema.cpp.
TEST_CASE("a model of millions of layers is refused at once, naming the depth limit", "[cli][hardening][config]") {
  json config = small_config();
  SECTION("5,000,000 hidden layers: stopped where the text is read") {
    std::string text = config.dump();
    std::string layers = "[1";
    layers.reserve(10'000'000);
    for (int i = 1; i < 5'000'000; ++i) layers += ",1";
    layers += "]";
    const std::string hidden = "\"hidden\":[16]";
    text.replace(text.find(hidden), hidden.size(), "\"hidden\":" + layers);
    const RunResult r = run_booster("train --config " + write_text("layers_5m.json", text).string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("'model.hidden[65536]'") && Catch::Contains("depth limit of 4096"));
    CHECK(r.err.size() < 1000);
  }
  SECTION("5,000 hidden layers: the schema's limit") {
    config["model"]["hidden"] = std::vector<int>(5000, 2);
    const RunResult r = run_booster("train --config " + write_text("layers_5k.json", config.dump()).string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("'model.hidden' has 5000 items, past the depth limit of 4096"));
  }
  SECTION("a GPT of 5,000,000 blocks") {
    config["model"] = {{"type", "gpt"}, {"vocab_size", 16}, {"context", 8}, {"width", 16}, {"layers", 5000000}, {"heads", 2}};
    const RunResult r = run_booster("check --config " + write_text("gpt_5m.json", config.dump()).string());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("'model.layers' is 5000000") && Catch::Contains("4096"));
  }
}

TEST_CASE("a resume whose metrics.jsonl is gone or short warns that its records are lost", "[cli][hardening]") {
  const fs::path run_dir = scratch_dir() / "lost_metrics_run", root = scratch_dir() / "lost_metrics_ckpt";
  const fs::path cfg = write_text("lost_metrics.json", small_config().dump());
  const std::string args = "train --config " + cfg.string() + " --set train.checkpoint_every=8 --set train.run_dir=" +
                           run_dir.string() + " --set train.checkpoint_dir=" + root.string();
  auto first_part = [&] {
    fs::remove_all(run_dir);
    fs::remove_all(root);
    REQUIRE(run_booster(args + " --set train.max_steps=8").exit_code == 0);
  };
  SECTION("missing") {
    first_part();
    fs::remove(run_dir / "metrics.jsonl");
    const RunResult r = run_booster(args + " --resume latest");
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.err, Catch::Contains("warning: " + (run_dir / "metrics.jsonl").string() + " is missing") &&
                          Catch::Contains("new records append from step 9"));
  }
  SECTION("shorter than the resumed step implies") {
    first_part();
    const std::string text = read_text(run_dir / "metrics.jsonl");
    write_text("lost_metrics_first_line", text.substr(0, text.find('\n') + 1));
    fs::copy_file(scratch_dir() / "lost_metrics_first_line", run_dir / "metrics.jsonl",
                  fs::copy_options::overwrite_existing);
    const RunResult r = run_booster(args + " --resume latest");
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.err, Catch::Contains("holds records up to step 4, short of step 8") &&
                          Catch::Contains("new records append from step 9"));
  }
  SECTION("whole: no warning") {
    first_part();
    const RunResult r = run_booster(args + " --resume latest");
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.err, !Catch::Contains("warning"));
  }
}

// Note [A data file that is not a file] in booster/data/dataset.h.
TEST_CASE("a directory given as a data file is a DataError naming it, exit 1", "[cli][hardening][data]") {
  const fs::path dir = scratch_dir() / "a_directory";
  fs::create_directories(dir);
  const std::string d = dir.string();
  const json mlp = {{"type", "mlp"}, {"in", 4}, {"hidden", {4}}, {"classes", 2}};
  const json gpt = {{"type", "gpt"}, {"vocab_size", 256}, {"context", 8}, {"width", 16}, {"layers", 1}, {"heads", 2}};
  const fs::path text = write_text("some_text.txt", std::string(200, 'a'));
  const std::vector<std::tuple<std::string, json, json>> cases = {
      {"npy x", mlp, {{"type", "npy"}, {"x", d}, {"y", d}}},
      {"npz", mlp, {{"type", "npy"}, {"path", d}}},
      {"safetensors", mlp, {{"type", "safetensors"}, {"path", d}}},
      {"csv", mlp, {{"type", "csv"}, {"path", d}}},
      {"text", gpt, {{"type", "text"}, {"path", d}, {"context", 8}}},
      {"tokenizer", gpt, {{"type", "text"}, {"path", text.string()}, {"tokenizer", d}, {"context", 8}}},
      {"tokens", gpt, {{"type", "tokens"}, {"path", d}, {"seq_len", 8}}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [name, model, data] = cases[i];
    INFO(name);
    json config = small_config();
    config["model"] = model;
    config["data"] = data;
    config["data"]["batch_size"] = 4;
    const RunResult r = run_booster("train --config " + write_text("dir_" + std::to_string(i) + ".json", config.dump()).string());
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains(d + " is a directory"));
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
  // Fashion-MNIST's IDX files.
  const fs::path idx = scratch_dir() / "idx_dir";
  fs::create_directories(idx / "train-images-idx3-ubyte.gz");
  json config = small_config();
  config["model"] = {{"type", "mlp"}, {"in", 784}, {"hidden", {4}}, {"classes", 10}};
  config["data"] = {{"type", "fashion_mnist"}, {"dir", idx.string()}, {"batch_size", 4}};
  const RunResult r = run_booster("train --config " + write_text("dir_idx.json", config.dump()).string());
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains((idx / "train-images-idx3-ubyte.gz").string() + " is a directory"));
}

// Note [Falling back from a damaged checkpoint] (core/booster/booster/state.cpp): --resume latest
// loads the newest step that passes its checksums. A damaged newer step is named in one warning (file
// and tensor) and left on disk byte for byte; when the resumed run saves that step again, the damaged
// one is kept beside as step-N.damaged. A root where no step passes is an error naming the damage.
TEST_CASE("resume from latest falls back past a damaged newest step and keeps it", "[cli][checkpoint][resume]") {
  const fs::path dir = testing::scratch_dir("test_cli_hardening") / "fallback";
  fs::remove_all(dir);
  const std::string common = "train --config " + std::string(BOOSTER_SOURCE_DIR) +
                             "/examples/configs/fashion_mnist_mlp.json --set train.max_steps=4 "
                             "--set train.checkpoint_every=2 --set train.eval_every=0 --set train.run_dir=" + dir.string();
  auto run = [&](const std::string& extra) {
    return testing::run_booster_in(dir.parent_path(), common + extra, "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1");
  };
  REQUIRE(run("").exit_code == 0);
  const fs::path root = dir / "checkpoints", newest = root / "step-00000004", file = newest / "model" / "model.safetensors";
  std::string bytes = read_text(file);
  bytes[bytes.size() - 100] ^= 0x40;  // inside the last tensor's data
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;

  const RunResult resumed = run(" --resume latest");
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.err, Catch::Contains("booster: warning: checkpoint file " + file.string()) &&
                              Catch::Contains("tensor 'layers.4.weight'") &&
                              Catch::Contains("resuming from " + (root / "step-00000002").string() + " instead"));
  CHECK_THAT(resumed.err, Catch::Contains("resumed from " + (root / "step-00000002").string() + " at step 2"));
  // The resumed run saved step 4 again: the damaged one is kept beside it, byte for byte.
  REQUIRE(fs::exists(root / "step-00000004.damaged"));
  CHECK(read_text(root / "step-00000004.damaged" / "model" / "model.safetensors") == bytes);
  const RunResult again = run(" --resume latest");
  CHECK(again.exit_code == 0);
  CHECK_THAT(again.err, !Catch::Contains("warning") && Catch::Contains("resumed from " + newest.string()));

  // No step passes: the error, naming the damage.
  for (const char* step : {"step-00000002", "step-00000004"}) {
    const fs::path f = root / step / "model" / "model.safetensors";
    std::string b = read_text(f);
    b[b.size() - 100] ^= 0x40;
    std::ofstream(f, std::ios::binary | std::ios::trunc) << b;
  }
  const RunResult none = run(" --resume latest");
  CHECK(none.exit_code != 0);
  CHECK_THAT(none.err, Catch::Contains("passes its checksums") && Catch::Contains("layers.4.weight"));
}

TEST_CASE("an epoch count near 2^63 with max_steps still trains max_steps steps", "[cli][hardening][config]") {
  // epochs x batches per epoch saturates: it once wrapped to a negative total, and the run ended at
  // once with exit 0, no step and a null final_loss.
  json config = small_config();
  config["train"]["epochs"] = std::numeric_limits<int64_t>::max();
  config["train"]["max_steps"] = 3;
  const RunResult r = run_booster("train --config " + write_text("endless_epochs.json", config.dump()).string());
  REQUIRE(r.exit_code == 0);
  const json summary = json::parse(r.out);  // the summary is stdout's one line
  CHECK(summary.at("steps") == 3);
  CHECK(summary.at("final_loss").is_number());
  CHECK_THAT(r.err, Catch::Contains("3 steps (8 per epoch)"));
}
