// The progress display and the metrics file of the Trainer (Note [What booster train prints]).
#include "booster/trainer/progress.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "booster/common/error.h"
#include "booster/distributed/process_group.h"

namespace booster::trainer {

int process_rank() {
  // A group of several processes knows; a one-process group under mpirun (the single plugin started N
  // times) does not, and the launcher's variables still tell the copies apart.
  if (distributed::is_initialized() && distributed::default_process_group().size() > 1)
    return distributed::default_process_group().rank();
  // Before any group exists: the launcher's variables (mpirun, Slurm's PMI, torchrun's RANK).
  return distributed::job_place_from_launcher().rank;
}

std::string human_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long long s = std::llround(seconds);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s % 3600) / 60);
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%llds", s);
  return buf;
}

std::string human_count(double n) {
  char buf[32];
  if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else if (n >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

// ------------------------------------------------------------------------------------------ Progress
Progress::Mode Progress::detect() {
  if (process_rank() != 0) return Mode::Silent;
  if (const char* forced = std::getenv("BOOSTER_PROGRESS")) {
    const std::string f = forced;
    if (f == "bar") return Mode::Bar;
    if (f == "lines") return Mode::Lines;
    if (f == "none") return Mode::Silent;
  }
  return ::isatty(STDERR_FILENO) ? Mode::Bar : Mode::Lines;
}

Progress::Progress(Mode mode, FILE* out) : mode_(mode), out_(out) {}

Progress::~Progress() { finish(); }

namespace {

// The terminal's width; $COLUMNS, else 80, when the output is no terminal.
int terminal_columns(FILE* out) {
  winsize ws{};
  if (::ioctl(::fileno(out), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* columns = std::getenv("COLUMNS"); columns && std::atoi(columns) > 20) return std::atoi(columns);
  return 80;
}

}  // namespace

void Progress::update(const StepReport& r, bool logged) {
  if (mode_ == Mode::Silent) return;
  if (mode_ == Mode::Lines) {
    if (!logged) return;
    char scale_text[64] = "";
    if (r.loss_scale)
      std::snprintf(scale_text, sizeof scale_text, " | scale %g | skipped %lld", *r.loss_scale,
                    static_cast<long long>(r.skipped));
    std::fprintf(out_, "step %6lld/%lld | epoch %lld | loss %.4f | lr %.3g%s | %.0f samples/s | ETA %s\n",
                 static_cast<long long>(r.step), static_cast<long long>(r.total_steps),
                 static_cast<long long>(r.epoch), r.loss, r.lr, scale_text, r.samples_per_second,
                 human_duration(r.eta_seconds).c_str());
    std::fflush(out_);
    return;
  }
  last_ = r;
  // Redrawing a line costs a write to the terminal; ten times a second looks live.
  const auto now = std::chrono::steady_clock::now();
  if (logged || r.step == r.total_steps || now - last_draw_ >= std::chrono::milliseconds(100)) {
    draw_bar(r);
    last_draw_ = now;
  }
}

void Progress::draw_bar(const StepReport& r) {
  const int columns = terminal_columns(out_);
  char head[64], tail[256], scale_text[64] = "";
  std::snprintf(head, sizeof head, "step %lld/%lld ", static_cast<long long>(r.step),
                static_cast<long long>(r.total_steps));
  if (r.loss_scale)
    std::snprintf(scale_text, sizeof scale_text, " | scale %g | skipped %lld", *r.loss_scale,
                  static_cast<long long>(r.skipped));
  const double fraction = r.total_steps > 0 ? std::clamp(double(r.step) / double(r.total_steps), 0.0, 1.0) : 0.0;
  // Most important first: a narrow terminal cuts the end.
  // Before the first logged step of a run over several processes no global loss is known yet.
  char loss_text[32] = "-";
  if (r.loss_step > 0) std::snprintf(loss_text, sizeof loss_text, "%.4f", r.loss);
  std::snprintf(tail, sizeof tail, " %3.0f%% ETA %s | loss %s | %s samples/s%s", 100.0 * fraction,
                human_duration(r.eta_seconds).c_str(), loss_text, human_count(r.samples_per_second).c_str(), scale_text);
  // The bar takes what the terminal has left, between 10 and 30 cells; on a narrow terminal the line is
  // cut rather than wrapped (a wrapped line cannot be redrawn with a carriage return).
  const int fixed = int(std::strlen(head) + std::strlen(tail)) + 2;
  const int cells = std::clamp(columns - 1 - fixed, 10, 30);
  const int filled = int(std::floor(fraction * cells));
  std::string line = head;
  line += '[';
  line.append(size_t(filled), '#');
  line.append(size_t(cells - filled), '.');
  line += ']';
  line += tail;
  if (int(line.size()) > columns - 1) line.resize(size_t(std::max(columns - 1, 0)));
  std::fprintf(out_, "\r%s\033[K", line.c_str());
  std::fflush(out_);
  bar_visible_ = true;
}

void Progress::erase_bar() {
  if (!bar_visible_) return;
  std::fputs("\r\033[K", out_);
  bar_visible_ = false;
}

void Progress::print(const std::string& line) {
  if (mode_ == Mode::Silent) return;
  const bool redraw = bar_visible_;
  erase_bar();
  std::fprintf(out_, "%s\n", line.c_str());
  if (redraw && last_) draw_bar(*last_);
  std::fflush(out_);
}

void Progress::finish() {
  if (mode_ != Mode::Bar || !bar_visible_) return;
  std::fputs("\n", out_);
  std::fflush(out_);
  bar_visible_ = false;
}

// ------------------------------------------------------------------------------------------ MetricsLog
void MetricsLog::open(const std::filesystem::path& file, bool append) {
  close();
  path_ = file;
  error_.clear();
  lost_ = 0;
  std::error_code ec;
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path(), ec);
  fd_ = ::open(file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC), 0644);
  BOOSTER_CHECK(fd_ >= 0, ConfigError, "cannot write the metrics file '", file.string(), "': ", std::strerror(errno),
                "; set train.run_dir to a writable directory, or to null for no files");
  struct stat st {};
  good_bytes_ = ::fstat(fd_, &st) == 0 ? int64_t(st.st_size) : 0;
}

MetricsLog::~MetricsLog() { close(); }

void MetricsLog::close() {
  if (fd_ >= 0 && ::close(fd_) != 0 && error_.empty()) error_ = std::strerror(errno);
  fd_ = -1;
}

void MetricsLog::write(const nlohmann::json& record) {
  if (fd_ < 0) return;
  if (failed()) {
    ++lost_;
    return;
  }
  const std::string line = record.dump() + "\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n > 0) {
      done += size_t(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      error_ = n < 0 ? std::strerror(errno) : "the write made no progress";
      // Cut a partial record off, so the file stays whole lines (a resumed run appends to it).
      if (done > 0) {
        [[maybe_unused]] const int cut = ::ftruncate(fd_, good_bytes_);  // best effort
      }
      ++lost_;
      return;
    }
  }
  good_bytes_ += int64_t(line.size());
}

}  // namespace booster::trainer
