// The trace recorder (engine/trace.h) through a whole seco step with the K/V store offloaded: the
// phases of every chunk and layer are there, once each, well nested on their thread, every copy with
// its bytes (summing to what the step reports moved), and the JSON has the Chrome trace shape. Off,
// nothing is recorded. On the GPU the times are the device's: offloaded copies run while layers
// compute.
#include "engine/trace.h"
#include "optim/schedule.h"
#include "tests/gpu_support.h"
#include "tests/support.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

using namespace cw;

namespace {

struct Shape {
  int64_t layers, B, T, chunk, bwd_chunk, window;
  int64_t sweep_chunks() const { return (T + bwd_chunk - 1) / bwd_chunk; }
  // The prefill stops where the reverse sweep's last chunk starts (optim/seco.cpp).
  int64_t prefill_end() const { return (sweep_chunks() - 1) * bwd_chunk; }
  int64_t prefill_chunks() const { return (prefill_end() + chunk - 1) / chunk; }
};

// One seco step of `model` recorded from start to stop.
std::pair<trace::Recording, StepStats> traced_step(LlamaModel& model, const Shape& s, const ParamSet& grads) {
  ScheduleOptions o;
  o.kind = ScheduleKind::seco;
  o.chunk = s.chunk;
  o.bwd_chunk = s.bwd_chunk;
  o.offload_window = s.window;
  auto schedule = Schedule::create(o);
  const Batch batch = random_batch(s.B, s.T, model.config().vocab_size, 41);
  grads.zero();
  schedule->step(model, batch, grads);  // untraced: the store, the arena and the kernels' plans exist
  grads.zero();
  trace::start(model.device());
  const StepStats st = schedule->step(model, batch, grads);
  return {trace::stop(), st};
}

int64_t count_prefix(const trace::Recording& r, const std::string& prefix) {
  return std::count_if(r.events.begin(), r.events.end(),
                       [&](const trace::Event& e) { return e.name.rfind(prefix, 0) == 0; });
}
int64_t count_suffix(const trace::Recording& r, const std::string& suffix) {
  return std::count_if(r.events.begin(), r.events.end(), [&](const trace::Event& e) {
    return e.name.size() >= suffix.size() && e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) == 0;
  });
}

double end_of(const trace::Event& e) { return e.ts + e.dur; }

// On one thread any two events are disjoint or one holds the other (tol: float rounding of GPU times).
void check_nested(const trace::Recording& r, double tol) {
  for (size_t i = 0; i < r.events.size(); ++i)
    for (size_t j = i + 1; j < r.events.size(); ++j) {
      const trace::Event &a = r.events[i], &b = r.events[j];
      if (a.thread != b.thread) continue;
      const bool disjoint = end_of(a) <= b.ts + tol || end_of(b) <= a.ts + tol;
      const bool a_holds_b = a.ts <= b.ts + tol && end_of(b) <= end_of(a) + tol;
      const bool b_holds_a = b.ts <= a.ts + tol && end_of(a) <= end_of(b) + tol;
      INFO(a.name, " [", a.ts, ", ", end_of(a), ") and ", b.name, " [", b.ts, ", ", end_of(b), ")");
      CHECK((disjoint || a_holds_b || b_holds_a));
    }
}

// Everything a seco step's recording must hold, on any device.
void check_seco_recording(const trace::Recording& r, const StepStats& st, const Shape& s, double tol) {
  REQUIRE(!r.events.empty());
  for (const trace::Event& e : r.events) {
    INFO(e.name);
    CHECK(e.ts >= 0);
    CHECK(e.dur >= 0);
    CHECK(e.name.find('{') == std::string::npos);  // every placeholder filled
  }
  const int64_t P = s.prefill_chunks(), K = s.sweep_chunks(), L = s.layers;
  CHECK(count_prefix(r, "prefill chunk ") == P);
  CHECK(count_prefix(r, "backprop chunk ") == K);
  CHECK(count_suffix(r, " forward") == P * L);
  CHECK(count_suffix(r, " recompute") == K * L);
  CHECK(count_suffix(r, " backward") == K * L);
  CHECK(count_prefix(r, "lm head + loss") == K);  // the prefill of seco computes no loss
  for (int64_t i = 0; i < P; ++i) CHECK(count_prefix(r, "prefill chunk " + std::to_string(i)) == 1);
  // Each layer phase once per chunk and layer, inside its chunk's phase.
  std::map<std::pair<std::string, int64_t>, const trace::Event*> chunks;  // (kind, chunk) -> event
  for (const trace::Event& e : r.events)
    if (e.name.rfind("prefill chunk ", 0) == 0 || e.name.rfind("backprop chunk ", 0) == 0)
      chunks[{e.name.substr(0, e.name.find(' ')), e.arg("chunk")}] = &e;
  CHECK(static_cast<int64_t>(chunks.size()) == P + K);
  std::map<std::tuple<std::string, int64_t, int64_t>, int> layer_phases;  // (phase, chunk, layer) -> count
  for (const trace::Event& e : r.events) {
    if (!e.has("layer") || e.cat != "compute") continue;
    INFO(e.name);
    REQUIRE(e.has("chunk"));
    const std::string phase = e.name.substr(e.name.rfind(' ') + 1);
    ++layer_phases[{phase, e.arg("chunk"), e.arg("layer")}];
    const auto it = chunks.find({phase == "forward" ? "prefill" : "backprop", e.arg("chunk")});
    REQUIRE(it != chunks.end());
    CHECK(it->second->ts <= e.ts + tol);
    CHECK(end_of(e) <= end_of(*it->second) + tol);
    CHECK(e.arg("t0") == it->second->arg("t0"));
  }
  CHECK(static_cast<int64_t>(layer_phases.size()) == (P + 2 * K) * L);
  for (const auto& [key, n] : layer_phases) CHECK(n == 1);
  // Copies: on their thread, named, with bytes summing to what the step moved.
  size_t copied = 0;
  int64_t copies = 0;
  for (const trace::Event& e : r.events) {
    if (e.cat != "copy") continue;
    INFO(e.name);
    ++copies;
    const bool store = e.name.rfind("store kv layer ", 0) == 0;
    CHECK((e.name.rfind("fetch kv layer ", 0) == 0 || store));
    CHECK(e.thread == (store ? trace::Thread::copies_out : trace::Thread::copies_in));
    CHECK(e.arg("item") >= 0);
    CHECK(e.arg("item") < L);
    CHECK(e.arg("bytes") > 0);
    CHECK(e.has("chunk"));
    copied += static_cast<size_t>(e.arg("bytes"));
  }
  CHECK(copies > 0);
  CHECK(st.kv_bytes_moved > 0);
  CHECK(copied == st.kv_bytes_moved);
  for (const trace::Event& e : r.events)
    if (e.cat == "compute") CHECK(e.thread == trace::Thread::compute);
  check_nested(r, tol);
}

// The JSON: a Chrome trace with one X event per recorded event and the name metadata.
void check_json(const trace::Recording& r) {
  const nlohmann::json j = nlohmann::json::parse(r.json());
  REQUIRE(j.contains("traceEvents"));
  REQUIRE(j["traceEvents"].is_array());
  size_t complete = 0;
  std::map<std::string, int> meta;
  for (const auto& e : j["traceEvents"]) {
    REQUIRE(e.contains("ph"));
    REQUIRE(e.contains("pid"));
    REQUIRE(e.contains("tid"));
    CHECK(e["pid"].get<int>() == (r.device.is_cpu() ? 0 : 1 + r.device.index));
    if (e["ph"] == "M") {
      ++meta[e["name"].get<std::string>()];
      CHECK(e["args"].is_object());
      continue;
    }
    CHECK(e["ph"] == "X");
    CHECK(e["name"].is_string());
    CHECK((e["cat"] == "compute" || e["cat"] == "copy"));
    CHECK(e["ts"].get<double>() >= 0);
    CHECK(e["dur"].get<double>() >= 0);
    CHECK((e["tid"] == 1 || e["tid"] == 2 || e["tid"] == 3));
    if (e["cat"] == "copy") CHECK(e["tid"] == (e["name"].get<std::string>().rfind("store", 0) == 0 ? 3 : 2));
    CHECK(e["args"].is_object());
    if (e["cat"] == "copy") CHECK(e["args"]["bytes"].get<int64_t>() > 0);
    ++complete;
  }
  CHECK(complete == r.events.size());
  CHECK(meta["process_name"] == 1);
  CHECK(meta["thread_name"] == 3);
}

}  // namespace

TEST_CASE("trace: a seco step with the K/V store offloaded, on the CPU: every chunk and layer phase, the copies") {
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.num_hidden_layers = 4;
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 3, cfg.initializer_range, 0.1);
  ParamSet grads(cfg, DType::f64);
  for (const Shape s : {Shape{4, 2, 40, 8, 8, 2}, Shape{4, 1, 36, 12, 5, 1}, Shape{4, 2, 40, 10, 0, 3}}) {
    Shape shape = s;
    if (shape.bwd_chunk == 0) shape.bwd_chunk = shape.chunk;
    CAPTURE(s.T);
    CAPTURE(s.chunk);
    CAPTURE(s.bwd_chunk);
    CAPTURE(s.window);
    auto [rec, st] = traced_step(model, s, grads);
    CHECK(rec.device == Device::host());
    check_seco_recording(rec, st, shape, 0.0);
    check_json(rec);
  }
}

TEST_CASE("trace: write() saves the JSON; tracing off records nothing") {
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 4, cfg.initializer_range, 0.1);
  ParamSet grads(cfg, DType::f64);
  ScheduleOptions o;
  o.kind = ScheduleKind::seco;
  o.chunk = 8;
  o.offload_window = 1;
  auto schedule = Schedule::create(o);
  const Batch batch = random_batch(1, 24, cfg.vocab_size, 5);

  CHECK(!trace::on());
  schedule->step(model, batch, grads);  // off: nothing is kept anywhere
  trace::start(Device::host());
  CHECK(trace::on());
  CHECK_THROWS_AS(trace::start(Device::host()), Error);
  const trace::Recording empty = trace::stop();
  CHECK(!trace::on());
  CHECK(empty.events.empty());
  CHECK_THROWS_AS(trace::stop(), Error);
  check_json(empty);

  trace::start(Device::host());
  schedule->step(model, batch, grads);
  const trace::Recording rec = trace::stop();
  CHECK(!rec.events.empty());
  schedule->step(model, batch, grads);  // off again: the next start begins empty
  trace::start(Device::host());
  CHECK(trace::stop().events.empty());

  const std::filesystem::path path = std::filesystem::temp_directory_path() / "chunkwise-test-trace.json";
  rec.write(path.string());
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  CHECK(j["traceEvents"].size() == rec.events.size() + 7);  // + process name, 3 thread names, 3 sort indices
  std::filesystem::remove(path);
  CHECK_THROWS_AS(rec.write("/nonexistent-dir/trace.json"), Error);
}

TEST_CASE("trace: a scope's placeholders take its args; the chunk comes from the enclosing scope") {
  trace::start(Device::host());
  {
    TraceScope outer("backprop chunk {chunk}", {{"chunk", 7}, {"t0", 70}});
    TraceScope inner("layer {layer} backward, {missing}", {{"layer", 2}});
    inner.end();
    inner.end();  // once only
    trace::CopyScope none(Device::host(), /*to_device=*/true, "kv layer", 1, 0);    // no bytes: no event
    trace::CopyScope other(Device::gpu(0), /*to_device=*/true, "kv layer", 1, 64);  // not the traced device
    trace::CopyScope copy(Device::host(), /*to_device=*/false, "kv layer", 3, 128);  // a store
  }
  const trace::Recording r = trace::stop();
  REQUIRE(r.events.size() == 3);
  CHECK(r.events[0].name == "backprop chunk 7");
  CHECK(r.events[1].name == "layer 2 backward, {missing}");
  CHECK(r.events[1].arg("chunk") == 7);
  CHECK(!r.events[1].has("t0"));  // only the chunk is inherited
  CHECK(r.events[2].name == "store kv layer 3");
  CHECK(r.events[2].cat == "copy");
  CHECK(r.events[2].arg("bytes") == 128);
  CHECK(r.events[2].arg("chunk") == 7);
  CHECK_THROWS_AS(r.events[2].arg("layer"), Error);
  check_nested(r, 0.0);
}

TEST_CASE("cuda: trace of an offloaded seco step: GPU times, every phase and copy, copies overlap layer compute" *
          doctest::skip(!cw::test::gpu_ready())) {
  // The small preset at 1K tokens: layers long enough on the device that a prefetch (issued before
  // a layer's kernels, waiting only for the compute queued before it) runs while that layer computes.
  const LlamaConfig cfg = LlamaConfig::preset("small");
  const Shape s{cfg.num_hidden_layers, 1, 1024, 256, 128, 2};
  LlamaModel model(cfg, DType::bf16, Device::gpu(0));
  init_parameters(model.params(), 6, cfg.initializer_range, 0.1);
  ParamSet grads(cfg, DType::f32, Device::gpu(0));
  auto [rec, st] = traced_step(model, s, grads);
  CHECK(rec.device == Device::gpu(0));
  // GPU times come from float milliseconds: allow their rounding (well under a microsecond here).
  check_seco_recording(rec, st, s, 0.01);
  check_json(rec);
  // Overlap: some copy's interval meets a layer phase of another layer (a prefetch or a store behind
  // compute) for a positive time.
  int64_t overlapping = 0, copies = 0;
  double copy_us = 0, compute_us = 0;
  for (const trace::Event& c : rec.events) {
    if (c.cat != "copy") continue;
    ++copies;
    copy_us += c.dur;
    for (const trace::Event& e : rec.events)
      if (e.cat == "compute" && e.has("layer") && e.arg("layer") != c.arg("item") &&
          std::min(end_of(c), end_of(e)) - std::max(c.ts, e.ts) > 0) {
        ++overlapping;
        break;
      }
  }
  for (const trace::Event& e : rec.events)
    if (e.name.find(" chunk ") != std::string::npos) compute_us += e.dur;
  MESSAGE(copies, " copies (", copy_us, " us), ", overlapping, " of them during another layer's compute; chunk phases ",
          compute_us, " us; ", rec.events.size(), " events");
  CHECK(overlapping > 0);
}
