// Packed sft samples (Note [Packing SFT records] in booster/data/sft.h, Note [Packed sequences] in
// booster/nn/packing.h): records share sequences greedily in file order, and a Llama or a GPT given the
// packed input gives each record the logits it has alone (positions restart, no attention across records), so
// one training step on the packed samples has the loss and gradients of one on the records one by one,
// also with activation checkpointing (whose recompute runs under the forward's layout).
// A byte tokenizer (id = byte, bos 1, eos 2) makes every id known here.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/common/error.h"
#include "booster/data/sft.h"
#include "booster/nn/model_registry.h"
#include "booster/nn/packing.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/trainer/trainer.h"
#include "roundoff.h"
#include "sft_bytes.h"

using namespace booster;
using namespace booster::data;
using nlohmann::json;
namespace ro = ::testing::roundoff;

namespace {

SftTokenizer byte_tokenizer() { return ::testing::byte_sft_tokenizer(); }

constexpr int64_t kT = 32;

// Records of L = |prompt| + |response| + 8 ids (bos, "U:", prompt, "|", "A:", response, "!", eos), each
// taking min(L - 1, 32) positions: 11, 19, 21, 32 (cut), 9, 11, 11; the last is left out (its response
// lies past 32). Next fit: [11 19] [21] [32] [9 11 11].
std::vector<Conversation> records() {
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"a", "one"}, {"what is two", "2"}, {"say hello", "hello"}, {"abcdefghij", "klmnopqrstuvwxyz0123"},
      {"q", "r"},   {"hi", "yo"},         {"x", "abc"},         {"a prompt far longer than the whole of seq_len allows", "lost"}};
  std::vector<Conversation> out;
  for (const auto& [p, r] : pairs) out.push_back({{"user", p}, {"assistant", r}});
  return out;
}

const ChatTemplate kTemplate = chat_template_from_json({{"user", "U:{content}|"}, {"assistant", "A:{content}!"}});

SftDataset make(bool packing) { return SftDataset(records(), kTemplate, byte_tokenizer(), {.seq_len = kT, .packing = packing}, "r"); }

const json kLlama = {{"type", "llama"},          {"vocab_size", 256},      {"hidden_size", 16},
                     {"intermediate_size", 24},  {"num_hidden_layers", 2}, {"num_attention_heads", 2},
                     {"num_key_value_heads", 1}, {"max_position_embeddings", 64}};

// A GPT of the same size: its learned position embeddings restart per record as the Llama's rotary
// turns do, and its attention takes the same segments.
const json kGPT = {{"type", "gpt"}, {"vocab_size", 256}, {"context", 64}, {"width", 16}, {"layers", 2}, {"heads", 2}};

// Note [Roundoff bounds]: the model's forward reductions on `batch` sequences of kT.
double forward_length(const json& model, double batch) {
  if (model.at("type") == "gpt") return ro::gpt_forward_length(16, 2, 2, double(kT), 256, batch);
  return ro::llama_forward_length(16, 2, 2, 24, double(kT), 256, batch);
}

Tensor lm_loss(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

// Where record k lies: packed row, first position, positions.
struct Place {
  int64_t row, start, length;
};
const std::vector<Place> kPlaces = {{0, 0, 11}, {0, 11, 19}, {1, 0, 21}, {2, 0, 32}, {3, 0, 9}, {3, 9, 11}, {3, 20, 11}};

double l2(const Tensor& t) {
  double s = 0;
  for (double v : t.to(DType::Float64).to_vector<double>()) s += v * v;
  return std::sqrt(s);
}

}  // namespace

TEST_CASE("sft packing: records share sequences greedily in file order, numbered per sequence", "[data][sft]") {
  const SftDataset unpacked = make(false), packed = make(true);
  CHECK(unpacked.size() == 7);
  CHECK(packed.size() == 4);
  CHECK(packed.packed_records() == 7);
  CHECK(packed.dropped() == 1);
  CHECK(packed.truncated() == 2);
  CHECK(packed.response_tokens() == unpacked.response_tokens());
  CHECK_THAT(packed.describe(), Catch::Contains("7 records packed into the 4 samples"));
  const Batch b = packed.get_batch({0, 1, 2, 3});
  REQUIRE(b.x.shape() == Shape{4, 2, kT});
  REQUIRE(packed.get(3).x.shape() == Shape{2, kT});
  const auto [ids, layout] = nn::unpack_sequences(b.x);
  const std::vector<int64_t> seg = layout.segments.to_vector<int64_t>(), pos = layout.positions.to_vector<int64_t>();
  const std::vector<int64_t> x = ids.to_vector<int64_t>(), y = b.y.to_vector<int64_t>();
  const Batch u = unpacked.get_batch({0, 1, 2, 3, 4, 5, 6});
  const std::vector<int64_t> ux = u.x.to_vector<int64_t>(), uy = u.y.to_vector<int64_t>();
  std::vector<int64_t> used(4, 0);
  for (size_t k = 0; k < kPlaces.size(); ++k) {
    const Place& p = kPlaces[k];
    INFO("record " << k);
    used[size_t(p.row)] += p.length;
    for (int64_t i = 0; i < p.length; ++i) {
      const size_t at = size_t(p.row * kT + p.start + i), alone = size_t(int64_t(k) * kT + i);
      CHECK(x[at] == ux[alone]);  // the record's ids and targets, as alone
      CHECK(y[at] == uy[alone]);
      CHECK(pos[at] == i);        // positions restart
      CHECK(seg[at] == seg[size_t(p.row * kT + p.start)]);
    }
    if (p.start > 0) CHECK(seg[size_t(p.row * kT + p.start)] != seg[size_t(p.row * kT + p.start - 1)]);
  }
  for (int64_t r = 0; r < 4; ++r)  // the padding: no targets, a document of its own
    for (int64_t t = used[size_t(r)]; t < kT; ++t) {
      CHECK(y[size_t(r * kT + t)] == kIgnoreIndex);
      CHECK(seg[size_t(r * kT + t)] != seg[size_t(r * kT + used[size_t(r)] - 1)]);
    }
}

namespace {

// The packed logits of each record are its logits alone, and one step on the packed samples is one on
// the records one by one.
void check_packed_like_alone(const json& family) {
  const SftDataset unpacked = make(false), packed = make(true);
  const nn::ModulePtr model = nn::make_model(family, 5);
  const Batch p = packed.get_batch({0, 1, 2, 3});
  const Batch u = unpacked.get_batch({0, 1, 2, 3, 4, 5, 6});
  const Tensor packed_logits = model->forward(p.x), alone_logits = model->forward(u.x);
  REQUIRE(packed_logits.shape() == Shape{4, kT, 256});
  // The sums that differ between the two: the attention over the keys (masked ones add exact zeros)
  // and the GEMMs of other row counts (Note [Roundoff bounds]), relative to a row's largest logit.
  const double eps = ro::reduction_bound({forward_length(family, 1)});
  // Without the layout the same ids give other logits past a sequence's first record: what packing fixes.
  const Tensor plain_logits = model->forward(nn::unpack_sequences(p.x).first);
  double worst = 0, plain_gap = 0;
  for (size_t k = 0; k < kPlaces.size(); ++k) {
    const Place& pl = kPlaces[k];
    const Tensor got = packed_logits.select(0, pl.row).narrow(0, pl.start, pl.length);
    const Tensor want = alone_logits.select(0, int64_t(k)).narrow(0, 0, pl.length);
    const double scale = max(abs(want)).item<double>();
    const double d = max(abs(got - want)).item<double>();
    INFO("record " << k << ": difference " << d << ", bound " << eps * scale);
    CHECK(d <= eps * scale);
    worst = std::max(worst, d / scale);
    if (pl.start > 0)
      plain_gap = std::max(plain_gap, max(abs(plain_logits.select(0, pl.row).narrow(0, pl.start, pl.length) - want)).item<double>() / scale);
  }
  CHECK(plain_gap > 1e3 * eps);

  // One SGD step of lr 1 on all records, packed and one by one, the loss the token mean (as sft trains).
  auto step = [&](bool packing, int64_t batch) {
    Booster booster(BoosterConfig{});
    const nn::ModulePtr m = nn::make_model(family, 5);
    auto sgd = std::make_shared<optim::SGD>(m->parameters(), json{{"lr", 1.0}});
    auto view = std::make_shared<SftDataset>(records(), kTemplate, byte_tokenizer(),
                                             SftOptions{.seq_len = kT, .packing = packing}, "r");
    booster.boost(m, sgd, lm_loss, booster.prepare_dataloader(view, {.batch_size = batch}), nullptr);
    TrainerOptions o;
    o.max_steps = 1;
    o.handle_signals = false;
    o.progress = trainer::Progress::Mode::Silent;
    o.token_mean_ignore_index = kIgnoreIndex;
    Trainer trainer(booster, o);
    const double loss = trainer.fit().final_loss;
    return std::make_pair(loss, booster.boosted().model->state_dict());
  };
  const auto [alone_loss, alone_weights] = step(false, 7);
  const auto [packed_loss, packed_weights] = step(true, 4);
  const double forward = forward_length(family, 7 * double(kT));
  CHECK(std::abs(packed_loss - alone_loss) <= ro::reduction_bound({forward}) * alone_loss);
  const nn::StateDict start = nn::make_model(family, 5)->state_dict();
  const double eps_gradient = ro::reduction_bound({2 * forward, 7 * double(kT)});
  for (const auto& [name, w] : alone_weights) {
    INFO(name);
    const double moved = l2(w - start.at(name));  // lr |g|
    const double d = l2(packed_weights.at(name) - w);
    INFO("difference " << d << ", step " << moved);
    CHECK(d <= ro::kUnit * 2 * l2(w) + ro::sgd_bound(moved, eps_gradient));
  }
}

}  // namespace

TEST_CASE("sft packing: a Llama gives each packed record its logits alone, and one step its loss and gradients",
          "[data][sft][nn]") {
  check_packed_like_alone(kLlama);
}

TEST_CASE("sft packing: a GPT gives each packed record its logits alone, and one step its loss and gradients",
          "[data][sft][nn][gpt]") {
  check_packed_like_alone(kGPT);
}

namespace {

void check_recomputed_like_plain(const json& family) {
  // Note [Recomputing in backward]: each checkpointed layer runs again in backward under the packed
  // layout its forward ran under, so the recompute is the forward's ops on the forward's operands and
  // the gradients are the plain packed run's bit for bit; the plain packed run equals the records one
  // by one within roundoff (the test above), and so the checkpointed one does.
  const SftDataset unpacked = make(false), packed = make(true);
  const Batch p = packed.get_batch({0, 1, 2, 3});
  const Batch u = unpacked.get_batch({0, 1, 2, 3, 4, 5, 6});
  json recomputing = family;
  recomputing["activation_checkpointing"] = true;
  // The token mean of every response token (both batches hold the same ones): the gradients by name.
  auto gradients = [](const json& config, const Batch& b) {
    const nn::ModulePtr m = nn::make_model(config, 5);
    Tensor loss = lm_loss(m->forward(b.x), b.y);
    loss.backward();
    std::map<std::string, Tensor> out;
    for (const auto& [name, w] : m->named_parameters()) out[name] = w.grad();
    return std::make_pair(loss.item<double>(), out);
  };
  const auto [plain_loss, plain] = gradients(family, p);
  const auto [recomputed_loss, recomputed] = gradients(recomputing, p);
  const auto [alone_loss, alone] = gradients(family, u);
  CHECK(recomputed_loss == plain_loss);
  const double forward = forward_length(family, 7 * double(kT));
  CHECK(std::abs(recomputed_loss - alone_loss) <= ro::reduction_bound({forward}) * alone_loss);
  const double eps_gradient = ro::reduction_bound({2 * forward, 7 * double(kT)});
  REQUIRE(recomputed.size() == alone.size());
  for (const auto& [name, g] : alone) {
    INFO(name);
    REQUIRE(recomputed.at(name).defined());
    const double differs = max(abs(recomputed.at(name) - plain.at(name))).item<double>();
    const double d = l2(recomputed.at(name) - g);
    INFO("largest difference from the plain packed gradient " << differs << ", from the records alone " << d
         << " of " << l2(g) << ", bound " << eps_gradient * l2(g));
    CHECK(differs == 0.0);
    CHECK(d <= eps_gradient * l2(g));
  }
}

}  // namespace

TEST_CASE("sft packing: with activation checkpointing a Llama gets the packed gradients bit for bit, as the records alone",
          "[data][sft][nn]") {
  check_recomputed_like_plain(kLlama);
}

TEST_CASE("sft packing: with activation checkpointing a GPT gets the packed gradients bit for bit, as the records alone",
          "[data][sft][nn][gpt]") {
  check_recomputed_like_plain(kGPT);
}
