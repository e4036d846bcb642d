// Fine-tunes a language model from a Hugging Face directory (a Llama or a GPT-2: config.json and
// model.safetensors) on a token file with the Booster, saves the result as a Hugging Face directory and
// generates from it: the loop a user writes around boost(), with nothing from the `booster` command.
//
//   build/bin/finetune_hf HF_DIR TOKENS OUT_DIR [STEPS] [MIXED_PRECISION] [PLUGIN]
//   build/bin/finetune_hf tests/fixtures/hf/llama tokens.bin tuned 20 bf16
//   mpirun -np 2 build/bin/finetune_hf HF_DIR TOKENS OUT_DIR 20 fp32 low_level_zero
//
// TOKENS is a flat uint16 file of token ids (what `booster tokenize` writes); the defaults are 20 steps,
// fp32 and one process. The strategy and the plugin are the two last arguments: the loop below is the
// same for each. Generation runs on what boost() returned, so under ZeRO-3 it gathers what it needs and
// every rank calls it.
#include <algorithm>  // std::min: the sequence length
#include <cstdio>   // printf: progress and the tokens
#include <cstdlib>  // atoi
#include <string>
#include <vector>

#include "booster/booster/booster.h"     // Booster: precision and plugin injected into the loop
#include "booster/config/config.h"       // load_file: the source's config.json
#include "booster/data/dataloader.h"     // DataLoaderOptions
#include "booster/data/tokens.h"         // token_file_dataset: samples of seq_len tokens and the next
#include "booster/nn/generate.h"         // nn::generate: greedy tokens through the key/value cache
#include "booster/nn/hf.h"               // load_pretrained, the Hugging Face directory reader
#include "booster/nn/kv_cache.h"         // CausalLM: the model's vocabulary and length
#include "booster/ops/ops.h"             // cross_entropy
#include "booster/optim/lr_scheduler.h"  // CosineAnnealingLR
#include "booster/optim/optimizer.h"     // AdamW

using namespace booster;

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s HF_DIR TOKENS OUT_DIR [STEPS] [MIXED_PRECISION] [PLUGIN]\n", argv[0]);
    return 2;
  }
  const std::string hf_dir = argv[1], tokens = argv[2], out_dir = argv[3];
  const int steps = argc > 4 ? std::atoi(argv[4]) : 20;
  const std::string precision = argc > 5 ? argv[5] : "fp32";
  const std::string plugin = argc > 6 ? argv[6] : "single";
  try {
    Booster booster(BoosterConfig{.mixed_precision = precision, .plugin = plugin});

    // The pretrained model; a plugin that shards it (ZeRO-3) reads only this rank's part of the files.
    nn::ModulePtr net = nn::load_pretrained(hf_dir);
    const int64_t vocab = net->causal_lm()->vocab_size();
    const int64_t seq_len = std::min<int64_t>(32, net->causal_lm()->max_positions() - 1);
    auto dataset = data::token_file_dataset(tokens, data::TokenDType::UInt16, {.seq_len = seq_len, .vocab_size = vocab});
    std::shared_ptr<optim::Optimizer> adamw =
        optim::make_optimizer({{"type", "adamw"}, {"lr", 1e-3}, {"weight_decay", 0.0}}, net->parameters());
    auto cosine = std::make_shared<optim::CosineAnnealingLR>(*adamw, steps);
    auto loss_fn = [](const Tensor& logits, const Tensor& y) {
      return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
    };
    auto loader = booster.prepare_dataloader(dataset, {.batch_size = 4, .shuffle = true, .seed = 1});

    auto [model, optimizer, criterion, train_loader, scheduler] =
        booster.boost(net, adamw, loss_fn, loader, cosine);
    const bool rank0 = booster.process_group().rank() == 0;
    int step = 0;
    while (step < steps) {
      for (data::Batch& batch : *train_loader) {
        optimizer->zero_grad();
        Tensor loss = criterion((*model)(batch.x), batch.y);
        booster.backward(loss, *optimizer);
        optimizer->step();
        scheduler->step();
        if (rank0 && (step % 5 == 0 || step + 1 == steps)) std::printf("step %3d  loss %.4f\n", step, loss.item());
        if (++step == steps) break;
      }
    }

    // Collective: every rank calls, rank 0 writes. The source's config.json keys the model does not
    // set itself (bos_token_id, ...) are kept.
    booster.save_pretrained(out_dir, {.base_config = config::load_file(hf_dir + "/config.json")});
    if (rank0) std::printf("saved %s\n", out_dir.c_str());

    const nn::GenerateResult r = nn::generate(*model, {1, 2, 3}, {.max_new_tokens = 12, .temperature = 0.0});
    if (rank0) {
      std::printf("greedy continuation of 1 2 3:");
      for (int64_t id : r.tokens) std::printf(" %lld", static_cast<long long>(id));
      std::printf("\n");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "finetune_hf: %s\n", e.what());
    return 1;
  }
  return 0;
}
