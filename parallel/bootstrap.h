// The bootstrap: rank 0 hands one opaque blob (for NCCL, the 128-byte ncclUniqueId) to every other
// rank over plain TCP, before any communicator exists.
//
//   rank 0      listens on port LaunchInfo::master_port of every local address (IPv4 and IPv6
//               wildcards: MASTER_ADDR may be any of its names or addresses, and a host name that
//               resolves to a loopback address must not hide it from other machines), accepts one
//               connection per other rank, and once ALL have connected sends each the blob. So the
//               exchange is also a roll call: no rank goes on (to ncclCommInitRank, which would wait
//               for the missing one without a word) unless every rank is alive.
//   rank r > 0  connects to MASTER_ADDR:port (every address getaddrinfo gives, IPv4 or IPv6),
//               retrying until the deadline while rank 0 is not yet listening, says who it is, and
//               receives the blob.
// Wire format (integers big-endian): hello = "CWBOOT01", rank u32, world size u32; reply =
// "CWBOOT01", status u8 (0 the blob follows, 1 an error message follows), length u32, bytes.
// Connections with another greeting are dropped silently (a port scanner is no rank).
//
// Errors (cw::Error, one line each), within `timeout` of the call (a rank that has connected waits
// up to `timeout` + 1 s after connecting, to hear rank 0's own error rather than a bare timeout):
//   rank 0: the ranks that did not connect, by number, and the address; a rank that gave a
//           different world size or a rank number already taken; the port already in use. Rank 0
//           also sends its error to every rank that did connect, which fail with it.
//   rank r: rank 0 not reachable at the address (the last connect error), rank 0's error, or no
//           reply in time (rank 0 is waiting for another rank).
// World size 1 returns the blob at once without touching the network.
// Tested in tests/parallel/test_bootstrap.cpp (threads as ranks on 127.0.0.1 and ::1).
#pragma once

#include "parallel/launch.h"

#include <chrono>
#include <cstdint>
#include <vector>

namespace cw {

using Seconds = std::chrono::duration<double>;

// Every rank calls this once; rank 0 passes the blob (at most kMaxBootstrapBlob bytes), the others
// pass anything (ignored). Returns rank 0's blob on every rank.
std::vector<uint8_t> exchange_bootstrap_blob(const LaunchInfo& info, std::vector<uint8_t> blob_from_rank0,
                                             Seconds timeout);

inline constexpr size_t kMaxBootstrapBlob = 1 << 20;

// CHUNKWISE_BOOTSTRAP_TIMEOUT_S (seconds, > 0), default 300: long enough for ranks that start
// minutes apart on a busy cluster, short enough that a missing rank is reported the same coffee break.
Seconds bootstrap_timeout_from(const Environment& env);

// A positive, finite number of seconds from variable `name`, or `fallback` when unset; anything else
// is a clear error naming the variable.
Seconds seconds_from(const Environment& env, const std::string& name, Seconds fallback);

}  // namespace cw
