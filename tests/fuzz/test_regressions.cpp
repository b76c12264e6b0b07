// Inputs the fuzz targets found (tests/fuzz/regressions/<target>/, README.md), each fed to the parser
// it broke and expected to be refused with a cw::Error. Some findings are undefined behaviour that an
// ordinary build survives by luck (the bad value then fails a later check); the sanitized builds
// report them: tests/README.md's build-asan, and the fuzz target replaying the file.
#include "engine/error.h"
#include "model/config.h"
#include "tests/support.h"

#include <filesystem>
#include <string>

using namespace cw;

namespace {

std::string regression_input(const std::string& target, const std::string& name) {
  const std::filesystem::path path = std::filesystem::path(CW_SOURCE_ROOT) / "tests" / "fuzz" / "regressions" / target / name;
  REQUIRE(std::filesystem::is_regular_file(path));
  return path.string();
}

}  // namespace

TEST_CASE("fuzz regression: config.json with an integer key of 1e300 is refused") {
  // 1e300 is integral as a double, and converting it to int64 was undefined (UBSan: model/config.cpp
  // get_int, an unsanitized build getting INT64_MIN); the typed reader (model/json_fields.h) now
  // refuses a double outside int64's range as "not an integer".
  CHECK_THROWS_AS(LlamaConfig::from_file(regression_input("config_json", "hidden_size_1e300.json")), Error);
}

// validate() accepted sizes whose products overflow int64 (intermediate_size = 2^62 here), and
// parameter_count() then overflowed (UBSan: model/config.cpp); the size bounds (ConfigLimits) now
// refuse the file before any product is formed.
TEST_CASE("fuzz regression: config.json whose parameter count overflows int64 is refused") {
  CHECK_THROWS_AS(LlamaConfig::from_file(regression_input("config_json", "intermediate_size_2e62.json")), Error);
}
