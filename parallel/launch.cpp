// Reading a launcher's variables (see launch.h for which, in what order, and the defaults).
#include "parallel/launch.h"

#include "engine/env.h"
#include "engine/error.h"

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <limits>

namespace cw {

Environment process_environment() { return cw::env::lookup; }

Environment environment_from(std::map<std::string, std::string> variables) {
  return [variables = std::move(variables)](const std::string& name) -> std::optional<std::string> {
    const auto it = variables.find(name);
    if (it == variables.end()) return std::nullopt;
    return it->second;
  };
}

const char* launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::single: return "single";
    case Launcher::torchrun: return "torchrun";
    case Launcher::open_mpi: return "open_mpi";
    case Launcher::slurm: return "slurm";
  }
  return "?";
}

std::string host_port(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return CW_FORMAT("[{}]:{}", host, port);  // IPv6 literal
  return CW_FORMAT("{}:{}", host, port);
}

std::string LaunchInfo::describe() const {
  const std::string local = local_world_size ? CW_FORMAT("local {} of {}", local_rank, *local_world_size)
                                             : CW_FORMAT("local {}", local_rank);
  return CW_FORMAT("rank {} of {} ({}) via {}, bootstrap at {} ({})", rank, world_size, local, launcher_name(launcher),
                   host_port(master_addr, master_port), address_from);
}

namespace {

constexpr const char* kLauncherHint = "the launcher (torchrun, mpirun, srun) sets it; unset it to run a single process";

// A set, non-empty variable's value (an empty one counts as unset).
std::optional<std::string> lookup(const Environment& env, const std::string& name) {
  std::optional<std::string> v = env(name);
  if (v && v->empty()) return std::nullopt;
  return v;
}

// A decimal integer in [lo, hi]: digits only (no sign, no spaces), or a clear error naming the variable.
int64_t parse_integer(const std::string& name, const std::string& value, int64_t lo, int64_t hi, const char* hint) {
  bool digits = !value.empty() && value.size() <= 18;
  for (const char c : value) digits = digits && std::isdigit(static_cast<unsigned char>(c));
  const int64_t v = digits ? std::strtoll(value.c_str(), nullptr, 10) : -1;
  if (!digits || v < lo || v > hi)
    fail(CW_FORMAT("environment variable {}='{}' is not an integer in [{}, {}]", name, value, lo, hi), hint);
  return v;
}

std::optional<int> read_int(const Environment& env, const std::string& name, int lo, int hi,
                            const char* hint = kLauncherHint) {
  const std::optional<std::string> v = lookup(env, name);
  if (!v) return std::nullopt;
  return static_cast<int>(parse_integer(name, *v, lo, hi, hint));
}

constexpr int kMaxInt = std::numeric_limits<int>::max();

// The variable names one launcher uses for the four numbers.
struct RankVariables {
  Launcher launcher;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;  // nullptr: the launcher's local world size is found another way
};

// Fills rank, world size and local rank from `names`; both of rank and world size or neither.
// Returns false when neither is set (not this launcher).
bool read_ranks(const Environment& env, const RankVariables& names, LaunchInfo& info) {
  const bool has_rank = lookup(env, names.rank).has_value();
  const bool has_size = lookup(env, names.world_size).has_value();
  if (!has_rank && !has_size) return false;
  if (!has_rank || !has_size)
    fail(CW_FORMAT("environment variable {} is set but {} is not", has_rank ? names.rank : names.world_size,
                   has_rank ? names.world_size : names.rank),
         CW_FORMAT("a {} launch sets both; set both, or neither for a single process", launcher_name(names.launcher)));
  info.launcher = names.launcher;
  info.world_size = *read_int(env, names.world_size, 1, kMaxInt);
  info.rank = *read_int(env, names.rank, 0, kMaxInt);
  if (info.rank >= info.world_size)
    fail(CW_FORMAT("environment variable {}={} is not below {}={}", names.rank, info.rank, names.world_size,
                   info.world_size),
         "ranks are 0 .. world size - 1; check how the job was launched");
  if (names.local_world_size) info.local_world_size = read_int(env, names.local_world_size, 1, kMaxInt);
  // Unset local rank: as if every rank were on this machine (a hand-made launch on one machine).
  info.local_rank = read_int(env, names.local_rank, 0, kMaxInt).value_or(info.rank);
  return true;
}

void check_local(const LaunchInfo& info, const char* local_rank_name, const char* local_size_name) {
  if (!info.local_world_size) {
    if (info.local_rank >= info.world_size)
      fail(CW_FORMAT("environment variable {}={} is not below the world size {}", local_rank_name, info.local_rank,
                     info.world_size),
           kLauncherHint);
    return;
  }
  if (*info.local_world_size > info.world_size)
    fail(CW_FORMAT("local world size {} (from {}) exceeds the world size {}", *info.local_world_size, local_size_name,
                   info.world_size),
         kLauncherHint);
  if (info.local_rank >= *info.local_world_size)
    fail(CW_FORMAT("environment variable {}={} is not below the local world size {} (from {})", local_rank_name,
                   info.local_rank, *info.local_world_size, local_size_name),
         kLauncherHint);
}

// SLURM's ranks on this node: the step's tasks-per-node list at this node's index, else
// SLURM_NTASKS_PER_NODE.
void read_slurm_local_world(const Environment& env, LaunchInfo& info, std::string& from) {
  const std::optional<int> node = read_int(env, "SLURM_NODEID", 0, kMaxInt);
  for (const char* list_name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    const std::optional<std::string> list = lookup(env, list_name);
    if (list && node) {
      info.local_world_size = slurm_tasks_on_node(*list, *node, list_name);
      from = CW_FORMAT("{} at SLURM_NODEID={}", list_name, *node);
      return;
    }
  }
  if (const std::optional<std::string> v = lookup(env, "SLURM_NTASKS_PER_NODE")) {
    // Set by --ntasks-per-node=N; a job-level value may read "4(x2)": every node the same count.
    info.local_world_size = slurm_tasks_on_node(*v, 0, "SLURM_NTASKS_PER_NODE");
    from = "SLURM_NTASKS_PER_NODE";
  }
}

void read_address(const Environment& env, LaunchInfo& info) {
  std::string addr_from, port_from;
  const bool one_machine = info.world_size == 1 || (info.local_world_size && *info.local_world_size == info.world_size);
  if (const std::optional<std::string> addr = lookup(env, "MASTER_ADDR")) {
    info.master_addr = *addr;
    addr_from = "MASTER_ADDR";
  } else if (one_machine) {
    info.master_addr = "127.0.0.1";
    addr_from = "every rank on this machine";
  } else if (info.launcher == Launcher::slurm) {
    const char* list_name = nullptr;
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (lookup(env, name)) {
        list_name = name;
        break;
      }
    }
    if (list_name == nullptr)
      fail("MASTER_ADDR is not set and neither is SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST",
           "export MASTER_ADDR=<host of task 0> before srun");
    info.master_addr = first_slurm_host(*lookup(env, list_name), list_name);
    addr_from = CW_FORMAT("first host of {}", list_name);
  } else {
    const std::string where = info.local_world_size
                                  ? CW_FORMAT("{} of its {} ranks on this machine", *info.local_world_size, info.world_size)
                                  : CW_FORMAT("{} ranks, how many on this machine unknown", info.world_size);
    const char* hint = info.launcher == Launcher::open_mpi
                           ? "export MASTER_ADDR=<host of rank 0> and pass it on: mpirun -x MASTER_ADDR ..."
                           : "export MASTER_ADDR=<host of rank 0> on every machine (torchrun sets it from --master-addr)";
    fail(CW_FORMAT("environment variable MASTER_ADDR is not set and the {} job may span several machines ({})",
                   launcher_name(info.launcher), where),
         hint);
  }

  constexpr const char* kPortHint = "a TCP port number, 1-65535, free on rank 0's machine";
  if (const std::optional<int> port = read_int(env, "CHUNKWISE_MASTER_PORT", 1, 65535, kPortHint)) {
    info.master_port = *port;
    port_from = "CHUNKWISE_MASTER_PORT";
  } else if (const std::optional<int> master_port = read_int(env, "MASTER_PORT", 1, 65535, kPortHint)) {
    info.master_port = *master_port;
    port_from = "MASTER_PORT";
    if (info.launcher == Launcher::torchrun && lookup(env, "TORCHELASTIC_USE_AGENT_STORE") == "True") {
      // torchrun's agent listens on MASTER_PORT itself (its TCP store); we take the next port.
      CW_CHECK_HINT(*master_port < 65535, "set CHUNKWISE_MASTER_PORT to a free port",
                    "MASTER_PORT=65535 is torchrun's store port and there is no next port for the bootstrap");
      info.master_port = *master_port + 1;
      port_from = "MASTER_PORT + 1: torchrun's agent holds MASTER_PORT";
    }
  } else if (const std::optional<std::string> job = lookup(env, "SLURM_JOB_ID");
             job && info.launcher == Launcher::slurm) {
    const int64_t id = parse_integer("SLURM_JOB_ID", *job, 0, std::numeric_limits<int64_t>::max() / 2,
                                     "SLURM sets it; or set MASTER_PORT");
    info.master_port = static_cast<int>(20000 + id % 10000);
    port_from = "20000 + SLURM_JOB_ID mod 10000";
  } else {
    info.master_port = 29500;
    port_from = "default port 29500";
  }
  info.address_from = addr_from + ", " + port_from;
}

}  // namespace

LaunchInfo read_launch_info(const Environment& env) {
  LaunchInfo info;
  std::string local_size_from;
  const char* local_rank_name = "LOCAL_RANK";
  if (read_ranks(env, {Launcher::torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}, info)) {
    local_size_from = "LOCAL_WORLD_SIZE";
  } else if (read_ranks(env,
                        {Launcher::open_mpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                         "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
                        info)) {
    local_rank_name = "OMPI_COMM_WORLD_LOCAL_RANK";
    local_size_from = "OMPI_COMM_WORLD_LOCAL_SIZE";
  } else if (read_ranks(env, {Launcher::slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr}, info)) {
    local_rank_name = "SLURM_LOCALID";
    read_slurm_local_world(env, info, local_size_from);
  }
  check_local(info, local_rank_name, local_size_from.c_str());
  read_address(env, info);
  return info;
}

std::string first_slurm_host(const std::string& host_list, const std::string& variable) {
  const auto malformed = [&](const char* why) -> std::string {
    fail(CW_FORMAT("environment variable {}='{}' is not a SLURM host list ({})", variable, host_list, why),
         "SLURM sets it (e.g. 'gpu[01-04],gpu07'); or set MASTER_ADDR to the host of task 0");
  };
  std::string host;
  size_t i = 0;
  while (i < host_list.size() && host_list[i] != ',') {
    const char c = host_list[i];
    if (c == ']') malformed("']' without '['");
    if (c != '[') {
      host += c;
      ++i;
      continue;
    }
    // A bracket: ranges and numbers separated by commas; the first number of the first range is
    // the first host's (zero padding kept: "[07-09]" starts at "07").
    const size_t close = host_list.find(']', i);
    if (close == std::string::npos) malformed("'[' without ']'");
    const std::string inside = host_list.substr(i + 1, close - i - 1);
    const std::string first = inside.substr(0, inside.find_first_of(",-"));
    if (first.empty()) malformed("an empty range");
    for (const char d : first)
      if (!std::isdigit(static_cast<unsigned char>(d))) malformed("a range that is not numbers");
    host += first;
    i = close + 1;
  }
  if (host.empty()) malformed("no host");
  return host;
}

int slurm_tasks_on_node(const std::string& tasks_per_node, int node_index, const std::string& variable) {
  const auto malformed = [&](const char* why) -> int {
    fail(CW_FORMAT("environment variable {}='{}' is not a SLURM tasks-per-node list ({})", variable, tasks_per_node,
                   why),
         "SLURM sets it (e.g. '2(x3),1'); check the srun options");
  };
  // Items "N" (one node) or "N(xM)" (M nodes), comma-separated, in node order.
  int64_t first_node = 0;
  size_t i = 0;
  while (i < tasks_per_node.size()) {
    size_t end = tasks_per_node.find(',', i);
    if (end == std::string::npos) end = tasks_per_node.size();
    const std::string item = tasks_per_node.substr(i, end - i);
    const size_t paren = item.find('(');
    const std::string count_text = item.substr(0, paren);
    int64_t repeat = 1;
    if (paren != std::string::npos) {
      if (item.size() < paren + 4 || item[paren + 1] != 'x' || item.back() != ')') malformed("an item not 'N(xM)'");
      repeat = parse_integer(variable, item.substr(paren + 2, item.size() - paren - 3), 1, kMaxInt,
                             "SLURM sets it; check the srun options");
    }
    const int64_t count = parse_integer(variable, count_text, 1, kMaxInt, "SLURM sets it; check the srun options");
    if (node_index < first_node + repeat) return static_cast<int>(count);
    first_node += repeat;
    i = end + 1;
  }
  if (first_node == 0) return malformed("empty");
  return malformed("fewer nodes than SLURM_NODEID + 1");
}

}  // namespace cw
