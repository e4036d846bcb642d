// Note [Reading config text] (json_text.h): a SAX handler that builds the document and enforces the
// limits as it goes.
#include "booster/common/json_text.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <vector>

namespace booster {

namespace {

using json = nlohmann::json;

// A char iterator that records the furthest point the parser has read, which is where a SAX event
// happens (nlohmann gives positions only to parse_error).
struct TrackedIterator {
  using iterator_category = std::forward_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  const char* at = nullptr;
  const char** furthest = nullptr;

  reference operator*() const { return *at; }
  TrackedIterator& operator++() {
    ++at;
    if (at > *furthest) *furthest = at;
    return *this;
  }
  TrackedIterator operator++(int) {
    TrackedIterator before = *this;
    ++*this;
    return before;
  }
  bool operator==(const TrackedIterator& other) const { return at == other.at; }
};

// At most `limit` characters of `s`, control characters escaped, for a message.
std::string printable(std::string_view s, size_t limit = 60) {
  std::string out;
  for (char c : s.substr(0, limit)) {
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(static_cast<unsigned char>(c)));
      out += buf;
    } else {
      out += c;
    }
  }
  if (s.size() > limit) out += "...";
  return out;
}

class DocumentBuilder {
 public:
  DocumentBuilder(std::string_view text, const std::string& source, const char** furthest, const JsonLimits& limits)
      : text_(text), source_(source), furthest_(furthest), max_depth_(limits.max_depth), max_items_(limits.max_items),
        plain_strings_(limits.plain_strings), items_advice_(limits.items_advice) {}

  json take() { return std::move(root_); }

  bool null() { return put(json(nullptr)); }
  bool boolean(bool v) { return put(json(v)); }
  bool number_integer(json::number_integer_t v) { return put(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return put(json(v)); }
  bool number_float(json::number_float_t v, const std::string&) { return put(json(v)); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }
  bool string(std::string& v) {
    if (plain_strings_ && v.find('\0') != std::string::npos) fail("a string holds a NUL character (\\u0000)", "remove it");
    return put(json(std::move(v)));
  }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(std::string& k) {
    Frame& frame = frames_.back();
    if (plain_strings_ && std::any_of(k.begin(), k.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; }))
      fail("the key \"" + printable(k) + "\" holds a control character", "keys are plain names");
    const size_t here = key_offset();
    const auto [it, inserted] = frame.key_offsets.emplace(k, here);
    if (!inserted) {
      frame.key = k;
      fail("the key \"" + printable(k) + "\" is given twice (first at " + line_column(it->second) + ")",
           "keep one of them; a later one would silently replace the first");
    }
    frame.key = std::move(k);
    return true;
  }

  template <class Exception>
  bool parse_error(std::size_t position, const std::string& token, const Exception& e) {
    if (e.id == 406) {  // out_of_range.406: a number that does not fit a double
      throw ConfigError(source_ + ": " + path_or_root() + " is " + printable(token) + " at " + line_column(position) +
                        ", which is out of the range of a double (about 1.8e308)");
    }
    // e.what() is "[json.exception.parse_error.101] parse error at line 3, column 5: ..."
    std::string what = e.what();
    const auto cut = what.find("] ");
    if (cut != std::string::npos) what = what.substr(cut + 2);
    throw JsonSyntaxError(source_ + " is not valid JSON: " + printable(what, 300), printable(what, 300));
  }

 private:
  struct Frame {
    json* node;
    std::string key;                          // objects: the key whose value comes next
    std::map<std::string, size_t> key_offsets;  // objects: where each key was given
  };

  bool put(json&& value) {
    if (frames_.empty()) {
      root_ = std::move(value);
      return true;
    }
    Frame& frame = frames_.back();
    if (frame.node->is_object()) {
      (*frame.node)[frame.key] = std::move(value);
    } else {
      check_items(frame);
      frame.node->push_back(std::move(value));
    }
    return true;
  }

  // An array past max_items stops here, before the rest is read (Note [Reading config text]).
  void check_items(const Frame& frame) const {
    if (frame.node->size() < max_items_) return;
    fail("an array holds more than " + std::to_string(max_items_) + " items", items_advice_);
  }

  bool open(json&& container) {
    if (int(frames_.size()) >= max_depth_) {
      fail("objects and arrays are nested more than " + std::to_string(max_depth_) + " deep",
           "no file the project reads needs that; check for runaway brackets");
    }
    json* node = nullptr;
    if (frames_.empty()) {
      root_ = std::move(container);
      node = &root_;
    } else {
      Frame& frame = frames_.back();
      // Note: a pointer to the last element stays valid until the next push_back into its parent, which
      // happens only after this container is closed.
      if (frame.node->is_object()) {
        node = &((*frame.node)[frame.key] = std::move(container));
      } else {
        check_items(frame);
        frame.node->push_back(std::move(container));
        node = &frame.node->back();
      }
    }
    frames_.push_back(Frame{node, {}, {}});
    return true;
  }

  bool close() {
    frames_.pop_back();
    return true;
  }

  // Where the key just read starts: back from its closing quote to the opening one.
  size_t key_offset() const {
    size_t end = size_t(*furthest_ - text_.data());
    size_t close = text_.rfind('"', end == 0 ? 0 : end - 1);
    if (close == std::string_view::npos || close == 0) return end;
    size_t open = close;
    do {
      open = text_.rfind('"', open - 1);
    } while (open != std::string_view::npos && open > 0 && text_[open - 1] == '\\');
    return open == std::string_view::npos ? end : open;
  }

  std::string line_column(size_t offset) const {
    offset = std::min(offset, text_.size());
    const auto line = 1 + std::count(text_.begin(), text_.begin() + std::ptrdiff_t(offset), '\n');
    const size_t line_start = offset == 0 ? 0 : text_.rfind('\n', offset - 1);
    const size_t column = line_start == std::string_view::npos ? offset + 1 : offset - line_start;
    return "line " + std::to_string(line) + ", column " + std::to_string(column);
  }

  // The JSON path of the value being read, quoted and cut for a message. Every frame but the last has
  // its open child already in place (the last element, or the current key).
  std::string path_or_root() const {
    std::string path;
    for (const Frame& frame : frames_) {
      const bool innermost = &frame == &frames_.back();
      if (frame.node->is_object()) {
        if (frame.key.empty() && innermost) break;
        path += (path.empty() ? "" : ".") + printable(frame.key, 40);
      } else {
        path += "[" + std::to_string(frame.node->size() - (innermost ? 0 : 1)) + "]";
      }
      if (path.size() > 120) return "'" + path.substr(0, 120) + "...'";
    }
    return path.empty() ? "the document" : "'" + path + "'";
  }

  [[noreturn]] void fail(const std::string& what, const std::string& fix) const {
    throw ConfigError(source_ + ": at " + path_or_root() + " (" + line_column(size_t(*furthest_ - text_.data())) +
                      "): " + what + "; " + fix);
  }

  std::string_view text_;
  const std::string& source_;
  const char** furthest_;
  int max_depth_;
  size_t max_items_;
  bool plain_strings_;
  const char* items_advice_;
  json root_;
  std::vector<Frame> frames_;
};

std::string megabytes(uintmax_t bytes) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed << double(bytes) / 1e6 << " MB";
  return os.str();
}

}  // namespace

json parse_json_text(std::string_view text, const std::string& source, const JsonLimits& limits) {
  if (text.size() > limits.max_bytes) {
    throw ConfigError(source + " is " + megabytes(text.size()) + "; it is limited to " + megabytes(limits.max_bytes) +
                      " (" + limits.size_advice + ")");
  }
  const char* furthest = text.data();
  TrackedIterator first{text.data(), &furthest}, last{text.data() + text.size(), &furthest};
  DocumentBuilder builder(text, source, &furthest, limits);
  json::sax_parse(first, last, &builder, json::input_format_t::json, /*strict=*/true, /*ignore_comments=*/true);
  return builder.take();
}

json read_json_file(const std::string& path, const JsonLimits& limits) {
  return read_json_file(path, "config file", limits);
}

json read_json_file(const std::string& path, const std::string& what, const JsonLimits& limits) {
  const std::string source = what + " '" + path + "'";
  std::error_code ec;
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    throw ConfigError(source + " is not a regular file (a directory, a FIFO or a device); give a JSON file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot open " + source);
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > limits.max_bytes) {
    throw ConfigError(source + " is " + megabytes(size) + "; it is limited to " + megabytes(limits.max_bytes) + " (" +
                      limits.size_advice + ")");
  }
  std::string text;
  // A FIFO or a device has no size: read at most one byte past the limit.
  text.resize(size_t(ec ? limits.max_bytes : std::min<uintmax_t>(size, limits.max_bytes)) + 1);
  in.read(text.data(), std::streamsize(text.size()));
  text.resize(size_t(in.gcount()));
  if (in.bad()) throw ConfigError("cannot read " + source);
  return parse_json_text(text, source, limits);
}

json try_parse_json_text(std::string_view text, const JsonLimits& limits) {
  try {
    return parse_json_text(text, "", limits);
  } catch (const ConfigError&) {
    return json(json::value_t::discarded);
  }
}

json try_read_json_file(const std::string& path, const JsonLimits& limits) {
  try {
    return read_json_file(path, "", limits);
  } catch (const ConfigError&) {
    return json(json::value_t::discarded);
  }
}

}  // namespace booster
