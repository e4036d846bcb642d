// Loss, data splits and evaluation built from a resolved config (training.h).
#include "booster/config/training.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "booster/autograd/autograd.h"
#include "booster/common/error.h"
#include "booster/common/json_text.h"
#include "booster/data/fashion_mnist.h"
#include "booster/data/sft.h"
#include "booster/data/synthetic.h"
#include "booster/data/tokenizer.h"
#include "booster/data/tokens.h"
#include "booster/ops/ops.h"

namespace booster::config {

using nlohmann::json;

namespace {

// [N] int64 labels -> [N, classes] one-hot in `dtype`.
Tensor one_hot(const Tensor& labels, int64_t classes, DType dtype) {
  Tensor flat = labels.to(DType::Int64).contiguous();
  const int64_t n = flat.numel();
  std::vector<float> values(size_t(n * classes), 0.0f);
  const int64_t* y = flat.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    BOOSTER_CHECK(y[i] >= 0 && y[i] < classes, IndexError, "mse: target class ", y[i], " is outside [0, ", classes,
                  ")");
    values[size_t(i * classes + y[i])] = 1.0f;
  }
  Shape shape = labels.shape();
  shape.push_back(classes);
  return from_vector(values, shape).to(dtype);
}

// The first `n` rows of a dataset's tensors, and the rest.
std::pair<std::shared_ptr<data::TensorDataset>, std::shared_ptr<data::TensorDataset>> split_rows(
    const data::TensorDataset& all, int64_t n) {
  const int64_t total = all.size();
  auto head = std::make_shared<data::TensorDataset>(all.x().narrow(0, 0, n).contiguous(),
                                                    all.y().narrow(0, 0, n).contiguous());
  auto tail = std::make_shared<data::TensorDataset>(all.x().narrow(0, n, total - n).contiguous(),
                                                    all.y().narrow(0, n, total - n).contiguous());
  return {head, tail};
}

std::string read_file_bytes(const std::string& path) {
  data::check_data_file(path, "text data: ", "set data.path to a readable text file");
  std::ifstream in(path, std::ios::binary);
  BOOSTER_CHECK(in.good(), DataError, "text data: cannot open '", path, "'; set data.path to a readable text file");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

Criterion make_criterion(const json& criterion) {
  const std::string type = criterion.at("type").get<std::string>();
  if (type == "cross_entropy") {
    const double label_smoothing = criterion.at("label_smoothing").get<double>();
    const int64_t ignore_index = criterion.at("ignore_index").get<int64_t>();
    return [=](const Tensor& output, const Tensor& target) {
      // A language model's [B, T, C] logits are B*T classifications.
      if (output.dim() > 2 && target.dim() == output.dim() - 1) {
        const int64_t classes = output.size(-1);
        return cross_entropy(output.reshape({-1, classes}), target.reshape({-1}), Reduction::Mean, ignore_index,
                             label_smoothing);
      }
      return cross_entropy(output, target, Reduction::Mean, ignore_index, label_smoothing);
    };
  }
  if (type == "mse") {
    return [](const Tensor& output, const Tensor& target) {
      if (is_floating(target.dtype())) return mse_loss(output, target);
      return mse_loss(output, one_hot(target, output.size(-1), output.dtype()));
    };
  }
  BOOSTER_FAIL(ConfigError, "'criterion.type' is \"", type, "\"; expected one of 'cross_entropy', 'mse'");
}

DataSplits make_datasets(const json& cfg, uint64_t seed, int64_t vocab_size) {
  const std::string type = cfg.at("type").get<std::string>();
  DataSplits split;
  if (type == "fashion_mnist") {
    const std::string dir = cfg.at("dir").get<std::string>();
    const bool normalize = cfg.at("normalize").get<bool>();
    split.train = data::load_fashion_mnist(dir, /*train=*/true, normalize);
    split.test = data::load_fashion_mnist(dir, /*train=*/false, normalize);
    split.description = str("Fashion-MNIST from ", dir, ": ", split.train->size(), " train, ", split.test->size(),
                            " test images");
    return split;
  }
  if (type == "synthetic") {
    const int64_t n_train = cfg.at("num_samples").get<int64_t>();
    const int64_t n_test = cfg.at("num_test_samples").get<int64_t>();
    const int64_t features = cfg.at("num_features").get<int64_t>();
    const int64_t classes = cfg.at("num_classes").get<int64_t>();
    // One draw, then split, so both splits come from the same blobs.
    auto all = data::synthetic_classification(n_train + n_test, features, classes, seed);
    auto [train, test] = split_rows(*all, n_train);
    split.train = train;
    if (n_test > 0) split.test = test;
    split.description = str("synthetic blobs: ", n_train, " train, ", n_test, " test points, ", features,
                            " features, ", classes, " classes");
    return split;
  }
  if (type == "text" && cfg.value("tokenizer", json()).is_string()) {
    const std::string path = cfg.at("path").get<std::string>();
    const int64_t context = cfg.at("context").get<int64_t>();
    const double test_fraction = cfg.at("test_fraction").get<double>();
    const std::unique_ptr<data::Tokenizer> opened = data::open_tokenizer(cfg.at("tokenizer").get<std::string>());
    const data::Tokenizer& tokenizer = *opened;
    std::vector<uint32_t> ids = tokenizer.encode_lines(read_file_bytes(path));
    const int64_t n_test = int64_t(double(ids.size()) * test_fraction);
    const int64_t n_train = int64_t(ids.size()) - n_test;
    BOOSTER_CHECK(n_train > context, DataError, "text data: '", path, "' tokenized by ", tokenizer.path(), " has ",
                  n_train, " training tokens, fewer than data.context + 1 = ", context + 1,
                  "; use a longer file or a shorter context");
    // Every window, as with bytes (Note [Token samples]); the test split counts each token once.
    const data::TokenDatasetOptions windows{.seq_len = context, .stride = 1, .vocab_size = vocab_size};
    const std::string name = path + " (tokenized by " + tokenizer.path() + ")";
    std::vector<uint32_t> test_ids(ids.begin() + n_train, ids.end());
    ids.resize(size_t(n_train));
    split.train = std::make_shared<data::TokenDataset>(data::TokenSource::from_ids(std::move(ids), name), windows);
    if (n_test > context) {
      split.test = std::make_shared<data::TokenDataset>(
          data::TokenSource::from_ids(std::move(test_ids), name + ", test split"), windows);
      split.eval_stride = context;
    }
    split.tokens_per_sample = context;
    split.language_model = true;
    split.description = str("text ", path, " tokenized by ", tokenizer.path(), " (vocabulary ", tokenizer.vocab_size(),
                            "): ", n_train, " train tokens, ", n_test, " test tokens, context ", context);
    return split;
  }
  if (type == "sft") {
    // Note [SFT records], [SFT templates] and [SFT samples] in booster/data/sft.h.
    const json val_fraction = cfg.at("val_fraction");
    BOOSTER_CHECK(val_fraction.is_null() || !cfg.at("val_path").is_string(), ConfigError, "'data.val_fraction' is ",
                  val_fraction.dump(), " and 'data.val_path' is ", cfg.at("val_path").dump(),
                  ": the validation data would be both; give one of them");
    const data::ChatTemplate tmpl = data::chat_template_from_json(cfg.at("template"));
    const int64_t seq_len = cfg.at("seq_len").get<int64_t>();
    std::shared_ptr<const data::Tokenizer> opened = data::open_tokenizer(cfg.at("tokenizer").get<std::string>());
    BOOSTER_CHECK(vocab_size <= 0 || opened->vocab_size() <= vocab_size, ConfigError, "the tokenizer ", opened->path(),
                  " ('data.tokenizer') has ", opened->vocab_size(), " ids but the model's vocabulary has ", vocab_size,
                  "; give 'data.tokenizer' the model's own tokenizer");
    const data::SftTokenizer tokenizer = data::sft_tokenizer(opened);
    const data::SftOptions samples{.seq_len = seq_len, .packing = cfg.at("packing").get<bool>()};
    const std::string path = cfg.at("path").get<std::string>();
    std::vector<data::Conversation> records = data::read_sft_file(path);
    std::vector<data::Conversation> val_records;
    std::string val_name;
    if (val_fraction.is_number()) {
      const int64_t n_val = int64_t(double(records.size()) * val_fraction.get<double>());
      BOOSTER_CHECK(n_val >= 1 && n_val < int64_t(records.size()), ConfigError, "'data.val_fraction' ",
                    val_fraction.get<double>(), " of the ", records.size(), " records of ", path, " is ", n_val,
                    " records; it must leave at least one for validation and one for training: change "
                    "'data.val_fraction' or give 'data.val_path'");
      val_records.assign(records.end() - n_val, records.end());
      records.resize(records.size() - size_t(n_val));
      val_name = str(path, ", its last ", n_val, " records (data.val_fraction ", val_fraction.get<double>(), ")");
    } else if (cfg.at("val_path").is_string()) {
      val_name = cfg.at("val_path").get<std::string>();
      val_records = data::read_sft_file(val_name);
    }
    auto train = std::make_shared<data::SftDataset>(records, tmpl, tokenizer, samples, path);
    split.train = train;
    split.description = str("sft ", train->describe(), ", tokenized by ", opened->path());
    if (!val_records.empty()) {
      auto val = std::make_shared<data::SftDataset>(val_records, tmpl, tokenizer, samples, val_name);
      split.test = val;
      split.description += str("; val ", val->describe());
    }
    split.tokens_per_sample = seq_len;
    split.language_model = true;
    split.token_mean_ignore_index = data::kIgnoreIndex;
    return split;
  }
  if (type == "tokens") {
    const int64_t seq_len = cfg.at("seq_len").get<int64_t>();
    const data::TokenDType dtype = data::token_dtype_from_string(cfg.at("dtype").get<std::string>());
    const data::TokenDatasetOptions samples{.seq_len = seq_len, .vocab_size = vocab_size};
    const json val_fraction = cfg.value("val_fraction", json());
    BOOSTER_CHECK(val_fraction.is_null() || !cfg.at("val_path").is_string(), ConfigError, "'data.val_fraction' is ",
                  val_fraction.dump(), " and 'data.val_path' is ", cfg.at("val_path").dump(),
                  ": the validation data would be both; give one of them");
    auto source = data::TokenSource::map_files(data::token_file_paths(token_data_paths(cfg)), dtype);
    auto describe = [&](const data::TokenDataset& d) {
      return str(d.source().name(), ": ", d.source().size(), " ", to_string(d.source().dtype()), " tokens",
                 d.source().llmc() ? " (llm.c shard)" : "", ", ", d.size(), " samples");
    };
    std::shared_ptr<const data::TokenSource> train_source = source;
    std::shared_ptr<data::TokenDataset> val;
    if (val_fraction.is_number()) {
      // Note [Token shards]: the end of the last file, as nanoGPT splits one file (and tokenize's
      // --val-fraction: the last floor(n * F) tokens).
      const double f = val_fraction.get<double>();
      const std::string last = source->files().back();
      const int64_t n = source->size(), n_last = source->last_file_tokens();
      const int64_t n_val = int64_t(double(n_last) * f);
      BOOSTER_CHECK(n_val >= seq_len + 1, ConfigError, "'data.val_fraction' ", f, " of the ", n_last, " tokens of ",
                    last, " is ", n_val, " tokens, fewer than one validation sample of 'data.seq_len' ", seq_len,
                    " plus its target (", seq_len + 1, "); raise 'data.val_fraction' or give 'data.val_path'");
      train_source = source->slice(0, n - n_val, str(source->name(), " (all but the last ", n_val, " tokens)"));
      val = std::make_shared<data::TokenDataset>(
          source->slice(n - n_val, n_val, str(last, ", its last ", n_val, " tokens (data.val_fraction ", f, ")")),
          samples);
    }
    auto train = std::make_shared<data::TokenDataset>(train_source, samples);
    split.description = str("tokens ", describe(*train), ", seq_len ", seq_len);
    split.train = train;
    if (cfg.at("val_path").is_string())
      val = data::token_files_dataset(data::token_file_paths({cfg.at("val_path").get<std::string>()}), dtype, samples);
    if (val) {
      split.description += str("; val ", describe(*val));
      split.test = val;
    }
    split.tokens_per_sample = seq_len;
    split.language_model = true;
    return split;
  }
  if (type == "text") {
    const std::string path = cfg.at("path").get<std::string>();
    const int64_t context = cfg.at("context").get<int64_t>();
    const double test_fraction = cfg.at("test_fraction").get<double>();
    std::string text = read_file_bytes(path);
    const int64_t n_test_bytes = int64_t(double(text.size()) * test_fraction);
    const int64_t n_train_bytes = int64_t(text.size()) - n_test_bytes;
    BOOSTER_CHECK(n_train_bytes > context, DataError, "text data: '", path, "' has ", n_train_bytes,
                  " training bytes, fewer than data.context + 1 = ", context + 1, "; use a longer file or a shorter context");
    split.train = std::make_shared<data::CharDataset>(text.substr(0, size_t(n_train_bytes)), context);
    if (n_test_bytes > context) {
      split.test = std::make_shared<data::CharDataset>(text.substr(size_t(n_train_bytes)), context);
      split.eval_stride = context;
    }
    split.tokens_per_sample = context;
    split.language_model = true;
    split.description = str("text ", path, ": ", n_train_bytes, " train bytes, ", n_test_bytes, " test bytes, context ",
                            context);
    return split;
  }
  if (is_file_data(type)) {
    data::FileData files = data::load_file_data(file_data_options(cfg, seed));
    split.train = files.train;
    split.test = files.test;
    split.description = files.description;
    return split;
  }
  BOOSTER_FAIL(ConfigError, "'data.type' is \"", type,
               "\"; expected one of 'fashion_mnist', 'synthetic', 'text', 'tokens', 'sft', 'npy', 'safetensors', 'csv'");
}

std::vector<std::string> token_data_paths(const json& data) {
  const json& path = data.at("path");
  auto fail = [&] {
    BOOSTER_FAIL(ConfigError, "'data.path' is ", path.dump(),
                 "; expected a token file, a glob (\"shards/*.bin\") or a non-empty list of them");
  };
  if (path.is_string()) {
    if (path.get<std::string>().empty()) fail();
    return {path.get<std::string>()};
  }
  if (!path.is_array() || path.empty()) fail();
  std::vector<std::string> out;
  for (const json& p : path) {
    if (!p.is_string() || p.get<std::string>().empty()) fail();
    out.push_back(p.get<std::string>());
  }
  return out;
}

int64_t model_vocab_size(const json& model) {
  if (model.contains("vocab_size") && model.at("vocab_size").is_number_integer())
    return model.at("vocab_size").get<int64_t>();
  if (model.value("type", json()) == "hf" && model.value("path", json()).is_string()) {
    // A Hugging Face model directory: its config.json names the vocabulary. Unreadable here is not an
    // error: the model's own loader reports it.
    // Note [One JSON reader] (json_text.h).
    const json config = try_read_json_file(model.at("path").get<std::string>() + "/config.json", JsonLimits{});
    if (config.is_object() && config.value("vocab_size", json()).is_number_integer())
      return config.at("vocab_size").get<int64_t>();
  }
  return 0;
}

bool is_file_data(const std::string& type) { return type == "npy" || type == "safetensors" || type == "csv"; }

data::FileDataOptions file_data_options(const json& cfg, uint64_t seed) {
  const std::string type = cfg.at("type").get<std::string>();
  BOOSTER_CHECK(is_file_data(type), ConfigError, "'data.type' is \"", type, "\", which is not file data");
  auto text = [&](const char* key) { return cfg.at(key).is_string() ? cfg.at(key).get<std::string>() : std::string(); };
  data::FileDataOptions o;
  o.seed = seed;
  o.test_fraction = cfg.at("test_fraction").get<double>();
  const std::string normalize = cfg.at("normalize").get<std::string>();
  o.normalize = normalize == "standardize" ? data::Normalize::Standardize
                : normalize == "scale"     ? data::Normalize::Scale
                                           : data::Normalize::None;
  o.divide_by = cfg.at("divide_by").get<double>();
  o.x_dtype = dtype_from_string(cfg.at("x_dtype").get<std::string>());
  o.integer_labels = cfg.at("targets") == "classes";
  o.allow_nonfinite = cfg.at("allow_nonfinite").get<bool>();
  BOOSTER_CHECK(o.normalize == data::Normalize::None || is_floating(o.x_dtype), ConfigError, "'data.normalize' is \"",
                normalize, "\" but 'data.x_dtype' is \"", cfg.at("x_dtype").get<std::string>(),
                "\"; normalizing needs float32 or float64 inputs");

  data::ArrayFiles train, test;
  bool has_test = false;
  if (type == "npy") {
    const std::string x = text("x"), y = text("y"), path = text("path");
    BOOSTER_CHECK(!path.empty() || (!x.empty() && !y.empty()), ConfigError,
                  "'data.x' and 'data.y' (two .npy files) or 'data.path' (one .npz) must be set; got ",
                  x.empty() ? "no x" : "x", y.empty() ? ", no y" : ", y", ", no path");
    BOOSTER_CHECK(path.empty() || (x.empty() && y.empty()), ConfigError,
                  "'data.path' (a .npz) and 'data.x'/'data.y' (.npy files) are both set; give one of them");
    train.format = path.empty() ? data::FileFormat::Npy : data::FileFormat::Npz;
    train.x_path = path.empty() ? x : path;
    train.y_path = y;
    const std::string test_x = text("test_x"), test_y = text("test_y"), test_path = text("test_path");
    BOOSTER_CHECK(test_x.empty() == test_y.empty(), ConfigError,
                  "'data.test_x' and 'data.test_y' go together: set both (two .npy files) or neither");
    BOOSTER_CHECK(test_path.empty() || test_x.empty(), ConfigError,
                  "'data.test_path' (a .npz) and 'data.test_x'/'data.test_y' (.npy files) are both set; give one");
    has_test = !test_path.empty() || !test_x.empty();
    test.format = test_path.empty() ? data::FileFormat::Npy : data::FileFormat::Npz;
    test.x_path = test_path.empty() ? test_x : test_path;
    test.y_path = test_y;
  } else {
    train.format = type == "csv" ? data::FileFormat::Csv : data::FileFormat::Safetensors;
    train.x_path = cfg.at("path").get<std::string>();
    has_test = !text("test_path").empty();
    test.format = train.format;
    test.x_path = text("test_path");
  }
  if (type != "csv") {
    train.x_key = test.x_key = cfg.at("x_key").get<std::string>();
    train.y_key = test.y_key = cfg.at("y_key").get<std::string>();
  } else {
    data::CsvOptions csv;
    const std::string delimiter = cfg.at("delimiter").get<std::string>();
    BOOSTER_CHECK(delimiter.size() == 1 && delimiter != "\"" && delimiter != "\n", ConfigError,
                  "'data.delimiter' is ", cfg.at("delimiter").dump(), "; expected one character, such as \",\" or \";\"");
    csv.delimiter = delimiter[0];
    const json& header = cfg.at("header");
    BOOSTER_CHECK(header.is_boolean() || header == "auto", ConfigError, "'data.header' is ", header.dump(),
                  "; expected true, false or \"auto\"");
    if (header.is_boolean()) csv.header = header.get<bool>();
    const json& label = cfg.at("label_column");
    BOOSTER_CHECK(label.is_number_integer() || (label.is_string() && !label.get<std::string>().empty()), ConfigError,
                  "'data.label_column' is ", label.dump(), "; expected a column name or an index (-1: the last)");
    if (label.is_string()) csv.label_name = label.get<std::string>();
    else csv.label_index = label.get<int64_t>();
    train.csv = test.csv = csv;
  }
  o.train = train;
  if (has_test) {
    BOOSTER_CHECK(o.test_fraction == 0.0, ConfigError, "'data.test_fraction' is ", o.test_fraction,
                  " but a test file is given too; use one of them");
    o.test = test;
  }
  return o;
}

std::unique_ptr<optim::LRScheduler> make_lr_scheduler(const json& lr_scheduler, optim::Optimizer& optimizer,
                                                      int64_t total_steps) {
  if (lr_scheduler.at("type") == "none") return nullptr;
  json options = lr_scheduler;
  for (const char* key : {"T_max", "total_steps"})
    if (options.contains(key) && options.at(key).is_null()) options[key] = std::max<int64_t>(total_steps, 1);
  return optim::make_scheduler(options, optimizer);
}

// Which settings, and why each (Note [Settings a resume must keep] in booster/booster/state.cpp says how
// they are compared):
//  * which samples make up each step, and in what order: train.seed (the shuffle order comes back from
//    the checkpoint, but the synthetic data set is drawn from the seed), train.grad_accumulation and
//    the data section (batch_size, shuffle, drop_last, the data set's own settings); the saved data
//    position, counted in batches, would also point elsewhere;
//  * the model section (but init_from, which only chooses the starting weights the checkpoint replaces);
//  * the criterion section (another loss, another label smoothing);
//  * the optimizer and lr_scheduler sections: their hyperparameters come back from the checkpoint (as
//    torch's load_state_dict does), so a changed lr, betas or schedule would be ignored without a word;
//  * the mixed_precision and plugin sections, every option resolved: the scaler's options
//    (growth_interval, backoff_factor, hysteresis, min_scale, max_scale, ...) are not in its saved
//    state, which holds only the scale and its trackers; low_level_zero's precision, ddp's
//    find_unused_parameters and broadcast_buffers change the numbers too (low_level_zero's stage
//    changes where state lives; a resume under another stage goes through portable_settings). Left out, as they change only
//    how fast: ddp's bucket_cap_mb and progress_thread, low_level_zero's overlap_communication and
//    reduce_bucket_size_in_m; and fp16_naive's log_num_zeros_in_grad (a log column). low_level_zero's
//    max_norm is left out as train.max_grad_norm is, of which it is the plugin's counterpart;
//  * train.max_steps, as the run's length in steps, when the schedule's length is the run's (a null
//    T_max or total_steps): the restored schedule keeps the saved length, so a longer run would go past
//    its end (a cosine climbs back up). Only a longer run is refused: a shorter one is an exact prefix.
// Left out because they may legitimately change: max_steps and epochs when the schedule does not
// depend on them (extending a run), max_grad_norm and the evaluation and logging settings (getting
// past a loss spike, watching more closely), data.dir, data.path and data.val_path (the data moved),
// data.made_by (Note [Data a script makes] in schema.cpp), data.eval_batch_size and the device.
nlohmann::json trajectory_settings(const nlohmann::json& config, int64_t total_steps) {
  using nlohmann::json;
  const json& train = config.at("train");
  json data = config.at("data");
  for (const char* may_change : {"dir", "path", "val_path", "eval_batch_size", "made_by"}) data.erase(may_change);
  json model = config.at("model");
  model.erase("init_from");
  json settings = {{"train.seed", train.at("seed")},
                   {"train.grad_accumulation", train.at("grad_accumulation")},
                   {"data", data},
                   {"model", model},
                   {"criterion", config.at("criterion")},
                   {"optimizer", config.at("optimizer")},
                   {"lr_scheduler", config.at("lr_scheduler")}};
  json mixed_precision = config.at("mixed_precision");
  mixed_precision.erase("log_num_zeros_in_grad");
  settings["mixed_precision"] = mixed_precision;
  json plugin = config.at("plugin");
  const json plugin_name = plugin.value("name", json());
  if (plugin_name == "ddp") {
    for (const char* speed_only : {"bucket_cap_mb", "progress_thread"}) plugin.erase(speed_only);
  } else if (plugin_name == "low_level_zero") {
    for (const char* may_change : {"overlap_communication", "reduce_bucket_size_in_m", "max_norm"})
      plugin.erase(may_change);
  }
  settings["plugin"] = plugin;
  const json& schedule = config.at("lr_scheduler");
  const bool schedule_spans_run = (schedule.contains("T_max") && schedule.at("T_max").is_null()) ||
                                  (schedule.contains("total_steps") && schedule.at("total_steps").is_null());
  if (schedule_spans_run) settings["train.max_steps"] = total_steps;
  return settings;
}

json portable_settings(const json& settings, int world_size) {
  json out = settings;
  if (out.contains("data") && out.at("data").is_object() && out.at("data").contains("batch_size") &&
      out.at("data").at("batch_size").is_number_integer()) {
    out["data"]["global_batch_size"] = out.at("data").at("batch_size").get<int64_t>() * world_size;
    out["data"].erase("batch_size");
  }
  if (out.contains("plugin") && out.at("plugin").is_object()) {
    const json name = out.at("plugin").value("name", json());
    if (name == "single" || name == "ddp") out.erase("plugin");
    // ZeRO's stage decides where state lives, not the numbers; its precision and scaler stay.
    else if (name == "low_level_zero") out["plugin"].erase("stage");
  }
  return out;
}

}  // namespace booster::config
