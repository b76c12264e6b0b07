// A build without NCCL: the factory says so (comm_nccl.h).
#include "parallel/comm_nccl.h"

#include "engine/error.h"

namespace cw {

bool nccl_available() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(const LaunchInfo& info, int, const NcclOptions&) {
  fail(CW_FORMAT("rank {} of {}: this build of chunkwise has no NCCL", info.rank, info.world_size),
       "install NCCL (Debian: libnccl-dev) and reconfigure: meson setup --reconfigure build");
}

}  // namespace cw
