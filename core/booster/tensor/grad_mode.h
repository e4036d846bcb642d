// Grad mode: whether ops record autograd history on this thread. Thread-local state at the bottom of
// the stack (as c10/core/GradMode.h), so the layers that consult it (tensor views, autocast's cast
// cache, autograd) need not include each other.
#pragma once

namespace booster::autograd {

// Is gradient recording on for this thread? (off inside NoGradGuard and during backward)
bool grad_mode_enabled();
void set_grad_mode(bool enabled);

class NoGradGuard {
 public:
  NoGradGuard() : prev_(grad_mode_enabled()) { set_grad_mode(false); }
  ~NoGradGuard() { set_grad_mode(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace booster::autograd

namespace booster {
using autograd::NoGradGuard;
}
