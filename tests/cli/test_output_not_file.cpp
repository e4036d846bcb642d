// Outputs that exist and are not regular files (Note [Outputs that are not files] in
// checkpoint/atomic_file.h): a FIFO, a symbolic link to /dev/null, a directory where a file goes. Every
// write refuses them before writing, and they remain as they were: `booster tokenize --out` and the
// atomic writer under every checkpoint, export and run-directory file.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "booster/checkpoint/atomic_file.h"
#include "booster/common/error.h"
#include "run_booster.h"
#include "skip.h"

namespace fs = std::filesystem;
using booster::ConfigError;
using Catch::Contains;

namespace {

fs::path scratch() { return testing::scratch_dir("test_output_not_file"); }

bool is_named_pipe(const fs::path& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0 && S_ISFIFO(st.st_mode);
}

bool dev_null_intact() {
  struct stat st {};
  return ::lstat("/dev/null", &st) == 0 && S_ISCHR(st.st_mode);
}

// A FIFO, a symbolic link to /dev/null and a directory in `dir`.
void make_targets(const fs::path& dir) {
  fs::create_directories(dir);
  for (const char* name : {"fifo", "null", "dir"}) fs::remove_all(dir / name);
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0644) == 0);
  fs::create_symlink("/dev/null", dir / "null");
  fs::create_directories(dir / "dir");
}

}  // namespace

TEST_CASE("tokenize --out at a FIFO, a link to /dev/null or a directory is refused and it remains",
          "[cli][tokens][outputs]") {
  const fs::path dir = scratch() / "tokenize";
  make_targets(dir);
  std::ofstream(dir / "text.txt") << "some text\n";
  for (const char* name : {"fifo", "null", "dir"}) {
    const fs::path out = dir / name;
    INFO(out);
    // `timeout`: before the fix, a FIFO output blocked until a reader came.
    const testing::RunResult r = testing::run_booster_in(
        dir, "tokenize --model /nonexistent.model --in " + (dir / "text.txt").string() + " --out " + out.string(),
        "timeout 60");
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Contains("--out " + out.string() + " is "));
    CHECK_THAT(r.err, Contains("not a regular file"));
  }
  CHECK(is_named_pipe(dir / "fifo"));
  CHECK(fs::is_symlink(fs::symlink_status(dir / "null")));
  CHECK(fs::read_symlink(dir / "null") == "/dev/null");
  CHECK(dev_null_intact());
  CHECK(fs::is_directory(dir / "dir"));
  CHECK(fs::is_empty(dir / "dir"));
  // The description file beside the output (OUT.json) and the temporary file are checked as well.
  std::ofstream(dir / "t.txt") << "x\n";
  fs::remove(dir / "out.bin.tmp");
  REQUIRE(::mkfifo((dir / "out.bin.tmp").c_str(), 0644) == 0);
  const testing::RunResult tmp = testing::run_booster_in(
      dir, "tokenize --model /nonexistent.model --in " + (dir / "t.txt").string() + " --out " + (dir / "out.bin").string(),
      "timeout 60");
  CHECK(tmp.exit_code == 2);
  CHECK_THAT(tmp.err, Contains("temporary file"));
  CHECK(is_named_pipe(dir / "out.bin.tmp"));
}

TEST_CASE("tokenize with a real tokenizer leaves a FIFO output as it was", "[cli][tokens][outputs]") {
  // Past every other check: a 300-piece model of the GPL (Debian's spm_train), as test_cli_tokens makes.
  const fs::path corpus = "/usr/share/common-licenses/GPL-3";
  if (std::system("command -v spm_train >/dev/null 2>&1") != 0 || !fs::exists(corpus)) {
    skip_test("spm_train (Debian's sentencepiece) or " + corpus.string() + " is missing");
    return;
  }
  const fs::path dir = scratch() / "real";
  make_targets(dir);
  const std::string train = "spm_train --input=" + corpus.string() + " --model_prefix=" + (dir / "gpl").string() +
                            " --vocab_size=300 --model_type=bpe >/dev/null 2>&1";
  REQUIRE(std::system(train.c_str()) == 0);
  const testing::RunResult r = testing::run_booster_in(
      dir, "tokenize --model " + (dir / "gpl.model").string() + " --in " + corpus.string() + " --out " +
               (dir / "fifo").string(), "timeout 60");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("is a FIFO (named pipe), not a regular file"));
  CHECK(is_named_pipe(dir / "fifo"));
  // The same command with a file writes it.
  const testing::RunResult ok = testing::run_booster_in(
      dir, "tokenize --model " + (dir / "gpl.model").string() + " --in " + corpus.string() + " --out " +
               (dir / "ok.bin").string(), "timeout 60");
  CHECK(ok.exit_code == 0);
  CHECK(fs::file_size(dir / "ok.bin") > 0);
}

TEST_CASE("the atomic writer refuses a FIFO and a directory, replaces links, and FileWriter refuses a device link",
          "[checkpoint][outputs]") {
  const fs::path dir = scratch() / "atomic";
  make_targets(dir);
  using booster::checkpoint::FileWriter;
  using booster::checkpoint::write_text_file_atomically;
  CHECK_THROWS_WITH(write_text_file_atomically(dir / "fifo", "x"), Contains("is a FIFO (named pipe), not a regular file"));
  CHECK_THROWS_AS(write_text_file_atomically(dir / "dir", "x"), ConfigError);
  CHECK_THROWS_AS(FileWriter(dir / "fifo"), ConfigError);  // refused, not blocked on open
  CHECK_THROWS_WITH(FileWriter(dir / "null"), Contains("is a symbolic link to a character device"));
  CHECK(is_named_pipe(dir / "fifo"));
  CHECK(dev_null_intact());
  CHECK(fs::read_symlink(dir / "null") == "/dev/null");
  CHECK(fs::is_directory(dir / "dir"));
  // The atomic writer's rename replaces a link itself, never its target: the link to /dev/null becomes a
  // file and /dev/null stays a device.
  write_text_file_atomically(dir / "null", "x");
  CHECK(!fs::is_symlink(fs::symlink_status(dir / "null")));
  CHECK(testing::read_text(dir / "null") == "x");
  CHECK(dev_null_intact());
  // What is allowed: a new file, a file written over, a link to a regular file (replaced by the file).
  write_text_file_atomically(dir / "new.txt", "a");
  write_text_file_atomically(dir / "new.txt", "b");
  CHECK(testing::read_text(dir / "new.txt") == "b");
  fs::remove(dir / "link.txt");
  fs::create_symlink(dir / "new.txt", dir / "link.txt");
  write_text_file_atomically(dir / "link.txt", "c");
  CHECK(testing::read_text(dir / "link.txt") == "c");
}
