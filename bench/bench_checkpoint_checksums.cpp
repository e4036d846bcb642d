// What checkpoint checksums cost (Note [Checkpoint checksums]): writing a model-sized safetensors file,
// then checksumming and verifying the directory, then reading the file back, each timed as the best
// of N repetitions. Usage: bench_checkpoint_checksums [MB of tensors, default 512] [repetitions, 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "booster/checkpoint/checksums.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/ops/ops.h"

namespace fs = std::filesystem;
using namespace booster;

namespace {

template <class F>
double best_seconds(int repetitions, F&& f) {
  double best = 1e30;
  for (int i = 0; i < repetitions; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t megabytes = argc > 1 ? std::atoll(argv[1]) : 512;
  const int repetitions = argc > 2 ? std::atoi(argv[2]) : 3;
  const fs::path dir = fs::temp_directory_path() / ("booster_bench_checksums_" + std::to_string(::getpid()));
  fs::create_directories(dir);

  // A GPT-like set: a few large matrices and many small vectors, float32.
  checkpoint::TensorMap tensors;
  const int64_t floats = megabytes * 1'000'000 / 4;
  const int64_t big = floats / 8;
  for (int i = 0; i < 8; ++i) tensors["layer" + std::to_string(i) + ".weight"] = randn({big});
  for (int i = 0; i < 64; ++i) tensors["norm" + std::to_string(i) + ".bias"] = randn({768});
  const fs::path file = dir / "model.safetensors";
  const double bytes = double(floats) * 4;

  const double write = best_seconds(repetitions, [&] { checkpoint::write_safetensors(file, tensors); });
  const double sum = best_seconds(repetitions, [&] { checkpoint::write_checksums(dir); });
  const double verify = best_seconds(repetitions, [&] { checkpoint::verify_checksums(dir); });
  const double read = best_seconds(repetitions, [&] { checkpoint::read_safetensors(file); });
  std::printf("%.0f MB of tensors, best of %d\n", bytes / 1e6, repetitions);
  std::printf("write_safetensors  %7.3f s  %6.2f GB/s\n", write, bytes / write / 1e9);
  std::printf("write_checksums    %7.3f s  %6.2f GB/s  (+%.0f%% of the write)\n", sum, bytes / sum / 1e9,
              100 * sum / write);
  std::printf("verify_checksums   %7.3f s  %6.2f GB/s  (+%.0f%% of the read)\n", verify, bytes / verify / 1e9,
              100 * verify / read);
  std::printf("read_safetensors   %7.3f s  %6.2f GB/s\n", read, bytes / read / 1e9);
  fs::remove_all(dir);
  return 0;
}
