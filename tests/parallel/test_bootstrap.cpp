// parallel/bootstrap.h: threads as ranks on this machine's loopback, a fresh port per case. Every
// rank must receive rank 0's exact bytes; every failure (a missing rank, no rank 0, a mismatch, a
// taken port) must be one clear error within the timeout, on rank 0 and on the ranks that came.
#include "parallel/bootstrap.h"

#include "engine/error.h"
#include "tests/parallel/net_support.h"
#include "tests/support.h"

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace cw;
using test::free_tcp_port;
using test::local_rank_info;

namespace {

using test::contains;

// How much later than its timeout a failing call may return: thread start-up and scheduling on a
// loaded two-core machine, never the order of the timeout itself.
constexpr double kLateSeconds = 2.0;

struct Outcome {
  std::vector<uint8_t> blob;
  std::string error;  // the cw::Error's text, "" on success
  double seconds = 0;
};

// Runs exchange_bootstrap_blob for each info on its own thread (after its delay) and collects what
// each got.
std::vector<Outcome> run_ranks(const std::vector<LaunchInfo>& infos, const std::vector<uint8_t>& blob, Seconds timeout,
                               const std::vector<double>& delay_s = {}) {
  std::vector<Outcome> out(infos.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < infos.size(); ++i) {
    threads.emplace_back([&, i] {
      if (i < delay_s.size()) std::this_thread::sleep_for(Seconds(delay_s[i]));
      const auto start = std::chrono::steady_clock::now();
      try {
        out[i].blob = exchange_bootstrap_blob(infos[i], infos[i].rank == 0 ? blob : std::vector<uint8_t>{}, timeout);
      } catch (const Error& e) {
        out[i].error = e.what();
      }
      out[i].seconds = Seconds(std::chrono::steady_clock::now() - start).count();
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

std::vector<uint8_t> random_blob(size_t n) {
  std::random_device seed;
  std::mt19937 rng(seed());
  std::vector<uint8_t> b(n);
  for (uint8_t& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

std::vector<LaunchInfo> world(int size, int port, const std::string& host = "127.0.0.1") {
  std::vector<LaunchInfo> infos;
  for (int r = 0; r < size; ++r) infos.push_back(local_rank_info(r, size, port, host));
  return infos;
}

}  // namespace

TEST_CASE("bootstrap: world size 1 returns the blob without touching the network") {
  const std::vector<uint8_t> blob = random_blob(128);
  // Port 1 is privileged: listening there would fail for a normal user, so success means no listen.
  CHECK(exchange_bootstrap_blob(local_rank_info(0, 1, 1), blob, Seconds(0.1)) == blob);
}

TEST_CASE("bootstrap: every rank of worlds of 2 and 4 receives rank 0's exact bytes") {
  for (const int size : {2, 4}) {
    for (const size_t bytes : {size_t{128}, size_t{0}, size_t{300000}}) {
      CAPTURE(size);
      CAPTURE(bytes);
      const std::vector<uint8_t> blob = random_blob(bytes);
      // Rank 0 last: the others retry until it listens.
      std::vector<double> delays(static_cast<size_t>(size), 0.0);
      delays[0] = 0.1;
      const std::vector<Outcome> got = run_ranks(world(size, free_tcp_port()), blob, Seconds(20), delays);
      for (int r = 0; r < size; ++r) {
        CAPTURE(r);
        CHECK(got[static_cast<size_t>(r)].error == "");
        CHECK(got[static_cast<size_t>(r)].blob == blob);
      }
    }
  }
}

TEST_CASE("bootstrap: a host name and an IPv6 address work as MASTER_ADDR") {
  const std::vector<uint8_t> blob = random_blob(128);
  std::vector<Outcome> got = run_ranks(world(3, free_tcp_port(), "localhost"), blob, Seconds(20));
  for (const Outcome& o : got) {
    CHECK(o.error == "");
    CHECK(o.blob == blob);
  }
  // ::1 only where this machine has IPv6 loopback.
  const int probe = ::socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool has_ipv6 = probe >= 0 && ::bind(probe, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  if (probe >= 0) ::close(probe);
  if (!has_ipv6) {
    MESSAGE("no IPv6 loopback on this machine: the ::1 exchange is not run");
    return;
  }
  got = run_ranks(world(2, free_tcp_port(), "::1"), blob, Seconds(20));
  for (const Outcome& o : got) {
    CHECK(o.error == "");
    CHECK(o.blob == blob);
  }
}

TEST_CASE("bootstrap: a rank that never connects fails rank 0 within the timeout, naming it") {
  const int port = free_tcp_port();
  std::vector<LaunchInfo> infos = world(4, port);
  infos.erase(infos.begin() + 2);  // rank 2 never comes
  const double timeout = 1.0;
  const std::vector<Outcome> got = run_ranks(infos, random_blob(128), Seconds(timeout));
  const std::string where = "127.0.0.1:" + std::to_string(port);
  const Outcome& rank0 = got[0];
  INFO(rank0.error);
  CHECK(contains(rank0.error, "rank 0: rank 2 of 4 did not connect to " + where));
  CHECK(contains(rank0.error, "within 1 s"));
  CHECK(rank0.seconds >= timeout);
  CHECK(rank0.seconds < timeout + kLateSeconds);
  // The ranks that came hear rank 0's reason.
  for (size_t i = 1; i < got.size(); ++i) {
    INFO(got[i].error);
    CHECK(contains(got[i].error, "the bootstrap failed on rank 0: rank 0: rank 2 of 4 did not connect"));
    CHECK(got[i].seconds < timeout + kLateSeconds);
  }
}

TEST_CASE("bootstrap: without rank 0 the other rank fails within the timeout, naming the address") {
  const int port = free_tcp_port();
  const double timeout = 0.5;
  const std::vector<Outcome> got = run_ranks({local_rank_info(1, 2, port)}, {}, Seconds(timeout));
  INFO(got[0].error);
  CHECK(contains(got[0].error, "rank 1 could not connect to rank 0 at 127.0.0.1:" + std::to_string(port)));
  CHECK(contains(got[0].error, "Connection refused"));
  CHECK(got[0].seconds >= timeout);
  CHECK(got[0].seconds < timeout + kLateSeconds);
}

TEST_CASE("bootstrap: mismatched world sizes and a rank taken twice fail every rank with the reason") {
  int port = free_tcp_port();
  std::vector<Outcome> got = run_ranks({local_rank_info(0, 2, port), local_rank_info(1, 3, port)}, random_blob(8),
                                       Seconds(10));
  for (const Outcome& o : got) {
    INFO(o.error);
    CHECK(contains(o.error, "rank 1 (from 127.0.0.1:"));
    CHECK(contains(o.error, "has world size 3, rank 0 has 2"));
  }

  port = free_tcp_port();
  got = run_ranks({local_rank_info(0, 3, port), local_rank_info(1, 3, port), local_rank_info(1, 3, port)},
                  random_blob(8), Seconds(10), {0.3, 0.0, 0.0});
  INFO(got[0].error);
  CHECK(contains(got[0].error, "rank 0: rank 1 connected twice"));
  CHECK(got[0].seconds < 10);
}

TEST_CASE("bootstrap: a stray connection is ignored, a port in use is a clear error") {
  const int port = free_tcp_port();
  const std::vector<uint8_t> blob = random_blob(128);
  std::thread stray([port] {
    // Something that is not a rank connects and talks: rank 0 drops it and keeps waiting.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
      const char request[] = "GET / HTTP/1.0\r\n\r\n";
      (void)!::send(fd, request, sizeof(request) - 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    ::close(fd);
  });
  const std::vector<Outcome> got = run_ranks(world(2, port), blob, Seconds(20), {0.0, 0.5});
  stray.join();
  for (const Outcome& o : got) {
    CHECK(o.error == "");
    CHECK(o.blob == blob);
  }

  // A port someone listens on already.
  const int holder = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  REQUIRE(::bind(holder, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(::listen(holder, 1) == 0);
  socklen_t len = sizeof(a);
  ::getsockname(holder, reinterpret_cast<sockaddr*>(&a), &len);
  const int taken = ntohs(a.sin_port);
  const std::string expected = "rank 0 cannot listen on port " + std::to_string(taken);
  CHECK_THROWS_WITH_AS(exchange_bootstrap_blob(local_rank_info(0, 2, taken), blob, Seconds(5)),
                       doctest::Contains(expected.c_str()), Error);
  ::close(holder);
}

TEST_CASE("bootstrap: timeouts from the environment") {
  CHECK(bootstrap_timeout_from(environment_from({})).count() == 300);
  CHECK(bootstrap_timeout_from(environment_from({{"CHUNKWISE_BOOTSTRAP_TIMEOUT_S", "2.5"}})).count() == 2.5);
  for (const char* bad : {"0", "-1", "abc", "1s", "inf", "nan"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(bootstrap_timeout_from(environment_from({{"CHUNKWISE_BOOTSTRAP_TIMEOUT_S", bad}})),
                         doctest::Contains("CHUNKWISE_BOOTSTRAP_TIMEOUT_S='"), Error);
  }
}
