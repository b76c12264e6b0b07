// The fuzz targets' dictionaries (tests/fuzz/dicts/, written by tests/fuzz/make_dicts from the
// parsers' sources and docs/options.md): the committed files are what make_dicts writes today, and
// the run-config dictionary holds every [section] and key of the options table, read from the code
// itself, so that a new option cannot be missing from it.
#include "tests/support.h"
#include "tools/train/run_config.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>

using namespace cw;
namespace fs = std::filesystem;

namespace {
const fs::path kDicts = fs::path(CW_SOURCE_ROOT) / "tests" / "fuzz" / "dicts";

bool have_python3() { return std::system("python3 -c 'import struct' >/dev/null 2>&1") == 0; }
}  // namespace

TEST_CASE("fuzz dictionaries: run_config.dict holds every [section] and key of the options table") {
  const std::string text = test::read_text(kDicts / "run_config.dict");
  REQUIRE(!text.empty());
  std::set<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.insert(line);
  RunConfig rc;
  for (const OptionRef& o : rc.options()) {
    INFO(o.name());
    CHECK(lines.count("\"[" + std::string(o.section) + "]\"") == 1);
    CHECK(lines.count("\"" + std::string(o.key) + " = \"") == 1);
  }
}

TEST_CASE("fuzz dictionaries: the committed ones are what tests/fuzz/make_dicts writes from the sources" *
          doctest::skip(!have_python3())) {
  const std::string command = "python3 " + (fs::path(CW_SOURCE_ROOT) / "tests" / "fuzz" / "make_dicts").string() +
                              " --check 2>&1";
  FILE* p = popen(command.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  INFO(out);
  CHECK(status == 0);
}
