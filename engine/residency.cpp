#include "engine/residency.h"

#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "engine/trace.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>

namespace cw {

Residency::Residency(Device device, std::vector<size_t> part_bytes, int items, int slots, const char* what)
    : device_(device), what_(what), part_bytes_(std::move(part_bytes)) {
  CW_CHECK(items > 0 && slots > 0 && slots <= items, "residency: {} slots for {} items", slots, items);
  // One pinned allocation per part for all items (item i's at i x the part's bytes): a streamed K/V
  // store has thousands of items, and pinning is a slow call per allocation.
  for (size_t b : part_bytes_) {
    host_.emplace_back(b * static_cast<size_t>(items), device_);
    // Zeroed on the cores' threads (a million-token store is about 100 GB).
    char* base = static_cast<char*>(host_.back().data());
    const int64_t total = static_cast<int64_t>(host_.back().bytes()), piece = int64_t{64} << 20;
#pragma omp parallel for schedule(static) if (total > piece)
    for (int64_t at = 0; at < total; at += piece) std::memset(base + at, 0, static_cast<size_t>(std::min(piece, total - at)));
  }
  for (int s = 0; s < slots; ++s) {
    auto& parts = slots_.emplace_back();
    for (size_t b : part_bytes_) parts.emplace_back(b, device_);
  }
  slot_of_.assign(static_cast<size_t>(items), -1);
  slot_item_.assign(static_cast<size_t>(slots), -1);
  slot_used_.assign(static_cast<size_t>(slots), 0);
  fetch_ticket_.assign(static_cast<size_t>(slots), std::vector<uint64_t>(part_bytes_.size(), 0));
  store_ticket_ = fetch_ticket_;
}

Residency::~Residency() {
  wait_idle();  // no kernel or copy may still read or write what the members free after this
}

size_t Residency::item_bytes() const {
  size_t n = 0;
  for (size_t b : part_bytes_) n += b;
  return n;
}

void* Residency::host(int item, int part) const {
  return static_cast<char*>(host_[static_cast<size_t>(part)].data()) +
         static_cast<size_t>(item) * part_bytes_[static_cast<size_t>(part)];
}

void* Residency::device(int item, int part) const {
  const int s = slot_of_[static_cast<size_t>(item)];
  CW_CHECK(s >= 0, "residency: item {} is not on the device (fetch it first)", item);
  return slots_[static_cast<size_t>(s)][static_cast<size_t>(part)].data();
}

void Residency::move(int item, const std::vector<Span>& spans, bool to_device) {
  const size_t slot = static_cast<size_t>(slot_of_[static_cast<size_t>(item)]);
  std::vector<char> touched(part_bytes_.size(), 0);
  size_t moved = 0;  // bytes copied (a zeroed span moves none)
  for (const Span& sp : spans) {
    CW_CHECK(sp.rows >= 1 && (sp.rows == 1 || sp.pitch >= sp.bytes) &&
                 sp.offset + (sp.rows - 1) * sp.pitch + sp.bytes <= part_bytes_[static_cast<size_t>(sp.part)],
             "residency: span beyond part {}", sp.part);
    if (sp.bytes != 0) touched[static_cast<size_t>(sp.part)] = 1;
    if (!(to_device && sp.zero)) moved += sp.bytes * sp.rows;
  }
  bytes_moved_ += moved;
  // The other lane's last copy of each part this batch touches goes first (before the trace's mark).
  const gpu::CopyLane lane = to_device ? gpu::CopyLane::in : gpu::CopyLane::out;
  if (!device_.is_cpu()) {
    const auto& other = to_device ? store_ticket_[slot] : fetch_ticket_[slot];
    std::vector<uint64_t> after;
    for (size_t p = 0; p < touched.size(); ++p)
      if (touched[p] && other[p] != 0) after.push_back(other[p]);
    gpu::lane_wait_for_copies(after, lane, device_.index);
  }
  trace::CopyScope traced(device_, to_device, what_, item, moved);
  std::vector<gpu::SideCopy> batch;
  for (const Span& sp : spans) {
    if (sp.bytes == 0) continue;
    char* slot_bytes = static_cast<char*>(slots_[slot][static_cast<size_t>(sp.part)].data()) + sp.offset;
    char* home = static_cast<char*>(host(item, sp.part)) + sp.offset;
    const bool zero = to_device && sp.zero;
    if (device_.is_cpu()) {  // at the call: the same schedule logic, exactly
      for (size_t r = 0; r < sp.rows; ++r) {
        char* dst = (to_device ? slot_bytes : home) + r * sp.pitch;
        if (zero) std::memset(dst, 0, sp.bytes);
        else std::memcpy(dst, (to_device ? home : slot_bytes) + r * sp.pitch, sp.bytes);
      }
      continue;
    }
    batch.push_back({to_device ? slot_bytes : home, to_device ? home : slot_bytes, sp.bytes, sp.rows, sp.pitch, zero});
  }
  if (batch.empty()) return;
  const uint64_t ticket = gpu::copies_on_side_stream(batch, device_.index, lane);
  auto& mine = to_device ? fetch_ticket_[slot] : store_ticket_[slot];
  for (size_t p = 0; p < touched.size(); ++p)
    if (touched[p]) mine[p] = ticket;
}

bool Residency::fetch(int item, const std::vector<Span>& spans) {
  CW_CHECK(item >= 0 && item < items(), "residency: no item {}", item);
  int s = slot_of_[static_cast<size_t>(item)];
  const bool was_resident = s >= 0;
  if (!was_resident) {
    s = 0;  // the least recently used slot
    for (int i = 1; i < slots(); ++i)
      if (slot_used_[static_cast<size_t>(i)] < slot_used_[static_cast<size_t>(s)]) s = i;
    if (const int old = slot_item_[static_cast<size_t>(s)]; old >= 0) slot_of_[static_cast<size_t>(old)] = -1;
    slot_item_[static_cast<size_t>(s)] = item;
    slot_of_[static_cast<size_t>(item)] = s;
  }
  slot_used_[static_cast<size_t>(s)] = ++clock_;
  move(item, spans, true);
  return was_resident;
}

void Residency::wait_for_slot(int slot, bool out) {
  const auto wait = [&](std::vector<uint64_t>& tickets) {
    for (uint64_t& t : tickets) {
      if (t != 0) gpu::wait_for_copy(t, device_.index);  // a batch's parts share a ticket: the rest return at once
      t = 0;
    }
  };
  wait(fetch_ticket_[static_cast<size_t>(slot)]);
  if (out) wait(store_ticket_[static_cast<size_t>(slot)]);
}

void Residency::ready(int item) { wait_for_item(item, /*out=*/true); }

void Residency::ready_to_read(int item) { wait_for_item(item, /*out=*/false); }

void Residency::wait_for_item(int item, bool out) {
  const int s = slot_of_[static_cast<size_t>(item)];
  CW_CHECK(s >= 0, "residency: item {} is not on the device (fetch it first)", item);
  slot_used_[static_cast<size_t>(s)] = ++clock_;
  wait_for_slot(s, out);
}

void Residency::store(int item, const std::vector<Span>& spans) {
  const int s = slot_of_[static_cast<size_t>(item)];
  CW_CHECK(s >= 0, "residency: item {} is not on the device (nothing to store)", item);
  move(item, spans, false);
}

void Residency::wait_idle() {
  if (device_.is_cpu()) return;
  gpu::synchronize(device_.index);
  gpu::wait_for_all_copies(device_.index);
}

void Residency::evict_all() {
  for (int& i : slot_of_) i = -1;
  for (int& i : slot_item_) i = -1;
}

size_t host_memory_total() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

size_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    size_t kib = 0;
    fields >> kib;
    return kib * 1024;
  }
  return 0;
}

}  // namespace cw
