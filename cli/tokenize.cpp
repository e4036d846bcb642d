// `booster tokenize`: text files to token files with a SentencePiece model or a Hugging Face
// tokenizer.json (byte-level BPE), for data.type "tokens".
//
//   booster tokenize --model tok.model --in corpus.txt [more.txt ...] --out train.bin [--val-fraction 0.05]
//                    [--val-out val.bin] [--dtype uint16|uint32] [--no-eos]
//
// The text is encoded line by line with each line's end marked by the model's </s> (Note [Encoding a
// text] in booster/data/tokenizer.h). Several --in files (repeated, or several after one --in) are
// encoded each as that one file would be and their ids concatenated in the order given: with </s> a
// file's last line ends with one whether or not the file ends with a newline, so files never run into
// each other; with --no-eos nothing separates them, as nothing separates lines. With --val-fraction F
// the last F of the ids go to the validation file: --val-out, by default OUT with its extension replaced
// by ".val.bin" (train.bin -> train.val.bin), and the rest to OUT. Files are flat token ids (nanoGPT's
// .bin, Note [Token files]), uint16 when the vocabulary fits (at most 65536 ids), else uint32, each with
// its description beside it (OUT.json: the dtype, the number of tokens, the vocabulary and the
// tokenizer; Note [Token file descriptions]), which token data checks. What was written goes to stderr
// as a sentence and to stdout as one line of JSON: {"train": {"path", "tokens"}, "val": {...} | null,
// "dtype", "vocab_size", "model", "inputs"}. An output (or its description) that is an --in text, the
// --model tokenizer or the other output (however the path is spelled) is refused before anything is
// written. The texts and their ids are held in memory, so the --in texts may total at most
// kMaxTokenizeTextBytes (1 GiB): regular files past it, or a device (/dev/zero would never end), are
// refused before anything is read; a pipe (--in <(zcat corpus.gz)) is read as it comes and refused once
// past the limit, or when nothing arrives for 10 s (a FIFO nobody writes to; Note [Inputs that are not
// files]).
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "booster/checkpoint/atomic_file.h"
#include "booster/common/error.h"
#include "booster/common/input_file.h"
#include "booster/data/tokenizer.h"
#include "booster/data/tokens.h"
#include "commands.h"
#include "options.h"

namespace po = boost::program_options;

namespace booster::cli {
namespace {

// The most text one `booster tokenize` reads: the text, its ids (4 bytes per token) and the output
// buffers are in memory at once, a few GiB at this size. A larger corpus is tokenized in parts.
constexpr uint64_t kMaxTokenizeTextBytes = uint64_t(1) << 30;
constexpr const char* kTokenizeTextFix =
    "give --in text files (or pipes) of at most 1.0 GiB in all (tokenize a larger corpus in parts)";

// train.bin -> train.val.bin, beside it.
std::string default_val_path(const std::string& out) {
  const std::filesystem::path p(out);
  return (p.parent_path() / (p.stem().string() + ".val.bin")).string();
}

// Whether paths a and b name one file, however spelled (./x.bin, a link); a file yet to be written
// compares by its absolute, normalized path.
bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (std::filesystem::equivalent(a, b, ec)) return true;
  const auto canonical_a = std::filesystem::weakly_canonical(std::filesystem::absolute(a), ec);
  if (ec) return a == b;
  const auto canonical_b = std::filesystem::weakly_canonical(std::filesystem::absolute(b), ec);
  return ec ? a == b : canonical_a == canonical_b;
}

}  // namespace

int tokenize(const std::vector<std::string>& args) {
  po::options_description desc(
      "usage: booster tokenize --model tok.model --in text.txt [more.txt ...] --out train.bin [--val-fraction F]\n\n"
      "Encodes text files with a SentencePiece model into token files for data.type \"tokens\" (flat\n"
      "token ids, nanoGPT's .bin, and OUT.json describing them); each line is followed by the model's </s>;\n"
      "several inputs are concatenated in order.\n\noptions");
  desc.add_options()
      ("help,h", "show this help")
      ("model,m", po::value<std::string>()->value_name("FILE"),
       "the SentencePiece .model (spm_train writes one) or a Hugging Face tokenizer.json")
      ("in,i", po::value<std::vector<std::string>>()->multitoken()->value_name("FILE..."),
       "the text to encode; several files (repeated --in, or several after it) are concatenated in order")
      ("out,o", po::value<std::string>()->value_name("FILE"), "the training token file to write")
      ("val-fraction", po::value<double>()->default_value(0.0)->value_name("F"),
       "the last F of the tokens go to a validation file (0 <= F < 1)")
      ("val-out", po::value<std::string>()->value_name("FILE"),
       "the validation file (default: OUT with the extension .val.bin)")
      ("dtype", po::value<std::string>()->value_name("uint16|uint32"),
       "the token type (default: uint16 when the vocabulary has at most 65536 ids, else uint32)")
      ("no-eos", "do not mark line ends with </s>");
  po::variables_map vm;
  if (!parse_options("tokenize", desc, args, vm, {"model", "in", "out"})) return kExitOk;
  const std::string model = vm["model"].as<std::string>(), out = vm["out"].as<std::string>();
  const std::vector<std::string> inputs = vm["in"].as<std::vector<std::string>>();
  const double val_fraction = vm["val-fraction"].as<double>();
  BOOSTER_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, ConfigError, "--val-fraction ", val_fraction,
                ": expected a fraction in [0, 1)");
  BOOSTER_CHECK(!vm.count("val-out") || val_fraction > 0.0, ConfigError,
                "--val-out is given but --val-fraction is 0; give a fraction for the validation file");
  const std::string val_out = vm.count("val-out") ? vm["val-out"].as<std::string>() : default_val_path(out);
  BOOSTER_CHECK(val_fraction == 0.0 || !same_file(val_out, out), ConfigError, "--val-out ", val_out,
                " is the same file as --out; give another");
  // An output that is one of the inputs would be overwritten: the text or the tokenizer lost. So would
  // an input that is an output's description (OUT.json), and the other output by one's description.
  std::vector<std::pair<std::string, std::string>> writes = {{"--out", out},
                                                             {"--out's description", data::token_description_path(out)}};
  if (val_fraction > 0.0) {
    writes.push_back({"--val-out", val_out});
    writes.push_back({"--val-out's description", data::token_description_path(val_out)});
    BOOSTER_CHECK(!same_file(data::token_description_path(out), val_out) &&
                      !same_file(data::token_description_path(val_out), out),
                  ConfigError, "--val-out ", val_out, " and --out ", out,
                  " would overwrite each other's description (FILE.json); give other names");
  }
  for (const auto& [flag, path] : writes) {
    // Note [Outputs that are not files] (checkpoint/atomic_file.h): a FIFO or device node at an output,
    // or at the temporary file renamed over it, is refused before anything is read or written.
    checkpoint::refuse_non_regular_output(path, flag);
    checkpoint::refuse_non_regular_output(path + ".tmp", flag + "'s temporary file");
    for (const std::string& in : inputs)
      BOOSTER_CHECK(!same_file(path, in), ConfigError, flag, " ", path, " is the --in text ", in,
                    "; writing it would overwrite the text; give another file (e.g. train.bin)");
    BOOSTER_CHECK(!same_file(path, model), ConfigError, flag, " ", path, " is the --model tokenizer ", model,
                  "; writing it would overwrite the tokenizer; give another file (e.g. train.bin)");
  }

  const std::unique_ptr<data::Tokenizer> opened = data::open_tokenizer(model);
  const data::Tokenizer& tokenizer = *opened;
  data::TokenDType dtype = tokenizer.vocab_size() <= 65536 ? data::TokenDType::UInt16 : data::TokenDType::UInt32;
  if (vm.count("dtype")) {
    dtype = data::token_dtype_from_string(vm["dtype"].as<std::string>());
    BOOSTER_CHECK(dtype == data::TokenDType::UInt32 || tokenizer.vocab_size() <= 65536, ConfigError,
                  "--dtype uint16 cannot hold the ", tokenizer.vocab_size(), " ids of ", model, "; use --dtype uint32");
  }

  // Every input opens before any is encoded, so a typo in the last one costs no time; a device or
  // regular files beyond the limit are refused here too (Note [Inputs that are not files]).
  uint64_t total_bytes = 0;
  for (const std::string& in : inputs) {
    BOOSTER_CHECK(std::filesystem::exists(in), DataError, "booster tokenize: cannot open --in ", in, ": ",
                  std::strerror(ENOENT));
    std::error_code ec;
    if (std::filesystem::is_fifo(in, ec)) continue;  // a pipe is counted as it is read
    total_bytes += open_input_file<DataError>(in, "booster tokenize: --in", kTokenizeTextFix, kMaxTokenizeTextBytes).size();
    BOOSTER_CHECK(total_bytes <= kMaxTokenizeTextBytes, DataError, "booster tokenize: the --in texts total ",
                  format_input_size(total_bytes), " by ", in, ", more than the limit of ",
                  format_input_size(kMaxTokenizeTextBytes), "; ", kTokenizeTextFix);
  }

  std::vector<uint32_t> ids;
  uint64_t read_bytes = 0;
  for (const std::string& in : inputs) {
    const std::string text = read_input_text<DataError>(in, "booster tokenize: --in", kTokenizeTextFix,
                                                        kMaxTokenizeTextBytes - read_bytes);
    read_bytes += text.size();
    const std::vector<uint32_t> file_ids = tokenizer.encode_lines(text, /*eos=*/!vm.count("no-eos"));
    ids.insert(ids.end(), file_ids.begin(), file_ids.end());
  }
  std::string in;  // the inputs, for messages
  for (size_t k = 0; k < inputs.size(); ++k) in += (k ? ", " : "") + inputs[k];
  BOOSTER_CHECK(!ids.empty(), DataError, "booster tokenize: ", in, " gave no tokens (",
                inputs.size() == 1 ? "an empty file?" : "empty files?", ")");

  const size_t n_val = size_t(double(ids.size()) * val_fraction);
  BOOSTER_CHECK(val_fraction == 0.0 || n_val > 0, DataError, "booster tokenize: --val-fraction ", val_fraction, " of the ",
                ids.size(), " tokens of ", in, " is less than one token; give a larger fraction or a longer text");
  std::vector<uint32_t> val(ids.end() - std::ptrdiff_t(n_val), ids.end());
  ids.resize(ids.size() - n_val);
  const data::TokenFileDescription about{
      .vocab_size = tokenizer.vocab_size(), .tokenizer = model,
      .tokenizer_kind = std::filesystem::path(model).extension() == ".json" ? "byte_level_bpe" : "sentencepiece"};
  data::write_token_file(out, ids, dtype, about);
  if (n_val > 0) data::write_token_file(val_out, val, dtype, about);

  std::cerr << "booster: wrote " << out << " (" << ids.size() << " " << data::to_string(dtype) << " tokens)";
  if (n_val > 0) std::cerr << " and " << val_out << " (" << n_val << " tokens)";
  std::cerr << " from " << in << " with " << model << " (vocabulary " << tokenizer.vocab_size() << ")\n";
  nlohmann::json summary = {{"train", {{"path", out}, {"tokens", ids.size()}}},
                            {"val", n_val > 0 ? nlohmann::json{{"path", val_out}, {"tokens", n_val}} : nlohmann::json()},
                            {"dtype", data::to_string(dtype)},
                            {"vocab_size", tokenizer.vocab_size()},
                            {"model", model},
                            {"inputs", inputs}};
  std::cout << summary.dump() << std::endl;
  return kExitOk;
}

}  // namespace booster::cli
