#include "booster/checkpoint/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "booster/common/error.h"
#include "booster/common/input_file.h"

namespace booster::checkpoint {

namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

void refuse_non_regular_output(const fs::path& path, const std::string& what, bool follow_links) {
  struct stat st {};
  if (!follow_links && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) return;  // the link is replaced
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return;  // absent (or unreadable: open says why)
  const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISFIFO(st.st_mode) ? "a FIFO (named pipe)"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                                            : "not a regular file";
  std::error_code ec;
  const bool link = fs::is_symlink(fs::symlink_status(path, ec));
  BOOSTER_FAIL(ConfigError, what.empty() ? std::string() : what + " ", path.string(), " is ",
               link ? std::string("a symbolic link to ") : std::string(), kind,
               ", not a regular file; writing it would replace it or block, so nothing was written. "
               "Give a path that is a file or does not exist yet");
}

FileWriter::FileWriter(fs::path path) : path_(std::move(path)) {
  refuse_non_regular_output(path_);  // Note [Outputs that are not files]
  // O_NONBLOCK: a FIFO put here since the check fails to open (ENXIO) instead of blocking.
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK, 0644);
  BOOSTER_CHECK(fd_ >= 0, CheckpointError, "cannot create ", path_.string(), ": ", errno_text());
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    refuse_non_regular_output(path_);
    BOOSTER_FAIL(CheckpointError, "cannot create ", path_.string(), ": not a regular file");
  }
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(const void* data, size_t nbytes) {
  if (memory_) {
    memory_->append(static_cast<const char*>(data), nbytes);
    return;
  }
  BOOSTER_CHECK(fd_ >= 0, CheckpointError, "write to ", path_.string(), " after it was closed");
  const char* p = static_cast<const char*>(data);
  while (nbytes > 0) {
    // Linux writes at most ~2 GiB per call; loop over partial writes.
    const ssize_t n = ::write(fd_, p, nbytes < (size_t(1) << 30) ? nbytes : (size_t(1) << 30));
    if (n < 0 && errno == EINTR) continue;
    BOOSTER_CHECK(n > 0, CheckpointError, "cannot write ", path_.string(), ": ", errno_text());
    p += n;
    nbytes -= size_t(n);
  }
}

void FileWriter::sync_and_close() {
  if (memory_ || fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    BOOSTER_FAIL(CheckpointError, "cannot flush ", path_.string(), " to disk: ", why);
  }
  BOOSTER_CHECK(::close(fd) == 0, CheckpointError, "cannot close ", path_.string(), ": ", errno_text());
}

void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  BOOSTER_CHECK(fd >= 0, CheckpointError, "cannot open directory ", dir.string(), ": ", errno_text());
  // Some file systems refuse fsync on directories (EINVAL); their renames are durable regardless.
  const bool ok = ::fsync(fd) == 0 || errno == EINVAL;
  const std::string why = ok ? "" : errno_text();
  ::close(fd);
  BOOSTER_CHECK(ok, CheckpointError, "cannot flush directory ", dir.string(), ": ", why);
}

namespace {
thread_local WriteCapture* current_capture = nullptr;
}  // namespace

WriteCapture::WriteCapture() : outer_(current_capture) { current_capture = this; }
WriteCapture::~WriteCapture() { current_capture = outer_; }
WriteCapture* WriteCapture::active() { return current_capture; }

void WriteCapture::add(fs::path path, std::string bytes) {
  for (File& f : files_)
    if (f.path == path) {
      f.bytes = std::move(bytes);
      return;
    }
  files_.push_back({std::move(path), std::move(bytes)});
}

void write_captured(const std::vector<WriteCapture::File>& files) {
  for (const WriteCapture::File& f : files) {
    if (f.path.has_parent_path() && !fs::is_directory(f.path.parent_path())) {
      std::error_code ec;
      fs::create_directories(f.path.parent_path(), ec);
      BOOSTER_CHECK(!ec, CheckpointError, "cannot create directory ", f.path.parent_path().string(), ": ", ec.message());
    }
    write_file_atomically(f.path, [&](FileWriter& out) { out.write(f.bytes); });
  }
}

void write_file_atomically(const fs::path& path, const std::function<void(FileWriter&)>& fill) {
  refuse_non_regular_output(path, "", /*follow_links=*/false);  // Note [Outputs that are not files]
  if (WriteCapture* capture = WriteCapture::active()) {  // Note [Capturing a checkpoint's files]
    std::string bytes;
    FileWriter out(path, bytes);
    fill(out);
    capture->add(path, std::move(bytes));
    return;
  }
  fs::path tmp = path;
  tmp += ".tmp-" + std::to_string(::getpid());
  try {
    FileWriter out(tmp);
    fill(out);
    out.sync_and_close();
  } catch (...) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    std::error_code ignored;
    fs::remove(tmp, ignored);
    BOOSTER_FAIL(CheckpointError, "cannot rename ", tmp.string(), " to ", path.string(), ": ", why);
  }
  sync_directory(path.has_parent_path() ? path.parent_path() : fs::path("."));
}

void write_text_file_atomically(const fs::path& path, const std::string& text) {
  write_file_atomically(path, [&](FileWriter& out) { out.write(text); });
}

std::string read_text_file(const fs::path& path, size_t max_bytes) {
  // Note [Inputs that are not files]: a FIFO must not block the open, nor a device be read on end.
  return read_input_file<CheckpointError>(path, "", "", max_bytes);
}

}  // namespace booster::checkpoint
