// The NCCL backend of the Communicator (parallel/comm.h): one process (or thread) per GPU.
//
// make_nccl_communicator(info, device, options):
//   1. makes `device` current;
//   2. rank 0 creates an ncclUniqueId; the TCP bootstrap (parallel/bootstrap.h) hands it to every rank
//      once all have connected (a rank that never comes is named there, within the bootstrap timeout);
//   3. ncclCommInitRankConfig in non-blocking mode, polled until ready within the bootstrap timeout.
//      Non-blocking because then no NCCL call can block the host indefinitely (a first collective's
//      connection setup included), and ncclCommAbort can always be called.
// Collectives run on the engine's compute stream of the device (engine.h: compute_stream), in the
// order issued; dtypes f32, bf16, f64 (sum); tensors contiguous, on this device, shapes as comm.h
// states (checked on this rank; a mismatch between ranks cannot be seen locally: it hangs, and the
// watchdog names the collective). Each returns a CommWork holding a CUDA event recorded after the
// collective: wait() makes the compute stream wait for it (the host does not block; ops issued
// later on the compute stream are ordered after it anyway) and throws if the watchdog has fired.
// barrier() is a one-element all-reduce that the host waits for. split(color, key) is ncclCommSplit,
// non-blocking too: the new communicator is polled until ready within the bootstrap timeout, and gets
// its own watchdog; it does not depend on its parent afterwards. A CommWork must not outlive its
// communicator. A collective over zero elements issues nothing (every rank has the same count).
//
// Watchdog (parallel/watchdog.h): every collective is watched from issue; one that has not finished
// within the collective timeout, or an asynchronous NCCL error (ncclCommGetAsyncError: a peer died,
// a network error), aborts the communicator (ncclCommAbort) from the watchdog thread. Then, by
// default, the process prints the error ("chunkwise: rank R of N: ...") and exits with status 1:
// the host may be anywhere (a stream sync, computing a step far from the next collective), and a
// rank that goes on with an aborted communicator only computes garbage. With exit_on_failure off
// (tests), every later call and wait() throws the error instead.
//
// Nothing CUDA- or NCCL-typed crosses this header. In a build without NCCL the factory throws a
// clear error (nccl_available() is false).
// Tested in tests/parallel/test_comm_nccl.cpp (GPU machine).
#pragma once

#include "parallel/bootstrap.h"
#include "parallel/comm.h"
#include "parallel/launch.h"
#include "parallel/watchdog.h"

#include <memory>

namespace cw {

struct NcclOptions {
  Seconds bootstrap_timeout{300};   // the id exchange and ncclCommInitRank (CHUNKWISE_BOOTSTRAP_TIMEOUT_S)
  Seconds collective_timeout{600};  // any one collective, from issue to completion (CHUNKWISE_COMM_TIMEOUT_S)
  bool exit_on_failure = true;      // the watchdog ends the process after aborting (see above)

  // The timeouts from the variables named above (unset: the defaults above).
  static NcclOptions from_environment(const Environment& env);
};

inline NcclOptions NcclOptions::from_environment(const Environment& env) {
  NcclOptions options;
  options.bootstrap_timeout = bootstrap_timeout_from(env);
  options.collective_timeout = comm_timeout_from(env);
  return options;
}

// This build has NCCL (whether a GPU is present is gpu_available(), engine/engine.h).
bool nccl_available();

// The communicator of rank info.rank of info.world_size on GPU `device` (usually info.local_rank).
// Every rank of the job calls it; it returns once all have joined.
std::unique_ptr<Communicator> make_nccl_communicator(const LaunchInfo& info, int device,
                                                     const NcclOptions& options = {});

}  // namespace cw
