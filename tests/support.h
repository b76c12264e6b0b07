// Shared helpers for the tests: tolerances, comparisons that report the worst element, the message
// of an expected error, files (read whole; the real model's GGUF) and temporary directories.
#pragma once

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/memory.h"
#include "engine/tensor.h"
#include "model/config.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

namespace cw::test {

using cw::SettingScope;  // engine/engine.h


// Central finite differences with a fourth-order stencil in f64: the truncation error is O(h^4)
// and the rounding error O(eps / h), both far below this bound at h = 1e-3.
constexpr double kFiniteDifferenceTol = 1e-7;
// Two exact computations of the same f64 quantity in different association orders.
constexpr double kSameMathF64Tol = 1e-12;

// The `chunkwise` binary the CLI tests run: the build's own, or CHUNKWISE_EXE's where the suite runs
// away from its build directory (tools/gpu-check with binaries built on another machine).
inline std::string chunkwise_exe() {
  const char* e = std::getenv("CHUNKWISE_EXE");
  return e != nullptr && *e != '\0' ? std::string(e) : std::string(CW_CHUNKWISE_EXE);
}

// Runs the chunkwise binary with `args`; returns its exit status and fills `output` with its stdout
// and stderr together (the CLI tests' one way of running it).
inline int run_cli(const std::string& args, std::string& output) {
  const std::string cmd = chunkwise_exe() + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  output.clear();
  while (size_t n = fread(buf, 1, sizeof buf, p)) output.append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

struct Worst {
  double rel = 0;      // ||a - b|| / ||b||
  double max_abs = 0;  // worst |a_i - b_i|
  int64_t index = -1;
  double a = 0, b = 0;
  std::string str() const {
    return fmt::format("rel_err={:.3e} worst element #{}: {:.17g} vs {:.17g}", rel, index, a, b);
  }
};

// Relative L2 error of a against b (both any float dtype on the CPU), with the worst element.
inline Worst compare(const Tensor& a, const Tensor& b) {
  check_same_shape(a, b, "compared", "reference");
  OwnedTensor a64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>(a.shape.begin(), a.shape.begin() + a.ndim));
  OwnedTensor b64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>(b.shape.begin(), b.shape.begin() + b.ndim));
  copy_convert(a64, a);
  copy_convert(b64, b);
  Worst w;
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a64.tensor.ptr<double>()[i], y = b64.tensor.ptr<double>()[i];
    num += (x - y) * (x - y);
    den += y * y;
    if (std::abs(x - y) > w.max_abs || w.index < 0) {
      w.max_abs = std::abs(x - y);
      w.index = i;
      w.a = x;
      w.b = y;
    }
  }
  w.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return w;
}

// The last `max_rel_err=` figure a gradcheck printed (a failed check when there is none).
inline double max_rel_err(const std::string& out) {
  const auto pos = out.rfind("max_rel_err=");
  REQUIRE(pos != std::string::npos);
  return std::stod(out.substr(pos + 12));
}

// Whether `text` contains `part`.
inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// What `chunkwise` would print for the exception `f` throws, as main's catch clauses print it: a
// cw::Error's message, "unexpected error: ..." for any other exception (a bug: the tables of
// malformed files check that none is), "" when it throws none.
template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("unexpected error: ") + e.what();
  }
  return "";
}

// The message of the cw::Error that `f` throws; a failed check, and "", when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  FAIL_CHECK("expected a cw::Error");
  return "";
}

// The whole file, its bytes as they are; "" where it cannot be read (the comparison that follows
// fails then).
inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The `small` preset cut to 2 blocks of width 32 (4 heads of 8 dims, 2 K/V heads, MLP 48): a model
// the command-line tests train, or have refused, in seconds.
inline LlamaConfig small_test_config() {
  LlamaConfig c = LlamaConfig::preset("small");
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  return c;
}

// The real SmolLM2-135M-Instruct, Q4_1, where `tools/run fetch-model` puts it; the tests that read it
// say they skipped where it is absent.
inline const std::filesystem::path kSmolLm2Gguf =
    std::filesystem::path(CW_SOURCE_ROOT) / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf";

// A fresh empty directory under the system temp dir, removed on destruction.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag);
  ~TempDir();
  std::string file(const std::string& name) const { return (path / name).string(); }
};

inline TempDir::TempDir(const std::string& tag) {
  static int counter = 0;
  path = std::filesystem::temp_directory_path() /
         fmt::format("chunkwise-test-{}-{}-{}", tag, static_cast<long>(::getpid()), counter++);
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
}
inline TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

// Sets (or with nullptr unsets) an environment variable for one scope, restoring it after (the
// registry's variables are read when used, engine/env.h).
class EnvScope {
 public:
  EnvScope(const char* name, const char* value) : name_(name) {
    if (const char* e = std::getenv(name)) saved_ = e;
    set(value);
  }
  ~EnvScope() { set(saved_ ? saved_->c_str() : nullptr); }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;
  void set(const char* value) {
    if (value != nullptr)
      ::setenv(name_, value, 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

}  // namespace cw::test
