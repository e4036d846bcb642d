// SHA-256 and HMAC-SHA256 (core/booster/common/sha256.h) against published vectors only: the NIST
// examples of FIPS 180-4 (csrc.nist.gov "SHA256.pdf", "SHA2_Additional.pdf") and RFC 4231's HMAC-SHA256
// test cases 1 to 7 (case 5, a truncated MAC, is compared on its first 16 bytes as the RFC does).
#include <catch2/catch.hpp>

#include <string>

#include "booster/common/sha256.h"

using booster::common::hmac_sha256;
using booster::common::sha256;
using booster::common::to_hex;

namespace {

std::string hex(const booster::common::Sha256Digest& d) { return to_hex(d.data(), d.size()); }

std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out += char(std::stoi(h.substr(i, 2), nullptr, 16));
  return out;
}

}  // namespace

TEST_CASE("sha256 matches the NIST examples", "[sha256]") {
  CHECK(hex(sha256("")) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(sha256("abc")) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // One million 'a' (FIPS 180-2 appendix B.3), fed in pieces of odd sizes to cross block edges.
  booster::common::Sha256 s;
  const std::string piece(997, 'a');
  size_t left = 1000000;
  while (left > 0) {
    const size_t n = std::min(left, piece.size());
    s.update(piece.data(), n);
    left -= n;
  }
  const auto d = s.finish();
  CHECK(to_hex(d.data(), d.size()) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // 55, 56 and 64 zero bytes: the padding's edge cases (one block, two blocks); digests from Python's
  // hashlib.sha256 (OpenSSL).
  CHECK(hex(sha256(std::string(64, '\0'))) == "f5a5fd42d16a20302798ef6ed309979b43003d2320d9f0e8ea9831a92759fb4b");
  CHECK(hex(sha256(std::string(56, '\0'))) == "d4817aa5497628e7c77e6b606107042bbba3130888c5f47a375e6179be789fbb");
  CHECK(hex(sha256(std::string(55, '\0'))) == "02779466cdec163811d078815c633f21901413081449002f24aa3e80f0b88ef7");
}

TEST_CASE("hmac_sha256 matches RFC 4231 test cases 1 to 7", "[sha256]") {
  struct Case {
    std::string key, data, mac;
  };
  const Case cases[] = {
      {std::string(20, '\x0b'), "Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::string(20, '\xaa'), std::string(50, '\xdd'),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {unhex("0102030405060708090a0b0c0d0e0f10111213141516171819"), std::string(50, '\xcd'),
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {std::string(131, '\xaa'),
       "This is a test using a larger than block-size key and a larger than block-size data. The key needs to "
       "be hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const Case& c : cases) CHECK(hex(hmac_sha256(c.key, c.data)) == c.mac);
  // Case 5: truncated to 128 bits.
  CHECK(hex(hmac_sha256(std::string(20, '\x0c'), "Test With Truncation")).substr(0, 32) ==
        "a3b6167473100ee06e0c796c2955552b");
}

TEST_CASE("digests_equal tells every differing byte", "[sha256]") {
  const auto a = sha256("x");
  CHECK(booster::common::digests_equal(a, a));
  for (size_t i = 0; i < a.size(); ++i) {
    auto b = a;
    b[i] ^= 1;
    CHECK_FALSE(booster::common::digests_equal(a, b));
  }
}
