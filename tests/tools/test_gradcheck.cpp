// `chunkwise gradcheck`, in process and as the built binary: the table, the last line, the exit code,
// the --tokens input and the --save-grads output.
#include "model/safetensors.h"
#include "tests/support.h"
#include "tools/gradcheck.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

using namespace cw;

namespace {
double max_rel_err(const std::string& out) {
  const auto pos = out.rfind("max_rel_err=");
  REQUIRE(pos != std::string::npos);
  return std::stod(out.substr(pos + 12));
}

// Runs the chunkwise binary; returns the exit status and fills the combined output.
int run_cli(const std::string& args, std::string& output) {
  const std::string cmd = std::string(CW_CHUNKWISE_EXE) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  output.clear();
  while (size_t n = fread(buf, 1, sizeof buf, p)) output.append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
}  // namespace

TEST_CASE("gradcheck seco against full: the issue's command passes at 1e-12") {
  GradcheckOptions o;
  o.model = "tiny";
  o.seq = 64;
  o.schedule.name = "seco";
  o.schedule.chunk = 7;
  o.schedule.bwd_chunk = 5;
  std::ostringstream out;
  CHECK(run_gradcheck(o, out) == 0);
  INFO(out.str());
  CHECK(max_rel_err(out.str()) <= 1e-12);
  CHECK(out.str().find("model.layers.1.mlp.down_proj.weight") != std::string::npos);
  CHECK(out.str().find("\nloss ") != std::string::npos);
}

TEST_CASE("gradcheck fails (exit 1) when the tolerance is not met") {
  GradcheckOptions o;
  o.schedule.name = "spaco";
  o.schedule.chunk = 4;
  o.schedule.keep = 1;  // an estimator: far from full
  std::ostringstream out;
  CHECK(run_gradcheck(o, out) == 1);
  CHECK(out.str().find("FAIL") != std::string::npos);
}

TEST_CASE("gradcheck --tokens and --save-grads") {
  test::TempDir dir("gradcheck");
  const std::string tokens = dir.file("batch.u32");
  {
    std::ofstream f(tokens, std::ios::binary);
    for (uint32_t i = 0; i < 2 * 12; ++i) {
      const uint32_t id = (i * 7) % 61;
      const unsigned char b[4] = {static_cast<unsigned char>(id), static_cast<unsigned char>(id >> 8), 0, 0};
      f.write(reinterpret_cast<const char*>(b), 4);
    }
  }
  GradcheckOptions o;
  o.seq = 12;
  o.batch = 2;
  o.schedule.name = "seco";
  o.schedule.chunk = 5;
  o.tokens_file = tokens;
  o.save_grads = dir.file("grads.safetensors");
  std::ostringstream out;
  CHECK(run_gradcheck(o, out) == 0);
  SafetensorsReader r(o.save_grads);
  REQUIRE(r.find("loss") != nullptr);
  REQUIRE(r.find("model.embed_tokens.weight") != nullptr);
  CHECK(r.find("lm_head.weight")->dtype == "F64");
  OwnedTensor loss(DType::f64, {1});
  r.read_into("loss", loss);
  CHECK(loss.tensor.ptr<double>()[0] > 3.0);  // about ln 61 for a random init
  o.batch = 3;  // the file holds 2 x 12 ids
  CHECK_THROWS_AS(run_gradcheck(o, out), Error);
}

TEST_CASE("the chunkwise binary: gradcheck output and clear errors") {
  std::string out;
  CHECK(run_cli("gradcheck --model tiny --seq 16 --dtype f64 --schedule full --directions 1", out) == 0);
  INFO(out);
  CHECK(max_rel_err(out) <= test::kFiniteDifferenceTol);
  CHECK(run_cli("gradcheck --model no-such-model", out) == 2);
  CHECK(out.find("unknown model preset 'no-such-model'") != std::string::npos);
  CHECK(out.find('\n') == out.size() - 1);  // one line
  CHECK(run_cli("gradcheck --seq", out) != 0);
  CHECK(run_cli("devices", out) == 0);
  CHECK(out.find("build: cuda=") != std::string::npos);
}

TEST_CASE("gradcheck seco --against fd: the chunked gradient against finite differences") {
  GradcheckOptions o;
  o.seq = 20;
  o.schedule.name = "seco";
  o.schedule.chunk = 6;
  o.schedule.bwd_chunk = 4;
  o.against = "fd";
  o.directions = 1;
  std::ostringstream out;
  CHECK(run_gradcheck(o, out) == 0);
  INFO(out.str());
  CHECK(max_rel_err(out.str()) <= test::kFiniteDifferenceTol);
}
