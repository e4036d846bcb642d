// fp8 training: per-tensor scaling (current or delayed, as Transformer Engine) and the linear layers the
// "fp8" strategy computes with float8 GEMM inputs (mixed_precision/fp8.cpp). mixed_precision/README.md
// describes the strategy; this header is its machinery, public so a plugin can build on it.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "booster/autocast/autocast.h"
#include "booster/mixed_precision/mixed_precision.h"

namespace booster::mixed_precision {

struct Float8ScalingOptions {
  bool delayed = true;                    // false: current scaling (the amax of the tensor being cast)
  int64_t amax_history_len = 1024;        // delayed: steps of amax kept
  std::string amax_compute_algo = "max";  // delayed: "max" over the history, or "most_recent"
  int margin = 0;                         // scale = fp8_max / amax / 2^margin
};

// Note [Float8 scaling]
// A tensor is cast as fp8(x * scale) (saturating) and its GEMM result multiplied by 1 / (product of
// the operands' scales). scale = fp8_max / amax / 2^margin puts the tensor's largest magnitude at the
// top of the format; an amax of 0, inf or NaN keeps the previous scale (initially 1).
//   current: amax is the tensor's own, measured before the cast.
//   delayed: the cast uses the scale of the last update; each cast records its amax, and update() (once
//            per optimizer step) pushes the step's largest recorded amax into a history of
//            amax_history_len steps and recomputes the scale from the history's max (or its most
//            recent entry). Transformer Engine's DelayedScaling with interval 1.
// Only training records: a forward with grad mode off (an evaluation, generation) casts with the scale
// it finds and leaves the state as it was (Note [Forwards that do not train]).
//
// Note [Forwards that do not train]
// An evaluation's forwards see other data than the training batches. Had their amaxes entered the
// step's record (delayed) or the scale (current), the next training step would cast with a scale the
// evaluation chose, and a run with evaluations would train other weights than the same run without:
// eval_every would change training. So the fp8 layers record only in forwards under grad mode, which
// every training forward is (an activation-checkpointed block's no-grad first forward records again,
// the same amaxes, when backward recomputes it under grad mode), and evaluate() runs under
// NoGradGuard.
class Float8Scale {
 public:
  Float8Scale(float fp8_max, const Float8ScalingOptions& options);
  // The scale to cast a tensor whose largest magnitude is `amax` with; records amax for update(). With
  // record false (a forward that does not train), the same scale, and nothing changes.
  float scale_for(float amax, bool record = true);
  // End of an optimizer step: delayed scaling moves to the next scale; current scaling forgets the
  // step's amax.
  void update();
  float scale() const { return scale_; }
  // The largest amax recorded since the last update (Note [Agreeing on amax] replaces it by the ranks').
  float step_amax() const { return step_amax_; }
  void set_step_amax(float amax) { step_amax_ = amax; }
  // The amax history, most recent first (delayed scaling; empty for current scaling).
  std::vector<float> history() const;
  // State for checkpoints, as state_dict() saves it (one float32 tensor of 3 + amax_history_len values):
  // [scale, step_amax, position (the history slot the next amax goes into), the history's slots in
  // storage order, slot 0 first (not most recent first); none for current scaling].
  std::vector<float> state() const;
  void load_state(const std::vector<float>& state);

 private:
  float from_amax(float amax) const;
  float fp8_max_;
  Float8ScalingOptions options_;
  float scale_ = 1.0f;
  float step_amax_ = 0.0f;        // largest amax recorded since the last update
  std::vector<float> ring_;       // delayed: the history as a ring buffer
  int64_t next_ = 0;              // the slot the next update writes
};

// Which linear layers go through fp8 and how they are scaled.
struct Float8LinearOptions {
  Float8ScalingOptions scaling;
  std::vector<std::string> layers{"*"};  // module paths to include ('*' matches any run of characters)
  std::vector<std::string> exclude;      // module paths to leave in the autocast dtype
  int64_t min_size = 0;                  // skip layers with fewer than this many weight elements
  bool lm_head = false;                  // include the model's last Linear (the GPT's lm_head, a classifier)
  DType output_dtype = DType::BFloat16;  // the dtype of each fp8 layer's output (the autocast dtype)
};

// The HYBRID recipe for the chosen nn::Linear layers of one model: forward GEMM inputs (input and
// weight) in e4m3, the output gradient in e5m2 for both backward GEMMs, float32 accumulation, per-tensor
// scales per layer. Installed as the model's autocast LinearOverride by the fp8 strategy; layers it did
// not choose run the usual autocast path.
class Float8Linears : public autocast::LinearOverride {
 public:
  explicit Float8Linears(Float8LinearOptions options);
  // Chooses the layers of `model` (by module path, as named_modules() names them), replacing any
  // earlier choice.
  void bind(const nn::Module& model);
  Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) override;
  // Once per optimizer step, after it: every scale's step amax goes through `agree` (Note [Agreeing on
  // amax]; may be null), then Float8Scale::update.
  void end_step(const MixedPrecision::AmaxReducer& agree = nullptr);

  std::vector<std::string> layer_names() const;
  // The scales of one layer: input, weight, output gradient.
  struct Layer {
    std::string name;
    Float8Scale input, weight, grad_output;
  };
  const Layer& layer(const std::string& name) const;

  // "float8.<layer>.<input|weight|grad_output>" -> the Float8Scale state as a float32 tensor.
  std::map<std::string, Tensor> state_dict() const;
  // Restores every layer's scales; a missing or extra entry is a StateError naming it.
  void load_state_dict(const std::map<std::string, Tensor>& tensors);

 private:
  Float8LinearOptions options_;
  std::vector<std::shared_ptr<Layer>> layers_;
  std::unordered_map<const TensorImpl*, std::shared_ptr<Layer>> by_weight_;
};

}  // namespace booster::mixed_precision
