// Checksums of every file of a checkpoint, so that a damaged file is refused instead of trained on.
//
// Note [Checkpoint checksums]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Before a step directory is committed, `checksums.json` is written into it, covering every other file:
//   {"format": "booster-checksums", "version": 1, "algorithm": "crc32c",
//    "files": {"trainer_state.json": {"bytes": N, "crc32c": "1a2b3c4d"},
//              "model/model.safetensors": {"bytes": N, "header_bytes": H, "header_crc32c": "...",
//                                          "tensors": {"fc1.weight": "...", ...}}, ...}}
// A safetensors file is covered by its header (the 8 length bytes and the JSON) and one CRC per
// tensor, which tile the file, so a mismatch names the tensor; the files themselves stay plain
// safetensors that PyTorch reads. CRC-32C (Note [CRC-32C] in checksums.cpp) catches every single
// flipped bit and every burst of up to 32 bits; it guards against damage, not against tampering.
// Loading verifies the whole directory before anything is parsed: a missing file, another size, a
// header or a tensor that differs is a CheckpointError naming the file (and tensor) and the way out.
// So is a file of the directory that checksums.json does not list: the manifest covers every file a
// step holds, so a file whose entry was removed (or one added after the save) is refused, never read
// unverified. Checkpoints written before checksums existed have no checksums.json; they load, with one
// warning. model.init_from verifies the model files it reads from a checkpoint the same way
// (load_weights in checkpoint.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>

namespace booster::checkpoint {

inline constexpr const char* kChecksumsFileName = "checksums.json";

// CRC-32C of `size` bytes, continuing from `crc` (0 to start): crc32c(b, m, crc32c(a, n)) is the CRC of
// a followed by b.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

// Writes `dir`/checksums.json over every regular file below `dir` (atomically, fsynced).
void write_checksums(const std::filesystem::path& dir);

enum class ChecksumStatus { Verified, Absent };
// Checks every file listed in `dir`/checksums.json, and that every regular file below `dir` is listed;
// Absent when the directory has none. `below` (relative to `dir`, a file or a folder) limits both to
// the files there, for a reader of only part of a checkpoint (model.init_from); empty: all of them.
// Throws CheckpointError naming the file and tensor that fail, and `--no-verify` as the escape hatch.
ChecksumStatus verify_checksums(const std::filesystem::path& dir, const std::filesystem::path& below = {});

}  // namespace booster::checkpoint
