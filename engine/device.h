// chunkwise engine: what compute devices this build and this machine have.
#pragma once

#include <string>
#include <vector>

namespace cw {

struct BuildFeatures {
  bool cuda, cudnn, nccl;
};
BuildFeatures build_features();

struct GpuInfo {
  int index;
  std::string name;
  int sm_major, sm_minor, multiprocessors;
  size_t memory_bytes;
};
// The GPUs the CUDA runtime sees; empty in a CPU-only build or on a machine without a GPU.
std::vector<GpuInfo> list_gpus();
// One line per device, starting with the CPU; used by `chunkwise devices` and test skip messages.
std::string describe_devices();

}  // namespace cw
