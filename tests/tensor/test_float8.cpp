// float8_e4m3fn and float8_e5m2 storage: every bit pattern both ways against a table derived from the
// format definitions alone (tests/fixtures/make_float8_fixtures.py), every float16 and bfloat16
// pattern through a CRC of the expected bytes, and the dtype's plumbing (save/load, refusals).
#include <zlib.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "booster/checkpoint/safetensors.h"
#include "booster/distributed/local_process_group.h"
#include "booster/ops/ops.h"
#include "fixture.h"

using namespace booster;

namespace {

const char* kFormats[] = {"float8_e4m3fn", "float8_e5m2"};

uint32_t parse_hex(const std::string& s) { return uint32_t(std::stoul(s, nullptr, 16)); }

float bits_to_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

uint32_t f32_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

Tensor float8_from_bytes(const std::vector<uint8_t>& bytes, DType dtype) {
  Tensor t = Tensor::empty({int64_t(bytes.size())}, dtype);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  REQUIRE(is_float8(t.dtype()));
  const Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.numel());
}

std::string hex(uint32_t v, int width) {
  std::ostringstream os;
  os << std::hex;
  os.width(width);
  os.fill('0');
  os << v;
  return os.str();
}

}  // namespace

TEST_CASE("float8: every bit pattern decodes to the value the format defines") {
  const auto table = testing::load_fixture_json("float8.json");
  for (const char* name : kFormats) {
    const DType dtype = dtype_from_string(name);
    const auto& decode = table.at(name).at("decode");
    REQUIRE(decode.size() == 256);
    std::vector<uint8_t> all(256);
    for (int p = 0; p < 256; ++p) all[size_t(p)] = uint8_t(p);
    const Tensor as_float = float8_from_bytes(all, dtype).to(DType::Float32);
    const Tensor scaled = from_float8(float8_from_bytes(all, dtype), 1.0f, DType::Float32);
    const std::vector<float> v = as_float.to_vector<float>(), w = scaled.to_vector<float>();
    for (int p = 0; p < 256; ++p) {
      INFO(name << " pattern 0x" << hex(uint32_t(p), 2));
      const std::string want = decode[size_t(p)].get<std::string>();
      if (want == "nan") {
        CHECK(std::isnan(v[size_t(p)]));
        CHECK(std::isnan(w[size_t(p)]));
      } else if (want == "+inf" || want == "-inf") {
        CHECK(v[size_t(p)] == (want == "+inf" ? INFINITY : -INFINITY));
      } else {
        CHECK(hex(f32_to_bits(v[size_t(p)]), 8) == want);  // the sign of zero too
        CHECK(f32_to_bits(w[size_t(p)]) == f32_to_bits(v[size_t(p)]));
      }
    }
    CHECK(float(table.at(name).at("max").get<double>()) ==
          (dtype == DType::Float8E4M3FN ? Float8E4M3FN::kMax : Float8E5M2::kMax));
  }
}

TEST_CASE("float8: float32 values round to nearest even, saturating or not") {
  const auto table = testing::load_fixture_json("float8.json");
  for (const char* name : kFormats) {
    const DType dtype = dtype_from_string(name);
    std::vector<float> inputs;
    std::vector<uint8_t> plain, saturated;
    for (const auto& line : table.at(name).at("encode_float32")) {
      std::istringstream in(line.get<std::string>());
      std::string x, p, s;
      in >> x >> p >> s;
      inputs.push_back(bits_to_f32(parse_hex(x)));
      plain.push_back(uint8_t(parse_hex(p)));
      saturated.push_back(uint8_t(parse_hex(s)));
    }
    REQUIRE(inputs.size() > 2000);
    const Tensor x = from_vector(inputs, {int64_t(inputs.size())});
    const std::vector<uint8_t> got_to = bytes_of(x.to(dtype));  // .to(): PyTorch's non-saturating cast
    const std::vector<uint8_t> got_plain = bytes_of(to_float8(x, dtype));
    const std::vector<uint8_t> got_sat = bytes_of(to_float8(x, dtype, 1.0f, /*saturate=*/true));
    int mismatches = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const bool ok = got_to[i] == plain[i] && got_plain[i] == plain[i] && got_sat[i] == saturated[i];
      if (!ok && ++mismatches <= 10) {
        FAIL_CHECK(name << ": float32 0x" << hex(f32_to_bits(inputs[i]), 8) << " (" << inputs[i] << ") gave 0x"
                        << hex(got_plain[i], 2) << " / saturating 0x" << hex(got_sat[i], 2) << ", expected 0x"
                        << hex(plain[i], 2) << " / 0x" << hex(saturated[i], 2));
      }
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("float8: every float16 and bfloat16 pattern converts as the format defines") {
  const auto table = testing::load_fixture_json("float8.json");
  std::vector<uint16_t> all(65536);
  for (uint32_t p = 0; p < 65536; ++p) all[p] = uint16_t(p);
  for (const DType src_dtype : {DType::Float16, DType::BFloat16}) {
    Tensor src = Tensor::empty({65536}, src_dtype);
    std::memcpy(src.data_ptr(), all.data(), all.size() * 2);
    const std::string key = src_dtype == DType::Float16 ? "crc32_from_float16" : "crc32_from_bfloat16";
    for (const char* name : kFormats) {
      const DType dtype = dtype_from_string(name);
      for (const bool saturate : {false, true}) {
        INFO(name << " from " << src_dtype << (saturate ? ", saturating" : ""));
        const std::vector<uint8_t> got = bytes_of(to_float8(src, dtype, 1.0f, saturate));
        const uLong crc = crc32(crc32(0L, Z_NULL, 0), got.data(), uInt(got.size()));
        CHECK(crc == table.at(name).at(key).at(saturate ? "saturate" : "plain").get<uLong>());
        if (!saturate) CHECK(bytes_of(src.to(dtype)) == got);
      }
    }
  }
}

TEST_CASE("float8: a scale multiplies before the one rounding, and dequantize divides it out") {
  const Tensor x = from_vector(std::vector<float>{1.0f, -3.0f, 300.0f, 1e-3f}, {4});
  // 300 * 2 = 600 overflows e4m3fn (max 448): NaN plain, 448 saturated.
  const std::vector<float> plain = to_float8(x, DType::Float8E4M3FN, 2.0f).to(DType::Float32).to_vector<float>();
  CHECK(plain[0] == 2.0f);
  CHECK(plain[1] == -6.0f);
  CHECK(std::isnan(plain[2]));
  CHECK(plain[3] == std::ldexp(1.0f, -9));  // 2e-3 rounds to the smallest subnormal, 2^-9 = 1.95e-3
  const Tensor q = to_float8(x, DType::Float8E4M3FN, 2.0f, true);
  const std::vector<float> back = from_float8(q, 0.5f).to_vector<float>();
  CHECK(back[0] == 1.0f);
  CHECK(back[1] == -3.0f);
  CHECK(back[2] == 224.0f);
  const std::vector<float> bf = from_float8(q, 0.5f, DType::BFloat16).to(DType::Float32).to_vector<float>();
  CHECK(bf == back);  // every float8 value halved is a bfloat16 value
}

TEST_CASE("float8: tensors save, load, fill and print, and arithmetic is refused with the fix") {
  const Tensor x = from_vector(std::vector<float>{0.5f, -2.0f, 448.0f}, {3});
  const Tensor a = x.to(DType::Float8E4M3FN);
  const Tensor b = x.to(DType::Float8E5M2);
  CHECK(a.dtype() == DType::Float8E4M3FN);
  CHECK(itemsize(DType::Float8E5M2) == 1);
  CHECK(std::string(dtype_name(DType::Float8E5M2)) == "float8_e5m2");
  CHECK(dtype_from_string("e4m3") == DType::Float8E4M3FN);
  CHECK(a.to_vector<double>() == std::vector<double>{0.5, -2.0, 448.0});
  CHECK(b.to_vector<double>() == std::vector<double>{0.5, -2.0, 448.0});
  CHECK(a.narrow(0, 1, 1).item() == -2.0);
  CHECK(a.str().find("float8_e4m3fn") != std::string::npos);
  Tensor f = Tensor::empty({2}, DType::Float8E5M2);
  f.fill_(3.0);
  CHECK(f.to_vector<double>() == std::vector<double>{3.0, 3.0});

  const auto dir = std::filesystem::temp_directory_path() / "booster_test_float8";
  std::filesystem::create_directories(dir);
  const auto path = dir / "f8.safetensors";
  checkpoint::write_safetensors(path, {{"a", a}, {"b", b}});
  const auto loaded = checkpoint::read_safetensors(path);
  CHECK(loaded.tensors.at("a").dtype() == DType::Float8E4M3FN);
  CHECK(bytes_of(loaded.tensors.at("a")) == bytes_of(a));
  CHECK(bytes_of(loaded.tensors.at("b")) == bytes_of(b));
  std::filesystem::remove_all(dir);

  CHECK_THROWS_WITH(a + a, Catch::Contains("float8") && Catch::Contains("convert"));
  CHECK_THROWS_AS(promote_types(DType::Float8E4M3FN, DType::Float32), DTypeError);
  CHECK_THROWS_WITH(to_float8(a, DType::Float8E5M2), Catch::Contains("input must be float32"));
  CHECK_THROWS_WITH(to_float8(x, DType::Float16), Catch::Contains("target must be float8"));

  // Collectives move float8 bytes but refuse to reduce them (no process group can add float8).
  distributed::LocalProcessGroup pg;
  Tensor c = a.clone();
  pg.broadcast(c, 0);
  CHECK(bytes_of(c) == bytes_of(a));
  CHECK_THROWS_WITH(pg.all_reduce(c, distributed::ReduceOp::Sum), Catch::Contains("cannot reduce float8_e4m3fn"));
}
