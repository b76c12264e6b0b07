// Who this process is in a multi-process job, read from the variables its launcher sets.
//
//   launcher   variables read (first match wins, in this order)
//   torchrun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//              (any launcher that sets RANK and WORLD_SIZE by hand counts as torchrun-style)
//   open_mpi   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
//              OMPI_COMM_WORLD_LOCAL_SIZE
//   slurm      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the local world size from
//              SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE (with SLURM_NODEID: srun sets them
//              for its step), else SLURM_NTASKS_PER_NODE; SLURM_STEP_NODELIST / SLURM_JOB_NODELIST /
//              SLURM_NODELIST and SLURM_JOB_ID for the address and port below
//   single     none of the above: rank 0 of 1
// torchrun comes first because it is often started inside a SLURM job (which sets SLURM_PROCID for
// the torchrun process, not for its workers), and mpirun inside a SLURM allocation likewise.
//
// The bootstrap address (where rank 0 listens for the other ranks: parallel/bootstrap.h):
//   address  MASTER_ADDR if set; else 127.0.0.1 when every rank is known to be on this machine
//            (local world size = world size); else under SLURM the first host of the step's node
//            list (task 0 runs there); else an error naming MASTER_ADDR. SLURM_LAUNCH_NODE_IPADDR is
//            not used: it is where srun ran, which may be a login node with no rank on it.
//   port     CHUNKWISE_MASTER_PORT if set (for every launcher); else MASTER_PORT, plus one under
//            torchrun when TORCHELASTIC_USE_AGENT_STORE=True (torchrun's agent then serves its own
//            TCP store on MASTER_PORT); else under SLURM 20000 + SLURM_JOB_ID mod 10000 (two jobs
//            sharing a node get different ports); else 29500 (torchrun's default).
// A variable that is set but empty counts as unset. Every value is checked: a non-numeric or
// out-of-range value, a rank >= world size, or one of a launcher's required pair without the other
// is a one-line error naming the variable.
// The environment is an input (a lookup function), so tests pass fake ones.
// Tested in tests/parallel/test_launch.cpp.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <streambuf>
#include <string>

namespace cw {

// One environment variable's value, or nullopt when it is unset.
using Environment = std::function<std::optional<std::string>(const std::string& name)>;

Environment process_environment();  // engine/env.h lookup: the registry's launch variables
Environment environment_from(std::map<std::string, std::string> variables);

enum class Launcher { single, torchrun, open_mpi, slurm };
const char* launcher_name(Launcher launcher);  // "single" | "torchrun" | "open_mpi" | "slurm"

struct LaunchInfo {
  Launcher launcher = Launcher::single;
  int rank = 0, world_size = 1;
  int local_rank = 0;                     // this rank's index among the ranks on its machine
  std::optional<int> local_world_size;    // ranks on this machine, where the launcher says
  std::string master_addr = "127.0.0.1";  // host name or IPv4/IPv6 address of rank 0
  int master_port = 29500;                // the TCP port rank 0 listens on for the bootstrap
  std::string address_from = "default";   // which variables gave address and port, for messages

  // One line: "rank 1 of 4 (local 1 of 4) via torchrun, bootstrap at 10.0.0.1:29500 (MASTER_ADDR, MASTER_PORT)".
  std::string describe() const;
};

// Reads the launcher's variables; throws a cw::Error naming the variable on bad values.
LaunchInfo read_launch_info(const Environment& env);

// "host:port", or "[v6-address]:port" for an IPv6 literal.
std::string host_port(const std::string& host, int port);

// The first host of a SLURM host list ("gpu[07-09,12],login1" -> "gpu07"; "a[1-2]-b[03-04]" -> "a1-b03").
// Throws naming `variable` when the list is malformed.
std::string first_slurm_host(const std::string& host_list, const std::string& variable);

// Tasks on node `node_index` from a SLURM tasks-per-node list ("2(x3),1": nodes 0-2 run 2, node 3 runs 1).
// Throws naming `variable` when the list is malformed or has no such node.
int slurm_tasks_on_node(const std::string& tasks_per_node, int node_index, const std::string& variable);

// Where the ranks other than 0 print: a stream that drops what it is given.
struct NullStream {
  struct Buffer : std::streambuf {
    int overflow(int c) override { return c; }
  } buffer;
  std::ostream stream{&buffer};
};

}  // namespace cw
