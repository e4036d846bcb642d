// Token data (booster/data/tokens.h): flat uint16/uint32 files and llm.c shards, written here byte by
// byte (not with the library's writer), against hand-computed slices; batch order unshuffled, shuffled,
// resumed and split over ranks through the library's own loaders; every malformed file a DataError
// naming the file and the offset; the config keys; the SentencePiece tokenizer's errors.
#include <catch2/catch.hpp>

#include "skip.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/config/training.h"
#include "booster/data/data.h"
#include "booster/plugin/data_parallel.h"  // data_parallel_loader: each rank's share, as ddp and ZeRO make it
#include "run_booster.h"

using namespace booster;
using namespace booster::data;
using Catch::Contains;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) { return testing::scratch_dir("test_tokens") / name; }

void append_le(std::string& bytes, uint64_t v, int width) {
  for (int b = 0; b < width; ++b) bytes.push_back(char((v >> (8 * b)) & 0xFF));
}

// A flat file of `width`-byte little-endian ids (nanoGPT's .bin), plus `extra` stray bytes.
fs::path write_flat(const std::string& name, const std::vector<uint32_t>& ids, int width, int extra = 0) {
  std::string bytes;
  for (uint32_t id : ids) append_le(bytes, id, width);
  bytes.append(size_t(extra), '\x01');
  const fs::path p = scratch(name);
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}

// llm.c's shard: 256 int32 (magic, version, count, zeros), then uint16 ids (plus `extra` stray bytes).
fs::path write_llmc(const std::string& name, const std::vector<uint32_t>& ids, int32_t version = 1,
                    int64_t count = -1, int extra = 0) {
  std::string bytes;
  append_le(bytes, uint32_t(20240520), 4);
  append_le(bytes, uint32_t(version), 4);
  append_le(bytes, uint32_t(count < 0 ? int64_t(ids.size()) : count), 4);
  bytes.resize(1024, '\0');
  for (uint32_t id : ids) append_le(bytes, id, 2);
  bytes.append(size_t(extra), '\x01');
  const fs::path p = scratch(name);
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}

std::vector<int64_t> slice(const std::vector<uint32_t>& ids, int64_t begin, int64_t count) {
  return std::vector<int64_t>(ids.begin() + begin, ids.begin() + begin + count);
}

std::vector<uint32_t> iota_ids(int64_t n) {
  std::vector<uint32_t> ids(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) ids[size_t(k)] = uint32_t(k);
  return ids;
}

// The sample indices of every batch of one pass, read back from the ids (ids[k] = k, so sample i's
// first input is i * T).
std::vector<std::vector<int64_t>> pass_samples(DataLoader& loader, int64_t T) {
  std::vector<std::vector<int64_t>> out;
  for (auto& [x, y] : loader) {
    std::vector<int64_t> batch;
    const std::vector<int64_t> flat = x.to_vector<int64_t>();
    for (size_t r = 0; r < flat.size(); r += size_t(T)) batch.push_back(flat[r] / T);
    out.push_back(batch);
  }
  return out;
}

std::multiset<int64_t> as_set(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

}  // namespace

TEST_CASE("token files: flat uint16 and uint32 and an llm.c shard give the hand-computed slices", "[data][tokens]") {
  const int64_t T = 5;
  // Ids that differ in both bytes (and, for uint32, above 65535), so a wrong width or byte order shows.
  std::vector<uint32_t> ids16, ids32;
  for (int64_t k = 0; k < 43; ++k) {
    ids16.push_back(uint32_t((k * 7919 + 258) % 65536));
    ids32.push_back(uint32_t(k * 1000003 + 70000));
  }
  struct Case {
    std::string what;
    fs::path path;
    TokenDType dtype;
    std::vector<uint32_t> ids;
    bool llmc;
  };
  const std::vector<Case> cases = {
      {"uint16", write_flat("flat16.bin", ids16, 2), TokenDType::UInt16, ids16, false},
      {"uint32", write_flat("flat32.bin", ids32, 4), TokenDType::UInt32, ids32, false},
      // An llm.c shard's dtype comes from its header, whatever the caller says.
      {"llm.c", write_llmc("shard.bin", ids16), TokenDType::UInt32, ids16, true},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    auto ds = token_file_dataset(c.path.string(), c.dtype, {.seq_len = T});
    CHECK(ds->source().llmc() == c.llmc);
    CHECK(ds->source().size() == 43);
    REQUIRE(ds->size() == (43 - 1) / T);  // 8: the last sample's target is token 40
    for (int64_t i = 0; i < ds->size(); ++i) {
      const Batch b = ds->get(i);
      REQUIRE(b.x.shape() == Shape{1, T});
      REQUIRE(b.x.dtype() == DType::Int64);
      REQUIRE(b.x.to_vector<int64_t>() == slice(c.ids, i * T, T));
      REQUIRE(b.y.to_vector<int64_t>() == slice(c.ids, i * T + 1, T));
    }
    const Batch b = ds->get_batch({7, 0, 3});
    REQUIRE(b.x.shape() == Shape{3, T});
    std::vector<int64_t> want_x, want_y;
    for (int64_t i : {7, 0, 3}) {
      for (int64_t v : slice(c.ids, i * T, T)) want_x.push_back(v);
      for (int64_t v : slice(c.ids, i * T + 1, T)) want_y.push_back(v);
    }
    CHECK(b.x.to_vector<int64_t>() == want_x);
    CHECK(b.y.to_vector<int64_t>() == want_y);
    CHECK_THROWS_AS(ds->get_batch({8}), IndexError);
  }
  // Exactly seq_len + 1 tokens: one sample; (n - 1) / T counts a partial last window out.
  CHECK(token_file_dataset(write_flat("one.bin", iota_ids(T + 1), 2).string(), TokenDType::UInt16, {.seq_len = T})
            ->size() == 1);
  CHECK(token_file_dataset(write_flat("two.bin", iota_ids(3 * T), 2).string(), TokenDType::UInt16, {.seq_len = T})
            ->size() == 2);
}

TEST_CASE("token data: unshuffled batch b holds samples b*B .. b*B+B-1", "[data][tokens]") {
  const int64_t T = 4, B = 3;
  auto ds = token_file_dataset(write_flat("order.bin", iota_ids(4 * 11 + 2), 2).string(), TokenDType::UInt16,
                               {.seq_len = T});
  REQUIRE(ds->size() == 11);
  DataLoader loader(ds, {.batch_size = B, .shuffle = false});
  const auto batches = pass_samples(loader, T);
  REQUIRE(batches.size() == 4);
  for (int64_t b = 0; b < 4; ++b) {
    std::vector<int64_t> want;
    for (int64_t i = b * B; i < std::min<int64_t>(b * B + B, 11); ++i) want.push_back(i);
    CHECK(batches[size_t(b)] == want);
  }
}

TEST_CASE("token data: shuffled order is reproducible, resumes exactly, and is the same on 1 and 2 ranks",
          "[data][tokens]") {
  const int64_t T = 8, G = 4;  // global batch G: 1 rank x 4, or 2 ranks x 2
  auto ds = token_file_dataset(write_flat("shuffle.bin", iota_ids(200), 4).string(), TokenDType::UInt32,
                               {.seq_len = T});
  REQUIRE(ds->size() == 24);
  const DataLoaderOptions one{.batch_size = G, .shuffle = true, .seed = 5};
  DataLoaderOptions half = one;
  half.batch_size = G / 2;

  // The uninterrupted run, epoch 1 (as the Booster's single-process loader makes it).
  DataLoader reference(ds, one);
  reference.set_epoch(1);
  const auto want = pass_samples(reference, T);
  REQUIRE(want.size() == 6);
  std::set<int64_t> seen;
  for (const auto& b : want) seen.insert(b.begin(), b.end());
  CHECK(seen.size() == 24);  // a permutation
  DataLoader again(ds, one);
  again.set_epoch(1);
  CHECK(pass_samples(again, T) == want);
  DataLoader other_epoch(ds, one);
  other_epoch.set_epoch(2);
  CHECK(pass_samples(other_epoch, T) != want);

  // Two ranks: each step's two halves are the reference step's samples.
  auto step_sets = [&](std::vector<std::shared_ptr<DataLoader>>& ranks) {
    std::vector<std::vector<std::vector<int64_t>>> per_rank;
    for (auto& l : ranks) per_rank.push_back(pass_samples(*l, T));
    std::vector<std::multiset<int64_t>> steps(per_rank[0].size());
    for (auto& batches : per_rank) {
      REQUIRE(batches.size() == steps.size());
      for (size_t s = 0; s < batches.size(); ++s) steps[s].insert(batches[s].begin(), batches[s].end());
    }
    return steps;
  };
  {
    std::vector<std::shared_ptr<DataLoader>> ranks = {data_parallel_loader(ds, half, 2, 0, "test"),
                                                      data_parallel_loader(ds, half, 2, 1, "test")};
    for (auto& l : ranks) l->set_epoch(1);
    const auto steps = step_sets(ranks);
    REQUIRE(steps.size() == want.size());
    for (size_t s = 0; s < want.size(); ++s) CHECK(steps[s] == as_set(want[s]));
  }

  // Stopped after k steps on one rank, resumed on one rank and on two: exactly the remaining steps.
  for (int64_t k : {1, 4}) {
    INFO("stopped after " << k << " steps");
    DataLoader first(ds, one);
    first.set_epoch(1);
    json state;
    int64_t taken = 0;
    for (auto& batch : first) {
      (void)batch;
      if (++taken == k) {
        state = first.state_dict();
        break;
      }
    }
    DataLoader resumed(ds, one);
    resumed.load_state_dict(json::parse(state.dump()));
    CHECK(pass_samples(resumed, T) == std::vector<std::vector<int64_t>>(want.begin() + k, want.end()));

    std::vector<std::shared_ptr<DataLoader>> ranks = {data_parallel_loader(ds, half, 2, 0, "test"),
                                                      data_parallel_loader(ds, half, 2, 1, "test")};
    for (auto& l : ranks) l->load_state_dict(state);
    const auto steps = step_sets(ranks);
    REQUIRE(int64_t(steps.size()) == int64_t(want.size()) - k);
    for (size_t s = 0; s < steps.size(); ++s) CHECK(steps[s] == as_set(want[size_t(k) + s]));
  }
}

TEST_CASE("malformed token files are DataErrors naming the file and the offset", "[data][tokens]") {
  auto open16 = [](const fs::path& p, int64_t T = 4, int64_t vocab = 0, int64_t eager = int64_t(64) << 20) {
    return token_file_dataset(p.string(), TokenDType::UInt16, {.seq_len = T, .vocab_size = vocab, .eager_check_bytes = eager});
  };
  SECTION("a size that is not a whole number of tokens") {
    const fs::path odd = write_flat("odd.bin", iota_ids(100), 2, /*extra=*/1);  // 201 bytes
    REQUIRE_THROWS_AS(open16(odd), DataError);
    CHECK_THROWS_WITH(open16(odd), Contains(odd.string()) && Contains("201 bytes") && Contains("byte offset 200"));
    const fs::path odd32 = write_flat("odd32.bin", iota_ids(10), 4, /*extra=*/2);  // 42 bytes
    CHECK_THROWS_WITH(token_file_dataset(odd32.string(), TokenDType::UInt32, {.seq_len = 4}),
                      Contains(odd32.string()) && Contains("uint32") && Contains("byte offset 40"));
    // The same 42 bytes are 21 whole uint16 tokens.
    CHECK(open16(odd32)->source().size() == 21);
  }
  SECTION("an llm.c header that lies") {
    const fs::path count = write_llmc("lying_count.bin", iota_ids(50), 1, /*count=*/100);
    REQUIRE_THROWS_AS(open16(count), DataError);
    CHECK_THROWS_WITH(open16(count), Contains(count.string()) && Contains("says 100 tokens") && Contains("byte offset 8") &&
                                         Contains("100 bytes after the 1024-byte header"));
    const fs::path torn = write_llmc("torn.bin", iota_ids(50), 1, 50, /*extra=*/1);
    CHECK_THROWS_WITH(open16(torn), Contains(torn.string()) && Contains("not a whole number"));
    const fs::path version = write_llmc("version.bin", iota_ids(50), /*version=*/2);
    CHECK_THROWS_WITH(open16(version), Contains(version.string()) && Contains("version 2") && Contains("byte offset 4"));
    // Too short for a header: the magic is not looked for, and 6 bytes are 3 flat uint16 tokens.
    std::string tiny;
    append_le(tiny, 20240520, 4);
    append_le(tiny, 1, 2);
    std::ofstream(scratch("tiny.bin"), std::ios::binary) << tiny;
    CHECK(open16(scratch("tiny.bin"), 1)->source().llmc() == false);
  }
  SECTION("a token id past the model's vocabulary") {
    std::vector<uint32_t> ids(200);
    for (size_t k = 0; k < ids.size(); ++k) ids[k] = uint32_t(k % 500);
    ids[12] = 500;  // the target of sample 2 (T = 4) and the first input of sample 3
    const fs::path flat = write_flat("past_vocab.bin", ids, 2);
    // A small file is scanned when the data set is made.
    REQUIRE_THROWS_AS(open16(flat, 4, 500), DataError);
    CHECK_THROWS_WITH(open16(flat, 4, 500), Contains(flat.string()) && Contains("token id 500") &&
                                                Contains("token offset 12") && Contains("byte offset 24") &&
                                                Contains("vocabulary of 500"));
    CHECK_NOTHROW(open16(flat, 4, 501));
    // A large one batch by batch: the batches without it are fine, the first that reads it fails.
    auto lazy = open16(flat, 4, 500, /*eager=*/0);
    CHECK_NOTHROW(lazy->get_batch({0, 1, 4, 40}));
    CHECK_THROWS_WITH(lazy->get_batch({0, 2}), Contains(flat.string()) && Contains("token offset 12"));  // a target
    CHECK_THROWS_WITH(lazy->get(3), Contains("token offset 12"));                                          // an input
    DataLoader loader(lazy, {.batch_size = 8});
    CHECK_THROWS_WITH([&] { for (auto& b : loader) (void)b; }(), Contains("token offset 12"));
    // In an llm.c shard the byte offset counts the header.
    const fs::path shard = write_llmc("past_vocab_shard.bin", ids);
    CHECK_THROWS_WITH(open16(shard, 4, 500), Contains(shard.string()) && Contains("token offset 12") &&
                                                 Contains("byte offset 1048"));
  }
  SECTION("missing, empty and too short files") {
    CHECK_THROWS_WITH(open16(scratch("nope.bin")), Contains(scratch("nope.bin").string()) && Contains("cannot open"));
    CHECK_THROWS_AS(open16(scratch("")), DataError);  // a directory
    std::ofstream(scratch("empty.bin"), std::ios::binary).close();
    CHECK_THROWS_WITH(open16(scratch("empty.bin")), Contains("holds 0 tokens"));
    const fs::path short_file = write_flat("short.bin", iota_ids(4), 2);
    CHECK_THROWS_WITH(open16(short_file, 4), Contains(short_file.string()) && Contains("needs at least 5"));
  }
}

namespace {
json token_config(const fs::path& train, const fs::path& val) {
  return {{"model", {{"type", "gpt"}, {"vocab_size", 512}, {"context", 16}, {"width", 16}, {"layers", 1}, {"heads", 2}}},
          {"optimizer", {{"type", "adamw"}, {"lr", 0.001}}},
          {"data", {{"type", "tokens"}, {"path", train.string()}, {"val_path", val.string()}, {"seq_len", 8},
                    {"batch_size", 4}}}};
}
}  // namespace

TEST_CASE("token data configs: resolve checks the keys and the files against the model", "[data][tokens][config]") {
  std::vector<uint32_t> ids(401);
  for (size_t k = 0; k < ids.size(); ++k) ids[k] = uint32_t((k * 37) % 511);
  const std::vector<uint32_t> val_ids(ids.begin(), ids.begin() + 97);
  const fs::path train = write_flat("cfg_train.bin", ids, 2), val = write_flat("cfg_val.bin", val_ids, 2);
  const json resolved = config::resolve(token_config(train, val));
  CHECK(resolved["data"]["dtype"] == "uint16");
  CHECK(resolved["data"]["shuffle"] == true);
  const config::DataSplits split =
      config::make_datasets(resolved["data"], 0, config::model_vocab_size(resolved["model"]));
  CHECK(split.train->size() == 50);
  REQUIRE(split.test != nullptr);
  CHECK(split.test->size() == (97 - 1) / 8);
  CHECK(split.eval_stride == 1);
  CHECK(split.tokens_per_sample == 8);
  CHECK(split.language_model);
  CHECK_THAT(split.description, Contains(train.string()) && Contains("401 uint16 tokens"));
  // Without val_path: no evaluation.
  json c = token_config(train, val);
  c["data"].erase("val_path");
  CHECK(config::make_datasets(config::resolve(c)["data"], 0).test == nullptr);

  c = token_config(train, val);
  c["data"]["seq_len"] = 32;
  CHECK_THROWS_WITH(config::resolve(c), Contains("'data.seq_len' is 32") && Contains("'model.context' is 16"));
  c = token_config(train, val);
  c["model"]["vocab_size"] = 300;
  CHECK_THROWS_AS(config::resolve(c), DataError);
  CHECK_THROWS_WITH(config::resolve(c), Contains(train.string()) && Contains("vocabulary of 300"));
  c = token_config(train, val);
  c["data"]["dtype"] = "int16";
  CHECK_THROWS_WITH(config::resolve(c), Contains("'data.dtype'") && Contains("uint16"));
  c = token_config(train, val);
  c["data"]["seq_lenn"] = 8;
  CHECK_THROWS_WITH(config::resolve(c), Contains("did you mean 'seq_len'"));
  c = token_config(train, val);
  c["data"].erase("path");
  CHECK_THROWS_AS(config::resolve(c), ConfigError);
  c = token_config(train, val);
  c["data"]["val_path"] = scratch("missing_val.bin").string();
  CHECK_THROWS_WITH(config::resolve(c), Contains("missing_val.bin"));
  c = token_config(train, val);
  c["model"] = {{"type", "mlp"}, {"in", 8}, {"classes", 3}};
  CHECK_THROWS_WITH(config::resolve(c), Contains("'data.type' \"tokens\" needs a language model"));
  c = token_config(train, val);
  c["criterion"] = {{"type", "mse"}};
  CHECK_THROWS_WITH(config::resolve(c), Contains("cross_entropy"));
}

namespace {
// False in a build without libsentencepiece, whose tokenizer is a stub that throws NotImplementedError.
bool tokenizer_built() {
  try {
    SentencePieceTokenizer probe("/nonexistent/probe.model");
  } catch (const NotImplementedError&) {
    return false;
  } catch (const Error&) {
  }
  return true;
}
}  // namespace

TEST_CASE("tokenizer: a missing or corrupt model is a DataError naming the file", "[data][tokens][tokenizer]") {
  if (!tokenizer_built()) {
    skip_test("this booster was built without SentencePiece (libsentencepiece-dev)");
    return;
  }
  CHECK_THROWS_AS(SentencePieceTokenizer(scratch("absent.model").string()), DataError);
  CHECK_THROWS_WITH(SentencePieceTokenizer(scratch("absent.model").string()),
                    Contains(scratch("absent.model").string()) && Contains("cannot open"));
  std::ofstream(scratch("corrupt.model"), std::ios::binary) << "this is not a protobuf\n\x01\x02\x03";
  CHECK_THROWS_AS(SentencePieceTokenizer(scratch("corrupt.model").string()), DataError);
  CHECK_THROWS_WITH(SentencePieceTokenizer(scratch("corrupt.model").string()),
                    Contains(scratch("corrupt.model").string()) && Contains("not a SentencePiece model"));
  // Through a config: text data's tokenizer key.
  json c = {{"model", {{"type", "gpt"}, {"vocab_size", 512}, {"context", 16}, {"width", 16}, {"layers", 1}, {"heads", 2}}},
            {"optimizer", {{"type", "adamw"}}},
            {"data", {{"type", "text"}, {"path", std::string(BOOSTER_SOURCE_DIR) + "/README.md"}, {"context", 8},
                      {"tokenizer", scratch("corrupt.model").string()}}}};
  CHECK_THROWS_WITH(config::resolve(c), Contains("corrupt.model"));
}

namespace {

// Trains a small BPE model on the GPL (which Debian ships) with spm_train; empty when it is missing.
fs::path train_tokenizer() {
  const fs::path corpus = "/usr/share/common-licenses/GPL-3";
  if (std::system("command -v spm_train >/dev/null 2>&1") != 0 || !fs::exists(corpus)) return {};
  const fs::path prefix = scratch("spm");
  if (fs::exists(prefix.string() + ".model")) return prefix.string() + ".model";
  const std::string cmd = "spm_train --input=" + corpus.string() + " --model_prefix=" + prefix.string() +
                          " --vocab_size=300 --model_type=bpe >" + prefix.string() + ".log 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  return prefix.string() + ".model";
}

// Every id spm_encode prints for `text_file`, in order (with --extra_options=eos: each line's </s>).
std::vector<uint32_t> spm_encode_ids(const fs::path& model, const fs::path& text_file) {
  const fs::path out = scratch("spm_encode.txt");
  const std::string cmd = "spm_encode --model=" + model.string() + " --output_format=id --extra_options=eos <" +
                          text_file.string() + " >" + out.string();
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::ifstream in(out);
  std::vector<uint32_t> ids;
  uint32_t id = 0;
  while (in >> id) ids.push_back(id);
  return ids;
}

}  // namespace

TEST_CASE("tokenizer: encode_lines gives spm_encode's ids, and text data windows them", "[data][tokens][tokenizer]") {
  const fs::path model = train_tokenizer();
  if (!tokenizer_built()) {
    skip_test("this booster was built without SentencePiece (libsentencepiece-dev)");
    return;
  }
  if (model.empty()) {
    skip_test("spm_train (Debian's sentencepiece) or /usr/share/common-licenses/GPL-3 is missing");
    return;
  }
  if (std::system("command -v spm_encode >/dev/null 2>&1") != 0) {
    skip_test("spm_encode (Debian's sentencepiece) is missing");
    return;
  }
  const SentencePieceTokenizer tokenizer(model.string());
  CHECK(tokenizer.vocab_size() == 300);
  CHECK(tokenizer.eos_id() == 2);
  // Lines of every kind: blank, leading spaces, non-ASCII, no final newline.
  const std::string text = "Hello world.\n\n  indented line\nnon-ASCII: caf\xc3\xa9 \xe2\x82\xac 42\nlast line without newline";
  std::ofstream(scratch("sample.txt"), std::ios::binary) << text;
  const std::vector<uint32_t> ids = tokenizer.encode_lines(text);
  CHECK(ids == spm_encode_ids(model, scratch("sample.txt")));
  CHECK(std::count(ids.begin(), ids.end(), 2u) == 5);  // one </s> per line
  const std::vector<uint32_t> no_eos = tokenizer.encode_lines(text, /*eos=*/false);
  CHECK(no_eos.size() == ids.size() - 5);
  CHECK(tokenizer.decode(tokenizer.encode("Hello world.")) == "Hello world.");

  // The whole GPL, through text data with the tokenizer key: every window of the first 90% of its ids.
  const fs::path corpus = "/usr/share/common-licenses/GPL-3";
  const std::vector<uint32_t> reference = spm_encode_ids(model, corpus);
  json c = {{"model", {{"type", "gpt"}, {"vocab_size", 300}, {"context", 16}, {"width", 16}, {"layers", 1}, {"heads", 2}}},
            {"optimizer", {{"type", "adamw"}}},
            {"data", {{"type", "text"}, {"path", corpus.string()}, {"context", 8}, {"tokenizer", model.string()}}}};
  const json resolved = config::resolve(c);
  const config::DataSplits split =
      config::make_datasets(resolved["data"], 0, config::model_vocab_size(resolved["model"]));
  const int64_t n = int64_t(reference.size()), n_test = int64_t(double(n) * 0.1), n_train = n - n_test;
  REQUIRE(split.train->size() == n_train - 8);
  REQUIRE(split.test != nullptr);
  CHECK(split.test->size() == n_test - 8);
  CHECK(split.eval_stride == 8);
  CHECK(split.language_model);
  for (int64_t i : {int64_t(0), int64_t(1), n_train - 9}) {
    const Batch b = split.train->get(i);
    CHECK(b.x.to_vector<int64_t>() == slice(reference, i, 8));
    CHECK(b.y.to_vector<int64_t>() == slice(reference, i + 1, 8));
  }
  CHECK(split.test->get(0).x.to_vector<int64_t>() == slice(reference, n_train, 8));
  // A model whose vocabulary is smaller than the tokenizer's.
  c["model"]["vocab_size"] = 256;
  CHECK_THROWS_WITH(config::resolve(c), Contains("'model.vocab_size' is 256") && Contains("300 ids"));
  // A Hugging Face model's vocabulary is its config.json's: the fix named is the tokenizer, not a model key.
  c["model"] = {{"type", "hf"}, {"path", (fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "llama").string()}};
  CHECK_THROWS_WITH(config::resolve(c), Contains("has 48 ids but the tokenizer") && Contains("300 ids") &&
                                            Contains("the model's own tokenizer") && !Contains("'model.vocab_size'"));
}

// Byte text (no tokenizer) has ids up to 255: a Llama or Hugging Face model with fewer ids is refused
// when the config resolves (so `booster check` says so), not by the embedding at the first batch.
TEST_CASE("text data of bytes needs 256 ids of a gpt or llama or hf model", "[data][tokens][errors]") {
  const fs::path corpus = "/usr/share/common-licenses/GPL-3";
  json c = {{"model", {{"type", "llama"}, {"vocab_size", 96}, {"hidden_size", 16}, {"intermediate_size", 32},
                       {"num_hidden_layers", 1}, {"num_attention_heads", 2}}},
            {"optimizer", {{"type", "adamw"}}},
            {"data", {{"type", "text"}, {"path", corpus.string()}, {"context", 8}}}};
  CHECK_THROWS_AS(config::resolve(c), ConfigError);
  CHECK_THROWS_WITH(config::resolve(c), Contains("'model.vocab_size' is 96") && Contains("one token per byte"));
  c["model"] = {{"type", "hf"}, {"path", (fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "gpt2").string()}};
  CHECK_THROWS_AS(config::resolve(c), ConfigError);
  CHECK_THROWS_WITH(config::resolve(c), Contains("has 48 ids") && Contains("one token per byte") &&
                                            Contains("'data.tokenizer'") && !Contains("'model.vocab_size'"));
  c["model"] = {{"type", "llama"}, {"vocab_size", 256}, {"hidden_size", 16}, {"intermediate_size", 32},
                {"num_hidden_layers", 1}, {"num_attention_heads", 2}};
  if (fs::exists(corpus)) CHECK_NOTHROW(config::resolve(c));
}

// --------------------------------------------------------------------------- descriptions and dtypes
// Note [Token file descriptions]: a file read with the wrong dtype trains on nonsense without a word,
// so what the writer said, and failing that the bytes, are checked.

namespace {
// ids below 65536 in uint32: as uint16, each followed by a zero.
std::vector<uint32_t> small_ids(int64_t n) {
  std::vector<uint32_t> ids(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) ids[size_t(k)] = uint32_t((k * 7919 + 3) % 300);
  return ids;
}
}  // namespace

TEST_CASE("token file descriptions: a dtype mismatch either way is a ConfigError naming both and the fix",
          "[data][tokens][dtype]") {
  const fs::path wide = scratch("described32.bin"), narrow = scratch("described16.bin");
  write_token_file(wide.string(), small_ids(1001), TokenDType::UInt32,
                   {.vocab_size = 300, .tokenizer = "tok.model", .tokenizer_kind = "sentencepiece"});
  write_token_file(narrow.string(), small_ids(1001), TokenDType::UInt16, {.vocab_size = 300});
  // The description the writer put beside each.
  const json d = json::parse(testing::read_text(wide.string() + ".json"));
  CHECK(d["dtype"] == "uint32");
  CHECK(d["tokens"] == 1001);
  CHECK(d["vocab_size"] == 300);
  CHECK(d["tokenizer"]["path"] == "tok.model");
  CHECK(d["tokenizer"]["kind"] == "sentencepiece");
  REQUIRE(read_token_description(narrow.string()).has_value());
  CHECK(read_token_description(narrow.string())->dtype == TokenDType::UInt16);
  CHECK_FALSE(read_token_description(scratch("no_such_file.bin").string()).has_value());

  // uint32 tokens declared uint16 (the silent case: 4004 bytes are 2002 whole uint16).
  REQUIRE_THROWS_AS(token_file_dataset(wide.string(), TokenDType::UInt16, {.seq_len = 8}), ConfigError);
  CHECK_THROWS_WITH(token_file_dataset(wide.string(), TokenDType::UInt16, {.seq_len = 8}),
                    Contains(wide.string()) && Contains("holds uint32 tokens") && Contains(wide.string() + ".json") &&
                        Contains("data.dtype is \"uint16\"") && Contains("set data.dtype: \"uint32\""));
  // uint16 tokens declared uint32: 2002 bytes would not even be whole uint32, but the dtype is named.
  REQUIRE_THROWS_AS(token_file_dataset(narrow.string(), TokenDType::UInt32, {.seq_len = 8}), ConfigError);
  CHECK_THROWS_WITH(token_file_dataset(narrow.string(), TokenDType::UInt32, {.seq_len = 8}),
                    Contains("holds uint16 tokens") && Contains("data.dtype is \"uint32\"") &&
                        Contains("set data.dtype: \"uint16\""));
  // The right dtype reads the ids.
  auto ds = token_file_dataset(wide.string(), TokenDType::UInt32, {.seq_len = 8, .vocab_size = 300});
  CHECK(ds->source().size() == 1001);
  CHECK(ds->get(2).x.to_vector<int64_t>() == slice(small_ids(1001), 16, 8));
  CHECK(token_file_dataset(narrow.string(), TokenDType::UInt16, {.seq_len = 8})->source().size() == 1001);

  // Through a config, so `booster check` says it before training.
  json c = token_config(wide, wide);
  c["data"].erase("val_path");
  CHECK_THROWS_AS(config::resolve(c), ConfigError);
  CHECK_THROWS_WITH(config::resolve(c), Contains("set data.dtype: \"uint32\""));
  c["data"]["dtype"] = "uint32";
  CHECK_NOTHROW(config::resolve(c));

  SECTION("a description of another file (the file rewritten alone) is a DataError") {
    const fs::path stale = scratch("stale.bin");
    write_token_file(stale.string(), small_ids(500), TokenDType::UInt16);
    write_flat("stale.bin", small_ids(600), 2);  // another writer, the old description left
    CHECK_THROWS_AS(token_file_dataset(stale.string(), TokenDType::UInt16, {.seq_len = 8}), DataError);
    CHECK_THROWS_WITH(token_file_dataset(stale.string(), TokenDType::UInt16, {.seq_len = 8}),
                      Contains("1200 bytes") && Contains("says 500 uint16 tokens") && Contains("changed"));
  }
  SECTION("a description that is not one is a DataError naming it") {
    const fs::path bad = write_flat("bad_description.bin", small_ids(100), 2);
    std::ofstream(bad.string() + ".json") << "{\"dtype\": \"int8\"}";
    CHECK_THROWS_AS(token_file_dataset(bad.string(), TokenDType::UInt16, {.seq_len = 8}), DataError);
    CHECK_THROWS_WITH(token_file_dataset(bad.string(), TokenDType::UInt16, {.seq_len = 8}),
                      Contains(bad.string() + ".json") && Contains("\"int8\""));
    std::ofstream(bad.string() + ".json") << "not json";
    CHECK_THROWS_WITH(token_file_dataset(bad.string(), TokenDType::UInt16, {.seq_len = 8}),
                      Contains(bad.string() + ".json") && Contains("not a JSON object"));
  }
  SECTION("a tokenizer larger than the model's vocabulary is refused by its description") {
    // The ids themselves all fit (below 300): only the description tells that larger ones will come.
    CHECK_THROWS_AS(token_file_dataset(wide.string(), TokenDType::UInt32, {.seq_len = 8, .vocab_size = 299}),
                    ConfigError);
    CHECK_THROWS_WITH(token_file_dataset(wide.string(), TokenDType::UInt32, {.seq_len = 8, .vocab_size = 299}),
                      Contains("tok.model of 300 ids") && Contains("vocabulary of 299") && Contains("at least 300"));
    CHECK_NOTHROW(token_file_dataset(wide.string(), TokenDType::UInt32, {.seq_len = 8, .vocab_size = 300}));
    CHECK_NOTHROW(token_file_dataset(wide.string(), TokenDType::UInt32, {.seq_len = 8}));  // 0: not checked
  }
}

TEST_CASE("a headerless uint32 file read as uint16 is refused as looking like uint32, and uint16 files pass",
          "[data][tokens][dtype]") {
  auto open16 = [](const fs::path& p) { return token_file_dataset(p.string(), TokenDType::UInt16, {.seq_len = 8}); };
  const fs::path wide = write_flat("headerless32.bin", small_ids(1000), 4);
  REQUIRE_FALSE(fs::exists(wide.string() + ".json"));
  REQUIRE_THROWS_AS(open16(wide), ConfigError);
  CHECK_THROWS_WITH(open16(wide), Contains(wide.string()) && Contains("looks like uint32") &&
                                      Contains("set data.dtype: \"uint32\"") && Contains(wide.string() + ".json"));
  CHECK(token_file_dataset(wide.string(), TokenDType::UInt32, {.seq_len = 8})->source().size() == 1000);
  // Only the first kDtypeSample values are read: a file far longer is judged by them.
  const fs::path long_wide = write_flat("headerless32_long.bin", small_ids(3 * kDtypeSample), 4);
  CHECK_THROWS_WITH(open16(long_wide), Contains("looks like uint32") && Contains("of its first 65536"));

  // uint16 files the rule must not touch.
  std::vector<uint32_t> zeros_at_even(1000), mostly_zero(1000), all_zero(1000, 0), one_odd(1000);
  for (size_t k = 0; k < 1000; ++k) {
    zeros_at_even[k] = k % 2 ? uint32_t(k % 300 + 1) : 0;  // token 0 every other place, the other way round
    mostly_zero[k] = k % 97 == 0 ? uint32_t(k % 300 + 1) : 0;
    one_odd[k] = k % 2 ? 0 : uint32_t(k % 300 + 1);
  }
  one_odd[999] = 5;  // the uint32 pattern but for one odd-index value
  for (const auto& [name, ids] : {std::pair<std::string, std::vector<uint32_t>>{"zeros_at_even", zeros_at_even},
                                  {"mostly_zero", mostly_zero},
                                  {"all_zero", all_zero},
                                  {"one_odd", one_odd}}) {
    INFO(name);
    CHECK(open16(write_flat("legit16_" + name + ".bin", ids, 2))->source().size() == 1000);
  }
  // Too short a sample to judge: fewer than kDtypeSampleMin uint16 values.
  CHECK_NOTHROW(open16(write_flat("short32.bin", small_ids(kDtypeSampleMin / 2 - 2), 4)));
  // The pattern in a real uint16 file: a description saying so lets it through, as the message says.
  std::vector<uint32_t> alternating = one_odd;
  alternating[999] = 0;
  const fs::path really16 = write_flat("really16.bin", alternating, 2);
  CHECK_THROWS_AS(open16(really16), ConfigError);
  std::ofstream(really16.string() + ".json") << "{\"dtype\": \"uint16\"}";
  CHECK(open16(really16)->source().size() == 1000);
}

// --------------------------------------------------------------------------- shards and val_fraction
TEST_CASE("token shards: a list or a glob of files is one stream of tokens, samples spanning files",
          "[data][tokens][shards]") {
  const int64_t T = 6;
  const std::vector<uint32_t> ids = iota_ids(120);
  const fs::path dir = scratch("shards");
  fs::remove_all(dir);
  fs::create_directories(dir);
  // Three shards of 37, 33 and 50 tokens, written last-first so the glob's order is the names'.
  const std::vector<std::pair<int64_t, int64_t>> spans = {{0, 37}, {37, 33}, {70, 50}};
  std::vector<std::string> paths;
  for (int k = 2; k >= 0; --k) {
    const fs::path p = dir / ("shard_" + std::to_string(k) + ".bin");
    write_token_file(p.string(), std::vector<uint32_t>(ids.begin() + spans[size_t(k)].first,
                                                       ids.begin() + spans[size_t(k)].first + spans[size_t(k)].second),
                     TokenDType::UInt16);
  }
  for (int k = 0; k < 3; ++k) paths.push_back((dir / ("shard_" + std::to_string(k) + ".bin")).string());

  // The glob: sorted, the descriptions (shard_k.bin.json) left out.
  CHECK(token_file_paths({(dir / "shard_*").string()}) == paths);
  CHECK(token_file_paths({paths[2], (dir / "shard_[01].bin").string()}) ==
        std::vector<std::string>{paths[2], paths[0], paths[1]});
  REQUIRE_THROWS_AS(token_file_paths({(dir / "nothing_*.bin").string()}), ConfigError);
  CHECK_THROWS_WITH(token_file_paths({(dir / "nothing_*.bin").string()}),
                    Contains((dir / "nothing_*.bin").string()) && Contains("matches no file"));
  CHECK_THROWS_AS(token_file_paths({}), ConfigError);

  auto shards = token_files_dataset(paths, TokenDType::UInt16, {.seq_len = T});
  CHECK_FALSE(shards->source().in_memory());  // mapped, not read
  CHECK(shards->source().files() == paths);
  CHECK(shards->source().size() == 120);
  REQUIRE(shards->size() == (120 - 1) / T);
  for (int64_t i = 0; i < shards->size(); ++i) {
    INFO("sample " << i);  // samples 6 (36..42) and 11 (66..72) span two files
    const Batch b = shards->get(i);
    CHECK(b.x.to_vector<int64_t>() == slice(ids, i * T, T));
    CHECK(b.y.to_vector<int64_t>() == slice(ids, i * T + 1, T));
  }
  const Batch b = shards->get_batch({11, 6});
  CHECK(b.x.to_vector<int64_t>()[0] == 66);
  CHECK(b.y.to_vector<int64_t>()[T + T - 1] == 42);
  CHECK_THAT(shards->source().name(), Contains(paths[0]) && Contains(paths[2]));

  SECTION("an id past the vocabulary is named by its own file and offset") {
    std::vector<uint32_t> bad(40, 3);
    bad[25] = 999;
    const fs::path p = write_flat("shards/bad_shard.bin", bad, 2);
    auto open = [&](int64_t eager) {
      return token_files_dataset({paths[0], p.string()}, TokenDType::UInt16,
                                 {.seq_len = T, .vocab_size = 200, .eager_check_bytes = eager});
    };
    CHECK_THROWS_WITH(open(int64_t(64) << 20), Contains(p.string()) && Contains("token offset 25") &&
                                                   Contains("byte offset 50") && Contains("token id 999"));
    // Batch by batch: token 37 + 25 = 62 of the stream is the target of sample 10.
    auto lazy = open(0);
    CHECK_NOTHROW(lazy->get(9));
    CHECK_THROWS_WITH(lazy->get(10), Contains(p.string()) && Contains("token offset 25"));
  }
  SECTION("files of different dtypes are refused") {
    const fs::path shard = write_llmc("shards/llmc.bin", iota_ids(50));
    const fs::path wide = write_flat("shards/wide.bin", iota_ids(50), 4);
    std::ofstream(wide.string() + ".json") << "{\"dtype\": \"uint32\"}";
    CHECK_NOTHROW(token_files_dataset({shard.string(), paths[0]}, TokenDType::UInt16, {.seq_len = T}));
    CHECK_THROWS_AS(token_files_dataset({wide.string(), shard.string()}, TokenDType::UInt32, {.seq_len = T}), DataError);
    CHECK_THROWS_WITH(token_files_dataset({wide.string(), shard.string()}, TokenDType::UInt32, {.seq_len = T}),
                      Contains("llm.c shard") && Contains("share one dtype"));
  }
}

TEST_CASE("token data configs: path as a list or glob, val_fraction holds out the end of the last file",
          "[data][tokens][config][shards]") {
  const int64_t T = 8;
  std::vector<uint32_t> ids(500);
  for (size_t k = 0; k < ids.size(); ++k) ids[k] = uint32_t((k * 37) % 511);
  const fs::path dir = scratch("cfg_shards");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path a = dir / "part_a.bin", b = dir / "part_b.bin";
  write_token_file(a.string(), std::vector<uint32_t>(ids.begin(), ids.begin() + 300), TokenDType::UInt16);
  write_token_file(b.string(), std::vector<uint32_t>(ids.begin() + 300, ids.end()), TokenDType::UInt16);
  json c = token_config(a, a);
  c["data"].erase("val_path");

  for (const json& path : {json::array({a.string(), b.string()}), json((dir / "part_*.bin").string())}) {
    INFO(path.dump());
    c["data"]["path"] = path;
    c["data"]["val_fraction"] = 0.25;  // of the last file's 200 tokens: its last 50
    const json resolved = config::resolve(c);
    const config::DataSplits split = config::make_datasets(resolved["data"], 0, 512);
    REQUIRE(split.train->size() == (450 - 1) / T);
    REQUIRE(split.test != nullptr);
    REQUIRE(split.test->size() == (50 - 1) / T);
    // Training: tokens 0..449, across both files; validation: 450..499, b's tail.
    CHECK(split.train->get(37).x.to_vector<int64_t>() == slice(ids, 37 * T, T));  // spans a and b
    CHECK(split.train->get(split.train->size() - 1).y.to_vector<int64_t>() ==
          slice(ids, (split.train->size() - 1) * T + 1, T));
    for (int64_t i = 0; i < split.test->size(); ++i) {
      CHECK(split.test->get(i).x.to_vector<int64_t>() == slice(ids, 450 + i * T, T));
      CHECK(split.test->get(i).y.to_vector<int64_t>() == slice(ids, 450 + i * T + 1, T));
    }
    CHECK_THAT(split.description, Contains("val " + b.string() + ", its last 50 tokens"));
    // Without val_fraction every token trains.
    json whole = c;
    whole["data"].erase("val_fraction");
    const config::DataSplits all = config::make_datasets(config::resolve(whole)["data"], 0, 512);
    CHECK(all.train->size() == (500 - 1) / T);
    CHECK(all.test == nullptr);
  }

  // val_fraction with a val_path: which is the validation data?
  json both = c;
  both["data"]["val_path"] = a.string();
  CHECK_THROWS_AS(config::resolve(both), ConfigError);
  CHECK_THROWS_WITH(config::resolve(both), Contains("'data.val_fraction'") && Contains("'data.val_path'"));
  // Less than one validation sample.
  json tiny = c;
  tiny["data"]["val_fraction"] = 0.04;  // 8 of 200 tokens, a sample needs 9
  CHECK_THROWS_AS(config::resolve(tiny), ConfigError);
  CHECK_THROWS_WITH(config::resolve(tiny), Contains("'data.val_fraction' 0.04 of the 200 tokens of " + b.string()) &&
                                               Contains("is 8 tokens"));
  for (const json& f : {json(0.0), json(1.0), json(-0.5), json("0.1")}) {
    INFO(f.dump());
    json bad = c;
    bad["data"]["val_fraction"] = f;
    CHECK_THROWS_WITH(config::resolve(bad), Contains("'data.val_fraction'"));
  }
  // A path of the wrong form, a glob matching nothing, a missing file of a list.
  for (const json& p : {json(5), json::array(), json::array({a.string(), 3}), json("")}) {
    INFO(p.dump());
    json bad = c;
    bad["data"]["path"] = p;
    CHECK_THROWS_AS(config::resolve(bad), ConfigError);
    CHECK_THROWS_WITH(config::resolve(bad), Contains("'data.path'"));
  }
  json nomatch = c;
  nomatch["data"]["path"] = (dir / "shard_*.bin").string();
  CHECK_THROWS_AS(config::resolve(nomatch), ConfigError);
  CHECK_THROWS_WITH(config::resolve(nomatch), Contains((dir / "shard_*.bin").string()) && Contains("matches no file"));
  json missing = c;
  missing["data"]["path"] = json::array({a.string(), (dir / "absent.bin").string()});
  CHECK_THROWS_AS(config::resolve(missing), DataError);
  CHECK_THROWS_WITH(config::resolve(missing), Contains("absent.bin"));
}
