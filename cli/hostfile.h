// The hostfile of `booster run --hostfile FILE` (cli/run.cpp): OpenMPI's syntax, read by booster run
// itself so a mistake is one line naming file:line before anything starts, and so a restart knows how
// many slots are left (Note [Hostfiles under booster run]).
//
// Note [Hostfiles under booster run]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A line is `HOST [KEY=VALUE ...]`, `#` starts a comment, blank lines are skipped. The keys are
// OpenMPI's: slots (also slot, count, cpu) is the number of processes the host takes, max_slots
// (max-slots) the most it may be oversubscribed to; user/username and port are passed to mpirun's ssh.
// Anything else is a ConfigError naming file:line, as is a count that is not a whole number from 1
// (max_slots from 0). A host listed twice adds its slots, as mpirun does. A line without slots= gets the
// host's cores from mpirun, which booster run cannot know for a remote host: the total is then unknown
// and -n is not checked (say slots=N on every line to have it checked).
#pragma once

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "booster/common/error.h"

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

}  // namespace detail_hostfile

// Parses `text`, the contents of the hostfile `name` (for messages); ConfigError naming name:line.
inline Hostfile parse_hostfile(const std::string& text, const std::string& name) {
  Hostfile file;
  std::istringstream in(text);
  std::string raw;
  for (int number = 1; std::getline(in, raw); ++number) {
    // Up to a comment, with `slots = 2` as `slots=2`, as OpenMPI's lexer takes it.
    std::string line;
    for (const char c : raw.substr(0, raw.find('#'))) {
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
    HostfileEntry entry{host, std::nullopt, number};
    while (words >> word) {
      const size_t equals = word.find('=');
      const std::string key = word.substr(0, equals);
      const std::string value = equals == std::string::npos ? "" : word.substr(equals + 1);
      BOOSTER_CHECK(equals != std::string::npos && !value.empty(), ConfigError, "booster run: hostfile ", where,
                    ": '", word, "' after the host name is not KEY=VALUE; expected a line `HOST slots=N` (e.g. `",
                    host, " slots=4`)");
      if (key == "slots" || key == "slot" || key == "count" || key == "cpu") {
        const std::optional<long> n = detail_hostfile::whole_number(value);
        BOOSTER_CHECK(n && *n >= 1, ConfigError, "booster run: hostfile ", where, ": ", key, "=", value,
                      " is not a number of slots; expected a whole number from 1 (e.g. ", host, " slots=4)");
        entry.slots = int(*n);
      } else if (key == "max_slots" || key == "max-slots") {
        const std::optional<long> n = detail_hostfile::whole_number(value);
        BOOSTER_CHECK(n.has_value(), ConfigError, "booster run: hostfile ", where, ": ", key, "=", value,
                      " is not a number; expected a whole number from 0");
      } else {
        BOOSTER_CHECK(key == "user" || key == "username" || key == "port", ConfigError, "booster run: hostfile ",
                      where, ": unknown key '", key, "'; a line is `HOST slots=N [max_slots=M]` (keys slots, ",
                      "max_slots, user, port)");
      }
    }
    file.entries.push_back(entry);
  }
  BOOSTER_CHECK(!file.entries.empty(), ConfigError, "booster run: hostfile ", name,
                " lists no host; expected a line `HOST slots=N` per machine (e.g. `localhost slots=2`)");
  return file;
}

// Reads and parses the hostfile at `path`: ConfigError when it cannot be read or is malformed.
inline Hostfile read_hostfile(const std::string& path, std::string* contents = nullptr) {
  std::error_code ec;
  BOOSTER_CHECK(!std::filesystem::is_directory(path, ec), ConfigError, "booster run: the hostfile '", path,
                "' is a directory; give --hostfile a file with a line `HOST slots=N` per machine");
  std::ifstream in(path, std::ios::binary);
  BOOSTER_CHECK(in.good(), ConfigError, "booster run: cannot read the hostfile '", path, "' (", std::strerror(errno),
                "); give --hostfile a file with a line `HOST slots=N` per machine");
  std::stringstream ss;
  ss << in.rdbuf();
  BOOSTER_CHECK(!in.bad(), ConfigError, "booster run: cannot read the hostfile '", path, "' (",
                std::strerror(errno), ")");
  if (contents) *contents = ss.str();
  return parse_hostfile(ss.str(), path);
}

}  // namespace booster::cli
