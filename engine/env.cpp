// The registry's tables and its readers (engine/env.h).
#include "engine/env.h"

#include "engine/error.h"

#include <cctype>
#include <cstring>

namespace cw::env {

namespace {

Variable launch(const char* name, const char* by_default, const char* meaning) {
  return {name, Kind::launch, by_default, meaning};
}
Variable test(const char* name, const char* by_default, const char* meaning) {
  return {name, Kind::test, by_default, meaning};
}
Variable library(const char* name, const char* by_default, const char* meaning) {
  return {name, Kind::library, by_default, meaning};
}

std::vector<Table> make_tables() {
  return {
      {"Read by chunkwise",
       {kDeterministic, kAttention, kAttentionWorkspaceMib, kCudnnPlanThreads, kCudnnVerbose, kArenaLog, kAllowNonfiniteWeights, kDemoData,
        kBootstrapTimeout, kCommTimeout, kMasterPort}},
      {"Read by the kernel profile (libcw_kernel_profile.so, loaded with CUDA_INJECTION64_PATH)",
       {kKernelProfile, kKernelProfileTop, kKernelProfileApi}},
      {"Set by a launcher (parallel/launch.h: the first launcher whose rank and world size are set wins)",
       {launch("RANK", "0 (one process)", "torchrun: this process's rank"),
        launch("WORLD_SIZE", "1", "torchrun: the count of processes"),
        launch("LOCAL_RANK", "RANK", "torchrun: this rank's index on its machine (its GPU)"),
        launch("LOCAL_WORLD_SIZE", "unknown", "torchrun: the ranks on this machine"),
        launch("MASTER_ADDR", "127.0.0.1 where every rank is on this machine",
               "the host of rank 0, for every launcher"),
        launch("MASTER_PORT", "29500", "the port of rank 0 (plus one when torchrun's agent holds it)"),
        launch("TORCHELASTIC_USE_AGENT_STORE", "unset", "torchrun: True when its agent serves a store on MASTER_PORT"),
        launch("OMPI_COMM_WORLD_RANK", "unset", "Open MPI: this process's rank"),
        launch("OMPI_COMM_WORLD_SIZE", "unset", "Open MPI: the count of processes"),
        launch("OMPI_COMM_WORLD_LOCAL_RANK", "the rank", "Open MPI: this rank's index on its machine"),
        launch("OMPI_COMM_WORLD_LOCAL_SIZE", "unknown", "Open MPI: the ranks on this machine"),
        launch("SLURM_PROCID", "unset", "SLURM: this task's rank"),
        launch("SLURM_NTASKS", "unset", "SLURM: the count of tasks"),
        launch("SLURM_LOCALID", "the rank", "SLURM: this task's index on its node"),
        launch("SLURM_NODEID", "unset", "SLURM: this node's index in the step, for the tasks-per-node lists"),
        launch("SLURM_STEP_TASKS_PER_NODE", "unset", "SLURM: tasks per node of the step, e.g. 2(x3),1"),
        launch("SLURM_TASKS_PER_NODE", "unset", "SLURM: tasks per node of the job, where the step's is unset"),
        launch("SLURM_NTASKS_PER_NODE", "unset", "SLURM: tasks per node, where neither list is set"),
        launch("SLURM_STEP_NODELIST", "unset", "SLURM: the step's hosts; the first is rank 0's"),
        launch("SLURM_JOB_NODELIST", "unset", "SLURM: the job's hosts, where the step's are unset"),
        launch("SLURM_NODELIST", "unset", "SLURM: the hosts, where neither list above is set"),
        launch("SLURM_JOB_ID", "unset", "SLURM: the job, whose number picks the port 20000 + id mod 10000")}},
      {"Test-only (read by the tests themselves: tests/README.md)",
       {test("CW_TEST_SEED", "a fresh seed", "the op table's seed (tests/engine/test_backend_ops.cpp)"),
        test("CW_TEST_OPS", "every row",
             "the op table's rows whose name contains the text (or any of several texts separated by bars)"),
        test("CW_TEST_ROW", "every row", "the op table's row of exactly this name"),
        test("CW_TEST_DTYPE", "every dtype", "the op table's dtype: f64, f32 or bf16"),
        test("CW_TEST_VARIANT", "every variant", "the op table's GPU variant, e.g. cudnn deterministic"),
        test("CW_TEST_MAX_ELEMENTS", "no limit", "the op table's rows whose largest operand holds at most N elements"),
        test("CW_TEST_MIN_ELEMENTS", "no limit", "the op table's rows whose largest operand holds more than N elements"),
        test("CW_TEST_TRACE", "0", "1: each op table run's rerun line printed as it starts"),
        test("CW_TEST_POISON_SCRATCH", "0", "1: a GPU run's scratch arena and cuBLASLt's workspace filled with NaN bytes before each call"),
        test("CW_TEST_LAUNCH_VARIABLE", "unset", "set and read by the tests of parallel/'s process environment"),
        test("CW_TEST_ENV_FLAG", "unset", "set and read by the tests of engine/env.h's readers"),
        test("CHUNKWISE_EXE", "the build's tools/chunkwise", "the chunkwise binary the CLI tests run")}},
      {"Read by CUDA and NCCL, not by chunkwise (named in its messages and scripts)",
       {library("CUDA_INJECTION64_PATH", "unset", "CUDA loads this library into the process: the kernel profile"),
        library("CUDA_VISIBLE_DEVICES", "every GPU", "the GPUs CUDA shows the process"),
        library("NCCL_DEBUG", "unset", "WARN: NCCL says why a collective or a communicator failed"),
        library("NCCL_NVLS_ENABLE", "1 where the GPUs have NVLink SHARP",
                "0: no NVLink multicast (tools/gpu-check sets it on machines that do not allow it)")}},
  };
}

[[noreturn]] void wrong_kind(const Variable& v, const char* reader) {
  fail(CW_FORMAT("engine/env.h: {} is read with env::{}, which is not its kind's reader", v.name, reader),
       "read each variable with the reader its Kind names");
}

}  // namespace

const std::vector<Table>& tables() {
  static const std::vector<Table> t = make_tables();
  return t;
}

std::string tables_markdown() {
  std::string s;
  for (const Table& t : tables()) {
    s += CW_FORMAT("{}### {}\n\n| variable | default | meaning |\n|---|---|---|\n", s.empty() ? "" : "\n", t.title);
    for (const Variable& v : t.variables) s += CW_FORMAT("| `{}` | {} | {} |\n", v.name, v.by_default, v.meaning);
  }
  return s;
}

const Variable* find(const std::string& name) {
  for (const Table& t : tables())
    for (const Variable& v : t.variables)
      if (name == v.name) return &v;
  return nullptr;
}

bool flag(const Variable& v) {
  if (v.kind != Kind::flag) wrong_kind(v, "flag");
  const char* e = value(v);
  if (e == nullptr) return std::strcmp(v.by_default, "1") == 0;
  if (std::strcmp(e, "0") == 0) return false;
  if (std::strcmp(e, "1") == 0) return true;
  fail(CW_FORMAT("environment variable {}='{}' is not 0 or 1", v.name, e),
       CW_FORMAT("unset it for the default ({}), or see `chunkwise options --env`: {}", v.by_default, v.meaning));
}

std::optional<int64_t> integer(const Variable& v) {
  if (v.kind != Kind::integer) wrong_kind(v, "integer");
  const char* e = value(v);
  if (e == nullptr) return std::nullopt;
  bool digits = std::strlen(e) <= 18;
  for (const char* c = e; *c != '\0'; ++c) digits = digits && std::isdigit(static_cast<unsigned char>(*c));
  const int64_t n = digits ? std::strtoll(e, nullptr, 10) : -1;
  if (!digits || n < v.lo || n > v.hi)
    fail(CW_FORMAT("environment variable {}='{}' is not an integer from {} to {}", v.name, e, v.lo, v.hi),
         CW_FORMAT("unset it for the default ({}); it sets {}", v.by_default, v.meaning));
  return n;
}

std::optional<std::string> text(const Variable& v) {
  if (v.kind != Kind::text) wrong_kind(v, "text");
  const char* e = value(v);
  if (e == nullptr) return std::nullopt;
  return std::string(e);
}

std::optional<std::string> lookup(const std::string& name) {
  const Variable* v = find(name);
  if (v == nullptr || (v->kind != Kind::launch && v->kind != Kind::test))
    fail(CW_FORMAT("engine/env.h: {} is not a launch variable of the registry", name),
         "add it to engine/env.cpp's tables, with its default and meaning");
  const char* e = std::getenv(v->name);
  if (e == nullptr) return std::nullopt;
  return std::string(e);
}

}  // namespace cw::env

namespace cw {

bool EnvFlag::get() {
  int v = value_.load();
  if (v < 0) {
    v = env::flag(variable_) ? 1 : 0;
    value_.store(v);
  }
  return v == 1;
}

}  // namespace cw
