#include "model/memory_need.h"

#include "engine/engine.h"
#include "engine/residency.h"
#include "model/layer_cast.h"
#include "model/params.h"

#include <fmt/format.h>

#include <algorithm>

namespace cw {

namespace {
uint64_t sum(const std::vector<std::pair<std::string, uint64_t>>& parts) {
  uint64_t total = 0;
  for (const auto& [part, bytes] : parts) total = checked_add(total, bytes, "memory needed");
  return total;
}

std::string list_parts(const std::vector<std::pair<std::string, uint64_t>>& parts) {
  std::string s;
  for (const auto& [part, bytes] : parts)
    s += fmt::format("{}{} {}", s.empty() ? "" : ", ", part, format_bytes(static_cast<double>(bytes)));
  return s;
}

// One memory against one need: `where` ("host memory"), the holder ("the host", "cuda:0") and its
// available and total bytes (0: unknown).
void require_one(uint64_t need, const std::vector<std::pair<std::string, uint64_t>>& parts, const char* where,
                 const std::string& holder, const char* available_word, size_t available, size_t total,
                 const MemorySubject& s) {
  const size_t have = s.against_total ? total : available;
  if (have == 0 || need <= have) return;
  const std::string has =
      s.against_total ? fmt::format("{} in all", format_bytes(double(total)))
                      : fmt::format("{} {} ({} in all)", format_bytes(double(available)), available_word,
                                    format_bytes(double(total)));
  fail(fmt::format("{}: {} parameters need {} of {} {} ({}) and {} has {}", s.model, format_count(s.parameters),
                   format_bytes(double(need)), where, s.task, list_parts(parts), holder, has),
       s.advice);
}
}  // namespace

uint64_t checked_mul(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  CW_CHECK(!__builtin_mul_overflow(a, b, &r), "{}: {} x {} passes 2^64", what, a, b);
  return r;
}

uint64_t checked_add(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  CW_CHECK(!__builtin_add_overflow(a, b, &r), "{}: {} + {} passes 2^64", what, a, b);
  return r;
}

uint64_t param_bytes(const std::vector<ParamSpec>& table, DType dtype) {
  uint64_t numel = 0;
  for (const ParamSpec& s : table) {
    uint64_t n = 1;
    for (const int64_t d : s.shape) {
      CW_CHECK(d >= 0, "parameter '{}' has a negative dimension {}", s.name, d);
      n = checked_mul(n, static_cast<uint64_t>(d), "parameter elements");
    }
    numel = checked_add(numel, n, "parameter elements");
  }
  return checked_mul(numel, dtype_size(dtype), "parameter bytes");
}

size_t usable_device_memory(Device device) {
  const size_t free = device_memory(device).free, limit = device_memory_limit(device);
  return limit > 0 ? std::min(free, limit) : free;
}

void MemoryNeed::add(Device where, const std::string& part, uint64_t bytes) {
  (where.is_cpu() ? host : device).emplace_back(part, bytes);
}

void MemoryNeed::repeat(int64_t copies) {
  CW_CHECK(copies >= 1, "MemoryNeed::repeat: {} copies", copies);
  for (auto* parts : {&host, &device})
    for (auto& [part, bytes] : *parts) bytes = checked_mul(bytes, static_cast<uint64_t>(copies), "memory needed");
}

uint64_t MemoryNeed::host_bytes() const { return sum(host); }
uint64_t MemoryNeed::device_bytes() const { return sum(device); }

uint64_t model_weight_bytes(const LlamaConfig& config, DType dtype, const LoraConfig& lora, bool cast_layers) {
  // LlamaModel's constructor: its base set (with cast_layers the tensors outside the blocks), its
  // adapters' set, and LayerCast's slots of one block each.
  const std::vector<ParamSpec> table = parameter_table(config);
  uint64_t bytes = param_bytes(cast_layers ? outside_blocks(table) : table, dtype);
  if (lora.enabled()) bytes = checked_add(bytes, param_bytes(lora_parameter_table(config, lora), dtype), "weights");
  if (cast_layers) {
    std::vector<ParamSpec> block;
    for (const ParamSpec& s : table)
      if (s.layer == 0) block.push_back(s);
    bytes = checked_add(bytes, checked_mul(LayerCast::kSlots, param_bytes(block, dtype), "weights"), "weights");
  }
  return bytes;
}

MemoryNeed model_memory_need(const LlamaConfig& config, DType host_dtype, Device device, DType dtype) {
  MemoryNeed need;
  need.add(Device::host(), fmt::format("{} weights", dtype_name(host_dtype)), model_weight_bytes(config, host_dtype));
  if (!device.is_cpu()) need.add(device, fmt::format("{} weights", dtype_name(dtype)), model_weight_bytes(config, dtype));
  return need;
}

void require_memory(const MemoryNeed& need, Device device, const MemorySubject& subject) {
  if (!device.is_cpu() && !need.device.empty()) {
    const DeviceMemory m = device_memory(device);
    require_one(need.device_bytes(), need.device, "device memory", device_name(device), "free",
                usable_device_memory(device), m.total, subject);
  }
  if (!need.host.empty())
    require_one(need.host_bytes(), need.host, "host memory", "the host", "available", host_memory_available(),
                host_memory_total(), subject);
}

std::string format_bytes(double b) {
  if (b >= double(1ull << 40)) return fmt::format("{:.2f} TiB", b / double(1ull << 40));
  if (b >= double(1ull << 30)) return fmt::format("{:.2f} GiB", b / double(1ull << 30));
  return fmt::format("{:.1f} MiB", b / double(1 << 20));
}

std::string format_count(int64_t n) {
  const double x = static_cast<double>(n);
  if (x >= 1e12) return fmt::format("{:.2f} trillion", x / 1e12);
  if (x >= 1e9) return fmt::format("{:.2f} billion", x / 1e9);
  if (x >= 1e6) return fmt::format("{:.1f} million", x / 1e6);
  return fmt::format("{}", n);
}

}  // namespace cw
