// `booster check`'s memory estimate (Note [Memory estimate] in booster/config/memory_estimate.h):
// exact byte counts of a small MLP worked out by hand under fp32, a 16-bit strategy with master
// weights, ZeRO stages 1, 2 and 3 over two ranks, and the table and warning the command prints.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/config/config.h"
#include "booster/config/memory_estimate.h"
#include "run_booster.h"

using namespace booster;
using Catch::Matchers::Contains;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// in 8, hidden [16], classes 3: (8*16 + 16) + (16*3 + 3) = 144 + 51 = 195 parameters. Batch 32 keeps
// 32 * (8 input + 2*16 hidden before/after relu + 2*3 logits and softmax) = 32 * 46 = 1472 values.
json small_mlp() {
  return {{"model", {{"type", "mlp"}, {"in", 8}, {"hidden", {16}}, {"classes", 3}}},
          {"optimizer", {{"type", "adamw"}, {"lr", 0.01}}},
          {"data", {{"type", "synthetic"}, {"num_features", 8}, {"num_classes", 3}, {"batch_size", 32}}}};
}

int64_t bytes_of(const config::MemoryEstimate& e, const std::string& what) {
  for (const auto& item : e.items)
    if (item.what == what) return item.bytes;
  return -1;  // absent
}

}  // namespace

TEST_CASE("memory estimate: a small MLP in float32 with AdamW, by hand", "[memory]") {
  const config::MemoryEstimate e = config::estimate_memory(config::resolve(small_mlp()), 1);
  CHECK(e.parameters == 195);
  CHECK(bytes_of(e, "parameters") == 195 * 4);
  CHECK(bytes_of(e, "gradients") == 195 * 4);
  CHECK(bytes_of(e, "master weights") == -1);
  CHECK(bytes_of(e, "optimizer state") == 2 * 195 * 4);
  CHECK(bytes_of(e, "activations") == 1472 * 4);
  CHECK(e.total_bytes() == 780 + 780 + 1560 + 5888);

  // SGD: no state without momentum, one with; amsgrad adds a third for Adam.
  json c = small_mlp();
  c["optimizer"] = {{"type", "sgd"}, {"lr", 0.1}};
  CHECK(bytes_of(config::estimate_memory(config::resolve(c), 1), "optimizer state") == 0);
  c["optimizer"]["momentum"] = 0.9;
  CHECK(bytes_of(config::estimate_memory(config::resolve(c), 1), "optimizer state") == 195 * 4);
  c["optimizer"] = {{"type", "adam"}, {"lr", 0.1}, {"amsgrad", true}};
  CHECK(bytes_of(config::estimate_memory(config::resolve(c), 1), "optimizer state") == 3 * 195 * 4);
  // ddp replicates: the same per rank on 4 ranks.
  c = small_mlp();
  c["plugin"] = "ddp";
  CHECK(config::estimate_memory(config::resolve(c), 4).total_bytes() == e.total_bytes());
}

TEST_CASE("memory estimate: 16-bit models, master weights and ZeRO shards", "[memory]") {
  json c = small_mlp();
  c["mixed_precision"] = {{"name", "bf16"}, {"pure", true}};  // bfloat16 model, float32 masters and optimizer state
  config::MemoryEstimate e = config::estimate_memory(config::resolve(c), 1);
  CHECK(bytes_of(e, "parameters") == 195 * 2);
  CHECK(bytes_of(e, "gradients") == 195 * 2);
  CHECK(bytes_of(e, "master weights") == 195 * 4);
  CHECK(bytes_of(e, "optimizer state") == 2 * 195 * 4);
  CHECK(bytes_of(e, "activations") == 1472 * 2);
  // Autocast (fp16, and bf16 without pure): float32 weights, 16-bit activations.
  c["mixed_precision"] = "fp16";
  e = config::estimate_memory(config::resolve(c), 1);
  CHECK(bytes_of(e, "parameters") == 195 * 4);
  CHECK(bytes_of(e, "master weights") == -1);
  CHECK(bytes_of(e, "activations") == 1472 * 2);

  // low_level_zero in bf16 over 2 ranks: ceil(195 / 2) = 98 parameters' share.
  c["mixed_precision"] = "fp32";
  c["plugin"] = {{"name", "low_level_zero"}, {"stage", 1}, {"precision", "bf16"}};
  e = config::estimate_memory(config::resolve(c), 2);
  CHECK(bytes_of(e, "parameters") == 195 * 2);   // every rank holds the model
  CHECK(bytes_of(e, "gradients") == 195 * 2);    // stage 1 keeps whole gradients
  CHECK(bytes_of(e, "master weights") == 98 * 4);
  CHECK(bytes_of(e, "optimizer state") == 2 * 98 * 4);
  c["plugin"]["stage"] = 2;
  e = config::estimate_memory(config::resolve(c), 2);
  CHECK(bytes_of(e, "gradients") == 98 * 2);     // stage 2 shards them too
  CHECK(e.total_bytes() == 390 + 196 + 392 + 784 + 1472 * 2);
  c["plugin"]["stage"] = 3;
  e = config::estimate_memory(config::resolve(c), 2);
  CHECK(bytes_of(e, "parameters") == 98 * 2);    // stage 3 shards the parameters as well
  CHECK(bytes_of(e, "gradients") == 98 * 2);
  CHECK(e.total_bytes() == 196 + 196 + 392 + 784 + 1472 * 2);
}

TEST_CASE("memory estimate: LoRA trains the adapters only, by hand", "[memory][lora]") {
  // A Llama of width 32, 4 heads over 2 key/value heads (head_dim 8), 2 layers; LoRA r 4 on q_proj
  // (32 -> 32) and v_proj (32 -> 16) adds r * (in + out) per Linear: 4 * (64 + 48) = 448 per layer, 896.
  json c = {{"model", {{"type", "llama"}, {"vocab_size", 256}, {"hidden_size", 32}, {"intermediate_size", 48},
                       {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                       {"max_position_embeddings", 16}}},
            {"optimizer", {{"type", "adamw"}, {"lr", 0.01}}},
            {"mixed_precision", {{"name", "bf16"}, {"pure", true}}},
            {"data", {{"type", "text"}, {"path", std::string(BOOSTER_SOURCE_DIR) + "/README.md"}, {"context", 16},
                      {"batch_size", 2}}}};
  const config::MemoryEstimate full = config::estimate_memory(config::resolve(c), 1);
  const int64_t base = full.parameters;
  REQUIRE(bytes_of(full, "gradients") == base * 2);
  c["lora"] = {{"r", 4}, {"alpha", 8}, {"target_modules", {"q_proj", "v_proj"}}};
  config::MemoryEstimate e = config::estimate_memory(config::resolve(c), 1);
  CHECK(e.parameters == base + 896);
  CHECK(bytes_of(e, "parameters") == (base + 896) * 2);  // the frozen base stays bfloat16
  CHECK(bytes_of(e, "gradients") == 896 * 2);
  CHECK(bytes_of(e, "master weights") == 896 * 4);
  CHECK(bytes_of(e, "optimizer state") == 2 * 896 * 4);
  CHECK(bytes_of(e, "activations") == bytes_of(full, "activations"));
  // ZeRO stage 2 over 2 ranks shards the adapters' gradients, masters and moments: 448 each.
  c["mixed_precision"] = "fp32";
  c["plugin"] = {{"name", "low_level_zero"}, {"stage", 2}, {"precision", "bf16"}};
  e = config::estimate_memory(config::resolve(c), 2);
  CHECK(bytes_of(e, "parameters") == (base + 896) * 2);
  CHECK(bytes_of(e, "gradients") == 448 * 2);
  CHECK(bytes_of(e, "master weights") == 448 * 4);
  CHECK(bytes_of(e, "optimizer state") == 2 * 448 * 4);
}

TEST_CASE("memory estimate: GPT parameters and activations, and library models not estimated", "[memory]") {
  json c = {{"model", {{"type", "gpt"}, {"vocab_size", 256}, {"context", 16}, {"width", 32}, {"layers", 2}, {"heads", 4}}},
            {"optimizer", {{"type", "adamw"}, {"lr", 0.01}}},
            {"data", {{"type", "text"}, {"path", std::string(BOOSTER_SOURCE_DIR) + "/README.md"}, {"context", 16},
                      {"batch_size", 4}}}};
  const config::MemoryEstimate e = config::estimate_memory(config::resolve(c), 1);
  const int64_t w = 32, per_block = 4 * w + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w);
  CHECK(e.parameters == 256 * w + 16 * w + 2 * per_block + 2 * w + w * 256);
  // Megatron's 17 w + 2.5 heads T per layer and token, + 3 w + 2 vocab, for 4 x 16 tokens.
  CHECK(bytes_of(e, "activations") == 4 * 16 * (2 * (17 * 32 + 160) + 3 * 32 + 2 * 256) * 4);

  json lib = small_mlp();
  lib["model"] = {{"type", "toy_mlp"}, {"library", std::string(BOOSTER_TEST_MODEL_DIR) + "/libbooster_model_toy.so"},
                  {"in", 8}, {"hidden", 5}, {"classes", 3}};
  const config::MemoryEstimate l = config::estimate_memory(config::resolve(lib), 1);
  CHECK(l.parameters == 8 * 5 + 5 + 5 * 3 + 3);
  CHECK(bytes_of(l, "activations") == 0);
  CHECK_THAT(config::format_memory_estimate(l), Contains("not estimated for model 'toy_mlp'"));
}

TEST_CASE("booster check prints the table per rank and warns when the machine is too small", "[memory][cli]") {
  const fs::path dir = fs::temp_directory_path() / ("booster_test_memory_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path cfg = dir / "small.json";
  std::ofstream(cfg) << small_mlp().dump();
  testing::RunResult r = testing::run_booster_in(dir, "check --config " + cfg.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("memory per rank (world size 1, 195 parameters)") && Contains("780 bytes") &&
                        Contains("optimizer state") && Contains("5.8 KiB") && Contains("machine:"));
  CHECK_THAT(r.err, !Contains("warning"));
  CHECK_NOTHROW(json::parse(r.out));  // stdout stays the resolved config
  r = testing::run_booster_in(dir, "check --config " + cfg.string() + " -n 2 --plugin low_level_zero");
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("world size 2") && Contains("sharded 1/2"));
  // A model whose parameters, gradients and moments need about 2.6 TB (widths under booster's limit of
  // 2^24): the warning names what to lower.
  r = testing::run_booster_in(dir, "check --config " + cfg.string() +
                                       " --set model.hidden=[400000,400000] --set data.batch_size=1");
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("booster: warning:") && Contains("more than the") && Contains("data.batch_size"));
  r = testing::run_booster_in(dir, "check --config " + cfg.string() + " -n 0");
  CHECK(r.exit_code == 2);
}
