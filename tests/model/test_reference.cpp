// The reference step (model/reference.h): first its own gradients against central finite differences
// of its own loss, which proves it without the engine; then every schedule against it within 1e-12
// in f64 (GQA, tied and untied embeddings, llama3, yarn and dynamic RoPE, packed documents, LoRA, Qwen2's
// biases, Qwen3's per-head norms, Mistral's sliding window, Gemma 2's block); then the CLI's
// `gradcheck --against reference`.
#include "engine/ops/lm_head_loss.h"
#include "engine/random.h"
#include "model/lora.h"
#include "model/reference.h"
#include "optim/schedule.h"
#include "tests/support.h"

#include <cmath>
#include <memory>

using namespace cw;

namespace {

// A tiny model and batch with the features a case turns on. The preset is GQA (4 heads, 2 K/V
// heads) with llama3 RoPE that acts at these lengths, untied.
struct Case {
  const char* name;
  bool tied = false;
  RopeScaling::Type rope = RopeScaling::Type::llama3;  // the preset's; yarn and dynamic made to act at T = 13
  std::vector<std::vector<int64_t>> documents;  // per sequence; empty: one document each
  bool document_positions = true;
  const char* lora_targets = nullptr;  // adapters of rank 2 on these linears; null: none
  const char* preset = "tiny";         // tiny-qwen2 (q/k/v biases, tied), tiny-qwen3 (per-head q/k norms),
                                       // tiny-mistral (a sliding window of 5 keys), tiny-gemma2 (Gemma 2's
                                       // block: a sliding and a global layer, capped scores and logits)
  bool attention_bias = false;         // Llama's / Qwen3's: biases on q, k, v and o_proj
};

struct Setup {
  LlamaConfig cfg;
  std::unique_ptr<LlamaModel> model;
  Batch batch;
};

constexpr int64_t kBatch = 2, kTokens = 13;  // 13: no chunk length below divides it

Setup setup(const Case& c, uint64_t seed) {
  LlamaConfig cfg = LlamaConfig::preset(c.preset);
  cfg.tie_word_embeddings = cfg.tie_word_embeddings || c.tied;
  if (c.attention_bias) cfg.attention_bias = cfg.o_bias = true;
  if (c.rope != RopeScaling::Type::llama3)
    cfg.rope_scaling = RopeScaling{.type = c.rope, .factor = 4.0, .original_max_position = 8};
  if (c.rope == RopeScaling::Type::dynamic) cfg.max_position_embeddings = 8;  // dynamic scales from it
  Setup s{cfg, nullptr, random_batch(kBatch, kTokens, cfg.vocab_size, seed + 1)};
  LoraConfig lora;
  if (c.lora_targets) lora = LoraConfig{.rank = 2, .alpha = 5.0, .dropout = 0.0, .targets = c.lora_targets, .seed = 3};
  s.model = std::make_unique<LlamaModel>(s.cfg, DType::f64, Device::host(), nullptr, lora);
  init_parameters(s.model->params(), seed, s.cfg.initializer_range, 0.1);
  // B drawn rather than PEFT's zero, so that A's gradient is not zero.
  if (c.lora_targets) init_lora_parameters(s.model->adapters(), 3, 0.05);
  int32_t* labels = s.batch.labels.tensor.ptr<int32_t>();
  labels[3] = labels[kTokens + 8] = kIgnoreLabel;  // a few positions without loss
  if (!c.documents.empty()) set_documents(s.batch, c.documents, c.document_positions);
  return s;
}

ReferenceResult reference(const Setup& s) {
  return reference_step(*s.model, s.batch.ids, s.batch.labels, s.batch.doc_starts, s.batch.document_positions);
}

const std::vector<std::vector<int64_t>> kDocuments{{0, 4, 5, 9}, {0, 7}};

}  // namespace

TEST_CASE("reference: its gradients against central finite differences of its loss (f64)") {
  const std::vector<Case> cases{
      {"GQA, llama3 RoPE, untied"},
      {"tied, yarn, packed documents", true, RopeScaling::Type::yarn, kDocuments},
      {"dynamic NTK, packed documents, absolute positions", false, RopeScaling::Type::dynamic, kDocuments, false},
      {"LoRA on every linear, documents", false, RopeScaling::Type::llama3, kDocuments, true, "all-linear"},
      {"qwen2: q/k/v biases, tied", false, RopeScaling::Type::llama3, {}, true, nullptr, "tiny-qwen2"},
      {"qwen3: per-head q/k norms, head_dim apart, documents", false, RopeScaling::Type::llama3, kDocuments, true,
       nullptr, "tiny-qwen3"},
      {"qwen3 with attention_bias: q, k, v and o_proj biases", false, RopeScaling::Type::llama3, {}, true, nullptr,
       "tiny-qwen3", true},
      {"mistral: a sliding window of 5 keys, documents", false, RopeScaling::Type::llama3, kDocuments, true, nullptr,
       "tiny-mistral"},
      {"gemma2: post-norms, (1 + w) norms, gelu, sqrt(C) embeddings, capped scores and logits, a sliding and a "
       "global layer, documents", false, RopeScaling::Type::llama3, kDocuments, true, nullptr, "tiny-gemma2"},
      {"gemma2 with attention_bias (o_proj's before the post-norm)", false, RopeScaling::Type::llama3, {}, true,
       nullptr, "tiny-gemma2", true},
  };
  double worst = 0;
  for (const Case& c : cases) {
    CAPTURE(c.name);
    Setup s = setup(c, 11);
    const ReferenceResult r = reference(s);
    CHECK(r.supervised == s.batch.supervised());
    CHECK(std::isfinite(r.loss));
    ParamSet& trained = s.model->trainable();
    REQUIRE(same_table(r.grads, trained));
    for (size_t i = 0; i < trained.size(); ++i) {
      const Tensor p = trained[i];
      OwnedTensor original = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{p.numel()});
      copy_convert(original, p.view({p.numel()}));
      for (uint64_t d = 0; d < 2; ++d) {
        OwnedTensor dir = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{p.numel()});
        fill_normal(dir, 77, i * 10 + d);
        const double* v = dir.tensor.ptr<double>();
        double norm = 0, gv = 0;
        for (int64_t k = 0; k < p.numel(); ++k) norm += v[k] * v[k];
        for (int64_t k = 0; k < p.numel(); ++k) gv += r.grads[i].ptr<double>()[k] * v[k] / std::sqrt(norm);
        const auto loss_at = [&](double t) {
          for (int64_t k = 0; k < p.numel(); ++k)
            p.ptr<double>()[k] = original.tensor.ptr<double>()[k] + t * v[k] / std::sqrt(norm);
          return reference(s).loss;
        };
        const double h = 1e-3;
        const double fd = (-loss_at(2 * h) + 8 * loss_at(h) - 8 * loss_at(-h) + loss_at(-2 * h)) / (12 * h);
        copy_convert(p.view({p.numel()}), original);
        CAPTURE(trained.specs()[i].name);
        INFO("g.v = " << gv << ", fd = " << fd);
        const double rel = std::abs(gv - fd) / std::max(std::abs(gv), std::abs(fd));
        CHECK(rel <= test::kFiniteDifferenceTol);
        worst = std::max(worst, rel);
      }
    }
  }
  MESSAGE("reference against finite differences: worst rel_err=", worst);
}

TEST_CASE("reference: every schedule's loss and gradients equal it within 1e-12 (f64)") {
  const std::vector<Case> cases{
      {"GQA, llama3 RoPE, untied"},
      {"tied embeddings"},
      {"yarn RoPE"},
      {"dynamic NTK RoPE (the frequencies of the batch's length)"},
      {"packed documents"},
      {"packed documents, absolute positions"},
      {"LoRA on q_proj, v_proj"},
      {"LoRA on every linear, tied, documents"},
      {"qwen2: q/k/v biases, tied"},
      {"qwen3: per-head q/k norms, head_dim apart"},
      {"qwen2, LoRA on every linear (biases frozen), documents"},
      {"qwen3, LoRA on q_proj, k_proj, v_proj"},
      {"llama with attention_bias: q, k, v and o_proj biases"},
      {"mistral: a sliding window of 5 keys (chunks of 3 to 6 against it)"},
      {"mistral, documents, LoRA on every linear"},
      {"gemma2: a sliding and a global layer, caps, post-norms"},
      {"gemma2, documents, LoRA on every linear"},
      {"gemma2 with attention_bias"},
  };
  std::vector<Case> configured = cases;
  configured[1].tied = true;
  configured[2].rope = RopeScaling::Type::yarn;
  configured[3].rope = RopeScaling::Type::dynamic;
  configured[4].documents = kDocuments;
  configured[5].documents = kDocuments;
  configured[5].document_positions = false;
  configured[6].lora_targets = "q_proj,v_proj";
  configured[7].lora_targets = "all-linear";
  configured[7].tied = true;
  configured[7].documents = kDocuments;
  configured[8].preset = configured[10].preset = "tiny-qwen2";
  configured[9].preset = configured[11].preset = "tiny-qwen3";
  configured[10].lora_targets = "all-linear";
  configured[10].documents = kDocuments;
  configured[11].lora_targets = "q_proj,k_proj,v_proj";
  configured[12].attention_bias = true;
  configured[13].preset = configured[14].preset = "tiny-mistral";
  configured[14].documents = kDocuments;
  configured[14].lora_targets = "all-linear";
  configured[15].preset = configured[16].preset = configured[17].preset = "tiny-gemma2";
  configured[16].documents = kDocuments;
  configured[16].lora_targets = "all-linear";
  configured[17].attention_bias = true;

  std::vector<ScheduleOptions> schedules(6);
  schedules[0].kind = ScheduleKind::full;
  schedules[1].kind = ScheduleKind::checkpointed;
  schedules[2].kind = ScheduleKind::seco;
  schedules[2].chunk = 5;  // chunks of 5, 5, 3; reverse chunks of 3 (4 of 3 and one of 1)
  schedules[2].bwd_chunk = 3;
  schedules[3].kind = ScheduleKind::seco;
  schedules[3].chunk = 4;
  schedules[3].save_inputs = true;  // the reverse sweep recomputes each layer from its saved input
  schedules[4].kind = ScheduleKind::spaco;  // keep 0: every chunk visited, its exact mode
  schedules[4].chunk = 4;
  schedules[5].kind = ScheduleKind::seco;
  schedules[5].chunk = 6;
  schedules[5].save_attention = true;  // the recompute reads attention outputs (and projects k for its norm)

  double worst = 0;
  for (const Case& c : configured) {
    const Setup s = setup(c, 5);
    const ReferenceResult ref = reference(s);
    for (const ScheduleOptions& so : schedules) {
      CAPTURE(c.name);
      CAPTURE(schedule_name(so.kind));
      CAPTURE(so.chunk);
      ParamSet grads = ParamSet::like(s.model->trainable(), DType::f64);
      const StepStats st = Schedule::create(so)->step(*s.model, s.batch, grads);
      CHECK(st.supervised == ref.supervised);
      CHECK(std::abs(st.loss - ref.loss) <= test::kSameMathF64Tol * ref.loss);
      worst = std::max(worst, std::abs(st.loss - ref.loss) / ref.loss);
      for (size_t i = 0; i < grads.size(); ++i) {
        const test::Worst w = test::compare(grads[i], ref.grads[i]);
        CAPTURE(grads.specs()[i].name);
        INFO(w.str());
        CHECK(w.rel <= test::kSameMathF64Tol);
        worst = std::max(worst, w.rel);
      }
    }
  }
  MESSAGE("every schedule against the reference: max_rel_err=", worst);
}

TEST_CASE("reference: refuses what it does not compute") {
  Setup s = setup({"dropout"}, 5);
  LlamaModel dropped(s.cfg, DType::f64, Device::host(), nullptr,
                     LoraConfig{.rank = 2, .alpha = 4.0, .dropout = 0.1, .targets = "q_proj", .seed = 1});
  CHECK(test::contains(test::error_of([&] { reference_step(dropped, s.batch.ids, s.batch.labels); }),
                       "give lora.dropout = 0"));
  CHECK(test::contains(test::error_of([&] {
                         reference_step(*s.model, s.batch.ids, s.batch.labels, {{0, 3}});
                       }),
                       "document starts for 1 sequences, the batch has 2"));
}

using test::max_rel_err;

TEST_CASE("the chunkwise binary: gradcheck --against reference") {
  std::string out;
  for (const char* args : {
           "--schedule seco --chunk 7 --bwd-chunk 5",
           "--schedule checkpointed --tie-embeddings 1",
           "--schedule spaco --chunk 6 --documents 10,1,20,1,11,21 --batch 2",
           "--schedule seco --chunk 5 --lora-rank 3 --lora-targets all-linear --documents 30,34",
       }) {
    CAPTURE(args);
    CHECK(test::run_cli(fmt::format("gradcheck --model tiny --seq 64 --dtype f64 {} --against reference", args), out) == 0);
    INFO(out);
    CHECK(test::contains(out, "against the reference step"));
    CHECK(max_rel_err(out) <= test::kSameMathF64Tol);
  }
  // An estimator (spaco visiting 2 of 8 chunks) is far from it: exit 1.
  CHECK(test::run_cli("gradcheck --model tiny --seq 32 --schedule spaco --chunk 4 --keep 2 --against reference", out) == 1);
  CHECK(test::contains(out, "FAIL: max_rel_err"));
  CHECK(test::run_cli("gradcheck --lora-rank 2 --lora-dropout 0.1 --against reference", out) == 2);
  CHECK(test::contains(out, "--against reference: the reference step has no dropout"));
  CHECK(out.find('\n') == out.size() - 1);  // one line
}
