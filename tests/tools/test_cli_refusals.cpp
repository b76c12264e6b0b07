// Bad input to the real `chunkwise` binary, one table row at a time: every refusal is one clear line
// naming the key or flag and the value (never a library's exception, "unexpected error", an integer
// that wrapped, or a silent success), and where the program goes on with something other than what
// was asked (an older checkpoint, a changed key on --resume) it says so.
//
// The rows run against a small byte-level model and corpus, and a two-step run trained by the CLI
// itself; damaged copies of that run stand for checkpoints written by a crash, a disk or a hand.
#include "model/config.h"
#include "tests/support.h"
#include "tools/data/tokenizer.h"
#include "tools/data/tokens.h"
#include "tools/train/run_dir.h"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

using namespace cw;
namespace fs = std::filesystem;

namespace {

// What a row expects of the program.
enum class Outcome {
  refused,  // a non-zero exit, one "chunkwise: error:" line holding the fragment
  says,     // exit 0, its output holding the fragment
};

struct Row {
  const char* args;      // after `chunkwise`; {model}, {huge}, {data}, {run}, {dir} and {kv_sequences} are replaced
  Outcome outcome;
  const char* fragment;  // what the output must hold
};

// clang-format off
const Row kRows[] = {
  // Counts far beyond any machine, refused by name before anything is sized by them.
  {"train --set data.batch_size=4611686018427387904",            Outcome::refused, "data.batch_size must be in [1, 1048576], got 4611686018427387904"},
  {"train --set data.grad_accum=4611686018427387904",            Outcome::refused, "data.grad_accum must be in [1, 1048576], got 4611686018427387904"},
  {"train --set data.seq_len=4611686018427387904",               Outcome::refused, "data.seq_len must be in [2, 1073741824]"},
  {"train --set data.seq_len=99999999999999999999",              Outcome::refused, "data.seq_len must be an integer"},
  {"train --set parallel.tp=2147483648",                         Outcome::refused, "parallel.tp must be in [1, 65536], got 2147483648"},
  {"train --tp 2147483648",                                      Outcome::refused, "parallel.tp must be in [1, 65536], got 2147483648"},
  {"train --dp 4096 --tp 4096",                                  Outcome::refused, "parallel.dp x parallel.tp x parallel.cp must be <= 65536"},
  {"train --cp 2 --tp 2",                                        Outcome::refused, "parallel.cp = 2 does not combine with parallel.tp = 2"},
  {"train --set train.steps=1099511627777",                      Outcome::refused, "train.steps must be in [1, 1099511627776]"},
  {"train --set train.steps=1099511627776 --set data.batch_size=1048576", Outcome::refused, "must be <= 2^62 tokens in all"},
  {"train --set eval.batches=1048577",                           Outcome::refused, "eval.batches must be in [1, 1048576]"},
  {"train --set checkpoint.keep_last=1048577",                   Outcome::refused, "checkpoint.keep_last must be in [1, 1048576]"},
  {"train --set schedule.bwd_chunk=1073741825",                  Outcome::refused, "schedule.bwd_chunk must be in [0, 1073741824]"},
  {"train --set schedule.offload_window=1048577",                Outcome::refused, "schedule.offload_window must be in [0, 1048576]"},
  {"train --set sample.tokens=-1",                               Outcome::refused, "sample.tokens must be in [0, 1073741824]"},
  // The count flags of the other commands, against the same bounds.
  {"logits --model tiny --tokens {dir}/none.bin --seq 4611686018427387904 --out {dir}/l.safetensors",
                                                                 Outcome::refused, "--seq: Value 4611686018427387904 not in range 1 to 1073741824"},
  {"sample --model tiny --tokens 4611686018427387904",           Outcome::refused, "--tokens: Value 4611686018427387904 not in range 0 to 1073741824"},
  {"bench --batch 0",                                            Outcome::refused, "--batch: Value 0 not in range 1 to 1048576"},
  {"train --stop-after -1",                                      Outcome::refused, "--stop-after: Value -1 not in range 0 to 1099511627776"},
  // -1 is not "auto" (auto is written as the word).
  {"train --set schedule.chunk=-1",                              Outcome::refused, "schedule.chunk must be in [0, 1073741824], or auto, got -1"},
  {"train --chunk -1",                                           Outcome::refused, "schedule.chunk must be in [0, 1073741824], or auto, got -1"},
  {"train --offload-window -1",                                  Outcome::refused, "schedule.offload_window must be in [0, 1048576], or auto, got -1"},
  // Sizes this machine could never hold, from its memory and the model.
  {"train --set model.source={model} --set data.train={data} --device cpu --set data.grad_accum=1048576 "
   "--set data.batch_size=1048576 --set data.seq_len=1024",   Outcome::refused, "tokens are built at once for a step"},
  {"train --set model.source={model} --set data.train={data} --device cpu --set data.seq_len=1048576 "
   "--set data.batch_size={kv_sequences}",
                                                                 Outcome::refused, "of host and device memory in all"},
  // A model too large for this machine, refused before its weights are allocated, naming the file, the
  // parameters and what to do (each of its sizes is plausible; together 3.19 trillion parameters).
  {"init --model {huge} --out {dir}/huge-init",                  Outcome::refused, "huge.json': 3.19 trillion parameters need"},
  {"init --model {huge} --out {dir}/huge-init",                  Outcome::refused, "of host memory to initialise in f64 (f64 weights "},
  {"logits --model {huge} --tokens {dir}/none.bin --seq 4 --out {dir}/l.safetensors",
                                                                 Outcome::refused, "of host memory to load (f32 weights "},
  {"eval --task loss-by-position --model {huge} --data {data} --seq 16 --device cpu",
                                                                 Outcome::refused, "of host memory to load (f32 weights "},
  {"train --set model.source={huge} --set data.train={data} --device cpu",
                                                                 Outcome::refused, "of host memory to train in f32 (f32 weights "},
  {"train --set model.source={huge} --set data.train={data} --device cpu",
                                                                 Outcome::refused, "lora.rank = 8 (adapters trained, the base frozen)"},
  {"train --set model.source={huge} --set data.train={data} --device cpu --set lora.rank=8",
                                                                 Outcome::refused, "to train in f32 (f32 weights and adapters "},
  // With the planner's check turned off, still refused: no state of this machine holds it.
  {"train --set model.source={huge} --set data.train={data} --device cpu --set train.memory_check=false",
                                                                 Outcome::refused, "of host memory to train in f32"},
  // Checkpoints: which one is read, and why a newer one is not.
  {"sample --run {dir}/damaged --tokens 2",                      Outcome::says,    "step-000002: "},
  {"sample --run {dir}/damaged --tokens 2",                      Outcome::says,    "sample from step 1"},
  {"sample --run {run} --tokens 2",                              Outcome::says,    "sample from step 2"},
  {"sample --run {run} --step -3",                               Outcome::refused, "--step must be >= 0"},
  {"sample --run {run} --step 7",                                Outcome::refused, "no complete checkpoint of step 7"},
  {"train --resume --run-dir {dir}/damaged --set train.steps=3", Outcome::says,    "resume: skipped"},
  // A checkpoint's state.json checked against the run.
  {"train --resume --run-dir {dir}/step99",                      Outcome::refused, "state.json: 'step' must be in [0, 2] for this run, got 99"},
  {"train --resume --run-dir {dir}/negative-tokens --set train.steps=3", Outcome::refused, "state.json: 'tokens_seen' must be in [2, "},
  {"train --resume --run-dir {dir}/string-step",                 Outcome::refused, "state.json: 'step' must be an integer, got \"2\""},
  {"train --resume --run-dir {run}",                             Outcome::refused, "the run is complete"},
  // --resume continues the run as it was started: its config.toml, the changes on top, named.
  {"train --resume --run-dir {dir}/resumed --set train.steps=3", Outcome::says,    "resume: train.steps: 2 -> 3"},
  {"train --resume --run-dir {run} --set train.steps=3 --set data.batch_size=3", Outcome::refused, "config.toml differs in data.batch_size (2 -> 3)"},
  {"train --run-dir {dir}/fresh --force-changes --set model.source={model} --set data.train={data}",
                                                                 Outcome::refused, "--force-changes applies to --resume"},
  // The tokenizer's hint names a switch that exists, and the switch does what it says.
  {"tokenize --out {dir}/bad.bin {dir}/bad.txt",                 Outcome::refused, "--keep-invalid-utf8"},
  {"tokenize --keep-invalid-utf8 --out {dir}/bad.bin {dir}/bad.txt", Outcome::says, "-> 5 tokens"},
};
// clang-format on

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
}

// A copy of the run whose latest checkpoint (step 2) holds `state` as its state.json, written
// through RunDirectory so that its manifest vouches for it (the damage is the file's content).
void copy_with_state(const fs::path& run, const fs::path& to, const std::function<void(nlohmann::json&)>& edit) {
  fs::copy(run, to, fs::copy_options::recursive);
  const fs::path step = to / checkpoint_dir_name(2);
  nlohmann::json state = nlohmann::json::parse(test::read_text(step / "state.json"));
  edit(state);
  const fs::path kept = to / "kept";
  fs::rename(step, kept);
  RunDirectory(to.string()).save_checkpoint(
      2,
      [&](const std::string& tmp) {
        for (const auto& f : fs::directory_iterator(kept))
          if (f.path().filename() != "manifest.json" && f.path().filename() != "state.json")
            fs::copy_file(f.path(), fs::path(tmp) / f.path().filename());
        std::ofstream(fs::path(tmp) / "state.json") << state.dump(2);
      },
      2);
  fs::remove_all(kept);
}

}  // namespace

TEST_CASE("cli refusals: one table of bad input, each refused in one line naming the key, flag or file") {
  test::TempDir dir("refusals");
  const LlamaConfig c = test::small_test_config();
  const std::string model = dir.file("model.json");
  std::ofstream(model) << c.to_json().dump(2);
  // Llama 3.1 405B's widths (C 16384, F 53248, 128 heads of 128, 8 K/V heads) in 1,000 blocks: every
  // size within ConfigLimits, 3.19 trillion parameters, 11.6 TiB in f32.
  LlamaConfig h = LlamaConfig::preset("llama-3.1-8b");
  h.hidden_size = 16384;
  h.intermediate_size = 53248;
  h.num_hidden_layers = 1000;
  h.num_attention_heads = 128;
  h.vocab_size = c.vocab_size;  // the byte corpus's ids
  const std::string huge = dir.file("huge.json");
  std::ofstream(huge) << h.to_json().dump(2);
  std::string text;
  for (int i = 0; i < 60; ++i) text += "the quick brown fox jumps over the lazy dog. ";
  const std::string data = dir.file("corpus.bin");
  write_token_shard(data, ByteTokenizer().encode(text));
  std::ofstream(dir.file("bad.txt"), std::ios::binary) << "ok\xff\xfe";

  // A two-step run, a checkpoint at each step, trained by the CLI; it must succeed for the rows to mean anything.
  const std::string run = dir.file("run");
  std::string out;
  REQUIRE_MESSAGE(test::run_cli(fmt::format("train --set model.source={} --set data.train={} --device cpu "
                                            "--set data.seq_len=32 --set data.batch_size=2 --set train.steps=2 "
                                            "--set schedule.chunk=10 --set eval.every=0 --set checkpoint.every=1 "
                                            "--set sample.tokens=0 --set log.plot=false --run-dir {}",
                                            model, data, run),
                                out) == 0,
                  out);
  // Its latest checkpoint damaged on disk; state.json files that no run writes.
  fs::copy(run, dir.file("damaged"), fs::copy_options::recursive);
  std::ofstream(fs::path(dir.file("damaged")) / checkpoint_dir_name(2) / "model.safetensors", std::ios::app) << "x";
  copy_with_state(run, dir.file("step99"), [](nlohmann::json& s) { s["step"] = 99; });
  copy_with_state(run, dir.file("negative-tokens"), [](nlohmann::json& s) { s["tokens_seen"] = -5; });
  copy_with_state(run, dir.file("string-step"), [](nlohmann::json& s) { s["step"] = "2"; });
  fs::copy(run, dir.file("resumed"), fs::copy_options::recursive);
  // A micro-batch whose K/V store outgrows this machine's memory while its ids still fit: 2 layers x
  // min(hidden 32, 2 x K/V width 16) = 64 f32 values (256 bytes) a token against 8 bytes of ids and
  // labels; host / 16 tokens keep 16 x host (on the CPU no device memory counts) in host / 2 of ids.
  const double host = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  const auto kv_sequences = static_cast<int64_t>(host / 16 / double(1 << 20));  // of 2^20 tokens
  REQUIRE(kv_sequences >= 1);
  REQUIRE(kv_sequences <= (int64_t(1) << 20));

  for (const Row& row : kRows) {
    std::string args = row.args;
    replace_all(args, "{model}", model);
    replace_all(args, "{huge}", huge);
    replace_all(args, "{data}", data);
    replace_all(args, "{run}", run);
    replace_all(args, "{dir}", dir.path.string());
    replace_all(args, "{kv_sequences}", std::to_string(kv_sequences));
    INFO("chunkwise " << args);
    const int status = test::run_cli(args, out);
    INFO("output: " << out);
    CHECK(out.find(row.fragment) != std::string::npos);
    CHECK(out.find("unexpected error") == std::string::npos);
    CHECK(out.find("bad_alloc") == std::string::npos);
    if (row.outcome == Outcome::refused) {
      CHECK(status != 0);
      // One error line (CLI11's own errors add a usage hint line after theirs).
      const size_t error = out.find("chunkwise: error: ");
      if (error != std::string::npos) CHECK(out.find('\n', error) == out.size() - 1);
    } else {
      CHECK(status == 0);
    }
  }
}
