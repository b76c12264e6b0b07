// Lists the GPUs the CUDA runtime sees. A machine with the driver but no GPU (the development
// machines) answers "no device", which is not an error here: the build is CPU-only in effect.
#include "engine/engine.h"

#include <cuda_runtime.h>

namespace cw {

std::vector<GpuInfo> cuda_list_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return {};
  }
  std::vector<GpuInfo> gpus;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    gpus.push_back({i, p.name, p.major, p.minor, p.multiProcessorCount, p.totalGlobalMem});
  }
  return gpus;
}

}  // namespace cw
