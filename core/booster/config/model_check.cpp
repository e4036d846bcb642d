// check_model (config.h): a Llama or Hugging Face model checked as `booster train` would build and split it.
//
// Note [Checking a model before it trains]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The table checks a "llama" or "hf" model's keys one by one (Note [Llama and Hugging Face model keys]
// in schema.cpp); what depends on several of them, or on files, is checked by the code that builds and
// splits the model, run here on the resolved config, so `booster check` refuses what `booster train`
// would refuse with the same message (and train, which resolves the config too, refuses it before it
// starts any process group):
//  * the model is built through nn::make_model under a LazyInitGuard, as cli/train.cpp builds it: no
//    parameter memory, and an hf model reads config.json and its weight files' headers but not the
//    weights. make_llama's ConfigError names the sizes that do not divide (hidden by heads, heads by
//    key/value heads) or an odd head size (RoPE turns pairs of features); load_pretrained's names a
//    missing config.json, model.safetensors / model.safetensors.index.json or shard, and tensors of
//    the wrong name or shape;
//  * data.seq_len (tokens) or data.context (text) must fit the model's positions (nn::CausalLM::
//    max_positions), which the first forward would otherwise refuse;
//  * under hybrid_parallel with tp_size or pp_size > 1, the shard policy the plugin would look up for the
//    model (nn::find_shard_policy, by Module::name()) is run for every pipeline stage, with a stand-in
//    tensor-parallel group of tp_size ranks that only answers rank() and size() (a policy slices without
//    communicating): so the Llama policy's refusals (tp_size not dividing the query heads, the key/value
//    heads, the intermediate size or the vocabulary; tied embeddings with pp_size > 1; stage_layers
//    that do not add up to the layers) come with the policy's own words. The model and the parts stand
//    for their shapes only (a ShapesOnlyGuard: no draws, no memory, a 7B Llama split in a second) and
//    are dropped. A ValueError of the policy (stage_layers) is a mistake in the config, so it
//    becomes a ConfigError with the same message. A part with no parameters at all (a middle stage
//    that got no layer: more stages than the layers + 2) is refused too, naming the stage: the run
//    would stop on that rank only, when the plugin rebuilds the optimizer over the part ("optimizer got
//    an empty parameter list").
// A built-in "gpt" is split the same way (its policy is booster's too), so a GPT pipeline stage left
// without a layer is refused by check as train refuses it. Other models are not split here: a
// registered or library model's policy belongs to a program or a
// library, which may not expect to be called over a stand-in group. But under hybrid_parallel with
// tp_size or pp_size > 1 every model is built deferred (a library's factory runs once more, allocating
// nothing) to look its shard policy up by Module::name(), as the plugin does at boost(): a model without
// one is refused with the plugin's own message (nn::find_shard_policy's IncompatibleError), before any
// process starts.
//
// Note [A trial forward of a library model]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A built-in model's input width and classes are checked against the data by the schema; a library
// model's keys are its own, so `booster check` (trial_forward, not train, which meets the same error
// at its first step) builds it and runs one forward, without gradients and in eval mode, on two samples
// of the training split: the first, and, where the targets are class indices in a tensor, the one with
// the largest class, so the criterion sees a class the model's outputs may not cover. A model whose
// input size does not fit the data fails in the layer that takes it ("fc1 (Linear): expected input
// [..., 8], got shape [2, 10]", Note [Errors name the module] in booster/nn/module.cpp), one with too
// few classes in the criterion, each with the error train would give. The model is counted deferred
// first: one whose parameters would take more than half of the memory available (MemAvailable) is not
// built, and check says so instead of running the machine out of memory.
#include "booster/config/config.h"

#include <map>
#include <set>

#include "booster/checkpoint/checkpoint.h"
#include "booster/common/error.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/families.h"
#include "booster/nn/kv_cache.h"
#include "booster/nn/llama.h"
#include "booster/nn/model_registry.h"
#include "booster/nn/model_size.h"
#include "booster/nn/models.h"
#include "booster/nn/shard_policy.h"
#include "booster/autograd/autograd.h"
#include "booster/config/memory_estimate.h"
#include "booster/config/training.h"
#include "booster/data/dataset.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"

namespace booster::config {
namespace {

// tp_size ranks of which this is rank 0, for running a shard policy on one process: any collective is a
// StateError (Note [Checking a model before it trains]).
class StandInGroup final : public distributed::ProcessGroup {
 public:
  explicit StandInGroup(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string backend() const override { return "stand-in"; }
  Device device() const override { return Device::cpu(); }
  void barrier() override { fail(); }
  [[noreturn]] void abort(int, const std::string& why) override { BOOSTER_FAIL(StateError, why); }

 protected:
  distributed::WorkPtr all_reduce_impl(const distributed::BufferSpan&, distributed::ReduceOp, bool) override { fail(); }
  distributed::WorkPtr broadcast_impl(const distributed::BufferSpan&, int, bool) override { fail(); }
  distributed::WorkPtr all_gather_impl(const distributed::BufferSpan&, const distributed::BufferSpan&, bool) override {
    fail();
  }
  distributed::WorkPtr reduce_scatter_impl(const distributed::BufferSpan&, const distributed::BufferSpan&,
                                           distributed::ReduceOp, bool) override {
    fail();
  }

 private:
  [[noreturn]] static void fail() {
    BOOSTER_FAIL(StateError, "checking a shard policy: the stand-in tensor-parallel group has no collectives");
  }
  int size_;
};

// Where the model's position limit comes from, for the message.
std::string positions_source(const json& model) {
  if (nn::find_decoder_family(model.at("type").get<std::string>())) return "'model.max_position_embeddings'";
  return "the config.json of " + model.at("path").get<std::string>() + " (max_position_embeddings or n_positions)";
}

// The decoder layers a pipeline cuts between (0 where unknown).
int64_t layers_of(const nn::Module& model) {
  if (const auto* llama = dynamic_cast<const nn::Llama*>(&model)) return llama->config.num_hidden_layers;
  if (const auto* gpt = dynamic_cast<const nn::GPT*>(&model)) return gpt->config.layers;
  return 0;
}

// True when the plugin section splits the model (hybrid_parallel with tp_size or pp_size > 1).
bool splits_model(const json& plugin) {
  return plugin.value("name", std::string()) == "hybrid_parallel" &&
         (plugin.value("tp_size", 1) > 1 || plugin.value("pp_size", 1) > 1);
}

// The plugin's shard policy for `model`: its own words for a model that has none
// (plugins/hybrid_parallel/plugin.cpp).
nn::ShardPolicy shard_policy_of(const nn::Module& model, const json& plugin) {
  const std::string why = "plugin 'hybrid_parallel' with tp_size " + std::to_string(plugin.value("tp_size", 1)) +
                          " and pp_size " + std::to_string(plugin.value("pp_size", 1));
  return nn::find_shard_policy(model.name(), why);
}

// The model section as train builds it, deferred and for its shapes only (no parameter memory, no draws).
nn::ModulePtr build_deferred(const json& c) {
  json section = c.at("model");
  section.erase("init_from");  // the weights replace the initial ones; they do not change the shapes
  LazyInitGuard lazy;
  ShapesOnlyGuard shapes;
  return nn::make_model(section, c.at("train").at("seed").get<uint64_t>());
}

void check_split(const nn::ModulePtr& model, const json& plugin) {
  if (!splits_model(plugin)) return;  // data parallel only: the plugin splits nothing
  const int tp = plugin.value("tp_size", 1), pp = plugin.value("pp_size", 1);
  const std::string why = "plugin 'hybrid_parallel' with tp_size " + std::to_string(tp) + " and pp_size " + std::to_string(pp);
  const nn::ShardPolicy policy = shard_policy_of(*model, plugin);
  LazyInitGuard lazy;  // the parts' own tensors, and the slices of the whole, stand for their shapes
  ShapesOnlyGuard shapes;
  StandInGroup group(tp);
  nn::ShardContext context;
  context.tp = &group;
  context.stages = pp;
  context.stage_layers = plugin.value("stage_layers", std::vector<int64_t>{});
  for (int stage = 0; stage < pp; ++stage) {
    context.stage = stage;
    nn::ShardedModel part;
    try {
      part = policy(model, context);
    } catch (const ValueError& e) {
      throw ConfigError(e.what());
    }
    // A stage between the first (the embedding) and the last (the head) that got no layer has nothing to
    // train, and the run would stop on that rank when the plugin rebuilds the optimizer over its part
    // ("optimizer got an empty parameter list").
    if (part.module != nullptr && part.module->parameters().empty()) {
      const int64_t layers = layers_of(*model);
      throw ConfigError(why + ": pipeline stage " + std::to_string(stage) + " of " + std::to_string(pp) +
                        " would hold no parameters" +
                        (layers > 0 ? " (the model's " + std::to_string(layers) + " layers do not reach every stage)" : "") +
                        ", so it would have nothing to train; use a pp_size of at most the layers + 2" +
                        (layers > 0 ? " (" + std::to_string(layers + 2) + ")" : "") +
                        ", or plugin.stage_layers giving every stage between the first and the last a layer");
    }
  }
}

}  // namespace

void check_model(const json& c) {
  const json& model = c.at("model");
  const std::string type = model.at("type").get<std::string>();
  // Note [Sizes before building] (nn/model_size.h): sizes past booster's limits are refused by name
  // before anything is built (an hf directory's are checked against its weights as it is read).
  if (type == "gpt" || nn::find_decoder_family(type) != nullptr)
    nn::check_decoder_sizes(nn::booster_decoder_sizes(type, model), "");
  else if (type == "mlp" || type == "linear")
    nn::check_mlp_sizes(model, "");
  if (nn::find_decoder_family(type) == nullptr && type != "hf") {
    if (!splits_model(c.at("plugin"))) return;
    // A family's policy (the GPT's) is booster's own, and split as a Llama's is; of other models, only
    // whether the plugin finds a policy (Note [Checking a model before it trains]).
    if (nn::find_model_family(type) != nullptr) check_split(build_deferred(c), c.at("plugin"));
    else shard_policy_of(*build_deferred(c), c.at("plugin"));
    return;
  }
  const nn::ModulePtr built = build_deferred(c);  // counted and split, never allocated

  const json& data = c.at("data");
  const char* length_key = data.contains("seq_len") ? "seq_len" : data.contains("context") ? "context" : nullptr;
  if (const auto* lm = dynamic_cast<const nn::CausalLM*>(built.get()); lm != nullptr && length_key != nullptr) {
    const json& length = data.at(length_key);
    if (length.is_number_integer() && length.get<int64_t>() > lm->max_positions())
      throw ConfigError("'data." + std::string(length_key) + "' is " + length.dump() + " but the model takes at most " +
                        std::to_string(lm->max_positions()) + " positions (" + positions_source(model) +
                        "); the model cannot see more tokens than its positions");
  }

  check_split(built, c.at("plugin"));
}

// Note [Weights of another model]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// model.init_from's weights are loaded into the model train builds, strictly: every tensor of the
// model must be there in its shape, and nothing else. A file of another model (another width, another
// layer count) used to pass `booster check` and stop train once the model was built, with a line
// listing every tensor (2.5 KB for a small Llama) that ended in an option of the C++ API a config cannot
// set. So the model is built deferred (no memory, no draws), the files' headers are read (no weights,
// nothing verified: train verifies as it loads), and the differences are listed short: the first few
// of each kind and a count of the rest; check and train refuse alike, while the config is resolved.
void check_init_from(const json& c) {
  const json& init_from = c.at("model").value("init_from", json());
  if (!init_from.is_string() || !std::filesystem::exists(init_from.get<std::string>())) return;
  const std::string file = init_from.get<std::string>();
  const std::map<std::string, Shape> saved = checkpoint::weight_shapes(file);
  const nn::ModulePtr model = build_deferred(c);
  std::vector<std::pair<std::string, Tensor>> own = model->named_parameters();
  for (auto& entry : model->named_buffers()) own.push_back(std::move(entry));
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> own_names;
  for (const auto& [name, t] : own) {
    own_names.insert(name);
    const auto it = saved.find(name);
    if (it == saved.end()) missing.push_back("\"" + name + "\"");
    else if (it->second != t.shape())
      mismatched.push_back(str("\"", name, "\" (saved ", it->second, ", model ", t.shape(), ")"));
  }
  for (const auto& [name, shape] : saved)
    if (!own_names.count(name)) unexpected.push_back("\"" + name + "\"");
  if (missing.empty() && unexpected.empty() && mismatched.empty()) return;
  // The first few of a list and a count of the rest.
  auto few = [](const std::vector<std::string>& items) {
    constexpr size_t kShown = 3;
    std::string out;
    for (size_t i = 0; i < std::min(items.size(), kShown); ++i) out += (i ? ", " : "") + items[i];
    if (items.size() > kShown) out += " and " + std::to_string(items.size() - kShown) + " more";
    return out;
  };
  std::string what;
  if (!mismatched.empty()) what += "; " + std::to_string(mismatched.size()) + " of another shape: " + few(mismatched);
  if (!missing.empty()) what += "; " + std::to_string(missing.size()) + " of the model's missing: " + few(missing);
  if (!unexpected.empty()) what += "; " + std::to_string(unexpected.size()) + " not the model's: " + few(unexpected);
  throw ConfigError("'model.init_from' " + file + " holds the weights of another model (" +
                    std::to_string(saved.size()) + " tensors, the model " + std::to_string(own.size()) + ")" + what +
                    "; give the weights of a run with this model section, or the model section of the run that "
                    "saved them");
}

// Note [A trial forward of a library model].
std::string trial_forward(const json& c) {
  const json& model = c.at("model");
  if (!model.contains("library")) return "";
  double bytes = 0;
  for (const Tensor& p : build_deferred(c)->parameters()) bytes += double(p.nbytes());
  const HostMemory memory = host_memory();
  if (memory.available > 0 && bytes > 0.5 * double(memory.available))
    return "the trial forward of the library model was skipped: its parameters take " + format_bytes(bytes) +
           ", more than half of the " + format_bytes(double(memory.available)) +
           " this machine has available; a model that does not fit the data fails at train's first step";
  const uint64_t seed = c.at("train").at("seed").get<uint64_t>();
  const DataSplits split = make_datasets(c.at("data"), seed, model_vocab_size(model));
  if (!split.train || split.train->size() == 0) return "";
  std::vector<int64_t> rows = {0};
  if (const auto* tensors = dynamic_cast<const data::TensorDataset*>(split.train.get());
      tensors && tensors->y().dim() == 1 && !is_floating(tensors->y().dtype()) && tensors->size() > 1)
    rows.push_back(argmax(tensors->y().to(DType::Int64), 0).to_vector<int64_t>()[0]);
  else if (split.train->size() > 1)
    rows.push_back(1);
  const data::Batch batch = split.train->get_batch(rows);
  json section = model;
  section.erase("init_from");
  const nn::ModulePtr built = nn::make_model(section, seed);
  built->eval();
  NoGradGuard no_grad;
  make_criterion(c.at("criterion"))((*built)(batch.x), batch.y);
  return "";
}

}  // namespace booster::config
