// safetensors: a validating reader that loads tensors on demand, and an atomic writer.
//
// The format: an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON (possibly padded with
// trailing spaces), then the data buffer, which runs to the end of the file. The JSON is an object;
// each key is a tensor name mapping to
//   {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
// with [begin, end) a byte range of the data buffer, tensors stored packed, row-major and little
// endian. The optional key "__metadata__" maps to an object of string -> string.
//
// The reader trusts nothing in the file. The constructor reads only the header and rejects, each
// with its own one-line error naming the file:
//   - a file shorter than the 8-byte length prefix;
//   - a header length over 100 MB (no real header is near that: the bytes are garbage) or running
//     past the end of the file;
//   - a header that is not valid UTF-8, not valid JSON, or whose JSON is not an object;
//   - a key that appears twice in any object of the header (JSON parsers silently keep one copy, so
//     two readers could disagree about which tensor a name denotes);
//   - an entry that is not an object or lacks "dtype", "shape" or "data_offsets"; an unknown dtype;
//     a shape that is not an array of non-negative integers; data_offsets that are not two
//     non-negative integers; begin > end; a shape whose element count times the dtype size
//     overflows u64 or differs from end - begin; a range ending past the data buffer;
//   - ranges that do not tile the data buffer: sorted by begin they must follow each other with no
//     overlap, no hole and no trailing bytes after the last (so every byte of the file is accounted
//     for, and no two tensors share bytes);
//   - "__metadata__" that is not an object of string -> string.
// Keys of an entry other than the three above are ignored. Known dtypes: F64 F32 F16 BF16 F8_E4M3
// F8_E5M2 F8_E8M0 I64 I32 I16 I8 U64 U32 U16 U8 BOOL; all can be listed, the float ones and I32 read.
//
// Tensor data is read with pread when asked for, never the whole file: checkpoints are gigabytes.
// The file stays open for the reader's lifetime, so the bytes read are those of the file validated
// even if another process renames a new checkpoint over the path meanwhile.
//
// The writer stores tensors in the given order, packed one after the other, in their own dtype, and
// pads the header with spaces to a multiple of 8 bytes so every tensor starts 8-byte aligned. It
// writes "<path>.tmp-<pid>", fsyncs it, renames it over `path` and fsyncs the directory: a crash
// leaves either the old file or the new one, never a torn one.
#pragma once

#include "engine/tensor.h"
#include "model/file.h"

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cw {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;           // as the file spells it: "F32", "BF16", ...
  std::vector<int64_t> shape;  // may be empty (a scalar) and hold zeros (an empty tensor)
  uint64_t begin = 0, end = 0; // byte range within the data buffer (after the header)

  int64_t numel() const;
};

// Bytes per element of a safetensors dtype name; 0 for a name this module does not know.
size_t safetensors_dtype_size(const std::string& dtype);

class SafetensorsReader {
 public:
  // Opens `path` and validates its header as described above; throws cw::Error otherwise.
  explicit SafetensorsReader(const std::string& path);
  SafetensorsReader(SafetensorsReader&& other) noexcept = default;
  SafetensorsReader& operator=(SafetensorsReader&& other) noexcept = default;

  // All tensors in file order: sorted by where their bytes lie (ties, only possible between empty
  // tensors, keep the header's order). For files from write_safetensors or the reference
  // implementation this is also the header's order.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // The entry named `name`, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

  // Reads tensor `name` into `dst`, which must be a CPU, contiguous tensor whose shape equals the
  // stored one. F64/F32/F16/BF16 read into f64/f32/bf16 (widening is exact, narrowing rounds to
  // nearest even, directly from the stored value: an F64 read into bf16 is not rounded twice);
  // I32 reads into i32. Throws naming the file and tensor for an unknown name, a shape mismatch
  // (both shapes shown), a dtype that cannot be converted, or a file cut short since it was opened.
  void read_into(const std::string& name, const Tensor& dst) const;

 private:
  std::string path_;
  FileReader file_;
  uint64_t data_start_ = 0;  // file offset of the data buffer: 8 + header length
  std::vector<SafetensorsEntry> entries_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (CPU, contiguous, any dtype: stored as F64/F32/BF16/I32) in the given order, with
// `metadata` as "__metadata__" when non-empty, atomically replacing `path`. Names must be unique,
// valid UTF-8 and not "__metadata__". Throws cw::Error naming the path if any step fails, leaving no
// temporary file behind.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace cw
