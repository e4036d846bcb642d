// Reproducible training across world sizes: the checks and the chunk trees (Note [Reproducible training
// across world sizes] in reproducible.h).
#include "booster/booster/reproducible.h"

#include <algorithm>
#include <functional>

#include "booster/common/error.h"
#include "booster/nn/dropout.h"
#include "booster/ops/ops.h"

namespace booster::reproducible {

using nlohmann::json;

namespace {

bool power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

int log2_exact(int64_t n) {
  int l = 0;
  while ((int64_t(1) << l) < n) ++l;
  return l;
}

std::string join_or(const std::vector<int64_t>& values) {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += i + 1 == values.size() ? " or " : ", ";
    out += std::to_string(values[i]);
  }
  return out;
}

// The powers of two that divide n (1 first).
std::vector<int64_t> power_of_two_divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t k = 1; n > 0 && n % k == 0; k *= 2) out.push_back(k);
  return out;
}

}  // namespace

int64_t default_chunks(int64_t global_rows) {
  int64_t k = 1;
  while (k * 2 <= kMaxDefaultChunks && global_rows % (k * 2) == 0) k *= 2;
  return k;
}

std::vector<int> world_sizes(int64_t chunks) {
  std::vector<int> out;
  for (int64_t w : power_of_two_divisors(chunks)) out.push_back(int(w));
  return out;
}

std::string describe_world_sizes(int64_t chunks) { return join_or(power_of_two_divisors(chunks)); }

void check_sizes(int64_t chunks, int64_t global_rows, int world, const std::string& where) {
  BOOSTER_CHECK(global_rows > 0, ConfigError, where, ": the global batch has no rows");
  const std::vector<int64_t> dividing = power_of_two_divisors(global_rows);
  BOOSTER_CHECK(power_of_two(chunks), ConfigError, where, ": reproducible_chunks is ", chunks,
                "; it must be a power of two that divides the global batch of ", global_rows, " rows: ",
                join_or(dividing));
  BOOSTER_CHECK(global_rows % chunks == 0, ConfigError, where, ": the global batch of ", global_rows,
                " rows (batch size x grad_accumulation x processes) is not cut evenly into ", chunks,
                " chunks; give reproducible_chunks ", join_or(dividing), ", or a global batch that is a multiple of ",
                chunks);
  BOOSTER_CHECK(world >= 1 && chunks % world == 0, ConfigError, where, ": ", world,
                " processes do not divide the ", chunks, " reproducible chunks, so the chunks' sum cannot keep its "
                "order; run on ", describe_world_sizes(chunks), " processes, or give reproducible_chunks a power of two "
                "that is a multiple of ", world);
}

void check_layout(const std::string& plugin, const ParallelLayout& layout, const json& options,
                  const std::string& precision, bool clipping) {
  const std::string where = "reproducible training";
  BOOSTER_CHECK(layout.tensor == 1, ConfigError, where, ": tensor parallelism (tp_size ", layout.tensor,
                ") sums partial products over the tensor ranks inside the forward, in an order that changes with "
                "tp_size; train with tp_size 1 (data parallelism) or without train.reproducible");
  BOOSTER_CHECK(layout.pipeline == 1, ConfigError, where, ": pipeline parallelism (pp_size ", layout.pipeline,
                ") is not supported yet; use ddp or low_level_zero stage 1, or turn train.reproducible off");
  const bool known = plugin.empty() || plugin == "single" || plugin == "ddp" || plugin == "low_level_zero";
  BOOSTER_CHECK(known, ConfigError, where, ": plugin '", plugin, "' is not supported; it works under single, ddp and "
                "low_level_zero stage 1");
  std::string strategy = precision;
  if (plugin == "low_level_zero") {
    const int stage = options.is_object() ? options.value("stage", 1) : 1;
    BOOSTER_CHECK(stage == 1, ConfigError, where, ": low_level_zero stage ", stage,
                  " reduces every backward into the shard, so the chunks' sum cannot keep its order; use stage 1 "
                  "(or ddp)");
    strategy = options.is_object() ? options.value("precision", std::string("fp16")) : std::string("fp16");
    const double max_norm = options.is_object() ? options.value("max_norm", 0.0) : 0.0;
    BOOSTER_CHECK(max_norm == 0.0 && !clipping, ConfigError, where, ": clipping under low_level_zero sums the "
                  "norm over shards, whose number is the world size; train without max_norm / train.max_grad_norm, "
                  "or under ddp");
  }
  // fp16 is autocast with float32 gradients; ZeRO's fp16 has float16 ones (Note: W * G could overflow).
  const bool supported = strategy == "fp32" || strategy == "bf16" || (strategy == "fp16" && plugin != "low_level_zero");
  BOOSTER_CHECK(supported, ConfigError, where, ": precision '", strategy, "' is not supported",
                plugin == "low_level_zero" ? " under low_level_zero (float16 gradients could overflow in the exchange "
                                             "where they do not on one process); use its \"precision\" option fp32 or "
                                             "bf16 (the default is fp16)"
                                           : "; use fp32, bf16 or fp16 (autocast with float32 gradients)");
}

void check_model(const nn::Module& model) {
  for (const auto& [path, m] : model.named_modules())
    if (const auto* d = dynamic_cast<const nn::Dropout*>(m))
      BOOSTER_CHECK(d->p == 0.0, ConfigError, "reproducible training: dropout '", path.empty() ? "(model)" : path,
                    "' has p = ", d->p, ", and its masks follow the rank that draws them, not the sample; set the "
                    "model's dropout to 0 or turn train.reproducible off");
}

std::string describe_config(const json& config, int world_size) {
  const json& train = config.at("train");
  if (!train.value("reproducible", false))
    return "not reproducible (train.reproducible is false): runs on other numbers of processes agree within "
           "roundoff, not bit for bit";
  const json& plugin = config.at("plugin");
  const std::string name = plugin.value("name", std::string("single"));
  ParallelLayout layout;
  layout.tensor = plugin.value("tp_size", 1);
  layout.pipeline = plugin.value("pp_size", 1);
  const json& clip = train.at("max_grad_norm");
  check_layout(name == "single" ? "" : name, layout, plugin, config.at("mixed_precision").value("name", "fp32"),
               clip.is_number() && clip.get<double>() > 0.0);
  const json dropout = config.at("model").value("dropout", json(0.0));
  BOOSTER_CHECK(!dropout.is_number() || dropout.get<double>() == 0.0, ConfigError, "train.reproducible: model.dropout is ",
                dropout.dump(), ", and dropout masks follow the rank that draws them, not the sample; set it to 0 or "
                "turn train.reproducible off");
  const json& data = config.at("data");
  const int64_t batch = data.at("batch_size").get<int64_t>();
  const int64_t accumulation = train.at("grad_accumulation").get<int64_t>();
  const int64_t global = batch * accumulation * int64_t(world_size);
  const json& given = train.at("reproducible_chunks");
  const int64_t chunks = given.is_number_integer() ? given.get<int64_t>() : default_chunks(global);
  check_sizes(chunks, global, world_size, "train.reproducible");
  std::string sizes;
  for (int w : world_sizes(chunks)) {
    if (global % (accumulation * w) != 0) continue;
    if (!sizes.empty()) sizes += ", ";
    sizes += std::to_string(w) + " (data.batch_size " + std::to_string(global / (accumulation * w)) + ")";
  }
  return "reproducible: the global batch of " + std::to_string(global) + " rows is cut into " +
         std::to_string(chunks) + " chunks of " + std::to_string(global / chunks) +
         " rows; the same bytes on these numbers of processes, keeping the global batch: " + sizes;
}

int64_t leaf(int64_t position, int64_t count) {
  const int bits = log2_exact(count);
  int64_t out = 0;
  for (int b = 0; b < bits; ++b)
    if (position & (int64_t(1) << b)) out |= int64_t(1) << (bits - 1 - b);
  return out;
}

// ------------------------------------------------------------------------------------------ GradientTree
GradientTree::GradientTree(std::vector<Tensor> params) {
  for (Tensor& p : params) {
    if (!p.requires_grad()) continue;
    auto it = std::find_if(groups_.begin(), groups_.end(), [&](const Group& g) { return g.dtype == p.dtype(); });
    if (it == groups_.end()) {
      groups_.push_back(Group{p.dtype(), {}, {0}, {}, {}});
      it = groups_.end() - 1;
    }
    BOOSTER_CHECK(p.dtype() != DType::Float16, ConfigError, "reproducible training: parameter '", p.name(),
                  "' has float16 gradients, which could overflow in the exchange (W times the sum) where they do not "
                  "on one process; train it in float32 or bfloat16 (fp16 autocast keeps float32 gradients)");
    it->params.push_back(p);
    it->offsets.push_back(it->offsets.back() + p.numel());
  }
}

void GradientTree::clear() { heights_.clear(); }

Tensor& GradientTree::slot(Group& g, size_t i) {
  while (g.levels.size() <= i) {
    const Tensor& first = g.params.front();
    g.levels.push_back(zeros({g.offsets.back()}, g.dtype, first.device()));
  }
  return g.levels[i];
}

void GradientTree::push(const std::function<void(Group&, Tensor&)>& fill) {
  const size_t top = heights_.size();
  for (Group& g : groups_) fill(g, slot(g, top));
  heights_.push_back(0);
  // Equal subtrees combine: left (earlier) + right.
  while (heights_.size() >= 2 && heights_[heights_.size() - 1] == heights_[heights_.size() - 2]) {
    const size_t right = heights_.size() - 1;
    for (Group& g : groups_) g.levels[right - 1].add_(g.levels[right]);
    heights_.pop_back();
    ++heights_.back();
  }
}

void GradientTree::push_gradients() {
  push([](Group& g, Tensor& leaf_buffer) {
    for (size_t i = 0; i < g.params.size(); ++i) {
      Tensor view = leaf_buffer.narrow(0, g.offsets[i], g.offsets[i + 1] - g.offsets[i]);
      Tensor grad = g.params[i].grad();
      if (grad.defined()) {
        view.copy_(grad.reshape({-1}));
        grad.zero_();
      } else {
        view.zero_();
      }
    }
  });
}

void GradientTree::combine_ranks(distributed::ProcessGroup& group) {
  BOOSTER_CHECK(heights_.size() == 1, StateError, "GradientTree::combine_ranks: ", heights_.size(),
                " subtrees are open; push a power-of-two number of chunks first");
  const int world = group.size();
  received_bytes_ = 0;
  if (world == 1) return;
  for (Group& g : groups_) {
    const int64_t n = g.offsets.back();
    if (!g.gathered.defined() || g.gathered.numel() != n * world)
      g.gathered = zeros({n * world}, g.dtype, g.params.front().device());
    group.all_gather(g.gathered, g.levels[0]);
    received_bytes_ += (world - 1) * n * int64_t(itemsize(g.dtype));
  }
  heights_.clear();
  for (int64_t t = 0; t < world; ++t) {
    const int64_t r = leaf(t, world);
    push([&](Group& g, Tensor& leaf_buffer) {
      const int64_t n = g.offsets.back();
      leaf_buffer.copy_(g.gathered.narrow(0, r * n, n));
    });
  }
}

void GradientTree::write_gradients(double scale, bool zeros_elsewhere, int rank) {
  BOOSTER_CHECK(heights_.size() == 1, StateError, "GradientTree::write_gradients: no complete sum");
  for (Group& g : groups_) {
    Tensor& total = g.levels[0];
    if (!g.zero.defined()) g.zero = zeros({1}, g.dtype, total.device());
    total.add_(g.zero.expand({total.numel()}));  // -0 + 0 = +0
    if (scale != 1.0 && rank == 0) total.mul_(scale);
    for (size_t i = 0; i < g.params.size(); ++i) {
      Tensor grad = g.params[i].grad();
      BOOSTER_CHECK(grad.defined(), StateError, "reproducible step: parameter '", g.params[i].name(),
                    "' has no gradient to write into");
      if (zeros_elsewhere && rank != 0)
        grad.zero_();
      else
        grad.copy_(total.narrow(0, g.offsets[i], g.offsets[i + 1] - g.offsets[i]).reshape(grad.shape()));
    }
  }
}

// ------------------------------------------------------------------------------------------ ValueTree
void ValueTree::push(double value) {
  stack_.emplace_back(value, 0);
  while (stack_.size() >= 2 && stack_[stack_.size() - 1].second == stack_[stack_.size() - 2].second) {
    const double right = stack_.back().first;
    stack_.pop_back();
    stack_.back().first += right;
    ++stack_.back().second;
  }
}

double ValueTree::total() const { return stack_.empty() ? 0.0 : stack_.front().first; }

void ValueTree::combine_ranks(distributed::ProcessGroup& group) {
  const int world = group.size();
  if (world == 1) return;
  Tensor mine = full({1}, total(), DType::Float64, group.device());
  Tensor all = zeros({int64_t(world)}, DType::Float64, group.device());
  group.all_gather(all, mine);
  const std::vector<double> values = all.cpu().tolist();
  stack_.clear();
  for (int64_t t = 0; t < world; ++t) push(values[size_t(leaf(t, world))]);
}

}  // namespace booster::reproducible
