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
using test::run_cli;

using test::max_rel_err;

TEST_CASE("gradcheck seco against full: the documented command (tiny, chunk 7, backward chunk 5) passes at 1e-12") {
  GradcheckOptions o;
  o.model = "tiny";
  o.seq = 64;
  o.schedule.kind = ScheduleKind::seco;
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
  o.schedule.kind = ScheduleKind::spaco;
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
  o.schedule.kind = ScheduleKind::seco;
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
  o.schedule.kind = ScheduleKind::seco;
  o.schedule.chunk = 6;
  o.schedule.bwd_chunk = 4;
  o.against = "fd";
  o.directions = 1;
  std::ostringstream out;
  CHECK(run_gradcheck(o, out) == 0);
  INFO(out.str());
  CHECK(max_rel_err(out.str()) <= test::kFiniteDifferenceTol);
}

// ---- LoRA: the adapters' gradients, the base frozen ----
namespace {
GradcheckOptions lora_check(const char* schedule, const char* targets) {
  GradcheckOptions o;
  o.seq = 14;
  o.batch = 2;
  o.schedule.kind = parse_schedule_kind(schedule);
  o.lora.rank = 3;
  o.lora.alpha = 6.0;
  o.lora.targets = targets;
  o.lora.seed = 4;
  return o;
}
}  // namespace

TEST_CASE("gradcheck lora: the adapters' gradients against finite differences in f64 (with dropout)") {
  // all-linear keeps the MLP's inputs; q_proj,v_proj freezes the MLP, which then keeps gate and up only.
  for (const char* targets : {"all-linear", "q_proj,v_proj"})
  for (const double dropout : {0.0, 0.15}) {
    CAPTURE(std::string(targets));
    CAPTURE(dropout);
    GradcheckOptions o = lora_check("full", targets);
    o.lora.dropout = dropout;
    o.directions = 2;
    std::ostringstream out;
    CHECK(run_gradcheck(o, out) == 0);
    INFO(out.str());
    CHECK(max_rel_err(out.str()) <= test::kFiniteDifferenceTol);
    CHECK(out.str().find("lora: rank 3, alpha 6") != std::string::npos);
    if (std::string(targets) == "all-linear")
      CHECK(out.str().find("layers.1.mlp.down_proj.lora_B.weight") != std::string::npos);
    CHECK(out.str().find("model.embed_tokens.weight") == std::string::npos);  // the base is not checked: frozen
  }
}

TEST_CASE("gradcheck lora: seco, spaco with every chunk and checkpointed against full at 1e-12 (f64)") {
  for (const char* targets : {"q_proj,v_proj", "all-linear"}) {
    GradcheckOptions seco = lora_check("seco", targets), spaco = lora_check("spaco", targets),
                     ckpt = lora_check("checkpointed", targets);
    seco.schedule.chunk = 5;
    seco.schedule.bwd_chunk = 4;
    seco.lora.dropout = 0.1;
    spaco.schedule.chunk = 4;  // keep 0: every chunk, which must be seco
    ckpt.schedule.mlp_shards = 2;
    for (const GradcheckOptions& o : {seco, spaco, ckpt}) {
      CAPTURE(std::string(targets));
      CAPTURE(schedule_name(o.schedule.kind));
      std::ostringstream out;
      CHECK(run_gradcheck(o, out) == 0);
      INFO(out.str());
      CHECK(max_rel_err(out.str()) <= test::kSameMathF64Tol);
    }
  }
  // Data parallelism trains the adapters too: ranks against one process, ZeRO 1 against zero 0.
  GradcheckOptions dp = lora_check("seco", "q_proj,v_proj");
  dp.schedule.chunk = 5;
  dp.batch = 2;
  dp.parallel.dp = 2;
  dp.parallel.zero = 1;
  std::ostringstream out;
  CHECK(run_gradcheck(dp, out) == 0);
  INFO(out.str());
  CHECK(out.str().find("zero 1 against zero 0 after 3 steps: parameters bitwise identical") != std::string::npos);
}

TEST_CASE("gradcheck --dp 2 --tp 2 --gather-dir: the ranks' results through files, as a launched run's, give the same check") {
  // A launched world (one process per GPU) hands its ranks' results to rank 0 through --gather-dir;
  // thread ranks given the option take the same path, so the files' round trip is checked here.
  GradcheckOptions o;
  o.model = "tiny";
  o.seq = 12;
  o.batch = 2;
  o.schedule.kind = ScheduleKind::seco;
  o.schedule.chunk = 5;
  o.parallel.dp = 2;
  o.parallel.tp = 2;
  o.parallel.zero = 2;
  o.optimizer_steps = 2;
  std::ostringstream direct, gathered;
  CHECK(run_gradcheck(o, direct) == 0);
  const test::TempDir dir("gradcheck-gather");
  o.gather_dir = dir.path.string();
  CHECK(run_gradcheck(o, gathered) == 0);
  INFO(gathered.str());
  CHECK(gathered.str() == direct.str());  // every figure, to the last digit
  CHECK(std::filesystem::exists(dir.path / "zero2" / "rank-3.safetensors"));
  CHECK(std::filesystem::exists(dir.path / "zero0" / "rank-0.safetensors"));
}

TEST_CASE("the chunkwise binary: gradcheck with LoRA flags, and their errors in one line") {
  std::string out;
  CHECK(run_cli("gradcheck --schedule seco --lora-rank 4 --lora-targets q_proj,v_proj --against full", out) == 0);
  INFO(out);
  CHECK(max_rel_err(out) <= test::kSameMathF64Tol);
  CHECK(run_cli("gradcheck --schedule seco --chunk 5 --seq 16 --lora-rank 2 --lora-targets all-linear --lora-dropout 0.1",
                out) == 0);
  CHECK(max_rel_err(out) <= test::kSameMathF64Tol);
  CHECK(run_cli("gradcheck --lora-rank 4 --lora-targets q_proj,qkv", out) == 2);
  CHECK(out.find("lora.targets: unknown LoRA target 'qkv'") != std::string::npos);
  CHECK(out.find('\n') == out.size() - 1);
  CHECK(run_cli("gradcheck --lora-targets q_proj", out) == 2);
  CHECK(out.find("lora.rank is 0") != std::string::npos);
  CHECK(run_cli("gradcheck --lora-rank -1", out) == 2);
  CHECK(out.find("lora.rank must be in [0, 1048576]") != std::string::npos);
  // With tensor parallelism the adapters are sharded with their linears, and a row-parallel linear's
  // dropout mask is the whole input's: exact against one process.
  CHECK(run_cli("gradcheck --lora-rank 2 --lora-targets all-linear --tp 2 --sequence-parallel --model tiny-tp --seq 16 "
                "--batch 2 --schedule seco --chunk 5",
                out) == 0);
  CHECK(max_rel_err(out) <= test::kSameMathF64Tol);
  CHECK(run_cli("gradcheck --lora-rank 2 --lora-targets all-linear --lora-dropout 0.1 --tp 4 --model tiny-tp --seq 16 "
                "--batch 2 --mlp-shards 2",
                out) == 0);
  CHECK(max_rel_err(out) <= test::kSameMathF64Tol);
  // Data-parallel ranks key their masks by the global batch's sequences: one process's masks.
  CHECK(run_cli("gradcheck --lora-rank 2 --lora-dropout 0.2 --dp 2 --tp 2 --zero 1 --model tiny-tp --seq 16 --batch 4 "
                "--schedule spaco --chunk 4 --keep 2",
                out) == 0);
  CHECK(max_rel_err(out) <= test::kSameMathF64Tol);
}
