// What a plugin shared library exports, and the version of that contract. The parallel plugin
// interface and its export macro are in parallel_plugin.h, beside this header.
//
// Note [Plugin ABI]
// A plugin is a shared library linked against libbooster_core. It need not come from this build: it may
// be built out of tree, against an installed prefix's headers and library, as long as it used the same
// compiler ABI and headers with the same BOOSTER_PLUGIN_ABI_VERSION. It exports four unmangled symbols
// (Boost.DLL aliases):
//   booster_plugin_abi_version  int()           the BOOSTER_PLUGIN_ABI_VERSION it was compiled with
//   booster_plugin_kind         const char*()   "precision", "parallel" or "model"
//   booster_plugin_name         const char*()   the name users select it by
//   its entry point             booster_create_precision (PrecisionFactory below), booster_create_parallel
//                               (ParallelFactory in parallel_plugin.h), or, for a model library,
//                               booster_register_models (ModelLibraryEntry in nn/model_registry.h)
// The host reads the version first and calls nothing else in a library whose version differs, so a
// stale plugin is refused with a PluginError naming both versions and the file instead of crashing on a
// changed vtable.
//
// Bump BOOSTER_PLUGIN_ABI_VERSION with any change a plugin compiled before it could not survive: a
// virtual function added, removed, reordered or re-typed in an interface a plugin implements or calls
// (MixedPrecision, ParallelPlugin, ModelRegistrar, CheckpointIO, ProcessGroup, Module, Optimizer,
// ...), a changed factory or entry-point signature (ModelFactory, ModelLibraryEntry), or a changed
// layout of a type a plugin shares: a class it derives from or
// allocates (MixedPrecision's or DataParallelPlugin's members, ...), a struct it passes or returns
// (TrainingParts, ParallelLayout, StepStats, ...). Adding non-virtual functions, free functions or
// classes to the core needs no bump, nor does giving an existing virtual a default (Note [Optional
// slots] in parallel_plugin.h). plugins/README.md states the rule for plugin authors.
//
// The version functions generated below have internal linkage on purpose: the core includes this
// header too, and an exported inline function would be interposed by the core's copy, so a plugin
// would report the host's version instead of its own.
#pragma once

#include <boost/dll/alias.hpp>
#include <memory>
#include <nlohmann/json.hpp>

#define BOOSTER_PLUGIN_ABI_VERSION 13

namespace booster::mixed_precision {
class MixedPrecision;
}

namespace booster::plugin {

// A precision plugin's factory: a new strategy built from its options, owned by the caller (the host
// binds it to the library, see loader.h). Errors are thrown as booster errors (ConfigError for options).
using PrecisionFactory = mixed_precision::MixedPrecision*(const nlohmann::json& options);

inline constexpr const char* kPrecisionKind = "precision";
inline constexpr const char* kParallelKind = "parallel";
// A model library registers models by name (Note [Model libraries] in booster/nn/model_registry.h).
inline constexpr const char* kModelKind = "model";

}  // namespace booster::plugin

// The identity every plugin library exports: its ABI version, kind and name.
#define BOOSTER_EXPORT_PLUGIN_IDENTITY(Kind, NameString, AbiVersion)                          \
  namespace booster_plugin_exports {                                                          \
  static int abi_version() { return (AbiVersion); }                                           \
  static const char* kind() { return #Kind; }                                                 \
  static const char* name() { return (NameString); }                                          \
  }                                                                                           \
  BOOST_DLL_ALIAS(booster_plugin_exports::abi_version, booster_plugin_abi_version)            \
  BOOST_DLL_ALIAS(booster_plugin_exports::kind, booster_plugin_kind)                          \
  BOOST_DLL_ALIAS(booster_plugin_exports::name, booster_plugin_name)

// The general form: exports the identity and `Factory` as booster_create_<Kind>. Plugins use the
// kind-specific macros below; tests use this one to build a plugin with a wrong version.
#define BOOSTER_EXPORT_PLUGIN_WITH_ABI(Kind, NameString, Factory, AbiVersion) \
  BOOSTER_EXPORT_PLUGIN_IDENTITY(Kind, NameString, AbiVersion)                \
  BOOST_DLL_ALIAS(Factory, booster_create_##Kind)

// A precision plugin: `MakeStrategy` is any function
//   std::unique_ptr<booster::mixed_precision::MixedPrecision> MakeStrategy(const nlohmann::json& options)
// (see examples/static_fp16/plugin.cpp). The strategy is then selected by NameString, e.g. from a
// config's "mixed_precision": {"name": NameString, ...}.
#define BOOSTER_EXPORT_PRECISION_PLUGIN(NameString, MakeStrategy)                                  \
  namespace booster_plugin_exports {                                                               \
  static ::booster::mixed_precision::MixedPrecision* create_precision(const nlohmann::json& options) { \
    return (MakeStrategy)(options).release();                                                      \
  }                                                                                                \
  }                                                                                                \
  BOOSTER_EXPORT_PLUGIN_WITH_ABI(precision, NameString, booster_plugin_exports::create_precision,   \
                                 BOOSTER_PLUGIN_ABI_VERSION)
