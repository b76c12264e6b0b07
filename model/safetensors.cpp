#include "model/safetensors.h"

#include "model/file.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <unordered_set>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace cw {

// Stored data is little endian and is read and written with memcpy.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;
constexpr const char* kCorruptHint = "the file is damaged or not a safetensors file: re-download or re-export it";

// A name from a file or a caller, safe to put in a one-line message: control bytes escaped, and cut
// short (at a UTF-8 character boundary) when very long.
std::string shown(const std::string& s, size_t max_bytes = 120) {
  size_t keep = s.size();
  if (keep > max_bytes) {
    keep = max_bytes;
    while (keep > 0 && (static_cast<unsigned char>(s[keep]) & 0xc0u) == 0x80u) --keep;
  }
  std::string out;
  for (size_t i = 0; i < keep; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  if (keep < s.size()) out += "...";
  return out;
}

// "an array", "a number", ... for messages (the value itself may be huge or deeply nested).
std::string kind_of(const nlohmann::json& v) {
  const std::string type = v.type_name();
  if (v.is_null()) return type;
  return (type[0] == 'a' || type[0] == 'o' ? "an " : "a ") + type;
}

// "[2, 3]". (Not fmt::join: with fmt 9 it trips a false -Wstringop-overflow in GCC 12 at -O3.)
std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

[[noreturn]] void bad_file(const std::string& path, const std::string& what) {
  fail(fmt::format("safetensors file '{}': {}", path, what), kCorruptHint);
}

[[noreturn]] void bad_entry(const std::string& path, const std::string& name, const std::string& what) {
  bad_file(path, fmt::format("tensor '{}': {}", shown(name), what));
}

// Strict UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF. Returns the offset of the
// first bad byte, or npos.
size_t invalid_utf8_at(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len;
    uint32_t cp, min;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0u) == 0xc0u) {
      len = 2, cp = c & 0x1fu, min = 0x80;
    } else if ((c & 0xf0u) == 0xe0u) {
      len = 3, cp = c & 0x0fu, min = 0x800;
    } else if ((c & 0xf8u) == 0xf0u) {
      len = 4, cp = c & 0x07u, min = 0x10000;
    } else {
      return i;
    }
    if (i + len > s.size()) return i;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0u) != 0x80u) return i;
      cp = (cp << 6) | (cc & 0x3fu);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
    i += len;
  }
  return std::string::npos;
}

// The stored dtypes this module reads, decoded once per read.
enum class Stored { f64, f32, f16, bf16, i32, other };

Stored stored_kind(const std::string& dtype) {
  if (dtype == "F64") return Stored::f64;
  if (dtype == "F32") return Stored::f32;
  if (dtype == "F16") return Stored::f16;
  if (dtype == "BF16") return Stored::bf16;
  if (dtype == "I32") return Stored::i32;
  return Stored::other;
}

const char* stored_name(DType t) {
  switch (t) {
    case DType::f64: return "F64";
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::i32: return "I32";
  }
  return "?";
}

// IEEE binary16 -> binary32, exactly: every half value (subnormals, infinities, NaN payloads
// included) is representable in a float.
float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  } else {
    // Zero or subnormal: mantissa * 2^-24, a product of a small integer and a power of two, which
    // a float holds exactly (and as a normal number).
    bits = sign | std::bit_cast<uint32_t>(static_cast<float>(mantissa) * 0x1p-24f);
  }
  return std::bit_cast<float>(bits);
}

// double -> bf16 rounded once, to nearest even. Going through float with round-to-nearest would
// round twice (1 + 2^-8 + 2^-40 becomes the tie 1 + 2^-8, then 1.0 instead of 1 + 2^-7). Rounding
// to float *to odd* instead (truncate, then set the lowest bit if anything was lost) keeps the
// information "above or below the tie", and since float has 16 more mantissa bits than bf16 over
// the same exponent range, bf16::from_float then rounds exactly as a direct rounding would.
bf16 bf16_from_double(double d) {
  float f = static_cast<float>(d);
  if (static_cast<double>(f) != d && !std::isnan(d)) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
    f = std::bit_cast<float>(std::bit_cast<uint32_t>(f) | 1u);
  }
  return bf16::from_float(f);
}

// Stored little-endian elements -> doubles (exact for every float source).
void decode(Stored kind, const unsigned char* in, size_t n, double* out) {
  for (size_t i = 0; i < n; ++i) {
    switch (kind) {
      case Stored::f64: {
        double v;
        std::memcpy(&v, in + 8 * i, 8);
        out[i] = v;
        break;
      }
      case Stored::f32: {
        float v;
        std::memcpy(&v, in + 4 * i, 4);
        out[i] = v;
        break;
      }
      case Stored::f16: {
        uint16_t v;
        std::memcpy(&v, in + 2 * i, 2);
        out[i] = f16_to_float(v);
        break;
      }
      case Stored::bf16: {
        bf16 v;
        std::memcpy(&v.bits, in + 2 * i, 2);
        out[i] = v.to_float();
        break;
      }
      case Stored::i32:
      case Stored::other: CW_CHECK(false, "decode of a non-float stored dtype"); break;
    }
  }
}

void encode(DType dst, const double* in, size_t n, void* out) {
  switch (dst) {
    case DType::f64: std::memcpy(out, in, n * 8); break;
    case DType::f32:
      for (size_t i = 0; i < n; ++i) static_cast<float*>(out)[i] = static_cast<float>(in[i]);
      break;
    case DType::bf16:
      for (size_t i = 0; i < n; ++i) static_cast<bf16*>(out)[i] = bf16_from_double(in[i]);
      break;
    case DType::i32: CW_CHECK(false, "encode of floats into i32"); break;
  }
}

// A JSON value that must be a non-negative integer fitting int64 (shape dims, offsets).
uint64_t json_count(const std::string& path, const std::string& name, const nlohmann::json& v,
                    const std::string& what) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      bad_entry(path, name, fmt::format("{} {} is too large", what, u));
    }
    return u;
  }
  if (v.is_number_integer()) bad_entry(path, name, fmt::format("{} {} is negative", what, v.get<int64_t>()));
  // Numbers are shown; anything else by its type only (dumping a deeply nested value would recurse).
  bad_entry(path, name, fmt::format("{} is not an integer (it is {})", what, v.is_number() ? v.dump() : kind_of(v)));
}

struct ParsedHeader {
  std::vector<SafetensorsEntry> entries;  // header order
  std::map<std::string, std::string> metadata;
};

// Parses the header text, refusing duplicate keys at any depth: nlohmann keeps one copy silently, so
// the parser callback watches every object's keys as they stream past. The top-level keys' order is
// recorded too (nlohmann::json sorts them).
ParsedHeader parse_header(const std::string& path, const std::string& text) {
  if (const size_t at = invalid_utf8_at(text); at != std::string::npos) {
    bad_file(path, fmt::format("header is not valid UTF-8 (bad byte 0x{:02x} at header offset {})",
                               static_cast<unsigned char>(text[at]), at));
  }

  // A raw NUL is never valid JSON (not even inside a string), but nlohmann's lexer takes it for the
  // end of input and would silently ignore whatever follows it.
  if (const size_t at = text.find('\0'); at != std::string::npos) {
    bad_file(path, fmt::format("header is not valid JSON: NUL byte at header offset {}", at));
  }

  struct Frame {
    std::unordered_set<std::string> keys;
    std::string last_key;
  };
  std::vector<Frame> frames;
  std::vector<std::string> top_keys;
  std::string duplicate;  // the first duplicate found, described
  auto watch = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Ev = nlohmann::json::parse_event_t;
    if (event == Ev::object_start) {
      frames.emplace_back();
    } else if (event == Ev::object_end && !frames.empty()) {
      frames.pop_back();
    } else if (event == Ev::key && !frames.empty()) {
      std::string key = parsed.get<std::string>();
      Frame& top = frames.back();
      if (!top.keys.insert(key).second && duplicate.empty()) {
        std::string where;
        for (size_t i = 0; i + 1 < frames.size(); ++i) where += (where.empty() ? "" : "/") + shown(frames[i].last_key);
        duplicate = where.empty() ? fmt::format("duplicate key '{}' in the header", shown(key))
                                  : fmt::format("duplicate key '{}' inside '{}'", shown(key), where);
      }
      if (frames.size() == 1) top_keys.push_back(key);
      top.last_key = std::move(key);
    }
    return true;
  };

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, watch);
  } catch (const nlohmann::json::exception& e) {
    // parse_error, or out_of_range for a number like 1e400. Drop nlohmann's
    // "[json.exception.parse_error.101] " tag; keep its position and reason.
    std::string why = e.what();
    if (const size_t tag = why.find("] "); tag != std::string::npos) why = why.substr(tag + 2);
    bad_file(path, fmt::format("header is not valid JSON: {}", shown(why, 400)));
  }
  if (!header.is_object()) bad_file(path, fmt::format("header JSON is not an object (it is {})", kind_of(header)));
  if (!duplicate.empty()) bad_file(path, duplicate);

  ParsedHeader out;
  for (const std::string& name : top_keys) {
    const nlohmann::json& v = header.at(name);
    if (name == "__metadata__") {
      if (!v.is_object()) {
        bad_file(path, fmt::format("\"__metadata__\" is not an object of string -> string (it is {})", kind_of(v)));
      }
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string()) {
          bad_file(path, fmt::format("\"__metadata__\" is not an object of string -> string (key '{}' maps to {})",
                                     shown(k), kind_of(s)));
        }
        out.metadata.emplace(k, s.get<std::string>());
      }
      continue;
    }
    if (!v.is_object()) bad_entry(path, name, fmt::format("entry is not an object (it is {})", kind_of(v)));
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!v.contains(field)) bad_entry(path, name, fmt::format("entry is missing \"{}\"", field));
    }
    SafetensorsEntry e;
    e.name = name;
    const nlohmann::json& dtype = v.at("dtype");
    if (!dtype.is_string()) bad_entry(path, name, fmt::format("dtype is not a string (it is {})", kind_of(dtype)));
    e.dtype = dtype.get<std::string>();
    if (safetensors_dtype_size(e.dtype) == 0) bad_entry(path, name, fmt::format("unknown dtype '{}'", shown(e.dtype)));
    const nlohmann::json& shape = v.at("shape");
    if (!shape.is_array()) bad_entry(path, name, fmt::format("shape is not an array (it is {})", kind_of(shape)));
    for (size_t d = 0; d < shape.size(); ++d) {
      e.shape.push_back(static_cast<int64_t>(json_count(path, name, shape[d], fmt::format("shape dimension {}", d))));
    }
    const nlohmann::json& offsets = v.at("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2) {
      bad_entry(path, name,
                fmt::format("data_offsets is not an array of two integers (it is {})",
                            offsets.is_array() ? fmt::format("an array of {}", offsets.size()) : kind_of(offsets)));
    }
    e.begin = json_count(path, name, offsets[0], "data_offsets begin");
    e.end = json_count(path, name, offsets[1], "data_offsets end");
    out.entries.push_back(std::move(e));
  }
  return out;
}

// Checks each entry's byte count, then that the ranges tile [0, data_size) exactly.
void check_layout(const std::string& path, std::vector<SafetensorsEntry>& entries, uint64_t data_size) {
  for (const SafetensorsEntry& e : entries) {
    if (e.begin > e.end) bad_entry(path, e.name, fmt::format("data_offsets begin {} > end {}", e.begin, e.end));
    // An empty tensor needs no bytes whatever its other dimensions; otherwise the product is checked.
    uint64_t bytes = safetensors_dtype_size(e.dtype);
    if (std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end()) {
      bytes = 0;
    } else {
      for (int64_t d : e.shape) {
        if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) {
          bad_entry(path, e.name, fmt::format("shape {} of {} overflows u64 bytes", shape_str(e.shape), e.dtype));
        }
      }
    }
    if (bytes != e.end - e.begin) {
      bad_entry(path, e.name, fmt::format("shape {} of {} needs {} bytes but data_offsets [{}, {}) span {}",
                                          shape_str(e.shape), e.dtype, bytes, e.begin, e.end, e.end - e.begin));
    }
    if (e.end > data_size) {
      bad_entry(path, e.name, fmt::format("data_offsets [{}, {}) reach beyond the end of the {}-byte data buffer",
                                          e.begin, e.end, data_size));
    }
  }
  // Sorted by (begin, end), an empty tensor sorts before a non-empty one starting at the same byte,
  // so it is not counted as overlapping it; one strictly inside another tensor's range is.
  std::stable_sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& e : entries) {
    if (e.begin < cursor) {
      bad_file(path, fmt::format("tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", shown(previous->name),
                                 previous->begin, previous->end, shown(e.name), e.begin, e.end));
    }
    if (e.begin > cursor) {
      bad_file(path, fmt::format("hole in the data buffer: bytes [{}, {}) belong to no tensor (before '{}')", cursor,
                                 e.begin, shown(e.name)));
    }
    cursor = e.end;
    previous = &e;
  }
  if (cursor < data_size) {
    bad_file(path, fmt::format("trailing bytes: [{}, {}) of the data buffer belong to no tensor", cursor, data_size));
  }
}

// Closes and removes the temporary file unless the rename went through.
struct TempFile {
  std::string path;
  FileDescriptor fd;
  bool renamed = false;
  ~TempFile() {
    fd.close();
    if (!renamed) ::unlink(path.c_str());
  }
};

}  // namespace

int64_t SafetensorsEntry::numel() const {
  // A zero anywhere first: the product of the other dimensions may not fit (the reader allows any).
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t safetensors_dtype_size(const std::string& dtype) {
  static const std::unordered_map<std::string, size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}, {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U64", 8},  {"U32", 4},     {"U16", 2},     {"U8", 1},      {"BOOL", 1},
  };
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

SafetensorsReader::SafetensorsReader(const std::string& path)
    : path_(path), file_(path, "safetensors file", "give the path of a .safetensors file") {
  const uint64_t file_size = file_.size();
  if (file_size < 8) bad_file(path, fmt::format("too short: {} bytes, less than the 8-byte header length", file_size));
  uint64_t header_len = 0;
  file_.read_at(0, &header_len, 8);
  if (header_len > kMaxHeaderBytes) bad_file(path, fmt::format("header length {} is over the 100 MB limit", header_len));
  if (header_len > file_size - 8)
    bad_file(path, fmt::format("header length {} runs past the end of the {}-byte file", header_len, file_size));
  std::string text(header_len, '\0');
  file_.read_at(8, text.data(), text.size());

  ParsedHeader parsed = parse_header(path, text);
  data_start_ = 8 + header_len;
  check_layout(path, parsed.entries, file_size - data_start_);
  entries_ = std::move(parsed.entries);
  metadata_ = std::move(parsed.metadata);
  for (size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].name, i);
}

const SafetensorsEntry* SafetensorsReader::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

void SafetensorsReader::read_into(const std::string& name, const Tensor& dst) const {
  CW_CHECK(file_.is_open(), "read_into on a moved-from SafetensorsReader");
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) {
    fail(fmt::format("safetensors file '{}' has no tensor '{}'", path_, shown(name)),
         fmt::format("it holds {} tensors: check that the checkpoint matches the model", entries_.size()));
  }
  CW_CHECK(dst.device.is_cpu(), "read of '{}' into a {} tensor: read into host memory and copy", shown(name),
           device_name(dst.device));
  CW_CHECK(dst.contiguous() && dst.defined(), "read of '{}' into a non-contiguous or unallocated tensor {}",
           shown(name), dst.describe());

  const std::vector<int64_t> dst_shape(dst.shape.begin(), dst.shape.begin() + dst.ndim);
  if (dst_shape != e->shape) {
    fail(fmt::format("safetensors file '{}': tensor '{}' has shape {} but the destination has shape {}", path_,
                     shown(name), shape_str(e->shape), shape_str(dst_shape)),
         "the checkpoint does not match the model config");
  }

  const Stored kind = stored_kind(e->dtype);
  const bool float_source = kind == Stored::f64 || kind == Stored::f32 || kind == Stored::f16 || kind == Stored::bf16;
  const bool ok = dst.dtype == DType::i32 ? kind == Stored::i32 : float_source;
  if (!ok) {
    fail(fmt::format("safetensors file '{}': tensor '{}' is stored as {}, which cannot be read into {}", path_,
                     shown(name), e->dtype, dtype_name(dst.dtype)),
         "F64/F32/F16/BF16 tensors read into f64/f32/bf16 and I32 into i32: convert the checkpoint");
  }

  const uint64_t offset = data_start_ + e->begin;
  if (e->dtype == stored_name(dst.dtype)) {
    file_.read_at(offset, dst.data, static_cast<size_t>(e->end - e->begin));
    return;
  }
  // Convert in chunks so the scratch space stays small whatever the tensor's size.
  constexpr size_t kChunk = size_t(1) << 16;
  const size_t src_size = safetensors_dtype_size(e->dtype), dst_size = dtype_size(dst.dtype);
  const auto total = static_cast<size_t>(e->numel());
  std::vector<unsigned char> raw(std::min(total, kChunk) * src_size);
  std::vector<double> wide(std::min(total, kChunk));
  for (size_t done = 0; done < total;) {
    const size_t n = std::min(kChunk, total - done);
    file_.read_at(offset + done * src_size, raw.data(), n * src_size);
    decode(kind, raw.data(), n, wide.data());
    encode(dst.dtype, wide.data(), n, static_cast<char*>(dst.data) + done * dst_size);
    done += n;
  }
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // The header, built by hand so the keys keep the caller's order (nlohmann::json would sort them);
  // names and metadata go through the JSON dumper for escaping, which also refuses invalid UTF-8.
  std::string header = "{";
  auto quoted = [&](const std::string& s, const char* what) {
    try {
      return nlohmann::json(s).dump();
    } catch (const nlohmann::json::exception&) {
      fail(fmt::format("cannot write safetensors file '{}': {} '{}' is not valid UTF-8", path, what, shown(s)),
           "tensor names and metadata must be UTF-8 text");
    }
  };
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      header += fmt::format("{}{}:{}", first ? "" : ",", quoted(k, "metadata key"), quoted(v, "metadata value"));
      first = false;
    }
    header += "}";
  }
  std::unordered_set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    CW_CHECK(name != "__metadata__" && seen.insert(name).second,
             "writing '{}': tensor name '{}' is reserved or given twice", path, shown(name));
    CW_CHECK(t.device.is_cpu() && t.contiguous() && t.defined(),
             "writing '{}': tensor '{}' is {}; it must be allocated, contiguous and on the CPU", path, shown(name),
             t.describe());
    const std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
    header += fmt::format("{}{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{},{}]}}",
                          header.size() > 1 ? "," : "", quoted(name, "tensor name"), stored_name(t.dtype),
                          shape_str(shape), offset, offset + t.bytes());
    offset += t.bytes();
  }
  header += "}";
  // Pad so the data buffer, and with it every tensor of an 8-byte-multiple size, starts 8-aligned.
  header.append((8 - header.size() % 8) % 8, ' ');

  TempFile tmp;
  tmp.path = fmt::format("{}.tmp-{}", path, static_cast<long>(::getpid()));
  tmp.fd = FileDescriptor(::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!tmp.fd.is_open()) {
    const int err = errno;
    tmp.renamed = true;  // nothing was created: nothing to remove
    fail(fmt::format("cannot create '{}' to write '{}': {}", tmp.path, path, std::strerror(err)),
         "check that the directory exists and is writable");
  }
  const uint64_t header_len = header.size();
  write_all(tmp.fd.get(), tmp.path, &header_len, 8);
  write_all(tmp.fd.get(), tmp.path, header.data(), header.size());
  for (const auto& [name, t] : tensors) write_all(tmp.fd.get(), tmp.path, t.data, t.bytes());
  if (::fsync(tmp.fd.get()) != 0) {
    fail(fmt::format("cannot fsync '{}': {}", tmp.path, std::strerror(errno)), "check the disk");
  }
  if (const int err = tmp.fd.close(); err != 0) {
    fail(fmt::format("cannot close '{}': {}", tmp.path, std::strerror(err)), "check free disk space");
  }
  if (::rename(tmp.path.c_str(), path.c_str()) != 0) {
    fail(fmt::format("cannot rename '{}' to '{}': {}", tmp.path, path, std::strerror(errno)),
         "check that the destination is writable and not a directory");
  }
  tmp.renamed = true;

  // The rename is durable only once the directory entry is on disk.
  const std::string dir = std::filesystem::path(path).parent_path().string();
  fsync_directory(dir.empty() ? "." : dir);
}

}  // namespace cw
