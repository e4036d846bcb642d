// The hostfile of `booster run --hostfile FILE` (cli/run.cpp): OpenMPI's syntax, read by booster run
// itself so a mistake is one line naming file:line before anything starts, and so a restart knows how
// many slots are left (Note [Hostfiles under booster run]).
//
// Note [Hostfiles under booster run]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A line is `HOST [KEY=VALUE ...]`; `#` and `//` start a comment to the end of the line, `/* ... */` is a
// comment that may span lines (and ends the line it starts on), blank lines are skipped. The keys are
// those of OpenMPI's hostfile lexer: slots (also count, cpu) is the number of processes the host takes,
// from 0; max_slots (max-slots, slots_max, slots-max, cpu_max, cpu-max, max_cpu, max-cpu, count_max,
// count-max, max_count, max-count) the most it may be oversubscribed to, not below slots, and the slots
// when slots is not given; username (user_name, user-name) and port are passed to mpirun's ssh; boards,
// sockets, cores (and their _per_ spellings) and cpu_set (cpu-set) describe the host to mpirun. Anything
// else (`slot=` is a rankfile's key, `user=` no key at all) is a ConfigError naming file:line, as is a
// count that is not a whole number from 0. `^HOST` excludes the host: it adds no slots and removes those
// of its other lines. A host may be listed on several lines without a count (mpirun: a slot per line);
// a count on any of them is a ConfigError, as mpirun refuses "multiple definitions of the slot count".
// A line without slots= or max_slots= gets the
// host's cores from mpirun, which booster run cannot know for a remote host: the total is then unknown
// and -n is not checked (say slots=N on every line to have it checked).
#pragma once

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "booster/common/error.h"
#include "booster/common/input_file.h"

namespace booster::cli {

struct HostfileEntry {
  std::string host;
  std::optional<int> slots;  // nullopt: not given (mpirun counts the host's cores)
  int line = 0;
};

struct Hostfile {
  std::vector<HostfileEntry> entries;
  // The slots of all lines, or nullopt when a line does not say (Note [Hostfiles under booster run]).
  std::optional<int> total_slots() const {
    long total = 0;
    for (const HostfileEntry& e : entries) {
      if (!e.slots) return std::nullopt;
      total += *e.slots;
    }
    return int(std::min(total, 1L << 30));
  }
};

namespace detail_hostfile {

inline std::optional<long> whole_number(const std::string& text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  for (char c : text)
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
  return std::stol(text);
}

// The lines of `text` without comments (Note [Hostfiles under booster run]), each with its line number;
// a `/* */` comment ends the line it starts on, and the text after it is a line of its own.
inline std::vector<std::pair<int, std::string>> hostfile_lines(const std::string& text) {
  std::vector<std::pair<int, std::string>> lines;
  std::string line;
  int number = 1, line_number = 1;
  bool in_block = false;
  const auto end_line = [&] {
    lines.emplace_back(line_number, line);
    line.clear();
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const char next = i + 1 < text.size() ? text[i + 1] : '\0';
    if (c == '\n') {
      if (!in_block) end_line();
      line_number = ++number;
    } else if (in_block) {
      if (c == '*' && next == '/') {
        in_block = false;
        line_number = number;
        ++i;
      }
    } else if (c == '/' && next == '*') {
      end_line();
      in_block = true;
      ++i;
    } else if (c == '#' || (c == '/' && next == '/')) {
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
    } else {
      line += c;
    }
  }
  if (!in_block) end_line();
  return lines;
}

inline bool is_one_of(const std::string& key, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (key == n) return true;
  return false;
}

// The host of `user@host`, for matching `^host` against the other lines.
inline std::string bare_host(const std::string& host) {
  const size_t at = host.rfind('@');
  return at == std::string::npos ? host : host.substr(at + 1);
}

}  // namespace detail_hostfile

// Parses `text`, the contents of the hostfile `name` (for messages); ConfigError naming name:line.
inline Hostfile parse_hostfile(const std::string& text, const std::string& name) {
  using detail_hostfile::is_one_of;
  Hostfile file;
  std::vector<std::string> excluded;
  for (const auto& [number, raw] : detail_hostfile::hostfile_lines(text)) {
    // `slots = 2` as `slots=2`, as OpenMPI's lexer takes it.
    std::string line;
    for (const char c : raw) {
      const bool space = std::isspace(static_cast<unsigned char>(c));
      if (c == '=')
        while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
      if (!(space && !line.empty() && line.back() == '=')) line += c;
    }
    std::istringstream words(line);
    std::string host, word;
    if (!(words >> host)) continue;  // blank or a comment
    const std::string where = name + ":" + std::to_string(number);
    BOOSTER_CHECK(host.find('=') == std::string::npos, ConfigError, "booster run: hostfile ", where, ": '", host,
                  "' is not a host name; expected a line `HOST slots=N` (e.g. `node01 slots=4`)");
    if (host[0] == '^') {
      BOOSTER_CHECK(host.size() > 1 && !(words >> word), ConfigError, "booster run: hostfile ", where, ": '", host,
                    host.size() > 1 ? " " + word : std::string(), "' is not a host to exclude; expected `^HOST` alone ",
                    "on its line (e.g. `^node03`)");
      excluded.push_back(detail_hostfile::bare_host(host.substr(1)));
      continue;
    }
    HostfileEntry entry{host, std::nullopt, number};
    std::optional<long> slots, max_slots;
    std::string max_key;
    while (words >> word) {
      const size_t equals = word.find('=');
      const std::string key = word.substr(0, equals);
      const std::string value = equals == std::string::npos ? "" : word.substr(equals + 1);
      BOOSTER_CHECK(equals != std::string::npos && !value.empty(), ConfigError, "booster run: hostfile ", where,
                    ": '", word, "' after the host name is not KEY=VALUE; expected a line `HOST slots=N` (e.g. `",
                    host, " slots=4`)");
      const bool is_slots = is_one_of(key, {"slots", "count", "cpu"});
      const bool is_max = is_one_of(key, {"max_slots", "max-slots", "slots_max", "slots-max", "cpu_max", "cpu-max",
                                          "max_cpu", "max-cpu", "count_max", "count-max", "max_count", "max-count"});
      const bool is_number = is_one_of(key, {"port", "boards", "sockets", "sockets_per_board", "sockets-per-board",
                                             "cores", "cores_per_socket", "cores-per-socket"});
      if (is_slots || is_max || is_number) {
        const std::optional<long> n = detail_hostfile::whole_number(value);
        BOOSTER_CHECK(n.has_value(), ConfigError, "booster run: hostfile ", where, ": ", key, "=", value, " is not ",
                      is_number ? "a number" : "a number of slots", "; expected a whole number from 0",
                      is_slots ? " (e.g. " + host + " slots=4)" : std::string());
        if (is_slots) slots = n;
        if (is_max) max_slots = n, max_key = key;
      } else {
        BOOSTER_CHECK(is_one_of(key, {"username", "user_name", "user-name", "cpu_set", "cpu-set"}), ConfigError,
                      "booster run: hostfile ", where, ": unknown key '", key, "'; a line is `HOST slots=N ",
                      "[max_slots=M]` (keys slots, max_slots, username, port, as mpirun's hostfile has them)");
      }
    }
    BOOSTER_CHECK(!max_slots || !slots || *max_slots >= *slots, ConfigError, "booster run: hostfile ", where, ": ",
                  max_key, "=", *max_slots, " is less than slots=", slots.value_or(0),
                  "; expected max_slots of at least slots (or leave it out)");
    if (slots || max_slots) entry.slots = int(slots ? *slots : *max_slots);
    file.entries.push_back(entry);
  }
  // `^HOST` removes the host whichever line lists it, as mpirun does.
  file.entries.erase(std::remove_if(file.entries.begin(), file.entries.end(),
                                    [&](const HostfileEntry& e) {
                                      return std::find(excluded.begin(), excluded.end(),
                                                       detail_hostfile::bare_host(e.host)) != excluded.end();
                                    }),
                     file.entries.end());
  // A host on several lines is one slot per line, or one line with slots=N: mpirun refuses the mix.
  for (size_t i = 0; i < file.entries.size(); ++i)
    for (size_t j = 0; j < i; ++j) {
      const HostfileEntry &first = file.entries[j], &again = file.entries[i];
      BOOSTER_CHECK(first.host != again.host || (!first.slots && !again.slots), ConfigError, "booster run: hostfile ",
                    name, ":", again.line, ": '", again.host, "' is listed again (first on line ", first.line,
                    ") and a slot count is given; mpirun takes one line `", again.host,
                    " slots=N`, or the host once per slot without slots=");
    }
  BOOSTER_CHECK(!file.entries.empty(), ConfigError, "booster run: hostfile ", name,
                " lists no host; expected a line `HOST slots=N` per machine (e.g. `localhost slots=2`)");
  return file;
}

// The largest hostfile booster run reads: a line per machine is a few hundred kilobytes for the largest
// clusters; more is not a hostfile (Note [Inputs that are not files]).
inline constexpr uint64_t kMaxHostfileBytes = uint64_t(1) << 20;

// Reads and parses the hostfile at `path`: ConfigError when it cannot be read, is larger than
// kMaxHostfileBytes, or is malformed. A pipe (--hostfile <(scontrol show ...)) is read as it comes, at
// most kMaxHostfileBytes and refused when nothing arrives for 10 s (a FIFO nobody writes to); a device
// (/dev/zero, which never ends) or a directory is refused (Note [Inputs that are not files]).
inline Hostfile read_hostfile(const std::string& path, std::string* contents = nullptr) {
  std::error_code ec;
  BOOSTER_CHECK(std::filesystem::exists(path, ec), ConfigError, "booster run: cannot read the hostfile '", path, "' (",
                std::strerror(ec ? ec.value() : ENOENT), "); give --hostfile a file with a line `HOST slots=N` per machine");
  const std::string text = read_input_text<ConfigError>(
      path, "booster run: the hostfile", "give --hostfile a file with a line `HOST slots=N` per machine",
      kMaxHostfileBytes);
  if (contents) *contents = text;
  return parse_hostfile(text, path);
}

}  // namespace booster::cli
