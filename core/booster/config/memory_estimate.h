// How much memory a training config needs per rank, before it runs: `booster check` prints it.
//
// Note [Memory estimate]
// ~~~~~~~~~~~~~~~~~~~~~~
// Per rank, from the resolved config and a world size:
//   parameters       every parameter in the model dtype (2 bytes when the strategy keeps the model in
//                    float16/bfloat16, else 4); every rank holds the whole model (ddp and ZeRO 1/2 alike)
//   gradients        one per parameter in the model dtype; ZeRO stage 2 keeps a 1/world_size shard
//   master weights   float32 copies, for strategies that keep them (bf16, fp16_naive, apex O2) and for
//                    low_level_zero in 16 bits; ZeRO shards them
//   optimizer state  per parameter: Adam/AdamW 2 (3 with amsgrad), SGD with momentum 1, without 0; in
//                    float32 with master weights, else in the model dtype; ZeRO (1 and 2) shards it
//   activations      what the forward keeps for backward, for one micro-batch (data.batch_size per rank):
//                    mlp/linear: the input, each hidden layer's output before and after its activation,
//                    the logits and their softmax; gpt: Megatron's count per layer and token,
//                    17 width + 2.5 heads x T elements (Korthikanti et al. 2022, "Reducing Activation
//                    Recomputation"), plus embeddings, the final norm, and logits with their softmax;
//                    llama: what its forward keeps per layer and token, grouped-query attention and
//                    activation checkpointing counted (Note [Counting a transformer] in
//                    memory_estimate.cpp); hf: as the gpt or llama its config.json describes.
//                    In 2 bytes under a 16-bit model or autocast, else 4. Other models: not estimated.
// The parameters of gpt, llama and hf are counted from their sizes (an hf model's from config.json,
// without reading the weights), equal to the built model's num_parameters(); any other model is built
// deferred (no memory) to count them.
// The model dtype, master weights and autocast dtype come from configuring the strategy (built-in or
// plugin) on a one-layer probe model, so a precision plugin is measured as it behaves. Counts are exact;
// what is not counted: allocator rounding and caching, communication buckets, the data set itself,
// temporaries inside backward, and the library's own code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace booster::config {

struct MemoryItem {
  std::string what;    // "parameters", "gradients", "master weights", "optimizer state", "activations"
  std::string detail;  // "195 x 2 bytes (bfloat16), sharded 1/2"
  int64_t bytes = 0;
  bool estimated = true;  // false: not estimated (bytes is 0)
};

struct MemoryEstimate {
  int world_size = 1;
  int64_t parameters = 0;  // the model's parameter count
  std::vector<MemoryItem> items;
  std::vector<std::string> notes;  // what is assumed or left out
  int64_t total_bytes() const;
};

// The estimate for a resolved config (config::resolve) on `world_size` ranks. A model other than mlp,
// linear, gpt, llama and hf is built once, deferred (on the CPU, from the config's seed), to count its
// parameters.
MemoryEstimate estimate_memory(const nlohmann::json& resolved, int world_size);

// The estimate as the table `booster check` prints.
std::string format_memory_estimate(const MemoryEstimate& estimate);
// "1.5 GiB", "195 bytes".
std::string format_bytes(double bytes);

// MemAvailable and MemTotal of /proc/meminfo in bytes (-1 where unknown). Test hook:
// BOOSTER_TEST_MEM_AVAILABLE=BYTES stands in for MemAvailable.
struct HostMemory {
  int64_t available = -1;
  int64_t total = -1;
};
HostMemory host_memory();

}  // namespace booster::config
