// Reverse-mode autograd over a graph recorded by ops.
//
// Note [Recording an op]
// An op that produced `out` from inputs that need gradients calls
//   autograd::record(out, "MulBackward", {a, b}, [a, b](const Tensor& g) { return grads{g * b, g * a}; });
// The closure returns one gradient per input (an undefined Tensor for "none"). Backward closures run
// with grad mode off. A closure must not capture `out` itself (that would be a reference cycle
// out -> grad_fn -> closure -> out); capture `out.detach()` instead, which shares the data only.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "booster/tensor/grad_mode.h"  // NoGradGuard, grad_mode_enabled
#include "booster/tensor/tensor.h"

namespace booster::autograd {

using grads = std::vector<Tensor>;

class Node {
 public:
  virtual ~Node() = default;
  // One gradient per entry of next (undefined where the input needs none).
  virtual grads apply(const Tensor& grad_output) = 0;
  virtual std::string name() const = 0;
  // Drops saved tensors after a backward without retain_graph.
  virtual void release() {}

  std::vector<std::shared_ptr<Node>> next;  // per input; null where the input needs no gradient
  uint64_t sequence = next_sequence();       // later nodes run first when several are ready

 private:
  static uint64_t next_sequence();
};

// The node that adds incoming gradients into a leaf's .grad and then runs its grad-ready hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf) : leaf_(leaf) {}
  grads apply(const Tensor& grad_output) override;
  std::string name() const override { return "AccumulateGrad"; }

 private:
  std::weak_ptr<TensorImpl> leaf_;
};

// True when grad mode is on and any input requires a gradient.
bool needs_grad(std::initializer_list<const Tensor*> inputs);
bool needs_grad(const std::vector<Tensor>& inputs);

// The edge backward follows into `t`: its grad_fn, its accumulator if it is a leaf requiring grad,
// or null.
std::shared_ptr<Node> edge_of(const Tensor& t);

using BackwardFn = std::function<grads(const Tensor& grad_output)>;

// Attaches a backward closure to `out` (see Note [Recording an op]). No-op when no input needs grad.
void record(Tensor& out, const char* name, const std::vector<Tensor>& inputs, BackwardFn fn);

// Runs backward from `root` seeded with `grad` (same shape as root).
void backward(const Tensor& root, const Tensor& grad, bool retain_graph);

// Sums `grad` down to `shape`, undoing broadcasting (for the backward of broadcasting ops).
Tensor sum_to(const Tensor& grad, const Shape& shape);

}  // namespace booster::autograd
