// The per-thread error context stack and its description (Note [Error context] in error_context.h).
#include "booster/common/error_context.h"

#include <algorithm>
#include <atomic>

namespace booster {

namespace {
std::atomic<ModuleDescriber> g_module_describer{nullptr};
}  // namespace

ErrorContextStack& error_context_stack() {
  thread_local ErrorContextStack stack;
  return stack;
}

void set_module_describer(ModuleDescriber describer) { g_module_describer.store(describer); }

const ErrorContextFrame* innermost_error_context(ErrorContextFrame::Kind kind) {
  const ErrorContextStack& s = error_context_stack();
  for (size_t i = std::min(s.depth, kMaxErrorContextDepth); i-- > 0;)
    if (s.frames[i].kind == kind) return &s.frames[i];
  return nullptr;
}

std::string describe_error_context() {
  const ErrorContextStack& s = error_context_stack();
  const size_t n = std::min(s.depth, kMaxErrorContextDepth);
  const ErrorContextFrame* op = innermost_error_context(ErrorContextFrame::Kind::Op);
  const ErrorContextFrame* backward = innermost_error_context(ErrorContextFrame::Kind::Backward);
  const ErrorContextFrame* module = innermost_error_context(ErrorContextFrame::Kind::Module);
  const ErrorContextFrame* building = innermost_error_context(ErrorContextFrame::Kind::Building);
  const void* root = nullptr;
  for (size_t i = 0; i < n && !root; ++i)
    if (s.frames[i].kind == ErrorContextFrame::Kind::Module) root = s.frames[i].what;

  std::string out;
  auto add = [&](const std::string& part) { out += (out.empty() ? "" : " ") + part; };
  if (op) add(std::string("in op '") + static_cast<const char*>(op->what) + "'");
  if (backward) add(std::string("in the backward of ") + static_cast<const char*>(backward->what));
  if (module) {
    const ModuleDescriber describe = g_module_describer.load();
    add("in module " + (describe ? describe(module->what, root) : std::string("?")));
  }
  if (building) add(std::string("while building model '") + static_cast<const char*>(building->what) + "'");
  return out;
}

}  // namespace booster
