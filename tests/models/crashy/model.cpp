// A test model library that crashes (tests/cli/test_cli_faults.cpp; Note [Naming the code that crashed]
// in booster/common/fatal_signal.h), built into build/test_models/libbooster_model_crashy.so:
//   crash_in_factory  a factory that writes through a null pointer
//   crash_in_forward  Linear(in, classes) -> CrashyLayer, whose forward writes through a null pointer
#include <cstdint>

#include "booster/nn/linear.h"
#include "booster/nn/model_registry.h"
#include "booster/tensor/random.h"

namespace {

using namespace booster;

// The fault's address, read at run time so the compiler cannot see the null store and drop or trap it.
volatile uintptr_t g_fault_address = 0;

[[noreturn]] void fault() {
  *reinterpret_cast<volatile int*>(g_fault_address) = 1;
  __builtin_unreachable();
}

class CrashyLayer : public nn::Module {
 public:
  Tensor forward(const Tensor&) override { fault(); }
  std::string name() const override { return "CrashyLayer"; }
};

class CrashyNet : public nn::Module {
 public:
  CrashyNet(int64_t in, int64_t classes, uint64_t seed) {
    Generator gen(seed);
    fc_ = register_module("fc", std::make_shared<nn::Linear>(in, classes, true, &gen));
    bad_ = register_module("bad", std::make_shared<CrashyLayer>());
    set_tensor_names();
  }
  Tensor forward(const Tensor& x) override { return (*bad_)((*fc_)(x)); }
  std::string name() const override { return "CrashyNet"; }

 private:
  std::shared_ptr<nn::Linear> fc_;
  std::shared_ptr<CrashyLayer> bad_;
};

void register_models(nn::ModelRegistrar& models) {
  models.add("crash_in_factory", [](const nlohmann::json&, uint64_t) -> nn::ModulePtr { fault(); });
  models.add("crash_in_forward", [](const nlohmann::json& cfg, uint64_t seed) -> nn::ModulePtr {
    return std::make_shared<CrashyNet>(cfg.at("in").get<int64_t>(), cfg.at("classes").get<int64_t>(), seed);
  });
}

}  // namespace

BOOSTER_MODEL_LIBRARY("crashy", register_models)
