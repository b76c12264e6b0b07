// Residency: what lives where, and when it moves.
//
// A Residency owns `items` (e.g. a model's layers), each made of `parts` (e.g. K, V, dK, dV) of fixed
// byte sizes. Every part has its home in host memory (pinned when the device is a GPU, so copies are
// asynchronous). A bounded number of device slots hold the items in use; an item in a slot is
// "resident". The caller moves bytes at named points:
//   fetch(item, spans)   make the item resident (taking the least recently used other slot; nothing is
//                        written back implicitly: the caller stores what it changed) and copy the
//                        spans host -> device; a span marked `zero` is a home whose bytes are logical
//                        zeros (the caller has not written it since it last cleared it): its device
//                        bytes are set to zero instead, so the home is never cleared or read; a span
//                        may be a run of rows at a pitch (one row of every sequence or head);
//   ready(item)          the compute stream waits until every copy into or out of the item's slot
//                        has finished (call it before compute overwrites the slot);
//   ready_to_read(item)  the compute stream waits until every copy into the slot has finished (call
//                        it before compute only reads the slot: a store out of it may go on);
//   store(item, spans)   copy the spans device -> host behind the compute queued so far.
// Ordering (GPU): fetches run in order on the device's "in" copy lane and stores on its "out" lane
// (engine/cuda/runtime.h), so the two directions of the bus work at once; each fetch's or store's
// spans run as one batch after everything the compute stream had queued when it was issued, so a
// fetch never overwrites a slot that queued compute still reads, and a store never copies bytes
// compute has not finished writing. Between the lanes, per slot and part: a fetch into a part waits
// for the last store out of it, and a store for the last fetch into it (a fetch of a slot's saved
// outputs need not wait for its dK, dV going home). The host never blocks, and issues one batch (one
// pair of events) a call, a strided span as one 2-d copy. On a CPU "device" (tests) the slots are host memory and every copy
// is a memcpy at the call, so the same schedule logic runs exactly in f64.
// Every fetch and store that moves bytes is one copy event of a trace (engine/trace.h).
// Tested through its users: the K/V store and the checkpointed input offload (tests/optim/test_schedules.cpp,
// tests/model/test_cuda_model.cpp) and the trace of copies (tests/engine/test_trace.cpp).
#pragma once

#include "engine/engine.h"
#include "engine/memory.h"
#include "engine/tensor.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cw {

class Residency {
 public:
  struct Span {
    int part;
    size_t offset, bytes;  // within the part: the first row's
    bool zero = false;     // fetch: set the device bytes to zero instead of copying the home's
    size_t rows = 1;       // rows of `bytes`, row r at offset + r pitch (the same layout at home and in a slot)
    size_t pitch = 0;
  };

  // `what` names an item in traces (engine/trace.h): "kv layer" gives copies "fetch kv layer 3".
  Residency(Device device, std::vector<size_t> part_bytes, int items, int slots, const char* what = "item");
  ~Residency();
  Residency(const Residency&) = delete;
  Residency& operator=(const Residency&) = delete;

  void* host(int item, int part) const;
  void* device(int item, int part) const;  // the item must be resident
  bool resident(int item) const { return slot_of_[static_cast<size_t>(item)] >= 0; }

  // Claims a slot for `item` if it has none (evicting the least recently used other item) and copies
  // the spans in. Returns whether the item was already resident.
  bool fetch(int item, const std::vector<Span>& spans);
  void ready(int item);
  void ready_to_read(int item);
  void store(int item, const std::vector<Span>& spans);
  // Forgets every slot's item (their device bytes become garbage); pending copies stay ordered.
  void evict_all();
  // The host waits until all queued compute and every copy are done (before touching host homes).
  void wait_idle();

  Device device() const { return device_; }
  int items() const { return static_cast<int>(slot_of_.size()); }
  int slots() const { return static_cast<int>(slot_item_.size()); }
  size_t item_bytes() const;
  size_t host_bytes() const { return item_bytes() * static_cast<size_t>(items()); }
  size_t device_bytes() const { return item_bytes() * static_cast<size_t>(slots()); }
  size_t bytes_moved() const { return bytes_moved_; }  // host <-> device, since construction (zeroed spans not)

 private:
  // Moves the spans between item `item`'s home and its slot (to_device: home -> slot, zeroing spans so
  // marked) as one batch on its lane, after the other lane's last copies of the same parts.
  void move(int item, const std::vector<Span>& spans, bool to_device);
  // The compute stream waits for the slot's copies in (and, `out`, out) not yet waited for; of an
  // item's slot, which becomes the most recently used.
  void wait_for_slot(int slot, bool out);
  void wait_for_item(int item, bool out);

  Device device_;
  const char* what_;
  std::vector<size_t> part_bytes_;
  std::vector<StagingBuffer> host_;               // [part], every item's: pinned on a GPU (engine.h)
  std::vector<std::vector<Buffer>> slots_;        // [slot][part]: device memory
  std::vector<int> slot_of_;               // item -> slot or -1
  std::vector<int> slot_item_;             // slot -> item or -1
  std::vector<uint64_t> slot_used_;        // slot -> last use (LRU clock)
  // [slot][part]: the last copy into / out of it not yet waited for by the compute stream (0: none).
  std::vector<std::vector<uint64_t>> fetch_ticket_, store_ticket_;
  uint64_t clock_ = 0;
  size_t bytes_moved_ = 0;
};

// Bytes of host memory the operating system can still give (MemAvailable), or 0 if unknown.
size_t host_memory_available();
// Bytes of host memory the machine has in all (physical pages), or 0 if unknown.
size_t host_memory_total();
// The share of that a run may pin: pinned pages cannot be swapped, so the system keeps the rest (a
// clear error before the step, never a swap storm). The K/V offload's check and the planner use it.
inline constexpr double kPinnableHostShare = 0.9;

}  // namespace cw
