// chunkwise engine: every environment variable the project reads, in one registry, and the typed
// readers the code reads them through. Nothing else calls std::getenv (the tests read their own
// CW_TEST_* variables; tests/engine/test_env.cpp checks the sources for any other getenv).
//
// A variable is one Variable below: its name, the reader its kind calls for, what unset means and one
// line of meaning. The readers:
//   flag     env::flag(v)      "1" on, "0" off; unset or empty: the default; anything else is a clear
//                              error naming the variable
//   integer  env::integer(v)   a decimal in [v.lo, v.hi]; unset or empty: nullopt (its caller holds the
//                              default, which may depend on the machine); anything else a clear error
//   text     env::text(v)      the value; unset or empty: nullopt
//   launch   env::lookup(name) the value as it is, for parallel/'s Environment: the launcher's
//                              variables and the multi-process settings, parsed and checked in
//                              parallel/ (so that its tests pass fake environments); the name must be
//                              a launch (or test) variable of the registry
//   test     read by the tests themselves (test-only)
//   library  read by CUDA or NCCL, never by chunkwise: listed because messages and scripts name them
// `chunkwise options --env` prints the registry as tables (tables_markdown); docs/environment.md
// holds a copy, which tests/tools/test_options.cpp holds to it.
// A setting that tests or benchmarks force but no user needs has a setter and no variable
// (engine/engine.h); an A/B switch is deleted once its default has won.
//
// libcw_kernel_profile.so (tools/kernel_profile), loaded into processes that are not chunkwise,
// includes this header for its variables and env::value alone (both inline), without linking the
// engine.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace cw::env {

enum class Kind { flag, integer, text, launch, test, library };

struct Variable {
  const char* name;
  Kind kind;
  const char* by_default;  // what unset means, as the table prints it
  const char* meaning;     // one line
  int64_t lo = 0, hi = 0;  // integer: the values accepted
};

// ---- Read by chunkwise ----
inline constexpr Variable kDeterministic{
    "CW_DETERMINISTIC", Kind::flag, "0",
    "1: every GPU result bitwise reproducible, only deterministic kernels running (engine.h "
    "set_deterministic; train.deterministic sets it too)"};
inline constexpr Variable kAttention{
    "CW_ATTENTION", Kind::text, "auto",
    "the attention kernel family every call runs: auto, cpu, cudnn, flash, flash-wgmma, flash-mma or flash-simt "
    "(engine/ops/attention.h)"};
inline constexpr Variable kAttentionWorkspaceMib{
    "CW_ATTENTION_WORKSPACE_MIB", Kind::integer,
    "a quarter of the free device memory (at least 256 MiB), raised to what the run's plan counts",
    "N fixes the cuDNN attention backward's workspace budget at N MiB; a plan needing more runs on flash",
    0, INT64_MAX >> 20};
inline constexpr Variable kCudnnPlanThreads{
    "CW_CUDNN_PLAN_THREADS", Kind::integer, "half the host's cores, 1 to 8",
    "host threads building a SeCO sweep's cuDNN attention plans ahead of use, 0 to 256 (0: each plan built "
    "when first needed)",
    0, 256};
inline constexpr Variable kCudnnVerbose{
    "CW_CUDNN_VERBOSE", Kind::flag, "0",
    "1: each cuDNN attention plan described on stderr (its engine, workspace, build time and the candidates "
    "tried)"};
inline constexpr Variable kArenaLog{
    "CW_ARENA_LOG", Kind::flag, "0",
    "1: a line on stderr for each block an arena adds (and `chunkwise plan` for each block its replay adds), "
    "to set a run's arena against the planner's"};
inline constexpr Variable kAllowNonfiniteWeights{
    "CW_ALLOW_NONFINITE_WEIGHTS", Kind::flag, "0",
    "1: weights holding NaN or infinity load (for debugging a diverged checkpoint); 0: refused at load, naming the "
    "tensor and the file"};
inline constexpr Variable kDemoData{
    "CHUNKWISE_DEMO_DATA", Kind::text, ".cache/demo/jargon.bin",
    "the token file \"@demo\" in data.train stands for (the demo corpus `tools/run train` fetches)"};
inline constexpr Variable kBootstrapTimeout{
    "CHUNKWISE_BOOTSTRAP_TIMEOUT_S", Kind::launch, "300",
    "seconds the ranks of a multi-process run wait for each other at the start (parallel/bootstrap.h)"};
inline constexpr Variable kCommTimeout{
    "CHUNKWISE_COMM_TIMEOUT_S", Kind::launch, "600",
    "seconds a collective may wait before the watchdog ends the run with an error (parallel/watchdog.h)"};
inline constexpr Variable kMasterPort{
    "CHUNKWISE_MASTER_PORT", Kind::launch, "the launcher's port (MASTER_PORT and the rest below)",
    "the TCP port rank 0 listens on for the bootstrap, whatever the launcher (parallel/launch.h)"};

// ---- Read by the kernel profile (libcw_kernel_profile.so, tools/kernel_profile) ----
inline constexpr Variable kKernelProfile{
    "CW_KERNEL_PROFILE", Kind::text, "unset: the summary on stderr only",
    "PATH: also write the summary to PATH.txt and every kernel's time to PATH.csv"};
inline constexpr Variable kKernelProfileTop{
    "CW_KERNEL_PROFILE_TOP", Kind::integer, "40", "the summary's kernel lines", 0, 1000000};
inline constexpr Variable kKernelProfileApi{
    "CW_KERNEL_PROFILE_API", Kind::flag, "0",
    "1: also record the host's CUDA runtime and driver calls, and where the GPU's queue ran dry"};

// One table of the registry: its title and its variables, in order.
struct Table {
  const char* title;
  std::vector<Variable> variables;
};
// Every variable, table by table: chunkwise's own, the kernel profile's, the launchers' (torchrun,
// Open MPI, SLURM: parallel/launch.h), the tests', the libraries'.
const std::vector<Table>& tables();
// The tables as markdown, each under its title: `chunkwise options --env`, docs/environment.md.
std::string tables_markdown();
// The registered variable named `name`, or nullptr.
const Variable* find(const std::string& name);

// The variable's value; nullptr where it is unset or empty. The typed readers read through it; with
// lookup's, the project's only std::getenv.
inline const char* value(const Variable& v) {
  const char* e = std::getenv(v.name);
  return e != nullptr && *e != '\0' ? e : nullptr;
}

bool flag(const Variable& v);                   // Kind::flag
std::optional<int64_t> integer(const Variable& v);  // Kind::integer
std::optional<std::string> text(const Variable& v);  // Kind::text
// Kind::launch (or test): the value of registered variable `name` as it is (empty included); nullopt
// where unset. Any other name is an error naming it.
std::optional<std::string> lookup(const std::string& name);

}  // namespace cw::env

namespace cw {

// A process-wide on/off setting with a variable (a flag of the registry): the value set(), else the
// variable's, read at the first get(). engine/engine.h's set_X / X pairs hold one each.
class EnvFlag {
 public:
  explicit EnvFlag(const env::Variable& variable) : variable_(variable) {}
  EnvFlag(const EnvFlag&) = delete;
  EnvFlag& operator=(const EnvFlag&) = delete;
  bool get();
  void set(bool on) { value_.store(on ? 1 : 0); }
  void forget() { value_.store(-1); }  // the next get() reads the variable again

 private:
  const env::Variable& variable_;
  std::atomic<int> value_{-1};  // -1: not yet set or read
};

}  // namespace cw
