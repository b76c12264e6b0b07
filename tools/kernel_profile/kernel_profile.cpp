// Kernel profile: where a process's GPU time goes, kernel by kernel.
//
// A library CUDA loads into any process at its first CUDA call:
//
//   CUDA_INJECTION64_PATH=build/tools/libcw_kernel_profile.so chunkwise bench ...
//   CUDA_INJECTION64_PATH=build/tools/libcw_kernel_profile.so python tools/bench/hf_reference.py ...
//
// so our steps and the peer's (torch, Triton, cuDNN, cuBLAS) are measured by the same clock. It records
// every kernel, copy and memset through CUPTI's activity API (kernels keep running concurrently; the
// records carry the GPU's own start and end times). What it reports is the ranges between
// cudaProfilerStart and cudaProfilerStop, which `chunkwise bench` and the Python benchmarks open around
// each timed step; a process that opens none is reported whole.
//
// At exit it prints, per range (a timed step): the range's time, the GPU's busy time (the union of the
// kernels' intervals), the kernel time by kind (matmul, attention, other), and one line per kernel name
// (time per range, share, calls, mean). Settings (environment; engine/env.h lists them, and this
// library reads them through env::value, leniently: it runs inside processes that are not ours, where
// it must not throw):
//   CW_KERNEL_PROFILE=PATH   also write PATH.csv (every kernel name: kind, calls, total ns) and PATH.txt
//                            (the printed summary); without it the summary goes to stderr only
//   CW_KERNEL_PROFILE_TOP=N  the summary's kernel lines (default 40)
//   CW_KERNEL_PROFILE_API=1  also record the host's CUDA runtime and driver calls and print, per range, the
//                            host thread's time inside them by call (a call that blocks, a synchronize or a
//                            synchronous copy, shows here as the reason the GPU's queue ran dry); each gap
//                            split by when the host launched the kernel that ended it (late, launching, or
//                            queued behind something on the GPU); and the memsets by the kernel after them
#include "engine/env.h"

#include <cupti.h>

#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Interval {
  uint64_t start, end;
};

enum class Kind { matmul, attention, other };

const char* kind_name(Kind k) { return k == Kind::matmul ? "matmul" : k == Kind::attention ? "attention" : "other"; }

// The kind from a kernel's name: cuBLAS's Hopper kernels are nvjet_* and sm90_xmma_*, CUTLASS's cutlass*;
// attention is cuDNN's generated SDPA graphs, FlashAttention's and ours (flash / fmha / attention).
Kind kind_of(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("attention_merge")) return Kind::other;
  if (has("nvjet") || has("gemm") || has("xmma") || has("cutlass") || has("cublas") || has("Gemm")) return Kind::matmul;
  if (has("sdpa") || has("fmha") || has("flash") || has("attention") || has("attn") || has("_fwd_kernel") ||
      has("_bwd_kernel"))
    return Kind::attention;
  return Kind::other;
}

std::string demangled(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d ? d : name;
  std::free(d);
  return out;
}

struct KernelRecord {
  int name;  // index into State::names
  Interval t;
  uint32_t correlation;  // the launching API call's
  uint32_t stream;
};

struct CopyRecord {
  uint8_t copy_kind;  // CUpti_ActivityMemcpyKind
  uint64_t bytes;
  Interval t;
  uint32_t stream;
};

struct MemsetRecord {
  Interval t;
  uint32_t stream;
};

struct ApiRecord {
  uint8_t driver;  // 1: driver API, 0: runtime API
  uint32_t cbid;
  uint32_t thread;
  Interval t;
  uint32_t correlation;
};

struct State {
  std::mutex mu;
  std::vector<ApiRecord> api;
  std::vector<std::string> names;
  std::unordered_map<const char*, int> name_of_ptr;  // CUPTI shares one name string per kernel
  std::vector<KernelRecord> kernels;
  std::vector<CopyRecord> copies;
  std::vector<Interval> ranges;  // the last one is open while its end is 0
  std::vector<MemsetRecord> memsets;
  bool reported = false;
};

State& state() {
  static State* s = new State;  // never destroyed: the report runs at exit
  return *s;
}

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel profile: %s failed: %s\n", what, msg ? msg : "unknown CUPTI error");
}

constexpr size_t kBufferBytes = 8 << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  State& s = state();
  {
    std::lock_guard lock(s.mu);
    CUpti_Activity* rec = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
      switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        case CUPTI_ACTIVITY_KIND_KERNEL: {
          const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
          auto [it, added] = s.name_of_ptr.try_emplace(k->name, static_cast<int>(s.names.size()));
          if (added) s.names.push_back(demangled(k->name ? k->name : "?"));
          s.kernels.push_back({it->second, {k->start, k->end}, k->correlationId, k->streamId});
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
          s.copies.push_back({m->copyKind, m->bytes, {m->start, m->end}, m->streamId});
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
          s.memsets.push_back({{m->start, m->end}, m->streamId});
          break;
        }
        case CUPTI_ACTIVITY_KIND_RUNTIME:
        case CUPTI_ACTIVITY_KIND_DRIVER: {
          const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
          s.api.push_back({static_cast<uint8_t>(rec->kind == CUPTI_ACTIVITY_KIND_DRIVER), a->cbid, a->threadId,
                           {a->start, a->end}, a->correlationId});
          break;
        }
        default:
          break;
      }
    }
  }
  std::free(buffer);
}

// cudaProfilerStart / Stop (the runtime's calls reach the driver's): a range opens after the start
// returns and closes as the stop is entered; the callers synchronize before stopping, so the range's
// kernels have ended by then.
void CUPTIAPI on_api(void*, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API) return;
  const auto* cb = static_cast<const CUpti_CallbackData*>(data);
  uint64_t now = 0;
  State& s = state();
  if (id == CUPTI_DRIVER_TRACE_CBID_cuProfilerStart && cb->callbackSite == CUPTI_API_EXIT) {
    cuptiGetTimestamp(&now);
    std::lock_guard lock(s.mu);
    if (s.ranges.empty() || s.ranges.back().end != 0) s.ranges.push_back({now, 0});
  } else if (id == CUPTI_DRIVER_TRACE_CBID_cuProfilerStop && cb->callbackSite == CUPTI_API_ENTER) {
    cuptiGetTimestamp(&now);
    {
      std::lock_guard lock(s.mu);
      if (!s.ranges.empty() && s.ranges.back().end == 0) s.ranges.back().end = now;
    }
    cuptiActivityFlushAll(0);
  }
}

// Sorted, merged intervals.
std::vector<Interval> merged(std::vector<Interval> v) {
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.start < b.start; });
  std::vector<Interval> out;
  for (const Interval& i : v) {
    if (!out.empty() && i.start <= out.back().end)
      out.back().end = std::max(out.back().end, i.end);
    else
      out.push_back(i);
  }
  return out;
}

uint64_t length(const std::vector<Interval>& v) {
  uint64_t n = 0;
  for (const Interval& i : v) n += i.end - i.start;
  return n;
}

// The part of [t.start, t.end) inside the ranges (sorted, disjoint).
uint64_t inside(const Interval& t, const std::vector<Interval>& ranges) {
  uint64_t n = 0;
  for (const Interval& r : ranges) {
    const uint64_t b = std::max(t.start, r.start), e = std::min(t.end, r.end);
    if (e > b) n += e - b;
  }
  return n;
}

std::string shortened(const std::string& name, size_t width) {
  return name.size() <= width ? name : name.substr(0, width - 3) + "...";
}

void report() {
  State& s = state();
  cuptiActivityFlushAll(1);
  std::lock_guard lock(s.mu);
  if (s.reported) return;
  s.reported = true;
  if (s.kernels.empty()) return;
  std::vector<Interval> ranges;
  for (const Interval& r : s.ranges)
    if (r.end > r.start) ranges.push_back(r);
  const bool whole = ranges.empty();
  if (whole) {  // no range opened: the whole run, first kernel to last
    Interval all{UINT64_MAX, 0};
    for (const KernelRecord& k : s.kernels) all.start = std::min(all.start, k.t.start), all.end = std::max(all.end, k.t.end);
    ranges.push_back(all);
  }
  ranges = merged(ranges);
  const double n_ranges = static_cast<double>(s.ranges.empty() ? 1 : ranges.size());
  const uint64_t span = length(ranges);

  struct Row {
    uint64_t ns = 0;
    int64_t calls = 0;
  };
  std::vector<Row> rows(s.names.size());
  std::vector<Interval> busy;
  uint64_t by_kind[3] = {0, 0, 0};
  for (const KernelRecord& k : s.kernels) {
    const uint64_t ns = inside(k.t, ranges);
    if (ns == 0) continue;
    rows[k.name].ns += ns;
    rows[k.name].calls += 1;
    busy.push_back(k.t);
  }
  std::vector<Kind> kinds(s.names.size());
  for (size_t i = 0; i < s.names.size(); ++i) {
    kinds[i] = kind_of(s.names[i]);
    by_kind[static_cast<int>(kinds[i])] += rows[i].ns;
  }
  // Busy: the union of the kernels' intervals, clipped to the ranges.
  uint64_t busy_ns = 0;
  for (const Interval& b : merged(busy)) busy_ns += inside(b, ranges);
  uint64_t copy_ns[4] = {0, 0, 0, 0}, copy_bytes[4] = {0, 0, 0, 0};  // host->device, device->host, device->device, other
  for (const CopyRecord& c : s.copies) {
    const uint64_t ns = inside(c.t, ranges);
    if (ns == 0) continue;
    const int slot = c.copy_kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? 0
                     : c.copy_kind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? 1
                     : c.copy_kind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD ? 2
                                                                      : 3;
    copy_ns[slot] += ns;
    copy_bytes[slot] += c.bytes;
  }
  uint64_t memset_ns = 0;
  for (const MemsetRecord& m : s.memsets) memset_ns += inside(m.t, ranges);
  const uint64_t kernel_ns = by_kind[0] + by_kind[1] + by_kind[2];

  std::string text;
  char line[512];
  auto ms = [&](uint64_t ns) { return static_cast<double>(ns) / 1e6 / n_ranges; };
  std::snprintf(line, sizeof line, "kernel profile: %s, %.1f ms per range; GPU busy %.1f ms (%.1f%%)\n",
                whole ? "the whole run (no cudaProfilerStart range)"
                      : (std::to_string(ranges.size()) + " ranges (cudaProfilerStart..Stop)").c_str(),
                ms(span), ms(busy_ns), 100.0 * static_cast<double>(busy_ns) / static_cast<double>(span));
  text += line;
  std::snprintf(line, sizeof line, "  kernel time per range: %.1f ms; matmul %.1f (%.1f%%), attention %.1f (%.1f%%), other %.1f (%.1f%%)\n",
                ms(kernel_ns), ms(by_kind[0]), 100.0 * by_kind[0] / kernel_ns, ms(by_kind[1]), 100.0 * by_kind[1] / kernel_ns,
                ms(by_kind[2]), 100.0 * by_kind[2] / kernel_ns);
  text += line;
  std::snprintf(line, sizeof line,
                "  copies per range: host->device %.1f ms (%.2f GB), device->host %.1f ms (%.2f GB), device->device %.1f ms "
                "(%.2f GB); memsets %.1f ms\n",
                ms(copy_ns[0]), copy_bytes[0] / 1e9 / n_ranges, ms(copy_ns[1]), copy_bytes[1] / 1e9 / n_ranges,
                ms(copy_ns[2]), copy_bytes[2] / 1e9 / n_ranges, ms(memset_ns));
  text += line;
  std::vector<size_t> order;
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i].calls > 0) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return rows[a].ns > rows[b].ns; });
  const char* top_env = cw::env::value(cw::env::kKernelProfileTop);
  const size_t top = top_env ? static_cast<size_t>(std::atol(top_env)) : 40;
  text += "  ms/range  share  calls/range  mean us  kind       kernel\n";
  for (size_t j = 0; j < order.size() && j < top; ++j) {
    const size_t i = order[j];
    std::snprintf(line, sizeof line, "  %8.2f  %4.1f%%  %11.1f  %7.1f  %-9s  %s\n", ms(rows[i].ns),
                  100.0 * rows[i].ns / kernel_ns, rows[i].calls / n_ranges, rows[i].ns / 1e3 / rows[i].calls,
                  kind_name(kinds[i]), shortened(s.names[i], 150).c_str());
    text += line;
  }
  if (order.size() > top) {
    uint64_t rest = 0;
    for (size_t j = top; j < order.size(); ++j) rest += rows[order[j]].ns;
    std::snprintf(line, sizeof line, "  %8.2f  %4.1f%%  (%zu more kernels)\n", ms(rest), 100.0 * rest / kernel_ns,
                  order.size() - top);
    text += line;
  }
  // Where the GPU sat idle: each gap between kernels (inside one range) counted against the kernel that
  // ended it, i.e. the work the GPU waited for (a copy, the host, an event).
  std::vector<const KernelRecord*> in_order;
  for (const KernelRecord& k : s.kernels)
    if (inside(k.t, ranges) > 0) in_order.push_back(&k);
  std::sort(in_order.begin(), in_order.end(), [](const KernelRecord* a, const KernelRecord* b) { return a->t.start < b->t.start; });
  // The gaps, once: [end of every kernel so far, start of the next), the kernel whose end began it and
  // the one that ended it; the tables below each read this list.
  struct Gap {
    Interval t;
    const KernelRecord* before;
    const KernelRecord* ended_by;
  };
  std::vector<Gap> gaps;
  const KernelRecord* last_end = nullptr;  // the kernel that has ended latest so far
  for (const KernelRecord* k : in_order) {
    if (last_end && k->t.start > last_end->t.end && inside({last_end->t.end, k->t.start}, ranges) > 0)
      gaps.push_back({{last_end->t.end, k->t.start}, last_end, k});
    if (!last_end || k->t.end > last_end->t.end) last_end = k;
  }
  std::vector<Row> idle_before(s.names.size());
  for (const Gap& g : gaps) {
    idle_before[g.ended_by->name].ns += inside(g.t, ranges);
    idle_before[g.ended_by->name].calls += 1;
  }
  std::vector<size_t> idle_order;
  for (size_t i = 0; i < idle_before.size(); ++i)
    if (idle_before[i].calls > 0) idle_order.push_back(i);
  std::sort(idle_order.begin(), idle_order.end(), [&](size_t a, size_t b) { return idle_before[a].ns > idle_before[b].ns; });
  text += "  idle: the GPU's gaps, by the kernel that ended them\n  ms/range  gaps/range  mean us  kernel\n";
  for (size_t j = 0; j < idle_order.size() && j < 12; ++j) {
    const size_t i = idle_order[j];
    std::snprintf(line, sizeof line, "  %8.2f  %10.1f  %7.1f  %s\n", ms(idle_before[i].ns), idle_before[i].calls / n_ranges,
                  idle_before[i].ns / 1e3 / idle_before[i].calls, shortened(s.names[i], 150).c_str());
    text += line;
  }
  if (!s.api.empty()) {
    // The host's CUDA calls inside the ranges, by name. A runtime call that enters the driver shows in both
    // domains; the table keeps them apart (R: runtime, D: driver).
    struct ApiRow {
      uint64_t ns = 0, max_ns = 0;
      int64_t calls = 0, over_20us = 0;
    };
    std::map<std::pair<int, uint32_t>, ApiRow> api_rows;
    for (const ApiRecord& a : s.api) {
      const uint64_t ns = inside(a.t, ranges);
      if (ns == 0) continue;
      ApiRow& r = api_rows[{a.driver, a.cbid}];
      r.ns += ns, r.calls += 1, r.max_ns = std::max(r.max_ns, ns), r.over_20us += ns > 20000;
    }
    std::vector<std::pair<std::pair<int, uint32_t>, ApiRow>> api_order(api_rows.begin(), api_rows.end());
    std::sort(api_order.begin(), api_order.end(), [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
    text += "  host CUDA calls (R runtime, D driver), by time inside them\n  ms/range  calls/range  mean us   max us  >20us/range  call\n";
    for (size_t j = 0; j < api_order.size() && j < 25; ++j) {
      const auto& [key, r] = api_order[j];
      const char* name = nullptr;
      cuptiGetCallbackName(key.first ? CUPTI_CB_DOMAIN_DRIVER_API : CUPTI_CB_DOMAIN_RUNTIME_API, key.second, &name);
      std::snprintf(line, sizeof line, "  %8.2f  %11.1f  %7.1f  %7.1f  %11.1f  %c %s\n", ms(r.ns), r.calls / n_ranges,
                    r.ns / 1e3 / r.calls, r.max_ns / 1e3, r.over_20us / n_ranges, key.first ? 'D' : 'R',
                    name ? name : "?");
      text += line;
    }
  }
  if (!s.api.empty()) {
    // Why the GPU ran dry: for each gap of at least 3 us, the host's time from the launch of the kernel
    // before the gap to the launch of the kernel ending it, on the launching thread, split into the
    // CUDA calls made in between (by name: a blocking call shows here) and the host's own code.
    std::unordered_map<uint32_t, const ApiRecord*> launch_of;
    for (const ApiRecord& a : s.api) launch_of.emplace(a.correlation, &a);
    std::map<std::string, uint64_t> between;  // call name (or "host code") -> ns, over all gaps
    uint64_t gaps_seen = 0, gap_ns = 0;
    std::map<uint32_t, std::vector<const ApiRecord*>> by_thread;
    for (const ApiRecord& a : s.api) by_thread[a.thread].push_back(&a);
    for (auto& [thread, v] : by_thread)
      std::sort(v.begin(), v.end(), [](const ApiRecord* a, const ApiRecord* b) { return a->t.start < b->t.start; });
    for (const Gap& g : gaps) {
      if (g.t.end - g.t.start < 3000) continue;
      {
        const auto a = launch_of.find(g.ended_by->correlation), b = launch_of.find(g.before->correlation);
        if (a != launch_of.end() && b != launch_of.end() && a->second->thread == b->second->thread &&
            a->second->t.start > b->second->t.end) {
          ++gaps_seen;
          gap_ns += g.t.end - g.t.start;
          const uint64_t h0 = b->second->t.end, h1 = a->second->t.start;
          uint64_t in_calls = 0;
          const auto& v = by_thread[a->second->thread];
          auto it = std::lower_bound(v.begin(), v.end(), h0,
                                     [](const ApiRecord* r, uint64_t t) { return r->t.start < t; });
          for (; it != v.end() && (*it)->t.start < h1; ++it) {
            const ApiRecord& r = **it;
            if (r.driver) continue;  // a runtime call's driver calls are inside it
            const uint64_t ns = std::min(r.t.end, h1) - r.t.start;
            const char* name = nullptr;
            cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, r.cbid, &name);
            between[name ? name : "?"] += ns;
            in_calls += ns;
          }
          between["(host code, no CUDA call)"] += (h1 - h0) - std::min(h1 - h0, in_calls);
        }
      }
    }
    std::vector<std::pair<std::string, uint64_t>> order_b(between.begin(), between.end());
    std::sort(order_b.begin(), order_b.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    std::snprintf(line, sizeof line,
                  "  why the GPU ran dry: %.1f gaps of >= 3 us per range (%.2f ms); the host between the launches "
                  "around them, per range:\n",
                  gaps_seen / n_ranges, ms(gap_ns));
    text += line;
    for (size_t j = 0; j < order_b.size() && j < 15; ++j) {
      std::snprintf(line, sizeof line, "  %8.2f ms  %s\n", ms(order_b[j].second), order_b[j].first.c_str());
      text += line;
    }
    // Each gap split by when the host asked for the kernel that ended it: before the host began its
    // launch call (the host was late), from that call to the kernel's start (launch latency), or queued
    // before the gap began (the GPU waited on something else: an event, a stream, a memset or copy on
    // the kernel's own stream, shown apart).
    struct GapSplit {
      uint64_t n = 0, total = 0, host = 0, launching = 0, queued = 0, filled = 0;
    };
    std::vector<GapSplit> split(s.names.size());
    std::map<uint32_t, std::vector<Interval>> fillers;  // per stream: memsets and copies
    for (const MemsetRecord& m : s.memsets) fillers[m.stream].push_back(m.t);
    for (const CopyRecord& c : s.copies) fillers[c.stream].push_back(c.t);
    for (auto& [stream, v] : fillers) v = merged(std::move(v));
    for (const Gap& gap : gaps) {
      const KernelRecord* k = gap.ended_by;
      const uint64_t g0 = gap.t.start, g1 = gap.t.end;
      const auto a = launch_of.find(k->correlation);
      if (a == launch_of.end()) continue;
      GapSplit& g = split[k->name];
      const uint64_t len = g1 - g0, call = a->second->t.start;
      g.n += 1, g.total += len;
      if (call >= g1) g.host += len;
      else if (call > g0) g.host += call - g0, g.launching += g1 - call;
      else if (a->second->t.end > g0) g.launching += len;
      else g.queued += len;
      if (auto f = fillers.find(k->stream); f != fillers.end()) g.filled += inside({g0, g1}, f->second);
    }
    std::vector<size_t> split_order;
    for (size_t i = 0; i < split.size(); ++i)
      if (split[i].n > 0) split_order.push_back(i);
    std::sort(split_order.begin(), split_order.end(), [&](size_t a, size_t b) { return split[a].total > split[b].total; });
    text += "  the gaps by the kernel that ended them, split by when the host launched it (ms per range):\n"
            "     total   host late  launching  queued  (memset/copy on its stream)  gaps  kernel\n";
    for (size_t j = 0; j < split_order.size() && j < 12; ++j) {
      const GapSplit& g = split[split_order[j]];
      std::snprintf(line, sizeof line, "  %8.2f  %9.2f  %9.2f  %7.2f  %27.2f  %5.0f  %s\n", ms(g.total), ms(g.host),
                    ms(g.launching), ms(g.queued), ms(g.filled), g.n / n_ranges,
                    shortened(s.names[split_order[j]], 110).c_str());
      text += line;
    }
    // Memsets, by the kernel that next starts on their stream (who asked for them, when the
    // launching code is a library's).
    std::map<uint32_t, std::vector<const KernelRecord*>> kernels_of_stream;
    for (const KernelRecord* k : in_order) kernels_of_stream[k->stream].push_back(k);
    std::vector<Row> memset_before(s.names.size());
    for (const MemsetRecord& m : s.memsets) {
      if (inside(m.t, ranges) == 0) continue;
      auto it = kernels_of_stream.find(m.stream);
      if (it == kernels_of_stream.end()) continue;
      const auto& v = it->second;
      auto next = std::lower_bound(v.begin(), v.end(), m.t.end,
                                   [](const KernelRecord* k, uint64_t t) { return k->t.start < t; });
      if (next == v.end()) continue;
      memset_before[(*next)->name].ns += m.t.end - m.t.start;
      memset_before[(*next)->name].calls += 1;
    }
    std::vector<size_t> memset_order;
    for (size_t i = 0; i < memset_before.size(); ++i)
      if (memset_before[i].calls > 0) memset_order.push_back(i);
    std::sort(memset_order.begin(), memset_order.end(),
              [&](size_t a, size_t b) { return memset_before[a].calls > memset_before[b].calls; });
    text += "  memsets by the next kernel on their stream\n  memsets/range  ms/range  kernel\n";
    for (size_t j = 0; j < memset_order.size() && j < 8; ++j) {
      const size_t i = memset_order[j];
      std::snprintf(line, sizeof line, "  %13.1f  %8.2f  %s\n", memset_before[i].calls / n_ranges, ms(memset_before[i].ns),
                    shortened(s.names[i], 120).c_str());
      text += line;
    }
  }
  std::fputs(text.c_str(), stderr);
  if (const char* path = cw::env::value(cw::env::kKernelProfile)) {
    const std::string base = path;
    if (FILE* f = std::fopen((base + ".txt").c_str(), "w")) std::fputs(text.c_str(), f), std::fclose(f);
    if (FILE* f = std::fopen((base + ".csv").c_str(), "w")) {
      std::fprintf(f, "kind,calls_per_range,ns_per_range,kernel\n");
      for (size_t i : order) {
        std::string quoted;  // CSV: a quote inside a field is doubled
        for (char ch : s.names[i]) quoted += ch == '"' ? std::string("\"\"") : std::string(1, ch);
        std::fprintf(f, "%s,%.2f,%.0f,\"%s\"\n", kind_name(kinds[i]), rows[i].calls / n_ranges, rows[i].ns / n_ranges,
                     quoted.c_str());
      }
      std::fclose(f);
    }
  }
}

}  // namespace

// CUDA calls this once, when the process initializes the driver, for the library named by CUDA_INJECTION64_PATH.
extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enabling kernel records");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enabling copy records");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enabling memset records");
  if (const char* api = cw::env::value(cw::env::kKernelProfileApi); api && std::strcmp(api, "1") == 0) {
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enabling runtime API records");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER), "enabling driver API records");
  }
  CUpti_SubscriberHandle subscriber;
  check(cuptiSubscribe(&subscriber, reinterpret_cast<CUpti_CallbackFunc>(on_api), nullptr), "cuptiSubscribe");
  check(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStart),
        "the cuProfilerStart callback");
  check(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStop),
        "the cuProfilerStop callback");
  std::atexit(report);
  return 1;
}
