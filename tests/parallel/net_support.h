// Helpers for tests that open TCP ports on this machine (the bootstrap, NCCL's world size 1).
#pragma once

#include "parallel/launch.h"

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace cw::test {

// A TCP port the kernel just handed out and released: free unless another process takes it in the
// meantime (ephemeral ports are handed out in rotation, so not right away).
inline int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  socklen_t len = sizeof(a);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Rank `rank` of `world_size` on this machine, bootstrapping at host:port.
inline LaunchInfo local_rank_info(int rank, int world_size, int port, const std::string& host = "127.0.0.1") {
  LaunchInfo info;
  info.launcher = Launcher::torchrun;
  info.rank = rank;
  info.world_size = world_size;
  info.local_rank = rank;
  info.local_world_size = world_size;
  info.master_addr = host;
  info.master_port = port;
  info.address_from = "test";
  return info;
}

}  // namespace cw::test
