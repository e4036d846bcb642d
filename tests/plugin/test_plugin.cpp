// Plugins: the loader (search path, explicit paths, ABI check, non-plugins, errors crossing the
// boundary, lifetime and unloading) and the example precision plugin examples/static_fp16, built as
// build/lib/libbooster_precision_static_fp16.so. The test plugins under tests/plugins/ are built into
// build/test_plugins/, off the search path, and loaded by path.
#include <catch2/catch.hpp>

#include "skip.h"

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <elf.h>
#include <sys/wait.h>
#include <unistd.h>

#include "plugin_path_guard.h"
#include "run_booster.h"
#include "booster/autograd/autograd.h"
#include "booster/data/synthetic.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/plugin/abi.h"
#include "booster/plugin/loader.h"

using namespace booster;
using namespace booster::mixed_precision;
using Catch::Matchers::Contains;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kExample = std::string(BOOSTER_LIB_DIR) + "/libbooster_precision_static_fp16.so";
std::string test_plugin(const std::string& dir) {
  return std::string(BOOSTER_TEST_PLUGIN_DIR) + "/libbooster_precision_" + dir + ".so";
}

using testing::PluginPathGuard;

// Whether a file is mapped into this process (a loaded shared library is).
bool is_mapped(const std::string& file) {
  std::ifstream maps("/proc/self/maps");
  const std::string canonical = fs::canonical(file).string();
  std::string line;
  while (std::getline(maps, line))
    if (line.find(canonical) != std::string::npos) return true;
  return false;
}

Criterion cross_entropy_criterion() {
  return [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
}

struct Setup {
  std::unique_ptr<MixedPrecision> mp;
  Configured c;
};

Setup make_setup(const std::string& strategy, const json& options, uint64_t seed, int64_t features, int64_t classes) {
  auto model = std::make_shared<nn::MLPClassifier>(features, std::vector<int64_t>{32}, classes, "relu", seed);
  std::shared_ptr<optim::Optimizer> opt =
      optim::make_optimizer({{"type", "adam"}, {"lr", 3e-3}}, model->parameters());
  Setup s;
  s.mp = create(strategy, options);
  s.c = s.mp->configure(model, opt, cross_entropy_criterion());
  return s;
}

void train_step(Setup& s, const Tensor& x, const Tensor& y) {
  s.c.optimizer->zero_grad();
  Tensor loss = s.c.criterion((*s.c.model)(x), y);
  s.mp->backward(loss, *s.c.optimizer);
  s.mp->step(*s.c.optimizer);
}

double accuracy(Setup& s, const Tensor& x, const Tensor& y) {
  NoGradGuard no_grad;
  s.c.model->eval();
  const auto p = argmax((*s.c.model)(x), 1).to_vector<int64_t>(), t = y.to_vector<int64_t>();
  s.c.model->train();
  int64_t right = 0;
  for (size_t i = 0; i < p.size(); ++i) right += p[i] == t[i];
  return double(right) / double(p.size());
}

}  // namespace

TEST_CASE("plugin: the example plugin is found by name in build/lib with BOOSTER_PLUGIN_PATH unset", "[plugin]") {
  PluginPathGuard unset(nullptr);
  REQUIRE(fs::equivalent(plugin::find(plugin::kPrecisionKind, "static_fp16"), kExample));
  auto lib = plugin::load(plugin::kPrecisionKind, "static_fp16");
  CHECK(lib->name() == "static_fp16");
  CHECK(lib->kind() == "precision");
  CHECK(lib->abi_version() == BOOSTER_PLUGIN_ABI_VERSION);

  bool listed = false;
  for (const StrategyInfo& s : available_strategies())
    if (s.name == "static_fp16") listed = fs::equivalent(s.file, kExample);
  CHECK(listed);
  // Built-ins are listed too, without a file.
  bool fp16_builtin = false;
  for (const StrategyInfo& s : available_strategies()) fp16_builtin |= s.name == "fp16" && s.file.empty();
  CHECK(fp16_builtin);

  auto mp = create("static_fp16", {{"loss_scale", 512}});
  CHECK(mp->name() == "static_fp16");
  CHECK(mp->options() == json{{"loss_scale", 512.0}});
  CHECK(mp->loss_scale() == 512.0);
  CHECK(create("static_fp16")->loss_scale() == 1024.0);  // the default
}

TEST_CASE("plugin: loaded by explicit path, and BOOSTER_PLUGIN_PATH comes before build/lib", "[plugin]") {
  auto mp = create(kExample, {{"loss_scale", 256}});
  CHECK(mp->name() == "static_fp16");
  CHECK(mp->loss_scale() == 256.0);
  auto lib = plugin::load(plugin::kPrecisionKind, test_plugin("throwing"));
  CHECK(lib->name() == "throwing");

  PluginPathGuard path((std::string("/nonexistent/dir:") + BOOSTER_TEST_PLUGIN_DIR).c_str());
  const auto dirs = plugin::search_path();
  REQUIRE(dirs.size() == 4);
  CHECK(dirs[0] == "/nonexistent/dir");
  // Then the loaded libbooster_core's own directory's booster/ (an install prefix) and the directory
  // itself (the build tree), found at run time: nothing absolute is compiled in.
  CHECK(dirs[2] == fs::path(BOOSTER_LIB_DIR) / "booster");
  CHECK(fs::equivalent(dirs[3], BOOSTER_LIB_DIR));
  CHECK(fs::equivalent(plugin::find(plugin::kPrecisionKind, "bad_abi"), test_plugin("bad_abi")));
}

TEST_CASE("plugin: static_fp16 trains an MLP to within 1 point of float32 accuracy", "[plugin]") {
  auto data = data::synthetic_classification(4096, 4, 8, 11);
  const Tensor& x = data->x();
  const Tensor& y = data->y();
  const int64_t batch = 64, epochs = 3;
  double acc[2];
  int64_t skipped = 0;
  const std::pair<std::string, json> cases[2] = {{"fp32", json::object()}, {"static_fp16", {{"loss_scale", 1024}}}};
  for (int i = 0; i < 2; ++i) {
    Setup s = make_setup(cases[i].first, cases[i].second, 21, 4, 8);
    for (int64_t e = 0; e < epochs; ++e)
      for (int64_t b = 0; b + batch <= x.size(0); b += batch) {
        train_step(s, x.narrow(0, b, batch), y.narrow(0, b, batch));
        skipped += s.mp->step_was_skipped();
        CHECK(s.mp->last_step_stats().loss_scale == (i == 0 ? 1.0 : 1024.0));
      }
    acc[i] = accuracy(s, x, y);
  }
  INFO("float32 accuracy " << acc[0] << ", static_fp16 accuracy " << acc[1]);
  REQUIRE(acc[0] > 0.8);  // learnable but not saturated, or the comparison says nothing
  REQUIRE(acc[0] < 0.99);
  CHECK(std::abs(acc[1] - acc[0]) <= 0.01);
  CHECK(skipped == 0);
}

TEST_CASE("plugin: static_fp16 skips a step with an inf gradient and keeps its scale", "[plugin]") {
  auto data = data::synthetic_classification(64, 16, 4, 2);
  Setup s = make_setup("static_fp16", {{"loss_scale", 1024}}, 3, 16, 4);
  const Tensor first = s.c.model->parameters().front();
  const std::vector<float> before = first.contiguous().to_vector<float>();

  s.c.optimizer->zero_grad();
  Tensor loss = s.c.criterion((*s.c.model)(data->x()), data->y());
  s.mp->backward(loss, *s.c.optimizer);
  first.grad().data<float>()[0] = std::numeric_limits<float>::infinity();
  s.mp->step(*s.c.optimizer);
  CHECK(s.mp->step_was_skipped());
  CHECK(first.contiguous().to_vector<float>() == before);  // untouched
  CHECK(s.mp->loss_scale() == 1024.0);                       // static: no backoff

  train_step(s, data->x(), data->y());
  CHECK_FALSE(s.mp->step_was_skipped());
  CHECK(first.contiguous().to_vector<float>() != before);

  const MixedPrecisionState state = s.mp->state_dict();
  CHECK(state.meta == json{{"scaler", {{"loss_scale", 1024.0}, {"skipped_steps", 1}}}});  // ConstantLossScaler's
  auto other = create("static_fp16", {{"loss_scale", 8}});
  other->load_state_dict(state);
  CHECK(other->loss_scale() == 1024.0);
  CHECK_THROWS_AS(other->load_state_dict(MixedPrecisionState{}), CheckpointError);  // crosses as itself
}

TEST_CASE("plugin: a wrong ABI version is refused before the factory runs, naming both versions and the file",
          "[plugin]") {
  const std::string file = test_plugin("bad_abi");
  const std::string expected_versions = "ABI version " + std::to_string(BOOSTER_PLUGIN_ABI_VERSION + 1000);
  REQUIRE_THROWS_AS(plugin::load(plugin::kPrecisionKind, file), PluginError);
  CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, file),
                    Contains(file) && Contains(expected_versions) &&
                        Contains("ABI version " + std::to_string(BOOSTER_PLUGIN_ABI_VERSION) + ";"));
  // The factory aborts the process: reaching here through create() proves it was never called.
  CHECK_THROWS_AS(create(file), PluginError);
}

TEST_CASE("plugin: a missing plugin lists the directories searched", "[plugin]") {
  PluginPathGuard path("/first/place:/second/place");
  REQUIRE_THROWS_AS(plugin::load(plugin::kPrecisionKind, "no_such_strategy"), PluginError);
  CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, "no_such_strategy"),
                    Contains("libbooster_precision_no_such_strategy.so") && Contains("/first/place") &&
                        Contains("/second/place") && Contains(BOOSTER_LIB_DIR) && Contains("BOOSTER_PLUGIN_PATH"));
  // Through the registry: ConfigError listing the built-ins and the same directories.
  REQUIRE_THROWS_AS(create("no_such_strategy"), ConfigError);
  CHECK_THROWS_WITH(create("no_such_strategy"), Contains("fp16") && Contains("bf16") && Contains("/first/place") &&
                                                     Contains(BOOSTER_LIB_DIR));
  // A path to nothing.
  CHECK_THROWS_WITH(create("/no/such/libfoo.so"), Contains("/no/such/libfoo.so") && Contains("does not exist"));
  CHECK_THROWS_AS(plugin::load("sharding", "x"), ValueError);
}

TEST_CASE("plugin: a shared library that is not a plugin, and a file that is no library, say so", "[plugin]") {
  const std::string file = test_plugin("not_a_plugin");
  REQUIRE_THROWS_AS(create(file), PluginError);
  CHECK_THROWS_WITH(create(file), Contains(file) && Contains("is not a booster plugin") &&
                                      Contains("booster_plugin_abi_version"));

  const fs::path text = fs::temp_directory_path() / "booster_test_plugin_not_elf.so";
  std::ofstream(text) << "not a shared library\n";
  CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, text.string()),
                    Contains("cannot load") && Contains(text.string()));
  fs::remove(text);
  // A plugin of another kind: the example is a precision plugin.
  CHECK_THROWS_WITH(plugin::load(plugin::kParallelKind, kExample), Contains("is a precision plugin"));
}

TEST_CASE("plugin: exceptions from a plugin's factory arrive as host error types", "[plugin]") {
  const std::string file = test_plugin("throwing");
  CHECK_THROWS_AS(create(file, {{"bad_option", 1}}), ConfigError);
  CHECK_THROWS_WITH(create(file, {{"bad_option", 1}}), Contains("unknown option 'bad_option'"));
  // Not a booster error: a PluginError naming the plugin and carrying the message.
  REQUIRE_THROWS_AS(create(file), PluginError);
  CHECK_THROWS_WITH(create(file), Contains("'throwing'") && Contains("the throwing plugin always throws"));
  // The example's option checks cross as ConfigError too.
  CHECK_THROWS_AS(create("static_fp16", {{"loss_scal", 1}}), ConfigError);
  CHECK_THROWS_AS(create("static_fp16", {{"loss_scale", 1e6}}), ConfigError);
}

TEST_CASE("plugin: shutdown: the library stays loaded while anything it made lives, and unloads after", "[plugin]") {
  PluginPathGuard unset(nullptr);
  auto data = data::synthetic_classification(64, 16, 4, 5);
  Configured c;
  {
    Setup s = make_setup("static_fp16", json::object(), 7, 16, 4);
    REQUIRE(is_mapped(kExample));
    c = s.c;
    train_step(s, data->x(), data->y());
  }  // the strategy (and the loader's handle) die here, before the model and criterion it made
  REQUIRE(is_mapped(kExample));
  {
    NoGradGuard no_grad;
    Tensor out = (*c.model)(data->x());  // runs the plugin's autocast wrapper
    CHECK(c.criterion(out, data->y()).item() > 0.0);
  }
  c = Configured{};
  // The last reference gone, the library is closed (a library that glibc marks unloadable-never,
  // e.g. one with STB_GNU_UNIQUE symbols, would stay; the example must not be one).
  CHECK_FALSE(is_mapped(kExample));
  // And it loads again.
  CHECK(create("static_fp16")->name() == "static_fp16");
}

// The cycle the leak check runs under valgrind: load, create, configure, train, destroy, twice.
TEST_CASE("plugin: load/create/destroy cycle (run under valgrind by the [valgrind] test)", "[.plugin_cycle]") {
  auto data = data::synthetic_classification(32, 8, 2, 1);
  for (int round = 0; round < 2; ++round) {
    Setup s = make_setup("static_fp16", {{"loss_scale", 64}}, 1, 8, 2);
    train_step(s, data->x(), data->y());
    CHECK_THROWS_AS(create(test_plugin("throwing")), PluginError);
    CHECK_THROWS_AS(create(test_plugin("bad_abi")), PluginError);
  }
}

TEST_CASE("plugin: loading and unloading leaks nothing (valgrind)", "[plugin][valgrind]") {
  if (std::system("valgrind --version >/dev/null 2>&1") != 0) {
    skip_test("valgrind is not installed (apt-get install valgrind)");
    return;
  }
  const fs::path self = fs::read_symlink("/proc/self/exe");
  const fs::path log = fs::temp_directory_path() / ("booster_plugin_valgrind_" + std::to_string(getpid()) + ".log");
  // Only definite leaks count: OpenMP's and OpenBLAS's thread pools and glibc's dlopen bookkeeping keep
  // memory reachable at exit by design ("still reachable" / "possibly lost" for threads' stacks).
  const std::string command = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 valgrind --leak-check=full --suppressions=" BOOSTER_SOURCE_DIR "/tests/valgrind.supp "
                              "--errors-for-leak-kinds=definite --error-exitcode=3 --log-file=" +
                              log.string() + " " + self.string() + " '[.plugin_cycle]' >" + log.string() + ".out 2>&1";
  const int status = std::system(command.c_str());
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  fs::remove(log);
  std::ifstream out_file(log.string() + ".out");
  std::stringstream out;
  out << out_file.rdbuf();
  fs::remove(log.string() + ".out");
  INFO(out.str() << text.str());
  // The hidden cycle really ran (a filter that matched nothing would also exit cleanly).
  CHECK(out.str().find("All tests passed") != std::string::npos);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const bool no_definite_leak = text.str().find("definitely lost: 0 bytes") != std::string::npos ||
                                text.str().find("definitely lost") == std::string::npos;
  CHECK(no_definite_leak);
  CHECK(text.str().find("ERROR SUMMARY: 0 errors") != std::string::npos);
}

// issue 38, item 5 (Note [Checking a library before dlopen] in booster/plugin/loader.cpp): a library file
// that dlopen would map past its end (SIGBUS) or cannot run here is refused first, naming the file.
TEST_CASE("plugin: a cut or foreign library file is refused before dlopen, naming what is wrong", "[plugin]") {
  std::ifstream in(kExample, std::ios::binary);
  const std::string whole((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(whole.size() > 4096);
  const fs::path file = fs::temp_directory_path() / ("booster_test_plugin_cut_" + std::to_string(::getpid()) + ".so");
  auto write = [&](const std::string& bytes) { std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes; };
  // Cut anywhere: in the ELF header, the program headers, the segments or the section headers at the end.
  for (const size_t size : {size_t(0), size_t(1), size_t(4), size_t(63), size_t(64), size_t(100), size_t(1000),
                            whole.size() / 3, whole.size() / 2, whole.size() - 64, whole.size() - 1}) {
    INFO("cut to " << size << " bytes");
    write(whole.substr(0, size));
    REQUIRE_THROWS_AS(plugin::load(plugin::kPrecisionKind, file.string()), PluginError);
    CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, file.string()),
                      Contains(file.string()) && Contains("truncated: " + std::to_string(size) + " bytes") &&
                          Contains("rebuild or reinstall it"));
  }
  // The whole file still loads (a copy of its own: a loaded file is not written to).
  const fs::path copy = file.string() + ".whole.so";
  std::ofstream(copy, std::ios::binary | std::ios::trunc) << whole;
  CHECK(plugin::load(plugin::kPrecisionKind, copy.string())->name() == "static_fp16");

  auto patched = [&](size_t offset, const std::string& bytes) {
    std::string copy = whole;
    copy.replace(offset, bytes.size(), bytes);
    write(copy);
  };
  patched(0, "\x7f" "ELG");
  CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, file.string()), Contains(file.string()) && Contains("not an ELF file"));
  patched(EI_CLASS, std::string(1, char(ELFCLASS32)));
  CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, file.string()), Contains("32-bit"));
  patched(EI_DATA, std::string(1, char(ELFDATA2MSB)));
  CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, file.string()), Contains("big-endian"));
#if defined(__x86_64__)
  const uint16_t other_machine = EM_AARCH64;
#else
  const uint16_t other_machine = EM_X86_64;
#endif
  patched(offsetof(Elf64_Ehdr, e_machine), std::string(reinterpret_cast<const char*>(&other_machine), 2));
  CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, file.string()), Contains("built for") && Contains("not for"));
  const uint16_t executable = ET_EXEC;
  patched(offsetof(Elf64_Ehdr, e_type), std::string(reinterpret_cast<const char*>(&executable), 2));
  CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, file.string()), Contains("not a shared library"));
  // A section header table claimed past the end, and one whose end overflows 64 bits.
  for (const uint64_t shoff : {uint64_t(whole.size()), ~uint64_t(0) - 8}) {
    patched(offsetof(Elf64_Ehdr, e_shoff), std::string(reinterpret_cast<const char*>(&shoff), 8));
    CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, file.string()),
                      Contains("truncated: " + std::to_string(whole.size()) + " bytes, its headers reach"));
  }
  fs::remove(file);
  fs::remove(copy);
}

TEST_CASE("plugin: a library that calls exit(0) while loading ends booster with an error, not success", "[plugin]") {
  // Note [A library that exits while loading] in booster/plugin/loader.cpp.
  const std::string library = test_plugin("exits_on_load");
  const fs::path dir = testing::scratch_dir("test_plugin");
  const fs::path config = dir / "exits_on_load.json";
  std::ofstream(config) << R"({"model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "sgd", "lr": 0.1},
    "data": {"type": "synthetic", "num_samples": 64, "num_test_samples": 16, "num_features": 8, "num_classes": 3,
             "batch_size": 16},
    "train": {"epochs": 1, "max_steps": 2, "run_dir": null}})";
  for (const std::string option : {"--mixed-precision", "--plugin"}) {
    INFO(option);
    const testing::RunResult r =
        testing::run_booster_in(dir, "train --config " + config.string() + " " + option + " " + library);
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("exits_on_load: exiting from a static constructor") &&
                          Contains("booster: error: plugin: " + library + " called exit(0) while it was being loaded"));
    CHECK(r.out.empty());  // no summary line: nothing was trained
  }
  fs::remove_all(dir);
}
