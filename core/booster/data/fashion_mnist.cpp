#include "booster/data/fashion_mnist.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "booster/common/error.h"
#include "booster/data/dataset.h"

namespace booster::data {

namespace {

constexpr uint32_t kLabelMagic = 0x00000801;  // unsigned bytes, 1 dimension
constexpr uint32_t kImageMagic = 0x00000803;  // unsigned bytes, 3 dimensions
constexpr int64_t kRows = 28, kCols = 28;
constexpr int kNumClasses = 10;

const char* const kInstallHint =
    "install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or pass the "
    "folder that holds the Fashion-MNIST IDX files";

// The path of `name` in `dir`: the .gz file, else an uncompressed copy (GzReader reads both).
std::string find_file(const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  BOOSTER_CHECK(!fs::exists(dir) || fs::is_directory(dir), DataError, "load_fashion_mnist: ", dir,
                " is a file, not a directory; pass the folder that holds the Fashion-MNIST IDX files");
  const fs::path gz = fs::path(dir) / (name + ".gz");
  const fs::path raw = fs::path(dir) / name;
  for (const fs::path& file : {gz, raw}) {
    if (!fs::exists(file)) continue;
    check_data_file(file, "load_fashion_mnist: ", std::string("expected the IDX file ") + name + "(.gz)");
    return file.string();
  }
  BOOSTER_FAIL(DataError, "load_fashion_mnist: missing ", gz.string(), "; ", kInstallHint);
}

// A whole IDX file, decompressed: its header dimensions and its payload bytes.
struct IdxFile {
  std::vector<uint32_t> dims;
  std::vector<uint8_t> payload;
};

// Reads an IDX file, gzip-compressed or not. Note [Whole gzip streams]: gzread takes a stream cut
// inside its CRC/length trailer for the end of a file still being written and returns no error (found
// with the last 4 bytes of train-images removed), so the reader inflates the file itself: inflate()
// in gzip mode returns Z_STREAM_END only after it has read and verified the CRC-32 and the length, and
// anything short of that at the end of the file is an error. Concatenated members are read in turn,
// as gunzip does; bytes after the last member that do not start another member are refused.
class GzReader {
 public:
  explicit GzReader(std::string path) : path_(std::move(path)), in_(path_, std::ios::binary) {
    BOOSTER_CHECK(in_.is_open(), DataError, "load_fashion_mnist: cannot open ", path_, ": ", std::strerror(errno),
                  "; ", kInstallHint);
    input_.resize(size_t(1) << 20);
    refill();
    gzip_ = avail_ >= 2 && uint8_t(input_[0]) == 0x1f && uint8_t(input_[1]) == 0x8b;
    if (gzip_) start_member();
  }
  ~GzReader() {
    if (inflating_) inflateEnd(&z_);
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to n bytes; returns how many were read (fewer only at the verified end of the data).
  size_t read(void* dst, size_t n) {
    auto* out = static_cast<uint8_t*>(dst);
    size_t done = 0;
    while (done < n) {
      if (!gzip_) {  // an uncompressed copy: the bytes as they are
        if (avail_ == 0 && !refill()) break;
        const size_t take = std::min(n - done, avail_);
        std::memcpy(out + done, input_.data() + pos_, take);
        pos_ += take, avail_ -= take, done += take;
        continue;
      }
      if (!inflating_) {  // between members: another one, or the end of the file
        if (avail_ == 0 && !refill()) break;
        BOOSTER_CHECK(avail_ >= 2 || refill(), DataError, "load_fashion_mnist: ", path_,
                      " has stray bytes after its gzip stream; ", kReplaceHint);
        BOOSTER_CHECK(uint8_t(input_[pos_]) == 0x1f && uint8_t(input_[pos_ + 1]) == 0x8b, DataError,
                      "load_fashion_mnist: ", path_, " has bytes after its gzip stream that are not gzip data; ",
                      kReplaceHint);
        start_member();
      }
      if (avail_ == 0 && !refill())
        BOOSTER_FAIL(DataError, "load_fashion_mnist: ", path_,
                     " is truncated: its gzip stream or its CRC/length trailer is cut short; ", kReplaceHint);
      z_.next_in = reinterpret_cast<Bytef*>(input_.data() + pos_);
      z_.avail_in = uInt(avail_);
      z_.next_out = out + done;
      z_.avail_out = uInt(std::min<size_t>(n - done, size_t(1) << 30));
      const uInt before = z_.avail_out;
      const int rc = inflate(&z_, Z_NO_FLUSH);
      done += before - z_.avail_out;
      pos_ += avail_ - z_.avail_in, avail_ = z_.avail_in;
      if (rc == Z_STREAM_END) {
        inflateEnd(&z_);
        inflating_ = false;
      } else {
        BOOSTER_CHECK(rc == Z_OK || rc == Z_BUF_ERROR, DataError, "load_fashion_mnist: ", path_,
                      " is corrupt (zlib: ", z_.msg ? z_.msg : zError(rc), "); ", kReplaceHint);
      }
    }
    return done;
  }

  // Reads exactly n bytes of `what`, else throws naming the file and how far it got.
  void read_exact(void* dst, size_t n, const char* what) {
    const size_t got = read(dst, n);
    BOOSTER_CHECK(got == n, DataError, "load_fashion_mnist: ", path_, " is truncated: its ", what, " needs ", n,
                  " bytes but the file ended after ", got, "; ", kReplaceHint);
  }

  const std::string& path() const { return path_; }

 private:
  static constexpr const char* kReplaceHint =
      "replace it with a good copy (apt-get install --reinstall dataset-fashion-mnist)";

  // Moves the unread bytes to the front and reads more of the file after them; false at its end.
  bool refill() {
    if (pos_ > 0 && avail_ > 0) std::memmove(input_.data(), input_.data() + pos_, avail_);
    pos_ = 0;
    if (!in_) return false;
    in_.read(input_.data() + avail_, std::streamsize(input_.size() - avail_));
    const size_t got = size_t(in_.gcount());
    avail_ += got;
    return got > 0;
  }

  void start_member() {
    std::memset(&z_, 0, sizeof(z_));
    BOOSTER_CHECK(inflateInit2(&z_, 16 + MAX_WBITS) == Z_OK, DataError, "load_fashion_mnist: zlib cannot start "
                  "inflating ", path_);
    inflating_ = true;
  }

  std::string path_;
  std::ifstream in_;
  std::vector<char> input_;
  size_t pos_ = 0, avail_ = 0;  // the unread bytes are input_[pos_, pos_ + avail_)
  bool gzip_ = false, inflating_ = false;
  z_stream z_{};
};

uint32_t big_endian_u32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | uint32_t(p[3]);
}

IdxFile read_idx(const std::string& path, uint32_t magic, size_t ndims) {
  GzReader in(path);
  IdxFile f;
  std::array<uint8_t, 4> word{};
  in.read_exact(word.data(), 4, "header");
  const uint32_t got_magic = big_endian_u32(word.data());
  BOOSTER_CHECK(got_magic == magic, DataError, "load_fashion_mnist: ", path, " has magic number 0x", std::hex,
                got_magic, ", expected 0x", magic, std::dec,
                " (an IDX file of unsigned bytes with ", ndims, " dimensions); it is not the right file or is corrupt");
  size_t count = 1;
  for (size_t d = 0; d < ndims; ++d) {
    in.read_exact(word.data(), 4, "header");
    f.dims.push_back(big_endian_u32(word.data()));
    count *= f.dims.back();
  }
  f.payload.resize(count);
  in.read_exact(f.payload.data(), count, "data");
  // Anything after the payload means the header lies about the sizes. Reading on also makes zlib
  // reach the end of the gzip stream and check its CRC, so a corrupt tail is caught.
  uint8_t extra = 0;
  BOOSTER_CHECK(in.read(&extra, 1) == 0, DataError, "load_fashion_mnist: ", path,
                " has more data than its header's sizes ", f.dims, " announce; it is corrupt");
  return f;
}

}  // namespace

std::shared_ptr<TensorDataset> load_fashion_mnist(const std::string& dir, bool train, bool normalize) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string image_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::string label_path = find_file(dir, prefix + "-labels-idx1-ubyte");

  const IdxFile labels = read_idx(label_path, kLabelMagic, 1);
  const IdxFile images = read_idx(image_path, kImageMagic, 3);
  BOOSTER_CHECK(images.dims[1] == kRows && images.dims[2] == kCols, DataError, "load_fashion_mnist: ",
                image_path, " holds images of ", images.dims[1], "x", images.dims[2], ", expected ", kRows,
                "x", kCols);
  BOOSTER_CHECK(images.dims[0] == labels.dims[0], DataError, "load_fashion_mnist: ", image_path, " holds ",
                images.dims[0], " images but ", label_path, " holds ", labels.dims[0],
                " labels; the two files must come from the same split");

  const int64_t n = images.dims[0];
  Tensor x = Tensor::empty({n, kRows * kCols}, DType::Float32);
  Tensor y = Tensor::empty({n}, DType::Int64);

  // pixel / 255, then optionally (p - mean) / std, folded into one multiply-add the compiler vectorizes.
  const float scale = normalize ? 1.0f / (255.0f * kFashionMnistStd) : 1.0f / 255.0f;
  const float shift = normalize ? -kFashionMnistMean / kFashionMnistStd : 0.0f;
  float* px = x.data<float>();
  const uint8_t* src = images.payload.data();
  const size_t total = images.payload.size();
  for (size_t i = 0; i < total; ++i) px[i] = float(src[i]) * scale + shift;

  int64_t* py = y.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t label = labels.payload[size_t(i)];
    BOOSTER_CHECK(label < kNumClasses, DataError, "load_fashion_mnist: ", label_path, " has label ", int(label),
                  " at index ", i, ", expected 0..", kNumClasses - 1, "; it is corrupt");
    py[i] = label;
  }
  return std::make_shared<TensorDataset>(std::move(x), std::move(y));
}

}  // namespace booster::data
