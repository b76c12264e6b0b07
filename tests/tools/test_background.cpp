// tools/background: a job started detached, waited for, read, stopped (the GPU machine's way to run
// a step longer than one device call).
#include "tests/support.h"

#include <doctest/doctest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace {
struct Result {
  int status;
  std::string out;
};
// Runs tools/background with `args` and BACKGROUND_DIR=dir; its exit status and output.
Result background(const std::string& dir, const std::string& args) {
  const std::string cmd = "BACKGROUND_DIR='" + dir + "' '" + std::string(CW_SOURCE_ROOT) + "/tools/background' " + args +
                          " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}
}  // namespace

TEST_CASE("tools/background: start, wait for the exit status and the log, stop a running job") {
  cw::test::TempDir dir("background");
  Result r = background(dir.path.string(), "start job -- sh -c 'echo first; sleep 1; echo last; exit 3'");
  CHECK(r.status == 0);
  CHECK(r.out.find("job: started") != std::string::npos);
  r = background(dir.path.string(), "start job -- true");
  CHECK(r.status == 1);  // one job of a name at a time
  r = background(dir.path.string(), "wait job 30");
  CHECK(r.status == 3);
  CHECK(r.out == "first\nlast\njob: exited 3\n");

  background(dir.path.string(), "start slow -- sleep 60");
  r = background(dir.path.string(), "wait slow 1");
  CHECK(r.status == 3);  // still running
  CHECK(r.out.find("slow: running") != std::string::npos);
  r = background(dir.path.string(), "stop slow");
  CHECK(r.out == "slow: stopped\n");
  r = background(dir.path.string(), "status slow");
  CHECK(r.status == 143);
  CHECK(background(dir.path.string(), "status none").out == "none: no such job\n");
  CHECK(background(dir.path.string(), "start x").status == 2);  // usage
}
