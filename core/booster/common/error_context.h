// What the library was doing when something failed: a per-thread stack of frames (the model being
// built, the module being run, the op being entered), read only when an error message is written.
//
// Note [Error context]
// ~~~~~~~~~~~~~~~~~~~~
// An allocation that fails deep inside an op knows only its byte count. To say which op, in which
// module of which model, ran out, the callers above it leave frames on a thread-local stack:
//   * Module::operator() pushes the module (so call children as (*child)(x), as PyTorch calls them);
//   * each op entry point pushes its name (BOOSTER_OP_CONTEXT("linear"));
//   * autograd pushes the backward node it runs ("MatmulBackward");
//   * make_model pushes the model type it builds.
// A frame is two words (a kind and a pointer to a string literal, a string that outlives the frame, or
// the module) written into a fixed array; nothing is formatted or allocated until a message needs it
// (describe_error_context), so the hot path pays two stores and a thread-local lookup per frame.
// Frames beyond kMaxErrorContextDepth are counted, not kept. Module frames are described through a
// describer the nn layer installs: the module's class name and its dotted path below the outermost
// module on the stack ("layers.2 (Linear) of MLPClassifier").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace booster {

struct ErrorContextFrame {
  enum class Kind : uint8_t { Op, Module, Building, Backward };
  Kind kind;
  const void* what;  // Op, Building, Backward: a NUL-terminated string; Module: the nn::Module
};

inline constexpr size_t kMaxErrorContextDepth = 64;

// The calling thread's stack. push/pop are the only writes; frames() is valid until the next push.
struct ErrorContextStack {
  ErrorContextFrame frames[kMaxErrorContextDepth];
  size_t depth = 0;  // may exceed kMaxErrorContextDepth: the frames past it are not kept
};
ErrorContextStack& error_context_stack();

// Pushes a frame for the lifetime of the scope.
class ErrorContextScope {
 public:
  ErrorContextScope(ErrorContextFrame::Kind kind, const void* what) : stack_(error_context_stack()) {
    if (stack_.depth < kMaxErrorContextDepth) stack_.frames[stack_.depth] = {kind, what};
    ++stack_.depth;
  }
  ~ErrorContextScope() { --stack_.depth; }
  ErrorContextScope(const ErrorContextScope&) = delete;
  ErrorContextScope& operator=(const ErrorContextScope&) = delete;

 private:
  ErrorContextStack& stack_;
};

// What the innermost frames say, for a message: "in op 'linear' in module 'layers.0' (Linear) of
// MLPClassifier" or "while building model 'gpt'"; "" with no frames.
std::string describe_error_context();
// The innermost frame of `kind`, or null.
const ErrorContextFrame* innermost_error_context(ErrorContextFrame::Kind kind);

// How the nn layer names a module frame: `module` inside `root` (the outermost module on the stack).
using ModuleDescriber = std::string (*)(const void* module, const void* root);
void set_module_describer(ModuleDescriber describer);

}  // namespace booster

#define BOOSTER_ERROR_CONTEXT_CONCAT2(a, b) a##b
#define BOOSTER_ERROR_CONTEXT_CONCAT(a, b) BOOSTER_ERROR_CONTEXT_CONCAT2(a, b)
// At an op's entry: BOOSTER_OP_CONTEXT("linear"); the name must be a string literal.
#define BOOSTER_OP_CONTEXT(name_literal)                                                        \
  const ::booster::ErrorContextScope BOOSTER_ERROR_CONTEXT_CONCAT(booster_op_context_, __LINE__)( \
      ::booster::ErrorContextFrame::Kind::Op, name_literal)
