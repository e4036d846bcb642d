// Sets or unsets BOOSTER_PLUGIN_PATH for one scope, and puts back what was there.
#pragma once

#include <cstdlib>
#include <string>

namespace testing {

class PluginPathGuard {
 public:
  explicit PluginPathGuard(const char* value) {
    if (const char* old = std::getenv("BOOSTER_PLUGIN_PATH")) old_ = old, had_ = true;
    if (value) setenv("BOOSTER_PLUGIN_PATH", value, 1);
    else unsetenv("BOOSTER_PLUGIN_PATH");
  }
  ~PluginPathGuard() {
    if (had_) setenv("BOOSTER_PLUGIN_PATH", old_.c_str(), 1);
    else unsetenv("BOOSTER_PLUGIN_PATH");
  }
  PluginPathGuard(const PluginPathGuard&) = delete;
  PluginPathGuard& operator=(const PluginPathGuard&) = delete;

 private:
  std::string old_;
  bool had_ = false;
};

}  // namespace testing
