// A model library of a user's own: libbooster_model_my_net.so, built against an installed booster. A
// config selects its model by name, with options of its own, and `booster train` builds it:
//
//   "model": {"type": "my_net", "library": "my_net", "in": 8, "width": 32, "blocks": 2, "classes": 3}
//
// with the library on BOOSTER_PLUGIN_PATH (or "library": "/path/to/libbooster_model_my_net.so").
// Note [Model libraries] in <booster/nn/model_registry.h> says how it is loaded and kept alive.
#include <booster/booster.h>

using namespace booster;

namespace {

// x + W2 gelu(W1 x): a module class of the library's own, used as a child of MyNet. (Objects of a
// library's classes keep the library loaded while anything holds them: Note [Plugin lifetime].)
class Residual : public nn::Module {
 public:
  Residual(int64_t width, Generator* gen) {
    up_ = register_module("up", std::make_shared<nn::Linear>(width, 2 * width, true, gen));
    down_ = register_module("down", std::make_shared<nn::Linear>(2 * width, width, true, gen));
  }
  Tensor forward(const Tensor& x) override { return x + (*down_)(gelu((*up_)(x))); }
  std::string name() const override { return "Residual"; }

 private:
  std::shared_ptr<nn::Linear> up_, down_;
};

// in -> width, then `blocks` residual blocks, then a classifier head.
class MyNet : public nn::Module {
 public:
  MyNet(int64_t in, int64_t width, int64_t blocks, int64_t classes, uint64_t seed) {
    Generator gen(seed);
    stem_ = register_module("stem", std::make_shared<nn::Linear>(in, width, true, &gen));
    for (int64_t b = 0; b < blocks; ++b)
      blocks_.push_back(register_module("block" + std::to_string(b), std::make_shared<Residual>(width, &gen)));
    head_ = register_module("head", std::make_shared<nn::Linear>(width, classes, true, &gen));
    set_tensor_names();
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*stem_)(x.reshape({x.size(0), -1}));
    for (const auto& block : blocks_) h = (*block)(h);
    return (*head_)(h);
  }
  std::string name() const override { return "MyNet"; }

 private:
  std::shared_ptr<nn::Linear> stem_, head_;
  std::vector<std::shared_ptr<Residual>> blocks_;
};

// The model section arrives without "library"; OptionReader names a bad or unknown key.
nn::ModulePtr make_my_net(const nlohmann::json& cfg, uint64_t seed) {
  config::OptionReader options("model", "my_net", cfg);
  options.raw("type", "my_net");
  const int64_t in = options.integer("in", 784, 1, 1 << 24);
  const int64_t width = options.integer("width", 64, 1, 1 << 16);
  const int64_t blocks = options.integer("blocks", 2, 0, 64);
  const int64_t classes = options.integer("classes", 10, 2, 1 << 20);
  options.finish();
  return std::make_shared<MyNet>(in, width, blocks, classes, seed);
}

void register_models(nn::ModelRegistrar& models) { models.add("my_net", make_my_net); }

}  // namespace

BOOSTER_MODEL_LIBRARY("my_net", register_models)
