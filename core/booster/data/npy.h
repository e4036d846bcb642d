// NumPy's file formats, read without Python: .npy (numpy.save) and .npz (numpy.savez and
// numpy.savez_compressed), and .npy written, so arrays go both ways between booster and NumPy.
//
// Note [The .npy format]
// ~~~~~~~~~~~~~~~~~~~~~~
// A .npy file is
//   6 bytes   the magic "\x93NUMPY"
//   2 bytes   the format version, major then minor (1.0, 2.0 or 3.0)
//   2 or 4    the header length, little-endian (2 bytes in version 1, 4 in versions 2 and 3)
//   header    a Python dict literal, e.g. {'descr': '<f4', 'fortran_order': False, 'shape': (60000, 784), }
//             padded with spaces and a newline so that the data starts aligned
//   the data  numel * itemsize bytes in the order the header says
// We read the element types a data set holds: '<f4' float32, '<f8' float64, '|u1' uint8, '<i4' int32,
// '<i8' int64 (little-endian; one-byte types may say '|', '<' or '='). Big-endian data, other types and
// Fortran (column-major) order are refused with a DataError that says how to re-save the array
// (numpy.ascontiguousarray, .astype). The data must end the file: a short file is truncated, a longer
// one is not what its header says.
//
// Note [The .npz format]
// ~~~~~~~~~~~~~~~~~~~~~~
// A .npz file is a zip archive with one <name>.npy per array. numpy.savez stores the members
// uncompressed, numpy.savez_compressed deflates them; both are read (deflate through zlib), Zip64
// sizes and offsets included, and each member's CRC-32 is checked. Encrypted or otherwise compressed
// members (bzip2, lzma) are refused.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "booster/tensor/tensor.h"

namespace booster::data {

// The element types an array file may hold (Note [The .npy format]).
enum class ArrayDType : uint8_t { Float32, Float64, UInt8, Int32, Int64 };
// "float32", "uint8", ...
const char* array_dtype_name(ArrayDType dtype);
size_t array_itemsize(ArrayDType dtype);
inline bool is_floating_array(ArrayDType dtype) { return dtype == ArrayDType::Float32 || dtype == ArrayDType::Float64; }

// An n-dimensional array as a file holds it: C order, little-endian elements.
struct Array {
  ArrayDType dtype = ArrayDType::Float32;
  Shape shape;
  std::vector<uint8_t> bytes;

  int64_t numel() const;
  // Element i as a double (exact for every value of the integer types up to 2^53).
  double at(int64_t i) const;
};

// A new contiguous CPU tensor of `dtype` with the array's shape, converted element by element
// (integers to floats exactly where the float holds them; floats to integers only when `dtype` is
// integral and every element is a whole number, else DataError naming `where`).
Tensor to_tensor(const Array& array, DType dtype, const std::string& where);

// Reads a .npy file. DataError naming the file: missing or unreadable, not .npy (bad magic), a header
// that does not parse, an unsupported dtype or byte order, Fortran order, or a size that does not
// match the header.
Array read_npy(const std::filesystem::path& path);
// The same, from bytes in memory; `where` names them in errors ("data.npz member 'x.npy'").
Array parse_npy(const uint8_t* data, size_t size, const std::string& where);

// Writes a float32, float64, int32 or int64 tensor as a version 1.0 .npy file that numpy.load reads.
void write_npy(const std::filesystem::path& path, const Tensor& tensor);

// Every array of a .npz file by name ("x" for the member "x.npy"). DataError naming the file and member
// for anything read_npy refuses and for a damaged archive (bad signatures, sizes, CRC, compression).
std::map<std::string, Array> read_npz(const std::filesystem::path& path);

}  // namespace booster::data
