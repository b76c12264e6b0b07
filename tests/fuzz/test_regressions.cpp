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
  // 1e300 is integral as a double, and converting it to int64 is undefined (UBSan: model/config.cpp
  // get_int); an unsanitized build gets INT64_MIN, which validate() then refuses.
  CHECK_THROWS_AS(LlamaConfig::from_file(regression_input("config_json", "hidden_size_1e300.json")), Error);
}

// Open: validate() accepts sizes whose products overflow int64 (intermediate_size = 2^62 here), and
// parameter_count() then overflows (UBSan: model/config.cpp). should_fail keeps the suite green while
// the parser accepts the file; once it refuses it this case fails, and should_fail comes off.
TEST_CASE("fuzz regression: config.json whose parameter count overflows int64 is refused" * doctest::should_fail()) {
  CHECK_THROWS_AS(LlamaConfig::from_file(regression_input("config_json", "intermediate_size_2e62.json")), Error);
}
