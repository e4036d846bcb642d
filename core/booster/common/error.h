// Typed errors and the one check macro every layer uses.
//
// A message says what was wrong, with the values, and what would be right:
//   BOOSTER_CHECK(a.dim() == 2, ShapeError, "matmul: expected a 2-D tensor, got shape ", a.shape());
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace booster {

// Base of every error the library throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

#define BOOSTER_DEFINE_ERROR(Name)          \
  class Name : public Error {               \
   public:                                  \
    using Error::Error;                     \
  };

BOOSTER_DEFINE_ERROR(ShapeError)         // shapes that do not fit the op
BOOSTER_DEFINE_ERROR(DTypeError)         // a dtype the op does not take
BOOSTER_DEFINE_ERROR(IndexError)         // an index or dimension out of range
BOOSTER_DEFINE_ERROR(ValueError)         // a value out of its allowed range
BOOSTER_DEFINE_ERROR(DeviceError)        // a device that is absent or mixed
BOOSTER_DEFINE_ERROR(AutogradError)      // misuse of backward / requires_grad
BOOSTER_DEFINE_ERROR(StateError)         // a call in the wrong order (e.g. unscale_ twice)
BOOSTER_DEFINE_ERROR(ConfigError)        // a bad configuration key or value
BOOSTER_DEFINE_ERROR(IncompatibleError)  // a strategy/plugin combination that cannot work
BOOSTER_DEFINE_ERROR(PluginError)        // a plugin that cannot be found or loaded
BOOSTER_DEFINE_ERROR(CheckpointError)    // a checkpoint that cannot be read or does not match
BOOSTER_DEFINE_ERROR(DataError)          // a data set that is missing or malformed
BOOSTER_DEFINE_ERROR(DistributedError)   // a failed collective or a peer that went away
BOOSTER_DEFINE_ERROR(NotImplementedError)
BOOSTER_DEFINE_ERROR(TrainingError)      // training cannot go on (e.g. loss scale below its floor)
BOOSTER_DEFINE_ERROR(OutOfMemoryError)   // an allocation the host or device could not satisfy
BOOSTER_DEFINE_ERROR(IOError)            // a file the run promised to write could not be written

#undef BOOSTER_DEFINE_ERROR

namespace detail {

template <class T>
void stream_one(std::ostringstream& os, const T& v) {
  if constexpr (requires { v.begin(); v.end(); } && !std::is_convertible_v<T, std::string>) {
    os << '[';
    bool first = true;
    for (const auto& x : v) {
      if (!first) os << ", ";
      first = false;
      stream_one(os, x);
    }
    os << ']';
  } else {
    os << v;
  }
}

template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (stream_one(os, args), ...);
  return os.str();
}

}  // namespace detail

// Builds a message from any streamable values; vectors print as [a, b, c].
template <class... Args>
std::string str(const Args&... args) {
  return detail::concat(args...);
}

}  // namespace booster

#define BOOSTER_CHECK(cond, ErrorType, ...)                              \
  do {                                                                   \
    if (!(cond)) [[unlikely]] {                                          \
      throw ::booster::ErrorType(::booster::detail::concat(__VA_ARGS__)); \
    }                                                                    \
  } while (0)

#define BOOSTER_FAIL(ErrorType, ...) throw ::booster::ErrorType(::booster::detail::concat(__VA_ARGS__))
