// transformers' own models as test oracles (tests/data/*_reference.py): a checkpoint directory that
// save_pretrained wrote and beside it expected.safetensors with the token ids [B, T], transformers'
// logits [B*T, V], its causal-LM loss [1] and every parameter's gradient ("grad.<HF name>"), all
// float64. compare_with_transformers runs chunkwise on the same ids: the logits through `chunkwise
// logits`' path (the sequence in chunks against the K/V store) and the loss and gradients under each
// given schedule, CHECKs each within kHfF64Tol and returns the worst relative error. Beside it the
// check of a family's refusals of config.json keys.
#pragma once

#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "optim/schedule.h"
#include "tests/model/gguf_builder.h"
#include "tests/support.h"
#include "tools/model_io.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

namespace cw::test {

// transformers in f64 with its float32 RMSNorm and RoPE angles patched to f64 (the reference scripts)
// against chunkwise in f64: the same math summed in other orders, through a softmax and 2 layers.
constexpr double kHfF64Tol = 1e-12;

inline std::filesystem::path hf_reference_dir(const char* set, const char* name) {
  return std::filesystem::path(CW_SOURCE_ROOT) / "tests" / "data" / set / name;
}

inline OwnedTensor read_tensor(const SafetensorsReader& r, const std::string& name, DType dtype = DType::f64) {
  const SafetensorsEntry* e = r.find(name);
  REQUIRE_MESSAGE(e != nullptr, name);
  OwnedTensor t = OwnedTensor::of_shape(dtype, e->shape);
  r.read_into(name, t);
  return t;
}

// The logits alone, as chunkwise computes them from the checkpoint `dir` for expected's ids: their
// relative L2 difference from transformers'.
inline Worst logits_against_transformers(const std::string& dir, const SafetensorsReader& expected,
                                         int64_t chunk) {
  const OwnedTensor ids = read_tensor(expected, "ids", DType::i32);
  const int64_t B = ids.tensor.size(0), T = ids.tensor.size(1);
  const int32_t* id = ids.tensor.ptr<int32_t>();
  TempDir tmp("hf-logits");
  std::vector<uint32_t> ids_u32(id, id + B * T);
  write_file(tmp, "ids.u32", bytes_of(ids_u32));
  LogitsOptions lo;
  lo.model = dir;
  lo.tokens = tmp.file("ids.u32");
  lo.batch = B;
  lo.seq = T;
  lo.dtype = "f64";
  lo.chunk = chunk;
  lo.out = tmp.file("logits.safetensors");
  write_logits(lo);
  return compare(read_tensor(SafetensorsReader(lo.out), "logits"), read_tensor(expected, "logits"));
}

inline double compare_with_transformers(const std::string& dir, const std::vector<ScheduleOptions>& schedules,
                                        int64_t logits_chunk = 5) {
  const SafetensorsReader expected((std::filesystem::path(dir) / "expected.safetensors").string());
  const OwnedTensor ids = read_tensor(expected, "ids", DType::i32);
  const int64_t B = ids.tensor.size(0), T = ids.tensor.size(1);
  const int32_t* id = ids.tensor.ptr<int32_t>();
  double worst = 0;

  const Worst logits = logits_against_transformers(dir, expected, logits_chunk);
  INFO("logits: " << logits.str());
  CHECK(logits.rel <= kHfF64Tol);
  worst = std::max(worst, logits.rel);

  // HF's causal-LM loss: labels = the ids shifted.
  LlamaModel model(LlamaConfig::resolve(dir), DType::f64);
  CHECK(load_checkpoint_weights(model.params(), dir).empty());
  const Batch batch = causal_lm_batch(std::vector<int32_t>(id, id + B * T), B, T);
  const double hf_loss = read_tensor(expected, "loss").tensor.ptr<double>()[0];
  for (const ScheduleOptions& so : schedules) {
    CAPTURE(schedule_name(so.kind));
    CAPTURE(so.chunk);
    CAPTURE(so.bwd_chunk);
    ParamSet grads(model.config(), DType::f64);
    const StepStats st = Schedule::create(so)->step(model, batch, grads);
    CHECK(std::abs(st.loss - hf_loss) <= kHfF64Tol * hf_loss);
    worst = std::max(worst, std::abs(st.loss - hf_loss) / hf_loss);
    for (size_t i = 0; i < grads.size(); ++i) {
      const std::string& tensor = grads.specs()[i].name;
      CAPTURE(tensor);
      const Worst w = compare(grads[i], read_tensor(expected, "grad." + tensor));
      INFO(w.str());
      CHECK(w.rel <= kHfF64Tol);
      worst = std::max(worst, w.rel);
    }
  }
  return worst;
}

// A config.json that asks for what chunkwise does not compute: `base` with each case's patch merged
// must be refused in one line naming the file and saying `message`.
struct ConfigRefusal {
  const char* what;
  nlohmann::json patch;
  const char* message;
};
inline void check_config_refusals(const nlohmann::json& base, const std::vector<ConfigRefusal>& cases) {
  for (const ConfigRefusal& c : cases) {
    CAPTURE(c.what);
    nlohmann::json j = base;
    j.merge_patch(c.patch);
    const std::string message = error_of([&] { LlamaConfig::from_json(j, "model/config.json"); });
    INFO(message);
    CHECK(contains(message, "model/config.json"));
    CHECK(contains(message, c.message));
    CHECK(!contains(message, "\n"));
  }
}

}  // namespace cw::test
