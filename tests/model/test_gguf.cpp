// Tests of the GGUF reader (model/gguf.h) and of Llama models from GGUF (model/gguf_llama.h):
//   - metadata of every value type, read back through the typed getters, wrong types refused;
//   - dequantization: hand-computed blocks of F32, F16, BF16, F64, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and
//     random blocks of every supported type against the `gguf` Python package (tests/data/gguf_quants.gguf,
//     made by tests/data/make_gguf_quants.py), bit for bit in f32;
//   - malformed files (built here byte by byte), each refused with one line naming the file;
//   - a tiny Llama written as GGUF the way llama.cpp's converter writes it (Q/K rows permuted, dims
//     innermost first) loads back into exactly the parameters it came from;
//   - the real SmolLM2-135M-Instruct Q4_1 file when it is in .models/ (skipped, with a message, when not).
#include "model/gguf.h"
#include "model/gguf_llama.h"

#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "tests/model/gguf_builder.h"
#include "tests/support.h"
#include "tools/model_io.h"

#include <nlohmann/json.hpp>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <numbers>
#include <optional>

namespace cw {
namespace {

using test::bytes_of;
using test::contains;
using test::converter_permute;
using test::error_of;
using test::gguf_string;
using test::GgufBuilder;
using test::raw;
using test::TensorSpec;
using test::write_file;

namespace fs = std::filesystem;

// `f` must throw cw::Error with one line naming `path` and containing `word`.
template <class F> void check_refused(F&& f, const std::string& path, const std::string& word) {
  const std::string message = error_of(f);
  INFO("message: ", message);
  CHECK_MESSAGE(!message.empty(), "expected an error containing '", word, "'");
  CHECK(contains(message, path));
  CHECK(contains(message, word));
  CHECK(!contains(message, "\n"));
}

void check_open_refused(const std::string& path, const std::string& word) {
  check_refused([&] { GgufReader r(path); }, path, word);
}

std::vector<double> read_values(const GgufReader& r, const std::string& name, DType dtype = DType::f64) {
  const GgufTensorInfo* t = r.find_tensor(name);
  REQUIRE(t);
  OwnedTensor out = OwnedTensor::of_shape(dtype, t->shape());
  r.read_into(name, out);
  OwnedTensor wide = OwnedTensor::of_shape(DType::f64, t->shape());
  copy_convert(wide, out);
  return {wide.tensor.ptr<double>(), wide.tensor.ptr<double>() + wide.tensor.numel()};
}

// ---- metadata ----

TEST_CASE("gguf: metadata of every value type reads back through the typed getters") {
  test::TempDir dir("gguf-meta");
  GgufBuilder b;
  b.kv("u8", 0, raw<uint8_t>(200));
  b.kv("i8", 1, raw<int8_t>(-100));
  b.kv("u16", 2, raw<uint16_t>(60000));
  b.kv("i16", 3, raw<int16_t>(-30000));
  b.u32("u32", 4000000000u);
  b.kv("i32", 5, raw<int32_t>(-2000000000));
  b.f32("f32", 0.1f);
  b.kv("bool", 7, raw<uint8_t>(1));
  b.str("string", "héllo");
  b.kv("u64", 10, raw<uint64_t>(uint64_t(1) << 40));
  b.kv("u64.huge", 10, raw<uint64_t>(~uint64_t(0)));
  b.kv("i64", 11, raw<int64_t>(-(int64_t(1) << 50)));
  b.kv("f64", 12, raw<double>(-2.5e-300));
  b.strings("strings", {"a", "", "merges x"});
  b.kv("i32s", 9, raw<uint32_t>(5) + raw<uint64_t>(3) + raw<int32_t>(1) + raw<int32_t>(-2) + raw<int32_t>(3));
  b.kv("f32s", 9, raw<uint32_t>(6) + raw<uint64_t>(2) + raw<float>(0.5f) + raw<float>(-1e30f));
  b.kv("nested", 9, raw<uint32_t>(9) + raw<uint64_t>(2) + raw<uint32_t>(0) + raw<uint64_t>(1) + raw<uint8_t>(7) +
                        raw<uint32_t>(8) + raw<uint64_t>(1) + gguf_string("in"));
  b.kv("empty", 9, raw<uint32_t>(4) + raw<uint64_t>(0));
  const std::string path = write_file(dir, "meta.gguf", b.bytes());
  const GgufReader r(path);
  CHECK(r.version() == 3);
  CHECK(r.alignment() == 32);
  CHECK(r.tensors().empty());
  REQUIRE(r.metadata().size() == 18);
  CHECK(r.metadata()[0].first == "u8");  // file order
  CHECK(r.get_int("u8") == 200);
  CHECK(r.get_int("i8") == -100);
  CHECK(r.get_int("u16") == 60000);
  CHECK(r.get_int("i16") == -30000);
  CHECK(r.get_int("u32") == 4000000000ll);
  CHECK(r.get_int("i32") == -2000000000);
  CHECK(r.get_float("f32") == static_cast<double>(0.1f));  // widened exactly
  CHECK(r.get_float("u32") == 4e9);                        // integers are numbers too
  CHECK(r.get_bool("bool"));
  CHECK(r.get_string("string") == "héllo");
  CHECK(r.get_int("u64") == int64_t(1) << 40);
  CHECK(r.get_int("i64") == -(int64_t(1) << 50));
  CHECK(r.get_float("f64") == -2.5e-300);
  CHECK(r.get_strings("strings") == std::vector<std::string>{"a", "", "merges x"});
  CHECK(r.get_ints("i32s") == std::vector<int64_t>{1, -2, 3});
  CHECK(r.get_floats("f32s") == std::vector<double>{0.5, static_cast<double>(-1e30f)});
  CHECK(r.get_ints("empty").empty());
  const GgufValue* nested = r.find("nested");
  REQUIRE(nested);
  CHECK(nested->element_type == GgufValueType::array);
  REQUIRE(nested->array_values.size() == 2);
  CHECK(nested->array_values[0].unsigned_values == std::vector<uint64_t>{7});
  CHECK(nested->array_values[1].string_values == std::vector<std::string>{"in"});
  // Fallbacks serve absent keys only.
  CHECK(r.get_int("absent", 17) == 17);
  CHECK(r.get_float("absent", 0.25) == 0.25);
  CHECK(r.get_string("absent", "x") == "x");
  CHECK(!r.get_bool("absent", false));
  CHECK(r.get_int("u8", 17) == 200);
  // Wrong types and absent keys: one line naming the file and the key.
  check_refused([&] { r.get_int("string"); }, path, "metadata 'string' is a string, expected an integer");
  check_refused([&] { r.get_int("f32"); }, path, "'f32' is a f32");
  check_refused([&] { r.get_string("u8", "fallback"); }, path, "expected a string");
  check_refused([&] { r.get_strings("i32s"); }, path, "'i32s' is an array of i32, expected an array of strings");
  check_refused([&] { r.get_floats("i32s"); }, path, "expected an array of floats");
  check_refused([&] { r.get_ints("u8"); }, path, "expected an array of integers");
  check_refused([&] { r.get_bool("u8"); }, path, "expected a bool");
  check_refused([&] { r.get_int("u64.huge"); }, path, "does not fit an int64");
  check_refused([&] { r.get_int("absent"); }, path, "metadata key 'absent' is missing");
}

// ---- dequantization, by hand ----

uint16_t half_bits(float f) {  // exact for the values used here (checked)
  const auto bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) == 0) return static_cast<uint16_t>(bits >> 16);  // +-0
  const uint32_t exponent = (bits >> 23) & 0xff;
  REQUIRE((bits & 0x1fff) == 0);
  REQUIRE((exponent >= 113 && exponent <= 142));
  return static_cast<uint16_t>(((bits >> 16) & 0x8000) | ((exponent - 112) << 10) | ((bits >> 13) & 0x3ff));
}

TEST_CASE("gguf: hand-computed blocks of F32, F16, BF16, F64, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1") {
  test::TempDir dir("gguf-hand");
  GgufBuilder b;
  b.tensors.push_back({"f32", {2}, 0, bytes_of(std::vector<float>{1.5f, -2.25f})});
  // F16: 1, -2, the smallest subnormal 2^-24, the largest finite 65504.
  b.tensors.push_back({"f16", {4}, 1, bytes_of(std::vector<uint16_t>{0x3c00, 0xc000, 0x0001, 0x7bff})});
  b.tensors.push_back({"bf16", {2}, 30, bytes_of(std::vector<uint16_t>{0x3f80, 0xc0a0})});  // 1, -5
  b.tensors.push_back({"f64", {1}, 28, bytes_of(std::vector<double>{1.0 / 3.0})});
  // Q8_0: d = 0.5, q_j = j - 16.
  std::string q8 = raw(half_bits(0.5f));
  for (int j = 0; j < 32; ++j) q8 += static_cast<char>(static_cast<int8_t>(j - 16));
  b.tensors.push_back({"q8_0", {32}, 8, q8});
  // The 4-bit types: byte j holds q_j in its low nibble and q_{j+16} in its high one; here q_j = j
  // and q_{j+16} = 15 - j.
  std::string nibbles;
  for (int j = 0; j < 16; ++j) nibbles += static_cast<char>(j | ((15 - j) << 4));
  b.tensors.push_back({"q4_0", {32}, 2, raw(half_bits(2.0f)) + nibbles});                              // d = 2
  b.tensors.push_back({"q4_1", {32}, 3, raw(half_bits(0.25f)) + raw(half_bits(-1.0f)) + nibbles});     // d, m
  // The 5-bit types add bit j of qh as the 5th bit of element j: here every even element.
  const uint32_t qh = 0x55555555u;
  b.tensors.push_back({"q5_0", {32}, 6, raw(half_bits(1.0f)) + raw(qh) + nibbles});
  b.tensors.push_back({"q5_1", {32}, 7, raw(half_bits(0.5f)) + raw(half_bits(3.0f)) + raw(qh) + nibbles});
  const std::string path = write_file(dir, "hand.gguf", b.bytes());
  const GgufReader r(path);

  CHECK(read_values(r, "f32") == std::vector<double>{1.5, -2.25});
  CHECK(read_values(r, "f16") == std::vector<double>{1.0, -2.0, std::ldexp(1.0, -24), 65504.0});
  CHECK(read_values(r, "bf16") == std::vector<double>{1.0, -5.0});
  CHECK(read_values(r, "f64") == std::vector<double>{1.0 / 3.0});
  const std::vector<double> q8v = read_values(r, "q8_0");
  CHECK(q8v[0] == -8.0);
  CHECK(q8v[31] == 7.5);
  const std::vector<double> q40 = read_values(r, "q4_0"), q41 = read_values(r, "q4_1");
  const std::vector<double> q50 = read_values(r, "q5_0"), q51 = read_values(r, "q5_1");
  CHECK(q40[0] == -16.0);   // (0 - 8) * 2
  CHECK(q40[16] == 14.0);   // (15 - 8) * 2
  CHECK(q41[5] == 0.25);    // 5 * 0.25 - 1
  CHECK(q41[31] == -1.0);   // 0 * 0.25 - 1
  CHECK(q50[0] == 0.0);     // (0 | 16) - 16
  CHECK(q50[1] == -15.0);   // (1 | 0) - 16
  CHECK(q50[16] == 15.0);   // element 16 is even: (15 | 16) - 16
  CHECK(q51[2] == 12.0);    // (2 | 16) * 0.5 + 3
  CHECK(q51[17] == 10.0);   // (14 | 0) * 0.5 + 3
  for (int j = 0; j < 32; ++j) {
    CAPTURE(j);
    const int q4 = j < 16 ? j : 15 - (j - 16);
    const int q5 = q4 | (j % 2 == 0 ? 16 : 0);
    CHECK(q8v[j] == (j - 16) * 0.5);
    CHECK(q40[j] == (q4 - 8) * 2.0);
    CHECK(q41[j] == q4 * 0.25 - 1.0);
    CHECK(q50[j] == q5 - 16.0);
    CHECK(q51[j] == q5 * 0.5 + 3.0);
  }
  // Every destination dtype: f32 and bf16 round the same values (all exact here).
  CHECK(read_values(r, "q4_1", DType::f32) == q41);
  CHECK(read_values(r, "q4_1", DType::bf16) == q41);
  // Shape mismatches and non-dequantizable types are refused naming file and tensor.
  OwnedTensor wrong(DType::f32, {31});
  check_refused([&] { r.read_into("q4_1", wrong); }, path, "tensor 'q4_1' has shape [32] (GGUF dims [32]), expected [31]");
  check_refused([&] { r.read_into("nothing", wrong); }, path, "has no tensor 'nothing'");
}

TEST_CASE("gguf: every supported type equals the gguf Python package's dequantization, bit for bit") {
  const std::string path = std::string(CW_SOURCE_ROOT) + "/tests/data/gguf_quants.gguf";
  const GgufReader r(path);
  const std::vector<std::string> types = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0",
                                          "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"};
  for (const std::string& type : types) {
    CAPTURE(type);
    const GgufTensorInfo* t = r.find_tensor(type);
    REQUIRE(t);
    CHECK(ggml_type_info(static_cast<uint32_t>(t->type))->name == type);
    CHECK(t->shape() == std::vector<int64_t>{2, 512});
    const std::vector<double> ours = read_values(r, type, DType::f32);
    const std::vector<double> exact = read_values(r, type, DType::f64);
    const std::vector<double> ref = read_values(r, type + ".ref", DType::f32);
    int mismatches = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      // f32: the package's value exactly; f64: a value that rounds to it (the exact one).
      if (ours[i] != ref[i] || static_cast<float>(exact[i]) != static_cast<float>(ref[i])) {
        if (++mismatches <= 3) MESSAGE(type, " element ", i, ": ours ", ours[i], " (exact ", exact[i], "), gguf ", ref[i]);
      }
    }
    CHECK(mismatches == 0);
  }
}

// ---- malformed files ----

// A valid file with metadata of several kinds and three tensors, the last one ending the file.
GgufBuilder valid_builder() {
  GgufBuilder b;
  b.str("general.architecture", "test");
  b.u32("general.alignment", 32);
  b.strings("tokens", {"a", "bc"});
  b.f32("eps", 1e-5f);
  b.tensors.push_back({"norm", {4}, 0, bytes_of(std::vector<float>{1, 2, 3, 4})});
  std::string q41 = raw(half_bits(1.0f)) + raw(half_bits(0.0f)) + std::string(16, '\x21');
  b.tensors.push_back({"w", {32, 2}, 3, q41 + q41});
  b.tensors.push_back({"h", {3}, 1, bytes_of(std::vector<uint16_t>{0x3c00, 0x3c00, 0x3c00})});
  return b;
}

TEST_CASE("gguf: a file cut at any byte is refused naming the file") {
  test::TempDir dir("gguf-cut");
  const std::string full = valid_builder().bytes();
  {
    const GgufReader r(write_file(dir, "full.gguf", full));  // the uncut file is valid
    CHECK(r.tensors().size() == 3);
    CHECK(read_values(r, "h") == std::vector<double>{1, 1, 1});
  }
  const uint64_t data_offset = GgufReader(dir.file("full.gguf")).data_offset();
  for (size_t cut = 0; cut < full.size(); ++cut) {
    CAPTURE(cut);
    const std::string path = write_file(dir, "cut.gguf", full.substr(0, cut));
    // In the header or its padding: the counts that cannot fit, or the read that needs the missing
    // bytes, say so; in the data: the tensor whose bytes are missing.
    const std::string message = error_of([&] { GgufReader r(path); });
    INFO("message: ", message);
    CHECK(contains(message, path));
    if (cut < data_offset)
      CHECK((contains(message, "truncated") || contains(message, "cannot fit")));
    else
      CHECK(contains(message, "reach past"));
  }
}

TEST_CASE("gguf: malformed headers are refused, each with its own message") {
  test::TempDir dir("gguf-bad");
  int n = 0;
  auto refused = [&](const GgufBuilder& b, const std::string& word) {
    check_open_refused(write_file(dir, fmt::format("bad{}.gguf", n++), b.bytes()), word);
  };
  GgufBuilder b = valid_builder();
  b.magic = 0x4c4d5447u;
  refused(b, "does not start with the magic 'GGUF'");
  b = valid_builder();
  b.version = 1;
  refused(b, "GGUF version 1");
  b.version = 0x03000000u;
  refused(b, "big-endian");
  b.version = 4;
  refused(b, "unsupported GGUF version 4");

  b = valid_builder();
  b.tensor_count = uint64_t(1) << 60;
  refused(b, "cannot fit");
  b = valid_builder();
  b.kv_count = ~uint64_t(0);
  refused(b, "cannot fit");

  b = GgufBuilder();
  b.kvs = raw<uint64_t>(uint64_t(1) << 40) + "key" + std::string(20, 'x');  // a key length past the end
  b.n_kv = 1;
  refused(b, "truncated: metadata key #0 of 1099511627776 bytes");
  b = GgufBuilder();
  b.kv("k", 13, raw<uint32_t>(0));
  refused(b, "metadata 'k': unknown value type 13");
  b = GgufBuilder();
  b.kv("k", 9, raw<uint32_t>(8) + raw<uint64_t>(uint64_t(1) << 61));
  refused(b, "metadata 'k': array of 2305843009213693952 string elements cannot fit");
  b = GgufBuilder();
  b.kv("k", 9, raw<uint32_t>(20) + raw<uint64_t>(1));
  refused(b, "unknown array element type 20");
  b = GgufBuilder();
  b.kv("k", 7, raw<uint8_t>(2));
  refused(b, "bool element 0 is 2");
  b = GgufBuilder();
  std::string deep = raw<uint32_t>(0) + raw<uint64_t>(0);
  for (int i = 0; i < 9; ++i) deep = raw<uint32_t>(9) + raw<uint64_t>(1) + deep;
  b.kv("k", 9, deep);
  refused(b, "arrays nested deeper than 8");
  b = valid_builder();
  b.u32("eps", 1);
  refused(b, "duplicate metadata 'eps'");

  b = valid_builder();
  b.kvs.clear();
  b.n_kv = 0;
  b.kv("general.alignment", 10, raw<uint64_t>(32));
  refused(b, "general.alignment must be a u32");
  b = valid_builder();
  b.kvs.clear();
  b.n_kv = 0;
  b.u32("general.alignment", 24);
  b.alignment = 24;
  refused(b, "general.alignment 24 is not a power of two");

  b = valid_builder();
  b.tensors[1].type = 99;
  refused(b, "tensor 'w': unknown ggml type id 99");
  b = valid_builder();
  b.tensors[1].dims = {16, 4};
  refused(b, "tensor 'w': rows of 16 elements are not a whole number of Q4_1 blocks of 32");
  b = valid_builder();
  b.tensors[0].n_dims = 5;
  b.tensors[0].dims = {1, 1, 1, 1, 4};
  refused(b, "tensor 'norm': n_dims 5 is not in 1..4");
  b = valid_builder();
  b.tensors[0].n_dims = 0;
  b.tensors[0].dims = {};
  refused(b, "n_dims 0");
  b = valid_builder();
  b.tensors[0].dims = {4, ~uint64_t(0)};
  refused(b, "negative as int64");
  b = valid_builder();
  b.tensors[0].dims = {uint64_t(1) << 40, uint64_t(1) << 40};
  refused(b, "overflow the element count");
  b = valid_builder();
  b.tensors[2].name = "norm";
  refused(b, "duplicate tensor 'norm'");

  b = valid_builder();
  b.tensors[1].offset = 8;
  refused(b, "tensor 'w': offset 8 is not a multiple of the alignment 32");
  b = valid_builder();
  b.tensors[1].offset = uint64_t(1) << 40;
  refused(b, "tensor 'w': bytes [1099511627776, 1099511627776+40) of the data section reach past its end");
  b = valid_builder();
  b.tensors[1].offset = ~uint64_t(0) - 31;  // offset + bytes would overflow u64
  refused(b, "reach past its end");
  b = valid_builder();
  b.tensors[1].offset = 0;  // on top of 'norm'
  refused(b, "tensors 'norm' [0, 16) and 'w' [0, 40) overlap");
}

TEST_CASE("gguf: a type that cannot be dequantized, and a file cut after opening, fail at read time") {
  test::TempDir dir("gguf-read");
  GgufBuilder b = valid_builder();
  b.tensors.push_back({"q2k", {256}, 10, std::string(84, '\0')});
  const std::string path = write_file(dir, "q2k.gguf", b.bytes());
  const GgufReader r(path);
  CHECK(r.find_tensor("q2k")->bytes == 84);
  OwnedTensor out(DType::f32, {256});
  check_refused([&] { r.read_into("q2k", out); }, path, "tensor 'q2k' is stored as Q2_K, which chunkwise cannot dequantize");
  fs::resize_file(path, r.data_offset() + 8);
  OwnedTensor h(DType::f32, {3});
  check_refused([&] { r.read_into("h", h); }, path, "truncated");
}

// ---- Llama models ----

LlamaConfig tiny_for_gguf(bool tied) {
  LlamaConfig c = LlamaConfig::preset("tiny");
  c.rope_scaling = {};  // GGUF stores llama3 scaling as rope_freqs (tested below)
  c.rope_theta = 10000.0;
  c.rms_norm_eps = static_cast<float>(1e-5);  // stored as f32
  c.tie_word_embeddings = tied;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  c.torch_dtype = "float32";
  c.initializer_range = LlamaConfig{}.initializer_range;  // not stored in GGUF: the loader's default
  return c;
}

TEST_CASE("gguf: a Llama written as llama.cpp writes it loads back into the same parameters") {
  test::TempDir dir("gguf-llama");
  for (const bool tied : {false, true}) {
    CAPTURE(tied);
    const LlamaConfig c = tiny_for_gguf(tied);
    ParamSet original(c, DType::f32);
    init_parameters(original, 11, 0.5, 0.1);
    const std::string path = write_file(dir, tied ? "tied.gguf" : "untied.gguf", test::model_gguf_builder(original).bytes());
    CHECK(is_gguf_file(path));
    const LlamaConfig loaded_config = LlamaConfig::resolve(path);
    CHECK(loaded_config.to_json() == c.to_json());
    for (const DType dt : {DType::f32, DType::f64}) {
      ParamSet loaded(loaded_config, dt);
      load_gguf_weights(loaded, GgufReader(path));
      for (size_t i = 0; i < original.size(); ++i) {
        CAPTURE(original.specs()[i].name);
        const test::Worst w = test::compare(loaded[i], original[i]);
        INFO(w.str());
        CHECK(w.max_abs == 0.0);
      }
    }
  }
}

TEST_CASE("gguf: `--model file.gguf` (chunkwise logits) gives the logits of the same weights as an HF checkpoint") {
  test::TempDir dir("gguf-logits");
  const LlamaConfig c = tiny_for_gguf(true);
  ParamSet params(c, DType::f32);
  init_parameters(params, 5, 0.5, 0.1);
  const std::string gguf = write_file(dir, "tiny.gguf", test::model_gguf_builder(params).bytes());
  save_checkpoint_weights(params, c, dir.file("hf"), DType::f32);
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 2 * 9; ++i) ids.push_back((i * 7 + 3) % 61);
  write_file(dir, "ids.u32", bytes_of(ids));
  std::vector<OwnedTensor> logits;
  for (const std::string& model : {gguf, dir.file("hf")}) {
    LogitsOptions o;
    o.model = model;
    o.tokens = dir.file("ids.u32");
    o.batch = 2;
    o.seq = 9;
    o.dtype = "f64";
    o.chunk = 4;
    o.out = dir.file("logits.safetensors");
    write_logits(o);
    const SafetensorsReader r(o.out);
    logits.push_back(OwnedTensor(DType::f64, {18, 61}));
    r.read_into("logits", logits.back());
  }
  const test::Worst w = test::compare(logits[0], logits[1]);
  INFO(w.str());
  CHECK(w.max_abs == 0.0);
}

TEST_CASE("gguf: Q/K rows go back to HF order: gguf_qk_row inverts the converter's permutation") {
  const int64_t D = 6, heads = 3, C = 1;
  std::vector<float> hf(static_cast<size_t>(heads * D));
  for (size_t r = 0; r < hf.size(); ++r) hf[r] = static_cast<float>(r);
  const std::vector<float> gguf_order = converter_permute(hf, heads, D, C);
  // Head 0 in GGUF order: HF rows 0, 3, 1, 4, 2, 5 (pairs (i, i + D/2) made adjacent).
  CHECK(std::vector<float>(gguf_order.begin(), gguf_order.begin() + D) == std::vector<float>{0, 3, 1, 4, 2, 5});
  for (int64_t r = 0; r < heads * D; ++r) CHECK(gguf_order[static_cast<size_t>(gguf_qk_row(r, D))] == hf[static_cast<size_t>(r)]);
}

TEST_CASE("gguf: Llama files that do not match their metadata, or are not plain Llama, are refused") {
  test::TempDir dir("gguf-llama-bad");
  const LlamaConfig c = tiny_for_gguf(false);
  ParamSet params(c, DType::f32);
  init_parameters(params, 3, 0.5);
  int n = 0;
  auto write = [&](const GgufBuilder& b) { return write_file(dir, fmt::format("bad{}.gguf", n++), b.bytes()); };
  auto config_refused = [&](const GgufBuilder& b, const std::string& word) {
    const std::string path = write(b);
    check_refused([&] { llama_config_from_gguf(GgufReader(path)); }, path, word);
  };
  auto weights_refused = [&](const GgufBuilder& b, const std::string& word) {
    const std::string path = write(b);
    ParamSet p(c, DType::f32);
    check_refused([&] { load_gguf_weights(p, GgufReader(path)); }, path, word);
  };
  auto tensor = [](GgufBuilder& b, const std::string& name) -> TensorSpec& {
    for (TensorSpec& t : b.tensors)
      if (t.name == name) return t;
    FAIL("no tensor ", name);
    return b.tensors[0];
  };

  GgufBuilder b = test::model_gguf_builder(params);
  b.u32("llama.embedding_length", 30);  // a second copy
  config_refused(b, "duplicate metadata 'llama.embedding_length'");
  b = test::model_gguf_builder(params);
  b.kvs = b.kvs.substr(0, 0);
  b.n_kv = 0;
  b.str("general.architecture", "gpt2");
  config_refused(b, "general.architecture is 'gpt2', not 'llama'");
  // token_embd disagreeing with the vocabulary (the token list) or the hidden size.
  b = test::model_gguf_builder(params);
  tensor(b, "token_embd.weight").dims = {24, 60};
  tensor(b, "token_embd.weight").data.resize(24 * 60 * 4);
  config_refused(b, "token_embd.weight has shape [60, 24] (GGUF dims [24, 60]) but the metadata says vocab 61 x hidden 24");
  // A layer tensor whose shape is not the metadata's.
  b = test::model_gguf_builder(params);
  tensor(b, "blk.1.ffn_up.weight").dims = {24, 39};
  tensor(b, "blk.1.ffn_up.weight").data.resize(24 * 39 * 4);
  weights_refused(b, "tensor 'blk.1.ffn_up.weight' has shape [39, 24] (GGUF dims [24, 39]), but the metadata gives "
                     "model.layers.1.mlp.up_proj.weight [40, 24]");
  b = test::model_gguf_builder(params);
  b.tensors.erase(b.tensors.begin() + 3);
  weights_refused(b, "has no tensor 'blk.0.attn_k.weight'");
  b = test::model_gguf_builder(params);
  b.tensors.push_back({"blk.0.attn_q.bias", {24}, 0, std::string(96, '\0')});
  weights_refused(b, "tensor 'blk.0.attn_q.bias' has no place in a llama model");
  b = test::model_gguf_builder(params);
  b.str("llama.rope.scaling.type", "yarn");
  config_refused(b, "llama.rope.scaling.type 'yarn' is not supported");
  b = test::model_gguf_builder(params);
  b.u32("llama.attention.value_length", 4);
  config_refused(b, "llama.attention.value_length = 4 differs from the head dim 6");
  LlamaConfig odd_groups = c;
  odd_groups.num_key_value_heads = 3;  // 4 query heads
  b = test::model_gguf_builder(ParamSet(odd_groups, DType::f32));
  config_refused(b, "num_attention_heads 4 is not a multiple of num_key_value_heads 3");
}

TEST_CASE("gguf: RoPE scaling from the metadata (linear) and from rope_freqs.weight (llama3)") {
  test::TempDir dir("gguf-rope");
  LlamaConfig c = tiny_for_gguf(true);
  ParamSet params(c, DType::f32);
  GgufBuilder b = test::model_gguf_builder(params);
  b.str("llama.rope.scaling.type", "linear");
  b.f32("llama.rope.scaling.factor", 4.0f);
  LlamaConfig got = llama_config_from_gguf(GgufReader(write_file(dir, "linear.gguf", b.bytes())));
  CHECK(got.rope_scaling.type == RopeScaling::Type::linear);
  CHECK(got.rope_scaling.factor == 4.0);

  // Llama 3.1's scaling at its own head dim and theta, the divisors written as llama.cpp's converter
  // computes them (in f32, the frequencies from theta^(2i/D)).
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 64;
  c.rope_theta = 500000.0;
  ParamSet big(c, DType::f32);
  std::vector<float> divisors;
  for (int i = 0; i < 32; ++i) {
    const float freq = 1.0f / std::pow(500000.0f, static_cast<float>(2 * i) / 64.0f);
    const double wavelen = 2 * std::numbers::pi / freq;
    if (wavelen < 8192.0 / 4.0) divisors.push_back(1.0f);
    else if (wavelen > 8192.0 / 1.0) divisors.push_back(8.0f);
    else {
      const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      divisors.push_back(static_cast<float>(1.0 / ((1 - smooth) / 8.0 + smooth)));
    }
  }
  const auto blended = [](float d) { return d > 1.0f && d < 8.0f; };
  REQUIRE(std::count_if(divisors.begin(), divisors.end(), blended) >= 3);
  b = test::model_gguf_builder(big);
  b.tensors.push_back({"rope_freqs.weight", {32}, 0, bytes_of(divisors)});
  const std::string path = write_file(dir, "llama3.gguf", b.bytes());
  got = llama_config_from_gguf(GgufReader(path));
  CHECK(got.rope_scaling.type == RopeScaling::Type::llama3);
  CHECK(got.rope_scaling.factor == 8.0);
  CHECK(got.rope_scaling.low_freq_factor == 1.0);
  CHECK(got.rope_scaling.high_freq_factor == 4.0);
  CHECK(got.rope_scaling.original_max_position == 8192);
  ParamSet loaded(got, DType::f32);
  load_gguf_weights(loaded, GgufReader(path));  // rope_freqs.weight is consumed, not refused
  // A table no llama3 scaling produces.
  const size_t moved = static_cast<size_t>(std::find_if(divisors.begin(), divisors.end(), blended) - divisors.begin());
  divisors[moved] *= 1.001f;
  b.tensors.back().data = bytes_of(divisors);
  const std::string odd = write_file(dir, "odd.gguf", b.bytes());
  check_refused([&] { llama_config_from_gguf(GgufReader(odd)); }, odd, fmt::format("rope_freqs.weight[{}]", moved));
}

// One row per malformation of a valid Llama GGUF file: the metadata or tensor changed, and a fragment
// of the one line that must refuse it. Each row runs the load as `chunkwise` does: the config from
// the metadata, the parameters allocated from it, the weights read.
TEST_CASE("gguf: malformed Llama files are refused before allocating, naming the key or tensor, as a table") {
  test::TempDir dir("gguf-table");
  LlamaConfig c = tiny_for_gguf(false);
  c.hidden_size = 32;  // a whole Q8_0 block per embedding row
  ParamSet params(c, DType::f32);
  init_parameters(params, 5, 0.5);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // The float at `index` of tensor `name` set to `value`.
  const auto poke = [](GgufBuilder& b, const std::string& name, size_t index, float value) {
    for (TensorSpec& t : b.tensors)
      if (t.name == name) {
        REQUIRE((index + 1) * 4 <= t.data.size());
        std::memcpy(t.data.data() + index * 4, &value, 4);
        return;
      }
    FAIL("no tensor ", name);
  };
  // token_embd.weight as Q8_0 (scale 1/64, quants i - 16), row `bad_row`'s scale the f16 `bad_scale`.
  const auto q8_embedding = [&](GgufBuilder& b, int64_t bad_row, uint16_t bad_scale) {
    for (TensorSpec& t : b.tensors) {
      if (t.name != "token_embd.weight") continue;
      t.type = 8;
      t.data.clear();
      for (int64_t row = 0; row < c.vocab_size; ++row) {
        t.data += raw<uint16_t>(row == bad_row ? bad_scale : uint16_t{0x2400});
        for (int i = 0; i < 32; ++i) t.data += raw<int8_t>(static_cast<int8_t>(i - 16));
      }
    }
  };
  struct Row {
    const char* what;
    std::function<void(GgufBuilder&)> mutate;
    std::string fragment;
  };
  const std::vector<Row> table = {
      {"2^40 blocks (u64)", [](GgufBuilder& b) { b.replace("llama.block_count", 10, raw<uint64_t>(uint64_t{1} << 40)); },
       "'llama.block_count' is 1099511627776, above the limit 16384"},
      {"2^31 + 1 blocks (u32)", [](GgufBuilder& b) { b.replace("llama.block_count", 4, raw<uint32_t>((1u << 31) + 1)); },
       "'llama.block_count' is 2147483649, above the limit 16384"},
      {"10^6 blocks", [](GgufBuilder& b) { b.replace("llama.block_count", 4, raw<uint32_t>(1000000)); },
       "'llama.block_count' is 1000000, above the limit 16384"},
      {"3 blocks in a file of 2", [](GgufBuilder& b) { b.replace("llama.block_count", 4, raw<uint32_t>(3)); },
       "has no tensor 'blk.2.attn_norm.weight' (for model.layers.2.input_layernorm.weight), which its metadata implies"},
      {"FFN 2^40", [](GgufBuilder& b) { b.replace("llama.feed_forward_length", 10, raw<uint64_t>(uint64_t{1} << 40)); },
       "'llama.feed_forward_length' is 1099511627776, above the limit 1048576"},
      {"FFN wider than its tensors", [](GgufBuilder& b) { b.replace("llama.feed_forward_length", 4, raw<uint32_t>(1000)); },
       "tensor 'blk.0.ffn_gate.weight' has shape [40, 32] (GGUF dims [32, 40]), but the metadata gives "
       "model.layers.0.mlp.gate_proj.weight [1000, 32]"},
      {"an array of 2^40 strings", [](GgufBuilder& b) {
         b.kv("tokenizer.ggml.merges", 9, raw<uint32_t>(8) + raw<uint64_t>(uint64_t{1} << 40));
       }, "metadata 'tokenizer.ggml.merges': array of 1099511627776 string elements cannot fit"},
      {"a string of 2^40 bytes", [](GgufBuilder& b) { b.kv("general.name", 8, raw<uint64_t>(uint64_t{1} << 40)); },
       "metadata 'general.name' of 1099511627776 bytes"},
      {"2^20 heads", [](GgufBuilder& b) { b.replace("llama.attention.head_count", 4, raw<uint32_t>(1u << 20)); },
       "'llama.attention.head_count' is 1048576, above the limit 65536"},
      {"freq_base inf", [&](GgufBuilder& b) { b.replace("llama.rope.freq_base", 6, raw<float>(inf)); },
       "'llama.rope.freq_base' must be positive and finite, got inf"},
      {"freq_base NaN", [&](GgufBuilder& b) { b.replace("llama.rope.freq_base", 6, raw<float>(nan)); },
       "'llama.rope.freq_base' must be positive and finite, got nan"},
      {"epsilon inf", [&](GgufBuilder& b) { b.replace("llama.attention.layer_norm_rms_epsilon", 6, raw<float>(inf)); },
       "'llama.attention.layer_norm_rms_epsilon' must be positive and finite"},
      {"linear factor inf", [&](GgufBuilder& b) {
         b.str("llama.rope.scaling.type", "linear");
         b.f32("llama.rope.scaling.factor", inf);
       }, "factor must be finite, got inf"},
      {"rope_freqs all NaN", [&](GgufBuilder& b) {
         b.tensors.push_back({"rope_freqs.weight", {3}, 0, bytes_of(std::vector<float>(3, nan))});
       }, "rope_freqs.weight[0] = nan is not a positive finite divisor"},
      {"an F32 weight NaN", [&](GgufBuilder& b) { poke(b, "blk.1.ffn_down.weight", 17, nan); },
       "tensor 'blk.1.ffn_down.weight' holds nan at element 17 of 1280"},
      {"an F32 weight inf", [&](GgufBuilder& b) { poke(b, "output_norm.weight", 0, -inf); },
       "tensor 'output_norm.weight' holds -inf at element 0"},
      {"a Q8_0 scale NaN", [&](GgufBuilder& b) { q8_embedding(b, 7, 0x7e00); },
       "tensor 'token_embd.weight' holds nan at element 224"},
  };
  for (const Row& row : table) {
    CAPTURE(row.what);
    GgufBuilder b = test::model_gguf_builder(params);
    row.mutate(b);
    const std::string path = write_file(dir, "bad.gguf", b.bytes());
    const std::string message = test::message_of([&] {
      const GgufReader reader(path);
      ParamSet loaded(llama_config_from_gguf(reader), DType::f32);
      load_gguf_weights(loaded, reader);
    });
    INFO("message: ", message);
    CHECK(contains(message, path));
    CHECK(contains(message, row.fragment));
    CHECK(!contains(message, "unexpected error"));
    CHECK(!contains(message, "\n"));
  }
  // The Q8_0 file itself is valid: the table's refusals are its malformations alone.
  GgufBuilder b = test::model_gguf_builder(params);
  q8_embedding(b, -1, 0);
  const std::string path = write_file(dir, "q8.gguf", b.bytes());
  const GgufReader reader(path);
  ParamSet loaded(llama_config_from_gguf(reader), DType::f32);
  load_gguf_weights(loaded, reader);
  CHECK(loaded.get("model.embed_tokens.weight").ptr<float>()[33] == static_cast<float>((1 - 16) / 64.0));
}

TEST_CASE("gguf: CW_ALLOW_NONFINITE_WEIGHTS=1 loads a NaN weight for debugging") {
  test::TempDir dir("gguf-nonfinite");
  const LlamaConfig c = tiny_for_gguf(true);
  ParamSet params(c, DType::f32);
  init_parameters(params, 5, 0.5);
  params.get("model.norm.weight").ptr<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  const std::string path = write_file(dir, "nan.gguf", test::model_gguf_builder(params).bytes());
  ParamSet loaded(llama_config_from_gguf(GgufReader(path)), DType::f32);
  CHECK(contains(error_of([&] { load_gguf_weights(loaded, GgufReader(path)); }), "CW_ALLOW_NONFINITE_WEIGHTS=1"));
  {
    const test::EnvScope allow("CW_ALLOW_NONFINITE_WEIGHTS", "1");
    CHECK_NOTHROW(load_gguf_weights(loaded, GgufReader(path)));
  }
  CHECK(std::isnan(loaded.get("model.norm.weight").ptr<float>()[3]));
}

// ---- the real file ----

TEST_CASE("gguf: SmolLM2-135M-Instruct Q4_1 (when present in .models/): config, tensors, values as the gguf package reads them") {
  const std::string path = test::kSmolLm2Gguf.string();
  if (!fs::exists(path)) {
    MESSAGE("skipped: ", path, " is absent (tools/run fetch-model puts it there)");
    return;
  }
  std::ifstream ref_in(std::string(CW_SOURCE_ROOT) + "/tests/data/smollm2_reference.json");
  const nlohmann::json ref = nlohmann::json::parse(ref_in);
  const auto t0 = std::chrono::steady_clock::now();
  const GgufReader r(path);
  const auto t1 = std::chrono::steady_clock::now();
  CHECK(r.version() == 3);
  CHECK(r.file_size() == ref["file_size"].get<uint64_t>());
  CHECK(r.tensors().size() == ref["tensor_count"].get<size_t>());
  std::map<std::string, int> types;
  for (const GgufTensorInfo& t : r.tensors()) ++types[ggml_type_info(static_cast<uint32_t>(t.type))->name];
  CHECK(nlohmann::json(types) == ref["types"]);
  // The tokenizer's metadata, as the tokenizer reads it.
  CHECK(r.get_strings("tokenizer.ggml.tokens").size() == 49152);
  CHECK(r.get_strings("tokenizer.ggml.merges").size() == 48900);
  CHECK(r.get_ints("tokenizer.ggml.token_type").size() == 49152);
  CHECK(r.get_string("tokenizer.ggml.model") == "gpt2");

  const LlamaConfig c = llama_config_from_gguf(r);
  CHECK(c.num_hidden_layers == 30);
  CHECK(c.hidden_size == 576);
  CHECK(c.intermediate_size == 1536);
  CHECK(c.num_attention_heads == 9);
  CHECK(c.num_key_value_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.vocab_size == 49152);
  CHECK(c.tie_word_embeddings);
  CHECK(c.max_position_embeddings == 8192);
  CHECK(c.rope_theta == 100000.0);
  CHECK(c.rms_norm_eps == static_cast<double>(1e-5f));
  CHECK(c.rope_scaling.type == RopeScaling::Type::none);
  CHECK(c.bos_token_id == 1);
  CHECK(c.eos_token_ids == std::vector<int64_t>{2});
  CHECK(c.pad_token_id == 2);  // tokenizer.ggml.padding_token_id, as transformers' GGUF loader maps it

  for (const auto& [name, t] : ref["tensors"].items()) {
    CAPTURE(name);
    const GgufTensorInfo* info = r.find_tensor(name);
    REQUIRE(info);
    CHECK(ggml_type_info(static_cast<uint32_t>(info->type))->name == t["type"].get<std::string>());
    CHECK(std::vector<int64_t>(info->dims) == t["dims"].get<std::vector<int64_t>>());
    const std::vector<double> v = read_values(r, name, DType::f32);
    const int64_t cols = info->dims[0];
    for (const auto& e : t["values"]) {
      const int64_t row = e[0].get<int64_t>(), col = e[1].get<int64_t>();
      CAPTURE(row);
      CAPTURE(col);
      CHECK(static_cast<float>(v[static_cast<size_t>(row * cols + col)]) == e[2].get<float>());
    }
    double sum = 0;
    for (double x : v) sum += x;
    CHECK(sum == doctest::Approx(t["sum"].get<double>()).epsilon(1e-9));
  }

  ParamSet params(c, DType::f32);
  const auto t2 = std::chrono::steady_clock::now();
  load_gguf_weights(params, r);
  const auto t3 = std::chrono::steady_clock::now();
  // q_proj row r is GGUF row gguf_qk_row(r); the other weights keep their rows.
  const std::vector<double> q = read_values(r, "blk.0.attn_q.weight", DType::f32);
  const Tensor& wq = params.get("model.layers.0.self_attn.q_proj.weight");
  for (const int64_t row : {0, 1, 31, 32, 33, 63, 64, 100, 575}) {
    CAPTURE(row);
    const int64_t g = gguf_qk_row(row, 64);
    CHECK(wq.ptr<float>()[row * 576 + 5] == static_cast<float>(q[static_cast<size_t>(g * 576 + 5)]));
  }
  const double ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); }(t0, t1);
  const double load_ms = std::chrono::duration<double, std::milli>(t3 - t2).count();
  MESSAGE(fmt::format("SmolLM2 Q4_1 ({:.1f} MB): header {:.1f} ms, all weights dequantized into f32 {:.0f} ms",
                      static_cast<double>(r.file_size()) / 1e6, ms, load_ms));
}

}  // namespace
}  // namespace cw
