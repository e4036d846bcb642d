// Parsing a subcommand's options, the part every subcommand shares: --help prints the options and ends
// the command, and a missing required option is a ConfigError (exit 2) naming it and the help.
#pragma once

#include <initializer_list>
#include <iostream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "booster/common/error.h"

namespace booster::cli {

// A subcommand without positional arguments refuses any: boost::program_options leaves a word that is
// no option's value out of the variables_map, so `--set a=1 b=2` would set a and drop b in silence.
inline void refuse_positional(const std::string& command, const boost::program_options::parsed_options& parsed) {
  namespace po = boost::program_options;
  const std::vector<std::string> stray = po::collect_unrecognized(parsed.options, po::include_positional);
  if (stray.empty()) return;
  const std::string& word = stray.front();
  const std::string hint = word.find('=') != std::string::npos
                               ? "; --set takes one KEY=VALUE: give --set again for each, e.g. --set " + word
                               : "; an option takes one value (quote a value with spaces)";
  BOOSTER_FAIL(ConfigError, "'booster ", command, "' does not take '", word, "'", hint, " (see booster ", command,
               " --help)");
}

// Parses `args` into `vm`; false when --help was asked for (the options are then printed).
inline bool parse_options(const std::string& command, const boost::program_options::options_description& desc,
                          const std::vector<std::string>& args, boost::program_options::variables_map& vm,
                          std::initializer_list<const char*> required = {}) {
  namespace po = boost::program_options;
  const po::parsed_options parsed = po::command_line_parser(args).options(desc).run();
  po::store(parsed, vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << desc;
    return false;
  }
  refuse_positional(command, parsed);
  for (const char* name : required)
    BOOSTER_CHECK(vm.count(name), ConfigError, "'booster ", command, "' needs --", name, " (see booster ", command,
                  " --help)");
  return true;
}

}  // namespace booster::cli
