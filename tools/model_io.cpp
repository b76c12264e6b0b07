#include "tools/model_io.h"

#include "model/checkpoint.h"
#include "model/gguf_llama.h"
#include "model/lora.h"
#include "model/safetensors.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>

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
  LlamaModel model = load_with_adapter(cfg, o.model, o.adapter, DType::f64, o.seed);
  merge_adapters(model.params(), model.adapters(), model.lora());
  save_checkpoint_weights(model.params(), cfg, o.out, parse_dtype(o.dtype));
}

void write_logits(const LogitsOptions& o) {
  if (o.out.empty()) fail("chunkwise logits needs --out FILE");
  const LlamaConfig cfg = LlamaConfig::resolve(o.model);
  const DType dt = parse_dtype(o.dtype);
  LlamaModel model = o.adapter.empty() ? LlamaModel(cfg, dt) : load_with_adapter(cfg, o.model, o.adapter, dt, o.seed);
  if (o.adapter.empty()) load_or_init(model, o.model, o.seed, 0.0);
  const Batch batch = read_token_batch(o.tokens, o.batch, o.seq, cfg.vocab_size);
  const int64_t B = o.batch, T = o.seq, V = cfg.vocab_size;
  model.ensure_positions(T);
  KVStore kv(cfg, B, T, dt, false);
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

}  // namespace cw
