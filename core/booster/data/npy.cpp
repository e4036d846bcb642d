// .npy and .npz reading and .npy writing (Note [The .npy format] and Note [The .npz format] in npy.h).
#include "booster/data/npy.h"

#include <zlib.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "booster/checkpoint/atomic_file.h"
#include "booster/common/error.h"
#include "booster/data/dataset.h"

namespace booster::data {

namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "the array readers assume a little-endian host");

const char* array_dtype_name(ArrayDType dtype) {
  switch (dtype) {
    case ArrayDType::Float32: return "float32";
    case ArrayDType::Float64: return "float64";
    case ArrayDType::UInt8: return "uint8";
    case ArrayDType::Int32: return "int32";
    case ArrayDType::Int64: return "int64";
  }
  return "?";
}

size_t array_itemsize(ArrayDType dtype) {
  switch (dtype) {
    case ArrayDType::Float32: return 4;
    case ArrayDType::Float64: return 8;
    case ArrayDType::UInt8: return 1;
    case ArrayDType::Int32: return 4;
    case ArrayDType::Int64: return 8;
  }
  return 0;
}

int64_t Array::numel() const { return numel_of(shape); }

double Array::at(int64_t i) const {
  const uint8_t* p = bytes.data() + size_t(i) * array_itemsize(dtype);
  switch (dtype) {
    case ArrayDType::Float32: { float v; std::memcpy(&v, p, 4); return v; }
    case ArrayDType::Float64: { double v; std::memcpy(&v, p, 8); return v; }
    case ArrayDType::UInt8: return *p;
    case ArrayDType::Int32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case ArrayDType::Int64: { int64_t v; std::memcpy(&v, p, 8); return double(v); }
  }
  return 0.0;
}

namespace {

template <class Src, class Dst>
void convert(const uint8_t* src, Dst* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    Src v;
    std::memcpy(&v, src + size_t(i) * sizeof(Src), sizeof(Src));
    dst[i] = static_cast<Dst>(v);
  }
}

template <class Dst>
void convert_array(const Array& a, Dst* dst) {
  const int64_t n = a.numel();
  switch (a.dtype) {
    case ArrayDType::Float32: convert<float>(a.bytes.data(), dst, n); break;
    case ArrayDType::Float64: convert<double>(a.bytes.data(), dst, n); break;
    case ArrayDType::UInt8: convert<uint8_t>(a.bytes.data(), dst, n); break;
    case ArrayDType::Int32: convert<int32_t>(a.bytes.data(), dst, n); break;
    case ArrayDType::Int64: convert<int64_t>(a.bytes.data(), dst, n); break;
  }
}

}  // namespace

Tensor to_tensor(const Array& array, DType dtype, const std::string& where) {
  Tensor out = Tensor::empty(array.shape, dtype);
  switch (dtype) {
    case DType::Float32: convert_array(array, out.data<float>()); break;
    case DType::Float64: convert_array(array, out.data<double>()); break;
    case DType::Int64:
    case DType::Int32:
      if (is_floating_array(array.dtype)) {
        for (int64_t i = 0; i < array.numel(); ++i) {
          const double v = array.at(i);
          BOOSTER_CHECK(std::isfinite(v) && v == std::floor(v) && std::abs(v) < 9.0e15, DataError, where,
                        ": element ", i, " is ", v, ", not a whole number; ", dtype,
                        " values (class labels) must be integers");
        }
      }
      if (dtype == DType::Int64) convert_array(array, out.data<int64_t>());
      else convert_array(array, out.data<int32_t>());
      break;
    default:
      BOOSTER_FAIL(DTypeError, where, ": cannot convert an array to ", dtype,
                   "; expected float32, float64, int32 or int64");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------- .npy

namespace {

constexpr char kNpyMagic[] = "\x93NUMPY";
constexpr size_t kNpyMagicSize = 6;
const char* const kResaveHint = "re-save it with numpy.save(path, numpy.ascontiguousarray(a, dtype=...))";

// The Python dict literal of a .npy header: {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }.
// A small parser for exactly what numpy writes: string, boolean and tuple-of-integer values.
class HeaderParser {
 public:
  HeaderParser(std::string text, std::string where) : s_(std::move(text)), where_(std::move(where)) {}

  void parse(std::string& descr, bool& fortran_order, Shape& shape) {
    bool has_descr = false, has_order = false, has_shape = false;
    skip();
    expect('{');
    while (true) {
      skip();
      if (peek() == '}') break;
      const std::string key = string_literal();
      skip();
      expect(':');
      skip();
      if (key == "descr") {
        descr = string_literal();
        has_descr = true;
      } else if (key == "fortran_order") {
        fortran_order = boolean();
        has_order = true;
      } else if (key == "shape") {
        shape = tuple();
        has_shape = true;
      } else {
        fail("has the unknown key '" + key + "' (expected descr, fortran_order, shape)");
      }
      skip();
      if (peek() == ',') ++i_;
      else if (peek() != '}') fail("has no ',' or '}' after the value of '" + key + "'");
    }
    if (!has_descr || !has_order || !has_shape) fail("lacks one of the keys descr, fortran_order, shape");
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    BOOSTER_FAIL(DataError, where_, ": not a valid .npy header: the header ", what, " (header: ", s_, ")");
  }
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  void skip() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("has no '") + c + "' at offset " + std::to_string(i_));
    ++i_;
  }
  std::string string_literal() {
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail("has no quoted string at offset " + std::to_string(i_));
    ++i_;
    const size_t end = s_.find(quote, i_);
    if (end == std::string::npos) fail("has an unterminated string");
    std::string out = s_.substr(i_, end - i_);
    i_ = end + 1;
    return out;
  }
  bool boolean() {
    if (s_.compare(i_, 4, "True") == 0) return i_ += 4, true;
    if (s_.compare(i_, 5, "False") == 0) return i_ += 5, false;
    fail("has fortran_order that is neither True nor False");
  }
  Shape tuple() {
    expect('(');
    Shape shape;
    while (true) {
      skip();
      if (peek() == ')') break;
      if (peek() < '0' || peek() > '9') fail("has a shape entry that is not a non-negative integer");
      int64_t v = 0;
      while (peek() >= '0' && peek() <= '9') {
        if (v > (std::numeric_limits<int64_t>::max() - 9) / 10) fail("has a shape entry too large");
        v = v * 10 + (s_[i_++] - '0');
      }
      if (peek() == 'L') ++i_;  // Python 2's long suffix in old files
      shape.push_back(v);
      skip();
      if (peek() == ',') ++i_;
      else if (peek() != ')') fail("has a malformed shape tuple");
    }
    ++i_;
    return shape;
  }

  std::string s_, where_;
  size_t i_ = 0;
};

ArrayDType parse_descr(const std::string& descr, const std::string& where) {
  auto refuse = [&](const std::string& why) -> ArrayDType {
    BOOSTER_FAIL(DataError, where, ": dtype '", descr, "' ", why,
                 "; supported: '<f4' float32, '<f8' float64, '|u1' uint8, '<i4' int32, '<i8' int64 (", kResaveHint,
                 ")");
  };
  if (descr.size() != 3) return refuse("is not supported");
  const char order = descr[0];
  const std::string code = descr.substr(1);
  ArrayDType dtype;
  if (code == "f4") dtype = ArrayDType::Float32;
  else if (code == "f8") dtype = ArrayDType::Float64;
  else if (code == "u1") dtype = ArrayDType::UInt8;
  else if (code == "i4") dtype = ArrayDType::Int32;
  else if (code == "i8") dtype = ArrayDType::Int64;
  else return refuse("is not supported");
  // One byte has no order ('|'); wider types must be little-endian ('<', or '=' native on this host).
  if (dtype == ArrayDType::UInt8) return order == '|' || order == '<' || order == '=' || order == '>' ? dtype : refuse("is not supported");
  if (order == '>') return refuse("is big-endian");
  if (order != '<' && order != '=') return refuse("is not supported");
  return dtype;
}

uint32_t little_u32(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }
uint16_t little_u16(const uint8_t* p) { return uint16_t(p[0] | p[1] << 8); }
uint64_t little_u64(const uint8_t* p) { return uint64_t(little_u32(p)) | uint64_t(little_u32(p + 4)) << 32; }

// The header of a .npy image in memory: the array's dtype and shape, and where its data starts.
struct NpyHeader {
  ArrayDType dtype;
  Shape shape;
  size_t data_offset;
};

NpyHeader parse_npy_header(const uint8_t* data, size_t size, const std::string& where) {
  BOOSTER_CHECK(size >= kNpyMagicSize + 4 && std::memcmp(data, kNpyMagic, kNpyMagicSize) == 0, DataError, where,
                ": not a .npy file (it does not start with the magic \\x93NUMPY); save arrays with numpy.save");
  const int major = data[6], minor = data[7];
  BOOSTER_CHECK(major >= 1 && major <= 3 && minor == 0, DataError, where, ": .npy format version ", major, ".", minor,
                " is not supported (1.0, 2.0 and 3.0 are)");
  const size_t length_bytes = major == 1 ? 2 : 4;
  BOOSTER_CHECK(size >= 8 + length_bytes, DataError, where, ": truncated .npy header");
  const size_t header_len = major == 1 ? little_u16(data + 8) : little_u32(data + 8);
  const size_t header_start = 8 + length_bytes;
  BOOSTER_CHECK(header_len <= size - header_start, DataError, where, ": the .npy header length ", header_len,
                " passes the end of the data (", size, " bytes); the file is truncated");
  std::string descr;
  bool fortran_order = false;
  Shape shape;
  HeaderParser(std::string(reinterpret_cast<const char*>(data + header_start), header_len), where)
      .parse(descr, fortran_order, shape);
  NpyHeader h{parse_descr(descr, where), shape, header_start + header_len};
  BOOSTER_CHECK(!fortran_order || h.shape.size() <= 1, DataError, where, ": the array of shape ", h.shape,
                " is in Fortran (column-major) order; booster reads C order: ", kResaveHint);
  return h;
}

// numel * itemsize, refusing what overflows.
size_t data_bytes(const NpyHeader& h, const std::string& where) {
  size_t n = array_itemsize(h.dtype);
  for (int64_t d : h.shape) {
    BOOSTER_CHECK(d == 0 || n <= std::numeric_limits<size_t>::max() / size_t(d), DataError, where, ": shape ", h.shape,
                  " is too large");
    n *= size_t(d);
  }
  return n;
}

std::vector<uint8_t> read_whole_file(const fs::path& path, const char* what) {
  std::error_code ec;
  BOOSTER_CHECK(fs::exists(path, ec), DataError, path.string(), " does not exist; expected ", what);
  check_data_file(path, "", std::string("expected ") + what);
  std::ifstream in(path, std::ios::binary);
  BOOSTER_CHECK(in.good(), DataError, "cannot open ", path.string(), ": ", std::strerror(errno));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(0, std::ios::beg);
  std::vector<uint8_t> bytes(size_t(std::max<std::streamoff>(size, 0)));
  in.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(bytes.size()));
  BOOSTER_CHECK(in.good() || bytes.empty(), DataError, "cannot read ", path.string(), ": ", std::strerror(errno));
  return bytes;
}

}  // namespace

Array parse_npy(const uint8_t* data, size_t size, const std::string& where) {
  const NpyHeader h = parse_npy_header(data, size, where);
  const size_t nbytes = data_bytes(h, where);
  const size_t available = size - h.data_offset;
  BOOSTER_CHECK(available == nbytes, DataError, where, ": the header says shape ", h.shape, " of ",
                array_dtype_name(h.dtype), " (", nbytes, " bytes) but ", available, " bytes follow it; ",
                available < nbytes ? "the file is truncated" : "the file is not what its header says");
  Array a;
  a.dtype = h.dtype;
  a.shape = h.shape;
  a.bytes.assign(data + h.data_offset, data + size);
  return a;
}

Array read_npy(const fs::path& path) {
  std::vector<uint8_t> bytes = read_whole_file(path, "a .npy file (numpy.save)");
  const NpyHeader h = parse_npy_header(bytes.data(), bytes.size(), path.string());
  const size_t nbytes = data_bytes(h, path.string());
  const size_t available = bytes.size() - h.data_offset;
  BOOSTER_CHECK(available == nbytes, DataError, path.string(), ": the header says shape ", h.shape, " of ",
                array_dtype_name(h.dtype), " (", nbytes, " bytes) but ", available, " bytes follow it; ",
                available < nbytes ? "the file is truncated" : "the file is not what its header says");
  // The data in place, without a second copy of the file.
  bytes.erase(bytes.begin(), bytes.begin() + std::ptrdiff_t(h.data_offset));
  Array a;
  a.dtype = h.dtype;
  a.shape = h.shape;
  a.bytes = std::move(bytes);
  return a;
}

void write_npy(const fs::path& path, const Tensor& tensor) {
  const Tensor t = tensor.cpu().contiguous();
  const char* descr = nullptr;
  switch (t.dtype()) {
    case DType::Float32: descr = "<f4"; break;
    case DType::Float64: descr = "<f8"; break;
    case DType::Int32: descr = "<i4"; break;
    case DType::Int64: descr = "<i8"; break;
    default: BOOSTER_FAIL(DTypeError, "write_npy ", path.string(), ": cannot write ", t.dtype(), "; expected float32, float64, int32 or int64");
  }
  std::string shape = "(";
  for (size_t i = 0; i < t.shape().size(); ++i) shape += std::to_string(t.shape()[i]) + (t.shape().size() == 1 ? "," : i + 1 < t.shape().size() ? ", " : "");
  shape += ")";
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  // Magic, version and length take 10 bytes; pad so the data starts 64-byte aligned, ending in '\n'.
  const size_t total = (10 + header.size() + 1 + 63) / 64 * 64;
  header.append(total - 10 - header.size() - 1, ' ');
  header += '\n';
  BOOSTER_CHECK(header.size() <= 0xFFFF, ValueError, "write_npy ", path.string(), ": shape ", t.shape(), " is too long for a .npy header");
  checkpoint::write_file_atomically(path, [&](checkpoint::FileWriter& out) {
    const uint8_t prefix[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, uint8_t(header.size() & 0xFF), uint8_t(header.size() >> 8)};
    out.write(prefix, sizeof(prefix));
    out.write(header);
    out.write(t.data_ptr(), t.nbytes());
  });
}

// ---------------------------------------------------------------------------------------------- .npz

namespace {

constexpr uint32_t kLocalHeader = 0x04034b50, kCentralHeader = 0x02014b50, kEndOfCentralDir = 0x06054b50;
constexpr uint32_t kZip64EndOfCentralDir = 0x06064b50, kZip64Locator = 0x07064b50;

struct ZipMember {
  std::string name;
  uint16_t flags = 0, method = 0;
  uint32_t crc = 0;
  uint64_t compressed = 0, uncompressed = 0, local_offset = 0;
};

class ZipReader {
 public:
  explicit ZipReader(const fs::path& path) : path_(path), bytes_(read_whole_file(path, "a .npz file (numpy.savez)")) {}

  std::vector<ZipMember> members() const {
    const size_t eocd = find_end_of_central_directory();
    uint64_t count = u16(eocd + 10), cd_size = u32(eocd + 12), cd_offset = u32(eocd + 16);
    if (count == 0xFFFF || cd_size == 0xFFFFFFFF || cd_offset == 0xFFFFFFFF) {  // Zip64
      check(eocd >= 20 && u32(eocd - 20) == kZip64Locator, "its Zip64 end-of-directory locator is missing");
      const uint64_t eocd64 = u64(eocd - 20 + 8);
      check(eocd64 + 56 <= bytes_.size() && u32(size_t(eocd64)) == kZip64EndOfCentralDir,
            "its Zip64 end-of-directory record is damaged");
      count = u64(size_t(eocd64) + 32);
      cd_size = u64(size_t(eocd64) + 40);
      cd_offset = u64(size_t(eocd64) + 48);
    }
    check(cd_offset <= bytes_.size() && cd_size <= bytes_.size() - cd_offset, "its central directory passes the end of the file");
    std::vector<ZipMember> out;
    size_t at = size_t(cd_offset);
    for (uint64_t i = 0; i < count; ++i) {
      check(at + 46 <= bytes_.size() && u32(at) == kCentralHeader, "its central directory is damaged");
      ZipMember m;
      m.flags = u16(at + 8);
      m.method = u16(at + 10);
      m.crc = u32(at + 16);
      m.compressed = u32(at + 20);
      m.uncompressed = u32(at + 24);
      const size_t name_len = u16(at + 28), extra_len = u16(at + 30), comment_len = u16(at + 32);
      m.local_offset = u32(at + 42);
      check(at + 46 + name_len + extra_len + comment_len <= bytes_.size(), "its central directory is damaged");
      m.name.assign(reinterpret_cast<const char*>(&bytes_[at + 46]), name_len);
      // Zip64 extra field: the values that are 0xFFFFFFFF above, in this order.
      for (size_t e = at + 46 + name_len; e + 4 <= at + 46 + name_len + extra_len;) {
        const uint16_t id = u16(e), len = u16(e + 2);
        size_t v = e + 4;
        if (id == 0x0001) {
          if (m.uncompressed == 0xFFFFFFFF && v + 8 <= e + 4 + len) m.uncompressed = u64(v), v += 8;
          if (m.compressed == 0xFFFFFFFF && v + 8 <= e + 4 + len) m.compressed = u64(v), v += 8;
          if (m.local_offset == 0xFFFFFFFF && v + 8 <= e + 4 + len) m.local_offset = u64(v), v += 8;
        }
        e += 4 + len;
      }
      out.push_back(std::move(m));
      at += 46 + name_len + extra_len + comment_len;
    }
    return out;
  }

  // A member's uncompressed bytes, CRC-checked.
  std::vector<uint8_t> extract(const ZipMember& m) const {
    const std::string where = path_.string() + " member '" + m.name + "'";
    BOOSTER_CHECK(!(m.flags & 0x1), DataError, where, " is encrypted; booster reads plain numpy.savez archives");
    BOOSTER_CHECK(m.method == 0 || m.method == 8, DataError, where, " uses zip compression method ", m.method,
                  "; booster reads stored (numpy.savez) and deflated (numpy.savez_compressed) members");
    const size_t at = size_t(m.local_offset);
    BOOSTER_CHECK(at + 30 <= bytes_.size() && u32(at) == kLocalHeader, DataError, where,
                  ": its local header is damaged; the archive is corrupt");
    const size_t start = at + 30 + u16(at + 26) + u16(at + 28);
    BOOSTER_CHECK(start <= bytes_.size() && m.compressed <= bytes_.size() - start, DataError, where,
                  ": its data passes the end of the file; the archive is truncated");
    const uint8_t* src = bytes_.data() + start;
    std::vector<uint8_t> out;
    if (m.method == 0) {
      BOOSTER_CHECK(m.compressed == m.uncompressed, DataError, where, ": a stored member whose sizes differ");
      out.assign(src, src + m.compressed);
    } else {
      out.resize(size_t(m.uncompressed));
      z_stream z{};
      BOOSTER_CHECK(inflateInit2(&z, -MAX_WBITS) == Z_OK, DataError, where, ": zlib cannot start inflating");
      uint64_t in_done = 0, out_done = 0;
      int rc = Z_OK;
      while (rc == Z_OK) {
        const uInt in_chunk = uInt(std::min<uint64_t>(m.compressed - in_done, 1u << 30));
        const uInt out_chunk = uInt(std::min<uint64_t>(m.uncompressed - out_done, 1u << 30));
        z.next_in = const_cast<Bytef*>(src + in_done);
        z.avail_in = in_chunk;
        z.next_out = out.data() + out_done;
        z.avail_out = out_chunk;
        rc = inflate(&z, Z_NO_FLUSH);
        in_done += in_chunk - z.avail_in;
        out_done += out_chunk - z.avail_out;
        if (rc == Z_OK && in_chunk == z.avail_in && out_chunk == z.avail_out) rc = Z_BUF_ERROR;  // no progress
      }
      inflateEnd(&z);
      BOOSTER_CHECK(rc == Z_STREAM_END && out_done == m.uncompressed, DataError, where,
                    ": its deflated data is corrupt (zlib: ", z.msg ? z.msg : "the stream ends early", ")");
    }
    uLong crc = crc32(0L, Z_NULL, 0);
    for (size_t done = 0; done < out.size();) {
      const uInt chunk = uInt(std::min<size_t>(out.size() - done, 1u << 30));
      crc = crc32(crc, out.data() + done, chunk);
      done += chunk;
    }
    BOOSTER_CHECK(uint32_t(crc) == m.crc, DataError, where, ": CRC-32 mismatch; the archive is corrupt");
    return out;
  }

 private:
  void check(bool ok, const char* what) const {
    BOOSTER_CHECK(ok, DataError, path_.string(), ": not a readable .npz (zip) archive: ", what,
                  "; save arrays with numpy.savez or numpy.savez_compressed");
  }
  size_t find_end_of_central_directory() const {
    check(bytes_.size() >= 22, "it is shorter than a zip directory");
    const size_t lowest = bytes_.size() > 22 + 0xFFFF ? bytes_.size() - 22 - 0xFFFF : 0;
    for (size_t at = bytes_.size() - 22;; --at) {
      if (u32(at) == kEndOfCentralDir) return at;
      if (at == lowest) break;
    }
    check(false, "it has no end-of-central-directory record");
    return 0;
  }
  uint16_t u16(size_t at) const { return little_u16(&bytes_[at]); }
  uint32_t u32(size_t at) const { return little_u32(&bytes_[at]); }
  uint64_t u64(size_t at) const { return little_u64(&bytes_[at]); }

  fs::path path_;
  std::vector<uint8_t> bytes_;
};

}  // namespace

std::map<std::string, Array> read_npz(const fs::path& path) {
  ZipReader zip(path);
  std::map<std::string, Array> arrays;
  for (const ZipMember& m : zip.members()) {
    if (m.name.size() < 4 || m.name.compare(m.name.size() - 4, 4, ".npy") != 0) continue;
    const std::vector<uint8_t> bytes = zip.extract(m);
    const std::string name = m.name.substr(0, m.name.size() - 4);
    arrays[name] = parse_npy(bytes.data(), bytes.size(), path.string() + " member '" + m.name + "'");
  }
  return arrays;
}

}  // namespace booster::data
