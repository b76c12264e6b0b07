// The trace recorder (engine/trace.h): events kept in one list while on; GPU times as CUDA event
// marks (engine/cuda/runtime.h), resolved in stop().
#include "engine/trace.h"

#include "engine/cuda/runtime.h"
#include "engine/error.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>

namespace cw::trace {

namespace detail {
bool g_on = false;
}  // namespace detail

namespace {

struct Raw {
  std::string name;  // template
  const char* cat;
  Thread thread;
  std::vector<std::pair<std::string, int64_t>> args;
  double t0 = 0, t1 = -1;        // CPU: microseconds since start (t1 < 0: never closed)
  size_t m0 = 0, m1 = 0;         // GPU: marks
  bool closed = false;
};

struct Recorder {
  Device device;
  std::chrono::steady_clock::time_point origin;
  std::vector<Raw> events;
  std::vector<int64_t> open;  // indices of the compute scopes open now, outermost first
  uint64_t generation = 0;    // which recording: a scope opened in an earlier one closes nothing
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

double host_us(const Recorder& r) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - r.origin).count();
}

// The chunk of the innermost open scope that names one, if any.
void inherit_chunk(const Recorder& r, std::vector<std::pair<std::string, int64_t>>& args) {
  for (const auto& a : args)
    if (a.first == "chunk") return;
  for (auto it = r.open.rbegin(); it != r.open.rend(); ++it)
    for (const auto& a : r.events[static_cast<size_t>(*it)].args)
      if (a.first == "chunk") {
        args.emplace_back(a);
        return;
      }
}

// Marks the beginning (end = false) or the end of event `e` on its thread.
void mark(Recorder& r, Raw& e, bool end) {
  if (r.device.is_cpu()) {
    (end ? e.t1 : e.t0) = host_us(r);
    return;
  }
  const int lane = e.thread == Thread::copies_in    ? static_cast<int>(gpu::CopyLane::in)
                   : e.thread == Thread::copies_out ? static_cast<int>(gpu::CopyLane::out)
                                                    : -1;
  (end ? e.m1 : e.m0) = gpu::trace_mark(r.device.index, lane, lane >= 0 && !end);
}

std::string fill_placeholders(const std::string& name, const std::vector<std::pair<std::string, int64_t>>& args) {
  std::string out = name;
  for (const auto& [key, value] : args) {
    const std::string ph = "{" + key + "}";
    for (size_t at = out.find(ph); at != std::string::npos; at = out.find(ph, at))
      out.replace(at, ph.size(), std::to_string(value));
  }
  return out;
}

int pid_of(Device d) { return d.is_cpu() ? 0 : 1 + d.index; }

}  // namespace

bool Event::has(const std::string& key) const {
  for (const auto& a : args)
    if (a.first == key) return true;
  return false;
}

int64_t Event::arg(const std::string& key) const {
  for (const auto& a : args)
    if (a.first == key) return a.second;
  fail(fmt::format("trace event '{}' has no arg '{}'", name, key));
}

void start(Device device) {
  CW_CHECK(!on(), "trace::start: a trace is already being recorded");
  Recorder& r = recorder();
  const uint64_t generation = r.generation + 1;
  r = Recorder{};
  r.device = device;
  r.generation = generation;
  if (!device.is_cpu()) {
    gpu::trace_marks_clear();
    gpu::trace_mark(device.index, -1, false);  // mark 0: the origin, on the compute stream
  }
  r.origin = std::chrono::steady_clock::now();
  detail::g_on = true;
}

Recording stop() {
  CW_CHECK(on(), "trace::stop: no trace is being recorded (trace::start first)");
  detail::g_on = false;
  Recorder& r = recorder();
  Recording out;
  out.device = r.device;
  std::vector<double> ms;
  if (!r.device.is_cpu()) ms = gpu::trace_marks_resolve(r.device.index);  // waits for compute and copies
  for (Raw& e : r.events) {
    if (!e.closed) continue;  // a scope still open (an exception unwound past stop): no end, no event
    Event ev;
    ev.name = fill_placeholders(e.name, e.args);
    ev.cat = e.cat;
    ev.thread = e.thread;
    ev.args = std::move(e.args);
    if (r.device.is_cpu()) {
      ev.ts = e.t0;
      ev.dur = e.t1 - e.t0;
    } else {
      ev.ts = ms[e.m0] * 1e3;
      ev.dur = (ms[e.m1] - ms[e.m0]) * 1e3;
    }
    out.events.push_back(std::move(ev));
  }
  const uint64_t generation = r.generation;
  r = Recorder{};
  r.generation = generation;
  return out;
}

void TraceScope::open(const char* name, std::initializer_list<Arg> args) {
  Recorder& r = recorder();
  Raw e{name, "compute", Thread::compute, {}};
  for (const Arg& a : args) e.args.emplace_back(a.key, a.value);
  inherit_chunk(r, e.args);
  mark(r, e, false);
  index_ = static_cast<int64_t>(r.events.size());
  generation_ = r.generation;
  r.events.push_back(std::move(e));
  r.open.push_back(index_);
}

void TraceScope::close() {
  Recorder& r = recorder();
  if (!on() || generation_ != r.generation) return;  // the recording ended under us
  try {
    Raw& e = r.events[static_cast<size_t>(index_)];
    mark(r, e, true);
    e.closed = true;
  } catch (...) {
    // A failed mark (the device in error) loses this event; the error itself surfaces elsewhere.
  }
  if (!r.open.empty() && r.open.back() == index_) r.open.pop_back();
}

void CopyScope::open(Device device, bool to_device, const char* what, int item, size_t bytes) {
  Recorder& r = recorder();
  if (bytes == 0 || !(device == r.device)) return;
  Raw e{fmt::format("{} {} {{item}}", to_device ? "fetch" : "store", what), "copy",
        to_device ? Thread::copies_in : Thread::copies_out, {}};
  e.args.emplace_back("item", item);
  e.args.emplace_back("bytes", static_cast<int64_t>(bytes));
  inherit_chunk(r, e.args);
  mark(r, e, false);
  index_ = static_cast<int64_t>(r.events.size());
  generation_ = r.generation;
  r.events.push_back(std::move(e));
}

void CopyScope::close() {
  Recorder& r = recorder();
  if (!on() || generation_ != r.generation) return;  // the recording ended under us
  try {
    Raw& e = r.events[static_cast<size_t>(index_)];
    mark(r, e, true);
    e.closed = true;
  } catch (...) {
  }
}

std::string Recording::json() const {
  using nlohmann::json;
  const int pid = pid_of(device);
  json list = json::array();
  list.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0},
                    {"args", {{"name", device_name(device)}}}});
  for (const auto& [tid, name] : {std::pair{Thread::compute, "compute"}, std::pair{Thread::copies_in, "copies in"},
                                  std::pair{Thread::copies_out, "copies out"}}) {
    list.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", static_cast<int>(tid)},
                      {"args", {{"name", name}}}});
    list.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", static_cast<int>(tid)},
                      {"args", {{"sort_index", static_cast<int>(tid)}}}});
  }
  for (const Event& e : events) {
    json args = json::object();
    for (const auto& [k, v] : e.args) args[k] = v;
    list.push_back({{"name", e.name}, {"cat", e.cat}, {"ph", "X"}, {"ts", e.ts}, {"dur", e.dur}, {"pid", pid},
                      {"tid", static_cast<int>(e.thread)}, {"args", std::move(args)}});
  }
  return json{{"traceEvents", std::move(list)}, {"displayTimeUnit", "ms"}}.dump() + "\n";
}

void Recording::write(const std::string& path) const {
  std::ofstream f(path, std::ios::binary);
  if (!f) fail(fmt::format("trace: cannot write '{}'", path), "check the directory exists and is writable");
  f << json();
  if (!f) fail(fmt::format("trace: writing '{}' failed", path), "check the disk has space");
}

}  // namespace cw::trace
