// Opening a file that is read as a whole (a config, a hostfile, weights, a text): refuses anything but a
// regular file, and a file larger than the reader's limit, before a byte is read (Note [Inputs that are
// not files]).
//
// Note [Inputs that are not files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// open(O_RDONLY) of a FIFO blocks until a writer comes, so `booster generate --hf DIR` with a FIFO for
// config.json or model.safetensors, `run --hostfile FIFO` and `tokenize --in FIFO` waited forever; a
// device such as /dev/zero opens and reads without end, so `--hostfile /dev/zero` grew to gigabytes.
// Every reader that expects a regular file goes through open_input_file (or check_input_file, for a
// reader that opens the file itself afterwards): the path is stat'ed first, so a device is never even
// opened; the open itself is O_NONBLOCK, so a FIFO put there since cannot block it, and the descriptor
// is fstat'ed again. A directory, FIFO, socket or device is refused as "<what> <path> is a FIFO (named
// pipe), not a regular file; <fix>", and a regular file larger than the reader's limit as "<what>
// <path> is 3.0 GiB, more than its limit of 1.0 MiB; <fix>". Where a pipe is a natural input (a
// hostfile from `<(scontrol show ...)`, a text from `<(zcat ...)`), read_input_text reads a FIFO as it
// comes, bounded by the same limit and by kPipeIdleSeconds without a byte (a FIFO nobody writes to).
// The output side is checkpoint::refuse_non_regular_output (Note [Outputs that are not files]).
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>

#include "booster/common/error.h"

namespace booster {

inline constexpr uint64_t kNoInputLimit = std::numeric_limits<uint64_t>::max();
// How long read_input_text waits for a pipe's writer to say something before giving up.
inline constexpr int kPipeIdleSeconds = 10;

// An open, read-only regular file; closed when it goes.
class InputFile {
 public:
  InputFile() = default;
  InputFile(int fd, uint64_t size) : fd_(fd), size_(size) {}
  ~InputFile();
  InputFile(InputFile&& other) noexcept : fd_(other.fd_), size_(other.size_) { other.fd_ = -1; }
  InputFile& operator=(InputFile&& other) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  int fd() const { return fd_; }
  uint64_t size() const { return size_; }  // at the open
  // Hands the descriptor over (the caller closes it).
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // The whole file (at most its size at the open), read with retries on EINTR; "" and `problem` set on
  // a read error.
  std::string read_all(std::string& problem) const;

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

// "1.0 MiB", "3.0 GiB", "512 bytes".
std::string format_input_size(uint64_t bytes);

namespace detail {
// Opens `path` as Note [Inputs that are not files] says. On failure returns an InputFile with fd -1
// and sets `problem` to the rest of the message after the path (" is a FIFO (named pipe), not a regular
// file", ": cannot open it (No such file or directory)"); `missing` tells an absent path apart.
InputFile try_open_input_file(const std::filesystem::path& path, uint64_t max_bytes, std::string& problem,
                              bool& missing);
// read_input_text's work: the text, or "" with `problem` set.
std::string try_read_input_text(const std::filesystem::path& path, uint64_t max_bytes, int idle_seconds,
                                std::string& problem);
std::string input_message(const std::string& what, const std::filesystem::path& path, const std::string& problem,
                          const std::string& fix);
}  // namespace detail

// Opens `path` for reading: an Error of type E naming `what`, the path and `fix` when it is absent or
// unreadable, not a regular file, or larger than `max_bytes`.
template <class E>
InputFile open_input_file(const std::filesystem::path& path, const std::string& what, const std::string& fix,
                          uint64_t max_bytes = kNoInputLimit) {
  std::string problem;
  bool missing = false;
  InputFile file = detail::try_open_input_file(path, max_bytes, problem, missing);
  if (file.fd() < 0) throw E(detail::input_message(what, path, problem, fix));
  return file;
}

// The same checks for a reader that opens the file itself afterwards; an absent path is left to that
// reader's own message.
template <class E>
void check_input_file(const std::filesystem::path& path, const std::string& what, const std::string& fix,
                      uint64_t max_bytes = kNoInputLimit) {
  std::string problem;
  bool missing = false;
  InputFile file = detail::try_open_input_file(path, max_bytes, problem, missing);
  if (file.fd() < 0 && !missing) throw E(detail::input_message(what, path, problem, fix));
}

// The whole of `path`, at most `max_bytes`, through open_input_file.
template <class E>
std::string read_input_file(const std::filesystem::path& path, const std::string& what, const std::string& fix,
                            uint64_t max_bytes = kNoInputLimit) {
  const InputFile file = open_input_file<E>(path, what, fix, max_bytes);
  std::string problem;
  std::string text = file.read_all(problem);
  if (!problem.empty()) throw E(detail::input_message(what, path, problem, fix));
  return text;
}

// A text that may also come from a pipe (bash's `--hostfile <(scontrol show hostnames)`, `--in <(zcat
// corpus.gz)`): a regular file as read_input_file reads it; a FIFO is read as it comes, at most
// `max_bytes` (a writer that never stops is refused once past it), and refused when nothing arrives
// for `idle_seconds` (a FIFO nobody writes to would otherwise wait forever). Devices, sockets and
// directories are refused as by open_input_file.
template <class E>
std::string read_input_text(const std::filesystem::path& path, const std::string& what, const std::string& fix,
                            uint64_t max_bytes, int idle_seconds = kPipeIdleSeconds) {
  std::string problem;
  std::string text = detail::try_read_input_text(path, max_bytes, idle_seconds, problem);
  if (!problem.empty()) throw E(detail::input_message(what, path, problem, fix));
  return text;
}

}  // namespace booster
