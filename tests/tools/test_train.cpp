// The training program end to end on a small model and corpus: resume is bit-identical, gradient
// accumulation equals one large batch, train then sample works, and resume errors are clear.
#include "model/checkpoint.h"
#include "model/lora.h"
#include "model/safetensors.h"
#include "optim/schedule.h"
#include "tests/support.h"
#include "tools/data/tokenizer.h"
#include "tools/data/tokens.h"
#include "tools/train/sample.h"
#include "tools/train/train.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

using namespace cw;
namespace fs = std::filesystem;

namespace {

// A small byte-level model (vocab 320) written as a config.json, and a corpus shard.
struct Fixture {
  test::TempDir dir{"train"};
  std::string model_json, shard;
  Fixture() {
    const LlamaConfig c = test::small_test_config();
    model_json = dir.file("model.json");
    std::ofstream(model_json) << c.to_json().dump(2);
    std::string text;
    for (int i = 0; i < 120; ++i) text += "the quick brown fox jumps over the lazy dog. ";
    std::vector<uint32_t> ids = ByteTokenizer().encode(text);
    shard = dir.file("corpus.bin");
    write_token_shard(shard, ids);
  }
  RunConfig config(int64_t steps) const {
    RunConfig rc = RunConfig::defaults();
    rc.model.source = model_json;
    rc.data.train = {shard};
    rc.data.seq_len = 32;
    rc.data.batch_size = 2;
    rc.data.grad_accum = 2;
    rc.schedule.chunk = 10;
    rc.train.steps = steps;
    rc.optimizer.warmup_steps = 2;
    rc.eval.every = 3;
    rc.eval.batches = 2;
    rc.checkpoint.every = 2;
    rc.sample.tokens = 0;
    rc.train.device = "cpu";  // the cases below are the CPU's (f64, ranks as threads), also on a GPU machine
    return rc;
  }
  // What the parallel layouts are checked against: one process, f64, 4 steps of a global batch of 4.
  RunConfig parallel_reference() const {
    RunConfig rc = config(4);
    rc.model.dtype = "f64";
    rc.data.batch_size = 4;
    return rc;
  }
};

std::vector<double> logged_losses(const std::string& run_dir) {
  std::ifstream f(fs::path(run_dir) / "metrics.jsonl");
  std::vector<double> losses;
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

// How far a parallel run's losses, eval loss and weights may sit from one process's (f64): the ranks'
// partial sums are added in another order (data, tensor and context parallelism's shares; ZeRO 3's
// reduce-scatter per backward chunk against ZeRO 0's one all-reduce), and a few AdamW steps amplify
// the rounding; still far below any real difference.
constexpr double kStepsOfRoundingTol = 1e-10;

// A run's logged losses (`got`) against its reference's (`want`): `steps` of each, every one within
// `tol` relative (parallel ranks add their sums in another order).
void check_losses_close(const std::vector<double>& got, const std::vector<double>& want, size_t steps, double tol) {
  REQUIRE(want.size() == steps);
  REQUIRE(got.size() == steps);
  for (size_t i = 0; i < want.size(); ++i) CHECK(std::abs(got[i] - want[i]) <= tol * std::abs(want[i]));
}

// Runs rc into run_dir, stopping after `stop_after` steps (which must interrupt it), then resumes
// it to the end; returns whether the first part was interrupted.
bool stop_and_resume(const RunConfig& rc, const std::string& run_dir, int64_t stop_after, std::ostream& log) {
  TrainOptions part;
  part.run_dir = run_dir;
  part.stop_after = stop_after;
  const bool interrupted = run_training(rc, part, log).interrupted;
  part.stop_after = 0;
  part.resume = true;
  run_training(rc, part, log);
  return interrupted;
}

// A stopped and resumed run in `resumed` against the straight run in `straight`: both logged
// `steps` losses, the same bits, and step `steps`'s checkpoint `files` are the same bytes.
void check_resumed_as_straight(const std::string& straight, const std::string& resumed, size_t steps,
                               std::initializer_list<const char*> files) {
  const std::vector<double> a = logged_losses(straight), b = logged_losses(resumed);
  REQUIRE(a.size() == steps);
  REQUIRE(b.size() == steps);
  for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == a[i]);
  const std::string step = fmt::format("step-{:06}", steps);
  for (const char* file : files) {
    CAPTURE(file);
    CHECK(fs::exists(fs::path(straight) / step / file));
    CHECK(test::read_text(fs::path(straight) / step / file) == test::read_text(fs::path(resumed) / step / file));
  }
}

// A run of four ranks with ZeRO 1 (`rc`, into `straight`): every loss within rounding of one
// process's (`single`); stopped after step 2 and resumed into `resumed`, the same losses and the same
// bytes of the model and of every rank's optimizer shard as straight through.
void check_four_ranks_zero1(const RunConfig& rc, const std::string& straight, const std::string& resumed,
                            const std::vector<double>& single, std::ostream& log) {
  TrainOptions o;
  o.run_dir = straight;
  run_training(rc, o, log);
  check_losses_close(logged_losses(straight), single, 4, kStepsOfRoundingTol);
  CHECK(stop_and_resume(rc, resumed, 2, log));
  check_resumed_as_straight(straight, resumed, 4,
                            {"model.safetensors", "optimizer-rank-00000.safetensors", "optimizer-rank-00001.safetensors",
                             "optimizer-rank-00002.safetensors", "optimizer-rank-00003.safetensors"});
}
}  // namespace

TEST_CASE("train: a stopped and resumed run is bit-identical to an uninterrupted one") {
  Fixture fx;
  std::ostringstream log;
  TrainOptions straight;
  straight.run_dir = fx.dir.file("straight");
  const TrainResult a = run_training(fx.config(8), straight, log);
  CHECK(a.last_step == 8);
  REQUIRE(a.last_eval_loss.has_value());

  TrainOptions first;
  first.run_dir = fx.dir.file("resumed");
  first.stop_after = 5;
  const TrainResult b1 = run_training(fx.config(8), first, log);
  CHECK(b1.interrupted);
  CHECK(b1.last_step == 5);
  TrainOptions second;
  second.run_dir = first.run_dir;
  second.resume = true;
  const TrainResult b2 = run_training(fx.config(8), second, log);
  CHECK(b2.last_step == 8);

  const std::vector<double> la = logged_losses(straight.run_dir), lb = logged_losses(second.run_dir);
  REQUIRE(la.size() == 8);
  REQUIRE(lb.size() == 8);  // the metrics log holds each step once
  for (size_t i = 0; i < la.size(); ++i) CHECK(la[i] == lb[i]);  // exactly, not approximately
  CHECK(test::read_text(fs::path(straight.run_dir) / "step-000008" / "model.safetensors") ==
        test::read_text(fs::path(second.run_dir) / "step-000008" / "model.safetensors"));
  CHECK(test::read_text(fs::path(straight.run_dir) / "step-000008" / "optimizer.safetensors") ==
        test::read_text(fs::path(second.run_dir) / "step-000008" / "optimizer.safetensors"));
  CHECK(fs::exists(fs::path(straight.run_dir) / "loss.svg"));
  CHECK(fs::exists(fs::path(straight.run_dir) / "config.toml"));
  CHECK(la.back() < la.front());  // it learns something
}

TEST_CASE("train with optimizer.offload: the bits of the run without it; each resumes the other's checkpoint") {
  Fixture fx;
  std::ostringstream log;
  TrainOptions plain;
  plain.run_dir = fx.dir.file("plain");
  const TrainResult a = run_training(fx.config(6), plain, log);
  RunConfig offloaded = fx.config(6);
  offloaded.optimizer.offload = true;
  offloaded.train.threads = 2;  // train.threads: the host update's and the kernels' threads
  TrainOptions first;
  first.run_dir = fx.dir.file("offloaded");
  first.stop_after = 3;
  run_training(offloaded, first, log);
  CHECK(log.str().find("|| host: master") != std::string::npos);  // the memory report says where they went
  TrainOptions second;  // resumed without the offload: AdamW's own file format either way
  second.run_dir = first.run_dir;
  second.resume = true;
  const TrainResult b = run_training(fx.config(6), second, log);
  CHECK(b.last_step == a.last_step);
  const std::vector<double> la = logged_losses(plain.run_dir), lb = logged_losses(second.run_dir);
  REQUIRE(la.size() == 6);
  REQUIRE(lb.size() == 6);
  for (size_t i = 0; i < la.size(); ++i) CHECK(la[i] == lb[i]);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    CHECK_MESSAGE(test::read_text(fs::path(plain.run_dir) / "step-000006" / file) ==
                      test::read_text(fs::path(second.run_dir) / "step-000006" / file),
                  file);

  // Data parallel ranks (threads) each with the whole state offloaded: the bits of the plain ranks;
  // ZeRO's sharded state does not combine with it and says so.
  RunConfig ranks = fx.config(3);
  ranks.data.batch_size = 2;
  ranks.parallel.dp = 2;
  TrainOptions dp_plain, dp_off;
  dp_plain.run_dir = fx.dir.file("dp-plain");
  dp_off.run_dir = fx.dir.file("dp-offloaded");
  run_training(ranks, dp_plain, log);
  ranks.optimizer.offload = true;
  run_training(ranks, dp_off, log);
  CHECK(logged_losses(dp_off.run_dir) == logged_losses(dp_plain.run_dir));
  CHECK(test::read_text(fs::path(dp_off.run_dir) / "step-000003" / "model.safetensors") ==
        test::read_text(fs::path(dp_plain.run_dir) / "step-000003" / "model.safetensors"));
  ranks.parallel.zero = 1;
  TrainOptions dp_zero;
  dp_zero.run_dir = fx.dir.file("dp-zero-offloaded");
  CHECK_THROWS_WITH_AS(run_training(ranks, dp_zero, log), doctest::Contains("parallel.zero"), Error);

  RunConfig no_eval = fx.config(2);  // eval.every = 0 is never, also at the end: there is no eval data
  no_eval.eval.every = 0;
  no_eval.data.eval_fraction = 0;
  TrainOptions quiet;
  quiet.run_dir = fx.dir.file("no-eval");
  CHECK_FALSE(run_training(no_eval, quiet, log).last_eval_loss.has_value());
  CHECK(fs::exists(fs::path(quiet.run_dir) / "step-000002"));  // saved at the end by default

  RunConfig keep_nothing = fx.config(3);  // checkpoint.at_end = false: with every = 0, no checkpoint at all
  keep_nothing.checkpoint.every = 0;
  keep_nothing.checkpoint.at_end = false;
  TrainOptions bare;
  bare.run_dir = fx.dir.file("keep-nothing");
  CHECK(run_training(keep_nothing, bare, log).last_step == 3);
  CHECK_FALSE(fs::exists(fs::path(bare.run_dir) / "latest"));
  keep_nothing.checkpoint.every = 2;  // the periodic ones still come
  TrainOptions periodic;
  periodic.run_dir = fx.dir.file("periodic-only");
  run_training(keep_nothing, periodic, log);
  CHECK(fs::exists(fs::path(periodic.run_dir) / "step-000002"));
  CHECK_FALSE(fs::exists(fs::path(periodic.run_dir) / "step-000003"));

  RunConfig capped = fx.config(2);
  capped.train.device_memory = 24;
  TrainOptions o;
  o.run_dir = fx.dir.file("capped");
  CHECK_THROWS_WITH_AS(run_training(capped, o, log), doctest::Contains("train.device_memory"), Error);
}

TEST_CASE("train: resume finds the last complete checkpoint and says what it skipped") {
  Fixture fx;
  std::ostringstream log;
  TrainOptions o;
  o.run_dir = fx.dir.file("run");
  o.resume = true;
  CHECK_THROWS_WITH_AS(run_training(fx.config(4), o, log), doctest::Contains("no complete checkpoint"), Error);
  o.resume = false;
  o.stop_after = 2;
  run_training(fx.config(6), o, log);
  // A half-written later checkpoint (no manifest) must be skipped with a message.
  fs::create_directories(fs::path(o.run_dir) / "step-000004");
  std::ofstream(fs::path(o.run_dir) / "step-000004" / "model.safetensors") << "partial";
  o.resume = true;
  o.stop_after = 0;
  std::ostringstream log2;
  const TrainResult r = run_training(fx.config(6), o, log2);
  CHECK(r.last_step == 6);
  CHECK(log2.str().find("step-000004") != std::string::npos);
  CHECK(log2.str().find("resumed from") != std::string::npos);
}

TEST_CASE("train then sample: the checkpoint generates text through the K/V cache") {
  Fixture fx;
  std::ostringstream log;
  TrainOptions o;
  o.run_dir = fx.dir.file("run");
  run_training(fx.config(4), o, log);
  SampleOptions so;
  so.prompt = "the ";
  so.tokens = 20;
  so.stop_at_eos = false;
  const std::string a = sample_from_run(o.run_dir, 0, so).text, b = sample_from_run(o.run_dir, 4, so).text;
  CHECK(a.size() >= 1);
  CHECK(a == b);  // the latest is step 4; same seed, same text
  so.seed = 2;
  so.temperature = 0;  // greedy ignores the seed
  CHECK(sample_from_run(o.run_dir, 0, so).text == sample_from_run(o.run_dir, 0, so).text);
  CHECK_THROWS_AS(sample_from_run(o.run_dir, 3, so), Error);  // never saved
  CHECK_THROWS_AS(sample_from_run(fx.dir.file("nowhere"), 0, so), Error);
}

TEST_CASE("gradient accumulation equals one large batch (f64, 1e-12)") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 21, cfg.initializer_range, 0.1);
  const int64_t T = 16;
  std::vector<int32_t> ids(4 * T);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 13 + 5) % cfg.vocab_size);
  const Batch big = causal_lm_batch(ids, 4, T);
  const Batch half1 = causal_lm_batch(std::vector<int32_t>(ids.begin(), ids.begin() + 2 * T), 2, T);
  const Batch half2 = causal_lm_batch(std::vector<int32_t>(ids.begin() + 2 * T, ids.end()), 2, T);
  for (const ScheduleKind kind : {ScheduleKind::full, ScheduleKind::seco}) {
    ScheduleOptions so;
    so.kind = kind;
    so.chunk = kind == ScheduleKind::seco ? 5 : 0;
    auto s = Schedule::create(so);
    ParamSet g_big(cfg, DType::f64), g_acc(cfg, DType::f64);
    const double l_big = s->step(model, big, g_big).loss;
    const double norm = static_cast<double>(half1.supervised() + half2.supervised());
    const double l_acc = s->step(model, half1, g_acc, norm).loss + s->step(model, half2, g_acc, norm).loss;
    CHECK(l_acc == doctest::Approx(l_big).epsilon(1e-14));
    for (size_t i = 0; i < g_big.size(); ++i) CHECK(test::compare(g_acc[i], g_big[i]).rel <= test::kSameMathF64Tol);
  }
}

TEST_CASE("train guards: non-finite loss stops or skips; an oversized run fails before step 1") {
  Fixture fx;
  // A checkpoint whose weights hold a NaN: every loss is NaN. The loader refuses such weights unless
  // told to load them for debugging, as here.
  const test::EnvScope allow_nonfinite("CW_ALLOW_NONFINITE_WEIGHTS", "1");
  LlamaModel m(LlamaConfig::from_file(fx.model_json), DType::f32);
  init_parameters(m.params(), 1, 0.02);
  m.params()[0].ptr<float>()[5] = std::nanf("");
  const std::string bad = fx.dir.file("nan-model");
  save_checkpoint_weights(m.params(), m.config(), bad, DType::f32);
  RunConfig rc = fx.config(3);
  rc.model.source = bad;
  rc.train.nonfinite = "stop";
  std::ostringstream log;
  TrainOptions o;
  o.run_dir = fx.dir.file("nan-stop");
  CHECK_THROWS_WITH_AS(run_training(rc, o, log), doctest::Contains("step 1: non-finite loss"), Error);
  rc.train.nonfinite = "skip";
  o.run_dir = fx.dir.file("nan-skip");
  const TrainResult r = run_training(rc, o, log);
  CHECK(r.last_step == 3);
  CHECK(log.str().find("update skipped") != std::string::npos);

  // A model no machine holds (5e10 parameters: about 8e11 bytes with gradients and optimizer
  // state): the training state's check (model/memory_need.h) must refuse it before allocating
  // anything, naming its parameters, whatever this machine's memory.
  // (Its vocabulary stays the byte tokenizer's, which data.tokenizer is checked against first.)
  LlamaConfig giant = LlamaConfig::from_file(fx.model_json);
  giant.hidden_size = 65536;
  giant.head_dim = 16384;
  giant.intermediate_size = 65536;
  const std::string giant_json = fx.dir.file("giant.json");
  std::ofstream(giant_json) << giant.to_json().dump();
  RunConfig huge = fx.config(1);
  huge.model.source = giant_json;
  o.run_dir = fx.dir.file("huge");
  CHECK_THROWS_WITH_AS(run_training(huge, o, log), doctest::Contains("51.56 billion parameters need"), Error);
}

TEST_CASE("train: SIGINT finishes the step, saves, and exits with the distinct code") {
  Fixture fx;
  RunConfig rc = fx.config(100000);
  rc.checkpoint.every = 0;
  rc.eval.every = 0;
  const std::string cfg = fx.dir.file("long.toml"), run = fx.dir.file("sig");
  std::ofstream(cfg) << rc.to_toml();
  // Start the run, wait until it has logged a step (so its handler is installed), then SIGINT it.
  const std::string log_path = fx.dir.file("sig.log"), status_path = fx.dir.file("sig.status");
  const std::string script = fmt::format(
      "{} train --config {} --run-dir {} >{} 2>&1 & pid=$!; "
      "for i in $(seq 1 600); do grep -q '^step ' {} && break; sleep 0.1; done; "
      "kill -INT $pid; wait $pid; echo $? >{}",
      test::chunkwise_exe(), cfg, run, log_path, log_path, status_path);
  const std::string script_path = fx.dir.file("sig.sh");
  std::ofstream(script_path) << script << "\n";
  REQUIRE(std::system(("bash " + script_path).c_str()) == 0);
  std::ifstream sf(status_path);
  int code = -1;
  sf >> code;
  const int status = code << 8;  // as if from waitpid: the tests below read WEXITSTATUS
  REQUIRE(WIFEXITED(status));
  std::ifstream lf(log_path);
  const std::string out((std::istreambuf_iterator<char>(lf)), {});
  INFO(out);
  CHECK(WEXITSTATUS(status) == kExitInterrupted);
  CHECK(out.find("stopped: saved step") != std::string::npos);
  CHECK(fs::exists(fs::path(run) / "latest"));
}

TEST_CASE("train --trace: a Chrome trace of the first step, every micro-batch's chunks in it") {
  Fixture fx;
  RunConfig rc = fx.config(2);
  rc.schedule.kind = ScheduleKind::seco;
  rc.schedule.offload_window = 1;
  rc.eval.every = 0;
  rc.checkpoint.every = 0;
  TrainOptions o;
  o.run_dir = fx.dir.file("traced");
  o.print_sample = false;
  o.trace = fx.dir.file("step.json");
  std::ostringstream log;
  run_training(rc, o, log);
  CHECK(log.str().find("trace of step 1: " + o.trace) != std::string::npos);
  std::ifstream in(o.trace);
  REQUIRE(in);
  const nlohmann::json j = nlohmann::json::parse(in);
  int64_t backprop = 0, copies = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    if (e["name"].get<std::string>().rfind("backprop chunk ", 0) == 0) ++backprop;
    if (e["cat"] == "copy") ++copies;
  }
  CHECK(backprop == rc.data.grad_accum * 4);  // 32 tokens in chunks of 10, per micro-batch, one step
  CHECK(copies > 0);
}

TEST_CASE("train data parallel: 2 ranks (threads) equal one process with twice the batch; ZeRO resumes from its shards") {
  Fixture fx;
  std::ostringstream log;
  RunConfig single = fx.config(4);
  single.model.dtype = "f64";
  single.data.batch_size = 4;
  TrainOptions o;
  o.run_dir = fx.dir.file("single");
  const TrainResult s = run_training(single, o, log);

  RunConfig ranks = single;
  ranks.data.batch_size = 2;
  ranks.parallel.dp = 2;
  ranks.parallel.bucket_mb = 0.01;
  o.run_dir = fx.dir.file("dp");
  std::ostringstream dp_log;
  const TrainResult d = run_training(ranks, o, dp_log);
  CHECK(dp_log.str().find("data parallel: 2 ranks, zero 0") != std::string::npos);
  const std::vector<double> ls = logged_losses(fx.dir.file("single")), ld = logged_losses(fx.dir.file("dp"));
  check_losses_close(ld, ls, 4, kStepsOfRoundingTol);  // rank 0 alone logs
  REQUIRE(d.last_eval_loss.has_value());
  CHECK(std::abs(*d.last_eval_loss - *s.last_eval_loss) <= kStepsOfRoundingTol * *s.last_eval_loss);

  // ZeRO 1: the same bits as zero 0; stopped at step 2 and resumed, the same bits again.
  RunConfig zero = ranks;
  zero.parallel.zero = 1;
  o.run_dir = fx.dir.file("zero-straight");
  run_training(zero, o, log);
  const std::vector<double> lz = logged_losses(o.run_dir);
  REQUIRE(lz.size() == 4);
  for (size_t i = 0; i < ld.size(); ++i) CHECK(lz[i] == ld[i]);
  const fs::path last_checkpoint = fs::path(o.run_dir) / "step-000004";
  CHECK(fs::exists(last_checkpoint / "optimizer-rank-00000.safetensors"));
  CHECK(fs::exists(last_checkpoint / "optimizer-rank-00001.safetensors"));
  CHECK(!fs::exists(last_checkpoint / "optimizer.safetensors"));

  TrainOptions part;
  part.run_dir = fx.dir.file("zero-resumed");
  CHECK(stop_and_resume(zero, part.run_dir, 2, log));
  check_resumed_as_straight(o.run_dir, part.run_dir, 4,
                            {"model.safetensors", "optimizer-rank-00000.safetensors", "optimizer-rank-00001.safetensors"});

  // A sharded state resumes only on its layout.
  part.resume = true;
  RunConfig other = zero;
  other.parallel.zero = 2;
  other.train.steps = 6;
  CHECK_THROWS_WITH_AS(run_training(other, part, log),
                       doctest::Contains("written with parallel.dp = 2 and parallel.zero = 1; this run has 2 and 2"), Error);
}

TEST_CASE("train with LoRA: checkpoints hold PEFT's files; stop and resume is bit-identical; sample; adapters continue") {
  Fixture fx;
  const auto lora_config = [&](int64_t steps) {
    RunConfig rc = fx.config(steps);
    rc.lora.rank = 2;
    rc.lora.alpha = 4;
    rc.lora.dropout = 0.1;
    rc.lora.targets = "all-linear";
    rc.lora.seed = 3;
    rc.optimizer.lr = 2e-2;
    return rc;
  };
  std::ostringstream log;
  TrainOptions straight;
  straight.run_dir = fx.dir.file("lora-straight");
  const TrainResult a = run_training(lora_config(6), straight, log);
  CHECK(a.last_step == 6);
  const std::string text = log.str();
  INFO(text);
  CHECK(text.find("lora: rank 2, alpha 4 (scale 2), dropout 0.1, on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
        != std::string::npos);
  CHECK(text.find("memory (cpu): weights") != std::string::npos);
  const fs::path last = fs::path(straight.run_dir) / "step-000006";
  CHECK(fs::exists(last / "adapter_config.json"));
  CHECK(fs::exists(last / "adapter_model.safetensors"));
  CHECK_FALSE(fs::exists(last / "model.safetensors"));  // the base stays model.source
  CHECK(read_peft_config(last.string()).rank == 2);
  CHECK(read_peft_base_model(last.string()) == fx.model_json);

  TrainOptions first;
  first.run_dir = fx.dir.file("lora-resumed");
  first.stop_after = 3;
  CHECK(run_training(lora_config(6), first, log).interrupted);
  TrainOptions second;
  second.run_dir = first.run_dir;
  second.resume = true;
  CHECK(run_training(lora_config(6), second, log).last_step == 6);
  const std::vector<double> la = logged_losses(straight.run_dir), lb = logged_losses(second.run_dir);
  REQUIRE(la.size() == 6);
  REQUIRE(lb.size() == 6);
  for (size_t i = 0; i < la.size(); ++i) CHECK(la[i] == lb[i]);  // dropout masks and all, exactly
  const fs::path other = fs::path(second.run_dir) / "step-000006";
  CHECK(test::read_text(last / "adapter_model.safetensors") == test::read_text(other / "adapter_model.safetensors"));
  CHECK(test::read_text(last / "optimizer.safetensors") == test::read_text(other / "optimizer.safetensors"));

  // The run's sample loads the base from run.toml's model.source and the adapters from the checkpoint.
  SampleOptions so;
  so.tokens = 12;
  so.temperature = 0;
  CHECK(sample_from_run(straight.run_dir, 0, so).text == sample_from_run(straight.run_dir, 6, so).text);

  // A resume with other adapters is refused, naming the checkpoint's adapter_config.json.
  RunConfig other_rank = lora_config(8);
  other_rank.lora.rank = 3;
  TrainOptions resume_other;
  resume_other.run_dir = straight.run_dir;
  resume_other.resume = true;
  CHECK_THROWS_WITH_AS(run_training(other_rank, resume_other, log),
                       doctest::Contains("step-000006/adapter_config.json: r 2, lora_alpha 4"), Error);

  // model.adapter: a new run continues from those adapters (lora.rank 0: the file's r, alpha, targets).
  RunConfig cont = fx.config(2);
  cont.model.adapter = last.string();
  std::ostringstream cont_log;
  TrainOptions co;
  co.run_dir = fx.dir.file("lora-continued");
  const TrainResult c = run_training(cont, co, cont_log);
  CHECK(c.last_step == 2);
  CHECK(cont_log.str().find(fmt::format("from {}", last.string())) != std::string::npos);
  // Its first loss is the trained adapters' (below the fresh run's first, which starts from B = 0).
  CHECK(logged_losses(co.run_dir).front() < la.front());
  cont.lora.rank = 4;  // a different rank than the file's
  co.run_dir = fx.dir.file("lora-mismatch");
  CHECK_THROWS_WITH_AS(run_training(cont, co, cont_log), doctest::Contains("adapter_config.json: r 2"), Error);
}

namespace {
// A checkpoint's weights (the whole model, an HF checkpoint) in f64.
ParamSet checkpoint_weights(const std::string& model_json, const fs::path& dir) {
  ParamSet p(LlamaConfig::from_file(model_json), DType::f64);
  load_checkpoint_weights(p, dir.string());
  return p;
}

// A run of ranks against one process on the same global batch: every logged loss, the last held-out
// loss and the last checkpoint's weights (step-<steps>) within tol relative.
void check_ranks_as_single(const TrainResult& ranks, const std::string& ranks_dir, const TrainResult& single,
                           const std::string& single_dir, const std::string& model_json, int steps, double tol) {
  check_losses_close(logged_losses(ranks_dir), logged_losses(single_dir), static_cast<size_t>(steps), tol);  // rank 0 alone logs
  REQUIRE(single.last_eval_loss.has_value());
  REQUIRE(ranks.last_eval_loss.has_value());
  CHECK(std::abs(*ranks.last_eval_loss - *single.last_eval_loss) <= tol * *single.last_eval_loss);
  const std::string last = fmt::format("step-{:06d}", steps);
  const ParamSet a = checkpoint_weights(model_json, fs::path(ranks_dir) / last),
                 b = checkpoint_weights(model_json, fs::path(single_dir) / last);
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a.specs()[i].name);
    const test::Worst e = test::compare(a[i], b[i]);
    INFO(e.str());
    CHECK(e.rel <= tol);
  }
}
}  // namespace

TEST_CASE("train with LoRA, data and tensor parallelism: TP 2 and DP 2 x TP 2 with dropout equal one process; the PEFT files are whole; resumed bit for bit") {
  Fixture fx;
  const auto lora_config = [&](const char* targets, double dropout) {
    RunConfig rc = fx.config(4);
    rc.model.dtype = "f64";
    rc.data.batch_size = 4;
    rc.lora.rank = 2;
    rc.lora.alpha = 4;
    rc.lora.targets = targets;
    rc.lora.dropout = dropout;
    rc.lora.seed = 5;
    rc.optimizer.lr = 2e-2;
    rc.sample.tokens = 4;  // the sample gathers the base and the adapters from the TP shards
    return rc;
  };
  struct Layout {
    const char* name;
    const char* targets;
    double dropout;
    int64_t dp, tp;
    bool sequence_parallel;
  };
  // Dropout masks are keyed by the global batch's sequence and the whole input's column, so every
  // layout draws one process's masks.
  for (const Layout& l : {Layout{"tp 2, every linear with dropout", "all-linear", 0.1, 1, 2, false},
                          Layout{"dp 2 x tp 2, q and v with dropout, sequence parallel", "q_proj,v_proj", 0.1, 2, 2,
                                 true}}) {
    CAPTURE(l.name);
    std::ostringstream log;
    TrainOptions single;
    single.run_dir = fx.dir.file(std::string("lora-single-") + l.targets);
    run_training(lora_config(l.targets, l.dropout), single, log);
    RunConfig rc = lora_config(l.targets, l.dropout);
    rc.data.batch_size = 4 / l.dp;
    rc.parallel.dp = l.dp;
    rc.parallel.tp = l.tp;
    rc.parallel.sequence_parallel = l.sequence_parallel;
    TrainOptions grid;
    grid.run_dir = fx.dir.file(std::string("lora-grid-") + l.targets);
    std::ostringstream grid_log;
    run_training(rc, grid, grid_log);
    INFO(grid_log.str());
    CHECK(grid_log.str().find("sample:") != std::string::npos);
    const std::vector<double> ls = logged_losses(single.run_dir), lt = logged_losses(grid.run_dir);
    check_losses_close(lt, ls, 4, kStepsOfRoundingTol);
    // The adapters' PEFT file: whole tensors, assembled from the TP shards.
    const fs::path a = fs::path(single.run_dir) / "step-000004", b = fs::path(grid.run_dir) / "step-000004";
    const SafetensorsReader fa((a / "adapter_model.safetensors").string()), fb((b / "adapter_model.safetensors").string());
    REQUIRE(fa.entries().size() == fb.entries().size());
    for (const SafetensorsEntry& e : fa.entries()) {
      CAPTURE(e.name);
      REQUIRE(fb.find(e.name));
      CHECK(fb.find(e.name)->shape == e.shape);
      OwnedTensor x = OwnedTensor::of_shape(DType::f64, e.shape), y = OwnedTensor::of_shape(DType::f64, e.shape);
      fa.read_into(e.name, x);
      fb.read_into(e.name, y);
      CHECK(test::compare(y, x).rel <= kStepsOfRoundingTol);
    }
  }
  // Stopped and resumed under TP: the adapters (and their sharded optimizer state) come back exactly.
  RunConfig rc = lora_config("all-linear", 0.0);
  rc.parallel.tp = 2;
  std::ostringstream log;
  TrainOptions straight;
  straight.run_dir = fx.dir.file("lora-tp-straight");
  run_training(rc, straight, log);
  TrainOptions part;
  part.run_dir = fx.dir.file("lora-tp-resumed");
  CHECK(stop_and_resume(rc, part.run_dir, 2, log));
  CHECK(logged_losses(part.run_dir) == logged_losses(straight.run_dir));
  CHECK(test::read_text(fs::path(part.run_dir) / "step-000004" / "adapter_model.safetensors") ==
        test::read_text(fs::path(straight.run_dir) / "step-000004" / "adapter_model.safetensors"));
}

TEST_CASE("train tensor parallel: TP 2 and DP 2 x TP 2 (threads) equal one process; their checkpoints resume bit-identically") {
  Fixture fx;
  std::ostringstream log;
  const RunConfig single = fx.parallel_reference();
  TrainOptions o;
  const std::string single_dir = fx.dir.file("single");
  o.run_dir = single_dir;
  const TrainResult s = run_training(single, o, log);
  const std::vector<double> ls = logged_losses(o.run_dir);

  struct Layout {
    const char* name;
    int64_t dp, tp;
    bool sequence_parallel;
  };
  for (const Layout& layout : {Layout{"tp 2", 1, 2, false}, Layout{"dp 2 x tp 2, sequence parallel", 2, 2, true}}) {
    CAPTURE(layout.name);
    RunConfig rc = single;
    rc.data.batch_size = single.data.batch_size / layout.dp;
    rc.parallel.dp = layout.dp;
    rc.parallel.tp = layout.tp;
    rc.parallel.sequence_parallel = layout.sequence_parallel;
    rc.parallel.bucket_mb = 0.01;
    o.run_dir = fx.dir.file(std::string("grid-") + std::to_string(layout.dp) + "x" + std::to_string(layout.tp));
    std::ostringstream grid_log;
    const TrainResult t = run_training(rc, o, grid_log);
    CHECK(grid_log.str().find("tensor parallel: 2 ranks per data-parallel rank") != std::string::npos);
    // The checkpoint is one whole HF checkpoint, assembled from the TP shards; the optimizer state
    // one file per TP shard.
    check_ranks_as_single(t, o.run_dir, s, single_dir, fx.model_json, 4, kStepsOfRoundingTol);
    const fs::path last = fs::path(o.run_dir) / "step-000004";
    CHECK(fs::exists(last / "optimizer-tp-00000.safetensors"));
    CHECK(fs::exists(last / "optimizer-tp-00001.safetensors"));
    CHECK(!fs::exists(last / "optimizer.safetensors"));
  }

  // DP 2 x TP 2 with ZeRO 1: stopped at step 2 and resumed, the same bits as straight through; every
  // world rank's optimizer shard in the checkpoint.
  RunConfig zero = single;
  zero.data.batch_size = 2;
  zero.parallel.dp = 2;
  zero.parallel.tp = 2;
  zero.parallel.zero = 1;
  zero.parallel.sequence_parallel = true;
  zero.parallel.tp_regather = true;
  check_four_ranks_zero1(zero, fx.dir.file("zero-straight"), fx.dir.file("zero-resumed"), ls, log);

  // TP 2 without ZeRO: the same, from the TP shards' optimizer files.
  RunConfig tp_only = single;
  tp_only.parallel.tp = 2;
  o.run_dir = fx.dir.file("tp-straight");
  run_training(tp_only, o, log);
  TrainOptions part;
  part.run_dir = fx.dir.file("tp-resumed");
  CHECK(stop_and_resume(tp_only, part.run_dir, 3, log));
  check_resumed_as_straight(o.run_dir, part.run_dir, 4,
                            {"model.safetensors", "optimizer-tp-00000.safetensors", "optimizer-tp-00001.safetensors"});

  // A checkpoint split by TP shards resumes only on its tp; a tp that does not divide the heads is
  // refused before anything runs.
  part.resume = true;
  RunConfig other = tp_only;
  other.parallel.tp = 1;
  other.train.steps = 6;
  CHECK_THROWS_WITH_AS(run_training(other, part, log),
                       doctest::Contains("written with parallel.tp = 2; this run has 1"), Error);
  RunConfig three = single;
  three.parallel.tp = 3;
  TrainOptions fresh;
  fresh.run_dir = fx.dir.file("three");
  CHECK_THROWS_WITH_AS(run_training(three, fresh, log), doctest::Contains("parallel.tp = 3 does not divide num_attention_heads = 4"),
                       Error);
}

TEST_CASE("train context parallel: CP 2 and DP 2 x CP 2 (threads) equal one process, LoRA's dropout too; ZeRO 1 "
          "over the grid resumes bit-identically; what it refuses") {
  Fixture fx;
  std::ostringstream log;
  const RunConfig single = fx.parallel_reference();  // chunks 10, 10, 10, 2 of 32 tokens, each split in two
  TrainOptions o;
  const std::string single_dir = fx.dir.file("cp-single");
  o.run_dir = single_dir;
  const TrainResult s = run_training(single, o, log);
  const std::vector<double> ls = logged_losses(o.run_dir);

  for (const int64_t dp : {int64_t{1}, int64_t{2}}) {
    CAPTURE(dp);
    RunConfig rc = single;
    rc.data.batch_size = single.data.batch_size / dp;
    rc.parallel.dp = dp;
    rc.parallel.cp = 2;
    rc.parallel.bucket_mb = 0.01;
    o.run_dir = fx.dir.file(fmt::format("cp-grid-{}x2", dp));
    std::ostringstream grid_log;
    const TrainResult t = run_training(rc, o, grid_log);
    INFO(grid_log.str());
    CHECK(test::contains(grid_log.str(), fmt::format("context parallel: 2 ranks per data-parallel rank ({} ranks in "
                                                     "all), each 1/2 of every chunk's tokens and 2 of 4 heads",
                                                     2 * dp)));
    // The held-out loss: the first data-parallel rank's group evaluates, its ranks' shares summed.
    // One whole HF checkpoint (rank 0's replica) and one optimizer file: every rank holds the same.
    check_ranks_as_single(t, o.run_dir, s, single_dir, fx.model_json, 4, kStepsOfRoundingTol);
    const fs::path last = fs::path(o.run_dir) / "step-000004";
    CHECK(fs::exists(last / "optimizer.safetensors"));
    const nlohmann::json state = nlohmann::json::parse(test::read_text(last / "state.json"));
    CHECK(state.at("parallel").at("dp") == dp);
    CHECK(state.at("parallel").at("cp") == 2);
  }

  // LoRA with dropout: the masks are keyed by each token's own sequence and position, so the ranks
  // holding a sequence's halves draw one process's masks.
  RunConfig lora = single;
  lora.lora.rank = 2;
  lora.lora.alpha = 4;
  lora.lora.targets = "all-linear";
  lora.lora.dropout = 0.1;
  lora.lora.seed = 5;
  lora.optimizer.lr = 2e-2;
  o.run_dir = fx.dir.file("cp-lora-single");
  run_training(lora, o, log);
  const std::vector<double> lora_single = logged_losses(o.run_dir);
  RunConfig lora_grid = lora;
  lora_grid.data.batch_size = 2;
  lora_grid.parallel.dp = 2;
  lora_grid.parallel.cp = 2;
  o.run_dir = fx.dir.file("cp-lora-grid");
  run_training(lora_grid, o, log);
  const std::vector<double> lora_ranks = logged_losses(o.run_dir);
  check_losses_close(lora_ranks, lora_single, 4, kStepsOfRoundingTol);

  // DP 2 x CP 2 with ZeRO 1: the moments sharded over the four ranks; stopped at step 2 and resumed,
  // the same bits as straight through.
  RunConfig zero = single;
  zero.data.batch_size = 2;
  zero.parallel.dp = 2;
  zero.parallel.cp = 2;
  zero.parallel.zero = 1;
  TrainOptions part;
  part.run_dir = fx.dir.file("cp-zero-resumed");
  check_four_ranks_zero1(zero, fx.dir.file("cp-zero-straight"), part.run_dir, ls, log);
  // Its shards resume only over the same dp x cp ranks.
  part.resume = true;
  RunConfig other = zero;
  other.parallel.cp = 1;
  other.parallel.dp = 4;
  other.data.batch_size = 1;
  other.train.steps = 6;
  CHECK_THROWS_WITH_AS(run_training(other, part, log),
                       doctest::Contains("written with parallel.cp = 2 and parallel.zero = 1; this run has "
                                         "parallel.cp = 1"),
                       Error);

  // Refused before anything runs, in one line naming the option.
  struct Refused {
    const char* what;
    std::function<void(RunConfig&)> change;
    const char* message;
  };
  const std::vector<Refused> refusals = {
      {"cp not dividing the heads", [](RunConfig& r) { r.parallel.cp = 3; r.data.seq_len = 30; r.schedule.chunk = 6; },
       "parallel.cp = 3 does not divide num_attention_heads = 4"},
      {"a chunk that does not split", [](RunConfig& r) { r.parallel.cp = 2; r.schedule.chunk = 5; },
       "parallel.cp = 2 splits every chunk's tokens into equal shares"},
      {"with tensor parallelism", [](RunConfig& r) { r.parallel.cp = 2; r.parallel.tp = 2; },
       "parallel.cp = 2 does not combine with parallel.tp = 2"},
      {"with ZeRO 3", [](RunConfig& r) { r.parallel.cp = 2; r.parallel.dp = 2; r.parallel.zero = 3; },
       "parallel.cp = 2 does not combine with parallel.zero = 3"},
      {"packed documents", [](RunConfig& r) { r.parallel.cp = 2; r.data.documents = true; },
       "data.documents with parallel.cp = 2 is not implemented"},
      {"saved layer inputs", [](RunConfig& r) { r.parallel.cp = 2; r.schedule.save_inputs = true; },
       "schedule.save_inputs keeps every token of a chunk"},
  };
  for (const Refused& r : refusals) {
    CAPTURE(r.what);
    RunConfig rc = single;
    r.change(rc);
    TrainOptions fresh;
    fresh.run_dir = fx.dir.file(std::string("cp-refused-") + std::to_string(&r - refusals.data()));
    const std::string error = test::message_of([&] { run_training(rc, fresh, log); });
    CHECK(test::contains(error, r.message));
    CHECK(error.find('\n') == std::string::npos);
  }
}

TEST_CASE("train with [rope]: the override is the model trained, and its checkpoints' config.json carries it") {
  Fixture fx;
  std::ostringstream log;
  RunConfig rc = fx.config(2);
  rc.rope.type = "yarn";
  rc.rope.factor = 4;
  rc.rope.original_max_position_embeddings = 16;
  TrainOptions o;
  o.run_dir = fx.dir.file("yarn");
  run_training(rc, o, log);
  const fs::path checkpoint = fs::path(o.run_dir) / "step-000002";
  const LlamaConfig saved = LlamaConfig::from_file((checkpoint / "config.json").string());
  CHECK(saved.rope_scaling.type == RopeScaling::Type::yarn);
  CHECK(saved.rope_scaling == rc.model_config().rope_scaling);
  CHECK(saved.max_position_embeddings == 64);
  // A run continuing from the checkpoint keeps its scaling (rope.type = model), and it samples.
  RunConfig next = fx.config(2);
  next.model.source = checkpoint.string();
  CHECK(next.model_config().rope_scaling == saved.rope_scaling);
  SampleOptions so;
  so.prompt = "the ";
  so.tokens = 4;
  so.stop_at_eos = false;
  CHECK_NOTHROW(sample_from_run(o.run_dir, 0, so));
}

TEST_CASE("train with packed documents and data.loss = assistant: the mask shapes the loss; 2 ranks equal one process; resume is bit-identical") {
  Fixture fx;
  // Chat-like data: documents of 9 to 40 byte tokens, each BOS first; the second half of each is the
  // "assistant's" (the loss mask), as chunkwise tokenize --chat-jsonl would mark it.
  std::vector<uint32_t> ids;
  TokenFlags flags{kFlagLoss | kFlagDocStart, {}};
  const std::string text = "the quick brown fox jumps over the lazy dog. ";
  for (int doc = 0; ids.size() < 1600; ++doc) {
    const int length = 9 + (doc * 7) % 32;
    for (int i = 0; i < length; ++i) {
      ids.push_back(i == 0 ? ByteTokenizer::kBos : static_cast<uint8_t>(text[static_cast<size_t>(doc + i) % text.size()]));
      flags.bits.push_back(static_cast<uint8_t>((i == 0 ? kFlagDocStart : 0) | (2 * i >= length ? kFlagLoss : 0)));
    }
  }
  const std::string chat = fx.dir.file("chat.bin");
  write_token_shard(chat, ids, 0, &flags);

  RunConfig rc = fx.config(4);
  rc.model.dtype = "f64";
  rc.data.train = {chat};
  rc.data.batch_size = 4;
  rc.data.documents = true;
  rc.data.loss = "assistant";
  std::ostringstream log;
  TrainOptions o;
  o.run_dir = fx.dir.file("assistant");
  const TrainResult a = run_training(rc, o, log);
  CHECK(a.last_step == 4);
  REQUIRE(a.last_eval_loss.has_value());
  CHECK(std::isfinite(*a.last_eval_loss));
  const std::vector<double> la = logged_losses(o.run_dir);
  REQUIRE(la.size() == 4);
  for (double l : la) CHECK(std::isfinite(l));

  // The same data and documents trained on every target: other losses from the first step on.
  RunConfig all = rc;
  all.data.loss = "all";
  o.run_dir = fx.dir.file("all");
  run_training(all, o, log);
  CHECK(logged_losses(o.run_dir)[0] != la[0]);

  // Data parallel: each rank's windows carry their own documents and mask.
  RunConfig ranks = rc;
  ranks.data.batch_size = 2;
  ranks.parallel.dp = 2;
  o.run_dir = fx.dir.file("dp");
  const TrainResult d = run_training(ranks, o, log);
  check_losses_close(logged_losses(o.run_dir), la, 4, kStepsOfRoundingTol);
  REQUIRE(d.last_eval_loss.has_value());
  CHECK(std::abs(*d.last_eval_loss - *a.last_eval_loss) <= kStepsOfRoundingTol * *a.last_eval_loss);

  // Stopped and resumed: the sampler's state finds the same windows, so the same masks.
  o.run_dir = fx.dir.file("resumed");
  CHECK(stop_and_resume(rc, o.run_dir, 2, log));
  const std::vector<double> lr = logged_losses(o.run_dir);
  REQUIRE(lr.size() == 4);
  for (size_t i = 0; i < la.size(); ++i) CHECK(lr[i] == la[i]);

  // A shard without a loss mask is refused before anything runs, naming it.
  RunConfig no_mask = rc;
  no_mask.data.train = {fx.shard};
  o.run_dir = fx.dir.file("no-mask");
  const std::string refused = "data.loss = assistant, but token file '" + fx.shard + "' has no loss mask";
  CHECK_THROWS_WITH_AS(run_training(no_mask, o, log), doctest::Contains(refused.c_str()), Error);
}

namespace {
// `zero0` (a data-parallel run) and the same with parallel.zero = 3, into <name>-zero0 and
// <name>-zero3 of the fixture's directory; the ZeRO 3 run's log names it, and its losses and eval
// loss are ZeRO 0's within `tol`. Returns the ZeRO 3 run's log.
std::string run_zero0_then_zero3(const Fixture& fx, const RunConfig& zero0, const std::string& name, double tol) {
  std::ostringstream log0, log3;
  TrainOptions o;
  o.run_dir = fx.dir.file(name + "-zero0");
  const TrainResult r0 = run_training(zero0, o, log0);
  RunConfig zero3 = zero0;
  zero3.parallel.zero = 3;
  o.run_dir = fx.dir.file(name + "-zero3");
  const TrainResult r3 = run_training(zero3, o, log3);
  INFO(log3.str());
  CHECK(log3.str().find("data parallel: " + std::to_string(zero0.parallel.dp) + " ranks, zero 3") != std::string::npos);
  const std::vector<double> l0 = logged_losses(fx.dir.file(name + "-zero0"));
  const std::vector<double> l3 = logged_losses(fx.dir.file(name + "-zero3"));
  REQUIRE(l0.size() == static_cast<size_t>(zero0.train.steps));
  REQUIRE(l3.size() == l0.size());  // rank 0 alone logs
  for (size_t i = 0; i < l0.size(); ++i) CHECK(std::abs(l3[i] - l0[i]) <= tol * std::abs(l0[i]));
  REQUIRE(r0.last_eval_loss.has_value());
  REQUIRE(r3.last_eval_loss.has_value());  // every rank evaluates together; rank 0 reports
  CHECK(std::abs(*r3.last_eval_loss - *r0.last_eval_loss) <= tol * *r0.last_eval_loss);
  return log3.str();
}
}  // namespace

TEST_CASE("train with ZeRO 3: 2 ranks (threads) equal ZeRO 0 (f64); the checkpoint is the whole model and each rank's shard; resumed bit for bit") {
  Fixture fx;
  std::ostringstream log;
  RunConfig zero0 = fx.config(4);
  zero0.model.dtype = "f64";
  zero0.parallel.dp = 2;
  zero0.data.batch_size = 1;  // 8 eval windows: 4 batches of the global 2
  zero0.eval.batches = 3;     // dealt to 2 ranks: rank 1 runs a fourth, uncounted, for rank 0's gathers
  run_zero0_then_zero3(fx, zero0, "full", kStepsOfRoundingTol);
  RunConfig zero3 = zero0;
  zero3.parallel.zero = 3;
  const std::vector<double> l3 = logged_losses(fx.dir.file("full-zero3"));
  TrainOptions o;

  // The checkpoint: the whole model as an HF checkpoint (gathered from the shards), equal to ZeRO 0's;
  // each rank's shard of the master weights and its moments beside it.
  const fs::path last = fs::path(fx.dir.file("full-zero3")) / "step-000004";
  const ParamSet w0 = checkpoint_weights(fx.model_json, fs::path(fx.dir.file("full-zero0")) / "step-000004");
  const ParamSet w3 = checkpoint_weights(fx.model_json, last);
  const test::Worst w = test::compare(w3.flat(), w0.flat());
  INFO(w.str());
  CHECK(w.rel <= kStepsOfRoundingTol);
  for (const char* file : {"zero3-rank-00000.safetensors", "zero3-rank-00000.safetensors.optimizer",
                           "zero3-rank-00001.safetensors", "zero3-rank-00001.safetensors.optimizer"})
    CHECK_MESSAGE(fs::exists(last / file), file);
  CHECK(!fs::exists(last / "optimizer.safetensors"));
  const nlohmann::json state = nlohmann::json::parse(test::read_text(last / "state.json"));
  CHECK(state["parallel"]["zero"] == 3);

  // Stopped after step 2 and resumed from the shards: the same bits.
  TrainOptions part;
  part.run_dir = fx.dir.file("full-zero3-resumed");
  CHECK(stop_and_resume(zero3, part.run_dir, 2, log));
  check_resumed_as_straight(fx.dir.file("full-zero3"), part.run_dir, 4,
                            {"model.safetensors", "zero3-rank-00000.safetensors", "zero3-rank-00001.safetensors"});

  // Its shards resume only on their layout; LoRA over a sharded base is refused in one line.
  part.resume = true;
  RunConfig other = zero3;
  other.parallel.zero = 2;
  other.train.steps = 6;
  CHECK_THROWS_WITH_AS(run_training(other, part, log),
                       doctest::Contains("written with parallel.dp = 2 and parallel.zero = 3; this run has 2 and 2"), Error);
  // The closing sample, from the whole weights gathered from the shards, and a sample from the
  // checkpoint (a whole HF model directory).
  RunConfig sampled = zero3;
  sampled.train.steps = 2;
  sampled.sample.tokens = 6;
  sampled.sample.temperature = 0;
  TrainOptions sampled_run;
  sampled_run.run_dir = fx.dir.file("zero3-sampled");
  std::ostringstream sampled_log;
  run_training(sampled, sampled_run, sampled_log);
  CHECK(sampled_log.str().find("\nsample:\n") != std::string::npos);
  SampleOptions so;
  so.prompt = "the ";
  so.tokens = 6;
  so.temperature = 0;
  so.stop_at_eos = false;
  CHECK(!sample_from_run(sampled_run.run_dir, 0, so).text.empty());

  // optimizer.offload: each rank's shard of the master weights and moments in host memory, updated
  // there; the bits of the run without it.
  RunConfig offload = zero3;
  offload.optimizer.offload = true;
  TrainOptions offloaded;
  offloaded.run_dir = fx.dir.file("full-zero3-offloaded");
  run_training(offload, offloaded, log);
  CHECK(logged_losses(offloaded.run_dir) == l3);
  for (const char* file : {"model.safetensors", "zero3-rank-00000.safetensors", "zero3-rank-00001.safetensors"})
    CHECK_MESSAGE(test::read_text(last / file) == test::read_text(fs::path(offloaded.run_dir) / "step-000004" / file),
                  file);

  RunConfig cast = zero3;
  cast.schedule.cast_layers = true;
  CHECK_THROWS_WITH_AS(run_training(cast, o, log), doctest::Contains("schedule.cast_layers"), Error);
}

TEST_CASE("train with LoRA and ZeRO 3: the frozen base sharded over 2 ranks (threads) equals ZeRO 0 with dropout (f64); PEFT files; resumed bit for bit") {
  Fixture fx;
  RunConfig zero0 = fx.config(4);
  zero0.model.dtype = "f64";
  zero0.parallel.dp = 2;
  zero0.lora.rank = 2;
  zero0.lora.alpha = 4;
  zero0.lora.targets = "all-linear";
  zero0.lora.dropout = 0.1;  // masks keyed by the global batch's sequence: every layout draws the same
  zero0.lora.seed = 5;
  zero0.optimizer.lr = 2e-2;
  zero0.sample.tokens = 4;  // the sample gathers the base from the shards
  const std::string zlog = run_zero0_then_zero3(fx, zero0, "lora", kStepsOfRoundingTol);
  CHECK(zlog.find("\nsample:\n") != std::string::npos);
  RunConfig zero3 = zero0;
  zero3.parallel.zero = 3;
  std::ostringstream log;

  // The checkpoint: PEFT's files (the adapters, whole: they are replicated) and rank 0's optimizer
  // file for them; no shard of the frozen base (model.source is the base).
  const fs::path last = fs::path(fx.dir.file("lora-zero3")) / "step-000004";
  CHECK(fs::exists(last / "adapter_config.json"));
  CHECK(!fs::exists(last / "model.safetensors"));
  CHECK(fs::exists(last / "optimizer.safetensors"));
  CHECK(!fs::exists(last / "zero3-rank-00000.safetensors"));
  const LlamaConfig mc = LlamaConfig::from_file(fx.model_json);
  LoraConfig lc;
  lc.rank = 2;
  lc.alpha = 4;
  lc.targets = "all-linear";
  ParamSet a0(mc, lora_parameter_table(mc, lc), DType::f64), a3(mc, lora_parameter_table(mc, lc), DType::f64);
  load_peft_adapter(a0, (fs::path(fx.dir.file("lora-zero0")) / "step-000004").string());
  load_peft_adapter(a3, last.string());
  const test::Worst w = test::compare(a3.flat(), a0.flat());
  INFO(w.str());
  CHECK(w.rel <= kStepsOfRoundingTol);

  // Stopped after step 2 and resumed: the same bits.
  TrainOptions part;
  part.run_dir = fx.dir.file("lora-zero3-resumed");
  CHECK(stop_and_resume(zero3, part.run_dir, 2, log));
  check_resumed_as_straight(fx.dir.file("lora-zero3"), part.run_dir, 4, {"adapter_model.safetensors", "optimizer.safetensors"});

  RunConfig offload = zero3;
  offload.optimizer.offload = true;
  CHECK_THROWS_WITH_AS(run_training(offload, part, log), doctest::Contains("under LoRA the base is frozen"), Error);
}
