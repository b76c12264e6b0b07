// The layering rule of the engine (engine/README.md): above engine/ (model/, optim/, parallel/,
// tools/) nothing includes engine/cuda/ or names the gpu:: namespace; the public engine is
// engine/engine.h, engine/ops/*.h, engine/memory.h, engine/residency.h and engine/trace.h. A
// violation fails naming the file and line.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
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
