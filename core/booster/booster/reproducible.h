// Reproducible training across world sizes: the same bytes (weights, optimizer state, logged loss) on 1,
// 2, 4, ... processes. What Booster::reproducible_step and the Trainer's `train.reproducible` use: the
// checks that say where the guarantee holds (ConfigError naming the sizes that would work), the fixed
// order of chunks, and the binary tree that sums the chunks' gradients whatever rank holds them.
//
// Note [Reproducible training across world sizes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Float addition is not associative, so a gradient summed over 2 ranks and one summed over 4 differ in
// their last bits, and under Adam such bits in near-zero gradients become lr-sized steps. So the sum's
// order is fixed by the data, not by the world size:
// * The global batch of a step (every rank's rows of every micro-batch) is cut into K chunks (K a power
//   of two, dividing the batch). Row p of the global batch (as a DistributedSampler deals it: rank
//   p mod W, local row p div W, micro-batches one after another) belongs to chunk p mod K. With W
//   dividing K, rank r holds exactly the chunks c = r + W m, and its local chunk m is its rows
//   i with i mod (K / W) == m, in order: the same rows, in the same order, as at any other world size.
// * Each chunk's gradient is computed on its own: a forward and a backward of criterion / K. The same
//   rows and the same shapes give the same bits wherever the chunk runs.
// * The chunks' gradients are summed in one fixed binary tree: the sum over a set of chunks
//   {c : c = a mod 2^l} is the sum over {c = a mod 2^(l+1)} plus the sum over {c = a + 2^l mod 2^(l+1)},
//   down to single chunks. Rank r's chunks at world size W = 2^w are the node {c = r mod W}: a subtree,
//   summed locally (leaves in bit-reversed order, as a pairwise stack sums them). The W partial sums are
//   the tree's top w levels: rank r's partial is leaf bitrev(r), so 4 ranks add (P0 + P2) + (P1 + P3).
// * Across ranks: every rank all-gathers the partial sums and adds them in that order (the simple first
//   version: (W - 1) times the gradient's bytes received per rank, where a ring all-reduce moves
//   2 (W - 1) / W times). Every rank then holds the same total G. Under ddp (and on one process) the
//   optimizer steps with G as it is, gradient sync staying off. ZeRO-1 reduce-scatters its gradient
//   buffer at its step whatever happened before, so its reduction runs, made exact: rank 0 hands it
//   W * G and the others zeros, and it averages (divides by the power of two W, exact, then adds zeros,
//   exact) in whatever order it likes. -0 is made +0 first (G + 0), so zeros cannot differ in sign
//   between world sizes.
// * The loss is summed in the same tree (float64) and divided by K.
// Where it cannot hold it is refused (check_layout, check_sizes, check_model): tensor parallelism (a row-
// parallel layer sums over tensor ranks inside the forward), pipeline parallelism and ZeRO stages 2 and
// 3 (they reduce every backward into the shard, so the chunk sums cannot be ordered yet), float16
// gradients (W * G could overflow where G does not, changing the loss scale's decisions: a float16 model,
// ZeRO's fp16; the fp16 strategy, autocast with float32 gradients, is supported, its dynamic loss scale
// included), other strategies (fp16_naive, fp16_apex, fp8: untested), clipping under ZeRO (the norm is
// summed over shards), and dropout (its masks follow the rank, not the sample).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/distributed/process_group.h"
#include "booster/nn/module.h"
#include "booster/plugin/parallel_plugin.h"

namespace booster::reproducible {

// The chunks a global batch of `global_rows` rows is cut into when none are given: the largest power of
// two that divides it, at most kMaxDefaultChunks (so 1, 2, 4 and 8 processes are covered when the
// batch allows).
inline constexpr int64_t kMaxDefaultChunks = 8;
int64_t default_chunks(int64_t global_rows);

// The world sizes at which `chunks` chunks give the same bytes: the powers of two that divide it.
std::vector<int> world_sizes(int64_t chunks);
// "1, 2 or 4".
std::string describe_world_sizes(int64_t chunks);

// ConfigError (starting with `where`) unless `chunks` is a power of two, divides `global_rows`, and
// `world` divides `chunks`; the message names the sizes that would work.
void check_sizes(int64_t chunks, int64_t global_rows, int world, const std::string& where);
// ConfigError for a plugin or strategy under which the guarantee cannot hold (the Note's list):
// `plugin` is the plugin's name ("" or "single" for one process), `layout` its layout, `options` its
// options, `precision` the Booster's strategy name, `clipping` whether gradients are clipped.
void check_layout(const std::string& plugin, const ParallelLayout& layout, const nlohmann::json& options,
                  const std::string& precision, bool clipping = false);
// ConfigError naming the first nn::Dropout with p > 0 (its masks depend on the rank that draws them).
void check_model(const nn::Module& model);

// What `booster check` says of a resolved training config on `world_size` processes: one line saying
// that it is not reproducible, or at which world sizes (with which data.batch_size) it gives the same
// bytes. ConfigError (naming the setting and what would work) where train.reproducible cannot hold.
std::string describe_config(const nlohmann::json& config, int world_size);

// The leaf at `position` of a tree over `count` leaves (a power of two): the bit reversal of position.
int64_t leaf(int64_t position, int64_t count);

// Pairwise sums in the Note's tree over the gradients of a fixed set of parameters: one flat buffer per
// dtype and stack level, allocated at the first step and reused (no allocation per chunk).
class GradientTree {
 public:
  // `params`: the parameters whose .grad are summed (those that require grad).
  explicit GradientTree(std::vector<Tensor> params);

  // Starts a new sum.
  void clear();
  // The parameters' current gradients as the next leaf (an undefined gradient counts as zeros), then
  // combines equal subtrees; zeroes the gradients for the next chunk.
  void push_gradients();
  // The local sum is complete (a power-of-two number of leaves): replaces it by the sum over every
  // rank of `group` in the tree's order (all-gather, then the top levels). No-op on one rank.
  void combine_ranks(distributed::ProcessGroup& group);
  // Writes the total into the parameters' gradients: on rank 0 times `scale`, on other ranks zeros
  // when `zeros_elsewhere`; -0 becomes +0 (the Note).
  void write_gradients(double scale, bool zeros_elsewhere, int rank);
  // Bytes one rank received in the last combine_ranks (the communication volume).
  int64_t received_bytes() const { return received_bytes_; }

 private:
  struct Group {
    DType dtype;
    std::vector<Tensor> params;
    std::vector<int64_t> offsets;  // offsets.back() == numel
    std::vector<Tensor> levels;    // stack slots, `numel` elements each
    Tensor gathered;               // world * numel elements
    Tensor zero;                   // one zero, added to make -0 +0
  };
  void push(const std::function<void(Group&, Tensor&)>& fill);
  Tensor& slot(Group& g, size_t i);
  std::vector<Group> groups_;
  std::vector<int> heights_;
  int64_t received_bytes_ = 0;
};

// The same pairwise tree over float64 values (the chunks' losses).
class ValueTree {
 public:
  void clear() { stack_.clear(); }
  void push(double value);
  double total() const;  // the one remaining subtree (0 when empty)
  // As GradientTree::combine_ranks, on one float64.
  void combine_ranks(distributed::ProcessGroup& group);

 private:
  std::vector<std::pair<double, int>> stack_;  // (sum, height)
};

}  // namespace booster::reproducible
