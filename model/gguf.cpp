#include "model/gguf.h"

#include "engine/error.h"
#include "engine/memory.h"
#include "model/file.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace cw {

static_assert(std::endian::native == std::endian::little, "GGUF I/O assumes a little-endian host");

namespace {

constexpr const char* kCorruptHint = "the file is damaged or not a GGUF file: re-download or re-convert it";
constexpr uint32_t kMagic = 0x46554747u;  // "GGUF" read as a little-endian u32
constexpr int kMaxArrayDepth = 8;
constexpr uint32_t kMaxDims = 4;          // GGML_MAX_DIMS
constexpr uint64_t kDefaultAlignment = 32;
// Rows dequantized per pread: bounds the staging memory (a few MB) whatever the tensor's size.
constexpr int64_t kStagingElems = int64_t(1) << 20;

// A name from the file, safe in a one-line message: control bytes escaped, long names cut.
std::string shown(const std::string& s, size_t max_bytes = 120) {
  std::string out;
  for (size_t i = 0; i < std::min(s.size(), max_bytes); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  if (s.size() > max_bytes) out += "...";
  return out;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

[[noreturn]] void bad_file(const std::string& path, const std::string& what, const char* hint = kCorruptHint) {
  fail(fmt::format("GGUF file '{}': {}", path, what), hint);
}

// The header's reader: a position in the file and a buffered window of it. Every read first checks
// that the bytes exist (`pos + n <= size`, written so it cannot overflow), so nothing is ever read
// past the end, and the error says what was being read and where.
class Cursor {
 public:
  explicit Cursor(const FileReader& file) : file_(file), path_(file.path()), size_(file.size()) {}

  uint64_t pos() const { return pos_; }
  const std::string& path() const { return path_; }
  uint64_t remaining() const { return size_ - pos_; }

  void need(uint64_t n, const std::string& what) const {
    if (n > remaining()) {
      bad_file(path_, fmt::format("truncated: {} at offset {} needs {} bytes, the file has {} left", what, pos_, n,
                                  remaining()));
    }
  }

  void read(void* dst, uint64_t n, const std::string& what) {
    need(n, what);
    auto* out = static_cast<unsigned char*>(dst);
    while (n > 0) {
      if (pos_ < window_start_ || pos_ >= window_start_ + window_.size()) refill();
      const uint64_t in_window = window_start_ + window_.size() - pos_;
      const uint64_t take = std::min(n, in_window);
      std::memcpy(out, window_.data() + (pos_ - window_start_), take);
      out += take;
      pos_ += take;
      n -= take;
    }
  }

  template <class T> T scalar(const std::string& what) {
    T v;
    read(&v, sizeof(T), what);
    return v;
  }
  uint32_t u32(const std::string& what) { return scalar<uint32_t>(what); }
  uint64_t u64(const std::string& what) { return scalar<uint64_t>(what); }

  std::string string(const std::string& what) {
    const uint64_t n = u64(what + " length");
    need(n, fmt::format("{} of {} bytes", what, n));
    std::string s(static_cast<size_t>(n), '\0');
    read(s.data(), n, what);
    return s;
  }

 private:
  void refill() {
    window_start_ = pos_;
    window_.resize(static_cast<size_t>(std::min<uint64_t>(kWindow, remaining())));
    file_.read_at(pos_, window_.data(), window_.size());
  }

  static constexpr uint64_t kWindow = uint64_t(1) << 20;
  const FileReader& file_;
  std::string path_;
  uint64_t size_;
  uint64_t pos_ = 0;
  std::vector<unsigned char> window_;
  uint64_t window_start_ = 0;
};

// Bytes a scalar value of type t occupies; 0 for string / array (variable) and unknown types.
uint64_t scalar_bytes(GgufValueType t) {
  switch (t) {
    case GgufValueType::u8: case GgufValueType::i8: case GgufValueType::boolean: return 1;
    case GgufValueType::u16: case GgufValueType::i16: return 2;
    case GgufValueType::u32: case GgufValueType::i32: case GgufValueType::f32: return 4;
    case GgufValueType::u64: case GgufValueType::i64: case GgufValueType::f64: return 8;
    case GgufValueType::string: case GgufValueType::array: return 0;
  }
  return 0;
}

bool known_value_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::f64); }

// The fewest bytes one element of type t can take: used to refuse absurd counts before allocating.
uint64_t min_bytes(GgufValueType t) {
  if (t == GgufValueType::string) return 8;       // the length
  if (t == GgufValueType::array) return 4 + 8;    // element type and count
  return scalar_bytes(t);
}

// Appends `count` elements of scalar type t, read from the cursor, to v's vector for that type.
void read_scalars(Cursor& c, GgufValueType t, uint64_t count, GgufValue& v, const std::string& what) {
  const uint64_t size = scalar_bytes(t);
  std::vector<unsigned char> raw(static_cast<size_t>(count * size));  // count * size <= remaining: checked
  c.read(raw.data(), raw.size(), what);
  auto get = [&](uint64_t i, auto zero) {
    decltype(zero) x;
    std::memcpy(&x, raw.data() + i * sizeof(x), sizeof(x));
    return x;
  };
  for (uint64_t i = 0; i < count; ++i) {
    switch (t) {
      case GgufValueType::u8: v.unsigned_values.push_back(get(i, uint8_t{})); break;
      case GgufValueType::u16: v.unsigned_values.push_back(get(i, uint16_t{})); break;
      case GgufValueType::u32: v.unsigned_values.push_back(get(i, uint32_t{})); break;
      case GgufValueType::u64: v.unsigned_values.push_back(get(i, uint64_t{})); break;
      case GgufValueType::i8: v.signed_values.push_back(get(i, int8_t{})); break;
      case GgufValueType::i16: v.signed_values.push_back(get(i, int16_t{})); break;
      case GgufValueType::i32: v.signed_values.push_back(get(i, int32_t{})); break;
      case GgufValueType::i64: v.signed_values.push_back(get(i, int64_t{})); break;
      case GgufValueType::f32: v.float_values.push_back(get(i, float{})); break;
      case GgufValueType::f64: v.float_values.push_back(get(i, double{})); break;
      case GgufValueType::boolean: {
        const uint8_t b = get(i, uint8_t{});
        if (b > 1) bad_file(c.path(), fmt::format("{}: bool element {} is {}, not 0 or 1", what, i, b));
        v.unsigned_values.push_back(b);
        break;
      }
      case GgufValueType::string:
      case GgufValueType::array: break;  // not scalars: the caller handles them
    }
  }
}

// Reads one value of type t (already read) for key `what`; arrays recurse up to kMaxArrayDepth.
GgufValue read_value(Cursor& c, GgufValueType t, const std::string& what, int depth) {
  GgufValue v;
  v.type = t;
  v.element_type = t;
  if (t == GgufValueType::string) {
    v.string_values.push_back(c.string(what));
    return v;
  }
  if (t != GgufValueType::array) {
    read_scalars(c, t, 1, v, what);
    return v;
  }
  if (depth >= kMaxArrayDepth) bad_file(c.path(), fmt::format("{}: arrays nested deeper than {}", what, kMaxArrayDepth));
  const uint32_t et = c.u32(what + " element type");
  if (!known_value_type(et)) bad_file(c.path(), fmt::format("{}: unknown array element type {}", what, et));
  v.element_type = static_cast<GgufValueType>(et);
  const uint64_t count = c.u64(what + " element count");
  // Refuse a count the rest of the file cannot hold before allocating anything for it.
  if (count > c.remaining() / min_bytes(v.element_type)) {
    bad_file(c.path(), fmt::format("{}: array of {} {} elements cannot fit in the {} bytes left after offset {}", what,
                                   count, gguf_value_type_name(v.element_type), c.remaining(), c.pos()));
  }
  if (v.element_type == GgufValueType::string) {
    v.string_values.reserve(static_cast<size_t>(count));
    for (uint64_t i = 0; i < count; ++i) v.string_values.push_back(c.string(fmt::format("{}[{}]", what, i)));
  } else if (v.element_type == GgufValueType::array) {
    v.array_values.reserve(static_cast<size_t>(count));
    for (uint64_t i = 0; i < count; ++i)
      v.array_values.push_back(read_value(c, GgufValueType::array, fmt::format("{}[{}]", what, i), depth + 1));
  } else {
    read_scalars(c, v.element_type, count, v, what);
  }
  return v;
}

// IEEE binary16 -> double, exactly (every half value is a float and a double; NaN stays NaN). Built
// from the bits: this runs once per block, and ldexp would dominate the load.
double half_to_double(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in a float
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -static_cast<double>(magnitude) : static_cast<double>(magnitude);
  }
  const uint32_t bits = exponent == 0x1f ? sign | 0x7f800000u | (mantissa << 13)               // inf, NaN
                                         : sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  return std::bit_cast<float>(bits);
}

double half_at(const unsigned char* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_double(h);
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block, packed in 12 bytes: sub-blocks
// 0-3 keep theirs in the low 6 bits of bytes j (scale) and j+4 (min); sub-blocks 4-7 split theirs
// between the low / high nibble of byte j+4 and the top 2 bits of bytes j-4 (scale) and j (min).
void k_scale_min(int j, const unsigned char* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block of each type -> its elements. The layouts (ggml's block_* structs, little endian):
//   Q4_0  [f16 d][16 B nibbles]                 x = (q - 8) d         q_j = low nibble of byte j, q_{j+16} its high
//   Q4_1  [f16 d][f16 m][16 B nibbles]          x = q d + m
//   Q5_0  [f16 d][u32 qh][16 B nibbles]         x = (q - 16) d        q's 5th bit: bit j of qh for element j
//   Q5_1  [f16 d][f16 m][u32 qh][16 B nibbles]  x = q d + m
//   Q8_0  [f16 d][32 x i8]                      x = q d
//   Q4_K  [f16 d][f16 dmin][12 B scales][128 B nibbles]: 8 sub-blocks of 32, x = d sc q - dmin mn
//   Q5_K  [f16 d][f16 dmin][12 B scales][32 B qh][128 B nibbles]: the same with a 5th bit
//   Q6_K  [128 B low nibbles][64 B 2-bit highs][16 x i8 scales][f16 d]: 16 sub-blocks of 16, x = d sc (q - 32)
// Values are computed in double, where they are exact, and stored as T (double, or float: rounded once).
template <class T> void dequantize_block(GgmlType type, const unsigned char* b, T* y) {
  switch (type) {
    case GgmlType::q4_0: {
      const double d = half_at(b);
      for (int j = 0; j < 16; ++j) {
        y[j] = static_cast<T>(((b[2 + j] & 0xf) - 8) * d);
        y[j + 16] = static_cast<T>(((b[2 + j] >> 4) - 8) * d);
      }
      return;
    }
    case GgmlType::q4_1: {
      const double d = half_at(b), m = half_at(b + 2);
      for (int j = 0; j < 16; ++j) {
        y[j] = static_cast<T>((b[4 + j] & 0xf) * d + m);
        y[j + 16] = static_cast<T>((b[4 + j] >> 4) * d + m);
      }
      return;
    }
    case GgmlType::q5_0:
    case GgmlType::q5_1: {
      const bool with_min = type == GgmlType::q5_1;
      const double d = half_at(b), m = with_min ? half_at(b + 2) : 0.0;
      uint32_t qh;
      std::memcpy(&qh, b + (with_min ? 4 : 2), 4);
      const unsigned char* qs = b + (with_min ? 8 : 6);
      const int offset = with_min ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0xf) | static_cast<int>(((qh >> j) & 1u) << 4);
        const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
        y[j] = static_cast<T>((lo - offset) * d + m);
        y[j + 16] = static_cast<T>((hi - offset) * d + m);
      }
      return;
    }
    case GgmlType::q8_0: {
      const double d = half_at(b);
      for (int j = 0; j < 32; ++j) y[j] = static_cast<T>(static_cast<int8_t>(b[2 + j]) * d);
      return;
    }
    case GgmlType::q4_k:
    case GgmlType::q5_k: {
      const bool five = type == GgmlType::q5_k;
      const double d = half_at(b), dmin = half_at(b + 2);
      const unsigned char* scales = b + 4;
      const unsigned char* qh = b + 16;                 // Q5_K only
      const unsigned char* qs = b + (five ? 48 : 16);
      // 4 groups of 64 elements: 32 low nibbles of 32 bytes (sub-block 2g), then their high nibbles (2g+1).
      for (int g = 0; g < 4; ++g) {
        for (int half = 0; half < 2; ++half) {
          int sc, mn;
          k_scale_min(2 * g + half, scales, sc, mn);
          const double scale = d * sc, min = dmin * mn;
          const int bit = 2 * g + half;  // Q5_K: the 5th bit of sub-block s is bit s of qh[l]
          for (int l = 0; l < 32; ++l) {
            int q = half ? (qs[32 * g + l] >> 4) : (qs[32 * g + l] & 0xf);
            if (five) q |= ((qh[l] >> bit) & 1) << 4;
            y[64 * g + 32 * half + l] = static_cast<T>(scale * q - min);
          }
        }
      }
      return;
    }
    case GgmlType::q6_k: {
      const unsigned char* ql = b;
      const unsigned char* qh = b + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const double d = half_at(b + 208);
      // 2 halves of 128: 64 bytes of low nibbles and 32 of 2-bit highs each, 4 rows of 32 elements.
      for (int n = 0; n < 2; ++n) {
        for (int l = 0; l < 32; ++l) {
          const int s = l / 16;
          const unsigned char lo0 = ql[64 * n + l], lo1 = ql[64 * n + l + 32], h = qh[32 * n + l];
          const int q1 = ((lo0 & 0xf) | (((h >> 0) & 3) << 4)) - 32;
          const int q2 = ((lo1 & 0xf) | (((h >> 2) & 3) << 4)) - 32;
          const int q3 = ((lo0 >> 4) | (((h >> 4) & 3) << 4)) - 32;
          const int q4 = ((lo1 >> 4) | (((h >> 6) & 3) << 4)) - 32;
          T* out = y + 128 * n;
          const int8_t* scale = sc + 8 * n;
          out[l] = static_cast<T>(d * scale[s + 0] * q1);
          out[l + 32] = static_cast<T>(d * scale[s + 2] * q2);
          out[l + 64] = static_cast<T>(d * scale[s + 4] * q3);
          out[l + 96] = static_cast<T>(d * scale[s + 6] * q4);
        }
      }
      return;
    }
    case GgmlType::f32: {
      float v;
      std::memcpy(&v, b, 4);
      y[0] = static_cast<T>(v);
      return;
    }
    case GgmlType::f16: y[0] = static_cast<T>(half_at(b)); return;
    case GgmlType::bf16: {
      uint16_t h;
      std::memcpy(&h, b, 2);
      y[0] = static_cast<T>(std::bit_cast<float>(static_cast<uint32_t>(h) << 16));
      return;
    }
    case GgmlType::f64: {
      double v;
      std::memcpy(&v, b, 8);
      y[0] = static_cast<T>(v);
      return;
    }
    default: break;
  }
  CW_CHECK(false, "ggml type {} cannot be dequantized", static_cast<uint32_t>(type));
}

struct TypeRow {
  uint32_t id;
  GgmlTypeInfo info;
};

// Every type ggml stores in files, with its block layout (ggml-common.h's block_* structs).
const TypeRow kTypes[] = {
    {0, {"F32", 1, 4, true}},         {1, {"F16", 1, 2, true}},         {2, {"Q4_0", 32, 18, true}},
    {3, {"Q4_1", 32, 20, true}},      {6, {"Q5_0", 32, 22, true}},      {7, {"Q5_1", 32, 24, true}},
    {8, {"Q8_0", 32, 34, true}},      {10, {"Q2_K", 256, 84, false}},   {11, {"Q3_K", 256, 110, false}},
    {12, {"Q4_K", 256, 144, true}},   {13, {"Q5_K", 256, 176, true}},   {14, {"Q6_K", 256, 210, true}},
    {15, {"Q8_K", 256, 292, false}},  {16, {"IQ2_XXS", 256, 66, false}}, {17, {"IQ2_XS", 256, 74, false}},
    {18, {"IQ3_XXS", 256, 98, false}}, {19, {"IQ1_S", 256, 50, false}}, {20, {"IQ4_NL", 32, 18, false}},
    {21, {"IQ3_S", 256, 110, false}}, {22, {"IQ2_S", 256, 82, false}},  {23, {"IQ4_XS", 256, 136, false}},
    {24, {"I8", 1, 1, false}},        {25, {"I16", 1, 2, false}},       {26, {"I32", 1, 4, false}},
    {27, {"I64", 1, 8, false}},       {28, {"F64", 1, 8, true}},        {29, {"IQ1_M", 256, 56, false}},
    {30, {"BF16", 1, 2, true}},       {34, {"TQ1_0", 256, 54, false}},  {35, {"TQ2_0", 256, 66, false}},
    {39, {"MXFP4", 32, 17, false}},
};

std::string dequantizable_list() {
  std::string s;
  for (const TypeRow& r : kTypes)
    if (r.info.dequantizable) s += (s.empty() ? "" : ", ") + std::string(r.info.name);
  return s;
}

}  // namespace

const char* gguf_value_type_name(GgufValueType t) {
  switch (t) {
    case GgufValueType::u8: return "u8";
    case GgufValueType::i8: return "i8";
    case GgufValueType::u16: return "u16";
    case GgufValueType::i16: return "i16";
    case GgufValueType::u32: return "u32";
    case GgufValueType::i32: return "i32";
    case GgufValueType::f32: return "f32";
    case GgufValueType::boolean: return "bool";
    case GgufValueType::string: return "string";
    case GgufValueType::array: return "array";
    case GgufValueType::u64: return "u64";
    case GgufValueType::i64: return "i64";
    case GgufValueType::f64: return "f64";
  }
  return "?";
}

size_t GgufValue::count() const {
  return unsigned_values.size() + signed_values.size() + float_values.size() + string_values.size() +
         array_values.size();
}

const GgmlTypeInfo* ggml_type_info(uint32_t id) {
  for (const TypeRow& r : kTypes)
    if (r.id == id) return &r.info;
  return nullptr;
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;  // validated at open: no overflow
  return n;
}

std::vector<int64_t> GgufTensorInfo::shape() const { return {dims.rbegin(), dims.rend()}; }

namespace {
template <class T> void dequantize_rows(GgmlType type, const unsigned char* src, int64_t rows, int64_t row_elems, T* out) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(type));
  CW_CHECK(info && info->dequantizable, "ggml type {} cannot be dequantized", static_cast<uint32_t>(type));
  CW_CHECK(rows >= 0 && row_elems >= 0 && row_elems % info->block_elems == 0,
           "ggml_dequantize_rows: {} rows of {} elements are not whole {} blocks of {}", rows, row_elems, info->name,
           info->block_elems);
  const int64_t blocks = rows * (row_elems / info->block_elems);
  for (int64_t i = 0; i < blocks; ++i)
    dequantize_block(type, src + static_cast<uint64_t>(i) * info->block_bytes, out + i * info->block_elems);
}
}  // namespace

void ggml_dequantize_rows(GgmlType type, const unsigned char* src, int64_t rows, int64_t row_elems, double* out) {
  dequantize_rows(type, src, rows, row_elems, out);
}

GgufReader::GgufReader(const std::string& path) : path_(path), file_(path, "GGUF file", "point at a .gguf file") {
  file_size_ = file_.size();
  {
    Cursor c(file_);
    const uint32_t magic = c.u32("the magic number");
    if (magic != kMagic) {
      bad_file(path, fmt::format("does not start with the magic 'GGUF' (first bytes {:08x})", __builtin_bswap32(magic)));
    }
    version_ = c.u32("the version");
    if (version_ == 1) {
      bad_file(path, "GGUF version 1 (32-bit counts, 2023) is not supported",
               "re-convert the model with a current llama.cpp (GGUF v3)");
    }
    if (version_ != 2 && version_ != 3) {
      const uint32_t swapped = __builtin_bswap32(version_);
      if (swapped == 2 || swapped == 3) {
        bad_file(path, fmt::format("a big-endian GGUF file (version {} byte-swapped)", swapped),
                 "convert the model for a little-endian machine");
      }
      bad_file(path, fmt::format("unsupported GGUF version {} (chunkwise reads 2 and 3)", version_));
    }
    const uint64_t tensor_count = c.u64("the tensor count");
    const uint64_t kv_count = c.u64("the metadata count");
    // A key-value pair takes at least 8 + 4 + 1 bytes, a tensor info 8 + 4 + 8 + 4 + 8: absurd counts
    // (a garbage header) are refused here, before anything is allocated for them.
    constexpr uint64_t kMinKv = 13, kMinTensor = 32;
    if (kv_count > c.remaining() / kMinKv || tensor_count > c.remaining() / kMinTensor ||
        kv_count * kMinKv + tensor_count * kMinTensor > c.remaining()) {
      bad_file(path, fmt::format("{} metadata entries and {} tensors cannot fit in the {} bytes after the header",
                                 kv_count, tensor_count, c.remaining()));
    }

    for (uint64_t i = 0; i < kv_count; ++i) {
      std::string key = c.string(fmt::format("metadata key #{}", i));
      const std::string what = fmt::format("metadata '{}'", shown(key));
      const uint32_t type = c.u32(what + " value type");
      if (!known_value_type(type)) bad_file(path, fmt::format("{}: unknown value type {}", what, type));
      GgufValue v = read_value(c, static_cast<GgufValueType>(type), what, 0);
      if (!metadata_index_.emplace(key, metadata_.size()).second) bad_file(path, fmt::format("duplicate {}", what));
      metadata_.emplace_back(std::move(key), std::move(v));
    }

    if (const GgufValue* a = find("general.alignment")) {
      if (a->type != GgufValueType::u32) {
        bad_file(path, fmt::format("general.alignment must be a u32, it is a {}", gguf_value_type_name(a->type)));
      }
      alignment_ = a->unsigned_values[0];
      if (alignment_ == 0 || !std::has_single_bit(alignment_)) {
        bad_file(path, fmt::format("general.alignment {} is not a power of two", alignment_));
      }
    } else {
      alignment_ = kDefaultAlignment;
    }

    tensors_.reserve(static_cast<size_t>(tensor_count));
    for (uint64_t i = 0; i < tensor_count; ++i) {
      GgufTensorInfo t;
      t.name = c.string(fmt::format("tensor #{} name", i));
      const std::string what = fmt::format("tensor '{}'", shown(t.name));
      const uint32_t n_dims = c.u32(what + " n_dims");
      if (n_dims < 1 || n_dims > kMaxDims) bad_file(path, fmt::format("{}: n_dims {} is not in 1..{}", what, n_dims, kMaxDims));
      uint64_t numel = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        const uint64_t dim = c.u64(fmt::format("{} dim {}", what, d));
        if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          bad_file(path, fmt::format("{}: dim {} is {} (negative as int64)", what, d, dim));
        t.dims.push_back(static_cast<int64_t>(dim));
        if (__builtin_mul_overflow(numel, dim, &numel) || numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          bad_file(path, fmt::format("{}: dims {} overflow the element count", what, shape_str(t.dims)));
      }
      const uint32_t type = c.u32(what + " type");
      const GgmlTypeInfo* info = ggml_type_info(type);
      if (!info) bad_file(path, fmt::format("{}: unknown ggml type id {}", what, type), "the file needs a newer reader, or is damaged");
      t.type = static_cast<GgmlType>(type);
      if (t.dims[0] % info->block_elems != 0) {
        bad_file(path, fmt::format("{}: rows of {} elements are not a whole number of {} blocks of {}", what,
                                   t.dims[0], info->name, info->block_elems));
      }
      // numel / block_elems blocks (exact: dims[0] is a multiple of the block size).
      if (__builtin_mul_overflow(numel / static_cast<uint64_t>(info->block_elems), info->block_bytes, &t.bytes))
        bad_file(path, fmt::format("{}: {} x {} overflows the byte count", what, shape_str(t.dims), info->name));
      t.offset = c.u64(what + " offset");
      if (t.offset % alignment_ != 0) {
        bad_file(path, fmt::format("{}: offset {} is not a multiple of the alignment {}", what, t.offset, alignment_));
      }
      if (!tensor_index_.emplace(t.name, tensors_.size()).second) bad_file(path, fmt::format("duplicate {}", what));
      tensors_.push_back(std::move(t));
    }

    // The data section starts at the next multiple of the alignment (no overflow: pos <= file size,
    // alignment <= 2^31).
    data_offset_ = (c.pos() + alignment_ - 1) / alignment_ * alignment_;
    if (!tensors_.empty() && data_offset_ > file_size_) {
      bad_file(path, fmt::format("truncated: the data section would start at offset {}, past the end of the {}-byte file",
                                 data_offset_, file_size_));
    }
    const uint64_t data_size = file_size_ - std::min(data_offset_, file_size_);
    for (const GgufTensorInfo& t : tensors_) {
      if (t.offset > data_size || t.bytes > data_size - t.offset) {
        bad_file(path, fmt::format("tensor '{}': bytes [{}, {}+{}) of the data section reach past its end ({} bytes; "
                                   "the file is {} bytes)",
                                   shown(t.name), t.offset, t.offset, t.bytes, data_size, file_size_));
      }
    }
    // No two tensors may share bytes: sorted by offset, each must start at or after the previous end.
    std::vector<const GgufTensorInfo*> by_offset;
    for (const GgufTensorInfo& t : tensors_)
      if (t.bytes > 0) by_offset.push_back(&t);
    std::stable_sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_offset.size(); ++i) {
      const GgufTensorInfo& a = *by_offset[i - 1];
      const GgufTensorInfo& b = *by_offset[i];
      if (b.offset < a.offset + a.bytes) {
        bad_file(path, fmt::format("tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", shown(a.name), a.offset,
                                   a.offset + a.bytes, shown(b.name), b.offset, b.offset + b.bytes));
      }
    }
  }
}

const GgufValue* GgufReader::find(const std::string& key) const {
  const auto it = metadata_index_.find(key);
  return it == metadata_index_.end() ? nullptr : &metadata_[it->second].second;
}

const GgufTensorInfo* GgufReader::find_tensor(const std::string& name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

void GgufReader::wrong_type(const std::string& key, const GgufValue& v, const char* wanted) const {
  const std::string have = v.is_array() ? fmt::format("an array of {}", gguf_value_type_name(v.element_type))
                                        : fmt::format("a {}", gguf_value_type_name(v.type));
  bad_file(path_, fmt::format("metadata '{}' is {}, expected {}", shown(key), have, wanted),
           "the file does not follow the GGUF conventions for this key: re-convert it");
}

const GgufValue& GgufReader::require(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) bad_file(path_, fmt::format("metadata key '{}' is missing", shown(key)), "re-convert the model with a current llama.cpp");
  return *v;
}

namespace {
// The integers of a value (scalar or array of integers) as int64, or false if it holds something else.
bool integers_of(const GgufValue& v, std::vector<int64_t>& out, uint64_t& too_big) {
  switch (v.element_type) {
    case GgufValueType::u8: case GgufValueType::u16: case GgufValueType::u32: case GgufValueType::u64:
      for (uint64_t u : v.unsigned_values) {
        if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          too_big = u;
          return false;
        }
        out.push_back(static_cast<int64_t>(u));
      }
      return true;
    case GgufValueType::i8: case GgufValueType::i16: case GgufValueType::i32: case GgufValueType::i64:
      out = v.signed_values;
      return true;
    default: return false;
  }
}
}  // namespace

int64_t GgufReader::get_int(const std::string& key) const {
  const GgufValue& v = require(key);
  std::vector<int64_t> ints;
  uint64_t too_big = 0;
  if (v.is_array() || !integers_of(v, ints, too_big)) {
    if (too_big) bad_file(path_, fmt::format("metadata '{}' = {} does not fit an int64", shown(key), too_big));
    wrong_type(key, v, "an integer");
  }
  return ints[0];
}

int64_t GgufReader::get_int(const std::string& key, int64_t fallback) const { return has(key) ? get_int(key) : fallback; }

double GgufReader::get_float(const std::string& key) const {
  const GgufValue& v = require(key);
  if (v.is_array()) wrong_type(key, v, "a number");
  if (v.type == GgufValueType::f32 || v.type == GgufValueType::f64) return v.float_values[0];
  std::vector<int64_t> ints;
  uint64_t too_big = 0;
  if (integers_of(v, ints, too_big)) return static_cast<double>(ints[0]);
  if (too_big) return static_cast<double>(too_big);
  wrong_type(key, v, "a number");
}

double GgufReader::get_float(const std::string& key, double fallback) const {
  return has(key) ? get_float(key) : fallback;
}

bool GgufReader::get_bool(const std::string& key) const {
  const GgufValue& v = require(key);
  if (v.type != GgufValueType::boolean) wrong_type(key, v, "a bool");
  return v.unsigned_values[0] != 0;
}

bool GgufReader::get_bool(const std::string& key, bool fallback) const { return has(key) ? get_bool(key) : fallback; }

const std::string& GgufReader::get_string(const std::string& key) const {
  const GgufValue& v = require(key);
  if (v.type != GgufValueType::string) wrong_type(key, v, "a string");
  return v.string_values[0];
}

std::string GgufReader::get_string(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}

const std::vector<std::string>& GgufReader::get_strings(const std::string& key) const {
  const GgufValue& v = require(key);
  if (!v.is_array() || v.element_type != GgufValueType::string) wrong_type(key, v, "an array of strings");
  return v.string_values;
}

std::vector<int64_t> GgufReader::get_ints(const std::string& key) const {
  const GgufValue& v = require(key);
  std::vector<int64_t> ints;
  uint64_t too_big = 0;
  if (!v.is_array() || !integers_of(v, ints, too_big)) {
    if (too_big) bad_file(path_, fmt::format("metadata '{}' holds {}, which does not fit an int64", shown(key), too_big));
    wrong_type(key, v, "an array of integers");
  }
  return ints;
}

std::vector<double> GgufReader::get_floats(const std::string& key) const {
  const GgufValue& v = require(key);
  if (!v.is_array() || (v.element_type != GgufValueType::f32 && v.element_type != GgufValueType::f64))
    wrong_type(key, v, "an array of floats");
  return v.float_values;
}

void GgufReader::read_into(const std::string& name, const Tensor& dst) const {
  const GgufTensorInfo* t = find_tensor(name);
  if (!t) bad_file(path_, fmt::format("has no tensor '{}'", shown(name)), "check the tensor name (gguf-dump lists them)");
  const GgmlTypeInfo& info = *ggml_type_info(static_cast<uint32_t>(t->type));
  if (!info.dequantizable) {
    bad_file(path_, fmt::format("tensor '{}' is stored as {}, which chunkwise cannot dequantize (it reads {})",
                                shown(name), info.name, dequantizable_list()),
             "re-quantize the model to one of those types (or convert it to F16 / BF16)");
  }
  CW_CHECK(dst.device.is_cpu() && dst.contiguous() &&
               (dst.dtype == DType::f64 || dst.dtype == DType::f32 || dst.dtype == DType::bf16),
           "GgufReader::read_into needs a contiguous CPU f64/f32/bf16 tensor, got {}", dst.describe());
  const std::vector<int64_t> shape = t->shape();
  if (std::vector<int64_t>(dst.shape.begin(), dst.shape.begin() + dst.ndim) != shape) {
    bad_file(path_, fmt::format("tensor '{}' has shape {} (GGUF dims {}), expected {}", shown(name), shape_str(shape),
                                shape_str(t->dims), shape_str({dst.shape.begin(), dst.shape.begin() + dst.ndim})),
             "the file does not match the model's configuration");
  }
  const int64_t row = t->dims[0];
  const int64_t rows = row > 0 ? t->numel() / row : 0;
  if (rows == 0) return;
  const uint64_t row_bytes = static_cast<uint64_t>(row / info.block_elems) * info.block_bytes;
  // Rows in groups of about kStagingElems: pread the group's bytes and dequantize them into dst, in
  // place for f64 and f32 (each value rounded once), through an f64 staging buffer for bf16.
  const int64_t group = std::max<int64_t>(1, kStagingElems / std::max<int64_t>(row, 1));
  std::vector<unsigned char> raw;
  OwnedTensor staging;
  const Tensor dst_rows = Tensor::packed(dst.data, dst.dtype, dst.device, std::vector<int64_t>{rows, row});
  for (int64_t r0 = 0; r0 < rows; r0 += group) {
    const int64_t n = std::min(group, rows - r0);
    raw.resize(static_cast<size_t>(static_cast<uint64_t>(n) * row_bytes));
    file_.read_at(data_offset_ + t->offset + static_cast<uint64_t>(r0) * row_bytes, raw.data(), raw.size());
    if (dst.dtype == DType::f64) {
      dequantize_rows(t->type, raw.data(), n, row, dst_rows.ptr<double>() + r0 * row);
      continue;
    }
    if (dst.dtype == DType::f32) {
      dequantize_rows(t->type, raw.data(), n, row, dst_rows.ptr<float>() + r0 * row);
      continue;
    }
    if (staging.tensor.numel() != n * row) staging = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{n, row});
    ggml_dequantize_rows(t->type, raw.data(), n, row, staging.tensor.ptr<double>());
    copy_convert(dst_rows.slice(0, r0, n), staging.tensor);
  }
}

}  // namespace cw
