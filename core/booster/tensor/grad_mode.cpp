#include "booster/tensor/grad_mode.h"

namespace booster::autograd {

namespace {
thread_local bool t_grad_mode = true;
}  // namespace

bool grad_mode_enabled() { return t_grad_mode; }
void set_grad_mode(bool enabled) { t_grad_mode = enabled; }

}  // namespace booster::autograd
