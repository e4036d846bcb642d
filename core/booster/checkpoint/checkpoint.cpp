#include "booster/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <regex>
#include <set>
#include <system_error>

#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checksums.h"
#include "booster/common/error.h"
#include "booster/common/json_text.h"

namespace booster::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::regex kStepDirName(R"(step-(\d{8}))");
const std::regex kTmpDirName(R"(step-\d{8}\.tmp)");
const std::regex kReplacedDirName(R"(step-(\d{8})\.replaced)");
constexpr const char* kFormatName = "booster-checkpoint";

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  BOOSTER_CHECK(!ec, CheckpointError, "cannot remove ", p.string(), ": ", ec.message());
}

// Removal after the commit (Note [Cleanup after the commit]): a failure is a warning, never an error.
void remove_after_commit(const fs::path& p) {
  std::error_code ec;
  if (const char* hook = std::getenv("BOOSTER_TEST_CLEANUP_FAILS"); hook && std::strcmp(hook, "1") == 0)
    ec = std::make_error_code(std::errc::directory_not_empty);
  else
    fs::remove_all(p, ec);
  if (!ec) return;
  std::fprintf(stderr, "booster: warning: cannot remove %s (%s); the checkpoint is saved, the next save retries\n",
               p.c_str(), ec.message().c_str());
  std::fflush(stderr);
}

void rename_or_throw(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  BOOSTER_CHECK(!ec, CheckpointError, "cannot rename ", from.string(), " to ", to.string(), ": ", ec.message());
}

// The test hook of Note [Replacing a checkpoint]: dies at `point` when BOOSTER_TEST_CRASH_AT names it.
void crash_here_if_testing(const char* point) {
  const char* hook = std::getenv("BOOSTER_TEST_CRASH_AT");
  if (hook && std::strcmp(hook, point) == 0) std::abort();
}

// Swaps the names of two directories in one atomic step; false (and nothing changed) where the file
// system or the kernel cannot (Note [Replacing a checkpoint]).
bool exchange_directories(const fs::path& a, const fs::path& b) {
  if (const char* hook = std::getenv("BOOSTER_TEST_NO_RENAME_EXCHANGE"); hook && std::strcmp(hook, "1") == 0)
    return false;
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  BOOSTER_CHECK(errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP, CheckpointError, "cannot exchange ",
                a.string(), " and ", b.string(), ": ", std::strerror(errno));
#endif
  return false;
}

// A json value of trainer_state.json that must be there.
const json& field(const json& state, const fs::path& file, const char* key) {
  BOOSTER_CHECK(state.contains(key), CheckpointError, "corrupt checkpoint ", file.string(), ": no \"", key,
                "\" field");
  return state[key];
}

}  // namespace

std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory(ec)) continue;
    if (std::regex_match(name, m, kStepDirName)) {
      out.emplace_back(std::stoll(m[1].str()), entry.path());
    } else if (std::regex_match(name, m, kReplacedDirName) && !fs::exists(root / step_dir_name(std::stoll(m[1].str())))) {
      // Caught between the renames of a replace: still the committed checkpoint of its step.
      out.emplace_back(std::stoll(m[1].str()), entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// The committed steps of a root, for a message that must point somewhere.
std::string existing_steps(const fs::path& root) {
  const auto committed = list_checkpoints(root);
  if (committed.empty()) return "the directory holds no committed checkpoint";
  std::string names;
  for (const auto& [step, dir] : committed) names += (names.empty() ? "" : ", ") + dir.filename().string();
  return "the committed checkpoints there are " + names + "; resume one of them by its path, or remove " +
         (root / kLatestFileName).string() + " to resume the newest";
}

}  // namespace

bool holds_no_checkpoint(const fs::path& root) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(root, ec))) return true;
  if (!fs::is_directory(root, ec)) return false;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == kLockFileName) continue;
    if (std::regex_match(name, kTmpDirName) && entry.is_directory(ec)) continue;  // an interrupted first save
    return false;
  }
  return !ec;
}

fs::path checkpoints_of_run(const fs::path& path) {
  std::error_code ec;
  const fs::path checkpoints = path / "checkpoints";
  if (!fs::is_directory(path, ec) || !fs::is_directory(checkpoints, ec)) return path;
  // A checkpoint (or a root) of its own wins: only a directory that is none stands for its checkpoints/.
  if (fs::exists(path / kTrainerStateFileName, ec) || fs::exists(fs::symlink_status(path / kLatestFileName, ec)) ||
      !list_checkpoints(path).empty())
    return path;
  return checkpoints;
}

fs::path begin_checkpoint(const fs::path& root, int64_t step) {
  BOOSTER_CHECK(step >= 0 && step <= 99'999'999, ValueError, "save_checkpoint: step ", step,
                " is outside [0, 99999999]");
  std::error_code ec;
  fs::create_directories(root, ec);
  BOOSTER_CHECK(fs::is_directory(root), CheckpointError, "save_checkpoint: cannot create directory ", root.string(),
                ec ? ": " + ec.message() : std::string());

  // Leftovers of interrupted saves. A `.replaced` directory without its `step-N/` is a committed
  // checkpoint caught between the renames of a replace: it gets its name back, since `latest` may name
  // it. Every other leftover is never a checkpoint (only step-XXXXXXXX is): clear it away, as far as
  // the file system lets (Note [Cleanup after the commit]); only the `.tmp` this save writes into must go.
  const fs::path tmp_dir = root / (step_dir_name(step) + ".tmp");
  std::vector<fs::path> entries;
  for (const auto& entry : fs::directory_iterator(root, ec)) entries.push_back(entry.path());
  for (const fs::path& entry : entries) {
    const std::string name = entry.filename().string();
    std::smatch m;
    if (std::regex_match(name, m, kReplacedDirName)) {
      const fs::path committed = root / step_dir_name(std::stoll(m[1].str()));
      if (fs::exists(committed)) {
        remove_after_commit(entry);
      } else {
        rename_or_throw(entry, committed);
        sync_directory(root);
      }
    }
  }
  for (const fs::path& entry : entries)
    if (std::regex_match(entry.filename().string(), kTmpDirName)) {
      if (entry == tmp_dir) remove_tree(entry);
      else remove_after_commit(entry);
    }

  fs::create_directory(tmp_dir, ec);
  BOOSTER_CHECK(!ec, CheckpointError, "save_checkpoint: cannot create ", tmp_dir.string(), ": ", ec.message());
  return tmp_dir;
}

fs::path commit_checkpoint(const fs::path& root, int64_t step, int keep_last) {
  BOOSTER_CHECK(keep_last >= 0, ValueError, "save_checkpoint: keep_last must be >= 0 (0 keeps all), got ", keep_last);
  const std::string name = step_dir_name(step);
  const fs::path final_dir = root / name;
  const fs::path tmp_dir = root / (name + ".tmp");
  // Note [Checkpoint checksums]: written last, so they cover every file of the checkpoint.
  write_checksums(tmp_dir);
  sync_directory(tmp_dir);
  crash_here_if_testing("before_commit");

  // The commit (Note [Replacing a checkpoint] when the step exists): `step-N/` always names a whole
  // checkpoint, the old one or the new one, except between the two renames of the portable replace,
  // where `step-N.replaced/` stands in for it. `latest` follows the commit at once, before any cleanup
  // (Note [Cleanup after the commit]).
  fs::path replaced_copy;  // the old checkpoint of this step, once the new one stands in its place
  // Note [Falling back from a damaged checkpoint]: a step that fails its checksums (a resume passed it
  // over) is kept beside, never replaced.
  if (fs::exists(final_dir)) {
    std::string damage;
    try {
      verify_step(final_dir);
    } catch (const CheckpointError& e) {
      damage = e.what();
    }
    if (!damage.empty()) {
      fs::path kept = root / (name + kDamagedSuffix);
      for (int k = 2; fs::exists(kept); ++k) kept = root / (name + kDamagedSuffix + "-" + std::to_string(k));
      rename_or_throw(final_dir, kept);
      sync_directory(root);
      std::fprintf(stderr, "booster: warning: %s fails its checksums (%s); it is kept as %s and the new "
                   "checkpoint of step %lld takes its name\n", final_dir.c_str(), damage.c_str(), kept.c_str(),
                   static_cast<long long>(step));
      std::fflush(stderr);
    }
  }
  if (!fs::exists(final_dir)) {
    rename_or_throw(tmp_dir, final_dir);
    sync_directory(root);
  } else if (exchange_directories(tmp_dir, final_dir)) {
    sync_directory(root);
    replaced_copy = tmp_dir;
  } else {
    const fs::path replaced = root / (name + kReplacedSuffix);
    rename_or_throw(final_dir, replaced);
    sync_directory(root);
    crash_here_if_testing("between_renames");
    rename_or_throw(tmp_dir, final_dir);
    sync_directory(root);
    replaced_copy = replaced;
  }
  write_text_file_atomically(root / kLatestFileName, name + "\n");
  crash_here_if_testing("before_old_removed");
  if (!replaced_copy.empty()) remove_after_commit(replaced_copy);
  crash_here_if_testing("before_prune");

  // Prune only now that the new checkpoint is committed and named by `latest`. Each one is first
  // renamed to a `.tmp` name, so a removal that stops half way (a crash, a file the file system will
  // not let go) leaves a leftover for the next save to clear, never a half checkpoint counted as one.
  if (keep_last > 0) {
    auto committed = list_checkpoints(root);
    // Note [Falling back from a damaged checkpoint]: a step newer than this one is there only when a
    // resume went back past it (it failed its checksums) or was pointed at an older step. A damaged one
    // is kept on disk until a save of its step moves it beside as step-N.damaged: it neither counts
    // toward keep_last (that would leave fewer good steps) nor is pruned. Only those newer steps are
    // verified, so a save reads back nothing in a run that went straight on.
    std::erase_if(committed, [&](const std::pair<int64_t, fs::path>& c) {
      if (c.first <= step) return false;
      try {
        verify_step(c.second);
        return false;
      } catch (const CheckpointError&) {
        return true;
      }
    });
    const size_t keep = size_t(keep_last);
    std::vector<fs::path> doomed;
    for (size_t i = 0; i + keep < committed.size(); ++i) {
      const fs::path& old = committed[i].second;
      if (old == final_dir) continue;
      const fs::path renamed = root / (step_dir_name(committed[i].first) + ".tmp");
      std::error_code ec;
      fs::rename(old, renamed, ec);
      if (!ec) {
        doomed.push_back(renamed);
        continue;
      }
      std::fprintf(stderr, "booster: warning: cannot prune %s (%s); the checkpoint is saved, the next save retries\n",
                   old.c_str(), ec.message().c_str());
      std::fflush(stderr);
    }
    if (!doomed.empty()) sync_directory(root);  // the renames are durable before any file goes
    for (const fs::path& dir : doomed) remove_after_commit(dir);
  }
  return final_dir;
}

fs::path save_checkpoint(const fs::path& root, const TrainingState& state, const SaveOptions& options) {
  BOOSTER_CHECK(options.keep_last >= 0, ValueError, "save_checkpoint: keep_last must be >= 0 (0 keeps all), got ",
                options.keep_last);
  const fs::path tmp_dir = begin_checkpoint(root, state.step);
  try {
    save_model(tmp_dir, state.model, options.max_shard_bytes);
    const bool has_optimizer = !state.optimizer.meta.is_null() || !state.optimizer.tensors.empty();
    if (has_optimizer) write_safetensors(tmp_dir / kOptimizerFileName, state.optimizer.tensors, {{"format", "pt"}});
    json rng = json::object();
    for (const auto& [rng_name, words] : state.rng) rng[rng_name] = words;
    const json trainer_state = {
        {"format", kFormatName},
        {"version", kCheckpointFormatVersion},
        {"step", state.step},
        {"optimizer", has_optimizer ? state.optimizer.meta : json()},
        {"scheduler", state.scheduler},
        {"dataloader", state.dataloader},
        {"rng", rng},
        {"extra", state.extra},
    };
    write_text_file_atomically(tmp_dir / kTrainerStateFileName, trainer_state.dump(2) + "\n");
    sync_directory(tmp_dir);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    throw;
  }
  return commit_checkpoint(root, state.step, options.keep_last);
}

// Note [Locking a checkpoint root]
// flock() is the lock: the kernel drops it when the holder dies, so a crash never leaves the root
// locked. Some file systems cannot flock at all: Lustre mounted with `noflock` (ENOSYS), NFSv3 without
// lockd (ENOLCK), FUSE file systems (ENOSYS, EOPNOTSUPP, EINVAL). Refusing to train there would refuse
// the file systems clusters checkpoint to, so on those errors the run goes on unlocked, with one
// warning line: nothing then stops a second run on the same root, and the user must not start one.
// The lock file holds `hostname:pid` of its holder, only to name it in the refusal (a root on a shared
// file system may be held from another node). BOOSTER_TEST_FLOCK_ERRNO=<errno> makes flock() fail with
// that errno, as on such a file system (tests/checkpoint/test_checkpoint.cpp, tests/cli/test_cli_resume.cpp).
RootLock::RootLock(const fs::path& root, const std::string& what) {
  std::error_code ec;
  fs::create_directories(root, ec);
  BOOSTER_CHECK(fs::is_directory(root), CheckpointError, "cannot create the ", what, " ", root.string(),
                ec ? ": " + ec.message() : std::string());
  const fs::path file = root / kLockFileName;
  fd_ = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  BOOSTER_CHECK(fd_ >= 0, CheckpointError, "cannot open ", file.string(), ": ", std::strerror(errno));
  int locked = 0;
  if (const char* hook = std::getenv("BOOSTER_TEST_FLOCK_ERRNO"); hook && *hook) {
    locked = -1;
    errno = std::atoi(hook);
  } else {
    locked = ::flock(fd_, LOCK_EX | LOCK_NB);
  }
  if (locked != 0) {
    const int why = errno;
    if (why == ENOSYS || why == ENOLCK || why == EOPNOTSUPP || why == EINVAL) {
      std::fprintf(stderr,
                   "booster: warning: the %s %s cannot be locked on this file system (%s); "
                   "no two runs may use it at once\n",
                   what.c_str(), root.c_str(), std::strerror(why));
      std::fflush(stderr);
      ::close(fd_);
      fd_ = -1;
      return;
    }
    char holder[300] = {};
    const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
    ::close(fd_);
    fd_ = -1;
    BOOSTER_CHECK(why != EWOULDBLOCK, CheckpointError, "the ", what, " ", root.string(),
                  " is in use by another process (", n > 0 ? std::string(holder, size_t(n)) : std::string("?"),
                  ", host:pid per ", file.string(), "); give this run its own ", what, ", or wait for that one");
    BOOSTER_FAIL(CheckpointError, "cannot lock ", file.string(), ": ", std::strerror(why));
  }
  // The holder, only for the message above: the flock is the lock, so a failed write is harmless.
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  const std::string holder = std::string(host) + ":" + std::to_string(::getpid());
  [[maybe_unused]] const int truncated = ::ftruncate(fd_, 0);
  [[maybe_unused]] const ssize_t written = ::pwrite(fd_, holder.data(), holder.size(), 0);
}

RootLock::~RootLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::vector<fs::path> checkpoint_candidates(const fs::path& root) {
  std::vector<fs::path> out;
  std::error_code ec;
  const fs::path latest_file = root / kLatestFileName;
  if (fs::exists(fs::symlink_status(latest_file, ec))) {
    try {
      out.push_back(resolve_checkpoint(root));
    } catch (const CheckpointError&) {
      // `latest` names nothing loadable: the committed steps still are candidates.
    }
  }
  const auto committed = list_checkpoints(root);
  for (auto it = committed.rbegin(); it != committed.rend(); ++it)
    if (std::find(out.begin(), out.end(), it->second) == out.end()) out.push_back(it->second);
  return out;
}

fs::path resolve_checkpoint(const fs::path& given) {
  fs::path path = given;
  // `<root>/step-N` named explicitly, caught between the renames of a replace: its stand-in.
  if (!fs::exists(path)) {
    fs::path named = path.lexically_normal();
    if (!named.has_filename()) named = named.parent_path();
    const fs::path stand_in = named.string() + kReplacedSuffix;
    if (std::regex_match(named.filename().string(), kStepDirName) && fs::is_directory(stand_in)) path = stand_in;
  }
  BOOSTER_CHECK(fs::is_directory(path), CheckpointError, "load_checkpoint: ", path.string(),
                " is not a directory");
  if (fs::exists(path / kTrainerStateFileName)) return path;
  std::error_code ec;
  const fs::path latest_file = path / kLatestFileName;
  if (fs::exists(fs::symlink_status(latest_file, ec))) {
    // Either our text file naming the step, or a symlink to a step directory (as some tools make it).
    std::string name;
    if (fs::is_symlink(fs::symlink_status(latest_file, ec))) {
      name = fs::read_symlink(latest_file, ec).lexically_normal().filename().string();
    } else {
      name = read_text_file(latest_file, 4096);
      while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    }
    BOOSTER_CHECK(std::regex_match(name, kStepDirName), CheckpointError, "load_checkpoint: ", latest_file.string(),
                  " names '", name, "', not a step-XXXXXXXX directory; ", existing_steps(path));
    fs::path dir = path / name;
    // Caught between the renames of a replace (Note [Replacing a checkpoint]).
    if (!fs::exists(dir) && fs::is_directory(path / (name + kReplacedSuffix))) dir = path / (name + kReplacedSuffix);
    BOOSTER_CHECK(fs::is_directory(dir), CheckpointError, "load_checkpoint: ", latest_file.string(), " names ", name,
                  ", which does not exist in ", path.string(), "; ", existing_steps(path));
    return dir;
  }
  const auto committed = list_checkpoints(path);
  BOOSTER_CHECK(!committed.empty(), CheckpointError, "load_checkpoint: no checkpoint in ", path.string(),
                " (no ", kTrainerStateFileName, ", no ", kLatestFileName, ", no step-XXXXXXXX directory)");
  return committed.back().second;
}

TrainingState load_checkpoint(const fs::path& path, const LoadOptions& options) {
  const fs::path dir = resolve_checkpoint(path);
  const bool verified = options.verify && verify_checksums(dir) == ChecksumStatus::Verified;
  const fs::path state_file = dir / kTrainerStateFileName;
  BOOSTER_CHECK(fs::exists(state_file), CheckpointError, "load_checkpoint: ", dir.string(), " has no ",
                kTrainerStateFileName, "; it is not a complete checkpoint");
  // Note [One JSON reader] (booster/common/json_text.h).
  json saved = parse_json_as<CheckpointError>(read_text_file(state_file), "checkpoint file " + state_file.string(),
                                              "corrupt checkpoint " + state_file.string() + ": not valid JSON: ",
                                              checkpoint_limits());
  BOOSTER_CHECK(saved.is_object() && saved.value("format", json()) == kFormatName, CheckpointError,
                "load_checkpoint: ", state_file.string(), " is not a booster checkpoint (no \"format\": \"",
                kFormatName, "\")");
  const json& version = field(saved, state_file, "version");
  BOOSTER_CHECK(version == 1 || version == kCheckpointFormatVersion, CheckpointError, "load_checkpoint: ",
                dir.string(), " has checkpoint format version ", version.dump(), "; this build reads versions 1 to ",
                kCheckpointFormatVersion);
  if (options.verify && !verified) {
    BOOSTER_CHECK(version == 1, CheckpointError, "load_checkpoint: ", dir.string(), " has no ", kChecksumsFileName,
                  " though its version records one: it was removed or the save was tampered with; pass "
                  "--no-verify (LoadOptions::verify = false) to load it unverified");
    std::fprintf(stderr, "booster: warning: %s predates checksums; its files are not verified\n", dir.c_str());
  }

  TrainingState state;
  try {
    state.step = field(saved, state_file, "step").get<int64_t>();
    state.scheduler = field(saved, state_file, "scheduler");
    state.dataloader = field(saved, state_file, "dataloader");
    for (const auto& [name, words] : field(saved, state_file, "rng").items())
      state.rng[name] = words.get<std::vector<uint64_t>>();
    state.extra = field(saved, state_file, "extra");
    state.optimizer.meta = field(saved, state_file, "optimizer");
  } catch (const json::exception& e) {
    BOOSTER_FAIL(CheckpointError, "corrupt checkpoint ", state_file.string(), ": ", e.what());
  }

  for (const auto& [key, expected] : options.expect_extra.items()) {
    BOOSTER_CHECK(state.extra.is_object() && state.extra.contains(key), CheckpointError, "load_checkpoint: ",
                  dir.string(), " does not record \"", key, "\" (this run expects ", expected.dump(), ")");
    BOOSTER_CHECK(state.extra[key] == expected, CheckpointError, "load_checkpoint: ", dir.string(),
                  " was saved with ", key, " = ", state.extra[key].dump(), " but this run uses ", key, " = ",
                  expected.dump(), "; resume with the same ", key, " or start a new run");
  }

  state.model = load_model(dir);
  if (!state.optimizer.meta.is_null()) {
    const fs::path optimizer_file = dir / kOptimizerFileName;
    BOOSTER_CHECK(fs::exists(optimizer_file), CheckpointError, "load_checkpoint: ", optimizer_file.string(),
                  " is missing but ", kTrainerStateFileName, " records an optimizer");
    state.optimizer.tensors = read_safetensors(optimizer_file).tensors;
  }
  return state;
}

// Note [Weights from a checkpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// model.init_from may name a checkpoint step, its model/ folder or a model file in it. Read as a plain
// directory, those files would skip the checksums a resume checks, and a flipped bit would become the
// starting weights of a run. So load_weights first looks for the step the path lies in: for a
// directory, the directory itself or its parent; for a file, its parent or grandparent (as deep as a
// model file lies in a step: step/model/model.safetensors, or step/model.safetensors in the layout of
// save_checkpoint). A step is a directory holding checksums.json, or a trainer_state.json of one of
// booster's formats. Hugging Face's Trainer writes a trainer_state.json of its own beside its weights:
// its checkpoints, like any Hugging Face directory or plain .safetensors file, carry no checksums and
// load unverified without a word. The files verified are the ones the load reads (the step's model/
// folder, the named file, or the index's directory) with verify_checksums' `below`, so a step whose
// optimizer file is damaged still gives its verified weights; where the model lies beside the other
// files (save_checkpoint's layout) the whole step is verified. A step whose format records checksums
// but that has no checksums.json is refused, an older one loads with the warning a resume gives.
namespace {

// The format and version of `dir`/trainer_state.json when it is one of booster's: "booster-state"
// (Booster::save_state) or "booster-checkpoint" (save_checkpoint).
std::optional<std::pair<std::string, int64_t>> booster_state_format(const fs::path& dir) {
  const fs::path file = dir / kTrainerStateFileName;
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return std::nullopt;
  try {
    const json state = parse_json_text(read_text_file(file, size_t(256) << 20), file.string(),
                                       checkpoint_limits());
    if (!state.is_object() || !state.contains("version") || !state.at("version").is_number_integer())
      return std::nullopt;
    const json format = state.value("format", json());
    if (format != kFormatName && format != "booster-state") return std::nullopt;
    return std::make_pair(format.get<std::string>(), state.at("version").get<int64_t>());
  } catch (const std::exception&) {
    return std::nullopt;  // not ours, or unreadable: nothing says it carries checksums
  }
}

// Whether `dir`'s format version writes checksums.json with every save.
bool records_checksums(const fs::path& dir) {
  const auto format = booster_state_format(dir);
  return format && ((format->first == kFormatName && format->second >= 2) ||
                    (format->first == "booster-state" && format->second >= 3));  // state.cpp's kStateFormatVersion
}

bool is_checkpoint_step(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(dir / kChecksumsFileName, ec)) || booster_state_format(dir).has_value();
}

bool is_index_file(const fs::path& path) {
  const std::string name = path.filename().string();
  return name.size() > 11 && name.compare(name.size() - 11, 11, ".index.json") == 0;
}

}  // namespace

void verify_step(const fs::path& dir) {
  BOOSTER_CHECK(verify_checksums(dir) == ChecksumStatus::Verified || !records_checksums(dir), CheckpointError,
                dir.string(), " has no ", kChecksumsFileName, " though its format version records one: it was "
                "removed after the save; pass --no-verify (LoadStateOptions::verify = false) to load it unverified");
}

namespace {

// Where load_weights(path) reads: the checkpoint step the path lies in (empty: none) and the model files
// (a folder, an index or a file).
struct WeightsSource {
  fs::path step, source;
};

WeightsSource locate_weights(const fs::path& path) {
  std::error_code ec;
  fs::path where = fs::weakly_canonical(path, ec);
  if (ec) where = fs::absolute(path).lexically_normal();
  if (!where.has_filename()) where = where.parent_path();
  const bool is_dir = fs::is_directory(where, ec);

  fs::path step;  // the checkpoint step the path lies in, if any
  for (const fs::path& candidate : is_dir ? std::vector<fs::path>{where, where.parent_path()}
                                          : std::vector<fs::path>{where.parent_path(), where.parent_path().parent_path()})
    if (!candidate.empty() && is_checkpoint_step(candidate)) {
      step = candidate;
      break;
    }
  if (step.empty()) return {fs::path(), path};

  // A step named whole: the model is its model/ folder (Booster::save_state), or its own model files
  // (save_checkpoint).
  fs::path source = where;
  if (is_dir && where == step && fs::is_directory(step / "model", ec)) source = step / "model";
  return {step, source};
}

// The shapes in one .safetensors file's header.
void add_header_shapes(const fs::path& file, std::map<std::string, Shape>& out) {
  for (const SafetensorsEntry& e : read_safetensors_header(file).entries) out[e.name] = e.shape;
}

}  // namespace

std::map<std::string, Shape> weight_shapes(const fs::path& path) {
  const fs::path source = locate_weights(path).source;
  fs::path file = source, index;
  if (fs::is_directory(source)) {
    file = source / kModelFileName;
    if (!fs::exists(file) && fs::exists(source / kModelIndexFileName)) index = source / kModelIndexFileName;
    BOOSTER_CHECK(fs::exists(file) || !index.empty(), CheckpointError, source.string(), " holds neither ",
                  kModelFileName, " nor ", kModelIndexFileName);
  } else if (is_index_file(source)) {
    index = source;
  }
  std::map<std::string, Shape> out;
  if (index.empty()) {
    add_header_shapes(file, out);
    return out;
  }
  json map;
  try {
    map = parse_json_text(read_text_file(index, size_t(256) << 20), index.string(), checkpoint_limits())
              .at("weight_map");
  } catch (const std::exception& e) {
    BOOSTER_FAIL(CheckpointError, "model index ", index.string(), ": no readable \"weight_map\" (", e.what(), ")");
  }
  std::set<std::string> shards;
  for (const auto& [name, shard] : map.items())
    if (shard.is_string()) shards.insert(shard.get<std::string>());
  for (const std::string& shard : shards)
    if (shard.find('/') == std::string::npos) add_header_shapes(index.parent_path() / shard, out);
  return out;
}

TensorMap load_weights(const fs::path& path, const LoadWeightsOptions& options) {
  std::error_code ec;
  const auto [step, source] = locate_weights(path);
  if (step.empty()) return load_model(path);
  if (options.verify) {
    // What the load reads: the folder, the index's folder (its shards), or the one file.
    const fs::path read = fs::is_directory(source, ec) || !is_index_file(source) ? source : source.parent_path();
    fs::path below = read.lexically_relative(step);
    if (below == ".") below.clear();
    if (verify_checksums(step, below) == ChecksumStatus::Absent) {
      const auto format = booster_state_format(step);
      BOOSTER_CHECK(!records_checksums(step), CheckpointError, step.string(), " has no ", kChecksumsFileName,
                    " though its format version records one: it was removed after the save; point model.init_from "
                    "at another step's model, or pass --no-verify to load it unverified");
      if (format && options.warn) {
        std::fprintf(stderr, "booster: warning: %s predates checksums; its files are not verified\n", step.c_str());
        std::fflush(stderr);
      }
    }
  }
  return load_model(source);
}

}  // namespace booster::checkpoint
