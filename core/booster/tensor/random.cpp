#include "booster/tensor/random.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "booster/common/error.h"

namespace booster {

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

void Generator::manual_seed(uint64_t seed) {
  seed_ = seed;
  uint64_t x = seed;
  for (auto& s : s_) s = splitmix64(x);
  has_spare_ = false;
  spare_ = 0.0;
}

uint64_t Generator::next_u64() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Generator::uniform() { return double(next_u64() >> 11) * 0x1.0p-53; }
float Generator::uniform_float() { return float(next_u64() >> 40) * 0x1.0p-24f; }

double Generator::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  double u1 = uniform();
  while (u1 <= 0.0) u1 = uniform();
  const double u2 = uniform();
  const double r = std::sqrt(-2.0 * std::log(u1));
  spare_ = r * std::sin(2.0 * M_PI * u2);
  has_spare_ = true;
  return r * std::cos(2.0 * M_PI * u2);
}

void Generator::skip_uniform(int64_t n) {
  for (int64_t i = 0; i < n; ++i) next_u64();
}

// Note [Skipping normals]: normal() makes its values in pairs from two uniforms, redrawing a first
// uniform of exactly 0 (its top 53 bits zero), and keeps the second value as the spare. Skipping a
// pair therefore draws the same raw numbers without the logarithm and trigonometry (about 10x faster);
// the last pair runs through normal() itself so that the spare, which state() saves, is the same too.
void Generator::skip_normal(int64_t n) {
  if (n > 0 && has_spare_) {
    has_spare_ = false;
    --n;
  }
  for (int64_t pairs = n / 2 - 1; pairs > 0; --pairs) {
    while ((next_u64() >> 11) == 0) {
    }
    next_u64();
  }
  for (int64_t i = std::max<int64_t>(n / 2 - 1, 0) * 2; i < n; ++i) normal();
}

int64_t Generator::randint(int64_t low, int64_t high) {
  BOOSTER_CHECK(high > low, ValueError, "randint: empty range [", low, ", ", high, ")");
  const uint64_t range = uint64_t(high - low);
  const uint64_t limit = UINT64_MAX - UINT64_MAX % range;  // reject the biased tail
  uint64_t x;
  do x = next_u64();
  while (x >= limit);
  return low + int64_t(x % range);
}

std::vector<uint64_t> Generator::state() const {
  uint64_t spare_bits;
  static_assert(sizeof(double) == sizeof(uint64_t));
  std::memcpy(&spare_bits, &spare_, 8);
  return {seed_, s_[0], s_[1], s_[2], s_[3], uint64_t(has_spare_), spare_bits};
}

void Generator::set_state(const std::vector<uint64_t>& s) {
  BOOSTER_CHECK(s.size() == 7, CheckpointError, "Generator::set_state: expected 7 words, got ", s.size());
  seed_ = s[0];
  for (int i = 0; i < 4; ++i) s_[i] = s[size_t(i) + 1];
  has_spare_ = s[5] != 0;
  std::memcpy(&spare_, &s[6], 8);
}

Generator& default_generator() {
  static Generator g(0);
  return g;
}

}  // namespace booster
