// The `chunkwise train` configuration: defaults and the default run, exact round trips,
// --set overrides of every value type, and that each mistake fails with one line naming where it
// came from (file:line:column or --set) and the key.
#include "tools/train/run_config.h"

#include "engine/error.h"
#include "tests/support.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace cw {
namespace {

// The message of the cw::Error that f throws; fails the test if it throws nothing or another type.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    const std::string message = e.what();
    INFO(message);
    CHECK(message.find('\n') == std::string::npos);  // one line
    return message;
  }
  FAIL("no cw::Error was thrown");
  return "";
}

std::string toml_error(const std::string& text) {
  return error_of([&] { RunConfig::from_toml(text, "cfg.toml"); });
}

std::string override_error(const std::string& assignment) {
  return error_of([&] {
    RunConfig c = RunConfig::defaults();
    c.apply_override(assignment);
  });
}

// The error of an assignment: from reading it (a word option takes no other word: schedule.name,
// schedule.recompute), else from validate.
std::string validate_error(const std::string& assignment) {
  RunConfig c = RunConfig::defaults();
  return error_of([&] {
    c.apply_override(assignment);
    c.validate();
  });
}

bool contains(const std::string& text, const std::string& part) {
  INFO("'", text, "' should contain '", part, "'");
  return text.find(part) != std::string::npos;
}

TEST_CASE("run config: defaults are valid and convert to schedule options") {
  const RunConfig c = RunConfig::defaults();
  CHECK_NOTHROW(c.validate());
  CHECK(c.model.source == "small");
  CHECK(c.data.train.empty());
  CHECK(c.data.seq_len == 256);
  CHECK(c.optimizer.lr == 3e-3);
  CHECK_FALSE(c.model.tie_embeddings.has_value());
  const ScheduleOptions o = c.schedule_options();
  CHECK(o.kind == ScheduleKind::seco);
  CHECK(o.chunk == 64);
  CHECK(o.scale_loss);
  CHECK_NOTHROW(o.validate());
  CHECK(c.to_json()["model"]["tie_embeddings"].is_null());
}

TEST_CASE("run config: the default run is the defaults with the demo corpus; its commented TOML reads back") {
  RunConfig run = RunConfig::default_run();
  CHECK(run.data.train == std::vector<std::string>{"@demo"});
  CHECK_NOTHROW(run.validate());
  const RunConfig parsed = RunConfig::from_toml(run.commented_toml(), "<default>");
  CHECK(parsed == run);
  run.data.train.clear();
  CHECK(run == RunConfig::defaults());
  // Every key is written out with its help (so the text documents it), except the one that has no
  // TOML value while unset.
  const std::string text = RunConfig::default_run().commented_toml();
  const nlohmann::json defaults = RunConfig::defaults().to_json();
  for (const auto& [section, keys] : defaults.items())
    for (const auto& [key, value] : keys.items())
      if (key != "tie_embeddings") CHECK(contains(text, "\n" + key + " = "));
  CHECK(contains(text, "# spaco: chunks backpropagated per step (t of k); 0: all (in [0, 1073741824])\nkeep = 0\n"));
}

TEST_CASE("run config: to_toml round-trips exactly") {
  SUBCASE("defaults") {
    const RunConfig c = RunConfig::defaults();
    const RunConfig back = RunConfig::from_toml(c.to_toml(), "resolved.toml");
    CHECK(back.to_json() == c.to_json());
    CHECK(back == c);
  }
  SUBCASE("every value changed, awkward strings and floats") {
    RunConfig c = RunConfig::defaults();
    c.model.source = "C:\\models\\\"quoted\"";
    c.model.tie_embeddings = false;
    c.model.init_seed = 9223372036854775807ull;
    c.data.train = {"a.bin", "dir with space/*.bin", "tab\there", "line\nbreak", "ctl\x01\x7f", "caf\xc3\xa9"};
    c.data.eval = {"eval.bin"};
    c.data.eval_fraction = 0.1;
    c.data.seq_len = 4096;
    c.optimizer.lr = 1.0 / 3.0;
    c.optimizer.min_lr = 0.0;
    c.optimizer.eps = 1e-300;
    c.optimizer.weight_decay = 1e20;
    c.optimizer.grad_clip = 3.0;
    c.schedule.kind = ScheduleKind::spaco;
    c.schedule.keep = 3;
    c.schedule.relay_cap = 2.5;
    c.schedule.stratified = true;
    c.log.run_dir = "";
    c.sample.prompt = "";
    c.sample.temperature = 0.1 + 0.2;  // not 0.3: the last bit must survive
    const std::string text = c.to_toml();
    INFO(text);
    const RunConfig back = RunConfig::from_toml(text, "resolved.toml");
    CHECK(back.to_json() == c.to_json());
    CHECK(back == c);
    CHECK(back.sample.temperature == 0.1 + 0.2);
    CHECK(back.model.tie_embeddings == std::optional<bool>(false));
  }
}

TEST_CASE("run config: a file overrides only the keys it names") {
  const RunConfig c = RunConfig::from_toml(
      "[data]\nseq_len = 64\ntrain = ['x.bin']\n[optimizer]\nlr = 3   # an integer is a float here\n"
      "[model]\ntie_embeddings = true\n",
      "cfg.toml");
  CHECK(c.data.seq_len == 64);
  CHECK(c.data.train == std::vector<std::string>{"x.bin"});
  CHECK(c.optimizer.lr == 3.0);
  CHECK(c.model.tie_embeddings == std::optional<bool>(true));
  RunConfig expected = RunConfig::defaults();
  expected.data.seq_len = 64;
  expected.data.train = {"x.bin"};
  expected.optimizer.lr = 3.0;
  expected.model.tie_embeddings = true;
  CHECK(c == expected);
  // Dotted keys and inline tables are the same TOML.
  CHECK(RunConfig::from_toml("data.seq_len = 64\ntrain = { steps = 5 }\n", "cfg.toml").data.seq_len == 64);
  CHECK(RunConfig::from_toml("data.seq_len = 64\ntrain = { steps = 5 }\n", "cfg.toml").train.steps == 5);
}

TEST_CASE("run config: from_file reads the file and names it in errors") {
  test::TempDir dir("run-config");
  const std::string path = dir.file("run.toml");
  {
    std::ofstream f(path);
    f << "[train]\nsteps = 7\n[eval]\nevery = 2.5\n";
  }
  const std::string message = error_of([&] { RunConfig::from_file(path); });
  CHECK(contains(message, path + ":4:9"));
  CHECK(contains(message, "eval.every must be an integer, got float 2.5"));
  {
    std::ofstream f(path);
    f << "[train]\nsteps = 7\n";
  }
  CHECK(RunConfig::from_file(path).train.steps == 7);
  CHECK(contains(error_of([&] { RunConfig::from_file(dir.file("missing.toml")); }), dir.file("missing.toml")));
}

TEST_CASE("run config: overrides of every type") {
  RunConfig c = RunConfig::defaults();
  c.apply_override("data.seq_len=512");
  c.apply_override(" train.steps = 10 ");
  c.apply_override("optimizer.lr=1e-3");
  c.apply_override("optimizer.min_lr=0");  // an integer where a float is expected
  c.apply_override("log.plot=false");
  c.apply_override("model.tie_embeddings=true");
  c.apply_override("schedule.seed=7");
  c.apply_override("model.source=\"tiny\"");
  c.apply_override("model.dtype=bf16");  // bare word
  c.apply_override("log.run_dir=runs/a b");  // bare, with a space inside
  c.apply_override("sample.prompt='Once upon'");
  c.apply_override("data.train=[\"a.bin\", \"b/*.bin\"]");
  c.apply_override("data.eval=held.bin");  // one bare string is a one-element list
  c.apply_override("data.tokenizer=");     // empty: the empty string (validate rejects it)
  CHECK(c.data.seq_len == 512);
  CHECK(c.train.steps == 10);
  CHECK(c.optimizer.lr == 1e-3);
  CHECK(c.optimizer.min_lr == 0.0);
  CHECK_FALSE(c.log.plot);
  CHECK(c.model.tie_embeddings == std::optional<bool>(true));
  CHECK(c.schedule.seed == 7);
  CHECK(c.model.source == "tiny");
  CHECK(c.model.dtype == "bf16");
  CHECK(c.log.run_dir == "runs/a b");
  CHECK(c.sample.prompt == "Once upon");
  CHECK(c.data.train == std::vector<std::string>{"a.bin", "b/*.bin"});
  CHECK(c.data.eval == std::vector<std::string>{"held.bin"});
  CHECK(c.data.tokenizer.empty());
  // A later override wins.
  c.apply_override("data.seq_len=128");
  CHECK(c.data.seq_len == 128);
}

TEST_CASE("run config: TOML syntax errors give the file and line:column") {
  const std::string m = toml_error("[model]\nsource = \n");
  CHECK(contains(m, "cfg.toml:2:"));
  CHECK(contains(m, "TOML syntax error"));
  CHECK(contains(toml_error("[data]\nseq_len = 1\nseq_len = 2\n"), "cfg.toml:3:"));  // duplicate key
}

TEST_CASE("run config: unknown sections and keys suggest the closest name") {
  std::string m = toml_error("[modle]\nsource = 'x'\n");
  CHECK(contains(m, "cfg.toml:1:"));
  CHECK(contains(m, "unknown section [modle]"));
  CHECK(contains(m, "did you mean [model]?"));
  CHECK(contains(toml_error("[wibblewobble]\n"), "sections are model, rope, lora, data, schedule"));

  m = toml_error("[data]\nseqlen = 3\n");
  CHECK(contains(m, "cfg.toml:2:1"));
  CHECK(contains(m, "unknown key data.seqlen"));
  CHECK(contains(m, "did you mean data.seq_len?"));
  CHECK(contains(toml_error("[data]\nsteps = 3\n"), "did you mean train.steps?"));
  CHECK(contains(toml_error("[log]\ncolour = 3\n"), "keys of [log] are run_dir, every, plot"));

  m = toml_error("steps = 3\n[train]\n");
  CHECK(contains(m, "key steps is outside any section"));
  CHECK(contains(m, "put it under [train]"));
  CHECK(contains(toml_error("model = 'tiny'\n"), "model must be a table, got string \"tiny\""));
  CHECK(contains(toml_error("[data.extra]\nx = 1\n"), "unknown key data.extra"));
}

TEST_CASE("run config: wrong types name the key, the expected and the found type") {
  std::string m = toml_error("[data]\nseq_len = \"256\"\n");
  CHECK(contains(m, "cfg.toml:2:11: data.seq_len must be an integer, got string \"256\""));
  CHECK(contains(m, "e.g. seq_len = 256"));
  CHECK(contains(toml_error("[data]\nseq_len = 256.0\n"), "data.seq_len must be an integer, got float 256.0"));
  CHECK(contains(toml_error("[data]\nseed = -1\n"), "data.seed must be a non-negative integer, got integer -1"));
  CHECK(contains(toml_error("[log]\nplot = 1\n"), "log.plot must be true or false, got integer 1"));
  CHECK(contains(toml_error("[optimizer]\nlr = '1e-3'\n"), "optimizer.lr must be a number, got string"));
  CHECK(contains(toml_error("[model]\nsource = 3\n"), "model.source must be a string, got integer 3"));
  CHECK(contains(toml_error("[data]\ntrain = 'a.bin'\n"), "data.train must be a list of strings, got string"));
  CHECK(contains(toml_error("[data]\ntrain = ['a', 3]\n"), "data.train[1] must be a string, got integer 3"));
  CHECK(contains(toml_error("[eval]\nevery = { a = 1 }\n"), "eval.every must be an integer, got table"));
}

TEST_CASE("run config: malformed overrides name --set and the key") {
  std::string m = override_error("data.seq_len");
  CHECK(contains(m, "--set 'data.seq_len'"));
  CHECK(contains(m, "expected section.key=value"));
  m = override_error("steps=3");
  CHECK(contains(m, "--set"));
  CHECK(contains(m, "has no section"));
  CHECK(contains(m, "did you mean train.steps?"));
  m = override_error("data.seqlen=3");
  CHECK(contains(m, "--set: unknown key data.seqlen"));
  CHECK(contains(m, "did you mean data.seq_len?"));
  CHECK(contains(override_error("dta.seq_len=3"), "--set: unknown section [dta]"));
  CHECK(contains(override_error("data.seq_len=abc"), "--set: data.seq_len must be an integer, got 'abc'"));
  CHECK(contains(override_error("data.seq_len=1.5"), "--set: data.seq_len must be an integer, got float 1.5"));
  CHECK(contains(override_error("data.seq_len="), "--set: data.seq_len must be an integer, got ''"));
  CHECK(contains(override_error("log.plot=yes"), "--set: log.plot must be true or false, got 'yes'"));
  CHECK(contains(override_error("model.source=\"unterminated"), "--set: model.source is not a valid TOML string"));
  CHECK(contains(override_error("data.train=[\"a\","), "--set: data.train is not a valid TOML list"));
  CHECK(contains(override_error("data.train=[1]"), "--set: data.train[0] must be a string, got integer 1"));
  CHECK(contains(override_error("data.seq_len=1\nx=2"), "--set: data.seq_len must be an integer"));
}

TEST_CASE("run config: validate names the key that is out of range") {
  const std::pair<const char*, const char*> cases[] = {
      {"data.seq_len=1", "data.seq_len must be in [2, "},
      {"data.batch_size=0", "data.batch_size must be in [1, "},
      {"data.grad_accum=0", "data.grad_accum must be in [1, "},
      {"data.eval_fraction=1", "data.eval_fraction must be in [0, 1)"},
      {"data.eval_fraction=-0.1", "data.eval_fraction"},
      {"data.format=u8", "data.format must be one of shard | u16 | u32, got \"u8\""},
      {"data.train=[\"\"]", "data.train holds an empty path"},
      {"model.dtype=f16", "model.dtype must be one of auto | f64 | f32 | bf16"},
      {"model.source=\"\"", "model.source must not be empty"},
      {"schedule.name=fast", "schedule.name must be one of full | checkpointed | seco | spaco"},
      {"schedule.recompute=partial", "schedule.recompute must be one of auto | full | selective | none"},
      {"schedule.mlp_shards=-2", "schedule.mlp_shards must be in [0, 1048576]"},
      {"schedule.chunk=-2", "schedule.chunk must be in [0, 1073741824], or auto, got -2"},
      {"schedule.keep=2", "schedule.keep is a spaco option"},
      {"schedule.drop_relay=true", "schedule.drop_relay is a spaco option"},
      {"schedule.relay_cap=-1", "schedule.relay_cap must be >= 0"},
      {"optimizer.lr=0", "optimizer.lr must be > 0"},
      {"optimizer.lr=nan", "optimizer.lr must be a finite number"},
      {"optimizer.lr=inf", "optimizer.lr must be a finite number"},
      {"optimizer.min_lr=0.01", "optimizer.min_lr must be <= optimizer.lr"},
      {"optimizer.beta1=1", "optimizer.beta1 must be in [0, 1)"},
      {"optimizer.beta2=-0.5", "optimizer.beta2 must be in [0, 1)"},
      {"optimizer.eps=0", "optimizer.eps must be > 0"},
      {"optimizer.decay=step", "optimizer.decay must be one of cosine | linear | constant"},
      {"optimizer.warmup_steps=-1", "optimizer.warmup_steps must be in [0, "},
      {"optimizer.grad_clip=-1", "optimizer.grad_clip must be >= 0"},
      {"train.steps=0", "train.steps must be in [1, "},
      {"train.device=tpu", "train.device must be one of auto | cpu | cuda"},
      {"train.nonfinite=ignore", "train.nonfinite must be one of skip | stop"},
      {"train.threads=-2", "train.threads must be in [0, "},
      {"eval.batches=0", "eval.batches must be in [1, "},
      {"data.eval_fraction=0", "eval.every is 50 but there is no eval data"},
      {"checkpoint.keep_last=0", "checkpoint.keep_last must be in [1, "},
      {"checkpoint.every=-1", "checkpoint.every must be in [0, "},
      {"log.every=0", "log.every must be in [1, "},
      {"sample.top_p=0", "sample.top_p must be in (0, 1]"},
      {"sample.temperature=-1", "sample.temperature must be >= 0"},
      {"sample.top_k=-1", "sample.top_k must be in [0, 1073741824] (0: off), got -1"},
      // The upper bounds (optim/options.h), and the products of bounded counts.
      {"data.batch_size=1048577", "data.batch_size must be in [1, 1048576], got 1048577"},
      {"data.seq_len=1073741825", "data.seq_len must be in [2, 1073741824], got 1073741825"},
      {"parallel.tp=65537", "parallel.tp must be in [1, 65536], got 65537"},
      {"schedule.chunk=1073741825", "schedule.chunk must be in [0, 1073741824], or auto, got 1073741825"},
      {"optimizer.warmup_steps=1099511627777", "optimizer.warmup_steps must be in [0, 1099511627776]"},
      {"lora.rank=1048577", "lora.rank must be in [0, 1048576] (0: no adapters)"},
      {"rope.factor=1e9", "rope.factor must be in [0, 1048576] (0: not given)"},
  };
  for (const auto& [assignment, expected] : cases) {
    INFO(assignment);
    CHECK(contains(validate_error(assignment), expected));
  }
  RunConfig c = RunConfig::defaults();
  c.model.init_seed = 1ull << 63;
  CHECK(contains(error_of([&] { c.validate(); }), "model.init_seed must be < 2^63"));
}

// The config after the assignments, validated.
RunConfig with(std::initializer_list<const char*> assignments) {
  RunConfig c = RunConfig::defaults();
  for (const char* a : assignments) c.apply_override(a);
  c.validate();
  return c;
}

TEST_CASE("run config: [rope] replaces the model's RoPE scaling in the model the run trains") {
  const LlamaConfig tiny = LlamaConfig::preset("tiny");  // llama3 scaling, max_position_embeddings 4096
  CHECK(with({"model.source=tiny"}).model_config().to_json() == tiny.to_json());  // rope.type = model
  CHECK(with({"model.source=tiny", "model.tie_embeddings=true"}).model_config().tie_word_embeddings);

  // yarn: the original length defaults to the model's, which is stretched by the factor.
  const LlamaConfig yarn = with({"model.source=tiny", "rope.type=yarn", "rope.factor=8"}).model_config();
  CHECK(yarn.rope_scaling.type == RopeScaling::Type::yarn);
  CHECK(yarn.rope_scaling.factor == 8.0);
  CHECK(yarn.rope_scaling.original_max_position == 4096);
  CHECK(yarn.max_position_embeddings == 8 * 4096);
  CHECK(yarn.rope_scaling.beta_fast == 32.0);
  CHECK(yarn.rope_scaling.beta_slow == 1.0);
  CHECK(yarn.rope_scaling.truncate);
  CHECK_FALSE(yarn.rope_scaling.attention_factor.has_value());
  CHECK_FALSE(yarn.rope_scaling.mscale.has_value());
  // The config.json its checkpoints carry reads back to the same model.
  CHECK(LlamaConfig::from_json(yarn.to_json(), "written").rope_scaling == yarn.rope_scaling);

  const LlamaConfig given = with({"model.source=tiny", "rope.type=yarn", "rope.factor=2.5",
                                  "rope.original_max_position_embeddings=32", "rope.beta_fast=16", "rope.beta_slow=2",
                                  "rope.mscale=1", "rope.mscale_all_dim=0.5", "rope.truncate=false"})
                                .model_config();
  CHECK(given.max_position_embeddings == 80);
  CHECK(given.rope_scaling.original_max_position == 32);
  CHECK(given.rope_scaling.beta_fast == 16.0);
  CHECK(given.rope_scaling.mscale == std::optional<double>(1.0));
  CHECK(given.rope_scaling.mscale_all_dim == std::optional<double>(0.5));
  CHECK_FALSE(given.rope_scaling.truncate);
  CHECK(with({"model.source=tiny", "rope.type=yarn", "rope.factor=4", "rope.attention_factor=1.5"})
            .model_config().rope_scaling.attention_factor == std::optional<double>(1.5));

  // dynamic scales from max_position_embeddings, which stays.
  const LlamaConfig dyn = with({"model.source=tiny", "rope.type=dynamic", "rope.factor=2"}).model_config();
  CHECK(dyn.rope_scaling.type == RopeScaling::Type::dynamic);
  CHECK(dyn.rope_scaling.original_max_position == 4096);
  CHECK(dyn.max_position_embeddings == 4096);
  CHECK(with({"model.source=tiny", "rope.type=default"}).model_config().rope_scaling == RopeScaling{});
  const RopeScaling linear = with({"model.source=tiny", "rope.type=linear", "rope.factor=2"}).model_config().rope_scaling;
  CHECK((linear.type == RopeScaling::Type::linear && linear.factor == 2.0));
  const RopeScaling llama3 = with({"model.source=tiny", "rope.type=llama3", "rope.factor=8", "rope.low_freq_factor=2",
                                   "rope.high_freq_factor=8"}).model_config().rope_scaling;
  CHECK(llama3 == RopeScaling{RopeScaling::Type::llama3, 8.0, 2.0, 8.0, 4096});

  // A checkpoint's own config.json loses to the override.
  test::TempDir dir("rope-override");
  std::ofstream(dir.file("config.json")) << tiny.to_json().dump();
  RunConfig from_checkpoint = with({"rope.type=yarn", "rope.factor=4"});
  from_checkpoint.model.source = dir.path.string();
  CHECK(from_checkpoint.model_config().rope_scaling.type == RopeScaling::Type::yarn);
}

TEST_CASE("run config: [rope] mistakes name the key") {
  const std::pair<std::vector<const char*>, const char*> cases[] = {
      {{"rope.type=longrope"}, "rope.type must be one of model | default | linear | llama3 | yarn | dynamic"},
      {{"rope.type=yarn"}, "rope.type = yarn needs rope.factor >= 1, got 0"},
      {{"rope.type=dynamic", "rope.factor=0.5"}, "rope.type = dynamic needs rope.factor >= 1, got 0.5"},
      {{"rope.factor=4"}, "rope.factor is set but rope.type = model does not read it"},
      {{"rope.type=linear", "rope.factor=2", "rope.beta_fast=16"}, "rope.beta_fast is set but rope.type = linear"},
      {{"rope.type=dynamic", "rope.factor=2", "rope.original_max_position_embeddings=2048"},
       "rope.original_max_position_embeddings is set but rope.type = dynamic"},
      {{"rope.type=yarn", "rope.factor=2", "rope.beta_slow=40"}, "rope.beta_fast (32) must exceed rope.beta_slow (40)"},
      {{"rope.type=llama3", "rope.factor=2", "rope.low_freq_factor=4"}, "rope.high_freq_factor (4) must exceed"},
      {{"rope.factor=-1"}, "rope.factor must be in [0, 1048576]"},
      {{"rope.beta_slow=0"}, "rope.beta_slow must be > 0"},
  };
  for (const auto& [assignments, expected] : cases) {
    INFO(assignments.front());
    RunConfig c = RunConfig::defaults();
    for (const char* a : assignments) c.apply_override(a);
    CHECK(contains(error_of([&] { c.validate(); }), expected));
  }
  CHECK(contains(override_error("rope.factor=eight"), "--set: rope.factor must be a number"));
  CHECK(contains(override_error("rope.scaling=yarn"), "unknown key rope.scaling"));
}

TEST_CASE("run config: values are checked after all layers, so a later --set can fix a file") {
  RunConfig c = RunConfig::from_toml("[data]\nseq_len = 1\n[schedule]\nkeep = 4\n", "cfg.toml");
  CHECK_THROWS_AS(c.validate(), Error);
  c.apply_override("data.seq_len=32");
  c.apply_override("schedule.name=spaco");
  CHECK_NOTHROW(c.validate());
  CHECK(c.schedule_options().keep == 4);
  // constant decay never reaches min_lr, so min_lr > lr is harmless there.
  c.apply_override("optimizer.decay=constant");
  c.apply_override("optimizer.min_lr=1");
  CHECK_NOTHROW(c.validate());
  // No eval data is fine when evaluation is off.
  c.apply_override("data.eval_fraction=0");
  c.apply_override("eval.every=0");
  CHECK_NOTHROW(c.validate());
}

}  // namespace
}  // namespace cw

namespace cw {
namespace {

TEST_CASE("run config: the committed configs/*.toml read and validate") {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(CW_SOURCE_ROOT) / "configs")) {
    if (entry.path().extension() != ".toml") continue;
    CAPTURE(entry.path().string());
    const RunConfig rc = RunConfig::from_file(entry.path().string());
    CHECK_NOTHROW(rc.validate());
    CHECK(rc.data.tokenizer == "model");  // the fine-tunes sample with the model's own tokenizer
    CHECK(rc.eval.at_start);
    ++files;
  }
  CHECK(files == 4);  // the fine-tune demo and the long-context demo, each in a CPU and a GPU form
}


TEST_CASE("run config: --resume's changes against the saved config, each named, those that break continuation refused") {
  // (assignment on top of the saved config, whether the run still continues as it started)
  const std::pair<const char*, bool> cases[] = {
      {"train.steps=600", true},          {"train.memory_check=false", true}, {"train.device_memory=8", true},
      {"eval.every=10", true},            {"eval.batches=2", true},           {"checkpoint.every=5", true},
      {"checkpoint.keep_last=4", true},   {"log.every=10", true},             {"sample.tokens=0", true},
      {"model.source=tiny", false},       {"data.batch_size=4", false},       {"data.seq_len=128", false},
      {"data.seed=7", false},             {"data.train=other.bin", false},    {"schedule.chunk=32", false},
      {"schedule.name=full", false},      {"optimizer.lr=1e-4", false},       {"optimizer.beta2=0.99", false},
      {"parallel.dp=2", false},           {"lora.rank=8", false},             {"train.deterministic=true", false},
  };
  RunConfig saved = RunConfig::default_run();
  saved.schedule.chunk = 48;  // the planner's number for "auto", as a run directory saves it
  for (const auto& [assignment, continues] : cases) {
    INFO(assignment);
    RunConfig resumed = saved;
    resumed.apply_override(assignment);
    const std::vector<ConfigChange> changes = resume_changes(saved, resumed);
    REQUIRE(changes.size() == 1);
    CHECK(std::string(assignment).starts_with(changes[0].key + "="));
    CHECK(changes[0].continues == continues);
    std::ostringstream printed;
    if (continues) {
      check_resume_changes(changes, false, printed);
    } else {
      CHECK(contains(error_of([&] { check_resume_changes(changes, false, printed); }),
                     "config.toml differs in " + changes[0].key + " ("));
      check_resume_changes(changes, true, printed);  // --force-changes
    }
    CHECK(contains(printed.str(), "resume: " + changes[0].key + ": " + changes[0].from + " -> " + changes[0].to));
  }
  // "auto" given again is the count the run's start resolved it to: no change.
  RunConfig resumed = saved;
  resumed.apply_override("schedule.chunk=auto");
  CHECK(resume_changes(saved, resumed).empty());
  CHECK(resumed.schedule.chunk == 48);
  // A --config given with --resume changes only the keys it names.
  resumed = saved;
  resumed.apply_toml("[train]\nsteps = 900\n", "more.toml");
  const std::vector<ConfigChange> changes = resume_changes(saved, resumed);
  REQUIRE(changes.size() == 1);
  CHECK(changes[0].key == "train.steps");
  CHECK(resumed.data.train == saved.data.train);
}

}  // namespace
}  // namespace cw
