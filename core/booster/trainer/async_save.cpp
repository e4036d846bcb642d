// AsyncSave (async_save.h): Note [Asynchronous checkpoints].
#include "booster/trainer/async_save.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "booster/checkpoint/checkpoint.h"
#include "booster/common/error.h"

namespace booster::trainer {

namespace fs = std::filesystem;

namespace {
// `step-N.tmp/`, where begin_checkpoint put the step's files (Note [Checkpoint directory layout]).
fs::path tmp_dir_of(const fs::path& root, int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, "step-%08lld.tmp", static_cast<long long>(step));
  return root / name;
}
}  // namespace

AsyncSave::~AsyncSave() {
  if (thread_.joinable()) thread_.join();
}

void AsyncSave::start(fs::path root, int64_t step, int keep_last, std::vector<checkpoint::WriteCapture::File> files) {
  BOOSTER_CHECK(!thread_.joinable(), StateError, "AsyncSave::start: the save of step ", outcome_.step,
                " is still in flight; wait for it first");
  finished_ = false;
  outcome_ = Outcome{};
  outcome_.step = step;
  thread_ = std::thread([this, root = std::move(root), step, keep_last, files = std::move(files)] {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      // Test hook (async_save.h): a pause after the first file, to kill the process mid-write.
      const char* hook = std::getenv("BOOSTER_TEST_ASYNC_SAVE_SLEEP_MS");
      const long sleep_ms = hook ? std::strtol(hook, nullptr, 10) : 0;
      for (size_t i = 0; i < files.size(); ++i) {
        checkpoint::write_captured({files[i]});
        if (i == 0 && sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
      }
      checkpoint::sync_directory(tmp_dir_of(root, step));
      outcome_.dir = checkpoint::commit_checkpoint(root, step, keep_last);
    } catch (const std::exception& e) {
      outcome_.error = e.what();
    } catch (...) {
      outcome_.error = "an unknown error";
    }
    outcome_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    finished_ = true;
  });
}

std::optional<AsyncSave::Outcome> AsyncSave::wait() {
  if (!thread_.joinable()) return std::nullopt;
  thread_.join();
  return outcome_;
}

std::optional<AsyncSave::Outcome> AsyncSave::poll() {
  if (!thread_.joinable() || !finished_) return std::nullopt;
  return wait();
}

}  // namespace booster::trainer
