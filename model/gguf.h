// GGUF: the single-file model container of llama.cpp / ggml, read and validated.
//
// Layout (little endian; versions 2 and 3; version 1, with 32-bit counts, is refused):
//   u32 magic "GGUF" | u32 version | u64 tensor_count | u64 metadata_kv_count
//   metadata_kv_count x { string key | u32 value type | value }
//   tensor_count      x { string name | u32 n_dims (1..4) | u64 dims[n_dims] | u32 ggml type | u64 offset }
//   zero padding up to a multiple of `general.alignment` (a u32 power of two; 32 when absent)
//   data section: tensor i's bytes at data_offset() + offset_i, each offset a multiple of the alignment
// A string is a u64 byte count and the bytes (no terminator). Value types: 0 u8, 1 i8, 2 u16, 3 i16,
// 4 u32, 5 i32, 6 f32, 7 bool (one byte, 0 or 1), 8 string, 9 array (u32 element type, u64 count,
// the elements; arrays may hold arrays), 10 u64, 11 i64, 12 f64.
//
// Shapes: GGUF lists a tensor's dims innermost first (dims[0] is contiguous, ggml's ne[0]). shape()
// gives them outermost first, the row-major order of our Tensor and of HF: a GGUF token_embd with
// dims [576, 49152] is our [49152, 576]. Quantized types cut each row of dims[0] elements into
// blocks (32 or 256 elements) stored one after the other; dims[0] must be a whole number of blocks.
//
// The reader trusts nothing: the constructor reads the header through a bounds-checked cursor
// (never past the end of the file) with overflow-safe arithmetic, and refuses, each with one line
// naming the file: a bad magic or version (a big-endian file says so), counts that cannot fit in the
// file, strings or arrays running past the end, an unknown value type, duplicate keys or tensor
// names, arrays nested deeper than 8, general.alignment that is not a u32 power of two, n_dims
// outside 1..4, a negative or overflowing dim, an unknown ggml type id, a row that is not a whole
// number of blocks, an offset that is not a multiple of the alignment, a tensor whose bytes reach
// past the end of the file, and two tensors sharing bytes.
//
// Tensor bytes are read with pread when asked for, never the whole file; the file stays open, so the
// bytes are those validated even if the path is replaced meanwhile.
//
// Dequantization (read_into): F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K.
// Each stored value is computed exactly (scale x quant (+ min) needs at most 25 significant bits, so a
// double holds it) and rounded once to the destination dtype: in f32 that is bit for bit what ggml
// and the `gguf` Python package compute. Other known types (Q2_K, Q3_K, the IQ and TQ families,
// integers) can be listed but not read.
//
// The metadata API (for the model and the tokenizer): find() for any value, and typed getters that
// throw one line naming the file and the key when the key is absent or has another type:
//   get_int (any integer type, checked to fit int64), get_float (f32, f64 or an integer), get_bool,
//   get_string, get_strings (an array of strings, by reference: tokenizer.ggml.tokens, .merges),
//   get_ints / get_floats (arrays: tokenizer.ggml.token_type, .scores).
// Each getter has a form with a fallback for an absent key (a present key of the wrong type still throws).
#pragma once

#include "engine/tensor.h"
#include "model/file.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cw {

enum class GgufValueType : uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7, string = 8, array = 9,
  u64 = 10, i64 = 11, f64 = 12,
};
const char* gguf_value_type_name(GgufValueType t);

// One metadata value. A scalar is held as a one-element list in the vector its type selects, an array
// as the list of its elements; so both read the same way.
struct GgufValue {
  GgufValueType type = GgufValueType::u8;          // array for arrays
  GgufValueType element_type = GgufValueType::u8;  // a scalar's own type, or the array's elements' type
  std::vector<uint64_t> unsigned_values;           // u8 u16 u32 u64, and bool as 0 / 1
  std::vector<int64_t> signed_values;              // i8 i16 i32 i64
  std::vector<double> float_values;                // f32 f64 (widened exactly)
  std::vector<std::string> string_values;          // string
  std::vector<GgufValue> array_values;             // elements that are arrays themselves

  bool is_array() const { return type == GgufValueType::array; }
  // Elements of an array (1 for a scalar).
  size_t count() const;
};

// ggml tensor types by their ids in the file. Ids 4, 5, 31-33 were removed from ggml; 9 (Q8_1) is
// never stored in files.
enum class GgmlType : uint32_t {
  f32 = 0, f16 = 1, q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, q8_0 = 8, q2_k = 10, q3_k = 11, q4_k = 12,
  q5_k = 13, q6_k = 14, q8_k = 15, iq2_xxs = 16, iq2_xs = 17, iq3_xxs = 18, iq1_s = 19, iq4_nl = 20,
  iq3_s = 21, iq2_s = 22, iq4_xs = 23, i8 = 24, i16 = 25, i32 = 26, i64 = 27, f64 = 28, iq1_m = 29,
  bf16 = 30, tq1_0 = 34, tq2_0 = 35, mxfp4 = 39,
};

struct GgmlTypeInfo {
  const char* name;      // as ggml spells it: "Q4_1"
  int64_t block_elems;   // elements per block (1 for plain types)
  uint64_t block_bytes;  // bytes per block
  bool dequantizable;    // read_into can read it
};
// The type's layout, or nullptr for an id this module does not know.
const GgmlTypeInfo* ggml_type_info(uint32_t id);

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // as stored: innermost (contiguous) first
  GgmlType type = GgmlType::f32;
  uint64_t offset = 0;        // from the start of the data section
  uint64_t bytes = 0;         // stored size

  int64_t numel() const;
  // Outermost first (dims reversed): the row-major shape of our Tensor and of HF.
  std::vector<int64_t> shape() const;
};

class GgufReader {
 public:
  // Opens `path` and validates everything described above; throws cw::Error otherwise.
  explicit GgufReader(const std::string& path);
  GgufReader(GgufReader&& other) noexcept = default;
  GgufReader& operator=(GgufReader&& other) noexcept = default;
  GgufReader(const GgufReader&) = delete;
  GgufReader& operator=(const GgufReader&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // file offset of the data section
  uint64_t file_size() const { return file_size_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return metadata_; }
  const GgufValue* find(const std::string& key) const;  // nullptr when absent
  bool has(const std::string& key) const { return find(key) != nullptr; }

  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key) const;
  bool get_bool(const std::string& key, bool fallback) const;
  const std::string& get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  const std::vector<std::string>& get_strings(const std::string& key) const;
  std::vector<int64_t> get_ints(const std::string& key) const;
  std::vector<double> get_floats(const std::string& key) const;

  // Tensors in file (header) order.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;  // nullptr when absent

  // Dequantizes tensor `name` into `dst`: a CPU, contiguous f64, f32 or bf16 tensor whose shape
  // equals the tensor's shape(). Throws naming the file and tensor for an unknown name, a shape
  // mismatch (both shapes shown), a type that cannot be dequantized, or a file cut short since it
  // was opened.
  void read_into(const std::string& name, const Tensor& dst) const;

 private:
  [[noreturn]] void wrong_type(const std::string& key, const GgufValue& v, const char* wanted) const;
  const GgufValue& require(const std::string& key) const;

  std::string path_;
  FileReader file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  uint64_t file_size_ = 0;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::unordered_map<std::string, size_t> metadata_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// Dequantizes `rows` rows of `row_elems` elements of `type` from `src` (rows x row_elems / block_elems
// blocks, packed) into `out` (rows x row_elems doubles), exactly. `type` must be dequantizable and
// row_elems a multiple of its block size (checked).
void ggml_dequantize_rows(GgmlType type, const unsigned char* src, int64_t rows, int64_t row_elems, double* out);

}  // namespace cw
