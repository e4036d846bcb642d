// `booster plugins` and `booster compat`: the parallel plugins on the search path with what they
// declare, and the compatibility matrix built from those declarations (booster/booster/compat.h).
#include <iostream>
#include <string>
#include <vector>

#include "booster/booster/booster.h"
#include "booster/booster/compat.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/plugin/loader.h"
#include "commands.h"

namespace booster::cli {

namespace {

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// Every parallel plugin library on the search path, created with default options; a library that
// fails to load is reported and skipped, so one broken file does not hide the others.
std::vector<std::pair<std::shared_ptr<ParallelPlugin>, std::string>> load_plugins(std::ostream& errors) {
  std::vector<std::pair<std::shared_ptr<ParallelPlugin>, std::string>> out;
  for (const plugin::Found& found : plugin::list(plugin::kParallelKind)) {
    try {
      out.emplace_back(create_plugin(found.file.string()), found.file.string());
    } catch (const std::exception& e) {
      errors << "booster: skipping " << found.file.string() << ": " << e.what() << "\n";
    }
  }
  return out;
}

}  // namespace

int plugins() {
  const auto found = load_plugins(std::cerr);
  std::cout << "parallel plugins (config: \"plugin\": NAME or {\"name\": NAME, OPTION: VALUE, ...}; command line: "
               "--plugin NAME; none named: single process, built in)\n";
  if (found.empty()) std::cout << "\n(none found; searched " << plugin::describe_search_path() << ")\n";
  for (const auto& [p, file] : found) {
    std::cout << "\n" << p->name() << " " << p->version() << "\n"
              << "  file: " << file << "\n"
              << "  devices: " << join(p->supported_devices()) << "\n"
              << "  mixed precision: "
              << (p->control_precision() ? "controls its own (set its precision option)"
                                         : join(p->supported_precisions()) == "*" ? std::string("any")
                                                                                  : join(p->supported_precisions()))
              << "\n"
              << "  no_sync: " << (p->support_no_sync() ? "yes" : "no") << "\n";
    const nlohmann::json options = p->options();
    if (options.empty()) std::cout << "  (no options)\n";
    for (const auto& [key, value] : options.items()) std::cout << "  " << key << " = " << value.dump() << "\n";
  }
  return kExitOk;
}

int compat(const std::string& device) {
  const auto found = load_plugins(std::cerr);
  std::vector<compat::PluginTraits> columns;
  for (const auto& [p, file] : found) columns.push_back(compat::PluginTraits::of(*p));
  if (columns.empty()) columns.push_back(compat::PluginTraits::of(*create_plugin("")));
  std::vector<std::string> precisions;
  for (const ListedStrategy& s : list_strategies(std::cerr)) precisions.push_back(s.name);
  std::cout << "mixed precision x parallel plugin on " << device
            << " (\"tensor parallel\" and \"pipeline parallel\": the rules a hybrid plugin with those axes "
               "would meet)\n\n"
            << compat::format_matrix(compat::build_matrix(precisions, columns, device));
  return kExitOk;
}

}  // namespace booster::cli
