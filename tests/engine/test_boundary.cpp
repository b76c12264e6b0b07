// The layering rule of the engine (engine/README.md): above engine/ (model/, optim/, parallel/,
// tools/) nothing includes engine/cuda/ or names the gpu:: namespace; the public engine is
// engine/engine.h, engine/ops/*.h, engine/memory.h, engine/residency.h, engine/scratch.h and
// engine/trace.h. A violation fails naming the file and line. And the CPU-only build's side of the
// boundary: every function engine/cuda/runtime.h declares has its stand-in in
// engine/cuda/runtime_stub.cpp, so a build without CUDA links (CI builds with CUDA, so nothing else
// would notice a missing one).
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

TEST_CASE("layering: nothing above engine/ includes engine/cuda/ or names gpu::") {
  const fs::path root = CW_SOURCE_ROOT;
  std::vector<std::string> violations;
  size_t files = 0;
  for (const char* dir : {"model", "optim", "parallel", "tools"}) {
    if (!fs::exists(root / dir)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = entry.path().extension().string();
      if (ext != ".cpp" && ext != ".h" && ext != ".cu" && ext != ".cuh") continue;
      ++files;
      std::ifstream in(entry.path());
      std::string line;
      for (int n = 1; std::getline(in, line); ++n)
        if (line.find("#include \"engine/cuda/") != std::string::npos || line.find("gpu::") != std::string::npos)
          violations.push_back(fs::relative(entry.path(), root).string() + ":" + std::to_string(n) + ": " + line);
    }
  }
  CHECK(files > 20);  // the scan saw the sources
  for (const std::string& v : violations) FAIL_CHECK("layering violation: " << v);
  CHECK(violations.empty());
}

TEST_CASE("layering: every function of engine/cuda/runtime.h has its stand-in in runtime_stub.cpp") {
  const fs::path root = CW_SOURCE_ROOT;
  const auto read = [](const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  const std::string header = read(root / "engine/cuda/runtime.h"), stub = read(root / "engine/cuda/runtime_stub.cpp");
  REQUIRE(!header.empty());
  REQUIRE(!stub.empty());
  // Declarations at namespace scope start in column 0 and end in ';' (inline definitions in the header
  // need no stand-in).
  const std::regex declaration(R"(^(?!inline\b)[A-Za-z][\w:<>,*& ]*?\b([a-z_]\w*)\([^;{]*\)[^;{]*;)", std::regex::multiline);
  std::vector<std::string> names, missing;
  for (std::sregex_iterator it(header.begin(), header.end(), declaration), end; it != end; ++it) {
    const std::string name = (*it)[1];
    names.push_back(name);
    if (!std::regex_search(stub, std::regex("\\b" + name + "\\("))) missing.push_back(name);
  }
  CHECK(names.size() > 20);  // the scan found the declarations
  for (const std::string& m : missing) FAIL_CHECK("engine/cuda/runtime_stub.cpp has no " << m << "(...)");
  CHECK(missing.empty());
}
