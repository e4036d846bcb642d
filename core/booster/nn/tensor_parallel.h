// Megatron-style tensor parallelism: the communication functions as autograd ops, and the column- and
// row-parallel Linear layers built on them. Each rank of a tensor-parallel group holds 1/tp of a
// layer's weight; an MLP block Column -> activation -> Row needs one all-reduce forward and one
// backward (Megatron-LM's f and g).
//
// The group must outlive the modules and functions that use it; every rank of it runs the same
// layers in the same order (each call is a collective).
#pragma once

#include "booster/distributed/process_group.h"
#include "booster/nn/dropout.h"
#include "booster/nn/embedding.h"
#include "booster/nn/linear.h"
#include "booster/nn/module.h"
#include "booster/nn/transformer.h"
#include "booster/tensor/random.h"

namespace booster::nn::tp {

// Seconds this process has spent in the tensor-parallel collectives below (forward and backward), for
// measuring their share of a step (bench/README.md).
double communication_seconds();

// f: identity forward, all-reduce (sum) of the gradient backward. Where a replicated activation
// enters column-parallel layers.
Tensor copy_to_group(const Tensor& x, distributed::ProcessGroup& group);
// g: all-reduce (sum) forward, identity backward. Where row-parallel partial sums leave.
Tensor reduce_from_group(const Tensor& x, distributed::ProcessGroup& group);
// The ranks' x concatenated along the last dim, in rank order; backward keeps this rank's slice.
Tensor gather_last_dim(const Tensor& x, distributed::ProcessGroup& group);
// This rank's slice of the last dim (which must divide by the group size); backward all-gathers.
Tensor split_last_dim(const Tensor& x, distributed::ProcessGroup& group);

// y = x A^T + b with A split by rows (output features): this rank holds rows
// [rank * out / tp, (rank + 1) * out / tp) of A and b, and computes that slice of y. With
// gather_output the slices are all-gathered into the whole y.
class ColumnParallelLinear : public Module {
 public:
  // Initialized as nn::Linear(in, out, bias, gen) would be, then sliced: a tensor-parallel model starts
  // from the same weights as its single-process twin built from the same generator. out must divide
  // by the group size (ShapeError naming both).
  ColumnParallelLinear(int64_t in_features, int64_t out_features, distributed::ProcessGroup& group, bool bias = true,
                       bool gather_output = false, Generator* gen = nullptr);
  // This rank's rows of an existing layer (its weights copied, so the layer itself is untouched).
  ColumnParallelLinear(const Linear& full, distributed::ProcessGroup& group, bool gather_output = false);
  // Given shards: weight [out / tp, in], bias [out / tp] or undefined.
  ColumnParallelLinear(Tensor weight_shard, Tensor bias_shard, int64_t out_features, distributed::ProcessGroup& group,
                       bool gather_output);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "ColumnParallelLinear"; }
  std::string extra_repr() const override;
  distributed::ProcessGroup& group() const { return *group_; }

  int64_t in_features, out_features, out_per_rank;
  bool gather_output;
  Tensor weight;  // [out / tp, in]
  Tensor bias;    // [out / tp], undefined without bias

 private:
  distributed::ProcessGroup* group_;
};

// y = x A^T + b with A split by columns (input features): this rank holds columns
// [rank * in / tp, (rank + 1) * in / tp) of A and multiplies its slice of x; the partial products are
// all-reduced and the whole bias (replicated) added once. With input_is_parallel the input already is
// this rank's slice (a column-parallel layer's output); otherwise the layer takes its slice.
class RowParallelLinear : public Module {
 public:
  // Initialized as nn::Linear(in, out, bias, gen), then sliced; in must divide by the group size.
  RowParallelLinear(int64_t in_features, int64_t out_features, distributed::ProcessGroup& group, bool bias = true,
                    bool input_is_parallel = true, Generator* gen = nullptr);
  // This rank's columns of an existing layer (its weights copied).
  RowParallelLinear(const Linear& full, distributed::ProcessGroup& group, bool input_is_parallel = true);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "RowParallelLinear"; }
  std::string extra_repr() const override;

  int64_t in_features, out_features, in_per_rank;
  bool input_is_parallel;
  Tensor weight;  // [out, in / tp]
  Tensor bias;    // [out], the same on every rank

 private:
  distributed::ProcessGroup* group_;
};

// Causal self-attention split by heads: this rank computes heads [rank * H / tp, (rank + 1) * H / tp).
// c_attn is column-parallel over the q, k and v rows of those heads, c_proj row-parallel over their
// features; one all-reduce forward (after c_proj) and one backward (into x). Built from an existing
// CausalSelfAttention, whose weights it slices (copies) and whose dropout module it shares, so the
// ranks draw the same masks as the single-process model.
class ParallelCausalSelfAttention : public Module {
 public:
  ParallelCausalSelfAttention(const CausalSelfAttention& full, distributed::ProcessGroup& group);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "ParallelCausalSelfAttention"; }

  const int64_t width, heads, local_heads;
  std::shared_ptr<ColumnParallelLinear> c_attn;  // width -> 3 width / tp (this rank's q, k, v)
  std::shared_ptr<RowParallelLinear> c_proj;     // width / tp -> width
  std::shared_ptr<Dropout> resid_dropout;
};

// The GPT's feed-forward split Megatron's way: c_fc column-parallel (4 width / tp features per rank),
// GELU on the slice, c_proj row-parallel; one all-reduce forward, one backward. Built from an existing
// MLP (weights copied, dropout shared).
class ParallelMLP : public Module {
 public:
  ParallelMLP(const MLP& full, distributed::ProcessGroup& group);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "ParallelMLP"; }

  std::shared_ptr<ColumnParallelLinear> c_fc;
  ModulePtr gelu;
  std::shared_ptr<RowParallelLinear> c_proj;
  ModulePtr dropout;
};

// A transformer Block with its attention split by heads and its MLP as above; the layer norms are
// replicated (the Block's own modules, shared). Named as the Block ("attn.c_attn.weight", ...).
class ParallelBlock : public Module {
 public:
  ParallelBlock(const Block& full, distributed::ProcessGroup& group);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "ParallelBlock"; }

  ModulePtr ln_1;
  std::shared_ptr<ParallelCausalSelfAttention> attn;
  ModulePtr ln_2;
  std::shared_ptr<ParallelMLP> mlp;
};

// An embedding with the vocabulary split by rows: this rank holds rows [rank * V / tp, (rank + 1) * V / tp).
// Ids outside the shard look up zeros; the ranks' partial rows are all-reduced, so every rank gets the
// whole [..., dim] output. Initialized as nn::Embedding(num, dim, gen), then sliced.
class VocabParallelEmbedding : public Module {
 public:
  VocabParallelEmbedding(int64_t num_embeddings, int64_t embedding_dim, distributed::ProcessGroup& group,
                         Generator* gen = nullptr);
  // This rank's rows of an existing embedding (copied).
  VocabParallelEmbedding(const Embedding& full, distributed::ProcessGroup& group);
  Tensor forward(const Tensor& indices) override;
  std::string name() const override { return "VocabParallelEmbedding"; }
  std::string extra_repr() const override;

  int64_t num_embeddings, embedding_dim, rows_per_rank;
  Tensor weight;  // [V / tp, dim]

 private:
  distributed::ProcessGroup* group_;
};

// Mean cross-entropy of logits whose vocabulary is split across the group (this rank's slice
// [..., V / tp], as a column-parallel lm_head without gather_output gives them) against whole-vocabulary
// targets [...], without gathering the logits: the max, the sum of exponentials and the target's
// logit are each reduced over the group as [N] vectors. Targets equal to ignore_index count for
// neither the loss nor the mean, as torch's cross_entropy. Computed in float32.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& target, distributed::ProcessGroup& group,
                                    int64_t ignore_index = -100);

}  // namespace booster::nn::tp
