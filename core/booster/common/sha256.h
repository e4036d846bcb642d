// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the job secret's challenge-response (Note [Job
// secret] in distributed/README.md): the project links no crypto library, and these two are small.
// Not for bulk hashing of weights (checkpoint/checksums has its own, faster sums).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace booster::common {

using Sha256Digest = std::array<uint8_t, 32>;

// Incremental SHA-256: update() any number of times, then finish() once.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  Sha256Digest finish();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t have_ = 0;
  uint64_t total_ = 0;
};

Sha256Digest sha256(std::string_view data);

// HMAC-SHA256 of `message` under `key` (any length; a key over 64 bytes is hashed first, RFC 2104).
Sha256Digest hmac_sha256(std::string_view key, std::string_view message);

// Equal digests, in time that does not depend on where they differ.
bool digests_equal(const Sha256Digest& a, const Sha256Digest& b);

// Lower-case hex of `n` bytes.
std::string to_hex(const uint8_t* data, size_t n);

}  // namespace booster::common
