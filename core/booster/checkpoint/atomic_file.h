// Durable and atomic file writes for checkpoints.
//
// Note [Atomic checkpoint writes]
// A file is written to `<path>.tmp-<pid>`, flushed to disk with fsync, and renamed over `path`; the
// directory is then fsynced so the rename itself survives a power cut. rename() replaces the target
// atomically, so a reader sees either the whole old file or the whole new one, never a torn mix, and a
// process killed mid-write leaves the old file untouched (plus a stray .tmp file that the next save of
// that file overwrites). A whole checkpoint directory is committed the same way (see checkpoint.h):
// the rename of `step-N.tmp/` to `step-N/` is the single commit point.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>

namespace booster::checkpoint {

// A file open for writing. Every failure throws CheckpointError naming the file and the system's
// reason (ENOSPC, EACCES, ...).
class FileWriter {
 public:
  // Creates or truncates `path`.
  explicit FileWriter(std::filesystem::path path);
  ~FileWriter();  // closes without syncing; use close() to see errors
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, size_t nbytes);
  void write(const std::string& s) { write(s.data(), s.size()); }
  // fsync, then close.
  void sync_and_close();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

// Writes `path` atomically (Note [Atomic checkpoint writes]): fill() writes the content into a
// temporary file beside it. If fill() throws, the temporary file is removed and `path` is unchanged.
void write_file_atomically(const std::filesystem::path& path, const std::function<void(FileWriter&)>& fill);
void write_text_file_atomically(const std::filesystem::path& path, const std::string& text);

// fsyncs a directory, so that renames and new entries in it are durable.
void sync_directory(const std::filesystem::path& dir);

// Reads a whole (small) file; CheckpointError naming the file if it is missing, unreadable or larger
// than max_bytes.
std::string read_text_file(const std::filesystem::path& path, size_t max_bytes = size_t(1) << 30);

}  // namespace booster::checkpoint
