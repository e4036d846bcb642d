// ByteLevelBPETokenizer (bpe_tokenizer.h): reading tokenizer.json, the NFC normalizer (Note [NFC]), the
// split patterns' scanner (Note [Split patterns]), GPT-2's byte-to-unicode map and merges by rank;
// open_tokenizer (tokenizer.h).
#include "booster/data/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"
#include "booster/common/json_text.h"
#include "booster/data/dataset.h"
#include "booster/data/unicode_tables_impl.h"

namespace booster::data {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// ------------------------------------------------------------------------------------------ reading

// tokenizer.json and tokenizer_config.json through the one JSON reader (Note [One JSON reader] in
// booster/common/json_text.h): the config's depth, but 256 MB, where the config stops at 16 MB: a
// released model's tokenizer.json is 2 to 35 MB (Llama 3's 9 MB, Gemma 3's 33 MB), its vocabulary and
// merges arrays of hundreds of thousands of items, and its tokens any characters (NUL and newlines
// included), all of which a config would refuse.
JsonLimits tokenizer_json_limits() {
  return data_limits(size_t(256) << 20, "a Hugging Face tokenizer file's limit");
}

json read_tokenizer_json(const fs::path& file, const std::string& what) {
  try {
    return booster::read_json_file(file.string(), what, tokenizer_json_limits());
  } catch (const ConfigError& e) {
    throw DataError(e.what());
  }
}

// ------------------------------------------------------------------------------------------ code points

// A byte that does not start a valid UTF-8 sequence decodes to this, one byte long, in the class of
// punctuation: the byte-level model still encodes it, so decode(encode(x)) == x for any bytes.
constexpr char32_t kInvalid = 0xFFFFFFFF;

struct CodePoints {
  std::vector<char32_t> cp;
  std::vector<size_t> offset;  // byte offset of each code point, and the text's size last
};

CodePoints decode_utf8(std::string_view s) {
  CodePoints out;
  out.cp.reserve(s.size());
  out.offset.reserve(s.size() + 1);
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = uint8_t(s[i]);
    int len = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xE ? 3 : (b0 >> 3) == 0x1E ? 4 : 0;
    char32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1F) : len == 3 ? (b0 & 0x0F) : (b0 & 0x07);
    bool ok = len > 0 && i + size_t(len) <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      const auto b = uint8_t(s[i + size_t(k)]);
      ok = (b & 0xC0) == 0x80;
      cp = (cp << 6) | (b & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are not valid UTF-8 either.
    if (ok) ok = !(len == 2 && cp < 0x80) && !(len == 3 && cp < 0x800) && !(len == 4 && cp < 0x10000) &&
                 !(cp >= 0xD800 && cp <= 0xDFFF) && cp <= 0x10FFFF;
    out.offset.push_back(i);
    if (ok) {
      out.cp.push_back(cp);
      i += size_t(len);
    } else {
      out.cp.push_back(kInvalid);
      i += 1;
    }
  }
  out.offset.push_back(s.size());
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

template <size_t N>
bool in_table(const unicode::CodePointRange (&table)[N], char32_t cp) {
  if (cp > 0x10FFFF) return false;
  const auto* it = std::upper_bound(std::begin(table), std::end(table), uint32_t(cp),
                                    [](uint32_t v, const unicode::CodePointRange& r) { return v < r.first; });
  return it != std::begin(table) && uint32_t(cp) <= (it - 1)->last;
}

bool is_letter(char32_t cp) {
  if (cp < 0x80) return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z');
  return in_table(unicode::kLetters, cp);
}
bool is_number(char32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return in_table(unicode::kNumbers, cp);
}
// Unicode's White_Space property, what \s matches in Oniguruma's Unicode mode.
bool is_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}
bool is_newline(char32_t cp) { return cp == '\r' || cp == '\n'; }
bool is_other(char32_t cp) { return !is_space(cp) && !is_letter(cp) && !is_number(cp); }  // [^\s\p{L}\p{N}]

// --------------------------------------------------------------------------------------------- NFC

// Note [NFC]
// ~~~~~~~~~~
// Qwen2's normalizer: Unicode's canonical composition (UAX #15): every code point decomposed canonically
// (Hangul syllables by formula), marks put in the order of their combining classes, then each mark
// composed with the starter before it unless blocked (a mark of the same or a higher class, or a
// starter, between them) and the pair is not excluded from composition. Tables from
// make_unicode_tables.py. A byte that is not UTF-8 stays as it is, a starter that composes with nothing.

constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;
constexpr char32_t kRawByte = 0x110000;  // kRawByte + b: the byte b, not UTF-8

uint8_t combining_class(char32_t cp) {
  const auto& t = unicode::kCombiningClasses;
  const auto* it = std::upper_bound(std::begin(t), std::end(t), uint32_t(cp),
                                    [](uint32_t v, const unicode::CombiningClassRange& r) { return v < r.first; });
  return it != std::begin(t) && uint32_t(cp) <= (it - 1)->last ? (it - 1)->ccc : 0;
}

const unicode::Decomposition* find_decomposition(char32_t cp) {
  const auto& t = unicode::kDecompositions;
  const auto* it = std::lower_bound(std::begin(t), std::end(t), uint32_t(cp),
                                    [](const unicode::Decomposition& d, uint32_t v) { return d.cp < v; });
  return it != std::end(t) && it->cp == uint32_t(cp) ? it : nullptr;
}

void decompose(char32_t cp, std::u32string& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (const unicode::Decomposition* d = find_decomposition(cp)) {
    decompose(d->first, out);
    if (d->second != 0) decompose(d->second, out);
    return;
  }
  out.push_back(cp);
}

const std::unordered_map<uint64_t, char32_t>& compositions() {
  static const std::unordered_map<uint64_t, char32_t> map = [] {
    std::unordered_map<uint64_t, char32_t> m;
    for (const unicode::Decomposition& d : unicode::kDecompositions)
      if (d.composes) m.emplace((uint64_t(d.first) << 32) | d.second, d.cp);
    return m;
  }();
  return map;
}

// The composite of a starter and the next code point, 0 when they do not compose.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  const auto it = compositions().find((uint64_t(a) << 32) | b);
  return it == compositions().end() ? 0 : it->second;
}

// Note [NFC].
std::string nfc(std::string_view text) {
  // Below U+0300 nothing decomposes or composes: most text is returned as it is.
  bool simple = true;
  for (char ch : text)
    if (uint8_t(ch) >= 0xCC) {
      simple = false;
      break;
    }
  if (simple) return std::string(text);
  std::u32string d;
  d.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const CodePoints one = decode_utf8(text.substr(i, std::min<size_t>(4, text.size() - i)));
    if (one.cp[0] == kInvalid) {
      d.push_back(kRawByte + uint8_t(text[i]));
      i += 1;
    } else {
      decompose(one.cp[0], d);
      i += one.offset[1];
    }
  }
  // Canonical order: each run of marks stably sorted by class.
  for (size_t i = 0; i < d.size();) {
    if (d[i] >= kRawByte || combining_class(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && d[j] < kRawByte && combining_class(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + ptrdiff_t(i), d.begin() + ptrdiff_t(j),
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  std::u32string r;
  r.reserve(d.size());
  ptrdiff_t starter = -1;
  int last_class = 0;
  for (char32_t c : d) {
    const int cc = c >= kRawByte ? 0 : combining_class(c);
    if (starter >= 0 && c < kRawByte && r[size_t(starter)] < kRawByte) {
      const bool adjacent = size_t(starter) + 1 == r.size();
      const bool blocked = !adjacent && (last_class == 0 || last_class >= cc);
      if (!blocked)
        if (const char32_t composite = compose(r[size_t(starter)], c)) {
          r[size_t(starter)] = composite;
          continue;
        }
    }
    if (cc == 0) starter = ptrdiff_t(r.size());
    last_class = cc;
    r.push_back(c);
  }
  std::string out;
  out.reserve(text.size());
  for (char32_t c : r) {
    if (c >= kRawByte) out.push_back(char(c - kRawByte));
    else append_utf8(out, c);
  }
  return out;
}

// ------------------------------------------------------------------------------------- split patterns

enum class Pattern { GPT2, Llama3, Qwen2 };

const char* const kGPT2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// 's 't 're 've 'm 'll 'd at i: the end, or i when none. Case-insensitive as (?i:...) is, where 's'
// also matches U+017F LATIN SMALL LETTER LONG S (its case folding is 's').
size_t match_contraction(const std::vector<char32_t>& c, size_t i, bool ignore_case) {
  const size_t n = c.size();
  if (c[i] != '\'' || i + 1 >= n) return i;
  auto is = [&](size_t k, char lower) {
    if (k >= n) return false;
    if (c[k] == char32_t(lower)) return true;
    if (!ignore_case) return false;
    return c[k] == char32_t(lower - 'a' + 'A') || (lower == 's' && c[k] == 0x017F);
  };
  for (const char* suffix : {"s", "t", "re", "ve", "m", "ll", "d"}) {
    size_t k = i + 1;
    const char* p = suffix;
    while (*p && is(k, *p)) ++k, ++p;
    if (!*p) return k;
  }
  return i;
}

// ` ?X+` at i: an optional space, then one or more of class X (no space taken when X does not follow).
template <class Class>
size_t match_space_run(const std::vector<char32_t>& c, size_t i, Class in_class) {
  size_t j = i;
  if (c[j] == ' ' && j + 1 < c.size() && in_class(c[j + 1])) ++j;
  if (!in_class(c[j])) return i;
  while (j < c.size() && in_class(c[j])) ++j;
  return j;
}

size_t space_run_end(const std::vector<char32_t>& c, size_t i) {
  size_t j = i;
  while (j < c.size() && is_space(c[j])) ++j;
  return j;
}

// `\s+(?!\S)|\s+` at i: a run of white space, less its last character when a non-space follows it and
// the run is longer than one (the lookahead backtracks one character: the space then goes with the word).
size_t match_trailing_space(const std::vector<char32_t>& c, size_t i) {
  const size_t j = space_run_end(c, i);
  if (j == i) return i;
  if (j == c.size() || j - 1 == i) return j;  // \s+(?!\S), or \s+ for a single space before a non-space
  return j - 1;
}

// The end of the pattern's match at code point i (i < size), i when it has none there.
size_t match_at(const std::vector<char32_t>& c, size_t i, Pattern p) {
  if (p == Pattern::GPT2) {
    size_t j = match_contraction(c, i, false);
    if (j > i) return j;
    if ((j = match_space_run(c, i, is_letter)) > i) return j;
    if ((j = match_space_run(c, i, is_number)) > i) return j;
    if ((j = match_space_run(c, i, is_other)) > i) return j;
    return match_trailing_space(c, i);
  }
  const size_t n = c.size();
  size_t j = match_contraction(c, i, true);
  if (j > i) return j;
  // [^\r\n\p{L}\p{N}]?\p{L}+
  j = i;
  if (!is_newline(c[j]) && !is_letter(c[j]) && !is_number(c[j]) && j + 1 < n && is_letter(c[j + 1])) ++j;
  if (is_letter(c[j])) {
    while (j < n && is_letter(c[j])) ++j;
    return j;
  }
  // \p{N}{1,3} (Llama 3), \p{N} (Qwen2)
  if (is_number(c[i])) {
    const size_t most = p == Pattern::Llama3 ? 3 : 1;
    j = i;
    while (j < n && j - i < most && is_number(c[j])) ++j;
    return j;
  }
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  if ((j = match_space_run(c, i, is_other)) > i) {
    while (j < n && is_newline(c[j])) ++j;
    return j;
  }
  // `\s*[\r\n]+`: \s* backtracks to the run's last line break, which [\r\n]+ then takes.
  const size_t run = space_run_end(c, i);
  for (size_t k = run; k > i; --k)
    if (is_newline(c[k - 1])) return k;
  return match_trailing_space(c, i);
}

// Splits [begin, end) of c into the pattern's matches and the stretches between them ("Isolated").
void split_isolated(const std::vector<char32_t>& c, size_t begin, size_t end, Pattern p,
                    std::vector<std::pair<size_t, size_t>>& out) {
  // The scanner sees the piece alone, as a regex run on the piece would: a sub-vector.
  const std::vector<char32_t> piece(c.begin() + ptrdiff_t(begin), c.begin() + ptrdiff_t(end));
  size_t gap = 0, i = 0;
  while (i < piece.size()) {
    const size_t j = match_at(piece, i, p);
    if (j == i) {
      ++i;
      continue;
    }
    if (gap < i) out.push_back({begin + gap, begin + i});
    out.push_back({begin + i, begin + j});
    i = gap = j;
  }
  if (gap < piece.size()) out.push_back({begin + gap, end});
}

// ------------------------------------------------------------------------------------------ byte map

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes for
// U+0100.. in byte order, so every byte is one printable character of a token string.
std::array<char32_t, 256> byte_to_char_map() {
  std::array<char32_t, 256> m{};
  char32_t next = 0x100;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    m[size_t(b)] = printable ? char32_t(b) : next++;
  }
  return m;
}

std::string describe(const json& j) {
  std::string s = j.dump();
  return s.size() > 120 ? s.substr(0, 117) + "..." : s;
}

}  // namespace

// ----------------------------------------------------------------------------------------- the model

struct AddedToken {
  std::string content;
  int id = 0;
};

struct ByteLevelBPETokenizer::Impl {
  std::string path;
  std::unordered_map<std::string, int> vocab;
  std::vector<std::string> id_to_token;  // by id; empty where no token has the id
  std::vector<char> id_is_added;
  std::vector<AddedToken> added;
  std::array<std::vector<size_t>, 256> added_by_first_byte;  // indices into `added`, longest first
  std::unordered_map<uint64_t, std::pair<int, int>> merges;  // (left id, right id) -> (rank, merged id)
  std::array<int, 256> byte_id{};
  std::array<char32_t, 256> byte_to_char{};
  std::unordered_map<char32_t, uint8_t> char_to_byte;
  std::vector<Pattern> splits;  // applied in order, each to the pieces of the one before
  bool ignore_merges = false;
  bool normalize_nfc = false;  // Note [NFC]
  int64_t eos = -1, bos = -1;

  [[noreturn]] void refuse(const std::string& field, const json& value, const std::string& why) const {
    throw ConfigError(path + ": " + field + " " + describe(value) + " " + why);
  }

  int id_of(const std::string& token) const {
    for (const AddedToken& a : added)
      if (a.content == token) return a.id;
    const auto it = vocab.find(token);
    return it == vocab.end() ? -1 : it->second;
  }

  void read_pre_tokenizer(const json& pt, const std::string& field, bool last) {
    BOOSTER_CHECK(pt.is_object() && pt.contains("type") && pt.at("type").is_string(), ConfigError, path, ": ",
                  field, " ", describe(pt), " is not a pre-tokenizer (an object with a \"type\")");
    const std::string type = pt.at("type").get<std::string>();
    if (type == "Sequence") {
      const json& list = pt.value("pretokenizers", json());
      if (!list.is_array() || list.empty()) refuse(field + ".pretokenizers", list, "must be a non-empty list");
      for (size_t k = 0; k < list.size(); ++k)
        read_pre_tokenizer(list[k], field + ".pretokenizers[" + std::to_string(k) + "]", last && k + 1 == list.size());
      return;
    }
    if (type == "ByteLevel") {
      if (pt.value("add_prefix_space", false))
        refuse(field + ".add_prefix_space", pt.at("add_prefix_space"),
               "is not supported (GPT-2, Llama 3 and Qwen2 write false); a space before the text would change the ids");
      if (!last) refuse(field, pt, "must come last in the pre-tokenizer sequence, as byte-level BPE writes it");
      if (pt.value("use_regex", true)) splits.push_back(Pattern::GPT2);
      saw_byte_level = true;
      return;
    }
    if (type == "Split") {
      const json& pattern = pt.value("pattern", json());
      if (!pattern.is_object() || !pattern.contains("Regex") || !pattern.at("Regex").is_string())
        refuse(field + ".pattern", pattern, "is not supported: only a {\"Regex\": ...} pattern is");
      const std::string regex = pattern.at("Regex").get<std::string>();
      Pattern p;
      if (regex == kGPT2Pattern) p = Pattern::GPT2;
      else if (regex == kLlama3Pattern) p = Pattern::Llama3;
      else if (regex == kQwen2Pattern) p = Pattern::Qwen2;
      else refuse(field + ".pattern.Regex", pattern.at("Regex"),
                  "is not a split pattern this tokenizer knows (it runs GPT-2's, Llama 3's and Qwen2's exactly)");
      if (pt.value("behavior", std::string()) != "Isolated")
        refuse(field + ".behavior", pt.value("behavior", json()), "is not supported: only \"Isolated\" is");
      if (pt.value("invert", false)) refuse(field + ".invert", pt.at("invert"), "is not supported: only false is");
      splits.push_back(p);
      return;
    }
    refuse(field + ".type", pt.at("type"),
           "is a pre-tokenizer this tokenizer does not apply (it takes ByteLevel, and Split by a known pattern "
           "followed by ByteLevel)");
  }
  bool saw_byte_level = false;

  void read(const json& j) {
    BOOSTER_CHECK(j.is_object() && j.contains("model") && j.at("model").is_object(), ConfigError, path,
                  " has no \"model\" object; is it a Hugging Face tokenizer.json?");
    const json& model = j.at("model");
    if (model.value("type", std::string("BPE")) != "BPE")
      refuse("model.type", model.at("type"), "is not supported: only byte-level \"BPE\" is (GPT-2, Llama 3, Qwen2)");
    if (!model.value("dropout", json()).is_null() && model.at("dropout").get<double>() != 0.0)
      refuse("model.dropout", model.at("dropout"), "is not supported: BPE dropout makes encoding random; use null");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && !model.at(key).is_null() && model.at(key) != json(""))
        refuse(std::string("model.") + key, model.at(key), "is not supported by byte-level BPE; use null");
    if (model.value("byte_fallback", false))
      refuse("model.byte_fallback", model.at("byte_fallback"),
             "is not supported (a SentencePiece-style BPE); use false");
    ignore_merges = model.value("ignore_merges", false);

    const json& normalizer = j.value("normalizer", json());
    if (normalizer.is_object() && normalizer.value("type", std::string()) == "NFC")
      normalize_nfc = true;  // Qwen2's
    else if (!normalizer.is_null())
      refuse("normalizer", normalizer, "is not applied by this tokenizer; it applies none (null) and NFC only");
    read_pre_tokenizer(j.value("pre_tokenizer", json()), "pre_tokenizer", true);
    if (!saw_byte_level) refuse("pre_tokenizer", j.value("pre_tokenizer", json()), "has no ByteLevel step");
    const json& decoder = j.value("decoder", json());
    if (!decoder.is_object() || decoder.value("type", std::string()) != "ByteLevel")
      refuse("decoder", decoder, "is not supported: a byte-level BPE decodes with {\"type\": \"ByteLevel\"}");

    // The vocabulary.
    const json& v = model.value("vocab", json());
    if (!v.is_object() || v.empty()) refuse("model.vocab", v, "must be an object of token -> id");
    int max_id = -1;
    for (const auto& [token, id] : v.items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int>::max())
        refuse("model.vocab[\"" + token + "\"]", id, "is not an id (an integer >= 0)");
      vocab[token] = id.get<int>();
      max_id = std::max(max_id, id.get<int>());
    }
    const json& at = j.value("added_tokens", json::array());
    if (!at.is_array()) refuse("added_tokens", at, "must be a list");
    for (size_t k = 0; k < at.size(); ++k) {
      const std::string field = "added_tokens[" + std::to_string(k) + "]";
      const json& a = at[k];
      if (!a.is_object() || !a.contains("content") || !a.at("content").is_string() || a.at("content") == json("") ||
          !a.contains("id") || !a.at("id").is_number_integer() || a.at("id").get<int64_t>() < 0 ||
          a.at("id").get<int64_t>() > std::numeric_limits<int>::max())
        refuse(field, a, "is not an added token (an object with a non-empty \"content\" and an \"id\" >= 0)");
      for (const char* flag : {"lstrip", "rstrip", "single_word"})
        if (a.value(flag, false))
          refuse(field + "." + flag, a.at(flag), "is not supported: only added tokens matched as they are (false) are");
      added.push_back({a.at("content").get<std::string>(), a.at("id").get<int>()});
      max_id = std::max(max_id, added.back().id);
    }
    id_to_token.assign(size_t(max_id) + 1, std::string());
    id_is_added.assign(size_t(max_id) + 1, 0);
    for (const auto& [token, id] : vocab) id_to_token[size_t(id)] = token;
    for (size_t k = 0; k < added.size(); ++k) {
      id_to_token[size_t(added[k].id)] = added[k].content;
      id_is_added[size_t(added[k].id)] = 1;
      added_by_first_byte[uint8_t(added[k].content[0])].push_back(k);
    }
    for (auto& list : added_by_first_byte)
      std::stable_sort(list.begin(), list.end(),
                       [&](size_t a, size_t b) { return added[a].content.size() > added[b].content.size(); });

    // The byte characters, each a token.
    byte_to_char = byte_to_char_map();
    for (int b = 0; b < 256; ++b) {
      char_to_byte[byte_to_char[size_t(b)]] = uint8_t(b);
      std::string s;
      append_utf8(s, byte_to_char[size_t(b)]);
      const auto it = vocab.find(s);
      if (it == vocab.end()) {
        std::ostringstream hex;
        hex << "0x" << std::hex << b;
        refuse("model.vocab", json("(" + std::to_string(vocab.size()) + " tokens)"),
               "has no token \"" + s + "\" for the byte " + hex.str() +
                   ": it is not a byte-level vocabulary (every byte's character must be a token)");
      }
      byte_id[size_t(b)] = it->second;
    }

    // The merges, ranked by their order.
    const json& m = model.value("merges", json());
    if (!m.is_array()) refuse("model.merges", m, "must be a list of \"a b\" strings or [a, b] pairs");
    merges.reserve(m.size());
    for (size_t rank = 0; rank < m.size(); ++rank) {
      const json& e = m[rank];
      std::string left, right;
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const size_t space = s.find(' ', 1);  // a token is never empty; byte-level tokens hold no ' '
        if (space == std::string::npos || space + 1 >= s.size() || s.find(' ', space + 1) != std::string::npos)
          refuse("model.merges[" + std::to_string(rank) + "]", e, "is not two tokens separated by one space");
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        left = e[0].get<std::string>();
        right = e[1].get<std::string>();
      } else {
        refuse("model.merges[" + std::to_string(rank) + "]", e, "is not \"a b\" or [a, b]");
      }
      const auto l = vocab.find(left), r = vocab.find(right), merged = vocab.find(left + right);
      if (l == vocab.end() || r == vocab.end() || merged == vocab.end())
        refuse("model.merges[" + std::to_string(rank) + "]", e,
               "names a token that is not in model.vocab (" +
                   (l == vocab.end() ? left : r == vocab.end() ? right : left + right) + ")");
      const uint64_t key = (uint64_t(uint32_t(l->second)) << 32) | uint32_t(r->second);
      merges.emplace(key, std::make_pair(int(rank), merged->second));  // the first (lowest) rank wins
    }

    read_special_ids(j);
  }

  // Note [Special ids].
  void read_special_ids(const json& j) {
    const json& post = j.value("post_processor", json());
    std::vector<const json*> processors;
    if (post.is_object() && post.value("type", std::string()) == "Sequence" && post.contains("processors") &&
        post.at("processors").is_array())
      for (const json& p : post.at("processors")) processors.push_back(&p);
    else if (post.is_object())
      processors.push_back(&post);
    for (const json* p : processors) {
      const std::string type = p->value("type", std::string());
      if (type == "TemplateProcessing" && p->contains("single") && p->at("single").is_array() &&
          !p->at("single").empty()) {
        const json& first = p->at("single")[0];
        if (first.is_object() && first.contains("SpecialToken")) {
          const std::string name = first.at("SpecialToken").value("id", std::string());
          const json& specials = p->value("special_tokens", json::object());
          if (specials.contains(name) && specials.at(name).contains("ids") && !specials.at(name).at("ids").empty())
            bos = specials.at(name).at("ids")[0].get<int64_t>();
          else
            bos = id_of(name);
        }
      } else if (type == "RobertaProcessing" && p->contains("cls") && p->at("cls").is_array() &&
                 p->at("cls").size() == 2) {
        bos = p->at("cls")[1].get<int64_t>();
      }
    }
    const fs::path config = fs::path(path).parent_path() / "tokenizer_config.json";
    if (!path.empty() && fs::is_regular_file(config)) {
      const json c = read_tokenizer_json(config, "tokenizer config");
      if (c.is_object() && c.contains("eos_token")) {
        const json& e = c.at("eos_token");
        const std::string name = e.is_string() ? e.get<std::string>()
                                 : e.is_object() ? e.value("content", std::string())
                                                 : std::string();
        if (!name.empty()) {
          eos = id_of(name);
          return;
        }
      }
    }
    for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>"}) {
      for (const AddedToken& a : added)
        if (a.content == name) {
          eos = a.id;
          return;
        }
    }
  }

  // The ids of one pre-tokenized piece (its UTF-8 bytes).
  void encode_piece(std::string_view bytes, std::vector<int>& out) const {
    if (ignore_merges) {
      std::string chars;
      for (char b : bytes) append_utf8(chars, byte_to_char[uint8_t(b)]);
      const auto it = vocab.find(chars);
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    std::vector<int> symbols;
    symbols.reserve(bytes.size());
    for (char b : bytes) symbols.push_back(byte_id[uint8_t(b)]);
    // Note [Merge order]: the pair of lowest rank merges, every non-overlapping occurrence of it from the
    // left, until no adjacent pair has a rank. (With merges as training writes them, where a token is
    // made before a merge uses it, this is the order of the Hugging Face library's priority queue.)
    while (symbols.size() > 1) {
      int best_rank = std::numeric_limits<int>::max(), best_id = -1;
      uint64_t best_key = 0;
      for (size_t k = 0; k + 1 < symbols.size(); ++k) {
        const uint64_t key = (uint64_t(uint32_t(symbols[k])) << 32) | uint32_t(symbols[k + 1]);
        const auto it = merges.find(key);
        if (it != merges.end() && it->second.first < best_rank) {
          best_rank = it->second.first;
          best_id = it->second.second;
          best_key = key;
        }
      }
      if (best_id < 0) break;
      size_t w = 0;
      for (size_t k = 0; k < symbols.size(); ++w) {
        if (k + 1 < symbols.size() &&
            ((uint64_t(uint32_t(symbols[k])) << 32) | uint32_t(symbols[k + 1])) == best_key) {
          symbols[w] = best_id;
          k += 2;
        } else {
          symbols[w] = symbols[k];
          k += 1;
        }
      }
      symbols.resize(w);
    }
    out.insert(out.end(), symbols.begin(), symbols.end());
  }

  // Pre-tokenized pieces of a text without added tokens, as byte ranges.
  std::vector<std::pair<size_t, size_t>> pieces(std::string_view text) const {
    const CodePoints cps = decode_utf8(text);
    std::vector<std::pair<size_t, size_t>> ranges{{0, cps.cp.size()}}, next;
    if (cps.cp.empty()) ranges.clear();
    for (Pattern p : splits) {
      next.clear();
      for (const auto& [b, e] : ranges) split_isolated(cps.cp, b, e, p, next);
      ranges.swap(next);
    }
    for (auto& [b, e] : ranges) {
      b = cps.offset[b];
      e = cps.offset[e];
    }
    return ranges;
  }

  void encode_plain(std::string_view text, std::vector<int>& out) const {
    if (normalize_nfc) {
      const std::string normal = nfc(text);
      for (const auto& [b, e] : pieces(normal)) encode_piece(std::string_view(normal).substr(b, e - b), out);
      return;
    }
    for (const auto& [b, e] : pieces(text)) encode_piece(text.substr(b, e - b), out);
  }

  // Added tokens first, leftmost and then longest; the stretches between them through the model.
  std::vector<int> encode(std::string_view text) const {
    std::vector<int> out;
    size_t plain = 0;
    for (size_t i = 0; i < text.size();) {
      const AddedToken* hit = nullptr;
      for (size_t k : added_by_first_byte[uint8_t(text[i])])
        if (text.compare(i, added[k].content.size(), added[k].content) == 0) {
          hit = &added[k];
          break;
        }
      if (!hit) {
        ++i;
        continue;
      }
      encode_plain(text.substr(plain, i - plain), out);
      out.push_back(hit->id);
      i += hit->content.size();
      plain = i;
    }
    encode_plain(text.substr(plain), out);
    return out;
  }
};

ByteLevelBPETokenizer::ByteLevelBPETokenizer(const std::string& path) : impl_(std::make_unique<Impl>()), path_(path) {
  const std::string fix = "give a Hugging Face tokenizer.json (from the model's directory)";
  check_data_file(path, "tokenizer: ", fix);
  std::ifstream in(path, std::ios::binary);
  BOOSTER_CHECK(in.good(), DataError, "tokenizer: cannot open ", path, ": ", std::strerror(errno), "; ", fix);
  in.close();
  json j = read_tokenizer_json(path, "tokenizer");
  impl_->path = path;
  impl_->read(j);
}

ByteLevelBPETokenizer::ByteLevelBPETokenizer(std::string_view json_text, const std::string& path)
    : impl_(std::make_unique<Impl>()), path_(path) {
  json j;
  try {
    j = parse_json_text(json_text, "tokenizer '" + path + "'", tokenizer_json_limits());
  } catch (const ConfigError& e) {
    throw DataError(e.what());
  }
  impl_->path = path;
  impl_->read(j);
}

ByteLevelBPETokenizer::~ByteLevelBPETokenizer() = default;

int64_t ByteLevelBPETokenizer::vocab_size() const { return int64_t(impl_->id_to_token.size()); }
int64_t ByteLevelBPETokenizer::eos_id() const { return impl_->eos; }
int64_t ByteLevelBPETokenizer::bos_id() const { return impl_->bos; }

std::vector<int> ByteLevelBPETokenizer::encode(std::string_view text) const { return impl_->encode(text); }

std::string ByteLevelBPETokenizer::decode(const std::vector<int>& ids) const {
  std::string out;
  for (int id : ids) {
    BOOSTER_CHECK(id >= 0 && size_t(id) < impl_->id_to_token.size() && !impl_->id_to_token[size_t(id)].empty(),
                  IndexError, "tokenizer ", path_, ": id ", id, " is no token of this tokenizer (vocabulary ",
                  vocab_size(), ")");
    const std::string& token = impl_->id_to_token[size_t(id)];
    if (impl_->id_is_added[size_t(id)]) {
      out += token;
      continue;
    }
    const CodePoints cps = decode_utf8(token);
    for (size_t k = 0; k < cps.cp.size(); ++k) {
      const auto it = impl_->char_to_byte.find(cps.cp[k]);
      if (it != impl_->char_to_byte.end()) out.push_back(char(it->second));
      else out.append(token, cps.offset[k], cps.offset[k + 1] - cps.offset[k]);  // not a byte character: as is
    }
  }
  return out;
}

std::vector<uint32_t> ByteLevelBPETokenizer::encode_lines(std::string_view text, bool eos) const {
  std::vector<uint32_t> out;
  out.reserve(text.size() / 3);
  const int64_t end_id = eos ? eos_id() : -1;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t newline = text.find('\n', begin);
    if (newline == std::string_view::npos) newline = text.size();
    for (int id : impl_->encode(text.substr(begin, newline - begin))) out.push_back(uint32_t(id));
    if (end_id >= 0) out.push_back(uint32_t(end_id));
    begin = newline + 1;
  }
  return out;
}

std::vector<std::string> ByteLevelBPETokenizer::pre_tokenize(std::string_view text) const {
  std::vector<std::string> out;
  const std::string normal = impl_->normalize_nfc ? nfc(text) : std::string(text);
  for (const auto& [b, e] : impl_->pieces(normal)) out.push_back(normal.substr(b, e - b));
  return out;
}

std::unique_ptr<Tokenizer> open_tokenizer(const std::string& path) {
  if (fs::path(path).extension() == ".json") return std::make_unique<ByteLevelBPETokenizer>(path);
  return std::make_unique<SentencePieceTokenizer>(path);
}

}  // namespace booster::data
