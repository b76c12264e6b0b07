// What a model's parameter sets take, set against the machine's memory before any is allocated.
//
// Loading, initialising or training a model allocates its parameter sets whole (model/params.h): the
// compute weights, and to train also master weights, gradients and AdamW's moments
// (optim/training.h TrainingState::memory_need). A config that asks for more than the host or the GPU
// has would otherwise end in the allocator's out-of-memory error, whose hint (a shorter sequence, a
// smaller batch) does not apply to it. require_memory refuses it first, in one line naming the model
// as the user gave it, its parameters, the bytes by part and the memory there is, with what to do.
// The byte counts are 64-bit and overflow-checked (engine/memory.h): they come from a user's config.
#pragma once

#include "engine/tensor.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/params.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace cw {

// Byte counts from sizes a user hands in: a product or sum past 2^64 fails, naming `what`, instead of
// wrapping into a small count.
uint64_t checked_mul(uint64_t a, uint64_t b, const char* what);
uint64_t checked_add(uint64_t a, uint64_t b, const char* what);

// The bytes a ParamSet of `table` in `dtype` allocates (its one buffer: ParamSet's constructor sizes
// it with this), overflow-checked.
uint64_t param_bytes(const std::vector<ParamSpec>& table, DType dtype);

// The bytes a run may still take on a GPU: what the driver has free, under the caching pool's limit
// when one is set (engine.h set_device_memory_limit: train.device_memory, --device-memory).
size_t usable_device_memory(Device device);

struct MemoryNeed {
  // Bytes by part ("f32 weights", "f32 gradients", ...), in the order the error lists them: in host
  // memory, and in the device's (empty on the CPU).
  std::vector<std::pair<std::string, uint64_t>> host, device;
  // Adds `bytes` of `part` where they live (the host's list when `where` is the CPU).
  void add(Device where, const std::string& part, uint64_t bytes);
  // Every part `copies` times over (thread ranks of one process, each with its own state).
  void repeat(int64_t copies);
  uint64_t host_bytes() const;
  uint64_t device_bytes() const;
};

// The bytes a LlamaModel of these arguments allocates for its parameter sets, all on its device:
// the compute weights (with cast_layers those outside the blocks and LayerCast's slots) and the
// adapters. tests/model/test_memory_need.cpp holds it to what a model allocates.
uint64_t model_weight_bytes(const LlamaConfig& config, DType dtype, const LoraConfig& lora = {},
                            bool cast_layers = false);

// What a command that runs a model (sample, eval, logits, init, merge) allocates for it: the weights
// read on the host in `host_dtype`, and on a GPU also their compute copy there in `dtype`.
MemoryNeed model_memory_need(const LlamaConfig& config, DType host_dtype, Device device, DType dtype);

struct MemorySubject {
  std::string model;        // the model as the user gave it: "model 'x/config.json'", "model.source 'x'"
  int64_t parameters = 0;   // the whole model's (not a tensor-parallel rank's)
  std::string task;         // what the bytes are for: "to train", "to load"
  std::string advice;       // what to do instead
  // Against the memory the machine has in all, not what is available now: with the user's check
  // turned off (train.memory_check = false) what no state of the machine holds is still refused.
  bool against_total = false;
};

// Fails when `need` passes the memory of `device` (free, under the caching pool's limit) or of the
// host (available: MemAvailable), the device first; the message names the subject, the parameters,
// the bytes by part and the memory, the hint is subject.advice. A memory the machine does not report
// (0) is not checked.
void require_memory(const MemoryNeed& need, Device device, const MemorySubject& subject);

// "512.0 MiB", "2.30 GiB", "11.61 TiB".
std::string format_bytes(double bytes);
// "135.0 million", "8.03 billion", "3.18 trillion" (below a million: the number).
std::string format_count(int64_t count);

}  // namespace cw
