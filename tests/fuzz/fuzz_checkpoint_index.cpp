// Fuzz target: an HF checkpoint's model.safetensors.index.json (model/checkpoint.h): the bytes are
// the index of a checkpoint directory that also holds one valid shard, and the weights of the
// "tiny" preset model are loaded from it, so the index's weight_map is checked against the shard
// files present and the tensors they hold.
#include <filesystem>
#include <vector>

#include "engine/tensor.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/params.h"
#include "model/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

constexpr const char* kShardName = "model-00001-of-00002.safetensors";

// The checkpoint directory with one shard holding the final norm's weight, made once per process.
const std::string& checkpoint_dir() {
  static const std::string dir = [] {
    const std::string path = cw::fuzz::scratch_dir() + "/checkpoint";
    std::filesystem::create_directories(path);
    const cw::LlamaConfig config = cw::LlamaConfig::preset("tiny");
    std::vector<float> norm(static_cast<size_t>(config.hidden_size), 1.0f);
    cw::write_safetensors(path + "/" + kShardName,
                          {{"model.norm.weight", cw::Tensor(norm.data(), cw::DType::f32, cw::Device::host(),
                                                            {config.hidden_size})}});
    return path;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cw;
  static ParamSet params(LlamaConfig::preset("tiny"), DType::f32);
  const std::string& dir = checkpoint_dir();
  fuzz::write_scratch_file("checkpoint/model.safetensors.index.json", {reinterpret_cast<const char*>(data), size});
  fuzz::refuse_quietly([&] { (void)load_checkpoint_weights(params, dir); });
  return 0;
}
