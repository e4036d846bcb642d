// The Trainer (trainer.h): fit() over the boosted parts, with logging, evaluation, checkpoints, resume
// and signals.
#include "booster/trainer/trainer.h"

#include <algorithm>
#include <limits>
#include <exception>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>

#include "booster/autograd/autograd.h"
#include "booster/booster/reproducible.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/common/json_text.h"
#include "booster/common/threads.h"
#include "booster/data/dataloader.h"
#include "booster/distributed/flight_recorder.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/loss.h"
#include "booster/ops/ops.h"
#include "booster/tensor/memory_stats.h"
#include "booster/trainer/signals.h"

namespace booster {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double now_seconds() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

// A test hook for `booster run --max-restarts` (cli/run.cpp): BOOSTER_TEST_KILL_AT_STEP=S[:FILE] makes
// the group's last rank SIGKILL itself once step S is done, before it is saved, as a lost node would;
// with :FILE only while FILE does not exist (it is created first), so a restarted job goes on.
void kill_here_if_testing(int64_t step, distributed::ProcessGroup& group) {
  const char* hook = std::getenv("BOOSTER_TEST_KILL_AT_STEP");
  if (!hook || !*hook || group.rank() != group.size() - 1) return;
  const std::string spec = hook;
  const size_t colon = spec.find(':');
  if (std::atoll(spec.substr(0, colon).c_str()) != step) return;
  if (colon != std::string::npos) {
    const std::string file = spec.substr(colon + 1);
    if (fs::exists(file)) return;
    std::ofstream(file) << step << "\n";
  }
  std::raise(SIGKILL);
}

template <class... Values>
std::string format_line(const char* format, Values... values) {
  char buf[512];
  std::snprintf(buf, sizeof buf, format, values...);
  return buf;
}

// The run directory with {time} filled in; every rank gets rank 0's answer, so the files of several
// processes go to one place.
fs::path resolve_run_dir(std::string dir, distributed::ProcessGroup& group) {
  const size_t at = dir.find("{time}");
  if (at == std::string::npos) return dir;
  std::string chosen;
  if (group.rank() == 0) {
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    gmtime_r(&now, &utc);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &utc);
    dir.replace(at, 6, stamp);
    // Two runs started in the same second get their own directories.
    chosen = dir;
    for (int n = 2; fs::exists(chosen); ++n) chosen = dir + "-" + std::to_string(n);
  }
  if (group.size() > 1) {
    // The length, then the bytes, one per int64 (the names are short).
    Tensor length = full({1}, double(chosen.size()), DType::Int64, group.device());
    group.broadcast(length, 0);
    const int64_t n = length.cpu().contiguous().data<int64_t>()[0];
    std::vector<float> bytes(size_t(n), 0.0f);
    for (size_t i = 0; i < chosen.size(); ++i) bytes[i] = float(static_cast<unsigned char>(chosen[i]));
    Tensor text = from_vector(bytes, {n}).to(DType::Int64).to(group.device());
    group.broadcast(text, 0);
    const Tensor host = text.cpu().contiguous();
    const int64_t* data = host.data<int64_t>();
    chosen.assign(size_t(n), ' ');
    for (int64_t i = 0; i < n; ++i) chosen[size_t(i)] = char(data[i]);
  }
  return chosen;
}

// A resumed run continues its metrics file: the records after the checkpoint's step (written by the
// interrupted run after its last checkpoint) are dropped, so each step appears once (Note [What a
// step's checkpoint holds]), and so is a torn last line (a crash mid-write). Other lines that are not
// records mean the file is not what this run wrote: it is kept aside, with a warning, not discarded.
// A file that is missing, or whose "train" records stop short of the last step up to `step` that
// logged one (every `log_every`), lost records the run cannot write again: one warning says so, and the
// run appends its new records from step + 1. A run directory made new for this run ({time} in run_dir)
// has no file to continue: the earlier records are in the earlier run's directory, which one line says.
void truncate_metrics_after(const fs::path& file, int64_t step, int64_t log_every, bool new_run_dir,
                            trainer::Progress& progress) {
  const int64_t last_logged = log_every > 0 ? step / log_every * log_every : 0;
  if (new_run_dir && !fs::exists(file)) {
    progress.print("booster: resuming from step " + std::to_string(step) + " in the new run directory " +
                   file.parent_path().string() + " ({time} in train.run_dir): its " + file.filename().string() +
                   " starts at step " + std::to_string(step + 1) + ", the earlier records stay in the earlier run's");
    return;
  }
  if (!fs::exists(file)) {
    progress.print("booster: warning: " + file.string() + " is missing at the resume from step " +
                   std::to_string(step) + "; the records before that step are gone, and new records append from step " +
                   std::to_string(step + 1));
    return;
  }
  std::ifstream in(file);
  std::string kept, line;
  std::vector<std::string> lines;
  while (std::getline(in, line)) lines.push_back(std::move(line));
  in.close();
  int64_t unreadable = 0;
  int64_t last_train = 0;  // the last "train" record kept
  for (size_t i = 0; i < lines.size(); ++i) {
    // Note [One JSON reader] (booster/common/json_text.h): a line nested past its depth is not a record.
    const json record = try_parse_json_text(lines[i], data_limits(lines[i].size(), "a line of the file"));
    if (!record.is_object() || !record.contains("step")) {
      if (i + 1 < lines.size() || lines[i].empty() || lines[i].front() != '{') ++unreadable;
      continue;
    }
    if (record.value("step", int64_t(0)) > step) continue;
    if (record.value("kind", json()) == "train") last_train = std::max(last_train, record.value("step", int64_t(0)));
    kept += lines[i] + "\n";
  }
  if (last_train < last_logged)
    progress.print("booster: warning: " + file.string() + " holds records up to step " + std::to_string(last_train) +
                   ", short of step " + std::to_string(last_logged) + " that the resume from step " +
                   std::to_string(step) + " implies; those records are gone, and new records append from step " +
                   std::to_string(step + 1));
  if (unreadable > 0) {
    const fs::path aside = file.string() + ".unreadable";
    std::error_code ec;
    fs::copy_file(file, aside, fs::copy_options::overwrite_existing, ec);
    progress.print("booster: warning: " + std::to_string(unreadable) + " line(s) of " + file.string() +
                   " are not metrics records; the file is kept as " + aside.string() +
                   (ec ? " (the copy failed: " + ec.message() + ")" : std::string()) +
                   " and the run continues the records it can read");
    BOOSTER_CHECK(!ec, IOError, "cannot keep the unreadable ", file.string(), " aside as ", aside.string(), ": ",
                  ec.message(), "; move it away yourself and resume again");
  }
  checkpoint::write_text_file_atomically(file, kept);
}

// Note [Perplexity]
// ~~~~~~~~~~~~~~~~~
// A language model's evaluation is also reported as nanoGPT and llm.c report it: val_loss, the mean
// cross-entropy per target token (the same number as test_loss, which every evaluation record keeps so
// that one reader serves all data), and val_ppl = exp(val_loss), the perplexity. It is a perplexity in
// the strict sense only for the plain loss: with label smoothing the criterion is not the negative
// log-likelihood, and the figure is exp of what the criterion measured.
json evaluation_json(const trainer::Evaluation& e, int64_t step) {
  json out = {{"step", step}, {"test_loss", e.loss}, {"test_accuracy", e.accuracy}, {"samples", e.samples}};
  if (e.perplexity) {
    out["val_loss"] = e.loss;
    out["val_ppl"] = *e.perplexity;
  }
  return out;
}

}  // namespace

// ------------------------------------------------------------------------------------ evaluation
trainer::Evaluation trainer::evaluate(nn::Module& model, const data::Dataset& dataset, const nn::Criterion& criterion,
                                      int64_t batch_size, int64_t stride, std::optional<int64_t> ignore_index) {
  BOOSTER_CHECK(batch_size > 0 && stride > 0, ValueError, "evaluate: batch_size (", batch_size, ") and stride (",
                stride, ") must be positive");
  const std::vector<Tensor> params = model.parameters();
  const Device device = params.empty() ? Device::cpu() : params.front().device();
  const bool was_training = model.is_training();
  model.eval();
  autograd::NoGradGuard no_grad;

  double loss_sum = 0.0;
  int64_t correct = 0, targets = 0, samples = 0;
  const int64_t n = dataset.size();
  std::vector<int64_t> indices;
  for (int64_t begin = 0; begin < n; begin += batch_size * stride) {
    indices.clear();
    for (int64_t i = begin; i < n && int64_t(indices.size()) < batch_size; i += stride) indices.push_back(i);
    data::Batch batch = dataset.get_batch(indices);
    Tensor output = model(batch.x.to(device));
    const int64_t batch_targets = batch.y.numel();
    const int64_t counted = ignore_index ? nn::count_targets(batch.y, *ignore_index) : batch_targets;
    if (counted > 0) loss_sum += criterion(output, batch.y.to(device)).item() * double(counted);
    if (!is_floating(batch.y.dtype())) {
      Tensor predicted = argmax(output, -1).cpu().contiguous();
      Tensor truth = batch.y.to(DType::Int64).contiguous();
      const int64_t* p = predicted.data<int64_t>();
      const int64_t* t = truth.data<int64_t>();
      for (int64_t i = 0; i < batch_targets; ++i) correct += p[i] == t[i] && (!ignore_index || t[i] != *ignore_index);
    }
    targets += counted;
    samples += int64_t(indices.size());
  }
  model.train(was_training);

  Evaluation e;
  e.samples = samples;
  e.loss = targets ? loss_sum / double(targets) : 0.0;
  e.accuracy = targets ? double(correct) / double(targets) : 0.0;
  return e;
}

json trainer::Evaluation::to_json() const {
  json out = {{"test_loss", loss}};
  if (perplexity) {  // Note [Perplexity]
    out["val_loss"] = loss;
    out["val_ppl"] = *perplexity;
  } else {
    out["test_accuracy"] = accuracy;
  }
  return out;
}

std::string trainer::Evaluation::describe() const {
  if (perplexity)
    return format_line("val loss %.4f | val ppl %.2f | %lld samples", loss, *perplexity, static_cast<long long>(samples));
  return format_line("test loss %.4f | test accuracy %.2f%% | %lld samples", loss, 100.0 * accuracy,
                     static_cast<long long>(samples));
}

std::string trainer::running_precision(Booster& booster) {
  ParallelPlugin& plugin = booster.plugin();
  if (!plugin.control_precision()) return booster.config().mixed_precision;
  const json options = plugin.options();
  if (options.is_object() && options.contains("precision") && options.at("precision").is_string())
    return options.at("precision").get<std::string>() + " (" + plugin.name() + "'s own)";
  return plugin.name() + "'s own";
}

// Note [The loss scale's warm-up]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// float16 ends at 65504, so a gradient of order 1 scaled by 2^16 or more overflows and its step is
// skipped. A dynamic scale that starts higher (low_level_zero's and ColossalAI's 2^32) comes down by
// backoff_factor per overflowing step (after hysteresis - 1 overflows it forgives), so about
// log(scale / 2^16) / log(1 / backoff_factor) + hysteresis - 1 of the first steps are skipped before
// one trains: 17 from 2^32, where a short run skips every step and looks as if it does not learn. The
// start of the run says so, with the setting that starts lower. Smaller gradients overflow later (the
// estimate is "~"); a constant scale (apex's static loss_scale) never comes down and is not a warm-up.
std::string trainer::loss_scale_warmup(Booster& booster, double scale) {
  constexpr double kFloat16Range = 65536.0;  // 2^16: the first power of two past float16's 65504
  if (!std::isfinite(scale) || !(scale > kFloat16Range)) return "";
  ParallelPlugin& plugin = booster.plugin();
  const bool own = plugin.control_precision();
  const json options = own ? plugin.options() : booster.precision().options();
  if (!options.is_object()) return "";
  std::string key;
  for (const char* k : {"initial_scale", "init_scale"})
    if (options.contains(k)) key = k;
  if (key.empty()) return "";  // no dynamic scale of a known kind
  const double backoff = options.value("backoff_factor", 0.5);
  if (!(backoff > 0.0 && backoff < 1.0)) return "";
  const int64_t hysteresis = std::max<int64_t>(options.value("hysteresis", int64_t(1)), 1);
  const int64_t steps =
      int64_t(std::ceil(std::log(scale / kFloat16Range) / std::log(1.0 / backoff) - 1e-9)) + hysteresis - 1;
  int exponent = 0;
  const bool power_of_two = std::frexp(scale, &exponent) == 0.5;
  const std::string start = power_of_two ? "2^" + std::to_string(exponent - 1) : format_line("%g", scale);
  const std::string change = backoff == 0.5 ? std::string("halves") : format_line("is multiplied by %g", backoff);
  const std::string forgiven = hysteresis > 1 ? " after the first " + std::to_string(hysteresis - 1) +
                                                    " (hysteresis " + std::to_string(hysteresis) + ")"
                                              : std::string();
  return "the loss scale starts at " + start + " and " + change + " on each overflowing step" + forgiven +
         ": the first ~" + std::to_string(steps) + " steps may be skipped; set " + (own ? "plugin." : "mixed_precision.") +
         key + " to start lower (torch's GradScaler starts at 65536)";
}

// Note [Peak memory of a run]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// fit() resets the peak of live tensor bytes of the model's device type as it starts, so the figure is
// the high-water mark over the run: what was live at its start (the parameters, a resumed optimizer's
// state) plus the most the steps, evaluations and saves added at once. Each "train" record holds the
// peak so far, the summary the peak at the run's end; on CUDA also the caching allocator's reserved
// peak (cudaMalloc'd bytes, in use or cached). The allocators count per process, with atomics they
// already update on every allocation, so reading costs nothing on the allocation path. Under several
// ranks each rank's figures are gathered by one float64 all-reduce of a vector in which each rank fills
// its own slots (zeros elsewhere; exact up to 2^53 bytes), at each logged step, which every rank reaches
// together, and at the run's end: records and summary hold the ranks' max as peak_tensor_bytes and
// every rank's as peak_tensor_bytes_per_rank. Ranks that are threads of one process share its counters.
namespace {

struct PeakMemory {
  std::vector<int64_t> tensor, reserved;  // per rank; reserved only on CUDA
};

PeakMemory gather_peak_memory(distributed::ProcessGroup& group, DeviceType type) {
  const MemoryStats m = memory_stats(type);
  const int n = group.size();
  PeakMemory out;
  if (n == 1) {
    out.tensor = {m.peak};
    if (type == DeviceType::CUDA) out.reserved = {m.peak_reserved};
    return out;
  }
  Tensor mine = full({2 * int64_t(n)}, 0.0, DType::Float64, Device::cpu());
  mine.data<double>()[2 * group.rank()] = double(m.peak);
  mine.data<double>()[2 * group.rank() + 1] = double(m.peak_reserved);
  Tensor all = mine.to(group.device());
  group.all_reduce(all);
  const Tensor back = all.cpu().contiguous();
  for (int r = 0; r < n; ++r) {
    out.tensor.push_back(int64_t(back.data<double>()[2 * r]));
    if (type == DeviceType::CUDA) out.reserved.push_back(int64_t(back.data<double>()[2 * r + 1]));
  }
  return out;
}

void put_peak(json& out, const char* key, const std::vector<int64_t>& per_rank) {
  if (per_rank.empty()) return;
  out[key] = *std::max_element(per_rank.begin(), per_rank.end());
  if (per_rank.size() > 1) out[std::string(key) + "_per_rank"] = per_rank;
}

void put_peak_memory(json& out, const std::vector<int64_t>& tensor, const std::vector<int64_t>& reserved) {
  put_peak(out, "peak_tensor_bytes", tensor);
  put_peak(out, "peak_reserved_bytes", reserved);
}

}  // namespace

json FitResult::to_json() const {
  json out = json::object();
  out["final_loss"] = final_loss;
  if (!precision.empty()) out["mixed_precision"] = precision;
  out["steps"] = steps;
  out["skipped_steps"] = skipped_steps;
  out["final_loss_scale"] = final_loss_scale ? json(*final_loss_scale) : json(nullptr);
  out["seconds"] = seconds;
  out["train_seconds"] = train_seconds;
  out["samples_per_second"] = samples_per_second;
  if (tokens_per_second) out["tokens_per_second"] = *tokens_per_second;
  if (evaluation) out.update(evaluation->to_json());
  out["run_dir"] = run_dir ? json(run_dir->string()) : json(nullptr);
  out["resumed_from"] = resumed_from ? json(resumed_from->string()) : json(nullptr);
  put_peak_memory(out, peak_tensor_bytes, peak_reserved_bytes);
  if (!interrupted.empty()) {
    out["interrupted"] = interrupted;
    out["last_checkpoint"] = last_checkpoint ? json(last_checkpoint->string()) : json(nullptr);
  }
  return out;
}

// ------------------------------------------------------------------------------------------ Trainer
int64_t planned_steps(int64_t epochs, int64_t steps_per_epoch, std::optional<int64_t> max_steps) {
  int64_t total = std::numeric_limits<int64_t>::max();
  if (epochs > 0 && steps_per_epoch > 0 && epochs <= total / steps_per_epoch) total = epochs * steps_per_epoch;
  else if (epochs <= 0 || steps_per_epoch <= 0) total = 0;
  return max_steps ? std::min(total, *max_steps) : total;
}

Trainer::Trainer(Booster& booster, TrainerOptions options) : booster_(booster), options_(std::move(options)) {
  const Boosted& parts = booster_.boosted();
  BOOSTER_CHECK(parts.model && parts.optimizer && parts.dataloader && parts.criterion, StateError,
                "Trainer: boost() the model with an optimizer, a criterion and a dataloader first (missing: ",
                !parts.model ? "model" : !parts.optimizer ? "optimizer" : !parts.criterion ? "criterion" : "dataloader",
                ")");
  const TrainerOptions& o = options_;
  BOOSTER_CHECK(o.epochs >= 1, ConfigError, "Trainer: epochs is ", o.epochs, "; it must be >= 1");
  BOOSTER_CHECK(!o.max_steps || *o.max_steps >= 1, ConfigError, "Trainer: max_steps is ", o.max_steps.value_or(0),
                "; it must be >= 1 (or unset)");
  BOOSTER_CHECK(o.grad_accumulation >= 1, ConfigError, "Trainer: grad_accumulation is ", o.grad_accumulation,
                "; it must be >= 1");
  BOOSTER_CHECK(o.max_grad_norm >= 0.0, ConfigError, "Trainer: max_grad_norm is ", o.max_grad_norm,
                "; it must be >= 0 (0: no clipping)");
  BOOSTER_CHECK(o.log_every >= 1 && o.eval_every >= 0 && o.checkpoint_every >= 0 && o.keep_last >= 0 &&
                    o.eval_batch_size >= 1,
                ConfigError, "Trainer: log_every (", o.log_every, ") and eval_batch_size (", o.eval_batch_size,
                ") must be >= 1, eval_every (", o.eval_every, "), checkpoint_every (", o.checkpoint_every,
                ") and keep_last (", o.keep_last, ") >= 0");
  BOOSTER_CHECK(o.diagnostics.every >= 0, ConfigError, "Trainer: diagnostics.every is ", o.diagnostics.every,
                "; it must be >= 0 (0: no per-module statistics)");
  BOOSTER_CHECK(o.checkpoint_every == 0 || o.run_dir || o.checkpoint_dir, ConfigError, "Trainer: checkpoint_every is ",
                o.checkpoint_every, " but there is no run_dir or checkpoint_dir to save into; set one");
  BOOSTER_CHECK(o.resume != "latest" || o.run_dir || o.checkpoint_dir, ConfigError,
                "Trainer: resume \"latest\" looks in the checkpoint directory, but there is no run_dir or checkpoint_dir");

  data::DataLoader& loader = *parts.dataloader;
  BOOSTER_CHECK(loader.size() > 0, ConfigError, "Trainer: the dataloader has no batch (", loader.num_samples(),
                " items for this process, batch_size ", loader.options().batch_size,
                loader.options().drop_last ? " with drop_last" : "", ")");
  BOOSTER_CHECK(loader.size() >= o.grad_accumulation, ConfigError, "Trainer: grad_accumulation is ",
                o.grad_accumulation, " but an epoch has only ", loader.size(),
                " batches for this process; lower it or the batch size");
  total_steps_ = planned_steps(o.epochs, loader.size() / o.grad_accumulation, o.max_steps);

  distributed::ProcessGroup& group = booster_.process_group();
  is_rank0_ = group.size() > 1 ? group.rank() == 0 : trainer::process_rank() == 0;
  // Note [Reproducible training across world sizes] (booster/booster/reproducible.h): every step's global
  // batch must cut into the chunks at this world size, and what cannot keep the sums in order is refused.
  if (booster_.config().reproducible) {
    BOOSTER_CHECK(!o.token_mean_ignore_index, ConfigError, "Trainer: reproducible training does not take the token "
                  "mean of a global batch (sft data) yet; turn train.reproducible off for this data");
    BOOSTER_CHECK(loader.options().drop_last || loader.num_samples() % loader.options().batch_size == 0, ConfigError,
                  "Trainer: reproducible training needs every batch full, but ", loader.num_samples(),
                  " items for this process leave a short last batch of ", loader.options().batch_size,
                  "; set data.drop_last");
    reproducible::check_layout(booster_.plugin().name(), booster_.plugin().layout(), booster_.plugin().options(),
                               booster_.config().mixed_precision, o.max_grad_norm > 0.0);
    booster_.reproducible_chunks(loader.options().batch_size * o.grad_accumulation * int64_t(group.size()));
  }
  if (o.run_dir) run_dir_ = resolve_run_dir(o.run_dir->string(), group);
  // Note [Flight recorder]: a collective timeout or a crash leaves <run_dir>/flight/rank-N.json.
  if (run_dir_) distributed::set_flight_dump_dir(*run_dir_ / "flight");
  if (o.checkpoint_dir) checkpoint_root_ = *o.checkpoint_dir;
  else if (run_dir_) checkpoint_root_ = *run_dir_ / "checkpoints";

  // The Trainer's own position travels with the Booster's state.
  booster_.register_state(
      "trainer",
      [this] {
        return json{{"skipped_steps", position_.skipped_steps},
                    {"samples_seen", position_.samples_seen},
                    {"loss", position_.loss},
                    {"evaluation", position_.evaluation}};
      },
      [this](const json& saved) {
        try {
          position_.skipped_steps = saved.at("skipped_steps").get<int64_t>();
          position_.samples_seen = saved.at("samples_seen").get<int64_t>();
          position_.loss = saved.value("loss", json());
          position_.evaluation = saved.value("evaluation", json());
        } catch (const json::exception& e) {
          BOOSTER_FAIL(CheckpointError, "Trainer resume: the trainer state is malformed (", e.what(), ")");
        }
      });
  booster_.set_resume_settings(o.resume_settings);
}

// The registered "trainer" state points at this Trainer: the Booster may outlive it.
Trainer::~Trainer() { booster_.unregister_state("trainer"); }

void Trainer::set_eval_data(data::DatasetPtr dataset, int64_t stride) {
  BOOSTER_CHECK(stride >= 1, ValueError, "Trainer::set_eval_data: stride is ", stride, "; it must be >= 1");
  eval_data_ = std::move(dataset);
  eval_stride_ = stride;
}

trainer::Evaluation Trainer::evaluate() {
  BOOSTER_CHECK(eval_data_ != nullptr, StateError, "Trainer::evaluate: no eval data; call set_eval_data first");
  const Boosted& parts = booster_.boosted();
  trainer::Evaluation e =
      trainer::evaluate(*parts.model, *eval_data_, parts.criterion, options_.eval_batch_size, eval_stride_,
                        options_.token_mean_ignore_index);
  if (options_.perplexity) e.perplexity = std::exp(e.loss);
  return e;
}

void Trainer::report_skipped_step(int64_t step, const diagnostics::Tracer* tracer) {
  diagnostics::SkippedStep skipped;
  skipped.step = step;
  skipped.loss_scale = booster_.precision().loss_scale();
  if (tracer && options_.diagnostics.name_nonfinite) skipped.first_nonfinite = tracer->first_nonfinite();
  skipped_.push_back(skipped);
  if (!options_.diagnostics.name_nonfinite) return;
  progress_->print(format_line("step %6lld skipped (inf/NaN gradients; loss scale now %g): ", static_cast<long long>(step),
                               skipped.loss_scale) +
                   (skipped.first_nonfinite ? "first non-finite: " + skipped.first_nonfinite->describe()
                                            : std::string("no traced tensor of this rank was non-finite")));
  nlohmann::json record = skipped.to_json();
  record["kind"] = "skipped";
  metrics_.write(record);
}

void Trainer::run_evaluation(int64_t step) {
  if (!eval_data_) return;
  const double t0 = now_seconds();
  const trainer::Evaluation result = evaluate();
  progress_->print(format_line("eval  step %6lld | ", static_cast<long long>(step)) + result.describe() +
                   format_line(" in %.2fs", now_seconds() - t0));
  position_.evaluation = evaluation_json(result, step);
  json record = {{"kind", "eval"}};
  record.update(position_.evaluation);
  record["time"] = now_seconds() - run_start_;
  metrics_.write(record);
  if (is_rank0_)
    for (const auto& hook : eval_hooks_) hook(step, result);
}

// Note [Failed writes]
// ~~~~~~~~~~~~~~~~~~~~
// A record of metrics.jsonl that cannot be written (ENOSPC, EIO, a quota) is data the run promised and
// lost. By default the run stops at the end of that step with an IOError naming the file, the reason
// and the last checkpoint, and does not save: resuming from the last checkpoint trains the steps after
// it again and rewrites their records (a resume drops the records after the checkpoint's step), so
// nothing is lost once space is freed. Saving now instead would put the checkpoint past the lost
// records for good. TrainerOptions::stop_on_write_error = false (train.on_write_error "warn") prints
// one warning and goes on without the records.
void Trainer::check_writes(int64_t step, const std::optional<fs::path>& last_checkpoint) {
  if (!metrics_.failed() || write_failure_reported_) return;
  write_failure_reported_ = true;
  const std::string what = "cannot write " + metrics_.path().string() + " at step " + std::to_string(step) + " (" +
                           metrics_.error() + ")";
  if (!options_.stop_on_write_error) {
    progress_->print("booster: warning: " + what + "; going on without metrics records (train.on_write_error is "
                     "\"warn\")");
    return;
  }
  const std::string resume =
      last_checkpoint ? "the last checkpoint, " + last_checkpoint->string() + ", resumes the run and rewrites them" +
                            (options_.resume_hint ? " (" + options_.resume_hint(*last_checkpoint) + ")" : std::string())
                      : std::string("no checkpoint was saved in this run");
  throw IOError(what + "; the run stops without saving so no record is lost: " + resume +
                " once there is space; or set train.on_write_error to \"warn\" to go on without the records");
}

std::string Trainer::where_to_resume(const std::optional<fs::path>& last) const {
  if (!last) return "no checkpoint of this run is committed; run it again once the cause is fixed";
  return "latest still names " + last->string() + "; to train the steps after it again once the cause is fixed, " +
         (options_.resume_hint ? options_.resume_hint(*last)
                               : "resume with TrainerOptions::resume = \"" + last->string() + "\"");
}

std::optional<fs::path> Trainer::save(int64_t step, std::optional<fs::path> last) {
  const double t0 = now_seconds();
  // N copies of a one-process run started by mpirun train the same thing: only the launcher's rank 0
  // writes, or they would all commit into one checkpoint directory at once.
  if (booster_.process_group().size() > 1 || is_rank0_) {
    if (options_.async_checkpoint && async_save_) {
      // Note [Asynchronous checkpoints] in async_save.h: one save in flight; snapshot, then write behind.
      collect_async_save(last, /*wait=*/true);
      const double t_snapshot = now_seconds();
      std::vector<checkpoint::WriteCapture::File> files;
      try {
        checkpoint::WriteCapture capture;
        booster_.save_state(*checkpoint_root_, {.keep_last = options_.keep_last, .step = step, .commit = false});
        files = capture.take();
      } catch (const std::exception& e) {
        if (options_.stop_on_save_error) throw;
        progress_->print(format_line("booster: warning: the checkpoint of step %lld failed: ", static_cast<long long>(step)) +
                         e.what() + "; training goes on, " +
                         (last ? "the last checkpoint is " + last->string() : std::string("nothing is saved yet")) +
                         " (train.on_save_error is \"warn\")");
        return last;
      }
      async_snapshot_seconds_ = now_seconds() - t_snapshot;
      async_save_->start(*checkpoint_root_, step, options_.keep_last, std::move(files));
      return last;
    }
    // A failed synchronous save stops the run, saying which step failed and where the run stands.
    try {
      last = booster_.save_state(*checkpoint_root_, {.keep_last = options_.keep_last, .step = step});
    } catch (const CheckpointError& e) {
      BOOSTER_FAIL(CheckpointError, "the checkpoint of step ", step, " failed: ", e.what(), "; ",
                   where_to_resume(last));
    }
  }
  progress_->print(format_line("saved step %6lld | %s in %.2fs", static_cast<long long>(step),
                               last ? last->c_str() : "", now_seconds() - t0));
  return last;
}

// Note [The run's last save]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// train.on_save_error "warn" lets a background save fail because training goes on and a later save
// covers its steps. Nothing follows the save of the run's last step: were its failure a warning, the
// run would exit 0 with its end saved nowhere and `latest` at an earlier step, which a following
// `booster export`, or a job scheduler that restarts only failed jobs, takes for the finished run. So
// that failure fails the run (CheckpointError, exit 1) whatever on_save_error says, naming the step
// `latest` still names, from which a resume trains the lost steps again, as a failed synchronous save does.
void Trainer::collect_async_save(std::optional<fs::path>& last, bool wait, bool run_end) {
  if (!async_save_) return;
  // On several processes a collective while a save is in flight (every rank calls it at the same points).
  const std::optional<trainer::AsyncSave::Outcome> done = async_save_->collect(wait);
  if (!done) return;
  const long long step = static_cast<long long>(done->step);
  if (done->error.empty()) {
    last = done->dir;
    progress_->print(format_line("saved step %6lld | %s in %.2fs in the background (training paused %.3fs)", step,
                                 done->dir.c_str(), done->seconds, async_snapshot_seconds_));
    return;
  }
  const std::string previous =
      last ? "latest still names " + last->string() : std::string("no checkpoint of this run is committed");
  BOOSTER_CHECK(!run_end, CheckpointError, "the background checkpoint of step ", step, ", the run's last, failed: ",
                done->error, "; the end of the run is saved nowhere: ", where_to_resume(last));
  BOOSTER_CHECK(!options_.stop_on_save_error, CheckpointError, "the background checkpoint of step ", step,
                " failed: ", done->error, "; ", previous, "; the run stops (train.on_save_error is \"stop\")");
  progress_->print(format_line("booster: warning: the background checkpoint of step %lld failed: ", step) + done->error +
                   "; training goes on and " + previous + " (train.on_save_error is \"warn\")");
}

FitResult Trainer::fit() {
  const TrainerOptions& o = options_;
  // A fit() that stopped with an error between the micro-batches of a step leaves the Booster in mid
  // cycle; this one starts a new cycle (its first micro-batch zeroes the gradients). A cycle left open
  // by a loop outside fit() is still an error (the StateError in the loop below).
  if (abandoned_cycle_) booster_.abandon_accumulation();
  abandoned_cycle_ = false;
  struct MidCycleOnError {
    Trainer& trainer;
    int uncaught = std::uncaught_exceptions();
    ~MidCycleOnError() {
      if (std::uncaught_exceptions() > uncaught && trainer.booster_.accumulation().micro != 0)
        trainer.abandoned_cycle_ = true;
    }
  } mid_cycle_on_error{*this};
  const Boosted& parts = booster_.boosted();
  nn::Module& model = *parts.model;
  BoostedOptimizer& optimizer = *parts.optimizer;
  const nn::Criterion& criterion = parts.criterion;
  data::DataLoader& loader = *parts.dataloader;
  BoostedScheduler* scheduler = parts.scheduler.get();
  distributed::ProcessGroup& group = booster_.process_group();
  mixed_precision::MixedPrecision& precision = booster_.precision();
  // Strategies that scale the loss start above 1 (dynamic scalers at 2^16); their scale and skipped
  // steps are worth a column in the log and a value in the summary.
  const bool scales_loss = precision.loss_scale() != 1.0;

  trainer::Progress progress(o.progress ? (is_rank0_ ? *o.progress : trainer::Progress::Mode::Silent)
                                        : trainer::Progress::detect());
  progress_ = &progress;
  struct ClearProgress {
    trainer::Progress*& p;
    ~ClearProgress() { p = nullptr; }
  } clear_progress{progress_};
  std::optional<trainer::StopOnSignal> stop;
  if (o.handle_signals) stop.emplace(/*announce=*/is_rank0_);
  auto stop_signal = [&] { return stop ? stop->agreed(group) : 0; };
  struct LeaveLoop {
    ~LeaveLoop() { trainer::StopOnSignal::set_in_loop(false); }
  } leave_loop;

  // Rank 0, which writes metrics.jsonl and config.json, holds the run directory while fit() runs: two
  // runs on one directory would both append to one metrics.jsonl, each ending with status 0 and a torn
  // log, checkpoints or not. The same lock as a checkpoint root's (RootLock), and the Booster's own when
  // the run directory is also the checkpoint root (one process must not flock one file twice).
  std::optional<checkpoint::RootLock> run_dir_lock;
  if (is_rank0_ && run_dir_) {
    const auto same = [](const fs::path& a, const fs::path& b) {  // "runs/a" and "./runs/a/" alike
      std::error_code ec;
      return (fs::absolute(a, ec) / "").lexically_normal() == (fs::absolute(b, ec) / "").lexically_normal();
    };
    if (checkpoint_root_ && same(*checkpoint_root_, *run_dir_))
      booster_.lock_state_root(*run_dir_);
    else
      run_dir_lock.emplace(*run_dir_, "run directory");
  }
  // The process that saves holds the checkpoint directory for the whole run: a second run started on
  // it is refused rather than clearing this one's save in progress as a crash's leftover.
  const bool saves = o.checkpoint_every > 0 && checkpoint_root_ && (group.size() > 1 || is_rank0_);
  if (saves) booster_.lock_state_root(*checkpoint_root_);
  // Note [Asynchronous checkpoints] in async_save.h. Leaving fit() (an error, an interrupt) waits for a
  // save in flight, so it is committed or cleanly failed before the Booster's state moves on.
  struct EndAsyncSave {
    std::unique_ptr<trainer::AsyncSave>& save;
    ~EndAsyncSave() { save.reset(); }
  } end_async_save{async_save_};
  if (o.async_checkpoint && checkpoint_root_) async_save_ = std::make_unique<trainer::AsyncSave>(&group);

  // ---- resume
  FitResult result;
  std::string unchecked, layout_change, precision_change;
  if (!o.resume.empty()) {
    const bool latest = o.resume == "latest";
    const fs::path where = latest ? *checkpoint_root_ : fs::path(o.resume);
    // "latest" with nothing saved yet starts afresh, so the same command serves the first run and
    // every restart after a crash; a directory holding anything else is resumed from or refused.
    bool fresh = latest && checkpoint::holds_no_checkpoint(where);
    if (latest && group.size() > 1) {
      // Note [Ranks resume from one step] in state.cpp: every rank starts afresh, or every rank
      // resumes; a rank whose root is empty while another's holds steps stops them all.
      Tensor empty = full({1}, fresh ? 1.0 : 0.0, DType::Int64, group.device());
      group.all_reduce(empty, distributed::ReduceOp::Min);
      const bool all_fresh = empty.item() > 0.5;
      Tensor any = full({1}, fresh ? double(group.rank() + 1) : 0.0, DType::Int64, group.device());
      group.all_reduce(any, distributed::ReduceOp::Max);
      const int64_t empty_rank = int64_t(any.item()) - 1;
      BOOSTER_CHECK(all_fresh || empty_rank < 0, CheckpointError, o.load_options.context, ": rank ", empty_rank, " of ",
                    group.size(), " finds no checkpoint in ",
                    empty_rank == group.rank() ? where.string() : std::string("its checkpoint directory"),
                    " while other ranks do; every rank must resume from the same step, so none does: give every "
                    "rank the same checkpoints");
      fresh = all_fresh;
    }
    if (fresh) {
      progress.print("booster: no checkpoint in " + where.string() + " yet; starting from step 0");
    } else {
      const LoadedState loaded = booster_.load_state(where, o.load_options);
      result.resumed_from = loaded.dir;
      layout_change = loaded.layout_change;
      precision_change = loaded.precision_change;
      for (const std::string& key : loaded.unchecked) unchecked += (unchecked.empty() ? "" : ", ") + key;
      BOOSTER_CHECK(loaded.step <= total_steps_, CheckpointError, o.load_options.context, ": ", loaded.dir.string(),
                    " is at step ", loaded.step, ", past this run's ", total_steps_,
                    " steps; raise max_steps or epochs");
    }
  }
  int64_t step = booster_.step();
  if (is_rank0_ && run_dir_) {
    std::error_code ec;
    fs::create_directories(*run_dir_, ec);
    BOOSTER_CHECK(!ec, ConfigError, "cannot create the run directory '", run_dir_->string(), "': ", ec.message(),
                  "; choose a writable run directory, or none for no files");
    if (!o.config.is_null()) checkpoint::write_text_file_atomically(*run_dir_ / "config.json", o.config.dump(2) + "\n");
    const fs::path metrics_file = *run_dir_ / trainer::kMetricsFileName;
    if (step > 0)
      truncate_metrics_after(metrics_file, step, o.log_every, o.run_dir->string().find("{time}") != std::string::npos,
                             progress);
    metrics_.open(metrics_file, /*append=*/step > 0);
    write_failure_reported_ = false;
  }

  if (!o.data_description.empty()) progress.print("booster: " + o.data_description);
  // A plugin that splits the model (hybrid_parallel) runs a part of it here: name the whole and the part.
  const nn::Module& whole = booster_.user_model() ? *booster_.user_model() : model;
  const std::string part = whole.num_parameters() == model.num_parameters()
                               ? std::string()
                               : " (" + trainer::human_count(double(model.num_parameters())) + " on this rank)";
  const std::string running_precision = trainer::running_precision(booster_);
  progress.print("booster: model " + whole.name() + " with " + trainer::human_count(double(whole.num_parameters())) +
                 " parameters" + part + ", optimizer " + optimizer.user_optimizer().name() +
                 (scheduler ? ", lr scheduler " + scheduler->scheduler().name() : std::string()) + ", precision " +
                 running_precision + ", plugin " + booster_.plugin().name() +
                 (group.size() > 1 ? " x " + std::to_string(group.size()) + " processes" : std::string()) +
                 (booster_.config().device != "cpu" ? ", device " + booster_.config().device : std::string()) +
                 ", threads " + std::to_string(num_threads()) + ", " +
                 std::to_string(total_steps_) + " steps (" + std::to_string(loader.size()) + " per epoch)" +
                 (run_dir_ ? ", run directory " + run_dir_->string() : std::string()));
  if (result.resumed_from)
    progress.print("booster: resumed from " + result.resumed_from->string() + " at step " + std::to_string(step));
  if (!layout_change.empty()) progress.print("booster: " + layout_change);
  if (!precision_change.empty()) progress.print("booster: " + precision_change);
  // Note [The loss scale's warm-up]; a resumed scale has come down already, unless the resume changed
  // the strategy (whose scale then starts afresh).
  if (step == 0 || !precision_change.empty())
    if (const std::string warmup = trainer::loss_scale_warmup(booster_, precision.loss_scale()); !warmup.empty())
      progress.print("booster: " + warmup);
  if (!unchecked.empty())
    progress.print("booster: " + result.resumed_from->string() + " predates the record of " + unchecked +
                   "; they are not checked against this run's");

  // Note [What a step's checkpoint holds]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Everything a step does comes before its checkpoint: its log record, the evaluation every
  // eval_every steps, and, at an epoch's last step, the end-of-epoch evaluation (or, at the run's last,
  // the final one). A run resumed from step N thus starts with step N + 1 and repeats or drops no
  // evaluation and no metrics record (truncate_metrics_after drops those after N that the interrupted
  // run wrote). So the batch loop breaks at an epoch's last step, before fetching micro-batches that
  // cannot fill a step (Note [Gradient accumulation]), and its evaluation and checkpoint follow the
  // loop; a run resumed at an epoch's end finds no step left in it and goes on with the next epoch.
  // A signal is looked at where a checkpoint would be taken, so the save it causes holds the same.
  //
  // Note [Gradient accumulation]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // One optimizer step takes grad_accumulation micro-batches, each run inside booster.accumulate()
  // (Note [Gradient accumulation in a loop] in booster/booster/booster.h): each one's loss is divided
  // by their number, so the accumulated gradient is that of their mean loss, as one batch of all of
  // them would give, and every micro-batch but the last skips the gradient synchronisation where the
  // plugin can, so data-parallel gradients are communicated once per step. Micro-batches left at the
  // end of an epoch that cannot fill a step are not used (as drop_last does for a batch), so the
  // Booster's cycles and this loop's steps stay aligned. Steps, schedules, logs and checkpoints count
  // optimizer steps.
  // Note [The loss of a data-parallel step]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Under data parallelism (ddp, low_level_zero, hybrid_parallel with dp > 1) each rank computes the
  // loss of its share of the batch; the step's gradient is the mean of the ranks' gradients, so the
  // step's loss is the mean of the ranks' losses (every rank's share is the same size: the sampler pads
  // the data to a multiple of the ranks). Rank 0's own loss would make the same run log another curve
  // at every world size. So the loss that is reported (log lines, the bar, "train" records,
  // final_loss, the checkpoint's position) is that mean: one float64 all-reduce of one value over the
  // plugin's group, on the group's device, at every logged step and every step whose position is
  // saved (the last step is both), not at the others, whose loss nobody reads but the bar (which shows
  // the last logged step's). The ranks of one replica that split its model (tensor and pipeline ranks)
  // hold the same loss (a vocabulary-parallel loss is reduced over the tensor group; execute_pipeline
  // broadcasts the last stage's), so the mean over the whole group is the mean over the replicas.
  const bool several_ranks = group.size() > 1;
  auto global_mean = [&](double local) {
    Tensor t = full({1}, local, DType::Float64, group.device());
    group.all_reduce(t);
    return t.item() / double(group.size());
  };
  run_start_ = now_seconds();
  // Note [Peak memory of a run]
  const DeviceType memory_device = [&] {
    const std::vector<Tensor> params = model.parameters();
    return params.empty() ? DeviceType::CPU : params.front().device().type;
  }();
  reset_peak_memory_stats(memory_device);
  model.train();
  const int64_t first_step = step;
  double last_loss = position_.loss.is_number() ? position_.loss.get<double>() : std::nan("");
  // The step whose loss last_loss is (Note [The loss of a data-parallel step]); 0: none.
  int64_t loss_step = position_.loss.is_number() ? step : 0;
  double step_local_loss = std::nan("");  // this rank's share of the last step's loss
  int64_t window_samples = 0, samples_this_run = 0;
  double train_seconds = 0.0;
  double window_start = now_seconds();
  const int64_t accumulation = o.grad_accumulation;
  const bool pipelined = booster_.plugin().layout().pipeline > 1;
  // Note [The token mean of a global batch]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // With TrainerOptions::token_mean_ignore_index a step's loss is sum_i l_i / N over the targets i of
  // the whole global batch that are not ignored (every micro-batch, every data-parallel replica), N
  // their number, as Hugging Face's Trainer (num_items_in_batch) and torchtitan compute it. The mean
  // of the micro-batches' own means would weigh a micro-batch of 3 response tokens as much as one of
  // 300, and so change with how the batch is split. So fit() fetches a step's micro-batches before it
  // runs any, counts their targets, adds the counts over the group (one float64 all-reduce a step; the
  // tensor and pipeline ranks of a replica load the same batch, so the sum is divided by their number),
  // and runs each micro-batch through a criterion that turns the criterion's mean over its n targets
  // into their sum over N:
  //     loss' = criterion(output, target) * n * (R * A * P) / N.
  // R * A * P undoes the averaging done anyway: the Booster divides each of the A micro-batches' losses
  // by A (Note [Gradient accumulation]), the data-parallel plugins average the R replicas' gradients,
  // and a pipeline divides by its P micro-batches (execute_pipeline hands the criterion rows / P rows;
  // P is read from that). So the step's gradient is that of sum_i l_i / N, and the step's loss as Note
  // [The loss of a data-parallel step] reduces it (the mean over ranks of each one's mean over its
  // micro-batches) is sum_i l_i / N too; one rank's own share, which only the bar shows between logged
  // steps, is R times its part of that sum. Mean times n is the sum within a rounding or two. The
  // criterion is the boosted one (under tp the vocabulary-parallel cross-entropy), given its own
  // targets, so a plugin sees nothing new. A micro-batch with no target counted (its mean would be
  // 0/0) is given one made-up target and adds 0 times its loss: every parameter still gets its (zero)
  // gradient, which data-parallel hooks wait for.
  const std::optional<int64_t> token_ignore = o.token_mean_ignore_index;
  const double replicas = double(booster_.plugin().layout().data);
  double token_weight = 0.0;  // R * A / N of the step being run
  int64_t micro_rows = 0;     // the rows of the micro-batch being run
  std::vector<data::Batch> step_batches;  // the step's micro-batches, fetched before any runs
  nn::Criterion token_criterion;
  if (token_ignore)
    token_criterion = [&, ignore = *token_ignore](const Tensor& output, const Tensor& target) -> Tensor {
      const int64_t n = nn::count_targets(target, ignore);
      const double pieces = target.dim() > 0 && target.size(0) > 0 ? double(micro_rows) / double(target.size(0)) : 1.0;
      if (n > 0) return criterion(output, target) * (double(n) * token_weight * pieces);
      Tensor made_up = target.cpu().to(DType::Int64).contiguous().clone();
      if (made_up.numel() > 0) made_up.data<int64_t>()[0] = 0;
      return criterion(output, made_up.to(target.dtype()).to(target.device())) * 0.0;
    };
  const nn::Criterion& step_criterion = token_ignore ? token_criterion : criterion;
  // R * A / N of the fetched step (Note [The token mean of a global batch]).
  auto token_step_weight = [&] {
    int64_t local = 0;
    for (const data::Batch& b : step_batches) local += nn::count_targets(b.y, *token_ignore);
    double total = double(local);
    if (several_ranks) {
      Tensor t = full({1}, total, DType::Float64, group.device());
      group.all_reduce(t);
      total = t.item() / (double(group.size()) / replicas);
    }
    BOOSTER_CHECK(total > 0.0, DataError, "step ", step + 1, ": no target of the global batch counts (every one is ",
                  *token_ignore, ", the ignore_index), so its mean loss is 0/0; check the data's masks, or give "
                  "bigger batches");
    return replicas * double(accumulation) / total;
  };
  auto statistics_step = [&](int64_t s) { return o.diagnostics.every > 0 && s % o.diagnostics.every == 0; };
  std::optional<diagnostics::Tracer> tracer;
  if (o.diagnostics.every > 0 || o.diagnostics.name_nonfinite) tracer.emplace(model);
  skipped_.clear();
  auto checkpoint_due = [&] { return saves && (step % o.checkpoint_every == 0 || step == total_steps_); };
  auto steps_left_in_epoch = [&] { return (loader.size() - loader.batches_consumed()) / accumulation; };
  // After a step's work: a due checkpoint, and a signal's save and stop.
  // The step's loss over the global batch, into the position a checkpoint saves.
  const bool reproducible = booster_.config().reproducible;  // every rank holds the global loss already
  auto reduce_loss = [&] {
    if (loss_step == step) return;
    last_loss = several_ranks && !reproducible ? global_mean(step_local_loss) : step_local_loss;
    loss_step = step;
    position_.loss = std::isfinite(last_loss) ? json(last_loss) : json(nullptr);
  };
  // The summary of the run so far (FitResult::to_json()): at its end, and in an InterruptedError.
  auto fill_result = [&] {
    result.steps = step;
    result.final_loss = last_loss;
    result.precision = running_precision;
    result.skipped_steps = position_.skipped_steps;
    if (scales_loss) result.final_loss_scale = precision.loss_scale();
    result.seconds = now_seconds() - run_start_;
    result.train_seconds = train_seconds;
    result.samples_per_second = double(samples_this_run) / std::max(train_seconds, 1e-9);
    if (o.tokens_per_sample > 1)
      result.tokens_per_second = double(samples_this_run * o.tokens_per_sample) / std::max(train_seconds, 1e-9);
    if (position_.evaluation.is_object()) {
      trainer::Evaluation e;
      e.loss = position_.evaluation.value("test_loss", 0.0);
      e.accuracy = position_.evaluation.value("test_accuracy", 0.0);
      e.samples = position_.evaluation.value("samples", int64_t(0));
      if (position_.evaluation.value("val_ppl", json()).is_number())
        e.perplexity = position_.evaluation.at("val_ppl").get<double>();
      result.evaluation = e;
    }
    result.run_dir = run_dir_;
  };
  // Ends fit() on an agreed signal: "stopped by SIGINT <where>", with the summary so far.
  auto interrupt = [&](int signal, const std::string& where) {
    progress.finish();
    fill_result();
    result.interrupted = trainer::StopOnSignal::signal_name(signal);
    throw InterruptedError(signal, std::string("stopped by ") + trainer::StopOnSignal::signal_name(signal) + " " + where,
                           result.to_json());
  };
  // A signal that came during the last step or after it: the run is complete, nothing is left to resume.
  auto interrupt_complete = [&](int signal) {
    const std::optional<fs::path>& saved = result.last_checkpoint;
    interrupt(signal, "after the last step, " + std::to_string(step) + " of " + std::to_string(total_steps_) +
                          ", as the run ended; it is complete" + (saved ? "; saved " + saved->string() : std::string()));
  };
  auto after_step = [&] {
    check_writes(step, result.last_checkpoint ? result.last_checkpoint : result.resumed_from);
    collect_async_save(result.last_checkpoint, /*wait=*/false);  // Note [Asynchronous checkpoints]
    const int signal = stop_signal();
    const bool saving = checkpoint_due() || (signal && checkpoint_root_);
    if (saving && step > first_step) reduce_loss();  // every rank: the signal was agreed
    if (saving) result.last_checkpoint = save(step, result.last_checkpoint);
    if (!signal) return;
    const bool last = step >= total_steps_;  // the signal came during the last step
    collect_async_save(result.last_checkpoint, /*wait=*/true, /*run_end=*/last);  // a stop names a committed step
    if (last) interrupt_complete(signal);
    if (!checkpoint_root_)
      interrupt(signal, "after step " + std::to_string(step) + " of " + std::to_string(total_steps_) +
                            "; nothing was saved: there is no run or checkpoint directory");
    if (!result.last_checkpoint)
      interrupt(signal, "after step " + std::to_string(step) + " of " + std::to_string(total_steps_) +
                            "; its checkpoint failed and this run committed none");
    const fs::path& saved = *result.last_checkpoint;
    const std::string hint =
        o.resume_hint ? o.resume_hint(saved) : "resume with TrainerOptions::resume = \"" + saved.string() + "\"";
    interrupt(signal, "after step " + std::to_string(step) + " of " + std::to_string(total_steps_) + "; saved " +
                          saved.string() + "; " + hint);
  };

  // A signal while the run was starting (reading the data, building the model, loading the checkpoint)
  // stops it here, before its first step: Note [Stopping on a signal].
  if (const int signal = stop_signal()) {
    const std::string where = result.resumed_from ? "; " + result.resumed_from->string() + " is where it stands"
                                                  : std::string();
    interrupt(signal, "before step " + std::to_string(step + 1) + " of " + std::to_string(total_steps_) +
                          "; nothing new to save" + where);
  }
  trainer::StopOnSignal::set_in_loop(stop.has_value());

  for (int64_t epoch = loader.epoch(); epoch < o.epochs && step < total_steps_; ++epoch) {
    loader.set_epoch(epoch);  // keeps a resumed position in this epoch
    if (steps_left_in_epoch() == 0) continue;  // resumed at this epoch's end
    int64_t micro = 0;            // micro-batches accumulated into the current step
    double accumulated_loss = 0;  // their mean loss
    double step_start = now_seconds();
    int64_t batch_samples = 0;
    // One micro-batch's forward and backward; true when it completes the step.
    auto run_micro_batch = [&](data::Batch& batch) {
      if (micro == 0) {
        step_start = now_seconds();
        optimizer.zero_grad();
        accumulated_loss = 0;
        batch_samples = 0;
        if (tracer) tracer->begin_step(statistics_step(step + 1));
      }
      const bool last_micro = ++micro == accumulation;
      micro_rows = batch.y.dim() > 0 ? batch.y.size(0) : 0;
      double micro_loss = 0.0;
      {
        const auto observing = tracer ? tracer->observe() : nullptr;
        const Booster::Accumulate accumulating = booster_.accumulate(accumulation);
        BOOSTER_CHECK(accumulating.sync() == last_micro, StateError, "Trainer: the Booster is at micro-step ",
                      accumulating.micro_step() + 1, " of ", accumulation, " where the step's micro-batch ", micro,
                      " runs; a loop outside fit() left an accumulation cycle of this Booster unfinished");
        if (pipelined) {
          // The plugin runs the stages' micro-batches (Booster::execute_pipeline).
          micro_loss = booster_.execute_pipeline(batch.x, batch.y, model, step_criterion, optimizer);
        } else {
          const Tensor loss = step_criterion(model(batch.x), batch.y);
          booster_.backward(loss, optimizer);
          micro_loss = loss.item();
        }
      }
      accumulated_loss += micro_loss / double(accumulation);
      batch_samples += batch.x.size(0);
      return last_micro;
    };
    // Note [Reproducible training across world sizes]: the step's micro-batches as one global batch's
    // rows, which Booster::reproducible_step cuts into its chunks.
    auto run_reproducible_step = [&] {
      step_start = now_seconds();
      if (tracer) tracer->begin_step(statistics_step(step + 1));
      std::vector<Tensor> xs, ys;
      batch_samples = 0;
      for (const data::Batch& b : step_batches) {
        xs.push_back(b.x);
        ys.push_back(b.y);
        batch_samples += b.x.size(0);
      }
      step_batches.clear();
      const auto observing = tracer ? tracer->observe() : nullptr;
      accumulated_loss = booster_.reproducible_step(cat(xs, 0), cat(ys, 0), model, step_criterion, optimizer);
      return true;
    };
    for (data::Batch& fetched : loader) {
      bool stepping = false;
      if (reproducible) {
        step_batches.push_back(fetched);
        if (int64_t(step_batches.size()) < accumulation) continue;
        stepping = run_reproducible_step();
      } else if (!token_ignore) {
        stepping = run_micro_batch(fetched);
      } else {
        // Note [The token mean of a global batch]: all of the step's micro-batches first.
        step_batches.push_back(fetched);
        if (int64_t(step_batches.size()) < accumulation) continue;
        token_weight = token_step_weight();
        for (data::Batch& batch : step_batches) stepping = run_micro_batch(batch);
        step_batches.clear();
      }
      if (!stepping) continue;
      micro = 0;
      const double step_lr = optimizer.lr();  // the lr this step uses (the scheduler moves it after)
      const double step_scale = precision.loss_scale();  // the scale its gradients were made at
      if (tracer) tracer->end_step();
      if (o.max_grad_norm > 0.0) booster_.clip_grad_norm(optimizer, o.max_grad_norm);
      optimizer.step();
      // A skipped step (inf/NaN gradients, the scale was lowered) changed no weight, so, as Accelerate
      // does, it does not move the schedule either (BoostedScheduler::step knows).
      const bool skipped = optimizer.step_was_skipped();
      if (skipped) ++position_.skipped_steps;
      if (scheduler) scheduler->step();
      step = booster_.step();
      kill_here_if_testing(step, group);
      if (skipped) report_skipped_step(step, tracer ? &*tracer : nullptr);
      if (tracer && statistics_step(step)) {
        metrics_.write({{"kind", "diagnostics"},
                        {"step", step},
                        {"loss_scale", step_scale},
                        {"modules", tracer->statistics_json().at("modules")}});
        for (const auto& hook : diagnostics_hooks_) hook(step, *tracer);
        tracer->reset_statistics();
      }
      step_local_loss = accumulated_loss;
      const bool logged = step % o.log_every == 0 || step == total_steps_;
      // Note [The loss of a data-parallel step]: one process's loss is the batch's at every step.
      if (!several_ranks || logged || checkpoint_due()) reduce_loss();
      train_seconds += now_seconds() - step_start;
      position_.samples_seen += batch_samples;
      samples_this_run += batch_samples;
      window_samples += batch_samples;

      // An overflowing 16-bit loss on a skipped step is the scaler's to handle (it throws itself when
      // the scale would fall below its floor).
      // The global loss where it was reduced (a non-finite share on any rank stops every rank), else
      // this rank's.
      const double checked_loss = loss_step == step ? last_loss : step_local_loss;
      if (!skipped && !std::isfinite(checked_loss)) {
        std::string first;
        if (tracer && o.diagnostics.name_nonfinite)
          if (const std::optional<diagnostics::NonFinite> f = tracer->first_nonfinite())
            first = " (the first non-finite tensor: " + f->describe() + ")";
        BOOSTER_FAIL(TrainingError, "the loss is ", checked_loss, " at step ", step, first,
                     "; lower the learning rate or check the data");
      }
      trainer::StepReport report;
      report.step = step;
      report.total_steps = total_steps_;
      report.epoch = epoch + 1;
      report.loss = last_loss;
      report.loss_step = loss_step;
      report.lr = step_lr;
      if (scales_loss) report.loss_scale = precision.loss_scale();
      report.skipped = position_.skipped_steps;
      report.samples_per_second = double(window_samples) / std::max(now_seconds() - window_start, 1e-9);
      report.seconds = now_seconds() - run_start_;
      report.eta_seconds = train_seconds / double(step - first_step) * double(total_steps_ - step);
      progress.update(report, logged);
      if (is_rank0_)
        for (const auto& hook : step_hooks_) hook(report);
      if (logged) {
        const PeakMemory peak = gather_peak_memory(group, memory_device);  // Note [Peak memory of a run]
        result.peak_tensor_bytes = peak.tensor;
        result.peak_reserved_bytes = peak.reserved;
        json record = {{"kind", "train"},
                       {"step", step},
                       {"epoch", report.epoch},
                       {"loss", last_loss},
                       {"lr", step_lr},
                       {"loss_scale", report.loss_scale ? json(*report.loss_scale) : json(nullptr)},
                       {"skipped", position_.skipped_steps},
                       {"samples_per_second", report.samples_per_second},
                       {"time", report.seconds},
                       {"precision", running_precision}};
        put_peak_memory(record, peak.tensor, peak.reserved);
        metrics_.write(record);
        window_samples = 0;
        window_start = now_seconds();
      }
      if (o.eval_every > 0 && step % o.eval_every == 0 && step < total_steps_) run_evaluation(step);
      // The end of the epoch or of the run: evaluation and checkpoint follow the loop.
      if (step >= total_steps_ || steps_left_in_epoch() == 0) break;
      after_step();
    }
    // The epoch's (or the run's) last step: eval_every = 0 evaluates after each epoch, and every run
    // once at its end.
    if (o.eval_every == 0 || step >= total_steps_) run_evaluation(step);
    after_step();
  }
  trainer::StopOnSignal::set_in_loop(false);
  // The run's end waits for its last save, which must not fail (Note [The run's last save]).
  collect_async_save(result.last_checkpoint, /*wait=*/true, /*run_end=*/true);
  // A signal during the last step's evaluation or save came after after_step() looked: the run is
  // complete, but a stop was asked for, so it ends as interrupted (Note [Stopping on a signal]).
  if (const int signal = stop_signal()) interrupt_complete(signal);
  {  // every rank is here together (the signal was agreed): Note [Peak memory of a run]
    const PeakMemory peak = gather_peak_memory(group, memory_device);
    result.peak_tensor_bytes = peak.tensor;
    result.peak_reserved_bytes = peak.reserved;
  }
  progress.finish();
  metrics_.close();
  check_writes(step, result.last_checkpoint ? result.last_checkpoint : result.resumed_from);
  fill_result();
  return result;
}

}  // namespace booster
