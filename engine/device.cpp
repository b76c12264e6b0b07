#include "engine/device.h"

#include "chunkwise_config.h"

#include <fmt/format.h>

#include <thread>

namespace cw {

#if CW_HAVE_CUDA
std::vector<GpuInfo> cuda_list_gpus();  // engine/cuda/device_query.cu
#endif

BuildFeatures build_features() { return {CW_HAVE_CUDA != 0, CW_HAVE_CUDNN != 0, CW_HAVE_NCCL != 0}; }

std::vector<GpuInfo> list_gpus() {
#if CW_HAVE_CUDA
  return cuda_list_gpus();
#else
  return {};
#endif
}

std::string describe_devices() {
  const BuildFeatures f = build_features();
  std::string s = fmt::format("build: cuda={} cudnn={} nccl={}\ncpu: {} hardware threads\n", f.cuda, f.cudnn, f.nccl,
                              std::thread::hardware_concurrency());
  for (const GpuInfo& g : list_gpus())
    s += fmt::format("cuda:{}: {} (sm_{}{}, {} SMs, {:.1f} GiB)\n", g.index, g.name, g.sm_major, g.sm_minor,
                     g.multiprocessors, static_cast<double>(g.memory_bytes) / (1ull << 30));
  return s;
}

}  // namespace cw
