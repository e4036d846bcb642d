#include "booster/data/fashion_mnist.h"

#include <zlib.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <vector>

#include "booster/common/error.h"

namespace booster::data {

namespace {

constexpr uint32_t kLabelMagic = 0x00000801;  // unsigned bytes, 1 dimension
constexpr uint32_t kImageMagic = 0x00000803;  // unsigned bytes, 3 dimensions
constexpr int64_t kRows = 28, kCols = 28;
constexpr int kNumClasses = 10;

const char* const kInstallHint =
    "install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or pass the "
    "folder that holds the Fashion-MNIST IDX files";

// The path of `name` in `dir`: the .gz file, else an uncompressed copy (gzread reads both).
std::string find_file(const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path gz = fs::path(dir) / (name + ".gz");
  if (fs::exists(gz)) return gz.string();
  const fs::path raw = fs::path(dir) / name;
  if (fs::exists(raw)) return raw.string();
  BOOSTER_FAIL(DataError, "load_fashion_mnist: missing ", gz.string(), "; ", kInstallHint);
}

// A whole IDX file, decompressed: its header dimensions and its payload bytes.
struct IdxFile {
  std::vector<uint32_t> dims;
  std::vector<uint8_t> payload;
};

class GzReader {
 public:
  explicit GzReader(std::string path) : path_(std::move(path)) {
    file_ = gzopen(path_.c_str(), "rb");
    BOOSTER_CHECK(file_ != nullptr, DataError, "load_fashion_mnist: cannot open ", path_, ": ",
                  std::strerror(errno), "; ", kInstallHint);
    gzbuffer(file_, 1 << 20);  // fewer, larger reads of the compressed file
  }
  ~GzReader() {
    if (file_) gzclose_r(file_);
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to n bytes; returns how many were read (fewer only at the end of the data).
  size_t read(void* dst, size_t n) {
    size_t done = 0;
    while (done < n) {
      const unsigned chunk = unsigned(std::min<size_t>(n - done, size_t(1) << 30));
      const int got = gzread(file_, static_cast<char*>(dst) + done, chunk);
      if (got < 0) {
        int code = 0;
        const char* msg = gzerror(file_, &code);
        BOOSTER_FAIL(DataError, "load_fashion_mnist: ", path_, " is corrupt (zlib: ", msg,
                     "); replace it with a good copy (apt-get install --reinstall dataset-fashion-mnist)");
      }
      if (got == 0) break;
      done += size_t(got);
    }
    if (done < n) {
      // gzread treats a stream that stops early as the end of a file still being written (Z_BUF_ERROR),
      // not as an error: a gzip file cut inside its data or its CRC/length trailer would read as shorter.
      int code = 0;
      const char* msg = gzerror(file_, &code);
      BOOSTER_CHECK(code == Z_OK, DataError, "load_fashion_mnist: ", path_, " is truncated or corrupt (zlib: ", msg,
                    "; the gzip stream or its CRC/length trailer is cut short); replace it with a good copy "
                    "(apt-get install --reinstall dataset-fashion-mnist)");
    }
    return done;
  }

  // Reads exactly n bytes of `what`, else throws naming the file and how far it got.
  void read_exact(void* dst, size_t n, const char* what) {
    const size_t got = read(dst, n);
    BOOSTER_CHECK(got == n, DataError, "load_fashion_mnist: ", path_, " is truncated: its ", what,
                  " needs ", n, " bytes but the file ended after ", got,
                  "; replace it with a good copy (apt-get install --reinstall dataset-fashion-mnist)");
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  gzFile file_ = nullptr;
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
