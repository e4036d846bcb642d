// The safetensors file format, and model weights saved as Hugging Face lays them out.
//
// Note [The safetensors format]
// A file is
//   8 bytes   N, the header length, unsigned little-endian
//   N bytes   a JSON object: {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
//                             ..., "__metadata__": {"<key>": "<string value>", ...}}
//             padded with spaces so that the data starts 8-byte aligned
//   the data  every tensor's elements, row-major, little-endian, at [begin, end) relative to the data's
//             start. The spans tile the data exactly: no gaps, no overlaps, nothing after the last.
// dtype names: F64 F32 F16 BF16 I64 I32 BOOL (the ones booster has; BOOL is one byte, 0 or 1).
// We write tensors sorted by name with contiguous offsets, as the reference writer does for tensors of
// one dtype, and the header as it does (compact JSON, "__metadata__" first, then each tensor's
// "dtype", "shape", "data_offsets" in that order), so files are byte-identical for equal inputs and read by PyTorch's tools (safetensors.torch.load_file,
// transformers' from_pretrained).
//
// The reader trusts nothing in the file: the header length against the file size, the JSON, every
// dtype, shape and offset, and that the spans tile the data. Any violation is a CheckpointError that
// names the file and what is wrong; it never reads outside the file or allocates from an unchecked size.
//
// Note [Sharded model files]
// save_model() writes `model.safetensors`, or, when the tensors exceed max_shard_bytes,
// `model-00001-of-0000N.safetensors` ... plus `model.safetensors.index.json`
//   {"metadata": {"total_size": <bytes of tensor data>}, "weight_map": {"<name>": "<shard file>"}}
// with the names and index format of transformers' save_pretrained and its greedy split: a new shard
// starts when the next tensor would overflow the current one (a tensor larger than the limit gets a
// shard alone). We take tensors in name order (transformers takes the state dict's order).
// Each file is replaced atomically and the index is written last, but a save into a directory that
// already holds a model is not atomic as a whole (an interrupted save may mix old and new shards;
// load_model reports shards that disagree with the index). save_checkpoint writes into a fresh directory and commits it by a rename.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "booster/tensor/tensor.h"

namespace booster::checkpoint {

using TensorMap = std::map<std::string, Tensor>;
using Metadata = std::map<std::string, std::string>;

// "F32" for Float32, ...; and back (CheckpointError naming the supported names).
const char* safetensors_dtype_name(DType dtype);
DType dtype_from_safetensors_name(const std::string& name);

struct SafetensorsFile {
  TensorMap tensors;  // contiguous CPU tensors
  Metadata metadata;  // the "__metadata__" object, empty if absent
};

// Writes `tensors` (any device, any strides: saved by value) atomically (Note [Atomic checkpoint
// writes]). Names must be non-empty, valid UTF-8 and not "__metadata__"; tensors must be defined.
void write_safetensors(const std::filesystem::path& path, const TensorMap& tensors, const Metadata& metadata = {});
// Reads and validates a whole file (Note [The safetensors format]).
SafetensorsFile read_safetensors(const std::filesystem::path& path);

// A tensor as the file stores it, for dtypes booster has no tensor type for (a data set's "U8" images):
// its safetensors dtype name ("F32", "U8", ...), shape and little-endian bytes.
struct RawTensor {
  std::string dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};
// Every tensor of a file, validated as read_safetensors does, with any of the format's dtypes (F64 F32
// F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL); the metadata is not returned.
std::map<std::string, RawTensor> read_safetensors_raw(const std::filesystem::path& path);

// Where each tensor's bytes lie in a file, as absolute offsets sorted by position, after the checks of
// read_safetensors (any of the format's dtypes): what checksums cover (Note [Checkpoint checksums]).
struct TensorSpan {
  std::string name;
  uint64_t begin = 0, end = 0;
};
std::vector<TensorSpan> safetensors_spans(const std::filesystem::path& path);

// A file's validated header (as read_safetensors checks it, any of the format's dtypes) without its
// data: each tensor's dtype name, shape and absolute byte span, sorted by position, and the metadata.
// What a reader that takes tensors one by one, or parts of them, needs (nn::load_pretrained).
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", "I64", ...
  Shape shape;
  uint64_t begin = 0, end = 0;
};
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;
  Metadata metadata;
};
SafetensorsHeader read_safetensors_header(const std::filesystem::path& path);

inline constexpr const char* kModelFileName = "model.safetensors";
inline constexpr const char* kModelIndexFileName = "model.safetensors.index.json";
// transformers' default shard size ("5GB").
inline constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000ull;

// Writes a state dict into directory `dir` (created if needed) as one file or as shards plus an index
// (Note [Sharded model files]), and removes model files of the other layout left by an earlier save.
// The files carry {"format": "pt"} metadata, which transformers expects.
void save_model(const std::filesystem::path& dir, const TensorMap& state_dict,
                uint64_t max_shard_bytes = kDefaultMaxShardBytes);
// Reads what save_model wrote (or Hugging Face's own files): `path` is a directory holding
// model.safetensors or model.safetensors.index.json (the single file wins when both exist, as in
// transformers), a .safetensors file, or an index file. Every shard is checked against the index.
TensorMap load_model(const std::filesystem::path& path);

}  // namespace booster::checkpoint
