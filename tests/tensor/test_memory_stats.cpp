// The live tensor bytes the allocators count (booster/tensor/memory_stats.h) and the peak the Trainer
// reports from them (Note [Peak memory of a run] in trainer.cpp). The counts are checked exactly
// against byte sizes derived from the shapes and the CPU allocator's documented 64-byte blocks, and the
// Trainer's peak against an independent figure: how much the process's peak resident memory (the
// kernel's VmHWM) grew over the same fit().
#include <catch2/catch.hpp>

#include <malloc.h>

#include <fstream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/data/data.h"
#include "booster/nn/nn.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/memory_stats.h"
#include "booster/tensor/random.h"
#include "booster/tensor/storage.h"
#include "booster/trainer/trainer.h"
#include "../cuda_skip.h"
#include "../skip.h"

using namespace booster;

namespace {

// The CPU allocator hands out whole 64-byte blocks (Note [CPU caching allocator]).
int64_t cpu_block(int64_t nbytes) { return (nbytes + 63) / 64 * 64; }

int64_t in_use() { return memory_stats(DeviceType::CPU).in_use; }
int64_t peak() { return memory_stats(DeviceType::CPU).peak; }

// A field of /proc/self/status in bytes ("VmHWM", "VmRSS"); -1 when it is missing.
int64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  return -1;
}

// Three 2048 x 2048 layers: 12.6 M float32 parameters (50 MB). Its AdamW training adds gradients and
// two moments (150 MB), far more than the batch's activations, the loader or the autograd graph.
class Wide : public nn::Module {
 public:
  Wide() {
    for (int i = 0; i < 3; ++i)
      layers_.push_back(register_module("l" + std::to_string(i), std::make_shared<nn::Linear>(kWidth, kWidth)));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (size_t i = 0; i < layers_.size(); ++i) h = i + 1 < layers_.size() ? relu((*layers_[i])(h)) : (*layers_[i])(h);
    return h;
  }
  std::string name() const override { return "Wide"; }
  static constexpr int64_t kWidth = 2048;

 private:
  std::vector<std::shared_ptr<nn::Linear>> layers_;
};

}  // namespace

TEST_CASE("memory_stats: the CPU allocator counts each tensor's rounded bytes and the peak exactly",
          "[memory_stats]") {
  const int64_t start = in_use();
  reset_peak_memory_stats(DeviceType::CPU);
  CHECK(peak() == start);
  const int64_t a_bytes = cpu_block(1 * 4), b_bytes = cpu_block(17 * 4), c_bytes = cpu_block(1000 * 4),
                d_bytes = cpu_block(16 * 8);
  CHECK(a_bytes == 64);  // the rounding itself: 4 bytes take a block,
  CHECK(b_bytes == 128);  // 68 bytes two,
  CHECK(c_bytes == 4032);  // 4000 bytes 63
  {
    const Tensor a = Tensor::empty({1});
    CHECK(in_use() - start == a_bytes);
    const Tensor b = Tensor::empty({17});
    CHECK(in_use() - start == a_bytes + b_bytes);
    const Tensor view = b.slice(0, 2, 9);  // a view allocates nothing
    CHECK(in_use() - start == a_bytes + b_bytes);
    {
      const Tensor c = Tensor::empty({1000});
      CHECK(in_use() - start == a_bytes + b_bytes + c_bytes);
    }
    CHECK(in_use() - start == a_bytes + b_bytes);
    CHECK(peak() - start == a_bytes + b_bytes + c_bytes);  // the peak stays where c was live
    const Tensor d = Tensor::empty({16}, DType::Float64);
    CHECK(in_use() - start == a_bytes + b_bytes + d_bytes);
    CHECK(peak() - start == a_bytes + b_bytes + c_bytes);
    // A block from the cache (c's, freed above) counts as a fresh one does.
    const Tensor c_again = Tensor::empty({1000});
    CHECK(in_use() - start == a_bytes + b_bytes + d_bytes + c_bytes);
    CHECK(peak() - start == a_bytes + b_bytes + d_bytes + c_bytes);
  }
  CHECK(in_use() == start);
  CHECK(peak() - start == a_bytes + b_bytes + d_bytes + c_bytes);
  reset_peak_memory_stats(DeviceType::CPU);
  CHECK(peak() == start);
  // The public figures are the allocator's own.
  CHECK(size_t(in_use()) == cpu_bytes_in_use());
  CHECK(size_t(peak()) == cpu_peak_bytes());
  CHECK(memory_stats(DeviceType::CPU).reserved == 0);
}

TEST_CASE("memory_stats: the CUDA caching allocator counts rounded bytes, reserved bytes and their peaks",
          "[memory_stats][cuda]") {
  if (::testing::skip_without_gpu()) return;
  const Device gpu = Device::cuda(0);
  // Note [CUDA caching allocator]: 512-byte blocks up to 1 MiB, 2 MiB ones above.
  auto cuda_block = [](int64_t n) {
    return n <= (int64_t(1) << 20) ? (n + 511) / 512 * 512 : (n + (int64_t(2) << 20) - 1) / (int64_t(2) << 20) * (int64_t(2) << 20);
  };
  const int64_t small = cuda_block(1000 * 4), large = cuda_block(int64_t(3) << 20);
  CHECK(small == 4096);
  CHECK(large == int64_t(4) << 20);
  allocator_for(gpu).empty_cache();  // nothing cached: what is reserved is in use
  const MemoryStats start = memory_stats(DeviceType::CUDA);
  REQUIRE(start.reserved == start.in_use);
  reset_peak_memory_stats(DeviceType::CUDA);
  {
    const Tensor a = Tensor::empty({1000}, DType::Float32, gpu);
    const Tensor b = Tensor::empty({int64_t(3) << 18}, DType::Float32, gpu);  // 3 MiB
    const MemoryStats m = memory_stats(DeviceType::CUDA);
    CHECK(m.in_use - start.in_use == small + large);
    CHECK(m.reserved - start.reserved == small + large);
    CHECK(m.peak - start.in_use == small + large);
    CHECK(m.peak_reserved - start.reserved == small + large);
  }
  // Freed blocks stay reserved in the cache; a block of a cached size comes from it, reserving nothing.
  MemoryStats m = memory_stats(DeviceType::CUDA);
  CHECK(m.in_use == start.in_use);
  CHECK(m.reserved - start.reserved == small + large);
  {
    const Tensor again = Tensor::empty({int64_t(3) << 18}, DType::Float32, gpu);
    CHECK(memory_stats(DeviceType::CUDA).reserved - start.reserved == small + large);
  }
  allocator_for(gpu).empty_cache();
  m = memory_stats(DeviceType::CUDA);
  CHECK(m.reserved == start.reserved);
  CHECK(m.peak_reserved - start.reserved == small + large);  // the peaks stay until a reset
  reset_peak_memory_stats(DeviceType::CUDA);
  m = memory_stats(DeviceType::CUDA);
  CHECK(m.peak == m.in_use);
  CHECK(m.peak_reserved == m.reserved);
}

// Note [Peak tensor bytes against peak RSS]
// The kernel's VmHWM is the peak of the process's resident memory, and writing "5" to
// /proc/self/clear_refs sets it to the present RSS, so VmHWM after fit() minus RSS before is how much
// the process's resident memory peaked above its start during fit(). Before it, the allocator's cache
// is emptied and malloc_trim returns freed heap to the system, so the tensors fit() creates take pages
// that were not resident, and every tensor here is written whole (weights, gradients, zeroed moments,
// activations): each live tensor byte is a resident byte. The growth is therefore at least the peak of
// tensor bytes above the start, less at most one partly-touched page per allocation at its ends, and
// at most that plus what is not a tensor: the autograd graph, the batch, glibc's chunk headers and
// OpenBLAS's buffers (made resident by a warm-up GEMM before the span), a few MB against 150 MB. The
// bound: 0.97 <= growth / tensor peak <= 1.15.
TEST_CASE("memory_stats: the Trainer's peak_tensor_bytes matches the growth of the process's peak RSS",
          "[memory_stats][trainer]") {
  manual_seed(1);
  auto model = std::make_shared<Wide>();
  (void)matmul(randn({64, Wide::kWidth}), randn({Wide::kWidth, Wide::kWidth}));  // OpenBLAS's buffers
  const int64_t n = 64;
  auto data = std::make_shared<data::TensorDataset>(randn({n, Wide::kWidth}), randn({n, Wide::kWidth}));
  Booster booster(BoosterConfig{});
  auto adamw = std::make_shared<optim::AdamW>(model->parameters(), nlohmann::json{{"lr", 1e-3}});
  auto loader = booster.prepare_dataloader(data, {.batch_size = 32});
  nn::Criterion mse = [](const Tensor& out, const Tensor& y) { return mse_loss(out, y); };
  booster.boost(model, adamw, mse, loader, nullptr);
  TrainerOptions o;
  o.epochs = 1;  // 2 steps
  o.progress = trainer::Progress::Mode::Silent;
  Trainer trainer(booster, o);

  allocator_for(Device::cpu()).empty_cache();
  ::malloc_trim(0);
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    if (!clear.flush()) {
      skip_test("/proc/self/clear_refs cannot reset the peak RSS here");
      return;
    }
  }
  const int64_t rss_before = status_bytes("VmRSS");
  REQUIRE(rss_before > 0);
  REQUIRE(status_bytes("VmHWM") - rss_before < (int64_t(1) << 20));  // the reset took
  const int64_t tensors_before = in_use();
  const FitResult result = trainer.fit();
  const int64_t rss_growth = status_bytes("VmHWM") - rss_before;

  REQUIRE(result.steps == 2);
  REQUIRE(result.peak_tensor_bytes.size() == 1);
  const int64_t tensor_growth = result.peak_tensor_bytes[0] - tensors_before;
  const int64_t params = model->num_parameters();
  // The peak counts from the run's start what was live then: at least the parameters, gradients and
  // two AdamW moments were live at once.
  CHECK(result.peak_tensor_bytes[0] >= 4 * 4 * params);
  CHECK(tensor_growth > 100'000'000);  // dominates the process, as the bound above assumes
  const double ratio = double(rss_growth) / double(tensor_growth);
  INFO("peak tensor bytes grew " << tensor_growth << ", peak RSS grew " << rss_growth << ": ratio " << ratio);
  CHECK(ratio >= 0.97);
  CHECK(ratio <= 1.15);
  WARN("peak RSS growth / peak tensor bytes growth = " << ratio);
  // The summary holds the same figure.
  CHECK(result.to_json().at("peak_tensor_bytes").get<int64_t>() == result.peak_tensor_bytes[0]);
  CHECK_FALSE(result.to_json().contains("peak_reserved_bytes"));  // CUDA only
}
