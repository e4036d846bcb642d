// Input files that must be regular files of a bounded size (Note [Inputs that are not files]).
#include "booster/common/input_file.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace booster {

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

InputFile& InputFile::operator=(InputFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    size_ = other.size_;
    other.fd_ = -1;
  }
  return *this;
}

std::string InputFile::read_all(std::string& problem) const {
  std::string text(size_t(size_), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::pread(fd_, text.data() + done, text.size() - done, off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      problem = std::string(": cannot be read (") + std::strerror(errno) + ")";
      return "";
    }
    if (n == 0) break;
    done += size_t(n);
  }
  if (done != text.size()) {
    problem = " shrank while being read (" + std::to_string(done) + " of " + std::to_string(text.size()) + " bytes)";
    return "";
  }
  return text;
}

std::string format_input_size(uint64_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " bytes";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = double(bytes) / 1024.0;
  int u = 0;
  while (v >= 1024.0 && u < 5) v /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

namespace {

const char* kind_of(mode_t mode) {
  return S_ISDIR(mode)    ? "a directory"
         : S_ISFIFO(mode) ? "a FIFO (named pipe)"
         : S_ISCHR(mode)  ? "a character device"
         : S_ISBLK(mode)  ? "a block device"
         : S_ISSOCK(mode) ? "a socket"
                          : "not a regular file";
}

std::string not_regular(mode_t mode) {
  if (S_ISDIR(mode)) return " is a directory, not a regular file";
  const std::string kind = kind_of(mode);
  return kind == "not a regular file" ? " is not a regular file"
                                      : " is " + kind + ", not a regular file (reading it could block or never end)";
}

}  // namespace

namespace detail {

InputFile try_open_input_file(const std::filesystem::path& path, uint64_t max_bytes, std::string& problem,
                              bool& missing) {
  missing = false;
  struct stat st {};
  // stat first: a device is never opened (opening one can have effects of its own).
  if (::stat(path.c_str(), &st) != 0) {
    missing = errno == ENOENT;
    problem = std::string(": cannot open it (") + std::strerror(errno) + ")";
    return {};
  }
  if (!S_ISREG(st.st_mode)) {
    problem = not_regular(st.st_mode);
    return {};
  }
  // O_NONBLOCK: a FIFO swapped in since the stat opens at once instead of waiting for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    problem = std::string(": cannot open it (") + std::strerror(errno) + ")";
    return {};
  }
  InputFile file(fd, 0);
  if (::fstat(fd, &st) != 0) {
    problem = std::string(": cannot read it (") + std::strerror(errno) + ")";
    return {};
  }
  if (!S_ISREG(st.st_mode)) {
    problem = not_regular(st.st_mode);
    return {};
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  const uint64_t size = uint64_t(st.st_size);
  if (size > max_bytes) {
    problem = " is " + format_input_size(size) + ", more than its limit of " + format_input_size(max_bytes);
    return {};
  }
  return InputFile(file.release(), size);
}

std::string try_read_input_text(const std::filesystem::path& path, uint64_t max_bytes, int idle_seconds,
                                std::string& problem) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode)) {
    // O_NONBLOCK: the open returns at once even with no writer; poll then waits for one, at most
    // idle_seconds between pieces (Linux reports no hang-up to a reader before a writer has come).
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      problem = std::string(": cannot open it (") + std::strerror(errno) + ")";
      return "";
    }
    const InputFile file(fd, 0);
    std::string text;
    char buffer[1 << 16];
    for (;;) {
      pollfd p{fd, POLLIN, 0};
      const int ready = ::poll(&p, 1, idle_seconds * 1000);
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) {
        problem = " is a FIFO (named pipe) that nothing was written to for " + std::to_string(idle_seconds) +
                  " s (after " + std::to_string(text.size()) + " bytes)";
        return "";
      }
      const ssize_t n = ready < 0 ? -1 : ::read(fd, buffer, sizeof buffer);
      if (n == 0) return text;  // every writer has closed it
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        problem = std::string(": cannot read it (") + std::strerror(errno) + ")";
        return "";
      }
      if (uint64_t(text.size()) + uint64_t(n) > max_bytes) {
        problem = " is a FIFO (named pipe) that gave more than its limit of " + format_input_size(max_bytes);
        return "";
      }
      text.append(buffer, size_t(n));
    }
  }
  bool missing = false;
  const InputFile file = try_open_input_file(path, max_bytes, problem, missing);
  return file.fd() < 0 ? std::string() : file.read_all(problem);
}

std::string input_message(const std::string& what, const std::filesystem::path& path, const std::string& problem,
                          const std::string& fix) {
  return (what.empty() ? std::string() : what + " ") + path.string() + problem + (fix.empty() ? "" : "; " + fix);
}

}  // namespace detail

}  // namespace booster
