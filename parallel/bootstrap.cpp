// The bootstrap exchange over TCP (contract and wire format in bootstrap.h).
//
// Every socket is non-blocking and every wait is a poll() bounded by the one deadline of the call,
// so no step (connect, accept, send, receive) can outlive the timeout.
#include "parallel/bootstrap.h"

#include "engine/error.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

namespace cw {

Seconds seconds_from(const Environment& env, const std::string& name, Seconds fallback) {
  const std::optional<std::string> v = env(name);
  if (!v || v->empty()) return fallback;
  char* end = nullptr;
  const double s = std::strtod(v->c_str(), &end);
  if (end != v->c_str() + v->size() || !std::isfinite(s) || s <= 0)
    fail(CW_FORMAT("environment variable {}='{}' is not a positive number of seconds", name, *v),
         CW_FORMAT("unset it for the default ({} s)", fallback.count()));
  return Seconds(s);
}

Seconds bootstrap_timeout_from(const Environment& env) {
  return seconds_from(env, "CHUNKWISE_BOOTSTRAP_TIMEOUT_S", Seconds(300));
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::array<uint8_t, 8> kMagic = {'C', 'W', 'B', 'O', 'O', 'T', '0', '1'};
constexpr size_t kHelloBytes = 8 + 4 + 4;
constexpr size_t kReplyHeaderBytes = 8 + 1 + 4;
constexpr uint8_t kStatusBlob = 0, kStatusError = 1;

std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

// A socket descriptor, closed when dropped.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { reset(); }
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Milliseconds left until the deadline for poll(), rounded up so a poll never returns just early.
int ms_until(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

// Waits for `events` on fd until the deadline: true when ready, false on timeout.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, ms_until(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return true;  // let the following call report the error
  }
}

enum class Io { ok, timeout, closed, failed };

// Sends all n bytes before the deadline (MSG_NOSIGNAL: a peer gone away is an error, not SIGPIPE).
Io send_all(int fd, const uint8_t* p, size_t n, Clock::time_point deadline, int& error) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_for(fd, POLLOUT, deadline)) return Io::timeout;
    } else {
      error = errno;
      return Io::failed;
    }
  }
  return Io::ok;
}

// Receives exactly n bytes before the deadline.
Io receive_exact(int fd, uint8_t* p, size_t n, Clock::time_point deadline, int& error) {
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k == 0) {
      return Io::closed;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!wait_for(fd, POLLIN, deadline)) return Io::timeout;
    } else {
      error = errno;
      return Io::failed;
    }
  }
  return Io::ok;
}

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (24 - 8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | p[i];
  return v;
}

// The numeric address of a connected peer, for messages.
std::string peer_name(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    ::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof(host), port, sizeof(port),
                  NI_NUMERICHOST | NI_NUMERICSERV);
  return host_port(host, std::atoi(port));
}

std::string seconds_text(Seconds s) { return CW_FORMAT("{} s", s.count()); }

std::string where(const LaunchInfo& info) {
  return CW_FORMAT("{} ({})", host_port(info.master_addr, info.master_port), info.address_from);
}

std::vector<uint8_t> reply_bytes(uint8_t status, const uint8_t* payload, size_t n) {
  std::vector<uint8_t> out(kReplyHeaderBytes + n);
  std::copy(kMagic.begin(), kMagic.end(), out.begin());
  out[8] = status;
  put_u32(out.data() + 9, static_cast<uint32_t>(n));
  std::copy(payload, payload + n, out.begin() + kReplyHeaderBytes);
  return out;
}

// ---- rank 0 ----

// Listening sockets on the port for every wildcard address getaddrinfo offers (IPv4 and IPv6; the
// IPv6 one IPv6-only, so the two never collide).
std::vector<Socket> listen_everywhere(const LaunchInfo& info) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(info.master_port);
  const int rc = ::getaddrinfo(nullptr, port.c_str(), &hints, &found);
  CW_CHECK(rc == 0, "rank 0: no local address for port {}: {}", info.master_port, ::gai_strerror(rc));
  // Freed however the loop ends (a port in use throws from inside it).
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
  std::vector<Socket> listeners;
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (!s.valid()) {
      last_error = errno_text(errno);  // e.g. IPv6 disabled on this machine
      continue;
    }
    const int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // a restarted job reuses its port
    if (a->ai_family == AF_INET6) ::setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0) {
      const int e = errno;
      if (e == EADDRINUSE)
        fail(CW_FORMAT("rank 0 cannot listen on port {} ({}): it is already in use", info.master_port,
                       info.address_from),
             "another job or a rank of an earlier run holds it: choose a free port with MASTER_PORT "
             "(or CHUNKWISE_MASTER_PORT), or end the old processes");
      last_error = errno_text(e);
      continue;
    }
    if (::listen(s.fd(), SOMAXCONN) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    listeners.push_back(std::move(s));
  }
  if (listeners.empty())
    fail(CW_FORMAT("rank 0 cannot listen on port {}: {}", info.master_port, last_error),
         "choose another port with MASTER_PORT (or CHUNKWISE_MASTER_PORT)");
  return listeners;
}

// A connection accepted but not yet identified: its hello arrives in pieces.
struct Newcomer {
  Socket socket;
  std::array<uint8_t, kHelloBytes> hello{};
  size_t received = 0;
};

std::vector<uint8_t> serve_blob(const LaunchInfo& info, const std::vector<uint8_t>& blob, Seconds timeout) {
  CW_CHECK_HINT(blob.size() <= kMaxBootstrapBlob, "the bootstrap carries ids and addresses, not data",
                "bootstrap blob of {} bytes exceeds the limit of {}", blob.size(), kMaxBootstrapBlob);
  const Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
  const std::vector<Socket> listeners = listen_everywhere(info);
  std::vector<Socket> ranks(static_cast<size_t>(info.world_size));  // by rank; [0] stays empty
  std::vector<Newcomer> newcomers;
  int joined = 0;

  // Tells every connected rank (and the newcomer that caused it, if any) why the bootstrap failed,
  // briefly (they may be gone), then throws.
  const auto fail_all = [&](const std::string& message, const std::string& hint, const Socket* newcomer = nullptr) {
    const std::vector<uint8_t> reply =
        reply_bytes(kStatusError, reinterpret_cast<const uint8_t*>(message.data()), message.size());
    const Clock::time_point give_up = std::min(deadline, Clock::now()) + std::chrono::seconds(1);
    int error = 0;
    for (const Socket& s : ranks)
      if (s.valid()) send_all(s.fd(), reply.data(), reply.size(), give_up, error);
    if (newcomer != nullptr) send_all(newcomer->fd(), reply.data(), reply.size(), give_up, error);
    fail(message, hint);
  };

  while (joined < info.world_size - 1) {
    if (Clock::now() >= deadline) {
      std::string missing;
      int count = 0;
      for (int r = 1; r < info.world_size; ++r) {
        if (ranks[static_cast<size_t>(r)].valid()) continue;
        if (++count <= 16) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      if (count > 16) missing += CW_FORMAT(" and {} more", count - 16);
      fail_all(CW_FORMAT("rank 0: {} {} of {} did not connect to {} within {}", count == 1 ? "rank" : "ranks",
                         missing, info.world_size, where(info), seconds_text(timeout)),
               "start every rank with the same MASTER_ADDR, MASTER_PORT and world size; a rank that failed at "
               "start says why in its own output; CHUNKWISE_BOOTSTRAP_TIMEOUT_S sets the wait");
    }
    std::vector<pollfd> fds;
    for (const Socket& l : listeners) fds.push_back({l.fd(), POLLIN, 0});
    for (const Newcomer& n : newcomers) fds.push_back({n.socket.fd(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), ms_until(deadline)) < 0 && errno != EINTR)
      fail_all(CW_FORMAT("rank 0: poll failed: {}", errno_text(errno)), "");

    const size_t polled = newcomers.size();  // those accepted below were not polled yet
    for (size_t i = 0; i < listeners.size(); ++i) {
      if (!(fds[i].revents & POLLIN)) continue;
      for (;;) {  // every connection waiting on this listener
        const int fd = ::accept4(listeners[i].fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        newcomers.push_back({Socket(fd)});
      }
    }
    for (size_t i = 0; i < polled; ++i) {
      if (!(fds[listeners.size() + i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Newcomer& n = newcomers[i];
      const ssize_t k = ::recv(n.socket.fd(), n.hello.data() + n.received, kHelloBytes - n.received, 0);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        n.socket.reset();  // gone before saying who it was
        continue;
      }
      if (k < 0) continue;
      n.received += static_cast<size_t>(k);
      if (n.received < kHelloBytes) continue;
      if (!std::equal(kMagic.begin(), kMagic.end(), n.hello.begin())) {
        n.socket.reset();  // not one of ours
        continue;
      }
      const uint32_t rank = get_u32(n.hello.data() + 8), size = get_u32(n.hello.data() + 12);
      const std::string from = peer_name(n.socket.fd());
      if (size != static_cast<uint32_t>(info.world_size))
        fail_all(CW_FORMAT("rank 0: rank {} (from {}) has world size {}, rank 0 has {}", rank, from, size,
                           info.world_size),
                 "every rank must be started with the same world size", &n.socket);
      if (rank == 0 || rank >= size)
        fail_all(CW_FORMAT("rank 0: a process at {} claims rank {} of {}", from, rank, size),
                 "ranks other than 0 connect to rank 0; check the launcher's rank variables", &n.socket);
      if (ranks[rank].valid())
        fail_all(CW_FORMAT("rank 0: rank {} connected twice (from {} and {})", rank, peer_name(ranks[rank].fd()), from),
                 "two processes have the same rank: check the launcher's rank variables, or an earlier run "
                 "still running with the same MASTER_PORT",
                 &n.socket);
      ranks[rank] = std::move(n.socket);
      ++joined;
    }
    std::erase_if(newcomers, [](const Newcomer& n) { return !n.socket.valid(); });
  }

  // Everyone is here: the blob to each.
  const std::vector<uint8_t> reply = reply_bytes(kStatusBlob, blob.data(), blob.size());
  for (int r = 1; r < info.world_size; ++r) {
    int error = 0;
    const Io io = send_all(ranks[static_cast<size_t>(r)].fd(), reply.data(), reply.size(), deadline, error);
    if (io != Io::ok)
      fail_all(CW_FORMAT("rank 0: could not send the bootstrap data to rank {}: {}", r,
                         io == Io::timeout ? "timed out" : errno_text(error)),
               "the rank went away after connecting: its own output says why");
  }
  return blob;
}

// ---- ranks 1 .. n-1 ----

// One non-blocking connect to one address, waiting at most until `give_up`.
Socket try_connect(const addrinfo& a, Clock::time_point give_up, std::string& error) {
  Socket s(::socket(a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a.ai_protocol));
  if (!s.valid()) {
    error = errno_text(errno);
    return {};
  }
  if (::connect(s.fd(), a.ai_addr, a.ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      error = errno_text(errno);
      return {};
    }
    if (!wait_for(s.fd(), POLLOUT, give_up)) {
      error = "connect timed out";
      return {};
    }
    int so_error = 0;
    socklen_t len = sizeof(so_error);
    ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &so_error, &len);
    if (so_error != 0) {
      error = errno_text(so_error);
      return {};
    }
  }
  return s;
}

std::vector<uint8_t> receive_blob(const LaunchInfo& info, Seconds timeout) {
  const Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
  const std::string port = std::to_string(info.master_port);
  std::string last_error = "no attempt";
  Socket s;
  auto pause = std::chrono::milliseconds(20);
  while (!s.valid()) {
    if (Clock::now() >= deadline)
      fail(CW_FORMAT("rank {} could not connect to rank 0 at {} within {} (last error: {})", info.rank, where(info),
                     seconds_text(timeout), last_error),
           "start rank 0 too, with the same MASTER_ADDR and MASTER_PORT; check that rank 0's host is reachable "
           "from this one on that port; CHUNKWISE_BOOTSTRAP_TIMEOUT_S sets the wait");
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(info.master_addr.c_str(), port.c_str(), &hints, &found);
    if (rc == EAI_NONAME || rc == EAI_FAMILY || rc == EAI_SERVICE)
      fail(CW_FORMAT("rank {}: the bootstrap address '{}' ({}) does not resolve: {}", info.rank, info.master_addr,
                     info.address_from, ::gai_strerror(rc)),
           "set MASTER_ADDR to the host name or IP address of rank 0's machine");
    if (rc != 0) {
      last_error = ::gai_strerror(rc);  // a temporary name-service failure: try again
    } else {
      for (addrinfo* a = found; a != nullptr && !s.valid(); a = a->ai_next)
        s = try_connect(*a, std::min(deadline, Clock::now() + std::chrono::seconds(5)), last_error);
      ::freeaddrinfo(found);
    }
    if (!s.valid()) {  // rank 0 is not listening yet: back off, up to a second between tries
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, std::max<Clock::duration>(deadline - Clock::now(), {})));
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
  }

  // Connected, so rank 0 is listening and its own deadline is at most `timeout` away: it answers
  // by then with the blob or its error. Waiting that long (and a second for the message to travel)
  // rather than to this call's deadline lets rank 0's reason reach every rank that came.
  const Clock::time_point reply_deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout) + std::chrono::seconds(1);
  std::array<uint8_t, kHelloBytes> hello{};
  std::copy(kMagic.begin(), kMagic.end(), hello.begin());
  put_u32(hello.data() + 8, static_cast<uint32_t>(info.rank));
  put_u32(hello.data() + 12, static_cast<uint32_t>(info.world_size));
  int error = 0;
  std::array<uint8_t, kReplyHeaderBytes> header{};
  Io io = send_all(s.fd(), hello.data(), hello.size(), reply_deadline, error);
  if (io == Io::ok) io = receive_exact(s.fd(), header.data(), header.size(), reply_deadline, error);
  const auto check_io = [&](Io result) {
    if (result == Io::timeout)
      fail(CW_FORMAT("rank {} reached rank 0 at {} but got no bootstrap data within {}", info.rank, where(info),
                     seconds_text(timeout)),
           "rank 0 answers once every rank has connected, so another rank is missing: rank 0's error names it");
    if (result != Io::ok)
      fail(CW_FORMAT("rank {}: rank 0 at {} dropped the bootstrap connection ({})", info.rank, where(info),
                     result == Io::closed ? "closed" : errno_text(error)),
           "rank 0 failed or refused this rank: its own output says why");
  };
  check_io(io);
  const uint32_t length = get_u32(header.data() + 9);
  CW_CHECK_HINT(std::equal(kMagic.begin(), kMagic.end(), header.begin()) && length <= kMaxBootstrapBlob &&
                    (header[8] == kStatusBlob || header[8] == kStatusError),
                "MASTER_ADDR/MASTER_PORT may name another service: check them",
                "rank {}: the reply from {} is not a chunkwise bootstrap reply", info.rank, where(info));
  std::vector<uint8_t> payload(length);
  check_io(receive_exact(s.fd(), payload.data(), payload.size(), reply_deadline, error));
  if (header[8] == kStatusError)
    fail(CW_FORMAT("rank {}: the bootstrap failed on rank 0: {}", info.rank, std::string(payload.begin(), payload.end())),
         "rank 0's output has the details");
  return payload;
}

}  // namespace

std::vector<uint8_t> exchange_bootstrap_blob(const LaunchInfo& info, std::vector<uint8_t> blob_from_rank0,
                                             Seconds timeout) {
  CW_CHECK(info.world_size >= 1 && info.rank >= 0 && info.rank < info.world_size,
           "bootstrap: rank {} of world size {} is not a rank", info.rank, info.world_size);
  CW_CHECK(timeout.count() > 0, "bootstrap: the timeout must be positive, not {} s", timeout.count());
  if (info.world_size == 1) return blob_from_rank0;
  if (info.rank == 0) return serve_blob(info, blob_from_rank0, timeout);
  return receive_blob(info, timeout);
}

}  // namespace cw
