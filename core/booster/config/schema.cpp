// The schema of a training config: every section, key, type, range and default, in one table.
//
// The factories (make_model, make_optimizer, make_scheduler, make_criterion, make_datasets) read
// configs that went through resolve() with this table, so a key added here is a key they may read,
// and a key they read must be declared here.
#include "booster/config/config.h"

namespace booster::config {
namespace {

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

// An integer that may be null (the default): "not set", e.g. no step limit.
Field optional_integer(std::string key, double min, std::string help = "") {
  Field f = integer(std::move(key), std::nullopt, min, std::nullopt, std::move(help));
  f.nullable = true;
  f.default_value = nullptr;
  return f;
}

std::vector<Section> make_training_schema() {
  std::vector<Section> schema;

  // ------------------------------------------------------------------------------------- model
  // Read by nn::make_model (booster/nn). Sizes of the MLP are the input, each hidden layer, the output.
  schema.push_back(Section{
      "model",
      "the network: {\"type\": \"mlp\" | \"gpt\", ...}",
      {},
      "type",
      {
          {"mlp",
           {
               integer("in_features", 784, 1),
               numbers("hidden_sizes", json::array({1024, 1024}), Kind::Int, 1, std::nullopt, std::nullopt),
               integer("out_features", 10, 1),
               text("activation", "relu", {"relu", "gelu", "tanh", "sigmoid"}),
               number("dropout", 0.0, 0.0, 1.0, false, true),
           }},
          {"gpt",
           {
               integer("vocab_size", 256, 1),
               integer("context_length", 128, 1),
               integer("n_embd", 256, 1),
               integer("n_layer", 4, 1),
               integer("n_head", 4, 1),
               number("dropout", 0.0, 0.0, 1.0, false, true),
               boolean("tie_weights", true, "share the token embedding with the output projection"),
           }},
      },
      /*optional=*/false,
      /*default_variant=*/"",
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
  });

  // ------------------------------------------------------------------------------------- data
  schema.push_back(Section{
      "data",
      "{\"type\": \"fashion_mnist\" | \"synthetic\" | \"text\", \"batch_size\": ...}",
      {
          integer("batch_size", 128, 1),
          integer("eval_batch_size", 1000, 1),
          boolean("shuffle", true),
          boolean("drop_last", false),
      },
      "type",
      {
          {"fashion_mnist", {text("dir", "/usr/share/datasets/fashion-mnist")}},
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
           }},
      },
      /*optional=*/false,
      /*default_variant=*/"",
  });

  // ------------------------------------------------------------------------------------- lr_scheduler
  // Stepped once per optimizer step. cosine's t_max = null means the whole run.
  schema.push_back(Section{
      "lr_scheduler",
      "{\"type\": \"none\" | \"step\" | \"cosine\" | \"linear_warmup\"}",
      {},
      "type",
      {
          {"none", {}},
          {"step", {integer("step_size", std::nullopt, 1), number("gamma", 0.1, 0.0, std::nullopt, true)}},
          {"cosine", {optional_integer("t_max", 1, "null: the whole run"), number("eta_min", 0.0, 0.0)}},
          {"linear_warmup",
           {integer("warmup_steps", std::nullopt, 0), number("start_factor", 0.0, 0.0, 1.0)}},
      },
      /*optional=*/true,
      /*default_variant=*/"none",
  });

  // ------------------------------------------------------------------------------------- train
  schema.push_back(Section{
      "train",
      "the loop: epochs, max_steps, log_every, eval_every, seed",
      {
          integer("epochs", 1, 1),
          optional_integer("max_steps", 1, "stop after this many steps; null: run all epochs"),
          integer("log_every", 50, 1),
          integer("eval_every", 0, 0, std::nullopt, "evaluate every N steps; 0: after each epoch"),
          integer("seed", 0, 0),
      },
      "",
      {},
      /*optional=*/true,
      /*default_variant=*/"",
  });

  return schema;
}

}  // namespace

const std::vector<Section>& training_schema() {
  static const std::vector<Section> schema = make_training_schema();
  return schema;
}

}  // namespace booster::config
