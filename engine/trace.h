// Trace: a timeline of one training step, written as Chrome trace JSON (chrome://tracing, Perfetto).
//
// A process-wide recorder, off by default. Off, every instrumentation point costs one branch on a
// global flag and records nothing. trace::start(device) turns it on for one device; trace::stop()
// waits for the device, turns it off and returns the recording, whose write(path) saves the JSON.
//
// What is recorded:
//   TraceScope     a compute phase, begin to end of the C++ scope, on the "compute" thread;
//   CopyScope      a host <-> device copy of the residency layer (engine/residency.h), on the
//                  "copies in" (fetch) or "copies out" (store) thread, with its bytes.
// Names are templates whose {key} placeholders are replaced by the event's integer args when it is
// written: TraceScope s("layer {layer} forward", {{"layer", l}, {"t0", t0}, {"t1", t1}}). An event
// that has no "chunk" arg takes the one of the innermost open scope that has it, so a layer phase or
// a copy names the chunk it ran in.
// The phases instrumented (optim/chunks.cpp, model/llama.cpp): "prefill chunk i", "backprop chunk i"
// (a reverse-sweep chunk: recompute and backward), inside them "layer l forward" (a forward keeping
// nothing: the prefill), "layer l recompute" (a forward keeping activations for the backward: seco's
// and spaco's recompute; for full and checkpointed it is the forward itself), "layer l backward"
// (with checkpointing, the layer's recompute inside it) and "lm head + loss"; the copies
// (engine/residency.cpp) "fetch kv layer l" / "store kv layer l" and, with checkpointed offload,
// "fetch input layer l" / "store input layer l".
// Times: on a GPU, CUDA events recorded on the stream the work runs on (a phase's events on the
// compute stream, a copy's on its copy lane, its begin mark after the copy's waits for the compute
// queued before it and for the copies it must follow), so the timeline shows when the device did the work, not when the host queued
// it; resolved once, in stop(), against an event recorded in start() (cudaEventElapsedTime: ~0.5 us
// resolution, float milliseconds). On the CPU, the host's steady clock; CPU copies are memcpys at the
// call, so they never overlap compute there.
// Output: {"traceEvents": [...], "displayTimeUnit": "ms"}: "X" (complete) events with ts and dur in
// microseconds from start(), pid = the device (0 for the CPU, 1 + index for cuda:index), tid 1 =
// "compute", 2 = "copies in", 3 = "copies out", cat "compute" or "copy", args the event's integer
// args; plus "M" metadata naming the process (the device) and the three threads.
// The recorder serves one host thread (the one that trains); it is not a profiler of kernels
// (nsys does that): its events are the engine's named phases.
#pragma once

#include "engine/tensor.h"

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace cw::trace {

namespace detail {
extern bool g_on;  // the one branch every instrumentation point takes
}  // namespace detail

inline bool on() { return detail::g_on; }

enum class Thread : int { compute = 1, copies_in = 2, copies_out = 3 };

struct Arg {
  const char* key;
  int64_t value;
};

// One event of a finished recording.
struct Event {
  std::string name, cat;  // name with its placeholders filled in
  Thread thread = Thread::compute;
  double ts = 0, dur = 0;  // microseconds from start()
  std::vector<std::pair<std::string, int64_t>> args;

  bool has(const std::string& key) const;
  int64_t arg(const std::string& key) const;  // a clear error when absent
};

struct Recording {
  Device device;
  std::vector<Event> events;  // in the order the host opened them

  std::string json() const;              // the Chrome trace JSON
  void write(const std::string& path) const;
};

// Starts recording the work of `device` (clearing any earlier recording). Throws if already on.
void start(Device device);
// Waits for everything queued on the device (compute and copies), turns recording off and returns
// the events. Throws if not on.
Recording stop();

// A compute phase: from construction to destruction, on the device's compute stream.
class TraceScope {
 public:
  TraceScope(const char* name, std::initializer_list<Arg> args = {}) {
    if (on()) open(name, args);
  }
  ~TraceScope() { end(); }
  // Ends the phase before the scope does (once; the destructor then records nothing).
  void end() {
    if (index_ >= 0) close();
    index_ = -1;
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  void open(const char* name, std::initializer_list<Arg> args);
  void close();
  int64_t index_ = -1;
  uint64_t generation_ = 0;
};

// A copy between host and device memory: from construction to destruction, on one of the device's
// copy lanes: a "fetch" (to_device: host -> device, the lane in) or a "store" (device -> host, the lane
// out). `what` names the items ("kv layer"), `bytes` is what the scope copies (nothing is recorded for
// 0 bytes). Only the recorded device's copies are traced.
class CopyScope {
 public:
  CopyScope(Device device, bool to_device, const char* what, int item, size_t bytes) {
    if (on()) open(device, to_device, what, item, bytes);
  }
  ~CopyScope() {
    if (index_ >= 0) close();
  }
  CopyScope(const CopyScope&) = delete;
  CopyScope& operator=(const CopyScope&) = delete;

 private:
  void open(Device device, bool to_device, const char* what, int item, size_t bytes);
  void close();
  int64_t index_ = -1;
  uint64_t generation_ = 0;
};

}  // namespace cw::trace

namespace cw {
using trace::TraceScope;
}  // namespace cw
