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
#include <vector>

namespace booster::checkpoint {

// A file open for writing. Every failure throws CheckpointError naming the file and the system's
// reason (ENOSPC, EACCES, ...).
class FileWriter {
 public:
  // Creates or truncates `path`.
  explicit FileWriter(std::filesystem::path path);
  // Collects the bytes into `memory` instead (Note [Capturing a checkpoint's files]).
  FileWriter(std::filesystem::path path, std::string& memory) : path_(std::move(path)), memory_(&memory) {}
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
  std::string* memory_ = nullptr;
};

// Note [Outputs that are not files]
// An output path that exists and is not a regular file (a device node, a FIFO, a socket, a directory; a
// symlink counts as what it points to, so one to /dev/null is a device) is refused before anything is
// written: renaming a temporary file over it would replace a device node (as root, /dev/null itself),
// and opening a FIFO to write blocks until someone reads. ConfigError naming `what` (e.g. "--out", or
// "" for a file the program chose) and the path, with the fix. Every write through write_file_atomically
// and FileWriter checks it; a command checks its outputs with it up front, before the work.
// write_file_atomically passes follow_links false: its rename replaces a symbolic link itself, never
// what it points to, so a link is written over as a file is (a checkpoint's `latest` may be a link to a
// step directory); FileWriter opens the path, so for it a link counts as its target.
void refuse_non_regular_output(const std::filesystem::path& path, const std::string& what = "",
                               bool follow_links = true);

// Writes `path` atomically (Note [Atomic checkpoint writes]): fill() writes the content into a
// temporary file beside it. If fill() throws, the temporary file is removed and `path` is unchanged.
void write_file_atomically(const std::filesystem::path& path, const std::function<void(FileWriter&)>& fill);
void write_text_file_atomically(const std::filesystem::path& path, const std::string& text);

// Note [Capturing a checkpoint's files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// While a WriteCapture lives, write_file_atomically on the same thread writes nothing: it keeps each
// file's bytes in memory (in the order written; a path written twice keeps its last bytes). An
// asynchronous checkpoint (train.async_checkpoint) thus snapshots the very bytes the synchronous save
// would write, at the step, and write_captured puts them on disk later, from another thread, through
// write_file_atomically as the synchronous save does. Directories are still created on disk.
class WriteCapture {
 public:
  struct File {
    std::filesystem::path path;
    std::string bytes;
  };
  WriteCapture();
  ~WriteCapture();
  WriteCapture(const WriteCapture&) = delete;
  WriteCapture& operator=(const WriteCapture&) = delete;
  // The files captured so far, moved out.
  std::vector<File> take() { return std::move(files_); }
  // The capture on this thread, or null.
  static WriteCapture* active();
  void add(std::filesystem::path path, std::string bytes);

 private:
  std::vector<File> files_;
  WriteCapture* outer_;
};

// Writes captured files, each atomically (creating its directory where missing).
void write_captured(const std::vector<WriteCapture::File>& files);

// fsyncs a directory, so that renames and new entries in it are durable.
void sync_directory(const std::filesystem::path& dir);

// Reads a whole (small) file; CheckpointError naming the file if it is missing, unreadable or larger
// than max_bytes.
std::string read_text_file(const std::filesystem::path& path, size_t max_bytes = size_t(1) << 30);

}  // namespace booster::checkpoint
