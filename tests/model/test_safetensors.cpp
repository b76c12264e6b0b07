// Tests of the safetensors reader and writer: bit-exact round trips, exact conversions from the
// stored float formats, the atomic replace, and one test per malformed file the reader must refuse
// (the bytes of each are built here, from a header JSON string and a data buffer).
#include "model/safetensors.h"

#include "tests/support.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

namespace cw {
namespace {

using test::contains;
using test::error_of;

// The 8-byte little-endian length prefix.
std::string le64(uint64_t v) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &v, 8);
  return s;
}

std::string write_bytes(const test::TempDir& dir, const std::string& name, const std::string& bytes) {
  const std::string path = dir.file(name);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

// A safetensors file from a header JSON string and the data buffer that follows it.
std::string write_raw(const test::TempDir& dir, const std::string& header, const std::string& data,
                      const std::string& name = "t.safetensors") {
  return write_bytes(dir, name, le64(header.size()) + header + data);
}

template <class T> std::string raw_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Opening `path` must throw cw::Error with a one-line message naming the file and the problem.
void check_rejected(const std::string& path, const std::string& word) {
  std::string message;
  bool threw = false;
  try {
    SafetensorsReader reader(path);
  } catch (const Error& e) {
    threw = true;
    message = e.what();
  }
  INFO("message: ", message);
  CHECK_MESSAGE(threw, "expected an error containing '", word, "'");
  CHECK(contains(message, path));
  CHECK(contains(message, word));
  CHECK(!contains(message, "\n"));
}

// Independent reference for IEEE binary16 values (NaN excluded): sign * mantissa * 2^exponent.
double f16_reference(uint16_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }

const std::string kF32Entry = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
const std::string kEightBytes(8, '\x01');

}  // namespace

TEST_CASE("safetensors round trip is bit-exact for f64, f32, bf16, i32, empty and scalar tensors") {
  test::TempDir dir("safetensors");
  const std::string path = dir.file("model.safetensors");

  std::vector<double> f64 = {1.0, -0.0, 1e-310, std::numeric_limits<double>::infinity(),
                             std::bit_cast<double>(uint64_t{0x7ff0000000000123}),  // signalling NaN, payload
                             std::numeric_limits<double>::max()};
  std::vector<float> f32 = {0.1f, -3.5f, 1e-40f, -std::numeric_limits<float>::infinity()};
  std::vector<bf16> b16(8);
  const uint16_t b16_bits[8] = {0x3f80, 0xc040, 0x0001, 0x7f80, 0x7f81, 0x8000, 0x3eab, 0xffff};
  for (int i = 0; i < 8; ++i) b16[i].bits = b16_bits[i];
  std::vector<int32_t> i32 = {std::numeric_limits<int32_t>::min(), -1, 0, 1, std::numeric_limits<int32_t>::max()};
  float scalar = 42.25f;

  const Tensor t64(f64.data(), DType::f64, Device::host(), {2, 3});
  const Tensor t32(f32.data(), DType::f32, Device::host(), {4});
  const Tensor tb16(b16.data(), DType::bf16, Device::host(), {2, 2, 2});
  const Tensor ti32(i32.data(), DType::i32, Device::host(), {5, 1});
  const Tensor empty(nullptr, DType::f32, Device::host(), {0, 3});
  const Tensor tscalar(&scalar, DType::f32, Device::host(), {});
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "caf\xc3\xa9 \"quoted\"\n"}};
  write_safetensors(path,
                    {{"w.f64", t64}, {"w.f32", t32}, {"w.bf16", tb16}, {"ids", ti32}, {"empty", empty}, {"s", tscalar}},
                    meta);

  // The header length is a multiple of 8, so the data buffer starts aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  CHECK(header_len % 8 == 0);

  SafetensorsReader moved_from(path);
  const SafetensorsReader reader(std::move(moved_from));
  CHECK(reader.path() == path);
  CHECK(reader.metadata() == meta);
  const std::vector<std::string> names = {"w.f64", "w.f32", "w.bf16", "ids", "empty", "s"};
  const std::vector<std::string> dtypes = {"F64", "F32", "BF16", "I32", "F32", "F32"};
  const std::vector<std::vector<int64_t>> shapes = {{2, 3}, {4}, {2, 2, 2}, {5, 1}, {0, 3}, {}};
  REQUIRE(reader.entries().size() == names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    CHECK(reader.entries()[i].name == names[i]);
    CHECK(reader.entries()[i].dtype == dtypes[i]);
    CHECK(reader.entries()[i].shape == shapes[i]);
    CHECK(reader.find(names[i]) == &reader.entries()[i]);
  }
  CHECK(reader.find("missing") == nullptr);
  CHECK(reader.find("empty")->begin == reader.find("empty")->end);

  OwnedTensor r64(DType::f64, {2, 3}), r32(DType::f32, {4}), rb16(DType::bf16, {2, 2, 2}), ri32(DType::i32, {5, 1});
  OwnedTensor rempty(DType::f32, {0, 3}), rscalar(DType::f32, {});
  reader.read_into("w.f64", r64);
  reader.read_into("w.f32", r32);
  reader.read_into("w.bf16", rb16);
  reader.read_into("ids", ri32);
  reader.read_into("empty", rempty);
  reader.read_into("s", rscalar);
  CHECK(std::memcmp(r64.tensor.data, f64.data(), 6 * 8) == 0);
  CHECK(std::memcmp(r32.tensor.data, f32.data(), 4 * 4) == 0);
  CHECK(std::memcmp(rb16.tensor.data, b16.data(), 8 * 2) == 0);
  CHECK(std::memcmp(ri32.tensor.data, i32.data(), 5 * 4) == 0);
  CHECK(*rscalar.tensor.ptr<float>() == 42.25f);
}

TEST_CASE("safetensors reads F16 exactly into f32, f64 and bf16, subnormals and infinities included") {
  test::TempDir dir("safetensors");
  const std::vector<uint16_t> small = {0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x3c00,
                                       0xc000, 0x3555, 0x7bff, 0x7c00, 0xfc00, 0x7e00};
  // Every bit pattern, and then some, so the conversion also runs over more than one chunk.
  std::vector<uint16_t> all(70000);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  const std::string header = fmt::format(
      R"({{"small":{{"dtype":"F16","shape":[3,4],"data_offsets":[0,24]}},)"
      R"("all":{{"dtype":"F16","shape":[70000],"data_offsets":[24,{}]}}}})",
      24 + 2 * all.size());
  const SafetensorsReader reader(write_raw(dir, header, raw_of(small) + raw_of(all)));

  OwnedTensor f32(DType::f32, {3, 4}), f64(DType::f64, {3, 4}), b16(DType::bf16, {3, 4});
  reader.read_into("small", f32);
  reader.read_into("small", f64);
  reader.read_into("small", b16);
  const std::vector<double> expected = {0.0,  -0.0, std::ldexp(1.0, -24), 1023 * std::ldexp(1.0, -24),
                                        std::ldexp(1.0, -14), 1.0, -2.0, 0.333251953125, 65504.0,
                                        std::numeric_limits<double>::infinity(),
                                        -std::numeric_limits<double>::infinity(), 0.0 /* NaN */};
  for (size_t i = 0; i + 1 < expected.size(); ++i) {
    INFO("element ", i);
    CHECK(f32.tensor.ptr<float>()[i] == static_cast<float>(expected[i]));
    CHECK(f64.tensor.ptr<double>()[i] == expected[i]);
    CHECK(std::signbit(f64.tensor.ptr<double>()[i]) == std::signbit(expected[i]));
    CHECK(b16.tensor.ptr<bf16>()[i].bits == bf16::from_float(static_cast<float>(expected[i])).bits);
  }
  CHECK(std::isnan(f32.tensor.ptr<float>()[11]));
  CHECK(std::isnan(f64.tensor.ptr<double>()[11]));
  CHECK(std::isnan(b16.tensor.ptr<bf16>()[11].to_float()));
  CHECK(b16.tensor.ptr<bf16>()[7].bits == 0x3eab);  // 0.333251953125 rounds up to 0.333984375

  OwnedTensor all64(DType::f64, {70000});
  reader.read_into("all", all64);
  int64_t wrong = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const double got = all64.tensor.ptr<double>()[i];
    const bool is_nan = (all[i] & 0x7c00) == 0x7c00 && (all[i] & 0x3ff) != 0;
    if (is_nan ? !std::isnan(got) : (got != f16_reference(all[i]) || std::signbit(got) != bool(all[i] & 0x8000))) {
      ++wrong;
    }
  }
  CHECK(wrong == 0);
}

TEST_CASE("safetensors reads BF16 exactly into f32, f64 and bf16") {
  test::TempDir dir("safetensors");
  const std::vector<uint16_t> bits = {0x3f80, 0xc040, 0x0001, 0x7f80, 0xff80, 0x8000, 0x3eab, 0x7fc1};
  const SafetensorsReader reader(
      write_raw(dir, R"({"b":{"dtype":"BF16","shape":[2,4],"data_offsets":[0,16]}})", raw_of(bits)));
  OwnedTensor f32(DType::f32, {2, 4}), f64(DType::f64, {2, 4}), b16(DType::bf16, {2, 4});
  reader.read_into("b", f32);
  reader.read_into("b", f64);
  reader.read_into("b", b16);
  const std::vector<double> expected = {1.0, -3.0, std::ldexp(1.0, -133), std::numeric_limits<double>::infinity(),
                                        -std::numeric_limits<double>::infinity(), -0.0, 0.333984375};
  for (size_t i = 0; i < bits.size(); ++i) {
    INFO("element ", i);
    CHECK(bits_of(f32.tensor.ptr<float>()[i]) == uint32_t{bits[i]} << 16);
    CHECK(b16.tensor.ptr<bf16>()[i].bits == bits[i]);
    if (i < expected.size()) {
      CHECK(f64.tensor.ptr<double>()[i] == expected[i]);
      CHECK(std::signbit(f64.tensor.ptr<double>()[i]) == std::signbit(expected[i]));
    }
  }
  CHECK(std::isnan(f64.tensor.ptr<double>()[7]));
}

TEST_CASE("safetensors rounds F32 and F64 to nearest even when reading into bf16 or f32") {
  test::TempDir dir("safetensors");
  // f32 bit patterns around the bf16 rounding point of 1.0 and friends, with the expected bf16.
  const std::vector<uint32_t> f32_bits = {0x3f808000,   // 1 + 2^-8: a tie, to the even 1.0
                                          0x3f818000,   // 1 + 2^-7 + 2^-8: a tie, to the even 1 + 2^-6
                                          0x3f808001,   // just above the tie: up
                                          0x3f807fff,   // just below the tie: down
                                          0xbf808001,   // negative, above the tie in magnitude
                                          0x7f7fffff};  // FLT_MAX: past bf16's largest, to inf
  const std::vector<uint16_t> f32_expected = {0x3f80, 0x3f82, 0x3f81, 0x3f80, 0xbf81, 0x7f80};
  // f64 values; 1 + 2^-8 + 2^-40 is the double-rounding trap: via f32 it would become the tie 1 + 2^-8.
  const std::vector<double> f64 = {1 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40), 1 + std::ldexp(1.0, -8),
                                   -(1 + std::ldexp(1.0, -7) + std::ldexp(1.0, -8)), 1e-50, -1e-50, 1e300};
  const std::vector<uint16_t> f64_expected = {0x3f81, 0x3f80, 0xbf82, 0x0000, 0x8000, 0x7f80};
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[6],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"F64","shape":[6],"data_offsets":[24,72]}})";
  const SafetensorsReader reader(write_raw(dir, header, raw_of(f32_bits) + raw_of(f64)));

  OwnedTensor a(DType::bf16, {6}), b(DType::bf16, {6}), b32(DType::f32, {6});
  reader.read_into("a", a);
  reader.read_into("b", b);
  reader.read_into("b", b32);
  for (size_t i = 0; i < 6; ++i) {
    INFO("element ", i);
    CHECK(a.tensor.ptr<bf16>()[i].bits == f32_expected[i]);
    CHECK(b.tensor.ptr<bf16>()[i].bits == f64_expected[i]);
    CHECK(b32.tensor.ptr<float>()[i] == static_cast<float>(f64[i]));
  }
  // F64 -> f32: the tie 1 + 2^-24 goes to the even 1.0, anything above it up.
  const std::vector<double> ties = {1 + std::ldexp(1.0, -24), 1 + std::ldexp(1.0, -24) + std::ldexp(1.0, -50)};
  const SafetensorsReader reader2(write_raw(dir, R"({"t":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})",
                                            raw_of(ties), "ties.safetensors"));
  OwnedTensor t(DType::f32, {2});
  reader2.read_into("t", t);
  CHECK(t.tensor.ptr<float>()[0] == 1.0f);
  CHECK(t.tensor.ptr<float>()[1] == 1.0f + std::ldexp(1.0f, -23));
}

TEST_CASE("safetensors accepts a padded header, any header order, empty tensors and unknown entry keys") {
  test::TempDir dir("safetensors");
  const std::string header =
      R"({"__metadata__":{"k":"v"},)"
      R"("second":{"dtype":"U8","shape":[4],"data_offsets":[8,12],"extra":[1]},)"
      R"("none":{"dtype":"I64","shape":[3,0],"data_offsets":[8,8]},)"
      R"("first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}     )";
  const std::vector<float> first = {1.5f, -2.0f};
  const SafetensorsReader reader(write_raw(dir, header, raw_of(first) + "abcd"));
  REQUIRE(reader.entries().size() == 3);
  CHECK(reader.entries()[0].name == "first");
  CHECK(reader.entries()[1].name == "none");
  CHECK(reader.entries()[2].name == "second");
  CHECK(reader.entries()[2].numel() == 4);
  CHECK(reader.metadata().at("k") == "v");
  OwnedTensor f(DType::f64, {2});
  reader.read_into("first", f);
  CHECK(f.tensor.ptr<double>()[0] == 1.5);
  CHECK(f.tensor.ptr<double>()[1] == -2.0);
}

TEST_CASE("safetensors read_into names the file, the tensor and both shapes or dtypes on a mismatch") {
  test::TempDir dir("safetensors");
  const std::vector<float> values(6, 1.0f);
  const std::vector<int32_t> ids = {1, 2};
  const std::string path = write_raw(dir,
                                     R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                                     R"("ids":{"dtype":"I32","shape":[2],"data_offsets":[24,32]}})",
                                     raw_of(values) + raw_of(ids));
  const SafetensorsReader reader(path);

  OwnedTensor wrong_shape(DType::f32, {3, 2});
  const std::string shape_error = error_of([&] { reader.read_into("w", wrong_shape); });
  CHECK(contains(shape_error, path));
  CHECK(contains(shape_error, "'w'"));
  CHECK(contains(shape_error, "[2, 3]"));
  CHECK(contains(shape_error, "[3, 2]"));

  OwnedTensor wrong_rank(DType::f32, {6});
  CHECK(contains(error_of([&] { reader.read_into("w", wrong_rank); }), "[6]"));

  OwnedTensor as_float(DType::f32, {2});
  const std::string dtype_error = error_of([&] { reader.read_into("ids", as_float); });
  CHECK(contains(dtype_error, path));
  CHECK(contains(dtype_error, "I32"));
  OwnedTensor as_int(DType::i32, {2, 3});
  CHECK(contains(error_of([&] { reader.read_into("w", as_int); }), "F32"));

  const std::string missing = error_of([&] { reader.read_into("nope", as_float); });
  CHECK(contains(missing, path));
  CHECK(contains(missing, "no tensor 'nope'"));
}

TEST_CASE("safetensors writer replaces an existing file atomically and leaves no temporary file") {
  test::TempDir dir("safetensors");
  const std::string path = dir.file("model.safetensors");
  std::vector<float> a = {1, 2};
  std::vector<double> b = {3, 4, 5};
  write_safetensors(path, {{"a", Tensor(a.data(), DType::f32, Device::host(), {2})}});
  write_safetensors(path, {{"b", Tensor(b.data(), DType::f64, Device::host(), {3})}}, {{"step", "2"}});

  std::vector<std::string> files;
  for (const auto& f : std::filesystem::directory_iterator(dir.path)) files.push_back(f.path().filename().string());
  CHECK(files == std::vector<std::string>{"model.safetensors"});

  const SafetensorsReader reader(path);
  REQUIRE(reader.entries().size() == 1);
  CHECK(reader.entries()[0].name == "b");
  CHECK(reader.metadata().at("step") == "2");
  OwnedTensor r(DType::f64, {3});
  reader.read_into("b", r);
  CHECK(std::memcmp(r.tensor.data, b.data(), 24) == 0);

  // A directory that does not exist: the error names the path and nothing is left anywhere.
  const std::string bad = dir.file("no-such-dir/model.safetensors");
  const std::string error =
      error_of([&] { write_safetensors(bad, {{"a", Tensor(a.data(), DType::f32, Device::host(), {2})}}); });
  CHECK(contains(error, bad));
  CHECK(!std::filesystem::exists(dir.path / "no-such-dir"));
}

// ---- malformed files: each must be refused with an error naming the file and the problem ----

TEST_CASE("safetensors names the path of a file it cannot open") {
  test::TempDir dir("safetensors");
  check_rejected(dir.file("absent.safetensors"), "cannot open");
  check_rejected(dir.path.string(), "not a regular file");
}

TEST_CASE("safetensors rejects a file shorter than the 8-byte length prefix") {
  test::TempDir dir("safetensors");
  check_rejected(write_bytes(dir, "short.safetensors", std::string("\x05\x00\x00", 3)), "too short");
  check_rejected(write_bytes(dir, "empty.safetensors", ""), "too short");
}

TEST_CASE("safetensors rejects an absurdly large header length") {
  test::TempDir dir("safetensors");
  check_rejected(write_bytes(dir, "huge.safetensors", le64(uint64_t(200) << 20) + "{}"), "100 MB");
  check_rejected(write_bytes(dir, "max.safetensors", le64(~uint64_t{0}) + "{}"), "100 MB");
}

TEST_CASE("safetensors rejects a header length past the end of the file") {
  test::TempDir dir("safetensors");
  check_rejected(write_bytes(dir, "t.safetensors", le64(1000) + "{}"), "past the end");
}

TEST_CASE("safetensors rejects a header that is not valid UTF-8") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, "{\"a\xff\":" + kF32Entry + "}", kEightBytes), "UTF-8");
  // An overlong encoding of '/' and a lone surrogate are not UTF-8 either.
  check_rejected(write_raw(dir, "{\"\xc0\xaf\":" + kF32Entry + "}", kEightBytes, "overlong.safetensors"), "UTF-8");
  check_rejected(write_raw(dir, "{\"\xed\xa0\x80\":" + kF32Entry + "}", kEightBytes, "surrogate.safetensors"), "UTF-8");
}

TEST_CASE("safetensors rejects a header that is not valid JSON") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a": {"dtype": "F32", )", kEightBytes), "not valid JSON");
  check_rejected(write_raw(dir, "", "", "empty-header.safetensors"), "not valid JSON");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,1e400]}})", kEightBytes,
                           "overflow.safetensors"),
                 "not valid JSON");
  // NUL padding is not whitespace; and a NUL must not hide the garbage after it.
  check_rejected(write_raw(dir, "{\"a\":" + kF32Entry + std::string("}\0\0", 3), kEightBytes, "nul.safetensors"),
                 "not valid JSON");
  check_rejected(write_raw(dir, "{\"a\":" + kF32Entry + std::string("}\0garbage", 9), kEightBytes,
                           "hidden.safetensors"),
                 "not valid JSON");
}

TEST_CASE("safetensors rejects header JSON that is not an object") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, "[" + kF32Entry + "]", kEightBytes), "not an object");
  check_rejected(write_raw(dir, "42", "", "number.safetensors"), "not an object");
  // Deep nesting is refused without recursing through it.
  check_rejected(write_raw(dir, std::string(100000, '[') + std::string(100000, ']'), "", "deep.safetensors"),
                 "not an object");
}

TEST_CASE("safetensors rejects duplicate keys at any depth") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, "{\"a\":" + kF32Entry + ",\"a\":" + kF32Entry + "}", kEightBytes), "duplicate key 'a'");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                           kEightBytes, "nested.safetensors"),
                 "duplicate key 'dtype' inside 'a'");
  check_rejected(write_raw(dir, R"({"__metadata__":{"k":"1","k":"2"},"a":)" + kF32Entry + "}", kEightBytes,
                           "metadata.safetensors"),
                 "duplicate key 'k'");
}

TEST_CASE("safetensors rejects an entry that is not an object") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":[0,8]})", kEightBytes), "entry is not an object");
}

TEST_CASE("safetensors rejects an entry missing dtype, shape or data_offsets") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":{"shape":[2],"data_offsets":[0,8]}})", kEightBytes, "1.safetensors"),
                 "missing \"dtype\"");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", kEightBytes, "2.safetensors"),
                 "missing \"shape\"");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[2]}})", kEightBytes, "3.safetensors"),
                 "missing \"data_offsets\"");
}

TEST_CASE("safetensors rejects an unknown dtype") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})", kEightBytes),
                 "unknown dtype 'F128'");
  check_rejected(write_raw(dir, R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", kEightBytes, "n.safetensors"),
                 "dtype is not a string");
}

TEST_CASE("safetensors rejects a negative shape dimension") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", kEightBytes), "negative");
}

TEST_CASE("safetensors rejects a non-integer shape dimension or a shape that is not an array") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", kEightBytes,
                           "1.safetensors"),
                 "not an integer");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", kEightBytes,
                           "2.safetensors"),
                 "not an integer");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", kEightBytes,
                           "3.safetensors"),
                 "shape is not an array");
}

TEST_CASE("safetensors rejects data_offsets that are not two non-negative integers") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", kEightBytes,
                           "1.safetensors"),
                 "two integers");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", kEightBytes,
                           "2.safetensors"),
                 "negative");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,1e30]}})", kEightBytes,
                           "3.safetensors"),
                 "not an integer");
}

TEST_CASE("safetensors rejects a shape whose byte count overflows u64") {
  test::TempDir dir("safetensors");
  check_rejected(
      write_raw(dir, R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,2],"data_offsets":[0,8]}})", kEightBytes),
      "overflow");
}

TEST_CASE("safetensors rejects a shape that disagrees with its byte range") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", kEightBytes),
                 "needs 12 bytes");
}

TEST_CASE("safetensors rejects data_offsets with begin > end") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", kEightBytes),
                 "begin 8 > end 0");
}

TEST_CASE("safetensors rejects data_offsets beyond the data buffer") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", kEightBytes),
                 "beyond the end");
}

TEST_CASE("safetensors rejects overlapping ranges") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir,
                           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           std::string(12, '\0')),
                 "overlap");
  // An empty tensor placed strictly inside another one overlaps it too.
  check_rejected(write_raw(dir,
                           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                           kEightBytes, "inside.safetensors"),
                 "overlap");
}

TEST_CASE("safetensors rejects a hole between ranges") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir,
                           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                           std::string(12, '\0')),
                 "hole");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", kEightBytes,
                           "leading.safetensors"),
                 "hole");
}

TEST_CASE("safetensors rejects trailing bytes after the last range") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", kEightBytes), "trailing");
  check_rejected(write_raw(dir, "{}", "x", "no-tensors.safetensors"), "trailing");
}

TEST_CASE("safetensors rejects __metadata__ that is not an object of strings") {
  test::TempDir dir("safetensors");
  check_rejected(write_raw(dir, R"({"__metadata__":{"k":1},"a":)" + kF32Entry + "}", kEightBytes, "1.safetensors"),
                 "__metadata__");
  check_rejected(write_raw(dir, R"({"__metadata__":["k","v"],"a":)" + kF32Entry + "}", kEightBytes, "2.safetensors"),
                 "__metadata__");
}

}  // namespace cw
