#include "booster/nn/tensor_parallel.h"

#include <atomic>
#include <chrono>

#include "booster/autograd/autograd.h"
#include "booster/nn/embedding.h"
#include "booster/nn/linear.h"
#include "booster/nn/packing.h"
#include "booster/nn/shard_policy.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"

namespace booster::nn::tp {

namespace {

std::atomic<int64_t> g_communication_ns{0};

// Adds the time from its construction to its destruction to the communication time.
struct CommunicationTimer {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~CommunicationTimer() {
    g_communication_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  }
};

Tensor all_reduced(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = x.detach().contiguous().clone();
  const CommunicationTimer timer;
  group.all_reduce(out);
  return out;
}

Tensor gathered(const Tensor& x, distributed::ProcessGroup& group) {
  const Tensor in = x.detach().contiguous();
  const int n = group.size();
  Tensor all = Tensor::empty({int64_t(n) * in.numel()}, in.dtype(), in.device());
  {
    const CommunicationTimer timer;
    group.all_gather(all, in);
  }
  std::vector<Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(all.narrow(0, r * in.numel(), in.numel()).reshape(in.shape()));
  return cat(parts, -1);
}

Tensor slice_of(const Tensor& x, distributed::ProcessGroup& group) {
  const int64_t last = x.size(-1), n = group.size();
  BOOSTER_CHECK(last % n == 0, ShapeError, "tensor parallel: the last dim ", last, " of shape ", x.shape(),
                " does not divide by the tensor-parallel size ", n);
  return x.narrow(-1, group.rank() * (last / n), last / n).contiguous();
}

// The rows [rank * rows / n, (rank + 1) * rows / n) of `full` along dim 0 (weights) or dim 1.
Tensor shard(const Tensor& full, int64_t dim, distributed::ProcessGroup& group, const char* layer, const char* what) {
  const int64_t total = full.size(dim), n = group.size();
  BOOSTER_CHECK(total % n == 0, ShapeError, layer, ": ", what, " ", total, " does not divide by the tensor-parallel size ",
                n);
  return shard_of(full, ShardSpec{dim, 1}, group.rank(), int(n));
}

}  // namespace

double communication_seconds() { return double(g_communication_ns.load()) * 1e-9; }

Tensor copy_to_group(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = x.detach();
  if (autograd::needs_grad({&x}))
    autograd::record(out, "CopyToTensorParallelBackward", {x},
                     [&group](const Tensor& g) { return autograd::grads{all_reduced(g, group)}; });
  return out;
}

Tensor reduce_from_group(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = all_reduced(x, group);
  if (autograd::needs_grad({&x}))
    autograd::record(out, "ReduceFromTensorParallelBackward", {x}, [](const Tensor& g) { return autograd::grads{g}; });
  return out;
}

Tensor gather_last_dim(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = gathered(x, group);
  if (autograd::needs_grad({&x}))
    autograd::record(out, "GatherFromTensorParallelBackward", {x},
                     [&group](const Tensor& g) { return autograd::grads{slice_of(g, group)}; });
  return out;
}

Tensor split_last_dim(const Tensor& x, distributed::ProcessGroup& group) {
  Tensor out = slice_of(x.detach(), group);
  if (autograd::needs_grad({&x}))
    autograd::record(out, "SplitToTensorParallelBackward", {x},
                     [&group](const Tensor& g) { return autograd::grads{gathered(g, group)}; });
  return out;
}

ColumnParallelLinear::ColumnParallelLinear(int64_t in, int64_t out, distributed::ProcessGroup& group, bool with_bias,
                                           bool gather, Generator* gen)
    : ColumnParallelLinear(Linear(in, out, with_bias, gen), group, gather) {}

ColumnParallelLinear::ColumnParallelLinear(const Linear& full, distributed::ProcessGroup& group, bool gather)
    : ColumnParallelLinear(shard(full.weight, 0, group, "ColumnParallelLinear", "out_features"),
                           full.bias.defined() ? shard(full.bias, 0, group, "ColumnParallelLinear", "out_features")
                                               : Tensor(),
                           full.out_features, group, gather) {}

ColumnParallelLinear::ColumnParallelLinear(Tensor weight_shard, Tensor bias_shard, int64_t out,
                                           distributed::ProcessGroup& group, bool gather)
    : in_features(weight_shard.size(1)), out_features(out), out_per_rank(weight_shard.size(0)), gather_output(gather),
      group_(&group) {
  BOOSTER_CHECK(out_per_rank * group.size() == out, ShapeError, "ColumnParallelLinear: a shard of ", out_per_rank,
                " rows on each of ", group.size(), " ranks is not ", out, " out_features");
  weight = register_parameter("weight", std::move(weight_shard));
  if (bias_shard.defined()) bias = register_parameter("bias", std::move(bias_shard));
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  BOOSTER_CHECK(x.dim() >= 1 && x.size(-1) == in_features, ShapeError, "ColumnParallelLinear: expected input [..., ",
                in_features, "], got shape ", x.shape());
  const Tensor y = linear(copy_to_group(x, *group_), weight, bias);
  return gather_output ? gather_last_dim(y, *group_) : y;
}

std::string ColumnParallelLinear::extra_repr() const {
  return str("in_features=", in_features, ", out_features=", out_features, " (", out_per_rank, " per rank), bias=",
             bias.defined() ? "True" : "False", ", gather_output=", gather_output ? "True" : "False");
}

RowParallelLinear::RowParallelLinear(int64_t in, int64_t out, distributed::ProcessGroup& group, bool with_bias,
                                     bool parallel_input, Generator* gen)
    : RowParallelLinear(Linear(in, out, with_bias, gen), group, parallel_input) {}

RowParallelLinear::RowParallelLinear(const Linear& full, distributed::ProcessGroup& group, bool parallel_input)
    : in_features(full.in_features), out_features(full.out_features), in_per_rank(full.in_features / group.size()),
      input_is_parallel(parallel_input), group_(&group) {
  weight = register_parameter("weight", shard(full.weight, 1, group, "RowParallelLinear", "in_features"));
  // Replicated: a copy (made from the recorded values when the whole model is deferred).
  if (full.bias.defined()) bias = register_parameter("bias", select_ranges(full.bias.detach(), 0, {0}, full.out_features));
}

ParallelCausalSelfAttention::ParallelCausalSelfAttention(const CausalSelfAttention& full,
                                                         distributed::ProcessGroup& group)
    : width(full.width), heads(full.heads), local_heads(full.heads / group.size()) {
  BOOSTER_CHECK(heads % group.size() == 0, ShapeError, "ParallelCausalSelfAttention: ", heads,
                " heads do not divide by the tensor-parallel size ", group.size());
  // c_attn's rows are [q; k; v], heads contiguous within each: this rank takes its heads' rows of each.
  const ShardSpec qkv{0, 3};
  const Tensor w = shard_of(full.c_attn->weight, qkv, group.rank(), group.size());
  const Tensor b = full.c_attn->bias.defined() ? shard_of(full.c_attn->bias, qkv, group.rank(), group.size()) : Tensor();
  c_attn = register_module("c_attn", std::make_shared<ColumnParallelLinear>(w, b, 3 * width, group, false));
  c_proj = register_module("c_proj", std::make_shared<RowParallelLinear>(*full.c_proj, group, true));
  resid_dropout = register_module("resid_dropout", full.resid_dropout);
}

Tensor ParallelCausalSelfAttention::forward(const Tensor& x) {
  BOOSTER_CHECK(x.dim() == 3 && x.size(2) == width, ShapeError, "ParallelCausalSelfAttention: expected input [B, T, ",
                width, "], got shape ", x.shape());
  const int64_t B = x.size(0), T = x.size(1), head_dim = width / heads, local = local_heads * head_dim;
  const std::vector<Tensor> qkv = split((*c_attn)(x), local, 2);
  auto to_heads = [&](const Tensor& t) { return t.view({B, T, local_heads, head_dim}).transpose(1, 2); };
  AttentionMask mask;  // Note [Packed sequences]: a packed forward's records attend only to themselves
  if (const SequenceLayout* packed = current_sequence_layout()) mask.segments = packed->segments;
  Tensor y = scaled_dot_product_attention(to_heads(qkv[0]), to_heads(qkv[1]), to_heads(qkv[2]), true, std::nullopt, mask);
  y = y.transpose(1, 2).reshape({B, T, local});
  return (*resid_dropout)((*c_proj)(y));
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  const int64_t want = input_is_parallel ? in_per_rank : in_features;
  BOOSTER_CHECK(x.dim() >= 1 && x.size(-1) == want, ShapeError, "RowParallelLinear: expected input [..., ", want,
                input_is_parallel ? "] (this rank's slice of " : "] (of ", in_features, " features), got shape ",
                x.shape());
  const Tensor local = input_is_parallel ? x : split_last_dim(x, *group_);
  const Tensor y = reduce_from_group(linear(local, weight, Tensor()), *group_);
  return bias.defined() ? y + bias : y;
}

std::string RowParallelLinear::extra_repr() const {
  return str("in_features=", in_features, " (", in_per_rank, " per rank), out_features=", out_features,
             ", bias=", bias.defined() ? "True" : "False", ", input_is_parallel=", input_is_parallel ? "True" : "False");
}

VocabParallelEmbedding::VocabParallelEmbedding(int64_t num, int64_t dim, distributed::ProcessGroup& group,
                                               Generator* gen)
    : num_embeddings(num), embedding_dim(dim), rows_per_rank(num / group.size()), group_(&group) {
  const Embedding full(num, dim, gen);
  weight = register_parameter("weight", shard(full.weight, 0, group, "VocabParallelEmbedding", "num_embeddings"));
}

VocabParallelEmbedding::VocabParallelEmbedding(const Embedding& full, distributed::ProcessGroup& group)
    : num_embeddings(full.num_embeddings),
      embedding_dim(full.embedding_dim),
      rows_per_rank(full.num_embeddings / group.size()),
      group_(&group) {
  weight = register_parameter("weight", shard(full.weight, 0, group, "VocabParallelEmbedding", "num_embeddings"));
}

ParallelMLP::ParallelMLP(const MLP& full, distributed::ProcessGroup& group) {
  c_fc = register_module("c_fc", std::make_shared<ColumnParallelLinear>(*full.c_fc, group, false));
  gelu = register_module("gelu", full.gelu);
  c_proj = register_module("c_proj", std::make_shared<RowParallelLinear>(*full.c_proj, group, true));
  dropout = register_module("dropout", full.dropout);
}

Tensor ParallelMLP::forward(const Tensor& x) { return (*dropout)((*c_proj)((*gelu)((*c_fc)(x)))); }

ParallelBlock::ParallelBlock(const Block& full, distributed::ProcessGroup& group) {
  ln_1 = register_module("ln_1", full.ln_1);
  attn = register_module("attn", std::make_shared<ParallelCausalSelfAttention>(*full.attn, group));
  ln_2 = register_module("ln_2", full.ln_2);
  mlp = register_module("mlp", std::make_shared<ParallelMLP>(*full.mlp, group));
}

Tensor ParallelBlock::forward(const Tensor& x) {
  Tensor h = x + (*attn)((*ln_1)(x));
  return h + (*mlp)((*ln_2)(h));
}

namespace {

// Ids of [first, first + count) as local indices (others 0) and a mask (1 where in range; 0 also
// for ignore_index), both on `device`.
std::pair<Tensor, Tensor> local_ids(const Tensor& ids, int64_t first, int64_t count, int64_t ignore_index,
                                    DType mask_dtype) {
  BOOSTER_CHECK(ids.dtype() == DType::Int64, DTypeError, "tensor parallel: ids must be int64, got ", ids.dtype());
  const std::vector<int64_t> v = ids.to_vector<int64_t>();
  std::vector<int64_t> local(v.size(), 0);
  std::vector<float> keep(v.size(), 0.0f);
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] != ignore_index && v[i] >= first && v[i] < first + count) {
      local[i] = v[i] - first;
      keep[i] = 1.0f;
    }
  return {from_vector(local, ids.shape()).to(ids.device()), from_vector(keep, ids.shape()).to(mask_dtype).to(ids.device())};
}

}  // namespace

Tensor VocabParallelEmbedding::forward(const Tensor& indices) {
  const std::vector<int64_t> all = indices.to_vector<int64_t>();
  for (int64_t id : all)
    BOOSTER_CHECK(id >= 0 && id < num_embeddings, IndexError, "VocabParallelEmbedding: index ", id,
                  " is out of range for ", num_embeddings, " embeddings");
  const auto [local, keep] =
      local_ids(indices, group_->rank() * rows_per_rank, rows_per_rank, -1, weight.dtype());
  return reduce_from_group(embedding(weight, local) * keep.unsqueeze(-1), *group_);
}

std::string VocabParallelEmbedding::extra_repr() const {
  return str(num_embeddings, " (", rows_per_rank, " per rank), ", embedding_dim);
}

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& target, distributed::ProcessGroup& group,
                                    int64_t ignore_index) {
  const int64_t v_local = logits.size(-1);
  BOOSTER_CHECK(logits.dim() >= 2 && target.numel() * v_local == logits.numel(), ShapeError,
                "vocab_parallel_cross_entropy: logits ", logits.shape(), " do not match targets ", target.shape());
  const Tensor x = logits.reshape({-1, v_local}).to(DType::Float32);
  const Tensor t = target.reshape({-1});
  // The row maxima over the whole vocabulary: a constant shift, so no gradient goes through it.
  Tensor row_max = max(x.detach(), 1, /*keepdim=*/true).contiguous();
  {
    const CommunicationTimer timer;
    group.all_reduce(row_max, distributed::ReduceOp::Max);
  }
  const Tensor shifted = x - row_max;
  const Tensor lse = log(reduce_from_group(sum(exp(shifted), {1}), group));
  const auto [local, keep] = local_ids(t, group.rank() * v_local, v_local, ignore_index, DType::Float32);
  const Tensor picked = reduce_from_group(gather(shifted, 1, local.unsqueeze(1)).squeeze(1) * keep, group);
  // Rows whose target is ignore_index: none of the ranks holds it, and they are dropped from the mean.
  const std::vector<int64_t> tv = t.to_vector<int64_t>();
  std::vector<float> valid(tv.size());
  int64_t count = 0;
  for (size_t i = 0; i < tv.size(); ++i) count += (valid[i] = tv[i] != ignore_index ? 1.0f : 0.0f) != 0.0f;
  const Tensor valid_t = from_vector(valid, {int64_t(valid.size())}).to(x.device());
  return sum((lse - picked) * valid_t) / double(count);  // NaN with every target ignored, as torch
}

}  // namespace booster::nn::tp
