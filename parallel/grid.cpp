#include "parallel/grid.h"

#include "engine/error.h"

#include <fmt/format.h>

namespace cw {

ParallelGrid::ParallelGrid(Communicator& world, int64_t dp, int64_t tp) : world_(world) {
  if (dp < 1 || tp < 1 || dp * tp != world.size())
    fail(fmt::format("parallel.dp = {} x parallel.tp = {} is {} ranks, but {} were started", dp, tp, dp * tp,
                     world.size()),
         "launch parallel.dp x parallel.tp ranks (torchrun --nproc-per-node, mpirun -np, srun --ntasks), or set "
         "parallel.dp and parallel.tp so that their product is the number launched");
  const int d = world.rank() / static_cast<int>(tp), t = world.rank() % static_cast<int>(tp);
  tp_ = world.split(d, t);
  dp_ = world.split(t, d);
}

}  // namespace cw
