// Pipeline parallelism: a model cut into stages, one per rank of a pipeline group, trained on
// micro-batches that flow forward through the stages and whose gradients flow back, under the 1F1B or
// the GPipe schedule. The schedules are plain lists of actions (testable without processes); a
// PipelineStage runs its stage's list, exchanging activations and gradients with its neighbours by
// point-to-point messages (Note [Point-to-point] in booster/distributed/README.md). How the schedules
// and the exchange fit together is Note [Pipeline schedules] in pipeline.cpp.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "booster/distributed/process_group.h"
#include "booster/nn/loss.h"
#include "booster/nn/models.h"
#include "booster/nn/module.h"

namespace booster::nn::pp {

enum class Schedule { OneFOneB, GPipe };
// "1f1b" or "gpipe"; ConfigError naming the value otherwise.
Schedule parse_schedule(const std::string& name);

struct PipelineAction {
  enum class Kind { Forward, Backward };
  Kind kind = Kind::Forward;
  int microbatch = 0;
  bool operator==(const PipelineAction&) const = default;
};

// The actions of `stage` (0-based, of `stages`) for one step of `microbatches`. ValueError for sizes
// out of range.
//   1F1B: min(stages - stage - 1, M) forwards to fill the pipeline, then one forward and one backward in
//         turn, then the remaining backwards: a stage holds at most stages - stage micro-batches'
//         activations.
//   GPipe: every forward, then every backward (in reverse): it holds all M.
std::vector<PipelineAction> schedule_actions(Schedule schedule, int stage, int stages, int microbatches);

// ---------------------------------------------------------------- cutting a GPT (Note [Cutting a GPT])
// How many of `units` (sizes, in order) each of `stages` stages takes, the first stage also holding
// `first` and the last `last`, so that the largest stage is as small as it can be; ties give earlier
// stages fewer units. ValueError for stages < 1.
std::vector<int64_t> balance_units(const std::vector<int64_t>& units, int64_t first, int64_t last, int stages);
// Blocks per stage that make the largest stage (in parameters, the embeddings counted on the first
// stage and ln_f + lm_head on the last) as small as it can be; ties give earlier stages fewer blocks.
// ValueError for stages < 1.
std::vector<int64_t> balance_gpt_layers(const GPT& gpt, int stages);
// Stage `stage` of `stages` of `gpt`: the first holds wte, wpe and the dropout, then its blocks; the
// last ends with ln_f and lm_head. `stage_layers` gives every stage's number of blocks (empty:
// balance_gpt_layers); ValueError unless it has one entry >= 0 per stage summing to the model's
// layers. The stage shares the GPT's modules and names its parameters as the GPT does
// ("blocks.3.attn.c_attn.weight"), so stages' state dicts together make the whole model's.
ModulePtr gpt_stage(const std::shared_ptr<GPT>& gpt, int stage, int stages, std::vector<int64_t> stage_layers = {});

// The modules a GPT's forward runs, in order, as a stage needs them: a GPT's own (gpt_parts), or a
// tensor-parallel twin's (booster/nn/shard_policy.h replaces the split ones).
struct GPTParts {
  ModulePtr wte, wpe, drop;
  std::vector<ModulePtr> blocks;
  ModulePtr ln_f, lm_head;
  int64_t context = 0;
  bool activation_checkpointing = false;
};
GPTParts gpt_parts(const GPT& gpt);
// As above over `parts`; stage_layers must be given (balance_gpt_layers of the GPT they came from).
ModulePtr gpt_stage(const GPTParts& parts, int stage, int stages, const std::vector<int64_t>& stage_layers);

struct PipelineOptions {
  Schedule schedule = Schedule::OneFOneB;
  int num_microbatches = 1;
};

// One rank's stage. Every rank of `group` (stage i = rank i) builds one over its part of the model and
// calls train_step() with the same batch; the group must outlive it.
class PipelineStage {
 public:
  PipelineStage(ModulePtr stage, distributed::ProcessGroup& group, PipelineOptions options);

  // One step's forward and backward over `x` and `y` (the whole batch; the first stage reads x, the last
  // y), split into num_microbatches equal micro-batches along dim 0 (ShapeError when the batch does not
  // divide). Gradients accumulate into the stage's parameters as one backward of the whole batch would
  // leave them: the last stage backpropagates criterion(out, y) / num_microbatches of each micro-batch,
  // so a criterion that averages over the batch gives the whole batch's gradient. Returns the mean of
  // the micro-batch losses on every rank (the whole batch's loss for such a criterion). Collective
  // over the group.
  // `backward` backpropagates each of the last stage's scaled micro-batch losses (a mixed-precision
  // strategy's backward, which scales it); empty: loss.backward().
  double train_step(const Tensor& x, const Tensor& y, const Criterion& criterion,
                    const std::function<void(const Tensor&)>& backward = nullptr);

  // The whole model's output on the last stage (an undefined tensor on the others), without gradients:
  // evaluation through the stages, one micro-batch at a time.
  Tensor forward(const Tensor& x);
  // As forward(), and then every stage gets the last stage's output (broadcast over the group).
  Tensor forward_to_all(const Tensor& x);

  // Seconds the last train_step() spent waiting for messages (receives and the sends' completion):
  // the stage's idle time, the pipeline bubble (bench/README.md measures it).
  double last_wait_seconds() const { return wait_seconds_; }

  int stage() const { return group_.rank(); }
  int stages() const { return group_.size(); }
  bool is_first() const { return stage() == 0; }
  bool is_last() const { return stage() + 1 == stages(); }
  Module& module() { return *stage_; }

 private:
  // Activations cross stages with a small header (dtype and shape) first, so a stage needs to know
  // nothing of its neighbour's output. Sends wait in pending_ until the stage's next receive, which
  // they are posted with as one batch, or the next action that receives nothing (Note [Pipeline
  // schedules]).
  void send_activation(const Tensor& t, int to);
  Tensor receive_activation(int from, int microbatch);
  void receive(Tensor& into, int from);
  void flush_sends();

  ModulePtr stage_;
  distributed::ProcessGroup& group_;
  PipelineOptions options_;
  std::vector<distributed::ProcessGroup::P2POp> pending_;  // sends not posted yet
  std::vector<distributed::WorkPtr> sends_;                // posted; waited for at the end of the step
  double wait_seconds_ = 0.0;
};

}  // namespace booster::nn::pp
