// A seeded generator that gives the same numbers on every machine and compiler.
//
// std::normal_distribution and friends are implementation-defined, so the transforms are ours:
// uniform floats from the top 24 (or 53) bits, normals by Box-Muller.
#pragma once

#include <cstdint>
#include <vector>

namespace booster {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) { manual_seed(seed); }
  void manual_seed(uint64_t seed);
  uint64_t seed() const { return seed_; }

  uint64_t next_u64();                  // xoshiro256**
  double uniform();                     // [0, 1), 53 bits
  float uniform_float();                // [0, 1), 24 bits
  double normal();                      // N(0, 1)
  // The state that n calls of uniform() (or normal()) would leave, without making the values: a
  // deferred tensor records its draws and moves the generator on (deferred.h). Exact, spare included.
  void skip_uniform(int64_t n);
  void skip_normal(int64_t n);
  int64_t randint(int64_t low, int64_t high);  // [low, high), unbiased

  // The whole state, for checkpoints.
  std::vector<uint64_t> state() const;
  void set_state(const std::vector<uint64_t>& s);

 private:
  uint64_t seed_ = 0;
  uint64_t s_[4] = {};
  bool has_spare_ = false;
  double spare_ = 0.0;
};

// The process-wide default generator used when an op is given none.
Generator& default_generator();
inline void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace booster
