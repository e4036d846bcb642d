// The ddp plugin under `mpirun -np 2` (every TEST_CASE runs on every rank, in the same order).
//
// The reference for data parallelism is one process: ddp on 2 ranks with B samples each must train
// like one process with the same 2B samples, because the mean loss over 2B samples has the average
// of the two ranks' mean-loss gradients as its gradient. Each rank computes that one-process run
// itself, locally, from the same seeds, so the comparison needs no communication of its own. The ddp
// model on rank 1 starts from different weights: the plugin's broadcast from rank 0 must fix that.
//
// Assertions are CHECKs, not REQUIREs: a REQUIRE that fails on one rank only would end that rank's
// test case while the other goes on into collectives it never joins, and the job would hang.
//
// Most cases drive the plugin as the Booster does (create_plugin + configure, then the precision
// strategy it returns runs backward and step), to reach its internals; the last one goes through the
// Booster itself.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <unistd.h>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/plugin/parallel_plugin.h"
#include "booster/data/dataset.h"
#include "booster/distributed/bucket.h"
#include "booster/distributed/nccl_process_group.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/linear.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/plugin/loader.h"
#include "booster/tensor/random.h"
#include "roundoff.h"

using namespace booster;
using distributed::ProcessGroup;
using nlohmann::json;

namespace {

ProcessGroup& group() { return distributed::init_process_group("mpi"); }

// The plugin as the Booster loads it: every call through the plugin boundary, and what it returns
// bound to its library.
std::shared_ptr<ParallelPlugin> load_ddp(const json& options = json::object()) { return create_plugin("ddp", options); }

const distributed::GradientBucketer& bucketer_of(const TrainingParts& parts) {
  const auto* owner = dynamic_cast<const distributed::GradientBucketerOwner*>(parts.precision.get());
  REQUIRE(owner != nullptr);
  return owner->gradient_bucketer();
}

// ------------------------------------------------------------------------------- the workload
constexpr int64_t kIn = 32, kClasses = 10;
constexpr double kLearningRate = 1e-3;

// Note [Roundoff bounds] (tests/roundoff.h) for this MLP (Linears of 32, 64 and 64 inputs, 10 classes)
// on a global batch of `rows`: the first-step gradients of two summation orders (forward chain, the
// chain back, the sum over the rows), and the weights of two SGD runs along the reference's `path`.
double gradient_bound(int64_t rows) {
  const double forward = ::testing::roundoff::mlp_forward_length({kIn, 64, 64}, kClasses, double(rows));
  return ::testing::roundoff::reduction_bound({2 * forward, double(rows)});
}

// The sum of a run's step lengths |p_t - p_{t-1}| (L2 over every parameter), for sgd_bound.
struct Path {
  std::vector<double> last;
  double length = 0;
  void add(const std::vector<double>& now) {
    if (!last.empty()) {
      double s = 0;
      for (size_t i = 0; i < now.size(); ++i) s += (now[i] - last[i]) * (now[i] - last[i]);
      length += std::sqrt(s);
    }
    last = now;
  }
};

double l2_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

nn::ModulePtr make_mlp(uint64_t seed) {
  return nn::make_model({{"type", "mlp"}, {"in", kIn}, {"hidden", {64, 64}}, {"classes", kClasses}}, seed);
}

// The samples of one step of the whole job (every rank draws the same ones).
data::Batch job_batch(int64_t step, int64_t rows) {
  Generator gen(1000 + uint64_t(step));
  return {randn({rows, kIn}, &gen), randint(0, kClasses, {rows}, &gen)};
}

// Rows [start, start + length) of a batch.
data::Batch rows_of(const data::Batch& b, int64_t start, int64_t length) {
  return {b.x.narrow(0, start, length).contiguous(), b.y.narrow(0, start, length).contiguous()};
}

json precision_options(const std::string& precision) {
  // A small initial scale: with this tiny model 65536 would overflow float16 in the first steps, and
  // this test is about ddp, not about the scaler finding its scale.
  return precision == "fp16" ? json{{"init_scale", 256.0}} : json::object();
}

// One training setup: model, AdamW, cross entropy, a precision strategy; under `plugin` when given.
// The parts of a training loop, and the plugin that configured them: objects a plugin created must not
// outlive its library (Note [Plugin lifetime]), so the plugin stays loaded while they live, as the
// Booster keeps it. (Bases are destroyed last to first: the parts go before the plugin.)
struct PluginHolder {
  std::shared_ptr<ParallelPlugin> plugin;
};
struct Training : PluginHolder, TrainingParts {};

// `strategy` replaces the one named by `precision` (for strategies wrapped by a test).
Training make_training(const std::string& precision, uint64_t model_seed,
                            const std::shared_ptr<ParallelPlugin>& plugin, nn::ModulePtr model = nullptr,
                            std::shared_ptr<mixed_precision::MixedPrecision> strategy = nullptr,
                            bool sgd = false) {
  if (!model) model = make_mlp(model_seed);
  std::shared_ptr<optim::Optimizer> optimizer;
  if (sgd)
    optimizer = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}, {"momentum", 0.9}});
  else
    optimizer = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", kLearningRate}});
  nn::Criterion criterion = [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
  std::shared_ptr<mixed_precision::MixedPrecision> mp =
      strategy ? strategy : mixed_precision::create(precision, precision_options(precision));
  mixed_precision::Configured c = mp->configure(model, optimizer, criterion);
  TrainingParts parts;
  parts.model = c.model;
  parts.optimizer = c.optimizer;
  parts.criterion = c.criterion;
  parts.precision = mp;
  if (plugin) parts = plugin->configure(parts);
  return Training{{plugin}, parts};
}

// zero_grad, forward, backward and step, as a training loop under the Booster runs them.
void train_step(TrainingParts& t, const data::Batch& batch, double loss_factor = 1.0) {
  t.optimizer->zero_grad();
  Tensor loss = t.criterion((*t.model)(batch.x), batch.y);
  if (loss_factor != 1.0) loss = mul(loss, loss_factor);
  t.precision->backward(loss, *t.optimizer);
  t.precision->step(*t.optimizer);
}

std::vector<double> parameters_of(const nn::Module& model) {
  std::vector<double> out;
  for (const Tensor& p : model.parameters()) {
    const std::vector<double> v = p.tolist();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// Largest |a - b| over all elements, and the largest |b|.
struct Difference {
  double max_abs = 0, max_ref = 0;
  double relative() const { return max_abs / max_ref; }
};
Difference difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  Difference d;
  for (size_t i = 0; i < a.size(); ++i) {
    d.max_abs = std::max(d.max_abs, std::abs(a[i] - b[i]));
    d.max_ref = std::max(d.max_ref, std::abs(b[i]));
  }
  return d;
}

// sqrt(mean((a - b)^2)).
double rms_difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(sum / double(a.size()));
}

// True when `local` holds the same bytes on every rank (all-gathered and compared).
bool same_bytes_on_every_rank(const Tensor& local) {
  ProcessGroup& pg = group();
  const Tensor mine = local.contiguous().reshape({local.numel()});
  Tensor all = zeros({pg.size() * mine.numel()}, mine.dtype());
  pg.all_gather(all, mine);
  const size_t bytes = mine.nbytes();
  const auto* base = static_cast<const char*>(all.data_ptr());
  for (int r = 1; r < pg.size(); ++r)
    if (std::memcmp(base, base + r * bytes, bytes) != 0) return false;
  return true;
}

Tensor all_parameters(const nn::Module& model) {
  std::vector<Tensor> flat;
  for (const Tensor& p : model.parameters()) flat.push_back(p.detach().to(DType::Float32).reshape({p.numel()}));
  return cat(flat, 0);
}

}  // namespace

TEST_CASE("ddp: options are validated and the declarations are the documented ones", "[mpi][ddp]") {
  auto plugin = load_ddp();
  CHECK(plugin->name() == "ddp");
  CHECK(plugin->options() ==
          json{{"bucket_cap_mb", 25.0}, {"broadcast_buffers", true}, {"find_unused_parameters", false},
               {"progress_thread", true}});
  // CUDA models go through NCCL (Note [A group per device]), so cuda is declared where NCCL is built.
  CHECK(plugin->supported_devices() ==
        (distributed::nccl_built() ? std::vector<std::string>{"cpu", "cuda"} : std::vector<std::string>{"cpu"}));
  CHECK(plugin->supported_precisions() == std::vector<std::string>{"*"});
  CHECK_FALSE(plugin->control_precision());
  CHECK_FALSE(plugin->control_device());
  CHECK(plugin->support_no_sync());
  CHECK_FALSE(plugin->control_checkpoint_io());
  CHECK(plugin->layout().data == group().size());
  CHECK(plugin->layout().tensor == 1);
  CHECK(plugin->layout().pipeline == 1);
  CHECK(&plugin->process_group() == &group());
  CHECK(load_ddp({{"bucket_cap_mb", 0.5}, {"broadcast_buffers", false}})->options()["bucket_cap_mb"] == 0.5);

  // Each bad option is a ConfigError whose message names it.
  auto config_error = [](const json& options) {
    try {
      load_ddp(options);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no ConfigError");
  };
  CHECK_THAT(config_error({{"bucket_cap", 5}}),
               Catch::Matchers::Contains("unknown option 'bucket_cap'") && Catch::Matchers::Contains("bucket_cap_mb"));
  CHECK_THAT(config_error({{"bucket_cap_mb", -1}}),
             Catch::Matchers::Contains("plugin 'ddp': option 'bucket_cap_mb' = -1 is out of range"));
  CHECK_THAT(config_error({{"bucket_cap_mb", "25"}}),
             Catch::Matchers::Contains("'bucket_cap_mb' must be a number, got \"25\""));
  CHECK_THAT(config_error({{"broadcast_buffers", 1}}),
               Catch::Matchers::Contains("'broadcast_buffers' must be true or false"));
  CHECK_THROWS_AS(load_ddp(json::array()), ConfigError);
}

// Note [ddp against one process: tolerances]
// The two computations differ only in the order of summation: one process sums each weight
// gradient over 2B rows in one GEMM; each ddp rank sums B rows and the all-reduce averages the two.
// * fp32: the first step's gradients (rms) within gradient_bound, Note [Roundoff bounds]'s spread of
//   two summation orders over this MLP's reductions (~7e-6; measured ~1e-7); the parameters after 20
//   AdamW steps within Adam's largest drift, 2 lr sum_t |m_hat / sqrt(v_hat)|, which no summation order
//   can exceed (a near-zero gradient may change sign). (Comparing gradients matters: AdamW is invariant
//   to the scale of the gradient, so parameters alone would not show a sum where an average belongs.)
// * fp16 and bf16 (autocast): every GEMM result is rounded to 16 bits. The reference rounds each sum
//   over 2B rows once; a ddp rank rounds its sum over B rows, so a gradient element differs by about
//   one 16-bit rounding, u = 2^-11 (fp16) or 2^-8 (bf16) relative. We require the first step's
//   gradients to agree to u (rms relative; measured ~0.6 u for both). The parameters then drift
//   apart by more than u: Adam moves each element by about lr per step whatever the size of its
//   gradient, so an element whose gradient is mostly cancellation (a sum of terms much larger than
//   itself, whose rounding error is of the size of the gradient) can be moved either way by the
//   rounding, up to lr per step; and parameters that differ give gradients that differ. Hence two
//   bounds after T steps: no element further apart than 2 T lr (both moved the full lr in opposite
//   directions at every step: anything more is not rounding), and the rms difference at most 10% of
//   the rms distance the reference trained (measured ~3% for both; a ddp whose ranks do not average,
//   each training on its own B samples, is 79% off, and its first-step gradients 93%).
TEST_CASE("ddp: 2 ranks with B samples each train like one process with 2B samples (fp32, fp16, bf16)",
          "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t B = 16;
  constexpr int kSteps = 20;
  for (const std::string precision : {"fp32", "fp16", "bf16"}) {
    INFO("precision " << precision);
    Training reference = make_training(precision, 7, nullptr);
    // Rank 1 starts from other weights: configure() must broadcast rank 0's.
    Training ddp = make_training(precision, 7 + 100 * uint64_t(pg.rank()), load_ddp());
    CHECK(parameters_of(*ddp.model) == parameters_of(*reference.model));

    const std::vector<double> initial = parameters_of(*reference.model);
    double grad_relative = 0;
    for (int64_t step = 0; step < kSteps; ++step) {
      const data::Batch batch = job_batch(step, 2 * B);
      train_step(reference, batch);
      train_step(ddp, rows_of(batch, pg.rank() * B, B));
      CHECK_FALSE(ddp.precision->step_was_skipped());
      CHECK_FALSE(reference.precision->step_was_skipped());
      // The averaged gradients themselves (AdamW alone would not see a sum instead of an average),
      // at the first step, while both start from the same parameters.
      if (step != 0) continue;
      const std::vector<double> ref_grad = reference.optimizer->flat_buffers(0)[0]->grad().tolist();
      grad_relative = rms_difference(ddp.optimizer->flat_buffers(0)[0]->grad().tolist(), ref_grad) /
                      rms_difference(ref_grad, std::vector<double>(ref_grad.size(), 0.0));
    }
    const Difference d = difference(parameters_of(*ddp.model), parameters_of(*reference.model));
    const double moved = rms_difference(parameters_of(*reference.model), initial);
    const double apart = rms_difference(parameters_of(*ddp.model), parameters_of(*reference.model));
    std::printf("rank %d %s: max |ddp - one process| = %.3g (relative to max |p| %.3g); rms %.3g = %.3g of the rms "
                "distance trained; first-step gradients rms relative %.3g\n",
                pg.rank(), precision.c_str(), d.max_abs, d.relative(), apart, apart / moved, grad_relative);
    if (precision == "fp32") {
      CHECK(grad_relative <= gradient_bound(2 * B));
      CHECK(d.max_abs <= ::testing::roundoff::adam_drift_bound(kLearningRate, kSteps, 0.9, 0.999));
    } else {
      const double u = precision == "fp16" ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
      CHECK(grad_relative <= u);
      CHECK(d.max_abs <= 2 * kSteps * kLearningRate);
      CHECK(apart <= 0.1 * moved);
    }
    // Every rank ends with the same bits.
    CHECK(same_bytes_on_every_rank(all_parameters(*ddp.model)));
  }
}

TEST_CASE("ddp: master-weight strategies start from rank 0's masters and stay identical across ranks",
          "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t B = 8;
  for (const std::string precision : {"fp16_naive", "fp16_apex"}) {
    INFO("precision " << precision);
    // Rank 1 builds other weights, so its float32 masters differ too until ddp broadcasts them.
    Training ddp = make_training(precision, 60 + uint64_t(pg.rank()), load_ddp());
    for (int64_t step = 0; step < 5; ++step) train_step(ddp, rows_of(job_batch(step, 2 * B), pg.rank() * B, B));
    CHECK_FALSE(ddp.precision->step_was_skipped());
    CHECK(same_bytes_on_every_rank(all_parameters(*ddp.model)));
    CHECK(parameters_of(*ddp.model) != parameters_of(*make_mlp(60)));  // it trained
  }
}

TEST_CASE("ddp: no_sync accumulates locally and the next synced backward reduces the sum", "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t B = 8;
  auto accumulating_plugin = load_ddp();
  // SGD: its update is linear in the gradient, so parameters agree as closely as gradients do (Adam
  // can magnify the rounding of a gradient element that is nearly zero, see the Note above).
  Training accumulating = make_training("fp32", 11, accumulating_plugin, nullptr, nullptr, /*sgd=*/true);
  Training whole = make_training("fp32", 11, load_ddp(), nullptr, nullptr, /*sgd=*/true);
  const distributed::GradientBucketer& bucketer = bucketer_of(accumulating);
  const Tensor grads = accumulating.optimizer->flat_buffers(0)[0]->grad();

  Path path;
  path.add(parameters_of(*whole.model));
  for (int64_t step = 0; step < 3; ++step) {
    const data::Batch mine = rows_of(job_batch(step, 4 * B), pg.rank() * 2 * B, 2 * B);
    // Two micro-batches, each loss halved so that the sum is the mean over both (as gradient
    // accumulation does); the first without communication.
    accumulating.optimizer->zero_grad();
    const int64_t launched_before = bucketer.stats().launched_in_hooks + bucketer.stats().launched_at_finish;
    accumulating_plugin->set_gradient_sync(false);
    {
      const data::Batch first = rows_of(mine, 0, B);
      accumulating.precision->backward(
          mul(accumulating.criterion((*accumulating.model)(first.x), first.y), 0.5), *accumulating.optimizer);
    }
    CHECK(bucketer.stats().launched_in_hooks + bucketer.stats().launched_at_finish == launched_before);
    CHECK_FALSE(bucketer.in_flight());
    // Nothing was communicated: each rank holds the gradient of its own micro-batch.
    CHECK_FALSE(same_bytes_on_every_rank(grads));
    accumulating_plugin->set_gradient_sync(true);
    {
      const data::Batch second = rows_of(mine, B, B);
      accumulating.precision->backward(
          mul(accumulating.criterion((*accumulating.model)(second.x), second.y), 0.5), *accumulating.optimizer);
    }
    CHECK(bucketer.stats().launched_in_hooks + bucketer.stats().launched_at_finish > launched_before);
    accumulating.precision->step(*accumulating.optimizer);
    CHECK(same_bytes_on_every_rank(grads));

    train_step(whole, mine);
    path.add(parameters_of(*whole.model));
    const std::vector<double> whole_grad = whole.optimizer->flat_buffers(0)[0]->grad().tolist();
    const double grad_relative = rms_difference(grads.tolist(), whole_grad) /
                                 rms_difference(whole_grad, std::vector<double>(whole_grad.size(), 0.0));
    // After the first step the weights differ too: the gradient moves by at most its Hessian times
    // that, inside the weights' own bound's factor (Note [Roundoff bounds], step 3).
    CHECK(grad_relative <= ::testing::roundoff::kDrift * gradient_bound(4 * B));
  }
  // Summation order only: SGD (lr 0.1, momentum 0.9) along the reference's path.
  CHECK(l2_difference(parameters_of(*accumulating.model), parameters_of(*whole.model)) <=
        ::testing::roundoff::sgd_bound(path.length, gradient_bound(4 * B), 0.9));
  CHECK(same_bytes_on_every_rank(all_parameters(*accumulating.model)));
}

namespace {
// Writes inf into the first gradient element on rank 1 just before the inner strategy unscales and
// checks, i.e. after ddp has reduced the gradients: only rank 1 can see the overflow, so only the
// found_inf reducer can make rank 0 skip too.
class InfOnRankOne final : public mixed_precision::PrecisionDecorator {
 public:
  using PrecisionDecorator::PrecisionDecorator;
  bool armed = false;
  void step(optim::Optimizer& optimizer) override {
    if (armed && group().rank() == 1) {
      const Tensor g = optimizer.flat_buffers(0)[0]->grad();
      g.data<float>()[0] = INFINITY;
      g.bump_version();
    }
    PrecisionDecorator::step(optimizer);
  }
};
}  // namespace

TEST_CASE("ddp: an overflow seen by one rank only makes every rank skip the step", "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t B = 8;
  auto injector = std::make_shared<InfOnRankOne>(mixed_precision::create("fp16", precision_options("fp16")));
  Training ddp = make_training("fp16", 5, load_ddp(), nullptr, injector);
  for (int64_t step = 0; step < 2; ++step) train_step(ddp, rows_of(job_batch(step, 2 * B), pg.rank() * B, B));
  CHECK_FALSE(ddp.precision->step_was_skipped());

  SECTION("inf written after the reduction, on rank 1 only") {
    injector->armed = true;
    const Tensor before = all_parameters(*ddp.model).clone();
    const double scale = ddp.precision->loss_scale();
    train_step(ddp, rows_of(job_batch(2, 2 * B), pg.rank() * B, B));
    CHECK(ddp.precision->step_was_skipped());
    CHECK(std::memcmp(before.data_ptr(), all_parameters(*ddp.model).data_ptr(), before.nbytes()) == 0);
    CHECK(ddp.precision->loss_scale() == scale / 2);
    // The next step trains again, on every rank alike.
    injector->armed = false;
    train_step(ddp, rows_of(job_batch(3, 2 * B), pg.rank() * B, B));
    CHECK_FALSE(ddp.precision->step_was_skipped());
    CHECK(same_bytes_on_every_rank(all_parameters(*ddp.model)));
  }
  SECTION("an inf input on rank 1 only: the reduction spreads the overflow") {
    const Tensor before = all_parameters(*ddp.model).clone();
    const double scale = ddp.precision->loss_scale();
    data::Batch mine = rows_of(job_batch(2, 2 * B), pg.rank() * B, B);
    if (pg.rank() == 1) mine.x.data<float>()[0] = INFINITY;
    train_step(ddp, mine);
    CHECK(ddp.precision->step_was_skipped());
    CHECK(std::memcmp(before.data_ptr(), all_parameters(*ddp.model).data_ptr(), before.nbytes()) == 0);
    CHECK(ddp.precision->loss_scale() == scale / 2);
  }
  SECTION("control: without ddp's reducer, rank 0 would have stepped") {
    auto local = std::make_shared<InfOnRankOne>(mixed_precision::create("fp16", precision_options("fp16")));
    Training alone = make_training("fp16", 5, nullptr, nullptr, local);
    local->armed = true;
    train_step(alone, job_batch(0, B));
    CHECK(alone.precision->step_was_skipped() == (pg.rank() == 1));
  }
}

// Note [Averages divide first]: one weight row w and one input row x_r per rank, loss = w . x_r at loss
// scale 1, so the float16 gradient of w on rank r is x_r itself. x_r[0] = 40000 + 8000 r is finite on
// every rank, but the 2-rank sum 88000 is past float16's largest value 65504 while the mean 44000 is
// not (all multiples of 32, float16's spacing there: exact). Summing first would overflow and skip the
// step; dividing first steps with the mean. The reference is the mean in float64 and one SGD step.
TEST_CASE("ddp: a float16 gradient whose 2-rank sum overflows is averaged, and the step is not skipped",
          "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr double kLr = 1e-5;
  const std::vector<double> w0{0.5, 0.25, -0.125};
  auto input_of = [](int r) { return std::vector<double>{40000.0 + 8000.0 * (r % 2), 3.0 + r, -1.5 * (r + 1)}; };
  auto model = std::make_shared<nn::Linear>(3, 1, /*bias=*/false);
  {
    NoGradGuard no_grad;
    model->weight.copy_(from_vector(w0, {1, 3}));
  }
  Training ddp;
  ddp.plugin = load_ddp();
  auto strategy = mixed_precision::create("fp16_naive", {{"initial_scale", 1.0}});
  mixed_precision::Configured c =
      strategy->configure(model, std::make_shared<optim::SGD>(model->parameters(), json{{"lr", kLr}}),
                          [](const Tensor& out, const Tensor&) { return sum(out); });
  TrainingParts parts;
  parts.model = c.model;
  parts.optimizer = c.optimizer;
  parts.criterion = c.criterion;
  parts.precision = std::move(strategy);
  static_cast<TrainingParts&>(ddp) = ddp.plugin->configure(parts);
  REQUIRE(model->weight.dtype() == DType::Float16);

  train_step(ddp, {from_vector(input_of(pg.rank()), {1, 3}), zeros({1})});
  CHECK_FALSE(ddp.precision->step_was_skipped());
  CHECK(ddp.precision->loss_scale() == 1.0);  // no overflow was seen, so no backoff

  std::vector<double> want = w0;
  for (int r = 0; r < pg.size(); ++r)
    for (size_t i = 0; i < want.size(); ++i) want[i] -= kLr * input_of(r)[i] / pg.size();
  const std::vector<double> got = model->weight.tolist();
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("weight " << i << ": got " << got[i] << ", want " << want[i]);
    CHECK(std::abs(got[i] - want[i]) <= std::ldexp(1.0, -10) * std::abs(w0[i]));  // float16 rounding
  }
  CHECK(std::abs(got[0] - w0[0]) > 0.4);  // it stepped, by the mean (a sum would move it twice as far)
  CHECK(same_bytes_on_every_rank(all_parameters(*model)));
}

TEST_CASE("ddp: with small buckets, several are launched from the hooks while backward runs", "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t B = 8;
  std::vector<double> trained[2];
  for (const bool progress_thread : {false, true}) {
    INFO("progress_thread " << progress_thread);
    // The MLP's parameters, last first: 40 B, 2560 B, 256 B | 16384 B | 256 B, 8192 B. A 10 KiB cap
    // cuts them into the three buckets marked.
    Training ddp = make_training(
        "fp32", 3, load_ddp({{"bucket_cap_mb", 10.0 / 1024}, {"progress_thread", progress_thread}}));
    const distributed::GradientBucketer& bucketer = bucketer_of(ddp);
    const optim::FlatBuffer& flat = *ddp.optimizer->flat_buffers(0)[0];
    const auto& buckets = bucketer.buckets();
    CHECK(buckets.size() == 3);
    if (buckets.size() == 3) {
      // Reverse parameter order, contiguous spans that tile the buffer from its end.
      CHECK(buckets[0].params == std::vector<size_t>{5, 4, 3});
      CHECK(buckets[1].params == std::vector<size_t>{2});
      CHECK(buckets[2].params == std::vector<size_t>{1, 0});
      CHECK(buckets[0].end == flat.numel());
      CHECK(buckets[1].end == buckets[0].begin);
      CHECK(buckets[2].end == buckets[1].begin);
      CHECK(buckets[2].begin == 0);
    }
    for (int64_t step = 0; step < 3; ++step) {
      train_step(ddp, rows_of(job_batch(step, 2 * B), pg.rank() * B, B));
      CHECK(bucketer.stats().last_launched_in_hooks == 3);
      CHECK(bucketer.stats().last_launched_at_finish == 0);
    }
    CHECK(bucketer.stats().synced_backwards == 3);
    CHECK(same_bytes_on_every_rank(all_parameters(*ddp.model)));
    trained[progress_thread] = parameters_of(*ddp.model);
  }
  // Who polls changes nothing in the result.
  CHECK(trained[0] == trained[1]);

  // The default cap (25 MiB, first bucket 1 MiB) holds this whole model in one bucket.
  Training one_bucket = make_training("fp32", 3, load_ddp());
  CHECK(bucketer_of(one_bucket).buckets().size() == 1);
}

TEST_CASE("ddp: several flat buffers (two param groups) are bucketed and reduced alike", "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t B = 8;
  // Group 0: the first layer; group 1: the rest, with its own learning rate. One flat buffer each.
  auto make_groups = [](const nn::ModulePtr& model) {
    std::vector<Tensor> params = model->parameters();
    std::vector<optim::ParamGroup> groups(2);
    groups[0].params = {params[0], params[1]};
    groups[1].params = std::vector<Tensor>(params.begin() + 2, params.end());
    groups[1].options = {{"lr", 0.05}};
    return std::make_shared<optim::SGD>(groups, json{{"lr", 0.1}, {"momentum", 0.9}});
  };
  auto run = [&](uint64_t seed, const std::shared_ptr<ParallelPlugin>& plugin) {
    Training t;
    t.plugin = plugin;
    t.model = make_mlp(seed);
    t.optimizer = make_groups(t.model);
    t.criterion = [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
    t.precision = mixed_precision::create("fp32");
    if (plugin) static_cast<TrainingParts&>(t) = plugin->configure(t);
    return t;
  };
  Training reference = run(90, nullptr);
  Training ddp = run(90 + uint64_t(pg.rank()), load_ddp({{"bucket_cap_mb", 10.0 / 1024}}));
  const auto& buckets = bucketer_of(ddp).buckets();
  // Last buffer first, each bucket inside one buffer: [fc3.b fc3.w fc2.b] [fc2.w] from buffer 1,
  // then [fc1.b fc1.w] from buffer 0.
  CHECK(buckets.size() == 3);
  if (buckets.size() == 3) {
    CHECK(buckets[0].buffer == 1);
    CHECK(buckets[1].buffer == 1);
    CHECK(buckets[2].buffer == 0);
    CHECK(buckets[2].params == std::vector<size_t>{1, 0});
  }
  for (int64_t step = 0; step < 5; ++step) {
    const data::Batch batch = job_batch(step, 2 * B);
    train_step(reference, batch);
    train_step(ddp, rows_of(batch, pg.rank() * B, B));
    if (step != 0) continue;
    // The first step's gradients, which the buckets carry, against one process's (Note [Roundoff bounds]).
    const std::vector<double> want = reference.optimizer->flat_buffers(0)[0]->grad().tolist();
    const std::vector<double> got = ddp.optimizer->flat_buffers(0)[0]->grad().tolist();
    CHECK(rms_difference(got, want) <=
          gradient_bound(2 * B) * rms_difference(want, std::vector<double>(want.size(), 0.0)));
  }
  const Difference d = difference(parameters_of(*ddp.model), parameters_of(*reference.model));
  CHECK(d.max_abs <= ::testing::roundoff::adam_drift_bound(kLearningRate, 5, 0.9, 0.999));
  CHECK(same_bytes_on_every_rank(all_parameters(*ddp.model)));
}

namespace {
// Three linear heads summed: `a` always, `b` only where use_b, `c` never.
class Branches final : public nn::Module {
 public:
  explicit Branches(uint64_t seed) {
    Generator gen(seed);
    a = register_module("a", std::make_shared<nn::Linear>(kIn, kClasses, true, &gen));
    b = register_module("b", std::make_shared<nn::Linear>(kIn, kClasses, true, &gen));
    c = register_module("c", std::make_shared<nn::Linear>(kIn, kClasses, true, &gen));
    set_tensor_names();
  }
  Tensor forward(const Tensor& x) override {
    Tensor out = (*a)(x);
    return use_b ? add(out, (*b)(x)) : out;
  }
  std::string name() const override { return "Branches"; }
  std::shared_ptr<nn::Linear> a, b, c;
  bool use_b = true;
};
}  // namespace

TEST_CASE("ddp: parameters without a gradient on some or all ranks do not hang the job", "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t B = 8;
  for (const bool find_unused : {false, true}) {
    INFO("find_unused_parameters " << find_unused);
    auto model = std::make_shared<Branches>(21);
    model->use_b = pg.rank() == 0;  // b: used by rank 0 only; c: used by no rank
    const std::vector<double> c_before = model->c->weight.tolist();
    const std::vector<double> b_before = model->b->weight.tolist();
    Training ddp = make_training("fp32", 0, load_ddp({{"find_unused_parameters", find_unused}}), model);
    for (int64_t step = 0; step < 3; ++step) {
      train_step(ddp, rows_of(job_batch(step, 2 * B), pg.rank() * B, B));
      CHECK(bucketer_of(ddp).stats().last_launched_at_finish >= 1);  // the bucket holding c never fills
    }
    // Every rank stepped the same parameters with the same gradients.
    CHECK(same_bytes_on_every_rank(all_parameters(*ddp.model)));
    CHECK(model->b->weight.tolist() != b_before);
    // c got no gradient anywhere: by default it counts as a zero gradient (AdamW's weight decay moves
    // it); with find_unused_parameters every optimizer skips it, as torch skips a None gradient.
    if (find_unused)
      CHECK(model->c->weight.tolist() == c_before);
    else
      CHECK(model->c->weight.tolist() != c_before);
  }
}

namespace {
// A linear layer with a buffer that its forward updates from rank-local information (as BatchNorm's
// running statistics are updated from the rank's own batch): +1 on rank 0, +2 on rank 1.
class RankCounter final : public nn::Module {
 public:
  explicit RankCounter(int rank) {
    Generator gen(31);
    fc = register_module("fc", std::make_shared<nn::Linear>(kIn, kClasses, true, &gen));
    count = register_buffer("count", full({1}, 10.0 * rank));
    set_tensor_names();
  }
  Tensor forward(const Tensor& x) override {
    count.add_(full({1}, double(group().rank() + 1)));
    return (*fc)(x);
  }
  std::string name() const override { return "RankCounter"; }
  std::shared_ptr<nn::Linear> fc;
  Tensor count;
};
}  // namespace

TEST_CASE("ddp: module buffers start as rank 0's and follow rank 0's with broadcast_buffers", "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t B = 8;
  for (const bool broadcast_buffers : {true, false}) {
    INFO("broadcast_buffers " << broadcast_buffers);
    auto model = std::make_shared<RankCounter>(pg.rank());
    Training ddp = make_training("fp32", 0, load_ddp({{"broadcast_buffers", broadcast_buffers}}), model);
    CHECK(model->count.item() == 0.0);  // rank 0's, broadcast by configure() in both cases
    for (int64_t step = 0; step < 2; ++step) {
      train_step(ddp, rows_of(job_batch(step, 2 * B), pg.rank() * B, B));
      // The forward added 1 (rank 0) or 2 (rank 1); with broadcast_buffers the backward that followed
      // gave every rank rank 0's value, as torch's broadcast before the next forward does.
      if (broadcast_buffers)
        CHECK(model->count.item() == double(step + 1));
      else
        CHECK(model->count.item() == double((step + 1) * (pg.rank() + 1)));
    }
    CHECK(same_bytes_on_every_rank(all_parameters(*ddp.model)));
  }
}

TEST_CASE("ddp: configure without an optimizer still starts every rank from rank 0's weights", "[mpi][ddp]") {
  ProcessGroup& pg = group();
  auto plugin = load_ddp();
  TrainingParts parts;
  parts.model = make_mlp(40 + uint64_t(pg.rank()));
  parts.precision = mixed_precision::create("fp32");
  parts = plugin->configure(parts);
  CHECK(parameters_of(*parts.model) == parameters_of(*make_mlp(40)));
  CHECK(parts.optimizer == nullptr);
  CHECK(plugin->checkpoint_io() != nullptr);
  CHECK_THROWS_AS(plugin->configure(parts), StateError);
}

TEST_CASE("ddp: prepare_dataloader gives each rank its share, reshuffled by the loader's set_epoch",
          "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t N = 40;
  std::vector<int64_t> ids(N);
  for (int64_t i = 0; i < N; ++i) ids[size_t(i)] = i;
  auto dataset = std::make_shared<data::TensorDataset>(zeros({N, 1}), from_vector(ids, {N}));
  data::DataLoaderOptions options;
  options.batch_size = 4;
  options.shuffle = true;
  options.seed = 9;
  auto plugin = load_ddp();  // loaded while its loader lives
  auto loader = plugin->prepare_dataloader(dataset, options);
  CHECK(loader->num_samples() == N / pg.size());

  auto epoch_order = [&](int64_t epoch) {
    loader->set_epoch(epoch);
    std::vector<int64_t> mine;
    for (const data::Batch& batch : *loader)
      for (double y : batch.y.tolist()) mine.push_back(int64_t(y));
    CHECK(int64_t(mine.size()) == N / pg.size());
    // All ranks together: every sample exactly once.
    Tensor all = zeros({N}, DType::Int64);
    pg.all_gather(all, from_vector(mine, {int64_t(mine.size())}));
    std::vector<double> seen = all.tolist();
    std::sort(seen.begin(), seen.end());
    for (int64_t i = 0; i < N; ++i) CHECK(seen[size_t(i)] == double(i));
    return mine;
  };
  const std::vector<int64_t> epoch0 = epoch_order(0), epoch1 = epoch_order(1);
  CHECK(epoch0 != epoch1);
  CHECK(epoch_order(0) == epoch0);
}

// Note [Data-parallel loaders] in booster/plugin/data_parallel.h: ddp and low_level_zero share one
// loader path. The sampler pads to a multiple of the world size (every rank 3 of 5 samples) whatever
// drop_last says, and drop_last drops each rank's last partial batch, as torch's DataLoader over a
// DistributedSampler. (low_level_zero used to pass drop_last to the sampler: 2 samples per rank.)
TEST_CASE("data-parallel plugins: ddp and low_level_zero give each rank the same batches", "[mpi][ddp][zero]") {
  ProcessGroup& pg = group();
  REQUIRE(pg.size() == 2);
  constexpr int64_t N = 5;
  std::vector<int64_t> ids(N);
  for (int64_t i = 0; i < N; ++i) ids[size_t(i)] = i;
  auto dataset = std::make_shared<data::TensorDataset>(zeros({N, 1}), from_vector(ids, {N}));
  auto ddp = load_ddp();
  auto zero = create_plugin("low_level_zero");
  for (const int64_t batch_size : {int64_t(1), int64_t(2)}) {
    for (const bool drop_last : {false, true}) {
      INFO("batch_size " << batch_size << " drop_last " << drop_last);
      data::DataLoaderOptions options;
      options.batch_size = batch_size;
      options.shuffle = true;
      options.seed = 3;
      options.drop_last = drop_last;
      auto batches = [&](ParallelPlugin& plugin) {
        std::vector<std::vector<double>> out;
        // Held in a variable: a range-for over *temporary would destroy the loader before the loop runs.
        const auto loader = plugin.prepare_dataloader(dataset, options);
        for (const data::Batch& batch : *loader) out.push_back(batch.y.tolist());
        return out;
      };
      const std::vector<std::vector<double>> from_ddp = batches(*ddp), from_zero = batches(*zero);
      CHECK(from_ddp == from_zero);
      // 3 samples per rank: 3 batches of 1; 2 batches of 2 (the last of 1), or 1 with drop_last.
      const size_t expected = batch_size == 1 ? 3 : (drop_last ? 1 : 2);
      CHECK(from_ddp.size() == expected);
    }
  }
}

TEST_CASE("ddp through the Booster: prepare_dataloader, no_sync and the boosted step train like one process",
          "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t N = 64, kMicroBatch = 8;  // per rank; one process takes both ranks' rows at once
  Generator gen(77);
  auto dataset = std::make_shared<data::TensorDataset>(randn({N, kIn}, &gen), randint(0, kClasses, {N}, &gen));
  nn::Criterion criterion = [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
  auto make_sgd = [](const nn::ModulePtr& model) {
    return std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}, {"momentum", 0.9}});
  };

  BoosterConfig config;
  config.plugin = "ddp";
  config.plugin_options = {{"bucket_cap_mb", 0.01}};
  Booster booster(config);
  CHECK(booster.plugin().name() == "ddp");
  nn::ModulePtr user_model = make_mlp(50 + uint64_t(pg.rank()));  // rank 1's start is overwritten
  Boosted boosted = booster.boost(user_model, make_sgd(user_model), criterion);
  data::DataLoaderOptions options;
  options.batch_size = kMicroBatch;
  options.shuffle = true;
  options.seed = 3;
  std::shared_ptr<data::DataLoader> loader = booster.prepare_dataloader(dataset, options);

  // One process: the same permutation (Note [Deterministic shuffling]) in micro-batches of both ranks'
  // rows: DistributedSampler gives rank r the positions r, r + 2, ..., so a one-process batch of 2 * 8
  // rows holds the same samples as the two ranks' batches of 8.
  nn::ModulePtr reference = make_mlp(50);
  auto reference_optimizer = make_sgd(reference);
  data::DataLoaderOptions reference_options = options;
  reference_options.batch_size = pg.size() * kMicroBatch;
  data::DataLoader reference_loader(dataset, reference_options);

  Path path;
  path.add(parameters_of(*reference));
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    loader->set_epoch(epoch);
    reference_loader.set_epoch(epoch);
    std::vector<data::Batch> mine, whole;
    for (data::Batch& b : *loader) mine.push_back(b);
    for (data::Batch& b : reference_loader) whole.push_back(b);
    CHECK(mine.size() == whole.size());
    // Gradient accumulation over pairs of micro-batches, the first of each pair without communication.
    for (size_t i = 0; i + 1 < mine.size(); i += 2) {
      boosted.optimizer->zero_grad();
      {
        auto no_sync = booster.no_sync();
        booster.backward(mul(boosted.criterion((*boosted.model)(mine[i].x), mine[i].y), 0.5), *boosted.optimizer);
      }
      booster.backward(mul(boosted.criterion((*boosted.model)(mine[i + 1].x), mine[i + 1].y), 0.5),
                       *boosted.optimizer);
      boosted.optimizer->step();
      CHECK_FALSE(boosted.optimizer->step_was_skipped());

      reference_optimizer->zero_grad();
      for (size_t k : {i, i + 1}) mul(criterion((*reference)(whole[k].x), whole[k].y), 0.5).backward();
      reference_optimizer->step();
      path.add(parameters_of(*reference));
    }
  }
  const auto* owner = dynamic_cast<const distributed::GradientBucketerOwner*>(&booster.precision());
  CHECK(owner != nullptr);
  if (owner) CHECK(owner->gradient_bucketer().stats().synced_backwards == 4);
  // Summation order only: SGD along the reference's path (Note [Roundoff bounds]), global batches of 2 x 16.
  CHECK(l2_difference(parameters_of(*boosted.model), parameters_of(*reference)) <=
        ::testing::roundoff::sgd_bound(path.length, gradient_bound(2 * pg.size() * kMicroBatch), 0.9));
  CHECK(same_bytes_on_every_rank(all_parameters(*boosted.model)));
}

// Note [Gradient accumulation in a loop] (booster/booster/booster.h): the README's loop with
// booster.accumulate(3) takes, per optimizer step, 3 micro-batches of kMicroBatch rows on each rank;
// it must end where one process stepping once on the 2 x 3 micro-batches' rows at once does, with one
// gradient all-reduce per step (the first two micro-batches of each run under no_sync).
TEST_CASE("ddp through the Booster: accumulate(3) over micro-batches steps as one process on their whole batch",
          "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t kMicroBatch = 4, kAccumulation = 3, kSteps = 4;
  const int64_t whole_rows = pg.size() * kAccumulation * kMicroBatch;
  nn::Criterion criterion = [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
  auto make_sgd = [](const nn::ModulePtr& model) {
    return std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}, {"momentum", 0.9}});
  };
  Booster booster(BoosterConfig{.plugin = "ddp", .plugin_options = {{"bucket_cap_mb", 0.01}}});
  nn::ModulePtr user_model = make_mlp(50 + uint64_t(pg.rank()));  // rank 1's start is overwritten
  Boosted boosted = booster.boost(user_model, make_sgd(user_model), criterion);
  nn::ModulePtr reference = make_mlp(50);
  auto reference_optimizer = make_sgd(reference);
  Path path;
  path.add(parameters_of(*reference));
  for (int64_t step = 0; step < kSteps; ++step) {
    const data::Batch whole = job_batch(step, whole_rows);
    for (int64_t k = 0; k < kAccumulation; ++k) {
      // Micro-batch k of rank r: rows (k * ranks + r) * kMicroBatch on; all of them make the whole batch.
      const data::Batch micro = rows_of(whole, (k * pg.size() + pg.rank()) * kMicroBatch, kMicroBatch);
      auto micro_step = booster.accumulate(kAccumulation);
      boosted.optimizer->zero_grad();
      booster.backward(boosted.criterion((*boosted.model)(micro.x), micro.y), *boosted.optimizer);
      boosted.optimizer->step();
    }
    CHECK(boosted.optimizer->steps() == step + 1);
    reference_optimizer->zero_grad();
    criterion((*reference)(whole.x), whole.y).backward();
    reference_optimizer->step();
    path.add(parameters_of(*reference));
  }
  const auto* owner = dynamic_cast<const distributed::GradientBucketerOwner*>(&booster.precision());
  CHECK(owner != nullptr);
  if (owner) CHECK(owner->gradient_bucketer().stats().synced_backwards == kSteps);
  // Note [Roundoff bounds]: the runs order the gradient's sums differently (3 micro-batch sums per rank,
  // averaged over the ranks, then divided by 3, against one sum over the whole batch), so a gradient
  // differs within the reductions of the whole batch plus the accumulation's sum and division; the
  // weights by SGD's bound along the reference's path.
  const double forward = ::testing::roundoff::mlp_forward_length({kIn, 64, 64}, kClasses, double(whole_rows));
  const double eps = ::testing::roundoff::reduction_bound({2 * forward, double(whole_rows), kAccumulation + 1.0});
  CHECK(l2_difference(parameters_of(*boosted.model), parameters_of(*reference)) <=
        ::testing::roundoff::sgd_bound(path.length, eps, 0.9));
  CHECK(same_bytes_on_every_rank(all_parameters(*boosted.model)));
}

TEST_CASE("ddp through the Booster: rank 0 saves model and optimizer, every rank loads them", "[mpi][ddp]") {
  ProcessGroup& pg = group();
  constexpr int64_t B = 8;
  // One directory for the job: rank 0's pid, broadcast.
  Tensor pid = full({1}, double(getpid()), DType::Int64);
  pg.broadcast(pid, 0);
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("booster_ddp_checkpoint_" + std::to_string(int64_t(pid.item())));
  auto make_sgd = [](const nn::ModulePtr& model) {
    return std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}, {"momentum", 0.9}});
  };
  nn::Criterion criterion = [](const Tensor& out, const Tensor& target) { return cross_entropy(out, target); };
  BoosterConfig config;
  config.plugin = "ddp";
  config.mixed_precision = "fp16";
  config.mixed_precision_options = precision_options("fp16");

  Booster trained(config);
  nn::ModulePtr model = make_mlp(80);
  Boosted a = trained.boost(model, make_sgd(model), criterion);
  for (int64_t step = 0; step < 3; ++step) {
    const data::Batch mine = rows_of(job_batch(step, 2 * B), pg.rank() * B, B);
    a.optimizer->zero_grad();
    trained.backward(a.criterion((*a.model)(mine.x), mine.y), *a.optimizer);
    a.optimizer->step();
  }
  trained.save_model(*a.model, dir / "model");
  trained.save_optimizer(*a.optimizer, dir / "optimizer");
  CHECK(std::filesystem::exists(dir / "model" / "model.safetensors"));

  Booster restored(config);
  nn::ModulePtr fresh = make_mlp(81 + uint64_t(pg.rank()));
  Boosted b = restored.boost(fresh, make_sgd(fresh), criterion);
  restored.load_model(*b.model, dir / "model");
  restored.load_optimizer(*b.optimizer, dir / "optimizer");
  CHECK(parameters_of(*b.model) == parameters_of(*a.model));
  CHECK(restored.precision().loss_scale() == trained.precision().loss_scale());
  // Both continue identically (momentum buffers restored too).
  const data::Batch next = rows_of(job_batch(3, 2 * B), pg.rank() * B, B);
  for (auto* run : {&a, &b}) {
    Booster& booster = run == &a ? trained : restored;
    run->optimizer->zero_grad();
    booster.backward(run->criterion((*run->model)(next.x), next.y), *run->optimizer);
    run->optimizer->step();
  }
  CHECK(parameters_of(*b.model) == parameters_of(*a.model));
  CHECK(same_bytes_on_every_rank(all_parameters(*b.model)));
  pg.barrier();
  if (pg.rank() == 0) std::filesystem::remove_all(dir);
}
