// GPT-2-small training step on a GPU: the 124M-parameter shape (12 layers, width 768, 12 heads, vocab
// 50257, context 1024) under fp32 (TF32 GEMMs), fp16 (autocast + GradScaler), bf16 (autocast) and
// fp16_naive (and fp8 on request: --precision fp8, its Linear GEMMs through cuBLASLt's float8 GEMM),
// with AdamW. Prints one JSON line per strategy: median ms per step, tokens/s, model
// TFLOP/s and MFU against a bf16 GEMM peak measured here through the same cuBLAS path
// (an 8192^3 matmul). bench/torch_gpt2_cuda.py is the PyTorch side of the comparison.
//
//   build/bin/bench_gpt2_cuda [--batch 8] [--context 1024] [--steps 10] [--warmup 3] [--precision all|fp32|...]
//                             [--flash 0|1]   (0: the unfused attention kernels, for a before/after)
//                             [--trace off|nonfinite|stats]   (the precision doctor's Tracer on the model)
// --precision and --trace take comma-separated lists (--precision bf16,fp8 --trace off,stats): one
// line per pair, from one process. --trace nonfinite traces every step as the Trainer does to name a
// step's first inf/NaN tensor (a fused finiteness check per module output and gradient, read only
// when the loss is not finite); stats gathers the per-module statistics (diagnostics.every = 1) on
// every step, the worst case of the doctor's cost.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/backends/cuda/cuda.h"
#include "booster/diagnostics/tracer.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"

using namespace booster;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// bf16 GEMM rate through cuBLAS (matmul -> cublasGemmStridedBatchedEx), random operands.
double measure_bf16_peak_tflops() {
  const int64_t n = 8192;
  Generator g(0);
  const Tensor a = randn({n, n}, &g).to(Device::cuda()).to(DType::BFloat16);
  const Tensor b = randn({n, n}, &g).to(Device::cuda()).to(DType::BFloat16);
  for (int i = 0; i < 3; ++i) matmul(a, b);
  cuda::synchronize();
  const int reps = 20;
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) matmul(a, b);
  cuda::synchronize();
  return 2.0 * double(n) * double(n) * double(n) * reps / seconds_since(t0) / 1e12;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t comma; (comma = s.find(',', start)) != std::string::npos; start = comma + 1)
    out.push_back(s.substr(start, comma - start));
  out.push_back(s.substr(start));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 8, context = 1024;
  int steps = 10, warmup = 3;
  std::string which = "all", traces = "off";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i], v = argv[i + 1];
    if (arg == "--batch") batch = std::atoll(v.c_str());
    else if (arg == "--context") context = std::atoll(v.c_str());
    else if (arg == "--steps") steps = std::atoi(v.c_str());
    else if (arg == "--warmup") warmup = std::atoi(v.c_str());
    else if (arg == "--precision") which = v;
    else if (arg == "--flash") set_flash_attention_enabled(v != "0");
    else if (arg == "--trace") traces = v;
    else {
      std::fprintf(stderr, "bench_gpt2_cuda: unknown option %s\n", arg.c_str());
      return 2;
    }
  }
  for (const std::string& t : split_commas(traces)) {
    if (t != "off" && t != "nonfinite" && t != "stats") {
      std::fprintf(stderr, "bench_gpt2_cuda: --trace takes off, nonfinite or stats, not %s\n", t.c_str());
      return 2;
    }
  }
  if (!cuda::is_available()) {
    std::fprintf(stderr, "bench_gpt2_cuda: no GPU: %s\n", cuda::unavailable_reason().c_str());
    return 1;
  }
  try {
    const double peak = measure_bf16_peak_tflops();
    std::printf("%s\n", nlohmann::json{{"device", cuda::device_name()}, {"bf16_gemm_peak_tflops", peak}}.dump().c_str());
    std::fflush(stdout);
    nn::GPTConfig config;
    config.vocab_size = 50257;
    config.context = context;
    config.width = 768;
    config.layers = 12;
    config.heads = 12;
    Generator g(0);
    const Tensor idx = randint(0, config.vocab_size, {batch, context}, &g).to(Device::cuda());
    const Tensor target = randint(0, config.vocab_size, {batch * context}, &g).to(Device::cuda());
    const int64_t vocab = config.vocab_size;
    std::vector<std::string> precisions = {"fp32", "fp16", "bf16", "fp16_naive"};
    if (which != "all") precisions = split_commas(which);
    std::vector<std::pair<std::string, std::string>> runs;  // (precision, trace)
    for (const std::string& precision : precisions)
      for (const std::string& trace : split_commas(traces)) runs.emplace_back(precision, trace);
    for (const auto& run : runs) {
      const std::string& precision = run.first;
      const std::string& trace = run.second;
      cuda::set_allow_tf32(precision == "fp32");  // fp32 runs its GEMMs in TF32, as torch with allow_tf32
      nn::ModulePtr model = std::make_shared<nn::GPT>(config, 0);
      model->to(Device::cuda());
      const int64_t params = model->num_parameters();
      std::shared_ptr<optim::Optimizer> opt =
          std::make_shared<optim::AdamW>(model->parameters(), nlohmann::json{{"lr", 1e-4}});
      mixed_precision::Criterion crit = [vocab](const Tensor& logits, const Tensor& t) {
        return cross_entropy(logits.reshape({-1, vocab}), t);
      };
      std::unique_ptr<mixed_precision::MixedPrecision> mp;
      if (precision != "fp32") {
        mp = mixed_precision::create(precision);
        auto c = mp->configure(model, opt, crit);
        model = c.model;
        opt = c.optimizer;
        crit = c.criterion;
      }
      // The tracer watches the (configured) model as the Trainer's does (Note [The first non-finite tensor]).
      std::optional<diagnostics::Tracer> tracer;
      if (trace != "off") tracer.emplace(*model);
      std::string first_nonfinite;
      double last_loss = 0;
      // Phase times of one step (host time to enqueue, and host + device time to finish each phase
      // with a sync after it), to tell a host-bound step from a device-bound one.
      std::vector<double> enqueue_fwd, fwd, bwd, upd;
      auto step = [&](bool phases) {
        auto t = Clock::now();
        if (tracer) tracer->begin_step(trace == "stats");
        Tensor loss;
        {
          const auto observing = tracer ? tracer->observe() : nullptr;
          loss = crit((*model)(idx), target);
          if (phases) {
            enqueue_fwd.push_back(seconds_since(t));
            cuda::synchronize();
            fwd.push_back(seconds_since(t));
            t = Clock::now();
          }
          if (mp) mp->backward(loss, *opt);
          else loss.backward();
        }
        if (tracer) tracer->end_step();
        if (phases) {
          cuda::synchronize();
          bwd.push_back(seconds_since(t));
          t = Clock::now();
        }
        if (mp) mp->step(*opt);
        else opt->step();
        last_loss = loss.item();  // one host sync per step, as a training loop that logs its loss
        if (tracer && !std::isfinite(last_loss) && first_nonfinite.empty())
          if (const auto f = tracer->first_nonfinite()) first_nonfinite = f->describe();
        opt->zero_grad();
        if (phases) upd.push_back(seconds_since(t));
      };
      for (int i = 0; i < warmup; ++i) step(false);
      std::vector<double> times;
      for (int i = 0; i < steps; ++i) {
        const auto t0 = Clock::now();
        step(false);
        times.push_back(seconds_since(t0));
      }
      for (int i = 0; i < 3; ++i) step(true);
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2] * 1e3;
      };
      const double s = median(times) / 1e3;
      const double tokens = double(batch * context);
      // Model FLOPs per token: 6 N for the dense parts plus 12 layers * width * context for attention
      // scores and values (forward + backward), as in the PaLM paper's MFU.
      const double flops = tokens * (6.0 * double(params) + 12.0 * double(config.layers * config.width * context));
      std::printf("%s\n", nlohmann::json{{"framework", "booster"},
                                         {"precision", precision},
                                         {"batch", batch},
                                         {"flash_attention", flash_attention_enabled()},
                                         {"trace", trace},
                                         {"context", context},
                                         {"params", params},
                                         {"ms_per_step", s * 1e3},
                                         {"tokens_per_s", tokens / s},
                                         {"tflops", flops / s / 1e12},
                                         {"mfu_vs_bf16_gemm", flops / s / 1e12 / peak},
                                         {"loss", last_loss},
                                         {"phase_ms", {{"forward_enqueue", median(enqueue_fwd)},
                                                       {"forward", median(fwd)},
                                                       {"backward", median(bwd)},
                                                       {"update", median(upd)}}},
                                         {"first_nonfinite", first_nonfinite},
                                         {"peak_mem_gib", double(cuda::peak_bytes()) / double(1 << 30)}}
                                .dump()
                                .c_str());
      std::fflush(stdout);
      // Under BOOSTER_CUDA_PROFILE=1: device time per kernel family over all steps above, per step.
      const std::string profile = cuda::profile_report();
      if (!profile.empty()) {
        std::printf("kernel families, %s, totals over %d steps (Note [CUDA kernel profile]):\n%s", precision.c_str(),
                    warmup + steps + 3, profile.c_str());
        cuda::reset_profile();
      }
      tracer.reset();  // before the model it watches
      model.reset();
      opt.reset();
      mp.reset();
      cuda::reset_peak_bytes();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpt2_cuda: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
