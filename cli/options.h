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

// Parses `args` into `vm`; false when --help was asked for (the options are then printed).
inline bool parse_options(const std::string& command, const boost::program_options::options_description& desc,
                          const std::vector<std::string>& args, boost::program_options::variables_map& vm,
                          std::initializer_list<const char*> required = {}) {
  namespace po = boost::program_options;
  po::store(po::command_line_parser(args).options(desc).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << desc;
    return false;
  }
  for (const char* name : required)
    BOOSTER_CHECK(vm.count(name), ConfigError, "'booster ", command, "' needs --", name, " (see booster ", command,
                  " --help)");
  return true;
}

}  // namespace booster::cli
