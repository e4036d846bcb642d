// hybrid_parallel: tensor, pipeline and data parallelism in one plugin (ColossalAI's
// HybridParallelPlugin), over a dp x pp x tp mesh of the default process group (booster/distributed/
// device_mesh.h). How the parts fit: README.md beside this file.
//
//   {"plugin": {"name": "hybrid_parallel", "tp_size": 2, "pp_size": 2, "num_microbatches": 4}}
//
// Options (ConfigError for unknown keys and bad values):
//   tp_size           ranks that split each layer, Megatron-style (1)
//   pp_size           pipeline stages (1)
//   zero_stage        0: every replica steps all its parameters; 1: the optimizer state (and float32
//                     masters) of each replica's parameters is split across the data-parallel group
//                     (Note [Hybrid ZeRO-1]) (0)
//   num_microbatches  micro-batches per step of a pipeline (1)
//   schedule          "1f1b" | "gpipe" ("1f1b")
//   stage_layers      units (GPT blocks, classifier Linear layers) per stage; [] balances by parameters
// The data-parallel size is world size / (tp_size * pp_size).
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "booster/autograd/autograd.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/common/json_text.h"
#include "booster/config/option_reader.h"
#include "booster/distributed/device_mesh.h"
#include "booster/distributed/local_process_group.h"
#include "booster/distributed/nccl_process_group.h"
#include "booster/mixed_precision/master_weight_optimizer.h"
#include "booster/nn/kv_cache.h"
#include "booster/nn/pipeline.h"
#include "booster/nn/shard_policy.h"
#include "booster/ops/ops.h"
#include "booster/plugin/data_parallel.h"  // data_parallel_loader
#include "booster/plugin/parallel_plugin.h"

namespace booster::plugins::hybrid {

using distributed::ProcessGroup;
using nlohmann::json;

struct HybridOptions {
  int tp_size = 1;
  int pp_size = 1;
  int zero_stage = 0;
  int num_microbatches = 1;
  std::string schedule = "1f1b";
  std::vector<int64_t> stage_layers;

  json to_json() const {
    return {{"tp_size", tp_size},
            {"pp_size", pp_size},
            {"zero_stage", zero_stage},
            {"num_microbatches", num_microbatches},
            {"schedule", schedule},
            {"stage_layers", stage_layers}};
  }

  static HybridOptions parse(const json& options) {
    config::OptionReader r("plugin", "hybrid_parallel", options);
    HybridOptions o;
    o.tp_size = int(r.integer("tp_size", 1, 1, 1 << 20));
    o.pp_size = int(r.integer("pp_size", 1, 1, 1 << 20));
    o.zero_stage = int(r.integer("zero_stage", 0, 0, 2));
    o.num_microbatches = int(r.integer("num_microbatches", 1, 1, 1 << 20));
    o.schedule = r.choice("schedule", "1f1b", {"1f1b", "gpipe"});
    const json layers = r.raw("stage_layers", json::array());
    r.finish();
    BOOSTER_CHECK(layers.is_array(), ConfigError, "plugin 'hybrid_parallel': stage_layers must be a list of numbers "
                  "of layers, one per stage, got ", layers.dump());
    for (const json& n : layers) {
      BOOSTER_CHECK(n.is_number_integer() && n.get<int64_t>() >= 0, ConfigError,
                    "plugin 'hybrid_parallel': stage_layers must hold numbers of layers >= 0, got ", layers.dump());
      o.stage_layers.push_back(n.get<int64_t>());
    }
    BOOSTER_CHECK(o.stage_layers.empty() || int(o.stage_layers.size()) == o.pp_size, ConfigError,
                  "plugin 'hybrid_parallel': stage_layers ", layers.dump(), " has ", o.stage_layers.size(),
                  " entries for ", o.pp_size, " stages; give one per stage or leave it out");
    BOOSTER_CHECK(o.zero_stage != 2 || o.pp_size == 1, ConfigError,
                  "plugin 'hybrid_parallel': zero_stage 2 shards gradients, which a pipeline accumulates over its "
                  "micro-batches; use zero_stage 1 with pp_size > 1 (as ColossalAI)");
    BOOSTER_CHECK(o.zero_stage <= 1, ConfigError, "plugin 'hybrid_parallel': zero_stage ", o.zero_stage,
                  " is not supported; use zero_stage 1 (optimizer state split across the data-parallel group), "
                  "or the low_level_zero plugin for ZeRO-2 and ZeRO-3 without tensor or pipeline parallelism");
    return o;
  }
};

// What the checkpoint IO reads from the plugin once boost() split the model.
struct SplitState {
  std::unique_ptr<distributed::DeviceMesh> mesh;
  std::map<std::string, nn::ShardSpec> shards;
  json layout;
  // zero_stage 1 (Note [Hybrid ZeRO-1]): the data-parallel rank that steps each parameter, by name.
  std::map<std::string, int> owners;
  // The whole model's, when it is a decoder (nn::CausalLM): what generation from the split model needs.
  int64_t max_positions = 0, vocab_size = 0;
};

// Note [Hybrid ZeRO-1]
// zero_stage 1 splits a replica's optimizer state over its data-parallel group by parameters, as
// torch's ZeroRedundancyOptimizer does: each parameter of this rank's part has an owner (the rank with
// the fewest elements so far, in parameter order, so every rank computes the same table), and the
// optimizer boost() returns steps only the parameters this rank owns, so their AdamW state and, for a
// strategy with float32 masters, their masters exist on the owner alone (1/dp of them per rank). The
// gradients are still averaged across the group (all of them, as one flat buffer), each owner steps
// its parameters, and then broadcasts them to the group, one flat buffer per owner. Partitioning by
// parameter rather than by element keeps every strategy's own step (scaling, masters, skipping)
// unchanged underneath: the strategy simply holds fewer parameters.
//
// Note [Hybrid gradients]
// Gradients are complete within a (tp, pp) replica once its backward ran: a split parameter's gradient
// is this rank's slice, a replicated one (layer norms, wpe, row-parallel biases) is the same on every
// tensor rank because what flows into it was all-reduced already (Megatron's f and g). So the data-
// parallel average is the only reduction left; it runs once per step, before anything reads the
// gradients (unscale, clip, step), over the optimizer's flat gradient buffers.
class HybridPrecision final : public mixed_precision::PrecisionDecorator {
 public:
  // `replicated`: this rank's parameters that every tensor rank holds whole (the others are split).
  // `zero` (zero_stage 1 on more than one data-parallel rank): `owners` gives the rank that steps each
  // of `parameters`.
  HybridPrecision(std::shared_ptr<mixed_precision::MixedPrecision> inner, std::shared_ptr<const SplitState> split,
                  std::shared_ptr<optim::Optimizer> optimizer, std::vector<Tensor> parameters,
                  std::vector<Tensor> replicated, bool zero, std::vector<int> owners)
      : PrecisionDecorator(std::move(inner)),
        split_(std::move(split)),
        mesh_(*split_->mesh),
        optimizer_(std::move(optimizer)),
        parameters_(std::move(parameters)),
        zero_(zero),
        owners_(std::move(owners)) {
    const std::set<const TensorImpl*> rep = [&] {
      std::set<const TensorImpl*> out;
      for (const Tensor& p : replicated) out.insert(p.impl());
      return out;
    }();
    // Under zero_stage 1 a gradient of a parameter this rank does not own exists only from the backward
    // that made it to the next reduction: one that is there counts as arrived. The gradient views the
    // optimizer passed to boost() left on them go now.
    if (zero_)
      for (size_t i = 0; i < parameters_.size(); ++i)
        if (owners_[i] != mesh_.coord().dp) parameters_[i].set_grad(Tensor());
    // What this rank's norm covers: every parameter, or (zero_stage 1) those it owns.
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (zero_ && owners_[i] != mesh_.coord().dp) continue;
      normed_.push_back(parameters_[i]);
      if (rep.count(parameters_[i].impl())) normed_replicated_.push_back(parameters_[i]);
    }
  }

  void backward(const Tensor& loss, optim::Optimizer& optimizer) override {
    inner_->backward(loss, optimizer);
    pending_ = true;
  }
  void mark_pending() { pending_ = true; }
  void unscale_gradients(optim::Optimizer& optimizer) override {
    reduce();
    inner_->unscale_gradients(optimizer);
  }
  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override;
  void step(optim::Optimizer& optimizer) override {
    reduce();
    PrecisionDecorator::step(optimizer);
    if (zero_) share_stepped_parameters();
    // The inner strategy saw this rank's part only: the norm of the step is the whole model's.
    if (!std::isnan(clipped_norm_)) stats_.grad_norm = clipped_norm_;
    clipped_norm_ = std::numeric_limits<double>::quiet_NaN();
  }

 private:
  void reduce() {
    if (!pending_) return;
    pending_ = false;
    ProcessGroup& dp = mesh_.dp_group();
    if (dp.size() == 1 || !optimizer_) return;
    if (zero_) return reduce_all_parameters();
    for (size_t g = 0; g < optimizer_->param_groups().size(); ++g)
      for (const optim::FlatBuffer* fb : optimizer_->flat_buffers(g)) {
        const_cast<optim::FlatBuffer*>(fb)->sync_grads();  // gradients that are not views yet join the buffer
        Tensor grad = fb->grad();  // a view of the buffer
        dp.all_reduce(grad, distributed::ReduceOp::Avg);
      }
  }

  // zero_stage 1: the optimizer holds only the owned parameters, so the others' gradients are averaged
  // here too, all of them as one flat buffer per dtype (every rank of the group the same layout), with
  // a mask of which arrived (a parameter that got no gradient on any rank keeps none, so its owner does
  // not step it, as at zero_stage 0). Only the owners keep the result; every other rank drops its
  // gradients of the parameters it does not own, which it no longer needs.
  void reduce_all_parameters() {
    std::map<const TensorImpl*, bool> owned_arrived;  // what the optimizer would count as arrived
    for (size_t g = 0; g < optimizer_->param_groups().size(); ++g)
      for (const optim::FlatBuffer* fb : optimizer_->flat_buffers(g)) {
        const std::vector<char> arrived = const_cast<optim::FlatBuffer*>(fb)->sync_grads();
        for (size_t i = 0; i < fb->params().size(); ++i) owned_arrived[fb->params()[i].impl()] = arrived[i] != 0;
      }
    std::vector<Tensor> trained;
    std::vector<double> arrived;
    for (const Tensor& p : parameters_) {
      if (!p.requires_grad()) continue;
      trained.push_back(p);
      auto it = owned_arrived.find(p.impl());
      arrived.push_back((it != owned_arrived.end() ? it->second : p.grad().defined()) ? 1.0 : 0.0);
    }
    Tensor mask = from_vector(arrived, {int64_t(arrived.size())}).to(mesh_.dp_group().device());
    mesh_.dp_group().all_reduce(mask, distributed::ReduceOp::Max);
    const std::vector<double> any = mask.tolist();
    std::set<const TensorImpl*> keep;  // owned, and arrived on some rank of the group
    for (size_t i = 0; i < trained.size(); ++i)
      if (any[i] != 0.0 && owned_arrived.count(trained[i].impl())) keep.insert(trained[i].impl());
    for_each_dtype(trained, [&](const std::vector<Tensor>& ps) {
      Tensor flat = flatten(ps, /*grads=*/true);
      mesh_.dp_group().all_reduce(flat, distributed::ReduceOp::Avg);
      unflatten(flat, ps, /*grads=*/true, keep);
    });
    NoGradGuard no_grad;
    for (const Tensor& p : trained)
      if (!owned_arrived.count(p.impl())) p.set_grad(Tensor());
  }
  // After the owners stepped: every rank takes each parameter from its owner, one broadcast per owner
  // and dtype.
  void share_stepped_parameters() {
    ProcessGroup& dp = mesh_.dp_group();
    NoGradGuard no_grad;
    for (int owner = 0; owner < dp.size(); ++owner) {
      std::vector<Tensor> owned;
      for (size_t i = 0; i < parameters_.size(); ++i)
        if (owners_[i] == owner) owned.push_back(parameters_[i]);
      for_each_dtype(owned, [&](const std::vector<Tensor>& ps) {
        Tensor flat = flatten(ps, /*grads=*/false);
        dp.broadcast(flat, owner);
        unflatten(flat, ps, /*grads=*/false);
        for (const Tensor& p : ps) p.bump_version();  // cached casts of the old values must not be reused
      });
    }
  }
  template <class Fn>
  static void for_each_dtype(const std::vector<Tensor>& ps, Fn&& fn) {
    std::vector<DType> dtypes;
    for (const Tensor& p : ps)
      if (std::find(dtypes.begin(), dtypes.end(), p.dtype()) == dtypes.end()) dtypes.push_back(p.dtype());
    for (DType d : dtypes) {
      std::vector<Tensor> same;
      for (const Tensor& p : ps)
        if (p.dtype() == d) same.push_back(p);
      fn(same);
    }
  }
  // The values (or gradients; zeros for a parameter without one) of `ps` as one contiguous tensor.
  static Tensor flatten(const std::vector<Tensor>& ps, bool grads) {
    int64_t n = 0;
    for (const Tensor& p : ps) n += p.numel();
    Tensor flat = Tensor::empty({n}, ps.front().dtype(), ps.front().device());
    int64_t at = 0;
    NoGradGuard no_grad;
    for (const Tensor& p : ps) {
      Tensor dst = flat.narrow(0, at, p.numel());
      if (!grads) dst.copy_(p.detach().reshape({p.numel()}));
      else if (p.grad().defined()) dst.copy_(p.grad().reshape({p.numel()}));
      else dst.zero_();
      at += p.numel();
    }
    return flat;
  }
  // Back into `ps` (their values, or their gradients: only those of `keep`).
  static void unflatten(const Tensor& flat, const std::vector<Tensor>& ps, bool grads,
                        const std::set<const TensorImpl*>& keep = {}) {
    int64_t at = 0;
    NoGradGuard no_grad;
    for (const Tensor& p : ps) {
      const Tensor src = flat.narrow(0, at, p.numel()).reshape(p.shape());
      if (grads && !keep.count(p.impl())) {
        at += p.numel();
        continue;
      }
      if (!grads) {
        Tensor dst = p.detach();
        dst.copy_(src);
      } else if (p.grad().defined()) {
        Tensor g = p.grad();
        g.copy_(src);
      } else {
        p.set_grad(src.clone());
      }
      at += p.numel();
    }
  }

  std::shared_ptr<const SplitState> split_;  // keeps the mesh (and its groups) alive
  const distributed::DeviceMesh& mesh_;
  std::shared_ptr<optim::Optimizer> optimizer_;
  std::vector<Tensor> parameters_;
  bool zero_;
  std::vector<int> owners_;                           // zero_stage 1: each parameter's stepping rank
  std::vector<Tensor> normed_, normed_replicated_;    // what this rank's unscaled norm covers
  bool pending_ = false;
  double clipped_norm_ = std::numeric_limits<double>::quiet_NaN();  // this step's, once clipped
};

// Note [Clipping split gradients]
// The norm to clip by is the whole model's: the sum of squares over every split parameter's pieces and
// over each replicated parameter once. The inner strategy gives this rank's norm, unscaled (with a
// max_norm no norm reaches, so nothing is clipped yet), wherever it keeps the unscaled gradients
// (float32 masters or the gradients themselves). A replicated parameter's share of it is its share of
// the model's own gradients (a ratio, so the loss scale cancels); each tensor rank counts 1/tp of that
// share (together: once), the ranks of a replica add their parts, and the data-parallel replicas
// (equal after the average) are divided out. Then the inner strategy clips with a max_norm that makes its factor
// max_norm / (norm + 1e-6), torch's. Every rank runs the same collectives whatever its gradients hold,
// so an inf on one rank gives every rank an inf norm, never a hang.
double HybridPrecision::clip_grad_norm(optim::Optimizer& optimizer, double max_norm) {
  BOOSTER_CHECK(max_norm > 0.0, ValueError, "clip_grad_norm: max_norm must be > 0, got ", max_norm);
  reduce();
  const double local = inner_->clip_grad_norm(optimizer, std::numeric_limits<double>::max());
  const int tp = mesh_.tp_size();
  // The data-parallel replicas hold equal gradients (divided out below), or, under zero_stage 1, each
  // steps (and norms) its own parameters (summed like the rest).
  const int dp = zero_ ? 1 : mesh_.dp_size();
  if (tp * mesh_.pp_size() == 1 && !zero_) return inner_->clip_grad_norm(optimizer, max_norm);
  auto squares = [](const std::vector<Tensor>& ps) {
    double total = 0.0;
    for (const Tensor& p : ps)
      if (p.grad().defined()) {
        const Tensor g = p.grad().to(DType::Float64);
        total += sum(mul(g, g)).item();
      }
    return total;
  };
  const double all = squares(normed_);
  const double replicated_share = all > 0.0 ? squares(normed_replicated_) / all : 0.0;
  // An inf or NaN gradient makes the norm inf on every rank (the step will be skipped).
  const double mine = !std::isfinite(local) || !std::isfinite(replicated_share)
                          ? std::numeric_limits<double>::infinity()
                          : local * local * (1.0 - replicated_share * double(tp - 1) / double(tp));
  Tensor total = full({1}, mine, DType::Float64, mesh_.world().device());
  mesh_.world().all_reduce(total);
  const double norm = std::sqrt(std::max(total.item(), 0.0) / double(dp));
  const double factor = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && factor < 1.0 && local > 0.0) inner_->clip_grad_norm(optimizer, factor * (local + 1e-6));
  clipped_norm_ = norm;
  return norm;
}

// The model a rank hands back: its part (parameters named as the whole model's), which keeps the mesh
// its layers communicate over alive. With pipeline stages, its forward without gradients runs the
// whole pipeline and gives the last stage's output to every stage (evaluation), and it refuses to run
// with gradients: a training step is Booster::execute_pipeline.
// It generates (nn::generate) when the whole model is a decoder, without a key/value cache: every step
// runs forward over the whole sequence, through the tensor-parallel layers and the pipeline as
// evaluation does, so every rank gets the same logits and draws the same tokens.
class SplitModel final : public nn::Module, public nn::CausalLM {
 public:
  SplitModel(nn::ModulePtr stage, std::shared_ptr<const SplitState> split)
      : stage_(std::move(stage)), split_(std::move(split)), pp_(split_->mesh->pp_group()), eval_(stage_, pp_, {}) {
    for (const auto& [n, p] : stage_->named_parameters(false)) register_parameter(n, p, p.requires_grad());
    for (const auto& [n, b] : stage_->named_buffers(false)) register_buffer(n, b);
    for (const auto& [n, c] : stage_->named_children()) register_module(n, c);
    train(stage_->is_training());
  }
  std::string name() const override { return stage_->name(); }

  nn::CausalLM* causal_lm() override { return split_->vocab_size > 0 ? this : nullptr; }
  bool has_kv_cache() const override { return false; }
  int64_t max_positions() const override { return split_->max_positions; }
  int64_t vocab_size() const override { return split_->vocab_size; }
  Tensor forward_cached(const Tensor&, nn::KVCache&) override {
    BOOSTER_FAIL(IncompatibleError, "plugin 'hybrid_parallel': a split model keeps no key/value cache; "
                  "nn::generate runs it over the whole sequence instead");
  }
  nn::KVCache make_kv_cache(int64_t) const override {
    BOOSTER_FAIL(IncompatibleError, "plugin 'hybrid_parallel': a split model keeps no key/value cache");
  }

  Tensor forward(const Tensor& x) override {
    if (pp_.size() == 1) return (*stage_)(x);
    BOOSTER_CHECK(!autograd::grad_mode_enabled(), IncompatibleError, "plugin 'hybrid_parallel': a model cut into pipeline "
                  "stages trains through booster.execute_pipeline(x, y, model, criterion, optimizer), not model(x); "
                  "model(x) runs the pipeline for inference only, without gradients (NoGradGuard)");
    stage_->train(is_training());
    return eval_.forward_to_all(x);
  }

   private:
  nn::ModulePtr stage_;
  std::shared_ptr<const SplitState> split_;  // keeps the mesh (and its groups) alive
  ProcessGroup& pp_;
  nn::pp::PipelineStage eval_;  // one micro-batch at a time: evaluation batches need not divide
};

class HybridParallelPlugin;


// Checkpoints (Note [Hybrid checkpoints] in README.md): the model in the single-process file, its split
// parameters gathered over the tensor group and its stages brought to rank 0; the optimizer per rank.
class HybridCheckpointIO final : public CheckpointIO {
 public:
  // The Booster asks for its IO before boost(): until the model is split (state.mesh null) this is
  // the default IO.
  HybridCheckpointIO(ProcessGroup& world, std::shared_ptr<const SplitState> state)
      : CheckpointIO(world), state_(std::move(state)) {}

  void save_model(const nn::Module& model, const std::filesystem::path& path, uint64_t max_shard_bytes) const override {
    if (!state_->mesh) return CheckpointIO::save_model(model, path, max_shard_bytes);
    const distributed::DeviceMesh& mesh = *state_->mesh;
    const auto& shards = state_->shards;
    nn::StateDict local = model.state_dict();
    ProcessGroup& tp = mesh.tp_group();
    for (auto& [name, t] : local) {
      auto it = shards.find(name);
      if (it == shards.end() || tp.size() == 1) continue;
      const Tensor piece = t.contiguous();
      Tensor all = Tensor::empty({int64_t(tp.size()) * piece.numel()}, piece.dtype(), piece.device());
      tp.all_gather(all, piece);
      std::vector<Tensor> pieces;
      for (int r = 0; r < tp.size(); ++r)
        pieces.push_back(all.narrow(0, r * piece.numel(), piece.numel()).reshape(piece.shape()));
      t = nn::unshard(pieces, it->second);
    }
    // Stage leaders (tp 0, dp 0) send their stage to rank 0 over the pipeline group.
    const distributed::MeshCoord& c = mesh.coord();
    if (c.tp == 0 && c.dp == 0 && mesh.pp_size() > 1) {
      ProcessGroup& pp = mesh.pp_group();
      if (c.pp == 0) {
        for (int s = 1; s < pp.size(); ++s) receive_stage(pp, s, local);
      } else {
        send_stage(pp, local);
      }
    }
    if (writes()) checkpoint::save_model(path, local, max_shard_bytes);
    group_.barrier();
  }

  void load_model(nn::Module& model, const std::filesystem::path& path) const override {
    if (!state_->mesh) return CheckpointIO::load_model(model, path);
    const auto& shards = state_->shards;
    ProcessGroup& tp = state_->mesh->tp_group();
    // Each rank checks its own part; the verdict is agreed before anyone throws, so no rank goes on
    // into the next collective while another stops here.
    std::string problem;
    nn::StateDict mine;
    try {
      const checkpoint::TensorMap whole = checkpoint::load_model(path);
      for (const auto& [name, t] : model.state_dict()) {
        auto it = whole.find(name);
        BOOSTER_CHECK(it != whole.end(), CheckpointError, "load_model: ", path.string(), " has no tensor '", name,
                      "' that this model needs");
        auto spec = shards.find(name);
        mine[name] = spec == shards.end() || tp.size() == 1 ? it->second
                                                            : nn::shard_of(it->second, spec->second, tp.rank(), tp.size());
      }
    } catch (const Error& e) {
      problem = e.what();
    }
    Tensor failed = full({1}, problem.empty() ? 0.0 : 1.0, DType::Float64, group_.device());
    group_.all_reduce(failed, distributed::ReduceOp::Max);
    BOOSTER_CHECK(failed.item() == 0.0, CheckpointError,
                  problem.empty() ? "load_model: another rank could not load its part of " + path.string() +
                                        " (its message says why)"
                                  : problem);
    model.load_state_dict(mine);
  }

  // The optimizer state of each rank's part, in rank-<r>/ beside the layout it was saved under.
  void save_optimizer(const optim::Optimizer& optimizer, const std::filesystem::path& path) const override {
    if (!state_->mesh) return CheckpointIO::save_optimizer(optimizer, path);
    const json& layout = state_->layout;
    own_io_.save_optimizer(optimizer, path / rank_dir());
    if (writes()) checkpoint::write_text_file_atomically(path / "hybrid_layout.json", layout.dump(1) + "\n");
    group_.barrier();
  }

  void load_optimizer(optim::Optimizer& optimizer, const std::filesystem::path& path) const override {
    if (!state_->mesh) return CheckpointIO::load_optimizer(optimizer, path);
    const json& layout = state_->layout;
    const std::filesystem::path file = path / "hybrid_layout.json";
    BOOSTER_CHECK(std::filesystem::exists(file), CheckpointError, "load_optimizer: ", file.string(),
                  " does not exist; plugin 'hybrid_parallel' resumes only its own checkpoints");
    // Note [One JSON reader] (booster/common/json_text.h).
    const json saved = parse_json_as<CheckpointError>(
        checkpoint::read_text_file(file), "checkpoint file " + file.string(),
        "load_optimizer: " + file.string() + " is not valid JSON; the checkpoint is corrupt: ", checkpoint_limits());
    BOOSTER_CHECK(saved == layout, CheckpointError, "load_optimizer: the checkpoint was saved with the layout ",
                  saved.dump(), " and this run has ", layout.dump(), "; resume with the same plugin options and "
                  "number of processes");
    own_io_.load_optimizer(optimizer, path / rank_dir());
  }

 private:
  std::string rank_dir() const { return "rank-" + std::to_string(group_.rank()); }

  static void send_stage(ProcessGroup& pp, const nn::StateDict& local) {
    json meta = json::array();
    for (const auto& [name, t] : local) {
      json shape = json::array();
      for (int64_t d : t.shape()) shape.push_back(d);
      meta.push_back({{"name", name}, {"dtype", int(t.dtype())}, {"shape", shape}});
    }
    const std::string text = meta.dump();
    const std::vector<int64_t> chars(text.begin(), text.end());
    pp.send(from_vector(std::vector<int64_t>{int64_t(chars.size())}, {1}).to(pp.device()), 0)->wait();
    pp.send(from_vector(chars, {int64_t(chars.size())}).to(pp.device()), 0)->wait();
    for (const auto& [name, t] : local) pp.send(t.contiguous(), 0)->wait();
  }

  static void receive_stage(ProcessGroup& pp, int from, nn::StateDict& into) {
    Tensor n = zeros({1}, DType::Int64, pp.device());
    pp.recv(n, from)->wait();
    Tensor chars = zeros({n.to_vector<int64_t>()[0]}, DType::Int64, pp.device());
    pp.recv(chars, from)->wait();
    const std::vector<int64_t> b = chars.to_vector<int64_t>();
    // The peer's list of its tensors, read as any JSON text is (Note [One JSON reader]).
    const json meta = parse_json_as<CheckpointError>(std::string(b.begin(), b.end()), "the tensor list of stage " +
                                                     std::to_string(from), "the tensor list of stage " +
                                                     std::to_string(from) + " is not valid JSON: ",
                                                     data_limits(b.size(), "the size it was sent with"));
    for (const json& m : meta) {
      Shape shape;
      for (const json& d : m.at("shape")) shape.push_back(d.get<int64_t>());
      Tensor t = Tensor::empty(shape, DType(m.at("dtype").get<int>()), pp.device());
      pp.recv(t, from)->wait();
      into[m.at("name").get<std::string>()] = t;
    }
  }

  std::shared_ptr<const SplitState> state_;
  mutable distributed::LocalProcessGroup own_group_;
  CheckpointIO own_io_{own_group_};
};

class HybridParallelPlugin final : public ParallelPlugin {
 public:
  explicit HybridParallelPlugin(const json& options) : options_(HybridOptions::parse(options)) {}

  std::string name() const override { return "hybrid_parallel"; }
  std::string version() const override { return "1.0"; }
  json options() const override { return options_.to_json(); }
  bool control_checkpoint_io() const override { return true; }
  // CUDA models take the group of their device, as ddp's do (Note [A group per device]).
  std::vector<std::string> supported_devices() const override {
    if (distributed::nccl_built()) return {"cpu", "cuda"};
    return {"cpu"};
  }
  ParallelLayout layout() const override {
    const int world = distributed::default_process_group().size();
    return {.data = std::max(1, world / (options_.tp_size * options_.pp_size)),
            .tensor = options_.tp_size,
            .pipeline = options_.pp_size};
  }

  TrainingParts shard(TrainingParts parts) override {
    BOOSTER_CHECK(parts.model != nullptr, ValueError, "plugin 'hybrid_parallel': boost() needs a model");
    BOOSTER_CHECK(mesh_ == nullptr, StateError, "plugin 'hybrid_parallel': boost() was called twice; make one plugin "
                  "per model");
    // Note [A group per device]: the model's device decides the group (nccl, or staged mpi, on CUDA).
    ProcessGroup& world = distributed::process_group_for(parts.model->parameters(), "plugin 'hybrid_parallel'");
    split_->mesh = std::make_unique<distributed::DeviceMesh>(world, options_.tp_size, options_.pp_size);
    split_->layout = options_.to_json();
    split_->layout["world_size"] = world.size();
    mesh_ = split_->mesh.get();
    const bool split = options_.tp_size > 1 || options_.pp_size > 1;
    const bool zero = options_.zero_stage == 1 && mesh_->dp_size() > 1;
    if (!split && !zero) return parts;  // data parallel only: nothing to split

    if (const nn::CausalLM* lm = parts.model->causal_lm()) {
      split_->max_positions = lm->max_positions();
      split_->vocab_size = lm->vocab_size();
    }
    nn::ModulePtr part = parts.model;
    const std::string why = "plugin 'hybrid_parallel' with tp_size " + std::to_string(options_.tp_size) +
                            " and pp_size " + std::to_string(options_.pp_size);
    if (split) {
      const nn::ShardPolicy policy = nn::find_shard_policy(parts.model->name(), why);
      nn::ShardContext context;
      context.tp = &mesh_->tp_group();
      context.stage = mesh_->coord().pp;
      context.stages = options_.pp_size;
      context.stage_layers = options_.stage_layers;
      nn::ShardedModel sharded = policy(parts.model, context);
      BOOSTER_CHECK(sharded.module != nullptr, PluginError, why, ": the shard policy for '", parts.model->name(),
                    "' returned no module");
      split_->shards = std::move(sharded.shards);
      // A split parameter is a new tensor: it stays frozen where the whole model's is (a LoRA model's
      // base), so it gets no gradient and the optimizer does not hold it.
      std::map<std::string, bool> trains;
      for (const auto& [n, p] : parts.model->named_parameters()) trains[n] = p.requires_grad();
      for (auto [n, p] : sharded.module->named_parameters()) {
        auto it = trains.find(n);
        if (it != trains.end() && !it->second) p.requires_grad_(false);  // a handle: the parameter itself
      }
      if (sharded.criterion && parts.criterion) parts.criterion = sharded.criterion(parts.criterion);
      part = sharded.module;
      require_no_empty_stage(*part, why);
    }
    if (zero) {  // Note [Hybrid ZeRO-1]: each parameter's owner, the same table on every rank of the group
      std::vector<int64_t> load(size_t(mesh_->dp_size()), 0);
      for (const auto& [n, p] : part->named_parameters()) {
        const int owner = int(std::min_element(load.begin(), load.end()) - load.begin());
        split_->owners[n] = owner;
        load[size_t(owner)] += p.numel();
      }
    }

    // The optimizer passed in holds the whole model's parameters: the same one over this rank's part
    // (those it steps, under zero_stage 1), found by name, group by group (a group may be empty on a
    // stage or rank that steps none of its parameters).
    if (parts.optimizer) {
      std::map<const TensorImpl*, std::string> names;
      for (const auto& [n, p] : parts.model->named_parameters()) names[p.impl()] = n;
      std::map<std::string, Tensor> local;
      for (const auto& [n, p] : part->named_parameters()) local[n] = p;
      std::vector<optim::ParamGroup> groups;
      for (const optim::ParamGroup& g : parts.optimizer->param_groups()) {
        optim::ParamGroup mine;
        mine.options = g.options;
        for (const Tensor& p : g.params) {
          auto n = names.find(p.impl());
          BOOSTER_CHECK(n != names.end(), ValueError, why, ": the optimizer holds a parameter (", p.name(),
                        ") that is not the model's; build the optimizer over model->parameters()");
          auto l = local.find(n->second);
          if (l == local.end()) continue;
          if (zero && split_->owners.at(n->second) != mesh_->coord().dp) continue;
          mine.params.push_back(l->second);
        }
        groups.push_back(std::move(mine));
      }
      parts.optimizer = mixed_precision::rebuild_optimizer(*parts.optimizer, std::move(groups));
    }
    parts.model = part;
    return parts;
  }

  TrainingParts configure(TrainingParts parts) override {
    BOOSTER_CHECK(mesh_ != nullptr, StateError, "plugin 'hybrid_parallel': configure() before shard(); boost() "
                  "calls both");
    require_same_replicas(*parts.model);
    ProcessGroup& world = mesh_->world();
    parts.precision->set_found_inf_reducer([&world](bool local) {
      Tensor flag = full({1}, local ? 1.0 : 0.0, DType::Float32, world.device());
      world.all_reduce(flag, distributed::ReduceOp::Max);
      return flag.item() > 0.0;
    });
    std::vector<Tensor> parameters, replicated;
    std::vector<int> owners;
    for (const auto& [name, p] : parts.model->named_parameters()) {
      parameters.push_back(p);
      if (!split_->shards.count(name)) replicated.push_back(p);
      if (!split_->owners.empty()) owners.push_back(split_->owners.at(name));
    }
    const bool zero = options_.zero_stage == 1 && mesh_->dp_size() > 1;
    precision_ = std::make_shared<HybridPrecision>(std::move(parts.precision), split_, parts.optimizer,
                                                   std::move(parameters), std::move(replicated), zero,
                                                   std::move(owners));
    parts.precision = precision_;
    if (options_.pp_size > 1)
      stage_ = std::make_unique<nn::pp::PipelineStage>(
          parts.model, mesh_->pp_group(),
          nn::pp::PipelineOptions{nn::pp::parse_schedule(options_.schedule), options_.num_microbatches});
    if (options_.tp_size > 1 || options_.pp_size > 1) {
      parts.model = std::make_shared<SplitModel>(parts.model, split_);
      if (parts.criterion)  // a vocabulary-parallel loss communicates over the mesh too
        parts.criterion = [split = std::shared_ptr<const SplitState>(split_), inner = std::move(parts.criterion)](
                              const Tensor& output, const Tensor& target) { return inner(output, target); };
    }
    return parts;
  }

  double train_step(const Tensor& x, const Tensor& y, const nn::Criterion& criterion,
                    const std::function<void(const Tensor&)>& backward) override {
    if (!stage_) return ParallelPlugin::train_step(x, y, criterion, backward);
    const double loss = stage_->train_step(x, y, criterion, backward);
    precision_->mark_pending();
    return loss;
  }

  std::shared_ptr<data::DataLoader> prepare_dataloader(data::DatasetPtr dataset,
                                                       const data::DataLoaderOptions& options) override {
    // Ranks of one data-parallel replica (its tensor and pipeline ranks) read the same batches.
    const ProcessGroup& world = distributed::default_process_group();
    const int replica = options_.tp_size * options_.pp_size;
    BOOSTER_CHECK(world.size() % replica == 0, ConfigError, distributed::mesh_size_problem(world.size(),
                  options_.tp_size, options_.pp_size));
    data::DataLoaderOptions per_replica = options;
    // A pipeline splits each batch into equal micro-batches: an epoch's last, partial batch is dropped.
    if (options_.pp_size > 1) per_replica.drop_last = true;
    // tp innermost, then pp (booster/distributed/device_mesh.h): the data-parallel rank is rank / replica.
    return data_parallel_loader(std::move(dataset), per_replica, world.size() / replica, world.rank() / replica, name());
  }

  std::shared_ptr<CheckpointIO> checkpoint_io() override {
    return std::make_shared<HybridCheckpointIO>(process_group(), split_);
  }
  ProcessGroup& process_group() override { return mesh_ ? mesh_->world() : distributed::default_process_group(); }

 private:
  // A pipeline stage without parameters (more stages than the model has layers to give) would stop
  // its ranks in the optimizer ("empty parameter list") while the others wait: every rank learns which
  // stages are empty and refuses alike.
  void require_no_empty_stage(const nn::Module& part, const std::string& why) const {
    ProcessGroup& world = mesh_->world();
    std::vector<double> empty(size_t(options_.pp_size), 0.0);
    empty[size_t(mesh_->coord().pp)] = part.parameters().empty() ? 1.0 : 0.0;
    Tensor flags = from_vector(empty, {int64_t(empty.size())}).to(world.device());
    world.all_reduce(flags, distributed::ReduceOp::Max);
    std::string stages;
    int count = 0;
    const std::vector<double> any = flags.tolist();
    for (size_t s = 0; s < any.size(); ++s)
      if (any[s] != 0.0) stages += (count++ ? ", " : "") + std::to_string(s);
    BOOSTER_CHECK(count == 0, ConfigError, why, ": pipeline stage", count > 1 ? "s " : " ", stages, " of ",
                  options_.pp_size, " would hold no parameters (the model's layers do not reach every stage), so ",
                  count > 1 ? "they" : "it", " would have nothing to train; use a smaller pp_size, or "
                  "plugin.stage_layers giving every stage a layer");
  }

  // Every rank must have built the same whole model (the policy slices it where it stands): the sums of
  // the parameters of this rank's part agree across its data-parallel group, or it is a ValueError.
  void require_same_replicas(const nn::Module& model) const {
    ProcessGroup& dp = mesh_->dp_group();
    if (dp.size() == 1) return;
    double total = 0.0;
    for (const Tensor& p : model.parameters()) total += sum(p.to(DType::Float64)).item();
    Tensor lo = full({1}, total, DType::Float64, dp.device()), hi = full({1}, total, DType::Float64, dp.device());
    dp.all_reduce(lo, distributed::ReduceOp::Min);
    dp.all_reduce(hi, distributed::ReduceOp::Max);
    // One verdict for the world: a rank whose group agreed must not go on waiting for one that did not.
    Tensor differ = full({1}, lo.item() == hi.item() ? 0.0 : 1.0, DType::Float64, mesh_->world().device());
    mesh_->world().all_reduce(differ, distributed::ReduceOp::Max);
    BOOSTER_CHECK(differ.item() == 0.0, ValueError, "plugin 'hybrid_parallel': the ranks built different models "
                  "(their parameters differ across the data-parallel group); build the model from the same seed on "
                  "every rank");
  }

  HybridOptions options_;
  std::shared_ptr<SplitState> split_ = std::make_shared<SplitState>();
  distributed::DeviceMesh* mesh_ = nullptr;  // split_->mesh once shard() ran
  std::shared_ptr<HybridPrecision> precision_;
  std::unique_ptr<nn::pp::PipelineStage> stage_;
};

std::unique_ptr<ParallelPlugin> make_hybrid_plugin(const json& options) {
  return std::make_unique<HybridParallelPlugin>(options);
}

}  // namespace booster::plugins::hybrid

BOOSTER_EXPORT_PARALLEL_PLUGIN("hybrid_parallel", booster::plugins::hybrid::make_hybrid_plugin)
