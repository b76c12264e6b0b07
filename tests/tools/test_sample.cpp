// Sampling with a run's tokenizer (tools/train/sample.h, data.tokenizer): a BPE tokenizer through
// training, the run directory and its checkpoints; `sample --run` and `sample --model` agreeing;
// prompt ids, BOS and stop ids; chats (ChatML); a prompt prefilled in chunks against one chunk (f64);
// --prompt-file; tokenizer/model mismatches failing before step 1;
// eval and sample before the first step. With the real SmolLM2 GGUF in .models/: greedy
// continuations equal to HF transformers' (tests/data/smollm2_reference.json), a chat that stops at
// <|im_end|>, and a fine-tune whose exported checkpoint carries transformers' config and the tokenizer.
#include "engine/error.h"
#include "model/chat_template.h"
#include "model/checkpoint.h"
#include "model/gguf_llama.h"
#include "model/safetensors.h"
#include "tests/support.h"
#include "tests/tools/bpe_fixture.h"
#include "tools/data/tokenizer.h"
#include "tools/data/tokens.h"
#include "tools/train/run_dir.h"
#include "tools/train/sample.h"
#include "tools/train/train.h"

#include <doctest/doctest.h>
#include <sys/wait.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace cw {
namespace {

using test::contains;
using test::error_of;
using test::kSmolLm2Gguf;
using test::read_text;
using test::run_cli;

namespace fs = std::filesystem;
using Ids = std::vector<uint32_t>;

nlohmann::json read_json(const fs::path& p) { return nlohmann::json::parse(read_text(p)); }

void write_files(const fs::path& dir, const std::vector<std::pair<std::string, std::string>>& files) {
  fs::create_directories(dir);
  for (const auto& [name, text] : files) std::ofstream(dir / name, std::ios::binary) << text;
}

using test::kBpeVocab;
using test::test_bpe;
constexpr int64_t kModelVocab = 1152;  // the model pads to a multiple of 64: ids 1100.. are not tokens

// A small model for that vocabulary, its tokenizer as HF files, and a corpus tokenized with it.
struct BpeFixture {
  test::TempDir dir{"sample"};
  BpeTokenizer tokenizer{test_bpe()};
  LlamaConfig model;
  std::string model_json, tokenizer_dir, shard;
  BpeFixture() {
    model = LlamaConfig::preset("small");
    model.vocab_size = kModelVocab;
    model.hidden_size = 32;
    model.intermediate_size = 48;
    model.num_hidden_layers = 2;
    model.num_attention_heads = 4;
    model.num_key_value_heads = 2;
    model.head_dim = 8;
    model.bos_token_id = 264;
    model.eos_token_ids = {266};
    model_json = dir.file("model.json");
    std::ofstream(model_json) << model.to_json().dump(2);
    tokenizer_dir = dir.file("tokenizer");
    write_files(tokenizer_dir, tokenizer_files(tokenizer));
    std::string text;
    for (int i = 0; i < 150; ++i) text += "the quick brown fox jumps over the lazy dog. ";
    std::ofstream(dir.file("corpus.txt")) << text;
    shard = dir.file("corpus.bin");
    tokenize_files(tokenizer, {dir.file("corpus.txt")}, shard);
  }
  RunConfig config(int64_t steps) const {
    RunConfig rc = RunConfig::defaults();
    rc.model.source = model_json;
    rc.data.train = {shard};
    rc.data.tokenizer = tokenizer_dir;
    rc.data.seq_len = 24;
    rc.data.batch_size = 2;
    rc.schedule.chunk = 8;
    rc.train.steps = steps;
    rc.optimizer.warmup_steps = 1;
    rc.eval.every = 0;
    rc.eval.batches = 2;
    rc.checkpoint.every = 0;
    rc.log.plot = false;
    rc.sample.prompt = "the ";
    rc.sample.tokens = 6;
    rc.sample.temperature = 0;
    return rc;
  }
};

TEST_CASE("train with a BPE tokenizer: the run directory and its checkpoints keep it; sample --run decodes with it") {
  BpeFixture fx;
  TrainOptions o;
  o.run_dir = fx.dir.file("run");
  std::ostringstream log;
  run_training(fx.config(2), o, log);
  CHECK(contains(log.str(), "sample:\nthe "));

  // The run directory and the checkpoint hold HF's files, not the path they came from.
  const fs::path run(o.run_dir), ckpt = run / checkpoint_dir_name(2);
  CHECK(read_json(run / "tokenizer.json").contains("model"));
  CHECK(read_json(run / "tokenizer_config.json").at("eos_token") == "<|im_end|>");
  CHECK(read_text(ckpt / "tokenizer.json") == read_text(run / "tokenizer.json"));
  CHECK(fs::exists(ckpt / "tokenizer_config.json"));
  CHECK(read_json(ckpt / "state.json").at("tokenizer").at("name") == "bpe");
  fs::remove_all(fx.tokenizer_dir);  // the run does not need the source any more

  SampleOptions so;
  so.prompt = "the quick";
  so.tokens = 10;
  so.temperature = 0;
  so.stop_at_eos = false;
  const Generation from_run = sample_from_run(o.run_dir, 0, so);
  CHECK(from_run.prompt == fx.tokenizer.encode("the quick"));  // no BOS: this tokenizer adds none
  REQUIRE(from_run.generated.size() == 10);
  for (const uint32_t id : from_run.generated) CHECK(id < kBpeVocab);  // the padded rows never come out
  CHECK(from_run.text == fx.tokenizer.decode(from_run.generated));
  // The checkpoint as a model with its own tokenizer ("model"): the same greedy continuation.
  const Generation from_model = sample_from_model(ckpt.string(), so);
  CHECK(from_model.generated == from_run.generated);
  CHECK(from_model.text == from_run.text);
  // The run's closing sample is the same greedy computation.
  so.prompt = "the ";
  so.tokens = 6;
  so.stop_at_eos = true;
  CHECK(contains(log.str(), "sample:\nthe " + sample_from_run(o.run_dir, 0, so).text + "\n"));
}

TEST_CASE("data.tokenizer: \"model\", and mismatches that fail before step 1 naming both sides") {
  BpeFixture fx;
  TrainOptions o;
  o.run_dir = fx.dir.file("run");
  std::ostringstream log;
  RunConfig rc = fx.config(1);
  rc.data.tokenizer = "bytes";
  CHECK(error_of([&] { run_training(rc, o, log); }) ==
        fmt::format("the tokenizer 'bytes' has 258 tokens but the model '{}' has vocab_size 1152: they belong to "
                    "different models (hint: set data.tokenizer to \"model\" (the model's own tokenizer), or use a "
                    "model made for this tokenizer)",
                    fx.model_json));
  CHECK_FALSE(fs::exists(o.run_dir));  // nothing was started
  rc.data.tokenizer = "model";
  CHECK(contains(error_of([&] { run_training(rc, o, log); }),
            fmt::format("data.tokenizer = \"model\" but the model '{}' has no tokenizer", fx.model_json)));

  // An HF checkpoint directory with its tokenizer: "model" is that tokenizer.
  const std::string ckpt = fx.dir.file("ckpt");
  LlamaModel model(fx.model, DType::f32);
  init_parameters(model.params(), 5, fx.model.initializer_range, 0.0);
  save_checkpoint_weights(model.params(), fx.model, ckpt, DType::f32);
  write_files(ckpt, hf_tokenizer_files(fx.tokenizer));
  rc.model.source = ckpt;
  rc.sample.tokens = 3;
  const TrainResult r = run_training(rc, o, log);
  CHECK(r.last_step == 1);
  CHECK(read_json(fs::path(o.run_dir) / "tokenizer_config.json").at("bos_token") == "<|endoftext|>");

  SampleOptions so;
  so.tokens = 3;
  CHECK(sample_from_model(ckpt, so).generated.size() <= 3);
  CHECK(contains(error_of([&] { sample_from_run(o.run_dir, 0, so, "bytes"); }),
            "the tokenizer 'bytes' has 258 tokens but the model"));
  CHECK(contains(error_of([&] { sample_from_model("small", so); }), "--model 'small' has no weights"));
  CHECK(contains(error_of([&] { sample_from_model(fx.model_json, so); }), "has no weights"));
}


// An HF checkpoint directory of the fixture's model (random weights, seed 5) with its tokenizer.
std::string write_checkpoint(const BpeFixture& fx) {
  const std::string ckpt = fx.dir.file("ckpt");
  LlamaModel model(fx.model, DType::f32);
  init_parameters(model.params(), 5, fx.model.initializer_range, 0.0);
  save_checkpoint_weights(model.params(), fx.model, ckpt, DType::f32);
  write_files(ckpt, hf_tokenizer_files(fx.tokenizer));
  return ckpt;
}

// sample's output without the line it writes on stderr of what the prompt and the new tokens cost
// ("chunkwise: prompt of N tokens through the prefill in ..."): stdout holds the text alone.
std::string text_of(const std::string& out) {
  std::string kept;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("chunkwise: prompt of ", 0) != 0) kept += line + "\n";
  return kept;
}

TEST_CASE("chunkwise sample: --model, --chat, --tokenizer on the command line; bad combinations fail in one line") {
  BpeFixture fx;
  const std::string ckpt = write_checkpoint(fx);

  SampleOptions so;
  so.prompt = "the fox";
  so.tokens = 5;
  so.temperature = 0;
  std::string out;
  CHECK(run_cli(fmt::format("sample --model {} --prompt 'the fox' --tokens 5 --temperature 0 --device cpu", ckpt),
                out) == 0);
  CHECK(text_of(out) == "the fox" + sample_from_model(ckpt, so).text + "\n");  // the prompt, then its continuation
  CHECK(contains(out, fmt::format("chunkwise: prompt of {} tokens through the prefill in ",
                                  sample_from_model(ckpt, so).prompt.size())));
  CHECK(contains(out, "5 tokens generated in "));
  so.chat = true;
  so.system = "Be brief.";
  CHECK(run_cli(fmt::format("sample --model {} --chat --system 'Be brief.' --prompt 'the fox' --tokens 5 --device cpu "
                            "--temperature 0 --tokenizer {}",
                            ckpt, fx.tokenizer_dir),
                out) == 0);
  CHECK(text_of(out) == sample_from_model(ckpt, so).text + "\n");  // a chat prints the reply only

  // --prompt-file: the file's text is the prompt; the continuation alone is printed.
  const std::string prompt_file = fx.dir.file("prompt.txt");
  std::ofstream(prompt_file) << "the fox\nthe ";
  so.chat = false;
  so.system.reset();
  so.prompt = "the fox\nthe ";
  CHECK(run_cli(fmt::format("sample --model {} --prompt-file {} --tokens 5 --temperature 0 --prefill-chunk 3 "
                            "--device cpu",
                            ckpt, prompt_file),
                out) == 0);
  CHECK(text_of(out) == sample_from_model(ckpt, so).text + "\n");
  CHECK(contains(out, ", chunks of 3), "));
  CHECK(run_cli(fmt::format("sample --model {} --prompt-file {} --prompt x", ckpt, prompt_file), out) != 0);
  CHECK(contains(out, "excludes"));
  CHECK(contains(error_of([&] { read_prompt_file(fx.dir.file("absent.txt")); }), "cannot read the prompt file"));

  CHECK(run_cli("sample --prompt x", out) == 2);
  CHECK(contains(out, "chunkwise sample needs --run DIR or --model MODEL"));
  CHECK(run_cli(fmt::format("sample --run {} --model {}", fx.dir.file("run"), ckpt), out) != 0);
  CHECK(contains(out, "excludes"));
  CHECK(run_cli(fmt::format("sample --model {} --tokenizer bytes", ckpt), out) == 2);
  CHECK(contains(out, "chunkwise: error: the tokenizer 'bytes' has 258 tokens but the model"));
  CHECK(run_cli(fmt::format("sample --model {} --system hi", ckpt), out) == 2);
  CHECK(contains(out, "--system is for a chat"));
  // --rope: the model's RoPE scaling replaced, as for eval (tools/model_io.h); a bad key is named.
  CHECK(run_cli(fmt::format("sample --model {} --prompt 'the fox' --tokens 5 --temperature 0 --device cpu --rope "
                            "type=dynamic factor=2",
                            ckpt),
                out) == 0);
  CHECK(run_cli(fmt::format("sample --model {} --prompt 'the fox' --rope type=yarn", ckpt), out) == 2);
  CHECK(contains(out, "needs rope.factor >= 1"));
  CHECK(run_cli(fmt::format("sample --model {} --device tpu", ckpt), out) == 2);
  CHECK(contains(out, "--device"));
}

TEST_CASE("cuda: sample --device cuda: the prefill and the K/V store on the GPU give the CPU's greedy continuation "
          "(f32)" *
          doctest::skip(!gpu_available())) {
  BpeFixture fx;
  const std::string ckpt = write_checkpoint(fx);
  SampleOptions so;
  so.prompt = "the fox\nthe lazy dog and the fox";
  so.tokens = 6;
  so.temperature = 0;
  so.prefill_chunk = 4;  // several chunks against the store
  const Generation cpu = sample_from_model(ckpt, so, kModelTokenizer, Device::host(), DType::f32);
  const Generation gpu = sample_from_model(ckpt, so, kModelTokenizer, Device::gpu(0), DType::f32);
  CHECK(gpu.generated == cpu.generated);
  std::string out;
  CHECK(run_cli(fmt::format("sample --model {} --prompt 'the fox' --tokens 4 --temperature 0 --device cuda --dtype bf16",
                            ckpt),
                out) == 0);
  CHECK(contains(out, "the fox"));
}

TEST_CASE("sample: prompt ids, BOS, stop ids and chats") {
  const BpeTokenizer bpe(test_bpe());
  const ByteTokenizer bytes;
  LlamaConfig config = LlamaConfig::preset("small");
  config.eos_token_ids = {266, 5000};  // an id past the tokenizer is no stop id

  SampleOptions so;
  so.prompt = "the fox";
  CHECK(prompt_ids(bpe, so) == bpe.encode("the fox"));
  CHECK(prompt_ids(bytes, so) == Ids{ByteTokenizer::kBos, 't', 'h', 'e', ' ', 'f', 'o', 'x'});
  CHECK(stop_ids(bpe, config, false) == Ids{266});
  CHECK(stop_ids(bytes, LlamaConfig::preset("small"), false) == Ids{ByteTokenizer::kEos});

  so.chat = true;
  const std::string rendered =
      "<|im_start|>system\nYou are a test.<|im_end|>\n<|im_start|>user\nthe fox<|im_end|>\n<|im_start|>assistant\n";
  CHECK(prompt_ids(bpe, so) == bpe.encode(rendered));
  CHECK(prompt_ids(bpe, so).front() == 265);  // <|im_start|> as one token, nothing in front
  so.system = "Be brief.";
  CHECK(prompt_ids(bpe, so) ==
        bpe.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nthe fox<|im_end|>\n"
                   "<|im_start|>assistant\n"));
  config.eos_token_ids = {};
  CHECK(stop_ids(bpe, config, true) == Ids{266});  // EOS is <|im_end|> here too

  CHECK(contains(error_of([&] { prompt_ids(bytes, so); }), "--chat: the bytes tokenizer has no chat template"));
  BpeDefinition llama_like = test_bpe();
  llama_like.chat_template = "{{ bos_token }}{{ '<|start_header_id|>' }}";
  CHECK(contains(error_of([&] { prompt_ids(BpeTokenizer(llama_like), so); }), "the chat template is not ChatML"));
  BpeDefinition no_markers = test_bpe();
  for (AddedToken& a : no_markers.added)
    if (a.content == "<|im_end|>") a.content = no_markers.tokens[a.id] = "<|end|>";
  CHECK(contains(error_of([&] { prompt_ids(BpeTokenizer(no_markers), so); }), "<|im_end|> is not one token"));
  so.chat = false;
  CHECK(contains(error_of([&] { prompt_ids(bpe, so); }), "--system is for a chat"));
  so.system.reset();
  so.prompt = "";
  CHECK(contains(error_of([&] { prompt_ids(bpe, so); }), "the prompt is empty"));
  CHECK(prompt_ids(bytes, so) == Ids{ByteTokenizer::kBos});  // BOS alone is something to continue
}

TEST_CASE("sample: a prompt prefilled in chunks gives the logits of one chunk (f64, to 1e-12) and the same ids") {
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.vocab_size = 320;  // the byte tokenizer's ids
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 7, cfg.initializer_range, 0.0);
  const ByteTokenizer bytes;
  SampleOptions so;
  so.prompt = "the quick brown fox jumps over the lazy dog";
  so.tokens = 12;
  so.temperature = 0;
  so.stop_at_eos = false;
  const Ids prompt = prompt_ids(bytes, so);
  const auto n = static_cast<int64_t>(prompt.size());
  REQUIRE(n == 44);
  // The logits after the prompt and after each of three more ids: the prompt as one chunk, in chunks
  // of 5 (the last one shorter) and of 1.
  const auto logits_after = [&](int64_t chunk) {
    Decoder decoder(model, n + 3);
    std::vector<std::vector<double>> out{decoder.feed(prompt, chunk)};
    for (const uint32_t id : {'a', 'b', 'c'}) out.push_back(decoder.feed(Ids{id}, 1));
    CHECK(decoder.position() == n + 3);
    // The store holds n + 3 tokens: one more is an error.
    CHECK(contains(error_of([&] { decoder.feed(Ids{'d'}, 1); }), "overrun the store's 47 tokens"));
    return out;
  };
  const std::vector<std::vector<double>> whole = logits_after(0);
  for (const int64_t chunk : {int64_t{5}, int64_t{1}, n}) {
    const std::vector<std::vector<double>> chunked = logits_after(chunk);
    REQUIRE(chunked.size() == whole.size());
    double worst = 0;
    for (size_t i = 0; i < whole.size(); ++i) {
      REQUIRE(chunked[i].size() == static_cast<size_t>(cfg.vocab_size));
      for (size_t v = 0; v < whole[i].size(); ++v)
        worst = std::max(worst, std::abs(chunked[i][v] - whole[i][v]) / std::max(1.0, std::abs(whole[i][v])));
    }
    CAPTURE(chunk);
    CHECK(worst <= test::kSameMathF64Tol);
  }
  // Greedy generation: the same ids whatever the prefill's chunk.
  so.prefill_chunk = 0;
  const Generation one = generate(model, bytes, so);
  REQUIRE(one.generated.size() == 12);
  for (const int64_t chunk : {int64_t{1}, int64_t{5}, int64_t{4096}}) {
    so.prefill_chunk = chunk;
    CHECK(generate(model, bytes, so).generated == one.generated);
  }
}

TEST_CASE("train: eval and sample before the first step (eval.at_start, sample.at_start)") {
  BpeFixture fx;
  RunConfig rc = fx.config(1);
  rc.eval.at_start = true;
  rc.sample.at_start = true;
  TrainOptions o;
  o.run_dir = fx.dir.file("run");
  std::ostringstream log;
  run_training(rc, o, log);
  CHECK(contains(log.str(), "step     0: eval loss "));
  CHECK(contains(log.str(), "before training"));
  CHECK(contains(log.str(), "sample before training:\nthe "));
  std::ifstream metrics(fs::path(o.run_dir) / "metrics.jsonl");
  std::string first;
  std::getline(metrics, first);
  const nlohmann::json j = nlohmann::json::parse(first);
  CHECK(j.at("step") == 0);
  CHECK(j.contains("eval_loss"));

  rc.eval.every = 0;
  rc.data.eval_fraction = 0;
  CHECK(contains(error_of([&] { rc.validate(); }), "eval.at_start is true but there is no eval data"));
}

// ---- the real model, when its GGUF is in .models/ ----

TEST_CASE("sample: SmolLM2's greedy continuations are HF transformers' (needs the SmolLM2 GGUF)" *
          doctest::skip(!fs::exists(kSmolLm2Gguf))) {
  const nlohmann::json ref = read_json(fs::path(CW_SOURCE_ROOT) / "tests" / "data" / "smollm2_reference.json");
  REQUIRE(ref.contains("greedy"));
  for (const auto& g : ref.at("greedy")) {
    SampleOptions so;
    so.prompt = g.at("prompt").get<std::string>();
    so.tokens = g.at("new_tokens").get<int64_t>();
    so.temperature = 0;
    CAPTURE(so.prompt);
    const Generation ours = sample_from_model(kSmolLm2Gguf.string(), so);
    CHECK(ours.text == g.at("text").get<std::string>());
    if (g.contains("prompt_ids")) CHECK(ours.prompt == g.at("prompt_ids").get<Ids>());
    if (g.contains("ids")) CHECK(ours.generated == g.at("ids").get<Ids>());
  }
  // A chat: the default system message of SmolLM2's template, a reply that ends at <|im_end|>, the
  // same reply every time.
  SampleOptions chat;
  chat.chat = true;
  chat.prompt = "What is 2 + 2?";
  chat.tokens = 60;
  chat.temperature = 0;
  const Generation a = sample_from_model(kSmolLm2Gguf.string(), chat);
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(kSmolLm2Gguf.string());
  CHECK(a.prompt == tok->encode("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                                "Face<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"));
  CHECK(a.stopped);
  CHECK_FALSE(a.text.empty());
  CHECK_FALSE(contains(a.text, "<|im_end|>"));
  CHECK(sample_from_model(kSmolLm2Gguf.string(), chat).generated == a.generated);
  MESSAGE("SmolLM2, chat 'What is 2 + 2?', greedy: ", a.text);
}

TEST_CASE("train: a fine-tune of SmolLM2 from its GGUF exports an HF checkpoint with transformers' config and the "
          "tokenizer (needs the SmolLM2 GGUF)" *
          doctest::skip(!fs::exists(kSmolLm2Gguf))) {
  test::TempDir dir("smollm2-finetune");
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(kSmolLm2Gguf.string());
  std::string text;
  for (int i = 0; i < 20; ++i) text += "A hacker is a person who enjoys exploring the details of programmable systems. ";
  std::ofstream(dir.file("corpus.txt")) << text;
  TokenizeOptions to;
  to.bos_token = "<|endoftext|>";
  tokenize_files(*tok, {dir.file("corpus.txt")}, dir.file("corpus.bin"), to);

  RunConfig rc = RunConfig::defaults();
  rc.model.source = kSmolLm2Gguf.string();
  rc.data.train = {dir.file("corpus.bin")};
  rc.data.tokenizer = "model";
  rc.data.seq_len = 16;
  rc.data.batch_size = 1;
  rc.schedule.chunk = 8;
  rc.train.steps = 1;
  rc.train.device = "cpu";
  rc.optimizer.lr = 1e-4;
  rc.optimizer.min_lr = 1e-5;
  rc.optimizer.warmup_steps = 0;
  rc.eval.every = 0;
  rc.checkpoint.every = 0;
  rc.log.plot = false;
  rc.sample.tokens = 0;
  TrainOptions o;
  o.run_dir = dir.file("run");
  std::ostringstream log;
  const auto t0 = std::chrono::steady_clock::now();
  run_training(rc, o, log);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // What transformers' GGUF loader makes of this file (integrations/ggml.py: llama.* keys and the
  // tokenizer.ggml.*_token_id keys mapped by name; tie_word_embeddings = no output.weight tensor):
  // the checkpoint must say the same, so that it loads as the same model.
  const fs::path ckpt = fs::path(o.run_dir) / checkpoint_dir_name(1);
  const nlohmann::json c = read_json(ckpt / "config.json");
  CHECK(c.at("architectures") == nlohmann::json::array({"LlamaForCausalLM"}));
  CHECK(c.at("vocab_size") == 49152);
  CHECK(c.at("hidden_size") == 576);
  CHECK(c.at("intermediate_size") == 1536);
  CHECK(c.at("num_hidden_layers") == 30);
  CHECK(c.at("num_attention_heads") == 9);
  CHECK(c.at("num_key_value_heads") == 3);
  CHECK(c.at("head_dim") == 64);
  CHECK(c.at("max_position_embeddings") == 8192);
  CHECK(c.at("rope_theta") == 100000.0);
  CHECK(c.at("rope_scaling").is_null());
  CHECK(c.at("rms_norm_eps") == static_cast<double>(1e-5f));  // llama.attention.layer_norm_rms_epsilon is an f32
  CHECK(c.at("tie_word_embeddings") == true);
  CHECK(c.at("bos_token_id") == 1);
  CHECK(c.at("eos_token_id") == 2);
  CHECK(c.at("pad_token_id") == 2);
  CHECK(c.at("torch_dtype") == "float32");
  // Tied: the LM head is the embedding, so the file has no lm_head.weight.
  const SafetensorsReader weights((ckpt / "model.safetensors").string());
  CHECK(weights.find("model.embed_tokens.weight") != nullptr);
  CHECK(weights.find("lm_head.weight") == nullptr);
  // The tokenizer beside it, as transformers' AutoTokenizer reads it.
  const nlohmann::json tc = read_json(ckpt / "tokenizer_config.json");
  CHECK(tc.at("bos_token") == "<|im_start|>");
  CHECK(tc.at("eos_token") == "<|im_end|>");
  CHECK(tc.at("add_bos_token") == false);
  CHECK(contains(tc.at("chat_template").get<std::string>(), "<|im_start|>"));
  const std::unique_ptr<Tokenizer> back = load_tokenizer(ckpt.string());
  CHECK(back->encode(text) == tok->encode(text));

  // sample --run: the checkpoint with the run's copy of the tokenizer (sample --model on a checkpoint
  // is the BPE fixture's business above; loading this one twice would double the test's time).
  SampleOptions so;
  so.prompt = "A hacker is";
  so.tokens = 4;
  so.temperature = 0;
  const Generation g = sample_from_run(o.run_dir, 0, so);
  CHECK(g.prompt == tok->encode("A hacker is"));
  CHECK(g.text == replace_invalid_utf8(tok->decode(g.generated)));  // the run's copy decodes as the GGUF's
  MESSAGE(fmt::format("SmolLM2 fine-tune, 1 step of 16 tokens with the checkpoint: {:.1f} s", seconds));
}

}  // namespace
}  // namespace cw
