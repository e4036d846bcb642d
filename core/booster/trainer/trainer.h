// Trainer: the training loop of `booster train` as a library, over the parts a Booster boosted.
//
//   Booster booster(BoosterConfig{.mixed_precision = "bf16"});
//   booster.boost(model, optimizer, criterion, booster.prepare_dataloader(train_set, {.batch_size = 64,
//                 .shuffle = true}), scheduler);
//   Trainer trainer(booster, {.epochs = 3, .run_dir = "runs/mnist", .checkpoint_every = 500,
//                             .resume = "latest"});
//   trainer.set_eval_data(test_set);
//   FitResult result = trainer.fit();   // progress, metrics.jsonl, checkpoints, resume, Ctrl-C saves
//
// fit() runs epochs of the boosted dataloader with gradient accumulation (Note [Gradient accumulation]),
// clipping, a skipped step not moving the schedule, evaluation every eval_every steps (or after each
// epoch), a progress bar or log lines on stderr and metrics.jsonl in the run directory (Note [What
// booster train prints] in progress.h), checkpoints through Booster::save_state every checkpoint_every
// steps (Note [What a step's checkpoint holds]), and resumes bit for bit from one (TrainerOptions::resume).
// SIGINT and SIGTERM finish the step, save, print how to resume and end fit() with InterruptedError
// (Note [Stopping on a signal] in signals.h); one that came before the first step (while the run was
// starting) or during the last step's evaluation and save ends it too, before or after them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/common/error.h"
#include "booster/data/dataset.h"
#include "booster/diagnostics/doctor.h"  // SkippedStep, Tracer
#include "booster/trainer/async_save.h"
#include "booster/trainer/progress.h"

namespace booster {

// fit() stopped on SIGINT or SIGTERM after saving (when it had somewhere to save).
class InterruptedError : public Error {
 public:
  InterruptedError(int signal, const std::string& what, nlohmann::json summary = nullptr)
      : Error(what), signal_(signal), summary_(std::move(summary)) {}
  int signal() const { return signal_; }
  // The exit status a shell reports for a process the signal ended: 128 + signal.
  int exit_code() const { return 128 + signal_; }
  // What the run did until it stopped: FitResult::to_json() with "interrupted" set; null when fit()
  // did not throw it.
  const nlohmann::json& summary() const { return summary_; }

 private:
  int signal_;
  nlohmann::json summary_;
};

namespace trainer {

struct Evaluation {
  double loss = 0.0;      // mean over the evaluated targets
  double accuracy = 0.0;  // fraction of targets whose argmax over the last dim is right (classification)
  int64_t samples = 0;
  // exp(loss) of a language model's evaluation (TrainerOptions::perplexity; Note [Perplexity]).
  std::optional<double> perplexity;

  // As a summary reports it (Note [Perplexity]): test_loss, and test_accuracy for a classifier or
  // val_loss and val_ppl for a language model (whose next-token accuracy nobody asked for).
  nlohmann::json to_json() const;
  // One readable line: "val loss 2.1234 | val ppl 8.37 | 512 samples" for a language model, else
  // "test loss 0.4321 | test accuracy 85.20% | 10000 samples".
  std::string describe() const;
};

// Evaluates `model` on every `stride`-th item of `dataset` in eval mode under NoGradGuard, `batch_size`
// items at a time, on the model's device, and restores the model's training mode. The loss is the mean
// over the targets: each batch's mean weighs its target count, which with `ignore_index` (a criterion
// that skips those targets, as sft data's) counts only the others.
Evaluation evaluate(nn::Module& model, const data::Dataset& dataset, const nn::Criterion& criterion,
                    int64_t batch_size, int64_t stride = 1, std::optional<int64_t> ignore_index = std::nullopt);

// The precision a run trains in, as the start line, metrics.jsonl and the summary name it: the
// Booster's strategy ("bf16"), or, where the plugin controls precision, the plugin's own ("fp16
// (low_level_zero's own)": its "precision" option), not the identity strategy the Booster then holds.
std::string running_precision(Booster& booster);

// Where a loss-scaling run starts above float16's range (low_level_zero's 2^32): how its scale comes
// down and about how many of the first steps that skips, with the setting that starts it lower; ""
// when the scale starts within range. `scale` is the strategy's scale before the first step.
std::string loss_scale_warmup(Booster& booster, double scale);

}  // namespace trainer

// What fit() watches of the model's numbers (booster/diagnostics/tracer.h).
struct DiagnosticsOptions {
  // Every N steps, per-module range statistics of that step (forward outputs and the gradients flowing
  // back) as a {"kind": "diagnostics"} record in metrics.jsonl and to on_diagnostics hooks; 0: never.
  int64_t every = 0;
  // On a skipped step, name the first tensor that became inf/NaN (Note [The first non-finite tensor]),
  // on the progress output and as a {"kind": "skipped"} record in metrics.jsonl. Costs a finiteness
  // check of each module's output and gradients per step.
  bool name_nonfinite = true;
};

struct TrainerOptions {
  int64_t epochs = 1;
  std::optional<int64_t> max_steps;  // optimizer steps; caps epochs
  // Micro-batches per optimizer step (Note [Gradient accumulation] in trainer.cpp).
  int64_t grad_accumulation = 1;
  double max_grad_norm = 0.0;  // clip the gradients' joint L2 norm to this; 0: no clipping
  int64_t log_every = 10;      // a log line and a metrics record every N steps (and at the last)
  int64_t eval_every = 0;      // evaluate every N steps; 0: after each epoch. Always at the end.
  int64_t eval_batch_size = 256;
  // A directory for metrics.jsonl, config.json and checkpoints/; "{time}" in it becomes the start time
  // (UTC YYYYmmdd-HHMMSS, a -2, -3 suffix when taken). Null: no files. fit() holds `<run_dir>/lock`
  // (checkpoint::RootLock) while it runs, so a second run on the same directory is refused at once,
  // naming the holder, instead of both appending to one metrics.jsonl.
  std::optional<std::filesystem::path> run_dir;
  // Where checkpoints go; null: <run_dir>/checkpoints.
  std::optional<std::filesystem::path> checkpoint_dir;
  int64_t checkpoint_every = 0;  // save every N steps and at the end; 0: only when interrupted
  int keep_last = 0;             // checkpoints to keep; 0: all
  // "": start afresh; "latest": the newest checkpoint in the checkpoint directory (afresh when there is
  // none, so one command serves the first run and every restart); else a checkpoint directory.
  std::string resume;
  bool handle_signals = true;  // SIGINT/SIGTERM save and stop (Note [Stopping on a signal])
  // A failed write of metrics.jsonl (a full disk) stops the run with an IOError, before the next
  // checkpoint, so a resume rewrites the lost records (Note [Failed writes]); false: one warning, and
  // the run goes on without them.
  bool stop_on_write_error = true;
  // Save checkpoints in the background (Note [Asynchronous checkpoints] in trainer/async_save.h): the
  // step's state is snapshotted into host memory at the step and written and committed on a thread
  // while training goes on; on several processes rank 0 commits once every rank's write is done.
  bool async_checkpoint = false;
  // A failed background save stops the run (CheckpointError) instead of one warning per failure, the
  // run going on with `latest` at the previous step. A failed synchronous save always stops it, and so
  // does a failed last save of the run (Note [The run's last save] in trainer.cpp).
  bool stop_on_save_error = false;
  // Settings a resume must keep (Note [Settings a resume must keep] in booster/booster/state.cpp) and
  // how a refused resume is told to restore one.
  nlohmann::json resume_settings = nlohmann::json::object();
  LoadStateOptions load_options = [] {
    LoadStateOptions o;
    o.context = "Trainer resume";
    return o;
  }();
  // How to resume from a saved checkpoint, for the message of an interrupted run; default: the
  // TrainerOptions::resume to set.
  std::function<std::string(const std::filesystem::path& checkpoint)> resume_hint;
  // Written to <run_dir>/config.json when not null.
  nlohmann::json config;
  // A line about the data for the start of the log ("Fashion-MNIST: 60000 train, 10000 test").
  std::string data_description;
  // Tokens per sample (a language model's context) for a tokens/s figure; 1: none.
  int64_t tokens_per_sample = 1;
  // The eval data is next-token prediction: evaluations also report val_loss and val_ppl = exp(val_loss)
  // in metrics.jsonl, on the progress output and in the summary (Note [Perplexity] in trainer.cpp).
  bool perplexity = false;
  // The criterion skips targets equal to this (a cross-entropy's ignore_index; sft data marks its prompt
  // and padding -100): a step's loss is then the mean over the other targets of the whole global batch,
  // all micro-batches and data-parallel ranks together, whatever the split (Note [The token mean of a
  // global batch] in trainer.cpp); evaluations count those targets alike. Null: each micro-batch's loss
  // weighs the same (the mean of their means), as before.
  std::optional<int64_t> token_mean_ignore_index;
  DiagnosticsOptions diagnostics;
  // Progress display; default Progress::detect() (a bar on a terminal, lines otherwise, silent off rank 0).
  std::optional<trainer::Progress::Mode> progress;
};

// What fit() did; to_json() is the summary line `booster train` prints.
struct FitResult {
  int64_t steps = 0;
  // The last step's mean loss over the global batch (every rank's share; NaN before any step).
  double final_loss = 0.0;
  // The precision it trained in (trainer::running_precision); the summary's "mixed_precision".
  std::string precision;
  int64_t skipped_steps = 0;
  std::optional<double> final_loss_scale;  // strategies that scale the loss
  double seconds = 0.0;                     // the whole of fit()
  double train_seconds = 0.0;               // in training steps, without evaluation and saving
  double samples_per_second = 0.0;
  std::optional<double> tokens_per_second;
  std::optional<trainer::Evaluation> evaluation;  // the last one
  std::optional<std::filesystem::path> run_dir;
  std::optional<std::filesystem::path> resumed_from;
  std::optional<std::filesystem::path> last_checkpoint;
  // The signal that stopped the run ("SIGINT"), in the summary of an InterruptedError; "": none.
  std::string interrupted;
  // Each rank's peak of live tensor bytes over the run (rank order of the plugin's group) and, on
  // CUDA, of the caching allocator's reserved bytes: Note [Peak memory of a run] in trainer.cpp.
  std::vector<int64_t> peak_tensor_bytes, peak_reserved_bytes;
  nlohmann::json to_json() const;
};

// The steps a run of `epochs` epochs of `steps_per_epoch` optimizer steps takes, capped by max_steps.
// The product saturates at INT64_MAX: an "endless" epoch count (2^63 - 1 with a max_steps) must not wrap
// to a negative total, which would end the run before its first step.
int64_t planned_steps(int64_t epochs, int64_t steps_per_epoch, std::optional<int64_t> max_steps);

class Trainer {
 public:
  // Trains what `booster` boosted (Booster::boosted(): the model, optimizer and dataloader are needed, a
  // criterion too; the scheduler is optional). ConfigError for options out of range. Its position
  // (skipped steps, samples seen, last loss and evaluation) is registered with the Booster as state
  // "trainer" while it lives, so one Trainer at a time per Booster.
  Trainer(Booster& booster, TrainerOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The data evaluate() and fit() evaluate on: every `stride`-th item (overlapping text windows would
  // count a token `context` times; a stride of `context` counts it once).
  void set_eval_data(data::DatasetPtr dataset, int64_t stride = 1);

  // Called on rank 0 after every step with what the progress display shows, and after every evaluation.
  void on_step(std::function<void(const trainer::StepReport&)> hook) { step_hooks_.push_back(std::move(hook)); }
  void on_evaluation(std::function<void(int64_t step, const trainer::Evaluation&)> hook) {
    eval_hooks_.push_back(std::move(hook));
  }

  // Called after every statistics step (DiagnosticsOptions::every) with the step and the tracer holding
  // that step's statistics (on every rank: each has its own).
  void on_diagnostics(std::function<void(int64_t step, const diagnostics::Tracer&)> hook) {
    diagnostics_hooks_.push_back(std::move(hook));
  }
  // The steps fit() skipped in this process's run, with the first non-finite tensor of each when
  // DiagnosticsOptions::name_nonfinite.
  const std::vector<diagnostics::SkippedStep>& skipped_steps() const { return skipped_; }

  // Trains to the end (or resumes and trains to the end). InterruptedError after a signal; TrainingError
  // when the loss stops being finite.
  FitResult fit();
  // Evaluates the model on the eval data (StateError without).
  trainer::Evaluation evaluate();

  // epochs x optimizer steps per epoch, capped by max_steps.
  int64_t total_steps() const { return total_steps_; }

 private:
  struct Position {
    int64_t skipped_steps = 0;
    int64_t samples_seen = 0;
    nlohmann::json loss;        // the last step's mean loss (null when not finite)
    nlohmann::json evaluation;  // the last evaluation
  };
  void run_evaluation(int64_t step);
  // A skipped step's line on the progress output and record in metrics.jsonl.
  void report_skipped_step(int64_t step, const diagnostics::Tracer* tracer);
  // Saves `step`; returns the newest committed checkpoint (an asynchronous save commits later: then
  // `last`, or a background save that finished meanwhile).
  std::optional<std::filesystem::path> save(int64_t step, std::optional<std::filesystem::path> last);
  // Reports the background save (Note [Asynchronous checkpoints]) if it has finished (or, with `wait`,
  // once it has), moving `last` to it when it committed; CheckpointError for a failure with
  // stop_on_save_error, or for a failure of the run's last save (`run_end`: Note [The run's last save]).
  void collect_async_save(std::optional<std::filesystem::path>& last, bool wait, bool run_end = false);
  // After a failed save: where the run stands (`last`, its newest committed checkpoint) and how to go on.
  std::string where_to_resume(const std::optional<std::filesystem::path>& last) const;
  // Note [Failed writes] in trainer.cpp.
  void check_writes(int64_t step, const std::optional<std::filesystem::path>& last_checkpoint);

  Booster& booster_;
  TrainerOptions options_;
  int64_t total_steps_ = 0;
  std::optional<std::filesystem::path> run_dir_;
  std::optional<std::filesystem::path> checkpoint_root_;
  data::DatasetPtr eval_data_;
  int64_t eval_stride_ = 1;
  Position position_;
  std::vector<std::function<void(const trainer::StepReport&)>> step_hooks_;
  std::vector<std::function<void(int64_t, const trainer::Evaluation&)>> eval_hooks_;
  std::vector<std::function<void(int64_t, const diagnostics::Tracer&)>> diagnostics_hooks_;
  std::vector<diagnostics::SkippedStep> skipped_;
  // While fit() runs.
  trainer::Progress* progress_ = nullptr;
  trainer::MetricsLog metrics_;
  bool write_failure_reported_ = false;
  double run_start_ = 0.0;
  bool is_rank0_ = true;
  bool abandoned_cycle_ = false;  // the last fit() stopped with an error in mid accumulation cycle
  std::unique_ptr<trainer::AsyncSave> async_save_;  // while fit() runs with async_checkpoint
  double async_snapshot_seconds_ = 0.0;             // the step's stall for the save in flight
};

}  // namespace booster
