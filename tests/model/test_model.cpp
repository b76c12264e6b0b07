// The whole tiny Llama: fp64 gradients along random directions against finite differences (tied and
// untied embeddings, GQA 2:1, llama3, yarn and dynamic RoPE scaling), f32 against f64, the chunk-against-cache
// forward equal to the whole-sequence forward, and the RoPE tables ensure_positions keeps.
#include "model/llama.h"
#include "optim/schedule.h"
#include "tests/support.h"
#include "tools/gradcheck.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>
#include <tuple>

using namespace cw;

namespace {

// f32 rounding accumulated through two layers and a softmax over 61 classes.
constexpr double kF32ModelTol = 1e-4;
}  // namespace

TEST_CASE("tiny model fp64 gradients match finite differences (untied and tied)") {
  for (int tied : {0, 1}) {
    GradcheckOptions o;
    o.model = "tiny";
    o.seq = 16;
    o.batch = 2;
    o.tie_embeddings = tied;
    std::ostringstream out;
    const int rc = run_gradcheck(o, out);
    INFO(out.str());
    CHECK(rc == 0);
    CHECK(test::max_rel_err(out.str()) <= test::kFiniteDifferenceTol);
  }
}

TEST_CASE("tiny model f32 gradients track f64") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  LlamaModel m64(cfg, DType::f64), m32(cfg, DType::f32);
  init_parameters(m64.params(), 5, cfg.initializer_range, 0.1);
  copy_convert(m32.params().flat(), m64.params().flat());
  const Batch batch = random_batch(2, 24, cfg.vocab_size, 6);
  ParamSet g64(cfg, DType::f64), g32(cfg, DType::f32);
  ScheduleOptions full;
  const double l64 = Schedule::create(full)->step(m64, batch, g64).loss;
  const double l32 = Schedule::create(full)->step(m32, batch, g32).loss;
  CHECK(l32 == doctest::Approx(l64).epsilon(1e-6));
  for (size_t i = 0; i < g64.size(); ++i) {
    const test::Worst w = test::compare(g32[i], g64[i]);
    INFO(g64.specs()[i].name, ": ", w.str());
    CHECK(w.rel < kF32ModelTol);
  }
}

TEST_CASE("chunked forward with the K/V store equals the whole-sequence forward") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 7, cfg.initializer_range, 0.1);
  const int64_t B = 2, T = 40;  // past the llama3 scaling's original context of 32
  const Batch batch = random_batch(B, T, cfg.vocab_size, 8);
  model.ensure_positions(T);
  Arena arena;
  KVStore kv_full(cfg, B, T, DType::f64), kv_chunks(cfg, B, T, DType::f64);
  OwnedTensor whole(DType::f64, {B * T, cfg.vocab_size});
  chunk_logits(whole, kv_full, model, slice_chunk(batch, 0, T, arena), true, arena);
  const std::vector<int64_t> bounds = chunk_bounds(T, 7);
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const int64_t s = bounds[i], c = bounds[i + 1] - s;
    ArenaScope scope(arena);
    OwnedTensor part(DType::f64, {B * c, cfg.vocab_size});
    chunk_logits(part, kv_chunks, model, slice_chunk(batch, s, s + c, arena), true, arena);
    for (int64_t b = 0; b < B; ++b) {
      const test::Worst w = test::compare(part.tensor.slice(0, b * c, c), whole.tensor.slice(0, b * T + s, c));
      INFO("chunk at ", s, " sequence ", b, ": ", w.str());
      CHECK(w.rel < test::kSameMathF64Tol);
    }
  }
  // The loss through chunks equals the loss in one piece.
  CHECK(batch_loss(model, batch, 7, arena) == doctest::Approx(batch_loss(model, batch, 0, arena)).epsilon(1e-14));
  // The store placed as a schedule places it: streamed in blocks of 7, or a window of one layer.
  ScheduleOptions streamed;
  streamed.kind = ScheduleKind::seco;
  streamed.chunk = 7;
  streamed.stream_kv = true;
  CHECK(batch_loss(model, batch, streamed, arena) == doctest::Approx(batch_loss(model, batch, 0, arena)).epsilon(1e-14));
  ScheduleOptions windowed = streamed;
  windowed.stream_kv = false;
  windowed.offload_window = 1;
  CHECK(batch_loss(model, batch, windowed, arena) == doctest::Approx(batch_loss(model, batch, 0, arena)).epsilon(1e-14));
}

TEST_CASE("K/V store: its options as applied, the ones a schedule compares to keep its store") {
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.num_hidden_layers = 4;  // a streamed store's three device slots need three (layer, block) items
  const int64_t L = cfg.num_hidden_layers, T = 12;
  // A window of every layer is no offload; a stream block longer than the sequence is the sequence.
  CHECK(KVStore(cfg, 1, T, DType::f64, {.with_grads = true, .offload_window = L}).options().offload_window == 0);
  CHECK(KVStore(cfg, 1, T, DType::f64, {.with_grads = true, .stream_block = 2 * T}).options().stream_block == T);
  // Layer-local gradients need gradients.
  CHECK_FALSE(KVStore(cfg, 1, T, DType::f64, {.layer_local_grads = true}).options().layer_local_grads);
  const KVStoreOptions saved{.with_grads = true, .offload_window = 1, .attention_outputs = true};
  CHECK(KVStore(cfg, 2, T, DType::f64, saved).options() == saved);
  // Each mode's combination that cannot be is one line naming the option.
  CHECK_THROWS_WITH_AS(KVStore(cfg, 1, T, DType::f64, {.attention_outputs = true}),
                       doctest::Contains("gradient accumulators"), Error);
  CHECK_THROWS_WITH_AS(KVStore(cfg, 1, T, DType::f64, {.with_grads = true, .offload_window = 1, .stream_block = 4}),
                       doctest::Contains("offload_window = 0 with stream_kv"), Error);
  CHECK_THROWS_WITH_AS(KVStore(cfg, 1, T, DType::f64, {.with_grads = true, .stream_block = 4, .layer_inputs = true}),
                       doctest::Contains("schedule.save_inputs with stream_kv"), Error);
}

TEST_CASE("causal-LM labels: shifted by one, last position ignored") {
  const Batch b = causal_lm_batch({5, 6, 7, 8, 1, 2, 3, 4}, 2, 4);
  const int32_t* lab = b.labels.tensor.ptr<int32_t>();
  CHECK(lab[0] == 6);
  CHECK(lab[2] == 8);
  CHECK(lab[3] == -100);
  CHECK(lab[4] == 2);
  CHECK(b.supervised() == 6);
  const Batch w = window_batch({1, 2, 3, 4, 5, 6, 7, 8}, 2, 3);
  CHECK(w.ids.tensor.ptr<int32_t>()[3] == 5);
  CHECK(w.labels.tensor.ptr<int32_t>()[3] == 6);
  CHECK(w.supervised() == 6);
}

TEST_CASE("cast_layers: blocks rounded from the master as they run give the resident copy's bits in every schedule") {
  // The same master rounded to f32 once into a resident copy, or block by block into two slots as
  // the chunks reach them: the same weights, so the same loss and gradients, bit for bit.
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.num_key_value_heads = 2;
  cfg.num_hidden_layers = 3;
  ParamSet master(cfg, DType::f64);
  init_parameters(master, 31, cfg.initializer_range, 0.1);
  LlamaModel resident(cfg, DType::f32);
  copy_params(resident.params(), master);
  LlamaModel cast(cfg, DType::f32, Device::host(), nullptr, {}, /*cast_layers=*/true);
  CHECK(cast.params().size() == 3);  // the embedding, the final norm, the untied head
  CHECK(cast.weights().layers.empty());
  CHECK_THROWS_WITH_AS(cast.layer(0), doctest::Contains("cast_layers_from"), Error);
  copy_params_by_name(cast.params(), master);
  cast.cast_layers_from(master);
  CHECK(same_table(cast.trainable_table(), parameter_table(cfg)));
  const Batch batch = random_batch(2, 24, cfg.vocab_size, 5);
  ParamSet g_resident(cfg, DType::f32), g_cast(cfg, cast.trainable_table(), DType::f32);
  for (const ScheduleKind kind :
       {ScheduleKind::full, ScheduleKind::checkpointed, ScheduleKind::seco, ScheduleKind::spaco}) {
    for (const RecomputeMode recompute : {RecomputeMode::none, RecomputeMode::full}) {
      ScheduleOptions o;
      o.kind = kind;
      o.recompute = kind == ScheduleKind::checkpointed ? RecomputeMode::full : recompute;
      if (o.kind == ScheduleKind::seco || o.kind == ScheduleKind::spaco) o.chunk = 8;
      if (o.kind == ScheduleKind::spaco) o.keep = 2, o.seed = 4;
      CAPTURE(schedule_name(kind));
      CAPTURE(recompute_name(recompute));
      g_resident.zero();
      g_cast.zero();
      const double loss_resident = Schedule::create(o)->step(resident, batch, g_resident).loss;
      const double loss_cast = Schedule::create(o)->step(cast, batch, g_cast).loss;
      CHECK(loss_cast == loss_resident);
      for (size_t i = 0; i < g_cast.size(); ++i) CHECK(test::compare(g_cast[i], g_resident[i]).max_abs == 0.0);
    }
  }
  // A changed master reaches the blocks once the model is told.
  fill(master.get("model.layers.1.self_attn.q_proj.weight"), 0.0);
  copy_params(resident.params(), master);
  cast.master_changed();
  CHECK(test::compare(cast.layer(1).wq, resident.params().layer(1).wq).max_abs == 0.0);
  // LoRA's base has no master to cast from.
  LoraConfig lora;
  lora.rank = 2;
  CHECK_THROWS_WITH_AS(LlamaModel(cfg, DType::f32, Device::host(), nullptr, lora, true), doctest::Contains("LoRA"),
                       Error);
}

TEST_CASE("tiny model with yarn and dynamic RoPE: fp64 gradients match finite differences") {
  // Scalings that bite at 16 tokens: yarn from an original 8 (its attention factor scales q.k),
  // dynamic above max_position_embeddings 8 (the tables of the batch's length).
  RopeScaling yarn{.type = RopeScaling::Type::yarn, .factor = 4.0, .original_max_position = 8};
  yarn.mscale = 1.0;
  yarn.mscale_all_dim = 0.5;
  const RopeScaling dynamic{.type = RopeScaling::Type::dynamic, .factor = 2.0, .original_max_position = 8};
  test::TempDir dir("rope-model");
  for (const auto& [name, scaling, max_positions] : {std::tuple{"yarn", yarn, 32}, std::tuple{"dynamic", dynamic, 8}}) {
    CAPTURE(std::string(name));
    LlamaConfig cfg = LlamaConfig::preset("tiny");
    cfg.rope_scaling = scaling;
    cfg.max_position_embeddings = max_positions;
    GradcheckOptions o;
    o.model = dir.file(std::string(name) + ".json");
    std::ofstream(o.model) << cfg.to_json().dump();
    o.seq = 16;
    o.batch = 2;
    std::ostringstream out;
    const int rc = run_gradcheck(o, out);
    INFO(out.str());
    CHECK(rc == 0);
    CHECK(test::max_rel_err(out.str()) <= test::kFiniteDifferenceTol);
  }
}

TEST_CASE("ensure_positions: tables grow; dynamic RoPE's are rebuilt for each length above the original") {
  auto rows = [](const LlamaModel& m) { return m.rope_cos().size(0); };
  auto table_of = [](const LlamaConfig& cfg, int64_t n) {
    OwnedTensor cos(DType::f64, {n, cfg.head_dim / 2}), sin(DType::f64, {n, cfg.head_dim / 2});
    rope_tables(cos, sin, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling);
    return cos;
  };
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  LlamaModel plain(cfg, DType::f64);
  const int64_t built = rows(plain);
  plain.ensure_positions(40);
  CHECK(rows(plain) == std::max<int64_t>(built, 40));  // llama3: a longer table serves every length
  plain.ensure_positions(built + 1);
  CHECK(rows(plain) == built + 1);

  cfg.max_position_embeddings = 8;
  cfg.rope_scaling = {.type = RopeScaling::Type::dynamic, .factor = 2.0, .original_max_position = 8};
  LlamaModel dyn(cfg, DType::f64);
  for (const int64_t n : {40, 20, 5, 8, 3}) {
    CAPTURE(n);
    dyn.ensure_positions(n);
    // The sequence's own length above 8; at most 8: any table of at most 8 rows that covers n.
    const int64_t want = n > 8 ? n : (n == 3 ? 8 : n);
    CHECK(rows(dyn) == want);
    CHECK(test::compare(dyn.rope_cos(), table_of(cfg, want)).max_abs == 0.0);
  }
}
