// A Llama with Llama's head size (128) on CUDA under bfloat16 autocast, its attention through the flash
// kernel and through the unfused one, against the same model in float32 on the CPU: the loss and every
// parameter's gradient. Skipped, with the reason, without a GPU.
#include <catch2/catch.hpp>

#include "cuda_skip.h"

#include <cmath>
#include <map>
#include <vector>

#include "booster/autocast/autocast.h"
#include "booster/backends/cuda/cuda.h"
#include "booster/nn/llama.h"
#include "booster/ops/ops.h"

using namespace booster;

namespace {

// ||got - ref|| / ||ref|| (L2), on the host in float64.
double rel_error(const Tensor& got, const Tensor& ref) {
  const std::vector<double> g = got.to(DType::Float64).cpu().contiguous().tolist();
  const std::vector<double> r = ref.to(DType::Float64).cpu().contiguous().tolist();
  REQUIRE(g.size() == r.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return INFINITY;
    num += (g[i] - r[i]) * (g[i] - r[i]);
    den += r[i] * r[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

Tensor loss_of(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

}  // namespace

// Tolerance: bfloat16 keeps 8 bits (u = 2^-8). Each GEMM input is rounded once (u relative, in norm about
// u / sqrt(3) for uniformly spread rounding errors), and a value passes about 2 L + 1 = 5 rounded GEMMs
// and attentions in series (RMSNorm and the residual stream stay float32), so the logits carry a few u
// in norm; the mean loss averages them further. Gradients go through as many roundings again backward
// (and the attention's P and dS roundings, Note [Flash attention tolerance]): 8 u in norm = 3e-2, with
// the loss held to 2u relative.
TEST_CASE("llama on CUDA: head size 128, bfloat16 autocast, flash and unfused attention, equals the CPU",
          "[cuda][llama]") {
  if (testing::skip_without_gpu()) return;
  nn::LlamaConfig cfg;
  cfg.vocab_size = 512;
  cfg.hidden_size = 256;
  cfg.intermediate_size = 512;
  cfg.num_hidden_layers = 2;
  cfg.num_attention_heads = 2;  // head size 128
  cfg.num_key_value_heads = 1;
  cfg.max_position_embeddings = 256;
  nn::Llama cpu(cfg, 5), gpu(cfg, 5);
  gpu.to(Device::cuda());
  Generator gen(7);
  const Tensor ids = randint(0, cfg.vocab_size, {2, 100}, &gen);  // 100: tiles of 64 and a partial one
  const Tensor y = randint(0, cfg.vocab_size, {2, 100}, &gen);
  const Tensor want = loss_of(cpu(ids), y);
  want.backward();
  std::map<std::string, Tensor> ref;
  for (const auto& [name, p] : cpu.named_parameters()) ref[name] = p.grad();

  const double u = std::ldexp(1.0, -8);
  for (bool flash : {true, false}) {
    INFO((flash ? "flash attention" : "unfused attention"));
    set_flash_attention_enabled(flash);
    gpu.zero_grad();
    Tensor loss;
    {
      autocast::AutocastGuard guard(true, DType::BFloat16);
      loss = loss_of(gpu(ids.to(Device::cuda())), y.to(Device::cuda()));
    }
    loss.backward();
    INFO("loss " << loss.item() << " against " << want.item());
    CHECK(std::abs(loss.item() - want.item()) <= 2 * u * std::abs(want.item()));
    for (const auto& [name, p] : gpu.named_parameters()) {
      INFO(name);
      REQUIRE(p.grad().defined());
      const double err = rel_error(p.grad(), ref.at(name));
      INFO("gradient error " << err << ", bound " << 8 * u);
      CHECK(err <= 8 * u);
    }
  }
  set_flash_attention_enabled(true);
}
