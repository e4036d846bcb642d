// Pipeline stages and their schedules (pipeline.h).
//
// Note [Pipeline schedules]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A step of M micro-batches over P stages is, for each stage, a list of actions: F(i) runs micro-batch
// i forward (receiving its input from the stage before, sending the output to the stage after), B(i)
// runs it backward (receiving the gradient of the output from the stage after, sending the gradient of
// the input to the stage before). GPipe lists every F, then every B; a stage then holds the
// activations of all M micro-batches at once. 1F1B (PipeDream-Flush, Megatron-LM's non-interleaved
// schedule) lets stage s run min(P - s - 1, M) forwards first, then alternates one forward and one
// backward, then drains the remaining backwards: B(i) comes as soon as stage s + 1 can send its
// gradient, so a stage holds at most P - s micro-batches, and the bubble is the same (P - 1 slots of
// each stage idle per step).
// Sends are non-blocking and waited for only at the end of the step; a receive blocks until its
// message is there. So a stage waits only on data it needs, and since every action's inputs come
// from actions earlier in the other stages' lists (tests/nn/test_pipeline.cpp runs the lists against
// each other to show it), no stage waits for ever. Messages between two neighbours go one way each
// (activations down, gradients up) and in the order posted, so they need no tags to match.
// On NCCL a send holds the stream until the peer's receive runs, so a stage that queued "send the
// activation, then receive a gradient" while its neighbour queued "send the gradient, then receive
// the activation" would wait for ever. So a send is posted together with the stage's next receive
// in one batch (Megatron-LM's send_forward_recv_backward and send_backward_recv_forward), or on its
// own at the start of the next action that receives nothing (the warm-up forwards of the first
// stage), and what is left at the end of the step.
// The loss: the last stage backpropagates criterion(out_i, y_i) / M for each micro-batch, so the
// parameters' gradients are those of the mean over micro-batches, which for equal micro-batches and a
// criterion that averages over its batch is the whole batch's loss; that mean is what every stage
// returns (broadcast from the last).
//
// Note [Packed micro-batches]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A packed input (Note [Packed sequences] in packing.h) carries its documents' layout in band, but only
// the first stage reads the input; the others receive hidden states, which say nothing of where a
// document starts. Every stage is handed the same batch (train_step's contract), so a later stage
// derives micro-batch i's layout from micro-batch i of that batch and holds it (SequenceLayoutScope)
// while its module runs the micro-batch forward; its attention layers read it as the first stage's
// do. Nothing more crosses between stages, and the layout is the sender's by construction. Backward
// needs no layout (the attention saved its mask); a checkpointed layer keeps the layout it ran under
// for its recompute (Note [Recomputing in backward]).
#include "booster/nn/pipeline.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>

#include "booster/autograd/autograd.h"
#include "booster/nn/activation_checkpoint.h"
#include "booster/nn/container.h"
#include "booster/nn/packing.h"
#include "booster/common/error.h"
#include "booster/ops/ops.h"

namespace booster::nn::pp {

using distributed::ProcessGroup;
using Action = PipelineAction;

Schedule parse_schedule(const std::string& name) {
  if (name == "1f1b") return Schedule::OneFOneB;
  if (name == "gpipe") return Schedule::GPipe;
  BOOSTER_FAIL(ConfigError, "pipeline: unknown schedule \"", name, "\"; use \"1f1b\" or \"gpipe\"");
}

std::vector<PipelineAction> schedule_actions(Schedule schedule, int stage, int stages, int microbatches) {
  BOOSTER_CHECK(stages >= 1 && stage >= 0 && stage < stages, ValueError, "pipeline: stage ", stage,
                " does not exist in a pipeline of ", stages, " stages");
  BOOSTER_CHECK(microbatches >= 1, ValueError, "pipeline: ", microbatches,
                " micro-batches; a step needs at least one");
  std::vector<Action> actions;
  actions.reserve(size_t(2 * microbatches));
  if (schedule == Schedule::GPipe) {
    for (int i = 0; i < microbatches; ++i) actions.push_back({Action::Kind::Forward, i});
    for (int i = microbatches; i-- > 0;) actions.push_back({Action::Kind::Backward, i});
    return actions;
  }
  const int warmup = std::min(stages - stage - 1, microbatches);
  int forward = 0, backward = 0;
  for (; forward < warmup; ++forward) actions.push_back({Action::Kind::Forward, forward});
  for (; forward < microbatches; ++forward, ++backward) {
    actions.push_back({Action::Kind::Forward, forward});
    actions.push_back({Action::Kind::Backward, backward});
  }
  for (; backward < microbatches; ++backward) actions.push_back({Action::Kind::Backward, backward});
  return actions;
}

PipelineStage::PipelineStage(ModulePtr stage, ProcessGroup& group, PipelineOptions options)
    : stage_(std::move(stage)), group_(group), options_(options) {
  BOOSTER_CHECK(stage_ != nullptr, ValueError, "PipelineStage: the stage's module is null");
  BOOSTER_CHECK(options_.num_microbatches >= 1, ConfigError, "pipeline: num_microbatches is ",
                options_.num_microbatches, "; it must be at least 1");
}

namespace {

constexpr int64_t kMaxDims = 8;

// Micro-batch i of m of `t` along dim 0.
Tensor microbatch(const Tensor& t, int i, int m, const char* what) {
  BOOSTER_CHECK(t.defined() && t.dim() >= 1, ShapeError, "pipeline: the ", what, " must have a batch dimension");
  const int64_t n = t.shape()[0];
  BOOSTER_CHECK(n % m == 0, ShapeError, "pipeline: a batch of ", n, " ", what, "s does not split into ", m,
                " equal micro-batches; choose num_microbatches dividing the batch size");
  return t.narrow(0, i * (n / m), n / m);
}

// Note [Packed micro-batches]: the layout a stage after the first runs micro-batch i of m under, when
// the batch x is packed; none otherwise.
std::optional<SequenceLayout> packed_layout(const Tensor& x, int i, int m, bool first) {
  if (first || !is_packed(x)) return std::nullopt;
  return unpack_sequences(microbatch(x, i, m, "input")).second;
}

}  // namespace

namespace {

// What a stage needs to receive a tensor it knows nothing of: dtype, dims, shape. A tensor of more than
// kMaxDims dims has its dims negated, so every receiver refuses it as the sender does.
Tensor header_of(const Tensor& t, Device device) {
  std::vector<int64_t> header(2 + kMaxDims, 0);
  header[0] = int64_t(t.dtype());
  header[1] = t.dim() <= kMaxDims ? t.dim() : -t.dim();
  for (int64_t d = 0; d < std::min<int64_t>(t.dim(), kMaxDims); ++d) header[size_t(2 + d)] = t.shape()[size_t(d)];
  return from_vector(header, {int64_t(header.size())}).to(device);
}

// The dtype and shape a header announces; `what` names the tensor in the errors.
std::pair<DType, Shape> read_header(const Tensor& head, const std::string& what) {
  const std::vector<int64_t> h = head.to_vector<int64_t>();
  BOOSTER_CHECK(h[1] >= 0, ShapeError, "pipeline: ", what, " has ", -h[1], " dimensions; at most ", kMaxDims,
                " cross stages");
  BOOSTER_CHECK(h[0] >= 0 && h[0] < kNumDTypes && h[1] <= kMaxDims, DistributedError, "pipeline: a malformed header for ",
                what);
  return {DType(int(h[0])), Shape(h.begin() + 2, h.begin() + 2 + h[1])};
}

}  // namespace

void PipelineStage::send_activation(const Tensor& t, int to) {
  BOOSTER_CHECK(t.dim() <= kMaxDims, ShapeError, "pipeline: stage ", stage(), "'s output has ", t.dim(),
                " dimensions; at most ", kMaxDims, " cross stages");
  using Kind = distributed::ProcessGroup::P2POp::Kind;
  pending_.push_back({Kind::Send, header_of(t, group_.device()), to, 0});
  pending_.push_back({Kind::Send, t.contiguous(), to, 0});
}

void PipelineStage::receive(Tensor& into, int from) {
  std::vector<distributed::ProcessGroup::P2POp> batch = std::move(pending_);
  pending_.clear();
  batch.push_back({distributed::ProcessGroup::P2POp::Kind::Recv, into, from, 0});
  const auto start = std::chrono::steady_clock::now();
  group_.batch_send_recv(batch)->wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void PipelineStage::flush_sends() {
  if (pending_.empty()) return;
  sends_.push_back(group_.batch_send_recv(pending_));
  pending_.clear();
}

Tensor PipelineStage::receive_activation(int from, int microbatch) {
  Tensor head = zeros({2 + kMaxDims}, DType::Int64, group_.device());
  receive(head, from);
  const auto [dtype, shape] =
      read_header(head, str("micro-batch ", microbatch, " from stage ", from, " to stage ", stage()));
  Tensor t = Tensor::empty(shape, dtype, group_.device());
  receive(t, from);
  return t;
}

double PipelineStage::train_step(const Tensor& x, const Tensor& y, const Criterion& criterion,
                                 const std::function<void(const Tensor&)>& backward) {
  const int m = options_.num_microbatches;
  // Checked on every rank alike, so a bad batch fails everywhere instead of leaving stages waiting.
  microbatch(x, 0, m, "input");
  microbatch(y, 0, m, "target");
  std::vector<Tensor> inputs(static_cast<size_t>(m)), outputs(static_cast<size_t>(m));
  double loss_sum = 0.0;
  wait_seconds_ = 0.0;
  for (const Action& action : schedule_actions(options_.schedule, stage(), stages(), m)) {
    const size_t i = size_t(action.microbatch);
    const bool receives = action.kind == Action::Kind::Forward ? !is_first() : !is_last();
    if (!receives) flush_sends();
    if (action.kind == Action::Kind::Forward) {
      Tensor in = is_first() ? microbatch(x, action.microbatch, m, "input") : receive_activation(stage() - 1, action.microbatch);
      if (!is_first() && is_floating(in.dtype())) in.requires_grad_(true);  // its gradient goes upstream
      Tensor out;
      {
        std::optional<SequenceLayoutScope> packed;
        if (auto layout = packed_layout(x, action.microbatch, m, is_first())) packed.emplace(std::move(*layout));
        out = (*stage_)(in);
      }
      if (is_last()) {
        const Tensor loss = criterion(out, microbatch(y, action.microbatch, m, "target"));
        BOOSTER_CHECK(loss.numel() == 1, ShapeError, "pipeline: the criterion returned ", loss.shape(),
                      "; a loss must be one value");
        loss_sum += loss.item();
        outputs[i] = loss * (1.0 / m);
      } else {
        send_activation(out.detach(), stage() + 1);
        outputs[i] = out;
      }
      inputs[i] = in;
      continue;
    }
    const Tensor& out = outputs[i];
    if (is_last()) {
      if (backward) backward(out);
      else out.backward();
    } else {
      Tensor grad = Tensor::empty(out.shape(), out.dtype(), group_.device());
      receive(grad, stage() + 1);
      if (out.requires_grad()) out.backward(grad);
    }
    if (!is_first()) {
      Tensor g = inputs[i].grad();
      if (!g.defined()) g = zeros(inputs[i].shape(), inputs[i].dtype(), group_.device());
      pending_.push_back({distributed::ProcessGroup::P2POp::Kind::Send, g.contiguous(), stage() - 1, 0});
    }
    inputs[i] = Tensor();  // the micro-batch's activations go back to the allocator
    outputs[i] = Tensor();
  }
  flush_sends();
  const auto start = std::chrono::steady_clock::now();
  distributed::wait_all(sends_);
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  sends_.clear();
  Tensor loss = full({1}, is_last() ? loss_sum / m : 0.0, DType::Float64, group_.device());
  if (stages() > 1) group_.broadcast(loss, stages() - 1);
  return loss.item();
}

Tensor PipelineStage::forward(const Tensor& x) {
  NoGradGuard no_grad;
  const int m = options_.num_microbatches;
  std::vector<Tensor> outs;
  microbatch(x, 0, m, "input");
  for (int i = 0; i < m; ++i) {
    if (is_first()) flush_sends();
    const Tensor in = is_first() ? microbatch(x, i, m, "input") : receive_activation(stage() - 1, i);
    Tensor out;
    {
      std::optional<SequenceLayoutScope> packed;
      if (auto layout = packed_layout(x, i, m, is_first())) packed.emplace(std::move(*layout));
      out = (*stage_)(in);
    }
    if (is_last()) outs.push_back(out);
    else send_activation(out, stage() + 1);
  }
  flush_sends();
  distributed::wait_all(sends_);
  sends_.clear();
  return is_last() ? cat(outs, 0) : Tensor();
}

Tensor PipelineStage::forward_to_all(const Tensor& x) {
  Tensor out = forward(x);
  if (stages() == 1) return out;
  const int last = stages() - 1;
  Tensor head = is_last() ? header_of(out, group_.device()) : zeros({2 + kMaxDims}, DType::Int64, group_.device());
  group_.broadcast(head, last);
  const auto [dtype, shape] = read_header(head, "the model's output");  // every stage refuses alike
  if (!is_last()) out = Tensor::empty(shape, dtype, group_.device());
  out = out.contiguous();
  group_.broadcast(out, last);
  return out;
}

// ---------------------------------------------------------------------------------- cutting a GPT

// Note [Cutting a GPT]
// ~~~~~~~~~~~~~~~~~~~~
// A GPT is cut between blocks: the first stage also embeds the token ids (wte + wpe, then the
// dropout), the last also normalizes and projects to the vocabulary (ln_f, lm_head), so only
// activations [B, T, width] cross stages (and the ids enter the first). Balanced by parameters: with
// blocks all of one size b, the first stage's extra e (the embeddings) and the last's h (the head),
// the smallest possible largest stage is found by trying every split (a table over stages and blocks,
// O(P L^2), nothing for the sizes pipelines have). Stages share the GPT's modules, so parameters
// and their names are the whole model's.

std::vector<int64_t> balance_units(const std::vector<int64_t>& units, int64_t first, int64_t last, int stages) {
  BOOSTER_CHECK(stages >= 1, ValueError, "pipeline: ", stages, " stages; a pipeline needs at least one");
  const int64_t n = int64_t(units.size());
  std::vector<int64_t> prefix(size_t(n) + 1, 0);  // prefix[l]: size of the first l units
  for (int64_t i = 0; i < n; ++i) prefix[size_t(i + 1)] = prefix[size_t(i)] + units[size_t(i)];
  // The size of stage s holding units [l - k, l).
  auto load = [&](int s, int64_t l, int64_t k) {
    return prefix[size_t(l)] - prefix[size_t(l - k)] + (s == 0 ? first : 0) + (s == stages - 1 ? last : 0);
  };
  // best[s][l]: the smallest largest load of stages 0..s-1 holding the first l units; cut[s][l] the
  // units of stage s-1 there.
  const int64_t inf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(size_t(stages) + 1, std::vector<int64_t>(size_t(n) + 1, inf));
  std::vector<std::vector<int64_t>> cut(size_t(stages) + 1, std::vector<int64_t>(size_t(n) + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int64_t l = 0; l <= n; ++l)
      for (int64_t k = 0; k <= l; ++k) {  // stage s-1 takes k units (the fewest on ties)
        const int64_t before = best[size_t(s - 1)][size_t(l - k)];
        if (before == inf) continue;
        const int64_t worst = std::max(before, load(s - 1, l, k));
        if (worst < best[size_t(s)][size_t(l)]) {
          best[size_t(s)][size_t(l)] = worst;
          cut[size_t(s)][size_t(l)] = k;
        }
      }
  std::vector<int64_t> out(static_cast<size_t>(stages));
  for (int64_t s = stages, l = n; s > 0; --s) {
    out[size_t(s - 1)] = cut[size_t(s)][size_t(l)];
    l -= out[size_t(s - 1)];
  }
  return out;
}

std::vector<int64_t> balance_gpt_layers(const GPT& gpt, int stages) {
  std::vector<int64_t> blocks;
  for (const ModulePtr& b : gpt.blocks->children()) blocks.push_back(b->num_parameters());
  return balance_units(blocks, gpt.wte->num_parameters() + gpt.wpe->num_parameters(),
                       gpt.ln_f->num_parameters() + gpt.lm_head->num_parameters(), stages);
}

namespace {

class GPTStage final : public Module {
 public:
  GPTStage(GPTParts parts, bool first, bool last, int64_t begin, int64_t end)
      : parts_(std::move(parts)), first_(first), last_(last) {
    if (first_) {
      register_module("wte", parts_.wte);
      register_module("wpe", parts_.wpe);
      register_module("drop", parts_.drop);
    }
    blocks_ = register_module("blocks", std::make_shared<Sequential>());
    for (int64_t i = begin; i < end; ++i) blocks_->push_back(std::to_string(i), parts_.blocks[size_t(i)]);
    if (last_) {
      register_module("ln_f", parts_.ln_f);
      register_module("lm_head", parts_.lm_head);
    }
  }
  std::string name() const override { return "GPTStage"; }

  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    // Note [Packed sequences]: the first stage unpacks a packed input and holds its layout for its own
    // blocks, each record's position embeddings from 0; a later stage runs under the layout its
    // PipelineStage installs from the same micro-batch (Note [Packed micro-batches]).
    std::optional<SequenceLayoutScope> scope;
    if (first_) {
      Tensor ids = x, positions;
      if (is_packed(x)) {
        auto [unpacked, layout] = unpack_sequences(x);
        ids = unpacked;
        positions = layout.positions;
        scope.emplace(std::move(layout));
      }
      BOOSTER_CHECK(ids.dim() == 2, ShapeError, "GPT stage: expected token ids [B, T], got shape ", ids.shape());
      BOOSTER_CHECK(ids.size(1) <= parts_.context, ShapeError, "GPT: sequence length ", ids.size(1),
                    " exceeds the context length ", parts_.context, "; pass at most ", parts_.context, " tokens");
      if (!positions.defined()) positions = arange(ids.size(1), DType::Int64).to(ids.device());
      h = (*parts_.drop)((*parts_.wte)(ids) + (*parts_.wpe)(positions));
    }
    for (const ModulePtr& block : blocks_->children())
      h = parts_.activation_checkpointing ? checkpoint(*block, h) : (*block)(h);
    if (last_) h = (*parts_.lm_head)((*parts_.ln_f)(h));
    return h;
  }

 private:
  GPTParts parts_;
  bool first_, last_;
  std::shared_ptr<Sequential> blocks_;
};

}  // namespace

GPTParts gpt_parts(const GPT& gpt) {
  GPTParts parts{gpt.wte, gpt.wpe, gpt.drop, gpt.blocks->children(), gpt.ln_f, gpt.lm_head, gpt.config.context,
                 gpt.config.activation_checkpointing};
  return parts;
}

ModulePtr gpt_stage(const std::shared_ptr<GPT>& gpt, int stage, int stages, std::vector<int64_t> stage_layers) {
  BOOSTER_CHECK(gpt != nullptr, ValueError, "pipeline: the GPT to cut is null");
  if (stages >= 1 && stage_layers.empty()) stage_layers = balance_gpt_layers(*gpt, stages);
  ModulePtr out = gpt_stage(gpt_parts(*gpt), stage, stages, stage_layers);
  out->train(gpt->is_training());
  return out;
}

ModulePtr gpt_stage(const GPTParts& parts, int stage, int stages, const std::vector<int64_t>& stage_layers) {
  BOOSTER_CHECK(stages >= 1 && stage >= 0 && stage < stages, ValueError, "pipeline: stage ", stage,
                " does not exist in a pipeline of ", stages, " stages");
  int64_t total = 0;
  bool nonnegative = true;
  for (int64_t n : stage_layers) {
    total += n;
    nonnegative &= n >= 0;
  }
  const int64_t layers = int64_t(parts.blocks.size());
  BOOSTER_CHECK(int(stage_layers.size()) == stages && nonnegative && total == layers, ValueError,
                "pipeline: stage_layers ", stage_layers, " must give each of the ", stages,
                " stages a number of blocks >= 0, together the model's ", layers);
  int64_t begin = 0;
  for (int s = 0; s < stage; ++s) begin += stage_layers[size_t(s)];
  return std::make_shared<GPTStage>(parts, stage == 0, stage == stages - 1, begin, begin + stage_layers[size_t(stage)]);
}

}  // namespace booster::nn::pp
