// What a training run shows while it runs (the Trainer, so `booster train` too): a progress bar or log
// lines on stderr, and the metrics file.
//
// Note [What booster train prints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// * stderr is for people. On a terminal (isatty) one status line is redrawn in place (carriage return +
//   erase-line), at most ten times a second and at every logged step:
//     step 120/1000 [#####.........]  12% ETA 1m23s | loss 0.4321 | 5.3k samples/s | scale 65536 | skipped 2
//   cut at the terminal's width (a wrapped line could not be redrawn in place).
//   Anything else (the model summary, evaluations) is printed above it: the bar is erased, the line
//   written, the bar redrawn. Not on a terminal (a pipe, a CI log, a file), every `train.log_every`-th
//   step is one plain line that scripts may parse:
//     step    120/1000 | epoch 1 | loss 0.4321 | lr 0.001 | scale 65536 | skipped 2 | 5300 samples/s | ETA 1m23s
//   (scale and skipped only for strategies that scale the loss).
// * Under several processes only rank 0 prints; the others stay silent, so N ranks do not print N bars.
//   The rank comes from the default process group when it exists, else from the launcher's environment
//   (OMPI_COMM_WORLD_RANK, PMI_RANK, torchrun's RANK), so it is known before any group is made.
// * stdout is for programs: its last line is the run's summary as one JSON object.
// * The run directory (`train.run_dir`) holds metrics.jsonl, one JSON object per line (MetricsLog):
//     {"kind": "train", "step", "epoch", "loss", "lr", "loss_scale", "skipped", "samples_per_second", "time",
//      "precision"}
//     {"kind": "eval", "step", "test_loss", "test_accuracy", "samples", "time"} (and "val_loss", "val_ppl"
//       for a language model: Note [Perplexity] in trainer.cpp)
//     {"kind": "skipped", "step", "loss_scale", "first_nonfinite": {"module", "type", "pass", "tensor"} | null}
//     {"kind": "diagnostics", "step", "loss_scale", "modules": [per-module statistics]}
//   for every logged step, every evaluation, every skipped step (TrainerOptions::diagnostics.name_nonfinite)
//   and every diagnostics.every-th step; `time` is seconds since the run started; `precision` is the
//   one the step ran in (FitResult::precision: "fp16 (low_level_zero's own)" where a plugin controls it).
//   `booster plot` draws the "train" lines.
// * The loss of the log lines, the bar, the "train" records and the summary's final_loss is the mean
//   over the global batch, every rank's share, not rank 0's (Note [The loss of a data-parallel step] in
//   trainer.cpp): the same run logs the same curve at any number of processes. Under several processes
//   it is averaged at logged steps only; the bar between them shows the last logged step's.
// * The start line names the precision that runs, and a loss scale that starts above float16's range
//   (low_level_zero's 2^32) gets a line of its own saying how many of the first steps it may skip.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace booster::trainer {

// This process's rank among the processes of the run (0 when it runs alone); see Note [What booster
// train prints].
int process_rank();

// "1h02m", "3m05s", "42s": a duration for people.
std::string human_duration(double seconds);
// "1.25M", "5.3k", "812": a count or rate for people.
std::string human_count(double n);

// One training step as the progress display and the metrics file see it.
struct StepReport {
  int64_t step = 0;         // steps done, 1-based
  int64_t total_steps = 0;
  int64_t epoch = 0;        // 1-based
  // The mean loss of the global batch (every rank's share: Note [The loss of a data-parallel step] in
  // trainer.cpp) of step `loss_step`: this step, except between logged steps of a run over several
  // processes, where it is the last logged step's (0: none yet, loss NaN).
  double loss = 0.0;
  int64_t loss_step = 0;
  double lr = 0.0;          // the lr this step used
  std::optional<double> loss_scale;  // only for strategies that scale the loss
  int64_t skipped = 0;      // skipped steps so far
  double samples_per_second = 0.0;
  double seconds = 0.0;     // since the run started
  double eta_seconds = 0.0;
};

// The status bar or the log lines on stderr (Note [What booster train prints]).
class Progress {
 public:
  enum class Mode { Bar, Lines, Silent };
  // Silent off rank 0, Bar when stderr is a terminal, else Lines. BOOSTER_PROGRESS=bar|lines|none
  // overrides (a bar in a terminal multiplexer that is not a tty, or no output at all).
  static Mode detect();

  explicit Progress(Mode mode, FILE* out = stderr);
  ~Progress();  // ends the bar's line
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Called after every step; `logged` says this step is a log_every step (a line in Lines mode, a
  // forced redraw in Bar mode).
  void update(const StepReport& report, bool logged);
  // A line of its own (model summary, evaluation result), above the bar.
  void print(const std::string& line);
  // Ends the bar's line, so what follows starts on a fresh one.
  void finish();

  Mode mode() const { return mode_; }

 private:
  void draw_bar(const StepReport& report);
  void erase_bar();

  Mode mode_;
  FILE* out_;
  bool bar_visible_ = false;
  std::optional<StepReport> last_;
  std::chrono::steady_clock::time_point last_draw_{};
};

// metrics.jsonl in the run directory: one JSON object per line, written through per line so a crashed
// or running run can still be read (and plotted). A default-constructed log writes nothing. A write
// that fails (a full disk) is never torn into the file: the partial line is cut off again, the failure
// is kept (failed(), error()) and later records are counted as lost, for the caller to report (Note
// [Failed writes] in trainer.cpp).
class MetricsLog {
 public:
  MetricsLog() = default;
  ~MetricsLog();
  // Creates the directory if needed and truncates the file (or appends to it: a resumed run);
  // ConfigError naming it when it cannot.
  void open(const std::filesystem::path& file, bool append = false);
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void write(const nlohmann::json& record);
  void close();
  bool enabled() const { return fd_ >= 0; }
  const std::filesystem::path& path() const { return path_; }
  bool failed() const { return !error_.empty(); }
  const std::string& error() const { return error_; }  // the first failure: the system's reason
  int64_t lost_records() const { return lost_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  int64_t good_bytes_ = 0;  // the file's length after the last whole record
  std::string error_;
  int64_t lost_ = 0;
};

inline constexpr const char* kMetricsFileName = "metrics.jsonl";

}  // namespace booster::trainer
