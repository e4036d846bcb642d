// The schema of a training config: every section, key, type, range and default, in one table.
//
// The factories (make_model, make_optimizer, make_scheduler, make_criterion, make_datasets) read
// configs that went through resolve() with this table, so a key added here is a key they may read,
// and a key they read must be declared here.
#include "booster/config/config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "booster/common/error.h"
#include "booster/common/json_text.h"
#include "booster/config/training.h"
#include "booster/data/file_dataset.h"
#include "booster/data/tokenizer.h"
#include "booster/data/tokens.h"
#include "booster/nn/families.h"
#include "booster/nn/llama.h"
#include "booster/nn/model_registry.h"
#include "booster/plugin/loader.h"

namespace booster::config {
namespace {

// Note [The depth limit]
// ~~~~~~~~~~~~~~~~~~~~~~
// A config's model names its layers: an MLP's "hidden" widths, a CNN's "channels", a GPT's "layers",
// a Llama's "num_hidden_layers". Nothing else bounds them, and 16 MB of config text holds a list of
// 5 000 000 layers, which builds for minutes before anything is printed. No network trained here comes
// near kMaxModelDepth layers, so a deeper one is a generated config gone wrong: resolve() refuses it at
// once, naming the limit, before any item is checked or any layer built; a list far longer than that
// stops where the config text is read (JsonLimits::max_items in json_text.h).
// Small builders so each row of the table reads as one line.
Field boolean(std::string key, bool def, std::string help = "") {
  Field f;
  f.key = std::move(key);
  f.kind = Kind::Bool;
  f.default_value = def;
  f.help = std::move(help);
  return f;
}

Field integer(std::string key, std::optional<int64_t> def, std::optional<double> min,
              std::optional<double> max = std::nullopt, std::string help = "") {
  Field f;
  f.key = std::move(key);
  f.kind = Kind::Int;
  if (def) f.default_value = *def;
  f.min = min;
  f.max = max;
  f.help = std::move(help);
  return f;
}

Field number(std::string key, std::optional<double> def, std::optional<double> min,
             std::optional<double> max = std::nullopt, bool min_exclusive = false, bool max_exclusive = false,
             std::string help = "") {
  Field f;
  f.key = std::move(key);
  f.kind = Kind::Number;
  if (def) f.default_value = *def;
  f.min = min;
  f.max = max;
  f.min_exclusive = min_exclusive;
  f.max_exclusive = max_exclusive;
  f.help = std::move(help);
  return f;
}

Field text(std::string key, std::optional<std::string> def, std::vector<std::string> choices = {},
           std::string help = "") {
  Field f;
  f.key = std::move(key);
  f.kind = Kind::String;
  if (def) f.default_value = *def;
  f.choices = std::move(choices);
  f.help = std::move(help);
  return f;
}

Field numbers(std::string key, json def, Kind item_kind, std::optional<double> min, std::optional<double> max,
              std::optional<size_t> length, bool max_exclusive = false, std::string help = "") {
  Field f;
  f.key = std::move(key);
  f.kind = Kind::Array;
  f.item_kind = item_kind;
  f.default_value = std::move(def);
  f.min = min;
  f.max = max;
  f.max_exclusive = max_exclusive;
  f.length = length;
  f.help = std::move(help);
  return f;
}

// A list with one item per layer of a model (Note [The depth limit]).
Field layer_list(std::string key, json def) {
  Field f = numbers(std::move(key), std::move(def), Kind::Int, 1, std::nullopt, std::nullopt);
  f.max_length = size_t(kMaxModelDepth);
  f.max_length_name = "the depth limit";
  return f;
}

// A value whose type the table does not fix (an index or a name); its reader checks it.
Field any(std::string key, json def, std::string help = "") {
  Field f;
  f.key = std::move(key);
  f.kind = Kind::Any;
  f.default_value = std::move(def);
  f.help = std::move(help);
  return f;
}

// A string that may be null: "not set" (no run directory, no resume).
Field optional_text(std::string key, json def, std::string help = "") {
  Field f = text(std::move(key), std::nullopt, {}, std::move(help));
  f.nullable = true;
  f.default_value = std::move(def);
  return f;
}

// A positive number that may be null (the default): "not set", e.g. no clipping.
Field optional_number(std::string key, double exclusive_min, std::string help = "") {
  Field f = number(std::move(key), std::nullopt, exclusive_min, std::nullopt, true, false, std::move(help));
  f.nullable = true;
  f.default_value = nullptr;
  return f;
}

// An integer that may be null (the default): "not set", e.g. no step limit.
Field optional_integer(std::string key, double min, std::string help = "") {
  Field f = integer(std::move(key), std::nullopt, min, std::nullopt, std::move(help));
  f.nullable = true;
  f.default_value = nullptr;
  return f;
}

// Token data's "path": a file, a glob or a list of them (Note [Token shards] in booster/data/tokens.h),
// required; its form is checked by config::token_data_paths.
Field token_paths() {
  Field f = any("path", nullptr,
                "token files: flat token ids (nanoGPT's .bin) or llm.c shards; a file, a glob (\"shards/*.bin\", "
                "sorted) or a list, read in order as one");
  f.default_value = std::nullopt;
  return f;
}

// Token data's "val_fraction": the tail of the last file held out as validation; null: none.
Field val_fraction() {
  Field f = optional_number("val_fraction", 0.0,
                            "without val_path: this share of the last file's tokens, its end, is the validation data");
  f.max = 1.0;
  f.max_exclusive = true;
  return f;
}

// SFT data's "val_fraction": the last records of the file held out as validation; null: none.
Field sft_val_fraction() {
  Field f = val_fraction();
  f.help = "without val_path: this share of the records, the file's last, is the validation data";
  return f;
}

// The keys every file data type shares (Note [File data] in booster/data/file_dataset.h).
std::vector<Field> with_file_data_fields(std::vector<Field> fields) {
  fields.push_back(number("test_fraction", 0.0, 0.0, 1.0, false, true,
                          "without test files: this share of the rows is the test split (a shuffle seeded by train.seed)"));
  fields.push_back(text("normalize", "none", {"none", "standardize", "scale"},
                        "standardize: per feature, with the training split's mean and std; scale: x / divide_by"));
  fields.push_back(number("divide_by", 255.0, 0.0, std::nullopt, true, false, "for normalize \"scale\""));
  fields.push_back(text("x_dtype", "float32", {"float32", "float64", "int64"}, "what the inputs become"));
  fields.push_back(text("targets", "classes", {"classes", "values"},
                        "classes: integer labels; values: float targets (regression, with an mse criterion)"));
  fields.push_back(boolean("allow_nonfinite", false,
                           "keep inf/NaN inputs and float targets; false: a file holding one is an error naming "
                           "its sample and element"));
  return fields;
}

// Note [Models the table does not list]
// The table checks the built-in models key by key. Any other model type is either one a program
// registered (nn::register_model) or one of a model library named by "library" (Note [Model libraries]
// in booster/nn/model_registry.h); their keys belong to their factories, which check them when the
// model is built, so here they are kept as given. A library is loaded to check that it is a model
// library of this ABI version (PluginError otherwise) and that it provides `type`.
json resolve_other_model(const std::string& type, const json& rest) {
  if (!rest.contains("library")) {
    if (nn::has_model(type)) return rest;
    std::vector<std::string> names = nn::registered_models();
    std::string msg = "'model.type' is \"" + type + "\"; expected one of ";
    for (size_t i = 0; i < names.size(); ++i) msg += (i ? ", '" : "'") + names[i] + "'";
    msg += ", or a model of a model library: set 'model.library' to its name or path";
    if (auto guess = nearest(type, names)) msg += " (did you mean '" + *guess + "'?)";
    throw ConfigError(msg);
  }
  const json& library = rest.at("library");
  if (!library.is_string() || library.get<std::string>().empty())
    throw ConfigError("'model.library' is " + show(library) +
                      "; expected the name of a model library (libbooster_model_<name>.so on the plugin search path) "
                      "or the path to one");
  const std::string name = library.get<std::string>();
  if (!plugin::is_path(name) && plugin::find_or_empty(plugin::kModelKind, name).empty())
    throw ConfigError("'model.library' is \"" + name + "\", which was not found: " +
                      plugin::describe_search(plugin::kModelKind, name));
  const std::vector<std::string> provided = nn::library_models(name);
  if (std::find(provided.begin(), provided.end(), type) == provided.end()) {
    std::string msg = "'model.type' is \"" + type + "\" but model library '" + name + "' provides ";
    for (size_t i = 0; i < provided.size(); ++i) msg += (i ? ", '" : "'") + provided[i] + "'";
    if (auto guess = nearest(type, provided)) msg += " (did you mean '" + *guess + "'?)";
    throw ConfigError(msg);
  }
  return rest;
}

// Note [Llama and Hugging Face model keys]
// The table checks a Llama's keys (nn::make_llama's, Hugging Face's LlamaConfig names) and an hf model's
// (nn::make_hf's: the directory and the overrides it takes), so a typo gets "did you mean" as any other
// key, and fills their defaults, the ones make_llama would use. What the table cannot see (sizes that
// must divide, what the directory holds) is checked by building the model deferred (check_model). Two
// defaults are not constants: num_key_value_heads null becomes the query heads, and an hf model's
// dropout (nn::GPT's one rate, for a gpt2 directory only) is left out unless set (finish_model).
Field hf_dropout() {
  Field f = number("dropout", std::nullopt, 0.0, 1.0, false, true,
                   "a gpt2 directory only: nn::GPT's dropout rate (config.json's *_pdrop are not applied); null: none");
  f.nullable = true;
  f.default_value = nullptr;
  return f;
}

// The keys of a decoder family (llama, mistral, qwen2), from its one declaration (Note [Decoder
// families] in nn/llama.cpp): Llama's keys with the family's defaults, and the family's own keys.
std::vector<Field> decoder_fields(const nn::DecoderFamily& family) {
  std::vector<Field> fields = {
      integer("vocab_size", std::nullopt, 1),
      integer("hidden_size", std::nullopt, 1, std::nullopt,
              "the width; num_attention_heads must divide it into heads of an even size (RoPE)"),
      integer("intermediate_size", std::nullopt, 1, std::nullopt, "the SwiGLU feed-forward's width"),
      integer("num_hidden_layers", std::nullopt, 1, double(kMaxModelDepth), "decoder layers (Note [The depth limit])"),
      integer("num_attention_heads", std::nullopt, 1, std::nullopt, "query heads"),
      optional_integer("num_key_value_heads", 1,
                       "key/value heads, dividing num_attention_heads (grouped-query attention); null: "
                       "as many as the query heads"),
      integer("max_position_embeddings", family.default_max_positions, 1, std::nullopt, "longest sequence"),
      number("rms_norm_eps", 1e-6, 0.0, std::nullopt, true),
      number("rope_theta", family.default_rope_theta, 0.0, std::nullopt, true),
      boolean("tie_word_embeddings", false, "lm_head reads the embedding table (one tensor)"),
      boolean("activation_checkpointing", false,
              "recompute each decoder layer's activations in backward: less memory, one more forward"),
      any("rope_scaling", nullptr,
          "Hugging Face's rope_scaling: null, {\"rope_type\": \"linear\", \"factor\"} or {\"rope_type\": \"llama3\", "
          "\"factor\", \"low_freq_factor\", \"high_freq_factor\", \"original_max_position_embeddings\"}"),
  };
  for (const auto& [key, fallback] : family.extra_keys)
    fields.push_back(any(key, fallback, key == "sliding_window" ? "keys a query attends, itself included; null: all"
                                        : key == "use_sliding_window" ? "whether the window is used at all"
                                                                      : "layers below this index attend everything"));
  return fields;
}

// The keys of a family declared as data (the GPT's: nn/gpt_family.cpp), with the schema's defaults and
// bounds from its one declaration (Note [Model families] in nn/families.cpp).
std::vector<Field> family_fields(const nn::ModelFamily& family) {
  std::vector<Field> fields;
  for (const nn::FamilyKey& k : family.keys) {
    switch (k.kind) {
      case nn::FamilyKey::Kind::Integer:
        fields.push_back(integer(k.name, k.default_value.get<int64_t>(), k.min,
                                 k.depth ? std::optional<double>(double(kMaxModelDepth)) : std::nullopt, k.help));
        break;
      case nn::FamilyKey::Kind::Number:
        fields.push_back(number(k.name, k.default_value.get<double>(), k.min, k.max, false, true, k.help));
        break;
      case nn::FamilyKey::Kind::Boolean:
        fields.push_back(boolean(k.name, k.default_value.get<bool>(), k.help));
        break;
    }
  }
  return fields;
}

void finish_model(const std::string& type, json& model) {
  if (nn::find_decoder_family(type) != nullptr && model.at("num_key_value_heads").is_null())
    model["num_key_value_heads"] = model.at("num_attention_heads");
  if (type == "hf" && model.at("dropout").is_null()) model.erase("dropout");
}

std::vector<Section> make_training_schema() {
  std::vector<Section> schema;

  // ------------------------------------------------------------------------------------- model
  // Read by nn::make_model (booster/nn/models.h), with the same key names.
  schema.push_back(Section{
      "model",
      "the network: {\"type\": \"mlp\" | \"linear\" | \"gpt\" | \"cnn\" | \"llama\" | \"mistral\" | \"qwen2\" | \"hf\" | a "
      "registered model, ...}, "
      "or a model library's: {\"type\": NAME, \"library\": LIB, its own keys...}",
      {optional_text("init_from", nullptr,
                     "start from these weights: a .safetensors file, or a directory with model.safetensors or a "
                     "sharded index (a checkpoint's model/); null: random initialisation")},
      "type",
      {
          {"mlp",
           {
               integer("in", 784, 1, std::nullopt, "input features per sample"),
               layer_list("hidden", json::array({1024, 1024})),
               integer("classes", 10, 1),
               text("activation", "relu", {"relu", "gelu", "gelu_tanh", "tanh"}),
           }},
          {"linear",
           {
               integer("in", 784, 1, std::nullopt, "input features per sample"),
               integer("classes", 10, 1),
           }},
          {"gpt", family_fields(*nn::find_model_family("gpt"))},  // Note [Model families]
          {"cnn",
           {
               integer("in_channels", 1, 1),
               integer("height", 28, 1),
               integer("width", 28, 1),
               layer_list("channels", json::array({32, 64})),
               integer("hidden", 128, 1),
               integer("classes", 10, 1),
               boolean("batch_norm", true),
               number("dropout", 0.0, 0.0, 1.0, false, true),
           }},
          // Note [Llama and Hugging Face model keys].
          {"llama", decoder_fields(*nn::find_decoder_family("llama"))},
          {"mistral", decoder_fields(*nn::find_decoder_family("mistral"))},
          {"qwen2", decoder_fields(*nn::find_decoder_family("qwen2"))},
          {"hf",
           {
               text("path", std::nullopt, {},
                    "a Hugging Face model directory: config.json and model.safetensors (or "
                    "model.safetensors.index.json and its shards)"),
               boolean("activation_checkpointing", false,
                       "recompute each layer's activations in backward: less memory, one more forward"),
               hf_dropout(),
           }},
      },
      /*optional=*/false,
      /*default_variant=*/"",
      /*custom_resolve=*/nullptr,
      /*resolve_other_variant=*/resolve_other_model,
      /*finish_variant=*/finish_model,
  });

  // ------------------------------------------------------------------------------------- optimizer
  // Read by optim::make_optimizer. Defaults are PyTorch's, except lr which PyTorch requires for SGD.
  schema.push_back(Section{
      "optimizer",
      "{\"type\": \"sgd\" | \"adam\" | \"adamw\", \"lr\": ...}",
      {number("lr", 1e-3, 0.0, std::nullopt, true)},
      "type",
      {
          {"sgd",
           {
               number("momentum", 0.0, 0.0),
               number("dampening", 0.0, 0.0),
               number("weight_decay", 0.0, 0.0),
               boolean("nesterov", false),
           }},
          {"adam",
           {
               numbers("betas", json::array({0.9, 0.999}), Kind::Number, 0.0, 1.0, 2, true),
               number("eps", 1e-8, 0.0, std::nullopt, true),
               number("weight_decay", 0.0, 0.0),
               boolean("amsgrad", false),
           }},
          {"adamw",
           {
               numbers("betas", json::array({0.9, 0.999}), Kind::Number, 0.0, 1.0, 2, true),
               number("eps", 1e-8, 0.0, std::nullopt, true),
               number("weight_decay", 0.01, 0.0),
               boolean("amsgrad", false),
           }},
      },
      /*optional=*/false,
      /*default_variant=*/"",
      /*custom_resolve=*/nullptr,
      /*resolve_other_variant=*/nullptr,
  });

  // ------------------------------------------------------------------------------------- criterion
  schema.push_back(Section{
      "criterion",
      "the loss: {\"type\": \"cross_entropy\" | \"mse\"}",
      {},
      "type",
      {
          {"cross_entropy",
           {
               number("label_smoothing", 0.0, 0.0, 1.0),
               integer("ignore_index", -100, std::nullopt),
           }},
          {"mse", {}},
      },
      /*optional=*/true,
      /*default_variant=*/"cross_entropy",
      /*custom_resolve=*/nullptr,
      /*resolve_other_variant=*/nullptr,
  });

  // ------------------------------------------------------------------------------------- data
  schema.push_back(Section{
      "data",
      "{\"type\": \"fashion_mnist\" | \"synthetic\" | \"text\" | \"tokens\" | \"sft\" | \"npy\" | \"safetensors\" | \"csv\", "
      "\"batch_size\": ...}",
      {
          integer("batch_size", 128, 1),
          integer("eval_batch_size", 1000, 1),
          boolean("shuffle", true),
          boolean("drop_last", false),
          // Note [Data a script makes].
          optional_text("made_by", nullptr, "the command that makes the data files, named when one is missing"),
      },
      "type",
      {
          {"fashion_mnist",
           {
               text("dir", "/usr/share/datasets/fashion-mnist"),
               boolean("normalize", true, "(x - mean) / std with the training set's statistics"),
           }},
          {"synthetic",
           {
               integer("num_samples", 2048, 1),
               integer("num_test_samples", 512, 0),
               integer("num_features", 20, 1),
               integer("num_classes", 4, 2),
           }},
          {"text",
           {
               text("path", std::nullopt, {}, "a text file read as bytes, one token per byte"),
               integer("context", 128, 1),
               number("test_fraction", 0.1, 0.0, 1.0, false, true),
               optional_text("tokenizer", nullptr,
                             "a SentencePiece .model or a Hugging Face tokenizer.json: the text's token ids "
                             "instead of its bytes; null: bytes"),
           }},
          // Note [Token files] in booster/data/tokens.h.
          {"tokens",
           {
               token_paths(),
               optional_text("val_path", nullptr, "the validation token file; null: no evaluation"),
               text("dtype", "uint16", {"uint16", "uint32"}, "the ids of a flat file; an llm.c shard says its own"),
               integer("seq_len", 128, 1, std::nullopt, "tokens per sample; sample i is tokens [i*seq_len, (i+1)*seq_len]"),
               val_fraction(),
           }},
          // Note [SFT records] and [SFT templates] in booster/data/sft.h.
          {"sft",
           {
               text("path", std::nullopt, {}, "a JSONL file of {prompt, response} or {messages} records"),
               text("tokenizer", std::nullopt, {}, "the model's own tokenizer: a SentencePiece .model or a tokenizer.json"),
               integer("seq_len", 128, 1, std::nullopt, "tokens per sample: a longer record is cut, a shorter padded"),
               any("template", json::object(),
                   "plain strings with {content}: {\"system\", \"user\", \"assistant\", \"bos\", \"eos\"}; "
                   "the loss is on the assistant's {content} and what follows it"),
               optional_text("val_path", nullptr, "a JSONL file of validation records; null: no evaluation"),
               sft_val_fraction(),
               boolean("packing", false, "several records per sequence, greedily in file order, each attending only "
                       "to itself (Llama-family models, pp_size 1)"),
           }},
          // Note [File data] in booster/data/file_dataset.h; the checks across keys are in
          // config::file_data_options (training.cpp).
          {"npy",
           with_file_data_fields({
               optional_text("x", nullptr, "the .npy file of the inputs (with y)"),
               optional_text("y", nullptr, "the .npy file of the labels (with x)"),
               optional_text("path", nullptr, "a .npz file holding both (instead of x and y)"),
               text("x_key", "x", {}, "the inputs' array in the .npz"),
               text("y_key", "y", {}, "the labels' array in the .npz"),
               optional_text("test_x", nullptr, "the test split's inputs (.npy, with test_y)"),
               optional_text("test_y", nullptr, "the test split's labels (.npy, with test_x)"),
               optional_text("test_path", nullptr, "the test split as a .npz"),
           })},
          {"safetensors",
           with_file_data_fields({
               text("path", std::nullopt, {}, "a .safetensors file holding the inputs and the labels"),
               text("x_key", "x", {}, "the inputs' tensor"),
               text("y_key", "y", {}, "the labels' tensor"),
               optional_text("test_path", nullptr, "the test split, a .safetensors file with the same names"),
           })},
          {"csv",
           with_file_data_fields({
               text("path", std::nullopt, {}, "a CSV file of numeric features and a label column"),
               optional_text("test_path", nullptr, "the test split, a CSV file with the same columns"),
               any("label_column", -1, "the label column's name (with a header) or index (-1: the last)"),
               any("header", "auto", "true, false, or \"auto\": a first row with a non-numeric cell is a header"),
               text("delimiter", ",", {}, "one character"),
           })},
      },
      /*optional=*/false,
      /*default_variant=*/"",
      /*custom_resolve=*/nullptr,
      /*resolve_other_variant=*/nullptr,
  });

  // ------------------------------------------------------------------------------------- lr_scheduler
  // Read by optim::make_scheduler, with PyTorch's names; stepped once per optimizer step. A null
  // T_max / total_steps means the run's total number of steps (filled in by the training driver).
  schema.push_back(Section{
      "lr_scheduler",
      "{\"type\": \"none\" | \"step\" | \"cosine\" | \"linear_warmup\"}",
      {},
      "type",
      {
          {"none", {}},
          {"step", {integer("step_size", std::nullopt, 1), number("gamma", 0.1, 0.0, std::nullopt, true)}},
          {"cosine", {optional_integer("T_max", 1, "null: the whole run"), number("eta_min", 0.0, 0.0)}},
          {"linear_warmup",
           {
               integer("warmup_steps", std::nullopt, 0),
               optional_integer("total_steps", 1, "null: the whole run"),
               text("decay", "cosine", {"cosine", "linear", "constant"}, "after the warmup"),
               number("min_lr_ratio", 0.0, 0.0, 1.0, false, false, "the floor as a fraction of the base lr"),
               number("start_factor", 0.0, 0.0, 1.0, false, false, "the warmup starts at lr * start_factor"),
           }},
      },
      /*optional=*/true,
      /*default_variant=*/"none",
      /*custom_resolve=*/nullptr,
      /*resolve_other_variant=*/nullptr,
  });

  // ------------------------------------------------------------------------------------- train
  schema.push_back(Section{
      "train",
      "the loop: epochs, max_steps, grad_accumulation, log_every, eval_every, seed, run_dir, checkpoints",
      {
          integer("epochs", 1, 1),
          optional_integer("max_steps", 0, "stop after this many steps; 0: evaluate without training; null: run all epochs"),
          integer("log_every", 50, 1),
          integer("eval_every", 0, 0, std::nullopt, "evaluate every N steps; 0: after each epoch"),
          integer("seed", 0, 0),
          // Note [Threads per process] in booster/common/threads.h.
          optional_integer("threads", 1,
                           "CPU threads of this process; null: OMP_NUM_THREADS, else the cores divided among the "
                           "processes of this machine"),
          optional_number("max_grad_norm", 0.0, "clip the gradients' joint L2 norm to this; null: no clipping"),
          integer("grad_accumulation", 1, 1, std::nullopt,
                  "micro-batches per optimizer step (their mean loss; no communication until the last)"),
          // Note [Reproducible training across world sizes] in booster/booster/reproducible.h.
          boolean("reproducible", false,
                  "the same bytes (weights, optimizer state, losses) at every world size that divides "
                  "reproducible_chunks, keeping the global batch; `booster check` names those sizes"),
          optional_integer("reproducible_chunks", 1,
                           "the chunks a step's global batch is cut into, a power of two; null: the largest "
                           "power of two dividing the global batch, at most 8"),
          // Note [The run directory] in config.h.
          optional_text("run_dir", kDefaultRunDir, "metrics.jsonl, config.json, checkpoints; {time}: the start time; null: no files"),
          optional_text("checkpoint_dir", nullptr, "null: <run_dir>/checkpoints"),
          integer("checkpoint_every", 0, 0, std::nullopt, "save every N steps and at the end; 0: never"),
          integer("keep_last", 3, 0, std::nullopt, "checkpoints to keep; 0: all"),
          optional_text("resume", nullptr, "\"latest\" (the newest in checkpoint_dir, if any), a checkpoint path, or null"),
          text("on_write_error", "stop", {"stop", "warn"},
               "a failed write of metrics.jsonl: stop (resume rewrites the lost records) or warn and go on"),
          // Note [Asynchronous checkpoints] in booster/trainer/async_save.h.
          boolean("async_checkpoint", false,
                  "save checkpoints in the background: the state is copied to host memory at the step and "
                  "written and committed on a thread while training goes on (the same files)"),
          text("on_save_error", "warn", {"warn", "stop"},
               "a failed background checkpoint (async_checkpoint): warn and go on, `latest` at the previous "
               "step, or stop; a failed synchronous save, or a failed last save of the run, always stops"),
          boolean("verify_checkpoints", true,
                  "check a checkpoint's files against its checksums before resuming or loading model.init_from "
                  "from one; false (--no-verify) loads a damaged one as it is"),
          // Note [What the doctor recommends] in booster/diagnostics/doctor.h; checked in check_training.
          any("diagnostics", json{{"every", 0}, {"name_nonfinite", true}},
              "{\"every\": N (per-module range statistics into metrics.jsonl every N steps; 0: never), "
              "\"name_nonfinite\": true (name the first inf/NaN tensor of a skipped step)}"),
          // Note [Collective timeouts] in core/booster/distributed/README.md.
          optional_number("collective_timeout_s", 0.0,
                          "seconds a collective waits for every rank before the job fails naming the missing ones; "
                          "null: BOOSTER_COLLECTIVE_TIMEOUT_S, else 1800"),
      },
      "",
      {},
      /*optional=*/true,
      /*default_variant=*/"",
      /*custom_resolve=*/nullptr,
      /*resolve_other_variant=*/nullptr,
  });

  // ------------------------------------------------------------------------------------- mixed_precision
  // Its options belong to the strategy (built-in or a plugin), so the strategy checks them where
  // resolve() builds it (Note [The mixed_precision section]); the table checks the name.
  Section mixed_precision;
  mixed_precision.name = "mixed_precision";
  mixed_precision.help = "a strategy name (\"bf16\") or {\"name\": ..., options...}; `booster precisions` lists them";
  mixed_precision.optional = true;
  mixed_precision.custom_resolve = [](const json& given) { return name_section(given, "mixed_precision"); };
  schema.push_back(std::move(mixed_precision));

  // ------------------------------------------------------------------------------------- plugin
  // Likewise the plugin's own options: Note [The plugin section] (both in booster_sections.cpp).
  Section plugin;
  plugin.name = "plugin";
  plugin.help = "a parallel plugin name (\"ddp\") or {\"name\": ..., options...}; `booster plugins` lists them";
  plugin.optional = true;
  plugin.custom_resolve = [](const json& given) { return name_section(given, "plugin"); };
  schema.push_back(std::move(plugin));

  // ------------------------------------------------------------------------------------- device
  // A string, not an object: "device": "cuda". Whether the GPU exists is checked where the Booster's
  // parts are built (require_device), so `booster check` on a machine without one says so too.
  Section device;
  device.name = "device";
  device.help = "where the model trains: \"cpu\", \"cuda\" or \"cuda:N\"";
  device.optional = true;
  device.custom_resolve = [](const json& given) -> json {
    if (given.is_object() && given.empty()) return "cpu";
    if (given.is_string()) {
      const std::string name = given.get<std::string>();
      bool valid = name == "cpu" || name == "cuda";
      if (!valid && name.rfind("cuda:", 0) == 0 && name.size() > 5)
        valid = std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (valid) return name;
    }
    throw ConfigError("'device' is " + given.dump() + "; expected \"cpu\", \"cuda\" or \"cuda:N\"");
  };
  schema.push_back(std::move(device));

  // ------------------------------------------------------------------------------------- lora
  // Note [The lora section] in lora_section.cpp: null (no adapters) when left out.
  schema.push_back(lora_section());

  return schema;
}

// Note [Checking file data]
// File data is read while the config is resolved (so `booster check` reports a missing file, a bad
// header or a label out of range before anything trains), and read again by make_datasets: twice the
// reading time, never twice the memory. A classifier's input width and classes are checked against
// what the files hold; a registered or library model's are its own business.
void check_file_data(const json& c, bool classifier) {
  const json& model = c.at("model");
  const json& data = c.at("data");
  if (data.at("targets") == "values" && c.at("criterion").at("type") != "mse")
    throw ConfigError("'data.targets' is \"values\" (float targets) but 'criterion.type' is " +
                      show(c.at("criterion").at("type")) + "; regression needs \"mse\", classes need 'data.targets' \"classes\"");
  data::FileDataOptions options = file_data_options(data, c.at("train").at("seed").get<uint64_t>());
  if (classifier && options.integer_labels) options.num_classes = model.at("classes").get<int64_t>();
  const data::FileData files = data::load_file_data(options);
  if (!classifier) return;
  const Tensor& x = files.train->x();
  const Shape sample(x.shape().begin() + 1, x.shape().end());
  const int64_t features = numel_of(sample);
  BOOSTER_CHECK(model.at("in").get<int64_t>() == features, DataError, "'model.in' is ", model.at("in").dump(),
                " but the samples of ", options.train.x_path, " have shape ", sample, ", ", features,
                " features each; set 'model.in' to ", features);
}

// Note [Checking token data]
// Text and token data are checked against the model while the config is resolved, so `booster check`
// reports them: a text file must open (train's own DataError: it is read by make_datasets), a tokenizer
// is loaded (a missing or corrupt .model is a DataError naming it) and its vocabulary must fit the
// model's; token files are mapped, their layout checked and, when small, every
// id checked against the model's vocabulary (Note [Checking token ids] in booster/data/tokens.h). Only
// a family's declared context key is checked here (the GPT's "context"); other models check their own.
void check_token_data(const json& c, const nn::ModelFamily* family) {
  const json& model = c.at("model");
  const json& data = c.at("data");
  const std::string data_type = data.at("type").get<std::string>();
  const int64_t vocab = model_vocab_size(model);
  const char* length_key = data_type == "text" ? "context" : "seq_len";
  if (family != nullptr && !family->context_key.empty() &&
      data.at(length_key).get<int64_t>() > model.at(family->context_key).get<int64_t>())
    throw ConfigError("'data." + std::string(length_key) + "' is " + data.at(length_key).dump() + " but 'model." +
                      family->context_key + "' is " + model.at(family->context_key).dump() +
                      "; the model cannot see more tokens than its context");
  if (data_type == "text") {
    // An hf model's vocabulary is its config.json's, which a user does not edit: the fix is the data's.
    const std::string model_type = model.at("type").get<std::string>();
    const bool hf = model_type == "hf";
    const std::string vocab_is = hf ? "the Hugging Face model " + model.at("path").get<std::string>() + " has " +
                                          std::to_string(vocab) + " ids"
                                    : "'model.vocab_size' is " + std::to_string(vocab);
    if (data.at("tokenizer").is_string()) {
      const std::unique_ptr<data::Tokenizer> opened = data::open_tokenizer(data.at("tokenizer").get<std::string>());
      const data::Tokenizer& tokenizer = *opened;
      if (vocab > 0 && vocab < tokenizer.vocab_size())
        throw ConfigError(vocab_is + " but the tokenizer " + tokenizer.path() + " has " +
                          std::to_string(tokenizer.vocab_size()) + " ids; " +
                          (hf ? std::string("give 'data.tokenizer' the model's own tokenizer")
                              : "set 'model.vocab_size' to at least " + std::to_string(tokenizer.vocab_size())));
    } else if ((family != nullptr || hf) && vocab > 0 && vocab < 256) {
      // Byte text has ids up to 255: a smaller embedding would fail at the first batch.
      throw ConfigError(vocab_is + "; text data without 'data.tokenizer' has one token per byte (256 ids), so " +
                        (hf ? std::string("give 'data.tokenizer' the model's own tokenizer")
                            : "it must be >= 256 (or give 'data.tokenizer')"));
    }
    // The file itself, with the message make_datasets gives (it is read there, not here).
    const std::string path = data.at("path").get<std::string>();
    data::check_data_file(path, "text data: ", "set data.path to a readable text file");
    BOOSTER_CHECK(std::ifstream(path, std::ios::binary).good(), DataError, "text data: cannot open '", path,
                  "'; set data.path to a readable text file");
    return;
  }
  // The files, their descriptions, the val_fraction split: as make_datasets makes them (it only maps).
  make_datasets(data, 0, vocab);
}

}  // namespace

// Note [Data a script makes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An example's data may come from a script (examples/llama_fortunes.sh tokenizes a corpus into the token
// files its config names). Before the script has run, the files are missing, and "cannot open
// runs/llama_fortunes/data/train.bin" does not say where they would come from. data.made_by names the
// command; a data file the config names that does not exist is then refused saying to run it.
// Globs are left to the data's own checks (a glob that matches nothing names itself).
static std::string missing_data_file(const json& data) {
  for (const char* key : {"path", "val_path", "test_path", "x", "y", "test_x", "test_y", "tokenizer"}) {
    const json value = data.value(key, json());
    for (const json& file : value.is_array() ? value : json::array({value})) {
      if (!file.is_string()) continue;
      const std::string name = file.get<std::string>();
      if (name.find_first_of("*?[") == std::string::npos && !std::filesystem::exists(name))
        return "'data." + std::string(key) + "' " + name;
    }
  }
  return "";
}

void check_training_config(const json& c) {
  const json& model = c.at("model");
  const json& data = c.at("data");
  const std::string model_type = model.at("type").get<std::string>();
  const std::string data_type = data.at("type").get<std::string>();
  const std::string criterion = c.at("criterion").at("type").get<std::string>();
  auto fail = [](const std::string& msg) { throw ConfigError(msg); };
  auto num = [](const json& v) { return v.dump(); };

  // A registered or library model's keys are its own: only the built-ins are checked against the data.
  const std::vector<std::string> builtins = nn::builtin_models();
  const bool builtin_model = std::find(builtins.begin(), builtins.end(), model_type) != builtins.end();
  const bool classifier = model_type == "mlp" || model_type == "linear";
  const bool image_classifier = model_type == "cnn";
  const nn::ModelFamily* family = nn::find_model_family(model_type);  // gpt, llama, mistral, qwen2
  // A Llama or Hugging Face model is built (deferred) and split as the run would: its sizes, its files,
  // its positions against the data's sequences, its shard policy (Note [Checking a model before it trains]).
  check_model(c);
  // The starting weights must be there (they are loaded after the model is built, so a missing file
  // would otherwise pass check and stop train).
  if (const json& init_from = model.value("init_from", json()); init_from.is_string()) {
    const std::string file = init_from.get<std::string>();
    if (!std::filesystem::exists(file))
      fail("'model.init_from' is " + file + ", which does not exist; give a .safetensors file, a checkpoint step or "
           "its model directory");
    check_init_from(c);  // weights of this model (Note [Weights of another model] in model_check.cpp)
  }
  if (const json& made_by = data.value("made_by", json()); made_by.is_string())  // Note [Data a script makes]
    if (const std::string missing = missing_data_file(data); !missing.empty())
      fail(missing + " does not exist; it is made by " + made_by.get<std::string>() +
           " (data.made_by): run that first, or point the data at files of your own");
  if (data_type == "text" || data_type == "tokens" || data_type == "sft") {
    const bool language_model = family != nullptr || model_type == "hf";
    if (builtin_model && !language_model) fail("'data.type' \"" + data_type + "\" needs a language model: set 'model.type' to \"gpt\" (it is \"" + model_type + "\")");
    if (criterion != "cross_entropy") fail("'criterion.type' must be \"cross_entropy\" for " + data_type + " data (it is \"" + criterion + "\")");
    if (data_type == "sft" && c.at("criterion").at("ignore_index") != -100)
      fail("'criterion.ignore_index' is " + num(c.at("criterion").at("ignore_index")) +
           " but sft data marks the targets outside the responses -100; leave 'criterion.ignore_index' at -100");
    if (data_type == "sft" && data.value("packing", false)) {
      // Note [Packing SFT records] and [Packed sequences] in booster/nn/packing.h: the model keeps them apart.
      if (builtin_model && model_type != "gpt" && !nn::find_decoder_family(model_type))
        fail("'data.packing' is true but 'model.type' \"" + model_type + "\" cannot keep packed records apart (gpt "
             "and the Llama family can: llama, mistral, qwen2); set 'data.packing' to false");
    }
    check_token_data(c, family);
  } else {
    if (family != nullptr)  // every decoder family reads token ids
      fail("'model.type' \"" + model_type + "\" needs token data: set 'data.type' to \"text\" or \"tokens\", or use \"mlp\" for \"" + data_type + "\"");
    if (is_file_data(data_type)) {
      check_file_data(c, classifier);
    } else if (image_classifier) {
      const int64_t features = data_type == "fashion_mnist" ? 784 : data.at("num_features").get<int64_t>();
      const int64_t classes = data_type == "fashion_mnist" ? 10 : data.at("num_classes").get<int64_t>();
      const int64_t pixels =
          model.at("in_channels").get<int64_t>() * model.at("height").get<int64_t>() * model.at("width").get<int64_t>();
      if (pixels != features)
        fail("'model.in_channels' x 'model.height' x 'model.width' is " + std::to_string(pixels) + " but the " +
             data_type + " data has " + std::to_string(features) + " features per sample");
      if (model.at("classes").get<int64_t>() != classes)
        fail("'model.classes' is " + num(model.at("classes")) + " but the " + data_type + " data has " + std::to_string(classes) + " classes");
    } else if (classifier) {
      const int64_t features = data_type == "fashion_mnist" ? 784 : data.at("num_features").get<int64_t>();
      const int64_t classes = data_type == "fashion_mnist" ? 10 : data.at("num_classes").get<int64_t>();
      if (model.at("in").get<int64_t>() != features)
        fail("'model.in' is " + num(model.at("in")) + " but the " + data_type + " data has " + std::to_string(features) + " features per sample");
      if (model.at("classes").get<int64_t>() != classes)
        fail("'model.classes' is " + num(model.at("classes")) + " but the " + data_type + " data has " + std::to_string(classes) + " classes");
    }
  }
  for (const auto& [a, b] : family != nullptr ? family->divisible : std::vector<std::pair<std::string, std::string>>{})
    if (model.at(a).get<int64_t>() % model.at(b).get<int64_t>() != 0)
      fail("'model." + a + "' " + num(model.at(a)) + " is not divisible by 'model." + b + "' " + num(model.at(b)));
  // Note [The run directory] in config.h.
  const json& train = c.at("train");
  const bool has_run_dir = train.at("run_dir").is_string();
  const bool has_checkpoint_dir = train.at("checkpoint_dir").is_string();
  if (train.at("checkpoint_every").get<int64_t>() > 0 && !has_run_dir && !has_checkpoint_dir)
    fail("'train.checkpoint_every' is " + num(train.at("checkpoint_every")) +
         " but 'train.run_dir' and 'train.checkpoint_dir' are both null; set one of them to say where checkpoints go");
  if (train.at("resume") == "latest" && !has_checkpoint_dir &&
      (!has_run_dir || train.at("run_dir").get<std::string>().find("{time}") != std::string::npos))
    fail("'train.resume' is \"latest\" but 'train.run_dir' is " + num(train.at("run_dir")) +
         ", a new directory every run; set 'train.checkpoint_dir' (or a run_dir without {time}) so a rerun finds "
         "its checkpoints");
  if (train.at("run_dir").is_string() && train.at("run_dir").get<std::string>().empty())
    fail("'train.run_dir' is \"\"; expected a directory, or null for no files");
  if (has_checkpoint_dir && train.at("checkpoint_dir").get<std::string>().empty())
    fail("'train.checkpoint_dir' is \"\"; expected a directory, or null for <run_dir>/checkpoints");

  const json& diagnostics = train.at("diagnostics");
  if (!diagnostics.is_object())
    fail("'train.diagnostics' is " + diagnostics.dump() + "; expected {\"every\": N, \"name_nonfinite\": true|false}");
  for (const auto& [key, value] : diagnostics.items()) {
    if (key == "every") {
      if (!value.is_number_integer() || value.get<int64_t>() < 0)
        fail("'train.diagnostics.every' is " + value.dump() +
             "; expected a whole number of steps >= 0 (0: no per-module statistics)");
    } else if (key == "name_nonfinite") {
      if (!value.is_boolean()) fail("'train.diagnostics.name_nonfinite' is " + value.dump() + "; expected true or false");
    } else {
      fail("'train.diagnostics." + key + "' is not a diagnostics setting; expected \"every\" or \"name_nonfinite\"");
    }
  }

  const json& sched = c.at("lr_scheduler");
  // max_steps 0 evaluates without training (cli/train.cpp): there is no schedule to fit.
  if (sched.at("type") == "linear_warmup" && c.at("train").at("max_steps").is_number() &&
      c.at("train").at("max_steps").get<int64_t>() > 0 && sched.at("warmup_steps").get<int64_t>() > c.at("train").at("max_steps").get<int64_t>())
    fail("'lr_scheduler.warmup_steps' is " + num(sched.at("warmup_steps")) + ", more than 'train.max_steps' " +
         num(c.at("train").at("max_steps")));
}

const std::vector<Section>& training_schema() {
  static const std::vector<Section> schema = make_training_schema();
  return schema;
}

}  // namespace booster::config
