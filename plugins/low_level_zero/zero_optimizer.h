// ZeroOptimizer: ZeRO stages 1, 2 and 3 over flat buffers. Float32 master weights, their gradients and
// the optimizer state exist only for this rank's shard of each flat buffer (one per parameter group;
// stage 3: one per module and group, whose parameters exist whole only while the module runs).
//
// How parameters, gradients and optimizer state are partitioned and reduced is Note [ZeRO
// partitions] and Note [ZeRO-3: parameters by module] in this folder's README.md.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "booster/distributed/process_group.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/module.h"
#include "booster/optim/optimizer.h"
#include "booster/mixed_precision/dynamic_grad_scaler.h"

namespace booster::zero {

struct ZeroOptions {
  int stage = 1;                                      // 1, 2 or 3
  DType working_dtype = DType::Float16;               // the model's dtype after configure
  mixed_precision::DynamicGradScalerOptions scaler;   // float16 only
  double max_norm = 0.0;                              // clip in step(); 0: no clipping
  // Stage 2: reduce gradients in buckets of whole parameters (about bucket_numel elements) as backward
  // produces them (Note [ZeRO-2 buckets]); false: one reduce-scatter after backward.
  bool overlap = true;
  int64_t bucket_numel = int64_t(12) << 20;
};

class ZeroOptimizer final : public optim::Optimizer {
 public:
  // Clears the flat gradient buffer (stage 1), this rank's reduced shard gradient and the step's
  // flags, so a backward that was not followed by step() leaves nothing behind (torch drops such
  // gradients at zero_grad too).
  void zero_grad(bool set_to_none = true) override;
  // `original` was built over `model`'s float32 parameters: its type (SGD, Adam, AdamW), groups and
  // options are taken. The parameters must already be equal on every rank. Converts the model to the
  // working dtype and binds its parameters into padded flat buffers (Note [ZeRO partitions]).
  ZeroOptimizer(const optim::Optimizer& original, const nn::ModulePtr& model, distributed::ProcessGroup& group,
                const ZeroOptions& options);
  ~ZeroOptimizer() override;

  // The whole ZeRO step: reduces gradients still pending, agrees on found_inf, clips (max_norm),
  // steps the shard or skips, all-gathers the parameters, updates the loss scale.
  void step() override;
  std::string name() const override { return inner_->name(); }

  // ------------------------------------------------------------ the precision strategy's hooks
  // Before backward: stage 2 gives every parameter a gradient slot in a fresh zeroed buffer.
  void prepare_backward();
  // After backward: reduce-scatter + unscale + local inf/NaN check (unless gradient sync is off).
  void finish_backward();
  // Clips the shards so that the norm of the whole gradient is at most max_norm (collective).
  // Returns the norm before clipping; inf (and nothing clipped) when a gradient is not finite.
  double clip_grad_norm(double max_norm);
  // Stage 1 only (IncompatibleError for stage 2 when disabling).
  void set_gradient_sync(bool enabled);
  double loss_scale() const { return scaler_ ? scaler_->scale() : 1.0; }
  const mixed_precision::StepStats& last_step_stats() const { return stats_; }
  nlohmann::json scaler_state() const;
  void load_scaler_state(const nlohmann::json& state);

  // ------------------------------------------------------------ stage 3 (Note [ZeRO-3: parameters by module])
  // Collective. gather_all(): every module's parameters whole; release_all(): back to the shards only.
  // take_shards_from_parameters(): after code wrote whole parameters (gathered), each rank keeps its
  // shard of them (and, for 16-bit training, masters rounded up from them until a checkpoint's masters
  // replace them). No-ops below stage 3.
  void gather_all();
  void release_all();
  void take_shards_from_parameters();

  // ------------------------------------------------------------ checkpoints (see the Note)
  optim::OptimizerState state_dict() const override;
  void load_state_dict(const optim::OptimizerState& state) override;
  bool state_holds_master_weights() const override { return options_.working_dtype != DType::Float32; }

  // ------------------------------------------------------------ introspection
  int stage() const { return options_.stage; }
  DType working_dtype() const { return options_.working_dtype; }
  // This rank's shard of group g: elements [shard_offset, shard_offset + shard_numel) of the padded
  // flat buffer.
  int64_t shard_offset(size_t g) const { return int64_t(group_.rank()) * parts_.at(g).shard; }
  int64_t shard_numel(size_t g) const { return parts_.at(g).shard; }
  int64_t padded_numel(size_t g) const { return parts_.at(g).padded; }
  const optim::Optimizer& inner() const { return *inner_; }

 protected:
  void check_options(const nlohmann::json&) const override {}  // validated by the inner optimizer
  std::vector<std::string> state_names(const nlohmann::json&) const override { return {}; }

 private:
  // One flat layout (Note [ZeRO partitions]): a parameter group's parameters, or for stage 3 those of
  // one module in one group.
  struct Partition {
    std::vector<Tensor> params;    // the model's parameters, working dtype, views of flat_params
    std::vector<int64_t> offsets;  // start of each parameter; offsets.back() == numel
    int64_t numel = 0, padded = 0, shard = 0;
    size_t group = 0;              // the optimizer's parameter group
    std::vector<size_t> index;     // global index of each parameter (torch's numbering across groups)
    Tensor flat_params;            // `padded` elements, working dtype (stage 3: released at rest)
    Tensor flat_grads;             // `padded` elements, working dtype (stage 2: only during backward)
    Tensor master;                 // `shard` float32 elements: the inner optimizer's parameter
    // Stage 3.
    Tensor shard_params;           // this rank's `shard` elements, working dtype: the parameters at rest
    bool gathered = false;         // flat_params holds the whole parameters (or is being gathered)
    distributed::WorkPtr gather_work;
    int64_t waiting = 0;           // parameters whose gradient has not arrived in this backward
    bool reduced = false;          // its gradients were reduced in this backward
    size_t last_user = 0;          // the last unit (pre-order) that reads it: Note [ZeRO-3: tied parameters]
    // Stage 2 with overlap: buckets of adjacent parameters, last parameters first.
    struct Bucket {
      int64_t begin = 0, end = 0;  // elements of the flat buffer
      size_t first = 0, last = 0;  // parameters [first, last]
      int64_t waiting = 0;         // parameters whose gradient has not arrived in this backward
      Tensor buffer;               // end - begin elements, working dtype, while being reduced
      distributed::WorkPtr work;
    };
    std::vector<Bucket> buckets;
    std::vector<size_t> bucket_of;  // per parameter
    std::vector<size_t> hook_index;  // per parameter: our grad-ready hook's place in its list
  };

  Tensor shard_of(const Tensor& flat, const Partition& p) const;
  // Construction: the partitions of stages 1 and 2 (one per group) or of stage 3 (per module and group).
  void partition_by_group(const optim::Optimizer& original);
  void partition_by_module(const optim::Optimizer& original, const nn::ModulePtr& model);
  // Stage 3 (Note [ZeRO-3: parameters by module]).
  struct Unit {
    nn::Module* module = nullptr;
    std::weak_ptr<nn::Module> owner;  // the module may go first (the optimizer then leaves it alone)
    std::vector<size_t> parts;  // its partitions, ascending, with those of tied parameters it reads
    int64_t pre_hook = 0, post_hook = 0;
  };
  void gather(size_t k, bool async);
  void release(size_t k);
  void prefetch(size_t u);
  void unit_forward_begin(size_t u);
  Tensor unit_forward_end(size_t u, const Tensor& out);
  void unit_backward_begin(size_t u);
  void on_grad_ready_stage3(size_t k);
  void bind_stage3_shards();
  void reduce_unit_partition(size_t k);
  void release_shard_grads();
  std::vector<Unit> units_;
  std::vector<std::vector<size_t>> group_params_;  // global indices of each group's parameters
  bool backward_found_ = false;
  // Reduce-scatters partition p's gradient buffer into master.grad(), unscaling; returns local inf/NaN.
  bool reduce_partition(Partition& p, bool accumulate);
  void reduce_pending();
  bool agreed_found_inf();
  void forward_options() const;
  void end_step();

  distributed::ProcessGroup& group_;
  ZeroOptions options_;
  Device device_;  // of the model, its buffers and shards; the group's device
  std::vector<Partition> parts_;
  std::unique_ptr<optim::Optimizer> inner_;
  std::optional<mixed_precision::DynamicGradScaler> scaler_;  // float16 only

  // Note [ZeRO-2 buckets] (in zero_optimizer.cpp).
  void on_grad_ready(size_t g, size_t j);
  bool reduce_buckets(Partition& p, bool accumulate);
  bool bucketed() const { return options_.stage == 2 && options_.overlap; }
  bool in_backward_ = false;
  // Hooks on the parameters hold this weakly: the model may outlive the optimizer.
  std::shared_ptr<ZeroOptimizer*> self_;

  // Per step.
  bool sync_enabled_ = true;
  bool unreduced_ = false;     // backward ran with sync off (stage 1): the buffer holds a local sum
  bool have_grads_ = false;    // master.grad() holds reduced gradients for this step
  bool local_found_inf_ = false;
  bool agreed_ = false, found_inf_ = false;
  bool clipped_ = false;
  double grad_norm_ = std::numeric_limits<double>::quiet_NaN();
  mixed_precision::StepStats stats_;
};

}  // namespace booster::zero
