// A test model library built for a plugin ABI version the host does not have: loading it must fail
// with a PluginError naming both versions and the file before its entry point is called (the entry
// point aborts, so a host that called it would crash the test).
#include <cstdlib>

#include "booster/nn/model_registry.h"

namespace {
void never_called(booster::nn::ModelRegistrar&) { std::abort(); }
}  // namespace

BOOSTER_MODEL_LIBRARY_WITH_ABI("bad_abi", never_called, BOOSTER_PLUGIN_ABI_VERSION + 1000)
