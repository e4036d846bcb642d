// Shard policies (shard_policy.h) and the built-in ones for the GPT and the MLP classifier (the Llama's
// is in llama.cpp, Note [Llama shard policy]).
//
// Note [Shard policies]
// ~~~~~~~~~~~~~~~~~~~~~
// A policy builds this rank's part from the whole model, which every rank constructs alike (same
// seed), so no weights travel: a split layer copies its slice (tensor_parallel.h), an unsplit one is
// the whole model's own module, shared. Pipeline stages then take the units (GPT blocks, MLP layers)
// of this rank's stage, balanced by parameters unless stage_layers says otherwise. Parameter names stay
// the whole model's ("blocks.3.mlp.c_fc.weight"), and `shards` says how each split one is laid out,
// so a checkpoint can gather the pieces into the single-process file and slice them back on load.
//   GPT (Megatron-LM): wte vocabulary-parallel; per block, attention by heads (c_attn's q, k and v
//     rows each split: chunks 3), c_proj row-parallel, mlp.c_fc column- and mlp.c_proj row-parallel;
//     layer norms and wpe replicated; lm_head column-parallel over the vocabulary, its logits left
//     split in training, where the loss is the vocabulary-parallel cross-entropy (checked once against
//     the user's criterion on the gathered logits: anything but plain cross-entropy is refused), and
//     gathered when gradients are off (evaluation), where the user's criterion gets the whole logits.
//   MLPClassifier: Linear layers alternately column- and row-parallel (an activation between them
//     works on the slice), so a pair costs one all-reduce; a last column-parallel layer gathers its
//     output. Hidden sizes (and the classes when the layer count is odd) must divide by tp.
#include "booster/nn/shard_policy.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <set>

#include "booster/autograd/autograd.h"
#include "booster/common/error.h"
#include "booster/nn/container.h"
#include "booster/nn/families.h"
#include "booster/nn/linear.h"
#include "booster/nn/llama.h"
#include "booster/nn/lora.h"
#include "booster/nn/models.h"
#include "booster/nn/pipeline.h"
#include "booster/nn/tensor_parallel.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"

namespace booster::nn {

Tensor shard_of(const Tensor& whole, const ShardSpec& spec, int rank, int size) {
  const int64_t dim = spec.dim < 0 ? spec.dim + whole.dim() : spec.dim;
  BOOSTER_CHECK(dim >= 0 && dim < whole.dim() && spec.chunks >= 1 && whole.size(dim) % (spec.chunks * size) == 0,
                ShapeError, "shard: dim ", spec.dim, " of shape ", whole.shape(), " does not split into ",
                spec.chunks, " x ", size, " equal pieces");
  const int64_t block = whole.size(dim) / spec.chunks, piece = block / size;
  std::vector<int64_t> starts;
  for (int64_t c = 0; c < spec.chunks; ++c) starts.push_back(c * block + rank * piece);
  // A deferred whole (built under a LazyInitGuard) gives its slice without being allocated.
  return select_ranges(whole.detach(), dim, starts, piece);
}

Tensor unshard(const std::vector<Tensor>& pieces, const ShardSpec& spec) {
  BOOSTER_CHECK(!pieces.empty(), ValueError, "unshard: no pieces");
  const int64_t dim = spec.dim < 0 ? spec.dim + pieces[0].dim() : spec.dim;
  BOOSTER_CHECK(pieces[0].size(dim) % spec.chunks == 0, ShapeError, "unshard: dim ", spec.dim, " of shape ",
                pieces[0].shape(), " does not split into ", spec.chunks, " chunks");
  const int64_t part = pieces[0].size(dim) / spec.chunks;
  NoGradGuard no_grad;
  std::vector<Tensor> parts;
  for (int64_t c = 0; c < spec.chunks; ++c)
    for (const Tensor& p : pieces) parts.push_back(p.narrow(dim, c * part, part));
  return cat(parts, dim).contiguous();
}

std::function<Criterion(const Criterion&)> vocab_parallel_criterion(distributed::ProcessGroup& group_ref,
                                                                int64_t vocab, const std::string& policy) {
  distributed::ProcessGroup* group = &group_ref;
  return [group, vocab, policy](const Criterion& user) -> Criterion {
    auto checked = std::make_shared<bool>(false);
    return [group, vocab, policy, user, checked](const Tensor& logits, const Tensor& target) {
      if (logits.size(-1) == vocab) return user(logits, target);  // gathered (evaluation)
      Tensor loss = tp::vocab_parallel_cross_entropy(logits, target, *group);
      if (!*checked) {
        // Once: the criterion passed to boost() must be the plain cross-entropy this replaces.
        *checked = true;
        NoGradGuard no_grad;
        const double want = user(tp::gather_last_dim(logits.detach(), *group), target).item();
        const double got = loss.item();
        BOOSTER_CHECK(std::abs(got - want) <= 1e-3 * std::max(1.0, std::abs(want)), IncompatibleError,
                      "shard policy '", policy, "': with tensor parallelism the loss is the vocabulary-parallel "
                      "cross-entropy (mean, ignore_index -100), but the criterion passed to boost() gives ", want,
                      " where it gives ", got, " (label smoothing, weights or another loss); use plain "
                      "cross_entropy, or tp_size 1");
      }
      return loss;
    };
  };
}

namespace {

// lm_head column-parallel over the vocabulary: its logits stay split while gradients are recorded
// (training: the loss is vocabulary-parallel) and are gathered otherwise (Note [Shard policies]).
// Note [LoRA on the vocabulary-parallel head]: the whole model's lm_head may carry adapters
// (target_modules naming "lm_head", tied to the embedding or not). The head is column-parallel, so
// they split as on any column-parallel base (split_lora: B by the rank's vocabulary rows, A whole,
// entered into the group); their hook adds to this rank's slice of the logits, so the gather for
// evaluation is a later hook, not part of forward.
class VocabParallelHead final : public tp::ColumnParallelLinear {
 public:
  VocabParallelHead(const Linear& full, Tensor rows, distributed::ProcessGroup& group)
      : ColumnParallelLinear(std::move(rows), Tensor(), full.out_features, group, false) {
    split_lora(full, *this, 0, group);
    register_forward_hook([g = &group](Module&, const Tensor&, const Tensor& y) {
      return autograd::grad_mode_enabled() ? y : tp::gather_last_dim(y, *g);
    });
  }
  std::string name() const override { return "VocabParallelHead"; }
};

}  // namespace

ModulePtr vocab_parallel_head(const Linear& full, Tensor rows, distributed::ProcessGroup& group) {
  BOOSTER_CHECK(!full.bias.defined(), IncompatibleError, "tensor parallel: the vocabulary-parallel lm_head has no "
                "bias here, and this one has; use tp_size 1");
  if (!rows.defined()) rows = shard_of(full.weight, ShardSpec{0, 1}, group.rank(), group.size());
  return std::make_shared<VocabParallelHead>(full, std::move(rows), group);
}

ShardedModel gpt_shard_policy(const ModulePtr& model, const ShardContext& c) {
  const auto gpt = std::dynamic_pointer_cast<GPT>(model);
  BOOSTER_CHECK(gpt != nullptr, IncompatibleError, "shard policy 'GPT': the model is a ", model->name(),
                ", not a booster::nn::GPT");
  BOOSTER_CHECK(!gpt->config.tie_word_embeddings || c.stages == 1, IncompatibleError,
                "shard policy 'GPT': tie_word_embeddings shares one tensor between wte (first pipeline stage) and "
                "lm_head (last stage), which a pipeline of ", c.stages, " stages puts on different ranks; use "
                "pp_size 1, or untie the embeddings");
  pp::GPTParts parts = pp::gpt_parts(*gpt);
  const std::vector<int64_t> layers = c.stage_layers.empty() ? pp::balance_gpt_layers(*gpt, c.stages) : c.stage_layers;
  // This stage's blocks [first_block, end_block) (gpt_stage checks `layers` itself; clamped here).
  const int64_t blocks = int64_t(parts.blocks.size());
  int64_t first_block = 0;
  for (int s = 0; s < c.stage && s < int(layers.size()); ++s) first_block += layers[size_t(s)];
  first_block = std::clamp<int64_t>(first_block, 0, blocks);
  const int64_t end_block =
      c.stage < int(layers.size()) ? std::clamp<int64_t>(first_block + layers[size_t(c.stage)], first_block, blocks)
                                   : first_block;
  ShardedModel out;
  distributed::ProcessGroup* group = c.tp;
  if (group != nullptr && group->size() > 1) {
    const GPTConfig& cfg = gpt->config;
    BOOSTER_CHECK(cfg.heads % group->size() == 0 && cfg.vocab_size % group->size() == 0, IncompatibleError,
                  "shard policy 'GPT': tensor parallel size ", group->size(), " must divide the heads (", cfg.heads,
                  ") and the vocabulary (", cfg.vocab_size, ")");
    // Only this stage's layers are split: the others are not this rank's, and split they would take
    // memory (a deferred model's are never allocated at all).
    std::shared_ptr<tp::VocabParallelEmbedding> vocab_wte;
    if (c.stage == 0) parts.wte = vocab_wte = std::make_shared<tp::VocabParallelEmbedding>(*gpt->wte, *group);
    const ModelFamily& family = *find_model_family("gpt");
    for (int64_t b = first_block; b < end_block; ++b) {
      const ModulePtr block = parts.blocks[size_t(b)];
      auto split = std::make_shared<tp::ParallelBlock>(dynamic_cast<const Block&>(*block), *group);
      // LoRA adapters follow their Linear's split by the family's table, B's rows c_attn's q | k | v
      // blocks (Note [LoRA under tensor parallelism] in lora.cpp).
      split_layer_lora(family, block, split, *group);
      parts.blocks[size_t(b)] = split;
    }
    // Tied: one stage (checked above), the head is wte's shard. Adapters on it follow the rows.
    if (c.stage == c.stages - 1)
      parts.lm_head = vocab_parallel_head(*gpt->lm_head, cfg.tie_word_embeddings ? vocab_wte->weight : Tensor(), *group);
    // Each block's Linears by the family's split table (gpt_family.cpp), biases and LoRA following.
    out.shards = family_shards(family, *gpt, cfg.layers);
    out.criterion = vocab_parallel_criterion(*group, cfg.vocab_size, "GPT");
  }
  out.module = pp::gpt_stage(parts, c.stage, c.stages, layers);
  out.module->train(gpt->is_training());
  return out;
}

namespace {

// Layers [begin, end) of an MLPClassifier's Sequential, named as there; the first stage flattens the
// input as the classifier does.
class MLPStage final : public Module {
 public:
  MLPStage(int64_t in_features, bool first) : in_features_(in_features), first_(first) {
    layers = register_module("layers", std::make_shared<Sequential>());
  }
  Tensor forward(const Tensor& x) override {
    if (!first_) return (*layers)(x);
    BOOSTER_CHECK(x.dim() >= 1 && x.numel() == x.size(0) * in_features_, ShapeError,
                  "MLPClassifier: expected input [N, ...] with ", in_features_, " features per sample, got shape ",
                  x.shape());
    return (*layers)(x.reshape({x.size(0), in_features_}));
  }
  std::string name() const override { return "MLPStage"; }
  std::shared_ptr<Sequential> layers;

 private:
  int64_t in_features_;
  bool first_;
};

ShardedModel mlp_policy(const ModulePtr& model, const ShardContext& c) {
  const auto mlp = std::dynamic_pointer_cast<MLPClassifier>(model);
  BOOSTER_CHECK(mlp != nullptr, IncompatibleError, "shard policy 'MLPClassifier': the model is a ", model->name(),
                ", not a booster::nn::MLPClassifier");
  const std::vector<std::pair<std::string, ModulePtr>> children = mlp->layers->named_children();
  // Units: each Linear with the parameter-free modules after it.
  std::vector<std::vector<size_t>> units;
  std::vector<int64_t> sizes;
  int64_t linears = 0;
  for (size_t i = 0; i < children.size(); ++i) {
    if (std::dynamic_pointer_cast<Linear>(children[i].second) || units.empty()) {
      units.emplace_back();
      sizes.push_back(0);
    }
    units.back().push_back(i);
    sizes.back() += children[i].second->num_parameters();
    linears += std::dynamic_pointer_cast<Linear>(children[i].second) != nullptr;
  }
  const std::vector<int64_t> per_stage =
      c.stage_layers.empty() ? pp::balance_units(sizes, 0, 0, c.stages) : c.stage_layers;
  int64_t total = 0;
  bool negative = false;
  for (int64_t n : per_stage) total += n, negative = negative || n < 0;
  BOOSTER_CHECK(int(per_stage.size()) == c.stages && total == int64_t(units.size()) && !negative, ValueError,
                "pipeline: stage_layers ", per_stage, " must give each of the ", c.stages,
                " stages a number of layers (>= 0), together the classifier's ", units.size(), " Linear layers");
  int64_t begin = 0;
  for (int s = 0; s < c.stage; ++s) begin += per_stage[size_t(s)];
  const int64_t end = begin + per_stage[size_t(c.stage)];
  std::vector<int64_t> unit_of(children.size());
  for (size_t u = 0; u < units.size(); ++u)
    for (size_t i : units[u]) unit_of[i] = int64_t(u);

  ShardedModel out;
  std::vector<ModulePtr> layers;
  for (const auto& [name, m] : children) layers.push_back(m);
  distributed::ProcessGroup* group = c.tp;
  if (group != nullptr && group->size() > 1) {
    int64_t k = 0;
    for (size_t i = 0; i < children.size(); ++i) {
      const auto linear = std::dynamic_pointer_cast<Linear>(children[i].second);
      if (!linear) continue;
      const std::string p = "layers." + children[i].first + ".";
      const bool here = unit_of[i] >= begin && unit_of[i] < end;  // only this stage's layers are split
      if (k % 2 == 0) {
        const bool last = k + 1 == linears;
        BOOSTER_CHECK(linear->out_features % group->size() == 0, IncompatibleError, "shard policy 'MLPClassifier': ",
                      p, "out_features ", linear->out_features, " does not divide by the tensor parallel size ",
                      group->size());
        if (here) layers[i] = std::make_shared<tp::ColumnParallelLinear>(*linear, *group, /*gather_output=*/last);
        out.shards[p + "weight"] = {0, 1};
        out.shards[p + "bias"] = {0, 1};
      } else {
        if (here) layers[i] = std::make_shared<tp::RowParallelLinear>(*linear, *group, /*input_is_parallel=*/true);
        out.shards[p + "weight"] = {1, 1};
      }
      ++k;
    }
  }
  auto stage = std::make_shared<MLPStage>(mlp->in_features, c.stage == 0);
  for (int64_t u = begin; u < end; ++u)
    for (size_t i : units[size_t(u)]) stage->layers->push_back(children[i].first, layers[i]);
  stage->train(mlp->is_training());
  out.module = stage;
  return out;
}

struct Registry {
  std::mutex mutex;
  // The decoder families' ("GPT", "Llama") are added by their declarations (families.h).
  std::map<std::string, ShardPolicy> policies{{"MLPClassifier", mlp_policy}};
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_shard_policy(const std::string& model_name, ShardPolicy policy) {
  BOOSTER_CHECK(!model_name.empty() && policy != nullptr, ValueError,
                "register_shard_policy: needs a model name and a policy");
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.policies[model_name] = std::move(policy);
}

std::vector<std::string> registered_shard_policies() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& [name, policy] : r.policies) out.push_back(name);
  return out;
}

ShardPolicy find_shard_policy(const std::string& model_name, const std::string& why) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.policies.find(model_name);
  if (it != r.policies.end()) return it->second;
  std::string known;
  for (const auto& [name, policy] : r.policies) known += (known.empty() ? "" : ", ") + name;
  BOOSTER_FAIL(IncompatibleError, why, " needs a shard policy for the model '", model_name,
               "', and none is registered (policies exist for ", known,
               "); register one with booster::nn::register_shard_policy(\"", model_name,
               "\", policy) before boost(), or use a plugin without tensor or pipeline parallelism (ddp, "
               "low_level_zero)");
}

}  // namespace booster::nn
