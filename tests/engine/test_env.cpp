// The registry of environment variables (engine/env.h): each reader's rule, EnvFlag's caching, the
// registry's rows, and that no source outside it reads or sets the environment. Its printed tables
// against docs/environment.md: tests/tools/test_options.cpp.
#include "engine/env.h"
#include "engine/error.h"
#include "tests/support.h"

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using namespace cw;

namespace {

// The test's own variables, of each kind (not in the registry: the readers take any Variable).
constexpr env::Variable kTestFlagOff{"CW_TEST_ENV_FLAG", env::Kind::flag, "0", "a test's flag, off by default"};
constexpr env::Variable kTestFlagOn{"CW_TEST_ENV_FLAG", env::Kind::flag, "1", "a test's flag, on by default"};
constexpr env::Variable kTestInteger{"CW_TEST_ENV_FLAG", env::Kind::integer, "none", "a test's count", 2, 300};
constexpr env::Variable kTestText{"CW_TEST_ENV_FLAG", env::Kind::text, "none", "a test's text"};

}  // namespace

TEST_CASE("env: a flag is its default when unset or empty, 0 or 1 when set, anything else a clear error") {
  test::EnvScope scope(kTestFlagOff.name, nullptr);
  CHECK_FALSE(env::flag(kTestFlagOff));
  CHECK(env::flag(kTestFlagOn));
  scope.set("");
  CHECK_FALSE(env::flag(kTestFlagOff));
  CHECK(env::flag(kTestFlagOn));
  scope.set("1");
  CHECK(env::flag(kTestFlagOff));
  scope.set("0");
  CHECK_FALSE(env::flag(kTestFlagOn));
  for (const char* bad : {"yes", "2", " 1", "on"}) {
    scope.set(bad);
    const std::string named = std::string("CW_TEST_ENV_FLAG='") + bad + "'";
    CHECK_THROWS_WITH_AS(env::flag(kTestFlagOff), doctest::Contains(named.c_str()), Error);
  }
}

TEST_CASE("env: an integer is nullopt when unset or empty, its digits within the range, anything else a clear error") {
  test::EnvScope scope(kTestInteger.name, nullptr);
  CHECK_FALSE(env::integer(kTestInteger).has_value());
  scope.set("");
  CHECK_FALSE(env::integer(kTestInteger).has_value());
  scope.set("2");
  CHECK(env::integer(kTestInteger) == 2);
  scope.set("300");
  CHECK(env::integer(kTestInteger) == 300);
  for (const char* bad : {"1", "301", "-5", "+5", "5 ", "five", "12345678901234567890"}) {
    scope.set(bad);
    CHECK_THROWS_WITH_AS(env::integer(kTestInteger), doctest::Contains("is not an integer from 2 to 300"), Error);
  }
}

TEST_CASE("env: text is nullopt when unset or empty, else the value") {
  test::EnvScope scope(kTestText.name, nullptr);
  CHECK_FALSE(env::text(kTestText).has_value());
  scope.set("");
  CHECK_FALSE(env::text(kTestText).has_value());
  scope.set("a/b c");
  CHECK(env::text(kTestText) == "a/b c");
  CHECK(env::value(kTestText) == std::string("a/b c"));
}

TEST_CASE("env: a reader refuses a variable of another kind") {
  CHECK_THROWS_AS(env::flag(kTestInteger), Error);
  CHECK_THROWS_AS(env::integer(kTestText), Error);
  CHECK_THROWS_AS(env::text(kTestFlagOff), Error);
  CHECK_THROWS_AS(env::flag(env::kAttention), Error);
}

TEST_CASE("env: lookup reads the registry's launch and test variables, as they are, and no other") {
  test::EnvScope scope("CW_TEST_LAUNCH_VARIABLE", "");
  CHECK(env::lookup("CW_TEST_LAUNCH_VARIABLE") == "");  // empty is kept: parallel/ decides what it means
  scope.set(nullptr);
  CHECK_FALSE(env::lookup("CW_TEST_LAUNCH_VARIABLE").has_value());
  CHECK_THROWS_WITH_AS(env::lookup("CW_NOT_A_VARIABLE"), doctest::Contains("CW_NOT_A_VARIABLE"), Error);
  CHECK_THROWS_WITH_AS(env::lookup(env::kDeterministic.name), doctest::Contains("not a launch variable"), Error);
}

TEST_CASE("EnvFlag: the default, the variable's 0 or 1, a set value kept, anything else a clear error") {
  test::EnvScope scope(kTestFlagOff.name, nullptr);
  for (const env::Variable* variable : {&kTestFlagOff, &kTestFlagOn}) {
    const bool by_default = variable == &kTestFlagOn;
    INFO("by default ", by_default);
    scope.set(nullptr);
    EnvFlag flag(*variable);
    CHECK(flag.get() == by_default);
    scope.set(by_default ? "0" : "1");
    CHECK(flag.get() == by_default);  // read once: the variable is not read again
    flag.forget();
    CHECK(flag.get() == !by_default);
    flag.set(by_default);
    CHECK(flag.get() == by_default);  // a set value wins over the variable
    scope.set(by_default ? "1" : "0");
    flag.forget();
    CHECK(flag.get() == by_default);
    scope.set("");
    flag.forget();
    CHECK(flag.get() == by_default);
    scope.set("yes");
    flag.forget();
    CHECK_THROWS_WITH_AS(flag.get(), doctest::Contains(variable->name), Error);
  }
}

TEST_CASE("env: the registry names each variable once, each row a default and a meaning a table can print") {
  std::set<std::string> names;
  size_t rows = 0;
  for (const env::Table& t : env::tables()) {
    CHECK_FALSE(t.variables.empty());
    for (const env::Variable& v : t.variables) {
      INFO(v.name);
      ++rows;
      names.insert(v.name);
      CHECK(env::find(v.name) == &v);
      for (const char* text : {v.name, v.by_default, v.meaning}) {
        CHECK(std::string(text).find('|') == std::string::npos);  // a markdown table's column separator
        CHECK(std::string(text).find('\n') == std::string::npos);
        CHECK_FALSE(std::string(text).empty());
      }
      if (v.kind == env::Kind::integer) CHECK(v.lo <= v.hi);
    }
  }
  CHECK(names.size() == rows);
  // The variables the code reads with a typed reader are in the tables.
  for (const env::Variable* v : {&env::kDeterministic, &env::kAttention, &env::kAttentionWorkspaceMib,
                                 &env::kCudnnPlanThreads, &env::kCudnnVerbose, &env::kArenaLog, &env::kDemoData,
                                 &env::kBootstrapTimeout, &env::kCommTimeout, &env::kMasterPort, &env::kKernelProfile,
                                 &env::kKernelProfileTop, &env::kKernelProfileApi}) {
    const env::Variable* row = env::find(v->name);
    REQUIRE_MESSAGE(row != nullptr, v->name);
    CHECK(row->kind == v->kind);
    CHECK(std::string(row->by_default) == v->by_default);
  }
}

TEST_CASE("env: no source of the project reads or sets the environment but engine/env.{h,cpp}") {
  // tests/ reads its own CW_TEST_* variables (listed in the registry as test-only) and is not scanned.
  namespace fs = std::filesystem;
  const fs::path root = CW_SOURCE_ROOT;
  std::vector<std::string> offenders;
  size_t scanned = 0;
  for (const char* dir : {"engine", "model", "optim", "parallel", "tools"}) {
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh")) continue;
      const std::string rel = fs::relative(e.path(), root).string();
      if (rel == "engine/env.h" || rel == "engine/env.cpp") continue;
      ++scanned;
      std::ifstream f(e.path());
      std::stringstream text;
      text << f.rdbuf();
      for (const char* call : {"getenv(", "setenv(", "putenv(", "unsetenv("})
        if (text.str().find(call) != std::string::npos) offenders.push_back(rel + ": " + call);
    }
  }
  CHECK(scanned > 50);
  std::string list;
  for (const std::string& o : offenders) list += "\n  " + o;
  CHECK_MESSAGE(offenders.empty(), "read the environment through engine/env.h:" << list);
}
