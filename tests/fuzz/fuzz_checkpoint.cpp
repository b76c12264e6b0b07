// Fuzz target: a run directory's checkpoint manifest (tools/train/run_dir.h): the bytes are
// step-000001/manifest.json beside one small weights file, and the run directory is asked for that
// checkpoint (find) and for its newest complete one (latest_complete), which verify the manifest's
// format, version, step and file list (names, sizes, FNV-1a hashes). The same bytes are then read
// as a checkpoint's state.json: its "sampler" record goes to SamplerState::from_json
// (tools/data/tokens.h), the data position a resume restores.
#include <filesystem>
#include <nlohmann/json.hpp>

#include "tests/fuzz/fuzz_support.h"
#include "tools/data/tokens.h"
#include "tools/train/run_dir.h"

namespace {

// The run directory with its one checkpoint's weights file, made once per process.
const std::string& run_dir() {
  static const std::string dir = [] {
    const std::string path = cw::fuzz::scratch_dir() + "/run";
    std::filesystem::create_directories(path + "/step-000001");
    cw::fuzz::write_scratch_file("run/step-000001/model.safetensors", "abcd");
    return path;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cw;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const std::string& dir = run_dir();
  fuzz::write_scratch_file("run/step-000001/manifest.json", bytes);
  fuzz::refuse_quietly([&] {
    const RunDirectory run(dir);
    std::string why;
    (void)run.find(1, &why);
    std::vector<std::string> skipped;
    (void)run.latest_complete(&skipped);
  });

  const nlohmann::json state = nlohmann::json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  if (state.is_object() && state.contains("sampler")) {
    fuzz::refuse_quietly([&] { (void)SamplerState::from_json(state.at("sampler"), "state.json"); });
  }
  return 0;
}
