// Fuzz target: a run-config TOML file (RunConfig::from_toml, tools/train/run_config.h), in memory,
// then validate(). For a config that passes both, to_toml() must read back as the same config (the
// header's promise for a run directory's copy, which is written once a run is validated): a
// difference is a finding too. Unvalidated configs are left out because a NaN, which validate()
// refuses, never compares equal to itself.
#include <cstdio>

#include "tests/fuzz/fuzz_support.h"
#include "tools/train/run_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cw;
  fuzz::refuse_quietly([&] {
    const RunConfig config = RunConfig::from_toml(fuzz::as_text(data, size), "run.toml");
    config.validate();
    const std::string written = config.to_toml();
    if (!(RunConfig::from_toml(written, "to_toml()") == config)) {
      std::fprintf(stderr, "fuzz: to_toml() does not read back as the same config:\n%s\n", written.c_str());
      __builtin_trap();
    }
  });
  return 0;
}
