// LoRA adapters on Linear layers (lora.h): two children and a forward hook per adapted layer, so
// every model whose layers are nn::Linear takes them without code of its own.
//
// Note [LoRA as a hook]
// ~~~~~~~~~~~~~~~~~~~~~
// The model's layers call their Linears through typed members ((*q_proj)(h)), so an adapter cannot
// replace the layer in the module tree; it attaches to it instead: lora_A and lora_B become the Linear's
// children (so they are parameters of the model, saved, loaded and handed to the optimizer under PEFT's
// names) and a forward hook adds s B A dropout(x) to the layer's output. The hook runs inside the
// layer's call, so it runs under the strategy's autocast, and a plugin's hooks registered later (ZeRO-3
// gathers lora_A and lora_B as modules of their own) see the adapted output.
//
// Note [LoRA under tensor parallelism]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A shard policy replaces an adapted Linear by this rank's piece (split_lora gives it its adapters):
// - Column-parallel base (q, k, v, gate, up: split along out): B [out, r] is split along out (the rank's
//   rows), A [r, in] whole. The rank's output slice is y_r + s B_r A x, B_r's gradient is the rank's
//   own, and x's gradient through A is a partial sum that the layer's entry (Megatron's f) all-reduces
//   as it does W_r's. A's gradient, though, is sum_r (B_r^T dy_r) x: each rank holds only its term,
//   while the hybrid plugin takes a replicated parameter's gradient to be complete on every rank
//   (Note [Hybrid gradients]: the layer norms' are, because what reaches them was all-reduced already).
//   So A's own product is taken twice: once with A's weight detached (x's gradient, partial as above)
//   and once with x detached through copy_to_group (identity forward, all-reduce backward), whose
//   backward gives every rank the whole sum_r B_r^T dy_r and so A's complete gradient; the forward
//   value is the second one's exactly (the first enters as z - z.detach(), which is 0).
//   A tp::ColumnParallelLinear (the GPT's c_attn and c_fc) enters the group inside its own forward, so
//   the hook sees the replicated x, before the layer's f: there x's gradient through the adapter must
//   be complete as it leaves, and one product does both, A x through copy_to_group ([.., r] numbers
//   all-reduced backward, A's and x's gradient then whole on every rank).
//   A fused base whose rows are blocks split alike (the GPT's c_attn: q | k | v, each by heads, ShardSpec
//   chunks 3) has B split the same way, so B_r's rows are the weight's rows of this rank, in its order.
// - Row-parallel base (o, down: split along in, the partial products all-reduced inside the layer):
//   A [r, in] is split along in (the rank's columns), B whole. A_r x_r is the rank's partial sum of
//   A x; it is all-reduced (reduce_from_group: [.., r] numbers, small) and B applied to the whole A x on
//   every rank. Adding s B A_r x_r to the partial output before the layer's own all-reduce would save
//   that reduction but is not reachable from a forward hook (the hook sees the reduced output; adding it
//   there would count the adapter tp times), and it would leave B's gradient a partial sum on each rank.
//   Reduced first, B's input and its gradient's input (dy, after the all-reduce) are the same on every
//   rank, so B's gradient is complete there as the layer norms' is, and A_r's is exact: s B^T dy
//   (whole on every rank; reduce_from_group's backward is the identity) times x_r.
// A dropout on the adapter's input is the whole model's module, shared: on a column-parallel layer's
// whole x the ranks draw the single process's mask; on a row-parallel layer's slice each rank draws a
// mask of its slice's size, so training with lora.dropout > 0 under tp is dropout, not the single
// process's draws.
#include "booster/nn/lora.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <set>
#include <sstream>

#include "booster/common/error.h"
#include "booster/nn/dropout.h"
#include "booster/nn/linear.h"
#include "booster/nn/shard_policy.h"
#include "booster/nn/tensor_parallel.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"
#include "booster/tensor/random.h"

namespace booster::nn {

double LoraConfig::scaling() const { return use_rslora ? alpha / std::sqrt(double(r)) : alpha / double(r); }

void LoraConfig::validate() const {
  BOOSTER_CHECK(r >= 1, ValueError, "lora: r is ", r, "; the adapters' rank must be >= 1 (8 and 16 are usual)");
  BOOSTER_CHECK(std::isfinite(alpha) && alpha > 0.0, ValueError, "lora: alpha is ", alpha,
                "; it must be > 0 (often 2 r)");
  BOOSTER_CHECK(dropout >= 0.0 && dropout < 1.0, ValueError, "lora: dropout is ", dropout, "; it must be in [0, 1)");
  BOOSTER_CHECK(!target_modules.empty(), ValueError,
                "lora: target_modules is empty; name the Linear layers to adapt, e.g. [\"q_proj\", \"v_proj\"]");
}

namespace {

// lora_A: a Linear (in -> r) that also keeps the adapter's scale, so a shard policy that splits the
// adapted layer can rebuild its hook (split_lora).
class LoraDown final : public Linear {
 public:
  LoraDown(int64_t in, int64_t r, Generator* gen, double s) : Linear(in, r, /*bias=*/false, gen), scaling(s) {}
  LoraDown(Tensor weight, double s) : Linear(std::move(weight)), scaling(s) {}
  const double scaling;
};

ModulePtr child_named(const Module& m, const std::string& name) {
  for (const auto& [n, c] : m.named_children())
    if (n == name) return c;
  return nullptr;
}

}  // namespace

// peft.cpp: checks init_from's settings against `config` and loads its A and B into the adapters.
void load_lora_init_from(Module& model, const LoraConfig& config);

std::vector<std::string> apply_lora(Module& model, const LoraConfig& config) {
  config.validate();
  for (const auto& [name, p] : model.named_parameters())
    BOOSTER_CHECK(name.find(".lora_A.") == std::string::npos, StateError, "lora: the model has adapters already ('",
                  name, "'); apply LoRA once");
  // The Linears, by path, found first: the adapters are Linears too and must not be adapted.
  std::vector<std::pair<std::string, std::shared_ptr<Linear>>> targets;
  std::set<std::string> linear_names;
  const std::set<std::string> wanted(config.target_modules.begin(), config.target_modules.end());
  std::function<void(Module&, const std::string&)> walk = [&](Module& m, const std::string& prefix) {
    for (const auto& [name, child] : m.named_children()) {
      const std::string path = prefix.empty() ? name : prefix + "." + name;
      if (auto linear = std::dynamic_pointer_cast<Linear>(child)) {
        linear_names.insert(name);
        if (wanted.count(name)) targets.emplace_back(path, linear);
      }
      walk(*child, path);
    }
  };
  walk(model, "");
  if (targets.empty()) {
    std::ostringstream names;
    for (const std::string& n : linear_names) names << (names.tellp() > 0 ? ", " : "") << n;
    BOOSTER_FAIL(ConfigError, "lora: no Linear layer of the ", model.name(), " is named in target_modules; its Linear "
                 "layers are named ", linear_names.empty() ? std::string("(none)") : names.str());
  }

  for (Tensor& p : model.parameters()) p.requires_grad_(false);  // only the adapters train
  Generator gen(config.seed);
  auto dropout_gen = std::make_shared<Generator>(config.seed + 1);
  const double s = config.scaling();
  std::vector<std::string> adapted;
  for (auto& [path, linear] : targets) {
    // A: kaiming-uniform (a = sqrt(5)), a Linear's own default; B: zero. Beside the base weight.
    auto A = std::make_shared<LoraDown>(linear->in_features, config.r, &gen, s);
    auto B = std::make_shared<Linear>(config.r, linear->out_features, /*bias=*/false, &gen);
    {
      NoGradGuard no_grad;
      B->weight.fill_(0.0);
    }
    if (linear->weight.device() != Device::cpu()) {
      A->to(linear->weight.device());
      B->to(linear->weight.device());
    }
    linear->add_module("lora_A", A);
    linear->add_module("lora_B", B);
    std::shared_ptr<Dropout> drop;
    if (config.dropout > 0.0) {
      drop = std::make_shared<Dropout>(config.dropout, dropout_gen);
      linear->add_module("lora_dropout", drop);
    }
    // Note [LoRA as a hook]
    linear->register_forward_hook([A, B, drop, s](Module&, const Tensor& x, const Tensor& y) {
      const Tensor h = drop ? (*drop)(x) : x;
      return y + (*B)((*A)(h)) * s;
    });
    adapted.push_back(path);
  }
  model.set_tensor_names();
  if (!config.init_from.empty()) load_lora_init_from(model, config);
  return adapted;
}

void split_lora(const Module& full, Module& split, int64_t dim, distributed::ProcessGroup& group, int64_t chunks) {
  const auto A = std::dynamic_pointer_cast<LoraDown>(child_named(full, "lora_A"));
  const auto B = std::dynamic_pointer_cast<Linear>(child_named(full, "lora_B"));
  if (!A || !B) return;
  BOOSTER_CHECK(dim == 0 || dim == 1, ValueError, "lora: split_lora takes dim 0 (column-parallel) or 1 "
                "(row-parallel), not ", dim);
  const auto drop = std::dynamic_pointer_cast<Dropout>(child_named(full, "lora_dropout"));
  const double s = A->scaling;
  const int rank = group.rank(), size = group.size();
  // Note [LoRA under tensor parallelism]. A split adapter is a copy of this rank's piece; a replicated
  // one is the whole model's module, shared, as a policy shares the layer norms.
  BOOSTER_CHECK(chunks >= 1 && (dim == 0 || chunks == 1), ValueError, "lora: split_lora takes chunks >= 1, and "
                "above 1 only for a column-parallel base (dim 0), not dim ", dim, " with chunks ", chunks);
  auto piece = [&](const Tensor& w, int64_t d) {
    Tensor t = shard_of(w, ShardSpec{d, d == 0 ? chunks : 1}, rank, size).clone();
    t.requires_grad_(w.requires_grad());
    return t;
  };
  distributed::ProcessGroup* g = &group;
  if (dim == 0) {
    const std::shared_ptr<LoraDown>& a = A;  // replicated: the whole model's own (Note [Shard policies])
    auto b = std::make_shared<Linear>(piece(B->weight, 0));
    b->weight.requires_grad_(B->weight.requires_grad());
    split.add_module("lora_A", a);
    split.add_module("lora_B", b);
    if (drop) split.add_module("lora_dropout", drop);
    if (dynamic_cast<const tp::ColumnParallelLinear*>(&split) != nullptr) {
      // Its input is replicated, before the layer's own f: one product, entered into the group.
      split.register_forward_hook([a, b, drop, s, g](Module&, const Tensor& x, const Tensor& y) {
        const Tensor h = drop ? (*drop)(x) : x;
        return y + (*b)(tp::copy_to_group((*a)(h), *g)) * s;
      });
      return;
    }
    split.register_forward_hook([a, b, drop, s, g](Module&, const Tensor& x, const Tensor& y) {
      const Tensor h = drop ? (*drop)(x) : x;
      const Tensor whole = tp::copy_to_group(linear(h.detach(), a->weight), *g);  // A's complete gradient
      const Tensor partial = linear(h, a->weight.detach());                      // x's partial gradient
      return y + (*b)(whole + (partial - partial.detach())) * s;
    });
  } else {
    auto a = std::make_shared<LoraDown>(piece(A->weight, 1), s);
    a->weight.requires_grad_(A->weight.requires_grad());
    const std::shared_ptr<Linear>& b = B;  // replicated: the whole model's own
    split.add_module("lora_A", a);
    split.add_module("lora_B", b);
    if (drop) split.add_module("lora_dropout", drop);
    split.register_forward_hook([a, b, drop, s, g](Module&, const Tensor& x, const Tensor& y) {
      const Tensor h = drop ? (*drop)(x) : x;
      return y + (*b)(tp::reduce_from_group((*a)(h), *g)) * s;
    });
  }
}

std::vector<Tensor> trainable_parameters(const Module& model) {
  std::vector<Tensor> out;
  for (const Tensor& p : model.parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

}  // namespace booster::nn
