// The backward engine: a dependency-counted walk of the recorded graph, latest node first.
#include <algorithm>
#include <atomic>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/common/error_context.h"
#include "booster/ops/ops.h"

namespace booster::autograd {

uint64_t Node::next_sequence() {
  static std::atomic<uint64_t> counter{0};
  return counter++;
}

namespace {

class LambdaNode final : public Node {
 public:
  LambdaNode(const char* name, BackwardFn fn) : name_(name), fn_(std::move(fn)) {}
  grads apply(const Tensor& g) override {
    BOOSTER_CHECK(fn_ != nullptr, AutogradError, "backward through ", name_,
                  " a second time: its saved tensors were freed after the first backward; pass "
                  "retain_graph=true to the first backward to keep them");
    const ErrorContextScope context(ErrorContextFrame::Kind::Backward, name_);  // Note [Error context]
    return fn_(g);
  }
  std::string name() const override { return name_; }
  void release() override { fn_ = nullptr; }

 private:
  const char* name_;
  BackwardFn fn_;
};

}  // namespace

bool needs_grad(std::initializer_list<const Tensor*> inputs) {
  if (!grad_mode_enabled()) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!grad_mode_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

std::shared_ptr<Node> edge_of(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return nullptr;
  TensorImpl* impl = t.impl();
  if (impl->grad_fn) return impl->grad_fn;
  // A leaf: share one accumulator between all its uses so its hooks fire once per backward.
  std::shared_ptr<Node> acc = impl->grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    impl->grad_accumulator = acc;
  }
  return acc;
}

void record(Tensor& out, const char* name, const std::vector<Tensor>& inputs, BackwardFn fn) {
  if (!needs_grad(inputs)) return;
  auto node = std::make_shared<LambdaNode>(name, std::move(fn));
  node->next.reserve(inputs.size());
  for (const Tensor& t : inputs) node->next.push_back(edge_of(t));
  out.impl()->grad_fn = std::move(node);
  out.impl()->requires_grad = true;
}

grads AccumulateGrad::apply(const Tensor& g) {
  std::shared_ptr<TensorImpl> leaf = leaf_.lock();
  if (!leaf) return {};
  Tensor param(leaf);
  Tensor grad = g.dtype() == param.dtype() ? g : g.to(param.dtype());
  if (grad.shape() != param.shape()) grad = sum_to(grad, param.shape());
  if (!leaf->grad) {
    // Take the incoming buffer when nobody else can see it; otherwise copy (a view, or shared).
    const bool exclusive = grad.is_contiguous() && grad.impl_ptr().use_count() <= 2 &&
                           grad.storage().use_count() == 1 && grad.numel() * int64_t(itemsize(grad.dtype())) ==
                                                                   int64_t(grad.storage()->nbytes());
    leaf->grad = (exclusive ? grad.detach() : grad.clone()).impl_ptr();
  } else {
    Tensor(leaf->grad).add_(grad);
  }
  for (auto& hook : leaf->grad_ready_hooks) hook(param);
  return {};
}

void backward(const Tensor& root, const Tensor& grad_in, bool retain_graph) {
  BOOSTER_CHECK(root.defined(), AutogradError, "backward: called on an undefined tensor");
  BOOSTER_CHECK(root.requires_grad(), AutogradError,
                "backward: the tensor does not require grad and has no grad_fn (did every input have "
                "requires_grad false, or was it computed under NoGradGuard?)");
  Tensor seed = grad_in;
  if (!seed.defined()) {
    BOOSTER_CHECK(root.numel() == 1, AutogradError,
                  "backward: grad can be implicitly created only for scalar outputs, but the output has "
                  "shape ",
                  root.shape(), "; pass a gradient of that shape, or reduce the output (e.g. sum or mean)");
    seed = ones_like(root);
  } else {
    BOOSTER_CHECK(seed.shape() == root.shape(), ShapeError, "backward: gradient of shape ", seed.shape(),
                  " does not match the output's shape ", root.shape());
  }

  NoGradGuard no_grad;
  autocast::AutocastGuard no_autocast(false);  // backward runs in the dtypes forward chose
  std::shared_ptr<Node> root_node = edge_of(root);

  // Count how many edges lead into each node reachable from the root.
  std::unordered_map<Node*, int> deps;
  std::vector<Node*> stack{root_node.get()};
  std::unordered_set<Node*> seen{root_node.get()};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const auto& nx : n->next) {
      if (!nx) continue;
      ++deps[nx.get()];
      if (seen.insert(nx.get()).second) stack.push_back(nx.get());
    }
  }

  auto later_first = [](const Node* a, const Node* b) { return a->sequence < b->sequence; };
  std::priority_queue<Node*, std::vector<Node*>, decltype(later_first)> ready(later_first);
  std::unordered_map<Node*, Tensor> pending;
  pending[root_node.get()] = seed;
  ready.push(root_node.get());
  // Keeps nodes alive while their grads are pending, even if the graph is being released.
  std::vector<std::shared_ptr<Node>> keep_alive{root_node};

  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    // A node that no gradient reached (every path into it gave "none") still releases its children.
    grads outs;
    if (auto it = pending.find(node); it != pending.end()) {
      Tensor g = std::move(it->second);
      pending.erase(it);
      outs = node->apply(g);
      BOOSTER_CHECK(outs.size() == node->next.size() || node->next.empty(), AutogradError, node->name(),
                    ": returned ", outs.size(), " gradients for ", node->next.size(), " inputs");
    }
    for (size_t i = 0; i < node->next.size(); ++i) {
      const auto& nx = node->next[i];
      if (!nx) continue;
      if (i < outs.size() && outs[i].defined()) {
        auto it = pending.find(nx.get());
        if (it == pending.end()) {
          pending.emplace(nx.get(), std::move(outs[i]));
        } else if (it->second.shape() == outs[i].shape() && it->second.dtype() == outs[i].dtype() &&
                   it->second.impl_ptr().use_count() == 1 && it->second.storage().use_count() == 1 &&
                   it->second.is_contiguous()) {
          it->second.add_(outs[i]);  // accumulate in place into a buffer nobody else sees
        } else {
          it->second = add(it->second, outs[i]);
        }
      }
      if (--deps[nx.get()] == 0) {
        keep_alive.push_back(nx);
        ready.push(nx.get());
      }
    }
    if (!retain_graph) node->release();
  }
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  const int64_t lead = grad.dim() - int64_t(shape.size());
  BOOSTER_CHECK(lead >= 0, ShapeError, "sum_to: cannot reduce shape ", grad.shape(), " to ", shape);
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < grad.dim(); ++d) {
    if (d < lead) dims.push_back(d);
    else if (shape[size_t(d - lead)] == 1 && grad.shape()[size_t(d)] != 1) dims.push_back(d);
  }
  Tensor r = dims.empty() ? grad : sum(grad, dims, /*keepdim=*/true);
  return r.reshape(shape);
}

}  // namespace booster::autograd
