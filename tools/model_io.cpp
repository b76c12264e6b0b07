#include "tools/model_io.h"

#include "engine/engine.h"
#include "model/checkpoint.h"
#include "model/gguf_llama.h"
#include "model/lora.h"
#include "model/memory_need.h"
#include "model/safetensors.h"
#include "tools/data/tokenizer.h"
#include "tools/train/run_config.h"
#include "tools/train/run_dir.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <iostream>

namespace cw {

namespace fs = std::filesystem;

Batch read_token_batch(const std::string& path, int64_t B, int64_t T, int64_t vocab) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(fmt::format("cannot open token file '{}'", path), "check the path");
  const int64_t n = B * T;
  const auto size = fs::file_size(path);
  if (size != static_cast<uintmax_t>(n) * 4)
    fail(fmt::format("{}: {} bytes, expected {} (batch {} x seq {} little-endian uint32 ids)", path, size, n * 4, B, T),
         "pass --batch and --seq matching the file");
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    unsigned char b[4];
    in.read(reinterpret_cast<char*>(b), 4);
    const uint32_t id = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
    if (id >= static_cast<uint64_t>(vocab))
      fail(fmt::format("{}: token {} at byte offset {} is not below vocab_size {}", path, id, i * 4, vocab),
           "the tokens must come from the model's tokenizer");
    ids[static_cast<size_t>(i)] = static_cast<int32_t>(id);
  }
  return causal_lm_batch(ids, B, T);
}

namespace {
// The weights of `config` against the host's memory (in `host_dtype`) and on a GPU the device's (in
// `dtype`) before any is allocated (model/memory_need.h); `name` is the model as the user gave it.
void require_model_memory(const LlamaConfig& config, const std::string& name, DType host_dtype, Device device,
                          DType dtype, const std::string& task) {
  require_memory(model_memory_need(config, host_dtype, device, dtype), device,
                 {.model = fmt::format("model '{}'", name),
                  .parameters = config.parameter_count(),
                  .task = task,
                  .advice = device.is_cpu() ? "use a smaller model or a machine with more memory"
                                            : "use a smaller model or a machine with more memory, or the CPU "
                                              "(--device cpu) where the host holds it"});
}
}  // namespace

void load_or_init(LlamaModel& model, const std::string& spec, uint64_t seed, double norm_jitter) {
  if (is_checkpoint_dir(spec))
    load_checkpoint_weights(model.params(), spec);
  else if (is_gguf_file(spec))
    load_gguf_weights(model.params(), GgufReader(spec));
  else
    init_parameters(model.params(), seed, model.config().initializer_range, norm_jitter);
}

void init_checkpoint(const InitOptions& o) {
  if (o.out.empty()) fail("chunkwise init needs --out DIR");
  LlamaConfig cfg = LlamaConfig::resolve(o.model);
  if (o.tie_embeddings >= 0) cfg.tie_word_embeddings = o.tie_embeddings == 1;
  require_model_memory(cfg, o.model, DType::f64, Device::host(), DType::f64, "to initialise in f64");
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), o.seed, cfg.initializer_range, o.norm_jitter);
  save_checkpoint_weights(model.params(), cfg, o.out, parse_dtype(o.dtype));
}

LlamaModel load_with_adapter(const LlamaConfig& config, const std::string& spec, const std::string& adapter_dir,
                             DType dtype, uint64_t seed) {
  const LoraConfig lora = read_peft_config(adapter_dir);
  LlamaModel model(config, dtype, Device::host(), nullptr, lora);
  load_or_init(model, spec, seed, 0.0);
  load_peft_adapter(model.adapters(), adapter_dir);
  return model;
}

void merge_adapter_checkpoint(const MergeOptions& o) {
  if (o.out.empty() || o.adapter.empty()) fail("chunkwise merge needs --adapter DIR and --out DIR");
  const LlamaConfig cfg = LlamaConfig::resolve(o.model);
  require_model_memory(cfg, o.model, DType::f64, Device::host(), DType::f64, "to merge in f64");
  LlamaModel model = load_with_adapter(cfg, o.model, o.adapter, DType::f64, o.seed);
  merge_adapters(model.params(), model.adapters(), model.lora());
  save_checkpoint_weights(model.params(), cfg, o.out, parse_dtype(o.dtype));
}

void write_logits(const LogitsOptions& o) {
  if (o.out.empty()) fail("chunkwise logits needs --out FILE");
  const LlamaConfig cfg = LlamaConfig::resolve(o.model);
  const DType dt = parse_dtype(o.dtype);
  require_model_memory(cfg, o.model, dt, Device::host(), dt, "to load");
  LlamaModel model = o.adapter.empty() ? LlamaModel(cfg, dt) : load_with_adapter(cfg, o.model, o.adapter, dt, o.seed);
  if (o.adapter.empty()) load_or_init(model, o.model, o.seed, 0.0);
  const Batch batch = read_token_batch(o.tokens, o.batch, o.seq, cfg.vocab_size);
  const int64_t B = o.batch, T = o.seq, V = cfg.vocab_size;
  model.ensure_positions(T);
  KVStore kv(cfg, B, T, dt);
  Arena arena;
  OwnedTensor logits(dt, {B * T, V});
  for (const int64_t s : [&] {
         std::vector<int64_t> b = chunk_bounds(T, o.chunk);
         b.pop_back();
         return b;
       }()) {
    ArenaScope scope(arena);
    const int64_t e = std::min(T, s + (o.chunk > 0 ? o.chunk : T));
    const ChunkTokens chunk = slice_chunk(batch, s, e, arena);
    Tensor part = arena.alloc(dt, {B * (e - s), V});
    chunk_logits(part, kv, model, chunk, true, arena);
    for (int64_t b = 0; b < B; ++b)
      copy_convert(logits.tensor.slice(0, b * T + s, e - s), part.slice(0, b * (e - s), e - s));
  }
  write_safetensors(o.out, {{"logits", logits.tensor}},
                    {{"model", o.model}, {"tokens", o.tokens}, {"adapter", o.adapter}});
}

namespace {
// The host model read from `spec` (see load_or_init) in `dtype`, with the adapters of `adapter_dir`
// when it is not empty.
LlamaModel host_model(const LlamaConfig& config, const std::string& spec, const std::string& adapter_dir, DType dtype,
                      uint64_t seed) {
  if (!adapter_dir.empty()) return load_with_adapter(config, spec, adapter_dir, dtype, seed);
  LlamaModel model(config, dtype);
  load_or_init(model, spec, seed, 0.0);
  return model;
}

// The host model on `device` in `dtype`: itself when it is there already, else a copy (weights
// converted as copy_params converts them).
std::unique_ptr<LlamaModel> placed(LlamaModel host, Device device, DType dtype) {
  if (device.is_cpu() && host.dtype() == dtype) return std::make_unique<LlamaModel>(std::move(host));
  auto model = std::make_unique<LlamaModel>(host.config(), dtype, device, nullptr, host.lora());
  copy_params(model->params(), host.params());
  if (host.has_adapters()) copy_params(model->adapters(), host.adapters());
  return model;
}
}  // namespace

namespace {
// `cf` with --rope's scaling in place of its own (none given: `cf`).
LlamaConfig with_rope_flags(const LlamaConfig& cf, const ModelSource& source, const std::string& name) {
  if (source.rope.empty()) return cf;
  const RunConfig::Rope rope = rope_from_assignments(source.rope, "--rope");
  return with_rope(cf, rope, fmt::format("'{}' with --rope type={}", name, rope.type));
}
}  // namespace

LoadedModel load_model(const ModelSource& source, Device device, DType dtype, const ModelNeeds& needs,
                       const std::string& what) {
  // Weights are read on the host in the compute dtype when the model stays there, else in f32 (the
  // readers convert from what the file stores) and then copied to the device.
  const DType host_dtype = device.is_cpu() ? dtype : DType::f32;
  LoadedModel out;
  std::string tokenizer_spec;
  if (!source.run.empty()) {
    const std::string& dir = source.run;
    if (!fs::is_directory(dir))
      fail(fmt::format("run directory '{}' does not exist", dir), "pass the --run-dir of a training run");
    if (source.step < 0)
      fail(fmt::format("--step must be >= 0 (0: the latest complete checkpoint), got {}", source.step),
           "give a saved step, or leave --step out");
    RunDirectory rd(dir);
    // Which checkpoint is read, and every newer one passed over with its reason, go to stderr: a
    // damaged latest checkpoint must not silently give an older model.
    std::vector<std::string> skipped;
    std::string why;
    const std::optional<CheckpointRef> ref =
        source.step > 0 ? rd.find(source.step, &why) : rd.latest_complete(&skipped);
    for (const std::string& s : skipped) std::cerr << "chunkwise: skipped " << s << "\n";
    if (!ref)
      fail(source.step > 0 ? fmt::format("run '{}' has no complete checkpoint of step {}{}", dir, source.step,
                                         why.empty() ? "" : " (" + why + ")")
                           : fmt::format("run '{}' has no complete checkpoint", dir),
           "train first, or pick a step that was saved");
    std::cerr << fmt::format("chunkwise: {} step {} ({}{})\n", what, ref->step, ref->path,
                             source.step > 0 ? "" : ", the latest complete checkpoint");
    out.name = ref->path;
    // The run directory holds a copy of the tokenizer it was trained with (train.cpp writes it).
    tokenizer_spec =
        source.tokenizer.empty() ? dir : resolve_tokenizer_spec(source.tokenizer, ref->path, "--tokenizer");
    if (fs::exists(fs::path(ref->path) / "adapter_config.json")) {
      // A LoRA run: its adapters on the base it trained on (model.source of the checkpoint's run.toml).
      const RunConfig rc = RunConfig::from_file((fs::path(ref->path) / "run.toml").string());
      const LlamaConfig cf = with_rope_flags(rc.model_config(), source, ref->path);  // the run's overrides on its base
      require_model_memory(cf, rc.model.source, host_dtype, device, dtype, "to load");
      out.model = placed(host_model(cf, rc.model.source, ref->path, host_dtype, rc.model.init_seed), device, dtype);
    } else {
      if (!is_checkpoint_dir(ref->path))
        fail(fmt::format("checkpoint '{}' has no weights (model.safetensors)", ref->path),
             "pick another step (--step), or train again");
      const LlamaConfig cf =
          with_rope_flags(LlamaConfig::from_file((fs::path(ref->path) / "config.json").string()), source, ref->path);
      require_model_memory(cf, ref->path, host_dtype, device, dtype, "to load");
      out.model = placed(host_model(cf, ref->path, "", host_dtype, 0), device, dtype);
    }
  } else {
    const std::string& spec = source.model;
    if (needs.weights && !is_gguf_file(spec) && !is_checkpoint_dir(spec))
      fail(fmt::format("--model '{}' has no weights to {} (a preset or config.json is a random model)", spec, what),
           "give an HF checkpoint directory (config.json + model.safetensors) or a .gguf file");
    out.name = spec;
    if (needs.tokenizer)
      tokenizer_spec = resolve_tokenizer_spec(source.tokenizer.empty() ? kModelTokenizer : source.tokenizer, spec,
                                              "--tokenizer");
    const LlamaConfig cf = with_rope_flags(LlamaConfig::resolve(spec), source, spec);
    require_model_memory(cf, spec, host_dtype, device, dtype, "to load");
    out.model = placed(host_model(cf, spec, "", host_dtype, source.seed), device, dtype);
  }
  if (needs.tokenizer) {
    out.tokenizer = load_tokenizer(tokenizer_spec);
    check_tokenizer_fits_model(*out.tokenizer, tokenizer_spec, out.model->config().vocab_size, out.name,
                               "--tokenizer");
    out.tokenizer_spec = tokenizer_spec;
  }
  return out;
}

namespace {
// A setting as written: "--device cuda" (a flag) or "train.device = cuda" (a run-config key).
std::string written(const std::string& name, const std::string& value) {
  return name.rfind("--", 0) == 0 ? name + " " + value : name + " = " + value;
}
}  // namespace

Device resolve_device(const std::string& setting, const std::string& name) {
  if (setting == "cpu") return Device::host();
  if (setting == "cuda") {
    if (!gpu_available())
      fail(written(name, "cuda") + " but no GPU is usable (this build has no CUDA, or the driver sees no device)",
           "use " + written(name, "cpu") + " (or auto)");
    return Device::gpu(0);
  }
  if (setting != "auto") fail(fmt::format("{}: unknown device", written(name, setting)), "use auto, cpu or cuda");
  return gpu_available() ? Device::gpu(0) : Device::host();
}

DType resolve_compute_dtype(const std::string& setting, Device device, const std::string& name,
                            const std::string& device_name) {
  if (setting == "auto") return device.is_cpu() ? DType::f32 : DType::bf16;
  const DType dt = parse_dtype(setting);
  if (dt == DType::bf16 && device.is_cpu())
    fail(written(name, "bf16") + " needs the GPU backend", "use " + written(name, "f32") + " (or f64, or auto) on the CPU");
  if (dt == DType::f64 && !device.is_cpu())
    fail(written(name, "f64") + " runs on the CPU only",
         "use bf16 or f32 on the GPU, or " + written(device_name, "cpu"));
  return dt;
}

}  // namespace cw
