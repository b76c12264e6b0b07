// Collective communication between the ranks of a job: the one interface data and tensor parallelism
// use, with two backends behind it.
//   threads  every rank is a thread of this process, tensors in host memory (f64, f32): the exactness
//            tests run DP/TP against one process in CI. Sums are taken in rank order 0, 1, ..., n-1
//            for every element, so every rank gets the same bits whatever the threads' timing.
//   nccl     one process per GPU, tensors in device memory, the collectives on the device's compute
//            stream (or the stream named by the call); across processes and machines it is NCCL.
// Collectives (sum is the only reduction; dtypes f64, f32, bf16 where the backend has them):
//   all_reduce(t)              t <- sum over ranks of t                                     (in place)
//   reduce(t, root)            root's t <- sum over ranks of t (in place); the other ranks' t is
//                              unspecified afterwards (threads: unchanged; NCCL may use it)
//   reduce_scatter(out, in)    in [size * n] on every rank; out [n] <- sum over ranks of in[rank * n, +n)
//   all_gather(out, in)        in [n] on every rank; out [size * n], rank r's in at [r * n, +n)
//   all_to_all(out, in)        in and out [size * n] on every rank; out[src * n, +n) <- rank src's
//                              in[rank * n, +n): rank r's block for every rank delivered, in rank
//                              order (context parallelism's exchange of tokens for heads); out and
//                              in must not overlap
//   broadcast(t, root)         t <- root's t                                                (in place)
//   barrier()                  returns once every rank has entered it
//   split(color, key)          a new communicator per color: the ranks that passed the same color
//                              >= 0, ranked by key (ties by rank here); null for a negative color
//                              (as MPI_Comm_split, ncclCommSplit). Blocks until every rank has called
//                              it; the result is independent of this communicator afterwards (NCCL)
//                              or lives as long as the run_thread_ranks call (threads).
// Every tensor is contiguous; shapes and dtypes agree across ranks (checked where the backend can).
// Calls are asynchronous: each returns a CommWork whose wait() blocks the host (threads) or makes the
// compute stream wait (nccl) until the collective is complete; a CommWork destroyed unwaited waits.
// Every rank must issue the same collectives in the same order (as NCCL requires).
#pragma once

#include "engine/tensor.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace cw {

class CommWork {
 public:
  virtual ~CommWork() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;  // where its tensors live
  virtual std::string backend() const = 0;  // "threads" | "nccl"

  virtual std::unique_ptr<CommWork> all_reduce(const Tensor& t) = 0;
  virtual std::unique_ptr<CommWork> reduce(const Tensor& t, int root) = 0;
  virtual std::unique_ptr<CommWork> reduce_scatter(const Tensor& out, const Tensor& in) = 0;
  virtual std::unique_ptr<CommWork> all_gather(const Tensor& out, const Tensor& in) = 0;
  virtual std::unique_ptr<CommWork> all_to_all(const Tensor& out, const Tensor& in) = 0;
  virtual std::unique_ptr<CommWork> broadcast(const Tensor& t, int root) = 0;
  virtual void barrier() = 0;
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
};

// Sums host values over the communicator's ranks in place (through its device when it has one; rank
// order on the threads backend, so every rank gets the same bits). A collective.
void sum_host_values(Communicator& comm, std::vector<double>& values);

// Runs fn(comm) on `size` threads, one per rank of a threads-backend group, and returns when all
// have. Each rank's CPU kernels get cpu_threads() / size of the caller's threads, at least one
// (engine/engine.h), so the ranks together do not oversubscribe the cores. An exception on any rank
// is rethrown here after the others have been released (their pending and later collectives throw
// instead of waiting forever): the one that failed the group, else the lowest rank's. A mismatch
// between ranks' collectives (kind, dtype, element counts, root) and a rank that returns while
// others wait on a collective it never issued fail the group the same way.
void run_thread_ranks(int size, const std::function<void(Communicator&)>& fn);

}  // namespace cw
