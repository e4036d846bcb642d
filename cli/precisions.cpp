// `booster precisions`: the mixed-precision strategies a config may name, with their options.
//
// The list is the built-in strategies, then the precision plugins found on the search path (with their
// file), and the defaults are what each strategy reports for itself (MixedPrecision::options()), the same
// values `booster check` fills into a config.
#include <iostream>
#include <string>

#include "booster/config/config.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "commands.h"

namespace booster::cli {

std::vector<ListedStrategy> list_strategies(std::ostream& errors) {
  std::vector<ListedStrategy> out;
  for (const auto& [name, file] : mixed_precision::available_strategies()) {
    try {
      out.push_back({name, file, mixed_precision::create(name)->options()});
    } catch (const std::exception& e) {
      if (file.empty()) throw;  // a built-in strategy that fails is a bug, not a file to skip
      errors << "booster: skipping " << file << ": " << e.what() << "\n";
    }
  }
  return out;
}

int precisions() {
  const std::vector<ListedStrategy> strategies = list_strategies(std::cerr);
  std::cout << "mixed-precision strategies (config: \"mixed_precision\": NAME or {\"name\": NAME, OPTION: VALUE, ...};\n"
               "command line: --mixed-precision NAME, --set mixed_precision.OPTION=VALUE; default \""
            << config::kDefaultMixedPrecision << "\")\n";
  for (const auto& [name, file, options] : strategies) {
    std::cout << "\n" << name << (file.empty() ? "" : " (plugin: " + file + ")") << "\n";
    if (options.empty()) std::cout << "  (no options)\n";
    for (const auto& [key, value] : options.items()) std::cout << "  " << key << " = " << value.dump() << "\n";
  }
  return kExitOk;
}

}  // namespace booster::cli
