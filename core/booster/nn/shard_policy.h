// Shard policies: how a model is split for hybrid parallelism (booster/nn/tensor_parallel.h,
// booster/nn/pipeline.h), after ColossalAI's Shardformer policies. A policy takes the whole model and
// this rank's place (its tensor-parallel group, its pipeline stage) and returns the part this rank
// runs: the layers it holds, split Megatron's way where the policy says so, and named as in the whole
// model, so that the parts' state dicts together make the whole model's (Note [Shard policies] in
// shard_policy.cpp).
//
// Built in: "GPT", "Llama" and "MLPClassifier" (by Module::name()). A user's model gets one with
// register_shard_policy(); a model without one is refused by name (IncompatibleError).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "booster/distributed/process_group.h"
#include "booster/nn/loss.h"
#include "booster/nn/module.h"

namespace booster::nn {

// How a parameter is split across the tensor-parallel ranks: the whole tensor is `chunks` equal blocks
// along `dim`, and rank r holds the r-th of tp equal pieces of each block, concatenated (chunks 1: one
// contiguous slice; 3: attention's [q; k; v] rows, each split by heads).
struct ShardSpec {
  int64_t dim = 0;
  int64_t chunks = 1;
};

// Where this rank sits. tp is the tensor-parallel group (size 1: no tensor parallelism); the stage is
// this rank's of `stages` pipeline stages; stage_layers the policy's units per stage (empty: balanced
// by parameters).
struct ShardContext {
  distributed::ProcessGroup* tp = nullptr;
  int stage = 0;
  int stages = 1;
  std::vector<int64_t> stage_layers;
};

// This rank's part of the model.
struct ShardedModel {
  // The layers this rank runs. Its parameters are the whole model's where they are not split (the same
  // tensors) and new shards where they are; all named as in the whole model.
  ModulePtr module;
  // When set, replaces the criterion passed to boost() (the model's output is split across the tensor
  // group and the loss must be computed without gathering it). Called with the criterion passed in.
  std::function<Criterion(const Criterion& user)> criterion;
  // The split parameters by name (the whole model's); a parameter not named here is replicated.
  std::map<std::string, ShardSpec> shards;
};

using ShardPolicy = std::function<ShardedModel(const ModulePtr& model, const ShardContext& context)>;

// Registers the policy for models whose name() is `model_name` (replacing an earlier one).
void register_shard_policy(const std::string& model_name, ShardPolicy policy);
// The policy for `model_name`; IncompatibleError naming the model, `why` (what needs one) and the
// models that have one, and how to register one, when there is none.
ShardPolicy find_shard_policy(const std::string& model_name, const std::string& why);
std::vector<std::string> registered_shard_policies();

// ShardedModel::criterion for a model whose logits leave column-parallel over a vocabulary of `vocab`
// (split in training, gathered in evaluation): the vocabulary-parallel cross-entropy on split logits,
// checked once against the user's criterion on the gathered ones (anything but plain cross-entropy is
// an IncompatibleError naming `policy`), and the user's criterion on gathered logits. The group must
// outlive it.
std::function<Criterion(const Criterion&)> vocab_parallel_criterion(distributed::ProcessGroup& group, int64_t vocab,
                                                                const std::string& policy);
// A model's lm_head `full` column-parallel over the vocabulary (logits split while gradients are
// recorded, gathered otherwise): `rows` this rank's rows of its weight (undefined: taken from `full`;
// a tied head passes the vocabulary-parallel embedding's shard), its LoRA adapters split by the same
// rows. IncompatibleError for a head with a bias.
class Linear;
ModulePtr vocab_parallel_head(const Linear& full, Tensor rows, distributed::ProcessGroup& group);

// This rank's piece of `whole` under `spec` (rank of `size`), and the whole from every rank's piece
// (in rank order): the inverse of each other.
// The built-in GPT's policy (Note [Shard policies] in shard_policy.cpp), registered under "GPT" by its
// family declaration (gpt_family.cpp).
ShardedModel gpt_shard_policy(const ModulePtr& model, const ShardContext& context);

Tensor shard_of(const Tensor& whole, const ShardSpec& spec, int rank, int size);
Tensor unshard(const std::vector<Tensor>& pieces, const ShardSpec& spec);

}  // namespace booster::nn
