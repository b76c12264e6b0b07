// parallel/launch.h: every launcher's variables from fake environments, the address and port
// rules, SLURM's host and tasks-per-node lists, and a clear error for each malformed value.
#include "parallel/launch.h"

#include "engine/env.h"
#include "engine/error.h"
#include "parallel/bootstrap.h"
#include "parallel/watchdog.h"

#include <doctest/doctest.h>

#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

using namespace cw;
// Values are assigned as std::string(...): GCC 12 warns falsely (-Wrestrict) when a map element is
// assigned a string literal.
using Vars = std::map<std::string, std::string>;

namespace {
LaunchInfo read(const Vars& vars) { return read_launch_info(environment_from(vars)); }
}  // namespace

TEST_CASE("launch: no launcher variables is a single process, rank 0 of 1") {
  const LaunchInfo info = read({{"PATH", "/usr/bin"}});
  CHECK(info.launcher == Launcher::single);
  CHECK(info.rank == 0);
  CHECK(info.world_size == 1);
  CHECK(info.local_rank == 0);
  CHECK(info.master_addr == "127.0.0.1");
  CHECK(info.master_port == 29500);
  // Set but empty counts as unset.
  CHECK(read({{"RANK", ""}, {"WORLD_SIZE", ""}}).launcher == Launcher::single);
}

TEST_CASE("launch: torchrun's variables") {
  Vars vars = {{"RANK", "5"},         {"WORLD_SIZE", "8"},         {"LOCAL_RANK", "1"},
               {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "node-a"}, {"MASTER_PORT", "1234"}};
  LaunchInfo info = read(vars);
  CHECK(info.launcher == Launcher::torchrun);
  CHECK(info.rank == 5);
  CHECK(info.world_size == 8);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 4);
  CHECK(info.master_addr == "node-a");
  CHECK(info.master_port == 1234);
  CHECK(info.describe() == "rank 5 of 8 (local 1 of 4) via torchrun, bootstrap at node-a:1234 (MASTER_ADDR, MASTER_PORT)");

  // torchrun's agent serves its store on MASTER_PORT: the bootstrap takes the next one.
  vars["TORCHELASTIC_USE_AGENT_STORE"] = std::string("True");
  CHECK(read(vars).master_port == 1235);
  vars["TORCHELASTIC_USE_AGENT_STORE"] = std::string("False");
  CHECK(read(vars).master_port == 1234);
  // CHUNKWISE_MASTER_PORT overrides every launcher's port.
  vars["CHUNKWISE_MASTER_PORT"] = std::string("40000");
  CHECK(read(vars).master_port == 40000);

  // A hand-made launch on one machine: no LOCAL_RANK, no MASTER_ADDR/PORT.
  info = read({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}});
  CHECK(info.local_rank == 1);
  CHECK(info.master_addr == "127.0.0.1");
  CHECK(info.master_port == 29500);
  // IPv6 literals are bracketed in messages.
  CHECK(host_port("fe80::1", 29500) == "[fe80::1]:29500");
}

TEST_CASE("launch: Open MPI's variables") {
  Vars vars = {{"OMPI_COMM_WORLD_RANK", "2"},
               {"OMPI_COMM_WORLD_SIZE", "4"},
               {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
               {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
  LaunchInfo info = read(vars);
  CHECK(info.launcher == Launcher::open_mpi);
  CHECK(info.rank == 2);
  CHECK(info.world_size == 4);
  CHECK(info.local_rank == 2);
  CHECK(info.local_world_size == 4);
  CHECK(info.master_addr == "127.0.0.1");  // every rank on this machine
  CHECK(info.master_port == 29500);

  // Two machines and no MASTER_ADDR: mpirun cannot tell us rank 0's host.
  vars["OMPI_COMM_WORLD_SIZE"] = std::string("8");
  CHECK_THROWS_WITH_AS(read(vars), doctest::Contains("MASTER_ADDR is not set"), Error);
  CHECK_THROWS_WITH_AS(read(vars), doctest::Contains("mpirun -x MASTER_ADDR"), Error);
  vars["MASTER_ADDR"] = std::string("10.0.0.7");
  vars["MASTER_PORT"] = std::string("29600");
  info = read(vars);
  CHECK(info.master_addr == "10.0.0.7");
  CHECK(info.master_port == 29600);
}

TEST_CASE("launch: SLURM's variables") {
  Vars vars = {{"SLURM_PROCID", "5"},
               {"SLURM_NTASKS", "7"},
               {"SLURM_LOCALID", "1"},
               {"SLURM_NODEID", "2"},
               {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"},
               {"SLURM_STEP_NODELIST", "gpu[07-09],login1"},
               {"SLURM_JOB_NODELIST", "other[1-4]"},
               {"SLURM_JOB_ID", "1234567"}};
  LaunchInfo info = read(vars);
  CHECK(info.launcher == Launcher::slurm);
  CHECK(info.rank == 5);
  CHECK(info.world_size == 7);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 2);
  CHECK(info.master_addr == "gpu07");          // the step's first node, not the job's
  CHECK(info.master_port == 20000 + 4567);     // 20000 + job id mod 10000

  vars.erase("SLURM_STEP_TASKS_PER_NODE");
  vars["SLURM_TASKS_PER_NODE"] = std::string("3,3,2(x2)");
  CHECK(read(vars).local_world_size == 2);
  vars.erase("SLURM_TASKS_PER_NODE");
  CHECK_FALSE(read(vars).local_world_size.has_value());  // unknown: neither list nor --ntasks-per-node
  vars["SLURM_NTASKS_PER_NODE"] = std::string("4");
  CHECK(read(vars).local_world_size == 4);

  vars.erase("SLURM_STEP_NODELIST");
  CHECK(read(vars).master_addr == "other1");
  vars["MASTER_ADDR"] = std::string("head");
  vars["MASTER_PORT"] = std::string("2000");
  CHECK(read(vars).master_addr == "head");
  CHECK(read(vars).master_port == 2000);

  // Several nodes, no MASTER_ADDR and no node list: say what to set.
  const Vars bare = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}};
  CHECK_THROWS_WITH_AS(read(bare), doctest::Contains("export MASTER_ADDR"), Error);
}

TEST_CASE("launch: torchrun's variables win over SLURM's and Open MPI's") {
  const LaunchInfo info = read({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "4"},
                                {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"},
                                {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}});
  CHECK(info.launcher == Launcher::torchrun);
  CHECK(info.rank == 3);
  const LaunchInfo mpi = read({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  CHECK(mpi.launcher == Launcher::open_mpi);
  CHECK(mpi.rank == 1);
}

TEST_CASE("launch: malformed and inconsistent values are one clear error naming the variable") {
  const auto error = [](const Vars& vars, const char* text) {
    INFO("expected an error containing: ", text);
    CHECK_THROWS_WITH_AS(read(vars), doctest::Contains(text), Error);
  };
  error({{"RANK", "one"}, {"WORLD_SIZE", "2"}}, "RANK='one' is not an integer");
  error({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK='-1' is not an integer");
  error({{"RANK", "1 "}, {"WORLD_SIZE", "2"}}, "RANK='1 ' is not an integer");
  error({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE='0' is not an integer in [1,");
  error({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}, "WORLD_SIZE='99999999999'");
  error({{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "RANK=4 is not below WORLD_SIZE=4");
  error({{"RANK", "0"}}, "RANK is set but WORLD_SIZE is not");
  error({{"WORLD_SIZE", "2"}}, "WORLD_SIZE is set but RANK is not");
  error({{"OMPI_COMM_WORLD_RANK", "0"}}, "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not");
  error({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID=2 is not below SLURM_NTASKS=2");
  error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
        "LOCAL_RANK=2 is not below the local world size 2");
  error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "3"}},
        "local world size 3 (from LOCAL_WORLD_SIZE) exceeds the world size 2");
  error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "5"}}, "LOCAL_RANK=5 is not below the world size 2");
  error({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT='70000' is not an integer in [1, 65535]");
  error({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "http"}}, "MASTER_PORT='http'");
  error({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"CHUNKWISE_MASTER_PORT", "0"}}, "CHUNKWISE_MASTER_PORT='0'");
  error({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "65535"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}},
        "there is no next port");
  // Several machines possible (local world size unknown) and no MASTER_ADDR.
  error({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, "environment variable MASTER_ADDR is not set");
  error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODEID", "0"}, {"SLURM_TASKS_PER_NODE", "1(x2"},
         {"SLURM_NODELIST", "a[1-2]"}},
        "SLURM_TASKS_PER_NODE='1(x2' is not a SLURM tasks-per-node list");
  error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODELIST", "gpu[07"}},
        "SLURM_NODELIST='gpu[07' is not a SLURM host list");
  error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODELIST", "a"}, {"SLURM_JOB_ID", "x1"}},
        "SLURM_JOB_ID='x1'");
}

TEST_CASE("launch: SLURM host lists and tasks-per-node lists") {
  CHECK(first_slurm_host("node1", "L") == "node1");
  CHECK(first_slurm_host("node1,node2", "L") == "node1");
  CHECK(first_slurm_host("gpu[07-09,12],login1", "L") == "gpu07");
  CHECK(first_slurm_host("gpu[3,5-6]", "L") == "gpu3");
  CHECK(first_slurm_host("rack[1-2]-n[003-004]", "L") == "rack1-n003");
  CHECK(first_slurm_host("a-b.example.org", "L") == "a-b.example.org");
  CHECK_THROWS_WITH_AS(first_slurm_host("", "L"), doctest::Contains("no host"), Error);
  CHECK_THROWS_WITH_AS(first_slurm_host("gpu[]", "L"), doctest::Contains("an empty range"), Error);
  CHECK_THROWS_WITH_AS(first_slurm_host("gpu[a-b]", "L"), doctest::Contains("not numbers"), Error);
  CHECK_THROWS_WITH_AS(first_slurm_host("gpu]1", "L"), doctest::Contains("']' without '['"), Error);

  CHECK(slurm_tasks_on_node("4", 0, "T") == 4);
  CHECK(slurm_tasks_on_node("2(x3),1", 0, "T") == 2);
  CHECK(slurm_tasks_on_node("2(x3),1", 2, "T") == 2);
  CHECK(slurm_tasks_on_node("2(x3),1", 3, "T") == 1);
  CHECK(slurm_tasks_on_node("1,8(x2)", 2, "T") == 8);
  CHECK_THROWS_WITH_AS(slurm_tasks_on_node("2(x3),1", 4, "T"), doctest::Contains("fewer nodes"), Error);
  CHECK_THROWS_WITH_AS(slurm_tasks_on_node("2(3)", 0, "T"), doctest::Contains("not 'N(xM)'"), Error);
  CHECK_THROWS_WITH_AS(slurm_tasks_on_node("two", 0, "T"), doctest::Contains("T='two'"), Error);
}

TEST_CASE("launch: the process environment is read through the registry (engine/env.h)") {
  ::setenv("CW_TEST_LAUNCH_VARIABLE", "42", 1);
  const Environment env = process_environment();
  CHECK(env("CW_TEST_LAUNCH_VARIABLE") == "42");
  ::unsetenv("CW_TEST_LAUNCH_VARIABLE");
  CHECK_FALSE(env("CW_TEST_LAUNCH_VARIABLE").has_value());
  CHECK_THROWS_WITH_AS(env("NOT_A_LAUNCH_VARIABLE"), doctest::Contains("NOT_A_LAUNCH_VARIABLE"), Error);
}

TEST_CASE("launch: every variable the launch readers ask for is a launch variable of the registry") {
  // Each launcher's variables set in turn, so that every branch asks its names.
  const std::vector<std::map<std::string, std::string>> worlds = {
      {},
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "40000"},
       {"TORCHELASTIC_USE_AGENT_STORE", "True"}},
      {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
      {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NODEID", "0"}, {"SLURM_JOB_NODELIST", "gpu[1-2]"},
       {"SLURM_JOB_ID", "77"}}};
  for (const auto& world : worlds) {
    std::set<std::string> asked;
    const Environment fake = environment_from(world);
    const Environment recording = [&](const std::string& name) {
      asked.insert(name);
      return fake(name);
    };
    read_launch_info(recording);
    bootstrap_timeout_from(recording);
    comm_timeout_from(recording);
    CHECK(asked.size() > 4);
    for (const std::string& name : asked) {
      INFO(name);
      const env::Variable* v = env::find(name);
      REQUIRE(v != nullptr);
      CHECK(v->kind == env::Kind::launch);
    }
  }
}
