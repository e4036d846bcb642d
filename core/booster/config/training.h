// The pieces of a training run that are built from a resolved config and shared by every driver
// (the `booster train` command, the Booster, examples): the loss, the data splits, evaluation.
//
// The model, optimizer and lr scheduler come from their own factories (nn::make_model,
// optim::make_optimizer, optim::make_scheduler), which read the same resolved sections.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/data/dataset.h"
#include "booster/data/file_dataset.h"
#include "booster/nn/loss.h"
#include "booster/nn/module.h"
#include "booster/optim/lr_scheduler.h"
#include "booster/tensor/tensor.h"

namespace booster::config {

using nn::Criterion;

// From the resolved `criterion` section:
//  * cross_entropy: output [N, C] or [B, T, C] (a language model; flattened to [B*T, C]) against class
//    indices [N] or [B, T], with label_smoothing and ignore_index as torch.nn.CrossEntropyLoss;
//  * mse: output against the target; integer class targets are one-hot encoded to the output's shape.
Criterion make_criterion(const nlohmann::json& criterion);

// What a run trains and evaluates on.
struct DataSplits {
  data::DatasetPtr train;
  data::DatasetPtr test;    // null when the data has no test split (then no evaluation)
  // Items of the test split to evaluate: every `eval_stride`-th. Overlapping windows of a text would
  // count each character `context` times; a stride of `context` counts each once.
  int64_t eval_stride = 1;
  int64_t tokens_per_sample = 1;  // `context` for text, `seq_len` for tokens, 1 for classification
  // Next-token prediction (text, tokens): evaluation reports perplexity too (TrainerOptions::perplexity).
  bool language_model = false;
  // sft: the targets outside the responses are this (-100), and a step's loss is the mean over the other
  // targets of the global batch (TrainerOptions::token_mean_ignore_index).
  std::optional<int64_t> token_mean_ignore_index;
  std::string description;       // "Fashion-MNIST: 60000 train, 10000 test", for the log
};

// From the resolved `data` section:
//  * fashion_mnist: the train/test splits from `dir` (normalized unless normalize = false);
//  * synthetic: num_samples + num_test_samples gaussian-blob points (same blobs in both splits);
//  * text: byte windows of `path`; the last test_fraction of the file is the test split; with a
//    `tokenizer` (a SentencePiece .model), windows of its token ids instead (Note [Encoding a text] in
//    booster/data/tokenizer.h), the last test_fraction of the ids the test split;
//  * tokens: samples of seq_len tokens of the token files `path` names, read as one (Note [Token files]
//    and Note [Token shards] in booster/data/tokens.h), `val_path`'s the test split, or with
//    `val_fraction` F the last F of the last file's tokens (ConfigError with val_path too);
//  * npy, safetensors, csv: a user's files (Note [File data] in booster/data/file_dataset.h), the
//    test_fraction split drawn with `seed`.
// `vocab_size`, the model's vocabulary (model_vocab_size), bounds the ids of token data (Note [Checking
// token ids]); 0: not checked. DataError (naming the file) when the data cannot be read.
DataSplits make_datasets(const nlohmann::json& data, uint64_t seed, int64_t vocab_size = 0);

// The patterns of token data's "path" (a string or a non-empty list of strings), for
// data::token_file_paths; ConfigError naming 'data.path' otherwise.
std::vector<std::string> token_data_paths(const nlohmann::json& data);

// The vocabulary of a resolved `model` section: its integer "vocab_size" (gpt, and any model that
// names its vocabulary so), else "vocab_size" of "config.json" in the directory `path` of an "hf" model;
// 0 when neither says.
int64_t model_vocab_size(const nlohmann::json& model);

// Whether `data.type` names files a user has ("npy", "safetensors", "csv").
bool is_file_data(const std::string& type);
// The loader options of a resolved npy, safetensors or csv `data` section, `seed` picking the
// test_fraction rows. ConfigError naming the keys for what the schema cannot check alone: x and y
// without each other or together with path, test files together with test_fraction, a label_column,
// header or delimiter of the wrong form, normalizing integer inputs.
data::FileDataOptions file_data_options(const nlohmann::json& data, uint64_t seed);

// From the resolved `lr_scheduler` section: null for "none", else optim::make_scheduler with a null
// T_max / total_steps replaced by `total_steps` (the run's length).
std::unique_ptr<optim::LRScheduler> make_lr_scheduler(const nlohmann::json& lr_scheduler, optim::Optimizer& optimizer,
                                                      int64_t total_steps);

// Note [Settings a resume must keep] (booster/booster/state.cpp) for `booster train`: the settings of a
// resolved config that a resume must not change, by key ("train.seed", "data", "optimizer", ...), with
// the run's length in steps as "train.max_steps" when the lr schedule spans the run. Passed to
// TrainerOptions::resume_settings.
nlohmann::json trajectory_settings(const nlohmann::json& config, int64_t total_steps);
// trajectory_settings as compared between runs of different world sizes (LoadStateOptions::
// portable_settings, Note [Resuming across layouts]): data.batch_size becomes data.global_batch_size
// (times world_size), the plugin section of single and ddp, whose layouts are the same, is left out, and
// so is low_level_zero's stage.
nlohmann::json portable_settings(const nlohmann::json& settings, int world_size);

}  // namespace booster::config
